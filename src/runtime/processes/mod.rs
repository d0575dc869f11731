//! Ranks as processes (`mpirun -np W tpc run …`): each MPI process is one global rank of
//! the `[ExternalDP, DP, PP, TP]` layout ([`rank_groups`]); its tensor-parallel and pipeline
//! groups are MPI sub-communicators cut from that layout, it loads only its own weight
//! slices, and it runs its rank's program on the CPU backend or, with `--device cuda`, on a
//! GPU of its host (`gpu.rs`). Every (ExternalDP, DP) replica takes the requests
//! [`placement`] deals it, and each replica's leading rank (tp rank 0 of its last stage)
//! sends its results to world rank 0, which returns them in request order.
//!
//! Failure: MPI reports no error to the peers of a failed process. The caller prints a
//! failed rank's error (naming it) and calls [`MpiWorld::abort`]; `mpirun` then stops every
//! process, as it does when a process is killed. Before any of that, the ranks' first
//! collective is [`MpiWorld::agree`]: ranks started with different arguments or files stop
//! there together ([`super::agreement`]).

pub mod expert_exchange;
#[cfg(feature = "cuda")]
mod gpu;
mod replica_link;
pub mod serve;

use super::agreement::{verdict, Record};
use super::comm::MpiComm;
use super::cpu::isa::Kernels;
use super::cpu_rank::cpu_backend;
use super::error::{Result, RunError};
use super::expert_exchange::ExpertMember;
use super::generate::{
    rank_runtime_sharing, stage_runtime_sharing, BatchOutput, Device, Request, RunOptions,
    SequenceOutput,
};
use super::launch::{check_before_start, check_host_memory, MpiThreads};
use super::rank_groups::{rank_groups, RankGroups};
use super::replicas::placement;
use super::tensor::Tensor;
use super::weights::WeightSource;
use crate::plan::stages::stage_program;
use crate::plan::Plan;
use mpi::datatype::{Equivalence, PartitionMut};
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator, CommunicatorCollectives};
use mpi::Threading;

/// The initialized MPI environment of this process (finalized when dropped).
pub struct MpiWorld {
    world: SimpleCommunicator,
    threading: Threading,
    _universe: Universe,
}

fn processes(problem: impl Into<String>) -> RunError {
    RunError::Processes(problem.into())
}

impl MpiWorld {
    /// Initializes MPI. Communicators move between threads (the rank's runtime is built on
    /// one thread and may run on another), so calls must be allowed from any thread, one
    /// at a time: `MPI_THREAD_SERIALIZED` at least; `threads` asks for more.
    pub fn init(threads: MpiThreads) -> Result<MpiWorld> {
        let asked = match threads {
            MpiThreads::OneAtATime => Threading::Serialized,
            MpiThreads::AtOnce => Threading::Multiple,
        };
        let (universe, provided) = mpi::initialize_with_threading(asked)
            .ok_or_else(|| processes("MPI was already initialized in this process"))?;
        if provided < Threading::Serialized {
            return Err(processes(format!(
                "the MPI library provides thread level {provided:?}; tpc needs Serialized (build Open MPI with thread support)"
            )));
        }
        Ok(MpiWorld {
            world: universe.world(),
            threading: provided,
            _universe: universe,
        })
    }

    /// Whether several threads may call MPI at once (`MPI_THREAD_MULTIPLE` was provided).
    pub fn many_threads(&self) -> bool {
        self.threading >= Threading::Multiple
    }

    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// A communicator over every process of the job (a copy of the world's).
    pub fn comm(&self) -> MpiComm {
        MpiComm::new(self.world.duplicate())
    }

    /// The communicator of this rank's group among `groups` (lists of world ranks), ranked
    /// in the group's order. Collective: every process calls it with the same lists.
    pub fn split_groups(&self, groups: &[Vec<usize>]) -> Result<MpiComm> {
        split(&self.world, groups, self.rank())
    }

