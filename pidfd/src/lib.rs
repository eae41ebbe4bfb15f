//! Process handles by pidfd (Linux 5.3+): a descriptor that names one
//! process for as long as it is held, so a signal or an exit watch can
//! never reach another process that later got the same pid number.
//!
//! Why a crate of its own: the agent holds its ranks' processes by pidfd
//! (exit watch, stack-dump signal) and the launcher its workers' (exit
//! watch); neither should borrow the system call from the other's modules.
//!
//! In: a pid, or a pidfd and a signal. Out: the descriptor, or the OS error.
//! Never: touch memory of the caller's beyond the call, or retry.
//!
//! # Layout
//! - [`open`]: a pidfd for a pid (`pidfd_open(2)`).
//! - [`send_signal`]: a signal through it (`pidfd_send_signal(2)`).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Opens a pidfd for `pid` (Linux 5.3+).
///
/// The caller must know `pid` still names the process it means (its own
/// unreaped child, or a process it just verified): from then on the
/// descriptor does.
pub fn open(pid: u32) -> std::io::Result<OwnedFd> {
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

/// Sends `signal` to the process `fd` holds (never to whatever now has its
/// pid number); fails with ESRCH once it has exited.
pub fn send_signal(fd: BorrowedFd<'_>, signal: i32) -> std::io::Result<()> {
    // SAFETY: pidfd_send_signal takes a pidfd kept open by the borrow, a
    // signal number, a null siginfo and flags 0; it touches no memory of
    // ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::process::Command;

    use super::*;

    #[test]
    fn a_held_child_is_signalled_and_a_gone_one_is_not() {
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        let fd = open(child.id()).unwrap();
        send_signal(fd.as_fd(), 0).unwrap();
        send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        // Reaped: the descriptor still names that process, which is gone.
        let e = send_signal(fd.as_fd(), 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "{e}");
    }

    #[test]
    fn a_pid_past_the_kernels_range_is_esrch() {
        let e = open(u32::MAX).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "{e}");
    }
}
