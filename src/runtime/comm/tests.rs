//! Tests of the in-process group against straightforward sequential references.
//!
//! Every group runs on real threads. A rank that does not report back within
//! [`WATCHDOG`] fails the test as a hang; no test measures speed.

use super::reduce::{chunk_range, summation_order};
use super::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

/// Hang detector: how long to wait for every rank to report. Only a hang gets near it.
const WATCHDOG: Duration = Duration::from_secs(120);

/// Larger than either one-shot threshold, so `Auto` runs the ring.
const RING_ELEMS: usize = ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED / 4 + 1000;

/// Runs `body(comm)` on one thread per rank of a new group and returns each rank's outcome
/// (`Err` holds the panic message), in rank order.
fn run_group<T, F>(n: usize, body: F) -> Vec<Result<T, String>>
where
    T: Send + 'static,
    F: Fn(LocalComm) -> T + Send + Sync + 'static,
{
    run_comms(local_group(n), body)
}

fn run_comms<T, F>(comms: Vec<LocalComm>, body: F) -> Vec<Result<T, String>>
where
    T: Send + 'static,
    F: Fn(LocalComm) -> T + Send + Sync + 'static,
{
    let n = comms.len();
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let (body, tx) = (body.clone(), tx.clone());
            thread::spawn(move || {
                let rank = comm.rank();
                let outcome = catch_unwind(AssertUnwindSafe(|| body(comm))).map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                });
                let _ = tx.send((rank, outcome));
            })
        })
        .collect();
    drop(tx);
    let mut outcomes: Vec<Option<Result<T, String>>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        match rx.recv_timeout(WATCHDOG) {
            Ok((rank, outcome)) => outcomes[rank] = Some(outcome),
            Err(_) => {
                let missing: Vec<usize> = (0..n).filter(|&r| outcomes[r].is_none()).collect();
                panic!("ranks {missing:?} of {n} did not finish within {WATCHDOG:?}: hang");
            }
        }
    }
    for h in handles {
        h.join().unwrap();
    }
    outcomes.into_iter().map(Option::unwrap).collect()
}

fn ok<T>(outcomes: Vec<Result<T, String>>) -> Vec<T> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, o)| o.unwrap_or_else(|msg| panic!("rank {rank} panicked: {msg}")))
        .collect()
}

/// Small integers: every summation order gives the exact same result.
fn exact_input(rank: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7 + salt * 13) % 17) as f32 - 8.0)
        .collect()
}

/// Values of very different magnitudes and both signs: the summation order changes bits.
fn order_sensitive_input(rank: usize, len: usize) -> Vec<f32> {
    let mut x = (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let exponent = (x % 48) as i32 - 24;
            let mantissa = 1.0 + ((x >> 8) % 1000) as f32 / 1000.0;
            let sign = if (x >> 20) & 1 == 0 { 1.0 } else { -1.0 };
            sign * mantissa * 2f32.powi(exponent)
        })
        .collect()
}

/// Sum over ranks, in rank order.
fn reference_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let len = inputs[0].len();
    (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).fold(0.0, |a, v| a + v))
        .collect()
}

/// The documented order (`reduce` module): element `i` of chunk `c` is summed starting at
/// rank `c + 1`, ending with rank `c`.
fn canonical_all_reduce(inputs: &[Vec<f32>]) -> Vec<f32> {
    let (n, len) = (inputs.len(), inputs[0].len());
    (0..len)
        .map(|i| {
            let c = (0..n)
                .find(|&c| chunk_range(len, n, c).contains(&i))
                .unwrap();
            let mut order = summation_order(n, c);
            let first = inputs[order.next().unwrap()][i];
            order.fold(first, |acc, q| acc + inputs[q][i])
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const ALGORITHMS: [AllReduceAlgorithm; 4] = [
    AllReduceAlgorithm::Auto,
    AllReduceAlgorithm::OneShot,
    AllReduceAlgorithm::TwoShot,
    AllReduceAlgorithm::Ring,
];

/// Small, odd and aligned lengths, both sides of both one-shot thresholds, and a large one.
fn all_reduce_lengths() -> Vec<usize> {
    vec![
        0,
        1,
        2,
        3,
        7,
        15,
        16,
        17,
        33,
        100,
        ONE_SHOT_MAX_BYTES / 4,
        ONE_SHOT_MAX_BYTES / 4 + 1,
        4097,
        ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED / 4,
        ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED / 4 + 1,
        3 * RING_ELEMS + 5,
    ]
}

#[test]
fn all_reduce_matches_reference_for_every_size_and_algorithm() {
    for n in 1..=8 {
        // One group per world size, reused for every length and algorithm.
        let results = ok(run_group(n, move |mut comm| {
            let rank = comm.rank();
            let mut out = Vec::new();
            for (salt, len) in all_reduce_lengths().into_iter().enumerate() {
                for algorithm in ALGORITHMS {
                    let mut buf = exact_input(rank, len, salt);
                    comm.all_reduce_sum_with(&mut buf, algorithm).unwrap();
                    out.push((len, algorithm, buf));
                }
            }
            out
        }));
        for (salt, len) in all_reduce_lengths().into_iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| exact_input(r, len, salt)).collect();
            let expected = reference_sum(&inputs);
            for (rank, per_rank) in results.iter().enumerate() {
                for (l, algorithm, got) in per_rank.iter().filter(|(l, ..)| *l == len) {
                    assert_eq!(got, &expected, "n {n} rank {rank} len {l} {algorithm}");
                }
            }
        }
    }
}

/// Every collective and algorithm, small: the test to run under Miri, which checks the
/// unsafe peer accesses for data races and aliasing violations:
/// `cargo +nightly miri test --lib runtime::comm::tests::small_`.
///
/// Every buffer is overwritten and then freed as soon as its collective returns, so a rank
/// that returned while a peer still read its memory would be a data race or a
/// use-after-free that Miri reports.
#[test]
fn small_groups_run_every_collective() {
    for n in 1..=4 {
        ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            for len in [0, 1, 17, 100] {
                let inputs: Vec<_> = (0..n).map(|r| exact_input(r, len, len)).collect();
                for algorithm in ALGORITHMS {
                    let mut buf = exact_input(rank, len, len);
                    comm.all_reduce_sum_with(&mut buf, algorithm).unwrap();
                    let sum = buf.clone();
                    buf.fill(f32::NAN);
                    drop(buf);
                    assert_eq!(sum, reference_sum(&inputs), "{algorithm} len {len}");
                }
                let mut local = exact_input(rank, len, 1);
                let mut gathered = vec![0.0; n * len];
                comm.all_gather(&local, &mut gathered).unwrap();
                local.fill(f32::NAN);
                drop(local);
                let mut piece = vec![0.0; len];
                comm.reduce_scatter_sum(&gathered, &mut piece).unwrap();
                gathered.fill(f32::NAN);
                drop(gathered);
                let expected: Vec<f32> = exact_input(rank, len, 1)
                    .iter()
                    .map(|x| x * n as f32)
                    .collect();
                assert_eq!(piece, expected);
                comm.barrier().unwrap();
            }
        }));
    }
}

