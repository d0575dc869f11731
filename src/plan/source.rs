//! What a plan was compiled from, recorded in the plan: the model as the compiler read it and
//! every choice that shaped the plan. With it a loaded plan can be compiled again and
//! compared field by field (`tpc::provenance`), and a checkpoint whose config differs from
//! the model the plan was made for can be named by the field that differs.

use crate::frontend::{ModelDef, TpWord};
use crate::ir::{AlgorithmChoice, NumericsMode, TpShares};
use crate::passes::ShardOptions;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanSource {
    /// The model definition the compiler read (a preset's fields as `config.json` gave
    /// them, or an explicit graph).
    pub model: ModelDef,
    /// Sequence parallelism, as decided (a cost-model `auto` is recorded as its outcome).
    pub sequence_parallel: bool,
    /// The all-reduce fused with the residual add and RMSNorm.
    pub fuse_norm: bool,
    /// How the plan's sums are ordered (absent: fast).
    #[serde(default, skip_serializing_if = "NumericsMode::is_fast")]
    pub numerics: NumericsMode,
    /// `tp_plan` overrides that won over the model's own (`tpc explain`'s what-ifs).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub forced: BTreeMap<String, TpWord>,
    /// The all-reduce algorithms chosen for a hardware profile (`compile --hw`), applied to
    /// every all-reduce of the plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithms: Option<AlgorithmChoice>,
    /// Each rank's share of the split dimensions (`--tp-shares`); absent: even.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<TpShares>,
}

impl PlanSource {
    pub fn options(&self) -> ShardOptions {
        ShardOptions {
            sequence_parallel: self.sequence_parallel,
            fuse_norm: self.fuse_norm,
            numerics: self.numerics,
            shares: self.shares,
            // The model recorded has the split applied already.
            moe: None,
        }
    }
}
