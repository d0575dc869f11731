//! The scheduler, block pool and engine loop over a toy model that keeps a real paged
//! cache of token ids and derives each next token from the whole history it reads back
//! through the block table: a wrong table, a shared block written over, a chunk at the wrong
//! position or a preempted sequence resumed wrongly all change the tokens.

use super::api::{Event, FinishReason, GenRequest, Serving, SubmitError};
use super::driver::{follow, lead, Command, Shared, StepRunner};
use super::handle::{Admission, EngineHandle};
use super::scheduler::{Scheduler, SchedulerConfig, StepOutput};
use super::step::{Exchange, PlannedSeq, StepMessage};
use crate::runtime::error::{Result, RunError};
use crate::runtime::sampling::Sampling;
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

const VOCAB: usize = 97;

/// The toy model's next token after `history`.
fn toy_next(history: &[i64]) -> i64 {
    let mut h: u64 = 1469598103934665603;
    for &t in history {
        h = (h ^ t as u64).wrapping_mul(1099511628211);
    }
    (h % VOCAB as u64) as i64
}

/// A request's tokens generated alone: what every batching must reproduce.
fn solo(prompt: &[i64], max_tokens: usize, stop: &[i64]) -> Vec<i64> {
    let mut tokens = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let t = toy_next(&tokens);
        tokens.push(t);
        out.push(t);
        if stop.contains(&t) {
            break;
        }
    }
    out
}

/// A paged cache of token ids, written and read through block tables as the kernels do.
struct PagedToy {
    block_size: usize,
    slots: Vec<Option<i64>>,
    steps: usize,
}

impl PagedToy {
    fn new(blocks: usize, block_size: usize) -> PagedToy {
        PagedToy {
            block_size,
            slots: vec![None; blocks * block_size],
            steps: 0,
        }
    }
    fn slot(&self, blocks: &[u32], p: usize) -> usize {
        blocks[p / self.block_size] as usize * self.block_size + p % self.block_size
    }
}

impl StepRunner for PagedToy {
    fn share(&mut self, message: Option<&StepMessage>) -> Result<StepMessage> {
        Ok(message.cloned().unwrap_or(StepMessage::Stop))
    }

    fn run(&mut self, seqs: &[PlannedSeq], exchange: Exchange) -> Result<Option<StepOutput>> {
        self.steps += 1;
        let mut picks = Vec::new();
        // With every position's logits, each position's next token.
        let mut every = Vec::new();
        for s in seqs {
            let end = s.start + s.tokens.len();
            assert!(s.blocks.len() * self.block_size >= end, "table too short");
            for (j, &t) in s.tokens.iter().enumerate() {
                let at = self.slot(&s.blocks, s.start + j);
                self.slots[at] = Some(t);
            }
            let history: Vec<i64> = (0..end)
                .map(|p| self.slots[self.slot(&s.blocks, p)].expect("a position never written"))
                .collect();
            every.extend((s.start..end).map(|e| toy_next(&history[..=e]) as usize));
            picks.push(toy_next(&history) as usize);
        }
        let logits = |rows: &[usize]| {
            let mut data = vec![0.0; rows.len() * VOCAB];
            for (r, &p) in rows.iter().enumerate() {
                data[r * VOCAB + p] = 30.0;
            }
            StepOutput::Logits { data, vocab: VOCAB }
        };
        Ok(Some(match exchange {
            Exchange::Argmax => StepOutput::Argmax(picks),
            Exchange::Logits => logits(&picks),
            Exchange::AllLogits => logits(&every),
            Exchange::TopK(k) => StepOutput::Candidates(
                picks
                    .iter()
                    .map(|&p| {
                        (0..VOCAB.min(k))
                            .map(|c| (if c == 0 { 30.0 } else { 0.0 }, (p + c) % VOCAB))
                            .collect()
                    })
                    .collect(),
            ),
        }))
    }

    fn locate(&mut self, sequence: usize, step: usize, _: &[i64]) -> RunError {
        RunError::Pipeline(format!("toy: sequence {sequence} step {step}"))
    }
}

type Log = Arc<Mutex<HashMap<u64, Vec<Event>>>>;

