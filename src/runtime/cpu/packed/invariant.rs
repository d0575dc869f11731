//! The packed linear in the invariant order (`--numerics invariant`): an output's bits do
//! not depend on how many rows ran with it, on the team's size, or (with exact blocks) on
//! how the depth was split over ranks.
//!
//! The depth is cut into fixed blocks from step 0. Each block's sum is one f32 chain from
//! zero, step after step, for every output: the tile kernel's order, which the one-chain
//! GEMV repeats for a few rows, so that a decode row and a prompt row give the same bits.
//! Blocks are then added in f32 in order ([`DepthOrder::Chained`]) or exactly
//! ([`DepthOrder::Exact`], `runtime::exact`): the latter for a product whose depth a valid
//! tp splits, whose ranks' sums a collective then adds in its own order.

use super::{pack_row_blocks, run_chunks, PackedMatrix, Panels, MC, NR, PACKED_ROWS};
use crate::runtime::cpu::isa::{Kernels, PanelValue, GEMV_MAX_ROWS, MR};
use crate::runtime::cpu::team::{SyncPtr, Team};
use crate::runtime::exact::{encode_limbs, from_units, to_units, DepthOrder, LIMBS};
use crate::runtime::simd::widest_simd_fn;
use crate::runtime::tensor::Tensor;

/// One GEMV call's chains: `[block of the call][row][column]`.
type BlockSums = [[[f32; NR]; GEMV_MAX_ROWS]; 8];

/// The running sum of one output over the blocks.
#[derive(Clone, Copy)]
struct Adder {
    order: DepthOrder,
    bound: f32,
}

impl Adder {
    fn new(order: DepthOrder) -> Adder {
        Adder {
            order,
            bound: order.bound(),
        }
    }

    /// `acc` after block `b` whose chains gave `sums` (f32 order: the first block's sums
    /// as they are, then `acc + s`; exact: grid units added). One loop per order, so that
    /// each vectorises.
    #[inline(always)]
    fn add(self, acc: &mut [f64], b: usize, sums: &[f32]) {
        match self.order {
            DepthOrder::Chained { .. } if b == 0 => {
                acc.iter_mut().zip(sums).for_each(|(a, &s)| *a = s as f64)
            }
            DepthOrder::Chained { .. } => acc
                .iter_mut()
                .zip(sums)
                .for_each(|(a, &s)| *a = (*a as f32 + s) as f64),
            DepthOrder::Exact { .. } => {
                let bound = self.bound;
                acc.iter_mut()
                    .zip(sums)
                    .for_each(|(a, &s)| *a += to_units(s, bound))
            }
        }
    }

    /// The output's values (1, or LIMBS) into `out`.
    #[inline(always)]
    fn write(self, acc: f64, out: &mut [f32]) {
        match self.order {
            DepthOrder::Chained { .. } => out[0] = acc as f32,
            DepthOrder::Exact { limbs: false, .. } => out[0] = from_units(acc),
            DepthOrder::Exact { limbs: true, .. } => {
                out[..LIMBS].copy_from_slice(&encode_limbs(acc))
            }
        }
    }
}

