//! `tpc calibrate`: measures this host with the runtime's own code and turns the figures
//! into a [`HwProfile`] whose ranks share the host ([`SharedHost`]):
//!
//! - compute: achieved FLOP/s of the packed linear kernels (the best variant this host
//!   runs, as `tpc run` picks it) over one pass of a model's linears (TinyLlama-1.1B's by
//!   default; every linear in program order, each with its own weights, up to a cap of
//!   weight bytes) at a prompt's rows, bf16 and f32 weights, all cores;
//! - memory: the bytes per second the decode GEMV (one row) reaches through distinct bf16
//!   weights far larger than the caches (and, for reference, a plain read loop);
//! - attention: the runtime's causal attention at head sizes 8 to 128 (its rate depends on
//!   the size: small heads take a slower path);
//! - per-op cost: decode steps of the shipped tiny model (`models/tiny-llama.ron`, random
//!   weights) through the executor, less the compute and elementwise time the other
//!   figures price for them, per op (never below the smallest linear through the team);
//! - collectives: α and β of the in-process communicator's one-shot, two-shot and ring
//!   all-reduce, fitted by least squares to `bench-comm`'s measurements at 2 ranks (256 B
//!   to 16 MiB by default).
//!
//! The figures are achieved rates, so the profile's efficiencies are 1. Rates are the median
//! of repeated calls, what a whole prefill or decode sustains; the per-op cost is taken from
//! best times (the floor the executor reaches).

use crate::cost::profile::{AlphaBeta, HwProfile, LinkCosts, SharedHost, QUICK_SOURCE};
use crate::ir::WeightOrder;
use crate::runtime::comm::bench::{bench_all_reduce, BenchKind, BenchRow};
use crate::runtime::cpu::isa::{Isa, KernelError, Kernels};
use crate::runtime::cpu::packed::PackedMatrix;
use crate::runtime::cpu::team::Team;
use crate::runtime::tensor::Tensor;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Why a calibration could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("cannot fit latency and bandwidth to the all-reduce times: {0}")]
    Fit(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("the {what} measurement came out as {value}; the host may be too busy, run again")]
    Measurement { what: &'static str, value: f64 },
    #[error("no linear of the model is small enough to measure (at most {max} weight elements)")]
    NoShapes { max: usize },
    #[error("running the tiny model through the executor failed: {0}")]
    Executor(String),
}

/// Largest weight (elements) a compute measurement packs.
pub const MAX_SHAPE_ELEMENTS: usize = 1 << 26;

/// What to measure and for how long.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Weight shapes (out, in) of one pass of a model's linears, in program order (repeats
    /// count: every layer's linears have weights of their own).
    pub shapes: Vec<(usize, usize)>,
    /// MiB of bf16 weights the pass is cut to (whole linears from its start).
    pub pass_mib: usize,
    /// Rows (prompt tokens) of the prompt products.
    pub rows: usize,
    /// Seconds per compute measurement (the median call counts: see [`median`]).
    pub seconds: f64,
    /// MiB of distinct bf16 weights the decode GEMV sweeps.
    pub sweep_mib: usize,
    /// Message sizes of the all-reduces, bytes.
    pub comm_sizes: Vec<usize>,
    /// Timed calls per all-reduce size.
    pub comm_iters: usize,
    /// Calls of the smallest linear timed for the per-op cost's floor.
    pub op_calls: usize,
    /// Decode steps of the tiny model timed for the per-op cost.
    pub decode_steps: usize,
    /// Threads for compute and bandwidth: every core the runtime would use.
    pub threads: usize,
    /// A quick measurement: the profile is marked rough ([`HwProfile::rough`]).
    pub rough: bool,
}

/// One layer of TinyLlama-1.1B's linears (q, k, v, o, gate, up, down): the CPU benchmark's.
pub const DEFAULT_LAYER: [(usize, usize); 7] = [
    (2048, 2048),
    (256, 2048),
    (256, 2048),
    (2048, 2048),
    (5632, 2048),
    (5632, 2048),
    (2048, 5632),
];

/// TinyLlama-1.1B's 22 layers of linears (the LM head, which a prefill runs on one row per
/// sequence, left out).
pub fn default_shapes() -> Vec<(usize, usize)> {
    DEFAULT_LAYER.repeat(22)
}

impl Settings {
    /// The full measurement (tens of seconds).
    pub fn full(threads: usize) -> Settings {
        Settings {
            shapes: default_shapes(),
            pass_mib: 512,
            rows: 128,
            seconds: 0.4,
            sweep_mib: 512,
            comm_sizes: (8..=24).map(|p| 1usize << p).collect(),
            comm_iters: 100,
            op_calls: 2000,
            decode_steps: 64,
            threads: threads.max(1),
            rough: false,
        }
    }

    /// A cheap, rough measurement (a second or two): small products, a sweep that fits in
    /// a large cache, few all-reduce sizes. For trying the command, not for predictions.
    pub fn quick(threads: usize) -> Settings {
        Settings {
            shapes: vec![(256, 256), (512, 256)],
            pass_mib: 1,
            rows: 64,
            seconds: 0.02,
            sweep_mib: 8,
            comm_sizes: (12..=20).step_by(2).map(|p| 1usize << p).collect(),
            comm_iters: 8,
            op_calls: 100,
            decode_steps: 8,
            threads: threads.max(1),
            rough: true,
        }
    }
}

/// The CPU the figures belong to.
#[derive(Debug, Clone, PartialEq)]
pub struct HostInfo {
    pub model: String,
    /// The instruction-set flags the kernels care about, as /proc/cpuinfo names them.
    pub flags: Vec<String>,
    pub cores: usize,
    /// Installed memory (MemTotal), bytes; 0 when unknown.
    pub memory_bytes: u64,
}

