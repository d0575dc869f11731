//! AVX2 + FMA kernels (8-wide f32).

use super::{MR, NR};
use std::arch::x86_64::*;

/// 12 accumulators (6 rows × 2 vectors of 8), two weight vectors and one broadcast:
/// 15 of the 16 ymm registers.
///
/// # Safety
/// As [`super::Kernels::tile_f32`] with 6 rows, on a CPU with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn tile_6x16(
    kc: usize,
    a: *const f32,
    b: *const f32,
    tile: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let mut c = [[_mm256_setzero_ps(); 2]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        let b0 = _mm256_loadu_ps(b);
        let b1 = _mm256_loadu_ps(b.add(8));
        for (r, row) in c.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*a.add(r));
            row[0] = _mm256_fmadd_ps(av, b0, row[0]);
            row[1] = _mm256_fmadd_ps(av, b1, row[1]);
        }
        a = a.add(MR);
        b = b.add(NR);
    }
    for (r, row) in c.iter().enumerate() {
        let dst = tile.add(r * ldc);
        let (mut v0, mut v1) = (row[0], row[1]);
        if accumulate {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(dst));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(dst.add(8)));
        }
        _mm256_storeu_ps(dst, v0);
        _mm256_storeu_ps(dst.add(8), v1);
    }
}

/// The even and odd steps of 8 columns of a pair row: the low half of each 32-bit lane is
/// step 2i, the high half step 2i + 1.
#[inline(always)]
unsafe fn split8(p: *const u16) -> (__m256, __m256) {
    let v = _mm256_loadu_si256(p as *const __m256i);
    let even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    let odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536)));
    (even, odd)
}

/// # Safety
/// As [`super::Kernels::widen_pairs`], on a CPU with AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn widen_pairs(src: &[u16], dst: &mut [f32]) {
    for i in 0..src.len() / (2 * NR) {
        let s = src.as_ptr().add(i * 2 * NR);
        let d = dst.as_mut_ptr().add(i * 2 * NR);
        let (e0, o0) = split8(s);
        let (e1, o1) = split8(s.add(NR));
        _mm256_storeu_ps(d, e0);
        _mm256_storeu_ps(d.add(8), e1);
        _mm256_storeu_ps(d.add(NR), o0);
        _mm256_storeu_ps(d.add(NR + 8), o1);
    }
}

/// # Safety
/// AVX2 + FMA; `x` holds `(R - 1)·ldx + k` values, `panel` `k·NR`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemv_f32<const R: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[f32],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    let w = panel.as_ptr();
    let step = |p: usize| {
        (
            _mm256_loadu_ps(w.add(p * NR)),
            _mm256_loadu_ps(w.add(p * NR + 8)),
        )
    };
    gemv::<R>(
        x,
        ldx,
        k,
        out,
        w as *const i8,
        NR * 4,
        |i| {
            let (e0, e1) = step(2 * i);
            let (o0, o1) = step(2 * i + 1);
            [[e0, e1], [o0, o1]]
        },
        step,
    )
}

/// # Safety
/// AVX2 + FMA; `x` holds `(R - 1)·ldx + k` values, `panel` `⌈k/2⌉` pair rows.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemv_pairs<const R: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[u16],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    let w = panel.as_ptr();
    let pair = |i: usize| {
        let (e0, o0) = split8(w.add(i * 2 * NR));
        let (e1, o1) = split8(w.add(i * 2 * NR + NR));
        [[e0, e1], [o0, o1]]
    };
    gemv::<R>(x, ldx, k, out, w as *const i8, NR * 2, pair, |p| {
        let [even, _] = pair(p / 2);
        (even[0], even[1])
    })
}

