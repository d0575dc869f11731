//! Issue 35, items 1–3: a saved plan runs only when it is what tpc compiles for the
//! checkpoint. Edits that `Plan::verify` accepts (slices exchanged between ranks, an
//! attention's k and v swapped, a replicated kv range shifted, the positions limit raised)
//! and plans of another model are refused before anything is loaded; a structural fuzzer of
//! plans never gets a plan through that computes other logits than the unedited one.

use crate::common::fixtures;
use crate::rng::Rng;
use serde_json::Value;
use std::path::{Path, PathBuf};
use tpc::error::{ProvenanceError, TpcError};
use tpc::frontend::load::load_model;
use tpc::passes::ShardOptions;
use tpc::plan::Plan;
use tpc::provenance::{check_saved, Accepted};
use tpc::runtime::generate::RunOptions;
use tpc::runtime::weights::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    Path::new("tests/fixtures/checkpoints").join(name)
}

fn compiled(dir: &Path, tp: u64, options: ShardOptions) -> Plan {
    let def = load_model(dir).unwrap();
    tpc::pipeline::compile_with(&def, tp, options).unwrap().plan
}

/// The plan after an edit of its JSON form (as a user's editor would make it).
fn edited(plan: &Plan, edit: impl FnOnce(&mut Value)) -> Plan {
    let mut v = serde_json::to_value(plan).unwrap();
    edit(&mut v);
    serde_json::from_value(v).unwrap()
}

/// What `tpc run --plan` decides for `plan` on the checkpoint `dir`.
fn check(plan: &Plan, dir: &Path) -> tpc::Result<Accepted> {
    check_saved(
        plan,
        Some(&load_model(dir).unwrap()),
        Path::new("plan.json"),
    )
}

fn refusal(plan: &Plan, dir: &Path) -> String {
    match check(plan, dir) {
        Ok(a) => panic!("an edited plan was accepted ({a:?})"),
        Err(e) => e.to_string(),
    }
}

/// The rank-0 prompt logits of a plan on the checkpoint's weights.
fn logits(plan: &Plan, ckpt: &Checkpoint) -> tpc::runtime::error::Result<Vec<f32>> {
    let opts = RunOptions {
        max_new_tokens: 1,
        all_prompt_logits: true,
        device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
            threads_per_rank: 1,
            ..Default::default()
        }),
        ..RunOptions::default()
    };
    Ok(tpc::runtime::run::run(plan, ckpt, &[1, 5, 9, 3], &opts)?
        .prompt_logits
        .data)
}

#[test]
fn every_fixture_plan_is_accepted_as_compiled() {
    for dir in fixtures() {
        for tp in [1, 2, 4, 8] {
            for sequence_parallel in [false, true] {
                let options = ShardOptions {
                    sequence_parallel,
                    fuse_norm: sequence_parallel,
                    numerics: tpc::ir::NumericsMode::Fast,
                    shares: None,
                    moe: None,
                };
                let def = load_model(&dir).unwrap();
                let Ok(c) = tpc::pipeline::compile_with(&def, tp, options) else {
                    continue;
                };
                let mut plan = c.plan;
                assert_eq!(check(&plan, &dir).unwrap(), Accepted::Recorded, "{dir:?}");
                // Saved and read back, in both forms, with pipeline stages too.
                tpc::pipeline::split_stages(&mut plan, 2, None).unwrap();
                for ext in ["ron", "json"] {
                    let path = std::env::temp_dir().join(format!(
                        "tpc-provenance-{}-{tp}-{sequence_parallel}.{ext}",
                        std::process::id()
                    ));
                    plan.save(&path).unwrap();
                    let back = Plan::load(&path).unwrap();
                    std::fs::remove_file(&path).unwrap();
                    assert_eq!(back, plan);
                    assert_eq!(check(&back, &dir).unwrap(), Accepted::Recorded);
                }
            }
        }
    }
}

