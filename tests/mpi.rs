//! Ranks as MPI processes (`mpirun -np W tpc run …`, feature `mpi`): every fixture at
//! several layouts prints HF's greedy tokens and the threaded run's logits bit for bit, and
//! a rank that fails — an error, a panic, SIGKILL — ends every process with a non-zero exit
//! and a message that names it. Needs Open MPI's `mpirun` on PATH (`.ci/run` installs it).
#![cfg(feature = "mpi")]

#[allow(
    dead_code,
    reason = "the MPI tests read the fixtures, not the tolerances or batches"
)]
mod common;

use common::{fixtures, read_reference};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "common/scratch.rs"]
mod scratch_dir;
#[path = "mpi/serve.rs"]
mod serve;
#[path = "common/serve_client.rs"]
mod serve_client;
use scratch_dir::Scratch;

const TPC: &str = env!("CARGO_BIN_EXE_tpc");

/// Past this a run is hung: the test kills it and fails (a guard, not a speed limit).
const HANG: Duration = Duration::from_secs(300);

fn scratch(test: &str) -> Scratch {
    Scratch::new("mpi", test)
}

fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
        TPC,
    ]);
    c
}

/// Waits for `child`, killing it (and failing) if it outlives [`HANG`].
fn finish(mut child: Child, what: &str) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: still running after {HANG:?} (hung); stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run(mut c: Command, what: &str) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start ({e}); is Open MPI's mpirun on PATH?"));
    finish(child, what)
}

fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn logits(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn csv(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn every_fixture_as_processes_equals_threads_and_hf() {
    let dir = scratch("parity");
    let mut ran = Vec::new();
    for fixture in fixtures() {
        let name = fixture.file_name().unwrap().to_string_lossy().into_owned();
        // (processes, tp, pp, shares, flag): tp alone, stages alone, both, and an uneven
        // tp (alone, with sequence parallelism, with the fused all-reduce + norm) and
        // unequal shares where the fixture's heads allow them.
        for (np, tp, pp, shares, flag) in [
            (2usize, 2u64, 1u64, "", ""),
            (2, 1, 2, "", ""),
            (4, 2, 2, "", ""),
            (3, 3, 1, "", ""),
            (3, 3, 1, "", "--sequence-parallel"),
            (3, 3, 1, "", "--fuse-norm"),
            (2, 2, 1, "2,1", ""),
        ] {
            let mut extra: Vec<String> = if shares.is_empty() {
                Vec::new()
            } else {
                vec!["--tp-shares".into(), shares.into()]
            };
            if !flag.is_empty() {
                extra.push(flag.into());
            }
            if (tp == 3 || !shares.is_empty()) && !compiles(&fixture, tp, &extra) {
                continue;
            }
            let what = format!("{name} np={np} tp={tp} pp={pp} shares={shares} {flag}");
            processes_equal_threads_and_hf(&fixture, &dir, &what, (np, tp, pp), &extra);
            ran.push(what);
        }
    }
    // Every fixture at all seven, GPT-2 and NeoX (fused q|k|v) included.
    assert!(ran.len() >= 49, "{ran:?}");
}

/// `tp_plan` overrides that cut unequal pieces run as processes (`tpc bench` on seeded
/// weights: `tpc run` takes checkpoints, whose configs carry no override): the hidden state
/// reduce-scattered by a rowwise `up_proj` (an all-reduce each rank cuts), the attention
/// output gathered by kv group before a replicated `o_proj`, replicated kv heads cut by
/// their starts under a rowwise `k_proj`, shares, and a replicated NeoX `dense` (whose
/// gather rank 1 once dropped). Each completes, issuing the collectives of the same run as
/// threads (rank 0's bytes and number of all-reduces). Their numerics against HF are the runtime
/// suite's (`tp_shares::overrides_that_split_undealt_dims_cut_unequal_pieces`).
#[test]
fn uneven_override_cuts_run_as_processes() {
    let dir = scratch("override");
    let up = r#""model.layers.*.mlp.up_proj": rowwise"#;
    for (model, over, np, shares) in [
        ("tiny-llama", up, 3usize, ""),
        (
            "tiny-llama",
            r#""model.layers.*.self_attn.o_proj": replicate"#,
            3,
            "",
        ),
        (
            "tiny-llama",
            r#""model.layers.*.self_attn.k_proj": rowwise"#,
            4,
            "",
        ),
        ("tiny-llama", up, 2, "1,3"),
        (
            "tiny-neox",
            r#""gpt_neox.layers.*.attention.dense": replicate"#,
            3,
            "",
        ),
    ] {
        let base = std::fs::read_to_string(format!("models/{model}.ron")).unwrap();
        let tp_plan = format!("    dtype: F32,\n    tp_plan: {{{over}}},\n");
        let text = base.replacen("    dtype: F32,\n", &tp_plan, 1);
        assert_ne!(text, base);
        let what = format!("{model} {over} np={np} shares={shares}");
        let file = what.replace([' ', '=', ',', '*', '.', '"', ':'], "_");
        let path = dir.join(format!("{file}.ron"));
        std::fs::write(&path, text).unwrap();
        let mut args = strings(&[
            "bench",
            path.to_str().unwrap(),
            "--tp",
            &np.to_string(),
            "--prompt-len",
            "4",
            "--max-new-tokens",
            "3",
            "--repeat",
            "1",
            "--threads-per-rank",
            "1",
        ]);
        if !shares.is_empty() {
            args.extend(strings(&["--tp-shares", shares]));
        }
        let report = |out: String| -> serde_json::Value {
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{what}: {e}: {out}"))
        };
        let mut c = Command::new(TPC);
        c.args(&args);
        let threads = report(ok(run(c, &what), &what));
        let mut c = mpirun(np);
        c.args(&args);
        let procs = report(ok(run(c, &what), &what));
        assert_eq!(procs["processes"], np, "{what}: {procs}");
        assert_eq!(procs["generated"], 3, "{what}: {procs}");
        assert_eq!(
            procs["collective_bytes_rank0"], threads["collective_bytes_rank0"],
            "{what}"
        );
        // MPI_Allreduce picks its own algorithm (`unreported`): the counts must agree.
        let all_reduces = |r: &serde_json::Value| -> u64 {
            let algorithms = r["all_reduce_algorithms_rank0"].as_object().unwrap();
            algorithms.values().filter_map(|n| n.as_u64()).sum()
        };
        assert_eq!(all_reduces(&procs), all_reduces(&threads), "{what}");
        assert!(all_reduces(&procs) > 0, "{what}: {procs}");
    }
}

/// `tpc run fixture` as `np` MPI processes gives the tokens of the same run as threads,
/// HF's greedy tokens, and logits bit-identical to the threads'.
fn processes_equal_threads_and_hf(
    fixture: &Path,
    dir: &Path,
    what: &str,
    (np, tp, pp): (usize, u64, u64),
    extra: &[String],
) {
    let reference = read_reference(fixture);
    let n = reference.greedy.len().min(6);
    let args = |dump: &Path| -> Vec<String> {
        let mut args: Vec<String> = vec![
            "run".into(),
            fixture.to_string_lossy().into_owned(),
            "--tp".into(),
            tp.to_string(),
            "--pp".into(),
            pp.to_string(),
            "--prompt-ids".into(),
            csv(&reference.prompt),
            "--max-new-tokens".into(),
            n.to_string(),
            "--threads-per-rank".into(),
            "1".into(),
            "--dump-logits".into(),
            dump.to_string_lossy().into_owned(),
        ];
        args.extend(extra.iter().cloned());
        args
    };
    let file = what.replace([' ', '=', ',', '/'], "_");
    let (a, b) = (
        dir.join(format!("{file}-threads.safetensors")),
        dir.join(format!("{file}-mpi.safetensors")),
    );
    let mut threads = Command::new(TPC);
    threads.args(args(&a));
    let threads = ok(run(threads, what), what);
    let mut procs = mpirun(np);
    procs.args(args(&b));
    let procs = ok(run(procs, what), what);
    assert_eq!(procs, threads, "{what}: tokens");
    assert_eq!(
        procs.trim(),
        csv(&reference.greedy[..n]),
        "{what}: HF's tokens"
    );
    let (x, y) = (logits(&b), logits(&a));
    assert_eq!(x.len(), y.len(), "{what}");
    let differ = x
        .iter()
        .zip(&y)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    assert_eq!(differ, 0, "{what}: logits not bit-identical to threads");
}

/// The mixture-of-experts fixtures as processes: experts split by features, dealt whole
/// unevenly (8 experts over 3 ranks), and dealt within each of two pipeline stages.
#[test]
fn moe_fixtures_as_processes_equal_threads_and_hf() {
    let dir = scratch("moe");
    let mut ran = 0;
    for name in common::MOE_FIXTURES {
        let fixture = Path::new("tests/fixtures/checkpoints").join(name);
        for (np, tp, pp, moe) in [
            (2usize, 2u64, 1u64, "tensor"),
            (3, 3, 1, "expert"),
            (4, 2, 2, "expert"),
        ] {
            let what = format!("{name} np={np} tp={tp} pp={pp} --moe {moe}");
            let extra = vec!["--moe".to_string(), moe.to_string()];
            processes_equal_threads_and_hf(&fixture, &dir, &what, (np, tp, pp), &extra);
            ran += 1;
        }
    }
    assert_eq!(ran, 12);
}

/// `--dp D --ep` as processes: each tp rank's experts dealt over the replicas' processes
/// (the layout's DP groups as MPI communicators), the routed rows swapped by
/// `MPI_Alltoallv`. Every MoE fixture at (np, tp, pp, dp) = (2, 1, 1, 2), (3, 1, 1, 3),
/// (4, 2, 1, 2) and, with two stages each sharing its layers' experts, (4, 1, 2, 2) prints
/// what the threaded `--ep` run prints (tokens, each EP rank's load, the same member order
/// so the same sums, and rank 0's weight bytes) and HF's greedy tokens for the sequences
/// with HF's prompt, while the replica with the 2-token request answers the others.
#[test]
fn moe_experts_over_replica_processes_equal_threads_and_hf() {
    let dir = scratch("moe-ep");
    let mut ran = 0;
    for name in common::MOE_FIXTURES {
        let fixture = Path::new("tests/fixtures/checkpoints").join(name);
        let reference = read_reference(&fixture);
        let n = reference.greedy.len().min(6);
        let prompts = dir.join(format!("{name}.jsonl"));
        let ids = |p: &[i64]| format!("[{}]", csv(p));
        let other: Vec<i64> = reference.prompt.iter().rev().take(5).copied().collect();
        std::fs::write(
            &prompts,
            format!(
                "{{\"prompt_ids\":{}}}\n{{\"prompt_ids\":{},\"max_new_tokens\":2}}\n{{\"prompt_ids\":{}}}\n",
                ids(&reference.prompt),
                ids(&reference.prompt),
                ids(&other)
            ),
        )
        .unwrap();
        for (np, tp, pp, dp) in [
            (2usize, 1u64, 1u64, 2u64),
            (3, 1, 1, 3),
            (4, 2, 1, 2),
            (4, 1, 2, 2),
        ] {
            let what = format!("{name} np={np} tp={tp} pp={pp} dp={dp} --ep");
            let args: Vec<String> = [
                "run",
                &fixture.to_string_lossy(),
                "--tp",
                &tp.to_string(),
                "--pp",
                &pp.to_string(),
                "--dp",
                &dp.to_string(),
                "--ep",
                "--moe",
                "expert",
                "--prompts",
                &prompts.to_string_lossy(),
                "--max-new-tokens",
                &n.to_string(),
                "--threads-per-rank",
                "1",
                "--json",
            ]
            .map(String::from)
            .to_vec();
            let mut threads = Command::new(TPC);
            threads.args(&args);
            let threads = ok(run(threads, &what), &what);
            let mut procs = mpirun(np);
            procs.args(&args);
            let procs = ok(run(procs, &what), &what);
            let parse = |out: &str| {
                let lines: Vec<serde_json::Value> = out
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap())
                    .collect();
                let tokens: Vec<serde_json::Value> =
                    lines[..3].iter().map(|l| l["generated"].clone()).collect();
                let summary = &lines[3]["summary"];
                (
                    tokens,
                    summary["moe_routed_pairs_per_rank"].clone(),
                    summary["weight_bytes_rank0"].clone(),
                )
            };
            let (t_tokens, t_load, t_bytes) = parse(&threads);
            let (p_tokens, p_load, p_bytes) = parse(&procs);
            assert_eq!(p_tokens, t_tokens, "{what}: tokens");
            assert_eq!(p_load, t_load, "{what}: load per EP rank");
            // Global rank 0's weights (its experts only), the first stage's with stages.
            assert_eq!(p_bytes, t_bytes, "{what}: rank 0's weight bytes");
            assert_eq!(
                p_load.as_array().map(Vec::len),
                Some(np),
                "{what}: one load per rank"
            );
            for (got, want) in p_tokens[..2].iter().zip([n, 2]) {
                assert_eq!(
                    got,
                    &serde_json::json!(reference.greedy[..want]),
                    "{what}: HF's tokens"
                );
            }
            ran += 1;
        }
    }
    assert_eq!(ran, 16);
}

/// Whether tpc splits `fixture` `tp` ways (with `extra` flags).
fn compiles(fixture: &Path, tp: u64, extra: &[String]) -> bool {
    Command::new(TPC)
        .args([
            "compile",
            &fixture.to_string_lossy(),
            "--tp",
            &tp.to_string(),
        ])
        .args(extra)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `--numerics invariant` as processes: every fixture's logits at tp 2 and 4, and at tp 2
/// over two stages, with and without `--fuse-norm`, are tp 1's bits (threads, one rank),
/// the collectives of MPI adding the exact sums' limbs in whatever order MPI likes.
#[test]
fn invariant_processes_give_tp_1s_bits() {
    let dir = scratch("invariant");
    let mut ran = 0;
    for fixture in fixtures() {
        let name = fixture.file_name().unwrap().to_string_lossy().into_owned();
        let reference = read_reference(&fixture);
        let args = |tp: u64, pp: u64, fuse_norm: bool, dump: &Path| -> Vec<String> {
            let mut args = [
                "run",
                &fixture.to_string_lossy(),
                "--tp",
                &tp.to_string(),
                "--pp",
                &pp.to_string(),
                "--numerics",
                "invariant",
                "--prompt-ids",
                &csv(&reference.prompt),
                "--max-new-tokens",
                "2",
                "--threads-per-rank",
                "1",
                "--dump-logits",
                &dump.to_string_lossy(),
            ]
            .map(String::from)
            .to_vec();
            if fuse_norm {
                args.push("--fuse-norm".into());
            }
            args
        };
        let one = dir.join(format!("{name}-tp1.safetensors"));
        let mut threads = Command::new(TPC);
        threads.args(args(1, 1, false, &one));
        ok(run(threads, &name), &name);
        let configs = [
            (2usize, 2u64, 1u64, false),
            (4, 4, 1, false),
            (4, 2, 2, false),
            (2, 2, 1, true),
            (4, 2, 2, true),
        ];
        for (np, tp, pp, fuse_norm) in configs {
            let fused = if fuse_norm { " --fuse-norm" } else { "" };
            let what = format!("{name} invariant np={np} tp={tp} pp={pp}{fused}");
            let many = dir.join(format!("{name}-{tp}-{pp}-{fuse_norm}.safetensors"));
            let mut procs = mpirun(np);
            procs.args(args(tp, pp, fuse_norm, &many));
            ok(run(procs, &what), &what);
            let (x, y) = (logits(&many), logits(&one));
            let first = x
                .iter()
                .zip(&y)
                .position(|(p, q)| p.to_bits() != q.to_bits());
            assert!(
                x.len() == y.len() && first.is_none(),
                "{what}: logit {first:?} differs from tp 1's"
            );
            ran += 1;
        }
    }
    assert!(ran >= 35, "only {ran} runs");
}

/// Four processes at tp 2: two external data-parallel replicas, the prompts dealt between
/// them and printed in input order, as one process prints them.
#[test]
fn replicas_as_processes_print_in_input_order() {
    let dir = scratch("replicas");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt_ids\": [3, 71, 249, 130]}\n{\"prompt_ids\": [5, 9], \"max_new_tokens\": 2}\n{\"prompt_ids\": [200, 1, 2]}\n",
    )
    .unwrap();
    let model = "tests/fixtures/checkpoints/llama-gqa";
    let args = [
        "run",
        model,
        "--tp",
        "2",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "5",
    ];
    let mut threads = Command::new(TPC);
    threads.args(args);
    let threads = ok(run(threads, "threads"), "threads");
    for np in [2, 4] {
        let mut procs = mpirun(np);
        procs.args(args);
        let procs = ok(run(procs, "mpi"), &format!("np={np}"));
        assert_eq!(procs, threads, "np={np}");
        assert_eq!(procs.lines().count(), 3);
    }
}

/// A run of tp 2 × pp 2 as four processes that takes minutes on its own (a batch of 64
/// prompts, generated 1000 times), so that a rank fails in the middle of it; with the
/// directory of its prompts, which must outlive it.
fn long_run(test: &str) -> (Command, Scratch) {
    let dir = scratch(test);
    let prompts = dir.join("prompts.jsonl");
    let lines: String = (0..64)
        .map(|i| format!("{{\"prompt_ids\": [{}, 71, 249]}}\n", 3 + i))
        .collect();
    std::fs::write(&prompts, lines).unwrap();
    let mut c = mpirun(4);
    c.args([
        "run",
        "tests/fixtures/checkpoints/llama-gqa",
        "--tp",
        "2",
        "--pp",
        "2",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "60",
        "--repeat",
        "1000",
    ]);
    (c, dir)
}

#[test]
fn a_rank_that_errors_or_panics_ends_every_process() {
    for (rank, kind, says) in [
        (
            1,
            "error",
            "rank 1 of 4: ranks as processes: rank 1: failed on purpose",
        ),
        (3, "panic", "rank 3: panicked on purpose"),
    ] {
        let (mut c, _dir) = long_run(kind);
        c.env("TPC_FAULT_INJECT", format!("{rank}:{kind}"));
        let o = run(c, kind);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{kind}: exited 0\n{err}");
        assert!(
            err.contains(says),
            "{kind}: stderr does not say `{says}`:\n{err}"
        );
    }
}

/// The processes `mpirun` (pid `parent`) started, with their world ranks.
fn ranks_of(parent: u32) -> Vec<(u32, usize)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The parent pid is the second field after the parenthesised name.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        if after.split_whitespace().nth(1) != Some(&parent.to_string()) {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        let rank = env
            .split(|&b| b == 0)
            .filter_map(|v| std::str::from_utf8(v).ok())
            .find_map(|v| v.strip_prefix("OMPI_COMM_WORLD_RANK=")?.parse().ok());
        if let Some(rank) = rank {
            found.push((pid, rank));
        }
    }
    found
}

