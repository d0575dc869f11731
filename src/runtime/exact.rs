//! Exact sums of f32 partial products, for `--numerics invariant`.
//!
//! A product whose depth is split over ranks (a row-parallel linear) is computed in blocks
//! of depth that every valid tp's split boundary falls on. Each block's sum is an ordinary
//! f32 chain; blocks are then added exactly: every block sum is rounded once to a fixed
//! grid of `2^-GRID_BITS` ([`to_units`]) and the grid values, integers in an f64, are added
//! without rounding while they stay below 2^53. Exact addition does not depend on order, so
//! the sum is the same bits whether one rank adds all the blocks or tp ranks add theirs and
//! a collective adds the ranks' sums in whatever order its algorithm likes.
//!
//! The collectives carry f32 values: a rank's integer sum travels as three f32 *limbs* of
//! [`LIMB_BITS`] bits ([`encode_limbs`]); summed over up to [`MAX_RANKS`] ranks each limb
//! stays an integer below 2^24, which f32 adds exactly in any order, so every all-reduce
//! and reduce-scatter algorithm (threads, MPI, NCCL) delivers the exact limb sums, and
//! [`decode_limbs`] turns them back into one f32 rounded once.

/// Bits after the point of the grid block sums are rounded to: 2^-28 ≈ 3.7e-9, below an
/// f32 ulp of any value above 0.03 (the outputs these sums make are added to a residual
/// stream of order 1).
pub const GRID_BITS: i32 = 28;

/// Largest integer an f64 adds exactly.
const EXACT: f64 = (1u64 << 53) as f64;

/// Bits per limb, and the ranks whose limb sums stay below 2^24.
pub const LIMB_BITS: i32 = 19;
pub const MAX_RANKS: usize = 1 << (24 - LIMB_BITS);
const _: () = assert!(MAX_RANKS as u64 == crate::ir::numerics::MAX_INVARIANT_RANKS);

/// Limbs per value.
pub const LIMBS: usize = 3;

/// Adding 1.5·2^52 to an f64 below 2^51 rounds it to an integer (to nearest even): the
/// rounding without a `round` instruction, so that loops of it vectorise.
const ROUND: f64 = 6_755_399_441_055_744.0;

/// The largest block sum (in value) a product of `blocks` blocks may hold so that any sum
/// of its blocks stays exact: 2^53 grid units shared by the blocks (rounded up to a power
/// of two).
pub fn block_bound(blocks: usize) -> f32 {
    let share = blocks.max(1).next_power_of_two() as f64;
    (EXACT / share * (-GRID_BITS as f64).exp2()) as f32
}

/// `v` rounded to the grid, as a count of grid units (an integer in an f64). A value past
/// `bound` (or not finite) gives NaN, which every later sum keeps: the run then stops at its
/// non-finite check, naming the op, instead of losing exactness silently.
#[inline(always)]
pub fn to_units(v: f32, bound: f32) -> f64 {
    // Computed either way and then chosen, so that loops of it vectorise (a blend).
    let units = (v as f64 * (GRID_BITS as f64).exp2() + ROUND) - ROUND;
    if v.abs() <= bound {
        units
    } else {
        f64::NAN
    }
}

/// A count of grid units back to a value: one rounding, to nearest.
#[inline(always)]
pub fn from_units(u: f64) -> f32 {
    (u * (-GRID_BITS as f64).exp2()) as f32
}

/// `u` (an integer below 2^53, or NaN) as three limbs, lowest first: `u = l0 + l1·2^19 +
/// l2·2^38` with `0 ≤ l0, l1 < 2^19` and `|l2| < 2^15`.
#[inline(always)]
pub fn encode_limbs(u: f64) -> [f32; LIMBS] {
    let unit = (LIMB_BITS as f64).exp2();
    let high = (u / unit).floor();
    let l0 = u - high * unit;
    let top = (high / unit).floor();
    let l1 = high - top * unit;
    [l0 as f32, l1 as f32, top as f32]
}

/// The value whose limbs (each summed over ranks) are `l`.
#[inline(always)]
pub fn decode_limbs(l: [f32; LIMBS]) -> f32 {
    let unit = (LIMB_BITS as f64).exp2();
    from_units(l[0] as f64 + (l[1] as f64 + l[2] as f64 * unit) * unit)
}

/// Rows of `n` values in limbs (`n · LIMBS` each, a value's limbs side by side, so that a
/// column block of values is a column block of limbs) → rows of `n` values.
pub fn decode_limb_rows(limbs: &[f32], out: &mut [f32]) {
    for (o, l) in out.iter_mut().zip(limbs.chunks_exact(LIMBS)) {
        *o = decode_limbs([l[0], l[1], l[2]]);
    }
}

