//! The training-side client: registration, the hot path, and staying out of the way.
//!
//! A [`Client`] always has a slot to write into: the agent's (connected) or
//! a private in-process one (disconnected). The hot path loads one
//! `AtomicPtr` and does a few relaxed stores into whichever it points at, so
//! agent trouble never costs training anything and never raises.
//!
//! A background thread, owning a current-thread tokio runtime, registers
//! with the agent over its Unix socket (gRPC), receives its slot's sealed
//! memory over the slot socket beside it ([`crate::slot_socket`]), maps it, copies the
//! current state (step, open sections, step ring, names) into it and swaps
//! the pointer. It then checks every `probe_interval` that the agent is still
//! there: the slot still carries our generation and is claimed, and (every fifth check) a
//! `GetNodeHealth` call on the open channel succeeds (the cheapest
//! call: it does not touch the rank registry, so a node with many ranks
//! does not pay for their probes). That call cannot tell an agent that was
//! restarted (the channel dials the new one by itself, and the slot's sealed
//! memory outlives the agent that made it): the `Control` stream does. It
//! breaks when the agent goes, is opened again every second, and a new
//! agent answers `NOT_FOUND` for a registration it never made. On any failure it copies
//! the state back into the private slot, swaps, retires the mapping and
//! re-registers with backoff (100 ms doubling to 5 s), passing the slot it
//! had as `previous_slot`.
//!
//! While registered, the same thread also follows in-process restart
//! requests (see [`crate::restart`]): it opens the rank's `Control` stream
//! (again after each registration, and after a broken stream), reads the
//! slot's control word every [`crate::restart::SLOT_POLL`], runs the callbacks
//! registered with [`Client::on_restart`] once per new request, and sends
//! the `AckControl` calls that [`Client::ack_restart`] queues.
//!
//! # Layout
//! - `options`: [`ConnectOptions`] and their environment (devices included).
//! - `hot_path`: the training loop's calls and the section-name table.
//! - `link`: the background thread: registration, probes, the `Control`
//!   stream, re-registration.
//! - `fork`: a forked child moved to its private slot.
//! - here: [`Client`] itself (lifecycle, restart and report calls) and the
//!   state the three share (`Inner`).

mod fork;
mod hot_path;
mod link;
mod options;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;

use tokio::sync::Notify;

pub use hot_path::{SectionGuard, SectionId};
pub use options::{
    ClientError, ConnectOptions, EXCEPTION_REPORT_TIMEOUT, MAX_DEVICE_NAME, MAX_DEVICES,
    devices_from_env,
};

use crate::clock;
use crate::mapping::SlotMapping;
use crate::report::{self, ExceptionDecision, ExceptionReport, ReportError};
use crate::restart::{RestartCallback, RestartRequest, RestartState, RestartVia};
#[cfg(doc)]
use crate::slot::ControlWord;
use crate::slot::{Slot, SlotError, SlotSnapshot};
use hot_path::Names;

/// What a client knows about its link to the agent (for status and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStatus {
    /// Whether the hot path writes into an agent's slot.
    pub connected: bool,
    /// The slot index, when connected.
    pub slot_index: Option<u32>,
    /// The generation the agent issued, when connected.
    pub generation: Option<u64>,
    /// Registrations that succeeded so far.
    pub registrations: u64,
    /// The last reason the client was or went disconnected.
    pub last_error: Option<String>,
    /// Where the agent wants stack dumps written, when connected.
    pub stack_dump_path: Option<PathBuf>,
}

/// What the client's handle, its hot path and its background link share.
#[derive(Debug)]
struct Inner {
    /// The slot the hot path writes: `dummy` or a live mapping's slot.
    current: AtomicPtr<Slot>,
    /// The private stand-in slot, used while no agent is there.
    dummy: Box<Slot>,
    names: Names,
    connected: AtomicBool,
    stop: AtomicBool,
    /// Set by a report of an uncaught exception: the process is about to
    /// exit because of it. Closing then leaves the registration in place,
    /// so the agent sees the exit (code, signal, with the exception before
    /// it) instead of a clean deregistration that would hide the crash
    /// (Python runs its atexit handlers, which close the client, after the
    /// excepthook).
    exiting: AtomicBool,
    wake: Notify,
    opts: ConnectOptions,
    /// Every mapping ever used: retired ones stay until the client is
    /// dropped so no pointer the hot path may still hold dangles.
    mappings: Mutex<Vec<SlotMapping>>,
    status: Mutex<LinkStatus>,
    /// In-process restart requests: the pending one, the callbacks, the
    /// acknowledgements still to send.
    restart: RestartState,
    /// Flight-recorder dump requests: the callbacks, the dump in progress.
    flight: crate::flight::FlightDumps,
}

