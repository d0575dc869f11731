//! Regression tests for the hardening issue: each input that once panicked, aborted, ran
//! without end, wrapped a size or lost a file now gets a clear refusal (exit 1, no panic),
//! or, for a closed pipe, a quiet exit 0.

use crate::cli::tpc;
use crate::scratch::Scratch;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const TINY: &str = "models/tiny-llama.ron";
const CHECKPOINT: &str = "tests/fixtures/checkpoints/llama-gqa";

fn scratch(test: &str) -> Scratch {
    Scratch::new("hardening", test)
}

/// Exit 1 with a message and no panic; returns stderr.
pub(crate) fn refused(o: &Output) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected a clean refusal: {e}");
    assert!(
        !e.contains("panicked") && !e.contains("RUST_BACKTRACE"),
        "{e}"
    );
    e
}

/// The tiny Llama preset with one text replacement, written to `dir`.
fn tiny_with(dir: &Path, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(TINY).unwrap();
    assert!(text.contains(from), "{from}");
    let path = dir.join(format!("m{}.ron", to.len() * 31 + from.len()));
    std::fs::write(&path, text.replace(from, to)).unwrap();
    path
}

#[test]
fn impossible_sizes_are_refused_before_anything_is_built() {
    let dir = scratch("sizes");
    for (from, to, expect) in [
        (
            "num_attention_heads: 8",
            "num_attention_heads: 0",
            "must be positive",
        ),
        (
            "num_hidden_layers: 2",
            "num_hidden_layers: 10000000",
            "limit is 4096",
        ),
        (
            "hidden_size: 64",
            "hidden_size: 1000000000",
            "limit is 16777216",
        ),
        (
            "intermediate_size: 128",
            "intermediate_size: 4611686018427387904",
            "limit is 16777216",
        ),
        // 2^32 heads once printed "43739.9B params" (a wrapped product).
        (
            "num_attention_heads: 8,\n    num_key_value_heads: 2",
            "num_attention_heads: 4294967296,\n    num_key_value_heads: 4294967296",
            "limit is 16777216",
        ),
    ] {
        let model = tiny_with(&dir, from, to);
        let e = refused(&tpc(&["compile", model.to_str().unwrap(), "--tp", "2"]));
        assert!(e.contains(expect), "{to}: {e}");
    }
}

#[test]
fn bad_float_attributes_are_refused() {
    let dir = scratch("floats");
    for (from, to, expect) in [
        ("norm_eps: 1e-5", "norm_eps: NaN", "norm_eps is NaN"),
        ("norm_eps: 1e-5", "norm_eps: inf", "norm_eps is inf"),
        ("norm_eps: 1e-5", "norm_eps: -1e-5", "norm_eps is -0.00001"),
        (
            "rope_theta: 10000.0",
            "rope_theta: -5.0",
            "rope_theta is -5",
        ),
        ("factor: 8.0", "factor: 0.0", "rope scaling factor is 0"),
    ] {
        let model = tiny_with(&dir, from, to);
        let e = refused(&tpc(&["compile", model.to_str().unwrap()]));
        assert!(e.contains(expect), "{to}: {e}");
    }
}

/// An explicit graph of one layer around `weight` (a 4×4 `w` under `Repeat(count: …)`).
fn graph_with(dir: &Path, name: &str, count: &str, groups: &str) -> PathBuf {
    let text = format!(
        r#"Graph(name: "g", dtype: F32, body: [
            Node(name: "ids", op: Input(kind: TokenIds)),
            Weight(name: "emb", shape: [16, 4]),
            Node(name: "x", op: Embedding(), inputs: ["ids", "emb"]),
            Repeat(count: {count}, carry: "h", init: "x", result: "y{{i}}", body: [
                Weight(name: "w{{i}}", shape: [4, 4], groups: {{{groups}}}),
                Node(name: "y{{i}}", op: Linear(), inputs: ["h", "w{{i}}"]),
            ]),
            Node(name: "out", op: Output(name: "logits"), inputs: ["h"]),
        ])"#
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn explicit_graphs_with_bad_counts_and_groups_are_refused() {
    let dir = scratch("graphs");
    // A repeat of 0 layers once compiled at tp=2^64-1 until the allocator gave up.
    let g = graph_with(&dir, "zero.ron", "0", "");
    for tp in ["18446744073709551615", "100000000", "2"] {
        let e = refused(&tpc(&["compile", g.to_str().unwrap(), "--tp", tp]));
        assert!(
            e.contains("outside 1..=4096") || e.contains("at most 1024"),
            "{e}"
        );
    }
    // A group on a dimension the weight lacks is the model's error, not "an invalid graph".
    let g = graph_with(&dir, "dim.ron", "1", "2: Heads(count: 2, size: 2)");
    let e = refused(&tpc(&["compile", g.to_str().unwrap(), "--tp", "2"]));
    assert!(e.contains("groups are given for dimension 2"), "{e}");
    assert!(!e.contains("produced an invalid graph"), "{e}");
    // Heads(count: 0) once divided by zero in the feasibility pass.
    let g = graph_with(&dir, "heads0.ron", "1", "0: Heads(count: 0, size: 4)");
    let e = refused(&tpc(&["compile", g.to_str().unwrap(), "--tp", "2"]));
    assert!(e.contains("head count is 0"), "{e}");
}

