//! Inputs that are not what they seem (issue 35, second hardening round): a FIFO or a
//! device where a file should be, an index that reaches outside the model folder through a
//! linked subfolder, a checkpoint cut short while a run reads it, and sizes from flags that
//! would build more than any machine holds. Each is refused with exit 1 and a message,
//! never a hang, a signal or an abort.

use crate::scratch::Scratch;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const CHECKPOINT: &str = "tests/fixtures/checkpoints/llama-gqa";

/// How long a command may run before the test calls it a hang: far more than any of these
/// takes, so that only a command that waits forever reaches it.
const HANG: Duration = Duration::from_secs(120);

fn scratch(test: &str) -> Scratch {
    Scratch::new("inputs", test)
}

/// A running `tpc` whose stderr goes to a file in `dir`.
fn spawn(dir: &Path, args: &[&str]) -> (std::process::Child, PathBuf) {
    let err = dir.join(format!("stderr-{}", args.join(" ").len()));
    let child = Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("tpc runs");
    (child, err)
}

/// Waits for `child`, killing it (and failing) if it runs past [`HANG`].
fn finish(mut child: std::process::Child, args: &[&str]) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tpc {args:?} still ran after {HANG:?}: it waits on an input");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `tpc args` in `dir` and returns its stderr, which must come with exit 1 (no
/// signal, no panic).
fn refused(dir: &Path, args: &[&str]) -> String {
    let (child, err) = spawn(dir, args);
    let status = finish(child, args);
    let e = std::fs::read_to_string(err).unwrap();
    assert_eq!(
        status.code(),
        Some(1),
        "tpc {args:?}: expected a clean refusal, got {status:?}: {e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    e
}

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// A model folder in `dir/name` with the fixture's files, except those in `skip`.
fn model_folder(dir: &Path, name: &str, skip: &[&str]) -> PathBuf {
    let model = dir.join(name);
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        if !skip.contains(&f) {
            std::fs::copy(Path::new(CHECKPOINT).join(f), model.join(f)).unwrap();
        }
    }
    model
}

