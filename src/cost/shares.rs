//! `simulate --search` on unequal devices: which `--tp-shares` to give ranks whose devices
//! run at the profile's `rank_speeds`. Shares in proportion to the speeds (memory and,
//! where they differ, compute) are the first guesses; since atoms round, their neighbours
//! are priced too and the fastest decode wins.

use super::profile::HwProfile;
use super::rank_speed::RankSpeed;
use super::simulate::{simulate_as, Estimate, Numerics, Workload};
use crate::error::TpcError;
use crate::ir::saturating::gcd;
use crate::ir::shares::MAX_SHARE;
use crate::ir::TpShares;
use crate::plan::Plan;
use serde::Serialize;

/// The shares proposed for unequal devices, with what the even split gives.
#[derive(Debug, Clone, Serialize)]
pub struct SharesProposal {
    /// The shares, or `None` when the even split is best.
    pub shares: Option<TpShares>,
    pub estimate: Estimate,
    pub even: Estimate,
}

/// The candidate shares for `speeds`: proportional ones at scales 1 to 8 (the slowest rank
/// 1 to 8), each rank's share also one up and one down; distinct ratios only, even left out.
pub fn candidates(speeds: &[f64]) -> Vec<TpShares> {
    let slowest = speeds.iter().copied().fold(f64::INFINITY, f64::min);
    let mut out: Vec<TpShares> = Vec::new();
    let mut push = |parts: Vec<u64>| {
        let g = parts.iter().copied().fold(0, gcd);
        let parts: Vec<u64> = parts.iter().map(|p| p / g.max(1)).collect();
        if let Ok(s) = TpShares::new(&parts) {
            if !s.is_even() && !out.contains(&s) {
                out.push(s);
            }
        }
    };
    for scale in 1..=8u64 {
        let base: Vec<u64> = speeds
            .iter()
            .map(|s| {
                ((s / slowest) * scale as f64)
                    .round()
                    .clamp(1.0, f64::from(MAX_SHARE)) as u64
            })
            .collect();
        push(base.clone());
        if scale <= 2 {
            for r in 0..base.len() {
                for delta in [-1i64, 1] {
                    let mut next = base.clone();
                    next[r] = (next[r] as i64 + delta).max(1) as u64;
                    push(next);
                }
            }
        }
    }
    out
}

/// The candidates for the memory speeds (decode's pace), then those the compute speeds
/// add where a rank's two differ.
fn speed_candidates(speeds: &[RankSpeed]) -> Vec<TpShares> {
    let memory: Vec<f64> = speeds.iter().map(|s| s.memory).collect();
    let compute: Vec<f64> = speeds.iter().map(|s| s.compute).collect();
    let mut out = candidates(&memory);
    for s in candidates(&compute) {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Prices the even split and every candidate for the profile's `rank_speeds` (one rank
/// each), and returns the fastest decode; `compile` makes the plan for given shares (`None`:
/// even). Candidates the model refuses are skipped; the even split must compile.
pub fn propose_shares(
    hw: &HwProfile,
    work: Workload,
    mut compile: impl FnMut(Option<TpShares>) -> Result<Plan, TpcError>,
    numerics: impl Fn(&Plan) -> Numerics,
) -> Result<SharesProposal, TpcError> {
    let price = |plan: &Plan| simulate_as(plan, hw, work, numerics(plan));
    let even = price(&compile(None)?);
    let mut best: Option<(TpShares, Estimate)> = None;
    for shares in speed_candidates(&hw.rank_speeds) {
        let Ok(plan) = compile(Some(shares)) else {
            continue;
        };
        let e = price(&plan);
        if best
            .as_ref()
            .is_none_or(|(_, b)| e.tokens_per_s.decode > b.tokens_per_s.decode)
        {
            best = Some((shares, e));
        }
    }
    Ok(match best {
        Some((shares, estimate)) if estimate.tokens_per_s.decode > even.tokens_per_s.decode => {
            SharesProposal {
                shares: Some(shares),
                estimate,
                even,
            }
        }
        _ => SharesProposal {
            shares: None,
            estimate: even.clone(),
            even,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_the_speeds_and_their_neighbours() {
        let c: Vec<String> = candidates(&[1.0, 0.25])
            .iter()
            .map(|s| s.to_string())
            .collect();
        // Proportional (4,1 at every scale), and one step either way at scales 1 and 2.
        assert_eq!(c[0], "4,1");
        for s in ["3,1", "5,1", "2,1", "7,2", "9,2"] {
            assert!(c.contains(&s.to_string()), "{s} in {c:?}");
        }
        assert!(!c.contains(&"1,1".to_string()));
        // Equal speeds: only the neighbours of the even split.
        let c: Vec<String> = candidates(&[2.0, 2.0])
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(c.contains(&"2,1".to_string()) && c.contains(&"1,2".to_string()));
    }
}
