//! Collectives on a backend's own buffers: what the executor calls. A device communicator
//! (NCCL, a same-GPU one) implements [`Collectives`] for its backend's buffers; every host
//! communicator ([`Communicator`]: threads today, MPI next) serves every backend whose
//! buffers live in host memory through the blanket implementation below.

use super::backend::{Activation, HostBuffer, HostData, HostDataRef};
use super::comm::{CommError, Communicator};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CollectiveError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("{during}: buffers of {got} elements ({dtype}), expected {expected}")]
    Buffers {
        during: &'static str,
        dtype: String,
        got: usize,
        expected: usize,
    },
    #[error("{during}: the buffers differ in dtype; every buffer of a collective has one dtype")]
    Dtype { during: &'static str },
}

/// Collective communication of one rank over buffers of type `A`. Every method is a
/// collective (or point-to-point) call with the contract of [`Communicator`].
pub trait Collectives<A>: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// `buf` ← the elementwise sum over ranks.
    fn all_reduce_sum(&mut self, buf: &mut A) -> Result<(), CollectiveError>;
    /// `out` (`world_size` × `local`'s elements) ← every rank's `local`, rank-major.
    fn all_gather(&mut self, local: &A, out: &mut A) -> Result<(), CollectiveError>;
    /// `input` is rank-major pieces; `out` ← the sum over ranks of piece `rank()`.
    fn reduce_scatter_sum(&mut self, input: &A, out: &mut A) -> Result<(), CollectiveError>;
    /// `buf` ← `buf` of `root`.
    fn broadcast(&mut self, buf: &mut A, root: usize) -> Result<(), CollectiveError>;
    fn send(&mut self, buf: &A, to: usize) -> Result<(), CollectiveError>;
    fn recv(&mut self, buf: &mut A, from: usize) -> Result<(), CollectiveError>;
    fn barrier(&mut self) -> Result<(), CollectiveError>;
    /// Marks this rank failed so that its peers stop waiting for it.
    fn abort(&mut self);
}

fn mismatch(during: &'static str) -> CollectiveError {
    CollectiveError::Dtype { during }
}

// Interim: the host communicator moves f32 only and has no point-to-point calls yet.
fn later(during: &'static str) -> CollectiveError {
    CollectiveError::Buffers {
        during,
        dtype: "unsupported".into(),
        got: 0,
        expected: 0,
    }
}

impl<A: Activation + HostBuffer, C: Communicator> Collectives<A> for C {
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }
    fn world_size(&self) -> usize {
        Communicator::world_size(self)
    }
    fn all_reduce_sum(&mut self, buf: &mut A) -> Result<(), CollectiveError> {
        match buf.host_data() {
            HostData::F32(b) => Communicator::all_reduce_sum(self, b)?,
            HostData::Bf16(_) => return Err(later("all_reduce_sum")),
        }
        Ok(())
    }
    fn all_gather(&mut self, local: &A, out: &mut A) -> Result<(), CollectiveError> {
        match (local.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(l), HostData::F32(o)) => Communicator::all_gather(self, l, o)?,
            _ => return Err(mismatch("all_gather")),
        }
        Ok(())
    }
    fn reduce_scatter_sum(&mut self, input: &A, out: &mut A) -> Result<(), CollectiveError> {
        match (input.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(i), HostData::F32(o)) => {
                Communicator::reduce_scatter_sum(self, i, o)?
            }
            _ => return Err(mismatch("reduce_scatter_sum")),
        }
        Ok(())
    }
    fn broadcast(&mut self, _buf: &mut A, _root: usize) -> Result<(), CollectiveError> {
        Err(later("broadcast"))
    }
    fn send(&mut self, _buf: &A, _to: usize) -> Result<(), CollectiveError> {
        Err(later("send"))
    }
    fn recv(&mut self, _buf: &mut A, _from: usize) -> Result<(), CollectiveError> {
        Err(later("recv"))
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(Communicator::barrier(self)?)
    }
    fn abort(&mut self) {}
}
