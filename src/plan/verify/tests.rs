//! Every check of `Plan::verify`, each on a real compiled plan corrupted in one way.

use super::*;
use crate::error::PlanProblem;
use crate::ir::{AddOp, AllGatherOp, DType, Groups, SliceRange};
use std::path::Path;

fn models_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models")
}

fn compiled(model: &str, tp: u64) -> Plan {
    let def = crate::frontend::load::load_model(&models_dir().join(format!("{model}.ron")))
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    crate::plan::build::compile(&def, tp)
        .unwrap_or_else(|e| panic!("{model} tp={tp}: {e}"))
        .plan
}

/// tiny-llama at tp=2: vocab-split embedding, column and row linears, all-reduces and
/// the LM head's all-gather.
fn llama2() -> Plan {
    compiled("tiny-llama", 2)
}

fn problems(plan: &Plan) -> Vec<PlanProblem> {
    plan.verify()
        .expect_err("the corrupted plan must not verify")
        .problems
}

/// Position of the instruction called `name` on `rank`.
fn at(plan: &Plan, rank: usize, name: &str) -> usize {
    plan.ranks[rank]
        .instrs
        .iter()
        .position(|i| &*i.name == name)
        .unwrap_or_else(|| panic!("no `{name}` on rank {rank}"))
}

fn iplace(plan: &Plan, rank: usize, index: usize) -> Place {
    instr_place(rank, &plan.ranks[rank].instrs[index])
}

fn weight(plan: &Plan, rank: usize, tensor: &str) -> usize {
    plan.ranks[rank]
        .weights
        .iter()
        .position(|w| &*w.tensor == tensor)
        .unwrap_or_else(|| panic!("no weight `{tensor}` on rank {rank}"))
}

fn wplace(rank: usize, tensor: &str) -> Place {
    Place::Weight {
        rank,
        tensor: tensor.into(),
    }
}

/// The plan fails with exactly these problems, in this order.
fn expect_exactly(plan: &Plan, want: Vec<(Place, Problem)>) {
    let got = problems(plan);
    let want: Vec<PlanProblem> = want
        .into_iter()
        .map(|(place, problem)| PlanProblem { place, problem })
        .collect();
    assert_eq!(got, want, "got:\n{}", list(&got));
}

/// The plan fails with (at least) this problem.
fn expect_has(plan: &Plan, place: Place, problem: Problem) {
    let got = problems(plan);
    let want = PlanProblem { place, problem };
    assert!(got.contains(&want), "missing: {want}\ngot:\n{}", list(&got));
}

fn list(p: &[PlanProblem]) -> String {
    p.iter().map(|p| format!("  {p}\n")).collect()
}

const DOWN: &str = "model.layers.0.mlp.down_proj";
const DOWN_W: &str = "model.layers.0.mlp.down_proj.weight";

#[test]
fn every_compiled_plan_verifies_clean() {
    let mut tiny: Vec<String> = std::fs::read_dir(models_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("tiny-") && n.ends_with(".ron"))
        .map(|n| n.trim_end_matches(".ron").to_string())
        .collect();
    tiny.sort();
    assert!(tiny.len() >= 6, "tiny models: {tiny:?}");
    let mut cases: Vec<(String, u64)> = tiny
        .iter()
        .flat_map(|m| [1, 2, 4].map(|tp| (m.clone(), tp)))
        .collect();
    cases.push(("tinyllama-1.1b".into(), 8));
    cases.push(("llama3-70b".into(), 8));
    for (model, tp) in cases {
        let plan = compiled(&model, tp);
        assert_eq!(plan.ranks.len() as u64, tp);
        if let Err(e) = plan.verify() {
            panic!("{model} tp={tp}: {e}");
        }
    }
}

// 1. Header.

#[test]
fn wrong_version_is_reported() {
    let mut plan = llama2();
    plan.version = 7;
    expect_exactly(
        &plan,
        vec![(
            Place::Plan,
            Problem::Version {
                found: 7,
                expected: PLAN_VERSION,
            },
        )],
    );
}

#[test]
fn tp_must_match_the_rank_programs() {
    let mut plan = llama2();
    plan.ranks.pop();
    plan.collectives.clear();
    // Rank 0 alone still issues its collectives, now unlisted; the count is what matters.
    expect_has(&plan, Place::Plan, Problem::RankCount { tp: 2, ranks: 1 });
    let mut plan = llama2();
    plan.tp = 0;
    let got = problems(&plan);
    assert_eq!(got[0].problem, Problem::ZeroTp, "{}", list(&got));
    assert_eq!(got[1].problem, Problem::RankCount { tp: 0, ranks: 2 });
}

#[test]
fn ranks_must_be_numbered_in_order() {
    let mut plan = llama2();
    plan.ranks[1].rank = 0;
    expect_exactly(
        &plan,
        vec![(
            Place::Rank { rank: 1 },
            Problem::RankNumber { index: 1, found: 0 },
        )],
    );
}

