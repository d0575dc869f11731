//! Linears that skip the zero padding of an uneven split (`--tp-shares`, or a tp that does
//! not divide the heads): every rank's piece has the largest piece's shape, but a rank with
//! a smaller share packs only its real rows and columns, reads only the real part of its
//! input and writes zeros for its padded outputs, so its time and memory follow its share.
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
    /// The leading inputs the weight holds; the rest multiply zero rows.
    pub real_depth: usize,
    /// The output columns in order, as runs of (real, padding): one run per weight of a
    /// fused product.
    pub columns: Vec<(usize, usize)>,
}

impl Unpadded {
    /// The slices to pack without their padding, and what was left out; `None` when there
    /// is no padding to skip, or when the slices of one product disagree on their depth's.
    pub fn trim(slices: &[&WeightSlice], order: WeightOrder) -> Option<(Vec<WeightSlice>, Self)> {
        let out_dim = order.out_dim();
        let in_dim = 1 - out_dim;
        let padding_on = |w: &WeightSlice, d: u32| if w.dim == Some(d) { w.padding } else { 0 };
        // Padding inside a piece (a fused q|k|v dealt unevenly) is computed, not skipped.
        if slices.iter().all(|w| w.padding == 0)
            || slices
                .iter()
                .any(|w| w.local_shape.len() != 2 || w.padded_inside())
        {
            return None;
        }
        let depth_pad = padding_on(slices[0], in_dim);
        if slices.iter().any(|w| padding_on(w, in_dim) != depth_pad) {
            return None;
        }
        let depth = usize::try_from(slices[0].local_shape[in_dim as usize]).ok()?;
        let mut columns = Vec::with_capacity(slices.len());
        let mut trimmed = Vec::with_capacity(slices.len());
        for w in slices {
            let mut t = (*w).clone();
            if let Some(d) = w.dim {
                t.local_shape[d as usize] = t.local_shape[d as usize].checked_sub(w.padding)?;
                t.padding = 0;
            }
            let n = usize::try_from(w.local_shape[out_dim as usize]).ok()?;
            let pad = usize::try_from(padding_on(w, out_dim)).ok()?;
            columns.push((n.checked_sub(pad)?, pad));
            trimmed.push(t);
        }
        let real_depth = depth.checked_sub(usize::try_from(depth_pad).ok()?)?;
        Some((
            trimmed,
            Unpadded {
                depth,
                real_depth,
                columns,
            },
        ))
    }

    /// `x`'s real inputs: its leading `real_depth` columns (`x` itself when that is all).
    pub fn real_inputs<'x>(&self, x: &'x Tensor) -> std::borrow::Cow<'x, Tensor> {
        let (rows, cols) = x.rows_cols();
        if self.real_depth == cols {
            return std::borrow::Cow::Borrowed(x);
        }
        let mut data = pool::empty(rows * self.real_depth);
        for row in x.data.chunks_exact(cols.max(1)).take(rows) {
            data.extend_from_slice(&row[..self.real_depth]);
        }
        std::borrow::Cow::Owned(x.with_cols(self.real_depth, data))
    }

    /// The product of the real columns `y` widened to the padded width, zeros in the padding.
    pub fn widen(&self, y: Tensor) -> Tensor {
        if self.columns.iter().all(|&(_, pad)| pad == 0) {
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
            (u.depth, u.real_depth, u.columns.clone()),
            (16, 16, vec![(6, 2)])
        );
        // A row-parallel one: 5 real inputs of 8.
        let row = slice(1, [16, 8], 3);
        let (t, u) = Unpadded::trim(&[&row], WeightOrder::OutIn).unwrap();
        assert_eq!(t[0].local_shape, vec![16, 5]);
        assert_eq!((u.depth, u.real_depth, u.columns), (8, 5, vec![(16, 0)]));
        // Nothing to trim, and a fused product whose parts disagree on the depth.
        assert!(Unpadded::trim(&[&slice(0, [8, 16], 0)], WeightOrder::OutIn).is_none());
        assert!(Unpadded::trim(&[&row, &slice(1, [16, 8], 1)], WeightOrder::OutIn).is_none());
    }

    #[test]
    fn inputs_shrink_and_outputs_widen_with_zeros() {
        let u = Unpadded {
            depth: 4,
            real_depth: 3,
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
            real_depth: 4,
            columns: vec![(0, 3)],
        };
        let wide = none.widen(Tensor::new(vec![2, 0], vec![]));
        assert_eq!((wide.shape, wide.data), (vec![2, 3], vec![0.; 6]));
    }
}
