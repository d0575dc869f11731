//! INT4 checkpoints as llm-compressor publishes them (compressed-tensors, `format:
//! "pack-quantized"`, W4A16): `llama-gqa-w4a16` (symmetric, groups of 32: no zero points
//! stored), `llama-gqa-w4a16-asym` (zero points, `actorder: "weight"`) and
//! `llama-gqa-w4a16-asym-act` (zero points, `actorder: "group"`: `weight_g_idx` scatters each
//! group along the inputs) are llama-gqa's weights packed by `scripts/make_int4_fixtures.py`,
//! with a reference run of transformers' f32 model holding the dequantized weights; the first
//! two load in transformers itself (through the compressed-tensors package) with the same
//! logits (recorded in their `reference.json`). tpc matches the reference at every tp the
//! groups allow, refuses a split that would cut a group, and refuses tensors and configs it
//! would misread before any compute. `llama-gqa-w8a16` (`scripts/make_int8_fixture.py`) is
//! the INT8 fixture's codes as W8A16 stores them (four to an int32, each plus 128): it runs
//! as the INT8 fixture does, bit for bit, and transformers itself loads it with the
//! reference's logits.

use crate::quant_fp8::refusal;
use crate::quant_int4::runs_at_every_valid_tp;
use crate::quant_int8::edited_copy;
use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::ir::QuantFormat;
use tpc::pipeline::compile;
use tpc::runtime::weights::Checkpoint;

const SYM: &str = "tests/fixtures/checkpoints/llama-gqa-w4a16";
const ASYM: &str = "tests/fixtures/checkpoints/llama-gqa-w4a16-asym";
const ASYM_ACT: &str = "tests/fixtures/checkpoints/llama-gqa-w4a16-asym-act";
const W8A16: &str = "tests/fixtures/checkpoints/llama-gqa-w8a16";
const INT8: &str = "tests/fixtures/checkpoints/llama-gqa-int8";

/// W8A16's codes are read as the INT8 fixture's: at every tp its logits are the INT8
/// fixture's bits (the same values, stored otherwise) and within tolerance of transformers,
/// its greedy tokens transformers', the codes kept (the same weight bytes) — f32 and bf16.
#[test]
fn w8a16_checkpoints_run_as_their_int8_codes_at_every_tp() {
    use crate::common::read_reference;
    use crate::quant_fp8::assert_matches;
    use tpc::runtime::generate::{ComputeDtype, Request, RunOptions};
    use tpc::runtime::run::run_batch;
    let reference = read_reference(Path::new(W8A16));
    let (packed, int8) = (
        Checkpoint::open(Path::new(W8A16)).unwrap(),
        Checkpoint::open(Path::new(INT8)).unwrap(),
    );
    let def = load_model(Path::new(W8A16)).unwrap();
    let request = [Request {
        prompt: reference.prompt.clone(),
        max_new_tokens: Some(2),
    }];
    let mut ran = Vec::new();
    for tp in 1u64..=8 {
        let Ok(compiled) = compile(&def, tp) else {
            continue;
        };
        let plan = &compiled.plan;
        assert!(plan.ranks[0].weights.iter().any(|w| w
            .quant
            .is_some_and(|q| (q.format, q.block) == (QuantFormat::Int8, [1, 0]))));
        assert_matches(plan, &packed, &reference, &format!("w8a16 tp {tp}"));
        for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let opts = RunOptions {
                dtype,
                ..Default::default()
            };
            let a = run_batch(plan, &packed, &request, &opts).unwrap();
            let b = run_batch(plan, &int8, &request, &opts).unwrap();
            let bits = |o: &tpc::runtime::generate::BatchOutput| -> Vec<u32> {
                o.sequences[0]
                    .prompt_logits
                    .data
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert!(
                bits(&a) == bits(&b),
                "tp {tp} {dtype:?}: other bits than INT8's"
            );
            assert_eq!(a.weight_bytes, b.weight_bytes, "tp {tp} {dtype:?}");
        }
        ran.push(tp);
    }
    assert!(ran.len() >= 4 && ran.contains(&8), "ran only at tp {ran:?}");
}

