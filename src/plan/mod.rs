//! The plan: a versioned artifact with one program per rank, the weight-slice manifest and
//! every collective. The runtime consumes only plans.

pub mod balance;
pub mod build;
pub mod diff;
pub mod dot;
pub mod experts;
pub mod fuse;
pub mod fuse_norm;
pub mod partition;
pub mod report;
pub mod source;
pub mod stages;
pub mod text;
pub mod verify;

pub use crate::error::{PlanError, PlanProblem};
use crate::error::{Result, TpcError};
use crate::frontend::load::{parse_json, parse_ron, read_text, ron_options};
use crate::ir::{DType, Layout, Name, NumericsMode, Op, SliceRange, TensorFact};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::path::Path;

/// Bumped whenever a plan's meaning changes, so that no tpc runs a plan it would read
/// wrongly. A field added with a default that keeps older plans meaning what they meant
/// (`max_positions`, `pipeline`, a rank's `fused` products) does not bump it: a plan without
/// the field loads as it always did, and a tpc that predates the field ignores it and runs
/// the plan as it was (fused products: as separate products, the same values).
pub const PLAN_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub version: u32,
    pub model: String,
    pub tp: u64,
    pub dtype: DType,
    /// Things a user should know (kv-head replication, vocab padding).
    pub notes: Vec<String>,
    pub collectives: Vec<Collective>,
    /// Column→row regions: the linears that open and close each.
    pub regions: Vec<RegionInfo>,
    pub ranks: Vec<RankProgram>,
    /// The longest sequence (prompt + generated) the model allows, when it says.
    #[serde(default)]
    pub max_positions: Option<u64>,
    /// Mistral's `sliding_window`: the runtime has full causal attention, so it runs only
    /// sequences that fit in the window.
    #[serde(default)]
    pub attention_window: Option<u64>,
    /// Pipeline stages over the decoder layers (`tpc compile --pp`); none: one stage.
    /// Each stage's programs are derived from `ranks` ([`stages::stage_program`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<stages::Pipeline>,
    /// What the plan was compiled from (the model as the compiler read it and every choice
    /// that shaped the plan), so that a loaded plan can be compiled again and compared
    /// (`tpc::provenance`): an edit that keeps the plan well-formed but computes something
    /// else is then refused. Absent in plans written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<source::PlanSource>,
    /// How the plan's sums are ordered (`ir::numerics`); absent in fast plans. A tpc that
    /// predates the field refuses an invariant plan rather than run it fast: the plan's
    /// `source` (which denies unknown fields) records the mode too.
    #[serde(default, skip_serializing_if = "NumericsMode::is_fast")]
    pub numerics: NumericsMode,
}

/// One collective of the forward pass (the same on every rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Collective {
    /// Value id in the rank programs.
    pub id: u32,
    pub name: String,
    /// `all_reduce`, `all_gather` or `reduce_scatter`.
    pub kind: String,
    pub layer: Option<u32>,
    /// Elements of the whole (gathered or reduced) value per token.
    pub elements_per_token: u64,
    /// Message size per token: elements × dtype size.
    pub bytes_per_token: u64,
    /// Bytes each rank sends per token with a ring algorithm.
    pub ring_wire_bytes_per_token: u64,
}

