//! Static check after sharding: a partial sum may only flow into an op that is linear in
//! that input (so summing over ranks commutes with the op).

use super::rules::rule;
use super::ShardCtx;
use crate::error::{Result, TpcError};
use crate::ir::{Graph, Layout, Op};

/// Whether `op` is linear in input `slot` given the layouts of all its inputs.
pub fn linear_in(op: &Op, slot: u32, layouts: &[Layout]) -> bool {
    let other_whole = |i: usize| layouts.get(i) == Some(&Layout::Replicated);
    match op {
        Op::Linear(_) => slot == 0 && other_whole(1),
        // The replicated addend is applied on one rank only (see the partitioner).
        Op::Add(_) => true,
        Op::BiasAdd(_) => slot == 0,
        Op::Mul(_) => other_whole(1 - slot as usize),
        Op::Unfuse(_) | Op::AllReduce(_) | Op::ReduceScatter(_) => true,
        _ => false,
    }
}

/// After collectives are in: every op receives exactly the layouts its rule needs, and no
/// partial sum reaches an op that is not linear in it.
pub fn check_partials(graph: &mut Graph, _ctx: &mut ShardCtx) -> Result<()> {
    let mut places = Vec::new();
    for id in graph.g.node_indices() {
        let inputs = graph.inputs(id);
        let layouts: Vec<Layout> = inputs.iter().map(|&i| graph.layout(i)).collect();
        if graph.layout(id) != Layout::Replicated
            || layouts.iter().any(|l| *l != Layout::Replicated)
        {
            let given: Vec<Option<Layout>> = layouts.iter().copied().map(Some).collect();
            let ranks: Vec<usize> = inputs
                .iter()
                .map(|&i| graph.node(i).fact.shape.rank())
                .collect();
            let need = rule(&graph.node(id).op, &given, &ranks, None);
            if !matches!(graph.node(id).op, Op::Param(_) | Op::Input(_))
                && (need.inputs != layouts || need.output != graph.layout(id))
            {
                places.push(format!(
                    "`{}` ({}) receives {layouts:?} and yields {}, but its rule needs {:?} → {}",
                    graph.node(id).name,
                    graph.node(id).op.kind(),
                    graph.layout(id),
                    need.inputs,
                    need.output
                ));
            }
        }
        for (slot, l) in layouts.iter().enumerate() {
            if *l == Layout::Partial && !linear_in(&graph.node(id).op, slot as u32, &layouts) {
                places.push(format!(
                    "`{}` ({}) input {slot} from `{}`",
                    graph.node(id).name,
                    graph.node(id).op.kind(),
                    graph.node(inputs[slot]).name
                ));
            }
        }
    }
    if places.is_empty() {
        Ok(())
    } else {
        places.sort();
        Err(TpcError::PartialMisuse { places })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::*;

    #[test]
    fn nonlinear_ops_reject_partial_sums() {
        let act = Op::Activation(ActivationOp {
            kind: ActivationKind::Gelu,
        });
        assert!(!linear_in(&act, 0, &[Layout::Partial]));
        let norm = Op::LayerNorm(LayerNormOp { eps: F64(1e-5) });
        assert!(!linear_in(
            &norm,
            0,
            &[Layout::Partial, Layout::Replicated, Layout::Replicated]
        ));
        let mul = Op::Mul(MulOp {});
        assert!(!linear_in(&mul, 0, &[Layout::Partial, Layout::Partial]));
        assert!(linear_in(&mul, 0, &[Layout::Partial, Layout::Replicated]));
        let lin = Op::Linear(LinearOp::default());
        assert!(!linear_in(
            &lin,
            0,
            &[Layout::Partial, Layout::Split { dim: 1 }]
        ));
    }
}