/// The unwind guard and failure paths, small (also run under Miri).
#[test]
fn small_failures_release_everyone() {
    let mut comms = local_group(3);
    comms[1].panic_in_ring_step = Some(1);
    let outcomes = run_comms(comms, |mut comm| {
        let mut buf = exact_input(comm.rank(), 100, 0);
        let first = comm.all_reduce_sum_with(&mut buf, AllReduceAlgorithm::Ring);
        (first, comm.all_reduce_sum(&mut buf))
    });
    assert!(outcomes[1].as_ref().unwrap_err().contains("injected panic"));
    for rank in [0, 2] {
        let (first, second) = outcomes[rank].as_ref().unwrap();
        assert!(matches!(first, Err(CommError::PeerFailed { peer: 1, .. })));
        assert!(matches!(second, Err(CommError::PeerFailed { peer: 1, .. })));
    }
    for algorithm in ALGORITHMS {
        let outcomes = run_group(3, move |mut comm| {
            let mut buf = exact_input(comm.rank(), 40, 0);
            comm.all_reduce_sum(&mut buf).unwrap();
            if comm.rank() == 0 {
                comm.abort();
            }
            comm.all_reduce_sum_with(&mut buf, algorithm)
        });
        for (rank, outcome) in ok(outcomes).into_iter().enumerate().skip(1) {
            assert_eq!(
                outcome,
                Err(CommError::PeerFailed {
                    rank,
                    peer: 0,
                    cause: FailureCause::Aborted,
                    during: Collective::AllReduceSum
                }),
                "{algorithm}"
            );
        }
    }
}

#[test]
fn all_gather_matches_reference() {
    let lengths = [0, 1, 3, 5, 16, 17, 100, 1001, 20_000];
    for n in 1..=8 {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            lengths
                .iter()
                .map(|&m| {
                    let local = exact_input(rank, m, m);
                    let mut out = vec![f32::NAN; n * m];
                    comm.all_gather(&local, &mut out).unwrap();
                    out
                })
                .collect::<Vec<_>>()
        }));
        for (k, &m) in lengths.iter().enumerate() {
            let expected: Vec<f32> = (0..n).flat_map(|r| exact_input(r, m, m)).collect();
            for (rank, per_rank) in results.iter().enumerate() {
                assert_eq!(per_rank[k], expected, "n {n} rank {rank} m {m}");
            }
        }
    }
}

#[test]
fn reduce_scatter_matches_reference() {
    let lengths = [0, 1, 3, 5, 16, 17, 100, 1001, 20_000];
    for n in 1..=8 {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            lengths
                .iter()
                .map(|&m| {
                    let input = exact_input(rank, n * m, m);
                    let mut out = vec![f32::NAN; m];
                    comm.reduce_scatter_sum(&input, &mut out).unwrap();
                    out
                })
                .collect::<Vec<_>>()
        }));
        for (k, &m) in lengths.iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| exact_input(r, n * m, m)).collect();
            let full = reference_sum(&inputs);
            for (rank, per_rank) in results.iter().enumerate() {
                let piece = &full[rank * m..(rank + 1) * m];
                assert_eq!(per_rank[k], piece, "n {n} rank {rank} m {m}");
            }
        }
    }
}

