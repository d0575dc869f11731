//! Reading Hugging Face `config.json` files. The fixtures under `tests/fixtures/hf_configs/`
//! are the configs published on the Hub, byte for byte as far as the fields go, except
//! `llama3.1-8b-v5`: the same Llama 3.1 8B config in the transformers 5.x spelling (`dtype`,
//! `rope_parameters`).

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use tpc::frontend::load::load_model;
use tpc::frontend::{Family, FamilyConfig, ModelDef};
use tpc::ir::{ActivationKind, DType, QuantFormat, RopeScaling, F64};
use tpc::pipeline::compile;
use tpc::plan::report::{summarize, Summary};
use tpc::plan::Plan;

const FIXTURES: [&str; 9] = [
    "llama3-8b",
    "llama3.1-405b",
    "llama3.1-8b",
    "llama3.1-8b-v5",
    "mistral-7b",
    "qwen2-7b",
    "qwen3-32b",
    "gpt2",
    "pythia-1.4b",
];

/// Fixtures with a shipped preset of the same name in `models/`.
const WITH_PRESET: [&str; 7] = [
    "llama3-8b",
    "llama3.1-405b",
    "mistral-7b",
    "qwen2-7b",
    "qwen3-32b",
    "gpt2",
    "pythia-1.4b",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/hf_configs").join(name)
}

fn fixture_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(path: &Path) -> ModelDef {
    load_model(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn family_of(def: &ModelDef) -> &FamilyConfig {
    match def {
        ModelDef::Preset(p) => p,
        ModelDef::Graph(g) => panic!("an HF config must read as a preset, got graph {}", g.name),
    }
}

fn plan_of(def: &ModelDef, tp: u64, what: &str) -> Plan {
    compile(def, tp)
        .unwrap_or_else(|e| panic!("{what} at tp={tp}: {e}"))
        .plan
}

fn preset(name: &str) -> ModelDef {
    load(&root().join("models").join(format!("{name}.ron")))
}

/// A scratch directory under the system temp dir, unique per process and call, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!(
            "tpc-hf-config-test-{}-{n}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Writes `text` as `<dir>/<sub>/config.json` and returns the model directory.
    fn model_dir(&self, sub: &str, text: &str) -> PathBuf {
        let dir = self.0.join(sub);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), text).unwrap();
        dir
    }

    fn model_json(&self, sub: &str, json: &Value) -> PathBuf {
        self.model_dir(sub, &serde_json::to_string_pretty(json).unwrap())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tpc<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .output()
        .expect("run the tpc binary")
}

