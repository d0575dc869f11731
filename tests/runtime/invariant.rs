//! `--numerics invariant` (issue 32): every fixture's logits are the same bits at every tp,
//! with sequence parallelism, norm fusion asked for and pipeline stages, on any thread
//! count, and close to HF's; a sequence's logits are the same bits alone, in a ragged
//! batch, prefilled in chunks and decoded beside others. Each comparison is also made in
//! the fast order, where some differ: the checks can fail.

use crate::common;
use common::{fixtures, ragged_requests, read_reference, rel_error, REL_TOL};

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::ir::NumericsMode;
use tpc::passes::ShardOptions;
use tpc::pipeline::{compile_with, split_stages};
use tpc::plan::Plan;
use tpc::runtime::comm::local_group;
use tpc::runtime::cpu::{CpuBackend, CpuOptions};
use tpc::runtime::device::Device;
use tpc::runtime::executor::{OutputRows, RankExecutor};
use tpc::runtime::generate::RunOptions;
use tpc::runtime::random::RandomWeights;
use tpc::runtime::run::run_batch;
use tpc::runtime::sampling::Sampling;
use tpc::runtime::tensor::Tensor;
use tpc::runtime::weights::Checkpoint;

fn options(numerics: NumericsMode, sequence_parallel: bool, fuse_norm: bool) -> ShardOptions {
    ShardOptions {
        sequence_parallel,
        fuse_norm,
        numerics,
        shares: None,
        moe: None,
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.data.iter().map(|v| v.to_bits()).collect()
}

/// CPU ranks of `threads` threads with the kernels that keep activations f32: HF's f32
/// tolerance is theirs (on a CPU with AVX512-BF16 or AMX the fastest kernels round the
/// activations to bf16, which `tests/runtime/parity.rs` holds to the bf16 tolerance).
fn run_opts(threads: usize, new_tokens: usize, sampling: Sampling) -> RunOptions {
    RunOptions {
        max_new_tokens: new_tokens,
        all_prompt_logits: true,
        sampling,
        device: Device::Cpu(CpuOptions {
            threads_per_rank: threads,
            isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Each (tp, variant) plan of `dir` that compiles, with its label.
fn plans(dir: &Path, numerics: NumericsMode) -> Vec<(String, Plan)> {
    let def = load_model(dir).unwrap();
    let mut out = Vec::new();
    for tp in [1u64, 2, 3, 4, 6, 8] {
        for (label, sp, fuse, pp) in [
            ("plain", false, false, 1),
            ("--sequence-parallel", true, false, 1),
            ("--fuse-norm", false, true, 1),
            ("--pp 2", false, false, 2),
        ] {
            if tp == 1 && label != "plain" && label != "--pp 2" {
                continue;
            }
            let Ok(c) = compile_with(&def, tp, options(numerics, sp, fuse)) else {
                continue;
            };
            let mut plan = c.plan;
            if pp > 1 && split_stages(&mut plan, pp, None).is_err() {
                continue;
            }
            out.push((format!("tp={tp} {label}"), plan));
        }
    }
    out
}

#[test]
fn every_fixture_gives_the_same_bits_at_every_tp_and_matches_hf() {
    let mut fast_differs = 0;
    let mut ran = 0;
    for dir in fixtures() {
        let r = read_reference(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let requests = vec![tpc::runtime::generate::Request {
            prompt: r.prompt.clone(),
            max_new_tokens: Some(r.greedy.len()),
        }];
        let seeded = Sampling {
            temperature: 0.9,
            top_k: None,
            top_p: Some(0.95),
            seed: 7,
        };
        for numerics in [NumericsMode::Invariant, NumericsMode::Fast] {
            let mut first: Option<(Vec<u32>, Vec<i64>)> = None;
            for (label, plan) in plans(&dir, numerics) {
                let ctx = format!("{} {numerics} {label}", dir.display());
                for threads in [1, 2] {
                    let greedy = run_batch(
                        &plan,
                        &ckpt,
                        &requests,
                        &run_opts(threads, r.greedy.len(), Sampling::default()),
                    )
                    .unwrap()
                    .sequences
                    .remove(0);
                    let sampled = run_batch(
                        &plan,
                        &ckpt,
                        &requests,
                        &run_opts(threads, 8, seeded.clone()),
                    )
                    .unwrap()
                    .sequences
                    .remove(0);
                    let err = rel_error(&greedy.prompt_logits.data, &r.logits);
                    assert!(err <= REL_TOL, "{ctx}: relative error {err:.3e} against HF");
                    assert_eq!(greedy.generated, r.greedy, "{ctx}: HF's greedy tokens");
                    let got = (bits(&greedy.prompt_logits), sampled.generated);
                    match (&first, numerics) {
                        (None, _) => first = Some(got),
                        (Some(want), NumericsMode::Invariant) => {
                            let at = want.0.iter().zip(&got.0).position(|(a, b)| a != b);
                            assert!(
                                at.is_none(),
                                "{ctx}, {threads} threads: logit {} differs from tp=1's",
                                at.unwrap_or(0)
                            );
                            assert_eq!(got.1, want.1, "{ctx}: seeded sampling");
                            ran += 1;
                        }
                        (Some(want), NumericsMode::Fast) => {
                            fast_differs += usize::from(want.0 != got.0);
                        }
                    }
                }
            }
        }
    }
    assert!(ran >= 7 * 8, "only {ran} invariant runs compared");
    assert!(
        fast_differs > 0,
        "the fast order gave tp=1's bits everywhere: the check cannot fail"
    );
}

/// A rank-0 executor of `plan` over random weights.
fn executor<'p>(
    plan: &'p Plan,
    weights: &RandomWeights,
    threads: usize,
) -> RankExecutor<'p, CpuBackend, tpc::runtime::comm::LocalComm> {
    let comm = local_group(1).pop().unwrap();
    RankExecutor::new(
        &plan.ranks[0],
        plan.numerics,
        weights,
        CpuBackend::new(threads),
        comm,
    )
    .unwrap()
}

/// Rows `rows` of `t` (`[rows, cols]`).
fn rows(t: &Tensor, from: usize, count: usize) -> Vec<u32> {
    let cols = t.data.len() / t.shape[0];
    t.data[from * cols..(from + count) * cols]
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Returns how many comparisons differed (none may under `invariant`).
fn batch_comparisons(numerics: NumericsMode) -> usize {
    let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    let plan = compile_with(&def, 1, options(numerics, false, false))
        .unwrap()
        .plan;
    let weights = RandomWeights::new(&plan, 5);
    let requests = ragged_requests(250);
    let a = &requests[2].prompt; // 11 tokens
    let (b, c) = (&requests[0].prompt, &requests[1].prompt);
    let mut differ = 0;
    let mut check = |what: &str, got: Vec<u32>, want: &[u32]| {
        if numerics == NumericsMode::Invariant {
            let at = got.iter().zip(want).position(|(a, b)| a != b);
            assert!(
                at.is_none() && got.len() == want.len(),
                "{what}: logit {at:?} of {} differs",
                want.len()
            );
        }
        differ += usize::from(got != want);
    };
    // Alone: the whole prompt, then three decode steps.
    let mut alone = executor(&plan, &weights, 1);
    let want = alone.forward(&[(0, a)], OutputRows::All).unwrap();
    let steps: Vec<Tensor> = [5i64, 77, 130]
        .iter()
        .map(|&t| alone.forward(&[(0, &[t])], OutputRows::LastOfEach).unwrap())
        .collect();
    for threads in [1, 2] {
        // In a ragged batch: b, a, c prefilled together.
        let mut batch = executor(&plan, &weights, threads);
        let got = batch
            .forward(&[(1, b), (0, a), (2, c)], OutputRows::All)
            .unwrap();
        check(
            "a prompt in a ragged batch",
            rows(&got, b.len(), a.len()),
            &bits(&want),
        );
        // Decoded beside the others (a is the middle row of three).
        for (k, &t) in [5i64, 77, 130].iter().enumerate() {
            let got = batch
                .forward(&[(1, &[9]), (0, &[t]), (2, &[4])], OutputRows::LastOfEach)
                .unwrap();
            check(
                "a decode step beside others",
                rows(&got, 1, 1),
                &bits(&steps[k]),
            );
        }
        // Prefilled in chunks of 4, 4 and 3.
        let mut chunks = executor(&plan, &weights, threads);
        let mut got = Vec::new();
        for part in a.chunks(4) {
            got.extend(rows(
                &chunks.forward(&[(0, part)], OutputRows::All).unwrap(),
                0,
                part.len(),
            ));
        }
        check("a prompt in chunks", got, &bits(&want));
    }
    differ
}

#[test]
fn a_sequence_gets_the_same_bits_alone_in_a_ragged_batch_and_in_chunks() {
    assert_eq!(batch_comparisons(NumericsMode::Invariant), 0);
    assert!(
        batch_comparisons(NumericsMode::Fast) > 0,
        "the fast order gave the same bits in every batch: the check cannot fail"
    );
}

/// `--fuse-norm` under `--numerics invariant`: the all-reduce, the residual add and the
/// norm run as one step (the profile counts the steps, and no separate all-reduce is left)
/// and the logits keep tp=1's bits, on one thread per rank (the one-loop step) and on two
/// (prompts long enough to take the parallel ops).
#[test]
fn norm_fusion_runs_as_one_step_and_keeps_the_bits() {
    let mut checked = 0;
    for dir in fixtures() {
        let r = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let one = |tp: u64, fuse: bool| {
            compile_with(&def, tp, options(NumericsMode::Invariant, false, fuse)).map(|c| c.plan)
        };
        let Ok(plan) = one(2, true) else { continue };
        let marked = plan.ranks[0]
            .instrs
            .iter()
            .filter(|i| matches!(&i.op, tpc::ir::Op::RmsNorm(n) if n.with_reduce))
            .count() as u64;
        if marked == 0 {
            continue; // LayerNorm families
        }
        // The fixture's prompt, and two of 100 tokens beside it: the batch's sums are large
        // enough for a rank of two threads to take the unfused (parallel) ops.
        let vocab = r.logits.len() as i64 / r.prompt.len() as i64;
        let mut requests = vec![tpc::runtime::generate::Request {
            prompt: r.prompt.clone(),
            max_new_tokens: Some(r.greedy.len()),
        }];
        for salt in [3, 5] {
            requests.push(tpc::runtime::generate::Request {
                prompt: (0..100).map(|i| (i * salt + 1) % vocab).collect(),
                max_new_tokens: Some(3),
            });
        }
        let run = |plan: &Plan, threads: usize| {
            let mut opts = run_opts(threads, r.greedy.len(), Sampling::default());
            opts.profile = true;
            run_batch(plan, &ckpt, &requests, &opts).unwrap()
        };
        let want = run(&one(1, false).unwrap(), 1);
        for threads in [1, 2] {
            let got = run(&plan, threads);
            let ctx = format!("{} {threads} thread(s)", dir.display());
            let calls = |kind: &str| {
                got.profile
                    .iter()
                    .find(|(k, _)| k == kind)
                    .map_or(0, |(_, t)| t.calls[0] + t.calls[1])
            };
            let forwards = got.profiled_steps[0] + got.profiled_steps[1];
            assert_eq!(calls("all_reduce_add_rms_norm"), marked * forwards, "{ctx}");
            for (k, (seq, want)) in got.sequences.iter().zip(&want.sequences).enumerate() {
                let want_bits = bits(&want.prompt_logits);
                let got_bits = bits(&seq.prompt_logits);
                let at = got_bits.iter().zip(&want_bits).position(|(a, b)| a != b);
                assert!(
                    at.is_none() && got_bits.len() == want_bits.len(),
                    "{ctx}, sequence {k}: logit {at:?} differs from tp=1's"
                );
                assert_eq!(seq.generated, want.generated, "{ctx}, sequence {k}");
            }
            assert_eq!(
                got.sequences[0].generated, r.greedy,
                "{ctx}: HF's greedy tokens"
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} fused runs checked");
}