/// One all-reduce algorithm's fit and the points it was fitted to.
#[derive(Debug, Clone, PartialEq)]
pub struct CommFit {
    pub fit: AlphaBeta,
    /// (bytes each rank moves by the cost model's formula, median seconds).
    pub points: Vec<(f64, f64)>,
    /// Set when the points would not fit a line (a noisy host): why, and that the figures
    /// are bounds instead (α the smallest time, β the largest message over its time).
    pub note: Option<String>,
}

/// [`fit_alpha_beta`], or, when the points do not make a line with positive slope, the
/// bounds: α = the smallest time, β = the largest message's bytes over its time.
pub fn fit_or_bound(points: &[(f64, f64)]) -> Result<(AlphaBeta, Option<String>), CalibrateError> {
    match fit_alpha_beta(points) {
        Ok(f) => Ok((f, None)),
        Err(e) => {
            let good: Vec<&(f64, f64)> = points
                .iter()
                .filter(|(x, y)| x.is_finite() && *x > 0.0 && y.is_finite() && *y > 0.0)
                .collect();
            let alpha = good.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
            let Some(&&(x, y)) = good.iter().max_by(|a, b| a.0.total_cmp(&b.0)) else {
                return Err(e);
            };
            Ok((
                AlphaBeta {
                    alpha_s: alpha,
                    beta_bytes_per_s: x / y,
                },
                Some(format!("{e}; bounds used instead (alpha: the smallest time, beta: the largest message over its time)")),
            ))
        }
    }
}

/// Everything one calibration measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub host: HostInfo,
    pub threads: usize,
    pub isa: Isa,
    pub gemm_bf16_variant: Isa,
    pub gemm_f32_variant: Isa,
    pub gemm_bf16_flops: f64,
    pub gemm_f32_flops: f64,
    pub gemv_bandwidth: f64,
    pub sweep_bytes: usize,
    pub read_bandwidth: f64,
    pub op_overhead_s: f64,
    /// The floor of the per-op cost: median one-row 16×16 linear through the team.
    pub bare_op_s: f64,
    /// Best decode step of the tiny model through the executor, and its compute ops.
    pub executor_step_s: f64,
    pub executor_ops: f64,
    /// The per-op cost of a rank with one thread (none when the host has one core), and the
    /// tiny model's best decode step it comes from.
    pub op_overhead_one_thread_s: Option<f64>,
    pub executor_step_one_thread_s: f64,
    /// GEMM FLOP/s of one of `threads` one-thread ranks running the pass split over them at
    /// once (bf16, f32 weights); none with one core.
    pub one_thread_flops: Option<(f64, f64)>,
    /// Linears (and their bf16 weight bytes) in the timed pass.
    pub pass_linears: usize,
    pub pass_bytes: usize,
    /// FLOP/s of the runtime's causal attention on a prompt (4 per head and dim per pair).
    pub attention_flops: f64,
    /// Its FLOP/s by head size.
    pub attention_by_head_dim: Vec<(u64, f64)>,
    pub comm_world: usize,
    pub one_shot: CommFit,
    pub two_shot: CommFit,
    pub ring: CommFit,
    pub settings: Settings,
}

/// The best time of `f` over at least 3 calls and `budget` seconds, after one untimed call.
pub fn best(budget: f64, mut f: impl FnMut()) -> Duration {
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

/// The median time of `f` over at least 5 calls and `budget` seconds, after one untimed
/// call: a throughput a whole prefill or decode sustains on a shared host, where the best
/// of a few calls is a burst the next pass does not see again (the GEMM pass moved from 484
/// to 777 GFLOP/s between three calibrations in a row on the 2-core KVM guest).
pub fn median(budget: f64, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || start.elapsed().as_secs_f64() < budget {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort_unstable();
    times[times.len() / 2]
}

fn checked(what: &'static str, value: f64) -> Result<f64, CalibrateError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(CalibrateError::Measurement { what, value })
    }
}

/// A deterministic weight (values in about [-0.5, 0.5]).
fn weight(n: usize, k: usize, seed: usize) -> Tensor {
    Tensor::new(
        vec![n, k],
        (0..n * k)
            .map(|i| ((i * 53 + seed) % 97) as f32 / 97.0 - 0.5)
            .collect(),
    )
}

/// The linears of the timed pass: `shapes` from the start, whole, up to `pass_mib` MiB of
/// bf16 weights (at least one).
fn pass_shapes(s: &Settings) -> Vec<(usize, usize)> {
    let cap = s.pass_mib.max(1) << 20;
    let mut bytes = 0usize;
    let mut out = Vec::new();
    for &(n, k) in &s.shapes {
        let b = n.saturating_mul(k).saturating_mul(2);
        if !out.is_empty() && bytes.saturating_add(b) > cap {
            break;
        }
        bytes = bytes.saturating_add(b);
        out.push((n, k));
    }
    out
}

/// One pass of linears at a prompt's rows: each with packed weights of its own (so they
/// stream from memory as a model's do), the inputs shared by width.
struct Pass {
    shapes: Vec<(usize, usize)>,
    mats: Vec<PackedMatrix>,
    inputs: std::collections::HashMap<usize, Tensor>,
    rows: usize,
}

impl Pass {
    /// `shapes` (out, in) at `rows` rows; weight `i` is seeded `seed(i)`.
    fn new(
        shapes: Vec<(usize, usize)>,
        rows: usize,
        bf16: bool,
        seed: impl Fn(usize) -> usize,
    ) -> Pass {
        let mats = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| {
                PackedMatrix::pack(&weight(n, k, seed(i)), WeightOrder::OutIn, bf16)
            })
            .collect();
        let mut inputs = std::collections::HashMap::new();
        for &(_, k) in &shapes {
            inputs.entry(k).or_insert_with(|| {
                Tensor::new(
                    vec![rows, k],
                    (0..rows * k)
                        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                        .collect(),
                )
            });
        }
        Pass {
            shapes,
            mats,
            inputs,
            rows,
        }
    }

    fn flops(&self) -> f64 {
        self.shapes
            .iter()
            .map(|&(n, k)| 2.0 * (self.rows * n * k) as f64)
            .sum()
    }

    fn run(&self, kern: Kernels, team: &Team) {
        for (m, &(_, k)) in self.mats.iter().zip(&self.shapes) {
            if let Some(x) = self.inputs.get(&k) {
                std::hint::black_box(m.matmul_with(kern, x, team));
            }
        }
    }
}

