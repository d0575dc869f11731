//! Products over quantized weights kept as stored (one byte a weight: FP8 e4m3 codes or
//! signed 8-bit integers, [`CodeKind`]) with their scales, for
//! the quantized linears (`packed/codes.rs`): a code panel is `[k][NR]` bytes, its scales
//! `[⌈k/kblock⌉][NR]` f32 (one per column per block of `kblock` steps).
//!
//! The decode GEMV sums each block's products of activations and code values in f32, then
//! adds the sum times the block's scale: the weight bytes read per token are half of bf16's.
//! The prompt GEMM widens a block of steps at a time into f32 values (code × scale, the
//! values the dequantizing reader gives, bit for bit) for the f32 tile kernel.
//!
//! On x86 the GEMV widens a code through fp16 (its bits shifted left 7 in a 16-bit lane,
//! the sign's copy masked off, are the fp16 of its value times 2⁻⁸, subnormals included;
//! `vcvtph2ps` does the rest, and the 2⁸ goes into the block's scale); the exact widening
//! of the GEMM is a shift and a mask into an f32's bits (2¹²⁰ too small) and a multiply by
//! 2¹²⁰. Neither gives the NaN codes (`0x7f`, `0xff`): they are refused when the codes are
//! read. Measured on the 2-core AVX-512 EPYC host, one thread: 20 G weights/s from cache
//! (the conversion paces it; the bf16 GEMV does 35), 17 from memory against bf16's 11.

use super::{rows_fit, Isa, Kernels, NR};
use crate::runtime::weights::e4m3_to_f32;

/// What a byte of a code panel holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeKind {
    /// FP8 e4m3 (`float8_e4m3fn`), no NaN codes.
    E4m3,
    /// A signed 8-bit integer.
    Int8,
}

impl CodeKind {
    /// The value of code `b` before its scale.
    #[inline(always)]
    pub fn value(self, b: u8) -> f32 {
        match self {
            CodeKind::E4m3 => e4m3_to_f32(b),
            CodeKind::Int8 => b as i8 as f32,
        }
    }
}

/// Runs `$call` with `$w` the x86 widening type of `$kind`.
#[cfg(target_arch = "x86_64")]
macro_rules! by_kind {
    ($kind:expr, $w:ident => $call:expr) => {
        match $kind {
            CodeKind::E4m3 => {
                type $w = x86::E4m3;
                $call
            }
            CodeKind::Int8 => {
                type $w = x86::Int8;
                $call
            }
        }
    };
}

impl Kernels {
    /// `out[r][j] = Σ_b scales[b][j] · Σ_{p ∈ block b} x[r][p] · value(codes[p][j])` for
    /// `R` rows of `x` (stride `ldx`) over `k` steps in blocks of `kblock`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_codes<const R: usize>(
        self,
        x: &[f32],
        ldx: usize,
        kind: CodeKind,
        codes: &[u8],
        scales: &[f32],
        k: usize,
        kblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        assert!(kblock > 0, "gemv: empty scale blocks");
        assert!(rows_fit(x.len(), R, ldx, k), "gemv: x too short");
        assert!(codes.len() >= k * NR, "gemv: panel too short");
        assert!(
            scales.len() >= k.div_ceil(kblock) * NR,
            "gemv: scales too short"
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the variant was checked against the host; the asserts keep every read of
        // x, of the codes and of the scales in bounds.
        match self.gemv_variant(false) {
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                return unsafe {
                    by_kind!(kind, W => x86::gemv_avx512::<R, W>(x, ldx, codes, scales, k, kblock, out))
                };
            }
            Isa::Avx2 => {
                return unsafe {
                    by_kind!(kind, W => x86::gemv_avx2::<R, W>(x, ldx, codes, scales, k, kblock, out))
                };
            }
            Isa::Portable => {}
        }
        gemv_portable::<R>(x, ldx, kind, codes, scales, k, kblock, out)
    }

    /// Steps `[p0, p0 + kc)` of a code panel as f32 `[kc][NR]` values into `dst`: each code
    /// times its block's scale, as the dequantizing reader computes them.
    #[allow(clippy::too_many_arguments)]
    pub fn widen_codes(
        self,
        kind: CodeKind,
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        assert!(kblock > 0, "widen: empty scale blocks");
        assert!(dst.len() >= kc * NR, "widen: dst too short");
        assert!(codes.len() >= (p0 + kc) * NR, "widen: panel too short");
        assert!(
            kc == 0 || scales.len() >= ((p0 + kc - 1) / kblock + 1) * NR,
            "widen: scales too short"
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `gemv_codes`; the asserts bound every read and write.
        match self.gemm_variant(false) {
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                return unsafe {
                    by_kind!(kind, W => x86::widen_avx512::<W>(codes, scales, kblock, p0, kc, dst))
                };
            }
            Isa::Avx2 => {
                return unsafe {
                    by_kind!(kind, W => x86::widen_avx2::<W>(codes, scales, kblock, p0, kc, dst))
                };
            }
            Isa::Portable => {}
        }
        for p in 0..kc {
            let s = &scales[(p0 + p) / kblock * NR..][..NR];
            let c = &codes[(p0 + p) * NR..][..NR];
            for j in 0..NR {
                dst[p * NR + j] = kind.value(c[j]) * s[j];
            }
        }
    }
}