/// Same bits on every rank, in every run, for every algorithm, equal to the documented
/// order — with data for which the order matters.
#[test]
fn sums_are_bit_identical_across_ranks_runs_and_algorithms() {
    for n in [2, 3, 4, 5, 7, 8] {
        for len in [1000, 2 * RING_ELEMS + 77] {
            let inputs: Vec<_> = (0..n).map(|r| order_sensitive_input(r, len)).collect();
            let canonical = bits(&canonical_all_reduce(&inputs));
            if n >= 3 {
                // The test means something only if another order gives other bits.
                assert_ne!(canonical, bits(&reference_sum(&inputs)), "n {n} len {len}");
            }
            for run in 0..2 {
                let results = ok(run_group(n, move |mut comm| {
                    let rank = comm.rank();
                    ALGORITHMS
                        .iter()
                        .map(|&algorithm| {
                            let mut buf = order_sensitive_input(rank, len);
                            comm.all_reduce_sum_with(&mut buf, algorithm).unwrap();
                            bits(&buf)
                        })
                        .collect::<Vec<_>>()
                }));
                for (rank, per_rank) in results.iter().enumerate() {
                    for (got, algorithm) in per_rank.iter().zip(ALGORITHMS) {
                        assert!(
                            *got == canonical,
                            "n {n} len {len} run {run} rank {rank} {algorithm}: bits differ"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_sums_in_the_documented_order() {
    for n in [3, 4, 8] {
        let m = 999;
        let results = ok(run_group(n, move |mut comm| {
            let input = order_sensitive_input(comm.rank(), n * m);
            let mut out = vec![0.0; m];
            comm.reduce_scatter_sum(&input, &mut out).unwrap();
            bits(&out)
        }));
        let inputs: Vec<_> = (0..n).map(|r| order_sensitive_input(r, n * m)).collect();
        for (rank, got) in results.iter().enumerate() {
            let expected: Vec<u32> = (rank * m..(rank + 1) * m)
                .map(|i| {
                    let mut order = summation_order(n, rank);
                    let first = inputs[order.next().unwrap()][i];
                    order.fold(first, |acc, q| acc + inputs[q][i]).to_bits()
                })
                .collect();
            assert!(*got == expected, "n {n} rank {rank}: bits differ");
        }
    }
}

/// Unequal pieces, some empty, for `n` ranks (pattern `k`).
fn uneven_counts(n: usize, k: usize) -> Vec<usize> {
    (0..n)
        .map(|q| match k {
            0 => q,
            1 => (q * 7 + 3) % 5 * 211,
            2 => usize::from(q == n - 1) * 1001,
            _ => 4000 + q * 13,
        })
        .collect()
}

#[test]
fn all_gather_of_unequal_pieces_matches_reference() {
    for n in 1..=6 {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            (0..4)
                .map(|k| {
                    let counts = uneven_counts(n, k);
                    let local = exact_input(rank, counts[rank], k);
                    let mut out = vec![f32::NAN; counts.iter().sum()];
                    comm.all_gather_counts(&local, &counts, &mut out).unwrap();
                    out
                })
                .collect::<Vec<_>>()
        }));
        for k in 0..4 {
            let counts = uneven_counts(n, k);
            let expected: Vec<f32> = (0..n).flat_map(|q| exact_input(q, counts[q], k)).collect();
            for (rank, per_rank) in results.iter().enumerate() {
                assert_eq!(per_rank[k], expected, "n {n} rank {rank} counts {counts:?}");
            }
        }
    }
}

/// Each rank's unequal piece is the sum over ranks in the order the equal reduce-scatter
/// adds (bit for bit, with data for which the order matters).
#[test]
fn reduce_scatter_of_unequal_pieces_sums_in_the_documented_order() {
    for n in [1, 2, 3, 4, 7] {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            (0..4)
                .map(|k| {
                    let counts = uneven_counts(n, k);
                    let input = order_sensitive_input(rank, counts.iter().sum());
                    let mut out = vec![f32::NAN; counts[rank]];
                    comm.reduce_scatter_sum_counts(&input, &counts, &mut out)
                        .unwrap();
                    bits(&out)
                })
                .collect::<Vec<_>>()
        }));
        for k in 0..4 {
            let counts = uneven_counts(n, k);
            let total: usize = counts.iter().sum();
            let inputs: Vec<_> = (0..n).map(|r| order_sensitive_input(r, total)).collect();
            for (rank, per_rank) in results.iter().enumerate() {
                let at: usize = counts[..rank].iter().sum();
                let expected: Vec<u32> = (at..at + counts[rank])
                    .map(|i| {
                        let mut order = summation_order(n, rank);
                        let first = inputs[order.next().unwrap()][i];
                        order.fold(first, |acc, q| acc + inputs[q][i]).to_bits()
                    })
                    .collect();
                assert!(
                    per_rank[k] == expected,
                    "n {n} rank {rank} counts {counts:?}"
                );
            }
        }
    }
}

/// Ranks that pass different counts (even with the same total) all get an error, and the
/// group stays usable; a rank whose own piece is not its count fails every rank.
#[test]
fn unequal_pieces_with_disagreeing_counts_fail_every_rank() {
    let outcomes = ok(run_group(3, |mut comm| {
        let rank = comm.rank();
        let counts = if rank == 1 { [2, 1, 3] } else { [1, 2, 3] };
        let local = vec![1.0f32; counts[rank]];
        let mut out = vec![0.0f32; 6];
        let gather = comm.all_gather_counts(&local, &counts, &mut out);
        let mut piece = vec![0.0f32; counts[rank]];
        let scatter = comm.reduce_scatter_sum_counts(&[1.0f32; 6], &counts, &mut piece);
        // A piece of the wrong length on rank 2 only.
        let wrong = vec![1.0f32; if rank == 2 { 2 } else { [1, 2, 3][rank] }];
        let bad_piece = comm.all_gather_counts(&wrong, &[1, 2, 3], &mut out);
        let after = comm.all_gather_counts(&[rank as f32; 1], &[1, 1, 1], &mut out[..3]);
        (gather, scatter, bad_piece, after, out[..3].to_vec())
    }));
    for (rank, (gather, scatter, bad_piece, after, out)) in outcomes.into_iter().enumerate() {
        assert!(
            matches!(gather, Err(CommError::PeerMismatch { .. })),
            "rank {rank}: {gather:?}"
        );
        assert!(
            matches!(scatter, Err(CommError::PeerMismatch { .. })),
            "rank {rank}: {scatter:?}"
        );
        match rank {
            2 => assert!(
                matches!(bad_piece, Err(CommError::SizeMismatch { .. })),
                "{bad_piece:?}"
            ),
            _ => assert!(
                matches!(bad_piece, Err(CommError::PeerBadArguments { peer: 2, .. })),
                "rank {rank}: {bad_piece:?}"
            ),
        }
        after.unwrap();
        assert_eq!(out, [0.0, 1.0, 2.0], "rank {rank}");
    }
}

/// Rank 2 of 4 panics after the first collective; the others enter the second one (some
/// may already be blocked in it, some enter later) and all get `PeerFailed` from rank 2.
#[test]
fn a_panicking_rank_fails_the_next_collective_everywhere() {
    for (len, delay_ms) in [(100, 0), (100, 50), (RING_ELEMS, 0), (RING_ELEMS, 50)] {
        let outcomes = run_group(4, move |mut comm| {
            let mut buf = exact_input(comm.rank(), len, 0);
            comm.all_reduce_sum(&mut buf).unwrap();
            if comm.rank() == 2 {
                // Give the others time to block in the second all-reduce (either way the
                // outcome must be the same).
                thread::sleep(Duration::from_millis(delay_ms));
                panic!("rank 2 fails");
            }
            let second = comm.all_reduce_sum(&mut buf);
            let later = comm.all_gather(&buf[..1], &mut [0.0; 4]);
            (second, later)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            if rank == 2 {
                assert!(outcome.unwrap_err().contains("rank 2 fails"));
                continue;
            }
            let (second, later) = outcome.unwrap();
            let expected = |during| CommError::PeerFailed {
                rank,
                peer: 2,
                cause: FailureCause::Panicked,
                during,
            };
            assert_eq!(second, Err(expected(Collective::AllReduceSum)), "len {len}");
            assert_eq!(later, Err(expected(Collective::AllGather)), "len {len}");
        }
    }
}

#[test]
fn every_collective_reports_the_failure() {
    type Op = fn(&mut LocalComm) -> Result<(), CommError>;
    let ops: [(Collective, Op); 4] = [
        (Collective::AllReduceSum, |c| {
            c.all_reduce_sum(&mut vec![1.0; 3 * RING_ELEMS])
        }),
        (Collective::AllGather, |c| {
            let n = c.world_size();
            c.all_gather(&[1.0; 7], &mut vec![0.0; 7 * n])
        }),
        (Collective::ReduceScatterSum, |c| {
            let n = c.world_size();
            c.reduce_scatter_sum(&vec![1.0; 7 * n], &mut [0.0; 7])
        }),
        (Collective::Barrier, |c| c.barrier()),
    ];
    for (during, op) in ops {
        let outcomes = run_group(3, move |mut comm| {
            op(&mut comm).unwrap();
            if comm.rank() == 0 {
                comm.abort();
                return (op(&mut comm), op(&mut comm));
            }
            (op(&mut comm), op(&mut comm))
        });
        for (rank, outcome) in ok(outcomes).into_iter().enumerate() {
            let expected = if rank == 0 {
                CommError::Aborted { rank, during }
            } else {
                CommError::PeerFailed {
                    rank,
                    peer: 0,
                    cause: FailureCause::Aborted,
                    during,
                }
            };
            assert_eq!(outcome, (Err(expected.clone()), Err(expected)), "{during}");
        }
    }
}

#[test]
fn dropping_a_communicator_fails_the_others() {
    let outcomes = run_group(3, |mut comm| {
        comm.barrier().unwrap();
        if comm.rank() == 1 {
            drop(comm);
            return Ok(());
        }
        comm.all_reduce_sum(&mut [1.0, 2.0])
    });
    for (rank, outcome) in ok(outcomes).into_iter().enumerate() {
        if rank != 1 {
            assert_eq!(
                outcome,
                Err(CommError::PeerFailed {
                    rank,
                    peer: 1,
                    cause: FailureCause::Dropped,
                    during: Collective::AllReduceSum,
                })
            );
        }
    }
}

/// A panic inside a ring step (between reading peers' data and the next wait): the
/// panicking rank still makes that wait, the others get `PeerFailed` from it.
#[test]
fn a_panic_inside_a_ring_step_fails_the_collective_everywhere() {
    for (n, bad, step) in [(2, 0, 0), (4, 3, 1), (8, 5, 6)] {
        let mut comms = local_group(n);
        comms[bad].panic_in_ring_step = Some(step);
        let outcomes = run_comms(comms, move |mut comm| {
            let mut buf = exact_input(comm.rank(), 3 * RING_ELEMS, 1);
            let first = comm.all_reduce_sum_with(&mut buf, AllReduceAlgorithm::Ring);
            let second = comm.barrier();
            (first, second)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            if rank == bad {
                assert!(outcome.unwrap_err().contains("injected panic"));
                continue;
            }
            let failed = |during| CommError::PeerFailed {
                rank,
                peer: bad,
                cause: FailureCause::Panicked,
                during,
            };
            assert_eq!(
                outcome.unwrap(),
                (
                    Err(failed(Collective::AllReduceSum)),
                    Err(failed(Collective::Barrier))
                ),
                "n {n}"
            );
        }
    }
}

/// Two-shot at the edges of its split: no element, one, fewer than the ranks, lengths that
/// leave chunks short or empty, and a large message; `f32` and `bf16`, bit for bit the
/// documented order (what one-shot and ring give) on every rank.
#[test]
fn two_shot_gives_the_documented_bits_for_every_split() {
    let two_shot = AllReduceAlgorithm::TwoShot;
    for n in 2..=8 {
        let mut lengths = vec![0, 1, n - 1, n, n + 1, 16 * n - 1, 16 * n + 1, 48 * n + 7];
        if [2, 3, 4, 8].contains(&n) {
            lengths.push((1 << 20) + 3);
        }
        let ls = lengths.clone();
        let results = ok(run_group(n, move |mut comm| {
            let rank = comm.rank();
            ls.iter()
                .map(|&len| {
                    let mut f = order_sensitive_input(rank, len);
                    comm.all_reduce_sum_with(&mut f, two_shot).unwrap();
                    let mut h = bf16_input(rank, len);
                    comm.all_reduce_sum_with(&mut h, two_shot).unwrap();
                    (bits(&f), bf16_bits(&h))
                })
                .collect::<Vec<_>>()
        }));
        for (k, &len) in lengths.iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| order_sensitive_input(r, len)).collect();
            let want = if len == 0 {
                Vec::new()
            } else {
                bits(&canonical_all_reduce(&inputs))
            };
            let inputs16: Vec<_> = (0..n).map(|r| bf16_input(r, len)).collect();
            let want16 = if len == 0 {
                Vec::new()
            } else {
                bf16_bits(&canonical_bf16_all_reduce(&inputs16))
            };
            for (rank, per_rank) in results.iter().enumerate() {
                assert!(
                    per_rank[k].0 == want,
                    "n {n} rank {rank} len {len}: f32 bits"
                );
                assert!(
                    per_rank[k].1 == want16,
                    "n {n} rank {rank} len {len}: bf16 bits"
                );
            }
        }
    }
}

/// A panic in the two-shot's reduce-scatter (after reading peers' buffers, before the
/// wait): the panicking rank still makes that wait, the others get `PeerFailed` from it.
/// The plan's choice of two-shot is what reaches the two-shot code.
#[test]
fn a_panic_inside_the_two_shot_fails_the_collective_everywhere() {
    for (n, bad) in [(2, 0), (3, 1), (8, 5)] {
        let mut comms = local_group(n);
        comms[bad].panic_in_two_shot_reduce = true;
        let outcomes = run_comms(comms, move |mut comm| {
            let mut buf = exact_input(comm.rank(), 3 * RING_ELEMS, 1);
            let first = comm.all_reduce_sum_planned(&mut buf, Some(CollectiveAlgorithm::TwoShot));
            let second = comm.barrier();
            (first, second)
        });
        for (rank, outcome) in outcomes.into_iter().enumerate() {
            if rank == bad {
                assert!(outcome.unwrap_err().contains("injected panic"));
                continue;
            }
            let failed = |during| CommError::PeerFailed {
                rank,
                peer: bad,
                cause: FailureCause::Panicked,
                during,
            };
            assert_eq!(
                outcome.unwrap(),
                (
                    Err(failed(Collective::AllReduceSum)),
                    Err(failed(Collective::Barrier))
                ),
                "n {n}"
            );
        }
    }
}

/// Ranks that force different algorithms, two-shot among them, all get the mismatch naming
/// both, and the group keeps working.
#[test]
fn a_forced_two_shot_must_match_on_every_rank() {
    use AllReduceAlgorithm::{OneShot, Ring, TwoShot};
    let outcomes = ok(run_group(2, |mut comm| {
        let rank = comm.rank();
        let mut errors = Vec::new();
        for pair in [[TwoShot, Ring], [OneShot, TwoShot]] {
            errors.push(
                comm.all_reduce_sum_with(&mut [1.0; 40], pair[rank])
                    .unwrap_err(),
            );
        }
        let mut buf = vec![rank as f32 + 1.0; 40];
        comm.all_reduce_sum_with(&mut buf, TwoShot).unwrap();
        assert_eq!(buf, vec![3.0; 40]);
        errors
    }));
    for (rank, errors) in outcomes.iter().enumerate() {
        let mismatch = |mine: [AllReduceAlgorithm; 2]| CommError::AlgorithmMismatch {
            rank,
            peer: 1 - rank,
            algorithm: mine[rank],
            peer_algorithm: mine[1 - rank],
        };
        assert_eq!(
            errors,
            &[mismatch([TwoShot, Ring]), mismatch([OneShot, TwoShot])]
        );
    }
    assert!(outcomes[0][0].to_string().contains("two-shot"));
}

/// Disagreements are reported on every rank, and the group keeps working afterwards.
#[test]
fn mismatched_calls_fail_on_every_rank_and_the_group_recovers() {
    let outcomes = ok(run_group(2, |mut comm| {
        let rank = comm.rank();
        let mut errors = Vec::new();
        // Different lengths.
        let mut buf = vec![1.0; 10 + rank];
        errors.push(comm.all_reduce_sum(&mut buf).unwrap_err());
        // Different collectives.
        let e = if rank == 0 {
            comm.all_reduce_sum(&mut [1.0; 4]).unwrap_err()
        } else {
            comm.all_gather(&[1.0; 2], &mut [0.0; 4]).unwrap_err()
        };
        errors.push(e);
        // Inconsistent arguments on rank 1.
        let mut out = vec![0.0; if rank == 1 { 5 } else { 6 }];
        errors.push(comm.all_gather(&[1.0; 3], &mut out).unwrap_err());
        // Different forced algorithms.
        let algorithm = [AllReduceAlgorithm::OneShot, AllReduceAlgorithm::Ring][rank];
        errors.push(
            comm.all_reduce_sum_with(&mut [1.0; 4], algorithm)
                .unwrap_err(),
        );
        // Still usable.
        let mut buf = vec![rank as f32 + 1.0; 100];
        comm.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, vec![3.0; 100]);
        comm.barrier().unwrap();
        errors
    }));
    let ar = Collective::AllReduceSum;
    assert_eq!(
        outcomes[0],
        [
            CommError::PeerMismatch {
                rank: 0,
                during: ar,
                len: 10,
                peer: 1,
                peer_during: ar,
                peer_len: 11
            },
            CommError::PeerMismatch {
                rank: 0,
                during: ar,
                len: 4,
                peer: 1,
                peer_during: Collective::AllGather,
                peer_len: 2
            },
            CommError::PeerBadArguments {
                rank: 0,
                during: Collective::AllGather,
                peer: 1
            },
            CommError::AlgorithmMismatch {
                rank: 0,
                peer: 1,
                algorithm: AllReduceAlgorithm::OneShot,
                peer_algorithm: AllReduceAlgorithm::Ring
            },
        ]
    );
    assert_eq!(
        outcomes[1][2],
        CommError::SizeMismatch {
            rank: 1,
            during: Collective::AllGather,
            what: "`out` (must hold world_size × local.len())",
            expected: 6,
            got: 5
        }
    );
    let message = outcomes[1][0].to_string();
    assert!(
        message.contains("rank 1") && message.contains("rank 0") && message.contains("11"),
        "{message}"
    );
}

