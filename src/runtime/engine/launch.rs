//! Starting an engine over a plan: the pool's size from the memory it may take, the
//! context it can hold, and the ranks as threads (any backend) with the leading rank's
//! scheduler, while a client (the HTTP server, `tpc run`) uses the engine's handle on a
//! thread of its own.

use super::api::{ModelInfo, Serving};
use super::driver::{follow, lead, Command, Shared};
use super::handle::{Admission, EngineHandle};
use super::metrics::Metrics;
use super::rank::{ExpertWatch, RankSteps};
use super::replicas::ReplicaSet;
use super::scheduler::{Scheduler, SchedulerConfig};
use crate::plan::Plan;
use crate::runtime::backend::Backend;
use crate::runtime::collectives::Collectives;
use crate::runtime::error::{Result, RunError};
use crate::runtime::expert_exchange::ExpertSeat;
use crate::runtime::generate::RankRuntime;
use crate::runtime::launch::{check_replicas, launch_sharing_experts};
use crate::runtime::weights::WeightSource;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// The engine's settings (`tpc serve` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Token slots per KV block.
    pub block_size: usize,
    /// Bytes of KV cache per rank; `None`: from the memory available.
    pub kv_cache_memory: Option<u64>,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    pub prefix_caching: bool,
    /// Positions a request may reach; `None`: the model's.
    pub max_model_len: Option<usize>,
    /// The name clients give as `model`.
    pub model_name: String,
    /// Deal each tp rank's experts over the replicas (`--ep`, with more than one replica):
    /// they answer each other's mixture-of-experts rounds, between requests too.
    pub expert_parallel: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            block_size: 16,
            kv_cache_memory: None,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_waiting: 1024,
            prefix_caching: true,
            max_model_len: None,
            model_name: "model".into(),
            expert_parallel: false,
        }
    }
}

/// Default KV memory when none is given: half of what the host has available after the
/// weights, shared by the ranks on it, at most this per rank.
const DEFAULT_KV_PER_RANK: u64 = 4 << 30;

fn refuse(problem: String) -> RunError {
    RunError::BadInstruction {
        name: "engine".into(),
        problem,
    }
}

/// Bytes one token's keys and values take on the rank that stores the most (f32). With
/// pipeline stages a rank keeps only its stage's layers' caches, so the pool's blocks are
/// sized by the stages' ranks, not by whole tp ranks (that would give a pool of pp times
/// fewer blocks than the memory holds).
pub fn kv_bytes_per_token(plan: &Plan) -> u64 {
    let summary = crate::plan::report::summarize(plan);
    let per_element = plan.dtype.size_bytes().max(1);
    let per_rank: Vec<u64> = if summary.stages.is_empty() {
        summary.kv_cache_bytes_per_token_per_rank
    } else {
        summary
            .stages
            .iter()
            .flat_map(|s| s.kv_cache_bytes_per_token_per_rank.iter().copied())
            .collect()
    };
    per_rank
        .iter()
        .map(|&b| b.saturating_mul(4) / per_element)
        .max()
        .unwrap_or(0)
}

/// Bytes of KV cache per rank: `--kv-cache-memory`, else half of what this host has free
/// after `weight_bytes` of weights, shared by its `ranks_on_host` ranks, at most
/// [`DEFAULT_KV_PER_RANK`].
pub(crate) fn kv_memory(opts: &EngineOptions, ranks_on_host: usize, weight_bytes: u64) -> u64 {
    match opts.kv_cache_memory {
        Some(m) => m,
        None => {
            let available = crate::runtime::memory::available_bytes().unwrap_or(8 << 30);
            let spare = available.saturating_sub(weight_bytes) / 2;
            (spare / ranks_on_host.max(1) as u64).min(DEFAULT_KV_PER_RANK)
        }
    }
}

/// What an engine over `plan` is made of before its ranks start.
pub struct EngineSetup {
    pub handle: Arc<EngineHandle>,
    scheduler: Scheduler,
    commands: Receiver<Command>,
    shared: Arc<Shared>,
    pub block_size: usize,
    pub blocks: usize,
}

