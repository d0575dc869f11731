//! `tpc explain MODEL --tp T [PATTERN] [--json]`: why each weight is split as it is.

use std::path::PathBuf;
use tpc::explain::{explain, render_text};
use tpc::frontend::load::load_model;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A .ron model definition, an HF model directory, or a config.json.
    model: PathBuf,
    /// Only weights whose checkpoint name contains PATTERN; with `*` a glob over the whole
    /// name, `*` matching any characters (e.g. `*.mlp.*`).
    pattern: Option<String>,
    /// Number of tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Each rank's part of every split dimension, e.g. `3,1,1,1` (one share per rank, as
    /// `tpc compile --tp-shares`); the weights' pieces show what each rank got.
    #[arg(long, value_name = "SHARES")]
    tp_shares: Option<tpc::ir::TpShares>,
    /// Print a JSON list of weights instead of text.
    #[arg(long)]
    json: bool,
    /// How mixture-of-experts layers are split (as `tpc compile --moe`); with `auto` and
    /// --hw, the cost model's choice for the workload, and the text says why.
    #[arg(long, value_enum)]
    moe: Option<super::MoeArg>,
    /// A hardware profile (as `tpc compile --hw`) for `--moe auto`.
    #[arg(long)]
    hw: Option<PathBuf>,
    /// The workload `--moe auto` is priced for.
    #[command(flatten)]
    work: super::WorkloadArgs,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let def = load_model(&a.model)?;
    let options = tpc::passes::ShardOptions {
        shares: a.tp_shares,
        moe: a.moe.map(Into::into),
        ..Default::default()
    };
    // `--moe auto` with a profile: the split the cost model keeps, and why.
    let mut why = None;
    let options = match (a.moe, &a.hw) {
        (Some(super::MoeArg::Auto), Some(hw)) => {
            let hw = tpc::cost::shipped_profiles::find_profile(hw)?;
            let (_, decisions) = tpc::cost::decide::compile_choosing_expert_split(
                &def,
                a.tp,
                &hw,
                a.work.workload(),
                |plan| tpc::cost::simulate::Numerics::for_profile(plan, &hw),
                |d| {
                    let options = tpc::passes::ShardOptions {
                        moe: None,
                        ..options
                    };
                    Ok((
                        tpc::pipeline::compile_with(d, a.tp, options)?,
                        Default::default(),
                    ))
                },
            )?;
            let chosen = decisions.experts.map(|d| {
                let split = if d.chosen == "expert" {
                    tpc::ir::ExpertSplit::Expert
                } else {
                    tpc::ir::ExpertSplit::Tensor
                };
                why = Some(d.note());
                split
            });
            tpc::passes::ShardOptions {
                moe: chosen.or(options.moe),
                ..options
            }
        }
        (_, Some(_)) => anyhow::bail!("--hw prices `--moe auto` only; add --moe auto or drop --hw"),
        _ => options,
    };
    let e = explain(&def, a.tp, options, a.pattern.as_deref())?;
    let text = if a.json {
        format!("{}\n", serde_json::to_string_pretty(&e.weights)?)
    } else {
        let note = why.map(|w| format!("note: {w}\n\n")).unwrap_or_default();
        note + &render_text(&e)
    };
    super::print_stdout(&text)
}
