//! The group barrier: spin briefly, then park; a failed rank releases everybody.
//!
//! All of the barrier's state is one `AtomicU64` (generation, arrivals, the first failure and
//! the verdict of the last completed generation), so an arrival, a completion and a failure
//! are totally ordered and every rank leaving a generation reads the same verdict.
//!
//! # Two kinds of wait
//!
//! * [`Phase::Entry`] — the first wait of a collective, after a rank has published its
//!   buffers. Before it completes no rank reads anybody's memory, so once a failure is
//!   recorded a waiter leaves at once with the failure (a rank that died outside a
//!   collective will never arrive). A failure recorded before the generation completes
//!   makes its verdict "failed", so no rank starts reading peers' memory after it.
//! * [`Phase::Inner`] — every later wait of a collective. The previous generation completed
//!   cleanly, so every rank is inside the same collective and may be reading this rank's
//!   memory: a waiter always waits for the generation to complete (all ranks arrive; none
//!   can leave the group while inside a collective, a rank that panics inside one arrives
//!   from its unwind guard first) and then returns the verdict.
//!
//! # Cost
//!
//! Measured on this machine (2 vCPU AMD EPYC Zen 3 under KVM, `--release`) with
//! `bench::bench_barrier`: every rank waits back to back, the time of a wait is the slowest
//! rank's, median of 20 000 waits; ranges are over five runs on an otherwise idle machine.
//!
//! | ranks (threads on 2 cores) | this barrier         | `std::sync::Barrier` |
//! |----------------------------|----------------------|----------------------|
//! | 2                          | 0.15 µs (0.15–0.40)  | 17–73 µs             |
//! | 4 (oversubscribed)         | 4.4–8.4 µs           | 49–61 µs             |
//! | 8 (oversubscribed)         | 9–14 µs              | 64–100 µs            |
//!
//! `std::sync::Barrier` parks every waiter on a mutex and condition variable, so each wait
//! costs a futex wake-up. Ranks that wait long do not burn their core here either: 2 or 8
//! ranks blocked for 1 s on one late rank used 0.00 s of CPU (10 ms resolution) in all.

use super::FailureCause;
use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Largest group the state word can describe (arrival count and failed rank are 12 bits).
pub const MAX_WORLD: usize = 1024;

/// Back-off when every rank has its own core: spin 150 µs, long enough to cover the skew of
/// balanced ranks, then give the core away. (It was 1024 rounds, ~30 µs on the Zen 3 host
/// but ~9 µs on the Xeon, where a tp=2 decode step then parked and woke ranks on its
/// all-reduces: TinyLlama at 512 cached keys, --profile's all-reduce 3.5 → 1.2-1.5 ms per
/// step; 500 µs did no better.)
pub(super) const DEDICATED: Backoff = Backoff {
    spin: Duration::from_micros(150),
    yields: 4,
};

/// Back-off when there are more ranks than cores: a spinning rank only delays the rank it
/// waits for, so spin a little, yield a few times (letting runnable ranks run without a
/// futex round trip), then park. Median wait measured for (spin rounds, yields) on the
/// Zen 3 host, µs. Now 150 ns, about 16 rounds on the Xeon (`bench-comm` barrier there, 3
/// runs: 4 ranks 2.07-2.18 µs against 2.26-2.72 with 16 rounds, 8 ranks 4.5-6.1 against
/// 4.6-5.0; 500 ns measured 0.6 µs slower at 4 ranks):
///
/// | ranks | (0, 0) | (16, 0) | (16, 1) | (16, 4) | (0, 16) | (64, 4) |
/// |-------|--------|---------|---------|---------|---------|---------|
/// | 4     | 59     | 55      | 5.2     | 5.7     | 5.4     | 9.6     |
/// | 8     | 65     | 88      | 16      | 14      | 15      | 18      |
pub(super) const OVERSUBSCRIBED: Backoff = Backoff {
    spin: Duration::from_nanos(150),
    yields: 4,
};

