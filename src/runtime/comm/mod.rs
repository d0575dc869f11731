//! Collective and point-to-point communication between the ranks of a tensor-parallel group.
//!
//! [`Communicator`] is what the executor calls; [`local_group`] builds an in-process group in
//! which every rank is a thread and the collectives read peers' buffers directly. Every
//! operation moves [`Element`]s: `f32` or `half::bf16`.
//!
//! # Contract
//!
//! * Every rank makes the same collective calls, in the same order, with the same sizes,
//!   element type and (for broadcast) root. A disagreement is detected at the call where it
//!   happens and every rank gets an error ([`CommError::PeerMismatch`],
//!   [`CommError::DTypeMismatch`], [`CommError::RootMismatch`],
//!   [`CommError::PeerBadArguments`]); the group stays usable.
//! * Point-to-point messages ([`Communicator::send`], [`Communicator::recv`]) are a separate
//!   stream per ordered pair of ranks: buffered, in order, not ordered against collectives. A
//!   `recv` whose size or element type differs from the matching `send` consumes the message
//!   and returns an error.
//! * A rank that fails — panics while owning its communicator, calls
//!   [`Communicator::abort`], or drops its communicator while the others go on — makes every
//!   rank that is blocked in, or later enters, a collective or `send`/`recv` return
//!   [`CommError::PeerFailed`] promptly. The group cannot be used after that, with one
//!   exception: a message sent before the failure can still be received (so a pipeline
//!   stage may send its last output and drop its communicator); a `recv` with no such
//!   message waiting returns `PeerFailed`.
//! * Sums are bit-reproducible: every element is summed in a fixed order (see
//!   [`reduce`]), in `f32` whatever the element type, and rounded once to the element type,
//!   so all ranks hold bit-identical results, repeated runs are bit-identical, and the
//!   result does not depend on which all-reduce algorithm was chosen.

mod barrier;
/// The most ranks an in-process group ([`local_group`]) can have.
pub use barrier::MAX_WORLD as MAX_LOCAL_RANKS;
pub mod bench;
mod local;
mod mailbox;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "mpi")]
pub use self::mpi::{bench_all_reduce_mpi, MpiComm};
pub mod reduce;

#[cfg(test)]
mod tests;

pub use local::{
    local_group, AllReduceAlgorithm, LocalComm, ONE_SHOT_MAX_BYTES,
    ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED,
};

use crate::ir::{CollectiveAlgorithm, DType};
use half::bf16;
use std::fmt;

/// Element types a collective moves. Sealed: `f32` and `half::bf16`.
///
/// Reductions always accumulate in `f32` and round the final sum once with
/// [`Element::from_f32`].
pub trait Element:
    Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static + private::Sealed
{
    /// The element type as the IR names it.
    const DTYPE: DType;

    /// Exact widening.
    fn to_f32(self) -> f32;

    /// Narrowing; rounds to nearest, ties to even, for `bf16` (NaN stays NaN).
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

/// The conversions are written out branch-free (same results as `half`'s, which branch on
/// NaN) so that the reduction loops vectorize: with `half`'s, a `bf16` all-reduce of 1 MiB
/// on 2 ranks took 3.1× the time of an `f32` one (ring, 347 vs 112 µs).
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        let x = v.to_bits();
        // Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when the
        // dropped half is above one half, or equal to it with an odd kept part.
        let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
        // NaN: keep the sign and the top of the payload, and make it quiet.
        let nan = (x >> 16) | 0x40;
        bf16::from_bits(if v.is_nan() { nan } else { rounded } as u16)
    }
}

/// What seals [`Element`], and the per-type hooks that let generic code reach per-type
/// storage and kernels without casting pointers between element types.
mod private {
    use super::reduce;
    use half::bf16;

    /// One buffer per element type (a rank's one-shot staging buffer).
    #[derive(Default)]
    pub struct PerType {
        pub f32: Vec<f32>,
        pub bf16: Vec<bf16>,
    }