/// Runs tpc, expects exit code 1 (an error, never a panic), returns stderr.
fn tpc_fails<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = tpc(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit code 1; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "tpc panicked:\n{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// Everything `None`; fill in what a config says.
fn blank(family: Family, name: &str, dtype: DType) -> FamilyConfig {
    FamilyConfig {
        family,
        name: Some(name.to_string()),
        hidden_size: 0,
        intermediate_size: 0,
        num_hidden_layers: 0,
        num_attention_heads: 0,
        num_key_value_heads: None,
        head_dim: None,
        vocab_size: 0,
        max_position_embeddings: None,
        norm_eps: None,
        rope_theta: None,
        rope_scaling: None,
        rotary_pct: None,
        attention_bias: None,
        tie_word_embeddings: None,
        use_parallel_residual: None,
        hidden_act: None,
        sliding_window: None,
        dtype,
        tp_plan: BTreeMap::new(),
        moe: None,
        quantization: None,
    }
}

fn llama31_rope() -> Option<RopeScaling> {
    Some(RopeScaling::Llama3 {
        factor: F64(8.0),
        low_freq_factor: F64(1.0),
        high_freq_factor: F64(4.0),
        original_max_position_embeddings: 8192,
    })
}

/// What each published config says, as tpc should read it.
fn expected(name: &str) -> FamilyConfig {
    let llama3_8b = FamilyConfig {
        hidden_size: 4096,
        intermediate_size: 14336,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: Some(8),
        vocab_size: 128256,
        max_position_embeddings: Some(8192),
        norm_eps: Some(1e-5),
        rope_theta: Some(500000.0),
        attention_bias: Some(false),
        tie_word_embeddings: Some(false),
        hidden_act: Some(ActivationKind::Silu),
        ..blank(Family::Llama, "llama", DType::Bf16)
    };
    match name {
        "llama3-8b" => llama3_8b,
        "llama3.1-8b" | "llama3.1-8b-v5" => FamilyConfig {
            max_position_embeddings: Some(131072),
            rope_scaling: llama31_rope(),
            ..llama3_8b
        },
        "llama3.1-405b" => FamilyConfig {
            hidden_size: 16384,
            intermediate_size: 53248,
            num_hidden_layers: 126,
            num_attention_heads: 128,
            max_position_embeddings: Some(131072),
            rope_scaling: llama31_rope(),
            ..llama3_8b
        },
        "mistral-7b" => FamilyConfig {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            vocab_size: 32000,
            max_position_embeddings: Some(32768),
            norm_eps: Some(1e-5),
            rope_theta: Some(10000.0),
            tie_word_embeddings: Some(false),
            hidden_act: Some(ActivationKind::Silu),
            // 4096 < 32768 positions: kept, so runs longer than the window are refused.
            sliding_window: Some(4096),
            ..blank(Family::Llama, "mistral", DType::Bf16)
        },
        "qwen2-7b" => FamilyConfig {
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: Some(4),
            vocab_size: 152064,
            max_position_embeddings: Some(131072),
            norm_eps: Some(1e-6),
            rope_theta: Some(1000000.0),
            // Not in the config: Qwen2 always has q/k/v biases.
            attention_bias: Some(true),
            tie_word_embeddings: Some(false),
            hidden_act: Some(ActivationKind::Silu),
            ..blank(Family::Qwen2, "qwen2", DType::Bf16)
        },
        "qwen3-32b" => FamilyConfig {
            hidden_size: 5120,
            intermediate_size: 25600,
            num_hidden_layers: 64,
            num_attention_heads: 64,
            num_key_value_heads: Some(8),
            head_dim: Some(128),
            vocab_size: 151936,
            max_position_embeddings: Some(40960),
            norm_eps: Some(1e-6),
            rope_theta: Some(1000000.0),
            attention_bias: Some(false),
            tie_word_embeddings: Some(false),
            hidden_act: Some(ActivationKind::Silu),
            ..blank(Family::Qwen3, "qwen3", DType::Bf16)
        },
        // No dtype in the config: GPT-2 checkpoints are f32.
        "gpt2" => FamilyConfig {
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            vocab_size: 50257,
            max_position_embeddings: Some(1024),
            norm_eps: Some(1e-5),
            hidden_act: Some(ActivationKind::GeluTanh),
            ..blank(Family::Gpt2, "gpt2", DType::F32)
        },
        "pythia-1.4b" => FamilyConfig {
            hidden_size: 2048,
            intermediate_size: 8192,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            vocab_size: 50304,
            max_position_embeddings: Some(2048),
            norm_eps: Some(1e-5),
            rope_theta: Some(10000.0),
            rotary_pct: Some(0.25),
            tie_word_embeddings: Some(false),
            use_parallel_residual: Some(true),
            hidden_act: Some(ActivationKind::Gelu),
            ..blank(Family::GptNeox, "gpt_neox", DType::F16)
        },
        other => panic!("no expectation for {other}"),
    }
}

/// Parameter counts of the published checkpoints (each tensor once, tied heads once).
fn published_params(name: &str) -> u64 {
    match name {
        "llama3-8b" | "llama3.1-8b" | "llama3.1-8b-v5" => 8_030_261_248,
        "llama3.1-405b" => 405_853_388_800,
        "mistral-7b" => 7_241_732_096,
        "qwen2-7b" => 7_615_616_512,
        "qwen3-32b" => 32_762_123_264,
        "gpt2" => 124_439_808,
        "pythia-1.4b" => 1_414_647_808,
        other => panic!("no parameter count for {other}"),
    }
}

/// The first difference between two sequences, described for a failure message.
fn first_diff<T: PartialEq + Debug>(a: &[T], b: &[T]) -> Option<String> {
    if let Some(i) = (0..a.len().min(b.len())).find(|&i| a[i] != b[i]) {
        return Some(format!(
            "first difference at index {i}:\n  hf:     {:?}\n  preset: {:?}",
            a[i], b[i]
        ));
    }
    (a.len() != b.len()).then(|| format!("lengths differ: hf {} vs preset {}", a.len(), b.len()))
}

/// Asserts two plans are equal except the model name, pointing at the first difference.
fn assert_same_plan_but_name(hf: &Plan, preset: &Plan, ctx: &str) {
    assert_eq!(hf.version, preset.version, "{ctx}: version");
    assert_eq!(hf.tp, preset.tp, "{ctx}: tp");
    assert_eq!(hf.dtype, preset.dtype, "{ctx}: dtype");
    assert_eq!(hf.notes, preset.notes, "{ctx}: notes");
    if let Some(d) = first_diff(&hf.collectives, &preset.collectives) {
        panic!("{ctx}: collectives: {d}");
    }
    if let Some(d) = first_diff(&hf.regions, &preset.regions) {
        panic!("{ctx}: regions: {d}");
    }
    assert_eq!(hf.ranks.len(), preset.ranks.len(), "{ctx}: rank count");
    for (a, b) in hf.ranks.iter().zip(&preset.ranks) {
        assert_eq!(a.rank, b.rank, "{ctx}");
        if let Some(d) = first_diff(&a.weights, &b.weights) {
            panic!("{ctx}: rank {} weights: {d}", a.rank);
        }
        if let Some(d) = first_diff(&a.instrs, &b.instrs) {
            panic!("{ctx}: rank {} instrs: {d}", a.rank);
        }
    }
    // Catch-all: nothing else differs either. (Each plan records the definition it came
    // from, which spells defaults differently; what is computed is compared above.)
    let renamed = Plan {
        model: preset.model.clone(),
        source: preset.source.clone(),
        ..hf.clone()
    };
    assert!(
        renamed == *preset,
        "{ctx}: plans differ outside the checked fields"
    );
}

#[test]
fn every_fixture_reads_as_published_from_directory_and_file() {
    for name in FIXTURES {
        let dir = fixture(name);
        let from_dir = load(&dir);
        let from_file = load(&dir.join("config.json"));
        assert_eq!(from_dir, from_file, "{name}: directory vs config.json");
        assert_eq!(family_of(&from_dir), &expected(name), "{name}");
        assert!(
            from_dir.tp_plan().is_empty(),
            "{name}: no tp_plan overrides"
        );
    }
}

#[test]
fn every_fixture_compiles_at_tp_1_2_4_with_published_sizes() {
    for name in FIXTURES {
        let def = load(&fixture(name));
        let c = family_of(&def).clone();
        let kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
        let bytes = c.dtype.size_bytes();
        let kv_total = c.num_hidden_layers * 2 * kv_heads * head_dim * bytes;
        for tp in [1, 2, 4] {
            let ctx = format!("{name} tp={tp}");
            let plan = plan_of(&def, tp, &ctx);
            assert_eq!(plan.tp, tp, "{ctx}");
            assert_eq!(plan.ranks.len() as u64, tp, "{ctx}");
            assert_eq!(plan.dtype, c.dtype, "{ctx}");
            assert_eq!(plan.model, c.name.clone().unwrap(), "{ctx}");
            let s: Summary = summarize(&plan);
            assert_eq!(s.model_param_count, published_params(name), "{ctx}");
            assert_eq!(s.model_param_bytes, published_params(name) * bytes, "{ctx}");
            // Every kv head count here divides by 4: the cache splits evenly, no copies.
            assert_eq!(
                s.kv_cache_bytes_per_token_per_rank,
                vec![kv_total / tp; tp as usize],
                "{ctx}"
            );
            let sharded: u64 = s.param_count_per_rank.iter().sum();
            if tp == 1 {
                assert_eq!(sharded, s.model_param_count, "{ctx}");
                assert_eq!(
                    s.collective_count, 0,
                    "{ctx}: one rank needs no collectives"
                );
            } else {
                // Norms are replicated and padded vocab rows added: never less than the model.
                assert!(sharded >= s.model_param_count, "{ctx}");
                // Most parameters are split: each rank holds far less than the whole.
                for p in &s.param_count_per_rank {
                    assert!(*p < s.model_param_count * 2 / tp + 1, "{ctx}: {p}");
                }
                assert!(s.collective_count >= c.num_hidden_layers, "{ctx}");
            }
        }
    }
}

#[test]
fn hf_configs_compile_to_the_shipped_presets_plans() {
    for name in WITH_PRESET {
        let mut hf = load(&fixture(name));
        let preset_def = preset(name);
        let want = family_of(&preset_def);
        let ModelDef::Preset(got) = &mut hf else {
            unreachable!()
        };
        // The presets are bf16 for serving; GPT-2 ships f32 and Pythia f16 checkpoints.
        // Only the dtype may differ, and only for those two.
        match name {
            "gpt2" => assert_eq!(got.dtype, DType::F32),
            "pythia-1.4b" => assert_eq!(got.dtype, DType::F16),
            _ => assert_eq!(got.dtype, want.dtype, "{name}: dtype"),
        }
        got.dtype = want.dtype;
        for tp in [1, 2, 4] {
            let ctx = format!("{name} tp={tp}");
            let from_hf = plan_of(&hf, tp, &format!("{ctx} (hf)"));
            let from_preset = plan_of(&preset_def, tp, &format!("{ctx} (preset)"));
            assert_same_plan_but_name(&from_hf, &from_preset, &ctx);
        }
    }
}

#[test]
fn gpt2_and_pythia_keep_their_checkpoint_dtype() {
    for (name, dtype) in [("gpt2", DType::F32), ("pythia-1.4b", DType::F16)] {
        let plan = plan_of(&load(&fixture(name)), 2, name);
        assert_eq!(plan.dtype, dtype, "{name}");
        for r in &plan.ranks {
            for w in &r.weights {
                assert_eq!(w.dtype, dtype, "{name}: {}", w.tensor);
            }
        }
        let s = summarize(&plan);
        assert_eq!(
            s.model_param_bytes,
            published_params(name) * dtype.size_bytes()
        );
    }
}

#[test]
fn llama31_8b_reads_the_same_in_transformers_4_and_5_spelling() {
    let v4_json = fixture_json("llama3.1-8b");
    let v5_json = fixture_json("llama3.1-8b-v5");
    // The fixtures really are the two spellings.
    assert!(v4_json.get("torch_dtype").is_some() && v4_json.get("dtype").is_none());
    assert!(v4_json.get("rope_scaling").is_some() && v4_json.get("rope_parameters").is_none());
    assert!(v5_json.get("dtype").is_some() && v5_json.get("torch_dtype").is_none());
    assert!(v5_json.get("rope_parameters").is_some());
    assert!(v5_json.get("rope_scaling").is_none() && v5_json.get("rope_theta").is_none());

    let v4 = load(&fixture("llama3.1-8b"));
    let v5 = load(&fixture("llama3.1-8b-v5"));
    let (mut a, mut b) = (family_of(&v4).clone(), family_of(&v5).clone());
    a.name = None;
    b.name = None;
    assert_eq!(a, b);
    assert_eq!(b.rope_theta, Some(500000.0));
    assert_eq!(b.rope_scaling, llama31_rope());
    assert_eq!(b.dtype, DType::Bf16);
    for tp in [1, 2, 4, 8] {
        let pa = plan_of(&v4, tp, "llama3.1-8b (4.x)");
        let pb = plan_of(&v5, tp, "llama3.1-8b (5.x)");
        assert_same_plan_but_name(&pa, &pb, &format!("llama3.1 8b 4.x vs 5.x tp={tp}"));
    }
}

#[test]
fn llama31_rope_scaling_reaches_every_rope_op() {
    let plan = plan_of(&load(&fixture("llama3.1-405b")), 8, "llama3.1-405b");
    let mut ropes = 0;
    for i in &plan.ranks[0].instrs {
        if let tpc::ir::Op::Rope(r) = &i.op {
            ropes += 1;
            assert_eq!(r.scaling, llama31_rope(), "{}", i.name);
            assert_eq!(r.theta, F64(500000.0), "{}", i.name);
            assert_eq!((r.head_dim, r.rotary_dim), (128, 128), "{}", i.name);
        }
    }
    assert_eq!(ropes, 2 * 126, "q and k in every layer");
}

#[test]
fn pythia_rotates_a_quarter_of_each_head() {
    let plan = plan_of(&load(&fixture("pythia-1.4b")), 2, "pythia-1.4b");
    let ropes: Vec<_> = plan.ranks[0]
        .instrs
        .iter()
        .filter_map(|i| match &i.op {
            tpc::ir::Op::Rope(r) => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(ropes.len(), 2 * 24);
    for r in ropes {
        assert_eq!((r.head_dim, r.rotary_dim), (128, 32));
        assert_eq!(r.theta, F64(10000.0));
        assert_eq!(r.scaling, None);
    }
}

/// Transformers 5.x moved rope_theta and the GPT-NeoX rotary fields into `rope_parameters`.
#[test]
fn transformers_5_rope_parameters_match_4_x_fields() {
    let scratch = Scratch::new("v5");
    // Qwen3: plain rope, theta only.
    let mut q = fixture_json("qwen3-32b");
    let o = q.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.remove("torch_dtype");
    o.insert("dtype".into(), json!("bfloat16"));
    o.insert(
        "rope_parameters".into(),
        json!({"rope_theta": 1000000, "rope_type": "default"}),
    );
    let q5 = load(&scratch.model_json("qwen3", &q));
    assert_eq!(family_of(&q5), &expected("qwen3-32b"));

    // GPT-NeoX: rotary_emb_base and rotary_pct become rope_theta and partial_rotary_factor.
    let mut n = fixture_json("pythia-1.4b");
    let o = n.as_object_mut().unwrap();
    o.remove("rotary_emb_base");
    o.remove("rotary_pct");
    o.remove("torch_dtype");
    o.insert("dtype".into(), json!("float16"));
    o.insert(
        "rope_parameters".into(),
        json!({"partial_rotary_factor": 0.25, "rope_theta": 10000, "rope_type": "default"}),
    );
    let n5 = load(&scratch.model_json("neox", &n));
    assert_eq!(family_of(&n5), &expected("pythia-1.4b"));
}

/// Keys a config leaves out take the HF config class's default, which is not always the
/// tpc family default.
#[test]
fn absent_keys_take_the_hf_class_defaults() {
    let scratch = Scratch::new("defaults");
    let without = |name: &str, key: &str| {
        let mut j = fixture_json(name);
        assert!(
            j.as_object_mut().unwrap().remove(key).is_some(),
            "{name} has {key}"
        );
        let def = load(&scratch.model_json(&format!("{name}-{key}"), &j));
        family_of(&def).clone()
    };
    let with = |name: &str, key: &str, v: Value| {
        let mut j = fixture_json(name);
        j.as_object_mut().unwrap().insert(key.into(), v);
        let def = load(&scratch.model_json(&format!("{name}-{key}-set"), &j));
        family_of(&def).clone()
    };
    // GPTNeoXConfig: rotary_pct 0.25.
    assert_eq!(without("pythia-1.4b", "rotary_pct").rotary_pct, Some(0.25));
    // Qwen3Config: head_dim 128, not hidden_size / heads (5120 / 64 = 80).
    assert_eq!(without("qwen3-32b", "head_dim").head_dim, Some(128));
    // num_key_value_heads: Mistral 8, Qwen2/Qwen3 32, Llama one per query head.
    assert_eq!(
        without("mistral-7b", "num_key_value_heads").num_key_value_heads,
        Some(8)
    );
    assert_eq!(
        without("qwen3-32b", "num_key_value_heads").num_key_value_heads,
        Some(32)
    );
    assert_eq!(
        without("qwen2-7b", "num_key_value_heads").num_key_value_heads,
        Some(32)
    );
    assert_eq!(
        without("llama3-8b", "num_key_value_heads").num_key_value_heads,
        None
    );
    // An explicit null means one kv head per query head in every HF class.
    assert_eq!(
        with("qwen3-32b", "num_key_value_heads", Value::Null).num_key_value_heads,
        None
    );
    // Qwen3 32B without num_key_value_heads has 32 kv heads: k_proj is [32 * 128, 5120].
    let mut j = fixture_json("qwen3-32b");
    j.as_object_mut().unwrap().remove("num_key_value_heads");
    let plan = plan_of(
        &load(&scratch.model_json("qwen3-kv32", &j)),
        1,
        "qwen3 kv 32",
    );
    let k = plan.ranks[0]
        .weights
        .iter()
        .find(|w| &*w.tensor == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.shape, vec![4096, 5120]);
}

#[test]
fn import_writes_a_preset_that_compiles_to_the_same_plan() {
    let scratch = Scratch::new("import");
    for name in FIXTURES {
        let dir = fixture(name);
        for (i, input) in [dir.clone(), dir.join("config.json")].iter().enumerate() {
            let out = scratch.0.join(format!("{name}-{i}.ron"));
            let run = tpc([
                "import".as_ref(),
                input.as_os_str(),
                "-o".as_ref(),
                out.as_os_str(),
            ]);
            assert!(
                run.status.success(),
                "{name}: tpc import failed:\n{}",
                String::from_utf8_lossy(&run.stderr)
            );
            let original = load(&dir);
            let imported = load(&out);
            assert_eq!(
                imported, original,
                "{name}: the RON reads back as the config"
            );
            for tp in [1, 2, 4] {
                assert!(
                    plan_of(&imported, tp, name) == plan_of(&original, tp, name),
                    "{name} tp={tp}: the imported preset compiles to a different plan"
                );
            }
        }
    }
}

#[test]
fn import_to_stdout_prints_the_same_preset() {
    let scratch = Scratch::new("import-stdout");
    let run = tpc(["import".as_ref(), fixture("qwen3-32b").as_os_str()]);
    assert!(run.status.success());
    let path = scratch.0.join("qwen3.ron");
    std::fs::write(&path, &run.stdout).unwrap();
    assert_eq!(load(&path), load(&fixture("qwen3-32b")));
}

#[test]
fn compile_json_from_the_binary_matches_the_library() {
    for name in ["llama3-8b", "gpt2", "pythia-1.4b"] {
        let dir = fixture(name);
        let run = tpc([
            "compile".as_ref(),
            dir.as_os_str(),
            "--tp".as_ref(),
            "4".as_ref(),
            "--json".as_ref(),
        ]);
        assert!(
            run.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let from_cli: Summary = serde_json::from_slice(&run.stdout).unwrap();
        let from_lib = summarize(&plan_of(&load(&dir), 4, name));
        assert_eq!(from_cli, from_lib, "{name}");
    }
}

#[test]
fn an_impossible_tp_names_the_constraint() {
    // Qwen2 7B: 28 query heads in 4 kv groups; tp 8 deals them unevenly (two ranks per
    // group, 4 and 3 query heads), but 29 ranks are more than the query heads.
    compile(&load(&fixture("qwen2-7b")), 8).unwrap();
    let err = compile(&load(&fixture("qwen2-7b")), 29).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("cannot be split 29 ways"), "{msg}");
    assert!(msg.contains("28 attention heads cannot be shared"), "{msg}");
    assert!(msg.contains("Valid tp values"), "{msg}");
    let stderr = tpc_fails([
        "compile".as_ref(),
        fixture("qwen2-7b").as_os_str(),
        "--tp".as_ref(),
        "29".as_ref(),
    ]);
    assert!(stderr.contains("cannot be split 29 ways"), "{stderr}");
}

// ---- bad inputs: exit code 1 and a message naming the problem ----

/// The llama3-8b config with one change, written to a scratch model directory.
fn edited(
    scratch: &Scratch,
    sub: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> PathBuf {
    let mut j = fixture_json("llama3-8b");
    edit(j.as_object_mut().unwrap());
    scratch.model_json(sub, &j)
}

/// Both the library and the binary (`compile` and `import`) reject `path`; every message
/// contains all of `needles`. Returns the binary's stderr.
fn rejected(path: &Path, needles: &[&str]) -> String {
    let lib = load_model(path).map(|_| ()).unwrap_err().to_string();
    for n in needles {
        assert!(lib.contains(n), "library message lacks {n:?}: {lib}");
    }
    let mut last = String::new();
    for cmd in ["compile", "import"] {
        let stderr = tpc_fails([cmd.as_ref(), path.as_os_str()]);
        for n in needles {
            assert!(
                stderr.contains(n),
                "`tpc {cmd}` message lacks {n:?}: {stderr}"
            );
        }
        last = stderr;
    }
    last
}

#[test]
fn unsupported_model_type_is_named() {
    let scratch = Scratch::new("model-type");
    let dir = edited(&scratch, "t5", |o| {
        o.insert("model_type".into(), json!("t5"));
    });
    let cfg = dir.join("config.json");
    let msg = rejected(
        &dir,
        &["model_type `t5` is not supported", "llama, mistral"],
    );
    assert!(msg.contains(&cfg.display().to_string()), "{msg}");
}

#[test]
fn missing_model_type_is_named() {
    let scratch = Scratch::new("no-model-type");
    let dir = edited(&scratch, "m", |o| {
        o.remove("model_type");
    });
    rejected(&dir, &["`model_type` is missing"]);
}

#[test]
fn missing_hidden_size_is_named() {
    let scratch = Scratch::new("no-hidden");
    let dir = edited(&scratch, "m", |o| {
        o.remove("hidden_size");
    });
    let cfg = dir.join("config.json");
    rejected(
        &dir,
        &["`hidden_size` is missing", &cfg.display().to_string()],
    );
    // GPT-2 names its own key.
    let mut g = fixture_json("gpt2");
    g.as_object_mut().unwrap().remove("n_embd");
    rejected(&scratch.model_json("gpt2", &g), &["`n_embd` is missing"]);
}

#[test]
fn a_string_where_a_number_belongs_is_named() {
    let scratch = Scratch::new("string-number");
    let dir = edited(&scratch, "layers", |o| {
        o.insert("num_hidden_layers".into(), json!("32"));
    });
    rejected(
        &dir,
        &[
            "`num_hidden_layers` must be a non-negative integer",
            "\"32\"",
        ],
    );
    let dir = edited(&scratch, "eps", |o| {
        o.insert("rms_norm_eps".into(), json!("1e-5"));
    });
    rejected(&dir, &["`rms_norm_eps` must be a number", "\"1e-5\""]);
    let dir = edited(&scratch, "negative", |o| {
        o.insert("vocab_size".into(), json!(-1));
    });
    rejected(&dir, &["`vocab_size` must be a non-negative integer", "-1"]);
    let dir = edited(&scratch, "bool", |o| {
        o.insert("tie_word_embeddings".into(), json!("no"));
    });
    rejected(&dir, &["`tie_word_embeddings` must be true or false"]);
}

#[test]
fn a_quantized_checkpoint_is_refused_naming_its_method() {
    let scratch = Scratch::new("quantized");
    for (sub, config, named) in [
        (
            "bnb",
            json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
            "`bitsandbytes`",
        ),
        ("hqq", json!({"quant_method": "hqq"}), "`hqq`"),
        ("none", json!({"bits": 8}), "no `quant_method`"),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        rejected(
            &dir,
            &[
                "the checkpoint is quantized",
                named,
                "tpc reads quant_method fp8",
                "unquantized release",
            ],
        );
    }
    // A null `quantization_config` is no quantization.
    let dir = edited(&scratch, "null", |o| {
        o.insert("quantization_config".into(), Value::Null);
    });
    load_model(&dir).unwrap();
}

#[test]
fn gptq_and_awq_checkpoints_are_read_with_their_groups_and_split_on_them() {
    let scratch = Scratch::new("int4");
    for (sub, config, format, block, act_order) in [
        (
            "gptq",
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
                   "sym": true, "checkpoint_format": "gptq", "lm_head": false,
                   "modules_in_block_to_quantize": null}),
            QuantFormat::Int4Gptq,
            [1, 128],
            false,
        ),
        (
            "gptq-act",
            json!({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": true}),
            QuantFormat::Int4Gptq,
            [1, 64],
            true,
        ),
        (
            "gptq-channel",
            json!({"quant_method": "gptq", "bits": 4, "group_size": -1}),
            QuantFormat::Int4Gptq,
            [1, 0],
            false,
        ),
        (
            "awq",
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
                   "version": "GEMM", "modules_to_not_convert": ["visual"]}),
            QuantFormat::Int4Awq,
            [1, 128],
            false,
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        let def = load(&dir);
        let q = family_of(&def).quantization.clone().expect("read");
        assert_eq!(
            (q.format, q.block, q.act_order),
            (format, block, act_order),
            "{sub}"
        );
        // Llama 3 8B: every split at tp 8 keeps groups of 128 whole (o_proj 4096 / 8 = 512
        // inputs, down_proj 14336 / 8 = 1792), and the report counts half a byte a weight.
        let plan = compile(&def, 8).unwrap().plan;
        let quantized: Vec<_> = plan.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .collect();
        assert_eq!(quantized.len(), 32 * 7, "{sub}");
        let elements: u64 = quantized.iter().map(|w| w.local_elements()).sum();
        let bytes: u64 = quantized.iter().map(|w| w.local_bytes()).sum();
        assert!(
            bytes > elements / 2 && bytes < elements / 2 + elements / 20,
            "{sub}: {bytes} bytes for {elements} elements"
        );
    }
    for (sub, config, named) in [
        (
            "bits",
            json!({"quant_method": "gptq", "bits": 3, "group_size": 128}),
            "3-bit weights are not read",
        ),
        (
            "v2",
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}),
            "`checkpoint_format` \"gptq_v2\" is not read",
        ),
        (
            "head",
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": true}),
            "its output head is quantized",
        ),
        (
            "dynamic",
            json!({"quant_method": "gptq", "bits": 4, "group_size": 128,
                   "dynamic": {"-:.*mlp.*": {}}}),
            "`dynamic`",
        ),
        (
            "group",
            json!({"quant_method": "awq", "bits": 4, "group_size": 100}),
            "`group_size` 100 is not -1 or a positive multiple of 8",
        ),
        (
            "marlin",
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}),
            "`version` marlin is not read",
        ),
        (
            "no-zero",
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": false}),
            "`zero_point: false` is not read",
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        rejected(&dir, &["`quantization_config`", named, "gptq (4-bit"]);
    }
}

