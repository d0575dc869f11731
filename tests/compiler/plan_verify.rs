//! A saved plan whose text was corrupted never loads: `Plan::load` (and so every command
//! that reads a plan file) refuses it with a message naming the rank, the instruction and
//! what would be right.

use crate::scratch::Scratch;
use std::path::{Path, PathBuf};
use std::process::Command;
use tpc::error::plan::{Place, Problem};
use tpc::plan::Plan;
use tpc::TpcError;

/// A fresh directory for one test's files.
fn scratch(test: &str) -> Scratch {
    Scratch::new("plan-verify", test)
}

fn compiled() -> Plan {
    let def = tpc::frontend::load::load_model(Path::new("models/tiny-llama.ron")).unwrap();
    tpc::pipeline::compile(&def, 2).unwrap().plan
}

/// tiny-llama at tp=2 saved as `plan.ron` and `plan.json`, with their text.
fn saved(dir: &Path) -> Vec<(PathBuf, String)> {
    let plan = compiled();
    ["ron", "json"]
        .iter()
        .map(|ext| {
            let path = dir.join(format!("plan.{ext}"));
            plan.save(&path).unwrap();
            let loaded = Plan::load(&path).expect("a freshly saved plan loads");
            assert_eq!(loaded, plan);
            let text = std::fs::read_to_string(&path).unwrap();
            (path, text)
        })
        .collect()
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// Where rank 1's program starts in the text.
fn rank1(text: &str, json: bool) -> usize {
    let marker = if json { "\"rank\": 1," } else { "rank: 1," };
    text.find(marker).expect("rank 1 in the plan text")
}

/// Byte offset of `needle` at or after `from`.
fn after(text: &str, from: usize, needle: &str) -> usize {
    from + text[from..]
        .find(needle)
        .unwrap_or_else(|| panic!("no `{needle}` after byte {from}"))
}

/// `text` with the first `old` at or after `from` replaced by `new`.
fn replace_after(text: &str, from: usize, old: &str, new: &str) -> String {
    let at = after(text, from, old);
    format!("{}{new}{}", &text[..at], &text[at + old.len()..])
}

/// `text` without the list element (`(...)` or `{...}`) that contains byte `inside`, and
/// the comma after it.
fn remove_element(text: &str, inside: usize, json: bool) -> String {
    let (open, close) = if json { ('{', '}') } else { ('(', ')') };
    let start = text[..inside].rfind(open).unwrap();
    let mut depth = 0;
    let mut end = start;
    for (k, c) in text[start..].char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                end = start + k + 1;
                break;
            }
        }
    }
    let rest = text[end..].trim_start();
    let rest = rest.strip_prefix(',').unwrap_or(rest);
    format!("{}{}", &text[..start], rest)
}

/// Writes `text` next to `path` and loads it: it must fail with a plan error.
fn load_corrupted(path: &Path, name: &str, text: &str) -> (PathBuf, tpc::plan::PlanError) {
    let bad = path.with_file_name(format!(
        "{name}.{}",
        path.extension().unwrap().to_str().unwrap()
    ));
    std::fs::write(&bad, text).unwrap();
    match Plan::load(&bad) {
        Err(TpcError::Plan(e)) => {
            assert_eq!(e.path.as_deref(), Some(bad.as_path()));
            (bad, e)
        }
        Err(other) => panic!("{name}: expected a plan error, got: {other}"),
        Ok(_) => panic!("{name}: a corrupted plan loaded"),
    }
}

fn assert_says(e: &tpc::plan::PlanError, line: &str) {
    let text = e.to_string();
    assert!(text.contains(line), "missing:\n{line}\nin:\n{text}");
}

#[test]
fn a_changed_input_id_is_refused() {
    let dir = scratch("input");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let name = if json {
            "\"name\": \"model.layers.0.mlp.down_proj\","
        } else {
            "name: \"model.layers.0.mlp.down_proj\","
        };
        let at = after(&text, rank1(&text, json), name);
        let bad = replace_after(&text, at, "27,", "9999,");
        let (_, e) = load_corrupted(&path, "input", &bad);
        assert_eq!(e.problems.len(), 1, "{e}");
        assert_says(
            &e,
            "rank 1, instruction %29 `model.layers.0.mlp.down_proj`: input 0 is %9999, which no instruction of this rank defines; it must name an earlier instruction of the same rank",
        );
    }
}

#[test]
fn a_changed_local_shape_is_refused() {
    let dir = scratch("local-shape");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let entry = after(
            &text,
            rank1(&text, json),
            "\"model.layers.0.mlp.down_proj.weight\"",
        );
        // local_shape [64, 64] -> [64, 65]: the split dim no longer matches the ranges.
        let shape = after(&text, entry, "local_shape");
        let second = after(&text, after(&text, shape, "64") + 2, "64");
        let bad = replace_after(&text, second, "64", "65");
        let (_, e) = load_corrupted(&path, "local-shape", &bad);
        assert_eq!(e.problems.len(), 2, "{e}");
        assert_says(
            &e,
            "rank 1, weight entry `model.layers.0.mlp.down_proj.weight`: ranges plus padding cover 64 elements of dim 1 but local_shape[1] is 65; they must be equal",
        );
        assert_says(
            &e,
            "rank 1, instruction %28 `model.layers.0.mlp.down_proj.weight`: the param's shape is [64, 64] but its weight entry's local_shape is [64, 65]; they must be equal",
        );
    }
}

