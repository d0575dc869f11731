//! INT4 checkpoints as GPTQ and AWQ publish them: `llama-gqa-gptq` (groups of 32 inputs),
//! `llama-gqa-gptq-act` (the same in act order: `g_idx` scatters each group along the inputs)
//! and `llama-gqa-awq` (AWQ's GEMM packing, groups of 32) are llama-gqa's weights packed by
//! `scripts/make_int4_fixtures.py`, with a reference run of transformers' f32 model holding
//! the weights unpacked from the stored tensors. tpc matches it at every tp the groups allow;
//! a split that would cut a group is refused with the valid tp; act order survives row
//! splits down to the packed words; tensors that do not fit are refused before compute.

use crate::common::read_reference;
use crate::quant_fp8::{assert_matches, refusal};
use crate::quant_int8::edited_copy;
use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::ir::QuantFormat;
use tpc::pipeline::compile;
use tpc::runtime::weights::Checkpoint;

const GPTQ: &str = "tests/fixtures/checkpoints/llama-gqa-gptq";
const GPTQ_ACT: &str = "tests/fixtures/checkpoints/llama-gqa-gptq-act";
const AWQ: &str = "tests/fixtures/checkpoints/llama-gqa-awq";

/// Runs the fixture in `dir` at every tp from 1 to 8 that compiles, against its reference,
/// checking each piece of a quantized weight keeps its groups (`group` inputs) and words
/// whole; returns the tp that ran.
pub(crate) fn runs_at_every_valid_tp(dir: &str, format: QuantFormat, act_order: bool) -> Vec<u64> {
    let dir = Path::new(dir);
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut ran = Vec::new();
    for tp in 1u64..=8 {
        let Ok(compiled) = compile(&def, tp) else {
            continue;
        };
        let plan = &compiled.plan;
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            let linear = w.tensor.contains("_proj.");
            assert_eq!(w.quant.is_some(), linear, "{} at tp {tp}", w.tensor);
            let Some(q) = w.quant else { continue };
            assert_eq!(
                (q.format, q.block, q.act_order),
                (format, [1, 32], act_order)
            );
            // Outputs in words of 8; inputs in groups of 32, or in act order words of 8.
            let atom = match w.dim {
                Some(0) => 8,
                Some(_) if act_order => 8,
                Some(_) => 32,
                None => continue,
            };
            let d = w.dim.unwrap_or(0) as usize;
            for r in &w.ranges {
                assert!(
                    r.offset % atom == 0 && (r.len % atom == 0 || r.offset + r.len == w.shape[d]),
                    "{} at tp {tp}: {r:?}",
                    w.tensor
                );
            }
        }
        assert_matches(plan, &ckpt, &reference, &format!("{dir:?} at tp {tp}"));
        ran.push(tp);
    }
    ran
}

#[test]
fn gptq_checkpoints_match_transformers_at_every_tp_their_groups_allow() {
    // o_proj's 64 inputs are two groups of 32: no split past 2 keeps them whole.
    assert_eq!(
        runs_at_every_valid_tp(GPTQ, QuantFormat::Int4Gptq, false),
        [1, 2]
    );
    // In act order only the words of 8 inputs bind the row splits.
    let ran = runs_at_every_valid_tp(GPTQ_ACT, QuantFormat::Int4Gptq, true);
    assert!(
        ran.contains(&4) && ran.contains(&8),
        "ran only at tp {ran:?}"
    );
}

/// In act order a linear keeps its codes, its steps stored sorted by group with the order
/// (4 bytes a slot and an input), and takes its activations in that order (the fixture's
/// q/k/v and gate/up share an order, as GPTQ gives the projections of one input): at tp 1
/// rank 0 holds the plain GPTQ fixture's bytes and the orders; at tp 2 each rank's share of
/// a scattered group of the row-split o and down projections fills a block of slots as long
/// as the largest share (the rest padding): more than the plain fixture's codes, far less
/// than f32 values (4 bytes an element).
#[test]
fn act_order_linears_keep_their_codes_sorted_by_group() {
    use tpc::runtime::generate::{Request, RunOptions};
    use tpc::runtime::run::run_batch;
    let held = |dir: &str, tp: u64| {
        let dir = Path::new(dir);
        let reference = read_reference(dir);
        let plan = compile(&load_model(dir).unwrap(), tp).unwrap().plan;
        let ckpt = Checkpoint::open(dir).unwrap();
        let opts = RunOptions {
            max_new_tokens: 1,
            ..Default::default()
        };
        let request = [Request {
            prompt: reference.prompt.clone(),
            max_new_tokens: None,
        }];
        let out = run_batch(&plan, &ckpt, &request, &opts).unwrap();
        (out.weight_bytes, plan)
    };
    let (plain, plan) = held(GPTQ, 1);
    let (act, _) = held(GPTQ_ACT, 1);
    let inputs: u64 = plan.ranks[0]
        .weights
        .iter()
        .filter(|w| w.quant.is_some())
        .map(|w| w.local_shape[1])
        .sum();
    // At most one order per linear (fewer where projections are fused).
    assert!(
        act > plain && act <= plain + 8 * inputs,
        "act order {act} bytes against {plain} plain ({inputs} inputs)"
    );
    let (plain, plan) = held(GPTQ, 2);
    let (act, _) = held(GPTQ_ACT, 2);
    let rows_split: u64 = plan.ranks[0]
        .weights
        .iter()
        .filter(|w| w.quant.is_some() && w.dim == Some(1))
        .map(|w| w.local_elements())
        .sum();
    assert!(rows_split > 0);
    assert!(
        act > plain && act < plain + rows_split,
        "act order {act} bytes against {plain} plain ({rows_split} row-split elements)"
    );
}

