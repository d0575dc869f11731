//! `tpc bench-load MODEL_DIR --tp N`: time and peak resident memory of packing every linear
//! weight of a plan's ranks from a checkpoint, the old way (f32 slice, then pack) against
//! `PackedMatrix::pack_slice`. Each method runs in a process of its own (this binary, run
//! again with `--method`), so that each peak resident size is its own.

use std::path::PathBuf;
use std::time::Instant;
use tpc::frontend::load::load_model;
use tpc::ir::{Op, WeightOrder};
use tpc::pipeline::compile;
use tpc::plan::{Plan, WeightSlice};
use tpc::runtime::cpu::packed::PackedMatrix;
use tpc::runtime::executor::weight_uses;
use tpc::runtime::memory::{peak_resident_bytes, resident_bytes};
use tpc::runtime::weights::{load_slice, Checkpoint};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face directory with config.json and safetensors weights.
    model: PathBuf,
    /// Number of tensor-parallel ranks whose slices are packed.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Pack only this rank's linears (default: every rank's, one after another, all kept).
    #[arg(long)]
    rank: Option<usize>,
    /// Panels in f32 instead of bf16.
    #[arg(long)]
    f32: bool,
    /// One method in this process; without it each method runs in a child process.
    #[arg(long, value_enum)]
    method: Option<Method>,
    /// Child runs per method (alternating methods), when no --method is given; 1 to 100.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100))]
    repeat: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum Method {
    /// `load_slice` to f32 then `pack` (the loader before `pack_slice`).
    Old,
    /// `pack_slice` from each slice's stored bytes.
    New,
}

/// The linear weights of a rank: slice and stored order, as the executor packs them.
fn linears(plan: &Plan, rank: usize) -> Vec<(&WeightSlice, WeightOrder)> {
    let program = &plan.ranks[rank];
    let uses = weight_uses(program);
    program
        .instrs
        .iter()
        .filter_map(|i| {
            let Op::Param(p) = &i.op else { return None };
            let order = uses.get(&i.id)?.linear?;
            let slice = program.weights.iter().find(|s| s.tensor == p.tensor)?;
            (slice.local_shape.len() == 2).then_some((slice, order))
        })
        .collect()
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let Some(method) = a.method else {
        return run_children(&a);
    };
    let def = load_model(&a.model)?;
    let plan = compile(&def, a.tp)?.plan;
    let ckpt = Checkpoint::open(&a.model)?;
    ckpt.check(&plan)?;
    let ranks: Vec<usize> = match a.rank {
        Some(r) if r < plan.ranks.len() => vec![r],
        Some(r) => anyhow::bail!("--rank {r}: the plan has ranks 0..{}", plan.ranks.len()),
        None => (0..plan.ranks.len()).collect(),
    };
    let bf16 = !a.f32;
    let rss_before = resident_bytes().unwrap_or(0);
    let cpu_before = cpu_seconds();
    let start = Instant::now();
    let mut packed = Vec::new();
    for &r in &ranks {
        for (w, order) in linears(&plan, r) {
            packed.push(match method {
                Method::Old => PackedMatrix::pack(&load_slice(&ckpt, w)?, order, bf16),
                Method::New => PackedMatrix::pack_slice(&ckpt, w, order, bf16)?,
            });
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds()
        .zip(cpu_before)
        .map(|(b, a)| (b.0 - a.0, b.1 - a.1));
    let packed_bytes: usize = packed.iter().map(|p| p.bytes()).sum();
    let json = serde_json::json!({
        "method": format!("{method:?}"),
        "tp": a.tp,
        "ranks": ranks,
        "panels": if bf16 { "bf16" } else { "f32" },
        "linears": packed.len(),
        "seconds": seconds,
        // CPU time of the whole process (all threads) while packing: steadier than wall
        // time on a machine shared with other work.
        "user_seconds": cpu.map(|c| c.0),
        "sys_seconds": cpu.map(|c| c.1),
        "packed_bytes": packed_bytes,
        "rss_before_bytes": rss_before,
        "rss_after_bytes": resident_bytes(),
        "peak_rss_bytes": peak_resident_bytes(),
    });
    super::print_stdout(&format!("{}\n", serde_json::to_string(&json)?))?;
    Ok(())
}

/// User and system CPU seconds this process has used so far.
fn cpu_seconds() -> Option<(f64, f64)> {
    // SAFETY: getrusage only writes the struct it is given, which is plain old data.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return None;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some((secs(u.ru_utime), secs(u.ru_stime)))
}

/// Runs each method `repeat` times in child processes, alternating, and prints their
/// lines followed by a summary per method (best seconds, largest peak).
fn run_children(a: &Args) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let methods = [Method::Old, Method::New];
    let mut results: Vec<(Method, f64, u64, u64, u64, f64)> = Vec::new();
    for _ in 0..a.repeat.max(1) {
        for m in methods {
            let mut cmd = std::process::Command::new(&exe);
            cmd.arg("bench-load")
                .arg(&a.model)
                .arg("--tp")
                .arg(a.tp.to_string())
                .arg("--method")
                .arg(
                    clap::ValueEnum::to_possible_value(&m)
                        .map_or_else(String::new, |v| v.get_name().to_string()),
                );
            if let Some(r) = a.rank {
                cmd.arg("--rank").arg(r.to_string());
            }
            if a.f32 {
                cmd.arg("--f32");
            }
            let out = cmd.output()?;
            if !out.status.success() {
                anyhow::bail!(
                    "bench-load --method {m:?} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
            super::outln!("{line}");
            let v: serde_json::Value = serde_json::from_str(&line)?;
            let num = |k: &str| v[k].as_u64().unwrap_or(0);
            results.push((
                m,
                v["seconds"].as_f64().unwrap_or(f64::NAN),
                num("peak_rss_bytes"),
                num("rss_before_bytes"),
                num("packed_bytes"),
                v["user_seconds"].as_f64().unwrap_or(f64::NAN)
                    + v["sys_seconds"].as_f64().unwrap_or(f64::NAN),
            ));
        }
    }
    let gb = |b: u64| b as f64 / 1e9;
    for m in methods {
        let runs: Vec<_> = results.iter().filter(|r| r.0 == m).collect();
        let secs: Vec<String> = runs.iter().map(|r| format!("{:.2}", r.1)).collect();
        let cpu: Vec<String> = runs.iter().map(|r| format!("{:.2}", r.5)).collect();
        let peak = runs.iter().map(|r| r.2).max().unwrap_or(0);
        let before = runs.iter().map(|r| r.3).max().unwrap_or(0);
        let packed = runs.first().map_or(0, |r| r.4);
        eprintln!(
            "{m:?}: wall seconds [{}], CPU seconds [{}], peak RSS {:.2} GB (before packing {:.2} GB), packed {:.2} GB, peak/packed {:.2}",
            secs.join(", "),
            cpu.join(", "),
            gb(peak),
            gb(before),
            gb(packed),
            peak as f64 / packed.max(1) as f64
        );
    }
    Ok(())
}