/// Many rounds of mixed collectives and sizes on one group, every result checked.
#[test]
fn a_group_survives_many_rounds() {
    for (n, rounds) in [(2, 3000), (3, 1000), (8, 300)] {
        let ok_rounds = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            let sizes = [0, 1, 17, 300, 5000, RING_ELEMS + 3];
            for round in 0..rounds {
                let len = sizes[round % sizes.len()];
                let mut buf = exact_input(rank, len, round);
                comm.all_reduce_sum(&mut buf).unwrap();
                let inputs: Vec<_> = (0..n).map(|r| exact_input(r, len, round)).collect();
                assert_eq!(buf, reference_sum(&inputs), "round {round}");
                let m = len % 64;
                let mut gathered = vec![0.0; n * m];
                comm.all_gather(&buf[..m], &mut gathered).unwrap();
                assert!(gathered.chunks(m.max(1)).all(|c| c == &buf[..m]));
                let mut piece = vec![0.0; m];
                comm.reduce_scatter_sum(&gathered, &mut piece).unwrap();
                let expect: Vec<f32> = buf[..m].iter().map(|x| x * n as f32).collect();
                assert_eq!(piece, expect, "round {round}");
                if round % 7 == 0 {
                    comm.barrier().unwrap();
                }
            }
            rounds
        }));
        assert!(ok_rounds.iter().all(|&r| r == rounds));
    }
}

