//! `tpc bench-comm [--tp N]`: barrier and all-reduce latency and bus bandwidth of the
//! in-process communicator (ring and one-shot) against the memcpy bound, measured in one
//! run; the numbers behind the one-shot threshold.

use tpc::runtime::comm::bench::{bench_all_reduce, bench_barrier, format_table};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks (threads).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Timed calls per size.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Smallest message, as a power of two of bytes (12: 4 KiB).
    #[arg(long, default_value_t = 12)]
    from_log2: u32,
    /// Largest message, as a power of two of bytes (24: 16 MiB).
    #[arg(long, default_value_t = 24)]
    to_log2: u32,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.tp >= 1 && a.tp <= 64, "--tp must be 1..=64");
    anyhow::ensure!(
        a.from_log2 <= a.to_log2 && a.to_log2 <= 30,
        "--from-log2 must not exceed --to-log2 (at most 30)"
    );
    println!("{:?}", bench_barrier(a.tp, 20_000.min(a.iters * 100)));
    let sizes: Vec<usize> = (a.from_log2..=a.to_log2).map(|p| 1usize << p).collect();
    print!(
        "{}",
        format_table(&bench_all_reduce(a.tp, &sizes, a.iters.max(1)))
    );
    Ok(())
}
