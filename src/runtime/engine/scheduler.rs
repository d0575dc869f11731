//! Continuous batching: which sequences run in the next step and with how many tokens.
//!
//! Each step gets a budget of tokens (`max_num_batched_tokens`). Running sequences come
//! first, oldest first: a decoding sequence takes one token, one still in its prompt takes
//! the next chunk of it. Waiting sequences then join, first come first served, while the
//! budget, `max_num_seqs` and free blocks allow; a joining prompt starts after the blocks
//! the prefix cache holds for it. When a running sequence needs a block and none is free,
//! the newest running sequence is preempted: its blocks go back and it waits at the front
//! of the queue to be recomputed (prompt and tokens so far). The oldest sequence is never
//! preempted for a newer one and a lone sequence always fits (the context is capped to the
//! pool), so every request finishes.

use super::api::{Event, EventSink, FinishReason, GenRequest, RequestId, TokenLogprobs, Usage};
use super::blocks::{BlockId, BlockPool};
use super::metrics::Metrics;
use super::step::{Exchange, PlannedSeq, StepMessage};
use crate::runtime::executor::Candidates;
use crate::runtime::sampling::{pick, pick_from_candidates, Rng};
use std::collections::VecDeque;
use std::time::Instant;

/// The scheduler's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences in one step at most.
    pub max_num_seqs: usize,
    /// Tokens in one step at most (prompt chunks and decode tokens together).
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub blocks: usize,
    pub prefix_caching: bool,
    /// Positions a sequence may use: its last token is fed at position `context - 1` at most.
    pub context: usize,
    /// Which prompt logits the steps that compute prompts return (`tpc run`).
    pub prompt_logits: PromptLogits,
    /// Every step returns whole logits, even where each row's argmax or top-k candidates
    /// would do (`tpc run --gather-logits`: the same tokens, more bytes).
    pub gather_logits: bool,
}

/// Which logits of the prompts a step returns besides what picking the next tokens needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptLogits {
    /// None (the server).
    #[default]
    Off,
    /// The last prompt position's.
    Last,
    /// Every prompt position's.
    All,
}

/// Integers up to this pass between ranks exactly (a top-k beyond it takes every token).
const EXACT: usize = (1 << 24) - 1;

/// A step's result on the leading rank: one row per planned sequence, in plan order.
#[derive(Debug)]
pub enum StepOutput {
    /// Each row's greedy token.
    Argmax(Vec<usize>),
    /// Each row's logits, `vocab` values per row.
    Logits { data: Vec<f32>, vocab: usize },
    /// Each row's best (logit, token) candidates.
    Candidates(Vec<Candidates>),
    /// Row `row` is not finite (`origin`: the op it comes from, when known): that sequence
    /// fails, the others run the step again.
    NonFinite { row: usize, origin: String },
}

struct Seq {
    id: RequestId,
    request: GenRequest,
    /// Prompt, then the generated tokens.
    tokens: Vec<i64>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Prompt tokens served by the prefix cache at the first admission.
    cached_prompt: Option<usize>,
    rng: Rng,
    sink: EventSink,
    arrived: Instant,
    last_token_at: Option<Instant>,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_prompt_tokens: self.cached_prompt.unwrap_or(0),
        }
    }
    /// What this sequence needs of a step's output to pick its next token.
    fn needs(&self) -> Exchange {
        let s = &self.request.sampling;
        if self.request.logprobs.is_some() {
            Exchange::Logits
        } else if s.temperature == 0.0 {
            Exchange::Argmax
        } else {
            match s.top_k.filter(|&k| k > 0) {
                Some(k) => Exchange::TopK(k.min(EXACT)),
                None => Exchange::Logits,
            }
        }
    }
}

/// The scheduler of the leading rank.
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    /// Oldest admitted first.
    running: Vec<Seq>,
    /// The step being run: each planned sequence's id and token count, in plan order.
    in_flight: Vec<(RequestId, usize)>,
    /// What that step's output is.
    in_flight_exchange: Exchange,
    pub metrics: Metrics,
}

fn label(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
}

impl Scheduler {
    /// The context is capped to what the pool holds, so that a lone sequence always fits.
    pub fn new(cfg: SchedulerConfig) -> Scheduler {
        Scheduler::with_metrics(cfg, Metrics::new())
    }

