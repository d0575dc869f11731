//! A run on the chosen device: [`run_batch`] hands the plan to the device's launcher (CPU
//! ranks as threads, or GPU ranks as threads with feature `cuda`); [`run`] is one prompt;
//! [`serve_on_device`] starts the serving engine the same way.

use super::engine::api::Serving;
use super::engine::launch::{serve_cpu, EngineOptions};
use super::error::{Result, RunError};
use super::generate::{BatchOutput, ComputeDtype, Device, Request, RunOptions, SequenceOutput};
use super::weights::WeightSource;
use crate::plan::Plan;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Runs `plan` over `weights` on `opts.device` and generates for every request.
pub fn run_batch(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
) -> Result<BatchOutput> {
    match &opts.device {
        Device::Cpu(cpu) => super::cpu_launch::run_batch_cpu(plan, weights, requests, opts, cpu),
        Device::Cuda(listed) => run_on_gpus(plan, weights, requests, opts, listed),
    }
}

#[cfg(feature = "cuda")]
fn run_on_gpus(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    listed: &[usize],
) -> Result<BatchOutput> {
    super::cuda::launch::run_batch_cuda(plan, weights, requests, opts, listed)
}

#[cfg(not(feature = "cuda"))]
fn run_on_gpus(
    _: &Plan,
    _: &dyn WeightSource,
    _: &[Request],
    _: &RunOptions,
    _: &[usize],
) -> Result<BatchOutput> {
    Err(no_cuda())
}

/// What `--device cuda` is in a build without the feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda() -> RunError {
    RunError::DeviceUnavailable(
        "--device cuda: this tpc was built without CUDA; build it with `cargo build --release --features cuda` (building needs no CUDA; running needs the NVIDIA driver, NVRTC and cuBLAS)".into(),
    )
}

/// Starts the serving engine over `plan` on `device` with `dp` replicas and runs `client`
/// with it, as `engine::launch::serve_cpu` (or `cuda::serve::serve_cuda`) does.
pub fn serve_on_device<T: Send>(
    plan: &Plan,
    weights: &dyn WeightSource,
    device: &Device,
    dtype: ComputeDtype,
    opts: &EngineOptions,
    dp: usize,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    match device {
        Device::Cpu(cpu) => serve_cpu(plan, weights, cpu, dtype, opts, dp, client),
        #[cfg(feature = "cuda")]
        Device::Cuda(listed) => {
            super::cuda::serve::serve_cuda(plan, weights, listed, dtype, opts, dp, client)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(no_cuda()),
    }
}

/// [`run_batch`] for one prompt: its tokens and prompt logits.
pub fn run(
    plan: &Plan,
    weights: &dyn WeightSource,
    prompt: &[i64],
    opts: &RunOptions,
) -> Result<SequenceOutput> {
    let request = Request {
        prompt: prompt.to_vec(),
        max_new_tokens: None,
    };
    run_batch(plan, weights, std::slice::from_ref(&request), opts)?
        .sequences
        .pop()
        .ok_or(RunError::EmptyPrompt)
}
