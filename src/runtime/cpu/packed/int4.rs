//! Linear weights kept as the 4-bit codes a GPTQ or AWQ checkpoint stores, two a byte,
//! beside an f32 scale and zero point per column per group, so that a decode step reads a
//! quarter of the bytes of bf16 (products in `isa/int4.rs`).
//!
//! A panel's codes are `k/4` quads of 32 bytes (`isa/int4.rs` gives the order); its scales
//! and zeros `[⌈k/kblock⌉][NR]`, `kblock` the checkpoint's group. That needs
//! every local block of `kblock` steps to read inputs of one stored group: true when the
//! split keeps the groups whole (feasibility checks it) and the groups are consecutive.
//! GPTQ's act order scatters them, so there — and where a depth or a group is not a
//! multiple of 4 — the
//! weight is not packed this way and is dequantized as it is read instead. A column's
//! padding steps inside a block of stored ones take the block's zero point as their code
//! (value 0); a block of padding alone takes scale 0.

use super::super::aligned::AlignedVec;
use super::super::isa::{int4_code, int4_slot, int4_value, Kernels, QuantizedRows, NR};
use super::{first_columns, PackedMatrix, Panels, Result};
use crate::plan::WeightSlice;
use crate::runtime::tensor::Tensor;
use crate::runtime::weights::{Int4Weight, Piece, SliceLayout, WeightSource};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Int4Panels {
    pub codes: AlignedVec<u8>,
    pub scales: AlignedVec<f32>,
    pub zeros: AlignedVec<f32>,
    /// Local steps per group (the last may be shorter).
    pub kblock: usize,
    /// Steps per block of the decode rows' i16 quantization: the largest multiple of 4 up
    /// to 256 that divides `kblock` (so that a block's i32 sums cannot overflow).
    pub xblock: usize,
    /// The stored order of the local steps where it is not theirs (GPTQ act order).
    pub order: Option<StepOrder>,
    /// The run computes linears in bf16: prompt products may round the weights and the
    /// activations to bf16 (the bf16 products); otherwise they stay f32.
    pub bf16: bool,
}

impl Int4Panels {
    pub fn panel(&self, q: usize, k: usize) -> &[u8] {
        &self.codes[q * k / 2 * NR..][..k / 2 * NR]
    }

    fn grid_len(&self, k: usize) -> usize {
        k.div_ceil(self.kblock) * NR
    }

    pub fn panel_scales(&self, q: usize, k: usize) -> &[f32] {
        let len = self.grid_len(k);
        &self.scales[q * len..][..len]
    }

    pub fn panel_zeros(&self, q: usize, k: usize) -> &[f32] {
        let len = self.grid_len(k);
        &self.zeros[q * len..][..len]
    }

    /// Steps `[p0, p0 + kc)` of panel `q` as f32 `[kc][NR]` values into `dst`.
    pub fn widen(
        &self,
        kernels: Kernels,
        q: usize,
        k: usize,
        p0: usize,
        kc: usize,
        dst: &mut [f32],
    ) {
        let (codes, scales, zeros) = (
            self.panel(q, k),
            self.panel_scales(q, k),
            self.panel_zeros(q, k),
        );
        kernels.widen_int4(codes, scales, zeros, self.kblock, p0, kc, dst);
    }

    pub fn bytes(&self) -> usize {
        let order = self
            .order
            .as_ref()
            .map_or(0, |o| (o.stored.len() + o.position.len()) * 4);
        self.codes.len() + (self.scales.len() + self.zeros.len()) * 4 + order
    }

    /// The value of output column `j`, step `p`.
    pub fn get(&self, j: usize, p: usize, k: usize) -> f32 {
        let (q, jj) = (j / NR, j % NR);
        let p = match &self.order {
            None => p,
            // A padding step is not stored: a zero weight.
            Some(o) if o.position[p] == u32::MAX => return 0.0,
            Some(o) => o.position[p] as usize,
        };
        let b = p / self.kblock * NR + jj;
        int4_value(
            int4_code(self.panel(q, k), p, jj),
            self.panel_zeros(q, k)[b],
            self.panel_scales(q, k)[b],
        )
    }