/// The first failure recorded in a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Failure {
    pub rank: usize,
    pub cause: FailureCause,
}

/// Which wait of a collective this is; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Entry,
    Inner,
}

/// How a waiting rank backs off: it polls with `spin_loop` for `spin` (a time, since a
/// `spin_loop` round is ~30 ns on the Zen 3 host and ~8.5 ns on the Xeon), then `yields`
/// times with `thread::yield_now`, then it parks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub spin: Duration,
    pub yields: u32,
}

impl Backoff {
    /// `poll()` until it returns `Some`, spinning then yielding; `None` once both are spent
    /// (the caller then parks).
    pub(super) fn poll<T>(&self, mut poll: impl FnMut() -> Option<T>) -> Option<T> {
        let started = Instant::now();
        for round in 1u32.. {
            if let Some(t) = poll() {
                return Some(t);
            }
            // The clock only every 8 rounds: reading it costs about a round.
            if self.spin.is_zero() || (round % 8 == 0 && started.elapsed() >= self.spin) {
                break;
            }
            spin_loop();
        }
        for _ in 0..self.yields {
            if let Some(t) = poll() {
                return Some(t);
            }
            std::thread::yield_now();
        }
        None
    }
}

/// One value on its own cache lines (adjacent-line prefetch pairs lines, hence 128).
#[repr(align(128))]
pub(super) struct CachePadded<T>(pub T);

/// Bit layout of the state word.
const ARRIVED_MASK: u64 = 0xfff;
const FAILED_SHIFT: u32 = 12; // failed rank + 1, 0 = no failure
const FAILED_MASK: u64 = 0xfff << FAILED_SHIFT;
const CAUSE_SHIFT: u32 = 24; // 2 bits
const CAUSE_MASK: u64 = 0b11 << CAUSE_SHIFT;
const VERDICT_FAILED: u64 = 1 << 26; // the last completed generation saw a failure
const GEN_SHIFT: u32 = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct State(u64);

impl State {
    fn arrived(self) -> u64 {
        self.0 & ARRIVED_MASK
    }

    fn generation(self) -> u32 {
        (self.0 >> GEN_SHIFT) as u32
    }

    fn failure(self) -> Option<Failure> {
        let failed = (self.0 & FAILED_MASK) >> FAILED_SHIFT;
        if failed == 0 {
            return None;
        }
        let cause = match (self.0 & CAUSE_MASK) >> CAUSE_SHIFT {
            0 => FailureCause::Panicked,
            1 => FailureCause::Aborted,
            _ => FailureCause::Dropped,
        };
        Some(Failure {
            rank: (failed - 1) as usize,
            cause,
        })
    }

    fn with_failure(self, f: Failure) -> State {
        let cause = match f.cause {
            FailureCause::Panicked => 0,
            FailureCause::Aborted => 1,
            FailureCause::Dropped => 2,
        };
        State(self.0 | ((f.rank as u64 + 1) << FAILED_SHIFT) | (cause << CAUSE_SHIFT))
    }

    fn plus_arrival(self) -> State {
        State(self.0 + 1)
    }

    /// The next generation: no arrivals, verdict = whether a failure is recorded now.
    fn completed(self) -> State {
        let gen = u64::from(self.generation().wrapping_add(1)) << GEN_SHIFT;
        let keep = self.0 & (FAILED_MASK | CAUSE_MASK);
        let verdict = if self.failure().is_some() {
            VERDICT_FAILED
        } else {
            0
        };
        State(gen | keep | verdict)
    }

    /// The verdict of the last completed generation.
    fn verdict(self) -> Result<(), Failure> {
        match self.failure() {
            Some(f) if self.0 & VERDICT_FAILED != 0 => Err(f),
            _ => Ok(()),
        }
    }
}

