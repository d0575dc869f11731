//! Data parallelism (`tpc run --dp D`): D independent replicas of the same plan, each its own
//! tp ranks (threads) with its own copy of the weights, the requests dealt out round robin
//! and the results put back in request order. Replicas never communicate: a sequence's
//! tokens do not depend on which replica ran it or beside which others (every sequence
//! samples from its own seeded generator, and a batch gives each sequence what it gives it
//! alone), so `--dp D` prints what `--dp 1` prints.
//!
//! Except under `--ep`: then each tp rank's experts are dealt over the replicas (the EP group
//! DP × TP of `tpc ranks`), and the replicas swap tokens at every mixture-of-experts layer
//! (`expert_exchange`, `moe_across`). A sequence's tokens are then the same as at `--dp 1`
//! up to the order in which its experts' outputs are added.

use super::cpu::CpuOptions;
use super::ep_group::{expert_seats_for, failing_replica};
use super::error::{Result, RunError};
use super::generate::{
    check_requests, BatchOutput, Device, OnFinished, Progress, Request, RunOptions, Stage,
};
use super::launch::{check_host_memory, check_replicas};
use super::run::run_batch;
use super::weights::WeightSource;
use crate::plan::Plan;
use std::sync::{Arc, Mutex};

/// The replica request `i` goes to, and its index there: round robin.
pub fn placement(i: usize, dp: usize) -> (usize, usize) {
    (i % dp, i / dp)
}

/// Runs `requests` over `dp` replicas of `plan` at once. Each rank gets cores / (tp · dp)
/// threads unless `opts` says. Timings are the slowest replica's (each replica's best timed
/// repeat: replicas are not synchronized between repeats);
/// rank-0 figures (collective bytes, all-reduce tally, weight bytes, profile, kernels) are
/// replica 0's. `--pin` is not supported with more than one replica (every replica would
/// pin to the same cores).
pub fn run_replicas(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    dp: usize,
) -> Result<BatchOutput> {
    check_replicas(dp)?;
    // Replicas beyond the requests would have nothing to run.
    let dp = dp.min(requests.len().max(1));
    if dp == 1 {
        return run_batch(plan, weights, requests, opts);
    }
    if opts.device.cpu_options().is_some_and(|c| c.pin_threads) {
        return Err(RunError::Replicas(
            "--pin places every replica's ranks on the same cores; use it with --dp 1".into(),
        ));
    }
    // Requests are checked by their index in the whole batch, before any replica starts.
    check_requests(plan, requests, opts)?;
    // Every replica holds the weights: refuse what cannot fit before any is loaded.
    check_host_memory(plan, requests, opts, dp as u64)?;
    // Every replica's ranks share this host's cores.
    let ranks = plan.ranks.len().max(1).saturating_mul(dp);
    let device = match &opts.device {
        Device::Cpu(cpu) => Device::Cpu(CpuOptions {
            threads_per_rank: cpu.threads_per_rank(ranks),
            ..cpu.clone()
        }),
        other => other.clone(),
    };
    let seats = if opts.expert_parallel {
        Some(expert_seats_for(plan, dp)?)
    } else {
        None
    };
    let mut parts: Vec<Vec<Request>> = vec![Vec::new(); dp];
    for (i, r) in requests.iter().enumerate() {
        parts[placement(i, dp).0].push(r.clone());
    }
    // Tokens so far per replica, summed for the caller's progress.
    let tokens = Arc::new(Mutex::new(vec![0usize; dp]));
    let outputs: Vec<Result<BatchOutput>> = std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(replica, part)| {
                let mut o = opts.clone();
                o.device = device.clone();
                o.expert_seat = seats.as_ref().map(|s| s[replica].clone());
                o.on_finished = opts.on_finished.as_ref().map(|f| {
                    let f = f.clone();
                    Arc::new(move |j: usize, t: &[i64]| f(j * dp + replica, t)) as OnFinished
                });
                o.progress = opts.progress.as_ref().map(|p| {
                    let (p, tokens) = (p.clone(), tokens.clone());
                    Arc::new(move |stage: Stage| match stage {
                        Stage::Token(n) => {
                            let total = tokens.lock().map(|mut t| {
                                t[replica] = n;
                                t.iter().sum()
                            });
                            if let Ok(total) = total {
                                p(Stage::Token(total));
                            }
                        }
                        // One replica's word for the stages: replica 0's.
                        other if replica == 0 => p(other),
                        _ => {}
                    }) as Progress
                });
                scope.spawn(move || {
                    let out = run_batch(plan, weights, part, &o);
                    // Whatever its end, the replica's ranks are gone: the others must not
                    // wait on its experts (after a normal end none does).
                    if let Some(seat) = &o.expert_seat {
                        seat.leave("its run ended");
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(replica, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(RunError::Replicas(format!("replica {replica} panicked")))
                })
            })
            .collect()
    });
    merge(outputs, requests.len(), dp, seats.is_some())
}

/// The replicas' outputs as one batch in request order (the first failure, with its
/// replica, if any failed).
fn merge(
    outputs: Vec<Result<BatchOutput>>,
    n: usize,
    dp: usize,
    sharing_experts: bool,
) -> Result<BatchOutput> {
    let mut outputs = outputs;
    if let Some(replica) = failing_replica(&outputs) {
        if let Err(e) = outputs.swap_remove(replica) {
            return Err(RunError::Replicas(format!("replica {replica}: {e}")));
        }
    }
    let mut parts: Vec<BatchOutput> = outputs.into_iter().flatten().collect();
    // Under --ep every replica's ranks are members of one EP group: all their loads.
    let routed_pairs_per_rank = if sharing_experts {
        parts
            .iter()
            .flat_map(|p| p.routed_pairs_per_rank.iter().copied())
            .collect()
    } else {
        parts
            .first()
            .map(|p| p.routed_pairs_per_rank.clone())
            .unwrap_or_default()
    };
    let mut slots: Vec<Vec<Option<_>>> = parts
        .iter_mut()
        .map(|p| {
            std::mem::take(&mut p.sequences)
                .into_iter()
                .map(Some)
                .collect()
        })
        .collect();
    let mut sequences = Vec::with_capacity(n);
    for i in 0..n {
        let (replica, j) = placement(i, dp);
        let seq = slots
            .get_mut(replica)
            .and_then(|s| s.get_mut(j))
            .and_then(Option::take)
            .ok_or_else(|| {
                RunError::Replicas(format!("replica {replica} returned no sequence {j}"))
            })?;
        sequences.push(seq);
    }
    let max = |f: fn(&BatchOutput) -> f64| parts.iter().map(f).fold(0.0, f64::max);
    let (load_seconds, prefill_seconds, decode_seconds) = (
        max(|p| p.load_seconds),
        max(|p| p.prefill_seconds),
        max(|p| p.decode_seconds),
    );
    let prompt_tokens = parts.iter().map(|p| p.prompt_tokens).sum();
    let first = parts.swap_remove(0);
    Ok(BatchOutput {
        sequences,
        routed_pairs_per_rank,
        prompt_tokens,
        load_seconds,
        prefill_seconds,
        decode_seconds,
        ..first
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_dealt_round_robin() {
        let got: Vec<_> = (0..7).map(|i| placement(i, 3)).collect();
        assert_eq!(
            got,
            [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
        );
    }
}
