//! The whole compiler: model definition → sharded graph → plan.

use crate::error::{Result, TpcError};
use crate::frontend::TpWord;
use crate::frontend::{to_graph, ModelDef};
use crate::passes::feasibility::MAX_TP;
use crate::passes::{shard_with, ShardOptions, Sharded};
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
    let graph = to_graph(def)?;
    let sharded = shard_with(graph, tp, &def.tp_plan(), forced, options)?;
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

/// Splits a compiled plan's layers into `pp` pipeline stages (`layers`: the count of each,
/// else balanced by cost); `pp = 1` without `layers` leaves the plan as it is.
pub fn split_stages(plan: &mut Plan, pp: u64, layers: Option<&[u64]>) -> Result<()> {
    if pp == 1 && layers.is_none() {
        plan.pipeline = None;
        return Ok(());
    }
    let pipeline = crate::plan::stages::split(plan, pp, layers)?;
    plan.pipeline = (pipeline.stages.len() > 1).then_some(pipeline);
    // The derived stage programs must hold together (no value read before a stage has it).
    if let Err(e) = crate::plan::stages::rank0_stages(plan) {
        plan.pipeline = None;
        return Err(e.into());
    }
    Ok(())
}
