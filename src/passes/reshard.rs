//! The one reshard table: how to turn a value laid out one way into another layout.

use crate::ir::{AllGatherOp, AllReduceOp, Layout, LocalSliceOp, Op, ReduceScatterOp};

/// The steps (ops, applied in order) that turn `from` into `to`; empty when equal.
/// `None` when no sequence of collectives can do it (nothing turns a whole value into
/// partial sums without arithmetic that the model did not ask for).
pub fn reshard(from: Layout, to: Layout) -> Option<Vec<Op>> {
    use Layout::*;
    let steps = match (from, to) {
        (Replicated, Replicated) | (Partial, Partial) => vec![],
        (Split { dim: a }, Split { dim: b }) if a == b => vec![],
        (Partial, Replicated) => vec![Op::AllReduce(AllReduceOp::default())],
        (Partial, Split { dim }) => vec![Op::ReduceScatter(ReduceScatterOp::even(dim))],
        (Split { dim }, Replicated) => vec![Op::AllGather(AllGatherOp {
            dim,
            unpad_to: None,
            pieces: Vec::new(),
        })],
        (Replicated, Split { dim }) => vec![Op::LocalSlice(LocalSliceOp::even(dim))],
        (Split { dim: a }, Split { dim: b }) => vec![
            Op::AllGather(AllGatherOp {
                dim: a,
                unpad_to: None,
                pieces: Vec::new(),
            }),
            Op::LocalSlice(LocalSliceOp::even(b)),
        ],
        (_, Partial) => return None,
    };
    Some(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Layout::*;

    fn kinds(from: Layout, to: Layout) -> Option<Vec<&'static str>> {
        reshard(from, to).map(|v| v.iter().map(Op::kind).collect())
    }

    #[test]
    fn partial_to_replicated_is_an_all_reduce() {
        assert_eq!(kinds(Partial, Replicated), Some(vec!["all_reduce"]));
    }

    #[test]
    fn partial_to_split_is_a_reduce_scatter() {
        assert_eq!(
            kinds(Partial, Split { dim: 2 }),
            Some(vec!["reduce_scatter"])
        );
    }

    #[test]
    fn split_to_replicated_is_an_all_gather() {
        let steps = reshard(Split { dim: 2 }, Replicated).unwrap();
        assert_eq!(
            steps,
            vec![Op::AllGather(AllGatherOp {
                dim: 2,
                unpad_to: None,
                pieces: Vec::new(),
            })]
        );
    }

    #[test]
    fn replicated_to_split_is_a_local_slice() {
        assert_eq!(
            kinds(Replicated, Split { dim: 1 }),
            Some(vec!["local_slice"])
        );
    }

    #[test]
    fn split_to_other_split_gathers_then_slices() {
        assert_eq!(
            kinds(Split { dim: 1 }, Split { dim: 2 }),
            Some(vec!["all_gather", "local_slice"])
        );
    }

    #[test]
    fn equal_layouts_need_nothing() {
        for l in [Replicated, Partial, Split { dim: 0 }] {
            assert_eq!(kinds(l, l), Some(vec![]));
        }
    }

    #[test]
    fn nothing_makes_partial_sums() {
        assert_eq!(kinds(Replicated, Partial), None);
        assert_eq!(kinds(Split { dim: 0 }, Partial), None);
    }
}
