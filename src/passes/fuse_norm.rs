//! Norm fusion: an all-reduce whose result feeds one RMSNorm becomes part of that norm
//! (`RmsNormOp::reduce_input`), so the reduced value is normalized in the same op. Where the
//! sharding folded the next residual add into a partial sum on rank 0
//! (`add(all_reduce(s), x)` with `x` partial), that add reads the partial `s` instead, on
//! every rank: the sum over ranks is the same (`Σ s + Σ x`), so the residual stream stays a
//! partial sum and is never held whole — the all-reduce + residual add + norm of the
//! Megatron layer become one fused op per site (and one add that every rank runs).

use super::ShardCtx;
use crate::error::Result;
use crate::ir::{Graph, Layout, NodeId, Op};

/// Fuses every eligible all-reduce into the RMSNorm that reads it, when
/// `ctx.fuse_norm` is set (and tp > 1); under `--numerics invariant`, marks the norms that
/// run in one step with their all-reduce instead ([`mark_reduce_norm_steps`]).
pub fn fuse_reduce_norm(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    if !ctx.fuse_norm || ctx.tp == 1 {
        return Ok(());
    }
    if ctx.numerics == crate::ir::NumericsMode::Invariant {
        return mark_reduce_norm_steps(graph, ctx);
    }
    let order = graph.topo_order().map_err(|_| ctx.cycle_error())?;
    let mut fused = 0;
    for reduce in order {
        let Op::AllReduce(all_reduce) = &graph.node(reduce).op else {
            continue;
        };
        let all_reduce = all_reduce.clone();
        let partial = graph.inputs(reduce)[0];
        let users = graph.users(reduce);
        let is_norm = |&(u, slot): &(NodeId, u32)| {
            slot == 0 && matches!(&graph.node(u).op, Op::RmsNorm(n) if n.reduce_input.is_none())
        };
        let norms: Vec<(NodeId, u32)> = users.iter().copied().filter(is_norm).collect();
        let adds: Vec<(NodeId, u32)> = users.iter().copied().filter(|u| !is_norm(u)).collect();
        // A residual add that already yields a partial sum can take the partial value
        // instead of the reduced one; anything else needs the whole value.
        let partial_add = |&(u, slot): &(NodeId, u32)| {
            matches!(graph.node(u).op, Op::Add(_))
                && graph.layout(u) == Layout::Partial
                && graph
                    .inputs(u)
                    .iter()
                    .enumerate()
                    .all(|(s, &i)| s == slot as usize || graph.layout(i) == Layout::Partial)
        };
        let [(norm, _)] = norms[..] else {
            continue;
        };
        if !adds.iter().all(partial_add) {
            continue;
        }
        for (add, slot) in adds {
            graph.rewire(add, slot, partial);
        }
        graph.rewire(norm, 0, partial);
        if let Op::RmsNorm(n) = &mut graph.node_mut(norm).op {
            n.reduce_input = Some(all_reduce);
        }
        graph.g.remove_node(reduce);
        fused += 1;
    }
    if fused > 0 {
        ctx.notes.push(format!(
            "norm fusion: {fused} all-reduces fused into the RMSNorm that reads them; the residual stream stays a partial sum"
        ));
    } else {
        ctx.notes.push(
            "norm fusion asked for, but no all-reduce feeds exactly one RMSNorm; the plan is unchanged"
                .into(),
        );
    }
    Ok(())
}

/// The invariant form of the fusion. Folding the all-reduce into the norm keeps the
/// residual stream as each rank's partial sum, which rounds differently at each tp; here the
/// residual stays whole. A norm that reads an all-reduce, or the residual add of one (the
/// add the all-reduce's only reader, its residual computed before it), is marked
/// `with_reduce`: the runtime does the reduction, the add and the norm in one step that
/// hands on the new residual and the normalized value (`plan::fuse_norm`), with the unfused
/// ops' arithmetic, so the bits do not change.
fn mark_reduce_norm_steps(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    let order = graph.topo_order().map_err(|_| ctx.cycle_error())?;
    let unmarked_norm = |graph: &Graph, (u, slot): (NodeId, u32)| {
        slot == 0
            && matches!(&graph.node(u).op, Op::RmsNorm(n) if n.reduce_input.is_none() && !n.with_reduce)
    };
    let mut marked = 0;
    for reduce in order {
        if !matches!(graph.node(reduce).op, Op::AllReduce(_)) {
            continue;
        }
        let users = graph.users(reduce);
        let norm = match users[..] {
            // all_reduce → add(residual, ·) → norm
            [(add, _)] if matches!(graph.node(add).op, Op::Add(_)) => {
                let inputs = graph.inputs(add);
                let residual_first = inputs.len() == 2
                    && inputs.iter().filter(|&&x| x == reduce).count() == 1
                    && inputs.iter().all(|&x| {
                        x == reduce
                            || petgraph::algo::has_path_connecting(&graph.g, x, reduce, None)
                    });
                let norms: Vec<_> = graph
                    .users(add)
                    .into_iter()
                    .filter(|&u| unmarked_norm(graph, u))
                    .collect();
                match (residual_first, &norms[..]) {
                    (true, &[(norm, _)]) => Some(norm),
                    _ => None,
                }
            }
            // all_reduce → norm (and whatever else reads the reduced value)
            _ => {
                let norms: Vec<_> = users
                    .iter()
                    .copied()
                    .filter(|&u| unmarked_norm(graph, u))
                    .collect();
                match norms[..] {
                    [(norm, _)] => Some(norm),
                    _ => None,
                }
            }
        };
        if let Some(norm) = norm {
            if let Op::RmsNorm(n) = &mut graph.node_mut(norm).op {
                n.with_reduce = true;
                marked += 1;
            }
        }
    }
    ctx.notes.push(if marked > 0 {
        format!(
            "norm fusion (invariant): {marked} RMSNorms run in one step with the all-reduce before them and its residual add; the residual stream stays whole, so the bits are those of the unfused plan"
        )
    } else {
        "norm fusion asked for, but no all-reduce feeds an RMSNorm; the plan is unchanged".into()
    });
    Ok(())
}
