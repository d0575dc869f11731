//! Generation on one rank, for any backend and communicator: a batch of sequences is
//! prefilled in one ragged forward call, then decoded one token per live sequence per step;
//! finished sequences drop out. Every rank computes the same logits (bit-identical after
//! the gather), or the same merged argmax or top-k candidates when the ranks exchange those
//! instead, and so picks the same tokens with the same seed, without a broadcast.

use super::backend::Backend;
use super::collectives::{AllReduceTally, Collectives};
use super::cpu::isa::LinearKernels;
pub use super::device::Device;
use super::error::{Result, RunError};
use super::executor::{Candidates, OpTime, OutputRows, RankExecutor};
use super::sampling::{pick, pick_from_candidates, Rng, Sampling};
use super::stage_link::{Control, StageLink};
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
    let program = plan
        .ranks
        .get(rank)
        .ok_or_else(|| RunError::BadInstruction {
            name: format!("rank {rank}"),
            problem: format!("the plan has {} ranks", plan.ranks.len()),
        })?;
    let load = Instant::now();
    let exec = RankExecutor::new(program, weights, backend, comm)?;
    Ok(RankRuntime {
        exec,
        rank,
        leads: rank == 0,
        load_seconds: load.elapsed().as_secs_f64(),
    })
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
    let exec = RankExecutor::new(&sp.program, weights, backend, comm)?.with_link(link);
    Ok(RankRuntime {
        exec,
        rank: usize::try_from(sp.program.rank).unwrap_or(usize::MAX),
        leads: tp_rank == 0 && sp.stage + 1 == sp.stages,
        load_seconds: load.elapsed().as_secs_f64(),
    })
}

