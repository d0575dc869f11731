//! The innermost loops of the packed linear (see `packed.rs` for the blocking), one module
//! per instruction set, and the choice among them, made at run time.
//!
//! Layouts:
//! - an f32 weight panel is `[k][NR]` (NR = 16 output columns, contiguous per step);
//! - a bf16 weight panel is `[kp/2][NR][2]`: the two steps of a pair side by side for each
//!   column, `kp` = k rounded up to [`BF16_K_ALIGN`] with zero padding. It is the layout
//!   `vdpbf16ps` and AMX's `tdpbf16ps` read (a 64-byte row of 16 columns × 2 steps), and the
//!   f32 kernels widen it with one shift or mask per 16 values;
//! - f32 activations for the tile kernels are packed `[kc][MR]` per 6-row panel;
//! - bf16 activations (the `avx512bf16` and `amx` variants) are row-major `[m][kp]`.
//!
//! Variants: `portable` (any CPU), `avx2` (AVX2, FMA and F16C), `avx512` (AVX-512F, 16-wide f32
//! FMA), `avx512bf16` (`vdpbf16ps`: activations rounded to bf16, products summed in f32) and
//! `amx` (AMX-BF16 tiles for the prompt GEMM). f32 weights have no bf16 product, so the
//! last two run the `avx512` kernels on them; `amx` runs the `avx512bf16` GEMV for decode
//! rows (a tile is 16 rows: one row would waste 15/16 of it).

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod codes;
mod detect;
mod int4;
mod int8;
mod peak;
mod portable;
pub(crate) mod streams;

pub use peak::peak_flops;

pub use codes::CodeKind;
pub use detect::{host, HostFeatures};
pub use int4::{int4_code, int4_slot, int4_value, QuantizedRows, QUAD_BYTES};
pub use int8::int8_xblock;

use std::fmt;

/// Rows one GEMV kernel call takes, and the rows at or below which the GEMV path (weights
/// read once from memory, no packing of `x`) is used unless the ISA says otherwise
/// ([`Kernels::gemv_max_rows`]).
pub const GEMV_MAX_ROWS: usize = 4;

/// Output columns per weight panel.
pub const NR: usize = 16;
/// Activation rows per packed f32 activation panel.
pub const MR: usize = 6;
/// bf16 panels pad their steps to a multiple of this (one AMX tile's depth).
pub const BF16_K_ALIGN: usize = 32;

/// An instruction-set variant of the kernels, in order of preference (last is best).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
    Avx512Bf16,
    Amx,
}

impl Isa {
    pub const ALL: [Isa; 5] = [
        Isa::Portable,
        Isa::Avx2,
        Isa::Avx512,
        Isa::Avx512Bf16,
        Isa::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Amx => "amx",
        }
    }

    /// `Err(why)` when this host cannot run the variant.
    pub fn host_support(self) -> Result<(), String> {
        let h = host();
        let (ok, needs) = match self {
            Isa::Portable => (true, ""),
            Isa::Avx2 => (h.avx2_fma, "AVX2, FMA and F16C"),
            Isa::Avx512 => (h.avx512f, "AVX-512F and AVX-512BW"),
            Isa::Avx512Bf16 => (h.avx512bf16, "AVX512-BF16, AVX512-VNNI and AVX512-VL"),
            Isa::Amx => (h.amx_bf16, "AMX-TILE and AMX-BF16 (and AVX512-BF16)"),
        };
        if ok {
            return Ok(());
        }
        match (&h.amx_refused, self) {
            (Some(why), Isa::Amx) => Err(why.clone()),
            _ => Err(format!("this CPU lacks {needs}")),
        }
    }

    /// Whether the variant rounds a bf16 product's activations to bf16.
    pub fn bf16_activations(self) -> bool {
        matches!(self, Isa::Avx512Bf16 | Isa::Amx)
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Isa {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Isa, KernelError> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| KernelError::Unknown {
                name: s.to_string(),
            })
    }
}

