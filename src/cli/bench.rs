//! `tpc bench MODEL --tp N`: prefill and decode throughput of a model on N ranks (threads,
//! MPI processes or GPUs), with its checkpoint or with seeded random weights when it has none.

use super::ExecArgs;
use std::path::PathBuf;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::generate::{ComputeDtype, Request, RunOptions};
use tpc::runtime::random::RandomWeights;
use tpc::runtime::replicas::run_replicas;
use tpc::runtime::weights::{Checkpoint, WeightSource};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A model (.ron, HF directory, config.json); a directory with weights uses them.
    model: PathBuf,
    /// Number of tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    /// Sequences generated together (each with the same prompt length, different ids).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// Prompt tokens (ids (i·7919) mod vocab), 1 to 2^20.
    #[arg(long, default_value_t = 128, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 20))]
    prompt_len: usize,
    /// New tokens per sequence, 0 to 2^20 (generation stops early only at the token limit).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 20))]
    max_new_tokens: usize,
    /// Data-parallel replicas of the tp ranks, each with its own weights; the batch is dealt
    /// out over them round robin. 1 to 64.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    dp: u64,
    /// Expert parallelism over the replicas: deal each tp rank's experts of a
    /// mixture-of-experts model over the --dp replicas (the EP group DP × TP of `tpc ranks`)
    /// instead of every replica holding them all; the replicas swap the routed tokens at
    /// every MoE layer (with --pp, each stage shares its layers' experts with the same
    /// stage of the others). Replicas as threads, or as MPI processes under mpirun; on CPUs
    /// or GPUs.
    #[arg(long)]
    ep: bool,
    #[command(flatten)]
    shard: super::ShardArgs,
    #[command(flatten)]
    pipe: super::PipelineArgs,
    /// Where the ranks run: threads, or MPI processes started by `mpirun -np W` (a build
    /// with `--features mpi`); auto: MPI when mpirun started this process with W > 1.
    #[arg(long, value_enum, default_value_t = super::launcher::Launcher::Auto)]
    launcher: super::launcher::Launcher,
    #[command(flatten)]
    exec: ExecArgs,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    super::launcher::with_launcher(
        "bench",
        a.launcher,
        super::launcher::MpiThreads::OneAtATime,
        |mpi| execute_with(a, mpi),
    )
}

/// Benchmarks with ranks as threads (`mpi` None) or as this MPI process's rank (world
/// rank 0 prints).
fn execute_with(a: Args, mpi: Option<&super::launcher::MpiWorld>) -> anyhow::Result<()> {
    let dtype: ComputeDtype = a.exec.dtype.into();
    let def = load_model(&a.model)?;
    let mut plan = tpc::pipeline::compile_with(&def, a.tp, a.shard.options())?.plan;
    a.pipe.apply(&mut plan)?;
    // Before the prompts' token ids exist: they are --batch × --prompt-len of them.
    super::sizes::check_prompts(
        &plan,
        &super::sizes::PromptFlags {
            batch: Some(("--batch", a.batch)),
            prompt_len: ("--prompt-len", a.prompt_len as u64),
            new_tokens: super::sizes::NewTokens::Flag("--max-new-tokens", a.max_new_tokens as u64),
        },
    )?;
    let vocab = tpc::runtime::generate::output_vocab(&plan).unwrap_or(1) as usize;
    let requests: Vec<Request> = (0..a.batch as usize)
        .map(|b| Request {
            prompt: (0..a.prompt_len.max(1))
                .map(|i| ((i * 7919 + b * 104_729) % vocab) as i64)
                .collect(),
            max_new_tokens: None,
        })
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
    // Its stdout is always JSON; the bar is on stderr, for a person at a terminal.
    let ranks = (plan.world() as u64).saturating_mul(a.dp);
    let bar = super::progress::bar(
        requests.len().saturating_mul(a.max_new_tokens),
        ranks,
        false,
    );
    let opts = RunOptions {
        max_new_tokens: a.max_new_tokens,
        all_prompt_logits: false,
        progress: Some(super::progress::reporter(
            &bar,
            a.exec.warmup as usize,
            a.exec.repeat as usize,
        )),
        expert_parallel: a.ep,
        ..a.exec.options()
    };
    let out = match mpi {
        None => run_replicas(&plan, weights, &requests, &opts, a.dp as usize),
        Some(world) => {
            // Every process would draw its own bar over the others'.
            bar.finish_and_clear();
            let job = super::agreement::Job {
                command: "bench",
                model: &a.model,
                plan: &plan,
                checkpoint: ckpt.as_ref(),
                requests: &requests,
                prompt_options: "the prompts (--batch, --prompt-len)",
                opts: &opts,
                dp: a.dp,
                shard: a.shard.options(),
            };
            let mut record = super::agreement::record(&job)?;
            record
                .argument("--batch", a.batch)
                .argument("--prompt-len", a.prompt_len);
            super::launcher::agree(world, &record)?;
            match super::launcher::run_as_process(
                world,
                &plan,
                weights,
                &requests,
                RunOptions {
                    progress: None,
                    ..opts
                },
                a.dp as usize,
            )? {
                Some(out) => Ok(out),
                None => return Ok(()),
            }
        }
    };
    bar.finish_and_clear();
    let out = out?;
    if a.exec.profile {
        eprint!("{}", tpc::runtime::generate::render_profile(&out));
    }
    let mut json = serde_json::json!({
        "model": plan.model,
        "tp": a.tp,
        "pp": plan.pp(),
        "dp": a.dp,
        "experts_over_replicas": a.ep,
        "processes": super::launcher::processes(mpi),
        "dtype": format!("{dtype:?}").to_lowercase(),
        "batch": a.batch,
        "prompt_tokens": out.prompt_tokens,
        "generated": out.generated_tokens(),
        "load_seconds": out.load_seconds,
        "stat": a.exec.stat(),
        "prefill_tokens_per_s": out.prefill_tokens_per_s(),
        "decode_tokens_per_s": out.decode_tokens_per_s(),
        "weight_bytes_rank0": out.weight_bytes,
        "collective_bytes_rank0": out.collective_bytes,
        "all_reduce_algorithms_rank0": out.all_reduces,
        "peak_resident_bytes": tpc::runtime::memory::peak_resident_bytes(),
        "linear_kernels": super::kernels_json(&out),
        "device": a.exec.device.to_string(),
    });
    super::with_expert_load(&mut json, &out.routed_pairs_per_rank);
    super::print_stdout(&format!("{}\n", serde_json::to_string(&json)?))?;
    Ok(())
}
