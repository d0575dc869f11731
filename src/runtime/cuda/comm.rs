//! Collectives for GPU ranks through a host communicator: each call copies the device
//! buffers to the host, runs the host collective (threads in one process, or MPI processes)
//! and copies the result back. Correct on any set of GPUs, one or many, and exactly the host
//! runtime's sums; slow (two copies per call). [`GpuComm`] adds the fast path for ranks that
//! share one GPU: the all-reduce as one kernel per rank ([`super::one_shot`]), and NCCL's
//! all-reduce for ranks on distinct GPUs ([`super::nccl`]).

use super::backend::CudaAct;
use super::device::GpuRank;
use super::nccl::NcclLink;
use super::one_shot::{self, OneShotGroup};
use crate::ir::CollectiveAlgorithm;
use crate::runtime::collectives::{CollectiveError, Collectives};
use crate::runtime::comm::Communicator;
use std::sync::{Arc, OnceLock};

pub struct StagedComm<C> {
    host: C,
}

impl<C: Communicator> StagedComm<C> {
    pub fn new(host: C) -> StagedComm<C> {
        StagedComm { host }
    }
}

fn device(during: &'static str, e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Device {
        during,
        problem: format!("copying between the GPU and the host: {e:?}"),
    }
}

/// The buffer's elements on the host.
fn down(buf: &CudaAct, during: &'static str) -> Result<Vec<f32>, CollectiveError> {
    let n: usize = buf.shape().iter().product();
    let data = buf.data();
    let mut host = data
        .stream()
        .clone_dtoh(data)
        .map_err(|e| device(during, e))?;
    host.truncate(n);
    Ok(host)
}

/// `values` into the buffer.
fn up(values: &[f32], buf: &mut CudaAct, during: &'static str) -> Result<(), CollectiveError> {
    if values.is_empty() {
        return Ok(());
    }
    let data = buf.data_mut();
    let stream = data.stream().clone();
    stream
        .memcpy_htod(values, &mut data.slice_mut(..values.len()))
        .map_err(|e| device(during, e))
}

use crate::runtime::backend::Activation;

impl<C: Communicator> Collectives<CudaAct> for StagedComm<C> {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn world_size(&self) -> usize {
        self.host.world_size()
    }
    fn all_reduce_sum(&mut self, buf: &mut CudaAct) -> Result<(), CollectiveError> {
        self.all_reduce_sum_planned(buf, None).map(|_| ())
    }
    fn all_reduce_sum_planned(
        &mut self,
        buf: &mut CudaAct,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CollectiveError> {
        let mut host = down(buf, "all_reduce_sum")?;
        let ran = self.host.all_reduce_sum_planned(&mut host, algorithm)?;
        up(&host, buf, "all_reduce_sum")?;
        Ok(ran)
    }
    fn all_gather(&mut self, local: &CudaAct, out: &mut CudaAct) -> Result<(), CollectiveError> {
        let mine = down(local, "all_gather")?;
        let mut all = vec![0f32; out.elements()];
        self.host.all_gather(&mine, &mut all)?;
        up(&all, out, "all_gather")
    }
    fn reduce_scatter_sum(
        &mut self,
        input: &CudaAct,
        out: &mut CudaAct,
    ) -> Result<(), CollectiveError> {
        let all = down(input, "reduce_scatter_sum")?;
        let mut mine = vec![0f32; out.elements()];
        self.host.reduce_scatter_sum(&all, &mut mine)?;
        up(&mine, out, "reduce_scatter_sum")
    }
    fn broadcast(&mut self, buf: &mut CudaAct, root: usize) -> Result<(), CollectiveError> {
        let mut host = down(buf, "broadcast")?;
        self.host.broadcast(&mut host, root)?;
        up(&host, buf, "broadcast")
    }
    fn send(&mut self, buf: &CudaAct, to: usize) -> Result<(), CollectiveError> {
        let host = down(buf, "send")?;
        self.host.send(&host, to)?;
        Ok(())
    }
    fn recv(&mut self, buf: &mut CudaAct, from: usize) -> Result<(), CollectiveError> {
        let mut host = vec![0f32; buf.elements()];
        self.host.recv(&mut host, from)?;
        up(&host, buf, "recv")
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(self.host.barrier()?)
    }
    fn abort(&mut self) {
        self.host.abort();
    }
}

/// A GPU rank's communicator: every collective staged through the host, except the
/// all-reduce of a group whose ranks share one GPU, which runs on the device.
pub struct GpuComm<C> {
    staged: StagedComm<C>,
    one_shot: Option<OneShotLink>,
    nccl: Option<NcclLink>,
}

/// This rank's part of a one-GPU group: the shared state, and the rank's GPU once its
/// backend has opened it (the communicator is made before the rank's thread starts).
pub struct OneShotLink {
    pub group: Arc<OneShotGroup>,
    pub gpu: Arc<OnceLock<Arc<GpuRank>>>,
}

impl<C: Communicator> GpuComm<C> {
    /// Staged collectives, with the all-reduce on the GPU when the group shares one
    /// (`one_shot`) or through NCCL when its ranks are on distinct GPUs (`nccl`).
    pub fn new(host: C, one_shot: Option<OneShotLink>, nccl: Option<NcclLink>) -> GpuComm<C> {
        GpuComm {
            staged: StagedComm::new(host),
            one_shot,
            nccl,
        }
    }
}

impl<C: Communicator> Collectives<CudaAct> for GpuComm<C> {
    fn rank(&self) -> usize {
        self.staged.rank()
    }
    fn world_size(&self) -> usize {
        self.staged.world_size()
    }
    fn all_reduce_sum(&mut self, buf: &mut CudaAct) -> Result<(), CollectiveError> {
        self.all_reduce_sum_planned(buf, None).map(|_| ())
    }
    fn all_reduce_sum_planned(
        &mut self,
        buf: &mut CudaAct,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CollectiveError> {
        if let Some(nccl) = &mut self.nccl {
            nccl.all_reduce(buf)?;
            return Ok(None);
        }
        let link = self
            .one_shot
            .as_ref()
            .and_then(|l| Some((&l.group, l.gpu.get()?)));
        let Some((group, gpu)) = link else {
            return self.staged.all_reduce_sum_planned(buf, algorithm);
        };
        let rank = self.staged.host.rank();
        let host = &mut self.staged.host;
        one_shot::all_reduce(group, gpu, rank, buf, &mut || Ok(host.barrier()?))?;
        Ok(Some(CollectiveAlgorithm::OneShot))
    }
    fn all_gather(&mut self, local: &CudaAct, out: &mut CudaAct) -> Result<(), CollectiveError> {
        self.staged.all_gather(local, out)
    }
    fn reduce_scatter_sum(
        &mut self,
        input: &CudaAct,
        out: &mut CudaAct,
    ) -> Result<(), CollectiveError> {
        self.staged.reduce_scatter_sum(input, out)
    }
    fn broadcast(&mut self, buf: &mut CudaAct, root: usize) -> Result<(), CollectiveError> {
        self.staged.broadcast(buf, root)
    }
    fn send(&mut self, buf: &CudaAct, to: usize) -> Result<(), CollectiveError> {
        self.staged.send(buf, to)
    }
    fn recv(&mut self, buf: &mut CudaAct, from: usize) -> Result<(), CollectiveError> {
        self.staged.recv(buf, from)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.staged.barrier()
    }
    fn abort(&mut self) {
        self.staged.abort();
    }
}
