//! The `tpc` command line: one file per subcommand under `cli/`.

mod cli;

use clap::Parser;
use std::process::ExitCode;

/// Exit status of a failed command: 3 when `tpc verify` found a numerical mismatch, 1 for
/// every other error. (Usage errors exit 2 from clap before any command runs.)
fn failure_code(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<cli::Mismatch>().is_some() {
        3
    } else {
        1
    }
}

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::execute(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<cli::ClosedPipe>().is_some() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(failure_code(&e))
        }
    }
}
