//! Replicas in other processes behind one server (`mpirun … tpc serve --dp D`): the server's
//! front holds replica 0's engine and, for every other replica, a [`RemoteReplica`] that
//! passes its requests to that replica's leading process and its events back over a
//! [`Link`]. On the replica's side, [`relay_requests`] drives its engine's handle from the
//! front's messages. The link is a transport of whole messages (MPI point-to-point under
//! mpirun; channels in the tests), so this module knows nothing of MPI.

mod front;
mod metrics_wire;
mod replica;
#[cfg(test)]
mod tests;
pub mod wire;

pub use front::{start_front, FrontRelay, RemoteReplica};
pub use replica::relay_requests;

use std::time::Duration;

/// Whole messages to and from peers, numbered from 0 (the front).
pub trait Link: Send {
    /// Sends `message` to peer `to`.
    fn send(&mut self, to: usize, message: &[u8]) -> Result<(), LinkError>;
    /// A message that has arrived and its sender, if any; does not wait.
    fn try_receive(&mut self) -> Result<Option<(usize, Vec<u8>)>, LinkError>;
}

/// How long a relay waits for its own side's news before it looks at the link again: the
/// most a message from the other side waits on top of its transport.
const POLL: Duration = Duration::from_millis(1);

/// What can go wrong between the front and a replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    #[error("{what} is not one tpc sends ({problem}); start every process with the same tpc")]
    Corrupt { what: &'static str, problem: String },
    #[error("replica {replica} serves {theirs:?}, the front {ours:?}; start every process with the same model and options")]
    OtherModel {
        replica: usize,
        theirs: String,
        ours: String,
    },
    #[error("the link to the other replicas failed: {0}")]
    Transport(String),
    #[error(
        "a message came from peer {from}, which is not a replica of this server (a bug in tpc)"
    )]
    Stranger { from: usize },
}
