//! Collectives for GPU ranks. Every collective can go through a host communicator (threads
//! in one process, or MPI processes): the device buffers are copied to the host, the host
//! collective runs, the result is copied back — correct on any set of GPUs and exactly the
//! host runtime's sums, but two copies per call. The all-reduce, the hot one, has two device
//! paths: one kernel per rank for ranks that share one GPU ([`super::one_shot`]), and NCCL
//! for ranks on distinct GPUs ([`super::nccl`]).

use super::act::CudaAct;
use super::device::GpuRank;
use super::error::device_failure;
use super::nccl::NcclLink;
use super::one_shot::{self, OneShotGroup};
use crate::ir::CollectiveAlgorithm;
use crate::runtime::backend::Activation;
use crate::runtime::collectives::{gather_real_columns, CollectiveError, Collectives};
use crate::runtime::comm::Communicator;
use std::sync::{Arc, OnceLock};

/// A GPU rank's communicator: the host communicator `host` for everything, except the
/// all-reduce when the group shares one GPU (`one_shot`) or spans distinct GPUs (`nccl`).
pub struct GpuComm<C> {
    host: C,
    one_shot: Option<OneShotLink>,
    nccl: Option<NcclLink>,
}

/// This rank's part of a one-GPU group: the shared state, and the rank's GPU once its
/// backend has opened it (the communicator is made before the rank's thread starts).
pub struct OneShotLink {
    pub group: Arc<OneShotGroup>,
    pub gpu: Arc<OnceLock<Arc<GpuRank>>>,
}

/// The buffer's elements on the host.
fn down(buf: &CudaAct, during: &'static str) -> Result<Vec<f32>, CollectiveError> {
    let data = buf.data();
    let mut host = data
        .stream()
        .clone_dtoh(data)
        .map_err(|e| device_failure(during, e))?;
    host.truncate(buf.elements());
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
        .map_err(|e| device_failure(during, e))
}

impl<C: Communicator> GpuComm<C> {
    pub fn new(host: C, one_shot: Option<OneShotLink>, nccl: Option<NcclLink>) -> GpuComm<C> {
        GpuComm {
            host,
            one_shot,
            nccl,
        }
    }
}

impl<C: Communicator> Collectives<CudaAct> for GpuComm<C> {
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
        if let Some(nccl) = &mut self.nccl {
            nccl.all_reduce(buf)?;
            return Ok(None);
        }
        let link = self
            .one_shot
            .as_ref()
            .and_then(|l| Some((&l.group, l.gpu.get()?)));
        if let Some((group, gpu)) = link {
            let (rank, host) = (self.host.rank(), &mut self.host);
            one_shot::all_reduce(group, gpu, rank, buf, &mut || Ok(host.barrier()?))?;
            return Ok(Some(CollectiveAlgorithm::OneShot));
        }
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
    fn all_gather_counts(
        &mut self,
        local: &CudaAct,
        counts: &[usize],
        out: &mut CudaAct,
    ) -> Result<(), CollectiveError> {
        let mine = down(local, "all_gather_counts")?;
        let mut all = vec![0f32; out.elements()];
        self.host.all_gather_counts(&mine, counts, &mut all)?;
        up(&all, out, "all_gather_counts")
    }
    fn reduce_scatter_sum_counts(
        &mut self,
        input: &CudaAct,
        counts: &[usize],
        out: &mut CudaAct,
    ) -> Result<(), CollectiveError> {
        let all = down(input, "reduce_scatter_sum_counts")?;
        let mut mine = vec![0f32; out.elements()];
        self.host
            .reduce_scatter_sum_counts(&all, counts, &mut mine)?;
        up(&mine, out, "reduce_scatter_sum_counts")
    }
    fn all_gather_columns(
        &mut self,
        local: &CudaAct,
        widths: &[usize],
        out: &mut CudaAct,
    ) -> Result<(), CollectiveError> {
        let mine = down(local, "all_gather_columns")?;
        let width = local.shape().last().copied().unwrap_or(0);
        let mut all = vec![0f32; out.elements()];
        gather_real_columns(&mut self.host, &mine, width, widths, &mut all)?;
        up(&all, out, "all_gather_columns")
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
