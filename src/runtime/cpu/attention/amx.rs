//! A prompt's causal attention on AMX tiles, for bf16 compute (queries, keys, probabilities
//! and values rounded to bf16, every sum in f32, as torch's bf16 attention does).
//!
//! Keys and values are repacked once per call into the tiles' B layout (pairs of one
//! operand's depth side by side): keys per kv head as `[16-key tile][32-dim step]`, values
//! as `[32-key block][16-column tile]`, zero past the keys and the head size. A work item is
//! 16 query rows of one head: its query tiles stay in L1 while the score tiles of every
//! visible key tile are computed, the rows' softmax runs in f32 (the f32 path's `exp`
//! algorithm, 16 lanes wide), the probabilities are rounded into A tiles, and the output
//! tiles are summed over the visible key blocks, then divided by each row's sum.

use super::{KvView, Layout};
use crate::runtime::cpu::aligned::AlignedVec;
use crate::runtime::cpu::isa::{round_bf16, AmxTiles, AMX_TILE};
use crate::runtime::cpu::team::{SyncPtr, Team};
use crate::runtime::tensor::Tensor;

/// Query rows, keys per score tile, output columns per tile.
const T: usize = 16;
/// Head dims per A tile of queries, keys per A tile of probabilities.
const K: usize = 32;

/// `q [t, hq·d]` over the cached keys and values of `kv` as [`super::causal_attention`],
/// on AMX.
///
/// # Safety
/// The host has AMX-BF16 and the process was granted the tile state
/// ([`crate::runtime::cpu::isa::Isa::Amx`] is supported).
pub unsafe fn causal_attention_amx(
    team: &Team,
    q: &Tensor,
    kv: &KvView,
    d: usize,
    kv_heads: usize,
    scale: f32,
) -> Tensor {
    if q.rows_cols().0 == 0 {
        return Tensor::zeros(q.shape.clone());
    }
    let Layout {
        t,
        heads,
        group,
        kcols,
        n,
    } = Layout::of(q, kv, d, kv_heads);
    let shape = Shape {
        t,
        n,
        d,
        heads,
        group,
        kcols,
        dsteps: d.div_ceil(K),
        ctiles: d.div_ceil(T),
        kblocks: n.div_ceil(K),
    };
    let (mut keys, mut values) = (AlignedVec::new(), AlignedVec::new());
    {
        // Keys on one member, values on another.
        let (kd, vd) = (
            std::sync::Mutex::new(&mut keys),
            std::sync::Mutex::new(&mut values),
        );
        team.run_on(team.size().min(2), &|member| {
            if member == 0 || team.size() < 2 {
                **kd.lock().unwrap_or_else(|e| e.into_inner()) = pack_keys(kv, &shape, kv_heads);
            }
            if member == 1 || team.size() < 2 {
                **vd.lock().unwrap_or_else(|e| e.into_inner()) = pack_values(kv, &shape, kv_heads);
            }
        });
    }
    let mut out = Tensor::zeros(q.shape.clone());
    let dst = SyncPtr::new(&mut out.data);
    let items = t.div_ceil(T) * shape.heads;
    // At least one member (`step_by` refuses 0), even for no items (no heads).
    let members = team.size().min(items).max(1);
    team.run_on(members, &|member| {
        // SAFETY: AMX is there (this function's contract).
        let tiles = unsafe { AmxTiles::configure() };
        let mut scratch = Scratch::new(&shape);
        for w in (member..items).step_by(members) {
            let (qb, h) = (w / shape.heads, w % shape.heads);
            // SAFETY: as above; items are dealt to exactly one member each.
            unsafe {
                item(
                    &tiles,
                    &shape,
                    q,
                    &keys,
                    &values,
                    scale,
                    qb,
                    h,
                    &mut scratch,
                    dst,
                )
            };
        }
    });
    out
}

struct Shape {
    t: usize,
    n: usize,
    d: usize,
    heads: usize,
    group: usize,
    kcols: usize,
    /// Query/key tiles per head (32 dims each) and output tiles (16 columns each).
    dsteps: usize,
    ctiles: usize,
    /// 32-key blocks over the whole cache (two 16-key score tiles each).
    kblocks: usize,
}

