//! Which candidate plan the cost model prefers: the cheaper; when the prices tie, the one
//! with fewer collectives (fewer calls on which every rank waits for the slowest, and less
//! the α-β model can misjudge). Used by the sequence-parallelism choice and by
//! `simulate --search`.

use super::simulate::Estimate;
use std::cmp::Ordering;

/// A candidate's price (seconds, less is better) and the collectives it runs for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub seconds: f64,
    pub collectives: u64,
}

/// Seconds as whole picoseconds: prices that agree to the picosecond tie, whatever order
/// their sums were taken in (and the comparison stays a total order, as a sort needs).
fn picoseconds(s: f64) -> f64 {
    (s * 1e12).round()
}

/// Best first: the cheaper, then on a tie the one with fewer collectives. `Equal` when
/// both tie; a stable sort then keeps the order candidates were given in.
pub fn better_first(a: &Price, b: &Price) -> Ordering {
    picoseconds(a.seconds)
        .total_cmp(&picoseconds(b.seconds))
        .then(a.collectives.cmp(&b.collectives))
}

/// Sorts `simulate --search`'s estimates best first: plans that fit before those that do
/// not, then by decode throughput (all share one workload, so the decode step's time),
/// then by fewer collectives per pass; full ties keep their order.
pub fn rank(estimates: &mut [Estimate]) {
    let decode = |e: &Estimate| Price {
        seconds: e.decode_step.time_s,
        collectives: e.collectives_per_pass,
    };
    estimates.sort_by(|x, y| {
        y.fits
            .cmp(&x.fits)
            .then(better_first(&decode(x), &decode(y)))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::shipped;
    use crate::cost::simulate::{simulate, Workload};

    fn price(seconds: f64, collectives: u64) -> Price {
        Price {
            seconds,
            collectives,
        }
    }

    #[test]
    fn the_cheaper_plan_wins_and_a_tie_goes_to_fewer_collectives() {
        // Cheaper wins whatever it communicates.
        assert_eq!(
            better_first(&price(1e-3, 130), &price(2e-3, 65)),
            Ordering::Less
        );
        // A tie: fewer collectives first, either way round.
        assert_eq!(
            better_first(&price(1e-3, 65), &price(1e-3, 130)),
            Ordering::Less
        );
        assert_eq!(
            better_first(&price(1e-3, 130), &price(1e-3, 65)),
            Ordering::Greater
        );
        // Sums taken in another order that land a rounding error apart still tie.
        let (a, b) = (0.1 + 0.2 + 0.3, 0.3 + 0.2 + 0.1);
        assert_ne!(a, b);
        assert_eq!(
            better_first(&price(a, 130), &price(b, 65)),
            Ordering::Greater
        );
        // A picosecond apart is a real difference.
        assert_eq!(
            better_first(&price(1e-3 + 1e-12, 65), &price(1e-3, 130)),
            Ordering::Greater
        );
        assert_eq!(
            better_first(&price(1e-3, 65), &price(1e-3, 65)),
            Ordering::Equal
        );
    }

    #[test]
    fn search_ranks_fitting_then_throughput_then_fewer_collectives() {
        let plan = shipped::plan("tiny-llama", 2);
        let hw = shipped::profile("h100-sxm-nvswitch-8");
        let work = Workload {
            batch: 1,
            prompt: 16,
            gen: 16,
        };
        let base = simulate(&plan, &hw, work);
        assert!(base.fits && base.collectives_per_pass > 0);
        let with = |pp: u64, collectives: u64, decode_s: f64, fits: bool| {
            let mut e = base.clone();
            e.pp = pp;
            e.collectives_per_pass = collectives;
            e.decode_step.time_s = decode_s;
            e.fits = fits;
            e
        };
        let mut ranked = vec![
            with(1, 9, 1e-3, false),
            with(2, 9, 1e-3, true),
            with(3, 5, 1e-3, true),
            with(4, 1, 2e-3, true),
            with(5, 5, 1e-3, true),
        ];
        rank(&mut ranked);
        let order: Vec<u64> = ranked.iter().map(|e| e.pp).collect();
        // The tie at 1 ms: 5 collectives before 9 (3 and 5 tie fully: kept in order);
        // slower 4 after them however few its collectives; the one that does not fit last.
        assert_eq!(order, vec![3, 5, 2, 4, 1]);
    }
}
