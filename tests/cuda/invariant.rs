//! `--numerics invariant` on the CUDA backend: every fixture's prompt logits are the same
//! bits at every valid tp (and with sequence parallelism), alone and in a ragged batch, in
//! f32 and bf16 weights, close to HF's, with the same seeded samples; on a GPU where there
//! is one, and on the emulated GPUs in a child process otherwise. The same runs in the fast
//! order differ somewhere: the check can fail.
#![cfg(feature = "cuda")]

use super::device::{emulated_gpu_path, emulation_wanted, gpu_present};
use super::device::{passed_on_emulated_gpu, spawn_on_emulated_gpu};
use crate::common::{fixtures, ragged_requests, read_reference, rel_error};
use crate::common::{BF16_REL_TOL, REL_TOL};
use tpc::frontend::load::load_model;
use tpc::ir::NumericsMode;
use tpc::passes::ShardOptions;
use tpc::pipeline::compile_with;
use tpc::runtime::generate::{ComputeDtype, Device, Request, RunOptions};
use tpc::runtime::run::run_batch;
use tpc::runtime::sampling::Sampling;
use tpc::runtime::weights::Checkpoint;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every fixture in `numerics`, ranks on `gpus`, for each (dtype, tolerance, tps) at each tp
/// that divides it (and, in f32, tp 2 with sequence parallelism and with norm fusion): the
/// prompt's logits alone and as the middle of a ragged batch of three, and 3 seeded
/// samples. Returns the report lines and how many runs differed from the first of their
/// fixture and dtype (none may under `invariant`).
fn compare_every_fixture(
    numerics: NumericsMode,
    gpus: &[usize],
    dtypes: &[(ComputeDtype, f64, &[u64])],
    most_fixtures: usize,
) -> (Vec<String>, usize) {
    let mut report = Vec::new();
    let mut differ = 0;
    let seeded = Sampling {
        temperature: 0.9,
        top_k: None,
        top_p: Some(0.95),
        seed: 7,
    };
    for dir in fixtures().into_iter().take(most_fixtures) {
        let r = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let vocab = r.logits.len() / r.prompt.len();
        let mut batch = ragged_requests(vocab as i64);
        batch[1] = Request {
            prompt: r.prompt.clone(),
            max_new_tokens: Some(3),
        };
        let alone = vec![batch[1].clone()];
        for &(dtype, tol, tps) in dtypes {
            let mut first: Option<(Vec<u32>, Vec<i64>)> = None;
            // (tp, sequence parallelism, norm fusion)
            let extra = tps.contains(&2) && dtype == ComputeDtype::F32;
            let variants = tps
                .iter()
                .map(|&tp| (tp, false, false))
                .chain(extra.then_some((2, true, false)))
                .chain(extra.then_some((2, false, true)));
            for (tp, sp, fuse_norm) in variants {
                let options = ShardOptions {
                    sequence_parallel: sp,
                    fuse_norm,
                    numerics,
                    shares: None,
                    moe: None,
                };
                let Ok(compiled) = compile_with(&def, tp, options) else {
                    continue;
                };
                let opts = RunOptions {
                    device: Device::Cuda(gpus.to_vec()),
                    dtype,
                    max_new_tokens: 3,
                    all_prompt_logits: true,
                    sampling: seeded.clone(),
                    ..Default::default()
                };
                let what = format!(
                    "{} {numerics} tp={tp}{}{} {dtype:?} on GPUs {gpus:?}",
                    dir.display(),
                    if sp { " --sequence-parallel" } else { "" },
                    if fuse_norm { " --fuse-norm" } else { "" }
                );
                let mut runs = Vec::new();
                for requests in [&alone, &batch] {
                    let out = run_batch(&compiled.plan, &ckpt, requests, &opts)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let seq = &out.sequences[requests.len() / 2];
                    let err = rel_error(&seq.prompt_logits.data, &r.logits);
                    assert!(err <= tol, "{what}: relative error {err:.3e} against HF");
                    runs.push((bits(&seq.prompt_logits.data), seq.generated.clone()));
                }
                let [in_batch, alone_run]: [_; 2] = [runs.pop().unwrap(), runs.pop().unwrap()];
                let mut same = in_batch == alone_run;
                match &first {
                    None => first = Some(alone_run),
                    Some(want) => same &= *want == alone_run,
                }
                if numerics == NumericsMode::Invariant {
                    assert!(
                        same,
                        "{what}: not the same bits or samples as tp=1 alone (alone or in a batch)"
                    );
                }
                differ += usize::from(!same);
                report.push(format!("{what}: same bits {same}"));
            }
        }
    }
    (report, differ)
}

