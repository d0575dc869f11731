//! A decode step's attention on AVX-512 or AVX2: the few query rows of a step read the
//! whole cache once each, so the work is streaming the cache's keys and values from memory
//! (after a step's weights streamed through, the cache is in no cache level).
//!
//! The members split the cached keys, not the heads: each takes a range of whole key blocks
//! and sweeps it twice in address order, keys then values, for every query row and head;
//! [`merge`] joins the ranges' partial softmax sums (each range's largest score, its sum of
//! exponentials, its weighted values). Scores are made a block (one vector) of keys at a
//! time: for one head, a running product per key (lanes over the head dimension), folded
//! into one vector of scores by a tree of shuffles and adds instead of a horizontal sum per
//! key. Values go a vector of columns at a time, each value vector loaded once for up to
//! `HEADS` query heads of its kv head. The next block is prefetched into L2 while one is
//! summed. The block kernels are per width (`avx512.rs`: 16 keys; `avx2.rs`: 8).
//!
//! Keys and values are read where they lie in the paged pool: a score block whose keys are
//! consecutive pool rows (always so with blocks of a multiple of 16 tokens, or blocks in
//! order) is read in place; one that straddles blocks is gathered into an L1 scratch block
//! first. Values are summed run by run of consecutive rows.
//!
//! Measured on the 2-core Xeon, TinyLlama's 32 query / 4 kv heads of 64, 512 cached keys,
//! two threads, against the per-(row, head) loop of [`super::super::direct`] (compiled for
//! AVX-512): per call with every call's cache in DRAM (1000 distinct caches) 181–199 µs →
//! 93–97 (AVX2 width) and 74–80 µs (AVX-512), where plainly summing the same 1 MiB takes
//! 55–59 µs; with the cache in L2 100–109 → 54–55 and 34–36 µs. In the model, attention per
//! decode step at 512–560 cached keys: 3.4–4.2 → 2.1–2.3 and 1.9–2.1 ms.

#![cfg(target_arch = "x86_64")]

use super::{exp_sum, max_of, KvView, Layout};
use crate::runtime::cpu::team::{SyncPtr, Team};
use crate::runtime::tensor::{pool, Tensor};
use std::arch::x86_64::*;

mod avx2;
mod avx512;

/// Query heads per value pass at most: one running sum per head (with the value vector and
/// a broadcast, 10 registers).
const HEADS: usize = 8;
/// Keys per member's range are a multiple of this (the widest block).
const SPAN_STEP: usize = 16;

/// The vector width a decode step's attention runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    /// AVX2 and FMA: 8 keys per score block, 8 columns per value pass.
    Avx2,
    /// AVX-512F: 16 and 16.
    Avx512,
}

impl Width {
    /// The widest this host runs for heads of `d` values, if any.
    pub(crate) fn for_host(d: usize) -> Option<Width> {
        [Width::Avx512, Width::Avx2]
            .into_iter()
            .find(|w| w.runs_here(d))
    }

    /// Whether this host runs this width for heads of `d` values (a whole number of
    /// vectors).
    pub(crate) fn runs_here(self, d: usize) -> bool {
        let host = crate::runtime::cpu::isa::host();
        match self {
            Width::Avx2 => host.avx2_fma && d.is_multiple_of(8),
            Width::Avx512 => host.avx512f && d.is_multiple_of(16),
        }
    }
}

/// The two block products of a decode step at one vector width.
trait BlockKernels {
    /// Keys per score block (one vector of scores; at most [`SPAN_STEP`]).
    const KEYS: usize;

    /// `out[j] = q · keys[j]` for the `KEYS` key rows `ld` apart of a block.
    ///
    /// # Safety
    /// The width's instructions; `q` holds `d` values (whole vectors), `keys` `KEYS` rows
    /// `ld` apart of `d` values, `out` `KEYS` values.
    unsafe fn score_block(q: *const f32, d: usize, keys: *const f32, ld: usize, out: *mut f32);

