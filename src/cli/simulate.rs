//! `tpc simulate MODEL --tp T --hw PROFILE --batch B --prompt S --gen N [--json] [--search]`:
//! what a plan costs on a hardware profile, by the α-β model of `tpc::cost`.

use std::path::PathBuf;
use tpc::cost::profile::HwProfile;
use tpc::cost::simulate::{simulate, Estimate, Workload};
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::report::human_bytes;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A .ron model definition, an HF model directory, or a config.json.
    model: PathBuf,
    /// Tensor-parallel ranks (ignored with --search).
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Pipeline stages; only 1 until tpc compiles pipeline stages.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1))]
    pp: u64,
    /// Hardware profile (RON), e.g. models/hw/h100-sxm-nvswitch-8.ron.
    #[arg(long)]
    hw: PathBuf,
    /// Sequences run together, 1 to 4096.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// Prompt tokens per sequence, 1 to 2^24.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    prompt: u64,
    /// Generated tokens per sequence, 0 to 2^24.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(0..=1 << 24))]
    gen: u64,
    /// Print the estimate (or the ranking) as JSON.
    #[arg(long)]
    json: bool,
    /// Rank every feasible tp up to the profile's device count by decode throughput.
    #[arg(long)]
    search: bool,
}

fn table(e: &Estimate) -> String {
    let ms = |s: f64| format!("{:.3} ms", s * 1e3);
    let mut out = format!(
        "model {}  tp={}  on {}\n{:<12} {:>12} {:>12} {:>12} {:>12}\n",
        e.model, e.tp, e.hw, "phase", "time", "compute", "memory", "comm"
    );
    for (name, p) in [("prefill", &e.prefill), ("decode step", &e.decode_step)] {
        out += &format!(
            "{:<12} {:>12} {:>12} {:>12} {:>12}\n",
            name,
            ms(p.time_s),
            ms(p.compute_s),
            ms(p.memory_s),
            ms(p.comm_s)
        );
    }
    out += &format!(
        "tokens/s: prefill {:.0}, decode {:.1}\nmemory per rank: {} (weights {}, KV cache {}) of {}: {}\n",
        e.tokens_per_s.prefill,
        e.tokens_per_s.decode,
        human_bytes(e.memory_per_rank_bytes),
        human_bytes(e.weight_bytes_per_rank),
        human_bytes(e.kv_bytes_per_rank),
        human_bytes(e.device_memory_bytes),
        if e.fits {
            "fits".to_string()
        } else {
            format!(
                "does NOT fit (short by {})",
                human_bytes(e.memory_per_rank_bytes - e.device_memory_bytes)
            )
        }
    );
    out
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let hw = HwProfile::load(&a.hw)?;
    let def = load_model(&a.model)?;
    let work = Workload {
        batch: a.batch,
        prompt: a.prompt,
        gen: a.gen,
    };
    if !a.search {
        anyhow::ensure!(
            a.tp <= hw.devices,
            "--tp {} needs {} devices, the profile {} has {}",
            a.tp,
            a.tp,
            hw.name,
            hw.devices
        );
        let e = simulate(&compile(&def, a.tp)?.plan, &hw, work);
        let text = if a.json {
            format!("{}\n", serde_json::to_string_pretty(&e)?)
        } else {
            table(&e)
        };
        return super::print_stdout(&text);
    }
    // Every tp the model splits into and the profile has devices for, fitting ones first,
    // then by decode throughput.
    let mut ranked: Vec<Estimate> = (1..=hw.devices.min(tpc::passes::feasibility::MAX_TP))
        .filter_map(|tp| compile(&def, tp).ok())
        .map(|c| simulate(&c.plan, &hw, work))
        .collect();
    anyhow::ensure!(!ranked.is_empty(), "no tp value splits this model");
    ranked.sort_by(|x, y| {
        y.fits
            .cmp(&x.fits)
            .then(y.tokens_per_s.decode.total_cmp(&x.tokens_per_s.decode))
    });
    let text = if a.json {
        format!("{}\n", serde_json::to_string_pretty(&ranked)?)
    } else {
        let mut s = format!(
            "{:>4} {:>14} {:>14} {:>16} {:>6}\n",
            "tp", "prefill tok/s", "decode tok/s", "memory/rank", "fits"
        );
        for e in &ranked {
            s += &format!(
                "{:>4} {:>14.0} {:>14.1} {:>16} {:>6}\n",
                e.tp,
                e.tokens_per_s.prefill,
                e.tokens_per_s.decode,
                human_bytes(e.memory_per_rank_bytes),
                if e.fits { "yes" } else { "no" }
            );
        }
        s
    };
    super::print_stdout(&text)
}
