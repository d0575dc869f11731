//! The CUDA backend on a GPU (feature `cuda`): every reference checkpoint at every valid tp
//! in {1, 2, 4, 8}, all ranks on GPU 0 (the host communicator between them), reproduces HF's
//! prefill logits within the f32 tolerance and its greedy tokens; bf16 compute stays within
//! the bf16 tolerance. Where no driver is present these print a skip line (a failure with
//! `TPC_REQUIRE_GPU` set, as `scripts/device_check.sh` sets it), and `--device cuda` is
//! checked to be a clear error instead.
#![cfg(feature = "cuda")]

use crate::common;
use crate::emulator;
use common::{fixtures, read_reference, rel_error, with_llama_override, BF16_REL_TOL, REL_TOL};
use std::path::Path;

use std::process::Command;
use tpc::frontend::load::load_model;
use tpc::frontend::TpWord;
use tpc::ir::{ExpertSplit, Op};
use tpc::passes::ShardOptions;
use tpc::pipeline::{compile, compile_with};
use tpc::plan::Plan;
use tpc::runtime::cuda::probe::{require, Library};
use tpc::runtime::executor::weight_uses;
use tpc::runtime::generate::{ComputeDtype, Device, Request, RunOptions};
use tpc::runtime::run::{run, run_batch};
use tpc::runtime::weights::Checkpoint;