    /// `m` decode rows of `x` quantized for the GEMV of `kernels` (split into bytes where
    /// it reads them so).
    pub fn quantize_rows(
        &self,
        x: &[f32],
        m: usize,
        k: usize,
        rows: &mut QuantizedRows,
        kernels: Kernels,
    ) {
        rows.quantize(x, m, k, self.xblock);
        if kernels.int4_reads_split() {
            rows.split_into_bytes();
        }
    }
}

/// The `OutIn` weights `slices` (output columns side by side, each with its `layout`) as
/// INT4 panels when the source stores every one as INT4 codes and every local block of
/// the checkpoint's group size reads one stored group, or (`sort_steps`) its steps can be
/// stored sorted by group; `None` otherwise (the caller packs the values).
pub(super) fn int4_panels(
    src: &dyn WeightSource,
    slices: &[&WeightSlice],
    layouts: &[SliceLayout],
    n: usize,
    k: usize,
    bf16: bool,
    sort_steps: bool,
) -> Result<Option<Int4Panels>> {
    let mut stored: Vec<Arc<Int4Weight>> = Vec::with_capacity(slices.len());
    for w in slices {
        match src.int4_weight(&w.tensor)? {
            Some(s) => stored.push(s),
            None => return Ok(None),
        }
    }
    let group = match slices[0].quant.map(|q| q.block[1]) {
        Some(0) => k as u64,
        Some(g) => g,
        None => return Ok(None),
    };
    let Ok(kblock) = usize::try_from(group) else {
        return Ok(None);
    };
    // (Steps and slots are u32: a depth of 2k slots must fit.)
    if k == 0
        || !k.is_multiple_of(4)
        || k > (u32::MAX / 2) as usize
        || kblock == 0
        || !kblock.is_multiple_of(4)
        || slices
            .iter()
            .any(|w| w.quant.map(|q| q.block[1]) != slices[0].quant.map(|q| q.block[1]))
    {
        return Ok(None);
    }
    let starts = first_columns(layouts);
    // Where the local groups are not consecutive (GPTQ's act order scatters a group's
    // inputs; a split may cut groups), the steps are stored sorted by group, a block of
    // slots a group, in one order for every column (the activations are taken in it): every
    // part must have its groups alike (as GPTQ gives the linears that read one input).
    // (A part's columns share its inputs: the first that is not all padding gives them.)
    let mut part_groups = Vec::with_capacity(slices.len());
    for (part, layout) in layouts.iter().enumerate() {
        let columns = starts.get(part + 1).copied().unwrap_or(n) - starts[part];
        let mut groups = vec![None; k];
        for column in 0..columns {
            groups = local_groups(layout, column, k, &stored[part])?;
            if groups.iter().any(Option::is_some) {
                break;
            }
        }
        if groups.iter().any(Option::is_some) {
            part_groups.push(groups);
        }
    }
    let first = part_groups.first();
    let layout = first.map_or(StepLayout::Own, |g| step_layout(g, kblock));
    let (order, kblock, depth) = match layout {
        StepLayout::Own => (None, kblock, k),
        StepLayout::Sorted { stored, block } => {
            if !sort_steps || part_groups.iter().any(|g| Some(g) != first) {
                return Ok(None);
            }
            let depth = stored.len();
            (Some(stored), block, depth)
        }
        StepLayout::Unkept => return Ok(None),
    };
    // The local step stored at slot `s` (`None`: padding).
    let stored_step = |s: usize| match &order {
        None => Some(s),
        Some(o) => (o[s] != u32::MAX).then_some(o[s] as usize),
    };
    let blocks = depth.div_ceil(kblock);
    let panels = n.div_ceil(NR);
    let mut panel_codes = AlignedVec::zeroed(panels * depth / 2 * NR);
    let mut scales = AlignedVec::zeroed(panels * blocks * NR);
    let mut zeros = AlignedVec::zeroed(panels * blocks * NR);
    let cut = AtomicBool::new(false);
    panel_codes
        .par_chunks_mut(depth / 2 * NR)
        .zip(scales.par_chunks_mut(blocks * NR))
        .zip(zeros.par_chunks_mut(blocks * NR))
        .enumerate()
        .try_for_each(|(q, ((codes, scales), zeros))| -> Result<()> {
            let mut column = vec![0u8; k];
            // Each local step's stored group (`None`: padding).
            let mut step_groups: Vec<Option<u32>> = vec![None; k];
            // Each block's stored group (`None`: padding alone so far).
            let mut group_of_block: Vec<Option<u32>> = vec![None; blocks];
            for jj in 0..NR.min(n - q * NR) {
                if cut.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let j = q * NR + jj;
                let part = starts.partition_point(|&s| s <= j) - 1;
                let (w, layout, s) = (slices[part], &layouts[part], &stored[part]);
                let inp = s.shape()[1].max(1);
                group_of_block.fill(None);
                step_groups.fill(None);
                let mut row = None;
                layout.pieces(j - starts[part], 0, k, |at, piece| {
                    if let Piece::Stored { from, len } = piece {
                        src.read_int4_codes(&w.tensor, from, &mut column[at..at + len])?;
                        row = Some(from / inp);
                        let groups = &s.group_of()[from % inp..][..len];
                        for (g, &stored) in step_groups[at..at + len].iter_mut().zip(groups) {
                            *g = Some(stored);
                        }
                    }
                    Ok(())
                })?;
                for (at, b) in (0..depth).map(|at| (at, at / kblock)) {
                    if let Some(g) = stored_step(at).and_then(|p| step_groups[p]) {
                        let block = &mut group_of_block[b];
                        if block.is_some_and(|b| b != g) {
                            cut.store(true, Ordering::Relaxed);
                        }
                        *block = Some(g);
                    }
                }
                for (b, g) in group_of_block.iter().enumerate() {
                    let (scale, zero) = match (g, row) {
                        (Some(g), Some(o)) => s.scale_zero(*g as usize, o),
                        _ => (0.0, 0),
                    };
                    scales[b * NR + jj] = scale;
                    zeros[b * NR + jj] = f32::from(zero);
                }
                for at in 0..depth {
                    // Padding reads as its block's zero point: a value of 0. (GPTQ's zeros
                    // run 1..=16: a 16 has no code, so that weight is not kept.)
                    let c = match stored_step(at).filter(|&p| step_groups[p].is_some()) {
                        Some(p) => column[p],
                        None => {
                            let zero = zeros[at / kblock * NR + jj];
                            if zero > 15.0 {
                                cut.store(true, Ordering::Relaxed);
                            }
                            zero as u8
                        }
                    };
                    let (byte, shift) = int4_slot(at, jj);
                    codes[byte] |= c << shift;
                }
            }
            Ok(())
        })?;
    if cut.load(Ordering::Relaxed) {
        return Ok(None);
    }
    Ok(Some(Int4Panels {
        codes: panel_codes,
        scales,
        zeros,
        kblock,
        xblock: xblock_for(kblock),
        order: order.map(|o| StepOrder::new(o, k)),
        bf16,
    }))
}

