//! CPU ranks as threads of this process (beside, not inside, `cpu/`: the launcher sits above
//! the generic launcher and generation, which the CPU backend's kernels sit below): the
//! threaded run over the CPU's rank factory (`cpu_rank.rs`) with in-process communicators.

use super::cpu::isa::Kernels;
use super::cpu::CpuOptions;
use super::cpu_rank::placed_cpu_backend;
use crate::plan::Plan;
use crate::runtime::error::Result;
use crate::runtime::generate::{BatchOutput, Request, RunOptions};
use crate::runtime::launch::{
    check_before_start, check_host_memory, launch_generation, local_groups,
};
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
    let mut out = launch_generation(plan, weights, comms, pipes, &make, requests, opts)?;
    out.linear_kernels = Some(kernels.linear_kernels(bf16));
    Ok(out)
}
