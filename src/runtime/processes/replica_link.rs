//! The link between a server's front and its replicas' leading processes under mpirun
//! (`tpc serve --dp D`): MPI point-to-point messages on a communicator of the replicas'
//! leading ranks, ranked by replica, so the front (replica 0) is peer 0. Its relay thread
//! calls MPI while the engine's thread runs collectives on other communicators, which
//! needs `MPI_THREAD_MULTIPLE` ([`super::MpiWorld::many_threads`]).

use crate::runtime::engine::remote::{Link, LinkError};
use crate::runtime::engine::ticks::{ReplicaTicks, Tick};
use crate::runtime::error::Result;
use mpi::collective::SystemOperation;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;

pub struct MpiLink {
    comm: SimpleCommunicator,
}

impl MpiLink {
    pub fn new(comm: SimpleCommunicator) -> Self {
        MpiLink { comm }
    }

    /// Whether this process is the front (replica 0's leading process).
    pub fn is_front(&self) -> bool {
        self.comm.rank() == 0
    }
}

// SAFETY: the link is built only where MPI provides `MPI_THREAD_MULTIPLE` (serve_mpi checks
// it first), and only the thread that owns the link uses its communicator.
unsafe impl Send for MpiLink {}

impl Link for MpiLink {
    fn send(&mut self, to: usize, message: &[u8]) -> std::result::Result<(), LinkError> {
        if i32::try_from(message.len()).is_err() {
            return Err(LinkError::Transport(format!(
                "a message of {} bytes exceeds MPI's counts",
                message.len()
            )));
        }
        let to = i32::try_from(to)
            .ok()
            .filter(|&t| t < self.comm.size())
            .ok_or_else(|| LinkError::Transport(format!("no replica {to} on the link")))?;
        self.comm.process_at_rank(to).send(message);
        Ok(())
    }

    fn try_receive(&mut self) -> std::result::Result<Option<(usize, Vec<u8>)>, LinkError> {
        Ok(self
            .comm
            .any_process()
            .immediate_matched_probe()
            .map(|probed| {
                let (bytes, status) = probed.matched_receive_vec::<u8>();
                (status.source_rank().max(0) as usize, bytes)
            }))
    }
}

/// The replicas' leading ranks ticking together (`--ep`, [`crate::runtime::engine::ticks`]):
/// an all-reduce of the busy and done flags on their own communicator.
pub struct MpiTicks {
    comm: SimpleCommunicator,
}

impl MpiTicks {
    pub fn new(comm: SimpleCommunicator) -> Self {
        MpiTicks { comm }
    }
}

// SAFETY: as for `MpiLink`; only the leading rank's engine thread ticks.
unsafe impl Send for MpiTicks {}

impl ReplicaTicks for MpiTicks {
    fn tick(&mut self, busy: bool, done: bool) -> Result<Tick> {
        let mine = [u64::from(busy), u64::from(done)];
        let mut sum = [0u64; 2];
        self.comm
            .all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
        Ok(Tick {
            any_busy: sum[0] > 0,
            all_done: sum[1] == self.comm.size().max(1) as u64,
        })
    }
}