    /// `out[g·d + c] += Σ_{j < keys} p[g·ldp + j] · v[j·ldv + c]` for `G` query heads of one
    /// kv head, a vector of columns at a time: each value vector is loaded once for all `G`.
    ///
    /// # Safety
    /// The width's instructions; `p` holds `G` rows `ldp` apart of `keys` values, `v` `keys`
    /// rows `ldv` apart of `d` values (whole vectors), `out` `G · d` values.
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_weighted_values<const G: usize>(
        p: *const f32,
        ldp: usize,
        v: *const f32,
        ldv: usize,
        keys: usize,
        d: usize,
        out: *mut f32,
    );
}

/// `q [t, hq·d]` over `k, v [n, hk·d]` (of `layout`, checked by [`Layout::of`]), as
/// [`super::causal_attention`], for a few query rows at `width`, which must run
/// here for `d`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_attention_decode(
    width: Width,
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    layout: Layout,
    scale: f32,
) -> Tensor {
    assert!(
        width.runs_here(d),
        "decode attention: {width:?} for heads of {d} on this host"
    );
    let Layout { t, heads, n, .. } = layout;
    let members = if t * heads * n * d < 1 << 15 {
        1
    } else {
        team.size()
    };
    // Each member takes a range of whole key blocks.
    let span = n.div_ceil(members).next_multiple_of(SPAN_STEP);
    // The queries scaled once for every member, so that a score block needs no multiply.
    let mut qs = pool::empty(q.data.len());
    qs.extend(q.data.iter().map(|&x| x * scale));
    let work = Work {
        qs: &qs,
        kv,
        d,
        layout,
        span,
    };
    let rows = t * heads;
    let mut sums = pool::take(members * rows * d);
    let mut stats = pool::take(members * rows * 2);
    let (sums_out, stats_out) = (SyncPtr::new(&mut sums), SyncPtr::new(&mut stats));
    team.run_on(members, &|member| {
        let keys = (member * span).min(n)..((member + 1) * span).min(n);
        let (stats, sums) = (
            // SAFETY: member `member` takes only its own rows of the partial sums and stats.
            unsafe { stats_out.span(member * rows * 2, rows * 2) },
            unsafe { sums_out.span(member * rows * d, rows * d) },
        );
        // SAFETY: the width runs here for `d` (asserted above), the layout was checked by
        // `Layout::of`, and the rows are this member's.
        unsafe {
            match width {
                Width::Avx512 => part_avx512(&work, keys, stats, sums),
                Width::Avx2 => part_avx2(&work, keys, stats, sums),
            }
        }
    });
    let mut out = Tensor::zeros(q.shape.clone());
    merge(&sums, &stats, members, d, &mut out.data);
    pool::give(qs);
    pool::give(sums);
    pool::give(stats);
    out
}

/// `out` for every (row, head) from the members' partial results over their key ranges:
/// weighted sums of values `sums [member][row·head][d]` and `stats [member][row·head]` =
/// (largest score, sum of exponentials relative to it).
fn merge(sums: &[f32], stats: &[f32], members: usize, d: usize, out: &mut [f32]) {
    let count = out.len() / d;
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let at = |m: usize| 2 * (m * count + r);
        let max = (0..members).fold(f32::NEG_INFINITY, |a, m| a.max(stats[at(m)]));
        let mut total = 0.0;
        for m in 0..members {
            // A member whose keys this row does not see has maximum -inf: weight 0.
            let w = (stats[at(m)] - max).exp();
            total += w * stats[at(m) + 1];
            for (x, &y) in o.iter_mut().zip(&sums[(m * count + r) * d..][..d]) {
                *x += w * y;
            }
        }
        let inv = 1.0 / total;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// The operands of a call (see the module doc).
struct Work<'a> {
    /// The queries `[t, hq·d]`, scaled.
    qs: &'a [f32],
    kv: &'a KvView<'a>,
    d: usize,
    layout: Layout,
    /// Keys per member (a multiple of `SPAN_STEP`).
    span: usize,
}

