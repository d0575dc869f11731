//! What [`Plan::verify`](crate::plan::Plan::verify) reports: every problem of a plan, each at
//! its place (rank, instruction, weight entry or listed collective), saying what is wrong
//! and what would be right.

use crate::ir::{DType, Name, TensorFact};
use std::fmt;
use std::path::PathBuf;

/// At most this many problems are kept in full; the rest are only counted, so a plan
/// with millions of broken instructions still fails fast and small.
pub const MAX_LISTED: usize = 1000;

/// A plan that does not hold together: every problem found, in plan order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(self))]
pub struct PlanError {
    /// The file the plan came from, when it was loaded.
    pub path: Option<PathBuf>,
    pub model: String,
    pub problems: Vec<PlanProblem>,
    /// Problems found beyond the first [`MAX_LISTED`].
    pub unlisted: usize,
}

impl PlanError {
    /// The same error, naming the file the plan was read from.
    pub fn at(mut self, path: impl Into<PathBuf>) -> PlanError {
        self.path = Some(path.into());
        self
    }
}

fn render(e: &PlanError) -> String {
    let total = e.problems.len() + e.unlisted;
    let mut out = match &e.path {
        Some(p) => format!("plan `{}` for `{}`", p.display(), e.model),
        None => format!("the plan for `{}`", e.model),
    };
    out.push_str(&format!(
        " is inconsistent ({total} problem(s)); recompile the model with `tpc compile` rather than editing the plan:"
    ));
    for p in &e.problems {
        out.push_str(&format!("\n  - {p}"));
    }
    if e.unlisted > 0 {
        out.push_str(&format!("\n  - ... and {} more", e.unlisted));
    }
    out
}

/// One problem at one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanProblem {
    pub place: Place,
    pub problem: Problem,
}

impl fmt::Display for PlanProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.place, self.problem)
    }
}

/// Where a problem is. `rank` is the program's position in `ranks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    Plan,
    Rank {
        rank: usize,
    },
    Instr {
        rank: usize,
        id: u32,
        name: Name,
    },
    Weight {
        rank: usize,
        tensor: Name,
    },
    /// A checkpoint tensor as all ranks together load it.
    Tensor {
        tensor: Name,
    },
    /// Entry `index` of `plan.collectives`.
    Collective {
        index: usize,
        id: u32,
        name: String,
    },
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Plan => f.write_str("plan"),
            Place::Rank { rank } => write!(f, "rank {rank}"),
            Place::Instr { rank, id, name } => write!(f, "rank {rank}, instruction %{id} `{name}`"),
            Place::Weight { rank, tensor } => write!(f, "rank {rank}, weight entry `{tensor}`"),
            Place::Tensor { tensor } => write!(f, "weight `{tensor}` across ranks"),
            Place::Collective { index, id, name } => {
                write!(f, "plan.collectives[{index}] (%{id} `{name}`)")
            }
        }
    }
}

/// One collective as a rank issues it: what the communicator of every rank must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Issued {
    pub id: u32,
    pub kind: &'static str,
    /// Elements of the rank's input per token; `None` when they overflow 64 bits.
    pub elements: Option<u64>,
}

impl fmt::Display for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.elements {
            Some(n) => write!(f, "{} %{} of {n} elements per token", self.kind, self.id),
            None => write!(f, "{} %{} of an overflowing size", self.kind, self.id),
        }
    }
}

/// What every rank holding a tensor must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightKey {
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub dim: Option<u32>,
}

impl fmt::Display for WeightKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype, self.shape)?;
        match self.dim {
            Some(d) => write!(f, " split on dim {d}"),
            None => f.write_str(" whole"),
        }
    }
}

fn issued(i: &Option<Issued>) -> String {
    i.map_or_else(|| "nothing".to_string(), |i| i.to_string())
}

fn range(r: &Option<(u64, u64)>) -> String {
    match r {
        Some((o, l)) => format!("Some(({o}, {l}))"),
        None => "None".into(),
    }
}

