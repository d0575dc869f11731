//! Collective communication between the ranks of a tensor-parallel group.
//!
//! [`Communicator`] is what the executor calls; [`local_group`] builds an in-process group in
//! which every rank is a thread and the collectives read peers' buffers directly.
//!
//! # Contract
//!
//! * Every rank makes the same collective calls, in the same order, with the same sizes.
//!   A disagreement is detected at the call where it happens and every rank gets an error
//!   ([`CommError::PeerMismatch`], [`CommError::PeerBadArguments`]); the group stays usable.
//! * A rank that fails — panics while owning its communicator, calls
//!   [`LocalComm::abort`], or drops its communicator while the others go on — makes every
//!   rank that is blocked in, or later enters, a collective return
//!   [`CommError::PeerFailed`] promptly. The group cannot be used after that.
//! * Sums are bit-reproducible: every element is summed in a fixed order (see
//!   [`reduce`]), so all ranks hold bit-identical results, repeated runs are bit-identical,
//!   and the result does not depend on which all-reduce algorithm was chosen.

mod barrier;
pub mod bench;
mod local;
pub mod reduce;

#[cfg(test)]
mod tests;

pub use local::{
    local_group, AllReduceAlgorithm, LocalComm, ONE_SHOT_MAX_BYTES,
    ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED,
};

use std::fmt;

/// The collective operations, as named in errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    AllReduceSum,
    AllGather,
    ReduceScatterSum,
    Barrier,
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Collective::AllReduceSum => "all_reduce_sum",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatterSum => "reduce_scatter_sum",
            Collective::Barrier => "barrier",
        })
    }
}

/// How a rank left its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureCause {
    /// Its thread panicked (its communicator was dropped while unwinding, or the panic
    /// happened inside a collective).
    Panicked,
    /// It called [`LocalComm::abort`].
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

/// Collective communication for one rank of a tensor-parallel group.
///
/// Every method is a collective: all ranks of the group must call it, in the same order,
/// with the same sizes. After `Err` the contents of the output buffer (`buf`, `out`) are
/// unspecified; inputs are never modified.
pub trait Communicator: Send {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// `buf` ← elementwise sum of every rank's `buf` (all ranks pass the same length).
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError>;

    /// `out` ← every rank's `local`, concatenated in rank order; `local` has the same length
    /// on every rank and `out.len() == world_size() * local.len()`.
    fn all_gather(&mut self, local: &[f32], out: &mut [f32]) -> Result<(), CommError>;

    /// `input` is `world_size()` pieces of `out.len()` elements; rank `r` gets in `out` the
    /// elementwise sum over ranks of piece `r`.
    fn reduce_scatter_sum(&mut self, input: &[f32], out: &mut [f32]) -> Result<(), CommError>;

    /// Returns once every rank has called it; what a rank did before happens-before what any
    /// rank does after.
    fn barrier(&mut self) -> Result<(), CommError>;
}
