//! The α-β cost model of a plan on a hardware profile: per phase (a prefill of the whole
//! batch, one decode step), time split into compute, memory and communication, plus memory
//! per rank. Compute and memory overlap (a phase takes the larger), communication does not
//! (tensor-parallel collectives sit between dependent ops), nor does a profile's fixed cost
//! per op. On a shared host (`HwProfile::shared`) each rank gets its share of the host's
//! compute and bandwidth.

use super::algorithms::all_reduce_time;
use super::profile::HwProfile;
use super::rank_speed::RankSpeed;
use crate::ir::{DType, Op};
use crate::plan::{Collective, Plan};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// What is run: `batch` sequences of `prompt` tokens, each generating `gen` more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub batch: u64,
    pub prompt: u64,
    pub gen: u64,
}

/// The number types a runtime computes a plan with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Numerics {
    /// Type the weights are held and read in.
    pub weights: DType,
    /// Type of the activations, the KV cache and the collectives' messages.
    pub activations: DType,
    /// Quantized weights are held as their codes with an f32 scale per output column per
    /// block of inputs (tpc's CPU runtime, whose products read the codes), rather than
    /// exactly as stored (a GPU runtime's FP8 products); codes are a byte whatever
    /// `weights` is.
    pub column_scales: bool,
}

impl Numerics {
    /// The plan's own dtype throughout (what a GPU runtime does).
    pub fn of_plan(plan: &Plan) -> Numerics {
        Numerics {
            weights: plan.dtype,
            activations: plan.dtype,
            column_scales: false,
        }
    }

    /// tpc's CPU runtime (`tpc run` / `tpc bench`): weights in bf16 or f32 as its `--dtype`
    /// chose; activations, the KV cache and collectives in f32 always.
    pub fn cpu_runtime(bf16_weights: bool) -> Numerics {
        Numerics {
            weights: if bf16_weights {
                DType::Bf16
            } else {
                DType::F32
            },
            activations: DType::F32,
            column_scales: true,
        }
    }

    /// What runs `plan` on `hw` by default: tpc's CPU runtime with `--dtype auto` on a
    /// shared-host profile (`tpc calibrate`'s), the plan's dtype throughout on a device.
    pub fn for_profile(plan: &Plan, hw: &HwProfile) -> Numerics {
        if hw.shared.is_some() {
            Numerics::cpu_runtime(plan.dtype == DType::Bf16)
        } else {
            Numerics::of_plan(plan)
        }
    }
}

/// Time of one phase, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PhaseTime {
    pub time_s: f64,
    pub compute_s: f64,
    pub memory_s: f64,
    pub comm_s: f64,
    /// The profile's fixed cost per op times the ops the rank runs.
    pub overhead_s: f64,
    /// Elementwise ops (norms, rope, activation, mul, add, bias, embedding): the
    /// activations they read and write at the rank's memory bandwidth, apart from the
    /// GEMMs (separate kernels, run one after another).
    pub elementwise_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokensPerS {
    pub prefill: f64,
    pub decode: f64,
}

/// The model's estimate for one plan, workload and profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub model: String,
    pub tp: u64,
    /// Pipeline stages (1: none).
    pub pp: u64,
    /// Data-parallel replicas sharing their experts (`--dp D --ep`; 1: none). The
    /// throughputs are then all replicas' together; times and memory are per rank.
    pub dp: u64,
    pub hw: String,
    /// True when the profile is a rough one (`tpc calibrate --quick`): the figures are for
    /// trying the command, not predictions.
    pub rough_profile: bool,
    /// Types of the weights and of the activations (KV cache, collectives) priced.
    pub weight_dtype: DType,
    /// How a quantized checkpoint's weights were priced (`fp8 e4m3 linears as stored`, or
    /// `... as codes with a scale per column` under tpc's CPU runtime); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantized_weights: Option<String>,
    pub activation_dtype: DType,
    pub prefill: PhaseTime,
    pub decode_step: PhaseTime,
    /// Weights plus the KV cache at the end of generation, on the fullest rank.
    pub memory_per_rank_bytes: u64,
    pub weight_bytes_per_rank: u64,
    pub kv_bytes_per_rank: u64,
    pub device_memory_bytes: u64,
    pub fits: bool,
    pub tokens_per_s: TokensPerS,
    /// Communication calls a forward pass waits on: every tensor-parallel collective of
    /// the plan, and the `pp − 1` sends between pipeline stages.
    pub collectives_per_pass: u64,
    /// Per pipeline stage, when `pp > 1`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageEstimate>,
}

/// Per-token work of the fullest rank (or of one pipeline stage of it), read off its program.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct RankWork {
    /// FLOPs of its linears per token (2 per weight element).
    linear_flops_per_token: f64,
    /// The part of those FLOPs in the linears a prefill runs on the last row of each
    /// sequence only (the LM head: `RankProgram::head_linears`).
    head_flops_per_token: f64,
    /// FLOPs per (query, key) pair summed over its attention ops (4 per head and dim:
    /// scores and weighted values).
    attention_flops_per_pair: f64,
    /// The largest head size of its attention ops (the profile's rate may depend on it).
    attention_head_dim: f64,
    /// Its attention ops (to share the KV cache out over pipeline stages).
    attention_ops: f64,
    weight_bytes: f64,
    /// Bytes of the weights a forward pass reads whole (all but embedding tables, which are
    /// read by row; a table tied to the LM head is read whole).
    weight_read_bytes: f64,
    kv_bytes_per_token: f64,
    /// Activation elements per token the elementwise ops (norms, rope, activation, mul,
    /// add, bias, embedding) read and write: memory-bound work outside the GEMMs.
    elementwise_elements_per_token: f64,
    /// Compute ops in its program (each pays the profile's fixed cost once per pass).
    ops: f64,
    /// Its mixture-of-experts layers, read apart from `weight_read_bytes`: a pass reads
    /// only the experts its tokens chose ([`ExpertWork`]).
    experts: ExpertWork,
}

/// The experts a rank holds, over its mixture-of-experts layers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct ExpertWork {
    /// Layers with experts.
    layers: f64,
    /// Bytes and elements of the rank's expert weights, all layers.
    bytes: f64,
    elements: f64,
    /// Experts the rank holds per layer (all of them split by features, its deal split by
    /// experts).
    local: f64,
    /// Experts in a layer, and how many each token chooses.
    total: f64,
    top_k: f64,
    /// Elements per token of the layer's input (a row dispatched to another replica).
    width: f64,
    /// Replicas whose tokens the rank's experts serve (`--ep`; 1: its own only).
    replicas: f64,
}

/// Kernels the runtime launches per chosen expert: gather the rows, the gate|up product,
/// split it, the activation, the product, the down product (`runtime::moe`).
const OPS_PER_EXPERT: f64 = 6.0;

impl ExpertWork {
    /// The busiest rank's share of `tokens` tokens' routing, with uniform routing: FLOPs,
    /// bytes of expert weights read, and kernels. A rank holding all experts (split by
    /// features) sees every token's choice; one holding a deal sees a binomial share, and
    /// the slowest of `tp` such ranks sets the pace (mean + √(2 ln tp) standard
    /// deviations, the expected maximum of tp normal draws).
    fn busiest(&self, tokens: f64, tp: u64) -> (f64, f64, f64) {
        if self.layers == 0.0 || self.local == 0.0 || self.total == 0.0 || tokens <= 0.0 {
            return (0.0, 0.0, 0.0);
        }
        // Under --ep every replica's tokens reach the rank, and the busiest is one of all
        // the replicas' ranks.
        let replicas = self.replicas.max(1.0);
        let (tokens, tp) = (tokens * replicas, tp.saturating_mul(replicas as u64));
        let pick = (self.top_k / self.total).clamp(0.0, 1.0);
        let share = (self.local / self.total).clamp(0.0, 1.0);
        let spread = if share < 1.0 && tp > 1 {
            (2.0 * (tp as f64).ln()).sqrt()
        } else {
            0.0
        };
        // Each expert is chosen by at least one token with probability 1 − (1 − k/E)^n.
        let used_p = 1.0 - (1.0 - pick).powf(tokens);
        let used_mean = self.local * used_p;
        let used = (used_mean + spread * (used_mean * (1.0 - used_p)).sqrt()).min(self.local);
        // Token-expert pairs routed to this rank's experts.
        let routed = tokens * self.top_k;
        let mine = routed * share;
        let pairs = (mine + spread * (mine * (1.0 - share)).sqrt())
            .min(tokens * self.top_k.min(self.local));
        let flops = 2.0 * self.elements / self.local * pairs;
        let bytes = self.bytes / self.local * used;
        (flops, bytes, self.layers * used * OPS_PER_EXPERT)
    }
}

impl std::ops::AddAssign for ExpertWork {
    fn add_assign(&mut self, o: ExpertWork) {
        self.layers += o.layers;
        self.bytes += o.bytes;
        self.elements += o.elements;
        self.local = self.local.max(o.local);
        self.total = self.total.max(o.total);
        self.top_k = self.top_k.max(o.top_k);
        self.width = self.width.max(o.width);
        self.replicas = self.replicas.max(o.replicas);
    }
}

impl ExpertWork {
    /// The rank's experts dealt again over `dp` replicas (`--ep`): it keeps the largest
    /// deal, ⌈local / dp⌉ per layer, and serves every replica's tokens.
    fn over_replicas(self, dp: u64) -> ExpertWork {
        if self.local == 0.0 || dp <= 1 {
            return self;
        }
        let kept = (self.local / dp as f64).ceil();
        let f = kept / self.local;
        ExpertWork {
            bytes: self.bytes * f,
            elements: self.elements * f,
            local: kept,
            replicas: dp as f64,
            ..self
        }
    }

    /// Bytes one rank sends in one all-to-all round of a layer for `tokens` of its own
    /// tokens under `--ep`: to each of the other dp − 1 members, the rows with a choice
    /// among that member's experts (uniform routing: 1 − (1 − local/E)^k of them), each a
    /// row of `width` activations and its routing weights.
    fn dispatch_bytes(&self, tokens: f64, act_bytes: f64) -> f64 {
        let others = self.replicas.max(1.0) - 1.0;
        if others <= 0.0 || self.total == 0.0 {
            return 0.0;
        }
        let hit = 1.0 - (1.0 - (self.local / self.total).clamp(0.0, 1.0)).powf(self.top_k);
        tokens * others * hit * (self.width * act_bytes + self.local * 4.0)
    }
}

impl std::ops::AddAssign for RankWork {
    fn add_assign(&mut self, o: RankWork) {
        self.linear_flops_per_token += o.linear_flops_per_token;
        self.head_flops_per_token += o.head_flops_per_token;
        self.attention_flops_per_pair += o.attention_flops_per_pair;
        self.attention_head_dim = self.attention_head_dim.max(o.attention_head_dim);
        self.attention_ops += o.attention_ops;
        self.weight_bytes += o.weight_bytes;
        self.weight_read_bytes += o.weight_read_bytes;
        self.kv_bytes_per_token += o.kv_bytes_per_token;
        self.elementwise_elements_per_token += o.elementwise_elements_per_token;
        self.ops += o.ops;
        self.experts += o.experts;
    }
}