impl PackedMatrix {
    /// `x [.., k] · Wᵀ` → `[.., n · order.width()]` in the invariant order (module doc).
    pub fn matmul_invariant(
        &self,
        kernels: Kernels,
        x: &Tensor,
        team: &Team,
        order: DepthOrder,
    ) -> Tensor {
        let (m, k) = x.rows_cols();
        assert_eq!(
            k, self.k,
            "linear: {k} input features against a packed weight of [{}, {}]",
            self.n, self.k
        );
        assert_eq!(
            self.inputs(),
            self.k,
            "linear: invariant products take weights packed in step order \
             (PackedMatrix::pack_slices_in_step_order)"
        );
        let width = order.width();
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("activations have a feature dim") = self.n * width;
        let mut out = Tensor::zeros(shape);
        if m == 0 || self.n == 0 {
            return out;
        }
        let panels = self.n.div_ceil(NR);
        let threads = if self.n * k * m.min(8) < 1 << 16 {
            1
        } else {
            team.size().min(panels)
        };
        let dst = SyncPtr::new(&mut out.data);
        let job = Job {
            w: self,
            kernels,
            x: &x.data,
            m,
            adder: Adder::new(order),
            block: order.block(),
            width,
            dst,
        };
        if m <= kernels.gemv_max_rows(self.is_bf16()) {
            run_chunks(team, threads, panels, 1, 0, &|chunk| {
                let mut scratch = vec![0f32; (job.block + 1).next_multiple_of(2) * NR];
                let mut kept = vec![[0f32; NR]; k.div_ceil(job.block) * GEMV_MAX_ROWS];
                let mut sums = [[[0f32; NR]; GEMV_MAX_ROWS]; 8];
                gemv_chunk(&job, chunk.panels, &mut scratch, &mut kept, &mut sums)
            });
        } else {
            let group = kernels.f32_tile_rows();
            let mut packed = PACKED_ROWS.take();
            pack_row_blocks(&x.data, m, k, job.block, group, &mut packed);
            run_chunks(team, threads, panels, 1, 0, &|chunk| {
                gemm_chunk(&job, &packed, chunk.panels)
            });
            PACKED_ROWS.set(packed);
        }
        out
    }
}

