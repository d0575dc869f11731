//! Opening an input so that it can be read to its end: only regular files. A FIFO would
//! block the open (and then every read) until some writer comes, a character device such as
//! `/dev/zero` never ends, a folder reads as an error only later; each is refused when it is
//! opened, with what it is.

use std::fs::File;
use std::io;
use std::path::Path;

/// Opens `path` for reading if it is a regular file (after following links); anything else
/// is an `InvalidInput` error saying what it is. The open itself never blocks: it is made
/// non-blocking (a FIFO with no writer opens at once), the type is taken from the open file
/// (so nothing can be swapped in between a check and the open), and only then is blocking
/// mode restored for the reads.
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "it is {}, not a regular file; tpc reads its inputs only from regular files",
                describe(&kind)
            ),
        ));
    }
    clear_nonblocking(&file)?;
    Ok(file)
}

/// Refuses `path` unless it is a regular file (following links), as [`open_regular`] does;
/// for readers that open the file themselves (a library taking a path).
pub fn check_regular_file(path: &Path) -> io::Result<()> {
    open_regular(path).map(drop)
}

/// Reads the whole of a regular file as UTF-8 text.
pub fn read_regular_text(path: &Path) -> io::Result<String> {
    use std::io::Read;
    let mut file = open_regular(path)?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(text)
}

/// What a file that is not a regular file is, in words.
fn describe(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a folder"
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

fn clear_nonblocking(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns; F_GETFL/F_SETFL read and
    // set only its status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tpc-fsio-check-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mkfifo(path: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    #[test]
    fn only_regular_files_open_and_nothing_blocks() {
        let dir = scratch("kinds");
        let file = dir.join("a.json");
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(read_regular_text(&file).unwrap(), "{}");
        // Through a link to a regular file too.
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_regular_text(&link).unwrap(), "{}");
        // A FIFO with no writer: without the non-blocking open this test would hang.
        let fifo = dir.join("fifo.json");
        mkfifo(&fifo);
        let e = read_regular_text(&fifo).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("a FIFO (named pipe)"), "{e}");
        for (path, what) in [
            (Path::new("/dev/zero"), "a character device"),
            (dir.as_path(), "a folder"),
        ] {
            let e = check_regular_file(path).unwrap_err().to_string();
            assert!(e.contains(what), "{}: {e}", path.display());
        }
        let zero = dir.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(check_regular_file(&zero).is_err());
        assert_eq!(
            check_regular_file(&dir.join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
