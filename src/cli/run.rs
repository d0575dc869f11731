//! `tpc run MODEL_DIR --tp N --prompt-ids 1,2,3 [--max-new-tokens K] [--dump-logits F] [--json]`

use super::ExecArgs;
use anyhow::Context;
use std::path::PathBuf;
use std::sync::Arc;
use tpc::frontend::load::load_model;
use tpc::frontend::stop_ids::stop_ids;
use tpc::frontend::text::TextTokenizer;
use tpc::plan::Plan;
use tpc::runtime::generate::{BatchOutput, Request, RunOptions};
use tpc::runtime::replicas::run_replicas;
use tpc::runtime::sampling::Sampling;
use tpc::runtime::weights::Checkpoint;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An HF model directory: config.json and model.safetensors (or a sharded index).
    model: PathBuf,
    /// Number of tensor-parallel ranks; default 1, or the plan's with --plan.
    #[arg(long)]
    tp: Option<u64>,
    #[command(flatten)]
    shard: super::ShardArgs,
    #[command(flatten)]
    pipe: super::PipelineArgs,
    /// Run this saved plan (`tpc compile MODEL -o plan.ron`) instead of compiling the model.
    #[arg(long)]
    plan: Option<PathBuf>,
    /// Prompt token ids, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present_any = ["prompt", "prompts"],
        conflicts_with_all = ["prompt", "prompts"]
    )]
    prompt_ids: Vec<i64>,
    /// Prompt text, encoded with the model directory's tokenizer.json and the special tokens
    /// Hugging Face adds by default (tokenizer_config.json's add_bos_token / add_eos_token,
    /// else tokenizer.json's post-processor); the output is decoded.
    #[arg(long, conflicts_with = "prompts")]
    prompt: Option<String>,
    /// JSONL file of prompts run as one batch: one object per line with `prompt_ids` (a list)
    /// or `prompt` (text), and optionally `max_new_tokens`. One JSON result per line comes
    /// out, in input order.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// New tokens to generate per prompt, 0 to 2^24 (fewer if the model emits an
    /// end-of-sequence id: `eos_token_id` of generation_config.json, else of config.json).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1 << 24))]
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
    /// Gather the whole logits at every decode step, even where the ranks could exchange
    /// only their argmax (greedy) or their top-k candidates (--top-k): the same tokens, more
    /// bytes; for comparisons.
    #[arg(long)]
    gather_logits: bool,
    /// Data parallelism: this many independent replicas of the tp ranks, each with its own
    /// copy of the weights, the prompts of --prompts dealt out round robin; results stay in
    /// input order. 1 to 64.
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
    /// Where the ranks run: threads of this process, or MPI processes (one rank each,
    /// started by `mpirun -np W`; needs a build with `--features mpi`). auto: MPI when an
    /// MPI launcher started this process with more than one rank, else threads.
    #[arg(long, value_enum, default_value_t = super::launcher::Launcher::Auto)]
    launcher: super::launcher::Launcher,
    #[command(flatten)]
    exec: ExecArgs,
}

/// The model folder's tokenizer; where its two files disagree about special tokens, a note
/// on stderr says which one tpc follows.
fn open_tokenizer(dir: &std::path::Path) -> anyhow::Result<TextTokenizer> {
    let t = TextTokenizer::open(dir)?;
    if let Some(note) = t.note() {
        eprintln!("note: {note}");
    }
    Ok(t)
}

/// One line of a `--prompts` file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    prompt_ids: Option<Vec<i64>>,
    prompt: Option<String>,
    max_new_tokens: Option<usize>,
}

/// The requests of a `--prompts` JSONL file (blank lines skipped).
fn read_prompts(
    path: &std::path::Path,
    dir: &std::path::Path,
    tokenizer: &mut Option<TextTokenizer>,
) -> anyhow::Result<Vec<Request>> {
    let text = tpc::fsio::read_text(path)?;
    let mut requests = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let place = format!("{}:{}", path.display(), n + 1);
        let l: PromptLine = serde_json::from_str(line).with_context(|| {
            format!("{place}: expected a JSON object with `prompt_ids` (a list of token ids) or `prompt` (text), and optionally `max_new_tokens`")
        })?;
        let prompt = match (l.prompt_ids, l.prompt) {
            (Some(ids), None) => ids,
            (None, Some(text)) => {
                if tokenizer.is_none() {
                    *tokenizer = Some(open_tokenizer(dir).with_context(|| place.clone())?);
                }
                let t = tokenizer.as_ref().context("tokenizer")?;
                t.encode(&text).with_context(|| place.clone())?
            }
            _ => anyhow::bail!("{place}: give exactly one of `prompt_ids` and `prompt`"),
        };
        requests.push(Request {
            prompt,
            max_new_tokens: l.max_new_tokens,
        });
    }
    anyhow::ensure!(
        !requests.is_empty(),
        "{} has no prompts; write one JSON object per line",
        path.display()
    );
    Ok(requests)
}