/// `barrier()` orders what ranks did before it before what they do after it.
#[test]
fn barrier_orders_memory() {
    let n = 5;
    let marks: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    let m = marks.clone();
    ok(run_group(n, move |mut comm| {
        for round in 1..=200 {
            m[comm.rank()].store(round, Relaxed);
            comm.barrier().unwrap();
            assert!(m.iter().all(|x| x.load(Relaxed) >= round), "round {round}");
            comm.barrier().unwrap();
        }
    }));
}

#[test]
fn errors_name_the_rank_the_peer_and_the_collective() {
    let e = CommError::PeerFailed {
        rank: 0,
        peer: 2,
        cause: FailureCause::Panicked,
        during: Collective::AllReduceSum,
    };
    assert_eq!(
        e.to_string(),
        "rank 0: all_reduce_sum cannot complete because rank 2 panicked; the group is unusable, build a new one"
    );
}

#[test]
fn auto_switches_at_the_threshold() {
    let auto = AllReduceAlgorithm::Auto;
    assert_eq!(auto.resolve::<f32>(512, 2048), AllReduceAlgorithm::OneShot);
    assert_eq!(auto.resolve::<f32>(513, 2048), AllReduceAlgorithm::Ring);
    assert_eq!(
        AllReduceAlgorithm::Ring.resolve::<f32>(1, 2048),
        AllReduceAlgorithm::Ring
    );
    let cores = thread::available_parallelism().map_or(1, |c| c.get());
    for n in [1, 2, 8] {
        let expected = if n <= cores {
            ONE_SHOT_MAX_BYTES
        } else {
            ONE_SHOT_MAX_BYTES_OVERSUBSCRIBED
        };
        assert_eq!(local_group(n)[0].one_shot_max_bytes(), expected);
    }
}

#[test]
#[should_panic(expected = "1..=1024 ranks, got 0")]
fn an_empty_group_is_refused() {
    local_group(0);
}

// ---- Element types other than f32, broadcast, point to point ----

use half::bf16;

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// `bf16` values of very different magnitudes and both signs.
fn bf16_input(rank: usize, len: usize) -> Vec<bf16> {
    to_bf16(&order_sensitive_input(rank, len))
}

fn bf16_bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Element `i` summed in `f32` in the order of owner `c`, rounded once to `bf16`.
fn widened_sum(inputs: &[Vec<bf16>], i: usize, c: usize) -> bf16 {
    let n = inputs.len();
    let mut order = summation_order(n, c);
    let first = inputs[order.next().unwrap()][i].to_f32();
    bf16::from_f32(order.fold(first, |acc, q| acc + inputs[q][i].to_f32()))
}

/// The documented result of a `bf16` all-reduce: the canonical order of the `f32` case,
/// accumulated in `f32`, rounded once.
fn canonical_bf16_all_reduce(inputs: &[Vec<bf16>]) -> Vec<bf16> {
    let (n, len) = (inputs.len(), inputs[0].len());
    (0..len)
        .map(|i| {
            let c = (0..n)
                .find(|&c| chunk_range(len, n, c).contains(&i))
                .unwrap();
            widened_sum(inputs, i, c)
        })
        .collect()
}

/// What rounding every partial sum to `bf16` would give (what the result must not be).
fn rounded_each_step(inputs: &[Vec<bf16>]) -> Vec<bf16> {
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let mut acc = inputs[0][i];
            for x in &inputs[1..] {
                acc = bf16::from_f32(acc.to_f32() + x[i].to_f32());
            }
            acc
        })
        .collect()
}

