//! Kind `hf_config`: Hugging Face `config.json` files, read as `tpc import` and `tpc compile`
//! read them, then compiled like any model.

use super::compile::exercise;
use super::harness::{bytes_mutator, corpus, Kind, Outcome};
use std::path::Path;
use tpc::frontend::hf_config::family_from_hf_json;
use tpc::frontend::load::{parse_json, parse_ron, ron_options};
use tpc::frontend::ModelDef;

const DICT: &[&str] = &[
    "\"model_type\": \"llama\"",
    "\"model_type\": \"gpt2\"",
    "\"model_type\": \"gpt_neox\"",
    "\"model_type\": \"qwen3\"",
    "\"model_type\": \"mistral\"",
    "\"hidden_size\": ",
    "\"intermediate_size\": ",
    "\"num_hidden_layers\": ",
    "\"num_attention_heads\": ",
    "\"num_key_value_heads\": ",
    "\"head_dim\": ",
    "\"vocab_size\": ",
    "\"rope_theta\": ",
    "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 0.0}",
    "\"rope_scaling\": {\"type\": \"linear\", \"factor\": -1}",
    "\"rms_norm_eps\": ",
    "\"sliding_window\": ",
    "\"tie_word_embeddings\": ",
    "\"torch_dtype\": \"float16\"",
    "\"rotary_pct\": ",
    "\"partial_rotary_factor\": ",
    "\"n_embd\": ",
    "\"n_inner\": ",
    "\"n_layer\": ",
    "\"n_head\": ",
    "\"n_positions\": ",
    "\"hidden_act\": \"gelu_new\"",
    "\"base_model_tp_plan\": {\"layers.*.mlp.up_proj\": \"rowwise\"}",
    "\"mlp_bias\": true",
    "null",
    "true",
    "false",
    "[]",
    "{}",
    "\"\"",
    "\\u0000",
    "\\ud800",
];

pub fn kind() -> Kind {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds = Vec::new();
    for fixtures in ["tests/fixtures/hf_configs", "tests/fixtures/checkpoints"] {
        let mut dirs: Vec<_> = std::fs::read_dir(root.join(fixtures))
            .expect("the fixtures")
            .filter_map(|e| e.ok().map(|e| e.path().join("config.json")))
            .filter(|p| p.is_file())
            .collect();
        dirs.sort();
        for p in dirs {
            let label = p.strip_prefix(root).unwrap_or(&p).display().to_string();
            seeds.push((label, std::fs::read(&p).expect("a readable config")));
        }
    }
    seeds.extend(corpus("hf_config"));
    Kind {
        name: "hf_config",
        ext: "json",
        default_iters: 400,
        seeds,
        dict: DICT,
        max_len: 1 << 20,
        mutator: bytes_mutator,
        target: Box::new(|bytes| {
            let path = Path::new("config.json");
            let text = String::from_utf8_lossy(bytes);
            let Ok(json) = parse_json::<serde_json::Value>(path, &text) else {
                return Outcome::Rejected;
            };
            let Ok(preset) = family_from_hf_json(path, &json) else {
                return Outcome::Rejected;
            };
            let def = ModelDef::Preset(preset);
            if let Some(broken) = import_round_trip(&def) {
                return Outcome::Failed(broken);
            }
            exercise(&def)
        }),
    }
}

/// `tpc import`'s RON of a preset must read back as the same preset.
fn import_round_trip(def: &ModelDef) -> Option<String> {
    let cfg = ron::ser::PrettyConfig::new()
        .extensions(ron::extensions::Extensions::IMPLICIT_SOME)
        .struct_names(false);
    let text = match ron_options().to_string_pretty(def, cfg) {
        Ok(t) => t,
        Err(e) => {
            return Some(format!(
                "broken: the imported preset does not serialize: {e}"
            ))
        }
    };
    match parse_ron::<ModelDef>(Path::new("imported.ron"), &text) {
        Ok(back) if back == *def || has_nan(&text) => None,
        Ok(_) => Some(format!(
            "broken: the imported preset reads back different:\n{text}"
        )),
        Err(e) => Some(format!(
            "broken: the imported preset's RON does not parse back: {e}\n{text}"
        )),
    }
}

/// NaN never equals itself, so a preset holding one cannot compare equal after a round trip.
fn has_nan(text: &str) -> bool {
    text.contains("NaN")
}
