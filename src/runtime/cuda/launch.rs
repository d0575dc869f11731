//! GPU ranks as threads of this process: `tpc run --device cuda[:N,…]`. Every rank opens
//! its GPU (ranks dealt to the listed GPUs round robin, so tp 2…8 fits on one GPU), loads
//! only its own weight slices there, and talks to its peers through the host communicator
//! of the threaded runtime ([`super::comm::GpuComm`]: staged through the host, except the
//! all-reduce of a tp group on one GPU or across distinct ones).

use super::backend::CudaBackend;
use super::comm::{GpuComm, OneShotLink};
use super::device::{device_count, GpuRank};
use super::nccl::{new_id, IdBytes, NcclLink};
use super::one_shot::OneShotGroup;
use super::CudaError;
use crate::plan::Plan;
use crate::runtime::comm::LocalComm;
use crate::runtime::error::Result;
use crate::runtime::generate::{BatchOutput, Request, RunOptions};
use crate::runtime::launch::{check_before_start, launch_generation, local_groups};
use crate::runtime::weights::WeightSource;
use std::sync::{Arc, OnceLock};

/// How a tp group all-reduces.
enum GroupPath {
    Staged,
    OneShot(Arc<OneShotGroup>),
    Nccl(IdBytes),
}

/// The GPUs a run uses: the listed ordinals, or every GPU the driver sees.
pub fn gpus(listed: &[usize]) -> std::result::Result<Vec<usize>, CudaError> {
    let count = device_count()?;
    if count == 0 {
        return Err(CudaError::NoSuchDevice { ordinal: 0, count });
    }
    if let Some(&ordinal) = listed.iter().find(|&&o| o >= count) {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    Ok(if listed.is_empty() {
        (0..count).collect()
    } else {
        listed.to_vec()
    })
}

/// The tp groups' and pipelines' communicators of GPU ranks as threads, and the slot each
/// rank's opened GPU goes into (the one-shot and NCCL all-reduces reach it there).
pub(super) struct GpuGroups {
    pub comms: Vec<GpuComm<LocalComm>>,
    pub pipes: Vec<GpuComm<LocalComm>>,
    pub gpus: Vec<Arc<OnceLock<Arc<GpuRank>>>>,
}

/// Lays `plan`'s ranks on `devices` (rank `r` on `devices[r % len]`, so tp 2…8 fits on one
/// GPU): per tp group, one GPU → the one-shot kernel; distinct GPUs → NCCL; else staged.
pub(super) fn gpu_groups(plan: &Plan, devices: &[usize]) -> Result<GpuGroups> {
    let (comms, pipes) = local_groups(plan)?;
    let tp = plan.ranks.len().max(1);
    let ordinal = |rank: usize| devices[rank % devices.len()];
    // A tp group whose ranks share one GPU all-reduces on it (global ranks g·tp .. g·tp+tp).
    let gpus: Vec<Arc<OnceLock<Arc<GpuRank>>>> = (0..comms.len())
        .map(|_| Arc::new(OnceLock::new()))
        .collect();
    let mut groups = Vec::with_capacity(comms.len() / tp);
    for first in (0..comms.len()).step_by(tp) {
        let mut on: Vec<usize> = (first..first + tp).map(ordinal).collect();
        on.sort_unstable();
        on.dedup();
        groups.push(if tp == 1 {
            GroupPath::Staged
        } else if on.len() == 1 {
            OneShotGroup::new(tp).map_or(GroupPath::Staged, GroupPath::OneShot)
        } else if on.len() == tp {
            GroupPath::Nccl(new_id()?)
        } else {
            GroupPath::Staged
        });
    }
    let comms: Vec<GpuComm<_>> = comms
        .into_iter()
        .enumerate()
        .map(|(g, host)| match &groups[g / tp] {
            GroupPath::Staged => GpuComm::new(host, None, None),
            GroupPath::OneShot(group) => {
                let link = OneShotLink {
                    group: group.clone(),
                    gpu: gpus[g].clone(),
                };
                GpuComm::new(host, Some(link), None)
            }
            GroupPath::Nccl(id) => {
                let link = NcclLink::new(*id, g % tp, tp, gpus[g].clone());
                GpuComm::new(host, None, Some(link))
            }
        })
        .collect();
    let pipes: Vec<GpuComm<_>> = pipes
        .into_iter()
        .map(|p| GpuComm::new(p, None, None))
        .collect();
    Ok(GpuGroups { comms, pipes, gpus })
}

/// Opens rank `rank`'s GPU (`devices[rank % len]`) and makes its backend, leaving the GPU
/// in the rank's slot for its communicator.
pub(super) fn open_rank(
    rank: usize,
    devices: &[usize],
    slots: &[Arc<OnceLock<Arc<GpuRank>>>],
    bf16: bool,
) -> Result<CudaBackend> {
    let gpu = Arc::new(GpuRank::open(rank, devices[rank % devices.len()])?);
    if let Some(slot) = slots.get(rank) {
        let _ = slot.set(gpu.clone());
    }
    Ok(CudaBackend::new(gpu, bf16))
}

/// [`crate::runtime::run::run_batch`] with every rank on a GPU.
pub fn run_batch_cuda(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    listed: &[usize],
) -> Result<BatchOutput> {
    // The devices first: a machine without a driver is told so before any weight is read.
    let devices = gpus(listed)?;
    check_before_start(plan, weights, requests, opts)?;
    let GpuGroups { comms, pipes, gpus } = gpu_groups(plan, &devices)?;
    let bf16 = opts.dtype.bf16_linears(plan);
    let make = |rank: usize| open_rank(rank, &devices, &gpus, bf16);
    launch_generation(plan, weights, comms, pipes, &make, requests, opts)
}
