//! The fuzz loop: seeds first, unmutated, then mutated cases, each run under
//! `catch_unwind` with a silent panic hook that keeps the message, location and tpc frames.
//! Errors returned by tpc are expected; a panic (or a broken invariant a target reports)
//! is a failure, written under `target/fuzz-failures/<kind>/` with the reproducing seed.

use super::rng::{case_seed, Rng};
use crate::scratch_dir::Scratch;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

/// What one input did.
pub enum Outcome {
    /// tpc took it (parsed, compiled, loaded...).
    Accepted,
    /// tpc refused it with an error: expected for most mutated inputs.
    Rejected,
    /// The target chose not to run it (a CLI vector outside the cheap commands).
    Skipped,
    /// A crash, hang or broken invariant, described.
    Failed(String),
}

/// Runs one input through tpc.
pub type Target = Box<dyn Fn(&[u8]) -> Outcome>;

pub type Mutator = fn(&mut Rng, &[u8], &[Vec<u8>], &[&str], usize) -> Vec<u8>;

/// One input kind: its seeds, how to mutate them and what to run on each input.
pub struct Kind {
    pub name: &'static str,
    /// File extension for saved failing inputs.
    pub ext: &'static str,
    /// Mutated cases in the default (short) run.
    pub default_iters: u64,
    /// (label, bytes): fixtures and `tests/fuzz/corpus/<kind>/`, each also run unmutated.
    pub seeds: Vec<(String, Vec<u8>)>,
    pub dict: &'static [&'static str],
    pub max_len: usize,
    pub mutator: Mutator,
    pub target: Target,
}

/// The run's knobs, from the environment (see docs/FUZZING.md).
pub struct Config {
    pub seed: u64,
    pub iters: Option<u64>,
    /// First case to run (to resume after a crash).
    pub start: u64,
    /// Only this case.
    pub case: Option<u64>,
    pub kinds: Option<Vec<String>>,
    /// Where to write each input before running it, so that a process killed by an abort
    /// or a hang leaves its last input behind.
    pub last_dir: Option<PathBuf>,
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

impl Config {
    pub fn from_env() -> Config {
        Config {
            seed: env_u64("TPC_FUZZ_SEED").unwrap_or(1),
            iters: env_u64("TPC_FUZZ_ITERS"),
            start: env_u64("TPC_FUZZ_START").unwrap_or(0),
            case: env_u64("TPC_FUZZ_CASE"),
            kinds: std::env::var("TPC_FUZZ_KINDS")
                .ok()
                .map(|s| s.split(',').map(|k| k.trim().to_string()).collect()),
            last_dir: std::env::var_os("TPC_FUZZ_LAST").map(PathBuf::from),
        }
    }

    pub fn wants(&self, kind: &str) -> bool {
        self.kinds
            .as_ref()
            .is_none_or(|ks| ks.iter().any(|k| k == kind))
    }
}

pub fn failures_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/fuzz-failures")
        .join(kind)
}

/// The input of case `case`: a seed as it is, or a mutation of one.
pub fn input_of(kind: &Kind, seed: u64, case: u64, seed_bytes: &[Vec<u8>]) -> Vec<u8> {
    if let Some((_, bytes)) = kind.seeds.get(case as usize) {
        return bytes.clone();
    }
    let mut rng = Rng::new(case_seed(seed, kind.name, case));
    let base = &seed_bytes[rng.below(seed_bytes.len())];
    (kind.mutator)(&mut rng, base, seed_bytes, kind.dict, kind.max_len)
}

/// The default mutator.
pub use super::mutate::mutate as bytes_mutator;

// Panic capture: one process-wide hook, silent while a fuzz target runs. Rank threads of
// the runtime panic on their own threads (the launcher turns that into an error), so the
// hook records every thread's panic, and in-process kinds take turns (`TURN`) so that a
// record belongs to the case running.
static HOOK: Once = Once::new();
static CAPTURING: AtomicBool = AtomicBool::new(false);
static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static TURN: Mutex<()> = Mutex::new(());

fn install_hook() {
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CAPTURING.load(Ordering::SeqCst) {
                return default(info);
            }
            let location = info
                .location()
                .map(|l| l.to_string())
                .unwrap_or_else(|| "?".into());
            let message = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let frames = tpc_frames(&std::backtrace::Backtrace::force_capture().to_string());
            let report = format!("panicked at {location}: {message}\n{frames}");
            PANICS
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(report);
        }));
    });
}

/// The backtrace's frames in tpc's own code (`src/...`), innermost first.
fn tpc_frames(backtrace: &str) -> String {
    let lines: Vec<&str> = backtrace.lines().map(str::trim).collect();
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let at = lines.get(i + 1).copied().unwrap_or("");
        let ours = at.starts_with("at ") && at.contains("/src/") && !at.contains("/rustc/");
        if ours && l.contains("tpc::") && !at.contains("/.cargo/") {
            out.push_str(&format!("    {l}\n      {at}\n"));
        }
    }
    out
}

/// Runs `f` with panics captured: `Failed` with the report when anything panicked.
pub fn guarded(f: impl FnOnce() -> Outcome) -> Outcome {
    PANICS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    let result = catch_unwind(AssertUnwindSafe(f));
    let reports = std::mem::take(&mut *PANICS.lock().unwrap_or_else(PoisonError::into_inner));
    match result {
        Ok(outcome) if reports.is_empty() => outcome,
        _ if !reports.is_empty() => Outcome::Failed(reports.join("\n")),
        _ => Outcome::Failed("panicked (no report captured)".into()),
    }
}

/// One failing case, with what reproduces it.
pub struct Failure {
    pub case: u64,
    pub report: String,
    pub saved: PathBuf,
}

