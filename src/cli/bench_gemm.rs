//! `tpc bench-gemm`: the linear kernels on a model's shapes, side by side in one run —
//! packed bf16 and packed f32 (ours) against the `gemm` crate on f32 — with the machine's
//! read bandwidth measured in the same run (the bound of the one-row case).

use std::time::{Duration, Instant};
use tpc::ir::WeightOrder;
use tpc::runtime::cpu::gemm_f32;
use tpc::runtime::packed::PackedMatrix;
use tpc::runtime::team::Team;
use tpc::runtime::tensor::Tensor;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows of the activation (tokens): decode is 1, a prompt is its length.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 128])]
    rows: Vec<usize>,
    /// Weight shapes as OUTxIN (default: TinyLlama-1.1B's q, k, gate and down projections).
    #[arg(long, value_delimiter = ',', default_values_t = ["2048x2048".to_string(), "256x2048".to_string(), "5632x2048".to_string(), "2048x5632".to_string()])]
    shapes: Vec<String>,
    /// Threads per product.
    #[arg(long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get()))]
    threads: usize,
    /// Seconds spent on each measurement (the best call is reported).
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// MiB of distinct bf16 weights the cold one-row sweep reads (0: no sweep). Far more than
    /// the last-level cache, as in decode, where every weight comes from memory.
    #[arg(long, default_value_t = 512)]
    sweep_mib: usize,
}

fn parse_shape(s: &str) -> anyhow::Result<(usize, usize)> {
    let (n, k) = s
        .split_once('x')
        .ok_or_else(|| anyhow::anyhow!("shape {s:?} is not OUTxIN, e.g. 2048x5632"))?;
    Ok((n.trim().parse()?, k.trim().parse()?))
}

/// Best wall time of `f` over about `budget` (at least three calls).
fn best(budget: f64, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut calls = 0;
    while calls < 3 || start.elapsed().as_secs_f64() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        calls += 1;
    }
    best
}

/// Read bandwidth (bytes/s) of `threads` threads summing disjoint parts of a 256 MiB f32
/// buffer with 16 partial sums (vectorised, like the C sum in `scripts/bench_vs_torch.sh`).
fn read_bandwidth(threads: usize, budget: f64) -> f64 {
    let values = vec![1f32; 64 << 20];
    let part = values.len().div_ceil(threads);
    let sum = |chunk: &[f32]| {
        tpc::runtime::simd::with_avx2(|| {
            let mut acc = [0f32; 16];
            for c in chunk.chunks_exact(16) {
                for l in 0..16 {
                    acc[l] += c[l];
                }
            }
            acc.iter().sum::<f32>()
        })
    };
    let t = best(budget, || {
        std::thread::scope(|s| {
            for chunk in values.chunks(part) {
                s.spawn(move || std::hint::black_box(sum(chunk)));
            }
        })
    });
    (values.len() * 4) as f64 / t.as_secs_f64()
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(
        a.rows.iter().all(|&m| (1..=1 << 16).contains(&m)),
        "--rows must be 1..=65536"
    );
    let shapes: Vec<(usize, usize)> = a
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(
        shapes
            .iter()
            .all(|&(n, k)| n >= 1 && k >= 1 && n * k <= 1 << 28),
        "--shapes must be positive and at most 2^28 elements"
    );
    let team = Team::new(a.threads);
    let bw = read_bandwidth(a.threads, a.seconds);
    println!(
        "read bandwidth, {} thread(s): {:.1} GB/s; {} thread(s) per product, best of {:.1} s each",
        a.threads,
        bw / 1e9,
        a.threads,
        a.seconds
    );
    println!(
        "{:>5} {:>11} | {:>20} | {:>20} | {:>14} | {:>8} {:>8}",
        "rows", "out x in", "packed bf16", "packed f32", "gemm crate f32", "bf16/ref", "f32/ref"
    );
    for &(n, k) in &shapes {
        let w = Tensor::new(
            vec![n, k],
            (0..n * k)
                .map(|i| ((i * 53 % 97) as f32 - 48.0) / 97.0)
                .collect(),
        );
        let bf16 = PackedMatrix::pack(&w, WeightOrder::OutIn, true);
        let f32w = PackedMatrix::pack(&w, WeightOrder::OutIn, false);
        for &m in &a.rows {
            let x = Tensor::new(
                vec![m, k],
                (0..m * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                    .collect(),
            );
            let flops = 2.0 * (m * n * k) as f64;
            let t_bf16 = best(a.seconds, || {
                std::hint::black_box(bf16.matmul(&x, &team));
            });
            let t_f32 = best(a.seconds, || {
                std::hint::black_box(f32w.matmul(&x, &team));
            });
            let mut out = vec![0f32; m * n];
            let t_ref = best(a.seconds, || {
                gemm_f32(
                    (m, n, k),
                    &mut out,
                    n,
                    &x.data,
                    (&w.data, 1, k as isize),
                    a.threads,
                );
                std::hint::black_box(&out);
            });
            // Decode reads every weight once: report GB/s; prefill computes: GFLOP/s.
            let cell = |t: Duration, bytes: usize| {
                let s = t.as_secs_f64();
                if m <= 4 {
                    format!("{:>7.1} µs {:>5.1} GB/s", s * 1e6, bytes as f64 / s / 1e9)
                } else {
                    format!("{:>7.2} ms {:>4.0} GF/s", s * 1e3, flops / s / 1e9)
                }
            };
            println!(
                "{:>5} {:>11} | {:>20} | {:>20} | {:>14} | {:>7.2}× {:>7.2}×",
                m,
                format!("{n}x{k}"),
                cell(t_bf16, n * k * 2),
                cell(t_f32, n * k * 4),
                cell(t_ref, n * k * 4)
                    .split_whitespace()
                    .take(2)
                    .collect::<Vec<_>>()
                    .join(" "),
                t_ref.as_secs_f64() / t_bf16.as_secs_f64(),
                t_ref.as_secs_f64() / t_f32.as_secs_f64(),
            );
        }
    }
    if a.sweep_mib > 0 {
        let (n, k) = shapes[0];
        let count = (a.sweep_mib << 20).div_ceil(n * k * 2).max(2);
        let mats: Vec<PackedMatrix> = (0..count)
            .map(|s| {
                let w = Tensor::new(
                    vec![n, k],
                    (0..n * k)
                        .map(|i| ((i * 53 + s) % 97) as f32 / 97.0)
                        .collect(),
                );
                PackedMatrix::pack(&w, WeightOrder::OutIn, true)
            })
            .collect();
        let bytes: usize = mats.iter().map(PackedMatrix::bytes).sum();
        let x = Tensor::new(vec![1, k], vec![0.5; k]);
        let t = best(a.seconds, || {
            for m in &mats {
                std::hint::black_box(m.matmul(&x, &team));
            }
        });
        let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
        println!(
            "cold sweep: one row through {count} distinct {n}x{k} bf16 weights ({} MiB): {gbs:.1} GB/s = {:.2}x the read bandwidth",
            bytes >> 20,
            gbs / (bw / 1e9)
        );
    }
    Ok(())
}
