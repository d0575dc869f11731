//! GPU ranks as threads of this process: `tpc run --device cuda[:N,…]`. Every rank opens
//! its GPU (ranks dealt to the listed GPUs round robin, so tp 2…8 fits on one GPU), loads
//! only its own weight slices there, and talks to its peers through the host communicator
//! of the threaded runtime, staged ([`super::comm::StagedComm`]).

use super::backend::CudaBackend;
use super::comm::StagedComm;
use super::device::{device_count, GpuRank};
use super::CudaError;
use crate::plan::Plan;
use crate::runtime::error::Result;
use crate::runtime::generate::{check_requests, BatchOutput, Request, RunOptions};
use crate::runtime::launch::{launch_stages, local_groups};
use crate::runtime::weights::WeightSource;

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

/// [`crate::runtime::launch::run_batch`] with every rank on a GPU.
pub fn run_batch_cuda(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    listed: &[usize],
) -> Result<BatchOutput> {
    check_requests(plan, requests, opts)?;
    // The devices first: a machine without a driver is told so before any weight is read.
    let devices = gpus(listed)?;
    weights.check(plan)?;
    let (comms, pipes) = local_groups(plan)?;
    let comms: Vec<StagedComm<_>> = comms.into_iter().map(StagedComm::new).collect();
    let pipes: Vec<StagedComm<_>> = pipes.into_iter().map(StagedComm::new).collect();
    let bf16 = opts.dtype.bf16_linears(plan);
    let make = |rank: usize| -> Result<CudaBackend> {
        let gpu = GpuRank::open(rank, devices[rank % devices.len()])?;
        Ok(CudaBackend::new(gpu, bf16))
    };
    launch_stages(plan, weights, comms, pipes, &make, &|rt| {
        rt.generate(requests, opts)
    })
}