#[test]
fn an_fp8_block_checkpoint_is_read_with_its_blocks_and_unconverted_modules() {
    let scratch = Scratch::new("fp8");
    let dir = edited(&scratch, "ok", |o| {
        o.insert(
            "quantization_config".into(),
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 64], "modules_to_not_convert": ["model.layers.0.mlp"]}),
        );
    });
    let q = family_of(&load(&dir))
        .quantization
        .clone()
        .expect("fp8 is read");
    assert_eq!(q.block, [128, 64]);
    assert_eq!(q.modules_to_not_convert, ["model.layers.0.mlp"]);
    // HF's default block when the config leaves it out.
    let dir = edited(&scratch, "default", |o| {
        o.insert("quantization_config".into(), json!({"quant_method": "fp8"}));
    });
    let q = family_of(&load(&dir)).quantization.clone().unwrap();
    assert_eq!(q.block, [128, 128]);
    for (sub, config, named) in [
        (
            "e5m2",
            json!({"quant_method": "fp8", "fmt": "e5m2"}),
            "`fmt` \"e5m2\" is not e4m3",
        ),
        (
            "static",
            json!({"quant_method": "fp8", "activation_scheme": "static"}),
            "needs stored activation scales",
        ),
        (
            "block",
            json!({"quant_method": "fp8", "weight_block_size": [0, 128]}),
            "`weight_block_size` [0,128] is not two positive block sizes",
        ),
        (
            "pattern",
            json!({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.*.mlp"]}),
            "is a pattern",
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        rejected(&dir, &["`quantization_config`", named, "tpc reads fp8"]);
    }
}

#[test]
fn compressed_tensors_per_channel_int8_and_fp8_are_read_and_other_schemes_refused() {
    let scratch = Scratch::new("compressed-tensors");
    let scheme = |format: &str, weights: Value, extra: Value| {
        let mut group = json!({"targets": ["Linear"], "weights": weights});
        if let (Some(g), Some(e)) = (group.as_object_mut(), extra.as_object()) {
            g.extend(e.clone());
        }
        json!({"quant_method": "compressed-tensors", "format": format,
               "ignore": ["lm_head"], "config_groups": {"group_0": group}})
    };
    let int8 = json!({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
                      "group_size": null, "dynamic": false});
    let fp8 = json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel"});
    for (sub, config, format) in [
        (
            "int8",
            scheme("int-quantized", int8.clone(), json!({})),
            QuantFormat::Int8,
        ),
        (
            "naive",
            scheme("naive-quantized", int8.clone(), json!({})),
            QuantFormat::Int8,
        ),
        (
            // W8A16: the same codes four to an int32.
            "w8a16",
            scheme("pack-quantized", int8.clone(), json!({})),
            QuantFormat::Int8,
        ),
        (
            "fp8",
            // W8A8 FP8 with dynamic per-token activations: the weights are what is stored.
            scheme(
                "float-quantized",
                fp8.clone(),
                json!({"input_activations": {"num_bits": 8, "type": "float", "dynamic": true, "strategy": "token"}}),
            ),
            QuantFormat::Fp8E4m3,
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        let q = family_of(&load(&dir)).quantization.clone().expect("read");
        assert_eq!((q.format, q.block), (format, [1, 0]), "{sub}");
        assert_eq!(q.scales, tpc::ir::quant::ScaleNames::Scale);
        assert_eq!(q.modules_to_not_convert, ["lm_head"]);
        // A scale per channel takes any split: every tp the heads allow compiles.
        for tp in [1, 2, 4] {
            compile(&load(&dir), tp).unwrap();
        }
    }
    let with = |key: &str, v: Value| {
        let mut w = int8.clone();
        w[key] = v;
        w
    };
    for (sub, config, named) in [
        (
            "packed-fp8",
            scheme("pack-quantized", fp8.clone(), json!({})),
            "fp8 e4m3 weights in `format` pack-quantized are not read",
        ),
        (
            "group",
            scheme("int-quantized", with("strategy", json!("group")), json!({})),
            "weight strategy `group`",
        ),
        (
            "int4",
            scheme("int-quantized", with("num_bits", json!(4)), json!({})),
            "int4 pack-quantized symmetric weights in `format` int-quantized are not read",
        ),
        (
            "asym",
            scheme("int-quantized", with("symmetric", json!(false)), json!({})),
            "is asymmetric",
        ),
        (
            "static",
            scheme(
                "int-quantized",
                int8.clone(),
                json!({"input_activations": {"num_bits": 8, "type": "int", "dynamic": false}}),
            ),
            "static activation scales",
        ),
        (
            "regex",
            json!({"quant_method": "compressed-tensors", "format": "int-quantized",
                   "ignore": ["re:.*mlp.gate$"],
                   "config_groups": {"g": {"targets": ["Linear"], "weights": int8.clone()}}}),
            "is a pattern",
        ),
        (
            "nogroups",
            json!({"quant_method": "compressed-tensors", "format": "int-quantized"}),
            "no `config_groups`",
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert("quantization_config".into(), config);
        });
        rejected(
            &dir,
            &[
                "`quantization_config` (compressed-tensors)",
                named,
                "tpc reads fp8",
            ],
        );
    }
}

/// llm-compressor's W4A16 (`pack-quantized` 4-bit integers): groups or channels, symmetric
/// or with zero points, group act order; the IR states which.
#[test]
fn compressed_tensors_pack_quantized_int4_is_read_with_its_groups_and_zero_points() {
    let scratch = Scratch::new("w4a16");
    for (sub, weights, format, block, act_order) in [
        (
            "sym",
            json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                   "group_size": 128, "actorder": null}),
            QuantFormat::Int4Packed { zero_points: false },
            [1, 128],
            false,
        ),
        (
            "asym-act",
            json!({"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group",
                   "group_size": 64, "actorder": "group"}),
            QuantFormat::Int4Packed { zero_points: true },
            [1, 64],
            true,
        ),
        (
            "channel-weight-order",
            json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "channel",
                   "actorder": "weight"}),
            QuantFormat::Int4Packed { zero_points: false },
            [1, 0],
            false,
        ),
    ] {
        let dir = edited(&scratch, sub, |o| {
            o.insert(
                "quantization_config".into(),
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}),
            );
        });
        let q = family_of(&load(&dir)).quantization.clone().expect("read");
        assert_eq!(
            (q.format, q.block, q.act_order),
            (format, block, act_order),
            "{sub}"
        );
        assert_eq!(q.scales, tpc::ir::quant::ScaleNames::Scale);
    }
}

