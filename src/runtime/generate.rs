//! What a generation is (requests, options, results, the checks before any weight is read)
//! and one rank that runs it: [`rank_runtime`] / [`stage_runtime`] build a [`RankRuntime`]
//! for any backend and communicator. Its `generate` (in `engine/batch.rs`) runs `tpc run`'s
//! batch through the serving engine.

use super::backend::Backend;
use super::collectives::{AllReduceTally, Collectives};
use super::cpu::isa::LinearKernels;
pub use super::device::Device;
use super::error::{Result, RunError};
use super::executor::{OpTime, RankExecutor};
use super::sampling::Sampling;
use super::stage_link::StageLink;
use super::tensor::Tensor;
use super::weights::WeightSource;
use crate::ir::Op;
use crate::plan::stages::StageProgram;
use crate::plan::Plan;
use std::time::Instant;

/// What rank 0 reports while it runs (for progress bars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Loaded,
    Prefilled,
    /// Tokens generated so far over the batch.
    Token(usize),
}

pub type Progress = std::sync::Arc<dyn Fn(Stage) + Send + Sync>;

/// Called by rank 0 when a sequence of the (last timed) generation is finished: its index
/// in the requests and its tokens, so results can stream out before the batch ends.
pub type OnFinished = std::sync::Arc<dyn Fn(usize, &[i64]) + Send + Sync>;

/// The compute type: `Auto` follows the checkpoint (bf16 checkpoints keep bf16 weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    #[default]
    Auto,
    /// Weights widened to f32 in memory.
    F32,
    /// Linear weights kept as bf16 in memory; f32 activations and accumulation.
    Bf16,
}

impl ComputeDtype {
    pub fn bf16_linears(self, plan: &Plan) -> bool {
        match self {
            ComputeDtype::Auto => plan.dtype == crate::ir::DType::Bf16,
            ComputeDtype::F32 => false,
            ComputeDtype::Bf16 => true,
        }
    }
}

#[derive(Clone)]
pub struct RunOptions {
    /// Where the ranks compute (`--device`) and that device's own settings: the CPU's
    /// kernels and threads, or GPUs (feature `cuda`).
    pub device: Device,
    pub dtype: ComputeDtype,
    /// New tokens per sequence unless its request says otherwise.
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Stop when one of these is generated.
    pub eos: Vec<i64>,
    /// Time every op kind on rank 0.
    pub profile: bool,
    /// Keep the logits of every prompt position (`--dump-logits`, parity checks); otherwise
    /// the LM head runs on the last position only, the one generation needs.
    pub all_prompt_logits: bool,
    /// Decode steps gather the whole logits and pick on the host, even where exchanging each
    /// rank's candidates would do (greedy decoding: its argmax; `--top-k K` sampling: its K
    /// best). The tokens are the same; for comparisons and tests (`tpc run --gather-logits`).
    pub gather_logits: bool,
    /// Untimed generations before the timed ones (same prompts, caches reset each time).
    pub warmup: usize,
    /// Timed generations (at least 1); the best prefill and decode times are reported.
    pub repeat: usize,
    pub progress: Option<Progress>,
    pub on_finished: Option<OnFinished>,
    /// `--ep`: with data-parallel replicas, deal each tp rank's experts over the replicas
    /// (its DP group) instead of every replica holding them all.
    pub expert_parallel: bool,
    /// This replica's seat in the EP group, set by the replica launcher under `--ep`.
    pub expert_seat: Option<super::expert_exchange::ExpertSeat>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("max_new_tokens", &self.max_new_tokens)
            .field("sampling", &self.sampling)
            .field("eos", &self.eos)
            .field("all_prompt_logits", &self.all_prompt_logits)
            .field("gather_logits", &self.gather_logits)
            .field("warmup", &self.warmup)
            .field("repeat", &self.repeat)
            .field("expert_parallel", &self.expert_parallel)
            .finish()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            device: Device::default(),
            dtype: ComputeDtype::Auto,
            max_new_tokens: 16,
            sampling: Sampling::default(),
            eos: vec![],
            profile: false,
            all_prompt_logits: true,
            gather_logits: false,
            warmup: 0,
            repeat: 1,
            progress: None,
            on_finished: None,
            expert_parallel: false,
            expert_seat: None,
        }
    }
}

