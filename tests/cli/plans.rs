//! Issue 35, items 1 and 2 at the command line: `tpc run --plan` refuses an edited plan or
//! a plan of another model before loading anything, naming the place; `tpc verify --plan`
//! says what differs and judges the plan by computing.

use crate::cli::{fails_cleanly, scratch, stderr, tpc};
use std::process::Output;

pub(crate) fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        stderr(o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const GQA: &str = "tests/fixtures/checkpoints/llama-gqa";

#[test]
fn run_refuses_an_edited_plan_and_a_plan_of_another_model() {
    let dir = scratch("plans-provenance");
    let plan = dir.join("plan.json");
    let p = plan.to_str().unwrap();
    ok(&tpc(&["compile", GQA, "--tp", "2", "-o", p]));
    let run = |model: &str, plan: &str| {
        tpc(&[
            "run",
            model,
            "--plan",
            plan,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ])
    };
    // The unedited plan runs.
    ok(&run(GQA, p));
    // Another checkpoint of the same shapes (llama3 rope scaling): refused, the field named.
    let o = run("tests/fixtures/checkpoints/llama3-scaled", p);
    let e = fails_cleanly(&o);
    assert!(o.stdout.is_empty());
    assert!(e.contains("`rope_scaling`"), "{e}");
    // Two ranks' k_proj ranges exchanged: Plan::verify accepts it, the run does not.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let k = v["ranks"][0]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .position(|w| w["tensor"] == "model.layers.1.self_attn.k_proj.weight")
        .unwrap();
    let a = v["ranks"][0]["weights"][k]["ranges"].take();
    let b = v["ranks"][1]["weights"][k]["ranges"].take();
    v["ranks"][0]["weights"][k]["ranges"] = b;
    v["ranks"][1]["weights"][k]["ranges"] = a;
    let edited = dir.join("edited.txt");
    std::fs::write(&edited, serde_json::to_string(&v).unwrap()).unwrap();
    let edited = edited.to_str().unwrap();
    let o = run(GQA, edited);
    let e = fails_cleanly(&o);
    assert!(o.stdout.is_empty());
    assert!(
        e.contains(
            "rank 0, weight `model.layers.1.self_attn.k_proj.weight`, field `ranges[0].offset`"
        ),
        "{e}"
    );
    // verify computes it anyway: exit 3, with the difference as a note.
    let o = tpc(&["verify", GQA, "--plan", edited]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("note: the plan"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// An explicit graph's plan runs on a checkpoint: checked against the checkpoint's config
/// where tpc reads it, and against the graph it records where the config names an
/// architecture tpc has no preset for.
#[test]
fn a_graph_plan_runs_on_a_checkpoint_of_an_architecture_without_a_preset() {
    let dir = scratch("graph-plan");
    let graph = dir.join("graph.ron");
    let plan = dir.join("plan.ron");
    ok(&tpc(&["lower", GQA, "-o", graph.to_str().unwrap()]));
    ok(&tpc(&[
        "compile",
        graph.to_str().unwrap(),
        "--tp",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]));
    let run = |model: &str| {
        tpc(&[
            "run",
            model,
            "--plan",
            plan.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
        ])
    };
    let want = ok(&tpc(&[
        "run",
        GQA,
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "4",
    ]));
    assert_eq!(ok(&run(GQA)), want);
    // The same weights under a config tpc cannot read as a preset.
    let mystery = dir.join("mystery");
    std::fs::create_dir_all(&mystery).unwrap();
    for entry in std::fs::read_dir(GQA).unwrap() {
        let from = entry.unwrap().path();
        std::fs::copy(&from, mystery.join(from.file_name().unwrap())).unwrap();
    }
    let config = mystery.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["model_type"] = "mystery".into();
    v["architectures"] = serde_json::json!(["MysteryForCausalLM"]);
    std::fs::write(&config, v.to_string()).unwrap();
    assert_eq!(ok(&run(mystery.to_str().unwrap())), want);
    // A preset's plan has nothing to be checked against there: refused.
    let preset_plan = dir.join("preset.ron");
    ok(&tpc(&[
        "compile",
        GQA,
        "--tp",
        "2",
        "-o",
        preset_plan.to_str().unwrap(),
    ]));
    let o = tpc(&[
        "run",
        mystery.to_str().unwrap(),
        "--plan",
        preset_plan.to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]);
    let e = fails_cleanly(&o);
    assert!(e.contains("mystery"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
