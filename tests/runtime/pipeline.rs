//! Pipeline stages (`--pp`): every reference checkpoint run as pipeline stages of tensor-
//! parallel ranks reproduces tp=1 (≤ 1e-5 relative, the same greedy tokens) and HF's
//! logits, bit for bit the run of the same tp without stages (a stage runs its layers'
//! ops of the tp program, in order); batches, sampling and data-parallel replicas pass
//! through the stages unchanged.

use crate::common;
use common::{fixtures, read_reference, rel_error};

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::frontend::ModelDef;
use tpc::pipeline::{compile, split_stages};
use tpc::runtime::generate::{Request, RunOptions};
use tpc::runtime::random::RandomWeights;
use tpc::runtime::replicas::run_replicas;
use tpc::runtime::run::{run, run_batch};
use tpc::runtime::sampling::Sampling;
use tpc::runtime::weights::Checkpoint;

/// Pipelined against tp=1: relative error of the prompt logits.
const PP_REL_TOL: f64 = 1e-5;
/// Against HF's f32 logits (as parity.rs).
const HF_REL_TOL: f64 = 1e-4;

fn exact() -> RunOptions {
    RunOptions {
        device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
            isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn staged(def: &ModelDef, tp: u64, pp: u64, layers: Option<&[u64]>) -> tpc::plan::Plan {
    let mut plan = compile(def, tp).unwrap().plan;
    split_stages(&mut plan, pp, layers).unwrap();
    assert_eq!(plan.pp() as u64, pp);
    plan
}

#[test]
fn every_fixture_through_pipeline_stages_matches_tp1_and_hf() {
    let mut report = Vec::new();
    for dir in fixtures() {
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let opts = RunOptions {
            max_new_tokens: reference.greedy.len(),
            ..exact()
        };
        let one = run(
            &compile(&def, 1).unwrap().plan,
            &ckpt,
            &reference.prompt,
            &opts,
        )
        .unwrap();
        let mut ran = 0;
        for (tp, pp) in [(1u64, 2u64), (2, 2), (1, 4)] {
            let Ok(flat) = compile(&def, tp) else {
                continue;
            };
            let mut plan = flat.plan.clone();
            if split_stages(&mut plan, pp, None).is_err() {
                // More stages than the fixture's layers.
                continue;
            }
            ran += 1;
            let out = run(&plan, &ckpt, &reference.prompt, &opts).unwrap();
            let err = rel_error(&out.prompt_logits.data, &one.prompt_logits.data);
            let hf = rel_error(&out.prompt_logits.data, &reference.logits);
            report.push(format!(
                "{} tp={tp} pp={pp}: vs tp=1 {err:.2e}, vs HF {hf:.2e}",
                dir.display()
            ));
            assert!(
                err <= PP_REL_TOL,
                "{} tp={tp} pp={pp}: {err:.3e}",
                dir.display()
            );
            assert!(
                hf <= HF_REL_TOL,
                "{} tp={tp} pp={pp}: {hf:.3e}",
                dir.display()
            );
            assert_eq!(
                out.generated,
                reference.greedy,
                "{} tp={tp} pp={pp}",
                dir.display()
            );
            assert_eq!(out.generated, one.generated);
            // The same ops in the same order as the tp program: the same bits.
            let same_tp = run(&flat.plan, &ckpt, &reference.prompt, &opts).unwrap();
            assert_eq!(
                out.prompt_logits,
                same_tp.prompt_logits,
                "{}",
                dir.display()
            );
        }
        assert!(ran >= 2, "{}: only {ran} (tp, pp) ran", dir.display());
    }
    eprintln!("{}", report.join("\n"));
}

/// Four stages need four layers: the tiny Llama preset with four, on seeded random weights.
#[test]
fn four_stages_of_a_four_layer_model_match_one_rank() {
    let mut def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    let ModelDef::Preset(p) = &mut def else {
        panic!("a preset")
    };
    p.num_hidden_layers = 4;
    let weights = RandomWeights::new(&compile(&def, 1).unwrap().plan, 5);
    let prompt = [3i64, 17, 99, 4, 250 - 1, 8];
    let opts = RunOptions {
        max_new_tokens: 6,
        ..exact()
    };
    let one = run(&compile(&def, 1).unwrap().plan, &weights, &prompt, &opts).unwrap();
    for (tp, pp, layers) in [
        (1u64, 4u64, None),
        (2, 4, None),
        (1, 2, Some(&[1u64, 3][..])),
        (4, 3, Some(&[2, 1, 1][..])),
    ] {
        let plan = staged(&def, tp, pp, layers);
        let out = run(&plan, &weights, &prompt, &opts).unwrap();
        let err = rel_error(&out.prompt_logits.data, &one.prompt_logits.data);
        assert!(err <= PP_REL_TOL, "tp={tp} pp={pp}: {err:.3e}");
        assert_eq!(out.generated, one.generated, "tp={tp} pp={pp}");
    }
}

fn requests() -> Vec<Request> {
    [
        (vec![3i64, 71, 249, 130, 12, 188, 64], Some(9)),
        (vec![5, 9], Some(3)),
        (vec![200, 1, 2, 3], None),
        (vec![7], Some(0)),
        (vec![44, 45, 46], Some(12)),
    ]
    .into_iter()
    .map(|(prompt, max_new_tokens)| Request {
        prompt,
        max_new_tokens,
    })
    .collect()
}

/// Ragged batches with their own limits (one of 0), an EOS, greedy, full sampling and
/// top-k: the stages see the same forward calls as the last stage decides them.
#[test]
fn batches_and_sampling_pass_through_the_stages() {
    let dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let requests = requests();
    let flat = compile(&def, 2).unwrap().plan;
    let plan = staged(&def, 2, 2, None);
    let tiny = staged(&def, 1, 2, None);
    for sampling in [
        Sampling::default(),
        Sampling {
            temperature: 0.9,
            seed: 11,
            ..Default::default()
        },
        Sampling {
            temperature: 0.8,
            top_k: Some(5),
            top_p: Some(0.9),
            seed: 3,
        },
    ] {
        let opts = RunOptions {
            max_new_tokens: 7,
            sampling: sampling.clone(),
            eos: vec![188],
            ..exact()
        };
        let want = run_batch(&flat, &ckpt, &requests, &opts).unwrap();
        for p in [&plan, &tiny] {
            let got = run_batch(p, &ckpt, &requests, &opts).unwrap();
            for (g, w) in got.sequences.iter().zip(&want.sequences) {
                assert_eq!(g.generated, w.generated, "{sampling:?}");
            }
            assert_eq!(got.generated_tokens(), want.generated_tokens());
        }
        // Two data-parallel replicas of the two-stage pipeline.
        let dp = run_replicas(&plan, &ckpt, &requests, &opts, 2).unwrap();
        for (g, w) in dp.sequences.iter().zip(&want.sequences) {
            assert_eq!(g.generated, w.generated, "dp 2 {sampling:?}");
        }
    }
}

/// Warm-ups and repetitions run every stage as often as the last; the timed repeats agree.
#[test]
fn repeated_generations_keep_the_stages_in_step() {
    let dir = Path::new("tests/fixtures/checkpoints/qwen3-tied");
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let plan = staged(&def, 2, 2, None);
    let opts = RunOptions {
        max_new_tokens: 5,
        warmup: 1,
        repeat: 3,
        ..exact()
    };
    let out = run_batch(&plan, &ckpt, &requests(), &opts).unwrap();
    let single = RunOptions {
        max_new_tokens: 5,
        ..exact()
    };
    let once = run_batch(&compile(&def, 2).unwrap().plan, &ckpt, &requests(), &single);
    let once = once.unwrap();
    assert!(out.generated_tokens() > 0);
    for (a, b) in out.sequences.iter().zip(&once.sequences) {
        assert_eq!(a.generated, b.generated);
    }
}
