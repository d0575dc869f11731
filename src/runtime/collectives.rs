//! Collectives on a backend's own buffers: what the executor calls. A device communicator
//! (NCCL, a same-GPU one) implements [`Collectives`] for its backend's buffers; every host
//! communicator ([`Communicator`]: threads, MPI processes, GPUs) serves every backend whose
//! buffers live in host memory through the blanket implementation below.

use super::activation::{Activation, HostBuffer, HostData, HostDataRef};
use super::comm::{CommError, Communicator, Element};
use crate::ir::CollectiveAlgorithm;
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
    /// Moving a device buffer to or from the host for a host communicator failed.
    #[error("{during}: {problem}")]
    Device {
        during: &'static str,
        problem: String,
    },
}

/// Collective communication of one rank over buffers of type `A`. Every method is a
/// collective (or point-to-point) call with the contract of [`Communicator`].
pub trait Collectives<A>: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// `buf` ← the elementwise sum over ranks.
    fn all_reduce_sum(&mut self, buf: &mut A) -> Result<(), CollectiveError>;
    /// [`Collectives::all_reduce_sum`] with the algorithm the plan recorded (`None`: the
    /// communicator's choice); returns the algorithm that ran when the communicator knows.
    fn all_reduce_sum_planned(
        &mut self,
        buf: &mut A,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CollectiveError> {
        let _ = algorithm;
        self.all_reduce_sum(buf).map(|()| None)
    }
    /// [`Collectives::all_reduce_sum_planned`], then `row(r, x)` on each row `x` (as `f32`)
    /// of `row_len` elements of the sum, in order — on a host communicator in the same loop
    /// as the reduction where it can ([`Communicator::all_reduce_sum_rows`]), which is what
    /// a fused all-reduce + norm needs. `None`: these buffers are not in host memory (a
    /// device communicator); the caller reduces and reads the sum separately.
    fn all_reduce_sum_rows(
        &mut self,
        buf: &mut A,
        row_len: usize,
        algorithm: Option<CollectiveAlgorithm>,
        row: &mut dyn FnMut(usize, &[f32]),
    ) -> Option<Result<Option<CollectiveAlgorithm>, CollectiveError>> {
        let _ = (buf, row_len, algorithm, row);
        None
    }
    /// `out` (`world_size` × `local`'s elements) ← every rank's `local`, rank-major.
    fn all_gather(&mut self, local: &A, out: &mut A) -> Result<(), CollectiveError>;
    /// `input` is rank-major pieces; `out` ← the sum over ranks of piece `rank()`.
    fn reduce_scatter_sum(&mut self, input: &A, out: &mut A) -> Result<(), CollectiveError>;
    /// [`Collectives::all_gather`] of unequal pieces: rank `q`'s `local` has `counts[q]`
    /// elements, `out` their sum, every rank's in rank order (only real elements move).
    fn all_gather_counts(
        &mut self,
        local: &A,
        counts: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError>;
    /// [`Collectives::reduce_scatter_sum`] of unequal pieces: `input` is every rank's piece
    /// in rank order (piece `q` of `counts[q]` elements); `out` ← the sum of piece `rank()`.
    fn reduce_scatter_sum_counts(
        &mut self,
        input: &A,
        counts: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError>;
    /// `out` (rows of Σ `widths` columns) ← every rank's first `widths[q]` columns of its
    /// `local` rows (padded to the largest width), side by side in rank order: an all-gather
    /// of a split dim dealt unevenly that moves only the real columns.
    fn all_gather_columns(
        &mut self,
        local: &A,
        widths: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError>;
    /// `buf` ← `buf` of `root`.
    fn broadcast(&mut self, buf: &mut A, root: usize) -> Result<(), CollectiveError>;
    fn send(&mut self, buf: &A, to: usize) -> Result<(), CollectiveError>;
    fn recv(&mut self, buf: &mut A, from: usize) -> Result<(), CollectiveError>;
    fn barrier(&mut self) -> Result<(), CollectiveError>;
    /// Marks this rank failed so that its peers stop waiting for it.
    fn abort(&mut self);
}

/// How many all-reduces ran with each algorithm (as the communicator reported it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AllReduceTally {
    pub one_shot: u64,
    pub two_shot: u64,
    pub ring: u64,
    /// Run by a communicator that does not say which algorithm it used.
    pub unreported: u64,
}

impl AllReduceTally {
    pub fn add(&mut self, ran: Option<CollectiveAlgorithm>) {
        *match ran {
            Some(CollectiveAlgorithm::OneShot) => &mut self.one_shot,
            Some(CollectiveAlgorithm::TwoShot) => &mut self.two_shot,
            Some(CollectiveAlgorithm::Ring) => &mut self.ring,
            None => &mut self.unreported,
        } += 1;
    }

    /// The calls made since `earlier` was taken.
    pub fn since(&self, earlier: &AllReduceTally) -> AllReduceTally {
        AllReduceTally {
            one_shot: self.one_shot - earlier.one_shot,
            two_shot: self.two_shot - earlier.two_shot,
            ring: self.ring - earlier.ring,
            unreported: self.unreported - earlier.unreported,
        }
    }
}

fn mismatch(during: &'static str) -> CollectiveError {
    CollectiveError::Dtype { during }
}

/// [`Collectives::all_gather_columns`] on host memory: `local` is rows of `width` columns
/// (the last dim of the activation), this rank's real ones first. Packs them, gathers the
/// ranks' packed pieces by their counts, and lays each rank's columns out at its place.
pub(crate) fn gather_real_columns<T: Element, C: Communicator>(
    comm: &mut C,
    local: &[T],
    width: usize,
    widths: &[usize],
    out: &mut [T],
) -> Result<(), CollectiveError> {
    let rows = local.len().checked_div(width).unwrap_or(0);
    let keep = widths
        .iter()
        .try_fold(0usize, |a, &w| a.checked_add(w))
        .unwrap_or(usize::MAX);
    let mine = widths.get(comm.rank()).copied().unwrap_or(usize::MAX);
    let expected = rows.saturating_mul(keep);
    if rows.saturating_mul(width) != local.len() || mine > width || out.len() != expected {
        return Err(CollectiveError::Buffers {
            during: "all_gather_columns (rows of the padded width in, of every real column out)",
            dtype: T::DTYPE.to_string(),
            got: out.len(),
            expected,
        });
    }
    let packed: Vec<T> = local
        .chunks_exact(width.max(1))
        .flat_map(|row| &row[..mine])
        .copied()
        .collect();
    let counts: Vec<usize> = widths.iter().map(|&w| w * rows).collect();
    let mut all = vec![T::default(); expected];
    comm.all_gather_counts(&packed, &counts, &mut all)?;
    let (mut at, mut column) = (0, 0);
    for &w in widths {
        for (r, piece) in all[at..at + w * rows].chunks_exact(w.max(1)).enumerate() {
            let start = r * keep + column;
            out[start..start + w].copy_from_slice(piece);
        }
        at += w * rows;
        column += w;
    }
    Ok(())
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
            HostData::Bf16(b) => Communicator::all_reduce_sum(self, b)?,
        }
        Ok(())
    }
    fn all_reduce_sum_planned(
        &mut self,
        buf: &mut A,
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CollectiveError> {
        Ok(match buf.host_data() {
            HostData::F32(b) => Communicator::all_reduce_sum_planned(self, b, algorithm)?,
            HostData::Bf16(b) => Communicator::all_reduce_sum_planned(self, b, algorithm)?,
        })
    }
    fn all_reduce_sum_rows(
        &mut self,
        buf: &mut A,
        row_len: usize,
        algorithm: Option<CollectiveAlgorithm>,
        row: &mut dyn FnMut(usize, &[f32]),
    ) -> Option<Result<Option<CollectiveAlgorithm>, CollectiveError>> {
        let len = buf.shape().iter().product::<usize>();
        if row_len == 0 || !len.is_multiple_of(row_len) {
            return Some(Err(CollectiveError::Buffers {
                during: "all_reduce_sum_rows (rows must divide the buffer)",
                dtype: buf.dtype().to_string(),
                got: len,
                expected: len.next_multiple_of(row_len.max(1)),
            }));
        }
        Some(match buf.host_data() {
            HostData::F32(b) => Communicator::all_reduce_sum_rows(self, b, row_len, algorithm, row)
                .map_err(CollectiveError::from),
            HostData::Bf16(b) => {
                // The row handed on in f32, widened once from the rounded sum.
                let mut wide = vec![0f32; row_len];
                Communicator::all_reduce_sum_rows(self, b, row_len, algorithm, &mut |r, x| {
                    for (w, v) in wide.iter_mut().zip(x) {
                        *w = v.to_f32();
                    }
                    row(r, &wide);
                })
                .map_err(CollectiveError::from)
            }
        })
    }
    fn all_gather(&mut self, local: &A, out: &mut A) -> Result<(), CollectiveError> {
        match (local.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(l), HostData::F32(o)) => Communicator::all_gather(self, l, o)?,
            (HostDataRef::Bf16(l), HostData::Bf16(o)) => Communicator::all_gather(self, l, o)?,
            _ => return Err(mismatch("all_gather")),
        }
        Ok(())
    }
    fn reduce_scatter_sum(&mut self, input: &A, out: &mut A) -> Result<(), CollectiveError> {
        match (input.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(i), HostData::F32(o)) => {
                Communicator::reduce_scatter_sum(self, i, o)?
            }
            (HostDataRef::Bf16(i), HostData::Bf16(o)) => {
                Communicator::reduce_scatter_sum(self, i, o)?
            }
            _ => return Err(mismatch("reduce_scatter_sum")),
        }
        Ok(())
    }
    fn all_gather_counts(
        &mut self,
        local: &A,
        counts: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError> {
        match (local.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(l), HostData::F32(o)) => {
                Communicator::all_gather_counts(self, l, counts, o)?
            }
            (HostDataRef::Bf16(l), HostData::Bf16(o)) => {
                Communicator::all_gather_counts(self, l, counts, o)?
            }
            _ => return Err(mismatch("all_gather_counts")),
        }
        Ok(())
    }
    fn reduce_scatter_sum_counts(
        &mut self,
        input: &A,
        counts: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError> {
        match (input.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(i), HostData::F32(o)) => {
                Communicator::reduce_scatter_sum_counts(self, i, counts, o)?
            }
            (HostDataRef::Bf16(i), HostData::Bf16(o)) => {
                Communicator::reduce_scatter_sum_counts(self, i, counts, o)?
            }
            _ => return Err(mismatch("reduce_scatter_sum_counts")),
        }
        Ok(())
    }
    fn all_gather_columns(
        &mut self,
        local: &A,
        widths: &[usize],
        out: &mut A,
    ) -> Result<(), CollectiveError> {
        let width = local.shape().last().copied().unwrap_or(0);
        match (local.host_data_ref(), out.host_data()) {
            (HostDataRef::F32(l), HostData::F32(o)) => {
                gather_real_columns(self, l, width, widths, o)
            }
            (HostDataRef::Bf16(l), HostData::Bf16(o)) => {
                gather_real_columns(self, l, width, widths, o)
            }
            _ => Err(mismatch("all_gather_columns")),
        }
    }
    fn broadcast(&mut self, buf: &mut A, root: usize) -> Result<(), CollectiveError> {
        match buf.host_data() {
            HostData::F32(b) => Communicator::broadcast(self, b, root)?,
            HostData::Bf16(b) => Communicator::broadcast(self, b, root)?,
        }
        Ok(())
    }
    fn send(&mut self, buf: &A, to: usize) -> Result<(), CollectiveError> {
        match buf.host_data_ref() {
            HostDataRef::F32(b) => Communicator::send(self, b, to)?,
            HostDataRef::Bf16(b) => Communicator::send(self, b, to)?,
        }
        Ok(())
    }
    fn recv(&mut self, buf: &mut A, from: usize) -> Result<(), CollectiveError> {
        match buf.host_data() {
            HostData::F32(b) => Communicator::recv(self, b, from)?,
            HostData::Bf16(b) => Communicator::recv(self, b, from)?,
        }
        Ok(())
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(Communicator::barrier(self)?)
    }
    fn abort(&mut self) {
        Communicator::abort(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::runtime::comm::local_group;
    use half::bf16;

    /// A host buffer of bf16 values, as a device backend with bf16 activations would have.
    struct Bf16Buf(Vec<bf16>, Vec<usize>);

    impl Activation for Bf16Buf {
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn dtype(&self) -> DType {
            DType::Bf16
        }
    }

    impl HostBuffer for Bf16Buf {
        fn host_data(&mut self) -> HostData<'_> {
            HostData::Bf16(&mut self.0)
        }
        fn host_data_ref(&self) -> HostDataRef<'_> {
            HostDataRef::Bf16(&self.0)
        }
    }

    #[test]
    fn host_communicators_move_backend_buffers_of_either_dtype() {
        let comms = local_group(3);
        std::thread::scope(|s| {
            for mut c in comms {
                s.spawn(move || {
                    let r = Collectives::<Bf16Buf>::rank(&c);
                    let mut x = Bf16Buf(vec![bf16::from_f32(r as f32 + 0.5); 4], vec![1, 4]);
                    Collectives::all_reduce_sum(&mut c, &mut x).unwrap();
                    assert!(x.0.iter().all(|v| v.to_f32() == 4.5));
                    let mut all = Bf16Buf(vec![bf16::ZERO; 12], vec![3, 4]);
                    Collectives::all_gather(&mut c, &x, &mut all).unwrap();
                    assert_eq!(all.0.len(), 12);
                    let mut b = Bf16Buf(vec![bf16::from_f32(r as f32); 2], vec![1, 2]);
                    Collectives::broadcast(&mut c, &mut b, 2).unwrap();
                    assert!(b.0.iter().all(|v| v.to_f32() == 2.0));
                    // Point to point around the ring, in f32 host tensors.
                    let n = Collectives::<Bf16Buf>::world_size(&c);
                    let t = crate::runtime::tensor::Tensor::new(vec![1, 2], vec![r as f32; 2]);
                    Collectives::send(&mut c, &t, (r + 1) % n).unwrap();
                    let mut got = crate::runtime::tensor::Tensor::new(vec![1, 2], vec![0.0; 2]);
                    Collectives::recv(&mut c, &mut got, (r + n - 1) % n).unwrap();
                    assert_eq!(got.data, vec![((r + n - 1) % n) as f32; 2]);
                    // Leaving the group early counts as a failure for ranks still in it.
                    Collectives::<Bf16Buf>::barrier(&mut c).unwrap();
                });
            }
        });
    }
}
