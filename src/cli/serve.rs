//! `tpc serve MODEL_DIR --tp N [--pp P] [--dp D] --host 127.0.0.1 --port 8000`: an
//! OpenAI-compatible server over the continuous-batching engine, on CPU ranks or GPUs.

use super::ExecArgs;
use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;
use tpc::runtime::engine::api::Serving;
use tpc::runtime::engine::launch::EngineOptions;
use tpc::runtime::run::serve_on_device;
use tpc::runtime::weights::Checkpoint;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An HF model directory: config.json, model.safetensors (or a sharded index) and, for
    /// text, tokenizer.json (tokenizer_config.json's chat_template for chat).
    model: PathBuf,
    /// Number of tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: u64,
    #[command(flatten)]
    shard: super::ShardArgs,
    #[command(flatten)]
    pipe: super::PipelineArgs,
    /// Data parallelism: this many replicas of the ranks, each with its own weights and
    /// engine (under mpirun, in processes of their own); requests go to the least loaded.
    /// 1 to 64.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    dp: u64,
    /// Expert parallelism over the replicas: deal each tp rank's experts of a
    /// mixture-of-experts model over the --dp replicas (the EP group DP × TP of `tpc ranks`)
    /// instead of every replica holding them all; the replicas swap the routed tokens at
    /// every MoE layer, and a replica without requests answers the others' (with --pp, each
    /// stage its own layers'). Replicas as threads, or as processes under mpirun.
    #[arg(long)]
    ep: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (printed once the server listens).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Token slots per KV-cache block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    block_size: u64,
    /// Bytes of KV cache per rank (e.g. 2147483648); default: half the memory the host has
    /// free after the weights, shared by the ranks, at most 4 GiB per rank.
    #[arg(long)]
    kv_cache_memory: Option<u64>,
    /// Sequences in one step at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_num_seqs: u64,
    /// Tokens in one step at most (prompt chunks and decode tokens together): longer
    /// prompts are prefilled in chunks between decode steps.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_num_batched_tokens: u64,
    /// Requests waiting at most; more are answered 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: u64,
    /// Do not share the KV blocks of a common prompt prefix between requests.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Positions a request may reach (prompt and generated tokens); default the model's.
    #[arg(long)]
    max_model_len: Option<u64>,
    /// The model name clients give; default the model folder's name.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seconds SIGTERM waits for running requests before the server exits.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_body_bytes: usize,
    #[command(flatten)]
    exec: ExecArgs,
    /// Where the ranks run: `mpi` (or `auto` under an MPI launcher with more than one rank)
    /// makes this process one rank of the server, started by `mpirun -np dp·tp·pp`; the
    /// process of tp rank 0 of the last stage of replica 0 listens, and sends requests to
    /// the other replicas' processes.
    #[arg(long, value_enum, default_value_t = super::launcher::Launcher::Auto)]
    launcher: super::launcher::Launcher,
}

fn size(flag: &str, v: u64) -> anyhow::Result<usize> {
    usize::try_from(v).with_context(|| format!("{flag} {v} is too large for this host"))
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    // Replicas as processes: each leading process's relay talks while its engine computes.
    let threads = if a.dp > 1 {
        super::launcher::MpiThreads::AtOnce
    } else {
        super::launcher::MpiThreads::OneAtATime
    };
    super::launcher::with_launcher("serve", a.launcher, threads, |mpi| execute_with(a, mpi))
}

/// Serves with the ranks as threads (`mpi` None) or as this MPI process's rank.
fn execute_with(a: Args, mpi: Option<&super::launcher::MpiWorld>) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.model.is_dir(),
        "`{}` is not a model directory; `tpc serve` needs config.json and model.safetensors",
        a.model.display()
    );
    anyhow::ensure!(
        a.shutdown_timeout.is_finite() && a.shutdown_timeout >= 0.0,
        "--shutdown-timeout {} is not a number of seconds; give e.g. 30",
        a.shutdown_timeout
    );
    let text = tpc::serve::TextSide::open(&a.model)?;
    let def = tpc::frontend::load::load_model(&a.model)?;
    let mut plan = tpc::pipeline::compile_with(&def, a.tp, a.shard.options())?.plan;
    a.pipe.apply(&mut plan)?;
    let ckpt = Checkpoint::open(&a.model)?;
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| tpc::serve::offline::served_name(&a.model));
    let opts = EngineOptions {
        block_size: size("--block-size", a.block_size)?,
        kv_cache_memory: a.kv_cache_memory,
        max_num_seqs: size("--max-num-seqs", a.max_num_seqs)?,
        max_num_batched_tokens: size("--max-num-batched-tokens", a.max_num_batched_tokens)?,
        max_waiting: size("--max-waiting", a.max_waiting)?,
        prefix_caching: !a.no_prefix_caching,
        max_model_len: a
            .max_model_len
            .map(|v| size("--max-model-len", v))
            .transpose()?,
        model_name: name,
        expert_parallel: a.ep,
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let server = tpc::serve::ServerOptions {
        host: a.host.clone(),
        port: a.port,
        max_body_bytes: a.max_body_bytes,
        shutdown_timeout: std::time::Duration::from_secs_f64(a.shutdown_timeout),
        handle_signals: true,
        stop: Some(stop.clone()),
    };
    let layout = tpc::runtime::engine::launch::layout_line(&plan, size("--dp", a.dp)?, &opts);
    let layout = match super::launcher::processes(mpi) {
        // The leading process prints it: SIGTERM to it drains the server (Open MPI's
        // mpirun kills the job a second after it forwards a SIGTERM).
        Some(n) => format!(
            "{layout}, {n} MPI processes, leading process pid {}",
            std::process::id()
        ),
        None => layout,
    };
    let client = move |engine: Arc<dyn Serving>, stopped: std::sync::mpsc::Receiver<()>| {
        // An engine that stops (a failed rank) stops the server too.
        std::thread::spawn(move || {
            let _ = stopped.recv();
            stop.notify_one();
        });
        let info = engine.info().clone();
        tpc::serve::serve_blocking(engine, text, server, |addr| {
            eprintln!(
                "serving {} ({layout}, context {} tokens): listening on http://{addr}",
                info.name, info.context
            );
        })
    };
    let exec = a.exec.options();
    let dp = a.dp as usize;
    if let Some(world) = mpi {
        let (engine, served) = super::launcher::serve_as_process(
            world,
            &super::launcher::ServeJob {
                model: &a.model,
                plan: &plan,
                checkpoint: &ckpt,
                exec: &a.exec,
                shard: a.shard.options(),
                dp: a.dp,
                engine: &opts,
            },
            client,
        )?;
        if let Some(served) = served {
            served?;
        }
        return Ok(engine?);
    }
    let (engine, served) =
        serve_on_device(&plan, &ckpt, &exec.device, exec.dtype, &opts, dp, client)?;
    if let Some(served) = served {
        served?;
    }
    engine?;
    Ok(())
}
