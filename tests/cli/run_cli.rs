//! `tpc run` as users drive it: saved plans, prompt files, refusals before loading.

use crate::scratch::Scratch;
use std::path::PathBuf;
use std::process::{Command, Output};

const MODEL: &str = "tests/fixtures/checkpoints/llama-gqa";
const PROMPT: &str = "3,71,249,130,12,188,64";

fn tpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("tpc runs")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!e.contains("panicked"), "{e}");
    e
}

fn scratch(test: &str) -> Scratch {
    Scratch::new("run", test)
}

#[test]
fn a_saved_plan_runs_bit_identically_to_compiling_on_the_fly() {
    let dir = scratch("plan");
    for ext in ["ron", "json"] {
        let plan = dir.join(format!("plan.{ext}"));
        let p = plan.to_str().unwrap();
        ok(&tpc(&["compile", MODEL, "--tp", "2", "-o", p]));
        let fly = dir.join(format!("fly-{ext}.safetensors"));
        let saved = dir.join(format!("saved-{ext}.safetensors"));
        let a = ok(&tpc(&[
            "run",
            MODEL,
            "--tp",
            "2",
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--dump-logits",
            fly.to_str().unwrap(),
        ]));
        let b = ok(&tpc(&[
            "run",
            MODEL,
            "--plan",
            p,
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--dump-logits",
            saved.to_str().unwrap(),
        ]));
        assert_eq!(a, b);
        assert_eq!(
            a.trim(),
            "59,40,188,239,174,169,126,162",
            "transformers' tokens"
        );
        assert_eq!(
            std::fs::read(&fly).unwrap(),
            std::fs::read(&saved).unwrap(),
            "{ext}: logits must be bit-identical"
        );
        // tpc verify takes the saved plan as its tp=N side.
        let v = ok(&tpc(&["verify", MODEL, "--plan", p, "--json"]));
        let v: serde_json::Value = serde_json::from_str(&v).unwrap();
        assert_eq!(v["tp"], 2);
        assert_eq!(v["passed"], true);
        // A plan for another tp than asked is refused, not run.
        let e = fails(&tpc(&[
            "run",
            MODEL,
            "--plan",
            p,
            "--tp",
            "4",
            "--prompt-ids",
            "1",
        ]));
        assert!(e.contains("tp=2"), "{e}");
    }
}

#[test]
fn a_prompts_file_gives_one_result_per_line_in_input_order() {
    let dir = scratch("prompts");
    let file = dir.join("p.jsonl");
    std::fs::write(
        &file,
        format!(
            "{{\"prompt_ids\": [{PROMPT}]}}\n\n{{\"prompt_ids\": [5, 6], \"max_new_tokens\": 3}}\n{{\"prompt\": \"hello world\", \"max_new_tokens\": 2}}\n"
        ),
    )
    .unwrap();
    let out = ok(&tpc(&[
        "run",
        MODEL,
        "--tp",
        "2",
        "--prompts",
        file.to_str().unwrap(),
        "--max-new-tokens",
        "8",
        "--json",
    ]));
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{out}");
    let generated = |v: &serde_json::Value| -> Vec<i64> {
        v["generated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    // Sequence 0 finishes last (8 tokens against 3 and 2) yet comes out first.
    for (i, line) in lines.iter().take(3).enumerate() {
        assert_eq!(line["index"], i);
    }
    assert_eq!(
        generated(&lines[0]),
        vec![59, 40, 188, 239, 174, 169, 126, 162]
    );
    assert_eq!(generated(&lines[1]).len(), 3);
    assert_eq!(generated(&lines[2]).len(), 2);
    assert!(lines[2]["text"].is_string(), "decoded with tokenizer.json");
    // The second line alone gives the same tokens.
    let alone = ok(&tpc(&[
        "run",
        MODEL,
        "--tp",
        "2",
        "--prompt-ids",
        "5,6",
        "--max-new-tokens",
        "3",
    ]));
    let alone: Vec<i64> = alone
        .trim()
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(generated(&lines[1]), alone);
    let summary = &lines[3]["summary"];
    assert_eq!(summary["sequences"], 3);
    assert_eq!(summary["generated_tokens"], 13);
    assert!(summary["decode_tokens_per_s"].as_f64().unwrap() > 0.0);

    std::fs::write(&file, "{\"prompt_ids\": [1], \"prompt\": \"x\"}\n").unwrap();
    let e = fails(&tpc(&["run", MODEL, "--prompts", file.to_str().unwrap()]));
    assert!(e.contains("p.jsonl:1") && e.contains("exactly one"), "{e}");
    std::fs::write(&file, "[1, 2]\n").unwrap();
    let e = fails(&tpc(&["run", MODEL, "--prompts", file.to_str().unwrap()]));
    assert!(e.contains("p.jsonl:1"), "{e}");
}

#[test]
fn impossible_requests_are_refused_quickly() {
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "1000000",
    ]));
    assert!(e.contains("max_position_embeddings"), "{e}");
    let e = fails(&tpc(&["run", MODEL, "--prompt-ids", "1,100000"]));
    assert!(e.contains("outside the vocabulary"), "{e}");
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        "1",
        "--dump-logits",
        "/nonexistent-dir/l.safetensors",
    ]));
    assert!(e.contains("does not exist"), "{e}");
    // The logits never replace the weights they were computed from.
    let weights = format!("{MODEL}/model.safetensors");
    let before = std::fs::read(&weights).unwrap();
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        "1",
        "--dump-logits",
        &weights,
    ]));
    assert!(e.contains("one of the files of the model folder"), "{e}");
    assert_eq!(std::fs::read(&weights).unwrap(), before);
}