/// Decoder layers of the plan.
fn layer_count(plan: &Plan) -> usize {
    plan.ranks
        .first()
        .map_or(0, crate::plan::stages::layer_count)
}

fn per_token(shape: &crate::ir::Shape) -> Option<f64> {
    shape
        .0
        .iter()
        .any(|d| !matches!(d, crate::ir::Dim::Fixed(_)))
        .then(|| shape.fixed_elements() as f64)
}

/// How `plan`'s quantized weights are priced under `num`, if it has any.
fn quantized_weights(plan: &Plan, num: Numerics) -> Option<String> {
    let q = plan
        .ranks
        .iter()
        .flat_map(|r| &r.weights)
        .find_map(|w| w.quant)?;
    Some(if num.column_scales && q.format.is_int4() && q.act_order {
        format!(
            "{} linears in act order as codes sorted by group, with a scale and a zero per \
             column per group",
            q.format.name()
        )
    } else if num.column_scales && q.format.is_int4() {
        format!(
            "{} linears as codes with a scale and a zero per column per group",
            q.format.name()
        )
    } else if num.column_scales {
        format!(
            "{} linears as codes with a scale per column",
            q.format.name()
        )
    } else {
        format!("{} linears as stored", q.format.name())
    })
}

/// Bytes a rank holds of weight `s` in units of the plan's dtype, which the caller then
/// scales to `num.weights`: as stored, or under `num.column_scales` a quantized weight's
/// codes and column scales (given in the units that scale back to their own size).
fn held_bytes(s: &crate::plan::WeightSlice, plan: &Plan, num: Numerics) -> f64 {
    match s.quant {
        Some(q) if num.column_scales => {
            q.column_scaled_bytes(&s.local_shape) as f64 * plan.dtype.size_bytes() as f64
                / num.weights.size_bytes().max(1) as f64
        }
        _ => s.local_bytes() as f64,
    }
}

/// Bytes of `rank`'s weights: the compile report's figure (as stored), or with quantized
/// weights held as `num` says.
fn rank_weight_bytes(
    plan: &Plan,
    summary: &crate::plan::report::Summary,
    rank: usize,
    num: Numerics,
) -> f64 {
    match plan.ranks.get(rank) {
        Some(r) if num.column_scales => r.weights.iter().map(|s| held_bytes(s, plan, num)).sum(),
        _ => summary.param_bytes_per_rank.get(rank).copied().unwrap_or(0) as f64,
    }
}

/// Each rank's work per segment (see [`segments`]); weight bytes are its slices' bytes (see
/// [`held_bytes`]), KV bytes are left 0 (the compile report's figures are per rank, shared
/// out later).
fn segment_work(plan: &Plan, layers: usize, num: Numerics) -> Vec<Vec<RankWork>> {
    plan.ranks
        .iter()
        .map(|r| {
            let seg = crate::plan::stages::segments(r, layers);
            let mut out = vec![RankWork::default(); layers + 2];
            let facts: HashMap<u32, _> = r.instrs.iter().map(|i| (i.id, &i.fact)).collect();
            let elements = |id: Option<&u32>| {
                id.and_then(|id| facts.get(id))
                    .map_or(0.0, |f| f.shape.fixed_elements() as f64)
            };
            let activation = |id: &u32| facts.get(id).and_then(|f| per_token(&f.shape));
            let mut read_whole = HashSet::new();
            for i in &r.instrs {
                for (slot, id) in i.inputs.iter().enumerate() {
                    if !(matches!(i.op, Op::Embedding(_)) && slot == 1) {
                        read_whole.insert(*id);
                    }
                }
            }
            let slices: HashMap<&str, &crate::plan::WeightSlice> =
                r.weights.iter().map(|s| (&*s.tensor, s)).collect();
            let heads = r.head_linears();
            // Sequence parallelism: the rank's part of the tokens (its share, else 1/tp).
            let token_share = match &r.sequence_shares {
                Some(s) => {
                    let parts = s.parts();
                    let total: f64 = parts.iter().map(|&p| f64::from(p)).sum();
                    parts
                        .get(r.rank as usize)
                        .map_or(1.0 / plan.tp as f64, |&p| f64::from(p) / total)
                }
                None => 1.0 / plan.tp as f64,
            };
            let by_id: HashMap<u32, &crate::plan::Instr> =
                r.instrs.iter().map(|i| (i.id, i)).collect();
            let weight_of = |id: &u32| match by_id.get(id).map(|i| &i.op) {
                Some(Op::Param(p)) => slices.get(&*p.tensor).copied(),
                _ => None,
            };
            // Expert stacks are read by the experts chosen, priced apart.
            let stacks: HashSet<u32> = r
                .instrs
                .iter()
                .filter(|i| matches!(i.op, Op::Experts(_)))
                .flat_map(|i| i.inputs.iter().skip(2).copied())
                .collect();
            // A fused product's linears after its first run inside its one product: one op.
            let in_product: HashSet<u32> = r
                .fused
                .iter()
                .flat_map(|g| g.linears.iter().skip(1).copied())
                .collect();
            for (i, &s) in r.instrs.iter().zip(&seg) {
                let w = &mut out[s];
                if let Op::Param(p) = &i.op {
                    let bytes = slices
                        .get(&*p.tensor)
                        .map_or(0.0, |s| held_bytes(s, plan, num));
                    w.weight_bytes += bytes;
                    if read_whole.contains(&i.id) && !stacks.contains(&i.id) {
                        w.weight_read_bytes += bytes;
                    }
                }
                match &i.op {
                    Op::Linear(_) => {
                        let flops = 2.0 * elements(i.inputs.get(1));
                        w.linear_flops_per_token += flops;
                        if heads.contains(&i.id) {
                            w.head_flops_per_token += flops;
                        }
                    }
                    Op::Experts(_) => {
                        let gate = i.inputs.get(2).and_then(weight_of);
                        let total = gate.and_then(|g| g.shape.first()).copied().unwrap_or(0);
                        let local = gate.map_or(0, |g| match g.dim {
                            Some(0) => g.ranges.iter().map(|r| r.len).sum(),
                            _ => total,
                        });
                        // The router feeding it (through the slice of an expert deal).
                        let mut at = i.inputs.get(1).and_then(|id| by_id.get(id));
                        if let Some(Op::LocalSlice(_)) = at.map(|x| &x.op) {
                            at = at
                                .and_then(|x| x.inputs.first())
                                .and_then(|id| by_id.get(id));
                        }
                        let top_k = match at.map(|x| &x.op) {
                            Some(Op::Route(route)) => route.top_k,
                            _ => 0,
                        };
                        let stack = i.inputs.iter().skip(2);
                        w.experts += ExpertWork {
                            width: i.inputs.first().and_then(activation).unwrap_or(0.0),
                            replicas: 1.0,
                            layers: 1.0,
                            bytes: stack
                                .clone()
                                .filter_map(weight_of)
                                .map(|s| held_bytes(s, plan, num))
                                .sum(),
                            elements: stack.map(|id| elements(Some(id))).sum(),
                            local: local as f64,
                            total: total as f64,
                            top_k: top_k as f64,
                        };
                    }
                    Op::Attention(a) => {
                        let q = elements(i.inputs.first());
                        w.attention_flops_per_pair += 4.0 * q;
                        w.attention_head_dim = w.attention_head_dim.max(a.head_dim as f64);
                        w.attention_ops += 1.0;
                    }
                    op if is_compute_op(op) => {
                        // Activations read and written; an embedding also reads its rows.
                        let read: f64 = i.inputs.iter().filter_map(activation).sum();
                        let written = per_token(&i.fact.shape).unwrap_or(0.0);
                        let rows = if matches!(op, Op::Embedding(_)) {
                            written
                        } else {
                            0.0
                        };
                        // Sequence parallelism: the op runs on the rank's block of tokens.
                        let share = if i.is_split_by_tokens() {
                            token_share
                        } else {
                            1.0
                        };
                        w.elementwise_elements_per_token += (read + written + rows) * share;
                    }
                    _ => {}
                }
                if is_compute_op(&i.op) && !in_product.contains(&i.id) {
                    w.ops += 1.0;
                }
            }
            out
        })
        .collect()
}

/// The work of the fullest rank (most weight and KV bytes per the compile report).
fn rank_work(plan: &Plan, num: Numerics) -> RankWork {
    // Weight and KV bytes per rank are the compile report's own figures.
    let summary = crate::plan::report::summarize(plan);
    let mut fullest = RankWork::default();
    for (rank, segs) in segment_work(plan, layer_count(plan), num)
        .into_iter()
        .enumerate()
    {
        let mut w = RankWork::default();
        for s in segs {
            w += s;
        }
        w.weight_bytes = rank_weight_bytes(plan, &summary, rank, num);
        w.kv_bytes_per_token = summary
            .kv_cache_bytes_per_token_per_rank
            .get(rank)
            .copied()
            .unwrap_or(0) as f64;
        if w.weight_bytes + w.kv_bytes_per_token > fullest.weight_bytes + fullest.kv_bytes_per_token
        {
            fullest = w;
        }
    }
    fullest
}

/// Compute ops per forward pass of the fullest rank (each pays the profile's per-op cost).
pub fn ops_per_pass(plan: &Plan) -> f64 {
    rank_work(plan, Numerics::of_plan(plan)).ops
}

/// Ops that run a kernel on the rank's threads (not inputs, weights, views, outputs, or
/// collectives, which are priced by their α).
fn is_compute_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Embedding(_)
            | Op::Linear(_)
            | Op::BiasAdd(_)
            | Op::Add(_)
            | Op::Mul(_)
            | Op::SigmoidGate(_)
            | Op::Route(_)
            | Op::Activation(_)
            | Op::RmsNorm(_)
            | Op::LayerNorm(_)
            | Op::Rope(_)
            | Op::Attention(_)
    )
}

/// Time of one all-reduce of `bytes` over `p` ranks with the cheapest algorithm.
pub fn all_reduce_s(link: &super::profile::LinkCosts, p: u64, bytes: f64) -> f64 {
    super::algorithms::cheapest_all_reduce(link, p, bytes).1
}

/// Time of one all-gather whose result is `bytes` (or one reduce-scatter of a `bytes`
/// input) over `p` ranks, by the cheaper algorithm. Each rank moves (p − 1)/p of the
/// message either way: around a ring, half of a ring all-reduce (its latency too: a ring
/// all-reduce is a reduce-scatter then an all-gather, so the two together cost exactly
/// one); or directly, every rank reading its peers' pieces after one barrier (what the
/// in-process communicator does, and NVSwitch's direct copies), at the one-shot link's
/// latency and rate.
pub fn gather_or_scatter_s(link: &super::profile::LinkCosts, p: u64, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    let wire = (p - 1.0) / p * bytes;
    let ring = link.ring.alpha_s * (p - 1.0) / 2.0 + wire / link.ring.beta_bytes_per_s;
    let direct = link.one_shot.alpha_s + wire / link.one_shot.beta_bytes_per_s;
    ring.min(direct)
}

