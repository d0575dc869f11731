//! GPU ranks as MPI processes (features `cuda` and `mpi`) on the emulated GPUs: `--dp D
//! --ep` replicas, one process each, deal their experts over the replicas' processes and
//! swap the routed rows through MPI, as the CPU ranks do (`tests/mpi.rs`); and a server
//! whose stages are processes serves as the threads' does. The stand-in NCCL joins threads
//! of one process only, so these layouts have one rank per tp group.
#![cfg(all(feature = "cuda", feature = "mpi"))]

use super::common::{fixture, read_reference, MOE_FIXTURES};
use super::device::{emulated_gpu_path, emulation_wanted};
use super::serve_client::{requests, Server};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// `mpirun` for `np` processes of tpc that see the `LD_LIBRARY_PATH` this test sets.
fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe"]).args([
        "-x",
        "LD_LIBRARY_PATH",
        "-np",
        &np.to_string(),
        TPC,
    ]);
    c
}

const TPC: &str = env!("CARGO_BIN_EXE_tpc");

/// `tpc ARGS` on the emulated GPUs: as threads, or as `np` processes under `mpirun`; its
/// stdout, failing the test unless it exited 0.
fn tpc_on_emulated_gpus(np: Option<usize>, args: &[String], path: &str, what: &str) -> String {
    let mut c = match np {
        Some(np) => mpirun(np),
        None => Command::new(TPC),
    };
    let out = c
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("LD_LIBRARY_PATH", path)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{what}: {stderr}");
    stdout.into_owned()
}

/// (each sequence's tokens, each EP rank's routed pairs, rank 0's weight bytes) of a
/// `run --json` with `sequences` prompts.
fn parsed(out: &str, sequences: usize) -> (Vec<serde_json::Value>, serde_json::Value, u64) {
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tokens = lines[..sequences]
        .iter()
        .map(|l| l["generated"].clone())
        .collect();
    let summary = &lines[sequences]["summary"];
    (
        tokens,
        summary["moe_routed_pairs_per_rank"].clone(),
        summary["weight_bytes_rank0"].as_u64().unwrap(),
    )
}