// 2. Program structure.

#[test]
fn duplicate_ids_are_reported() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    let first_id = plan.ranks[1].instrs[down - 1].id;
    plan.ranks[1].instrs[down].id = first_id;
    expect_has(
        &plan,
        iplace(&plan, 1, down),
        Problem::DuplicateId {
            id: first_id,
            first: down - 1,
        },
    );
}

#[test]
fn dangling_inputs_are_reported() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    plan.ranks[1].instrs[down].inputs[0] = 999_999;
    expect_exactly(
        &plan,
        vec![(
            iplace(&plan, 1, down),
            Problem::UndefinedInput {
                slot: 0,
                input: 999_999,
            },
        )],
    );
}

#[test]
fn use_before_def_is_reported() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    let later = plan.ranks[1].instrs[down + 1].id;
    plan.ranks[1].instrs[down].inputs[0] = later;
    expect_exactly(
        &plan,
        vec![(
            iplace(&plan, 1, down),
            Problem::UseBeforeDef {
                slot: 0,
                input: later,
                defined_at: down + 1,
                index: down,
            },
        )],
    );
}

#[test]
fn arity_is_checked_and_params_take_no_inputs() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    let w = at(&plan, 1, DOWN_W);
    plan.ranks[1].instrs[down].inputs.pop();
    plan.ranks[1].instrs[w].inputs.push(0);
    let got = problems(&plan);
    let arity = |index, kind, expected, found| PlanProblem {
        place: iplace(&plan, 1, index),
        problem: Problem::Arity {
            kind,
            expected,
            found,
        },
    };
    assert!(got.contains(&arity(w, "param", 0, 1)), "{}", list(&got));
    assert!(got.contains(&arity(down, "linear", 2, 1)), "{}", list(&got));
}

#[test]
fn exactly_one_output_per_rank() {
    let output = |plan: &Plan, r: usize| {
        plan.ranks[r]
            .instrs
            .iter()
            .position(|i| matches!(i.op, Op::Output(_)))
            .unwrap()
    };
    let mut plan = llama2();
    let out = output(&plan, 0);
    plan.ranks[0].instrs.remove(out);
    expect_exactly(
        &plan,
        vec![(Place::Rank { rank: 0 }, Problem::OutputCount { found: 0 })],
    );
    // A second output on rank 1, under a fresh id (which is itself beyond the plan's ids).
    let mut plan = llama2();
    let extra = plan.ranks[1].instrs[output(&plan, 1)].clone();
    plan.ranks[1].instrs.push(Instr { id: 65, ..extra });
    expect_has(
        &plan,
        Place::Rank { rank: 1 },
        Problem::OutputCount { found: 2 },
    );
}

// 3. Local facts.

#[test]
fn recorded_facts_must_follow_from_the_inputs() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    let right = plan.ranks[1].instrs[down].fact.clone();
    let wrong = TensorFact {
        dtype: DType::Bf16,
        shape: Shape::tokens(&[65]),
    };
    plan.ranks[1].instrs[down].fact = wrong.clone();
    expect_has(
        &plan,
        iplace(&plan, 1, down),
        Problem::Fact {
            recorded: Box::new(wrong),
            inferred: Box::new(right),
        },
    );
}

#[test]
fn collectives_change_the_split_dim_by_tp() {
    let mut plan = compiled("tiny-gpt2", 4);
    let r = 2;
    let gather = plan.ranks[r]
        .instrs
        .iter()
        .position(|i| matches!(i.op, Op::AllGather(_)))
        .unwrap();
    let right = plan.ranks[r].instrs[gather].fact.clone();
    // The all-gather's fact must be the local piece × tp, then unpadded.
    assert_eq!(right.shape.fixed_at(2), Some(250));
    let wrong = TensorFact {
        shape: right.shape.with_last(252),
        ..right.clone()
    };
    plan.ranks[r].instrs[gather].fact = wrong.clone();
    expect_has(
        &plan,
        iplace(&plan, r, gather),
        Problem::Fact {
            recorded: Box::new(wrong),
            inferred: Box::new(right),
        },
    );
    // Reduce-scatter and local slice divide the dim by tp; it must divide.
    let plan = compiled("tiny-gpt2", 4);
    let x = TensorFact {
        dtype: DType::F32,
        shape: Shape::tokens(&[64]),
    };
    let rs = Op::ReduceScatter(ReduceScatterOp::even(2));
    let ls = Op::LocalSlice(LocalSliceOp::even(2));
    for op in [&rs, &ls] {
        assert_eq!(
            local_fact(&plan, op, &[&x]),
            Ok(TensorFact {
                shape: Shape::tokens(&[16]),
                ..x.clone()
            })
        );
    }
    let odd = TensorFact {
        shape: Shape::tokens(&[66]),
        ..x.clone()
    };
    assert_eq!(
        local_fact(&plan, &rs, &[&odd]),
        Err(Problem::NotDivisible {
            kind: "reduce_scatter",
            dim: 2,
            size: 66,
            tp: 4
        })
    );
    assert_eq!(
        local_fact(&plan, &Op::LocalSlice(LocalSliceOp::even(0)), &[&x]),
        Err(Problem::CollectiveDim {
            kind: "local_slice",
            dim: 0,
            input: Box::new(x.clone())
        })
    );
    let matrix = TensorFact {
        dtype: DType::F32,
        shape: Shape::fixed(&[8, 8]),
    };
    assert_eq!(
        local_fact(&plan, &rs, &[&matrix]),
        Err(Problem::CollectiveDim {
            kind: "reduce_scatter",
            dim: 2,
            input: Box::new(matrix.clone())
        })
    );
    // All-reduce keeps the fact.
    assert_eq!(
        local_fact(
            &plan,
            &Op::AllReduce(crate::ir::AllReduceOp::default()),
            &[&x]
        ),
        Ok(x.clone())
    );
}

