//! Runtime: executes per-rank plans on CPU ranks (threads) with real collectives. Plans are
//! its only input; it never re-derives sharding.

pub mod affinity;
pub mod attention;
pub mod backend;
pub mod comm;
pub mod cpu;
pub mod executor;
pub mod fastmath;
pub mod generate;
pub mod memory;
pub mod microkernel;
pub mod packed;
pub mod random;
pub mod rope;
pub mod sampling;
pub mod simd;
pub mod team;
pub mod tensor;
pub mod verify;
pub mod weights;
