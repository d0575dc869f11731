//! AVX512-BF16 kernels: `vdpbf16ps` multiplies 16 column pairs of a weight pair row by one
//! broadcast pair of bf16 activations and adds both products to 16 f32 sums.

use super::NR;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn weights(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i))
}

/// The bf16 pair at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn pair(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32((p as *const i32).read_unaligned()))
}

/// `R` rows × `P` panels of 16 columns over the whole depth; at most 12 × 2 = 24 of the 32
/// zmm registers accumulate.
///
/// # Safety
/// As [`super::Kernels::tile_bf16`], on a CPU with AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
pub unsafe fn tile<const R: usize, const P: usize>(
    a: *const u16,
    lda: usize,
    b: [*const u16; P],
    pairs: usize,
    c: *mut f32,
    ldc: usize,
    last_cols: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for i in 0..pairs {
        let w: [__m512bh; P] = std::array::from_fn(|q| weights(b[q].add(i * 2 * NR)));
        for (r, row) in acc.iter_mut().enumerate() {
            let x = pair(a.add(r * lda + 2 * i));
            for (s, &wq) in row.iter_mut().zip(&w) {
                *s = _mm512_dpbf16_ps(*s, x, wq);
            }
        }
    }
    let mask: __mmask16 = if last_cols >= NR {
        0xFFFF
    } else {
        (1u16 << last_cols) - 1
    };
    for (r, row) in acc.iter().enumerate() {
        for (q, &v) in row.iter().enumerate() {
            let dst = c.add(r * ldc + q * NR);
            if q + 1 == P {
                _mm512_mask_storeu_ps(dst, mask, v);
            } else {
                _mm512_storeu_ps(dst, v);
            }
        }
    }
}

/// Decode rows: `R` bf16 rows against one panel, read as one stream with four sums per row
/// taking the pair rows in turn (see `gemv_one_row`).
///
/// # Safety
/// AVX512-BF16; `x` holds `R` rows of `2·pairs` values `ldx` apart; `panel` `pairs` pair
/// rows.
#[target_feature(enable = "avx512f,avx512bf16")]
pub unsafe fn gemv<const R: usize>(
    x: &[u16],
    ldx: usize,
    panel: &[u16],
    pairs: usize,
    out: &mut [[f32; NR]; R],
) {
    let (xp, w) = (x.as_ptr(), panel.as_ptr());
    if R == 1 {
        let sum = gemv_one_row(xp, w, pairs);
        _mm512_storeu_ps(out[0].as_mut_ptr(), sum);
        return;
    }
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    // The order of `gemv_one_row`: so a row's sums have the same bits whatever the rows
    // beside it.
    let whole = pairs / 16 * 16;
    for j in 0..pairs {
        super::streams::prefetch_one_stream(w.add(j * 2 * NR) as *const u8);
        let wv = weights(w.add(j * 2 * NR));
        let s = if j < whole { j % 4 } else { 0 };
        for (r, a) in acc.iter_mut().enumerate() {
            a[s] = _mm512_dpbf16_ps(a[s], pair(xp.add(r * ldx + 2 * j)), wv);
        }
    }
    for (a, o) in acc.iter().zip(out.iter_mut()) {
        let sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
        _mm512_storeu_ps(o.as_mut_ptr(), sum);
    }
}

/// One row's sums against one panel, in the order of `gemv`: the panel read as one stream,
/// prefetched 4 KiB ahead (`prefetch_one_stream`), four sums taking the pair rows in turn;
/// each 16 activation pairs are loaded once into a register and broadcast from there
/// (`vpermd`), so a weight line costs one load. On the Zen 5 guest the panel read as eight
/// parts at once, each prefetched 512 B ahead, had read more slowly from memory: cold
/// sweeps (`tpc bench-gemm --rows 1 --isa avx512bf16`) of 768x2048 weights 39.1–39.2 GB/s
/// before, 42.2–42.8 after; of 5632x2048 38.3 before, 40.6 after; TinyLlama-shaped bf16
/// decode at tp 1, 5 alternating passes: a median per-pass ratio of 1.12. From cache it
/// runs as before (13.4–17.8 µs a 768x2048 product, 13.9–14.0 after).
///
/// # Safety
/// AVX512-BF16; `x` holds `2·pairs` values, `w` `pairs` pair rows.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn gemv_one_row(x: *const u16, w: *const u16, pairs: usize) -> __m512 {
    use super::streams::prefetch_one_stream;
    let mut acc = [_mm512_setzero_ps(); 4];
    let whole = pairs / 16 * 16;
    let mut j0 = 0;
    while j0 < whole {
        let xv = _mm512_loadu_si512(x.add(2 * j0) as *const __m512i);
        for t in 0..16 {
            let j = j0 + t;
            prefetch_one_stream(w.add(j * 2 * NR) as *const u8);
            let lane = _mm512_set1_epi32(t as i32);
            let xb = std::mem::transmute::<__m512i, __m512bh>(_mm512_permutexvar_epi32(lane, xv));
            acc[t % 4] = _mm512_dpbf16_ps(acc[t % 4], xb, weights(w.add(j * 2 * NR)));
        }
        j0 += 16;
    }
    for j in whole..pairs {
        acc[0] = _mm512_dpbf16_ps(acc[0], pair(x.add(2 * j)), weights(w.add(j * 2 * NR)));
    }
    _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))
}
