//! Column→row pairs: the linears whose split outputs reach a row-split linear through
//! split-preserving ops only. Between them no communication happens; the report counts
//! them and the picture boxes them.

use super::ShardCtx;
use crate::error::Result;
use crate::ir::{Graph, Layout, NodeId, Op};
use std::collections::BTreeMap;

/// One column→row region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Region {
    /// Column-split linears that open the region.
    pub columns: Vec<NodeId>,
    /// Row-split linears that close it with partial sums.
    pub rows: Vec<NodeId>,
    /// Every node inside, columns and rows included.
    pub members: Vec<NodeId>,
    pub layer: Option<u32>,
}

fn weight_layout(graph: &Graph, linear: NodeId) -> Option<Layout> {
    graph.inputs(linear).get(1).map(|&w| graph.layout(w))
}

fn is_split(l: Layout) -> bool {
    matches!(l, Layout::Split { .. })
}

pub fn find_regions(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    ctx.regions.clear();
    let order = graph.topo_order().map_err(|_| ctx.cycle_error())?;
    let mut region_of: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut regions: Vec<Region> = Vec::new();
    for &id in &order {
        let node = graph.node(id);
        let closes = matches!(node.op, Op::Linear(_)) && node.layout == Some(Layout::Partial);
        if !closes || !weight_layout(graph, id).is_some_and(is_split) {
            continue;
        }
        // Walk back through split activations to the column linears.
        let mut region = Region {
            layer: node.layer,
            rows: vec![id],
            ..Default::default()
        };
        let mut stack = vec![graph.inputs(id)[0]];
        let mut seen = vec![id];
        while let Some(n) = stack.pop() {
            if seen.contains(&n) || !is_split(graph.layout(n)) {
                continue;
            }
            seen.push(n);
            match &graph.node(n).op {
                Op::Param(_) | Op::Input(_) => continue,
                Op::Linear(_) => {
                    region.columns.push(n);
                    continue;
                }
                _ => {}
            }
            stack.extend(graph.inputs(n));
        }
        if region.columns.is_empty() {
            continue;
        }
        seen.retain(|n| !matches!(graph.node(*n).op, Op::Param(_)));
        region.members = seen;
        // Regions that share a node (e.g. two row linears reading one split value) merge.
        let target = region
            .members
            .iter()
            .find_map(|m| region_of.get(m).copied());
        let idx = match target {
            Some(i) => {
                let r = &mut regions[i];
                r.columns.extend(region.columns);
                r.rows.extend(region.rows);
                r.members.extend(region.members);
                r.columns.dedup();
                r.members.sort_by_key(|m| graph.node(*m).order);
                r.members.dedup();
                i
            }
            None => {
                regions.push(region);
                regions.len() - 1
            }
        };
        for &m in &regions[idx].members {
            region_of.insert(m, idx);
        }
    }
    for r in &mut regions {
        r.members.sort_by_key(|m| graph.node(*m).order);
        r.columns.sort_by_key(|m| graph.node(*m).order);
    }
    ctx.regions = regions;
    Ok(())
}
