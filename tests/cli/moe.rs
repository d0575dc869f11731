//! `--moe` at the command line: both splits run a mixture of experts to the same tokens,
//! `auto` leaves the choice to the cost model when a profile is given, and a dense model
//! refuses the flag.

use crate::cli::{fails_cleanly, scratch, tpc};
use crate::plans::ok;
use serde_json::Value;

const QWEN2_MOE: &str = "tests/fixtures/checkpoints/qwen2-moe";

#[test]
fn every_split_runs_to_the_same_tokens_and_auto_without_a_profile_is_tensor() {
    let run = |moe: &str| {
        ok(&tpc(&[
            "run",
            QWEN2_MOE,
            "--tp",
            "3",
            "--moe",
            moe,
            "--prompt-ids",
            "3,71,249",
            "--max-new-tokens",
            "4",
        ]))
    };
    let tensor = run("tensor");
    assert_eq!(run("expert"), tensor);
    assert_eq!(run("auto"), tensor);
    // The plan records the split it was compiled with: the expert stacks' split dim.
    let dir = scratch("moe-plans");
    let stack_dim = |moe: &str| -> Value {
        let path = dir.join(format!("{moe}.json"));
        let p = path.to_str().unwrap();
        ok(&tpc(&[
            "compile", QWEN2_MOE, "--tp", "2", "--moe", moe, "-o", p,
        ]));
        let plan: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        plan["ranks"][0]["weights"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["tensor"] == "model.layers.0.mlp.experts.{e}.gate_proj.weight")
            .map(|w| w["dim"].clone())
            .unwrap()
    };
    assert_eq!(stack_dim("tensor"), 1);
    assert_eq!(stack_dim("auto"), 1);
    assert_eq!(stack_dim("expert"), 0);
}

#[test]
fn auto_with_a_profile_prices_both_splits_and_keeps_the_cheaper() {
    let simulate = |extra: &[&str]| {
        let mut args = vec![
            "simulate",
            "models/qwen3-30b-a3b.ron",
            "--tp",
            "8",
            "--hw",
            "h100-sxm-nvswitch-8",
            "--moe",
            "auto",
        ];
        args.extend_from_slice(extra);
        ok(&tpc(&args))
    };
    for (batch, prompt, gen) in [("1", "16", "256"), ("64", "2048", "1")] {
        let out = simulate(&[
            "--batch",
            batch,
            "--prompt-len",
            prompt,
            "--gen",
            gen,
            "--json",
        ]);
        let e: Value = serde_json::from_str(&out).unwrap();
        let d = &e["expert_split_decision"];
        let (t, x) = (
            d["tensor_s"].as_f64().unwrap(),
            d["expert_s"].as_f64().unwrap(),
        );
        assert!(t > 0.0 && x > 0.0, "{d}");
        let cheaper = if x < t { "expert" } else { "tensor" };
        assert_eq!(d["chosen"], cheaper, "{d}");
        assert_eq!(d["batch"].as_u64().unwrap().to_string(), batch);
        // The estimate is the kept plan's: its time for the workload is the cheaper one.
        let workload = e["prefill"]["time_s"].as_f64().unwrap()
            + gen.parse::<f64>().unwrap() * e["decode_step"]["time_s"].as_f64().unwrap();
        assert!(
            (workload - t.min(x)).abs() <= 1e-9 * workload,
            "{workload} {d}"
        );
    }
    // The text report says why.
    let text = simulate(&[]);
    assert!(
        text.contains("experts split by") && text.contains("dealt whole (expert)"),
        "{text}"
    );
}

#[test]
fn a_dense_model_refuses_every_moe_word() {
    for moe in ["tensor", "expert", "auto"] {
        let e = fails_cleanly(&tpc(&[
            "compile",
            "models/tiny-llama.ron",
            "--tp",
            "2",
            "--moe",
            moe,
        ]));
        assert!(e.contains("has none; drop --moe"), "{moe}: {e}");
    }
    let e = fails_cleanly(&tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--tp",
        "2",
        "--hw",
        "h100-sxm-nvswitch-8",
        "--moe",
        "auto",
    ]));
    assert!(e.contains("has none; drop --moe"), "{e}");
}

#[test]
fn explain_names_the_split_and_why_auto_chose_it() {
    let text = ok(&tpc(&[
        "explain",
        "models/qwen3-30b-a3b.ron",
        "--tp",
        "8",
        "--moe",
        "auto",
        "--hw",
        "h100-sxm-nvswitch-8",
        "--batch",
        "1",
        "--gen",
        "256",
        "*layers.0.mlp.experts*gate_proj*",
    ]));
    let note = text.lines().next().unwrap();
    assert!(note.starts_with("note: experts split by "), "{text}");
    let chosen = if note.starts_with("note: experts split by expert") {
        "--moe expert"
    } else {
        "--moe tensor"
    };
    assert!(
        text.contains(&format!("mixture of experts, {chosen}")),
        "{text}"
    );
    let dealt = ok(&tpc(&[
        "explain",
        "models/tiny-qwen3-moe.ron",
        "--tp",
        "2",
        "--moe",
        "expert",
        "*experts*gate*",
    ]));
    assert!(
        dealt.contains("mixture of experts, --moe expert"),
        "{dealt}"
    );
    let e = fails_cleanly(&tpc(&[
        "explain",
        "models/tiny-qwen3-moe.ron",
        "--tp",
        "2",
        "--hw",
        "h100-sxm-nvswitch-8",
    ]));
    assert!(e.contains("--hw prices `--moe auto` only"), "{e}");
}

