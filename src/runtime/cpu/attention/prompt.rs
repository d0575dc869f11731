//! A prompt's attention (more than `DIRECT_MAX_ROWS` queries): keys are first transposed to
//! `[hk][d][n]`; a work item is a block of `QB` query rows of one head, which keeps `QB` rows
//! of scores and computes them `LANES` keys at a time with `QB × LANES` sums in registers
//! (each key vector loaded once for `QB` rows), then the outputs `LANES` columns at a time
//! the same way (each value row loaded once for `QB` rows). Keys and values are read
//! through the sequence's block table, a run of consecutive pool rows at a time.

use super::softmax::{exp_sum, max_of};
use super::{work_members, KvView, Layout, LANES};
use crate::runtime::cpu::team::{SyncPtr, Team};
use crate::runtime::simd::widest_simd_fn;
use crate::runtime::tensor::{pool, Tensor};

/// Query rows per work item of a prompt: `QB × LANES` sums stay in 16 zmm registers.
const QB: usize = 8;

/// `q` over `k, v` as [`super::causal_attention`], for a prompt's many query rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    layout: Layout,
    scale: f32,
) -> Tensor {
    let Layout {
        t,
        heads,
        group,
        kcols,
        n,
    } = layout;
    let mut out = Tensor::zeros(q.shape.clone());
    let members = work_members(team, &layout, d);
    let dst = SyncPtr::new(&mut out.data);
    // Transposed keys, each row padded with zeros to whole blocks of LANES keys, pay off
    // when many queries read them; a decode step's few queries read the cache as it is.
    // One spare block per row: rows a power of two apart (n = 512 → 2 KiB) would map
    // the d rows a score block reads to the same two L1 sets and evict each other.
    let np = n.next_multiple_of(LANES) + LANES;
    let mut kt = pool::take(kcols * np);
    for run in kv.runs(0..n) {
        let keys = kv.key_rows(run.row, run.len);
        for (j, key) in (run.pos..).zip(keys.chunks_exact(kcols)) {
            for (c, &x) in key.iter().enumerate() {
                kt[c * np + j] = x;
            }
        }
    }
    let blocked = Blocked {
        q,
        kt: &kt,
        kv,
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
    out
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
    kv: &'a KvView<'a>,
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
            && crate::runtime::cpu::isa::host().avx512f;
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
            for run in self.kv.runs(0..last) {
                let values = self.kv.value_rows(run.row, run.len);
                #[cfg(target_arch = "x86_64")]
                if fast {
                    // SAFETY: AVX-512F was detected; the run's value rows hold the LANES
                    // columns c0.. of head kh (d is a multiple of LANES); scores hold QB
                    // rows of np ≥ run.pos + run.len.
                    unsafe {
                        avx512::add_weighted_values(
                            scores.as_ptr().add(run.pos),
                            np,
                            values[kh * d + c0..].as_ptr(),
                            kcols,
                            run.len,
                            &mut acc,
                        )
                    };
                    continue;
                }
                for (j, vrow) in (run.pos..).zip(values.chunks_exact(kcols)) {
                    let mut vals = [0f32; LANES];
                    vals[..cols].copy_from_slice(&vrow[kh * d + c0..][..cols]);
                    for (r, a) in acc.iter_mut().enumerate() {
                        let p = scores[r * np + j];
                        for l in 0..LANES {
                            a[l] += p * vals[l];
                        }
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

    /// `out[r][l] += Σ_{j < last} p[r·np + j] · v[j·ldv + l]` for `r < QB`, `l < LANES`
    /// (one run of a sequence's value rows).
    ///
    /// # Safety
    /// AVX-512F; `p` holds `QB` rows `np` apart of `last` values, `v` `last` rows `ldv`
    /// apart of `LANES` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn add_weighted_values(
        p: *const f32,
        np: usize,
        v: *const f32,
        ldv: usize,
        last: usize,
        out: &mut [[f32; LANES]; QB],
    ) {
        let mut acc: [[__m512; 2]; QB] = std::array::from_fn(|r| {
            [
                _mm512_loadu_ps(out[r].as_ptr()),
                _mm512_loadu_ps(out[r].as_ptr().add(16)),
            ]
        });
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
