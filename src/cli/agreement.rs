//! What the MPI ranks of `run` and `bench` compare before loading
//! ([`tpc::runtime::agreement`]): every option that changes what a rank computes or which
//! collectives it calls, the prompts, the plan and the model files. Options of one host's
//! resources may differ between ranks: `--threads-per-rank`, `--pin`, `--isa` (the best
//! kernels of each host), the GPU list of `--device cuda:LIST`; so may those of world rank
//! 0's output alone: `--json`, `--profile`, the path of `--dump-logits`, the model's path.
//! `--launcher` needs no field: a rank that compares is an MPI rank (see
//! [`super::launcher::with_launcher`] for one that is not).

use anyhow::Context;
use std::path::Path;
use tpc::plan::Plan;
use tpc::runtime::agreement::{digest, Digest, Record};
use tpc::runtime::generate::{Device, Request, RunOptions};
use tpc::runtime::weights::Checkpoint;

/// One rank's job, as `run` and `bench` hold it just before the ranks load.
pub struct Job<'a> {
    /// `run` or `bench`.
    pub command: &'static str,
    /// The model as given: a folder (its files are compared), or a model file.
    pub model: &'a Path,
    pub plan: &'a Plan,
    pub checkpoint: Option<&'a Checkpoint>,
    pub requests: &'a [Request],
    /// What the requests were made of, for the message (`--prompt-ids, --prompt or --prompts`).
    pub prompt_options: &'static str,
    pub opts: &'a RunOptions,
    pub dp: u64,
    pub shard: tpc::passes::ShardOptions,
}

fn on_off(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The record this rank compares with the others'.
pub fn record(job: &Job<'_>) -> anyhow::Result<Record> {
    let (plan, opts) = (job.plan, job.opts);
    let stages = match &plan.pipeline {
        Some(p) if plan.pp() > 1 => {
            let layers: Vec<String> = p.stages.iter().map(|s| s.layers.to_string()).collect();
            format!("{} stages of {} layers", plan.pp(), layers.join(","))
        }
        _ => "1 stage".into(),
    };
    let device = match &opts.device {
        Device::Cpu(_) => "cpu",
        Device::Cuda(_) => "cuda",
    };
    let s = &opts.sampling;
    let mut r = Record::new(job.command);
    r.argument("--tp", plan.tp)
        .argument("--pp / --pp-layers", stages)
        .argument("--dp", job.dp)
        .argument("--ep", on_off(opts.expert_parallel))
        .argument("--sequence-parallel", on_off(job.shard.sequence_parallel))
        .argument("--fuse-norm", on_off(job.shard.fuse_norm))
        .argument("--numerics", job.shard.numerics)
        .argument(
            "--moe",
            job.shard.moe.map_or("as the model says", |m| m.word()),
        )
        .argument("--device", device)
        .argument(
            "--dtype",
            if opts.dtype.bf16_linears(plan) {
                "bf16"
            } else {
                "f32"
            },
        )
        .argument("--temperature", s.temperature)
        .argument("--top-k", s.top_k.map_or("none".into(), |k| k.to_string()))
        .argument("--top-p", s.top_p.map_or("none".into(), |p| p.to_string()))
        .argument("--seed", s.seed)
        .argument("--max-new-tokens", opts.max_new_tokens)
        .argument("--warmup", opts.warmup)
        .argument("--repeat", opts.repeat)
        .argument("--gather-logits", on_off(opts.gather_logits))
        .argument("--dump-logits", on_off(opts.all_prompt_logits))
        .argument_digest(job.prompt_options, requests_digest(job.requests));
    let eos: Vec<String> = opts.eos.iter().map(i64::to_string).collect();
    r.derived(
        "the end-of-sequence ids (config.json, generation_config.json)",
        format!("[{}]", eos.join(",")),
    );
    let plan_bytes = serde_json::to_vec(plan).context("serializing the plan")?;
    r.derived_digest(
        "the plan (--plan, or the one compiled from the model)",
        digest(&plan_bytes),
    );
    model_files(&mut r, job.model, job.checkpoint)?;
    Ok(r)
}

/// The digest of a batch of prompts: each one's token ids and its own new-token limit.
fn requests_digest(requests: &[Request]) -> u64 {
    let mut d = Digest::default();
    d.u64(requests.len() as u64);
    for r in requests {
        d.u64(r.prompt.len() as u64);
        for &id in &r.prompt {
            d.bytes(&id.to_le_bytes());
        }
        d.u64(r.max_new_tokens.map_or(u64::MAX, |n| n as u64));
    }
    d.finish()
}

/// The model folder's files that decide what is computed: config.json and
/// generation_config.json whole, the index whole, and each weight file by its header,
/// length and samples of its data ([`Checkpoint::file_identities`]). `model` is the model
/// as given: a folder, or a model file (then only the weights are named: random or not).
fn model_files(
    r: &mut Record,
    model: &Path,
    checkpoint: Option<&Checkpoint>,
) -> anyhow::Result<()> {
    if model.is_dir() {
        for name in [
            "config.json",
            "generation_config.json",
            "model.safetensors.index.json",
        ] {
            let path = model.join(name);
            // Opened as every input is (a FIFO or a device would block or never end).
            let bytes = match tpc::fsio_check::open_regular(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(e).with_context(|| format!("reading `{}`", path.display())),
                Ok(mut file) => {
                    let mut bytes = Vec::new();
                    std::io::Read::read_to_end(&mut file, &mut bytes)
                        .with_context(|| format!("reading `{}`", path.display()))?;
                    Some(bytes)
                }
            };
            r.file(name, bytes.map(|b| digest(&b)));
        }
    }
    match checkpoint {
        Some(c) => {
            r.derived("the weights", "the checkpoint's");
            for (name, d) in c.file_identities()? {
                r.file(&name, Some(d));
            }
        }
        None => {
            r.derived("the weights", "random (no checkpoint)");
        }
    }
    Ok(())
}