/// The all-reduce algorithms a plan recorded (compiled for a profile), by collective id.
type Recorded<'a> = HashMap<u32, &'a crate::ir::AlgorithmChoice>;

fn recorded_algorithms(plan: &Plan) -> Recorded<'_> {
    plan.ranks
        .first()
        .into_iter()
        .flat_map(|r| &r.instrs)
        .filter_map(|i| match &i.op {
            Op::AllReduce(a) => a.algorithm.as_ref().map(|c| (i.id, c)),
            Op::RmsNorm(n) => n
                .reduce_input
                .as_ref()
                .and_then(|a| a.algorithm.as_ref())
                .map(|c| (i.id, c)),
            _ => None,
        })
        .collect()
}

fn comm_s(
    plan: &Plan,
    hw: &HwProfile,
    recorded: &Recorded,
    tokens: f64,
    scale: f64,
    collectives: &[&Collective],
) -> f64 {
    // An all-reduce runs the algorithm its plan recorded, else the cheapest.
    collectives
        .iter()
        .map(|c| {
            let bytes = c.bytes_per_token as f64 * tokens * scale;
            match c.kind.as_str() {
                "all_gather" | "reduce_scatter" => gather_or_scatter_s(&hw.link, plan.tp, bytes),
                _ => match recorded.get(&c.id).and_then(|r| r.for_bytes(bytes as u64)) {
                    Some(a) => all_reduce_time(&hw.link, a, plan.tp, bytes),
                    None => all_reduce_s(&hw.link, plan.tp, bytes),
                },
            }
        })
        // From +0 (a sum of no f64 is -0, which prints as "-0.000 ms").
        .fold(0.0, |a, b| a + b)
}

fn phase(
    compute_s: f64,
    memory_s: f64,
    comm_s: f64,
    overhead_s: f64,
    elementwise_s: f64,
) -> PhaseTime {
    PhaseTime {
        time_s: compute_s.max(memory_s) + elementwise_s + overhead_s + comm_s,
        compute_s,
        memory_s,
        comm_s,
        overhead_s,
        elementwise_s,
    }
}

/// Field-wise sum of phases run one after another (pipeline stages).
fn sum_phases(phases: &[PhaseTime]) -> PhaseTime {
    let mut t = PhaseTime {
        time_s: 0.0,
        compute_s: 0.0,
        memory_s: 0.0,
        comm_s: 0.0,
        overhead_s: 0.0,
        elementwise_s: 0.0,
    };
    for p in phases {
        t.time_s += p.time_s;
        t.compute_s += p.compute_s;
        t.memory_s += p.memory_s;
        t.comm_s += p.comm_s;
        t.overhead_s += p.overhead_s;
        t.elementwise_s += p.elementwise_s;
    }
    t
}

/// Why a plan cannot be priced as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimulateError {
    #[error(
        "--pp {pp} asks for more pipeline stages than the model's {layers} decoder layers; \
         valid: {valid}"
    )]
    Stages { pp: u64, layers: u64, valid: String },
}

/// One pipeline stage's figures (its fullest rank).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StageEstimate {
    /// Its decoder layers: `first_layer .. first_layer + layers`.
    pub first_layer: u64,
    pub layers: u64,
    pub weight_bytes_per_rank: u64,
    /// KV cache of its layers at the end of generation.
    pub kv_bytes_per_rank: u64,
    pub prefill_time_s: f64,
    pub decode_step_time_s: f64,
}

/// The profile's figures for one rank: GEMM peak, memory bandwidth and attention rate (for
/// heads of `head_dim`), for `compute_ranks` ranks holding threads and `bandwidth_ranks`
/// streaming memory at once.
struct Rates {
    peak: f64,
    bandwidth: f64,
    attention: f64,
    /// Fixed cost per compute op of the rank (its thread count decides, on a shared host).
    op_overhead_s: f64,
}

fn rates(
    hw: &HwProfile,
    compute_ranks: u64,
    bandwidth_ranks: u64,
    f32_weights: bool,
    head_dim: f64,
) -> Rates {
    let (peak, _) = hw.per_rank(compute_ranks, f32_weights);
    let (_, bandwidth) = hw.per_rank(bandwidth_ranks, f32_weights);
    let share = hw
        .shared
        .as_ref()
        .map_or(1.0, |h| h.compute_share(compute_ranks));
    // Attention at its own measured rate where the profile has one (a rank's share of it
    // on a shared host), else at the GEMM peak.
    let attention = match hw.attention_rate(head_dim as u64) {
        Some(a) => a * share,
        None => peak,
    };
    let op_overhead_s = hw.shared.as_ref().map_or(hw.op_overhead_s, |h| {
        h.op_overhead_s(compute_ranks, hw.op_overhead_s)
    });
    Rates {
        peak,
        bandwidth,
        attention,
        op_overhead_s,
    }
}

/// Prefill and decode-step times of `w` (with `collectives`, the ones it waits on).
#[allow(clippy::too_many_arguments)]
fn price(
    plan: &Plan,
    hw: &HwProfile,
    recorded: &Recorded,
    work: Workload,
    w: &RankWork,
    r: &Rates,
    act_scale: f64,
    act_bytes: f64,
    collectives: &[&Collective],
) -> (PhaseTime, PhaseTime) {
    let overhead = w.ops * r.op_overhead_s;
    let (b, s, g) = (work.batch as f64, work.prompt as f64, work.gen as f64);
    let attention = |pairs: f64| w.attention_flops_per_pair * pairs / r.attention;
    let elementwise =
        |tokens: f64| w.elementwise_elements_per_token * act_bytes * tokens / r.bandwidth;

    // Prefill: every prompt token through every linear but the LM head, which runs on the
    // last token of each sequence; causal attention over s(s+1)/2 pairs per sequence;
    // weights read once, the prompt's keys and values written.
    // Experts: only those the pass's tokens chose are read and run.
    let (expert_flops, expert_bytes, expert_ops) = w.experts.busiest(b * s, plan.tp);
    let prefill_linear = (w.linear_flops_per_token - w.head_flops_per_token) * b * s
        + w.head_flops_per_token * b
        + expert_flops;
    let prefill_bytes = w.weight_read_bytes + expert_bytes + w.kv_bytes_per_token * b * s;
    let prefill = phase(
        prefill_linear / r.peak + attention(b * s * (s + 1.0) / 2.0),
        prefill_bytes / r.bandwidth,
        comm_s(plan, hw, recorded, b * s, act_scale, collectives),
        overhead + expert_ops * r.op_overhead_s,
        elementwise(b * s),
    );

    // A decode step at the middle of generation: one token per sequence, attending to
    // about s + g/2 cached positions; all weights and that cache are read.
    let context = s + g / 2.0;
    let (expert_flops, expert_bytes, expert_ops) = w.experts.busiest(b, plan.tp);
    let decode_linear = w.linear_flops_per_token * b + expert_flops;
    let decode_bytes = w.weight_read_bytes + expert_bytes + w.kv_bytes_per_token * b * context;
    let decode_step = phase(
        decode_linear / r.peak + attention(b * context),
        decode_bytes / r.bandwidth,
        comm_s(plan, hw, recorded, b, act_scale, collectives),
        overhead + expert_ops * r.op_overhead_s,
        elementwise(b),
    );
    (prefill, decode_step)
}

/// How much longer than the fullest rank's figures the slowest rank takes: its part of the
/// work (`work`: the real share of its padded parameters, as the CPU and CUDA backends skip
/// the padding of an uneven split) and its device's speed
/// (`speed`, the profile's `rank_speeds`: compute scales the products and the per-op
/// overhead, memory the reads and the elementwise ops). The ranks meet at every
/// collective, so the slowest one sets the pace.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pace {
    work: f64,
    speed: RankSpeed,
}

impl Pace {
    fn apply(self, p: PhaseTime) -> PhaseTime {
        let (compute, memory) = (
            self.work / self.speed.compute,
            self.work / self.speed.memory,
        );
        phase(
            p.compute_s * compute,
            p.memory_s * memory,
            p.comm_s,
            p.overhead_s / self.speed.compute,
            p.elementwise_s * memory,
        )
    }
}

/// Each rank's pace.
fn rank_paces(plan: &Plan, hw: &HwProfile) -> Vec<Pace> {
    use crate::ir::saturating::sum;
    plan.ranks
        .iter()
        .enumerate()
        .map(|(r, program)| {
            let padded = sum(program.weights.iter().map(|w| w.local_elements())) as f64;
            let real = sum(program.weights.iter().map(|w| w.real_elements())) as f64;
            let work = if padded > 0.0 { real / padded } else { 1.0 };
            let speed = hw.rank_speeds.get(r).copied().unwrap_or(RankSpeed::SAME);
            Pace { work, speed }
        })
        .collect()
}

/// `p` as the slowest of the ranks takes it.
fn slowest(paces: &[Pace], p: PhaseTime) -> PhaseTime {
    paces
        .iter()
        .map(|pace| pace.apply(p))
        .max_by(|a, b| a.time_s.total_cmp(&b.time_s))
        .unwrap_or(p)
}

/// The estimate for `plan` running `work` on `hw`, in the plan's dtype throughout.
pub fn simulate(plan: &Plan, hw: &HwProfile, work: Workload) -> Estimate {
    simulate_as(plan, hw, work, Numerics::of_plan(plan))
}

/// The estimate for `plan` running `work` on `hw` with the number types `num`: weight bytes
/// scale from the plan's dtype to `num.weights`, KV and collective bytes to
/// `num.activations`; products run at the f32 peak when either operand is f32 on a device
/// without mixed products, i.e. at the bf16 peak only for bf16 weights.
pub fn simulate_as(plan: &Plan, hw: &HwProfile, work: Workload, num: Numerics) -> Estimate {
    simulate_sharing_experts(plan, hw, work, num, 1)
}

