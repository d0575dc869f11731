//! `--launcher`: where `run` and `bench` put their ranks — threads of this process, or MPI
//! processes started by `mpirun` (one global rank each, feature `mpi`).

use tpc::plan::Plan;
use tpc::runtime::generate::{BatchOutput, Request, RunOptions};
use tpc::runtime::weights::WeightSource;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    /// MPI when an MPI launcher started this process with more than one rank, else threads.
    Auto,
    Threads,
    Mpi,
}

/// This process's MPI environment (no value exists in a build without MPI).
#[cfg(feature = "mpi")]
pub type MpiWorld = tpc::runtime::processes::MpiWorld;
#[cfg(not(feature = "mpi"))]
pub type MpiWorld = std::convert::Infallible;

/// Runs `body` with ranks as threads (`None`), or as this MPI process's rank when
/// `launcher` says so. A rank that fails prints its error, naming itself, and ends the job
/// (`MPI_Abort`), so no peer waits on it; a panic does the same.
pub fn with_launcher(
    launcher: Launcher,
    body: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mpi = match launcher {
        Launcher::Auto => tpc::runtime::launch::mpi_launched_world_size().is_some_and(|n| n > 1),
        Launcher::Threads => false,
        Launcher::Mpi => true,
    };
    if !mpi {
        return body(None);
    }
    as_process(body)
}

#[cfg(not(feature = "mpi"))]
fn as_process(_: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>) -> anyhow::Result<()> {
    anyhow::bail!(
        "an MPI launcher started this process (or --launcher mpi was given), but this tpc was built without MPI: build it with `cargo build --release --features mpi` (needs Open MPI: libopenmpi-dev, openmpi-bin, libclang-dev), or run without mpirun for ranks as threads"
    )
}

#[cfg(feature = "mpi")]
fn as_process(body: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let world = MpiWorld::init()?;
    tpc::runtime::processes::abort_job_on_panic();
    let (rank, size) = (world.rank(), world.size());
    match body(Some(&world)) {
        Ok(()) => Ok(()),
        Err(e) if e.downcast_ref::<super::ClosedPipe>().is_some() => Ok(()),
        Err(e) => {
            eprintln!("error: rank {rank} of {size}: {e:#}");
            world.abort(1)
        }
    }
}

/// This MPI process's rank of the run: world rank 0 gets the batch's results, the other
/// ranks `None`. No progress or streamed results (the ranks are processes).
#[cfg(feature = "mpi")]
pub fn run_as_process(
    world: &MpiWorld,
    plan: &Plan,
    weights: &dyn WeightSource,
    requests: &[Request],
    opts: RunOptions,
    dp: usize,
) -> anyhow::Result<Option<BatchOutput>> {
    let opts = RunOptions {
        progress: None,
        on_finished: None,
        ..opts
    };
    Ok(tpc::runtime::processes::run_batch_mpi(
        world, plan, weights, requests, &opts, dp,
    )?)
}

#[cfg(not(feature = "mpi"))]
pub fn run_as_process(
    world: &MpiWorld,
    _: &Plan,
    _: &dyn WeightSource,
    _: &[Request],
    _: RunOptions,
    _: usize,
) -> anyhow::Result<Option<BatchOutput>> {
    match *world {}
}

/// The world size when ranks are processes (the layout printed with the results).
pub fn processes(world: Option<&MpiWorld>) -> Option<usize> {
    #[cfg(feature = "mpi")]
    {
        world.map(|w| w.size())
    }
    #[cfg(not(feature = "mpi"))]
    {
        world.map(|w| match *w {})
    }
}
