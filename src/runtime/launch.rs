//! Launchers: where ranks live. [`launch_threads`] runs every rank of a plan as a thread of
//! this process with any backend and communicator; [`run`] and [`run_batch`] are the CPU
//! choice (CPU backend, in-process communicator) that `tpc run`, `bench` and `verify` use.
//! A process launcher (MPI) and GPU backends are further choices of the same seam.

use super::backend::Backend;
use super::collectives::Collectives;
use super::comm::{local_group, CommError, LocalComm, MAX_LOCAL_RANKS};
use super::cpu::affinity;
use super::cpu::isa::Kernels;
use super::cpu::CpuBackend;
use super::error::{Result, RunError};
use super::generate::{
    check_requests, rank_runtime, stage_runtime, BatchOutput, Device, Request, RunOptions,
    SequenceOutput,
};
use super::rank_groups::rank_groups;
use super::weights::WeightSource;
use crate::plan::stages::{stage_program, StageProgram};
use crate::plan::Plan;

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
                        let mut rt = match (sp, pipe) {
                            (Some(sp), Some(pipe)) => stage_runtime(sp, b, comm, pipe, weights)?,
                            _ => rank_runtime(plan, rank, b, comm, weights)?,
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

/// The world size an MPI launcher (`mpirun`, `srun`) gave this process, if one started it.
pub fn mpi_launched_world_size() -> Option<usize> {
    MPI_LAUNCHER_SIZE_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// Compute threads per rank: as asked, or the cores shared out over the ranks.
pub fn threads_per_rank(opts: &RunOptions, tp: usize) -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if opts.threads_per_rank > 0 {
        opts.threads_per_rank
    } else {
        (cores / tp.max(1)).max(1)
    }
}

/// Runs `plan` on CPU ranks (threads) over `weights` and generates for every request.
pub fn run_batch(
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
) -> Result<BatchOutput> {
    if let Device::Cuda(listed) = &opts.device {
        return run_on_gpus(plan, weights, requests, opts, listed);
    }
    check_requests(plan, requests, opts)?;
    weights.check(plan)?;
    let (comms, pipes) = local_groups(plan)?;
    // Stages run one after another (no micro-batches), so a rank's threads share the
    // cores with its tp group only.
    let threads = threads_per_rank(opts, plan.ranks.len());
    let bf16 = opts.dtype.bf16_linears(plan);
    let tokens = super::generate::total_tokens(requests, opts);
    super::memory::check_fits(plan, bf16, tokens)?;
    let kernels = Kernels::select(opts.isa)?;
    let make = |rank: usize| -> Result<CpuBackend> {
        let placement = if opts.pin_threads {
            affinity::placement(rank, threads)
        } else {
            Vec::new()
        };
        if let Some(Some(core)) = placement.first() {
            affinity::pin_current_thread(*core);
        }
        cpu_backend(rank, threads, &placement, bf16, kernels)
    };
    let mut out = launch_stages(plan, weights, comms, pipes, &make, &|rt| {
        rt.generate(requests, opts)
    })?;
    out.linear_kernels = Some(kernels.linear_kernels(bf16));
    Ok(out)
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
    Err(RunError::DeviceUnavailable(
        "--device cuda: this tpc was built without CUDA; build it with `cargo build --release --features cuda` (building needs no CUDA; running needs the NVIDIA driver, NVRTC and cuBLAS)".into(),
    ))
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