    /// This process's place among the job's processes on its host: (its index, by world
    /// rank, and how many there are). Collective.
    pub fn place_on_host(&self) -> (usize, usize) {
        let host = self.world.split_shared(self.world.rank());
        (host.rank().max(0) as usize, host.size().max(1) as usize)
    }

    /// The least of every rank's `mine`: a figure the ranks must share (the KV pool's size)
    /// where each computed its own from its host.
    pub fn all_min(&self, mine: u64) -> Result<u64> {
        let all = self.all_gather_bytes(&mine.to_le_bytes())?;
        all.iter()
            .map(|b| <[u8; 8]>::try_from(&b[..]).map(u64::from_le_bytes))
            .try_fold(u64::MAX, |m, v| v.map(|v| m.min(v)))
            .map_err(|_| {
                processes(
                    "a rank sent a figure that is not 8 bytes (start every rank with the same tpc)",
                )
            })
    }

    /// Ends every process of the job with `code` (`MPI_Abort`); `mpirun` reports it.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    /// Every rank's `mine`, in world rank order. The lengths travel first, in a fixed-size
    /// exchange, so the bytes after them cannot be truncated whatever each rank sends; a
    /// length past [`RECORD_MAX`] is refused by every rank alike.
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.size();
        let mut lengths = vec![0u64; n];
        self.world
            .all_gather_into(&(mine.len() as u64), &mut lengths[..]);
        if let Some((rank, &len)) = lengths
            .iter()
            .enumerate()
            .find(|(_, &l)| l > RECORD_MAX as u64)
        {
            return Err(processes(format!(
                "rank {rank} sent a record of {len} bytes before loading, more than the {RECORD_MAX} any tpc sends; start every rank with the same tpc"
            )));
        }
        // MPI counts and offsets are C ints: the total fits one, so every offset does.
        let total = lengths
            .iter()
            .try_fold(0usize, |a, &l| a.checked_add(l as usize))
            .filter(|&t| t <= i32::MAX as usize)
            .ok_or_else(|| processes(format!("{n} ranks' records exceed MPI's counts")))?;
        let counts: Vec<i32> = lengths.iter().map(|&l| l as i32).collect();
        let offsets: Vec<i32> = counts
            .iter()
            .scan(0i32, |at, &c| {
                let start = *at;
                *at += c;
                Some(start)
            })
            .collect();
        let mut all = vec![0u8; total];
        {
            let mut parts = PartitionMut::new(&mut all[..], &counts[..], &offsets[..]);
            self.world.all_gather_varcount_into(mine, &mut parts);
        }
        Ok(counts
            .iter()
            .zip(&offsets)
            .map(|(&c, &o)| all[o as usize..(o + c) as usize].to_vec())
            .collect())
    }

    /// Compares `record` with every other rank's: the first collective of a run, before
    /// anything is loaded. Every rank gets the same answer, so on a difference every rank
    /// returns the same [`RunError::RanksDisagree`] and none is left waiting.
    pub fn agree(&self, record: &Record) -> Result<()> {
        let records = self.all_gather_bytes(&record.to_bytes())?;
        Ok(verdict(&records)?)
    }
}

/// The most bytes a rank's record may have (a checkpoint of a thousand files makes about
/// 60 KB).
const RECORD_MAX: usize = 16 << 20;

/// Ends the whole MPI job when any thread of this process panics, after the usual panic
/// message: a rank that panicked must not leave its peers waiting.
pub fn abort_job_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        // SAFETY: MPI_Abort may be called at any time after MPI_Init (and this hook is set
        // after it); it does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
        }
    }));
}

/// The sub-communicator of the group (one of `groups`) that holds this rank, ranked in the
/// group's order. Collective over the world: every process calls it with the same lists.
fn split(world: &SimpleCommunicator, groups: &[Vec<usize>], me: usize) -> Result<MpiComm> {
    Ok(MpiComm::new(split_raw(world, groups, me)?))
}