    /// [`Scheduler::new`] recording into `metrics` (a replica's, in a shared registry).
    pub fn with_metrics(mut cfg: SchedulerConfig, metrics: Metrics) -> Scheduler {
        cfg.context = cfg
            .context
            .min(cfg.blocks.saturating_mul(cfg.block_size.max(1)));
        let pool = BlockPool::new(cfg.blocks, cfg.block_size, cfg.prefix_caching);
        metrics.kv_blocks_total.set(cfg.blocks as i64);
        Scheduler {
            cfg,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: Vec::new(),
            in_flight_exchange: Exchange::Argmax,
            metrics,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request (already validated by the engine's handle).
    pub fn add(&mut self, id: RequestId, request: GenRequest, sink: EventSink, arrived: Instant) {
        let seq = Seq {
            id,
            tokens: request.prompt.clone(),
            prompt_len: request.prompt.len(),
            rng: Rng::new(request.sampling.seed),
            request,
            computed: 0,
            blocks: Vec::new(),
            cached_prompt: None,
            sink,
            arrived,
            last_token_at: None,
        };
        self.waiting.push_back(seq);
        self.update_gauges();
    }

    /// Ends request `id` early (between steps), freeing its blocks.
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(seq) = self.waiting.remove(i) {
                self.finish(seq, FinishReason::Cancelled);
            }
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.finish(seq, FinishReason::Cancelled);
        }
        self.update_gauges();
    }

    /// Fails every request (the engine cannot go on).
    pub fn fail_all(&mut self, message: &str) {
        let all: Vec<Seq> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for seq in &all {
            self.pool.release(&seq.blocks);
        }
        self.in_flight.clear();
        // The gauges say the requests are gone before their clients hear it.
        self.update_gauges();
        for mut seq in all {
            (seq.sink)(Event::Failed {
                message: message.to_string(),
            });
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// (running, waiting) requests.
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// KV blocks read by some request.
    pub fn blocks_in_use(&self) -> usize {
        self.pool.in_use()
    }

    /// The next step, or `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<StepMessage> {
        debug_assert!(self.in_flight.is_empty(), "a step is still in flight");
        let mut budget = self.cfg.max_num_batched_tokens.max(1);
        let mut seqs = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, len) = (self.running[i].computed, self.running[i].tokens.len());
            let n = (len - computed).min(budget);
            let want = self
                .pool
                .blocks_for(computed + n)
                .saturating_sub(self.running[i].blocks.len());
            let got = loop {
                if let Some(got) = self.pool.take_new(want) {
                    break Some(got);
                }
                // The newest running sequence makes room; if that is this one, it waits.
                let last = self.running.len() - 1;
                self.preempt(last);
                preempted = true;
                if last == i {
                    break None;
                }
            };
            let Some(got) = got else { break };
            let seq = &mut self.running[i];
            seq.blocks.extend(got);
            seqs.push(self.plan_of(i, n));
            budget -= n;
            i += 1;
        }
        // A step that had to preempt admits no one (they would be preempted next).
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs.max(1) {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            let hits = if seq.computed == 0 && seq.blocks.is_empty() {
                self.pool.cached_prefix(&seq.tokens)
            } else {
                Vec::new()
            };
            self.pool.take_cached(&hits);
            let cached = hits.len() * self.pool.block_size();
            let n = (seq.tokens.len() - cached).min(budget);
            let want = self.pool.blocks_for(cached + n) - hits.len();
            let Some(got) = self.pool.take_new(want) else {
                self.pool.release(&hits);
                self.waiting.push_front(seq);
                break;
            };
            if seq.cached_prompt.is_none() {
                seq.cached_prompt = Some(cached);
                self.metrics.prefix_lookup(seq.prompt_len, cached);
            }
            seq.computed = cached;
            seq.blocks = hits;
            seq.blocks.extend(got);
            self.running.push(seq);
            seqs.push(self.plan_of(self.running.len() - 1, n));
            budget -= n;
        }
        self.update_gauges();
        if seqs.is_empty() {
            return None;
        }
        self.in_flight_exchange = self.step_exchange();
        Some(StepMessage::Step {
            seqs,
            exchange: self.in_flight_exchange,
        })
    }

