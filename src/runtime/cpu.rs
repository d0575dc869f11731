//! The CPU kernel set: packed linears (`packed.rs`) and attention (`attention.rs`) on the
//! rank's team, norms and activations as f32 loops (f64 where accumulated error would
//! matter), and the `gemm` crate for a linear weight that was not packed.

use super::backend::{Backend, BinaryOp, RopeTables};
use super::fastmath;
use super::packed::PackedMatrix;
use super::simd::with_avx2;
use super::team::Team;
use super::tensor::Tensor;
use crate::ir::{ActivationKind, WeightOrder};

/// Elementwise work at least this long (elements) is split over the team: a prompt's
/// activations are, a decode step's are not (waking a helper would cost more than it saves).
const PARALLEL_MIN: usize = 1 << 15;

/// CPU kernels; `threads` is the intra-op parallelism (≈ cores / tp), served by the rank's
/// own team of compute threads.
#[derive(Debug)]
pub struct CpuBackend {
    pub threads: usize,
    pub team: Team,
}

impl CpuBackend {
    pub fn new(threads: usize) -> CpuBackend {
        CpuBackend::pinned(threads, &[])
    }

    /// With member `m` of the team pinned to `cores[m]` (member 0 is the caller's thread,
    /// which pins itself).
    pub fn pinned(threads: usize, cores: &[Option<usize>]) -> CpuBackend {
        CpuBackend {
            threads: threads.max(1),
            team: Team::pinned(threads, cores),
        }
    }
}

