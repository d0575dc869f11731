//! Linear weights packed once at load time into panels of 16 output columns, `[n/16][k][16]`,
//! kept as bf16 bits or f32, and the GEMM / GEMV that multiply activations by them.
//!
//! Why packed: every kernel then reads a weight panel front to back, contiguous, which is what
//! both the memory-bound decode GEMV and the cache-blocked prefill GEMM want; and a bf16 panel
//! is widened to f32 one cache-sized block at a time instead of the whole matrix.
//!
//! Prefill GEMM (BLIS order): activations are packed into 6-row panels per block of `KC`
//! steps; each thread owns a range of weight panels, widens `KC × 16` of one into L1 and runs
//! the 6×16 micro-kernel against every activation panel of the block (which stays in L2).

use super::microkernel::{widen, Kernels, MR, NR};
use super::team::{SyncPtr, Team};
use super::tensor::Tensor;
use crate::ir::WeightOrder;
use rayon::prelude::*;

/// Reduction steps per block: a widened weight block (`KC·NR` f32 = 16 KiB) stays in L1.
const KC: usize = 256;
/// Activation rows per block: `MC·KC` f32 (144 KiB) stays in L2.
const MC: usize = 144;
/// Work chunks per team member: enough for late members to even out, few enough that each
/// chunk still streams a long run of weights.
const CHUNKS_PER_MEMBER: usize = 8;
/// Rows at or below which the GEMV path (weights read once, no packing of `x`) is used.
pub const GEMV_MAX_ROWS: usize = 4;

#[derive(Debug, Clone, PartialEq)]
enum Panels {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

/// A linear weight as `n` output columns by `k` inputs, packed (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    panels: Panels,
}

impl PackedMatrix {
    /// Packs `w`, stored `[n, k]` (`OutIn`) or `[k, n]` (`InOut`), as bf16 (rounded to
    /// nearest even: exact for values read from a bf16 checkpoint) or f32.
    pub fn pack(w: &Tensor, order: WeightOrder, bf16: bool) -> PackedMatrix {
        let (r, c) = (w.shape[0], w.shape[1]);
        let (n, k) = match order {
            WeightOrder::OutIn => (r, c),
            WeightOrder::InOut => (c, r),
        };
        let at = |j: usize, p: usize| match order {
            WeightOrder::OutIn => w.data[j * k + p],
            WeightOrder::InOut => w.data[p * n + j],
        };
        // One panel per task: a 1B-parameter model packs in parallel at load time.
        fn fill<T: Send>(
            out: &mut [T],
            n: usize,
            k: usize,
            value: impl Fn(usize, usize) -> T + Sync,
        ) {
            out.par_chunks_mut(k * NR)
                .enumerate()
                .for_each(|(q, panel)| {
                    for j in q * NR..n.min(q * NR + NR) {
                        for p in 0..k {
                            panel[p * NR + j % NR] = value(j, p);
                        }
                    }
                });
        }
        let len = n.div_ceil(NR) * k * NR;
        let panels = if bf16 {
            let mut bits = vec![0u16; len];
            fill(&mut bits, n, k, |j, p| {
                half::bf16::from_f32(at(j, p)).to_bits()
            });
            Panels::Bf16(bits)
        } else {
            let mut vals = vec![0f32; len];
            fill(&mut vals, n, k, at);
            Panels::F32(vals)
        };
        PackedMatrix { n, k, panels }
    }

    /// Bytes the packed weight occupies (padding included).
    pub fn bytes(&self) -> usize {
        match &self.panels {
            Panels::Bf16(v) => v.len() * 2,
            Panels::F32(v) => v.len() * 4,
        }
    }

    /// Element `(j, p)`: output column `j`, input `p`, as f32.
    pub fn get(&self, j: usize, p: usize) -> f32 {
        let i = (j / NR) * self.k * NR + p * NR + j % NR;
        match &self.panels {
            Panels::Bf16(v) => widen(v[i]),
            Panels::F32(v) => v[i],
        }
    }

