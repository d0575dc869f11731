//! `tpc compile MODEL --tp N [--pp P [--pp-layers 8,8,…]] [--hw PROFILE [--batch B --prompt-len S --gen N]] [--sequence-parallel[=on|off|auto]] [-o plan.ron|plan.json] [--dot FILE] [--json] [--text]`

use std::path::PathBuf;
use tpc::cost::simulate::Numerics;
use tpc::frontend::load::load_model;
use tpc::plan::report::{render_table, summarize};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A .ron model definition, an HF model directory, or a config.json.
    model: PathBuf,
    /// Number of tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Write the plan here (RON, or JSON when the name ends in .json).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Also write a Graphviz picture of the plan (rank 0).
    #[arg(long)]
    dot: Option<PathBuf>,
    /// Print the machine-readable summary instead of the table.
    #[arg(long)]
    json: bool,
    /// Print the plan's programs as text after the table.
    #[arg(long)]
    text: bool,
    /// Choose each all-reduce's algorithm by message size for this hardware profile: a
    /// shipped one by name (a file of models/hw/ without `.ron`, e.g. h100-sxm-nvswitch-8)
    /// or a profile file (e.g. `tpc calibrate`'s); the runtime follows the plan's choice.
    #[arg(long)]
    hw: Option<PathBuf>,
    /// The workload sequence parallelism is priced for with --hw (`auto`).
    #[command(flatten)]
    work: super::WorkloadArgs,
    #[command(flatten)]
    shard: super::ShardArgs,
    #[command(flatten)]
    pipe: super::PipelineArgs,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let mut inputs = vec![a.model.as_path()];
    inputs.extend(a.hw.as_deref());
    if let Some(out) = &a.output {
        tpc::fsio::check_output("-o", out, &inputs)?;
    }
    if let Some(dot) = &a.dot {
        tpc::fsio::check_output("--dot", dot, &inputs)?;
        if let Some(out) = &a.output {
            tpc::fsio::check_distinct_outputs(("-o", out), ("--dot", dot))?;
        }
    }
    let hw =
        a.hw.as_deref()
            .map(tpc::cost::shipped_profiles::find_profile)
            .transpose()?;
    let def = load_model(&a.model)?;
    let (mut compiled, decision) =
        a.shard
            .compile(&def, a.tp, hw.as_ref(), a.work.workload(), |plan| {
                hw.as_ref().map_or(Numerics::of_plan(plan), |hw| {
                    Numerics::for_profile(plan, hw)
                })
            })?;
    if let Some(hw) = &hw {
        tpc::cost::algorithms::choose_algorithms(&mut compiled.plan, hw);
    }
    a.pipe.apply(&mut compiled.plan)?;
    let summary = summarize(&compiled.plan);
    if let Some(out) = &a.output {
        compiled.plan.save(out)?;
    }
    if let Some(path) = &a.dot {
        let picture = tpc::plan::dot::draw(&compiled.plan, &tpc::plan::dot::DotOptions::default());
        if picture.too_large() {
            super::dot::warn_too_large(
                &picture,
                "`tpc dot MODEL --tp N --layers 0..1` draws fewer layers",
            );
        }
        tpc::fsio::write_text(path, &picture.text)?;
    }
    if a.json {
        let json = super::with_decision(serde_json::to_value(&summary)?, &decision)?;
        super::print_stdout(&format!("{}\n", serde_json::to_string_pretty(&json)?))?;
    } else {
        super::print_stdout(&render_table(&summary))?;
        if let Some(out) = &a.output {
            super::print_stdout(&format!("plan written to {}\n", out.display()))?;
        }
        if a.text {
            super::print_stdout(&tpc::plan::text::render_plan(&compiled.plan))?;
        }
    }
    // The process ends here; freeing tens of thousands of small allocations one by one
    // would cost more than the rest of a large compile.
    std::mem::forget(compiled);
    Ok(())
}
