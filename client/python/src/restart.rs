//! In-process restarts in Python: `warden.RestartRequested` raised in the
//! training thread, again and again until `warden.run` catches it.
//!
//! The Rust client hands each request to [`deliver`] on its background
//! thread (no GIL needed). The request is raised only in a thread that is
//! inside a guarded call ([`_restart_call`], which `warden.run` wraps the
//! training function in); outside one it just stays pending, and the agent
//! escalates after its timeout.
//!
//! A thread of our own, the resender, delivers it:
//! 1. first with the signal `warden.run` installed a Python handler for
//!    (`WARDEN_RESTART_SIGNAL`, default SIGUSR1), sent to the target thread
//!    with `pthread_kill`: it interrupts a blocking call (`time.sleep`, a
//!    socket or lock wait returns EINTR, Python runs the handler, which
//!    raises);
//! 2. then, if no raise followed within [`SIGNAL_GRACE`] (no handler: not
//!    the main thread, the program owns the signal), with
//!    `PyThreadState_SetAsyncExc`, which raises at the thread's next
//!    bytecode;
//! 3. again every [`RESEND`] while the request is neither caught by
//!    `warden.run` nor raised recently (user code swallowed it), never while
//!    the last raise is still unwinding (its `finally` blocks run in peace).
//!
//! The catch is native ([`_restart_call`]): between the training function's
//! failure and the end of further raises no Python bytecode runs, so no
//! second delivery can land in `warden.run`'s own code. A thread stuck in
//! native code that never returns to the interpreter (a NCCL wait) cannot be
//! interrupted this way; the agent's timeout then restarts the processes.

use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use warden_client::{RestartAcker, RestartRequest};

/// Resend interval while a request is neither caught nor unwinding.
const RESEND: Duration = Duration::from_millis(100);
/// How long a signal gets to produce a raise before the asynchronous
/// exception is set as well.
const SIGNAL_GRACE: Duration = Duration::from_millis(20);

/// `warden.RestartRequested` (defined in Python, registered at import).
static EXCEPTION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Called with the request's seq before its first delivery: aborts the
/// rank's process groups (`warden._torch.abort_process_groups`), so a
/// training thread blocked in a collective returns to the interpreter.
static ABORT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

#[derive(Debug)]
struct Pending {
    request: RestartRequest,
    /// Acknowledges through the client that received it (none for a
    /// request injected without a client).
    acker: Option<RestartAcker>,
    /// When a delivery (signal or asynchronous exception) was last made.
    sent_at: Option<Instant>,
    /// When the exception was last instantiated in the target thread.
    raised_at: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Target {
    /// `threading.get_ident()` of the thread (its pthread_t on Linux).
    ident: u64,
    /// Nesting of guarded calls on it.
    depth: u32,
}

#[derive(Debug, Default)]
struct State {
    pending: Option<Pending>,
    /// The request `warden.run` caught: never raised again.
    caught_seq: u64,
    target: Option<Target>,
    /// The signal with a raising Python handler, and the thread (the main
    /// thread) it may be sent to; 0: none.
    signal: i32,
    signal_thread: u64,
    resender: bool,
    /// The last request whose abort hook ran (0: none).
    aborted_seq: u64,
    /// The restart count of the attempt this rank joined before its
    /// request for it came (`warden.heal`: a later attempt begun by its
    /// peers while it waited); 0: none. That request, when it comes, is
    /// acknowledged, not raised: raised, it would restart the attempt the
    /// rank is already in, one count further, and the peers with it.
    joined_early: u32,
    /// Deliveries made, for tests and diagnostics.
    signals_sent: u64,
    async_sent: u64,
}

impl State {
    /// The target thread and request to raise now, if any.
    fn due(&self) -> Option<(Target, u64)> {
        let p = self.pending.as_ref()?;
        let t = self.target.filter(|t| t.depth > 0)?;
        (p.request.seq != self.caught_seq).then_some((t, p.request.seq))
    }
}

fn state() -> MutexGuard<'static, State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE
        .get_or_init(|| Mutex::new(State::default()))
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn changed() -> &'static Condvar {
    static CV: Condvar = Condvar::new();
    &CV
}