#[test]
fn awq_checkpoints_match_transformers_at_every_tp_their_groups_allow() {
    assert_eq!(
        runs_at_every_valid_tp(AWQ, QuantFormat::Int4Awq, false),
        [1, 2]
    );
}

#[test]
fn a_split_that_would_cut_a_group_is_refused_and_the_report_counts_stored_bytes() {
    let def = load_model(Path::new(GPTQ)).unwrap();
    let e = compile(&def, 4).err().unwrap().to_string();
    assert!(
        e.contains("would cut the checkpoint's int4 gptq scale groups of 32")
            && e.contains("o_proj")
            && e.contains("Valid tp values for this model: 1, 2."),
        "{e}"
    );
    // Half a byte an element, an f16 scale and a 4-bit zero per group per output, and a
    // g_idx entry per input, against the f32 model's four bytes an element.
    let gptq = tpc::plan::report::summarize(&compile(&def, 1).unwrap().plan);
    let awq = tpc::plan::report::summarize(
        &compile(&load_model(Path::new(AWQ)).unwrap(), 1)
            .unwrap()
            .plan,
    );
    let dense = tpc::plan::report::summarize(
        &compile(
            &load_model(Path::new("tests/fixtures/checkpoints/llama-gqa")).unwrap(),
            1,
        )
        .unwrap()
        .plan,
    );
    // llama-gqa: per layer q, o 64×64, k, v 16×64, gate, up 128×64, down 64×128; 2 layers.
    let linear = 2 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 128 * 64);
    // Groups × outputs: 64 inputs (2 groups) for all but down (128: 4 groups of 64 outputs).
    let scales = 2 * (2 * (64 + 64 + 16 + 16 + 128 + 128) + 4 * 64);
    let inputs = 2 * (6 * 64 + 128);
    let awq_bytes = linear / 2 + scales * 5 / 2;
    assert_eq!(
        dense.model_param_bytes - awq.model_param_bytes,
        (linear * 4 - awq_bytes) as u64
    );
    assert_eq!(
        awq.model_param_bytes + inputs as u64 * 4,
        gptq.model_param_bytes
    );
}