impl Collective {
    /// How many times a ring moves the message for `op` (the rank's instruction): twice
    /// for an all-reduce (a reduce-scatter and an all-gather), a norm fused with one, and a
    /// reduce-scatter of unequal pieces (an all-reduce that each rank cuts); once otherwise.
    pub fn ring_passes(op: &Op) -> f64 {
        match op {
            Op::AllReduce(_) | Op::RmsNorm(_) => 2.0,
            Op::ReduceScatter(r) if !r.pieces.is_empty() => 2.0,
            _ => 1.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub layer: Option<u32>,
    pub columns: Vec<String>,
    pub rows: Vec<String>,
    /// Every op inside the region.
    pub members: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankProgram {
    pub rank: u64,
    pub weights: Vec<WeightSlice>,
    pub instrs: Vec<Instr>,
    /// Linear ops that run as one product on this rank ([`fuse`]); absent in plans
    /// written before fusion, which then run each linear on its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<FusedLinears>,
    /// The unequal shares the program's values split by tokens (sequence parallelism)
    /// are dealt by ([`crate::ir::token_blocks`]); absent: evenly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_shares: Option<crate::ir::TpShares>,
}

/// Linear ops of one rank that read the same input and run as one product: the runtime
/// loads their weight slices side by side (concatenated along the output features, in the
/// order listed) and each op's value is its block of the product's columns. Q/K/V and
/// gate/up of a Llama-like layer, one GEMM (or GEMV) per rank instead of three or two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusedLinears {
    /// The linear instructions' ids, in program order.
    pub linears: Vec<u32>,
    /// Each one's output columns on this rank: the product's column blocks, in order.
    pub columns: Vec<u64>,
}

impl RankProgram {
    /// Whether the program has mixture-of-experts layers.
    pub fn has_experts(&self) -> bool {
        self.instrs
            .iter()
            .any(|i| matches!(i.op, crate::ir::Op::Experts(_)))
    }

    /// The id of the all-gather whose result is the program's output, when the output is
    /// gathered (vocabulary-split logits).
    pub fn output_gather(&self) -> Option<u32> {
        let output = self.instrs.iter().find(|i| matches!(i.op, Op::Output(_)))?;
        let id = *output.inputs.first()?;
        self.instrs
            .iter()
            .find(|i| i.id == id && matches!(i.op, Op::AllGather(_)))
            .map(|i| i.id)
    }
}

impl RankProgram {
    /// The linears whose outputs reach the program's output through row-wise ops only (the
    /// LM head): slicing rows before them equals slicing after, so a prefill runs them on
    /// the last row of each sequence. None when the path passes anything else (attention,
    /// a norm of a residual stream reused elsewhere, ...), which would need its other inputs
    /// sliced too.
    pub fn head_linears(&self) -> Vec<u32> {
        let by_id: std::collections::HashMap<u32, &Instr> =
            self.instrs.iter().map(|i| (i.id, i)).collect();
        let mut heads = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut stack: Vec<u32> = self
            .instrs
            .iter()
            .filter(|i| matches!(i.op, Op::Output(_)))
            .flat_map(|i| i.inputs.first().copied())
            .collect();
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let Some(i) = by_id.get(&id) else { continue };
            match &i.op {
                Op::Linear(_) => heads.push(id),
                op if crate::ir::op_dims::dims(op).row_wise => {
                    if let Some(&first) = i.inputs.first() {
                        stack.push(first)
                    }
                }
                _ => return Vec::new(),
            }
        }
        heads
    }
}

/// Which part of a checkpoint tensor one rank loads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightSlice {
    /// The checkpoint's tensor name.
    pub tensor: Name,
    /// Shape in the checkpoint.
    pub shape: Vec<u64>,
    pub dtype: DType,
    /// The split dim, `None` when the rank loads the whole tensor.
    pub dim: Option<u32>,
    /// Ranges of `dim` to load, concatenated in order.
    pub ranges: Vec<SliceRange>,
    /// Zero rows appended after the ranges (vocab padding).
    pub padding: u64,
    /// Shape the rank holds.
    pub local_shape: Vec<u64>,
    /// How the checkpoint stores the tensor when it is quantized (the piece keeps its
    /// scale blocks whole); `dtype` is then what the rank computes with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<crate::ir::Quantized>,
}

impl WeightSlice {
    pub fn local_elements(&self) -> u64 {
        crate::ir::saturating::product(self.local_shape.iter().copied())
    }
    /// Elements of the rank's piece without its padding (what a backend that skips the
    /// padding of an uneven split holds).
    pub fn real_elements(&self) -> u64 {
        let Some(d) = self.dim else {
            return self.local_elements();
        };
        let others = crate::ir::saturating::product(
            self.local_shape
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != d as usize)
                .map(|(_, &n)| n),
        );
        others.saturating_mul(self.real_len())
    }
    /// The split dim's checkpoint elements this piece holds (its padding left out).
    pub fn real_len(&self) -> u64 {
        crate::ir::saturating::sum(self.ranges.iter().map(|r| r.len))
    }
    /// The split dim's zeros in this piece: after its ranges and at its end.
    pub fn pad_len(&self) -> u64 {
        crate::ir::saturating::sum(self.ranges.iter().map(|r| r.pad)).saturating_add(self.padding)
    }
    /// Whether some padding lies inside the piece (a fused q|k|v dealt unevenly).
    pub fn padded_inside(&self) -> bool {
        self.ranges.iter().any(|r| r.pad > 0)
    }
    /// Bytes of the whole tensor as the checkpoint stores it.
    pub fn whole_bytes(&self) -> u64 {
        self.stored_bytes(&self.shape)
    }
    /// Bytes of the piece as the checkpoint stores it (a quantized weight's elements and
    /// the scales of the blocks it holds).
    pub fn local_bytes(&self) -> u64 {
        self.stored_bytes(&self.local_shape)
    }
    /// Bytes of a tensor of `shape` in this weight's stored encoding.
    fn stored_bytes(&self, shape: &[u64]) -> u64 {
        match &self.quant {
            Some(q) => q.stored_bytes(shape),
            None => crate::ir::saturating::product(shape.iter().copied())
                .saturating_mul(self.dtype.size_bytes()),
        }
    }
}