impl Kernels {
    /// A code panel of `k` steps as a bf16 pair panel (`[kp/2][NR][2]`, all of `out`
    /// written, zero past `k`): each value code × scale, rounded to nearest even — the
    /// panel that packing the dequantized weight as bf16 gives, for the bf16 products.
    pub fn codes_to_bf16_pairs(
        self,
        kind: CodeKind,
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        assert!(kblock > 0, "widen: empty scale blocks");
        assert!(codes.len() >= k * NR, "widen: panel too short");
        assert!(
            scales.len() >= k.div_ceil(kblock) * NR,
            "widen: scales too short"
        );
        assert!(
            out.len() >= k.div_ceil(2) * 2 * NR && out.len().is_multiple_of(2 * NR),
            "widen: out too short"
        );
        #[cfg(target_arch = "x86_64")]
        if self.isa() >= Isa::Avx512Bf16 {
            // SAFETY: AVX-512F, BW and BF16 were checked against the host; the asserts bound
            // every access.
            return unsafe {
                by_kind!(kind, W => x86::bf16_pairs_avx512bf16::<W>(codes, scales, kblock, k, out))
            };
        }
        if self.isa() >= Isa::Avx512 {
            // SAFETY: AVX-512F was checked against the host; the asserts bound every access.
            return unsafe {
                by_kind!(kind, W => x86::bf16_pairs_avx512::<W>(codes, scales, kblock, k, out))
            };
        }
        out.fill(0);
        for p in 0..k {
            let s = &scales[p / kblock * NR..][..NR];
            for j in 0..NR {
                let v = kind.value(codes[p * NR + j]) * s[j];
                out[(p / 2) * 2 * NR + 2 * j + (p & 1)] = super::round_bf16(v);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gemv_portable<const R: usize>(
    x: &[f32],
    ldx: usize,
    kind: CodeKind,
    codes: &[u8],
    scales: &[f32],
    k: usize,
    kblock: usize,
    out: &mut [[f32; NR]; R],
) {
    *out = [[0f32; NR]; R];
    for (b, s) in scales.chunks_exact(NR).take(k.div_ceil(kblock)).enumerate() {
        let mut acc = [[0f32; NR]; R];
        for p in b * kblock..k.min((b + 1) * kblock) {
            let c = &codes[p * NR..][..NR];
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = x[r * ldx + p];
                for (a, &c) in a.iter_mut().zip(c) {
                    *a += xv * kind.value(c);
                }
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            for j in 0..NR {
                o[j] += a[j] * s[j];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::streams::prefetch_one_stream;
    use super::NR;
    use std::arch::x86_64::*;

    /// 2¹²⁰: a code's bits placed as an f32's, times this, is its value.
    const RESCALE: f32 = f32::from_bits((127 + 120) << 23);
    /// Sign, the four exponent bits and the three mantissa bits of a code shifted left 20.
    const KEEP: i32 = 0x87f0_0000u32 as i32;

    /// 16 codes from `p` as f32 values.
    #[inline(always)]
    unsafe fn e4m3x16(p: *const u8) -> __m512 {
        let t = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
        let bits = _mm512_and_si512(_mm512_slli_epi32::<20>(t), _mm512_set1_epi32(KEEP));
        _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(RESCALE))
    }

    /// 8 codes from `p` as f32 values.
    #[inline(always)]
    unsafe fn e4m3x8(p: *const u8) -> __m256 {
        let t = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let bits = _mm256_and_si256(_mm256_slli_epi32::<20>(t), _mm256_set1_epi32(KEEP));
        _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(RESCALE))
    }

    /// How the kernels widen one kind of code.
    pub trait Widen {
        /// What [`Widen::gemv16`]'s values are short of the codes' (a power of two).
        const UNIT: f32;
        /// 16 codes from `p` as f32 values divided by `UNIT` (the GEMV's cheapest widening).
        unsafe fn gemv16(p: *const u8) -> __m512;
        /// 16 and 8 codes from `p` as their f32 values, exactly.
        unsafe fn exact16(p: *const u8) -> __m512;
        unsafe fn exact8(p: *const u8) -> __m256;
        /// [`Widen::gemv16`] for AVX2 (with F16C): codes 0–7 and 8–15 of `p`.
        unsafe fn gemv8x2(p: *const u8) -> [__m256; 2];
    }

    pub struct E4m3;
    pub struct Int8;

    impl Widen for E4m3 {
        const UNIT: f32 = 256.0;
        #[inline(always)]
        unsafe fn gemv16(p: *const u8) -> __m512 {
            e4m3x16_over_256(p)
        }
        #[inline(always)]
        unsafe fn exact16(p: *const u8) -> __m512 {
            e4m3x16(p)
        }
        #[inline(always)]
        unsafe fn exact8(p: *const u8) -> __m256 {
            e4m3x8(p)
        }
        #[inline(always)]
        unsafe fn gemv8x2(p: *const u8) -> [__m256; 2] {
            let h = e4m3x16_as_fp16_over_256(p);
            [
                _mm256_cvtph_ps(_mm256_castsi256_si128(h)),
                _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)),
            ]
        }
    }

    impl Widen for Int8 {
        const UNIT: f32 = 1.0;
        #[inline(always)]
        unsafe fn gemv16(p: *const u8) -> __m512 {
            Self::exact16(p)
        }
        #[inline(always)]
        unsafe fn exact16(p: *const u8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn exact8(p: *const u8) -> __m256 {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn gemv8x2(p: *const u8) -> [__m256; 2] {
            [Self::exact8(p), Self::exact8(p.add(8))]
        }
    }

    /// 16 codes from `p` as f32 values times 2⁻⁸, through fp16: a code's bits shifted
    /// left 7 in a 16-bit lane are an fp16's (bias 15 against e4m3's 7, subnormals
    /// included) once the sign's copy in bit 14 is cleared; fp16 → f32 is one instruction.
    /// Cheaper than [`e4m3x16`] (16-bit lanes, no multiply), and every value stays normal.
    #[inline(always)]
    unsafe fn e4m3x16_over_256(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(e4m3x16_as_fp16_over_256(p))
    }

    /// 16 codes from `p` as fp16 values times 2⁻⁸ (see [`e4m3x16_over_256`]).
    #[inline(always)]
    unsafe fn e4m3x16_as_fp16_over_256(p: *const u8) -> __m256i {
        let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
        _mm256_and_si256(
            _mm256_slli_epi16::<7>(w),
            _mm256_set1_epi16(0xbf80u16 as i16),
        )
    }

    /// Four steps a round, four sums per row (chains in flight); each block's sums, times
    /// 2⁸ and its scales, into the row's total.
    ///
    /// # Safety
    /// AVX-512F; as `Kernels::gemv_codes` asserts.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemv_avx512<const R: usize, W: Widen>(
        x: &[f32],
        ldx: usize,
        codes: &[u8],
        scales: &[f32],
        k: usize,
        kblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        let c = codes.as_ptr();
        let xp = x.as_ptr();
        let mut tot = [_mm512_setzero_ps(); R];
        let mut b0 = 0;
        let mut b = 0;
        while b0 < k {
            let b1 = (b0 + kblock).min(k);
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            let mut p = b0;
            while p + 4 <= b1 {
                prefetch_one_stream(c.add(p * NR));
                let w = [0, 1, 2, 3].map(|i| W::gemv16(c.add((p + i) * NR)));
                for (r, a) in acc.iter_mut().enumerate() {
                    for i in 0..4 {
                        let xv = _mm512_set1_ps(*xp.add(r * ldx + p + i));
                        a[i] = _mm512_fmadd_ps(xv, w[i], a[i]);
                    }
                }
                p += 4;
            }
            while p < b1 {
                let w = W::gemv16(c.add(p * NR));
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(*xp.add(r * ldx + p));
                    a[0] = _mm512_fmadd_ps(xv, w, a[0]);
                }
                p += 1;
            }
            let s = _mm512_loadu_ps(scales.as_ptr().add(b * NR));
            for (t, a) in tot.iter_mut().zip(&acc) {
                let sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
                let sum = _mm512_mul_ps(sum, _mm512_set1_ps(W::UNIT));
                *t = _mm512_fmadd_ps(sum, s, *t);
            }
            b0 = b1;
            b += 1;
        }
        for (o, t) in out.iter_mut().zip(&tot) {
            _mm512_storeu_ps(o.as_mut_ptr(), *t);
        }
    }

    /// Two halves of eight columns, one step at a time (two chains per row); each block's
    /// sums, times 2⁸ for FP8 (see [`Widen::gemv8x2`]) and its scales, added into `out`
    /// (AVX2's 16 registers hold no more). More chains (a round of 4 steps, 8 chains for
    /// one row) measured no faster on Zen 1: the widening, not the multiply-adds' latency,
    /// paces it.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; as `Kernels::gemv_codes` asserts.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gemv_avx2<const R: usize, W: Widen>(
        x: &[f32],
        ldx: usize,
        codes: &[u8],
        scales: &[f32],
        k: usize,
        kblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        let c = codes.as_ptr();
        let xp = x.as_ptr();
        let unit = _mm256_set1_ps(W::UNIT);
        *out = [[0f32; NR]; R];
        let mut b0 = 0;
        let mut b = 0;
        while b0 < k {
            let b1 = (b0 + kblock).min(k);
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for p in b0..b1 {
                prefetch_one_stream(c.add(p * NR));
                let [lo, hi] = W::gemv8x2(c.add(p * NR));
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_set1_ps(*xp.add(r * ldx + p));
                    a[0] = _mm256_fmadd_ps(xv, lo, a[0]);
                    a[1] = _mm256_fmadd_ps(xv, hi, a[1]);
                }
            }
            let s = scales.as_ptr().add(b * NR);
            for (o, a) in out.iter_mut().zip(&acc) {
                for (h, &a) in a.iter().enumerate() {
                    let o = o.as_mut_ptr().add(8 * h);
                    let a = _mm256_mul_ps(a, unit);
                    let t = _mm256_fmadd_ps(a, _mm256_loadu_ps(s.add(8 * h)), _mm256_loadu_ps(o));
                    _mm256_storeu_ps(o, t);
                }
            }
            b0 = b1;
            b += 1;
        }
    }

    /// f32 values rounded to bf16 (nearest even; no NaN among them), in the upper halves.
    #[inline(always)]
    unsafe fn round_bf16x16(v: __m512) -> __m512i {
        let b = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        _mm512_and_si512(r, _mm512_set1_epi32(-65536))
    }

    /// How two steps' f32 values (16 columns each) become a row of bf16 pairs (`[NR][2]`,
    /// the even step first), rounded to nearest even.
    pub trait PairBits {
        unsafe fn pair(even: __m512, odd: __m512) -> __m512i;
    }

    /// In integers (AVX-512F; no NaN among the values): the even step's low half is
    /// shifted out, so its rounding needs no mask.
    pub struct PairByIntegers;

    impl PairBits for PairByIntegers {
        #[inline(always)]
        unsafe fn pair(even: __m512, odd: __m512) -> __m512i {
            let e = _mm512_castps_si512(even);
            let e_odd = _mm512_and_si512(_mm512_srli_epi32::<16>(e), _mm512_set1_epi32(1));
            let e = _mm512_add_epi32(e, _mm512_add_epi32(e_odd, _mm512_set1_epi32(0x7fff)));
            _mm512_or_si512(_mm512_srli_epi32::<16>(e), round_bf16x16(odd))
        }
    }

    /// With `vcvtne2ps2bf16` and a word permute (AVX512-BF16 and BW): two operations
    /// instead of eleven. The instruction takes subnormal values as zero: a weight under
    /// 1.2e-38 becomes 0 here where the integer form keeps it, a difference far below
    /// the rounding of any sum it enters.
    pub struct PairByBf16;

    /// Word `2j` of a pair row is word `j` of the conversion (the even step), word `2j + 1`
    /// is word `16 + j` (the odd one).
    static INTERLEAVE: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut j = 0;
        while j < 16 {
            idx[2 * j] = j as u16;
            idx[2 * j + 1] = 16 + j as u16;
            j += 1;
        }
        idx
    };

