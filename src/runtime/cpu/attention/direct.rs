//! A decode step's attention the portable way: one (query row, head) per work item,
//! reading the cache where it lies, run by run of its blocks (hosts without AVX2, head
//! dims not a whole number of vectors).

use super::softmax::{dot, exp_sum, max_of};
use super::{work_members, KvView, Layout, LANES};
use crate::runtime::cpu::team::{SyncPtr, Team};
use crate::runtime::simd::widest_simd_fn;
use crate::runtime::tensor::{pool, Tensor};

/// `q` over `k, v` as [`super::causal_attention`], for a few query rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    layout: Layout,
    scale: f32,
) -> Tensor {
    let mut out = Tensor::zeros(q.shape.clone());
    let members = work_members(team, &layout, d);
    let dst = SyncPtr::new(&mut out.data);
    let direct = Direct {
        q,
        kv,
        d,
        group: layout.group,
        kcols: layout.kcols,
        n: layout.n,
        scale,
    };
    team.run_on(members, &|member| run_direct(&direct, member, members, dst));
    out
}

/// The operands of a decode step's attention (see the module doc).
struct Direct<'a> {
    q: &'a Tensor,
    kv: &'a KvView<'a>,
    d: usize,
    group: usize,
    kcols: usize,
    n: usize,
    scale: f32,
}

widest_simd_fn!(fn run_direct(a: &Direct, member: usize, members: usize, dst: SyncPtr) => direct_items);

/// Query heads one work item takes: for a prompt, a whole group (its kv head's keys and
/// values read once for all of them), or a share of it when there are fewer groups × rows
/// than members.
fn heads_per_item(a: &Direct, rows: usize, members: usize) -> usize {
    // A decode step's few rows: one head per item measured faster (5.5 ms against 6.5 per
    // TinyLlama step at 512 positions, AVX2), a prompt's grouped (0.68 s against 0.80 for
    // 512 positions). The bits are the same either way.
    if rows <= super::DIRECT_MAX_ROWS {
        return 1;
    }
    let groups = rows * (a.q.rows_cols().1 / a.d / a.group).max(1);
    let parts = members.div_ceil(groups).clamp(1, a.group);
    a.group.div_ceil(parts)
}

/// Member `member`'s (query row, heads) items: every `members`-th, strided because causal
/// rows grow with the row, so striding balances the members. An item is some query heads
/// of one kv group: each key is read once for them, and each head's sums are its own, in
/// the order a head alone would take (its dot products, softmax, then values in position
/// order), so the bits do not depend on how heads are grouped into items.
#[inline(always)]
fn direct_items(a: &Direct, member: usize, members: usize, dst: SyncPtr) {
    let (t, qcols) = a.q.rows_cols();
    let (d, kcols) = (a.d, a.kcols);
    let heads = qcols / d;
    let per = heads_per_item(a, t, members);
    let per_group = a.group.div_ceil(per);
    let items_per_row = heads / a.group * per_group;
    let mut scores = pool::take(per * a.n);
    for w in (member..t * items_per_row).step_by(members) {
        let (i, item) = (w / items_per_row, w % items_per_row);
        // Item `sub` of kv group `kh`: up to `per` of its query heads.
        let (kh, sub) = (item / per_group, item % per_group);
        let first = kh * a.group + sub * per;
        let hs = first..(first + per).min((kh + 1) * a.group);
        let visible = a.n - t + i + 1;
        let qv = |h: usize| &a.q.data[i * qcols + h * d..][..d];
        let rows = &mut scores[..hs.len() * visible];
        for run in a.kv.runs(0..visible) {
            let keys = a.kv.key_rows(run.row, run.len);
            for (p, key) in (run.pos..run.pos + run.len).zip(keys.chunks_exact(kcols)) {
                let key = &key[kh * d..][..d];
                for (j, h) in hs.clone().enumerate() {
                    rows[j * visible + p] = dot(qv(h), key) * a.scale;
                }
            }
        }
        let mut sums = [0f32; 64];
        let mut sums_vec = Vec::new();
        let sums: &mut [f32] = if hs.len() <= 64 {
            &mut sums[..hs.len()]
        } else {
            sums_vec.resize(hs.len(), 0.0);
            &mut sums_vec
        };
        for (j, row) in rows.chunks_exact_mut(visible).enumerate() {
            sums[j] = exp_sum(row, max_of(row));
        }
        // SAFETY: item (i, heads hs) owns columns first·d .. last·d of row i < t of the
        // t × qcols `out` (zeroed, so initialised), and every item goes to exactly one member.
        let o = unsafe { dst.slice_mut(i * qcols + first * d, hs.len() * d) };
        // Output 32 columns at a time, summed over the visible keys in registers.
        for cb in 0..d.div_ceil(LANES) {
            let width = LANES.min(d - cb * LANES);
            let base = kh * d + cb * LANES;
            if width == LANES {
                // Two heads at a time: their sums stay in registers, each value row is read
                // once for both.
                let mut j = 0;
                while j < hs.len() {
                    if hs.len() - j >= 2 {
                        let sums = value_sums::<2>(a, visible, base, &rows[j * visible..]);
                        for (h, acc) in sums.iter().enumerate() {
                            o[(j + h) * d + cb * LANES..][..LANES].copy_from_slice(acc);
                        }
                        j += 2;
                    } else {
                        let [acc] = value_sums::<1>(a, visible, base, &rows[j * visible..]);
                        o[j * d + cb * LANES..][..LANES].copy_from_slice(&acc);
                        j += 1;
                    }
                }
            } else {
                for run in a.kv.runs(0..visible) {
                    let values = a.kv.value_rows(run.row, run.len);
                    for (p, vrow) in (run.pos..run.pos + run.len).zip(values.chunks_exact(kcols)) {
                        for j in 0..hs.len() {
                            let w = rows[j * visible + p];
                            let chunk = &mut o[j * d + cb * LANES..][..width];
                            for (o, &x) in chunk.iter_mut().zip(&vrow[base..]) {
                                *o += w * x;
                            }
                        }
                    }
                }
            }
        }
        for (j, &sum) in sums.iter().enumerate() {
            let inv = 1.0 / sum;
            o[j * d..(j + 1) * d].iter_mut().for_each(|x| *x *= inv);
        }
    }
    pool::give(scores);
}

/// `H` heads' value sums for `LANES` output columns from `base`: head `h`'s weights are
/// `rows[h·visible ..][..visible]`, summed over the visible positions in order.
#[inline(always)]
fn value_sums<const H: usize>(
    a: &Direct,
    visible: usize,
    base: usize,
    rows: &[f32],
) -> [[f32; LANES]; H] {
    let mut acc = [[0f32; LANES]; H];
    for run in a.kv.runs(0..visible) {
        let values = a.kv.value_rows(run.row, run.len);
        for (p, vrow) in (run.pos..run.pos + run.len).zip(values.chunks_exact(a.kcols)) {
            let vals: &[f32; LANES] = vrow[base..][..LANES].try_into().expect("LANES values");
            for (h, acc) in acc.iter_mut().enumerate() {
                let w = rows[h * visible + p];
                for l in 0..LANES {
                    acc[l] += w * vals[l];
                }
            }
        }
    }
    acc
}
