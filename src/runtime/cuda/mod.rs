//! The CUDA side of the runtime (feature `cuda`): its kernels (`kernels/*.cu` at the top of
//! the repository), compiled at start by NVRTC for the device's architecture, and the probe
//! that finds the CUDA libraries before anything calls into them. cudarc loads the libraries
//! at run time, so this builds on machines without CUDA; a machine without them gets a
//! [`CudaError`], never a panic.

mod act;
pub mod backend;
pub mod comm;
pub mod device;
mod error;
pub mod launch;
pub mod nccl;
pub mod nvrtc;
pub mod one_shot;
pub mod probe;
pub mod serve;
pub mod sources;

pub use act::CudaAct;
pub use error::CudaError;