/// `--dp D --ep`: the replicas share the experts (each holds 1/D of its tp rank's) and
/// print the tokens `--dp 1` prints; the load report lists every rank of the EP group (DP ×
/// TP) and adds up to the same (token, expert) pairs; with stages too. Refused where it
/// cannot apply.
#[test]
fn experts_dealt_over_replicas_print_what_one_replica_prints() {
    let dir = scratch("moe-ep");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\":[3,71,249],\"max_new_tokens\":6}\n{\"prompt_ids\":[9,8],\"max_new_tokens\":2}\n{\"prompt_ids\":[5,5,5,5]}\n",
    )
    .unwrap();
    let p = prompts.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            QWEN2_MOE,
            "--moe",
            "expert",
            "--prompts",
            p,
            "--max-new-tokens",
            "4",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = ok(&tpc(&args));
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let tokens: Vec<Value> = lines[..3].iter().map(|l| l["generated"].clone()).collect();
        let loads: Vec<u64> = lines[3]["summary"]["moe_routed_pairs_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        (tokens, loads)
    };
    let (alone, alone_loads) = run(&["--tp", "2"]);
    for (tp, dp) in [("1", "3"), ("2", "2")] {
        let (tokens, loads) = run(&["--tp", tp, "--dp", dp, "--ep"]);
        assert_eq!(tokens, alone, "tp {tp} dp {dp} --ep");
        let ranks: usize = tp.parse::<usize>().unwrap() * dp.parse::<usize>().unwrap();
        assert_eq!(loads.len(), ranks, "tp {tp} dp {dp}: {loads:?}");
        assert_eq!(
            loads.iter().sum::<u64>(),
            alone_loads.iter().sum::<u64>(),
            "tp {tp} dp {dp}: {loads:?} vs {alone_loads:?}"
        );
    }
    let refused = |args: &[&str], says: &str| {
        let e = fails_cleanly(&tpc(args));
        assert!(e.contains(says), "{args:?}: {e}");
    };
    refused(
        &[
            "run",
            "tests/fixtures/checkpoints/llama-gqa",
            "--dp",
            "2",
            "--ep",
            "--prompts",
            p,
        ],
        "no mixture-of-experts layers",
    );
    // With two stages each stage shares its layers' experts with the same stage of the
    // other replica: the same tokens.
    let (staged, _) = run(&["--tp", "1", "--pp", "2", "--dp", "2", "--ep"]);
    assert_eq!(staged, alone, "tp 1 pp 2 dp 2 --ep");
}

/// `simulate --search` on a mixture of experts also ranks replicas sharing the experts
/// (`--dp D --ep`), the batch dealt over them; a dense model's table has no such column.
#[test]
fn search_ranks_replicas_sharing_the_experts_beside_tp_and_pp() {
    let search = |model: &str, json: bool| {
        let mut args = vec![
            "simulate",
            model,
            "--hw",
            "h100-sxm-nvswitch-8",
            "--search",
            "--batch",
            "8",
            "--prompt-len",
            "512",
            "--gen",
            "128",
        ];
        if json {
            args.push("--json");
        }
        ok(&tpc(&args))
    };
    let text = search("models/qwen3-30b-a3b.ron", false);
    let header = text.lines().next().unwrap();
    assert!(
        header.split_whitespace().take(3).eq(["tp", "pp", "dp"]),
        "{text}"
    );
    assert!(text.contains("the batch of 8 dealt over them"), "{text}");
    let ranked: Value = serde_json::from_str(&search("models/qwen3-30b-a3b.ron", true)).unwrap();
    // (tp, pp, dp): every stage count too, each stage sharing its layers' experts.
    let mut layouts: Vec<(u64, u64, u64)> = ranked
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["dp"].as_u64().unwrap() > 1)
        .map(|e| {
            let n = |k: &str| e[k].as_u64().unwrap();
            (n("tp"), n("pp"), n("dp"))
        })
        .collect();
    layouts.sort();
    assert_eq!(
        layouts,
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
    // Each such row is what `simulate --pp P --dp D --ep` prices alone for the batch over D
    // replicas, with one stage or more.
    for (tp, pp, dp) in [(2u64, 1u64, 4u64), (2, 2, 2)] {
        let [tp_s, pp_s, dp_s, batch] = [tp, pp, dp, 8 / dp].map(|n| n.to_string());
        let alone: Value = serde_json::from_str(&ok(&tpc(&[
            "simulate",
            "models/qwen3-30b-a3b.ron",
            "--hw",
            "h100-sxm-nvswitch-8",
            "--tp",
            &tp_s,
            "--pp",
            &pp_s,
            "--dp",
            &dp_s,
            "--ep",
            "--batch",
            &batch,
            "--prompt-len",
            "512",
            "--gen",
            "128",
            "--json",
        ])))
        .unwrap();
        let row = ranked
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["tp"] == tp && e["pp"] == pp && e["dp"] == dp)
            .unwrap();
        let what = format!("tp {tp} pp {pp} dp {dp}");
        assert_eq!(row["tokens_per_s"], alone["tokens_per_s"], "{what}");
        assert_eq!(
            row["memory_per_rank_bytes"], alone["memory_per_rank_bytes"],
            "{what}"
        );
    }
    let dense = search("models/llama3-8b.ron", false);
    assert!(
        dense
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .take(3)
            .eq(["tp", "pp", "prefill"]),
        "{dense}"
    );
}
