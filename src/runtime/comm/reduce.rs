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
//! Floating-point addition is commutative but not associative, so for two ranks every order
//! gives the same bits; from three ranks on, the order above is what makes results
//! reproducible. (A NaN result is NaN everywhere, but which NaN payload it carries is not
//! specified by Rust, so only non-NaN results are promised bit for bit.)

use std::ops::Range;

/// Chunk boundaries are multiples of this many elements (one 64-byte cache line of `f32`),
/// so two ranks never write the same cache line in one ring step.
pub const CHUNK_ALIGN: usize = 16;

/// The elements of chunk `c` (of `n`) of a `len`-element all-reduce. Chunks are consecutive,
/// equal-sized multiples of [`CHUNK_ALIGN`] except for the last non-empty one; trailing
/// chunks may be empty.
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    debug_assert!(c < n);
    let per = len.div_ceil(n).div_ceil(CHUNK_ALIGN) * CHUNK_ALIGN;
    let start = (c * per).min(len);
    start..(start + per).min(len)
}

/// The ranks, in the order their values are added, for chunk (or piece) `c` of `n`.
pub fn summation_order(n: usize, c: usize) -> impl Iterator<Item = usize> {
    (1..=n).map(move |j| (c + j) % n)
}

/// `dst ← ((s₀ + s₁) + s₂) + …` for the sources in the order given (a copy of `s₀` if it is
/// the only one); nothing if there is none.
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
pub(super) fn copy(dst: &mut [f32], src: &[f32]) {
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
                    assert!(r.start % CHUNK_ALIGN == 0 || r.is_empty());
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

    #[test]
    fn order_starts_after_owner_and_ends_with_it() {
        assert_eq!(summation_order(4, 1).collect::<Vec<_>>(), [2, 3, 0, 1]);
        assert_eq!(summation_order(4, 3).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(summation_order(1, 0).collect::<Vec<_>>(), [0]);
    }
}
