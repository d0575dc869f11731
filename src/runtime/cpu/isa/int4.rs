//! Products over INT4 weights kept as their 4-bit codes (GPTQ, AWQ), for the INT4 linears
//! (`packed/int4.rs`). A panel's codes come in quads of 4 steps, 32 bytes each: byte `b`
//! of quad `i` holds column `b / 4`'s code of step `4i + b % 4` in its low nibble and
//! column `8 + b / 4`'s in its high one, so that masking a quad gives, for 8 columns, each
//! column's 4 steps side by side (what a pairwise integer multiply-add sums). Its scales and
//! zero points are `[⌈k/kblock⌉][NR]` f32 each, one per column per block of `kblock` steps
//! (a group of the checkpoint); a weight's value is `(code − zero) × scale`.
//!
//! In a bf16 run (whose products may round activations to bf16) the decode GEMV multiplies
//! integers: each row of activations is quantized to i16 per
//! block of `xblock` steps (a divisor of `kblock`; scale `max |x| / 32767`, an error of at
//! most 2⁻¹⁶ of the block's largest |x| per element, far below bf16's rounding), and
//! `vpmaddwd` sums code × activation pairs exactly into i32. Per block:
//! `out += scale · xscale · (Σ code·xq − zero · Σ xq)`. A quad (64 weights) costs a load, two
//! masks, four widenings, four multiply-adds and four adds; measured on the AVX2 EPYC host,
//! the f32 form (widen, convert, fused multiply-add per weight) ran 6.5 G weights/s a core,
//! under the 14 a core that reading the codes at the host's bandwidth allows; the integer
//! form runs 13–14. Where the host has AVX512-VNNI (the AVX512-BF16 variants), `vpdpbusd`
//! multiplies the codes by the i16 activations split into bytes (`gemv_vnni`): the same
//! integer sums, a third of the operations; measured on the 2-core Zen 4 host (one row
//! over 16 KiB panels of 2048 steps, one thread, from L3) 17.2–17.7 GB/s of codes against
//! the AVX2 form's 12.8–13.0, level (23 GB/s, the host's read rate) from memory.
//! An f32 run keeps f32 activations (the quantization's error, up to
//! 1.3e-4 of a fixture's logits, exceeds the f32 tolerance): its decode rows take the
//! widened values and the f32 GEMV (`packed.rs`).
//! The prompt GEMM widens a block of steps at a time into f32 values (`(code − zero) ×
//! scale`, the values the dequantizing reader gives, bit for bit) for the f32 tile kernel,
//! or into bf16 pairs for the bf16 products.

use super::{rows_fit, Isa, Kernels, NR};

/// Bytes of a quad: 4 steps of 16 columns.
pub const QUAD_BYTES: usize = 2 * NR;

/// The value of an INT4 code: `(code − zero) × scale`, as the reader computes it.
#[inline(always)]
pub fn int4_value(code: u8, zero: f32, scale: f32) -> f32 {
    (f32::from(code) - zero) * scale
}

/// Where column `j`'s code of step `p` lies in a panel: (byte, shift).
#[inline(always)]
pub fn int4_slot(p: usize, j: usize) -> (usize, u32) {
    (p / 4 * QUAD_BYTES + (j % 8) * 4 + p % 4, 4 * (j / 8) as u32)
}

/// The code of step `p`, column `j` of a panel.
#[inline(always)]
pub fn int4_code(codes: &[u8], p: usize, j: usize) -> u8 {
    let (at, shift) = int4_slot(p, j);
    (codes[at] >> shift) & 0xf
}

/// Row activations quantized to i16 per block of `xblock` steps for [`Kernels::gemv_int4`]:
/// `q[r·k + p]`, and per row per block the scale and the sum of the block's `q`.
#[derive(Debug, Default)]
pub struct QuantizedRows {
    pub q: Vec<i16>,
    /// `q` as bytes for the VNNI GEMV, made by [`QuantizedRows::split_into_bytes`] (empty
    /// until then): per row `2k` bytes, per 4 steps the low bytes of their `q` (unsigned) then the high bytes
    /// (signed), so that `q = 256 · high + low` and each four is one broadcast.
    pub split: Vec<u8>,
    pub scales: Vec<f32>,
    pub sums: Vec<f32>,
    pub blocks: usize,
}

impl QuantizedRows {
    pub const fn new() -> QuantizedRows {
        QuantizedRows {
            q: Vec::new(),
            split: Vec::new(),
            scales: Vec::new(),
            sums: Vec::new(),
            blocks: 0,
        }
    }