#[test]
fn overflowing_sizes_are_errors_not_panics() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    let huge = TensorFact {
        dtype: DType::F32,
        shape: Shape::tokens(&[u64::MAX, 3]),
    };
    plan.ranks[1].instrs[down].fact = huge.clone();
    expect_has(
        &plan,
        iplace(&plan, 1, down),
        Problem::Overflow {
            what: format!("the element count of its fact {huge}"),
        },
    );
    // An unfuse structure whose length overflows, which plain inference would multiply.
    let mut plan = compiled("tiny-neox", 2);
    let q = at(&plan, 1, "gpt_neox.layers.0.attention.q");
    if let Op::Unfuse(u) = &mut plan.ranks[1].instrs[q].op {
        u.groups = Groups::Interleaved {
            heads: u64::MAX,
            parts: vec![2, 2, 2],
        };
    }
    expect_has(
        &plan,
        iplace(&plan, 1, q),
        Problem::Overflow {
            what: "the length of its unfuse structure".into(),
        },
    );
    // A weight entry whose byte size overflows.
    let mut plan = llama2();
    let w = weight(&plan, 0, DOWN_W);
    plan.ranks[0].weights[w].shape = vec![u64::MAX / 2, 128];
    expect_has(
        &plan,
        wplace(0, DOWN_W),
        Problem::Overflow {
            what: format!(
                "the byte size of its checkpoint shape {:?}",
                [u64::MAX / 2, 128]
            ),
        },
    );
}

// 4. Weight manifest.

#[test]
fn every_param_needs_its_manifest_entry() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    plan.ranks[1].weights.remove(w);
    expect_exactly(
        &plan,
        vec![
            (
                iplace(&plan, 1, at(&plan, 1, DOWN_W)),
                Problem::MissingWeight {
                    tensor: DOWN_W.into(),
                },
            ),
            // Rank 1's columns are now loaded by nobody.
            (
                Place::Tensor {
                    tensor: DOWN_W.into(),
                },
                Problem::WeightCoverage {
                    dim: 1,
                    size: 128,
                    start: 64,
                    end: 128,
                },
            ),
        ],
    );
}

#[test]
fn unused_and_duplicate_entries_are_reported() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    let entry = plan.ranks[1].weights[w].clone();
    plan.ranks[1].weights.push(entry.clone());
    plan.ranks[1].weights.push(WeightSlice {
        tensor: "ghost.weight".into(),
        dim: None,
        ranges: Vec::new(),
        local_shape: entry.shape.clone(),
        ..entry
    });
    expect_exactly(
        &plan,
        vec![
            (wplace(1, DOWN_W), Problem::DuplicateWeight { first: w }),
            (wplace(1, "ghost.weight"), Problem::UnusedWeight),
        ],
    );
}

#[test]
fn entry_local_shape_must_equal_the_param() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    // Column slice [64..128] of [64, 128]: local [64, 64]. Claim 65 columns.
    plan.ranks[1].weights[w].local_shape = vec![64, 65];
    expect_exactly(
        &plan,
        vec![
            (
                wplace(1, DOWN_W),
                Problem::RangeTotal {
                    dim: 1,
                    covered: Some(64),
                    local: 65,
                },
            ),
            (
                iplace(&plan, 1, at(&plan, 1, DOWN_W)),
                Problem::WeightShape {
                    param: vec![64, 64],
                    manifest: vec![64, 65],
                },
            ),
        ],
    );
}

#[test]
fn entry_dtype_must_equal_the_param() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    let theirs = weight_key(&plan.ranks[1].weights[w]);
    plan.ranks[1].weights[w].dtype = DType::Bf16;
    let ours = weight_key(&plan.ranks[1].weights[w]);
    expect_exactly(
        &plan,
        vec![
            (
                iplace(&plan, 1, at(&plan, 1, DOWN_W)),
                Problem::WeightDtype {
                    param: DType::F32,
                    manifest: DType::Bf16,
                },
            ),
            // Rank 0 still reads it as f32.
            (
                wplace(1, DOWN_W),
                Problem::WeightDisagrees {
                    other: 0,
                    ours,
                    theirs,
                },
            ),
        ],
    );
}

