//! Which CUDA libraries this machine can load. cudarc loads a library the first time one of
//! its functions is called and panics when it cannot; every entry into cudarc checks here
//! first, so a machine without CUDA gets a [`CudaError`] naming the library.

use super::CudaError;

/// A library the CUDA runtime of tpc loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    /// The driver (`libcuda`), installed with the NVIDIA driver.
    Driver,
    /// The run-time compiler (`libnvrtc`), from a CUDA toolkit or the `nvidia-cuda-nvrtc` wheel.
    Nvrtc,
    /// cuBLAS, from a toolkit or the `nvidia-cublas` wheel.
    Cublas,
    /// NCCL, from the `nvidia-nccl-cu13` wheel or a system package.
    Nccl,
}

impl Library {
    /// The name cudarc looks the library up by (`lib<name>.so…`).
    pub fn name(self) -> &'static str {
        match self {
            Library::Driver => "cuda",
            Library::Nvrtc => "nvrtc",
            Library::Cublas => "cublas",
            Library::Nccl => "nccl",
        }
    }

    fn present(self) -> bool {
        // SAFETY: each call only tries `dlopen` on cudarc's candidate names for the library
        // and closes what it opened; no symbol is called.
        unsafe {
            match self {
                Library::Driver => cudarc::driver::sys::is_culib_present(),
                Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                Library::Cublas => cudarc::cublas::sys::is_culib_present(),
                Library::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }
}

/// Ok when `library` can be loaded; otherwise the error that names it and the file names
/// tried.
pub fn require(library: Library) -> Result<(), CudaError> {
    if library.present() {
        return Ok(());
    }
    let tried = cudarc::get_lib_name_candidates(library.name());
    let shown: Vec<&str> = tried.iter().map(String::as_str).take(3).collect();
    Err(CudaError::LibraryMissing {
        library: format!("lib{}", library.name()),
        tried: format!("{}, … ({} names)", shown.join(", "), tried.len()),
    })
}