fn sink(log: &Log, id: u64) -> super::api::EventSink {
    let log = log.clone();
    Box::new(move |e| log.lock().unwrap().entry(id).or_default().push(e))
}

fn request(prompt: Vec<i64>, max_tokens: usize) -> GenRequest {
    GenRequest {
        prompt,
        max_tokens,
        min_tokens: 0,
        sampling: Sampling::default(),
        stop_ids: vec![],
        logprobs: None,
    }
}

fn tokens_of(events: &[Event]) -> Vec<i64> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

fn finish_of(events: &[Event]) -> Option<FinishReason> {
    match events.last() {
        Some(Event::Finished { reason, .. }) => Some(*reason),
        _ => None,
    }
}

fn prompt(seed: i64, len: usize) -> Vec<i64> {
    (0..len as i64)
        .map(|i| (seed * 31 + i * 7) % VOCAB as i64)
        .collect()
}

/// Runs `arrivals` (step at which it arrives, request) through a scheduler over the toy
/// model; returns each request's events and the scheduler.
fn run_arrivals(cfg: SchedulerConfig, arrivals: Vec<(usize, GenRequest)>) -> (Log, Scheduler) {
    let mut model = PagedToy::new(cfg.blocks, cfg.block_size);
    let mut scheduler = Scheduler::new(cfg);
    let log: Log = Default::default();
    let mut pending: Vec<(usize, u64, GenRequest)> = arrivals
        .into_iter()
        .enumerate()
        .map(|(i, (at, r))| (at, i as u64, r))
        .collect();
    let mut step = 0;
    loop {
        pending.retain(|(at, id, r)| {
            if *at <= step {
                scheduler.add(*id, r.clone(), sink(&log, *id), Instant::now());
                false
            } else {
                true
            }
        });
        match scheduler.schedule() {
            Some(StepMessage::Step { seqs, exchange }) => {
                let out = model.run(&seqs, exchange).unwrap().unwrap();
                scheduler.complete(out, Instant::now());
            }
            _ if pending.is_empty() && scheduler.is_idle() => break,
            _ => {}
        }
        step += 1;
        assert!(step < 100_000, "the engine does not finish");
    }
    (log, scheduler)
}

fn config(blocks: usize, block_size: usize, budget: usize, seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: budget,
        block_size,
        blocks,
        prefix_caching: true,
        context: 1000,
        prompt_logits: Default::default(),
        gather_logits: false,
    }
}

/// Requests of many lengths arriving over time, some sharing prefixes.
fn mixed_arrivals() -> Vec<(usize, GenRequest)> {
    let shared = prompt(5, 40);
    (0..24)
        .map(|i| {
            let mut p = if i % 3 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            p.extend(prompt(i as i64, 1 + (i * 13) % 37));
            (i * 3 % 17, request(p, 1 + (i * 7) % 23))
        })
        .collect()
}

/// Each request got its solo tokens, as many as `context` positions allow.
fn check_solo(log: &Log, arrivals: &[(usize, GenRequest)], context: usize) {
    let log = log.lock().unwrap();
    for (i, (_, r)) in arrivals.iter().enumerate() {
        let events = &log[&(i as u64)];
        let fits = (context + 1).saturating_sub(r.prompt.len());
        assert_eq!(
            tokens_of(events),
            solo(&r.prompt, r.max_tokens.min(fits), &r.stop_ids),
            "request {i}"
        );
        assert_eq!(finish_of(events), Some(FinishReason::Length), "request {i}");
    }
}

#[test]
fn every_request_gets_its_solo_tokens_however_it_is_batched() {
    let arrivals = mixed_arrivals();
    // (blocks, block size, token budget, max seqs): roomy; chunked prefill forced small;
    // a pool so small that preemption happens; one sequence at a time; block size 1.
    for (blocks, bs, budget, seqs) in [
        (400, 16, 2048, 256),
        (400, 4, 5, 8),
        (12, 8, 64, 16),
        (9, 16, 7, 4),
        (60, 1, 3, 3),
        (200, 16, 512, 1),
    ] {
        let (log, scheduler) = run_arrivals(config(blocks, bs, budget, seqs), arrivals.clone());
        check_solo(&log, &arrivals, blocks * bs);
        assert_eq!(scheduler.blocks_in_use(), 0, "blocks left in use");
        if blocks == 12 {
            assert!(
                scheduler.metrics.preemptions.get() > 0,
                "the small pool was meant to preempt"
            );
        }
    }
}