impl Work<'_> {
    /// Every (query row, head) over cached keys `keys`: for each, the largest score and the
    /// sum of exponentials relative to it into `stats [row·head][2]`, the weighted sum of
    /// values into `sums [row·head][d]` (zero on entry).
    ///
    /// # Safety
    /// `K`'s instructions, for `d` values per head; the layout was checked by
    /// [`Layout::of`]; `keys` lie in the cache; `stats` and `sums` hold `t · heads` rows of 2
    /// and of `d` values that no one else accesses meanwhile.
    #[inline(always)]
    unsafe fn part<K: BlockKernels>(
        &self,
        keys: std::ops::Range<usize>,
        stats: *mut f32,
        sums: *mut f32,
    ) {
        let Layout {
            t,
            heads,
            group,
            kcols,
            n,
        } = self.layout;
        let (d, span) = (self.d, self.span);
        let (start, end) = (keys.start, keys.end);
        let rows = t * heads;
        // Scores [row·head][span], and room for a block of keys that is not consecutive
        // rows of the pool (or the last, partial, block): its rows past the end hold stale
        // or zero values whose scores land past `end` and are never read.
        let mut scratch = pool::take(rows * span + K::KEYS * kcols);
        let (scores, tail) = scratch.split_at_mut(rows * span);
        let (pk, pv) = self.kv.pool();
        // Keys in one sweep, a block of `K::KEYS` rows at a time, each read by every
        // (row, head).
        for jb in (start..end).step_by(K::KEYS) {
            let count = K::KEYS.min(end - jb);
            self.prefetch(pk, jb + K::KEYS, (jb + 2 * K::KEYS).min(end));
            let in_place = if count == K::KEYS {
                self.kv.rows_at(jb, count)
            } else {
                None
            };
            let block = match in_place {
                Some(row) => pk[row * kcols..].as_ptr(),
                None => {
                    for run in self.kv.runs(jb..jb + count) {
                        let at = (run.pos - jb) * kcols;
                        tail[at..at + run.len * kcols]
                            .copy_from_slice(self.kv.key_rows(run.row, run.len));
                    }
                    tail.as_ptr()
                }
            };
            for r in 0..rows {
                let kh = r % heads / group;
                let out = scores[r * span + jb - start..].as_mut_ptr();
                K::score_block(self.qs[r * d..].as_ptr(), d, block.add(kh * d), kcols, out);
            }
        }
        // Softmax over the keys each query row sees (up to its own position).
        for r in 0..rows {
            let seen = (n - t + r / heads + 1).clamp(start, end) - start;
            let row = &mut scores[r * span..r * span + end - start];
            let (visible, hidden) = row.split_at_mut(seen);
            hidden.fill(0.0);
            let max = max_of(visible);
            // (No key seen: maximum -inf and sum 0.)
            *stats.add(2 * r) = max;
            *stats.add(2 * r + 1) = exp_sum(visible, max);
        }
        // Values in one sweep: per block, each kv head's value vectors are loaded once for
        // up to `HEADS` of its query heads, a run of consecutive pool rows at a time.
        for jb in (start..end).step_by(K::KEYS) {
            let count = K::KEYS.min(end - jb);
            self.prefetch(pv, jb + K::KEYS, (jb + 2 * K::KEYS).min(end));
            for run in self.kv.runs(jb..jb + count) {
                let rows_v = &pv[run.row * kcols..];
                let len = run.len;
                for r0 in (0..rows).step_by(group) {
                    let kh = r0 % heads / group;
                    let v = rows_v[kh * d..].as_ptr();
                    for g0 in (0..group).step_by(HEADS) {
                        let r = r0 + g0;
                        let p = scores[r * span + run.pos - start..].as_ptr();
                        let o = sums.add(r * d);
                        match HEADS.min(group - g0) {
                            1 => K::add_weighted_values::<1>(p, span, v, kcols, len, d, o),
                            2 => K::add_weighted_values::<2>(p, span, v, kcols, len, d, o),
                            3 => K::add_weighted_values::<3>(p, span, v, kcols, len, d, o),
                            4 => K::add_weighted_values::<4>(p, span, v, kcols, len, d, o),
                            5 => K::add_weighted_values::<5>(p, span, v, kcols, len, d, o),
                            6 => K::add_weighted_values::<6>(p, span, v, kcols, len, d, o),
                            7 => K::add_weighted_values::<7>(p, span, v, kcols, len, d, o),
                            _ => K::add_weighted_values::<8>(p, span, v, kcols, len, d, o),
                        }
                    }
                }
            }
        }
        pool::give(scratch);
    }
}

