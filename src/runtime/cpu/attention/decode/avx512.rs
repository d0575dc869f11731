//! The block kernels of [`super`] on AVX-512F: 16 keys per score block, 16 columns per
//! value pass.

use super::BlockKernels;
use std::arch::x86_64::*;

/// AVX-512F registers (see [`BlockKernels`]).
pub(super) struct Zmm;

impl BlockKernels for Zmm {
    const KEYS: usize = 16;

    #[target_feature(enable = "avx512f")]
    unsafe fn score_block(q: *const f32, d: usize, keys: *const f32, ld: usize, out: *mut f32) {
        let mut acc = [_mm512_setzero_ps(); 16];
        for c in (0..d).step_by(16) {
            let qv = _mm512_loadu_ps(q.add(c));
            for j in 0..16 {
                let kv = _mm512_loadu_ps(keys.add(j * ld + c));
                acc[slot(j)] = _mm512_fmadd_ps(qv, kv, acc[slot(j)]);
            }
        }
        _mm512_storeu_ps(out, fold_16(acc));
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn add_weighted_values<const G: usize>(
        p: *const f32,
        ldp: usize,
        v: *const f32,
        ldv: usize,
        keys: usize,
        d: usize,
        out: *mut f32,
    ) {
        for c in (0..d).step_by(16) {
            let mut acc = [_mm512_setzero_ps(); G];
            for j in 0..keys {
                let x = _mm512_loadu_ps(v.add(j * ldv + c));
                for (g, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(g * ldp + j)), x, *a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let o = out.add(g * d + c);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *a));
            }
        }
    }
}

/// The register that key `j` of a block sums into, so that [`fold_16`]'s 4 × 4 transpose
/// leaves key `j`'s score in lane `j`.
const fn slot(j: usize) -> usize {
    4 * (j % 4) + j / 4
}

/// The 16 lane sums of `a`: lane `4r + m` of the result is the sum of `a[4m + r]` (a 4 × 4
/// transpose of the order, undone by [`slot`]). Four levels of shuffles and adds, 15 pairs
/// in all, where 16 horizontal sums take 64 shuffles.
#[inline(always)]
unsafe fn fold_16(a: [__m512; 16]) -> __m512 {
    // Quarters 0-1 hold a[2k]'s sum, quarters 2-3 a[2k + 1]'s.
    let s: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    });
    // Quarter r holds a[4m + r]'s sum.
    let u: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (s[2 * m], s[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    });
    // Per quarter: lanes 0 and 2 hold u[2p]'s, lanes 1 and 3 u[2p + 1]'s.
    let w: [__m512; 2] = std::array::from_fn(|p| {
        let (x, y) = (u[2 * p], u[2 * p + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    let (x, y) = (_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
    )
}
