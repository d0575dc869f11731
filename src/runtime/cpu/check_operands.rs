//! What the kernel checks multiply and what they must get: deterministic operands and an
//! f64 reference product. Below both the packed weights and the start-up self-check, whose
//! tests and checks use them alike.

use super::isa::{round_bf16, widen};
use crate::runtime::tensor::Tensor;

/// Operands of a check: `m × k` activations and `n · k` weight values, in [-1, 1].
pub(crate) fn operands(m: usize, n: usize, k: usize) -> (Tensor, Vec<f32>) {
    let x = (0..m * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let w = (0..n * k)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
        .collect();
    (Tensor::new(vec![m, k], x), w)
}

/// `x · wᵀ` in f64 (`w(j, p)`: row `j`, step `p` of the `n`-row weight), with `x` rounded
/// to bf16 first when `round` (as the bf16-product variants do).
pub(crate) fn reference(
    x: &Tensor,
    n: usize,
    w: impl Fn(usize, usize) -> f32,
    round: bool,
) -> Vec<f64> {
    let (m, k) = x.rows_cols();
    let xv = |i: usize| {
        let v = x.data[i];
        if round {
            widen(round_bf16(v))
        } else {
            v
        }
    };
    (0..m * n)
        .map(|i| {
            let (r, j) = (i / n, i % n);
            (0..k).map(|p| xv(r * k + p) as f64 * w(j, p) as f64).sum()
        })
        .collect()
}
