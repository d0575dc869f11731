//! `tpc explain`: the rule named for q/k/v/o, gate/up/down, embedding and LM head on every
//! family, the chains that decided row splits, collective bytes that agree with
//! `compile --json`, alternatives, patterns and refusals.

use crate::scratch::Scratch;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::{Command, Output};

fn tpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("tpc runs")
}

fn json(args: &[&str]) -> Value {
    let o = tpc(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

fn explain(model: &str, tp: &str) -> Vec<Value> {
    json(&["explain", model, "--tp", tp, "--json"])
        .as_array()
        .expect("a list")
        .clone()
}

/// The entry whose checkpoint names end with `suffix`.
fn entry<'a>(all: &'a [Value], suffix: &str) -> &'a Value {
    all.iter()
        .find(|e| {
            e["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .all(|t| t.as_str().unwrap().ends_with(suffix))
        })
        .unwrap_or_else(|| panic!("no entry for `{suffix}`"))
}

fn kinds(e: &Value) -> Vec<&str> {
    e["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect()
}

/// What one family calls its weights.
struct Family {
    model: &'static str,
    tp: &'static str,
    /// Column-split linears (suffixes).
    columns: &'static [&'static str],
    /// Row-split linears and a column linear their decider chain must name.
    rows: &'static [(&'static str, &'static str)],
    embedding: &'static str,
    /// An untied LM head's weight; `None` when tied to the embedding.
    head: Option<&'static str>,
}

const LLAMA_COLUMNS: &[&str] = &[
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
];
const LLAMA_ROWS: &[(&str, &str)] = &[
    ("self_attn.o_proj.weight", "self_attn.q_proj.weight"),
    ("mlp.down_proj.weight", "mlp.gate_proj.weight"),
    ("mlp.down_proj.weight", "mlp.up_proj.weight"),
];

const FAMILIES: &[Family] = &[
    Family {
        model: "models/tiny-llama.ron",
        tp: "2",
        columns: LLAMA_COLUMNS,
        rows: LLAMA_ROWS,
        embedding: "model.embed_tokens.weight",
        head: Some("lm_head.weight"),
    },
    Family {
        model: "models/tiny-llama-explicit.ron",
        tp: "2",
        columns: LLAMA_COLUMNS,
        rows: LLAMA_ROWS,
        embedding: "model.embed_tokens.weight",
        head: Some("lm_head.weight"),
    },
    Family {
        model: "models/tiny-qwen2.ron",
        tp: "2",
        columns: LLAMA_COLUMNS,
        rows: LLAMA_ROWS,
        embedding: "model.embed_tokens.weight",
        head: Some("lm_head.weight"),
    },
    Family {
        model: "models/tiny-qwen3.ron",
        tp: "2",
        columns: LLAMA_COLUMNS,
        rows: LLAMA_ROWS,
        embedding: "model.embed_tokens.weight",
        head: None,
    },
    Family {
        model: "models/tiny-gpt2.ron",
        tp: "2",
        columns: &["attn.c_attn.weight", "mlp.c_fc.weight"],
        rows: &[
            ("attn.c_proj.weight", "attn.c_attn.weight"),
            ("mlp.c_proj.weight", "mlp.c_fc.weight"),
        ],
        embedding: "transformer.wte.weight",
        head: None,
    },
    Family {
        model: "models/tiny-neox.ron",
        tp: "2",
        columns: &[
            "attention.query_key_value.weight",
            "mlp.dense_h_to_4h.weight",
        ],
        rows: &[
            ("attention.dense.weight", "attention.query_key_value.weight"),
            ("mlp.dense_4h_to_h.weight", "mlp.dense_h_to_4h.weight"),
        ],
        embedding: "gpt_neox.embed_in.weight",
        head: Some("embed_out.weight"),
    },
    Family {
        model: "models/llama3-8b.ron",
        tp: "8",
        columns: LLAMA_COLUMNS,
        rows: LLAMA_ROWS,
        embedding: "model.embed_tokens.weight",
        head: Some("lm_head.weight"),
    },
];

#[test]
fn explain_names_the_rule_for_every_family() {
    for f in FAMILIES {
        let all = explain(f.model, f.tp);
        let at = |what: &str| format!("{} tp {}: {what}", f.model, f.tp);
        for col in f.columns {
            let e = entry(&all, col);
            assert_eq!(e["layout"], "column", "{}", at(col));
            assert_eq!(e["rule"], "reads_whole_activation", "{}", at(col));
            assert_eq!(e["decided_by"]["op"], "linear", "{}", at(col));
            assert!(kinds(e).is_empty(), "{}: {e}", at(col));
            // The other split is not free: the compiler's choice is the cheaper one.
            let alt = &e["alternative"];
            assert_eq!(alt["word"], "rowwise", "{}", at(col));
            assert!(
                alt["collective_bytes_per_token_delta"].as_i64().unwrap() > 0,
                "{}: {alt}",
                at(col)
            );
        }
        for (row, opener) in f.rows {
            let e = entry(&all, row);
            assert_eq!(e["layout"], "row", "{}", at(row));
            assert_eq!(e["rule"], "reads_split_activation", "{}", at(row));
            // The decider chain ends at a column linear, and the openers name `opener`.
            let chain = e["chain"].as_array().unwrap();
            let last = chain.last().expect("a chain");
            assert_eq!(last["op"], "linear", "{}: {e}", at(row));
            assert!(last["layout"].as_str().unwrap().starts_with("S("), "{last}");
            let opened: Vec<&str> = e["opened_by"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_str().unwrap())
                .collect();
            assert!(
                opened.iter().any(|o| o.ends_with(opener)),
                "{}: {opened:?}",
                at(row)
            );
            assert_eq!(kinds(e), ["all_reduce"], "{}", at(row));
            assert_eq!(e["alternative"]["word"], "colwise", "{}", at(row));
            assert!(
                e["alternative"]["collective_bytes_per_token_delta"]
                    .as_i64()
                    .unwrap()
                    > 0,
                "{}",
                at(row)
            );
        }
        let emb = entry(&all, f.embedding);
        assert_eq!(emb["layout"], "vocab", "{}", at(f.embedding));
        assert_eq!(emb["rule"], "embedding_vocab", "{}", at(f.embedding));
        assert_eq!(emb["decided_by"]["op"], "embedding");
        assert_eq!(emb["vocab_dim"], true);
        assert!(kinds(emb).contains(&"all_reduce"), "{emb}");
        match f.head {
            Some(head) => {
                let e = entry(&all, head);
                assert_eq!(e["layout"], "column", "{}", at(head));
                assert_eq!(e["vocab_dim"], true, "{}", at(head));
                assert_eq!(e["rule"], "reads_whole_activation", "{}", at(head));
                assert_eq!(kinds(e), ["all_gather"], "{}", at(head));
                assert!(e["also_read_by"].as_array().unwrap().is_empty());
            }
            None => {
                // Tied: the embedding decides, the LM head reads the same split and its
                // logits gather is the embedding's doing too.
                let readers = emb["also_read_by"].as_array().unwrap();
                assert_eq!(readers.len(), 1, "{emb}");
                assert_eq!(readers[0]["op"], "linear");
                assert_eq!(kinds(emb), ["all_reduce", "all_gather"], "{emb}");
            }
        }
    }
}

#[test]
fn collective_bytes_agree_with_compile_json() {
    for f in FAMILIES {
        let all = explain(f.model, f.tp);
        let mut named: BTreeMap<String, (String, u64)> = BTreeMap::new();
        for e in &all {
            for c in e["collectives"].as_array().unwrap() {
                let values = c["values"].as_array().unwrap();
                assert_eq!(values.len() as u64, c["count"].as_u64().unwrap());
                for v in values {
                    named.insert(
                        v.as_str().unwrap().to_string(),
                        (
                            c["kind"].as_str().unwrap().to_string(),
                            c["bytes_per_token"].as_u64().unwrap(),
                        ),
                    );
                }
            }
        }
        let compiled = json(&["compile", f.model, "--tp", f.tp, "--json"]);
        let plan: BTreeMap<String, (String, u64)> = compiled["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["value"].as_str().unwrap().to_string(),
                    (
                        c["kind"].as_str().unwrap().to_string(),
                        c["bytes_per_token"].as_u64().unwrap(),
                    ),
                )
            })
            .collect();
        // Every collective of the plan is some weight's doing, with the plan's bytes.
        assert_eq!(named, plan, "{}", f.model);
    }
}

