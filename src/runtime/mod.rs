//! Runtime: executes per-rank plans on a backend (CPU today) with real collectives, ranks
//! started by a launcher (threads today). Plans are its only input; it never re-derives
//! sharding.

pub mod affinity;
pub mod aligned;
pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod attention_amx;
#[cfg(target_arch = "x86_64")]
pub mod attention_decode;
pub mod backend;
pub mod collectives;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod executor;
pub mod fastmath;
pub mod generate;
pub mod kernels;
pub mod launch;
pub mod memory;
pub mod packed;
#[cfg(feature = "mpi")]
pub mod processes;
pub mod random;
pub mod rank_groups;
pub mod replicas;
pub mod rope;
pub mod sampling;
pub mod shape_rules;
pub mod simd;
pub mod stage_link;
pub mod team;
pub mod tensor;
pub mod verify;
pub mod weights;
