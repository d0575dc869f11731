//! `tpc lower MODEL [-o FILE]`: a preset written out as the equivalent explicit graph,
//! a starting point for a new architecture.

use std::path::PathBuf;
use tpc::frontend::load::{load_model, ron_options};
use tpc::frontend::{preset::lower_preset, ModelDef};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A preset (.ron, HF directory or config.json).
    model: PathBuf,
    /// Where to write the explicit graph; stdout when absent.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    if let Some(out) = &a.output {
        tpc::fsio::check_output("-o", out, &[&a.model])?;
    }
    let def = load_model(&a.model)?;
    // A lowered file must load back: refuse what tpc would refuse to build.
    tpc::frontend::to_graph(&def)?;
    let graph = match def {
        ModelDef::Preset(p) => lower_preset(&p)?,
        ModelDef::Graph(g) => g,
    };
    let cfg = ron::ser::PrettyConfig::new()
        .extensions(
            ron::extensions::Extensions::IMPLICIT_SOME
                | ron::extensions::Extensions::UNWRAP_VARIANT_NEWTYPES,
        )
        .depth_limit(4);
    let text = ron_options().to_string_pretty(&ModelDef::Graph(graph), cfg)?;
    match &a.output {
        Some(p) => tpc::fsio::write_text(p, &(text + "\n"))?,
        None => super::print_stdout(&format!("{text}\n"))?,
    }
    Ok(())
}
