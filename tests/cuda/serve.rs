//! `tpc serve --device cuda` (feature `cuda`): the engine on GPU ranks, driven over HTTP.
//! Many requests at once get exactly the greedy tokens each gets alone, with a roomy pool,
//! with prompts prefilled in chunks of a few tokens, and with a pool so small that requests
//! are preempted and recomputed; the reference prompt gets HF's tokens; mixture-of-experts
//! replicas sharing their experts (`--dp 2 --ep`) give their `--dp 1` tokens. On the emulated GPUs
//! of `tests/emulator` (one GPU shared by the tp ranks, two GPUs through the stand-in NCCL,
//! and two replicas over them), or on a real GPU where `TPC_REQUIRE_GPU` is set
//! (`scripts/device_check.sh`).
#![cfg(feature = "cuda")]

use crate::common::{fixture, read_reference};
use crate::device::{emulated_gpu_path, emulation_wanted, gpu_present};
use crate::serve_client::{requests, Server};
use std::process::Command;

/// `LD_LIBRARY_PATH` for the server: the emulator's libraries, or this run's own on a real
/// GPU. `None`: the test cannot run here (it said why).
fn library_path(test: &str) -> Option<String> {
    if std::env::var_os("TPC_REQUIRE_GPU").is_some() {
        return gpu_present(test).then(|| std::env::var("LD_LIBRARY_PATH").unwrap_or_default());
    }
    emulation_wanted(test).then(emulated_gpu_path)
}

/// `tpc serve MODEL ARGS` on a free port with the libraries of `path`.
fn start(model: &str, args: &[&str], path: &str) -> Server {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tpc"));
    c.args(["serve", model, "--port", "0", "--host", "127.0.0.1"])
        .args(args)
        .env("LD_LIBRARY_PATH", path);
    Server::start(c, &format!("`tpc serve {args:?}`"))
}

#[test]
fn serving_on_gpus_gives_every_request_its_solo_greedy_tokens() {
    let test = "serving_on_gpus_gives_every_request_its_solo_greedy_tokens";
    let Some(path) = library_path(test) else {
        return;
    };
    let dir = fixture("llama-gqa");
    let model = dir.to_str().unwrap();
    let reference = read_reference(&dir);
    let reqs = requests(&reference.prompt, reference.greedy.len(), 11);
    // llama-gqa at tp 2: 2 layers, 1 kv head of 8 dims per rank, keys and values in f32.
    let per_token = 2 * 2 * 8 * 4;
    let squeezed_bytes = (per_token * 4 * 12).to_string();
    let configs: [(&str, Vec<&str>); 5] = [
        // The pool from the GPU's free memory.
        ("one GPU", vec!["--device", "cuda:0"]),
        (
            "chunked prefill",
            vec!["--device", "cuda:0", "--block-size", "4"]
                .into_iter()
                .chain(["--max-num-batched-tokens", "3"])
                .collect(),
        ),
        // 12 blocks of 4 tokens: the longest request (46 tokens) fits, all of them together
        // do not.
        (
            "squeezed pool",
            vec![
                "--device",
                "cuda:0",
                "--block-size",
                "4",
                "--no-prefix-caching",
            ]
            .into_iter()
            .chain(["--kv-cache-memory", &squeezed_bytes])
            .chain(["--max-num-batched-tokens", "16"])
            .collect(),
        ),
        ("two GPUs", vec!["--device", "cuda:0,1"]),
        // Two replicas, each over both GPUs through NCCL; requests go to the least loaded.
        ("two replicas", vec!["--device", "cuda:0,1", "--dp", "2"]),
    ];
    // The emulator has as many GPUs as asked; a real machine may have one.
    let real_gpus = std::env::var_os("TPC_REQUIRE_GPU")
        .map(|_| tpc::runtime::cuda::device::device_count().unwrap_or(0));
    for (what, args) in configs {
        if real_gpus.is_some_and(|n| n < 2) && args.contains(&"cuda:0,1") {
            eprintln!("SKIP {what}: this machine has one GPU");
            continue;
        }
        let mut args = args;
        args.extend(["--tp", "2"]);
        let server = start(model, &args, &path);
        server.check_alone_and_at_once(&reqs, &reference.greedy, what == "squeezed pool", what);
        if what == "two replicas" {
            server.check_every_replica_served(2, what);
        }
        eprintln!("{what}: {} requests alone and at once agree", reqs.len());
    }
}

/// `tpc serve --dp 2 --ep` on GPU ranks: two replicas, one per GPU, deal their experts over
/// each other and swap the routed rows at every MoE layer, so the replica without a request
/// answers the other's calls. Every MoE fixture, requests one at a time (one replica
/// working, the other only answering) and all at once (both working), gets the tokens the
/// same GPU engine gives at `--dp 1`, and HF's for HF's prompt; both replicas serve.
#[test]
fn serving_moe_replicas_sharing_experts_on_gpus_gives_their_dp_1_tokens() {
    let test = "serving_moe_replicas_sharing_experts_on_gpus_gives_their_dp_1_tokens";
    let Some(path) = library_path(test) else {
        return;
    };
    let real_gpus = std::env::var_os("TPC_REQUIRE_GPU")
        .map(|_| tpc::runtime::cuda::device::device_count().unwrap_or(0));
    if real_gpus.is_some_and(|n| n < 2) {
        eprintln!("SKIP {test}: this machine has one GPU");
        return;
    }
    for name in crate::common::MOE_FIXTURES {
        let dir = std::path::Path::new("tests/fixtures/checkpoints").join(name);
        let model = dir.to_str().unwrap();
        let reference = read_reference(&dir);
        let reqs = requests(&reference.prompt, reference.greedy.len(), 5);
        let common = ["--tp", "1", "--moe", "expert", "--device", "cuda:0,1"];
        let alone: Vec<Vec<i64>> = {
            let server = start(model, &common, &path);
            reqs.iter().map(|(p, n)| server.complete(p, *n)).collect()
        };
        assert_eq!(alone[0], reference.greedy, "{name} --dp 1: not HF's tokens");
        let mut args = common.to_vec();
        args.extend(["--dp", "2", "--ep"]);
        let server = start(model, &args, &path);
        let one_at_a_time: Vec<Vec<i64>> =
            reqs.iter().map(|(p, n)| server.complete(p, *n)).collect();
        assert_eq!(one_at_a_time, alone, "{name} --dp 2 --ep, one at a time");
        let together: Vec<Vec<i64>> = server.complete_all_at_once(&reqs);
        assert_eq!(together, alone, "{name} --dp 2 --ep, all at once");
        server.check_every_replica_served(2, name);
        eprintln!(
            "{name}: {} requests at --dp 2 --ep agree with --dp 1",
            reqs.len()
        );
    }
}