#[test]
fn unsupported_values_are_named() {
    let scratch = Scratch::new("values");
    let dir = edited(&scratch, "act", |o| {
        o.insert("hidden_act".into(), json!("quick_gelu"));
    });
    rejected(&dir, &["activation `quick_gelu` is not supported"]);
    let dir = edited(&scratch, "dtype", |o| {
        o.insert("torch_dtype".into(), json!("float8_e4m3fn"));
    });
    rejected(&dir, &["dtype `float8_e4m3fn` is not supported"]);
    let dir = edited(&scratch, "rope", |o| {
        o.insert(
            "rope_scaling".into(),
            json!({"rope_type": "yarn", "factor": 4.0}),
        );
    });
    rejected(&dir, &["rope type `yarn` is not supported"]);
    let dir = edited(&scratch, "rope-factor", |o| {
        o.insert("rope_scaling".into(), json!({"rope_type": "linear"}));
    });
    rejected(&dir, &["rope scaling `linear` needs `factor`"]);
    let dir = edited(&scratch, "mlp-bias", |o| {
        o.insert("mlp_bias".into(), json!(true));
    });
    rejected(&dir, &["`mlp_bias: true` is not supported"]);
}

#[test]
fn inconsistent_shapes_fail_cleanly() {
    let scratch = Scratch::new("shapes");
    let dir = edited(&scratch, "kv", |o| {
        o.insert("num_key_value_heads".into(), json!(7));
    });
    // Read fine; the preset lowering names the constraint.
    load(&dir);
    let stderr = tpc_fails(["compile".as_ref(), dir.as_os_str()]);
    assert!(
        stderr.contains("num_attention_heads 32 must be a multiple of num_key_value_heads 7"),
        "{stderr}"
    );
    let stderr = tpc_fails(["import".as_ref(), dir.as_os_str()]);
    assert!(stderr.contains("num_key_value_heads 7"), "{stderr}");

    let mut g = fixture_json("gpt2");
    g.as_object_mut()
        .unwrap()
        .insert("tie_word_embeddings".into(), json!(false));
    let gdir = scratch.model_json("gpt2-untied", &g);
    let stderr = tpc_fails(["compile".as_ref(), gdir.as_os_str()]);
    assert!(stderr.contains("GPT-2 always ties its LM head"), "{stderr}");

    let mut g = fixture_json("gpt2");
    g.as_object_mut()
        .unwrap()
        .insert("n_embd".into(), json!(u64::MAX));
    let gdir = scratch.model_json("gpt2-huge", &g);
    let stderr = tpc_fails(["import".as_ref(), gdir.as_os_str()]);
    assert!(stderr.contains("too large"), "{stderr}");
}