/// Achieved FLOP/s of the packed linear over one [`Pass`] of [`pass_shapes`]: total FLOPs
/// over the median pass.
fn gemm_rate(kern: Kernels, team: &Team, s: &Settings, bf16: bool) -> Result<f64, CalibrateError> {
    let pass = Pass::new(pass_shapes(s), s.rows, bf16, |i| i);
    let t = median(s.seconds, || pass.run(kern, team));
    checked(
        if bf16 {
            "bf16 GEMM FLOP/s"
        } else {
            "f32 GEMM FLOP/s"
        },
        pass.flops() / t.as_secs_f64(),
    )
}

/// FLOP/s one rank reaches when `s.threads` ranks of one thread each run the pass at once,
/// each over its share of every linear's outputs (what tp = cores runs): each timed pass
/// starts and ends at a barrier, so it lasts as long as the slowest rank's; the median of
/// at least five passes.
fn gemm_rate_one_thread_ranks(
    kern: Kernels,
    s: &Settings,
    bf16: bool,
) -> Result<f64, CalibrateError> {
    let ranks = s.threads.max(1);
    let shapes: Vec<(usize, usize)> = pass_shapes(s)
        .into_iter()
        .map(|(n, k)| (n.div_ceil(ranks), k))
        .collect();
    let barrier = std::sync::Barrier::new(ranks);
    let passes = 6;
    let (times, flops) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..ranks)
            .map(|rank| {
                let (shapes, barrier) = (shapes.clone(), &barrier);
                scope.spawn(move || {
                    let team = Team::new(1);
                    let pass = Pass::new(shapes, s.rows, bf16, |i| i * ranks + rank);
                    let mut times = Vec::with_capacity(passes);
                    for _ in 0..passes {
                        barrier.wait();
                        let t = Instant::now();
                        pass.run(kern, &team);
                        barrier.wait();
                        times.push(t.elapsed());
                    }
                    (times, pass.flops())
                })
            })
            .collect();
        // Every rank waits at the same barriers: rank 0's times are the group's.
        let mut first = (Vec::new(), 0.0);
        for (rank, w) in workers.into_iter().enumerate() {
            let t = w.join().unwrap_or_default();
            if rank == 0 {
                first = t;
            }
        }
        first
    });
    // The first pass warms up (packing done, caches cold): the median of the others.
    let mut timed: Vec<Duration> = times.into_iter().skip(1).collect();
    timed.sort_unstable();
    let t = timed.get(timed.len() / 2).copied().unwrap_or_default();
    checked("one-thread rank GEMM FLOP/s", flops / t.as_secs_f64())
}

/// Bytes/s of a one-row product through distinct bf16 weights of about `mib` MiB in all.
fn gemv_sweep(kern: Kernels, team: &Team, s: &Settings) -> Result<(f64, usize), CalibrateError> {
    let (n, k) = (2048, 2048);
    let count = (s.sweep_mib << 20).div_ceil(n * k * 2).max(2);
    let mats: Vec<PackedMatrix> = (0..count)
        .map(|i| PackedMatrix::pack(&weight(n, k, i), WeightOrder::OutIn, true))
        .collect();
    let bytes: usize = mats.iter().map(PackedMatrix::bytes).sum();
    let x = Tensor::new(vec![1, k], vec![0.5; k]);
    let t = median(s.seconds.max(0.01) * 2.0, || {
        for m in &mats {
            std::hint::black_box(m.matmul_with(kern, &x, team));
        }
    });
    Ok((
        checked("decode GEMV bandwidth", bytes as f64 / t.as_secs_f64())?,
        bytes,
    ))
}

/// Read bandwidth (bytes/s) of `threads` threads summing disjoint parts of a buffer of
/// `mib` MiB (vectorised, like the C sum in `scripts/bench_vs_torch.sh`), in the faster of
/// two read orders: one sequential stream per thread, and the decode GEMVs' order (64 KiB
/// blocks, each read as `STREAMS` parts at once; see `runtime/cpu/isa/streams.rs`), which
/// reads faster where one stream leaves the memory system idle. `tpc bench-gemm` reports it
/// too.
pub fn read_loop_bandwidth(threads: usize, mib: usize, budget: f64) -> f64 {
    let values = vec![1f32; (mib.max(1) << 20) / 4];
    let part = values.len().div_ceil(threads.max(1));
    let time = |sum: fn(&[f32], &mut f32)| {
        best(budget / 2.0, || {
            std::thread::scope(|s| {
                for chunk in values.chunks(part) {
                    s.spawn(move || {
                        let mut total = 0.0;
                        sum(chunk, &mut total);
                        std::hint::black_box(total)
                    });
                }
            })
        })
    };
    let t = time(sum_one_stream).min(time(sum_in_parts));
    (values.len() * 4) as f64 / t.as_secs_f64()
}

crate::runtime::simd::widest_simd_fn!(fn sum_one_stream(x: &[f32], total: &mut f32) => one_stream);
crate::runtime::simd::widest_simd_fn!(fn sum_in_parts(x: &[f32], total: &mut f32) => in_parts);

