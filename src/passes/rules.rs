//! One sharding rule per op: given the layouts of its inputs (an undecided weight is
//! `None`), which layouts the op needs on its inputs and which layout its output has.
//! Where inputs differ from what is needed, the propagator records a reshard.

use crate::frontend::TpWord;
use crate::ir::{Layout, Op, WeightOrder};

/// What an op needs and yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Required layout of each input, in slot order.
    pub inputs: Vec<Layout>,
    pub output: Layout,
}

const R: Layout = Layout::Replicated;
const P: Layout = Layout::Partial;

fn split(dim: u32) -> Layout {
    Layout::Split { dim }
}

/// The rule for `op`. `given[i]` is input i's layout, `None` for a weight no earlier op
/// has placed; `ranks[i]` is input i's tensor rank; `word` is a tp_plan override for the
/// op's weight.
pub fn rule(op: &Op, given: &[Option<Layout>], ranks: &[usize], word: Option<TpWord>) -> Choice {
    let out_rank = ranks.first().copied().unwrap_or(2).max(1);
    let feat = |r: usize| split(r as u32 - 1);
    let g = |i: usize| given.get(i).copied().flatten().unwrap_or(R);
    let choice = |inputs: Vec<Layout>, output: Layout| Choice { inputs, output };
    match op {
        Op::Input(_) | Op::Param(_) => {
            choice(vec![], given.first().copied().flatten().unwrap_or(R))
        }
        Op::Linear(l) => linear(l.weight_order, g(0), given[1], ranks[0], word),
        Op::Embedding(_) => {
            let table = given[1].unwrap_or(match word {
                Some(TpWord::Replicate) => R,
                Some(TpWord::Colwise) => split(1),
                _ => split(0),
            });
            let out = match table {
                Layout::Split { dim: 0 } => P,
                Layout::Split { .. } => feat(ranks[0] + 1),
                _ => R,
            };
            choice(vec![R, table], out)
        }
        Op::BiasAdd(_) => match g(0) {
            Layout::Split { dim } => choice(vec![split(dim), split(0)], split(dim)),
            // Added on one rank only, so the sum over ranks gains the bias once.
            P => choice(vec![P, R], P),
            R => choice(vec![R, R], R),
        },
        Op::Add(_) => {
            let (a, b) = (g(0), g(1));
            let out = match (a, b) {
                _ if a == b => a,
                (R, P) | (P, R) => P,
                (Layout::Split { .. }, _) => a,
                (_, Layout::Split { .. }) => b,
                _ => R,
            };
            let need = |x: Layout| if x == R && out == P { R } else { out };
            choice(vec![need(a), need(b)], out)
        }
        Op::Mul(_) => match (g(0), g(1)) {
            // Linear in one factor only: the partial factor stays, the other is whole.
            (P, _) => choice(vec![P, R], P),
            (_, P) => choice(vec![R, P], P),
            (a, b) => {
                let out = if matches!(a, Layout::Split { .. }) || b == R {
                    a
                } else {
                    b
                };
                choice(vec![out, out], out)
            }
        },
        Op::Activation(_) | Op::Rope(_) => {
            let x = match g(0) {
                P => R,
                other => other,
            };
            let mut inputs = vec![x];
            if matches!(op, Op::Rope(_)) {
                inputs.push(R);
            }
            choice(inputs, x)
        }
        Op::RmsNorm(n) => {
            let x = match (g(0), n.group) {
                (s @ Layout::Split { .. }, Some(_)) => s,
                _ => R,
            };
            choice(vec![x, R], x)
        }
        Op::LayerNorm(_) => choice(vec![R, R, R], R),
        Op::Attention(_) => {
            let any_split = (0..3).any(|i| matches!(g(i), Layout::Split { .. }));
            let x = if any_split { feat(out_rank) } else { R };
            choice(vec![x, x, x], x)
        }
        Op::Unfuse(_) => choice(vec![g(0)], g(0)),
        Op::Output(_) => choice(vec![R], R),
        Op::AllReduce(_) => choice(vec![P], R),
        Op::AllGather(a) => choice(vec![split(a.dim)], R),
        Op::ReduceScatter(r) => choice(vec![P], split(r.dim)),
        Op::LocalSlice(s) => choice(vec![R], split(s.dim)),
    }
}