/// What is wrong, and what would be right.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    // Header.
    #[error("format version is {found}; this tpc reads version {expected}")]
    Version { found: u32, expected: u32 },
    #[error("tp is 0; a plan needs at least one rank")]
    ZeroTp,
    #[error("tp is {tp} but there are {ranks} rank programs; there must be exactly one per rank")]
    RankCount { tp: u64, ranks: usize },
    #[error("the program at position {index} says it is rank {found}; it must be rank {index}")]
    RankNumber { index: usize, found: u64 },
    #[error("{0}")]
    Pipeline(String),

    // Program structure.
    #[error("id %{id} is already defined by instruction #{first} of this rank; ids must be unique within a rank")]
    DuplicateId { id: u32, first: usize },
    #[error("input {slot} is %{input}, which no instruction of this rank defines; it must name an earlier instruction of the same rank")]
    UndefinedInput { slot: usize, input: u32 },
    #[error("input {slot} is %{input}, defined only at instruction #{defined_at} (this is #{index}); inputs must be defined before they are used")]
    UseBeforeDef {
        slot: usize,
        input: u32,
        defined_at: usize,
        index: usize,
    },
    #[error("{kind} takes {expected} input(s) but has {found}")]
    Arity {
        kind: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("id %{id} is not below {limit}, the number of values the plan names; partition numbers values densely from 0 and the runtime keeps them in a table indexed by id")]
    IdBeyond { id: u32, limit: u64 },
    #[error("runs {ours} here but {theirs} on rank {other} under the same id; every rank runs the same op (and name) on its own piece")]
    OpDiffers {
        other: usize,
        ours: String,
        theirs: String,
    },
    #[error("has {found} output instructions; a rank program needs exactly one")]
    OutputCount { found: usize },

    // Local facts.
    #[error("its op does not accept its recorded inputs: {message}")]
    Inference { message: String },
    #[error("its op's attributes are invalid: {message}")]
    Attribute { message: String },
    #[error("records {recorded}, but its op on its recorded inputs gives {inferred}")]
    Fact {
        recorded: Box<TensorFact>,
        inferred: Box<TensorFact>,
    },
    #[error("{what} overflows 64 bits; no tensor is that large")]
    Overflow { what: String },
    #[error("{kind} on dim {dim} of {input}: that dim must be a fixed dim of the input")]
    CollectiveDim {
        kind: &'static str,
        dim: u32,
        input: Box<TensorFact>,
    },
    #[error("{kind} on dim {dim} of a rank-{rank} value: the runtime moves only the last dim (dim {})", rank.saturating_sub(1))]
    CollectiveNotLast {
        kind: &'static str,
        dim: u32,
        rank: usize,
    },
    #[error(
        "{kind} splits dim {dim} of size {size} {tp} ways; the size must be a multiple of tp={tp}"
    )]
    NotDivisible {
        kind: &'static str,
        dim: u32,
        size: u64,
        tp: u64,
    },
    #[error("unpad_to is {unpad_to} but the gathered dim has only {gathered} elements (local size × tp); it must be at most {gathered}")]
    UnpadTooLarge { unpad_to: u64, gathered: u64 },
    #[error("pieces {pieces:?} of an all-gather must give one count per rank (tp={tp}), each at most the local size {local}, summing to the gathered size {size}")]
    BadPieces {
        pieces: Vec<u64>,
        tp: u64,
        local: u64,
        size: u64,
    },
    #[error("vocab_range ({offset}, {len}) reaches outside its table: the rank holds {local_rows} rows{}; offset + len must stay within the checkpoint's rows and len within the rank's rows", checkpoint_rows.map(|r| format!(" of a {r}-row checkpoint table")).unwrap_or_default())]
    VocabRangeOutside {
        offset: u64,
        len: u64,
        local_rows: u64,
        checkpoint_rows: Option<u64>,
    },
    #[error(
        "vocab_range is {}, but its table's weight entry gives {}",
        range(found),
        range(expected)
    )]
    VocabRange {
        found: Option<(u64, u64)>,
        expected: Option<(u64, u64)>,
    },

    // Weight manifest.
    #[error("its tensor `{tensor}` has no entry in this rank's weight manifest; every param needs exactly one")]
    MissingWeight { tensor: Name },
    #[error("a second entry for this tensor (the first is entry #{first}); each tensor needs exactly one entry")]
    DuplicateWeight { first: usize },
    #[error("no param instruction of this rank reads it; remove the entry or the rank loads a weight it never uses")]
    UnusedWeight,
    #[error("the param's shape is {param:?} but its weight entry's local_shape is {manifest:?}; they must be equal")]
    WeightShape { param: Vec<u64>, manifest: Vec<u64> },
    #[error(
        "the param's dtype is {param} but its weight entry's is {manifest}; they must be equal"
    )]
    WeightDtype { param: DType, manifest: DType },
    #[error("local_shape {local:?} has {} dims but the checkpoint shape {shape:?} has {}; they must have the same rank", local.len(), shape.len())]
    LocalRank { shape: Vec<u64>, local: Vec<u64> },
    #[error("dim is None (whole tensor) but local_shape is {local:?}, ranges {ranges} and padding {padding}; the whole tensor means local_shape {shape:?}, no ranges, no padding")]
    WholeMismatch {
        shape: Vec<u64>,
        local: Vec<u64>,
        ranges: usize,
        padding: u64,
    },
    #[error("splits dim {dim} of a rank-{rank} tensor; the split dim must be below {rank}")]
    SplitDimOutside { dim: u32, rank: usize },
    #[error("splits dim {dim} of a rank-{rank} tensor; the loader slices only dim 0, dim 1 of a 2-D tensor, or any dim of a stack of experts")]
    LoaderCannotSlice { dim: u32, rank: usize },
    #[error("range {index} ({offset} + {len}) lies outside dim {dim} of size {size}; every range must end at or before {size}")]
    RangeOutside {
        index: usize,
        offset: u64,
        len: u64,
        dim: u32,
        size: u64,
    },
    #[error("ranges plus padding cover {} elements of dim {dim} but local_shape[{dim}] is {local}; they must be equal", covered.map_or_else(|| "an overflowing number of".to_string(), |c| c.to_string()))]
    RangeTotal {
        dim: u32,
        covered: Option<u64>,
        local: u64,
    },
    #[error("local_shape {local:?} differs from the checkpoint shape {shape:?} outside the split dim {dim}; only dim {dim} may change")]
    OtherDims {
        dim: u32,
        shape: Vec<u64>,
        local: Vec<u64>,
    },

    #[error("is {ours} here but {theirs} on rank {other}; every rank must read the same checkpoint tensor the same way")]
    WeightDisagrees {
        other: usize,
        ours: WeightKey,
        theirs: WeightKey,
    },
    #[error("no rank loads {start}..{end} of dim {dim} (size {size}); the ranks' ranges together must cover 0..{size}")]
    WeightCoverage {
        dim: u32,
        size: u64,
        start: u64,
        end: u64,
    },

    // Collectives.
    #[error("issues {} as collective #{position}, but rank {other} issues {}; every rank must issue the same collectives (kind, size) in the same order", issued(ours), issued(theirs))]
    CollectiveOrder {
        position: usize,
        other: usize,
        ours: Option<Issued>,
        theirs: Option<Issued>,
    },
    #[error("lists {kind} %{id}, but rank 0 issues {} at this position; the list must follow rank 0's program", issued(actual))]
    CollectiveListed {
        id: u32,
        kind: String,
        actual: Option<Issued>,
    },
    #[error("rank 0 issues {issued} as collective #{position}, but plan.collectives has no entry for it")]
    CollectiveUnlisted { position: usize, issued: Issued },
    #[error("lists {field} = {listed}, but the facts give {}", expected.map_or_else(|| "an overflowing size".to_string(), |e| e.to_string()))]
    CollectiveSize {
        field: &'static str,
        listed: u64,
        expected: Option<u64>,
    },
    #[error("is named `{listed}` but instruction %{id} is `{actual}`")]
    CollectiveName {
        id: u32,
        listed: String,
        actual: String,
    },

    // Fused products.
    #[error("--numerics invariant: {0}")]
    Numerics(String),
    #[error("fused product #{index}: {problem}")]
    Fused {
        index: usize,
        problem: super::fuse::FuseProblem,
    },
    #[error("norm fused with its all-reduce: {0}")]
    ReduceNorm(super::fuse_norm::ReduceNormProblem),
}