    /// The least output the in-flight step's sequences need: argmax picks when all are
    /// greedy, top-k candidates when all are greedy or sample from a top-k, else logits;
    /// the prompt logits asked for when some sequence computes its prompt.
    fn step_exchange(&self) -> Exchange {
        let seqs = self
            .in_flight
            .iter()
            .filter_map(|&(id, _)| self.running.iter().find(|s| s.id == id));
        let prefilling = seqs.clone().any(|s| s.computed < s.prompt_len);
        match self.cfg.prompt_logits {
            PromptLogits::All if prefilling => return Exchange::AllLogits,
            PromptLogits::Last if prefilling => return Exchange::Logits,
            _ if self.cfg.gather_logits => return Exchange::Logits,
            _ => {}
        }
        let mut top_k = None;
        for s in seqs {
            match s.needs() {
                Exchange::Argmax => {}
                Exchange::TopK(k) => top_k = Some(top_k.unwrap_or(0).max(k)),
                _ => return Exchange::Logits,
            }
        }
        top_k.map_or(Exchange::Argmax, Exchange::TopK)
    }

    /// The in-flight step's sequences in plan order: id, token count and the output row
    /// that picks its next token (with every position's logits, its last position's).
    fn in_flight_rows(&self) -> Vec<(RequestId, usize, usize)> {
        // Rows of a sequence: `last + 1 - first_rows(n)..=last`.
        let mut offset = 0;
        let all = self.in_flight_exchange == Exchange::AllLogits;
        self.in_flight
            .iter()
            .enumerate()
            .map(|(p, &(id, n))| {
                offset += n;
                (id, n, if all { offset - 1 } else { p })
            })
            .collect()
    }

    /// The in-flight sequence whose output row `row` is: its id, every token fed so far
    /// (this step's included) and how many of them it generated (0: still its prompt).
    pub fn in_flight_at_row(&self, row: usize) -> Option<(RequestId, &[i64], usize)> {
        let (id, ..) = self
            .in_flight_rows()
            .into_iter()
            .find(|&(_, n, last)| row <= last && row + self.rows_of(n) > last)?;
        let seq = self.running.iter().find(|s| s.id == id)?;
        Some((id, &seq.tokens[..], seq.tokens.len() - seq.prompt_len))
    }

    /// Output rows the in-flight step gives a sequence that computes `n` tokens.
    fn rows_of(&self, n: usize) -> usize {
        if self.in_flight_exchange == Exchange::AllLogits {
            n
        } else {
            1
        }
    }