#[test]
fn parallel_residual_layers_share_one_all_reduce() {
    let all = explain("models/tiny-neox.ron", "2");
    let e = entry(&all, "attention.dense.weight");
    let c = &e["collectives"][0];
    let shared: Vec<&str> = c["shared_with"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(shared, ["gpt_neox.layers.0.mlp.dense_4h_to_h.weight"]);
}

#[test]
fn text_tells_the_story_and_patterns_filter() {
    let o = tpc(&["explain", "models/tiny-llama.ron", "--tp", "2", "down_proj"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("model.layers.{0..1}.mlp.down_proj.weight"),
        "{text}"
    );
    assert!(text.contains("row split, dim 1"), "{text}");
    assert!(
        text.contains("reading gate_up S(2) ← act S(2) ← gate_proj S(2)"),
        "{text}"
    );
    assert!(
        text.contains("split by column-split gate_proj.weight, up_proj.weight"),
        "{text}"
    );
    assert!(!text.contains("q_proj"), "{text}");
    // A glob: only the MLP's three linears, two layers each.
    let all = json(&[
        "explain",
        "models/tiny-llama.ron",
        "--tp",
        "2",
        "*.mlp.*",
        "--json",
    ]);
    let tensors: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["tensor"].as_str().unwrap())
        .collect();
    assert_eq!(
        tensors,
        [
            "model.layers.{0..1}.mlp.gate_proj.weight",
            "model.layers.{0..1}.mlp.up_proj.weight",
            "model.layers.{0..1}.mlp.down_proj.weight"
        ]
    );
}

#[test]
fn an_override_is_named_and_its_alternative_compiled() {
    let dir = Scratch::new("explain", "override");
    let base = std::fs::read_to_string("models/tiny-llama.ron").unwrap();
    let text = base.replacen(
        "    dtype: F32,\n",
        "    dtype: F32,\n    tp_plan: {\"lm_head\": replicate},\n",
        1,
    );
    assert_ne!(text, base);
    let path = dir.join("over.ron");
    std::fs::write(&path, text).unwrap();
    let all = json(&[
        "explain",
        path.to_str().unwrap(),
        "--tp",
        "2",
        "lm_head",
        "--json",
    ]);
    let e = &all[0];
    assert_eq!(e["layout"], "replicated");
    assert_eq!(e["rule"], "override");
    assert_eq!(e["override"], "replicate");
    assert!(kinds(e).is_empty(), "{e}");
    // Column-splitting it again brings the logits gather back, and halves its bytes.
    let alt = &e["alternative"];
    assert_eq!(alt["outcome"], "feasible", "{alt}");
    assert_eq!(alt["word"], "colwise");
    assert_eq!(alt["collectives_delta"]["all_gather"], 1, "{alt}");
    assert_eq!(alt["param_bytes_per_rank_delta"], -32000, "{alt}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tp_1_explains_without_alternatives() {
    let all = explain("models/tiny-llama.ron", "1");
    for e in &all {
        assert_eq!(e["rule"], "tp_1", "{e}");
        assert_eq!(e["layout"], "replicated");
        assert_eq!(e["alternative"]["outcome"], "none");
    }
}

#[test]
fn bad_input_fails_cleanly() {
    for args in [
        &[
            "explain",
            "models/tiny-llama.ron",
            "--tp",
            "2",
            "no_such_weight",
        ][..],
        &["explain", "models/tiny-llama.ron", "--tp", "9"],
        &["explain", "models/tiny-llama.ron", "--tp", "0"],
        &["explain", "models/does-not-exist.ron", "--tp", "2"],
    ] {
        let o = tpc(args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    let o = tpc(&[
        "explain",
        "models/tiny-llama.ron",
        "--tp",
        "2",
        "no_such_weight",
    ]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("no weight of tiny-llama matches `no_such_weight`"),
        "{e}"
    );
    assert!(
        e.contains("`model.layers.0.self_attn.q_proj.weight`"),
        "{e}"
    );
}
