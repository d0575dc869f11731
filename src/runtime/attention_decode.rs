//! A decode step's attention on AVX-512: the few query rows of a step read the whole cache
//! once each, so the work is streaming the cache's keys and values from memory (after a
//! step's weights streamed through, the cache is in no cache level).
//!
//! The members split the cached keys, not the heads: each takes a range of whole 16-key
//! blocks and sweeps it twice in address order, keys then values, for every query row and
//! head; [`merge`] joins the ranges' partial softmax sums (each range's largest score, its
//! sum of exponentials, its weighted values). Scores are made a block at a time: for one
//! head, 16 running products (one per key, lanes over the head dimension) are folded into
//! one vector of 16 scores by a tree of shuffles and adds, instead of a horizontal sum per
//! key. Values go 16 columns at a time, each value vector loaded once for up to `HEADS`
//! query heads of its kv head. The next block is prefetched into L2 while one is summed.
//!
//! Measured on the 2-core Xeon, TinyLlama's 32 query / 4 kv heads of 64, 512 cached keys,
//! two threads, against the per-(row, head) loop of [`super::attention`]: 181 → 80 µs per
//! call with every call's cache in DRAM (1000 distinct caches), 109 → 36 µs with it in L2;
//! plainly summing the same 1 MiB takes 55–59 µs. In the model: 4.1–4.2 → 2.0–2.1 ms of
//! attention per decode step at 512–560 cached keys.

#![cfg(target_arch = "x86_64")]

use super::attention::{exp_sum, max_of, Layout};
use super::team::{SyncPtr, Team};
use super::tensor::{pool, Tensor};
use std::arch::x86_64::*;

/// Query heads per work item at most: one running sum per head in the value pass (with the
/// value vector and a broadcast, 10 of the 32 zmm registers).
const HEADS: usize = 8;
/// Keys per score block: one zmm of scores.
const KEYS: usize = 16;

/// Whether this path takes heads of `d` values on this host.
pub(crate) fn takes(d: usize) -> bool {
    d.is_multiple_of(16) && super::kernels::host().avx512f
}

/// `q [t, hq·d]` over `k, v [n, hk·d]`, as [`super::attention::causal_attention`], for a few
/// query rows on a host with AVX-512F and `d` a multiple of 16 (see [`takes`]).
pub(crate) fn causal_attention_decode(
    team: &Team,
    q: &Tensor,
    k: &[f32],
    v: &[f32],
    d: usize,
    kv_heads: usize,
    scale: f32,
) -> Tensor {
    assert!(takes(d), "decode attention: heads of {d} on this host");
    let layout = Layout::of(q, k, v, d, kv_heads);
    let Layout { t, heads, n, .. } = layout;
    let members = if t * heads * n * d < 1 << 15 {
        1
    } else {
        team.size()
    };
    // Each member takes a range of whole key blocks.
    let span = n.div_ceil(members).next_multiple_of(KEYS);
    let work = Work {
        q,
        k,
        v,
        d,
        scale,
        layout,
        span,
    };
    let rows = t * heads;
    let mut sums = pool::take(members * rows * d);
    let mut stats = pool::take(members * rows * 2);
    let (sums_out, stats_out) = (SyncPtr::new(&mut sums), SyncPtr::new(&mut stats));
    team.run_on(members, &|member| {
        let keys = (member * span).min(n)..((member + 1) * span).min(n);
        // SAFETY: AVX-512F was checked by `takes`, the layout by `Layout::of`; member
        // `member` writes only its own rows of the partial sums and stats.
        unsafe {
            work.part(
                keys,
                stats_out.span(member * rows * 2, rows * 2),
                sums_out.span(member * rows * d, rows * d),
            )
        };
    });
    let mut out = Tensor::zeros(q.shape.clone());
    merge(&sums, &stats, members, d, &mut out.data);
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
            // A member whose keys this row does not see has no sum (its maximum is -inf).
            if stats[at(m) + 1] == 0.0 {
                continue;
            }
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
    q: &'a Tensor,
    k: &'a [f32],
    v: &'a [f32],
    d: usize,
    scale: f32,
    layout: Layout,
    /// Keys per member (a multiple of `KEYS`).
    span: usize,
}

