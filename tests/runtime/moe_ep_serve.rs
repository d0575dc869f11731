//! Serving with experts dealt over the replicas (`tpc serve --dp D --ep`): the replicas'
//! engines take requests independently, yet every mixture-of-experts layer is a round of
//! the whole DP group, so a replica with no requests answers the others between its own.
//! Every MoE fixture served this way gives each request the greedy tokens it gets alone at
//! `--dp 1` (HF's for HF's prompt), whether one replica does all the work while the others
//! only answer, or requests arrive staggered over all of them, with one pipeline stage or
//! two; the server drains and stops cleanly; a replica that cannot load stops the others
//! with its own error.

use super::engine_serve::greedy;
use super::moe_ep::{staged_plan, ReadsFail};
use crate::common;
use common::read_reference;

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tpc::ir::ExpertSplit;
use tpc::plan::Plan;
use tpc::runtime::cpu::CpuOptions;
use tpc::runtime::engine::api::{Event, FinishReason, GenRequest, Serving};
use tpc::runtime::engine::launch::{serve_cpu, EngineOptions};
use tpc::runtime::generate::{ComputeDtype, Request, RunOptions};
use tpc::runtime::replicas::run_replicas;
use tpc::runtime::weights::{Checkpoint, WeightSource};

fn exact_cpu() -> CpuOptions {
    CpuOptions {
        isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
        ..Default::default()
    }
}

/// Each request's greedy tokens alone at `--dp 1` (`tpc run`'s path, exact kernels).
fn alone(plan: &Plan, ckpt: &Checkpoint, r: &GenRequest) -> Vec<i64> {
    let opts = RunOptions {
        max_new_tokens: r.max_tokens,
        device: tpc::runtime::device::Device::Cpu(exact_cpu()),
        ..Default::default()
    };
    let one = Request {
        prompt: r.prompt.clone(),
        max_new_tokens: None,
    };
    run_replicas(plan, ckpt, &[one], &opts, 1)
        .unwrap()
        .sequences
        .remove(0)
        .generated
}

fn ep_options() -> EngineOptions {
    EngineOptions {
        kv_cache_memory: Some(16 << 20),
        expert_parallel: true,
        ..Default::default()
    }
}

/// Serves `plan` on `dp` replicas sharing their experts; the `k`-th request is submitted
/// from its own thread after `k · stagger`. Each request's tokens, then the engine's end.
fn serve_ep(
    plan: &Plan,
    weights: &dyn WeightSource,
    dp: usize,
    reqs: &[GenRequest],
    stagger: Duration,
) -> tpc::runtime::error::Result<Vec<Vec<i64>>> {
    let client = |handle: Arc<dyn Serving>, _stopped: mpsc::Receiver<()>| {
        let tokens = std::thread::scope(|s| {
            let threads: Vec<_> = reqs
                .iter()
                .enumerate()
                .map(|(k, r)| {
                    let handle = handle.clone();
                    s.spawn(move || {
                        std::thread::sleep(stagger * k as u32);
                        let (tx, rx) = mpsc::channel();
                        let sink = Box::new(move |e| {
                            let _ = tx.send(e);
                        });
                        handle.submit(r.clone(), sink).unwrap();
                        let mut tokens = Vec::new();
                        for e in rx.iter() {
                            match e {
                                Event::Token { id, .. } => tokens.push(id),
                                Event::Finished { reason, .. } => {
                                    assert_eq!(reason, FinishReason::Length, "request {k}")
                                }
                                Event::Failed { message } => {
                                    panic!("request {k} failed: {message}")
                                }
                            }
                        }
                        tokens
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap())
                .collect::<Vec<_>>()
        });
        handle.drain();
        tokens
    };
    let (engine, out) = serve_cpu(
        plan,
        weights,
        &exact_cpu(),
        ComputeDtype::Auto,
        &ep_options(),
        dp,
        client,
    )?;
    engine?;
    Ok(out.expect("the client ran"))
}

#[test]
fn replicas_sharing_experts_serve_every_request_its_tokens_alone() {
    let mut runs = 0;
    for case in common::MOE_FIXTURES {
        let dir = Path::new("tests/fixtures/checkpoints").join(case);
        let reference = read_reference(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let n = reference.greedy.len();
        let hf = greedy(reference.prompt.clone(), n);
        // Prompts of our own, of several lengths, and HF's cut short.
        let mut staggered = vec![hf.clone()];
        for k in 0..4usize {
            let prompt: Vec<i64> = reference
                .prompt
                .iter()
                .cycle()
                .skip(k * 3 + 1)
                .take(2 + k * 4)
                .copied()
                .collect();
            staggered.push(greedy(prompt, 2 + k));
        }
        for (tp, pp, dp, split) in [
            (1, 1, 2, ExpertSplit::Expert),
            (1, 1, 3, ExpertSplit::Expert),
            (2, 1, 2, ExpertSplit::Tensor),
            // Two stages: the idle replica's first stage with experts hears the call.
            (1, 2, 2, ExpertSplit::Expert),
            (2, 2, 2, ExpertSplit::Tensor),
        ] {
            let what = format!("{case} tp {tp} pp {pp} dp {dp} --ep --moe {}", split.word());
            let plan = staged_plan(&dir, tp, pp, split);
            // One request: one replica computes, the others only answer its calls.
            let one = serve_ep(&plan, &ckpt, dp, std::slice::from_ref(&hf), Duration::ZERO)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(one[0], reference.greedy, "{what}: one request, HF's tokens");
            // Requests arriving one after another over every replica.
            let want: Vec<Vec<i64>> = staggered.iter().map(|r| alone(&plan, &ckpt, r)).collect();
            let got = serve_ep(&plan, &ckpt, dp, &staggered, Duration::from_millis(4))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(
                got, want,
                "{what}: staggered requests, each its tokens alone"
            );
            runs += 1;
        }
    }
    assert_eq!(runs, 20);
}

#[test]
fn a_replica_that_cannot_load_stops_the_others_with_its_own_error() {
    let dir = Path::new("tests/fixtures/checkpoints/mixtral-moe");
    let plan = staged_plan(dir, 1, 1, ExpertSplit::Expert);
    // The first read fails, and a later one (the other replica's, or the same one's).
    for after in [0, 5] {
        let source = ReadsFail::new(dir, after);
        let err = serve_ep(
            &plan,
            &source,
            2,
            &[greedy(vec![1, 2, 3], 2)],
            Duration::ZERO,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("the disk went away"), "read {after}: {err}");
    }
}
