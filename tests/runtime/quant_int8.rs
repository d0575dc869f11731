//! INT8 checkpoints with a scale per output channel in the compressed-tensors layout
//! (`quant_method: "compressed-tensors"`, `format: "int-quantized"`): `llama-gqa-int8` is
//! llama-gqa's weights quantized by `scripts/make_int8_fixture.py`, with a reference run of
//! transformers' f32 model holding the dequantized weights. tpc at every tp up to 8 matches
//! it (a scale per channel takes any cut of the inputs, so every tp the model allows runs),
//! and checkpoints whose scales or config do not fit are refused before any compute.

use crate::common::read_reference;
use crate::quant_fp8::{assert_matches, refusal};
use std::path::{Path, PathBuf};
use tpc::frontend::load::load_model;
use tpc::ir::QuantFormat;
use tpc::pipeline::compile;
use tpc::runtime::weights::Checkpoint;

const FIXTURE: &str = "tests/fixtures/checkpoints/llama-gqa-int8";

/// A copy of the fixture `src` with its `config.json` edited by `edit` and its tensors
/// passed through `tensors` (name, dtype, shape, bytes) before they are written (shared with
/// `quant_int4.rs`).
pub(crate) fn edited_copy(
    src: &Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    tensors: impl Fn(
        &str,
        safetensors::Dtype,
        Vec<usize>,
        Vec<u8>,
    ) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tpc-quant-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| {
            tensors(&n, v.dtype(), v.shape().to_vec(), v.data().to_vec())
                .map(|(d, s, b)| (n, d, s, b))
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn int8_channel_checkpoints_match_transformers_at_every_tp() {
    let dir = Path::new(FIXTURE);
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut ran = Vec::new();
    for tp in 1u64..=8 {
        let Ok(compiled) = compile(&def, tp) else {
            continue;
        };
        let plan = &compiled.plan;
        // Every decoder linear is INT8 with a scale per output channel; the head and the
        // embeddings are not quantized.
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            let linear = w.tensor.contains("_proj.");
            assert_eq!(w.quant.is_some(), linear, "{} at tp {tp}", w.tensor);
            if let Some(q) = w.quant {
                assert_eq!((q.format, q.block), (QuantFormat::Int8, [1, 0]));
            }
        }
        assert_matches(plan, &ckpt, &reference, &format!("tp {tp}"));
        ran.push(tp);
    }
    // The kv heads (2) bound the even splits; uneven ones deal whole kv groups.
    assert!(ran.len() >= 4 && ran.contains(&8), "ran only at tp {ran:?}");
    // The report counts a byte an element and an f32 per output row for the linears.
    let int8 = tpc::plan::report::summarize(&compile(&def, 1).unwrap().plan);
    let f32_dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let dense =
        tpc::plan::report::summarize(&compile(&load_model(f32_dir).unwrap(), 1).unwrap().plan);
    // llama-gqa: per layer q, o 64×64, k, v 16×64, gate, up 128×64, down 64×128; 2 layers.
    let linear = 2 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 128 * 64);
    let rows = 2 * (64 + 64 + 16 + 16 + 128 + 128 + 64);
    assert_eq!(
        dense.model_param_bytes - int8.model_param_bytes,
        (linear * 4 - linear - rows * 4) as u64
    );
}

#[test]
fn scales_that_do_not_fit_or_an_unsaid_format_are_refused_before_compute() {
    let plan = compile(&load_model(Path::new(FIXTURE)).unwrap(), 2)
        .unwrap()
        .plan;
    // A scale per row stored flat ([out] instead of [out, 1]).
    let flat = edited_copy(
        Path::new(FIXTURE),
        "flat",
        |_| {},
        |n, d, s, b| {
            let s = if n == "model.layers.0.self_attn.o_proj.weight_scale" {
                vec![s[0]]
            } else {
                s
            };
            Some((d, s, b))
        },
    );
    let e = refusal(&plan, &flat);
    assert!(
        e.contains("o_proj.weight_scale") && e.contains("[64, 1] scales"),
        "{e}"
    );
    // INT8 weights beside a config without their quantization.
    let unsaid = edited_copy(
        Path::new(FIXTURE),
        "unsaid",
        |c| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
        |_, d, s, b| Some((d, s, b)),
    );
    let plan_plain = compile(&load_model(&unsaid).unwrap(), 2).unwrap().plan;
    let e = refusal(&plan_plain, &unsaid);
    assert!(
        e.contains("I8") && e.contains("no INT8 `quantization_config`"),
        "{e}"
    );
    // Missing scales.
    let missing = edited_copy(
        Path::new(FIXTURE),
        "missing",
        |_| {},
        |n, d, s, b| (n != "model.layers.1.mlp.up_proj.weight_scale").then_some((d, s, b)),
    );
    let e = refusal(&plan, &missing);
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("are missing"),
        "{e}"
    );
    // A plan compiled for FP8 blocks on these INT8 weights.
    let fp8 = compile(
        &load_model(Path::new("tests/fixtures/checkpoints/llama-gqa-fp8")).unwrap(),
        2,
    )
    .unwrap()
    .plan;
    let e = refusal(&fp8, Path::new(FIXTURE));
    assert!(
        e.contains("is stored as int8") && e.contains("compiled for"),
        "{e}"
    );
    for d in [flat, unsaid, missing] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A bf16 run on AVX2 multiplies INT8 codes by decode rows quantized to i16 (`isa/int8.rs`);
/// other variants keep f32 rows. On every variant this host runs, at tp 1 and 2, the prompt
/// logits of the INT8 and W8A16 checkpoints stay within the bf16 tolerance of
/// transformers' f32 ones and the greedy tokens match.
#[test]
fn bf16_runs_of_int8_checkpoints_stay_within_the_bf16_tolerance() {
    for dir in [FIXTURE, "tests/fixtures/checkpoints/llama-gqa-w8a16"] {
        crate::quant_fp8::assert_bf16_runs_match_on_every_variant(
            Path::new(dir),
            QuantFormat::Int8,
        );
    }
}
