//! Head sizes against the head structure the weights declare, checked on the built graph
//! before sharding. A rope or attention op works on heads of `head_dim`; tensor parallelism
//! splits the value it reads only between the units its weight declares (`Heads(size: S)`,
//! a part of a fused q|k|v), or anywhere in a weight dimension declared plain. An op whose
//! head does not fit those units computes on the whole model yet gets a piece it cannot
//! take on some rank: without this check that surfaced as "pass `partition` produced an
//! invalid graph", which reads as a bug in tpc rather than a mistake in the model.

use crate::error::{Result, TpcError};
use crate::ir::{Graph, Groups, NodeId, Op};

/// Where a value's last dimension comes from, as far as splitting it goes.
enum Unit {
    /// Heads of this many elements, declared by `source` (a weight's dimension, a fused
    /// value's part).
    Heads { size: u64, source: String },
    /// A plain dimension of `weight` (no head structure): a split may cut it anywhere.
    Plain { weight: String, dim: u32, len: u64 },
    /// Not read off a weight (an input, an embedding, a whole fused output): not checked.
    Unknown,
}

/// Every rope and attention op's `head_dim` must divide the heads its inputs are split by.
pub fn check_head_sizes(graph: &Graph) -> Result<()> {
    for id in graph.g.node_indices() {
        let node = graph.node(id);
        let (what, head_dim, inputs) = match &node.op {
            Op::Rope(r) => ("rope", r.head_dim, 1),
            Op::Attention(a) => ("attention", a.head_dim, 3),
            _ => continue,
        };
        for (slot, input) in graph.inputs(id).into_iter().take(inputs).enumerate() {
            let role = match (what, slot) {
                ("attention", 0) => " (its q)",
                ("attention", 1) => " (its k)",
                ("attention", 2) => " (its v)",
                _ => "",
            };
            if let Some(message) = misfit(what, role, head_dim, unit_of(graph, input)) {
                return Err(TpcError::Model {
                    model: graph.name.clone(),
                    place: format!("node `{}`", node.name),
                    message,
                });
            }
        }
    }
    Ok(())
}

/// What is wrong when heads of `head_dim` do not fit `unit`.
fn misfit(what: &str, role: &str, head_dim: u64, unit: Unit) -> Option<String> {
    match unit {
        Unit::Heads { size, source } if head_dim == 0 || size % head_dim != 0 => Some(format!(
            "{what} head_dim {head_dim} does not fit the heads of {size} that {source} declares, which feeds it{role}; a head must lie within one declared head, so make head_dim {size} (or a divisor of it) or declare heads of {head_dim}"
        )),
        Unit::Plain { weight, dim, len } => Some(format!(
            "weight `{weight}` feeds this {what}{role} but declares no head structure on dimension {dim}, so tensor parallelism could split it inside a head; declare it: `groups: {{{dim}: Heads(count: {}, size: {head_dim})}}`",
            len.checked_div(head_dim).unwrap_or(0)
        )),
        _ => None,
    }
}

/// The unit of `id`'s last dimension: followed back through ops that keep each feature
/// where it is (norms, bias, activation, elementwise, rope) to the weight or the fused
/// part that made it.
fn unit_of(graph: &Graph, mut id: NodeId) -> Unit {
    // Each step goes to an earlier node; the bound only guards a malformed graph.
    for _ in 0..graph.g.node_count() {
        let node = graph.node(id);
        let inputs = graph.inputs(id);
        match &node.op {
            Op::BiasAdd(_)
            | Op::RmsNorm(_)
            | Op::LayerNorm(_)
            | Op::Activation(_)
            | Op::Rope(_)
            | Op::Add(_)
            | Op::Mul(_)
            | Op::SigmoidGate(_) => match inputs.first() {
                Some(&first) => id = first,
                None => return Unit::Unknown,
            },
            Op::Linear(l) => {
                let Some(Op::Param(p)) = inputs.get(1).map(|&w| &graph.node(w).op) else {
                    return Unit::Unknown;
                };
                let dim = l.weight_order.out_dim();
                let Some(&len) = p.shape.get(dim as usize) else {
                    return Unit::Unknown;
                };
                let weight = p.tensor.to_string();
                return match p.groups_of(dim) {
                    Groups::Heads { size, .. } => Unit::Heads {
                        size,
                        source: format!("weight `{weight}` (dimension {dim})"),
                    },
                    Groups::Plain { .. } => Unit::Plain { weight, dim, len },
                    // A fused output is read through an Unfuse, which names its part.
                    Groups::Concat(_) | Groups::Interleaved { .. } => Unit::Unknown,
                };
            }
            Op::Unfuse(u) => {
                return match part_unit(&u.groups, u.part) {
                    Some(size) => Unit::Heads {
                        size,
                        source: format!("part {} of the fused value `{}`", u.part, node.name),
                    },
                    None => Unit::Unknown,
                };
            }
            _ => return Unit::Unknown,
        }
    }
    Unit::Unknown
}

/// The head size of part `part` of a fused structure: each head's share of an interleaved
/// dimension, the head size of a concatenated part.
fn part_unit(groups: &Groups, part: u32) -> Option<u64> {
    match groups {
        Groups::Interleaved { parts, .. } => parts.get(part as usize).copied(),
        Groups::Concat(parts) => match parts.get(part as usize)? {
            Groups::Heads { size, .. } => Some(*size),
            Groups::Interleaved { parts, .. } => Some(parts.iter().sum()),
            _ => None,
        },
        _ => None,
    }
}