#[inline(always)]
fn one_stream(x: &[f32], total: &mut f32) {
    let mut acc = [0f32; 16];
    for c in x.chunks_exact(16) {
        for l in 0..16 {
            acc[l] += c[l];
        }
    }
    *total += acc.iter().sum::<f32>();
}

#[inline(always)]
fn in_parts(x: &[f32], total: &mut f32) {
    use crate::runtime::cpu::isa::streams::STREAMS;
    const BLOCK: usize = (64 << 10) / 4;
    const LEN: usize = BLOCK / STREAMS;
    let mut acc = [[0f32; 16]; 4];
    let blocks = x.chunks_exact(BLOCK);
    one_stream(blocks.remainder(), total);
    for block in blocks {
        let block: &[f32; BLOCK] = block.try_into().expect("chunks_exact gives BLOCK values");
        for i in (0..LEN).step_by(16) {
            for s in 0..STREAMS {
                let line = &block[s * LEN + i..][..16];
                #[cfg(target_arch = "x86_64")]
                crate::runtime::cpu::isa::streams::prefetch_pair(line.as_ptr() as *const u8, 0, 64);
                for l in 0..16 {
                    acc[s % 4][l] += line[l];
                }
            }
        }
    }
    *total += acc.iter().flatten().sum::<f32>();
}

fn read_bandwidth(threads: usize, mib: usize, budget: f64) -> Result<f64, CalibrateError> {
    checked("read bandwidth", read_loop_bandwidth(threads, mib, budget))
}

/// Head sizes the attention rate is measured at.
pub const ATTENTION_HEAD_DIMS: [usize; 5] = [8, 16, 32, 64, 128];

/// FLOP/s of the runtime's causal attention over a whole prompt of `s.rows` tokens, 32
/// query heads of `d` over 4 key/value heads, 4 FLOPs per head and dim per (query, key)
/// pair (the count the cost model uses).
fn attention_rate(team: &Team, s: &Settings, d: usize) -> Result<f64, CalibrateError> {
    let (t, heads, kv_heads) = (s.rows, 32, 4);
    let q = Tensor::new(
        vec![t, heads * d],
        (0..t * heads * d).map(|i| (i % 13) as f32 / 13.0).collect(),
    );
    let kv: Vec<f32> = (0..t * kv_heads * d)
        .map(|i| (i % 7) as f32 / 7.0)
        .collect();
    let scale = 1.0 / (d as f32).sqrt();
    let cache = crate::runtime::cpu::attention::KvView::contiguous(&kv, &kv, kv_heads * d)
        .map_err(CalibrateError::Executor)?;
    let time = median(s.seconds, || {
        std::hint::black_box(crate::runtime::cpu::attention::causal_attention(
            team, &q, &cache, d, kv_heads, scale,
        ));
    });
    let flops = 4.0 * (heads * d) as f64 * (t * (t + 1) / 2) as f64;
    checked("attention FLOP/s", flops / time.as_secs_f64())
}

/// Median time of the smallest linear (one row, 16×16) through the team: what every op
/// pays besides its arithmetic and memory traffic.
fn op_overhead(kern: Kernels, team: &Team, calls: usize) -> Result<f64, CalibrateError> {
    let w = PackedMatrix::pack(&weight(16, 16, 0), WeightOrder::OutIn, false);
    let x = Tensor::new(vec![1, 16], vec![0.5; 16]);
    for _ in 0..calls.min(100) {
        std::hint::black_box(w.matmul_with(kern, &x, team));
    }
    let mut times: Vec<f64> = (0..calls.max(1))
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(w.matmul_with(kern, &x, team));
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    // A zero (a clock coarser than the call) is a real "too small to see", not a failure.
    Ok(times[times.len() / 2].max(1e-9))
}

/// α and β of `t = α + bytes / β` by least squares on relative errors (each point weighted
/// by 1/t², so 4 KiB latencies count as much as 16 MiB transfers). A negative intercept
/// (latency lost in the noise) is refitted through the origin (α = 0).
pub fn fit_alpha_beta(points: &[(f64, f64)]) -> Result<AlphaBeta, CalibrateError> {
    if points.len() < 2 {
        return Err(CalibrateError::Fit(format!(
            "{} point(s); at least two message sizes are needed",
            points.len()
        )));
    }
    if let Some(p) = points
        .iter()
        .find(|(x, y)| !(x.is_finite() && *x >= 0.0 && y.is_finite() && *y > 0.0))
    {
        return Err(CalibrateError::Fit(format!(
            "the point ({} bytes, {} s) is not a finite, positive time",
            p.0, p.1
        )));
    }
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in points {
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    if !(det.is_finite() && det > 0.0) {
        return Err(CalibrateError::Fit(
            "every point has the same size; measure at least two sizes".into(),
        ));
    }
    let mut slope = (sw * sxy - sx * sy) / det;
    let mut alpha = (sy - slope * sx) / sw;
    if alpha < 0.0 {
        alpha = 0.0;
        slope = sxy / sxx;
    }
    if !(slope.is_finite() && slope > 0.0) {
        return Err(CalibrateError::Fit(format!(
            "the times do not grow with the message size (slope {slope:e} s/byte); \
             measure larger messages or on a quieter host"
        )));
    }
    Ok(AlphaBeta {
        alpha_s: alpha,
        beta_bytes_per_s: 1.0 / slope,
    })
}

/// Points of one algorithm: bytes each rank moves by the cost model's formula for `world`
/// ranks (ring and two-shot: 2(p−1)/p · K; one-shot: (p−1) · K), against the median time.
fn comm_points(rows: &[BenchRow], kind: BenchKind, world: usize) -> Vec<(f64, f64)> {
    let p = world as f64;
    rows.iter()
        .filter(|r| r.kind == kind)
        .map(|r| {
            let k = r.bytes as f64;
            let wire = match kind {
                BenchKind::Ring | BenchKind::TwoShot => 2.0 * (p - 1.0) / p * k,
                _ => (p - 1.0) * k,
            };
            (wire, r.median_us * 1e-6)
        })
        .collect()
}

/// The CPU's model name, its kernel-relevant flags, cores and installed memory.
pub fn host_info(cores: usize) -> HostInfo {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let wanted = [
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512_bf16",
        "amx_tile",
        "amx_bf16",
    ];
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_bytes = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<u64>().ok())
        .map_or(0, |kib| kib.saturating_mul(1024));
    let model = field("model name");
    HostInfo {
        model: if model.is_empty() {
            std::env::consts::ARCH.to_string()
        } else {
            model
        },
        flags: wanted
            .into_iter()
            .filter(|w| flags.split_whitespace().any(|f| f == *w))
            .map(str::to_string)
            .collect(),
        cores,
        memory_bytes,
    }
}