/// Each local step's stored group in column `column` of a slice (`None`: padding).
fn local_groups(
    layout: &SliceLayout,
    column: usize,
    k: usize,
    s: &Int4Weight,
) -> Result<Vec<Option<u32>>> {
    let inp = s.shape()[1].max(1);
    let mut groups = vec![None; k];
    layout.pieces(column, 0, k, |at, piece| {
        if let Piece::Stored { from, len } = piece {
            let stored = &s.group_of()[from % inp..][..len];
            for (g, &stored) in groups[at..at + len].iter_mut().zip(stored) {
                *g = Some(stored);
            }
        }
        Ok(())
    })?;
    Ok(groups)
}

/// How a weight's local steps are stored, given each one's group (`None`: padding).
enum StepLayout {
    /// In their own order: every block of the checkpoint's group size reads one group.
    Own,
    /// Sorted by group, each group's steps at the start of a `block` of slots of its own
    /// (`block` the most steps a group has here, rounded up to 4), the rest padding:
    /// `stored[s]` is the step at slot `s` (`u32::MAX`: padding; the local padding steps,
    /// zero weights, are left out).
    Sorted { stored: Vec<u32>, block: usize },
    /// Sorted, it would more than double the depth: the values are packed instead.
    Unkept,
}

fn step_layout(groups: &[Option<u32>], kblock: usize) -> StepLayout {
    let consecutive = groups.chunks(kblock).all(|block| {
        let mut stored = block.iter().flatten();
        stored.next().is_none_or(|first| stored.all(|g| g == first))
    });
    if consecutive {
        return StepLayout::Own;
    }
    let mut steps: Vec<(u32, u32)> = (0u32..)
        .zip(groups)
        .filter_map(|(p, g)| g.map(|g| (g, p)))
        .collect();
    steps.sort_unstable();
    let runs = || steps.chunk_by(|a, b| a.0 == b.0);
    let block = runs()
        .map(<[_]>::len)
        .max()
        .unwrap_or(0)
        .next_multiple_of(4)
        .max(4);
    let depth = runs().count() * block;
    if depth > 2 * groups.len() {
        return StepLayout::Unkept;
    }
    let mut stored = vec![u32::MAX; depth];
    for (slots, run) in stored.chunks_exact_mut(block).zip(runs()) {
        for (slot, &(_, p)) in slots.iter_mut().zip(run) {
            *slot = p;
        }
    }
    StepLayout::Sorted { stored, block }
}

