//! The closed set of operations. Each variant carries one small struct of attributes.

use super::groups::Groups;
use super::tensor::{DType, Name};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// An f64 attribute with bitwise equality, so ops can be `Eq + Hash`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct F64(pub f64);

impl Eq for F64 {}

impl std::hash::Hash for F64 {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state)
    }
}

impl fmt::Display for F64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InputKind {
    /// Token ids `[B, S]`.
    TokenIds,
    /// Absolute positions `[B, S]`.
    Positions,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InputOp {
    pub kind: InputKind,
}

/// A checkpoint tensor, named as the checkpoint names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamOp {
    pub tensor: Name,
    pub shape: Vec<u64>,
    #[serde(default)]
    pub dtype: Option<DType>,
    /// Structure of splittable dims (dim index → groups); unlisted dims are plain.
    #[serde(default)]
    pub groups: BTreeMap<u32, Groups>,
    /// Stored quantized (a linear weight of a quantized checkpoint): the split must keep
    /// its scale blocks whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<super::quant::Quantized>,
}

impl ParamOp {
    pub fn groups_of(&self, dim: u32) -> Groups {
        self.groups.get(&dim).cloned().unwrap_or_default()
    }
}

/// Table lookup: inputs `ids [B,S]`, `table [V, H]` → `[B, S, H]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct EmbeddingOp {
    /// Set per rank by partitioning: the rows `[offset, offset+len)` this rank holds;
    /// ids outside it yield zeros.
    #[serde(default)]
    pub vocab_range: Option<(u64, u64)>,
}

/// How a linear weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum WeightOrder {
    /// `[out, in]` (torch `nn.Linear`).
    #[default]
    OutIn,
    /// `[in, out]` (GPT-2 `Conv1D`).
    InOut,
}

impl WeightOrder {
    pub fn out_dim(self) -> u32 {
        match self {
            WeightOrder::OutIn => 0,
            WeightOrder::InOut => 1,
        }
    }
    pub fn in_dim(self) -> u32 {
        1 - self.out_dim()
    }
}

/// `y = x · Wᵀ`: inputs `x [.., in]`, `w` → `[.., out]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct LinearOp {
    #[serde(default)]
    pub weight_order: WeightOrder,
    /// In an invariant plan, the exact depth blocks of a linear that a valid tp splits by
    /// rows (`ir::numerics`); none otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<super::numerics::ExactBlocks>,
}

/// `y = x + b` with `b` broadcast over the last dim.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct BiasAddOp {}

/// Elementwise sum of two equal shapes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct AddOp {}

/// Elementwise product of two equal shapes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct MulOp {}

/// `x ⊙ σ(g)`: `x [.., h]` scaled per token by the sigmoid of `g [.., 1]` (Qwen2-MoE's gate
/// on its shared expert).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct SigmoidGateOp {}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ActivationKind {
    Silu,
    /// GeLU with the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact GeLU with erf.
    Gelu,
    Relu,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ActivationOp {
    pub kind: ActivationKind,
}

/// RMSNorm over the last dim, or over each `group`-sized slice of it (per-head q/k norm).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RmsNormOp {
    pub eps: F64,
    #[serde(default)]
    pub group: Option<u64>,
    /// Set by the norm-fusion pass: the input is a partial sum that this op all-reduces
    /// (with these attributes) before normalizing — one collective and one kernel instead
    /// of an all-reduce then a norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_input: Option<AllReduceOp>,
    /// Set by the norm-fusion pass under `--numerics invariant`: this norm runs in one step
    /// with the all-reduce that feeds it (directly, or through the one residual add that
    /// reads the all-reduce), and those ops keep their own values (`plan::fuse_norm`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub with_reduce: bool,
}

/// LayerNorm over the last dim: inputs `x`, `weight`, `bias`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerNormOp {
    pub eps: F64,
}

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Llama 3.1: long wavelengths scaled by `factor`, smooth in between.
    Llama3 {
        factor: F64,
        low_freq_factor: F64,
        high_freq_factor: F64,
        original_max_position_embeddings: u64,
    },
    /// Positions divided by `factor`.
    Linear { factor: F64 },
}

/// Rotary position embedding, rotate-half style, on the first `rotary_dim` of each head.
/// Inputs: `x [B, S, heads*head_dim]`, `positions [B, S]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RopeOp {
    pub head_dim: u64,
    pub rotary_dim: u64,
    pub theta: F64,
    #[serde(default)]
    pub scaling: Option<RopeScaling>,
}