/// Why a kernel variant cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KernelError {
    #[error(
        "unknown kernel variant {name:?}: choose one of portable, avx2, avx512, avx512bf16, amx"
    )]
    Unknown { name: String },
    #[error("--isa {isa}: {why}; this host runs {runs}")]
    Unsupported { isa: Isa, why: String, runs: String },
    #[error(
        "--isa {isa}: the start-up self-check failed ({detail}); the variant is not used — \
         report this with the CPU model, or choose another --isa"
    )]
    SelfCheckFailed { isa: Isa, detail: String },
}

/// The kernels one linear runs with: a variant this host supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    isa: Isa,
}

/// Whether `rows` rows of `width` values, `stride` apart, fit in `len` values; checked, so
/// a huge stride cannot wrap the bound that guards the unchecked reads.
fn rows_fit(len: usize, rows: usize, stride: usize, width: usize) -> bool {
    rows == 0
        || (rows - 1)
            .checked_mul(stride)
            .and_then(|start| start.checked_add(width))
            .is_some_and(|end| end <= len)
}

impl Kernels {
    /// The portable kernels, which every host runs.
    pub(crate) const PORTABLE: Kernels = Kernels { isa: Isa::Portable };

    /// `isa` if the host supports it, without the self-check (for tests and the check
    /// itself).
    pub fn unchecked(isa: Isa) -> Result<Kernels, KernelError> {
        isa.host_support().map_err(|why| KernelError::Unsupported {
            isa,
            why,
            runs: Isa::ALL
                .into_iter()
                .filter(|i| i.host_support().is_ok())
                .map(Isa::name)
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        Ok(Kernels { isa })
    }

    /// The portable kernels, whatever the CPU.
    pub fn portable() -> Kernels {
        Kernels { isa: Isa::Portable }
    }

    pub fn isa(self) -> Isa {
        self.isa
    }

    /// The variant that runs a prompt product (more than [`Kernels::gemv_max_rows`] rows).
    pub fn gemm_variant(self, bf16_weights: bool) -> Isa {
        match self.isa {
            Isa::Avx512Bf16 | Isa::Amx if !bf16_weights => Isa::Avx512,
            isa => isa,
        }
    }

    /// The variant that runs a decode product (a few rows).
    pub fn gemv_variant(self, bf16_weights: bool) -> Isa {
        match self.gemm_variant(bf16_weights) {
            Isa::Amx => Isa::Avx512Bf16,
            isa => isa,
        }
    }

    /// Rows at or below which a product takes the GEMV path rather than the GEMM: the
    /// GEMV reads each weight panel from memory once and runs it over the rows
    /// [`GEMV_MAX_ROWS`] at a time from cache, with no packing of the activations; the GEMM
    /// packs and tiles for many rows. Where they cross was measured per variant with
    /// `tpc bench --batch B` (TinyLlama-1.1B shape, 2-core AVX2 EPYC, 2026-12-04): AVX2 with
    /// bf16 weights, a decode step of 8 rows 130 ms by GEMV against 215 by GEMM, 32 rows 457
    /// against 502, 64 rows 944 against 839; with f32 weights 8 rows 182 against 233, 16
    /// rows 309 against 291. Elsewhere (AVX-512, AMX) the GEMM's wider tiles were not
    /// measured against it: the GEMV takes up to [`GEMV_MAX_ROWS`] rows.
    pub fn gemv_max_rows(self, bf16_weights: bool) -> usize {
        match (self.gemv_variant(bf16_weights), bf16_weights) {
            (Isa::Avx2, true) => 32,
            (Isa::Avx2, false) => 8,
            _ => GEMV_MAX_ROWS,
        }
    }

    /// What runs the linears of weights stored as bf16 (`true`) or f32.
    pub fn linear_kernels(self, bf16_weights: bool) -> LinearKernels {
        LinearKernels {
            isa: self.isa,
            prompt_gemm: self.gemm_variant(bf16_weights),
            decode_gemv: self.gemv_variant(bf16_weights),
        }
    }

    /// Rows of one f32 tile (`tile_f32`): whole `[kc][MR]` panels, consecutive.
    pub fn f32_tile_rows(self) -> usize {
        match self.gemm_variant(false) {
            Isa::Avx512 => 2 * MR,
            _ => MR,
        }
    }

    /// `tile[rows][NR] (+)= Σ_p a[p] ⊗ b[p][NR]` over `kc` steps for
    /// `rows = f32_tile_rows()`: `a` is `rows / MR` consecutive `[kc][MR]` panels; `tile` is
    /// overwritten when `accumulate` is false, added to otherwise; its rows are `ldc` apart.
    ///
    /// # Safety
    /// `a` holds `kc·rows`, `b` `kc·NR` values; `tile` is valid for `rows` rows of `NR`
    /// values `ldc` apart.
    #[inline]
    pub unsafe fn tile_f32(
        self,
        kc: usize,
        a: *const f32,
        b: *const f32,
        tile: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        match self.gemm_variant(false) {
            Isa::Avx512 => return avx512::tile_12x16(kc, a, b, tile, ldc, accumulate),
            Isa::Avx2 => return avx2::tile_6x16(kc, a, b, tile, ldc, accumulate),
            _ => {}
        }
        portable::tile_6x16(kc, a, b, tile, ldc, accumulate)
    }

    /// bf16 pair rows → f32 `[2·pairs][NR]`: `src` holds `pairs·2·NR` values, `dst` at
    /// least as many.
    pub fn widen_pairs(self, src: &[u16], dst: &mut [f32]) {
        assert!(dst.len() >= src.len() && src.len().is_multiple_of(2 * NR));
        #[cfg(target_arch = "x86_64")]
        match self.gemm_variant(true) {
            // SAFETY: the variant was checked against the host; lengths were asserted.
            Isa::Avx512 | Isa::Avx512Bf16 | Isa::Amx => {
                return unsafe { avx512::widen_pairs(src, dst) }
            }
            Isa::Avx2 => return unsafe { avx2::widen_pairs(src, dst) },
            _ => {}
        }
        portable::widen_pairs(src, dst)
    }

    /// `out[r][j] = Σ_p x[r][p] · w[p][j]` for `R` rows of f32 `x` (row stride `ldx`) and
    /// one weight panel of `k` steps (f32 `[k][NR]`, or bf16 pairs of `≥ k` steps).
    pub fn gemv<const R: usize, T: PanelValue>(
        self,
        x: &[f32],
        ldx: usize,
        panel: &[T],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        assert!(rows_fit(x.len(), R, ldx, k), "gemv: x too short");
        assert!(panel.len() >= T::panel_len(k), "gemv: panel too short");
        #[cfg(target_arch = "x86_64")]
        {
            let bf16 = T::BF16;
            // SAFETY: the variant was checked against the host; the asserts keep every read
            // of x and of the panel in bounds.
            match self.gemv_variant(bf16) {
                Isa::Avx512 | Isa::Avx512Bf16 => {
                    return unsafe { T::gemv_avx512::<R>(x, ldx, panel, k, out) }
                }
                Isa::Avx2 => return unsafe { T::gemv_avx2::<R>(x, ldx, panel, k, out) },
                _ => {}
            }
        }
        portable::gemv::<R, T>(x, ldx, panel, k, out)
    }

    /// The invariant order's decode product (`--numerics invariant`) over `G` depth blocks of
    /// one panel at once: block `g` is steps `starts[g] .. starts[g] + len` (of the panel and
    /// of each row of `x`), into `out[g]`; each output of each block is one chain, its steps
    /// in order from zero — the bits of [`Kernels::tile_f32`] over that block alone — and the
    /// blocks' chains run interleaved, so that more loads and FMAs are in flight. bf16 blocks
    /// start on a pair row (`starts[g]` even).
    pub fn gemv_one_chain_blocks<const R: usize, const G: usize, T: PanelValue>(
        self,
        x: &[f32],
        ldx: usize,
        panel: &[T],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    ) {
        for &s in &starts {
            assert!(
                !T::BF16 || s.is_multiple_of(2),
                "gemv: a bf16 block starts mid-pair"
            );
            let end = s
                .checked_add(len)
                .expect("gemv: block past the address space");
            assert!(rows_fit(x.len(), R, ldx, end), "gemv: x too short");
            assert!(panel.len() >= T::read_len(end), "gemv: panel too short");
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the variant was checked against the host; the asserts keep every
            // read of x and of the panel in bounds.
            match self.gemv_variant(T::BF16) {
                Isa::Avx512 | Isa::Avx512Bf16 => {
                    return unsafe {
                        T::gemv_blocks_avx512::<R, G>(x, ldx, panel, starts, len, out)
                    }
                }
                Isa::Avx2 => {
                    return unsafe { T::gemv_blocks_avx2::<R, G>(x, ldx, panel, starts, len, out) }
                }
                _ => {}
            }
        }
        for (&s, o) in starts.iter().zip(out.iter_mut()) {
            portable::gemv::<R, T>(&x[s..], ldx, &panel[T::slot(s, 0)..], len, o);
        }
    }

    /// As [`Kernels::gemv`] with bf16 `x` rows (`[..][ldx]`, zero past `k`) and products
    /// summed pairwise in f32 (`vdpbf16ps`).
    pub fn gemv_bf16x<const R: usize>(
        self,
        x: &[u16],
        ldx: usize,
        panel: &[u16],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        let pairs = k.div_ceil(2);
        assert!(rows_fit(x.len(), R, ldx, 2 * pairs), "gemv: x too short");
        assert!(panel.len() >= pairs * 2 * NR, "gemv: panel too short");
        #[cfg(target_arch = "x86_64")]
        if self.gemv_variant(true) == Isa::Avx512Bf16 {
            // SAFETY: AVX512-BF16 was checked against the host; asserts bound the reads.
            return unsafe { avx512bf16::gemv::<R>(x, ldx, panel, pairs, out) };
        }
        portable::gemv_bf16x::<R>(x, ldx, panel, pairs, out)
    }

    /// `c[r][j] = Σ_p a[r][p] · w_c[p][j]` for `R` bf16 rows of `a` (stride `lda`), `P`
    /// weight panels (`b`) over `pairs` step pairs; columns past `last_cols` of the last
    /// panel are not written; `c` rows are `ldc` apart.
    ///
    /// # Safety
    /// `a` holds `R` rows of `2·pairs` values `lda` apart; each `b` a panel of `pairs`
    /// pair rows; `c` is valid for `R` rows of `(P - 1)·NR + last_cols` values `ldc` apart.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile_bf16<const R: usize, const P: usize>(
        self,
        a: *const u16,
        lda: usize,
        b: [*const u16; P],
        pairs: usize,
        c: *mut f32,
        ldc: usize,
        last_cols: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.gemm_variant(true) >= Isa::Avx512Bf16 {
            return avx512bf16::tile::<R, P>(a, lda, b, pairs, c, ldc, last_cols);
        }
        portable::tile_bf16::<R, P>(a, lda, b, pairs, c, ldc, last_cols)
    }

    /// f32 rows of `k` values → bf16 AMX A tiles (`kblocks` per 16 rows; see `amx.rs`),
    /// rounded as [`Kernels::round_to_bf16`]; all of `dst` (whole row tiles) is written,
    /// zero past `k` and past the rows of `x`.
    pub fn round_to_tiles(self, x: &[f32], k: usize, kblocks: usize, dst: &mut [u16]) {
        let tiles_len = 16 * BF16_K_ALIGN * kblocks;
        assert!(kblocks * BF16_K_ALIGN >= k && k > 0 && x.len().is_multiple_of(k));
        assert!(dst.len().is_multiple_of(tiles_len) && dst.len() / tiles_len * 16 * k >= x.len());
        #[cfg(target_arch = "x86_64")]
        if self.isa >= Isa::Avx512 {
            // SAFETY: AVX-512F was checked against the host; sizes were asserted.
            return unsafe { avx512::round_to_tiles(x, k, kblocks, dst) };
        }
        portable::round_to_tiles(x, k, kblocks, dst)
    }

    /// f32 rows → bf16 (round to nearest even, NaN quieted, as `half::bf16::from_f32`).
    pub fn round_to_bf16(self, src: &[f32], dst: &mut [u16]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa >= Isa::Avx512 {
            // SAFETY: AVX-512F was checked against the host.
            return unsafe { avx512::round_to_bf16(src, dst) };
        }
        portable::round_to_bf16(src, dst)
    }
}

#[cfg(target_arch = "x86_64")]
pub use amx::{AmxTiles, TILE as AMX_TILE};

/// The variants a run's linears used: the one chosen, and what ran prompt products and
/// decode products for the weights' type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearKernels {
    pub isa: Isa,
    pub prompt_gemm: Isa,
    pub decode_gemv: Isa,
}