#[test]
fn packed_tensors_that_do_not_fit_or_other_packings_are_refused_before_compute() {
    let src = Path::new(GPTQ);
    let plan = compile(&load_model(src).unwrap(), 2).unwrap().plan;
    // A packed weight of the wrong length: 7 words of inputs for 64 inputs.
    let short = edited_copy(
        src,
        "int4-short",
        |_| {},
        |n, d, s, b| {
            if n == "model.layers.0.self_attn.q_proj.qweight" {
                Some((d, vec![7, s[1]], b[..7 * s[1] * 4].to_vec()))
            } else {
                Some((d, s, b))
            }
        },
    );
    let e = refusal(&plan, &short);
    assert!(
        e.contains("q_proj.qweight")
            && e.contains("has shape [7, 64]")
            && e.contains("has [8, 64]"),
        "{e}"
    );
    // Scales of the wrong shape (one group).
    let scales = edited_copy(
        src,
        "int4-scales",
        |_| {},
        |n, d, s, b| {
            if n == "model.layers.1.mlp.up_proj.scales" {
                Some((d, vec![1, s[1]], b[..s[1] * 2].to_vec()))
            } else {
                Some((d, s, b))
            }
        },
    );
    let e = refusal(&plan, &scales);
    assert!(
        e.contains("up_proj.scales") && e.contains("scales [2, 128]"),
        "{e}"
    );
    // A plan compiled for AWQ's packing on GPTQ's tensors.
    let awq = compile(&load_model(Path::new(AWQ)).unwrap(), 2)
        .unwrap()
        .plan;
    let e = refusal(&awq, src);
    assert!(
        e.contains("is stored as int4 gptq, the plan was compiled for int4 awq"),
        "{e}"
    );
    // GPTQ tensors beside a config that does not say so.
    let unsaid = edited_copy(
        src,
        "int4-unsaid",
        |c| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
        |_, d, s, b| Some((d, s, b)),
    );
    let plain = compile(&load_model(&unsaid).unwrap(), 2).unwrap().plan;
    let e = refusal(&plain, &unsaid);
    assert!(
        e.contains("holds `model.layers.0.self_attn.q_proj.qweight` instead")
            && e.contains("no `quantization_config`"),
        "{e}"
    );
    for d in [short, scales, unsaid] {
        let _ = std::fs::remove_dir_all(d);
    }
    // Configs tpc would misread are refused by name.
    for (edit, want) in [
        (serde_json::json!({"bits": 8}), "8-bit weights are not read"),
        (
            serde_json::json!({"group_size": 20}),
            "`group_size` 20 is not -1",
        ),
        (
            serde_json::json!({"checkpoint_format": "gptq_v2"}),
            "`checkpoint_format` \"gptq_v2\"",
        ),
        (
            serde_json::json!({"quant_method": "awq", "version": "gemv"}),
            "`version` gemv is not read",
        ),
        (
            serde_json::json!({"quant_method": "bitsandbytes"}),
            "`bitsandbytes`",
        ),
    ] {
        let dir = edited_copy(
            src,
            "int4-config",
            |c| {
                let q = c["quantization_config"].as_object_mut().unwrap();
                for (k, v) in edit.as_object().unwrap() {
                    q.insert(k.clone(), v.clone());
                }
            },
            |_, d, s, b| Some((d, s, b)),
        );
        let e = load_model(&dir).err().unwrap().to_string();
        assert!(
            e.contains(want) && e.contains("gptq (4-bit") && e.contains("awq (4-bit"),
            "{want}: {e}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A bf16 run keeps the INT4 codes and quantizes decode rows to i16 (`isa/int4.rs`): the
/// prompt logits stay within the bf16 tolerance of transformers' f32 ones on every variant
/// this host runs, at tp 1 and 2 (in act order too), and the greedy tokens match.
#[test]
fn bf16_runs_of_int4_checkpoints_stay_within_the_bf16_tolerance() {
    for (dir, format) in [
        (GPTQ, QuantFormat::Int4Gptq),
        (GPTQ_ACT, QuantFormat::Int4Gptq),
        (AWQ, QuantFormat::Int4Awq),
        (
            "tests/fixtures/checkpoints/llama-gqa-w4a16-asym-act",
            QuantFormat::Int4Packed { zero_points: true },
        ),
    ] {
        crate::quant_fp8::assert_bf16_runs_match_on_every_variant(Path::new(dir), format);
    }
}

/// `--numerics invariant` sums each output's depth in fixed blocks of the stored steps in
/// their own order: act-order linears are then packed as values (not sorted by group), and
/// the logits are the same bits at tp 1, 2, 4 and 8, within the f32 tolerance of
/// transformers.
#[test]
fn act_order_runs_in_the_invariant_order_give_the_same_bits_at_every_tp() {
    use crate::common::{rel_error, REL_TOL};
    use tpc::ir::NumericsMode;
    use tpc::passes::ShardOptions;
    use tpc::pipeline::compile_with;
    use tpc::runtime::cpu::CpuOptions;
    use tpc::runtime::device::Device;
    use tpc::runtime::generate::{Request, RunOptions};
    use tpc::runtime::run::run_batch;
    let dir = Path::new(GPTQ_ACT);
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let opts = RunOptions {
        max_new_tokens: 1,
        device: Device::Cpu(CpuOptions {
            isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let request = [Request {
        prompt: reference.prompt.clone(),
        max_new_tokens: None,
    }];
    let mut first: Option<Vec<u32>> = None;
    for tp in [1, 2, 4, 8] {
        let options = ShardOptions {
            numerics: NumericsMode::Invariant,
            ..Default::default()
        };
        let plan = compile_with(&def, tp, options).unwrap().plan;
        let out = run_batch(&plan, &ckpt, &request, &opts).unwrap();
        let logits = &out.sequences[0].prompt_logits;
        let err = rel_error(&logits.data, &reference.logits);
        assert!(err <= REL_TOL, "tp {tp}: relative error {err:.3e}");
        let bits: Vec<u32> = logits.data.iter().map(|v| v.to_bits()).collect();
        match &first {
            None => first = Some(bits),
            Some(want) => assert!(*want == bits, "tp {tp}: other bits than tp 1"),
        }
    }
}