// The loops around the kernels (the blocks' sums added, outputs written) compiled for the
// host's widest vectors: they are a fifth of a prompt product's time in baseline SSE2.
widest_simd_fn!(fn gemv_chunk(job: &Job<'_>, panels: std::ops::Range<usize>, scratch: &mut [f32], kept: &mut [[f32; NR]], sums: &mut BlockSums) => gemv_panels);
widest_simd_fn!(fn gemm_chunk(job: &Job<'_>, a: &[f32], panels: std::ops::Range<usize>) => gemm_panels);

#[inline(always)]
fn gemv_panels(
    job: &Job<'_>,
    panels: std::ops::Range<usize>,
    scratch: &mut [f32],
    kept: &mut [[f32; NR]],
    sums: &mut BlockSums,
) {
    for q in panels {
        job.gemv_panel(q, scratch, kept, sums)
    }
}

#[inline(always)]
fn gemm_panels(job: &Job<'_>, a: &[f32], panels: std::ops::Range<usize>) {
    job.gemm_panels(a, panels)
}

/// One product's operands.
struct Job<'a> {
    w: &'a PackedMatrix,
    kernels: Kernels,
    x: &'a [f32],
    m: usize,
    adder: Adder,
    block: usize,
    width: usize,
    dst: SyncPtr<'a>,
}

impl Job<'_> {
    /// The depth blocks: (first step, steps).
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (k, b) = (self.w.k, self.block);
        (0..k).step_by(b).map(move |s| (s, b.min(k - s)))
    }

    /// Writes output `(row, column)`'s values from its running sum.
    fn write(&self, row: usize, col: usize, acc: f64) {
        let w = self.width;
        // SAFETY: row < m and col < n: the value's `width` slots lie in the m × n·width
        // output, and each (row, col) belongs to the one member that runs its panel.
        let out = unsafe { self.dst.slice_mut((row * self.w.n + col) * w, w) };
        self.adder.write(acc, out);
    }

    /// Weight panel `q`'s steps `s .. s + len` as f32 `[len][NR]`: the panel itself for f32
    /// weights, else widened into `scratch`.
    fn panel_block<'s>(
        &'s self,
        q: usize,
        s: usize,
        len: usize,
        scratch: &'s mut [f32],
    ) -> &'s [f32] {
        match &self.w.panels {
            Panels::F32(v) => {
                let start = q * f32::panel_len(self.w.k) + s * NR;
                &v[start..start + len * NR]
            }
            Panels::Bf16(v) => {
                let panel = &v[q * u16::panel_len(self.w.k)..][..u16::panel_len(self.w.k)];
                if s.is_multiple_of(2) {
                    // Whole pair rows from s (a pair past k is the panel's zero padding).
                    let pairs = len.div_ceil(2) * 2 * NR;
                    self.kernels
                        .widen_pairs(&panel[s * NR..s * NR + pairs], scratch);
                } else {
                    for p in 0..len {
                        for j in 0..NR {
                            scratch[p * NR + j] = panel[u16::slot(s + p, j)].to_f32();
                        }
                    }
                }
                &scratch[..len * NR]
            }
            Panels::Codes(c) => {
                let (codes, scales) = (c.panel(q, self.w.k), c.panel_scales(q, self.w.k));
                self.kernels
                    .widen_codes(c.kind, codes, scales, c.kblock, s, len, scratch);
                &scratch[..len * NR]
            }
            Panels::Int4(c) => {
                c.widen(self.kernels, q, self.w.k, s, len, scratch);
                &scratch[..len * NR]
            }
        }
    }

    /// Every row of panel `q`, a few rows per kernel call (decode); for one or two rows,
    /// several blocks per call (their chains interleaved, each still its own). Such a call
    /// takes blocks `s · rounds + j` for its streams `s` at round `j`, so that each stream
    /// reads one contiguous run of the panel across the rounds (as the fast GEMV's streams
    /// do: a prefetcher follows it), not a new place after every few blocks. The blocks'
    /// sums are kept and added in block order at the end.
    #[inline(always)]
    fn gemv_panel(
        &self,
        q: usize,
        scratch: &mut [f32],
        kept: &mut [[f32; NR]],
        sums: &mut BlockSums,
    ) {
        let (k, n) = (self.w.k, self.w.n);
        let cols = NR.min(n - q * NR);
        let count = k.div_ceil(self.block);
        let block = |b: usize| (b * self.block, self.block.min(k - b * self.block));
        // bf16 pair rows are read in place when every block starts on one.
        // (Quantized codes are widened a block at a time, as an odd bf16 block is.)
        let in_place = match self.w.panels {
            Panels::F32(_) => true,
            Panels::Bf16(_) => self.block.is_multiple_of(2),
            Panels::Codes(_) | Panels::Int4(_) => false,
        };
        let mut done = 0;
        while done < self.m {
            let r = (self.m - done).min(GEMV_MAX_ROWS);
            let xs = &self.x[done * k..];
            // Four streams (eight chains) for one or two rows: with eight streams one row's
            // sixteen chains spill from AVX2's registers (measured 5 % slower); two for more.
            let want = match r {
                1 => 4,
                2 => 4,
                _ => 2,
            };
            let group = |same: usize| {
                [8, 4, 2, 1]
                    .into_iter()
                    .find(|&g| g <= want && g <= same && (in_place || g == 1))
                    .unwrap_or(1)
            };
            // The blocks of the full length, dealt to the streams in contiguous runs.
            let full = (0..count).take_while(|&c| block(c).1 == self.block).count();
            let g = group(full);
            let rounds = full / g;
            // One call: blocks `ids[..g]` of `len` steps, each stream's chains into `kept`.
            let mut call = |ids: [usize; 8], g: usize, len: usize| {
                let starts_all = ids.map(|b| block(b).0);
                let starts = &starts_all[..g];
                match &self.w.panels {
                    Panels::F32(v) if in_place => {
                        let panel = &v[q * f32::panel_len(k)..][..f32::panel_len(k)];
                        block_sums(self.kernels, r, xs, k, panel, starts, len, sums);
                    }
                    Panels::Bf16(v) if in_place => {
                        let panel = &v[q * u16::panel_len(k)..][..u16::panel_len(k)];
                        block_sums(self.kernels, r, xs, k, panel, starts, len, sums);
                    }
                    _ => {
                        // An odd block of bf16 pairs: widened to f32 steps first.
                        let panel = self.panel_block(q, starts[0], len, scratch);
                        let x0 = &xs[starts[0]..];
                        block_sums(self.kernels, r, x0, k, panel, &[0], len, sums);
                    }
                }
                for (gi, sums) in sums[..g].iter().enumerate() {
                    kept[ids[gi] * GEMV_MAX_ROWS..][..r].copy_from_slice(&sums[..r]);
                }
            };
            for j in 0..rounds {
                call(
                    [0, 1, 2, 3, 4, 5, 6, 7].map(|s| s.min(g - 1) * rounds + j),
                    g,
                    self.block,
                );
            }
            // The rest (fewer than g full blocks, and a shorter last one) as they come.
            let mut b = rounds * g;
            while b < count {
                let len = block(b).1;
                let same = (b..count).take_while(|&c| block(c).1 == len).count();
                let g = group(same);
                call([0, 1, 2, 3, 4, 5, 6, 7].map(|i| b + i.min(g - 1)), g, len);
                b += g;
            }
            let mut acc = [[0f64; NR]; GEMV_MAX_ROWS];
            for b in 0..count {
                for (a, s) in acc[..r].iter_mut().zip(&kept[b * GEMV_MAX_ROWS..][..r]) {
                    self.adder.add(a, b, s);
                }
            }
            for (i, a) in acc[..r].iter().enumerate() {
                for (j, &v) in a[..cols].iter().enumerate() {
                    self.write(done + i, q * NR + j, v);
                }
            }
            done += r;
        }
    }

    /// Panels `panels` over every row: rows in blocks of `MC`, for each depth block each
    /// tile's chain into a scratch tile, added into the running sums.
    #[inline(always)]
    fn gemm_panels(&self, a: &[f32], panels: std::ops::Range<usize>) {
        let (n, m) = (self.w.n, self.m);
        let group = self.kernels.f32_tile_rows();
        let m_panels = m.div_ceil(group) * (group / MR);
        let first_col = panels.start * NR;
        let cols = (panels.end * NR).min(n) - first_col;
        let mut scratch = vec![0f32; (self.block + 1).next_multiple_of(2) * NR];
        let mut tile = vec![0f32; group * NR];
        let mut acc = vec![0f64; MC.next_multiple_of(group) * cols];
        for mb in (0..m_panels).step_by(MC / MR) {
            let mb_end = (mb + MC / MR).min(m_panels);
            let first_row = mb * MR;
            acc.fill(0.0);
            for (b, (s, len)) in self.blocks().enumerate() {
                let a_block = &a[s * m_panels * MR..(s + len) * m_panels * MR];
                for q in panels.clone() {
                    let w = self.panel_block(q, s, len, &mut scratch);
                    let qcols = NR.min(n - q * NR);
                    for mp in (mb..mb_end).step_by(group / MR) {
                        let ap = &a_block[mp * MR * len..(mp * MR + group) * len];
                        // SAFETY: `ap` holds len·group and `w` len·NR values; `tile` is
                        // group rows of NR.
                        unsafe {
                            self.kernels.tile_f32(
                                len,
                                ap.as_ptr(),
                                w.as_ptr(),
                                tile.as_mut_ptr(),
                                NR,
                                false,
                            )
                        };
                        let rows = group.min(m - mp * MR);
                        for r in 0..rows {
                            let row = mp * MR + r - first_row;
                            let sums = &tile[r * NR..r * NR + qcols];
                            let at = row * cols + q * NR - first_col;
                            self.adder.add(&mut acc[at..at + qcols], b, sums);
                        }
                    }
                }
            }
            let rows = (mb_end * MR).min(m) - first_row;
            for r in 0..rows {
                for c in 0..cols {
                    self.write(first_row + r, first_col + c, acc[r * cols + c]);
                }
            }
        }
    }
}

