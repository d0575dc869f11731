//! The CPU backend: every rank's compute on this host's cores. [`backend`] implements the
//! runtime's `Backend` trait over packed weights ([`packed`]) and the rank's compute threads
//! ([`team`]); [`isa`] holds the matrix kernels per instruction set (portable, AVX2, AVX-512,
//! AVX-512 BF16, AMX) and picks one at start; [`attention`] the causal attention for prompts
//! and decode steps. (The CUDA kernels are the `.cu` files in the top-level `kernels/`.)

pub mod affinity;
pub mod aligned;
pub mod attention;
pub mod backend;
pub(crate) mod check_operands;
pub mod fastmath;
pub mod isa;
pub mod options;
pub mod packed;
pub(crate) mod self_check;
pub mod team;

pub use backend::{gemm_f32, CpuBackend};
pub use options::CpuOptions;