/// Keys as B tiles for the scores: per kv head, per 16-key tile, per 32-dim step, pair row
/// `p` holds dims `2p, 2p + 1` of each of the 16 keys.
fn pack_keys(kv: &KvView, s: &Shape, kv_heads: usize) -> AlignedVec<u16> {
    let ktiles = 2 * s.kblocks;
    let mut out = AlignedVec::zeroed(kv_heads * ktiles * s.dsteps * AMX_TILE);
    for (j, key) in kv
        .runs(0..s.n)
        .flat_map(|run| (run.pos..).zip(kv.key_rows(run.row, run.len).chunks_exact(s.kcols)))
    {
        let (kt, jj) = (j / T, j % T);
        for kh in 0..kv_heads {
            let row = &key[kh * s.d..][..s.d];
            for (c, &x) in row.iter().enumerate() {
                let tile = (kh * ktiles + kt) * s.dsteps + c / K;
                let c = c % K;
                out[tile * AMX_TILE + (c / 2) * 2 * T + jj * 2 + (c & 1)] = round_bf16(x);
            }
        }
    }
    out
}

/// Values as B tiles for the output: per kv head, per 32-key block, per 16-column tile, pair
/// row `p` holds keys `2p, 2p + 1` of each of the 16 columns.
fn pack_values(kv: &KvView, s: &Shape, kv_heads: usize) -> AlignedVec<u16> {
    let mut out = AlignedVec::zeroed(kv_heads * s.kblocks * s.ctiles * AMX_TILE);
    for (j, value) in kv
        .runs(0..s.n)
        .flat_map(|run| (run.pos..).zip(kv.value_rows(run.row, run.len).chunks_exact(s.kcols)))
    {
        let (kb, jj) = (j / K, j % K);
        for kh in 0..kv_heads {
            let row = &value[kh * s.d..][..s.d];
            for (c, &x) in row.iter().enumerate() {
                let tile = (kh * s.kblocks + kb) * s.ctiles + c / T;
                out[tile * AMX_TILE + (jj / 2) * 2 * T + (c % T) * 2 + (jj & 1)] = round_bf16(x);
            }
        }
    }
    out
}

/// A member's working tiles, 64-byte aligned.
struct Scratch {
    /// Query A tiles, `[dsteps][16 rows][32 dims]`.
    q: AlignedVec<u16>,
    /// Scores then probabilities in f32, `[16 rows][kblocks·32]`.
    s: AlignedVec<f32>,
    /// Probabilities as A tiles, `[kblocks][16 rows][32 keys]`.
    p: AlignedVec<u16>,
    /// Output tiles, `[16 rows][ctiles·16]`.
    o: AlignedVec<f32>,
}

impl Scratch {
    fn new(s: &Shape) -> Scratch {
        Scratch {
            q: AlignedVec::zeroed(s.dsteps * AMX_TILE),
            s: AlignedVec::zeroed(T * s.kblocks * K),
            p: AlignedVec::zeroed(s.kblocks * AMX_TILE),
            o: AlignedVec::zeroed(T * s.ctiles * T),
        }
    }
}

