//! Files whose path an operator or a user names: the config file, scenario
//! files, the TLS and etcd CA, certificate, key and password files, the
//! launcher's `--config`, the planner's scenario and ledger.
//!
//! In: a path from a flag or a config key. Out: the file's bytes, or an
//! [`std::io::Error`] that says why it was refused (the callers already name
//! the path and the key in their own error types, so the message here says
//! only what was wrong). Never: reads something that is not a regular file
//! (`/dev/zero` would be read without end, a FIFO without a writer blocks
//! `open` and `read` for ever), reads more than the caller's cap, or waits
//! past [`DEADLINE`] on a filesystem that stopped answering (a hung NFS or
//! FUSE mount): the open and the read run on a helper thread, and the
//! caller gets a timeout error while that thread is left to the kernel.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

/// The cap for configuration-like files (TOML, JSON, PEM): far above any
/// real one (the shipped config is ~20 KiB, a CA bundle ~200 KiB), low
/// enough that a wrong path cannot take the agent's memory.
pub const CONFIG_CAP: u64 = 1 << 20;

/// How long an open plus read may take before the caller gets an error.
/// A local file is read in microseconds; the margin is for a loaded
/// machine and slow network filesystems that still answer.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// The whole content of the regular file at `path`, at most `cap` bytes.
///
/// Opened with `O_NONBLOCK | O_NOCTTY` so that a FIFO or a terminal never
/// blocks the open; anything but a regular file is then refused by its
/// `fstat` before one byte is read. A file larger than `cap` (by `fstat`,
/// or by what the read finds when it grows meanwhile) is refused.
pub fn read(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    read_within(path, cap, DEADLINE)
}

/// [`read`], as UTF-8 text (an `InvalidData` error otherwise).
pub fn read_to_string(path: &Path, cap: u64) -> io::Result<String> {
    String::from_utf8(read(path, cap)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text: {e}")))
}

/// [`read`] with an explicit deadline (tests use a short one).
pub fn read_within(path: &Path, cap: u64, deadline: Duration) -> io::Result<Vec<u8>> {
    let owned = path.to_owned();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("named-file-read".into())
        .spawn(move || {
            // The receiver may be gone after a timeout; nothing to tell then.
            let _ = tx.send(read_now(&owned, cap));
        })?;
    match rx.recv_timeout(deadline) {
        Ok(result) => result,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "opening and reading it took longer than {} (a hung filesystem?); refused",
                humantime::format_duration(deadline)
            ),
        )),
    }
}

/// The read itself, on the calling thread.
fn read_now(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    let f: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)?;
    let meta = f.metadata()?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_char_device() {
            "a character device"
        } else if ft.is_block_device() {
            "a block device"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {kind}; only a regular file is read (refused)"),
        ));
    }
    let too_large = |size: u64| {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("it is larger than the {cap}-byte cap ({size} bytes); refused"),
        )
    };
    if meta.len() > cap {
        return Err(too_large(meta.len()));
    }
    let hint = usize::try_from(meta.len()).unwrap_or(0);
    let mut bytes = Vec::with_capacity(hint);
    f.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_is_read_whole() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("a.toml");
        std::fs::write(&p, b"[agent]\n").unwrap();
        assert_eq!(read(&p, 100).unwrap(), b"[agent]\n");
        assert_eq!(read_to_string(&p, 100).unwrap(), "[agent]\n");
    }

    #[test]
    fn devices_fifos_and_directories_are_refused_at_once() {
        let t = tempfile::tempdir().unwrap();
        let fifo = t.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for (p, kind) in [
            (Path::new("/dev/zero"), "a character device"),
            (fifo.as_path(), "a FIFO"),
            (t.path(), "a directory"),
        ] {
            // A FIFO without a writer would block a plain open for ever;
            // the short deadline turns a regression into a failure, not a hang.
            let e = read_within(p, CONFIG_CAP, Duration::from_secs(30)).unwrap_err();
            assert_eq!(
                e.kind(),
                io::ErrorKind::InvalidInput,
                "{}: {e}",
                p.display()
            );
            assert!(e.to_string().contains(kind), "{}: {e}", p.display());
        }
    }

    #[test]
    fn a_file_over_the_cap_is_refused_with_its_size() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("big");
        std::fs::write(&p, vec![b'#'; 101]).unwrap();
        let e = read(&p, 100).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::FileTooLarge);
        assert!(e.to_string().contains("100-byte cap (101 bytes)"), "{e}");
        assert_eq!(read(&p, 101).unwrap().len(), 101);
    }

    #[test]
    fn a_missing_file_keeps_the_os_error() {
        let e = read(Path::new("/nonexistent/warden.toml"), 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn invalid_utf8_is_named() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("bin");
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        let e = read_to_string(&p, 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("not UTF-8"), "{e}");
    }
}
