//! Ranks as threads of this process, for any backend: [`launch_stages`] runs every rank of a
//! plan (stages or not) on its own thread with the backend a device's rank factory makes
//! (`cpu_launch.rs`, `cuda/launch.rs`) and in-process communicators ([`local_groups`]), and
//! reports the root cause of a failure. [`check_before_start`] and [`check_host_memory`] are
//! the start-up checks every launcher (threads, MPI processes, replicas) shares; `run.rs`
//! picks the device.

use super::backend::Backend;
use super::collectives::Collectives;
use super::comm::{local_group, CommError, LocalComm, MAX_LOCAL_RANKS};
use super::error::{Result, RunError};
use super::expert_exchange::ExpertSeat;
use super::generate::{
    check_requests, rank_runtime_sharing, stage_runtime_sharing, Request, RunOptions,
};
use super::rank_groups::rank_groups;
use super::weights::WeightSource;
use crate::plan::stages::{stage_program, StageProgram};
use crate::plan::Plan;
use std::sync::atomic::{AtomicU64, Ordering};

/// Runs `job` on every rank of `plan`, one thread per rank: rank `r` gets the backend
/// `backend(r)` and communicator `comms[r]`. Returns rank 0's result, or the root cause
/// of the first failure (a peer's echo of it is not the cause). A plan with pipeline
/// stages needs [`launch_stages`].
pub fn launch_threads<B, C, T>(
    plan: &Plan,
    weights: &dyn WeightSource,
    comms: Vec<C>,
    backend: &(dyn Fn(usize) -> Result<B> + Sync),
    job: &(dyn Fn(&mut super::generate::RankRuntime<'_, B, C>) -> Result<T> + Sync),
) -> Result<T>
where
    B: Backend,
    C: Collectives<B::Act>,
    T: Send,
{
    launch_stages(plan, weights, comms, Vec::new(), backend, job)
}

/// Most replicas one process runs (each holds a copy of the weights).
pub const MAX_REPLICAS: usize = 64;

/// Refuses a replica count (`--dp`) outside 1 to [`MAX_REPLICAS`].
pub fn check_replicas(dp: usize) -> Result<()> {
    if dp == 0 || dp > MAX_REPLICAS {
        return Err(RunError::Replicas(format!(
            "--dp {dp}: the number of replicas must be 1 to {MAX_REPLICAS}"
        )));
    }
    Ok(())
}

/// [`launch_threads`] for every rank of a pipelined plan (pp · tp, global rank =
/// stage · tp + tp rank): `comms[g]` is rank g's tensor-parallel group, `pipes[g]` its
/// pipeline group (empty without stages). Returns the result of tp rank 0 on the last stage.
pub fn launch_stages<B, C, T>(
    plan: &Plan,
    weights: &dyn WeightSource,
    comms: Vec<C>,
    pipes: Vec<C>,
    backend: &(dyn Fn(usize) -> Result<B> + Sync),
    job: &(dyn Fn(&mut super::generate::RankRuntime<'_, B, C>) -> Result<T> + Sync),
) -> Result<T>
where
    B: Backend,
    C: Collectives<B::Act>,
    T: Send,
{
    launch_sharing_experts(plan, weights, comms, pipes, None, backend, job)
}

/// Every rank of `plan` generating for `requests` (a device's threaded launcher): as a
/// replica sharing its experts when `opts` gives it a seat (`--ep`), each rank then loading
/// only the experts it computes. Returns the leading rank's output, with global rank 0's
/// weight bytes (the lead's are its last stage's).
pub fn launch_generation<B, C>(
    plan: &Plan,
    weights: &dyn WeightSource,
    comms: Vec<C>,
    pipes: Vec<C>,
    backend: &(dyn Fn(usize) -> Result<B> + Sync),
    requests: &[Request],
    opts: &RunOptions,
) -> Result<super::generate::BatchOutput>
where
    B: Backend,
    C: Collectives<B::Act>,
{
    let rank0_weight_bytes = AtomicU64::new(0);
    let mut out = launch_sharing_experts(
        plan,
        weights,
        comms,
        pipes,
        opts.expert_seat.as_ref(),
        backend,
        &|rt| {
            let out = rt.generate_in_expert_group(requests, opts)?;
            if rt.rank == 0 {
                rank0_weight_bytes.store(out.weight_bytes, Ordering::Relaxed);
            }
            Ok(out)
        },
    )?;
    out.weight_bytes = rank0_weight_bytes.into_inner();
    Ok(out)
}

/// [`launch_stages`] for one replica of several that share their experts (`--ep`): each
/// rank loads only the experts its seat in `seat`'s DP group computes.
pub(crate) fn launch_sharing_experts<B, C, T>(
    plan: &Plan,
    weights: &dyn WeightSource,
    comms: Vec<C>,
    pipes: Vec<C>,
    seat: Option<&ExpertSeat>,
    backend: &(dyn Fn(usize) -> Result<B> + Sync),
    job: &(dyn Fn(&mut super::generate::RankRuntime<'_, B, C>) -> Result<T> + Sync),
) -> Result<T>
where
    B: Backend,
    C: Collectives<B::Act>,
    T: Send,
{
    if let (Some(_), Some(why)) = (seat, plan.why_experts_cannot_span_replicas()) {
        return Err(RunError::Replicas(format!("--ep: {why}")));
    }
    // The plan is a contract: checked before any rank starts.
    plan.verify()?;
    let (tp, pp, world) = (plan.ranks.len(), plan.pp(), plan.world());
    let expected_pipes = if pp > 1 { world } else { 0 };
    if comms.len() != world || pipes.len() != expected_pipes {
        return Err(RunError::BadInstruction {
            name: "launch".into(),
            problem: format!(
                "{} communicators and {} pipeline links for a plan of {world} ranks ({pp} stage(s) of {tp})",
                comms.len(),
                pipes.len()
            ),
        });
    }
    let stage_programs: Vec<StageProgram> = if pp > 1 {
        (0..world)
            .map(|g| stage_program(plan, g % tp, g / tp))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| RunError::Input(e.into()))?
    } else {
        Vec::new()
    };
    let mut pipes: Vec<Option<C>> = pipes.into_iter().map(Some).collect();
    pipes.resize_with(world, || None);
    let results: Vec<std::thread::Result<Result<T>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(pipes)
            .enumerate()
            .map(|(rank, (comm, pipe))| {
                let sp = stage_programs.get(rank);
                std::thread::Builder::new()
                    .name(format!("tpc-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let b = backend(rank)?;
                        let member = seat.and_then(|s| s.member(rank));
                        let mut rt = match (sp, pipe) {
                            (Some(sp), Some(pipe)) => {
                                stage_runtime_sharing(sp, b, comm, pipe, weights, member)?
                            }
                            _ => rank_runtime_sharing(plan, rank, b, comm, weights, member)?,
                        };
                        let out = job(&mut rt);
                        if out.is_err() {
                            // Peers blocked in a collective or on a stage learn of it now.
                            rt.exec.comm.abort();
                            if let Some(link) = rt.exec.link.as_mut() {
                                link.comm.abort();
                            }
                        }
                        out
                    })
                    // A rank that cannot start drops its communicators, which releases the
                    // ranks already started.
                    .map_err(|e| RunError::RankPanicked {
                        rank,
                        message: format!("cannot start its thread: {e}"),
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join(),
                Err(e) => Ok(Err(e)),
            })
            .collect()
    });
    root_cause(results, (pp - 1) * tp)
}

/// In-process communicators for every rank of `plan`, built from the rank-group layout
/// (`tpc ranks`): each rank's tensor-parallel group and, with stages, its pipeline group.
pub fn local_groups(plan: &Plan) -> Result<(Vec<LocalComm>, Vec<LocalComm>)> {
    let (tp, pp, world) = (plan.ranks.len(), plan.pp(), plan.world());
    if world > MAX_LOCAL_RANKS {
        return Err(RunError::TooManyRanks {
            tp: world,
            max: MAX_LOCAL_RANKS,
        });
    }
    let groups = rank_groups(world as u64, tp as u64, pp as u64, 1).map_err(|e| {
        RunError::BadInstruction {
            name: "launch".into(),
            problem: e.to_string(),
        }
    })?;
    let place = |lists: &[Vec<usize>]| -> Vec<LocalComm> {
        let mut slots: Vec<Option<LocalComm>> = (0..world).map(|_| None).collect();
        for list in lists {
            for (&g, comm) in list.iter().zip(local_group(list.len())) {
                slots[g] = Some(comm);
            }
        }
        slots.into_iter().flatten().collect()
    };
    let comms = place(&groups.tp_groups);
    let pipes = if pp > 1 {
        place(&groups.pp_groups)
    } else {
        Vec::new()
    };
    Ok((comms, pipes))
}

/// Rank `lead`'s result, or the first failure that is not a peer's echo of another.
fn root_cause<T>(results: Vec<std::thread::Result<Result<T>>>, lead: usize) -> Result<T> {
    let mut first_err: Option<RunError> = None;
    let mut output = None;
    for (rank, r) in results.into_iter().enumerate() {
        let err = match r {
            Ok(Ok(out)) => {
                if rank == lead {
                    output = Some(out);
                }
                continue;
            }
            Ok(Err(e)) => e,
            Err(panic) => RunError::RankPanicked {
                rank,
                message: panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panicked".into()),
            },
        };
        let is_echo = matches!(&err, RunError::Comm(CommError::PeerFailed { .. }));
        match &first_err {
            None => first_err = Some(err),
            Some(RunError::Comm(CommError::PeerFailed { .. })) if !is_echo => first_err = Some(err),
            // Every rank reports non-finite logits; the op earliest in the program is the origin.
            Some(RunError::NonFiniteLogits { origin: seen, .. }) => {
                if let RunError::NonFiniteLogits {
                    origin: Some(o), ..
                } = &err
                {
                    if seen.as_ref().is_none_or(|s| o.index < s.index) {
                        first_err = Some(err);
                    }
                }
            }
            _ => {}
        }
    }
    match (first_err, output) {
        (Some(e), _) => Err(e),
        (None, Some(out)) => Ok(out),
        (None, None) => Err(RunError::RankPanicked {
            rank: lead,
            message: format!("rank {lead} returned nothing"),
        }),
    }
}

/// Environment variables an MPI launcher sets in every process it starts (Open MPI, then
/// the PMI/PMIx ones MPICH and Slurm use), holding the world size.
const MPI_LAUNCHER_SIZE_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];

/// Which threads of an MPI process may call MPI (feature `mpi`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiThreads {
    /// Any thread, one at a time (`MPI_THREAD_SERIALIZED`): enough for a rank.
    OneAtATime,
    /// Several at once, if the library provides it (`MPI_THREAD_MULTIPLE`): a server's
    /// replicas as processes, whose relays talk while their engines compute.
    AtOnce,
}

/// The world size an MPI launcher (`mpirun`, `srun`) gave this process, if one started it.
pub fn mpi_launched_world_size() -> Option<usize> {
    MPI_LAUNCHER_SIZE_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// The checks every launcher makes before any rank loads a weight: the requests fit the plan
/// (by their index in the whole batch), and the checkpoint holds every slice it names.
pub fn check_before_start(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
) -> Result<()> {
    check_requests(plan, requests, opts)?;
    weights.check(plan)?;
    Ok(())
}

/// For ranks that compute in this host's memory (the CPU): refuses before any weight is
/// loaded what cannot fit, `copies` copies of the weights (data-parallel replicas; one copy
/// of the experts between them under `--ep`) and KV caches for `requests`. GPU ranks
/// report their device's memory when they allocate.
pub fn check_host_memory(
    plan: &Plan,
    requests: &[Request],
    opts: &RunOptions,
    copies: u64,
) -> Result<()> {
    if opts.device.cpu_options().is_none() {
        return Ok(());
    }
    let tokens = super::generate::total_tokens(requests, opts);
    super::memory::check_fits_copies(
        plan,
        opts.dtype.bf16_linears(plan),
        tokens,
        copies,
        opts.expert_parallel,
    )
}
