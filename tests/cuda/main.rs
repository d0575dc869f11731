//! The CUDA backend (feature `cuda`; without it this binary has no tests): the kernels
//! through NVRTC, and the backend on a GPU or, where there is none, on the emulated GPUs
//! of `tests/emulator` in a child process. `scripts/device_check.sh` runs this binary on a
//! real GPU.

#[cfg(feature = "cuda")]
#[path = "../common/mod.rs"]
#[allow(
    dead_code,
    reason = "the GPU tests read the fixtures, not the batch helpers"
)]
mod common;
#[cfg(feature = "cuda")]
#[path = "../contract/mod.rs"]
mod contract;
#[cfg(feature = "cuda")]
#[path = "../emulator/mod.rs"]
#[allow(
    dead_code,
    reason = "only the stand-in libraries; the kernel launcher is for cuda_emulated"
)]
mod emulator;
#[cfg(feature = "cuda")]
#[path = "../common/serve_client.rs"]
#[allow(
    dead_code,
    reason = "SIGTERM only in the tests of GPU ranks as MPI processes"
)]
mod serve_client;

mod backend_contract;
mod device;
mod invariant;
mod kernels;
mod processes;
mod quantized;
mod serve;
