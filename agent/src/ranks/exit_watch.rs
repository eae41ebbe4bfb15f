//! Seeing a rank's process exit at once: a pidfd per rank, awaited on the
//! runtime (readable when the process exits), instead of a slow poll.
//!
//! The exit status of a process that is not our child cannot be waited for;
//! it is read from `/proc/<pid>/stat` while the process is a zombie, which is
//! the moment the pidfd turns readable. If its parent reaps it first, the
//! status is reported as unknown, with that reason.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::process::RankProcess;
use super::procfs;
use super::registry::{ExitInfo, RankKey};
use crate::state::AgentState;

/// Opens a pidfd for `pid` (Linux 5.3+).
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Watches the rank's held process and reports its exit to the agent
/// state (through a duplicate of its pidfd: never a pid looked up again).
pub fn spawn(state: Arc<AgentState>, key: RankKey, generation: u64, process: &RankProcess) {
    let pid = process.pid;
    let registered = process.fd.try_clone().and_then(|fd| {
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd: it stays open
        // and refers to the same pidfd until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(std::io::Error::from)
    });
    let fd = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(%key, pid, error = %e, "cannot watch the rank's process with a pidfd; its exit will be seen by the scan");
            return;
        }
    };
    let released = process.released.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            // Deregistered (or replaced) while the process lives on: the
            // registration is gone, and with it the watch and its pidfd.
            () = released.cancelled() => return,
            r = fd.readable() => { let _ = r; }
        }
        state.rank_exited(&key, generation, exit_info(pid));
    });
}

/// The exit status of `pid`, read while it is a zombie.
pub fn exit_info(pid: u32) -> ExitInfo {
    match procfs::read(pid) {
        Some(f) if f.state == 'Z' || f.state == 'X' => match f.exit_status {
            Some(status) => {
                let (code, signal) = procfs::decode_status(status);
                ExitInfo {
                    code,
                    signal,
                    source: "/proc/PID/stat of the zombie".into(),
                }
            }
            None => ExitInfo {
                code: None,
                signal: None,
                source: "kernel does not report exit_code in /proc/PID/stat".into(),
            },
        },
        _ => ExitInfo {
            code: None,
            signal: None,
            source: "status unknown: the parent reaped the process before the agent read it".into(),
        },
    }
}