/// Every MoE fixture with `--moe expert --ep` on the emulated GPUs, at (np, pp, dp) =
/// (2, 1, 2) and, with two stages each sharing its layers' experts, (4, 2, 2): the
/// processes print the threaded run's tokens, load per EP rank and rank 0's weight bytes
/// (its own experts only), and HF's greedy tokens for the sequences with HF's prompt, while
/// the replica given the 2-token request answers the other's rounds after it is done.
#[test]
fn expert_parallel_gpu_replicas_as_processes_equal_threads_and_hf() {
    if !emulation_wanted("expert_parallel_gpu_replicas_as_processes_equal_threads_and_hf") {
        return;
    }
    let path = emulated_gpu_path();
    let dir = std::env::temp_dir().join(format!("tpc-cuda-mpi-ep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut ran = 0;
    for name in MOE_FIXTURES {
        let fixture = Path::new("tests/fixtures/checkpoints").join(name);
        let reference = read_reference(&Path::new(env!("CARGO_MANIFEST_DIR")).join(&fixture));
        let n = reference.greedy.len().min(4);
        let ids = |p: &[i64]| {
            let s: Vec<String> = p.iter().map(i64::to_string).collect();
            format!("[{}]", s.join(","))
        };
        let prompts = dir.join(format!("{name}.jsonl"));
        std::fs::write(
            &prompts,
            format!(
                "{{\"prompt_ids\":{}}}\n{{\"prompt_ids\":{},\"max_new_tokens\":2}}\n",
                ids(&reference.prompt),
                ids(&reference.prompt),
            ),
        )
        .unwrap();
        for (np, pp, dp) in [(2usize, 1u64, 2u64), (4, 2, 2)] {
            let what = format!("{name} np={np} pp={pp} dp={dp} --ep on the emulated GPUs");
            let args: Vec<String> = [
                "run",
                &fixture.to_string_lossy(),
                "--pp",
                &pp.to_string(),
                "--dp",
                &dp.to_string(),
                "--ep",
                "--moe",
                "expert",
                "--device",
                "cuda",
                "--prompts",
                &prompts.to_string_lossy(),
                "--max-new-tokens",
                &n.to_string(),
                "--json",
            ]
            .map(String::from)
            .to_vec();
            let threads = parsed(&tpc_on_emulated_gpus(None, &args, &path, &what), 2);
            let procs = parsed(&tpc_on_emulated_gpus(Some(np), &args, &path, &what), 2);
            assert_eq!(procs.0, threads.0, "{what}: tokens");
            assert_eq!(procs.1, threads.1, "{what}: load per EP rank");
            assert_eq!(procs.2, threads.2, "{what}: rank 0's weight bytes");
            assert_eq!(procs.1.as_array().map(Vec::len), Some(np), "{what}: loads");
            for (got, want) in procs.0.iter().zip([n, 2]) {
                let hf = serde_json::json!(reference.greedy[..want]);
                assert_eq!(got, &hf, "{what}: HF's tokens");
            }
            eprintln!("{what}: tokens, loads and weight bytes equal the threads'");
            ran += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(ran, 2 * MOE_FIXTURES.len());
}

/// `mpirun -np 2 tpc serve … --pp 2 --device cuda`: one server whose two stages are
/// processes, each on an emulated GPU of its own, the activations between them staged
/// through MPI; and `--dp 2` (with `--ep` on an MoE fixture): two replicas' processes, a GPU
/// each, behind one front. Requests one at a time and all at once get the tokens each gets
/// alone, the reference prompt HF's; with a pool squeezed so that requests are preempted
/// too; both replicas serve; SIGTERM to the leading process drains the server and every
/// process exits 0.
#[test]
fn a_server_of_gpu_stage_processes_gives_every_request_its_solo_greedy_tokens() {
    let test = "a_server_of_gpu_stage_processes_gives_every_request_its_solo_greedy_tokens";
    if !emulation_wanted(test) {
        return;
    }
    let path = emulated_gpu_path();
    // llama-gqa at pp 2: keys and values of a stage's 1 layer, 2 kv heads of 8 dims, f32;
    // 12 blocks of 4 tokens: the longest request fits, all of them together do not.
    let per_token = 2 * 2 * 8 * 4;
    let squeezed_bytes = (per_token * 4 * 12).to_string();
    let configs: [(&str, &str, Vec<&str>); 4] = [
        ("pp 2", "llama-gqa", vec!["--pp", "2"]),
        (
            "pp 2, squeezed pool",
            "llama-gqa",
            vec!["--pp", "2", "--block-size", "4", "--no-prefix-caching"]
                .into_iter()
                .chain(["--kv-cache-memory", &squeezed_bytes])
                .chain(["--max-num-batched-tokens", "16"])
                .collect(),
        ),
        // Replicas as processes behind one front, a GPU each.
        ("dp 2", "llama-gqa", vec!["--dp", "2"]),
        // And dealing their experts over each other.
        (
            "dp 2 --ep",
            "qwen3-moe",
            vec!["--dp", "2", "--ep", "--moe", "expert"],
        ),
    ];
    for (what, name, args) in configs {
        let dir = fixture(name);
        let model = dir.to_str().unwrap();
        let reference = read_reference(&dir);
        let reqs = requests(&reference.prompt, reference.greedy.len(), 5);
        let mut c = mpirun(2);
        c.args(["serve", model, "--port", "0", "--host", "127.0.0.1"])
            .args(["--device", "cuda"])
            .args(&args)
            .env("LD_LIBRARY_PATH", &path);
        let server = Server::start(c, &format!("`mpirun -np 2 tpc serve {args:?}`"));
        server.check_alone_and_at_once(&reqs, &reference.greedy, what.contains("squeezed"), what);
        if what.starts_with("dp") {
            server.check_every_replica_served(2, what);
        }
        server.drain_from_leading(Duration::from_secs(300), what);
        eprintln!("{what}: {} requests alone and at once agree", reqs.len());
    }
}

/// Two ranks of one tp group on one GPU (`--device cuda:0`, two processes on this host):
/// NCCL would refuse them, or leave the other waiting; every process refuses first, naming
/// the ranks and the GPU, and the job ends with exit 1, no rank printing results.
#[test]
fn two_ranks_of_a_tp_group_on_one_gpu_are_refused_naming_them() {
    if !emulation_wanted("two_ranks_of_a_tp_group_on_one_gpu_are_refused_naming_them") {
        return;
    }
    // `timeout`: a guard against a hang (exit 124), not a speed limit.
    let out = Command::new("timeout")
        .args(["--kill-after=10", "300", "mpirun", "--allow-run-as-root"])
        .args(["--oversubscribe", "-x", "LD_LIBRARY_PATH", "-np", "2", TPC])
        .args(["run", "tests/fixtures/checkpoints/llama-gqa", "--tp", "2"])
        .args(["--device", "cuda:0", "--prompt-ids", "1,2,3"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("LD_LIBRARY_PATH", emulated_gpu_path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}: {err}", out.status);
    // The first rank to refuse aborts the job, so another's line may be cut or missing.
    let said = "--device cuda: ranks 0 and 1, of one tp group, would share GPU 0 of host";
    assert!(err.contains("error: rank ") && err.contains(said), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty());
}
