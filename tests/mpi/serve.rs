//! `mpirun -np W tpc serve …`: one server whose ranks are MPI processes, driven over HTTP.
//! Many requests at once get exactly the greedy tokens each gets alone — at tp 2, with
//! pipeline stages, with prompts prefilled in chunks, with a pool so small that requests are
//! preempted — the reference prompt gets HF's tokens, and SIGTERM to the leading process
//! drains the server: every process exits 0. (SIGTERM to Open MPI's `mpirun` itself ends the
//! job with status 1 whatever the processes do.)

use super::{fixtures, mpirun, read_reference, HANG};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A `tpc serve` job under `mpirun` on a free port, killed when dropped.
struct Server {
    child: Child,
    url: String,
    /// The leading process, which listens.
    lead_pid: String,
    said: Arc<Mutex<Vec<String>>>,
}

impl Server {
    fn start(np: usize, model: &str, args: &[&str]) -> Server {
        let mut c = mpirun(np);
        let mut child = c
            .args(["serve", model, "--port", "0", "--host", "127.0.0.1"])
            .args(["--threads-per-rank", "1"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mpirun ({e}); is Open MPI on PATH?"));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut said = String::new();
        let (url, lead_pid) = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("`mpirun -np {np} tpc serve {args:?}` exited before it listened:\n{said}");
            };
            if let Some((head, url)) = line.split_once("listening on ") {
                let pid = head
                    .split_once("leading process pid ")
                    .and_then(|(_, p)| p.split([',', ')']).next())
                    .unwrap_or_else(|| panic!("no leading pid in `{line}`"));
                break (url.trim().to_string(), pid.trim().to_string());
            }
            said.push_str(&line);
            said.push('\n');
        };
        // Drained for the server's life, so that its writes never block.
        let heard = Arc::new(Mutex::new(Vec::new()));
        let keep = heard.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(|l| l.ok()) {
                keep.lock().unwrap().push(line);
            }
        });
        Server {
            child,
            url,
            lead_pid,
            said: heard,
        }
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

    /// A metric's value in /metrics.
    fn metric(&self, name: &str) -> f64 {
        let text = ureq::get(&format!("{}/metrics", self.url))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
    }

    /// SIGTERM to the leading process; the job's exit status, and what it said meanwhile.
    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let pid = self.lead_pid.clone();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(200));
                let said = self.said.lock().unwrap().join("\n");
                return (status, said);
            }
            assert!(
                start.elapsed() < HANG,
                "mpirun still runs {HANG:?} after SIGTERM (hung)"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
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
    for i in 1..10i64 {
        let len = 1 + (i * 13) % 37;
        let prompt = (0..len).map(|j| (i * 31 + j * 17) % 249 + 1).collect();
        reqs.push((prompt, 1 + (i as usize * 5) % 9));
    }
    reqs
}

#[test]
fn a_server_of_mpi_processes_gives_every_request_its_solo_greedy_tokens() {
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("llama-gqa"))
        .unwrap();
    let model = dir.to_str().unwrap();
    let reference = read_reference(&dir);
    let reqs = requests(&reference.prompt, reference.greedy.len());
    // llama-gqa at tp 2: 2 layers, 1 kv head of 8 dims per rank, keys and values in f32;
    // 12 blocks of 4 tokens: the longest request (46 tokens) fits, all of them together
    // do not.
    let per_token = 2 * 2 * 8 * 4;
    let squeezed_bytes = (per_token * 4 * 12).to_string();
    let configs: [(&str, usize, Vec<&str>); 3] = [
        ("tp 2", 2, vec!["--tp", "2"]),
        (
            "tp 2, pp 2, chunked prefill",
            4,
            vec!["--tp", "2", "--pp", "2", "--block-size", "4"]
                .into_iter()
                .chain(["--max-num-batched-tokens", "3"])
                .collect(),
        ),
        (
            "tp 2, squeezed pool",
            2,
            vec!["--tp", "2", "--block-size", "4", "--no-prefix-caching"]
                .into_iter()
                .chain(["--kv-cache-memory", &squeezed_bytes])
                .chain(["--max-num-batched-tokens", "16"])
                .collect(),
        ),
    ];
    for (what, np, args) in configs {
        let server = Server::start(np, model, &args);
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
        if what.contains("squeezed") {
            assert!(
                server.metric("tpc_preemptions_total") > 0.0,
                "{what}: the pool was meant to force preemption"
            );
        }
        let (status, said) = server.terminate();
        assert!(
            status.success(),
            "{what}: SIGTERM to the leading process should drain and exit 0, got {status}:\n{said}"
        );
        eprintln!("{what}: {} requests alone and at once agree", reqs.len());
    }
}

#[test]
fn a_server_under_mpirun_refuses_replicas_and_a_wrong_process_count() {
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("llama-gqa"))
        .unwrap();
    let model = dir.to_str().unwrap();
    for (np, args, says) in [
        (4usize, vec!["--tp", "2"], "takes tp · pp = 2 processes"),
        (2, vec!["--tp", "2", "--dp", "2"], "serves one replica"),
    ] {
        let mut c = mpirun(np);
        c.args(["serve", model, "--port", "0"]).args(&args);
        let out = super::run(c, "serve refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} under -np {np} was served");
        assert!(err.contains(says), "{args:?} -np {np}: {err}");
    }
}
