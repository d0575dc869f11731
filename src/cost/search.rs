//! `simulate --search`: every (tp, pp) layout a profile's devices hold, priced and ranked;
//! for a mixture of experts also every tp × pp × dp with each stage's experts dealt over
//! the dp replicas (`--pp P --dp D --ep`), the workload's batch then being the whole
//! deployment's.
//!
//! Bounded by what tpc plans, whatever the profile's device count: tp up to
//! [`MAX_TP`](crate::passes::feasibility::MAX_TP) and only the values the model splits into,
//! pp up to the model's layers and [`MAX_PP`](crate::plan::stages::MAX_PP), tp·pp up to the
//! devices. So at most a few thousand layouts; each plan is compiled once and its stage
//! splits for every pp balanced in one pass, which keeps a search over a million devices
//! to seconds.

use super::profile::HwProfile;
use super::simulate::{Estimate, Numerics, StagedPlan, Workload};
use crate::error::TpcError;
use crate::passes::feasibility::MAX_TP;
use crate::plan::stages::MAX_PP;
use crate::plan::Plan;

/// Every feasible (tp, pp) with tp·pp at most `hw.devices`, unranked, in tp then pp order.
/// `compile` makes the plan for one tp; a tp it refuses is left out, and when it says which
/// tp values the model takes (an infeasible split), only those are tried after it.
/// `progress` is told each tp as its plan is priced, with the largest tp to be tried.
/// Where `experts_span(plan)` (its experts can be dealt over replicas), each tp is also
/// priced with D = 2.. replicas sharing the experts, each of P = 1.. stages dealing its
/// layers' experts over the same stage of the others, for every D that divides the batch
/// (`work.batch / D` sequences a replica: the same sequences in all, so the throughputs
/// compare) with tp · P · D at most the devices.
pub fn search(
    hw: &HwProfile,
    work: Workload,
    mut compile: impl FnMut(u64) -> Result<Plan, TpcError>,
    numerics: impl Fn(&Plan) -> Numerics,
    experts_span: impl Fn(&Plan) -> bool,
    mut progress: impl FnMut(u64, u64),
) -> Vec<Estimate> {
    let max_tp = hw.devices.min(MAX_TP);
    let mut candidates: Vec<u64> = (1..=max_tp).collect();
    let mut estimates = Vec::new();
    let mut next = 0;
    while let Some(&tp) = candidates.get(next) {
        next += 1;
        let plan = match compile(tp) {
            Ok(plan) => plan,
            Err(TpcError::Infeasible { valid, .. }) => {
                // The split's constraints hold for every tp alike: skip to those it allows.
                candidates.retain(|&t| t <= tp || valid.contains(&t));
                continue;
            }
            Err(_) => continue,
        };
        progress(tp, candidates.last().copied().unwrap_or(tp));
        let max_pp = (hw.devices / tp).min(MAX_PP);
        let num = numerics(&plan);
        let staged = StagedPlan::new(&plan, max_pp, num);
        let spans = experts_span(&plan);
        for pp in 1..=max_pp {
            // Past the layers (or the stages tpc cuts) every larger pp fails alike.
            match staged.estimate(hw, work, num, pp) {
                Ok(e) => estimates.push(e),
                Err(_) => break,
            }
            if spans {
                estimates.extend(expert_replicas(&staged, tp, pp, hw, work, num));
            }
        }
    }
    estimates
}

