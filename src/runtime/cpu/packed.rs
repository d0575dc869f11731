//! Linear weights packed once at load time into panels of 16 output columns, kept as bf16
//! bits or f32 (layouts in `isa/mod.rs`) or, for a quantized checkpoint, as its codes and
//! scales (`packed/codes.rs`), and the GEMM / GEMV that multiply activations by them with
//! the kernel variant chosen at run time.
//!
//! Why packed: every kernel then reads a weight panel front to back, contiguous, which is what
//! both the memory-bound decode GEMV and the cache-blocked prefill GEMM want; and a bf16 panel
//! is widened to f32 one cache-sized block at a time instead of the whole matrix.
//!
//! Prompt GEMM, f32 products (`portable`, `avx2`, `avx512`, and f32 weights everywhere), in
//! BLIS order: activations are packed into 6-row panels per block of `KC` steps; each thread
//! takes a range of weight panels, widens `KC × 16` of one into L1 and runs the tile kernel
//! against every activation panel of the block (which stays in L2).
//!
//! Prompt GEMM, bf16 products (`avx512bf16`, `amx`, bf16 weights): activations are rounded
//! once to bf16 rows (AMX: 1 KiB tiles); each thread takes pairs of weight panels and runs
//! the tile kernel for every block of rows, over the whole depth (`avx512bf16`) or over
//! depth slices into partial sums kept in L2 (`amx`, see `Bf16Product::gemm_amx`).

use super::aligned::{AlignedVec, Plain};
use super::isa::{widen, Isa, Kernels, PanelValue, QuantizedRows, BF16_K_ALIGN, MR, NR};
use super::team::{SyncPtr, Team};
use crate::ir::WeightOrder;
use crate::plan::WeightSlice;
use crate::runtime::weights::WeightError;

type Result<T, E = WeightError> = std::result::Result<T, E>;
use crate::runtime::tensor::Tensor;
use crate::runtime::weights::{Piece, SliceLayout, StoredRows, WeightSource};
use rayon::prelude::*;

mod codes;
mod int4;
mod invariant;
mod quantized_view;

use codes::CodePanels;
use int4::Int4Panels;
pub use quantized_view::QuantizedPanels;

/// Reduction steps per block: a widened weight block (`KC·NR` f32 = 16 KiB) stays in L1.
const KC: usize = 256;
/// Activation rows per block: `MC·KC` f32 (144 KiB) stays in L2.
pub(crate) const MC: usize = 144;
/// Rows per block of the bf16 products: each weight panel streams from memory once per block
/// and meets all of the block's rows (whose bf16 activations, `MC_BF16 · k · 2` bytes, come
/// from L2/L3). Measured on TinyLlama at 512 rows: 192-row blocks (three reads of every
/// weight) spent 2.8 s in prefill linears, one block 1.7 s.
const MC_BF16: usize = 1536;
/// Work chunks per team member: enough for late members to even out, few enough that each
/// chunk still streams a long run of weights.
const CHUNKS_PER_MEMBER: usize = 8;
/// Steps of the depth per slice of the AMX product: a panel pair's slice (16 KiB) stays in
/// L1 and 512 rows' activations for it (256 KiB) in L2. Measured on TinyLlama's products at
/// 512 rows (bench-gemm, 2 threads): 256 steps ~1.9 TF/s, 512 ~1.5–1.8, the whole depth
/// (one slice) ~1.4; the data sizes rather than the call count decide.
const AMX_SLICE: usize = 256;
/// Bytes of partial sums a thread keeps in L2 per group of panel pairs in the AMX product
/// (512 KiB: 8 pairs at 512 rows). A group reads the block's activations once, so larger
/// groups read them less often, up to where the sums push them out of L2.
const AMX_SUMS_BYTES: usize = 512 << 10;
/// Panels per work chunk of the AMX product, at least (see `run_chunks`).
const AMX_MIN_CHUNK: usize = 16;
use super::isa::GEMV_MAX_ROWS;
/// The largest edge tile of the f32 GEMM (`Kernels::f32_tile_rows`).
const MAX_TILE_ROWS: usize = 2 * MR;

#[derive(Debug, Clone, PartialEq)]
enum Panels {
    Bf16(AlignedVec<u16>),
    F32(AlignedVec<f32>),
    /// A quantized weight's codes (FP8 or INT8) and their scales (`packed/codes.rs`).
    Codes(CodePanels),
    /// An INT4 weight's codes, scales and zero points (`packed/int4.rs`).
    Int4(Int4Panels),
}

/// A linear weight as `n` output columns by `k` inputs, packed (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    panels: Panels,
}

impl PackedMatrix {
    /// Packs `w`, stored `[n, k]` (`OutIn`) or `[k, n]` (`InOut`), as bf16 (rounded to
    /// nearest even: exact for values read from a bf16 checkpoint) or f32.
    pub fn pack(w: &Tensor, order: WeightOrder, bf16: bool) -> PackedMatrix {
        let (r, c) = (w.shape[0], w.shape[1]);
        let (n, k) = match order {
            WeightOrder::OutIn => (r, c),
            WeightOrder::InOut => (c, r),
        };
        let at = |j: usize, p: usize| match order {
            WeightOrder::OutIn => w.data[j * k + p],
            WeightOrder::InOut => w.data[p * n + j],
        };
        // One panel per task: a 1B-parameter model packs in parallel at load time.
        fn fill<T: PanelValue + Plain>(
            n: usize,
            k: usize,
            value: impl Fn(usize, usize) -> T + Sync,
        ) -> AlignedVec<T> {
            let mut out = AlignedVec::zeroed(n.div_ceil(NR) * T::panel_len(k));
            // A weight with no inputs has empty panels (and chunks of zero are not allowed).
            if k == 0 {
                return out;
            }
            out.par_chunks_mut(T::panel_len(k))
                .enumerate()
                .for_each(|(q, panel)| {
                    for j in q * NR..n.min(q * NR + NR) {
                        for p in 0..k {
                            panel[T::slot(p, j % NR)] = value(j, p);
                        }
                    }
                });
            out
        }
        let panels = if bf16 {
            Panels::Bf16(fill(n, k, |j, p| half::bf16::from_f32(at(j, p)).to_bits()))
        } else {
            Panels::F32(fill(n, k, at))
        };
        PackedMatrix { n, k, panels }
    }

    /// Packs one rank's slice `w` of a linear weight straight from `src`, as
    /// [`PackedMatrix::pack`] of [`load_slice`](crate::runtime::weights::load_slice) would, bit for
    /// bit, but without the f32 copy: each panel reads its 16 output columns (16 stored rows
    /// for `OutIn`, a 16-wide window of every row for `InOut`) into at most a `16 × k`
    /// scratch, from the slice's stored bytes when the source has them (read a batch of
    /// rows at a time, in the stored encoding: bf16 is copied).
    pub fn pack_slice(
        src: &dyn WeightSource,
        w: &WeightSlice,
        order: WeightOrder,
        bf16: bool,
    ) -> Result<PackedMatrix> {
        Self::pack_slices(src, &[w], order, bf16)
    }

    /// Packs one rank's slices of several linear weights that read the same input as one
    /// matrix, their output columns side by side in the order given (a fused product's
    /// weight, `plan::fuse`), as [`PackedMatrix::pack_slice`] packs one and in one pass: a
    /// panel that straddles two weights reads its columns from both, so no weight is packed
    /// twice and none needs its output count to fill whole panels.
    pub fn pack_slices(
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
        bf16: bool,
    ) -> Result<PackedMatrix> {
        Self::pack_slices_in(src, slices, order, bf16, Batch::for_this_host(), true)
    }

    /// [`PackedMatrix::pack_slices`] for the invariant order (`invariant.rs`), whose depth
    /// blocks must be the stored steps in their own order: INT4 weights whose steps would
    /// be stored sorted by group (act order) are packed as values instead.
    pub fn pack_slices_in_step_order(
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
        bf16: bool,
    ) -> Result<PackedMatrix> {
        Self::pack_slices_in(src, slices, order, bf16, Batch::for_this_host(), false)
    }

    /// [`PackedMatrix::pack_slices`] reading the stored rows `batch` at a time; INT4 steps
    /// may be stored sorted by group when `sort_steps`.
    fn pack_slices_in(
        src: &dyn WeightSource,
        slices: &[&WeightSlice],
        order: WeightOrder,
        bf16: bool,
        batch: Batch,
        sort_steps: bool,
    ) -> Result<PackedMatrix> {
        let bad = |w: &WeightSlice, what: String| WeightError::Slice {
            name: w.tensor.to_string(),
            problem: what,
        };
        let Some(&first) = slices.first() else {
            return Err(WeightError::Slice {
                name: "a fused product".into(),
                problem: "it has no weights to pack".into(),
            });
        };
        let layouts = slices
            .iter()
            .map(|w| SliceLayout::new(w))
            .collect::<Result<Vec<_>>>()?;
        // Each weight's output columns and depth.
        let dims: Vec<(usize, usize)> = layouts
            .iter()
            .map(|l| match order {
                WeightOrder::OutIn => (l.rows, l.cols),
                WeightOrder::InOut => (l.cols, l.rows),
            })
            .collect();
        let k = dims[0].1;
        if let Some((w, &(_, depth))) = slices.iter().zip(&dims).find(|(_, d)| d.1 != k) {
            return Err(bad(
                w,
                format!(
                    "it takes {depth} inputs but `{}` beside it in one product takes {k}",
                    first.tensor
                ),
            ));
        }
        let n = dims
            .iter()
            .try_fold(0usize, |a, d| a.checked_add(d.0))
            .ok_or_else(|| bad(first, "the product's columns overflow".into()))?;
        // Both layouts fit in the bf16 one's size (it pads the steps; f32 does not).
        n.div_ceil(NR)
            .checked_mul(
                k.checked_next_multiple_of(BF16_K_ALIGN)
                    .unwrap_or(usize::MAX),
            )
            .and_then(|v| v.checked_mul(NR))
            .ok_or_else(|| {
                bad(
                    first,
                    format!("a {n}×{k} weight overflows the address space"),
                )
            })?;
        // Weights stored as quantized codes keep them (`OutIn`: a checkpoint's linears).
        if order == WeightOrder::OutIn {
            if let Some(p) = int4::int4_panels(src, slices, &layouts, n, k, bf16, sort_steps)? {
                // Steps stored sorted by group take `depth` slots (padding included).
                let depth = p.order.as_ref().map_or(k, |o| o.stored.len());
                return Ok(PackedMatrix {
                    n,
                    k: depth,
                    panels: Panels::Int4(p),
                });
            }
        }
        let code_scales = match order {
            WeightOrder::OutIn => codes::code_scales(src, slices, &layouts, n, k)?,
            WeightOrder::InOut => None,
        };
        let mut parts = Vec::with_capacity(slices.len());
        let mut start = 0;
        for ((&w, layout), &(cols, _)) in slices.iter().zip(&layouts).zip(&dims) {
            // No rows asked: this says whether the source stores bytes (and checks them).
            let mut stored = StoredRows::default();
            if code_scales.is_some() {
                stored.keep_codes();
            }
            let stores = src.read_stored_rows(w, 0..0, &mut stored)?;
            parts.push((
                start,
                Reader {
                    src,
                    slice: w,
                    stored: stores.then_some(stored),
                    layout,
                },
            ));
            start += cols;
        }
        let mut stack = Stack {
            parts,
            order,
            outputs: n,
        };
        let panels = if let Some((kind, kblock, scales)) = code_scales {
            Panels::Codes(CodePanels::new(
                kind,
                fill_panels(&mut stack, order, n, k, batch)?,
                scales,
                kblock,
                bf16,
            ))
        } else if bf16 {
            Panels::Bf16(fill_panels(&mut stack, order, n, k, batch)?)
        } else {
            Panels::F32(fill_panels(&mut stack, order, n, k, batch)?)
        };
        drop(stack);
        Ok(PackedMatrix { n, k, panels })
    }

