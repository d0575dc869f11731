//! Kinds `plan_ron` and `plan_json`: saved plans, corrupted, then read by `Plan::load`
//! (parse, version check, `Plan::verify`). A plan that loads is trusted by everything
//! downstream, so it is also rendered and run for one token on random weights.

use super::compile::render_all;
use super::harness::{bytes_mutator, corpus, scratch, Kind, Outcome};
use std::path::{Path, PathBuf};
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::Plan;
use tpc::runtime::generate::RunOptions;
use tpc::runtime::random::RandomWeights;
use tpc::runtime::run::run;

/// The seeds: tiny models at tps that shard differently (replicated kv heads, padding).
const SEEDS: &[(&str, u64)] = &[
    ("models/tiny-llama.ron", 2),
    ("models/tiny-gpt2.ron", 4),
    ("models/tiny-neox.ron", 1),
    ("models/tiny-qwen3.ron", 2),
];

const DICT: &[&str] = &[
    "version",
    "tp",
    "rank",
    "weights",
    "instrs",
    "collectives",
    "regions",
    "local_shape",
    "ranges",
    "padding",
    "dim",
    "shape",
    "inputs",
    "layout",
    "fact",
    "Replicated",
    "Split",
    "Partial",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "AllReduce",
    "AllGather",
    "Param",
    "None",
    "Some(",
    "null",
    "max_positions",
    "attention_window",
    "F32",
    "BF16",
    "start",
    "end",
    "layer",
    "fused",
    "linears",
    "columns",
];

/// A plan run only when its weights are small: a plan that verifies may still describe a
/// large model, and allocating it is not what this kind tests.
const MAX_RUN_BYTES: u64 = 64 << 20;

pub fn kind(json: bool) -> Kind {
    let (name, ext) = if json {
        ("plan_json", "json")
    } else {
        ("plan_ron", "ron")
    };
    let dir = scratch(name);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds = Vec::new();
    for &(model, tp) in SEEDS {
        let def = load_model(&root.join(model)).expect("a seed model");
        let plan = compile(&def, tp).expect("a seed plan").plan;
        let path = dir.join(format!("seed.{ext}"));
        plan.save(&path).expect("a saved seed plan");
        seeds.push((
            format!("{model} tp={tp}"),
            std::fs::read(&path).expect("the saved plan"),
        ));
    }
    seeds.extend(corpus(name));
    let file: PathBuf = dir.join(format!("plan.{ext}"));
    Kind {
        name,
        ext,
        default_iters: 500,
        seeds,
        dict: DICT,
        max_len: 4 << 20,
        mutator: bytes_mutator,
        target: Box::new(move |bytes| {
            // The directory lives (and is removed) with the target.
            let _dir = &dir;
            std::fs::write(&file, bytes).expect("the scratch plan");
            let _ = Plan::looks_like_plan(&file);
            match Plan::load(&file) {
                Ok(plan) => {
                    render_all(&plan);
                    run_one_token(&plan);
                    Outcome::Accepted
                }
                Err(_) => Outcome::Rejected,
            }
        }),
    }
}

/// One prompt of two tokens and one new token on seeded random weights; errors are fine.
fn run_one_token(plan: &Plan) {
    let bytes: u64 = plan
        .ranks
        .iter()
        .flat_map(|r| &r.weights)
        .map(|w| w.local_bytes())
        .fold(0, u64::saturating_add);
    if bytes > MAX_RUN_BYTES || plan.tp > 8 {
        return;
    }
    let weights = RandomWeights::new(plan, 7);
    let opts = RunOptions {
        max_new_tokens: 1,
        device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
            threads_per_rank: 1,
            ..Default::default()
        }),
        all_prompt_logits: false,
        ..RunOptions::default()
    };
    let _ = run(plan, &weights, &[1, 2], &opts);
}
