//! The in-process group: every rank is a thread, collectives read peers' memory directly.
//!
//! # Protocol of one collective call
//!
//! 1. *Publish.* The rank writes what it is about to do (collective, algorithm, length,
//!    whether its own arguments were consistent) and a pointer to the memory peers should
//!    read into its slot. Slots and one-shot staging buffers are double-buffered by the
//!    parity of the call number, which is the same on every rank.
//! 2. *Entry wait* ([`Phase::Entry`]). After it, every rank checks every slot; if anything
//!    disagrees all ranks see the same slots and all return an error, so the group stays in
//!    step. A recorded failure releases this wait at once.
//! 3. *Data phases*, separated by *inner waits* ([`Phase::Inner`]): each rank reads only
//!    memory that peers published for this call and that no rank writes in the same phase,
//!    and writes only its own memory. The last inner wait guarantees no peer still reads a
//!    rank's buffer when that rank returns. The one-shot all-reduce reads only staging
//!    buffers owned by the group, so it needs no wait after its data phase; the two-shot
//!    reads peers' buffers in its first phase and only staging buffers in its second, so it
//!    needs one inner wait, between the two.
//!
//! Why a slot or staging buffer of parity `p` is never written while a peer reads it: a peer
//! reads it between the entry wait of call `k` and its own arrival at the entry wait of call
//! `k + 1`; the owner writes it again in call `k + 2`, which it starts only after the entry
//! wait of call `k + 1` completed cleanly — if that wait failed, the group has a recorded
//! failure and every later call returns before publishing anything.
//!
//! A call publishes its element type, so a peer's pointer is read as the type it was
//! published with. Point-to-point messages do not take part in this protocol: they are
//! copied into group-owned buffers ([`super::mailbox`]).

use super::barrier::{
    Backoff, CachePadded, Failure, GroupBarrier, Phase, DEDICATED, MAX_WORLD, OVERSUBSCRIBED,
};
use super::mailbox::{Mailbox, Spares};
use super::private::PerType;
use super::reduce::{
    accumulate_into_own, add_round, chunk_range, copy, sum_peers_into_own, summation_order,
    widen_add,
};
use super::{check_counts, Collective, CommError, Communicator, Element, FailureCause};
use crate::ir::{CollectiveAlgorithm, DType};
use std::fmt;
use std::ops::Range;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

/// With every rank on its own core, all-reduces of at most this many bytes use the one-shot
/// algorithm, larger ones the ring (the same byte threshold for every element type).
///
/// The ring makes `2n − 1` waits, the one-shot 1, but the one-shot copies the whole buffer
/// into its staging buffer first and reads `n × len` elements where the ring reads about
/// `2 len`. With 2 ranks on this machine (2 vCPU AMD EPYC Zen 3 under KVM) a wait costs
/// 0.15 µs, so the one-shot wins only below 2 KiB; they tie at 2 KiB.
/// `bench::bench_all_reduce`, tp = 2, median µs of 2000 calls (three runs agreed within
/// 0.05 µs):
///
/// | bytes    | 64   | 256  | 1 Ki | 2 Ki | 4 Ki | 8 Ki | 16 Ki | 32 Ki |
/// |----------|------|------|------|------|------|------|-------|-------|
/// | one-shot | 0.32 | 0.39 | 0.52 | 0.75 | 1.20 | 1.63 | 2.69  | 5.09  |
/// | ring     | 0.42 | 0.53 | 0.61 | 0.73 | 0.98 | 1.50 | 2.33  | 3.53  |
pub const ONE_SHOT_MAX_BYTES: usize = 2 * 1024;

/// [`ONE_SHOT_MAX_BYTES`] for a group with more ranks than cores, where a wait costs a
/// context switch (5–15 µs here) and the ring's `2(n − 1)` waits dominate. Same benchmark,
/// 400 calls, two runs (they vary by up to 2×; the crossover stayed between 32 and 64 KiB):
///
/// | bytes           | 4 Ki    | 8 Ki    | 16 Ki   | 32 Ki   | 48 Ki   | 64 Ki   | 128 Ki  |
/// |-----------------|---------|---------|---------|---------|---------|---------|---------|
/// | tp=4 one-shot   | 10–15   | 10–20   | 15–32   | 28–58   | 34–82   | 43–51   | 76–91   |
/// | tp=4 ring       | 22–36   | 26–39   | 27–40   | 30–48   | 33–57   | 35–43   | 47–58   |
/// | tp=8 one-shot   | 24–26   | 33–37   | 52–59   | 87–106  | 121–132 | 147–178 | 285–420 |
/// | tp=8 ring       | 138–159 | 124–158 | 162–163 | 180–203 | 157–160 | 154–180 | 178–343 |
pub const ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED: usize = 32 * 1024;

/// Which all-reduce algorithm to run; see [`LocalComm::all_reduce_sum_with`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllReduceAlgorithm {
    /// One-shot up to [`ONE_SHOT_MAX_BYTES`] (or [`ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED`] when the
    /// group has more ranks than cores), ring above.
    Auto,
    /// Every rank copies its buffer to a group-owned staging buffer, one wait, then every
    /// rank sums all staging buffers itself: 1 wait, `n × len` reads per rank.
    OneShot,
    /// Reduce-scatter then all-gather, each one phase over the one-shot's direct reads: rank
    /// `r` sums its chunk `r` from every rank's buffer into its own buffer and a copy into
    /// its group-owned staging buffer, one wait, then every rank copies each other rank's
    /// summed chunk from that rank's staging buffer: 2 waits, about `2 len` reads per rank.
    TwoShot,
    /// Ring reduce-scatter then ring all-gather over `n` chunks, in place in the ranks'
    /// buffers: `2(n − 1)` steps, each reading one chunk from the previous rank.
    Ring,
}

impl fmt::Display for AllReduceAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AllReduceAlgorithm::Auto => "auto",
            AllReduceAlgorithm::OneShot => "one-shot",
            AllReduceAlgorithm::TwoShot => "two-shot",
            AllReduceAlgorithm::Ring => "ring",
        })
    }
}

impl AllReduceAlgorithm {
    /// What this group runs for a plan's choice: the algorithm planned; no choice: by size.
    pub(super) fn planned(choice: Option<CollectiveAlgorithm>) -> AllReduceAlgorithm {
        match choice {
            None => AllReduceAlgorithm::Auto,
            Some(CollectiveAlgorithm::OneShot) => AllReduceAlgorithm::OneShot,
            Some(CollectiveAlgorithm::TwoShot) => AllReduceAlgorithm::TwoShot,
            Some(CollectiveAlgorithm::Ring) => AllReduceAlgorithm::Ring,
        }
    }

