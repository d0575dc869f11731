//! The executor's paged KV cache: steps that bring their own block tables (out of order,
//! a prompt in chunks, a prompt prefix shared with another sequence) give the logits the
//! sequence-slot API gives over the executor's own blocks, and tables that the pool cannot
//! serve are refused.

use std::path::Path;
use tpc::frontend::load::load_model;
use tpc::pipeline::compile;
use tpc::plan::Plan;
use tpc::runtime::comm::local_group;
use tpc::runtime::cpu::CpuBackend;
use tpc::runtime::executor::{OutputRows, RankExecutor, SeqStep};
use tpc::runtime::random::RandomWeights;
use tpc::runtime::tensor::Tensor;

fn tiny_llama() -> Plan {
    let def = load_model(Path::new("models/tiny-llama.ron")).unwrap();
    compile(&def, 1).unwrap().plan
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape, want.shape, "{what}: shape");
    for (i, (a, b)) in got.data.iter().zip(&want.data).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "{what}: logit {i}: {a} vs {b}"
        );
    }
}

#[test]
fn steps_through_their_own_tables_match_numbered_sequences() {
    let plan = tiny_llama();
    let weights = RandomWeights::new(&plan, 11);
    let run = |threads| {
        let comm = local_group(1).pop().unwrap();
        RankExecutor::new(
            &plan.ranks[0],
            plan.numerics,
            &weights,
            CpuBackend::new(threads),
            comm,
        )
        .unwrap()
    };
    let a: Vec<i64> = (0..11).map(|i| (i * 37 + 5) % 250).collect();
    // b shares a's first 8 tokens: two full blocks of 4.
    let mut b: Vec<i64> = a[..8].to_vec();
    b.extend([201, 17, 99]);
    let next = [3i64, 141, 77];

    // The sequence-slot API: a and b as numbered sequences, whole prompts, then decoding.
    let mut numbered = run(2);
    let want_a = numbered.forward(&[(0, &a)], OutputRows::All).unwrap();
    let want_b = numbered
        .forward(&[(1, &b)], OutputRows::LastOfEach)
        .unwrap();
    let mut want_steps = Vec::new();
    for &t in &next {
        want_steps.push(
            numbered
                .forward(&[(1, &[t]), (0, &[t])], OutputRows::LastOfEach)
                .unwrap(),
        );
    }

    for threads in [1, 2] {
        let mut exec = run(threads);
        exec.set_kv_pool(4, 12).unwrap();
        assert_eq!(exec.kv_blocks(), 12);
        // a: blocks out of order, its prompt in two chunks (the second starts mid-block).
        let table_a: [u32; 4] = [7, 2, 9, 0];
        let first = exec
            .forward_steps(
                &[SeqStep {
                    tokens: &a[..6],
                    start: 0,
                    blocks: &table_a,
                }],
                OutputRows::All,
            )
            .unwrap();
        let rest = exec
            .forward_steps(
                &[SeqStep {
                    tokens: &a[6..],
                    start: 6,
                    blocks: &table_a,
                }],
                OutputRows::All,
            )
            .unwrap();
        let vocab = want_a.cols();
        let mut chunks = first.data.clone();
        chunks.extend_from_slice(&rest.data);
        let chunks = Tensor::new(vec![a.len(), vocab], chunks);
        assert_close(&format!("threads {threads}: a in chunks"), &chunks, &want_a);
        // b: a's first two blocks (cached, only read), then a block of its own.
        let table_b: [u32; 4] = [7, 2, 5, 10];
        let got_b = exec
            .forward_steps(
                &[SeqStep {
                    tokens: &b[8..],
                    start: 8,
                    blocks: &table_b,
                }],
                OutputRows::LastOfEach,
            )
            .unwrap();
        assert_close(
            &format!("threads {threads}: b on a's prefix"),
            &got_b,
            &want_b,
        );
        // Both decode together, b first; a's blocks are what a wrote.
        for (n, (&t, want)) in next.iter().zip(&want_steps).enumerate() {
            let got = exec
                .forward_steps(
                    &[
                        SeqStep {
                            tokens: &[t],
                            start: b.len() + n,
                            blocks: &table_b,
                        },
                        SeqStep {
                            tokens: &[t],
                            start: a.len() + n,
                            blocks: &table_a,
                        },
                    ],
                    OutputRows::LastOfEach,
                )
                .unwrap();
            assert_close(&format!("threads {threads}: decode step {n}"), &got, want);
        }
        // The greedy pick over steps is the logits' argmax.
        let picked = exec
            .forward_steps_argmax(
                &[SeqStep {
                    tokens: &[9],
                    start: a.len() + next.len(),
                    blocks: &table_a,
                }],
                OutputRows::LastOfEach,
            )
            .unwrap()
            .unwrap();
        assert_eq!(picked.len(), 1);
    }
}

#[test]
fn tables_the_pool_cannot_serve_are_refused() {
    let plan = tiny_llama();
    let weights = RandomWeights::new(&plan, 3);
    let comm = local_group(1).pop().unwrap();
    let mut exec = RankExecutor::new(
        &plan.ranks[0],
        plan.numerics,
        &weights,
        CpuBackend::new(1),
        comm,
    )
    .unwrap();
    exec.set_kv_pool(4, 3).unwrap();
    let bytes4 = exec.kv_block_bytes();
    // Two layers of 2 kv heads of 8 dims: keys and values, f32, 4 tokens a block.
    assert_eq!(bytes4, 2 * 2 * (2 * 8) * 4 * 4);
    let tokens = [1i64, 2, 3, 4, 5];
    for (blocks, start, what) in [
        (&[0u32][..], 0, "a table of 1 block of 4 for 5 positions"),
        (&[0u32, 3][..], 0, "block 3 of 3"),
        (
            &[0u32, 1][..],
            4,
            "a table of 2 blocks for positions up to 9",
        ),
    ] {
        let step = SeqStep {
            tokens: &tokens,
            start,
            blocks,
        };
        assert!(
            exec.forward_steps(&[step], OutputRows::LastOfEach).is_err(),
            "{what}: accepted"
        );
    }
    assert!(exec.set_kv_pool(0, 3).is_err(), "blocks of 0 tokens");
    // The numbered sequences take blocks past the caller's; while they hold some, the block
    // size may not change nor the caller's range grow over them.
    exec.forward(&[(0, &tokens)], OutputRows::LastOfEach)
        .unwrap();
    assert!(exec.kv_blocks() >= 5);
    assert!(exec.set_kv_pool(8, 3).is_err(), "a new block size");
    assert!(
        exec.set_kv_pool(4, 4).is_err(),
        "a range over the numbered blocks"
    );
    exec.reset();
    exec.set_kv_pool(8, 4).unwrap();
    assert_eq!(exec.kv_block_bytes(), 2 * bytes4);
    assert_eq!(exec.kv_blocks(), 4);
    // The numbered sequences work on after it, on blocks past the caller's (a reservation
    // grows the pools exactly).
    exec.reserve(0, 5);
    assert_eq!(exec.kv_blocks(), 5);
    exec.forward(&[(0, &tokens)], OutputRows::LastOfEach)
        .unwrap();
    assert_eq!(exec.kv_blocks(), 5);
}