/// Every weight whose ranks hold different ranges, exchanged between the first two ranks:
/// where `Plan::verify` accepts the exchange, refused naming the rank and the weight. The
/// kinds the issue lists (q/k/v/o, gate/up/down, `lm_head`, GPT-2's fused `c_attn`, NeoX's
/// `query_key_value`) must all be among those verify accepts.
#[test]
fn exchanged_slices_of_any_weight_are_refused() {
    let mut seen = std::collections::BTreeSet::new();
    for dir in fixtures() {
        let plan = compiled(&dir, 2, ShardOptions::default());
        for (w, weight) in plan.ranks[0].weights.iter().enumerate() {
            let Some(u) = plan.ranks[1]
                .weights
                .iter()
                .position(|x| x.tensor == weight.tensor)
            else {
                continue;
            };
            if weight.ranges == plan.ranks[1].weights[u].ranges {
                continue;
            }
            let tensor = weight.tensor.to_string();
            let bad = edited(&plan, |v| {
                let a = v["ranks"][0]["weights"][w]["ranges"].take();
                let b = v["ranks"][1]["weights"][u]["ranges"].take();
                v["ranks"][0]["weights"][w]["ranges"] = b;
                v["ranks"][1]["weights"][u]["ranges"] = a;
            });
            if bad.verify().is_err() {
                // Caught already (an embedding's vocabulary range is checked by verify).
                continue;
            }
            let e = refusal(&bad, &dir);
            assert!(
                e.contains(&format!("rank 0, weight `{tensor}`")) && e.contains("ranges"),
                "{e}"
            );
            seen.insert(tensor.rsplit('.').nth(1).unwrap_or("").to_string());
        }
    }
    for kind in [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
        "c_attn",
        "query_key_value",
    ] {
        assert!(seen.contains(kind), "no fixture exercised {kind}: {seen:?}");
    }
}

#[test]
fn exchanged_or_renumbered_rank_programs_are_refused() {
    let dir = fixture("llama-gqa");
    let plan = compiled(&dir, 2, ShardOptions::default());
    // Exchanged whole, each keeping the number of its new place (so verify's own check
    // that program i says rank i holds).
    let bad = edited(&plan, |v| {
        let ranks = v["ranks"].as_array_mut().unwrap();
        ranks.swap(0, 1);
        ranks[0]["rank"] = 0.into();
        ranks[1]["rank"] = 1.into();
    });
    assert!(bad.verify().is_ok());
    let e = refusal(&bad, &dir);
    assert!(e.contains("rank 0"), "{e}");
}

/// The k and v inputs of every attention swapped: the same shapes under GQA.
#[test]
fn an_attention_reading_k_and_v_swapped_is_refused() {
    let dir = fixture("llama-gqa");
    let plan = compiled(&dir, 2, ShardOptions::default());
    let bad = edited(&plan, |v| {
        for rank in v["ranks"].as_array_mut().unwrap() {
            for i in rank["instrs"].as_array_mut().unwrap() {
                if i["op"].get("Attention").is_some() {
                    i["inputs"].as_array_mut().unwrap().swap(1, 2);
                }
            }
        }
    });
    assert!(bad.verify().is_ok(), "{:?}", bad.verify());
    let e = refusal(&bad, &dir);
    assert!(
        e.contains("rank 0, instruction %") && e.contains("field `inputs[1]`"),
        "{e}"
    );
}

/// At tp 8 the two kv heads of llama-gqa are replicated over four ranks each; shifting one
/// rank's range by a row keeps every row covered.
#[test]
fn a_replicated_kv_range_shifted_by_one_row_is_refused() {
    let dir = fixture("llama-gqa");
    let plan = compiled(&dir, 8, ShardOptions::default());
    let w = plan.ranks[3]
        .weights
        .iter()
        .position(|w| {
            w.tensor
                .to_string()
                .ends_with("layers.0.self_attn.k_proj.weight")
        })
        .unwrap();
    let bad = edited(&plan, |v| {
        let r = &mut v["ranks"][3]["weights"][w]["ranges"][0]["offset"];
        *r = (r.as_u64().unwrap() + 1).into();
    });
    assert!(bad.verify().is_ok(), "{:?}", bad.verify());
    let e = refusal(&bad, &dir);
    assert!(e.contains("rank 3, weight") && e.contains("k_proj"), "{e}");
}