#[test]
fn every_fixture_gives_the_same_bits_at_every_tp_and_batch_on_one_gpu() {
    if !gpu_present("every_fixture_gives_the_same_bits_at_every_tp_and_batch_on_one_gpu") {
        return;
    }
    let both: [(_, _, &[u64]); 2] = [
        (ComputeDtype::F32, REL_TOL, &[1, 2, 4]),
        (ComputeDtype::Bf16, BF16_REL_TOL, &[1, 2]),
    ];
    let (report, _) = compare_every_fixture(NumericsMode::Invariant, &[0], &both, usize::MAX);
    eprintln!("{}", report.join("\n"));
    // The fast order, f32, two fixtures: tp 2 or the batch changes some bits.
    let f32s: [(_, _, &[u64]); 1] = [(ComputeDtype::F32, REL_TOL, &[1, 2])];
    let (_, differ) = compare_every_fixture(NumericsMode::Fast, &[0], &f32s, 2);
    assert!(
        differ > 0,
        "the fast order gave the same bits everywhere: the check cannot fail"
    );
}

/// tp 2 with a rank on each GPU (the all-reduce of limbs through NCCL), against tp 1.
#[test]
fn every_fixture_gives_the_same_bits_with_a_rank_on_each_of_two_gpus() {
    if !gpu_present("every_fixture_gives_the_same_bits_with_a_rank_on_each_of_two_gpus") {
        return;
    }
    let count = tpc::runtime::cuda::device::device_count().unwrap();
    if count < 2 {
        eprintln!(
            "SKIP every_fixture_gives_the_same_bits_with_a_rank_on_each_of_two_gpus: {count} GPU"
        );
        return;
    }
    let f32s: [(_, _, &[u64]); 1] = [(ComputeDtype::F32, REL_TOL, &[1, 2])];
    let (report, _) = compare_every_fixture(NumericsMode::Invariant, &[0, 1], &f32s, usize::MAX);
    eprintln!("{}", report.join("\n"));
}

/// Both tests above on the emulated GPUs (`tests/emulator`), in child processes.
#[test]
fn every_fixture_gives_the_same_bits_on_the_emulated_gpus() {
    if !emulation_wanted("every_fixture_gives_the_same_bits_on_the_emulated_gpus") {
        return;
    }
    let path = emulated_gpu_path();
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let tests = [
        "every_fixture_gives_the_same_bits_at_every_tp_and_batch_on_one_gpu",
        "every_fixture_gives_the_same_bits_with_a_rank_on_each_of_two_gpus",
    ];
    let children: Vec<_> = tests
        .iter()
        .map(|test| {
            let child = spawn_on_emulated_gpu(&format!("{module}::{test}"), &path, &[]);
            (test, child)
        })
        .collect();
    for (test, child) in children {
        let stderr = passed_on_emulated_gpu(test, child);
        let runs = stderr
            .lines()
            .filter(|l| l.contains(": same bits true"))
            .count();
        assert!(
            runs >= 3 * fixtures().len(),
            "{test}: {runs} runs:\n{stderr}"
        );
        eprintln!("{test}: {runs} runs the same bits on the emulated GPUs");
    }
}
