//! Flight-recorder dump requests: the agent asks a hung rank to write its
//! torch flight recorder to a file the agent named, and reads it back.
//!
//! In: a `KIND_DUMP_FLIGHT_RECORDER` message on the rank's `Control`
//! stream, with the path. Out: the callbacks registered with
//! [`crate::Client::on_flight_recorder_dump`] (the Python package's calls
//! torch and writes the file), run on a thread of their own.
//! Never: hand the callbacks a path outside the directory the agent named
//! at registration (the stack-dump file's directory: a file the agent made
//! directly in it and handed to the rank), or block the client's background
//! thread: a callback that waits for a GIL the training thread holds
//! forever stalls its own thread only, and further requests are dropped
//! while one runs.

use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// A request to write the flight recorder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightRecorderDump {
    /// The agent's number for the request (nothing to acknowledge).
    pub seq: u64,
    /// Where to write it: a file the agent made (mode 0600, handed to the
    /// rank's uid) in its own directory, which the rank cannot create,
    /// rename or remove anything in. Written in place; the rank then takes
    /// its write bits off (`chmod 0400`) to say the dump is complete
    /// ([`write_dump`]).
    pub path: PathBuf,
}

/// A function run for each dump request.
pub type FlightRecorderCallback = Arc<dyn Fn(&FlightRecorderDump) + Send + Sync>;

/// The callbacks and whether a dump is being written.
#[derive(Default)]
pub(crate) struct FlightDumps {
    callbacks: Mutex<Vec<FlightRecorderCallback>>,
    /// A dump in progress: its thread runs the callbacks; requests meanwhile
    /// are dropped (one stuck dump never piles up threads).
    busy: Arc<AtomicBool>,
}

impl std::fmt::Debug for FlightDumps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightDumps")
            .field("busy", &self.busy.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl FlightDumps {
    pub(crate) fn add(&self, cb: FlightRecorderCallback) {
        self.callbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(cb);
    }

    /// Runs the callbacks for `req` on a new thread, unless its path is
    /// not one the agent may name or a dump is already in progress. True
    /// when started.
    pub(crate) fn offer(&self, req: FlightRecorderDump, stack_dump_path: Option<&Path>) -> bool {
        // A refused path is dropped silently (the client never writes to
        // stderr from its background thread): the agent's bounded wait
        // reports that no dump came.
        if check_path(&req.path, stack_dump_path).is_err() {
            return false;
        }
        let callbacks = self
            .callbacks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if callbacks.is_empty() || self.busy.swap(true, Ordering::AcqRel) {
            return false;
        }
        let busy = self.busy.clone();
        let spawned = std::thread::Builder::new()
            .name("warden-flight".to_owned())
            .spawn(move || {
                for cb in &callbacks {
                    cb(&req);
                }
                busy.store(false, Ordering::Release);
            });
        if spawned.is_err() {
            self.busy.store(false, Ordering::Release);
            return false;
        }
        true
    }
}

/// Checks that `path` is `<dir of stack_dump_path>/<one name>`, not the
/// stack-dump file itself: the only place an agent asks for a dump.
pub fn check_path(path: &Path, stack_dump_path: Option<&Path>) -> Result<(), String> {
    let base = stack_dump_path
        .and_then(Path::parent)
        .ok_or("the agent named no stack-dump directory at registration")?;
    let rest = path
        .strip_prefix(base)
        .map_err(|_| format!("not under {}", base.display()))?;
    let parts: Vec<Component<'_>> = rest.components().collect();
    if parts.len() != 1 || !parts.iter().all(|c| matches!(c, Component::Normal(_))) {
        return Err(format!("not a file directly in {}", base.display()));
    }
    if Some(path) == stack_dump_path {
        return Err("the stack-dump file, not a flight-recorder file".to_owned());
    }
    Ok(())
}

/// Writes a dump into the file the agent made at `path` and marks it
/// complete: opened without creating and never through a link, cut to
/// nothing, written, then its write bits taken off (mode 0400), which is
/// what the agent waits for. Nothing is created or renamed: the directory
/// is the agent's, and the agent removes the file by its name afterwards.
pub fn write_dump(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    f.set_len(0)?;
    f.write_all(bytes)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o400))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_file_in_a_directory_of_the_stack_dump_directory() {
        let stack = Some(Path::new("/run/warden/slots/stacks/job-0.abc"));
        let ok = Path::new("/run/warden/slots/stacks/job-0.fr.xyz");
        assert_eq!(check_path(ok, stack), Ok(()));
        for bad in [
            "/etc/passwd",
            "/run/warden/slots/stacks/job-0.abc",
            "/run/warden/slots/stacks/job-0.fr.xyz/flight_recorder.json",
            "/run/warden/slots/stacks/a/b/c.json",
            "/run/warden/slots/stacks/../x/flight_recorder.json",
            "/run/warden/slots/stacks/a/../b",
            "relative/a/b",
        ] {
            assert!(check_path(Path::new(bad), stack).is_err(), "{bad}");
        }
        assert!(check_path(ok, None).is_err());
    }

    #[test]
    fn one_dump_at_a_time() {
        let dumps = FlightDumps::default();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = Mutex::new(rx);
        let (ran_tx, ran_rx) = std::sync::mpsc::channel::<u64>();
        let ran_tx = Mutex::new(ran_tx);
        dumps.add(Arc::new(move |r: &FlightRecorderDump| {
            let _ = ran_tx.lock().map(|t| t.send(r.seq));
            // Stuck until the test lets go, as a GIL never released would be.
            let _ = rx.lock().map(|r| r.recv());
        }));
        let stack = Path::new("/s/stacks/j-0.x");
        let req = |seq| FlightRecorderDump {
            seq,
            path: PathBuf::from("/s/stacks/j-0.fr.y"),
        };
        assert!(dumps.offer(req(1), Some(stack)));
        assert_eq!(
            ran_rx.recv_timeout(std::time::Duration::from_secs(30)),
            Ok(1)
        );
        assert!(!dumps.offer(req(2), Some(stack)), "one is still running");
        tx.send(()).expect("release");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !dumps.offer(req(3), Some(stack)) {
            assert!(std::time::Instant::now() < deadline, "never freed");
            std::thread::yield_now();
        }
        assert_eq!(
            ran_rx.recv_timeout(std::time::Duration::from_secs(30)),
            Ok(3)
        );
        tx.send(()).expect("release");
    }
}
