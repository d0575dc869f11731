//! Reading and writing whole files with errors that name the path, and the checks an output
//! passes before any long work. A write never leaves a half-written file, a replaced device
//! or a broken link: a regular file is replaced whole by a complete temporary renamed over
//! it (`temporary`: one a killed process leaves no trace of), at the file its links lead
//! to and with its mode and owner, while devices and pipes are written in place (`target`).

mod reserve;
mod target;
mod temporary;

use crate::error::{Result, TpcError};
use std::path::Path;
use target::{Refusal, Target};

pub use reserve::Reserved;

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

/// Replaces `path` with `bytes` atomically (temporary file, fsync, rename), or writes a
/// device or pipe in place.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    let err = |io| TpcError::Write {
        path: path.to_path_buf(),
        io,
    };
    let target = target::resolve(path).map_err(|r| match r {
        Refusal::Io(io) => err(io),
        Refusal::Reason(reason) => TpcError::Output {
            what: "the output".into(),
            path: path.to_path_buf(),
            reason,
        },
    })?;
    Reserved::new("the output", path, target)
        .map_err(err)?
        .commit(bytes)
}

/// The folder `path` is in (`.` for a bare file name).
fn parent_dir(path: &Path) -> Option<&Path> {
    match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Some(Path::new(".")),
        other => other,
    }
}

/// Checks, before any long work, that `output` can be written and replaces none of the
/// command's `inputs`: see [`reserve`].
pub fn check_output(what: &str, output: &Path, inputs: &[&Path]) -> Result<()> {
    reserve(what, output, inputs).map(drop)
}

/// Makes `output` ready to be written after the work (the `what` option's file): its folder
/// exists and takes a new file now, it is not a folder, a disk or a socket, it is not an
/// input (also through links), and it is not one of the files a model folder among the
/// inputs is read from (config, weights, index, tokenizer).
pub fn reserve(what: &str, output: &Path, inputs: &[&Path]) -> Result<Reserved> {
    let refuse = |reason: String| TpcError::Output {
        what: what.to_string(),
        path: output.to_path_buf(),
        reason,
    };
    if output.file_name().is_none() {
        return Err(refuse("it names no file".into()));
    }
    let target = target::resolve(output).map_err(|r| refuse(r.to_string()))?;
    // The file that is written: the end of the links.
    let written = match &target {
        Target::Replace { path, .. } => {
            let dir = parent_dir(path).ok_or_else(|| refuse("it names no file".into()))?;
            if !dir.is_dir() {
                return Err(refuse(if dir.exists() {
                    format!("`{}` is not a folder", dir.display())
                } else {
                    format!(
                        "the folder `{}` does not exist; create it first",
                        dir.display()
                    )
                }));
            }
            path.clone()
        }
        Target::InPlace { path, .. } => {
            check_writable(path)
                .map_err(|io| refuse(format!("it cannot be opened for writing ({io})")))?;
            path.clone()
        }
    };
    if let Ok(out_meta) = std::fs::metadata(output) {
        check_not_an_input(&written, &out_meta, inputs).map_err(refuse)?;
    }
    let folder = parent_dir(&written).unwrap_or(Path::new("/")).to_path_buf();
    Reserved::new(what, output, target).map_err(|io| {
        refuse(format!(
            "a file cannot be created in its folder `{}` ({io}); choose a writable folder",
            folder.display()
        ))
    })
}

/// The reason `output` (the file `written`) may not be written over one of `inputs`.
fn check_not_an_input(
    written: &Path,
    out_meta: &std::fs::Metadata,
    inputs: &[&Path],
) -> std::result::Result<(), String> {
    for input in inputs {
        let Ok(meta) = std::fs::metadata(input) else {
            continue;
        };
        if meta.is_dir() {
            if is_model_file(written) && same_folder(written, input) {
                return Err(format!(
                    "it is one of the files of the model folder `{}` that tpc reads; write elsewhere",
                    input.display()
                ));
            }
        } else if same_file(out_meta, &meta) {
            return Err(format!(
                "it is the input `{}` itself; write elsewhere",
                input.display()
            ));
        }
    }
    Ok(())
}

