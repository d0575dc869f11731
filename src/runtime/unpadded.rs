//! Linears that skip the zero padding of an uneven split (`--tp-shares`, or a tp that does
//! not divide the heads): every rank's piece has the largest piece's shape, but a rank with
//! a smaller share packs only its real rows and columns, reads only the real part of its
//! input and writes zeros for its padded outputs, so its time and memory follow its share.
//! Zeros may lie inside a piece too (a fused q|k|v dealt part by part): they are skipped
//! as runs.
//! The values are those of the padded product: padded inputs meet zero weights, padded
//! outputs are the zeros that zero weights give.

use crate::ir::WeightOrder;
use crate::plan::WeightSlice;
use crate::runtime::tensor::{pool, Tensor};

/// What a packed weight leaves out of its padded shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpadded {
    /// The input width the plan gives (padding included).
    pub depth: usize,
    /// The inputs in order, as runs of (real, padding): the real ones meet the weight's
    /// rows, the padded ones would meet zero rows.
    pub depth_runs: Vec<(usize, usize)>,
    /// The output columns in order, as runs of (real, padding): one or more per weight of
    /// a fused product (more where padding lies inside a piece: a fused q|k|v).
    pub columns: Vec<(usize, usize)>,
}

/// The runs of (real, zeros) along dim `d` of `w`'s piece: its ranges each with the zeros
/// after it, the end padding after the last, neighbours without zeros between them
/// merged; one all-real run where `w` is not split on `d`. `None` unless they cover the
/// piece exactly.
fn runs_along(w: &WeightSlice, d: u32) -> Option<Vec<(usize, usize)>> {
    let n = usize::try_from(*w.local_shape.get(d as usize)?).ok()?;
    if w.dim != Some(d) {
        return Some(vec![(n, 0)]);
    }
    let mut runs: Vec<(usize, usize)> = Vec::with_capacity(w.ranges.len() + 1);
    for r in &w.ranges {
        let (len, pad) = (usize::try_from(r.len).ok()?, usize::try_from(r.pad).ok()?);
        match runs.last_mut() {
            Some(last) if last.1 == 0 => *last = (last.0.checked_add(len)?, pad),
            _ => runs.push((len, pad)),
        }
    }
    let end = usize::try_from(w.padding).ok()?;
    match runs.last_mut() {
        Some(last) => last.1 = last.1.checked_add(end)?,
        None => runs.push((0, end)),
    }
    let covered = runs
        .iter()
        .try_fold(0usize, |acc, &(a, b)| acc.checked_add(a)?.checked_add(b))?;
    (covered == n).then_some(runs)
}

fn padded(runs: &[(usize, usize)]) -> bool {
    runs.iter().any(|&(_, pad)| pad > 0)
}

impl Unpadded {
    /// The slices to pack without their padding, and what was left out; `None` when there
    /// is no padding to skip, or when the slices of one product disagree on their depth's.
    pub fn trim(slices: &[&WeightSlice], order: WeightOrder) -> Option<(Vec<WeightSlice>, Self)> {
        let out_dim = order.out_dim();
        let in_dim = 1 - out_dim;
        if slices.iter().all(|w| w.pad_len() == 0)
            || slices.iter().any(|w| w.local_shape.len() != 2)
        {
            return None;
        }
        let depth_runs = runs_along(slices[0], in_dim)?;
        let depth = usize::try_from(slices[0].local_shape[in_dim as usize]).ok()?;
        let mut columns = Vec::with_capacity(slices.len());
        let mut trimmed = Vec::with_capacity(slices.len());
        for w in slices {
            if runs_along(w, in_dim)? != depth_runs {
                return None;
            }
            columns.extend(runs_along(w, out_dim)?);
            let mut t = (*w).clone();
            if let Some(d) = w.dim {
                t.local_shape[d as usize] = w.real_len();
                t.padding = 0;
                t.ranges.iter_mut().for_each(|r| r.pad = 0);
            }
            trimmed.push(t);
        }
        Some((
            trimmed,
            Unpadded {
                depth,
                depth_runs,
                columns,
            },
        ))
    }

