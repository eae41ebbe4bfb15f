//! Seeing a rank's process exit at once: a pidfd per rank, awaited on the
//! runtime (readable when the process exits), instead of a slow poll.
//!
//! The exit status of a process that is not our child cannot be waited for;
//! it is read from `/proc/<pid>/stat` while the process is a zombie, which is
//! the moment the pidfd turns readable. If its parent reaps it first, the
//! status is reported as unknown, with that reason.
//!
//! In: the rank's pidfd and the handles of [`Handles`]. Out: the exit
//! recorded in the registry ([`super::exited::record`]), whose typed outcome
//! this watch acts on: the last steps booked in the goodput ledger,
//! `rank.exited` published, `warden_rank_exits_total` counted. Never: hold
//! the agent's whole state, or look a pid up again.

use std::sync::Arc;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

use super::exited;
use super::process::RankProcess;
use super::procfs;
use super::registry::{ExitInfo, RankKey, SharedRegistry};
use warden_core::events::{EventBus, Severity};
use warden_core::goodput::Goodput;
use warden_core::signal::Signal;

/// What an exit watch needs of the agent, and nothing more.
#[derive(Debug, Clone)]
pub struct Handles {
    /// Where the exit is recorded.
    pub registry: SharedRegistry,
    /// Where the steps the rank completed since the last scan are booked.
    pub goodput: Arc<Goodput>,
    /// Where `rank.exited` is published.
    pub events: Arc<EventBus>,
    /// Cancelled when the agent shuts down: the watch ends with it.
    pub shutdown: CancellationToken,
}

/// Watches the rank's held process and reports its exit ([`on_exit`])
/// (through a duplicate of its pidfd: never a pid looked up again).
pub fn spawn(handles: Handles, key: RankKey, generation: u64, process: &RankProcess) {
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
            () = handles.shutdown.cancelled() => return,
            // Deregistered (or replaced) while the process lives on: the
            // registration is gone, and with it the watch and its pidfd.
            () = released.cancelled() => return,
            r = fd.readable() => { let _ = r; }
        }
        on_exit(&handles, &key, generation, exit_info(pid));
    });
}

/// Records that a rank's process exited ([`exited::record`]) and acts on
/// the outcome: books the steps it completed since the last scan in the
/// goodput ledger and publishes `rank.exited`. A stale exit (another
/// generation, already reported) does nothing.
pub fn on_exit(handles: &Handles, key: &RankKey, generation: u64, exit: ExitInfo) {
    let Some(out) = exited::record(&mut handles.registry.lock(), key, generation, exit) else {
        return;
    };
    if !out.last_steps.is_empty() {
        let mut l = handles.goodput.ledger();
        for s in out.last_steps {
            l.step(&key.job, key.rank, s);
        }
    }
    let clean = out.signal.severity() == Severity::Info;
    metrics::counter!("warden_rank_exits_total", "outcome" => if clean { "clean" } else { "failed" }).increment(1);
    handles.events.publish(Signal::RankExited(out.signal));
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
