//! Generation on tp CPU ranks: one thread per rank, each with its own slice of the weights
//! and its own KV cache, joined only by collectives. Every rank computes the same logits
//! (bit-identical after the gather) and so picks the same tokens with the same seed.

use super::comm::{local_group, Communicator, LocalComm};
use super::cpu::CpuBackend;
use super::executor::RankExecutor;
use super::sampling::{pick, Rng, Sampling};
use super::tensor::Tensor;
use super::weights::WeightSource;
use crate::error::{Result, TpcError};
use crate::ir::Op;
use crate::plan::Plan;
use std::time::Instant;

/// What rank 0 reports while it runs (for progress bars).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Loaded,
    Prefilled,
    Token(usize),
}

pub type Progress = std::sync::Arc<dyn Fn(Stage) + Send + Sync>;

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
    pub dtype: ComputeDtype,
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Stop when one of these is generated.
    pub eos: Vec<i64>,
    /// GEMM threads per rank; 0 = cores / tp.
    pub threads_per_rank: usize,
    /// Time every op kind on rank 0.
    pub profile: bool,
    /// Keep the logits of every prompt position (`--dump-logits`, parity checks); otherwise
    /// the LM head runs on the last position only, the one generation needs.
    pub all_prompt_logits: bool,
    /// Pin every rank's compute threads to cores, round robin (`affinity.rs`; `--pin`).
    /// Off by default: on this project's 2-vCPU machine it measured no gain beyond noise.
    pub pin_threads: bool,
    /// Untimed generations before the timed ones (same prompt, cache reset each time).
    pub warmup: usize,
    /// Timed generations (at least 1); the best prefill and decode times are reported.
    pub repeat: usize,
    pub progress: Option<Progress>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("dtype", &self.dtype)
            .field("max_new_tokens", &self.max_new_tokens)
            .field("sampling", &self.sampling)
            .field("eos", &self.eos)
            .field("threads_per_rank", &self.threads_per_rank)
            .field("all_prompt_logits", &self.all_prompt_logits)
            .field("pin_threads", &self.pin_threads)
            .field("warmup", &self.warmup)
            .field("repeat", &self.repeat)
            .finish()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            dtype: ComputeDtype::Auto,
            max_new_tokens: 16,
            sampling: Sampling::default(),
            eos: vec![],
            threads_per_rank: 0,
            profile: false,
            all_prompt_logits: true,
            pin_threads: false,
            warmup: 0,
            repeat: 1,
            progress: None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct RunOutput {
    pub generated: Vec<i64>,
    /// Logits of the prompt, `[prompt_len, vocab]` (`[1, vocab]`, the last position, unless
    /// `all_prompt_logits`), padding removed.
    pub prompt_logits: Tensor,
    pub prompt_len: usize,
    pub load_seconds: f64,
    pub prefill_seconds: f64,
    /// Wall time of the decode steps after the first new token.
    pub decode_seconds: f64,
    /// Rank 0's time per op kind (seconds, calls), largest first, when profiled.
    pub profile: Vec<(String, f64, u64)>,
}

impl RunOutput {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_len as f64 / self.prefill_seconds.max(1e-12)
    }
    /// Tokens after the first new one, over their wall time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.generated.len().saturating_sub(1);
        if n == 0 {
            0.0
        } else {
            n as f64 / self.decode_seconds.max(1e-12)
        }
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

fn check_prompt(prompt: &[i64], vocab: u64) -> Result<()> {
    if prompt.is_empty() {
        return Err(TpcError::EmptyPrompt);
    }
    for (position, &id) in prompt.iter().enumerate() {
        if id < 0 || id as u64 >= vocab {
            return Err(TpcError::TokenOutOfRange {
                id,
                position,
                vocab,
            });
        }
    }
    Ok(())
}

fn rank_main(
    plan: &Plan,
    rank: usize,
    ckpt: &dyn WeightSource,
    comm: LocalComm,
    prompt: &[i64],
    opts: &RunOptions,
    threads: usize,
) -> Result<RunOutput> {
    let placement = if opts.pin_threads {
        super::affinity::placement(rank, threads)
    } else {
        Vec::new()
    };
    if let Some(Some(core)) = placement.first() {
        super::affinity::pin_current_thread(*core);
    }
    let backend = CpuBackend::pinned(threads, &placement);
    let load = Instant::now();
    let bf16 = opts.dtype.bf16_linears(plan);
    let mut exec = RankExecutor::new(&plan.ranks[rank], ckpt, &backend, comm, bf16)?;
    if opts.profile && rank == 0 {
        exec.profile = Some(Default::default());
    }
    let report = |stage| {
        if let (0, Some(p)) = (rank, &opts.progress) {
            p(stage)
        }
    };
    let result = generate_on(&mut exec, prompt, opts, load, &report);
    if result.is_err() {
        // Peers blocked in a collective learn of the failure now instead of waiting.
        exec.comm.abort();
    }
    result
}