/// Up to two rows keep two partial sums per vector (even and odd steps) so that even one
/// row has four FMA chains in flight; more rows have chains enough and too few registers.
/// `pair(i)` gives steps 2i and 2i + 1, `one(p)` step p alone (the odd last step).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv<const R: usize>(
    x: &[f32],
    ldx: usize,
    k: usize,
    out: &mut [[f32; NR]; R],
    base: *const i8,
    step_bytes: usize,
    pair: impl Fn(usize) -> [[__m256; 2]; 2],
    one: impl Fn(usize) -> (__m256, __m256),
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; R];
    super::streams::for_each_pair!(k / 2, base as *const u8, 2 * step_bytes, |i, _s| {
        let p = 2 * i;
        let w = pair(i);
        for (step, [w0, w1]) in w.into_iter().enumerate() {
            let s = if R <= 2 { step } else { 0 };
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(x.get_unchecked(r * ldx + p + step));
                a[s][0] = _mm256_fmadd_ps(xv, w0, a[s][0]);
                a[s][1] = _mm256_fmadd_ps(xv, w1, a[s][1]);
            }
        }
    });
    if k % 2 == 1 {
        let p = k - 1;
        let (w0, w1) = one(p);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm256_broadcast_ss(x.get_unchecked(r * ldx + p));
            a[0][0] = _mm256_fmadd_ps(xv, w0, a[0][0]);
            a[0][1] = _mm256_fmadd_ps(xv, w1, a[0][1]);
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        _mm256_storeu_ps(o.as_mut_ptr(), _mm256_add_ps(a[0][0], a[1][0]));
        _mm256_storeu_ps(o.as_mut_ptr().add(8), _mm256_add_ps(a[0][1], a[1][1]));
    }
}

/// `G` depth blocks of one f32 panel at once, for the invariant order: see [`gemv_blocks`].
///
/// # Safety
/// AVX2 + FMA; each block's steps `starts[g] .. starts[g] + len` lie in `panel` (`[k][NR]`)
/// and in each of the `R` rows of `x` (`ldx` apart).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemv_blocks_f32<const R: usize, const G: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[f32],
    starts: [usize; G],
    len: usize,
    out: &mut [[[f32; NR]; R]; G],
) {
    let w = panel.as_ptr();
    let step = |p: usize| {
        (
            _mm256_loadu_ps(w.add(p * NR)),
            _mm256_loadu_ps(w.add(p * NR + 8)),
        )
    };
    gemv_blocks::<R, G>(
        x,
        ldx,
        starts,
        len,
        out,
        w as *const u8,
        NR * 4,
        |p| {
            let (e0, e1) = step(p);
            let (o0, o1) = step(p + 1);
            [[e0, e1], [o0, o1]]
        },
        step,
    )
}

/// `G` depth blocks of one bf16 pair panel at once: see [`gemv_blocks`].
///
/// # Safety
/// AVX2 + FMA; every `starts[g]` is even and each block's pair rows lie in `panel`; its
/// steps lie in each of the `R` rows of `x` (`ldx` apart).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gemv_blocks_pairs<const R: usize, const G: usize>(
    x: &[f32],
    ldx: usize,
    panel: &[u16],
    starts: [usize; G],
    len: usize,
    out: &mut [[[f32; NR]; R]; G],
) {
    let w = panel.as_ptr();
    // Step p (even) and p + 1 sit side by side in pair row p / 2, at p·NR values.
    let pair = |p: usize| {
        let (e0, o0) = split8(w.add(p * NR));
        let (e1, o1) = split8(w.add(p * NR + NR));
        [[e0, e1], [o0, o1]]
    };
    gemv_blocks::<R, G>(
        x,
        ldx,
        starts,
        len,
        out,
        w as *const u8,
        NR * 2,
        pair,
        |p| {
            let [even, _] = pair(p);
            (even[0], even[1])
        },
    )
}

/// The invariant order's decode product over `G` depth blocks of one panel: each output of
/// each block is one chain, its steps in order from zero (the bits of `gemv::<R, true>`, and
/// of the tile kernel, over that block alone), and the blocks' chains are interleaved, so
/// that `G` streams of the panel are read at once and `2·R·G` FMA chains are in flight (one
/// block alone has two, too few to keep a core's loads busy). `pair(p)` gives steps `p` and
/// `p + 1`, `one(p)` step `p` (a block's odd last step).
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
    pair: impl Fn(usize) -> [[__m256; 2]; 2],
    one: impl Fn(usize) -> (__m256, __m256),
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; R]; G];
    for i in 0..len / 2 {
        for (g, a) in acc.iter_mut().enumerate() {
            let p = starts[g] + 2 * i;
            super::streams::prefetch_pair(base, p / 2, 2 * step_bytes);
            for (step, [w0, w1]) in pair(p).into_iter().enumerate() {
                for (r, a) in a.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(x.get_unchecked(r * ldx + p + step));
                    a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                    a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                }
            }
        }
    }
    if len % 2 == 1 {
        for (g, a) in acc.iter_mut().enumerate() {
            let p = starts[g] + len - 1;
            let (w0, w1) = one(p);
            for (r, a) in a.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(x.get_unchecked(r * ldx + p));
                a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
            }
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        for (a, o) in a.iter().zip(o.iter_mut()) {
            _mm256_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), a[1]);
        }
    }
}
