//! A rank's process as the agent may touch it: verified to belong to the
//! caller that registered it, and held by a pidfd.
//!
//! In: the pid a registration declares and the kernel's word on the caller
//! (SO_PEERCRED). Out: a [`RankProcess`] whose pidfd is what the agent
//! watches for the exit and signals for a stack dump. Never: signal a bare
//! pid number (a recycled pid would be hit), or a process the caller did not
//! show to be its own: itself, or its descendant (a launcher registering
//! its workers), running as the caller's uid.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

/// Why a declared pid was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProcessError {
    /// The pid is neither the caller nor one of its descendants.
    #[error(
        "pid {declared} is not the caller (pid {caller}) nor one of its descendants: a rank registers only its own process"
    )]
    NotCallers {
        /// What the request said.
        declared: u32,
        /// Who called.
        caller: u32,
    },
    /// The process runs as another user than the caller.
    #[error("pid {pid} runs as uid {found}, not the caller's uid {caller}")]
    OtherUser {
        /// The process.
        pid: u32,
        /// Its uid.
        found: u32,
        /// The caller's.
        caller: u32,
    },
    /// The process is gone (or could not be opened).
    #[error("pid {pid} cannot be held: {why}")]
    Gone {
        /// The process.
        pid: u32,
        /// What the kernel said.
        why: String,
    },
}

/// A verified rank process, held by its pidfd.
#[derive(Debug, Clone)]
pub struct RankProcess {
    /// Its pid in the agent's namespace (for messages and procfs).
    pub pid: u32,
    /// The pidfd: the exit watch and every signal go through it.
    pub fd: Arc<OwnedFd>,
    /// Cancelled when the last copy of this registration's process is
    /// dropped (the rank deregistered or was replaced while its process
    /// lives on): the exit watch then ends and closes its pidfd, which
    /// would otherwise stay open, with its task, until the process exits
    /// (issue 22: one descriptor per registration of a long-lived process).
    pub released: tokio_util::sync::CancellationToken,
    /// Cancels `released` when the last copy goes.
    _release_on_drop: Arc<tokio_util::sync::DropGuard>,
}

impl RankProcess {
    /// Verifies that `declared` is the caller `caller_pid` (uid `caller_uid`)
    /// or its descendant running as the same uid, and holds it by a pidfd.
    /// The checks run after the pidfd is open, so the process they saw is
    /// the one held: a pid recycled before the open fails them, and one
    /// recycled after cannot be reached through the pidfd.
    ///
    /// A caller in another PID namespace (a pod's rank, seen by a node agent
    /// in the host's) declares its own pid as its namespace numbers it: that
    /// is the caller itself when it is the innermost pid of the caller's
    /// `NSpid:` line, and the process held is then the caller, under the
    /// number the agent sees.
    pub fn verify(declared: u32, caller_pid: u32, caller_uid: u32) -> Result<Self, ProcessError> {
        let declared = if declared != caller_pid && innermost_pid(caller_pid) == Some(declared) {
            caller_pid
        } else {
            declared
        };
        let fd = warden_pidfd::open(declared).map_err(|e| ProcessError::Gone {
            pid: declared,
            why: e.to_string(),
        })?;
        if declared != caller_pid && !descends_from(declared, caller_pid) {
            return Err(ProcessError::NotCallers {
                declared,
                caller: caller_pid,
            });
        }
        let found = uid_of(declared).ok_or_else(|| ProcessError::Gone {
            pid: declared,
            why: "its /proc/PID/status is gone".into(),
        })?;
        // Root may register a worker that dropped its privileges: its
        // descendant by the check above, and root could signal it anyway.
        if found != caller_uid && caller_uid != 0 {
            return Err(ProcessError::OtherUser {
                pid: declared,
                found,
                caller: caller_uid,
            });
        }
        // Still alive through the pidfd (signal 0 checks, sends nothing):
        // the facts above were about the process it holds.
        warden_pidfd::send_signal(fd.as_fd(), 0).map_err(|e| ProcessError::Gone {
            pid: declared,
            why: e.to_string(),
        })?;
        let released = tokio_util::sync::CancellationToken::new();
        Ok(Self {
            pid: declared,
            fd: Arc::new(fd),
            _release_on_drop: Arc::new(released.clone().drop_guard()),
            released,
        })
    }

    /// Sends `signal` to the held process (never to whatever now has its
    /// pid number). Fails with ESRCH once it has exited.
    pub fn signal(&self, signal: i32) -> std::io::Result<()> {
        warden_pidfd::send_signal(self.fd.as_fd(), signal)
    }
}

/// The parent of `pid`, from its /proc/PID/stat.
fn parent_of(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    super::procfs::parse_stat(&text).map(|f| f.ppid)
}

/// Whether `ancestor` is a (grand)parent of `pid`. The walk is bounded:
/// process trees are shallow, and a loop in what procfs says ends it.
pub fn descends_from(pid: u32, ancestor: u32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        match parent_of(p) {
            Some(parent) if parent == ancestor => return true,
            Some(parent) if parent > 1 && parent != p => p = parent,
            _ => return false,
        }
    }
    false
}

/// The pid of `pid` in its own (innermost) PID namespace: the last number
/// of `NSpid:` in its status.
pub fn innermost_pid(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

/// The effective uid of `pid` (the second number of `Uid:` in its status).
pub fn uid_of(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_verified_as_itself_and_its_children() {
        let me = std::process::id();
        let uid = nix::unistd::geteuid().as_raw();
        let held = RankProcess::verify(me, me, uid).unwrap();
        held.signal(0).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        assert!(descends_from(child.id(), me));
        RankProcess::verify(child.id(), me, uid).unwrap();
        // The child is not the parent's to claim the other way round.
        assert_eq!(
            RankProcess::verify(me, child.id(), uid).unwrap_err(),
            ProcessError::NotCallers {
                declared: me,
                caller: child.id()
            }
        );
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_signal_after_the_exit_reaches_nobody() {
        let me = std::process::id();
        let uid = nix::unistd::geteuid().as_raw();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let held = RankProcess::verify(child.id(), me, uid).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        // Reaped: the pidfd refers to a process that is gone, whatever now
        // has its number.
        let e = held.signal(libc::SIGUSR1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH));
    }

    #[test]
    fn init_is_nobodys_descendant() {
        assert!(!descends_from(1, std::process::id()));
    }
}