fn generate_on<C: Communicator>(
    exec: &mut RankExecutor<'_, CpuBackend, C>,
    prompt: &[i64],
    opts: &RunOptions,
    load: Instant,
    report: &dyn Fn(Stage),
) -> Result<RunOutput> {
    exec.comm.barrier()?;
    let load_seconds = load.elapsed().as_secs_f64();
    report(Stage::Loaded);
    let mut best: Option<RunOutput> = None;
    let runs = opts.warmup + opts.repeat.max(1);
    for run in 0..runs {
        if run == opts.warmup {
            // Profile the timed generations only.
            if let Some(p) = exec.profile.as_mut() {
                p.clear();
            }
        }
        exec.reset();
        exec.reserve_positions(prompt.len() + opts.max_new_tokens);
        let out = generate_once(exec, prompt, opts, report)?;
        if run < opts.warmup {
            continue;
        }
        best = Some(match best {
            None => out,
            Some(b) => {
                if b.generated != out.generated {
                    return Err(TpcError::BadInstruction {
                        name: "generation".into(),
                        problem: format!(
                            "repetition {run} generated {:?} after {:?}: the runtime is not deterministic",
                            out.generated, b.generated
                        ),
                    });
                }
                RunOutput {
                    prefill_seconds: b.prefill_seconds.min(out.prefill_seconds),
                    decode_seconds: b.decode_seconds.min(out.decode_seconds),
                    ..out
                }
            }
        });
    }
    let mut out = best.expect("at least one timed generation");
    out.load_seconds = load_seconds;
    let mut profile: Vec<(String, f64, u64)> = exec
        .profile
        .iter()
        .flatten()
        .map(|(k, (t, n))| (k.to_string(), t.as_secs_f64(), *n))
        .collect();
    profile.sort_by(|a, b| b.1.total_cmp(&a.1));
    out.profile = profile;
    Ok(out)
}

/// One generation from an empty cache: prefill, then decode until EOS or the token limit.
fn generate_once<C: Communicator>(
    exec: &mut RankExecutor<'_, CpuBackend, C>,
    prompt: &[i64],
    opts: &RunOptions,
    report: &dyn Fn(Stage),
) -> Result<RunOutput> {
    let mut rng = Rng::new(opts.sampling.seed);
    let start = Instant::now();
    let prompt_logits = exec.forward_rows(prompt, !opts.all_prompt_logits)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    report(Stage::Prefilled);
    let (rows, vocab) = prompt_logits.rows_cols();
    let mut generated = Vec::new();
    let mut last = &prompt_logits.data[(rows - 1) * vocab..rows * vocab];
    let mut step_logits: Option<Tensor> = None;
    let decode = Instant::now();
    while generated.len() < opts.max_new_tokens {
        let next = pick(last, &opts.sampling, &mut rng) as i64;
        generated.push(next);
        report(Stage::Token(generated.len()));
        if opts.eos.contains(&next) || generated.len() == opts.max_new_tokens {
            break;
        }
        // The previous step's logits go back to the pool for this step's to reuse.
        if let Some(old) = step_logits.take() {
            old.release();
        }
        last = &step_logits.insert(exec.forward_rows(&[next], true)?).data;
    }
    let decode_seconds = decode.elapsed().as_secs_f64();
    Ok(RunOutput {
        generated,
        prompt_logits,
        prompt_len: prompt.len(),
        load_seconds: 0.0,
        prefill_seconds,
        decode_seconds,
        profile: Vec::new(),
    })
}

/// Runs `plan` on its ranks (threads) over the checkpoint and generates from `prompt`.
pub fn run(
    plan: &Plan,
    ckpt: &dyn WeightSource,
    prompt: &[i64],
    opts: &RunOptions,
) -> Result<RunOutput> {
    ckpt.check(plan)?;
    let vocab = output_vocab(plan).ok_or_else(|| TpcError::BadInstruction {
        name: "output".into(),
        problem: "the plan's output has no vocabulary dim".into(),
    })?;
    check_prompt(prompt, vocab)?;
    let tp = plan.ranks.len();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = if opts.threads_per_rank > 0 {
        opts.threads_per_rank
    } else {
        (cores / tp).max(1)
    };
    let comms = local_group(tp);
    let results: Vec<std::thread::Result<Result<RunOutput>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("tpc-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        rank_main(plan, rank, ckpt, comm, prompt, opts, threads)
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    // Report the root cause: a panic or an error that is not a peer's failure.
    let mut first_err: Option<TpcError> = None;
    let mut output = None;
    for (rank, r) in results.into_iter().enumerate() {
        let err = match r {
            Ok(Ok(out)) => {
                if rank == 0 {
                    output = Some(out);
                }
                continue;
            }
            Ok(Err(e)) => e,
            Err(panic) => TpcError::RankPanicked {
                rank,
                message: panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panicked".into()),
            },
        };
        let is_echo = matches!(
            &err,
            TpcError::Comm(super::comm::CommError::PeerFailed { .. })
        );
        match &first_err {
            None => first_err = Some(err),
            Some(TpcError::Comm(super::comm::CommError::PeerFailed { .. })) if !is_echo => {
                first_err = Some(err)
            }
            _ => {}
        }
    }
    match (first_err, output) {
        (Some(e), _) => Err(e),
        (None, Some(out)) => Ok(out),
        (None, None) => Err(TpcError::RankPanicked {
            rank: 0,
            message: "rank 0 returned nothing".into(),
        }),
    }
}

/// Rank 0's profile as a table: op kind, seconds, share of the run, calls.
pub fn render_profile(out: &RunOutput) -> String {
    use std::fmt::Write;
    let total: f64 = out.profile.iter().map(|p| p.1).sum();
    let mut s = format!(
        "{:<16} {:>10} {:>7} {:>8}\n",
        "op (rank 0)", "seconds", "share", "calls"
    );
    for (kind, secs, calls) in &out.profile {
        let _ = writeln!(
            s,
            "{kind:<16} {secs:>10.4} {:>6.1}% {calls:>8}",
            100.0 * secs / total.max(1e-12)
        );
    }
    let _ = writeln!(
        s,
        "{:<16} {total:>10.4} (prefill {:.4} s + decode {:.4} s wall)",
        "all ops", out.prefill_seconds, out.decode_seconds
    );
    s
}