/// Measures this host (see the module notes).
pub fn measure(s: &Settings) -> Result<Calibration, CalibrateError> {
    let kern = Kernels::select(None)?;
    let team = Team::new(s.threads);
    let host = host_info(s.threads);
    let gemm_bf16_flops = gemm_rate(kern, &team, s, true)?;
    let gemm_f32_flops = gemm_rate(kern, &team, s, false)?;
    let (gemv_bandwidth, sweep_bytes) = gemv_sweep(kern, &team, s)?;
    let read_bandwidth = read_bandwidth(s.threads, s.sweep_mib.max(8), s.seconds * 2.0)?;
    let bare_op_s = op_overhead(kern, &team, s.op_calls)?;
    let mut attention_by_head_dim = Vec::new();
    for d in ATTENTION_HEAD_DIMS {
        attention_by_head_dim.push((d as u64, attention_rate(&team, s, d)?));
    }
    let attention_flops = attention_by_head_dim
        .iter()
        .find(|e| e.0 == 64)
        .map_or(f64::NAN, |e| e.1);
    drop(team);
    let world = 2;
    let rows = bench_all_reduce::<f32>(world, &s.comm_sizes, s.comm_iters.max(1));
    let fit = |kind| -> Result<CommFit, CalibrateError> {
        let points = comm_points(&rows, kind, world);
        let (fit, note) = fit_or_bound(&points)?;
        Ok(CommFit { fit, points, note })
    };
    let one_shot = fit(BenchKind::OneShot)?;
    let two_shot = fit(BenchKind::TwoShot)?;
    let mut ring = fit(BenchKind::Ring)?;
    // The ring pays its latency once per step, (p − 1) steps: α per step.
    ring.fit.alpha_s /= (world - 1) as f64;
    let pass = pass_shapes(s);
    let mut c = Calibration {
        host,
        threads: s.threads,
        isa: kern.isa(),
        gemm_bf16_variant: kern.gemm_variant(true),
        gemm_f32_variant: kern.gemm_variant(false),
        gemm_bf16_flops,
        gemm_f32_flops,
        gemv_bandwidth,
        sweep_bytes,
        read_bandwidth,
        op_overhead_s: bare_op_s,
        bare_op_s,
        executor_step_s: 0.0,
        executor_ops: 0.0,
        op_overhead_one_thread_s: None,
        executor_step_one_thread_s: 0.0,
        one_thread_flops: None,
        pass_linears: pass.len(),
        pass_bytes: pass.iter().map(|(n, k)| n * k * 2).sum(),
        attention_flops,
        attention_by_head_dim,
        comm_world: world,
        one_shot,
        two_shot,
        ring,
        settings: s.clone(),
    };
    let (step, ops, priced) = executor_step(&c.profile(), s)?;
    c.executor_step_s = step;
    c.executor_ops = ops;
    c.op_overhead_s = ((step - priced) / ops.max(1.0)).max(bare_op_s);
    // A rank of a tp ≥ cores run has one thread: measured apart, at one core's share of the
    // host's rates.
    if s.threads > 1 {
        c.one_thread_flops = Some((
            gemm_rate_one_thread_ranks(kern, s, true)?,
            gemm_rate_one_thread_ranks(kern, s, false)?,
        ));
        let one = Settings {
            threads: 1,
            ..s.clone()
        };
        let (step, ops, priced) = executor_step(&one_core_share(&c.profile(), s.threads), &one)?;
        // Never below the smallest linear through a one-thread team (a busy host can leave
        // the residual at or under zero).
        let bare_one = op_overhead(kern, &Team::new(1), s.op_calls)?;
        c.executor_step_one_thread_s = step;
        c.op_overhead_one_thread_s = Some(((step - priced) / ops.max(1.0)).max(bare_one));
    }
    Ok(c)
}

