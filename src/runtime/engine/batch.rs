//! A fixed batch through the engine: what `tpc run` generates. The leading rank queues every
//! request at once into a scheduler with room for all of them (a pool that holds each
//! sequence's prompt and new tokens, a step budget that takes every prompt in the first
//! step, no prefix cache: a repeated run computes as much as the first), then runs steps
//! until the last request finishes; the other ranks follow the steps as when serving. Beside
//! the tokens it keeps what `tpc run` reports: the prompts' logits, and the wall time of the
//! first step (the prefill) and of the others (decoding).

use super::api::{Event, GenRequest};
use super::driver::{follow, StepRunner};
use super::rank::RankSteps;
use super::scheduler::{PromptLogits, Scheduler, SchedulerConfig, StepOutput};
use super::step::StepMessage;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::Collectives;
use crate::runtime::error::{Result, RunError};
use crate::runtime::executor::OpTime;
use crate::runtime::generate::{
    BatchOutput, RankRuntime, Request, RunOptions, SequenceOutput, Stage,
};
use crate::runtime::tensor::Tensor;
use std::time::Instant;

/// Tokens per KV-cache block in a batch (the server's default too).
pub const BATCH_BLOCK_SIZE: usize = 16;

/// Block ids pass between ranks as exact f32 integers.
const MAX_BLOCKS: usize = (1 << 24) - 1;

/// The scheduler's limits for `requests`: every prompt in the first step, every sequence's
/// prompt and new tokens in the pool at once (so nothing is ever preempted). The requests
/// were checked against the model's context before any weight was read.
pub fn batch_config(requests: &[Request], opts: &RunOptions) -> Result<SchedulerConfig> {
    let mut blocks = 0usize;
    let mut prompt_tokens = 0usize;
    for r in requests {
        let limit = r.max_new_tokens.unwrap_or(opts.max_new_tokens);
        let positions = r.prompt.len().saturating_add(limit);
        blocks = blocks.saturating_add(positions.div_ceil(BATCH_BLOCK_SIZE));
        prompt_tokens = prompt_tokens.saturating_add(r.prompt.len());
    }
    if blocks > MAX_BLOCKS {
        return Err(RunError::BadBatch {
            problem: format!(
                "the batch needs {blocks} KV-cache blocks of {BATCH_BLOCK_SIZE} tokens, more \
                 than {MAX_BLOCKS}; give fewer prompts or fewer new tokens per run"
            ),
        });
    }
    Ok(SchedulerConfig {
        max_num_seqs: requests.len().max(1),
        max_num_batched_tokens: prompt_tokens.max(1),
        block_size: BATCH_BLOCK_SIZE,
        blocks,
        prefix_caching: false,
        context: usize::MAX,
        prompt_logits: if opts.all_prompt_logits {
            PromptLogits::All
        } else {
            PromptLogits::Last
        },
        gather_logits: opts.gather_logits,
    })
}

/// The engine's request for one sequence of the batch.
fn gen_request(r: &Request, opts: &RunOptions) -> GenRequest {
    GenRequest {
        prompt: r.prompt.clone(),
        max_tokens: r.max_new_tokens.unwrap_or(opts.max_new_tokens),
        min_tokens: 0,
        sampling: opts.sampling.clone(),
        stop_ids: opts.eos.clone(),
        logprobs: None,
    }
}