#[test]
fn w8a16_packed_bytes_that_do_not_fit_are_refused_before_compute() {
    let src = Path::new(W8A16);
    let plan = compile(&load_model(src).unwrap(), 2).unwrap().plan;
    // Packed codes for 60 inputs of 64.
    let short = edited_copy(
        src,
        "w8a16-short",
        |_| {},
        |n, d, mut s, mut b| {
            if n == "model.layers.0.mlp.gate_proj.weight_packed" {
                b = b.chunks(s[1] * 4).flat_map(|r| r[..60].to_vec()).collect();
                s[1] = 15;
            }
            Some((d, s, b))
        },
    );
    let e = refusal(&plan, &short);
    assert!(
        e.contains("gate_proj.weight") && e.contains("[128, 60]"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(short);
    // The packed words without their scales.
    let unscaled = edited_copy(
        src,
        "w8a16-scales",
        |_| {},
        |n, d, s, b| (n != "model.layers.1.self_attn.v_proj.weight_scale").then_some((d, s, b)),
    );
    let e = refusal(&plan, &unscaled);
    assert!(
        e.contains("`model.layers.1.self_attn.v_proj.weight_scale` are missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(unscaled);
}

#[test]
fn pack_quantized_checkpoints_match_transformers_at_every_tp_their_groups_allow() {
    let sym = QuantFormat::Int4Packed { zero_points: false };
    let asym = QuantFormat::Int4Packed { zero_points: true };
    // o_proj's 64 inputs are two groups of 32: no split past 2 keeps them whole.
    assert_eq!(runs_at_every_valid_tp(SYM, sym, false), [1, 2]);
    assert_eq!(runs_at_every_valid_tp(ASYM, asym, false), [1, 2]);
    // In group act order only the words of 8 inputs bind the row splits.
    let ran = runs_at_every_valid_tp(ASYM_ACT, asym, true);
    assert!(
        ran.contains(&4) && ran.contains(&8),
        "ran only at tp {ran:?}"
    );
}

#[test]
fn a_split_that_would_cut_a_group_is_refused_and_the_report_counts_no_zeros_where_symmetric() {
    let sym = load_model(Path::new(SYM)).unwrap();
    let e = compile(&sym, 4).err().unwrap().to_string();
    assert!(
        e.contains("would cut the checkpoint's int4 pack-quantized symmetric scale groups of 32")
            && e.contains("Valid tp values for this model: 1, 2."),
        "{e}"
    );
    let bytes = |dir: &str| {
        tpc::plan::report::summarize(
            &compile(&load_model(Path::new(dir)).unwrap(), 1)
                .unwrap()
                .plan,
        )
        .model_param_bytes
    };
    // llama-gqa: per layer q, o 64×64, k, v 16×64, gate, up 128×64, down 64×128; 2 layers;
    // groups × outputs as in quant_int4.rs. The report counts a 16-bit scale per group (the
    // fixture, an f32 model, stores f32 ones; published releases store bf16) and, with zero
    // points, half a byte more; in act order an int32 g_idx entry per input.
    let scales = 2 * (2 * (64 + 64 + 16 + 16 + 128 + 128) + 4 * 64);
    let inputs = 2 * (6 * 64 + 128);
    assert_eq!(bytes(ASYM) - bytes(SYM), (scales / 2) as u64);
    assert_eq!(bytes(ASYM_ACT) - bytes(ASYM), (inputs * 4) as u64);
    let awq = bytes("tests/fixtures/checkpoints/llama-gqa-awq");
    assert_eq!(bytes(ASYM), awq);
}

/// A corrupted copy's name, the tensor edited, the edit of its shape and bytes, and what
/// the refusal must say.
type Corruption = (
    &'static str,
    &'static str,
    fn(&mut Vec<usize>, &mut Vec<u8>),
    &'static [&'static str],
);

#[test]
fn pack_quantized_tensors_that_do_not_fit_are_refused_before_compute() {
    let src = Path::new(ASYM_ACT);
    let plan = compile(&load_model(src).unwrap(), 2).unwrap().plan;
    let edited = |name: &str, tensor: &'static str, f: fn(&mut Vec<usize>, &mut Vec<u8>)| {
        edited_copy(
            src,
            name,
            |_| {},
            move |n, d, mut s, mut b| {
                if n == tensor {
                    f(&mut s, &mut b);
                }
                Some((d, s, b))
            },
        )
    };
    let cases: [Corruption; 4] = [
        // Packed codes of the wrong length: 7 words of inputs for 64 inputs.
        (
            "packed-short",
            "model.layers.0.self_attn.q_proj.weight_packed",
            |s, b| {
                b.truncate(s[0] * 7 * 4);
                s[1] = 7;
            },
            &["q_proj.weight_packed", "has shape [64, 7]", "has [64, 8]"],
        ),
        // Scales for one group of a weight with two.
        (
            "scales",
            "model.layers.1.mlp.up_proj.weight_scale",
            |s, b| {
                let keep: Vec<u8> = b.chunks(8).flat_map(|r| r[..4].to_vec()).collect();
                *b = keep;
                s[1] = 1;
            },
            &["up_proj.weight_scale", "scales [128, 2]"],
        ),
        // Zero points of the wrong shape.
        (
            "zeros",
            "model.layers.0.mlp.down_proj.weight_zero_point",
            |s, b| {
                b.truncate(b.len() / 2);
                s[0] /= 2;
            },
            &["down_proj.weight_zero_point", "zeros [8, 4]"],
        ),
        // A weight_shape that disagrees with the packed codes.
        (
            "shape",
            "model.layers.1.self_attn.k_proj.weight_shape",
            |_, b| b[0] = 17,
            &["k_proj.weight_shape", "[17, 64]", "[16, 64]"],
        ),
    ];
    for (name, tensor, f, want) in cases {
        let dir = edited(name, tensor, f);
        let e = refusal(&plan, &dir);
        assert!(want.iter().all(|w| e.contains(w)), "{name}: {e}");
        let _ = std::fs::remove_dir_all(dir);
    }
    // Group act order with its g_idx missing.
    let dir = edited_copy(
        src,
        "g_idx",
        |_| {},
        |n, d, s, b| (!n.ends_with("o_proj.weight_g_idx")).then_some((d, s, b)),
    );
    let e = refusal(&plan, &dir);
    assert!(
        e.contains("`model.layers.0.self_attn.o_proj.weight_g_idx` is missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn pack_quantized_configs_tpc_would_misread_are_refused_by_name() {
    let src = Path::new(SYM);
    for (edit, want) in [
        (
            serde_json::json!({"num_bits": 8, "strategy": "channel", "group_size": null, "symmetric": false}),
            "asymmetric (zero points); tpc reads symmetric 8-bit weights",
        ),
        (
            serde_json::json!({"strategy": "tensor"}),
            "4-bit weight strategy `tensor`",
        ),
        (
            serde_json::json!({"actorder": "sideways"}),
            "`actorder` \"sideways\"",
        ),
        (
            serde_json::json!({"group_size": 20}),
            "`group_size` 20 is not -1",
        ),
        (serde_json::json!({"type": "float"}), "4-bit float weights"),
        (
            serde_json::json!({"dynamic": true}),
            "quantizes weights dynamically",
        ),
    ] {
        let dir = edited_copy(
            src,
            "packed-config",
            |c| {
                let w = c["quantization_config"]["config_groups"]["group_0"]["weights"]
                    .as_object_mut()
                    .unwrap();
                for (k, v) in edit.as_object().unwrap() {
                    w.insert(k.clone(), v.clone());
                }
            },
            |_, d, s, b| Some((d, s, b)),
        );
        let e = load_model(&dir).err().unwrap().to_string();
        assert!(
            e.contains(want) && e.contains("compressed-tensors ("),
            "{want}: {e}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
    // Quantized activations (W4A8) and a packed scheme under an unpacked format.
    let dir = edited_copy(
        src,
        "packed-a8",
        |c| {
            c["quantization_config"]["config_groups"]["group_0"]["input_activations"] =
                serde_json::json!({"num_bits": 8, "type": "int", "dynamic": true});
        },
        |_, d, s, b| Some((d, s, b)),
    );
    let e = load_model(&dir).err().unwrap().to_string();
    assert!(e.contains("quantizes activations too"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
    let dir = edited_copy(
        src,
        "packed-format",
        |c| c["quantization_config"]["format"] = "int-quantized".into(),
        |_, d, s, b| Some((d, s, b)),
    );
    let e = load_model(&dir).err().unwrap().to_string();
    assert!(
        e.contains("int4 pack-quantized symmetric weights in `format` int-quantized are not read"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
