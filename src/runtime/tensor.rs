//! The runtime's host tensor: f32 values, row-major, with a plain shape.

/// A dense row-major f32 tensor. Activations are `[tokens, features]` (batch 1).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    /// Rows and columns when seen as a matrix over the last dim.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.data.len().checked_div(cols).unwrap_or(0);
        (rows, cols)
    }

    pub fn cols(&self) -> usize {
        self.rows_cols().1
    }

    /// The same rows with `data` of `cols` columns each.
    pub fn with_cols(&self, cols: usize, data: Vec<f32>) -> Tensor {
        let mut shape = self.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = cols;
        }
        Tensor::new(shape, data)
    }

    /// The last row alone, as `[1, cols]`.
    pub fn last_row(&self) -> Tensor {
        let (rows, cols) = self.rows_cols();
        let start = rows.saturating_sub(1) * cols;
        Tensor::new(vec![1, cols], self.data[start..start + cols].to_vec())
    }

    /// Column block `k` of `parts` equal blocks, every row, appended to `out`.
    pub fn push_column_block(&self, k: usize, parts: usize, out: &mut Vec<f32>) {
        let (rows, n) = self.rows_cols();
        let piece = n / parts;
        for r in 0..rows {
            out.extend_from_slice(&self.data[r * n + k * piece..r * n + (k + 1) * piece]);
        }
    }
}
