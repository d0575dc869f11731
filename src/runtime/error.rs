//! The runtime's errors: everything that can go wrong running a plan. Compile-layer errors
//! (a model file, a config, a saved plan's text) come through [`RunError::Input`].

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Input(#[from] crate::error::TpcError),

    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),

    #[error(transparent)]
    Weights(#[from] super::weights::WeightError),
    #[error(transparent)]
    Kernel(#[from] crate::runtime::cpu::isa::KernelError),

    /// A device backend's own failure before or outside any instruction (the CUDA backend: a
    /// missing library or device, a kernel that did not compile). Each backend converts its
    /// error type into this, so the generic error names no device.
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync + 'static>),

    /// `--device cuda` where this tpc cannot run it.
    #[error("{0}")]
    DeviceUnavailable(String),

    /// Ranks as MPI processes: the layout, the MPI library, or a result that did not arrive.
    #[error("ranks as processes: {0}")]
    Processes(String),

    /// MPI ranks started with different arguments or given different model files: every
    /// rank finds the same differences, before anything is loaded.
    #[error(transparent)]
    RanksDisagree(#[from] super::agreement::Disagreement),

    /// Data-parallel replicas (`--dp`): a bad count, or which replica failed.
    #[error("data parallelism: {0}")]
    Replicas(String),

    /// Experts dealt over replicas (`--ep`): a replica that stopped, which the others
    /// waiting on its experts learn of.
    #[error("expert parallelism over replicas: {0}")]
    ExpertExchange(#[from] super::expert_exchange::ExchangeError),

    #[error(
        "prompt token id {id} at position {position} is outside the vocabulary of {vocab} tokens"
    )]
    TokenOutOfRange {
        id: i64,
        position: usize,
        vocab: u64,
    },

    #[error("the prompt is empty; give at least one token id")]
    EmptyPrompt,

    #[error(transparent)]
    Comm(#[from] super::comm::CommError),

    #[error("rank {rank} failed: {message}")]
    RankPanicked { rank: usize, message: String },

    // `error` is in the message and deliberately not a `source` (no second copy in chains).
    #[error("instruction `{name}`: {error}")]
    Backend {
        name: String,
        error: super::backend::BackendError,
    },

    #[error("{0}")]
    Collective(super::collectives::CollectiveError),

    #[error(
        "tp={tp} ranks cannot run as threads of one process: at most {max}; choose a smaller tp"
    )]
    TooManyRanks { tp: usize, max: usize },

    #[error("{}", non_finite_message(*sequence, step, origin.as_ref()))]
    NonFiniteLogits {
        sequence: usize,
        /// "the prompt" or "decode step N".
        step: String,
        /// The first op whose output was not finite when the tokens were recomputed.
        origin: Option<NonFiniteOp>,
    },

    #[error("the run needs at least {} (weights on all ranks {}, KV cache {}), and this host has {} available; use a smaller model, --dtype bf16 (half the bytes of f32 weights), or shorter or fewer prompts", gib(*needed), gib(*weights), gib(*kv), gib(*available))]
    OutOfMemory {
        needed: u64,
        weights: u64,
        kv: u64,
        available: u64,
    },

    // `io` is in the message and deliberately not a `source` (no second copy in chains).
    #[error("rank {rank}: the system refused to start its {threads} compute threads ({io}); lower --threads-per-rank or the tp")]
    Threads {
        rank: usize,
        threads: usize,
        io: std::io::Error,
    },

    #[error("pipeline stages: {0}")]
    Pipeline(String),

    #[error("bad batch: {problem}")]
    BadBatch { problem: String },

    #[error("request {request}: a prompt of {prompt} tokens plus {new_tokens} new tokens needs more than the model's {max_positions} positions (max_position_embeddings); shorten the prompt or lower --max-new-tokens")]
    TooLong {
        request: usize,
        prompt: usize,
        new_tokens: usize,
        max_positions: u64,
    },

    #[error("repetition {repetition} generated other tokens than the first timed one: the runtime is not deterministic; this is a bug in tpc")]
    NotDeterministic { repetition: usize },

    #[error("plan instruction `{name}` cannot run: {problem}. This plan does not fit this runtime; recompile it with this tpc.")]
    BadInstruction { name: String, problem: String },
}

/// A communicator's failure keeps its own variant, so a peer's echo of another rank's
/// failure (`CommError::PeerFailed`) can be told from the root cause.
impl From<super::collectives::CollectiveError> for RunError {
    fn from(e: super::collectives::CollectiveError) -> RunError {
        match e {
            super::collectives::CollectiveError::Comm(c) => RunError::Comm(c),
            other => RunError::Collective(other),
        }
    }
}

pub type Result<T, E = RunError> = std::result::Result<T, E>;

/// Where non-finite values first appear in a rank's program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteOp {
    pub rank: usize,
    /// Position in the rank's program (equal across ranks for the same op).
    pub index: usize,
    pub name: String,
    pub kind: &'static str,
    pub layer: Option<u32>,
}

fn non_finite_message(sequence: usize, step: &str, origin: Option<&NonFiniteOp>) -> String {
    let head = format!(
        "the logits of sequence {sequence} at {step} are not finite (NaN or infinite), so no token can be chosen; generation stopped"
    );
    match origin {
        Some(o) => format!(
            "{head}. The first op producing non-finite values is `{}` ({}{}) on rank {}: check the checkpoint's weights feeding it and the model's eps",
            o.name,
            o.kind,
            o.layer.map_or_else(String::new, |l| format!(", layer {l}")),
            o.rank
        ),
        None => format!(
            "{head}. Recomputing the tokens op by op found no non-finite value, so the origin is not known"
        ),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}