#[test]
fn malformed_json_reports_line_and_column() {
    let scratch = Scratch::new("malformed");
    // A comma missing at the end of line 3: the error is at line 4, column 3.
    let dir = scratch.model_dir(
        "m",
        "{\n  \"model_type\": \"llama\",\n  \"hidden_size\": 4096\n  \"vocab_size\": 128256\n}\n",
    );
    let cfg = dir.join("config.json");
    let at = format!("{}:4:3:", cfg.display());
    rejected(&dir, &[&at, "expected `,` or `}`", "JSON"]);
    // Truncated file: the error is at the end.
    let dir = scratch.model_dir("t", "{\n  \"model_type\": \"llama\",\n");
    let at = format!("{}:3:0:", dir.join("config.json").display());
    rejected(&dir, &[&at, "EOF"]);
    // Valid JSON that is not an object.
    let dir = scratch.model_dir("a", "[1, 2, 3]\n");
    rejected(&dir, &["must hold a JSON object"]);
}

#[test]
fn a_directory_without_config_json_is_named() {
    let scratch = Scratch::new("empty-dir");
    let dir = scratch.0.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
    rejected(&dir, &[&dir.display().to_string(), "has no config.json"]);
}

#[test]
fn a_nonexistent_path_is_named() {
    let scratch = Scratch::new("missing");
    let path = scratch.0.join("no-such-model");
    let shown = path.display().to_string();
    let lib = load_model(&path).map(|_| ()).unwrap_err().to_string();
    assert!(
        lib.contains(&shown) && lib.contains("no such file or directory"),
        "{lib}"
    );
    let stderr = tpc_fails(["compile".as_ref(), path.as_os_str()]);
    assert!(
        stderr.contains(&format!("cannot read `{shown}`")),
        "{stderr}"
    );
    assert!(stderr.contains("no such file or directory"), "{stderr}");
    // `tpc import` refuses it before reading; it names the path.
    let stderr = tpc_fails(["import".as_ref(), path.as_os_str()]);
    assert!(stderr.contains(&shown), "{stderr}");
}

