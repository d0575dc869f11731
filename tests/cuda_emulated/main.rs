//! The CUDA kernels of `kernels/` run on the CPU (`tests/emulator`: g++, fibers for CUDA
//! threads) against plain references, with no GPU and no CUDA library. Part of the default
//! run (it needs g++); `scripts/build_device_bundle.sh` leaves it out of the GPU bundle.

#[path = "../emulator/mod.rs"]
#[allow(
    dead_code,
    reason = "only the kernel launcher; the stand-in libraries are for the cuda tests"
)]
mod emulator;

mod kernels;
mod ops;
mod quant;
