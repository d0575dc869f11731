//! Golden snapshots of the sharded plans and pictures of the tiny models at tp 1, 2, 4.
//! Review changes with `cargo insta review`, or re-bless all with
//! `INSTA_UPDATE=always cargo test --release --test compiler -- golden::`.

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::dot::{draw, render, DotOptions, Picture, READABLE_NODES};
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

/// The node count `draw` reports is the number of node statements in its text, in every
/// view (one rank, every rank, some layers, pipeline stages).
#[test]
fn pictures_count_their_nodes() {
    let statements = |text: &str| {
        text.lines()
            .filter(|l| l.trim_start().starts_with('"') && !l.contains(" -> "))
            .count()
    };
    let mut staged = plan("tiny-llama", 2);
    tpc::pipeline::split_stages(&mut staged, 2, None).unwrap();
    for p in [plan("tiny-llama", 2), plan("tiny-gpt2", 4), staged] {
        for all_ranks in [false, true] {
            for layers in [None, Some((1, 1))] {
                let o = DotOptions { all_ranks, layers };
                let picture = draw(&p, &o);
                assert_eq!(picture.text, render(&p, &o));
                assert_eq!(picture.nodes, statements(&picture.text), "{o:?}");
                assert!(picture.nodes > 10 && !picture.too_large(), "{o:?}");
            }
        }
    }
    let at = |nodes| Picture {
        text: String::new(),
        nodes,
    };
    assert!(!at(READABLE_NODES).too_large());
    assert!(at(READABLE_NODES + 1).too_large());
}

#[test]
fn printing_is_deterministic() {
    for model in MODELS {
        let a = render_plan(&plan(model, 4));
        let b = render_plan(&plan(model, 4));
        assert_eq!(a, b);
    }
}