/// Where an INT4 weight stores its local steps when not in their own order
/// ([`StepLayout::Sorted`]).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StepOrder {
    /// The local step at each slot (`u32::MAX`: padding).
    pub stored: Vec<u32>,
    /// The slot of each local step (`u32::MAX`: a padding step, not stored).
    pub position: Vec<u32>,
}

impl StepOrder {
    fn new(stored: Vec<u32>, inputs: usize) -> StepOrder {
        let mut position = vec![u32::MAX; inputs];
        for (at, &p) in (0u32..).zip(&stored) {
            if p != u32::MAX {
                position[p as usize] = at;
            }
        }
        StepOrder { stored, position }
    }

    /// `x`'s rows (one per local step each) as rows of slots: each slot takes its step's
    /// activation, a padding slot 0. In a pooled buffer (a decode step asks every product).
    pub fn permute(&self, x: &Tensor) -> Tensor {
        let (inputs, depth) = (self.position.len(), self.stored.len());
        let mut data = crate::runtime::tensor::pool::empty(x.data.len() / inputs.max(1) * depth);
        for row in x.data.chunks_exact(inputs) {
            data.extend(
                self.stored
                    .iter()
                    .map(|&p| row.get(p as usize).copied().unwrap_or(0.0)),
            );
        }
        let mut shape = x.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = depth;
        }
        Tensor::new(shape, data)
    }
}

/// The decode rows' quantization block for groups of `kblock` steps (a multiple of 4): the
/// largest multiple of 4 up to 256 that divides it.
fn xblock_for(kblock: usize) -> usize {
    (4..=256.min(kblock))
        .rev()
        .step_by(4)
        .find(|d| kblock.is_multiple_of(*d))
        .unwrap_or(4)
}

impl PackedMatrix {
    /// A weight of INT4 codes `[n][k]` (row-major, each 0–15) with scales and zero points
    /// `[n][⌈k/kblock⌉]`, packed as a checkpoint's INT4 weight is (for the start-up
    /// self-check and tests); `k` and `kblock` multiples of 4, `bf16` as for
    /// [`PackedMatrix::pack`].
    pub(crate) fn from_int4(
        n: usize,
        k: usize,
        codes: &[u8],
        scales: &[f32],
        zeros: &[f32],
        kblock: usize,
        bf16: bool,
    ) -> PackedMatrix {
        let blocks = k.div_ceil(kblock.max(1));
        assert!(
            kblock > 0
                && kblock.is_multiple_of(4)
                && k.is_multiple_of(4)
                && codes.len() == n * k
                && codes.iter().all(|&c| c < 16)
                && scales.len() == n * blocks
                && zeros.len() == n * blocks
        );
        let panels = n.div_ceil(NR);
        let mut c = AlignedVec::zeroed(panels * k / 2 * NR);
        let mut s = AlignedVec::zeroed(panels * blocks * NR);
        let mut z = AlignedVec::zeroed(panels * blocks * NR);
        for j in 0..n {
            let (q, jj) = (j / NR, j % NR);
            for p in 0..k {
                let (at, shift) = int4_slot(p, jj);
                c[q * k / 2 * NR + at] |= codes[j * k + p] << shift;
            }
            for b in 0..blocks {
                s[(q * blocks + b) * NR + jj] = scales[j * blocks + b];
                z[(q * blocks + b) * NR + jj] = zeros[j * blocks + b];
            }
        }
        PackedMatrix {
            n,
            k,
            panels: Panels::Int4(Int4Panels {
                codes: c,
                scales: s,
                zeros: z,
                kblock,
                xblock: xblock_for(kblock),
                order: None,
                bf16,
            }),
        }
    }
}
