//! The temporary file an output is written to before it replaces the target, made so that a
//! killed process leaves nothing behind: on Linux an unnamed file (`O_TMPFILE`), given a name
//! only once it is complete, just before the rename; on file systems without unnamed files a
//! short named one, `.tpc-HASH-PID-N.tmp`. Its name never grows with the target's (a name of
//! 255 bytes, the usual limit, must still work), and the next write of the same target
//! removes the named temporaries whose process is gone.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub(super) struct Temporary {
    file: File,
    dir: PathBuf,
    /// The hash of the target's file name that the temporary's name carries.
    tag: u64,
    /// The temporary's name while it has one: the named kind throughout, the unnamed kind
    /// between its link and the rename. Removed on drop.
    visible: Option<PathBuf>,
}

impl Temporary {
    /// A new empty temporary in `dir` for the target named `target_name`, after removing
    /// that target's temporaries left by processes that died while writing.
    pub(super) fn create(dir: &Path, target_name: &OsStr) -> io::Result<Temporary> {
        Temporary::create_as(dir, target_name, true)
    }

    /// [`Temporary::create`], the unnamed kind only where `unnamed` allows (tests use both).
    fn create_as(dir: &Path, target_name: &OsStr, unnamed: bool) -> io::Result<Temporary> {
        let tag = name_hash(target_name);
        remove_stale(dir, tag, target_name);
        let (file, visible) = match unnamed.then(|| unnamed_in(dir)).flatten() {
            Some(file) => (file, None),
            None => {
                let (file, path) = named_in(dir, tag)?;
                (file, Some(path))
            }
        };
        // Held until the process ends: another writer's cleanup sees the temporary is in use
        // even where it cannot see this process (another PID namespace).
        file.lock()?;
        Ok(Temporary {
            file,
            dir: dir.to_path_buf(),
            tag,
            visible,
        })
    }

    pub(super) fn file(&self) -> &File {
        &self.file
    }

