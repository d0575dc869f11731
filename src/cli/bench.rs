//! `tpc bench MODEL --tp N`: prefill and decode throughput of a model on N CPU ranks, with
//! its checkpoint or with seeded random weights when it has none.

use super::DtypeArg;
use std::path::PathBuf;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::generate::{run, ComputeDtype, RunOptions};
use tpc::runtime::random::RandomWeights;
use tpc::runtime::weights::{Checkpoint, WeightSource};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A model (.ron, HF directory, config.json); a directory with weights uses them.
    model: PathBuf,
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Prompt tokens (ids (i·7919) mod vocab).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    #[arg(long, default_value_t = 16)]
    max_new_tokens: usize,
    /// Compute type: auto (the checkpoint's), f32, or bf16 (bf16 weights, f32 accumulation).
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    dtype: DtypeArg,
    /// GEMM threads per rank (default: cores / tp).
    #[arg(long, default_value_t = 0)]
    threads_per_rank: usize,
    /// Print where rank 0's time goes, per op kind, on stderr.
    #[arg(long)]
    profile: bool,
    /// Pin compute threads to cores round robin (measured here: no gain beyond the noise).
    #[arg(long)]
    pin: bool,
    /// Untimed generations first (loading is never timed).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Timed generations; the best prefill and decode are reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    repeat: u64,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    let dtype: ComputeDtype = a.dtype.into();
    let def = load_model(&a.model)?;
    let plan = compile(&def, a.tp)?.plan;
    let vocab = tpc::runtime::generate::output_vocab(&plan).unwrap_or(1) as usize;
    let prompt: Vec<i64> = (0..a.prompt_len.max(1))
        .map(|i| ((i * 7919) % vocab) as i64)
        .collect();
    let ckpt = Checkpoint::find(&a.model)?;
    let random;
    let weights: &dyn WeightSource = match &ckpt {
        Some(c) => c,
        None => {
            random = RandomWeights::new(&compile(&def, 1)?.plan, 0);
            &random
        }
    };
    let opts = RunOptions {
        dtype,
        max_new_tokens: a.max_new_tokens,
        threads_per_rank: a.threads_per_rank,
        profile: a.profile,
        pin_threads: a.pin,
        warmup: a.warmup,
        repeat: a.repeat as usize,
        all_prompt_logits: false,
        ..Default::default()
    };
    let out = run(&plan, weights, &prompt, &opts)?;
    if a.profile {
        eprint!("{}", tpc::runtime::generate::render_profile(&out));
    }
    let json = serde_json::json!({
        "model": plan.model,
        "tp": a.tp,
        "dtype": format!("{dtype:?}").to_lowercase(),
        "prompt_tokens": prompt.len(),
        "generated": out.generated.len(),
        "load_seconds": out.load_seconds,
        "stat": format!("best of {} after {} warm-up", a.repeat, a.warmup),
        "prefill_tokens_per_s": out.prefill_tokens_per_s(),
        "decode_tokens_per_s": out.decode_tokens_per_s(),
    });
    println!("{}", serde_json::to_string(&json)?);
    Ok(())
}