    /// A weight of `kind` codes `[n][k]` (row-major, no NaN codes) with scales
    /// `[n][⌈k/kblock⌉]`, packed as a checkpoint's FP8 or INT8 weight is (for the start-up
    /// self-check, tests and `tpc bench-gemm --sweep-codes`); `bf16` as for
    /// [`PackedMatrix::pack`].
    pub fn from_codes(
        kind: super::isa::CodeKind,
        n: usize,
        k: usize,
        codes: &[u8],
        scales: &[f32],
        kblock: usize,
        bf16: bool,
    ) -> PackedMatrix {
        let blocks = k.div_ceil(kblock);
        assert!(codes.len() == n * k && scales.len() == n * blocks && kblock > 0);
        let mut c = AlignedVec::zeroed(n.div_ceil(NR) * k * NR);
        let mut s = AlignedVec::zeroed(n.div_ceil(NR) * blocks * NR);
        for j in 0..n {
            let (q, jj) = (j / NR, j % NR);
            for p in 0..k {
                c[(q * k + p) * NR + jj] = codes[j * k + p];
            }
            for b in 0..blocks {
                s[(q * blocks + b) * NR + jj] = scales[j * blocks + b];
            }
        }
        PackedMatrix {
            n,
            k,
            panels: Panels::Codes(CodePanels::new(kind, c, s, kblock, bf16)),
        }
    }

    /// Bytes the packed weight occupies (padding included).
    pub fn bytes(&self) -> usize {
        match &self.panels {
            Panels::Bf16(v) => v.len() * 2,
            Panels::F32(v) => v.len() * 4,
            Panels::Codes(c) => c.bytes(),
            Panels::Int4(c) => c.bytes(),
        }
    }

    /// The activations a decode product with this weight multiplies where they are not `x`
    /// (for the start-up self-check's reference): the rows of `x` quantized to i16 per
    /// block, scaled back, for INT4 panels in a bf16 run and for INT8 ones where `kernels`
    /// run the integer GEMV. `None` elsewhere: those products take `x` as it is.
    pub(crate) fn decode_rows(&self, x: &Tensor, kernels: Kernels) -> Option<Tensor> {
        let xblock = match &self.panels {
            Panels::Int4(c) if c.bf16 => c.xblock,
            Panels::Codes(c) => c.integer_decode(kernels)?,
            _ => return None,
        };
        let (m, k) = x.rows_cols();
        let mut rows = QuantizedRows::new();
        rows.quantize(&x.data, m, k, xblock);
        let data = (0..m * k)
            .map(|i| f32::from(rows.q[i]) * rows.scales[i / k * rows.blocks + i % k / xblock])
            .collect();
        Some(Tensor::new(vec![m, k], data))
    }