/// A reusable barrier for a fixed group of ranks, with failure propagation.
pub(super) struct GroupBarrier {
    state: CachePadded<AtomicU64>,
    sleepers: CachePadded<AtomicUsize>,
    n: u64,
    backoff: Backoff,
    lock: Mutex<()>,
    cv: Condvar,
}

impl GroupBarrier {
    /// A barrier for `n` ranks (1..=[`MAX_WORLD`]).
    pub(super) fn new(n: usize, backoff: Backoff) -> Self {
        assert!(
            (1..=MAX_WORLD).contains(&n),
            "a group has 1..={MAX_WORLD} ranks, got {n}"
        );
        GroupBarrier {
            state: CachePadded(AtomicU64::new(0)),
            sleepers: CachePadded(AtomicUsize::new(0)),
            n: n as u64,
            backoff,
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    fn load(&self) -> State {
        State(self.state.0.load(SeqCst))
    }

    /// Arrive and wait for the other ranks. `Err` carries the group's first failure: for
    /// [`Phase::Entry`] as soon as one is recorded, for [`Phase::Inner`] once every rank has
    /// arrived, if one was recorded before that.
    ///
    /// Memory effects: everything a rank did before arriving happens-before everything any
    /// rank does after this generation completes (arrivals and the completion are SeqCst
    /// read-modify-writes of one word, and waiters leave after a SeqCst load of it).
    pub(super) fn wait(&self, phase: Phase) -> Result<(), Failure> {
        let mut s = self.load();
        let gen = loop {
            if phase == Phase::Entry {
                if let Some(f) = s.failure() {
                    return Err(f);
                }
            }
            let last = s.arrived() + 1 == self.n;
            let next = if last {
                s.completed()
            } else {
                s.plus_arrival()
            };
            match self
                .state
                .0
                .compare_exchange_weak(s.0, next.0, SeqCst, SeqCst)
            {
                Ok(_) if last => {
                    self.wake();
                    return next.verdict();
                }
                Ok(_) => break s.generation(),
                Err(now) => s = State(now),
            }
        };
        self.block_until(|s| {
            if s.generation() != gen {
                Some(s.verdict())
            } else if phase == Phase::Entry {
                s.failure().map(Err)
            } else {
                None
            }
        })
    }

    /// Record that `rank` failed (the first failure is kept) and wake every waiter.
    /// Returns the failure the group keeps.
    pub(super) fn fail(&self, rank: usize, cause: FailureCause) -> Failure {
        let mine = Failure { rank, cause };
        let mut s = self.load();
        let kept = loop {
            if let Some(f) = s.failure() {
                break f;
            }
            match self
                .state
                .0
                .compare_exchange_weak(s.0, s.with_failure(mine).0, SeqCst, SeqCst)
            {
                Ok(_) => break mine,
                Err(now) => s = State(now),
            }
        };
        self.wake();
        kept
    }

    /// The group's first failure, if any.
    pub(super) fn failure(&self) -> Option<Failure> {
        self.load().failure()
    }

    /// Spin, then park on the condition variable, until `decide` returns `Some`.
    fn block_until<T>(&self, mut decide: impl FnMut(State) -> Option<T>) -> T {
        if let Some(t) = self.backoff.poll(|| decide(self.load())) {
            return t;
        }
        let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        // Dekker pair with `wake`: we announce ourselves, then look at the state; a waker
        // changes the state, then looks for sleepers. With SeqCst on all four accesses at
        // least one side sees the other, and the waker notifies under the lock we hold
        // until `wait` releases it, so the notification cannot be lost.
        self.sleepers.0.fetch_add(1, SeqCst);
        let t = loop {
            if let Some(t) = decide(self.load()) {
                break t;
            }
            guard = self.cv.wait(guard).unwrap_or_else(PoisonError::into_inner);
        };
        self.sleepers.0.fetch_sub(1, SeqCst);
        drop(guard);
        t
    }

    fn wake(&self) {
        if self.sleepers.0.load(SeqCst) != 0 {
            drop(self.lock.lock().unwrap_or_else(PoisonError::into_inner));
            self.cv.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn state_word_round_trips() {
        let s = State(0);
        assert_eq!(s.failure(), None);
        assert_eq!(s.verdict(), Ok(()));
        for cause in [
            FailureCause::Panicked,
            FailureCause::Aborted,
            FailureCause::Dropped,
        ] {
            let f = Failure {
                rank: MAX_WORLD - 1,
                cause,
            };
            let s = State(0).plus_arrival().with_failure(f);
            assert_eq!(s.failure(), Some(f));
            assert_eq!(s.arrived(), 1);
            // Failure recorded after a clean completion does not change that verdict.
            assert_eq!(s.verdict(), Ok(()));
            let done = s.completed();
            assert_eq!(done.generation(), 1);
            assert_eq!(done.arrived(), 0);
            assert_eq!(done.verdict(), Err(f));
        }
        let wrap = State(u64::from(u32::MAX) << GEN_SHIFT).completed();
        assert_eq!(wrap.generation(), 0);
    }

    /// Writes before a wait are visible after it, for many rounds, with spinning and with
    /// immediate parking (spin 0), including more ranks than cores.
    #[test]
    fn orders_memory_between_rounds() {
        let park_at_once = Backoff {
            spin: Duration::ZERO,
            yields: 0,
        };
        for (n, backoff) in [
            (1, DEDICATED),
            (2, DEDICATED),
            (3, park_at_once),
            (5, OVERSUBSCRIBED),
            (8, park_at_once),
        ] {
            let b = Arc::new(GroupBarrier::new(n, backoff));
            let counter = Arc::new(AtomicUsize::new(0));
            let rounds = 300;
            let handles: Vec<_> = (0..n)
                .map(|_| {
                    let (b, counter) = (b.clone(), counter.clone());
                    thread::spawn(move || {
                        for round in 1..=rounds {
                            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            b.wait(Phase::Inner).unwrap();
                            let seen = counter.load(std::sync::atomic::Ordering::Relaxed);
                            assert!(seen >= round * n, "round {round}: saw {seen}");
                            b.wait(Phase::Inner).unwrap();
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        }
    }

    #[test]
    fn failure_releases_entry_waiters_and_first_failure_is_kept() {
        let b = Arc::new(GroupBarrier::new(
            3,
            Backoff {
                spin: Duration::ZERO,
                yields: 0,
            },
        ));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.wait(Phase::Entry))
            })
            .collect();
        // Rank 2 never arrives; it leaves the group instead.
        while b.sleepers.0.load(SeqCst) < 2 {
            thread::yield_now();
        }
        let kept = b.fail(2, FailureCause::Dropped);
        assert_eq!(kept.rank, 2);
        assert_eq!(b.fail(0, FailureCause::Aborted), kept);
        for w in waiters {
            assert_eq!(w.join().unwrap(), Err(kept));
        }
        assert_eq!(b.failure(), Some(kept));
        assert_eq!(b.wait(Phase::Entry), Err(kept));
    }

    /// An inner wait ignores a failure until every rank has arrived, then all see it.
    #[test]
    fn inner_wait_completes_before_reporting() {
        let b = Arc::new(GroupBarrier::new(
            2,
            Backoff {
                spin: Duration::ZERO,
                yields: 0,
            },
        ));
        let f = b.fail(1, FailureCause::Panicked);
        let b2 = b.clone();
        let waiter = thread::spawn(move || b2.wait(Phase::Inner));
        while b.sleepers.0.load(SeqCst) < 1 {
            thread::yield_now();
        }
        assert!(!waiter.is_finished());
        assert_eq!(b.wait(Phase::Inner), Err(f));
        assert_eq!(waiter.join().unwrap(), Err(f));
    }
}
