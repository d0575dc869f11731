//! Plain-Rust kernels: the reference every variant is checked against, and what runs on a
//! CPU without the instruction sets of the others. Same layouts, same sums.

use super::{round_bf16, widen, PanelValue, MR, NR};

/// # Safety
/// As [`super::Kernels::tile_f32`] with 6 rows.
pub unsafe fn tile_6x16(
    kc: usize,
    a: *const f32,
    b: *const f32,
    tile: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let mut acc = [[0f32; NR]; MR];
    for p in 0..kc {
        let bp = std::slice::from_raw_parts(b.add(p * NR), NR);
        for (r, row) in acc.iter_mut().enumerate() {
            let av = *a.add(p * MR + r);
            for (c, &bv) in row.iter_mut().zip(bp) {
                *c += av * bv;
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        let dst = std::slice::from_raw_parts_mut(tile.add(r * ldc), NR);
        for (d, &v) in dst.iter_mut().zip(row) {
            *d = if accumulate { *d + v } else { v };
        }
    }
}

pub fn widen_pairs(src: &[u16], dst: &mut [f32]) {
    for (i, pair) in src.chunks_exact(2 * NR).enumerate() {
        for j in 0..NR {
            dst[2 * i * NR + j] = widen(pair[2 * j]);
            dst[(2 * i + 1) * NR + j] = widen(pair[2 * j + 1]);
        }
    }
}

pub fn gemv<const R: usize, T: PanelValue>(
    x: &[f32],
    ldx: usize,
    panel: &[T],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    *out = [[0f32; NR]; R];
    for p in 0..k {
        for (r, row) in out.iter_mut().enumerate() {
            let xv = x[r * ldx + p];
            for (j, o) in row.iter_mut().enumerate() {
                *o += xv * panel[T::slot(p, j)].to_f32();
            }
        }
    }
}

pub fn gemv_bf16x<const R: usize>(
    x: &[u16],
    ldx: usize,
    panel: &[u16],
    pairs: usize,
    out: &mut [[f32; NR]; R],
) {
    *out = [[0f32; NR]; R];
    for i in 0..pairs {
        let w = &panel[i * 2 * NR..(i + 1) * 2 * NR];
        for (r, row) in out.iter_mut().enumerate() {
            let (x0, x1) = (widen(x[r * ldx + 2 * i]), widen(x[r * ldx + 2 * i + 1]));
            for (j, o) in row.iter_mut().enumerate() {
                *o += x0 * widen(w[2 * j]) + x1 * widen(w[2 * j + 1]);
            }
        }
    }
}

/// # Safety
/// As [`super::Kernels::tile_bf16`].
pub unsafe fn tile_bf16<const R: usize, const P: usize>(
    a: *const u16,
    lda: usize,
    b: [*const u16; P],
    pairs: usize,
    c: *mut f32,
    ldc: usize,
    last_cols: usize,
) {
    for (q, &panel) in b.iter().enumerate() {
        let panel = std::slice::from_raw_parts(panel, pairs * 2 * NR);
        let mut out = [[0f32; NR]; R];
        let x = std::slice::from_raw_parts(a, if R == 0 { 0 } else { (R - 1) * lda + 2 * pairs });
        gemv_bf16x::<R>(x, lda, panel, pairs, &mut out);
        let cols = if q + 1 == P { last_cols } else { NR };
        for (r, row) in out.iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), c.add(r * ldc + q * NR), cols);
        }
    }
}

/// Rows of `x` (`k` values each) rounded into AMX A tiles: tile `(r / 16, t)` holds row
/// `r`'s steps `t·32..` at row `r % 16` (see `amx.rs`). Every value of the `dst.len() /
/// (16·32·kblocks)` row tiles is written: zero past `k` and past the rows of `x`.
#[inline(always)]
pub fn round_to_tiles(x: &[f32], k: usize, kblocks: usize, dst: &mut [u16]) {
    const T: usize = super::BF16_K_ALIGN;
    for (g, group) in dst.chunks_exact_mut(16 * T * kblocks).enumerate() {
        for r in 0..16 {
            let row = x.get((g * 16 + r) * k..(g * 16 + r + 1) * k).unwrap_or(&[]);
            for t in 0..kblocks {
                let out = &mut group[t * 16 * T + r * T..][..T];
                let part = row.get(t * T..).unwrap_or(&[]);
                let n = part.len().min(T);
                round_to_bf16(&part[..n], &mut out[..n]);
                out[n..].fill(0);
            }
        }
    }
}

#[inline(always)]
pub fn round_to_bf16(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = round_bf16(s);
    }
}
