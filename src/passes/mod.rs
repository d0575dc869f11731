//! Sharding passes, run in order by one pass manager that verifies the graph after each.

pub mod decision;
pub mod feasibility;
pub mod fuse_norm;
pub mod insert_collectives;
pub mod invariant;
pub mod overrides;
pub mod partial_check;
pub mod propagate;
pub mod regions;
pub mod reshard;
pub mod rules;
pub mod sequence_parallel;

use crate::error::{Result, TpcError};
use crate::frontend::TpWord;
use crate::ir::verify::verify;
use crate::ir::{Deal, Graph, Layout, NodeId, NumericsMode, TpShares};
pub use decision::{Decision, Reason};
pub use regions::Region;
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeMap;

/// What passes share besides the graph (side tables keyed by node id).
#[derive(Debug, Default)]
pub struct ShardCtx {
    pub tp: u64,
    /// Override words by weight node.
    pub overrides: HashMap<NodeId, TpWord>,
    /// Layout each (consumer, input slot) needs; filled by propagation, consumed by
    /// collective insertion.
    pub required: HashMap<(NodeId, u32), Layout>,
    /// Column→row regions.
    pub regions: Vec<Region>,
    /// Why each weight has its layout; filled by propagation, read by `tpc explain`.
    pub decisions: HashMap<NodeId, Decision>,
    /// Things a user should know about this plan (kv replication, vocab padding).
    pub notes: Vec<String>,
    /// Hold the residual stream split by tokens between blocks (`--sequence-parallel`).
    pub sequence_parallel: bool,
    /// Fuse all-reduces into the RMSNorm that reads them (`--fuse-norm`).
    pub fuse_norm: bool,
    /// How the plan's sums are ordered (`--numerics`).
    pub numerics: NumericsMode,
    /// Each rank's share of every split dimension (`--tp-shares`); `None`: even.
    pub shares: Option<TpShares>,
    /// The quantization blocks a plain dimension is dealt in (`ir::quant::graph_split_block`;
    /// 0 or 1: none).
    pub block: u64,
}

impl ShardCtx {
    /// How every split dimension is dealt over the ranks.
    pub fn deal(&self) -> Deal {
        Deal::by(self.tp, self.shares).in_blocks(self.block)
    }

    fn cycle_error(&self) -> TpcError {
        TpcError::Verify {
            pass: "topological order",
            problems: vec![],
        }
    }
}

pub type Pass = fn(&mut Graph, &mut ShardCtx) -> Result<()>;

/// The sharding pipeline, in order.
pub const PIPELINE: &[(&str, Pass)] = &[
    ("assign_layouts", propagate::assign_layouts),
    ("check_feasibility", feasibility::check_feasibility),
    ("mark_exact_linears", invariant::mark_exact_linears),
    ("insert_collectives", insert_collectives::insert_collectives),
    (
        "check_gathers_join_disjoint_pieces",
        feasibility::check_gathers_join_disjoint_pieces,
    ),
    ("check_partials", partial_check::check_partials),
    ("find_regions", regions::find_regions),
    ("split_sequence", sequence_parallel::split_sequence),
    ("fuse_reduce_norm", fuse_norm::fuse_reduce_norm),
];

/// Runs passes in order, verifying after each; a pass that leaves a broken graph is named.
pub fn run_passes(
    graph: &mut Graph,
    ctx: &mut ShardCtx,
    passes: &[(&'static str, Pass)],
) -> Result<()> {
    verify(graph).map_err(|problems| TpcError::Verify {
        pass: "frontend",
        problems,
    })?;
    for &(name, pass) in passes {
        pass(graph, ctx)?;
        verify(graph).map_err(|problems| TpcError::Verify {
            pass: name,
            problems,
        })?;
    }
    Ok(())
}

/// A sharded graph with its side tables.
#[derive(Debug)]
pub struct Sharded {
    pub graph: Graph,
    pub ctx: ShardCtx,
}

/// Choices a user makes about the sharding beyond tp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardOptions {
    pub sequence_parallel: bool,
    pub fuse_norm: bool,
    pub numerics: NumericsMode,
    /// Each rank's share of every split dimension (`--tp-shares`); `None`: even.
    pub shares: Option<TpShares>,
    /// How mixture-of-experts layers are split (`--moe`); `None`: as the model says.
    pub moe: Option<crate::ir::ExpertSplit>,
}

/// A model definition's graph sharded for `tp` ranks with the model's overrides and the
/// `forced` ones (where the plan's builder starts, and the passes' tests with it).
pub fn shard_model(
    def: &crate::frontend::ModelDef,
    tp: u64,
    forced: &BTreeMap<String, TpWord>,
    options: ShardOptions,
) -> Result<Sharded> {
    shard_with(
        crate::frontend::to_graph(def)?,
        tp,
        &def.tp_plan(),
        forced,
        options,
    )
}

/// Shards `graph` for `tp` ranks with the model's overrides.
pub fn shard(graph: Graph, tp: u64, tp_plan: &BTreeMap<String, TpWord>) -> Result<Sharded> {
    shard_with(
        graph,
        tp,
        tp_plan,
        &BTreeMap::new(),
        ShardOptions::default(),
    )
}

/// [`shard`] with options, and with `forced` overrides that win over the model's where both
/// name a weight (`tpc explain` asks what another split of one weight would cost).
pub fn shard_with(
    mut graph: Graph,
    tp: u64,
    tp_plan: &BTreeMap<String, TpWord>,
    forced: &BTreeMap<String, TpWord>,
    options: ShardOptions,
) -> Result<Sharded> {
    if tp == 0 {
        return Err(TpcError::ZeroTp { tp });
    }
    if let Some(shares) = options.shares {
        if shares.tp() != tp {
            return Err(TpcError::SharesCount {
                shares: shares.to_string(),
                count: shares.tp(),
                tp,
            });
        }
    }
    let mut overrides = overrides::resolve_overrides(&graph, tp_plan)?;
    overrides.extend(overrides::resolve_overrides(&graph, forced)?);
    let mut ctx = ShardCtx {
        tp,
        overrides,
        sequence_parallel: options.sequence_parallel,
        fuse_norm: options.fuse_norm,
        numerics: options.numerics,
        shares: options.shares,
        block: crate::ir::quant::graph_split_block(&graph),
        ..Default::default()
    };
    run_passes(&mut graph, &mut ctx, PIPELINE)?;
    Ok(Sharded { graph, ctx })
}