    /// `m` rows of `k` from `x`, in blocks of `xblock`.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize, xblock: usize) {
        let blocks = k.div_ceil(xblock.max(1));
        self.blocks = blocks;
        self.q.clear();
        self.q.resize(m * k, 0);
        self.scales.clear();
        self.scales.resize(m * blocks, 0.0);
        self.sums.clear();
        self.sums.resize(m * blocks, 0.0);
        for (r, row) in x.chunks_exact(k).take(m).enumerate() {
            for (b, xs) in row.chunks(xblock.max(1)).enumerate() {
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                // A NaN or an infinity in the block gives a NaN or infinite scale: the
                // block's outputs are NaN, as the f32 product's would be.
                let bad = xs.iter().any(|v| !v.is_finite());
                let scale = if bad { f32::NAN } else { amax / 32767.0 };
                let inv = if amax > 0.0 && !bad {
                    32767.0 / amax
                } else {
                    0.0
                };
                let q = &mut self.q[r * k + b * xblock..][..xs.len()];
                let mut sum = 0i64;
                for (q, &v) in q.iter_mut().zip(xs) {
                    *q = (v * inv).round().clamp(-32767.0, 32767.0) as i16;
                    sum += i64::from(*q);
                }
                self.scales[r * blocks + b] = scale;
                self.sums[r * blocks + b] = sum as f32;
            }
        }
        // A split of earlier rows must not outlive them.
        self.split.clear();
    }

    /// Lays `q` out as [`QuantizedRows::split`] (for the GEMV that reads it:
    /// [`Kernels::int4_reads_split`]); rows whose depth is no multiple of 4 get none.
    pub fn split_into_bytes(&mut self) {
        self.split.clear();
        if self.q.len().is_multiple_of(4) {
            self.split.reserve(2 * self.q.len());
            for four in self.q.chunks_exact(4) {
                self.split.extend(four.iter().map(|v| v.to_le_bytes()[0]));
                self.split.extend(four.iter().map(|v| v.to_le_bytes()[1]));
            }
        }
    }
}