impl Work<'_> {
    /// Asks for positions `from..to` of `base` (the pool's keys or values) in L2: the next
    /// block's while this one is summed (after a step's weights streamed through, the cache
    /// is in no cache level; into L1, blocks ahead evicted the scores and measured slower).
    #[inline(always)]
    fn prefetch(&self, base: &[f32], from: usize, to: usize) {
        let ld = self.layout.kcols;
        for run in self.kv.runs(from..to) {
            for l in (0..run.len * ld).step_by(16) {
                // SAFETY: a prefetch only hints; the address lies in the run's rows.
                unsafe { _mm_prefetch::<_MM_HINT_T2>(base[run.row * ld + l..].as_ptr().cast()) };
            }
        }
    }
}

/// A member's part at AVX-512F (see [`Work::part`]).
///
/// # Safety
/// As [`Work::part`], with AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn part_avx512(w: &Work, keys: std::ops::Range<usize>, stats: *mut f32, sums: *mut f32) {
    w.part::<avx512::Zmm>(keys, stats, sums)
}

/// A member's part at AVX2 (see [`Work::part`]).
///
/// # Safety
/// As [`Work::part`], with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn part_avx2(w: &Work, keys: std::ops::Range<usize>, stats: *mut f32, sums: *mut f32) {
    w.part::<avx2::Ymm>(keys, stats, sums)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::attention::reference::{layouts, operands, reference, with_layout};

    /// Every width the host runs, against the f64 reference, on decode shapes: partial key
    /// blocks, more than 8 query heads per kv head (two value passes), a group of one, four
    /// query rows, head dims from 8 to 128, and key ranges that a query row does not see;
    /// each over a cache in one run and paged in blocks of 1, 3 and 16 rows out of order.
    #[test]
    fn every_width_matches_an_f64_reference() {
        // (queries, cached keys, head dim, query heads, kv heads)
        let shapes: &[(usize, usize, usize, usize, usize)] = &[
            (1, 1, 16, 2, 1),
            (1, 40, 64, 8, 2),
            (1, 150, 64, 8, 2),
            (1, 130, 64, 8, 1),
            (1, 70, 32, 12, 1),
            (4, 100, 16, 3, 3),
            (1, 17, 128, 20, 2),
            (2, 33, 64, 16, 1),
            (2, 200, 40, 12, 3),
            (3, 57, 8, 6, 2),
        ];
        let mut ran = 0;
        for width in [Width::Avx2, Width::Avx512] {
            for &(t, n, d, hq, hk) in shapes {
                if !width.runs_here(d) {
                    println!("{width:?}: not run for head dim {d} on this host");
                    continue;
                }
                let (q, k, v) = operands(t, n, d, hq, hk);
                let scale = 1.0 / (d as f32).sqrt();
                let want = reference(&q, &k, &v, d, hk, scale as f64);
                for paging in layouts() {
                    for members in [1, 2, 3] {
                        let team = Team::new(members);
                        let got = with_layout(&k, &v, hk * d, paging, |kv| {
                            let layout = Layout::of(&q, kv, d, hk);
                            causal_attention_decode(width, &team, &q, kv, d, layout, scale)
                        });
                        for (a, b) in got.data.iter().zip(&want) {
                            assert!(
                                (*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()),
                                "{width:?} t={t} n={n} d={d} hq={hq} hk={hk} {paging:?} \
                                 members={members}: {a} vs {b}"
                            );
                        }
                    }
                }
                ran += 1;
            }
        }
        println!("{ran} (width, shape) pairs run");
    }
}