#[test]
fn ranges_must_lie_inside_the_checkpoint_dim() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    plan.ranks[1].weights[w].ranges = vec![SliceRange {
        offset: 100,
        len: 64,
        pad: 0,
    }];
    expect_exactly(
        &plan,
        vec![(
            wplace(1, DOWN_W),
            Problem::RangeOutside {
                index: 0,
                offset: 100,
                len: 64,
                dim: 1,
                size: 128,
            },
        )],
    );
    // An offset whose end overflows is outside too, not a panic.
    plan.ranks[1].weights[w].ranges[0].offset = u64::MAX;
    let got = problems(&plan);
    assert!(
        matches!(
            got[0].problem,
            Problem::RangeOutside {
                offset: u64::MAX,
                ..
            }
        ),
        "{}",
        list(&got)
    );
}

#[test]
fn ranges_and_padding_must_make_the_local_dim() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    plan.ranks[1].weights[w].padding = 3;
    expect_exactly(
        &plan,
        vec![(
            wplace(1, DOWN_W),
            Problem::RangeTotal {
                dim: 1,
                covered: Some(67),
                local: 64,
            },
        )],
    );
}

#[test]
fn split_dim_must_be_inside_and_loadable() {
    let mut plan = llama2();
    for r in 0..2 {
        let w = weight(&plan, r, DOWN_W);
        plan.ranks[r].weights[w].dim = Some(2);
    }
    let outside = |r| {
        (
            wplace(r, DOWN_W),
            Problem::SplitDimOutside { dim: 2, rank: 2 },
        )
    };
    expect_exactly(&plan, vec![outside(0), outside(1)]);
    let w = weight(&plan, 1, DOWN_W);
    // A rank-3 tensor split on dim 1: consistent, but the loader cannot slice it.
    let entry = &mut plan.ranks[1].weights[w];
    entry.dim = Some(1);
    entry.shape.push(1);
    entry.local_shape.push(1);
    expect_has(
        &plan,
        wplace(1, DOWN_W),
        Problem::LoaderCannotSlice { dim: 1, rank: 3 },
    );
}

#[test]
fn whole_entries_hold_the_whole_tensor() {
    let mut plan = llama2();
    let norm = "model.layers.0.input_layernorm.weight";
    let w = weight(&plan, 0, norm);
    plan.ranks[0].weights[w].local_shape = vec![32];
    let got = problems(&plan);
    assert_eq!(
        got[0],
        PlanProblem {
            place: wplace(0, norm),
            problem: Problem::WholeMismatch {
                shape: vec![64],
                local: vec![32],
                ranges: 0,
                padding: 0
            }
        },
        "{}",
        list(&got)
    );
}

#[test]
fn only_the_split_dim_may_change() {
    let mut plan = llama2();
    // Both ranks (so that they still agree) claim 65 checkpoint rows but hold 64.
    for r in 0..2 {
        let w = weight(&plan, r, DOWN_W);
        plan.ranks[r].weights[w].shape = vec![65, 128];
    }
    let other_dims = |r| {
        (
            wplace(r, DOWN_W),
            Problem::OtherDims {
                dim: 1,
                shape: vec![65, 128],
                local: vec![64, 64],
            },
        )
    };
    expect_exactly(&plan, vec![other_dims(0), other_dims(1)]);
    let w = weight(&plan, 1, DOWN_W);
    plan.ranks[1].weights[w].local_shape = vec![64];
    let got = problems(&plan);
    assert!(
        got.iter()
            .any(|p| matches!(p.problem, Problem::LocalRank { .. })),
        "{}",
        list(&got)
    );
}

// 5. Collectives.

fn nth_collective(plan: &Plan, rank: usize, n: usize) -> usize {
    plan.ranks[rank]
        .instrs
        .iter()
        .enumerate()
        .filter(|(_, i)| i.op.is_collective())
        .nth(n)
        .unwrap()
        .0
}

#[test]
fn ranks_must_issue_the_same_collectives() {
    // Rank 1 turns its third collective into an all-gather: kind differs at position 2.
    let mut plan = llama2();
    let c = nth_collective(&plan, 1, 2);
    let instr = &mut plan.ranks[1].instrs[c];
    let id = instr.id;
    instr.op = Op::AllGather(AllGatherOp {
        dim: 2,
        unpad_to: None,
        pieces: Vec::new(),
    });
    expect_has(
        &plan,
        Place::Rank { rank: 1 },
        Problem::CollectiveOrder {
            position: 2,
            other: 0,
            ours: Some(Issued {
                id,
                kind: "all_gather",
                elements: Some(64),
            }),
            theirs: Some(Issued {
                id,
                kind: "all_reduce",
                elements: Some(64),
            }),
        },
    );
    // Rank 1 drops its last collective (and what reads it): rank 1 issues nothing there.
    let mut plan = llama2();
    let last = plan.ranks[1]
        .instrs
        .iter()
        .filter(|i| i.op.is_collective())
        .count()
        - 1;
    let c = nth_collective(&plan, 1, last);
    let gone = plan.ranks[1].instrs.remove(c);
    let theirs = Issued {
        id: gone.id,
        kind: "all_gather",
        elements: Some(125),
    };
    expect_has(
        &plan,
        Place::Rank { rank: 1 },
        Problem::CollectiveOrder {
            position: last,
            other: 0,
            ours: None,
            theirs: Some(theirs),
        },
    );
}

