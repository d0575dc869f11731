//! The compiler's tests, one module per subject: model files and HF configs in, plans and
//! reports out. One test binary, so one link step (see `[[test]]` in Cargo.toml).

mod communication;
mod fused_weights;
mod golden;
mod hf_config;
mod plan_verify;
mod property;
#[path = "../common/scratch.rs"]
mod scratch;
mod sequence_parallel;
