//! One rank's hold on a GPU: the device's context, the rank's own stream (ranks sharing a
//! GPU overlap), its cuBLAS handle on that stream, and every kernel of `kernels/` loaded.

use super::nvrtc::{compiled_all, Target};
use super::probe::{require, Library};
use super::sources::{kernel_names, KERNEL_FILES};
use super::CudaError;
use crate::runtime::backend::BackendError;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::Arc;

pub struct GpuRank {
    pub rank: usize,
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
}

/// How many GPUs the driver sees (an error, not a panic, where there is no driver).
pub fn device_count() -> Result<usize, CudaError> {
    require(Library::Driver)?;
    let n = CudaContext::device_count().map_err(|e| CudaError::Driver {
        what: "counting devices".into(),
        error: format!("{e:?}"),
    })?;
    Ok(n.max(0) as usize)
}

impl GpuRank {
    /// Rank `rank` on GPU `ordinal`: the libraries probed first, the kernels compiled (once
    /// per process) for the device's compute capability and loaded.
    pub fn open(rank: usize, ordinal: usize) -> Result<GpuRank, CudaError> {
        // The driver first (device_count probes it), then the libraries the rank needs.
        let count = device_count()?;
        require(Library::Nvrtc)?;
        require(Library::Cublas)?;
        let driver = |what: String| {
            move |e: DriverError| CudaError::Driver {
                what: what.clone(),
                error: format!("{e:?}"),
            }
        };
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver(format!("opening GPU {ordinal}")))?;
        let (major, minor) = ctx.compute_capability().map_err(driver(format!(
            "reading GPU {ordinal}'s compute capability"
        )))?;
        let target = Target {
            compute_capability: (major.max(0) as u32) * 10 + minor.max(0) as u32,
        };
        let stream = ctx
            .new_stream()
            .map_err(driver(format!("creating rank {rank}'s stream")))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Driver {
            what: format!("creating rank {rank}'s cuBLAS handle"),
            error: format!("{e:?}"),
        })?;
        let mut kernels = HashMap::new();
        let ptx = compiled_all(&target)?;
        for ((file, text), (_, ptx)) in KERNEL_FILES.iter().zip(ptx) {
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(driver(format!("loading kernels/{file}")))?;
            for name in kernel_names(text) {
                let f = module
                    .load_function(name)
                    .map_err(driver(format!("finding kernel `{name}` in kernels/{file}")))?;
                kernels.insert(name, f);
            }
        }
        Ok(GpuRank {
            rank,
            ordinal,
            ctx,
            stream,
            blas,
            kernels,
        })
    }

    /// A loaded kernel by name (all of `kernels/` is loaded; a missing one is a tpc bug).
    pub fn kernel(&self, name: &str) -> Result<&CudaFunction, BackendError> {
        self.kernels.get(name).ok_or_else(|| {
            BackendError::Device(format!("kernel `{name}` is not loaded (a bug in tpc)"))
        })
    }

    /// The error for a failed device call, naming the rank and the GPU; out of memory gets
    /// the bytes asked for and free.
    pub fn fail(&self, what: &str, asked_bytes: Option<usize>, e: DriverError) -> BackendError {
        let oom = e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        if oom {
            let free = self
                .ctx
                .mem_get_info()
                .map_or("unknown".to_string(), |(free, _)| format!("{free}"));
            return BackendError::OutOfMemory(format!(
                "rank {} on GPU {}: {what} asked for {} bytes, {free} bytes free",
                self.rank,
                self.ordinal,
                asked_bytes.map_or("?".to_string(), |b| b.to_string())
            ));
        }
        BackendError::Device(format!(
            "rank {} on GPU {}: {what}: {e:?}",
            self.rank, self.ordinal
        ))
    }
}

/// A grid-stride launch over `n` items: 256 threads a block, at most 4096 blocks.
pub fn grid_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid's x dimension: at most 2^31 − 1 blocks.
pub fn grid_dim(n: usize) -> Result<u32, BackendError> {
    u32::try_from(n.max(1))
        .ok()
        .filter(|&d| d <= i32::MAX as u32)
        .ok_or_else(|| BackendError::Unsupported(format!("a launch of {n} blocks")))
}

/// A grid's y dimension: at most 65535 blocks (heads, in practice).
pub fn grid_dim_y(n: usize) -> Result<u32, BackendError> {
    u32::try_from(n.max(1))
        .ok()
        .filter(|&d| d <= 65535)
        .ok_or_else(|| BackendError::Unsupported(format!("a launch of {n} blocks in y")))
}

/// One block per item (`items` blocks), `threads` threads each (a multiple of 32).
pub fn blocks_of(items: usize, threads: u32) -> Result<LaunchConfig, BackendError> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(items)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}
