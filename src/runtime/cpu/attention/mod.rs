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
mod prompt;
#[cfg(test)]
pub(crate) mod reference;
mod softmax;

pub(crate) use layout::Layout;
pub(crate) use softmax::{exp_sum, max_of};

use crate::runtime::cpu::team::Team;
use crate::runtime::tensor::Tensor;

/// Keys or output columns summed in registers at once (four 8-wide vectors).
const LANES: usize = 32;
/// Query rows up to which keys are read in place rather than transposed first.
pub(crate) const DIRECT_MAX_ROWS: usize = 4;

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
    if layout.t > DIRECT_MAX_ROWS {
        return prompt::attend(team, q, k, v, d, layout, scale);
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(width) = decode::Width::for_host(d) {
        return decode::causal_attention_decode(width, team, q, k, v, d, layout, scale);
    }
    direct::attend(team, q, k, v, d, layout, scale)
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
    use super::reference::{operands, reference};
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
