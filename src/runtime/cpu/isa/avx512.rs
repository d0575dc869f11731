//! AVX-512F kernels: 16-wide f32 FMA, one zmm per panel step.

use super::{MR, NR};
use std::arch::x86_64::*;

/// 12 rows (two `[kc][MR]` panels) × 16 columns: 12 accumulators, so that 12 FMA chains are
/// in flight (two FMA ports × 4-cycle latency needs 8), one weight load per 12 FMAs.
///
/// # Safety
/// As [`super::Kernels::tile_f32`] with 12 rows, on a CPU with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn tile_12x16(
    kc: usize,
    a: *const f32,
    b: *const f32,
    tile: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let mut c = [_mm512_setzero_ps(); 2 * MR];
    let (a0, a1) = (a, a.add(kc * MR));
    for p in 0..kc {
        let w = _mm512_loadu_ps(b.add(p * NR));
        for r in 0..MR {
            c[r] = _mm512_fmadd_ps(_mm512_set1_ps(*a0.add(p * MR + r)), w, c[r]);
            c[MR + r] = _mm512_fmadd_ps(_mm512_set1_ps(*a1.add(p * MR + r)), w, c[MR + r]);
        }
    }
    for (r, &v) in c.iter().enumerate() {
        let dst = tile.add(r * ldc);
        let v = if accumulate {
            _mm512_add_ps(v, _mm512_loadu_ps(dst))
        } else {
            v
        };
        _mm512_storeu_ps(dst, v);
    }
}

/// The even and odd steps of a 64-byte pair row (16 columns).
#[inline(always)]
unsafe fn split16(p: *const u16) -> (__m512, __m512) {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
    (even, odd)
}

/// # Safety
/// As [`super::Kernels::widen_pairs`], on a CPU with AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn widen_pairs(src: &[u16], dst: &mut [f32]) {
    for i in 0..src.len() / (2 * NR) {
        let (even, odd) = split16(src.as_ptr().add(i * 2 * NR));
        let d = dst.as_mut_ptr().add(i * 2 * NR);
        _mm512_storeu_ps(d, even);
        _mm512_storeu_ps(d.add(NR), odd);
    }
}

/// # Safety
/// AVX-512F; `x` holds `(R - 1)·ldx + k` values, `panel` `k·NR`.
#[target_feature(enable = "avx512f")]
pub unsafe fn gemv_f32<const R: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[f32],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    let w = panel.as_ptr();
    let step = |p: usize| _mm512_loadu_ps(w.add(p * NR));
    gemv::<R>(
        x,
        ldx,
        k,
        out,
        w as *const i8,
        NR * 4,
        |i| (step(2 * i), step(2 * i + 1)),
        step,
    )
}

/// # Safety
/// AVX-512F; `x` holds `(R - 1)·ldx + k` values, `panel` `⌈k/2⌉` pair rows.
#[target_feature(enable = "avx512f")]
pub unsafe fn gemv_pairs<const R: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[u16],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    let w = panel.as_ptr();
    let pair = |i: usize| split16(w.add(i * 2 * NR));
    gemv::<R>(x, ldx, k, out, w as *const i8, NR * 2, pair, |p| {
        pair(p / 2).0
    })
}

/// Even and odd steps keep separate sums (two chains per row even for one row).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv<const R: usize>(
    x: &[f32],
    ldx: usize,
    k: usize,
    out: &mut [[f32; NR]; R],
    base: *const i8,
    step_bytes: usize,
    pair: impl Fn(usize) -> (__m512, __m512),
    one: impl Fn(usize) -> __m512,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    super::streams::for_each_pair!(k / 2, base as *const u8, 2 * step_bytes, |i, _s| {
        let p = 2 * i;
        let (even, odd) = pair(i);
        for (r, a) in acc.iter_mut().enumerate() {
            let x0 = _mm512_set1_ps(*x.get_unchecked(r * ldx + p));
            let x1 = _mm512_set1_ps(*x.get_unchecked(r * ldx + p + 1));
            a[0] = _mm512_fmadd_ps(x0, even, a[0]);
            a[1] = _mm512_fmadd_ps(x1, odd, a[1]);
        }
    });
    if k % 2 == 1 {
        let p = k - 1;
        let w = one(p);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.get_unchecked(r * ldx + p));
            a[0] = _mm512_fmadd_ps(xv, w, a[0]);
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(a[0], a[1]));
    }
}

