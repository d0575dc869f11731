//! Supervised runs (the default): a kind's cases run in a child process (this test
//! binary, one test) under an address-space limit, so that an abort, a stack overflow or a
//! hang — which kill or stall a process, beyond `catch_unwind` — is recorded with its
//! input, and the run resumes after it.

use super::harness::{failures_dir, Config};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Counts over every child of a kind.
#[derive(Default)]
pub struct Totals {
    pub tried: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub skipped: u64,
    /// Panics and broken invariants, reported and saved by the children.
    pub panics: u64,
    /// Crashes and hangs, one line each.
    pub deaths: Vec<String>,
}

/// The child's progress line: `seed case tried accepted rejected skipped failures`.
fn progress(line: &str) -> Option<(Option<u64>, [u64; 5])> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let counts = [n(2)?, n(3)?, n(4)?, n(5)?, n(6)?];
    Some((n(1), counts))
}

/// Runs `test` (the kind's test) in children until its cases are done.
pub fn supervise(kind: &str, test: &str, cfg: &Config) -> Totals {
    let hang = Duration::from_secs(env_u64("TPC_FUZZ_HANG_SECS", 20));
    let memory_kib = env_u64("TPC_FUZZ_MEMORY_MIB", 4096) * 1024;
    let last = failures_dir(kind).join("last");
    let case_file = last.join(format!("{kind}.case"));
    let exe = std::env::current_exe().expect("the test binary");
    let mut start = cfg.start;
    let mut totals = Totals::default();
    loop {
        let _ = std::fs::remove_file(&case_file);
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("ulimit -v {memory_kib}; exec \"$0\" \"$@\""))
            .arg(&exe)
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env("TPC_FUZZ_CHILD", "1")
            .env("TPC_FUZZ_START", start.to_string())
            .env("TPC_FUZZ_LAST", &last)
            .spawn()
            .expect("the test binary runs");
        let mut seen = String::new();
        let mut since = Instant::now();
        let hung = loop {
            if child.try_wait().expect("waiting for the child").is_some() {
                break false;
            }
            let now = std::fs::read_to_string(&case_file).unwrap_or_default();
            if now != seen {
                seen = now;
                since = Instant::now();
            } else if since.elapsed() > hang {
                let _ = child.kill();
                break true;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let status = child.wait().expect("the child's status");
        let seen = std::fs::read_to_string(&case_file).unwrap_or(seen);
        let Some((case, counts)) = progress(&seen) else {
            totals.deaths.push(format!(
                "{kind}: the child ended before its first case ({status})"
            ));
            return totals;
        };
        totals.tried += counts[0];
        totals.accepted += counts[1];
        totals.rejected += counts[2];
        totals.skipped += counts[3];
        totals.panics += counts[4];
        // `done`, or a normal exit (with or without panics, which the child reported).
        let Some(case) = case.filter(|_| hung || status.code().is_none()) else {
            return totals;
        };
        let what = if hung {
            format!("hang: no progress for {} s (killed)", hang.as_secs())
        } else {
            format!("crash: {status}")
        };
        let saved = save(kind, cfg.seed, case, &last);
        let line = format!(
            "{kind} case {case}: {what}; input {}; reproduce: TPC_FUZZ_SEED={} TPC_FUZZ_KINDS={kind} TPC_FUZZ_CASE={case} cargo test --release --test fuzz -- --nocapture",
            saved.display(),
            cfg.seed
        );
        eprintln!("FUZZ FAILURE {line}");
        totals.tried += 1;
        totals.deaths.push(line);
        if cfg.case.is_some() {
            return totals;
        }
        start = case + 1;
    }
}

/// Keeps the input the child was running.
fn save(kind: &str, seed: u64, case: u64, last: &Path) -> PathBuf {
    let to = failures_dir(kind).join(format!("seed{seed}-case{case}.crash"));
    let _ = std::fs::copy(last.join(format!("{kind}.input")), &to);
    to
}
