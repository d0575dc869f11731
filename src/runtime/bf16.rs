//! bf16 weights kept as bf16 in memory (half the bytes of f32) and multiplied with f32
//! accumulation. Decode (few rows) runs a GEMV that widens bf16 to f32 in registers
//! (AVX2 + FMA when the CPU has them, a portable loop otherwise); prefill widens blocks of
//! rows into a scratch buffer and hands them to the f32 GEMM.

use super::tensor::Tensor;
use rayon::prelude::*;

/// A weight matrix `[n, k]` (output rows, input columns) stored as bf16 bits.
#[derive(Debug, Clone, PartialEq)]
pub struct Bf16Matrix {
    pub n: usize,
    pub k: usize,
    pub bits: Vec<u16>,
}

impl Bf16Matrix {
    /// From an f32 weight stored `[n, k]` (`transposed = false`) or `[k, n]` (`true`),
    /// rounding to nearest even (exact for values that came from a bf16 checkpoint).
    pub fn from_f32(w: &Tensor, transposed: bool) -> Bf16Matrix {
        let (r, c) = (w.shape[0], w.shape[1]);
        let (n, k) = if transposed { (c, r) } else { (r, c) };
        let mut bits = vec![0u16; n * k];
        for i in 0..n {
            for j in 0..k {
                let v = if transposed {
                    w.data[j * c + i]
                } else {
                    w.data[i * c + j]
                };
                bits[i * k + j] = half::bf16::from_f32(v).to_bits();
            }
        }
        Bf16Matrix { n, k, bits }
    }

    fn row(&self, i: usize) -> &[u16] {
        &self.bits[i * self.k..(i + 1) * self.k]
    }
}

/// Rows of `x` at or below which the GEMV path is used.
pub const GEMV_MAX_ROWS: usize = 4;
/// Elements widened per block on the GEMM path (16 MiB of f32): large blocks keep the GEMM
/// efficient (measured: 256-row blocks cost ~30 % of prefill on a 2048-wide model).
const BLOCK_ELEMENTS: usize = 1 << 22;

/// `x [m, k] · Wᵀ` → `[m, n]` with f32 accumulation, using up to `threads` threads.
pub fn linear_bf16(x: &Tensor, w: &Bf16Matrix, threads: usize) -> Tensor {
    let (m, k) = x.rows_cols();
    assert_eq!(
        k, w.k,
        "linear: {k} input features against a bf16 weight of [{}, {}]",
        w.n, w.k
    );
    let mut shape = x.shape.clone();
    *shape.last_mut().expect("activations have a feature dim") = w.n;
    let mut out = Tensor::zeros(shape);
    if m == 0 || w.n == 0 {
        return out;
    }
    if m <= GEMV_MAX_ROWS {
        gemv(x, w, &mut out.data, threads);
    } else {
        blocked_gemm(x, w, &mut out.data, threads);
    }
    out
}

fn gemv(x: &Tensor, w: &Bf16Matrix, out: &mut [f32], threads: usize) {
    let (m, k) = x.rows_cols();
    let n = w.n;
    let dot = dot_kernel();
    let fill = |(i, o): (usize, &mut f32)| {
        let (row, col) = (i / n, i % n);
        *o = dot(&x.data[row * k..(row + 1) * k], w.row(col));
    };
    if threads > 1 && n * k >= 1 << 16 {
        out.par_iter_mut()
            .enumerate()
            .with_min_len(64)
            .for_each(fill);
    } else {
        out.iter_mut().enumerate().for_each(fill);
    }
    debug_assert_eq!(out.len(), m * n);
}

fn blocked_gemm(x: &Tensor, w: &Bf16Matrix, out: &mut [f32], threads: usize) {
    let (m, k) = x.rows_cols();
    let n = w.n;
    let block_rows = (BLOCK_ELEMENTS / k.max(1)).max(64).min(n);
    let mut scratch = vec![0f32; block_rows * k];
    for start in (0..n).step_by(block_rows) {
        let rows = block_rows.min(n - start);
        let block = &mut scratch[..rows * k];
        for (d, &b) in block.iter_mut().zip(&w.bits[start * k..(start + rows) * k]) {
            *d = f32::from_bits((b as u32) << 16);
        }
        // The block is [rows, k]: read as [k, rows] with row stride 1, column stride k.
        crate::runtime::cpu::gemm_f32(
            (m, rows, k),
            &mut out[start..],
            n,
            &x.data,
            (block, 1, k as isize),
            threads,
        );
    }
}

