//! Kind `cli`: argument vectors (one argument per line) for the cheap commands, run as the
//! built `tpc` binary in a fresh directory holding tiny models and plans. A panic (exit
//! 101), a death by signal (abort, stack overflow, the 4 GiB address-space limit) or a
//! run past 20 s is a failure; exit 1 or 2 is an ordinary refusal.

use super::harness::{corpus, scratch, Kind, Outcome};
use super::mutate::mutate;
use super::rng::Rng;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Only commands that finish in milliseconds on tiny inputs: `run`, `verify` and the
/// benches would turn huge mutated numbers into legitimately long work.
const CHEAP: &[&str] = &[
    "compile",
    "dot",
    "ranks",
    "lower",
    "import",
    "help",
    "--help",
    "-h",
    "--version",
    "-V",
];

const HANG: Duration = Duration::from_secs(20);

/// Address-space limit of each run, in KiB: a huge allocation aborts instead of swapping.
const MEMORY_KIB: u64 = 4 << 20;

const SEEDS: &[&str] = &[
    "compile\ntiny-llama.ron\n--tp\n2",
    "compile\ntiny-llama.ron\n--tp\n4\n-o\nout.ron\n--dot\nout.dot\n--text",
    "compile\ntiny-gpt2.ron\n--tp\n3\n--json",
    "compile\nhf\n--tp\n8",
    "compile\nhf/config.json\n--tp\n2\n-o\nout.json",
    "compile\ntiny-llama-explicit.ron\n--tp\n2",
    "compile\nplan.ron\n--tp\n2",
    "dot\ntiny-llama.ron\n--tp\n2\n--all-ranks\n--layers\n0..1",
    "dot\nplan.ron\n--layers\n1",
    "dot\nplan.json\n--tp\n2\n-o\nout.dot",
    "ranks\n--world\n16\n--tp\n2\n--pp\n2\n--dp\n2",
    "ranks\n--world\n8\n--tp\n8\n--json",
    "lower\ntiny-llama.ron\n-o\nlowered.ron",
    "lower\nhf",
    "import\nhf/config.json\n-o\nimported.ron",
    "import\ngpt2",
    "compile\n--help",
    "--version",
];

const DICT: &[&str] = &[
    "compile",
    "dot",
    "ranks",
    "lower",
    "import",
    "--tp",
    "--tp=",
    "-o",
    "--output",
    "--dot",
    "--json",
    "--text",
    "--all-ranks",
    "--layers",
    "0..=3",
    "5..2",
    "--world",
    "--pp",
    "--dp",
    "tiny-llama.ron",
    "tiny-gpt2.ron",
    "tiny-neox.ron",
    "hf",
    "gpt2",
    "plan.ron",
    "plan.json",
    "missing.ron",
    "out.ron",
    "\n",
    "\n\n",
    "-",
    "--",
    "=",
];

/// Files every run finds in its directory.
fn inputs(dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for m in [
        "tiny-llama.ron",
        "tiny-gpt2.ron",
        "tiny-neox.ron",
        "tiny-llama-explicit.ron",
    ] {
        std::fs::copy(root.join("models").join(m), dir.join(m)).unwrap();
    }
    for (from, to) in [
        ("tests/fixtures/hf_configs/llama3-8b", "hf"),
        ("tests/fixtures/checkpoints/gpt2", "gpt2"),
    ] {
        std::fs::create_dir_all(dir.join(to)).unwrap();
        std::fs::copy(
            root.join(from).join("config.json"),
            dir.join(to).join("config.json"),
        )
        .unwrap();
    }
    let def = tpc::frontend::load::load_model(&root.join("models/tiny-llama.ron")).unwrap();
    let plan = tpc::pipeline::compile(&def, 2).unwrap().plan;
    plan.save(&dir.join("plan.ron")).unwrap();
    plan.save(&dir.join("plan.json")).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

pub fn kind() -> Kind {
    let dir = scratch("cli");
    let pristine = dir.join("inputs");
    std::fs::create_dir_all(&pristine).unwrap();
    inputs(&pristine);
    let mut seeds: Vec<(String, Vec<u8>)> = SEEDS
        .iter()
        .map(|s| (s.replace('\n', " "), s.as_bytes().to_vec()))
        .collect();
    seeds.extend(corpus("cli"));
    Kind {
        name: "cli",
        ext: "args",
        default_iters: 150,
        seeds,
        dict: DICT,
        max_len: 4096,
        mutator: args_mutator,
        target: Box::new(move |bytes| run_tpc(&dir, &pristine, bytes)),
    }
}

/// Mostly keeps the subcommand and mutates its arguments: a mutated subcommand is
/// usually one the kind skips.
fn args_mutator(
    rng: &mut Rng,
    input: &[u8],
    others: &[Vec<u8>],
    dict: &[&str],
    max_len: usize,
) -> Vec<u8> {
    let split = input.iter().position(|&b| b == b'\n');
    match split {
        Some(i) if !rng.one_in(8) => {
            let mut out = input[..=i].to_vec();
            out.extend(mutate(rng, &input[i + 1..], others, dict, max_len));
            out
        }
        _ => mutate(rng, input, others, dict, max_len),
    }
}

fn run_tpc(dir: &Path, pristine: &Path, bytes: &[u8]) -> Outcome {
    let args: Vec<&OsStr> = bytes
        .split(|&b| b == b'\n')
        .map(OsStr::from_bytes)
        .collect();
    let cheap = args
        .first()
        .is_some_and(|a| CHEAP.iter().any(|c| OsStr::new(c) == *a));
    // Outputs stay inside the run's directory: no absolute paths, no way up.
    let contained = args.iter().all(|a| {
        let a = a.as_bytes();
        !a.starts_with(b"/") && !a.windows(2).any(|w| w == b"..") && !a.contains(&0)
    });
    if !cheap || !contained {
        return Outcome::Skipped;
    }
    let work: PathBuf = dir.join("run");
    let _ = std::fs::remove_dir_all(&work);
    copy_dir(pristine, &work);
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {MEMORY_KIB}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_tpc"))
        .args(&args)
        .current_dir(&work)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("sh runs");
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for tpc") {
            break status;
        }
        if started.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            return Outcome::Failed(format!(
                "hang: tpc still running after {} s",
                HANG.as_secs()
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    match (status.code(), status.signal()) {
        (Some(0), _) => Outcome::Accepted,
        (Some(101), _) => Outcome::Failed(panic_report(&stderr)),
        (Some(_), _) => Outcome::Rejected,
        (None, signal) => Outcome::Failed(format!(
            "crash: killed by signal {}\n{}",
            signal.unwrap_or(0),
            tail(&stderr)
        )),
    }
}

/// `panicked at FILE:LINE:COL: MESSAGE` from the default hook's output, then the rest.
fn panic_report(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().collect();
    match lines.iter().position(|l| l.contains("panicked at")) {
        Some(i) => {
            let at = lines[i].split("panicked at ").nth(1).unwrap_or("");
            let message = lines.get(i + 1).copied().unwrap_or("");
            format!(
                "panicked at {}: {message}\n{}",
                at.trim_end_matches(':'),
                tail(stderr)
            )
        }
        None => format!("crash: exit 101\n{}", tail(stderr)),
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
