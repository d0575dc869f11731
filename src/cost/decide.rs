//! Plan-wide choices made by cost: sequence parallelism is compiled both ways and the
//! cheaper plan for a workload on a hardware profile is kept.
//!
//! Why a whole-workload price: a plan serves the prefill *and* every decode step. Sequence
//! parallelism moves the same bytes as the all-reduces it replaces (a ring all-reduce is a
//! reduce-scatter plus an all-gather) and divides the token-wise work (residual adds, norms)
//! by tp, which pays in a long prefill; in a decode step it adds a second collective latency
//! per site and pads the step's few rows to a multiple of tp. Which side wins depends on
//! the prompt, the number of new tokens and the profile's α, so the decision prices
//! `prefill + gen × decode step` for both plans.

use crate::cost::prefer::{better_first, Price};
use crate::cost::profile::HwProfile;
use crate::cost::simulate::{simulate_as, Estimate, Numerics, Workload};
use crate::error::Result;
use crate::frontend::ModelDef;
use crate::passes::ShardOptions;
use crate::pipeline::{compile_with, Compiled};
use crate::plan::Plan;
use serde::Serialize;
use std::cmp::Ordering;

/// What the cost model weighed for sequence parallelism, and what it chose.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SequenceParallelDecision {
    /// True when the plan kept is the sequence-parallel one.
    pub chosen: bool,
    /// Seconds for the workload with and without sequence parallelism.
    pub with_s: f64,
    pub without_s: f64,
    pub batch: u64,
    pub prompt: u64,
    pub gen: u64,
    pub hw: String,
}

impl SequenceParallelDecision {
    /// One line for the plan's notes and the report.
    pub fn note(&self) -> String {
        format!(
            "sequence parallelism {} by cost on {}: {:.3} ms with, {:.3} ms without, for batch {}, prompt {}, {} new tokens (prefill + each decode step)",
            if self.chosen { "chosen" } else { "not chosen" },
            self.hw,
            self.with_s * 1e3,
            self.without_s * 1e3,
            self.batch,
            self.prompt,
            self.gen
        )
    }
}

/// Collectives a forward pass of `plan` runs.
fn collectives(plan: &Plan) -> u64 {
    plan.collectives.len() as u64
}

/// True when the sequence-parallel plan is preferred to the plain one: cheaper, or as cheap
/// with fewer collectives ([`better_first`]); a full tie keeps the plain plan.
pub fn keeps_split(split: Price, plain: Price) -> bool {
    better_first(&split, &plain) == Ordering::Less
}

/// Seconds the estimate gives for the whole workload: the prefill and `gen` decode steps.
pub fn workload_seconds(e: &Estimate, work: Workload) -> f64 {
    e.prefill.time_s + work.gen as f64 * e.decode_step.time_s
}

/// Compiles `def` for `tp` ranks with and without sequence parallelism (the rest of
/// `options` as given), prices both for `work` on `hw` with the number types `numerics`
/// gives for a plan, and returns the preferred plan ([`keeps_split`]) and the decision.
/// At tp 1 there is nothing to split: the plain plan, no decision.
pub fn compile_choosing_sequence_parallel(
    def: &ModelDef,
    tp: u64,
    options: ShardOptions,
    hw: &HwProfile,
    work: Workload,
    numerics: impl Fn(&Plan) -> Numerics,
) -> Result<(Compiled, Option<SequenceParallelDecision>)> {
    let plain = compile_with(
        def,
        tp,
        ShardOptions {
            sequence_parallel: false,
            ..options
        },
    )?;
    if tp == 1 {
        return Ok((plain, None));
    }
    let split = compile_with(
        def,
        tp,
        ShardOptions {
            sequence_parallel: true,
            ..options
        },
    )?;
    let price =
        |c: &Compiled| workload_seconds(&simulate_as(&c.plan, hw, work, numerics(&c.plan)), work);
    let (without_s, with_s) = (price(&plain), price(&split));
    let decision = SequenceParallelDecision {
        chosen: keeps_split(
            Price {
                seconds: with_s,
                collectives: collectives(&split.plan),
            },
            Price {
                seconds: without_s,
                collectives: collectives(&plain.plan),
            },
        ),
        with_s,
        without_s,
        batch: work.batch,
        prompt: work.prompt,
        gen: work.gen,
        hw: hw.name.clone(),
    };
    let mut kept = if decision.chosen { split } else { plain };
    kept.plan.notes.push(decision.note());
    Ok((kept, Some(decision)))
}