impl fmt::Display for LinearKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (prompt GEMM: {}, decode GEMV: {})",
            self.isa, self.prompt_gemm, self.decode_gemv
        )
    }
}

/// A stored weight value: bf16 bits (`u16`, pair layout) or `f32` (`[k][NR]`).
pub trait PanelValue: Copy + Send + Sync {
    const BF16: bool;
    /// Values in one panel of `k` steps.
    fn panel_len(k: usize) -> usize;
    /// Values a GEMV over `k` steps reads from the start of a panel (bf16: whole pairs).
    fn read_len(k: usize) -> usize;
    /// Index of step `p`, column `j` (< NR) in a panel.
    fn slot(p: usize, j: usize) -> usize;
    fn to_f32(self) -> f32;
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `(R - 1)·ldx + k` values, `panel` `panel_len(k)`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[Self],
        k: usize,
        out: &mut [[f32; NR]; R],
    );
    /// # Safety
    /// As `gemv_avx2`, with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[Self],
        k: usize,
        out: &mut [[f32; NR]; R],
    );
    /// # Safety
    /// The CPU has AVX2 and FMA; as [`Kernels::gemv_one_chain_blocks`] checks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx2<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[Self],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    );
    /// # Safety
    /// As `gemv_blocks_avx2`, with AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx512<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[Self],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    );
}