/// The best decode step of the shipped tiny model (f32, random weights, tp 1, all threads)
/// through the executor, its compute ops per step, and what `profile` prices that step's
/// compute and elementwise ops at (its weights, in cache, are not priced at the DRAM
/// bandwidth).
fn executor_step(hw: &HwProfile, s: &Settings) -> Result<(f64, f64, f64), CalibrateError> {
    use crate::cost::simulate::{simulate_as, Numerics, Workload};
    let err = |e: &dyn std::fmt::Display| CalibrateError::Executor(e.to_string());
    let path = std::path::Path::new("models/tiny-llama.ron");
    let def: crate::frontend::spec::ModelDef =
        crate::frontend::load::parse_ron(path, include_str!("../../models/tiny-llama.ron"))
            .map_err(|e| err(&e))?;
    let plan = crate::pipeline::compile(&def, 1).map_err(|e| err(&e))?.plan;
    let weights = crate::runtime::random::RandomWeights::new(&plan, 0);
    let prompt = 16usize;
    let steps = s.decode_steps.max(2);
    let request = crate::runtime::generate::Request {
        prompt: (0..prompt as i64).map(|i| (i * 7919) % 250).collect(),
        max_new_tokens: None,
    };
    let opts = crate::runtime::generate::RunOptions {
        dtype: crate::runtime::generate::ComputeDtype::F32,
        max_new_tokens: steps + 1,
        device: crate::runtime::device::Device::Cpu(crate::runtime::cpu::CpuOptions {
            threads_per_rank: s.threads,
            ..Default::default()
        }),
        all_prompt_logits: false,
        warmup: 1,
        repeat: 3,
        ..Default::default()
    };
    let out =
        crate::runtime::run::run_batch(&plan, &weights, &[request], &opts).map_err(|e| err(&e))?;
    let decoded = out.generated_tokens().saturating_sub(1).max(1);
    let step = checked("executor decode step", out.decode_seconds / decoded as f64)?;
    let mut bare = hw.clone();
    bare.op_overhead_s = 0.0;
    let work = Workload {
        batch: 1,
        prompt: prompt as u64,
        gen: (steps + 1) as u64,
    };
    let e = simulate_as(&plan, &bare, work, Numerics::cpu_runtime(false));
    let ops = crate::cost::simulate::ops_per_pass(&plan);
    // The tiny model's 400 KB of weights stay in cache from step to step: its step pays
    // its arithmetic and activations, not the DRAM term the profile's bandwidth prices.
    Ok((
        step,
        ops,
        e.decode_step.compute_s + e.decode_step.elementwise_s,
    ))
}

/// `hw` with one of `threads` cores' share of its compute, attention and bandwidth rates.
fn one_core_share(hw: &HwProfile, threads: usize) -> HwProfile {
    let k = 1.0 / threads.max(1) as f64;
    let mut one = hw.clone();
    one.peak_flops_bf16 *= k;
    one.peak_flops_f32 *= k;
    one.memory_bandwidth *= k;
    one.attention_flops = one.attention_flops.map(|a| a * k);
    for (_, a) in &mut one.attention_flops_by_head_dim {
        *a *= k;
    }
    one
}

