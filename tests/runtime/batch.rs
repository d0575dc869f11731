//! Batched generation: a ragged batch of prompts, prefilled together and decoded together
//! with finished sequences dropping out, gives every sequence what running it alone gives,
//! on every reference checkpoint at every valid tp.

use crate::common;
use common::{fixtures, ragged_requests as requests, rel_error};

use std::path::PathBuf;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::runtime::generate::{Request, RunOptions};
use tpc::runtime::run::{run, run_batch};
use tpc::runtime::weights::Checkpoint;

/// Batched rows go through the prompt GEMM where a lone decode step takes the GEMV, so sums
/// may round differently; this bounds ‖a − b‖ / ‖b‖ of each sequence's prompt logits.
const BATCH_REL_TOL: f64 = 1e-5;

#[test]
fn a_ragged_batch_equals_each_sequence_alone_at_every_tp() {
    let mut checked = 0;
    for dir in fixtures() {
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for tp in [1, 2, 4, 8] {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            let plan = compiled.plan;
            let vocab = tpc::runtime::generate::output_vocab(&plan).unwrap() as i64;
            let reqs = requests(vocab);
            let opts = RunOptions {
                all_prompt_logits: true,
                ..RunOptions::default()
            };
            // An EOS id that the first sequence meets early (its third token alone), so it
            // drops out of the batch before the others.
            let alone0 = run(
                &plan,
                &ckpt,
                &reqs[0].prompt,
                &RunOptions {
                    max_new_tokens: 6,
                    ..opts.clone()
                },
            )
            .unwrap();
            let opts = RunOptions {
                eos: vec![alone0.generated[2]],
                ..opts
            };
            let batch = run_batch(&plan, &ckpt, &reqs, &opts).unwrap();
            assert_eq!(batch.sequences.len(), reqs.len());
            for (s, r) in reqs.iter().enumerate() {
                let alone = run(
                    &plan,
                    &ckpt,
                    &r.prompt,
                    &RunOptions {
                        max_new_tokens: r.max_new_tokens.unwrap(),
                        ..opts.clone()
                    },
                )
                .unwrap();
                let got = &batch.sequences[s];
                let ctx = format!("{} tp={tp} sequence {s}", dir.display());
                assert_eq!(got.generated, alone.generated, "{ctx}: tokens");
                assert_eq!(got.prompt_logits.shape, alone.prompt_logits.shape, "{ctx}");
                let e = rel_error(&got.prompt_logits.data, &alone.prompt_logits.data);
                assert!(e <= BATCH_REL_TOL, "{ctx}: prompt logits differ by {e:.3e}");
                checked += 1;
            }
            assert!(
                batch.sequences[0].generated.len() <= 3,
                "EOS ends sequence 0"
            );
            assert_eq!(batch.sequences[2].generated.len(), 1);
        }
    }
    assert!(checked >= 7 * 3 * 2, "only {checked} sequences checked");
}

#[test]
fn requests_are_refused_before_any_weight_is_read() {
    let dir = PathBuf::from("tests/fixtures/checkpoints/gpt2");
    let def = load_model(&dir).unwrap();
    let plan = compile(&def, 2).unwrap().plan;
    let max = plan.max_positions.expect("GPT-2 has n_positions");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let long = Request {
        prompt: vec![1; 4],
        max_new_tokens: Some(max as usize),
    };
    let e = run_batch(&plan, &ckpt, &[long], &RunOptions::default()).unwrap_err();
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
    // Exactly the model's positions is fine: the last new token is never fed back.
    let fits = Request {
        prompt: vec![1; 4],
        max_new_tokens: Some(max as usize - 3),
    };
    assert!(tpc::runtime::generate::check_requests(&plan, &[fits], &RunOptions::default()).is_ok());
    let vocab = tpc::runtime::generate::output_vocab(&plan).unwrap() as i64;
    let bad_id = Request {
        prompt: vec![1, vocab],
        max_new_tokens: None,
    };
    let e = run_batch(&plan, &ckpt, &[bad_id], &RunOptions::default()).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    let many = vec![
        Request {
            prompt: vec![1],
            max_new_tokens: Some(1),
        };
        tpc::runtime::generate::MAX_BATCH + 1
    ];
    let e = run_batch(&plan, &ckpt, &many, &RunOptions::default()).unwrap_err();
    assert!(e.to_string().contains("split the prompts"), "{e}");
}

