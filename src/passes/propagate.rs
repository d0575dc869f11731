//! Layout propagation and plan choice: one generic forward walk that asks each op's rule
//! what it needs, places undecided weights as the rule prefers (or as an override says),
//! and records every input whose layout must change.

use super::decision::{split_chain, Decision, Reason};
use super::rules::rule_with_reason;
use super::ShardCtx;
use crate::error::Result;
use crate::ir::{Graph, Layout, NodeId, NumericsMode, Op};
use rustc_hash::FxHashSet as HashSet;

/// Gives every node a layout and fills `ctx.required` with the layout each input slot
/// needs. With tp = 1 everything is replicated and nothing needs to change.
pub fn assign_layouts(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    let order = graph.topo_order().map_err(|_| ctx.cycle_error())?;
    ctx.required.clear();
    ctx.decisions.clear();
    for n in graph.g.node_weights_mut() {
        n.layout = None;
    }
    if ctx.tp == 1 {
        for &id in &order {
            graph.node_mut(id).layout = Some(Layout::Replicated);
            for (slot, &input) in graph.inputs(id).iter().enumerate() {
                ctx.required.insert((id, slot as u32), Layout::Replicated);
                if matches!(graph.node(input).op, Op::Param(_)) {
                    ctx.decisions.entry(input).or_insert(Decision {
                        reason: Reason::SingleRank,
                        consumer: id,
                        chain: vec![],
                        openers: vec![],
                    });
                }
            }
        }
        return Ok(());
    }
    // Partial values some earlier consumer already needs whole: later consumers read the
    // reduced copy, so the residual stream stays whole as in Megatron.
    let mut reduced: HashSet<NodeId> = HashSet::default();
    for &id in &order {
        if matches!(graph.node(id).op, Op::Param(_)) {
            continue;
        }
        let inputs = graph.inputs(id);
        let given: Vec<Option<Layout>> = inputs
            .iter()
            .map(|&i| match graph.node(i).layout {
                // Invariant numerics reduce every partial sum before anything reads it: an
                // op applied to a rank's part would round differently at each tp.
                Some(Layout::Partial)
                    if reduced.contains(&i) || ctx.numerics == NumericsMode::Invariant =>
                {
                    Some(Layout::Replicated)
                }
                other => other,
            })
            .collect();
        let ranks: Vec<usize> = inputs
            .iter()
            .map(|&i| graph.node(i).fact.shape.rank())
            .collect();
        let word = inputs.iter().find_map(|i| ctx.overrides.get(i).copied());
        let (choice, placed) = rule_with_reason(&graph.node(id).op, &given, &ranks, word);
        for (slot, (&input, &need)) in inputs.iter().zip(&choice.inputs).enumerate() {
            if graph.node(input).layout.is_none() {
                let reason = match placed {
                    Some((w, why)) if w == slot => why,
                    _ => Reason::Follows,
                };
                let decision = decide(graph, id, &inputs, reason);
                ctx.decisions.insert(input, decision);
            }
            let producer = graph.node_mut(input);
            if producer.layout.is_none() {
                // An undecided weight takes the layout its first consumer needs.
                producer.layout = Some(need);
            }
            if producer.layout == Some(Layout::Partial) && need == Layout::Replicated {
                reduced.insert(input);
            }
            ctx.required.insert((id, slot as u32), need);
        }
        graph.node_mut(id).layout = Some(choice.output);
    }
    for n in graph.g.node_weights_mut() {
        n.layout.get_or_insert(Layout::Replicated);
    }
    Ok(())
}

/// The decision record for a weight that `consumer` places: the chain behind the
/// consumer's activation (its first input that is not a weight).
fn decide(graph: &Graph, consumer: NodeId, inputs: &[NodeId], reason: Reason) -> Decision {
    let activation = inputs
        .iter()
        .copied()
        .find(|&i| !matches!(graph.node(i).op, Op::Param(_)));
    let (chain, openers) = match activation {
        Some(x) => split_chain(graph, x),
        None => (vec![], vec![]),
    };
    Decision {
        reason,
        consumer,
        chain,
        openers,
    }
}