    /// Allocates `len` bytes now, so that a disk without room for the output says so before
    /// the work that produces it. A file system that cannot preallocate is not an error.
    pub(super) fn preallocate(&self, len: u64) -> io::Result<()> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let Ok(len) = libc::off_t::try_from(len) else {
                return Err(io::Error::from_raw_os_error(libc::EFBIG));
            };
            if len == 0 {
                return Ok(());
            }
            // SAFETY: a valid open descriptor; fallocate reads no memory of ours.
            if unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len) } != 0 {
                let e = io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EOPNOTSUPP | libc::ENOSYS) => Ok(()),
                    _ => Err(e),
                };
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = len;
        Ok(())
    }

    /// Puts the complete temporary in the place of `target` (a path in the same folder) by
    /// a rename: readers see the old file or the new one, never a part.
    pub(super) fn replace(mut self, target: &Path) -> io::Result<()> {
        if self.visible.is_none() {
            self.visible = Some(self.link_unnamed()?);
        }
        if let Some(from) = &self.visible {
            std::fs::rename(from, target)?;
        }
        // The name is the target's now.
        self.visible = None;
        Ok(())
    }

    /// Gives the unnamed file a short temporary name (the target itself cannot be linked
    /// over; the rename replaces it).
    fn link_unnamed(&self) -> io::Result<PathBuf> {
        loop {
            let path = self.dir.join(fresh_name(self.tag));
            match link_unnamed_at(&self.file, &path) {
                // A leftover of a dead process with our number: take the next name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
                Ok(()) => return Ok(path),
            }
        }
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if let Some(path) = &self.visible {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// FNV-1a: a short, stable stand-in for the target's name in the temporary's name.
fn name_hash(name: &OsStr) -> u64 {
    name.as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h: u64, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// `.tpc-HASH-PID-N.tmp`: at most 57 bytes, whatever the target's name.
fn fresh_name(tag: u64) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(".tpc-{tag:016x}-{}-{n}.tmp", std::process::id())
}

/// An unnamed file in `dir`, or `None` where the file system (or the kernel) has none or
/// it could not be named later (no `/proc`); then a named temporary is used.
#[cfg(target_os = "linux")]
fn unnamed_in(dir: &Path) -> Option<File> {
    if !Path::new("/proc/self/fd").is_dir() {
        return None;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .mode(0o666)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)
        .ok()
}

#[cfg(not(target_os = "linux"))]
fn unnamed_in(_: &Path) -> Option<File> {
    None
}

/// Links the unnamed `file` at `path` (its descriptor's `/proc` entry, which unprivileged
/// processes may link; `AT_EMPTY_PATH` where that fails and privilege allows).
#[cfg(target_os = "linux")]
fn link_unnamed_at(file: &File, path: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let to = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let proc_path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a number");
    // SAFETY: both paths are NUL-terminated strings that outlive the calls.
    let linked = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_path.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if linked == 0 {
        return Ok(());
    }
    let first = io::Error::last_os_error();
    if first.kind() == io::ErrorKind::AlreadyExists {
        return Err(first);
    }
    // SAFETY: as above; the empty path names the descriptor itself.
    let linked = unsafe {
        libc::linkat(
            fd,
            c"".as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    if linked == 0 {
        Ok(())
    } else {
        Err(first)
    }
}

#[cfg(not(target_os = "linux"))]
fn link_unnamed_at(_: &File, _: &Path) -> io::Result<()> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

/// A new named temporary in `dir`.
fn named_in(dir: &Path, tag: u64) -> io::Result<(File, PathBuf)> {
    loop {
        let path = dir.join(fresh_name(tag));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o666)
            .open(&path)
        {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
            Ok(file) => return Ok((file, path)),
        }
    }
}

/// Removes the temporaries of the target named `target_name` in `dir` whose writer died:
/// its process is gone and nobody holds the file's lock. Also those of tpc versions that
/// named them `.NAME.tpc-PID-N.tmp`. Best effort: a folder that cannot be listed is skipped.
fn remove_stale(dir: &Path, tag: u64, target_name: &OsStr) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = stale_owner(&entry.file_name(), tag, target_name) else {
            continue;
        };
        if pid == std::process::id() || !process_gone(pid) {
            continue;
        }
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let path = entry.path();
        if let Ok(file) = File::open(&path) {
            if file.try_lock().is_ok() {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// The process id in a temporary's name when `name` is one of `target_name`'s.
fn stale_owner(name: &OsStr, tag: u64, target_name: &OsStr) -> Option<u32> {
    let bytes = name.as_bytes();
    if let Some(rest) = bytes.strip_prefix(format!(".tpc-{tag:016x}-").as_bytes()) {
        return pid_of(rest);
    }
    let legacy = [b".", target_name.as_bytes(), b".tpc-"].concat();
    pid_of(bytes.strip_prefix(legacy.as_slice())?)
}

/// `PID` of `PID-N.tmp`.
fn pid_of(rest: &[u8]) -> Option<u32> {
    let rest = std::str::from_utf8(rest).ok()?.strip_suffix(".tmp")?;
    let (pid, n) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(n) {
        return None;
    }
    pid.parse().ok()
}

/// Whether no process `pid` exists (as far as this process can see).
fn process_gone(pid: u32) -> bool {
    // 0 and negative ids would address process groups.
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    !alive && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpc-temporary-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// A process id that is not running: a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(process_gone(pid));
        pid
    }

    #[test]
    fn a_temporary_is_invisible_while_written_where_the_file_system_allows() {
        let dir = scratch("unnamed");
        let t = Temporary::create(&dir, OsStr::new("out.bin")).unwrap();
        if unnamed_in(&dir).is_none() {
            println!("NOT RUN: this file system has no unnamed temporary files");
            return;
        }
        t.file().write_all(b"bytes").unwrap();
        // A process killed now leaves nothing: the file has no name yet.
        assert!(names(&dir).is_empty(), "{:?}", names(&dir));
        t.replace(&dir.join("out.bin")).unwrap();
        assert_eq!(names(&dir), ["out.bin"]);
        assert_eq!(std::fs::read(dir.join("out.bin")).unwrap(), b"bytes");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporaries_of_dead_writers_are_removed_and_live_ones_kept() {
        let dir = scratch("stale");
        let target = OsStr::new("logits.safetensors");
        let tag = name_hash(target);
        let dead = dead_pid();
        let alive = std::process::id();
        let stale = format!(".tpc-{tag:016x}-{dead}-0.tmp");
        let legacy = format!(".logits.safetensors.tpc-{dead}-3.tmp");
        let live = format!(".tpc-{tag:016x}-1-0.tmp"); // pid 1 is always running
        let mine = format!(".tpc-{tag:016x}-{alive}-999.tmp");
        let other_target = format!(".tpc-{:016x}-{dead}-0.tmp", name_hash(OsStr::new("x")));
        let unrelated = format!(".tpc-{tag:016x}-{dead}-0.tmp.keep");
        for n in [&stale, &legacy, &live, &mine, &other_target, &unrelated] {
            std::fs::write(dir.join(n), "x").unwrap();
        }
        let t = Temporary::create(&dir, target).unwrap();
        drop(t);
        let left = names(&dir);
        assert!(!left.contains(&stale), "{left:?}");
        assert!(!left.contains(&legacy), "{left:?}");
        for kept in [&live, &mine, &other_target, &unrelated] {
            assert!(left.contains(kept), "{kept} was removed: {left:?}");
        }
        // A dead pid whose file is still locked (a writer in another PID namespace) stays.
        let locked = dir.join(format!(".tpc-{tag:016x}-{dead}-1.tmp"));
        std::fs::write(&locked, "x").unwrap();
        let holder = File::open(&locked).unwrap();
        holder.lock().unwrap();
        // Another open file description of this process contends for the lock as another
        // process would.
        drop(Temporary::create(&dir, target).unwrap());
        assert!(locked.exists());
        drop(holder);
        drop(Temporary::create(&dir, target).unwrap());
        assert!(!locked.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporary_names_stay_short_and_are_recognised() {
        let long = "n".repeat(255);
        let tag = name_hash(OsStr::new(&long));
        let name = fresh_name(tag);
        assert!(name.len() <= 57, "{name}");
        let parsed = stale_owner(OsStr::new(&name), tag, OsStr::new(&long));
        assert_eq!(parsed, Some(std::process::id()));
        for not_ours in [
            ".tpc-zz-1-0.tmp",
            ".tpc-1-0.tmp",
            "x.tmp",
            ".tpc-0000000000000000-+1-0.tmp",
        ] {
            assert_eq!(
                stale_owner(OsStr::new(not_ours), 0, OsStr::new("x")),
                None,
                "{not_ours}"
            );
        }
        assert!(!process_gone(0) && !process_gone(u32::MAX));
    }

    #[test]
    fn both_kinds_replace_the_target_or_leave_nothing() {
        let dir = scratch("kinds");
        for unnamed in [false, true] {
            let t = Temporary::create_as(&dir, OsStr::new("a"), unnamed).unwrap();
            t.file().write_all(b"half").unwrap();
            drop(t);
            assert!(names(&dir).is_empty(), "{:?}", names(&dir));
            let t = Temporary::create_as(&dir, OsStr::new("a"), unnamed).unwrap();
            t.file().write_all(b"whole").unwrap();
            t.replace(&dir.join("a")).unwrap();
            assert_eq!(names(&dir), ["a"]);
            assert_eq!(std::fs::read(dir.join("a")).unwrap(), b"whole");
            std::fs::remove_file(dir.join("a")).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_named_temporary_is_short_and_locked_while_written() {
        let dir = scratch("named");
        let long = "n".repeat(250);
        let t = Temporary::create_as(&dir, OsStr::new(&long), false).unwrap();
        let seen = names(&dir);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert!(seen[0].len() <= 57 && seen[0].ends_with(".tmp"), "{seen:?}");
        // Its writer holds the lock: a cleanup in another process would leave it.
        let other = File::open(dir.join(&seen[0])).unwrap();
        assert!(other.try_lock().is_err());
        t.replace(&dir.join(&long)).unwrap();
        assert_eq!(names(&dir), [long]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