#[test]
fn a_rank_killed_with_sigkill_ends_every_process() {
    let (mut command, _dir) = long_run("sigkill");
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun on PATH");
    let parent = child.id();
    // Wait until all four ranks run, and a little more so they are inside the generation.
    let start = Instant::now();
    let victim = loop {
        let ranks = ranks_of(parent);
        if ranks.len() == 4 {
            break ranks.iter().find(|(_, r)| *r == 1).unwrap().0;
        }
        assert!(start.elapsed() < HANG, "the four ranks never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(1500));
    let killed = Instant::now();
    assert!(Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap()
        .success());
    let o = finish(child, "after SIGKILL");
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!(
        "mpirun exited {} s after rank 1 was killed",
        killed.elapsed().as_secs_f64()
    );
    assert!(
        !o.status.success(),
        "exited 0 after a rank was killed\n{err}"
    );
    assert!(
        err.contains("rank 1") && err.contains("signal 9"),
        "stderr does not name rank 1 and SIGKILL:\n{err}"
    );
}

/// Two network namespaces joined by a veth pair, standing in for two hosts; removed on drop.
struct TwoHosts {
    names: [String; 2],
    dir: Scratch,
}

const HOST_IPS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

impl TwoHosts {
    /// `None` where this process may not create namespaces (not root, no CAP_NET_ADMIN).
    fn new() -> Option<TwoHosts> {
        let id = std::process::id();
        let names = [format!("tpc-a-{id}"), format!("tpc-b-{id}")];
        let veth = [format!("tv{id}a"), format!("tv{id}b")];
        let ip = |args: &[&str]| -> bool {
            Command::new("ip")
                .args(args)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !ip(&["netns", "add", &names[0]]) {
            return None;
        }
        let hosts = TwoHosts {
            names: names.clone(),
            dir: scratch("two-hosts"),
        };
        assert!(ip(&["netns", "add", &names[1]]));
        assert!(ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1]
        ]));
        for k in 0..2 {
            assert!(ip(&["link", "set", &veth[k], "netns", &names[k]]));
            let addr = format!("{}/24", HOST_IPS[k]);
            assert!(ip(&[
                "-n", &names[k], "addr", "add", &addr, "dev", &veth[k]
            ]));
            assert!(ip(&["-n", &names[k], "link", "set", &veth[k], "up"]));
            assert!(ip(&["-n", &names[k], "link", "set", "lo", "up"]));
        }
        // Open MPI starts its daemon on a "host" through this agent, as it would with ssh.
        let agent = hosts.dir.join("agent.sh");
        std::fs::write(
            &agent,
            format!(
                "#!/bin/sh\nwhile [ \"${{1#-}}\" != \"$1\" ]; do shift; done\nhost=$1; shift\ncase \"$host\" in\n  {}) ns={} ;;\n  {}) ns={} ;;\n  *) echo \"agent: unknown host $host\" >&2; exit 1 ;;\nesac\nexec ip netns exec \"$ns\" sh -c \"$*\"\n",
                HOST_IPS[0], names[0], HOST_IPS[1], names[1]
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(
            hosts.dir.join("hosts"),
            format!("{} slots=1\n{} slots=1\n", HOST_IPS[0], HOST_IPS[1]),
        )
        .unwrap();
        Some(hosts)
    }

    /// `mpirun` in the first namespace, one rank per host, MPI over TCP on the veth pair.
    fn mpirun(&self) -> Command {
        let mut c = Command::new("ip");
        let (agent, hostfile) = (self.dir.join("agent.sh"), self.dir.join("hosts"));
        c.args([
            "netns",
            "exec",
            &self.names[0],
            "mpirun",
            "--allow-run-as-root",
            // Both "hosts" are this machine: each daemon would bind its one rank to core 0,
            // the same core, and the two ranks would take turns by the scheduler's time slice.
            "--bind-to",
            "none",
        ]);
        c.args(["--hostfile", hostfile.to_str().unwrap(), "-np", "2"]);
        c.args(["--mca", "plm_rsh_agent", agent.to_str().unwrap()]);
        for (key, value) in [
            ("oob_tcp_if_include", "10.77.0.0/24"),
            ("btl", "tcp,self"),
            ("btl_tcp_if_include", "10.77.0.0/24"),
        ] {
            c.args(["--mca", key, value]);
        }
        c.arg(TPC);
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

/// Two ranks on two "hosts" (network namespaces joined by a veth pair, Open MPI over TCP
/// between them, its daemon started through `ip netns exec` as ssh would start it): tp 2
/// and pp 2 across the hosts print HF's tokens and the threaded run's logits bit for bit.
/// Where namespaces cannot be made (not root) it says so and passes only if
/// `TPC_REQUIRE_NETNS` is unset; `.ci/run` sets it where it can make them.
#[test]
fn ranks_on_two_hosts_over_tcp_equal_threads() {
    let Some(hosts) = TwoHosts::new() else {
        assert!(
            std::env::var_os("TPC_REQUIRE_NETNS").is_none(),
            "TPC_REQUIRE_NETNS is set but `ip netns add` failed"
        );
        eprintln!("SKIPPED: cannot create network namespaces here (needs root and iproute2)");
        return;
    };
    let fixture = std::fs::canonicalize("tests/fixtures/checkpoints/llama-gqa").unwrap();
    let reference = read_reference(&fixture);
    for (tp, pp) in [(2, 1), (1, 2)] {
        let what = format!("two hosts, tp={tp} pp={pp}");
        let dumps = [
            hosts.dir.join(format!("threads-{tp}-{pp}.safetensors")),
            hosts.dir.join(format!("hosts-{tp}-{pp}.safetensors")),
        ];
        let args = |dump: &Path| -> Vec<String> {
            [
                "run",
                fixture.to_str().unwrap(),
                "--tp",
                &tp.to_string(),
                "--pp",
                &pp.to_string(),
                "--prompt-ids",
                &csv(&reference.prompt),
                "--max-new-tokens",
                "6",
                "--threads-per-rank",
                "1",
                "--dump-logits",
                dump.to_str().unwrap(),
            ]
            .map(String::from)
            .to_vec()
        };
        let mut threads = Command::new(TPC);
        threads.args(args(&dumps[0]));
        let threads = ok(run(threads, &what), &what);
        let mut across = hosts.mpirun();
        across.args(args(&dumps[1]));
        let across = ok(run(across, &what), &what);
        assert_eq!(across, threads, "{what}");
        assert_eq!(across.trim(), csv(&reference.greedy[..6]), "{what}: HF");
        let (x, y) = (logits(&dumps[1]), logits(&dumps[0]));
        assert!(
            x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: logits differ from threads"
        );
    }
}

/// `tpc bench` and `tpc bench-comm` under `mpirun`: one report from world rank 0, saying
/// the ranks were processes, with figures in it.
#[test]
fn bench_and_bench_comm_run_as_processes() {
    let mut bench = mpirun(2);
    bench.args([
        "bench",
        "models/tiny-llama.ron",
        "--tp",
        "2",
        "--prompt-len",
        "8",
        "--max-new-tokens",
        "3",
    ]);
    let out = ok(run(bench, "bench"), "bench");
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one report, from world rank 0:\n{out}");
    let report: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(report["processes"], 2, "{report}");
    assert_eq!(report["tp"], 2, "{report}");
    assert_eq!(report["generated"], 3, "{report}");
    for key in ["prefill_tokens_per_s", "decode_tokens_per_s"] {
        let v = report[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{key} in {report}");
    }

    let mut comm = mpirun(2);
    comm.args([
        "bench-comm",
        "--iters",
        "3",
        "--from-log2",
        "12",
        "--to-log2",
        "13",
    ]);
    let out = ok(run(comm, "bench-comm"), "bench-comm");
    for kind in ["MpiExact", "MpiAllreduce"] {
        let rows: Vec<&str> = out.lines().filter(|l| l.contains(kind)).collect();
        assert_eq!(
            rows.len(),
            2,
            "{kind}: one row per size (4 and 8 KiB):\n{out}"
        );
        for row in rows {
            let median: f64 = row.split_whitespace().nth(4).unwrap().parse().unwrap();
            assert!(median > 0.0, "{row}");
        }
    }
    // MPI measures f32 only: asking for bf16 is an error, not a silent f32 run.
    let mut bf16 = mpirun(2);
    bf16.args(["bench-comm", "--iters", "1", "--dtype", "bf16"]);
    let o = run(bf16, "bench-comm bf16");
    assert!(
        !o.status.success(),
        "bench-comm --dtype bf16 over MPI succeeded"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("f32"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `mpirun` with one program per rank (MPMD: `-np 1 tpc ARGS0 : -np 1 tpc ARGS1 : …`), so
/// that each rank gets its own arguments.
fn mpirun_each(per_rank: &[Vec<String>]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe"]);
    for (i, args) in per_rank.iter().enumerate() {
        if i > 0 {
            c.arg(":");
        }
        c.args(["-np", "1", TPC]);
        c.args(args);
    }
    c
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A short greedy run of the llama-gqa fixture (or `model`) at tp `tp`, plus `extra`.
fn short_run(model: &str, tp: u64, extra: &[&str]) -> Vec<String> {
    let mut args = strings(&[
        "run",
        model,
        "--tp",
        &tp.to_string(),
        "--prompt-ids",
        "3,71,249",
        "--max-new-tokens",
        "3",
        "--threads-per-rank",
        "1",
    ]);
    args.extend(strings(extra));
    args
}

const GQA: &str = "tests/fixtures/checkpoints/llama-gqa";

/// Starts one rank per entry of `per_rank` and checks that the job ended (no hang: the
/// guard of [`finish`]) with exit 1 and every rank saying `says`, the differences named.
fn refused(per_rank: &[Vec<String>], says: &str) -> String {
    let what = format!("ranks {per_rank:?}");
    let o = run(mpirun_each(per_rank), &what);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{what}: {}\n{err}", o.status);
    for rank in 0..per_rank.len() {
        let line = format!("error: rank {rank} of {}: {says}", per_rank.len());
        assert!(err.contains(&line), "{what}: stderr lacks `{line}`:\n{err}");
    }
    assert!(
        String::from_utf8_lossy(&o.stdout).trim().is_empty(),
        "{what}: a rank printed results"
    );
    err
}

#[test]
fn ranks_with_another_seed_are_refused_naming_them() {
    let rank = |seed: &str| short_run(GQA, 1, &["--temperature", "0.8", "--seed", seed]);
    refused(
        &[rank("1"), rank("2"), rank("1")],
        "MPI ranks disagree on --seed: ranks 0,2 have 1, rank 1 has 2; start every rank with the same arguments",
    );
}

#[test]
fn ranks_with_another_tp_are_refused_naming_it() {
    // Not the plan as well: it differs only because --tp does.
    refused(
        &[short_run(GQA, 2, &[]), short_run(GQA, 1, &[])],
        "MPI ranks disagree on --tp: rank 0 has 2, rank 1 has 1; start every rank with the same arguments",
    );
}

#[test]
fn ranks_with_another_prompt_are_refused() {
    let mut other = short_run(GQA, 2, &[]);
    other[5] = "3,71,250".into();
    refused(
        &[short_run(GQA, 2, &[]), other],
        "MPI ranks disagree on the prompt (--prompt-ids, --prompt or --prompts): rank 0 has one value, rank 1 has another value; start every rank with the same arguments",
    );
}

#[test]
fn ranks_with_another_max_new_tokens_are_refused() {
    let mut other = short_run(GQA, 2, &[]);
    other[7] = "4".into();
    refused(
        &[short_run(GQA, 2, &[]), other],
        "MPI ranks disagree on --max-new-tokens: rank 0 has 3, rank 1 has 4;",
    );
}

#[test]
fn ranks_with_other_shard_options_are_refused() {
    for (flag, says) in [
        ("--fuse-norm", "--fuse-norm: rank 0 has off, rank 1 has on"),
        (
            "--sequence-parallel",
            "--sequence-parallel: rank 0 has off, rank 1 has on",
        ),
    ] {
        refused(
            &[short_run(GQA, 2, &[]), short_run(GQA, 2, &[flag])],
            &format!("MPI ranks disagree on {says}; start every rank with the same arguments"),
        );
    }
}

#[test]
fn ranks_with_other_sampling_and_repetitions_are_refused_naming_each() {
    let err = refused(
        &[
            short_run(GQA, 2, &["--temperature", "0.5"]),
            short_run(
                GQA,
                2,
                &[
                    "--temperature",
                    "0.5",
                    "--top-k",
                    "3",
                    "--gather-logits",
                    "--warmup",
                    "1",
                    "--repeat",
                    "2",
                ],
            ),
        ],
        "MPI ranks disagree on --top-k: rank 0 has none, rank 1 has 3",
    );
    for says in [
        "on --warmup: rank 0 has 0, rank 1 has 1",
        "on --repeat: rank 0 has 1, rank 1 has 2",
        "on --gather-logits: rank 0 has off, rank 1 has on",
    ] {
        assert!(err.contains(says), "stderr lacks `{says}`:\n{err}");
    }
}

/// A copy of the llama-gqa fixture at another path agrees (paths may differ between
/// hosts); the same copy with one weight changed — same shapes, same header — is refused,
/// naming the file.
#[test]
fn ranks_with_another_checkpoint_of_the_same_shapes_are_refused_naming_the_file() {
    let dir = scratch("checkpoint");
    let copy = dir.join("llama-gqa");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(GQA).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let copy_str = copy.to_str().unwrap();
    let same = ok(
        run(
            mpirun_each(&[short_run(GQA, 2, &[]), short_run(copy_str, 2, &[])]),
            "an identical copy",
        ),
        "an identical copy",
    );
    assert_eq!(same.trim().split(',').count(), 3, "{same}");

    // The first weight of one tensor changed: what a fine-tune of the same model does to
    // every tensor.
    let file = copy.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensor = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    let start = tensor.data().as_ptr() as usize - bytes.as_ptr() as usize;
    assert!(start >= 8 + header);
    let v = f32::from_le_bytes(bytes[start..start + 4].try_into().unwrap()) + 0.5;
    bytes[start..start + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    refused(
        &[short_run(GQA, 2, &[]), short_run(copy_str, 2, &[])],
        "MPI ranks disagree on the model file model.safetensors: rank 0 has one version, rank 1 has another version; give every rank the same model files",
    );
}

/// Ranks running another subcommand, or no MPI rank at all (`--launcher threads`,
/// `compile`), are refused before anything is loaded; before this, those that do not join
/// MPI left the others waiting forever.
#[test]
fn ranks_with_another_command_or_launcher_are_refused_without_waiting() {
    let bench = strings(&[
        "bench",
        GQA,
        "--tp",
        "2",
        "--prompt-len",
        "3",
        "--max-new-tokens",
        "3",
    ]);
    let command_dir = scratch("command");
    let compile_out = command_dir.join("plan.ron");
    let compile = strings(&[
        "compile",
        GQA,
        "--tp",
        "2",
        "-o",
        compile_out.to_str().unwrap(),
    ]);
    for (other, name) in [
        (bench, "bench"),
        (
            short_run(GQA, 2, &["--launcher", "threads"]),
            "run --launcher threads",
        ),
        (compile, "compile"),
    ] {
        refused(
            &[short_run(GQA, 2, &[]), other],
            &format!("MPI ranks disagree on the command: rank 0 has run, rank 1 has {name}; start every rank with the same tpc and the same command"),
        );
    }
    // bench-comm's ranks compare too, before their communicator is copied.
    let comm = |iters: &str| {
        strings(&[
            "bench-comm",
            "--iters",
            iters,
            "--from-log2",
            "12",
            "--to-log2",
            "12",
        ])
    };
    refused(
        &[comm("3"), comm("4")],
        "MPI ranks disagree on --iters: rank 0 has 3, rank 1 has 4",
    );
    // Every process running the same command without MPI ranks: each runs alone, as before.
    let mut alone = mpirun(2);
    alone.args(short_run(GQA, 2, &["--launcher", "threads"]));
    let out = ok(run(alone, "threads under mpirun"), "threads under mpirun");
    assert_eq!(out.lines().count(), 2, "{out}");
}