/// The plan to run: the saved one (checked against `--tp`) or the model compiled now.
fn plan_for(
    model: &std::path::Path,
    saved: Option<&PathBuf>,
    tp: Option<u64>,
    options: tpc::passes::ShardOptions,
    pipe: &super::PipelineArgs,
) -> anyhow::Result<Plan> {
    match saved {
        Some(path) => {
            super::refuse_options_with_plan(options)?;
            let plan = super::plan_for_tp(Plan::load(path)?, path, tp)?;
            pipe.check_saved(&plan, path)?;
            // A plan that holds together may still compute another model or another split:
            // it runs only if it is what tpc compiles for this checkpoint.
            // A config of an architecture without a preset is run through a plan of an
            // explicit graph; the check then holds the plan to the graph it records.
            let checkpoint = load_model(model);
            let graph_plan = matches!(
                plan.source.as_ref().map(|s| &s.model),
                Some(tpc::frontend::ModelDef::Graph(_))
            );
            let checkpoint = match checkpoint {
                Ok(def) => Some(def),
                Err(_) if graph_plan => None,
                Err(e) => return Err(e.into()),
            };
            tpc::provenance::check_saved(&plan, checkpoint.as_ref(), path)?;
            Ok(plan)
        }
        None => {
            let mut plan =
                tpc::pipeline::compile_with(&load_model(model)?, tp.unwrap_or(1), options)?.plan;
            pipe.apply(&mut plan)?;
            Ok(plan)
        }
    }
}

fn write_logits(
    out: tpc::fsio::Reserved,
    logits: &tpc::runtime::tensor::Tensor,
) -> anyhow::Result<()> {
    let bytes: Vec<u8> = logits.data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, logits.shape.clone(), &bytes)
            .context("building the logits tensor")?;
    let file =
        safetensors::serialize([("logits", view)], &None).context("serializing the logits")?;
    out.commit(&file)?;
    Ok(())
}

/// The bytes of the prompt's logits (f32, [prompt_len, vocab]): the room `--dump-logits`
/// takes before the run. `None` where the plan does not say the vocabulary.
fn logits_bytes(plan: &Plan, prompt_len: usize) -> Option<u64> {
    tpc::runtime::generate::output_vocab(plan)?
        .checked_mul(prompt_len as u64)?
        .checked_mul(4)
}

/// One `--prompts` result as a JSON line.
fn result_line(index: usize, tokens: &[i64], tokenizer: Option<&TextTokenizer>) -> String {
    let mut line = serde_json::json!({ "index": index, "generated": tokens });
    match tokenizer.map(|t| t.decode(tokens)) {
        Some(Ok(text)) => line["text"] = serde_json::Value::String(text),
        Some(Err(e)) => line["text_error"] = serde_json::Value::String(e.to_string()),
        None => {}
    }
    format!("{line}\n")
}

/// Prints results in input order, each as soon as every earlier one is out.
#[derive(Default)]
struct InOrder {
    next: usize,
    waiting: std::collections::BTreeMap<usize, String>,
    error: Option<String>,
}

impl InOrder {
    fn push(&mut self, index: usize, line: String) {
        self.waiting.insert(index, line);
        while let Some(line) = self.waiting.remove(&self.next) {
            if self.error.is_none() {
                if let Err(e) = super::print_stdout(&line) {
                    self.error = Some(e.to_string());
                }
            }
            self.next += 1;
        }
    }
}

/// Figures of a run for `--json`.
fn figures(out: &BatchOutput, tp: u64, pp: usize, a: &Args) -> serde_json::Value {
    let mut json = serde_json::json!({
        "tp": tp,
        "pp": pp,
        "dp": a.dp,
        "experts_over_replicas": a.ep,
        "sequences": out.sequences.len(),
        "prompt_tokens": out.prompt_tokens,
        "generated_tokens": out.generated_tokens(),
        "load_seconds": out.load_seconds,
        "stat": a.exec.stat(),
        "prefill_seconds": out.prefill_seconds,
        "decode_seconds": out.decode_seconds,
        "prefill_tokens_per_s": out.prefill_tokens_per_s(),
        "decode_tokens_per_s": out.decode_tokens_per_s(),
        "weight_bytes_rank0": out.weight_bytes,
        "collective_bytes_rank0": out.collective_bytes,
        "all_reduce_algorithms_rank0": out.all_reduces,
        "collective_dtype": "f32",
        "peak_resident_bytes": tpc::runtime::memory::peak_resident_bytes(),
        "linear_kernels": super::kernels_json(out),
        "device": a.exec.device.to_string(),
    });
    super::with_expert_load(&mut json, &out.routed_pairs_per_rank);
    json
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    super::launcher::with_launcher(
        "run",
        a.launcher,
        super::launcher::MpiThreads::OneAtATime,
        |mpi| execute_with(a, mpi),
    )
}