/// `model.safetensors.index.json` in `model`, mapping every tensor of the fixture to `file`.
fn index_to(model: &Path, file: &str) {
    let bytes = std::fs::read(Path::new(CHECKPOINT).join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .map(|k| (k.clone(), serde_json::Value::String(file.into())))
        .collect();
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    std::fs::write(
        model.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
}

#[test]
fn a_fifo_or_a_device_as_an_input_is_refused_not_waited_on() {
    let dir = scratch("fifo");
    let run = |model: &Path, extra: &[&str]| {
        let mut args = vec!["run", model.to_str().unwrap()];
        match extra {
            [] => args.extend(["--prompt-ids", "1,2"]),
            _ => args.extend_from_slice(extra),
        }
        refused(&dir, &args)
    };
    let fifo_msg = "a FIFO (named pipe), not a regular file";
    // The weights, the config and the tokenizer (for a text prompt) of a model folder.
    for (file, extra) in [
        ("model.safetensors", &[][..]),
        ("config.json", &[]),
        ("tokenizer.json", &["--prompt", "hello"]),
    ] {
        let model = model_folder(&dir, &format!("m-{file}"), &[file]);
        mkfifo(&model.join(file));
        let e = run(&model, extra);
        assert!(e.contains(fifo_msg) && e.contains(file), "{file}: {e}");
    }
    // A shard that the index names: a FIFO in the folder, and /dev/zero through a link
    // (a link to a file is fine, the Hugging Face cache is made of them).
    let model = model_folder(&dir, "m-index", &["model.safetensors"]);
    mkfifo(&model.join("shard.safetensors"));
    index_to(&model, "shard.safetensors");
    let e = run(&model, &[]);
    assert!(
        e.contains(fifo_msg) && e.contains("shard.safetensors"),
        "{e}"
    );
    std::os::unix::fs::symlink("/dev/zero", model.join("zero.safetensors")).unwrap();
    index_to(&model, "zero.safetensors");
    let e = run(&model, &[]);
    assert!(e.contains("a character device, not a regular file"), "{e}");
    // Files named by flags: prompts, a plan, a hardware profile, a model definition.
    let fifo = dir.join("fifo.ron");
    mkfifo(&fifo);
    let f = fifo.to_str().unwrap();
    for args in [
        &["run", CHECKPOINT, "--prompts", f][..],
        &["run", CHECKPOINT, "--plan", f, "--prompt-ids", "1,2"],
        &["simulate", "models/tiny-llama.ron", "--hw", f],
        &["compile", f],
    ] {
        let e = refused(&dir, args);
        assert!(e.contains(fifo_msg), "{args:?}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_index_may_not_reach_outside_the_model_folder_through_a_linked_subfolder() {
    let dir = scratch("linked");
    let outside = dir.join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::copy(
        Path::new(CHECKPOINT).join("model.safetensors"),
        outside.join("model.safetensors"),
    )
    .unwrap();
    let model = model_folder(&dir, "m", &["model.safetensors"]);
    std::os::unix::fs::symlink(&outside, model.join("sub")).unwrap();
    index_to(&model, "sub/model.safetensors");
    let m = model.to_str().unwrap();
    let e = refused(&dir, &["run", m, "--prompt-ids", "1,2"]);
    assert!(e.contains("not inside the model folder"), "{e}");
    // A real subfolder is inside; so is a file that is a link (as in the Hugging Face
    // cache, where each file links into a blob store outside the snapshot folder).
    std::fs::remove_file(model.join("sub")).unwrap();
    std::fs::create_dir(model.join("sub")).unwrap();
    std::os::unix::fs::symlink(
        outside.join("model.safetensors"),
        model.join("sub/model.safetensors"),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(["run", m, "--prompt-ids", "1,2", "--max-new-tokens", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Llama checkpoint of zeros, about 90 MB of f32 (loading it takes far longer than the
/// test needs to notice that the run opened it), and where its header ends.
fn large_checkpoint(dir: &Path) -> (PathBuf, u64) {
    let model = dir.join("large");
    std::fs::create_dir_all(&model).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(CHECKPOINT).join("config.json")).unwrap(),
    )
    .unwrap();
    let (hidden, inter, layers, vocab, kv) = (512u64, 1536u64, 4u64, 8192u64, 2u64);
    let head_dim = hidden / 8;
    for (k, v) in [
        ("hidden_size", hidden),
        ("intermediate_size", inter),
        ("num_hidden_layers", layers),
        ("vocab_size", vocab),
        ("num_attention_heads", 8),
        ("num_key_value_heads", kv),
        ("head_dim", head_dim),
    ] {
        config[k] = v.into();
    }
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<u64>)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, hidden])];
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for (name, shape) in [
            ("input_layernorm.weight", vec![hidden]),
            ("self_attn.q_proj.weight", vec![hidden, hidden]),
            ("self_attn.k_proj.weight", vec![kv * head_dim, hidden]),
            ("self_attn.v_proj.weight", vec![kv * head_dim, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, hidden]),
            ("post_attention_layernorm.weight", vec![hidden]),
            ("mlp.gate_proj.weight", vec![inter, hidden]),
            ("mlp.up_proj.weight", vec![inter, hidden]),
            ("mlp.down_proj.weight", vec![hidden, inter]),
        ] {
            tensors.push((format!("{p}{name}"), shape));
        }
    }
    tensors.push(("model.norm.weight".into(), vec![hidden]));
    tensors.push(("lm_head.weight".into(), vec![vocab, hidden]));
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape) in &tensors {
        let bytes = 4 * shape.iter().product::<u64>();
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": "F32", "shape": shape, "data_offsets": [at, at + bytes] }),
        );
        at += bytes;
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut file = std::fs::File::create(model.join("model.safetensors")).unwrap();
    use std::io::Write;
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(header.as_bytes()).unwrap();
    // Zeros without writing them: the length is what matters.
    let header_end = 8 + header.len() as u64;
    file.set_len(header_end + at).unwrap();
    (model, header_end)
}

/// Whether process `pid` has `file` open.
fn has_open(pid: u32, file: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == file))
}