#[test]
fn element_types_convert_as_documented() {
    assert_eq!(<f32 as Element>::DTYPE, crate::ir::DType::F32);
    assert_eq!(<bf16 as Element>::DTYPE, crate::ir::DType::Bf16);
    assert_eq!(<f32 as Element>::from_f32(0.1).to_bits(), 0.1f32.to_bits());
    // 1 + 2⁻⁸ lies halfway between 1 and 1 + 2⁻⁷: ties go to the even mantissa (1); just
    // above halfway goes up; 1 + 3·2⁻⁸ is a tie that goes up to the even 1 + 2⁻⁶.
    let from = <bf16 as Element>::from_f32;
    assert_eq!(from(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
    assert_eq!(
        from(1.0 + 2f32.powi(-8) + 2f32.powi(-20)).to_f32(),
        1.0 + 2f32.powi(-7)
    );
    assert_eq!(
        from(1.0 + 3.0 * 2f32.powi(-8)).to_f32(),
        1.0 + 2f32.powi(-6)
    );
    assert!(from(f32::NAN).is_nan());
    assert_eq!(Element::to_f32(from(-3.5)), -3.5);
}

/// The branch-free conversions agree with `half`'s bit for bit: every upper half of an `f32`
/// with the lower halves where rounding decides (zero, just below, at and just above one
/// half, odd and even kept parts, all ones), NaNs and infinities included.
#[test]
fn bf16_conversions_match_half() {
    for hi in 0..=u32::from(u16::MAX) {
        for lo in [0, 1, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xc000, 0xfffe, 0xffff] {
            let v = f32::from_bits(hi << 16 | lo);
            let ours = <bf16 as Element>::from_f32(v).to_bits();
            assert_eq!(ours, bf16::from_f32(v).to_bits(), "{:#010x}", v.to_bits());
        }
        // Widening is exact, NaN payloads included (`half` sets the quiet bit).
        let b = bf16::from_bits(hi as u16);
        let wide = Element::to_f32(b);
        assert_eq!(wide.to_bits(), hi << 16);
        if !b.is_nan() {
            assert_eq!(wide.to_bits(), b.to_f32().to_bits());
        }
    }
}

/// `bf16` all-reduce: every rank, every algorithm, bit-identical to the `f32`-accumulated
/// canonical sum rounded once — with data for which rounding every step would differ.
#[test]
fn bf16_all_reduce_rounds_the_canonical_f32_sum_once() {
    let lengths = [
        1,
        3,
        17,
        33,
        999,
        1025,
        ONE_SHOT_MAX_BYTES / 2 + 1,
        3 * RING_ELEMS + 5,
    ];
    for n in [1, 2, 3, 4, 8] {
        let results = ok(run_group(n, move |mut comm| {
            let rank = comm.rank();
            let mut out = Vec::new();
            for len in lengths {
                for algorithm in ALGORITHMS {
                    let mut buf = bf16_input(rank, len);
                    comm.all_reduce_sum_with(&mut buf, algorithm).unwrap();
                    out.push(bf16_bits(&buf));
                }
            }
            out
        }));
        for (k, len) in lengths.into_iter().enumerate() {
            let inputs: Vec<_> = (0..n).map(|r| bf16_input(r, len)).collect();
            let expected = bf16_bits(&canonical_bf16_all_reduce(&inputs));
            if n >= 3 && len > 100 {
                assert_ne!(expected, bf16_bits(&rounded_each_step(&inputs)), "n {n}");
            }
            for (rank, per_rank) in results.iter().enumerate() {
                for (a, algorithm) in ALGORITHMS.iter().enumerate() {
                    assert!(
                        per_rank[k * ALGORITHMS.len() + a] == expected,
                        "n {n} rank {rank} len {len} {algorithm}: bits differ"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_all_gather_and_reduce_scatter_match_reference() {
    let lengths = [0, 1, 3, 17, 257, 1001];
    for n in [1, 2, 3, 4, 8] {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            lengths
                .iter()
                .map(|&m| {
                    let local = bf16_input(rank + 10, m);
                    let mut gathered = vec![bf16::NAN; n * m];
                    comm.all_gather(&local, &mut gathered).unwrap();
                    let input = bf16_input(rank, n * m);
                    let mut piece = vec![bf16::NAN; m];
                    comm.reduce_scatter_sum(&input, &mut piece).unwrap();
                    (bf16_bits(&gathered), bf16_bits(&piece))
                })
                .collect::<Vec<_>>()
        }));
        for (k, &m) in lengths.iter().enumerate() {
            let gathered: Vec<bf16> = (0..n).flat_map(|r| bf16_input(r + 10, m)).collect();
            let inputs: Vec<_> = (0..n).map(|r| bf16_input(r, n * m)).collect();
            for (rank, per_rank) in results.iter().enumerate() {
                assert_eq!(
                    per_rank[k].0,
                    bf16_bits(&gathered),
                    "n {n} rank {rank} m {m}"
                );
                let piece: Vec<bf16> = (rank * m..(rank + 1) * m)
                    .map(|i| widened_sum(&inputs, i, rank))
                    .collect();
                assert!(
                    per_rank[k].1 == bf16_bits(&piece),
                    "n {n} rank {rank} m {m}: reduce-scatter bits differ"
                );
            }
        }
    }
}

/// The unsafe paths of the widened ring, small (also for Miri), with `f32` and `bf16`
/// calls interleaved on one group so the staging buffers and slots change type.
#[test]
fn small_groups_mix_element_types() {
    for n in 1..=4 {
        ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            for len in [1, 17, 100] {
                let inputs: Vec<_> = (0..n).map(|r| bf16_input(r, len)).collect();
                let expected = bf16_bits(&canonical_bf16_all_reduce(&inputs));
                for algorithm in ALGORITHMS {
                    let mut buf = bf16_input(rank, len);
                    comm.all_reduce_sum_with(&mut buf, algorithm).unwrap();
                    let got = bf16_bits(&buf);
                    buf.fill(bf16::NAN);
                    drop(buf);
                    assert_eq!(got, expected, "{algorithm} len {len}");
                    let mut f = exact_input(rank, len, 3);
                    comm.all_reduce_sum_with(&mut f, algorithm).unwrap();
                    let inputs: Vec<_> = (0..n).map(|r| exact_input(r, len, 3)).collect();
                    assert_eq!(f, reference_sum(&inputs));
                }
                let mut b = to_bf16(&exact_input(rank, len, 4));
                comm.broadcast(&mut b, n - 1).unwrap();
                assert_eq!(b, to_bf16(&exact_input(n - 1, len, 4)));
            }
        }));
    }
}

#[test]
fn broadcast_from_every_root() {
    for n in 1..=5 {
        let results = ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            let mut out = Vec::new();
            for len in [0, 1, 17, 1000, RING_ELEMS] {
                for root in 0..n {
                    let mut f = exact_input(rank, len, root);
                    comm.broadcast(&mut f, root).unwrap();
                    let mut b = bf16_input(rank, len);
                    comm.broadcast(&mut b, root).unwrap();
                    out.push((len, root, f, bf16_bits(&b)));
                }
            }
            out
        }));
        for (rank, per_rank) in results.iter().enumerate() {
            for (len, root, f, b) in per_rank {
                assert_eq!(*f, exact_input(*root, *len, *root), "n {n} rank {rank}");
                assert_eq!(*b, bf16_bits(&bf16_input(*root, *len)), "n {n} rank {rank}");
            }
        }
    }
}

/// Message `k` from `from` to `to`: its length and contents identify it.
fn message(from: usize, to: usize, k: usize) -> Vec<f32> {
    let len = (k * 37 + from * 5 + to) % 300;
    exact_input(from * 100 + to, len, k)
}

/// Every rank sends to its successor and receives from its predecessor, many messages of
/// changing sizes and both types, sent ahead of the receives (buffered), checked in order.
#[test]
fn send_recv_around_a_ring_in_order() {
    for n in [2, 3, 5] {
        ok(run_group(n, move |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            for round in 0..20 {
                // Up to 50 messages in flight per pair.
                for k in round * 50..(round + 1) * 50 {
                    let m = message(rank, next, k);
                    if k % 3 == 0 {
                        comm.send(&to_bf16(&m), next).unwrap();
                    } else {
                        comm.send(&m, next).unwrap();
                    }
                }
                for k in round * 50..(round + 1) * 50 {
                    let expected = message(prev, rank, k);
                    if k % 3 == 0 {
                        let mut got = vec![bf16::NAN; expected.len()];
                        comm.recv(&mut got, prev).unwrap();
                        assert_eq!(got, to_bf16(&expected), "message {k}");
                    } else {
                        let mut got = vec![f32::NAN; expected.len()];
                        comm.recv(&mut got, prev).unwrap();
                        assert_eq!(got, expected, "message {k}");
                    }
                }
            }
            // Stay in the group until the successor has received everything.
            comm.barrier().unwrap();
        }));
    }
}

/// Two ranks stream to each other at once (and a third rank's messages to rank 0 are
/// interleaved with rank 1's), each receiving while the other sends.
#[test]
fn send_recv_both_directions_many_messages() {
    let count = 3000;
    ok(run_group(3, move |mut comm| {
        let rank = comm.rank();
        match rank {
            0 | 1 => {
                let peer = 1 - rank;
                for k in 0..count {
                    comm.send(&message(rank, peer, k), peer).unwrap();
                    if k >= 10 {
                        // Receive with a lag of 10 messages.
                        let j = k - 10;
                        let expected = message(peer, rank, j);
                        let mut got = vec![0.0; expected.len()];
                        comm.recv(&mut got, peer).unwrap();
                        assert_eq!(got, expected, "rank {rank} message {j}");
                    }
                    if rank == 0 && k % 100 == 0 {
                        let expected = message(2, 0, k / 100);
                        let mut got = vec![0.0; expected.len()];
                        comm.recv(&mut got, 2).unwrap();
                        assert_eq!(got, expected, "from rank 2, message {}", k / 100);
                    }
                }
                for j in count - 10..count {
                    let expected = message(peer, rank, j);
                    let mut got = vec![0.0; expected.len()];
                    comm.recv(&mut got, peer).unwrap();
                    assert_eq!(got, expected, "rank {rank} message {j}");
                }
            }
            _ => {
                for k in 0..count / 100 {
                    comm.send(&message(2, 0, k), 0).unwrap();
                }
            }
        }
        // Point-to-point traffic leaves the collectives in step.
        comm.barrier().unwrap();
    }));
}

