//! Linear weights kept as the quantized codes their checkpoint stores (one byte a weight:
//! FP8 e4m3 or INT8) beside their scales, so that a decode step reads half the bytes of bf16
//! (products in `isa/codes.rs`).
//!
//! A code panel is `[k][NR]` bytes; its scales are `[⌈k/kblock⌉][NR]` f32, one per column
//! per block of `kblock` local steps. That needs every local block to lie within one of the
//! checkpoint's scale blocks: true when the split keeps the blocks whole (feasibility
//! checks it); where a slice's pieces meet inside a block, the weight is not packed this way
//! and is dequantized as it is read instead.

use super::super::aligned::AlignedVec;
use super::super::isa::{int8_xblock, CodeKind, Isa, Kernels, NR};
use super::{first_columns, Result};
use crate::ir::QuantFormat;
use crate::plan::WeightSlice;
use crate::runtime::weights::{BlockScales, Piece, SliceLayout, WeightSource};
use rayon::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct CodePanels {
    pub kind: CodeKind,
    pub codes: AlignedVec<u8>,
    pub scales: AlignedVec<f32>,
    /// Local steps per scale block (the last may be shorter).
    pub kblock: usize,
    /// The run computes linears in bf16: prompt products may round the weights and the
    /// activations to bf16 (the bf16 products); otherwise they stay f32.
    pub bf16: bool,
    /// The activation block of the integer decode GEMV (`isa/int8.rs`) for INT8 codes in
    /// a bf16 run (an f32 run keeps f32 activations, as INT4's does); `None` otherwise.
    xblock: Option<usize>,
}

impl CodePanels {
    pub fn new(
        kind: CodeKind,
        codes: AlignedVec<u8>,
        scales: AlignedVec<f32>,
        kblock: usize,
        bf16: bool,
    ) -> CodePanels {
        let integer = kind == CodeKind::Int8 && bf16;
        CodePanels {
            kind,
            codes,
            scales,
            kblock,
            bf16,
            xblock: integer.then(|| int8_xblock(kblock)).flatten(),
        }
    }

    /// The activation block of the integer decode GEMV where `kernels` take it for these
    /// panels: on the AVX2 GEMV, whose f32 form is bound by widening the codes. The AVX-512
    /// GEMVs keep their f32 form (measured at 1.7–1.9× bf16 decode on the AVX-512 host; the
    /// integer form was not measured there).
    pub fn integer_decode(&self, kernels: Kernels) -> Option<usize> {
        self.xblock
            .filter(|_| kernels.gemv_variant(false) == Isa::Avx2)
    }

    pub fn panel(&self, q: usize, k: usize) -> &[u8] {
        &self.codes[q * k * NR..][..k * NR]
    }

    pub fn panel_scales(&self, q: usize, k: usize) -> &[f32] {
        let len = k.div_ceil(self.kblock) * NR;
        &self.scales[q * len..][..len]
    }

    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scales.len() * 4
    }

    /// The value of output column `j`, step `p`.
    pub fn get(&self, j: usize, p: usize, k: usize) -> f32 {
        let (q, jj) = (j / NR, j % NR);
        self.kind.value(self.panel(q, k)[p * NR + jj])
            * self.panel_scales(q, k)[p / self.kblock * NR + jj]
    }
}

/// The scales of the `OutIn` weights `slices` (output columns side by side, each with its
/// `layout`) when the source stores every one as codes of one kind with scale blocks of one
/// depth: `Some((kind, kblock, scales))`, the scales in panel order as
/// [`CodePanels::scales`]. `None` when a weight is not stored so, or a local block would
/// take two stored scales.
pub(super) fn code_scales(
    src: &dyn WeightSource,
    slices: &[&WeightSlice],
    layouts: &[SliceLayout],
    n: usize,
    k: usize,
) -> Result<Option<(CodeKind, usize, AlignedVec<f32>)>> {
    let mut stored: Vec<Arc<BlockScales>> = Vec::with_capacity(slices.len());
    for w in slices {
        match src.quant_scales(&w.tensor)? {
            Some(s) => stored.push(s),
            None => return Ok(None),
        }
    }
    let (kblock, format) = (stored[0].block[1], stored[0].format);
    if kblock == 0
        || stored
            .iter()
            .any(|s| s.block[1] != kblock || s.format != format)
    {
        return Ok(None);
    }
    let kind = match format {
        QuantFormat::Fp8E4m3 => CodeKind::E4m3,
        QuantFormat::Int8 => CodeKind::Int8,
        // Dequantized as they load (no BlockScales are read for them).
        QuantFormat::Int4Gptq | QuantFormat::Int4Awq | QuantFormat::Int4Packed { .. } => {
            return Ok(None)
        }
    };
    let blocks = k.div_ceil(kblock);
    let per_panel = blocks * NR;
    let mut scales = AlignedVec::zeroed(n.div_ceil(NR) * per_panel);
    let starts = first_columns(layouts);
    let whole = scales
        .par_chunks_mut(per_panel.max(1))
        .enumerate()
        .try_fold(
            || true,
            |whole, (q, panel)| -> Result<bool> {
                if !whole {
                    return Ok(false);
                }
                for jj in 0..NR.min(n - q * NR) {
                    let j = q * NR + jj;
                    let part = starts.partition_point(|&s| s <= j) - 1;
                    let (layout, s) = (&layouts[part], &stored[part]);
                    let r = j - starts[part];
                    for b in 0..blocks {
                        let c0 = b * kblock;
                        match block_scale(layout, s, r, c0, kblock.min(k - c0))? {
                            Some(v) => panel[b * NR + jj] = v,
                            None => return Ok(false),
                        }
                    }
                }
                Ok(true)
            },
        )
        .try_reduce(|| true, |a, b| Ok(a && b))?;
    Ok(whole.then_some((kind, kblock, scales)))
}

/// The one stored scale of local row `r`'s columns `[c0, c0 + len)` (zero for padding
/// alone), `None` when they take more than one.
fn block_scale(
    layout: &SliceLayout,
    s: &BlockScales,
    r: usize,
    c0: usize,
    len: usize,
) -> Result<Option<f32>> {
    let mut index: Option<usize> = None;
    let mut one = true;
    layout.pieces(r, c0, len, |_, piece| {
        if let Piece::Stored {
            from,
            len: len @ 1..,
        } = piece
        {
            let (first, last) = (s.index_of(from), s.index_of(from + len - 1));
            one &= first == last && index.is_none_or(|i| i == first);
            index = Some(first);
        }
        Ok(())
    })?;
    Ok(one.then(|| index.map_or(0.0, |i| s.values.get(i).copied().unwrap_or(f32::NAN))))
}
