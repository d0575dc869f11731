//! Serving with ranks as MPI processes (`mpirun -np W tpc serve …`, feature `mpi`): an
//! engine per replica (`--dp D`: W = D · tp · pp), each process one rank of the plan on its
//! CPU or, with `--device cuda` (feature `cuda`), on a GPU of its host (`gpu.rs`). The
//! process of a replica's leading rank (tp rank 0 of its last stage) holds its scheduler;
//! the others only follow its steps. Replica 0's leading process runs the client (the HTTP
//! server) over its own engine and, with replicas, over the others' through the replica
//! link (`crate::runtime::engine::remote`, MPI messages in `replica_link.rs`): requests go
//! to the least loaded replica. The KV pool must be the same on every rank, so its size is
//! the least any rank would give from its host or its GPU.

use super::replica_link::{MpiLink, MpiTicks};
use super::MpiWorld;
use crate::plan::stages::stage_program;
use crate::plan::Plan;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::Collectives;
use crate::runtime::cpu::isa::Kernels;
use crate::runtime::cpu_rank::cpu_backend;
use crate::runtime::engine::api::Serving;
use crate::runtime::engine::handle::EngineHandle;
use crate::runtime::engine::launch::{
    any_stops, kv_memory, prepare, serve_with, EngineOptions, EngineSetup,
};
use crate::runtime::engine::metrics::Metrics;
use crate::runtime::engine::rank::ExpertWatch;
use crate::runtime::engine::remote::LinkError;
use crate::runtime::engine::remote::{relay_requests, start_front};
use crate::runtime::engine::replicas::ReplicaSet;
use crate::runtime::error::{Result, RunError};
use crate::runtime::expert_exchange::ExpertMember;
use crate::runtime::generate::{rank_runtime_sharing, stage_runtime_sharing, ComputeDtype, Device};
use crate::runtime::rank_groups::{rank_groups, RankGroups};
use crate::runtime::weights::WeightSource;
use mpi::topology::{Communicator, SimpleCommunicator};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// This process's rank of a replica's engine over `plan` on `device`, `dp` replicas in the
/// job. `client` runs in replica 0's leading process only, once every rank of every replica
/// has loaded, with the engines (one: its own; more: the replicas behind one front) and a
/// receiver that disconnects when one stops. Returns this rank's result and, in the process
/// that ran it, the client's.
#[allow(clippy::too_many_arguments)]
pub fn serve_mpi<T: Send>(
    mpi: &MpiWorld,
    plan: &Plan,
    weights: &dyn WeightSource,
    device: &Device,
    dtype: ComputeDtype,
    opts: &EngineOptions,
    dp: usize,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    let (me, world) = (mpi.rank(), mpi.size());
    let (tp, pp) = (plan.ranks.len(), plan.pp());
    let engine_ranks = tp.saturating_mul(pp);
    if Some(world) != engine_ranks.checked_mul(dp) {
        return Err(RunError::Processes(format!(
            "mpirun -np {world} tpc serve: {dp} replica(s) of tp · pp = {engine_ranks} ranks take {} processes, no more and no fewer",
            engine_ranks.saturating_mul(dp)
        )));
    }
    if dp > 1 && !mpi.many_threads() {
        return Err(RunError::Processes(
            "serving replicas as processes needs an MPI library that provides MPI_THREAD_MULTIPLE (Open MPI does unless built without it); or serve --dp with the ranks as threads".into(),
        ));
    }
    let sharing = opts.expert_parallel && dp > 1;
    if sharing {
        super::check_expert_parallel(plan)?;
    }
    let groups = rank_groups(world as u64, tp as u64, pp as u64, dp as u64)
        .map_err(|e| RunError::Processes(format!("mpirun -np {world}: {e}")))?;
    weights.check(plan)?;
    let coords = groups.ranks[me];
    let replica = coords.ext_dp * groups.dp + coords.dp;
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
    // `--ep`: the DP group (this stage and tp rank of every replica) shares its experts,
    // member = this replica's place in it.
    let member = if sharing {
        let dp_comm = super::split_raw(&mpi.world, &groups.dp_groups, me)?;
        let member = dp_comm.rank().max(0) as usize;
        Some(ExpertMember {
            exchange: Arc::new(super::expert_exchange::MpiExchange::new(dp_comm)),
            member,
        })
    } else {
        None
    };
    let (link, watch) = match replica_link(mpi, &groups, dp)? {
        Some(leaders) => {
            // The leading ranks tick on a communicator of their own (`ticks.rs`).
            let watch =
                sharing.then(|| ExpertWatch::Ticks(Box::new(MpiTicks::new(leaders.duplicate()))));
            (Some(MpiLink::new(leaders)), watch)
        }
        None => (None, None),
    };
    let sharing_rank = Sharing { member, watch };
    let host = mpi.place_on_host();
    let on_host = host.1;
    let bf16 = dtype.bf16_linears(plan);
    let (weight_bytes, _) = crate::runtime::memory::least_run_bytes(plan, bf16, 0);
    // One replica's weights over its ranks: what one process holds, about.
    let per_rank_weights = weight_bytes / engine_ranks.max(1) as u64;
    let registry = Arc::new(prometheus::Registry::new());
    // The engine, its pool `memory` bytes a rank: the least over the ranks (collective).
    let engine = |memory: u64| -> Result<EngineSetup> {
        let opts = EngineOptions {
            kv_cache_memory: Some(mpi.all_min(memory)?),
            ..opts.clone()
        };
        let metrics = Metrics::in_registry(registry.clone(), (dp > 1).then_some(replica));
        prepare(plan, &opts, on_host, weight_bytes, metrics)
    };
    let client = |engine: Arc<dyn Serving>, stopped: Receiver<()>| {
        front_or_relay(link, dp, registry.clone(), engine, stopped, client)
    };
    match device {
        Device::Cpu(cpu) => {
            let kernels = Kernels::select(cpu.isa)?;
            // The weights of this host's ranks, about: every rank holds a like share.
            let host_weights = per_rank_weights.saturating_mul(on_host as u64);
            let setup = engine(kv_memory(opts, on_host, host_weights))?;
            let backend = cpu_backend(me, cpu.threads_per_rank(on_host), &[], bf16, kernels)?;
            let ranks = (backend, comm, pipe);
            let out = serve_rank(plan, place, ranks, sharing_rank, weights, setup, client)?;
            Ok(client_outcome(out))
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
            let ranks = (backend, opened.comm, pipe);
            let out = serve_rank(plan, place, ranks, sharing_rank, weights, setup, client)?;
            Ok(client_outcome(out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(RunError::DeviceUnavailable(
            "--device cuda: this tpc was built without CUDA; build it with `cargo build --release --features mpi,cuda`".into(),
        )),
    }
}

/// The communicator of the replicas' leading processes (ranked by replica), in a process
/// that leads one where there are replicas. Collective over the world.
fn replica_link(
    mpi: &MpiWorld,
    groups: &RankGroups,
    dp: usize,
) -> Result<Option<SimpleCommunicator>> {
    if dp < 2 {
        return Ok(None);
    }
    let leaders: Vec<usize> = (0..dp)
        .map(|r| {
            super::lead_of(groups, r).ok_or_else(|| {
                RunError::Processes(format!("replica {r} has no leading rank (a bug in tpc)"))
            })
        })
        .collect::<Result<_>>()?;
    let me = mpi.rank();
    // Every other process in a group of its own.
    let mut split: Vec<Vec<usize>> = vec![leaders.clone()];
    split.extend(
        (0..mpi.size())
            .filter(|r| !leaders.contains(r))
            .map(|r| vec![r]),
    );
    let comm = super::split_raw(&mpi.world, &split, me)?;
    Ok(leaders.contains(&me).then_some(comm))
}

/// How a rank shares its experts with the other replicas (`--ep`): its seat in its DP
/// group's exchange, and on a leading rank how it learns of the others' calls.
struct Sharing {
    member: Option<ExpertMember>,
    watch: Option<ExpertWatch>,
}

/// What the client of a leading process runs: in replica 0's, the front (over the other
/// replicas through `link`, their metrics scraped into `registry`) and then `client`; in
/// another replica's, the relay of the front's requests to its engine.
fn front_or_relay<T>(
    link: Option<MpiLink>,
    dp: usize,
    registry: Arc<prometheus::Registry>,
    engine: Arc<dyn Serving>,
    stopped: Receiver<()>,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T,
) -> std::result::Result<Option<T>, LinkError> {
    let Some(mut link) = link else {
        return Ok(Some(client(engine, stopped)));
    };
    if link.is_front() {
        let info = engine.info().clone();
        let (remotes, stops, relay) = start_front(Box::new(link), dp - 1, &info, registry.clone())?;
        let mut replicas: Vec<Arc<dyn Serving>> = vec![engine];
        replicas.extend(remotes.into_iter().map(|r| r as Arc<dyn Serving>));
        let front: Arc<dyn Serving> = Arc::new(ReplicaSet::new(replicas, registry));
        let out = client(front, any_stops(std::iter::once(stopped).chain(stops)));
        relay.close()?;
        Ok(Some(out))
    } else {
        relay_requests(&mut link, engine, stopped)?;
        Ok(None)
    }
}

/// This rank's result and the client's, a broken replica link counted as this rank's
/// failure.
fn client_outcome<T>(
    (engine, client): (
        Result<()>,
        Option<std::result::Result<Option<T>, LinkError>>,
    ),
) -> (Result<()>, Option<T>) {
    match client {
        Some(Err(e)) => (
            engine.and(Err(RunError::Processes(format!("the replicas' link: {e}")))),
            None,
        ),
        Some(Ok(t)) => (engine, t),
        None => (engine, None),
    }
}

/// A rank's tp rank and stage.
#[derive(Clone, Copy)]
struct Place {
    tp: usize,
    stage: usize,
}

/// Runs this rank of the engine `setup` on `backend`, its tp group `comm` and its pipeline
/// link `pipe` (with stages), sharing its experts as `sharing` says, the client in the
/// leading process.
fn serve_rank<B: Backend, C: Collectives<B::Act>, T: Send>(
    plan: &Plan,
    place: Place,
    (backend, comm, pipe): (B, C, Option<C>),
    sharing: Sharing,
    weights: &dyn WeightSource,
    setup: EngineSetup,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    let stage;
    let member = sharing.member;
    let mut rt = match pipe {
        Some(pipe) => {
            stage = stage_program(plan, place.tp, place.stage)
                .map_err(|e| RunError::Input(e.into()))?;
            stage_runtime_sharing(&stage, backend, comm, pipe, weights, member)?
        }
        None => rank_runtime_sharing(plan, place.tp, backend, comm, weights, member)?,
    };
    let front = |handle: Arc<EngineHandle>, stopped: Receiver<()>| client(handle, stopped);
    Ok(serve_with(setup, sharing.watch, front, |body| {
        body.run(&mut rt)
    }))
}