fn current_ident() -> u64 {
    // SAFETY: pthread_self has no preconditions. CPython's thread ident on
    // Linux is this pthread_t, as an unsigned long.
    unsafe { libc::pthread_self() as u64 }
}

/// Takes a request from a client (its background thread) and wakes the
/// resender. The newest request wins.
pub fn deliver(request: RestartRequest, acker: Option<RestartAcker>) {
    let mut g = state();
    if g.joined_early != 0 && request.restart_count == g.joined_early {
        g.joined_early = 0;
        drop(g);
        if let Some(a) = &acker {
            a.ack(request.seq);
        }
        return;
    }
    g.pending = Some(Pending {
        request,
        acker,
        sent_at: None,
        raised_at: None,
    });
    ensure_resender(&mut g);
    drop(g);
    changed().notify_all();
}

/// Starts the resender thread once (at the first guarded call, so the
/// first request does not wait for a thread to be created).
fn ensure_resender(g: &mut State) {
    if !g.resender {
        let spawned = std::thread::Builder::new()
            .name("warden-restart".to_owned())
            .spawn(resender);
        g.resender = spawned.is_ok();
    }
}

/// Clears an asynchronous exception set on thread `ident` and not raised
/// yet (the GIL is held by the caller, as the C API requires).
fn clear_async(_py: Python<'_>, ident: u64) {
    // SAFETY: we hold the GIL (the `Python` token); a NULL exception clears
    // what is pending on that thread state, if the thread exists.
    unsafe {
        pyo3::ffi::PyThreadState_SetAsyncExc(ident as std::ffi::c_long, std::ptr::null_mut());
    }
}

fn resender() {
    loop {
        let mut g = state();
        // Wait for something to raise, due now.
        let (target, seq) = loop {
            if let Some((t, seq)) = g.due() {
                let last = g
                    .pending
                    .as_ref()
                    .and_then(|p| match (p.sent_at, p.raised_at) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    });
                match last.map(|l| l + RESEND) {
                    Some(next) if next > Instant::now() => {
                        let wait = next.saturating_duration_since(Instant::now());
                        g = changed()
                            .wait_timeout(g, wait)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        continue;
                    }
                    _ => break (t, seq),
                }
            }
            g = changed().wait(g).unwrap_or_else(PoisonError::into_inner);
        };
        if g.aborted_seq != seq {
            // Before the first delivery: abort the process groups, so a
            // thread blocked in a collective comes back to take it.
            g.aborted_seq = seq;
            drop(g);
            run_abort_hook(seq);
            g = state();
            if g.due().map(|(_, s)| s) != Some(seq) {
                continue;
            }
        }
        let raised_before = g.pending.as_ref().and_then(|p| p.raised_at);
        if let Some(p) = g.pending.as_mut() {
            p.sent_at = Some(Instant::now());
        }
        if g.signal > 0 && g.signal_thread == target.ident {
            g.signals_sent += 1;
            // SAFETY: the target is inside a guarded call, which it cannot
            // leave without this lock: the thread exists. Its handler for
            // the signal is Python's (installed by warden.run and kept).
            unsafe {
                libc::pthread_kill(target.ident as libc::pthread_t, g.signal);
            }
            let deadline = Instant::now() + SIGNAL_GRACE;
            g = changed()
                .wait_timeout_while(g, SIGNAL_GRACE, |s| {
                    s.due() == Some((target, seq))
                        && s.pending.as_ref().and_then(|p| p.raised_at) == raised_before
                        && Instant::now() < deadline
                })
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            let raised = g.pending.as_ref().and_then(|p| p.raised_at) != raised_before;
            if raised || g.due() != Some((target, seq)) {
                continue;
            }
        }
        drop(g);
        // The asynchronous exception needs the GIL: taken without our lock
        // (the training thread takes the lock while holding the GIL).
        Python::attach(|py| {
            let mut g = state();
            let still = g.due() == Some((target, seq))
                && g.pending.as_ref().and_then(|p| p.raised_at) == raised_before;
            if !still {
                return;
            }
            if let Some(cls) = EXCEPTION.get(py) {
                g.async_sent += 1;
                // SAFETY: we hold the GIL; `cls` is a live exception class
                // (kept by EXCEPTION); the target is inside a guarded call.
                unsafe {
                    pyo3::ffi::PyThreadState_SetAsyncExc(
                        target.ident as std::ffi::c_long,
                        cls.as_ptr(),
                    );
                }
            }
        });
    }
}