/// Row `r` of the scores `s` (`np` apart, `blocks · 32` used): `seen[r]` keys become
/// `e^((x - max) · scale)` (the rest zero), `inv[r]` = 1 / their sum, and the rows are
/// rounded (to nearest even) into `blocks` A tiles at `p`. One pass for the maximum, one
/// for the exponentials, one for the rounding (`vcvtne2ps2bf16`).
///
/// # Safety
/// AVX-512F and AVX512-BF16 (every AMX host has them); `s` holds 16 rows `np ≥ blocks·32`
/// apart; `seen[r] ≤ blocks·32`; `p` holds `blocks` tiles.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn softmax_to_tiles(
    s: &mut [f32],
    np: usize,
    blocks: usize,
    seen: &[usize; T],
    scale: f32,
    p: &mut [u16],
    inv: &mut [f32; T],
) {
    use std::arch::x86_64::*;
    assert!(s.len() >= (T - 1) * np + blocks * K && p.len() >= blocks * AMX_TILE);
    let width = blocks * K;
    let sc = _mm512_set1_ps(scale);
    for (r, iv) in inv.iter_mut().enumerate() {
        let row = s.as_mut_ptr().add(r * np);
        let len = seen[r].min(width);
        let mask = |i: usize| -> __mmask16 {
            let left = len.saturating_sub(i);
            if left >= 16 {
                0xFFFF
            } else {
                ((1u32 << left) - 1) as __mmask16
            }
        };
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..len).step_by(16) {
            m = _mm512_mask_max_ps(m, mask(i), m, _mm512_loadu_ps(row.add(i)));
        }
        let mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut sum = _mm512_setzero_ps();
        for i in (0..width).step_by(16) {
            let k = mask(i);
            let x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row.add(i)), mx), sc);
            let e = _mm512_maskz_mov_ps(k, exp16(x));
            _mm512_storeu_ps(row.add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
        *iv = if len == 0 {
            0.0
        } else {
            1.0 / _mm512_reduce_add_ps(sum)
        };
    }
    for kb in 0..blocks {
        for r in 0..T {
            let src = s.as_ptr().add(r * np + kb * K);
            let pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src.add(16)), _mm512_loadu_ps(src));
            _mm512_storeu_si512(
                p.as_mut_ptr().add(kb * AMX_TILE + r * K) as *mut __m512i,
                std::mem::transmute::<__m512bh, __m512i>(pair),
            );
        }
    }
}

/// `fastmath::exp` 16 lanes wide, for `x ≤ 0` (and NaN, which stays NaN), with fused
/// multiply-adds. Not the f32 path's `max_of` / `exp_sum`: softmax through them (scores
/// scaled in a pass first) took prompt attention from 0.24 to 0.31 s per three 512-token
/// TinyLlama prefills (alternating, 3 rounds).
#[inline(always)]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // max_ps returns its second operand when either is NaN: a NaN stays NaN.
    let xc = _mm512_max_ps(_mm512_set1_ps(-87.3), x);
    let round = _mm512_set1_ps(12_582_912.0);
    let t = _mm512_fmadd_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E), round);
    let n = _mm512_sub_ps(t, round);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut poly = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
    }
    let bits = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(round));
    let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        bits,
        _mm512_set1_epi32(127),
    )));
    let y = _mm512_mul_ps(poly, two_n);
    // Below the clamp the result is 0 (as the scalar exp); a NaN input stays NaN.
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
    _mm512_mask_mov_ps(y, under, _mm512_setzero_ps())
}

