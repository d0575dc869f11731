//! FP8 e4m3 block-scaled checkpoints (`quant_method: "fp8"`): `llama-gqa-fp8` and
//! `qwen3-moe-fp8` are llama-gqa's and qwen3-moe's weights quantized in blocks of 8 and 16 by
//! `scripts/make_fp8_fixture.py`, with transformers' own references (it dequantizes FP8
//! checkpoints on a CPU). tpc at every tp up to 8 (the MoE model at tp 1 to 4 with both
//! expert splits) matches them, every rank's pieces keep their blocks whole, the report
//! counts the stored bytes; splits that would cut a block and checkpoints whose scales do not
//! fit are refused before any compute.

use crate::common::{read_reference, rel_error, Reference, REL_TOL};
use std::path::{Path, PathBuf};
use tpc::frontend::load::load_model;
use tpc::ir::ExpertSplit;
use tpc::passes::ShardOptions;
use tpc::pipeline::{compile, compile_with};
use tpc::runtime::generate::RunOptions;
use tpc::runtime::run::run;
use tpc::runtime::weights::Checkpoint;

const FIXTURE: &str = "tests/fixtures/checkpoints/llama-gqa-fp8";

/// A copy of the fixture whose `config.json` is edited by `edit`, with only the tensors
/// `keep` accepts when it is given.
fn edited_copy(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    keep: Option<&dyn Fn(&str) -> bool>,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tpc-fp8-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(FIXTURE);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    match keep {
        None => std::fs::write(dir.join("model.safetensors"), &bytes).unwrap(),
        Some(keep) => {
            // The fixture's tensors but those `keep` drops.
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let views: Vec<_> = st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
            safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
        }
    }
    dir
}

/// `plan` on `ckpt` gives transformers' prompt logits (within the f32 tolerance) and greedy
/// tokens (shared with `quant_int8.rs`).
pub(crate) fn assert_matches(
    plan: &tpc::plan::Plan,
    ckpt: &Checkpoint,
    reference: &Reference,
    what: &str,
) {
    let opts = RunOptions {
        max_new_tokens: reference.greedy.len(),
        ..Default::default()
    };
    let out = run(plan, ckpt, &reference.prompt, &opts).unwrap();
    let err = rel_error(&out.prompt_logits.data, &reference.logits);
    assert!(err <= REL_TOL, "{what}: relative error {err:.3e}");
    assert_eq!(out.generated, reference.greedy, "{what}: greedy tokens");
}