/// [`simulate_as`] for `dp` data-parallel replicas of `plan`, each running `work`, that deal
/// every tp rank's experts over the replicas (`--dp D --ep`): a rank holds ⌈1/D⌉ of its
/// experts (its memory), serves all replicas' tokens with them (the busiest of tp · D ranks
/// paces), and swaps rows with the other D − 1 members in two all-to-all rounds per MoE
/// layer (dispatch and combine, each α + bytes/β on the profile's direct link). On a shared
/// host the tp · D ranks share its compute, bandwidth and memory. Throughputs are the D
/// replicas' together.
pub fn simulate_sharing_experts(
    plan: &Plan,
    hw: &HwProfile,
    work: Workload,
    num: Numerics,
    dp: u64,
) -> Estimate {
    let dp = dp.max(1);
    let mut w = rank_work(plan, num);
    let plan_size = plan.dtype.size_bytes() as f64;
    let weight_scale = num.weights.size_bytes() as f64 / plan_size;
    let act_scale = num.activations.size_bytes() as f64 / plan_size;
    w.weight_bytes *= weight_scale;
    w.weight_read_bytes *= weight_scale;
    w.experts.bytes *= weight_scale;
    w.kv_bytes_per_token *= act_scale;
    if dp > 1 {
        let held = w.experts.bytes;
        w.experts = w.experts.over_replicas(dp);
        w.weight_bytes -= (held - w.experts.bytes).min(w.weight_bytes);
    }
    let ranks = plan.tp.saturating_mul(dp);
    let r = rates(
        hw,
        ranks,
        ranks,
        num.weights == DType::F32,
        w.attention_head_dim,
    );
    let act_bytes = num.activations.size_bytes() as f64;
    let recorded = recorded_algorithms(plan);
    let (prefill, decode_step) = price(
        plan,
        hw,
        &recorded,
        work,
        &w,
        &r,
        act_scale,
        act_bytes,
        &plan.collectives.iter().collect::<Vec<_>>(),
    );
    let paces = rank_paces(plan, hw);
    let (prefill, decode_step) = (slowest(&paces, prefill), slowest(&paces, decode_step));
    let (b, s, g) = (work.batch as f64, work.prompt as f64, work.gen as f64);
    let (prefill, decode_step) = (
        with_expert_swaps(prefill, &w.experts, hw, b * s, act_bytes),
        with_expert_swaps(decode_step, &w.experts, hw, b, act_bytes),
    );
    let kv_bytes = w.kv_bytes_per_token * b * (s + g);
    let memory = w.weight_bytes + kv_bytes;
    // Ranks on a shared host split its memory.
    let capacity = match hw.shared {
        Some(_) => hw.memory_bytes / ranks.max(1) as f64,
        None => hw.memory_bytes,
    };
    let replicas = dp as f64;
    Estimate {
        model: plan.model.clone(),
        tp: plan.tp,
        pp: 1,
        dp,
        hw: hw.name.clone(),
        rough_profile: hw.is_rough(),
        weight_dtype: num.weights,
        quantized_weights: quantized_weights(plan, num),
        activation_dtype: num.activations,
        prefill,
        decode_step,
        memory_per_rank_bytes: memory as u64,
        weight_bytes_per_rank: w.weight_bytes as u64,
        kv_bytes_per_rank: kv_bytes as u64,
        device_memory_bytes: capacity as u64,
        fits: memory <= capacity,
        tokens_per_s: TokensPerS {
            prefill: replicas * b * s / prefill.time_s,
            decode: replicas * b / decode_step.time_s,
        },
        collectives_per_pass: plan.collectives.len() as u64,
        stages: Vec::new(),
    }
}

/// `p` with the all-to-all rounds of `experts` dealt over replicas (`--ep`) added to its
/// communication: two per MoE layer (dispatch and combine) for a phase of `tokens` tokens,
/// each α + bytes/β on the profile's direct link; none without replicas.
fn with_expert_swaps(
    p: PhaseTime,
    experts: &ExpertWork,
    hw: &HwProfile,
    tokens: f64,
    act_bytes: f64,
) -> PhaseTime {
    let sent = experts.dispatch_bytes(tokens, act_bytes);
    let swap = if sent == 0.0 {
        0.0
    } else {
        let link = &hw.link.one_shot;
        2.0 * experts.layers * (link.alpha_s + sent / link.beta_bytes_per_s)
    };
    phase(
        p.compute_s,
        p.memory_s,
        p.comm_s + swap,
        p.overhead_s,
        p.elementwise_s,
    )
}

/// The estimate with `pp` pipeline stages of `plan.tp` ranks each. The decoder layers
/// split into the `pp` stages `tpc compile --pp` cuts (the plan's own when it has them;
/// the embedding on the first, the final norm and LM head on the last); each stage runs its part of the plan's
/// program (its layers' ops and collectives, read off the fullest rank). At batch 1 the
/// stages run one after another: a phase takes the sum of the stage times plus `pp − 1`
/// sends of the hidden state (`link.send_recv`: α + bytes/β). Batches are not micro-batched
/// (a stage runs the whole batch, then the next). Memory per rank: the fullest stage's
/// weights and its layers' KV cache. On a shared host one stage computes at a time, as
/// the runtime runs them (each rank gets cores / tp threads): compute and bandwidth are
/// shared over tp ranks; memory over tp·pp ranks. `pp = 1` is [`simulate_as`].
pub fn simulate_pp(
    plan: &Plan,
    hw: &HwProfile,
    work: Workload,
    num: Numerics,
    pp: u64,
) -> Result<Estimate, SimulateError> {
    simulate_pp_sharing_experts(plan, hw, work, num, pp, 1)
}

/// [`simulate_pp`] for `dp` replicas sharing their experts, stage by stage
/// ([`StagedPlan::estimate_sharing_experts`]); one stage is [`simulate_sharing_experts`].
pub fn simulate_pp_sharing_experts(
    plan: &Plan,
    hw: &HwProfile,
    work: Workload,
    num: Numerics,
    pp: u64,
    dp: u64,
) -> Result<Estimate, SimulateError> {
    if pp == 1 {
        return Ok(simulate_sharing_experts(plan, hw, work, num, dp));
    }
    StagedPlan::new(plan, pp, num).estimate_sharing_experts(hw, work, num, pp, dp)
}

/// What pricing one plan at any pipeline depth needs, worked out once: each rank's work
/// per segment, its bytes, where each value and collective sits. `simulate --search`
/// prices every pp of a plan; redoing this per pp made it quadratic in the layers (tens
/// of seconds for a 126-layer model over many devices).
pub struct StagedPlan<'a> {
    plan: &'a Plan,
    layers: usize,
    /// Each rank's work per segment ([`segment_work`]).
    segs: Vec<Vec<RankWork>>,
    /// Each rank's weight bytes and KV bytes per token (the compile report's figures).
    rank_bytes: Vec<(f64, f64)>,
    /// The segment of each value of rank 0, by id.
    segment_of: HashMap<u32, usize>,
    /// The all-reduce algorithms the plan recorded, by collective id.
    recorded: Recorded<'a>,
    /// Elements per token of the hidden state sent between stages.
    hidden: f64,
    /// The stages `tpc compile --pp` cuts, for pp = 1, 2, … up to the most asked for.
    pipelines: Vec<crate::plan::stages::Pipeline>,
}

