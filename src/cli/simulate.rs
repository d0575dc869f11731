//! `tpc simulate MODEL --tp T [--pp P] --hw PROFILE --batch B --prompt-len S --gen N [--json]
//! [--search]`: what a plan costs on a hardware profile, by the α-β model of `tpc::cost`;
//! pipeline stages are modelled there (tpc does not compile them yet).

use std::path::PathBuf;
use tpc::cost::search::search;
use tpc::cost::shipped_profiles::find_profile;
use tpc::cost::simulate::{simulate_pp_sharing_experts, Estimate, Numerics};
use tpc::frontend::load::load_model;
use tpc::plan::report::human_bytes;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A .ron model definition, an HF model directory, or a config.json.
    model: PathBuf,
    /// Tensor-parallel ranks (ignored with --search).
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Pipeline stages of --tp ranks each: the layers split into the P contiguous stages
    /// `compile --pp` cuts (balanced by parameter bytes and compute), run one after another
    /// (ignored with --search).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pp: u64,
    /// Data-parallel replicas of the tp ranks, each running the workload, with --ep (alone
    /// they are independent, and one is priced): 1 to 64 (ignored with --search).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    dp: u64,
    /// Price the experts dealt over the --dp replicas (`run --ep`): a rank's memory holds
    /// 1/dp of its experts, its experts serve every replica's tokens, and each MoE layer adds
    /// two all-to-all rounds; throughputs are the replicas' together.
    #[arg(long)]
    ep: bool,
    /// Hardware profile: a shipped one by name (a file of models/hw/ without `.ron`, e.g.
    /// h100-sxm-nvswitch-8) or a profile file (RON, e.g. `tpc calibrate`'s).
    #[arg(long)]
    hw: PathBuf,
    #[command(flatten)]
    work: super::WorkloadArgs,
    /// Print the estimate (or the ranking) as JSON.
    #[arg(long)]
    json: bool,
    /// Rank every feasible (tp, pp) with tp·pp up to the profile's device count by decode
    /// throughput (on a tie, fewer collectives first). Bounded whatever the devices: tp up
    /// to 1024 (the values the model splits into), pp up to the layers and 256.
    #[arg(long)]
    search: bool,
    #[command(flatten)]
    shard: super::ShardArgs,
    /// Number types priced: `plan` (the plan's dtype throughout, as a GPU runtime), or as
    /// `tpc bench --dtype` runs on CPU: `auto` (bf16 weights for a bf16 plan, else f32),
    /// `f32`, `bf16`, with f32 activations, KV cache and collectives. Default: `auto` for a
    /// shared-host profile (from `tpc calibrate`), `plan` otherwise.
    #[arg(long, value_enum)]
    dtype: Option<SimDtype>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SimDtype {
    Plan,
    Auto,
    F32,
    Bf16,
}

fn numerics(d: SimDtype, plan: &tpc::plan::Plan) -> Numerics {
    match d {
        SimDtype::Plan => Numerics::of_plan(plan),
        SimDtype::Auto => Numerics::cpu_runtime(plan.dtype == tpc::ir::DType::Bf16),
        SimDtype::F32 => Numerics::cpu_runtime(false),
        SimDtype::Bf16 => Numerics::cpu_runtime(true),
    }
}

