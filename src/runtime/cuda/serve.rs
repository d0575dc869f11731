//! The serving engine on GPU ranks as threads (`tpc serve --device cuda[:N,…]`): the ranks
//! laid on the GPUs as `tpc run` lays them, each with its paged KV pool on its GPU, sized
//! from `--kv-cache-memory` or from the memory the GPUs have free.

use super::launch::{gpu_groups, gpus, open_rank, GpuGroups};
use super::CudaError;
use crate::plan::Plan;
use crate::runtime::engine::api::Serving;
use crate::runtime::engine::launch::{
    prepare, serve_replicas, serve_threads, serving_seats, EngineOptions, EngineSetup, HandOver,
};
use crate::runtime::error::{Result, RunError};
use crate::runtime::generate::ComputeDtype;
use crate::runtime::launch::check_replicas;
use crate::runtime::weights::WeightSource;
use cudarc::driver::CudaContext;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// The share of a GPU's memory, free once its ranks' weights are in, that the KV pools take
/// by default (the rest: activations, cuBLAS workspaces, the collectives' buffers).
const DEFAULT_KV_SHARE: f64 = 0.8;

/// Bytes free on GPU `ordinal` now.
fn free_bytes(ordinal: usize) -> Result<u64> {
    let driver = |what: &str, e: cudarc::driver::DriverError| {
        RunError::from(CudaError::Driver {
            what: format!("{what} GPU {ordinal}"),
            error: format!("{e:?}"),
        })
    };
    let ctx = CudaContext::new(ordinal).map_err(|e| driver("opening", e))?;
    let (free, _) = ctx
        .mem_get_info()
        .map_err(|e| driver("reading the free memory of", e))?;
    Ok(free as u64)
}

/// KV bytes per rank when none are given: on every GPU, [`DEFAULT_KV_SHARE`] of what is
/// free after the weights of the ranks it holds, split among them; the least over the GPUs.
/// `ranks` ranks in all (every replica's), rank `r` on `devices[r % len]`.
fn default_kv_bytes(
    plan: &Plan,
    devices: &[usize],
    ranks: usize,
    weight_bytes: u64,
) -> Result<u64> {
    let per_rank_weights = weight_bytes / plan.world().max(1) as u64;
    let mut least = u64::MAX;
    let mut seen = Vec::new();
    for rank in 0..ranks.max(1) {
        let ordinal = devices[rank % devices.len()];
        if seen.contains(&ordinal) {
            continue;
        }
        seen.push(ordinal);
        let ranks_here = (0..ranks)
            .filter(|r| devices[r % devices.len()] == ordinal)
            .count() as u64;
        least = least.min(kv_bytes_on(ordinal, ranks_here, per_rank_weights)?);
    }
    Ok(least)
}

/// KV bytes for each of the `ranks_here` ranks on GPU `ordinal`, each with
/// `per_rank_weights` bytes of weights: [`DEFAULT_KV_SHARE`] of what is free after them.
pub(crate) fn kv_bytes_on(ordinal: usize, ranks_here: u64, per_rank_weights: u64) -> Result<u64> {
    let spare = free_bytes(ordinal)?.saturating_sub(per_rank_weights.saturating_mul(ranks_here));
    Ok((spare as f64 * DEFAULT_KV_SHARE) as u64 / ranks_here.max(1))
}

/// Engines over `plan` on GPU ranks as threads (`listed` GPUs, or all), `dp` replicas of
/// them behind one [`Serving`]: replica `d`'s rank `r` on the GPU of global rank
/// `d · world + r`, dealt round the GPUs as `tpc run` deals ranks. `client` runs once every
/// replica has loaded, with the engines and a receiver that hears (or disconnects) when one
/// stops. Returns the first engine failure, else Ok, and the client's result.
pub fn serve_cuda<T: Send>(
    plan: &Plan,
    weights: &dyn WeightSource,
    listed: &[usize],
    dtype: ComputeDtype,
    opts: &EngineOptions,
    dp: usize,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    check_replicas(dp)?;
    // The devices first: a machine without a driver is told so before any weight is read.
    let devices = gpus(listed)?;
    weights.check(plan)?;
    let bf16 = dtype.bf16_linears(plan);
    let (weight_bytes, _) = crate::runtime::memory::least_run_bytes(plan, bf16, 0);
    let world = plan.world().max(1);
    let opts = match opts.kv_cache_memory {
        Some(_) => opts.clone(),
        None => EngineOptions {
            kv_cache_memory: Some(default_kv_bytes(
                plan,
                &devices,
                world.saturating_mul(dp),
                weight_bytes,
            )?),
            ..opts.clone()
        },
    };
    let seats = serving_seats(plan, &opts, dp)?;
    let run_replica = |d: usize, setup: EngineSetup, hand_over: HandOver| {
        // This replica's ranks start where the previous replica's ended.
        let mut on = devices.clone();
        let first = d.saturating_mul(world) % on.len();
        on.rotate_left(first);
        let GpuGroups { comms, pipes, gpus } = gpu_groups(plan, &on)?;
        let make = |rank: usize| open_rank(rank, &on, &gpus, bf16);
        let seat = seats.as_ref().and_then(|s| s.get(d));
        serve_threads(plan, weights, comms, pipes, &make, seat, setup, hand_over).0
    };
    let setup = |metrics| prepare(plan, &opts, world, weight_bytes, metrics);
    serve_replicas(dp, &setup, &run_replica, client)
}
