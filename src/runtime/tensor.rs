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

    /// Zeros, in memory from this thread's pool when a released buffer fits.
    pub fn zeros(shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: pool::take(n),
        }
    }

    /// A copy in pooled memory.
    pub fn pooled_copy(&self) -> Tensor {
        let mut data = pool::take(self.data.len());
        data.copy_from_slice(&self.data);
        Tensor {
            shape: self.shape.clone(),
            data,
        }
    }

    /// Gives the tensor's memory back to this thread's pool.
    pub fn release(self) {
        pool::give(self.data);
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

    /// The first row holding a NaN or an infinity, if any.
    pub fn first_non_finite_row(&self) -> Option<usize> {
        self.data
            .chunks(self.cols().max(1))
            .position(|row| row.iter().any(|v| !v.is_finite()))
    }

    /// The same rows with `data` of `cols` columns each.
    pub fn with_cols(&self, cols: usize, data: Vec<f32>) -> Tensor {
        let mut shape = self.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = cols;
        }
        Tensor::new(shape, data)
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

/// Per-thread free list of activation buffers. A decode step allocates the same sizes the
/// step before released, so after the first step every activation comes from here and the
/// loop stops asking the allocator (and the kernel, for fresh pages) for memory.
pub mod pool {
    use std::cell::RefCell;

    /// Buffers kept per thread; the rest are freed.
    const KEEP: usize = 64;
    /// Smaller buffers are not worth keeping.
    const MIN_LEN: usize = 256;

    thread_local! {
        static FREE: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
    }

    /// `n` zeros, in the smallest kept buffer that holds them (or a new one).
    pub fn take(n: usize) -> Vec<f32> {
        let mut b = empty(n);
        b.resize(n, 0.0);
        b
    }

    /// An empty buffer with room for `n` values, kept or new.
    pub fn empty(n: usize) -> Vec<f32> {
        let reused = FREE.with_borrow_mut(|free| {
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= n)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)?;
            Some(free.swap_remove(best))
        });
        match reused {
            Some(mut b) => {
                b.clear();
                b
            }
            None => Vec::with_capacity(n),
        }
    }

    /// Keeps `buf` for a later `take` on this thread.
    pub fn give(buf: Vec<f32>) {
        if buf.capacity() < MIN_LEN {
            return;
        }
        FREE.with_borrow_mut(|free| {
            if free.len() < KEEP {
                free.push(buf);
            } else if let Some(smallest) = free.iter_mut().min_by_key(|b| b.capacity()) {
                if smallest.capacity() < buf.capacity() {
                    *smallest = buf;
                }
            }
        })
    }
}