    /// Whether the panels hold bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.panels, Panels::Bf16(_))
    }

    /// The input features a product takes: `k`, except for INT4 steps stored sorted by
    /// group, whose `k` slots hold the inputs and padding.
    pub fn inputs(&self) -> usize {
        match &self.panels {
            Panels::Int4(Int4Panels {
                order: Some(order), ..
            }) => order.position.len(),
            _ => self.k,
        }
    }

    /// Whether the panels hold INT4 codes.
    pub fn is_int4(&self) -> bool {
        matches!(self.panels, Panels::Int4(_))
    }

    /// Element `(j, p)`: output column `j`, input `p`, as f32.
    pub fn get(&self, j: usize, p: usize) -> f32 {
        let (q, jj) = (j / NR, j % NR);
        match &self.panels {
            Panels::Bf16(v) => widen(v[q * u16::panel_len(self.k) + u16::slot(p, jj)]),
            Panels::F32(v) => v[q * f32::panel_len(self.k) + f32::slot(p, jj)],
            Panels::Codes(c) => c.get(j, p, self.k),
            Panels::Int4(c) => c.get(j, p, self.k),
        }
    }

    fn panel_count(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// `x [.., k] · Wᵀ` → `[.., n]`, f32 accumulation, on the members of `team`, with the
    /// best kernels of this host.
    pub fn matmul(&self, x: &Tensor, team: &Team) -> Tensor {
        self.matmul_with(Kernels::detect(), x, team)
    }

    /// As [`PackedMatrix::matmul`] with a given kernel set.
    pub fn matmul_with(&self, kernels: Kernels, x: &Tensor, team: &Team) -> Tensor {
        let (m, k) = x.rows_cols();
        assert_eq!(
            k,
            self.inputs(),
            "linear: {k} input features against a packed weight of [{}, {}]",
            self.n,
            self.k
        );
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("activations have a feature dim") = self.n;
        // No rows, no columns, or no inputs (an empty sum): zeros.
        if m == 0 || self.n == 0 || k == 0 {
            return Tensor::zeros(shape);
        }
        let len = m * self.n;
        let mut data = crate::runtime::tensor::pool::empty(len);
        // Not zeroed first (a prompt's outputs are tens of MB per product): every path below
        // writes every output value and none reads one before writing it.
        let dst = SyncPtr::uninit(&mut data.spare_capacity_mut()[..len]);
        match &self.panels {
            // Steps stored in another order (act order): the activations are taken in it.
            Panels::Int4(Int4Panels {
                order: Some(order), ..
            }) => {
                let permuted = order.permute(x);
                self.write_product(kernels, &permuted, team, dst);
                crate::runtime::tensor::pool::give(permuted.data);
            }
            _ => self.write_product(kernels, x, team, dst),
        }
        // SAFETY: `empty` gave room for `len` values and `write_product` wrote all of them.
        unsafe { data.set_len(len) };
        Tensor::new(shape, data)
    }

    /// The product of `x` (`m` rows of `k`) into the `m × n` values at `dst`, all written.
    fn write_product(&self, kernels: Kernels, x: &Tensor, team: &Team, dst: SyncPtr<'_>) {
        let (m, k) = x.rows_cols();
        let panels = self.panel_count();
        // Small products are not worth waking a second thread.
        // (Under Miri, whose tests can afford only tiny shapes, tiny products are split too.)
        let threads = if self.n * k * m.min(8) < if cfg!(miri) { 1 << 8 } else { 1 << 16 } {
            1
        } else {
            team.size().min(panels)
        };
        let gemv = m <= kernels.gemv_max_rows(self.is_bf16());
        // Quantized codes in a bf16 run take the bf16 products for prompts, widened a chunk
        // of panels at a time.
        let bf16_prompt = !gemv && kernels.gemm_variant(true).bf16_activations();
        let codes = match &self.panels {
            Panels::Codes(c) if c.bf16 && bf16_prompt => Some(&self.panels),
            Panels::Int4(c) if c.bf16 && bf16_prompt => Some(&self.panels),
            _ => None,
        };
        let variant = if gemv {
            kernels.gemv_variant(self.is_bf16())
        } else {
            kernels.gemm_variant(self.is_bf16() || codes.is_some())
        };
        let bf16_panels = match &self.panels {
            Panels::Bf16(w) => Some(&w[..]),
            _ => codes.map(|_| &[][..]),
        };
        if let (Some(w), true) = (bf16_panels, variant.bf16_activations()) {
            let mut xb = BF16_ROWS.take();
            let lda = self.k.next_multiple_of(BF16_K_ALIGN);
            // AMX reads whole 16-row tiles: the rows past m are zeros.
            let rows = if variant == Isa::Amx {
                m.next_multiple_of(16)
            } else {
                m
            };
            // Every value is written below (padding included): no zeroing first.
            xb.set_len(rows * lda);
            if variant == Isa::Amx {
                // One share of 16-row groups per member: a prompt's rows are megabytes.
                let kblocks = lda / BF16_K_ALIGN;
                let group = 16 * lda;
                let groups = rows / 16;
                let members = if m * k < 1 << 16 { 1 } else { threads };
                let per = groups.div_ceil(members);
                let shares: Vec<std::sync::Mutex<&mut [u16]>> = xb
                    .chunks_mut(per * group)
                    .map(std::sync::Mutex::new)
                    .collect();
                team.run_on(shares.len(), &|member| {
                    let mut dst = shares[member].lock().unwrap_or_else(|e| e.into_inner());
                    let first = member * per * 16;
                    let x_rows = &x.data[(first * k).min(x.data.len())..]
                        [..((per * 16).min(m.saturating_sub(first)) * k)];
                    kernels.round_to_tiles(x_rows, k, kblocks, &mut dst);
                });
            } else {
                for (src, dst) in x.data.chunks_exact(k).zip(xb.chunks_exact_mut(lda)) {
                    kernels.round_to_bf16(src, &mut dst[..k]);
                    dst[k..].fill(0);
                }
            }
            let bf16 = Bf16Product {
                w,
                first: 0,
                n: self.n,
                k,
                a: &xb,
                lda,
                m,
                dst,
            };
            if gemv {
                let rows = Bf16Rows(&bf16, kernels);
                run_chunks(team, threads, panels, 1, 0, &|range| {
                    gemv_panels(&rows, m, self.n, range.panels, dst)
                });
            } else {
                let blocks = m.div_ceil(MC_BF16);
                // AMX reads all the block's activations per chunk: chunks of at least
                // AMX_MIN_CHUNK panels while every member still gets one.
                let min_chunk = if variant == Isa::Amx {
                    AMX_MIN_CHUNK
                } else {
                    0
                };
                run_chunks(
                    team,
                    threads,
                    panels,
                    blocks,
                    min_chunk,
                    &|range| match codes {
                        None => bf16.gemm(kernels, variant, range),
                        Some(c) => {
                            // AMX takes groups of panel pairs: the chunk is widened at once.
                            // The tile kernels take one pair at a time: each pair is widened
                            // just before its tiles, so it is still in L1/L2 when they read
                            // it (a chunk's widened panels overflow L2 and came back from L3).
                            let step = if variant == Isa::Amx {
                                range.panels.len().max(1)
                            } else {
                                2
                            };
                            let len = u16::panel_len(k);
                            let mut widened = CODE_PANELS.take();
                            for first in range.panels.clone().step_by(step) {
                                let panels = first..(first + step).min(range.panels.end);
                                widened.set_len(panels.len() * len);
                                for (q, out) in panels.clone().zip(widened.chunks_exact_mut(len)) {
                                    widen_to_bf16_pairs(kernels, c, q, k, out);
                                }
                                // The next pair's codes come from memory while these tiles
                                // run (widening them waited on every line otherwise).
                                if step == 2 {
                                    for q in panels.end..(panels.end + 2).min(range.panels.end) {
                                        prefetch_codes(c, q, k);
                                    }
                                }
                                let chunk = Bf16Product {
                                    w: &widened,
                                    first,
                                    ..bf16
                                };
                                chunk.gemm(
                                    kernels,
                                    variant,
                                    Chunk {
                                        panels,
                                        block: range.block,
                                    },
                                );
                            }
                            CODE_PANELS.set(widened);
                        }
                    },
                );
            }
            BF16_ROWS.set(xb);
            return;
        }
        if gemv {
            // INT4 panels of a bf16 run take the rows quantized to i16, and so do INT8
            // panels where the integer GEMV runs.
            let mut quantized = QUANTIZED_ROWS.take();
            match &self.panels {
                Panels::Int4(c) if c.bf16 => {
                    c.quantize_rows(&x.data, m, k, &mut quantized, kernels)
                }
                Panels::Codes(c) => {
                    if let Some(xblock) = c.integer_decode(kernels) {
                        quantized.quantize(&x.data, m, k, xblock);
                    }
                }
                _ => {}
            }
            let rows = F32Rows(self, kernels, &x.data, &quantized);
            run_chunks(team, threads, panels, 1, 0, &|range| {
                gemv_panels(&rows, m, self.n, range.panels, dst)
            });
            QUANTIZED_ROWS.set(quantized);
        } else {
            let mut packed_x = PACKED_ROWS.take();
            let group = kernels.f32_tile_rows();
            pack_rows(&x.data, m, k, group, &mut packed_x);
            run_chunks(team, threads, panels, 1, 0, &|range| {
                self.gemm_panels(kernels, &packed_x, m, range.panels, dst)
            });
            PACKED_ROWS.set(packed_x);
        }
    }

    /// The blocked GEMM over panels `range` (see the module doc); `a` is from `pack_rows`.
    fn gemm_panels(
        &self,
        kernels: Kernels,
        a: &[f32],
        m: usize,
        range: std::ops::Range<usize>,
        dst: SyncPtr,
    ) {
        let (n, k) = (self.n, self.k);
        let group = kernels.f32_tile_rows();
        let m_panels = m.div_ceil(group) * (group / MR);
        let mut widened = vec![0f32; (KC + 1) * NR];
        let mut edge = [0f32; MAX_TILE_ROWS * NR];
        for mb in (0..m_panels).step_by(MC / MR) {
            let mb_end = (mb + MC / MR).min(m_panels);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                let a_block = &a[k0 * m_panels * MR..(k0 + kc) * m_panels * MR];
                for q in range.clone() {
                    let b: &[f32] = match &self.panels {
                        Panels::F32(v) => {
                            let start = q * f32::panel_len(k) + k0 * NR;
                            &v[start..start + kc * NR]
                        }
                        Panels::Bf16(v) => {
                            // k0 is even, so the block starts on a pair row; an odd kc
                            // widens the zero step after it too.
                            let start = q * u16::panel_len(k) + k0 * NR;
                            let len = kc.next_multiple_of(2) * NR;
                            kernels.widen_pairs(&v[start..start + len], &mut widened);
                            &widened[..kc * NR]
                        }
                        Panels::Codes(c) => {
                            let (codes, scales) = (c.panel(q, k), c.panel_scales(q, k));
                            kernels.widen_codes(
                                c.kind,
                                codes,
                                scales,
                                c.kblock,
                                k0,
                                kc,
                                &mut widened,
                            );
                            &widened[..kc * NR]
                        }
                        Panels::Int4(c) => {
                            c.widen(kernels, q, k, k0, kc, &mut widened);
                            &widened[..kc * NR]
                        }
                    };
                    let cols = NR.min(n - q * NR);
                    for mp in (mb..mb_end).step_by(group / MR) {
                        let rows = group.min(m - mp * MR);
                        let ap = &a_block[mp * MR * kc..(mp * MR + group) * kc];
                        let accumulate = k0 > 0;
                        // SAFETY: `ap` holds kc·group and `b` kc·NR values. The span is
                        // the `rows` rows from mp·MR (< m) of columns q·NR.. + cols (≤ n)
                        // of the m × n output, owned by this thread (panel q). A full tile
                        // (rows = group, cols = NR) writes exactly those; a partial tile
                        // goes through `edge` and copies back only the rows and columns
                        // that exist (reading back only values this thread wrote with the
                        // first depth block).
                        unsafe {
                            let o = dst.span(mp * MR * n + q * NR, (rows - 1) * n + cols);
                            if rows == group && cols == NR {
                                kernels.tile_f32(kc, ap.as_ptr(), b.as_ptr(), o, n, accumulate);
                            } else {
                                // The first depth block overwrites: nothing to read.
                                for r in (0..rows).filter(|_| accumulate) {
                                    std::ptr::copy_nonoverlapping(
                                        o.add(r * n),
                                        edge.as_mut_ptr().add(r * NR),
                                        cols,
                                    );
                                }
                                let e = edge.as_mut_ptr();
                                kernels.tile_f32(kc, ap.as_ptr(), b.as_ptr(), e, NR, accumulate);
                                for r in 0..rows {
                                    std::ptr::copy_nonoverlapping(
                                        e.add(r * NR),
                                        o.add(r * n),
                                        cols,
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Each weight's first output column in a product of weights side by side (`layouts`).
fn first_columns(layouts: &[SliceLayout]) -> Vec<usize> {
    layouts
        .iter()
        .scan(0, |at, l| {
            let s = *at;
            *at += l.rows;
            Some(s)
        })
        .collect()
}

/// A decode product's source of output rows: `R` rows from row `first` on, of panel `q`.
trait PanelRows: Sync {
    fn rows<const R: usize>(&self, q: usize, first: usize, out: &mut [[f32; NR]; R]);
}

/// f32 activations against any panel type (quantized to i16 for the INT4 panels of a bf16
/// run, and the INT8 ones where the integer GEMV runs).
struct F32Rows<'a>(&'a PackedMatrix, Kernels, &'a [f32], &'a QuantizedRows);

impl PanelRows for F32Rows<'_> {
    fn rows<const R: usize>(&self, q: usize, first: usize, out: &mut [[f32; NR]; R]) {
        let (w, kernels, k) = (self.0, self.1, self.0.k);
        let xs = &self.2[first * k..];
        match &w.panels {
            Panels::Bf16(v) => {
                let len = u16::panel_len(k);
                kernels.gemv::<R, _>(xs, k, &v[q * len..(q + 1) * len], k, out)
            }
            Panels::F32(v) => {
                let len = f32::panel_len(k);
                kernels.gemv::<R, _>(xs, k, &v[q * len..(q + 1) * len], k, out)
            }
            Panels::Codes(c) => {
                let (codes, scales) = (c.panel(q, k), c.panel_scales(q, k));
                match c.integer_decode(kernels) {
                    Some(xblock) => {
                        let (x, blocks) = (self.3, self.3.blocks);
                        kernels.gemv_int8::<R>(
                            &x.q[first * k..],
                            k,
                            &x.scales[first * blocks..],
                            blocks,
                            codes,
                            scales,
                            k,
                            c.kblock,
                            xblock,
                            out,
                        )
                    }
                    None => kernels.gemv_codes::<R>(xs, k, c.kind, codes, scales, k, c.kblock, out),
                }
            }
            Panels::Int4(c) if !c.bf16 => {
                // An f32 run keeps f32 activations: the panel is widened a block of steps at
                // a time (into L1) for the f32 GEMV.
                let mut block = [0f32; KC * NR];
                let mut part = [[0f32; NR]; R];
                *out = [[0f32; NR]; R];
                for k0 in (0..k).step_by(KC) {
                    let kc = KC.min(k - k0);
                    c.widen(kernels, q, k, k0, kc, &mut block);
                    kernels.gemv::<R, f32>(&xs[k0..], k, &block[..kc * NR], kc, &mut part);
                    for (o, p) in out.iter_mut().zip(&part) {
                        for (o, p) in o.iter_mut().zip(p) {
                            *o += p;
                        }
                    }
                }
            }
            Panels::Int4(c) => {
                let (x, blocks) = (self.3, self.3.blocks);
                kernels.gemv_int4::<R>(
                    &x.q[first * k..],
                    x.split.get(2 * first * k..).unwrap_or_default(),
                    k,
                    &x.scales[first * blocks..],
                    &x.sums[first * blocks..],
                    blocks,
                    c.panel(q, k),
                    c.panel_scales(q, k),
                    c.panel_zeros(q, k),
                    k,
                    c.kblock,
                    c.xblock,
                    out,
                )
            }
        }
    }
}

/// Rounded bf16 activations against bf16 panels (`vdpbf16ps`).
struct Bf16Rows<'a>(&'a Bf16Product<'a>, Kernels);

impl PanelRows for Bf16Rows<'_> {
    fn rows<const R: usize>(&self, q: usize, first: usize, out: &mut [[f32; NR]; R]) {
        let p = self.0;
        let xs = &p.a[first * p.lda..];
        self.1.gemv_bf16x::<R>(xs, p.lda, p.panel(q), p.k, out)
    }
}

/// Output columns `[q·NR, q·NR + NR)` of all `m` rows of an `n`-column output, for panels
/// `q` in `range`, up to `GEMV_MAX_ROWS` rows per kernel call.
fn gemv_panels(
    src: &impl PanelRows,
    m: usize,
    n: usize,
    range: std::ops::Range<usize>,
    dst: SyncPtr,
) {
    fn head<const R: usize>(rows: &mut [[f32; NR]; GEMV_MAX_ROWS]) -> &mut [[f32; NR]; R] {
        (&mut rows[..R]).try_into().expect("R ≤ GEMV_MAX_ROWS")
    }
    for q in range {
        let cols = NR.min(n - q * NR);
        let mut rows = [[0f32; NR]; GEMV_MAX_ROWS];
        let mut done = 0;
        while done < m {
            let r = (m - done).min(GEMV_MAX_ROWS);
            match r {
                1 => src.rows::<1>(q, done, head(&mut rows)),
                2 => src.rows::<2>(q, done, head(&mut rows)),
                3 => src.rows::<3>(q, done, head(&mut rows)),
                _ => src.rows::<4>(q, done, head(&mut rows)),
            }
            for (i, row) in rows[..r].iter().enumerate() {
                // SAFETY: row `done + i` < m and columns q·NR .. q·NR + cols ≤ n lie in the
                // m × n output; only this thread writes panel q's columns.
                unsafe {
                    let o = dst.span((done + i) * n + q * NR, cols);
                    std::ptr::copy_nonoverlapping(row.as_ptr(), o, cols);
                }
            }
            done += r;
        }
    }
}

/// One work item: weight panels `panels` for row block `block` (of `MC_BF16` rows).
struct Chunk {
    panels: std::ops::Range<usize>,
    block: usize,
}

/// Panel `q` of quantized codes widened to the bf16 pairs the bf16 products read.
fn widen_to_bf16_pairs(kernels: Kernels, panels: &Panels, q: usize, k: usize, out: &mut [u16]) {
    match panels {
        Panels::Codes(c) => kernels.codes_to_bf16_pairs(
            c.kind,
            c.panel(q, k),
            c.panel_scales(q, k),
            c.kblock,
            k,
            out,
        ),
        Panels::Int4(c) => kernels.int4_to_bf16_pairs(
            c.panel(q, k),
            c.panel_scales(q, k),
            c.panel_zeros(q, k),
            c.kblock,
            k,
            out,
        ),
        Panels::Bf16(_) | Panels::F32(_) => unreachable!("only quantized panels are widened"),
    }
}

/// Asks for panel `q`'s codes into L2, a line at a time.
fn prefetch_codes(panels: &Panels, q: usize, k: usize) {
    let codes = match panels {
        Panels::Codes(c) => c.panel(q, k),
        Panels::Int4(c) => c.panel(q, k),
        Panels::Bf16(_) | Panels::F32(_) => return,
    };
    #[cfg(target_arch = "x86_64")]
    for line in codes.chunks(64) {
        prefetch_l2(line.as_ptr());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = codes;
}

/// Runs `work` over `blocks` row blocks × chunks of `panels` (an even number each, so the
/// bf16 tiles get panel pairs) on `threads` members, block-major: members take chunks as
/// they come free rather than fixed halves, so a member that starts late or is preempted
/// (this machine has noisy neighbours) does less instead of making the others wait for it.
fn run_chunks(
    team: &Team,
    threads: usize,
    panels: usize,
    blocks: usize,
    min_chunk: usize,
    work: &(dyn Fn(Chunk) + Sync),
) {
    let chunk = panels
        .div_ceil(threads * CHUNKS_PER_MEMBER)
        .max(min_chunk.min(panels.div_ceil(threads)))
        .max(1)
        .next_multiple_of(2);
    let per_block = panels.div_ceil(chunk);
    let next = std::sync::atomic::AtomicUsize::new(0);
    team.run_on(threads, &|_member| loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if i >= per_block * blocks {
            break;
        }
        let start = (i % per_block) * chunk;
        work(Chunk {
            panels: start..(start + chunk).min(panels),
            block: i / per_block,
        });
    });
}

/// A product of bf16 activation rows by bf16 panels (the `avx512bf16` and `amx` variants).
struct Bf16Product<'a> {
    /// Panels `first..` (all of them, or a chunk's made from quantized codes).
    w: &'a [u16],
    first: usize,
    n: usize,
    k: usize,
    /// Rounded activations, zero past `k`: `[m][lda]`, or for AMX 16-row × 32-step tiles
    /// (`[rows/16][lda/32][16][32]`, rows rounded up to 16, zero past `m`).
    a: &'a [u16],
    lda: usize,
    m: usize,
    dst: SyncPtr<'a>,
}

impl Bf16Product<'_> {
    fn panel(&self, q: usize) -> &[u16] {
        let len = u16::panel_len(self.k);
        &self.w[(q - self.first) * len..][..len]
    }

    /// Rows of block `chunk.block` × panels `chunk.panels` (taken in pairs).
    fn gemm(&self, kernels: Kernels, variant: Isa, chunk: Chunk) {
        let rows = chunk.block * MC_BF16..((chunk.block + 1) * MC_BF16).min(self.m);
        #[cfg(target_arch = "x86_64")]
        if variant == Isa::Amx {
            return self.gemm_amx(rows, chunk.panels);
        }
        let _ = variant;
        let pairs = self.k.div_ceil(2);
        for q in chunk.panels.clone().step_by(2) {
            let two = q + 1 < chunk.panels.end;
            let last_cols = NR.min(self.n - (q + two as usize) * NR);
            let b0 = self.panel(q).as_ptr();
            let b1 = if two { self.panel(q + 1).as_ptr() } else { b0 };
            let mut r0 = rows.start;
            while r0 < rows.end {
                let r = (rows.end - r0).min(12);
                // SAFETY: rows r0.. r0 + r < m of `a` hold 2·pairs ≤ lda values; the panels
                // hold `pairs` pair rows; the tile writes rows r0.. + r and the columns of
                // panels q (and q + 1) that exist, owned by this thread.
                unsafe {
                    let a = self.a.as_ptr().add(r0 * self.lda);
                    let width = (two as usize) * NR + last_cols;
                    let c = self
                        .dst
                        .span(r0 * self.n + q * NR, (r - 1) * self.n + width);
                    macro_rules! tile {
                        ($r:literal) => {
                            if two {
                                kernels.tile_bf16::<$r, 2>(
                                    a,
                                    self.lda,
                                    [b0, b1],
                                    pairs,
                                    c,
                                    self.n,
                                    last_cols,
                                )
                            } else {
                                kernels.tile_bf16::<$r, 1>(
                                    a,
                                    self.lda,
                                    [b0],
                                    pairs,
                                    c,
                                    self.n,
                                    last_cols,
                                )
                            }
                        };
                    }
                    match r {
                        1 => tile!(1),
                        2 => tile!(2),
                        3 => tile!(3),
                        4 => tile!(4),
                        5 => tile!(5),
                        6 => tile!(6),
                        7 => tile!(7),
                        8 => tile!(8),
                        9 => tile!(9),
                        10 => tile!(10),
                        11 => tile!(11),
                        _ => tile!(12),
                    }
                }
                r0 += r;
            }
        }
    }

    /// AMX, in three levels (see `AMX_SLICE` and `AMX_SUMS_BYTES` for the sizes):
    /// - a group of panel pairs whose partial sums for all the chunk's rows stay in L2;
    /// - a slice of the depth: the rows' activations for it stay in L2 while every pair of
    ///   the group passes over them;
    /// - one pair's slice of weights (from memory once, then L1) under every 32-row block,
    ///   the 2 × 2 tiles adding into the sums.
    ///
    /// The sums go to the output when the group's depth is done.
    #[cfg(target_arch = "x86_64")]
    fn gemm_amx(&self, rows: std::ops::Range<usize>, panels: std::ops::Range<usize>) {
        use super::isa::{AmxTiles, AMX_TILE};
        let kblocks = self.lda / BF16_K_ALIGN;
        let slice = AMX_SLICE / BF16_K_ALIGN;
        let blocks = rows.len().div_ceil(32);
        let pair_sums = blocks * 32 * 32;
        let group_pairs = (AMX_SUMS_BYTES / (pair_sums * 4)).max(1);
        // Every block's first slice overwrites its sums: no zeroing.
        let mut sums = AMX_SUMS.take();
        sums.set_len(group_pairs * pair_sums);
        let panel_len = u16::panel_len(self.k);
        let w = self.w.as_ptr();
        // The first value of panel q at k-block t (for prefetches, past the end too).
        let at = |q: usize, t: usize| {
            w.wrapping_add((q - self.first) * panel_len + t * BF16_K_ALIGN * NR) as *const u8
        };
        // SAFETY: `Kernels` holds `Isa::Amx` only where the host supports it.
        let tiles = unsafe { AmxTiles::configure() };
        for g0 in panels.clone().step_by(2 * group_pairs) {
            let group = g0..(g0 + 2 * group_pairs).min(panels.end);
            let group_len = group.len().div_ceil(2);
            for k0 in (0..kblocks).step_by(slice) {
                let kb = slice.min(kblocks - k0);
                // The activations of the next slice (this group's, else the next group's
                // first) are asked into L2 while this one computes: from L3 the tile
                // loads would wait for each line in turn.
                let a_next = if k0 + kb < kblocks { k0 + kb } else { 0 };
                let a_next_kb = slice.min(kblocks - a_next);
                let a_lines = rows.len().div_ceil(16) * a_next_kb * 16;
                let a_per_call = a_lines.div_ceil(group_len * blocks);
                let a_first = (rows.start / 16) * kblocks * AMX_TILE;
                let prefetch_a = |call: usize| {
                    for li in call * a_per_call..((call + 1) * a_per_call).min(a_lines) {
                        let (rt, off) = (li / (a_next_kb * 16), li % (a_next_kb * 16));
                        let tile = a_first + (rt * kblocks + a_next) * AMX_TILE;
                        prefetch_l2(self.a.as_ptr().wrapping_add(tile + off * 32) as *const u8);
                    }
                };
                for (g, q) in group.clone().step_by(2).enumerate() {
                    let two = q + 1 < group.end;
                    let (b0, b1) = (
                        at(q, k0) as *const u16,
                        at(q + two as usize, k0) as *const u16,
                    );
                    // The weights read next — the group's next pair at this slice, else its
                    // first at the next slice, else the next group's first — are asked into
                    // L2 meanwhile, the first half of the row blocks asking for the first
                    // panel's part, the second half for the second's.
                    let next = if q + 2 < group.end {
                        (q + 2, k0)
                    } else if k0 + kb < kblocks {
                        (g0, k0 + kb)
                    } else {
                        (group.end, 0)
                    };
                    let next_kb = slice.min(kblocks.saturating_sub(next.1)).max(1);
                    let half = blocks.div_ceil(2);
                    let lines = (next_kb * AMX_TILE * 2 / 64).div_ceil(half * kb);
                    for (i, r0) in rows.clone().step_by(32).enumerate() {
                        let (panel, j) = if i < half {
                            (next.0, i)
                        } else {
                            (next.0 + 1, i - half)
                        };
                        let ahead = (at(panel, next.1).wrapping_add(j * kb * lines * 64), lines);
                        // `a` has whole 16-row tiles of zeros past m.
                        let r16 = if self.m.next_multiple_of(16) - r0 >= 32 {
                            2
                        } else {
                            1
                        };
                        let accumulate = k0 > 0;
                        prefetch_a(g * blocks + i);
                        // SAFETY: `a` holds the row tiles of rows r0.. + 16·r16 (rows rounded
                        // up to 16), kblocks tiles each, of which k0.. + kb are read; each
                        // panel kblocks tiles of 1 KiB, k0.. + kb read; `sums` has 32 × 32
                        // values for every block of every pair of the group.
                        unsafe {
                            let a = self.a.as_ptr().add(((r0 / 16) * kblocks + k0) * AMX_TILE);
                            let a = (a, kblocks * AMX_TILE);
                            let c = (sums.as_mut_ptr().add(g * pair_sums + i * 32 * 32), 32);
                            match (r16, two) {
                                (2, true) => {
                                    tiles.block::<2, 2>(a, [b0, b1], kb, c, accumulate, ahead)
                                }
                                (2, false) => {
                                    tiles.block::<2, 1>(a, [b0], kb, c, accumulate, ahead)
                                }
                                (_, true) => {
                                    tiles.block::<1, 2>(a, [b0, b1], kb, c, accumulate, ahead)
                                }
                                (_, false) => {
                                    tiles.block::<1, 1>(a, [b0], kb, c, accumulate, ahead)
                                }
                            }
                        }
                    }
                }
            }
            for (g, q) in group.clone().step_by(2).enumerate() {
                let cols = (self.n - q * NR).min(if q + 1 < group.end { 2 * NR } else { NR });
                let pair = &sums[g * pair_sums..(g + 1) * pair_sums];
                for (r, sum) in rows.clone().zip(pair.chunks_exact(32)) {
                    // SAFETY: row r < m, the columns of panels q (and q + 1) that exist,
                    // this thread's.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            sum.as_ptr(),
                            self.dst.span(r * self.n + q * NR, cols),
                            cols,
                        )
                    };
                }
            }
        }
        drop(tiles);
        AMX_SUMS.set(sums);
    }
}

/// Asks for the cache line at `p` into L2.
#[cfg(target_arch = "x86_64")]
fn prefetch_l2(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) };
}