#[test]
fn run_json_reports_load_time_and_bytes() {
    let out = ok(&tpc(&[
        "run",
        MODEL,
        "--tp",
        "2",
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "2",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["load_seconds"].as_f64().unwrap() > 0.0);
    assert!(v["weight_bytes_rank0"].as_u64().unwrap() > 0);
    // Two layers, two all-reduces each, one embedding all-reduce and one logits gather per
    // forward call; f32 messages.
    assert!(v["collective_bytes_rank0"].as_u64().unwrap() > 0);
    assert_eq!(v["collective_dtype"], "f32");
    assert!(v["peak_resident_bytes"].as_u64().unwrap() > v["weight_bytes_rank0"].as_u64().unwrap());
}

#[test]
fn isa_forces_a_kernel_variant_or_says_why_it_cannot() {
    use tpc::runtime::cpu::isa::Isa;
    for isa in Isa::ALL {
        let o = tpc(&[
            "run",
            MODEL,
            "--dtype",
            "bf16",
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "2",
            "--isa",
            isa.name(),
            "--json",
        ]);
        match isa.host_support() {
            Ok(()) => {
                let v: serde_json::Value = serde_json::from_str(&ok(&o)).unwrap();
                let k = &v["linear_kernels"];
                assert_eq!(k["isa"], isa.name(), "{v}");
                // bf16 weights: amx runs prompts on tiles and decode rows on vdpbf16ps.
                let gemv = if isa == Isa::Amx {
                    "avx512bf16"
                } else {
                    isa.name()
                };
                assert_eq!(k["prompt_gemm"], isa.name(), "{v}");
                assert_eq!(k["decode_gemv"], gemv, "{v}");
            }
            Err(_) => {
                let e = fails(&o);
                assert!(
                    e.contains(&format!("--isa {isa}")) && e.contains("runs"),
                    "{e}"
                );
                eprintln!("NOT RUN on this host: --isa {isa}");
            }
        }
    }
    let o = tpc(&["run", MODEL, "--prompt-ids", "1", "--isa", "sse9"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("amx"));
}

#[test]
fn absurd_execution_flags_are_usage_errors() {
    for flag in [["--threads-per-rank", "100000"], ["--warmup", "1000000000"]] {
        let o = tpc(&["run", MODEL, "--prompt-ids", "1", flag[0], flag[1]]);
        assert_eq!(o.status.code(), Some(2), "{flag:?}");
    }
    // 100000 threads per product aborted the process (no memory for their stack guards).
    for threads in ["0", "100000"] {
        let o = tpc(&[
            "bench-gemm",
            "--threads",
            threads,
            "--rows",
            "1",
            "--sweep-mib",
            "0",
        ]);
        assert_eq!(o.status.code(), Some(2), "bench-gemm --threads {threads}");
    }
    let o = tpc(&["bench-gemm", "--sweep-mib", "100000000"]);
    assert_eq!(o.status.code(), Some(2), "bench-gemm --sweep-mib");
    // Sizes whose activations would not fit: refused before anything is allocated.
    let o = tpc(&["bench-gemm", "--rows", "65536", "--shapes", "16384x16384"]);
    assert_eq!(o.status.code(), Some(1), "bench-gemm --rows 65536");
}

#[test]
fn bench_gemm_sweeps_code_panels_beside_bf16() {
    let o = tpc(&[
        "bench-gemm",
        "--rows",
        "1",
        "--shapes",
        "48x64",
        "--sweep-mib",
        "1",
        "--sweep-codes",
        "--seconds",
        "0.01",
        "--isa",
        "portable",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for name in ["bf16", "INT8", "FP8"] {
        let line = out
            .lines()
            .find(|l| l.starts_with("cold sweep") && l.contains(&format!("48x64 {name} weights")))
            .unwrap_or_else(|| panic!("no {name} sweep in:\n{out}"));
        let gbs: f64 = line
            .split("MiB): ")
            .nth(1)
            .and_then(|r| r.split(" GB/s").next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no GB/s in {line:?}"));
        assert!(gbs > 0.0 && gbs.is_finite(), "{line}");
    }
}

#[test]
fn a_closed_or_full_stdout_is_an_error_not_a_panic() {
    use std::process::Stdio;
    // /dev/full: every write fails with ENOSPC.
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        return; // not on this system
    };
    for args in [
        &["compile", "models/tiny-llama.ron", "--tp", "2"][..],
        &["dot", "models/tiny-llama.ron", "--tp", "2"],
        &["run", MODEL, "--prompt-ids", "1,2", "--max-new-tokens", "2"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_tpc"))
            .args(args)
            .stdout(Stdio::from(full.try_clone().unwrap()))
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(
            e.contains("cannot write the result to stdout"),
            "{args:?}: {e}"
        );
    }
}

/// Greedy decoding exchanges one (value, index) pair per rank and row instead of gathering
/// the logits: the same tokens as top-k 1 sampling from gathered logits (`--gather-logits`),
/// fewer bytes.
#[test]
fn greedy_decode_exchanges_pairs_instead_of_logits() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "run",
            MODEL,
            "--tp",
            "2",
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&tpc(&args))).unwrap()
    };
    let greedy = json(&[]);
    let gathered = json(&["--temperature", "1", "--top-k", "1", "--gather-logits"]);
    assert_eq!(greedy["generated"], gathered["generated"]);
    let bytes = |v: &serde_json::Value| v["collective_bytes_rank0"].as_u64().unwrap();
    // 7 decode steps each gather the 250 f32 logits (1000 B) when sampling, and
    // 2 ranks × one (value, index) f32 pair (16 B) when greedy.
    assert_eq!(bytes(&gathered) - bytes(&greedy), 7 * (1000 - 16));
    // Greedy decoding made to gather moves what sampling from gathered logits moves; top-k 1
    // sampling exchanges one candidate pair per rank, as greedy does.
    let greedy_gathered = json(&["--gather-logits"]);
    assert_eq!(greedy_gathered["generated"], greedy["generated"]);
    assert_eq!(bytes(&greedy_gathered), bytes(&gathered));
    let top_1 = json(&["--temperature", "1", "--top-k", "1"]);
    assert_eq!(top_1["generated"], greedy["generated"]);
    assert_eq!(bytes(&top_1), bytes(&greedy));
    // The compile report states the same exchange.
    let summary: serde_json::Value =
        serde_json::from_str(&ok(&tpc(&["compile", MODEL, "--tp", "2", "--json"]))).unwrap();
    assert_eq!(
        summary["greedy_exchange"],
        serde_json::json!({"logits_gather_bytes_per_token": 1000, "pair_bytes_per_token": 16})
    );
    // At tp=1 nothing is gathered, and the report says nothing.
    let one: serde_json::Value =
        serde_json::from_str(&ok(&tpc(&["compile", MODEL, "--json"]))).unwrap();
    assert!(one.get("greedy_exchange").is_none());
}

/// Sampling with a top-k exchanges each rank's K best (value, index) pairs per row instead of
/// gathering the logits: the tokens of sampling from the gathered logits, fewer bytes than
/// top-p sampling (which needs the whole distribution, so gathers); the compile report
/// states the exchange.
#[test]
fn top_k_sampling_exchanges_candidates_instead_of_logits() {
    let json = |tp: &str, extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "run",
            MODEL,
            "--tp",
            tp,
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "8",
            "--temperature",
            "0.8",
            "--seed",
            "11",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&ok(&tpc(&args))).unwrap()
    };
    let bytes = |v: &serde_json::Value| v["collective_bytes_rank0"].as_u64().unwrap();
    // Per decode row: the gather moves the 250 real f32 logits (at tp 4 the ranks hold
    // 63/63/63/61, and only those move, not four pieces of 63); top-k 5 moves tp × 5
    // (value, index) f32 pairs.
    for (tp, gather, pairs) in [("2", 1000, 80), ("4", 1000, 160)] {
        let top_k = json(tp, &["--top-k", "5"]);
        let gathered = json(tp, &["--top-k", "5", "--gather-logits"]);
        assert_eq!(top_k["generated"], gathered["generated"], "tp {tp}");
        assert_eq!(bytes(&gathered) - bytes(&top_k), 7 * (gather - pairs));
        let top_p = json(tp, &["--top-p", "0.9"]);
        assert!(bytes(&top_k) < bytes(&top_p), "tp {tp}");
        assert_eq!(bytes(&top_p), bytes(&gathered), "tp {tp}");
        // With top-p after the top-k, the candidates still suffice.
        let both = json(tp, &["--top-k", "5", "--top-p", "0.9"]);
        let both_gathered = json(tp, &["--top-k", "5", "--top-p", "0.9", "--gather-logits"]);
        assert_eq!(both["generated"], both_gathered["generated"], "tp {tp}");
        assert_eq!(bytes(&both), bytes(&top_k), "tp {tp}");
        // A K whose pairs outweigh the slices gathers; a huge K is not a huge allocation.
        for k in ["100", "1000000000"] {
            let big = json(tp, &["--top-k", k]);
            let big_gathered = json(tp, &["--top-k", k, "--gather-logits"]);
            assert_eq!(big["generated"], big_gathered["generated"], "tp {tp} k {k}");
            assert_eq!(bytes(&big), bytes(&gathered), "tp {tp} k {k}");
        }
    }
    let summary: serde_json::Value =
        serde_json::from_str(&ok(&tpc(&["compile", MODEL, "--tp", "2", "--json"]))).unwrap();
    assert_eq!(
        summary["top_k_exchange"],
        serde_json::json!({
            "logits_gather_bytes_per_token": 1000,
            "pair_bytes_per_token_per_k": 16,
            "max_k": 62
        })
    );
    let text = ok(&tpc(&["compile", MODEL, "--tp", "2"]));
    assert!(
        text.contains("sampling with --top-k K: ranks exchange K pairs each, 8·K·tp = 16 B·K per token instead of the 1000 B logits gather (K up to 62"),
        "{text}"
    );
    let one: serde_json::Value =
        serde_json::from_str(&ok(&tpc(&["compile", MODEL, "--json"]))).unwrap();
    assert!(one.get("top_k_exchange").is_none());
}