#[test]
fn huge_tp_is_refused_at_once() {
    for tp in ["18446744073709551615", "100000000", "2048"] {
        for cmd in ["compile", "bench"] {
            let e = refused(&tpc(&[cmd, TINY, "--tp", tp]));
            assert!(e.contains("at most 1024"), "{cmd} --tp {tp}: {e}");
        }
    }
}

#[test]
fn deep_nesting_gets_tpcs_own_message() {
    let dir = scratch("nesting");
    let mut groups = "Plain(padded: false)".to_string();
    for _ in 0..200 {
        groups = format!("Concat([{groups}])");
    }
    let path = dir.join("deep.ron");
    std::fs::write(
        &path,
        format!(
            r#"Graph(name: "x", body: [Node(name: "u", op: Unfuse(groups: {groups}, part: 0))])"#
        ),
    )
    .unwrap();
    let e = refused(&tpc(&["compile", path.to_str().unwrap()]));
    assert!(e.contains("nested deeper than tpc reads"), "{e}");
    assert!(!e.contains("serde_stacker"), "{e}");
}

/// Runs `args` with stdout read for `keep` bytes and then closed, as `| head -c` does;
/// stderr must hold nothing but the lines that begin with `said_before` (what the command
/// says before it writes, if anything).
fn with_reader_closing_after(
    args: &[&str],
    keep: usize,
    said_before: Option<&str>,
) -> std::process::ExitStatus {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = vec![0; keep];
    child.stdout.take().unwrap().read_exact(&mut buf).unwrap();
    // stdout is dropped here: the writer's next write fails with EPIPE.
    let out = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    match said_before {
        None => assert!(e.is_empty(), "a closed pipe is not an error: {e}"),
        Some(start) => assert!(
            e.lines().count() == 1 && e.starts_with(start),
            "a closed pipe is not an error: {e}"
        ),
    }
    out.status
}

#[test]
fn a_closed_pipe_ends_quietly_and_a_full_disk_is_an_error() {
    // Both print far more than a pipe buffer holds.
    let big = ["compile", "models/llama3-70b.ron", "--tp", "8", "--text"];
    assert_eq!(with_reader_closing_after(&big, 100, None).code(), Some(0));
    // A picture this large is also too large to read: that warning comes first, and then
    // nothing about the pipe.
    let dot = ["dot", "models/llama3-70b.ron", "--tp", "8", "--all-ranks"];
    let warned = Some("warning: the picture has ");
    assert_eq!(with_reader_closing_after(&dot, 100, warned).code(), Some(0));
    if !Path::new("/dev/full").exists() {
        println!("NOT RUN: /dev/full is missing on this system");
        return;
    }
    for args in [
        &["compile", TINY, "--tp", "2"][..],
        &[
            "run",
            CHECKPOINT,
            "--prompt-ids",
            "1,2",
            "--max-new-tokens",
            "2",
        ],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_tpc"))
            .args(args)
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let e = refused(&o);
        assert!(e.contains("No space left"), "{e}");
    }
}

