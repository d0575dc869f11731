//! The decode GEMV over INT8 code panels (`isa/codes.rs` gives their layout: `[k][NR]`
//! signed bytes, scales `[⌈k/kblock⌉][NR]`) that multiplies integers, for bf16 runs on
//! AVX2: the activations come quantized to i16 per block of `xblock` steps, as the INT4
//! GEMV takes them ([`QuantizedRows`](super::QuantizedRows)), and `vpmaddwd` sums a pair of
//! steps' code × activation products exactly into i32. Per block:
//! `out += scale · xscale · Σ code·xq`.
//!
//! Why: AVX2's f32 form widens each code to an i32 and then an f32 before its fused
//! multiply-add, three 256-bit operations per 8 weights; on Zen 1's 128-bit units that
//! arithmetic, not reading the bytes, paced INT8 decode (1.16× bf16 on TinyLlama's shape
//! against the 1.8× its bytes allow). Here two steps of 16 columns (32 weights) cost two
//! 16-byte loads, two byte interleaves, two sign extensions, two multiply-adds and two adds.
//! Measured on the 2-core Zen 1 host (W8A16 TinyLlama, tp 1, best of 3): decode 13.5–14.1
//! tokens/s with the f32 form, 17.3–18.3 with this one (bf16: 11.6–11.7).
//!
//! A block's sums stay within i32: each multiply-add lane is at most 2 · 128 · 32767, and a
//! block holds at most 256 pairs (`xblock` ≤ [`INT8_MAX_XBLOCK`]).

use super::{rows_fit, Isa, Kernels, NR};

/// The most steps an activation block of [`Kernels::gemv_int8`] may hold.
pub const INT8_MAX_XBLOCK: usize = 512;

/// The activation block for INT8 codes in scale blocks of `kblock` steps: the largest even
/// divisor of `kblock` up to [`INT8_MAX_XBLOCK`] (`None` for an odd `kblock`, whose pairs
/// of steps would straddle two scales).
pub fn int8_xblock(kblock: usize) -> Option<usize> {
    (2..=INT8_MAX_XBLOCK.min(kblock))
        .rev()
        .step_by(2)
        .find(|d| d.is_multiple_of(2) && kblock.is_multiple_of(*d))
}

