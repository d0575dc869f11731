//! Fuzzing every input tpc reads, on stable Rust, as ordinary tests: model RON, HF
//! `config.json`, saved plans (RON and JSON), safetensors files and their index, and CLI
//! argument vectors. Seeded and reproducible; see docs/FUZZING.md for the knobs and for
//! long runs.

#[path = "fuzz/checkpoint.rs"]
mod checkpoint;
#[path = "fuzz/cli.rs"]
mod cli;
#[path = "fuzz/compile.rs"]
mod compile;
#[path = "fuzz/harness.rs"]
mod harness;
#[path = "fuzz/hf.rs"]
mod hf;
#[path = "fuzz/model.rs"]
mod model;
#[path = "fuzz/mutate.rs"]
mod mutate;
#[path = "fuzz/plan.rs"]
mod plan;
#[path = "fuzz/rng.rs"]
mod rng;
#[path = "common/scratch.rs"]
mod scratch_dir;
#[path = "fuzz/supervise.rs"]
mod supervise;

use harness::{assert_clean, run, Config, Kind};

/// Runs a kind: in a supervised child by default, in this process inside that child or
/// with `TPC_FUZZ_IN_PROCESS=1` (for a debugger).
fn fuzz(kind: &str, test: &str, make: impl FnOnce() -> Kind) {
    let cfg = Config::from_env();
    if !cfg.wants(kind) {
        return;
    }
    let in_process = ["TPC_FUZZ_CHILD", "TPC_FUZZ_IN_PROCESS"]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
    if !in_process {
        let t = supervise::supervise(kind, test, &cfg);
        eprintln!(
            "fuzz {kind} total: {} inputs, {} accepted, {} errors, {} skipped, {} panics/broken, {} crashes/hangs",
            t.tried, t.accepted, t.rejected, t.skipped, t.panics, t.deaths.len()
        );
        assert!(
            t.panics == 0 && t.deaths.is_empty(),
            "fuzz {kind}: {} panics (reported above) and {} crashes/hangs:\n{}",
            t.panics,
            t.deaths.len(),
            t.deaths.join("\n")
        );
        return;
    }
    let kind_value = make();
    // The CLI kind runs the binary; its panics happen in the child, not here.
    let stats = run(&kind_value, &cfg, kind != "cli");
    assert_clean(kind, &stats);
}

#[test]
fn fuzz_model() {
    fuzz("model", "fuzz_model", model::kind);
}

#[test]
fn fuzz_hf_config() {
    fuzz("hf_config", "fuzz_hf_config", hf::kind);
}

#[test]
fn fuzz_plan_ron() {
    fuzz("plan_ron", "fuzz_plan_ron", || plan::kind(false));
}

#[test]
fn fuzz_plan_json() {
    fuzz("plan_json", "fuzz_plan_json", || plan::kind(true));
}

#[test]
fn fuzz_safetensors() {
    fuzz(
        "safetensors",
        "fuzz_safetensors",
        checkpoint::safetensors_kind,
    );
}

#[test]
fn fuzz_index() {
    fuzz("index", "fuzz_index", checkpoint::index_kind);
}

#[test]
fn fuzz_cli() {
    fuzz("cli", "fuzz_cli", cli::kind);
}
