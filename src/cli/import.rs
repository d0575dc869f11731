//! `tpc import config.json -o model.ron`

use std::path::PathBuf;
use tpc::frontend::load::{hf_config_path, load_model, ron_options};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An HF model directory or its config.json.
    config: PathBuf,
    /// Where to write the RON preset; stdout when absent.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    if !a.config.exists() {
        anyhow::bail!(
            "`{}`: no such file or directory; give an HF model directory or its config.json",
            a.config.display()
        );
    }
    if hf_config_path(&a.config).is_none() {
        anyhow::bail!(
            "`{}` is not an HF config: give a model directory or a config.json path",
            a.config.display()
        );
    }
    if let Some(out) = &a.output {
        let config = hf_config_path(&a.config).unwrap_or_else(|| a.config.clone());
        tpc::fsio::check_output("-o", out, &[&a.config, &config])?;
    }
    let def = load_model(&a.config)?;
    // Fail here, not later, if the config does not make a valid model.
    tpc::frontend::to_graph(&def)?;
    let cfg = ron::ser::PrettyConfig::new()
        .extensions(ron::extensions::Extensions::IMPLICIT_SOME)
        .struct_names(false);
    let text = ron_options().to_string_pretty(&def, cfg)?;
    match &a.output {
        Some(path) => tpc::fsio::write_text(path, &(text + "\n"))?,
        None => super::print_stdout(&format!("{text}\n"))?,
    }
    Ok(())
}
