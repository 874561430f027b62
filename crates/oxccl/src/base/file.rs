//! Reading a small file a user names (a tune file, a flight record): opened without blocking
//! (a FIFO would hang `open` until a writer comes), refused unless it is a regular file, and
//! read up to a bound (`/dev/zero` or a huge file would exhaust the host's memory).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The text of `path`, at most `cap` bytes; `Ok(None)` when there is no such file. A FIFO, a
/// device, a directory or a socket is an error (`InvalidInput`), as is a file larger than
/// `cap` or one that is not UTF-8 (`InvalidData`); the message says which and the bound, not
/// the path (the caller names it).
pub fn read_bounded(path: &Path, cap: u64) -> std::io::Result<Option<String>> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // fstat of the open file, not stat of the path: the file checked is the file read.
    let meta = f.metadata()?;
    if !meta.is_file() {
        let kind = {
            use std::os::unix::fs::FileTypeExt;
            let t = meta.file_type();
            if t.is_dir() {
                "a directory"
            } else if t.is_fifo() {
                "a FIFO"
            } else if t.is_socket() {
                "a socket"
            } else if t.is_char_device() || t.is_block_device() {
                "a device"
            } else {
                "not a regular file"
            }
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{kind}, not a regular file: refused"),
        ));
    }
    let too_big = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {cap} bytes: refused"),
        )
    };
    if meta.len() > cap {
        return Err(too_big());
    }
    // The file may grow between fstat and read: read at most one byte past the bound.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_big());
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("oxccl-file-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_device_a_fifo_and_a_big_file_are_refused_without_blocking_or_reading_them() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a device"), "{e}");
        let d = dir();
        let fifo = d.join("fifo");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Without O_NONBLOCK this open would wait for a writer forever.
        let e = read_bounded(&fifo, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let e = read_bounded(&d, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let big = d.join("big");
        std::fs::write(&big, vec![b'#'; 2000]).unwrap();
        let e = read_bounded(&big, 1000).unwrap_err();
        assert!(e.to_string().contains("larger than 1000 bytes"), "{e}");
        assert_eq!(read_bounded(&big, 2000).unwrap().unwrap().len(), 2000);
        assert!(read_bounded(&d.join("none"), 10).unwrap().is_none());
        let _ = std::fs::remove_dir_all(&d);
    }
}
