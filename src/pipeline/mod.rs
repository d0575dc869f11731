//! The compiler's entry points: a model definition → sharded graph → plan (`plan::build`),
//! and a compiled plan split into pipeline stages (`plan::stages`). Above every layer of the
//! compiler, this is also where the tests that compile whole models and check what one
//! layer made of them live (`tests/`), so that no layer reaches a layer above it.

pub use crate::plan::build::{compile, compile_forcing, compile_full, compile_with, Compiled};
pub use crate::plan::stages::split_stages;

#[cfg(test)]
mod tests;
