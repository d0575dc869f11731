//! A rank's own team of compute threads: the rank's thread plus `size - 1` helpers that
//! wait spinning (then parked) for the next job. Decode runs ~150 small products per token;
//! waking sleeping pool threads through a futex for each cost ~20 % of decode time on this
//! machine (tp=1 with two rayon threads ran at 0.8x tp=2 with one thread per rank), while a
//! spinning helper starts within a fraction of a microsecond.
//!
//! A job is `f(member)` for every member `0..size`; the caller runs member 0 itself and
//! returns once every helper has finished, so `f` may borrow the caller's stack.

use std::any::Any;
use std::cell::UnsafeCell;
use std::hint::spin_loop;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

type Job = dyn Fn(usize) + Sync;

/// Spin rounds (~30 ns each here) a waiting helper spends before it parks: long enough to
/// cover the norms and adds between two products of a decode step. (Under Miri, where each
/// round costs thousands of times more, a few: the parking path is then tested too.)
const SPIN_ROUNDS: u32 = if cfg!(miri) { 8 } else { 1 << 12 };

struct Shared {
    /// Bumped once per job (and once for shutdown).
    epoch: AtomicU64,
    /// The current job, valid while `pending > 0`; written only by the caller before it
    /// bumps `epoch`.
    job: UnsafeCell<Option<*const Job>>,
    /// Helpers that have not yet finished the current job.
    pending: AtomicUsize,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// The first panic of a helper during the current job (member, payload); taken by the
    /// caller when the job is done, so it never outlives its job.
    panic: Mutex<Option<(usize, Box<dyn Any + Send>)>>,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the thread holding the team's run lock, before an epoch
// bump (SeqCst), and read by helpers only after they observe that bump and before they
// decrement `pending`, which the writer waits for before touching it again.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// An output buffer shared by team members that write disjoint parts of it: a
/// `&'a mut [f32]` (or a `&'a mut [MaybeUninit<f32>]` to be filled) whose borrow it keeps,
/// handed to every member. Safe to make and to share; every access is an `unsafe` method
/// whose caller promises that no two members touch the same element (each says why at its
/// use). Bounds are checked in debug builds only: the accessors sit in hot loops.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<'a> {
    ptr: *mut f32,
    len: usize,
    _buf: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SyncPtr` is a unique borrow of its buffer (like `&mut [f32]`, which is `Send`
// and `Sync`); it hands out access only through `unsafe` methods whose contract is that the
// members' accesses are to disjoint elements, so sharing it between threads races nowhere.
unsafe impl Send for SyncPtr<'_> {}
unsafe impl Sync for SyncPtr<'_> {}

impl<'a> SyncPtr<'a> {
    /// Shares `buf` (initialised values) for the duration of its borrow.
    pub(crate) fn new(buf: &'a mut [f32]) -> SyncPtr<'a> {
        SyncPtr {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: PhantomData,
        }
    }

    /// Shares `buf`, not yet initialised, for its members to fill through
    /// [`SyncPtr::span`] (reading an element only after writing it).
    pub(crate) fn uninit(buf: &'a mut [MaybeUninit<f32>]) -> SyncPtr<'a> {
        SyncPtr {
            ptr: buf.as_mut_ptr().cast(),
            len: buf.len(),
            _buf: PhantomData,
        }
    }

    /// A raw pointer to elements `start .. start + len`, which the caller then reads or
    /// writes through (a kernel with a leading dimension may touch part of the span only).
    ///
    /// # Safety
    /// `start + len` is at most the buffer's length (checked in debug builds), and while the
    /// borrow this `SyncPtr` was made from lasts, no other member accesses the elements that
    /// the caller accesses through the pointer; reads only of initialised elements.
    #[inline(always)]
    pub(crate) unsafe fn span(self, start: usize, len: usize) -> *mut f32 {
        debug_assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "SyncPtr span {start}+{len} past {}",
            self.len
        );
        // SAFETY: in bounds by the caller's contract, so the offset stays in the allocation.
        unsafe { self.ptr.add(start) }
    }

    /// Elements `start .. start + len` as a slice.
    ///
    /// # Safety
    /// `start + len` is at most the buffer's length (checked in debug builds); the elements
    /// are initialised (the buffer came from [`SyncPtr::new`], or they were written); and
    /// while the returned slice lives no other access to them happens (no other member's
    /// slice or span overlaps it).
    #[inline(always)]
    pub(crate) unsafe fn slice_mut(self, start: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: the caller's contract: in bounds, initialised, not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.span(start, len), len) }
    }
}

/// A helper thread's stack (std's default for spawned threads).
const HELPER_STACK: usize = 2 << 20;
/// Address space a helper needs beyond its stack (guard page, signal stack), with margin.
const SPAWN_HEADROOM: usize = 1 << 20;

pub struct Team {
    size: usize,
    shared: Arc<Shared>,
    /// Serialises `run` (the team serves one job at a time).
    running: Mutex<()>,
    helpers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Team {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Team").field("size", &self.size).finish()
    }
}

impl Team {
    /// A team of `size` members (at least 1): the caller and `size - 1` helper threads.
    pub fn new(size: usize) -> Team {
        Team::pinned(size, &[])
    }

    /// As [`Team::new`], helper `m` pinned to `cores[m]` where given (best effort).
    pub fn pinned(size: usize, cores: &[Option<usize>]) -> Team {
        Team::try_pinned(size, cores).expect("spawning a compute thread")
    }

    /// As [`Team::pinned`]; a helper thread the system refuses to start is an error (the
    /// helpers already started are stopped again).
    pub fn try_pinned(size: usize, cores: &[Option<usize>]) -> std::io::Result<Team> {
        let size = size.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let mut team = Team {
            size: 1,
            shared,
            running: Mutex::new(()),
            helpers: Vec::with_capacity(size - 1),
        };
        for member in 1..size {
            let shared = team.shared.clone();
            let core = cores.get(member).copied().flatten();
            // The new thread maps its signal stack itself, after the spawn succeeded, and std
            // aborts the process if that fails (seen ~1 in 40 runs near an address-space
            // limit): ask for the stack and that headroom first, one helper at a time (each
            // waits until the last one runs), so that a shortage is refused here, as an
            // error. (On failure `team` drops here, which stops the helpers started so far.)
            Vec::<u8>::new()
                .try_reserve_exact(HELPER_STACK + SPAWN_HEADROOM)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e))?;
            let (started, running) = std::sync::mpsc::channel();
            let handle = std::thread::Builder::new()
                .name(format!("tpc-team-{member}"))
                .stack_size(HELPER_STACK)
                .spawn(move || {
                    // Its signal stack is mapped by now: the next helper's check sees it.
                    let _ = started.send(());
                    if let Some(core) = core {
                        super::affinity::pin_current_thread(core);
                    }
                    helper(&shared, member)
                })?;
            let _ = running.recv();
            team.helpers.push(handle);
        }
        team.size = size;
        Ok(team)
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs `f(member)` for every member, the caller's share (member 0) on this thread;
    /// returns when all are done. A panic in any share is re-raised here once every member
    /// has finished: member 0's as it was, else the first helper's, naming the member and
    /// its message. The team serves the next job normally either way.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.size == 1 {
            return f(0);
        }
        let _running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &*self.shared;
        // SAFETY: lifetime erasure. The pointer is only dereferenced by helpers before they
        // decrement `pending`, and `WaitForHelpers` (also run on unwind) does not return
        // until `pending` is 0, so `f` outlives every use.
        let job: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        // SAFETY: no helper reads `job` now: the previous job's `pending` reached 0.
        unsafe { *s.job.get() = Some(job) };
        s.pending.store(self.size - 1, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }
        struct WaitForHelpers<'a>(&'a Shared);
        impl Drop for WaitForHelpers<'_> {
            fn drop(&mut self) {
                let mut rounds = 0u32;
                while self.0.pending.load(SeqCst) > 0 {
                    rounds = rounds.saturating_add(1);
                    if rounds < SPIN_ROUNDS {
                        spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
            }
        }
        let wait = WaitForHelpers(s);
        let own = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        drop(wait);
        // Every helper is done: take this job's helper panic (if any) whatever happens next,
        // so that the next job starts clean.
        let helper_panic = s
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Err(payload) = own {
            std::panic::resume_unwind(payload);
        }
        if let Some((member, payload)) = helper_panic {
            let what = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(a non-string payload)");
            panic!("compute thread {member} of this rank panicked: {what}");
        }
    }
}

impl Team {
    /// Runs `f(member)` for the first `members` members only (all on the caller's thread
    /// when that is one, without waking anybody).
    pub fn run_on(&self, members: usize, f: &(dyn Fn(usize) + Sync)) {
        if members <= 1 {
            return f(0);
        }
        self.run(&|m| {
            if m < members {
                f(m)
            }
        })
    }

    /// Runs `f(part, offset)` over `data` cut into one part per member, each part a whole
    /// number of `align`-element units (rows) starting at element `offset`; data shorter
    /// than `min_len` stays on the caller's thread.
    pub fn for_each_part(
        &self,
        data: &mut [f32],
        align: usize,
        min_len: usize,
        f: &(dyn Fn(&mut [f32], usize) + Sync),
    ) {
        let align = align.max(1);
        let units = data.len() / align;
        let members = if data.len() < min_len {
            1
        } else {
            self.size.min(units.max(1))
        };
        if members == 1 {
            return f(data, 0);
        }
        let len = data.len();
        let base = SyncPtr::new(data);
        // Member m's first unit: m·(units / members) plus one more for each earlier member
        // among the first `units % members` (no product exceeds `units`: nothing overflows).
        let (per, extra) = (units / members, units % members);
        let first_unit = |m: usize| m * per + m.min(extra);
        self.run_on(members, &|m| {
            let start = first_unit(m) * align;
            let end = if m + 1 == members {
                len
            } else {
                first_unit(m + 1) * align
            };
            assert!(
                start <= end && end <= len,
                "team part {start}..{end} of {len}"
            );
            // SAFETY: members get disjoint ranges [start, end) of `data` (first_unit grows
            // with m), in bounds (asserted), initialised (a `&mut [f32]`), and `data` stays
            // borrowed by `base` until `run_on` returns, when every member is done.
            let part = unsafe { base.slice_mut(start, end - start) };
            f(part, start)
        });
    }
}

fn helper(s: &Shared, member: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin, then park.
        let mut rounds = 0u32;
        let epoch = loop {
            let e = s.epoch.load(SeqCst);
            if e != seen {
                break e;
            }
            rounds += 1;
            if rounds < SPIN_ROUNDS {
                spin_loop();
                continue;
            }
            let mut g = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.sleepers.fetch_add(1, SeqCst);
            while s.epoch.load(SeqCst) == seen {
                g = s.wake.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
            s.sleepers.fetch_sub(1, SeqCst);
            rounds = 0;
        };
        seen = epoch;
        if s.shutdown.load(SeqCst) {
            return;
        }
        // SAFETY: see `Shared`: the job was written before the epoch bump observed above
        // and stays valid until this helper decrements `pending`.
        let job = unsafe { (*s.job.get()).expect("a job is set with every epoch") };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: as above.
            unsafe { (*job)(member) }
        }));
        if let Err(payload) = result {
            let mut first = s.panic.lock().unwrap_or_else(PoisonError::into_inner);
            first.get_or_insert((member, payload));
        }
        s.pending.fetch_sub(1, SeqCst);
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_member_runs_once_per_job_and_borrows_work() {
        let (len, rounds) = if cfg!(miri) { (60, 4) } else { (1000, 200) };
        for size in [1, 2, 3, 5] {
            let team = Team::new(size);
            let mut data = vec![0usize; len];
            for round in 1..=rounds {
                let counts: Vec<AtomicUsize> = (0..size).map(|_| AtomicUsize::new(0)).collect();
                let out = AtomicUsize::new(0);
                team.run(&|m| {
                    counts[m].fetch_add(1, SeqCst);
                    let part = data.len() / size;
                    let sum: usize = data[m * part..(m + 1) * part].iter().sum();
                    out.fetch_add(sum, SeqCst);
                });
                assert!(counts.iter().all(|c| c.load(SeqCst) == 1), "size {size}");
                let part = data.len() / size;
                assert_eq!(out.load(SeqCst), (round - 1) * part * size);
                data.iter_mut().for_each(|v| *v += 1);
            }
        }
    }

    #[test]
    fn parts_cover_the_data_once_in_whole_rows() {
        for size in [1, 2, 3] {
            let team = Team::new(size);
            for (len, align) in [(0, 4), (7, 1), (12, 4), (30, 5), (1000, 10)] {
                let mut data = vec![0f32; len];
                team.for_each_part(&mut data, align, 0, &|part, offset| {
                    assert_eq!(offset % align, 0);
                    for (i, v) in part.iter_mut().enumerate() {
                        *v += (offset + i) as f32;
                    }
                });
                let want: Vec<f32> = (0..len).map(|i| i as f32).collect();
                assert_eq!(data, want, "size {size} len {len}");
            }
        }
    }

    #[test]
    fn parked_helpers_wake_for_the_next_job() {
        let team = Team::new(2);
        let hits = AtomicUsize::new(0);
        for _ in 0..3 {
            // Long enough for the helper to give up spinning and park.
            std::thread::sleep(std::time::Duration::from_millis(50));
            team.run(&|_| {
                hits.fetch_add(1, SeqCst);
            });
        }
        assert_eq!(hits.load(SeqCst), 6);
    }

    /// The message of a caught panic.
    fn message(payload: Box<dyn std::any::Any + Send>) -> String {
        match payload.downcast::<String>() {
            Ok(s) => *s,
            Err(p) => p.downcast_ref::<&str>().copied().unwrap_or("?").to_string(),
        }
    }

    /// Runs `job` on `team`, returning its panic's message if it panicked.
    fn run_catching(team: &Team, job: &(dyn Fn(usize) + Sync)) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| team.run(job)))
            .err()
            .map(message)
    }

    /// Job 2 runs every member once and nothing else.
    fn assert_next_job_runs(team: &Team) {
        let hits = AtomicUsize::new(0);
        team.run(&|_| {
            hits.fetch_add(1, SeqCst);
        });
        assert_eq!(hits.load(SeqCst), team.size());
    }

    #[test]
    fn a_helper_panic_reaches_the_caller_and_the_team_still_works() {
        let team = Team::new(2);
        let msg = run_catching(&team, &|m| {
            if m == 1 {
                panic!("boom");
            }
        });
        let msg = msg.expect("the helper's panic is re-raised");
        assert!(msg.contains("thread 1") && msg.contains("boom"), "{msg}");
        assert_next_job_runs(&team);
    }

    #[test]
    fn a_panic_of_member_0_reaches_the_caller_and_the_team_still_works() {
        for size in [1, 2, 3] {
            let team = Team::new(size);
            let msg = run_catching(&team, &|m| {
                if m == 0 {
                    panic!("own share");
                }
            });
            assert_eq!(msg.as_deref(), Some("own share"), "size {size}");
            assert_next_job_runs(&team);
        }
    }

    #[test]
    fn a_job_where_every_member_panics_leaves_no_stale_panic_for_the_next() {
        // Member 0's panic unwinds past the point where the helpers' panic used to be
        // cleared: job 2 then failed with "a compute thread panicked" though none had.
        let team = Team::new(3);
        for _ in 0..2 {
            let msg = run_catching(&team, &|m| panic!("member {m}"));
            assert_eq!(msg.as_deref(), Some("member 0"));
            assert_next_job_runs(&team);
        }
    }
}