/// [`split`] as MPI's own communicator.
fn split_raw(
    world: &SimpleCommunicator,
    groups: &[Vec<usize>],
    me: usize,
) -> Result<SimpleCommunicator> {
    let (color, key) = groups
        .iter()
        .enumerate()
        .find_map(|(g, list)| list.iter().position(|&r| r == me).map(|k| (g, k)))
        .ok_or_else(|| processes(format!("rank {me} is in no group of the layout")))?;
    world
        .split_by_color_with_key(Color::with_value(color as i32), key as i32)
        .ok_or_else(|| processes(format!("rank {me}: MPI returned no communicator")))
}

/// Under `--ep` with more than one replica: why this run cannot deal its experts over the
/// replicas, checked alike on every process before any collective.
fn check_expert_parallel(plan: &Plan) -> Result<()> {
    match plan.why_experts_cannot_span_replicas() {
        Some(why) => Err(RunError::Replicas(format!("--ep: {why}"))),
        None => Ok(()),
    }
}

/// The global rank that leads `replica`: tp rank 0 of its last stage.
fn lead_of(groups: &RankGroups, replica: usize) -> Option<usize> {
    groups
        .ranks
        .iter()
        .find(|c| c.ext_dp * groups.dp + c.dp == replica && c.pp + 1 == groups.pp && c.tp == 0)
        .map(|c| c.rank)
}

/// What a replica's lead sends world rank 0 (its logits follow, one message per sequence).
#[derive(serde::Serialize, serde::Deserialize)]
struct ReplicaReport {
    generated: Vec<Vec<i64>>,
    logits_shapes: Vec<Vec<usize>>,
    prompt_tokens: usize,
    load_seconds: f64,
    prefill_seconds: f64,
    decode_seconds: f64,
    routed_pairs_per_rank: Vec<u64>,
}

const TAG_REPORT: i32 = 11;
const TAG_LOGITS: i32 = 12;

fn send_report(world: &SimpleCommunicator, out: &BatchOutput) -> Result<()> {
    let report = ReplicaReport {
        generated: out.sequences.iter().map(|s| s.generated.clone()).collect(),
        logits_shapes: out
            .sequences
            .iter()
            .map(|s| s.prompt_logits.shape.clone())
            .collect(),
        prompt_tokens: out.prompt_tokens,
        load_seconds: out.load_seconds,
        prefill_seconds: out.prefill_seconds,
        decode_seconds: out.decode_seconds,
        routed_pairs_per_rank: out.routed_pairs_per_rank.clone(),
    };
    let bytes = serde_json::to_vec(&report).map_err(|e| processes(e.to_string()))?;
    let root = world.process_at_rank(0);
    root.send_with_tag(&bytes[..], TAG_REPORT);
    for s in &out.sequences {
        root.send_with_tag(&s.prompt_logits.data[..], TAG_LOGITS);
    }
    Ok(())
}

fn receive_report(world: &SimpleCommunicator, from: usize) -> Result<BatchOutput> {
    let source = world.process_at_rank(from as i32);
    let (message, status) = source.matched_probe_with_tag(TAG_REPORT);
    let mut bytes = vec![0u8; status.count(u8::equivalent_datatype()).max(0) as usize];
    message.matched_receive_into(&mut bytes[..]);
    let report: ReplicaReport = serde_json::from_slice(&bytes)
        .map_err(|e| processes(format!("rank {from} sent a malformed result: {e}")))?;
    let mut sequences = Vec::with_capacity(report.generated.len());
    for (generated, shape) in report.generated.into_iter().zip(report.logits_shapes) {
        let (message, status) = source.matched_probe_with_tag(TAG_LOGITS);
        let got = status.count(f32::equivalent_datatype()).max(0) as usize;
        let expected = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if expected != Some(got) {
            return Err(processes(format!(
                "rank {from} sent {got} logits for a tensor of shape {shape:?}"
            )));
        }
        let mut data = vec![0f32; got];
        message.matched_receive_into(&mut data[..]);
        sequences.push(SequenceOutput {
            generated,
            prompt_logits: Tensor::new(shape, data),
        });
    }
    Ok(BatchOutput {
        sequences,
        prompt_tokens: report.prompt_tokens,
        load_seconds: report.load_seconds,
        prefill_seconds: report.prefill_seconds,
        decode_seconds: report.decode_seconds,
        routed_pairs_per_rank: report.routed_pairs_per_rank,
        ..BatchOutput::default()
    })
}