/// `tpc import` of a directory that does not exist says so.
#[test]
fn import_of_a_nonexistent_directory_says_it_is_missing() {
    let scratch = Scratch::new("import-missing");
    let path = scratch.0.join("no-such-model");
    let stderr = tpc_fails(["import".as_ref(), path.as_os_str()]);
    assert!(stderr.contains("no such file or directory"), "{stderr}");
}

/// A `.json` path that does not exist is a missing file, not a directory without config.json.
#[test]
fn a_nonexistent_config_json_path_is_reported_as_missing() {
    let scratch = Scratch::new("missing-json");
    for path in [
        scratch.0.join("no-such-model/config.json"),
        scratch.0.join("model.json"),
    ] {
        let msg = rejected(&path, &[&path.display().to_string()]);
        assert!(!msg.contains("directory has no config.json"), "{msg}");
        assert!(msg.contains("no such file"), "{msg}");
    }
}

/// A read error names its io cause once, even through `main`'s `{e:#}` chain.
#[test]
fn a_read_error_says_its_cause_once() {
    let scratch = Scratch::new("missing-once");
    let path = scratch.0.join("no-such-model");
    let stderr = tpc_fails(["compile".as_ref(), path.as_os_str()]);
    assert_eq!(
        stderr.matches("no such file or directory").count(),
        1,
        "{stderr}"
    );
}