impl Kernels {
    /// `out[r][j] = Σ_b scales[g(b)][j] · xscales[r][b] · Σ_{p ∈ b} xq[r][p] · code(p, j)`
    /// for `R` rows of `xq` (stride `ldx`) over `k` steps in activation blocks `b` of
    /// `xblock` steps (even, dividing `kblock`, at most [`INT8_MAX_XBLOCK`]), `g(b)` the
    /// scale block of `kblock` steps holding it; `xscales` with stride `lds`. The codes are
    /// signed bytes (`CodeKind::Int8`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_int8<const R: usize>(
        self,
        xq: &[i16],
        ldx: usize,
        xscales: &[f32],
        lds: usize,
        codes: &[u8],
        scales: &[f32],
        k: usize,
        kblock: usize,
        xblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        assert!(
            xblock > 0
                && xblock <= INT8_MAX_XBLOCK
                && xblock.is_multiple_of(2)
                && kblock.is_multiple_of(xblock),
            "gemv: int8 blocks of {xblock} steps in scale blocks of {kblock}"
        );
        let blocks = k.div_ceil(xblock);
        assert!(rows_fit(xq.len(), R, ldx, k), "gemv: x too short");
        assert!(
            rows_fit(xscales.len(), R, lds, blocks),
            "gemv: x scales too short"
        );
        assert!(codes.len() >= k * NR, "gemv: panel too short");
        assert!(
            scales.len() >= k.div_ceil(kblock) * NR,
            "gemv: scales too short"
        );
        #[cfg(target_arch = "x86_64")]
        if self.gemv_variant(false) >= Isa::Avx2 {
            // SAFETY: AVX2 was checked against the host (every variant above it has it);
            // the asserts keep every read in bounds and every block's sums within i32.
            return unsafe {
                x86::gemv_avx2::<R>(xq, ldx, xscales, lds, codes, scales, k, kblock, xblock, out)
            };
        }
        *out = [[0f32; NR]; R];
        for b in 0..blocks {
            let s = &scales[b * xblock / kblock * NR..][..NR];
            for (r, o) in out.iter_mut().enumerate() {
                let mut acc = [0i32; NR];
                for p in b * xblock..((b + 1) * xblock).min(k) {
                    let xv = i32::from(xq[r * ldx + p]);
                    for (a, &c) in acc.iter_mut().zip(&codes[p * NR..][..NR]) {
                        *a += xv * i32::from(c as i8);
                    }
                }
                let xs = xscales[r * lds + b];
                for j in 0..NR {
                    o[j] += acc[j] as f32 * (s[j] * xs);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::streams::prefetch_one_stream;
    use super::NR;
    use std::arch::x86_64::*;

    /// Steps `p` and `p + 1` (the rows `a`, `b` of 16 codes) as two vectors of i16, columns
    /// 0–7 and 8–15, each column's two codes side by side (what `vpmaddwd` pairs).
    #[inline(always)]
    unsafe fn pair(a: __m128i, b: __m128i) -> [__m256i; 2] {
        [
            _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)),
            _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)),
        ]
    }

    /// Each block: per row two i32 sums (columns 0–7, 8–15), a pair of steps a
    /// multiply-add; converted, times the scales and the block's activation scale.
    ///
    /// # Safety
    /// AVX2 and FMA; as `Kernels::gemv_int8` asserts.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv_avx2<const R: usize>(
        xq: &[i16],
        ldx: usize,
        xscales: &[f32],
        lds: usize,
        codes: &[u8],
        scales: &[f32],
        k: usize,
        kblock: usize,
        xblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        let c = codes.as_ptr();
        let x = xq.as_ptr();
        let mut tot = [[_mm256_setzero_ps(); 2]; R];
        let mut b0 = 0;
        while b0 < k {
            // The last block may be short, and odd (a depth cut short).
            let b1 = (b0 + xblock).min(k);
            let mut acc = [[_mm256_setzero_si256(); 2]; R];
            let mut p = b0;
            // Four steps a round (two pairs: fewer loop branches per byte).
            while p + 4 <= b1 {
                let at = c.add(p * NR);
                prefetch_one_stream(at);
                let w = [0, 2].map(|d| {
                    pair(
                        _mm_loadu_si128(at.add(d * NR) as *const __m128i),
                        _mm_loadu_si128(at.add((d + 1) * NR) as *const __m128i),
                    )
                });
                for (r, a) in acc.iter_mut().enumerate() {
                    for (d, w) in w.iter().enumerate() {
                        let x2 = (x.add(r * ldx + p + 2 * d) as *const i32).read_unaligned();
                        let xv = _mm256_set1_epi32(x2);
                        a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(w[0], xv));
                        a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(w[1], xv));
                    }
                }
                p += 4;
            }
            while p + 2 <= b1 {
                let at = c.add(p * NR);
                prefetch_one_stream(at);
                let w = pair(
                    _mm_loadu_si128(at as *const __m128i),
                    _mm_loadu_si128(at.add(NR) as *const __m128i),
                );
                for (r, a) in acc.iter_mut().enumerate() {
                    // Steps p and p + 1 of the row: one i32, broadcast.
                    let x2 = (x.add(r * ldx + p) as *const i32).read_unaligned();
                    let xv = _mm256_set1_epi32(x2);
                    a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(w[0], xv));
                    a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(w[1], xv));
                }
                p += 2;
            }
            if p < b1 {
                // An odd last step, paired with zeros.
                let w = pair(
                    _mm_loadu_si128(c.add(p * NR) as *const __m128i),
                    _mm_setzero_si128(),
                );
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_set1_epi32(i32::from(*x.add(r * ldx + p) as u16));
                    a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(w[0], xv));
                    a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(w[1], xv));
                }
            }
            let s = scales.as_ptr().add(b0 / kblock * NR);
            for (r, (t, a)) in tot.iter_mut().zip(&acc).enumerate() {
                let xs = _mm256_set1_ps(*xscales.as_ptr().add(r * lds + b0 / xblock));
                for h in 0..2 {
                    let sx = _mm256_mul_ps(_mm256_loadu_ps(s.add(8 * h)), xs);
                    t[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h]), sx, t[h]);
                }
            }
            b0 = b1;
        }
        for (o, t) in out.iter_mut().zip(&tot) {
            _mm256_storeu_ps(o.as_mut_ptr(), t[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), t[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::QuantizedRows;
    use super::*;

    fn variants() -> Vec<Kernels> {
        Isa::ALL
            .into_iter()
            .filter_map(|i| Kernels::unchecked(i).ok())
            .collect()
    }

    #[test]
    fn activation_blocks_are_the_largest_even_divisors_up_to_512() {
        assert_eq!(int8_xblock(128), Some(128));
        assert_eq!(int8_xblock(2048), Some(512));
        assert_eq!(int8_xblock(2816), Some(352));
        assert_eq!(int8_xblock(5632), Some(512));
        assert_eq!(int8_xblock(70), Some(70));
        assert_eq!(int8_xblock(2 * 521), Some(2));
        assert_eq!(int8_xblock(37), None);
        assert_eq!(int8_xblock(0), None);
    }

    /// Every code from −128 to 127 and activations at ±32767 (the largest sums a block may
    /// reach), against exact integer sums scaled in f64.
    fn check<const R: usize>(k: usize, kblock: usize, xblock: usize, extreme: bool) {
        let codes: Vec<u8> = (0..k * NR)
            .map(|i| {
                if extreme {
                    0x80
                } else {
                    ((i * 37 + k) % 256) as u8
                }
            })
            .collect();
        let scales: Vec<f32> = (0..k.div_ceil(kblock) * NR)
            .map(|i| 0.01 + ((i * 7 + kblock) % 13) as f32 * 0.037)
            .collect();
        let x: Vec<f32> = (0..R * k)
            .map(|i| {
                if extreme {
                    -1.0
                } else {
                    ((i * 13) % 17) as f32 / 17.0 - 0.5
                }
            })
            .collect();
        let mut q = QuantizedRows::default();
        q.quantize(&x, R, k, xblock);
        for kernels in variants() {
            let mut out = [[f32::NAN; NR]; R];
            kernels.gemv_int8::<R>(
                &q.q, k, &q.scales, q.blocks, &codes, &scales, k, kblock, xblock, &mut out,
            );
            for (r, row) in out.iter().enumerate() {
                for (j, &got) in row.iter().enumerate() {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for b in 0..k.div_ceil(xblock) {
                        let mut sum = 0i64;
                        for p in b * xblock..((b + 1) * xblock).min(k) {
                            sum += i64::from(q.q[r * k + p]) * i64::from(codes[p * NR + j] as i8);
                        }
                        let s = f64::from(scales[b * xblock / kblock * NR + j]);
                        let xs = f64::from(q.scales[r * q.blocks + b]);
                        want += sum as f64 * s * xs;
                        mag += (sum as f64 * s * xs).abs();
                    }
                    let got = f64::from(got);
                    assert!(
                        (got - want).abs() <= 1e-6 * mag.max(1e-30),
                        "{:?} R={R} k={k} kblock={kblock} xblock={xblock} row {r} col {j}: \
                         {got} vs {want}",
                        kernels.isa()
                    );
                }
            }
        }
    }

    #[test]
    fn every_variant_sums_blocks_of_integer_products_times_their_scales() {
        for (k, kblock, xblock) in [
            (2, 2, 2),
            (1, 2, 2),
            (8, 8, 8),
            (70, 8, 8),
            (71, 8, 8),
            (130, 128, 128),
            (1024, 1024, 512),
            (1000, 2048, 512),
            (1031, 1024, 256),
            (384, 128, 64),
        ] {
            for extreme in [false, true] {
                check::<1>(k, kblock, xblock, extreme);
                check::<2>(k, kblock, xblock, extreme);
                check::<3>(k, kblock, xblock, extreme);
                check::<4>(k, kblock, xblock, extreme);
            }
        }
    }

    #[test]
    fn no_steps_give_zeros() {
        for kernels in variants() {
            let mut out = [[f32::NAN; NR]; 2];
            kernels.gemv_int8::<2>(&[], 0, &[], 0, &[], &[], 0, 8, 8, &mut out);
            assert_eq!(out, [[0.0; NR]; 2]);
        }
    }
}
