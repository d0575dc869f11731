//! Kind `model`: RON model definitions (presets and explicit graphs).

use super::compile::exercise;
use super::harness::{bytes_mutator, corpus, files_in, Kind, Outcome};
use std::path::Path;
use tpc::frontend::load::parse_ron;
use tpc::frontend::ModelDef;

/// Field names, variants and group words of model files.
const DICT: &[&str] = &[
    "Preset(", "Graph(", "Llama", "Qwen2", "Qwen3", "Gpt2", "GptNeox", "None", "Some(",
    "true", "false", "hidden_size: ", "intermediate_size: ", "num_hidden_layers: ",
    "num_attention_heads: ", "num_key_value_heads: ", "head_dim: ", "vocab_size: ",
    "rotary_dim: ", "norm_eps: ", "rope_theta: ", "sliding_window: ", "tie_word_embeddings: ",
    "tp_plan: {\"*\": colwise}", "groups: {0: Heads(count: 0, size: 8)}",
    "Heads(count: 3, size: 0, replicable: true)", "Plain(padded: true)", "Repeat(count: 0, ",
    "Node(name: \"x\", op: Add(), inputs: [\"x\", \"x\"])", "Weight(name: \"w\", shape: [])",
    "{i}", "model.layers.{i}", "F32", "BF16", "F16", "Linear(weight_order: InOut)",
    "Attention(head_dim: 0)", "Rope(head_dim: 8, rotary_dim: 9, theta: 0.0)",
    "Llama3(factor: 0.0, low_freq_factor: 1.0, high_freq_factor: 1.0, original_max_position_embeddings: 0)",
    "Linear(factor: 0.0)", "Linear(factor: NaN)", "rotary_pct: ", "hidden_act: ", "colwise", "rowwise",
    "vocab", "replicate", "//", "/*", "r#\"", "\\u{0}",
];

pub fn kind() -> Kind {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds = files_in(&root.join("models"), |p| {
        p.extension().is_some_and(|e| e == "ron")
    });
    seeds.extend(corpus("model"));
    Kind {
        name: "model",
        ext: "ron",
        default_iters: 400,
        seeds,
        dict: DICT,
        max_len: 1 << 20,
        mutator: bytes_mutator,
        target: Box::new(|bytes| {
            let text = String::from_utf8_lossy(bytes);
            match parse_ron::<ModelDef>(Path::new("fuzz.ron"), &text) {
                Ok(def) => exercise(&def),
                Err(_) => Outcome::Rejected,
            }
        }),
    }
}
