//! Micro-benchmarks of the in-process group (for a CLI command; not part of the API).
//!
//! Every measurement runs one thread per rank of a fresh group. A latency is, per
//! iteration, the slowest rank's time for that call; the table reports the median and the
//! minimum over iterations. Bus bandwidth follows the NCCL convention,
//! `2(n − 1)/n · bytes / time`, so the three algorithms compare against the same yardstick. The
//! memcpy row is the bound: every rank copies `bytes` between two private buffers at the
//! same time (the memory system is shared as it is during a collective) with the copy
//! kernel the collectives use (`reduce::copy`, not glibc `memcpy`, see there), and its
//! bandwidth is `bytes / time`.

pub use super::barrier::Backoff;
use super::barrier::{GroupBarrier, Phase};
use super::local::{group_with, Tuning};
use super::reduce::copy;
use super::{AllReduceAlgorithm, Communicator, Element};
use crate::ir::DType;
use std::fmt::Write as _;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

/// What one row measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKind {
    OneShot,
    TwoShot,
    Ring,
    /// Every rank copying `bytes` at once: the bandwidth bound.
    Memcpy,
    /// MPI processes, tpc's all-reduce over MPI (`MPI_Allgather` + the fixed-order sum).
    MpiExact,
    /// MPI processes, `MPI_Allreduce` itself (for comparison; not bit-reproducible).
    MpiAllreduce,
}

/// One measured (world, size, kind).
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub world: usize,
    pub dtype: DType,
    pub bytes: usize,
    pub kind: BenchKind,
    pub iters: usize,
    pub median_us: f64,
    pub min_us: f64,
    /// `2(n − 1)/n · bytes / median` for all-reduces, `bytes / median` for memcpy; GB/s.
    pub bus_gb_s: f64,
}

/// All-reduce latency and bus bandwidth of the three algorithms, and the memcpy bound, for each
/// message size in bytes (rounded down to whole elements of `T`), `iters` timed calls each
/// after a warm-up.
pub fn bench_all_reduce<T: Element>(
    world: usize,
    sizes_bytes: &[usize],
    iters: usize,
) -> Vec<BenchRow> {
    bench_all_reduce_with::<T>(world, sizes_bytes, iters, Tuning::for_world(world).backoff)
}