/// What a panel holds: bf16 bits or f32, made from stored bytes or from an f32 value
/// exactly as [`PackedMatrix::pack`] makes it.
/// Quantized codes are made from stored bytes only (a source without them has no codes).
trait PanelElem: Plain + Send + Sync {
    /// Values in one panel of `k` steps, and the index of step `p`, column `j` in it.
    fn elem_panel_len(k: usize) -> usize;
    fn elem_slot(p: usize, j: usize) -> usize;
    fn from_stored(s: &StoredRows, r: usize, c0: usize, out: &mut [Self]) -> Result<()>;
    fn from_f32(v: f32) -> Option<Self>;
}

impl PanelElem for u16 {
    fn elem_panel_len(k: usize) -> usize {
        u16::panel_len(k)
    }
    fn elem_slot(p: usize, j: usize) -> usize {
        u16::slot(p, j)
    }
    fn from_stored(s: &StoredRows, r: usize, c0: usize, out: &mut [u16]) -> Result<()> {
        s.bf16_bits(r, c0, out)
    }
    fn from_f32(v: f32) -> Option<u16> {
        Some(half::bf16::from_f32(v).to_bits())
    }
}

impl PanelElem for f32 {
    fn elem_panel_len(k: usize) -> usize {
        f32::panel_len(k)
    }
    fn elem_slot(p: usize, j: usize) -> usize {
        f32::slot(p, j)
    }
    fn from_stored(s: &StoredRows, r: usize, c0: usize, out: &mut [f32]) -> Result<()> {
        s.f32s(r, c0, out)
    }
    fn from_f32(v: f32) -> Option<f32> {
        Some(v)
    }
}

/// A quantized code, FP8 or INT8 (`[k][NR]` panels).
impl PanelElem for u8 {
    fn elem_panel_len(k: usize) -> usize {
        k * NR
    }
    fn elem_slot(p: usize, j: usize) -> usize {
        p * NR + j
    }
    fn from_stored(s: &StoredRows, r: usize, c0: usize, out: &mut [u8]) -> Result<()> {
        s.codes(r, c0, out)
    }
    fn from_f32(_: f32) -> Option<u8> {
        None
    }
}

/// Reads windows of a slice's local rows from a weight source.
struct Reader<'a> {
    src: &'a dyn WeightSource,
    slice: &'a WeightSlice,
    /// The batch of the slice's local rows read last, as stored, when the source stores
    /// bytes (padding included).
    stored: Option<StoredRows>,
    layout: &'a SliceLayout,
}