#[test]
fn mismatched_dtype_root_and_size_fail_on_every_rank_and_the_group_recovers() {
    for n in [2, 3] {
        let outcomes = ok(run_group(n, |mut comm| {
            let (rank, n) = (comm.rank(), comm.world_size());
            let mut errors = Vec::new();
            // Rank 1 passes bf16, the others f32, to every data-moving collective.
            let f = |len| vec![1.0f32; len];
            let b = |len| vec![bf16::ONE; len];
            errors.push(if rank == 1 {
                comm.all_reduce_sum(&mut b(8)).unwrap_err()
            } else {
                comm.all_reduce_sum(&mut f(8)).unwrap_err()
            });
            errors.push(if rank == 1 {
                comm.all_gather(&b(3), &mut b(3 * n)).unwrap_err()
            } else {
                comm.all_gather(&f(3), &mut f(3 * n)).unwrap_err()
            });
            errors.push(if rank == 1 {
                comm.reduce_scatter_sum(&b(3 * n), &mut b(3)).unwrap_err()
            } else {
                comm.reduce_scatter_sum(&f(3 * n), &mut f(3)).unwrap_err()
            });
            errors.push(if rank == 1 {
                comm.broadcast(&mut b(5), 0).unwrap_err()
            } else {
                comm.broadcast(&mut f(5), 0).unwrap_err()
            });
            // Different roots, then different sizes.
            let root = usize::from(rank == 1);
            errors.push(comm.broadcast(&mut f(5), root).unwrap_err());
            errors.push(
                comm.broadcast(&mut f(5 + usize::from(rank == 1)), 0)
                    .unwrap_err(),
            );
            // A root outside the group on one rank.
            let root = if rank == 1 { n } else { 0 };
            errors.push(comm.broadcast(&mut f(5), root).unwrap_err());
            // Still usable.
            let mut buf = vec![bf16::from_f32(rank as f32); 5];
            comm.broadcast(&mut buf, n - 1).unwrap();
            assert_eq!(buf, vec![bf16::from_f32((n - 1) as f32); 5]);
            comm.barrier().unwrap();
            errors
        }));
        use crate::ir::DType::{Bf16, F32};
        let ar = Collective::AllReduceSum;
        for (rank, errors) in outcomes.iter().enumerate() {
            assert_eq!(errors.len(), 7);
            // Every rank is told, naming a peer that disagrees with it.
            let (dtype, peer, peer_dtype) = if rank == 1 {
                (Bf16, 0, F32)
            } else {
                (F32, 1, Bf16)
            };
            for (e, during) in errors[..4].iter().zip([
                ar,
                Collective::AllGather,
                Collective::ReduceScatterSum,
                Collective::Broadcast,
            ]) {
                assert_eq!(
                    *e,
                    CommError::DTypeMismatch {
                        rank,
                        during,
                        dtype,
                        peer,
                        peer_during: during,
                        peer_dtype
                    },
                    "n {n}"
                );
            }
            let (root, peer_root) = if rank == 1 { (1, 0) } else { (0, 1) };
            assert_eq!(
                errors[4],
                CommError::RootMismatch {
                    rank,
                    root,
                    peer,
                    peer_root
                }
            );
            assert!(
                matches!(errors[5], CommError::PeerMismatch { rank: r, during: Collective::Broadcast, peer: p, .. } if r == rank && p == peer),
                "{:?}",
                errors[5]
            );
            if rank == 1 {
                assert_eq!(
                    errors[6],
                    CommError::BadRank {
                        rank,
                        during: Collective::Broadcast,
                        peer: n,
                        world_size: n,
                        what: "the root must be a rank of the group"
                    }
                );
            } else {
                assert_eq!(
                    errors[6],
                    CommError::PeerBadArguments {
                        rank,
                        during: Collective::Broadcast,
                        peer: 1
                    }
                );
            }
        }
        let message = outcomes[0][0].to_string();
        assert!(
            message.contains("f32") && message.contains("bf16") && message.contains("rank 1"),
            "{message}"
        );
    }
}

#[test]
fn point_to_point_refuses_bad_partners_and_mismatched_messages() {
    let outcomes = ok(run_group(2, |mut comm| {
        let rank = comm.rank();
        let peer = 1 - rank;
        let mut errors = Vec::new();
        for bad in [rank, 2, usize::MAX] {
            errors.push(comm.send(&[1.0f32], bad).unwrap_err());
            errors.push(comm.recv(&mut [0.0f32], bad).unwrap_err());
        }
        if rank == 0 {
            comm.send(&[1.0f32; 4], peer).unwrap();
            comm.send(&[1.0f32; 4], peer).unwrap();
            comm.send(&[2.0f32; 3], peer).unwrap();
        } else {
            // Wrong type, wrong size: each consumes its message, the next one is intact.
            errors.push(comm.recv(&mut [bf16::ZERO; 4], peer).unwrap_err());
            errors.push(comm.recv(&mut [0.0f32; 5], peer).unwrap_err());
            let mut got = [0.0f32; 3];
            comm.recv(&mut got, peer).unwrap();
            assert_eq!(got, [2.0; 3]);
        }
        errors
    }));
    for (rank, errors) in outcomes.iter().enumerate() {
        for (k, bad) in [rank, 2, usize::MAX].into_iter().enumerate() {
            for (e, during) in errors[2 * k..2 * k + 2]
                .iter()
                .zip([Collective::Send, Collective::Recv])
            {
                assert_eq!(
                    *e,
                    CommError::BadRank {
                        rank,
                        during,
                        peer: bad,
                        world_size: 2,
                        what: "the peer must be another rank of the group"
                    }
                );
            }
        }
    }
    assert_eq!(
        outcomes[1][6..],
        [
            CommError::DTypeMismatch {
                rank: 1,
                during: Collective::Recv,
                dtype: crate::ir::DType::Bf16,
                peer: 0,
                peer_during: Collective::Send,
                peer_dtype: crate::ir::DType::F32
            },
            CommError::PeerMismatch {
                rank: 1,
                during: Collective::Recv,
                len: 5,
                peer: 0,
                peer_during: Collective::Send,
                peer_len: 4
            }
        ]
    );
}

/// How a rank leaves the group in the release tests.
#[derive(Clone, Copy, Debug)]
enum Leave {
    Abort,
    Panic,
    Drop,
}

