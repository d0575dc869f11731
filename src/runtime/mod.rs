//! Runtime: executes per-rank plans with real collectives. Plans are its only input; it never
//! re-derives sharding.
//!
//! The root holds the device-neutral core: the [`backend::Backend`] contract, the
//! [`executor`] that runs a rank's program over it, [`generate`] (prefill, decode steps,
//! sampling), the collectives and communicators ([`collectives`], [`comm`]), weights, and the
//! launchers that place ranks (threads: [`launch`]; MPI processes: `processes`, feature
//! `mpi`; data-parallel replicas: [`replicas`]). Each device is a folder: [`cpu`] (always
//! built) and `cuda` (feature `cuda`; its kernel sources are the top-level `kernels/`).

pub mod activation;
pub mod agreement;
pub mod backend;
pub mod backend_error;
pub mod calibrate;
pub mod collectives;
pub mod comm;
pub mod cpu;
pub mod cpu_launch;
pub mod cpu_rank;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod engine;
pub mod ep_group;
pub mod error;
pub mod exact;
pub mod executor;
pub mod expert_exchange;
pub mod fused;
pub mod generate;
pub mod launch;
pub mod memory;
pub mod moe;
pub mod moe_across;
pub mod norm_steps;
#[cfg(feature = "mpi")]
pub mod processes;
pub mod random;
pub mod rank_groups;
pub mod replicas;
pub mod rope;
pub mod run;
pub mod sampling;
pub mod shape_rules;
pub mod simd;
pub mod stage_link;
pub mod tensor;
pub mod unpadded;
pub mod verify;
pub mod weights;
