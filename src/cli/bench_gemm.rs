//! `tpc bench-gemm`: the linear kernels on a model's shapes, side by side in one run — every
//! kernel variant this host runs, packed bf16 and packed f32, against the `gemm` crate on
//! f32 — with the bounds measured in the same run: each variant's arithmetic peak (a loop of
//! its multiply-add instruction) for prompt rows, the read bandwidth for decode rows.

use std::time::Duration;
use tpc::ir::WeightOrder;
use tpc::runtime::calibrate::best;
use tpc::runtime::cpu::gemm_f32;
use tpc::runtime::cpu::isa::{peak_flops, CodeKind, Isa, Kernels};
use tpc::runtime::cpu::packed::PackedMatrix;
use tpc::runtime::cpu::team::Team;
use tpc::runtime::tensor::Tensor;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows of the activation (tokens): decode is 1, a prompt is its length.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 128])]
    rows: Vec<usize>,
    /// Weight shapes as OUTxIN (default: TinyLlama-1.1B's q, k, gate and down projections).
    #[arg(long, value_delimiter = ',', default_values_t = ["2048x2048".to_string(), "256x2048".to_string(), "5632x2048".to_string(), "2048x5632".to_string()])]
    shapes: Vec<String>,
    /// Threads per product (1..=1024).
    #[arg(long, default_value_t = std::thread::available_parallelism().map_or(1, |n| n.get() as u64), value_parser = clap::value_parser!(u64).range(1..=1024))]
    threads: u64,
    /// Seconds spent on each measurement (the best call is reported).
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// MiB of distinct bf16 weights the cold one-row sweep reads (0: no sweep). Far more than
    /// the last-level cache, as in decode, where every weight comes from memory (at most 8192).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(0..=8192))]
    sweep_mib: u64,
    /// Also sweep one-byte code panels of the same shape and as many bytes — INT8 and FP8
    /// e4m3, one scale per output, packed as a bf16 run packs a checkpoint's — right after
    /// each variant's bf16 sweep: what quantized decode reads, beside what bf16 decode reads.
    #[arg(long)]
    sweep_codes: bool,
    /// Kernel variants to measure (default: every one this host runs).
    #[arg(long, value_delimiter = ',', value_parser = super::parse_isa)]
    isa: Vec<Isa>,
}

fn parse_shape(s: &str) -> anyhow::Result<(usize, usize)> {
    let (n, k) = s
        .split_once('x')
        .ok_or_else(|| anyhow::anyhow!("shape {s:?} is not OUTxIN, e.g. 2048x5632"))?;
    Ok((n.trim().parse()?, k.trim().parse()?))
}

