//! systemd's notify protocol: READY=1, STATUS=, STOPPING=1 and the watchdog.
//!
//! All of it is a no-op when `NOTIFY_SOCKET` is unset (not under systemd).
//! Sends never block (a full socket buffer drops the message instead).
//! The watchdog is pinged from the work loop, not from a timer of its own,
//! so an agent whose loop is wedged stops pinging and systemd restarts it.

use std::time::{Duration, Instant};

use sd_notify::NotifyState;

/// Tells systemd the agent is serving.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// Updates the one-line status `systemctl status` shows.
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// Tells systemd the agent is shutting down.
pub fn stopping() {
    send(&[NotifyState::Stopping, NotifyState::Status("shutting down")]);
}

fn send(states: &[NotifyState<'_>]) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if let Err(e) = send_nonblocking(states) {
        // Once: a notify socket that went away would otherwise log every tick.
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(error = %e, "cannot notify systemd (further failures are not logged)");
        }
    }
}

/// Pings the watchdog at half of `WATCHDOG_USEC`, when one is configured.
#[derive(Debug)]
pub struct Watchdog {
    every: Option<Duration>,
    last: Option<Instant>,
}

impl Watchdog {
    /// Reads `WATCHDOG_USEC` / `WATCHDOG_PID` from the environment.
    pub fn from_env() -> Self {
        Self {
            every: sd_notify::watchdog_enabled().map(|d| d / 2),
            last: None,
        }
    }

    /// The ping period, if the watchdog is on.
    pub fn period(&self) -> Option<Duration> {
        self.every
    }

    /// Called on every loop iteration; pings when half the timeout passed.
    pub fn tick(&mut self, now: Instant) {
        let Some(every) = self.every else { return };
        if self
            .last
            .is_none_or(|last| now.duration_since(last) >= every)
        {
            send(&[NotifyState::Watchdog]);
            self.last = Some(now);
        }
    }
}

/// Sends one notify datagram without ever blocking: a manager that stopped
/// reading (a full socket buffer) must not stall the work loop that sends.
fn send_nonblocking(states: &[NotifyState<'_>]) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::UnixDatagram;

    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let msg: String = states.iter().map(|s| format!("{s}\n")).collect();
    let sock = UnixDatagram::unbound()?;
    sock.set_nonblocking(true)?;
    let bytes = path.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(msg.as_bytes(), &addr)?;
    } else {
        sock.send_to(msg.as_bytes(), &path)?;
    }
    Ok(())
}