/// Top-k sampling exchanges each rank's k best (logit, token) pairs instead of gathering the
/// logits (when that is fewer bytes): a ragged batch gets exactly the tokens that sampling
/// from the gathered logits gives, for every seed, tp, k (below, near and above the slice
/// width) and with top-p, on every reference checkpoint.
#[test]
fn top_k_sampling_from_exchanged_candidates_equals_sampling_from_gathered_logits() {
    let mut checked = 0;
    let mut fewer_bytes = 0;
    for dir in fixtures() {
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for tp in [1, 2, 4] {
            let Ok(compiled) = compile(&def, tp) else {
                continue;
            };
            let plan = compiled.plan;
            let vocab = tpc::runtime::generate::output_vocab(&plan).unwrap() as i64;
            let reqs = requests(vocab);
            for seed in 0..8u64 {
                for (k, top_p, temperature) in [
                    (1, None, 1.0),
                    (5, None, 2.0),
                    (7, Some(0.85), 0.8),
                    (vocab as usize - 1, None, 1.5),
                    (1 << 30, Some(0.95), 1.0),
                ] {
                    let opts = RunOptions {
                        sampling: tpc::runtime::sampling::Sampling {
                            temperature,
                            top_k: Some(k),
                            top_p,
                            seed,
                        },
                        all_prompt_logits: false,
                        device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
                            threads_per_rank: 1,
                            ..Default::default()
                        }),
                        ..RunOptions::default()
                    };
                    let exchanged = run_batch(&plan, &ckpt, &reqs, &opts).unwrap();
                    let gathered = run_batch(
                        &plan,
                        &ckpt,
                        &reqs,
                        &RunOptions {
                            gather_logits: true,
                            ..opts
                        },
                    )
                    .unwrap();
                    let ctx = format!("{} tp={tp} seed {seed} k {k}", dir.display());
                    for (a, b) in exchanged.sequences.iter().zip(&gathered.sequences) {
                        assert_eq!(a.generated, b.generated, "{ctx}");
                    }
                    assert!(
                        exchanged.collective_bytes <= gathered.collective_bytes,
                        "{ctx}"
                    );
                    if exchanged.collective_bytes < gathered.collective_bytes {
                        fewer_bytes += 1;
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 7 * 3 * 8 * 5, "only {checked} runs checked");
    assert!(
        fewer_bytes >= 7 * 2 * 8 * 3,
        "only {fewer_bytes} runs exchanged fewer bytes"
    );
}

/// `--profile` splits rank 0's op time into the prompt's forward call and the decode steps
/// (each sequence one new token), counting every attention layer once per forward call.
#[test]
fn a_profile_splits_prefill_from_decode_steps() {
    let dir = PathBuf::from("tests/fixtures/checkpoints/llama-gqa");
    let def = load_model(&dir).unwrap();
    let plan = compile(&def, 2).unwrap().plan;
    let ckpt = Checkpoint::open(&dir).unwrap();
    let reqs = [
        Request {
            prompt: vec![3, 1, 4, 1, 5],
            max_new_tokens: Some(5),
        },
        Request {
            prompt: vec![9, 2],
            max_new_tokens: Some(5),
        },
    ];
    let opts = RunOptions {
        profile: true,
        warmup: 1,
        repeat: 2,
        ..RunOptions::default()
    };
    let out = run_batch(&plan, &ckpt, &reqs, &opts).unwrap();
    // The timed repetitions only: one prompt call and 4 steps each (the fifth token is
    // never fed back).
    assert_eq!(out.profiled_steps, [2, 8]);
    let (_, attention) = out
        .profile
        .iter()
        .find(|(kind, _)| kind == "attention")
        .expect("an attention row");
    // Each attention layer once per forward call, both sequences in one call.
    let layers = attention.calls[0] / 2;
    assert!(
        layers > 0 && attention.calls[0] == 2 * layers,
        "{:?}",
        attention.calls
    );
    assert_eq!(attention.calls[1], 8 * layers);
    assert!(attention.seconds.iter().all(|&s| s > 0.0));
    let table = tpc::runtime::generate::render_profile(&out);
    assert!(table.contains("2 prefill calls, 8 decode steps"), "{table}");
}
