//! A mixture-of-experts weight is one `[experts, ..]` tensor in the IR (so that a split by
//! experts or by features is an ordinary slice), while checkpoints store one tensor per
//! expert: the IR names the stack with `{e}` where the expert's index goes
//! (`model.layers.0.mlp.experts.{e}.gate_proj.weight`). Here a rank's slice of the stack
//! becomes its slices of the experts' own tensors.

use super::WeightSlice;

/// Where an expert's index goes in a stacked tensor's name.
pub const EXPERT_MARK: &str = "{e}";

/// Whether `tensor` names a stack of per-expert tensors.
pub fn is_stacked(tensor: &str) -> bool {
    tensor.contains(EXPERT_MARK)
}

/// Expert `e`'s own tensor in a stack's name.
pub fn expert_tensor(stacked: &str, e: u64) -> String {
    stacked.replacen(EXPERT_MARK, &e.to_string(), 1)
}

/// Every expert tensor of a stack `[experts, ..]` and the shape each has (the stack's
/// without its first dim); `None` for a name without the mark or a shape without dims.
pub fn expert_tensors(stacked: &str, shape: &[u64]) -> Option<Vec<(String, Vec<u64>)>> {
    let (&count, rest) = shape.split_first()?;
    if !is_stacked(stacked) {
        return None;
    }
    Some(
        (0..count)
            .map(|e| (expert_tensor(stacked, e), rest.to_vec()))
            .collect(),
    )
}

/// A rank's slice of a stack as its slices of the experts' tensors, one per row of the
/// stack's local first dim: `None` where that row is padding (an expert dealt unevenly
/// pads the rank's piece to the largest). `None` overall if `w` is not a stack.
pub fn expert_slices(w: &WeightSlice) -> Option<Vec<Option<WeightSlice>>> {
    if !is_stacked(&w.tensor) || w.shape.len() < 2 || w.local_shape.len() != w.shape.len() {
        return None;
    }
    let one = |e: u64, dim: Option<u32>, ranges, padding, local: Vec<u64>| WeightSlice {
        tensor: expert_tensor(&w.tensor, e).as_str().into(),
        shape: w.shape[1..].to_vec(),
        dtype: w.dtype,
        dim,
        ranges,
        padding,
        local_shape: local,
        quant: w.quant,
    };
    let whole = w.shape[1..].to_vec();
    match w.dim {
        None => Some(
            (0..w.shape[0])
                .map(|e| Some(one(e, None, Vec::new(), 0, whole.clone())))
                .collect(),
        ),
        Some(0) => {
            let mut out = Vec::new();
            for r in &w.ranges {
                for e in r.offset..r.offset.checked_add(r.len)? {
                    out.push(Some(one(e, None, Vec::new(), 0, whole.clone())));
                }
                out.extend((0..r.pad).map(|_| None));
            }
            out.extend((0..w.padding).map(|_| None));
            Some(out)
        }
        Some(d) => Some(
            (0..w.shape[0])
                .map(|e| {
                    Some(one(
                        e,
                        Some(d - 1),
                        w.ranges.clone(),
                        w.padding,
                        w.local_shape[1..].to_vec(),
                    ))
                })
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, SliceRange};

    fn stack(
        dim: Option<u32>,
        ranges: Vec<SliceRange>,
        padding: u64,
        local: Vec<u64>,
    ) -> WeightSlice {
        WeightSlice {
            tensor: "m.experts.{e}.up_proj.weight".into(),
            shape: vec![5, 8, 4],
            dtype: DType::Bf16,
            dim,
            ranges,
            padding,
            local_shape: local,
            quant: None,
        }
    }

    fn range(offset: u64, len: u64) -> SliceRange {
        SliceRange {
            offset,
            len,
            pad: 0,
        }
    }

    #[test]
    fn a_split_by_experts_keeps_whole_experts_and_marks_the_padding() {
        let w = stack(Some(0), vec![range(3, 2)], 1, vec![3, 8, 4]);
        let parts = expert_slices(&w).unwrap();
        assert_eq!(parts.len(), 3);
        let names: Vec<_> = parts
            .iter()
            .map(|p| p.as_ref().map(|p| p.tensor.to_string()))
            .collect();
        assert_eq!(
            names,
            vec![
                Some("m.experts.3.up_proj.weight".to_string()),
                Some("m.experts.4.up_proj.weight".to_string()),
                None
            ]
        );
        let first = parts[0].as_ref().unwrap();
        assert_eq!((first.dim, first.local_shape.clone()), (None, vec![8, 4]));
    }

    #[test]
    fn a_split_by_features_cuts_every_expert_alike() {
        let w = stack(Some(1), vec![range(4, 4)], 0, vec![5, 4, 4]);
        let parts = expert_slices(&w).unwrap();
        assert_eq!(parts.len(), 5);
        for (e, p) in parts.iter().enumerate() {
            let p = p.as_ref().unwrap();
            assert_eq!(&*p.tensor, format!("m.experts.{e}.up_proj.weight"));
            assert_eq!(p.dim, Some(0));
            assert_eq!(p.ranges, vec![range(4, 4)]);
            assert_eq!(
                (p.shape.clone(), p.local_shape.clone()),
                (vec![8, 4], vec![4, 4])
            );
        }
    }

    #[test]
    fn plain_tensors_are_not_stacks() {
        assert!(expert_tensors("m.up_proj.weight", &[5, 8]).is_none());
        let all = expert_tensors("a.{e}.b", &[2, 3]).unwrap();
        assert_eq!(
            all,
            vec![("a.0.b".into(), vec![3]), ("a.1.b".into(), vec![3])]
        );
    }
}
