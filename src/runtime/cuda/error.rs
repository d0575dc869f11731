//! The CUDA layer's errors: a library that is missing, a kernel that does not compile.

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA library could not be loaded (no driver, or its folder not on the loader path).
    #[error(
        "the CUDA library `{library}` was not found (tried {tried}); install the NVIDIA driver (libcuda) or the CUDA wheels, and put their `lib` folders on LD_LIBRARY_PATH"
    )]
    LibraryMissing { library: String, tried: String },

    /// NVRTC rejected a kernel file, or warned about it (tpc's kernels compile cleanly).
    #[error("kernel file `kernels/{file}` for {arch}: {problem}\n{log}")]
    Compile {
        file: String,
        arch: String,
        problem: String,
        log: String,
    },

    /// A driver or library call failed.
    #[error("CUDA: {what}: {error}")]
    Driver { what: String, error: String },

    /// `--device cuda:N` names a GPU the driver does not see.
    #[error("GPU {ordinal} does not exist: the driver sees {count} GPU(s) (numbered from 0)")]
    NoSuchDevice { ordinal: usize, count: usize },

    /// A kernel file name that is not one of `kernels/*.cu` (a bug in tpc).
    #[error("no kernel file `kernels/{0}` is built into tpc (a bug in tpc)")]
    UnknownKernelFile(String),
}

impl From<CudaError> for crate::runtime::error::RunError {
    fn from(e: CudaError) -> Self {
        crate::runtime::error::RunError::Device(Box::new(e))
    }
}

/// A failed device call during a collective.
pub(super) fn device_failure(
    during: &'static str,
    e: impl std::fmt::Debug,
) -> crate::runtime::collectives::CollectiveError {
    crate::runtime::collectives::CollectiveError::Device {
        during,
        problem: format!("{e:?}"),
    }
}
