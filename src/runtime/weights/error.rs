//! Why a checkpoint's weights cannot be read for a plan. Backends and the runtime both wrap
//! it, so it sits below them.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("checkpoint `{path}`: {problem}")]
    File { path: PathBuf, problem: String },
    #[error("checkpoint tensor `{tensor}` ({path}): {problem}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        problem: String,
    },
    /// A plan's weight slice that this checkpoint or runtime cannot serve.
    #[error("plan instruction `{name}` cannot run: {problem}. This plan does not fit this runtime; recompile it with this tpc.")]
    Slice { name: String, problem: String },
    /// A weight file that shrank after it was opened: something wrote it while tpc read it.
    #[error("the checkpoint `{path}` changed while it was being read ({what}); wait until nothing writes it (a download or copy has finished), then run again")]
    Changed { path: PathBuf, what: String },
    /// Reading a file (the checkpoint, its index).
    #[error(transparent)]
    Read(#[from] crate::error::TpcError),
}