/// One instruction: `%id = op(inputs)`. Ids are shared by all ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instr {
    pub id: u32,
    pub name: Name,
    pub op: Op,
    pub inputs: SmallVec<[u32; 4]>,
    /// The value on this rank.
    pub fact: TensorFact,
    pub layout: Layout,
    pub layer: Option<u32>,
}

impl Instr {
    /// Whether the value is split by tokens (sequence parallelism): each rank holds its
    /// block of the call's token rows.
    pub fn is_split_by_tokens(&self) -> bool {
        matches!(self.layout, Layout::Split { dim } if self.fact.shape.is_sequence(dim))
    }
}

/// The two text forms a plan is saved in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanFormat {
    Ron,
    Json,
}

impl PlanFormat {
    /// The form a plan is written in: JSON when the name ends in `.json` in any case.
    pub fn for_output(path: &Path) -> PlanFormat {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => PlanFormat::Json,
            _ => PlanFormat::Ron,
        }
    }

    /// The form a plan's text is in, from its content, not its name (a JSON plan renamed
    /// `.txt` or `.JSON` is still JSON): JSON starts with `{`, a RON plan with `(`.
    pub fn of_text(text: &str) -> PlanFormat {
        let first = text
            .lines()
            .map(str::trim_start)
            .find(|l| !l.is_empty() && !l.starts_with("//") && !l.starts_with("#!"));
        match first {
            Some(l) if l.starts_with('{') => PlanFormat::Json,
            _ => PlanFormat::Ron,
        }
    }

    fn parse<T: serde::de::DeserializeOwned>(self, path: &Path, text: &str) -> Result<T> {
        match self {
            PlanFormat::Json => parse_json(path, text),
            PlanFormat::Ron => parse_ron(path, text),
        }
    }
}

impl Plan {
    /// Why this plan's experts cannot be dealt over replicas (`--ep`), if they cannot:
    /// every launcher and `simulate` ask this one question.
    pub fn why_experts_cannot_span_replicas(&self) -> Option<&'static str> {
        if !self.ranks.first().is_some_and(RankProgram::has_experts) {
            return Some("the model has no mixture-of-experts layers to deal over replicas");
        }
        None
    }

    /// Writes RON, or JSON when the path ends in `.json` (any case).
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = match PlanFormat::for_output(path) {
            PlanFormat::Json => serde_json::to_string_pretty(self)
                .map_err(|e| TpcError::Serialize(e.to_string()))?,
            PlanFormat::Ron => {
                let cfg = ron::ser::PrettyConfig::new().depth_limit(6);
                ron_options()
                    .to_string_pretty(self, cfg)
                    .map_err(|e| TpcError::Serialize(e.to_string()))?
            }
        };
        crate::fsio::write_text(path, &text)
    }

    /// Reads a plan written by [`Plan::save`] (RON or JSON, told apart by content), checking
    /// its version and then [`Plan::verify`].
    pub fn load(path: &Path) -> Result<Plan> {
        let text = read_text(path)?;
        Plan::from_text(path, &text)
    }

    /// [`Plan::load`] of text already read from `path`.
    pub fn from_text(path: &Path, text: &str) -> Result<Plan> {
        #[derive(Deserialize)]
        struct Header {
            version: u32,
        }
        let format = PlanFormat::of_text(text);
        let header: Header = format.parse(path, text)?;
        if header.version != PLAN_VERSION {
            return Err(TpcError::PlanVersion {
                path: path.to_path_buf(),
                found: header.version,
                expected: PLAN_VERSION,
            });
        }
        let plan: Plan = format.parse(path, text)?;
        // A corrupted or hand-edited plan never reaches the runtime.
        plan.verify().map_err(|e| e.at(path))?;
        Ok(plan)
    }

    /// If `path` holds a plan (not a model definition), reads it. Told by content: a JSON
    /// object with `ranks` and `version`, or RON that opens with `(` (model files open with
    /// an enum variant, `Preset(` / `Graph(`).
    pub fn looks_like_plan(path: &Path) -> Option<Result<Plan>> {
        if !path.is_file() {
            return None;
        }
        let text = read_text(path).ok()?;
        let is_plan = match PlanFormat::of_text(&text) {
            PlanFormat::Json => {
                let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                v.get("ranks").is_some() && v.get("version").is_some()
            }
            PlanFormat::Ron => text
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with("//") && !l.starts_with("#!"))
                .is_some_and(|l| l.starts_with('(')),
        };
        is_plan.then(|| Plan::from_text(path, &text))
    }
}