impl Reader<'_> {
    /// Reads the slice's local rows `rows` (a source that stores bytes; the others are read
    /// a window at a time).
    fn load(&mut self, rows: std::ops::Range<usize>) -> Result<()> {
        if let Some(s) = &mut self.stored {
            self.src.read_stored_rows(self.slice, rows, s)?;
        }
        Ok(())
    }

    /// Local row `r`, columns `[c0, c0 + out.len())`, into `out`: from the rows loaded last
    /// when the source stores bytes; `f32s` is scratch for a source without them.
    fn row<T: PanelElem>(
        &self,
        r: usize,
        c0: usize,
        out: &mut [T],
        f32s: &mut Vec<f32>,
    ) -> Result<()> {
        if let Some(s) = &self.stored {
            // The stored rows hold the padding as zero bytes: zero in every encoding, as
            // `T::default()` is.
            return T::from_stored(s, r, c0, out);
        }
        self.layout
            .pieces(r, c0, out.len(), |at, piece| match piece {
                Piece::Zeros { len } => {
                    out[at..at + len].fill(T::default());
                    Ok(())
                }
                Piece::Stored { from, len } => {
                    f32s.clear();
                    self.src.read(&self.slice.tensor, from, len, f32s)?;
                    if f32s.len() != len {
                        return Err(WeightError::Tensor {
                            path: "weight source".into(),
                            tensor: self.slice.tensor.to_string(),
                            problem: format!("gave {} elements for {len} asked", f32s.len()),
                        });
                    }
                    for (o, &v) in out[at..at + len].iter_mut().zip(f32s.iter()) {
                        *o = T::from_f32(v).ok_or_else(|| WeightError::Tensor {
                            path: "weight source".into(),
                            tensor: self.slice.tensor.to_string(),
                            problem: "has no stored codes to pack; report this as a bug".into(),
                        })?;
                    }
                    Ok(())
                }
            })
    }
}

/// Weights side by side along the output features: each reader with the first output
/// column it fills. Rows and columns are those of the stored orientation of the whole
/// (`OutIn`: the weights' rows one after another; `InOut`: each row the weights' rows side
/// by side).
struct Stack<'a> {
    parts: Vec<(usize, Reader<'a>)>,
    order: WeightOrder,
    /// Output columns of the whole.
    outputs: usize,
}

impl Stack<'_> {
    /// The part holding output column `j`, with its first column and its last + 1.
    fn part_of(&self, j: usize) -> (usize, usize, &Reader<'_>) {
        let at = self.parts.partition_point(|(start, _)| *start <= j) - 1;
        let end = self.parts.get(at + 1).map_or(self.outputs, |p| p.0);
        let (start, reader) = &self.parts[at];
        (*start, end, reader)
    }

    /// Reads rows `[r0, r1)` of the whole into the readers that hold them: for `OutIn` the
    /// weights' own rows there, for `InOut` those rows of every weight.
    fn load(&mut self, r0: usize, r1: usize) -> Result<()> {
        let ends: Vec<usize> = (self.parts.iter().skip(1).map(|p| p.0))
            .chain([self.outputs])
            .collect();
        for ((start, reader), end) in self.parts.iter_mut().zip(ends) {
            match self.order {
                WeightOrder::OutIn => {
                    let (a, b) = (r0.max(*start), r1.min(end));
                    if a < b {
                        reader.load(a - *start..b - *start)?;
                    }
                }
                WeightOrder::InOut => reader.load(r0..r1)?,
            }
        }
        Ok(())
    }

    /// Row `r` of the whole, columns `[c0, c0 + out.len())`, into `out` (from the rows
    /// loaded last, where the source stores bytes).
    fn row<T: PanelElem>(
        &self,
        r: usize,
        c0: usize,
        out: &mut [T],
        f32s: &mut Vec<f32>,
    ) -> Result<()> {
        match self.order {
            WeightOrder::OutIn => {
                let (start, _, reader) = self.part_of(r);
                reader.row(r - start, c0, out, f32s)
            }
            // A run of output columns may cross from one weight into the next.
            WeightOrder::InOut => {
                let mut done = 0;
                while done < out.len() {
                    let (start, end, reader) = self.part_of(c0 + done);
                    let len = (end - (c0 + done)).min(out.len() - done);
                    reader.row(r, c0 + done - start, &mut out[done..done + len], f32s)?;
                    done += len;
                }
                Ok(())
            }
        }
    }
}

/// How many stored rows a packer reads at a time (per weight being packed).
#[derive(Debug, Clone, Copy)]
struct Batch {
    /// Bytes at most: few enough that the batch stays small beside the weight, enough that
    /// its reads are long.
    bytes: usize,
    /// `OutIn` panels per batch at least, so that every thread has work.
    min_panels: usize,
}

impl Batch {
    fn for_this_host() -> Batch {
        Batch {
            bytes: 8 << 20,
            min_panels: 4 * rayon::current_num_threads(),
        }
    }

    /// Rows of `row_len` elements (up to 4 bytes each) per batch, a multiple of `multiple`:
    /// as many as `bytes` holds, at least `min_rows` and at least `multiple`.
    fn rows(self, row_len: usize, multiple: usize, min_rows: usize) -> usize {
        let fit = self.bytes / row_len.saturating_mul(4).max(1);
        fit.max(min_rows).div_ceil(multiple).max(1) * multiple
    }
}

/// The panels of an `n × k` weight (layout of `T`), one panel per task, the stored rows
/// read a batch at a time.
fn fill_panels<T: PanelElem>(
    stack: &mut Stack,
    order: WeightOrder,
    n: usize,
    k: usize,
    batch: Batch,
) -> Result<AlignedVec<T>> {
    let panel_len = T::elem_panel_len(k);
    let len = n.div_ceil(NR) * panel_len;
    let mut out = AlignedVec::zeroed(len);
    if len == 0 {
        return Ok(out);
    }
    let scratch = || (Vec::<T>::new(), Vec::<f32>::new());
    match order {
        // Stored `[n, k]`: a batch is whole panels' rows. Each panel reads its 16 stored
        // rows of k, then transposes them into the panel a 16 × 16 tile at a time (both
        // sides of a tile stay in L1).
        WeightOrder::OutIn => {
            let per = batch.rows(k, NR, NR * batch.min_panels);
            for (b, batch) in out.chunks_mut(per / NR * panel_len).enumerate() {
                let j0 = b * per;
                stack.load(j0, n.min(j0 + per))?;
                let stack = &*stack;
                batch
                    .par_chunks_mut(panel_len)
                    .enumerate()
                    .try_for_each_init(scratch, |(rows, f32s), (qq, panel)| {
                        let q = j0 / NR + qq;
                        let cols = NR.min(n - q * NR);
                        rows.resize(cols * k, T::default());
                        for (jj, row) in rows.chunks_exact_mut(k).enumerate() {
                            stack.row(q * NR + jj, 0, row, f32s)?;
                        }
                        for p0 in (0..k).step_by(NR) {
                            let w = NR.min(k - p0);
                            for (jj, row) in rows.chunks_exact(k).enumerate() {
                                for (pp, &v) in row[p0..p0 + w].iter().enumerate() {
                                    panel[T::elem_slot(p0 + pp, jj)] = v;
                                }
                            }
                        }
                        Ok::<(), WeightError>(())
                    })?;
            }
        }
        // Stored `[k, n]`: a batch is rows of every panel; each row's 16 columns are one run.
        WeightOrder::InOut => {
            let per = batch.rows(n, 1, 1);
            for p0 in (0..k).step_by(per) {
                let p1 = k.min(p0 + per);
                stack.load(p0, p1)?;
                let stack = &*stack;
                out.par_chunks_mut(panel_len)
                    .enumerate()
                    .try_for_each_init(scratch, |(rows, f32s), (q, panel)| {
                        rows.resize(NR.min(n - q * NR), T::default());
                        for p in p0..p1 {
                            stack.row(p, q * NR, rows, f32s)?;
                            for (jj, &v) in rows.iter().enumerate() {
                                panel[T::elem_slot(p, jj)] = v;
                            }
                        }
                        Ok::<(), WeightError>(())
                    })?;
            }
        }
    }
    Ok(out)
}

thread_local! {
    /// The packed activations of the last GEMM on this thread, kept so that the next one
    /// reuses the memory instead of faulting in fresh pages (a prompt's rows are megabytes).
    static PACKED_ROWS: std::cell::Cell<AlignedVec<f32>> = const { std::cell::Cell::new(AlignedVec::new()) };
    /// The same for the bf16 activation rows of the bf16 products.
    static BF16_ROWS: std::cell::Cell<AlignedVec<u16>> = const { std::cell::Cell::new(AlignedVec::new()) };
    /// A chunk's code panels widened to bf16 for a prompt product, kept the same way.
    static CODE_PANELS: std::cell::Cell<AlignedVec<u16>> = const { std::cell::Cell::new(AlignedVec::new()) };
    /// Decode rows quantized to i16 for the INT4 and INT8 GEMVs, kept the same way (a decode step
    /// runs a few hundred products).
    static QUANTIZED_ROWS: std::cell::Cell<QuantizedRows> = const { std::cell::Cell::new(QuantizedRows::new()) };
    /// The AMX product's partial sums (`Bf16Product::gemm_amx`), kept the same way.
    static AMX_SUMS: std::cell::Cell<AlignedVec<f32>> = const { std::cell::Cell::new(AlignedVec::new()) };
}

/// `x [m, k]` → for each block of `KC` steps, panels `[kc][MR]` for `m` rounded up to
/// `group` rows (rows past `m` zero), into `out` (resized).
fn pack_rows(x: &[f32], m: usize, k: usize, group: usize, out: &mut AlignedVec<f32>) {
    pack_row_blocks(x, m, k, KC, group, out)
}

