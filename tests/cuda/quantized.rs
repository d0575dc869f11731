//! Quantized checkpoints on the GPU (feature `cuda`): FP8 (block scales), INT8 (a scale per
//! output channel) and INT4 (GPTQ, AWQ, GPTQ in act order, compressed-tensors W4A16) linears kept on the device as
//! their codes (`src/runtime/cuda/backend/quantized.rs`, `kernels/quant.cu`). Each fixture at
//! every tp its blocks and groups allow (f32; bf16 at tp 1 and 2) matches transformers'
//! logits (greedy tokens in f32); at tp 2 its weights take the bytes of codes, not of bf16
//! values, and a prompt long enough for the widened cuBLAS product gives the CPU backend's
//! logits, f32 and bf16 (the fixtures' 7-token prompts take the decode GEMV).

#![cfg(feature = "cuda")]

use super::device::{emulated_gpu_path, emulation_wanted, gpu_present};
use super::device::{passed_on_emulated_gpu, spawn_on_emulated_gpu};
use crate::common::{read_reference, rel_error, BF16_REL_TOL, REL_TOL};
use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::Plan;
use tpc::runtime::generate::{ComputeDtype, Device, Request, RunOptions};
use tpc::runtime::run::run_batch;
use tpc::runtime::weights::Checkpoint;

/// The quantized fixtures and the least bytes per linear weight element that keeping their
/// codes saves against bf16 values (2 bytes): a byte code, or half a byte, plus scales.
const CASES: [(&str, f64); 6] = [
    ("llama-gqa-fp8", 0.5),
    ("llama-gqa-int8", 0.5),
    ("llama-gqa-gptq", 1.0),
    ("llama-gqa-awq", 1.0),
    ("llama-gqa-gptq-act", 1.0),
    ("llama-gqa-w4a16", 1.0),
];

fn dir_of(case: &str) -> std::path::PathBuf {
    Path::new("tests/fixtures/checkpoints").join(case)
}

fn run_one(
    plan: &Plan,
    ckpt: &Checkpoint,
    requests: &[Request],
    device: Device,
    dtype: ComputeDtype,
) -> tpc::runtime::generate::BatchOutput {
    let opts = RunOptions {
        device,
        dtype,
        max_new_tokens: 8,
        ..Default::default()
    };
    run_batch(plan, ckpt, requests, &opts).unwrap_or_else(|e| panic!("{e}"))
}

/// Rank 0's linear weight elements that are stored quantized.
fn quantized_elements(plan: &Plan) -> u64 {
    plan.ranks[0]
        .weights
        .iter()
        .filter(|w| w.quant.is_some())
        .map(|w| w.local_elements())
        .sum()
}

#[test]
fn quantized_fixtures_on_one_gpu_keep_their_codes_and_match_hf() {
    if !gpu_present("quantized_fixtures_on_one_gpu_keep_their_codes_and_match_hf") {
        return;
    }
    let gpu = || Device::Cuda(vec![0]);
    // llama-gqa's own weights, as bf16 values: what the quantized fixtures' bytes are
    // compared with (they are its weights quantized).
    let plain_dir = dir_of("llama-gqa");
    let plain_ckpt = Checkpoint::open(&plain_dir).unwrap();
    let plain_def = load_model(&plain_dir).unwrap();
    let plain_prompt = [Request {
        prompt: read_reference(&plain_dir).prompt,
        max_new_tokens: None,
    }];
    for (case, saved_per_element) in CASES {
        let dir = dir_of(case);
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let request = [Request {
            prompt: reference.prompt.clone(),
            max_new_tokens: Some(reference.greedy.len()),
        }];
        // Three times the prompt: 21 rows, past the GEMV's 8.
        let long = [Request {
            prompt: reference.prompt.repeat(3),
            max_new_tokens: Some(3),
        }];
        let mut ran = Vec::new();
        for tp in 1u64..=8 {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            let plan = &compiled.plan;
            // f32 at every tp; bf16 at tp 1 and 2.
            let dtypes: &[(ComputeDtype, f64)] = if tp <= 2 {
                &[
                    (ComputeDtype::F32, REL_TOL),
                    (ComputeDtype::Bf16, BF16_REL_TOL),
                ]
            } else {
                &[(ComputeDtype::F32, REL_TOL)]
            };
            for &(dtype, tol) in dtypes {
                let what = format!("{case} tp={tp} {dtype:?}");
                let out = run_one(plan, &ckpt, &request, gpu(), dtype);
                let seq = &out.sequences[0];
                let err = rel_error(&seq.prompt_logits.data, &reference.logits);
                eprintln!(
                    "{what}: rel err {err:.2e}, {} weight bytes",
                    out.weight_bytes
                );
                assert!(err <= tol, "{what}: relative error {err:.3e} > {tol}");
                if dtype == ComputeDtype::F32 {
                    assert_eq!(seq.generated, reference.greedy, "{what}: greedy tokens");
                }
                if tp != 2 {
                    continue;
                }
                // The widened product for a prompt of 21 rows, against the CPU backend.
                let on_gpu = run_one(plan, &ckpt, &long, gpu(), dtype);
                let on_cpu = run_one(plan, &ckpt, &long, Device::Cpu(Default::default()), dtype);
                let (g, c) = (&on_gpu.sequences[0], &on_cpu.sequences[0]);
                let err = rel_error(&g.prompt_logits.data, &c.prompt_logits.data);
                eprintln!("{what}, 21-token prompt: rel err against the CPU {err:.2e}");
                assert!(
                    err <= tol,
                    "{what}, 21 rows: {err:.3e} from the CPU's logits"
                );
                if dtype == ComputeDtype::F32 {
                    assert_eq!(g.generated, c.generated, "{what}, 21 rows: greedy tokens");
                }
                if dtype == ComputeDtype::Bf16 {
                    let plain_plan = compile(&plain_def, tp).unwrap().plan;
                    let plain = run_one(&plain_plan, &plain_ckpt, &plain_prompt, gpu(), dtype);
                    let elements = quantized_elements(plan) as f64;
                    let saved = plain.weight_bytes as f64 - out.weight_bytes as f64;
                    eprintln!(
                        "{what}: rank 0's weights {} bytes against {} as bf16 values ({elements} quantized elements)",
                        out.weight_bytes, plain.weight_bytes
                    );
                    assert!(
                        elements > 0.0 && saved >= saved_per_element * elements,
                        "{what}: {} weight bytes against {} as bf16 values ({elements} quantized elements): the codes were not kept",
                        out.weight_bytes,
                        plain.weight_bytes
                    );
                }
            }
            ran.push(tp);
        }
        assert!(ran.contains(&2), "{case}: ran only at tp {ran:?}");
    }
}

