//! `tpc serve --device cuda` (feature `cuda`): the engine on GPU ranks, driven over HTTP.
//! Many requests at once get exactly the greedy tokens each gets alone, with a roomy pool,
//! with prompts prefilled in chunks of a few tokens, and with a pool so small that requests
//! are preempted and recomputed; the reference prompt gets HF's tokens. On the emulated GPUs
//! of `tests/emulator` (one GPU shared by the tp ranks, two GPUs through the stand-in NCCL,
//! and two replicas over them), or on a real GPU where `TPC_REQUIRE_GPU` is set
//! (`scripts/device_check.sh`).
#![cfg(feature = "cuda")]

use crate::common::{fixtures, read_reference};
use crate::device::{emulated_gpu_path, emulation_wanted, gpu_present};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// `LD_LIBRARY_PATH` for the server: the emulator's libraries, or this run's own on a real
/// GPU. `None`: the test cannot run here (it said why).
fn library_path(test: &str) -> Option<String> {
    if std::env::var_os("TPC_REQUIRE_GPU").is_some() {
        return gpu_present(test).then(|| std::env::var("LD_LIBRARY_PATH").unwrap_or_default());
    }
    emulation_wanted(test).then(emulated_gpu_path)
}

/// A `tpc serve` child on a free port, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(model: &str, args: &[&str], path: &str) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tpc"))
            .args(["serve", model, "--port", "0", "--host", "127.0.0.1"])
            .args(args)
            .env("LD_LIBRARY_PATH", path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut said = String::new();
        let url = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("`tpc serve {args:?}` exited before it listened:\n{said}");
            };
            if let Some((_, url)) = line.split_once("listening on ") {
                break url.trim().to_string();
            }
            said.push_str(&line);
            said.push('\n');
        };
        // Drained for the server's life, so that its writes never block.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, url }
    }

    /// Greedy ids for a prompt of ids.
    fn complete(&self, prompt: &[i64], max_tokens: usize) -> Vec<i64> {
        let body = json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": true, "return_token_ids": true });
        let mut r = ureq::post(&format!("{}/v1/completions", self.url))
            .send_json(&body)
            .unwrap_or_else(|e| panic!("{body}: {e}"));
        let v: Value = r.body_mut().read_json().unwrap();
        v["choices"][0]["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no token ids in {v}"))
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect()
    }

    /// A metric's value in /metrics, summed over replicas (`name{replica="…"}`).
    fn metric(&self, name: &str) -> f64 {
        let text = ureq::get(&format!("{}/metrics", self.url))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        let values: Vec<f64> = text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(name)?;
                let value = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once("} ")?.1,
                    None => rest.strip_prefix(' ')?,
                };
                value.trim().parse().ok()
            })
            .collect();
        assert!(!values.is_empty(), "no {name} in /metrics:\n{text}");
        values.iter().sum()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Requests of 1 to 37 prompt ids and 1 to 9 new tokens, the reference prompt first.
fn requests(reference: &[i64], greedy: usize) -> Vec<(Vec<i64>, usize)> {
    let mut reqs = vec![(reference.to_vec(), greedy)];
    for i in 1..12i64 {
        let len = 1 + (i * 13) % 37;
        let prompt = (0..len).map(|j| (i * 31 + j * 17) % 249 + 1).collect();
        reqs.push((prompt, 1 + (i as usize * 5) % 9));
    }
    reqs
}

#[test]
fn serving_on_gpus_gives_every_request_its_solo_greedy_tokens() {
    let test = "serving_on_gpus_gives_every_request_its_solo_greedy_tokens";
    let Some(path) = library_path(test) else {
        return;
    };
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("llama-gqa"))
        .unwrap();
    let model = dir.to_str().unwrap();
    let reference = read_reference(&dir);
    let reqs = requests(&reference.prompt, reference.greedy.len());
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
        let server = Server::start(model, &args, &path);
        let solo: Vec<Vec<i64>> = reqs.iter().map(|(p, n)| server.complete(p, *n)).collect();
        assert_eq!(solo[0], reference.greedy, "{what}: not HF's tokens");
        let together: Vec<Vec<i64>> = std::thread::scope(|s| {
            let running: Vec<_> = reqs
                .iter()
                .map(|(p, n)| s.spawn(|| server.complete(p, *n)))
                .collect();
            running.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (k, (got, want)) in together.iter().zip(&solo).enumerate() {
            assert_eq!(got, want, "{what}: request {k} at once differs from alone");
            assert_eq!(got.len(), reqs[k].1, "{what}: request {k}");
        }
        assert_eq!(server.metric("tpc_kv_blocks_in_use"), 0.0, "{what}");
        if what == "squeezed pool" {
            assert!(
                server.metric("tpc_preemptions_total") > 0.0,
                "{what}: the pool was meant to force preemption"
            );
        }
        if what == "two replicas" {
            for r in 0..2 {
                let done =
                    server.metric(&format!("tpc_generation_tokens_total{{replica=\"{r}\"}}"));
                assert!(done > 0.0, "{what}: replica {r} served no request");
            }
        }
        eprintln!("{what}: {} requests alone and at once agree", reqs.len());
    }
}
