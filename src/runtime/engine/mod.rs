//! The serving engine: continuous batching over a paged KV cache with prefix caching, one
//! step at a time on every rank. [`api`] is what clients (the HTTP server, `tpc run`) see.

pub mod api;
pub mod batch;
pub mod blocks;
pub mod driver;
pub mod handle;
pub mod launch;
pub mod metrics;
pub mod rank;
pub mod remote;
pub mod replicas;
pub mod scheduler;
pub mod step;
#[cfg(test)]
mod tests;
pub mod ticks;
