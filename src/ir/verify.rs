//! The verifier: checks the whole graph and collects every problem with its node.

use super::graph::Graph;
use super::graph::NodeId;
use super::layout::Layout;
use super::shape::infer;
use super::tensor::TensorFact;
use petgraph::visit::EdgeRef;
use rustc_hash::FxHashSet as HashSet;
use smallvec::SmallVec;
use std::fmt;

/// One problem found by the verifier, at a named node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub node: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at node `{}`: {}", self.node, self.message)
    }
}

/// Checks structure, arity, shapes against inference, unique names, and (once layouts
/// are assigned) that every layout fits its value and every collective converts the layout
/// it says it does.
pub fn verify(graph: &Graph) -> Result<(), Vec<Problem>> {
    let mut problems = Vec::new();
    let mut say = |node: &str, message: String| {
        problems.push(Problem {
            node: node.to_string(),
            message,
        })
    };
    if let Err(cycle) = graph.topo_order() {
        let names: Vec<_> = cycle.iter().map(|&n| &*graph.node(n).name).collect();
        say(
            names[0],
            format!("nodes form a cycle: {}", names.join(", ")),
        );
    }
    let mut names = HashSet::with_capacity_and_hasher(graph.g.node_count(), Default::default());
    let any_layout = graph.g.node_weights().any(|n| n.layout.is_some());
    for id in graph.g.node_indices() {
        let node = graph.node(id);
        if !names.insert(&*node.name) {
            say(&node.name, "name is used by more than one node".into());
        }
        let mut edges: SmallVec<[(u32, NodeId); 4]> = graph
            .g
            .edges_directed(id, petgraph::Direction::Incoming)
            .map(|e| (e.weight().slot, e.source()))
            .collect();
        edges.sort_unstable();
        if edges
            .iter()
            .enumerate()
            .any(|(i, (slot, _))| *slot != i as u32)
        {
            let slots: Vec<u32> = edges.iter().map(|e| e.0).collect();
            say(&node.name, format!("input slots {slots:?} are not 0..n"));
            continue;
        }
        let inputs: SmallVec<[NodeId; 4]> = edges.iter().map(|e| e.1).collect();
        let facts: SmallVec<[&TensorFact; 4]> =
            inputs.iter().map(|&i| &graph.node(i).fact).collect();
        match infer(&node.op, &facts, graph.dtype) {
            Ok(f) if f != node.fact => say(
                &node.name,
                format!("recorded fact {} but inference gives {f}", node.fact),
            ),
            Ok(_) => {}
            Err(e) => say(&node.name, e),
        }
        if !any_layout {
            continue;
        }
        let Some(layout) = node.layout else {
            say(&node.name, "has no layout while others do".into());
            continue;
        };
        if let Layout::Split { dim } = layout {
            if dim as usize >= node.fact.shape.rank() {
                say(
                    &node.name,
                    format!("split dim {dim} is outside its shape {}", node.fact.shape),
                );
            }
        }
        let input_layout = inputs.first().map(|&i| graph.layout(i));
        // Collectives and local slices turn the layout the op table says into another.
        if let Some((from, to)) = super::op_dims::dims(&node.op).moves {
            if input_layout != Some(from) || layout != to {
                say(
                    &node.name,
                    format!(
                        "{} must turn {from} into {to}, but turns {} into {layout}",
                        node.op.kind(),
                        input_layout.map(|l| l.to_string()).unwrap_or_default()
                    ),
                );
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::*;

    fn param(g: &mut Graph, name: &str, shape: &[u64]) -> NodeId {
        let op = Op::Param(ParamOp {
            tensor: name.into(),
            shape: shape.to_vec(),
            dtype: None,
            groups: Default::default(),
            quant: None,
        });
        g.add(
            Node {
                name: name.into(),
                op,
                fact: TensorFact {
                    dtype: DType::F32,
                    shape: Shape::fixed(shape),
                },
                layer: None,
                order: 0,
                layout: None,
            },
            &[],
        )
    }

    #[test]
    fn collects_every_problem_with_its_node() {
        let mut g = Graph::new("t", DType::F32);
        let a = param(&mut g, "a", &[4]);
        let b = param(&mut g, "a", &[5]);
        let bad_fact = TensorFact {
            dtype: DType::F32,
            shape: Shape::fixed(&[4]),
        };
        g.add(
            Node {
                name: "sum".into(),
                op: Op::Add(AddOp {}),
                fact: bad_fact,
                layer: None,
                order: 1,
                layout: None,
            },
            &[a, b],
        );
        let problems = verify(&g).unwrap_err();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems
            .iter()
            .any(|p| p.message.contains("more than one node")));
        assert!(problems
            .iter()
            .any(|p| p.node == "sum" && p.message.contains("equal shapes")));
    }
}