    impl PairBits for PairByBf16 {
        #[inline(always)]
        unsafe fn pair(even: __m512, odd: __m512) -> __m512i {
            let halves = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even));
            let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr() as *const __m512i);
            _mm512_permutexvar_epi16(idx, halves)
        }
    }

    /// # Safety
    /// AVX-512F; as `Kernels::codes_to_bf16_pairs` asserts.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn bf16_pairs_avx512<W: Widen>(
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        bf16_pairs::<W, PairByIntegers>(codes, scales, kblock, k, out)
    }

    /// # Safety
    /// AVX-512F, BW and BF16; as `Kernels::codes_to_bf16_pairs` asserts.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn bf16_pairs_avx512bf16<W: Widen>(
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        bf16_pairs::<W, PairByBf16>(codes, scales, kblock, k, out)
    }

    #[inline(always)]
    unsafe fn bf16_pairs<W: Widen, P: PairBits>(
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        // Scales are read once per block (no division per step).
        let scale = |b: usize| _mm512_loadu_ps(scales.as_ptr().add(b * NR));
        let value = |p: usize, s: __m512| _mm512_mul_ps(W::exact16(codes.as_ptr().add(p * NR)), s);
        let dst = out.as_mut_ptr() as *mut __m512i;
        let mut p = 0;
        while p < k {
            let block = p / kblock;
            let end = ((block + 1) * kblock).min(k);
            let s = scale(block);
            while p + 1 < end {
                // Lines not yet in cache (the first pair of a chunk) are asked for ahead.
                prefetch_one_stream(codes.as_ptr().add(p * NR));
                _mm512_storeu_si512(dst.add(p / 2), P::pair(value(p, s), value(p + 1, s)));
                p += 2;
            }
            if p < end {
                // The block's last step is even: its pair's odd step opens the next block.
                let odd = if p + 1 < k {
                    value(p + 1, scale(block + 1))
                } else {
                    _mm512_setzero_ps()
                };
                _mm512_storeu_si512(dst.add(p / 2), P::pair(value(p, s), odd));
                p += 2;
            }
        }
        for i in k.div_ceil(2)..out.len() / (2 * NR) {
            _mm512_storeu_si512(dst.add(i), _mm512_setzero_si512());
        }
    }

    /// # Safety
    /// AVX-512F; as `Kernels::widen_codes` asserts.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen_avx512<W: Widen>(
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        for p in 0..kc {
            let s = _mm512_loadu_ps(scales.as_ptr().add((p0 + p) / kblock * NR));
            let w = W::exact16(codes.as_ptr().add((p0 + p) * NR));
            _mm512_storeu_ps(dst.as_mut_ptr().add(p * NR), _mm512_mul_ps(w, s));
        }
    }

    /// # Safety
    /// AVX2; as `Kernels::widen_codes` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_avx2<W: Widen>(
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        for p in 0..kc {
            let s = scales.as_ptr().add((p0 + p) / kblock * NR);
            for h in 0..2 {
                let w = W::exact8(codes.as_ptr().add((p0 + p) * NR + 8 * h));
                let v = _mm256_mul_ps(w, _mm256_loadu_ps(s.add(8 * h)));
                _mm256_storeu_ps(dst.as_mut_ptr().add(p * NR + 8 * h), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code but e4m3's NaNs, a few times over, in a panel of `k` steps.
    fn panel(k: usize, seed: usize) -> Vec<u8> {
        (0..k * NR)
            .map(|i| {
                let b = ((i * 37 + seed * 11) % 256) as u8;
                if b & 0x7f == 0x7f {
                    0x3c
                } else {
                    b
                }
            })
            .collect()
    }

    const KINDS: [CodeKind; 2] = [CodeKind::E4m3, CodeKind::Int8];

    fn variants() -> Vec<Kernels> {
        Isa::ALL
            .into_iter()
            .filter_map(|i| Kernels::unchecked(i).ok())
            .collect()
    }

    #[test]
    fn widened_codes_are_their_values_times_their_block_scales_on_every_variant() {
        let (k, kblock) = (37, 8);
        let codes = panel(k, 1);
        let scales: Vec<f32> = (0..k.div_ceil(kblock) * NR)
            .map(|i| 0.01 + i as f32 * 0.37)
            .collect();
        for (kernels, kind) in variants().into_iter().flat_map(|v| KINDS.map(|c| (v, c))) {
            for (p0, kc) in [(0, k), (5, 20), (36, 1)] {
                let mut got = vec![f32::NAN; kc * NR];
                kernels.widen_codes(kind, &codes, &scales, kblock, p0, kc, &mut got);
                for p in 0..kc {
                    for j in 0..NR {
                        let want = kind.value(codes[(p0 + p) * NR + j])
                            * scales[(p0 + p) / kblock * NR + j];
                        assert_eq!(
                            got[p * NR + j].to_bits(),
                            want.to_bits(),
                            "{:?} {kind:?} step {} col {j}",
                            kernels.isa(),
                            p0 + p
                        );
                    }
                }
            }
        }
    }

    fn check<const R: usize>(k: usize, kblock: usize) {
        let codes = panel(k, k + kblock);
        let scales: Vec<f32> = (0..k.div_ceil(kblock) * NR)
            .map(|i| 0.5 + ((i * 7) % 13) as f32 * 0.125)
            .collect();
        let ldx = k + 3;
        let x: Vec<f32> = (0..R * ldx)
            .map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.5)
            .collect();
        for (kernels, kind) in variants().into_iter().flat_map(|v| KINDS.map(|c| (v, c))) {
            let mut out = [[f32::NAN; NR]; R];
            kernels.gemv_codes::<R>(&x, ldx, kind, &codes, &scales, k, kblock, &mut out);
            for r in 0..R {
                for j in 0..NR {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for p in 0..k {
                        let w = kind.value(codes[p * NR + j]) as f64
                            * scales[p / kblock * NR + j] as f64;
                        want += x[r * ldx + p] as f64 * w;
                        mag += (x[r * ldx + p] as f64 * w).abs();
                    }
                    let got = out[r][j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * mag.max(1e-30),
                        "{:?} {kind:?} R={R} k={k} kblock={kblock} row {r} col {j}: {got} vs {want}",
                        kernels.isa()
                    );
                }
            }
        }
    }

    #[test]
    fn every_variant_sums_blocks_of_codes_times_their_scales() {
        for (k, kblock) in [
            (1, 1),
            (3, 8),
            (7, 4),
            (16, 16),
            (37, 8),
            (130, 128),
            (257, 64),
        ] {
            check::<1>(k, kblock);
            check::<2>(k, kblock);
            check::<3>(k, kblock);
            check::<4>(k, kblock);
        }
    }

    #[test]
    fn code_panels_round_to_the_bf16_panels_of_their_values_on_every_variant() {
        use super::super::PanelValue;
        for (k, kblock) in [(1, 1), (5, 4), (9, 1), (11, 3), (37, 8), (64, 16)] {
            let codes = panel(k, 3);
            let scales: Vec<f32> = (0..k.div_ceil(kblock) * NR)
                .map(|i| 1e-3 * (1.0 + ((i * 29) % 31) as f32 / 7.0))
                .collect();
            for (kernels, kind) in variants().into_iter().flat_map(|v| KINDS.map(|c| (v, c))) {
                let mut got = vec![0xdead; u16::panel_len(k)];
                kernels.codes_to_bf16_pairs(kind, &codes, &scales, kblock, k, &mut got);
                for p in 0..k.next_multiple_of(super::super::BF16_K_ALIGN) {
                    for j in 0..NR {
                        let want = if p < k {
                            let v = kind.value(codes[p * NR + j]) * scales[p / kblock * NR + j];
                            half::bf16::from_f32(v).to_bits()
                        } else {
                            0
                        };
                        assert_eq!(
                            got[u16::slot(p, j)],
                            want,
                            "{:?} {kind:?} k={k} step {p} col {j}",
                            kernels.isa()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn no_steps_give_zeros() {
        for (kernels, kind) in variants().into_iter().flat_map(|v| KINDS.map(|c| (v, c))) {
            let mut out = [[f32::NAN; NR]; 2];
            kernels.gemv_codes::<2>(&[], 0, kind, &[], &[], 0, 8, &mut out);
            assert_eq!(out, [[0.0; NR]; 2]);
        }
    }
}