/// Sizes the pool (`ranks_on_host` ranks share this host's memory, `weight_bytes` of
/// weights in all) and makes the scheduler and the handle.
pub fn prepare(
    plan: &Plan,
    opts: &EngineOptions,
    ranks_on_host: usize,
    weight_bytes: u64,
    metrics: Metrics,
) -> Result<EngineSetup> {
    if opts.block_size == 0 || opts.block_size > 1024 {
        return Err(refuse(format!(
            "--block-size {}: give 1 to 1024 token slots (16 is usual)",
            opts.block_size
        )));
    }
    if opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
        return Err(refuse(
            "--max-num-seqs and --max-num-batched-tokens must be at least 1".into(),
        ));
    }
    let per_token = kv_bytes_per_token(plan).max(1);
    let block_bytes = per_token.saturating_mul(opts.block_size as u64);
    let memory = kv_memory(opts, ranks_on_host, weight_bytes);
    let model_context = [plan.max_positions, plan.attention_window]
        .into_iter()
        .flatten()
        .min()
        .map(|m| usize::try_from(m).unwrap_or(usize::MAX));
    if let (Some(asked), Some(model)) = (opts.max_model_len, model_context) {
        if asked > model {
            return Err(refuse(format!(
                "--max-model-len {asked} is past the model's {model} positions; give at most {model}"
            )));
        }
    }
    let context = opts.max_model_len.or(model_context);
    // No more blocks than every sequence at its longest needs (and ids pass between ranks
    // exactly below 2^24).
    let useful = context
        .map(|c| {
            c.div_ceil(opts.block_size)
                .saturating_mul(opts.max_num_seqs)
        })
        .unwrap_or(usize::MAX)
        .min((1 << 24) - 1);
    let blocks = usize::try_from(memory / block_bytes)
        .unwrap_or(usize::MAX)
        .min(useful);
    if blocks == 0 {
        return Err(refuse(format!(
            "--kv-cache-memory {memory} bytes holds no KV block ({block_bytes} bytes: {} tokens of {per_token} bytes); give at least {block_bytes}",
            opts.block_size
        )));
    }
    let pool_tokens = blocks.saturating_mul(opts.block_size);
    let context = context.unwrap_or(pool_tokens).min(pool_tokens);
    let vocab = crate::runtime::generate::plan_vocab(plan)?;
    let scheduler = Scheduler::with_metrics(
        SchedulerConfig {
            max_num_seqs: opts.max_num_seqs,
            max_num_batched_tokens: opts.max_num_batched_tokens,
            block_size: opts.block_size,
            blocks,
            prefix_caching: opts.prefix_caching,
            context,
            prompt_logits: Default::default(),
            gather_logits: false,
        },
        metrics,
    );
    let (tx, commands) = channel();
    let shared = Arc::new(Shared::default());
    let handle = Arc::new(EngineHandle::new(
        ModelInfo {
            name: opts.model_name.clone(),
            vocab,
            context,
        },
        Admission {
            max_waiting: opts.max_waiting,
            block_size: opts.block_size,
            blocks,
        },
        tx,
        shared.clone(),
        &scheduler.metrics,
    ));
    Ok(EngineSetup {
        handle,
        scheduler,
        commands,
        shared,
        block_size: opts.block_size,
        blocks,
    })
}

/// One rank's part in a running engine, shared by the ranks of one engine (threads, or the
/// one rank of an MPI process): its slice of the pool, a barrier so that every rank has
/// loaded before a request is taken, then the leading rank's loop or a follower's.
pub(crate) struct RankBody {
    leader: Mutex<Option<(Scheduler, Receiver<Command>)>>,
    /// Where the leading rank waits for the other replicas' expert calls (`--ep`).
    watch: Mutex<Option<ExpertWatch>>,
    ready: Mutex<Option<Sender<()>>>,
    shared: Arc<Shared>,
    block_size: usize,
    blocks: usize,
}

