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
        for run in a.kv.runs(0..visible) {
            let keys = a.kv.key_rows(run.row, run.len);
            for (s, key) in row[run.pos..run.pos + run.len]
                .iter_mut()
                .zip(keys.chunks_exact(kcols))
            {
                *s = dot(qv, &key[kh * d..][..d]) * a.scale;
            }
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
                for run in a.kv.runs(0..visible) {
                    let values = a.kv.value_rows(run.row, run.len);
                    for (&p, vrow) in row[run.pos..run.pos + run.len]
                        .iter()
                        .zip(values.chunks_exact(kcols))
                    {
                        let vals: &[f32; LANES] =
                            vrow[base..][..LANES].try_into().expect("LANES values");
                        for l in 0..LANES {
                            acc[l] += p * vals[l];
                        }
                    }
                }
                chunk.copy_from_slice(&acc);
            } else {
                for run in a.kv.runs(0..visible) {
                    let values = a.kv.value_rows(run.row, run.len);
                    for (&p, vrow) in row[run.pos..run.pos + run.len]
                        .iter()
                        .zip(values.chunks_exact(kcols))
                    {
                        for (o, &x) in chunk.iter_mut().zip(&vrow[base..]) {
                            *o += p * x;
                        }
                    }
                }
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
    pool::give(scores);
}
