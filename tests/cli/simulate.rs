//! `tpc simulate`: the JSON contract, refusals, and `--search` over the shipped profiles.

use crate::scratch::Scratch;
use std::process::{Command, Output};

fn tpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("tpc runs")
}

const NVSWITCH: &str = "models/hw/h100-sxm-nvswitch-8.ron";

#[test]
fn json_has_the_contract_fields() {
    let o = tpc(&[
        "simulate",
        "models/llama3-70b.ron",
        "--tp",
        "8",
        "--hw",
        NVSWITCH,
        "--batch",
        "4",
        "--prompt-len",
        "512",
        "--gen",
        "64",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for phase in ["prefill", "decode_step"] {
        let p = &v[phase];
        let (t, c, m, k) = (
            p["time_s"].as_f64().unwrap(),
            p["compute_s"].as_f64().unwrap(),
            p["memory_s"].as_f64().unwrap(),
            p["comm_s"].as_f64().unwrap(),
        );
        let el = p["elementwise_s"].as_f64().unwrap();
        assert!(t > 0.0 && c > 0.0 && m > 0.0 && k > 0.0 && el > 0.0, "{p}");
        assert!((t - (c.max(m) + el + k)).abs() < 1e-12, "{p}");
    }
    assert!(v["memory_per_rank_bytes"].as_u64().unwrap() > 17_000_000_000);
    assert_eq!(v["fits"], true);
    let tps = &v["tokens_per_s"];
    let prefill = tps["prefill"].as_f64().unwrap();
    let expect = 4.0 * 512.0 / v["prefill"]["time_s"].as_f64().unwrap();
    assert!((prefill / expect - 1.0).abs() < 1e-9);
    assert!(tps["decode"].as_f64().unwrap() > 0.0);
}

/// A token count is `--prompt-len` (as in `bench` and `verify`; `run --prompt` is text);
/// `--prompt`, its old name in `simulate` and `compile`, still works but is not shown.
#[test]
fn the_prompt_token_count_is_prompt_len_and_the_old_spelling_still_works() {
    for command in ["simulate", "compile"] {
        let decision = |flag: &[&str]| {
            let args = [
                &[
                    command,
                    "models/tiny-llama.ron",
                    "--tp",
                    "2",
                    "--hw",
                    NVSWITCH,
                ][..],
                flag,
                &["--json"],
            ]
            .concat();
            let o = tpc(&args);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            v["sequence_parallel_decision"].clone()
        };
        let new = decision(&["--prompt-len", "300"]);
        assert_eq!(new["prompt"], 300, "{command}: {new}");
        assert_eq!(decision(&["--prompt", "300"]), new, "{command}");
        assert_eq!(decision(&[])["prompt"], 128, "{command}");
        let o = tpc(&[command, "--help"]);
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(help.contains("--prompt-len <PROMPT_LEN>"), "{help}");
        assert_eq!(
            help.matches("--prompt").count(),
            help.matches("--prompt-len").count(),
            "{command} --help shows only --prompt-len: {help}"
        );
    }
}

/// `--hw` takes a shipped profile's name (from any folder: the profiles are built in) or a
/// file; an unknown one is an error that lists the names.
#[test]
fn hw_takes_a_shipped_name_and_an_unknown_one_lists_them() {
    let elsewhere = std::env::temp_dir();
    let model = std::fs::canonicalize("models/tiny-llama.ron").unwrap();
    let model = model.to_str().unwrap();
    let json = |command: &str, hw: &str, dir: &std::path::Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_tpc"))
            .args([command, model, "--tp", "2", "--hw", hw, "--json"])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let here = std::env::current_dir().unwrap();
    for command in ["simulate", "compile"] {
        let by_path = json(command, NVSWITCH, &here);
        assert_eq!(json(command, "h100-sxm-nvswitch-8", &elsewhere), by_path);
        assert_eq!(
            json(command, "h100-sxm-nvswitch-8.ron", &elsewhere),
            by_path
        );
    }
    let v = json("simulate", "a100-pcie-8", &elsewhere);
    assert_eq!(v["hw"], "8x A100 80GB PCIe, PCIe Gen4");
    for unknown in ["h100", "models/hw/h200.ron"] {
        for command in ["simulate", "compile"] {
            let o = tpc(&[command, "models/tiny-llama.ron", "--hw", unknown]);
            assert_eq!(o.status.code(), Some(1));
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(
                e.contains(&format!("`{unknown}`"))
                    && e.contains("a100-pcie-8, h100-ib400-2x8, h100-sxm-nvswitch-8")
                    && !e.contains("panicked"),
                "{e}"
            );
        }
    }
}

#[test]
fn a_plan_that_does_not_fit_says_by_how_much_and_search_ranks_fitting_plans_first() {
    let o = tpc(&["simulate", "models/llama3-70b.ron", "--hw", NVSWITCH]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("does NOT fit (short by"), "{text}");
    let o = tpc(&[
        "simulate",
        "models/llama3-70b.ron",
        "--hw",
        NVSWITCH,
        "--search",
        "--json",
    ]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ranked = v.as_array().unwrap();
    let tps: Vec<u64> = ranked
        .iter()
        .filter(|e| e["pp"] == 1)
        .map(|e| e["tp"].as_u64().unwrap())
        .collect();
    // Every tp up to the 8 devices (3, 5, 6 and 7 deal the 8 kv groups unevenly), more
    // ranks first.
    assert_eq!(tps, vec![8, 7, 6, 5, 4, 3, 2, 1], "{tps:?}");
    // Every (tp, pp) with tp·pp ≤ 8 devices is ranked.
    assert!(ranked
        .iter()
        .all(|e| e["tp"].as_u64().unwrap() * e["pp"].as_u64().unwrap() <= 8));
    assert!(ranked.iter().any(|e| e["tp"] == 4 && e["pp"] == 2));
    assert_eq!(ranked.last().unwrap()["fits"], false);
    // What a tie is broken by: the collectives a pass runs, with one send per stage boundary.
    let collectives = |tp: u64, pp: u64| {
        ranked
            .iter()
            .find(|e| e["tp"] == tp && e["pp"] == pp)
            .unwrap()["collectives_per_pass"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(collectives(1, 1), 0);
    assert_eq!(collectives(1, 2), 1);
    assert!(collectives(4, 1) > 80, "two all-reduces per layer");
    assert_eq!(collectives(4, 2), collectives(4, 1) + 1);
}

#[test]
fn bad_requests_and_profiles_are_refused() {
    let e = tpc(&[
        "simulate",
        "models/llama3-70b.ron",
        "--tp",
        "16",
        "--hw",
        NVSWITCH,
    ]);
    assert_eq!(e.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&e.stderr).contains("needs 16 devices"));
    let dir = Scratch::new("simulate", "profiles");
    let bad = dir.join("bad.ron");
    let text = std::fs::read_to_string(NVSWITCH)
        .unwrap()
        .replace("memory_bandwidth: 3.35e12", "memory_bandwidth: -1.0");
    std::fs::write(&bad, text).unwrap();
    let o = tpc(&[
        "simulate",
        "models/llama3-8b.ron",
        "--hw",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("memory_bandwidth is -1") && !e.contains("panicked"),
        "{e}"
    );
    // More pipeline stages than layers: an error listing the valid ones.
    let o = tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--hw",
        NVSWITCH,
        "--pp",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("valid: 1 to 2") && !e.contains("panicked"),
        "{e}"
    );
    // tp·pp beyond the profile's devices.
    let o = tpc(&[
        "simulate",
        "models/llama3-8b.ron",
        "--hw",
        NVSWITCH,
        "--tp",
        "4",
        "--pp",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs 16 devices"));
}

#[test]
fn pipeline_stages_show_in_the_json() {
    let run = |pp: &str| {
        let o = tpc(&[
            "simulate",
            "models/llama3-8b.ron",
            "--hw",
            NVSWITCH,
            "--tp",
            "2",
            "--pp",
            pp,
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let one = run("1");
    assert_eq!(one["pp"], 1);
    assert!(one.get("stages").is_none());
    let two = run("2");
    assert_eq!(two["pp"], 2);
    let stages = two["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2);
    // 32 equal layers and an untied embedding and LM head of the same size; stages are
    // balanced by parameter bytes plus linear weights (compute), as `compile --pp` cuts
    // them: the embedding is bytes without compute, the LM head both, so the first stage
    // takes 17 layers (largest stage cost 1.021 of an even half, against 1.035 with 16).
    assert_eq!(stages[0]["layers"], 17);
    assert_eq!(stages[1]["first_layer"], 17);
    // Per rank at tp 2, bf16: embedding 128256·4096 / 2 elements, a layer 218 103 808 / 2
    // linear elements and two replicated norms of 4096, the final norm 4096.
    let (e, l, norm) = (525_336_576.0, 218_103_808.0 + 16_384.0, 8_192.0);
    let w = two["weight_bytes_per_rank"].as_u64().unwrap() as f64;
    let w1 = one["weight_bytes_per_rank"].as_u64().unwrap() as f64;
    assert!(
        (w1 / (2.0 * e + 32.0 * l + norm) - 1.0).abs() < 1e-9,
        "{w1}"
    );
    assert!((w / (e + 17.0 * l) - 1.0).abs() < 1e-6, "{w} {w1}");
}

#[test]
fn a_quick_calibration_writes_a_profile_that_simulate_accepts() {
    let dir = Scratch::new("simulate", "calibrate");
    let out = dir.join("host.ron");
    let o = tpc(&["calibrate", "--quick", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("GEMM bf16 weights") && table.contains("ring all-reduce β"),
        "{table}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.contains("shared") && text.contains("tpc calibrate --quick"),
        "{text}"
    );
    assert!(text.contains("rough: true"), "{text}");
    // simulate says the estimate is rough: in the table, in --json, in --search.
    let simulate = |hw: &str, extra: &[&str]| {
        let args = [
            &["simulate", "models/tiny-llama.ron", "--hw", hw][..],
            extra,
        ]
        .concat();
        let o = tpc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let quick = out.to_str().unwrap();
    assert!(
        simulate(quick, &[]).contains("rough profile:") && simulate(quick, &[]).contains("--quick"),
        "{}",
        simulate(quick, &[])
    );
    assert!(simulate(quick, &["--search"]).contains("rough profile:"));
    let v: serde_json::Value = serde_json::from_str(&simulate(quick, &["--json"])).unwrap();
    assert_eq!(v["rough_profile"], true, "{v}");
    let ranked: serde_json::Value =
        serde_json::from_str(&simulate(quick, &["--search", "--json"])).unwrap();
    assert!(ranked
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["rough_profile"] == true));
    // A quick profile written before the field: its first source line says --quick.
    let old = dir.join("old-quick.ron");
    std::fs::write(&old, text.replace("rough: true,", "")).unwrap();
    assert_ne!(std::fs::read_to_string(&old).unwrap(), text);
    let v: serde_json::Value =
        serde_json::from_str(&simulate(old.to_str().unwrap(), &["--json"])).unwrap();
    assert_eq!(v["rough_profile"], true, "{v}");
    // A shipped profile is not rough.
    assert!(!simulate(NVSWITCH, &[]).contains("rough"));
    let v: serde_json::Value = serde_json::from_str(&simulate(NVSWITCH, &["--json"])).unwrap();
    assert_eq!(v["rough_profile"], false, "{v}");
    for tp in ["1", "2"] {
        let o = tpc(&[
            "simulate",
            "models/tiny-llama.ron",
            "--tp",
            tp,
            "--hw",
            out.to_str().unwrap(),
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        // The CPU runtime's types: tiny-llama is an f32 model.
        assert_eq!(v["weight_dtype"], "F32");
        assert_eq!(v["activation_dtype"], "F32");
        assert!(v["decode_step"]["overhead_s"].as_f64().unwrap() > 0.0);
    }
    // -o naming the model it measures is refused before any measurement, input untouched.
    let model = dir.join("model.ron");
    std::fs::copy("models/tiny-llama.ron", &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    let o = tpc(&[
        "calibrate",
        "--quick",
        "--model",
        model.to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("it is the input"), "{e}");
    assert_eq!(std::fs::read(&model).unwrap(), before);
    // A folder that does not exist is refused too.
    let o = tpc(&[
        "calibrate",
        "--quick",
        "-o",
        dir.join("no/such/x.ron").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sequence_parallel_divides_the_token_wise_work_and_prices_its_collectives() {
    let estimate = |extra: &[&str]| {
        llama8b_tp8(
            &["--batch", "1", "--prompt-len", "4096", "--gen", "16"],
            extra,
        )
    };
    let plain = estimate(&["--sequence-parallel=off"]);
    let sp = estimate(&["--sequence-parallel"]);
    let f = |v: &serde_json::Value, phase: &str, key: &str| v[phase][key].as_f64().unwrap();
    // The norms and residual adds run on 1/8 of the tokens; the rest (rope, activation, mul
    // on whole values) does not shrink, so the total falls by less than 8×.
    let (a, b) = (
        f(&plain, "prefill", "elementwise_s"),
        f(&sp, "prefill", "elementwise_s"),
    );
    assert!(b < a && b > a / 8.0, "{a} {b}");
    // Same FLOPs and weights; its reduce-scatters and all-gathers are priced as such.
    assert_eq!(
        f(&plain, "prefill", "compute_s"),
        f(&sp, "prefill", "compute_s")
    );
    assert!(f(&sp, "decode_step", "comm_s") > f(&plain, "decode_step", "comm_s"));
    // Norm fusion moves the same bytes: the same estimate.
    let fused = estimate(&["--fuse-norm", "--sequence-parallel=off"]);
    assert_eq!(fused["prefill"], plain["prefill"]);
}

/// `simulate`'s JSON for llama3-8b at tp 8 on the NVSwitch profile and a workload.
fn llama8b_tp8(workload: &[&str], extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "simulate",
        "models/llama3-8b.ron",
        "--tp",
        "8",
        "--hw",
        NVSWITCH,
        "--json",
    ];
    args.extend(workload);
    args.extend(extra);
    let o = tpc(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn the_cost_model_chooses_sequence_parallelism_for_long_prompts_only() {
    let long = ["--batch", "8", "--prompt-len", "8192", "--gen", "1"];
    let chat = ["--batch", "1", "--prompt-len", "16", "--gen", "1024"];
    let workload_s = |v: &serde_json::Value, gen: f64| {
        v["prefill"]["time_s"].as_f64().unwrap()
            + gen * v["decode_step"]["time_s"].as_f64().unwrap()
    };
    for (work, gen, want) in [(&long, 1.0, true), (&chat, 1024.0, false)] {
        let auto = llama8b_tp8(work, &[]);
        let d = &auto["sequence_parallel_decision"];
        assert_eq!(d["chosen"], want, "{d}");
        // The two prices are the forced plans' estimates for the whole workload, and the
        // estimate printed is the one of the plan kept.
        let on = llama8b_tp8(work, &["--sequence-parallel"]);
        let off = llama8b_tp8(work, &["--sequence-parallel=off"]);
        assert!(on.get("sequence_parallel_decision").is_none());
        let (with_s, without_s) = (
            d["with_s"].as_f64().unwrap(),
            d["without_s"].as_f64().unwrap(),
        );
        assert!((with_s / workload_s(&on, gen) - 1.0).abs() < 1e-9, "{d}");
        assert!(
            (without_s / workload_s(&off, gen) - 1.0).abs() < 1e-9,
            "{d}"
        );
        assert_eq!(with_s < without_s, want);
        let kept = if want { &on } else { &off };
        assert_eq!(auto["prefill"], kept["prefill"]);
        assert_eq!(auto["decode_step"], kept["decode_step"]);
    }
}

#[test]
fn compile_with_a_profile_keeps_the_cheaper_plan_and_says_why() {
    let compile = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["compile", "models/llama3-8b.ron", "--tp", "8", "--json"];
        args.extend(extra);
        let o = tpc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let kinds = |v: &serde_json::Value| -> Vec<String> {
        v["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["kind"].as_str().unwrap().to_string())
            .collect()
    };
    let long = [
        "--hw",
        NVSWITCH,
        "--batch",
        "8",
        "--prompt-len",
        "8192",
        "--gen",
        "1",
    ];
    let v = compile(&long);
    assert!(kinds(&v).iter().any(|k| k == "reduce_scatter"), "{v}");
    assert_eq!(v["sequence_parallel_decision"]["chosen"], true);
    let note = v["notes"].as_array().unwrap().iter().any(|n| {
        n.as_str()
            .is_some_and(|n| n.starts_with("sequence parallelism chosen by cost on 8x H100"))
    });
    assert!(note, "{v}");
    // Refused, forced off: the plain plan and no decision.
    let mut off = long.to_vec();
    off.push("--sequence-parallel=off");
    let v = compile(&off);
    assert!(!kinds(&v).iter().any(|k| k == "reduce_scatter"));
    assert!(v.get("sequence_parallel_decision").is_none());
    // Without a profile nothing is priced: the plain plan.
    let v = compile(&[]);
    assert!(!kinds(&v).iter().any(|k| k == "reduce_scatter"));
    assert!(v.get("sequence_parallel_decision").is_none());
    // The default workload (batch 1, prompt 128, 128 new tokens) keeps the plain plan.
    let v = compile(&["--hw", NVSWITCH]);
    assert_eq!(v["sequence_parallel_decision"]["chosen"], false);
    assert!(!kinds(&v).iter().any(|k| k == "reduce_scatter"));
    // A value the flag does not take is a usage error.
    let o = tpc(&[
        "compile",
        "models/llama3-8b.ron",
        "--sequence-parallel=maybe",
    ]);
    assert_eq!(o.status.code(), Some(2));
}

/// A profile's `rank_speeds` for unequal devices: `simulate` paces by the slowest rank and
/// `--search` proposes shares on a CPU host's and on a GPU profile (both backends skip the
/// padding); alike devices keep the even split.
#[test]
fn unequal_devices_get_shares_proposed() {
    let dir = Scratch::new("simulate", "unequal");
    let with_speeds = |text: &str, name: &str, speeds: &str| {
        let end = text.trim_end().rfind(')').unwrap();
        let edited = format!(
            "{},\n    rank_speeds: [{speeds}],\n)\n",
            text[..end].trim_end().trim_end_matches(',')
        );
        let path = dir.join(name);
        std::fs::write(&path, edited).unwrap();
        path.to_str().unwrap().to_string()
    };
    let host = dir.join("host.ron");
    let o = tpc(&["calibrate", "--quick", "-o", host.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let host_text = std::fs::read_to_string(&host).unwrap();
    let cpu = with_speeds(&host_text, "cpu.ron", "1.0, 0.25");
    let gpu = with_speeds(
        &std::fs::read_to_string(NVSWITCH).unwrap(),
        "gpu.ron",
        "1.0, 0.25",
    );
    let run = |hw: &str, extra: &[&str]| {
        let args = [
            &["simulate", "models/tinyllama-1.1b.ron", "--hw", hw][..],
            &[
                "--sequence-parallel=off",
                "--prompt-len",
                "64",
                "--gen",
                "32",
            ],
            extra,
        ]
        .concat();
        let o = tpc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let decode = |hw: &str, extra: &[&str]| {
        let v: serde_json::Value =
            serde_json::from_str(&run(hw, &[&["--tp", "2", "--json"], extra].concat())).unwrap();
        v["tokens_per_s"]["decode"].as_f64().unwrap()
    };
    // The slow rank paces the even split; shares toward the fast one win on the CPU host.
    assert!(decode(&cpu, &["--tp-shares", "4,1"]) > 1.5 * decode(&cpu, &[]));
    // The same speeds written apart price the same; a rank slow at compute only (memory
    // as fast) slows the compute-bound prompt at least as much as the decode.
    let apart = with_speeds(
        &host_text,
        "apart.ron",
        "1.0, (compute: 0.25, memory: 0.25)",
    );
    assert_eq!(
        decode(&apart, &["--tp-shares", "4,1"]),
        decode(&cpu, &["--tp-shares", "4,1"])
    );
    let compute_only = with_speeds(
        &host_text,
        "compute.ron",
        "1.0, (compute: 0.25, memory: 1.0)",
    );
    let both = |hw: &str| {
        let v: serde_json::Value =
            serde_json::from_str(&run(hw, &["--tp", "2", "--json"])).unwrap();
        let t = &v["tokens_per_s"];
        (
            t["prefill"].as_f64().unwrap(),
            t["decode"].as_f64().unwrap(),
        )
    };
    let alike = with_speeds(&host_text, "alike.ron", "1.0, 1.0");
    let (slow_prefill, slow_decode) = both(&compute_only);
    let (prefill, decode_alike) = both(&alike);
    // The profile is measured here (and under load in CI), so only what holds for any
    // host: a prompt does more products per weight byte than a decode step, so it slows at
    // least as much, and a 64-token prompt on a CPU is compute-bound enough to slow.
    let (p, d) = (slow_prefill / prefill, slow_decode / decode_alike);
    assert!(
        p <= d * (1.0 + 1e-9) && p < 0.75,
        "prefill {slow_prefill} vs {prefill}, decode {slow_decode} vs {decode_alike}"
    );
    let text = run(&cpu, &["--search"]);
    let line = text
        .lines()
        .find(|l| l.starts_with("unequal devices (rank_speeds 1, 0.25): --tp 2 --tp-shares "))
        .unwrap_or_else(|| panic!("{text}"));
    let shares: Vec<u64> = line
        .split("--tp-shares ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap()
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    assert!(shares[0] >= 3 * shares[1], "{line}");
    let v: serde_json::Value = serde_json::from_str(&run(&cpu, &["--search", "--json"])).unwrap();
    assert!(
        v["ranked"].is_array() && v["shares_proposal"]["shares"].is_array(),
        "{v}"
    );
    // The CUDA backend skips the padding too: shares are proposed on a GPU profile.
    let text = run(&gpu, &["--search"]);
    assert!(
        text.contains("unequal devices (rank_speeds 1, 0.25): --tp 2 --tp-shares "),
        "{text}"
    );
    // Alike devices: the even split is the fastest.
    let alike_gpu = with_speeds(
        &std::fs::read_to_string(NVSWITCH).unwrap(),
        "alike-gpu.ron",
        "1.0, 1.0",
    );
    let text = run(&alike_gpu, &["--search"]);
    assert!(
        text.contains("the even split at --tp 2 is the fastest"),
        "{text}"
    );
    // A speed outside the bounds is refused with the field's name.
    let bad = dir.join("bad.ron");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&cpu)
            .unwrap()
            .replace("0.25", "0.0"),
    )
    .unwrap();
    let o = tpc(&[
        "simulate",
        "models/tinyllama-1.1b.ron",
        "--hw",
        bad.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("rank_speeds"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--dp D --ep`: the replicas share their experts, so a rank holds fewer weights than the
/// same tp alone (with stages too, stage by stage), and the throughput is the replicas'
/// together; `--dp` alone is refused.
#[test]
fn experts_over_replicas_are_priced_with_their_memory_and_swaps() {
    let sim = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "simulate",
            "models/qwen3-30b-a3b.ron",
            "--hw",
            "h100-sxm-nvswitch-8",
            "--moe",
            "expert",
            "--tp",
            "2",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = tpc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (alone, shared) = (sim(&[]), sim(&["--dp", "4", "--ep"]));
    assert_eq!(alone["dp"], 1);
    assert_eq!(shared["dp"], 4);
    let w = |e: &serde_json::Value| e["weight_bytes_per_rank"].as_f64().unwrap();
    // Experts are about 95 % of Qwen3-30B-A3B: a quarter of them is less than a third.
    assert!(w(&shared) < w(&alone) / 3.0, "{shared} vs {alone}");
    let comm = |e: &serde_json::Value| e["decode_step"]["comm_s"].as_f64().unwrap();
    assert!(comm(&shared) > comm(&alone));
    // With two stages each stage shares its own layers' experts: each stage's rank holds
    // less than the stage alone, and the replicas' throughput is priced.
    let (staged, staged_shared) = (
        sim(&["--pp", "2"]),
        sim(&["--pp", "2", "--dp", "2", "--ep"]),
    );
    assert_eq!(
        (staged_shared["pp"].clone(), staged_shared["dp"].clone()),
        (2.into(), 2.into())
    );
    let stages = |e: &serde_json::Value| e["stages"].as_array().unwrap().clone();
    assert_eq!(stages(&staged_shared).len(), 2);
    for (a, b) in stages(&staged).iter().zip(&stages(&staged_shared)) {
        let w = |s: &serde_json::Value| s["weight_bytes_per_rank"].as_f64().unwrap();
        // Half the experts, about 95 % of the weights.
        assert!(w(b) < 0.6 * w(a), "{b} vs {a}");
    }
    let decode = |e: &serde_json::Value| e["tokens_per_s"]["decode"].as_f64().unwrap();
    assert!(
        decode(&staged_shared) > decode(&staged),
        "{staged_shared} vs {staged}"
    );
    let o = tpc(&[
        "simulate",
        "models/qwen3-30b-a3b.ron",
        "--hw",
        "h100-sxm-nvswitch-8",
        "--tp",
        "2",
        "--dp",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("without --ep"));
    let o = tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--hw",
        "h100-sxm-nvswitch-8",
        "--dp",
        "2",
        "--ep",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no mixture-of-experts"));
}
