//! One rank's executor: runs its program op by op on a [`Backend`], talking to the other
//! ranks only through its [`Collectives`]. It schedules (program order, liveness, in-place
//! reuse) and never touches values itself: every op, layout ops and KV-cache appends
//! included, is a backend call, so the same executor drives every device.
//!
//! A forward call takes a batch of sequences, each with its new tokens, the position they
//! start at and its block table in the rank's paged KV cache (one pool of blocks per
//! attention op): one prompt, a ragged batch of prompts or prompt chunks, or one new token
//! per live sequence. The serving engine gives the tables ([`RankExecutor::forward_steps`]);
//! callers that number their sequences instead (`generate`, tests) get tables from the
//! executor's own allocator ([`RankExecutor::forward`], [`RankExecutor::reserve`]).

use super::backend::{
    Activation, Backend, BackendError, BinaryOp, NormStep, ReduceNormError, Segment, WeightUse,
};
use super::collectives::{AllReduceTally, Collectives};
use super::error::{NonFiniteOp, Result, RunError};
use super::exact::{DepthOrder, LIMBS};
use super::moe::ExpertWeights;
use super::norm_steps::NormSteps;
use super::stage_link::StageLink;
use super::tensor::Tensor;
use super::weights::WeightSource;
use crate::ir::op::piece_window;
use crate::ir::{op_dims, Groups, InputKind, Layout, NumericsMode, Op, RopeOp, WeightOrder};
use crate::plan::{Instr, RankProgram};
use std::collections::{HashMap, HashSet};

/// `last_use` of a value a pipeline stage sends after its last instruction.
const PINNED: usize = usize::MAX - 1;

enum Value<A> {
    Ids(Vec<i64>),
    Act(A),
}

/// One row's top-k sampling candidates: (logit, token) pairs, best first.
pub type Candidates = Vec<(f32, usize)>;

/// Which rows of the model output a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputRows {
    /// Every row of every sequence (prompt logits).
    All,
    /// The last row of each sequence (what generation samples from); the LM head then
    /// computes nothing else.
    LastOfEach,
}

/// A rank with its weights loaded and its KV caches.
pub struct RankExecutor<'a, B: Backend, C: Collectives<B::Act>> {
    program: &'a RankProgram,
    backend: B,
    pub comm: C,
    tp: usize,
    rank: usize,
    /// Weights by value id, in the backend's layout.
    weights: HashMap<u32, B::Weight>,
    /// Linears that run as one product (`plan::fuse`), with their weights.
    fused: super::fused::FusedProducts<B::Weight, B::Act>,
    /// Per mixture-of-experts op, its experts' weights by routing column on this rank.
    experts: HashMap<u32, Vec<Option<ExpertWeights<B::Weight>>>>,
    /// Per attention op, its pool of KV blocks.
    pools: HashMap<u32, B::Kv>,
    /// Per attention op, its key and value widths per token.
    kv_widths: HashMap<u32, (usize, usize)>,
    block_size: usize,
    /// Blocks every pool has.
    pool_blocks: usize,
    /// Blocks `0..engine_blocks` are the serving engine's to hand out; the numbered
    /// sequences' own allocator takes blocks from there up.
    engine_blocks: usize,
    /// The next block the numbered sequences' allocator takes.
    next_block: usize,
    /// Numbered sequences: each one's block table and tokens cached.
    slots: Vec<Slot>,
    /// The linears that compute the output (the LM head): only row-wise ops lie between
    /// them and it, so they may run on the rows the caller wants alone.
    head_linears: Vec<u32>,
    /// Per parameter value id, the checkpoint tensor's rows (for embedding bounds).
    table_rows: HashMap<u32, u64>,
    /// Per value id, the index of the last instruction that reads it (`usize::MAX`: none):
    /// a value is released there, and an elementwise op that is its last reader works in
    /// place on it instead of on a copy.
    last_use: Vec<usize>,
    values: Vec<Option<Value<B::Act>>>,
    /// Bytes of every collective message so far (the whole value, in its dtype).
    pub collective_bytes: u64,
    /// (token, expert) pairs this rank's mixture-of-experts layers computed so far: its
    /// load, which an expert deal spreads unevenly.
    pub routed_pairs: u64,
    /// With experts dealt over data-parallel replicas (`--ep`): this rank's seat in its DP
    /// group, whose members share out its experts.
    expert_member: Option<super::expert_exchange::ExpertMember>,
    /// The algorithms rank's all-reduces ran with.
    pub all_reduces: AllReduceTally,
    /// Bytes the weights occupy on the device.
    pub weight_bytes: u64,
    /// Time and calls per op kind, when profiling.
    pub profile: Option<HashMap<&'static str, OpTime>>,
    /// Forward calls while profiling, by phase (prefill, decode).
    pub profiled_steps: [u64; 2],
    /// While locating non-finite values: the first op whose output has one.
    non_finite: Option<Option<NonFiniteOp>>,
    /// The all-gather of vocabulary-split logits that is the program's output, if any.
    logits_gather: Option<u32>,
    /// The other pipeline stages, when the program is one stage of a pipeline.
    pub link: Option<StageLink<C>>,
    /// Per linear id, the order its sums follow under `--numerics invariant`; empty in a
    /// fast plan.
    invariant: HashMap<u32, DepthOrder>,
    /// Values held as limbs (exact partial sums a collective is to add, `runtime::exact`).
    limbs: HashSet<u32>,
    /// All-reduces that add a residual and normalize in the same step (`--fuse-norm` under
    /// `--numerics invariant`).
    norm_steps: NormSteps<B>,
}

/// One forward call's inputs: every row's token id and position, the sequences' rows, and
/// the output rows wanted when the LM head may compute those alone.
struct Call<'c> {
    ids: &'c [i64],
    positions: &'c [i64],
    segments: &'c [Segment<'c>],
    select: Option<&'c [usize]>,
    /// What the logits gather exchanges.
    exchange: Exchange,
    /// 1 for a decode step (every sequence one new token after cached ones), 0 otherwise.
    phase: usize,
}

/// A profiled op kind's seconds and calls, by phase: [prefill, decode].
#[derive(Debug, Clone, Copy, Default)]
pub struct OpTime {
    pub seconds: [f64; 2],
    pub calls: [u64; 2],
}

/// What a vocabulary-parallel logits gather moves between the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exchange {
    /// The vocabulary slices: every rank gets the whole logits.
    Logits,
    /// Only each row's greedy token is wanted: one (value, index) pair per rank and row.
    Argmax,
    /// Only each row's `k` best candidates are wanted (top-k sampling): `k` pairs per rank
    /// and row. `k` is at most the slice width and the vocabulary.
    TopK(usize),
}

/// A numbered sequence's place in the KV cache.
#[derive(Debug, Clone, Default)]
struct Slot {
    blocks: Vec<u32>,
    position: usize,
}

/// One sequence's part of a forward call: its new tokens, the position the first one sits
/// at (the tokens cached before it), and its block table, which covers every position up
/// to the last new token.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    pub tokens: &'a [i64],
    pub start: usize,
    pub blocks: &'a [u32],
}

/// Token slots per KV block unless the serving engine sets its own.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

fn bad(i: &Instr, problem: impl Into<String>) -> RunError {
    RunError::BadInstruction {
        name: i.name.to_string(),
        problem: problem.into(),
    }
}

/// The weight `i` reads as input `slot`.
fn weight_of<'w, W>(weights: &'w HashMap<u32, W>, i: &Instr, slot: usize) -> Result<&'w W> {
    let id = *i
        .inputs
        .get(slot)
        .ok_or_else(|| bad(i, format!("input {slot} is missing")))?;
    weights
        .get(&id)
        .ok_or_else(|| bad(i, format!("input {slot} (%{id}) is not a weight")))
}

fn on(i: &Instr) -> impl Fn(BackendError) -> RunError + '_ {
    move |error| RunError::Backend {
        name: i.name.to_string(),
        error,
    }
}

/// A backend failure on the program's output.
fn at_output(error: BackendError) -> RunError {
    RunError::Backend {
        name: "output".into(),
        error,
    }
}

/// Blocks of a linear's depth added in f32 in an invariant plan when no tp splits it: the
/// tile kernel's cache block.
const CHAINED_BLOCK: usize = 256;