#[test]
fn a_shared_prefix_is_computed_once_and_gives_the_same_tokens() {
    let long = prompt(9, 64);
    let mut second = long.clone();
    second.extend([1, 2, 3]);
    let arrivals = vec![(0, request(long.clone(), 4)), (40, request(second, 4))];
    let (log, scheduler) = run_arrivals(config(64, 16, 4096, 8), arrivals.clone());
    check_solo(&log, &arrivals, 1000);
    // 64 + 3 prompt tokens, of which the second request's first 64 (four full blocks) hit.
    assert_eq!(scheduler.metrics.prompt_tokens_computed.get(), 64 + 3);
    assert_eq!(scheduler.metrics.prefix_hit_tokens.get(), 64);
    let log = log.lock().unwrap();
    match log[&1].last() {
        Some(Event::Finished { usage, .. }) => assert_eq!(usage.cached_prompt_tokens, 64),
        other => panic!("{other:?}"),
    }
    // Without prefix caching everything is computed.
    let mut off = config(64, 16, 4096, 8);
    off.prefix_caching = false;
    let (log2, scheduler) = run_arrivals(off, arrivals.clone());
    check_solo(&log2, &arrivals, 1000);
    assert_eq!(scheduler.metrics.prompt_tokens_computed.get(), 64 + 67);
}

#[test]
fn a_prompt_fully_cached_still_computes_its_last_token() {
    let p = prompt(3, 32);
    let arrivals = vec![(0, request(p.clone(), 3)), (20, request(p, 3))];
    let (log, scheduler) = run_arrivals(config(32, 16, 4096, 8), arrivals.clone());
    check_solo(&log, &arrivals, 1000);
    // The second prompt reuses its first block only: its last block holds the token whose
    // logits it needs.
    assert_eq!(scheduler.metrics.prefix_hit_tokens.get(), 16);
}

#[test]
fn stop_ids_min_tokens_and_the_context_end_requests() {
    let p = prompt(1, 5);
    let first = solo(&p, 8, &[])[2];
    let mut stop = request(p.clone(), 8);
    stop.stop_ids = vec![first];
    let mut min = stop.clone();
    min.min_tokens = 8;
    let mut cfg = config(64, 4, 64, 8);
    cfg.context = 9;
    let arrivals = vec![(0, stop), (0, min), (0, request(p.clone(), 100))];
    let (log, _) = run_arrivals(cfg, arrivals);
    let log = log.lock().unwrap();
    assert_eq!(tokens_of(&log[&0]).len(), 3);
    assert_eq!(finish_of(&log[&0]), Some(FinishReason::Stop));
    assert_eq!(
        tokens_of(&log[&1]).len(),
        5,
        "context 9 = 5 prompt + 4 fed tokens"
    );
    assert_eq!(finish_of(&log[&1]), Some(FinishReason::Length));
    assert_eq!(tokens_of(&log[&2]), solo(&p, 5, &[]));
}

#[test]
fn cancelling_a_waiting_or_running_request_frees_its_blocks() {
    let mut model = PagedToy::new(32, 4);
    let mut s = Scheduler::new(config(32, 4, 64, 1));
    let log: Log = Default::default();
    s.add(0, request(prompt(1, 9), 50), sink(&log, 0), Instant::now());
    s.add(1, request(prompt(2, 9), 50), sink(&log, 1), Instant::now());
    for _ in 0..3 {
        let Some(StepMessage::Step { seqs, exchange }) = s.schedule() else {
            panic!()
        };
        let out = model.run(&seqs, exchange).unwrap().unwrap();
        s.complete(out, Instant::now());
    }
    assert!(s.blocks_in_use() > 0);
    s.cancel(1);
    s.cancel(0);
    s.cancel(7);
    assert!(s.is_idle());
    assert_eq!(s.blocks_in_use(), 0);
    let log = log.lock().unwrap();
    assert_eq!(finish_of(&log[&0]), Some(FinishReason::Cancelled));
    assert_eq!(finish_of(&log[&1]), Some(FinishReason::Cancelled));
    assert_eq!(tokens_of(&log[&1]), Vec::<i64>::new());
}