/// bf16 runs of the checkpoint in `dir` at tp 1 and 2 (whose plans hold linears of
/// `format`), on every kernel variant this host runs, give transformers' f32 prompt logits
/// within the bf16 tolerance and its greedy tokens (shared with `quant_int8.rs` and
/// `quant_int4.rs`, whose decode rows are quantized to i16 on some variants).
pub(crate) fn assert_bf16_runs_match_on_every_variant(dir: &Path, format: tpc::ir::QuantFormat) {
    use crate::common::BF16_REL_TOL;
    use tpc::runtime::cpu::isa::Isa;
    use tpc::runtime::generate::ComputeDtype;
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    for tp in [1, 2] {
        let plan = compile(&def, tp).unwrap().plan;
        assert!(plan.ranks[0]
            .weights
            .iter()
            .any(|w| w.quant.is_some_and(|q| q.format == format)));
        for isa in Isa::ALL.into_iter().filter(|i| i.host_support().is_ok()) {
            let opts = RunOptions {
                dtype: ComputeDtype::Bf16,
                max_new_tokens: reference.greedy.len(),
                device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
                    isa: Some(isa),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let out = run(&plan, &ckpt, &reference.prompt, &opts).unwrap();
            let err = rel_error(&out.prompt_logits.data, &reference.logits);
            assert!(
                err <= BF16_REL_TOL,
                "{dir:?} tp={tp} {isa:?}: bf16 relative error {err:.3e}"
            );
            assert_eq!(out.generated, reference.greedy, "{dir:?} tp={tp} {isa:?}");
        }
    }
}

/// Why `plan` does not run on the checkpoint in `dir`.
pub(crate) fn refusal(plan: &tpc::plan::Plan, dir: &Path) -> String {
    let ckpt = Checkpoint::open(dir).unwrap();
    let e = run(plan, &ckpt, &[1, 2], &RunOptions::default()).err();
    e.expect("the run is refused").to_string()
}

#[test]
fn fp8_checkpoints_match_transformers_at_every_tp_with_whole_blocks() {
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
        // Every decoder linear is quantized and every piece keeps its 8 × 8 blocks whole;
        // the output head and the embeddings are not.
        let mut quantized = 0;
        for w in plan.ranks.iter().flat_map(|r| &r.weights) {
            let linear = w.tensor.contains("_proj.");
            assert_eq!(w.quant.is_some(), linear, "{} at tp {tp}", w.tensor);
            let Some(q) = w.quant else { continue };
            quantized += 1;
            assert_eq!(q.block, [8, 8]);
            if let Some(d) = w.dim {
                for r in &w.ranges {
                    assert!(
                        r.offset % 8 == 0
                            && (r.len % 8 == 0 || r.offset + r.len == w.shape[d as usize]),
                        "{} at tp {tp}: {r:?}",
                        w.tensor
                    );
                }
            }
        }
        assert_eq!(quantized, 14 * tp as usize, "tp {tp}");
        assert_matches(plan, &ckpt, &reference, &format!("tp {tp}"));
        ran.push(tp);
    }
    assert!(ran.len() >= 4 && ran.contains(&8), "ran only at tp {ran:?}");
    // The report counts the stored bytes: the quantized linears at a byte an element plus a
    // scale per block, against the f32 model's four bytes.
    let fp8 = tpc::plan::report::summarize(&compile(&def, 2).unwrap().plan);
    let f32_dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let dense =
        tpc::plan::report::summarize(&compile(&load_model(f32_dir).unwrap(), 2).unwrap().plan);
    // llama-gqa: per layer q, o 64×64, k, v 16×64, gate, up 128×64, down 64×128; 2 layers.
    let linear = 2 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 128 * 64);
    let scales = linear / 64;
    assert_eq!(
        dense.model_param_bytes - fp8.model_param_bytes,
        (linear * 4 - linear - scales * 4) as u64
    );
}

