//! The engine loop on each rank. The leading rank takes requests from its handle between
//! steps, asks the scheduler for the next step, sends it to the other ranks and runs it with
//! them; every other rank receives each step and runs it. A failing step fails every
//! request and stops every rank; a drained engine stops when its last request ends.
//!
//! A replica whose experts are dealt over the replicas (`--ep`) must answer the others'
//! mixture-of-experts rounds whenever it has nothing of its own to run: between requests
//! it waits for a command or for such a call, whichever comes first, and once drained it
//! answers until every replica is done.

use super::api::{EventSink, GenRequest, RequestId};
use super::scheduler::{Scheduler, StepOutput};
use super::step::{Exchange, PlannedSeq, StepMessage};
use crate::runtime::error::{Result, RunError};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an idle replica sharing its experts waits for the others' calls before it looks
/// for a command again: a new request waits at most this long (calls wake it at once).
pub(crate) const IDLE_CALL_WAIT: Duration = Duration::from_millis(2);

/// What one rank does in a step, over its executor and communicators.
pub trait StepRunner {
    /// The leading rank sends `message` to every other rank and gets it back; another
    /// rank (`message` is `None`) receives the leading rank's.
    fn share(&mut self, message: Option<&StepMessage>) -> Result<StepMessage>;
    /// Runs one step on this rank; the leading rank gets its output.
    fn run(&mut self, seqs: &[PlannedSeq], exchange: Exchange) -> Result<Option<StepOutput>>;
    /// Every rank together recomputes `tokens`, the history of request `sequence` whose
    /// logits at `step` are not finite, and returns the error that names the op they come
    /// from.
    fn locate(&mut self, sequence: usize, step: usize, tokens: &[i64]) -> RunError;
    /// Whether this rank's experts are dealt over the replicas (`--ep`), so that it must
    /// answer the others' calls while it has nothing to run.
    fn shares_experts(&self) -> bool {
        false
    }
    /// Waits up to `timeout` for another replica to call on this one's experts; whether
    /// one has.
    fn wait_for_expert_call(&mut self, _timeout: Duration) -> Result<bool> {
        Ok(false)
    }
    /// Answers one forward call of the other replicas with this rank's experts (`done`:
    /// until every replica is done, this one having no requests again).
    fn answer_experts(&mut self, _done: bool) -> Result<()> {
        Ok(())
    }
    /// The leading rank of a replica sharing its experts is about to run a forward call
    /// (replicas as processes tick first: [`super::ticks`]).
    fn before_forward(&mut self) -> Result<()> {
        Ok(())
    }
    /// The leading rank of a drained replica sharing its experts: every rank of it answers
    /// the others' calls until every replica is done.
    fn answer_until_all_done(&mut self) -> Result<()> {
        answer_experts(self, true)
    }
}

/// What the handle asks of the leading rank.
pub enum Command {
    Submit {
        id: RequestId,
        request: GenRequest,
        sink: EventSink,
        arrived: Instant,
    },
    Cancel(RequestId),
    /// Take no more requests; stop when the last one ends.
    Drain,
}

/// What the leading rank publishes for the handle.
#[derive(Debug, Default)]
pub struct Shared {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Submitted requests the leading rank has not taken yet.
    pub pending: AtomicUsize,
    pub draining: AtomicBool,
    /// Why the engine stopped, once it has.
    pub stopped: Mutex<Option<String>>,
}

impl Shared {
    fn publish(&self, scheduler: &Scheduler) {
        let (running, waiting) = scheduler.load();
        self.running.store(running, Ordering::Release);
        self.waiting.store(waiting, Ordering::Release);
    }

    pub(crate) fn stop(&self, why: String) {
        if let Ok(mut s) = self.stopped.lock() {
            s.get_or_insert(why);
        }
    }
}

