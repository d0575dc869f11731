//! Which linear deals a split dim of a value: the weight whose pieces (under unequal
//! shares, uneven ones) fix how many of the dim's entries each rank holds.

use super::graph::{Graph, NodeId};
use super::layout::Layout;
use super::op::Op;
use super::op_dims::dims;

/// The linear whose weight's split deals dim `dim` of value `id`: `id` itself, or the one
/// reached back through ops that carry the dim from a split input (elementwise products,
/// activations, attention's heads: the output's letter at `dim` on an input split there,
/// per `op_dims`). `None` where the trail ends elsewhere.
pub fn dealing_linear(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    dealing_op(graph, id, dim).filter(|&at| matches!(graph.node(at).op, Op::Linear(_)))
}

/// The op that split dim `dim` of value `id`, on [`dealing_linear`]'s trail: a linear, or
/// a reduce-scatter or local slice of that dim (a `tp_plan` override that splits a value
/// no linear deals, such as the hidden state). `None` where the trail ends elsewhere.
pub fn dealing_op(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    let mut last = None;
    let found = dealing_trail(graph, id, dim, |at| last = Some(at));
    found.then_some(last).flatten()
}

/// The unfuse (a part of a fused q|k|v product) on [`dealing_op`]'s trail back from dim
/// `dim` of value `id`, if any: the gathered dim is that part's, not the fused weight's.
pub fn unfuse_on_trail(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    let mut unfuse = None;
    dealing_trail(graph, id, dim, |at| {
        if unfuse.is_none() && matches!(graph.node(at).op, Op::Unfuse(_)) {
            unfuse = Some(at);
        }
    });
    unfuse
}

/// Walks back from dim `dim` of value `id` through ops that carry the dim from a split
/// input, `visit`ing each node, to the op that split it (a linear, or a reduce-scatter or
/// local slice of that dim), which it visits last and then returns true; false where the
/// trail ends elsewhere.
fn dealing_trail(graph: &Graph, id: NodeId, dim: u32, mut visit: impl FnMut(NodeId)) -> bool {
    let (mut at, mut dim) = (id, dim);
    // Each step moves to an earlier node: the graph is acyclic, so the walk ends.
    loop {
        let node = graph.node(at);
        visit(at);
        match &node.op {
            Op::Linear(_) => return true,
            Op::ReduceScatter(r) => return r.dim == dim,
            Op::LocalSlice(s) => return s.dim == dim,
            _ => {}
        }
        let d = dims(&node.op);
        if d.collective || d.moves.is_some() {
            return false;
        }
        let Some(letter) = d.output.letter_at(dim, node.fact.shape.rank()) else {
            return false;
        };
        let inputs = graph.inputs(at);
        let next = d.inputs.iter().zip(&inputs).find_map(|(operand, &i)| {
            let input = graph.node(i);
            let rank = input.fact.shape.rank();
            let split_at = operand.dim_of(letter, rank)?;
            (input.layout == Some(Layout::Split { dim: split_at })
                && !matches!(input.op, Op::Param(_)))
            .then_some((i, split_at))
        });
        match next {
            Some(step) => (at, dim) = step,
            None => return false,
        }
    }
}

/// The weight of [`dealing_linear`]'s linear.
pub fn dealing_weight(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    dealing_linear(graph, id, dim).and_then(|linear| graph.inputs(linear).get(1).copied())
}

