//! The block kernels of [`super`] on AVX2 and FMA: 8 keys per score block, 8 columns per
//! value pass (16 ymm registers: 8 running products or sums, a query or value vector, a
//! broadcast).

use super::BlockKernels;
use std::arch::x86_64::*;

/// AVX2 registers (see [`BlockKernels`]).
pub(super) struct Ymm;

impl BlockKernels for Ymm {
    const KEYS: usize = 8;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn score_block(q: *const f32, d: usize, keys: *const f32, ld: usize, out: *mut f32) {
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in (0..d).step_by(8) {
            let qv = _mm256_loadu_ps(q.add(c));
            for j in 0..8 {
                let kv = _mm256_loadu_ps(keys.add(j * ld + c));
                acc[slot(j)] = _mm256_fmadd_ps(qv, kv, acc[slot(j)]);
            }
        }
        _mm256_storeu_ps(out, fold_8(acc));
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_weighted_values<const G: usize>(
        p: *const f32,
        ldp: usize,
        v: *const f32,
        ldv: usize,
        keys: usize,
        d: usize,
        out: *mut f32,
    ) {
        for c in (0..d).step_by(8) {
            let mut acc = [_mm256_setzero_ps(); G];
            for j in 0..keys {
                let x = _mm256_loadu_ps(v.add(j * ldv + c));
                for (g, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(g * ldp + j)), x, *a);
                }
            }
            for (g, a) in acc.iter().enumerate() {
                let o = out.add(g * d + c);
                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), *a));
            }
        }
    }
}

/// The register that key `j` of a block sums into, so that [`fold_8`]'s order leaves key
/// `j`'s score in lane `j`.
const fn slot(j: usize) -> usize {
    2 * (j % 4) + j / 4
}

/// The 8 lane sums of `a`: lane `4h + m` of the result is the sum of `a[2m + h]` (the
/// order [`slot`] undoes). Three levels of shuffles and adds, 7 pairs in all.
#[inline(always)]
unsafe fn fold_8(a: [__m256; 8]) -> __m256 {
    // Half 0 holds a[2k]'s sum, half 1 a[2k + 1]'s.
    let s: [__m256; 4] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(x, y),
            _mm256_permute2f128_ps::<0x31>(x, y),
        )
    });
    // Per half: lanes 0 and 2 hold s[2p]'s, lanes 1 and 3 s[2p + 1]'s.
    let w: [__m256; 2] = std::array::from_fn(|p| {
        let (x, y) = (s[2 * p], s[2 * p + 1]);
        _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
    });
    let (x, y) = (_mm256_castps_pd(w[0]), _mm256_castps_pd(w[1]));
    _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
        _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
    )
}