impl Work<'_> {
    /// Every (query row, head) over cached keys `keys`: for each, the largest score and the
    /// sum of exponentials relative to it into `stats [row·head][2]`, the weighted sum of
    /// values into `sums [row·head][d]` (zero on entry).
    ///
    /// # Safety
    /// AVX-512F; the layout was checked by [`Layout::of`] and `d` by [`takes`]; `keys` lie
    /// in the cache; `stats` and `sums` hold `t · heads` rows of 2 and of `d` values that
    /// no one else accesses meanwhile.
    #[target_feature(enable = "avx512f")]
    unsafe fn part(&self, keys: std::ops::Range<usize>, stats: *mut f32, sums: *mut f32) {
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
        // Scores [row·head][span], the queries scaled (so that a score block needs no
        // multiply) [row·head][d], and room for a last partial block of keys: its rows past the end hold
        // stale or zero values whose scores land past `end` and are never read.
        let mut scratch = pool::take(rows * span + rows * d + KEYS * kcols);
        let (scores, rest) = scratch.split_at_mut(rows * span);
        let (qs, tail) = rest.split_at_mut(rows * d);
        for (x, &y) in qs.iter_mut().zip(&self.q.data) {
            *x = y * self.scale;
        }
        // Keys in one sweep, 16 rows at a time, each block read by every (row, head).
        for jb in (start..end).step_by(KEYS) {
            prefetch_rows(self.k.as_ptr(), kcols, jb + KEYS, (jb + 2 * KEYS).min(end));
            let (block, ld) = if jb + KEYS <= end {
                (self.k[jb * kcols..].as_ptr(), kcols)
            } else {
                tail[..(end - jb) * kcols].copy_from_slice(&self.k[jb * kcols..end * kcols]);
                (tail.as_ptr(), kcols)
            };
            for r in 0..rows {
                let kh = r % heads / group;
                let out = scores[r * span + jb - start..].as_mut_ptr();
                score_block(qs[r * d..].as_ptr(), d, block.add(kh * d), ld, out);
            }
        }
        // Softmax over the keys each query row sees (up to its own position).
        for r in 0..rows {
            let seen = (n - t + r / heads + 1).clamp(start, end) - start;
            let row = &mut scores[r * span..r * span + end - start];
            let (visible, hidden) = row.split_at_mut(seen);
            hidden.fill(0.0);
            let max = max_of(visible);
            *stats.add(2 * r) = max;
            *stats.add(2 * r + 1) = if seen == 0 {
                0.0
            } else {
                exp_sum(visible, max)
            };
        }
        // Values in one sweep: per block, each kv head's value vectors are loaded once for
        // up to `HEADS` of its query heads.
        for jb in (start..end).step_by(KEYS) {
            prefetch_rows(self.v.as_ptr(), kcols, jb + KEYS, (jb + 2 * KEYS).min(end));
            let count = KEYS.min(end - jb);
            for r0 in (0..rows).step_by(group) {
                let kh = r0 % heads / group;
                let v = self.v[jb * kcols + kh * d..].as_ptr();
                for g0 in (0..group).step_by(HEADS) {
                    let r = r0 + g0;
                    let p = scores[r * span + jb - start..].as_ptr();
                    let o = sums.add(r * d);
                    match HEADS.min(group - g0) {
                        1 => add_weighted_values::<1>(p, span, v, kcols, count, d, o),
                        2 => add_weighted_values::<2>(p, span, v, kcols, count, d, o),
                        3 => add_weighted_values::<3>(p, span, v, kcols, count, d, o),
                        4 => add_weighted_values::<4>(p, span, v, kcols, count, d, o),
                        5 => add_weighted_values::<5>(p, span, v, kcols, count, d, o),
                        6 => add_weighted_values::<6>(p, span, v, kcols, count, d, o),
                        7 => add_weighted_values::<7>(p, span, v, kcols, count, d, o),
                        _ => add_weighted_values::<8>(p, span, v, kcols, count, d, o),
                    }
                }
            }
        }
        pool::give(scratch);
    }
}

