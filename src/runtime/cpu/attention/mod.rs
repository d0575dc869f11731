//! Causal attention of a block of queries over a KV cache, spread over the rank's team.
//! [`causal_attention`] picks the way: a prompt (more than [`DIRECT_MAX_ROWS`] queries) in
//! [`prompt`] (transposed keys, blocks of query rows); a decode step on AVX-512 or AVX2 with
//! head dims a whole number of vectors in [`decode`]; otherwise [`direct`], one (query row,
//! head) per item. [`amx`] is the prompt path on AMX tiles, which the backend picks itself.

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
pub mod decode;
mod direct;
mod layout;
mod paged;
mod prompt;
#[cfg(test)]
pub(crate) mod reference;
mod softmax;

pub(crate) use layout::Layout;
pub use paged::KvView;
pub(crate) use softmax::{exp_sum, max_of};

use crate::runtime::cpu::team::Team;
use crate::runtime::tensor::Tensor;

/// Keys or output columns summed in registers at once (four 8-wide vectors).
const LANES: usize = 32;
/// Query rows up to which keys are read in place rather than transposed first.
pub(crate) const DIRECT_MAX_ROWS: usize = 4;

/// `q [t, hq·d]` over the `n` cached keys and values `[n, hk·d]` of `kv`; query row `i`
/// sits at position `n - t + i` and sees keys `0..=n - t + i`. Query head `h` reads
/// key/value head `h / (hq / hk)`.
pub fn causal_attention(
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    kv_heads: usize,
    scale: f32,
) -> Tensor {
    let layout = Layout::of(q, kv, d, kv_heads);
    if layout.t > DIRECT_MAX_ROWS {
        return prompt::attend(team, q, kv, d, layout, scale);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(width) = decode::Width::for_host(d) {
        return decode::causal_attention_decode(width, team, q, kv, d, layout, scale);
    }
    direct::attend(team, q, kv, d, layout, scale)
}

/// [`causal_attention`] in the one order every call shape shares (`--numerics
/// invariant`): each (query row, head) scores its visible keys, takes their softmax and sums
/// the values in position order, so its bits depend on its position and the cache only —
/// not on the call's other rows (a decode step, a prompt, a chunk of one) nor the team.
pub fn invariant_attention(
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    kv_heads: usize,
    scale: f32,
) -> Tensor {
    let layout = Layout::of(q, kv, d, kv_heads);
    direct::attend(team, q, kv, d, layout, scale)
}

/// Members a call is spread over: tiny work stays on one. (Under Miri, whose tests can
/// afford only tiny shapes, tiny work is split too.)
fn work_members(team: &Team, layout: &Layout, d: usize) -> usize {
    let work = layout.t * layout.heads * layout.n * d;
    if work < if cfg!(miri) { 1 << 6 } else { 1 << 15 } {
        1
    } else {
        team.size()
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{layouts, operands, reference, scattered, with_layout, Order};
    use super::*;

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
            // Decode in `decode` (whose own test runs every width): groups of more
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
            // The cache in one run, and paged: blocks of 1, 3 and 16 rows out of order.
            for layout in layouts() {
                for members in [1, 2, 3] {
                    let got = with_layout(&k, &v, hk * d, layout, |kv| {
                        causal_attention(&Team::new(members), &q, kv, d, hk, scale)
                    });
                    for (a, b) in got.data.iter().zip(&want) {
                        assert!(
                            (*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()),
                            "t={t} n={n} d={d} {layout:?} members={members}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// The invariant path: a query row's bits are the same alone or among others, and on
    /// any team (whose size decides how a prompt's kv groups are dealt into items, here also
    /// unevenly: 11 members over 5 rows of one group of 8 take 3 heads an item), and close
    /// to the f64 reference.
    #[test]
    fn invariant_attention_gives_a_row_the_same_bits_however_the_call_is_split() {
        let shapes: &[(usize, usize, usize, usize, usize)] = if cfg!(miri) {
            &[(3, 5, 4, 4, 1)]
        } else {
            &[
                (6, 40, 64, 8, 1),
                (5, 200, 64, 8, 1),
                (5, 33, 40, 12, 3),
                (4, 20, 16, 4, 4),
                (9, 9, 8, 6, 2),
            ]
        };
        for &(t, n, d, hq, hk) in shapes {
            let (q, k, v) = operands(t, n, d, hq, hk);
            let scale = 1.0 / (d as f32).sqrt();
            let want = reference(&q, &k, &v, d, hk, scale as f64);
            let qcols = hq * d;
            for layout in layouts() {
                let whole = with_layout(&k, &v, hk * d, layout, |kv| {
                    invariant_attention(&Team::new(1), &q, kv, d, hk, scale)
                });
                for (a, b) in whole.data.iter().zip(&want) {
                    assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
                }
                for members in [2, 3, 5, 11] {
                    let got = with_layout(&k, &v, hk * d, layout, |kv| {
                        invariant_attention(&Team::new(members), &q, kv, d, hk, scale)
                    });
                    assert_eq!(
                        got.data, whole.data,
                        "t={t} d={d} {layout:?} members={members}"
                    );
                }
                // The last row alone, over the same cache: its position is n - 1 either way.
                let last = Tensor::new(vec![1, qcols], q.data[(t - 1) * qcols..].to_vec());
                let alone = with_layout(&k, &v, hk * d, layout, |kv| {
                    invariant_attention(&Team::new(3), &last, kv, d, hk, scale)
                });
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&alone.data), bits(&whole.data[(t - 1) * qcols..]));
            }
        }
    }

    /// Two sequences whose tables name the same first blocks (a shared prompt prefix) and
    /// then blocks of their own: each reads the shared keys and its own, for a decode step
    /// and for a prompt chunk, on every path.
    #[test]
    fn sequences_sharing_their_first_blocks_read_each_their_own_rest() {
        let (bs, hq, hk) = (3, 4, 2);
        let dims: &[usize] = if cfg!(miri) { &[4] } else { &[4, 12, 16, 64] };
        for &d in dims {
            let kcols = hk * d;
            // Sequence a: 8 positions; b: the same first 6 (two shared blocks), then 5 own.
            let (_, ka, va) = operands(1, 8, d, hq, hk);
            let (_, kb_own, vb_own) = operands(1, 11, d, hq, hk);
            let kb: Vec<f32> = ka[..6 * kcols]
                .iter()
                .chain(&kb_own[6 * kcols..].iter().map(|x| -x).collect::<Vec<_>>())
                .copied()
                .collect();
            let vb: Vec<f32> = va[..6 * kcols]
                .iter()
                .chain(&vb_own[6 * kcols..])
                .copied()
                .collect();
            let (mut pk, mut pv, table_a) = scattered(&ka, &va, kcols, bs, Order::Backward);
            // Table a is [5, 3, 1]; b shares 5 and 3, then has 7 and 8 of its own.
            let table_b = [table_a[0], table_a[1], 7, 8];
            let grow = (9 * bs * kcols).saturating_sub(pk.len());
            pk.extend(std::iter::repeat_n(f32::NAN, grow));
            pv.extend(std::iter::repeat_n(f32::NAN, grow));
            for p in 6..11 {
                let row = table_b[p / bs] as usize * bs + p % bs;
                pk[row * kcols..(row + 1) * kcols].copy_from_slice(&kb[p * kcols..][..kcols]);
                pv[row * kcols..(row + 1) * kcols].copy_from_slice(&vb[p * kcols..][..kcols]);
            }
            for (t, table, n, keys, values) in [
                (1, &table_a[..], 8, &ka, &va),
                (1, &table_b[..], 11, &kb, &vb),
                (5, &table_b[..], 11, &kb, &vb),
                (7, &table_a[..], 8, &ka, &va),
            ] {
                let (q, _, _) = operands(t, 1, d, hq, hk);
                let want = reference(&q, &keys[..n * kcols], &values[..n * kcols], d, hk, 0.5);
                let kv = KvView::new(&pk, &pv, kcols, bs, table, n).unwrap();
                for members in [1, 2] {
                    let got = causal_attention(&Team::new(members), &q, &kv, d, hk, 0.5);
                    for (a, b) in got.data.iter().zip(&want) {
                        assert!(
                            (*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()),
                            "d={d} t={t} table={table:?}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
