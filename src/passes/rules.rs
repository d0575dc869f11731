//! One sharding rule per op: given the layouts of its inputs (an undecided weight is
//! `None`), which layouts the op needs on its inputs and which layout its output has.
//! Where inputs differ from what is needed, the propagator records a reshard.
//!
//! What each op can do comes from its dims (`ir::op_dims`): which letter a split splits,
//! what the output then is, which inputs may stay partial. This file only holds policy:
//! where an undecided weight goes, and which admitted layout wins when inputs disagree.

use super::decision::Reason;
use crate::frontend::TpWord;
use crate::ir::op_dims::{dims, Linearity, OpDims, Role};
use crate::ir::{Layout, Op};

/// What an op needs and yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Required layout of each input, in slot order.
    pub inputs: Vec<Layout>,
    pub output: Layout,
}

const R: Layout = Layout::Replicated;
#[cfg(test)]
const P: Layout = Layout::Partial;

fn split(dim: u32) -> Layout {
    Layout::Split { dim }
}

/// The rule for `op`. `given[i]` is input i's layout, `None` for a weight no earlier op
/// has placed; `ranks[i]` is input i's tensor rank; `word` is a tp_plan override for the
/// op's weight.
pub fn rule(op: &Op, given: &[Option<Layout>], ranks: &[usize], word: Option<TpWord>) -> Choice {
    rule_with_reason(op, given, ranks, word).0
}

/// [`rule`], and when it placed an undecided weight, that weight's slot and why.
pub fn rule_with_reason(
    op: &Op,
    given: &[Option<Layout>],
    ranks: &[usize],
    word: Option<TpWord>,
) -> (Choice, Option<(usize, Reason)>) {
    let d = dims(op);
    if let Some((from, to)) = d.moves {
        let c = Choice {
            inputs: vec![from],
            output: to,
        };
        return (c, None);
    }
    if d.inputs.is_empty() {
        let c = Choice {
            inputs: vec![],
            output: given.first().copied().flatten().unwrap_or(R),
        };
        return (c, None);
    }
    let mut g: Vec<Layout> = (0..d.inputs.len())
        .map(|i| given.get(i).copied().flatten().unwrap_or(R))
        .collect();
    // A contraction's weight decides the split (placed first if no op has yet); elsewhere
    // the activations' splits decide and weights follow.
    let mut placed_why = None;
    let drivers: Vec<usize> = match summed_weight(&d) {
        Some(w) => {
            g[w] = match given.get(w).copied().flatten() {
                Some(placed) => placed,
                None if matches!(op, Op::Experts(_)) => {
                    let (layout, why) = place_experts(op, word);
                    placed_why = Some((w, why));
                    layout
                }
                None => {
                    let (layout, why) = place_weight(&d, w, g[0], ranks, word);
                    placed_why = Some((w, why));
                    layout
                }
            };
            vec![w]
        }
        None => (0..g.len()).filter(|&i| d.inputs[i].ellipsis).collect(),
    };
    let split = drivers
        .iter()
        .find_map(|&s| match g[s] {
            Layout::Split { dim } => d.split_letter(s, dim, ranks),
            _ => None,
        })
        .and_then(|letter| d.split_along(letter, ranks));
    let partial = d.keep_partial(&g);
    // A product keeps its partial factor (the other factor is made whole); a sum or a
    // single-input op keeps a split and reduces a partial addend into it.
    let partial_first = matches!(d.linear, Linearity::Each(slots) if slots.len() > 1);
    let picked = if partial_first {
        partial.or(split)
    } else {
        split.or(partial)
    };
    let (inputs, output) = picked.unwrap_or_else(|| (vec![R; g.len()], R));
    (Choice { inputs, output }, placed_why)
}

/// The weight input of a contraction: the operand without token dims that has a summed
/// (contracted or looked-up) letter.
fn summed_weight(d: &OpDims) -> Option<usize> {
    d.inputs.iter().position(|o| {
        !o.ellipsis
            && o.dims.iter().any(|dim| {
                dim.chars()
                    .any(|l| matches!(d.role(l), Some(Role::Contracted | Role::Lookup)))
            })
    })
}