/// Runs the ranks as threads (`mpi` None) or as this MPI process's rank.
fn execute_with(a: Args, mpi: Option<&super::launcher::MpiWorld>) -> anyhow::Result<()> {
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
    anyhow::ensure!(
        a.prompts.is_none() || a.dump_logits.is_none(),
        "--dump-logits writes one prompt's logits; use it with --prompt-ids or --prompt, not --prompts"
    );
    // The logits file is made ready now: a folder that takes no file fails before the run.
    let mut logits_out = match &a.dump_logits {
        Some(path) => {
            let mut inputs = vec![a.model.as_path()];
            inputs.extend(a.plan.as_deref());
            inputs.extend(a.prompts.as_deref());
            Some(tpc::fsio::reserve("--dump-logits", path, &inputs)?)
        }
        None => None,
    };
    let mut tokenizer = match &a.prompt {
        Some(_) => Some(open_tokenizer(&a.model)?),
        None => None,
    };
    let requests: Vec<Request> = match (&a.prompts, &a.prompt) {
        (Some(file), _) => read_prompts(file, &a.model, &mut tokenizer)?,
        (None, Some(text)) => vec![Request {
            prompt: tokenizer.as_ref().context("tokenizer")?.encode(text)?,
            max_new_tokens: None,
        }],
        (None, None) => vec![Request {
            prompt: a.prompt_ids.clone(),
            max_new_tokens: None,
        }],
    };
    // Checked before any long work: a malformed config is refused now.
    let eos = stop_ids(&a.model)?;
    let plan = plan_for(&a.model, a.plan.as_ref(), a.tp, a.shard.options(), &a.pipe)?;
    let tp = plan.tp;
    let pp = plan.pp();
    // Replicas as threads beyond the requests have nothing to run and are not started.
    let dp = match mpi {
        None => a.dp.min(requests.len().max(1) as u64),
        Some(_) => a.dp,
    };
    // "tp=2", "tp=2 pp=2 dp=2": the ranks' layout, the default 1s left out.
    let layout = format!(
        "tp={tp}{}{}",
        if pp > 1 {
            format!(" pp={pp}")
        } else {
            String::new()
        },
        match (dp > 1, a.ep) {
            (true, true) => format!(" dp={dp} ep={}", dp * tp),
            (true, false) => format!(" dp={dp}"),
            _ => String::new(),
        }
    );
    let layout = match super::launcher::processes(mpi) {
        Some(n) => format!("{layout}, {n} MPI processes"),
        None => layout,
    };
    // A disk without room for the logits fails before the run too (MPI ranks other than
    // the first write none).
    if let (Some(out), Some(r), None) = (&mut logits_out, requests.first(), mpi) {
        if let Some(len) = logits_bytes(&plan, r.prompt.len()) {
            out.preallocate(len)?;
        }
    }
    let ckpt = Checkpoint::open(&a.model)?;
    let total_new: usize = requests
        .iter()
        .map(|r| r.max_new_tokens.unwrap_or(a.max_new_tokens))
        .sum();
    let ranks = (plan.world() as u64).saturating_mul(a.dp);
    let bar = super::progress::bar(total_new, ranks, a.json);
    let tokenizer = Arc::new(tokenizer);
    let streamed = Arc::new(std::sync::Mutex::new(InOrder::default()));
    let on_finished: Option<tpc::runtime::generate::OnFinished> = a.prompts.as_ref().map(|_| {
        let (streamed, tokenizer, bar) = (streamed.clone(), tokenizer.clone(), bar.clone());
        Arc::new(move |index: usize, tokens: &[i64]| {
            let line = result_line(index, tokens, tokenizer.as_ref().as_ref());
            if let Ok(mut s) = streamed.lock() {
                bar.suspend(|| s.push(index, line));
            }
        }) as tpc::runtime::generate::OnFinished
    });
    let opts = RunOptions {
        max_new_tokens: a.max_new_tokens,
        sampling: Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        },
        eos,
        all_prompt_logits: a.dump_logits.is_some(),
        gather_logits: a.gather_logits,
        progress: Some(super::progress::reporter(
            &bar,
            a.exec.warmup as usize,
            a.exec.repeat as usize,
        )),
        on_finished,
        expert_parallel: a.ep,
        ..a.exec.options()
    };
    let out = match mpi {
        None => run_replicas(&plan, &ckpt, &requests, &opts, a.dp as usize),
        Some(world) => {
            bar.finish_and_clear();
            let job = super::agreement::Job {
                command: "run",
                model: &a.model,
                plan: &plan,
                checkpoint: Some(&ckpt),
                requests: &requests,
                prompt_options: "the prompt (--prompt-ids, --prompt or --prompts)",
                opts: &opts,
                dp: a.dp,
                shard: a.shard.options(),
            };
            super::launcher::agree(world, &super::agreement::record(&job)?)?;
            match super::launcher::run_as_process(
                world,
                &plan,
                &ckpt,
                &requests,
                RunOptions {
                    progress: None,
                    ..opts
                },
                a.dp as usize,
            )? {
                Some(out) => {
                    // Results arrive at world rank 0 together: printed in order now.
                    if a.prompts.is_some() {
                        if let Ok(mut s) = streamed.lock() {
                            for (i, seq) in out.sequences.iter().enumerate() {
                                s.push(
                                    i,
                                    result_line(i, &seq.generated, tokenizer.as_ref().as_ref()),
                                );
                            }
                        }
                    }
                    Ok(out)
                }
                None => return Ok(()),
            }
        }
    };
    bar.finish_and_clear();
    let out = out?;
    if a.exec.profile {
        eprint!("{}", tpc::runtime::generate::render_profile(&out));
    }
    let text_of = |ids: &[i64]| -> anyhow::Result<Option<String>> {
        tokenizer
            .as_ref()
            .as_ref()
            .map(|t| t.decode(ids))
            .transpose()
            .map_err(anyhow::Error::from)
    };
    if a.prompts.is_some() {
        let mut streamed = streamed
            .lock()
            .map_err(|_| anyhow::anyhow!("the result printer failed"))?;
        // Every sequence was printed as it finished; a closed pipe or a full disk is an error.
        if let Some(e) = streamed.error.take() {
            anyhow::bail!(e);
        }
        anyhow::ensure!(
            streamed.next == out.sequences.len(),
            "{} of {} results were printed",
            streamed.next,
            out.sequences.len()
        );
        if a.json {
            let summary = serde_json::json!({ "summary": figures(&out, tp, pp, &a) });
            super::print_stdout(&format!("{}\n", serde_json::to_string(&summary)?))?;
        }
        if !a.json {
            eprintln!(
                "{layout}, {} sequences: prefill {:.1} tokens/s ({} tokens), decode {:.1} tokens/s over the batch",
                out.sequences.len(),
                out.prefill_tokens_per_s(),
                out.prompt_tokens,
                out.decode_tokens_per_s(),
            );
            if let Some(line) = super::expert_load_line(&out.routed_pairs_per_rank) {
                eprintln!("{line}");
            }
        }
        return Ok(());
    }
    let seq = out
        .sequences
        .first()
        .context("the run returned no sequence")?;
    // The tokens are printed before the logits are written, so a disk that fills up loses
    // the logits (exit 1) but not the run's result.
    let printed = (|| -> anyhow::Result<()> {
        if a.json {
            let mut json = figures(&out, tp, pp, &a);
            json["generated"] = serde_json::json!(seq.generated);
            // What the prompt became: its ids, special tokens included.
            if let Some(r) = requests.first() {
                json["prompt_ids"] = serde_json::json!(r.prompt);
            }
            if let Some(text) = text_of(&seq.generated)? {
                json["text"] = serde_json::Value::String(text);
            }
            super::print_stdout(&format!("{}\n", serde_json::to_string_pretty(&json)?))?;
        } else if let Some(text) = text_of(&seq.generated)? {
            super::print_stdout(&format!("{text}\n"))?;
        } else {
            let ids: Vec<String> = seq.generated.iter().map(i64::to_string).collect();
            super::print_stdout(&format!("{}\n", ids.join(",")))?;
            eprintln!(
            "{layout}: prefill {:.1} tokens/s ({} tokens), decode {:.1} tokens/s ({} tokens after the first)",
            out.prefill_tokens_per_s(),
            out.prompt_tokens,
            out.decode_tokens_per_s(),
            seq.generated.len().saturating_sub(1)
        );
            if let Some(line) = super::expert_load_line(&out.routed_pairs_per_rank) {
                eprintln!("{line}");
            }
        }
        Ok(())
    })();
    if let Some(out) = logits_out {
        write_logits(out, &seq.prompt_logits)?;
    }
    printed
}