/// A rank that the test of failure handling makes fail: `TPC_FAULT_INJECT=RANK:error` or
/// `RANK:panic` (global rank), after it has loaded and before it generates.
fn injected_fault(rank: usize) -> Result<()> {
    let Ok(spec) = std::env::var("TPC_FAULT_INJECT") else {
        return Ok(());
    };
    let Some((who, what)) = spec.split_once(':') else {
        return Err(processes(format!(
            "TPC_FAULT_INJECT={spec}: expected RANK:error or RANK:panic"
        )));
    };
    if who.trim().parse::<usize>().ok() != Some(rank) {
        return Ok(());
    }
    match what.trim() {
        "error" => Err(processes(format!(
            "rank {rank}: failed on purpose (TPC_FAULT_INJECT)"
        ))),
        "panic" => panic!("rank {rank}: panicked on purpose (TPC_FAULT_INJECT)"),
        other => Err(processes(format!(
            "TPC_FAULT_INJECT={spec}: `{other}` is not error or panic"
        ))),
    }
}

/// Runs this process's rank of `plan` over `weights` for `requests`: world rank 0 returns
/// the whole batch's results in request order, every other rank `None`. The world size must
/// be a multiple of tp · pp · `dp`; every multiple beyond is an external data-parallel
/// replica (vLLM's ExternalDP).
pub fn run_batch_mpi(
    mpi: &MpiWorld,
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: &RunOptions,
    dp: usize,
) -> Result<Option<BatchOutput>> {
    let (me, world) = (mpi.rank(), mpi.size());
    let (tp, pp) = (plan.ranks.len(), plan.pp());
    let groups = rank_groups(world as u64, tp as u64, pp as u64, dp as u64)
        .map_err(|e| processes(format!("mpirun -np {world}: {e}")))?;
    check_before_start(plan, weights, requests, opts)?;
    let sharing = opts.expert_parallel && dp > 1;
    if sharing {
        check_expert_parallel(plan)?;
    }
    let coords = groups.ranks[me];
    let replicas = groups.ext_dp * groups.dp;
    let replica = coords.ext_dp * groups.dp + coords.dp;
    // Collective over the world, in the same order on every process.
    let comm = split(&mpi.world, &groups.tp_groups, me)?;
    let pipe = if pp > 1 {
        Some(split(&mpi.world, &groups.pp_groups, me)?)
    } else {
        None
    };
    // The DP group (this stage and tp rank of every replica) shares its experts: member =
    // this replica's place in it.
    let member = if sharing {
        let dp_comm = split_raw(&mpi.world, &groups.dp_groups, me)?;
        let member = dp_comm.rank().max(0) as usize;
        Some(ExpertMember {
            exchange: std::sync::Arc::new(expert_exchange::MpiExchange::new(dp_comm)),
            member,
        })
    } else {
        None
    };
    let host = mpi.place_on_host();
    let on_this_host = host.1;
    let mine: Vec<Request> = requests
        .iter()
        .enumerate()
        .filter(|&(i, _)| placement(i, replicas).0 == replica)
        .map(|(_, r)| r.clone())
        .collect();
    let mut outcome = Ok(None);
    // Under --ep a replica without requests still answers the others.
    if !mine.is_empty() || member.is_some() {
        outcome = match &opts.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(listed) => {
                let gpu = gpu::GpuProcess {
                    mpi,
                    me,
                    tp_rank: coords.tp,
                    stage: coords.pp,
                    listed,
                    host,
                };
                gpu::generate_on_gpu(&gpu, plan, weights, &mine, opts, (comm, pipe), member)
                    .map(Some)
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(RunError::DeviceUnavailable(
                "--device cuda: this tpc was built without CUDA; build it with `cargo build --release --features mpi,cuda`".into(),
            )),
            Device::Cpu(cpu) => {
        let bf16 = opts.dtype.bf16_linears(plan);
        check_host_memory(plan, &mine, opts, 1)?;
        let threads = cpu.threads_per_rank(on_this_host);
        let kernels = Kernels::select(cpu.isa)?;
        let backend = cpu_backend(me, threads, &[], bf16, kernels)?;
        let stage;
        let mut rt = match pipe {
            Some(pipe) => {
                stage = stage_program(plan, coords.tp, coords.pp)
                    .map_err(|e| RunError::Input(e.into()))?;
                stage_runtime_sharing(&stage, backend, comm, pipe, weights, member)?
            }
            None => rank_runtime_sharing(plan, coords.tp, backend, comm, weights, member)?,
        };
        injected_fault(me)?;
        let mut out = rt.generate_in_expert_group(&mine, opts)?;
        out.linear_kernels = Some(kernels.linear_kernels(bf16));
        Ok(Some(out))
            }
        };
    }
    // Results travel to world rank 0 over the world communicator.
    let Ok(out) = outcome else { return outcome };
    let leads: Vec<Option<usize>> = (0..replicas).map(|k| lead_of(&groups, k)).collect();
    if me != 0 {
        if let (Some(out), true) = (out, leads.contains(&Some(me))) {
            send_report(&mpi.world, &out)?;
        }
        mpi.world.barrier();
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(replicas);
    for (k, lead) in leads.iter().enumerate() {
        let has_requests = k < requests.len() || sharing;
        parts.push(match (lead, has_requests) {
            (_, false) => BatchOutput::default(),
            (Some(0), true) => out.clone().unwrap_or_default(),
            (Some(r), true) => receive_report(&mpi.world, *r)?,
            (None, true) => return Err(processes(format!("replica {k} has no leading rank"))),
        });
    }
    mpi.world.barrier();
    Ok(Some(merge(
        parts,
        requests.len(),
        out.unwrap_or_default(),
        sharing,
    )))
}

/// The replicas' results in request order; timings are the slowest replica's, the other
/// figures those of world rank 0 (`own`); under `--ep` (`sharing`) the load report is every
/// replica's ranks', replica after replica.
fn merge(parts: Vec<BatchOutput>, requests: usize, own: BatchOutput, sharing: bool) -> BatchOutput {
    let replicas = parts.len().max(1);
    let mut merged = BatchOutput {
        sequences: Vec::with_capacity(requests),
        ..own
    };
    if sharing {
        merged.routed_pairs_per_rank = parts
            .iter()
            .flat_map(|p| p.routed_pairs_per_rank.iter().copied())
            .collect();
    }
    merged.prompt_tokens = parts.iter().map(|p| p.prompt_tokens).sum();
    merged.load_seconds = parts.iter().map(|p| p.load_seconds).fold(0.0, f64::max);
    merged.prefill_seconds = parts.iter().map(|p| p.prefill_seconds).fold(0.0, f64::max);
    merged.decode_seconds = parts.iter().map(|p| p.decode_seconds).fold(0.0, f64::max);
    let mut iters: Vec<_> = parts.into_iter().map(|p| p.sequences.into_iter()).collect();
    for i in 0..requests {
        if let Some(s) = iters[placement(i, replicas).0].next() {
            merged.sequences.push(s);
        }
    }
    merged
}
