//! Which collectives a weight's split causes: from each op reading the weight, follow its
//! output forward while it keeps the same kind of layout (split values until a linear
//! closes the region, partial sums until something reduces them); every collective met on
//! the way is the weight's doing.

use super::Caused;
use crate::ir::{Graph, Layout, NodeId, Op};
use crate::plan::Plan;
use rustc_hash::FxHashSet as HashSet;
use std::collections::BTreeMap;

fn same_kind(a: Layout, b: Layout) -> bool {
    matches!(
        (a, b),
        (Layout::Split { .. }, Layout::Split { .. }) | (Layout::Partial, Layout::Partial)
    )
}

/// The collective nodes `weight`'s split leads to, in program order. A whole weight causes
/// none: what its op's output is comes from the activation.
fn collectives_of(graph: &Graph, weight: NodeId) -> Vec<NodeId> {
    let mut found = Vec::new();
    if !matches!(graph.layout(weight), Layout::Split { .. }) {
        return found;
    }
    let mut seen: HashSet<NodeId> = HashSet::default();
    let mut stack: Vec<NodeId> = graph.users(weight).into_iter().map(|(u, _)| u).collect();
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        if graph.node(n).op.is_collective() {
            found.push(n);
            continue;
        }
        let here = graph.layout(n);
        for (u, _) in graph.users(n) {
            if graph.node(u).op.is_collective() || same_kind(here, graph.layout(u)) {
                stack.push(u);
            }
        }
    }
    found.sort_by_key(|&n| graph.node(n).order);
    found.dedup();
    found
}

/// For each weight, the collectives its split causes (one each; the caller counts groups),
/// with bytes per token from the plan and the other weights that cause the same one.
pub fn by_weight(graph: &Graph, weights: &[NodeId], plan: &Plan) -> BTreeMap<NodeId, Vec<Caused>> {
    let by_name: BTreeMap<&str, &crate::plan::Collective> = plan
        .collectives
        .iter()
        .map(|c| (c.name.as_str(), c))
        .collect();
    let found: Vec<(NodeId, Vec<NodeId>)> = weights
        .iter()
        .map(|&w| (w, collectives_of(graph, w)))
        .collect();
    let mut causers: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for (w, cs) in &found {
        for &c in cs {
            causers.entry(c).or_default().push(*w);
        }
    }
    let tensor = |w: NodeId| match &graph.node(w).op {
        Op::Param(p) => p.tensor.to_string(),
        _ => graph.node(w).name.to_string(),
    };
    found
        .into_iter()
        .map(|(w, cs)| {
            let caused = cs
                .into_iter()
                // A collective the partitioner dropped (dead code) costs nothing.
                .filter_map(|c| {
                    let name = graph.node(c).name.to_string();
                    let entry = by_name.get(name.as_str())?;
                    Some(Caused {
                        kind: entry.kind.clone(),
                        values: vec![name.clone()],
                        value: name,
                        bytes_per_token: entry.bytes_per_token,
                        count: 1,
                        shared_with: causers[&c]
                            .iter()
                            .filter(|&&o| o != w)
                            .map(|&o| tensor(o))
                            .collect(),
                    })
                })
                .collect();
            (w, caused)
        })
        .collect()
}