/// Causal scaled-dot-product attention with grouped kv heads. Inputs `q, k, v`; the head
/// counts are read from the input shapes, so one rank's op needs no rewriting.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttentionOp {
    pub head_dim: u64,
    /// Softmax scale; `None` means `1/sqrt(head_dim)`.
    #[serde(default)]
    pub scale: Option<F64>,
}

/// Takes part `part` out of a fused last dim with structure `groups` (a `Concat` or
/// `Interleaved` structure, the same one the producing weight declares).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UnfuseOp {
    pub groups: Groups,
    pub part: u32,
}

/// A model output (logits).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OutputOp {
    pub name: String,
}

/// Sum over ranks; every rank gets the whole result.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct AllReduceOp {
    /// The algorithm by message size, when the plan was compiled for a hardware profile;
    /// otherwise the communicator chooses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<super::AlgorithmChoice>,
}

/// Concatenate the ranks' pieces along `dim`; `unpad_to` drops vocab padding afterwards.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AllGatherOp {
    pub dim: u32,
    #[serde(default)]
    pub unpad_to: Option<u64>,
    /// Per-rank counts, set by partitioning where the ranks hold unequal real parts (a
    /// vocabulary dealt by `--tp-shares`): rank `r`'s piece starts with its `pieces[r]`
    /// real elements, the rest is padding, and the gathered value joins only the real
    /// parts in rank order. Empty: every piece is whole but for `unpad_to`'s end padding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<u64>,
}

impl AllGatherOp {
    /// Each rank's real count along `dim` when every rank's piece holds `local` elements:
    /// `pieces` where set, else whole pieces up to `unpad_to`'s end padding.
    pub fn real_counts(&self, local: u64, tp: u64) -> Vec<u64> {
        if !self.pieces.is_empty() {
            return self.pieces.clone();
        }
        let keep = self.unpad_to.unwrap_or(local.saturating_mul(tp));
        (0..tp)
            .map(|r| local.min(keep.saturating_sub(r.saturating_mul(local))))
            .collect()
    }
}

/// Sum over ranks, each rank keeping its piece along `dim`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReduceScatterOp {
    pub dim: u32,
    /// Per-rank counts, set by partitioning where the ranks keep unequal parts of a dim
    /// that is not the sequence's (a `tp_plan` override that splits the hidden state at a
    /// tp that does not divide it, or `--tp-shares`): rank `r` keeps the sum of its
    /// `pieces[r]` entries after the earlier ranks', padded with zeros to the largest, as
    /// an uneven local slice keeps them. Empty: even pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<u64>,
    /// Where each rank's piece starts, set where pieces overlap (kv heads replicated on
    /// several ranks); empty: after the earlier ranks' pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub starts: Vec<u64>,
}

impl ReduceScatterOp {
    /// An even reduce-scatter along `dim`.
    pub fn even(dim: u32) -> ReduceScatterOp {
        ReduceScatterOp {
            dim,
            pieces: Vec::new(),
            starts: Vec::new(),
        }
    }
}

/// What a local slice or a reduce-scatter cuts: its dim, and its uneven pieces and their
/// starts (empty: even pieces; starts empty: one after another).
#[derive(Debug, Clone, Copy)]
pub struct Cut<'a> {
    pub dim: u32,
    pub pieces: &'a [u64],
    pub starts: &'a [u64],
}

impl Op {
    /// The cut of a local slice or a reduce-scatter; `None` for other ops.
    pub fn cut(&self) -> Option<Cut<'_>> {
        let (dim, pieces, starts) = match self {
            Op::ReduceScatter(r) => (r.dim, &r.pieces, &r.starts),
            Op::LocalSlice(s) => (s.dim, &s.pieces, &s.starts),
            _ => return None,
        };
        Some(Cut {
            dim,
            pieces,
            starts,
        })
    }

    /// Sets a local slice's or a reduce-scatter's uneven `pieces` and `starts`.
    pub fn set_cut(&mut self, pieces: Vec<u64>, starts: Vec<u64>) {
        match self {
            Op::ReduceScatter(r) => (r.pieces, r.starts) = (pieces, starts),
            Op::LocalSlice(s) => (s.pieces, s.starts) = (pieces, starts),
            _ => {}
        }
    }
}

