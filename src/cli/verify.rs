//! `tpc verify MODEL --tp N`: tp=1 and tp=N on the same inputs, logits compared.

use std::path::PathBuf;
use tpc::frontend::load::load_model;
use tpc::frontend::ModelDef;
use tpc::runtime::verify::verify_plans;
use tpc::runtime::weights::{Checkpoint, WeightSource};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A model (.ron, HF directory, config.json). A directory with weights uses them;
    /// otherwise weights are seeded random values.
    model: PathBuf,
    /// Number of tensor-parallel ranks to compare against tp=1 (the plan's with --plan).
    #[arg(long, required_unless_present = "plan")]
    tp: Option<u64>,
    /// Compare this saved plan (`tpc compile MODEL -o plan.ron`) against tp=1 of the model.
    #[arg(long, conflicts_with = "layers")]
    plan: Option<PathBuf>,
    /// Seed for random weights and the prompt.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    shard: super::ShardArgs,
    #[command(flatten)]
    pipe: super::PipelineArgs,
    /// Prompt length in tokens, 1 to 2^20.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    prompt_len: usize,
    /// Keep only the first N layers of a preset (big models in little memory).
    #[arg(long)]
    layers: Option<u64>,
    /// Print the comparison as JSON instead of one line.
    #[arg(long)]
    json: bool,
    /// Where both sides compute: cpu, cuda or cuda:0,1,… (a build with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = super::parse_device)]
    device: tpc::runtime::generate::Device,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let mut def = load_model(&a.model)?;
    if let (Some(n), ModelDef::Preset(p)) = (a.layers, &mut def) {
        anyhow::ensure!(n >= 1, "--layers must be at least 1");
        p.num_hidden_layers = p.num_hidden_layers.min(n);
    }
    // A cut model no longer matches its checkpoint: it runs on random weights.
    let ckpt = match a.layers {
        None => Checkpoint::find(&a.model)?,
        Some(_) => None,
    };
    let options = a.shard.options();
    let many = match &a.plan {
        Some(path) => {
            super::refuse_options_with_plan(options)?;
            let plan = super::plan_for_tp(tpc::plan::Plan::load(path)?, path, a.tp)?;
            a.pipe.check_saved(&plan, path)?;
            // `run` refuses a plan that is not the compiler's; verify computes it anyway, so
            // an edited plan can be judged by its logits, and says what differs.
            if let Err(e) = tpc::provenance::check_saved(&plan, Some(&def), path) {
                eprintln!("note: {e}");
            }
            plan
        }
        None => {
            let mut plan = tpc::pipeline::compile_with(&def, a.tp.unwrap_or(1), options)?.plan;
            a.pipe.apply(&mut plan)?;
            plan
        }
    };
    let tp = match many.pp() {
        1 => many.tp.to_string(),
        pp => format!("{} pp={pp}", many.tp),
    };
    // tp=1 in the same numerics: an invariant plan is compared bit for bit.
    let one_options = tpc::passes::ShardOptions {
        numerics: many.numerics,
        ..Default::default()
    };
    let one = tpc::pipeline::compile_with(&def, 1, one_options)?.plan;
    // The model's limits, in this command's flags (the runtime's message names `run`'s).
    super::sizes::check_prompts(
        &one,
        &super::sizes::PromptFlags {
            batch: None,
            prompt_len: ("--prompt-len", a.prompt_len as u64),
            new_tokens: super::sizes::NewTokens::Fixed(
                tpc::runtime::verify::VERIFY_NEW_TOKENS as u64,
                "verify generates",
            ),
        },
    )?;
    let report = verify_plans(
        &one,
        &many,
        ckpt.as_ref().map(|c| c as &dyn WeightSource),
        a.seed,
        a.prompt_len,
        &a.device,
    )?;
    if a.json {
        super::print_stdout(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        let source = if ckpt.is_some() {
            "checkpoint weights"
        } else {
            "seeded random weights"
        };
        super::print_stdout(&format!(
            "tp=1 vs tp={} ({source}, {} prompt tokens): max abs error {:.3e}, relative error {:.3e} (tolerance {:.0e}), max elementwise relative error {:.3e}; greedy tokens {}\n",
            tp,
            report.prompt.len(),
            report.max_abs_error,
            report.rel_error,
            report.tolerance,
            report.max_elementwise_rel_error,
            if report.tokens_tp1 == report.tokens_tpn { "equal" } else { "DIFFER" }
        ))?;
        if report.invariant {
            let line = match report.first_difference {
                None => "--numerics invariant: every prompt logit is the same bits\n".to_string(),
                Some((row, col, one, n)) => format!(
                    "--numerics invariant: NOT the same bits: first at prompt row {row}, vocab column {col}: tp=1 {one:e} ({:#010x}), tp={tp} {n:e} ({:#010x})\n",
                    one.to_bits(),
                    n.to_bits()
                ),
            };
            super::print_stdout(&line)?;
        }
    }
    if !report.passed {
        return Err(Mismatch(format!(
            "tp={} does not reproduce tp=1{}: relative error {:.3e} (tolerance {:.0e}), tokens {:?} vs {:?}",
            tp,
            if report.invariant && !report.bitwise_equal {
                " bit for bit (--numerics invariant)"
            } else {
                ""
            },
            report.rel_error,
            report.tolerance,
            report.tokens_tpn,
            report.tokens_tp1
        ))
        .into());
    }
    Ok(())
}

/// The comparison ran and tp=N disagreed with tp=1: `tpc` exits 3 for this, so scripts can
/// tell a numerical mismatch from an error that stopped the check (exit 1).
#[derive(Debug)]
pub struct Mismatch(String);

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Mismatch {}
