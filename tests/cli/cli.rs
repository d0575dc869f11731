//! The command line as users and scripts see it: exit codes, messages, JSON, plan files,
//! pictures that Graphviz renders, and overrides.

use crate::scratch::Scratch;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub(crate) fn tpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("tpc runs")
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A fresh directory for one test's files.
pub(crate) fn scratch(test: &str) -> Scratch {
    Scratch::new("cli", test)
}

pub(crate) fn fails_cleanly(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(1),
        "expected exit 1 (not a panic): {}",
        stderr(o)
    );
    let e = stderr(o);
    assert!(!e.contains("panicked"), "{e}");
    e
}

#[test]
fn impossible_tp_names_the_constraint_and_the_valid_values() {
    // Uneven tps deal heads by their kv groups; more ranks than query heads cannot.
    let o = tpc(&["compile", "models/tiny-llama.ron", "--tp", "9"]);
    let e = fails_cleanly(&o);
    assert!(
        e.contains("8 attention heads cannot be shared by tp=9: every rank needs at least one"),
        "{e}"
    );
    assert!(
        e.contains("Valid tp values for this model: 1, 2, 3, 4, 5, 6, 7, 8."),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "one paragraph: {e}");

    // GPT-2 stores q|k|v as one weight: each part is dealt by whole heads, so tp 3 compiles
    // and tp 9 is refused as for separate weights.
    let o = tpc(&["compile", "models/tiny-gpt2.ron", "--tp", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = tpc(&["compile", "models/tiny-gpt2.ron", "--tp", "9"]);
    let e = fails_cleanly(&o);
    assert!(
        e.contains("8 attention heads cannot be shared by tp=9"),
        "{e}"
    );
    assert!(
        e.contains("Valid tp values for this model: 1, 2, 3, 4, 5, 6, 7, 8."),
        "{e}"
    );
}

#[test]
fn zero_tp_is_an_error() {
    let e = fails_cleanly(&tpc(&["compile", "models/tiny-llama.ron", "--tp", "0"]));
    assert!(e.contains("tp must be at least 1"), "{e}");
}

#[test]
fn malformed_ron_reports_file_line_and_column() {
    let dir = scratch("ron");
    let path = dir.join("bad.ron");
    std::fs::write(
        &path,
        "Preset(\n    family: Llama,\n    hidden_size: 64\n    vocab_size: 10,\n)\n",
    )
    .unwrap();
    let e = fails_cleanly(&tpc(&["compile", path.to_str().unwrap(), "--tp", "2"]));
    assert!(e.contains(&format!("{}:4:", path.display())), "{e}");
}

#[test]
fn garbage_and_missing_inputs_fail_without_panicking() {
    let dir = scratch("garbage");
    let path = dir.join("junk.ron");
    std::fs::write(&path, [0xffu8, 0xfe, 0x00, 0x41]).unwrap();
    fails_cleanly(&tpc(&["compile", path.to_str().unwrap(), "--tp", "2"]));
    let e = fails_cleanly(&tpc(&["compile", "models/does-not-exist.ron", "--tp", "2"]));
    assert!(e.contains("does-not-exist.ron"), "{e}");
    let txt = dir.join("model.txt");
    std::fs::write(&txt, "hello").unwrap();
    let e = fails_cleanly(&tpc(&["compile", txt.to_str().unwrap()]));
    assert!(e.contains(".ron"), "{e}");
}

#[test]
fn bad_graph_definitions_name_the_node() {
    let dir = scratch("graph");
    let path = dir.join("g.ron");
    std::fs::write(
        &path,
        r#"Graph(name: "broken", dtype: F32, body: [
            Node(name: "ids", op: Input(kind: TokenIds)),
            Weight(name: "emb", shape: [10, 8]),
            Node(name: "x", op: Embedding(), inputs: ["ids", "emb"]),
            Weight(name: "w", shape: [4, 7]),
            Node(name: "y", op: Linear(), inputs: ["x", "w"]),
            Node(name: "out", op: Output(name: "logits"), inputs: ["y"]),
        ])"#,
    )
    .unwrap();
    let e = fails_cleanly(&tpc(&["compile", path.to_str().unwrap()]));
    assert!(e.contains("node `y`") && e.contains("expects 7"), "{e}");

    std::fs::write(
        &path,
        r#"Graph(name: "broken", body: [Node(name: "y", op: Output(name: "o"), inputs: ["nowhere"])])"#,
    )
    .unwrap();
    let e = fails_cleanly(&tpc(&["compile", path.to_str().unwrap()]));
    assert!(e.contains("input `nowhere` is not defined"), "{e}");
}