#[test]
fn collective_sizes_must_agree_across_ranks() {
    // Rank 1 feeds its first all-reduce a value of another size.
    let mut plan = llama2();
    let c = nth_collective(&plan, 1, 0);
    let input = plan.ranks[1].instrs[c].inputs[0];
    let src = plan.ranks[1]
        .instrs
        .iter()
        .position(|i| i.id == input)
        .unwrap();
    let fact = TensorFact {
        dtype: DType::F32,
        shape: Shape::tokens(&[32]),
    };
    plan.ranks[1].instrs[src].fact = fact.clone();
    plan.ranks[1].instrs[c].fact = fact;
    let id = plan.ranks[1].instrs[c].id;
    let issued = |elements| Issued {
        id,
        kind: "all_reduce",
        elements: Some(elements),
    };
    expect_has(
        &plan,
        Place::Rank { rank: 1 },
        Problem::CollectiveOrder {
            position: 0,
            other: 0,
            ours: Some(issued(32)),
            theirs: Some(issued(64)),
        },
    );
}

#[test]
fn the_collective_list_follows_rank_0() {
    let mut plan = llama2();
    let entry = plan.collectives[1].clone();
    plan.collectives[1].bytes_per_token += 4;
    plan.collectives[2].kind = "reduce_scatter".into();
    plan.collectives[3].name = "renamed".into();
    let last = plan.collectives.pop().unwrap();
    let cplace = |k: usize, c: &super::super::Collective| Place::Collective {
        index: k,
        id: c.id,
        name: c.name.clone(),
    };
    let got = problems(&plan);
    let want = [
        PlanProblem {
            place: cplace(1, &entry),
            problem: Problem::CollectiveSize {
                field: "bytes_per_token",
                listed: entry.bytes_per_token + 4,
                expected: Some(entry.bytes_per_token),
            },
        },
        PlanProblem {
            place: cplace(2, &plan.collectives[2]),
            problem: Problem::CollectiveListed {
                id: plan.collectives[2].id,
                kind: "reduce_scatter".into(),
                actual: Some(Issued {
                    id: plan.collectives[2].id,
                    kind: "all_reduce",
                    elements: Some(64),
                }),
            },
        },
        PlanProblem {
            place: cplace(3, &plan.collectives[3]),
            problem: Problem::CollectiveName {
                id: plan.collectives[3].id,
                listed: "renamed".into(),
                actual: "model.layers.1.attn_residual.all_reduce".into(),
            },
        },
        PlanProblem {
            place: Place::Plan,
            problem: Problem::CollectiveUnlisted {
                position: plan.collectives.len(),
                issued: Issued {
                    id: last.id,
                    kind: "all_gather",
                    elements: Some(125),
                },
            },
        },
    ];
    assert_eq!(got, want, "{}", list(&got));
    // The listed elements of an all-gather are the gathered value's, padding included.
    assert_eq!(last.elements_per_token, 250);
    assert_eq!(last.bytes_per_token, 1000);
}

// 6. Embedding rows and all-gather unpadding.

#[test]
fn vocab_range_must_be_the_tables_rows() {
    let mut plan = llama2();
    let e = at(&plan, 1, "model.embed_tokens");
    let Op::Embedding(op) = &mut plan.ranks[1].instrs[e].op else {
        panic!("not an embedding")
    };
    assert_eq!(op.vocab_range, Some((125, 125)));
    op.vocab_range = Some((125, 200));
    expect_exactly(
        &plan,
        vec![
            (
                iplace(&plan, 1, e),
                Problem::VocabRangeOutside {
                    offset: 125,
                    len: 200,
                    local_rows: 125,
                    checkpoint_rows: Some(250),
                },
            ),
            (
                iplace(&plan, 1, e),
                Problem::VocabRange {
                    found: Some((125, 200)),
                    expected: Some((125, 125)),
                },
            ),
        ],
    );
    // Inside the table but not the rows this rank loads.
    let Op::Embedding(op) = &mut plan.ranks[1].instrs[e].op else {
        unreachable!()
    };
    op.vocab_range = Some((0, 125));
    expect_exactly(
        &plan,
        vec![(
            iplace(&plan, 1, e),
            Problem::VocabRange {
                found: Some((0, 125)),
                expected: Some((125, 125)),
            },
        )],
    );
}

