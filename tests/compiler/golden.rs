//! Golden snapshots of the sharded plans and pictures of the tiny models at tp 1, 2, 4.
//! Review changes with `cargo insta review`, or re-bless all with
//! `INSTA_UPDATE=always cargo test --release --test compiler -- golden::`.

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::dot::{render, DotOptions};
use tpc::plan::text::render_plan;

const MODELS: [&str; 5] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gpt2",
    "tiny-neox",
];

fn plan(model: &str, tp: u64) -> tpc::plan::Plan {
    let def = load_model(Path::new(&format!("models/{model}.ron"))).unwrap();
    compile(&def, tp).unwrap().plan
}

#[test]
fn plan_text_snapshots() {
    for model in MODELS {
        for tp in [1, 2, 4] {
            insta::assert_snapshot!(
                format!("plan_{model}_tp{tp}"),
                render_plan(&plan(model, tp))
            );
        }
    }
}

#[test]
fn dot_snapshots() {
    for model in MODELS {
        for tp in [1, 2, 4] {
            let dot = render(&plan(model, tp), &DotOptions::default());
            insta::assert_snapshot!(format!("dot_{model}_tp{tp}"), dot);
        }
    }
    let all = render(
        &plan("tiny-llama", 2),
        &DotOptions {
            all_ranks: true,
            layers: Some((1, 1)),
        },
    );
    insta::assert_snapshot!("dot_tiny-llama_tp2_all_ranks_layer1", all);
}

#[test]
fn printing_is_deterministic() {
    for model in MODELS {
        let a = render_plan(&plan(model, 4));
        let b = render_plan(&plan(model, 4));
        assert_eq!(a, b);
    }
}
