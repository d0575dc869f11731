//! The fixed summation order of every reducing collective, and the kernels that follow it.
//!
//! # Order
//!
//! An all-reduce of `len` elements over `n` ranks splits the elements into `n` chunks
//! ([`chunk_range`]). Rank `c` owns chunk `c`, and every element of chunk `c` is summed as
//!
//! ```text
//! ((x[c+1] + x[c+2]) + …) + x[c+n]        rank indices mod n
//! ```
//!
//! — it starts at the rank after the owner and the owner adds last ([`summation_order`]).
//! That is the order in which a ring reduce-scatter carries a chunk's partial sum around
//! the ring; the one-shot algorithm adds in the same order, so both algorithms produce the
//! same bits and the size threshold between them never changes a result. `reduce_scatter_sum`
//! sums piece `r` in the order of owner `r`.
//!
//! Every sum is carried in `f32` whatever the element type, and a `bf16` result is rounded
//! once, from the complete `f32` sum (so `bf16` results are bit-identical across ranks and
//! algorithms too, and no partial sum loses precision on the way). The ring therefore
//! carries `bf16` partial sums as `f32` (`widen_add`) and rounds at the owner
//! (`add_round`); `f32` partial sums travel in place in the ranks' buffers.
//!
//! Floating-point addition is commutative but not associative, so for two ranks every order
//! gives the same bits; from three ranks on, the order above is what makes results
//! reproducible. (A NaN result is NaN everywhere, but which NaN payload it carries is not
//! specified by Rust, so only non-NaN results are promised bit for bit.)

use super::Element;
use crate::runtime::simd::with_avx2;
use std::ops::Range;

/// Chunk boundaries are multiples of this many elements (one 64-byte cache line of `f32`, so
/// for `bf16` half a line: see [`chunk_range`]), so two ranks never write the same cache line
/// in one ring step.
pub const CHUNK_ALIGN: usize = 16;

/// The elements of chunk `c` (of `n`) of a `len`-element all-reduce. Chunks are consecutive,
/// equal-sized multiples of [`CHUNK_ALIGN`] except for the last non-empty one; trailing
/// chunks may be empty.
///
/// Chunks depend on the element count only, not the type, so the summation order of an
/// element is the same for `f32` and `bf16`. For `bf16` two chunks may share a cache line
/// (false sharing costs time, never correctness: the chunks are disjoint elements).
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    debug_assert!(c < n);
    let per = len.div_ceil(n).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
    let start = (c * per).min(len);
    start..(start + per).min(len)
}

/// The ranks, in the order their values are added, for chunk (or piece) `c` of `n`.
pub fn summation_order(n: usize, c: usize) -> impl Iterator<Item = usize> + Clone {
    (1..=n).map(move |j| (c + j) % n)
}

/// `dst ← ((s₀ + s₁) + s₂) + …` for the sources in the order given (a copy of `s₀` if it is
/// the only one); nothing if there is none. The `f32` kernel: accumulates in `dst`.
pub(super) fn sum_into<'a>(dst: &mut [f32], mut sources: impl Iterator<Item = &'a [f32]>) {
    let Some(first) = sources.next() else {
        return;
    };
    match sources.next() {
        None => copy(dst, first),
        Some(second) => {
            add_two(dst, first, second);
            for src in sources {
                accumulate(dst, src);
            }
        }
    }
}