// ---- sliding-window attention ----

/// The `sliding_window` tpc keeps for `name`'s config with `edit` applied.
fn window_of(
    scratch: &Scratch,
    name: &str,
    sub: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> Option<u64> {
    let mut j = fixture_json(name);
    edit(j.as_object_mut().unwrap());
    family_of(&load(&scratch.model_json(sub, &j))).sliding_window
}

#[test]
fn sliding_window_is_kept_only_where_it_limits_the_context() {
    let scratch = Scratch::new("window");
    // Mistral 7B: 4096 of 32768 positions.
    assert_eq!(
        family_of(&load(&fixture("mistral-7b"))).sliding_window,
        Some(4096)
    );
    assert_eq!(family_of(&preset("mistral-7b")).sliding_window, Some(4096));
    let set = |v: Value| {
        move |j: &mut serde_json::Map<String, Value>| {
            j.insert("sliding_window".into(), v);
        }
    };
    // Null, absent, or the whole context or more: nothing changes.
    assert_eq!(
        window_of(&scratch, "mistral-7b", "null", set(Value::Null)),
        None
    );
    assert_eq!(
        window_of(&scratch, "mistral-7b", "absent", |j| {
            j.remove("sliding_window");
        }),
        None
    );
    assert_eq!(
        window_of(&scratch, "mistral-7b", "all", set(json!(32768))),
        None
    );
    assert_eq!(
        window_of(&scratch, "mistral-7b", "more", set(json!(65536))),
        None
    );
    assert_eq!(
        window_of(&scratch, "mistral-7b", "less", set(json!(32767))),
        Some(32767)
    );
    // Switched off (Qwen2 style), even in a Mistral config.
    assert_eq!(
        window_of(&scratch, "mistral-7b", "off", |j| {
            j.insert("use_sliding_window".into(), json!(false));
        }),
        None
    );
    // Qwen2 7B says use_sliding_window: false; absent means false too (Qwen2Config's
    // default); true makes a smaller window count.
    assert_eq!(family_of(&load(&fixture("qwen2-7b"))).sliding_window, None);
    assert_eq!(
        window_of(&scratch, "qwen2-7b", "qwen-default", |j| {
            j.remove("use_sliding_window");
            j.insert("sliding_window".into(), json!(4096));
        }),
        None
    );
    assert_eq!(
        window_of(&scratch, "qwen2-7b", "qwen-on", |j| {
            j.insert("use_sliding_window".into(), json!(true));
            j.insert("sliding_window".into(), json!(4096));
        }),
        Some(4096)
    );
    // LlamaConfig has no window: a stray key changes nothing.
    assert_eq!(
        window_of(&scratch, "llama3-8b", "llama", set(json!(1024))),
        None
    );
    // A window of 0 is no attention at all.
    let mut j = fixture_json("mistral-7b");
    j["sliding_window"] = json!(0);
    rejected(&scratch.model_json("zero", &j), &["`sliding_window` 0"]);
}

/// The tiny llama-gqa checkpoint as a Mistral with an attention window of `window` tokens.
fn windowed_checkpoint(scratch: &Scratch, window: u64) -> PathBuf {
    let src = root().join("tests/fixtures/checkpoints/llama-gqa");
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut j: Value = serde_json::from_str(&text).unwrap();
    let o = j.as_object_mut().unwrap();
    o.insert("model_type".into(), json!("mistral"));
    o.insert("sliding_window".into(), json!(window));
    let dir = scratch.model_json(&format!("windowed-{window}"), &j);
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn a_windowed_model_compiles_but_runs_only_within_its_window() {
    let scratch = Scratch::new("window-run");
    let dir = windowed_checkpoint(&scratch, 8);
    let def = load(&dir);
    assert_eq!(family_of(&def).sliding_window, Some(8));
    // The split does not depend on the window: the plan is llama-gqa's, plus the window
    // it records for the runtime to enforce (a saved plan is checked too).
    let plain = load(&root().join("tests/fixtures/checkpoints/llama-gqa"));
    for tp in [1, 2] {
        let mut a = plan_of(&def, tp, "windowed");
        assert_eq!(a.attention_window, Some(8));
        a.attention_window = None;
        let b = plan_of(&plain, tp, "llama-gqa");
        assert_same_plan_but_name(&a, &b, &format!("windowed tp={tp}"));
    }
    let d = dir.to_str().unwrap();
    let o = tpc(["compile", d, "--tp", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Up to the window full causal attention is the window's computation: 7 + 1 = 8 runs and
    // gives the first token transformers generates for this checkpoint.
    let prompt = "3,71,249,130,12,188,64";
    let o = tpc([
        "run",
        d,
        "--tp",
        "2",
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        "1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "59");
    // One token more would attend past the window.
    let e = tpc_fails([
        "run",
        d,
        "--tp",
        "2",
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        "2",
    ]);
    for needle in [
        "sliding_window",
        "last 8 positions",
        "this one has 9",
        "--max-new-tokens",
    ] {
        assert!(e.contains(needle), "{needle:?} missing: {e}");
    }
    // verify runs prompt + 4 tokens: 8 prompt tokens do not fit, 4 do.
    let e = tpc_fails(["verify", d, "--tp", "2", "--prompt-len", "8"]);
    assert!(
        e.contains("sliding_window") && e.contains("this one has 12"),
        "{e}"
    );
    let o = tpc(["verify", d, "--tp", "2", "--prompt-len", "4"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The library says the same.
    assert!(def.check_executable(8).is_ok());
    assert!(def.check_executable(9).is_err());
    assert!(plain.check_executable(1 << 20).is_ok());
}

/// The mixture-of-experts configs' absent keys take their HF classes' defaults, and what
/// tpc cannot compute (OLMoE's `clip_qkv`) is refused by name.
#[test]
fn moe_configs_take_their_class_defaults_and_refuse_clip_qkv() {
    let scratch = Scratch::new("moe-defaults");
    let checkpoint = |name: &str| -> Value {
        let text = std::fs::read_to_string(
            root()
                .join("tests/fixtures/checkpoints")
                .join(name)
                .join("config.json"),
        )
        .unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let edits = std::cell::Cell::new(0);
    let family = |name: &str, edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut j = checkpoint(name);
        edit(j.as_object_mut().unwrap());
        edits.set(edits.get() + 1);
        let def = load(&scratch.model_json(&format!("{name}-{}", edits.get()), &j));
        family_of(&def).clone()
    };
    let drop = |key: &'static str| {
        move |o: &mut serde_json::Map<String, Value>| {
            assert!(o.remove(key).is_some(), "{key}");
        }
    };
    let moe = |c: FamilyConfig| *c.moe.unwrap();
    // Qwen2MoeConfig: 60 experts, 4 per token, 1408 features each, shared expert 5632,
    // q/k/v bias on.
    assert_eq!(family("qwen2-moe", &|_| {}).family, Family::Qwen2Moe);
    assert_eq!(
        moe(family("qwen2-moe", &drop("num_experts"))).num_experts,
        60
    );
    assert_eq!(
        moe(family("qwen2-moe", &drop("num_experts_per_tok"))).num_experts_per_tok,
        4
    );
    assert_eq!(
        moe(family("qwen2-moe", &drop("moe_intermediate_size"))).moe_intermediate_size,
        Some(1408)
    );
    assert_eq!(
        moe(family(
            "qwen2-moe",
            &drop("shared_expert_intermediate_size")
        ))
        .shared_expert_intermediate_size,
        Some(5632)
    );
    assert_eq!(
        family("qwen2-moe", &drop("qkv_bias")).attention_bias,
        Some(true)
    );
    let no_bias = family("qwen2-moe", &|o| {
        o.insert("qkv_bias".into(), json!(false));
    });
    assert_eq!(no_bias.attention_bias, Some(false));
    // Qwen3MoeConfig: 768 features per expert; OLMoE: intermediate_size, 64 experts, top 8.
    assert_eq!(
        moe(family("qwen3-moe", &drop("moe_intermediate_size"))).moe_intermediate_size,
        Some(768)
    );
    let olmoe = family("olmoe", &|_| {});
    assert_eq!(olmoe.family, Family::Olmoe);
    assert_eq!(moe(olmoe).moe_intermediate_size, None);
    assert_eq!(moe(family("olmoe", &drop("num_experts"))).num_experts, 64);
    assert_eq!(
        moe(family("olmoe", &drop("num_experts_per_tok"))).num_experts_per_tok,
        8
    );
    // Only the routed experts have no shared one outside Qwen2-MoE.
    assert_eq!(
        moe(family("olmoe", &|_| {})).shared_expert_intermediate_size,
        None
    );
    let mut j = checkpoint("olmoe");
    j.as_object_mut()
        .unwrap()
        .insert("clip_qkv".into(), json!(8.0));
    rejected(
        &scratch.model_json("olmoe-clip", &j),
        &["`clip_qkv` 8.0", "clip_qkv null"],
    );
}

#[test]
fn qwen3_32b_with_the_fp8_releases_quantization_compiles_as_the_fp8_preset() {
    // Qwen3-32B's config with the `quantization_config` of its FP8 release.
    let scratch = Scratch::new("qwen3-fp8");
    let mut j = fixture_json("qwen3-32b");
    j.as_object_mut().unwrap().insert(
        "quantization_config".into(),
        json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}),
    );
    let dir = scratch.model_json("hf", &j);
    let hf = load(&dir);
    let preset = load(&root().join("models/qwen3-32b-fp8.ron"));
    for tp in [1, 2, 3, 4, 6, 7, 8] {
        let a = compile(&hf, tp).unwrap().plan;
        let b = compile(&preset, tp).unwrap().plan;
        assert_same_plan_but_name(&a, &b, &format!("qwen3-32b fp8 tp={tp}"));
        // Every decoder linear, 7 per layer, is stored quantized.
        let quantized = a.ranks[0]
            .weights
            .iter()
            .filter(|w| w.quant.is_some())
            .count();
        assert_eq!(quantized, 64 * 7, "tp={tp}");
    }
    // tp 3 deals the MLP's 25600 columns in its 200 blocks of 128 (a 32nd, 800, would cut
    // them): 67/67/66 blocks, gate, up and down alike.
    let plan = compile(&hf, 3).unwrap().plan;
    for name in ["gate_proj", "up_proj", "down_proj"] {
        let tensor = format!("model.layers.5.mlp.{name}.weight");
        let real: Vec<u64> = plan
            .ranks
            .iter()
            .map(|r| {
                let w = r.weights.iter().find(|w| *w.tensor == *tensor).unwrap();
                assert!(w.ranges.iter().all(|g| g.offset % 128 == 0), "{tensor}");
                w.ranges.iter().map(|g| g.len).sum()
            })
            .collect();
        assert_eq!(real, [8576, 8576, 8448], "{tensor}");
    }
}

#[test]
fn a_preset_states_its_quantization_and_a_block_of_zero_is_refused() {
    let scratch = Scratch::new("ron-fp8");
    let preset = |block: &str| {
        let path = scratch.0.join(format!("fp8-{block}.ron"));
        let text = format!(
            "Preset(family: Llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, \
             num_attention_heads: 8, vocab_size: 100, \
             quantization: Some((format: Fp8E4m3, block: ({block}), modules_to_not_convert: [\"mlp.down_proj\"])))"
        );
        std::fs::write(&path, text).unwrap();
        load(&path)
    };
    let plan = compile(&preset("16, 16"), 2).unwrap().plan;
    let quantized: Vec<&str> = plan.ranks[0]
        .weights
        .iter()
        .filter(|w| w.quant.is_some())
        .map(|w| &*w.tensor)
        .collect();
    // Six of the layer's seven linears: down_proj is left unconverted.
    assert_eq!(quantized.len(), 6, "{quantized:?}");
    assert!(!quantized.iter().any(|t| t.contains("down_proj")));
    let e = compile(&preset("0, 16"), 2).err().unwrap().to_string();
    assert!(
        e.contains("block [0, 16] must be two sizes from 1 to"),
        "{e}"
    );
}
