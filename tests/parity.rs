//! Parity with Hugging Face transformers: every tiny reference checkpoint, at every valid
//! tp in {1, 2, 4, 8}, reproduces HF's prefill logits (relative error ≤ 1e-4) and greedy
//! continuation exactly. References come from `scripts/make_fixtures.py`.

mod common;
use common::fixtures;

use safetensors::SafeTensors;
use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::generate::RunOptions;
use tpc::runtime::launch::run;
use tpc::runtime::weights::Checkpoint;

/// The one tolerance for f32 parity: ‖a − b‖ / ‖b‖ over all prompt logits.
const REL_TOL: f64 = 1e-4;

struct Reference {
    prompt: Vec<i64>,
    logits: Vec<f32>,
    greedy: Vec<i64>,
}

fn read_reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let i64s = |name: &str| -> Vec<i64> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Reference {
        prompt: i64s("prompt_ids"),
        logits,
        greedy: i64s("greedy_ids"),
    }
}

fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn every_fixture_matches_hf_at_every_valid_tp() {
    let mut report = Vec::new();
    for dir in fixtures() {
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut ran = 0;
        for tp in [1u64, 2, 4, 8] {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            ran += 1;
            let opts = RunOptions {
                max_new_tokens: reference.greedy.len(),
                ..Default::default()
            };
            let out = run(&compiled.plan, &ckpt, &reference.prompt, &opts).unwrap();
            let err = rel_error(&out.prompt_logits.data, &reference.logits);
            report.push(format!("{} tp={tp}: rel err {err:.2e}", dir.display()));
            assert!(
                err <= REL_TOL,
                "{} tp={tp}: relative error {err:.3e} > {REL_TOL}",
                dir.display()
            );
            assert_eq!(
                out.generated,
                reference.greedy,
                "{} tp={tp}: greedy tokens",
                dir.display()
            );
        }
        assert!(ran >= 3, "{}: only {ran} tp values ran", dir.display());
    }
    eprintln!("{}", report.join("\n"));
}

/// The bf16 compute tolerance: linear weights rounded to bf16 (8 mantissa bits), f32
/// activations and accumulation, against HF's f32 logits of the f32 checkpoint.
const BF16_REL_TOL: f64 = 3e-2;

#[test]
fn bf16_compute_stays_within_its_tolerance() {
    use tpc::runtime::generate::ComputeDtype;
    let mut report = Vec::new();
    for dir in fixtures() {
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for tp in [1u64, 2] {
            let plan = compile(&def, tp).unwrap().plan;
            let opts = RunOptions {
                dtype: ComputeDtype::Bf16,
                max_new_tokens: 1,
                ..Default::default()
            };
            let out = run(&plan, &ckpt, &reference.prompt, &opts).unwrap();
            let err = rel_error(&out.prompt_logits.data, &reference.logits);
            report.push(format!("{} tp={tp} bf16: rel err {err:.2e}", dir.display()));
            assert!(
                err <= BF16_REL_TOL,
                "{} tp={tp}: bf16 relative error {err:.3e} > {BF16_REL_TOL}",
                dir.display()
            );
            if dir.ends_with("llama-bf16") {
                // Its weights are bf16 already: keeping them bf16 loses nothing.
                assert!(err <= REL_TOL, "{} tp={tp}: {err:.3e}", dir.display());
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}