    /// A buffer of either element type (a point-to-point message).
    #[derive(Debug)]
    pub enum Owned {
        F32(Vec<f32>),
        Bf16(Vec<bf16>),
    }

    pub trait Sealed: Sized + 'static {
        /// This type's buffer in `p`.
        fn of(p: &mut PerType) -> &mut Vec<Self>;

        fn into_owned(v: Vec<Self>) -> Owned;

        /// The vector if `o` holds this type, else `o` back.
        fn from_owned(o: Owned) -> Result<Vec<Self>, Owned>;

        /// `buf` itself when `Self` is `f32`: sums can then be carried in place.
        fn as_f32_mut(buf: &mut [Self]) -> Option<&mut [f32]>;

        /// `dst ← round(((s₀ + s₁) + s₂) + …)`, summed in `f32`; see [`reduce::sum_into`].
        fn sum_into<'a>(dst: &mut [Self], sources: impl Iterator<Item = &'a [Self]> + Clone);
    }

    impl Sealed for f32 {
        fn of(p: &mut PerType) -> &mut Vec<Self> {
            &mut p.f32
        }

        fn into_owned(v: Vec<Self>) -> Owned {
            Owned::F32(v)
        }

        fn from_owned(o: Owned) -> Result<Vec<Self>, Owned> {
            match o {
                Owned::F32(v) => Ok(v),
                other => Err(other),
            }
        }

        fn as_f32_mut(buf: &mut [Self]) -> Option<&mut [f32]> {
            Some(buf)
        }

        fn sum_into<'a>(dst: &mut [Self], sources: impl Iterator<Item = &'a [Self]> + Clone) {
            reduce::sum_into(dst, sources);
        }
    }

    impl Sealed for bf16 {
        fn of(p: &mut PerType) -> &mut Vec<Self> {
            &mut p.bf16
        }

        fn into_owned(v: Vec<Self>) -> Owned {
            Owned::Bf16(v)
        }

        fn from_owned(o: Owned) -> Result<Vec<Self>, Owned> {
            match o {
                Owned::Bf16(v) => Ok(v),
                other => Err(other),
            }
        }

        fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
            None
        }

        fn sum_into<'a>(dst: &mut [Self], sources: impl Iterator<Item = &'a [Self]> + Clone) {
            reduce::sum_widened_into(dst, sources);
        }
    }

    impl Owned {
        pub fn dtype(&self) -> crate::ir::DType {
            match self {
                Owned::F32(_) => crate::ir::DType::F32,
                Owned::Bf16(_) => crate::ir::DType::Bf16,
            }
        }
    }
}

/// The collective operations, as named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduceSum,
    AllGather,
    ReduceScatterSum,
    Barrier,
    Broadcast,
    Send,
    Recv,
    AllGatherCounts,
    ReduceScatterSumCounts,
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Collective::AllReduceSum => "all_reduce_sum",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatterSum => "reduce_scatter_sum",
            Collective::Barrier => "barrier",
            Collective::Broadcast => "broadcast",
            Collective::Send => "send",
            Collective::Recv => "recv",
            Collective::AllGatherCounts => "all_gather_counts",
            Collective::ReduceScatterSumCounts => "reduce_scatter_sum_counts",
        })
    }
}

/// How a rank left its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureCause {
    /// Its thread panicked (its communicator was dropped while unwinding, or the panic
    /// happened inside a collective).
    Panicked,
    /// It called [`Communicator::abort`].
    Aborted,
    /// It dropped its communicator without panicking while the others went on.
    Dropped,
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureCause::Panicked => "panicked",
            FailureCause::Aborted => "aborted its communicator",
            FailureCause::Dropped => "dropped its communicator (left the group)",
        })
    }
}