    /// `x`'s real inputs: the real part of each depth run (`x` itself when that is all).
    pub fn real_inputs<'x>(&self, x: &'x Tensor) -> std::borrow::Cow<'x, Tensor> {
        let (rows, cols) = x.rows_cols();
        if !padded(&self.depth_runs) {
            return std::borrow::Cow::Borrowed(x);
        }
        let real: usize = self.depth_runs.iter().map(|&(n, _)| n).sum();
        let mut data = pool::empty(rows * real);
        for row in x.data.chunks_exact(cols.max(1)).take(rows) {
            let mut at = 0;
            for &(n, pad) in &self.depth_runs {
                data.extend_from_slice(&row[at..at + n]);
                at += n + pad;
            }
        }
        std::borrow::Cow::Owned(x.with_cols(real, data))
    }

    /// The product of the real columns `y` widened to the padded width, zeros in the padding.
    pub fn widen(&self, y: Tensor) -> Tensor {
        if !padded(&self.columns) {
            return y;
        }
        // Rows from the shape: a product with no real columns holds no values to count.
        let rows: usize = y.shape[..y.shape.len().saturating_sub(1)].iter().product();
        let real = y.shape.last().copied().unwrap_or(0);
        let width: usize = self.columns.iter().map(|&(n, pad)| n + pad).sum();
        let mut data = pool::empty(rows * width);
        for row in y.data.chunks_exact(real.max(1)).take(rows) {
            let mut at = 0;
            for &(n, pad) in &self.columns {
                data.extend_from_slice(&row[at..at + n]);
                data.resize(data.len() + pad, 0.0);
                at += n;
            }
        }
        if real == 0 {
            data.resize(rows * width, 0.0);
        }
        y.with_cols(width, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, SliceRange};

    fn slice(dim: u32, local: [u64; 2], padding: u64) -> WeightSlice {
        WeightSlice {
            tensor: "w".into(),
            shape: vec![16, 16],
            dtype: DType::F32,
            dim: Some(dim),
            ranges: vec![SliceRange {
                offset: 0,
                len: local[dim as usize] - padding,
                pad: 0,
            }],
            padding,
            local_shape: local.to_vec(),
            quant: None,
        }
    }

    #[test]
    fn trims_output_and_depth_padding() {
        // A column-parallel [n, k] weight: 6 real outputs of 8.
        let col = slice(0, [8, 16], 2);
        let (t, u) = Unpadded::trim(&[&col], WeightOrder::OutIn).unwrap();
        assert_eq!(t[0].local_shape, vec![6, 16]);
        assert_eq!(t[0].padding, 0);
        assert_eq!(
            (u.depth, u.depth_runs.clone(), u.columns.clone()),
            (16, vec![(16, 0)], vec![(6, 2)])
        );
        // A row-parallel one: 5 real inputs of 8.
        let row = slice(1, [16, 8], 3);
        let (t, u) = Unpadded::trim(&[&row], WeightOrder::OutIn).unwrap();
        assert_eq!(t[0].local_shape, vec![16, 5]);
        assert_eq!(
            (u.depth, u.depth_runs, u.columns),
            (8, vec![(5, 3)], vec![(16, 0)])
        );
        // Nothing to trim, and a fused product whose parts disagree on the depth.
        assert!(Unpadded::trim(&[&slice(0, [8, 16], 0)], WeightOrder::OutIn).is_none());
        assert!(Unpadded::trim(&[&row, &slice(1, [16, 8], 1)], WeightOrder::OutIn).is_none());
    }

    /// A fused q|k|v piece dealt unevenly: zeros after each part's real rows.
    fn fused(dim: u32, local: [u64; 2], runs: &[(u64, u64)], padding: u64) -> WeightSlice {
        let mut at = 0;
        let ranges = runs
            .iter()
            .map(|&(len, pad)| {
                let r = SliceRange {
                    offset: at,
                    len,
                    pad,
                };
                at += 2 * len;
                r
            })
            .collect();
        WeightSlice {
            ranges,
            padding,
            ..slice(dim, local, 0)
        }
    }

    #[test]
    fn trims_padding_inside_a_piece_into_runs() {
        // Outputs q 3+1, k 2+0, v 2+2 and 1 of end padding: q's run ends in zeros, so k
        // starts a run; v follows k with no zeros between and joins it.
        let w = fused(0, [11, 16], &[(3, 1), (2, 0), (2, 2)], 1);
        let (t, u) = Unpadded::trim(&[&w], WeightOrder::OutIn).unwrap();
        assert_eq!(u.columns, vec![(3, 1), (4, 3)]);
        assert_eq!(u.depth_runs, vec![(16, 0)]);
        assert_eq!(t[0].local_shape, vec![7, 16]);
        assert!(t[0].ranges.iter().all(|r| r.pad == 0) && t[0].padding == 0);
        // The same zeros on the input side: the depth runs, which a fused product's parts
        // must share.
        let rows = fused(1, [16, 11], &[(3, 1), (2, 0), (2, 2)], 1);
        let (t, u) = Unpadded::trim(&[&rows], WeightOrder::OutIn).unwrap();
        assert_eq!(u.depth_runs, vec![(3, 1), (4, 3)]);
        assert_eq!(t[0].local_shape, vec![16, 7]);
        let other = fused(1, [16, 11], &[(3, 1), (2, 2), (2, 0)], 1);
        assert!(Unpadded::trim(&[&rows, &other], WeightOrder::OutIn).is_none());
        // Ranges that do not cover the piece: not trimmed (computed as stored).
        let short = fused(0, [12, 16], &[(3, 1), (2, 0), (2, 2)], 1);
        assert!(Unpadded::trim(&[&short], WeightOrder::OutIn).is_none());
        // Inputs: each run's real part, in order.
        let u = Unpadded {
            depth: 6,
            depth_runs: vec![(1, 2), (2, 1)],
            columns: vec![(1, 0)],
        };
        let x = Tensor::new(vec![1, 6], vec![1., 9., 9., 2., 3., 9.]);
        assert_eq!(u.real_inputs(&x).data, vec![1., 2., 3.]);
    }

    #[test]
    fn inputs_shrink_and_outputs_widen_with_zeros() {
        let u = Unpadded {
            depth: 4,
            depth_runs: vec![(3, 1)],
            columns: vec![(2, 1), (1, 2)],
        };
        let x = Tensor::new(vec![2, 4], vec![1., 2., 3., 9., 4., 5., 6., 9.]);
        assert_eq!(u.real_inputs(&x).data, vec![1., 2., 3., 4., 5., 6.]);
        let y = Tensor::new(vec![2, 3], vec![1., 2., 3., 4., 5., 6.]);
        let wide = u.widen(y);
        assert_eq!(wide.shape, vec![2, 6]);
        assert_eq!(
            wide.data,
            vec![1., 2., 0., 3., 0., 0., 4., 5., 0., 6., 0., 0.]
        );
        // A rank that holds only padding: no real columns, zeros of the padded width.
        let none = Unpadded {
            depth: 4,
            depth_runs: vec![(4, 0)],
            columns: vec![(0, 3)],
        };
        let wide = none.widen(Tensor::new(vec![2, 0], vec![]));
        assert_eq!((wide.shape, wide.data), (vec![2, 3], vec![0.; 6]));
    }
}