impl PanelValue for u16 {
    const BF16: bool = true;
    fn panel_len(k: usize) -> usize {
        k.next_multiple_of(BF16_K_ALIGN) * NR
    }
    fn read_len(k: usize) -> usize {
        k.div_ceil(2) * 2 * NR
    }
    fn slot(p: usize, j: usize) -> usize {
        (p / 2) * 2 * NR + j * 2 + (p & 1)
    }
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
        avx2::gemv_pairs::<R>(x, ldx, panel, k, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[u16],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        avx512::gemv_pairs::<R>(x, ldx, panel, k, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx2<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[u16],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    ) {
        avx2::gemv_blocks_pairs::<R, G>(x, ldx, panel, starts, len, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx512<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[u16],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    ) {
        avx512::gemv_blocks_pairs::<R, G>(x, ldx, panel, starts, len, out)
    }
}

impl PanelValue for f32 {
    const BF16: bool = false;
    fn panel_len(k: usize) -> usize {
        k * NR
    }
    fn read_len(k: usize) -> usize {
        k * NR
    }
    fn slot(p: usize, j: usize) -> usize {
        p * NR + j
    }
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
        avx2::gemv_f32::<R>(x, ldx, panel, k, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512<const R: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[f32],
        k: usize,
        out: &mut [[f32; NR]; R],
    ) {
        avx512::gemv_f32::<R>(x, ldx, panel, k, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx2<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[f32],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    ) {
        avx2::gemv_blocks_f32::<R, G>(x, ldx, panel, starts, len, out)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_blocks_avx512<const R: usize, const G: usize>(
        x: &[f32],
        ldx: usize,
        panel: &[f32],
        starts: [usize; G],
        len: usize,
        out: &mut [[[f32; NR]; R]; G],
    ) {
        avx512::gemv_blocks_f32::<R, G>(x, ldx, panel, starts, len, out)
    }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn widen(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even, NaN quieted (as `half::bf16::from_f32`).
#[inline(always)]
pub fn round_bf16(f: f32) -> u16 {
    let b = f.to_bits();
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        ((b >> 16) | 0x40) as u16
    } else {
        (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
    }
}