/// One sequence to generate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub prompt: Vec<i64>,
    /// New tokens for this sequence; `None`: the run's `max_new_tokens`.
    pub max_new_tokens: Option<usize>,
}

/// What one sequence produced.
#[derive(Debug, Clone)]
pub struct SequenceOutput {
    pub generated: Vec<i64>,
    /// Logits of the prompt, `[prompt_len, vocab]` (`[1, vocab]`, the last position, unless
    /// `all_prompt_logits`), padding removed.
    pub prompt_logits: Tensor,
}

/// A batch's results, in request order, with the leading rank's figures (rank 0; tp
/// rank 0 of the last stage in a pipeline).
#[derive(Debug, Clone, Default)]
pub struct BatchOutput {
    pub sequences: Vec<SequenceOutput>,
    pub prompt_tokens: usize,
    pub load_seconds: f64,
    pub prefill_seconds: f64,
    /// Wall time of the decode steps after the first new tokens.
    pub decode_seconds: f64,
    /// Bytes of collective messages rank 0 sent in the (last timed) generation.
    pub collective_bytes: u64,
    /// (token, expert) pairs each rank of the lead's tensor-parallel group computed in that
    /// generation, in rank order (its mixture-of-experts load); empty for a dense model.
    pub routed_pairs_per_rank: Vec<u64>,
    /// Rank 0's all-reduces in that generation, by the algorithm that ran.
    pub all_reduces: AllReduceTally,
    /// Bytes rank 0's weights occupy in its backend.
    pub weight_bytes: u64,
    /// Rank 0's time per op kind, largest first, when profiled.
    pub profile: Vec<(String, OpTime)>,
    /// Rank 0's profiled forward calls: [prefill, decode steps].
    pub profiled_steps: [u64; 2],
    /// The linear kernels the CPU ranks ran (set by the CPU launcher).
    pub linear_kernels: Option<LinearKernels>,
}

/// `tokens` over `seconds` (0 for no tokens).
fn rate(tokens: usize, seconds: f64) -> f64 {
    if tokens == 0 {
        0.0
    } else {
        tokens as f64 / seconds.max(1e-12)
    }
}

impl BatchOutput {
    pub fn generated_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.generated.len()).sum()
    }
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_seconds)
    }
    /// Tokens after each sequence's first new one, over the decode wall time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self
            .sequences
            .iter()
            .map(|s| s.generated.len().saturating_sub(1))
            .sum();
        rate(n, self.decode_seconds)
    }
}

/// The vocabulary size the plan's output has.
pub fn output_vocab(plan: &Plan) -> Option<u64> {
    plan.ranks
        .first()?
        .instrs
        .iter()
        .find(|i| matches!(i.op, Op::Output(_)))?
        .fact
        .shape
        .fixed_at(2)
}

/// The most sequences one batch may hold (each has its own KV caches).
pub const MAX_BATCH: usize = 4096;

/// [`output_vocab`], or the error a plan without one is.
pub fn plan_vocab(plan: &Plan) -> Result<u64> {
    output_vocab(plan).ok_or_else(|| RunError::BadInstruction {
        name: "output".into(),
        problem: "the plan's output has no vocabulary dim".into(),
    })
}

/// Prompt plus new tokens over every request: what the KV caches must hold.
pub fn total_tokens(requests: &[Request], opts: &RunOptions) -> u64 {
    crate::ir::saturating::sum(requests.iter().map(|r| {
        let new = r.max_new_tokens.unwrap_or(opts.max_new_tokens) as u64;
        (r.prompt.len() as u64).saturating_add(new)
    }))
}