/// `dst[m, n] (row stride dst_rs) = lhs[m, k] · rhs[k, n]`, rhs given with its row and
/// column strides; through the `gemm` crate with `threads` threads.
pub fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    lhs: &[f32],
    (rhs, rhs_rs, rhs_cs): (&[f32], isize, isize),
    threads: usize,
) {
    assert!(
        m == 0 || n == 0 || dst.len() >= (m - 1) * dst_rs + n,
        "gemm destination too small"
    );
    assert!(lhs.len() >= m * k, "gemm lhs too small");
    assert!(
        k == 0
            || n == 0
            || rhs.len() as isize > (k as isize - 1) * rhs_rs + (n as isize - 1) * rhs_cs,
        "gemm rhs too small"
    );
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above keep every access inside the three slices; `dst` is a
    // unique borrow so it aliases neither input; read_dst is false so it is only written.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs,
            rhs_rs,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

impl CpuBackend {
    /// `x[i] = f(x[i])`, split over the team for long tensors; `f` is inlined into an
    /// AVX2 loop where the CPU has it (so SiLU's `exp` vectorises).
    fn map_in_place(&self, x: &mut Tensor, f: impl Fn(f32) -> f32 + Sync) {
        self.team
            .for_each_part(&mut x.data, 1, PARALLEL_MIN, &|part, _| {
                with_avx2(|| part.iter_mut().for_each(|v| *v = f(*v)))
            });
    }
}

impl Backend for CpuBackend {
    fn linear(&self, x: &Tensor, w: &Tensor, order: WeightOrder) -> Tensor {
        let (m, k) = x.rows_cols();
        let (n, k_w, rhs_rs, rhs_cs) = match order {
            // W [n, k]: element (kk, j) of the right-hand side is W[j·k + kk].
            WeightOrder::OutIn => (w.shape[0], w.shape[1], 1isize, w.shape[1] as isize),
            // W [k, n]: row-major already.
            WeightOrder::InOut => (w.shape[1], w.shape[0], w.shape[1] as isize, 1isize),
        };
        assert_eq!(
            k, k_w,
            "linear: {k} input features against a weight of {:?}",
            w.shape
        );
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("activations have a feature dim") = n;
        let mut out = Tensor::zeros(shape);
        // The right-hand side is W read as [k, n] through its strides.
        gemm_f32(
            (m, n, k),
            &mut out.data,
            n,
            &x.data,
            (&w.data, rhs_rs, rhs_cs),
            self.threads,
        );
        out
    }

    fn packed_linear(&self, x: &Tensor, w: &PackedMatrix) -> Tensor {
        w.matmul(x, &self.team)
    }

    fn rms_norm(&self, x: &Tensor, w: &[f32], group: usize, eps: f32) -> Tensor {
        let mut out = x.pooled_copy();
        let group = group.max(1);
        self.team
            .for_each_part(&mut out.data, group, PARALLEL_MIN, &|part, _| {
                for o in part.chunks_mut(group) {
                    let ms = o.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / group as f64;
                    let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
                    for (o, &g) in o.iter_mut().zip(w) {
                        *o = g * (*o * inv);
                    }
                }
            });
        out
    }

    fn binary(&self, x: &mut Tensor, y: &Tensor, op: BinaryOp) {
        self.team
            .for_each_part(&mut x.data, 1, PARALLEL_MIN, &|part, offset| {
                let y = &y.data[offset..offset + part.len()];
                with_avx2(|| match op {
                    BinaryOp::Add => part.iter_mut().zip(y).for_each(|(o, v)| *o += v),
                    BinaryOp::Mul => part.iter_mut().zip(y).for_each(|(o, v)| *o *= v),
                })
            });
    }

    fn layer_norm(&self, x: &Tensor, w: &[f32], b: &[f32], eps: f32) -> Tensor {
        let cols = x.cols();
        let mut out = x.pooled_copy();
        for (row, o) in x.data.chunks(cols).zip(out.data.chunks_mut(cols)) {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for (i, o) in o.iter_mut().enumerate() {
                *o = ((row[i] as f64 - mean) * inv) as f32 * w[i] + b[i];
            }
        }
        out
    }

    fn activation(&self, x: &mut Tensor, kind: ActivationKind) {
        match kind {
            ActivationKind::Silu => self.map_in_place(x, fastmath::silu),
            ActivationKind::Relu => self.map_in_place(x, |v| v.max(0.0)),
            ActivationKind::Gelu => self.map_in_place(x, |v| {
                let v = v as f64;
                (0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2))) as f32
            }),
            ActivationKind::GeluTanh => self.map_in_place(x, |v| {
                let v = v as f64;
                let c = (2.0 / std::f64::consts::PI).sqrt();
                (0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())) as f32
            }),
        }
    }

    fn rope(&self, x: &mut Tensor, head_dim: usize, t: &RopeTables) {
        let (rows, cols) = x.rows_cols();
        let half = t.half;
        for r in 0..rows {
            let cos = &t.cos[r * half..(r + 1) * half];
            let sin = &t.sin[r * half..(r + 1) * half];
            let row = &mut x.data[r * cols..(r + 1) * cols];
            for head in row.chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &[f32],
        v: &[f32],
        d: usize,
        kv_heads: usize,
        scale: f32,
    ) -> Tensor {
        super::attention::causal_attention(&self.team, q, k, v, d, kv_heads, scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &Tensor, w: &Tensor, order: WeightOrder) -> Vec<f32> {
        let (m, k) = x.rows_cols();
        let n = match order {
            WeightOrder::OutIn => w.shape[0],
            WeightOrder::InOut => w.shape[1],
        };
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|kk| {
                        let wv = match order {
                            WeightOrder::OutIn => w.data[j * k + kk],
                            WeightOrder::InOut => w.data[kk * n + j],
                        };
                        x.data[i * k + kk] * wv
                    })
                    .sum();
            }
        }
        out
    }

    #[test]
    fn linear_matches_a_naive_product_in_both_weight_orders() {
        let x = Tensor::new(
            vec![3, 5],
            (0..15).map(|i| (i as f32 * 0.37).sin()).collect(),
        );
        let w = Tensor::new(
            vec![4, 5],
            (0..20).map(|i| (i as f32 * 0.11).cos()).collect(),
        );
        for threads in [1, 2] {
            let cpu = CpuBackend::new(threads);
            let y = cpu.linear(&x, &w, WeightOrder::OutIn);
            assert_eq!(y.shape, vec![3, 4]);
            for (a, b) in y.data.iter().zip(naive(&x, &w, WeightOrder::OutIn)) {
                assert!((a - b).abs() < 1e-5);
            }
            let w2 = Tensor::new(vec![5, 4], w.data.clone());
            let y = cpu.linear(&x, &w2, WeightOrder::InOut);
            for (a, b) in y.data.iter().zip(naive(&x, &w2, WeightOrder::InOut)) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn attention_over_one_key_returns_its_value() {
        let cpu = CpuBackend::new(1);
        let q = Tensor::new(vec![1, 4], vec![1.0, 2.0, 3.0, 4.0]);
        let out = cpu.attention(&q, &[0.5, 0.5], &[7.0, 8.0], 2, 1, 1.0);
        assert_eq!(out.data, vec![7.0, 8.0, 7.0, 8.0]);
    }

    #[test]
    fn group_rms_norm_normalizes_each_head() {
        let cpu = CpuBackend::new(1);
        let x = Tensor::new(vec![1, 4], vec![3.0, 4.0, 1.0, 1.0]);
        let y = cpu.rms_norm(&x, &[1.0, 1.0], 2, 0.0);
        let expect = [3.0 / 12.5f32.sqrt(), 4.0 / 12.5f32.sqrt(), 1.0, 1.0];
        for (a, b) in y.data.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