/// `dst[i] = src[i]`, deliberately not through `memcpy`.
///
/// On this machine (AMD EPYC Zen 3 under KVM, glibc 2.36) `memcpy` of 4 KiB–256 KiB uses
/// `rep movsb`, which runs at 3 GB/s instead of 40–80 GB/s when the destination is a few
/// bytes above the source modulo 4 KiB (measured: distance 16 bytes mod 4 KiB, 16 KiB copy,
/// 5.4 µs with `copy_from_slice`, 0.34 µs with this loop). Buffers of different ranks land
/// at such distances by chance (same-sized allocations in per-thread arenas do), so every
/// copy in the collectives uses this loop. Its eight separate element stores per iteration
/// keep LLVM from recognising it as `memcpy`; the SLP vectorizer turns them into vector
/// moves.
pub(super) fn copy<T: Copy>(dst: &mut [T], src: &[T]) {
    debug_assert_eq!(dst.len(), src.len());
    let mut dst8 = dst.chunks_exact_mut(8);
    let mut src8 = src.chunks_exact(8);
    for (d, s) in (&mut dst8).zip(&mut src8) {
        let [a, b, c, e, f, g, h, i] = [s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]];
        d[0] = a;
        d[1] = b;
        d[2] = c;
        d[3] = e;
        d[4] = f;
        d[5] = g;
        d[6] = h;
        d[7] = i;
    }
    for (d, s) in dst8.into_remainder().iter_mut().zip(src8.remainder()) {
        *d = *s;
    }
}

/// `dst[i] = a[i] + b[i]`.
#[inline]
fn add_two(dst: &mut [f32], a: &[f32], b: &[f32]) {
    debug_assert!(dst.len() == a.len() && dst.len() == b.len());
    for ((d, a), b) in dst.iter_mut().zip(a).zip(b) {
        *d = *a + *b;
    }
}

/// `dst[i] = dst[i] + src[i]`: adds the next rank's value to an accumulator.
#[inline]
fn accumulate(dst: &mut [f32], src: &[f32]) {
    debug_assert_eq!(dst.len(), src.len());
    for (d, s) in dst.iter_mut().zip(src) {
        *d += *s;
    }
}

/// `own[i] = partial[i] + own[i]`: the ring step, where the accumulator arrives from the
/// previous rank and this rank's value is added to it. (Written `own += partial`: addition
/// is commutative, only its association matters.)
#[inline]
pub(super) fn accumulate_into_own(own: &mut [f32], partial: &[f32]) {
    debug_assert_eq!(own.len(), partial.len());
    for (o, p) in own.iter_mut().zip(partial) {
        *o += *p;
    }
}

/// Elements per block of [`sum_widened_into`]: its `f32` accumulator (1 KiB) stays in L1.
const BLOCK: usize = 256;

/// [`sum_into`] for an element type narrower than `f32`: each block of `dst` is summed in an
/// `f32` accumulator, in the order of the sources, and rounded once. `sources` is walked
/// once per block (it is cheap to clone: it maps rank indices to slices).
pub(super) fn sum_widened_into<'a, T: Element>(
    dst: &mut [T],
    sources: impl Iterator<Item = &'a [T]> + Clone,
) {
    with_avx2(|| sum_widened_blocks(dst, sources));
}

#[inline(always)]
fn sum_widened_blocks<'a, T: Element>(
    dst: &mut [T],
    sources: impl Iterator<Item = &'a [T]> + Clone,
) {
    let mut acc = [0.0f32; BLOCK];
    for (b, d) in dst.chunks_mut(BLOCK).enumerate() {
        let range = b * BLOCK..b * BLOCK + d.len();
        let acc = &mut acc[..d.len()];
        let mut sources = sources.clone();
        let Some(first) = sources.next() else {
            return;
        };
        for (a, x) in acc.iter_mut().zip(&first[range.clone()]) {
            *a = x.to_f32();
        }
        for src in sources {
            for (a, x) in acc.iter_mut().zip(&src[range.clone()]) {
                *a += x.to_f32();
            }
        }
        for (d, a) in d.iter_mut().zip(acc.iter()) {
            *d = T::from_f32(*a);
        }
    }
}

