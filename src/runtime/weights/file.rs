//! One safetensors file of a checkpoint, open for reading with `pread`, never mapped.
//!
//! A mapped file that another process truncates while tpc copies from the map raises
//! SIGBUS in the copy: the run dies with nothing on stderr, and Rust offers no safe way to
//! turn that fault into an error (a handler cannot unwind the copy; replacing the page
//! behind the fault would hide it). A `pread` past the end of a shrunk file instead returns
//! fewer bytes than asked, which is reported as the file having changed. So every byte of
//! a checkpoint, header included, is read with `pread` into memory tpc owns.

use super::{file_err, Result, WeightError};
use crate::error::TpcError;
use safetensors::tensor::{Metadata, SafeTensorError};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The longest header safetensors itself reads (its `MAX_HEADER_SIZE`).
const MAX_HEADER: u64 = 100_000_000;

pub(super) struct ShardFile {
    pub path: PathBuf,
    file: std::fs::File,
    /// The file's length when it was opened; every tensor was checked to lie inside it.
    pub size: u64,
    /// Where tensor data starts (after the 8-byte length and the JSON header).
    pub data_start: u64,
    pub meta: Metadata,
}

impl ShardFile {
    /// Opens a regular file and reads and checks its header: the offsets tile the data
    /// exactly and every tensor's bytes match its shape and dtype.
    pub fn open(path: &Path) -> Result<ShardFile> {
        if path.is_dir() {
            return Err(file_err(
                path,
                "is a folder, not a safetensors file; the checkpoint's weights must be files",
            ));
        }
        let file = crate::fsio_check::open_regular(path).map_err(|io| TpcError::Read {
            path: path.to_path_buf(),
            io,
        })?;
        let size = file
            .metadata()
            .map_err(|io| TpcError::Read {
                path: path.to_path_buf(),
                io,
            })?
            .len();
        let (header, meta) = read_header(path, &file, size)?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            file,
            size,
            data_start: 8 + header,
            meta,
        })
    }

    /// Fills `buf` with the file's bytes from `offset`; a file now shorter than that is the
    /// error [`WeightError::Changed`].
    pub fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        read_exact_at(&self.path, &self.file, self.size, offset, buf)
    }
}

fn read_exact_at(
    path: &Path,
    file: &std::fs::File,
    size: u64,
    offset: u64,
    buf: &mut [u8],
) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|io| {
        if io.kind() == std::io::ErrorKind::UnexpectedEof {
            WeightError::Changed {
                path: path.to_path_buf(),
                what: format!(
                    "bytes {offset}..{} of the {size} it had when opened are gone",
                    offset.saturating_add(buf.len() as u64),
                ),
            }
        } else {
            TpcError::Read {
                path: path.to_path_buf(),
                io,
            }
            .into()
        }
    })
}

/// The header's length and the metadata it holds, checked as safetensors' `read_metadata`
/// checks a whole file in memory; errors in tpc's words.
fn read_header(path: &Path, file: &std::fs::File, size: u64) -> Result<(u64, Metadata)> {
    let read = |offset: u64, buf: &mut [u8]| read_exact_at(path, file, size, offset, buf);
    let mut declared = None;
    let checked = (|| {
        if size < 8 {
            return Err(SafeTensorError::HeaderTooSmall.into());
        }
        let mut len = [0u8; 8];
        read(0, &mut len).map_err(Fault::Read)?;
        let n = u64::from_le_bytes(len);
        declared = Some(n);
        if n > MAX_HEADER {
            return Err(SafeTensorError::HeaderTooLarge.into());
        }
        if n.saturating_add(8) > size {
            return Err(SafeTensorError::InvalidHeaderLength.into());
        }
        let mut json = vec![0u8; n as usize];
        read(8, &mut json).map_err(Fault::Read)?;
        let text = std::str::from_utf8(&json).map_err(|_| SafeTensorError::InvalidHeader)?;
        let meta: Metadata = serde_json::from_str(text)
            .map_err(|_| SafeTensorError::InvalidHeaderDeserialization)?;
        let data_end = tiled_end(&meta)?;
        if data_end.checked_add(8 + n) != Some(size) {
            return Err(SafeTensorError::MetadataIncompleteBuffer.into());
        }
        Ok((n, meta))
    })();
    checked.map_err(|e| match e {
        Fault::Read(e) => e,
        Fault::Header(e) => file_err(path, header_problem(size, declared, &e)),
    })
}

/// Why a header does not read: the file could not be read, or what it says is wrong.
enum Fault {
    Read(WeightError),
    Header(SafeTensorError),
}

impl From<SafeTensorError> for Fault {
    fn from(e: SafeTensorError) -> Fault {
        Fault::Header(e)
    }
}

/// The end of the tensors' data when their offsets tile it from 0 without gap or overlap
/// and each tensor's bytes are its shape times its dtype's size (safetensors' own check).
fn tiled_end(meta: &Metadata) -> std::result::Result<u64, SafeTensorError> {
    let mut tensors: Vec<_> = meta.tensors().into_iter().collect();
    tensors.sort_by_key(|(_, info)| info.data_offsets);
    let mut at = 0usize;
    for (name, info) in tensors {
        let (start, end) = info.data_offsets;
        if start != at || end < start {
            return Err(SafeTensorError::InvalidOffset(name));
        }
        let bytes = info
            .shape
            .iter()
            .try_fold(info.dtype.size(), |n, &d| n.checked_mul(d))
            .ok_or(SafeTensorError::ValidationOverflow)?;
        if end - start != bytes {
            return Err(SafeTensorError::TensorInvalidInfo);
        }
        at = end;
    }
    Ok(at as u64)
}

/// tpc's own words for why a safetensors header does not read, for a file of `size` bytes
/// whose first 8 bytes declare a header of `declared` bytes (when it has 8).
fn header_problem(size: u64, declared: Option<u64>, e: &SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    let why = match (e, declared) {
        (E::HeaderTooSmall, _) => {
            format!("the file has {size} bytes, fewer than the 8-byte header length; it is truncated")
        }
        (E::MetadataIncompleteBuffer | E::InvalidHeaderLength, Some(n)) if n.saturating_add(8) > size => {
            format!("its header length says {n} bytes follow, the file has {size} in all; it is truncated")
        }
        (E::MetadataIncompleteBuffer, _) => format!(
            "the tensors' data does not fill the file exactly ({size} bytes); it is truncated or has bytes appended"
        ),
        (E::HeaderTooLarge | E::InvalidHeaderLength, _) => {
            "the header length is impossible; the file is corrupt or not safetensors".into()
        }
        (E::InvalidHeader | E::InvalidHeaderStart | E::InvalidHeaderDeserialization | E::JsonError(_), _) => {
            "the header is not the JSON safetensors expects; the file is corrupt or not safetensors".into()
        }
        (E::TensorInvalidInfo | E::InvalidOffset(_) | E::ValidationOverflow, _) => {
            "a tensor's shape, type and byte offsets disagree; the file is corrupt".into()
        }
        (other, _) => format!("its header does not read ({other:?})"),
    };
    format!("not a valid safetensors file: {why}; re-download or re-save it")
}