#[test]
fn logprobs_and_sampling_ask_for_logits_and_report_them() {
    let mut r = request(prompt(4, 6), 3);
    r.logprobs = Some(2);
    let arrivals = vec![(0, r.clone()), (0, request(prompt(5, 6), 3))];
    let (log, _) = run_arrivals(config(32, 4, 64, 8), arrivals.clone());
    check_solo(&log, &arrivals, 1000);
    let log = log.lock().unwrap();
    for e in &log[&0] {
        if let Event::Token { id, logprobs } = e {
            let lp = logprobs.as_ref().expect("logprobs asked for");
            assert_eq!(lp.top.len(), 2);
            assert_eq!(lp.top[0].0, *id, "the toy's pick is its most likely token");
            assert!(lp.logprob > -1e-3 && lp.logprob <= 0.0);
        }
    }
}

#[test]
fn a_non_finite_row_fails_its_request_and_the_others_go_on() {
    let mut model = PagedToy::new(32, 4);
    let mut s = Scheduler::new(config(32, 4, 64, 8));
    let log: Log = Default::default();
    let arrivals: Vec<GenRequest> = (0..3).map(|i| request(prompt(i, 5), 4)).collect();
    for (i, r) in arrivals.iter().enumerate() {
        s.add(i as u64, r.clone(), sink(&log, i as u64), Instant::now());
    }
    let mut first = true;
    while let Some(StepMessage::Step { seqs, exchange }) = s.schedule() {
        let out = if first {
            first = false;
            StepOutput::NonFinite {
                row: 1,
                origin: "layer 0".into(),
            }
        } else {
            model.run(&seqs, exchange).unwrap().unwrap()
        };
        s.complete(out, Instant::now());
    }
    let log = log.lock().unwrap();
    assert!(matches!(log[&1].last(), Some(Event::Failed { .. })));
    for i in [0u64, 2] {
        assert_eq!(
            tokens_of(&log[&i]),
            solo(&arrivals[i as usize].prompt, 4, &[])
        );
    }
    assert_eq!(s.blocks_in_use(), 0);
}

/// A runner whose leader shares steps with one follower thread over a channel pair, like
/// two ranks.
struct Pair {
    model: PagedToy,
    to: Option<mpsc::Sender<StepMessage>>,
    from: Option<mpsc::Receiver<StepMessage>>,
    fail_at: Option<usize>,
}

impl StepRunner for Pair {
    fn share(&mut self, message: Option<&StepMessage>) -> Result<StepMessage> {
        match (message, &self.to, &self.from) {
            (Some(m), Some(to), _) => {
                to.send(m.clone())
                    .map_err(|_| RunError::Pipeline("gone".into()))?;
                Ok(m.clone())
            }
            (None, _, Some(from)) => from.recv().map_err(|_| RunError::Pipeline("gone".into())),
            _ => unreachable!(),
        }
    }
    fn run(&mut self, seqs: &[PlannedSeq], exchange: Exchange) -> Result<Option<StepOutput>> {
        if self.fail_at == Some(self.model.steps) {
            return Err(RunError::Pipeline("a rank failed".into()));
        }
        self.model.run(seqs, exchange)
    }
    fn locate(&mut self, sequence: usize, step: usize, tokens: &[i64]) -> RunError {
        self.model.locate(sequence, step, tokens)
    }
}

/// The leader's and the follower's results.
type Ranks = std::thread::JoinHandle<(Result<()>, Result<()>)>;

