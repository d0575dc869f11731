//! Why a saved plan is refused before it runs: it is not what tpc compiles from the model
//! and choices it records, or the checkpoint is another model than the one it records.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProvenanceError {
    #[error("the plan `{}` was compiled from another model than this checkpoint's{}: what they compute differs first at {}. A plan computes the model it was compiled from: compile a plan from this checkpoint (`tpc compile MODEL_DIR --tp {tp} -o PLAN`) or run the checkpoint the plan was made for.", path.display(), list_fields(fields), difference.place)]
    OtherModel {
        path: PathBuf,
        tp: u64,
        /// "`rope_theta`: 10000 in the plan's model, 500000 in the checkpoint's", ...
        fields: Vec<String>,
        /// The first place where the two models' plans differ.
        difference: PlanDifference,
    },

    #[error("the plan `{}` is not what tpc compiles from the model and options it records (it was edited, or written by a tpc that compiled differently): {difference}. Recompile it with `tpc compile`; to split a weight differently, give the model a `tp_plan` override, which the compiler records and honours. `tpc verify --plan` checks an edited plan by computing.", path.display())]
    Edited {
        path: PathBuf,
        difference: PlanDifference,
    },

    #[error("the plan `{}` cannot be checked against this checkpoint: its config.json is not a model tpc reads, and the plan is not an explicit graph's (`tpc compile graph.ron -o PLAN` records the graph, which is then what the plan is checked against).", path.display())]
    Unchecked { path: PathBuf },

    #[error("the plan `{}` does not record what it was compiled from (an older tpc or a hand-written plan), and it is not what tpc compiles for this checkpoint at tp={tp} with any sharding option: {difference}. Recompile it with `tpc compile`; `tpc verify --plan` checks such a plan by computing.", path.display())]
    Unrecorded {
        path: PathBuf,
        tp: u64,
        difference: PlanDifference,
    },
}

/// " (config.json differs in `rope_theta`: ...; `eps`: ...)", or nothing.
fn list_fields(fields: &[String]) -> String {
    if fields.is_empty() {
        String::new()
    } else {
        format!(" (its config differs in {})", fields.join("; "))
    }
}

/// Where two plans first differ and what each has there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanDifference {
    /// "rank 1, weight `lm_head.weight`, field `ranges[0].start`".
    pub place: String,
    /// The value in the plan being checked (`absent` when it lacks the field).
    pub found: String,
    /// The value in the reference plan.
    pub expected: String,
}

impl fmt::Display for PlanDifference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: the plan has {}, compiling gives {}",
            self.place, self.found, self.expected
        )
    }
}
