//! Ranks as processes: a [`Communicator`] over an MPI communicator (Open MPI through rsmpi).
//!
//! Data moves as bytes through MPI's own collectives and point-to-point calls. Sums keep the
//! contract of the module ([`super`]): every rank gathers the others' buffers
//! (`MPI_Allgather`, or `MPI_Alltoall` for a reduce-scatter) and adds them itself in the
//! fixed order of [`super::reduce::summation_order`], in `f32`, rounding once — so an MPI
//! run is bit-identical to the same plan on threads, and every rank holds the same bits.
//! That moves `n − 1` buffers into each rank where `MPI_Allreduce` would move about two;
//! for the group sizes tensor parallelism uses (2–8) and its message sizes it is the price of
//! exact agreement with the threaded runtime.
//!
//! What differs from the in-process group: MPI does not report a peer's failure to the
//! ranks waiting on it, it ends the job. A call whose sizes disagree between ranks is an MPI
//! error, which Open MPI makes fatal for every process; [`Communicator::abort`] only marks
//! this communicator (the process launcher then prints the error and calls `MPI_Abort`, and
//! `mpirun` stops every process). `send` may wait for the matching `recv` when a message is
//! large (MPI's rendezvous protocol); the pipeline's messages never wait on each other in a
//! cycle, so this cannot deadlock them.

use super::bench::{slowest_rank_stats, time_each, BenchKind, BenchRow};
use super::private::PerType;
use super::reduce::{chunk_range, summation_order};
use super::{check_counts, Collective, CommError, Communicator, Element};
use crate::ir::DType;
use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::{CommunicatorCollectives, Root};
use std::time::Duration;

/// One rank of an MPI (sub-)communicator.
pub struct MpiComm {
    comm: SimpleCommunicator,
    rank: usize,
    n: usize,
    aborted: bool,
    /// Every rank's buffer, gathered for a sum (reused between calls).
    gathered: PerType,
}

// SAFETY: an MPI communicator handle may be used from any thread when MPI was initialized
// with at least `MPI_THREAD_SERIALIZED` (the process launcher refuses less), and `&mut self`
// on every call keeps calls on one communicator from overlapping.
unsafe impl Send for MpiComm {}

/// MPI counts are C ints.
const MAX_COUNT: usize = i32::MAX as usize;

/// The bytes of a slice of `f32` or `bf16` (both plain data without padding).
/// Element counts or offsets as MPI's byte counts (C ints; callers check the total fits).
fn in_bytes<T: Element>(elements: &[usize]) -> Vec<i32> {
    let size = std::mem::size_of::<T>();
    elements.iter().map(|&c| (c * size) as i32).collect()
}

fn bytes<T: Element>(buf: &[T]) -> &[u8] {
    // SAFETY: `Element` is sealed to `f32` and `bf16`, which have no padding and no invalid
    // bit patterns; the byte view covers exactly the slice and borrows it.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast(), std::mem::size_of_val(buf)) }
}

fn bytes_mut<T: Element>(buf: &mut [T]) -> &mut [u8] {
    let len = std::mem::size_of_val(buf);
    // SAFETY: as in `bytes`; every byte pattern written through the view is a valid `f32`
    // or `bf16`.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast(), len) }
}

/// The message tag that carries the element type of a point-to-point message.
fn tag_of(dtype: DType) -> i32 {
    match dtype {
        DType::Bf16 => 2,
        _ => 1,
    }
}