    /// The plan's name for what ran (`Auto` is resolved before anything runs; it reads as
    /// the ring, its choice for large messages).
    fn as_planned(self) -> CollectiveAlgorithm {
        match self {
            AllReduceAlgorithm::OneShot => CollectiveAlgorithm::OneShot,
            AllReduceAlgorithm::TwoShot => CollectiveAlgorithm::TwoShot,
            AllReduceAlgorithm::Auto | AllReduceAlgorithm::Ring => CollectiveAlgorithm::Ring,
        }
    }

    /// The algorithm `self` means for `len` elements of `T` in a group with this threshold.
    pub(super) fn resolve<T: Element>(
        self,
        len: usize,
        one_shot_max_bytes: usize,
    ) -> AllReduceAlgorithm {
        match self {
            AllReduceAlgorithm::Auto
                if len.saturating_mul(size_of::<T>()) <= one_shot_max_bytes =>
            {
                AllReduceAlgorithm::OneShot
            }
            AllReduceAlgorithm::Auto => AllReduceAlgorithm::Ring,
            forced => forced,
        }
    }
}

/// A row length and what to call on each row of a sum.
type EachRow<'a, T> = (usize, &'a mut dyn FnMut(usize, &[T]));

/// One rank's communicator in an in-process group; move it into the rank's thread.
///
/// Dropping it leaves the group: ranks that still call collectives get
/// [`CommError::PeerFailed`]. Leaking it (`mem::forget`) while peers wait for it hangs them,
/// like any rank that never arrives.
pub struct LocalComm {
    rank: usize,
    n: usize,
    shared: Arc<Shared>,
    /// Number of collective calls this rank has started; its parity selects the slot and
    /// staging buffer, and it is the same on every rank.
    calls: u64,
    aborted: bool,
    /// Where a ring all-reduce of a type narrower than `f32` carries its `f32` partial sums.
    workspace: Vec<f32>,
    /// Test hook: panic inside the given ring step, after touching the data.
    #[cfg(test)]
    pub(super) panic_in_ring_step: Option<usize>,
    /// Test hook: panic in the two-shot's reduce-scatter phase, after reading peers' data.
    #[cfg(test)]
    pub(super) panic_in_two_shot_reduce: bool,
}

/// What the ranks of one group share.
struct Shared {
    barrier: GroupBarrier,
    /// Where `Auto` switches from one-shot to ring.
    one_shot_max_bytes: usize,
    /// `rank * 2 + parity`.
    slots: Box<[Slot]>,
    /// `rank * 2 + parity`: where a rank copies its buffer for a one-shot all-reduce, or
    /// sums its chunk in a two-shot one, one buffer per element type. Owned by the group so
    /// it outlives any rank that leaves while peers still read it. Only its rank locks it (to
    /// resize and fill it); peers read it through the pointer published in the slot, under
    /// the protocol described in the module documentation.
    staging: Box<[CachePadded<Mutex<PerType>>]>,
    /// Per receiving rank: its point-to-point messages.
    mailboxes: Box<[CachePadded<Mailbox>]>,
    /// Per sending rank: emptied message buffers to reuse.
    spares: Box<[CachePadded<Spares>]>,
}

impl Shared {
    /// Records that `rank` failed and wakes everybody who waits: in a collective's waits
    /// and in `recv`.
    fn fail(&self, rank: usize, cause: FailureCause) {
        self.barrier.fail(rank, cause);
        for mailbox in self.mailboxes.iter() {
            mailbox.0.wake();
        }
    }
}

/// What one rank publishes for one call.
#[repr(align(128))]
#[derive(Default)]
struct Slot {
    code: AtomicU32,
    len: AtomicUsize,
    root: AtomicUsize,
    /// The rank's data for this call, elements of the published type.
    ptr: AtomicPtr<()>,
    /// What the all-reduce's algorithm publishes besides `ptr`: the ring, where the rank
    /// keeps its `f32` partial sums (`ptr` itself for `f32`); the two-shot, its summed chunk
    /// (elements of the published type, in its staging buffer).
    aux: AtomicPtr<()>,
}

/// The call a rank publishes, encoded into `Slot::code` (and `len`, `root`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Call {
    during: Collective,
    algorithm: Option<AllReduceAlgorithm>,
    /// `None` for the barrier, which moves no data.
    dtype: Option<DType>,
    /// Broadcast only; 0 otherwise.
    root: usize,
    len: usize,
}

const BAD_ARGUMENTS: u32 = 1 << 8;

impl Call {
    /// A call that moves `len` elements of `T`.
    fn of<T: Element>(during: Collective, len: usize) -> Call {
        Call {
            during,
            algorithm: None,
            dtype: Some(T::DTYPE),
            root: 0,
            len,
        }
    }

    fn code(self) -> u32 {
        let during = match self.during {
            Collective::AllReduceSum => 0,
            Collective::AllGather => 1,
            Collective::ReduceScatterSum => 2,
            Collective::Barrier => 3,
            Collective::Broadcast => 4,
            // Point to point: never published (kept distinct all the same).
            Collective::Send => 5,
            Collective::Recv => 6,
            Collective::AllGatherCounts => 7,
            Collective::ReduceScatterSumCounts => 8,
        };
        let algorithm = match self.algorithm {
            None | Some(AllReduceAlgorithm::Auto) => 0,
            Some(AllReduceAlgorithm::OneShot) => 1,
            Some(AllReduceAlgorithm::Ring) => 2,
            Some(AllReduceAlgorithm::TwoShot) => 3,
        };
        let dtype = match self.dtype {
            None => 0,
            Some(DType::F32) => 1,
            Some(DType::F16) => 2,
            Some(DType::Bf16) => 3,
            Some(DType::I64) => 4,
        };
        during | algorithm << 4 | dtype << 12
    }

    fn decode(code: u32, len: usize, root: usize) -> Call {
        let during = match code & 0xf {
            0 => Collective::AllReduceSum,
            1 => Collective::AllGather,
            2 => Collective::ReduceScatterSum,
            3 => Collective::Barrier,
            4 => Collective::Broadcast,
            5 => Collective::Send,
            6 => Collective::Recv,
            7 => Collective::AllGatherCounts,
            _ => Collective::ReduceScatterSumCounts,
        };
        let algorithm = match (code >> 4) & 0xf {
            0 => None,
            1 => Some(AllReduceAlgorithm::OneShot),
            2 => Some(AllReduceAlgorithm::Ring),
            _ => Some(AllReduceAlgorithm::TwoShot),
        };
        let dtype = match (code >> 12) & 0xf {
            0 => None,
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::Bf16),
            _ => Some(DType::I64),
        };
        Call {
            during,
            algorithm,
            dtype,
            root,
            len,
        }
    }
}

