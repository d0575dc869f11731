//! Collective insertion: every input whose producer's layout differs from what the
//! consumer needs gets the reshard table's steps, shared by all consumers that need the
//! same layout of the same value.

use super::reshard::reshard;
use super::ShardCtx;
use crate::error::{Result, TpcError};
use crate::ir::{op_dims, Graph, Layout, Node, NodeId};
use rustc_hash::FxHashMap as HashMap;

pub fn insert_collectives(graph: &mut Graph, ctx: &mut ShardCtx) -> Result<()> {
    let mut wanted: Vec<((NodeId, u32), Layout)> =
        ctx.required.iter().map(|(&k, &v)| (k, v)).collect();
    wanted.sort_unstable_by_key(|&((n, s), _)| (graph.node(n).order, s));
    let mut cache: HashMap<(NodeId, Layout), NodeId> = HashMap::default();
    let mut inserted_after: HashMap<NodeId, u64> = HashMap::default();
    for ((consumer, slot), need) in wanted {
        let producer = graph.inputs(consumer)[slot as usize];
        let from = graph.layout(producer);
        let steps = reshard(from, need).ok_or_else(|| TpcError::PartialMisuse {
            places: vec![format!(
                "`{}` needs `{}` as {need} but it is {from}, and no collective makes that",
                graph.node(consumer).name,
                graph.node(producer).name
            )],
        })?;
        let mut current = producer;
        for step in steps {
            // What the step makes of its input, from the op table.
            let Some((_, to)) = op_dims::dims(&step).moves else {
                return Err(TpcError::PartialMisuse {
                    places: vec![format!(
                        "the reshard table gave `{}` for `{}`, which moves no layout; this is a bug in tpc",
                        step.kind(),
                        graph.node(producer).name
                    )],
                });
            };
            current = match cache.get(&(current, to)) {
                Some(&done) => done,
                None => {
                    let src = graph.node(current).clone();
                    let k = inserted_after.entry(producer).or_insert(0);
                    *k += 1;
                    let node = Node {
                        name: format!("{}.{}", src.name, step.kind()).into(),
                        op: step,
                        fact: src.fact.clone(),
                        layer: src.layer,
                        order: graph.node(producer).order + *k,
                        layout: Some(to),
                    };
                    let id = graph.add(node, &[current]);
                    cache.insert((current, to), id);
                    id
                }
            };
        }
        if current != producer {
            graph.rewire(consumer, slot, current);
        }
    }
    ctx.required.clear();
    Ok(())
}