impl MpiComm {
    /// `buf` ← `buf` of `root`, as bytes (an opaque token such as NCCL's unique id; every
    /// rank passes a buffer of the same length).
    pub fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.check_root(root)?;
        self.comm.process_at_rank(root as i32).broadcast_into(buf);
        Ok(())
    }

    /// A broadcast's root must be a usable member of the group.
    fn check_root(&self, root: usize) -> Result<(), CommError> {
        let during = Collective::Broadcast;
        self.check_usable(during)?;
        if root >= self.n {
            return Err(CommError::BadRank {
                rank: self.rank,
                during,
                peer: root,
                world_size: self.n,
                what: "it is not in the group",
            });
        }
        Ok(())
    }

    /// This process's rank of `comm` (a communicator of the initialized MPI world).
    pub fn new(comm: SimpleCommunicator) -> MpiComm {
        MpiComm {
            rank: comm.rank() as usize,
            n: comm.size() as usize,
            comm,
            aborted: false,
            gathered: PerType::default(),
        }
    }

    fn check_usable(&self, during: Collective) -> Result<(), CommError> {
        if self.aborted {
            return Err(CommError::Aborted {
                rank: self.rank,
                during,
            });
        }
        Ok(())
    }

    /// `len` elements of `T`, `times` over, as an MPI byte count.
    fn count<T: Element>(
        &self,
        len: usize,
        times: usize,
        during: Collective,
    ) -> Result<(), CommError> {
        let total = len
            .checked_mul(times)
            .and_then(|x| x.checked_mul(std::mem::size_of::<T>()));
        match total {
            Some(b) if b <= MAX_COUNT => Ok(()),
            _ => Err(CommError::SizeMismatch {
                rank: self.rank,
                during,
                what: "a message of at most 2^31 − 1 bytes (MPI counts are C ints)",
                expected: MAX_COUNT / std::mem::size_of::<T>(),
                got: len.saturating_mul(times),
            }),
        }
    }

    fn check_peer(&self, peer: usize, during: Collective) -> Result<(), CommError> {
        let what = if peer >= self.n {
            "it is not in the group"
        } else if peer == self.rank {
            "a rank cannot send to or receive from itself"
        } else {
            return Ok(());
        };
        Err(CommError::BadRank {
            rank: self.rank,
            during,
            peer,
            world_size: self.n,
            what,
        })
    }

    /// Every rank's `buf`, rank-major, in this rank's gather buffer.
    fn gather_all<T: Element>(&mut self, buf: &[T]) -> Vec<T> {
        let mut all = std::mem::take(T::of(&mut self.gathered));
        all.clear();
        all.resize(buf.len() * self.n, T::default());
        self.comm.all_gather_into(bytes(buf), bytes_mut(&mut all));
        all
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce_sum<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CommError> {
        let during = Collective::AllReduceSum;
        self.check_usable(during)?;
        self.count::<T>(buf.len(), self.n, during)?;
        if self.n == 1 {
            return Ok(());
        }
        let (n, len) = (self.n, buf.len());
        let all = self.gather_all(buf);
        for c in 0..n {
            let range = chunk_range(len, n, c);
            if range.is_empty() {
                continue;
            }
            let sources =
                summation_order(n, c).map(|q| &all[q * len + range.start..q * len + range.end]);
            T::sum_into(&mut buf[range.clone()], sources);
        }
        *T::of(&mut self.gathered) = all;
        Ok(())
    }

    fn all_gather<T: Element>(&mut self, local: &[T], out: &mut [T]) -> Result<(), CommError> {
        let during = Collective::AllGather;
        self.check_usable(during)?;
        let expected = local.len().saturating_mul(self.n);
        if out.len() != expected {
            return Err(CommError::SizeMismatch {
                rank: self.rank,
                during,
                what: "`out` (must hold world_size × local.len())",
                expected,
                got: out.len(),
            });
        }
        self.count::<T>(local.len(), self.n, during)?;
        self.comm.all_gather_into(bytes(local), bytes_mut(out));
        Ok(())
    }

    fn reduce_scatter_sum<T: Element>(
        &mut self,
        input: &[T],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::ReduceScatterSum;
        self.check_usable(during)?;
        let (n, m) = (self.n, out.len());
        let expected = m.saturating_mul(n);
        if input.len() != expected {
            return Err(CommError::SizeMismatch {
                rank: self.rank,
                during,
                what: "`input` (must hold world_size × out.len())",
                expected,
                got: input.len(),
            });
        }
        self.count::<T>(m, n, during)?;
        // Piece q of every rank's input goes to rank q: what arrives here is every rank's
        // piece `rank`, rank-major.
        let mut pieces = std::mem::take(T::of(&mut self.gathered));
        pieces.clear();
        pieces.resize(expected, T::default());
        self.comm
            .all_to_all_into(bytes(input), bytes_mut(&mut pieces));
        T::sum_into(
            out,
            summation_order(n, self.rank).map(|q| &pieces[q * m..(q + 1) * m]),
        );
        *T::of(&mut self.gathered) = pieces;
        Ok(())
    }

    fn all_gather_counts<T: Element>(
        &mut self,
        local: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::AllGatherCounts;
        self.check_usable(during)?;
        let (offsets, total) =
            check_counts(self.rank, self.n, during, counts, local.len(), out.len())?;
        self.count::<T>(total, 1, during)?;
        // The total fits a C int (checked), so each count and offset does.
        let (counts, offsets) = (in_bytes::<T>(counts), in_bytes::<T>(&offsets));
        let mut parts = PartitionMut::new(bytes_mut(out), &counts[..], &offsets[..]);
        self.comm.all_gather_varcount_into(bytes(local), &mut parts);
        Ok(())
    }

    fn reduce_scatter_sum_counts<T: Element>(
        &mut self,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::ReduceScatterSumCounts;
        self.check_usable(during)?;
        let (n, rank) = (self.n, self.rank);
        let (offsets, total) = check_counts(rank, n, during, counts, out.len(), input.len())?;
        let m = counts[rank];
        self.count::<T>(total.max(m.saturating_mul(n)), 1, during)?;
        // Piece q of every rank's input goes to rank q: what arrives here is every rank's
        // piece `rank`, rank-major.
        let (send_counts, send_offsets) = (in_bytes::<T>(counts), in_bytes::<T>(&offsets));
        let recv_counts = in_bytes::<T>(&vec![m; n]);
        let recv_offsets = in_bytes::<T>(&(0..n).map(|q| q * m).collect::<Vec<_>>());
        let mut pieces = std::mem::take(T::of(&mut self.gathered));
        pieces.clear();
        pieces.resize(m * n, T::default());
        {
            let send = Partition::new(bytes(input), &send_counts[..], &send_offsets[..]);
            let mut recv =
                PartitionMut::new(bytes_mut(&mut pieces), &recv_counts[..], &recv_offsets[..]);
            self.comm.all_to_all_varcount_into(&send, &mut recv);
        }
        T::sum_into(
            out,
            summation_order(n, rank).map(|q| &pieces[q * m..(q + 1) * m]),
        );
        *T::of(&mut self.gathered) = pieces;
        Ok(())
    }

    fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.check_root(root)?;
        self.count::<T>(buf.len(), 1, Collective::Broadcast)?;
        self.comm
            .process_at_rank(root as i32)
            .broadcast_into(bytes_mut(buf));
        Ok(())
    }

    fn send<T: Element>(&mut self, buf: &[T], to: usize) -> Result<(), CommError> {
        let during = Collective::Send;
        self.check_peer(to, during)?;
        self.check_usable(during)?;
        self.count::<T>(buf.len(), 1, during)?;
        self.comm
            .process_at_rank(to as i32)
            .send_with_tag(bytes(buf), tag_of(T::DTYPE));
        Ok(())
    }

    fn recv<T: Element>(&mut self, buf: &mut [T], from: usize) -> Result<(), CommError> {
        let during = Collective::Recv;
        self.check_peer(from, during)?;
        self.check_usable(during)?;
        self.count::<T>(buf.len(), 1, during)?;
        // Probe first: a message of another size or type is consumed and reported instead of
        // being an MPI truncation error, which would end the job.
        let (message, status) = self.comm.process_at_rank(from as i32).matched_probe();
        let got = status.count(u8::equivalent_datatype()).max(0) as usize;
        let sent_dtype = if status.tag() == tag_of(DType::Bf16) {
            DType::Bf16
        } else {
            DType::F32
        };
        if sent_dtype == T::DTYPE && got == std::mem::size_of_val(buf) {
            message.matched_receive_into(bytes_mut(buf));
            return Ok(());
        }
        let mut discard = vec![0u8; got];
        message.matched_receive_into(&mut discard[..]);
        if sent_dtype != T::DTYPE {
            return Err(CommError::DTypeMismatch {
                rank: self.rank,
                during,
                dtype: T::DTYPE,
                peer: from,
                peer_during: Collective::Send,
                peer_dtype: sent_dtype,
            });
        }
        Err(CommError::PeerMismatch {
            rank: self.rank,
            during,
            len: buf.len(),
            peer: from,
            peer_during: Collective::Send,
            peer_len: got / std::mem::size_of::<T>(),
        })
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.check_usable(Collective::Barrier)?;
        self.comm.barrier();
        Ok(())
    }

    fn abort(&mut self) {
        self.aborted = true;
    }
}

