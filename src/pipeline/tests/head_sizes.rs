//! The frontend's head-size checks through the whole compiler: a model error is the same refusal at every tp, and heads that divide the declared ones compile.

use crate::frontend::load::parse_ron;
use crate::frontend::ModelDef;
use std::path::Path;

const EXPLICIT: &str = include_str!("../../../models/tiny-llama-explicit.ron");

fn explicit_with(from: &str, to: &str) -> ModelDef {
    assert!(EXPLICIT.contains(from), "{from}");
    parse_ron(Path::new("m.ron"), &EXPLICIT.replace(from, to)).unwrap()
}

/// The message for every tp the model was once accepted at, the same at each.
fn refusal(def: &ModelDef) -> String {
    let first = crate::frontend::to_graph(def).unwrap_err().to_string();
    for tp in [1, 2, 4] {
        let e = crate::pipeline::compile(def, tp).unwrap_err().to_string();
        assert_eq!(e, first);
    }
    assert!(!first.contains("invalid graph"), "{first}");
    first
}

#[test]
fn a_rope_wider_than_the_declared_heads_is_a_model_error() {
    // k has 2 heads of 8: a rope of 16 fits the whole k (16 wide) but not one rank's
    // head at tp 2, where it was "pass `partition` produced an invalid graph".
    let def = explicit_with(
        "Rope(head_dim: 8, rotary_dim: 8",
        "Rope(head_dim: 16, rotary_dim: 16",
    );
    let e = refusal(&def);
    assert!(
        e.contains("node `model.layers.0.self_attn.q_rope`")
            && e.contains("rope head_dim 16 does not fit the heads of 8")
            && e.contains("model.layers.0.self_attn.q_proj.weight"),
        "{e}"
    );
}

#[test]
fn an_attention_wider_than_the_declared_heads_is_a_model_error() {
    let def = explicit_with("Attention(head_dim: 8)", "Attention(head_dim: 16)");
    let e = refusal(&def);
    assert!(
        e.contains("attention head_dim 16 does not fit the heads of 8") && e.contains("(its q)"),
        "{e}"
    );
}

#[test]
fn a_plain_weight_feeding_a_rope_must_declare_its_heads() {
    let def = explicit_with(
        "shape: [16, 64], groups: {0: Heads(count: 2, size: 8, replicable: true, kv_groups: 2)}),\n                Node(name: \"model.layers.{i}.self_attn.k_proj\"",
        "shape: [16, 64]),\n                Node(name: \"model.layers.{i}.self_attn.k_proj\"",
    );
    let e = refusal(&def);
    assert!(
        e.contains("weight `model.layers.0.self_attn.k_proj.weight` feeds this rope")
            && e.contains("Heads(count: 2, size: 8)"),
        "{e}"
    );
}

#[test]
fn heads_that_divide_the_declared_ones_and_the_shipped_models_pass() {
    // Two rope heads of 4 in each declared head of 8: every split keeps them whole.
    let def = explicit_with(
        "Rope(head_dim: 8, rotary_dim: 8",
        "Rope(head_dim: 4, rotary_dim: 4",
    );
    crate::pipeline::compile(&def, 2).unwrap();
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/models")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ron") {
            let def = crate::frontend::load::load_model(&path).unwrap();
            crate::frontend::to_graph(&def).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}