impl<'a> StagedPlan<'a> {
    /// `plan` ready to be priced with up to `max_pp` stages, its quantized weights held as
    /// `num` (that of the estimates asked for) says.
    pub fn new(plan: &'a Plan, max_pp: u64, num: Numerics) -> StagedPlan<'a> {
        let layers = layer_count(plan);
        let summary = crate::plan::report::summarize(plan);
        let rank_bytes = (0..plan.ranks.len())
            .map(|rank| {
                let w = rank_weight_bytes(plan, &summary, rank, num);
                let kv = summary
                    .kv_cache_bytes_per_token_per_rank
                    .get(rank)
                    .copied()
                    .unwrap_or(0) as f64;
                (w, kv)
            })
            .collect();
        let segment_of = plan
            .ranks
            .first()
            .map(|r0| {
                r0.instrs
                    .iter()
                    .zip(crate::plan::stages::segments(r0, layers))
                    .map(|(i, s)| (i.id, s))
                    .collect()
            })
            .unwrap_or_default();
        let hidden = plan
            .ranks
            .first()
            .and_then(|r0| r0.instrs.iter().find(|i| matches!(i.op, Op::Embedding(_))))
            .and_then(|i| per_token(&i.fact.shape))
            .unwrap_or(0.0);
        StagedPlan {
            plan,
            layers,
            segs: segment_work(plan, layers, num),
            rank_bytes,
            segment_of,
            recorded: recorded_algorithms(plan),
            hidden,
            pipelines: crate::plan::stages::balanced_pipelines(plan, max_pp),
        }
    }

    /// The decoder layers of the plan: the most pipeline stages it can take.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// [`simulate_pp`] of this plan.
    pub fn estimate(
        &self,
        hw: &HwProfile,
        work: Workload,
        num: Numerics,
        pp: u64,
    ) -> Result<Estimate, SimulateError> {
        self.estimate_sharing_experts(hw, work, num, pp, 1)
    }

    /// [`StagedPlan::estimate`] for `dp` replicas, each running `work`, whose stages deal
    /// their layers' experts over the same stage of the other replicas (`--pp P --dp D
    /// --ep`): each stage priced as [`simulate_sharing_experts`] prices a replica's ranks
    /// (⌈1/D⌉ of the experts held, all replicas' tokens served, two all-to-all rounds per
    /// MoE layer of the stage); on a shared host the tp · D ranks of a stage share its
    /// compute and bandwidth (the replicas' stages run at once) and all tp · pp · D ranks
    /// its memory. Throughputs are the D replicas' together.
    pub fn estimate_sharing_experts(
        &self,
        hw: &HwProfile,
        work: Workload,
        num: Numerics,
        pp: u64,
        dp: u64,
    ) -> Result<Estimate, SimulateError> {
        let (plan, layers) = (self.plan, self.layers);
        let dp = dp.max(1);
        if pp == 1 {
            return Ok(simulate_sharing_experts(plan, hw, work, num, dp));
        }
        if pp == 0 || pp > layers as u64 {
            return Err(SimulateError::Stages {
                pp,
                layers: layers as u64,
                valid: if layers == 0 {
                    "1".into()
                } else {
                    format!("1 to {layers}")
                },
            });
        }
        let parts = pp as usize;
        // The stages `tpc compile --pp` would cut (a plan with stages keeps its own).
        let pipeline = match &plan.pipeline {
            Some(p) if p.stages.len() == parts => p,
            _ => self
                .pipelines
                .get(parts - 1)
                .ok_or_else(|| SimulateError::Stages {
                    pp,
                    layers: layers as u64,
                    valid: format!("1 to {}", self.pipelines.len().max(1)),
                })?,
        };
        let starts: Vec<usize> = pipeline
            .stages
            .iter()
            .map(|s| s.first_layer as usize)
            .collect();
        let stage_of_segment = |seg: usize| -> usize {
            match seg {
                0 => 0,
                s if s > layers => parts - 1,
                s => starts.iter().rposition(|&st| st < s).unwrap_or(0),
            }
        };
        let segment_stage: Vec<usize> = (0..layers + 2).map(stage_of_segment).collect();
        let plan_size = plan.dtype.size_bytes() as f64;
        let weight_scale = num.weights.size_bytes() as f64 / plan_size;
        let act_scale = num.activations.size_bytes() as f64 / plan_size;
        let act_bytes = num.activations.size_bytes() as f64;
        let ranks = plan.tp.max(1).saturating_mul(pp).saturating_mul(dp);
        let (b, s, g) = (work.batch as f64, work.prompt as f64, work.gen as f64);
        // Each stage's fullest rank: one pass over every rank's segments, each adding to
        // its stage (in segment order, as a sum per stage would).
        let mut fullest: Vec<Option<RankWork>> = vec![None; parts];
        for (rank, rs) in self.segs.iter().enumerate() {
            let mut per_stage = vec![RankWork::default(); parts];
            let (mut total_w, mut total_attn) = (0.0, 0.0);
            for (seg, sw) in rs.iter().enumerate() {
                total_w += sw.weight_bytes;
                total_attn += sw.attention_ops;
                if let Some(&stage) = segment_stage.get(seg) {
                    per_stage[stage] += *sw;
                }
            }
            // The compile report's weight and KV bytes of the rank, shared out by the
            // stage's part of its parameter slices and of its attention ops.
            let (rank_w, rank_kv) = self.rank_bytes.get(rank).copied().unwrap_or_default();
            for (w, best) in per_stage.iter_mut().zip(fullest.iter_mut()) {
                w.weight_bytes = if total_w > 0.0 {
                    rank_w * w.weight_bytes / total_w
                } else {
                    0.0
                };
                w.kv_bytes_per_token = if total_attn > 0.0 {
                    rank_kv * w.attention_ops / total_attn
                } else {
                    0.0
                };
                if best.is_none_or(|f| {
                    w.weight_bytes + w.kv_bytes_per_token > f.weight_bytes + f.kv_bytes_per_token
                }) {
                    *best = Some(*w);
                }
            }
        }
        // Collectives by stage, through the segment of their value on rank 0 (in plan
        // order within a stage, as their times are summed).
        let mut by_stage: Vec<Vec<&Collective>> = vec![Vec::new(); parts];
        for c in &plan.collectives {
            let seg = match c.layer {
                Some(l) => (l as usize).min(layers - 1) + 1,
                None => self.segment_of.get(&c.id).copied().unwrap_or(layers + 1),
            };
            by_stage[stage_of_segment(seg)].push(c);
        }
        let mut stages = Vec::new();
        let mut prefills = Vec::new();
        let mut decodes = Vec::new();
        let (mut fullest_w, mut fullest_kv) = (0.0f64, 0.0f64);
        for (stage, best) in fullest.into_iter().enumerate() {
            let mut w = best.unwrap_or_default();
            w.weight_bytes *= weight_scale;
            w.weight_read_bytes *= weight_scale;
            w.experts.bytes *= weight_scale;
            w.kv_bytes_per_token *= act_scale;
            if dp > 1 {
                let held = w.experts.bytes;
                w.experts = w.experts.over_replicas(dp);
                w.weight_bytes -= (held - w.experts.bytes).min(w.weight_bytes);
            }
            let stage_ranks = plan.tp.saturating_mul(dp);
            let r = rates(
                hw,
                stage_ranks,
                stage_ranks,
                num.weights == DType::F32,
                w.attention_head_dim,
            );
            let (prefill, decode) = price(
                plan,
                hw,
                &self.recorded,
                work,
                &w,
                &r,
                act_scale,
                act_bytes,
                &by_stage[stage],
            );
            let prefill = with_expert_swaps(prefill, &w.experts, hw, b * s, act_bytes);
            let decode = with_expert_swaps(decode, &w.experts, hw, b, act_bytes);
            let kv = w.kv_bytes_per_token * b * (s + g);
            if w.weight_bytes + kv > fullest_w + fullest_kv {
                (fullest_w, fullest_kv) = (w.weight_bytes, kv);
            }
            let first = starts[stage];
            let end = starts.get(stage + 1).copied().unwrap_or(layers);
            stages.push(StageEstimate {
                first_layer: first as u64,
                layers: (end - first) as u64,
                weight_bytes_per_rank: w.weight_bytes as u64,
                kv_bytes_per_rank: kv as u64,
                prefill_time_s: prefill.time_s,
                decode_step_time_s: decode.time_s,
            });
            prefills.push(prefill);
            decodes.push(decode);
        }
        // Between stages: the hidden state of every token of the phase, one send each.
        let send = |tokens: f64| {
            let l = &hw.link.send_recv;
            (pp - 1) as f64 * (l.alpha_s + self.hidden * act_bytes * tokens / l.beta_bytes_per_s)
        };
        let mut prefill = sum_phases(&prefills);
        prefill.comm_s += send(b * s);
        prefill.time_s += send(b * s);
        let mut decode_step = sum_phases(&decodes);
        decode_step.comm_s += send(b);
        decode_step.time_s += send(b);
        let memory = fullest_w + fullest_kv;
        let capacity = match hw.shared {
            Some(_) => hw.memory_bytes / ranks as f64,
            None => hw.memory_bytes,
        };
        let replicas = dp as f64;
        Ok(Estimate {
            model: plan.model.clone(),
            tp: plan.tp,
            pp,
            dp,
            hw: hw.name.clone(),
            rough_profile: hw.is_rough(),
            weight_dtype: num.weights,
            quantized_weights: quantized_weights(plan, num),
            activation_dtype: num.activations,
            prefill,
            decode_step,
            memory_per_rank_bytes: memory as u64,
            weight_bytes_per_rank: fullest_w as u64,
            kv_bytes_per_rank: fullest_kv as u64,
            device_memory_bytes: capacity as u64,
            fits: memory <= capacity,
            tokens_per_s: TokensPerS {
                prefill: replicas * b * s / prefill.time_s,
                decode: replicas * b / decode_step.time_s,
            },
            collectives_per_pass: plan.collectives.len() as u64 + (pp - 1),
            stages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::profile::{AlphaBeta, LinkCosts};

    fn flat_hw() -> HwProfile {
        let ab = AlphaBeta {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e11,
        };
        HwProfile {
            name: "test".into(),
            sources: vec![],
            devices: 8,
            memory_bytes: 80e9,
            peak_flops_bf16: 1e15,
            peak_flops_f32: 1e14,
            memory_bandwidth: 2e12,
            compute_efficiency: 0.5,
            memory_efficiency: 0.5,
            link: LinkCosts {
                ring: ab,
                one_shot: ab,
                two_shot: ab,
                send_recv: ab,
            },
            op_overhead_s: 0.0,
            attention_flops: None,
            attention_flops_by_head_dim: vec![],
            shared: None,
            rough: false,
            rank_speeds: Vec::new(),
        }
    }

    fn plan(tp: u64) -> Plan {
        super::super::shipped::plan("llama3-8b", tp)
    }

    fn moe_plan(name: &str, tp: u64, split: crate::ir::ExpertSplit) -> Plan {
        let def = super::super::shipped::model(name)
            .with_expert_split(split)
            .unwrap();
        crate::pipeline::compile(&def, tp).unwrap().plan
    }

    /// Bytes of `plan`'s expert stacks on rank 0 (a stack's tensor name holds `{e}`).
    fn expert_bytes(plan: &Plan) -> f64 {
        plan.ranks[0]
            .weights
            .iter()
            .filter(|w| crate::plan::experts::is_stacked(&w.tensor))
            .map(|w| w.local_bytes() as f64)
            .sum()
    }

    #[test]
    fn int4_weights_are_read_as_stored_on_a_device_and_dequantized_by_the_cpu_runtime() {
        let mut def = super::super::shipped::model("qwen3-32b");
        let crate::frontend::ModelDef::Preset(f) = &mut def else {
            panic!("a preset")
        };
        f.quantization = Some(crate::ir::Quantization {
            format: crate::ir::QuantFormat::Int4Gptq,
            block: [1, 128],
            scales: Default::default(),
            modules_to_not_convert: Vec::new(),
            act_order: false,
        });
        let int4 = crate::pipeline::compile(&def, 4).unwrap().plan;
        let bf16 = super::super::shipped::plan("qwen3-32b", 4);
        let hw = flat_hw();
        let chat = Workload {
            batch: 1,
            prompt: 16,
            gen: 64,
        };
        let linears: u64 = int4.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .map(|w| w.local_elements())
            .sum();
        // On a device: half a byte a weight plus the groups' scales, zeros and g_idx.
        let device = |p: &Plan| simulate_as(p, &hw, chat, Numerics::of_plan(p));
        let saved = device(&bf16).weight_bytes_per_rank - device(&int4).weight_bytes_per_rank;
        assert!(
            saved > linears * 3 / 2 - linears / 40 && saved < linears * 3 / 2,
            "{saved} of {linears}"
        );
        assert_eq!(
            device(&int4).quantized_weights.as_deref(),
            Some("int4 gptq linears as stored")
        );
        // tpc's CPU runtime keeps the codes, with an f32 scale and zero per group per column.
        let num = Numerics::cpu_runtime(true);
        let cpu = |p: &Plan| simulate_as(p, &hw, chat, num);
        let saved = cpu(&bf16).weight_bytes_per_rank - cpu(&int4).weight_bytes_per_rank;
        assert!(
            saved > linears * 3 / 2 - linears / 16 - 1 && saved < linears * 3 / 2,
            "{saved} of {linears}"
        );
        assert_eq!(
            cpu(&int4).quantized_weights.as_deref(),
            Some("int4 gptq linears as codes with a scale and a zero per column per group")
        );
        // In act order it keeps the codes too, sorted by group, with each linear's order
        // (8 bytes an input; a row split's padding slots are not priced).
        if let crate::frontend::ModelDef::Preset(f) = &mut def {
            if let Some(q) = &mut f.quantization {
                q.act_order = true;
            }
        }
        let act = crate::pipeline::compile(&def, 4).unwrap().plan;
        let inputs: u64 = act.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .map(|w| w.local_shape[1])
            .sum();
        let orders = cpu(&act).weight_bytes_per_rank - cpu(&int4).weight_bytes_per_rank;
        assert!(
            orders > 0 && orders <= 8 * inputs,
            "{orders} for {inputs} inputs"
        );
        assert_eq!(
            cpu(&act).quantized_weights.as_deref(),
            Some(
                "int4 gptq linears in act order as codes sorted by group, with a scale and a \
                 zero per column per group"
            )
        );
    }

    #[test]
    fn fp8_weights_are_read_as_stored_on_a_device_and_as_codes_by_the_cpu_runtime() {
        let (fp8, bf16) = (
            super::super::shipped::plan("qwen3-32b-fp8", 4),
            super::super::shipped::plan("qwen3-32b", 4),
        );
        let hw = flat_hw();
        let bw = hw.per_rank(4, false).1;
        let chat = Workload {
            batch: 1,
            prompt: 16,
            gen: 64,
        };
        let device = |p: &Plan| simulate_as(p, &hw, chat, Numerics::of_plan(p));
        let (q, b) = (device(&fp8), device(&bf16));
        assert_eq!(
            q.quantized_weights.as_deref(),
            Some("fp8 e4m3 linears as stored")
        );
        assert_eq!(b.quantized_weights, None);
        // A byte an element and an f32 per 128 × 128 block for the decoder's linears; the
        // embeddings and the head stay bf16.
        let linears: u64 = fp8.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .map(|w| w.local_elements())
            .sum();
        let scales = linears / (128 * 128);
        assert_eq!(
            b.weight_bytes_per_rank - q.weight_bytes_per_rank,
            linears - 4 * scales
        );
        // A decode step reads those bytes: about half the time where memory paces it.
        let read = |e: &Estimate| e.decode_step.memory_s * bw;
        let saved = read(&b) - read(&q);
        assert!(
            (saved - (linears - 4 * scales) as f64).abs() < 1e-6 * saved,
            "{saved} vs {}",
            linears - 4 * scales
        );
        // tpc's CPU runtime holds the codes too, with an f32 scale per column per block of
        // 128 inputs, whatever type it holds the other weights in.
        let column_scales: u64 = fp8.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .map(|w| w.local_elements() / 128 * 4)
            .sum();
        for bf16_weights in [true, false] {
            let num = Numerics::cpu_runtime(bf16_weights);
            let cpu = |p: &Plan| simulate_as(p, &hw, chat, num);
            let plain = if bf16_weights { 1 } else { 2 };
            assert_eq!(
                cpu(&bf16).weight_bytes_per_rank - cpu(&fp8).weight_bytes_per_rank,
                linears * 2 * plain - linears - column_scales,
                "bf16 weights: {bf16_weights}"
            );
            assert_eq!(
                cpu(&fp8).quantized_weights.as_deref(),
                Some("fp8 e4m3 linears as codes with a scale per column")
            );
            // Staged pricing holds them alike: one stage is the whole, two about halve it.
            let staged = |p: &Plan, pp: u64| {
                simulate_pp(p, &hw, chat, num, pp)
                    .unwrap()
                    .weight_bytes_per_rank
            };
            assert_eq!(staged(&fp8, 1), cpu(&fp8).weight_bytes_per_rank);
            assert!(staged(&fp8, 2) < staged(&fp8, 1) && staged(&fp8, 2) < staged(&bf16, 2));
        }
    }

    #[test]
    fn a_decode_step_reads_the_chosen_experts_and_a_long_prefill_all_of_them() {
        // Qwen3-30B-A3B: 128 experts, 8 per token. One token reads 8 of each layer's 128
        // experts; 4096 prompt tokens choose (nearly) every one.
        let plan = moe_plan("qwen3-30b-a3b", 1, crate::ir::ExpertSplit::Tensor);
        let hw = flat_hw();
        let bw = hw.per_rank(1, false).1;
        let experts = expert_bytes(&plan);
        let w = rank_work(&plan, Numerics::of_plan(&plan));
        assert!(
            experts > 0.9 * w.weight_bytes,
            "{experts} of {}",
            w.weight_bytes
        );
        let one = Workload {
            batch: 1,
            prompt: 4096,
            gen: 1,
        };
        let e = simulate(&plan, &hw, one);
        let decode_bytes = e.decode_step.memory_s * bw;
        let chosen = experts * 8.0 / 128.0;
        let want = w.weight_read_bytes + chosen;
        let kv = w.kv_bytes_per_token * 4096.5;
        assert!(
            (decode_bytes - kv - want).abs() <= 1e-6 * want,
            "{decode_bytes} vs {want} + kv {kv}"
        );
        // Active parameters: about 3.3B of 30.5B (non-expert weights read whole included).
        assert!(want < 0.15 * w.weight_bytes, "{want} of {}", w.weight_bytes);
        let prefill_bytes = e.prefill.memory_s * bw - w.kv_bytes_per_token * 4096.0;
        assert!(
            prefill_bytes > w.weight_read_bytes + 0.999 * experts,
            "{prefill_bytes}"
        );
        // One token: 2 FLOPs per weight element of its 8 experts, 8 experts' kernels per
        // layer.
        let (flops, bytes, ops) = w.experts.busiest(1.0, 1);
        let per_expert = w.experts.elements / 128.0;
        assert!((flops - 2.0 * 8.0 * per_expert).abs() <= 1e-9 * flops);
        assert!((bytes - chosen).abs() <= 1e-9 * bytes);
        assert_eq!(ops, 48.0 * 8.0 * OPS_PER_EXPERT);
    }

    #[test]
    fn dealing_experts_pays_for_the_busiest_rank_and_saves_kernels() {
        let (tensor, expert) = (
            moe_plan("qwen3-30b-a3b", 4, crate::ir::ExpertSplit::Tensor),
            moe_plan("qwen3-30b-a3b", 4, crate::ir::ExpertSplit::Expert),
        );
        let mut hw = flat_hw();
        hw.op_overhead_s = 5e-6;
        // Both hold a quarter of the experts' bytes.
        let (t, x) = (expert_bytes(&tensor), expert_bytes(&expert));
        assert!((t - x).abs() <= 1e-9 * t, "{t} {x}");
        // One decoded token: its 8 experts land unevenly on 4 ranks, whose busiest reads
        // more than the quarter of each that every rank reads when split by features.
        let chat = Workload {
            batch: 1,
            prompt: 16,
            gen: 64,
        };
        let (a, b) = (simulate(&tensor, &hw, chat), simulate(&expert, &hw, chat));
        assert!(
            b.decode_step.memory_s > a.decode_step.memory_s * 1.2,
            "{a:?} {b:?}"
        );
        // A long prompt uses every expert on every rank: the same bytes, but a quarter of
        // the kernels per rank when the experts are dealt.
        let long = Workload {
            batch: 8,
            prompt: 2048,
            gen: 1,
        };
        let (a, b) = (simulate(&tensor, &hw, long), simulate(&expert, &hw, long));
        assert!((a.prefill.memory_s - b.prefill.memory_s).abs() <= 0.01 * a.prefill.memory_s);
        assert!(
            b.prefill.overhead_s < 0.5 * a.prefill.overhead_s,
            "{a:?} {b:?}"
        );
    }

    /// Qwen3-30B-A3B at tp 2 with its experts dealt, on the flat profile, 4 sequences of
    /// 256 + 32 tokens: what the replica tests price.
    fn experts_dealt_at_tp_2() -> (Plan, HwProfile, Numerics, Workload) {
        let plan = moe_plan("qwen3-30b-a3b", 2, crate::ir::ExpertSplit::Expert);
        let num = Numerics::of_plan(&plan);
        let work = Workload {
            batch: 4,
            prompt: 256,
            gen: 32,
        };
        (plan, flat_hw(), num, work)
    }

    #[test]
    fn experts_dealt_over_replicas_hold_a_share_serve_every_replica_and_swap_rows() {
        // Qwen3-30B-A3B at tp 2, experts dealt: 64 experts per rank, 16 per rank over 4
        // replicas.
        let (plan, hw, num, work) = experts_dealt_at_tp_2();
        let alone = simulate_as(&plan, &hw, work, num);
        assert_eq!(simulate_sharing_experts(&plan, &hw, work, num, 1), alone);
        let shared = simulate_sharing_experts(&plan, &hw, work, num, 4);
        assert_eq!(shared.dp, 4);
        // Memory: the non-expert weights, and a quarter of the rank's experts.
        let experts = expert_bytes(&plan);
        let want = alone.weight_bytes_per_rank as f64 - 0.75 * experts;
        let got = shared.weight_bytes_per_rank as f64;
        assert!((got - want).abs() <= 1e-6 * want + 1.0, "{got} vs {want}");
        // The rank's 16 experts serve the 4 replicas' 4 tokens of a decode step.
        let w = rank_work(&plan, Numerics::of_plan(&plan))
            .experts
            .over_replicas(4);
        assert_eq!((w.local, w.replicas), (16.0, 4.0));
        let (_, bytes, _) = w.busiest(4.0, 2);
        assert!(bytes > 0.0 && bytes <= w.bytes, "{bytes} of {}", w.bytes);
        // Two rounds per MoE layer; each row goes to a member that holds one of its 8 of
        // 128 choices among that member's 16.
        let hit = 1.0 - (1.0 - 16.0 / 128.0f64).powi(8);
        let row = w.width * 2.0 + 16.0 * 4.0;
        let sent = 4.0 * 3.0 * hit * row;
        assert!((w.dispatch_bytes(4.0, 2.0) - sent).abs() <= 1e-9 * sent);
        let link = hw.link.one_shot;
        let swap = 2.0 * 48.0 * (link.alpha_s + sent / link.beta_bytes_per_s);
        let extra = shared.decode_step.comm_s - alone.decode_step.comm_s;
        assert!((extra - swap).abs() <= 1e-9 * swap, "{extra} vs {swap}");
        // Throughput is the four replicas' together.
        let per_replica = 4.0 / shared.decode_step.time_s;
        assert!((shared.tokens_per_s.decode - 4.0 * per_replica).abs() <= 1e-9 * per_replica);
    }

    #[test]
    fn sequence_parallel_token_wise_work_follows_the_token_shares() {
        let def = crate::frontend::load::load_model(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tinyllama-1.1b.ron"),
        )
        .unwrap();
        let options = crate::passes::ShardOptions {
            shares: Some("3,1".parse().unwrap()),
            sequence_parallel: true,
            ..Default::default()
        };
        let plan = crate::pipeline::compile_with(&def, 2, options)
            .unwrap()
            .plan;
        let work = |plan: &Plan| {
            segment_work(plan, layer_count(plan), Numerics::of_plan(plan))
                .iter()
                .map(|segs| {
                    segs.iter()
                        .map(|w| w.elementwise_elements_per_token)
                        .sum::<f64>()
                })
                .collect::<Vec<f64>>()
        };
        let by_shares = work(&plan);
        let mut even_tokens = plan.clone();
        even_tokens
            .ranks
            .iter_mut()
            .for_each(|r| r.sequence_shares = None);
        let even = work(&even_tokens);
        // Rank 0 runs the norms and adds on three quarters of the tokens, not half.
        assert!(
            by_shares[0] > even[0] && by_shares[1] < even[1],
            "{by_shares:?} {even:?}"
        );
    }

    #[test]
    fn stages_of_replicas_sharing_experts_deal_each_stages_experts_and_swap_its_rows() {
        let (plan, hw, num, work) = experts_dealt_at_tp_2();
        let staged = StagedPlan::new(&plan, 2, num);
        // One replica is the staged estimate; one stage is the one-stage estimate.
        let alone = staged.estimate(&hw, work, num, 2).unwrap();
        assert_eq!(
            staged
                .estimate_sharing_experts(&hw, work, num, 2, 1)
                .unwrap(),
            alone
        );
        assert_eq!(
            staged
                .estimate_sharing_experts(&hw, work, num, 1, 4)
                .unwrap(),
            simulate_sharing_experts(&plan, &hw, work, num, 4)
        );
        let shared = staged
            .estimate_sharing_experts(&hw, work, num, 2, 4)
            .unwrap();
        assert_eq!((shared.pp, shared.dp, shared.stages.len()), (2, 4, 2));
        // Every stage's rank keeps a quarter of its layers' experts: the stages' weights
        // add up to those of one stage sharing its experts (48 layers of 64 experts a rank
        // divide evenly).
        let whole = simulate_sharing_experts(&plan, &hw, work, num, 4);
        let sum: u64 = shared.stages.iter().map(|s| s.weight_bytes_per_rank).sum();
        let want = whole.weight_bytes_per_rank as f64;
        assert!(
            (sum as f64 - want).abs() <= 1e-6 * want + 2.0,
            "{sum} vs {want}"
        );
        for (a, b) in alone.stages.iter().zip(&shared.stages) {
            assert!(
                b.weight_bytes_per_rank < a.weight_bytes_per_rank,
                "{a:?} {b:?}"
            );
        }
        // The swaps: two rounds per MoE layer, each stage its own layers', all 48 in all.
        let w = rank_work(&plan, num).experts.over_replicas(4);
        let link = hw.link.one_shot;
        let sent = w.dispatch_bytes(4.0, 2.0);
        let swaps = 2.0 * 48.0 * (link.alpha_s + sent / link.beta_bytes_per_s);
        let no_swap = |e: &Estimate| e.decode_step.comm_s;
        let extra = no_swap(&shared) - no_swap(&alone);
        assert!((extra - swaps).abs() <= 1e-9 * swaps, "{extra} vs {swaps}");
        // Throughput is the four replicas' together.
        let per_replica = 4.0 / shared.decode_step.time_s;
        assert!((shared.tokens_per_s.decode - 4.0 * per_replica).abs() <= 1e-9 * per_replica);
    }

    #[test]
    fn a_fused_product_pays_the_per_op_cost_once() {
        let fused = plan(1);
        let mut separate = fused.clone();
        separate.ranks.iter_mut().for_each(|r| r.fused.clear());
        // 32 layers of q|k|v (2 linears ride along) and gate|up (1).
        assert_eq!(ops_per_pass(&separate) - ops_per_pass(&fused), 32.0 * 3.0);
    }

    #[test]
    fn a_gather_or_scatter_costs_the_cheaper_of_half_a_ring_and_one_direct_read() {
        let mut link = flat_hw().link;
        // 8 ranks, 8 MB: each rank moves 7 MB either way.
        link.ring = AlphaBeta {
            alpha_s: 1e-6,
            beta_bytes_per_s: 1e11,
        };
        link.one_shot = AlphaBeta {
            alpha_s: 5e-6,
            beta_bytes_per_s: 1e11,
        };
        // Ring: half of a ring all-reduce's 7 µs latency (7 steps of 1 µs), + 70 µs.
        let ring = 7.0 * 1e-6 / 2.0 + 7e6 / 1e11;
        assert!((gather_or_scatter_s(&link, 8, 8e6) / ring - 1.0).abs() < 1e-12);
        // A slower ring step makes the direct reads (one 5 µs latency) cheaper.
        link.ring.alpha_s = 4e-6;
        let direct = 5e-6 + 7e6 / 1e11;
        assert!((gather_or_scatter_s(&link, 8, 8e6) / direct - 1.0).abs() < 1e-12);
        // A reduce-scatter and an all-gather around the ring are one ring all-reduce.
        link.one_shot.beta_bytes_per_s = 1e9;
        let ar = all_reduce_time(&link, crate::ir::CollectiveAlgorithm::Ring, 8, 8e6);
        assert!((2.0 * gather_or_scatter_s(&link, 8, 8e6) - ar).abs() < 1e-12 * ar);
        assert_eq!(gather_or_scatter_s(&link, 1, 8e6), 0.0);
    }

    #[test]
    fn llama3_8b_decode_is_memory_bound_and_matches_hand_arithmetic() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 0,
        };
        let e = simulate(&plan(1), &hw, work);
        // 8.03 B parameters in bf16 held.
        let weights = 8.03e9 * 2.0;
        assert!((e.weight_bytes_per_rank as f64 / weights - 1.0).abs() < 0.01);
        // Decode at batch 1: memory time = weights read / (2e12 · 0.5), no communication;
        // the embedding table (128256 × 4096, untied) is read by row, not whole.
        assert_eq!(e.decode_step.comm_s, 0.0);
        let expect = (weights - 128256.0 * 4096.0 * 2.0) / 1e12;
        assert!(
            (e.decode_step.memory_s / expect - 1.0).abs() < 0.02,
            "{e:?}"
        );
        assert_eq!(
            e.decode_step.time_s,
            e.decode_step.memory_s + e.decode_step.elementwise_s
        );
        // Prefill of 128 tokens: compute about 2 · 7.0e9 (the layers) · 128 / 5e14, plus the
        // LM head (128256 × 4096) on the last token only.
        let head = 128256.0 * 4096.0;
        let layer_params = 8.03e9 - 2.0 * head;
        let expect = 2.0 * (layer_params * 128.0 + head) / 5e14;
        assert!((e.prefill.compute_s / expect - 1.0).abs() < 0.05, "{e:?}");
        assert!(e.fits);
    }

    #[test]
    fn tensor_parallelism_splits_weights_and_adds_communication() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 128,
        };
        let one = simulate(&plan(1), &hw, work);
        let eight = simulate(&plan(8), &hw, work);
        let ratio = one.weight_bytes_per_rank as f64 / eight.weight_bytes_per_rank as f64;
        assert!(ratio > 7.0 && ratio <= 8.0, "{ratio}");
        assert!(eight.decode_step.comm_s > 0.0);
        // 65 all-reduces of 8 KiB and one logits gather per decode step: each at least α.
        assert!(eight.decode_step.comm_s >= 65.0 * hw.link.ring.alpha_s);
        assert!(eight.decode_step.memory_s < one.decode_step.memory_s / 7.0);
    }