fn engine(
    cfg: SchedulerConfig,
    max_waiting: usize,
    fail_at: Option<usize>,
) -> (Arc<EngineHandle>, Ranks) {
    let (tx, rx) = mpsc::channel::<Command>();
    let shared = Arc::new(Shared::default());
    let scheduler = Scheduler::new(cfg.clone());
    let handle = Arc::new(EngineHandle::new(
        super::api::ModelInfo {
            name: "toy".into(),
            vocab: VOCAB as u64,
            context: cfg.context,
        },
        Admission {
            max_waiting,
            block_size: cfg.block_size,
            blocks: cfg.blocks,
        },
        tx,
        shared.clone(),
        &scheduler.metrics,
    ));
    let join = std::thread::spawn(move || {
        let (to, from) = mpsc::channel();
        let mut leader = Pair {
            model: PagedToy::new(cfg.blocks, cfg.block_size),
            to: Some(to),
            from: None,
            fail_at,
        };
        let mut other = Pair {
            model: PagedToy::new(cfg.blocks, cfg.block_size),
            to: None,
            from: Some(from),
            fail_at: None,
        };
        let follower = std::thread::spawn(move || follow(&mut other));
        let mut scheduler = scheduler;
        let led = lead(&mut leader, &mut scheduler, &rx, &shared);
        drop(leader);
        (led, follower.join().unwrap())
    });
    (handle, join)
}

fn collect(handle: &EngineHandle, r: GenRequest) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    handle
        .submit(
            r,
            Box::new(move |e| {
                let _ = tx.send(e);
            }),
        )
        .unwrap();
    rx
}

#[test]
fn the_engine_serves_concurrent_clients_and_stops_when_drained() {
    let (handle, join) = engine(config(40, 4, 16, 8), 1000, None);
    let arrivals = mixed_arrivals();
    let clients: Vec<_> = arrivals
        .iter()
        .map(|(_, r)| {
            let (h, r) = (handle.clone(), r.clone());
            std::thread::spawn(move || {
                let rx = collect(&h, r);
                rx.iter().collect::<Vec<Event>>()
            })
        })
        .collect();
    for (c, (_, r)) in clients.into_iter().zip(&arrivals) {
        let events = c.join().unwrap();
        assert_eq!(tokens_of(&events), solo(&r.prompt, r.max_tokens, &[]));
        assert_eq!(finish_of(&events), Some(FinishReason::Length));
    }
    assert_eq!(handle.blocks_in_use(), 0);
    handle.drain();
    assert_eq!(
        handle.submit(request(vec![1], 1), Box::new(|_| {})),
        Err(SubmitError::ShuttingDown)
    );
    let (led, followed) = join.join().unwrap();
    led.unwrap();
    followed.unwrap();
    assert_eq!(handle.load(), (0, 0));
}

#[test]
fn the_handle_refuses_what_cannot_run_with_the_reason() {
    let mut cfg = config(4, 4, 16, 8);
    cfg.context = 20;
    let (handle, join) = engine(cfg, 0, None);
    let refused = |p: Vec<i64>| handle.submit(request(p, 1), Box::new(|_| {}));
    assert_eq!(refused(vec![]), Err(SubmitError::EmptyPrompt));
    assert_eq!(
        refused(vec![1, 97]),
        Err(SubmitError::TokenOutOfRange {
            id: 97,
            position: 1,
            vocab: 97
        })
    );
    assert_eq!(
        refused(vec![1; 20]),
        Err(SubmitError::PromptTooLong {
            prompt: 20,
            context: 20
        })
    );
    assert_eq!(
        refused(vec![1; 16]),
        Err(SubmitError::PoolTooSmall {
            needed: 5,
            total: 4
        })
    );
    assert_eq!(
        refused(vec![1; 3]),
        Err(SubmitError::QueueFull { waiting: 0 })
    );
    handle.drain();
    join.join().unwrap().0.unwrap();
}

#[test]
fn a_failing_rank_fails_every_request_and_later_submissions() {
    let (handle, join) = engine(config(40, 4, 16, 8), 100, Some(3));
    let rx = collect(&handle, request(prompt(1, 5), 50));
    let events: Vec<Event> = rx.iter().collect();
    assert!(
        matches!(events.last(), Some(Event::Failed { message }) if message.contains("a rank failed"))
    );
    let (led, _) = join.join().unwrap();
    assert!(led.is_err());
    match handle.submit(request(vec![1], 1), Box::new(|_| {})) {
        Err(SubmitError::Stopped(why)) => assert!(why.contains("a rank failed"), "{why}"),
        other => panic!("{other:?}"),
    }
}