#[test]
fn gather_pieces_must_give_each_rank_a_count_that_sums_to_the_gathered_dim() {
    let def = crate::frontend::load::load_model(&models_dir().join("tiny-llama.ron")).unwrap();
    let options = crate::passes::ShardOptions {
        shares: Some("3,1".parse().unwrap()),
        ..Default::default()
    };
    let plan = crate::plan::build::compile_with(&def, 2, options)
        .unwrap()
        .plan;
    let g = plan.ranks[0]
        .instrs
        .iter()
        .position(|i| matches!(i.op, Op::AllGather(_)))
        .unwrap();
    // 250 vocabulary rows in atoms of 2 by shares 3,1: 188 and 62, each piece 188 long.
    let Op::AllGather(op) = &plan.ranks[0].instrs[g].op else {
        unreachable!()
    };
    assert_eq!(op.pieces, vec![188, 62]);
    plan.verify().unwrap();
    let bad = [vec![188, 63], vec![189, 61], vec![250], vec![188, 62, 0]];
    for pieces in bad {
        let mut plan = plan.clone();
        let mut want = Vec::new();
        for r in 0..2 {
            let g = at(&plan, r, "lm_head.all_gather");
            let Op::AllGather(op) = &mut plan.ranks[r].instrs[g].op else {
                unreachable!()
            };
            op.pieces = pieces.clone();
            let problem = Problem::BadPieces {
                pieces: pieces.clone(),
                tp: 2,
                local: 188,
                size: 250,
            };
            want.push((iplace(&plan, r, g), problem));
        }
        expect_exactly(&plan, want);
    }
}

#[test]
fn unpad_to_must_fit_the_gathered_dim() {
    let mut plan = compiled("tiny-gpt2", 4);
    let mut want = Vec::new();
    for r in 0..4 {
        let g = plan.ranks[r]
            .instrs
            .iter()
            .position(|i| matches!(i.op, Op::AllGather(_)))
            .unwrap();
        let Op::AllGather(op) = &mut plan.ranks[r].instrs[g].op else {
            unreachable!()
        };
        // 250 vocab rows over 4 ranks: 63 each, 252 gathered, 250 kept.
        assert_eq!(op.unpad_to, Some(250));
        op.unpad_to = Some(253);
        want.push((
            iplace(&plan, r, g),
            Problem::UnpadTooLarge {
                unpad_to: 253,
                gathered: 252,
            },
        ));
    }
    expect_exactly(&plan, want);
}

// Robustness: absurd plans fail fast and small.

#[test]
fn absurd_tp_and_empty_ranks_fail_fast() {
    let mut plan = llama2();
    plan.tp = 1 << 40;
    plan.ranks.clear();
    plan.collectives.clear();
    expect_exactly(
        &plan,
        vec![(
            Place::Plan,
            Problem::RankCount {
                tp: 1 << 40,
                ranks: 0,
            },
        )],
    );
    // With its programs kept, tp=2^40 multiplies sizes without overflow or panic.
    let mut plan = llama2();
    plan.tp = 1 << 40;
    assert!(problems(&plan).iter().any(|p| p.problem
        == Problem::RankCount {
            tp: 1 << 40,
            ranks: 2
        }));
}

#[test]
fn a_million_bogus_ids_fail_fast_with_a_capped_list() {
    let mut plan = llama2();
    let template = Instr {
        id: 0,
        name: "bogus".into(),
        op: Op::Add(AddOp {}),
        inputs: Default::default(),
        fact: TensorFact {
            dtype: DType::F32,
            shape: Shape::tokens(&[64]),
        },
        layout: crate::ir::Layout::Replicated,
        layer: None,
    };
    let n = 1_000_000u32;
    plan.ranks[0].instrs = (0..n)
        .map(|k| Instr {
            id: u32::MAX - k,
            inputs: [k, k + n].into_iter().collect(),
            ..template.clone()
        })
        .collect();
    let started = std::time::Instant::now();
    let e = plan.verify().unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.problems.len(), MAX_LISTED);
    // Two dangling inputs each, one missing output, rank 0's unused weights, collectives.
    assert!(e.unlisted >= 2 * n as usize - MAX_LISTED, "{}", e.unlisted);
    eprintln!("verify of {n} bogus instructions took {took:?}");
    assert!(took.as_secs() < 10, "took {took:?}");
    let text = e.to_string();
    assert!(text.contains("... and"), "{}", &text[..500]);
    assert!(text.len() < 400_000, "{} bytes", text.len());
}

#[test]
fn display_names_rank_instruction_and_the_fix() {
    let mut plan = llama2();
    let down = at(&plan, 1, DOWN);
    plan.ranks[1].instrs[down].inputs[0] = 4242;
    let text = plan.verify().unwrap_err().to_string();
    let id = plan.ranks[1].instrs[down].id;
    assert!(
        text.contains(&format!(
            "rank 1, instruction %{id} `{DOWN}`: input 0 is %4242, which no instruction of this rank defines"
        )),
        "{text}"
    );
    assert!(text.starts_with("the plan for `"), "{text}");
    assert!(text.contains("1 problem(s)"), "{text}");
}