/// The tests above on the emulated GPU (`tests/emulator`), each in a child process.
#[test]
fn quantized_fixtures_keep_their_codes_on_the_emulated_gpu() {
    if !emulation_wanted("quantized_fixtures_keep_their_codes_on_the_emulated_gpu") {
        return;
    }
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let path = emulated_gpu_path();
    // (test, the runs it reports with their weight bytes): every dense case at tp 1 and 2
    // in f32 and bf16; both expert splits at tp 1 and 2.
    let tests = [
        (
            "quantized_fixtures_on_one_gpu_keep_their_codes_and_match_hf",
            2 * 2 * CASES.len(),
        ),
        ("fp8_experts_on_one_gpu_keep_their_codes_and_match_hf", 4),
    ];
    let children: Vec<_> = tests
        .iter()
        .map(|&(test, want)| {
            let test = format!("{module}::{test}");
            let child = spawn_on_emulated_gpu(&test, &path, &[]);
            (test, want, child)
        })
        .collect();
    for (test, want, child) in children {
        let stderr = passed_on_emulated_gpu(&test, child);
        let report: Vec<&str> = stderr.lines().filter(|l| l.contains("rel err")).collect();
        eprintln!("{}", report.join("\n"));
        let runs = report.iter().filter(|l| l.contains("weight bytes")).count();
        assert!(runs >= want, "{test}: {runs} runs:\n{stderr}");
        eprintln!("{test}: {runs} runs on the emulated GPU");
    }
}

/// Mixture-of-experts weights as FP8 codes on one GPU (`qwen3-moe-fp8`: every expert's
/// projections in blocks of 16): both expert splits at tp 1 and 2, f32, match transformers'
/// logits and greedy tokens, and the weights take at least 2 bytes an element fewer than
/// `qwen3-moe`'s f32 values (which they quantize).
#[test]
fn fp8_experts_on_one_gpu_keep_their_codes_and_match_hf() {
    use tpc::ir::ExpertSplit;
    use tpc::passes::ShardOptions;
    use tpc::pipeline::compile_with;
    if !gpu_present("fp8_experts_on_one_gpu_keep_their_codes_and_match_hf") {
        return;
    }
    let (dir, plain_dir) = (dir_of("qwen3-moe-fp8"), dir_of("qwen3-moe"));
    let reference = read_reference(&dir);
    let (def, plain_def) = (load_model(&dir).unwrap(), load_model(&plain_dir).unwrap());
    let ckpt = Checkpoint::open(&dir).unwrap();
    let plain_ckpt = Checkpoint::open(&plain_dir).unwrap();
    let request = [Request {
        prompt: reference.prompt.clone(),
        max_new_tokens: Some(reference.greedy.len()),
    }];
    for split in [ExpertSplit::Tensor, ExpertSplit::Expert] {
        for tp in [1u64, 2] {
            let options = || ShardOptions {
                moe: Some(split),
                ..Default::default()
            };
            let what = format!("qwen3-moe-fp8 --moe {} tp={tp}", split.word());
            let plan = compile_with(&def, tp, options()).unwrap().plan;
            let out = run_one(
                &plan,
                &ckpt,
                &request,
                Device::Cuda(vec![0]),
                ComputeDtype::F32,
            );
            let seq = &out.sequences[0];
            let err = rel_error(&seq.prompt_logits.data, &reference.logits);
            eprintln!(
                "{what}: rel err {err:.2e}, {} expert weight bytes",
                out.weight_bytes
            );
            assert!(err <= REL_TOL, "{what}: relative error {err:.3e}");
            assert_eq!(seq.generated, reference.greedy, "{what}: greedy tokens");
            let plain_plan = compile_with(&plain_def, tp, options()).unwrap().plan;
            let plain = run_one(
                &plain_plan,
                &plain_ckpt,
                &request,
                Device::Cuda(vec![0]),
                ComputeDtype::F32,
            );
            let elements = quantized_elements(&plan) as f64;
            let saved = plain.weight_bytes as f64 - out.weight_bytes as f64;
            assert!(
                elements > 0.0 && saved >= 2.0 * elements,
                "{what}: {} weight bytes against {} as f32 values ({elements} quantized elements)",
                out.weight_bytes,
                plain.weight_bytes
            );
        }
    }
}
