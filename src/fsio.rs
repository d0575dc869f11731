//! Reading and writing whole files with errors that name the path. Writes are atomic: the
//! bytes go to a temporary file beside the target, are synced, and replace the target by a
//! rename, so a full disk or a killed process never leaves a half-written or emptied file.

use crate::error::{Result, TpcError};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The whole of a regular file as text (a FIFO or device is refused, never waited on).
pub fn read_text(path: &Path) -> Result<String> {
    crate::fsio_check::read_regular_text(path).map_err(|io| TpcError::Read {
        path: path.to_path_buf(),
        io,
    })
}

pub fn write_text(path: &Path, text: &str) -> Result<()> {
    write_bytes(path, text.as_bytes())
}

/// Replaces `path` with `bytes` atomically (temporary file, fsync, rename).
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    let err = |io| TpcError::Write {
        path: path.to_path_buf(),
        io,
    };
    let tmp = temporary_beside(path).map_err(err)?;
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(io) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(io));
    }
    // Make the rename itself durable; a folder that cannot be synced is not an error.
    if let Some(dir) = parent_dir(path) {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// The folder `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> Option<&Path> {
    match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Some(Path::new(".")),
        other => other,
    }
}

/// `.NAME.tpc-PID-N.tmp` in the target's folder, so the rename never crosses file systems.
fn temporary_beside(path: &Path) -> std::io::Result<PathBuf> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the path has no file name",
        )
    })?;
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp_name = format!(
        ".{}.tpc-{}-{n}.tmp",
        name.to_string_lossy(),
        std::process::id()
    );
    Ok(match parent_dir(path) {
        Some(dir) => dir.join(tmp_name),
        None => PathBuf::from(tmp_name),
    })
}

/// Checks, before any long work, that `output` can be written and replaces none of the
/// command's `inputs`: its folder exists, it is not a folder, it is not an input file (also
/// through links), and it is not one of the files a model folder among the inputs is read
/// from (config, weights, index, tokenizer).
pub fn check_output(what: &str, output: &Path, inputs: &[&Path]) -> Result<()> {
    let refuse = |reason: String| TpcError::Output {
        what: what.to_string(),
        path: output.to_path_buf(),
        reason,
    };
    let dir = parent_dir(output).ok_or_else(|| refuse("it names no file".into()))?;
    if !dir.is_dir() {
        return Err(refuse(format!(
            "the folder `{}` does not exist; create it first",
            dir.display()
        )));
    }
    if output.file_name().is_none() || output.is_dir() {
        return Err(refuse("it is a folder; give a file name".into()));
    }
    let Ok(out_meta) = std::fs::metadata(output) else {
        return Ok(()); // a new file replaces nothing
    };
    for input in inputs {
        let Ok(meta) = std::fs::metadata(input) else {
            continue;
        };
        if meta.is_dir() {
            if is_model_file(output) && same_folder(output, input) {
                return Err(refuse(format!(
                    "it is one of the files of the model folder `{}` that tpc reads; write elsewhere",
                    input.display()
                )));
            }
        } else if same_file(&out_meta, &meta) {
            return Err(refuse(format!(
                "it is the input `{}` itself; write elsewhere",
                input.display()
            )));
        }
    }
    Ok(())
}

/// Checks that two outputs of one command are not the same file.
pub fn check_distinct_outputs(a: (&str, &Path), b: (&str, &Path)) -> Result<()> {
    let same = a.1 == b.1
        || matches!(
            (std::fs::metadata(a.1), std::fs::metadata(b.1)),
            (Ok(x), Ok(y)) if same_file(&x, &y)
        );
    if same {
        return Err(TpcError::Output {
            what: b.0.to_string(),
            path: b.1.to_path_buf(),
            reason: format!("{} writes the same file; give two names", a.0),
        });
    }
    Ok(())
}

/// Files a Hugging Face model folder is read from (tpc reads config, weights, index and
/// tokenizer; the others belong to the model too).
fn is_model_file(path: &Path) -> bool {
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    name.ends_with(".safetensors")
        || name.ends_with(".safetensors.index.json")
        || [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "tokenizer.model",
        ]
        .contains(&name.as_str())
}

fn same_folder(file: &Path, dir: &Path) -> bool {
    match (
        file.canonicalize()
            .ok()
            .and_then(|f| f.parent().map(Path::to_path_buf)),
        dir.canonicalize(),
    ) {
        (Some(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-fsio-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary() {
        let dir = scratch("atomic");
        let file = dir.join("plan.ron");
        write_text(&file, "old").unwrap();
        write_text(&file, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // A write that fails (the target is a folder) keeps nothing half-done.
        let sub = dir.join("sub");
        std::fs::create_dir(&sub).unwrap();
        assert!(write_text(&sub, "x").is_err());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn outputs_over_inputs_are_refused() {
        let dir = scratch("over");
        let model = dir.join("m.ron");
        std::fs::write(&model, "x").unwrap();
        let err = check_output("-o", &model, &[&model])
            .unwrap_err()
            .to_string();
        assert!(err.contains("input"), "{err}");
        // Through a hard link too.
        let link = dir.join("link.ron");
        std::fs::hard_link(&model, &link).unwrap();
        assert!(check_output("-o", &link, &[&model]).is_err());
        // The model folder's own files.
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("model.safetensors"), "x").unwrap();
        for name in ["config.json", "model.safetensors"] {
            let err = check_output("-o", &dir.join(name), &[&dir])
                .unwrap_err()
                .to_string();
            assert!(err.contains("model folder"), "{err}");
        }
        // A new file in the model folder, or an earlier output there, is fine.
        check_output("-o", &dir.join("plan.ron"), &[&dir]).unwrap();
        std::fs::write(dir.join("plan.json"), "x").unwrap();
        check_output("-o", &dir.join("plan.json"), &[&dir]).unwrap();
        std::fs::write(dir.join("notes.txt"), "x").unwrap();
        check_output("-o", &dir.join("notes.txt"), &[&dir]).unwrap();
        // A missing folder and a folder as output are refused up front.
        let err = check_output("-o", &dir.join("missing/plan.ron"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
        assert!(check_output("-o", &dir, &[]).is_err());
        assert!(check_distinct_outputs(("-o", &model), ("--dot", &model)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
