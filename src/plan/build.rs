//! The compiler up to its last layer: a model definition → dataflow graph (frontend) →
//! sharded graph (passes) → plan (`partition`), with what the plan records of its source.
//! `crate::pipeline` re-exports these as the crate's entry points.

use crate::error::{Result, TpcError};
use crate::frontend::ModelDef;
use crate::frontend::TpWord;
use crate::passes::feasibility::MAX_TP;
use crate::passes::{shard_model, ShardOptions, Sharded};
use crate::plan::partition::partition;
use crate::plan::source::PlanSource;
use crate::plan::Plan;
use std::collections::BTreeMap;

/// A compiled model: the sharded graph (for pictures) and the plan.
#[derive(Debug)]
pub struct Compiled {
    pub sharded: Sharded,
    pub plan: Plan,
}

/// Compiles a model definition for `tp` ranks.
pub fn compile(def: &ModelDef, tp: u64) -> Result<Compiled> {
    compile_full(def, tp, &BTreeMap::new(), ShardOptions::default())
}

/// [`compile`] with sharding options (sequence parallelism).
pub fn compile_with(def: &ModelDef, tp: u64, options: ShardOptions) -> Result<Compiled> {
    compile_full(def, tp, &BTreeMap::new(), options)
}

/// [`compile`] with extra `tp_plan` overrides that win over the model's own.
pub fn compile_forcing(
    def: &ModelDef,
    tp: u64,
    forced: &BTreeMap<String, TpWord>,
) -> Result<Compiled> {
    compile_full(def, tp, forced, ShardOptions::default())
}

/// [`compile`] with everything a plan's source records: `forced` overrides and options.
pub fn compile_full(
    def: &ModelDef,
    tp: u64,
    forced: &BTreeMap<String, TpWord>,
    options: ShardOptions,
) -> Result<Compiled> {
    // Decided before the graph is built: a hostile tp must not cost memory or time.
    if tp == 0 {
        return Err(TpcError::ZeroTp { tp });
    }
    if tp > MAX_TP {
        return Err(TpcError::TpTooLarge { tp, max: MAX_TP });
    }
    let split;
    let def = match options.moe {
        Some(s) => {
            split = def.with_expert_split(s)?;
            &split
        }
        None => def,
    };
    let sharded = shard_model(def, tp, forced, options)?;
    let mut plan = partition(&sharded)?;
    plan.max_positions = def.max_positions();
    plan.attention_window = def.sliding_window();
    plan.numerics = options.numerics;
    plan.source = Some(PlanSource {
        model: def.clone(),
        sequence_parallel: options.sequence_parallel,
        fuse_norm: options.fuse_norm,
        numerics: options.numerics,
        forced: forced.clone(),
        algorithms: None,
        shares: options.shares.filter(|s| !s.is_even()),
    });
    Ok(Compiled { sharded, plan })
}

/// Shipped models compiled, for the tests of the plan and the layers above it.
#[cfg(test)]
pub(crate) mod shipped {
    use crate::frontend::ModelDef;
    use crate::plan::Plan;
    use std::path::Path;

    /// `models/NAME.ron`.
    pub fn model(name: &str) -> ModelDef {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(format!("{name}.ron"));
        crate::frontend::load::load_model(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// `models/NAME.ron` compiled for `tp` ranks.
    pub fn plan(name: &str, tp: u64) -> Plan {
        super::compile(&model(name), tp)
            .unwrap_or_else(|e| panic!("{name} tp={tp}: {e}"))
            .plan
    }
}