    fn tinyllama(tp: u64) -> Plan {
        super::super::shipped::plan("tinyllama-1.1b", tp)
    }

    #[test]
    fn the_slowest_rank_paces_unequal_devices_and_shares() {
        let mut hw = flat_hw();
        hw.shared = Some(crate::cost::profile::SharedHost::new(2));
        let work = Workload {
            batch: 1,
            prompt: 64,
            gen: 32,
        };
        let num = Numerics::cpu_runtime(true);
        let def = crate::frontend::load::load_model(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tinyllama-1.1b.ron"),
        )
        .unwrap();
        let shared = |s: &str| {
            let options = crate::passes::ShardOptions {
                shares: Some(s.parse().unwrap()),
                ..Default::default()
            };
            crate::pipeline::compile_with(&def, 2, options)
                .unwrap()
                .plan
        };
        let even = simulate_as(&tinyllama(2), &hw, work, num);
        // One device at a quarter of the speed: every step takes four times as long.
        hw.rank_speeds = vec![RankSpeed::SAME, RankSpeed::both(0.25)];
        let slow = simulate_as(&tinyllama(2), &hw, work, num);
        let ratio = slow.decode_step.memory_s / even.decode_step.memory_s;
        assert!((ratio - 4.0).abs() < 1e-9, "{ratio}");
        assert_eq!(slow.decode_step.comm_s, even.decode_step.comm_s);
        // Shares 4,1: rank 1 holds about a fifth of the split weights (a bit more: the
        // vocabulary and the norms stay even); rank 0 pads nothing and paces the step.
        let four = simulate_as(&shared("4,1"), &hw, work, num);
        assert!(
            four.tokens_per_s.decode > 1.5 * slow.tokens_per_s.decode,
            "{four:?} {slow:?}"
        );
        // The GPU backend skips the padding too: the same on a profile of separate devices.
        hw.shared = None;
        let slow = simulate_as(&tinyllama(2), &hw, work, num);
        let four = simulate_as(&shared("4,1"), &hw, work, num);
        assert!(
            four.tokens_per_s.decode > 1.5 * slow.tokens_per_s.decode,
            "{four:?} {slow:?}"
        );
        // Alike devices: shares only slow the group (the larger piece paces every step).
        hw.rank_speeds.clear();
        let padded = simulate_as(&shared("4,1"), &hw, work, num);
        let plain = simulate_as(&tinyllama(2), &hw, work, num);
        assert!(padded.decode_step.memory_s > plain.decode_step.memory_s);
    }