/// One rank leaves after the others have blocked (in `recv` from it, in `recv` from a live
/// rank that never sends, or in a broadcast); every one of them gets `PeerFailed` from it.
#[test]
fn a_failing_rank_releases_blocked_recv_and_broadcast() {
    #[derive(Clone, Copy, Debug)]
    enum Blocked {
        RecvFromLeaver,
        RecvFromLive,
        Broadcast,
    }
    for leave in [Leave::Abort, Leave::Panic, Leave::Drop] {
        for blocked in [
            Blocked::RecvFromLeaver,
            Blocked::RecvFromLive,
            Blocked::Broadcast,
        ] {
            let outcomes = run_group(3, move |mut comm| {
                let rank = comm.rank();
                comm.barrier().unwrap();
                if rank == 2 {
                    // Let the others block first (the outcome must not depend on it).
                    thread::sleep(Duration::from_millis(50));
                    match leave {
                        Leave::Abort => {
                            comm.abort();
                            comm.abort();
                            let again = comm.recv(&mut [0.0f32], 0);
                            assert!(matches!(again, Err(CommError::Aborted { rank: 2, .. })));
                        }
                        Leave::Panic => panic!("rank 2 fails"),
                        Leave::Drop => drop(comm),
                    }
                    return None;
                }
                let mut buf = [0.0f32; 64];
                Some(match blocked {
                    Blocked::RecvFromLeaver => comm.recv(&mut buf, 2),
                    // Ranks 0 and 1 wait for each other; neither ever sends.
                    Blocked::RecvFromLive => comm.recv(&mut buf, 1 - rank),
                    Blocked::Broadcast => comm.broadcast(&mut buf, 0),
                })
            });
            let cause = match leave {
                Leave::Abort => FailureCause::Aborted,
                Leave::Panic => FailureCause::Panicked,
                Leave::Drop => FailureCause::Dropped,
            };
            for (rank, outcome) in outcomes.into_iter().enumerate() {
                if rank == 2 {
                    match leave {
                        Leave::Panic => assert!(outcome.unwrap_err().contains("rank 2 fails")),
                        _ => assert_eq!(outcome, Ok(None)),
                    }
                    continue;
                }
                let during = match blocked {
                    Blocked::Broadcast => Collective::Broadcast,
                    _ => Collective::Recv,
                };
                assert_eq!(
                    outcome.unwrap(),
                    Some(Err(CommError::PeerFailed {
                        rank,
                        peer: 2,
                        cause,
                        during
                    })),
                    "{leave:?} {blocked:?}"
                );
            }
        }
    }
}

/// After a failure, sends are refused at once and a recv takes only messages sent before
/// it: a rank that sends and then leaves (here: drops its communicator, or panics) is still
/// heard, in order, and the next recv from it fails instead of waiting.
#[test]
fn messages_sent_before_a_failure_are_still_received() {
    for leave in [Leave::Drop, Leave::Panic, Leave::Abort] {
        let outcomes = run_group(3, move |mut comm| {
            let rank = comm.rank();
            match rank {
                0 => {
                    for k in 0..5 {
                        comm.send(&message(0, 1, k), 1).unwrap();
                    }
                    match leave {
                        Leave::Drop => drop(comm),
                        Leave::Panic => panic!("rank 0 fails"),
                        Leave::Abort => comm.abort(),
                    }
                    None
                }
                1 => {
                    // Start receiving only once rank 0 has certainly left.
                    thread::sleep(Duration::from_millis(50));
                    let received: Vec<bool> = (0..5)
                        .map(|k| {
                            let expected = message(0, 1, k);
                            let mut got = vec![0.0; expected.len()];
                            comm.recv(&mut got, 0).is_ok_and(|()| got == expected)
                        })
                        .collect();
                    assert_eq!(received, [true; 5], "{leave:?}");
                    Some((comm.recv(&mut [0.0f32; 3], 0), comm.send(&[1.0f32], 2)))
                }
                _ => Some((comm.recv(&mut [0.0f32; 3], 1), comm.send(&[1.0f32], 1))),
            }
        });
        let cause = match leave {
            Leave::Abort => FailureCause::Aborted,
            Leave::Panic => FailureCause::Panicked,
            Leave::Drop => FailureCause::Dropped,
        };
        for (rank, outcome) in outcomes.into_iter().enumerate().skip(1) {
            let failed = |during| CommError::PeerFailed {
                rank,
                peer: 0,
                cause,
                during,
            };
            let (recv, send) = outcome.unwrap().unwrap();
            assert_eq!(recv, Err(failed(Collective::Recv)), "rank {rank} {leave:?}");
            // Rank 2's send may come before rank 0 leaves; rank 1's cannot.
            if rank == 1 {
                assert_eq!(send, Err(failed(Collective::Send)), "{leave:?}");
            }
        }
    }
}

/// The sum, every row handed on (index, values) in the order they came, what ran.
type SummedRows<T> = (Vec<T>, Vec<(usize, Vec<T>)>, Option<CollectiveAlgorithm>);

/// Runs `all_reduce_sum_rows` with `algorithm` (a plan's choice; `None`: by size).
fn summed_rows<T: Element>(
    comm: &mut LocalComm,
    mut buf: Vec<T>,
    row_len: usize,
    algorithm: Option<CollectiveAlgorithm>,
) -> SummedRows<T> {
    let mut rows = Vec::new();
    let ran = comm
        .all_reduce_sum_rows(&mut buf, row_len, algorithm, &mut |r, x| {
            rows.push((r, x.to_vec()))
        })
        .unwrap();
    (buf, rows, ran)
}

/// The row-wise all-reduce (what a fused all-reduce + norm runs on): every algorithm gives
/// the documented sum bit for bit, and hands on every row of it once, in order, whether
/// rows straddle the chunks of the ranks (odd row lengths) or not.
#[test]
fn rows_of_the_sum_are_handed_on_in_order_with_the_sums_bits() {
    const CHOICES: [Option<CollectiveAlgorithm>; 4] = [
        None,
        Some(CollectiveAlgorithm::OneShot),
        Some(CollectiveAlgorithm::TwoShot),
        Some(CollectiveAlgorithm::Ring),
    ];
    // (rows, row length): one row, rows cut by chunk boundaries, a message above the
    // one-shot threshold.
    let shapes = [
        (1, 1),
        (1, 64),
        (3, 7),
        (5, 33),
        (4, 2048),
        (2, RING_ELEMS + 3),
    ];
    for n in [1, 2, 3, 4] {
        let results = ok(run_group(n, move |mut comm| {
            let rank = comm.rank();
            let mut out = Vec::new();
            for (rows, cols) in shapes {
                for choice in CHOICES {
                    let x = order_sensitive_input(rank, rows * cols);
                    let f32s = summed_rows(&mut comm, x.clone(), cols, choice);
                    let bf16s = summed_rows(&mut comm, to_bf16(&x), cols, choice);
                    out.push((f32s, bf16s));
                }
            }
            out
        }));
        let mut k = 0;
        for (rows, cols) in shapes {
            let len = rows * cols;
            let inputs: Vec<_> = (0..n).map(|r| order_sensitive_input(r, len)).collect();
            let want = bits(&canonical_all_reduce(&inputs));
            let inputs16: Vec<_> = inputs.iter().map(|x| to_bf16(x)).collect();
            let want16 = bf16_bits(&canonical_bf16_all_reduce(&inputs16));
            for choice in CHOICES {
                for (rank, per_rank) in results.iter().enumerate() {
                    let ((sum, handed, ran), (sum16, handed16, ran16)) = &per_rank[k];
                    let at = format!("n {n} rank {rank} {rows}x{cols} {choice:?}");
                    assert_eq!(bits(sum), want, "{at}");
                    assert_eq!(bf16_bits(sum16), want16, "{at}");
                    assert!(ran.is_some() && ran == ran16, "{at}");
                    if choice.is_some() {
                        assert_eq!(*ran, choice, "{at}");
                    }
                    assert_eq!(handed.len(), rows, "{at}");
                    assert_eq!(handed16.len(), rows, "{at}");
                    for (r, ((i, x), (i16, x16))) in handed.iter().zip(handed16).enumerate() {
                        assert_eq!((*i, *i16), (r, r), "{at}");
                        assert_eq!(bits(x), want[r * cols..(r + 1) * cols], "{at}");
                        assert_eq!(bf16_bits(x16), want16[r * cols..(r + 1) * cols], "{at}");
                    }
                }
                k += 1;
            }
        }
    }
}