/// All-reduce latency over MPI processes for each message size in bytes (whole `f32`s), for
/// tpc's exact all-reduce and for `MPI_Allreduce`: per iteration the slowest rank's time,
/// median and minimum over `iters` timed calls after a warm-up. Collective: every process
/// calls it with the same arguments; every rank gets the rows.
pub fn bench_all_reduce_mpi(
    comm: &mut MpiComm,
    sizes_bytes: &[usize],
    iters: usize,
) -> Vec<BenchRow> {
    use mpi::collective::SystemOperation;
    let n = comm.n;
    let mut rows = Vec::new();
    for &bytes in sizes_bytes {
        let len = bytes / 4;
        let mut buf = vec![1f32; len];
        let mut out = vec![0f32; len];
        for kind in [BenchKind::MpiExact, BenchKind::MpiAllreduce] {
            let mut call = |c: &mut MpiComm| match kind {
                BenchKind::MpiAllreduce => {
                    c.comm
                        .all_reduce_into(&buf[..], &mut out[..], SystemOperation::sum())
                }
                _ => {
                    let _ = c.all_reduce_sum(&mut buf);
                    buf.fill(1.0);
                }
            };
            for _ in 0..3 {
                call(comm);
            }
            comm.comm.barrier();
            let mine: Vec<f64> = time_each(iters, || call(comm))
                .iter()
                .map(|d| d.as_secs_f64())
                .collect();
            let mut all = vec![0f64; iters * n];
            comm.comm.all_gather_into(&mine[..], &mut all[..]);
            let per_rank: Vec<Vec<Duration>> = all
                .chunks(iters)
                .map(|c| c.iter().map(|&s| Duration::from_secs_f64(s)).collect())
                .collect();
            let refs: Vec<&Vec<Duration>> = per_rank.iter().collect();
            let (median, min) = slowest_rank_stats(&refs);
            rows.push(BenchRow {
                world: n,
                dtype: DType::F32,
                bytes: len * 4,
                kind,
                iters,
                median_us: median * 1e6,
                min_us: min * 1e6,
                bus_gb_s: 2.0 * (n as f64 - 1.0) / n as f64 * (len * 4) as f64 / median / 1e9,
            });
        }
    }
    rows
}