/// Runs the abort hook, if one is registered, with the GIL (a thread
/// blocked in a collective has released it). Its errors are printed, never
/// raised: the restart goes on either way.
fn run_abort_hook(seq: u64) {
    Python::attach(|py| {
        if let Some(hook) = ABORT.get(py)
            && let Err(e) = hook.bind(py).call1((seq,))
        {
            e.print(py);
        }
    });
}

/// Registers the hook that aborts the process groups before a request is
/// delivered (at import).
#[pyfunction]
pub fn _restart_set_abort(py: Python<'_>, hook: Bound<'_, PyAny>) -> PyResult<()> {
    let _ = ABORT.set(py, hook.unbind());
    Ok(())
}

/// Registers `warden.RestartRequested` (at import).
#[pyfunction]
pub fn _restart_set_exception(py: Python<'_>, cls: Bound<'_, PyType>) -> PyResult<()> {
    let _ = EXCEPTION.set(py, cls.unbind());
    Ok(())
}

/// Records that the Python handler for `signal` raises (0: none), and the
/// thread it runs on (the main thread).
#[pyfunction]
pub fn _restart_set_signal(signal: i32, thread: u64) {
    let mut g = state();
    g.signal = signal;
    g.signal_thread = thread;
}

/// The pending request as a dict (seq, restart_count, reason,
/// incident_id), or None.
#[pyfunction]
pub fn _restart_pending(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let req = state().pending.as_ref().map(freshest);
    req.map(|r| request_dict(py, &r)).transpose()
}

/// Whether the pending request is the one `warden.run` caught: the
/// training thread has it and is tearing its attempt down before the
/// acknowledgement. `warden.heal`'s `_Stuck` takes such a request as
/// taken: a thread that holds it is in `warden.run`'s own teardown, not
/// blocked in a collective, and leaving with exit 75 there (a teardown off
/// the CPU for a second on a loaded host) turned a survivor into a second
/// heal in the middle of the first (CI, issue 31). False with none pending.
#[pyfunction]
pub fn _restart_pending_caught() -> bool {
    let g = state();
    g.pending
        .as_ref()
        .is_some_and(|p| p.request.seq == g.caught_seq)
}

/// The pending request with what its client learnt since (a request first
/// seen in the slot gets its reason and incident from the stream's copy).
fn freshest(p: &Pending) -> RestartRequest {
    p.acker
        .as_ref()
        .and_then(RestartAcker::pending)
        .filter(|r| r.seq == p.request.seq)
        .unwrap_or_else(|| p.request.clone())
}

fn request_dict<'py>(py: Python<'py>, r: &RestartRequest) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("seq", r.seq)?;
    d.set_item("restart_count", r.restart_count)?;
    d.set_item("reason", &r.reason)?;
    d.set_item("incident_id", &r.incident_id)?;
    Ok(d)
}

/// Called by `RestartRequested.__init__` when it describes the pending
/// request: the raise happened, the next resend waits.
#[pyfunction]
pub fn _restart_raised() {
    let mut g = state();
    if let Some(p) = g.pending.as_mut() {
        p.raised_at = Some(Instant::now());
    }
    drop(g);
    changed().notify_all();
}

/// Whether the signal handler, running now, is to raise.
#[pyfunction]
pub fn _restart_should_raise() -> bool {
    state()
        .due()
        .is_some_and(|(t, _)| t.ident == current_ident())
}