/// The two-shot's reduce-scatter at a chunk's owner:
/// `own[i] ← round(((p₀[i] + p₁[i]) + …) + own[i])` for the `peers` in the order given (the
/// owner adds last, as [`summation_order`] says), summed in `f32`, and the result copied to
/// `out` too. The sums are those of [`sum_into`] and [`sum_widened_into`] with the owner as
/// the last source, bit for bit (the same `f32` additions in the same order, rounded once),
/// but `own` is read and written in one pass, block by block, with the partial sums in L1.
pub(super) fn sum_peers_into_own<'a, T: Element>(
    own: &mut [T],
    out: &mut [T],
    peers: impl Iterator<Item = &'a [T]> + Clone,
) {
    debug_assert_eq!(own.len(), out.len());
    with_avx2(|| {
        let mut acc = [0.0f32; BLOCK];
        for (b, (o, d)) in own.chunks_mut(BLOCK).zip(out.chunks_mut(BLOCK)).enumerate() {
            let range = b * BLOCK..b * BLOCK + o.len();
            let acc = &mut acc[..o.len()];
            let mut peers = peers.clone();
            match peers.next() {
                Some(first) => {
                    for (a, x) in acc.iter_mut().zip(&first[range.clone()]) {
                        *a = x.to_f32();
                    }
                    for src in peers {
                        for (a, x) in acc.iter_mut().zip(&src[range.clone()]) {
                            *a += x.to_f32();
                        }
                    }
                    for ((o, d), a) in o.iter_mut().zip(d.iter_mut()).zip(acc.iter()) {
                        *o = T::from_f32(*a + o.to_f32());
                        *d = *o;
                    }
                }
                None => copy(d, o),
            }
        }
    })
}

/// `acc[i] = partial[i] + own[i]` in `f32`: a ring step that carries a widened partial sum
/// on. `partial` is the previous rank's input (first step) or its `f32` partial sum.
#[inline]
pub(super) fn widen_add<P: Element, T: Element>(acc: &mut [f32], partial: &[P], own: &[T]) {
    debug_assert!(acc.len() == partial.len() && acc.len() == own.len());
    with_avx2(|| {
        for ((a, p), o) in acc.iter_mut().zip(partial).zip(own) {
            *a = p.to_f32() + o.to_f32();
        }
    })
}

