//! What a client of the serving engine sees: requests in, a stream of events out per request,
//! cancellation, and the engine's metrics. The HTTP server (`crate::serve`) and `tpc run`
//! talk to the engine only through [`Serving`], so the server is tested over a stand-in
//! engine and the engine without a server.

use crate::runtime::sampling::Sampling;
use std::sync::Arc;

/// The engine's name for one request, unique for its lifetime.
pub type RequestId = u64;

/// One generation request, already tokenized and validated by the caller's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<i64>,
    /// New tokens at most (the engine also stops at the model's context).
    pub max_tokens: usize,
    /// Stop ids are ignored until this many tokens are generated.
    pub min_tokens: usize,
    pub sampling: Sampling,
    /// Generation ends when one of these is generated (the model's EOS unless the client
    /// said otherwise); the stop token is reported, as OpenAI's servers do not return it in
    /// text but count it.
    pub stop_ids: Vec<i64>,
    /// `Some(k)`: report each chosen token's log-probability and the `k` most likely tokens
    /// at that step (`k` may be 0).
    pub logprobs: Option<usize>,
}

/// Log-probabilities at one generated position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability (under the temperature-free distribution).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(i64, f32)>,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop id was generated.
    Stop,
    /// `max_tokens` or the model's context was reached.
    Length,
    /// The client cancelled it (a disconnect, a stop string found by the caller).
    Cancelled,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

/// What the engine tells a request's sink, in order: tokens, then exactly one `Finished` or
/// `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        id: i64,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The engine could not run the request (it has stopped, or a rank failed).
    Failed {
        message: String,
    },
}

/// Where a request's events go. Called on the engine's thread: it must not block (push
/// into a channel).
pub type EventSink = Box<dyn FnMut(Event) + Send>;

/// Why a request was not admitted. Each message names the problem and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty; give at least one token")]
    EmptyPrompt,
    #[error(
        "token id {id} at prompt position {position} is outside the vocabulary of {vocab} tokens"
    )]
    TokenOutOfRange {
        id: i64,
        position: usize,
        vocab: u64,
    },
    #[error(
        "the prompt has {prompt} tokens and the model's context is {context}; shorten the prompt"
    )]
    PromptTooLong { prompt: usize, context: usize },
    #[error("the prompt needs {needed} KV-cache blocks and the pool has {total}; shorten the prompt or give more --kv-cache-memory")]
    PoolTooSmall { needed: usize, total: usize },
    #[error("{waiting} requests are waiting already (--max-waiting); retry later")]
    QueueFull { waiting: usize },
    #[error("the engine is shutting down and takes no new requests")]
    ShuttingDown,
    #[error("the engine has stopped: {0}")]
    Stopped(String),
}

/// The model an engine serves, as clients see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name clients give as `model` (the model folder's name unless set).
    pub name: String,
    pub vocab: u64,
    /// Prompt plus generated tokens a request may reach.
    pub context: usize,
}

/// A serving engine as its clients use it. `submit` returns at once; the events arrive on
/// the sink from the engine's thread.
pub trait Serving: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn submit(&self, request: GenRequest, sink: EventSink) -> Result<RequestId, SubmitError>;
    /// Ends a request early: its sink gets `Finished { reason: Cancelled }` (unless it had
    /// finished already) and its KV blocks are freed. Unknown ids are ignored.
    fn cancel(&self, id: RequestId);
    /// Stops taking requests; those running finish. Returns at once.
    fn drain(&self);
    /// Running and waiting requests (0 and 0: drained).
    fn load(&self) -> (usize, usize);
    /// The engine's metrics registry (Prometheus), for `/metrics`.
    fn registry(&self) -> Arc<prometheus::Registry>;
}