/// Rank `rank`'s window of an uneven cut (a local slice's or a reduce-scatter's `pieces`
/// and `starts`): its offset, its real length, and the width every rank's piece is padded
/// to (the largest).
pub fn piece_window(pieces: &[u64], starts: &[u64], rank: usize) -> (u64, u64, u64) {
    let offset = match starts.get(rank) {
        Some(&s) => s,
        None => super::saturating::sum(pieces.iter().take(rank).copied()),
    };
    let len = pieces.get(rank).copied().unwrap_or(0);
    (offset, len, pieces.iter().copied().max().unwrap_or(0))
}

/// Keep this rank's piece of a replicated value along `dim` (no communication).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LocalSliceOp {
    pub dim: u32,
    /// Per-rank counts, set by partitioning where the ranks take unequal parts (the dim
    /// dealt unevenly or by `--tp-shares`, as the weight of the linear that reads the
    /// slice): rank `r` keeps its `pieces[r]` entries after the earlier ranks', padded with
    /// zeros to the largest. Empty: even pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<u64>,
    /// Where each rank's piece starts, set where pieces overlap (kv heads replicated on
    /// several ranks); empty: after the earlier ranks' pieces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub starts: Vec<u64>,
}

impl LocalSliceOp {
    /// An even slice along `dim`.
    pub fn even(dim: u32) -> LocalSliceOp {
        LocalSliceOp {
            dim,
            pieces: Vec::new(),
            starts: Vec::new(),
        }
    }
}

/// A mixture-of-experts router: softmax over the experts' logits (in f32), the `top_k`
/// largest kept (the lower expert first among equal values) and, with `normalize`, divided
/// by their sum; every other expert's weight is zero. Input `logits [.., e]` → `[.., e]` f32.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RouteOp {
    pub top_k: u64,
    #[serde(default)]
    pub normalize: bool,
}

/// How a mixture-of-experts layer is split over the ranks (`--moe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ExpertSplit {
    /// Every expert's gate/up by columns and down by rows on every rank.
    #[default]
    Tensor,
    /// Whole experts dealt to the ranks; each computes only its experts.
    Expert,
}

impl ExpertSplit {
    pub fn word(self) -> &'static str {
        match self {
            ExpertSplit::Tensor => "tensor",
            ExpertSplit::Expert => "expert",
        }
    }
}

/// The experts of a mixture-of-experts layer, each a gated MLP
/// `down · (act(gate · x) ⊙ up · x)`, summed with the router's weights:
/// inputs `x [.., h]`, `routing [.., e]` (a [`RouteOp`]'s output), `gate [e, f, h]`,
/// `up [e, f, h]`, `down [e, h, f]` → `[.., h]`. A token reads only the experts its routing
/// weight is non-zero for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExpertsOp {
    pub act: ActivationKind,
    /// Which dim the sharding pass splits: the experts, or each expert's features.
    #[serde(default)]
    pub split: ExpertSplit,
}

/// Every operation tpc knows. Collectives are only ever inserted by passes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    Input(InputOp),
    Param(ParamOp),
    Embedding(EmbeddingOp),
    Linear(LinearOp),
    BiasAdd(BiasAddOp),
    Add(AddOp),
    Mul(MulOp),
    SigmoidGate(SigmoidGateOp),
    Activation(ActivationOp),
    RmsNorm(RmsNormOp),
    LayerNorm(LayerNormOp),
    Rope(RopeOp),
    Attention(AttentionOp),
    Unfuse(UnfuseOp),
    Output(OutputOp),
    AllReduce(AllReduceOp),
    AllGather(AllGatherOp),
    ReduceScatter(ReduceScatterOp),
    LocalSlice(LocalSliceOp),
    Route(RouteOp),
    Experts(ExpertsOp),
}