/// Every request is runnable on `plan`: non-empty, ids inside the vocabulary, prompt plus
/// new tokens within the model's positions. Checked before any weight is read.
pub fn check_requests(plan: &Plan, requests: &[Request], opts: &RunOptions) -> Result<()> {
    if requests.is_empty() {
        return Err(RunError::EmptyPrompt);
    }
    if requests.len() > MAX_BATCH {
        return Err(RunError::BadBatch {
            problem: format!(
                "{} sequences; one batch takes at most {MAX_BATCH}: split the prompts into several runs",
                requests.len()
            ),
        });
    }
    let vocab = plan_vocab(plan)?;
    for (index, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(RunError::EmptyPrompt);
        }
        for (position, &id) in r.prompt.iter().enumerate() {
            if id < 0 || id as u64 >= vocab {
                return Err(RunError::TokenOutOfRange {
                    id,
                    position,
                    vocab,
                });
            }
        }
        let new = r.max_new_tokens.unwrap_or(opts.max_new_tokens);
        let tokens = (r.prompt.len() as u64).saturating_add(new as u64);
        if let Some(window) = plan.attention_window.filter(|&w| tokens > w) {
            return Err(
                crate::frontend::spec::window_error(plan.model.clone(), window, tokens).into(),
            );
        }
        if let Some(max) = plan.max_positions {
            // The last generated token is never fed back, so it needs no position.
            let needed = (r.prompt.len() as u64).saturating_add(new.saturating_sub(1) as u64);
            if needed > max {
                return Err(RunError::TooLong {
                    request: index,
                    prompt: r.prompt.len(),
                    new_tokens: new,
                    max_positions: max,
                });
            }
        }
    }
    Ok(())
}

/// One rank of a running plan: its program, backend, communicator and loaded weights.
pub struct RankRuntime<'p, B: Backend, C: Collectives<B::Act>> {
    pub exec: RankExecutor<'p, B, C>,
    /// The global rank.
    pub rank: usize,
    /// Whether this rank reports (progress, finished sequences, profile, the result): tp
    /// rank 0 of the last pipeline stage.
    pub leads: bool,
    pub load_seconds: f64,
}

/// The per-rank entry point: uploads rank `rank`'s weight slices of `plan` to `backend`.
/// Every launcher (threads, processes, GPUs) builds its ranks through this.
pub fn rank_runtime<'p, B: Backend, C: Collectives<B::Act>>(
    plan: &'p Plan,
    rank: usize,
    backend: B,
    comm: C,
    weights: &dyn WeightSource,
) -> Result<RankRuntime<'p, B, C>> {
    rank_runtime_sharing(plan, rank, backend, comm, weights, None)
}

/// [`rank_runtime`] for a rank whose experts are shared out over replicas (`--ep`): it
/// loads only those its seat `member` computes.
pub fn rank_runtime_sharing<'p, B: Backend, C: Collectives<B::Act>>(
    plan: &'p Plan,
    rank: usize,
    backend: B,
    comm: C,
    weights: &dyn WeightSource,
    member: Option<super::expert_exchange::ExpertMember>,
) -> Result<RankRuntime<'p, B, C>> {
    let program = plan
        .ranks
        .get(rank)
        .ok_or_else(|| RunError::BadInstruction {
            name: format!("rank {rank}"),
            problem: format!("the plan has {} ranks", plan.ranks.len()),
        })?;
    let load = Instant::now();
    let exec = RankExecutor::new_sharing(program, plan.numerics, weights, backend, comm, member)?;
    Ok(RankRuntime {
        exec,
        rank,
        leads: rank == 0,
        load_seconds: load.elapsed().as_secs_f64(),
    })
}

impl<B: Backend, C: Collectives<B::Act>> RankRuntime<'_, B, C> {
    /// [`RankRuntime::generate`] for a rank that shares its experts with other replicas
    /// (built with a seat in its DP group, `--ep`): once its own requests are done (it may
    /// have none), it answers the others' until all are; the load report is then each rank's
    /// (token, expert) pairs of one generation, its answers to the other replicas included.
    /// Without a seat, just `generate`.
    pub fn generate_in_expert_group(
        &mut self,
        requests: &[Request],
        opts: &RunOptions,
    ) -> Result<BatchOutput> {
        let Some(member) = self.exec.expert_member().cloned() else {
            return self.generate(requests, opts);
        };
        let mut guard = super::expert_exchange::LeaveUnlessDone(Some(member));
        let mut out = if requests.is_empty() {
            BatchOutput::default()
        } else {
            self.generate(requests, opts)?
        };
        self.exec.serve_expert_group()?;
        // Every generation routes the same tokens (a repeat that differs is refused), so the
        // run's pairs over its generations are one generation's.
        let runs = (opts.warmup + opts.repeat.max(1)) as u64;
        out.routed_pairs_per_rank = self
            .exec
            .gather_expert_loads(self.exec.routed_pairs / runs)?;
        guard.0 = None;
        Ok(out)
    }
}

