//! Serving with ranks as MPI processes (`mpirun -np W tpc serve …`, feature `mpi`): one
//! engine over every process of the job, each process one rank of the plan on its CPU. The
//! process of the leading rank (tp rank 0 of the last stage) holds the scheduler and runs
//! the client (the HTTP server); the others only follow its steps. The KV pool must be the
//! same on every rank, so its size is the least any rank would give from its host.

use super::MpiWorld;
use crate::plan::stages::stage_program;
use crate::plan::Plan;
use crate::runtime::cpu::isa::Kernels;
use crate::runtime::cpu::CpuOptions;
use crate::runtime::cpu_rank::cpu_backend;
use crate::runtime::engine::api::Serving;
use crate::runtime::engine::handle::EngineHandle;
use crate::runtime::engine::launch::{kv_memory, prepare, serve_with, EngineOptions};
use crate::runtime::engine::metrics::Metrics;
use crate::runtime::error::{Result, RunError};
use crate::runtime::generate::{rank_runtime, stage_runtime, ComputeDtype};
use crate::runtime::rank_groups::rank_groups;
use crate::runtime::weights::WeightSource;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// This process's rank of an engine over `plan` on its CPU. `client` runs in the process of
/// the leading rank only, once every rank has loaded, with the engine and a receiver that
/// disconnects when the engine stops. Returns this rank's result and, in the leading
/// process, the client's.
pub fn serve_mpi<T: Send>(
    mpi: &MpiWorld,
    plan: &Plan,
    weights: &dyn WeightSource,
    cpu: &CpuOptions,
    dtype: ComputeDtype,
    opts: &EngineOptions,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    let (me, world) = (mpi.rank(), mpi.size());
    let (tp, pp) = (plan.ranks.len(), plan.pp());
    if Some(world) != tp.checked_mul(pp) {
        return Err(RunError::Processes(format!(
            "mpirun -np {world} tpc serve: one server's engine takes tp · pp = {} processes, no more and no fewer; for replicas start one server per replica, or use --dp with ranks as threads",
            tp.saturating_mul(pp)
        )));
    }
    let groups = rank_groups(world as u64, tp as u64, pp as u64, 1)
        .map_err(|e| RunError::Processes(format!("mpirun -np {world}: {e}")))?;
    weights.check(plan)?;
    let coords = groups.ranks[me];
    // Collective over the world, in the same order on every process.
    let comm = mpi.split_groups(&groups.tp_groups)?;
    let pipe = if pp > 1 {
        Some(mpi.split_groups(&groups.pp_groups)?)
    } else {
        None
    };
    let on_host = mpi.ranks_on_host();
    let bf16 = dtype.bf16_linears(plan);
    let kernels = Kernels::select(cpu.isa)?;
    let (weight_bytes, _) = crate::runtime::memory::least_run_bytes(plan, bf16, 0);
    // The weights of this host's ranks, about: every rank holds a like share.
    let host_weights = weight_bytes / world.max(1) as u64 * on_host as u64;
    let memory = mpi.all_min(kv_memory(opts, on_host, host_weights))?;
    let opts = EngineOptions {
        kv_cache_memory: Some(memory),
        ..opts.clone()
    };
    let registry = Arc::new(prometheus::Registry::new());
    let setup = prepare(
        plan,
        &opts,
        on_host,
        host_weights,
        Metrics::in_registry(registry, None),
    )?;
    let backend = cpu_backend(me, cpu.threads_per_rank(on_host), &[], bf16, kernels)?;
    let stage;
    let mut rt = match pipe {
        Some(pipe) => {
            stage =
                stage_program(plan, coords.tp, coords.pp).map_err(|e| RunError::Input(e.into()))?;
            stage_runtime(&stage, backend, comm, pipe, weights)?
        }
        None => rank_runtime(plan, coords.tp, backend, comm, weights)?,
    };
    let front = |handle: Arc<EngineHandle>, stopped: Receiver<()>| client(handle, stopped);
    Ok(serve_with(setup, None, front, |body| body.run(&mut rt)))
}
