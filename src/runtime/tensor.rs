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
}
