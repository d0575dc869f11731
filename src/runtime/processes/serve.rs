//! Serving with ranks as MPI processes (`mpirun -np W tpc serve …`, feature `mpi`): one
//! engine over every process of the job, each process one rank of the plan on its CPU or,
//! with `--device cuda` (feature `cuda`), on a GPU of its host (`gpu.rs`). The process of
//! the leading rank (tp rank 0 of the last stage) holds the scheduler and runs the client
//! (the HTTP server); the others only follow its steps. The KV pool must be the same on
//! every rank, so its size is the least any rank would give from its host or its GPU.

use super::MpiWorld;
use crate::plan::stages::stage_program;
use crate::plan::Plan;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::Collectives;
use crate::runtime::cpu::isa::Kernels;
use crate::runtime::cpu_rank::cpu_backend;
use crate::runtime::engine::api::Serving;
use crate::runtime::engine::handle::EngineHandle;
use crate::runtime::engine::launch::{kv_memory, prepare, serve_with, EngineOptions, EngineSetup};
use crate::runtime::engine::metrics::Metrics;
use crate::runtime::error::{Result, RunError};
use crate::runtime::generate::{rank_runtime, stage_runtime, ComputeDtype, Device};
use crate::runtime::rank_groups::rank_groups;
use crate::runtime::weights::WeightSource;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// This process's rank of an engine over `plan` on `device`. `client` runs in the process of
/// the leading rank only, once every rank has loaded, with the engine and a receiver that
/// disconnects when the engine stops. Returns this rank's result and, in the leading
/// process, the client's.
pub fn serve_mpi<T: Send>(
    mpi: &MpiWorld,
    plan: &Plan,
    weights: &dyn WeightSource,
    device: &Device,
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
    let place = Place {
        tp: coords.tp,
        stage: coords.pp,
    };
    // Collective over the world, in the same order on every process.
    let comm = mpi.split_groups(&groups.tp_groups)?;
    let pipe = if pp > 1 {
        Some(mpi.split_groups(&groups.pp_groups)?)
    } else {
        None
    };
    let host = mpi.place_on_host();
    let on_host = host.1;
    let bf16 = dtype.bf16_linears(plan);
    let (weight_bytes, _) = crate::runtime::memory::least_run_bytes(plan, bf16, 0);
    // The engine, its pool `memory` bytes a rank: the least over the ranks (collective).
    let engine = |memory: u64| -> Result<EngineSetup> {
        let opts = EngineOptions {
            kv_cache_memory: Some(mpi.all_min(memory)?),
            ..opts.clone()
        };
        let registry = Arc::new(prometheus::Registry::new());
        let metrics = Metrics::in_registry(registry, None);
        prepare(plan, &opts, on_host, weight_bytes, metrics)
    };
    match device {
        Device::Cpu(cpu) => {
            let kernels = Kernels::select(cpu.isa)?;
            // The weights of this host's ranks, about: every rank holds a like share.
            let host_weights = weight_bytes / world.max(1) as u64 * on_host as u64;
            let setup = engine(kv_memory(opts, on_host, host_weights))?;
            let backend = cpu_backend(me, cpu.threads_per_rank(on_host), &[], bf16, kernels)?;
            serve_rank(plan, place, (backend, comm, pipe), weights, setup, client)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(listed) => {
            use crate::runtime::cuda::comm::GpuComm;
            let p = super::gpu::GpuProcess {
                mpi,
                me,
                tp_rank: coords.tp,
                stage: coords.pp,
                listed,
                host,
            };
            let opened = super::gpu::open_gpu_rank(&p, tp, comm)?;
            let per_rank_weights = weight_bytes / world.max(1) as u64;
            let memory = match opts.kv_cache_memory {
                Some(m) => m,
                None => crate::runtime::cuda::serve::kv_bytes_on(
                    opened.ordinal,
                    opened.sharing as u64,
                    per_rank_weights,
                )?,
            };
            let setup = engine(memory)?;
            let backend = crate::runtime::cuda::backend::CudaBackend::new(opened.gpu, bf16);
            let pipe = pipe.map(|p| GpuComm::new(p, None, None));
            serve_rank(plan, place, (backend, opened.comm, pipe), weights, setup, client)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(RunError::DeviceUnavailable(
            "--device cuda: this tpc was built without CUDA; build it with `cargo build --release --features mpi,cuda`".into(),
        )),
    }
}

/// A rank's tp rank and stage.
#[derive(Clone, Copy)]
struct Place {
    tp: usize,
    stage: usize,
}

/// Runs this rank of the engine `setup` on `backend`, its tp group `comm` and its pipeline
/// link `pipe` (with stages), the client in the leading process.
fn serve_rank<B: Backend, C: Collectives<B::Act>, T: Send>(
    plan: &Plan,
    place: Place,
    (backend, comm, pipe): (B, C, Option<C>),
    weights: &dyn WeightSource,
    setup: EngineSetup,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    let stage;
    let mut rt = match pipe {
        Some(pipe) => {
            stage = stage_program(plan, place.tp, place.stage)
                .map_err(|e| RunError::Input(e.into()))?;
            stage_runtime(&stage, backend, comm, pipe, weights)?
        }
        None => rank_runtime(plan, place.tp, backend, comm, weights)?,
    };
    let front = |handle: Arc<EngineHandle>, stopped: Receiver<()>| client(handle, stopped);
    Ok(serve_with(setup, None, front, |body| body.run(&mut rt)))
}