impl Op {
    /// Short kind name used in reports, errors and pictures.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::Param(_) => "param",
            Op::Embedding(_) => "embedding",
            Op::Linear(_) => "linear",
            Op::BiasAdd(_) => "bias_add",
            Op::Add(_) => "add",
            Op::Mul(_) => "mul",
            Op::SigmoidGate(_) => "sigmoid_gate",
            Op::Activation(_) => "activation",
            Op::RmsNorm(n) if n.reduce_input.is_some() => "all_reduce_rms_norm",
            Op::RmsNorm(_) => "rms_norm",
            Op::LayerNorm(_) => "layer_norm",
            Op::Rope(_) => "rope",
            Op::Attention(_) => "attention",
            Op::Unfuse(_) => "unfuse",
            Op::Output(_) => "output",
            Op::AllReduce(_) => "all_reduce",
            Op::AllGather(_) => "all_gather",
            Op::ReduceScatter(_) => "reduce_scatter",
            Op::LocalSlice(_) => "local_slice",
            Op::Route(_) => "route",
            Op::Experts(_) => "experts",
        }
    }

    /// Number of inputs the op takes.
    pub fn arity(&self) -> usize {
        match self {
            Op::Input(_) | Op::Param(_) => 0,
            Op::Activation(_)
            | Op::Unfuse(_)
            | Op::Output(_)
            | Op::AllReduce(_)
            | Op::AllGather(_)
            | Op::ReduceScatter(_)
            | Op::LocalSlice(_)
            | Op::Route(_) => 1,
            Op::Embedding(_)
            | Op::Linear(_)
            | Op::BiasAdd(_)
            | Op::Add(_)
            | Op::Mul(_)
            | Op::SigmoidGate(_)
            | Op::RmsNorm(_)
            | Op::Rope(_) => 2,
            Op::LayerNorm(_) | Op::Attention(_) => 3,
            Op::Experts(_) => 5,
        }
    }

    pub fn is_collective(&self) -> bool {
        super::op_dims::dims(self).collective
    }

    /// A one-line attribute summary for printers.
    pub fn attrs(&self) -> String {
        match self {
            Op::Input(i) => format!("{:?}", i.kind),
            Op::Param(p) => p.tensor.to_string(),
            Op::Embedding(e) => match e.vocab_range {
                Some((o, l)) => format!("rows {o}..{}", o + l),
                None => String::new(),
            },
            Op::Linear(l) => match l.weight_order {
                WeightOrder::OutIn => String::new(),
                WeightOrder::InOut => "w[in,out]".into(),
            },
            Op::Activation(a) => format!("{:?}", a.kind),
            Op::RmsNorm(n) => {
                let mut a = match n.group {
                    Some(g) => format!("eps={} group={g}", n.eps),
                    None => format!("eps={}", n.eps),
                };
                if let Some(c) = n.reduce_input.as_ref().and_then(|r| r.algorithm.as_ref()) {
                    a.push_str(&format!(" all-reduce {}", c.describe()));
                }
                if n.with_reduce {
                    a.push_str(" with its all-reduce");
                }
                a
            }
            Op::LayerNorm(n) => format!("eps={}", n.eps),
            Op::Rope(r) => format!(
                "head_dim={} rotary_dim={} theta={}{}",
                r.head_dim,
                r.rotary_dim,
                r.theta,
                if r.scaling.is_some() { " scaled" } else { "" }
            ),
            Op::Attention(a) => format!("head_dim={}", a.head_dim),
            Op::Unfuse(u) => format!("part {}", u.part),
            Op::Output(o) => o.name.clone(),
            Op::AllGather(g) => {
                let mut text = format!("dim={}", g.dim);
                if let Some(n) = g.unpad_to {
                    text.push_str(&format!(" unpad_to={n}"));
                }
                if !g.pieces.is_empty() {
                    let list: Vec<String> = g.pieces.iter().map(u64::to_string).collect();
                    text.push_str(&format!(" pieces={}", list.join("/")));
                }
                text
            }
            Op::ReduceScatter(_) | Op::LocalSlice(_) => {
                let Some(Cut {
                    dim,
                    pieces,
                    starts,
                }) = self.cut()
                else {
                    return String::new();
                };
                let mut text = format!("dim={dim}");
                for (name, list) in [("pieces", pieces), ("starts", starts)] {
                    if !list.is_empty() {
                        let list: Vec<String> = list.iter().map(u64::to_string).collect();
                        text.push_str(&format!(" {name}={}", list.join("/")));
                    }
                }
                text
            }
            Op::Route(r) => format!(
                "top_k={}{}",
                r.top_k,
                if r.normalize { " normalized" } else { "" }
            ),
            Op::Experts(e) => format!("{:?} split={}", e.act, e.split.word()),
            Op::BiasAdd(_) | Op::Add(_) | Op::Mul(_) | Op::SigmoidGate(_) => String::new(),
            Op::AllReduce(a) => a
                .algorithm
                .as_ref()
                .map(|c| c.describe())
                .unwrap_or_default(),
        }
    }
}