#[test]
fn a_dropped_weight_entry_is_refused() {
    let dir = scratch("weight");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let tensor = if json {
            "\"tensor\": \"model.layers.0.mlp.down_proj.weight\""
        } else {
            "tensor: \"model.layers.0.mlp.down_proj.weight\""
        };
        let at = after(&text, rank1(&text, json), tensor);
        let bad = remove_element(&text, at, json);
        let (_, e) = load_corrupted(&path, "weight", &bad);
        assert_eq!(
            e.problems[0].place,
            Place::Instr {
                rank: 1,
                id: 28,
                name: "model.layers.0.mlp.down_proj.weight".into()
            }
        );
        assert_eq!(e.problems.len(), 2, "{e}");
        assert_says(
            &e,
            "weight `model.layers.0.mlp.down_proj.weight` across ranks: no rank loads 64..128 of dim 1 (size 128); the ranks' ranges together must cover 0..128",
        );
        assert_says(
            &e,
            "rank 1, instruction %28 `model.layers.0.mlp.down_proj.weight`: its tensor `model.layers.0.mlp.down_proj.weight` has no entry in this rank's weight manifest; every param needs exactly one",
        );
    }
}

#[test]
fn a_collective_swapped_on_one_rank_is_refused() {
    let dir = scratch("collective");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let name = if json {
            "\"name\": \"model.layers.0.mlp_residual.all_reduce\","
        } else {
            "name: \"model.layers.0.mlp_residual.all_reduce\","
        };
        let at = after(&text, rank1(&text, json), name);
        let bad = if json {
            replace_after(
                &text,
                at,
                "\"AllReduce\": {}",
                "\"AllGather\": {\"dim\": 2}",
            )
        } else {
            replace_after(&text, at, "AllReduce()", "AllGather(dim: 2)")
        };
        let (_, e) = load_corrupted(&path, "collective", &bad);
        let order = e
            .problems
            .iter()
            .find(|p| matches!(p.problem, Problem::CollectiveOrder { .. }))
            .unwrap_or_else(|| panic!("no order problem in {e}"));
        assert_eq!(order.place, Place::Rank { rank: 1 });
        assert_says(
            &e,
            "rank 1: issues all_gather %31 of 64 elements per token as collective #2, but rank 0 issues all_reduce %31 of 64 elements per token; every rank must issue the same collectives (kind, size) in the same order",
        );
        // Its fact no longer follows either: an all-gather would double the features.
        assert_says(
            &e,
            "rank 1, instruction %31 `model.layers.0.mlp_residual.all_reduce`: records f32[B, S, 64], but its op on its recorded inputs gives f32[B, S, 128]",
        );
    }
}

#[test]
fn a_changed_collective_listing_is_refused() {
    let dir = scratch("listing");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let bytes = if json {
            "\"bytes_per_token\": 256"
        } else {
            "bytes_per_token: 256"
        };
        let bad = replace_after(&text, 0, bytes, &bytes.replace("256", "512"));
        let (_, e) = load_corrupted(&path, "listing", &bad);
        assert_eq!(e.problems.len(), 1, "{e}");
        assert_says(
            &e,
            "plan.collectives[0] (%4 `model.embed_tokens.all_reduce`): lists bytes_per_token = 512, but the facts give 256",
        );
    }
}

/// Commands that read a plan file get the same refusal: exit 1, the message, no panic.
#[test]
fn commands_never_run_a_plan_that_fails_verify() {
    let dir = scratch("cli");
    for (path, text) in saved(&dir) {
        let json = is_json(&path);
        let tensor = if json {
            "\"tensor\": \"model.layers.0.mlp.down_proj.weight\""
        } else {
            "tensor: \"model.layers.0.mlp.down_proj.weight\""
        };
        let at = after(&text, rank1(&text, json), tensor);
        let bad = remove_element(&text, at, json);
        let (bad_path, _) = load_corrupted(&path, "cli", &bad);
        let dot = |p: &Path| {
            Command::new(env!("CARGO_BIN_EXE_tpc"))
                .args(["dot", p.to_str().unwrap()])
                .output()
                .expect("tpc runs")
        };
        let good = dot(&path);
        assert!(
            good.status.success(),
            "{}",
            String::from_utf8_lossy(&good.stderr)
        );
        let o = dot(&bad_path);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.contains(&format!("plan `{}`", bad_path.display()))
                && err.contains("has no entry in this rank's weight manifest"),
            "{err}"
        );
    }
}