/// Acknowledges the pending request, once a guarded call caught it (the
/// training function runs again), and returns it as a dict; None when no
/// caught request is pending (a newer one that arrived since stays pending:
/// the next guarded call takes it at once).
#[pyfunction]
pub fn _restart_ack(py: Python<'_>) -> PyResult<Option<Bound<'_, PyDict>>> {
    let mut g = state();
    let caught = g.caught_seq;
    let Some(p) = g.pending.take_if(|p| p.request.seq == caught) else {
        return Ok(None);
    };
    drop(g);
    changed().notify_all();
    let request = freshest(&p);
    if let Some(a) = &p.acker {
        // Writes the slot's ack word, queues the AckControl call.
        py.detach(|| a.ack(p.request.seq));
    }
    request_dict(py, &request).map(Some)
}

/// The rank joined the attempt of `restart_count` before its request for
/// it came: that request is acknowledged when it comes (or now, if it is
/// pending and not caught yet), never raised. Returns whether a pending
/// request was acknowledged now.
#[pyfunction]
pub fn _restart_joined_early(py: Python<'_>, restart_count: u32) -> bool {
    let mut g = state();
    let caught = g.caught_seq;
    let taken = g
        .pending
        .take_if(|p| p.request.restart_count == restart_count && p.request.seq != caught);
    g.joined_early = if taken.is_some() { 0 } else { restart_count };
    drop(g);
    changed().notify_all();
    let Some(p) = taken else { return false };
    if let Some(a) = &p.acker {
        py.detach(|| a.ack(p.request.seq));
    }
    true
}

/// Deliveries made so far: (signals, asynchronous exceptions).
#[pyfunction]
pub fn _restart_deliveries() -> (u64, u64) {
    let g = state();
    (g.signals_sent, g.async_sent)
}

/// Leaves the guarded call on this thread (drop guard).
struct Guarded {
    ident: u64,
    target: bool,
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if !self.target {
            return;
        }
        let mut g = state();
        if let Some(t) = g.target.as_mut().filter(|t| t.ident == self.ident) {
            t.depth = t.depth.saturating_sub(1);
            if t.depth == 0 {
                g.target = None;
            }
        }
        drop(g);
        changed().notify_all();
    }
}

/// Calls `func(*args, **kwargs)` as the training thread's guarded call:
/// returns `(True, result)`, or `(False, exc)` when it ended with
/// `RestartRequested` (or when a request was already pending: then `func`
/// is not called). Any other exception propagates. Restart requests are
/// raised in this thread only while it is inside such a call.
#[pyfunction]
#[pyo3(signature = (func, args, kwargs=None))]
pub fn _restart_call<'py>(
    py: Python<'py>,
    func: &Bound<'py, PyAny>,
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<(bool, Bound<'py, PyAny>)> {
    let Some(cls) = EXCEPTION.get(py).map(|c| c.bind(py).clone()) else {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "warden.RestartRequested is not registered (import warden first)",
        ));
    };
    let ident = current_ident();
    let (target, pending_now) = {
        let mut g = state();
        ensure_resender(&mut g);
        let target = match g.target.as_mut() {
            None => {
                g.target = Some(Target { ident, depth: 1 });
                true
            }
            Some(t) if t.ident == ident => {
                t.depth += 1;
                true
            }
            Some(_) => false,
        };
        let due = target && g.due().is_some();
        if due {
            // Asked before the call began: no need to start it at all.
            g.caught_seq = g.pending.as_ref().map_or(g.caught_seq, |p| p.request.seq);
        }
        (target, due)
    };
    let guard = Guarded { ident, target };
    changed().notify_all();
    if pending_now {
        drop(guard);
        let exc = cls.call0()?;
        return Ok((false, exc));
    }
    let result = func.call(args, kwargs);
    // Out of the guarded call first: from here on nothing is raised.
    drop(guard);
    match result {
        Ok(v) => {
            if target {
                clear_async(py, ident);
            }
            Ok((true, v))
        }
        Err(e) => {
            if target {
                clear_async(py, ident);
            }
            if e.is_instance(py, &cls) {
                // Only the target thread's catch is the catch of the request
                // (another thread's RestartRequested was raised by hand).
                let mut g = state();
                if let Some(seq) = g.pending.as_ref().map(|p| p.request.seq).filter(|_| target) {
                    g.caught_seq = seq;
                }
                drop(g);
                changed().notify_all();
                if target {
                    // Normalising the exception may have run Python code.
                    clear_async(py, ident);
                }
                Ok((false, e.into_value(py).into_bound(py).into_any()))
            } else {
                Err(e)
            }
        }
    }
}