impl RankBody {
    /// Runs this rank of the engine until it stops.
    pub(crate) fn run<B: Backend, C: Collectives<B::Act>>(
        &self,
        rt: &mut RankRuntime<'_, B, C>,
    ) -> Result<()> {
        // A rank that fails releases the replicas that share its experts.
        let mut guard =
            crate::runtime::expert_exchange::LeaveUnlessDone(rt.exec.expert_member().cloned());
        let out = self.steps(rt);
        if out.is_ok() {
            guard.0 = None;
        }
        out
    }

    /// The leading rank's loop or a follower's, once every rank has loaded.
    fn steps<B: Backend, C: Collectives<B::Act>>(
        &self,
        rt: &mut RankRuntime<'_, B, C>,
    ) -> Result<()> {
        rt.exec.set_kv_pool(self.block_size, self.blocks)?;
        // Every rank has loaded before a request is taken.
        rt.exec.comm.barrier()?;
        if let Some(link) = rt.exec.link.as_mut() {
            link.comm.barrier()?;
        }
        if !rt.leads {
            return follow(&mut RankSteps { rt, watch: None });
        }
        let (mut scheduler, commands) = self
            .leader
            .lock()
            .ok()
            .and_then(|mut l| l.take())
            .ok_or_else(|| refuse("two leading ranks (a bug in tpc)".into()))?;
        if let Some(tx) = self.ready.lock().ok().and_then(|mut r| r.take()) {
            let _ = tx.send(());
        }
        lead(
            &mut RankSteps {
                rt,
                watch: self.watch.lock().ok().and_then(|mut w| w.take()),
            },
            &mut scheduler,
            &commands,
            &self.shared,
        )
    }
}

/// Runs the engine of `setup`: `ranks` runs every rank of it that lives in this process,
/// each through the [`RankBody`] it is given. Once the leading rank has loaded (and every
/// rank with it), `client` runs on a thread of its own with the handle and a receiver that
/// disconnects when the engine stops; a process without the leading rank never starts it.
/// Returns when the engine has stopped (drained, or the client's handle dropped and the
/// running requests ended) and the client has returned: the engine's result and the
/// client's (`None` if it never started).
pub(crate) fn serve_with<T: Send>(
    setup: EngineSetup,
    watch: Option<ExpertWatch>,
    client: impl FnOnce(Arc<EngineHandle>, Receiver<()>) -> T + Send,
    ranks: impl FnOnce(&RankBody) -> Result<()>,
) -> (Result<()>, Option<T>) {
    let EngineSetup {
        handle,
        scheduler,
        commands,
        shared,
        block_size,
        blocks,
    } = setup;
    let (ready_tx, ready_rx) = channel::<()>();
    let (stopped_tx, stopped_rx) = channel::<()>();
    let body = RankBody {
        leader: Mutex::new(Some((scheduler, commands))),
        watch: Mutex::new(watch),
        ready: Mutex::new(Some(ready_tx)),
        shared: shared.clone(),
        block_size,
        blocks,
    };
    std::thread::scope(|s| {
        let client_thread = s.spawn(move || {
            ready_rx.recv().ok()?;
            Some(client(handle, stopped_rx))
        });
        let result = ranks(&body);
        if let Err(e) = &result {
            shared.stop(e.to_string());
        }
        // The client learns that the engine is gone (or never came).
        drop(body);
        drop(stopped_tx);
        let client = client_thread.join().ok().flatten();
        (result, client)
    })
}

/// Runs the engine of `setup` on every rank of `plan` as threads (the backends `backend`
/// makes, the communicators given, as [`crate::runtime::launch::launch_stages`] takes
/// them); `client` as [`serve_with`] runs it. With a `seat` the replica shares its experts
/// with the others (`--ep`): each rank loads only its own, the leading rank watches for
/// their calls, and once the replica has stopped, for whatever reason, it leaves the
/// exchange so that no other replica waits on it.
#[allow(clippy::too_many_arguments)]
pub fn serve_threads<B, C, T>(
    plan: &Plan,
    weights: &dyn WeightSource,
    comms: Vec<C>,
    pipes: Vec<C>,
    backend: &(dyn Fn(usize) -> Result<B> + Sync),
    seat: Option<&ExpertSeat>,
    setup: EngineSetup,
    client: impl FnOnce(Arc<EngineHandle>, Receiver<()>) -> T + Send,
) -> (Result<()>, Option<T>)
where
    B: Backend,
    C: Collectives<B::Act>,
    T: Send,
{
    let watch = match seat {
        Some(seat) => match first_stage_with_experts(plan) {
            Some(stage) => seat
                .member(stage * plan.ranks.len())
                .map(ExpertWatch::Exchange),
            None => None,
        },
        None => None,
    };
    let out = serve_with(setup, watch, client, |body| {
        launch_sharing_experts(plan, weights, comms, pipes, seat, backend, &|rt| {
            body.run(rt)
        })
    });
    if let Some(seat) = seat {
        seat.leave("its engine stopped");
    }
    out
}