/// Item 2: a llama-gqa plan on the llama3-scaled checkpoint (the same shapes, another
/// rope) is refused naming the field.
#[test]
fn a_plan_of_another_model_with_the_same_shapes_is_refused() {
    let plan = compiled(&fixture("llama-gqa"), 2, ShardOptions::default());
    let e = refusal(&plan, &fixture("llama3-scaled"));
    assert!(
        e.contains("`rope_scaling`") && e.contains("Llama3") && e.contains("another model"),
        "{e}"
    );
    // The same check holds for a plan without a recorded source: compiling the checkpoint
    // gives another plan.
    let mut old = plan.clone();
    old.source = None;
    let e = refusal(&old, &fixture("llama3-scaled"));
    assert!(e.contains("does not record"), "{e}");
}

/// Item 3: GPT-2's positions end at `n_positions`; a plan that drops or raises its limit
/// does not run past them.
#[test]
fn gpt2_positions_limit_cannot_be_edited_away() {
    let dir = fixture("gpt2");
    let plan = compiled(&dir, 2, ShardOptions::default());
    let max = plan.max_positions.expect("GPT-2 has a positions limit");
    for edit in [Value::Null, (max * 4).into()] {
        let bad = edited(&plan, |v| v["max_positions"] = edit.clone());
        let e = refusal(&bad, &dir);
        assert!(e.contains("field `max_positions`"), "{e}");
    }
    // The recorded model edited too: its positions table would be longer than the plan's.
    let bad = edited(&plan, |v| {
        v["max_positions"] = (max * 4).into();
        v["source"]["model"]["Preset"]["max_position_embeddings"] = (max * 4).into();
    });
    let e = refusal(&bad, &dir);
    assert!(e.contains("`transformer.wpe.weight`"), "{e}");
}

/// Plans written before sources were recorded run when they are the compiler's, with the
/// options found; sequence parallelism included.
#[test]
fn plans_without_a_source_run_when_they_are_what_tpc_compiles() {
    let dir = fixture("llama-gqa");
    for options in [
        ShardOptions::default(),
        ShardOptions {
            sequence_parallel: true,
            fuse_norm: true,
            numerics: tpc::ir::NumericsMode::Fast,
            shares: None,
            moe: None,
        },
    ] {
        let mut plan = compiled(&dir, 2, options);
        plan.source = None;
        assert_eq!(check(&plan, &dir).unwrap(), Accepted::Inferred(options));
    }
}