impl Inner {
    fn set_status(&self, f: impl FnOnce(&mut LinkStatus)) {
        let mut g = match self.status.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g);
    }

    fn mappings(&self) -> MutexGuard<'_, Vec<SlotMapping>> {
        match self.mappings.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn dummy_ptr(&self) -> *mut Slot {
        (&*self.dummy as *const Slot).cast_mut()
    }
}

/// The handle a training process holds: hot-path calls and lifecycle.
///
/// Why it never fails for agent trouble: the agent must never cost goodput,
/// so with no agent the client writes into a private slot and keeps trying.
/// Step and section calls must come from one thread at a time (the training
/// loop); `heartbeat` may be called from any thread.
#[derive(Debug)]
pub struct Client {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Client {
    /// Connects with options from the environment (malformed values fall back to defaults).
    pub fn connect() -> Client {
        let opts = ConnectOptions::from_env_lossy();
        match Self::connect_with(opts.clone()) {
            Ok(c) => c,
            // Only a thread spawn failure gets here: stay disconnected for good.
            Err(e) => Self::offline(opts, Some(e.to_string())),
        }
    }

    /// Connects with explicit options; errors only for invalid options.
    ///
    /// Waits up to `connect_timeout` for the first registration attempt, so a
    /// present agent is attached on return; an absent one is retried in the
    /// background.
    pub fn connect_with(opts: ConnectOptions) -> Result<Client, ClientError> {
        opts.validate()?;
        let _ = clock::now_ns();
        let client = Self::offline(opts, None);
        fork::track(&client.inner);
        let (tx, rx) = mpsc::sync_channel(1);
        let inner = client.inner.clone();
        let handle = std::thread::Builder::new()
            .name("warden-client".to_owned())
            .spawn(move || link::background(inner, tx))
            .map_err(ClientError::Thread)?;
        let timeout = client.inner.opts.connect_timeout;
        if let Ok(mut g) = client.thread.lock() {
            *g = Some(handle);
        }
        let _ = rx.recv_timeout(timeout);
        Ok(client)
    }