/// The weight, and its dim, whose structure made dim `dim` of value `id`: followed back
/// through ops that carry the dim (whatever their layout), all-reduces, and collectives
/// and cuts of other dims (the sequence's), to the linear
/// that made it (its weight's output dim, split or not: a row-parallel `q_proj`'s heads)
/// or to an all-gather of it (the split dim of the weight that dealt the gathered pieces:
/// OLMoE's q and k around their whole-width norms). `None` where the trail reaches
/// anything else first (the embeddings' hidden columns).
fn origin_weight(graph: &Graph, id: NodeId, dim: u32) -> Option<Origin> {
    let (mut at, mut dim) = (id, dim);
    // Each step moves to an earlier node: the graph is acyclic, so the walk ends.
    loop {
        let node = graph.node(at);
        let inputs = graph.inputs(at);
        // A collective or cut of another dim (sequence parallelism's, over the tokens)
        // carries this one as it is.
        let other_dim = match &node.op {
            Op::AllGather(g) => g.dim != dim,
            Op::ReduceScatter(r) => r.dim != dim,
            Op::LocalSlice(s) => s.dim != dim,
            Op::AllReduce(_) => true,
            _ => false,
        };
        if other_dim {
            at = *inputs.first()?;
            continue;
        }
        match &node.op {
            Op::AllGather(g) => {
                let w = dealing_weight(graph, *inputs.first()?, g.dim)?;
                let Some(Layout::Split { dim: split }) = graph.node(w).layout else {
                    return None;
                };
                return Some(Origin {
                    weight: (w, split),
                    gathered: true,
                });
            }
            Op::Linear(l) => {
                let last = node.fact.shape.rank().checked_sub(1)?;
                return (dim as usize == last).then_some(Origin {
                    weight: (*inputs.get(1)?, l.weight_order.out_dim()),
                    gathered: false,
                });
            }
            _ => {}
        }
        let d = dims(&node.op);
        if d.collective || d.moves.is_some() {
            return None;
        }
        let letter = d.output.letter_at(dim, node.fact.shape.rank())?;
        (at, dim) = d.inputs.iter().zip(&inputs).find_map(|(operand, &i)| {
            let input = graph.node(i);
            let found = operand.dim_of(letter, input.fact.shape.rank())?;
            (!matches!(input.op, Op::Param(_))).then_some((i, found))
        })?;
    }
}

/// Where [`origin_weight`]'s trail ended.
struct Origin {
    /// The weight and its dim.
    weight: (NodeId, u32),
    /// Reached through an all-gather (else at the linear that made the value).
    gathered: bool,
}

/// The weight, and its dim, whose structure fixes the pieces that a local slice or a
/// reduce-scatter `id` cuts, first found of: the weight that dealt the value before an
/// all-gather joined it ([`origin_weight`]); a split weight reading the result
/// ([`weight_reading`]); the weight of the linear that made the value, split there or not
/// (a row-parallel `q_proj`'s heads, [`origin_weight`]). `None` when none exists (a plain
/// deal then).
pub fn cutting_weight(graph: &Graph, id: NodeId) -> Option<(NodeId, u32)> {
    let dim = match &graph.node(id).op {
        Op::LocalSlice(s) => s.dim,
        Op::ReduceScatter(r) => r.dim,
        _ => return None,
    };
    let origin = graph
        .inputs(id)
        .first()
        .and_then(|&x| origin_weight(graph, x, dim));
    if let Some(Origin {
        weight,
        gathered: true,
    }) = origin
    {
        return Some(weight);
    }
    let reading = weight_reading(graph, id, dim).and_then(|w| match graph.node(w).layout {
        Some(Layout::Split { dim }) => Some((w, dim)),
        _ => None,
    });
    reading.or(origin.map(|o| o.weight))
}

/// The split weight whose pieces the split dim `dim` of value `id` (a local slice's or a
/// reduce-scatter's output) must match: that of the linear reading it as its input (split
/// by its input dim), or, for another op, that of the linear dealing the same dim, of the
/// same length, of an input beside it (split by its output dim: an MLP's `up` beside a
/// sliced activation; not attention's kv heads beside its query heads), or a split weight
/// beside it. `None` when none exists.
pub fn weight_reading(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    let node = graph.node(id);
    graph.users(id).into_iter().find_map(|(user, slot)| {
        let inputs = graph.inputs(user);
        let u = graph.node(user);
        if matches!(u.op, Op::Linear(_)) {
            return (slot == 0).then(|| inputs.get(1).copied()).flatten();
        }
        let d = dims(&u.op);
        let letter = d
            .inputs
            .get(slot as usize)?
            .letter_at(dim, node.fact.shape.rank())?;
        d.inputs
            .iter()
            .zip(&inputs)
            .enumerate()
            .filter(|&(j, _)| j != slot as usize)
            .find_map(|(_, (operand, &i))| {
                let input = graph.node(i);
                let at = operand.dim_of(letter, input.fact.shape.rank())?;
                let same_length =
                    input.fact.shape.0.get(at as usize) == node.fact.shape.0.get(dim as usize);
                if input.layout != Some(Layout::Split { dim: at }) || !same_length {
                    return None;
                }
                // A weight beside the slice deals the dim itself (a mixture-of-experts
                // layer's expert stacks beside its routing).
                if matches!(input.op, Op::Param(_)) {
                    return Some(i);
                }
                dealing_weight(graph, i, at)
            })
    })
}
