//! The innermost loops of the packed GEMM and GEMV (see `packed.rs` for the layouts):
//! AVX2 + FMA versions picked at run time when the CPU has them, and portable versions
//! that compute the same sums in the same layouts.
//!
//! Layouts: a weight panel is `[k][NR]` (NR = 16 output columns, contiguous per k); a packed
//! activation panel is `[k][MR]` (MR = 6 rows, contiguous per k).

/// Output columns per weight panel.
pub const NR: usize = 16;
/// Activation rows per micro-kernel call.
pub const MR: usize = 6;

/// The kernels this CPU runs, chosen once.
#[derive(Clone, Copy)]
pub struct Kernels {
    avx2: bool,
}

impl Kernels {
    pub fn detect() -> Kernels {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Kernels { avx2: true };
            }
        }
        Kernels { avx2: false }
    }

    /// The portable kernels, whatever the CPU (for tests).
    pub fn portable() -> Kernels {
        Kernels { avx2: false }
    }

    /// `tile[MR][NR] = Σ_p a[p][MR] ⊗ b[p][NR]` over `kc` steps; `tile` is overwritten
    /// when `accumulate` is false and added to otherwise. `tile` rows are `ldc` apart.
    ///
    /// # Safety
    /// `a` holds `kc·MR`, `b` holds `kc·NR` values, and `tile` is valid for `MR` rows of
    /// `NR` values `ldc` apart.
    #[inline]
    pub unsafe fn tile_6x16(
        self,
        kc: usize,
        a: *const f32,
        b: *const f32,
        tile: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            return x86::tile_6x16(kc, a, b, tile, ldc, accumulate);
        }
        tile_portable(kc, a, b, tile, ldc, accumulate)
    }

    /// `dst[p·NR + j] = widen(src[p·NR + j])` for `len` values.
    pub fn widen_bf16(self, src: &[u16], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: AVX2 was detected; the function bounds itself by the shorter slice.
            return unsafe { x86::widen_bf16(src, dst) };
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = widen(s);
        }
    }

    /// `out[r][j] = Σ_p x[r][p] · panel[p][j]` for `R` rows of `x` (row stride `ldx`),
    /// a weight panel (bf16 bits or f32) of `k` steps; `out` rows are `NR` apart.
    pub fn gemv<const R: usize, T: PanelValue>(
        self,
        x: &[f32],
        ldx: usize,
        panel: &[T],
        out: &mut [[f32; NR]; R],
    ) {
        let k = panel.len() / NR;
        assert!(R == 0 || x.len() >= (R - 1) * ldx + k, "gemv: x too short");
        #[cfg(target_arch = "x86_64")]
        if self.avx2 {
            // SAFETY: AVX2 + FMA were detected; the assert keeps x reads in bounds and the
            // panel is read through k = len / NR steps.
            return unsafe { T::gemv_avx2::<R>(x, ldx, panel, k, out) };
        }
        gemv_portable::<R, T>(x, ldx, panel, k, out)
    }
}

/// A stored weight value: bf16 bits (`u16`) or `f32`.
pub trait PanelValue: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// The AVX2 GEMV over panels of this type.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `(R - 1)·ldx + k` values, `panel` `k·NR`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[Self],
        k: usize,
        out: &mut [[f32; NR]; R],
    );
}

impl PanelValue for u16 {
    fn to_f32(self) -> f32 {
        widen(self)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[u16],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        x86::gemv_bf16::<R>(x, ldx, panel, k, out)
    }
}

impl PanelValue for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[f32],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        x86::gemv_f32::<R>(x, ldx, panel, k, out)
    }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// # Safety
/// As [`Kernels::tile_6x16`].
unsafe fn tile_portable(
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

fn gemv_portable<const R: usize, T: PanelValue>(
    x: &[f32],
    ldx: usize,
    panel: &[T],
    k: usize,
    out: &mut [[f32; NR]; R],
) {
    *out = [[0f32; NR]; R];
    for p in 0..k {
        let w = &panel[p * NR..(p + 1) * NR];
        for (r, row) in out.iter_mut().enumerate() {
            let xv = x[r * ldx + p];
            for (o, &wv) in row.iter_mut().zip(w) {
                *o += xv * wv.to_f32();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// How far ahead of its reads the GEMV asks for weights. Measured on this machine (GEMV
    /// over 40 cold 5632×2048 bf16 matrices, 2 threads): no prefetch 16–23 GB/s, 1–4 KiB
    /// ahead 23–29 GB/s; TinyLlama decode 11.1–12.4 → 12.6–14.9 tok/s (3 alternations).
    const PREFETCH_BYTES: usize = 2048;

    /// 12 accumulators (6 rows × 2 vectors of 8), two weight vectors and one broadcast:
    /// 15 of the 16 ymm registers.
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

    #[target_feature(enable = "avx2")]
    pub unsafe fn widen_bf16(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            let v = widen8(src.as_ptr().add(i));
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), v);
            i += 8;
        }
        while i < n {
            dst[i] = super::widen(src[i]);
            i += 1;
        }
    }

    /// Eight bf16 at `p` → eight f32: zero-extend to 32 bits and shift into the high half.
    #[inline(always)]
    unsafe fn widen8(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv_bf16<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[u16],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        gemv::<R>(x, ldx, k, out, panel.as_ptr() as *const i8, NR * 2, |p| {
            let w = panel.as_ptr().add(p * NR);
            (widen8(w), widen8(w.add(8)))
        })
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemv_f32<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[f32],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        gemv::<R>(x, ldx, k, out, panel.as_ptr() as *const i8, NR * 4, |p| {
            let w = panel.as_ptr().add(p * NR);
            (_mm256_loadu_ps(w), _mm256_loadu_ps(w.add(8)))
        })
    }

    /// Up to two rows keep two partial sums per vector (even and odd steps) so that even one
    /// row has four FMA chains in flight; more rows have chains enough and too few registers.
    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        x: &[f32],
        ldx: usize,
        k: usize,
        out: &mut [[f32; NR]; R],
        base: *const i8,
        step_bytes: usize,
        load: impl Fn(usize) -> (__m256, __m256),
    ) {
        let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; R];
        let mut p = 0;
        while p + 2 <= k {
            // Prefetches never fault, so running past the panel's end is harmless.
            let ahead = base.wrapping_add(p * step_bytes + PREFETCH_BYTES);
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            if step_bytes > 32 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            }
            for step in 0..2 {
                let s = if R <= 2 { step } else { 0 };
                let (w0, w1) = load(p + step);
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(x.get_unchecked(r * ldx + p + step));
                    a[s][0] = _mm256_fmadd_ps(xv, w0, a[s][0]);
                    a[s][1] = _mm256_fmadd_ps(xv, w1, a[s][1]);
                }
            }
            p += 2;
        }
        if p < k {
            let (w0, w1) = load(p);
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
}