/// One communicator per rank (`0..world_size`, in order) of a new in-process group.
///
/// When `world_size` does not exceed the available cores, waiting ranks spin briefly before
/// parking and small all-reduces go one-shot up to [`ONE_SHOT_MAX_BYTES`]; with more ranks
/// than cores they park almost at once and the one-shot goes up to
/// [`ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED`].
///
/// # Panics
///
/// If `world_size` is 0 or above 1024.
pub fn local_group(world_size: usize) -> Vec<LocalComm> {
    group_with(world_size, Tuning::for_world(world_size))
}

/// The machine-dependent choices of a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tuning {
    pub backoff: Backoff,
    pub one_shot_max_bytes: usize,
}

impl Tuning {
    /// What [`local_group`] chooses for `world_size` ranks on this machine.
    pub(super) fn for_world(world_size: usize) -> Tuning {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        if world_size <= cores {
            Tuning {
                backoff: DEDICATED,
                one_shot_max_bytes: ONE_SHOT_MAX_BYTES,
            }
        } else {
            Tuning {
                backoff: OVERSUBSCRIBED,
                one_shot_max_bytes: ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED,
            }
        }
    }
}

/// [`local_group`] with explicit tuning (benchmarks).
pub(super) fn group_with(world_size: usize, tuning: Tuning) -> Vec<LocalComm> {
    assert!(
        (1..=MAX_WORLD).contains(&world_size),
        "a local group has 1..={MAX_WORLD} ranks, got {world_size}"
    );
    let shared = Arc::new(Shared {
        barrier: GroupBarrier::new(world_size, tuning.backoff),
        one_shot_max_bytes: tuning.one_shot_max_bytes,
        slots: (0..2 * world_size).map(|_| Slot::default()).collect(),
        staging: (0..2 * world_size)
            .map(|_| CachePadded(Mutex::default()))
            .collect(),
        mailboxes: (0..world_size)
            .map(|_| CachePadded(Mailbox::new(tuning.backoff)))
            .collect(),
        spares: (0..world_size)
            .map(|_| CachePadded(Spares::default()))
            .collect(),
    });
    (0..world_size)
        .map(|rank| LocalComm {
            rank,
            n: world_size,
            shared: shared.clone(),
            calls: 0,
            aborted: false,
            workspace: Vec::new(),
            #[cfg(test)]
            panic_in_ring_step: None,
            #[cfg(test)]
            panic_in_two_shot_reduce: false,
        })
        .collect()
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("rank", &self.rank)
            .field("world_size", &self.n)
            .field("calls", &self.calls)
            .field("aborted", &self.aborted)
            .finish_non_exhaustive()
    }
}

/// On unwinding out of a data phase, records the panic and still makes the inner wait the
/// peers are heading for, so no peer reads this rank's buffers after they are freed.
struct UnwindGuard<'a> {
    shared: &'a Shared,
    rank: usize,
    was_panicking: bool,
}

impl<'a> UnwindGuard<'a> {
    fn new(shared: &'a Shared, rank: usize) -> Self {
        UnwindGuard {
            shared,
            rank,
            was_panicking: std::thread::panicking(),
        }
    }
}

impl Drop for UnwindGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.was_panicking {
            self.shared.fail(self.rank, FailureCause::Panicked);
            // Every peer is inside this collective and arrives; the verdict is "failed".
            let _ = self.shared.barrier.wait(Phase::Inner);
        }
    }
}

impl LocalComm {
    /// The largest all-reduce, in bytes, that `Auto` runs one-shot in this group.
    pub fn one_shot_max_bytes(&self) -> usize {
        self.shared.one_shot_max_bytes
    }

    /// [`Communicator::all_reduce_sum`] with a chosen algorithm. Every rank must choose the
    /// same one (after `Auto` is resolved by size in bytes), or all get
    /// [`CommError::AlgorithmMismatch`]. The result is bit-identical for every algorithm.
    pub fn all_reduce_sum_with<T: Element>(
        &mut self,
        buf: &mut [T],
        algorithm: AllReduceAlgorithm,
    ) -> Result<(), CommError> {
        self.all_reduce_sum_then(buf, algorithm, None)
    }