mod batch {
    //! `tpc run`'s batch through the engine, over the toy model.
    use super::*;
    use crate::runtime::engine::batch::{batch_config, lead_batch, BatchRun};
    use crate::runtime::engine::scheduler::PromptLogits;
    use crate::runtime::generate::{Request, RunOptions};

    fn argmax(row: &[f32]) -> i64 {
        let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter().position(|&v| v == best).unwrap() as i64
    }

    fn requests() -> Vec<Request> {
        [
            (3, 5, Some(6)),
            (4, 40, None),
            (5, 1, Some(0)),
            (6, 17, Some(2)),
        ]
        .into_iter()
        .map(|(seed, len, new)| Request {
            prompt: prompt(seed, len),
            max_new_tokens: new,
        })
        .collect()
    }

    fn run(
        runner: &mut impl StepRunner,
        requests: &[Request],
        opts: &RunOptions,
    ) -> (Result<BatchRun>, Vec<(usize, Vec<i64>)>) {
        let cfg = batch_config(requests, opts).unwrap();
        let finished = Mutex::new(Vec::new());
        let out = lead_batch(runner, cfg, requests, opts, &|_| {}, &|i, t| {
            finished.lock().unwrap().push((i, t.to_vec()))
        });
        (out, finished.into_inner().unwrap())
    }

    #[test]
    fn a_batch_gives_each_request_its_solo_tokens_and_its_prompt_logits() {
        let requests = requests();
        for all in [true, false] {
            let opts = RunOptions {
                max_new_tokens: 9,
                all_prompt_logits: all,
                ..RunOptions::default()
            };
            let cfg = batch_config(&requests, &opts).unwrap();
            assert_eq!(cfg.max_num_batched_tokens, 5 + 40 + 1 + 17);
            let mut toy = PagedToy::new(cfg.blocks, cfg.block_size);
            let (out, mut finished) = run(&mut toy, &requests, &opts);
            let out = out.unwrap();
            // Every prompt in the first step, then one step per further token.
            assert_eq!(toy.steps, 9, "all={all}");
            finished.sort();
            for (i, r) in requests.iter().enumerate() {
                let limit = r.max_new_tokens.unwrap_or(9);
                let want = solo(&r.prompt, limit, &[]);
                assert_eq!(out.sequences[i].generated, want, "request {i}");
                assert_eq!(finished[i], (i, want));
                let logits = &out.sequences[i].prompt_logits;
                let rows = if all { r.prompt.len() } else { 1 };
                assert_eq!(logits.shape, vec![rows, VOCAB], "request {i}");
                for (k, row) in logits.data.chunks(VOCAB).enumerate() {
                    let upto = r.prompt.len() - rows + k + 1;
                    assert_eq!(
                        argmax(row),
                        toy_next(&r.prompt[..upto]),
                        "request {i} row {k}"
                    );
                }
            }
        }
    }