/// Whether this process may open the device or pipe `path` for writing (without opening
/// it: opening a pipe would wait for a reader, and closing it would end the reader's input).
fn check_writable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Checks that two outputs of one command are not the same file (a character device such
/// as /dev/null may take both).
pub fn check_distinct_outputs(a: (&str, &Path), b: (&str, &Path)) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    if std::fs::metadata(a.1).is_ok_and(|m| m.file_type().is_char_device()) {
        return Ok(());
    }
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

fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    use std::path::PathBuf;

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
        let err = check_output("-o", &model.join("plan.ron"), &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not a folder"), "{err}");
        assert!(check_output("-o", &dir, &[]).is_err());
        assert!(check_distinct_outputs(("-o", &model), ("--dot", &model)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_link_is_written_through_and_stays_a_link() {
        let dir = scratch("link");
        std::fs::create_dir(dir.join("real")).unwrap();
        std::fs::write(dir.join("real/plan.ron"), "old").unwrap();
        let link = dir.join("plan.ron");
        std::os::unix::fs::symlink("real/plan.ron", &link).unwrap();
        write_text(&link, "new").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(dir.join("real/plan.ron")).unwrap(),
            "new"
        );
        // A dangling link: the file it names is created.
        std::os::unix::fs::symlink("real/later.ron", dir.join("later.ron")).unwrap();
        write_text(&dir.join("later.ron"), "made").unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("real/later.ron")).unwrap(),
            "made"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replaced_file_keeps_its_mode_and_owner() {
        let dir = scratch("mode");
        let file = dir.join("secret.safetensors");
        std::fs::write(&file, "old").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        // Another owner, where this process may give files away (root).
        let other = (4321, 4322);
        let chowned = std::os::unix::fs::chown(&file, Some(other.0), Some(other.1)).is_ok();
        write_bytes(&file, b"new").unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o600);
        if chowned {
            assert_eq!((meta.uid(), meta.gid()), other);
        } else {
            println!("NOT RUN: the owner part (this process cannot give files away)");
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        // A new file gets the usual mode (umask applied), not the last one's.
        let fresh = dir.join("fresh.bin");
        write_bytes(&fresh, b"x").unwrap();
        assert_ne!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The character device `major:minor` made in `dir` where this process may (root), so
    /// that a regression would replace that copy and never the system's; else the system's
    /// own `system` (which only root could replace).
    fn device(dir: &Path, system: &str, major: u32, minor: u32) -> PathBuf {
        let path = dir.join(Path::new(system).file_name().unwrap());
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        let made = unsafe {
            libc::mknod(
                c.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            )
        };
        if made == 0 {
            path
        } else {
            PathBuf::from(system)
        }
    }

    #[test]
    fn devices_are_written_in_place_and_stay_devices() {
        let dir = scratch("devices");
        let null = device(&dir, "/dev/null", 1, 3);
        if !null.exists() {
            println!("NOT RUN: no /dev/null");
            return;
        }
        write_text(&null, "discarded").unwrap();
        assert!(std::fs::metadata(&null)
            .unwrap()
            .file_type()
            .is_char_device());
        check_output("-o", &null, &[]).unwrap();
        check_distinct_outputs(("-o", &null), ("--dot", &null)).unwrap();
        let full = device(&dir, "/dev/full", 1, 7);
        if full.exists() {
            let e = write_text(&full, "x").unwrap_err().to_string();
            assert!(e.contains("No space left"), "{e}");
            assert!(std::fs::metadata(&full)
                .unwrap()
                .file_type()
                .is_char_device());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_behind_a_descriptor_link_is_appended_to_not_replaced() {
        use std::os::fd::AsRawFd;
        let dir = scratch("fdlink");
        let log = dir.join("log.txt");
        std::fs::write(&log, "kept\n").unwrap();
        // What `>> log.txt` hands a command as its stdout.
        let fd = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        let link = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        if !link.exists() {
            println!("NOT RUN: no /proc");
            return;
        }
        write_text(&link, "added\n").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "kept\nadded\n");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_name_at_the_file_system_limit_can_be_written() {
        let dir = scratch("long");
        let file = dir.join("n".repeat(250) + ".bin");
        check_output("-o", &file, &[]).unwrap();
        write_bytes(&file, b"x").unwrap();
        write_bytes(&file, b"y").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"y");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_folder_that_takes_no_file_is_refused_before_the_work() {
        // Not even root may create files in sysfs.
        let out = Path::new("/sys/tpc-logits.safetensors");
        if !Path::new("/sys/kernel").is_dir() {
            println!("NOT RUN: no sysfs at /sys");
            return;
        }
        let e = reserve("--dump-logits", out, &[])
            .err()
            .expect("refused")
            .to_string();
        assert!(
            e.contains("--dump-logits") && e.contains("cannot be created in its folder `/sys`"),
            "{e}"
        );
    }

    #[test]
    fn a_reservation_leaves_nothing_until_committed() {
        let dir = scratch("reserve");
        let file = dir.join("logits.safetensors");
        let mut r = reserve("--dump-logits", &file, &[]).unwrap();
        r.preallocate(1 << 20).unwrap();
        let visible: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        // The unnamed kind shows nothing; the named one a single short temporary.
        assert!(visible.len() <= 1, "{visible:?}");
        r.commit(b"abc").unwrap();
        // The room taken beyond the bytes is given back.
        assert_eq!(std::fs::read(&file).unwrap(), b"abc");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // Dropped without a commit: nothing is left and the old file is untouched.
        drop(reserve("--dump-logits", &file, &[]).unwrap());
        assert_eq!(std::fs::read(&file).unwrap(), b"abc");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