    /// [`LocalComm::all_reduce_sum_with`], then `rows` (a row length and what to call on
    /// each row of the sum): one-shot calls it on each row as soon as that row is summed;
    /// the two-shot and the ring, after their last phase.
    fn all_reduce_sum_then<T: Element>(
        &mut self,
        buf: &mut [T],
        algorithm: AllReduceAlgorithm,
        rows: Option<EachRow<'_, T>>,
    ) -> Result<(), CommError> {
        let each_row = |buf: &[T], rows: Option<EachRow<'_, T>>| {
            if let Some((len, row)) = rows {
                for (r, x) in buf.chunks(len.max(1)).enumerate() {
                    row(r, x);
                }
            }
        };
        let during = Collective::AllReduceSum;
        let len = buf.len();
        let algorithm = algorithm.resolve::<T>(len, self.shared.one_shot_max_bytes);
        let call = Call {
            algorithm: Some(algorithm),
            ..Call::of::<T>(during, len)
        };
        self.check_usable(during)?;
        if self.n == 1 || len == 0 {
            self.begin(call, ptr::null(), ptr::null_mut(), None)?;
            each_row(buf, rows);
            return Ok(());
        }
        if algorithm == AllReduceAlgorithm::OneShot {
            let staged = self.stage(buf);
            let parity = self.begin(call, staged.cast(), ptr::null_mut(), None)?;
            match rows {
                Some((row_len, row)) if row_len > 0 => {
                    self.one_shot_rows(buf, parity, row_len, row)
                }
                _ => self.one_shot(buf, parity),
            }
            return Ok(());
        }
        if algorithm == AllReduceAlgorithm::TwoShot {
            // Until `two_shot` returns, this rank touches `buf` only through `own`, the
            // pointer its peers read too (a reference passed on would assert, on entry, that
            // nobody else reads it).
            let own = buf.as_mut_ptr();
            let reduced = self.reduce_target::<T>(chunk_range(len, self.n, self.rank).len());
            let parity = self.begin(call, own.cast_const().cast(), reduced.cast(), None)?;
            self.two_shot(own, len, reduced, parity)?;
            each_row(buf, rows);
            return Ok(());
        }
        // From here until `ring` returns, this rank touches `buf` only through `own` and
        // `acc`, the pointers its peers use too. `f32` partial sums travel in `buf` itself
        // (`acc` is `own`), narrower types' in the workspace, widened. The workspace is
        // taken out of `self` so that `ring` borrows `self` without covering it. With two
        // ranks the only reduce-scatter step is the last, which rounds straight into `buf`:
        // no partial sum is stored, and the workspace is neither grown nor read.
        let mut workspace = std::mem::take(&mut self.workspace);
        let in_place = T::as_f32_mut(buf).map(|b| b.as_mut_ptr());
        let (own, acc) = match in_place {
            Some(acc) => (acc.cast::<T>(), acc),
            None => {
                if self.n > 2 {
                    workspace.resize(len, 0.0);
                }
                (buf.as_mut_ptr(), workspace.as_mut_ptr())
            }
        };
        let result = self
            .begin(call, own.cast_const().cast(), acc.cast(), None)
            .and_then(|parity| self.ring(own, acc, in_place.is_some(), len, parity));
        self.workspace = workspace;
        result?;
        each_row(buf, rows);
        Ok(())
    }

    /// [`LocalComm::all_reduce_sum_then`] with a plan's choice ([`AllReduceAlgorithm::planned`]);
    /// returns what ran.
    fn all_reduce_sum_planned_then<T: Element>(
        &mut self,
        buf: &mut [T],
        algorithm: Option<CollectiveAlgorithm>,
        rows: Option<EachRow<'_, T>>,
    ) -> Result<Option<CollectiveAlgorithm>, CommError> {
        let runs = AllReduceAlgorithm::planned(algorithm)
            .resolve::<T>(buf.len(), self.shared.one_shot_max_bytes);
        self.all_reduce_sum_then(buf, runs, rows)?;
        Ok(Some(runs.as_planned()))
    }

    fn parity(&self) -> usize {
        (self.calls & 1) as usize
    }

    fn slot(&self, rank: usize, parity: usize) -> &Slot {
        &self.shared.slots[rank * 2 + parity]
    }

    fn peer_failed(&self, f: Failure, during: Collective) -> CommError {
        CommError::PeerFailed {
            rank: self.rank,
            peer: f.rank,
            cause: f.cause,
            during,
        }
    }

    /// Refuses calls on an aborted communicator or a failed group, before anything is
    /// published (see the module documentation for why this matters).
    fn check_usable(&self, during: Collective) -> Result<(), CommError> {
        if self.aborted {
            return Err(CommError::Aborted {
                rank: self.rank,
                during,
            });
        }
        match self.shared.barrier.failure() {
            Some(f) => Err(self.peer_failed(f, during)),
            None => Ok(()),
        }
    }

    /// Refuses a point-to-point partner that is this rank or outside the group.
    fn check_peer(&self, peer: usize, during: Collective) -> Result<(), CommError> {
        if peer < self.n && peer != self.rank {
            return Ok(());
        }
        Err(CommError::BadRank {
            rank: self.rank,
            during,
            peer,
            world_size: self.n,
            what: "the peer must be another rank of the group",
        })
    }

    fn wait(&self, phase: Phase, during: Collective) -> Result<(), CommError> {
        self.shared
            .barrier
            .wait(phase)
            .map_err(|f| self.peer_failed(f, during))
    }

    /// Copies `buf` into this rank's staging buffer for the coming call; returns where.
    fn stage<T: Element>(&self, buf: &[T]) -> *const T {
        let mut staging = self.shared.staging[self.rank * 2 + self.parity()]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let staging = T::of(&mut staging);
        // No peer reads this buffer now: its last readers read it two calls ago, before the
        // entry wait of the previous call, which completed cleanly (`check_usable`).
        staging.resize(buf.len(), T::default());
        copy(staging, buf);
        staging.as_ptr()
    }

    /// This rank's staging buffer for the coming call, `len` elements of `T`: where a
    /// two-shot all-reduce sums its chunk. Returns where.
    fn reduce_target<T: Element>(&self, len: usize) -> *mut T {
        let mut staging = self.shared.staging[self.rank * 2 + self.parity()]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let staging = T::of(&mut staging);
        // No peer reads this buffer now, as in `stage`.
        staging.resize(len, T::default());
        staging.as_mut_ptr()
    }

    /// Steps 1 and 2 of the protocol: publishes `call`, its data `ptr` (elements of
    /// `call.dtype`) and what its all-reduce algorithm publishes besides (`aux`, see
    /// [`Slot::aux`]). Returns the parity of this call.
    fn begin(
        &mut self,
        call: Call,
        ptr: *const (),
        aux: *mut (),
        local_error: Option<CommError>,
    ) -> Result<usize, CommError> {
        self.check_usable(call.during)?;
        let parity = self.parity();
        self.calls += 1;
        let slot = self.slot(self.rank, parity);
        let bad = if local_error.is_some() {
            BAD_ARGUMENTS
        } else {
            0
        };
        slot.code.store(call.code() | bad, Relaxed);
        slot.len.store(call.len, Relaxed);
        slot.root.store(call.root, Relaxed);
        slot.ptr.store(ptr.cast_mut(), Relaxed);
        slot.aux.store(aux, Relaxed);
        // The entry wait orders these stores before every peer's loads below.
        self.wait(Phase::Entry, call.during)?;
        if let Some(e) = local_error {
            return Err(e);
        }
        for peer in (0..self.n).filter(|&p| p != self.rank) {
            let slot = self.slot(peer, parity);
            let code = slot.code.load(Relaxed);
            if code & BAD_ARGUMENTS != 0 {
                return Err(CommError::PeerBadArguments {
                    rank: self.rank,
                    during: call.during,
                    peer,
                });
            }
            let theirs = Call::decode(code, slot.len.load(Relaxed), slot.root.load(Relaxed));
            if theirs.during != call.during || theirs.len != call.len {
                return Err(CommError::PeerMismatch {
                    rank: self.rank,
                    during: call.during,
                    len: call.len,
                    peer,
                    peer_during: theirs.during,
                    peer_len: theirs.len,
                });
            }
            if let (Some(dtype), Some(peer_dtype)) = (call.dtype, theirs.dtype) {
                if dtype != peer_dtype {
                    return Err(CommError::DTypeMismatch {
                        rank: self.rank,
                        during: call.during,
                        dtype,
                        peer,
                        peer_during: theirs.during,
                        peer_dtype,
                    });
                }
            }
            if theirs.root != call.root {
                return Err(CommError::RootMismatch {
                    rank: self.rank,
                    root: call.root,
                    peer,
                    peer_root: theirs.root,
                });
            }
            if let (Some(mine), Some(their)) = (call.algorithm, theirs.algorithm) {
                if mine != their {
                    return Err(CommError::AlgorithmMismatch {
                        rank: self.rank,
                        peer,
                        algorithm: mine,
                        peer_algorithm: their,
                    });
                }
            }
        }
        Ok(parity)
    }

    /// `range` of the data `peer` published for the current call (which has `parity`).
    ///
    /// # Safety
    ///
    /// Call only between this call's entry wait (completed without error) and this rank's
    /// next arrival at a wait, with `T` the element type of this call (`begin` checked that
    /// every rank published the same one), with `range.end` within what `peer` published
    /// (`peer`'s own argument checks passed, so its buffer has the length the collective
    /// implies), and only for elements `peer` does not write in the current data phase.
    unsafe fn peer_data<T: Element>(
        &self,
        peer: usize,
        parity: usize,
        range: Range<usize>,
    ) -> &[T] {
        let base = self
            .slot(peer, parity)
            .ptr
            .load(Relaxed)
            .cast_const()
            .cast::<T>();
        // SAFETY: `base` was published by `peer`, as a pointer to elements of `T`, before the
        // entry wait that made it visible here and points to at least `range.end`
        // initialized elements, which stay allocated and unwritten while the slice is used,
        // as the caller guarantees: a peer frees or reuses its memory only after a later
        // wait that this rank has not arrived at.
        unsafe { std::slice::from_raw_parts(base.add(range.start), range.len()) }
    }

    /// `out` ← elements `piece` of every rank's published input (this rank's own is
    /// `input`) summed in the documented order, then the inner wait that frees them.
    ///
    /// # Safety
    ///
    /// After a [`LocalComm::begin`] of `parity` in which every peer published a buffer of
    /// at least `piece.end` elements of `T`, which it keeps unwritten until that wait.
    unsafe fn sum_piece<T: Element>(
        &self,
        input: &[T],
        piece: Range<usize>,
        parity: usize,
        out: &mut [T],
        during: Collective,
    ) -> Result<(), CommError> {
        let rank = self.rank;
        let _guard = UnwindGuard::new(&self.shared, rank);
        let sources = summation_order(self.n, rank).map(|q| {
            if q == rank {
                &input[piece.clone()]
            } else {
                // SAFETY: the caller's guarantee: `q` published at least `piece.end`
                // elements of `T`, a shared borrow nobody writes, held until `q` passes the
                // inner wait below, which needs this rank's arrival.
                unsafe { self.peer_data::<T>(q, parity, piece.clone()) }
            }
        });
        T::sum_into(out, sources);
        self.wait(Phase::Inner, during)
    }

    /// Starts a collective of unequal pieces: checks this rank's arguments (its own piece
    /// `mine` elements, the whole `whole`: [`check_counts`]), publishes `data` and `counts`,
    /// and checks that every peer passed the same counts. Returns the parity and each
    /// piece's offset; the caller then reads what it needs and makes the inner wait, which
    /// every rank makes once the counts are published (peers read them), errors included.
    fn begin_counts<T: Element>(
        &mut self,
        during: Collective,
        counts: &[usize],
        mine: usize,
        whole: usize,
        data: *const (),
    ) -> Result<(usize, Vec<usize>), CommError> {
        let checked = check_counts(self.rank, self.n, during, counts, mine, whole);
        let (offsets, total, local_error) = match checked {
            Ok((o, t)) => (o, t, None),
            Err(e) => (Vec::new(), 0, Some(e)),
        };
        let call = Call::of::<T>(during, total);
        let aux = counts.as_ptr().cast_mut().cast();
        let parity = self.begin(call, data, aux, local_error)?;
        if let Err(e) = self.check_peer_counts(parity, during, counts) {
            self.wait(Phase::Inner, during)?;
            return Err(e);
        }
        Ok((parity, offsets))
    }

    /// After [`LocalComm::begin`] of a collective of unequal pieces (each rank publishing its
    /// `counts` as `aux`): an error unless every peer passed the same counts as this rank.
    /// Every rank gets it when any two differ (a rank equal to every other would make them
    /// all equal), so none goes on to read a peer's data; each still makes the inner wait
    /// before it returns, since peers may be reading its counts.
    fn check_peer_counts(
        &self,
        parity: usize,
        during: Collective,
        counts: &[usize],
    ) -> Result<(), CommError> {
        for peer in (0..self.n).filter(|&p| p != self.rank) {
            let base = self.slot(peer, parity).aux.load(Relaxed).cast_const();
            // SAFETY: `peer` published a pointer to its `counts`, checked in its own
            // `check_counts` to hold `n` elements (else it flagged bad arguments and `begin`
            // returned), before the entry wait; they stay alive and unwritten until the
            // peer passes the inner wait, which needs this rank's arrival after this read.
            let theirs = unsafe { std::slice::from_raw_parts(base.cast::<usize>(), self.n) };
            if theirs != counts {
                let total = |c: &[usize]| c.iter().fold(0usize, |a, &x| a.saturating_add(x));
                return Err(CommError::PeerMismatch {
                    rank: self.rank,
                    during,
                    len: total(counts),
                    peer,
                    peer_during: during,
                    peer_len: total(theirs),
                });
            }
        }
        Ok(())
    }

    /// `range` of the `f32` partial sums `peer` published for the current ring all-reduce.
    ///
    /// # Safety
    ///
    /// As for [`Self::peer_data`], in a ring all-reduce, which publishes `len` partial sums.
    unsafe fn peer_acc(&self, peer: usize, parity: usize, range: Range<usize>) -> &[f32] {
        let base = self
            .slot(peer, parity)
            .aux
            .load(Relaxed)
            .cast_const()
            .cast::<f32>();
        // SAFETY: as in `peer_data`; `aux` points to `len` `f32`s (the peer's buffer itself
        // for `f32`, else its workspace, resized to `len` whenever `ring` reads it: with more
        // than two ranks).
        unsafe { std::slice::from_raw_parts(base.add(range.start), range.len()) }
    }

    /// The `len` summed elements `peer` published for the current two-shot all-reduce.
    ///
    /// # Safety
    ///
    /// As for [`Self::peer_data`], in a two-shot all-reduce, after its inner wait completed
    /// without error, with `len` the length of `peer`'s chunk.
    unsafe fn peer_reduced<T: Element>(&self, peer: usize, parity: usize, len: usize) -> &[T] {
        let base = self
            .slot(peer, parity)
            .aux
            .load(Relaxed)
            .cast_const()
            .cast::<T>();
        // SAFETY: as in `peer_data`; `aux` points to `peer`'s staging buffer, which it sized
        // to its chunk's `len` elements of the call's type before publishing it and filled
        // before the inner wait.
        unsafe { std::slice::from_raw_parts(base, len) }
    }

    /// Two-shot data phases over this rank's `buf` (`own`, `len` elements). Reduce-scatter:
    /// this rank sums its chunk of every rank's `buf`, in the fixed order, into that chunk
    /// of its `buf` and into its staging buffer (`reduced`, the chunk's length). One inner
    /// wait. All-gather: it copies every other rank's summed chunk from that rank's staging
    /// buffer into its `buf`.
    ///
    /// In the first phase every rank reads chunk `q` of every rank's buffer and writes only
    /// its own chunk `r` and its staging buffer, which nobody reads before the wait; in the
    /// second it writes only its `buf`, which nobody reads after the wait, and reads only
    /// staging buffers, which belong to the group and are written again two calls later (as
    /// the one-shot's are): so no rank waits for the others before returning. (Summing in
    /// place and skipping the own chunk in the second phase saves reading it back from the
    /// staging buffer and writing it again: counted at 2 ranks, a rank moves about 4 times
    /// the message through memory instead of 5; the ring moves 3.)
    fn two_shot<T: Element>(
        &self,
        own: *mut T,
        len: usize,
        reduced: *mut T,
        parity: usize,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.n, self.rank);
        let mine = chunk_range(len, n, rank);
        let guard = UnwindGuard::new(&self.shared, rank);
        if !mine.is_empty() {
            // The owner adds last: its peers first, in the fixed order.
            let peers = summation_order(n, rank).take(n - 1).map(|q| {
                // SAFETY: rank `q` published its `buf` of `len` elements of `T` (length and
                // type agreed in `begin`); in this phase it writes only its own chunk `q`,
                // and it keeps the buffer until it passes the inner wait below, which needs
                // this rank's arrival.
                unsafe { self.peer_data::<T>(q, parity, mine.clone()) }
            });
            // SAFETY: `own` is this rank's `buf` of `len` elements, borrowed mutably for the
            // whole call and accessed only through `own`; peers read only their own chunks
            // of it in this phase, never `mine`. `reduced` is this rank's staging buffer for
            // this call, sized to `mine.len()` elements of `T` by `reduce_target`; only this
            // rank writes it, and nobody reads it before the inner wait below.
            let (own_chunk, dst) = unsafe {
                (
                    std::slice::from_raw_parts_mut(own.add(mine.start), mine.len()),
                    std::slice::from_raw_parts_mut(reduced, mine.len()),
                )
            };
            sum_peers_into_own(own_chunk, dst, peers);
        }
        #[cfg(test)]
        if self.panic_in_two_shot_reduce {
            panic!("injected panic in the two-shot reduce-scatter on rank {rank}");
        }
        self.wait(Phase::Inner, Collective::AllReduceSum)?;
        drop(guard);
        for q in (0..n).filter(|&q| q != rank) {
            let chunk = chunk_range(len, n, q);
            if chunk.is_empty() {
                continue;
            }
            // SAFETY: rank `q` published its staging buffer of its chunk's length and filled
            // it before the inner wait that just completed cleanly; the group keeps it
            // alive, and rank `q` writes it again only after this rank has arrived at the
            // entry wait of its next call.
            let theirs = unsafe { self.peer_reduced::<T>(q, parity, chunk.len()) };
            // SAFETY: `own` is this rank's `buf` of `len` elements, accessed only through
            // `own`; after the inner wait nobody else reads it.
            let dst = unsafe { std::slice::from_raw_parts_mut(own.add(chunk.start), chunk.len()) };
            copy(dst, theirs);
        }
        Ok(())
    }

    /// One-shot data phase: every chunk summed from all staging buffers, in the fixed order.
    fn one_shot<T: Element>(&self, buf: &mut [T], parity: usize) {
        let (n, len) = (self.n, buf.len());
        for c in 0..n {
            let range = chunk_range(len, n, c);
            if range.is_empty() {
                continue;
            }
            let sources = summation_order(n, c).map(|q| {
                // SAFETY: rank `q` published its staging buffer of `len` elements for this
                // call (lengths agreed in `begin`); staging buffers belong to the group,
                // which `self.shared` keeps alive, and rank `q` writes this one again only
                // after this rank has arrived at the entry wait of its next call.
                unsafe { self.peer_data::<T>(q, parity, range.clone()) }
            });
            T::sum_into(&mut buf[range.clone()], sources);
        }
    }

    /// [`LocalComm::one_shot`] row by row: each row's elements summed from all staging
    /// buffers (each element in the order of the chunk it belongs to, so the bits are the
    /// ones `one_shot` gives), then handed to `row` while they are in cache.
    fn one_shot_rows<T: Element>(
        &self,
        buf: &mut [T],
        parity: usize,
        row_len: usize,
        row: &mut dyn FnMut(usize, &[T]),
    ) {
        let (n, len) = (self.n, buf.len());
        for (r, start) in (0..len).step_by(row_len).enumerate() {
            let end = start.saturating_add(row_len).min(len);
            for c in 0..n {
                let chunk = chunk_range(len, n, c);
                let part = chunk.start.max(start)..chunk.end.min(end);
                if part.is_empty() {
                    continue;
                }
                let sources = summation_order(n, c).map(|q| {
                    // SAFETY: as in `one_shot`: rank `q` published its staging buffer of
                    // `len` elements for this call, and writes it again only after this
                    // rank has arrived at the entry wait of its next call.
                    unsafe { self.peer_data::<T>(q, parity, part.clone()) }
                });
                T::sum_into(&mut buf[part.clone()], sources);
            }
            row(r, &buf[start..end]);
        }
    }

    /// Ring data phases, in place in every rank's buffer (`own`, `len` elements) and, for a
    /// type narrower than `f32`, its workspace (`acc`, `len` `f32`s; for `f32`, `acc` is
    /// `own` and `in_place` is true). Chunk `c` travels from rank `c + 1` around the ring and
    /// ends, complete, at rank `c`; then each complete chunk travels around once more as a
    /// copy.
    ///
    /// In reduce-scatter step `s` rank `r` reads chunk `r − s − 2` of rank `r − 1` (its input
    /// when `s = 0`, else the partial sum it wrote in step `s − 1`) and writes its own chunk
    /// `r − s − 2` (a partial sum; the rounded result in the last step); in all-gather step
    /// `s` it reads chunk `r − s − 1` of rank `r − 1` and writes its own chunk `r − s − 1`. In
    /// one step a rank's memory is thus written at chunk `r − s − k` by rank `r` and read at
    /// chunk `r − s − k + 1` by rank `r + 1`: disjoint (for `f32` chunks never share a cache
    /// line either, see [`chunk_range`]).
    fn ring<T: Element>(
        &self,
        own: *mut T,
        acc: *mut f32,
        in_place: bool,
        len: usize,
        parity: usize,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.n, self.rank);
        let during = Collective::AllReduceSum;
        let pred = (rank + n - 1) % n;
        let _guard = UnwindGuard::new(&self.shared, rank);
        for step in 0..n - 1 {
            let range = chunk_range(len, n, (rank + 2 * n - step - 2) % n);
            let last = step == n - 2;
            // SAFETY (the three blocks below): `own` is this rank's `buf` and `acc` its
            // partial sums, `len` elements each (`acc` is only used in steps before the last,
            // so with more than two ranks, when it has been resized; `buf` is borrowed
            // mutably for the whole call and accessed only through `own` and `acc`; the
            // workspace is out of `self`);
            // nobody else writes them, and in this step the successor reads a different
            // chunk (see above). The predecessor's chunk is not written in this step, and its
            // memory stays allocated until after its last inner wait, which needs this rank's
            // arrival. It published its input as elements of `T` (the type agreed in `begin`)
            // and its partial sums as `f32`s.
            if in_place {
                // `acc` is `own` (and the predecessor's `acc` its input): add in place.
                let (mine, theirs) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(acc.add(range.start), range.len()),
                        self.peer_acc(pred, parity, range),
                    )
                };
                accumulate_into_own(mine, theirs);
            } else if step == 0 {
                let theirs = unsafe { self.peer_data::<T>(pred, parity, range.clone()) };
                unsafe { carry(own, acc, range, theirs, last) };
            } else {
                let theirs = unsafe { self.peer_acc(pred, parity, range.clone()) };
                unsafe { carry(own, acc, range, theirs, last) };
            }
            #[cfg(test)]
            if self.panic_in_ring_step == Some(step) {
                panic!("injected panic in ring step {step} on rank {rank}");
            }
            self.wait(Phase::Inner, during)?;
        }
        for step in 0..n - 1 {
            let range = chunk_range(len, n, (rank + n - step - 1) % n);
            // SAFETY: as above.
            let (mine, theirs) = unsafe {
                (
                    std::slice::from_raw_parts_mut(own.add(range.start), range.len()),
                    self.peer_data::<T>(pred, parity, range),
                )
            };
            copy(mine, theirs);
            self.wait(Phase::Inner, during)?;
        }
        Ok(())
    }
}

