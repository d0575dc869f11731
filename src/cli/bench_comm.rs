//! `tpc bench-comm [--tp N] [--dtype f32|bf16]`: barrier and all-reduce latency and bus
//! bandwidth of the in-process communicator (one-shot, two-shot and ring) against the memcpy
//! bound, measured in one run; the numbers behind the one-shot threshold. Under `mpirun -np W` (a
//! build with `--features mpi`): the all-reduce over W processes, tpc's exact one and
//! `MPI_Allreduce`, printed by world rank 0.

use tpc::runtime::comm::bench::{bench_all_reduce, bench_barrier, format_table};

/// Element type of the measured all-reduces.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks (threads).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Timed calls per size, 1 to 10^6.
    #[arg(long, default_value_t = 200, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    iters: usize,
    /// Smallest message, as a power of two of bytes (12: 4 KiB).
    #[arg(long, default_value_t = 12)]
    from_log2: u32,
    /// Largest message, as a power of two of bytes (24: 16 MiB).
    #[arg(long, default_value_t = 24)]
    to_log2: u32,
    /// Element type of the all-reduces (message sizes stay in bytes; MPI measures f32).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    /// Ranks as threads, or as the MPI processes `mpirun` started (auto: MPI when mpirun
    /// started this process with W > 1; --tp is then W).
    #[arg(long, value_enum, default_value_t = super::launcher::Launcher::Auto)]
    launcher: super::launcher::Launcher,
}

pub fn execute(a: Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.tp >= 1 && a.tp <= 64, "--tp must be 1..=64");
    anyhow::ensure!(
        a.from_log2 <= a.to_log2 && a.to_log2 <= 30,
        "--from-log2 must not exceed --to-log2 (at most 30)"
    );
    // Each rank holds the reduced buffer, a source and a destination for the memcpy bound
    // and up to three staging buffers of the communicator, all of the largest size; an MPI
    // process holds one rank, with a gather of the world's buffers besides.
    let largest = 1u64 << a.to_log2;
    let world = tpc::runtime::launch::mpi_launched_world_size()
        .filter(|&w| w > 1 && !matches!(a.launcher, super::launcher::Launcher::Threads));
    let (needed, what) = match world {
        Some(w) => (
            (6 + w as u64).saturating_mul(largest),
            format!(
                "one of {w} MPI ranks with messages of 2^{} bytes",
                a.to_log2
            ),
        ),
        None => (
            (6 * a.tp as u64).saturating_mul(largest),
            format!(
                "{} rank{} with messages of 2^{} bytes",
                a.tp,
                if a.tp == 1 { "" } else { "s" },
                a.to_log2
            ),
        ),
    };
    super::sizes::check_memory(needed, &what, "--to-log2 or --tp")?;
    super::launcher::with_launcher(
        "bench-comm",
        a.launcher,
        super::launcher::MpiThreads::OneAtATime,
        |mpi| match mpi {
            None => in_process(&a),
            Some(world) => {
                // Before the communicator's copy, itself a collective.
                let mut record = tpc::runtime::agreement::Record::new("bench-comm");
                record
                    .argument("--iters", a.iters)
                    .argument("--from-log2", a.from_log2)
                    .argument("--to-log2", a.to_log2)
                    .argument("--dtype", format!("{:?}", a.dtype).to_lowercase());
                super::launcher::agree(world, &record)?;
                anyhow::ensure!(
                    matches!(a.dtype, Dtype::F32),
                    "over MPI bench-comm measures f32 all-reduces only; drop --dtype bf16"
                );
                over_mpi(world, &a)
            }
        },
    )
}

#[cfg(feature = "mpi")]
fn over_mpi(world: &super::launcher::MpiWorld, a: &Args) -> anyhow::Result<()> {
    let sizes: Vec<usize> = (a.from_log2..=a.to_log2).map(|p| 1usize << p).collect();
    let rows = tpc::runtime::comm::bench_all_reduce_mpi(&mut world.comm(), &sizes, a.iters);
    if world.rank() == 0 {
        super::print_stdout(&format_table(&rows))?;
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn over_mpi(world: &super::launcher::MpiWorld, _: &Args) -> anyhow::Result<()> {
    match *world {}
}

fn in_process(a: &Args) -> anyhow::Result<()> {
    let barrier = bench_barrier(a.tp, 20_000.min(a.iters * 100));
    super::outln!(
        "barrier, {} ranks: {:.2} µs median (std::sync::Barrier: {:.2} µs; spin {:?}, yields {})",
        barrier.world,
        barrier.group_median_us,
        barrier.std_median_us,
        barrier.backoff.spin,
        barrier.backoff.yields
    );
    let sizes: Vec<usize> = (a.from_log2..=a.to_log2).map(|p| 1usize << p).collect();
    let iters = a.iters.max(1);
    let rows = match a.dtype {
        Dtype::F32 => bench_all_reduce::<f32>(a.tp, &sizes, iters),
        Dtype::Bf16 => bench_all_reduce::<half::bf16>(a.tp, &sizes, iters),
    };
    super::print_stdout(&format_table(&rows))?;
    Ok(())
}