/// [`pack_rows`] with depth blocks of `block` steps (the last may be shorter): block
/// `(k0, kc)` starts at `k0 · m_panels · MR`.
fn pack_row_blocks(
    x: &[f32],
    m: usize,
    k: usize,
    block: usize,
    group: usize,
    out: &mut AlignedVec<f32>,
) {
    let m_panels = m.div_ceil(group) * (group / MR);
    out.set_len(m_panels * MR * k);
    out.fill(0.0);
    for k0 in (0..k).step_by(block.max(1)) {
        let kc = block.min(k - k0);
        let block = &mut out[k0 * m_panels * MR..(k0 + kc) * m_panels * MR];
        for (mp, panel) in block.chunks_exact_mut(MR * kc).enumerate() {
            for r in 0..MR.min(m.saturating_sub(mp * MR)) {
                let row = &x[(mp * MR + r) * k + k0..(mp * MR + r) * k + k0 + kc];
                for (p, &v) in row.iter().enumerate() {
                    panel[p * MR + r] = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::check_operands::{operands, reference};

    /// Every variant this host runs; the others are printed, not counted.
    fn host_variants() -> Vec<Kernels> {
        Isa::ALL
            .into_iter()
            .filter_map(|isa| match Kernels::unchecked(isa) {
                Ok(k) => Some(k),
                Err(e) => {
                    eprintln!("NOT RUN on this host: kernel variant {isa}: {e}");
                    None
                }
            })
            .collect()
    }

    fn check(m: usize, n: usize, k: usize, bf16: bool, order: WeightOrder) {
        let (x, w) = operands(m, n, k);
        let shape = match order {
            WeightOrder::OutIn => vec![n, k],
            WeightOrder::InOut => vec![k, n],
        };
        let w = Tensor::new(shape, w);
        let packed = PackedMatrix::pack(&w, order, bf16);
        for kernels in host_variants() {
            let round = bf16 && kernels.isa().bf16_activations();
            let want = reference(&x, packed.n, |j, p| packed.get(j, p), round);
            for &threads in if cfg!(miri) { &[2][..] } else { &[1, 2, 3] } {
                // The output is not zeroed first: leave NaNs where it will be taken from, so
                // a value no kernel writes shows.
                crate::runtime::tensor::pool::give(vec![f32::NAN; m * packed.n]);
                let got = packed.matmul_with(kernels, &x, &Team::new(threads));
                assert_eq!(got.shape, vec![m, packed.n]);
                for (i, (a, b)) in got.data.iter().zip(&want).enumerate() {
                    let isa = kernels.isa();
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()) * (k as f64).sqrt(),
                        "{isa}: m={m} n={n} k={k} bf16={bf16} threads={threads} at {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_path_matches_an_f64_reference_at_edge_sizes() {
        // Under Miri (portable kernels only; thousands of times slower), a few small shapes
        // that still reach every path that writes through `SyncPtr`: gemv and gemm split
        // over threads, partial tiles across two depth blocks (read back before the second).
        let miri: &[(usize, usize, usize)] = &[(1, 7, 5), (1, 40, 8), (7, 40, 8), (6, 3, 257)];
        // Rows across the GEMV limits (4; AVX2: 8 for f32, 32 for bf16 weights) and the
        // 6-row tiles, columns across 16-wide panels, depths across the 256-step blocks;
        // products big enough to be split over threads.
        let all: &[(usize, usize, usize)] = &[
            (1, 7, 5),
            (1, 300, 300),
            (2, 33, 64),
            (3, 17, 513),
            (4, 64, 1024),
            (5, 300, 41),
            (6, 16, 256),
            (7, 513, 96),
            (13, 48, 257),
            (150, 40, 300),
            // The bf16 tiles: 12-row dpbf16 tiles, 16/32-row AMX blocks with partial rows
            // and panels, odd panel counts, depths across 32-step blocks, row blocks of 192.
            (12, 16, 31),
            (16, 32, 64),
            (25, 100, 33),
            (33, 47, 70),
            (200, 80, 96),
            // AMX groups and depth slices: two groups of panel pairs (the second with an
            // odd panel count), three slices of the depth (the last partial), a last row
            // block with 24 rows.
            (600, 300, 600),
        ];
        for &(m, n, k) in if cfg!(miri) { miri } else { all } {
            for bf16 in [false, true] {
                check(m, n, k, bf16, WeightOrder::OutIn);
            }
        }
    }

    #[test]
    fn a_weight_with_no_inputs_gives_zeros_on_every_variant() {
        for bf16 in [false, true] {
            let w = PackedMatrix::pack(&Tensor::new(vec![3, 0], vec![]), WeightOrder::OutIn, bf16);
            for kernels in host_variants() {
                for m in [1, 9] {
                    let y = w.matmul_with(kernels, &Tensor::new(vec![m, 0], vec![]), &Team::new(2));
                    assert_eq!((y.shape.clone(), y.data), (vec![m, 3], vec![0.0; m * 3]));
                }
            }
        }
    }

    #[test]
    fn both_weight_orders_pack_the_same_matrix() {
        let w = Tensor::new(vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let t = Tensor::new(vec![3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let a = PackedMatrix::pack(&w, WeightOrder::OutIn, false);
        let b = PackedMatrix::pack(&t, WeightOrder::InOut, false);
        assert_eq!(a, b);
        assert_eq!((a.n, a.k), (2, 3));
        assert_eq!(a.get(1, 2), 6.0);
        check(9, 21, 35, true, WeightOrder::InOut);
    }

    #[test]
    fn bf16_packing_rounds_to_nearest_even() {
        let w = Tensor::new(vec![1, 2], vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0]);
        let p = PackedMatrix::pack(&w, WeightOrder::OutIn, true);
        // 1 + 2⁻⁸ is halfway between bf16 neighbours 1 and 1 + 2⁻⁷: ties go to even (1).
        assert_eq!(p.get(0, 0), 1.0);
        assert_eq!(p.get(0, 1), 1.0 + 4.0 / 256.0);
        // One panel of 16 columns, the 2 steps padded to one 32-step block, 2 bytes each.
        assert_eq!(p.bytes(), 16 * 32 * 2);
    }
}

/// `pack_slice` against `pack(load_slice(..))`, bit for bit, over every slicing a plan can
/// express, every stored dtype, both weight orders and both panel types.
#[cfg(test)]
mod slice_tests {
    use super::*;
    use crate::ir::QuantFormat;
    use crate::ir::{DType, SliceRange};
    use crate::plan::Plan;
    use crate::runtime::random::RandomWeights;
    use crate::runtime::weights::{load_slice, write_int4_checkpoint, Checkpoint, StoredDtype};
    use proptest::prelude::*;
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The panels as bits (f32 NaNs compare by their bits too).
    fn bits(m: &PackedMatrix) -> (usize, usize, bool, Vec<u32>) {
        let v = match &m.panels {
            Panels::Bf16(v) => v.iter().map(|&b| b as u32).collect(),
            Panels::F32(v) => v.iter().map(|f| f.to_bits()).collect(),
            Panels::Codes(c) => (c.codes.iter().map(|&b| b as u32))
                .chain(c.scales.iter().map(|f| f.to_bits()))
                .collect(),
            Panels::Int4(c) => (c.codes.iter().map(|&b| b as u32))
                .chain(c.scales.iter().chain(c.zeros.iter()).map(|f| f.to_bits()))
                .collect(),
        };
        (m.n, m.k, matches!(m.panels, Panels::Bf16(_)), v)
    }

    /// Stored rows a few at a time (one `InOut` row, one `OutIn` panel's rows per batch,
    /// or a few), so that small weights take many batches.
    const SMALL_BATCHES: [Batch; 2] = [
        Batch {
            bytes: 0,
            min_panels: 0,
        },
        Batch {
            bytes: 300,
            min_panels: 0,
        },
    ];

    fn assert_same(src: &dyn WeightSource, w: &WeightSlice, what: &str) {
        for order in [WeightOrder::OutIn, WeightOrder::InOut] {
            for bf16 in [false, true] {
                let old = PackedMatrix::pack(&load_slice(src, w).unwrap(), order, bf16);
                let new = PackedMatrix::pack_slice(src, w, order, bf16).unwrap();
                assert!(
                    bits(&old) == bits(&new),
                    "{what}: {w:?} {order:?} bf16={bf16}: panels differ"
                );
                for batch in SMALL_BATCHES {
                    let new =
                        PackedMatrix::pack_slices_in(src, &[w], order, bf16, batch, true).unwrap();
                    assert!(
                        bits(&old) == bits(&new),
                        "{what}: {w:?} {order:?} bf16={bf16} {batch:?}: panels differ"
                    );
                }
            }
        }
    }

    /// A directory with `model.safetensors` holding `tensors` (name, dtype, shape, bytes).
    fn write_checkpoint(tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tpc-pack-slice-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                (
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
        dir
    }

    /// Little-endian bytes of `values` bit patterns in `dtype` (low 16 bits for 2-byte ones).
    fn encode(dtype: StoredDtype, values: &[u32]) -> (Dtype, Vec<u8>) {
        match dtype {
            StoredDtype::F32 => (
                Dtype::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            StoredDtype::Bf16 => (
                Dtype::BF16,
                values
                    .iter()
                    .flat_map(|&v| (v as u16).to_le_bytes())
                    .collect(),
            ),
            StoredDtype::F16 => (
                Dtype::F16,
                values
                    .iter()
                    .flat_map(|&v| (v as u16).to_le_bytes())
                    .collect(),
            ),
            StoredDtype::F8E4m3 => (Dtype::F8_E4M3, values.iter().map(|&v| v as u8).collect()),
            StoredDtype::I8 => (Dtype::I8, values.iter().map(|&v| v as u8).collect()),
        }
    }

    /// A well-mixed 32-bit pattern for element `i` (splitmix64).
    fn bits_at(seed: u64, i: u64) -> u32 {
        let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) as u32
    }

    /// Values computed on demand: the path for sources without stored bytes.
    struct Computed(Vec<f32>);

    impl WeightSource for Computed {
        fn check(&self, _: &Plan) -> Result<()> {
            Ok(())
        }
        fn read(&self, _: &str, from: usize, count: usize, out: &mut Vec<f32>) -> Result<()> {
            out.extend_from_slice(&self.0[from..from + count]);
            Ok(())
        }
    }

    fn slice_of(
        shape: [usize; 2],
        dim: Option<u32>,
        ranges: &[(usize, usize)],
        padding: usize,
    ) -> WeightSlice {
        let mut local = shape;
        if let Some(d) = dim {
            local[d as usize] = ranges.iter().map(|r| r.1).sum::<usize>() + padding;
        }
        WeightSlice {
            tensor: "w".into(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            dtype: DType::F32,
            dim,
            ranges: ranges
                .iter()
                .map(|&(offset, len)| SliceRange {
                    offset: offset as u64,
                    len: len as u64,
                    pad: 0,
                })
                .collect(),
            padding: padding as u64,
            local_shape: local.iter().map(|&d| d as u64).collect(),
            quant: None,
        }
    }

    /// A random slicing of a random `[rows, cols]` tensor: whole, or 1–3 ranges of dim 0
    /// or 1 (within the dim, possibly overlapping, as fused pieces may be), each followed by
    /// some zeros (a fused part's padding), plus padding at the end.
    fn slicing() -> impl Strategy<Value = WeightSlice> {
        (
            1usize..40,
            1usize..40,
            0u32..3,
            prop::collection::vec((any::<usize>(), any::<usize>(), 0u64..4), 1..4),
            0usize..20,
        )
            .prop_map(|(rows, cols, dim, raw, padding)| {
                let dim = [None, Some(0), Some(1)][dim as usize];
                let len = match dim {
                    Some(0) => rows,
                    _ => cols,
                };
                let ranges: Vec<(usize, usize)> = raw
                    .iter()
                    .map(|&(a, b, _)| {
                        let offset = a % len;
                        (offset, b % (len - offset + 1))
                    })
                    .collect();
                match dim {
                    None => slice_of([rows, cols], None, &[], 0),
                    Some(d) => {
                        let mut w = slice_of([rows, cols], Some(d), &ranges, padding);
                        for (r, &(_, _, pad)) in w.ranges.iter_mut().zip(&raw) {
                            r.pad = pad;
                            w.local_shape[d as usize] += pad;
                        }
                        w
                    }
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn pack_slice_equals_pack_of_load_slice(
            w in slicing(),
            dtype in prop::sample::select(vec![StoredDtype::F32, StoredDtype::Bf16, StoredDtype::F16]),
            seed in any::<u64>(),
        ) {
            let n = (w.shape[0] * w.shape[1]) as usize;
            // Random bit patterns: NaNs (signalling too), infinities, subnormals included.
            let values: Vec<u32> = (0..n as u64).map(|i| bits_at(seed, i)).collect();
            let (st, bytes) = encode(dtype, &values);
            let shape = vec![w.shape[0] as usize, w.shape[1] as usize];
            let dir = write_checkpoint(&[("w".into(), st, shape, bytes)]);
            let ckpt = Checkpoint::open(&dir).unwrap();
            assert_same(&ckpt, &w, "checkpoint");
            let f32s = values.iter().map(|&v| f32::from_bits(v)).collect();
            assert_same(&Computed(f32s), &w, "computed");
            drop(ckpt);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// One part of a fused product: `n` outputs of depth `k`, stored in `order`, whole or
    /// a few ranges (plus padding) of its output dim.
    fn part(
        order: WeightOrder,
        k: usize,
        n: usize,
        raw: &[(usize, usize)],
        padding: usize,
        split: bool,
    ) -> WeightSlice {
        let ranges: Vec<(usize, usize)> = raw
            .iter()
            .map(|&(a, b)| {
                let offset = a % n;
                (offset, b % (n - offset + 1))
            })
            .collect();
        match (order, split) {
            (WeightOrder::OutIn, true) => slice_of([n, k], Some(0), &ranges, padding),
            (WeightOrder::OutIn, false) => slice_of([n, k], None, &[], 0),
            (WeightOrder::InOut, true) => slice_of([k, n], Some(1), &ranges, padding),
            (WeightOrder::InOut, false) => slice_of([k, n], None, &[], 0),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Weights packed side by side in one pass equal the packing of their slices joined
        /// on the host, bit for bit, wherever the weights meet inside a panel.
        #[test]
        fn pack_slices_equals_pack_of_the_slices_side_by_side(
            k in 1usize..40,
            parts in prop::collection::vec(
                (1usize..40, prop::collection::vec((any::<usize>(), any::<usize>()), 1..3), 0usize..6, any::<bool>()),
                1..4,
            ),
            in_out in any::<bool>(),
            dtype in prop::sample::select(vec![StoredDtype::F32, StoredDtype::Bf16]),
            seed in any::<u64>(),
        ) {
            let order = if in_out { WeightOrder::InOut } else { WeightOrder::OutIn };
            let slices: Vec<WeightSlice> = parts
                .iter()
                .enumerate()
                .map(|(i, (n, raw, padding, split))| WeightSlice {
                    tensor: format!("w{i}").into(),
                    ..part(order, k, *n, raw, *padding, *split)
                })
                .collect();
            let tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = slices
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let shape: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
                    let values: Vec<u32> = (0..shape.iter().product::<usize>() as u64)
                        .map(|e| bits_at(seed ^ i as u64, e))
                        .collect();
                    let (st, bytes) = encode(dtype, &values);
                    (w.tensor.to_string(), st, shape, bytes)
                })
                .collect();
            let dir = write_checkpoint(&tensors);
            let ckpt = Checkpoint::open(&dir).unwrap();
            let refs: Vec<&WeightSlice> = slices.iter().collect();
            let names: Vec<&str> = slices.iter().map(|w| &*w.tensor).collect();
            let loaded = slices
                .iter()
                .map(|w| load_slice(&ckpt, w).map(|t| (t.shape, t.data)))
                .collect::<Result<Vec<_>>>()
                .unwrap();
            let (shape, joined) =
                crate::runtime::weights::side_by_side(loaded, order, &names).unwrap();
            for bf16 in [false, true] {
                let old = PackedMatrix::pack(&Tensor::new(shape.clone(), joined.clone()), order, bf16);
                let new = PackedMatrix::pack_slices(&ckpt, &refs, order, bf16).unwrap();
                prop_assert!(bits(&old) == bits(&new), "{order:?} bf16={bf16}: panels differ");
                for batch in SMALL_BATCHES {
                    let new = PackedMatrix::pack_slices_in(&ckpt, &refs, order, bf16, batch, true).unwrap();
                    prop_assert!(bits(&old) == bits(&new), "{order:?} bf16={bf16} {batch:?}: panels differ");
                }
            }
            drop(ckpt);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn weights_of_different_depths_are_not_packed_together() {
        let a = WeightSlice {
            tensor: "a".into(),
            ..slice_of([4, 3], None, &[], 0)
        };
        let b = WeightSlice {
            tensor: "b".into(),
            ..slice_of([4, 5], None, &[], 0)
        };
        let src = Computed(vec![0.5; 20]);
        let e = PackedMatrix::pack_slices(&src, &[&a, &b], WeightOrder::OutIn, false).unwrap_err();
        assert!(e.to_string().contains("takes 5 inputs but `a`"), "{e}");
        assert!(PackedMatrix::pack_slices(&src, &[], WeightOrder::OutIn, false).is_err());
    }

    fn plans() -> Vec<Plan> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models");
        let mut plans = Vec::new();
        for model in [
            "tiny-gpt2.ron",
            "tiny-llama.ron",
            "tiny-neox.ron",
            "tiny-qwen2.ron",
            "tiny-qwen3.ron",
        ] {
            let def = crate::frontend::load::load_model(&dir.join(model)).unwrap();
            for tp in [1, 2, 4] {
                plans.push(crate::pipeline::compile(&def, tp).unwrap().plan);
            }
        }
        plans
    }

    #[test]
    fn every_plan_slice_packs_the_same_from_random_weights_and_checkpoints() {
        let (mut row_split, mut col_split, mut multi) = (0, 0, 0);
        for plan in plans() {
            let random = RandomWeights::new(&plan, 11);
            // Every tensor of the plan, from the random values, in each stored dtype.
            let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
            for w in plan.ranks.iter().flat_map(|r| &r.weights) {
                if tensors.iter().all(|t| t.0 != *w.tensor) {
                    let shape: Vec<usize> = w.shape.iter().map(|&d| d as usize).collect();
                    let mut v = Vec::new();
                    random
                        .read(&w.tensor, 0, shape.iter().product(), &mut v)
                        .unwrap();
                    tensors.push((w.tensor.to_string(), shape, v));
                }
            }
            let ckpts: Vec<(PathBuf, Checkpoint)> =
                [StoredDtype::F32, StoredDtype::Bf16, StoredDtype::F16]
                    .into_iter()
                    .map(|dtype| {
                        let files: Vec<_> = tensors
                            .iter()
                            .map(|(name, shape, v)| {
                                let bits: Vec<u32> = match dtype {
                                    StoredDtype::F32 => v.iter().map(|f| f.to_bits()).collect(),
                                    StoredDtype::Bf16 => v
                                        .iter()
                                        .map(|&f| half::bf16::from_f32(f).to_bits() as u32)
                                        .collect(),
                                    StoredDtype::F16 => v
                                        .iter()
                                        .map(|&f| half::f16::from_f32(f).to_bits() as u32)
                                        .collect(),
                                    StoredDtype::F8E4m3 | StoredDtype::I8 => {
                                        unreachable!("not among the dtypes")
                                    }
                                };
                                let (st, bytes) = encode(dtype, &bits);
                                (name.clone(), st, shape.clone(), bytes)
                            })
                            .collect();
                        let dir = write_checkpoint(&files);
                        let ckpt = Checkpoint::open(&dir).unwrap();
                        ckpt.check(&plan).unwrap();
                        (dir, ckpt)
                    })
                    .collect();
            for w in plan.ranks.iter().flat_map(|r| &r.weights) {
                if w.local_shape.len() != 2 {
                    continue;
                }
                match w.dim {
                    Some(0) => row_split += 1,
                    Some(1) => col_split += 1,
                    _ => {}
                }
                multi += (w.ranges.len() > 1) as usize;
                assert_same(&random, w, &plan.model);
                for (_, ckpt) in &ckpts {
                    assert_same(ckpt, w, &plan.model);
                }
            }
            for (dir, ckpt) in ckpts {
                drop(ckpt);
                std::fs::remove_dir_all(dir).unwrap();
            }
        }
        // The plans did exercise each kind of slicing.
        assert!(
            row_split > 0 && col_split > 0 && multi > 0,
            "{row_split} {col_split} {multi}"
        );
    }

    #[test]
    fn special_values_round_like_the_f32_path() {
        // bf16 signalling NaN (quiet bit clear), quiet NaN, infinities, subnormals, -0;
        // f32 values exactly halfway between bf16 neighbours.
        let bf16: [u32; 8] = [
            0x7F81, 0xFF81, 0x7FC0, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x3F80,
        ];
        let f32: [u32; 8] = [
            0x3F80_8000,
            0x3F81_8000,
            0x7F80_0001,
            0xFF80_0000,
            0x0000_0001,
            0x7F7F_FFFF,
            0x8000_0000,
            0x3F80_7FFF,
        ];
        let w = slice_of([2, 4], None, &[], 0);
        for (dtype, values) in [
            (StoredDtype::Bf16, bf16),
            (StoredDtype::F16, bf16),
            (StoredDtype::F32, f32),
        ] {
            let (st, bytes) = encode(dtype, &values);
            let dir = write_checkpoint(&[("w".into(), st, vec![2, 4], bytes)]);
            let ckpt = Checkpoint::open(&dir).unwrap();
            assert_same(&ckpt, &w, "special values");
            drop(ckpt);
            std::fs::remove_dir_all(dir).unwrap();
        }
        // And the copied bf16 NaN really is quieted, as bf16::from_f32 does.
        let mut out = vec![];
        let (st, bytes) = encode(StoredDtype::Bf16, &bf16);
        let dir = write_checkpoint(&[("w".into(), st, vec![8], bytes)]);
        let ckpt = Checkpoint::open(&dir).unwrap();
        ckpt.read_bf16("w", 0, 3, &mut out).unwrap();
        let got: Vec<u16> = out.iter().map(|b| b.to_bits()).collect();
        assert_eq!(got, vec![0x7FC1, 0xFFC1, 0x7FC0]);
        drop(ckpt);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A directory holding an FP8 `w [rows, cols]` in scale blocks of `block` (random codes,
    /// no NaN; positive scales) and the config.json that states the blocks.
    fn fp8_checkpoint(rows: usize, cols: usize, block: [usize; 2], seed: u64) -> PathBuf {
        let codes: Vec<u32> = (0..(rows * cols) as u64)
            .map(|i| match bits_at(seed, i) as u8 {
                b if b & 0x7f == 0x7f => 0x30,
                b => b as u32,
            })
            .collect();
        let (st, bytes) = encode(StoredDtype::F8E4m3, &codes);
        let scale_shape = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        let scales: Vec<u32> = (0..(scale_shape[0] * scale_shape[1]) as u64)
            .map(|i| (1e-3 + (bits_at(!seed, i) % 1000) as f32 * 1e-4).to_bits())
            .collect();
        let (sst, sbytes) = encode(StoredDtype::F32, &scales);
        let dir = write_checkpoint(&[
            ("w".into(), st, vec![rows, cols], bytes),
            ("w_scale_inv".into(), sst, scale_shape, sbytes),
        ]);
        let config = format!(
            r#"{{"quantization_config": {{"quant_method": "fp8", "weight_block_size": [{}, {}]}}}}"#,
            block[0], block[1]
        );
        std::fs::write(dir.join("config.json"), config).unwrap();
        dir
    }

    /// A directory holding an INT8 (or FP8, `fp8`) `w [rows, cols]` with a scale per row
    /// (random codes, no NaN; positive scales), as compressed-tensors stores it, and its
    /// config.json.
    fn channel_checkpoint(rows: usize, cols: usize, seed: u64, fp8: bool) -> PathBuf {
        let codes: Vec<u32> = (0..(rows * cols) as u64)
            .map(|i| match bits_at(seed, i) {
                b if fp8 && b & 0x7f == 0x7f => 0x30,
                b => b,
            })
            .collect();
        let dtype = if fp8 {
            StoredDtype::F8E4m3
        } else {
            StoredDtype::I8
        };
        let (st, bytes) = encode(dtype, &codes);
        let scales: Vec<u32> = (0..rows as u64)
            .map(|i| (1e-3 + (bits_at(!seed, i) % 1000) as f32 * 1e-4).to_bits())
            .collect();
        let (sst, sbytes) = encode(StoredDtype::F32, &scales);
        let dir = write_checkpoint(&[
            ("w".into(), st, vec![rows, cols], bytes),
            ("w_scale".into(), sst, vec![rows, 1], sbytes),
        ]);
        let (format, kind) = if fp8 {
            ("float-quantized", "float")
        } else {
            ("int-quantized", "int")
        };
        let config = format!(
            r#"{{"quantization_config": {{"quant_method": "compressed-tensors",
            "format": "{format}", "config_groups": {{"g": {{"targets": ["Linear"],
            "weights": {{"num_bits": 8, "type": "{kind}", "symmetric": true, "strategy": "channel"}}}}}}}}}}"#
        );
        std::fs::write(dir.join("config.json"), config).unwrap();
        dir
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// An INT8 or FP8 slice with a scale per row keeps its codes whatever the cut of
        /// its inputs, and packs the dequantized values bit for bit.
        #[test]
        fn channel_scaled_slices_keep_their_codes_under_any_cut(
            w in slicing(),
            seed in any::<u64>(),
            fp8 in any::<bool>(),
        ) {
            let (rows, cols) = (w.shape[0] as usize, w.shape[1] as usize);
            let dir = channel_checkpoint(rows, cols, seed, fp8);
            let ckpt = Checkpoint::open(&dir).unwrap();
            let dense = load_slice(&ckpt, &w).unwrap();
            let packed = PackedMatrix::pack_slice(&ckpt, &w, WeightOrder::OutIn, false).unwrap();
            prop_assert!(matches!(packed.panels, Panels::Codes(_)));
            for j in 0..packed.n {
                for p in 0..packed.inputs() {
                    prop_assert_eq!(
                        packed.get(j, p).to_bits(),
                        dense.data[j * packed.inputs() + p].to_bits(),
                        "column {}, step {}", j, p
                    );
                }
            }
            drop(ckpt);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// An FP8 slice keeps its codes unless a local block of its depth would take two
        /// stored scales, and either way packs the dequantized values: codes times scales
        /// equal what `load_slice` reads, bit for bit.
        #[test]
        fn fp8_slices_keep_their_codes_where_their_blocks_stay_whole(
            w in slicing(),
            b0 in 1usize..5,
            b1 in 1usize..7,
            seed in any::<u64>(),
        ) {
            let (rows, cols) = (w.shape[0] as usize, w.shape[1] as usize);
            let dir = fp8_checkpoint(rows, cols, [b0, b1], seed);
            let ckpt = Checkpoint::open(&dir).unwrap();
            let dense = load_slice(&ckpt, &w).unwrap();
            for batch in SMALL_BATCHES.into_iter().chain([Batch::for_this_host()]) {
                let packed =
                    PackedMatrix::pack_slices_in(&ckpt, &[&w], WeightOrder::OutIn, true, batch, true)
                        .unwrap();
                let k = packed.inputs();
                if matches!(packed.panels, Panels::Codes(_)) {
                    for j in 0..packed.n {
                        for p in 0..k {
                            prop_assert_eq!(
                                packed.get(j, p).to_bits(),
                                dense.data[j * k + p].to_bits(),
                                "column {}, step {}", j, p
                            );
                        }
                    }
                } else {
                    // Only a cut depth can mix two scales in one local block.
                    prop_assert_eq!(w.dim, Some(1));
                    let old = PackedMatrix::pack(&dense, WeightOrder::OutIn, true);
                    prop_assert!(bits(&old) == bits(&packed));
                }
            }
            drop(ckpt);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// A checkpoint directory of its own for an INT4 test case.
    fn int4_dir() -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        std::env::temp_dir().join(format!(
            "tpc-pack-int4-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
    }

    fn int4_format(i: usize) -> (QuantFormat, bool) {
        [
            (QuantFormat::Int4Gptq, false),
            (QuantFormat::Int4Awq, false),
            (QuantFormat::Int4Gptq, true),
            (QuantFormat::Int4Packed { zero_points: false }, false),
            (QuantFormat::Int4Packed { zero_points: true }, true),
        ][i % 5]
    }

    /// `w` as a slice of the INT4 weight `w.weight` in groups of `group`.
    fn int4_slice(
        mut w: WeightSlice,
        format: QuantFormat,
        act_order: bool,
        group: u64,
    ) -> WeightSlice {
        w.tensor = "w.weight".into();
        w.quant = Some(crate::ir::Quantized {
            format,
            block: [1, group],
            act_order,
        });
        w
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// An INT4 slice keeps its codes when every local group of its depth reads one stored
        /// group (always for a slice cut on group boundaries, and in act order for a whole
        /// depth, its steps stored sorted by group), and either way packs the dequantized
        /// values bit for bit.
        #[test]
        fn int4_slices_keep_their_codes_where_their_groups_stay_whole(
            outs in 1usize..5,
            groups in 1usize..4,
            g in 0usize..3,
            kind in 0usize..5,
            dim in 0usize..3,
            raw in prop::collection::vec((0usize..64, 0usize..64, 0u64..3), 1..3),
            aligned in any::<bool>(),
            padding in 0usize..3,
            seed in any::<u64>(),
        ) {
            let group = [8, 16, 32][g];
            let (format, act_order) = int4_format(kind);
            let (rows, cols) = (8 * outs, group * groups);
            let dir = int4_dir();
            write_int4_checkpoint(&dir, format, act_order, [rows, cols], group, seed);
            let ckpt = Checkpoint::open(&dir).unwrap();
            let w = match dim {
                0 => slice_of([rows, cols], None, &[], 0),
                d => {
                    // Ranges (and their padding) of inputs in whole groups when `aligned`.
                    let unit = if aligned && d == 2 { group } else { 1 };
                    let len = [rows, cols][d - 1] / unit;
                    let ranges: Vec<(usize, usize)> = raw
                        .iter()
                        .map(|&(a, b, _)| {
                            let offset = a % len;
                            (offset * unit, b % (len - offset + 1) * unit)
                        })
                        .collect();
                    let mut w = slice_of([rows, cols], Some(d as u32 - 1), &ranges, padding * unit);
                    for (r, &(_, _, pad)) in w.ranges.iter_mut().zip(&raw) {
                        r.pad = pad * unit as u64;
                        w.local_shape[d - 1] += pad * unit as u64;
                    }
                    w
                }
            };
            let w = int4_slice(w, format, act_order, group as u64);
            let dense = load_slice(&ckpt, &w).unwrap();
            for bf16 in [false, true] {
                let packed = PackedMatrix::pack_slice(&ckpt, &w, WeightOrder::OutIn, bf16).unwrap();
                let k = packed.inputs();
                if matches!(packed.panels, Panels::Int4(_)) {
                    for j in 0..packed.n {
                        for p in 0..k {
                            prop_assert_eq!(
                                packed.get(j, p).to_bits(),
                                dense.data[j * k + p].to_bits(),
                                "column {}, step {}", j, p
                            );
                        }
                    }
                } else {
                    // Kept unless a cut depth mixes two groups in one local block (a row
                    // split not on group boundaries, or any row split in act order, whose
                    // groups it scatters) or leaves an odd depth.
                    prop_assert!(
                        (dim == 2 && (act_order || !aligned)) || k == 0,
                        "{w:?}: not kept as codes"
                    );
                    let old = PackedMatrix::pack(&dense, WeightOrder::OutIn, bf16);
                    prop_assert!(bits(&old) == bits(&packed));
                }
            }
            drop(ckpt);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Products over INT4 codes (decode rows and prompt blocks, on every variant and team
    /// size) match an f64 product of the dequantized weight; a weight whose depth is cut
    /// inside its groups (a row split, padded) too.
    #[test]
    fn int4_code_products_match_the_dequantized_weight() {
        let (n, k, group) = (40, 320, 32);
        for kind in 0..5 {
            let (format, act_order) = int4_format(kind);
            let dir = int4_dir();
            write_int4_checkpoint(&dir, format, act_order, [n, k], group, 11);
            let whole = int4_slice(slice_of([n, k], None, &[], 0), format, act_order, 32);
            // Inputs 64..160 and 224..320, then a group of padding.
            let rows = int4_slice(
                slice_of([n, k], Some(1), &[(64, 96), (224, 96)], 32),
                format,
                act_order,
                32,
            );
            // 48 codes a column (40 padded to 48) + a scale and a zero per group per column.
            let bytes = |k: usize| 48 * k / 2 + 48 * (k / group) * 8;
            if act_order {
                // Steps stored sorted by group, with the order and its inverse (4 bytes a
                // slot and a step); the activations are permuted alike.
                let sorted = |p: &Panels| matches!(p, Panels::Int4(c) if c.order.is_some());
                code_products_match(&dir, &whole, bytes(k) + 8 * k, sorted);
                // A row split's share of each scattered group sits in a block of slots as
                // long as the largest share (rounded up to 4), the rest padding.
                let ckpt = Checkpoint::open(&dir).unwrap();
                let stored = ckpt.int4_weight("w.weight").unwrap().unwrap();
                let mut shares = std::collections::BTreeMap::new();
                for i in (64..160).chain(224..320) {
                    *shares.entry(stored.group_of()[i]).or_insert(0usize) += 1;
                }
                let block = shares.values().max().unwrap().next_multiple_of(4);
                let depth = shares.len() * block;
                let held = 48 * depth / 2 + 48 * shares.len() * 8 + (depth + 224) * 4;
                code_products_match(&dir, &rows, held, sorted);
                std::fs::remove_dir_all(&dir).unwrap();
                continue;
            }
            code_products_match(&dir, &whole, bytes(k), |p| matches!(p, Panels::Int4(_)));
            code_products_match(&dir, &rows, bytes(224), |p| matches!(p, Panels::Int4(_)));
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Products over FP8 codes (decode rows and prompt blocks, on every variant and team
    /// size) match an f64 product of the dequantized weight.
    #[test]
    fn block_and_channel_scaled_code_products_match_the_dequantized_weight() {
        let (n, k) = (40, 300);
        for (dir, scale_bytes) in [
            (fp8_checkpoint(n, k, [4, 128], 7), 48 * 3 * 4),
            (channel_checkpoint(n, k, 7, false), 48 * 4),
            (channel_checkpoint(n, k, 7, true), 48 * 4),
        ] {
            let w = slice_of([n, k], None, &[], 0);
            code_products_match(&dir, &w, 48 * k + scale_bytes, |p| {
                matches!(p, Panels::Codes(_))
            });
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// Products of `w` packed from the checkpoint in `dir` (its panels as `kept` says,
    /// `bytes` of them) against an f64 product of its dequantized values.
    fn code_products_match(
        dir: &std::path::Path,
        w: &WeightSlice,
        bytes: usize,
        kept: impl Fn(&Panels) -> bool,
    ) {
        use crate::runtime::cpu::check_operands::operands;
        let ckpt = Checkpoint::open(dir).unwrap();
        let dense = load_slice(&ckpt, w).unwrap();
        let (n, k) = (dense.shape[0], dense.shape[1]);
        for (bf16, m) in [false, true]
            .into_iter()
            .flat_map(|b| [1, 2, 3, 4, 5, 9, 40].map(|m| (b, m)))
        {
            let packed = PackedMatrix::pack_slice(&ckpt, w, WeightOrder::OutIn, bf16).unwrap();
            assert!(kept(&packed.panels), "{w:?}: panels not kept as codes");
            assert_eq!(packed.bytes(), bytes);
            let (x, _) = operands(m, n, k);
            for kernels in Isa::ALL
                .into_iter()
                .filter_map(|i| Kernels::unchecked(i).ok())
            {
                // Prompt rows on a bf16 variant: weights and activations rounded to bf16.
                let gemv = m <= kernels.gemv_max_rows(false);
                let round = bf16 && !gemv && kernels.gemm_variant(true).bf16_activations();
                let v = |f: f32| {
                    if round {
                        half::bf16::from_f32(f).to_f64()
                    } else {
                        f as f64
                    }
                };
                for threads in [1, 2] {
                    let got = packed.matmul_with(kernels, &x, &Team::new(threads));
                    for r in 0..m {
                        for j in 0..n {
                            let (mut want, mut mag) = (0f64, 0f64);
                            for p in 0..k {
                                let t = v(x.data[r * k + p]) * v(dense.data[j * k + p]);
                                want += t;
                                mag += t.abs();
                            }
                            let a = got.data[r * n + j] as f64;
                            assert!(
                                (a - want).abs() <= 1e-5 * mag.max(1e-30),
                                "{} m={m} threads={threads} rounded={round} ({r}, {j}): {a} vs {want}",
                                kernels.isa()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_nan_code_is_refused_naming_the_tensor() {
        let dir = fp8_checkpoint(16, 8, [16, 8], 3);
        let mut bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        // The weight's data is the first tensor's; its header is followed by 16·8 codes
        // and the scales: overwrite one code.
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let first = st.tensor("w").unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize;
        assert!(first >= 8 + header);
        bytes[first + 21] = 0xff;
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let w = slice_of([16, 8], None, &[], 0);
        let e = PackedMatrix::pack_slice(&ckpt, &w, WeightOrder::OutIn, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`w`") && e.contains("NaN code 0xff") && e.contains("row 2, column 5"),
            "{e}"
        );
        drop(ckpt);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_slices_are_errors() {
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let src = Computed(values);
        // A range past the dim, a local shape the ranges do not give, a 1-D weight.
        let mut past = slice_of([3, 4], Some(0), &[(2, 1)], 0);
        past.ranges[0].len = 2;
        let mut wrong_local = slice_of([3, 4], Some(1), &[(0, 2)], 1);
        wrong_local.local_shape = vec![3, 4];
        let mut one_d = slice_of([3, 4], None, &[], 0);
        one_d.shape = vec![12];
        one_d.local_shape = vec![12];
        for w in [past, wrong_local, one_d] {
            let e = PackedMatrix::pack_slice(&src, &w, WeightOrder::OutIn, true).unwrap_err();
            assert!(matches!(e, WeightError::Slice { .. }), "{e}");
        }
    }
}