    fn panel_count(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// `x [.., k] · Wᵀ` → `[.., n]`, f32 accumulation, on the members of `team`.
    pub fn matmul(&self, x: &Tensor, team: &Team) -> Tensor {
        self.matmul_with(Kernels::detect(), x, team)
    }

    /// As [`PackedMatrix::matmul`] with a given kernel set.
    pub fn matmul_with(&self, kernels: Kernels, x: &Tensor, team: &Team) -> Tensor {
        let (m, k) = x.rows_cols();
        assert_eq!(
            k, self.k,
            "linear: {k} input features against a packed weight of [{}, {}]",
            self.n, self.k
        );
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("activations have a feature dim") = self.n;
        let mut out = Tensor::zeros(shape);
        if m == 0 || self.n == 0 {
            return out;
        }
        let mut packed_x = PACKED_ROWS.take();
        if m > GEMV_MAX_ROWS {
            pack_rows(&x.data, m, k, &mut packed_x);
        }
        let panels = self.panel_count();
        // Small products are not worth waking a second thread.
        let threads = if self.n * k * m.min(8) < 1 << 16 {
            1
        } else {
            team.size().min(panels)
        };
        let dst = SyncPtr(out.data.as_mut_ptr());
        // Members take chunks of panels as they come free rather than fixed halves, so a
        // member that starts late or is preempted (this machine has noisy neighbours) does
        // less instead of making the others wait for it.
        let chunk = panels.div_ceil(threads * CHUNKS_PER_MEMBER).max(1);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = |_member: usize| loop {
            let start = next.fetch_add(chunk, std::sync::atomic::Ordering::Relaxed);
            if start >= panels {
                break;
            }
            let range = start..(start + chunk).min(panels);
            if m > GEMV_MAX_ROWS {
                self.gemm_panels(kernels, &packed_x, m, range, dst)
            } else {
                self.gemv_panels(kernels, &x.data, m, range, dst)
            }
        };
        team.run_on(threads, &work);
        PACKED_ROWS.set(packed_x);
        out
    }

    /// Output columns `[q·NR, q·NR + NR)` of every row, for panels `q` in `range`.
    fn gemv_panels(
        &self,
        kernels: Kernels,
        x: &[f32],
        m: usize,
        range: std::ops::Range<usize>,
        dst: SyncPtr,
    ) {
        let k = self.k;
        for q in range {
            let cols = NR.min(self.n - q * NR);
            let panel = q * k * NR..(q + 1) * k * NR;
            let mut rows = [[0f32; NR]; GEMV_MAX_ROWS];
            let mut done = 0;
            while done < m {
                let r = (m - done).min(GEMV_MAX_ROWS);
                let xs = &x[done * k..];
                macro_rules! run {
                    ($r:literal) => {{
                        let out: &mut [[f32; NR]; $r] = (&mut rows[..$r]).try_into().unwrap();
                        match &self.panels {
                            Panels::Bf16(v) => kernels.gemv::<$r, _>(xs, k, &v[panel.clone()], out),
                            Panels::F32(v) => kernels.gemv::<$r, _>(xs, k, &v[panel.clone()], out),
                        }
                    }};
                }
                match r {
                    1 => run!(1),
                    2 => run!(2),
                    3 => run!(3),
                    _ => run!(4),
                }
                for (i, row) in rows[..r].iter().enumerate() {
                    // SAFETY: row `done + i` < m and columns q·NR .. q·NR + cols ≤ n lie in
                    // the output; only this thread writes panel q's columns.
                    unsafe {
                        let o = dst.0.add((done + i) * self.n + q * NR);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), o, cols);
                    }
                }
                done += r;
            }
        }
    }

    /// The blocked GEMM over panels `range` (see the module doc); `a` is from `pack_rows`.
    fn gemm_panels(
        &self,
        kernels: Kernels,
        a: &[f32],
        m: usize,
        range: std::ops::Range<usize>,
        dst: SyncPtr,
    ) {
        let (n, k) = (self.n, self.k);
        let m_panels = m.div_ceil(MR);
        let mut widened = vec![0f32; KC * NR];
        let mut edge = [0f32; MR * NR];
        for mb in (0..m_panels).step_by(MC / MR) {
            let mb_end = (mb + MC / MR).min(m_panels);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                let a_block = &a[k0 * m_panels * MR..(k0 + kc) * m_panels * MR];
                for q in range.clone() {
                    let start = q * k * NR + k0 * NR;
                    let b: &[f32] = match &self.panels {
                        Panels::F32(v) => &v[start..start + kc * NR],
                        Panels::Bf16(v) => {
                            kernels.widen_bf16(&v[start..start + kc * NR], &mut widened);
                            &widened[..kc * NR]
                        }
                    };
                    let cols = NR.min(n - q * NR);
                    for mp in mb..mb_end {
                        let rows = MR.min(m - mp * MR);
                        let ap = &a_block[mp * MR * kc..(mp + 1) * MR * kc];
                        let accumulate = k0 > 0;
                        // SAFETY: `ap` holds kc·MR and `b` kc·NR values. A full tile writes
                        // rows mp·MR.. +MR and columns q·NR.. +NR of the m×n output, inside
                        // it and owned by this thread (panel q); a partial tile goes through
                        // `edge` and copies back only the rows and columns that exist.
                        unsafe {
                            let o = dst.0.add(mp * MR * n + q * NR);
                            if rows == MR && cols == NR {
                                kernels.tile_6x16(kc, ap.as_ptr(), b.as_ptr(), o, n, accumulate);
                            } else {
                                for r in 0..rows {
                                    std::ptr::copy_nonoverlapping(
                                        o.add(r * n),
                                        edge.as_mut_ptr().add(r * NR),
                                        cols,
                                    );
                                }
                                let e = edge.as_mut_ptr();
                                kernels.tile_6x16(kc, ap.as_ptr(), b.as_ptr(), e, NR, accumulate);
                                for r in 0..rows {
                                    std::ptr::copy_nonoverlapping(
                                        e.add(r * NR),
                                        o.add(r * n),
                                        cols,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

thread_local! {
    /// The packed activations of the last GEMM on this thread, kept so that the next one
    /// reuses the memory instead of faulting in fresh pages (a prompt's rows are megabytes).
    static PACKED_ROWS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `x [m, k]` → for each block of `KC` steps, `m/MR` panels `[kc][MR]` (rows past `m` zero),
/// into `out` (resized).
fn pack_rows(x: &[f32], m: usize, k: usize, out: &mut Vec<f32>) {
    let m_panels = m.div_ceil(MR);
    out.clear();
    out.resize(m_panels * MR * k, 0.0);
    for k0 in (0..k).step_by(KC) {
        let kc = KC.min(k - k0);
        let block = &mut out[k0 * m_panels * MR..(k0 + kc) * m_panels * MR];
        for (mp, panel) in block.chunks_exact_mut(MR * kc).enumerate() {
            for r in 0..MR.min(m - mp * MR) {
                let row = &x[(mp * MR + r) * k + k0..(mp * MR + r) * k + k0 + kc];
                for (p, &v) in row.iter().enumerate() {
                    panel[p * MR + r] = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &Tensor, w: &PackedMatrix) -> Vec<f64> {
        let (m, k) = x.rows_cols();
        (0..m * w.n)
            .map(|i| {
                let (r, j) = (i / w.n, i % w.n);
                (0..k)
                    .map(|p| x.data[r * k + p] as f64 * w.get(j, p) as f64)
                    .sum()
            })
            .collect()
    }

    fn check(m: usize, n: usize, k: usize, bf16: bool, order: WeightOrder) {
        let x = Tensor::new(
            vec![m, k],
            (0..m * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect(),
        );
        let shape = match order {
            WeightOrder::OutIn => vec![n, k],
            WeightOrder::InOut => vec![k, n],
        };
        let w = Tensor::new(
            shape,
            (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
                .collect(),
        );
        let packed = PackedMatrix::pack(&w, order, bf16);
        let want = reference(&x, &packed);
        for kernels in [Kernels::detect(), Kernels::portable()] {
            for threads in [1, 2, 3] {
                let got = packed.matmul_with(kernels, &x, &Team::new(threads));
                assert_eq!(got.shape, vec![m, packed.n]);
                for (i, (a, b)) in got.data.iter().zip(&want).enumerate() {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()) * (k as f64).sqrt(),
                        "m={m} n={n} k={k} bf16={bf16} threads={threads} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_path_matches_an_f64_reference_at_edge_sizes() {
        // Rows across the GEMV limit and the 6-row tiles, columns across 16-wide panels,
        // depths across the 256-step blocks; products big enough to be split over threads.
        for &(m, n, k) in &[
            (1, 7, 5),
            (1, 300, 300),
            (2, 33, 64),
            (3, 17, 513),
            (4, 64, 1024),
            (5, 300, 41),
            (6, 16, 256),
            (7, 513, 96),
            (13, 48, 257),
            (150, 40, 300),
        ] {
            for bf16 in [false, true] {
                check(m, n, k, bf16, WeightOrder::OutIn);
            }
        }
    }

    #[test]
    fn both_weight_orders_pack_the_same_matrix() {
        let w = Tensor::new(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let t = Tensor::new(vec![3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let a = PackedMatrix::pack(&w, WeightOrder::OutIn, false);
        let b = PackedMatrix::pack(&t, WeightOrder::InOut, false);
        assert_eq!(a, b);
        assert_eq!((a.n, a.k), (2, 3));
        assert_eq!(a.get(1, 2), 6.0);
        check(9, 21, 35, true, WeightOrder::InOut);
    }

    #[test]
    fn bf16_packing_rounds_to_nearest_even() {
        let w = Tensor::new(vec![1, 2], vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]);
        let p = PackedMatrix::pack(&w, WeightOrder::OutIn, true);
        // 1 + 2⁻⁸ is halfway between bf16 neighbours 1 and 1 + 2⁻⁷: ties go to even (1).
        assert_eq!(p.get(0, 0), 1.0);
        assert_eq!(p.get(0, 1), 1.0 + 4.0 / 256.0);
        assert_eq!(p.bytes(), 16 * 2 * 2);
    }
}
