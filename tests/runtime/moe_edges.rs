//! Mixture-of-experts edge cases against a dense twin, and bad inputs.
//!
//! With every router weight zero, all experts tie on every token: the lower experts win
//! (`runtime::moe::route`), so every token picks the same ones with equal weights. The
//! layer then equals a dense gated MLP made of the chosen experts side by side (gate and
//! up stacked, down scaled by the routing weight), which tpc's dense path computes and
//! which matches HF on the dense fixtures. The twin checks ties, every token picking the
//! same experts, experts no token picks (their weights are NaN here, so reading them would
//! show), and top-k equal to the number of experts.

use crate::common::{read_reference, rel_error, REL_TOL};
use crate::scratch::Scratch;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::ir::ExpertSplit;
use tpc::passes::ShardOptions;
use tpc::pipeline::compile_with;
use tpc::runtime::generate::RunOptions;
use tpc::runtime::run::run;
use tpc::runtime::weights::Checkpoint;

const MIXTRAL: &str = "tests/fixtures/checkpoints/mixtral-moe";
const EXPERTS: usize = 8;

fn scratch(name: &str) -> Scratch {
    Scratch::new("moe-edges", name)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The f32 tensors of `dir`'s checkpoint, by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let raw = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&raw).unwrap();
    let mut all: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), Dtype::F32, "{n}");
            (n, t.shape().to_vec(), f32s(t.data()))
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn write(dir: &Path, config: &Value, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), bytes(v)))
        .collect();
    let views: Vec<(String, TensorView)> = raw
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, &None).unwrap(),
    )
    .unwrap();
}

fn config(dir: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(Path::new(dir).join("config.json")).unwrap())
        .unwrap()
}

/// The Mixtral fixture with zero routers, `top_k` experts per token, and the experts no
/// token can pick (those past `top_k`) poisoned with NaN; and its dense Llama twin, whose
/// MLP is the first `top_k` experts side by side, each down scaled by `1 / top_k`.
fn tied_and_twin(top_k: usize) -> (Scratch, Scratch) {
    let src = tensors(Path::new(MIXTRAL));
    let moe_dir = scratch(&format!("tied-{top_k}"));
    let mut moe_config = config(MIXTRAL);
    moe_config["num_experts_per_tok"] = json!(top_k);
    let moe: Vec<_> = src
        .iter()
        .map(|(n, s, v)| {
            let poisoned = (top_k..EXPERTS).any(|e| n.contains(&format!(".experts.{e}.")));
            let values = if n.ends_with("block_sparse_moe.gate.weight") {
                vec![0.0; v.len()]
            } else if poisoned {
                vec![f32::NAN; v.len()]
            } else {
                v.clone()
            };
            (n.clone(), s.clone(), values)
        })
        .collect();
    write(&moe_dir, &moe_config, &moe);

    let twin_dir = scratch(&format!("twin-{top_k}"));
    let c = config(MIXTRAL);
    let features = c["intermediate_size"].as_u64().unwrap() as usize;
    let hidden = c["hidden_size"].as_u64().unwrap() as usize;
    let twin_config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "float32",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": features * top_k,
        "max_position_embeddings": c["max_position_embeddings"],
        "num_attention_heads": c["num_attention_heads"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_key_value_heads": c["num_key_value_heads"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_parameters": c["rope_parameters"],
        "tie_word_embeddings": false,
        "vocab_size": c["vocab_size"],
    });
    let find = |name: &str| -> &Vec<f32> {
        &src.iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("{name}"))
            .2
    };
    let mut twin: Vec<(String, Vec<usize>, Vec<f32>)> = src
        .iter()
        .filter(|(n, ..)| !n.contains("block_sparse_moe"))
        .cloned()
        .collect();
    let layers = c["num_hidden_layers"].as_u64().unwrap();
    let scale = 1.0 / top_k as f32;
    for l in 0..layers {
        let expert = |e: usize, w: &str| {
            find(&format!(
                "model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"
            ))
        };
        // gate (w1) and up (w3) are [f, h]: the experts' rows one after another.
        for (w, name) in [("w1", "gate_proj"), ("w3", "up_proj")] {
            let rows: Vec<f32> = (0..top_k).flat_map(|e| expert(e, w).clone()).collect();
            twin.push((
                format!("model.layers.{l}.mlp.{name}.weight"),
                vec![features * top_k, hidden],
                rows,
            ));
        }
        // down (w2) is [h, f]: each row the experts' columns side by side, scaled.
        let mut down = Vec::with_capacity(hidden * features * top_k);
        for r in 0..hidden {
            for e in 0..top_k {
                let w2 = expert(e, "w2");
                down.extend(
                    w2[r * features..(r + 1) * features]
                        .iter()
                        .map(|v| v * scale),
                );
            }
        }
        twin.push((
            format!("model.layers.{l}.mlp.down_proj.weight"),
            vec![hidden, features * top_k],
            down,
        ));
    }
    write(&twin_dir, &twin_config, &twin);
    (moe_dir, twin_dir)
}

