//! Fused products: the linear ops of one rank that read the same input (q, k and v; gate
//! and up) run as one product over their weights side by side, so that a decode step reads
//! one packed matrix in one pass (one GEMV, one wake-up of the rank's threads or one kernel
//! launch) instead of one per projection. The rule lives here once: [`find`] groups what it
//! allows and [`problems`] (run by `Plan::verify`) checks a recorded group against it.

use super::{FusedLinears, Instr, RankProgram};
pub use crate::error::fuse::FuseProblem;
use crate::ir::{Op, WeightOrder};
use std::collections::HashMap;

/// What one linear brings to a product: its input, weight order, output layout and width.
struct Candidate<'a> {
    instr: &'a Instr,
    order: WeightOrder,
    columns: Option<u64>,
}

/// The program's instructions by id (first definition), and how many read each value.
struct Index<'a> {
    by_id: HashMap<u32, (usize, &'a Instr)>,
    readers: HashMap<u32, usize>,
    heads: Vec<u32>,
}

impl<'a> Index<'a> {
    fn new(program: &'a RankProgram) -> Index<'a> {
        let mut by_id = HashMap::with_capacity(program.instrs.len());
        let mut readers: HashMap<u32, usize> = HashMap::new();
        for (at, i) in program.instrs.iter().enumerate() {
            by_id.entry(i.id).or_insert((at, i));
            for &input in &i.inputs {
                *readers.entry(input).or_default() += 1;
            }
        }
        Index {
            by_id,
            readers,
            heads: program.head_linears(),
        }
    }

    /// `i` as a member of a product, or why it cannot be one.
    fn candidate(&self, i: &'a Instr) -> Result<Candidate<'a>, FuseProblem> {
        let Op::Linear(l) = &i.op else {
            return Err(FuseProblem::NotLinear { id: i.id });
        };
        let (Some(_), Some(&weight)) = (i.inputs.first(), i.inputs.get(1)) else {
            return Err(FuseProblem::NotLinear { id: i.id });
        };
        if self.heads.contains(&i.id) {
            return Err(FuseProblem::Head { id: i.id });
        }
        let is_param = self
            .by_id
            .get(&weight)
            .is_some_and(|(_, w)| matches!(w.op, Op::Param(_)) && w.fact.shape.rank() == 2);
        // Read once, by this linear: the weight is loaded only as part of the product.
        if !is_param || self.readers.get(&weight) != Some(&1) {
            return Err(FuseProblem::Weight { id: i.id, weight });
        }
        let shape = &i.fact.shape;
        let columns = shape.rank().checked_sub(1).and_then(|d| shape.fixed_at(d));
        Ok(Candidate {
            instr: i,
            order: l.weight_order,
            columns,
        })
    }
}

/// Whether `c` may join a product whose first member is `first`.
fn joins(first: &Candidate, c: &Candidate) -> Result<(), FuseProblem> {
    let (f, i) = (first.instr, c.instr);
    let id = i.id;
    if i.inputs[0] != f.inputs[0] {
        return Err(FuseProblem::Input {
            id,
            input: i.inputs[0],
            first: f.inputs[0],
        });
    }
    if c.order != first.order {
        return Err(FuseProblem::WeightOrder {
            id,
            order: c.order,
            first: first.order,
        });
    }
    if i.layout != f.layout {
        return Err(FuseProblem::Layout {
            id,
            layout: i.layout,
            first: f.layout,
        });
    }
    Ok(())
}

/// The products `program` can run: per input, the linears that read it and may join (in
/// program order), grouped by weight order and output layout; groups of one are left alone.
pub fn find(program: &RankProgram) -> Vec<FusedLinears> {
    let index = Index::new(program);
    // Per input value, its groups in order of their first member.
    let mut groups: Vec<Vec<Candidate>> = Vec::new();
    let mut by_input: HashMap<u32, Vec<usize>> = HashMap::new();
    for i in &program.instrs {
        let Ok(c) = index.candidate(i) else { continue };
        if c.columns.is_none() {
            continue;
        }
        let open = by_input.entry(i.inputs[0]).or_default();
        match open
            .iter()
            .find(|&&g| joins(&groups[g][0], &c).is_ok())
            .copied()
        {
            Some(g) => groups[g].push(c),
            None => {
                open.push(groups.len());
                groups.push(vec![c]);
            }
        }
    }
    groups
        .into_iter()
        .filter(|g| g.len() >= 2)
        .map(|g| FusedLinears {
            linears: g.iter().map(|c| c.instr.id).collect(),
            columns: g.iter().filter_map(|c| c.columns).collect(),
        })
        .collect()
}

/// Every problem of `program`'s recorded products, with the index of the product.
pub fn problems(program: &RankProgram) -> Vec<(usize, FuseProblem)> {
    let index = Index::new(program);
    let mut out = Vec::new();
    let mut seen: HashMap<u32, usize> = HashMap::new();
    for (g, group) in program.fused.iter().enumerate() {
        let mut say = |p| out.push((g, p));
        if group.linears.len() < 2 {
            say(FuseProblem::TooFew {
                count: group.linears.len(),
            });
        }
        if group.columns.len() != group.linears.len() {
            say(FuseProblem::ColumnCount {
                listed: group.columns.len(),
                linears: group.linears.len(),
            });
        }
        let mut first: Option<Candidate> = None;
        let mut last_at: Option<usize> = None;
        for (k, &id) in group.linears.iter().enumerate() {
            if seen.insert(id, g).is_some() {
                say(FuseProblem::Repeated { id });
                continue;
            }
            let Some(&(at, instr)) = index.by_id.get(&id) else {
                say(FuseProblem::NotLinear { id });
                continue;
            };
            if last_at.is_some_and(|l| at <= l) {
                say(FuseProblem::Order { id });
            }
            last_at = Some(at);
            let c = match index.candidate(instr) {
                Ok(c) => c,
                Err(p) => {
                    say(p);
                    continue;
                }
            };
            if let Some(&listed) = group.columns.get(k) {
                if c.columns != Some(listed) {
                    say(FuseProblem::Columns {
                        id,
                        listed,
                        actual: c.columns,
                    });
                }
            }
            match &first {
                None => first = Some(c),
                Some(f) => {
                    if let Err(p) = joins(f, &c) {
                        say(p);
                    }
                }
            }
        }
    }
    out
}

/// The members' names, their common prefix said once: `a.b.{q_proj, k_proj, v_proj}`.
pub fn describe(names: &[&str]) -> String {
    let Some((head, rest)) = names.split_first() else {
        return String::new();
    };
    // The longest common prefix that ends at a `.`, so that names stay whole words.
    let mut cut = head.rfind('.').map_or(0, |d| d + 1);
    for n in rest {
        while cut > 0 && !(n.len() >= cut && n.as_bytes()[..cut] == head.as_bytes()[..cut]) {
            cut = head[..cut - 1].rfind('.').map_or(0, |d| d + 1);
        }
    }
    if cut == 0 {
        return names.join(", ");
    }
    let tails: Vec<&str> = names.iter().map(|n| &n[cut..]).collect();
    format!("{}{{{}}}", &head[..cut], tails.join(", "))
}

/// Fused products of a stage program: those whose linears all run in the stage.
pub fn within(fused: &[FusedLinears], instrs: &[Instr]) -> Vec<FusedLinears> {
    let ids: std::collections::HashSet<u32> = instrs.iter().map(|i| i.id).collect();
    fused
        .iter()
        .filter(|g| g.linears.iter().all(|id| ids.contains(id)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::load::load_model;
    use crate::ir::Layout;
    use crate::plan::build::compile;
    use std::path::Path;

    fn plan(model: &str, tp: u64) -> crate::plan::Plan {
        compile(&load_model(Path::new(model)).unwrap(), tp)
            .unwrap()
            .plan
    }

    fn names(program: &RankProgram, g: &FusedLinears) -> Vec<String> {
        g.linears
            .iter()
            .map(|id| {
                let i = program.instrs.iter().find(|i| i.id == *id).unwrap();
                i.name.to_string()
            })
            .collect()
    }

    #[test]
    fn llama_fuses_qkv_and_gate_up_per_layer_on_every_rank() {
        for tp in [1, 2, 4] {
            let plan = plan("models/tiny-llama.ron", tp);
            for program in &plan.ranks {
                let groups: Vec<Vec<String>> =
                    program.fused.iter().map(|g| names(program, g)).collect();
                let mut want = Vec::new();
                for l in 0..2 {
                    let p = format!("model.layers.{l}.");
                    want.push(
                        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
                            .map(|n| format!("{p}{n}"))
                            .to_vec(),
                    );
                    want.push(
                        ["mlp.gate_proj", "mlp.up_proj"]
                            .map(|n| format!("{p}{n}"))
                            .to_vec(),
                    );
                }
                assert_eq!(groups, want, "tp={tp} rank {}", program.rank);
                // Columns: 8 query heads and 2 kv heads of 8, 128 intermediate, split tp ways
                // (kv heads replicated past tp = 2).
                let kv = 16 / tp.min(2);
                assert_eq!(program.fused[0].columns, vec![64 / tp, kv, kv]);
                assert_eq!(program.fused[1].columns, vec![128 / tp, 128 / tp]);
                assert!(problems(program).is_empty());
            }
        }
    }

    #[test]
    fn gpt2_and_neox_fused_checkpoints_have_nothing_left_to_fuse() {
        // c_attn and query_key_value are one linear already; each MLP projection reads a
        // different input.
        for model in ["models/tiny-gpt2.ron", "models/tiny-neox.ron"] {
            let plan = plan(model, 2);
            assert!(plan.ranks.iter().all(|r| r.fused.is_empty()), "{model}");
        }
    }

    #[test]
    fn the_lm_head_and_shared_weights_stay_out() {
        let plan = plan("models/tiny-llama.ron", 2);
        let program = &plan.ranks[0];
        let heads = program.head_linears();
        assert!(!heads.is_empty());
        for g in &program.fused {
            assert!(g.linears.iter().all(|id| !heads.contains(id)));
        }
        let index = Index::new(program);
        let head = index.by_id[&heads[0]].1;
        assert_eq!(
            index.candidate(head).err(),
            Some(FuseProblem::Head { id: heads[0] })
        );
    }

    /// Each broken record is found, with what is wrong.
    #[test]
    fn broken_records_are_problems() {
        let plan = plan("models/tiny-llama.ron", 2);
        let base = plan.ranks[0].clone();
        let qkv = base.fused[0].clone();
        let gate_up = base.fused[1].clone();
        let check = |edit: &dyn Fn(&mut RankProgram), want: FuseProblem| {
            let mut p = base.clone();
            edit(&mut p);
            let found = problems(&p);
            assert!(
                found.iter().any(|(_, f)| *f == want),
                "want {want:?}, found {found:?}"
            );
        };
        let (q, k, v) = (qkv.linears[0], qkv.linears[1], qkv.linears[2]);
        check(
            &|p| p.fused[0].linears.truncate(1),
            FuseProblem::TooFew { count: 1 },
        );
        check(
            &|p| {
                p.fused[0].linears.swap(0, 1);
                p.fused[0].columns.swap(0, 1);
            },
            FuseProblem::Order { id: q },
        );
        check(
            &|p| p.fused[1].linears[0] = k,
            FuseProblem::Repeated { id: k },
        );
        // A linear of another input: gate with q and k.
        check(
            &|p| p.fused[0].linears[2] = gate_up.linears[0],
            FuseProblem::Input {
                id: gate_up.linears[0],
                input: base
                    .instrs
                    .iter()
                    .find(|i| i.id == gate_up.linears[0])
                    .unwrap()
                    .inputs[0],
                first: base.instrs.iter().find(|i| i.id == q).unwrap().inputs[0],
            },
        );
        check(
            &|p| p.fused[0].columns[2] += 1,
            FuseProblem::Columns {
                id: v,
                listed: qkv.columns[2] + 1,
                actual: Some(qkv.columns[2]),
            },
        );
        check(
            &|p| p.fused[0].columns.pop().map(drop).unwrap_or(()),
            FuseProblem::ColumnCount {
                listed: 2,
                linears: 3,
            },
        );
        let weight = base.instrs.iter().find(|i| i.id == q).unwrap().inputs[1];
        check(
            &|p| p.fused[0].linears[0] = weight,
            FuseProblem::NotLinear { id: weight },
        );
        check(
            &|p| {
                let at = p.instrs.iter().position(|i| i.id == v).unwrap();
                p.instrs[at].layout = Layout::Replicated;
            },
            FuseProblem::Layout {
                id: v,
                layout: Layout::Replicated,
                first: Layout::Split { dim: 2 },
            },
        );
        check(
            &|p| {
                let at = p.instrs.iter().position(|i| i.id == k).unwrap();
                p.instrs[at].op = Op::Linear(crate::ir::LinearOp {
                    weight_order: WeightOrder::InOut,
                    exact: None,
                });
            },
            FuseProblem::WeightOrder {
                id: k,
                order: WeightOrder::InOut,
                first: WeightOrder::OutIn,
            },
        );
        // The q weight also read by another op: it is no longer the product's alone.
        check(
            &|p| {
                let at = p.instrs.iter().position(|i| i.id == v).unwrap();
                p.instrs[at].inputs[1] = weight;
            },
            FuseProblem::Weight { id: q, weight },
        );
        let head = base.head_linears()[0];
        check(
            &|p| p.fused[1].linears.push(head),
            FuseProblem::Head { id: head },
        );
    }

    #[test]
    fn each_pipeline_stage_runs_the_products_of_its_layers() {
        let mut plan = plan("models/tiny-llama.ron", 2);
        crate::plan::stages::split_stages(&mut plan, 2, None).unwrap();
        for stage in 0..2 {
            let sp = crate::plan::stages::stage_program(&plan, 1, stage).unwrap();
            let layers: Vec<Option<u32>> = sp
                .program
                .fused
                .iter()
                .map(|g| {
                    sp.program
                        .instrs
                        .iter()
                        .find(|i| i.id == g.linears[0])
                        .unwrap()
                        .layer
                })
                .collect();
            let l = Some(stage as u32);
            assert_eq!(layers, vec![l, l], "stage {stage}");
            assert!(problems(&sp.program).is_empty());
        }
    }

    #[test]
    fn names_are_described_with_their_common_prefix_once() {
        assert_eq!(
            describe(&["a.b.q_proj", "a.b.k_proj", "a.b.v_proj"]),
            "a.b.{q_proj, k_proj, v_proj}"
        );
        assert_eq!(
            describe(&["l.0.mlp.gate_proj", "l.0.mlp.up_proj"]),
            "l.0.mlp.{gate_proj, up_proj}"
        );
        // A prefix that would cut a word is not taken.
        assert_eq!(describe(&["ab.x", "ac.y"]), "ab.x, ac.y");
        assert_eq!(describe(&["a.x", "a.yy.z"]), "a.{x, yy.z}");
        assert_eq!(describe(&["q", "k"]), "q, k");
    }
}
