//! Causal attention of a block of queries over a KV cache, one (query row, head) pair per
//! work item, spread over the rank's team. Each item keeps one row of scores (the keys it
//! may see), never a `[t, n]` matrix per head. Keys are first transposed to `[hk][d][n]`
//! so that a row of scores is `d` contiguous multiply-adds over the keys (8 wide, no
//! horizontal sums); values are read as they are, one contiguous row per key.

use super::fastmath::exp;
use super::simd::with_avx2;
use super::team::{SyncPtr, Team};
use super::tensor::{pool, Tensor};

/// Keys or output columns summed in registers at once (four 8-wide vectors).
const LANES: usize = 32;
/// Query rows up to which keys are read in place rather than transposed first.
const DIRECT_MAX_ROWS: usize = 4;

/// Dot product with eight partial sums, so that it vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
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
    let (t, qcols) = q.rows_cols();
    let heads = qcols / d;
    let group = heads / kv_heads;
    let kcols = kv_heads * d;
    let n = k.len() / kcols;
    assert!(
        t <= n && v.len() == k.len(),
        "attention: {t} queries over {n} cached keys"
    );
    let mut out = Tensor::zeros(q.shape.clone());
    let items = t * heads;
    let members = if items * n * d < 1 << 15 {
        1
    } else {
        team.size()
    };
    let dst = SyncPtr(out.data.as_mut_ptr());
    // Transposed keys, each row padded with zeros to whole blocks of LANES keys, pay off
    // when many queries read them; a decode step's few queries read the cache as it is.
    let transpose = t > DIRECT_MAX_ROWS;
    let np = n.next_multiple_of(LANES);
    let mut kt = pool::take(if transpose { kcols * np } else { 0 });
    if transpose {
        for j in 0..n {
            for (c, &x) in k[j * kcols..(j + 1) * kcols].iter().enumerate() {
                kt[c * np + j] = x;
            }
        }
    }
    let work = |member: usize| {
        with_avx2(|| {
            let mut scores = pool::take(np);
            // Strided items: causal rows grow with i, so striding balances the members.
            for w in (member..items).step_by(members) {
                let (i, h) = (w / heads, w % heads);
                let visible = n - t + i + 1;
                let kh = h / group;
                let qv = &q.data[i * qcols + h * d..][..d];
                if !transpose {
                    for (j, s) in scores[..visible].iter_mut().enumerate() {
                        *s = dot(qv, &k[j * kcols + kh * d..][..d]) * scale;
                    }
                }
                // Scores LANES keys at a time (fixed-size, so the sums stay in registers
                // across all d), padding keys included and then ignored.
                let blocks = if transpose {
                    visible.next_multiple_of(LANES)
                } else {
                    0
                };
                for (jb, block) in scores[..blocks].chunks_exact_mut(LANES).enumerate() {
                    let mut acc = [0f32; LANES];
                    for (c, &qc) in qv.iter().enumerate() {
                        let keys: &[f32; LANES] = kt[(kh * d + c) * np + jb * LANES..][..LANES]
                            .try_into()
                            .expect("LANES values");
                        for l in 0..LANES {
                            acc[l] += qc * keys[l];
                        }
                    }
                    for l in 0..LANES {
                        block[l] = acc[l] * scale;
                    }
                }
                let row = &mut scores[..visible];
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                for s in row.iter_mut() {
                    *s = exp(*s - max);
                }
                let sum: f32 = row.iter().sum();
                // SAFETY: item (i, h) owns columns h·d .. h·d + d of row i of `out`, and
                // every item goes to exactly one member.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at(i * qcols + h * d), d) };
                // Output 32 columns at a time, summed over the visible keys in registers.
                for (cb, chunk) in o.chunks_mut(LANES).enumerate() {
                    let base = kh * d + cb * LANES;
                    if chunk.len() == LANES {
                        let mut acc = [0f32; LANES];
                        for (j, &p) in row.iter().enumerate() {
                            let vals: &[f32; LANES] = v[j * kcols + base..][..LANES]
                                .try_into()
                                .expect("LANES values");
                            for l in 0..LANES {
                                acc[l] += p * vals[l];
                            }
                        }
                        chunk.copy_from_slice(&acc);
                    } else {
                        for (j, &p) in row.iter().enumerate() {
                            for (o, &x) in chunk.iter_mut().zip(&v[j * kcols + base..]) {
                                *o += p * x;
                            }
                        }
                    }
                }
                let inv = 1.0 / sum;
                o.iter_mut().for_each(|x| *x *= inv);
            }
            pool::give(scores);
        })
    };
    team.run_on(members, &work);
    pool::give(kt);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention in f64, written the obvious way.
    fn reference(
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
        for &(t, n, d, hq, hk) in &[
            (1, 1, 4, 2, 1),
            (7, 7, 16, 4, 2),
            (1, 40, 64, 8, 2),
            (3, 50, 64, 4, 2),
            (5, 33, 12, 6, 3),
            (64, 64, 64, 4, 4),
        ] {
            let q = Tensor::new(
                vec![t, hq * d],
                (0..t * hq * d)
                    .map(|i| ((i * 31 % 17) as f32 - 8.0) / 4.0)
                    .collect(),
            );
            let k: Vec<f32> = (0..n * hk * d)
                .map(|i| ((i * 13 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let v: Vec<f32> = (0..n * hk * d)
                .map(|i| ((i * 7 % 19) as f32 - 9.0) / 3.0)
                .collect();
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