/// [`bench_all_reduce`] with an explicit back-off for the group's waits.
pub fn bench_all_reduce_with<T: Element>(
    world: usize,
    sizes_bytes: &[usize],
    iters: usize,
    backoff: Backoff,
) -> Vec<BenchRow> {
    let iters = iters.max(1);
    let elem = size_of::<T>();
    let sizes: Vec<usize> = sizes_bytes.iter().map(|b| b / elem).collect();
    let tuning = Tuning {
        backoff,
        ..Tuning::for_world(world)
    };
    let per_rank = run_ranks(group_with(world, tuning), move |mut comm| {
        let mut times = Vec::new();
        for &len in &sizes {
            let mut buf = vec![T::from_f32(0.0); len];
            for algorithm in [
                AllReduceAlgorithm::OneShot,
                AllReduceAlgorithm::TwoShot,
                AllReduceAlgorithm::Ring,
            ] {
                let warmup = (iters / 10).clamp(2, 50);
                for _ in 0..warmup {
                    comm.all_reduce_sum_with(&mut buf, algorithm)
                        .expect("benchmark all-reduce");
                }
                comm.barrier().expect("benchmark barrier");
                times.push(time_each(iters, || {
                    comm.all_reduce_sum_with(&mut buf, algorithm)
                        .expect("benchmark all-reduce");
                }));
            }
            let src = vec![T::from_f32(1.0); len];
            let mut dst = vec![T::from_f32(0.0); len];
            copy(&mut dst, &src);
            comm.barrier().expect("benchmark barrier");
            times.push(time_each(iters, || {
                copy(&mut dst, std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
            }));
        }
        times
    });
    let mut rows = Vec::new();
    let kinds = [
        BenchKind::OneShot,
        BenchKind::TwoShot,
        BenchKind::Ring,
        BenchKind::Memcpy,
    ];
    for (s, &bytes) in sizes_bytes.iter().enumerate() {
        for (k, kind) in kinds.into_iter().enumerate() {
            let series: Vec<&Vec<Duration>> =
                per_rank.iter().map(|t| &t[s * kinds.len() + k]).collect();
            let (median, min) = slowest_rank_stats(&series);
            let bytes = bytes / elem * elem;
            let factor = match kind {
                BenchKind::Memcpy => 1.0,
                _ => 2.0 * (world as f64 - 1.0) / world as f64,
            };
            rows.push(BenchRow {
                world,
                dtype: T::DTYPE,
                bytes,
                kind,
                iters,
                median_us: median * 1e6,
                min_us: min * 1e6,
                bus_gb_s: factor * bytes as f64 / median / 1e9,
            });
        }
    }
    rows
}

/// Round trip of the group barrier and of `std::sync::Barrier`.
#[derive(Clone, Debug, PartialEq)]
pub struct BarrierRow {
    pub world: usize,
    /// How the group barrier's waiters backed off.
    pub backoff: Backoff,
    pub group_median_us: f64,
    pub std_median_us: f64,
}

/// Median time of one barrier wait (every rank waiting back to back, slowest rank per
/// iteration) for the group barrier with the spin budget `local_group` would choose, and
/// for `std::sync::Barrier`.
pub fn bench_barrier(world: usize, iters: usize) -> BarrierRow {
    bench_barrier_with(world, iters, Tuning::for_world(world).backoff)
}

/// [`bench_barrier`] with an explicit back-off.
pub fn bench_barrier_with(world: usize, iters: usize, backoff: Backoff) -> BarrierRow {
    let iters = iters.max(1);
    let group = Arc::new(GroupBarrier::new(world, backoff));
    let std_barrier = Arc::new(Barrier::new(world));
    let per_rank = run_ranks((0..world).collect(), move |_rank: usize| {
        for _ in 0..iters / 10 + 10 {
            group.wait(Phase::Inner).expect("benchmark barrier");
        }
        let ours = time_each(iters, || {
            group.wait(Phase::Inner).expect("benchmark barrier");
        });
        for _ in 0..iters / 10 + 10 {
            std_barrier.wait();
        }
        let std = time_each(iters, || {
            std_barrier.wait();
        });
        vec![ours, std]
    });
    let ours: Vec<_> = per_rank.iter().map(|t| &t[0]).collect();
    let std: Vec<_> = per_rank.iter().map(|t| &t[1]).collect();
    BarrierRow {
        world,
        backoff,
        group_median_us: slowest_rank_stats(&ours).0 * 1e6,
        std_median_us: slowest_rank_stats(&std).0 * 1e6,
    }
}

/// A plain-text table of all-reduce rows.
pub fn format_table(rows: &[BenchRow]) -> String {
    let mut s =
        String::from("ranks  dtype  bytes      kind          median µs    min µs   bus GB/s\n");
    for r in rows {
        let _ = writeln!(
            s,
            "{:<6} {:<6} {:<10} {:<13} {:>9.2} {:>9.2} {:>10.2}",
            r.world,
            r.dtype,
            r.bytes,
            format!("{:?}", r.kind),
            r.median_us,
            r.min_us,
            r.bus_gb_s
        );
    }
    s
}

pub(super) fn time_each(iters: usize, mut f: impl FnMut()) -> Vec<Duration> {
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect()
}

/// Median and minimum over iterations of the slowest rank's time, in seconds.
pub(super) fn slowest_rank_stats(per_rank: &[&Vec<Duration>]) -> (f64, f64) {
    let iters = per_rank.iter().map(|t| t.len()).min().unwrap_or(0);
    let mut slowest: Vec<f64> = (0..iters)
        .map(|i| {
            per_rank
                .iter()
                .map(|t| t[i].as_secs_f64())
                .fold(0.0, f64::max)
        })
        .collect();
    if slowest.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    slowest.sort_by(f64::total_cmp);
    (slowest[slowest.len() / 2], slowest[0])
}

/// Runs `body` on one thread per element of `ranks` (communicators or indices); returns
/// what each returned, in order.
fn run_ranks<C: Send + 'static, T: Send + 'static>(
    ranks: Vec<C>,
    body: impl Fn(C) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let body = Arc::new(body);
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|rank| {
            let body = body.clone();
            thread::spawn(move || body(rank))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("benchmark rank panicked"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Smoke test: the benchmark runs and reports sane numbers.
    #[test]
    fn bench_runs() {
        let rows = bench_all_reduce::<f32>(2, &[4096, 100_000], 3);
        assert_eq!(rows.len(), 8);
        assert!(rows.iter().any(|r| r.kind == BenchKind::TwoShot));
        let half = bench_all_reduce::<half::bf16>(2, &[4096], 3);
        assert_eq!(half.len(), 4);
        assert!(half
            .iter()
            .all(|r| r.dtype == DType::Bf16 && r.bus_gb_s > 0.0));
        assert!(rows.iter().all(|r| r.median_us > 0.0 && r.bus_gb_s > 0.0));
        assert!(format_table(&rows).lines().count() == 9);
        let b = bench_barrier(2, 10);
        assert!(b.group_median_us > 0.0 && b.std_median_us > 0.0);
    }
}
