//! `--launcher`: where `run` and `bench` put their ranks — threads of this process, or MPI
//! processes started by `mpirun` (one global rank each, feature `mpi`).

use tpc::plan::Plan;
use tpc::runtime::generate::{BatchOutput, Request, RunOptions};
pub use tpc::runtime::launch::MpiThreads;
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

/// Runs `body` (of the subcommand `command`) with ranks as threads (`None`), or as this MPI
/// process's rank when `launcher` says so. A rank that fails prints its error, naming
/// itself, and ends the job (`MPI_Abort`), so no peer waits on it; a panic does the same.
/// Ranks that found they disagree ([`agree`]) all print it and exit 1 without aborting:
/// none waits on another.
pub fn with_launcher(
    command: &str,
    launcher: Launcher,
    threads: MpiThreads,
    body: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mpi = match launcher {
        Launcher::Auto => launched_with_peers(),
        Launcher::Threads => false,
        Launcher::Mpi => true,
    };
    if !mpi {
        stand_by(&format!("{command} --launcher threads"))?;
        return body(None);
    }
    as_process(threads, body)
}

/// Whether an MPI launcher started this process as one of several.
fn launched_with_peers() -> bool {
    tpc::runtime::launch::mpi_launched_world_size().is_some_and(|n| n > 1)
}

/// For a process that an MPI launcher started as one of several but that runs no MPI rank
/// (`--launcher threads`, a subcommand without ranks such as `compile`): it joins MPI only
/// for the ranks' first collective, the agreement, with a record naming what it runs.
/// Without this, MPI ranks started beside it would wait in that collective forever:
/// Open MPI's `mpirun` does not end a job when one of its processes exits 0 without
/// calling MPI_Init. When every process runs the same such command, they agree and each
/// goes on alone, as before. (A build without MPI cannot join; nothing then waits on it
/// unless other processes are of a build with MPI.)
#[cfg(feature = "mpi")]
pub fn stand_by(command: &str) -> anyhow::Result<()> {
    if !launched_with_peers() {
        return Ok(());
    }
    let world = MpiWorld::init(MpiThreads::OneAtATime)?;
    match world.agree(&tpc::runtime::agreement::Record::new(command)) {
        // MPI_Finalize on drop: every process agreed, so every one reaches it.
        Ok(()) => Ok(()),
        Err(e) => stop_disagreeing(world, &e.into()),
    }
}

#[cfg(not(feature = "mpi"))]
pub fn stand_by(_: &str) -> anyhow::Result<()> {
    Ok(())
}

/// Ends this process after the ranks found they disagree: every rank found the same
/// difference at the same collective and stops, so MPI_Finalize (on drop) returns on all
/// of them, and mpirun reports exit 1 without MPI_Abort's report.
#[cfg(feature = "mpi")]
fn stop_disagreeing(world: MpiWorld, e: &anyhow::Error) -> ! {
    // One write, so that the ranks' lines do not interleave in mpirun's output.
    let line = format!("error: rank {} of {}: {e:#}\n", world.rank(), world.size());
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    drop(world);
    std::process::exit(1)
}

#[cfg(not(feature = "mpi"))]
fn as_process(
    _: MpiThreads,
    _: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    anyhow::bail!(
        "an MPI launcher started this process (or --launcher mpi was given), but this tpc was built without MPI: build it with `cargo build --release --features mpi` (needs Open MPI: libopenmpi-dev, openmpi-bin, libclang-dev), or run without mpirun for ranks as threads"
    )
}

