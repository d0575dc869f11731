//! Where an output's bytes go. A regular file, or a new one, is replaced whole by a rename;
//! through symbolic links that is the file they lead to, so the links stay links. Character
//! devices (`/dev/null`) and pipes are written in place, as are the files behind `/proc`'s
//! descriptor links (`/dev/stdout`): a rename would put a regular file where the device or
//! the link was. Block devices (disks) and sockets are refused.

use std::fs::Metadata;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// Links followed before giving up, as the kernel does (`ELOOP` after 40).
const MAX_LINKS: usize = 40;

#[derive(Debug)]
pub(super) enum Target {
    /// Replace the regular file at `path` (no link), or create it.
    Replace { path: PathBuf },
    /// Open `path` and write into it; `append` for a regular file behind a `/proc` link
    /// (`>> log` must keep the log; after `> file` the file is empty anyway).
    InPlace { path: PathBuf, append: bool },
}

/// Why an output cannot be written where it points.
#[derive(Debug)]
pub(super) enum Refusal {
    Reason(String),
    Io(io::Error),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Reason(r) => f.write_str(r),
            Refusal::Io(e) => write!(f, "it cannot be looked up ({e})"),
        }
    }
}

/// Where the bytes for `path` go: its links followed one by one (relative ones from the
/// link's folder) to a file, a device or nothing yet.
pub(super) fn resolve(path: &Path) -> Result<Target, Refusal> {
    let mut at = path.to_path_buf();
    for _ in 0..=MAX_LINKS {
        let meta = match std::fs::symlink_metadata(&at) {
            // A missing folder on the way is the caller's to name.
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENOTDIR) =>
            {
                return Ok(Target::Replace { path: at })
            }
            Err(e) => return Err(Refusal::Io(e)),
            Ok(meta) => meta,
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let dir = super::parent_dir(&at)
                .unwrap_or(Path::new("/"))
                .to_path_buf();
            if is_procfs(&dir) {
                // `/proc/self/fd/1` names "pipe:[…]" or a deleted file: only opening it
                // reaches what it stands for.
                let append = std::fs::metadata(&at).map_err(Refusal::Io)?.is_file();
                return Ok(Target::InPlace {
                    path: path.to_path_buf(),
                    append,
                });
            }
            let to = std::fs::read_link(&at).map_err(Refusal::Io)?;
            at = dir.join(to);
            continue;
        }
        let reason = |what: &str| {
            Refusal::Reason(format!(
                "it is {what}; tpc writes regular files, character devices such as /dev/null, and pipes"
            ))
        };
        return if kind.is_file() {
            Ok(Target::Replace { path: at })
        } else if kind.is_char_device() || kind.is_fifo() {
            Ok(Target::InPlace {
                path: at,
                append: false,
            })
        } else if kind.is_dir() {
            Err(Refusal::Reason("it is a folder; give a file name".into()))
        } else if kind.is_block_device() {
            Err(reason("a block device (a disk)"))
        } else if kind.is_socket() {
            Err(reason("a socket"))
        } else {
            Err(reason("neither a file nor a device"))
        };
    }
    Err(Refusal::Reason(format!(
        "its symbolic links form a loop or a chain of more than {MAX_LINKS}"
    )))
}

/// Whether `dir` is on a proc file system, whose links are not paths.
#[cfg(target_os = "linux")]
fn is_procfs(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a zeroed statfs is valid to fill; the path is NUL-terminated.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut fs) == 0 && fs.f_type == libc::PROC_SUPER_MAGIC }
}

#[cfg(not(target_os = "linux"))]
fn is_procfs(dir: &Path) -> bool {
    dir.starts_with("/proc") || dir.starts_with("/dev/fd")
}

/// Gives the new file at `file` the permission bits and owner of the file it replaces.
/// The owner only where this process may set it (root, or a group of its own); the
/// set-id bits never, as a write by anyone but root would clear them too.
pub(super) fn keep_mode_and_owner(file: &std::fs::File, old: &Metadata) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mine = file.metadata()?;
    if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
        // Owner first: a change of owner may clear mode bits.
        if std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid())).is_err() {
            let _ = std::os::unix::fs::fchown(file, None, Some(old.gid()));
        }
    }
    file.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o777))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-target-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn replaced(t: Target) -> PathBuf {
        match t {
            Target::Replace { path, .. } => path,
            other => panic!("expected a replace, got {other:?}"),
        }
    }

    #[test]
    fn links_lead_to_the_file_they_name() {
        let dir = scratch("links");
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/real"), "x").unwrap();
        std::os::unix::fs::symlink("sub/real", dir.join("rel")).unwrap();
        std::os::unix::fs::symlink(dir.join("rel"), dir.join("abs")).unwrap();
        for link in ["rel", "abs"] {
            let p = replaced(resolve(&dir.join(link)).unwrap());
            assert_eq!(
                p.canonicalize().unwrap(),
                dir.join("sub/real").canonicalize().unwrap()
            );
        }
        // A dangling link: the file it names is created.
        std::os::unix::fs::symlink("sub/new", dir.join("dangling")).unwrap();
        assert_eq!(
            replaced(resolve(&dir.join("dangling")).unwrap()),
            dir.join("sub/new")
        );
        // A loop is refused, not followed forever.
        std::os::unix::fs::symlink("loop2", dir.join("loop1")).unwrap();
        std::os::unix::fs::symlink("loop1", dir.join("loop2")).unwrap();
        let e = resolve(&dir.join("loop1")).unwrap_err().to_string();
        assert!(e.contains("loop"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_and_pipes_are_written_in_place() {
        for dev in ["/dev/null", "/dev/full"] {
            if Path::new(dev).exists() {
                assert!(matches!(
                    resolve(Path::new(dev)),
                    Ok(Target::InPlace { append: false, .. })
                ));
            }
        }
        let dir = scratch("fifo");
        let fifo = dir.join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(resolve(&fifo), Ok(Target::InPlace { .. })));
        // `/dev/stdout` goes through `/proc`: opened, never resolved to "pipe:[…]".
        if Path::new("/proc/self/fd").is_dir() {
            let t = resolve(Path::new("/proc/self/fd/0")).unwrap();
            assert!(
                matches!(t, Target::InPlace { ref path, .. } if path == Path::new("/proc/self/fd/0")),
                "{t:?}"
            );
        }
        assert!(resolve(&dir).unwrap_err().to_string().contains("folder"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn block_devices_are_refused() {
        let Some(disk) = std::fs::read_dir("/dev").ok().and_then(|d| {
            d.flatten()
                .find(|e| e.file_type().is_ok_and(|t| t.is_block_device()))
                .map(|e| e.path())
        }) else {
            println!("NOT RUN: no block device in /dev");
            return;
        };
        let e = resolve(&disk).unwrap_err().to_string();
        assert!(e.contains("block device"), "{e}");
    }
}