#[test]
fn outputs_never_replace_inputs_and_are_checked_first() {
    let dir = scratch("outputs");
    let model = dir.join("m.ron");
    std::fs::copy(TINY, &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    let m = model.to_str().unwrap();
    for args in [
        &["compile", m, "-o", m][..],
        &["lower", m, "-o", m],
        &["dot", m, "-o", m],
    ] {
        let e = refused(&tpc(args));
        assert!(e.contains("is the input"), "{args:?}: {e}");
    }
    assert_eq!(std::fs::read(&model).unwrap(), before);
    // Two outputs of one command must differ.
    let plan = dir.join("p.ron");
    let p = plan.to_str().unwrap();
    let e = refused(&tpc(&["compile", m, "-o", p, "--dot", p]));
    assert!(e.contains("same file"), "{e}");
    // A missing folder is refused before compiling.
    let e = refused(&tpc(&["compile", m, "-o", "/nonexistent-tpc-dir/p.ron"]));
    assert!(e.contains("does not exist"), "{e}");
    // `import DIR -o DIR/config.json` would overwrite the config it reads.
    let hf = dir.join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(Path::new(CHECKPOINT).join(f), hf.join(f)).unwrap();
    }
    let config = hf.join("config.json");
    let before = std::fs::read(&config).unwrap();
    let e = refused(&tpc(&[
        "import",
        hf.to_str().unwrap(),
        "-o",
        config.to_str().unwrap(),
    ]));
    assert!(e.contains("refused"), "{e}");
    assert_eq!(std::fs::read(&config).unwrap(), before);
    // Writes replace a file whole: no temporary is left beside it.
    let o = tpc(&["compile", m, "--tp", "2", "-o", p]);
    assert!(o.status.success());
    let o = tpc(&["compile", m, "--tp", "2", "-o", p]);
    assert!(o.status.success());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// A copy of the fixture checkpoint with one file replaced by `bytes` (or a folder).
fn broken_checkpoint(dir: &Path, weights: Option<&[u8]>) -> PathBuf {
    let model = dir.join("ck");
    let _ = std::fs::remove_dir_all(&model);
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        Path::new(CHECKPOINT).join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    match weights {
        Some(b) => std::fs::write(model.join("model.safetensors"), b).unwrap(),
        None => std::fs::create_dir(model.join("model.safetensors")).unwrap(),
    }
    model
}

#[test]
fn broken_checkpoints_get_tpcs_own_messages() {
    let dir = scratch("checkpoints");
    let whole = std::fs::read(Path::new(CHECKPOINT).join("model.safetensors")).unwrap();
    let run = |model: &Path| {
        refused(&tpc(&[
            "run",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ]))
    };
    for (cut, expect) in [
        (whole.len() / 2, "truncated"),
        (100, "truncated"),
        (5, "truncated"),
    ] {
        let e = run(&broken_checkpoint(&dir, Some(&whole[..cut])));
        assert!(e.contains(expect), "{cut} bytes: {e}");
        assert!(!e.contains("MetadataIncompleteBuffer"), "{e}");
    }
    let e = run(&broken_checkpoint(&dir, None));
    assert!(e.contains("is a folder"), "{e}");
    assert!(!e.contains("No such device"), "{e}");
}

#[test]
fn an_index_may_not_point_outside_the_model_folder() {
    let dir = scratch("index");
    let outside = dir.join("elsewhere.safetensors");
    std::fs::copy(Path::new(CHECKPOINT).join("model.safetensors"), &outside).unwrap();
    let model = dir.join("m");
    std::fs::create_dir(&model).unwrap();
    std::fs::copy(
        Path::new(CHECKPOINT).join("config.json"),
        model.join("config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(&outside).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    for target in [
        "../elsewhere.safetensors".to_string(),
        outside.to_str().unwrap().to_string(),
    ] {
        let map: serde_json::Map<String, serde_json::Value> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .map(|k| (k.clone(), serde_json::Value::String(target.clone())))
            .collect();
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(
            model.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        let e = refused(&tpc(&[
            "run",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ]));
        assert!(e.contains("not inside the model folder"), "{target}: {e}");
    }
}

#[test]
fn nan_weights_stop_generation_and_name_the_first_op() {
    let dir = scratch("nan");
    let mut bytes = std::fs::read(Path::new(CHECKPOINT).join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let w = &header["model.layers.1.mlp.down_proj.weight"];
    assert_eq!(w["dtype"], "F32");
    let r = w["data_offsets"].as_array().unwrap();
    let (a, b) = (
        r[0].as_u64().unwrap() as usize,
        r[1].as_u64().unwrap() as usize,
    );
    for chunk in bytes[8 + n + a..8 + n + b].chunks_exact_mut(4) {
        chunk.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    let model = broken_checkpoint(&dir, Some(&bytes));
    let m = model.to_str().unwrap();
    for extra in [
        &[][..],
        &["--temperature", "0.7"],
        &["--tp", "2"],
        // Layer 1 is on the last pipeline stage.
        &["--pp", "2"],
        &["--tp", "2", "--pp", "2"],
    ] {
        let mut args = vec!["run", m, "--prompt-ids", "1,2,3", "--max-new-tokens", "3"];
        args.extend_from_slice(extra);
        let o = tpc(&args);
        let e = refused(&o);
        assert!(o.stdout.is_empty(), "no tokens are printed");
        assert!(e.contains("not finite"), "{extra:?}: {e}");
        assert!(
            e.contains("`model.layers.1.mlp.down_proj` (linear, layer 1)"),
            "{extra:?}: {e}"
        );
    }
}

/// `MemAvailable` of /proc/meminfo in KiB (0 where there is none).
fn mem_available_kib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_run_that_cannot_fit_in_memory_is_refused_before_allocating() {
    // Llama 3.1 405B in bf16 needs about 756 GiB for the weights alone.
    let available_kib = mem_available_kib();
    if available_kib == 0 || available_kib > 700 << 20 {
        println!("NOT RUN: this host has no MemAvailable or more than 700 GiB of it");
        return;
    }
    let e = refused(&tpc(&["bench", "models/llama3.1-405b.ron", "--tp", "8"]));
    assert!(
        e.contains("needs at least") && e.contains("available"),
        "{e}"
    );
}

#[test]
fn data_parallel_replicas_that_cannot_fit_in_memory_are_refused_before_allocating() {
    // 64 copies of Llama-3-8B's 16 GB of bf16 weights: about 1 TB.
    let available_kib = mem_available_kib();
    if available_kib == 0 || available_kib > 900 << 20 {
        println!("NOT RUN: this host has no MemAvailable or more than 900 GiB of it");
        return;
    }
    let e = refused(&tpc(&[
        "bench",
        "models/llama3-8b.ron",
        "--dp",
        "64",
        "--batch",
        "64",
    ]));
    assert!(
        e.contains("needs at least") && e.contains("available"),
        "{e}"
    );
}

#[test]
fn compute_threads_the_system_refuses_are_an_error() {
    // 1024 thread stacks of 2 MiB cannot fit in 1.5 GB of address space.
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 1500000 && exec {} run {CHECKPOINT} --prompt-ids 1,2 --max-new-tokens 2 --threads-per-rank 1024",
            env!("CARGO_BIN_EXE_tpc")
        ))
        .output()
        .unwrap();
    let e = refused(&o);
    assert!(
        e.contains("refused to start its 1024 compute threads"),
        "{e}"
    );
}

/// Logits that turn non-finite at a decode step (every embedding row but the prompt's is
/// NaN) stop greedy decoding and top-k sampling alike, whether the ranks gather the logits
/// or exchange candidates, and name the decode step and the op.
#[test]
fn nan_logits_at_a_decode_step_stop_every_exchange() {
    let dir = scratch("nan-decode");
    let mut bytes = std::fs::read(Path::new(CHECKPOINT).join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let w = &header["model.embed_tokens.weight"];
    assert_eq!(w["dtype"], "F32");
    let width = w["shape"][1].as_u64().unwrap() as usize;
    let a = 8 + n + w["data_offsets"][0].as_u64().unwrap() as usize;
    let prompt = [1usize, 2, 3];
    for row in (0..250).filter(|r| !prompt.contains(r)) {
        let at = a + row * width * 4;
        for chunk in bytes[at..at + width * 4].chunks_exact_mut(4) {
            chunk.copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    let model = broken_checkpoint(&dir, Some(&bytes));
    let m = model.to_str().unwrap();
    let sample = ["--temperature", "0.7", "--top-k", "5", "--seed", "1"];
    let staged = [
        "--pp",
        "2",
        "--temperature",
        "0.7",
        "--top-k",
        "5",
        "--seed",
        "1",
    ];
    for (tp, extra) in [
        ("1", &[][..]),
        ("2", &[][..]),
        ("1", &sample[..]),
        ("2", &sample[..]),
        ("4", &sample[..]),
        // The embedding is on the first pipeline stage: a stage the last one told to
        // recompute finds the origin.
        ("1", &["--pp", "2"][..]),
        ("2", &staged[..]),
    ] {
        for gather in [false, true] {
            let mut args = vec!["run", m, "--tp", tp, "--prompt-ids", "1,2,3"];
            args.extend_from_slice(&["--max-new-tokens", "40"]);
            args.extend_from_slice(extra);
            if gather {
                args.push("--gather-logits");
            }
            let o = tpc(&args);
            let e = refused(&o);
            assert!(e.contains("not finite"), "{args:?}: {e}");
            assert!(e.contains("decode step"), "{args:?}: {e}");
            assert!(e.contains("embed_tokens"), "{args:?}: {e}");
        }
    }
}
