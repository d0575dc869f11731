//! The softmax pieces every CPU attention path shares: a vectorisable maximum, the
//! exponentials with their sum, and a dot product.

use crate::runtime::cpu::fastmath::exp;

/// The largest value, over 16 running maxima so that it vectorises (one running maximum,
/// or `f32::max` with its NaN rule, stays a scalar chain: seen in a profile).
#[inline(always)]
pub(crate) fn max_of(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    rest.iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// `x[i] = e^(x[i] - max)`, returning their sum over 16 partial sums (see [`max_of`]).
#[inline(always)]
pub(crate) fn exp_sum(x: &mut [f32], max: f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        for l in 0..16 {
            c[l] = exp(c[l] - max);
            acc[l] += c[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for v in chunks.into_remainder() {
        *v = exp(*v - max);
        s += *v;
    }
    s
}

/// Dot product with sixteen partial sums, one zmm (or two ymm) of lanes, so that it
/// vectorises at full width. With eight sums combined pairwise the compiler built it from
/// 4-wide products and shuffles (seen in `perf annotate` of a decode step at 512 cached keys).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}
