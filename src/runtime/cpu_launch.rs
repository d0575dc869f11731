//! CPU ranks as threads of this process (beside, not inside, `cpu/`: the launcher sits above
//! the generic launcher and generation, which the CPU backend's kernels sit below): the CPU's rank factory ([`cpu_backend`]: compute
//! threads, pinned or not, bf16 linear weights or not, the chosen kernels) and the threaded
//! run over it with in-process communicators.

use super::cpu::affinity;
use super::cpu::isa::Kernels;
use super::cpu::{CpuBackend, CpuOptions};
use crate::plan::Plan;
use crate::runtime::error::{Result, RunError};
use crate::runtime::generate::{BatchOutput, Request, RunOptions};
use crate::runtime::launch::{check_before_start, check_host_memory, launch_stages, local_groups};
use crate::runtime::weights::WeightSource;

/// Runs `plan` on CPU ranks (threads) over `weights` and generates for every request.
pub fn run_batch_cpu(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    cpu: &CpuOptions,
) -> Result<BatchOutput> {
    check_before_start(plan, weights, requests, opts)?;
    let (comms, pipes) = local_groups(plan)?;
    // Stages run one after another (no micro-batches), so a rank's threads share the
    // cores with its tp group only.
    let threads = cpu.threads_per_rank(plan.ranks.len());
    let bf16 = opts.dtype.bf16_linears(plan);
    check_host_memory(plan, requests, opts, 1)?;
    let kernels = Kernels::select(cpu.isa)?;
    let make = |rank: usize| placed_cpu_backend(rank, threads, cpu.pin_threads, bf16, kernels);
    let mut out = launch_stages(plan, weights, comms, pipes, &make, &|rt| {
        rt.generate(requests, opts)
    })?;
    out.linear_kernels = Some(kernels.linear_kernels(bf16));
    Ok(out)
}

/// Rank `rank`'s CPU backend: `threads` compute threads (on `placement`'s cores where it
/// names them), bf16 linear weights or not, and the chosen kernels.
pub fn cpu_backend(
    rank: usize,
    threads: usize,
    placement: &[Option<usize>],
    bf16: bool,
    kernels: Kernels,
) -> Result<CpuBackend> {
    let backend = CpuBackend::try_pinned(threads, placement).map_err(|io| RunError::Threads {
        rank,
        threads,
        io,
    })?;
    Ok(backend.with_bf16_linears(bf16).with_kernels(kernels))
}

/// [`cpu_backend`] for `rank` on the cores [`affinity::placement`] gives it when `pin` (the
/// calling thread pinned to the first), else unpinned.
pub fn placed_cpu_backend(
    rank: usize,
    threads: usize,
    pin: bool,
    bf16: bool,
    kernels: Kernels,
) -> Result<CpuBackend> {
    let placement = if pin {
        affinity::placement(rank, threads)
    } else {
        Vec::new()
    };
    if let Some(Some(core)) = placement.first() {
        affinity::pin_current_thread(*core);
    }
    cpu_backend(rank, threads, &placement, bf16, kernels)
}