#[derive(Default)]
pub struct Stats {
    pub tried: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub skipped: u64,
    pub failures: Vec<Failure>,
}

fn save_failure(kind: &Kind, seed: u64, case: u64, input: &[u8], report: &str) -> PathBuf {
    let dir = failures_dir(kind.name);
    let _ = std::fs::create_dir_all(&dir);
    let stem = format!("seed{seed}-case{case}");
    let input_path = dir.join(format!("{stem}.{}", kind.ext));
    let _ = std::fs::write(&input_path, input);
    let _ = std::fs::write(dir.join(format!("{stem}.txt")), report);
    input_path
}

/// Writes the case about to run, with the counts so far, where the supervisor finds them
/// if the process dies (`case` is `done` at the end).
fn note_last(dir: &Path, kind: &Kind, seed: u64, case: &str, input: &[u8], stats: &Stats) {
    let _ = std::fs::create_dir_all(dir);
    let _ = std::fs::write(dir.join(format!("{}.input", kind.name)), input);
    let _ = std::fs::write(
        dir.join(format!("{}.case", kind.name)),
        format!(
            "{seed} {case} {} {} {} {} {}\n",
            stats.tried,
            stats.accepted,
            stats.rejected,
            stats.skipped,
            stats.failures.len()
        ),
    );
}

/// Runs the kind's cases and prints its counts and each failure.
pub fn run(kind: &Kind, cfg: &Config, in_process: bool) -> Stats {
    install_hook();
    // In-process kinds take turns: the panic records are process-wide.
    let _turn: Option<MutexGuard<()>> =
        in_process.then(|| TURN.lock().unwrap_or_else(PoisonError::into_inner));
    CAPTURING.store(true, Ordering::SeqCst);
    let seed_bytes: Vec<Vec<u8>> = kind.seeds.iter().map(|(_, b)| b.clone()).collect();
    let total = kind.seeds.len() as u64 + cfg.iters.unwrap_or(kind.default_iters);
    let cases: Box<dyn Iterator<Item = u64>> = match cfg.case {
        Some(c) => Box::new(std::iter::once(c)),
        None => Box::new(cfg.start..total),
    };
    let mut stats = Stats::default();
    for case in cases {
        let input = input_of(kind, cfg.seed, case, &seed_bytes);
        if let Some(dir) = &cfg.last_dir {
            note_last(dir, kind, cfg.seed, &case.to_string(), &input, &stats);
        }
        let outcome = if in_process {
            guarded(|| (kind.target)(&input))
        } else {
            (kind.target)(&input)
        };
        stats.tried += 1;
        match outcome {
            Outcome::Accepted => stats.accepted += 1,
            Outcome::Rejected => stats.rejected += 1,
            Outcome::Skipped => stats.skipped += 1,
            Outcome::Failed(report) => {
                let label = match kind.seeds.get(case as usize) {
                    Some((label, _)) => format!("seed {label}"),
                    None => "mutated".into(),
                };
                let report = format!(
                    "kind {} case {case} ({label}); reproduce: TPC_FUZZ_SEED={} TPC_FUZZ_KINDS={} TPC_FUZZ_CASE={case} cargo test --release --test fuzz -- --nocapture\n{report}",
                    kind.name, cfg.seed, kind.name
                );
                let saved = save_failure(kind, cfg.seed, case, &input, &report);
                let short: Vec<&str> = report.lines().take(24).collect();
                eprintln!(
                    "FUZZ FAILURE {}\ninput saved to {}\n",
                    short.join("\n"),
                    saved.display()
                );
                stats.failures.push(Failure {
                    case,
                    report,
                    saved,
                });
            }
        }
    }
    CAPTURING.store(false, Ordering::SeqCst);
    if let Some(dir) = &cfg.last_dir {
        note_last(dir, kind, cfg.seed, "done", &[], &stats);
    }
    eprintln!(
        "fuzz {}: {} inputs ({} seeds), {} accepted, {} errors, {} skipped, {} panics/failures",
        kind.name,
        stats.tried,
        kind.seeds.len(),
        stats.accepted,
        stats.rejected,
        stats.skipped,
        stats.failures.len()
    );
    stats
}

/// Fails the test when anything crashed, naming each distinct panic site once.
pub fn assert_clean(kind: &str, stats: &Stats) {
    if stats.failures.is_empty() {
        return;
    }
    let mut sites: Vec<String> = Vec::new();
    for f in &stats.failures {
        let site = f
            .report
            .lines()
            .find(|l| {
                l.starts_with("panicked at")
                    || l.starts_with("crash")
                    || l.starts_with("hang")
                    || l.starts_with("broken")
            })
            .unwrap_or("?")
            .to_string();
        if !sites.iter().any(|s| s.starts_with(&site)) {
            sites.push(format!(
                "{site}\n    first: case {} ({})",
                f.case,
                f.saved.display()
            ));
        }
    }
    panic!(
        "fuzz {kind}: {} of {} inputs failed; distinct sites:\n{}",
        stats.failures.len(),
        stats.tried,
        sites.join("\n")
    );
}

/// A per-process scratch directory for a kind's files.
pub fn scratch(name: &str) -> Scratch {
    Scratch::new("fuzz", name)
}

/// Every file in `dir` (sorted), as seeds labelled by their path.
pub fn files_in(dir: &Path, keep: impl Fn(&Path) -> bool) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && keep(p))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).expect("a readable seed");
            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let label = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            (label, bytes)
        })
        .collect()
}

/// `tests/fuzz/corpus/<kind>/`.
pub fn corpus(kind: &str) -> Vec<(String, Vec<u8>)> {
    files_in(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fuzz/corpus")
            .join(kind),
        |_| true,
    )
}