/// A profile whose links make one algorithm the cheapest at every message size.
fn profile_where(dir: &std::path::Path, name: &str, winner: &str) -> PathBuf {
    let base = std::fs::read_to_string("models/hw/h100-sxm-nvswitch-8.ron").unwrap();
    // Everything slow, the winner fast (each within the bounds a profile's figures must
    // keep: a second and a megabyte per second at the slow end).
    let slow = "AlphaBeta(alpha_s: 1.0, beta_bytes_per_s: 1e6)";
    let fast = "AlphaBeta(alpha_s: 1e-9, beta_bytes_per_s: 1e15)";
    let mut text = String::new();
    for line in base.lines() {
        let trimmed = line.trim_start();
        let algorithm = ["ring", "one_shot", "two_shot"]
            .into_iter()
            .find(|a| trimmed.starts_with(&format!("{a}: AlphaBeta")));
        match algorithm {
            Some(a) => {
                let ab = if a == winner { fast } else { slow };
                text.push_str(&format!("        {a}: {ab},\n"));
            }
            None => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    let path = dir.join(format!("{name}.ron"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn the_runtime_runs_the_all_reduce_algorithm_the_plan_recorded() {
    let dir = scratch("algorithms");
    let tally = |plan: Option<&std::path::Path>| -> serde_json::Value {
        let mut args = vec!["run", MODEL, "--tp", "2", "--prompt-ids", PROMPT];
        args.extend(["--max-new-tokens", "3", "--json"]);
        if let Some(p) = plan {
            args.extend(["--plan", p.to_str().unwrap()]);
        }
        let out: serde_json::Value = serde_json::from_str(&ok(&tpc(&args))).unwrap();
        out["all_reduce_algorithms_rank0"].clone()
    };
    // Without a profile the communicator chooses; every all-reduce is counted once.
    let own = tally(None);
    let total = |t: &serde_json::Value| {
        ["one_shot", "two_shot", "ring", "unreported"]
            .iter()
            .map(|k| t[k].as_u64().unwrap())
            .sum::<u64>()
    };
    assert!(total(&own) > 0, "{own}");
    for (winner, runs_as) in [
        ("one_shot", "one_shot"),
        ("ring", "ring"),
        // The in-process group runs a two-shot choice as two-shot (reduce-scatter, then
        // all-gather over the one-shot link; issue 27), no longer as its ring.
        ("two_shot", "two_shot"),
    ] {
        let hw = profile_where(&dir, winner, winner);
        let plan = dir.join(format!("{winner}.json"));
        let report = ok(&tpc(&[
            "compile",
            MODEL,
            "--tp",
            "2",
            "--hw",
            hw.to_str().unwrap(),
            // The all-reduces of the plain plan are what is counted.
            "--sequence-parallel=off",
            "-o",
            plan.to_str().unwrap(),
        ]));
        assert!(
            report.contains(&format!("{winner} always")),
            "{winner}: {report}"
        );
        let t = tally(Some(&plan));
        assert_eq!(t[runs_as].as_u64(), Some(total(&own)), "{winner}: {t}");
        assert_eq!(total(&t), total(&own), "{winner}: {t}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plan_whose_algorithm_table_is_broken_is_refused() {
    let dir = scratch("bad-algorithms");
    let hw = profile_where(&dir, "ring", "ring");
    let plan = dir.join("plan.json");
    ok(&tpc(&[
        "compile",
        MODEL,
        "--tp",
        "2",
        "--hw",
        hw.to_str().unwrap(),
        "--sequence-parallel=off",
        "-o",
        plan.to_str().unwrap(),
    ]));
    let text = std::fs::read_to_string(&plan).unwrap();
    let max = u64::MAX.to_string();
    assert!(text.contains(&max));
    std::fs::write(&plan, text.replace(&max, "4096")).unwrap();
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--plan",
        plan.to_str().unwrap(),
        "--prompt-ids",
        PROMPT,
    ]));
    assert!(
        e.contains("algorithm choice") && e.contains("ends at 4096"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--dp D`: D replicas of the tp ranks, the prompts dealt round robin. Every result line
/// equals the single replica's, in input order, greedy and sampled (each sequence has its
/// own seeded sampler); more replicas than prompts is fine; --pin with replicas is refused.
#[test]
fn data_parallel_replicas_print_what_one_replica_prints() {
    let dir = scratch("dp");
    let file = dir.join("p.jsonl");
    let lines = [
        format!("{{\"prompt_ids\": [{PROMPT}]}}"),
        "{\"prompt_ids\": [5, 6], \"max_new_tokens\": 3}".into(),
        "{\"prompt_ids\": [17, 4, 200, 9, 33]}".into(),
        "{\"prompt_ids\": [1], \"max_new_tokens\": 6}".into(),
        "{\"prompt_ids\": [88, 120, 7], \"max_new_tokens\": 1}".into(),
    ];
    std::fs::write(&file, lines.join("\n")).unwrap();
    let run = |dp: &str, extra: &[&str]| -> (Vec<serde_json::Value>, serde_json::Value) {
        let mut args = vec!["run", MODEL, "--tp", "2", "--prompts"];
        args.extend([file.to_str().unwrap(), "--max-new-tokens", "5", "--json"]);
        args.extend(["--dp", dp]);
        args.extend(extra);
        let out = ok(&tpc(&args));
        let mut v: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let summary = v.pop().unwrap()["summary"].clone();
        (v, summary)
    };
    for sampling in [&[][..], &["--temperature", "0.9", "--seed", "11"][..]] {
        let (one, s1) = run("1", sampling);
        assert_eq!(one.len(), 5);
        assert_eq!(s1["dp"], 1);
        for dp in ["2", "3", "8"] {
            let (many, s) = run(dp, sampling);
            assert_eq!(many, one, "--dp {dp} {sampling:?}");
            assert_eq!(s["dp"].to_string(), dp);
            assert_eq!(s["generated_tokens"], s1["generated_tokens"]);
            assert_eq!(s["prompt_tokens"], s1["prompt_tokens"]);
        }
    }
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--tp",
        "2",
        "--prompts",
        file.to_str().unwrap(),
        "--dp",
        "2",
        "--pin",
    ]));
    assert!(e.contains("--pin") && e.contains("--dp 1"), "{e}");
    let o = tpc(&["run", MODEL, "--prompt-ids", PROMPT, "--dp", "0"]);
    assert_eq!(o.status.code(), Some(2));
    // bench deals its batch out the same way.
    let out = ok(&tpc(&[
        "bench",
        MODEL,
        "--tp",
        "2",
        "--dp",
        "2",
        "--batch",
        "3",
        "--prompt-len",
        "16",
        "--max-new-tokens",
        "2",
    ]));
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (v["dp"].as_u64(), v["generated"].as_u64()),
        (Some(2), Some(6)),
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--pp`: compiled stages report per stage, a saved pipelined plan runs as compiled, and
/// every layout of ranks prints the tokens tp=1 prints.
#[test]
fn pipeline_stages_from_compile_to_run() {
    let dir = scratch("pp");
    let plan = dir.join("plan.json");
    let p = plan.to_str().unwrap();
    let json = ok(&tpc(&[
        "compile", MODEL, "--tp", "2", "--pp", "2", "--json", "-o", p,
    ]));
    let summary: serde_json::Value = serde_json::from_str(&json).unwrap();
    let stages = summary["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2);
    assert_eq!(stages[0]["ranks"], serde_json::json!([0, 1]));
    assert_eq!(stages[1]["ranks"], serde_json::json!([2, 3]));
    assert_eq!(stages[0]["first_layer"], 0);
    assert_eq!(stages[1]["first_layer"], 1);
    // The hidden state (hidden 64, f32) crosses once; the last stage sends nothing.
    assert_eq!(stages[0]["send_bytes_per_token_per_rank"], 64 * 4);
    assert_eq!(stages[1]["send_bytes_per_token_per_rank"], 0);
    // Each stage holds its own layers: their weights add up to the tp rank's (the embedding
    // and LM head of this model are separate tensors, each on one stage).
    let per_rank = |v: &serde_json::Value| v["param_bytes_per_rank"][0].as_u64().unwrap();
    assert_eq!(
        per_rank(&stages[0]) + per_rank(&stages[1]),
        per_rank(&summary)
    );
    let tp1 = ok(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "8",
    ]));
    for args in [
        &["--tp", "1", "--pp", "2"][..],
        &["--tp", "2", "--pp", "2"],
        &["--pp", "2", "--pp-layers", "1,1"],
        &["--plan", p],
        &["--plan", p, "--pp", "2"],
        &["--tp", "2", "--pp", "2", "--dp", "2"],
    ] {
        let mut all = vec![
            "run",
            MODEL,
            "--prompt-ids",
            PROMPT,
            "--max-new-tokens",
            "8",
        ];
        all.extend_from_slice(args);
        assert_eq!(ok(&tpc(&all)), tp1, "{args:?}");
    }
    let v = ok(&tpc(&["verify", MODEL, "--tp", "2", "--pp", "2"]));
    assert!(
        v.contains("tp=1 vs tp=2 pp=2") && v.contains("greedy tokens equal"),
        "{v}"
    );
    let text = ok(&tpc(&[
        "compile", MODEL, "--tp", "2", "--pp", "2", "--text",
    ]));
    assert!(text.contains("rank 3 (stage 1 of 2, tp rank 1):"), "{text}");
    assert!(text.contains("= recv() {from stage 0}"), "{text}");
    assert!(text.contains("{to stage 1}"), "{text}");
    let dot = ok(&tpc(&["dot", MODEL, "--tp", "2", "--pp", "2"]));
    assert!(dot.contains("cluster_s1_stage") && dot.contains("send/recv 256 B/token"));
    // Refusals: more stages than layers (naming the valid counts), counts that do not add
    // up, a saved plan asked for other stages.
    let e = fails(&tpc(&["compile", MODEL, "--pp", "3"]));
    assert!(e.contains("1 to 2 pipeline stage(s)"), "{e}");
    let e = fails(&tpc(&["compile", MODEL, "--pp", "2", "--pp-layers", "2,1"]));
    assert!(e.contains("they sum to 3"), "{e}");
    let e = fails(&tpc(&[
        "run",
        MODEL,
        "--plan",
        p,
        "--pp",
        "1",
        "--prompt-ids",
        "1",
    ]));
    assert!(e.contains("has 2 pipeline stage(s), not --pp 1"), "{e}");
    let e = fails(&tpc(&["compile", MODEL, "--pp", "0"]));
    assert!(e.contains("--pp 0"), "{e}");
}

/// `--device`: cpu is the default and runs; a malformed value is a usage error; cuda in a
/// build without the `cuda` feature says how to build one (with the feature and no driver,
/// tests/cuda/device.rs checks the error instead).
#[test]
fn device_flag_is_parsed_and_cuda_needs_the_feature() {
    let cpu = tpc(&[
        "run",
        MODEL,
        "--tp",
        "2",
        "--device",
        "cpu",
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(ok(&cpu).trim(), "59,40,188,239,174,169,126,162");
    let json = ok(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "2",
        "--json",
    ]));
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["device"], "cpu", "{json}");
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:0,,1", "cuda:4096"] {
        let o = tpc(&["run", MODEL, "--device", bad, "--prompt-ids", PROMPT]);
        assert_eq!(o.status.code(), Some(2), "--device {bad}");
    }
    if cfg!(feature = "cuda") {
        return;
    }
    for args in [
        vec![
            "run",
            MODEL,
            "--tp",
            "2",
            "--device",
            "cuda:0",
            "--prompt-ids",
            PROMPT,
        ],
        vec!["verify", MODEL, "--tp", "2", "--device", "cuda"],
        vec![
            "bench",
            "models/tiny-llama.ron",
            "--device",
            "cuda",
            "--prompt-len",
            "4",
        ],
    ] {
        let e = fails(&tpc(&args));
        assert!(e.contains("--features cuda"), "{args:?}: {e}");
    }
}

/// A Llama-2-style folder (`scripts/make_text_fixture.py`): a BPE tokenizer whose
/// tokenizer_config.json adds `<s>`, and a generation_config.json whose `eos_token_id` is a
/// list; `text_reference.json` holds what HF's tokenizer and `generate` made of its prompt.
const TEXT_MODEL: &str = "tests/fixtures/text/llama";

fn text_reference() -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{TEXT_MODEL}/text_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `tpc run DIR --prompt TEXT --json` with the reference's prompt and token limit.
fn run_text(dir: &str, extra: &[&str]) -> serde_json::Value {
    let r = text_reference();
    let max_new = r["max_new_tokens"].to_string();
    let mut args = vec![
        "run",
        dir,
        "--prompt",
        r["prompt"].as_str().unwrap(),
        "--max-new-tokens",
        &max_new,
        "--json",
    ];
    args.extend_from_slice(extra);
    serde_json::from_str(&ok(&tpc(&args))).unwrap()
}

#[test]
fn a_text_prompt_matches_hf_tokenizer_and_generate_token_for_token() {
    let r = text_reference();
    assert_eq!(r["prompt_ids"][0], 1, "HF put <s> first: {r}");
    for tp in ["1", "2"] {
        let v = run_text(TEXT_MODEL, &["--tp", tp]);
        assert_eq!(v["prompt_ids"], r["prompt_ids"], "tp={tp}: {v}");
        assert_eq!(
            v["prompt_tokens"],
            r["prompt_ids"].as_array().unwrap().len()
        );
        assert_eq!(v["generated"], r["generated_ids"], "tp={tp}: {v}");
        assert_eq!(v["text"], r["generated_text"], "tp={tp}: {v}");
    }
    // The second id of generation_config.json's list stopped it before the token limit.
    let generated = r["generated_ids"].as_array().unwrap();
    assert!(generated.len() < r["max_new_tokens"].as_u64().unwrap() as usize);
    assert_eq!(generated.last(), r["eos_token_id"].get(1));
    // A `prompt` line of a --prompts file is encoded the same way.
    let dir = scratch("text-prompts");
    let file = dir.join("p.jsonl");
    let line = serde_json::json!({ "prompt": r["prompt"] });
    std::fs::write(&file, format!("{line}\n")).unwrap();
    let max_new = r["max_new_tokens"].to_string();
    let out = ok(&tpc(&[
        "run",
        TEXT_MODEL,
        "--prompts",
        file.to_str().unwrap(),
        "--max-new-tokens",
        &max_new,
    ]));
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(v["generated"], r["generated_ids"], "{out}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A copy of the text fixture folder, less `drop`, with `replace`'s files written over.
fn text_model_copy(test: &str, drop: &[&str], replace: &[(&str, &str)]) -> Scratch {
    let dir = scratch(test);
    for entry in std::fs::read_dir(TEXT_MODEL).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if !drop.contains(&name.as_str()) {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        }
    }
    for (name, text) in replace {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

#[test]
fn missing_text_settings_fall_back_and_malformed_ones_are_refused() {
    let r = text_reference();
    let generated: Vec<serde_json::Value> = r["generated_ids"].as_array().unwrap().clone();
    // No tokenizer_config.json: tokenizer.json's post-processor still puts <s> first.
    let dir = text_model_copy("no-tokenizer-config", &["tokenizer_config.json"], &[]);
    let v = run_text(dir.to_str().unwrap(), &[]);
    assert_eq!(v["prompt_ids"], r["prompt_ids"], "{v}");
    let _ = std::fs::remove_dir_all(&dir);
    // add_bos_token false: no <s>.
    let no_bos = r#"{"add_bos_token": false, "bos_token": "<s>"}"#;
    let dir = text_model_copy("no-bos", &[], &[("tokenizer_config.json", no_bos)]);
    let v = run_text(dir.to_str().unwrap(), &[]);
    assert_eq!(
        v["prompt_ids"], r["prompt_ids_without_special_tokens"],
        "{v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    // No generation_config.json: only config.json's </s> stops, so the same tokens run on
    // past the list's second id to the token limit.
    let dir = text_model_copy("no-generation-config", &["generation_config.json"], &[]);
    let v = run_text(dir.to_str().unwrap(), &[]);
    let longer = v["generated"].as_array().unwrap();
    assert_eq!(
        longer.len() as u64,
        r["max_new_tokens"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(longer[..generated.len()], generated[..], "{v}");
    let _ = std::fs::remove_dir_all(&dir);
    // Malformed files: exit 1 naming the file and the fix.
    for (name, text, says) in [
        ("tokenizer_config.json", "{\"add_bos_token\": ", "JSON"),
        (
            "tokenizer_config.json",
            r#"{"add_bos_token": "yes"}"#,
            "true or false",
        ),
        ("generation_config.json", "[2", "JSON"),
        (
            "generation_config.json",
            r#"{"eos_token_id": "2"}"#,
            "list of token ids",
        ),
    ] {
        let dir = text_model_copy("malformed", &[], &[(name, text)]);
        let e = fails(&tpc(&[
            "run",
            dir.to_str().unwrap(),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "1",
        ]));
        assert!(e.contains(name) && e.contains(says), "{name} {text}: {e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// What a progress bar leaves in captured output: carriage returns and ANSI escapes.
fn has_progress_bytes(stderr: &[u8]) -> bool {
    stderr.iter().any(|&b| b == b'\r' || b == 0x1b)
}

#[test]
fn no_progress_bar_reaches_a_pipe() {
    let r = text_reference();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            TEXT_MODEL,
            "--prompt",
            r["prompt"].as_str().unwrap(),
            "--max-new-tokens",
            "4",
            "--warmup",
            "1",
            "--repeat",
            "2",
        ];
        args.extend_from_slice(extra);
        tpc(&args)
    };
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            MODEL,
            "--prompt-len",
            "4",
            "--max-new-tokens",
            "4",
            "--warmup",
            "1",
            "--repeat",
            "2",
        ];
        args.extend_from_slice(extra);
        tpc(&args)
    };
    for (what, o) in [
        ("run", run(&[])),
        ("run --json", run(&["--json"])),
        ("run --tp 2 --dp 2", run(&["--tp", "2", "--dp", "2"])),
        ("bench", bench(&[])),
        ("bench --tp 2", bench(&["--tp", "2"])),
    ] {
        ok(&o);
        assert!(
            !has_progress_bytes(&o.stderr) && !has_progress_bytes(&o.stdout),
            "{what}: {:?}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn verify_numerics_invariant_checks_every_bit_and_a_plan_records_the_mode() {
    let dir = "tests/fixtures/checkpoints/llama-gqa";
    for extra in [&[][..], &["--sequence-parallel"], &["--pp", "2"]] {
        let mut args = vec!["verify", dir, "--tp", "4", "--numerics", "invariant"];
        args.extend_from_slice(extra);
        let out = ok(&tpc(&args));
        assert!(
            out.contains("--numerics invariant: every prompt logit is the same bits")
                && out.contains("max abs error 0.000e0"),
            "{extra:?}: {out}"
        );
    }
    // Fast plans are compared within the tolerance, and do differ in their low bits.
    let out = ok(&tpc(&["verify", dir, "--tp", "4"]));
    assert!(
        !out.contains("--numerics invariant") && !out.contains("max abs error 0.000e0"),
        "{out}"
    );
    // The mode is in the plan; a saved plan cannot be given another.
    let scratch_dir = scratch("numerics");
    let plan = scratch_dir.join("plan.json");
    let p = plan.to_str().unwrap();
    ok(&tpc(&[
        "compile",
        dir,
        "--tp",
        "2",
        "--numerics",
        "invariant",
        "-o",
        p,
    ]));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(json["numerics"], "invariant");
    let err = fails(&tpc(&[
        "run",
        dir,
        "--plan",
        p,
        "--numerics",
        "invariant",
        "--prompt-ids",
        "1,2",
    ]));
    assert!(
        err.contains("--numerics and --tp-shares apply when tpc compiles"),
        "{err}"
    );
    // Beyond the limbs' 32 ranks: refused with the reason.
    let err = fails(&tpc(&[
        "compile",
        "models/llama3-70b.ron",
        "--tp",
        "64",
        "--numerics",
        "invariant",
    ]));
    assert!(err.contains("choose tp ≤ 32"), "{err}");
}

/// `--tp-shares`: the run gives tp 1's tokens, the compile report shows each rank's real
/// share, a saved plan keeps the shares, and malformed or mismatched shares are refused.
#[test]
fn tp_shares_run_report_and_refusals() {
    let plain = ok(&tpc(&[
        "run",
        MODEL,
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "6",
    ]));
    let tokens = plain.lines().next().unwrap().to_string();
    let shared = ok(&tpc(&[
        "run",
        MODEL,
        "--tp",
        "4",
        "--tp-shares",
        "3,1,1,1",
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "6",
    ]));
    assert_eq!(shared.lines().next().unwrap(), tokens);
    let report = ok(&tpc(&[
        "compile",
        "models/tinyllama-1.1b.ron",
        "--tp",
        "4",
        "--tp-shares",
        "3,1,1,1",
    ]));
    assert!(report.contains("real params (share)"), "{report}");
    assert!(
        report.contains("(45.3 %)") && report.contains("(19.9 %)"),
        "{report}"
    );
    assert!(
        report.contains("by shares 3,1,1,1: 5632 columns dealt 2816/1056/880/880"),
        "{report}"
    );
    assert!(
        report.contains("by shares 3,1,1,1: 32000 vocabulary rows dealt 16000/6000/5000/5000"),
        "{report}"
    );
    // explain and DOT show each rank's piece.
    let explained = ok(&tpc(&[
        "explain",
        "models/tinyllama-1.1b.ron",
        "--tp",
        "4",
        "--tp-shares",
        "3,1,1,1",
        "*.0.mlp.up_proj*",
    ]));
    assert!(
        explained.contains("at tp=4 (--tp-shares 3,1,1,1)")
            && explained.contains("pieces      2816/1056/880/880 of 5632 along dim 0"),
        "{explained}"
    );
    let json = ok(&tpc(&[
        "explain",
        MODEL,
        "--tp",
        "2",
        "--tp-shares",
        "1,3",
        "lm_head*",
        "--json",
    ]));
    let weights: serde_json::Value = serde_json::from_str(&json).unwrap();
    let pieces = &weights[0]["pieces"];
    let [a, b] = [&pieces[0], &pieces[1]].map(|v| v.as_u64().unwrap());
    assert!(a < b, "{json}");
    let dot = ok(&tpc(&[
        "dot",
        MODEL,
        "--tp",
        "2",
        "--tp-shares",
        "1,3",
        "--all-ranks",
        "--layers",
        "0",
    ]));
    assert!(dot.contains("tp=2 shares 1,3"), "{dot}");
    assert!(dot.contains(" pad\\n"), "{dot}");
    // A saved plan runs with its shares; the flag is refused beside it.
    let dir = scratch("tp-shares");
    let plan = dir.join("plan.ron");
    let p = plan.to_str().unwrap();
    ok(&tpc(&[
        "compile",
        MODEL,
        "--tp",
        "2",
        "--tp-shares",
        "2,1",
        "-o",
        p,
    ]));
    let saved = ok(&tpc(&[
        "run",
        MODEL,
        "--plan",
        p,
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "6",
    ]));
    assert_eq!(saved.lines().next().unwrap(), tokens);
    let err = fails(&tpc(&[
        "run",
        MODEL,
        "--plan",
        p,
        "--tp-shares",
        "2,1",
        "--prompt-ids",
        PROMPT,
    ]));
    assert!(err.contains("--tp-shares apply when tpc compiles"), "{err}");
    let err = fails(&tpc(&["compile", MODEL, "--tp", "3", "--tp-shares", "2,1"]));
    assert!(err.contains("names 2 ranks but tp is 3"), "{err}");
    let err = tpc(&["compile", MODEL, "--tp", "2", "--tp-shares", "2,0"]);
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("positive share"));
    // GPT-2's fused q|k|v: each part dealt by the shares, padded inside the piece.
    let report = ok(&tpc(&[
        "compile",
        "tests/fixtures/checkpoints/gpt2",
        "--tp",
        "2",
        "--tp-shares",
        "2,1",
    ]));
    assert!(
        report.contains("a fused dimension of 3 parts, 8 heads of each dealt 5/3"),
        "{report}"
    );
    // An override that makes the MLP's product read whole all-gathers pieces of unequal
    // shares, joined by gate/up's per-rank counts; one that makes an op read a whole value
    // split slices it into the pieces of the weight that reads it (2048 at tp 3:
    // 704/704/640; under shares 1,3: 512/1536).
    let with_override = |name: &str, tp_plan: &str| {
        let model = std::fs::read_to_string("models/tinyllama-1.1b.ron")
            .unwrap()
            .replacen(
                "    dtype: Bf16,\n",
                &format!("    dtype: Bf16,\n    tp_plan: {tp_plan},\n"),
                1,
            );
        let path = dir.join(name);
        std::fs::write(&path, model).unwrap();
        path.to_str().unwrap().to_string()
    };
    let gathered = with_override(
        "gathered.ron",
        "{\"model.layers.*.mlp.down_proj\": replicate}",
    );
    let text = ok(&tpc(&[
        "compile",
        &gathered,
        "--tp",
        "2",
        "--tp-shares",
        "1,3",
        "--text",
    ]));
    assert!(text.contains("pieces"), "{text}");
    let sliced = with_override("sliced.ron", "{\"model.layers.*.mlp.gate_proj\": rowwise}");
    let text = ok(&tpc(&[
        "compile",
        &sliced,
        "--tp",
        "2",
        "--tp-shares",
        "1,3",
        "--text",
    ]));
    assert!(
        text.contains("local_slice(%21) {dim=2 pieces=512/1536}"),
        "{text}"
    );
    let text = ok(&tpc(&["compile", &sliced, "--tp", "3", "--text"]));
    assert!(
        text.contains("local_slice(%21) {dim=2 pieces=704/704/640}"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
