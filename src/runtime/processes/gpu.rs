//! A GPU rank as an MPI process (features `mpi` and `cuda`): the processes on a host take its
//! GPUs (the listed ones, or all) in turn by their rank on the host; the tp group
//! all-reduces through NCCL, its unique id made by tp rank 0 and broadcast over the group's
//! MPI communicator (so every rank of a tp group needs a GPU of its own); everything else is
//! staged through MPI. `run` and `serve` open their ranks here alike.

use super::MpiWorld;
use crate::plan::stages::stage_program;
use crate::plan::Plan;
use crate::runtime::comm::MpiComm;
use crate::runtime::cuda::backend::CudaBackend;
use crate::runtime::cuda::comm::GpuComm;
use crate::runtime::cuda::device::GpuRank;
use crate::runtime::cuda::nccl::{new_id, IdBytes, NcclLink};
use crate::runtime::error::{Result, RunError};
use crate::runtime::expert_exchange::ExpertMember;
use crate::runtime::generate::{
    rank_runtime_sharing, stage_runtime_sharing, BatchOutput, Request, RunOptions,
};
use crate::runtime::weights::WeightSource;
use std::sync::{Arc, OnceLock};

/// A GPU rank's place among the processes.
pub(super) struct GpuProcess<'a> {
    pub mpi: &'a MpiWorld,
    pub me: usize,
    pub tp_rank: usize,
    pub stage: usize,
    pub listed: &'a [usize],
    /// Its place among the job's processes on its host ([`MpiWorld::place_on_host`]).
    pub host: (usize, usize),
}

/// This process's GPU rank, opened.
pub(super) struct OpenedGpu {
    pub gpu: Arc<GpuRank>,
    /// The GPU it is on.
    pub ordinal: usize,
    /// How many processes of this host share that GPU (this one included).
    pub sharing: usize,
    /// Its tp group: NCCL where tp > 1, MPI for the rest.
    pub comm: GpuComm<MpiComm>,
}

/// Opens this process's GPU and its tp group's communicator (`comm`, of `tp` ranks).
pub(super) fn open_gpu_rank(p: &GpuProcess<'_>, tp: usize, mut comm: MpiComm) -> Result<OpenedGpu> {
    let devices = crate::runtime::cuda::launch::gpus(p.listed)?;
    let (on_host, here) = p.host;
    let slot = on_host % devices.len();
    let ordinal = devices[slot];
    let sharing = (0..here).filter(|r| r % devices.len() == slot).count();
    check_a_gpu_per_tp_rank(p, tp, ordinal)?;
    let gpu = Arc::new(GpuRank::open(p.me, ordinal)?);
    let nccl = if tp > 1 {
        let mut id: IdBytes = [0; 128];
        if p.tp_rank == 0 {
            id = new_id()?;
        }
        let mut bytes: Vec<u8> = id.iter().map(|&c| c as u8).collect();
        comm.broadcast_bytes(&mut bytes, 0)?;
        for (c, b) in id.iter_mut().zip(&bytes) {
            *c = *b as std::ffi::c_char;
        }
        let slot = Arc::new(OnceLock::new());
        let _ = slot.set(gpu.clone());
        Some(NcclLink::new(id, p.tp_rank, tp, slot))
    } else {
        None
    };
    Ok(OpenedGpu {
        gpu,
        ordinal,
        sharing,
        comm: GpuComm::new(comm, None, nccl),
    })
}

/// NCCL refuses two ranks of one communicator on one GPU (and a refused or half-made
/// communicator can leave its peers waiting): every process learns where every other's GPU
/// is (collective) and all refuse alike where two ranks of a tp group would share one.
fn check_a_gpu_per_tp_rank(p: &GpuProcess<'_>, tp: usize, ordinal: usize) -> Result<()> {
    if tp < 2 {
        return Ok(());
    }
    let host = mpi::environment::processor_name().unwrap_or_default();
    let seats: Vec<String> = p
        .mpi
        .all_gather_bytes(format!("{ordinal} {host}").as_bytes())?
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    // Global ranks run [.., PP, TP], tp fastest: a tp group is `tp` consecutive ranks.
    for (g, members) in seats.chunks(tp).enumerate() {
        for a in 0..members.len() {
            let Some(b) = (a + 1..members.len()).find(|&b| members[b] == members[a]) else {
                continue;
            };
            let (gpu, host) = members[a].split_once(' ').unwrap_or((&members[a], ""));
            return Err(RunError::DeviceUnavailable(format!(
                "--device cuda: ranks {} and {}, of one tp group, would share GPU {gpu} of host `{host}`, and NCCL needs a GPU for each rank of a tp group; list as many GPUs as a host runs processes (--device cuda:0,1,…) or start fewer processes per host",
                g * tp + a,
                g * tp + b
            )));
        }
    }
    Ok(())
}

/// This process's rank of `plan` on its GPU, generating `mine`. Under `--ep` (`member`) the
/// rank's experts are those of its seat in its DP group, whose routed rows travel between
/// the replicas' processes through host memory, as on the CPU.
pub(super) fn generate_on_gpu(
    p: &GpuProcess<'_>,
    plan: &Plan,
    weights: &dyn WeightSource,
    mine: &[Request],
    opts: &RunOptions,
    (comm, pipe): (MpiComm, Option<MpiComm>),
    member: Option<ExpertMember>,
) -> Result<BatchOutput> {
    let opened = open_gpu_rank(p, plan.ranks.len(), comm)?;
    let backend = CudaBackend::new(opened.gpu, opts.dtype.bf16_linears(plan));
    let stage;
    let mut rt = match pipe {
        Some(pipe) => {
            stage =
                stage_program(plan, p.tp_rank, p.stage).map_err(|e| RunError::Input(e.into()))?;
            let pipe = GpuComm::new(pipe, None, None);
            stage_runtime_sharing(&stage, backend, opened.comm, pipe, weights, member)?
        }
        None => rank_runtime_sharing(plan, p.tp_rank, backend, opened.comm, weights, member)?,
    };
    super::injected_fault(p.me)?;
    rt.generate_in_expert_group(mine, opts)
}