fn run_dir(dir: &Path, tp: u64, moe: Option<ExpertSplit>, prompt: &[i64]) -> (Vec<f32>, Vec<i64>) {
    let def = load_model(dir).unwrap();
    let options = ShardOptions {
        moe,
        ..Default::default()
    };
    let plan = compile_with(&def, tp, options).unwrap().plan;
    let ckpt = Checkpoint::open(dir).unwrap();
    let opts = RunOptions {
        max_new_tokens: 8,
        ..Default::default()
    };
    let out = run(&plan, &ckpt, prompt, &opts).unwrap();
    (out.prompt_logits.data, out.generated)
}

#[test]
fn tied_routers_pick_the_lower_experts_for_every_token_and_equal_the_dense_twin() {
    let prompt = read_reference(Path::new(MIXTRAL)).prompt;
    // Top 2 of 8: experts 0 and 1 at 1/2 each, 2-7 never read (NaN). Top 8 of 8: all at 1/8.
    for top_k in [2, EXPERTS] {
        let (moe, twin) = tied_and_twin(top_k);
        let (want, want_tokens) = run_dir(&twin, 1, None, &prompt);
        assert!(want.iter().all(|v| v.is_finite()));
        for split in [ExpertSplit::Tensor, ExpertSplit::Expert] {
            for tp in 1..=4 {
                let (got, tokens) = run_dir(&moe, tp, Some(split), &prompt);
                let what = format!("top {top_k} of {EXPERTS}, --moe {} tp={tp}", split.word());
                let err = rel_error(&got, &want);
                assert!(
                    err <= REL_TOL,
                    "{what}: relative error {err:.3e} to the dense twin"
                );
                assert_eq!(tokens, want_tokens, "{what}: greedy tokens");
            }
        }
        let _ = std::fs::remove_dir_all(moe);
        let _ = std::fs::remove_dir_all(twin);
    }
}

/// Reading `dir` fails before any weight is read (or compute runs), with a message that
/// holds every needle.
fn refused(dir: &Path, needles: &[&str]) {
    let err = match load_model(dir).and_then(|def| compile_with(&def, 2, ShardOptions::default())) {
        Err(e) => e.to_string(),
        Ok(compiled) => match Checkpoint::open(dir) {
            Err(e) => e.to_string(),
            Ok(ckpt) => run(&compiled.plan, &ckpt, &[1, 2], &RunOptions::default())
                .unwrap_err()
                .to_string(),
        },
    };
    for n in needles {
        assert!(err.contains(n), "{dir:?}: lacks {n:?}: {err}");
    }
}

#[test]
fn expert_counts_that_do_not_fit_and_missing_experts_are_named() {
    let src = tensors(Path::new(MIXTRAL));
    let with_config = |name: &str, key: &str, v: Value| {
        let dir = scratch(name);
        let mut c = config(MIXTRAL);
        c[key] = v;
        write(&dir, &c, &src);
        dir
    };
    // More experts than the checkpoint holds: the router's shape says so first.
    let more = with_config("more", "num_local_experts", json!(16));
    refused(
        &more,
        &[
            "model.layers.0.block_sparse_moe.gate.weight",
            "[8, 64]",
            "[16, 64]",
        ],
    );
    // A top-k beyond the experts, or zero.
    let wide = with_config("wide", "num_experts_per_tok", json!(9));
    refused(&wide, &["num_experts_per_tok is 9", "1 to the 8 experts"]);
    let none = with_config("none", "num_experts_per_tok", json!(0));
    refused(&none, &["num_experts_per_tok is 0"]);
    let zero = with_config("zero", "num_local_experts", json!(0));
    refused(&zero, &["num_experts is 0"]);
    // One expert's tensor missing from the checkpoint.
    let gone = "model.layers.1.block_sparse_moe.experts.5.w2.weight";
    let dir = scratch("gone");
    let kept: Vec<_> = src.iter().filter(|(n, ..)| n != gone).cloned().collect();
    write(&dir, &config(MIXTRAL), &kept);
    refused(&dir, &[gone, "missing"]);
    // An expert of the wrong shape.
    let dir = scratch("shape");
    let reshaped: Vec<_> = src
        .iter()
        .map(|(n, s, v)| {
            let s = if n == gone {
                vec![s[1], s[0]]
            } else {
                s.clone()
            };
            (n.clone(), s, v.clone())
        })
        .collect();
    write(&dir, &config(MIXTRAL), &reshaped);
    refused(&dir, &[gone, "shape"]);
    for d in [more, wide, none, zero] {
        let _ = std::fs::remove_dir_all(d);
    }
}
