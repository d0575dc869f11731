//! NCCL between GPUs: the all-reduce of a tensor-parallel group whose ranks are on distinct
//! GPUs. The communicator is made on each rank's own thread at its first collective, from a
//! unique id every rank of the group shares (`ncclCommInitRank`, called by every rank at
//! once): one process makes the id with [`new_id`]; ranks in several processes would receive
//! it over MPI ([`NcclLink::new`] takes it as bytes) — not wired yet.

use super::act::CudaAct;
use super::device::GpuRank;
use super::probe::{require, Library};
use super::CudaError;
use crate::runtime::backend::Activation;
use crate::runtime::collectives::CollectiveError;
use cudarc::nccl::{Comm, Id, ReduceOp};
use std::ffi::c_char;
use std::sync::{Arc, OnceLock};

/// A group's NCCL unique id, as the bytes that travel to the other ranks.
pub type IdBytes = [c_char; 128];

/// A fresh unique id for one group (NCCL must be loadable).
pub fn new_id() -> Result<IdBytes, CudaError> {
    require(Library::Nccl)?;
    let id = Id::new().map_err(|e| CudaError::Driver {
        what: "ncclGetUniqueId".into(),
        error: format!("{e:?}"),
    })?;
    Ok(*id.internal())
}

/// An NCCL communicator, used only by the rank thread that made it.
struct RankComm(Comm);

// SAFETY: an NCCL communicator may be used from any one thread at a time; it is made on the
// rank's thread and only that thread calls it (the wrapper lets the rank's communicator,
// which is moved into that thread before the NCCL one exists, be `Send`).
unsafe impl Send for RankComm {}

/// One rank's place in an NCCL group.
pub struct NcclLink {
    id: IdBytes,
    rank: usize,
    ranks: usize,
    gpu: Arc<OnceLock<Arc<GpuRank>>>,
    comm: Option<RankComm>,
}

impl NcclLink {
    pub fn new(id: IdBytes, rank: usize, ranks: usize, gpu: Arc<OnceLock<Arc<GpuRank>>>) -> Self {
        NcclLink {
            id,
            rank,
            ranks,
            gpu,
            comm: None,
        }
    }

    /// `buf` ← the sum over the group, on the GPU.
    pub fn all_reduce(&mut self, buf: &mut CudaAct) -> Result<(), CollectiveError> {
        const DURING: &str = "NCCL all-reduce";
        let fail = |problem: String| CollectiveError::Device {
            during: DURING,
            problem,
        };
        if self.comm.is_none() {
            let gpu = self
                .gpu
                .get()
                .ok_or_else(|| fail("the rank's GPU is not open (a bug in tpc)".into()))?;
            let comm = Comm::from_rank(
                gpu.stream.clone(),
                self.rank,
                self.ranks,
                Id::uninit(self.id),
            )
            .map_err(|e| {
                fail(format!(
                    "ncclCommInitRank, rank {} of {}: {e:?}",
                    self.rank, self.ranks
                ))
            })?;
            self.comm = Some(RankComm(comm));
        }
        let Some(RankComm(comm)) = &self.comm else {
            return Err(fail("no communicator (a bug in tpc)".into()));
        };
        let n = buf.elements();
        if n == 0 {
            return Ok(());
        }
        comm.all_reduce_in_place(&mut buf.data_mut().slice_mut(..n), &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| fail(format!("{e:?}")))
    }
}