/// Query rows `qb·16..` of head `h` into `dst`.
///
/// # Safety
/// AMX tiles configured on this thread (`tiles`); the item is this member's alone.
#[allow(clippy::too_many_arguments)]
unsafe fn item(
    tiles: &AmxTiles,
    s: &Shape,
    q: &Tensor,
    keys: &[u16],
    values: &[u16],
    scale: f32,
    qb: usize,
    h: usize,
    w: &mut Scratch,
    dst: SyncPtr,
) {
    let qcols = s.heads * s.d;
    let first = qb * T;
    let rows = T.min(s.t - first);
    let visible = |r: usize| s.n - s.t + first + r + 1;
    let last = visible(rows - 1);
    let (blocks, ktiles) = (last.div_ceil(K), 2 * s.kblocks);
    let np = s.kblocks * K;
    let kh = h / s.group;
    // Query tiles: rows past the block and dims past d stay zero.
    w.q.fill(0);
    for r in 0..rows {
        let row = &q.data[(first + r) * qcols + h * s.d..][..s.d];
        for (c, &x) in row.iter().enumerate() {
            w.q[(c / K) * AMX_TILE + r * K + c % K] = round_bf16(x);
        }
    }
    // Scores of every 16-key tile up to the last visible key's 32-key block.
    for kt in 0..2 * blocks {
        let b = keys[(kh * ktiles + kt) * s.dsteps * AMX_TILE..].as_ptr();
        // SAFETY: dsteps query and key tiles; 16 rows of scores from column kt·16 < np.
        unsafe {
            tiles.product_tile(
                (w.q.as_ptr(), AMX_TILE),
                (b, AMX_TILE),
                s.dsteps,
                (w.s.as_mut_ptr().add(kt * T), np),
            )
        };
    }
    // Softmax per row in f32; hidden keys and rows past the block get zero probability.
    let mut inv = [0f32; T];
    let seen: [usize; T] = std::array::from_fn(|r| if r < rows { visible(r) } else { 0 });
    // SAFETY: AMX hosts have AVX-512F and AVX512-BF16; the scratch sizes are the Shape's.
    unsafe { softmax_to_tiles(&mut w.s, np, blocks, &seen, scale, &mut w.p, &mut inv) };
    // Output tiles over the visible key blocks.
    for ct in 0..s.ctiles {
        let b = values[(kh * s.kblocks * s.ctiles + ct) * AMX_TILE..].as_ptr();
        // SAFETY: `blocks` probability tiles; value tiles kb·ctiles + ct for kb < blocks;
        // 16 rows of 16 output values from column ct·16.
        unsafe {
            tiles.product_tile(
                (w.p.as_ptr(), AMX_TILE),
                (b, s.ctiles * AMX_TILE),
                blocks,
                (w.o.as_mut_ptr().add(ct * T), s.ctiles * T),
            )
        };
    }
    for (r, &iv) in inv.iter().enumerate().take(rows) {
        // SAFETY: the item owns columns h·d .. + d of row first + r < t (the caller's
        // contract: items go to one member each).
        let o = unsafe { dst.slice_mut((first + r) * qcols + h * s.d, s.d) };
        for (o, &x) in o.iter_mut().zip(&w.o[r * s.ctiles * T..]) {
            *o = x * iv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::cpu::attention::reference::{layouts, operands, reference, with_layout};
    use crate::runtime::cpu::isa::{widen, Isa, Kernels};

    #[test]
    fn matches_an_f64_reference_of_the_rounded_operands() {
        if let Err(why) = Kernels::select(Some(Isa::Amx)) {
            eprintln!("NOT RUN on this host: AMX attention: {why}");
            return;
        }
        // (queries, cached keys, head dim, query heads, kv heads): partial 16-row blocks,
        // a cache longer than the queries, head dims that are not whole tiles, grouped heads.
        let all: &[(usize, usize, usize, usize, usize)] = &[
            (1, 40, 64, 8, 2),
            (5, 5, 64, 2, 1),
            (20, 50, 64, 4, 2),
            (17, 17, 80, 2, 1),
            (9, 9, 8, 3, 3),
            (64, 64, 64, 4, 4),
            (33, 100, 40, 6, 2),
            (48, 48, 128, 2, 2),
        ];
        let bf = |x: f32| widen(round_bf16(x));
        for &(t, n, d, hq, hk) in all {
            let (q, k, v) = operands(t, n, d, hq, hk);
            let scale = 1.0 / (d as f32).sqrt();
            let rounded = Tensor::new(q.shape.clone(), q.data.iter().map(|&x| bf(x)).collect());
            let (kr, vr): (Vec<f32>, Vec<f32>) = (
                k.iter().map(|&x| bf(x)).collect(),
                v.iter().map(|&x| bf(x)).collect(),
            );
            let want = reference(&rounded, &kr, &vr, d, hk, scale as f64);
            for (paging, members) in layouts().into_iter().flat_map(|p| [(p, 1), (p, 2), (p, 3)]) {
                let got = with_layout(&k, &v, hk * d, paging, |kv| {
                    // SAFETY: AMX was found above.
                    unsafe { causal_attention_amx(&Team::new(members), &q, kv, d, hk, scale) }
                });
                // Only the probabilities are rounded beyond the reference's operands, each
                // by at most 2⁻⁹ relative, in the sum but not in its divisor; values here are
                // at most 3 in size: error ≤ 2 · 2⁻⁹ · 3 ≈ 1.2e-2 in the worst case (3.7e-3
                // seen).
                for (i, (a, b)) in got.data.iter().zip(&want).enumerate() {
                    assert!(
                        (*a as f64 - b).abs() < 1e-2,
                        "t={t} n={n} d={d} hq={hq} hk={hk} {paging:?} members={members} at {i}: \
                         {a} vs {b}"
                    );
                }
            }
        }
    }
}