impl Kernels {
    /// `out[r][j] = Σ_b scales[g(b)][j] · xscales[r][b] · (Σ_{p ∈ b} xq[r][p] · code(p, j) −
    /// zeros[g(b)][j] · xsums[r][b])` for `R` rows of `xq` (stride `ldx`) over `k` steps in
    /// activation blocks `b` of `xblock` steps, `g(b)` the block of `kblock` steps holding
    /// it (`xblock` divides `kblock`, both multiples of 4, as is `k`); `xscales` and `xsums`
    /// with stride `lds`. `xsplit` is `xq` as [`QuantizedRows::split`] lays it out (`2·ldx`
    /// bytes a row), read where the host has AVX512-VNNI.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_int4<const R: usize>(
        self,
        xq: &[i16],
        xsplit: &[u8],
        ldx: usize,
        xscales: &[f32],
        xsums: &[f32],
        lds: usize,
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        k: usize,
        kblock: usize,
        xblock: usize,
        out: &mut [[f32; NR]; R],
    ) {
        assert!(
            xblock > 0
                && xblock <= 256
                && kblock.is_multiple_of(xblock)
                && xblock.is_multiple_of(4)
                && k.is_multiple_of(4),
            "gemv: int4 blocks of {xblock} steps in groups of {kblock} over {k} steps"
        );
        let blocks = k.div_ceil(xblock);
        assert!(rows_fit(xq.len(), R, ldx, k), "gemv: x too short");
        assert!(
            rows_fit(xscales.len().min(xsums.len()), R, lds, blocks),
            "gemv: x scales too short"
        );
        assert!(codes.len() >= k / 4 * QUAD_BYTES, "gemv: panel too short");
        assert!(
            scales.len().min(zeros.len()) >= k.div_ceil(kblock) * NR,
            "gemv: scales too short"
        );
        #[cfg(target_arch = "x86_64")]
        {
            let rows = |x: *const u8| x86::Int4Gemv {
                x,
                ldx,
                xscales,
                xsums,
                lds,
                codes,
                scales,
                zeros,
                k,
                kblock,
                xblock,
            };
            if self.int4_reads_split() {
                assert!(
                    rows_fit(xsplit.len(), R, 2 * ldx, 2 * k),
                    "gemv: split x too short"
                );
                // SAFETY: AVX512-VNNI was checked against the host with AVX512-BF16
                // (`detect`); the asserts keep every read in bounds and every block's sums
                // within i32.
                return unsafe { x86::gemv_vnni::<R>(&rows(xsplit.as_ptr()), out) };
            }
            if self.gemv_variant(false) >= Isa::Avx2 {
                // SAFETY: AVX2 was checked against the host (every variant above it has it);
                // the asserts keep every read in bounds and every block's sums within i32.
                return unsafe { x86::gemv_avx2::<R>(&rows(xq.as_ptr().cast()), out) };
            }
        }
        *out = [[0f32; NR]; R];
        for b in 0..blocks {
            let g = b * xblock / kblock * NR;
            let (s, z) = (&scales[g..][..NR], &zeros[g..][..NR]);
            for (r, o) in out.iter_mut().enumerate() {
                let mut acc = [0i32; NR];
                for p in b * xblock..((b + 1) * xblock).min(k) {
                    let xv = i32::from(xq[r * ldx + p]);
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a += xv * i32::from(int4_code(codes, p, j));
                    }
                }
                let (xs, sum) = (xscales[r * lds + b], xsums[r * lds + b]);
                for j in 0..NR {
                    o[j] += (acc[j] as f32 - z[j] * sum) * (s[j] * xs);
                }
            }
        }
    }

    /// Whether [`Kernels::gemv_int4`] reads the rows' [`QuantizedRows::split`] (with
    /// AVX512-VNNI: the `avx512bf16` and `amx` variants) rather than `q`.
    pub fn int4_reads_split(self) -> bool {
        cfg!(target_arch = "x86_64") && self.gemv_variant(true) >= Isa::Avx512Bf16
    }

    /// Steps `[p0, p0 + kc)` of an INT4 panel as f32 `[kc][NR]` values into `dst`:
    /// `(code − zero) × scale` of each step's block, as the dequantizing reader computes them.
    #[allow(clippy::too_many_arguments)]
    pub fn widen_int4(
        self,
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        assert!(kblock > 0, "widen: empty scale blocks");
        assert!(dst.len() >= kc * NR, "widen: dst too short");
        assert!(
            codes.len() >= (p0 + kc).div_ceil(4) * QUAD_BYTES,
            "widen: panel too short"
        );
        assert!(
            kc == 0 || (scales.len().min(zeros.len()) >= ((p0 + kc - 1) / kblock + 1) * NR),
            "widen: scales too short"
        );
        #[cfg(target_arch = "x86_64")]
        if self.gemm_variant(false) >= Isa::Avx2 {
            // SAFETY: AVX2 was checked against the host; the asserts bound every access.
            return unsafe { x86::widen_avx2(codes, scales, zeros, kblock, p0, kc, dst) };
        }
        for p in 0..kc {
            let b = (p0 + p) / kblock * NR;
            for j in 0..NR {
                dst[p * NR + j] =
                    int4_value(int4_code(codes, p0 + p, j), zeros[b + j], scales[b + j]);
            }
        }
    }

    /// An INT4 panel of `k` steps as a bf16 pair panel (`[kp/2][NR][2]`, all of `out`
    /// written, zero past `k`): each value `(code − zero) × scale` rounded to nearest even —
    /// the panel that packing the dequantized weight as bf16 gives, for the bf16 products.
    pub fn int4_to_bf16_pairs(
        self,
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        assert!(
            out.len() >= k.div_ceil(2) * 2 * NR && out.len().is_multiple_of(2 * NR),
            "widen: out too short"
        );
        #[cfg(target_arch = "x86_64")]
        if self.isa() >= Isa::Avx512 && k.is_multiple_of(4) && kblock.is_multiple_of(4) {
            let n = k.div_ceil(kblock) * NR;
            assert!(codes.len() >= k / 4 * QUAD_BYTES, "widen: panel too short");
            assert!(
                scales.len().min(zeros.len()) >= n,
                "widen: scales too short"
            );
            // The vector rounding assumes no NaN: finite scales and zeros give none.
            if scales[..n].iter().chain(&zeros[..n]).all(|v| v.is_finite()) {
                // SAFETY: AVX-512F (and BW and BF16 for that variant) were checked against
                // the host; the asserts bound every access.
                return unsafe {
                    if self.isa() >= Isa::Avx512Bf16 {
                        x86::bf16_pairs_avx512bf16(codes, scales, zeros, kblock, k, out)
                    } else {
                        x86::bf16_pairs_avx512(codes, scales, zeros, kblock, k, out)
                    }
                };
            }
        }
        let mut pair = [0f32; 2 * NR];
        for (i, dst) in out.chunks_exact_mut(2 * NR).enumerate() {
            let (p, steps) = (2 * i, k.saturating_sub(2 * i).min(2));
            pair.fill(0.0);
            if steps == 0 {
                dst.fill(0);
                continue;
            }
            self.widen_int4(codes, scales, zeros, kblock, p, steps, &mut pair);
            for j in 0..NR {
                dst[2 * j] = super::round_bf16(pair[j]);
                dst[2 * j + 1] = super::round_bf16(pair[NR + j]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::codes::x86::{PairBits, PairByBf16, PairByIntegers};
    use super::super::streams::{prefetch_one_stream, prefetch_runs};
    use super::{NR, QUAD_BYTES};
    use std::arch::x86_64::*;

    /// A quad's codes as two vectors of bytes: columns 0–7 and 8–15, each column's four
    /// steps side by side.
    #[inline(always)]
    unsafe fn quad(p: *const u8) -> (__m256i, __m256i) {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let m = _mm256_set1_epi8(0xf);
        (
            _mm256_and_si256(v, m),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m),
        )
    }

    /// One INT4 GEMV's operands (as `Kernels::gemv_int4` takes them): `x` the rows'
    /// activations, 2 bytes a step in either layout (`q`, or its split), `ldx` steps apart.
    pub struct Int4Gemv<'a> {
        pub x: *const u8,
        pub ldx: usize,
        pub xscales: &'a [f32],
        pub xsums: &'a [f32],
        pub lds: usize,
        pub codes: &'a [u8],
        pub scales: &'a [f32],
        pub zeros: &'a [f32],
        pub k: usize,
        pub kblock: usize,
        pub xblock: usize,
    }

    /// How a quad's codes meet a row's 4 activations: two ways to the same exact integer
    /// sums, a row's four accumulators `[columns 0–7 / 8–15][two parts]`.
    trait QuadProduct {
        type Codes;
        /// The quad's masked halves (columns 0–7, 8–15) as the products take them.
        unsafe fn codes(lo: __m256i, hi: __m256i) -> Self::Codes;
        /// Adds the products with the row's 4 activations at `x`.
        unsafe fn add(acc: &mut [[__m256i; 2]; 2], w: &Self::Codes, x: *const u8);
        /// A block's column sums `Σ code · q`, columns 0–7 and 8–15.
        unsafe fn columns(acc: &[[__m256i; 2]; 2]) -> [__m256i; 2];
    }

    /// AVX2: codes widened to i16, `vpmaddwd` with the i16 activations; every lane a pair
    /// of a column's steps, the low and high bytes of each half of the quad apart.
    struct Madd;

    impl QuadProduct for Madd {
        type Codes = [[__m256i; 2]; 2];
        #[inline(always)]
        unsafe fn codes(lo: __m256i, hi: __m256i) -> Self::Codes {
            let zero = _mm256_setzero_si256();
            [
                [
                    _mm256_unpacklo_epi8(lo, zero),
                    _mm256_unpackhi_epi8(lo, zero),
                ],
                [
                    _mm256_unpacklo_epi8(hi, zero),
                    _mm256_unpackhi_epi8(hi, zero),
                ],
            ]
        }
        #[inline(always)]
        unsafe fn add(acc: &mut [[__m256i; 2]; 2], w: &Self::Codes, x: *const u8) {
            let x = _mm256_set1_epi64x((x as *const i64).read_unaligned());
            for h in 0..2 {
                for e in 0..2 {
                    acc[h][e] = _mm256_add_epi32(acc[h][e], _mm256_madd_epi16(w[h][e], x));
                }
            }
        }
        #[inline(always)]
        unsafe fn columns(acc: &[[__m256i; 2]; 2]) -> [__m256i; 2] {
            // Lane pairs (0, 1) (2, 3) of the low bytes' sums are columns 0–1 and 4–5 of
            // the half, of the high bytes' 2–3 and 6–7: one add in order.
            [
                _mm256_hadd_epi32(acc[0][0], acc[0][1]),
                _mm256_hadd_epi32(acc[1][0], acc[1][1]),
            ]
        }
    }

    /// AVX512-VNNI: each 32-bit lane of a masked half is one column's 4 codes (0–15); two
    /// `vpdpbusd` meet the 4 activations split into bytes (`q = 256 · high + low`): low
    /// bytes (unsigned) × codes (as signed), codes (as unsigned) × high bytes (signed), and
    /// `low + 256 · high` is `Σ code · q` exactly, in column order. A quad costs a load, a
    /// shift, two masks and four multiply-adds a row, where [`Madd`] adds four widenings
    /// and, a row, a broadcast and four more adds.
    struct Dpbusd;

    impl QuadProduct for Dpbusd {
        type Codes = [__m256i; 2];
        #[inline(always)]
        unsafe fn codes(lo: __m256i, hi: __m256i) -> Self::Codes {
            [lo, hi]
        }
        #[inline(always)]
        unsafe fn add(acc: &mut [[__m256i; 2]; 2], w: &Self::Codes, x: *const u8) {
            let x = x as *const i32;
            let low = _mm256_set1_epi32(x.read_unaligned());
            let high = _mm256_set1_epi32(x.add(1).read_unaligned());
            for h in 0..2 {
                acc[h][0] = _mm256_dpbusd_epi32(acc[h][0], low, w[h]);
                acc[h][1] = _mm256_dpbusd_epi32(acc[h][1], w[h], high);
            }
        }
        #[inline(always)]
        unsafe fn columns(acc: &[[__m256i; 2]; 2]) -> [__m256i; 2] {
            [
                _mm256_add_epi32(acc[0][0], _mm256_slli_epi32::<8>(acc[0][1])),
                _mm256_add_epi32(acc[1][0], _mm256_slli_epi32::<8>(acc[1][1])),
            ]
        }
    }

    /// Each block: per row the exact column sums `P` gives, converted, less the zero times
    /// the block's sum, times the scales.
    #[inline(always)]
    unsafe fn gemv_blocks<const R: usize, P: QuadProduct>(g: &Int4Gemv, out: &mut [[f32; NR]; R]) {
        let c = g.codes.as_ptr();
        let groups = g.k.div_ceil(g.kblock) * NR;
        prefetch_runs(&[&g.scales[..groups], &g.zeros[..groups]]);
        let mut tot = [[_mm256_setzero_ps(); 2]; R];
        let mut b0 = 0;
        while b0 < g.k {
            // The last block may be short (a group cut short by the depth).
            let b1 = (b0 + g.xblock).min(g.k);
            let mut acc = [[[_mm256_setzero_si256(); 2]; 2]; R];
            for i in b0 / 4..b1 / 4 {
                let at = c.add(i * QUAD_BYTES);
                prefetch_one_stream(at);
                let (lo, hi) = quad(at);
                let w = P::codes(lo, hi);
                for (r, a) in acc.iter_mut().enumerate() {
                    P::add(a, &w, g.x.add(2 * (r * g.ldx + 4 * i)));
                }
            }
            let at = b0 / g.kblock * NR;
            let b = b0 / g.xblock;
            for (r, (t, a)) in tot.iter_mut().zip(&acc).enumerate() {
                let cols = P::columns(a);
                let xs = _mm256_set1_ps(*g.xscales.as_ptr().add(r * g.lds + b));
                let sum = _mm256_set1_ps(*g.xsums.as_ptr().add(r * g.lds + b));
                for h in 0..2 {
                    let s = _mm256_loadu_ps(g.scales.as_ptr().add(at + 8 * h));
                    let z = _mm256_loadu_ps(g.zeros.as_ptr().add(at + 8 * h));
                    let net = _mm256_fnmadd_ps(z, sum, _mm256_cvtepi32_ps(cols[h]));
                    t[h] = _mm256_fmadd_ps(net, _mm256_mul_ps(s, xs), t[h]);
                }
            }
            b0 = b1;
        }
        for (o, t) in out.iter_mut().zip(&tot) {
            _mm256_storeu_ps(o.as_mut_ptr(), t[0]);
            _mm256_storeu_ps(o.as_mut_ptr().add(8), t[1]);
        }
    }

    /// # Safety
    /// AVX2 and FMA; `g.x` holds `q`; as `Kernels::gemv_int4` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv_avx2<const R: usize>(g: &Int4Gemv, out: &mut [[f32; NR]; R]) {
        gemv_blocks::<R, Madd>(g, out)
    }

    /// # Safety
    /// AVX-512 VNNI and VL; `g.x` holds the split rows; as `Kernels::gemv_int4` asserts.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn gemv_vnni<const R: usize>(g: &Int4Gemv, out: &mut [[f32; NR]; R]) {
        gemv_blocks::<R, Dpbusd>(g, out)
    }

    /// Step `S` of 16 columns' four steps (a column's codes a 32-bit lane, a step a byte)
    /// as f32 `(code − zero) × scale`, as [`super::int4_value`] computes it.
    #[inline(always)]
    unsafe fn step_values<const S: u32>(cols: __m512i, zeros: __m512, scales: __m512) -> __m512 {
        let code = _mm512_and_si512(_mm512_srli_epi32::<S>(cols), _mm512_set1_epi32(0xff));
        _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(code), zeros), scales)
    }

    /// # Safety
    /// AVX-512F; `k` and `kblock` multiples of 4, as `Kernels::int4_to_bf16_pairs`
    /// asserts, with finite scales and zeros.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub unsafe fn bf16_pairs_avx512(
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        bf16_pairs::<PairByIntegers>(codes, scales, zeros, kblock, k, out)
    }

    /// # Safety
    /// AVX-512F, BW and BF16; as [`bf16_pairs_avx512`].
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512bf16")]
    pub unsafe fn bf16_pairs_avx512bf16(
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        bf16_pairs::<PairByBf16>(codes, scales, zeros, kblock, k, out)
    }

    /// A quad (4 steps, 2 pairs) at a time: its masked halves side by side are the 16
    /// columns' 4 codes a lane; each step widened, and the steps paired as `P` rounds them.
    #[inline(always)]
    unsafe fn bf16_pairs<P: PairBits>(
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        k: usize,
        out: &mut [u16],
    ) {
        let (quads, rest) = out.split_at_mut(k / 4 * 4 * NR);
        let nibbles = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
        for (i, two) in quads.chunks_exact_mut(4 * NR).enumerate() {
            // Lines not yet in cache (the first pair of a chunk) are asked for ahead.
            prefetch_one_stream(codes.as_ptr().add(i * QUAD_BYTES));
            let g = 4 * i / kblock * NR;
            let s = _mm512_loadu_ps(scales.as_ptr().add(g));
            let z = _mm512_loadu_ps(zeros.as_ptr().add(g));
            let v = _mm256_loadu_si256(codes.as_ptr().add(i * QUAD_BYTES) as *const __m256i);
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), v);
            let cols = _mm512_and_si512(_mm512_srlv_epi32(both, nibbles), _mm512_set1_epi8(0xf));
            let at = two.as_mut_ptr() as *mut __m512i;
            _mm512_storeu_si512(
                at,
                P::pair(step_values::<0>(cols, z, s), step_values::<8>(cols, z, s)),
            );
            _mm512_storeu_si512(
                at.add(1),
                P::pair(step_values::<16>(cols, z, s), step_values::<24>(cols, z, s)),
            );
        }
        rest.fill(0);
    }

    /// Bytes of a lane (4 columns × 4 steps, column-major) step-major.
    const STEP_MAJOR: [i8; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

    /// # Safety
    /// AVX2; as `Kernels::widen_int4` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn widen_avx2(
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        let order =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(STEP_MAJOR.as_ptr() as *const __m128i));
        let mut p = p0;
        while p < p0 + kc {
            let (lo, hi) = quad(codes.as_ptr().add(p / 4 * QUAD_BYTES));
            // Per lane: the 4 steps' codes of 4 columns, a step a dword.
            let halves = [
                _mm256_shuffle_epi8(lo, order),
                _mm256_shuffle_epi8(hi, order),
            ];
            let last = (p / 4 * 4 + 4).min(p0 + kc);
            for step in p..last {
                let s = (step % 4) as i32;
                let pick = _mm256_setr_epi32(s, s + 4, 0, 0, 0, 0, 0, 0);
                let b = step / kblock * NR;
                for (h, half) in halves.iter().enumerate() {
                    let bytes = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(*half, pick));
                    let w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
                    let sc = _mm256_loadu_ps(scales.as_ptr().add(b + 8 * h));
                    let z = _mm256_loadu_ps(zeros.as_ptr().add(b + 8 * h));
                    let v = _mm256_mul_ps(_mm256_sub_ps(w, z), sc);
                    _mm256_storeu_ps(dst.as_mut_ptr().add((step - p0) * NR + 8 * h), v);
                }
            }
            p = last;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random-looking codes for `k` steps.
    fn panel(k: usize, seed: usize) -> Vec<u8> {
        (0..k.div_ceil(4) * QUAD_BYTES)
            .map(|i| ((i * 73 + seed * 29) % 256) as u8)
            .collect()
    }

    fn grid(blocks: usize, seed: usize) -> (Vec<f32>, Vec<f32>) {
        let scales = (0..blocks * NR)
            .map(|i| 0.01 + ((i * 7 + seed) % 13) as f32 * 0.037)
            .collect();
        let zeros = (0..blocks * NR)
            .map(|i| ((i * 5 + seed) % 17) as f32)
            .collect();
        (scales, zeros)
    }

    fn variants() -> Vec<Kernels> {
        Isa::ALL
            .into_iter()
            .filter_map(|i| Kernels::unchecked(i).ok())
            .collect()
    }

    #[test]
    fn every_code_has_its_own_nibble() {
        let mut seen = [0u8; 2 * QUAD_BYTES];
        for p in 0..8 {
            for j in 0..NR {
                let (at, shift) = int4_slot(p, j);
                assert_eq!(seen[at] >> shift & 0xf, 0, "step {p} col {j}");
                seen[at] |= 0xf << shift;
            }
        }
        assert!(seen.iter().all(|&b| b == 0xff));
    }

    #[test]
    fn widened_int4_codes_are_code_minus_zero_times_scale_on_every_variant() {
        let (k, kblock) = (40, 8);
        let codes = panel(k, 1);
        let (scales, zeros) = grid(k.div_ceil(kblock), 2);
        for kernels in variants() {
            for (p0, kc) in [(0, k), (5, 20), (39, 1), (12, 0), (2, 7)] {
                let mut got = vec![f32::NAN; kc * NR];
                kernels.widen_int4(&codes, &scales, &zeros, kblock, p0, kc, &mut got);
                for p in 0..kc {
                    let b = (p0 + p) / kblock * NR;
                    for j in 0..NR {
                        let c = int4_code(&codes, p0 + p, j);
                        let want = (f32::from(c) - zeros[b + j]) * scales[b + j];
                        assert_eq!(
                            got[p * NR + j].to_bits(),
                            want.to_bits(),
                            "{:?} step {} col {j}",
                            kernels.isa(),
                            p0 + p
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_rows_are_within_half_a_step_of_the_block_maximum() {
        let (m, k, xblock) = (3, 40, 8);
        let x: Vec<f32> = (0..m * k)
            .map(|i| (((i * 37) % 101) as f32 - 50.0) * 0.013 * (1 + i % 3) as f32)
            .collect();
        let mut q = QuantizedRows::default();
        q.quantize(&x, m, k, xblock);
        q.split_into_bytes();
        for r in 0..m {
            for b in 0..k / xblock {
                let xs = &x[r * k + b * xblock..][..xblock];
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                let scale = q.scales[r * q.blocks + b];
                let mut sum = 0f32;
                for (p, &v) in xs.iter().enumerate() {
                    let got = q.q[r * k + b * xblock + p];
                    sum += f32::from(got);
                    assert!((f32::from(got) * scale - v).abs() <= amax / 32767.0 * 0.5001);
                }
                assert_eq!(sum, q.sums[r * q.blocks + b]);
            }
        }
        // The split bytes rebuild q: per 4 steps, 4 low bytes then 4 signed high bytes.
        assert_eq!(q.split.len(), 2 * m * k);
        for (i, &v) in q.q.iter().enumerate() {
            let at = i / 4 * 8 + i % 4;
            let (low, high) = (q.split[at], q.split[at + 4] as i8);
            assert_eq!(
                256 * i32::from(high) + i32::from(low),
                i32::from(v),
                "value {i}"
            );
        }
        // A NaN makes its block's scale NaN.
        let mut bad = x.clone();
        bad[13] = f32::NAN;
        q.quantize(&bad, m, k, xblock);
        assert!(q.scales[1].is_nan() && q.scales[0].is_finite());
    }

    fn check<const R: usize>(k: usize, kblock: usize, xblock: usize) {
        let codes = panel(k, k + kblock);
        let (scales, zeros) = grid(k.div_ceil(kblock), k);
        let x: Vec<f32> = (0..R * k)
            .map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let mut q = QuantizedRows::default();
        q.quantize(&x, R, k, xblock);
        q.split_into_bytes();
        for kernels in variants() {
            let mut out = [[f32::NAN; NR]; R];
            kernels.gemv_int4::<R>(
                &q.q, &q.split, k, &q.scales, &q.sums, q.blocks, &codes, &scales, &zeros, k,
                kblock, xblock, &mut out,
            );
            for (r, row) in out.iter().enumerate() {
                for (j, &got) in row.iter().enumerate() {
                    // Against the quantized activations' values, in f64.
                    let (mut want, mut mag) = (0f64, 0f64);
                    for p in 0..k {
                        let g = p / kblock * NR + j;
                        let c = f64::from(int4_code(&codes, p, j));
                        let (z, s) = (f64::from(zeros[g]), f64::from(scales[g]));
                        let xs = f64::from(q.scales[r * q.blocks + p / xblock]);
                        let xv = f64::from(q.q[r * k + p]) * xs;
                        want += xv * (c - z) * s;
                        mag += (xv * s).abs() * (c + z);
                    }
                    let got = f64::from(got);
                    assert!(
                        (got - want).abs() <= 1e-5 * mag.max(1e-30),
                        "{:?} R={R} k={k} kblock={kblock} row {r} col {j}: {got} vs {want}",
                        kernels.isa()
                    );
                }
            }
        }
    }

    #[test]
    fn every_variant_sums_groups_of_codes_less_their_zeros_times_their_scales() {
        for (k, kblock, xblock) in [
            (4, 4, 4),
            (8, 4, 4),
            (16, 16, 8),
            (40, 8, 8),
            (128, 128, 128),
            (256, 32, 32),
            (1024, 1024, 256),
            // Depths that end inside a block (a group cut short): the last block is short.
            (68, 8, 8),
            (100, 32, 16),
            (1000, 1024, 256),
        ] {
            check::<1>(k, kblock, xblock);
            check::<2>(k, kblock, xblock);
            check::<3>(k, kblock, xblock);
            check::<4>(k, kblock, xblock);
        }
    }

    /// The VNNI GEMV sums the same integers as the AVX2 one and then runs the same f32
    /// operations: every x86 variant gives the AVX2 variant's bits, for activations at the
    /// ends of i16 (high bytes 127 and −128, low bytes 0 and 255) and codes at 0 and 15.
    #[test]
    fn every_x86_variant_gives_the_avx2_gemvs_bits() {
        let Ok(avx2) = Kernels::unchecked(Isa::Avx2) else {
            return;
        };
        for (k, kblock, xblock, seed) in [(1024, 1024, 256, 1), (256, 128, 128, 2), (68, 8, 8, 3)] {
            let mut codes = panel(k, seed);
            codes[..QUAD_BYTES].fill(0xff);
            codes[QUAD_BYTES..2 * QUAD_BYTES].fill(0);
            let (scales, zeros) = grid(k.div_ceil(kblock), seed);
            let x: Vec<f32> = (0..4 * k)
                .map(|i| match i % 7 {
                    0 => 1.0,
                    1 => -1.0,
                    2 => 0.0,
                    _ => ((i * 31 % 97) as f32 - 48.0) / 48.0,
                })
                .collect();
            let mut q = QuantizedRows::default();
            q.quantize(&x, 4, k, xblock);
            q.split_into_bytes();
            assert!(q.q.contains(&32767) && q.q.contains(&-32767));
            let run = |kernels: Kernels| {
                let mut out = [[f32::NAN; NR]; 4];
                kernels.gemv_int4::<4>(
                    &q.q, &q.split, k, &q.scales, &q.sums, q.blocks, &codes, &scales, &zeros, k,
                    kblock, xblock, &mut out,
                );
                out.map(|row| row.map(f32::to_bits))
            };
            let want = run(avx2);
            for kernels in variants().into_iter().filter(|v| v.isa() >= Isa::Avx2) {
                assert_eq!(run(kernels), want, "{:?} k={k}", kernels.isa());
            }
        }
    }

    #[test]
    fn int4_panels_round_to_the_bf16_panels_of_their_values_on_every_variant() {
        use super::super::PanelValue;
        for (k, kblock) in [(4, 4), (8, 4), (40, 8), (64, 32)] {
            let codes = panel(k, 3);
            let (scales, zeros) = grid(k.div_ceil(kblock), 5);
            for kernels in variants() {
                let mut got = vec![0xdead; u16::panel_len(k)];
                kernels.int4_to_bf16_pairs(&codes, &scales, &zeros, kblock, k, &mut got);
                for p in 0..k.next_multiple_of(super::super::BF16_K_ALIGN) {
                    for j in 0..NR {
                        let want = if p < k {
                            let b = p / kblock * NR + j;
                            let v = int4_value(int4_code(&codes, p, j), zeros[b], scales[b]);
                            half::bf16::from_f32(v).to_bits()
                        } else {
                            0
                        };
                        assert_eq!(
                            got[u16::slot(p, j)],
                            want,
                            "{:?} k={k} step {p} col {j}",
                            kernels.isa()
                        );
                    }
                }
            }
        }
    }
}