/// What the cost model weighed for splitting a mixture of experts (`--moe auto`), and
/// what it chose.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExpertSplitDecision {
    /// `tensor` or `expert`.
    pub chosen: &'static str,
    /// Seconds for the workload with the experts split by features and dealt whole.
    pub tensor_s: f64,
    pub expert_s: f64,
    pub batch: u64,
    pub prompt: u64,
    pub gen: u64,
    pub hw: String,
}

impl ExpertSplitDecision {
    /// One line for the plan's notes and the report.
    pub fn note(&self) -> String {
        format!(
            "experts split by {} by cost on {}: {:.3} ms by features (tensor), {:.3} ms dealt whole (expert), for batch {}, prompt {}, {} new tokens",
            self.chosen,
            self.hw,
            self.tensor_s * 1e3,
            self.expert_s * 1e3,
            self.batch,
            self.prompt,
            self.gen
        )
    }
}

/// The choices the cost model made for a plan.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Decisions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sequence_parallel: Option<SequenceParallelDecision>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertSplitDecision>,
}

/// Compiles `def` (a mixture of experts) for `tp` ranks with its experts split by features
/// and dealt whole, each through `compile` (which may make its own choices), prices both
/// for `work` on `hw`, and keeps the cheaper; a tie keeps the split by features, whose
/// ranks share every token's work evenly. At tp 1 there is nothing to split: by features.
pub fn compile_choosing_expert_split(
    def: &ModelDef,
    tp: u64,
    hw: &HwProfile,
    work: Workload,
    numerics: impl Fn(&Plan) -> Numerics,
    compile: impl Fn(&ModelDef) -> Result<(Compiled, Decisions)>,
) -> Result<(Compiled, Decisions)> {
    let by_features = def.with_expert_split(crate::ir::ExpertSplit::Tensor)?;
    let (tensor, mut tensor_decisions) = compile(&by_features)?;
    if tp == 1 {
        return Ok((tensor, tensor_decisions));
    }
    let (expert, expert_decisions) =
        compile(&def.with_expert_split(crate::ir::ExpertSplit::Expert)?)?;
    let price =
        |c: &Compiled| workload_seconds(&simulate_as(&c.plan, hw, work, numerics(&c.plan)), work);
    let (tensor_s, expert_s) = (price(&tensor), price(&expert));
    let dealt = expert_s < tensor_s;
    let decision = ExpertSplitDecision {
        chosen: if dealt { "expert" } else { "tensor" },
        tensor_s,
        expert_s,
        batch: work.batch,
        prompt: work.prompt,
        gen: work.gen,
        hw: hw.name.clone(),
    };
    let (mut kept, mut decisions) = if dealt {
        (expert, expert_decisions)
    } else {
        (tensor, std::mem::take(&mut tensor_decisions))
    };
    kept.plan.notes.push(decision.note());
    decisions.experts = Some(decision);
    Ok((kept, decisions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::shipped;

    fn llama8b() -> ModelDef {
        shipped::model("llama3-8b")
    }

    fn nvswitch() -> HwProfile {
        shipped::profile("h100-sxm-nvswitch-8")
    }

    fn decide(work: Workload) -> (Compiled, SequenceParallelDecision) {
        let (c, d) = compile_choosing_sequence_parallel(
            &llama8b(),
            8,
            ShardOptions::default(),
            &nvswitch(),
            work,
            Numerics::of_plan,
        )
        .unwrap();
        (c, d.unwrap())
    }

    fn has_reduce_scatter(plan: &Plan) -> bool {
        plan.collectives.iter().any(|c| c.kind == "reduce_scatter")
    }

    #[test]
    fn a_long_prompt_chooses_sequence_parallelism_and_a_long_generation_does_not() {
        let long_prompt = Workload {
            batch: 8,
            prompt: 8192,
            gen: 1,
        };
        let (c, d) = decide(long_prompt);
        assert!(d.chosen, "{}", d.note());
        assert!(d.with_s < d.without_s);
        assert!(has_reduce_scatter(&c.plan));
        assert!(c.plan.notes.iter().any(|n| n == &d.note()));

        let chat = Workload {
            batch: 1,
            prompt: 16,
            gen: 1024,
        };
        let (c, d) = decide(chat);
        assert!(!d.chosen, "{}", d.note());
        assert!(d.with_s > d.without_s);
        assert!(!has_reduce_scatter(&c.plan));
    }

    #[test]
    fn a_tie_keeps_the_plan_with_fewer_collectives() {
        // llama3-8b at tp 8: the split plan runs a reduce-scatter and an all-gather where
        // the plain one runs one all-reduce.
        let plain = compile_with(&llama8b(), 8, ShardOptions::default()).unwrap();
        let split = compile_with(
            &llama8b(),
            8,
            ShardOptions {
                sequence_parallel: true,
                ..ShardOptions::default()
            },
        )
        .unwrap();
        let (p, s) = (collectives(&plain.plan), collectives(&split.plan));
        assert!(s > p, "{s} {p}");
        let at = |seconds, collectives| Price {
            seconds,
            collectives,
        };
        assert!(!keeps_split(at(1e-3, s), at(1e-3, p)));
        // Were the split plan the one with fewer collectives, the tie would keep it.
        assert!(keeps_split(at(1e-3, p), at(1e-3, s)));
        // A full tie keeps the plain plan.
        assert!(!keeps_split(at(1e-3, p), at(1e-3, p)));
        // Cheaper wins whatever it communicates.
        assert!(keeps_split(at(0.9e-3, s), at(1e-3, p)));
    }

    #[test]
    fn the_expert_split_is_chosen_by_the_workload() {
        let def = shipped::model("qwen3-30b-a3b");
        let choose = |work: Workload, op_overhead_s: f64| {
            let mut hw = nvswitch();
            hw.op_overhead_s = op_overhead_s;
            compile_choosing_expert_split(&def, 8, &hw, work, Numerics::of_plan, |d| {
                Ok((
                    compile_with(d, 8, ShardOptions::default())?,
                    Decisions::default(),
                ))
            })
            .unwrap()
        };
        // One conversation, kernels free: a token's 8 experts land unevenly on 8 ranks, so
        // every rank reading an eighth of each is faster. (With a cost per kernel, the
        // fewer kernels of a deal can win even here: the runtime launches per expert.)
        let (c, d) = choose(
            Workload {
                batch: 1,
                prompt: 16,
                gen: 256,
            },
            0.0,
        );
        let d = d.experts.unwrap();
        assert_eq!(d.chosen, "tensor", "{}", d.note());
        assert!(d.tensor_s < d.expert_s);
        assert!(c.plan.notes.contains(&d.note()));
        // A large batch of long prompts uses every expert on every rank: dealing them
        // runs an eighth of the kernels.
        let (c, d) = choose(
            Workload {
                batch: 64,
                prompt: 2048,
                gen: 1,
            },
            5e-6,
        );
        let d = d.experts.unwrap();
        assert_eq!(d.chosen, "expert", "{}", d.note());
        let dealt = c.plan.ranks[0]
            .weights
            .iter()
            .find(|w| crate::plan::experts::is_stacked(&w.tensor))
            .unwrap();
        assert_eq!(dealt.dim, Some(0));
    }

    #[test]
    fn the_price_is_the_prefill_plus_every_decode_step() {
        let work = Workload {
            batch: 2,
            prompt: 100,
            gen: 7,
        };
        let plan = compile_with(&llama8b(), 8, ShardOptions::default())
            .unwrap()
            .plan;
        let e = simulate_as(&plan, &nvswitch(), work, Numerics::of_plan(&plan));
        let want = e.prefill.time_s + 7.0 * e.decode_step.time_s;
        assert!((workload_seconds(&e, work) - want).abs() <= 1e-12 * want);
        let (_, d) = decide(work);
        assert!((d.without_s - want).abs() <= 1e-9 * want);
    }
}