/// Why a collective did not complete. `rank` is always the rank that reports the error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank}: {during} cannot complete because rank {peer} {cause}; the group is unusable, build a new one")]
    PeerFailed {
        rank: usize,
        /// The rank that failed first.
        peer: usize,
        cause: FailureCause,
        during: Collective,
    },

    #[error("rank {rank}: {during} called after this communicator was aborted")]
    Aborted { rank: usize, during: Collective },

    #[error("rank {rank}: {during} got {what} of {got} elements, expected {expected}")]
    SizeMismatch {
        rank: usize,
        during: Collective,
        /// Which argument, and the rule it breaks.
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("rank {rank}: {during} of {len} elements, but rank {peer} called {peer_during} of {peer_len} elements; every rank must make the same collective calls in the same order with the same sizes")]
    PeerMismatch {
        rank: usize,
        during: Collective,
        len: usize,
        peer: usize,
        peer_during: Collective,
        peer_len: usize,
    },

    #[error("rank {rank}: {during} of {dtype} elements, but rank {peer} called {peer_during} with {peer_dtype} elements; every rank must pass the same element type")]
    DTypeMismatch {
        rank: usize,
        during: Collective,
        dtype: DType,
        peer: usize,
        peer_during: Collective,
        peer_dtype: DType,
    },

    #[error("rank {rank}: broadcast from root {root}, but rank {peer} named root {peer_root}; every rank must name the same root")]
    RootMismatch {
        rank: usize,
        root: usize,
        peer: usize,
        peer_root: usize,
    },

    #[error(
        "rank {rank}: {during} names rank {peer}, but {what}; the group has ranks 0..{world_size}"
    )]
    BadRank {
        rank: usize,
        during: Collective,
        peer: usize,
        world_size: usize,
        /// The rule it breaks.
        what: &'static str,
    },

    #[error("rank {rank}: {during} abandoned because rank {peer} passed buffers of inconsistent sizes to it")]
    PeerBadArguments {
        rank: usize,
        during: Collective,
        peer: usize,
    },

    #[error("rank {rank}: all_reduce_sum forced to the {algorithm} algorithm, but rank {peer} forced {peer_algorithm}; force the same algorithm on every rank or use Auto")]
    AlgorithmMismatch {
        rank: usize,
        peer: usize,
        algorithm: AllReduceAlgorithm,
        peer_algorithm: AllReduceAlgorithm,
    },
}

/// Checks a rank's arguments to a collective of unequal pieces: one count per rank, its own
/// piece `mine` elements long and the whole `whole` elements (the sum of the counts).
/// Returns the offset of every piece, and the sum.
pub(crate) fn check_counts(
    rank: usize,
    world_size: usize,
    during: Collective,
    counts: &[usize],
    mine: usize,
    whole: usize,
) -> Result<(Vec<usize>, usize), CommError> {
    let mismatch = |what, expected, got| CommError::SizeMismatch {
        rank,
        during,
        what,
        expected,
        got,
    };
    if counts.len() != world_size {
        return Err(mismatch(
            "`counts` (one per rank)",
            world_size,
            counts.len(),
        ));
    }
    let mut offsets = Vec::with_capacity(world_size);
    let mut total = 0usize;
    for &c in counts {
        offsets.push(total);
        total = total
            .checked_add(c)
            .ok_or_else(|| mismatch("`counts` (their sum must fit in memory)", usize::MAX, c))?;
    }
    if mine != counts[rank] {
        return Err(mismatch(
            "its own piece (must hold counts[rank] elements)",
            counts[rank],
            mine,
        ));
    }
    if whole != total {
        return Err(mismatch(
            "the whole (must hold the sum of the counts)",
            total,
            whole,
        ));
    }
    Ok((offsets, total))
}

/// Collective and point-to-point communication for one rank of a tensor-parallel group.
///
/// Every method but `send`, `recv` and `abort` is a collective: all ranks of the group must
/// call it, in the same order, with the same sizes and element type. After `Err` the
/// contents of the output buffer (`buf`, `out`) are unspecified; inputs are never modified.
pub trait Communicator: Send {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// `buf` ← elementwise sum of every rank's `buf` (all ranks pass the same length).
    fn all_reduce_sum<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CommError>;

