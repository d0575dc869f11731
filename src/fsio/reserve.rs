//! An output made ready before the work that produces it: its place is resolved and, for a
//! file, the temporary already exists in the target's folder (room too, where the size is
//! known), so a folder that cannot be written is refused before a long run instead of after
//! it. Committing writes the bytes and puts them in place; dropping leaves nothing.

use super::target::{keep_mode_and_owner, Target};
use super::temporary::Temporary;
use crate::error::{Result, TpcError};
use std::io::Write;
use std::path::{Path, PathBuf};

pub struct Reserved {
    what: String,
    /// The path as given, for messages.
    path: PathBuf,
    how: How,
}

enum How {
    Replace {
        target: PathBuf,
        temp: Temporary,
        preallocated: bool,
    },
    InPlace {
        path: PathBuf,
        append: bool,
    },
}

impl Reserved {
    /// The reservation for `target`; the error is the one of creating the temporary.
    pub(super) fn new(what: &str, path: &Path, target: Target) -> std::io::Result<Reserved> {
        let how = match target {
            Target::Replace { path: target } => {
                let dir = super::parent_dir(&target).unwrap_or(Path::new("/"));
                let name = target.file_name().ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name")
                })?;
                How::Replace {
                    temp: Temporary::create(dir, name)?,
                    target,
                    preallocated: false,
                }
            }
            Target::InPlace { path, append } => How::InPlace { path, append },
        };
        Ok(Reserved {
            what: what.to_string(),
            path: path.to_path_buf(),
            how,
        })
    }

    /// Takes the room for `len` bytes now, so a full disk is refused before the work (a
    /// device or pipe needs none).
    pub fn preallocate(&mut self, len: u64) -> Result<()> {
        if let How::Replace {
            temp, preallocated, ..
        } = &mut self.how
        {
            temp.preallocate(len).map_err(|io| TpcError::Output {
                what: self.what.clone(),
                path: self.path.clone(),
                reason: format!(
                    "there is no room for its {len} bytes ({io}); free space or write elsewhere"
                ),
            })?;
            *preallocated = true;
        }
        Ok(())
    }

    /// Writes `bytes` and puts them in place: a file whole, by a rename, with the mode and
    /// owner of the file it replaces; a device or pipe in place.
    pub fn commit(self, bytes: &[u8]) -> Result<()> {
        let err = |io| TpcError::Write {
            path: self.path.clone(),
            io,
        };
        match self.how {
            How::Replace {
                target,
                temp,
                preallocated,
            } => {
                let written = (|| {
                    let mut file = temp.file();
                    file.write_all(bytes)?;
                    if preallocated {
                        // The room taken may exceed what was written.
                        file.set_len(bytes.len() as u64)?;
                    }
                    // What the target is at the end of the work, not when it began.
                    if let Ok(old) = std::fs::symlink_metadata(&target) {
                        if old.is_file() {
                            keep_mode_and_owner(file, &old)?;
                        }
                    }
                    file.sync_all()
                })();
                // Dropping the temporary on an error removes it.
                written.and_then(|()| temp.replace(&target)).map_err(err)?;
                // Make the rename itself durable; a folder that cannot be synced is not an error.
                if let Some(dir) = super::parent_dir(&target) {
                    let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
                }
                Ok(())
            }
            How::InPlace { path, append } => {
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .append(append)
                    .open(&path)
                    .map_err(err)?;
                file.write_all(bytes).map_err(err)?;
                // Devices and pipes cannot be synced; a regular file behind `/proc` can.
                if append {
                    file.sync_all().map_err(err)?;
                }
                Ok(())
            }
        }
    }
}