type Dot = fn(&[f32], &[u16]) -> f32;

/// The fastest dot product this CPU runs.
fn dot_kernel() -> Dot {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return |x, w| {
                // SAFETY: the features this function needs were detected just above.
                unsafe { dot_avx2(x, w) }
            };
        }
    }
    dot_portable
}

/// Portable reference: widen each bf16 and accumulate in f32 with four partial sums.
pub fn dot_portable(x: &[f32], w: &[u16]) -> f32 {
    let mut acc = [0f32; 4];
    let chunks = x.len() / 4;
    for (xs, ws) in x.chunks_exact(4).zip(w.chunks_exact(4)) {
        for ((a, &xv), &wv) in acc.iter_mut().zip(xs).zip(ws) {
            *a += xv * f32::from_bits((wv as u32) << 16);
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for i in chunks * 4..x.len() {
        s += x[i] * f32::from_bits((w[i] as u32) << 16);
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(x: &[f32], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len().min(w.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (l, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * l;
            // bf16 → f32: zero-extend to 32 bits and shift into the high half.
            let wb = _mm_loadu_si128(w.as_ptr().add(o) as *const __m128i);
            let wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(wb), 16));
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(o)), wf, *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        let wb = _mm_loadu_si128(w.as_ptr().add(i) as *const __m128i);
        let wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(wb), 16));
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), wf, acc[0]);
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    let mut s: f32 = lanes.iter().sum();
    while i < n {
        s += x[i] * f32::from_bits((w[i] as u32) << 16);
        i += 1;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &Tensor, w: &Tensor) -> Vec<f32> {
        // f64 product of x with the bf16-rounded weights.
        let (m, k) = x.rows_cols();
        let n = w.shape[0];
        let round = |v: f32| half::bf16::from_f32(v).to_f32() as f64;
        (0..m * n)
            .map(|i| {
                (0..k)
                    .map(|j| x.data[(i / n) * k + j] as f64 * round(w.data[(i % n) * k + j]))
                    .sum::<f64>() as f32
            })
            .collect()
    }

    fn check(m: usize, n: usize, k: usize, threads: usize) {
        let x = Tensor::new(
            vec![m, k],
            (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect(),
        );
        let w = Tensor::new(
            vec![n, k],
            (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
                .collect(),
        );
        let got = linear_bf16(&x, &Bf16Matrix::from_f32(&w, false), threads);
        for (a, b) in got.data.iter().zip(reference(&x, &w)) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "m={m} n={n} k={k}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn gemv_and_blocked_gemm_match_an_f64_reference() {
        for &(m, n, k) in &[
            (1, 7, 5),
            (1, 300, 77),
            (3, 33, 64),
            (5, 300, 41),
            (17, 513, 96),
        ] {
            check(m, n, k, 1);
            check(m, n, k, 2);
        }
    }

    #[test]
    fn transposed_storage_is_read_as_out_in() {
        let w = Tensor::new(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let t = Bf16Matrix::from_f32(&w, true);
        assert_eq!((t.n, t.k), (3, 2));
        assert_eq!(
            t.row(1),
            &[
                half::bf16::from_f32(2.0).to_bits(),
                half::bf16::from_f32(5.0).to_bits()
            ]
        );
    }

    #[test]
    fn portable_and_simd_dots_agree() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.01).sin()).collect();
        let w: Vec<u16> = (0..1000)
            .map(|i| half::bf16::from_f32((i as f32 * 0.02).cos()).to_bits())
            .collect();
        let a = dot_portable(&x, &w);
        let b = dot_kernel()(&x, &w);
        assert!((a - b).abs() < 1e-3, "{a} vs {b}");
    }
}