/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn round_to_tiles(x: &[f32], k: usize, kblocks: usize, dst: &mut [u16]) {
    super::portable::round_to_tiles(x, k, kblocks, dst)
}

/// # Safety
/// AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn round_to_bf16(src: &[f32], dst: &mut [u16]) {
    // The portable loop, compiled 16 wide.
    super::portable::round_to_bf16(src, dst)
}

/// `G` depth blocks of one f32 panel at once, for the invariant order (as
/// `avx2::gemv_blocks`).
///
/// # Safety
/// AVX-512F; each block's steps lie in `panel` and in each of the `R` rows of `x`.
#[target_feature(enable = "avx512f")]
pub unsafe fn gemv_blocks_f32<const R: usize, const G: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[f32],
    starts: [usize; G],
    len: usize,
    out: &mut [[[f32; NR]; R]; G],
) {
    let w = panel.as_ptr();
    let step = |p: usize| _mm512_loadu_ps(w.add(p * NR));
    gemv_blocks::<R, G>(
        x,
        ldx,
        starts,
        len,
        out,
        w as *const u8,
        NR * 4,
        |p| (step(p), step(p + 1)),
        step,
    )
}

/// `G` depth blocks of one bf16 pair panel at once (as `avx2::gemv_blocks`).
///
/// # Safety
/// AVX-512F; every `starts[g]` is even and each block's pair rows lie in `panel`; its steps
/// lie in each of the `R` rows of `x`.
#[target_feature(enable = "avx512f")]
pub unsafe fn gemv_blocks_pairs<const R: usize, const G: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[u16],
    starts: [usize; G],
    len: usize,
    out: &mut [[[f32; NR]; R]; G],
) {
    let w = panel.as_ptr();
    let pair = |p: usize| split16(w.add(p * NR));
    gemv_blocks::<R, G>(
        x,
        ldx,
        starts,
        len,
        out,
        w as *const u8,
        NR * 2,
        pair,
        |p| pair(p).0,
    )
}

/// One chain per output of each block, steps in order from zero; the `G` blocks' chains
/// interleaved (see `avx2::gemv_blocks`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_blocks<const R: usize, const G: usize>(
    x: &[f32],
    ldx: usize,
    starts: [usize; G],
    len: usize,
    out: &mut [[[f32; NR]; R]; G],
    base: *const u8,
    step_bytes: usize,
    pair: impl Fn(usize) -> (__m512, __m512),
    one: impl Fn(usize) -> __m512,
) {
    let mut acc = [[_mm512_setzero_ps(); R]; G];
    for i in 0..len / 2 {
        for (g, a) in acc.iter_mut().enumerate() {
            let p = starts[g] + 2 * i;
            super::streams::prefetch_pair(base, p / 2, 2 * step_bytes);
            let (even, odd) = pair(p);
            for (r, a) in a.iter_mut().enumerate() {
                let x0 = _mm512_set1_ps(*x.get_unchecked(r * ldx + p));
                let x1 = _mm512_set1_ps(*x.get_unchecked(r * ldx + p + 1));
                *a = _mm512_fmadd_ps(x0, even, *a);
                *a = _mm512_fmadd_ps(x1, odd, *a);
            }
        }
    }
    if len % 2 == 1 {
        for (g, a) in acc.iter_mut().enumerate() {
            let p = starts[g] + len - 1;
            let w = one(p);
            for (r, a) in a.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.get_unchecked(r * ldx + p));
                *a = _mm512_fmadd_ps(xv, w, *a);
            }
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        for (a, o) in a.iter().zip(o.iter_mut()) {
            _mm512_storeu_ps(o.as_mut_ptr(), *a);
        }
    }
}
