//! The engine loop on each rank. The leading rank takes requests from its handle between
//! steps, asks the scheduler for the next step, sends it to the other ranks and runs it with
//! them; every other rank receives each step and runs it. A failing step fails every
//! request and stops every rank; a drained engine stops when its last request ends.

use super::api::{EventSink, GenRequest, RequestId};
use super::scheduler::{Scheduler, StepOutput};
use super::step::{Exchange, PlannedSeq, StepMessage};
use crate::runtime::error::{Result, RunError};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Mutex;
use std::time::Instant;

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
                return Ok(());
            }
            // Nothing to run: sleep until a command comes.
            match commands.recv() {
                Ok(c) => apply(c, scheduler, shared),
                Err(_) => open = false,
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
            StepMessage::Locate {
                sequence,
                step,
                tokens,
            } => return Err(runner.locate(sequence, step, &tokens)),
        }
    }
}