    #[test]
    fn a_rank_slow_at_compute_only_slows_the_compute_bound_phase() {
        let mut hw = flat_hw();
        // A CPU host's rates: a 64-token prompt is compute-bound, a decode step read-bound.
        hw.op_overhead_s = 1e-6;
        hw.peak_flops_bf16 = 4e11;
        hw.peak_flops_f32 = 2e11;
        hw.memory_bandwidth = 4e10;
        hw.shared = Some(crate::cost::profile::SharedHost::new(2));
        let work = Workload {
            batch: 1,
            prompt: 64,
            gen: 32,
        };
        let num = Numerics::cpu_runtime(true);
        let even = simulate_as(&tinyllama(2), &hw, work, num);
        let lagging = RankSpeed {
            compute: 0.25,
            memory: 1.0,
        };
        hw.rank_speeds = vec![RankSpeed::SAME, lagging];
        let slow = simulate_as(&tinyllama(2), &hw, work, num);
        let ratio = |a: f64, b: f64| a / b;
        // The products and the per-op overhead take four times as long ...
        for (a, b) in [
            (slow.prefill.compute_s, even.prefill.compute_s),
            (slow.decode_step.compute_s, even.decode_step.compute_s),
            (slow.decode_step.overhead_s, even.decode_step.overhead_s),
        ] {
            assert!((ratio(a, b) - 4.0).abs() < 1e-9, "{a} {b}");
        }
        // ... the reads and elementwise ops as long as before.
        assert_eq!(slow.decode_step.memory_s, even.decode_step.memory_s);
        assert_eq!(slow.prefill.elementwise_s, even.prefill.elementwise_s);
        assert!(slow.tokens_per_s.prefill < 0.5 * even.tokens_per_s.prefill);
        assert!(slow.tokens_per_s.decode > 0.8 * even.tokens_per_s.decode);
        // The other way round: decode, bound by the reads, slows; the step is the slowest
        // rank's, so a rank slow at memory paces decode by its memory speed.
        hw.rank_speeds = vec![
            RankSpeed::SAME,
            RankSpeed {
                compute: 1.0,
                memory: 0.25,
            },
        ];
        let slow_reads = simulate_as(&tinyllama(2), &hw, work, num);
        assert!((slow_reads.decode_step.memory_s / even.decode_step.memory_s - 4.0).abs() < 1e-9);
        assert_eq!(slow_reads.prefill.compute_s, even.prefill.compute_s);
    }

