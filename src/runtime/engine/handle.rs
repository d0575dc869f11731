//! The client side of a running engine: [`EngineHandle`] checks each request against the
//! model and the queue, then passes it to the leading rank, and implements [`Serving`].

use super::api::{EventSink, GenRequest, ModelInfo, RequestId, Serving, SubmitError};
use super::driver::{Command, Shared};
use super::metrics::Metrics;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Limits the handle checks before a request reaches the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Requests waiting (not yet running) at most; more are refused with `QueueFull`.
    pub max_waiting: usize,
    pub block_size: usize,
    pub blocks: usize,
}

/// A handle on a running engine; cheap to share between server tasks.
pub struct EngineHandle {
    info: ModelInfo,
    admission: Admission,
    commands: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    registry: Arc<prometheus::Registry>,
    /// The scheduler's gauge, set before any client hears that a request ended.
    kv_blocks_in_use: prometheus::IntGauge,
}

impl EngineHandle {
    pub fn new(
        info: ModelInfo,
        admission: Admission,
        commands: Sender<Command>,
        shared: Arc<Shared>,
        metrics: &Metrics,
    ) -> EngineHandle {
        EngineHandle {
            info,
            admission,
            commands: Mutex::new(commands),
            shared,
            next_id: AtomicU64::new(1),
            registry: metrics.registry.clone(),
            kv_blocks_in_use: metrics.kv_blocks_in_use.clone(),
        }
    }

    /// KV blocks some request reads now.
    pub fn blocks_in_use(&self) -> usize {
        usize::try_from(self.kv_blocks_in_use.get()).unwrap_or(0)
    }

    fn send(&self, command: Command) -> Result<(), SubmitError> {
        let tx = self.commands.lock().map_err(|_| self.stopped())?;
        tx.send(command).map_err(|_| self.stopped())
    }

    /// Why the engine takes no requests any more.
    fn stopped(&self) -> SubmitError {
        let why = self
            .shared
            .stopped
            .lock()
            .ok()
            .and_then(|s| s.clone())
            .unwrap_or_else(|| "its ranks are gone".into());
        SubmitError::Stopped(why)
    }

    /// The request is one the model and the pool can run.
    fn check(&self, r: &GenRequest) -> Result<(), SubmitError> {
        if r.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        let vocab = self.info.vocab;
        if let Some((position, &id)) = r
            .prompt
            .iter()
            .enumerate()
            .find(|&(_, &id)| id < 0 || id as u64 >= vocab)
        {
            return Err(SubmitError::TokenOutOfRange {
                id,
                position,
                vocab,
            });
        }
        if r.prompt.len() >= self.info.context {
            return Err(SubmitError::PromptTooLong {
                prompt: r.prompt.len(),
                context: self.info.context,
            });
        }
        // The prompt and its first token's position must fit in the pool alone.
        let needed = (r.prompt.len() + 1).div_ceil(self.admission.block_size.max(1));
        if needed > self.admission.blocks {
            return Err(SubmitError::PoolTooSmall {
                needed,
                total: self.admission.blocks,
            });
        }
        Ok(())
    }
}

impl Serving for EngineHandle {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn submit(&self, request: GenRequest, sink: EventSink) -> Result<RequestId, SubmitError> {
        if self.shared.draining.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if self
            .shared
            .stopped
            .lock()
            .map(|s| s.is_some())
            .unwrap_or(true)
        {
            return Err(self.stopped());
        }
        self.check(&request)?;
        let waiting = self.shared.waiting.load(Ordering::Acquire)
            + self.shared.pending.load(Ordering::Acquire);
        if waiting >= self.admission.max_waiting {
            return Err(SubmitError::QueueFull { waiting });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.pending.fetch_add(1, Ordering::AcqRel);
        let sent = self.send(Command::Submit {
            id,
            request,
            sink,
            arrived: Instant::now(),
        });
        if sent.is_err() {
            self.shared.pending.fetch_sub(1, Ordering::AcqRel);
        }
        sent.map(|()| id)
    }

    fn cancel(&self, id: RequestId) {
        let _ = self.send(Command::Cancel(id));
    }

    fn drain(&self) {
        self.shared.draining.store(true, Ordering::Release);
        let _ = self.send(Command::Drain);
    }

    fn load(&self) -> (usize, usize) {
        (
            self.shared.running.load(Ordering::Acquire),
            self.shared.waiting.load(Ordering::Acquire)
                + self.shared.pending.load(Ordering::Acquire),
        )
    }

    fn registry(&self) -> Arc<prometheus::Registry> {
        self.registry.clone()
    }
}