/// `pp` stages of a tp `tp` plan on 2.. replicas sharing their experts: every D dividing
/// the batch with tp · pp · D at most the devices, each replica `work.batch / D` sequences.
fn expert_replicas(
    staged: &StagedPlan,
    tp: u64,
    pp: u64,
    hw: &HwProfile,
    work: Workload,
    num: Numerics,
) -> Vec<Estimate> {
    let most = hw.devices / tp.max(1).saturating_mul(pp.max(1));
    (2..=most.min(work.batch))
        .filter(|dp| work.batch.is_multiple_of(*dp))
        .filter_map(|dp| {
            let per_replica = Workload {
                batch: work.batch / dp,
                ..work
            };
            staged
                .estimate_sharing_experts(hw, per_replica, num, pp, dp)
                .ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::shipped;
    use crate::cost::simulate::{simulate_pp, simulate_pp_sharing_experts};

    fn work() -> Workload {
        Workload {
            batch: 1,
            prompt: 128,
            gen: 128,
        }
    }

    #[test]
    fn every_layout_is_the_one_simulate_prices_alone() {
        let hw = shipped::profile("h100-sxm-nvswitch-8");
        let def = shipped::model("llama3-8b");
        let found = search(
            &hw,
            work(),
            |tp| crate::pipeline::compile(&def, tp).map(|c| c.plan),
            Numerics::of_plan,
            |_| false,
            |_, _| {},
        );
        // 32 heads, 8 kv heads, 32 layers, 8 devices: every tp up to 8 (3, 5, 6 and 7 deal
        // the kv groups unevenly) and pp up to 8 / tp.
        let layouts: Vec<(u64, u64)> = found.iter().map(|e| (e.tp, e.pp)).collect();
        let mut expected = Vec::new();
        for tp in 1u64..=8 {
            expected.extend((1..=8 / tp).map(|pp| (tp, pp)));
        }
        assert_eq!(layouts, expected);
        for e in &found {
            let plan = crate::pipeline::compile(&def, e.tp).unwrap().plan;
            let alone = simulate_pp(&plan, &hw, work(), Numerics::of_plan(&plan), e.pp).unwrap();
            assert_eq!(e, &alone);
        }
    }

    #[test]
    fn a_million_devices_try_only_the_tp_values_the_model_takes() {
        let mut hw = shipped::profile("h100-sxm-nvswitch-8");
        hw.devices = 1 << 20;
        let def = shipped::model("tiny-llama");
        let mut compiled = Vec::new();
        let found = search(
            &hw,
            work(),
            |tp| {
                compiled.push(tp);
                crate::pipeline::compile(&def, tp).map(|c| c.plan)
            },
            Numerics::of_plan,
            |_| false,
            |_, _| {},
        );
        // 8 heads in 2 kv groups: every tp up to 8 (unevenly where 8 does not divide); 9 is
        // the first it refuses (more ranks than query heads), and after it nothing else is
        // compiled.
        assert_eq!(compiled, (1..=9).collect::<Vec<u64>>());
        let layouts: Vec<(u64, u64)> = found.iter().map(|e| (e.tp, e.pp)).collect();
        let expected: Vec<(u64, u64)> = (1..=8).flat_map(|tp| [(tp, 1), (tp, 2)]).collect();
        assert_eq!(layouts, expected);
    }

    #[test]
    fn a_mixture_of_experts_is_also_priced_on_replicas_sharing_its_experts() {
        let hw = shipped::profile("h100-sxm-nvswitch-8");
        let def = shipped::model("qwen3-30b-a3b");
        let work = Workload {
            batch: 8,
            prompt: 512,
            gen: 128,
        };
        let spans = |p: &Plan| p.why_experts_cannot_span_replicas().is_none();
        let found = search(
            &hw,
            work,
            |tp| crate::pipeline::compile(&def, tp).map(|c| c.plan),
            Numerics::of_plan,
            spans,
            |_, _| {},
        );
        // Every dp dividing the batch of 8 with tp · pp · dp at most 8, each stage sharing
        // its layers' experts with the same stage of the other replicas.
        let mut replicas: Vec<(u64, u64, u64)> = found
            .iter()
            .filter(|e| e.dp > 1)
            .map(|e| (e.tp, e.pp, e.dp))
            .collect();
        replicas.sort();
        assert_eq!(
            replicas,
            [
                (1, 1, 2),
                (1, 1, 4),
                (1, 1, 8),
                (1, 2, 2),
                (1, 2, 4),
                (1, 3, 2),
                (1, 4, 2),
                (2, 1, 2),
                (2, 1, 4),
                (2, 2, 2),
                (3, 1, 2),
                (4, 1, 2)
            ]
        );
        for e in found.iter().filter(|e| e.dp > 1) {
            let plan = crate::pipeline::compile(&def, e.tp).unwrap().plan;
            let per_replica = Workload {
                batch: 8 / e.dp,
                ..work
            };
            let num = Numerics::of_plan(&plan);
            let alone = simulate_pp_sharing_experts(&plan, &hw, per_replica, num, e.pp, e.dp);
            assert_eq!(e, &alone.unwrap(), "tp {} pp {} dp {}", e.tp, e.pp, e.dp);
        }
        // Eight replicas of one rank hold an eighth of the experts each.
        let get = |tp, dp| {
            found
                .iter()
                .find(|e| e.tp == tp && e.dp == dp && e.pp == 1)
                .unwrap()
        };
        assert!(get(1, 8).weight_bytes_per_rank < get(1, 1).weight_bytes_per_rank);
        // A dense model, or a batch of one, gets no replicas.
        let one = search(
            &hw,
            Workload { batch: 1, ..work },
            |tp| crate::pipeline::compile(&def, tp).map(|c| c.plan),
            Numerics::of_plan,
            spans,
            |_, _| {},
        );
        assert!(one.iter().all(|e| e.dp == 1));
        let dense = shipped::model("llama3-8b");
        let dense_found = search(
            &hw,
            work,
            |tp| crate::pipeline::compile(&dense, tp).map(|c| c.plan),
            Numerics::of_plan,
            spans,
            |_, _| {},
        );
        assert!(dense_found.iter().all(|e| e.dp == 1));
    }
}