/// Where a mixture-of-experts layer's gate weights `[e, f, h]` go: split by experts or by
/// each expert's features as the op says, unless the model's tp_plan replicates them.
fn place_experts(op: &Op, word: Option<TpWord>) -> (Layout, Reason) {
    match (op, word) {
        (_, Some(TpWord::Replicate)) => (R, Reason::Override(TpWord::Replicate)),
        (Op::Experts(e), _) => match e.split {
            crate::ir::ExpertSplit::Expert => (split(0), Reason::Experts(e.split)),
            crate::ir::ExpertSplit::Tensor => (split(1), Reason::Experts(e.split)),
        },
        _ => (R, Reason::NoSplittableDim),
    }
}

/// Where an undecided contraction weight goes. Its kept dim split is a column split (the
/// output is split by features); its summed dim split is a row split (partial sums). A
/// linear reading a split value is row-split, any other column-split; an embedding table
/// is split by vocabulary (its looked-up dim) unless told otherwise. Says which branch
/// decided, for `tpc explain`.
fn place_weight(
    d: &OpDims,
    w: usize,
    x: Layout,
    ranks: &[usize],
    word: Option<TpWord>,
) -> (Layout, Reason) {
    let at = |role: Role| d.input_dim_with(w, role, ranks).map(split).unwrap_or(R);
    let lookup = d.input_dim_with(w, Role::Lookup, ranks).is_some();
    let column = at(Role::Kept);
    let row = if lookup {
        at(Role::Lookup)
    } else {
        at(Role::Contracted)
    };
    let (layout, why) = match word {
        Some(TpWord::Replicate) => (R, Reason::Override(TpWord::Replicate)),
        Some(w @ TpWord::Colwise) => (column, Reason::Override(w)),
        Some(w @ TpWord::Rowwise) => (row, Reason::Override(w)),
        // The vocabulary: an embedding's looked-up rows, an LM head's outputs.
        Some(w @ TpWord::Vocab) if lookup => (row, Reason::Override(w)),
        Some(w @ TpWord::Vocab) => (column, Reason::Override(w)),
        None if lookup => (row, Reason::Lookup),
        None if matches!(x, Layout::Split { .. }) => (row, Reason::ReadsSplit),
        None => (column, Reason::ReadsWhole),
    };
    match why {
        Reason::Override(_) => (layout, why),
        _ if layout == R => (R, Reason::NoSplittableDim),
        _ => (layout, why),
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
            exact: None,
        });
        let c = rule(&op, &[Some(R), None], &[3, 2], None);
        assert_eq!(c.inputs[1], split(1));
        let c = rule(&op, &[Some(split(2)), None], &[3, 2], None);
        assert_eq!(c.inputs[1], split(0));
    }

    #[test]
    fn the_placing_branch_is_named() {
        let why =
            |given: Option<Layout>, word| rule_with_reason(&lin(), &[given, None], &[3, 2], word).1;
        assert_eq!(why(Some(R), None), Some((1, Reason::ReadsWhole)));
        assert_eq!(why(Some(split(2)), None), Some((1, Reason::ReadsSplit)));
        assert_eq!(
            why(Some(split(2)), Some(TpWord::Colwise)),
            Some((1, Reason::Override(TpWord::Colwise)))
        );
        let emb = Op::Embedding(EmbeddingOp::default());
        let placed = rule_with_reason(&emb, &[Some(R), None], &[2, 2], None).1;
        assert_eq!(placed, Some((1, Reason::Lookup)));
        // A weight some earlier op placed is not placed again.
        let placed = rule_with_reason(&lin(), &[Some(R), Some(split(0))], &[3, 2], None).1;
        assert_eq!(placed, None);
        // Ops without a contraction weight place nothing themselves.
        let add = Op::Add(AddOp {});
        assert_eq!(
            rule_with_reason(&add, &[Some(R), None], &[3, 3], None).1,
            None
        );
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
            reduce_input: None,
            with_reduce: false,
        });
        assert_eq!(
            rule(&norm, &[Some(split(2)), None], &[3, 1], None).inputs[0],
            R
        );
        let head_norm = Op::RmsNorm(RmsNormOp {
            eps: F64(1e-5),
            group: Some(4),
            reduce_input: None,
            with_reduce: false,
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

    /// Every choice the rule makes, for any given layouts (weights undecided or placed,
    /// splits on any dim) and any override, is one the op's dims admit.
    #[test]
    fn every_choice_is_admitted_by_the_table() {
        use crate::ir::op_dims::tests::{ranks_of, samples};
        let layouts = [
            None,
            Some(R),
            Some(P),
            Some(split(0)),
            Some(split(1)),
            Some(split(2)),
            Some(split(3)),
        ];
        let words = [
            None,
            Some(TpWord::Colwise),
            Some(TpWord::Rowwise),
            Some(TpWord::Vocab),
            Some(TpWord::Replicate),
        ];
        let mut checked = 0;
        for op in samples() {
            let d = dims(&op);
            let ranks = ranks_of(&d);
            let n = d.inputs.len();
            for code in 0..layouts.len().pow(n as u32) {
                let given: Vec<Option<Layout>> = (0..n)
                    .map(|i| layouts[code / layouts.len().pow(i as u32) % layouts.len()])
                    .collect();
                for word in words {
                    let c = rule(&op, &given, &ranks, word);
                    if let Err(e) = d.admits(&c.inputs, &ranks, c.output) {
                        panic!("{op:?} given {given:?} ({word:?}) → {c:?}: {e}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked > 3000, "{checked}");
    }

    /// For every op of the tiny models at tp 1, 2, 4: the layouts the compiler settled on
    /// are what the rule asks for, and the op's dims admit them.
    #[test]
    fn tiny_models_agree_with_the_table() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
        let mut models: Vec<_> = std::fs::read_dir(&dir)
            .expect("models/")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("tiny-") && n.ends_with(".ron"))
            })
            .collect();
        models.sort();
        assert!(models.len() >= 5, "{models:?}");
        let (mut ops, mut splits, mut partials) = (0, 0, 0);
        for path in &models {
            let def = crate::frontend::load::load_model(path).expect("loads");
            for tp in [1, 2, 4] {
                let no_overrides = std::collections::BTreeMap::new();
                let sharded =
                    crate::passes::shard_model(&def, tp, &no_overrides, Default::default())
                        .expect("shards");
                let g = &sharded.graph;
                for id in g.g.node_indices() {
                    let node = g.node(id);
                    let inputs = g.inputs(id);
                    if inputs.is_empty() {
                        continue;
                    }
                    let layouts: Vec<Layout> = inputs.iter().map(|&i| g.layout(i)).collect();
                    let ranks: Vec<usize> = inputs
                        .iter()
                        .map(|&i| g.node(i).fact.shape.rank())
                        .collect();
                    let output = g.layout(id);
                    let given: Vec<Option<Layout>> = layouts.iter().copied().map(Some).collect();
                    let c = rule(&node.op, &given, &ranks, None);
                    let at = format!(
                        "{} tp {tp}: `{}` ({})",
                        path.display(),
                        node.name,
                        node.op.kind()
                    );
                    assert_eq!((&c.inputs, c.output), (&layouts, output), "{at}");
                    if let Err(e) = dims(&node.op).admits(&layouts, &ranks, output) {
                        panic!("{at}: {e}");
                    }
                    ops += 1;
                    splits += usize::from(matches!(output, Layout::Split { .. }));
                    partials += usize::from(output == P);
                }
            }
        }
        // Split and partial layouts were really exercised, not only replicated ones.
        assert!(
            ops > 500 && splits > 50 && partials > 20,
            "{ops} {splits} {partials}"
        );
    }
}
