//! Replicas in separate processes that deal their experts over each other (`mpirun … tpc
//! serve --dp D --ep`) cannot see each other's forward calls the way threads sharing one
//! exchange do. Their leading ranks keep in step instead: before every forward call a busy
//! replica ticks, and an idle one ticks to learn whether it must answer one. A tick is a
//! collective over every replica's leading rank, so each tick is one of two things for all
//! of them alike: a forward call (every replica runs its batch or answers the others'), or
//! nothing (nobody is busy). Once every replica is done, a tick says so and all stop.

use crate::runtime::error::Result;

/// What a tick told every replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    /// Some replica runs a forward call now: every other answers it.
    pub any_busy: bool,
    /// Every replica is done (drained or closed, with nothing left to run).
    pub all_done: bool,
}

/// The replicas' leading ranks ticking together.
pub trait ReplicaTicks: Send {
    /// One tick with every other replica's leading rank: `busy`, this one runs a forward
    /// call next; `done`, it will run none again.
    fn tick(&mut self, busy: bool, done: bool) -> Result<Tick>;
}