/// Under `--numerics invariant`, each linear's order (`LinearOp::exact`, else chained
/// blocks) and the linears whose outputs are partial sums that a collective adds (held as
/// limbs); empty for a fast plan.
fn invariant_orders(
    program: &RankProgram,
    numerics: NumericsMode,
    tp: usize,
) -> (HashMap<u32, DepthOrder>, HashSet<u32>) {
    let mut orders = HashMap::new();
    let mut limbs = HashSet::new();
    if numerics != NumericsMode::Invariant {
        return (orders, limbs);
    }
    for i in &program.instrs {
        let Op::Linear(l) = &i.op else { continue };
        let order = match l.exact {
            Some(e) => {
                let partial = tp > 1 && i.layout == Layout::Partial;
                if partial {
                    limbs.insert(i.id);
                }
                DepthOrder::Exact {
                    block: usize::try_from(e.block).unwrap_or(usize::MAX),
                    blocks_total: usize::try_from(e.blocks).unwrap_or(usize::MAX),
                    limbs: partial,
                }
            }
            None => DepthOrder::Chained {
                block: CHAINED_BLOCK,
            },
        };
        orders.insert(i.id, order);
    }
    (orders, limbs)
}

/// How the program uses each weight value (by value id).
pub fn weight_uses(program: &RankProgram) -> HashMap<u32, WeightUse> {
    let mut uses: HashMap<u32, WeightUse> = HashMap::new();
    for i in &program.instrs {
        for (slot, &id) in i.inputs.iter().enumerate() {
            let u = uses.entry(id).or_default();
            match (&i.op, slot) {
                (Op::Linear(l), 1) => u.linear = Some(l.weight_order),
                _ => u.other = true,
            }
        }
    }
    uses
}

impl<'a, B: Backend, C: Collectives<B::Act>> RankExecutor<'a, B, C> {
    /// Uploads this rank's weight slices to the backend, in the layout each use wants.
    pub fn new(
        program: &'a RankProgram,
        numerics: NumericsMode,
        weights: &dyn WeightSource,
        backend: B,
        comm: C,
    ) -> Result<Self> {
        Self::new_sharing(program, numerics, weights, backend, comm, None)
    }

    /// [`RankExecutor::new`] for a rank that shares its experts with the other members of
    /// its DP group (`--ep`, `member`): it loads only its own columns' experts and runs
    /// every mixture-of-experts layer through the group's exchange.
    pub fn new_sharing(
        program: &'a RankProgram,
        numerics: NumericsMode,
        weights: &dyn WeightSource,
        mut backend: B,
        comm: C,
        member: Option<super::expert_exchange::ExpertMember>,
    ) -> Result<Self> {
        let tp = comm.world_size();
        let (invariant, limbs) = invariant_orders(program, numerics, tp);
        if numerics == NumericsMode::Invariant {
            backend
                .set_invariant_numerics()
                .map_err(|error| RunError::Backend {
                    name: "(the rank's backend)".into(),
                    error,
                })?;
        }
        let slices: HashMap<&str, &crate::plan::WeightSlice> =
            program.weights.iter().map(|w| (&*w.tensor, w)).collect();
        let uses = weight_uses(program);
        let mut loaded = HashMap::new();
        let (fused, in_products, mut weight_bytes) =
            super::fused::FusedProducts::load(program, weights, &backend)?;
        let (experts, in_experts, expert_bytes) =
            load_experts(program, &slices, weights, &backend, member.as_ref())?;
        weight_bytes += expert_bytes;
        for i in &program.instrs {
            if in_products.contains(&i.id) || in_experts.contains(&i.id) {
                continue;
            }
            if let Op::Param(p) = &i.op {
                let w = slices
                    .get(&*p.tensor)
                    .ok_or_else(|| bad(i, "its weight is not in the rank's manifest"))?;
                let usage = uses.get(&i.id).copied().unwrap_or_default();
                let weight = backend.upload(weights, w, usage).map_err(|e| match e {
                    BackendError::Weights(e) => e.into(),
                    e => on(i)(e),
                })?;
                weight_bytes += backend.weight_bytes(&weight) as u64;
                loaded.insert(i.id, weight);
            }
        }
        // Each parameter's whole row count (every rank's rows together), for embeddings.
        let table_rows = program
            .instrs
            .iter()
            .filter_map(|i| match &i.op {
                Op::Param(p) => Some((i.id, slices.get(&*p.tensor)?.shape.first().copied()?)),
                _ => None,
            })
            .collect();
        let mut kv_widths = HashMap::new();
        for i in &program.instrs {
            if let Op::Attention(_) = &i.op {
                let width = |slot: usize| {
                    let id = *i.inputs.get(slot)?;
                    let x = program.instrs.iter().find(|x| x.id == id)?;
                    usize::try_from(x.fact.shape.fixed_elements()).ok()
                };
                let (Some(k), Some(v)) = (width(1), width(2)) else {
                    return Err(bad(i, "its key or value width is not known"));
                };
                kv_widths.insert(i.id, (k, v));
            }
        }
        let max_id = program.instrs.iter().map(|i| i.id).max().unwrap_or(0) as usize;
        let mut last_use = vec![usize::MAX; max_id + 1];
        for (idx, i) in program.instrs.iter().enumerate() {
            for &id in &i.inputs {
                if let Some(l) = last_use.get_mut(id as usize) {
                    *l = idx;
                }
            }
        }
        let pools = kv_widths
            .iter()
            .map(|(&id, &(k, v))| (id, backend.new_kv(k, v, DEFAULT_BLOCK_SIZE)))
            .collect();
        let exec = RankExecutor {
            program,
            tp: comm.world_size(),
            rank: comm.rank(),
            backend,
            comm,
            weights: loaded,
            fused,
            experts,
            pools,
            kv_widths,
            block_size: DEFAULT_BLOCK_SIZE,
            pool_blocks: 0,
            engine_blocks: 0,
            next_block: 0,
            slots: Vec::new(),
            head_linears: program.head_linears(),
            table_rows,
            last_use,
            values: Vec::new(),
            collective_bytes: 0,
            routed_pairs: 0,
            expert_member: member,
            all_reduces: AllReduceTally::default(),
            weight_bytes,
            profile: None,
            profiled_steps: [0; 2],
            non_finite: None,
            logits_gather: program.output_gather(),
            link: None,
            invariant,
            limbs,
            norm_steps: NormSteps::new(program),
        };
        Ok(exec)
    }

    /// Makes this executor one stage of a pipeline: it receives `link.recv` from the stage
    /// before it and sends `link.send` to the stage after it on every forward call.
    pub fn with_link(mut self, link: StageLink<C>) -> Self {
        let top = link
            .recv
            .iter()
            .chain(&link.send)
            .copied()
            .max()
            .unwrap_or(0) as usize;
        if self.last_use.len() <= top {
            self.last_use.resize(top + 1, usize::MAX);
        }
        // Sent after the last instruction: never released or overwritten before.
        for &id in &link.send {
            self.last_use[id as usize] = PINNED;
        }
        self.link = Some(link);
        self
    }

    /// The last stage of a pipeline: tells every earlier stage `message` (nothing without
    /// a pipeline).
    pub fn tell(&mut self, message: &[f32]) -> Result<()> {
        match self.link.as_mut() {
            Some(link) => link.tell(&self.backend, message),
            None => Ok(()),
        }
    }

    /// A stage before the last: what the last stage says to run next.
    pub fn listen(&mut self) -> Result<Vec<f32>> {
        match self.link.as_mut() {
            Some(link) => link.listen(&self.backend),
            None => Err(RunError::Pipeline(
                "listen without a pipeline (a bug in tpc)".into(),
            )),
        }
    }

    /// Tensor-parallel rank 0 sends `data` to every rank of its group; the others (`None`)
    /// receive it: the length first, then the values (through the backend's memory, as
    /// every collective).
    pub fn broadcast_floats(&mut self, data: Option<Vec<f32>>) -> Result<Vec<f32>> {
        let on = |error| RunError::Backend {
            name: "engine step message".into(),
            error,
        };
        let b = &self.backend;
        let mut len = b
            .upload_host(&Tensor::new(
                vec![1],
                vec![data.as_ref().map_or(0.0, |d| d.len() as f32)],
            ))
            .map_err(on)?;
        let sent = self.comm.broadcast(&mut len, 0);
        let n = b.to_host(len).map_err(on)?;
        sent?;
        let n = n.data[0];
        if !(n >= 0.0 && n < (1u32 << 24) as f32 && n.fract() == 0.0) {
            return Err(RunError::Pipeline(format!(
                "an engine step message of {n} values (a bug in tpc)"
            )));
        }
        let n = n as usize;
        let mut body = match data {
            Some(d) => b.upload_host(&Tensor::new(vec![d.len()], d)),
            None => b.alloc(&[n], crate::ir::DType::F32),
        }
        .map_err(on)?;
        let sent = self.comm.broadcast(&mut body, 0);
        let body = b.to_host(body).map_err(on)?;
        sent?;
        Ok(body.data)
    }

    /// Whether the program has mixture-of-experts layers.
    pub fn has_experts(&self) -> bool {
        !self.experts.is_empty()
    }

