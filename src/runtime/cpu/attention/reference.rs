//! Test operands and an f64 reference for every CPU attention path's tests.

use super::KvView;
use crate::runtime::tensor::Tensor;

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
                            q.data[i * qcols + h * d + c] as f64 * k[j * kcols + kh * d + c] as f64
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

/// How [`scattered`] lays a sequence's blocks out in the pool.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Order {
    /// Every block alone, backwards, a free block between each two.
    Backward,
    /// Pairs of consecutive blocks (read as one run), the pairs backwards with gaps.
    Pairs,
}

/// `k`, `v` `[n, kcols]` written into a pool of blocks of `block_size` rows, filled with
/// NaN elsewhere (a kernel that reads a position outside the table makes NaN), through a
/// table in `order`: the pool's keys and values and the table.
pub(crate) fn scattered(
    k: &[f32],
    v: &[f32],
    kcols: usize,
    block_size: usize,
    order: Order,
) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let n = k.len() / kcols;
    let m = n.div_ceil(block_size).max(1);
    let table: Vec<u32> = (0..m)
        .map(|i| match order {
            Order::Backward => 2 * (m - i) - 1,
            Order::Pairs => 3 * ((m - 1) / 2 - i / 2) + 1 + i % 2,
        } as u32)
        .collect();
    let pool_blocks = *table.iter().max().expect("a block") as usize + 2;
    let len = pool_blocks * block_size * kcols;
    let (mut pk, mut pv) = (vec![f32::NAN; len], vec![f32::NAN; len]);
    for p in 0..n {
        let row = table[p / block_size] as usize * block_size + p % block_size;
        pk[row * kcols..(row + 1) * kcols].copy_from_slice(&k[p * kcols..(p + 1) * kcols]);
        pv[row * kcols..(row + 1) * kcols].copy_from_slice(&v[p * kcols..(p + 1) * kcols]);
    }
    (pk, pv, table)
}

/// The cache layouts every kernel test runs a shape over: `None` for one contiguous run,
/// else a block size and an order of the blocks.
pub(crate) fn layouts() -> Vec<Option<(usize, Order)>> {
    if cfg!(miri) {
        // Thousands of times slower: one of each order, blocks of 1 and 3.
        return vec![None, Some((1, Order::Pairs)), Some((3, Order::Backward))];
    }
    let mut all = vec![None];
    for bs in [1, 3, 16] {
        all.push(Some((bs, Order::Backward)));
        all.push(Some((bs, Order::Pairs)));
    }
    all
}

/// Runs `f` on `k`, `v` `[n, kcols]` laid out as `layout` (see [`layouts`]).
pub(crate) fn with_layout<R>(
    k: &[f32],
    v: &[f32],
    kcols: usize,
    layout: Option<(usize, Order)>,
    f: impl FnOnce(&KvView) -> R,
) -> R {
    match layout {
        None => f(&KvView::contiguous(k, v, kcols).expect("whole rows")),
        Some((bs, order)) => {
            let (pk, pv, table) = scattered(k, v, kcols, bs, order);
            let n = k.len() / kcols;
            f(&KvView::new(&pk, &pv, kcols, bs, &table, n).expect("a valid table"))
        }
    }
}