/// A JSON plan named `.JSON` or `.txt` is read as JSON (item 16).
#[test]
fn a_plan_is_read_by_its_content_not_its_name() {
    let plan = compiled(&fixture("llama-gqa"), 2, ShardOptions::default());
    let dir = std::env::temp_dir().join(format!("tpc-plan-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, written_as) in [
        ("plan.JSON", "plan.json"),
        ("plan.txt", "plan.json"),
        ("plan", "plan.ron"),
    ] {
        let first = dir.join(written_as);
        plan.save(&first).unwrap();
        let path = dir.join(name);
        std::fs::rename(&first, &path).unwrap();
        assert_eq!(Plan::load(&path).unwrap(), plan, "{name}");
        assert!(
            matches!(Plan::looks_like_plan(&path), Some(Ok(_))),
            "{name}"
        );
    }
    // Written under an upper-case `.JSON` name, it is JSON.
    let upper = dir.join("upper.JSON");
    plan.save(&upper).unwrap();
    assert!(std::fs::read_to_string(&upper).unwrap().starts_with('{'));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Exchanges the values at two JSON pointers (nothing when either is absent).
fn exchange(v: &mut Value, a: &str, b: &str) {
    if a == b || v.pointer(a).is_none() || v.pointer(b).is_none() {
        return;
    }
    let x = v.pointer_mut(a).map(Value::take).unwrap_or_default();
    let y = v.pointer_mut(b).map(Value::take).unwrap_or_default();
    if let Some(at) = v.pointer_mut(a) {
        *at = y;
    }
    if let Some(at) = v.pointer_mut(b) {
        *at = x;
    }
}

fn count(v: &Value, pointer: &str) -> usize {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
}

/// One structural mutation: it keeps the syntax and the local shape facts (lengths,
/// shapes, counts), which is what `Plan::verify` checks.
fn mutate(v: &mut Value, rng: &mut Rng) -> &'static str {
    let ranks = count(v, "/ranks");
    let (a, b) = (rng.below(ranks), rng.below(ranks));
    match rng.below(8) {
        0 => {
            let w = rng.below(count(v, &format!("/ranks/{a}/weights")));
            exchange(
                v,
                &format!("/ranks/{a}/weights/{w}/ranges"),
                &format!("/ranks/{b}/weights/{w}/ranges"),
            );
            "ranges exchanged between ranks"
        }
        1 => {
            exchange(v, &format!("/ranks/{a}"), &format!("/ranks/{b}"));
            for r in [a, b] {
                if let Some(n) = v.pointer_mut(&format!("/ranks/{r}/rank")) {
                    *n = (r as u64).into();
                }
            }
            "rank programs exchanged"
        }
        2 => {
            // Two inputs of one instruction exchanged on every rank.
            let i = rng.below(count(v, "/ranks/0/instrs"));
            let k = count(v, &format!("/ranks/0/instrs/{i}/inputs"));
            let (x, y) = (rng.below(k), rng.below(k));
            for r in 0..ranks {
                let inputs = format!("/ranks/{r}/instrs/{i}/inputs");
                exchange(v, &format!("{inputs}/{x}"), &format!("{inputs}/{y}"));
            }
            "instruction inputs exchanged"
        }
        3 => {
            // One range moved by a row, its length kept.
            let w = rng.below(count(v, &format!("/ranks/{a}/weights")));
            let up = rng.below(2) == 0;
            if let Some(o) = v.pointer_mut(&format!("/ranks/{a}/weights/{w}/ranges/0/offset")) {
                let x = o.as_u64().unwrap_or(0);
                *o = if up { x + 1 } else { x.saturating_sub(1) }.into();
            }
            "range shifted by one row"
        }
        4 => {
            // A number inside one op (eps, theta, a head count, a vocab range) changed.
            let i = rng.below(count(v, &format!("/ranks/{a}/instrs")));
            let op = format!("/ranks/{a}/instrs/{i}/op");
            let mut leaves = Vec::new();
            if let Some(x) = v.pointer(&op) {
                number_leaves(x, &op, &mut leaves);
            }
            if !leaves.is_empty() {
                let leaf = leaves.swap_remove(rng.below(leaves.len()));
                if let Some(at) = v.pointer_mut(&leaf) {
                    *at = match (at.as_u64(), at.as_f64()) {
                        (Some(n), _) => (n ^ 1).into(),
                        (None, Some(x)) => (x * 1.5 + 1.0).into(),
                        _ => at.take(),
                    };
                }
            }
            "a number of an op changed"
        }
        5 => {
            let choice = [Value::Null, 4096.into(), 8.into()];
            v["max_positions"] = choice[rng.below(3)].clone();
            "positions limit changed"
        }
        6 => {
            exchange(
                v,
                &format!("/ranks/{a}/fused"),
                &format!("/ranks/{b}/fused"),
            );
            "fused blocks exchanged between ranks"
        }
        _ => {
            if let Some(o) = v.as_object_mut() {
                o.remove("source");
            }
            "source removed"
        }
    }
}

/// The JSON pointers of every number under `v` (which sits at `at`).
fn number_leaves(v: &Value, at: &str, out: &mut Vec<String>) {
    match v {
        Value::Number(_) => out.push(at.to_string()),
        Value::Object(o) => {
            for (k, x) in o {
                number_leaves(x, &format!("{at}/{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                number_leaves(x, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The structural fuzzer: mutated plans that still verify are either refused by the
/// provenance check or compute bit-identical logits. It also counts the mutants that only
/// `Plan::verify` would let through although their logits differ, and requires some: the
/// fuzzer must be able to find what the check is there to stop.
#[test]
fn structural_plan_mutations_never_run_to_other_logits() {
    let cases: &[(&str, u64)] = &[
        ("llama-gqa", 2),
        ("llama-gqa", 8),
        ("gpt2", 2),
        ("neox-parallel", 2),
        ("qwen3-tied", 2),
    ];
    let mutants_per_case = 60;
    let (mut verified, mut wrong_but_verified, mut accepted) = (0, 0, 0);
    for (c, &(name, tp)) in cases.iter().enumerate() {
        let dir = fixture(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let plan = compiled(&dir, tp, ShardOptions::default());
        let want = logits(&plan, &ckpt).unwrap();
        let base = serde_json::to_value(&plan).unwrap();
        let mut rng = Rng::new(0x35 + c as u64);
        for m in 0..mutants_per_case {
            let mut v = base.clone();
            let mut what = Vec::new();
            for _ in 0..1 + rng.below(2) {
                what.push(mutate(&mut v, &mut rng));
            }
            let Ok(mutant) = serde_json::from_value::<Plan>(v) else {
                continue;
            };
            if mutant.verify().is_err() {
                continue;
            }
            verified += 1;
            let got = logits(&mutant, &ckpt);
            let same = matches!(&got, Ok(g) if g.iter().map(|x| x.to_bits()).eq(want.iter().map(|x| x.to_bits())));
            if !same {
                wrong_but_verified += 1;
            }
            match check(&mutant, &dir) {
                Err(TpcError::Provenance(e))
                    if matches!(
                        *e,
                        ProvenanceError::Edited { .. }
                            | ProvenanceError::Unrecorded { .. }
                            | ProvenanceError::OtherModel { .. }
                    ) => {}
                Err(e) => panic!("{name} tp={tp} mutant {m} ({what:?}): refused oddly: {e}"),
                Ok(_) => {
                    accepted += 1;
                    assert!(
                        same,
                        "{name} tp={tp} mutant {m} ({what:?}) was accepted and computes other logits"
                    );
                }
            }
        }
    }
    eprintln!(
        "structural plan fuzzer: {verified} mutants passed Plan::verify, {wrong_but_verified} of them compute other logits, {accepted} accepted by the provenance check (all bit-identical)"
    );
    assert!(
        wrong_but_verified >= 10,
        "the fuzzer found only {wrong_but_verified} verified mutants with other logits"
    );
}

/// Item 3 below the check: even a plan that reaches the runtime without its positions limit
/// (a library caller's) stops at the end of GPT-2's learned positions instead of reading
/// rows of zeros.
#[test]
fn gpt2_positions_past_the_table_are_an_error_in_the_runtime() {
    let dir = fixture("gpt2");
    let mut plan = compiled(&dir, 2, ShardOptions::default());
    let max = plan.max_positions.expect("GPT-2 has a positions limit") as usize;
    plan.max_positions = None;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let opts = RunOptions {
        max_new_tokens: 4,
        ..RunOptions::default()
    };
    let prompt: Vec<i64> = (0..max as i64).map(|i| i % 7 + 1).collect();
    let e = tpc::runtime::run::run(&plan, &ckpt, &prompt, &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("past the {max} rows")), "{e}");
}
