//! Mixture-of-experts parity with Hugging Face transformers: the tiny Mixtral, Qwen2-MoE
//! (a shared expert behind a sigmoid gate), Qwen3-MoE (a dense layer among its sparse ones)
//! and OLMoE (q and k normalised over the whole projection) checkpoints
//! (`scripts/make_fixtures.py`) reproduce HF's prefill logits and greedy tokens at tp 1 to
//! 4 with the experts split by features (`--moe tensor`) and dealt whole (`--moe expert`,
//! 8 experts dealt 3/3/2 at tp 3).

use crate::common;
use common::{read_reference, rel_error, REL_TOL};

use tpc::frontend::load::load_model;
use tpc::ir::ExpertSplit;
use tpc::passes::ShardOptions;
use tpc::pipeline::compile_with;
use tpc::runtime::generate::RunOptions;
use tpc::runtime::run::run;
use tpc::runtime::weights::Checkpoint;

#[test]
fn every_moe_family_matches_hf_with_both_splits_at_tp_1_to_4() {
    let mut runs = 0;
    for case in common::MOE_FIXTURES {
        let dir = std::path::Path::new("tests/fixtures/checkpoints").join(case);
        let reference = read_reference(&dir);
        let def = load_model(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        for split in [ExpertSplit::Tensor, ExpertSplit::Expert] {
            for tp in 1u64..=4 {
                let options = ShardOptions {
                    moe: Some(split),
                    ..Default::default()
                };
                let plan = compile_with(&def, tp, options).unwrap().plan;
                let opts = RunOptions {
                    max_new_tokens: reference.greedy.len(),
                    device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
                        isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                let out = run(&plan, &ckpt, &reference.prompt, &opts).unwrap();
                let what = format!("{case} --moe {} tp={tp}", split.word());
                let err = rel_error(&out.prompt_logits.data, &reference.logits);
                eprintln!("{what}: rel err {err:.2e}");
                assert!(
                    err <= REL_TOL,
                    "{what}: relative error {err:.3e} > {REL_TOL}"
                );
                assert_eq!(out.generated, reference.greedy, "{what}: greedy tokens");
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 32);
}

#[test]
fn expert_split_deals_whole_experts_and_slices_the_routing_by_their_counts() {
    let dir = std::path::Path::new("tests/fixtures/checkpoints/mixtral-moe");
    let def = load_model(dir).unwrap();
    let options = ShardOptions {
        moe: Some(ExpertSplit::Expert),
        ..Default::default()
    };
    let plan = compile_with(&def, 3, options).unwrap().plan;
    for (rank, want) in [3u64, 3, 2].into_iter().enumerate() {
        let w = plan.ranks[rank]
            .weights
            .iter()
            .find(|w| &*w.tensor == "model.layers.0.block_sparse_moe.experts.{e}.w1.weight")
            .unwrap();
        assert_eq!(w.dim, Some(0));
        assert_eq!(w.real_len(), want, "rank {rank}'s experts");
        let slice = plan.ranks[rank]
            .instrs
            .iter()
            .find_map(|i| match &i.op {
                tpc::ir::Op::LocalSlice(s) if i.layer == Some(0) => Some(s.pieces.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(slice, vec![3, 3, 2]);
    }
    // The notes and a refusal count experts, not columns or heads.
    assert!(
        plan.notes
            .iter()
            .any(|n| n.contains("8 experts dealt 3/3/2")),
        "{:?}",
        plan.notes
    );
    let options = ShardOptions {
        moe: Some(ExpertSplit::Expert),
        ..Default::default()
    };
    let err = compile_with(&def, 9, options).err().unwrap().to_string();
    assert!(
        err.contains("8 experts cannot be shared by tp=9") && err.contains("8 attention heads"),
        "{err}"
    );
    // The router stays whole: no all-gather inside the layers.
    assert!(plan
        .collectives
        .iter()
        .all(|c| c.kind != "all_gather" || c.layer.is_none()));
}

/// Qwen2-MoE's shared expert and its gate add no communication: the routed and the
/// shared experts' partial sums meet before the layer's one all-reduce after attention's.
#[test]
fn the_shared_expert_shares_the_layers_all_reduce() {
    let dir = std::path::Path::new("tests/fixtures/checkpoints/qwen2-moe");
    let def = load_model(dir).unwrap();
    for split in [ExpertSplit::Tensor, ExpertSplit::Expert] {
        let options = ShardOptions {
            moe: Some(split),
            ..Default::default()
        };
        let plan = compile_with(&def, 2, options).unwrap().plan;
        let in_layer_0 = |kind: &str| {
            plan.collectives
                .iter()
                .filter(|c| c.kind == kind && c.layer == Some(0))
                .count()
        };
        assert_eq!(in_layer_0("all_reduce"), 2, "--moe {}", split.word());
        assert_eq!(in_layer_0("all_gather"), 0, "--moe {}", split.word());
        // The gate is replicated: one logit per token on every rank.
        let gate = plan.ranks[1]
            .weights
            .iter()
            .find(|w| &*w.tensor == "model.layers.0.mlp.shared_expert_gate.weight")
            .unwrap();
        assert_eq!(gate.dim, None);
    }
}

/// OLMoE's q and k norms span every head: the heads are gathered for them, which works
/// while each rank holds its own run of kv heads and is refused, naming the valid tps,
/// once tp exceeds the kv heads (4 here).
#[test]
fn olmoe_gathers_q_and_k_for_their_norms_and_refuses_replicated_kv_heads() {
    let dir = std::path::Path::new("tests/fixtures/checkpoints/olmoe");
    let def = load_model(dir).unwrap();
    let plan = compile_with(&def, 4, ShardOptions::default()).unwrap().plan;
    let gathers: Vec<_> = plan
        .collectives
        .iter()
        .filter(|c| c.kind == "all_gather" && c.layer == Some(0))
        .collect();
    assert_eq!(gathers.len(), 2, "{gathers:?}");
    let err = compile_with(&def, 8, ShardOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("k_proj") && err.contains("replicated") && err.contains("1, 2, 3, 4"),
        "{err}"
    );
}

/// A run reports each rank's expert load: every rank computes every (token, expert) pair
/// when the experts are split by features; a deal shares the same pairs out, each rank
/// counting those of its own experts.
#[test]
fn each_rank_reports_the_token_expert_pairs_it_computed() {
    let dir = std::path::Path::new("tests/fixtures/checkpoints/qwen3-moe");
    let reference = read_reference(dir);
    let def = load_model(dir).unwrap();
    let ckpt = Checkpoint::open(dir).unwrap();
    // Prompt plus the fed-back tokens (the last new one is not fed), 2 experts each, in
    // the 2 sparse layers (layer 1 is dense).
    let n_new = reference.greedy.len();
    let pairs = ((reference.prompt.len() + n_new - 1) * 2 * 2) as u64;
    let request = tpc::runtime::generate::Request {
        prompt: reference.prompt.clone(),
        max_new_tokens: None,
    };
    for (split, tp) in [(ExpertSplit::Tensor, 3u64), (ExpertSplit::Expert, 3)] {
        let options = ShardOptions {
            moe: Some(split),
            ..Default::default()
        };
        let plan = compile_with(&def, tp, options).unwrap().plan;
        let opts = RunOptions {
            max_new_tokens: n_new,
            ..Default::default()
        };
        let out = tpc::runtime::run::run_batch(&plan, &ckpt, std::slice::from_ref(&request), &opts)
            .unwrap();
        let load = out.routed_pairs_per_rank;
        assert_eq!(load.len(), tp as usize, "{load:?}");
        match split {
            ExpertSplit::Tensor => assert!(load.iter().all(|&p| p == pairs), "{load:?}"),
            ExpertSplit::Expert => {
                assert_eq!(load.iter().sum::<u64>(), pairs, "{load:?}");
                assert!(load.iter().all(|&p| p < pairs), "{load:?}");
            }
        }
    }
    // With two stages every rank of both reports its own layers' pairs: a tp rank's over
    // the stages add up to every pair (each tensor-split rank computes them all).
    for tp in [1u64, 2] {
        let options = ShardOptions {
            moe: Some(ExpertSplit::Tensor),
            ..Default::default()
        };
        let mut plan = compile_with(&def, tp, options).unwrap().plan;
        tpc::pipeline::split_stages(&mut plan, 2, None).unwrap();
        let opts = RunOptions {
            max_new_tokens: n_new,
            ..Default::default()
        };
        let out = tpc::runtime::run::run_batch(&plan, &ckpt, std::slice::from_ref(&request), &opts)
            .unwrap();
        let load = out.routed_pairs_per_rank;
        let tp = tp as usize;
        assert_eq!(load.len(), 2 * tp, "pp 2 tp {tp}: {load:?}");
        for t in 0..tp {
            assert_eq!(load[t] + load[tp + t], pairs, "pp 2 tp {tp}: {load:?}");
        }
    }
    // A dense model reports no load, with stages or without.
    let dense = std::path::Path::new("tests/fixtures/checkpoints/llama-gqa");
    for pp in [1, 2] {
        let mut plan = compile_with(&load_model(dense).unwrap(), 2, ShardOptions::default())
            .unwrap()
            .plan;
        if pp > 1 {
            tpc::pipeline::split_stages(&mut plan, pp, None).unwrap();
        }
        let out = tpc::runtime::run::run_batch(
            &plan,
            &Checkpoint::open(dense).unwrap(),
            &[tpc::runtime::generate::Request {
                prompt: vec![1, 2, 3],
                max_new_tokens: None,
            }],
            &RunOptions {
                max_new_tokens: 2,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(out.routed_pairs_per_rank.is_empty(), "pp {pp}");
    }
}