/// The fixture's MLP cut to 120 columns (15 of its blocks of 8): at tp 6 an even piece of 20
/// columns would cut the blocks, so the columns are dealt in whole blocks (3/3/3/3/3/0,
/// each rank's gate, up and down alike), and the run gives tp 1's logits and tokens. (Before,
/// tp 6 was refused as cutting blocks.)
#[test]
fn a_width_whose_even_pieces_would_cut_blocks_is_dealt_in_blocks() {
    const WIDTH: usize = 120;
    // Row-major `[rows, cols]` bytes cut to the first `rows` rows or `cols` columns.
    fn cut(shape: &[usize], bytes: Vec<u8>, rows: usize, cols: usize) -> Vec<u8> {
        let es = bytes.len() / (shape[0] * shape[1]);
        bytes
            .chunks(shape[1] * es)
            .take(rows)
            .flat_map(|row| row[..cols * es].to_vec())
            .collect()
    }
    let dir = crate::quant_int8::edited_copy(
        Path::new(FIXTURE),
        "fp8-mlp120",
        |c| c["intermediate_size"] = serde_json::json!(WIDTH),
        |name, dtype, shape, bytes| {
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let scale = name.ends_with("weight_scale_inv");
            let keep = if scale { WIDTH / 8 } else { WIDTH };
            let (rows, cols) = if name.contains("gate_proj") || name.contains("up_proj") {
                (keep, cols)
            } else if name.contains("down_proj") {
                (rows, keep)
            } else {
                return Some((dtype, shape, bytes));
            };
            Some((dtype, vec![rows, cols], cut(&shape, bytes, rows, cols)))
        },
    );
    let def = load_model(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let whole = compile(&def, 1).unwrap().plan;
    let opts = RunOptions {
        max_new_tokens: 4,
        ..Default::default()
    };
    let prompt = read_reference(Path::new(FIXTURE)).prompt;
    let want = run(&whole, &ckpt, &prompt, &opts).unwrap();
    let plan = compile(&def, 6).unwrap().plan;
    for tensor in ["gate_proj", "up_proj", "down_proj"] {
        let real: Vec<u64> = plan
            .ranks
            .iter()
            .map(|r| {
                let w = r
                    .weights
                    .iter()
                    .find(|w| *w.tensor == *format!("model.layers.0.mlp.{tensor}.weight"))
                    .unwrap();
                assert!(
                    w.ranges.iter().all(|g| g.offset % 8 == 0 && g.len % 8 == 0),
                    "{tensor}: {:?}",
                    w.ranges
                );
                w.ranges.iter().map(|g| g.len).sum()
            })
            .collect();
        assert_eq!(real, [24, 24, 24, 24, 24, 0], "{tensor}");
    }
    let got = run(&plan, &ckpt, &prompt, &opts).unwrap();
    let err = rel_error(&got.prompt_logits.data, &want.prompt_logits.data);
    assert!(
        err <= REL_TOL,
        "tp 6 against tp 1: relative error {err:.3e}"
    );
    assert_eq!(got.generated, want.generated);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_split_that_would_cut_a_block_is_refused_with_the_valid_tp() {
    // Blocks of 16 put both 8-wide kv heads in one block: no split keeps it whole.
    let dir = edited_copy(
        "block16",
        |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([16, 16]),
        None,
    );
    let def = load_model(&dir).unwrap();
    let e = compile(&def, 2).err().unwrap().to_string();
    assert!(
        e.contains("rank 0's piece, elements 0..8 of 16 would cut the checkpoint's fp8 e4m3 scale blocks of 16")
            && e.contains("k_proj")
            && e.contains("Valid tp values for this model: 1."),
        "{e}"
    );
    // Compiled whole, the plan still does not fit these weights: their scales are per 8.
    let plan = compile(&def, 1).unwrap().plan;
    let e = refusal(&plan, &dir);
    assert!(
        e.contains("_scale_inv") && e.contains("do not match"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plan_for_other_blocks_or_weights_without_scales_are_refused_before_compute() {
    // A plan compiled for blocks of 4 runs on weights in blocks of 8: refused by name.
    let four = edited_copy(
        "block4",
        |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([4, 4]),
        None,
    );
    let plan = compile(&load_model(&four).unwrap(), 2).unwrap().plan;
    let e = refusal(&plan, Path::new(FIXTURE));
    assert!(
        e.contains("the plan was compiled for blocks of 4 × 4"),
        "{e}"
    );
    // Scales missing.
    let missing = edited_copy(
        "noscales",
        |_| {},
        Some(&|n: &str| n != "model.layers.1.mlp.down_proj.weight_scale_inv"),
    );
    let plan = compile(&load_model(&missing).unwrap(), 2).unwrap().plan;
    let e = refusal(&plan, &missing);
    assert!(
        e.contains("model.layers.1.mlp.down_proj.weight") && e.contains("are missing"),
        "{e}"
    );
    // FP8 weights beside a config that does not say they are quantized.
    let unsaid = edited_copy(
        "unsaid",
        |c| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
        None,
    );
    let plan = compile(&load_model(&unsaid).unwrap(), 2).unwrap().plan;
    let e = refusal(&plan, &unsaid);
    assert!(
        e.contains("F8_E4M3") && e.contains("no FP8 `quantization_config`"),
        "{e}"
    );
    for d in [four, missing, unsaid] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn fp8_experts_match_transformers_with_both_splits() {
    let dir = Path::new("tests/fixtures/checkpoints/qwen3-moe-fp8");
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut runs = 0;
    for split in [ExpertSplit::Tensor, ExpertSplit::Expert] {
        for tp in 1u64..=4 {
            let options = ShardOptions {
                moe: Some(split),
                ..Default::default()
            };
            let what = format!("--moe {} tp={tp}", split.word());
            let plan = compile_with(&def, tp, options).unwrap().plan;
            // Every expert's weights are quantized, in blocks of 16; the routers are not.
            for w in plan.ranks.iter().flat_map(|r| &r.weights) {
                let quantized = w.tensor.contains("_proj.");
                assert_eq!(w.quant.is_some(), quantized, "{what}: {}", w.tensor);
                if let Some(q) = w.quant {
                    assert_eq!(q.block, [16, 16], "{what}: {}", w.tensor);
                }
            }
            assert_matches(&plan, &ckpt, &reference, &what);
            runs += 1;
        }
    }
    assert_eq!(runs, 8);
}