    /// The prompt logits in the in-flight step's `output`, for each sequence that has some:
    /// its id, the position of the first row, and the rows (`vocab` values each). With
    /// every position's logits those of its prompt positions; otherwise its last prompt
    /// position's when this step computes it.
    pub fn prompt_rows<'o>(&self, output: &'o StepOutput) -> Vec<(RequestId, usize, &'o [f32])> {
        let StepOutput::Logits { data, vocab } = output else {
            return Vec::new();
        };
        let all = self.in_flight_exchange == Exchange::AllLogits;
        let mut out = Vec::new();
        for (id, n, last) in self.in_flight_rows() {
            let Some(seq) = self.running.iter().find(|s| s.id == id) else {
                continue;
            };
            let (start, end) = (seq.computed, seq.computed + n);
            if start >= seq.prompt_len {
                continue;
            }
            let (first_row, first, rows) = if all {
                (last + 1 - n, start, end.min(seq.prompt_len) - start)
            } else if end == seq.prompt_len {
                (last, end - 1, 1)
            } else {
                continue;
            };
            if let Some(rows) = data.get(first_row * vocab..(first_row + rows) * vocab) {
                out.push((id, first, rows));
            }
        }
        out
    }

    /// Running sequence `i`'s next `n` tokens, recorded as in flight.
    fn plan_of(&mut self, i: usize, n: usize) -> PlannedSeq {
        let seq = &self.running[i];
        let prompt_part = (seq.computed + n).min(seq.prompt_len) - seq.computed.min(seq.prompt_len);
        self.metrics
            .prompt_tokens_computed
            .inc_by(prompt_part as u64);
        self.in_flight.push((seq.id, n));
        PlannedSeq {
            start: seq.computed,
            tokens: seq.tokens[seq.computed..seq.computed + n].to_vec(),
            blocks: seq.blocks.clone(),
        }
    }

    /// Running sequence `i` gives its blocks back and waits at the front of the queue.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        self.waiting.push_front(seq);
        self.metrics.preemptions.inc();
    }

    /// Takes the result of the step [`Scheduler::schedule`] returned: sequences whose
    /// tokens are all computed now pick their next token; finished ones leave.
    pub fn complete(&mut self, output: StepOutput, now: Instant) {
        if let StepOutput::NonFinite { row, origin } = &output {
            // Nothing advances: the others' keys and values are written again next step.
            let hit = self.in_flight_at_row(*row).map(|(id, ..)| id);
            self.in_flight.clear();
            if let Some(id) = hit {
                if let Some(i) = self.running.iter().position(|s| s.id == id) {
                    let mut seq = self.running.remove(i);
                    self.pool.release(&seq.blocks);
                    self.update_gauges();
                    (seq.sink)(Event::Failed {
                        message: format!("the model's logits are not finite ({origin})"),
                    });
                }
            }
            self.update_gauges();
            return;
        }
        let in_flight = self.in_flight_rows();
        self.in_flight.clear();
        let mut generated = 0;
        let mut done = Vec::new();
        for &(id, n, row) in &in_flight {
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            let seq = &mut self.running[i];
            seq.computed += n;
            self.pool
                .cache_full_blocks(&seq.blocks, &seq.tokens[..seq.computed]);
            if seq.computed < seq.tokens.len() {
                continue;
            }
            if seq.request.max_tokens == 0 {
                // A prompt only (`tpc run --max-new-tokens 0`): no token is picked.
                done.push((id, FinishReason::Length));
                continue;
            }
            let (token, logprobs) = match &output {
                StepOutput::Candidates(all) => (
                    all.get(row)
                        .and_then(|c| pick_from_candidates(c, &seq.request.sampling, &mut seq.rng))
                        .map(|t| t as i64),
                    None,
                ),
                StepOutput::Argmax(picks) => (picks.get(row).map(|&t| t as i64), None),
                StepOutput::Logits { data, vocab } => {
                    let logits = data.get(row * vocab..(row + 1) * vocab);
                    match logits {
                        Some(logits) => {
                            let t = pick(logits, &seq.request.sampling, &mut seq.rng);
                            let lp = seq.request.logprobs.map(|k| logprobs_of(logits, t, k));
                            (Some(t as i64), lp)
                        }
                        None => (None, None),
                    }
                }
                StepOutput::NonFinite { .. } => (None, None),
            };
            let Some(token) = token else { continue };
            seq.tokens.push(token);
            generated += 1;
            match seq.last_token_at {
                None => self
                    .metrics
                    .time_to_first_token
                    .observe(now.duration_since(seq.arrived).as_secs_f64()),
                Some(t) => self
                    .metrics
                    .inter_token_latency
                    .observe(now.duration_since(t).as_secs_f64()),
            }
            seq.last_token_at = Some(now);
            (seq.sink)(Event::Token {
                id: token,
                logprobs,
            });
            let g = seq.generated();
            let reason = if g >= seq.request.min_tokens && seq.request.stop_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if g >= seq.request.max_tokens || seq.tokens.len() > self.cfg.context {
                // The newest token would be fed at position `tokens.len() - 1`.
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                done.push((id, reason));
            }
        }
        self.metrics.generated(generated, now);
        for (id, reason) in done {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let seq = self.running.remove(i);
                self.finish(seq, reason);
            }
        }
        self.update_gauges();
    }

    fn finish(&mut self, mut seq: Seq, reason: FinishReason) {
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        self.metrics
            .finished
            .with_label_values(&[label(reason)])
            .inc();
        // The gauges say the request is gone before its client hears that it is.
        self.update_gauges();
        let usage = seq.usage();
        (seq.sink)(Event::Finished { reason, usage });
    }

    fn update_gauges(&mut self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        self.metrics.kv_blocks_in_use.set(self.pool.in_use() as i64);
    }
}

/// The chosen token's log-probability and the `k` most likely tokens', from raw logits.
pub fn logprobs_of(logits: &[f32], chosen: usize, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |t: usize| (logits[t] as f64 - log_z) as f32;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(logits.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
        });
        order.truncate(k);
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    } else {
        order.clear();
    }
    TokenLogprobs {
        logprob: lp(chosen),
        top: order.into_iter().map(|t| (t as i64, lp(t))).collect(),
    }
}