/// A tiny deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// A size that stresses arithmetic: small, a boundary, or huge.
    fn size(&mut self) -> u64 {
        const EDGES: [u64; 10] = [
            0,
            1,
            2,
            3,
            64,
            u32::MAX as u64,
            u32::MAX as u64 + 1,
            u64::MAX / 2,
            u64::MAX - 1,
            u64::MAX,
        ];
        EDGES[self.below(EDGES.len())]
    }
}

/// One random corruption of a number somewhere in the plan.
fn corrupt(plan: &mut Plan, rng: &mut Rng) {
    let size = rng.size();
    let r = rng.below(plan.ranks.len());
    if rng.below(8) == 0 {
        match rng.below(3) {
            0 => plan.tp = size,
            1 => {
                if let Some(c) = plan.collectives.get_mut(rng.below(9)) {
                    c.elements_per_token = size;
                }
            }
            _ => plan.ranks[r].rank = size,
        }
        return;
    }
    let program = &mut plan.ranks[r];
    if rng.below(3) == 0 {
        let k = rng.below(program.weights.len());
        let Some(w) = program.weights.get_mut(k) else {
            return;
        };
        let d = rng.below(3);
        match rng.below(6) {
            0 => w.dim = Some(size as u32),
            1 => w.padding = size,
            2 => {
                if let Some(x) = w.shape.get_mut(d) {
                    *x = size
                }
            }
            3 => {
                if let Some(x) = w.local_shape.get_mut(d) {
                    *x = size
                }
            }
            4 => w.ranges.push(SliceRange {
                offset: size,
                len: rng.size(),
                pad: 0,
            }),
            _ => w.local_shape.push(size),
        }
        return;
    }
    let k = rng.below(program.instrs.len());
    let Some(i) = program.instrs.get_mut(k) else {
        return;
    };
    match rng.below(6) {
        0 => i.id = size as u32,
        1 => {
            let slot = rng.below(i.inputs.len());
            if let Some(x) = i.inputs.get_mut(slot) {
                *x = size as u32;
            }
        }
        2 => {
            let d = rng.below(i.fact.shape.rank());
            if let Some(x) = i.fact.shape.0.get_mut(d) {
                *x = Dim::Fixed(size);
            }
        }
        3 => {
            i.fact.shape.0.pop();
        }
        _ => match &mut i.op {
            Op::Param(p) => {
                let d = rng.below(p.shape.len());
                if let Some(x) = p.shape.get_mut(d) {
                    *x = size;
                }
            }
            Op::Embedding(e) => e.vocab_range = Some((size, rng.size())),
            Op::AllGather(g) => {
                g.unpad_to = Some(size);
                g.dim = rng.size() as u32;
            }
            Op::Unfuse(u) => {
                u.groups = Groups::Interleaved {
                    heads: size,
                    parts: vec![rng.size(), rng.size()],
                }
            }
            Op::Rope(x) => x.head_dim = size,
            Op::Attention(a) => a.head_dim = size,
            Op::RmsNorm(n) => n.group = Some(size),
            _ => i.fact.dtype = DType::I64,
        },
    }
}

#[test]
fn random_corruptions_are_reported_never_panics() {
    let base = [compiled("tiny-gpt2", 4), compiled("tiny-neox", 2)];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut failed = 0;
    for round in 0..3000 {
        let mut plan = base[round % base.len()].clone();
        for _ in 0..1 + rng.below(3) {
            corrupt(&mut plan, &mut rng);
        }
        let result = std::panic::catch_unwind(|| plan.verify());
        match result {
            Err(_) => panic!("verify panicked in round {round}"),
            Ok(Err(e)) => {
                failed += 1;
                // Every problem renders with its place.
                assert!(!e.to_string().is_empty());
            }
            Ok(Ok(())) => {}
        }
    }
    eprintln!("{failed} of 3000 corrupted plans reported");
    // Almost every corruption is caught (a few are harmless, e.g. a size set to its value).
    assert!(
        failed > 2700,
        "only {failed} of 3000 corruptions were reported"
    );
}

#[test]
fn ids_must_number_the_values_densely() {
    // The runtime keeps values in a table indexed by id: an id of 2^32 - 1 would make
    // it allocate 32 GiB, though nothing else about the plan is wrong.
    let mut plan = llama2();
    let n = plan.ranks[0].instrs.len() as u64;
    for r in 0..2 {
        let out = plan.ranks[r].instrs.len() - 1;
        assert!(matches!(plan.ranks[r].instrs[out].op, Op::Output(_)));
        plan.ranks[r].instrs[out].id = u32::MAX;
    }
    let place = |plan: &Plan, r: usize| iplace(plan, r, plan.ranks[r].instrs.len() - 1);
    let beyond = Problem::IdBeyond {
        id: u32::MAX,
        limit: n,
    };
    expect_exactly(
        &plan,
        vec![(place(&plan, 0), beyond.clone()), (place(&plan, 1), beyond)],
    );
}

