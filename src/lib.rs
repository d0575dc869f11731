//! tpc: a tensor-parallel compiler and executor for transformer language models.
//!
//! Pipeline: [`frontend`] (model files → IR) → [`passes`] (layouts, collectives,
//! feasibility) → [`plan`] (per-rank programs, weight slices, report, DOT) → runtime.

pub mod cost;
pub mod error;
pub mod explain;
pub mod frontend;
pub mod fsio;
pub mod fsio_check;
pub mod ir;
#[cfg(test)]
mod layering;
pub mod passes;
pub mod pipeline;
pub mod plan;
pub mod provenance;
pub mod runtime;
pub mod serve;

pub use error::{Result, TpcError};