/// What the leading rank of a batch returns.
#[derive(Debug)]
pub struct BatchRun {
    /// In request order.
    pub sequences: Vec<SequenceOutput>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

fn bug(problem: &str) -> RunError {
    RunError::BadInstruction {
        name: "engine batch".into(),
        problem: format!("{problem} (a bug in tpc)"),
    }
}

/// The leading rank's part: runs the batch to its end with the other ranks (who run
/// [`super::driver::follow`]) and tells them to stop. Logits that are not finite stop the
/// batch with the op they come from, found by every rank together.
pub fn lead_batch<R: StepRunner>(
    runner: &mut R,
    cfg: SchedulerConfig,
    requests: &[Request],
    opts: &RunOptions,
    report: &dyn Fn(Stage),
    finished: &dyn Fn(usize, &[i64]),
) -> Result<BatchRun> {
    let mut scheduler = Scheduler::new(cfg);
    let (tx, events) = std::sync::mpsc::channel();
    let arrived = Instant::now();
    for (i, r) in requests.iter().enumerate() {
        let tx = tx.clone();
        let sink = Box::new(move |e| {
            let _ = tx.send((i, e));
        });
        scheduler.add(i as u64, gen_request(r, opts), sink, arrived);
    }
    drop(tx);
    let mut generated: Vec<Vec<i64>> = vec![Vec::new(); requests.len()];
    let mut logits: Vec<Vec<f32>> = vec![Vec::new(); requests.len()];
    let mut vocab = 0;
    let mut total = 0;
    let started = Instant::now();
    let mut prefill: Option<(f64, Instant)> = None;
    while let Some(message) = scheduler.schedule() {
        runner.share(Some(&message))?;
        let StepMessage::Step { seqs, exchange } = &message else {
            return Err(bug("the scheduler made a message that is not a step"));
        };
        let output = runner
            .run(seqs, *exchange)?
            .ok_or_else(|| bug("the leading rank computed no output"))?;
        if let StepOutput::NonFinite { row, .. } = &output {
            let (id, tokens, step) = scheduler
                .in_flight_at_row(*row)
                .ok_or_else(|| bug("a non-finite row of no sequence"))?;
            let sequence = usize::try_from(id).unwrap_or(usize::MAX);
            let tokens = tokens.to_vec();
            runner.share(Some(&StepMessage::Locate {
                sequence,
                step,
                tokens: tokens.clone(),
            }))?;
            return Err(runner.locate(sequence, step, &tokens));
        }
        for (id, _, rows) in scheduler.prompt_rows(&output) {
            if let (Some(to), StepOutput::Logits { vocab: v, .. }) =
                (logits.get_mut(id as usize), &output)
            {
                to.extend_from_slice(rows);
                vocab = *v;
            }
        }
        scheduler.complete(output, Instant::now());
        for (i, event) in events.try_iter() {
            match event {
                Event::Token { id, .. } => {
                    generated[i].push(id);
                    total += 1;
                }
                Event::Finished { .. } => finished(i, &generated[i]),
                Event::Failed { message } => return Err(bug(&message)),
            }
        }
        if prefill.is_none() {
            prefill = Some((started.elapsed().as_secs_f64(), Instant::now()));
            report(Stage::Prefilled);
        }
        report(Stage::Token(total));
    }
    if !scheduler.is_idle() {
        return Err(bug("requests wait but none can be scheduled"));
    }
    runner.share(Some(&StepMessage::Stop))?;
    let (prefill_seconds, decode) = prefill.unwrap_or((0.0, Instant::now()));
    let sequences = generated
        .into_iter()
        .zip(logits)
        .map(|(generated, rows)| SequenceOutput {
            generated,
            prompt_logits: match vocab {
                0 => Tensor::default(),
                v => Tensor::new(vec![rows.len() / v, v], rows),
            },
        })
        .collect();
    Ok(BatchRun {
        sequences,
        prefill_seconds,
        decode_seconds: decode.elapsed().as_secs_f64(),
    })
}

impl<B: Backend, C: Collectives<B::Act>> RankRuntime<'_, B, C> {
    /// Generates for every request (warm-ups and repetitions as `opts` says) and returns the
    /// best timings of the timed runs. Every generation is one batch through the serving
    /// engine's scheduler and steps ([`lead_batch`] on the leading rank, [`follow`] on the
    /// others); the leading rank's result has the tokens.
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
        report(Stage::Loaded);
        if opts.profile && leads {
            self.exec.profile = Some(Default::default());
        }
        let cfg = batch_config(requests, opts)?;
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
            let out = self.generate_batch(&cfg, requests, opts, &report, &finished)?;
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
    /// the engine stop and dropped its link would otherwise fail a stage still waiting to
    /// hear it (the last stage tells them one after another).
    fn leave_together(&mut self) -> Result<()> {
        if let Some(link) = self.exec.link.as_mut() {
            link.comm.barrier()?;
        }
        Ok(())
    }

    /// One generation from an empty pool sized for the batch: the leading rank schedules
    /// and returns the tokens, every other rank follows its steps.
    fn generate_batch(
        &mut self,
        cfg: &SchedulerConfig,
        requests: &[Request],
        opts: &RunOptions,
        report: &dyn Fn(Stage),
        finished: &dyn Fn(usize, &[i64]),
    ) -> Result<BatchOutput> {
        let bytes_before = self.exec.collective_bytes;
        let routed_before = self.exec.routed_pairs;
        let all_reduces_before = self.exec.all_reduces;
        self.exec.reset();
        self.exec.set_kv_pool(cfg.block_size, cfg.blocks)?;
        let leads = self.leads;
        let mut steps = RankSteps {
            rt: self,
            watch: None,
        };
        let run = if leads {
            Some(lead_batch(
                &mut steps,
                cfg.clone(),
                requests,
                opts,
                report,
                finished,
            )?)
        } else {
            follow(&mut steps)?;
            None
        };
        // Every rank learns each rank's expert load, every stage's (the lead reports it).
        let mine = self.exec.routed_pairs - routed_before;
        let routed_pairs_per_rank = self.exec.gather_expert_loads(mine)?;
        let exec = &self.exec;
        let (sequences, prefill_seconds, decode_seconds) = match run {
            Some(r) => (r.sequences, r.prefill_seconds, r.decode_seconds),
            None => Default::default(),
        };
        Ok(BatchOutput {
            sequences,
            prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
            load_seconds: 0.0,
            prefill_seconds,
            decode_seconds,
            collective_bytes: exec.collective_bytes - bytes_before,
            routed_pairs_per_rank,
            all_reduces: exec.all_reduces.since(&all_reduces_before),
            weight_bytes: 0,
            profile: Vec::new(),
            profiled_steps: [0; 2],
            linear_kernels: None,
        })
    }
}