    /// [`Communicator::all_reduce_sum`] with the algorithm a plan recorded (`None`: the
    /// communicator's own choice). Returns the algorithm that ran, when the communicator
    /// knows it; one without a choice of algorithms runs its own and returns `None`.
    fn all_reduce_sum_planned<T: Element>(
        &mut self,
        buf: &mut [T],
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CommError> {
        let _ = algorithm;
        self.all_reduce_sum(buf).map(|()| None)
    }

    /// [`Communicator::all_reduce_sum_planned`], then `row(r, x)` on each row `x` of
    /// `row_len` elements of the sum, in order (`buf.len()` a multiple of `row_len`). A
    /// communicator that can hands each row on as soon as it is summed, while it is still
    /// in cache, so that the reduction and what reads it are one loop over the rows (the
    /// in-process one-shot); this default reduces the whole buffer first.
    fn all_reduce_sum_rows<T: Element>(
        &mut self,
        buf: &mut [T],
        row_len: usize,
        algorithm: Option<CollectiveAlgorithm>,
        row: &mut dyn FnMut(usize, &[T]),
    ) -> Result<Option<CollectiveAlgorithm>, CommError> {
        let ran = self.all_reduce_sum_planned(buf, algorithm)?;
        for (r, x) in buf.chunks(row_len.max(1)).enumerate() {
            row(r, x);
        }
        Ok(ran)
    }

    /// `out` ← every rank's `local`, concatenated in rank order; `local` has the same length
    /// on every rank and `out.len() == world_size() * local.len()`.
    fn all_gather<T: Element>(&mut self, local: &[T], out: &mut [T]) -> Result<(), CommError>;

    /// `input` is `world_size()` pieces of `out.len()` elements; rank `r` gets in `out` the
    /// elementwise sum over ranks of piece `r`.
    fn reduce_scatter_sum<T: Element>(
        &mut self,
        input: &[T],
        out: &mut [T],
    ) -> Result<(), CommError>;

    /// [`Communicator::all_gather`] of unequal pieces: rank `q` gives `counts[q]` elements
    /// (`local.len() == counts[rank()]`), and `out` (their sum) gets every rank's, in rank
    /// order. Every rank passes the same `counts`, one per rank; only real elements move.
    fn all_gather_counts<T: Element>(
        &mut self,
        local: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError>;

    /// [`Communicator::reduce_scatter_sum`] of unequal pieces: `input` is every rank's piece
    /// in rank order, piece `q` of `counts[q]` elements; rank `r` gets in `out`
    /// (`counts[r]` elements) the elementwise sum over ranks of piece `r`, added in the
    /// order [`Communicator::reduce_scatter_sum`] adds. Every rank passes the same `counts`.
    fn reduce_scatter_sum_counts<T: Element>(
        &mut self,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError>;

    /// `buf` on every rank ← `buf` of `root` (every rank names the same root).
    fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError>;

    /// Point to point (pipeline stages). `send` may return before the matching `recv`
    /// (buffered); messages between one pair arrive in order; sizes must match.
    fn send<T: Element>(&mut self, buf: &[T], to: usize) -> Result<(), CommError>;

    /// Receives the oldest message from `from` not yet received. Waits for it, as long as no
    /// rank of the group fails; a message sent before a failure is still received.
    fn recv<T: Element>(&mut self, buf: &mut [T], from: usize) -> Result<(), CommError>;

    /// Returns once every rank has called it; what a rank did before happens-before what any
    /// rank does after.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Marks this rank failed: every peer blocked in or later entering any collective or
    /// recv returns `CommError::PeerFailed` promptly (a recv first takes a message sent to
    /// it before the failure, if there is one), and this communicator refuses further calls
    /// with [`CommError::Aborted`]. Idempotent.
    fn abort(&mut self);
}
