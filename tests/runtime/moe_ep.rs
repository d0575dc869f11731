//! Expert parallelism over data-parallel replicas (`--dp D --ep`): each tp rank's experts
//! dealt over the D replicas, the routed tokens swapped at every MoE layer. Every MoE
//! fixture at tp 1 and 2 with 2 and 3 replicas reproduces HF's prompt logits and greedy
//! tokens for the sequences that carry HF's prompt, while a replica that finished early keeps
//! answering the others; every (token, expert) pair is computed once in the EP group.

use crate::common;
use common::{read_reference, rel_error, REL_TOL};

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::ir::ExpertSplit;
use tpc::passes::ShardOptions;
use tpc::pipeline::{compile_with, split_stages};
use tpc::runtime::generate::{Request, RunOptions};
use tpc::runtime::replicas::run_replicas;
use tpc::runtime::weights::Checkpoint;

fn exact(new_tokens: usize) -> RunOptions {
    RunOptions {
        max_new_tokens: new_tokens,
        device: tpc::runtime::device::Device::Cpu(tpc::runtime::cpu::CpuOptions {
            isa: Some(tpc::runtime::cpu::isa::Kernels::exact().isa()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The plan at `tp` with `split`, cut into `pp` stages.
pub(super) fn staged_plan(dir: &Path, tp: u64, pp: u64, split: ExpertSplit) -> tpc::plan::Plan {
    let mut plan = plan(dir, tp, split);
    if pp > 1 {
        split_stages(&mut plan, pp, None).unwrap();
    }
    plan
}

fn plan(dir: &Path, tp: u64, split: impl Into<Option<ExpertSplit>>) -> tpc::plan::Plan {
    let options = ShardOptions {
        moe: split.into(),
        ..Default::default()
    };
    compile_with(&load_model(dir).unwrap(), tp, options)
        .unwrap()
        .plan
}

#[test]
fn experts_dealt_over_replicas_match_hf_on_every_moe_fixture() {
    let mut runs = 0;
    for case in common::MOE_FIXTURES {
        let dir = Path::new("tests/fixtures/checkpoints").join(case);
        let reference = read_reference(&dir);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let n = reference.greedy.len();
        // HF's prompt to the end, HF's prompt for 2 tokens (its replica then only answers the
        // others), and a prompt of our own.
        let other: Vec<i64> = reference.prompt.iter().rev().take(5).copied().collect();
        let requests = vec![
            Request {
                prompt: reference.prompt.clone(),
                max_new_tokens: None,
            },
            Request {
                prompt: reference.prompt.clone(),
                max_new_tokens: Some(2),
            },
            Request {
                prompt: other,
                max_new_tokens: None,
            },
        ];
        for (tp, pp, dp, split) in [
            (1, 1, 2, ExpertSplit::Expert),
            (1, 1, 3, ExpertSplit::Expert),
            (2, 1, 2, ExpertSplit::Expert),
            (2, 1, 2, ExpertSplit::Tensor),
            // Two stages: each stage's ranks share its layers' experts with the same
            // stage of the other replicas.
            (1, 2, 2, ExpertSplit::Expert),
            (2, 2, 2, ExpertSplit::Tensor),
        ] {
            let what = format!("{case} tp {tp} pp {pp} dp {dp} --ep --moe {}", split.word());
            let plan = staged_plan(&dir, tp, pp, split);
            let alone = run_replicas(&plan, &ckpt, &requests, &exact(n), 1).unwrap();
            let opts = RunOptions {
                expert_parallel: true,
                ..exact(n)
            };
            let out = run_replicas(&plan, &ckpt, &requests, &opts, dp).unwrap();
            for (s, new) in out.sequences[..2].iter().zip([n, 2]) {
                let err = rel_error(&s.prompt_logits.data, &reference.logits);
                eprintln!("{what}: rel err {err:.2e}");
                assert!(err <= REL_TOL, "{what}: relative error {err:.3e}");
                assert_eq!(
                    s.generated,
                    reference.greedy[..new],
                    "{what}: greedy tokens"
                );
            }
            assert_eq!(
                out.sequences[2].generated, alone.sequences[2].generated,
                "{what}: our own prompt, as without --ep"
            );
            // One load per rank of the EP group (DP × PP × TP), and each pair computed once
            // per rank that computes it without --ep too.
            assert_eq!(
                out.routed_pairs_per_rank.len(),
                (tp as usize) * (pp as usize) * dp,
                "{what}"
            );
            let total = |v: &[u64]| v.iter().sum::<u64>();
            assert_eq!(
                total(&out.routed_pairs_per_rank),
                total(&alone.routed_pairs_per_rank),
                "{what}: (token, expert) pairs"
            );
            assert!(
                out.weight_bytes < alone.weight_bytes,
                "{what}: a replica holds {} bytes of weights, {} without --ep",
                out.weight_bytes,
                alone.weight_bytes
            );
            runs += 1;
        }
    }
    assert_eq!(runs, 24);
}

#[test]
fn expert_parallelism_is_refused_where_it_cannot_apply() {
    let two = vec![
        Request {
            prompt: vec![1, 2, 3],
            max_new_tokens: None,
        };
        2
    ];
    let opts = RunOptions {
        expert_parallel: true,
        ..exact(2)
    };
    let dense = Path::new("tests/fixtures/checkpoints/llama-gqa");
    let p = plan(dense, 1, None);
    let err = run_replicas(&p, &Checkpoint::open(dense).unwrap(), &two, &opts, 2).unwrap_err();
    assert!(
        err.to_string().contains("no mixture-of-experts layers"),
        "{err}"
    );
}

/// A checkpoint whose `after`-th read fails (counting from 0, every replica's reads
/// together): a replica that cannot load.
pub(super) struct ReadsFail {
    inner: Checkpoint,
    reads: std::sync::atomic::AtomicUsize,
    after: usize,
}

impl ReadsFail {
    pub(super) fn new(dir: &Path, after: usize) -> ReadsFail {
        ReadsFail {
            inner: Checkpoint::open(dir).unwrap(),
            reads: Default::default(),
            after,
        }
    }

    /// Counts reads from 0 again.
    pub(super) fn reset(&self) {
        self.reads.store(0, std::sync::atomic::Ordering::SeqCst);
    }

    fn tick(&self) -> Result<(), tpc::runtime::weights::WeightError> {
        let k = self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if k == self.after {
            return Err(tpc::runtime::weights::WeightError::Slice {
                name: "injected".into(),
                problem: "the disk went away".into(),
            });
        }
        Ok(())
    }
}

impl tpc::runtime::weights::WeightSource for ReadsFail {
    fn check(&self, plan: &tpc::plan::Plan) -> Result<(), tpc::runtime::weights::WeightError> {
        self.inner.check(plan)
    }
    fn read(
        &self,
        tensor: &str,
        from: usize,
        count: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), tpc::runtime::weights::WeightError> {
        self.tick()?;
        self.inner.read(tensor, from, count, out)
    }
    fn read_stored_rows(
        &self,
        w: &tpc::plan::WeightSlice,
        rows: std::ops::Range<usize>,
        into: &mut tpc::runtime::weights::StoredRows,
    ) -> Result<bool, tpc::runtime::weights::WeightError> {
        self.tick()?;
        self.inner.read_stored_rows(w, rows, into)
    }
}

#[test]
fn a_replica_that_fails_stops_the_others_and_is_the_error_reported() {
    let dir = Path::new("tests/fixtures/checkpoints/mixtral-moe");
    let source = ReadsFail::new(dir, 0);
    let requests = vec![
        Request {
            prompt: vec![1, 2, 3],
            max_new_tokens: None,
        };
        3
    ];
    let opts = RunOptions {
        expert_parallel: true,
        ..exact(4)
    };
    for (tp, dp) in [(1, 2), (1, 3), (2, 2)] {
        source.reset();
        let p = plan(dir, tp, ExpertSplit::Expert);
        let err = run_replicas(&p, &source, &requests, &opts, dp).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("the disk went away"),
            "tp {tp} dp {dp}: {text}"
        );
    }
}