impl<B: Backend, C: Collectives<B::Act>> RankRuntime<'_, B, C> {
    /// Generates for every request (warm-ups and repetitions as `opts` says) and returns the
    /// best timings of the timed runs.
    pub fn generate(&mut self, requests: &[Request], opts: &RunOptions) -> Result<BatchOutput> {
        let leads = self.leads;
        let report = |stage| {
            if let (true, Some(p)) = (leads, &opts.progress) {
                p(stage)
            }
        };
        // Every rank has loaded before anything is timed.
        self.exec.comm.barrier()?;
        if let Some(link) = self.exec.link.as_mut() {
            link.comm.barrier()?;
        }
        if !self.exec.has_output() {
            self.follow(requests, opts)?;
            self.leave_together()?;
            return Ok(BatchOutput::default());
        }
        report(Stage::Loaded);
        if opts.profile && leads {
            self.exec.profile = Some(Default::default());
        }
        let mut best: Option<BatchOutput> = None;
        let runs = opts.warmup + opts.repeat.max(1);
        for run in 0..runs {
            if run == opts.warmup {
                // Profile the timed generations only.
                if let Some(p) = self.exec.profile.as_mut() {
                    p.clear();
                    self.exec.profiled_steps = [0; 2];
                }
            }
            let finished = |index: usize, tokens: &[i64]| {
                if let (true, true, Some(f)) = (leads, run + 1 == runs, &opts.on_finished) {
                    f(index, tokens)
                }
            };
            let out = generate_batch(&mut self.exec, requests, opts, &report, &finished)?;
            if run < opts.warmup {
                continue;
            }
            best = Some(match best {
                None => out,
                Some(b) => {
                    let same = b
                        .sequences
                        .iter()
                        .zip(&out.sequences)
                        .all(|(x, y)| x.generated == y.generated);
                    if !same {
                        return Err(RunError::NotDeterministic { repetition: run });
                    }
                    BatchOutput {
                        prefill_seconds: b.prefill_seconds.min(out.prefill_seconds),
                        decode_seconds: b.decode_seconds.min(out.decode_seconds),
                        ..out
                    }
                }
            });
        }
        self.leave_together()?;
        let mut out = best.ok_or(RunError::EmptyPrompt)?;
        out.load_seconds = self.load_seconds;
        out.weight_bytes = self.exec.weight_bytes;
        let mut profile: Vec<(String, OpTime)> = self
            .exec
            .profile
            .iter()
            .flatten()
            .map(|(k, t)| (k.to_string(), *t))
            .collect();
        let total = |t: &OpTime| t.seconds[0] + t.seconds[1];
        profile.sort_by(|a, b| total(&b.1).total_cmp(&total(&a.1)));
        out.profile = profile;
        out.profiled_steps = self.exec.profiled_steps;
        Ok(out)
    }

    /// Waits for every stage of the pipeline before this one returns: a stage that heard
    /// `Done` and dropped its link would otherwise fail a stage still waiting for its own
    /// `Done` (the last stage tells them one after another).
    fn leave_together(&mut self) -> Result<()> {
        if let Some(link) = self.exec.link.as_mut() {
            link.comm.barrier()?;
        }
        Ok(())
    }

    /// A pipeline stage before the last: runs the forward calls the last stage asks for
    /// (the prompts, then one call per decode step), as many generations as `opts` says.
    fn follow(&mut self, requests: &[Request], opts: &RunOptions) -> Result<()> {
        let exec = &mut self.exec;
        for _ in 0..opts.warmup + opts.repeat.max(1) {
            exec.reset();
            for (s, r) in requests.iter().enumerate() {
                let limit = r.max_new_tokens.unwrap_or(opts.max_new_tokens);
                exec.reserve(s, r.prompt.len().saturating_add(limit));
            }
            let batch: Vec<(usize, &[i64])> = requests
                .iter()
                .enumerate()
                .map(|(s, r)| (s, r.prompt.as_slice()))
                .collect();
            exec.forward_stage(&batch)?;
            loop {
                match exec.listen()? {
                    Control::Done => break,
                    Control::Step(pairs) => {
                        let ids: Vec<[i64; 1]> = pairs.iter().map(|&(_, t)| [t]).collect();
                        let batch: Vec<(usize, &[i64])> = pairs
                            .iter()
                            .zip(&ids)
                            .map(|(&(s, _), id)| (s, id.as_slice()))
                            .collect();
                        exec.forward_stage(&batch)?;
                    }
                    Control::Locate {
                        sequence,
                        step,
                        tokens,
                    } => {
                        let origin = exec.locate_non_finite(&tokens)?;
                        return Err(RunError::NonFiniteLogits {
                            sequence,
                            step: step_name(step),
                            origin,
                        });
                    }
                    Control::Engine(_) => {
                        return Err(RunError::Pipeline(
                            "a serving-engine step during a batch generation (a bug in tpc)".into(),
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}

/// "the prompt" (step 0) or "decode step N".
fn step_name(step: usize) -> String {
    if step == 0 {
        "the prompt".into()
    } else {
        format!("decode step {step}")
    }
}

/// One generation from empty caches: [`prefill`] of every prompt, then, while any sequence is
/// live, [`pick_next`] (sample each one's token and [`retire`] the finished) and
/// [`decode_step`] (one forward call over the sequences still live).
fn generate_batch<B: Backend, C: Collectives<B::Act>>(
    exec: &mut RankExecutor<'_, B, C>,
    requests: &[Request],
    opts: &RunOptions,
    report: &dyn Fn(Stage),
    finished: &dyn Fn(usize, &[i64]),
) -> Result<BatchOutput> {
    let n = requests.len();
    let bytes_before = exec.collective_bytes;
    let all_reduces_before = exec.all_reduces;
    let mut run = Generation {
        requests,
        opts,
        limits: requests
            .iter()
            .map(|r| r.max_new_tokens.unwrap_or(opts.max_new_tokens))
            .collect(),
        rngs: (0..n).map(|_| Rng::new(opts.sampling.seed)).collect(),
        sequences: Vec::new(),
        finished,
    };
    let start = Instant::now();
    let prompt = prefill(exec, &mut run)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    report(Stage::Prefilled);
    let mut live: Vec<usize> = (0..n).filter(|&s| run.limits[s] > 0).collect();
    for s in (0..n).filter(|&s| run.limits[s] == 0) {
        retire(&run, s);
    }
    let mode = DecodeMode::of(opts);
    let mut from = NextFrom::Prompt;
    let mut total = 0;
    let decode = Instant::now();
    let outcome: Result<()> = (|| {
        while !live.is_empty() {
            let (still, next_ids) = pick_next(&mut run, &prompt, &from, &live)?;
            total += live.len();
            report(Stage::Token(total));
            if still.is_empty() {
                break;
            }
            let last = std::mem::replace(&mut from, NextFrom::Prompt);
            from = decode_step(exec, &run, mode, &still, &next_ids, last)?;
            live = still;
        }
        Ok(())
    })();
    // The last step's logits go back to the pool whatever happened.
    if let NextFrom::Logits(old) = from {
        old.release();
    }
    outcome?;
    let decode_seconds = decode.elapsed().as_secs_f64();
    exec.tell(&Control::Done)?;
    let mut sequences = run.sequences;
    if n == 1 {
        sequences[0].prompt_logits = prompt.logits;
    } else {
        prompt.logits.release();
    }
    Ok(BatchOutput {
        sequences,
        prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
        load_seconds: 0.0,
        prefill_seconds,
        decode_seconds,
        collective_bytes: exec.collective_bytes - bytes_before,
        all_reduces: exec.all_reduces.since(&all_reduces_before),
        weight_bytes: 0,
        profile: Vec::new(),
        profiled_steps: [0; 2],
        linear_kernels: None,
    })
}

/// The state of one generation that its phases share.
struct Generation<'r> {
    requests: &'r [Request],
    opts: &'r RunOptions,
    /// New tokens each sequence may generate.
    limits: Vec<usize>,
    /// One sampler per sequence, all from the run's seed.
    rngs: Vec<Rng>,
    sequences: Vec<SequenceOutput>,
    finished: &'r dyn Fn(usize, &[i64]),
}

/// The prefill's logits and the row each sequence samples its first token from.
struct PromptLogits {
    logits: Tensor,
    row_of: Vec<usize>,
}

/// What the next tokens are picked from.
enum NextFrom {
    /// The prefill's logits, at each sequence's [`PromptLogits::row_of`].
    Prompt,
    /// A decode step's logits, one row per live sequence in order.
    Logits(Tensor),
    /// A decode step's picks, made on the device (greedy decoding).
    Picks(Vec<usize>),
    /// A decode step's best candidates per live sequence (top-k sampling).
    Candidates(Vec<Candidates>),
}

/// How decode steps return their result.
#[derive(Clone, Copy)]
enum DecodeMode {
    /// Greedy decode picks on the device: only token ids come back from a decode step.
    Greedy,
    /// Top-k sampling needs each row's k best logits only: they come back from a decode
    /// step (exchanged between the ranks instead of the logits when that is fewer bytes).
    TopK(usize),
    /// Exact sampling without a top-k needs the whole distribution: the logits.
    Logits,
}

impl DecodeMode {
    fn of(opts: &RunOptions) -> DecodeMode {
        let sampling = opts.sampling.temperature > 0.0;
        match opts.sampling.top_k {
            _ if opts.gather_logits => DecodeMode::Logits,
            _ if !sampling => DecodeMode::Greedy,
            Some(k) if k > 0 => DecodeMode::TopK(k),
            _ => DecodeMode::Logits,
        }
    }
}

/// Empties the caches, reserves each sequence's positions and runs every prompt in one
/// ragged forward call; keeps each sequence's prompt logits (all rows with
/// `all_prompt_logits`, else the last).
fn prefill<B: Backend, C: Collectives<B::Act>>(
    exec: &mut RankExecutor<'_, B, C>,
    run: &mut Generation<'_>,
) -> Result<PromptLogits> {
    let requests = run.requests;
    exec.reset();
    for (s, r) in requests.iter().enumerate() {
        exec.reserve(s, r.prompt.len().saturating_add(run.limits[s]));
    }
    let rows = if run.opts.all_prompt_logits {
        OutputRows::All
    } else {
        OutputRows::LastOfEach
    };
    let rows_of = |r: &Request| {
        if rows == OutputRows::All {
            r.prompt.len()
        } else {
            1
        }
    };
    let batch: Vec<(usize, &[i64])> = requests
        .iter()
        .enumerate()
        .map(|(s, r)| (s, r.prompt.as_slice()))
        .collect();
    let logits = exec.forward(&batch, rows)?;
    let vocab = logits.cols();
    if let Some(row) = logits.first_non_finite_row() {
        // Rows are each sequence's prompt rows (or its last row), in batch order.
        let mut end = 0;
        let s = requests
            .iter()
            .position(|r| {
                end += rows_of(r);
                row < end
            })
            .unwrap_or(0);
        logits.release();
        return Err(non_finite(exec, s, 0, &requests[s].prompt));
    }
    let mut row_of = Vec::with_capacity(requests.len());
    let mut spans = Vec::with_capacity(requests.len());
    let mut offset = 0;
    for r in requests {
        let len = rows_of(r);
        row_of.push(offset + len - 1);
        spans.push((offset, len));
        offset += len;
    }
    run.sequences = if requests.len() == 1 {
        // The common case keeps the (pooled) logits as they are.
        vec![SequenceOutput {
            generated: Vec::new(),
            prompt_logits: Tensor::default(),
        }]
    } else {
        spans
            .iter()
            .map(|&(o, len)| SequenceOutput {
                generated: Vec::new(),
                prompt_logits: Tensor::new(
                    vec![len, vocab],
                    logits.data[o * vocab..(o + len) * vocab].to_vec(),
                ),
            })
            .collect()
    };
    Ok(PromptLogits { logits, row_of })
}

/// Picks each live sequence's next token from `from`, retires those that meet EOS or their
/// limit, and returns the sequences still live with their new tokens.
fn pick_next(
    run: &mut Generation<'_>,
    prompt: &PromptLogits,
    from: &NextFrom,
    live: &[usize],
) -> Result<(Vec<usize>, Vec<i64>)> {
    let vocab = prompt.logits.cols();
    let mut still = Vec::with_capacity(live.len());
    let mut next_ids = Vec::with_capacity(live.len());
    for (k, &s) in live.iter().enumerate() {
        let sampling = &run.opts.sampling;
        let next = match from {
            NextFrom::Picks(picks) => picks[k] as i64,
            NextFrom::Candidates(candidates) => {
                pick_from_candidates(&candidates[k], sampling, &mut run.rngs[s]).ok_or_else(
                    || RunError::BadInstruction {
                        name: "output".into(),
                        problem: "a row of the logits has no candidate token".into(),
                    },
                )? as i64
            }
            NextFrom::Logits(step) => pick(
                &step.data[k * vocab..(k + 1) * vocab],
                sampling,
                &mut run.rngs[s],
            ) as i64,
            NextFrom::Prompt => {
                let r = prompt.row_of[s];
                let row = &prompt.logits.data[r * vocab..(r + 1) * vocab];
                pick(row, sampling, &mut run.rngs[s]) as i64
            }
        };
        let seq = &mut run.sequences[s];
        seq.generated.push(next);
        if !(run.opts.eos.contains(&next) || seq.generated.len() >= run.limits[s]) {
            still.push(s);
            next_ids.push(next);
        } else {
            retire(run, s);
        }
    }
    Ok((still, next_ids))
}

/// A sequence leaves the batch: its tokens go to the caller at once.
fn retire(run: &Generation<'_>, s: usize) {
    (run.finished)(s, &run.sequences[s].generated);
}

/// One decode step: the sequences `still` live, each with its newest token, through one
/// forward call (earlier pipeline stages told to run it too). A row that is not finite stops
/// generation with the op it comes from. `last` (the previous step's result) is released
/// once the new one exists, so the pool reuses its logits.
fn decode_step<B: Backend, C: Collectives<B::Act>>(
    exec: &mut RankExecutor<'_, B, C>,
    run: &Generation<'_>,
    mode: DecodeMode,
    still: &[usize],
    next_ids: &[i64],
    last: NextFrom,
) -> Result<NextFrom> {
    if let NextFrom::Logits(old) = last {
        old.release();
    }
    let batch: Vec<(usize, &[i64])> = still
        .iter()
        .zip(next_ids)
        .map(|(&s, id)| (s, std::slice::from_ref(id)))
        .collect();
    let stop = |exec: &mut RankExecutor<'_, B, C>, k: usize| {
        let s = still[k];
        let seq = &run.sequences[s];
        let tokens = [run.requests[s].prompt.as_slice(), &seq.generated].concat();
        non_finite(exec, s, seq.generated.len(), &tokens)
    };
    exec.tell(&Control::Step(
        still
            .iter()
            .copied()
            .zip(next_ids.iter().copied())
            .collect(),
    ))?;
    Ok(match mode {
        DecodeMode::Greedy => match exec.forward_argmax(&batch, OutputRows::LastOfEach)? {
            Ok(picks) => NextFrom::Picks(picks),
            Err(k) => return Err(stop(exec, k)),
        },
        DecodeMode::TopK(k) => match exec.forward_top_k(&batch, OutputRows::LastOfEach, k)? {
            Ok(candidates) => NextFrom::Candidates(candidates),
            Err(k) => return Err(stop(exec, k)),
        },
        DecodeMode::Logits => {
            let fresh = exec.forward(&batch, OutputRows::LastOfEach)?;
            if let Some(k) = fresh.first_non_finite_row() {
                fresh.release();
                return Err(stop(exec, k));
            }
            NextFrom::Logits(fresh)
        }
    })
}

/// The error for non-finite logits of `sequence` at `step` (0: the prompt), with the first
/// op producing them found by recomputing its `tokens` (every rank does this together, as
/// it saw the same logits; earlier pipeline stages are told to).
fn non_finite<B: Backend, C: Collectives<B::Act>>(
    exec: &mut RankExecutor<'_, B, C>,
    sequence: usize,
    step: usize,
    tokens: &[i64],
) -> RunError {
    let locate = Control::Locate {
        sequence,
        step,
        tokens: tokens.to_vec(),
    };
    if let Err(e) = exec.tell(&locate) {
        return e;
    }
    match exec.locate_non_finite(tokens) {
        Ok(origin) => RunError::NonFiniteLogits {
            sequence,
            step: step_name(step),
            origin,
        },
        Err(e) => e,
    }
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