/// `r` (≤ GEMV_MAX_ROWS) rows of `xs` (stride `ldx`) against the blocks of `panel` that
/// start at `starts` (1, 2, 4 or 8 of them, `len` steps each): each row's chain per block into
/// `sums[block][row]`.
#[allow(clippy::too_many_arguments)]
fn block_sums<T: PanelValue>(
    kernels: Kernels,
    r: usize,
    xs: &[f32],
    ldx: usize,
    panel: &[T],
    starts: &[usize],
    len: usize,
    sums: &mut BlockSums,
) {
    fn call<const R: usize, const G: usize, T: PanelValue>(
        kernels: Kernels,
        xs: &[f32],
        ldx: usize,
        panel: &[T],
        starts: &[usize],
        len: usize,
        sums: &mut [[[f32; NR]; GEMV_MAX_ROWS]; 8],
    ) {
        let starts: [usize; G] = starts.try_into().expect("G block starts");
        let mut out = [[[0f32; NR]; R]; G];
        kernels.gemv_one_chain_blocks::<R, G, T>(xs, ldx, panel, starts, len, &mut out);
        for (s, o) in sums.iter_mut().zip(&out) {
            s[..R].copy_from_slice(o);
        }
    }
    match (r, starts.len()) {
        (1, 8) => call::<1, 8, T>(kernels, xs, ldx, panel, starts, len, sums),
        (1, 4) => call::<1, 4, T>(kernels, xs, ldx, panel, starts, len, sums),
        (1, 2) => call::<1, 2, T>(kernels, xs, ldx, panel, starts, len, sums),
        (1, _) => call::<1, 1, T>(kernels, xs, ldx, panel, starts, len, sums),
        (2, 4) => call::<2, 4, T>(kernels, xs, ldx, panel, starts, len, sums),
        (2, 2) => call::<2, 2, T>(kernels, xs, ldx, panel, starts, len, sums),
        (2, _) => call::<2, 1, T>(kernels, xs, ldx, panel, starts, len, sums),
        (3, 2) => call::<3, 2, T>(kernels, xs, ldx, panel, starts, len, sums),
        (3, _) => call::<3, 1, T>(kernels, xs, ldx, panel, starts, len, sums),
        (_, 2) => call::<4, 2, T>(kernels, xs, ldx, panel, starts, len, sums),
        _ => call::<4, 1, T>(kernels, xs, ldx, panel, starts, len, sums),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::WeightOrder;
    use crate::runtime::cpu::isa::Isa;
    use crate::runtime::exact::decode_limb_rows;

    fn noise(len: usize, salt: u64) -> Vec<f32> {
        let mut s = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }

    fn host_kernels() -> Vec<Kernels> {
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

    fn bits(t: &Tensor) -> Vec<u32> {
        t.data.iter().map(|v| v.to_bits()).collect()
    }

    /// `[n, k]` weights packed, and their depth steps `range` alone (a rank's row split).
    fn packed(
        w: &[f32],
        n: usize,
        k: usize,
        range: std::ops::Range<usize>,
        bf16: bool,
    ) -> PackedMatrix {
        let part: Vec<f32> = (0..n)
            .flat_map(|j| w[j * k + range.start..j * k + range.end].to_vec())
            .collect();
        let t = Tensor::new(vec![n, range.len()], part);
        PackedMatrix::pack(&t, WeightOrder::OutIn, bf16)
    }

    fn rows(x: &Tensor, from: usize, count: usize) -> Tensor {
        let k = x.cols();
        Tensor::new(
            vec![count, k],
            x.data[from * k..(from + count) * k].to_vec(),
        )
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_team() {
        let (n, k) = (200, 96);
        let w = noise(n * k, 1);
        let x = Tensor::new(vec![150, k], noise(150 * k, 2));
        let orders = [
            DepthOrder::Chained { block: 32 },
            DepthOrder::Chained { block: 50 },
            DepthOrder::Exact {
                block: 12,
                blocks_total: 16,
                limbs: false,
            },
            DepthOrder::Exact {
                block: 24,
                blocks_total: 4,
                limbs: true,
            },
        ];
        let mut fast_differs = false;
        for kernels in host_kernels() {
            for bf16 in [false, true] {
                let wp = packed(&w, n, k, 0..k, bf16);
                for order in orders {
                    let whole = wp.matmul_invariant(kernels, &x, &Team::new(1), order);
                    let width = n * order.width();
                    for (from, count) in [
                        (0, 1),
                        (3, 1),
                        (5, 2),
                        (7, 3),
                        (9, 4),
                        (1, 5),
                        (20, 13),
                        (0, 150),
                    ] {
                        for members in [1, 2, 3] {
                            let part = wp.matmul_invariant(
                                kernels,
                                &rows(&x, from, count),
                                &Team::new(members),
                                order,
                            );
                            assert_eq!(
                                bits(&part),
                                bits(&whole)[from * width..(from + count) * width],
                                "{kernels:?} bf16={bf16} {order:?}: rows {from}+{count} on {members}"
                            );
                        }
                    }
                    // Within f32 sums' tolerance of the plain product of f32 activations
                    // (a variant that rounds them to bf16 is further off by design).
                    let f32_kernels = if bf16 && kernels.isa().bf16_activations() {
                        Kernels::exact()
                    } else {
                        kernels
                    };
                    let plain = wp.matmul_with(f32_kernels, &x, &Team::new(1));
                    let mut values = whole.data.clone();
                    if order.width() == LIMBS {
                        values = vec![0.0; plain.data.len()];
                        decode_limb_rows(&whole.data, &mut values);
                    }
                    for (a, b) in values.iter().zip(&plain.data) {
                        assert!((a - b).abs() < 1e-4, "{order:?}: {a} vs {b}");
                    }
                    // The fast product's rows do depend on the batch (so the check can fail).
                    let alone = wp.matmul_with(f32_kernels, &rows(&x, 20, 1), &Team::new(1));
                    fast_differs |= bits(&alone) != bits(&plain)[20 * n..21 * n];
                }
            }
        }
        assert!(
            fast_differs,
            "the fast order gave the same bits alone and in a batch"
        );
    }

    #[test]
    fn exact_blocks_split_over_ranks_add_up_to_the_whole_products_bits() {
        let (n, k, block) = (33, 120, 10);
        let w = noise(n * k, 3);
        for m in [1, 3, 4, 9, 40] {
            let x = Tensor::new(vec![m, k], noise(m * k, 4 + m as u64));
            for kernels in host_kernels() {
                for bf16 in [false, true] {
                    let order = |limbs| DepthOrder::Exact {
                        block,
                        blocks_total: k / block,
                        limbs,
                    };
                    let whole = packed(&w, n, k, 0..k, bf16).matmul_invariant(
                        kernels,
                        &x,
                        &Team::new(1),
                        order(false),
                    );
                    for ranks in [2, 3, 4, 6, 12] {
                        let per = k / ranks;
                        let mut sum = vec![0f32; m * n * LIMBS];
                        // Ranks' limbs added in reverse order: any order gives the same sums.
                        for r in (0..ranks).rev() {
                            let xr: Vec<f32> = (0..m)
                                .flat_map(|i| {
                                    x.data[i * k + r * per..i * k + (r + 1) * per].to_vec()
                                })
                                .collect();
                            let part = packed(&w, n, k, r * per..(r + 1) * per, bf16)
                                .matmul_invariant(
                                    kernels,
                                    &Tensor::new(vec![m, per], xr),
                                    &Team::new(2),
                                    order(true),
                                );
                            sum.iter_mut().zip(&part.data).for_each(|(s, p)| *s += p);
                        }
                        let mut got = vec![0f32; m * n];
                        decode_limb_rows(&sum, &mut got);
                        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, bits(&whole), "m={m} bf16={bf16} {ranks} ranks");
                    }
                }
            }
        }
    }

    #[test]
    fn a_block_sum_past_the_exact_range_becomes_nan() {
        let (n, k) = (16, 8);
        let w = vec![1e6f32; n * k];
        let x = Tensor::new(vec![1, k], vec![1.0; k]);
        let wp = packed(&w, n, k, 0..k, false);
        let order = DepthOrder::Exact {
            block: 4,
            blocks_total: 1 << 20,
            limbs: false,
        };
        let y = wp.matmul_invariant(Kernels::portable(), &x, &Team::new(1), order);
        assert!(y.data.iter().all(|v| v.is_nan()));
    }
}
