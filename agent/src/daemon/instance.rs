//! One agent per socket: an exclusive lock beside the socket file.
//!
//! The lock (`<socket>.lock`, holding the owner's pid) is taken before the
//! socket is touched. A second agent fails to take it and is told which
//! process holds it. The kernel drops the lock when its holder dies, so a
//! socket file left behind by a crash is known to be stale and is replaced.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why the socket could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// Another agent holds the lock.
    #[error(
        "another wardend (pid {pid}{name}) already serves {socket}; stop it first or set api.socket to another path"
    )]
    AlreadyRunning {
        /// The socket path.
        socket: PathBuf,
        /// The pid recorded by the holder ("unknown" if unreadable).
        pid: String,
        /// ", comm" when /proc told us the holder's name.
        name: String,
    },
    /// Something that is not a socket sits at the path.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// The socket answers, but nobody holds the lock (another program?).
    #[error(
        "{0} is accepting connections although no wardend holds its lock; refusing to replace it"
    )]
    InUse(PathBuf),
    /// A filesystem call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Held for the agent's life; removes the socket file when dropped.
#[derive(Debug)]
pub struct SocketClaim {
    socket: PathBuf,
    _lock: File,
    /// Pid of the crashed agent whose socket was replaced, if any.
    pub replaced_stale: Option<String>,
}

impl SocketClaim {
    /// The socket path now owned by this process.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for SocketClaim {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstanceError {
    let path = path.to_owned();
    move |source| InstanceError::Io { what, path, source }
}

/// Claims `socket` for this process: creates its directory, takes the lock,
/// and removes a stale socket file.
pub fn claim(socket: &Path) -> Result<SocketClaim, InstanceError> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(io("cannot create directory", dir))?;
    }
    let lock_path = PathBuf::from(format!("{}.lock", socket.display()));
    let mut lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(&lock_path)
        .map_err(io("cannot open lock file", &lock_path))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut pid = String::new();
            let _ = lock.read_to_string(&mut pid);
            let pid = pid.trim().to_owned();
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| format!(", {}", c.trim()))
                .unwrap_or_default();
            return Err(InstanceError::AlreadyRunning {
                socket: socket.to_owned(),
                pid: if pid.is_empty() {
                    "unknown".into()
                } else {
                    pid
                },
                name,
            });
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(io("cannot lock", &lock_path)(e));
        }
    }
    let mut previous = String::new();
    let _ = lock.read_to_string(&mut previous);
    lock.set_len(0).map_err(io("cannot write", &lock_path))?;
    lock.rewind().map_err(io("cannot write", &lock_path))?;
    write!(lock, "{}", std::process::id()).map_err(io("cannot write", &lock_path))?;

    let mut replaced_stale = None;
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Err(InstanceError::InUse(socket.to_owned()));
            }
            std::fs::remove_file(socket).map_err(io("cannot remove stale socket", socket))?;
            let previous = previous.trim();
            replaced_stale = Some(if previous.is_empty() {
                "unknown".into()
            } else {
                previous.to_owned()
            });
        }
        Ok(_) => return Err(InstanceError::NotASocket(socket.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("cannot inspect", socket)(e)),
    }
    Ok(SocketClaim {
        socket: socket.to_owned(),
        _lock: lock,
        replaced_stale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_claim_is_refused_with_pid() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("a.sock");
        let _first = claim(&sock).unwrap();
        // flock locks belong to the open file description, so a second open
        // in the same process conflicts just as another process would.
        let err = claim(&sock).unwrap_err().to_string();
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        assert!(err.contains("a.sock"), "{err}");
    }

    #[test]
    fn stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("b.sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        assert!(sock.exists());
        let c = claim(&sock).unwrap();
        assert!(c.replaced_stale.is_some());
        assert!(!sock.exists());
    }

    #[test]
    fn regular_file_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("c.sock");
        std::fs::write(&sock, b"precious").unwrap();
        assert!(matches!(claim(&sock), Err(InstanceError::NotASocket(_))));
        assert_eq!(std::fs::read(&sock).unwrap(), b"precious");
    }
}
