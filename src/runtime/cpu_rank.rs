//! The CPU's rank factory, for every launcher and the serving engine (beside `cpu/`, below
//! the launchers): one rank's backend with its compute threads, pinned or not, bf16 linear
//! weights or not, and the chosen kernels.

use super::cpu::affinity;
use super::cpu::isa::Kernels;
use super::cpu::CpuBackend;
use crate::runtime::error::{Result, RunError};

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