/// The leading rank's loop: runs until drained (or every handle is gone) and idle.
pub fn lead<R: StepRunner>(
    runner: &mut R,
    scheduler: &mut Scheduler,
    commands: &Receiver<Command>,
    shared: &Shared,
) -> Result<()> {
    let outcome = lead_steps(runner, scheduler, commands, shared);
    let why = match &outcome {
        Ok(()) => "it was shut down".to_string(),
        Err(e) => e.to_string(),
    };
    scheduler.fail_all(&format!("the engine stopped: {why}"));
    shared.publish(scheduler);
    shared.stop(why);
    // Requests that arrive now are failed too.
    while let Ok(c) = commands.try_recv() {
        if let Command::Submit { mut sink, .. } = c {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            sink(super::api::Event::Failed {
                message: "the engine has stopped".into(),
            });
        }
    }
    if outcome.is_ok() {
        runner.share(Some(&StepMessage::Stop))?;
    }
    outcome
}

fn lead_steps<R: StepRunner>(
    runner: &mut R,
    scheduler: &mut Scheduler,
    commands: &Receiver<Command>,
    shared: &Shared,
) -> Result<()> {
    let mut open = true;
    loop {
        if scheduler.is_idle() {
            if !open || shared.draining.load(Ordering::Acquire) {
                if runner.shares_experts() {
                    // The other replicas may still call on this one's experts.
                    runner.answer_until_all_done()?;
                }
                return Ok(());
            }
            if runner.shares_experts() {
                // Nothing to run: answer the other replicas' calls until a command comes.
                open = idle_answering(runner, scheduler, commands, shared)?;
            } else {
                // Nothing to run: sleep until a command comes.
                match commands.recv() {
                    Ok(c) => apply(c, scheduler, shared),
                    Err(_) => open = false,
                }
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => apply(c, scheduler, shared),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let Some(message) = scheduler.schedule() else {
            shared.publish(scheduler);
            if scheduler.is_idle() {
                continue;
            }
            return Err(RunError::BadInstruction {
                name: "engine".into(),
                problem: "requests wait but none can be scheduled (a bug in tpc)".into(),
            });
        };
        shared.publish(scheduler);
        if runner.shares_experts() && matches!(message, StepMessage::Step { .. }) {
            runner.before_forward()?;
        }
        runner.share(Some(&message))?;
        let StepMessage::Step { seqs, exchange } = &message else {
            continue;
        };
        let output = runner
            .run(seqs, *exchange)?
            .ok_or_else(|| RunError::BadInstruction {
                name: "engine".into(),
                problem: "the leading rank computed no output (a bug in tpc)".into(),
            })?;
        scheduler.complete(output, Instant::now());
        shared.publish(scheduler);
    }
}

/// Every rank of this replica answers one forward call of the others (`done`: all of
/// them, until every replica is done).
pub(crate) fn answer_experts<R: StepRunner + ?Sized>(runner: &mut R, done: bool) -> Result<()> {
    let message = StepMessage::Answer { done };
    runner.share(Some(&message))?;
    runner.answer_experts(done)
}

/// An idle replica that shares its experts: answers the others' calls until a command comes
/// (applied) or every handle is gone (false: the engine is closed).
fn idle_answering<R: StepRunner>(
    runner: &mut R,
    scheduler: &mut Scheduler,
    commands: &Receiver<Command>,
    shared: &Shared,
) -> Result<bool> {
    loop {
        match commands.try_recv() {
            Ok(c) => {
                apply(c, scheduler, shared);
                return Ok(true);
            }
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return Ok(false),
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if runner.wait_for_expert_call(IDLE_CALL_WAIT)? {
            answer_experts(runner, false)?;
        }
    }
}

fn apply(command: Command, scheduler: &mut Scheduler, shared: &Shared) {
    match command {
        Command::Submit {
            id,
            request,
            sink,
            arrived,
        } => {
            shared.pending.fetch_sub(1, Ordering::AcqRel);
            scheduler.add(id, request, sink, arrived);
        }
        Command::Cancel(id) => scheduler.cancel(id),
        Command::Drain => shared.draining.store(true, Ordering::Release),
    }
}

/// Every other rank's loop: runs the steps it is sent until told to stop.
pub fn follow<R: StepRunner>(runner: &mut R) -> Result<()> {
    loop {
        match runner.share(None)? {
            StepMessage::Stop => return Ok(()),
            StepMessage::Step { seqs, exchange } => {
                runner.run(&seqs, exchange)?;
            }
            StepMessage::Answer { done } => runner.answer_experts(done)?,
            StepMessage::Locate {
                sequence,
                step,
                tokens,
            } => return Err(runner.locate(sequence, step, &tokens)),
        }
    }
}