    #[test]
    fn ranks_on_a_two_core_host_get_half_its_compute_and_bandwidth() {
        let mut hw = flat_hw();
        hw.compute_efficiency = 1.0;
        hw.memory_efficiency = 1.0;
        hw.peak_flops_bf16 = 8e11;
        hw.memory_bandwidth = 2e10;
        hw.memory_bytes = 16e9;
        hw.op_overhead_s = 2e-6;
        hw.shared = Some(crate::cost::profile::SharedHost::new(2));
        let work = Workload {
            batch: 1,
            prompt: 128,
            gen: 0,
        };
        let num = Numerics::cpu_runtime(true);
        let one = simulate_as(&tinyllama(1), &hw, work, num);
        let two = simulate_as(&tinyllama(2), &hw, work, num);
        // TinyLlama read whole per pass: 22 layers of q, k, v, o (2048², 256×2048 twice,
        // 2048²), gate, up, down (3 × 5632×2048) and two norms, the final norm and the
        // LM head (32000×2048); bf16. Keys and values: 22 layers × 2 × 256, f32.
        let layer = 2 * 2048 * 2048 + 2 * 256 * 2048 + 3 * 5632 * 2048;
        let read1 = 2.0 * (22 * (layer + 2 * 2048) + 2048 + 32000 * 2048) as f64;
        let kv1 = (22 * 2 * 256 * 4) as f64;
        let expect = (read1 + kv1 * 128.0) / 2e10;
        assert!(
            (one.decode_step.memory_s / expect - 1.0).abs() < 1e-12,
            "{one:?}"
        );
        // tp 2: linears and the head split in half, norms replicated, 2 of 4 kv heads; one
        // core and half the bandwidth each.
        let read2 = 2.0 * (22 * (layer / 2 + 2 * 2048) + 2048 + 16000 * 2048) as f64;
        let expect = (read2 + kv1 / 2.0 * 128.0) / 1e10;
        assert!(
            (two.decode_step.memory_s / expect - 1.0).abs() < 1e-12,
            "{two:?}"
        );
        // Prefill: half the FLOPs at half the rate take as long as tp 1's; the LM head runs
        // on the last token only.
        let flops1 = 2.0 * (22 * layer) as f64 * 128.0
            + 2.0 * (32000 * 2048) as f64
            + 4.0 * (22 * 2048) as f64 * 128.0 * 129.0 / 2.0;
        assert!((one.prefill.compute_s / (flops1 / 8e11) - 1.0).abs() < 1e-12);
        assert!((two.prefill.compute_s / (flops1 / 2.0 / 4e11) - 1.0).abs() < 1e-12);
        // 289 ops per pass (4 products: q|k|v fused, o, gate|up fused, down; 2 norms, 2
        // ropes, 2 adds, attention, activation, mul per layer; embedding, final norm,
        // head), 2 µs each.
        assert!(
            (one.decode_step.overhead_s - 289.0 * 2e-6).abs() < 1e-12,
            "{one:?}"
        );
        assert_eq!(one.decode_step.comm_s, 0.0);
        // Collectives carry f32: 45 all-reduces of 2048 f32 and the logits gather.
        assert!(two.decode_step.comm_s >= 45.0 * hw.link.one_shot.alpha_s);
        let t = &two.decode_step;
        assert_eq!(
            t.time_s,
            t.compute_s.max(t.memory_s) + t.elementwise_s + t.overhead_s + t.comm_s
        );
        // Elementwise ops scale with the tokens of the phase: 128 in the prefill, 1 in a
        // decode step, at the same bandwidth.
        assert!(
            (one.prefill.elementwise_s / one.decode_step.elementwise_s - 128.0).abs() < 1e-9,
            "{one:?}"
        );
        assert!(one.decode_step.elementwise_s > 0.0);
        // With an attention rate of its own, attention's FLOPs are priced at it.
        hw.attention_flops = Some(1e10);
        let slow = simulate_as(&tinyllama(2), &hw, work, num);
        let attention = 4.0 * (22 * 1024) as f64 * 128.0 * 129.0 / 2.0;
        let linear = (22 * layer / 2) as f64 * 2.0 * 128.0 + (16000 * 2048) as f64 * 2.0;
        let expect = linear / 4e11 + attention / 5e9;
        assert!(
            (slow.prefill.compute_s / expect - 1.0).abs() < 1e-12,
            "{slow:?}"
        );
        // The host's 16 GB are shared by the ranks.
        assert_eq!(two.device_memory_bytes, 8_000_000_000);
        assert_eq!(two.weight_dtype, DType::Bf16);
        assert_eq!(two.activation_dtype, DType::F32);
    }

    #[test]
    fn f32_weights_double_the_bytes_and_use_the_f32_peak() {
        let hw = flat_hw();
        let work = Workload {
            batch: 1,
            prompt: 16,
            gen: 0,
        };
        let plan = tinyllama(1);
        let bf = simulate_as(&plan, &hw, work, Numerics::cpu_runtime(true));
        let f = simulate_as(&plan, &hw, work, Numerics::cpu_runtime(false));
        assert_eq!(f.weight_bytes_per_rank, 2 * bf.weight_bytes_per_rank);
        assert!((f.prefill.compute_s / bf.prefill.compute_s - 10.0).abs() < 1e-9);
        assert_eq!(simulate(&plan, &hw, work).weight_dtype, DType::Bf16);
    }

    fn tiny(tp: u64) -> Plan {
        super::super::shipped::plan("tiny-llama", tp)
    }

    #[test]
    fn two_pipeline_stages_by_hand() {
        let mut hw = flat_hw();
        hw.compute_efficiency = 1.0;
        hw.memory_efficiency = 1.0;
        let work = Workload {
            batch: 1,
            prompt: 16,
            gen: 8,
        };
        let num = Numerics::of_plan(&tiny(1));
        let plan = tiny(1);
        // pp 1 is the tensor-parallel estimate itself.
        let one = simulate_pp(&plan, &hw, work, num, 1).unwrap();
        assert_eq!(one, simulate_as(&plan, &hw, work, num));
        assert!(one.stages.is_empty() && one.pp == 1);
        // tiny-llama, f32: a layer holds q, o (64×64), k, v (16×64), gate, up (128×64),
        // down (64×128) and two norms of 64: 34 944 elements. Stage 0: the embedding
        // (250×64) and layer 0; stage 1: layer 1, the final norm and the LM head (250×64).
        let layer = 2 * 64 * 64 + 2 * 16 * 64 + 3 * 128 * 64 + 2 * 64;
        let w0 = 4 * (250 * 64 + layer) as u64;
        let w1 = 4 * (layer + 64 + 250 * 64) as u64;
        let e = simulate_pp(&plan, &hw, work, num, 2).unwrap();
        assert_eq!(e.pp, 2);
        assert_eq!(e.stages.len(), 2);
        assert_eq!((e.stages[0].first_layer, e.stages[0].layers), (0, 1));
        assert_eq!((e.stages[1].first_layer, e.stages[1].layers), (1, 1));
        assert_eq!(e.stages[0].weight_bytes_per_rank, w0);
        assert_eq!(e.stages[1].weight_bytes_per_rank, w1);
        // KV: 2 kv heads of 8, keys and values, f32, per layer and token; 24 tokens.
        let kv = (2 * 16 * 4 * 24) as u64;
        assert_eq!(e.stages[1].kv_bytes_per_rank, kv);
        assert_eq!(e.weight_bytes_per_rank, w1);
        assert_eq!(e.memory_per_rank_bytes, w1 + kv);
        assert_eq!(
            one.weight_bytes_per_rank,
            w0 + w1 - 4 * 250 * 64 + 4 * 250 * 64
        );
        // Time: the stages one after another, plus one send of the hidden state (64 f32
        // per token): 16 tokens in the prefill, 1 in a decode step.
        let ab = hw.link.send_recv;
        let send = |tokens: f64| ab.alpha_s + 64.0 * 4.0 * tokens / ab.beta_bytes_per_s;
        let sum = |f: &dyn Fn(&StageEstimate) -> f64| e.stages.iter().map(f).sum::<f64>();
        assert!((e.prefill.time_s - (sum(&|s| s.prefill_time_s) + send(16.0))).abs() < 1e-15);
        assert!(
            (e.decode_step.time_s - (sum(&|s| s.decode_step_time_s) + send(1.0))).abs() < 1e-15
        );
        // Compute splits between the stages: their sum is the one-stage figure.
        assert!((e.prefill.compute_s / one.prefill.compute_s - 1.0).abs() < 1e-12);
        assert!((e.decode_step.overhead_s - one.decode_step.overhead_s).abs() < 1e-15);
        // More stages than layers: an error naming the valid ones.
        let err = simulate_pp(&plan, &hw, work, num, 3).unwrap_err();
        assert!(err.to_string().contains("valid: 1 to 2"), "{err}");
    }

    #[test]
    fn a_plan_that_does_not_fit_says_so() {
        let mut hw = flat_hw();
        hw.memory_bytes = 1e9;
        let e = simulate(
            &plan(1),
            &hw,
            Workload {
                batch: 1,
                prompt: 16,
                gen: 16,
            },
        );
        assert!(!e.fits);
    }

    /// A profile with every figure at the slow end of its bounds (`slow`) or the fast end.
    fn profile_at_bounds(slow: bool, shared: Option<u64>) -> HwProfile {
        use crate::cost::profile::{
            SharedHost, BYTES_PER_S, EFFICIENCY, FLOPS, LATENCY_S, MEMORY_BYTES, OP_OVERHEAD_S,
        };
        let end = |b: crate::cost::profile::Bound, slow_is_max: bool| {
            if slow == slow_is_max {
                b.max
            } else if b.zero {
                0.0
            } else {
                b.min
            }
        };
        let ab = AlphaBeta {
            alpha_s: end(LATENCY_S, true),
            beta_bytes_per_s: end(BYTES_PER_S, false),
        };
        let mut p = flat_hw();
        p.memory_bytes = end(MEMORY_BYTES, false);
        p.peak_flops_bf16 = end(FLOPS, false);
        p.peak_flops_f32 = end(FLOPS, false);
        p.memory_bandwidth = end(BYTES_PER_S, false);
        p.compute_efficiency = end(EFFICIENCY, false);
        p.memory_efficiency = end(EFFICIENCY, false);
        p.link = LinkCosts {
            ring: ab,
            one_shot: ab,
            two_shot: ab,
            send_recv: ab,
        };
        p.op_overhead_s = end(OP_OVERHEAD_S, true);
        p.attention_flops = Some(end(FLOPS, false));
        p.attention_flops_by_head_dim = vec![(1, end(FLOPS, false))];
        p.shared = shared.map(|cores| SharedHost {
            op_overhead_one_thread_s: Some(end(OP_OVERHEAD_S, true)),
            one_thread_flops_bf16: Some(end(FLOPS, false)),
            one_thread_flops_f32: Some(end(FLOPS, false)),
            ..SharedHost::new(cores)
        });
        p.devices = crate::cost::profile::MAX_DEVICES;
        p.check().unwrap();
        p
    }

    /// A profile that passes its check never prices a phase at inf, NaN or 0 seconds (which
    /// the table printed as `inf ms` and the JSON as `null`), at the smallest and the
    /// largest workloads the command line takes.
    #[test]
    fn every_figure_of_a_valid_profile_gives_a_finite_estimate() {
        let plans = [
            plan(1),
            plan(8),
            super::super::shipped::plan("tiny-llama", 2),
        ];
        let works = [
            Workload {
                batch: 1,
                prompt: 1,
                gen: 0,
            },
            Workload {
                batch: 4096,
                prompt: 1 << 24,
                gen: 1 << 24,
            },
        ];
        for slow in [true, false] {
            for shared in [None, Some(1), Some(crate::cost::profile::MAX_DEVICES)] {
                let hw = profile_at_bounds(slow, shared);
                for plan in &plans {
                    for work in works {
                        for pp in [1, 2] {
                            let e =
                                simulate_pp(plan, &hw, work, Numerics::of_plan(plan), pp).unwrap();
                            let phases = [e.prefill, e.decode_step];
                            let times = phases.iter().flat_map(|p| {
                                [
                                    p.time_s,
                                    p.compute_s,
                                    p.memory_s,
                                    p.comm_s,
                                    p.overhead_s,
                                    p.elementwise_s,
                                ]
                            });
                            for t in times.chain([e.tokens_per_s.prefill, e.tokens_per_s.decode]) {
                                assert!(
                                    t.is_finite() && t >= 0.0,
                                    "{slow} {shared:?} {work:?} {e:?}"
                                );
                            }
                            assert!(
                                e.prefill.time_s > 0.0 && e.decode_step.time_s > 0.0,
                                "{e:?}"
                            );
                            let json = serde_json::to_string(&e).unwrap();
                            assert!(!json.contains("null"), "{json}");
                        }
                    }
                }
            }
        }
    }
}