    /// A client that never connects: the no-agent mode, for tests and fallbacks.
    pub fn offline(opts: ConnectOptions, reason: Option<String>) -> Client {
        let dummy = Slot::new_boxed();
        let ptr = (&*dummy as *const Slot).cast_mut();
        Client {
            inner: Arc::new(Inner {
                current: AtomicPtr::new(ptr),
                dummy,
                names: Names::new(),
                connected: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                exiting: AtomicBool::new(false),
                wake: Notify::new(),
                opts,
                mappings: Mutex::new(Vec::new()),
                status: Mutex::new(LinkStatus {
                    last_error: reason,
                    ..LinkStatus::default()
                }),
                restart: RestartState::default(),
                flight: crate::flight::FlightDumps::default(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Whether heartbeats currently reach an agent.
    pub fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::Relaxed)
    }

    /// The link's state, for logs and diagnostics.
    pub fn status(&self) -> LinkStatus {
        match self.inner.status.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// A snapshot of the slot the hot path writes now (the agent's or the private one).
    ///
    /// Why: lets tests, the Python package and debugging tools see exactly
    /// what the agent would read, even with no agent.
    pub fn snapshot(&self) -> Result<SlotSnapshot, SlotError> {
        let _names = self.inner.names.guard();
        let p = self.inner.current.load(Ordering::Acquire);
        let index = self.status().slot_index.unwrap_or(0);
        // SAFETY: see `Inner::writer`.
        unsafe { &*p }.snapshot(index)
    }

    /// The options this client registered with.
    pub fn options(&self) -> &ConnectOptions {
        &self.inner.opts
    }

    /// Runs `f` for every new in-process restart request from the agent
    /// (and at once, on this thread, for one already pending).
    ///
    /// Why a callback: the request arrives on the client's background
    /// thread (the `Control` stream or the slot's control word, whichever
    /// is first), and only the program knows how to stop its training loop
    /// (the Python package raises `warden.RestartRequested` in it). `f`
    /// runs on that background thread and must return quickly. The request
    /// stays pending until [`Client::ack_restart`]; an agent that gets no
    /// acknowledgement within its `restart.in_process_timeout` restarts the
    /// job's processes instead.
    pub fn on_restart(&self, f: impl Fn(&RestartRequest) + Send + Sync + 'static) {
        let cb: RestartCallback = Arc::new(f);
        if let Some(pending) = self.inner.restart.add_callback(cb.clone()) {
            cb(&pending);
        }
    }

    /// Runs `f` for every flight-recorder dump request from the agent (a
    /// hung rank asked where its collectives stand), on a thread of its
    /// own: `f` may wait for a lock the training thread holds (Python's
    /// GIL) without stalling the client. Requests arriving while one runs
    /// are dropped; the agent waits a bounded time and says so. Only paths
    /// in the directory the agent named at registration reach `f`
    /// ([`crate::flight::check_path`]).
    pub fn on_flight_recorder_dump(
        &self,
        f: impl Fn(&crate::flight::FlightRecorderDump) + Send + Sync + 'static,
    ) {
        self.inner.flight.add(Arc::new(f));
    }

    /// The restart request waiting for an acknowledgement, if any.
    pub fn restart_pending(&self) -> Option<RestartRequest> {
        self.inner.restart.pending()
    }

    /// Acknowledges restart request `seq`: the training function is being
    /// run again. Stores `seq` into the slot's ack word at once and queues
    /// the `AckControl` call for the background thread (the caller never
    /// waits on the agent). False when `seq` is not the pending request.
    pub fn ack_restart(&self, seq: u64) -> bool {
        ack_restart(&self.inner, seq)
    }

    /// A handle that acknowledges restarts for this client without keeping
    /// it alive (for callbacks, which the client itself holds).
    pub fn restart_acker(&self) -> RestartAcker {
        RestartAcker {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Makes `req` pending as if the agent had sent it, and runs the
    /// callbacks; false when its sequence number was seen already.
    ///
    /// Why: tests and restart drills exercise the whole in-process path
    /// (the Python package's raise, `warden.run`'s retry) with no agent.
    /// Acknowledging an injected request writes the slot's ack word like
    /// any other (an agent ignores an ack it did not ask for).
    pub fn inject_restart(&self, mut req: RestartRequest) -> bool {
        req.via = RestartVia::Injected;
        offer_restart(&self.inner, req)
    }

    /// Reports an exception to the agent (`ReportException`), as this
    /// registration (job, rank, generation, pid); the agent publishes it as
    /// a `rank.exception` event and diagnoses the exit that may follow
    /// with it.
    ///
    /// Bounded: returns within `exception_report_timeout` (1 s by default)
    /// whatever the agent does, and at once when the client holds no
    /// registration (no agent, not yet, or a forked child). Never panics.
    /// `report.step` defaults to the step the client's slot holds.
    ///
    /// With `report.uncaught` the process is taken to be about to exit:
    /// [`Client::close`] (and drop) then no longer deregister, so the agent
    /// sees the exit itself, as a crash with its exit code.
    pub fn report_exception(&self, report: &ExceptionReport) -> Result<(), ReportError> {
        self.send_report(report, false).map(|_| ())
    }

    /// Reports an exception the rank caught and waits on (`warden.run`):
    /// the agent classifies it and answers whether the job restarts in
    /// process (a transient class: the request is on its way to every rank,
    /// this one included) or the exception ends the rank. Bounded as
    /// [`Client::report_exception`]; `report.uncaught` must be false.
    pub fn report_exception_for_decision(
        &self,
        report: &ExceptionReport,
    ) -> Result<ExceptionDecision, ReportError> {
        self.send_report(report, true).map(ExceptionDecision::from)
    }

    fn send_report(
        &self,
        report: &ExceptionReport,
        awaits_decision: bool,
    ) -> Result<warden_proto::v1::ReportExceptionResponse, ReportError> {
        if report.uncaught {
            self.inner.exiting.store(true, Ordering::Release);
        }
        if report.exception_type.is_empty() {
            return Err(ReportError::EmptyType);
        }
        // The atomic first, and no blocking lock after it: in a forked child
        // (never connected) a lock may be held by a thread that is not there.
        if !self.is_connected() {
            return Err(ReportError::NotRegistered(self.not_registered_reason()));
        }
        let status = self.status();
        let Some(generation) = status.generation.filter(|_| status.connected) else {
            return Err(ReportError::NotRegistered(self.not_registered_reason()));
        };
        let step = report
            .step
            .unwrap_or_else(|| self.current_step().unwrap_or(0));
        let opts = &self.inner.opts;
        let mut req = report::request(report, &opts.job_id, opts.global_rank, generation, step);
        req.awaits_decision = awaits_decision && !report.uncaught;
        report::send(opts.socket_path.clone(), req, opts.exception_report_timeout)
    }

    /// Why the client is not registered (the last error, if the status is
    /// free to read without waiting).
    fn not_registered_reason(&self) -> String {
        match self.inner.status.try_lock() {
            Ok(s) => s.last_error.clone(),
            Err(_) => None,
        }
        .unwrap_or_else(|| "not connected".to_owned())
    }

    /// The step the slot holds (open, or the last one), when a step was ever begun.
    fn current_step(&self) -> Option<u64> {
        let s = self.snapshot().ok()?;
        (s.step_open || s.steps_completed > 0 || s.step != 0).then_some(s.step)
    }

    /// Deregisters from the agent and stops the background thread (idempotent).
    ///
    /// Bounded: the deregistration call times out after a second. The client
    /// stays usable (disconnected) afterwards. After a report of an uncaught
    /// exception it does not deregister (see [`Client::report_exception`]).
    pub fn close(&self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.wake.notify_one();
        let handle = match self.thread.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        fork::forget(&self.inner);
        self.close();
    }
}

/// Acknowledges restart requests for a client it does not keep alive
/// (see [`Client::restart_acker`]).
#[derive(Debug, Clone)]
pub struct RestartAcker {
    inner: std::sync::Weak<Inner>,
}

impl RestartAcker {
    /// [`Client::ack_restart`] on the client, if it still exists.
    pub fn ack(&self, seq: u64) -> bool {
        self.inner
            .upgrade()
            .is_some_and(|inner| ack_restart(&inner, seq))
    }

    /// [`Client::restart_pending`] on the client, if it still exists.
    pub fn pending(&self) -> Option<RestartRequest> {
        self.inner
            .upgrade()
            .and_then(|inner| inner.restart.pending())
    }
}

fn ack_restart(inner: &Inner, seq: u64) -> bool {
    if !inner.restart.ack(seq) {
        return false;
    }
    // The slot first: the agent reads it even when the call cannot be made.
    inner.writer().ack(seq);
    true
}

/// Hands a request to the restart state and runs the callbacks if it is new.
fn offer_restart(inner: &Inner, req: RestartRequest) -> bool {
    let Some((req, callbacks)) = inner.restart.offer(req) else {
        return false;
    };
    for cb in &callbacks {
        cb(&req);
    }
    true
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_client_without_an_agent_reports_nothing_and_returns_at_once() {
        let mut o = ConnectOptions::from_env_lossy();
        o.socket_path = PathBuf::from("/nonexistent/warden/wardend.sock");
        o.job_id = "j".into();
        o.global_rank = 0;
        o.world_size = 1;
        let client = Client::offline(o, Some("no agent here".into()));
        let t0 = std::time::Instant::now();
        let r = client.report_exception(&ExceptionReport {
            exception_type: "RuntimeError".into(),
            message: "boom".into(),
            uncaught: false,
            ..ExceptionReport::default()
        });
        assert!(
            matches!(&r, Err(ReportError::NotRegistered(why)) if why == "no agent here"),
            "{r:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "{:?}",
            t0.elapsed()
        );
        let r = client.report_exception(&ExceptionReport::default());
        assert!(matches!(r, Err(ReportError::EmptyType)), "{r:?}");
    }
}