#[test]
fn json_summary_has_the_contract_fields() {
    let o = tpc(&["compile", "models/llama3-70b.ron", "--tp", "8", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tp"], 8);
    let per_rank = v["param_bytes_per_rank"].as_array().unwrap();
    assert_eq!(per_rank.len(), 8);
    let collectives = v["collectives"].as_array().unwrap();
    assert_eq!(collectives.len(), 162);
    for c in collectives {
        let kind = c["kind"].as_str().unwrap();
        assert!(["all_reduce", "all_gather", "reduce_scatter"].contains(&kind));
        assert!(c["layer"].is_null() || c["layer"].is_u64());
        assert!(c["bytes_per_token"].as_u64().unwrap() > 0);
    }
    let embedding = &collectives[0];
    assert_eq!(embedding["kind"], "all_reduce");
    assert!(embedding["layer"].is_null());
    assert_eq!(collectives[1]["layer"], 0);
    assert_eq!(collectives[1]["bytes_per_token"], 16384);
}

#[test]
fn table_reports_memory_communication_and_kv_cache() {
    let o = tpc(&["compile", "models/llama3-8b.ron", "--tp", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "params",
        "bytes",
        "kv bytes/token",
        "all_reduce",
        "all_gather",
        "per layer: 2 all_reduce",
        "ring",
    ] {
        assert!(out.contains(needle), "missing `{needle}` in:\n{out}");
    }
}

#[test]
fn plans_round_trip_through_ron_and_json() {
    let dir = scratch("plans");
    for ext in ["ron", "json"] {
        let path = dir.join(format!("plan.{ext}"));
        let o = tpc(&[
            "compile",
            "models/tiny-gpt2.ron",
            "--tp",
            "2",
            "-o",
            path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let loaded = tpc::plan::Plan::load(&path).unwrap();
        let def = tpc::frontend::load::load_model(Path::new("models/tiny-gpt2.ron")).unwrap();
        let fresh = tpc::pipeline::compile(&def, 2).unwrap().plan;
        assert_eq!(loaded, fresh, "{ext}");
        assert_eq!(loaded.ranks.len(), 2);
        assert!(loaded.ranks.iter().all(|r| !r.weights.is_empty()));
    }
    // A plan from another format version is refused with advice.
    let json = dir.join("plan.json");
    let text =
        std::fs::read_to_string(&json)
            .unwrap()
            .replacen("\"version\": 1", "\"version\": 99", 1);
    let old = dir.join("old.json");
    std::fs::write(&old, text).unwrap();
    let e = tpc::plan::Plan::load(&old).unwrap_err().to_string();
    assert!(e.contains("version 99") && e.contains("Recompile"), "{e}");
}

/// Whether Graphviz's `dot` runs here. Where it does not, the rendering check prints a skip
/// line; `.ci/run` installs Graphviz and sets `TPC_REQUIRE_GRAPHVIZ=1`, so there a missing
/// `dot` fails instead of skipping.
fn graphviz_available() -> bool {
    let found = Command::new("dot")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("TPC_REQUIRE_GRAPHVIZ").is_none(),
            "TPC_REQUIRE_GRAPHVIZ is set but Graphviz `dot` does not run"
        );
        println!("SKIPPED: Graphviz `dot` is not installed (apt-get install graphviz); the DOT files are written but not rendered");
    }
    found
}

/// Renders with Graphviz where it is installed ([`graphviz_available`]).
fn graphviz_renders(dot_file: &Path) {
    if !graphviz_available() {
        return;
    }
    let out = dot_file.with_extension("svg");
    let status = Command::new("dot")
        .args([
            "-Tsvg",
            dot_file.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .status()
        .expect("dot runs");
    assert!(status.success(), "dot failed on {}", dot_file.display());
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.contains("<svg"), "no svg from {}", dot_file.display());
}

#[test]
fn dot_files_render_with_graphviz() {
    let dir = scratch("dot");
    let rank0 = dir.join("rank0.dot");
    let o = tpc(&[
        "dot",
        "models/tiny-neox.ron",
        "--tp",
        "2",
        "-o",
        rank0.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&rank0).unwrap();
    assert!(
        text.contains("cluster_layer_0") && text.contains("cluster_region_"),
        "layer clusters and column→row boxes"
    );
    assert!(text.contains("B/token"), "collectives carry their bytes");
    graphviz_renders(&rank0);

    // Every rank of whole models: Graphviz 2.43's default ranking fails on these
    // ("trouble in init_rank") where the picture does not ask for one global ranking.
    for (model, tp) in [("tiny-llama", "2"), ("tiny-gpt2", "8")] {
        let all = dir.join(format!("{model}-all.dot"));
        let o = tpc(&[
            "dot",
            &format!("models/{model}.ron"),
            "--tp",
            tp,
            "--all-ranks",
            "-o",
            all.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        graphviz_renders(&all);
    }

    // From a plan file, every rank, one layer of an 80-layer model.
    let plan = dir.join("plan.ron");
    let o = tpc(&[
        "compile",
        "models/llama3-70b.ron",
        "--tp",
        "4",
        "-o",
        plan.to_str().unwrap(),
        "--dot",
        dir.join("c.dot").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    graphviz_renders(&dir.join("c.dot"));
    let all = dir.join("all.dot");
    let o = tpc(&[
        "dot",
        plan.to_str().unwrap(),
        "--all-ranks",
        "--layers",
        "3..4",
        "-o",
        all.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&all).unwrap();
    assert!(
        text.contains("cluster_rank_3") && text.contains("layer 4") && !text.contains("layer 5\"")
    );
    graphviz_renders(&all);
    // Two layers of every rank of Llama-3-8B at tp 8 failed the same way.
    let eight = dir.join("8b-all.dot");
    let o = tpc(&[
        "dot",
        "models/llama3-8b.ron",
        "--tp",
        "8",
        "--all-ranks",
        "--layers",
        "3..4",
        "-o",
        eight.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    graphviz_renders(&eight);
    let e = fails_cleanly(&tpc(&["dot", plan.to_str().unwrap(), "--tp", "2"]));
    assert!(e.contains("tp=4"), "{e}");
    let e = fails_cleanly(&tpc(&["dot", "models/tiny-llama.ron", "--layers", "5..x"]));
    assert!(e.contains("--layers"), "{e}");
}

#[test]
fn a_picture_too_large_to_read_gets_a_warning_that_suggests_layers() {
    let dir = scratch("dot-large");
    let warned = |o: &Output| {
        assert!(o.status.success(), "{}", stderr(o));
        let e = stderr(o);
        e.contains("warning: the picture has") && e.contains("--layers")
    };
    // A whole 8B model (32 layers, 584 nodes at tp 2): warned, and still drawn.
    let big = dir.join("big.dot");
    let whole = ["dot", "models/llama3-8b.ron", "--tp", "2"];
    let o = tpc(&[&whole[..], &["-o", big.to_str().unwrap()]].concat());
    assert!(warned(&o), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&big)
        .unwrap()
        .starts_with("digraph"));
    // On stdout the picture stays clean: the warning goes to stderr.
    let o = tpc(&whole);
    assert!(warned(&o));
    assert!(stdout(&o).starts_with("digraph"), "{}", stdout(&o));
    // Every rank of it: the warning says how to draw one rank too.
    let o = tpc(&[&whole[..], &["--all-ranks", "--layers", "0..9"]].concat());
    assert!(
        warned(&o) && stderr(&o).contains("one rank"),
        "{}",
        stderr(&o)
    );
    // On either side of the threshold (300 nodes): 16 layers (297 nodes), 17 layers.
    let o = tpc(&[&whole[..], &["--layers", "0..15"]].concat());
    assert!(!warned(&o), "{}", stderr(&o));
    let o = tpc(&[&whole[..], &["--layers", "0..16"]].concat());
    assert!(warned(&o), "{}", stderr(&o));
    // A few layers, or a tiny model: quiet.
    let o = tpc(&[&whole[..], &["--layers", "0..1"]].concat());
    assert!(!warned(&o) && stderr(&o).is_empty(), "{}", stderr(&o));
    let o = tpc(&["dot", "models/tiny-llama.ron", "--tp", "8", "--all-ranks"]);
    assert!(!warned(&o) && stderr(&o).is_empty(), "{}", stderr(&o));
    // `compile --dot` draws the whole model: the same warning, pointing at `tpc dot`.
    let o = tpc(&[
        "compile",
        "models/llama3-8b.ron",
        "--tp",
        "2",
        "--dot",
        dir.join("c.dot").to_str().unwrap(),
    ]);
    assert!(
        warned(&o) && stderr(&o).contains("tpc dot"),
        "{}",
        stderr(&o)
    );
    let o = tpc(&[
        "compile",
        "models/tiny-llama.ron",
        "--tp",
        "2",
        "--dot",
        dir.join("t.dot").to_str().unwrap(),
    ]);
    assert!(!warned(&o), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

fn with_overrides(dir: &Path, plan: &str) -> PathBuf {
    let base = std::fs::read_to_string("models/tiny-llama.ron").unwrap();
    let text = base.replacen(
        "    dtype: F32,\n",
        &format!("    dtype: F32,\n    tp_plan: {{{plan}}},\n"),
        1,
    );
    assert_ne!(text, base);
    let path = dir.join("over.ron");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn overrides_apply_and_are_checked() {
    let dir = scratch("over");
    // A replicated LM head needs no logits gather.
    let p = with_overrides(&dir, r#""lm_head": replicate"#);
    let o = tpc(&["compile", p.to_str().unwrap(), "--tp", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let kinds: Vec<&str> = v["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert!(!kinds.contains(&"all_gather"), "{kinds:?}");

    // Row-splitting the MLP's up projections is legal but costs an extra all-reduce per
    // layer, and the plan says so by counting it.
    let p = with_overrides(&dir, r#""layers.*.mlp.gate_proj": rowwise"#);
    let o = tpc(&["compile", p.to_str().unwrap(), "--tp", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["collectives"].as_array().unwrap().len() > 6);

    for (plan, needle) in [
        (r#""layers.*.mlp.nothing": colwise"#, "matches no weight"),
        (r#""layers.*.self_attn.q_proj": vocab"#, "not an LM head"),
        (r#""layers.*.input_layernorm": colwise"#, "rms_norm"),
    ] {
        let p = with_overrides(&dir, plan);
        let e = fails_cleanly(&tpc(&["compile", p.to_str().unwrap(), "--tp", "2"]));
        assert!(e.contains(needle), "{plan}: {e}");
    }
}

#[test]
fn explicit_graph_compiles_to_the_preset_plan() {
    let load = |p: &str| tpc::frontend::load::load_model(Path::new(p)).unwrap();
    let (explicit, preset) = (
        load("models/tiny-llama-explicit.ron"),
        load("models/tiny-llama.ron"),
    );
    // Uneven tps too: the explicit heads declare their kv groups, as the preset's do.
    for tp in 1..=8 {
        let mut a = tpc::pipeline::compile(&explicit, tp).unwrap().plan;
        let mut b = tpc::pipeline::compile(&preset, tp).unwrap().plan;
        // Each records the definition it came from; every other field is the same.
        assert!(a.source.is_some() && b.source.is_some());
        (a.source, b.source) = (None, None);
        assert_eq!(a, b, "tp={tp}");
    }
    // Without the kv groups the heads split only evenly, and the refusal says how to
    // declare them.
    let dir = scratch("no-kv-groups");
    let path = dir.join("explicit.ron");
    let text = std::fs::read_to_string("models/tiny-llama-explicit.ron").unwrap();
    std::fs::write(&path, text.replace(", kv_groups: 2", "")).unwrap();
    let e = tpc::pipeline::compile(&load(path.to_str().unwrap()), 3)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("8 attention heads are not divisible by tp=3 (declared with their key/value groups, `kv_groups`")
            && e.contains("Valid tp values for this model: 1, 2, 4, 8."),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn lower_writes_an_explicit_graph_with_the_same_plan() {
    let dir = scratch("lower");
    let out = dir.join("gpt2.ron");
    let o = tpc(&["lower", "models/tiny-gpt2.ron", "-o", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let load = |p: &Path| tpc::frontend::load::load_model(p).unwrap();
    let lowered = load(&out);
    assert!(matches!(lowered, tpc::frontend::ModelDef::Graph(_)));
    let mut a = tpc::pipeline::compile(&lowered, 4).unwrap().plan;
    let mut b = tpc::pipeline::compile(&load(Path::new("models/tiny-gpt2.ron")), 4)
        .unwrap()
        .plan;
    // Each records the definition it came from; every other field is the same.
    (a.source, b.source) = (None, None);
    assert_eq!(a, b);
}

#[test]
fn run_prints_tokens_and_throughput_and_dumps_logits() {
    let dir = scratch("run");
    let logits = dir.join("logits.safetensors");
    let o = tpc(&[
        "run",
        "tests/fixtures/checkpoints/neox-parallel",
        "--tp",
        "2",
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "5",
        "--json",
        "--dump-logits",
        logits.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["generated"].as_array().unwrap().len(), 5);
    assert!(v["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    let bytes = std::fs::read(&logits).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(
        (t.dtype(), t.shape()),
        (safetensors::Dtype::F32, &[4usize, 250][..])
    );

    let o = tpc(&[
        "run",
        "tests/fixtures/checkpoints/neox-parallel",
        "--tp",
        "2",
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "5",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim().split(',').count(), 5, "{}", stdout(&o));
    assert!(stderr(&o).contains("decode"), "{}", stderr(&o));

    let e = fails_cleanly(&tpc(&[
        "run",
        "tests/fixtures/checkpoints/neox-parallel",
        "--tp",
        "9",
        "--prompt-ids",
        "1",
    ]));
    assert!(e.contains("Valid tp values"), "{e}");
    let e = fails_cleanly(&tpc(&[
        "run",
        "tests/fixtures/checkpoints/neox-parallel",
        "--prompt-ids",
        "1,9999",
    ]));
    assert!(e.contains("9999"), "{e}");
    let e = fails_cleanly(&tpc(&["run", "models/tiny-llama.ron", "--prompt-ids", "1"]));
    assert!(e.contains("not a model directory"), "{e}");
}

#[test]
fn verify_compares_tp_n_with_tp_1() {
    let o = tpc(&["verify", "models/tiny-qwen3.ron", "--tp", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("max abs error") && out.contains("relative error") && out.contains("equal"),
        "{out}"
    );
    let o = tpc(&[
        "verify",
        "tests/fixtures/checkpoints/llama-bf16",
        "--tp",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["passed"], true);
    assert!(v["rel_error"].as_f64().unwrap() < 1e-4);
}

#[test]
fn run_with_a_text_prompt_uses_the_tokenizer() {
    let dir = "tests/fixtures/checkpoints/llama-gqa";
    let o = tpc(&[
        "run",
        dir,
        "--tp",
        "2",
        "--prompt",
        "the quick cat sat on the red stone",
        "--max-new-tokens",
        "6",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ids: Vec<u32> = v["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), 6);
    // The text is the tokenizer's decoding of exactly the generated ids.
    let tok = tokenizers::Tokenizer::from_file(format!("{dir}/tokenizer.json")).unwrap();
    assert_eq!(v["text"], tok.decode(&ids, true).unwrap());
    // Same tokens as the ids the tokenizer makes of the text.
    let enc: Vec<String> = tok
        .encode("the quick cat sat on the red stone", false)
        .unwrap()
        .get_ids()
        .iter()
        .map(|i| i.to_string())
        .collect();
    let o2 = tpc(&[
        "run",
        dir,
        "--tp",
        "2",
        "--prompt-ids",
        &enc.join(","),
        "--max-new-tokens",
        "6",
        "--json",
    ]);
    let v2: serde_json::Value = serde_json::from_slice(&o2.stdout).unwrap();
    assert_eq!(v["generated"], v2["generated"]);
    let e = fails_cleanly(&tpc(&[
        "run",
        "tests/fixtures/checkpoints/gpt2",
        "--prompt",
        "hi",
    ]));
    assert!(e.contains("tokenizer.json"), "{e}");
}

fn per_layer_json(path: &Path) -> (serde_json::Value, String) {
    let p = path.to_str().unwrap();
    let o = tpc(&["compile", p, "--tp", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let o = tpc(&["compile", p, "--tp", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let line = stdout(&o)
        .lines()
        .find(|l| l.starts_with("per layer"))
        .expect("a per-layer line")
        .to_string();
    (v["collectives_per_layer"].clone(), line)
}

#[test]
fn per_layer_line_counts_each_layer_when_layers_differ() {
    let dir = scratch("per-layer");
    // Layer 0's down projection whole on every rank: layer 0 gathers the MLP activation and
    // all-reduces once (attention), layer 1 all-reduces twice. The old line divided the
    // totals by the layer count and printed "0 all_gather, 1 all_reduce", true of no layer.
    let p = with_overrides(&dir, r#""layers.0.mlp.down_proj": replicate"#);
    let (json, line) = per_layer_json(&p);
    assert_eq!(
        json,
        serde_json::json!({
            "all_gather": {"min": 0, "max": 1},
            "all_reduce": {"min": 1, "max": 2},
        })
    );
    assert!(
        line.starts_with("per layer (layers differ): 0–1 all_gather, 1–2 all_reduce;"),
        "{line}"
    );
    // Row-split gate in layer 0 only: 3 all-reduces there, 2 in layer 1 (the old line: 2).
    let p = with_overrides(&dir, r#""layers.0.mlp.gate_proj": rowwise"#);
    let (json, line) = per_layer_json(&p);
    assert_eq!(
        json,
        serde_json::json!({"all_reduce": {"min": 2, "max": 3}})
    );
    assert!(
        line.starts_with("per layer (layers differ): 2–3 all_reduce;"),
        "{line}"
    );
}

#[test]
fn per_layer_line_gives_one_count_when_layers_agree() {
    let (json, line) = per_layer_json(Path::new("models/tiny-llama.ron"));
    assert_eq!(json, serde_json::json!({"all_reduce": 2}));
    assert!(line.starts_with("per layer: 2 all_reduce;"), "{line}");
    // The summary reads back from its JSON.
    let o = tpc(&[
        "compile",
        "models/tiny-llama-explicit.ron",
        "--tp",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s: tpc::plan::report::Summary = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        s.collectives_per_layer.get("all_reduce"),
        Some(&tpc::plan::report::LayerCount::Same(2))
    );
}

#[test]
fn sampling_flags_are_never_silently_ignored() {
    let model = "tests/fixtures/checkpoints/llama-gqa";
    let base = [
        "run",
        model,
        "--prompt-ids",
        "3,71",
        "--max-new-tokens",
        "2",
    ];
    let run = |extra: &[&str]| tpc(&[&base[..], extra].concat());
    for (extra, flag) in [
        (&["--top-k", "5"][..], "--top-k"),
        (&["--top-p", "0.9"][..], "--top-p"),
        (
            &["--top-k", "5", "--top-p", "0.9", "--temperature", "0"][..],
            "--top-k and --top-p",
        ),
    ] {
        let e = fails_cleanly(&run(extra));
        assert!(
            e.contains("add --temperature T") && e.contains(&format!("or drop {flag}")),
            "{extra:?}: {e}"
        );
    }
    for (extra, needle) in [
        (&["--temperature", "1", "--top-k", "0"][..], "--top-k 0"),
        (&["--temperature", "1", "--top-p", "1.5"][..], "--top-p 1.5"),
        (&["--temperature", "1", "--top-p", "0"][..], "--top-p 0"),
        (&["--temperature=-1"][..], "--temperature -1"),
        (&["--temperature", "NaN"][..], "--temperature NaN"),
    ] {
        let e = fails_cleanly(&run(extra));
        assert!(e.contains(needle), "{extra:?}: {e}");
    }
    // The same flags with a temperature sample.
    let o = run(&[
        "--temperature",
        "0.8",
        "--top-k",
        "5",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim().split(',').count(), 2, "{}", stdout(&o));
}

/// Subcommand names from `tpc --help`.
fn subcommands() -> Vec<String> {
    let o = tpc(&["--help"]);
    assert!(o.status.success());
    let text = stdout(&o);
    let mut names = Vec::new();
    let mut in_commands = false;
    for line in text.lines() {
        if line.starts_with("Commands:") {
            in_commands = true;
        } else if in_commands {
            match line.split_whitespace().next() {
                Some(name) if line.starts_with("  ") => names.push(name.to_string()),
                _ => break,
            }
        }
    }
    names.retain(|n| n != "help");
    names
}

/// Arguments and options of one `--help` page whose text is empty or only clap's
/// `[default: ..]` / `[possible values: ..]` notes. Handles both layouts: the description on
/// the name's line (short help) or indented below it (long help).
fn undescribed(help: &str) -> Vec<String> {
    fn is_note(s: &str) -> bool {
        s.is_empty() || (s.starts_with('[') && s.ends_with(']'))
    }
    let mut entries: Vec<(String, String)> = Vec::new();
    let mut in_section = false;
    for line in help.lines() {
        if !line.starts_with(' ') {
            in_section = line.starts_with("Arguments:") || line.starts_with("Options:");
            continue;
        }
        if !in_section {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let t = line.trim();
        if indent < 10 && (t.starts_with('-') || t.starts_with('<') || t.starts_with('[')) {
            // The name ends at the first run of two spaces.
            let (name, rest) = t.split_once("  ").unwrap_or((t, ""));
            entries.push((name.to_string(), rest.trim().to_string()));
        } else if let Some(last) = entries.last_mut() {
            last.1.push(' ');
            last.1.push_str(t);
        }
    }
    entries
        .into_iter()
        .filter(|(_, text)| {
            // Notes can follow a description; what remains without them must be words.
            let words: String = text
                .split(']')
                .map(|part| part.split('[').next().unwrap_or(""))
                .collect();
            is_note(text.trim()) || words.trim().is_empty()
        })
        .map(|(name, _)| name)
        .collect()
}

#[test]
fn every_option_of_every_subcommand_has_help() {
    let commands = subcommands();
    assert!(
        commands.len() >= 9 && commands.iter().any(|c| c == "verify"),
        "{commands:?}"
    );
    let mut missing = Vec::new();
    for cmd in &commands {
        let o = tpc(&[cmd, "--help"]);
        assert!(o.status.success(), "{cmd}: {}", stderr(&o));
        let help = stdout(&o);
        assert!(help.contains("Options:"), "{cmd}: {help}");
        for name in undescribed(&help) {
            missing.push(format!("tpc {cmd}: {name}"));
        }
    }
    assert!(
        missing.is_empty(),
        "options without a description:\n{}",
        missing.join("\n")
    );
    // The parser itself catches a bare option line (so the check above can fail).
    let bare =
        "Options:\n      --seed <SEED>  [default: 0]\n      --tp <TP>\n  -h, --help  Print help\n";
    assert_eq!(undescribed(bare), ["--seed <SEED>", "--tp <TP>"]);
    let long = "Arguments:\n  <MODEL>\n          A model\n\nOptions:\n      --x <X>\n          [default: 1]\n\n      --y\n          Why\n";
    assert_eq!(undescribed(long), ["--x <X>"]);
}

#[test]
fn model_files_cannot_set_what_the_partitioner_sets() {
    let dir = scratch("partitioner-only");
    let path = dir.join("g.ron");
    for (node, needles) in [
        (
            r#"Node(name: "emb", op: Embedding(vocab_range: Some((0, 5))), inputs: ["ids", "table"]),"#,
            &["node `emb`", "`vocab_range`", "chosen by the partitioner"][..],
        ),
        (
            r#"Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
               Node(name: "g", op: AllGather(dim: 2, unpad_to: Some(10)), inputs: ["emb"]),"#,
            &[
                "node `g`",
                "`all_gather` is inserted by tpc",
                "`unpad_to`",
                "partitioner",
            ][..],
        ),
        (
            r#"Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
               Node(name: "r", op: AllReduce(), inputs: ["emb"]),"#,
            &["node `r`", "`all_reduce` is inserted by tpc"][..],
        ),
        (
            r#"Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
               Node(name: "s", op: ReduceScatter(dim: 2), inputs: ["emb"]),"#,
            &["node `s`", "`reduce_scatter` is inserted by tpc"][..],
        ),
        (
            r#"Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
               Node(name: "l", op: LocalSlice(dim: 2), inputs: ["emb"]),"#,
            &["node `l`", "`local_slice` is inserted by tpc"][..],
        ),
    ] {
        let text = format!(
            r#"Graph(name: "g", dtype: F32, body: [
                Node(name: "ids", op: Input(kind: TokenIds)),
                Weight(name: "table", shape: [10, 8]),
                {node}
                Node(name: "out", op: Output(name: "logits"), inputs: ["emb"]),
            ])"#
        );
        std::fs::write(&path, text).unwrap();
        let e = fails_cleanly(&tpc(&["compile", path.to_str().unwrap(), "--tp", "2"]));
        for n in needles {
            assert!(e.contains(n), "missing {n:?} in: {e}");
        }
    }
    // Inside a repeat the message names the layer's node.
    std::fs::write(
        &path,
        r#"Graph(name: "g", dtype: F32, body: [
            Node(name: "ids", op: Input(kind: TokenIds)),
            Weight(name: "table", shape: [10, 8]),
            Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
            Repeat(count: 2, carry: "h", init: "emb", result: "l{i}.r", body: [
                Node(name: "l{i}.r", op: AllReduce(), inputs: ["h"]),
            ]),
            Node(name: "out", op: Output(name: "logits"), inputs: ["h"]),
        ])"#,
    )
    .unwrap();
    let e = fails_cleanly(&tpc(&["compile", path.to_str().unwrap()]));
    assert!(e.contains("node `l0.r`"), "{e}");
    // Without those the same graph compiles.
    std::fs::write(
        &path,
        r#"Graph(name: "g", dtype: F32, body: [
            Node(name: "ids", op: Input(kind: TokenIds)),
            Weight(name: "table", shape: [10, 8]),
            Node(name: "emb", op: Embedding(), inputs: ["ids", "table"]),
            Node(name: "out", op: Output(name: "logits"), inputs: ["emb"]),
        ])"#,
    )
    .unwrap();
    let o = tpc(&["compile", path.to_str().unwrap(), "--tp", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// The ```ron block between the README's tp_plan markers.
fn readme_tp_plan_example() -> String {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let start = readme
        .find("<!-- tp_plan example -->")
        .expect("README has the tp_plan example start marker");
    let end = readme
        .find("<!-- end tp_plan example -->")
        .expect("README has the tp_plan example end marker");
    let block = &readme[start..end];
    let body = block
        .split_once("```ron\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("a ```ron block between the markers")
        .0;
    body.to_string()
}

#[test]
fn readme_tp_plan_example_compiles_and_takes_effect() {
    let dir = scratch("readme-tp-plan");
    let path = dir.join("example.ron");
    let example = readme_tp_plan_example();
    assert!(example.contains("tp_plan"), "{example}");
    std::fs::write(&path, &example).unwrap();
    let def = tpc::frontend::load::load_model(&path).unwrap();
    assert!(!def.tp_plan().is_empty());
    let o = tpc(&["compile", path.to_str().unwrap(), "--tp", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // What the README says: 4 collectives, none outside the layers (6 without the plan).
    assert_eq!(v["collective_count"], 4);
    assert_eq!(v["collectives_outside_layers"], serde_json::json!({}));
    let o = tpc(&["compile", "models/tiny-llama.ron", "--tp", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["collective_count"], 6);
}

/// A copy of a fixture checkpoint whose LM head is NaN.
fn nan_head_checkpoint(dir: &Path) -> PathBuf {
    let src = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let model = dir.join("nan-head");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(src.join("config.json"), model.join("config.json")).unwrap();
    let mut bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let head = &header["lm_head.weight"];
    assert_eq!(head["dtype"], "F32");
    let range = head["data_offsets"].as_array().unwrap();
    let (a, b) = (
        8 + n + range[0].as_u64().unwrap() as usize,
        8 + n + range[1].as_u64().unwrap() as usize,
    );
    for chunk in bytes[a..b].chunks_exact_mut(4) {
        chunk.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(model.join("model.safetensors"), bytes).unwrap();
    model
}

/// A tp=2 plan of the llama-gqa fixture whose two ranks read each other's key heads of
/// layer 0: consistent as a plan (every row read once), but not the model — a real mismatch.
fn swapped_heads_plan(dir: &Path) -> PathBuf {
    let plan = dir.join("swapped.json");
    let o = tpc(&[
        "compile",
        "tests/fixtures/checkpoints/llama-gqa",
        "--tp",
        "2",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let name = "model.layers.0.self_attn.k_proj.weight";
    let ranges = |v: &mut serde_json::Value, rank: usize| -> serde_json::Value {
        let weights = v["ranks"][rank]["weights"].as_array_mut().unwrap();
        let w = weights.iter_mut().find(|w| w["tensor"] == name).unwrap();
        w["ranges"].take()
    };
    let (r0, r1) = (ranges(&mut v, 0), ranges(&mut v, 1));
    assert_ne!(r0, r1);
    for (rank, r) in [(0, r1), (1, r0)] {
        let weights = v["ranks"][rank]["weights"].as_array_mut().unwrap();
        weights.iter_mut().find(|w| w["tensor"] == name).unwrap()["ranges"] = r;
    }
    std::fs::write(&plan, serde_json::to_string(&v).unwrap()).unwrap();
    plan
}

#[test]
fn verify_exits_3_on_a_mismatch_and_1_on_an_error() {
    let dir = scratch("verify-exit");
    let plan = swapped_heads_plan(&dir);
    let o = tpc(&[
        "verify",
        "tests/fixtures/checkpoints/llama-gqa",
        "--plan",
        plan.to_str().unwrap(),
    ]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{e}");
    assert!(e.contains("tp=2 does not reproduce tp=1"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    // NaN weights are not blamed on the sharding: the run stops and names the op.
    let model = nan_head_checkpoint(&dir);
    let e = fails_cleanly(&tpc(&["verify", model.to_str().unwrap(), "--tp", "2"]));
    assert!(e.contains("not finite"), "{e}");
    assert!(e.contains("`lm_head`"), "{e}");
    // An error that stops the check is not a mismatch.
    let e = fails_cleanly(&tpc(&["verify", "models/tiny-llama.ron", "--tp", "9"]));
    assert!(e.contains("Valid tp values"), "{e}");
    // A usage error is clap's 2.
    let o = tpc(&["verify", "models/tiny-llama.ron"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    // And an agreeing comparison is 0.
    let o = tpc(&[
        "verify",
        "tests/fixtures/checkpoints/llama-gqa",
        "--tp",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