/// The CPU's model name and the flags of the instruction sets the kernels use.
fn host_line() -> String {
    let host = tpc::runtime::calibrate::host_info(0);
    format!("host: {}; flags: {}", host.model, host.flags.join(" "))
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    // clap bounds --threads to 1..=1024.
    let threads = a.threads as usize;
    anyhow::ensure!(
        a.rows.iter().all(|&m| (1..=1 << 16).contains(&m)),
        "--rows must be 1..=65536"
    );
    anyhow::ensure!(
        a.seconds.is_finite() && (0.0..=60.0).contains(&a.seconds),
        "--seconds must be 0..=60"
    );
    let shapes: Vec<(usize, usize)> = a
        .shapes
        .iter()
        .map(|s| parse_shape(s))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(
        shapes
            .iter()
            .all(|&(n, k)| n >= 1 && k >= 1 && n.checked_mul(k).is_some_and(|e| e <= 1 << 28)),
        "--shapes must be positive and at most 2^28 elements"
    );
    // The activations (rows × in) and outputs (rows × out) are allocated too.
    anyhow::ensure!(
        shapes
            .iter()
            .all(|&(n, k)| a.rows.iter().all(|&m| m * n.max(k) <= 1 << 28)),
        "--rows × the largest side of a --shapes entry must be at most 2^28 elements"
    );
    // At once: a shape's f32 weight and both its packings (4 + 4 + 2 bytes an element), the
    // activations and the outputs of the most rows; later the sweep's bf16 weights and one
    // f32 weight being packed; first the bandwidth loop's 256 MiB. All within 2^28-element
    // bounds (checked above), so no product overflows.
    let most_rows = a.rows.iter().copied().max().unwrap_or(1) as u64;
    let shape_bytes = |&(n, k): &(usize, usize)| {
        let (n, k) = (n as u64, k as u64);
        10 * n * k + 4 * most_rows * (k + 2 * n)
    };
    // With --sweep-codes, two more sets of the same bytes, and one weight's codes and
    // scales being packed.
    let sweep_sets = if a.sweep_codes { 3 } else { 1 };
    let sweep = match (a.sweep_mib, shapes.first()) {
        (0, _) | (_, None) => 0,
        (mib, Some(&(n, k))) => sweep_sets * (mib << 20) + 6 * (n * k) as u64,
    };
    let needed = shapes
        .iter()
        .map(shape_bytes)
        .chain([sweep, 256 << 20])
        .max();
    super::sizes::check_memory(
        needed.unwrap_or(0),
        "these --shapes, --rows and --sweep-mib",
        "--sweep-mib, --shapes or --rows",
    )?;
    let isas = if a.isa.is_empty() {
        Isa::ALL
            .into_iter()
            .filter(|i| i.host_support().is_ok())
            .collect()
    } else {
        a.isa.clone()
    };
    let kernels: Vec<Kernels> = isas
        .iter()
        .map(|&i| Kernels::select(Some(i)))
        .collect::<Result<_, _>>()?;
    let team = Team::new(threads);
    super::outln!("{}", host_line());
    let not_run: Vec<&str> = Isa::ALL
        .into_iter()
        .filter(|i| i.host_support().is_err())
        .map(Isa::name)
        .collect();
    if !not_run.is_empty() {
        super::outln!("variants this host cannot run: {}", not_run.join(", "));
    }
    let peaks: Vec<(Isa, Option<f64>)> = Isa::ALL
        .into_iter()
        .filter(|i| isas.contains(i) || kernels.iter().any(|k| k.gemm_variant(false) == *i))
        .map(|i| (i, peak_flops(i, threads, a.seconds.max(1.0))))
        .collect();
    let peak_of = |isa: Isa| peaks.iter().find(|p| p.0 == isa).and_then(|p| p.1);
    super::outln!(
        "peak, {} thread(s), best over at least 1 s of a loop of each variant's multiply-add: {}",
        threads,
        peaks
            .iter()
            .filter_map(|(i, p)| p.map(|p| format!("{i} {:.0} GF/s", p / 1e9)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let bw = tpc::runtime::calibrate::read_loop_bandwidth(threads, 256, a.seconds);
    super::outln!(
        "read bandwidth, {} thread(s): {:.1} GB/s; {} thread(s) per product, best of {:.1} s each",
        threads,
        bw / 1e9,
        threads,
        a.seconds
    );
    super::outln!(
        "{:>5} {:>11} {:>10} | {:>33} | {:>33} | {:>10}",
        "rows",
        "out x in",
        "--isa",
        "packed bf16 (kernel)",
        "packed f32 (kernel)",
        "gemm crate"
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
            let mut out = vec![0f32; m * n];
            let t_ref = best(a.seconds, || {
                gemm_f32((m, n, k), &mut out, n, &x.data, (&w.data, 1, k), threads);
                std::hint::black_box(&out);
            });
            // Decode reads every weight once: GB/s against the read bandwidth; a prompt
            // computes: GFLOP/s against the peak of the variant that ran.
            let cell = |t: Duration, bytes: usize, ran: Isa, gemv: bool| {
                let s = t.as_secs_f64();
                if gemv {
                    let gbs = bytes as f64 / s;
                    format!(
                        "{:>7.1} µs {:>5.1} GB/s {:>3.0}% bw {:<6}",
                        s * 1e6,
                        gbs / 1e9,
                        100.0 * gbs / bw,
                        short(ran)
                    )
                } else {
                    let pct = peak_of(ran).map_or("   -".into(), |p| {
                        format!("{:>3.0}%", 100.0 * flops / s / p)
                    });
                    format!(
                        "{:>7.2} ms {:>5.0} GF/s {pct} pk {:<6}",
                        s * 1e3,
                        flops / s / 1e9,
                        short(ran)
                    )
                }
            };
            for &kern in &kernels {
                let t_bf16 = best(a.seconds, || {
                    std::hint::black_box(bf16.matmul_with(kern, &x, &team));
                });
                let t_f32 = best(a.seconds, || {
                    std::hint::black_box(f32w.matmul_with(kern, &x, &team));
                });
                let gemv = |bf16: bool| m <= kern.gemv_max_rows(bf16);
                let ran = |bf16: bool| {
                    if gemv(bf16) {
                        kern.gemv_variant(bf16)
                    } else {
                        kern.gemm_variant(bf16)
                    }
                };
                super::outln!(
                    "{:>5} {:>11} {:>10} | {} | {} | {:>7.2} ms",
                    m,
                    format!("{n}x{k}"),
                    kern.isa().name(),
                    cell(t_bf16, n * k * 2, ran(true), gemv(true)),
                    cell(t_f32, n * k * 4, ran(false), gemv(false)),
                    t_ref.as_secs_f64() * 1e3,
                );
            }
        }
    }
    if a.sweep_mib > 0 {
        let (n, k) = shapes[0];
        // clap bounds --sweep-mib to 8 GiB.
        let count = ((a.sweep_mib as usize) << 20).div_ceil(n * k * 2).max(2);
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
        let mut sets = vec![("bf16", mats)];
        if a.sweep_codes {
            let count = ((a.sweep_mib as usize) << 20).div_ceil(n * k).max(2);
            for (name, kind) in [("INT8", CodeKind::Int8), ("FP8", CodeKind::E4m3)] {
                let mats = (0..count)
                    .map(|s| {
                        // Every byte but e4m3's NaN codes (0x7f, 0xff), which loading refuses.
                        let codes: Vec<u8> = (0..n * k)
                            .map(|i| match ((i * 53 + s * 7) % 251) as u8 {
                                b if b & 0x7f == 0x7f => b ^ 1,
                                b => b,
                            })
                            .collect();
                        let scales = vec![0.01; n];
                        PackedMatrix::from_codes(kind, n, k, &codes, &scales, k, true)
                    })
                    .collect();
                sets.push((name, mats));
            }
        }
        let x = Tensor::new(vec![1, k], vec![0.5; k]);
        for &kern in &kernels {
            for (name, mats) in &sets {
                let bytes: usize = mats.iter().map(PackedMatrix::bytes).sum();
                let t = best(a.seconds, || {
                    for m in mats {
                        std::hint::black_box(m.matmul_with(kern, &x, &team));
                    }
                });
                let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
                super::outln!(
                    "cold sweep, --isa {}: one row through {} distinct {n}x{k} {name} weights ({} MiB): {gbs:.1} GB/s = {:.2}x the read bandwidth",
                    kern.isa(),
                    mats.len(),
                    bytes >> 20,
                    gbs / (bw / 1e9)
                );
            }
        }
    }
    Ok(())
}

/// A variant's name in a table cell.
fn short(isa: Isa) -> &'static str {
    match isa {
        Isa::Avx512Bf16 => "bf16dp",
        i => i.name(),
    }
}