#[test]
fn ranks_must_read_a_tensor_the_same_way() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    let theirs = weight_key(&plan.ranks[0].weights[weight(&plan, 0, DOWN_W)]);
    // Rank 1 thinks the checkpoint tensor is twice as wide: its reads would land elsewhere.
    plan.ranks[1].weights[w].shape = vec![64, 256];
    let ours = weight_key(&plan.ranks[1].weights[w]);
    expect_exactly(
        &plan,
        vec![(
            wplace(1, DOWN_W),
            Problem::WeightDisagrees {
                other: 0,
                ours,
                theirs,
            },
        )],
    );
}

#[test]
fn split_tensors_are_loaded_whole_by_the_ranks_together() {
    let mut plan = llama2();
    let w = weight(&plan, 1, DOWN_W);
    // Both ranks load columns 0..64; nobody loads 64..128.
    plan.ranks[1].weights[w].ranges = vec![SliceRange {
        offset: 0,
        len: 64,
        pad: 0,
    }];
    expect_exactly(
        &plan,
        vec![(
            Place::Tensor {
                tensor: DOWN_W.into(),
            },
            Problem::WeightCoverage {
                dim: 1,
                size: 128,
                start: 64,
                end: 128,
            },
        )],
    );
}

#[test]
fn ranks_run_the_same_op_under_one_id() {
    // Rank 1 rotates with another head size: every shape still fits, the result is wrong.
    let mut plan = llama2();
    let rope = at(&plan, 1, "model.layers.0.self_attn.q_rope");
    let Op::Rope(r) = &mut plan.ranks[1].instrs[rope].op else {
        panic!("not a rope")
    };
    r.head_dim = 4;
    r.rotary_dim = 4;
    let ours = describe(&plan.ranks[1].instrs[rope]);
    let theirs = describe(&plan.ranks[0].instrs[at(&plan, 0, "model.layers.0.self_attn.q_rope")]);
    assert_eq!(
        ours,
        "rope `model.layers.0.self_attn.q_rope` {head_dim=4 rotary_dim=4 theta=10000 scaled}"
    );
    expect_exactly(
        &plan,
        vec![(
            iplace(&plan, 1, rope),
            Problem::OpDiffers {
                other: 0,
                ours,
                theirs,
            },
        )],
    );
}

#[test]
fn an_invariant_plan_keeps_its_exact_sums_or_is_refused() {
    fn linear<'p>(p: &'p mut Plan, name: &str) -> &'p mut crate::ir::LinearOp {
        let i = at(p, 0, name);
        match &mut p.ranks[0].instrs[i].op {
            Op::Linear(l) => l,
            _ => panic!("{name} is not a linear"),
        }
    }
    let def = crate::frontend::load::load_model(&models_dir().join("tiny-llama.ron")).unwrap();
    let options = crate::passes::ShardOptions {
        numerics: crate::ir::NumericsMode::Invariant,
        ..Default::default()
    };
    let plan = crate::plan::build::compile_with(&def, 2, options)
        .unwrap()
        .plan;
    plan.verify().unwrap();
    let numerics = |p: &Plan| -> Vec<String> {
        problems(p)
            .into_iter()
            .filter(|x| matches!(x.problem, Problem::Numerics(_)))
            .map(|x| x.to_string())
            .collect()
    };
    let o_proj = "model.layers.0.self_attn.o_proj";
    // o_proj given `blocks` (None: summed the fast way) must be refused saying `what`.
    let refused = |blocks: Option<crate::ir::ExactBlocks>, what: &str| -> Plan {
        let mut p = plan.clone();
        linear(&mut p, o_proj).exact = blocks;
        let said = numerics(&p);
        assert!(said.iter().any(|x| x.contains(what)), "{said:?}");
        p
    };
    let exact = linear(&mut plan.clone(), o_proj).exact.unwrap();
    let depth = exact.block * exact.blocks;
    // Blocks that do not make the depth, one that the rank's half of the depth cuts, and
    // a partial sum summed the fast way.
    let three_quarters = crate::ir::ExactBlocks {
        block: depth / 4 * 3,
        blocks: 1,
    };
    refused(Some(three_quarters), "do not make the weight's depth");
    let whole = crate::ir::ExactBlocks {
        block: depth,
        blocks: 1,
    };
    refused(Some(whole), "cut an exact block");
    let fast = refused(None, "has no exact blocks");
    // The same plan in fast numerics has nothing to keep.
    let mut as_fast = fast.clone();
    as_fast.numerics = crate::ir::NumericsMode::Fast;
    assert!(numerics(&as_fast).is_empty());
}
