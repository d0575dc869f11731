//! `tpc run MODEL_DIR --tp N --prompt-ids 1,2,3 [--max-new-tokens K] [--dump-logits F] [--json]`

use super::ExecArgs;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::generate::{run, RunOptions, Stage};
use tpc::runtime::sampling::Sampling;
use tpc::runtime::weights::Checkpoint;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An HF model directory: config.json and model.safetensors (or a sharded index).
    model: PathBuf,
    /// Number of tensor-parallel ranks (threads).
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Prompt token ids, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    prompt_ids: Vec<i64>,
    /// Prompt text, encoded with the model directory's tokenizer.json; the output is decoded.
    #[arg(long)]
    prompt: Option<String>,
    /// New tokens to generate per prompt (fewer if the model emits its end-of-sequence id).
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// Write the prompt's logits ([prompt_len, vocab], f32) to this safetensors file.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Print a JSON result instead of text.
    #[arg(long)]
    json: bool,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample only among the K most likely tokens (needs --temperature above 0).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities add up to P, in (0, 1]
    /// (needs --temperature above 0).
    #[arg(long)]
    top_p: Option<f32>,
    /// Seed of the sampler; the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    exec: ExecArgs,
}

/// End-of-sequence ids from the model's config.json (an id or a list).
fn eos_ids(dir: &std::path::Path) -> Vec<i64> {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return vec![];
    };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return vec![];
    };
    match json.get("eos_token_id") {
        Some(serde_json::Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(serde_json::Value::Array(v)) => v.iter().filter_map(|x| x.as_i64()).collect(),
        _ => vec![],
    }
}

fn decode(t: &tokenizers::Tokenizer, ids: &[i64]) -> anyhow::Result<String> {
    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    t.decode(&ids, true)
        .map_err(|e| anyhow::anyhow!("cannot decode the output: {e}"))
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.model.is_dir(),
        "`{}` is not a model directory; `tpc run` needs config.json and model.safetensors",
        a.model.display()
    );
    Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
    }
    .validate()?;
    let tokenizer = match &a.prompt {
        Some(_) => {
            let path = a.model.join("tokenizer.json");
            anyhow::ensure!(
                path.exists(),
                "--prompt needs {}; give --prompt-ids instead",
                path.display()
            );
            Some(
                tokenizers::Tokenizer::from_file(&path)
                    .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?,
            )
        }
        None => None,
    };
    let prompt_ids: Vec<i64> = match (&tokenizer, &a.prompt) {
        (Some(t), Some(text)) => t
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("cannot tokenize the prompt: {e}"))?
            .get_ids()
            .iter()
            .map(|&i| i as i64)
            .collect(),
        _ => a.prompt_ids.clone(),
    };
    let def = load_model(&a.model)?;
    def.check_executable(prompt_ids.len().saturating_add(a.max_new_tokens) as u64)?;
    let plan = compile(&def, a.tp)?.plan;
    let ckpt = Checkpoint::open(&a.model)?;
    let bar = ProgressBar::new(a.max_new_tokens as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} tokens")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(format!("loading {} ranks", a.tp));
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    let progress_bar = bar.clone();
    let opts = RunOptions {
        max_new_tokens: a.max_new_tokens,
        sampling: Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        eos: eos_ids(&a.model),
        all_prompt_logits: a.dump_logits.is_some(),
        progress: Some(Arc::new(move |stage| match stage {
            Stage::Loaded => progress_bar.set_message("prefill"),
            Stage::Prefilled => progress_bar.set_message("decode"),
            Stage::Token(n) => progress_bar.set_position(n as u64),
        })),
        ..a.exec.options()
    };
    let out = run(&plan, &ckpt, &prompt_ids, &opts);
    bar.finish_and_clear();
    let out = out?;
    if a.exec.profile {
        eprint!("{}", tpc::runtime::generate::render_profile(&out));
    }
    if let Some(path) = &a.dump_logits {
        let bytes: Vec<u8> = out
            .prompt_logits
            .data
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            out.prompt_logits.shape.clone(),
            &bytes,
        )
        .context("building the logits tensor")?;
        let file =
            safetensors::serialize([("logits", view)], &None).context("serializing the logits")?;
        tpc::fsio::write_bytes(path, &file)?;
    }
    if a.json {
        let json = serde_json::json!({
            "generated": out.generated,
            "prompt_tokens": prompt_ids.len(),
            "tp": a.tp,
            "load_seconds": out.load_seconds,
            "stat": a.exec.stat(),
            "prefill_seconds": out.prefill_seconds,
            "decode_seconds": out.decode_seconds,
            "prefill_tokens_per_s": out.prefill_tokens_per_s(),
            "decode_tokens_per_s": out.decode_tokens_per_s(),
        });
        let mut json = json;
        if let Some(t) = &tokenizer {
            json["text"] = serde_json::Value::String(decode(t, &out.generated)?);
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else if let Some(t) = &tokenizer {
        println!("{}", decode(t, &out.generated)?);
    } else {
        let ids: Vec<String> = out.generated.iter().map(i64::to_string).collect();
        println!("{}", ids.join(","));
        eprintln!(
            "tp={}: prefill {:.1} tokens/s ({} tokens), decode {:.1} tokens/s ({} tokens after the first)",
            a.tp,
            out.prefill_tokens_per_s(),
            prompt_ids.len(),
            out.decode_tokens_per_s(),
            out.generated.len().saturating_sub(1)
        );
    }
    Ok(())
}
