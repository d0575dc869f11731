//! A `tpc serve` child driven over HTTP, for the tests that start a real server (`cuda`:
//! GPU ranks; `mpi`: ranks as processes): start it and wait for its address, greedy
//! completions, `/metrics`, SIGTERM, and the mix of requests they send.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A server child (started by the caller's command), killed when dropped.
pub struct Server {
    child: Child,
    pub url: String,
    /// The line that gave the address.
    pub line: String,
    /// What it said after that line, read for its whole life so its writes never block.
    said: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `command` (a `tpc serve … --port 0`) and waits for its "listening on" line.
    pub fn start(mut command: Command, what: &str) -> Server {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: cannot start ({e})"));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut before = String::new();
        let (url, line) = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("{what}: exited before it listened:\n{before}");
            };
            if let Some((_, url)) = line.split_once("listening on ") {
                break (url.trim().to_string(), line.clone());
            }
            before.push_str(&line);
            before.push('\n');
        };
        let said = Arc::new(Mutex::new(Vec::new()));
        let keep = said.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(|l| l.ok()) {
                keep.lock().unwrap().push(line);
            }
        });
        Server {
            child,
            url,
            line,
            said,
        }
    }

    /// Greedy ids for a prompt of ids.
    pub fn complete(&self, prompt: &[i64], max_tokens: usize) -> Vec<i64> {
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

    /// A metric's value in /metrics, summed over replicas (`name{replica="…"}`); a name
    /// with its labels gives that series alone.
    /// Each request's greedy tokens, every request sent at once (a thread each), in order.
    pub fn complete_all_at_once(&self, reqs: &[(Vec<i64>, usize)]) -> Vec<Vec<i64>> {
        // Every client thread ready before any sends, so the requests arrive together.
        let start = std::sync::Barrier::new(reqs.len());
        std::thread::scope(|s| {
            let running: Vec<_> = reqs
                .iter()
                .map(|(p, n)| {
                    let start = &start;
                    s.spawn(move || {
                        start.wait();
                        self.complete(p, *n)
                    })
                })
                .collect();
            running.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every request alone, then all at once: the same greedy tokens both ways, as many as
    /// each asked, the first request `greedy` (HF's tokens for its prompt); the pool is
    /// empty after. Where `squeezed` (a pool too small for all of them together) requests
    /// must have been preempted on the way: how many run together depends on when they
    /// arrive, so the all-at-once round is repeated, each time with the same check, until
    /// one has preempted (at most five rounds).
    pub fn check_alone_and_at_once(
        &self,
        reqs: &[(Vec<i64>, usize)],
        greedy: &[i64],
        squeezed: bool,
        what: &str,
    ) {
        let solo: Vec<Vec<i64>> = reqs.iter().map(|(p, n)| self.complete(p, *n)).collect();
        assert_eq!(solo[0], greedy, "{what}: not HF's tokens");
        for round in 1..=5 {
            let together: Vec<Vec<i64>> = self.complete_all_at_once(reqs);
            for (k, (got, want)) in together.iter().zip(&solo).enumerate() {
                assert_eq!(got, want, "{what}: request {k} at once differs from alone");
                assert_eq!(got.len(), reqs[k].1, "{what}: request {k}");
            }
            assert_eq!(self.metric("tpc_kv_blocks_in_use"), 0.0, "{what}");
            if !squeezed || self.metric("tpc_preemptions_total") > 0.0 {
                return;
            }
            eprintln!("{what}: round {round} at once preempted nothing; again");
        }
        panic!("{what}: the pool was meant to force preemption, and five rounds did not");
    }

    pub fn metric(&self, name: &str) -> f64 {
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

    /// The pid of the leading process of a server under `mpirun`, which the line it listens
    /// with names.
    pub fn leading_pid(&self) -> String {
        self.line
            .split_once("leading process pid ")
            .and_then(|(_, p)| p.split([',', ')']).next())
            .unwrap_or_else(|| panic!("no leading pid in `{}`", self.line))
            .trim()
            .to_string()
    }

    /// Every one of `replicas` replicas has generated tokens (its labelled metric).
    pub fn check_every_replica_served(&self, replicas: usize, what: &str) {
        for r in 0..replicas {
            let tokens = self.metric(&format!("tpc_generation_tokens_total{{replica=\"{r}\"}}"));
            assert!(tokens > 0.0, "{what}: replica {r} ran no request");
        }
    }

    /// SIGTERM to the leading process of a server under mpirun: it drains, and every
    /// process of the job exits 0 within `hang`.
    pub fn drain_from_leading(self, hang: Duration, what: &str) {
        let pid = self.leading_pid();
        let (status, said) = self.terminate(&pid, hang);
        assert!(
            status.success(),
            "{what}: SIGTERM to the leading process should drain and exit 0, got {status}:\n{said}"
        );
    }

    /// SIGTERM to `pid` (the server's process, or one of its job); then the child's exit
    /// status and what it said. A child still running after `hang` fails the test.
    pub fn terminate(self, pid: &str, hang: Duration) -> (ExitStatus, String) {
        let sent = Command::new("kill").args(["-TERM", pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
        self.wait_exit(hang)
    }

    /// The pid of the child (the server, or `mpirun`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the child to exit; its exit status and what it said. A child still running
    /// after `hang` fails the test.
    pub fn wait_exit(mut self, hang: Duration) -> (ExitStatus, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(200));
                let said = self.said.lock().unwrap().join("\n");
                return (status, said);
            }
            assert!(
                start.elapsed() < hang,
                "still running {hang:?} later (hung)"
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

/// The reference prompt with its `greedy` tokens, then `more` requests of 1 to 37 prompt
/// ids and 1 to 9 new tokens.
pub fn requests(reference: &[i64], greedy: usize, more: i64) -> Vec<(Vec<i64>, usize)> {
    let mut reqs = vec![(reference.to_vec(), greedy)];
    for i in 1..=more {
        let len = 1 + (i * 13) % 37;
        let prompt = (0..len).map(|j| (i * 31 + j * 17) % 249 + 1).collect();
        reqs.push((prompt, 1 + (i as usize * 5) % 9));
    }
    reqs
}
