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
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let def = load_model(&a.model)?;
    let options = tpc::passes::ShardOptions {
        shares: a.tp_shares,
        ..Default::default()
    };
    let e = explain(&def, a.tp, options, a.pattern.as_deref())?;
    let text = if a.json {
        format!("{}\n", serde_json::to_string_pretty(&e.weights)?)
    } else {
        render_text(&e)
    };
    super::print_stdout(&text)
}