/// Asks for rows `from..to` of `ld` values in L2: the next block's while this one is
/// summed (after a step's weights streamed through, the cache is in no cache level; into
/// L1, blocks ahead evicted the scores and measured slower).
#[inline(always)]
unsafe fn prefetch_rows(base: *const f32, ld: usize, from: usize, to: usize) {
    for j in from..to {
        for l in (0..ld).step_by(16) {
            _mm_prefetch::<_MM_HINT_T2>(base.add(j * ld + l).cast());
        }
    }
}

/// The register that key `j` of a block sums into, so that [`fold_16`]'s 4 × 4 transpose
/// leaves key `j`'s score in lane `j`.
const fn slot(j: usize) -> usize {
    4 * (j % 4) + j / 4
}

/// `out[j] = q · keys[j]` for the 16 key rows `ld` apart of a block.
///
/// # Safety
/// AVX-512F; `q` holds `d` values (a multiple of 16), `keys` 16 rows `ld` apart of `d`
/// values, `out` 16 values.
#[target_feature(enable = "avx512f")]
unsafe fn score_block(q: *const f32, d: usize, keys: *const f32, ld: usize, out: *mut f32) {
    let mut acc = [_mm512_setzero_ps(); KEYS];
    for c in (0..d).step_by(16) {
        let qv = _mm512_loadu_ps(q.add(c));
        for j in 0..KEYS {
            let kv = _mm512_loadu_ps(keys.add(j * ld + c));
            acc[slot(j)] = _mm512_fmadd_ps(qv, kv, acc[slot(j)]);
        }
    }
    _mm512_storeu_ps(out, fold_16(acc));
}

/// The 16 lane sums of `a`: lane `4r + m` of the result is the sum of `a[4m + r]` (a 4 × 4
/// transpose of the order, undone by [`slot`]). Four levels of shuffles and adds, 15 pairs
/// in all, where 16 horizontal sums take 64 shuffles.
#[inline(always)]
unsafe fn fold_16(a: [__m512; 16]) -> __m512 {
    // Quarters 0-1 hold a[2k]'s sum, quarters 2-3 a[2k + 1]'s.
    let s: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    });
    // Quarter r holds a[4m + r]'s sum.
    let u: [__m512; 4] = std::array::from_fn(|m| {
        let (x, y) = (s[2 * m], s[2 * m + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    });
    // Per quarter: lanes 0 and 2 hold u[2p]'s, lanes 1 and 3 u[2p + 1]'s.
    let w: [__m512; 2] = std::array::from_fn(|p| {
        let (x, y) = (u[2 * p], u[2 * p + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    let (x, y) = (_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
    _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
    )
}

/// `out[g·d + c] += Σ_{j < keys} p[g·ldp + j] · v[j·ldv + c]` for `G` query heads of one kv
/// head, 16 columns at a time: each value vector is loaded once for all `G` heads.
///
/// # Safety
/// AVX-512F; `p` holds `G` rows `ldp` apart of `keys` values, `v` `keys` rows `ldv` apart
/// of `d` values (a multiple of 16), `out` `G · d` values.
#[target_feature(enable = "avx512f")]
unsafe fn add_weighted_values<const G: usize>(
    p: *const f32,
    ldp: usize,
    v: *const f32,
    ldv: usize,
    keys: usize,
    d: usize,
    out: *mut f32,
) {
    for c in (0..d).step_by(16) {
        let mut acc = [_mm512_setzero_ps(); G];
        for j in 0..keys {
            let x = _mm512_loadu_ps(v.add(j * ldv + c));
            for (g, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(g * ldp + j)), x, *a);
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let o = out.add(g * d + c);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *a));
        }
    }
}
