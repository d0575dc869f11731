//! The command line as users and scripts drive it (the built `tpc` binary), one module per
//! command or concern. One test binary, so one link step (see `[[test]]` in Cargo.toml).

mod cli;
mod explain;
mod hardening;
mod inputs;
mod messages;
mod moe;
mod outputs;
mod plans;
mod ranks;
mod run_cli;
#[path = "../common/scratch.rs"]
mod scratch;
mod simulate;
