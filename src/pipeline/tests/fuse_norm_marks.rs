//! Which all-reduces of a compiled model the fuse-norm pass joins with the norm after them.

use crate::frontend::load::load_model;
use crate::ir::Op;
use crate::passes::ShardOptions;
use crate::pipeline::compile_with;

fn plan(model: &str, tp: u64, fuse_norm: bool) -> crate::plan::Plan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(model);
    let options = ShardOptions {
        fuse_norm,
        ..Default::default()
    };
    compile_with(&load_model(&path).unwrap(), tp, options)
        .unwrap()
        .plan
}

fn kinds(p: &crate::plan::Plan, rank: usize, kind: &str) -> usize {
    p.ranks[rank]
        .instrs
        .iter()
        .filter(|i| i.op.kind() == kind)
        .count()
}

#[test]
fn every_all_reduce_of_a_llama_joins_its_norm_and_every_rank_adds_residuals() {
    let plain = plan("models/tiny-llama.ron", 2, false);
    let fused = plan("models/tiny-llama.ron", 2, true);
    for rank in 0..2 {
        assert_eq!(kinds(&fused, rank, "all_reduce"), 0);
        // The embedding's, then two per layer (the last one feeds the final norm).
        assert_eq!(kinds(&fused, rank, "all_reduce_rms_norm"), 5);
        assert_eq!(kinds(&fused, rank, "rms_norm"), 0);
    }
    // Rank 1 used to skip the residual adds (rank 0 added the whole residual into its
    // partial sum); now each rank adds its own partial residual.
    assert_eq!(kinds(&plain, 1, "add"), 0);
    assert_eq!(kinds(&fused, 1, "add"), 4);
    assert_eq!(kinds(&fused, 0, "add"), 4);
    // One op fewer on rank 0 per fused site.
    assert_eq!(plain.ranks[0].instrs.len() - fused.ranks[0].instrs.len(), 5);
    assert!(fused.notes.iter().any(|n| n.contains("norm fusion: 5")));
}

#[test]
fn under_invariant_numerics_norms_are_marked_and_the_residual_stream_stays_whole() {
    let compile = |tp: u64, sequence_parallel: bool, fuse_norm: bool| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-llama.ron");
        let options = ShardOptions {
            fuse_norm,
            sequence_parallel,
            numerics: crate::ir::NumericsMode::Invariant,
            shares: None,
            moe: None,
        };
        compile_with(&load_model(&path).unwrap(), tp, options)
            .unwrap()
            .plan
    };
    let marked = |p: &crate::plan::Plan, rank: usize| {
        p.ranks[rank]
            .instrs
            .iter()
            .filter(|i| matches!(&i.op, Op::RmsNorm(n) if n.with_reduce))
            .count()
    };
    let plain = compile(2, false, false);
    let fused = compile(2, false, true);
    for rank in 0..2 {
        assert_eq!(marked(&fused, rank), 5);
        // Nothing else changes: the all-reduces, adds and norms stay (each rank adds
        // the whole residual), and no norm reduces its input the fast way.
        for kind in ["all_reduce", "add", "rms_norm"] {
            assert_eq!(
                kinds(&fused, rank, kind),
                kinds(&plain, rank, kind),
                "{kind}"
            );
        }
        assert_eq!(kinds(&fused, rank, "all_reduce_rms_norm"), 0);
    }
    assert!(fused
        .notes
        .iter()
        .any(|n| n.contains("norm fusion (invariant): 5")));
    // Sequence parallelism leaves no all-reduce to join (as in fast numerics), and tp 1
    // has none.
    for p in [compile(2, true, true), compile(1, false, true)] {
        assert_eq!(marked(&p, 0), 0);
    }
}

#[test]
fn layer_norm_families_and_tp_1_are_left_alone() {
    for (model, tp) in [("models/tiny-gpt2.ron", 2), ("models/tiny-llama.ron", 1)] {
        let p = plan(model, tp, true);
        assert!(p.ranks.iter().all(|r| r
            .instrs
            .iter()
            .all(|i| !matches!(&i.op, Op::RmsNorm(n) if n.reduce_input.is_some()))));
    }
}
