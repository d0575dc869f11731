//! All-reduce algorithm choice: each algorithm's α-β time, the cheapest per message size,
//! and the pass that writes that choice onto every all-reduce of a plan.

use super::profile::{AlphaBeta, HwProfile, LinkCosts};
use crate::ir::{AlgorithmChoice, CollectiveAlgorithm, Op, SizeRange};
use crate::plan::Plan;

/// Time of one all-reduce of `bytes` over `p` ranks with `algorithm`.
pub fn all_reduce_time(
    link: &LinkCosts,
    algorithm: CollectiveAlgorithm,
    p: u64,
    bytes: f64,
) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    let cost = |ab: AlphaBeta, wire: f64| ab.alpha_s + wire / ab.beta_bytes_per_s;
    // Ring and two-shot move 2(p-1)/p of the message per rank; one-shot reads every peer's
    // whole buffer; the ring pays its latency once per step.
    match algorithm {
        CollectiveAlgorithm::Ring => cost(
            AlphaBeta {
                alpha_s: link.ring.alpha_s * (p - 1.0),
                ..link.ring
            },
            2.0 * (p - 1.0) / p * bytes,
        ),
        CollectiveAlgorithm::TwoShot => cost(link.two_shot, 2.0 * (p - 1.0) / p * bytes),
        CollectiveAlgorithm::OneShot => cost(link.one_shot, (p - 1.0) * bytes),
    }
}

/// The cheapest algorithm for `bytes` and its time; ties go to the earlier of
/// [`CollectiveAlgorithm::ALL`].
pub fn cheapest_all_reduce(link: &LinkCosts, p: u64, bytes: f64) -> (CollectiveAlgorithm, f64) {
    let mut best = (CollectiveAlgorithm::ALL[0], f64::INFINITY);
    for a in CollectiveAlgorithm::ALL {
        let t = all_reduce_time(link, a, p, bytes);
        if t < best.1 {
            best = (a, t);
        }
    }
    best
}

/// The cheapest algorithm for every message size, as ascending ranges. Each change of the
/// cheapest algorithm between powers of two is placed to the byte by bisection.
pub fn algorithm_table(link: &LinkCosts, p: u64) -> Vec<SizeRange> {
    let pick = |bytes: u64| cheapest_all_reduce(link, p, bytes as f64).0;
    let mut ranges: Vec<SizeRange> = Vec::new();
    // A message has at least one byte; the first range covers empty ones too.
    let mut current = pick(1);
    let mut below = 1u64;
    for k in 1..=62 {
        let at = 1u64 << k;
        if pick(at) == current {
            below = at;
            continue;
        }
        // `below` still picks `current`, `at` does not: find the last byte that does.
        let (mut lo, mut hi) = (below, at);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if pick(mid) == current {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        ranges.push(SizeRange {
            up_to_bytes: lo,
            algorithm: current,
        });
        current = pick(hi);
        below = at;
    }
    ranges.push(SizeRange {
        up_to_bytes: u64::MAX,
        algorithm: current,
    });
    ranges
}

/// Records on every all-reduce of every rank the cheapest algorithm by message size on
/// `hw` (all sites of a plan share the group size and the link, so they share the table).
pub fn choose_algorithms(plan: &mut Plan, hw: &HwProfile) {
    let choice = AlgorithmChoice {
        profile: hw.name.clone(),
        by_size: algorithm_table(&hw.link, plan.tp),
    };
    apply_algorithms(plan, &choice);
    // Recorded with the plan's source, so a loaded plan compiles again to the same choices.
    if let Some(source) = &mut plan.source {
        source.algorithms = Some(choice);
    }
}

/// Sets `choice` on every all-reduce of every rank (a fused norm's too).
pub fn apply_algorithms(plan: &mut Plan, choice: &AlgorithmChoice) {
    for rank in &mut plan.ranks {
        for i in &mut rank.instrs {
            match &mut i.op {
                Op::AllReduce(a) => a.algorithm = Some(choice.clone()),
                Op::RmsNorm(n) => {
                    if let Some(a) = &mut n.reduce_input {
                        a.algorithm = Some(choice.clone());
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CollectiveAlgorithm::*;

    fn link(one_shot_alpha: f64) -> LinkCosts {
        let ab = AlphaBeta {
            alpha_s: 1e-5,
            beta_bytes_per_s: 1e11,
        };
        LinkCosts {
            ring: ab,
            one_shot: AlphaBeta {
                alpha_s: one_shot_alpha,
                ..ab
            },
            two_shot: ab,
            send_recv: ab,
        }
    }

    #[test]
    fn the_cheapest_algorithm_follows_hand_arithmetic() {
        let link = link(5e-6);
        assert_eq!(all_reduce_time(&link, Ring, 1, 1e9), 0.0);
        // Small messages: one-shot's lower latency wins over two-shot and the ring's 7 steps.
        let (a, t) = cheapest_all_reduce(&link, 8, 1024.0);
        assert_eq!(a, OneShot);
        assert!((t - (5e-6 + 7.0 * 1024.0 / 1e11)).abs() < 1e-12);
        // Large messages: 2(p-1)/p of the bytes with one latency (two-shot).
        let (a, t) = cheapest_all_reduce(&link, 8, 1e9);
        assert_eq!(a, TwoShot);
        assert!((t - (1e-5 + 1.75e9 / 1e11)).abs() < 1e-9);
    }

    #[test]
    fn the_table_changes_where_the_costs_cross() {
        // p = 8: one-shot 5 µs + 7b/β, two-shot 10 µs + 1.75b/β: equal at b = 5e-6·β/5.25.
        let link = link(5e-6);
        let table = algorithm_table(&link, 8);
        let cross = 5e-6 * 1e11 / 5.25;
        assert_eq!(table.len(), 2, "{table:?}");
        assert_eq!(table[0].algorithm, OneShot);
        assert!(
            (table[0].up_to_bytes as f64 - cross).abs() <= 1.0,
            "{table:?}"
        );
        assert_eq!(table[1].algorithm, TwoShot);
        assert_eq!(table[1].up_to_bytes, u64::MAX);
        // Each bound is exact to the byte.
        let b = table[0].up_to_bytes;
        assert_eq!(cheapest_all_reduce(&link, 8, b as f64).0, OneShot);
        assert_eq!(cheapest_all_reduce(&link, 8, (b + 1) as f64).0, TwoShot);
        // A one-shot slower in latency never wins.
        let table = algorithm_table(&self::link(1.0), 8);
        assert_eq!(
            table,
            vec![SizeRange {
                up_to_bytes: u64::MAX,
                algorithm: TwoShot
            }]
        );
    }

    #[test]
    fn every_all_reduce_of_a_plan_gets_the_choice() {
        let mut plan = crate::cost::shipped::plan("tiny-llama", 2);
        let hw = crate::cost::shipped::profile("h100-sxm-nvswitch-8");
        choose_algorithms(&mut plan, &hw);
        let mut sites = 0;
        for r in &plan.ranks {
            for i in &r.instrs {
                if let Op::AllReduce(a) = &i.op {
                    let c = a.algorithm.as_ref().unwrap();
                    assert_eq!(c.profile, hw.name);
                    assert!(c.check().is_ok());
                    sites += 1;
                }
            }
        }
        assert!(sites >= 4, "{sites}");
        // The plan with its choices is still a valid plan.
        plan.verify().unwrap();
    }
}
