//! Norm fusion under `--numerics invariant`: a norm marked `with_reduce` runs in one step
//! with the all-reduce that feeds it, directly or through the one residual add that reads
//! the all-reduce. The step does the unfused ops' arithmetic in their order (the sum decoded
//! once, the residual added, the sum of squares of the norm), so it gives the unfused bits;
//! it hands on two values, the new residual and the normalized one, which is why it is a
//! group of instructions and not one op (the IR's ops have one output each).
//!
//! [`groups`] finds a program's groups; `Plan::verify` refuses a mark that makes none, and
//! a pipeline stage that holds only part of a group runs its ops apart (the same values).

use super::RankProgram;
pub use crate::error::fuse_norm::ReduceNormProblem;
use crate::ir::Op;
use std::collections::{HashMap, HashSet};

/// One fused step: an all-reduce, the residual add that reads it (if any), and the norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReduceNormGroup {
    pub reduce: u32,
    pub add: Option<ResidualAdd>,
    /// The norm's id and its index in the program.
    pub norm: u32,
    pub norm_at: usize,
}

/// The add of a fused step: its id and its other input, the residual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidualAdd {
    pub id: u32,
    pub residual: u32,
}

/// The groups of `program`'s marked norms, and each marked norm (by id) that makes none.
pub fn groups(program: &RankProgram) -> (Vec<ReduceNormGroup>, Vec<(u32, ReduceNormProblem)>) {
    let instrs = &program.instrs;
    let mut at: HashMap<u32, usize> = HashMap::with_capacity(instrs.len());
    let mut readers: HashMap<u32, usize> = HashMap::new();
    for (k, i) in instrs.iter().enumerate() {
        at.entry(i.id).or_insert(k);
        for &x in &i.inputs {
            *readers.entry(x).or_default() += 1;
        }
    }
    let is_reduce = |id: &u32| {
        at.get(id)
            .is_some_and(|&k| matches!(instrs[k].op, Op::AllReduce(_)))
    };
    let mut found = Vec::new();
    let mut problems = Vec::new();
    let mut used = HashSet::new();
    for (norm_at, i) in instrs.iter().enumerate() {
        let Op::RmsNorm(n) = &i.op else { continue };
        if !n.with_reduce {
            continue;
        }
        let mut refuse = |p| problems.push((i.id, p));
        if n.reduce_input.is_some() {
            refuse(ReduceNormProblem::BothFusions);
            continue;
        }
        let input = i.inputs.first().copied().unwrap_or(u32::MAX);
        let Some(&def_at) = at.get(&input) else {
            refuse(ReduceNormProblem::Missing { input });
            continue;
        };
        let def = &instrs[def_at];
        let (reduce, add) = match &def.op {
            Op::AllReduce(_) => (input, None),
            Op::Add(_) if def.inputs.len() == 2 => {
                // The all-reduce is the input whose partner was computed before it (when
                // both are all-reduces, as the first layer's add of the embedding's).
                let fits = |slot: usize| {
                    let (reduce, residual) = (def.inputs[slot], def.inputs[1 - slot]);
                    if !is_reduce(&reduce) {
                        Err(ReduceNormProblem::NotAfterReduce { input })
                    } else if readers.get(&reduce) != Some(&1) {
                        Err(ReduceNormProblem::SharedReduce { add: input, reduce })
                    } else if at.get(&residual).is_none_or(|r| r >= &at[&reduce]) {
                        Err(ReduceNormProblem::LateResidual {
                            add: input,
                            reduce,
                            residual,
                        })
                    } else {
                        Ok((reduce, slot))
                    }
                };
                let (reduce, slot) = match (fits(1), fits(0)) {
                    (Ok(found), _) | (_, Ok(found)) => found,
                    // Say what is wrong with an all-reduce input rather than the other's
                    // not being one.
                    (Err(ReduceNormProblem::NotAfterReduce { .. }), Err(problem))
                    | (Err(problem), _) => {
                        refuse(problem);
                        continue;
                    }
                };
                let add = ResidualAdd {
                    id: input,
                    residual: def.inputs[1 - slot],
                };
                (reduce, Some(add))
            }
            _ => {
                refuse(ReduceNormProblem::NotAfterReduce { input });
                continue;
            }
        };
        if !used.insert(reduce) {
            refuse(ReduceNormProblem::Repeated { reduce });
            continue;
        }
        found.push(ReduceNormGroup {
            reduce,
            add,
            norm: i.id,
            norm_at,
        });
    }
    (found, problems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::plan::Problem;
    use crate::ir::{AllReduceOp, NumericsMode};
    use crate::passes::ShardOptions;
    use crate::plan::{Plan, PlanProblem};

    fn plan(numerics: NumericsMode, fuse_norm: bool) -> Plan {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-llama.ron");
        let options = ShardOptions {
            fuse_norm,
            numerics,
            ..Default::default()
        };
        let def = crate::frontend::load::load_model(&path).unwrap();
        crate::plan::build::compile_with(&def, 2, options)
            .unwrap()
            .plan
    }

    fn id(p: &Plan, name: &str) -> u32 {
        p.ranks[0]
            .instrs
            .iter()
            .find(|i| &*i.name == name)
            .unwrap_or_else(|| panic!("no `{name}`"))
            .id
    }

    fn instr<'p>(p: &'p mut Plan, name: &str) -> &'p mut crate::plan::Instr {
        let id = id(p, name);
        p.ranks[0].instrs.iter_mut().find(|i| i.id == id).unwrap()
    }

    fn norm_op<'p>(p: &'p mut Plan, name: &str) -> &'p mut crate::ir::RmsNormOp {
        match &mut instr(p, name).op {
            Op::RmsNorm(n) => n,
            _ => panic!("`{name}` is not a norm"),
        }
    }

    /// What `Plan::verify` says of rank 0's fusions.
    fn said(p: &Plan) -> Vec<String> {
        let problems: Vec<PlanProblem> = p.verify().map_or_else(|e| e.problems, |_| Vec::new());
        problems
            .into_iter()
            .filter(|x| matches!(x.problem, Problem::ReduceNorm(_) | Problem::Numerics(_)))
            .map(|x| x.to_string())
            .collect()
    }

    const ATTN_NORM: &str = "model.layers.0.post_attention_layernorm";
    const NEXT_NORM: &str = "model.layers.1.input_layernorm";

    #[test]
    fn a_llama_makes_one_step_per_all_reduce() {
        let p = plan(NumericsMode::Invariant, true);
        p.verify().unwrap();
        let (found, problems) = groups(&p.ranks[1]);
        assert!(problems.is_empty(), "{problems:?}");
        // The embedding's all-reduce (read by the first norm and the first residual add),
        // then o_proj's and down_proj's of each layer, each through its residual add.
        assert_eq!(found.len(), 5);
        let embedding = id(&p, "model.embed_tokens.all_reduce");
        assert_eq!(found[0].reduce, embedding);
        assert_eq!(found[0].add, None);
        let attn = found.iter().find(|g| g.norm == id(&p, ATTN_NORM)).unwrap();
        assert_eq!(
            attn.reduce,
            id(&p, "model.layers.0.self_attn.o_proj.all_reduce")
        );
        let add = attn.add.unwrap();
        assert_eq!(add.id, id(&p, "model.layers.0.attn_residual"));
        // The first residual add reads two all-reduces; the residual is the earlier one.
        assert_eq!(add.residual, embedding);
        assert!(found[1..].iter().all(|g| g.add.is_some()));
        // A fast plan and an unfused invariant one have none.
        for p in [
            plan(NumericsMode::Fast, true),
            plan(NumericsMode::Invariant, false),
        ] {
            assert_eq!(groups(&p.ranks[0]), (Vec::new(), Vec::new()));
        }
    }

    #[test]
    fn a_mark_that_makes_no_step_is_refused_saying_why() {
        let good = plan(NumericsMode::Invariant, true);
        let refused = |edit: &dyn Fn(&mut Plan), what: &str| {
            let mut p = good.clone();
            edit(&mut p);
            let said = said(&p);
            assert!(said.iter().any(|s| s.contains(what)), "{what}: {said:?}");
        };
        refused(
            &|p| norm_op(p, ATTN_NORM).reduce_input = Some(AllReduceOp::default()),
            "keep one",
        );
        // `reader`'s first input rewired to `source`'s value.
        let rewired = |reader: &str, source: &str, what: &str| {
            refused(
                &|p| {
                    let from = id(p, source);
                    instr(p, reader).inputs[0] = from;
                },
                what,
            )
        };
        // The norm reads a linear's output instead.
        rewired(
            ATTN_NORM,
            "model.layers.0.self_attn.q_proj",
            "neither an all-reduce nor an add of one",
        );
        // Something else reads o_proj's all-reduce too.
        rewired(
            "model.layers.0.mlp_residual",
            "model.layers.0.self_attn.o_proj.all_reduce",
            "is also read by something else",
        );
        // Two norms join one all-reduce.
        rewired(
            NEXT_NORM,
            "model.layers.0.attn_residual",
            "which another marked norm joins already",
        );
        refused(
            &|p| instr(p, ATTN_NORM).inputs[0] = 9999,
            "which this rank does not compute",
        );
        // Each mode's fusion only.
        let mut fast = good.clone();
        fast.numerics = NumericsMode::Fast;
        fast.source = None;
        assert!(said(&fast)
            .iter()
            .any(|s| s.contains("a plan of fast numerics")));
        let mut fast_fusion = plan(NumericsMode::Fast, true);
        fast_fusion.numerics = NumericsMode::Invariant;
        fast_fusion.source = None;
        assert!(said(&fast_fusion)
            .iter()
            .any(|s| s.contains("keeps the residual stream as partial sums")));
    }
}
