//! Regression tests for the "unclear or wrong messages" items of the second hardening round:
//! inputs that were accepted or explained badly now run as transformers would or are refused
//! with a message that says what is wrong with the input (exit 1, no panic).

use crate::cli::tpc;
use crate::hardening::refused;
use crate::scratch::Scratch;
use std::path::{Path, PathBuf};
use std::process::Output;

const CHECKPOINT: &str = "tests/fixtures/checkpoints/llama-gqa";
const PROMPT: &str = "3,71,249,130,12,188,64";

fn scratch(test: &str) -> Scratch {
    Scratch::new("messages", test)
}

/// Exit 0; returns stdout.
fn succeeded(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A copy of a fixture checkpoint folder that a test may edit.
fn copy_of(fixture: &str, dir: &Path) -> PathBuf {
    let to = dir.join("model");
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

/// The greedy tokens `tpc run --json` generates for the test prompt.
fn generated(model: &Path) -> Vec<i64> {
    let out = succeeded(&tpc(&[
        "run",
        model.to_str().unwrap(),
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--json",
    ]));
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    json["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

/// Replaces `"eos_token_id": null` in the copy's config.json.
fn set_config_eos(model: &Path, value: &str) {
    let path = model.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"eos_token_id\": null"), "{text}");
    std::fs::write(
        &path,
        text.replace(
            "\"eos_token_id\": null",
            &format!("\"eos_token_id\": {value}"),
        ),
    )
    .unwrap();
}

#[test]
fn generation_config_eos_stops_the_run_and_overrides_config_json() {
    let dir = scratch("eos");
    let model = copy_of(CHECKPOINT, &dir);
    let free = generated(&model);
    assert_eq!(free.len(), 8, "{free:?}");
    // The third greedy token as the generation file's eos, the second as config.json's: the
    // run must stop at the third (transformers' generate follows generation_config.json),
    // which the old union of both files did not (it stopped at the second).
    let (second, third) = (free[1], free[2]);
    assert!(
        !free[..2].contains(&third) && !free[..1].contains(&second),
        "{free:?}"
    );
    set_config_eos(&model, &second.to_string());
    std::fs::write(
        model.join("generation_config.json"),
        format!(r#"{{"_from_model_config": true, "eos_token_id": [{third}]}}"#),
    )
    .unwrap();
    assert_eq!(generated(&model), free[..3].to_vec());
    // Without the generation file's field, config.json's id stops the run.
    std::fs::write(model.join("generation_config.json"), "{}").unwrap();
    assert_eq!(generated(&model), free[..2].to_vec());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_eos_that_is_no_token_of_the_model_is_refused() {
    let dir = scratch("eos-bad");
    let model = copy_of(CHECKPOINT, &dir);
    for (value, names) in [
        ("250", "250"),
        ("[1, 18446744073709551615]", "18446744073709551615"),
        ("-1", "-1"),
        ("2.0", "2.0"),
        (r#""</s>""#, "</s>"),
    ] {
        std::fs::write(
            model.join("generation_config.json"),
            format!(r#"{{"eos_token_id": {value}}}"#),
        )
        .unwrap();
        let e = refused(&tpc(&[
            "run",
            model.to_str().unwrap(),
            "--prompt-ids",
            PROMPT,
        ]));
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id") && e.contains(names),
            "{value}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const NVSWITCH: &str = "models/hw/h100-sxm-nvswitch-8.ron";

/// The NVSwitch profile with one text replacement, written to `dir`.
fn profile_with(dir: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(NVSWITCH).unwrap();
    assert!(text.contains(from), "{from}");
    let path = dir.join(name);
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
    path
}

#[test]
fn absurd_or_misspelled_profile_figures_are_refused() {
    let dir = scratch("profiles");
    for (from, to, expect) in [
        // A subnormal bandwidth once priced every phase at `inf ms` (`null` in JSON).
        (
            "memory_bandwidth: 3.35e12",
            "memory_bandwidth: 5e-324",
            "memory_bandwidth is 5e-324",
        ),
        (
            "memory_bandwidth: 3.35e12",
            "memory_bandwidth: 0.0",
            "memory_bandwidth is 0",
        ),
        ("alpha_s: ", "alpha_s: -", "alpha_s is -"),
        (
            "peak_flops_bf16: 989.5e12",
            "peak_flops_bf16: 1e300",
            "peak_flops_bf16 is 1e300",
        ),
        (
            "compute_efficiency: 0.6",
            "compute_efficiency: 1e-300",
            "compute_efficiency is 1e-300",
        ),
        // A misspelled optional field was dropped and its default priced.
        (
            "devices: 8,",
            "devices: 8,\n    op_overhead: 1e-6,",
            "op_overhead",
        ),
        ("alpha_s: ", "latency_s: 1e-6, alpha_s: ", "latency_s"),
    ] {
        let hw = profile_with(&dir, "p.ron", from, to);
        for extra in [&[][..], &["--json"], &["--search"]] {
            let args = [
                &[
                    "simulate",
                    "models/tiny-llama.ron",
                    "--hw",
                    hw.to_str().unwrap(),
                ][..],
                extra,
            ]
            .concat();
            let e = refused(&tpc(&args));
            assert!(e.contains("p.ron") && e.contains(expect), "{to}: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_valid_profile_at_its_bounds_prices_finite_times() {
    let dir = scratch("bounds");
    let mut text = std::fs::read_to_string(NVSWITCH).unwrap();
    // The slowest figures a profile may give, at the longest workload.
    for (from, to) in [
        ("memory_bandwidth: 3.35e12", "memory_bandwidth: 1e6"),
        ("peak_flops_bf16: 989.5e12", "peak_flops_bf16: 1e6"),
        ("compute_efficiency: 0.6", "compute_efficiency: 0.001"),
        ("memory_efficiency: 0.8", "memory_efficiency: 0.001"),
    ] {
        assert!(text.contains(from), "{from}");
        text = text.replace(from, to);
    }
    let hw = dir.join("slow.ron");
    std::fs::write(&hw, text).unwrap();
    let out = succeeded(&tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--hw",
        hw.to_str().unwrap(),
        "--batch",
        "4096",
        "--prompt-len",
        "16777216",
        "--gen",
        "16777216",
        "--json",
    ]));
    assert!(!out.contains("null"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for phase in ["prefill", "decode_step"] {
        let t = v[phase]["time_s"].as_f64().unwrap();
        assert!(t.is_finite() && t > 0.0, "{v}");
    }
    let table = succeeded(&tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--hw",
        hw.to_str().unwrap(),
    ]));
    assert!(!table.contains("inf") && !table.contains("NaN"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rope_that_does_not_fit_the_heads_is_a_model_error() {
    let dir = scratch("rope");
    let text = std::fs::read_to_string("models/tiny-llama-explicit.ron").unwrap();
    for (from, to, expect) in [
        // k holds 2 heads of 8: a rope of 16 fits the whole k but not one rank's head.
        (
            "Rope(head_dim: 8, rotary_dim: 8",
            "Rope(head_dim: 16, rotary_dim: 16",
            "rope head_dim 16 does not fit the heads of 8",
        ),
        (
            "Attention(head_dim: 8)",
            "Attention(head_dim: 16)",
            "attention head_dim 16 does not fit the heads of 8",
        ),
        // k without a head structure: a split could cut inside a head.
        (
            "shape: [16, 64], groups: {0: Heads(count: 2, size: 8, replicable: true, kv_groups: 2)}),\n                Node(name: \"model.layers.{i}.self_attn.k_proj\"",
            "shape: [16, 64]),\n                Node(name: \"model.layers.{i}.self_attn.k_proj\"",
            "declares no head structure on dimension 0",
        ),
    ] {
        assert!(text.contains(from), "{from}");
        let model = dir.join("m.ron");
        std::fs::write(&model, text.replace(from, to)).unwrap();
        for tp in ["1", "2", "4"] {
            let e = refused(&tpc(&["compile", model.to_str().unwrap(), "--tp", tp]));
            assert!(
                e.contains("model `tiny-llama`") && e.contains(expect) && !e.contains("invalid graph"),
                "{to} at tp {tp}: {e}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sizes_whose_product_overflows_are_refused_plainly() {
    let max = u64::MAX.to_string();
    for (args, expect) in [
        (
            vec!["ranks", "--world", "2", "--tp", &max, "--pp", "3"],
            format!("--tp {max} is more than the world of 2 ranks"),
        ),
        (
            vec![
                "ranks", "--world", "64", "--tp", "8", "--pp", "4", "--dp", "4",
            ],
            "tp × pp × dp = 8 × 4 × 4 = 128 ranks is more than the world of 64 ranks".into(),
        ),
        (
            vec![
                "simulate",
                "models/tiny-llama.ron",
                "--hw",
                NVSWITCH,
                "--tp",
                &max,
                "--pp",
                "2",
            ],
            format!("--tp {max} --pp 2 needs more than 2^64 devices"),
        ),
    ] {
        let e = refused(&tpc(&args));
        assert!(e.contains(&expect), "{args:?}: {e}");
        // A saturated product is never printed as a figure.
        assert!(
            !e.contains(&format!("= {max}")) && !e.contains(&format!("needs {max}")),
            "{e}"
        );
    }
}

#[test]
fn search_over_a_million_devices_ranks_the_layouts_the_model_takes() {
    let dir = scratch("search");
    let hw = profile_with(&dir, "big.ron", "devices: 8,", "devices: 1048576,");
    let out = succeeded(&tpc(&[
        "simulate",
        "models/tiny-llama.ron",
        "--hw",
        hw.to_str().unwrap(),
        "--search",
        "--json",
    ]));
    let ranked: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut layouts: Vec<(u64, u64)> = ranked
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["tp"].as_u64().unwrap(), e["pp"].as_u64().unwrap()))
        .collect();
    layouts.sort();
    // 8 heads over 2 kv heads, 2 layers: every tp up to 8 (uneven ones deal the kv groups)
    // and pp 1, 2.
    let expected: Vec<(u64, u64)> = (1..=8).flat_map(|tp| [(tp, 1), (tp, 2)]).collect();
    assert_eq!(layouts, expected);
    let _ = std::fs::remove_dir_all(&dir);
}