#[test]
fn a_checkpoint_cut_short_while_a_run_loads_it_is_an_error_not_a_signal() {
    let dir = scratch("cut");
    let (model, header_end) = large_checkpoint(&dir);
    let weights = model.join("model.safetensors");
    let canonical = weights.canonicalize().unwrap();
    let m = model.to_str().unwrap();
    let args = ["run", m, "--prompt-ids", "1,2", "--max-new-tokens", "2"];
    let (mut child, err) = spawn(&dir, &args);
    // As soon as the run has the file open, its data goes (the header stays).
    let start = Instant::now();
    while !has_open(child.id(), &canonical) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "tpc exited before it opened the checkpoint: {}",
            std::fs::read_to_string(&err).unwrap()
        );
        assert!(
            start.elapsed() < HANG,
            "tpc never opened {}",
            weights.display()
        );
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(header_end)
        .unwrap();
    let status = finish(child, &args);
    let e = std::fs::read_to_string(&err).unwrap();
    assert_eq!(
        status.signal(),
        None,
        "killed by a signal with {:?} on stderr",
        e
    );
    assert_eq!(status.code(), Some(1), "{e}");
    // Cut after the header was read (as good as always): the change is named. Cut between
    // the open and the header's read: the file reads as truncated.
    let changed = format!(
        "the checkpoint `{}` changed while it was being read",
        weights.display()
    );
    assert!(e.contains(&changed) || e.contains("it is truncated"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `MemAvailable` of /proc/meminfo in bytes (`None` where there is none).
fn mem_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[test]
fn sizes_from_flags_are_checked_before_anything_is_built_from_them() {
    let dir = scratch("sizes");
    // 4096 prompts of 2^20 tokens were 32 GiB of token ids, built before the model's 256
    // positions were looked at: an abort where that memory was not there.
    let e = refused(
        &dir,
        &[
            "bench",
            "models/tiny-llama.ron",
            "--batch",
            "4096",
            "--prompt-len",
            "1048576",
        ],
    );
    assert!(
        e.contains("--prompt-len 1048576 and --max-new-tokens 16 need 1048591 positions")
            && e.contains("has 256 (max_position_embeddings): lower --prompt-len to at most 241"),
        "{e}"
    );
    // verify generates 4 tokens of its own; the message once named `run`'s flag.
    let e = refused(
        &dir,
        &[
            "verify",
            "models/tiny-llama.ron",
            "--tp",
            "2",
            "--prompt-len",
            "1048576",
        ],
    );
    assert!(
        e.contains("the 4 tokens verify generates")
            && e.contains("lower --prompt-len to at most 253"),
        "{e}"
    );
    // Within the positions of a long-context model, too many tokens for any host.
    let e = refused(
        &dir,
        &[
            "bench",
            "models/llama3.1-405b.ron",
            "--batch",
            "4096",
            "--prompt-len",
            "131072",
            "--max-new-tokens",
            "1",
        ],
    );
    assert!(
        e.contains("--batch 4096 × --prompt-len 131072 = 536870912 prompt tokens; one run builds at most 67108864"),
        "{e}"
    );
    // 64 ranks with three 1 GiB buffers each (and the communicator's), where the host has
    // less than that.
    let comm = [
        "bench-comm",
        "--tp",
        "64",
        "--to-log2",
        "30",
        "--iters",
        "1",
    ];
    match mem_available() {
        Some(m) if m < 384 << 30 => {
            let e = refused(&dir, &comm);
            assert!(
                e.contains(
                    "64 ranks with messages of 2^30 bytes: about 384.0 GiB of memory needed"
                ) && e.contains("lower --to-log2 or --tp"),
                "{e}"
            );
        }
        _ => println!(
            "NOT RUN: bench-comm's memory check (this host has 384 GiB available, or does not say)"
        ),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