/// Whether a GPU can be used here; prints why not.
pub(super) fn gpu_present(test: &str) -> bool {
    let why = match require(Library::Driver) {
        Ok(()) => match tpc::runtime::cuda::device::device_count() {
            Ok(n) if n > 0 => return true,
            Ok(_) => "the driver sees no GPU".to_string(),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    assert!(
        std::env::var_os("TPC_REQUIRE_GPU").is_none(),
        "TPC_REQUIRE_GPU is set but no GPU can be used: {why}"
    );
    eprintln!("SKIP {test}: {why}");
    false
}

#[test]
fn without_a_driver_device_cuda_is_a_clear_error() {
    if require(Library::Driver).is_ok() {
        eprintln!("SKIP without_a_driver_device_cuda_is_a_clear_error: a driver is present");
        return;
    }
    let dir = fixtures().into_iter().next().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args([
            "run",
            dir.to_str().unwrap(),
            "--tp",
            "2",
            "--device",
            "cuda",
        ])
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("libcuda") && err.contains("not found"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Every fixture at each of `tps` that splits it, with each of `dtypes` (and its tolerance),
/// ranks on `gpus`: HF's prefill logits within the tolerance, and its greedy tokens in f32.
/// One report line per run.
fn every_fixture_matches_hf(
    tps: &[u64],
    gpus: &[usize],
    dtypes: &[(ComputeDtype, f64)],
) -> Vec<String> {
    let mut report = Vec::new();
    for dir in fixtures() {
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for &tp in tps {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            for &(dtype, tol) in dtypes {
                let opts = RunOptions {
                    device: Device::Cuda(gpus.to_vec()),
                    dtype,
                    max_new_tokens: reference.greedy.len(),
                    ..Default::default()
                };
                let what = format!("{} tp={tp} {dtype:?} on GPUs {gpus:?}", dir.display());
                let out = run(&compiled.plan, &ckpt, &reference.prompt, &opts)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let err = rel_error(&out.prompt_logits.data, &reference.logits);
                report.push(format!("{what}: rel err {err:.2e}"));
                assert!(err <= tol, "{what}: relative error {err:.3e} > {tol}");
                if dtype == ComputeDtype::F32 {
                    assert_eq!(out.generated, reference.greedy, "{what}: greedy tokens");
                }
            }
        }
    }
    report
}

#[test]
fn every_fixture_on_one_gpu_matches_hf_at_every_valid_tp() {
    if !gpu_present("every_fixture_on_one_gpu_matches_hf_at_every_valid_tp") {
        return;
    }
    let dtypes = [
        (ComputeDtype::F32, REL_TOL),
        (ComputeDtype::Bf16, BF16_REL_TOL),
    ];
    let report = every_fixture_matches_hf(&[1, 2, 3, 4, 8], &[0], &dtypes);
    eprintln!("{}", report.join("\n"));
}

/// Ranks on two GPUs: at tp=2 each rank has its own GPU and the group all-reduces through
/// NCCL; at tp=3 and 4 ranks share GPUs and the group goes through the host communicator
/// (tp 3 deals the heads unevenly).
/// Every fixture, f32, against HF's logits and tokens. Skips with fewer than two GPUs.
#[test]
fn every_fixture_on_two_gpus_matches_hf() {
    if !gpu_present("every_fixture_on_two_gpus_matches_hf") {
        return;
    }
    let count = tpc::runtime::cuda::device::device_count().unwrap();
    if count < 2 {
        eprintln!("SKIP every_fixture_on_two_gpus_matches_hf: {count} GPU");
        return;
    }
    let report = every_fixture_matches_hf(&[2, 3, 4], &[0, 1], &[(ComputeDtype::F32, REL_TOL)]);
    eprintln!("{}", report.join("\n"));
}

/// The mixture-of-experts checkpoints (Mixtral; Qwen2-MoE with its gated shared expert;
/// Qwen3-MoE with a dense layer among its sparse ones; OLMoE with whole-projection q/k
/// norms), with the experts split by features (`--moe tensor`) and dealt whole (`--moe
/// expert`).
const MOE_CASES: [&str; 4] = common::MOE_FIXTURES;
const MOE_SPLITS: [ExpertSplit; 2] = [ExpertSplit::Tensor, ExpertSplit::Expert];

/// Every case of [`MOE_CASES`] with each split at each of `tps`, with each of `dtypes` (and
/// its tolerance), ranks on `gpus`: HF's prefill logits within the tolerance, and its greedy
/// tokens in f32. One report line per run.
fn moe_fixtures_match_hf(
    tps: &[u64],
    gpus: &[usize],
    dtypes: &[(ComputeDtype, f64)],
) -> Vec<String> {
    let mut report = Vec::new();
    for case in MOE_CASES {
        let dir = Path::new("tests/fixtures/checkpoints").join(case);
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for split in MOE_SPLITS {
            for &tp in tps {
                let options = ShardOptions {
                    moe: Some(split),
                    ..Default::default()
                };
                let plan = compile_with(&def, tp, options)
                    .unwrap_or_else(|e| panic!("{case} --moe {} tp={tp}: {e}", split.word()))
                    .plan;
                for &(dtype, tol) in dtypes {
                    let what = format!(
                        "{case} --moe {} tp={tp} {dtype:?} on GPUs {gpus:?}",
                        split.word()
                    );
                    let opts = RunOptions {
                        device: Device::Cuda(gpus.to_vec()),
                        dtype,
                        max_new_tokens: reference.greedy.len(),
                        ..Default::default()
                    };
                    let out = run(&plan, &ckpt, &reference.prompt, &opts)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let err = rel_error(&out.prompt_logits.data, &reference.logits);
                    report.push(format!("{what}: rel err {err:.2e}"));
                    assert!(err <= tol, "{what}: relative error {err:.3e} > {tol}");
                    if dtype == ComputeDtype::F32 {
                        assert_eq!(out.generated, reference.greedy, "{what}: greedy tokens");
                    }
                }
            }
        }
    }
    report
}

/// Mixture-of-experts layers on one GPU: the router on the host, one product per chosen
/// expert, the weighted sum in `kernels/moe.cu`; at tp 2 and 3 the ranks share the GPU, and
/// tp 3 deals the 8 experts 3/3/2 (each rank's columns of the routing cut unevenly); f32, and
/// bf16 linear weights within the bf16 tolerance.
#[test]
fn moe_fixtures_on_one_gpu_match_hf_with_both_splits() {
    if !gpu_present("moe_fixtures_on_one_gpu_match_hf_with_both_splits") {
        return;
    }
    let dtypes = [
        (ComputeDtype::F32, REL_TOL),
        (ComputeDtype::Bf16, BF16_REL_TOL),
    ];
    let report = moe_fixtures_match_hf(&[1, 2, 3], &[0], &dtypes);
    eprintln!("{}", report.join("\n"));
}

/// Experts dealt over two data-parallel replicas (`--dp 2 --ep`) on one GPU: each replica's
/// ranks hold half of their experts and the replicas swap the routed rows at every MoE layer
/// (through the host); the replica with the shorter request keeps answering the other. HF's
/// prefill logits and greedy tokens for both sequences, f32, tp 1 (`--moe expert`) and tp 2
/// (`--moe tensor`).
#[test]
fn moe_experts_over_replicas_on_one_gpu_match_hf() {
    if !gpu_present("moe_experts_over_replicas_on_one_gpu_match_hf") {
        return;
    }
    let mut report = Vec::new();
    for case in MOE_CASES {
        let dir = Path::new("tests/fixtures/checkpoints").join(case);
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let n = reference.greedy.len();
        let requests = [n, 2].map(|new| Request {
            prompt: reference.prompt.clone(),
            max_new_tokens: Some(new),
        });
        for (tp, split) in [(1, ExpertSplit::Expert), (2, ExpertSplit::Tensor)] {
            let options = ShardOptions {
                moe: Some(split),
                ..Default::default()
            };
            let plan = compile_with(&def, tp, options).unwrap().plan;
            let opts = RunOptions {
                device: Device::Cuda(vec![0]),
                expert_parallel: true,
                ..Default::default()
            };
            let what = format!("{case} --moe {} tp={tp} --dp 2 --ep on GPU 0", split.word());
            let out = tpc::runtime::replicas::run_replicas(&plan, &ckpt, &requests, &opts, 2)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for (s, new) in out.sequences.iter().zip([n, 2]) {
                let err = rel_error(&s.prompt_logits.data, &reference.logits);
                report.push(format!("{what}, {new} tokens: rel err {err:.2e}"));
                assert!(err <= REL_TOL, "{what}: relative error {err:.3e}");
                assert_eq!(
                    s.generated,
                    reference.greedy[..new],
                    "{what}: greedy tokens"
                );
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// Mixture-of-experts layers at tp 2 with a GPU per rank (the layer's all-reduce through
/// NCCL). Skips with fewer than two GPUs.
#[test]
fn moe_fixtures_on_two_gpus_match_hf() {
    if !gpu_present("moe_fixtures_on_two_gpus_match_hf") {
        return;
    }
    let count = tpc::runtime::cuda::device::device_count().unwrap();
    if count < 2 {
        eprintln!("SKIP moe_fixtures_on_two_gpus_match_hf: {count} GPU");
        return;
    }
    let report = moe_fixtures_match_hf(&[2], &[0, 1], &[(ComputeDtype::F32, REL_TOL)]);
    eprintln!("{}", report.join("\n"));
}

/// The f32 bytes of rank 0's weights on a backend that leaves out the padding of every
/// weight that only linears read (an embedding table, a bias or a tied table is whole).
fn unpadded_f32_bytes(plan: &Plan) -> u64 {
    let program = &plan.ranks[0];
    let uses = weight_uses(program);
    let elements: u64 = program
        .instrs
        .iter()
        .filter_map(|i| {
            let Op::Param(p) = &i.op else {
                return None;
            };
            let w = program.weights.iter().find(|w| w.tensor == p.tensor)?;
            let u = uses.get(&i.id).copied().unwrap_or_default();
            Some(if u.linear.is_some() && !u.other {
                w.real_elements()
            } else {
                w.local_elements()
            })
        })
        .sum();
    elements * 4
}

/// Uneven splits and unequal shares on one GPU: every fixture (GPT-2's fused q|k|v padded
/// inside its piece too) at shares 1,3 and 1,2,3, and at tp 3 with sequence parallelism and
/// with the fused all-reduce + norm (shares 1,2,3 with sequence parallelism too), matches
/// HF's logits and greedy tokens (f32) — so do a replicated `down_proj` at 1,3, whose
/// all-gather joins unequal pieces, and a rowwise `gate_proj` at tp 3, whose local slices
/// cut them — and the backend leaves the padding out of a
/// smaller share's linears: rank 0's weights take the bytes of their real parts (whole
/// where other ops read them), fewer than the padded pieces wherever a linear's piece is
/// padded.
#[test]
fn every_fixture_under_shares_on_one_gpu_matches_hf() {
    if !gpu_present("every_fixture_under_shares_on_one_gpu_matches_hf") {
        return;
    }
    // (tp, shares, sequence parallelism, norm fusion); the first two are compared below.
    let configs: [(u64, Option<&str>, bool, bool); 6] = [
        (2, None, false, false),
        (2, Some("1,3"), false, false),
        (3, Some("1,2,3"), false, false),
        (3, None, true, false),
        (3, None, false, true),
        (3, Some("1,2,3"), true, false),
    ];
    let mut report = Vec::new();
    for dir in fixtures() {
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let opts = RunOptions {
            device: Device::Cuda(vec![0]),
            dtype: ComputeDtype::F32,
            max_new_tokens: reference.greedy.len(),
            ..Default::default()
        };
        let request = [Request {
            prompt: reference.prompt.clone(),
            max_new_tokens: None,
        }];
        let mut shed = Vec::new();
        for (tp, shares, sequence_parallel, fuse_norm) in configs {
            let options = ShardOptions {
                shares: shares.map(|s| s.parse().unwrap()),
                sequence_parallel,
                fuse_norm,
                ..Default::default()
            };
            let what = format!(
                "{} tp={tp} shares {shares:?} sp {sequence_parallel} fuse-norm {fuse_norm}",
                dir.display()
            );
            let compiled =
                compile_with(&def, tp, options).unwrap_or_else(|e| panic!("{what}: {e}"));
            let out = run_batch(&compiled.plan, &ckpt, &request, &opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let seq = &out.sequences[0];
            let err = rel_error(&seq.prompt_logits.data, &reference.logits);
            report.push(format!(
                "{what}: rel err {err:.2e}, rank 0 weights {} B",
                out.weight_bytes
            ));
            assert!(
                err <= REL_TOL,
                "{what}: relative error {err:.3e} > {REL_TOL}"
            );
            assert_eq!(seq.generated, reference.greedy, "{what}: greedy tokens");
            // Quantized linears keep their codes where nothing is trimmed (fewer bytes:
            // tests/cuda/quantized.rs), their values where padding is left out.
            let quantized = compiled.plan.ranks[0]
                .weights
                .iter()
                .any(|w| w.quant.is_some());
            if quantized {
                assert!(
                    out.weight_bytes <= unpadded_f32_bytes(&compiled.plan),
                    "{what}: rank 0's weight bytes"
                );
            } else {
                assert_eq!(
                    out.weight_bytes,
                    unpadded_f32_bytes(&compiled.plan),
                    "{what}: rank 0's weight bytes"
                );
            }
            let padded: u64 = compiled.plan.ranks[0]
                .weights
                .iter()
                .map(|w| w.local_bytes())
                .sum();
            shed.push(padded - out.weight_bytes);
        }
        // A replicated down_proj reads the MLP product whole: an all-gather of unequal
        // pieces joined by gate/up's counts; a rowwise gate_proj slices whole values into
        // uneven pieces at tp 3; a rowwise up_proj splits the hidden state (a
        // reduce-scatter of unequal pieces: an all-reduce each rank cuts); a rowwise k_proj
        // at tp 4 cuts replicated kv heads by their starts (Llama and Qwen names only).
        let overrides = [
            (
                "model.layers.*.mlp.down_proj",
                TpWord::Replicate,
                2,
                Some("1,3"),
            ),
            ("model.layers.*.mlp.gate_proj", TpWord::Rowwise, 3, None),
            ("model.layers.*.mlp.up_proj", TpWord::Rowwise, 3, None),
            ("model.layers.*.self_attn.k_proj", TpWord::Rowwise, 4, None),
        ];
        for (pattern, word, tp, shares) in overrides {
            let Some(over) = with_llama_override(&def, pattern, word) else {
                continue;
            };
            let options = ShardOptions {
                shares: shares.map(|s| s.parse().unwrap()),
                ..Default::default()
            };
            let what = format!(
                "{} {pattern} {word:?}, tp {tp} shares {shares:?}",
                dir.display()
            );
            let plan = compile_with(&over, tp, options).unwrap().plan;
            let out =
                run_batch(&plan, &ckpt, &request, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
            let seq = &out.sequences[0];
            let err = rel_error(&seq.prompt_logits.data, &reference.logits);
            report.push(format!("{what}: rel err {err:.2e}"));
            assert!(
                err <= REL_TOL,
                "{what}: relative error {err:.3e} > {REL_TOL}"
            );
            assert_eq!(seq.generated, reference.greedy, "{what}: greedy tokens");
        }
        // At 1,3 rank 0's linears are padded (at least its LM head's vocabulary rows), but
        // for qwen3-tied, whose only uneven piece is the LM head's table that the embedding
        // reads too.
        let tied = dir.ends_with("qwen3-tied");
        assert_eq!(
            shed[1] > 0,
            !tied,
            "{}: {shed:?} bytes left out",
            dir.display()
        );
    }
    eprintln!("{}", report.join("\n"));
}

/// A test of this module by the name the harness knows it (`device::test`, in the `cuda`
/// test target), for `--exact`.
fn in_this_module(test: &str) -> String {
    match module_path!().split_once("::") {
        Some((_crate, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}

/// Whether the emulated-GPU tests run here: not on a real GPU run (`TPC_REQUIRE_GPU`), and
/// only with NVRTC (required where `TPC_REQUIRE_NVRTC` is set). Prints why not.
pub(super) fn emulation_wanted(test: &str) -> bool {
    if std::env::var_os("TPC_REQUIRE_GPU").is_some() {
        eprintln!("SKIP {test}: this run is on a real GPU");
        return false;
    }
    if let Err(e) = require(Library::Nvrtc) {
        assert!(
            std::env::var_os("TPC_REQUIRE_NVRTC").is_none(),
            "TPC_REQUIRE_NVRTC is set but NVRTC cannot be loaded: {e}"
        );
        eprintln!("SKIP {test}: {e}");
        return false;
    }
    true
}

/// Runs `test` of this binary (its `module::name`) in a child process on the emulated GPUs
/// (`path`: [`emulated_gpu_path`]) with `env` set besides; the child requires a GPU, so it
/// fails rather than skips.
pub(super) fn spawn_on_emulated_gpu(
    test: &str,
    path: &str,
    env: &[(&str, &str)],
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .env("LD_LIBRARY_PATH", path)
        .env("TPC_REQUIRE_GPU", "1")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// The stderr of a child of [`spawn_on_emulated_gpu`], failing unless its test passed.
pub(super) fn passed_on_emulated_gpu(test: &str, child: std::process::Child) -> String {
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test} on the emulated GPU failed:\n{stdout}\n{stderr}"
    );
    stderr.into_owned()
}

/// `LD_LIBRARY_PATH` with the stand-in CUDA libraries (tests/emulator) first.
pub(super) fn emulated_gpu_path() -> String {
    let fake = emulator::fake_cuda_libraries().unwrap_or_else(|e| panic!("{e}"));
    match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", fake.display()),
        _ => fake.display().to_string(),
    }
}

/// A GPU too small for the model: `tpc run` exits 1 with an error that names the rank, the
/// GPU and the bytes asked for and free (the emulated GPU, given 64 KiB).
#[test]
fn out_of_memory_on_a_gpu_names_the_rank_the_gpu_and_the_bytes() {
    if !emulation_wanted("out_of_memory_on_a_gpu_names_the_rank_the_gpu_and_the_bytes") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tpc"))
        .args(["run", "tests/fixtures/checkpoints/llama-gqa", "--tp", "2"])
        .args(["--device", "cuda:0", "--prompt-ids", "1,2,3"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("LD_LIBRARY_PATH", emulated_gpu_path())
        .env("TPC_FAKE_CUDA_BYTES", "65536")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let said =
        err.contains("on GPU 0: ") && err.contains("asked for ") && err.contains(" bytes free");
    assert!(said && err.contains("rank "), "{err}");
    // Said once: the instruction's error is in its message, not again as its cause.
    assert_eq!(err.matches("asked for").count(), 1, "{err}");
    eprintln!("{}", err.trim());
}

/// The GPU parity test above, on the CPU: this test binary runs it again in a child process
/// whose `libcuda` and `libcublas` are the emulator's stand-ins (tests/emulator; NVRTC is
/// the real one and must be present). Every line of the CUDA backend runs — cudarc's calls,
/// launch arguments, cuBLAS parameters, KV caches, the one-shot all-reduce of ranks sharing
/// the GPU — with kernels executed by the emulator. Not shown: speed, the GPU's own
/// rounding, and anything that needs two streams to run at once. It runs once with the
/// backend's choice of attention kernel and once with each other kernel forced, and the
/// two-GPU test (NCCL, through the stand-in libnccl) once.
#[test]
fn every_fixture_matches_hf_on_the_emulated_gpu() {
    if !emulation_wanted("every_fixture_matches_hf_on_the_emulated_gpu") {
        return;
    }
    let path = emulated_gpu_path();
    // The backend's own choice of attention kernel (the one-pass one, for these short
    // prompts), then each other kernel forced; three children at once.
    let one_gpu = "every_fixture_on_one_gpu_matches_hf_at_every_valid_tp";
    let runs = [
        (one_gpu, ""),
        (one_gpu, "tiled"),
        (one_gpu, "split"),
        ("every_fixture_on_two_gpus_matches_hf", ""),
        ("every_fixture_under_shares_on_one_gpu_matches_hf", ""),
    ];
    let children: Vec<(&str, &str, std::process::Child)> = runs
        .into_iter()
        .map(|(test, way)| {
            let env = [("TPC_CUDA_ATTENTION", way)];
            let child = spawn_on_emulated_gpu(&in_this_module(test), &path, &env);
            (test, way, child)
        })
        .collect();
    for (test, way, child) in children {
        let way = if way.is_empty() { "chosen" } else { way };
        let stderr = passed_on_emulated_gpu(&format!("{test} (attention {way})"), child);
        // The child ran every case (it fails rather than skips without a GPU).
        let runs = stderr.lines().filter(|l| l.contains(": rel err")).count();
        assert!(
            runs >= fixtures().len(),
            "{test}, attention {way}: {runs} runs:\n{stderr}"
        );
        eprintln!("{test}, attention {way}: {runs} runs passed");
    }
}

/// The mixture-of-experts tests above on the emulated GPUs, each in a child process as
/// [`every_fixture_matches_hf_on_the_emulated_gpu`] runs its tests: both cases with both
/// splits at tp 1, 2 and 3 on one GPU in f32 and bf16, and in f32 at tp 2 on two GPUs (NCCL
/// through the stand-in libnccl). Every run must have passed: the children require a GPU,
/// so none can skip.
#[test]
fn moe_fixtures_match_hf_on_the_emulated_gpu() {
    if !emulation_wanted("moe_fixtures_match_hf_on_the_emulated_gpu") {
        return;
    }
    let path = emulated_gpu_path();
    let cases = MOE_CASES.len() * MOE_SPLITS.len();
    // (test, runs it makes); both children at once.
    let runs = [
        (
            "moe_fixtures_on_one_gpu_match_hf_with_both_splits",
            3 * 2 * cases,
        ),
        ("moe_fixtures_on_two_gpus_match_hf", cases),
        (
            "moe_experts_over_replicas_on_one_gpu_match_hf",
            4 * MOE_CASES.len(),
        ),
    ];
    let children: Vec<(&str, usize, std::process::Child)> = runs
        .into_iter()
        .map(|(test, want)| {
            let child = spawn_on_emulated_gpu(&in_this_module(test), &path, &[]);
            (test, want, child)
        })
        .collect();
    for (test, want, child) in children {
        let stderr = passed_on_emulated_gpu(test, child);
        let runs = stderr.lines().filter(|l| l.contains(": rel err")).count();
        assert_eq!(runs, want, "{test}: {runs} runs:\n{stderr}");
        eprintln!("{test}: {runs} runs passed");
    }
}