/// How an invariant product adds its depth blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepthOrder {
    /// Blocks of `block` steps (the last may be shorter), added in f32 in order.
    Chained { block: usize },
    /// Blocks of `block` steps added exactly. `blocks_total`: blocks of the whole depth
    /// (over every rank), which bounds a block's sum; `limbs`: write each output as its
    /// limbs (`LIMBS` values side by side: a rank's partial sum for a collective).
    Exact {
        block: usize,
        blocks_total: usize,
        limbs: bool,
    },
}

impl DepthOrder {
    pub fn block(self) -> usize {
        match self {
            DepthOrder::Chained { block } | DepthOrder::Exact { block, .. } => block.max(1),
        }
    }

    /// The largest block sum the order may add ([`block_bound`] of the whole depth's
    /// blocks when they are added exactly; anything when chained in f32).
    pub fn bound(self) -> f32 {
        match self {
            DepthOrder::Exact { blocks_total, .. } => block_bound(blocks_total),
            DepthOrder::Chained { .. } => f32::INFINITY,
        }
    }

    /// Values written per output.
    pub fn width(self) -> usize {
        match self {
            DepthOrder::Exact { limbs: true, .. } => LIMBS,
            _ => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2654435761) ^ salt).wrapping_mul(40503);
                let mantissa = (h % 100_000) as f32 / 100_000.0 - 0.5;
                mantissa * [1e-6f32, 1e-2, 1.0, 300.0][(h >> 20) as usize % 4]
            })
            .collect()
    }

    #[test]
    fn sums_of_units_are_the_same_in_any_grouping_and_through_limbs() {
        let blocks = values(64, 7);
        let bound = block_bound(blocks.len());
        let units: Vec<f64> = blocks.iter().map(|&v| to_units(v, bound)).collect();
        let whole = units.iter().sum::<f64>();
        let backwards = units.iter().rev().sum::<f64>();
        assert_eq!(whole.to_bits(), backwards.to_bits());
        for ranks in [2, 3, 4, 8, 16, 32] {
            // Each rank sums its share, encodes it; limbs are summed as f32 in two orders.
            let per = blocks.len().div_ceil(ranks);
            let parts: Vec<[f32; LIMBS]> = units
                .chunks(per)
                .map(|c| encode_limbs(c.iter().sum::<f64>()))
                .collect();
            let add = |a: [f32; LIMBS], b: &[f32; LIMBS]| [a[0] + b[0], a[1] + b[1], a[2] + b[2]];
            let forward = parts.iter().fold([0.0; LIMBS], add);
            let reverse = parts.iter().rev().fold([0.0; LIMBS], add);
            assert_eq!(forward, reverse);
            assert_eq!(
                decode_limbs(forward).to_bits(),
                from_units(whole).to_bits(),
                "{ranks} ranks"
            );
        }
        // The f32 sum in two orders is not this stable: the check above can fail.
        let f32_forward = blocks.iter().sum::<f32>();
        let f32_backward = blocks.iter().rev().sum::<f32>();
        assert_ne!(f32_forward.to_bits(), f32_backward.to_bits());
    }

    #[test]
    fn units_round_to_the_grid_and_out_of_range_values_become_nan() {
        assert_eq!(from_units(to_units(1.5, 1e6)), 1.5);
        assert_eq!(from_units(to_units(-0.25, 1e6)), -0.25);
        let tiny = (-(GRID_BITS as f32) - 2.0).exp2();
        assert_eq!(to_units(tiny, 1e6), 0.0);
        assert!(to_units(2e6, 1e6).is_nan());
        assert!(to_units(f32::NAN, 1e6).is_nan());
        assert!(decode_limbs(encode_limbs(f64::NAN)).is_nan());
        for u in [
            0.0,
            1.0,
            -1.0,
            524_287.0,
            -524_289.0,
            1e15,
            -1e15,
            (EXACT - 1.0),
        ] {
            let l = encode_limbs(u);
            assert!((0.0..524_288.0).contains(&l[0]) && (0.0..524_288.0).contains(&l[1]));
            assert_eq!(
                l[0] as f64 + (l[1] as f64 + l[2] as f64 * 524_288.0) * 524_288.0,
                u
            );
        }
        assert_eq!(block_bound(3), block_bound(4));
        assert!(block_bound(32) > 1e6);
    }
}
