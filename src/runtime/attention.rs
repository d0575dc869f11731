//! Causal attention of a block of queries over a KV cache, spread over the rank's team.
//!
//! A prompt (more than `DIRECT_MAX_ROWS` queries): keys are first transposed to
//! `[hk][d][n]`; a work item is a block of `QB` query rows of one head, which keeps `QB` rows
//! of scores and computes them `LANES` keys at a time with `QB × LANES` sums in registers
//! (each key vector loaded once for `QB` rows), then the outputs `LANES` columns at a time
//! the same way (each value row loaded once for `QB` rows). A decode step (a few queries):
//! on AVX-512 or AVX2 with head dims a whole number of vectors, [`super::attention_decode`];
//! otherwise one (query row, head) per item, reading the cache as it is.

use super::fastmath::exp;
use super::simd::widest_simd_fn;
use super::team::{SyncPtr, Team};
use super::tensor::{pool, Tensor};

/// Keys or output columns summed in registers at once (four 8-wide vectors).
const LANES: usize = 32;
/// Query rows up to which keys are read in place rather than transposed first.
pub(crate) const DIRECT_MAX_ROWS: usize = 4;
/// Query rows per work item of a prompt: `QB × LANES` sums stay in 16 zmm registers.
const QB: usize = 8;

/// The largest value, over 16 running maxima so that it vectorises (one running maximum,
/// or `f32::max` with its NaN rule, stays a scalar chain: seen in a profile).
#[inline(always)]
pub(crate) fn max_of(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    rest.iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// `x[i] = e^(x[i] - max)`, returning their sum over 16 partial sums (see [`max_of`]).
#[inline(always)]
pub(crate) fn exp_sum(x: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for l in 0..16 {
            c[l] = exp(c[l] - max);
            acc[l] += c[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for v in chunks.into_remainder() {
        *v = exp(*v - max);
        s += *v;
    }
    s
}

/// Dot product with sixteen partial sums, one zmm (or two ymm) of lanes, so that it
/// vectorises at full width. With eight sums combined pairwise the compiler built it from
/// 4-wide products and shuffles (seen in `perf annotate` of a decode step at 512 cached keys).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// The head layout of an attention call, checked: the fast paths index keys and values
/// without checks, so it must be exact.
pub(crate) struct Layout {
    /// Query rows.
    pub t: usize,
    /// Query heads, and query heads per key/value head.
    pub heads: usize,
    pub group: usize,
    /// Values per cached key row, and cached keys.
    pub kcols: usize,
    pub n: usize,
}

impl Layout {
    pub(crate) fn of(q: &Tensor, k: &[f32], v: &[f32], d: usize, kv_heads: usize) -> Layout {
        let (t, qcols) = q.rows_cols();
        assert!(
            d > 0 && kv_heads > 0 && qcols.is_multiple_of(d) && (qcols / d).is_multiple_of(kv_heads),
            "attention: {qcols} query columns are not whole heads of {d} in groups over {kv_heads} kv heads"
        );
        let heads = qcols / d;
        let kcols = kv_heads * d;
        assert!(
            k.len().is_multiple_of(kcols),
            "attention: {} cached key values are not whole rows of {kcols}",
            k.len()
        );
        let n = k.len() / kcols;
        assert!(
            t <= n && v.len() == k.len(),
            "attention: {t} queries over {n} cached keys"
        );
        Layout {
            t,
            heads,
            group: heads / kv_heads,
            kcols,
            n,
        }
    }
}

/// `q [t, hq·d]` over `k, v [n, hk·d]`; query row `i` sits at position `n - t + i` and sees
/// keys `0..=n - t + i`. Query head `h` reads key/value head `h / (hq / hk)`.
pub fn causal_attention(
    team: &Team,
    q: &Tensor,
    k: &[f32],
    v: &[f32],
    d: usize,
    kv_heads: usize,
    scale: f32,
) -> Tensor {
    let layout = Layout::of(q, k, v, d, kv_heads);
    let Layout {
        t,
        heads,
        group,
        kcols,
        n,
    } = layout;
    #[cfg(target_arch = "x86_64")]
    if let Some(width) = super::attention_decode::Width::for_host(d) {
        if t <= DIRECT_MAX_ROWS {
            return super::attention_decode::causal_attention_decode(
                width, team, q, k, v, d, layout, scale,
            );
        }
    }
    let mut out = Tensor::zeros(q.shape.clone());
    let items = t * heads;
    // (Under Miri, whose tests can afford only tiny shapes, tiny work is split too.)
    let members = if items * n * d < if cfg!(miri) { 1 << 6 } else { 1 << 15 } {
        1
    } else {
        team.size()
    };
    let dst = SyncPtr::new(&mut out.data);
    // Transposed keys, each row padded with zeros to whole blocks of LANES keys, pay off
    // when many queries read them; a decode step's few queries read the cache as it is.
    if t > DIRECT_MAX_ROWS {
        // One spare block per row: rows a power of two apart (n = 512 → 2 KiB) would map
        // the d rows a score block reads to the same two L1 sets and evict each other.
        let np = n.next_multiple_of(LANES) + LANES;
        let mut kt = pool::take(kcols * np);
        for j in 0..n {
            for (c, &x) in k[j * kcols..(j + 1) * kcols].iter().enumerate() {
                kt[c * np + j] = x;
            }
        }
        let blocked = Blocked {
            q,
            kt: &kt,
            v,
            d,
            group,
            n,
            np,
            scale,
        };
        team.run_on(members, &|member| {
            run_blocked(&blocked, member, members, t, heads, dst)
        });
        pool::give(kt);
        return out;
    }
    let direct = Direct {
        q,
        k,
        v,
        d,
        group,
        kcols,
        n,
        scale,
    };
    team.run_on(members, &|member| run_direct(&direct, member, members, dst));
    out
}

/// The operands of a decode step's attention (see the module doc).
struct Direct<'a> {
    q: &'a Tensor,
    k: &'a [f32],
    v: &'a [f32],
    d: usize,
    group: usize,
    kcols: usize,
    n: usize,
    scale: f32,
}

widest_simd_fn!(fn run_direct(a: &Direct, member: usize, members: usize, dst: SyncPtr) => direct_items);

/// Member `member`'s (query row, head) items: every `members`-th, strided because causal
/// rows grow with the row, so striding balances the members.
#[inline(always)]
fn direct_items(a: &Direct, member: usize, members: usize, dst: SyncPtr) {
    let (t, qcols) = a.q.rows_cols();
    let (d, kcols) = (a.d, a.kcols);
    let heads = qcols / d;
    let mut scores = pool::take(a.n);
    for w in (member..t * heads).step_by(members) {
        let (i, h) = (w / heads, w % heads);
        let visible = a.n - t + i + 1;
        let kh = h / a.group;
        let qv = &a.q.data[i * qcols + h * d..][..d];
        let row = &mut scores[..visible];
        for (j, s) in row.iter_mut().enumerate() {
            *s = dot(qv, &a.k[j * kcols + kh * d..][..d]) * a.scale;
        }
        let sum = exp_sum(row, max_of(row));
        // SAFETY: item (i, h) owns columns h·d .. h·d + d of row i < t of the t × qcols
        // `out` (zeroed, so initialised), and every item goes to exactly one member.
        let o = unsafe { dst.slice_mut(i * qcols + h * d, d) };
        // Output 32 columns at a time, summed over the visible keys in registers.
        for (cb, chunk) in o.chunks_mut(LANES).enumerate() {
            let base = kh * d + cb * LANES;
            if chunk.len() == LANES {
                let mut acc = [0f32; LANES];
                for (j, &p) in row.iter().enumerate() {
                    let vals: &[f32; LANES] = a.v[j * kcols + base..][..LANES]
                        .try_into()
                        .expect("LANES values");
                    for l in 0..LANES {
                        acc[l] += p * vals[l];
                    }
                }
                chunk.copy_from_slice(&acc);
            } else {
                for (j, &p) in row.iter().enumerate() {
                    for (o, &x) in chunk.iter_mut().zip(&a.v[j * kcols + base..]) {
                        *o += p * x;
                    }
                }
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
    pool::give(scores);
}

widest_simd_fn!(fn run_blocked(
    b: &Blocked,
    member: usize,
    members: usize,
    t: usize,
    heads: usize,
    dst: SyncPtr,
) => blocked_items);

/// Member `member`'s items: every `members`-th block of `t` rows × `heads`.
#[inline(always)]
fn blocked_items(b: &Blocked, member: usize, members: usize, t: usize, heads: usize, dst: SyncPtr) {
    let mut scores = pool::take(QB * b.np);
    for w in (member..t.div_ceil(QB) * heads).step_by(members) {
        b.item(w / heads, w % heads, &mut scores, dst);
    }
    pool::give(scores);
}

/// The operands of a prompt's attention (see the module doc).
struct Blocked<'a> {
    q: &'a Tensor,
    /// Keys transposed, `[hk·d][np]`, zero past `n`.
    kt: &'a [f32],
    v: &'a [f32],
    d: usize,
    group: usize,
    n: usize,
    np: usize,
    scale: f32,
}

impl Blocked<'_> {
    /// Query rows `qb·QB..` of head `h`, into `dst`; `scores` holds `QB × np`.
    #[inline(always)]
    fn item(&self, qb: usize, h: usize, scores: &mut [f32], dst: SyncPtr) {
        let (t, qcols) = self.q.rows_cols();
        let (d, np) = (self.d, self.np);
        let kh = h / self.group;
        let kcols = self.kt.len() / np;
        let rows = QB.min(t - qb * QB);
        let first = qb * QB;
        // Row r sees keys 0..visible(r); the block computes up to the last row's.
        let visible = |r: usize| self.n - t + first + r + 1;
        let last = visible(rows - 1);
        let mut qv = [[0f32; QB]; 256];
        // Queries as [c][r] so one step of the sum broadcasts QB values in a row (rows past
        // the block are zero). Head dims beyond 256 take the general path below.
        let small = d <= qv.len();
        if small {
            for (c, col) in qv.iter_mut().enumerate().take(d) {
                for (r, x) in col.iter_mut().enumerate().take(rows) {
                    *x = self.q.data[(first + r) * qcols + h * d + c];
                }
            }
        }
        let fast = cfg!(target_arch = "x86_64")
            && small
            && d.is_multiple_of(LANES)
            && super::kernels::host().avx512f;
        for jb in (0..last).step_by(LANES) {
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: AVX-512F was detected; kt rows hold np ≥ jb + LANES values
                // (np is n rounded up to LANES, jb < last ≤ n), scores QB rows of np.
                unsafe {
                    avx512::scores(
                        qv.as_ptr(),
                        d,
                        self.kt.as_ptr().add(kh * d * np + jb),
                        np,
                        self.scale,
                        scores.as_mut_ptr().add(jb),
                        np,
                    )
                };
                continue;
            }
            let mut acc = [[0f32; LANES]; QB];
            for c in 0..d {
                let keys: &[f32; LANES] = self.kt[(kh * d + c) * np + jb..][..LANES]
                    .try_into()
                    .expect("LANES values");
                let qc = qv.get(c).copied().filter(|_| small).unwrap_or_else(|| {
                    std::array::from_fn(|r| {
                        if r < rows {
                            self.q.data[(first + r) * qcols + h * d + c]
                        } else {
                            0.0
                        }
                    })
                });
                for (a, &x) in acc.iter_mut().zip(&qc) {
                    for l in 0..LANES {
                        a[l] += x * keys[l];
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for l in 0..LANES {
                    scores[r * np + jb + l] = a[l] * self.scale;
                }
            }
        }
        let mut inv = [0f32; QB];
        for (r, iv) in inv.iter_mut().enumerate().take(rows) {
            let row = &mut scores[r * np..r * np + last];
            let (seen, hidden) = row.split_at_mut(visible(r));
            let sum = exp_sum(seen, max_of(seen));
            hidden.fill(0.0);
            *iv = 1.0 / sum;
        }
        for r in rows..QB {
            scores[r * np..r * np + last].fill(0.0);
        }
        for c0 in (0..d).step_by(LANES) {
            let cols = LANES.min(d - c0);
            let mut acc = [[0f32; LANES]; QB];
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: AVX-512F was detected; value rows j < last ≤ n hold the LANES
                // columns c0.. of head kh (d is a multiple of LANES); scores hold QB rows.
                unsafe {
                    avx512::weighted_values(
                        scores.as_ptr(),
                        np,
                        self.v.as_ptr().add(kh * d + c0),
                        kcols,
                        last,
                        &mut acc,
                    )
                };
            }
            for j in 0..if fast { 0 } else { last } {
                let base = j * kcols + kh * d + c0;
                let mut vals = [0f32; LANES];
                vals[..cols].copy_from_slice(&self.v[base..base + cols]);
                for (r, a) in acc.iter_mut().enumerate() {
                    let p = scores[r * np + j];
                    for l in 0..LANES {
                        a[l] += p * vals[l];
                    }
                }
            }
            for (r, a) in acc.iter().enumerate().take(rows) {
                // SAFETY: item (qb, h) owns columns h·d .. h·d + d (c0 + cols ≤ d) of rows
                // first.. first + rows ≤ t of the t × qcols `out` (zeroed, so initialised),
                // and every item goes to exactly one member.
                let o = unsafe { dst.slice_mut((first + r) * qcols + h * d + c0, cols) };
                for (o, &x) in o.iter_mut().zip(a) {
                    *o = x * inv[r];
                }
            }
        }
    }
}

/// The two block products of [`Blocked::item`] with QB × 32 sums in 16 zmm registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{LANES, QB};
    use std::arch::x86_64::*;

    /// `out[r·ldo + l] = scale · Σ_c qv[c][r] · kt[c·np + l]` for `r < QB`, `l < LANES`.
    ///
    /// # Safety
    /// AVX-512F; `qv` holds `d` rows, `kt` `d` rows `np` apart of `LANES` values, `out` `QB`
    /// rows `ldo` apart of `LANES` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores(
        qv: *const [f32; QB],
        d: usize,
        kt: *const f32,
        np: usize,
        scale: f32,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; QB];
        for c in 0..d {
            let k0 = _mm512_loadu_ps(kt.add(c * np));
            let k1 = _mm512_loadu_ps(kt.add(c * np + 16));
            let q = &*qv.add(c);
            for (a, &x) in acc.iter_mut().zip(q) {
                let x = _mm512_set1_ps(x);
                a[0] = _mm512_fmadd_ps(x, k0, a[0]);
                a[1] = _mm512_fmadd_ps(x, k1, a[1]);
            }
        }
        let s = _mm512_set1_ps(scale);
        for (r, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * ldo), _mm512_mul_ps(a[0], s));
            _mm512_storeu_ps(out.add(r * ldo + 16), _mm512_mul_ps(a[1], s));
        }
    }

    /// `out[r][l] = Σ_{j < last} p[r·np + j] · v[j·ldv + l]` for `r < QB`, `l < LANES`.
    ///
    /// # Safety
    /// AVX-512F; `p` holds `QB` rows `np` apart of `last` values, `v` `last` rows `ldv`
    /// apart of `LANES` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_values(
        p: *const f32,
        np: usize,
        v: *const f32,
        ldv: usize,
        last: usize,
        out: &mut [[f32; LANES]; QB],
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; QB];
        for j in 0..last {
            let v0 = _mm512_loadu_ps(v.add(j * ldv));
            let v1 = _mm512_loadu_ps(v.add(j * ldv + 16));
            for (r, a) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*p.add(r * np + j));
                a[0] = _mm512_fmadd_ps(x, v0, a[0]);
                a[1] = _mm512_fmadd_ps(x, v1, a[1]);
            }
        }
        for (a, o) in acc.iter().zip(out.iter_mut()) {
            _mm512_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(o.as_mut_ptr().add(16), a[1]);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Queries `[t, hq·d]` and cached keys and values `[n, hk·d]`, varied values of a few
    /// units.
    pub(crate) fn operands(
        t: usize,
        n: usize,
        d: usize,
        hq: usize,
        hk: usize,
    ) -> (Tensor, Vec<f32>, Vec<f32>) {
        let q = Tensor::new(
            vec![t, hq * d],
            (0..t * hq * d)
                .map(|i| ((i * 31 % 17) as f32 - 8.0) / 4.0)
                .collect(),
        );
        let k = (0..n * hk * d)
            .map(|i| ((i * 13 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let v = (0..n * hk * d)
            .map(|i| ((i * 7 % 19) as f32 - 9.0) / 3.0)
            .collect();
        (q, k, v)
    }

    /// Softmax attention in f64, written the obvious way.
    pub(crate) fn reference(
        q: &Tensor,
        k: &[f32],
        v: &[f32],
        d: usize,
        kv_heads: usize,
        scale: f64,
    ) -> Vec<f64> {
        let (t, qcols) = q.rows_cols();
        let heads = qcols / d;
        let kcols = kv_heads * d;
        let n = k.len() / kcols;
        let mut out = vec![0f64; t * qcols];
        for i in 0..t {
            for h in 0..heads {
                let kh = h / (heads / kv_heads);
                let visible = n - t + i + 1;
                let s: Vec<f64> = (0..visible)
                    .map(|j| {
                        (0..d)
                            .map(|c| {
                                q.data[i * qcols + h * d + c] as f64
                                    * k[j * kcols + kh * d + c] as f64
                            })
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for c in 0..d {
                    out[i * qcols + h * d + c] = (0..visible)
                        .map(|j| e[j] * v[j * kcols + kh * d + c] as f64)
                        .sum::<f64>()
                        / sum;
                }
            }
        }
        out
    }

    #[test]
    fn matches_an_f64_reference_with_grouped_heads_and_a_cache() {
        // (queries, cached keys, head dim, query heads, kv heads): prefill, decode, chunks.
        let all: &[(usize, usize, usize, usize, usize)] = &[
            (1, 1, 4, 2, 1),
            (7, 7, 16, 4, 2),
            (1, 40, 64, 8, 2),
            (3, 50, 64, 4, 2),
            // Decode over longer caches: a head dim not a multiple of LANES, one kv head.
            (1, 150, 64, 8, 2),
            (2, 200, 40, 12, 3),
            (1, 130, 64, 8, 1),
            // Decode in `attention_decode` (whose own test runs every width): groups of more
            // than 8 query heads (two value passes), a group of one, four query rows, head
            // dims 16, 32 and 128, and (with 3 members) a key range that the first query row
            // does not see; then the per-(row, head) loop, for a head dim of 12.
            (1, 70, 32, 12, 1),
            (4, 100, 16, 3, 3),
            (1, 17, 128, 20, 2),
            (2, 33, 64, 16, 1),
            (2, 60, 12, 6, 2),
            (5, 33, 12, 6, 3),
            (64, 64, 64, 4, 4),
            // Prompt blocks: partial last block over a longer cache, head dims not a
            // multiple of LANES, more than 8 rows per head.
            (20, 50, 64, 4, 2),
            (17, 17, 80, 2, 1),
            (9, 9, 8, 3, 3),
            // The smallest prompt split over members (many heads, short keys).
            (9, 9, 32, 16, 4),
        ];
        // Under Miri (thousands of times slower): a decode step on one member, then decode
        // and prompt shapes split over members (which write `out` through `SyncPtr`).
        let miri: &[(usize, usize, usize, usize, usize)] = &[
            (1, 1, 4, 2, 1),
            (3, 6, 4, 4, 2),
            (5, 5, 4, 2, 1),
            (9, 12, 4, 4, 2),
        ];
        for &(t, n, d, hq, hk) in if cfg!(miri) { miri } else { all } {
            let (q, k, v) = operands(t, n, d, hq, hk);
            let scale = 1.0 / (d as f32).sqrt();
            let want = reference(&q, &k, &v, d, hk, scale as f64);
            for members in [1, 2, 3] {
                let got = causal_attention(&Team::new(members), &q, &k, &v, d, hk, scale);
                for (a, b) in got.data.iter().zip(&want) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()),
                        "t={t} n={n} d={d}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
