//! The link between a server's front and its replicas' leading processes under mpirun
//! (`tpc serve --dp D`): MPI point-to-point messages on a communicator of the replicas'
//! leading ranks, ranked by replica, so the front (replica 0) is peer 0. Its relay thread
//! calls MPI while the engine's thread runs collectives on other communicators, which
//! needs `MPI_THREAD_MULTIPLE` ([`super::MpiWorld::many_threads`]).

use crate::runtime::engine::remote::{Link, LinkError};
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

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
    fn send(&mut self, to: usize, message: &[u8]) -> Result<(), LinkError> {
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

    fn try_receive(&mut self) -> Result<Option<(usize, Vec<u8>)>, LinkError> {
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
