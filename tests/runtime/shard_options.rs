//! Sharding options against HF transformers on every reference checkpoint at tp 2 and 4:
//! sequence parallelism (`--sequence-parallel`, the residual stream held split by tokens,
//! also batched with uneven prompts against the plan without it) and norm fusion
//! (`--fuse-norm`, each all-reduce fused into the RMSNorm that reads it).

use crate::common;
use common::{fixtures, ragged_requests, read_reference, rel_error};

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::passes::ShardOptions;
use tpc::pipeline::{compile, compile_with};
use tpc::plan::Plan;
use tpc::runtime::generate::RunOptions;
use tpc::runtime::run::{run, run_batch};
use tpc::runtime::weights::Checkpoint;

/// The f32 parity tolerance of `parity.rs`: ‖a − b‖ / ‖b‖ over all prompt logits.
const REL_TOL: f64 = 1e-4;

const SP: ShardOptions = ShardOptions {
    sequence_parallel: true,
    fuse_norm: false,
    numerics: tpc::ir::NumericsMode::Fast,
    shares: None,
    moe: None,
};

const FUSED: ShardOptions = ShardOptions {
    sequence_parallel: false,
    fuse_norm: true,
    numerics: tpc::ir::NumericsMode::Fast,
    shares: None,
    moe: None,
};

fn count(plan: &Plan, kind: &str) -> usize {
    plan.collectives.iter().filter(|c| c.kind == kind).count()
}

/// Runs every fixture at tp 2 and 4 compiled with `options` against HF; `check` looks at
/// each (plain plan, optioned plan) pair first.
fn matches_hf_with(options: ShardOptions, check: impl Fn(&Plan, &Plan, &str)) {
    let mut ran = 0;
    let mut report = Vec::new();
    for dir in fixtures() {
        let r = read_reference(&dir);
        let (prompt, logits, greedy) = (r.prompt, r.logits, r.greedy);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for tp in [2u64, 3, 4] {
            let Ok(plain) = compile(&def, tp) else {
                continue;
            };
            let plan = compile_with(&def, tp, options).unwrap().plan;
            let ctx = format!("{} tp={tp}", dir.display());
            check(&plain.plan, &plan, &ctx);
            let opts = RunOptions {
                max_new_tokens: greedy.len(),
                device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
                    isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let out = run(&plan, &ckpt, &prompt, &opts).unwrap();
            let err = rel_error(&out.prompt_logits.data, &logits);
            report.push(format!("{ctx}: rel err {err:.2e}"));
            assert!(
                err <= REL_TOL,
                "{ctx}: relative error {err:.3e} > {REL_TOL}"
            );
            assert_eq!(out.generated, greedy, "{ctx}: greedy tokens");
            ran += 1;
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(ran >= 7 * 2 - 2, "only {ran} (fixture, tp) pairs ran");
}

#[test]
fn sequence_parallel_plans_match_hf_at_tp_2_and_4() {
    matches_hf_with(SP, |plain, plan, ctx| {
        // Every all-reduce became a reduce-scatter over the sequence, and token-split values
        // are gathered where a whole one is needed.
        assert_eq!(count(plan, "all_reduce"), 0, "{ctx}");
        assert_eq!(
            count(plan, "reduce_scatter"),
            count(plain, "all_reduce"),
            "{ctx}"
        );
        assert!(
            count(plan, "all_gather") > count(plain, "all_gather"),
            "{ctx}"
        );
    });
}

#[test]
fn norm_fused_plans_match_hf_at_tp_2_and_4() {
    matches_hf_with(FUSED, |plain, plan, ctx| {
        // Families with RMSNorm fuse every all-reduce (each feeds one norm); LayerNorm
        // families (GPT-2, NeoX) keep theirs. Either way the bytes stay the same.
        let fused = count(plan, "all_reduce_rms_norm");
        if ctx.contains("gpt2") || ctx.contains("neox") {
            assert_eq!(fused, 0, "{ctx}");
        } else {
            assert_eq!(count(plan, "all_reduce"), 0, "{ctx}");
            assert_eq!(fused, count(plain, "all_reduce"), "{ctx}");
        }
        let bytes = |p: &Plan| p.collectives.iter().map(|c| c.bytes_per_token).sum::<u64>();
        assert_eq!(bytes(plan), bytes(plain), "{ctx}");
    });
}

#[test]
fn uneven_batches_split_by_tokens_equal_the_plain_plan() {
    // 7 + 2 + 11 prompt tokens (20 rows: 5 per rank at tp 4), then decode steps of 3, 2
    // and 1 rows, padded to 4.
    let dir = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    let requests = ragged_requests(250);
    let opts = RunOptions {
        all_prompt_logits: true,
        ..RunOptions::default()
    };
    let plain = compile(&def, 4).unwrap().plan;
    let split = compile_with(&def, 4, SP).unwrap().plan;
    let want = run_batch(&plain, &ckpt, &requests, &opts).unwrap();
    let got = run_batch(&split, &ckpt, &requests, &opts).unwrap();
    for (s, (g, w)) in got.sequences.iter().zip(&want.sequences).enumerate() {
        assert_eq!(g.generated, w.generated, "sequence {s}");
        assert_eq!(g.prompt_logits.shape, w.prompt_logits.shape, "sequence {s}");
        let e = rel_error(&g.prompt_logits.data, &w.prompt_logits.data);
        assert!(e <= 1e-5, "sequence {s}: prompt logits differ by {e:.3e}");
    }
}
