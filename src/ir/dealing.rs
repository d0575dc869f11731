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
    let (mut at, mut dim) = (id, dim);
    // Each step moves to an earlier node: the graph is acyclic, so the walk ends.
    loop {
        let node = graph.node(at);
        if matches!(node.op, Op::Linear(_)) {
            return Some(at);
        }
        let d = dims(&node.op);
        if d.collective || d.moves.is_some() {
            return None;
        }
        let letter = d.output.letter_at(dim, node.fact.shape.rank())?;
        let inputs = graph.inputs(at);
        let (next, next_dim) = d.inputs.iter().zip(&inputs).find_map(|(operand, &i)| {
            let input = graph.node(i);
            let rank = input.fact.shape.rank();
            let split_at = operand.dim_of(letter, rank)?;
            (input.layout == Some(Layout::Split { dim: split_at })
                && !matches!(input.op, Op::Param(_)))
            .then_some((i, split_at))
        })?;
        (at, dim) = (next, next_dim);
    }
}

/// The weight of [`dealing_linear`]'s linear.
pub fn dealing_weight(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    dealing_linear(graph, id, dim).and_then(|linear| graph.inputs(linear).get(1).copied())
}

/// The weight of the linear that dealt dim `dim` of value `id` before an all-gather joined
/// it: followed back through ops that carry the dim (whatever their layout) to an
/// all-gather of that dim. `None` where the trail reaches anything else first.
fn gathered_dealer(graph: &Graph, id: NodeId, dim: u32) -> Option<NodeId> {
    let (mut at, mut dim) = (id, dim);
    // Each step moves to an earlier node: the graph is acyclic, so the walk ends.
    loop {
        let node = graph.node(at);
        let inputs = graph.inputs(at);
        if let Op::AllGather(g) = &node.op {
            return dealing_weight(graph, *inputs.first()?, g.dim).filter(|_| g.dim == dim);
        }
        let d = dims(&node.op);
        if d.collective || d.moves.is_some() || matches!(node.op, Op::Linear(_)) {
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

/// The split weight whose pieces local slice `id` must cut: that of the linear that dealt
/// the value before it was gathered whole, or that of the linear reading the slice as its
/// input (split by its input dim), or, for another op, that of the linear
/// dealing the same dim of an input beside the slice (split by its output dim: an MLP's
/// `up` beside a sliced activation), or a split weight beside it (the expert stacks beside
/// a mixture-of-experts layer's routing). `None` when none exists.
pub fn slicing_weight(graph: &Graph, id: NodeId) -> Option<NodeId> {
    let node = graph.node(id);
    let Op::LocalSlice(s) = &node.op else {
        return None;
    };
    // A value gathered whole and sliced again (OLMoE's q and k around their whole-width
    // norms) is cut as the linear that made it was dealt, not as a value beside it.
    if let Some(w) = graph
        .inputs(id)
        .first()
        .and_then(|&x| gathered_dealer(graph, x, s.dim))
    {
        return Some(w);
    }
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
            .letter_at(s.dim, node.fact.shape.rank())?;
        d.inputs
            .iter()
            .zip(&inputs)
            .enumerate()
            .filter(|&(j, _)| j != slot as usize)
            .find_map(|(_, (operand, &i))| {
                let input = graph.node(i);
                let at = operand.dim_of(letter, input.fact.shape.rank())?;
                if input.layout != Some(Layout::Split { dim: at }) {
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
