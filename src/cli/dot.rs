//! `tpc dot MODEL|PLAN --tp N [--pp P] [-o FILE] [--all-ranks] [--layers A..B]`

use anyhow::Context;
use std::path::PathBuf;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile_with;
use tpc::plan::dot::{draw, DotOptions, Picture, READABLE_NODES};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A model (.ron, HF directory, config.json) or a plan written by `tpc compile -o`.
    input: PathBuf,
    /// Number of ranks (read from the plan when the input is a plan).
    #[arg(long)]
    tp: Option<u64>,
    /// Output file; stdout when absent.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Draw every rank instead of rank 0.
    #[arg(long)]
    all_ranks: bool,
    /// Only these layers, e.g. `0..1` or `3`; others are elided.
    #[arg(long)]
    layers: Option<String>,
    /// Each rank's share of every split dimension, one per rank (as `tpc compile
    /// --tp-shares`); a weight whose piece is padded shows its real length. A saved plan
    /// keeps the shares it was compiled with.
    #[arg(long, value_name = "SHARES")]
    tp_shares: Option<tpc::ir::TpShares>,
    #[command(flatten)]
    pipe: super::PipelineArgs,
}

fn parse_layers(s: &str) -> anyhow::Result<(u32, u32)> {
    let parse = |x: &str| {
        x.trim()
            .parse::<u32>()
            .with_context(|| format!("`{x}` is not a layer number"))
    };
    match s.split_once("..") {
        Some((a, b)) => {
            let b = b.strip_prefix('=').unwrap_or(b);
            let (a, b) = (parse(a)?, parse(b)?);
            anyhow::ensure!(
                a <= b,
                "--layers {s}: the first layer must not exceed the last"
            );
            Ok((a, b))
        }
        None => {
            let l = parse(s)?;
            Ok((l, l))
        }
    }
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    if let Some(out) = &a.output {
        tpc::fsio::check_output("-o", out, &[&a.input])?;
    }
    let layers = a
        .layers
        .as_deref()
        .map(parse_layers)
        .transpose()
        .context("--layers takes `A..B` (inclusive) or one layer number")?;
    let options = DotOptions {
        all_ranks: a.all_ranks,
        layers,
    };
    let plan = match tpc::plan::Plan::looks_like_plan(&a.input) {
        Some(plan) => {
            anyhow::ensure!(
                a.tp_shares.is_none(),
                "--tp-shares applies when tpc compiles; {} is a saved plan, which keeps the shares it was compiled with: drop --tp-shares",
                a.input.display()
            );
            let plan = super::plan_for_tp(plan?, &a.input, a.tp)?;
            a.pipe.check_saved(&plan, &a.input)?;
            plan
        }
        None => {
            let options = tpc::passes::ShardOptions {
                shares: a.tp_shares,
                ..Default::default()
            };
            let def = load_model(&a.input)?;
            let mut plan = compile_with(&def, a.tp.unwrap_or(1), options)?.plan;
            a.pipe.apply(&mut plan)?;
            plan
        }
    };
    let picture = draw(&plan, &options);
    if picture.too_large() {
        let fewer = if a.all_ranks {
            "draw fewer layers (`--layers 0..1`) or one rank (without --all-ranks)"
        } else {
            "draw fewer layers, e.g. `--layers 0..1`"
        };
        warn_too_large(&picture, fewer);
    }
    match &a.output {
        Some(p) => tpc::fsio::write_text(p, &picture.text)?,
        None => super::print_stdout(&picture.text)?,
    }
    Ok(())
}

/// Says on stderr that `picture` is too large to be useful and how to draw less.
pub fn warn_too_large(picture: &Picture, fewer: &str) {
    eprintln!(
        "warning: the picture has {} nodes, too many to read (Graphviz may also take minutes \
         to lay out more than {READABLE_NODES}); {fewer}",
        picture.nodes
    );
}