/// The first pipeline stage of `plan` whose program has mixture-of-experts layers: where
/// another replica's forward call first needs this one's experts.
fn first_stage_with_experts(plan: &Plan) -> Option<usize> {
    if plan.pp() <= 1 {
        return plan
            .ranks
            .first()
            .is_some_and(|p| p.has_experts())
            .then_some(0);
    }
    (0..plan.pp()).find(|&s| {
        crate::plan::stages::stage_program(plan, 0, s).is_ok_and(|sp| sp.program.has_experts())
    })
}

/// The ranks' layout of an engine over `plan` with `dp` replicas: "tp=2 pp=1 dp=2", with
/// " ep=4" (the EP group's size) where the replicas share their experts.
pub fn layout_line(plan: &Plan, dp: usize, opts: &EngineOptions) -> String {
    let mut line = format!("tp={} pp={} dp={dp}", plan.tp, plan.pp());
    if opts.expert_parallel && dp > 1 {
        line.push_str(&format!(" ep={}", dp.saturating_mul(plan.ranks.len())));
    }
    line
}

/// The seats of the EP group when `opts` deals the experts over `dp` replicas (`--ep` and
/// more than one replica), or why they cannot be.
pub(crate) fn serving_seats(
    plan: &Plan,
    opts: &EngineOptions,
    dp: usize,
) -> Result<Option<Vec<ExpertSeat>>> {
    if !opts.expert_parallel || dp < 2 {
        return Ok(None);
    }
    crate::runtime::ep_group::expert_seats_for(plan, dp).map(Some)
}

/// How a replica's client is handed its engine: once its ranks have loaded, its handle and
/// a receiver that disconnects when it stops.
pub(crate) type HandOver = Box<dyn FnOnce(Arc<EngineHandle>, Receiver<()>) + Send>;