/// `y = x · W`: column split keeps the output split by features, row split contracts a
/// split dim and yields partial sums; replicated weights keep x's layout if x is partial.
fn linear(
    order: WeightOrder,
    x: Layout,
    w: Option<Layout>,
    x_rank: usize,
    word: Option<TpWord>,
) -> Choice {
    let feat = split(x_rank as u32 - 1);
    let column = split(order.out_dim());
    let row = split(order.in_dim());
    let w = w.unwrap_or(match word {
        Some(TpWord::Colwise | TpWord::Vocab) => column,
        Some(TpWord::Rowwise) => row,
        Some(TpWord::Replicate) => R,
        None => match x {
            Layout::Split { .. } => row,
            _ => column,
        },
    });
    if w == column {
        Choice {
            inputs: vec![R, w],
            output: feat,
        }
    } else if w == row {
        Choice {
            inputs: vec![feat, w],
            output: P,
        }
    } else if x == P {
        Choice {
            inputs: vec![P, R],
            output: P,
        }
    } else {
        Choice {
            inputs: vec![R, R],
            output: R,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::*;

    fn lin() -> Op {
        Op::Linear(LinearOp::default())
    }

    #[test]
    fn replicated_input_makes_a_column_split() {
        let c = rule(&lin(), &[Some(R), None], &[3, 2], None);
        assert_eq!(
            c,
            Choice {
                inputs: vec![R, split(0)],
                output: split(2)
            }
        );
    }

    #[test]
    fn split_input_makes_a_row_split_with_partial_sums() {
        let c = rule(&lin(), &[Some(split(2)), None], &[3, 2], None);
        assert_eq!(
            c,
            Choice {
                inputs: vec![split(2), split(1)],
                output: P
            }
        );
    }

    #[test]
    fn conv1d_weights_split_the_other_dim() {
        let op = Op::Linear(LinearOp {
            weight_order: WeightOrder::InOut,
        });
        let c = rule(&op, &[Some(R), None], &[3, 2], None);
        assert_eq!(c.inputs[1], split(1));
        let c = rule(&op, &[Some(split(2)), None], &[3, 2], None);
        assert_eq!(c.inputs[1], split(0));
    }

    #[test]
    fn partial_input_is_reduced_before_a_column_split() {
        let c = rule(&lin(), &[Some(P), None], &[3, 2], None);
        assert_eq!(c.inputs[0], R);
    }

    #[test]
    fn overrides_pick_the_weight_layout() {
        let c = rule(&lin(), &[Some(R), None], &[3, 2], Some(TpWord::Rowwise));
        assert_eq!(
            c,
            Choice {
                inputs: vec![split(2), split(1)],
                output: P
            }
        );
        let c = rule(
            &lin(),
            &[Some(split(2)), None],
            &[3, 2],
            Some(TpWord::Replicate),
        );
        assert_eq!(
            c,
            Choice {
                inputs: vec![R, R],
                output: R
            }
        );
    }

    #[test]
    fn embedding_splits_the_vocab_into_partial_sums() {
        let op = Op::Embedding(EmbeddingOp::default());
        assert_eq!(rule(&op, &[Some(R), None], &[2, 2], None).output, P);
        assert_eq!(
            rule(&op, &[Some(R), None], &[2, 2], Some(TpWord::Colwise)).output,
            split(2)
        );
    }

    #[test]
    fn partial_sums_stay_partial_through_adds() {
        let add = Op::Add(AddOp {});
        assert_eq!(rule(&add, &[Some(P), Some(P)], &[3, 3], None).output, P);
        let c = rule(&add, &[Some(R), Some(P)], &[3, 3], None);
        assert_eq!(
            c,
            Choice {
                inputs: vec![R, P],
                output: P
            }
        );
        let c = rule(&add, &[Some(split(2)), Some(R)], &[3, 3], None);
        assert_eq!(c.inputs, vec![split(2), split(2)]);
    }

    #[test]
    fn bias_on_partial_sums_is_added_once() {
        let c = rule(&Op::BiasAdd(BiasAddOp {}), &[Some(P), None], &[3, 1], None);
        assert_eq!(
            c,
            Choice {
                inputs: vec![P, R],
                output: P
            }
        );
    }

    #[test]
    fn nonlinear_ops_need_whole_values() {
        let act = Op::Activation(ActivationOp {
            kind: ActivationKind::Silu,
        });
        assert_eq!(rule(&act, &[Some(P)], &[3], None).inputs, vec![R]);
        assert_eq!(rule(&act, &[Some(split(2))], &[3], None).output, split(2));
        let norm = Op::RmsNorm(RmsNormOp {
            eps: F64(1e-5),
            group: None,
        });
        assert_eq!(
            rule(&norm, &[Some(split(2)), None], &[3, 1], None).inputs[0],
            R
        );
        let head_norm = Op::RmsNorm(RmsNormOp {
            eps: F64(1e-5),
            group: Some(4),
        });
        assert_eq!(
            rule(&head_norm, &[Some(split(2)), None], &[3, 1], None).output,
            split(2)
        );
    }

    #[test]
    fn mul_is_linear_in_one_factor() {
        let mul = Op::Mul(MulOp {});
        let c = rule(&mul, &[Some(P), Some(P)], &[3, 3], None);
        assert_eq!(
            c,
            Choice {
                inputs: vec![P, R],
                output: P
            }
        );
        let c = rule(&mul, &[Some(split(2)), Some(split(2))], &[3, 3], None);
        assert_eq!(c.output, split(2));
    }

    #[test]
    fn attention_keeps_heads_split() {
        let att = Op::Attention(AttentionOp {
            head_dim: 4,
            scale: None,
        });
        let s = Some(split(2));
        assert_eq!(rule(&att, &[s, s, s], &[3, 3, 3], None).output, split(2));
        let c = rule(&att, &[Some(P), Some(R), Some(R)], &[3, 3, 3], None);
        assert_eq!(c.inputs, vec![R, R, R]);
    }
}