    #[test]
    fn steps_exchange_the_least_output_their_sequences_need() {
        let sampled = |top_k: Option<usize>, top_p: Option<f32>| Sampling {
            temperature: 0.7,
            top_k,
            top_p,
            ..Sampling::default()
        };
        let with = |s: Sampling| GenRequest {
            sampling: s,
            ..request(prompt(1, 3), 4)
        };
        let logprobs = GenRequest {
            logprobs: Some(2),
            ..request(prompt(2, 3), 4)
        };
        let cases: Vec<(Vec<GenRequest>, PromptLogits, bool, [Exchange; 2])> = vec![
            (
                vec![request(prompt(1, 3), 4)],
                PromptLogits::Off,
                false,
                [Exchange::Argmax; 2],
            ),
            (
                vec![
                    request(prompt(1, 3), 4),
                    with(sampled(Some(5), None)),
                    with(sampled(Some(3), Some(0.9))),
                ],
                PromptLogits::Off,
                false,
                [Exchange::TopK(5); 2],
            ),
            (
                vec![with(sampled(Some(5), None)), with(sampled(None, Some(0.9)))],
                PromptLogits::Off,
                false,
                [Exchange::Logits; 2],
            ),
            (
                vec![request(prompt(1, 3), 4), logprobs],
                PromptLogits::Off,
                false,
                [Exchange::Logits; 2],
            ),
            (
                vec![request(prompt(1, 3), 4)],
                PromptLogits::Off,
                true,
                [Exchange::Logits; 2],
            ),
            (
                vec![with(sampled(Some(5), None))],
                PromptLogits::All,
                false,
                [Exchange::AllLogits, Exchange::TopK(5)],
            ),
            (
                vec![request(prompt(1, 3), 4)],
                PromptLogits::Last,
                false,
                [Exchange::Logits, Exchange::Argmax],
            ),
        ];
        for (n, (reqs, prompt_logits, gather_logits, want)) in cases.into_iter().enumerate() {
            let cfg = SchedulerConfig {
                prompt_logits,
                gather_logits,
                ..config(64, 4, 64, 8)
            };
            let mut toy = PagedToy::new(cfg.blocks, cfg.block_size);
            let mut scheduler = Scheduler::new(cfg);
            let log: Log = Default::default();
            for (id, r) in reqs.iter().enumerate() {
                scheduler.add(id as u64, r.clone(), sink(&log, id as u64), Instant::now());
            }
            for (step, want) in want.iter().enumerate() {
                let Some(StepMessage::Step { seqs, exchange }) = scheduler.schedule() else {
                    panic!("case {n}: no step {step}");
                };
                assert_eq!(exchange, *want, "case {n} step {step}");
                let out = toy.run(&seqs, exchange).unwrap().unwrap();
                scheduler.complete(out, Instant::now());
            }
            // Sampling from top-k candidates gave every request its tokens.
            let log = log.lock().unwrap();
            for id in 0..reqs.len() as u64 {
                assert_eq!(tokens_of(&log[&id]).len(), 2, "case {n} request {id}");
            }
        }
    }

    /// The toy with row `row` of step `at` not finite; records what the leading rank shares.
    struct Poisoned {
        toy: PagedToy,
        at: usize,
        row: usize,
        shared: Vec<StepMessage>,
    }

    impl StepRunner for Poisoned {
        fn share(&mut self, message: Option<&StepMessage>) -> Result<StepMessage> {
            self.shared.extend(message.cloned());
            self.toy.share(message)
        }
        fn run(&mut self, seqs: &[PlannedSeq], exchange: Exchange) -> Result<Option<StepOutput>> {
            let out = self.toy.run(seqs, exchange)?;
            Ok(if self.toy.steps == self.at {
                Some(StepOutput::NonFinite {
                    row: self.row,
                    origin: String::new(),
                })
            } else {
                out
            })
        }
        fn locate(&mut self, sequence: usize, step: usize, tokens: &[i64]) -> RunError {
            self.toy.locate(sequence, step, tokens)
        }
    }

    #[test]
    fn logits_that_are_not_finite_stop_the_batch_where_every_rank_finds_their_op() {
        let requests = requests();
        // Prompt rows of every position in the first step: row 45 is request 2's only one.
        // Later steps have a row per live request: request 3 is the third at step 2.
        for (all, at, row, sequence, step) in [
            (true, 1, 45, 2, 0),
            (false, 1, 1, 1, 0),
            (false, 2, 2, 3, 1),
        ] {
            let opts = RunOptions {
                max_new_tokens: 9,
                all_prompt_logits: all,
                ..RunOptions::default()
            };
            let cfg = batch_config(&requests, &opts).unwrap();
            let mut runner = Poisoned {
                toy: PagedToy::new(cfg.blocks, cfg.block_size),
                at,
                row,
                shared: Vec::new(),
            };
            let (out, _) = run(&mut runner, &requests, &opts);
            let err = out.unwrap_err().to_string();
            assert!(
                err.contains(&format!("toy: sequence {sequence} step {step}")),
                "{err}"
            );
            let mut tokens = requests[sequence].prompt.clone();
            if step > 0 {
                tokens.extend(solo(&tokens, step, &[]));
            }
            assert_eq!(
                runner.shared.last(),
                Some(&StepMessage::Locate {
                    sequence,
                    step,
                    tokens
                })
            );
        }
    }
}
