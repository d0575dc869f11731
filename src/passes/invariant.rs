//! Invariant numerics (`--numerics invariant`): which linears add their depth exactly, and
//! in which blocks (`ir::numerics`, `runtime::exact`).
//!
//! A linear whose depth a tp splits (a row-parallel one) leaves each rank a partial sum.
//! For its value to be the same bits at every tp, it is summed in blocks that every valid
//! tp's split boundary falls on, and the blocks are added exactly, at tp 1 too. Which
//! linears those are does not depend on the tp (layouts follow the model's structure), so
//! they are found by sharding the graph for a nominal tp of 2, whatever the plan's tp.

use super::feasibility::split_dims;
use super::propagate::assign_layouts;
use super::ShardCtx;
use crate::error::{Result, TpcError};
use crate::ir::numerics::MAX_INVARIANT_RANKS as MAX_RANKS;
use crate::ir::saturating::gcd;
use crate::ir::{ExactBlocks, Graph, Layout, NumericsMode, Op};

/// Largest block the kernels take without losing their cache blocking; a block above it
/// is cut into equal parts (any finer cut keeps every split boundary).
const MAX_BLOCK: u64 = 256;

/// `block` cut into the largest equal parts of at most `MAX_BLOCK` (kept whole when only
/// tiny parts divide it).
fn refine(block: u64) -> u64 {
    if block <= MAX_BLOCK {
        return block;
    }
    match (32..=MAX_BLOCK).rev().find(|d| block.is_multiple_of(*d)) {
        Some(d) => d,
        None => block,
    }
}

/// Records `LinearOp::exact` on every linear a valid tp splits by rows (plans of every tp
/// record the same blocks), and checks that the plan's own partial sums are among them.
pub fn mark_exact_linears(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    if ctx.numerics != NumericsMode::Invariant {
        return Ok(());
    }
    if ctx.tp > MAX_RANKS {
        return Err(TpcError::Numerics {
            problem: format!(
                "tp {} is more ranks than its exact sums hold ({MAX_RANKS}); choose tp ≤ {MAX_RANKS} or --numerics fast",
                ctx.tp
            ),
        });
    }
    let mut nominal = graph.clone();
    let mut nominal_ctx = ShardCtx {
        tp: 2,
        overrides: ctx.overrides.clone(),
        numerics: ctx.numerics,
        block: ctx.block,
        ..Default::default()
    };
    assign_layouts(&mut nominal, &mut nominal_ctx)?;
    let dims = split_dims(&nominal, nominal_ctx.block);
    let valid: Vec<u64> = (2..=MAX_RANKS)
        .filter(|&t| dims.iter().all(|(_, d)| d.fits(t)))
        .collect();
    // Each row-split linear's depth and its split structure.
    let mut linears = Vec::new();
    for id in nominal.g.node_indices() {
        if !matches!(nominal.node(id).op, Op::Linear(_)) || nominal.layout(id) != Layout::Partial {
            continue;
        }
        let weight = nominal.inputs(id)[1];
        let (Op::Linear(l), Op::Param(p)) = (&nominal.node(id).op, &nominal.node(weight).op) else {
            continue;
        };
        let in_dim = l.weight_order.in_dim();
        let Some(&depth) = p.shape.get(in_dim as usize) else {
            continue;
        };
        linears.push((id, depth, p.groups_of(in_dim)));
    }
    // The blocks come from the tps that are powers of two; any other valid tp is covered
    // when its boundaries fall on those blocks (uneven tps do, by their atoms), else left
    // out rather than shrink every tp's blocks (TinyLlama's even tp 11 would cut them to 16).
    let cuts_dealt = |depth: u64, groups: &crate::ir::Groups, deal: crate::ir::Deal| {
        (0..deal.tp)
            .filter_map(|r| groups.slice_dealt(depth, deal, r).ok())
            .flat_map(|s| s.ranges)
            .fold(0, |g, range| gcd(g, gcd(range.offset, range.len)))
    };
    let cuts = |depth: u64, groups: &crate::ir::Groups, t: u64| {
        cuts_dealt(depth, groups, crate::ir::Deal::even(t).in_blocks(ctx.block))
    };
    let blocks: Vec<u64> = linears
        .iter()
        .map(|(_, depth, groups)| {
            valid
                .iter()
                .filter(|t| t.is_power_of_two())
                .fold(*depth, |b, &t| gcd(b, cuts(*depth, groups, t)))
        })
        .collect();
    let covers = |t: u64| {
        linears
            .iter()
            .zip(&blocks)
            .all(|((_, depth, groups), &b)| cuts(*depth, groups, t) % b.max(1) == 0)
    };
    let covered: Vec<u64> = valid.iter().copied().filter(|&t| covers(t)).collect();
    let deal = ctx.deal();
    if let Some(shares) = deal.shares {
        let on_blocks = linears
            .iter()
            .zip(&blocks)
            .all(|((_, depth, groups), &b)| cuts_dealt(*depth, groups, deal) % b.max(1) == 0);
        if !on_blocks {
            return Err(TpcError::Numerics {
                problem: format!(
                    "--tp-shares {shares} cuts a row-parallel linear off the blocks that the exact sums of every tp keep; choose other shares, no shares, or --numerics fast"
                ),
            });
        }
    }
    if ctx.tp > 1 && !covered.contains(&ctx.tp) {
        let list: Vec<String> = std::iter::once(1)
            .chain(covered.iter().copied())
            .map(|t| t.to_string())
            .collect();
        return Err(TpcError::Numerics {
            problem: format!(
                "tp {} splits a row-parallel linear off the blocks that the other tps' exact sums keep; --numerics invariant covers tp {} for this model: choose one of those or --numerics fast",
                ctx.tp,
                list.join(", ")
            ),
        });
    }
    let mut marked = 0;
    for ((id, depth, _), block) in linears.into_iter().zip(blocks) {
        let block = refine(block.max(1));
        if let Op::Linear(l) = &mut graph.node_mut(id).op {
            l.exact = Some(ExactBlocks {
                block,
                blocks: depth / block,
            });
            marked += 1;
        }
    }
    let unmarked: Vec<String> = graph
        .g
        .node_indices()
        .filter(|&id| graph.layout(id) == Layout::Partial)
        .filter(|&id| matches!(&graph.node(id).op, Op::Linear(l) if l.exact.is_none()))
        .map(|id| format!("`{}`", graph.node(id).name))
        .collect();
    if !unmarked.is_empty() {
        return Err(TpcError::Numerics {
            problem: format!(
                "at tp {} {} end in partial sums that a tp of 2 does not split; their sums would differ between tps (a tpc bug: report it with the model)",
                ctx.tp,
                unmarked.join(", ")
            ),
        });
    }
    ctx.notes.push(format!(
        "invariant numerics: {marked} linears that a tp splits by rows add their depth blocks exactly; partial sums are reduced before any other op reads them; every sum's order is fixed by the model, the same at every tp ≤ {MAX_RANKS} and batch"
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_above_the_limit_are_cut_into_equal_parts() {
        assert_eq!(refine(176), 176);
        assert_eq!(refine(2816), 256);
        assert_eq!(refine(528), 176);
        assert_eq!(refine(512), 256);
        assert_eq!(refine(1009), 1009);
        assert_eq!(gcd(0, 12), 12);
    }
}
