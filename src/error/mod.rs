//! The compiler's errors, one type per layer: [`TpcError`] (frontend, passes, files),
//! [`PlanError`] (a plan that does not hold together), [`StageError`] (pipeline stages).
//! They sit below every layer that returns them, so the layers form a one-way chain. Each
//! message names the place and says what would be right. The runtime has its own type,
//! `runtime::error::RunError`.

pub mod fuse;
pub mod fuse_norm;
pub mod plan;
pub mod provenance;
pub mod stage;

pub use plan::{PlanError, PlanProblem};
pub use provenance::ProvenanceError;
pub use stage::StageError;

use crate::ir::verify::Problem;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TpcError {
    // `io` is printed in the message and deliberately not a `source`, so `{:#}` chains
    // do not print it twice.
    #[error("cannot read `{path}`: {io}. Check that the path exists and is readable.")]
    Read { path: PathBuf, io: std::io::Error },

    #[error("cannot write `{path}`: {io}. Check that the directory exists and is writable.")]
    Write { path: PathBuf, io: std::io::Error },

    #[error("{what} `{path}`: refused, {reason}.")]
    Output {
        what: String,
        path: PathBuf,
        reason: String,
    },

    #[error("{path}:{line}:{column}: {message}. Fix the {format} syntax at that position.")]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        format: &'static str,
        message: String,
    },

    #[error("`{path}` is not a model tpc can read: {reason}. Give a .ron model definition, a Hugging Face model directory with config.json, or a config.json path.")]
    UnknownInput { path: PathBuf, reason: String },

    #[error("{path}: {message}")]
    HfConfig { path: PathBuf, message: String },

    #[error("hardware profile `{path}`: {message}; fix the profile")]
    HwProfile { path: PathBuf, message: String },

    #[error("`{given}` is neither a hardware profile file nor the name of one tpc ships. Shipped profiles (models/hw/): {}. Give one of those names or the path of a profile (RON, e.g. one `tpc calibrate -o host.ron` wrote).", names.join(", "))]
    UnknownHwProfile { given: PathBuf, names: Vec<String> },

    #[error("model `{model}`, {place}: {message}")]
    Model {
        model: String,
        place: String,
        message: String,
    },

    #[error("pass `{pass}` produced an invalid graph ({} problem(s)):\n{}", problems.len(), problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Verify {
        pass: &'static str,
        problems: Vec<Problem>,
    },

    #[error(transparent)]
    Stages(#[from] StageError),

    #[error("pass `{pass}` did not settle within {limit} rounds; this is a bug in tpc, please report it with the model file.")]
    NoFixpoint { pass: &'static str, limit: usize },

    #[error("{model} cannot be split {tp} ways: {}. Valid tp values for this model: {}.", reasons.join("; "), fmt_list(valid))]
    Infeasible {
        model: String,
        tp: u64,
        reasons: Vec<String>,
        valid: Vec<u64>,
    },

    #[error("tp must be at least 1, got {tp}.")]
    ZeroTp { tp: u64 },

    #[error("{model} cannot take --tp-shares {shares}: {problem}")]
    SharesUnsupported {
        model: String,
        shares: String,
        problem: String,
    },

    #[error("--tp-shares {shares} names {count} ranks but tp is {tp}; give one share per rank, e.g. --tp {tp} with {tp} shares.")]
    SharesCount { shares: String, count: u64, tp: u64 },

    #[error("tp={tp} is more than tpc plans for: at most {max} ranks share one tensor-parallel group (each rank gets its own program, and no interconnect makes a wider group pay off). Use a tp of {max} or less.")]
    TpTooLarge { tp: u64, max: u64 },

    #[error("tp_plan override `{pattern}: {word}` is wrong: {reason}")]
    BadOverride {
        pattern: String,
        word: &'static str,
        reason: String,
    },

    #[error("partial sums reach ops that are not linear in them: {}. This is a sharding-rule bug in tpc.", places.join("; "))]
    PartialMisuse { places: Vec<String> },

    #[error("--numerics invariant: {problem}")]
    Numerics { problem: String },

    #[error("`{path}` is a plan for format version {found}, this tpc reads version {expected}. Recompile the model with this tpc.")]
    PlanVersion {
        path: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error(transparent)]
    Plan(#[from] PlanError),

    // Boxed: its messages carry whole plan places, and every `Result` pays for the
    // largest variant.
    #[error(transparent)]
    Provenance(Box<ProvenanceError>),

    #[error("cannot serialize the plan: {0}")]
    Serialize(String),

    #[error("no weight of {model} matches `{pattern}`; a pattern is a substring of the checkpoint name, or a glob where `*` matches any characters. Weights are named like {}.", examples.iter().map(|e| format!("`{e}`")).collect::<Vec<_>>().join(", "))]
    NoWeightMatches {
        model: String,
        pattern: String,
        examples: Vec<String>,
    },
}

impl From<ProvenanceError> for TpcError {
    fn from(e: ProvenanceError) -> TpcError {
        TpcError::Provenance(Box::new(e))
    }
}

fn fmt_list(v: &[u64]) -> String {
    if v.is_empty() {
        return "none up to 1024".into();
    }
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

pub type Result<T, E = TpcError> = std::result::Result<T, E>;