/// One reduce-scatter step of a widened ring: this rank's chunk `range` of `own` is added to
/// the predecessor's `partial` in `f32`; the sum goes to `acc` or, in the `last` step,
/// rounded, to `own`.
///
/// # Safety
///
/// `own` and `acc` point to at least `range.end` elements each, which do not overlap each
/// other or `partial` and which nobody else accesses during the call.
unsafe fn carry<P: Element, T: Element>(
    own: *mut T,
    acc: *mut f32,
    range: Range<usize>,
    partial: &[P],
    last: bool,
) {
    if last {
        // SAFETY: as the caller guarantees.
        let own = unsafe { std::slice::from_raw_parts_mut(own.add(range.start), range.len()) };
        add_round(own, partial);
    } else {
        // SAFETY: as the caller guarantees.
        let (own, acc) = unsafe {
            (
                std::slice::from_raw_parts(own.add(range.start), range.len()),
                std::slice::from_raw_parts_mut(acc.add(range.start), range.len()),
            )
        };
        widen_add(acc, partial, own);
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce_sum<T: Element>(&mut self, buf: &mut [T]) -> Result<(), CommError> {
        self.all_reduce_sum_with(buf, AllReduceAlgorithm::Auto)
    }

    /// As [`AllReduceAlgorithm::planned`] says.
    fn all_reduce_sum_planned<T: Element>(
        &mut self,
        buf: &mut [T],
        algorithm: Option<CollectiveAlgorithm>,
    ) -> Result<Option<CollectiveAlgorithm>, CommError> {
        self.all_reduce_sum_planned_then(buf, algorithm, None)
    }

    /// One-shot hands each row on as soon as it is summed (one loop for the reduction and
    /// what reads it); the ring after its last step.
    fn all_reduce_sum_rows<T: Element>(
        &mut self,
        buf: &mut [T],
        row_len: usize,
        algorithm: Option<CollectiveAlgorithm>,
        row: &mut dyn FnMut(usize, &[T]),
    ) -> Result<Option<CollectiveAlgorithm>, CommError> {
        self.all_reduce_sum_planned_then(buf, algorithm, Some((row_len, row)))
    }

    fn all_gather<T: Element>(&mut self, local: &[T], out: &mut [T]) -> Result<(), CommError> {
        let during = Collective::AllGather;
        let (n, rank, m) = (self.n, self.rank, local.len());
        let expected = m.saturating_mul(n);
        let local_error = (out.len() != expected).then_some(CommError::SizeMismatch {
            rank,
            during,
            what: "`out` (must hold world_size × local.len())",
            expected,
            got: out.len(),
        });
        let call = Call::of::<T>(during, m);
        let parity = self.begin(call, local.as_ptr().cast(), ptr::null_mut(), local_error)?;
        if m == 0 {
            return Ok(());
        }
        let _guard = UnwindGuard::new(&self.shared, rank);
        for (q, dst) in out.chunks_exact_mut(m).enumerate() {
            if q == rank {
                copy(dst, local);
            } else {
                // SAFETY: rank `q` published its `local` of `m` elements of `T` (checked in
                // `begin`); it is a shared borrow nobody writes, held until `q` passes the
                // inner wait below, which needs this rank's arrival.
                copy(dst, unsafe { self.peer_data::<T>(q, parity, 0..m) });
            }
        }
        self.wait(Phase::Inner, during)
    }

    fn reduce_scatter_sum<T: Element>(
        &mut self,
        input: &[T],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::ReduceScatterSum;
        let (n, rank, m) = (self.n, self.rank, out.len());
        let expected = m.saturating_mul(n);
        let local_error = (input.len() != expected).then_some(CommError::SizeMismatch {
            rank,
            during,
            what: "`input` (must hold world_size × out.len())",
            expected,
            got: input.len(),
        });
        let call = Call::of::<T>(during, m);
        let parity = self.begin(call, input.as_ptr().cast(), ptr::null_mut(), local_error)?;
        if m == 0 {
            return Ok(());
        }
        // SAFETY: every rank published its `input` of `n × m` elements of `T` (its own size
        // check passed; `m` and the type agreed in `begin`), so each holds `piece`.
        unsafe { self.sum_piece(input, rank * m..(rank + 1) * m, parity, out, during) }
    }

    fn all_gather_counts<T: Element>(
        &mut self,
        local: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::AllGatherCounts;
        let rank = self.rank;
        let data = local.as_ptr().cast();
        let (parity, offsets) =
            self.begin_counts::<T>(during, counts, local.len(), out.len(), data)?;
        if out.is_empty() {
            return self.wait(Phase::Inner, during);
        }
        let _guard = UnwindGuard::new(&self.shared, rank);
        for (q, (&at, &len)) in offsets.iter().zip(counts).enumerate() {
            let dst = &mut out[at..at + len];
            if q == rank {
                copy(dst, local);
            } else if len > 0 {
                // SAFETY: rank `q` published its `local`, checked against the same `counts`
                // (compared above) to hold `counts[q]` elements of `T` (the type agreed in
                // `begin`); a shared borrow nobody writes, held until `q` passes the inner
                // wait below, which needs this rank's arrival.
                copy(dst, unsafe { self.peer_data::<T>(q, parity, 0..len) });
            }
        }
        self.wait(Phase::Inner, during)
    }

    fn reduce_scatter_sum_counts<T: Element>(
        &mut self,
        input: &[T],
        counts: &[usize],
        out: &mut [T],
    ) -> Result<(), CommError> {
        let during = Collective::ReduceScatterSumCounts;
        let rank = self.rank;
        let data = input.as_ptr().cast();
        let (parity, offsets) =
            self.begin_counts::<T>(during, counts, out.len(), input.len(), data)?;
        // Peers may read this rank's input even where it keeps nothing: wait for them.
        if out.is_empty() {
            return self.wait(Phase::Inner, during);
        }
        let piece = offsets[rank]..offsets[rank] + counts[rank];
        // SAFETY: every rank published its `input`, checked to hold the sum of the same
        // `counts` (compared above) in elements of `T` (agreed in `begin`), so each holds
        // `piece`.
        unsafe { self.sum_piece(input, piece, parity, out, during) }
    }

    fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let during = Collective::Broadcast;
        let (n, rank, len) = (self.n, self.rank, buf.len());
        let local_error = (root >= n).then_some(CommError::BadRank {
            rank,
            during,
            peer: root,
            world_size: n,
            what: "the root must be a rank of the group",
        });
        let call = Call {
            root,
            ..Call::of::<T>(during, len)
        };
        // Peers read only the root's buffer, and the root leaves it alone until it returns.
        let data = buf.as_mut_ptr();
        let parity = self.begin(call, data.cast_const().cast(), ptr::null_mut(), local_error)?;
        if n == 1 || len == 0 {
            return Ok(());
        }
        if rank != root {
            let _guard = UnwindGuard::new(&self.shared, rank);
            // SAFETY: `root` published its `buf` of `len` elements of `T` (length, type and
            // root agreed in `begin`); the root does not touch it until it passes the inner
            // wait below, which needs this rank's arrival. This rank's own `buf` is not read
            // by anybody.
            let theirs = unsafe { self.peer_data::<T>(root, parity, 0..len) };
            copy(buf, theirs);
        }
        self.wait(Phase::Inner, during)
    }

    fn send<T: Element>(&mut self, buf: &[T], to: usize) -> Result<(), CommError> {
        let during = Collective::Send;
        self.check_peer(to, during)?;
        self.check_usable(during)?;
        let mut message = self.shared.spares[self.rank].0.take::<T>();
        message.resize(buf.len(), T::default());
        copy(&mut message, buf);
        self.shared.mailboxes[to]
            .0
            .deliver(self.rank, T::into_owned(message));
        Ok(())
    }

    fn recv<T: Element>(&mut self, buf: &mut [T], from: usize) -> Result<(), CommError> {
        let during = Collective::Recv;
        self.check_peer(from, during)?;
        if self.aborted {
            return Err(CommError::Aborted {
                rank: self.rank,
                during,
            });
        }
        // A group failure is checked by `take`, after the messages already sent.
        let barrier = &self.shared.barrier;
        let message = self.shared.mailboxes[self.rank]
            .0
            .take(from, || barrier.failure())
            .map_err(|f| self.peer_failed(f, during))?;
        let spares = &self.shared.spares[from].0;
        let message = match T::from_owned(message) {
            Ok(message) => message,
            Err(other) => {
                let peer_dtype = other.dtype();
                spares.give(other);
                return Err(CommError::DTypeMismatch {
                    rank: self.rank,
                    during,
                    dtype: T::DTYPE,
                    peer: from,
                    peer_during: Collective::Send,
                    peer_dtype,
                });
            }
        };
        let outcome = if message.len() == buf.len() {
            copy(buf, &message);
            Ok(())
        } else {
            Err(CommError::PeerMismatch {
                rank: self.rank,
                during,
                len: buf.len(),
                peer: from,
                peer_during: Collective::Send,
                peer_len: message.len(),
            })
        };
        spares.give(T::into_owned(message));
        outcome
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let call = Call {
            dtype: None,
            ..Call::of::<f32>(Collective::Barrier, 0)
        };
        self.begin(call, ptr::null(), ptr::null_mut(), None)
            .map(drop)
    }

    /// Leave the group on purpose: every rank blocked in or later entering a collective,
    /// `send` or `recv` (unless a message it asks for was sent already) gets
    /// [`CommError::PeerFailed`] with [`FailureCause::Aborted`], and this communicator
    /// refuses further calls with [`CommError::Aborted`].
    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            self.shared.fail(self.rank, FailureCause::Aborted);
        }
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        if !self.aborted {
            let cause = if std::thread::panicking() {
                FailureCause::Panicked
            } else {
                FailureCause::Dropped
            };
            self.shared.fail(self.rank, cause);
        }
    }
}