/// `own[i] = round(partial[i] + own[i])`: the last ring step, at the chunk's owner, which
/// completes the `f32` sum and rounds it once.
#[inline]
pub(super) fn add_round<P: Element, T: Element>(own: &mut [T], partial: &[P]) {
    debug_assert_eq!(own.len(), partial.len());
    with_avx2(|| {
        for (o, p) in own.iter_mut().zip(partial) {
            *o = T::from_f32(p.to_f32() + o.to_f32());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_tile_the_buffer() {
        for n in 1..=8 {
            for len in [0, 1, 5, 15, 16, 17, 100, 127, 128, 1000, 4099] {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk_range(len, n, c);
                    assert_eq!(r.start, next, "len {len} n {n} chunk {c}");
                    assert!(r.start.is_multiple_of(CHUNK_ALIGN) || r.is_empty());
                    next = r.end;
                }
                assert_eq!(next, len, "len {len} n {n}");
            }
        }
    }

    #[test]
    fn kernels_compute_what_they_say() {
        for len in [0, 1, 7, 8, 9, 31, 1000] {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut dst = vec![f32::NAN; len];
            copy(&mut dst, &src);
            assert_eq!(dst, src);
            let twice: Vec<f32> = src.iter().map(|x| x * 2.0).collect();
            sum_into(&mut dst, [&src[..], &src[..]].into_iter());
            assert_eq!(dst, twice);
            sum_into(&mut dst, [&src[..], &src[..], &twice[..]].into_iter());
            assert_eq!(dst, src.iter().map(|x| x * 4.0).collect::<Vec<_>>());
            sum_into(&mut dst, [&twice[..]].into_iter());
            assert_eq!(dst, twice);
            accumulate_into_own(&mut dst, &src);
            assert_eq!(dst, src.iter().map(|x| x * 3.0).collect::<Vec<_>>());
        }
    }

    /// The widened kernels round once, from the exact `f32` sum in the given order.
    #[test]
    fn widened_kernels_sum_in_f32_and_round_once() {
        use half::bf16;
        // bf16 has 7 mantissa bits, so 1 + 2⁻⁸ is a tie and rounds to 1 (even): rounding
        // after each addition of 1 + 2⁻⁸ + 2⁻⁸ would give 1; rounding the f32 sum gives
        // 1 + 2⁻⁷, which bf16 holds exactly.
        let one = bf16::from_f32(1.0);
        let tiny = bf16::from_f32(2f32.powi(-8));
        for len in [1, 255, 256, 257, 1000] {
            let a = vec![one; len];
            let b = vec![tiny; len];
            let mut dst = vec![bf16::ZERO; len];
            sum_widened_into(&mut dst, [&a[..], &b[..], &b[..]].into_iter());
            assert!(
                dst.iter().all(|x| x.to_f32() == 1.0 + 2f32.powi(-7)),
                "len {len}"
            );
            sum_widened_into(&mut dst, [&b[..]].into_iter());
            assert_eq!(dst, b);
            let mut acc = vec![0.0f32; len];
            widen_add(&mut acc, &a, &b);
            assert!(acc.iter().all(|&x| x == 1.0 + 2f32.powi(-8)));
            let mut own = b.clone();
            add_round(&mut own, &acc);
            assert!(own.iter().all(|x| x.to_f32() == 1.0 + 2f32.powi(-7)));
            let mut own = b.clone();
            add_round(&mut own, &a);
            assert!(own.iter().all(|&x| x == one), "a tie rounds to even");
        }
    }

    /// The two-shot's owner kernel gives the bits of the one-shot's kernels with the owner
    /// added last, for `f32` and `bf16`, across block boundaries, with 0 to 3 peers.
    #[test]
    fn sum_into_own_matches_the_one_shot_kernels() {
        use half::bf16;
        let value = |k: usize, i: usize| {
            let x = ((i * 7919 + k * 104_729) % 2003) as f32 - 1001.0;
            x * 2f32.powi((i % 23) as i32 - 11)
        };
        for len in [0, 1, 17, 255, 256, 257, 1000] {
            for peers in 0..=3 {
                let srcs: Vec<Vec<f32>> = (0..=peers)
                    .map(|k| (0..len).map(|i| value(k, i)).collect())
                    .collect();
                let mut want = vec![0.0f32; len];
                sum_into(&mut want, srcs.iter().map(|v| &v[..]));
                let mut own = srcs[peers].clone();
                let mut out = vec![f32::NAN; len];
                sum_peers_into_own(&mut own, &mut out, srcs[..peers].iter().map(|v| &v[..]));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&own), bits(&want), "f32 len {len} peers {peers}");
                assert_eq!(bits(&out), bits(&want), "f32 len {len} peers {peers}");
                let srcs16: Vec<Vec<bf16>> = srcs
                    .iter()
                    .map(|v| v.iter().map(|&x| bf16::from_f32(x)).collect())
                    .collect();
                let mut want16 = vec![bf16::ZERO; len];
                sum_widened_into(&mut want16, srcs16.iter().map(|v| &v[..]));
                let mut own16 = srcs16[peers].clone();
                let mut out16 = vec![bf16::NAN; len];
                sum_peers_into_own(
                    &mut own16,
                    &mut out16,
                    srcs16[..peers].iter().map(|v| &v[..]),
                );
                let bits16 = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits16(&own16),
                    bits16(&want16),
                    "bf16 len {len} peers {peers}"
                );
                assert_eq!(
                    bits16(&out16),
                    bits16(&want16),
                    "bf16 len {len} peers {peers}"
                );
            }
        }
    }

    #[test]
    fn order_starts_after_owner_and_ends_with_it() {
        assert_eq!(summation_order(4, 1).collect::<Vec<_>>(), [2, 3, 0, 1]);
        assert_eq!(summation_order(4, 3).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(summation_order(1, 0).collect::<Vec<_>>(), [0]);
    }
}
