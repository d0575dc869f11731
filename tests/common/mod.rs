//! Helpers shared by the integration tests: the reference checkpoints and HF's outputs for
//! them, the tolerances, a ragged batch. Included by the `runtime`, `cuda` and `mpi` test
//! targets (`#[path]`); a target that uses only part says so where it includes it.

use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use tpc::runtime::generate::Request;

/// The one tolerance for f32 parity with HF: ‖a − b‖ / ‖b‖ over all prompt logits.
pub const REL_TOL: f64 = 1e-4;

/// The bf16 compute tolerance: linear weights rounded to bf16 (8 mantissa bits), f32
/// accumulation, activations f32 or rounded to bf16 (`avx512bf16`, `amx`, the GPU's bf16
/// products), against HF's f32 logits of the f32 checkpoint.
pub const BF16_REL_TOL: f64 = 3e-2;

/// The mixture-of-experts reference checkpoints: `runtime::moe_parity` runs those tpc
/// reads; every backend and launcher test runs the dense ones ([`fixtures`]).
pub const MOE_FIXTURES: [&str; 4] = ["mixtral-moe", "olmoe", "qwen2-moe", "qwen3-moe"];
/// Quantized mixture-of-experts fixtures (`scripts/make_fp8_fixture.py`), checked on their own.
pub const QUANTIZED_MOE_FIXTURES: [&str; 1] = ["qwen3-moe-fp8"];
/// INT4 fixtures (`scripts/make_int4_fixtures.py`): their groups of 32 inputs allow tp 1 and
/// 2 only (in act order 1, 2, 4 and 8), fewer than the suites over [`fixtures`] take, so
/// `runtime::quant_int4` and `runtime::quant_packed` run them at every tp they allow.
pub const INT4_FIXTURES: [&str; 6] = [
    "llama-gqa-awq",
    "llama-gqa-gptq",
    "llama-gqa-gptq-act",
    "llama-gqa-w4a16",
    "llama-gqa-w4a16-asym",
    "llama-gqa-w4a16-asym-act",
];
/// `llama-gqa-int8`'s codes stored otherwise (W8A16): `runtime::quant_packed` checks they
/// give that fixture's bits at every tp, so the suites over [`fixtures`] run only that one.
pub const RESTORED_FIXTURES: [&str; 1] = ["llama-gqa-w8a16"];

/// The tiny dense HF reference checkpoints (`scripts/make_fixtures.py`), in a fixed order.
/// The fixture checkpoint `name` (`tests/fixtures/checkpoints/NAME`), which must exist.
pub fn fixture(name: &str) -> PathBuf {
    let dir = Path::new("tests/fixtures/checkpoints").join(name);
    assert!(
        dir.join("config.json").exists(),
        "no fixture {}",
        dir.display()
    );
    dir
}

pub fn fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("tests/fixtures/checkpoints")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .filter(|p| {
            !p.file_name().is_some_and(|n| {
                MOE_FIXTURES
                    .iter()
                    .chain(&QUANTIZED_MOE_FIXTURES)
                    .chain(&INT4_FIXTURES)
                    .chain(&RESTORED_FIXTURES)
                    .any(|m| n == *m)
            })
        })
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 7,
        "expected the seven reference checkpoints, found {dirs:?}"
    );
    dirs
}

/// What `scripts/make_fixtures.py` saved beside a checkpoint: HF's prompt, prefill logits
/// and greedy continuation.
pub struct Reference {
    pub prompt: Vec<i64>,
    pub logits: Vec<f32>,
    pub greedy: Vec<i64>,
}

pub fn read_reference(dir: &Path) -> Reference {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let i64s = |name: &str| -> Vec<i64> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Reference {
        prompt: i64s("prompt_ids"),
        logits,
        greedy: i64s("greedy_ids"),
    }
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        n += (y as f64).powi(2);
    }
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// Three prompts of different lengths and token limits, from the fixture's vocabulary.
pub fn ragged_requests(vocab: i64) -> Vec<Request> {
    let ids = |n: i64, salt: i64| (0..n).map(|i| (i * 37 + salt * 11 + 3) % vocab).collect();
    vec![
        Request {
            prompt: ids(7, 0),
            max_new_tokens: Some(6),
        },
        Request {
            prompt: ids(2, 1),
            max_new_tokens: Some(9),
        },
        Request {
            prompt: ids(11, 2),
            max_new_tokens: Some(1),
        },
    ]
}

/// `def` with one `tp_plan` override (`pattern` → `word`), for the fixtures whose weights
/// have Llama's names (the Llama and Qwen presets); `None` for the others.
pub fn with_llama_override(
    def: &tpc::frontend::ModelDef,
    pattern: &str,
    word: tpc::frontend::TpWord,
) -> Option<tpc::frontend::ModelDef> {
    use tpc::frontend::{Family, ModelDef};
    let mut over = def.clone();
    let ModelDef::Preset(p) = &mut over else {
        return None;
    };
    if !matches!(p.family, Family::Llama | Family::Qwen2 | Family::Qwen3) {
        return None;
    }
    p.tp_plan.insert(pattern.into(), word);
    Some(over)
}
