//! Static check after sharding: a partial sum may only flow into an op that is linear in
//! that input (so summing over ranks commutes with the op).

use super::rules::rule;
use super::ShardCtx;
use crate::error::{Result, TpcError};
use crate::ir::op_dims::dims;
use crate::ir::{Graph, Layout, Op};

/// Whether `op` is linear in input `slot` given the layouts of all its inputs (the op's
/// dims say; a replicated addend is applied on one rank only, see the partitioner).
pub fn linear_in(op: &Op, slot: u32, layouts: &[Layout]) -> bool {
    dims(op).linear_in(slot, layouts)
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

#[cfg(test)]
mod graph_tests {
    use super::*;
    use crate::ir::*;

    fn node(name: &str, op: Op, fact: TensorFact, layout: Layout) -> Node {
        Node {
            name: name.into(),
            op,
            fact,
            layer: None,
            order: 0,
            layout: Some(layout),
        }
    }

    #[test]
    fn a_partial_sum_fed_to_an_activation_is_rejected_with_its_place() {
        let mut g = Graph::new("t", DType::F32);
        let fact = TensorFact {
            dtype: DType::F32,
            shape: Shape::tokens(&[8]),
        };
        let ids = g.add(
            node(
                "ids",
                Op::Input(InputOp {
                    kind: InputKind::TokenIds,
                }),
                TensorFact {
                    dtype: DType::I64,
                    shape: Shape::ids(),
                },
                Layout::Replicated,
            ),
            &[],
        );
        let table_op = Op::Param(ParamOp {
            tensor: "emb".into(),
            shape: vec![16, 8],
            dtype: None,
            groups: Default::default(),
            quant: None,
        });
        let table = g.add(
            node(
                "emb",
                table_op,
                TensorFact {
                    dtype: DType::F32,
                    shape: Shape::fixed(&[16, 8]),
                },
                Layout::Split { dim: 0 },
            ),
            &[],
        );
        let x = g.add(
            node(
                "x",
                Op::Embedding(EmbeddingOp::default()),
                fact.clone(),
                Layout::Partial,
            ),
            &[ids, table],
        );
        let act = Op::Activation(ActivationOp {
            kind: ActivationKind::Gelu,
        });
        g.add(node("act", act, fact, Layout::Partial), &[x]);
        let err = check_partials(&mut g, &mut ShardCtx::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("`act` (activation) input 0 from `x`"), "{err}");
    }
}