fn table(e: &Estimate) -> String {
    let ms = |s: f64| format!("{:.3} ms", s * 1e3);
    let mut layout = String::new();
    if e.pp > 1 {
        layout += &format!("  pp={}", e.pp);
    }
    if e.dp > 1 {
        layout += &format!(
            "  dp={} ep={} (experts dealt over the replicas{}; tokens/s of all)",
            e.dp,
            e.dp * e.tp,
            if e.pp > 1 { ", stage by stage" } else { "" }
        );
    }
    let mut out = format!(
        "model {}  tp={}{}  on {}  (weights {}{}, activations {})\n{:<12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
        e.model,
        e.tp,
        layout,
        e.hw,
        e.weight_dtype,
        e.quantized_weights
            .as_ref()
            .map(|q| format!(" ({q})"))
            .unwrap_or_default(),
        e.activation_dtype,
        "phase",
        "time",
        "compute",
        "memory",
        "comm",
        "per-op",
        "elementwise"
    );
    for (name, p) in [("prefill", &e.prefill), ("decode step", &e.decode_step)] {
        out += &format!(
            "{:<12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
            name,
            ms(p.time_s),
            ms(p.compute_s),
            ms(p.memory_s),
            ms(p.comm_s),
            ms(p.overhead_s),
            ms(p.elementwise_s)
        );
    }
    for (k, st) in e.stages.iter().enumerate() {
        out += &format!(
            "stage {k}: layers {}..{}  weights/rank {}  KV/rank {}  prefill {}  decode step {}\n",
            st.first_layer,
            st.first_layer + st.layers,
            human_bytes(st.weight_bytes_per_rank),
            human_bytes(st.kv_bytes_per_rank),
            ms(st.prefill_time_s),
            ms(st.decode_step_time_s)
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

/// A line saying the estimate is rough when the profile is (`tpc calibrate --quick`), else
/// nothing.
fn rough_note(hw: &tpc::cost::profile::HwProfile) -> String {
    if hw.is_rough() {
        format!(
            "rough profile: {} was measured by `tpc calibrate --quick` (small products, a \
             second of timing); these figures are for trying the command: measure with \
             `tpc calibrate` (no --quick) for estimates to go by\n",
            hw.name
        )
    } else {
        String::new()
    }
}

/// A spinner on stderr while `--search` prices, for a person at a terminal only (a large
/// model over many devices takes seconds).
fn search_bar(json: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !super::progress::shows_progress(std::io::stderr().is_terminal(), json) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new_spinner();
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    bar
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let hw = find_profile(&a.hw)?;
    let def = load_model(&a.model)?;
    let work = a.work.workload();
    // As asked, else what runs the plan on this profile by default.
    let number_types = |plan: &tpc::plan::Plan| match a.dtype {
        Some(d) => numerics(d, plan),
        None => Numerics::for_profile(plan, &hw),
    };
    if !a.search {
        anyhow::ensure!(
            a.dp == 1 || a.ep,
            "--dp {} without --ep: the replicas are independent, so simulate prices one (drop --dp), or add --ep to price them sharing their experts",
            a.dp
        );
        let dp = if a.ep { a.dp } else { 1 };
        let layout = format!(
            "--tp {}{}{}",
            a.tp,
            if a.pp > 1 {
                format!(" --pp {}", a.pp)
            } else {
                String::new()
            },
            if dp > 1 {
                format!(" --dp {dp} --ep")
            } else {
                String::new()
            }
        );
        // A product past 2^64 is said as such, never printed as a saturated count.
        let ranks = a.tp.checked_mul(a.pp).and_then(|r| r.checked_mul(dp));
        let devices = ranks.map_or_else(|| "more than 2^64".to_string(), |d| d.to_string());
        anyhow::ensure!(
            ranks.is_some_and(|d| d <= hw.devices),
            "{layout} needs {devices} devices, the profile {} has {}",
            hw.name,
            hw.devices
        );
        let (compiled, decision) = a.shard.compile(&def, a.tp, Some(&hw), work, number_types)?;
        let plan = compiled.plan;
        if dp > 1 {
            if let Some(why) = plan.why_experts_cannot_span_replicas() {
                anyhow::bail!("--ep: {why}");
            }
        }
        let num = number_types(&plan);
        let e = simulate_pp_sharing_experts(&plan, &hw, work, num, a.pp, dp)?;
        let text = if a.json {
            let json = super::with_decision(serde_json::to_value(&e)?, &decision)?;
            format!("{}\n", serde_json::to_string_pretty(&json)?)
        } else {
            let mut t = table(&e);
            if let Some(d) = &decision.experts {
                t += &format!("{}\n", d.note());
            }
            if let Some(d) = &decision.sequence_parallel {
                t += &format!("{}\n", d.note());
            }
            t + &rough_note(&hw)
        };
        return super::print_stdout(&text);
    }
    // Every tp the model splits into and the profile has devices for, fitting ones first,
    // then by decode throughput, then by fewer collectives.
    let bar = search_bar(a.json);
    let mut ranked = search(
        &hw,
        work,
        |tp| {
            a.shard
                .compile(&def, tp, Some(&hw), work, number_types)
                .map(|(c, _)| c.plan)
        },
        number_types,
        // A mixture of experts is also priced on replicas sharing its experts (`--ep`).
        |plan| plan.why_experts_cannot_span_replicas().is_none(),
        |tp, last| bar.set_message(format!("searching: pricing tp {tp} of up to {last}")),
    );
    bar.finish_and_clear();
    anyhow::ensure!(!ranked.is_empty(), "no tp value splits this model");
    tpc::cost::prefer::rank(&mut ranked);
    // Unequal devices: the shares that pace the group best at the profile's tp.
    let proposal = if hw.rank_speeds.is_empty() {
        None
    } else {
        let tp = hw.rank_speeds.len() as u64;
        Some(tpc::cost::shares::propose_shares(
            &hw,
            work,
            |shares| {
                let mut options = a.shard.options();
                options.shares = shares;
                tpc::pipeline::compile_with(&def, tp, options).map(|c| c.plan)
            },
            number_types,
        )?)
    };
    let text = if a.json {
        match &proposal {
            None => format!("{}\n", serde_json::to_string_pretty(&ranked)?),
            Some(p) => format!(
                "{}\n",
                serde_json::to_string_pretty(&serde_json::json!({
                    "ranked": ranked,
                    "shares_proposal": p,
                }))?
            ),
        }
    } else {
        // The replicas' column only where some layout has replicas (`--dp D --ep`).
        let replicas = ranked.iter().any(|e| e.dp > 1);
        let dp = |v: String| {
            if replicas {
                format!(" {v:>4}")
            } else {
                String::new()
            }
        };
        let mut s = format!(
            "{:>4} {:>4}{} {:>14} {:>14} {:>16} {:>6}\n",
            "tp",
            "pp",
            dp("dp".into()),
            "prefill tok/s",
            "decode tok/s",
            "memory/rank",
            "fits"
        );
        for e in &ranked {
            s += &format!(
                "{:>4} {:>4}{} {:>14.0} {:>14.1} {:>16} {:>6}\n",
                e.tp,
                e.pp,
                dp(e.dp.to_string()),
                e.tokens_per_s.prefill,
                e.tokens_per_s.decode,
                human_bytes(e.memory_per_rank_bytes),
                if e.fits { "yes" } else { "no" }
            );
        }
        if replicas {
            s += &format!(
                "dp > 1: the experts dealt over dp replicas of tp ranks (--dp D --ep), the batch of {} dealt over them; tokens/s of all\n",
                work.batch
            );
        }
        if let Some(p) = &proposal {
            s += &shares_note(&hw, p);
        }
        s + &rough_note(&hw)
    };
    super::print_stdout(&text)
}

/// The `--search` line for unequal devices.
fn shares_note(
    hw: &tpc::cost::profile::HwProfile,
    p: &tpc::cost::shares::SharesProposal,
) -> String {
    let speeds: Vec<String> = hw.rank_speeds.iter().map(|s| format!("{s}")).collect();
    let (e, even) = (&p.estimate, &p.even);
    match p.shares {
        Some(shares) => format!(
            "unequal devices (rank_speeds {}): --tp {} --tp-shares {shares} decodes {:.1} tok/s, the even split {:.1} ({:.2}x); prefill {:.0} vs {:.0} tok/s\n",
            speeds.join(", "),
            e.tp,
            e.tokens_per_s.decode,
            even.tokens_per_s.decode,
            e.tokens_per_s.decode / even.tokens_per_s.decode,
            e.tokens_per_s.prefill,
            even.tokens_per_s.prefill
        ),
        None => format!(
            "unequal devices (rank_speeds {}): the even split at --tp {} is the fastest of the shares tried ({:.1} tok/s decode)\n",
            speeds.join(", "),
            even.tp,
            even.tokens_per_s.decode
        ),
    }
}