/// `dp` engines as threads of this process behind one [`Serving`]: `setup(metrics)` makes
/// each replica's engine (its metrics labelled with its index when there are several, in
/// one registry), `run_replica(r, setup, hand_over)` runs replica `r` to its end, calling
/// `hand_over` once its ranks have loaded ([`serve_threads`] does). `client` runs once every
/// replica has, with the engines (one replica: its handle; more: a [`ReplicaSet`] sending
/// each request to the least loaded) and a receiver that hears (or disconnects) when one
/// stops. Returns the first engine failure (the first replica's that failed of its own
/// accord), else Ok, and the client's result.
pub(crate) fn serve_replicas<T: Send>(
    dp: usize,
    setup: &dyn Fn(Metrics) -> Result<EngineSetup>,
    run_replica: &(dyn Fn(usize, EngineSetup, HandOver) -> Result<()> + Sync),
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    let registry = Arc::new(prometheus::Registry::new());
    let setups = (0..dp)
        .map(|r| {
            setup(Metrics::in_registry(
                registry.clone(),
                (dp > 1).then_some(r),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let (ready_tx, ready_rx) = channel::<(usize, Arc<EngineHandle>, Receiver<()>)>();
    Ok(std::thread::scope(|s| {
        let engines: Vec<_> = setups
            .into_iter()
            .enumerate()
            .map(|(r, setup)| {
                let ready = ready_tx.clone();
                s.spawn(move || {
                    let hand_over: HandOver = Box::new(move |handle, stopped| {
                        let _ = ready.send((r, handle, stopped));
                    });
                    run_replica(r, setup, hand_over)
                })
            })
            .collect();
        drop(ready_tx);
        let mut ready: Vec<(usize, Arc<EngineHandle>, Receiver<()>)> =
            ready_rx.iter().take(dp).collect();
        let client_result = if ready.len() == dp {
            ready.sort_by_key(|(r, _, _)| *r);
            let (mut fronts, stops): (Vec<Arc<dyn Serving>>, Vec<_>) = ready
                .into_iter()
                .map(|(_, handle, stopped)| (handle as Arc<dyn Serving>, stopped))
                .unzip();
            // Any replica that stops stops the client.
            let stop_rx = any_stops(stops);
            let front: Arc<dyn Serving> = if dp == 1 {
                fronts.remove(0)
            } else {
                Arc::new(ReplicaSet::new(fronts, registry))
            };
            Some(client(front, stop_rx))
        } else {
            // A replica did not start: the others stop when their handles go.
            drop(ready);
            None
        };
        let mut outcomes: Vec<Result<()>> = engines
            .into_iter()
            .enumerate()
            .map(|(r, e)| {
                e.join().unwrap_or_else(|_| {
                    Err(RunError::RankPanicked {
                        rank: r,
                        message: "an engine thread panicked".into(),
                    })
                })
            })
            .collect();
        // A replica that only learnt that another had stopped is not the cause.
        let result = match crate::runtime::ep_group::failing_replica(&outcomes) {
            Some(r) => outcomes.swap_remove(r),
            None => Ok(()),
        };
        (result, client_result)
    }))
}

/// A receiver that hears (or disconnects) once any of `stops` does (each disconnects when
/// its engine stops).
pub(crate) fn any_stops(stops: impl IntoIterator<Item = Receiver<()>>) -> Receiver<()> {
    let (tx, rx) = channel();
    for stop in stops {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let _ = stop.recv();
            let _ = tx.send(());
        });
    }
    rx
}

/// Engines over `plan` on CPU ranks, `dp` replicas of them (each its own ranks and copy of
/// the weights) behind one [`Serving`]: each rank a thread with cores / (ranks · dp)
/// compute threads (pinned with `--pin`, one replica only), bf16 linear weights as `dtype`
/// says. The pool's default size leaves room for every rank's weights. `client` runs as
/// [`serve_replicas`] runs it. Returns the first engine failure, else Ok, and the client's
/// result.
pub fn serve_cpu<T: Send>(
    plan: &Plan,
    weights: &dyn WeightSource,
    cpu: &crate::runtime::cpu::CpuOptions,
    dtype: crate::runtime::generate::ComputeDtype,
    opts: &EngineOptions,
    dp: usize,
    client: impl FnOnce(Arc<dyn Serving>, Receiver<()>) -> T + Send,
) -> Result<(Result<()>, Option<T>)> {
    check_replicas(dp)?;
    if dp > 1 && cpu.pin_threads {
        return Err(RunError::Replicas(
            "--pin places every replica's ranks on the same cores; use it with --dp 1".into(),
        ));
    }
    weights.check(plan)?;
    let ranks = plan.world().saturating_mul(dp);
    let threads = cpu.threads_per_rank(ranks);
    let bf16 = dtype.bf16_linears(plan);
    let kernels = crate::runtime::cpu::isa::Kernels::select(cpu.isa)?;
    let seats = serving_seats(plan, opts, dp)?;
    let weight_bytes =
        crate::runtime::memory::copies_weight_bytes(plan, bf16, dp as u64, seats.is_some());
    let make = |rank: usize| {
        crate::runtime::cpu_rank::placed_cpu_backend(rank, threads, cpu.pin_threads, bf16, kernels)
    };
    let run_replica = |r: usize, setup: EngineSetup, hand_over: HandOver| {
        let (comms, pipes) = crate::runtime::launch::local_groups(plan)?;
        let seat = seats.as_ref().and_then(|s| s.get(r));
        serve_threads(plan, weights, comms, pipes, &make, seat, setup, hand_over).0
    };
    let setup = |metrics| prepare(plan, opts, ranks, weight_bytes, metrics);
    serve_replicas(dp, &setup, &run_replica, client)
}
