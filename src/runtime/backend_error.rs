//! Why a backend could not do what the executor asked. Its own module, below the
//! [`Backend`](super::backend::Backend) contract and the shape rules that both use it.

use thiserror::Error;

/// Why a backend could not do what the executor asked. The executor adds the instruction.
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("{0}")]
    Shape(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A device call failed (a GPU backend: the driver, a library, a kernel launch).
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Weights(super::weights::WeightError),
}

pub type BackendResult<T> = std::result::Result<T, BackendError>;