/// The civil date (UTC, `YYYY-MM-DD`) of a Unix time in seconds.
pub fn utc_date(unix_s: u64) -> String {
    // Howard Hinnant's days-to-civil algorithm.
    let z = (unix_s / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

impl Calibration {
    /// The profile these figures make (efficiencies 1: the figures are achieved rates).
    pub fn profile(&self) -> HwProfile {
        let date = utc_date(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        );
        let s = &self.settings;
        let h = &self.host;
        // Quick settings with another model's shapes are still a quick measurement.
        let kind = if s.rough {
            format!("{QUICK_SOURCE} (rough: small products, a sweep that may fit in cache)")
        } else {
            "tpc calibrate".into()
        };
        let sources = vec![
            format!(
                "{kind}, tpc {} on {date}: {}; flags: {}; {} cores; {} bytes of memory",
                env!("CARGO_PKG_VERSION"),
                h.model,
                h.flags.join(" "),
                h.cores,
                h.memory_bytes
            ),
            format!(
                "peak_flops_bf16 / peak_flops_f32: achieved by the packed linear ({} / {} kernels, {} threads) over one pass of {} linears ({} MiB of bf16 weights, each its own; the model's first, in program order) at {} rows: total FLOPs over the median pass",
                self.gemm_bf16_variant,
                self.gemm_f32_variant,
                self.threads,
                self.pass_linears,
                self.pass_bytes >> 20,
                s.rows,
            ),
            format!(
                "memory_bandwidth: one-row products (decode GEMV, {} kernels) through {} MiB of distinct bf16 weights, {} threads, median sweep; the faster of two plain read loops (one stream per thread; the GEMVs' 8-part order) reached {:.2e} B/s",
                self.isa,
                self.sweep_bytes >> 20,
                self.threads,
                self.read_bandwidth
            ),
            format!(
                "attention_flops / attention_flops_by_head_dim: the runtime's causal attention over a {}-token prompt, 32 query heads of 8, 16, 32, 64, 128 (attention_flops: 64) over 4 kv heads, {} threads, median call, 4 FLOPs per head-dim per pair",
                s.rows, self.threads
            ),
            format!(
                "op_overhead_s: the tiny model's (models/tiny-llama.ron, f32, random weights, tp 1) best decode step through the executor, {:.2} us, less the compute and elementwise time the other figures price (its weights stay in cache), over its {} compute ops; floor: median of {} calls of a one-row 16x16 linear through the team ({:.3} us)",
                self.executor_step_s * 1e6,
                self.executor_ops,
                s.op_calls,
                self.bare_op_s * 1e6
            ),
            match self.op_overhead_one_thread_s {
                Some(o) => format!(
                    "shared.op_overhead_one_thread_s: the same with one thread (a rank of tp >= cores), {:.2} us per step at one core's share of the rates: {:.3} us per op (floor: the one-row 16x16 linear through a one-thread team)",
                    self.executor_step_one_thread_s * 1e6,
                    o * 1e6
                ),
                None => "shared.op_overhead_one_thread_s: not measured (one core)".into(),
            },
            match self.one_thread_flops {
                Some(_) => format!(
                    "shared.one_thread_flops_bf16 / _f32: {} ranks of one thread each running the same pass at once, each over 1/{} of every linear's outputs; one rank's FLOPs over the median pass (each pass between two barriers: the slowest rank's)",
                    self.threads, self.threads
                ),
                None => "shared.one_thread_flops_*: not measured (one core)".into(),
            },
            format!(
                "one_shot / two_shot / ring: in-process communicator, f32, {} ranks, least squares (relative) of the median times over {}..{} bytes; ring alpha per step",
                self.comm_world,
                s.comm_sizes.first().copied().unwrap_or(0),
                s.comm_sizes.last().copied().unwrap_or(0)
            ),
            format!(
                "fit notes: one_shot: {}; two_shot: {}; ring: {}",
                self.one_shot.note.as_deref().unwrap_or("least squares"),
                self.two_shot.note.as_deref().unwrap_or("least squares"),
                self.ring.note.as_deref().unwrap_or("least squares")
            ),
            "send_recv: the one-shot's figures".into(),
            "compute_efficiency, memory_efficiency: 1, the figures are achieved rates; shared: ranks share this host's cores and bandwidth".into(),
        ];
        HwProfile {
            name: format!("{} ({} cores), calibrated", h.model, h.cores),
            sources,
            devices: h.cores.max(1) as u64,
            memory_bytes: if h.memory_bytes > 0 {
                h.memory_bytes as f64
            } else {
                f64::NAN // refused by check: the caller says memory is unknown
            },
            peak_flops_bf16: self.gemm_bf16_flops,
            peak_flops_f32: self.gemm_f32_flops,
            memory_bandwidth: self.gemv_bandwidth,
            compute_efficiency: 1.0,
            memory_efficiency: 1.0,
            link: LinkCosts {
                ring: self.ring.fit,
                one_shot: self.one_shot.fit,
                two_shot: self.two_shot.fit,
                send_recv: self.one_shot.fit,
            },
            op_overhead_s: self.op_overhead_s,
            attention_flops: Some(self.attention_flops),
            attention_flops_by_head_dim: self.attention_by_head_dim.clone(),
            shared: Some(SharedHost {
                cores: h.cores.max(1) as u64,
                op_overhead_one_thread_s: self.op_overhead_one_thread_s,
                one_thread_flops_bf16: self.one_thread_flops.map(|f| f.0),
                one_thread_flops_f32: self.one_thread_flops.map(|f| f.1),
            }),
            rough: s.rough,
            rank_speeds: Vec::new(),
        }
    }

    /// The fitted all-reduce algorithms, by name.
    fn comm_fits(&self) -> [(&'static str, &CommFit); 3] {
        [
            ("one-shot", &self.one_shot),
            ("two-shot", &self.two_shot),
            ("ring", &self.ring),
        ]
    }

    /// A plain-text summary of what was measured.
    pub fn summary(&self) -> String {
        let h = &self.host;
        let mut out = format!(
            "host: {}; flags: {}; {} cores; kernels: {}\n{:<34} {:>14}  how\n",
            h.model,
            h.flags.join(" "),
            h.cores,
            self.isa,
            "figure",
            "value"
        );
        let mut row = |what: &str, value: String, how: String| {
            let _ = writeln!(out, "{what:<34} {value:>14}  {how}");
        };
        row(
            "GEMM bf16 weights",
            format!("{:.1} GF/s", self.gemm_bf16_flops / 1e9),
            format!(
                "{} kernel, {} rows, {} linears ({} MiB)",
                self.gemm_bf16_variant,
                self.settings.rows,
                self.pass_linears,
                self.pass_bytes >> 20
            ),
        );
        row(
            "GEMM f32 weights",
            format!("{:.1} GF/s", self.gemm_f32_flops / 1e9),
            format!(
                "{} kernel, {} rows",
                self.gemm_f32_variant, self.settings.rows
            ),
        );
        row(
            "decode GEMV bandwidth",
            format!("{:.2} GB/s", self.gemv_bandwidth / 1e9),
            format!("{} MiB of bf16 weights, one row", self.sweep_bytes >> 20),
        );
        row(
            "read loop bandwidth",
            format!("{:.2} GB/s", self.read_bandwidth / 1e9),
            "reference only".into(),
        );
        row(
            "attention",
            format!("{:.1} GF/s", self.attention_flops / 1e9),
            format!("causal, {} tokens, 32 heads of 64", self.settings.rows),
        );
        for (d, a) in &self.attention_by_head_dim {
            row(
                &format!("attention, heads of {d}"),
                format!("{:.1} GF/s", a / 1e9),
                "".into(),
            );
        }
        row(
            "per-op overhead",
            format!("{:.2} µs", self.op_overhead_s * 1e6),
            format!(
                "tiny model's decode step {:.1} µs / {} ops through the executor",
                self.executor_step_s * 1e6,
                self.executor_ops
            ),
        );
        if let Some((bf16, f32)) = self.one_thread_flops {
            row(
                "GEMM, one-thread rank (bf16 / f32)",
                format!("{:.0} / {:.0} GF/s", bf16 / 1e9, f32 / 1e9),
                format!(
                    "{} such ranks at once, the pass split over them",
                    self.threads
                ),
            );
        }
        if let Some(o) = self.op_overhead_one_thread_s {
            row(
                "per-op overhead, one thread",
                format!("{:.2} µs", o * 1e6),
                format!(
                    "the same step with one thread: {:.1} µs",
                    self.executor_step_one_thread_s * 1e6
                ),
            );
        }
        for (name, f) in self.comm_fits() {
            row(
                &format!("{name} all-reduce α"),
                format!("{:.2} µs", f.fit.alpha_s * 1e6),
                format!("{} ranks, f32, {} sizes", self.comm_world, f.points.len()),
            );
            row(
                &format!("{name} all-reduce β"),
                format!("{:.2} GB/s", f.fit.beta_bytes_per_s / 1e9),
                "bytes each rank moves per second".into(),
            );
        }
        for (name, f) in self.comm_fits() {
            if let Some(note) = &f.note {
                let _ = writeln!(out, "note, {name}: {note}");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_line_and_refuses_what_is_not_one() {
        // t = 5 µs + bytes / 10 GB/s, exactly.
        let pts: Vec<(f64, f64)> = [4096.0, 65536.0, 1048576.0, 16777216.0]
            .iter()
            .map(|&x| (x, 5e-6 + x / 1e10))
            .collect();
        let f = fit_alpha_beta(&pts).unwrap();
        assert!((f.alpha_s - 5e-6).abs() < 1e-12, "{f:?}");
        assert!((f.beta_bytes_per_s / 1e10 - 1.0).abs() < 1e-9, "{f:?}");
        // Hand-made noisy points: (0, 2), (1, 3.1), (2, 3.9) in (bytes, s) with weights
        // 1/t²; the intercept and slope solve the weighted normal equations.
        let pts = [(0.0, 2.0), (1.0, 3.1), (2.0, 3.9)];
        let w: Vec<f64> = pts.iter().map(|p| 1.0 / (p.1 * p.1)).collect();
        let s = |f: &dyn Fn(f64, f64) -> f64| -> f64 {
            pts.iter().zip(&w).map(|(p, w)| w * f(p.0, p.1)).sum()
        };
        let (sw, sx, sy, sxx, sxy) = (
            s(&|_, _| 1.0),
            s(&|x, _| x),
            s(&|_, y| y),
            s(&|x, _| x * x),
            s(&|x, y| x * y),
        );
        let slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
        let f = fit_alpha_beta(&pts).unwrap();
        assert!((1.0 / f.beta_bytes_per_s - slope).abs() < 1e-12);
        assert!((f.alpha_s - (sy - slope * sx) / sw).abs() < 1e-12);
        assert!(f.alpha_s > 1.9 && f.alpha_s < 2.1 && slope > 0.9 && slope < 1.0);
        // A negative intercept is refitted through the origin.
        let f = fit_alpha_beta(&[(1.0, 0.5), (2.0, 1.6), (3.0, 2.7)]).unwrap();
        assert_eq!(f.alpha_s, 0.0);
        // Refusals: too few points, one size, falling times, NaN.
        assert!(fit_alpha_beta(&[(1.0, 1.0)]).is_err());
        assert!(fit_alpha_beta(&[(1.0, 1.0), (1.0, 2.0)]).is_err());
        assert!(fit_alpha_beta(&[(1.0, 2.0), (2.0, 1.0)]).is_err());
        assert!(fit_alpha_beta(&[(1.0, f64::NAN), (2.0, 1.0)]).is_err());
        assert!(fit_alpha_beta(&[(1.0, 0.0), (2.0, 1.0)]).is_err());
        // Falling times (a noisy host) give bounds, with a note saying so.
        let (b, note) = fit_or_bound(&[(1000.0, 2e-6), (4000.0, 1e-6)]).unwrap();
        assert_eq!(b.alpha_s, 1e-6);
        assert_eq!(b.beta_bytes_per_s, 4e9);
        assert!(note.unwrap().contains("bounds"));
        assert!(fit_or_bound(&[]).is_err());
        assert_eq!(fit_or_bound(&pts).unwrap().1, None);
    }

    #[test]
    fn ring_points_use_the_models_wire_bytes() {
        let row = |kind, bytes| BenchRow {
            world: 2,
            dtype: crate::ir::DType::F32,
            bytes,
            kind,
            iters: 1,
            median_us: 1.0,
            min_us: 1.0,
            bus_gb_s: 1.0,
        };
        let rows = [
            row(BenchKind::Ring, 4096),
            row(BenchKind::OneShot, 4096),
            row(BenchKind::TwoShot, 8192),
        ];
        assert_eq!(comm_points(&rows, BenchKind::Ring, 4), vec![(6144.0, 1e-6)]);
        assert_eq!(
            comm_points(&rows, BenchKind::TwoShot, 4),
            vec![(12288.0, 1e-6)]
        );
        assert_eq!(
            comm_points(&rows, BenchKind::OneShot, 4),
            vec![(12288.0, 1e-6)]
        );
    }

    /// Each all-reduce algorithm of the profile is priced from its own measurement.
    #[test]
    fn the_profile_prices_each_algorithm_from_its_own_fit() {
        let fit = |alpha_s: f64| CommFit {
            fit: AlphaBeta {
                alpha_s,
                beta_bytes_per_s: 1e10,
            },
            points: vec![(4096.0, alpha_s)],
            note: None,
        };
        let c = Calibration {
            host: HostInfo {
                model: "test cpu".into(),
                flags: Vec::new(),
                cores: 2,
                memory_bytes: 1 << 30,
            },
            threads: 2,
            isa: Isa::Portable,
            gemm_bf16_variant: Isa::Portable,
            gemm_f32_variant: Isa::Portable,
            gemm_bf16_flops: 1e11,
            gemm_f32_flops: 1e11,
            gemv_bandwidth: 1e10,
            sweep_bytes: 1 << 20,
            read_bandwidth: 1e10,
            op_overhead_s: 1e-6,
            bare_op_s: 1e-6,
            executor_step_s: 1e-4,
            executor_ops: 35.0,
            op_overhead_one_thread_s: None,
            executor_step_one_thread_s: 0.0,
            one_thread_flops: None,
            pass_linears: 2,
            pass_bytes: 1 << 20,
            attention_flops: 1e10,
            attention_by_head_dim: vec![(64, 1e10)],
            comm_world: 2,
            one_shot: fit(1e-6),
            two_shot: fit(2e-6),
            ring: fit(3e-6),
            settings: Settings::quick(2),
        };
        let link = c.profile().link;
        assert_eq!(link.one_shot.alpha_s, 1e-6);
        assert_eq!(link.two_shot.alpha_s, 2e-6);
        assert_eq!(link.ring.alpha_s, 3e-6);
        assert!(c.summary().contains("two-shot all-reduce α"));
    }

    #[test]
    fn dates() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(1_700_000_000), "2023-11-14");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
    }
}