/// [`rank_runtime`] for one stage of a pipeline: `sp`'s weight slices, `comm` its tp
/// group, `pipe` its PP group (this tp rank on every stage, ranked by stage).
pub fn stage_runtime<'p, B: Backend, C: Collectives<B::Act>>(
    sp: &'p StageProgram,
    backend: B,
    comm: C,
    pipe: C,
    weights: &dyn WeightSource,
) -> Result<RankRuntime<'p, B, C>> {
    stage_runtime_sharing(sp, backend, comm, pipe, weights, None)
}

/// [`stage_runtime`] for a stage whose experts are shared out over replicas (`--ep`): it
/// loads only those its seat `member` computes.
pub fn stage_runtime_sharing<'p, B: Backend, C: Collectives<B::Act>>(
    sp: &'p StageProgram,
    backend: B,
    comm: C,
    pipe: C,
    weights: &dyn WeightSource,
    member: Option<super::expert_exchange::ExpertMember>,
) -> Result<RankRuntime<'p, B, C>> {
    let load = Instant::now();
    let tp_rank = comm.rank();
    let link = StageLink {
        comm: pipe,
        stage: sp.stage,
        stages: sp.stages,
        recv: sp.recv.iter().map(|b| b.id).collect(),
        send: sp.send.iter().map(|b| b.id).collect(),
        origin: sp.origin.clone(),
    };
    let exec = RankExecutor::new_sharing(&sp.program, sp.numerics, weights, backend, comm, member)?
        .with_link(link);
    Ok(RankRuntime {
        exec,
        rank: usize::try_from(sp.program.rank).unwrap_or(usize::MAX),
        leads: tp_rank == 0 && sp.stage + 1 == sp.stages,
        load_seconds: load.elapsed().as_secs_f64(),
    })
}

/// Rank 0's profile as a table: op kind, seconds in prefill and in decode steps, the decode
/// time per step, share of the run, calls.
pub fn render_profile(out: &BatchOutput) -> String {
    use std::fmt::Write;
    let (prefill, decode) = out.profile.iter().fold((0.0, 0.0), |(p, d), (_, t)| {
        (p + t.seconds[0], d + t.seconds[1])
    });
    let total = prefill + decode;
    let steps = out.profiled_steps[1].max(1) as f64;
    let mut s = format!(
        "{:<16} {:>10} {:>10} {:>9} {:>7} {:>8}\n",
        "op (rank 0)", "prefill s", "decode s", "ms/step", "share", "calls"
    );
    let mut row = |kind: &str, prefill: f64, decode: f64, calls: u64| {
        let _ = writeln!(
            s,
            "{kind:<16} {prefill:>10.4} {decode:>10.4} {:>9.3} {:>6.1}% {calls:>8}",
            1e3 * decode / steps,
            100.0 * (prefill + decode) / total.max(1e-12)
        );
    };
    for (kind, t) in &out.profile {
        row(kind, t.seconds[0], t.seconds[1], t.calls[0] + t.calls[1]);
    }
    row(
        "all ops",
        prefill,
        decode,
        out.profiled_steps[0] + out.profiled_steps[1],
    );
    let _ = writeln!(
        s,
        "{} prefill calls, {} decode steps; wall time of the best run: prefill {:.4} s, decode {:.4} s",
        out.profiled_steps[0], out.profiled_steps[1], out.prefill_seconds, out.decode_seconds
    );
    if let Some(k) = out.linear_kernels {
        let _ = writeln!(s, "linear kernels: {k}");
    }
    s
}