#[cfg(feature = "mpi")]
fn as_process(
    threads: MpiThreads,
    body: impl FnOnce(Option<&MpiWorld>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let world = MpiWorld::init(threads)?;
    tpc::runtime::processes::abort_job_on_panic();
    let (rank, size) = (world.rank(), world.size());
    match body(Some(&world)) {
        Ok(()) => Ok(()),
        Err(e) if e.downcast_ref::<super::ClosedPipe>().is_some() => Ok(()),
        Err(e)
            if matches!(
                e.downcast_ref::<tpc::runtime::error::RunError>(),
                Some(tpc::runtime::error::RunError::RanksDisagree(_))
            ) =>
        {
            stop_disagreeing(world, &e)
        }
        Err(e) => {
            eprintln!("error: rank {rank} of {size}: {e:#}");
            world.abort(1)
        }
    }
}

/// Stops unless every MPI rank runs the same job: the first collective of `run`, `bench`
/// and `bench-comm`, before anything is loaded ([`tpc::runtime::agreement`]).
#[cfg(feature = "mpi")]
pub fn agree(world: &MpiWorld, record: &tpc::runtime::agreement::Record) -> anyhow::Result<()> {
    Ok(world.agree(record)?)
}

#[cfg(not(feature = "mpi"))]
pub fn agree(world: &MpiWorld, _: &tpc::runtime::agreement::Record) -> anyhow::Result<()> {
    match *world {}
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

/// What the MPI ranks of `serve` hold before they load.
#[cfg_attr(
    not(feature = "mpi"),
    allow(dead_code, reason = "read by the MPI launcher alone")
)]
pub struct ServeJob<'a> {
    pub model: &'a std::path::Path,
    pub plan: &'a Plan,
    pub checkpoint: &'a tpc::runtime::weights::Checkpoint,
    pub exec: &'a super::ExecArgs,
    pub shard: tpc::passes::ShardOptions,
    pub dp: u64,
    pub engine: &'a tpc::runtime::engine::launch::EngineOptions,
}

/// The engine's result and, in the process that listens, the client's.
pub type Served<T> = (tpc::runtime::error::Result<()>, Option<T>);

/// This MPI process's rank of `serve`: the ranks first agree on the job (the plan, the
/// model's files, the engine's settings), then load and serve; `client` (the HTTP server)
/// runs in the process of the leading rank. The other processes ignore SIGTERM: they stop
/// when the leading rank, draining, tells them to.
#[cfg(feature = "mpi")]
pub fn serve_as_process<T: Send>(
    world: &MpiWorld,
    job: &ServeJob<'_>,
    client: impl FnOnce(
            std::sync::Arc<dyn tpc::runtime::engine::api::Serving>,
            std::sync::mpsc::Receiver<()>,
        ) -> T
        + Send,
) -> anyhow::Result<Served<T>> {
    let opts = job.exec.options();
    let e = job.engine;
    let mut record = super::agreement::record(&super::agreement::Job {
        command: "serve",
        model: job.model,
        plan: job.plan,
        checkpoint: Some(job.checkpoint),
        requests: &[],
        prompt_options: "the prompts",
        opts: &opts,
        dp: job.dp,
        shard: job.shard,
    })?;
    record
        .argument("--block-size", e.block_size)
        .argument(
            "--kv-cache-memory",
            e.kv_cache_memory
                .map_or_else(|| "from free memory".to_string(), |m| m.to_string()),
        )
        .argument("--max-num-seqs", e.max_num_seqs)
        .argument("--max-num-batched-tokens", e.max_num_batched_tokens)
        .argument("--no-prefix-caching", !e.prefix_caching)
        .argument(
            "--max-model-len",
            e.max_model_len
                .map_or_else(|| "the model's".to_string(), |m| m.to_string()),
        );
    agree(world, &record)?;
    // The leading process's server installs its own SIGTERM handler once it listens.
    ignore_sigterm();
    Ok(tpc::runtime::processes::serve::serve_mpi(
        world,
        job.plan,
        job.checkpoint,
        &opts.device,
        opts.dtype,
        job.engine,
        usize::try_from(job.dp)?,
        client,
    )?)
}

/// SIGTERM (from `mpirun`, or a kill of the process group) leaves this process running.
#[cfg(feature = "mpi")]
fn ignore_sigterm() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code; it is
    // done before the rank starts its threads' work.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
}

#[cfg(not(feature = "mpi"))]
pub fn serve_as_process<T: Send>(
    world: &MpiWorld,
    _: &ServeJob<'_>,
    _: impl FnOnce(
            std::sync::Arc<dyn tpc::runtime::engine::api::Serving>,
            std::sync::mpsc::Receiver<()>,
        ) -> T
        + Send,
) -> anyhow::Result<Served<T>> {
    match *world {}
}