    /// This rank's seat in its DP group when it shares its experts (`--ep`).
    pub fn expert_member(&self) -> Option<&super::expert_exchange::ExpertMember> {
        self.expert_member.as_ref()
    }

    /// How many of a call's `tokens` rows each rank holds of a value split by tokens
    /// (sequence parallelism): [`crate::ir::token_blocks`] by the program's shares.
    fn token_blocks(&self, tokens: usize) -> Vec<usize> {
        let shares = self.program.sequence_shares.as_ref();
        crate::ir::token_blocks(tokens as u64, self.tp as u64, shares)
            .into_iter()
            .map(|r| r as usize)
            .collect()
    }

    /// After this replica's last forward call: answers the other members' mixture-of-experts
    /// rounds, layer after layer in program order as their forward calls make them, until
    /// every member is done. Nothing without a DP group.
    pub fn serve_expert_group(&mut self) -> Result<()> {
        while self.answer_expert_calls(true)? {}
        Ok(())
    }

    /// One forward call's worth of the other members' mixture-of-experts rounds (a round
    /// per MoE layer, in program order), for a replica with no tokens of its own; `done`:
    /// it will have none again. Whether the members go on (false: every member was done,
    /// or there is no DP group or no MoE layer).
    pub fn answer_expert_calls(&mut self, done: bool) -> Result<bool> {
        let Some(member) = self.expert_member.clone() else {
            return Ok(false);
        };
        if self.experts.is_empty() {
            return Ok(false);
        }
        // The program outlives `self`'s borrow: its MoE ops in order, nothing collected.
        let program = self.program;
        for (id, act) in program.instrs.iter().filter_map(|i| match &i.op {
            Op::Experts(e) => Some((i.id, e.act)),
            _ => None,
        }) {
            let experts = self.experts.get(&id).map_or(&[][..], |e| e.as_slice());
            let served = super::moe_across::serve_layer(&self.backend, &member, experts, act, done)
                .map_err(|e| across_error("mixture-of-experts (serving the other replicas)", e))?;
            match served {
                Some(pairs) => self.routed_pairs = self.routed_pairs.saturating_add(pairs),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// The (token, expert) pairs of every rank of the plan, in global rank order (stage times
    /// tp, plus tp rank): each stage's tensor-parallel group gathers its ranks' `count`, and
    /// with stages the pipeline group gathers the stages'. Empty where no stage has
    /// mixture-of-experts layers. Every rank of every stage calls it.
    pub fn gather_expert_loads(&mut self, count: u64) -> Result<Vec<u64>> {
        let Some(link) = self.link.as_mut() else {
            if !self.has_experts() {
                return Ok(Vec::new());
            }
            return gather_counts_over(&self.backend, &mut self.comm, &[count]);
        };
        // Beside each count, whether its stage has experts at all.
        let has = u64::from(!self.experts.is_empty());
        let stage = gather_counts_over(&self.backend, &mut self.comm, &[count, has])?;
        let all = gather_counts_over(&self.backend, &mut link.comm, &stage)?;
        if all.chunks_exact(2).all(|c| c[1] == 0) {
            return Ok(Vec::new());
        }
        Ok(all.chunks_exact(2).map(|c| c[0]).collect())
    }

    /// Whether this rank computes the model output (no pipeline, or its last stage).
    pub fn has_output(&self) -> bool {
        self.link.as_ref().is_none_or(StageLink::is_last)
    }

    /// Sizes the paged cache for the serving engine: blocks of `block_size` tokens, blocks
    /// `0..blocks` its own to hand out, every attention op's pool grown to hold them. While
    /// numbered sequences hold blocks (`forward`, `reserve`), the block size may not change
    /// and the engine's range may not grow over their blocks (`reset` first); otherwise a
    /// new block size makes the pools anew, empty.
    pub fn set_kv_pool(&mut self, block_size: usize, blocks: usize) -> Result<()> {
        if block_size == 0 || u32::try_from(blocks).is_err() {
            return Err(RunError::BadBatch {
                problem: format!(
                    "a KV cache of {blocks} blocks of {block_size} tokens (blocks of at least \
                     one token, fewer than 2^32 blocks)"
                ),
            });
        }
        let numbered_hold = self.next_block > self.engine_blocks;
        if numbered_hold && (block_size != self.block_size || blocks > self.engine_blocks) {
            return Err(RunError::BadBatch {
                problem: format!(
                    "the KV cache changes to {blocks} blocks of {block_size} tokens while \
                     numbered sequences hold blocks {}..{} of {} tokens; reset first",
                    self.engine_blocks, self.next_block, self.block_size
                ),
            });
        }
        if block_size != self.block_size {
            let b = &self.backend;
            for (id, &(k, v)) in &self.kv_widths {
                self.pools.insert(*id, b.new_kv(k, v, block_size));
            }
            self.block_size = block_size;
            self.pool_blocks = 0;
        }
        // The numbered sequences take blocks past the engine's (theirs, if any, already lie
        // past them).
        if !numbered_hold {
            self.next_block = blocks;
        }
        self.engine_blocks = blocks;
        self.grow_pools(self.next_block.max(blocks))
    }

    /// Blocks every attention op's pool has.
    pub fn kv_blocks(&self) -> usize {
        self.pool_blocks
    }

    /// Bytes one block takes over every attention op of this rank (keys and values, f32).
    pub fn kv_block_bytes(&self) -> u64 {
        let per_token: usize = self.kv_widths.values().map(|&(k, v)| k + v).sum();
        (per_token as u64)
            .saturating_mul(4)
            .saturating_mul(self.block_size as u64)
    }

    fn grow_pools(&mut self, blocks: usize) -> Result<()> {
        if blocks <= self.pool_blocks {
            return Ok(());
        }
        let b = &self.backend;
        for (id, pool) in self.pools.iter_mut() {
            b.grow_kv(pool, blocks).map_err(|error| RunError::Backend {
                name: format!("the KV cache of attention %{id}"),
                error,
            })?;
        }
        self.pool_blocks = blocks;
        Ok(())
    }

    /// Numbered sequence `seq`'s table covers `positions` tokens (blocks taken in order
    /// from the allocator, the pools grown as needed).
    fn slot_room(&mut self, seq: usize, positions: usize) -> Result<()> {
        if self.slots.len() <= seq {
            self.slots.resize_with(seq + 1, Slot::default);
        }
        let have = self.slots[seq].blocks.len();
        let need = positions.div_ceil(self.block_size);
        if need <= have {
            return Ok(());
        }
        let end = self
            .next_block
            .checked_add(need - have)
            .ok_or_else(|| RunError::BadBatch {
                problem: format!("KV room for {positions} positions"),
            })?;
        self.grow_pools(end)?;
        let first = self.next_block as u32;
        self.slots[seq].blocks.extend(first..end as u32);
        self.next_block = end;
        Ok(())
    }

    /// Reserves KV-cache room for `positions` tokens of sequence `seq`, so that decoding
    /// never grows it and its blocks are consecutive (read in place). Best effort: room that
    /// cannot be had now is asked for again, and refused, when it is needed.
    pub fn reserve(&mut self, seq: usize, positions: usize) {
        let _ = self.slot_room(seq, positions);
    }

    /// Reserves room for `positions` tokens of sequence 0.
    pub fn reserve_positions(&mut self, positions: usize) {
        self.reserve(0, positions)
    }

    /// Forgets every cached token of every numbered sequence (keeping the memory).
    pub fn reset(&mut self) {
        self.slots.clear();
        self.next_block = self.engine_blocks;
    }

    /// Runs the program on `ids` of sequence 0 (after the tokens it has cached) and returns
    /// the model output: logits `[ids.len(), vocab]`, or `[1, vocab]` with `last_only`.
    pub fn forward_rows(&mut self, ids: &[i64], last_only: bool) -> Result<Tensor> {
        let rows = if last_only {
            OutputRows::LastOfEach
        } else {
            OutputRows::All
        };
        self.forward(&[(0, ids)], rows)
    }

    /// Runs the program once over a batch: `(sequence, new token ids)` pairs, each sequence
    /// continuing after its cached tokens. Returns the output rows `rows` asks for, in batch
    /// order, on the host.
    pub fn forward(&mut self, batch: &[(usize, &[i64])], rows: OutputRows) -> Result<Tensor> {
        let out = self.forward_on_device(batch, rows)?;
        self.backend.to_host(out).map_err(at_output)
    }

    /// Each row's token from the (value, index) pairs of a vocabulary-parallel argmax;
    /// `Err(row)` for a row that is not finite.
    fn picks_of_pairs(&self, out: B::Act) -> Result<std::result::Result<Vec<usize>, usize>> {
        let pairs = self.backend.to_host(out).map_err(at_output)?;
        let picked = pairs
            .data
            .chunks(2)
            .enumerate()
            .map(|(row, p)| {
                if p[0].is_finite() {
                    Ok(p[1] as usize)
                } else {
                    Err(row)
                }
            })
            .collect();
        pairs.release();
        Ok(picked)
    }

    /// Each row's greedy token picked from whole logits on the device; `Err(row)` for the
    /// first row that is not finite.
    fn picks_of_logits(&self, out: B::Act) -> Result<std::result::Result<Vec<usize>, usize>> {
        let picked = match self.backend.first_non_finite_row(&out) {
            Ok(Some(row)) => Ok(Err(row)),
            Ok(None) => self.backend.argmax_rows(&out).map(Ok),
            Err(e) => Err(e),
        };
        self.backend.release(out);
        picked.map_err(at_output)
    }

    /// Top-k sampling's candidates for each returned row: its `k` best (logit, token) pairs
    /// (all of them when the vocabulary is smaller), best first, the lower token first among
    /// equal logits (`sampling::candidate_order`), picked on the device so that only these
    /// come back to the host. With vocabulary-split logits each rank sends its slice's `k`
    /// best instead of the slice whenever that is fewer bytes (`2k` below the slice width);
    /// the union of the ranks' top-k holds the global top-k, so the candidates are the same
    /// either way. A row with a NaN or an infinity is `Err(row)`.
    pub fn forward_steps_top_k(
        &mut self,
        batch: &[SeqStep<'_>],
        rows: OutputRows,
        k: usize,
    ) -> Result<std::result::Result<Vec<Candidates>, usize>> {
        self.top_k_of(k, |exec, exchange| exec.steps_call(batch, rows, exchange))
    }

    /// Each row's `k` best candidates of the output `call` computes (given the exchange).
    fn top_k_of(
        &mut self,
        k: usize,
        call: impl FnOnce(&mut Self, Exchange) -> Result<B::Act>,
    ) -> Result<std::result::Result<Vec<Candidates>, usize>> {
        let exchange = self
            .logits_gather
            .and_then(|id| self.vocab_slice(id))
            .map(|(n, keep)| (n, k.min(keep)))
            .filter(|&(n, k)| k > 0 && k.saturating_mul(2) < n)
            .map(|(_, k)| k);
        let out = match exchange {
            Some(k) => call(self, Exchange::TopK(k))?,
            None => {
                let logits = call(self, Exchange::Logits)?;
                let cols = logits.rows_cols().1;
                let pairs = self.backend.top_k_pairs(&logits, k.min(cols), cols, 0);
                self.backend.release(logits);
                pairs.map_err(at_output)?
            }
        };
        let pairs = self.backend.to_host(out).map_err(at_output)?;
        let width = pairs.cols().max(2);
        let picked = pairs
            .data
            .chunks(width)
            .enumerate()
            .map(|(row, p)| {
                if p[0].is_finite() {
                    Ok(p.chunks(2)
                        .filter(|e| e[1] >= 0.0)
                        .map(|e| (e[0], e[1] as usize))
                        .collect())
                } else {
                    Err(row)
                }
            })
            .collect();
        pairs.release();
        Ok(picked)
    }

    /// The width of each rank's slice of the gathered logits `gather` and the vocabulary
    /// kept after the gather (padding dropped).
    fn vocab_slice(&self, gather: u32) -> Option<(usize, usize)> {
        let instrs = &self.program.instrs;
        let g = instrs.iter().find(|i| i.id == gather)?;
        let Op::AllGather(op) = &g.op else {
            return None;
        };
        let input = instrs.iter().find(|i| Some(&i.id) == g.inputs.first())?;
        let n = usize::try_from(
            input
                .fact
                .shape
                .fixed_at(input.fact.shape.rank().checked_sub(1)?)?,
        )
        .ok()?;
        let keep = op.real_counts(n as u64, self.tp as u64).iter().sum::<u64>();
        Some((n, usize::try_from(keep).ok()?))
    }

    /// Recomputes `tokens` as one fresh sequence, checking every op's output, and returns
    /// the first op on this rank whose output holds a NaN or an infinity. Forgets every
    /// cached token (generation is over when this is called). Every rank of the group must
    /// call it together: the program's collectives run as usual.
    pub fn locate_non_finite(&mut self, tokens: &[i64]) -> Result<Option<NonFiniteOp>> {
        self.reset();
        self.non_finite = Some(None);
        let out = self.forward_inner(&[(0, tokens)], OutputRows::LastOfEach, Exchange::Logits);
        let found = self.non_finite.take().flatten();
        self.reset();
        if let Some(out) = out? {
            self.backend.release(out);
        }
        Ok(found)
    }

    /// As [`RankExecutor::forward`], the output left in the backend's memory.
    pub fn forward_on_device(
        &mut self,
        batch: &[(usize, &[i64])],
        rows: OutputRows,
    ) -> Result<B::Act> {
        self.forward_call(batch, rows, Exchange::Logits)
    }

    fn forward_call(
        &mut self,
        batch: &[(usize, &[i64])],
        rows: OutputRows,
        exchange: Exchange,
    ) -> Result<B::Act> {
        self.forward_inner(batch, rows, exchange)?
            .ok_or_else(|| RunError::BadInstruction {
                name: "program".into(),
                problem: "this pipeline stage has no output; only the last one does".into(),
            })
    }

    fn forward_inner(
        &mut self,
        batch: &[(usize, &[i64])],
        rows: OutputRows,
        exchange: Exchange,
    ) -> Result<Option<B::Act>> {
        let mut seen = Vec::with_capacity(batch.len());
        for &(seq, ids) in batch {
            if seen.contains(&seq) {
                return Err(RunError::BadBatch {
                    problem: format!("sequence {seq} appears twice in one batch"),
                });
            }
            seen.push(seq);
            let start = self.slots.get(seq).map_or(0, |s| s.position);
            self.slot_room(seq, start.saturating_add(ids.len()))?;
        }
        let tables: Vec<(usize, Vec<u32>)> = batch
            .iter()
            .map(|&(seq, _)| (self.slots[seq].position, self.slots[seq].blocks.clone()))
            .collect();
        let steps: Vec<SeqStep<'_>> = batch
            .iter()
            .zip(&tables)
            .map(|(&(_, tokens), (start, blocks))| SeqStep {
                tokens,
                start: *start,
                blocks,
            })
            .collect();
        let out = self.run_steps(&steps, rows, exchange);
        if out.is_ok() {
            for &(seq, ids) in batch {
                self.slots[seq].position += ids.len();
            }
        }
        out
    }

    /// Runs the program once over sequences whose block tables the caller keeps (the
    /// serving engine). Returns the output rows `rows` asks for, in batch order, on the host.
    pub fn forward_steps(&mut self, batch: &[SeqStep<'_>], rows: OutputRows) -> Result<Tensor> {
        let out = self.steps_call(batch, rows, Exchange::Logits)?;
        self.backend.to_host(out).map_err(at_output)
    }

    /// The greedy next token of each returned row, picked on the device: only the ids come
    /// back to the host, not the logits. A row with a NaN or an infinity is
    /// `Err(row)`, since no token can be chosen from it.
    pub fn forward_steps_argmax(
        &mut self,
        batch: &[SeqStep<'_>],
        rows: OutputRows,
    ) -> Result<std::result::Result<Vec<usize>, usize>> {
        if self.logits_gather.is_some() {
            let out = self.steps_call(batch, rows, Exchange::Argmax)?;
            return self.picks_of_pairs(out);
        }
        let out = self.steps_call(batch, rows, Exchange::Logits)?;
        self.picks_of_logits(out)
    }

    /// A pipeline stage before the last runs one engine step: it passes its values on.
    pub fn forward_stage_steps(&mut self, batch: &[SeqStep<'_>]) -> Result<()> {
        if let Some(out) = self.run_steps(batch, OutputRows::All, Exchange::Logits)? {
            self.backend.release(out);
        }
        Ok(())
    }

    fn steps_call(
        &mut self,
        batch: &[SeqStep<'_>],
        rows: OutputRows,
        exchange: Exchange,
    ) -> Result<B::Act> {
        self.run_steps(batch, rows, exchange)?
            .ok_or_else(|| RunError::BadInstruction {
                name: "program".into(),
                problem: "this pipeline stage has no output; only the last one does".into(),
            })
    }

    fn run_steps(
        &mut self,
        batch: &[SeqStep<'_>],
        rows: OutputRows,
        exchange: Exchange,
    ) -> Result<Option<B::Act>> {
        let mut segments = Vec::with_capacity(batch.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for step in batch {
            if step.tokens.is_empty() {
                return Err(RunError::EmptyPrompt);
            }
            let end = step.start.saturating_add(step.tokens.len());
            if step.blocks.len().saturating_mul(self.block_size) < end {
                return Err(RunError::BadBatch {
                    problem: format!(
                        "a block table of {} blocks of {} tokens for positions up to {end}",
                        step.blocks.len(),
                        self.block_size
                    ),
                });
            }
            segments.push(Segment {
                rows: ids.len()..ids.len() + step.tokens.len(),
                start: step.start,
                blocks: step.blocks,
            });
            ids.extend_from_slice(step.tokens);
            positions.extend((step.start..end).map(|p| p as i64));
        }
        let last_rows: Vec<usize> = segments.iter().map(|s| s.rows.end - 1).collect();
        // A decode step: one new token after cached ones, for every sequence of the batch.
        let phase = usize::from(segments.iter().all(|s| s.start > 0 && s.rows.len() == 1));
        if self.profile.is_some() {
            self.profiled_steps[phase] += 1;
        }
        let call = Call {
            phase,
            select: (rows == OutputRows::LastOfEach && last_rows.len() < ids.len())
                .then_some(last_rows.as_slice()),
            ids: &ids,
            positions: &positions,
            segments: &segments,
            exchange,
        };
        self.run_program(&call)
    }

    fn run_program(&mut self, call: &Call<'_>) -> Result<Option<B::Act>> {
        // The value table is kept between calls (its slots are all empty in between).
        let mut values = std::mem::take(&mut self.values);
        values.resize_with(self.last_use.len(), || None);
        let mut ropes: HashMap<RopeOp, B::RopeTables> = HashMap::new();
        let mut output = None;
        let mut result = self.receive_stage_inputs(&mut values);
        let instrs = if result.is_ok() {
            self.program.instrs.as_slice()
        } else {
            &[]
        };
        for (idx, i) in instrs.iter().enumerate() {
            let value = match &i.op {
                Op::Param(_) => continue,
                Op::Input(inp) => Value::Ids(match inp.kind {
                    InputKind::TokenIds => call.ids.to_vec(),
                    InputKind::Positions => call.positions.to_vec(),
                }),
                Op::Output(_) => {
                    match self.take_or_copy(&mut values, idx, i) {
                        Ok(v) => output = Some(v),
                        Err(e) => result = Err(e),
                    }
                    break;
                }
                op => {
                    let started = self.profile.is_some().then(std::time::Instant::now);
                    let step = self.run(op, idx, i, &mut values, call, &mut ropes);
                    let v = match step {
                        Ok(v) => v,
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    };
                    // A fused step counts once, as itself; its add and norm only hand on
                    // its values.
                    let counted = started.filter(|_| !self.norm_steps.hands_on(i.id));
                    if let (Some(t), Some(p)) = (counted, self.profile.as_mut()) {
                        let kind = match self.norm_steps.by_reduce.contains_key(&i.id) {
                            true => "all_reduce_add_rms_norm",
                            false => op.kind(),
                        };
                        let e = p.entry(kind).or_default();
                        e.seconds[call.phase] += t.elapsed().as_secs_f64();
                        e.calls[call.phase] += 1;
                    }
                    if matches!(self.non_finite, Some(None))
                        && self
                            .backend
                            .first_non_finite_row(&v)
                            .map_err(on(i))?
                            .is_some()
                    {
                        let index = self
                            .link
                            .as_ref()
                            .and_then(|l| l.origin.get(idx).copied())
                            .unwrap_or(idx);
                        self.non_finite = Some(Some(NonFiniteOp {
                            rank: self.rank,
                            index,
                            name: i.name.to_string(),
                            kind: op.kind(),
                            layer: i.layer,
                        }));
                    }
                    Value::Act(v)
                }
            };
            values[i.id as usize] = Some(value);
            // Inputs read for the last time go back to the backend.
            for &id in &i.inputs {
                if self.last_use.get(id as usize) == Some(&idx) {
                    if let Some(Some(Value::Act(t))) = values.get_mut(id as usize).map(Option::take)
                    {
                        self.backend.release(t);
                    }
                }
            }
        }
        if result.is_ok() && output.is_none() {
            result = self.send_stage_outputs(&mut values);
        }
        for v in values.iter_mut().filter_map(Option::take) {
            if let Value::Act(t) = v {
                self.backend.release(t);
            }
        }
        self.norm_steps.release_waiting(&self.backend);
        self.values = values;
        result?;
        let Some(output) = output else {
            if self.has_output() {
                return Err(RunError::BadInstruction {
                    name: "program".into(),
                    problem: "it has no output".into(),
                });
            }
            return Ok(None);
        };
        // When the LM head could not be narrowed (a non-row-wise op after it), narrow here.
        let output = match call.select {
            Some(rows) if output.rows_cols().0 != rows.len() => {
                let narrowed = self.backend.select_rows(&output, rows);
                self.backend.release(output);
                narrowed.map_err(at_output)?
            }
            _ => output,
        };
        Ok(Some(output))
    }

    /// A pipeline stage after the first: the values the stage before computed.
    fn receive_stage_inputs(&mut self, values: &mut [Option<Value<B::Act>>]) -> Result<()> {
        let Some(link) = self.link.as_mut() else {
            return Ok(());
        };
        let from = link.stage.saturating_sub(1);
        for k in 0..link.recv.len() {
            let id = link.recv[k] as usize;
            let x = link.recv_act(&self.backend, from)?;
            match values.get_mut(id) {
                Some(slot) => *slot = Some(Value::Act(x)),
                None => self.backend.release(x),
            }
        }
        Ok(())
    }

    /// A pipeline stage before the last: its values the later stages read, to the next.
    fn send_stage_outputs(&mut self, values: &mut [Option<Value<B::Act>>]) -> Result<()> {
        let Some(link) = self.link.as_mut() else {
            return Ok(());
        };
        let to = link.stage + 1;
        for k in 0..link.send.len() {
            let id = link.send[k];
            let Some(Some(Value::Act(x))) = values.get(id as usize) else {
                return Err(RunError::Pipeline(format!(
                    "stage {} has no value %{id} to send (a bug in tpc)",
                    link.stage
                )));
            };
            link.send_act(&self.backend, x, to)?;
        }
        Ok(())
    }

    fn ids<'v>(
        &self,
        values: &'v [Option<Value<B::Act>>],
        i: &Instr,
        slot: usize,
    ) -> Result<&'v [i64]> {
        let id = *i
            .inputs
            .get(slot)
            .ok_or_else(|| bad(i, format!("input {slot} is missing")))? as usize;
        match values.get(id) {
            Some(Some(Value::Ids(v))) => Ok(v),
            _ => Err(bad(i, format!("input %{id} is not token ids"))),
        }
    }

    /// The whole table (every rank's rows together) has a row for every id it is given: an
    /// id past it (a position past GPT-2's learned ones) is an error, never a row of zeros
    /// that no rank holds.
    fn check_rows(&self, i: &Instr, ids: &[i64]) -> Result<()> {
        let rows = i
            .inputs
            .get(1)
            .and_then(|t| self.table_rows.get(t))
            .copied();
        let Some(rows) = rows else {
            return Ok(());
        };
        match ids
            .iter()
            .find(|&&id| u64::try_from(id).map_or(true, |id| id >= rows))
        {
            None => Ok(()),
            Some(id) => Err(bad(
                i,
                format!(
                    "id {id} is past the {rows} rows of its table (0 to {})",
                    rows.saturating_sub(1)
                ),
            )),
        }
    }

    fn weight(&self, i: &Instr, slot: usize) -> Result<&B::Weight> {
        weight_of(&self.weights, i, slot)
    }

    /// Input 0 of instruction `idx` as an owned buffer: the value itself when this is its
    /// last reader (and it is not read twice here), else a copy.
    fn take_or_copy(
        &self,
        values: &mut [Option<Value<B::Act>>],
        idx: usize,
        i: &Instr,
    ) -> Result<B::Act> {
        let id = *i
            .inputs
            .first()
            .ok_or_else(|| bad(i, "input 0 is missing"))?;
        let last = self.last_use.get(id as usize) == Some(&idx)
            && i.inputs.iter().filter(|&&x| x == id).count() == 1;
        if last {
            if let Some(slot) = values.get_mut(id as usize) {
                if let Some(Value::Act(t)) = slot.take() {
                    return Ok(t);
                }
            }
        }
        let x = act(values, i, 0)?;
        self.backend.copy(x).map_err(on(i))
    }

    /// A collective's result `sum`, as values: decoded when its input was held as limbs.
    fn values_of_sum(&self, i: &Instr, sum: B::Act) -> Result<B::Act> {
        if !i.inputs.first().is_some_and(|x| self.limbs.contains(x)) {
            return Ok(sum);
        }
        let values = self.backend.decode_limbs(&sum).map_err(on(i));
        self.backend.release(sum);
        values
    }

    fn run(
        &mut self,
        op: &Op,
        idx: usize,
        i: &Instr,
        values: &mut [Option<Value<B::Act>>],
        call: &Call<'_>,
        ropes: &mut HashMap<RopeOp, B::RopeTables>,
    ) -> Result<B::Act> {
        // The add and the norm of an invariant norm fusion ran in their all-reduce's step:
        // the add hands on the new residual (left as the all-reduce's value, which only it
        // reads), the norm its waiting value.
        if let Some(&reduce) = self.norm_steps.adds.get(&i.id) {
            return match values.get_mut(reduce as usize).and_then(Option::take) {
                Some(Value::Act(h)) => Ok(h),
                _ => Err(bad(
                    i,
                    "its all-reduce's fused step did not run before it (a bug in tpc)",
                )),
            };
        }
        if self.norm_steps.norms.contains(&i.id) {
            return self.norm_steps.normed.remove(&i.id).ok_or_else(|| {
                bad(
                    i,
                    "its all-reduce's fused step did not run before it (a bug in tpc)",
                )
            });
        }
        // Elementwise ops write into their first input when nothing reads it later; a norm
        // fused with an all-reduce reduces its first input in place.
        let in_place =
            op_dims::dims(op).in_place || matches!(op, Op::RmsNorm(n) if n.reduce_input.is_some());
        let mut first = if in_place {
            Some(self.take_or_copy(values, idx, i)?)
        } else {
            None
        };
        let mut owned = || {
            first
                .take()
                .ok_or_else(|| bad(i, "input 0 was already used"))
        };
        let values: &[Option<Value<B::Act>>] = values;
        let b = &self.backend;
        let err = on(i);
        let x = |slot| act(values, i, slot);
        Ok(match op {
            Op::Linear(_) if self.fused.covers(i.id) => {
                self.fused
                    .output(b, i, x(0)?, self.invariant.get(&i.id).copied())?
            }
            Op::Embedding(e) => {
                let ids = self.ids(values, i, 0)?;
                self.check_rows(i, ids)?;
                let offset = e.vocab_range.map(|(o, _)| o as usize).unwrap_or(0);
                b.embedding(ids, self.weight(i, 1)?, offset).map_err(err)?
            }
            Op::Linear(_) => {
                let x = x(0)?;
                // The LM head of a generation step needs the selected rows only.
                let narrowed = match call.select {
                    Some(rows) if self.head_linears.contains(&i.id) => {
                        Some(b.select_rows(x, rows).map_err(&err)?)
                    }
                    _ => None,
                };
                let x = narrowed.as_ref().unwrap_or(x);
                let y = match self.invariant.get(&i.id) {
                    Some(&order) => b.linear_invariant(x, self.weight(i, 1)?, order),
                    None => b.linear(x, self.weight(i, 1)?),
                };
                if let Some(n) = narrowed {
                    b.release(n);
                }
                y.map_err(err)?
            }
            Op::BiasAdd(_) => {
                let mut out = owned()?;
                b.bias_add(&mut out, self.weight(i, 1)?).map_err(err)?;
                out
            }
            Op::Add(_) | Op::Mul(_) => {
                let mut out = owned()?;
                let kind = if matches!(op, Op::Add(_)) {
                    BinaryOp::Add
                } else {
                    BinaryOp::Mul
                };
                b.binary(&mut out, x(1)?, kind).map_err(err)?;
                out
            }
            Op::SigmoidGate(_) => {
                let gate = b.copy(x(1)?).and_then(|g| b.to_host(g)).map_err(&err)?;
                super::moe::sigmoid_gate(b, x(0)?, &gate).map_err(err)?
            }
            Op::Activation(a) => {
                let mut out = owned()?;
                b.activation(&mut out, a.kind).map_err(err)?;
                out
            }
            Op::RmsNorm(n) if n.reduce_input.is_some() => {
                if i.inputs.first().is_some_and(|x| self.limbs.contains(x)) {
                    return Err(bad(
                        i,
                        "a fused all-reduce + norm reads exact partial sums; an invariant plan has none",
                    ));
                }
                // The input is a partial sum: reduce it in place, then normalize it.
                let mut sum = owned()?;
                let bytes = message_bytes(&sum);
                self.collective_bytes += bytes;
                let planned = n
                    .reduce_input
                    .as_ref()
                    .and_then(|r| r.algorithm.as_ref())
                    .and_then(|c| c.for_bytes(bytes));
                let group = n.group.map(|g| g as usize).unwrap_or(sum.rows_cols().1);
                let out = weight_of(&self.weights, i, 1).and_then(|w| {
                    b.all_reduce_rms_norm(
                        &mut self.comm,
                        &mut sum,
                        w,
                        group,
                        n.eps.0 as f32,
                        planned,
                    )
                    .map_err(|e| match e {
                        ReduceNormError::Collective(c) => RunError::from(c),
                        ReduceNormError::Norm(e) => err(e),
                    })
                });
                b.release(sum);
                let (out, ran) = out?;
                self.all_reduces.add(ran);
                out
            }
            Op::RmsNorm(n) => {
                let x = x(0)?;
                let group = n.group.map(|g| g as usize).unwrap_or(x.rows_cols().1);
                b.rms_norm(x, self.weight(i, 1)?, group, n.eps.0 as f32)
                    .map_err(err)?
            }
            Op::LayerNorm(n) => b
                .layer_norm(
                    x(0)?,
                    self.weight(i, 1)?,
                    self.weight(i, 2)?,
                    n.eps.0 as f32,
                )
                .map_err(err)?,
            Op::Rope(r) => {
                let mut out = owned()?;
                if !ropes.contains_key(r) {
                    let t = b.rope_tables(r, call.positions).map_err(&err)?;
                    ropes.insert(r.clone(), t);
                }
                b.rope(&mut out, r.head_dim as usize, &ropes[r])
                    .map_err(err)?;
                out
            }
            Op::Attention(a) => {
                let d = a.head_dim as usize;
                let scale = a
                    .scale
                    .map(|s| s.0 as f32)
                    .unwrap_or(1.0 / (d as f32).sqrt());
                let (q, k, v) = (x(0)?, x(1)?, x(2)?);
                let pool = self
                    .pools
                    .get_mut(&i.id)
                    .ok_or_else(|| bad(i, "it has no KV cache"))?;
                b.attention([q, k, v], pool, call.segments, d, scale)
                    .map_err(err)?
            }
            Op::Unfuse(u) => {
                let x = x(0)?;
                let (block, offset, len) =
                    unfuse_block(&u.groups, u.part as usize, x.rows_cols().1)
                        .ok_or_else(|| bad(i, "its structure does not fit its input"))?;
                b.unfuse(x, block, offset, len).map_err(err)?
            }
            Op::AllReduce(a) if self.norm_steps.by_reduce.contains_key(&i.id) => {
                let group = self.norm_steps.by_reduce[&i.id];
                let sum = owned()?;
                let bytes = message_bytes(&sum);
                self.collective_bytes += bytes;
                let planned = a.algorithm.as_ref().and_then(|c| c.for_bytes(bytes));
                let limbs = i.inputs.first().is_some_and(|x| self.limbs.contains(x));
                let norm = &self.program.instrs[group.norm_at];
                let Op::RmsNorm(n) = &norm.op else {
                    return Err(bad(
                        norm,
                        "its fused step names it, but it is not a norm (a bug in tpc)",
                    ));
                };
                let residual = match group.add {
                    Some(add) => match values.get(add.residual as usize) {
                        Some(Some(Value::Act(r))) => Some(r),
                        _ => {
                            return Err(bad(
                                i,
                                format!(
                                    "its fused step's residual %{} is not computed",
                                    add.residual
                                ),
                            ))
                        }
                    },
                    None => None,
                };
                let cols = sum.rows_cols().1 / if limbs { LIMBS } else { 1 };
                let step = NormStep {
                    limbs,
                    residual,
                    weight: weight_of(&self.weights, norm, 1)?,
                    group: n.group.map(|g| g as usize).unwrap_or(cols),
                    eps: n.eps.0 as f32,
                };
                let out = b
                    .all_reduce_add_rms_norm(&mut self.comm, sum, step, planned)
                    .map_err(|e| match e {
                        ReduceNormError::Collective(c) => RunError::from(c),
                        ReduceNormError::Norm(e) => err(e),
                    })?;
                self.all_reduces.add(out.ran);
                if let Some(stale) = self.norm_steps.normed.insert(group.norm, out.normed) {
                    b.release(stale);
                }
                out.residual
            }
            Op::AllReduce(a) => {
                let mut out = owned()?;
                let bytes = message_bytes(&out);
                self.collective_bytes += bytes;
                // The plan's choice for this message size, when it recorded one.
                let planned = a.algorithm.as_ref().and_then(|c| c.for_bytes(bytes));
                let ran = self
                    .comm
                    .all_reduce_sum_planned(&mut out, planned)
                    .map_err(RunError::from)?;
                self.all_reduces.add(ran);
                self.values_of_sum(i, out)?
            }
            Op::AllGather(g)
                if call.exchange != Exchange::Logits && self.logits_gather == Some(i.id) =>
            {
                // Each rank's best candidates of its vocabulary slice, then the best of all.
                let x = x(0)?;
                let n = x.rows_cols().1;
                let counts = g.real_counts(n as u64, self.tp as u64);
                let offset = counts.iter().take(self.rank).sum::<u64>() as usize;
                let valid = counts.get(self.rank).copied().unwrap_or(0) as usize;
                let local = match call.exchange {
                    Exchange::TopK(k) => b.top_k_pairs(x, k, valid, offset),
                    _ => b.argmax_pairs(x, valid, offset),
                }
                .map_err(&err)?;
                let tp = self.tp;
                let out = gather_then(
                    b,
                    &mut self.comm,
                    &mut self.collective_bytes,
                    tp,
                    &local,
                    &err,
                    |all| {
                        match call.exchange {
                            Exchange::TopK(k) => b.best_k_of_pairs(all, tp, k),
                            _ => b.best_of_pairs(all, tp),
                        }
                        .map_err(&err)
                    },
                );
                b.release(local);
                out?
            }
            Op::AllGather(g) if i.fact.shape.is_sequence(g.dim) => {
                // Every rank's block of tokens, in rank order (only its rows move), padding
                // dropped.
                let tokens = call.ids.len();
                let x = x(0)?;
                let n = x.rows_cols().1;
                let blocks = self.token_blocks(tokens);
                let rows = blocks.iter().sum::<usize>();
                let counts: Vec<usize> = blocks.iter().map(|&r| r * n).collect();
                let mut all = b.alloc(&[rows, n], x.dtype()).map_err(&err)?;
                self.collective_bytes += message_bytes(&all);
                match self.comm.all_gather_counts(x, &counts, &mut all) {
                    Err(e) => {
                        b.release(all);
                        return Err(e.into());
                    }
                    Ok(()) if rows > tokens => {
                        let out = b.row_window(&all, 0, tokens).map_err(&err);
                        b.release(all);
                        out?
                    }
                    Ok(()) => all,
                }
            }
            Op::AllGather(g) => {
                let x = x(0)?;
                let (rows, n) = x.rows_cols();
                let widths: Vec<usize> = g
                    .real_counts(n as u64, self.tp as u64)
                    .into_iter()
                    .map(|c| c as usize)
                    .collect();
                if widths.iter().any(|&w| w != n) {
                    // Unequal real parts (an uneven split, shares): only the real columns
                    // move, each rank's laid out at its place.
                    let keep = widths.iter().sum::<usize>();
                    let mut out = b.alloc(&[rows, keep], x.dtype()).map_err(&err)?;
                    self.collective_bytes += message_bytes(&out);
                    match self.comm.all_gather_columns(x, &widths, &mut out) {
                        Ok(()) => out,
                        Err(e) => {
                            b.release(out);
                            return Err(e.into());
                        }
                    }
                } else {
                    // Rank-major pieces [tp][rows][n] → [rows][tp·n].
                    gather_then(
                        b,
                        &mut self.comm,
                        &mut self.collective_bytes,
                        self.tp,
                        x,
                        &err,
                        |all| b.rank_major_to_rows(all, &widths).map_err(&err),
                    )?
                }
            }
            Op::ReduceScatter(r) if i.fact.shape.is_sequence(r.dim) => {
                // The call's tokens dealt in blocks (padded to a row a rank where there are
                // fewer); this rank keeps the sum of its block.
                let x = x(0)?;
                let (tokens, n) = x.rows_cols();
                let blocks = self.token_blocks(tokens);
                let rows = blocks.iter().sum::<usize>();
                let counts: Vec<usize> = blocks.iter().map(|&r| r * n).collect();
                let padded = match rows > tokens {
                    true => Some(b.row_window(x, 0, rows).map_err(&err)?),
                    false => None,
                };
                let input = padded.as_ref().unwrap_or(x);
                self.collective_bytes += message_bytes(input);
                let summed = b
                    .alloc(&[blocks[self.rank], n], x.dtype())
                    .map_err(&err)
                    .and_then(|mut out| {
                        match self
                            .comm
                            .reduce_scatter_sum_counts(input, &counts, &mut out)
                        {
                            Ok(()) => Ok(out),
                            Err(e) => {
                                b.release(out);
                                Err(e.into())
                            }
                        }
                    });
                if let Some(p) = padded {
                    b.release(p);
                }
                self.values_of_sum(i, summed?)?
            }
            Op::ReduceScatter(r) if !r.pieces.is_empty() => {
                // Unequal parts (a dim that tp does not divide, or shares): every rank sums
                // the whole value and keeps its piece, after the earlier ranks', padded with
                // zeros to the largest (as an uneven local slice keeps it). Twice a
                // reduce-scatter's bytes, only where an override splits a dim so.
                let mut sum = b.copy(x(0)?).map_err(&err)?;
                self.collective_bytes += message_bytes(&sum);
                let ran = match self.comm.all_reduce_sum_planned(&mut sum, None) {
                    Ok(ran) => ran,
                    Err(e) => {
                        b.release(sum);
                        return Err(e.into());
                    }
                };
                self.all_reduces.add(ran);
                let sum = self.values_of_sum(i, sum)?;
                let (offset, len, width) = piece_window(&r.pieces, &r.starts, self.rank);
                let piece = b
                    .column_window(&sum, offset as usize, len as usize, width as usize)
                    .map_err(&err);
                b.release(sum);
                piece?
            }
            Op::ReduceScatter(_) => {
                // Column blocks to rank-major row blocks, one per rank, each rank keeping its sum.
                let x = x(0)?;
                let (rows, n) = x.rows_cols();
                let arranged = b.rows_to_rank_major(x, self.tp).map_err(&err)?;
                let shape = [rows, n / self.tp];
                let sum = scatter_sum(
                    b,
                    &mut self.comm,
                    &mut self.collective_bytes,
                    arranged,
                    &shape,
                    &err,
                )?;
                self.values_of_sum(i, sum)?
            }
            Op::LocalSlice(l) if i.fact.shape.is_sequence(l.dim) => {
                let x = x(0)?;
                let blocks = self.token_blocks(x.rows_cols().0);
                let offset = blocks[..self.rank].iter().sum::<usize>();
                b.row_window(x, offset, blocks[self.rank]).map_err(err)?
            }
            Op::LocalSlice(l) if !l.pieces.is_empty() => {
                // This rank's uneven piece (after the earlier ranks' or where `starts`
                // places it), padded to the largest.
                let (offset, len, width) = piece_window(&l.pieces, &l.starts, self.rank);
                b.column_window(x(0)?, offset as usize, len as usize, width as usize)
                    .map_err(err)?
            }
            Op::LocalSlice(_) => b.column_block(x(0)?, self.rank, self.tp).map_err(err)?,
            Op::Route(r) => {
                let logits = b.copy(x(0)?).and_then(|l| b.to_host(l)).map_err(&err)?;
                let top_k = usize::try_from(r.top_k).unwrap_or(usize::MAX);
                let routing = super::moe::route(&logits, top_k, r.normalize).map_err(&err)?;
                b.upload_host(&routing).map_err(err)?
            }
            Op::Experts(e) => {
                let routing = b.copy(x(1)?).and_then(|r| b.to_host(r)).map_err(&err)?;
                let experts = self
                    .experts
                    .get(&i.id)
                    .ok_or_else(|| bad(i, "its experts' weights were not loaded"))?;
                let (y, pairs) = match &self.expert_member {
                    Some(m) => {
                        super::moe_across::experts_across(b, m, x(0)?, &routing, experts, e.act)
                            .map_err(|e| across_error(&i.name, e))?
                    }
                    None => {
                        super::moe::run_experts(b, x(0)?, &routing, experts, e.act).map_err(err)?
                    }
                };
                self.routed_pairs = self.routed_pairs.saturating_add(pairs);
                y
            }
            Op::Param(_) | Op::Input(_) | Op::Output(_) => {
                return Err(bad(i, "is not a compute op"))
            }
        })
    }
}

/// An error of a mixture-of-experts layer dealt over replicas, for instruction `name`.
/// Every rank of `comm`'s `counts`, rank after rank (an all-gather of three 24-bit limbs a
/// count, exact in f32, through `b`'s memory).
fn gather_counts_over<B: Backend, C: Collectives<B::Act>>(
    b: &B,
    comm: &mut C,
    counts: &[u64],
) -> Result<Vec<u64>> {
    let on = |error| RunError::Backend {
        name: "load report".into(),
        error,
    };
    const LIMB: u64 = 1 << 24;
    let limbs: Vec<f32> = counts
        .iter()
        .flat_map(|&c| (0..3).map(move |i| ((c >> (24 * i)) % LIMB) as f32))
        .collect();
    let width = limbs.len();
    let local = b
        .upload_host(&Tensor::new(vec![1, width], limbs))
        .map_err(on)?;
    let ranks = comm.world_size();
    let mut all = b
        .alloc(&[1, width * ranks], crate::ir::DType::F32)
        .map_err(on)?;
    let sent = comm.all_gather(&local, &mut all);
    b.release(local);
    let all = b.to_host(all).map_err(on)?;
    sent?;
    Ok(all
        .data
        .chunks_exact(3)
        .map(|l| {
            l.iter().rev().fold(0u64, |n, &limb| {
                n.saturating_mul(LIMB).saturating_add(limb as u64)
            })
        })
        .collect())
}

fn across_error(name: &str, e: super::moe_across::AcrossError) -> RunError {
    match e {
        super::moe_across::AcrossError::Backend(error) => RunError::Backend {
            name: name.to_string(),
            error,
        },
        super::moe_across::AcrossError::Exchange(e) => RunError::ExpertExchange(e),
    }
}

/// Every mixture-of-experts op's experts on this rank: per routing column, the expert's
/// gate and up as one weight (one product) and its down, read from the experts' own
/// tensors (`plan::experts`). Also the ids of the stacked params they replace, and bytes.
/// A member of a DP group sharing its experts (`member`) loads only its own columns'.
#[allow(clippy::type_complexity)]
fn load_experts<B: Backend>(
    program: &RankProgram,
    slices: &HashMap<&str, &crate::plan::WeightSlice>,
    src: &dyn WeightSource,
    backend: &B,
    member: Option<&super::expert_exchange::ExpertMember>,
) -> Result<(
    HashMap<u32, Vec<Option<ExpertWeights<B::Weight>>>>,
    HashSet<u32>,
    u64,
)> {
    let by_id: HashMap<u32, &Instr> = program.instrs.iter().map(|i| (i.id, i)).collect();
    let mut all = HashMap::new();
    let mut params = HashSet::new();
    let mut bytes = 0u64;
    for i in program
        .instrs
        .iter()
        .filter(|i| matches!(i.op, Op::Experts(_)))
    {
        let stack = |slot: usize| -> Result<Vec<Option<crate::plan::WeightSlice>>> {
            let id = *i
                .inputs
                .get(slot)
                .ok_or_else(|| bad(i, "an input is missing"))?;
            let Some(Op::Param(p)) = by_id.get(&id).map(|w| &w.op) else {
                return Err(bad(i, format!("input {slot} is not a weight")));
            };
            let w = slices
                .get(&*p.tensor)
                .ok_or_else(|| bad(i, "its weight is not in the rank's manifest"))?;
            crate::plan::experts::expert_slices(w).ok_or_else(|| {
                bad(
                    i,
                    format!(
                        "its weight `{}` is not a stack of experts (a name with `{}`)",
                        p.tensor,
                        crate::plan::experts::EXPERT_MARK
                    ),
                )
            })
        };
        let (gate, up, down) = (stack(2)?, stack(3)?, stack(4)?);
        params.extend(i.inputs.iter().skip(2).copied());
        if gate.len() != up.len() || gate.len() != down.len() {
            return Err(bad(i, "its gate, up and down hold different experts"));
        }
        let fail = |e: BackendError| match e {
            BackendError::Weights(e) => e.into(),
            error => on(i)(error),
        };
        let mut experts = Vec::with_capacity(gate.len());
        let mine = member.map_or(0..gate.len(), |m| {
            super::moe_across::my_columns(gate.len(), m)
        });
        for (column, ((g, u), d)) in gate.iter().zip(&up).zip(&down).enumerate() {
            let (true, Some(g), Some(u), Some(d)) = (mine.contains(&column), g, u, d) else {
                experts.push(None);
                continue;
            };
            let features = g.local_shape.first().copied().unwrap_or(0);
            let features =
                usize::try_from(features).map_err(|_| bad(i, "an expert wider than memory"))?;
            let gate_up = backend
                .upload_linears(src, &[g, u], WeightOrder::OutIn)
                .map_err(fail)?;
            let usage = WeightUse {
                linear: Some(WeightOrder::OutIn),
                other: false,
            };
            let down = backend.upload(src, d, usage).map_err(fail)?;
            bytes += (backend.weight_bytes(&gate_up) + backend.weight_bytes(&down)) as u64;
            experts.push(Some(ExpertWeights {
                gate_up,
                down,
                features,
            }));
        }
        all.insert(i.id, experts);
    }
    Ok((all, params, bytes))
}

/// All-gathers `local` from every rank into a new rank-major `[rows · tp, cols]` buffer,
/// counting its bytes, and returns what `finish` makes of it; the gathered buffer is
/// released whatever happens.
fn gather_then<B, C, T>(
    b: &B,
    comm: &mut C,
    bytes: &mut u64,
    tp: usize,
    local: &B::Act,
    err: &dyn Fn(BackendError) -> RunError,
    finish: impl FnOnce(&B::Act) -> Result<T>,
) -> Result<T>
where
    B: Backend,
    C: Collectives<B::Act>,
{
    let (rows, n) = local.rows_cols();
    let mut all = b.alloc(&[rows * tp, n], local.dtype()).map_err(err)?;
    *bytes += message_bytes(&all);
    let out = comm
        .all_gather(local, &mut all)
        .map_err(RunError::from)
        .and_then(|()| finish(&all));
    b.release(all);
    out
}

/// Reduce-scatters `arranged` (one block of rows per rank, in rank order) into a new buffer
/// of `shape`, this rank's block summed over the ranks, counting the bytes sent; `arranged`
/// is released whatever happens.
fn scatter_sum<B, C>(
    b: &B,
    comm: &mut C,
    bytes: &mut u64,
    arranged: B::Act,
    shape: &[usize],
    err: &dyn Fn(BackendError) -> RunError,
) -> Result<B::Act>
where
    B: Backend,
    C: Collectives<B::Act>,
{
    *bytes += message_bytes(&arranged);
    let out = b
        .alloc(shape, arranged.dtype())
        .map_err(err)
        .and_then(|mut out| {
            comm.reduce_scatter_sum(&arranged, &mut out)
                .map_err(RunError::from)
                .map(|()| out)
        });
    b.release(arranged);
    out
}

fn message_bytes<A: Activation>(a: &A) -> u64 {
    (a.elements() as u64).saturating_mul(a.dtype().size_bytes())
}

fn act<'v, A>(values: &'v [Option<Value<A>>], i: &Instr, slot: usize) -> Result<&'v A> {
    let id = *i
        .inputs
        .get(slot)
        .ok_or_else(|| bad(i, format!("input {slot} is missing")))?;
    match values.get(id as usize) {
        Some(Some(Value::Act(t))) => Ok(t),
        _ => Err(bad(i, format!("input %{id} is not a computed activation"))),
    }
}

/// Where part `part` of a fused last dim of `n` columns lies: (block, offset, len) within
/// each repeating block of `block` columns.
fn unfuse_block(groups: &Groups, part: usize, n: usize) -> Option<(usize, usize, usize)> {
    let (block, offset, len) = match groups {
        Groups::Concat(parts) => {
            let lens: Vec<u64> = parts
                .iter()
                .map(|p| p.covered_len())
                .collect::<Option<_>>()?;
            let offset: u64 = lens.get(..part)?.iter().sum();
            (n as u64, offset, *lens.get(part)?)
        }
        Groups::Interleaved { heads, parts } => {
            let block: u64 = parts.iter().sum();
            let offset: u64 = parts.get(..part)?.iter().sum();
            if block.checked_mul(*heads)? != n as u64 {
                return None;
            }
            (block, offset, *parts.get(part)?)
        }
        _ => return None,
    };
    let (block, offset, len) = (
        usize::try_from(block).ok()?,
        usize::try_from(offset).ok()?,
        usize::try_from(len).ok()?,
    );
    (offset.checked_add(len)? <= block && block > 0 && n.is_multiple_of(block))
        .then_some((block, offset, len))
}
