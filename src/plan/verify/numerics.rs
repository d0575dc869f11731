//! An invariant plan's own promises (`--numerics invariant`): every rank's partial sum of a
//! linear is added exactly (its linear has exact blocks, which every rank's slice of the
//! depth respects) and reaches nothing but a collective, and the ranks fit the limbs.

use super::Found;
use crate::error::fuse_norm::ReduceNormProblem;
use crate::error::plan::{Place, Problem};
use crate::ir::numerics::MAX_INVARIANT_RANKS;
use crate::ir::{Layout, NumericsMode, Op};
use crate::plan::{Plan, RankProgram};
use std::collections::HashMap;

pub(super) fn check_numerics(plan: &Plan, found: &mut Found) {
    check_norm_fusions(plan, found);
    if plan.numerics != NumericsMode::Invariant {
        return;
    }
    if plan.tp > MAX_INVARIANT_RANKS {
        found.say(
            Place::Plan,
            Problem::Numerics(format!(
                "tp {} is more ranks than the exact sums' limbs hold ({MAX_INVARIANT_RANKS})",
                plan.tp
            )),
        );
    }
    for (rank, program) in plan.ranks.iter().enumerate() {
        check_rank(plan.tp, rank, program, found);
    }
}

fn check_rank(tp: u64, rank: usize, program: &RankProgram, found: &mut Found) {
    let by_id: HashMap<u32, &crate::plan::Instr> =
        program.instrs.iter().map(|i| (i.id, i)).collect();
    let place = |i: &crate::plan::Instr| Place::Instr {
        rank,
        id: i.id,
        name: i.name.clone(),
    };
    for i in &program.instrs {
        // Whatever reads a partial sum of a linear must be the collective that adds it.
        for &input in &i.inputs {
            let Some(from) = by_id.get(&input) else {
                continue;
            };
            let partial =
                tp > 1 && from.layout == Layout::Partial && matches!(from.op, Op::Linear(_));
            if partial && !matches!(i.op, Op::AllReduce(_) | Op::ReduceScatter(_)) {
                found.say(
                    place(i),
                    Problem::Numerics(format!(
                        "reads `{}`'s partial sum; only an all-reduce or a reduce-scatter may (they add the exact sums)",
                        from.name
                    )),
                );
            }
        }
        let Op::Linear(l) = &i.op else { continue };
        let Some(exact) = l.exact else {
            if tp > 1 && i.layout == Layout::Partial {
                found.say(
                    place(i),
                    Problem::Numerics(
                        "a partial sum whose linear has no exact blocks; recompile the model"
                            .into(),
                    ),
                );
            }
            continue;
        };
        let slice = i
            .inputs
            .get(1)
            .and_then(|w| by_id.get(w))
            .and_then(|w| match &w.op {
                Op::Param(p) => program.weights.iter().find(|s| s.tensor == p.tensor),
                _ => None,
            });
        let Some(slice) = slice else { continue };
        let in_dim = l.weight_order.in_dim();
        let depth = slice.shape.get(in_dim as usize).copied().unwrap_or(0);
        if exact.block == 0 || exact.block.checked_mul(exact.blocks) != Some(depth) {
            found.say(
                place(i),
                Problem::Numerics(format!(
                    "{} exact blocks of {} do not make the weight's depth of {depth}",
                    exact.blocks, exact.block
                )),
            );
            continue;
        }
        if slice.dim == Some(in_dim) {
            let cut = slice
                .ranges
                .iter()
                .find(|r| r.offset % exact.block != 0 || r.len % exact.block != 0);
            if let Some(r) = cut {
                found.say(
                    place(i),
                    Problem::Numerics(format!(
                        "this rank's inputs {}..{} cut an exact block of {}",
                        r.offset,
                        r.offset.saturating_add(r.len),
                        exact.block
                    )),
                );
            }
        }
    }
}

/// Each mode's norm fusion only: the fast one (`reduce_input`) keeps the residual stream as
/// partial sums, which an invariant plan cannot; the invariant one (`with_reduce`) belongs
/// to invariant plans.
fn check_norm_fusions(plan: &Plan, found: &mut Found) {
    let invariant = plan.numerics == NumericsMode::Invariant;
    for (rank, program) in plan.ranks.iter().enumerate() {
        for i in &program.instrs {
            let Op::RmsNorm(n) = &i.op else { continue };
            let place = || Place::Instr {
                rank,
                id: i.id,
                name: i.name.clone(),
            };
            if invariant && n.reduce_input.is_some() {
                found.say(
                    place(),
                    Problem::Numerics(
                        "a norm fused with its all-reduce the fast way (`reduce_input`) keeps the residual stream as partial sums, which round differently at each tp; compile with --numerics invariant again"
                            .into(),
                    ),
                );
            }
            if !invariant && n.with_reduce {
                found.say(place(), Problem::ReduceNorm(ReduceNormProblem::FastPlan));
            }
        }
    }
}
