//! Test operands and an f64 reference for every CPU attention path's tests.

use crate::runtime::tensor::Tensor;

/// Queries `[t, hq·d]` and cached keys and values `[n, hk·d]`, varied values of a few
/// units.
pub(crate) fn operands(
    t: usize,
    n: usize,
    d: usize,
    hq: usize,
    hk: usize,
) -> (Tensor, Vec<f32>, Vec<f32>) {
    let q = Tensor::new(
        vec![t, hq * d],
        (0..t * hq * d)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 4.0)
            .collect(),
    );
    let k = (0..n * hk * d)
        .map(|i| ((i * 13 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let v = (0..n * hk * d)
        .map(|i| ((i * 7 % 19) as f32 - 9.0) / 3.0)
        .collect();
    (q, k, v)
}

/// Softmax attention in f64, written the obvious way.
pub(crate) fn reference(
    q: &Tensor,
    k: &[f32],
    v: &[f32],
    d: usize,
    kv_heads: usize,
    scale: f64,
) -> Vec<f64> {
    let (t, qcols) = q.rows_cols();
    let heads = qcols / d;
    let kcols = kv_heads * d;
    let n = k.len() / kcols;
    let mut out = vec![0f64; t * qcols];
    for i in 0..t {
        for h in 0..heads {
            let kh = h / (heads / kv_heads);
            let visible = n - t + i + 1;
            let s: Vec<f64> = (0..visible)
                .map(|j| {
                    (0..d)
                        .map(|c| {
                            q.data[i * qcols + h * d + c] as f64 * k[j * kcols + kh * d + c] as f64
                        })
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for c in 0..d {
                out[i * qcols + h * d + c] = (0..visible)
                    .map(|j| e[j] * v[j * kcols + kh * d + c] as f64)
                    .sum::<f64>()
                    / sum;
            }
        }
    }
    out
}
