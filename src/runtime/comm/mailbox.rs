//! Point-to-point messages of the in-process group: one inbox per receiving rank.
//!
//! A message is copied into a buffer the group owns, so `send` returns at once and the
//! sender's memory is never read by another thread. Messages from one sender are taken in
//! the order they were delivered; messages from different senders do not wait for each
//! other. Buffers come back to their sender after the receiver has copied them out, so a
//! steady exchange of same-sized messages allocates nothing.
//!
//! A receiver spins and yields briefly (the group's [`Backoff`]), then parks on a condition
//! variable. A failure anywhere in the group wakes it: the group records the failure first
//! and then calls [`Mailbox::wake`] on every inbox; a receiver checks for a failure under
//! its inbox's lock before it parks, so the wake-up cannot be lost.
//!
//! A message already delivered is taken even after a failure: what a rank sent before it
//! failed (or finished and dropped its communicator) was complete when sent, and whether
//! the receiver got it must not depend on how late the receiver asked.

use super::barrier::{Backoff, Failure};
use super::private::Owned;
use super::Element;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// At most this many returned buffers are kept per sender; more are freed.
const SPARES_PER_SENDER: usize = 4;

/// The inbox of one rank.
pub(super) struct Mailbox {
    inbox: Mutex<Inbox>,
    cv: Condvar,
    /// Messages ever delivered here: what a spinning receiver watches.
    delivered: AtomicU64,
    backoff: Backoff,
}

#[derive(Default)]
struct Inbox {
    /// Undelivered messages and their senders, oldest first.
    queue: VecDeque<(usize, Owned)>,
    /// Whether the receiver is parked on `cv` (only the owning rank receives).
    parked: bool,
}

impl Mailbox {
    pub(super) fn new(backoff: Backoff) -> Self {
        Mailbox {
            inbox: Mutex::new(Inbox::default()),
            cv: Condvar::new(),
            delivered: AtomicU64::new(0),
            backoff,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends a message from `from` and wakes the receiver if it is parked.
    pub(super) fn deliver(&self, from: usize, data: Owned) {
        let mut inbox = self.lock();
        inbox.queue.push_back((from, data));
        self.delivered.fetch_add(1, SeqCst);
        if inbox.parked {
            self.cv.notify_one();
        }
    }

    /// Removes and returns the oldest message from `from`, waiting for one while `failure()`
    /// reports none; `Err` with the failure once one is recorded and no message from `from`
    /// is waiting.
    pub(super) fn take(
        &self,
        from: usize,
        failure: impl Fn() -> Option<Failure>,
    ) -> Result<Owned, Failure> {
        let mut seen = None;
        let polled = self.backoff.poll(|| {
            let now = self.delivered.load(SeqCst);
            if seen == Some(now) && failure().is_none() {
                return None;
            }
            seen = Some(now);
            Self::try_take(&mut self.lock(), from, &failure)
        });
        if let Some(outcome) = polled {
            return outcome;
        }
        let mut inbox = self.lock();
        loop {
            if let Some(outcome) = Self::try_take(&mut inbox, from, &failure) {
                return outcome;
            }
            inbox.parked = true;
            inbox = self.cv.wait(inbox).unwrap_or_else(PoisonError::into_inner);
            inbox.parked = false;
        }
    }

    fn try_take(
        inbox: &mut Inbox,
        from: usize,
        failure: &impl Fn() -> Option<Failure>,
    ) -> Option<Result<Owned, Failure>> {
        match inbox.queue.iter().position(|(sender, _)| *sender == from) {
            Some(at) => inbox.queue.remove(at).map(|(_, data)| Ok(data)),
            None => failure().map(Err),
        }
    }

    /// Wakes a parked receiver so it sees a failure the group has just recorded.
    pub(super) fn wake(&self) {
        // Taking the lock orders this after the receiver's check (see the module docs).
        let inbox = self.lock();
        if inbox.parked {
            self.cv.notify_all();
        }
    }
}

/// Emptied message buffers of one sender, for its next messages.
#[derive(Default)]
pub(super) struct Spares(Mutex<Vec<Owned>>);

impl Spares {
    /// A kept buffer of `T` (empty if there is none).
    pub(super) fn take<T: Element>(&self) -> Vec<T> {
        let mut spares = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match spares.iter().position(|s| s.dtype() == T::DTYPE) {
            // Never the default: the buffer holds `T`.
            Some(at) => T::from_owned(spares.swap_remove(at)).unwrap_or_default(),
            None => Vec::new(),
        }
    }

    pub(super) fn give(&self, buf: Owned) {
        let mut spares = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if spares.len() < SPARES_PER_SENDER {
            spares.push(buf);
        }
    }
}
