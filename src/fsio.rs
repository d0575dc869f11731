//! Reading and writing whole text files with errors that name the path.

use crate::error::{Result, TpcError};
use std::path::Path;

pub fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|io| TpcError::Read {
        path: path.to_path_buf(),
        io,
    })
}

pub fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|io| TpcError::Write {
        path: path.to_path_buf(),
        io,
    })
}

pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|io| TpcError::Write {
        path: path.to_path_buf(),
        io,
    })
}
