//! The native half of the `warden` Python package (module `warden._native`).
//!
//! Thin PyO3 wrappers over [`warden_client::Client`]. The hot path is kept
//! lean for Python: a [`Section`] is resolved to its id once, when it is
//! created, and its `__enter__`/`__exit__` are implemented here, so a `with`
//! block costs two native method calls and a few atomic stores. The
//! module-level functions use a default client created from the environment
//! on first use. Nothing raises for agent trouble; only invalid arguments do.
//!
//! Exception reports ([`Client::report_exception`]) format the exception in
//! Python (`warden/_excepthook.py`, which also installs the chained
//! `sys.excepthook` and `threading.excepthook` when a client is created)
//! and send it here with the GIL released, within the client's bounded
//! deadline.
//!
//! In-process restarts ([`restart`]): every client created here hands the
//! agent's restart requests to the module-wide restart state, which raises
//! `warden.RestartRequested` in the thread running `warden.run`.
//!
//! Modules: `checkpoint` (the agent calls around a shard's save and
//! restore), `copy` (an async save's snapshot copy, split over threads),
//! `flight` (the torch flight recorder's dump hook), `restart`.

mod checkpoint;
mod copy;
mod flight;
mod restart;

use std::path::PathBuf;
use std::time::Duration;

use std::sync::atomic::{AtomicI32, Ordering};

use pyo3::exceptions::{PyBaseException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use warden_client::slot::SlotSnapshot;
use warden_client::{ConnectOptions, ExceptionReport, SectionId};

/// A connection to the local warden agent (or a private slot while there is none).
///
/// Weak-referenceable: the excepthook follows explicit clients without
/// keeping them alive.
#[pyclass(frozen, weakref, module = "warden._native")]
#[derive(Debug)]
pub struct Client {
    inner: warden_client::Client,
    /// name -> Section, so `with client.section("forward"):` in a loop
    /// allocates nothing after the first iteration (bounded, see CACHE_MAX).
    sections: Py<PyDict>,
}

/// Most sections cached per client; names past it still work, uncached.
const CACHE_MAX: usize = 256;

impl Client {
    fn new(py: Python<'_>, inner: warden_client::Client) -> Client {
        // The acker holds the client weakly: the callback lives in it.
        let acker = inner.restart_acker();
        inner.on_restart(move |req| restart::deliver(req.clone(), Some(acker.clone())));
        inner.on_flight_recorder_dump(flight::deliver);
        Client {
            inner,
            sections: PyDict::new(py).unbind(),
        }
    }
}

/// A section, resolved to its id once; use with `with` or as a decorator.
#[pyclass(frozen, module = "warden._native")]
#[derive(Debug)]
pub struct Section {
    client: Py<Client>,
    id: SectionId,
    name: String,
}

/// A training step as a context manager: `step_begin` on enter, `step_end` on exit.
#[pyclass(frozen, module = "warden._native")]
#[derive(Debug)]
pub struct Step {
    client: Py<Client>,
    step: u64,
}

/// The module-level client, created from the environment on first use.
static DEFAULT: PyOnceLock<Py<Client>> = PyOnceLock::new();

/// The signal the Python layer handles with faulthandler (0: none); set by
/// `warden/__init__.py` before any client exists, and sent to the agent at
/// registration so it can ask a hung rank for its stacks.
static STACK_DUMP_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Records the stack-dump signal the package installed a handler for.
#[pyfunction]
fn _set_stack_dump_signal(signal: i32) {
    STACK_DUMP_SIGNAL.store(signal, Ordering::Relaxed);
}

pub(crate) fn options_from_env() -> ConnectOptions {
    let mut o = ConnectOptions::from_env_lossy();
    o.stack_dump_signal = STACK_DUMP_SIGNAL.load(Ordering::Relaxed);
    o
}

fn default_ref(py: Python<'_>) -> PyResult<&'static Py<Client>> {
    if let Some(c) = DEFAULT.get(py) {
        return Ok(c);
    }
    let c = DEFAULT.get_or_try_init(py, || {
        let opts = options_from_env();
        let inner = py.detach(|| {
            warden_client::Client::connect_with(opts.clone())
                .unwrap_or_else(|e| warden_client::Client::offline(opts, Some(e.to_string())))
        });
        Py::new(py, Client::new(py, inner))
    })?;
    install_excepthooks(py);
    Ok(c)
}

/// `warden._excepthook.install()`: idempotent, honours `WARDEN_EXCEPTHOOK=0`.
/// A failure costs the automatic reports, never the client.
fn install_excepthooks(py: Python<'_>) {
    let _ = py
        .import("warden._excepthook")
        .and_then(|m| m.call_method0("install"));
}

fn section_of(client: &Bound<'_, Client>, name: &Bound<'_, PyString>) -> PyResult<Py<Section>> {
    let py = client.py();
    let cache = client.get().sections.bind(py);
    if let Some(hit) = cache.get_item(name)?
        && let Ok(sec) = hit.cast_into::<Section>()
    {
        return Ok(sec.unbind());
    }
    let text = name.to_cow()?;
    let sec = Py::new(
        py,
        Section {
            client: client.clone().unbind(),
            id: client.get().inner.section_id(&text),
            name: text.into_owned(),
        },
    )?;
    if cache.len() < CACHE_MAX {
        cache.set_item(name, &sec)?;
    }
    Ok(sec)
}

#[pymethods]
impl Client {
    /// Says "still alive" (any thread).
    fn heartbeat(&self) {
        self.inner.heartbeat();
    }

    /// Starts training step `step` (an open step is ended first).
    fn step_begin(&self, step: u64) {
        self.inner.step_begin(step);
    }

    /// Ends the open step, closing sections left open in it.
    fn step_end(&self, step: u64) {
        self.inner.step_end(step);
    }

    /// Reports this step's loss and gradient norm (either may be omitted;
    /// anything `float()` accepts, a 0-d tensor included) for the agent's
    /// silent-data-corruption check.
    #[pyo3(signature = (loss=None, grad_norm=None))]
    fn report_values(&self, loss: Option<f64>, grad_norm: Option<f64>) {
        self.inner.report_values(loss, grad_norm);
    }

    /// A context manager / decorator for section `name` (id resolved now).
    fn section(slf: &Bound<'_, Self>, name: &Bound<'_, PyString>) -> PyResult<Py<Section>> {
        section_of(slf, name)
    }

    /// A context manager for training step `step`.
    fn step(slf: &Bound<'_, Self>, step: u64) -> Step {
        Step {
            client: slf.clone().unbind(),
            step,
        }
    }

    /// The id of section `name`, interned on first use.
    fn section_id(&self, name: &str) -> u32 {
        self.inner.section_id(name).get()
    }

    /// Opens section `id` (explicit form of `with section(...)`).
    fn section_open(&self, id: u32) {
        self.inner.section_open(SectionId::from_raw(id));
    }

    /// Closes section `id` and any section opened inside it.
    fn section_close(&self, id: u32) {
        self.inner.section_close(SectionId::from_raw(id));
    }

    /// Whether heartbeats currently reach an agent.
    fn is_connected(&self) -> bool {
        self.inner.is_connected()
    }

    /// The link's state: connected, slot index, generation, registrations, last error.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.status();
        let d = PyDict::new(py);
        d.set_item("connected", s.connected)?;
        d.set_item("slot_index", s.slot_index)?;
        d.set_item("generation", s.generation)?;
        d.set_item("registrations", s.registrations)?;
        d.set_item("last_error", s.last_error)?;
        d.set_item("stack_dump_path", s.stack_dump_path)?;
        Ok(d)
    }

    /// What the agent would read from this client's slot now, as a dict.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self
            .inner
            .snapshot()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        snapshot_dict(py, &s)
    }

    /// Reports `exc` to the agent as this rank's (a `rank.exception` event);
    /// True when the agent accepted it.
    ///
    /// Never raises for agent trouble and takes at most about a second (at
    /// once without an agent); the GIL is released meanwhile. `step`
    /// defaults to the step the client last began. `uncaught=True` says the
    /// process is about to exit of it: the client then leaves the exit for
    /// the agent to see instead of deregistering at close.
    #[pyo3(signature = (exc, *, uncaught=false, step=None))]
    fn report_exception(
        &self,
        py: Python<'_>,
        exc: &Bound<'_, PyAny>,
        uncaught: bool,
        step: Option<u64>,
    ) -> PyResult<bool> {
        if !exc.is_instance_of::<PyBaseException>() {
            return Err(PyTypeError::new_err(format!(
                "report_exception() takes an exception, not {}",
                exc.get_type().name()?
            )));
        }
        let report = if self.inner.is_connected() {
            let (exception_type, message, traceback): (String, String, String) = py
                .import("warden._excepthook")?
                .call_method1("describe", (exc,))?
                .extract()?;
            ExceptionReport {
                exception_type,
                message,
                traceback,
                step,
                uncaught,
            }
        } else {
            // No registration: the report goes nowhere, so the traceback
            // is not formatted (milliseconds for a deep one); the call still
            // records `uncaught` for close.
            ExceptionReport {
                exception_type: "(not described: not registered)".to_owned(),
                uncaught,
                ..ExceptionReport::default()
            }
        };
        Ok(py.detach(|| self.inner.report_exception(&report)).is_ok())
    }

    /// Reports an exception that `warden.run` caught and waits on; returns
    /// the agent's decision as a dict (`restart_in_process`, `seq`, `rule`,
    /// `reason`), or None when the report did not reach the agent (no
    /// registration, no answer within about a second). The GIL is released
    /// meanwhile.
    #[pyo3(signature = (exc, *, step=None))]
    fn _report_for_decision<'py>(
        &self,
        py: Python<'py>,
        exc: &Bound<'py, PyAny>,
        step: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        if !self.inner.is_connected() {
            return Ok(None);
        }
        let (exception_type, message, traceback): (String, String, String) = py
            .import("warden._excepthook")?
            .call_method1("describe", (exc,))?
            .extract()?;
        let report = ExceptionReport {
            exception_type,
            message,
            traceback,
            step,
            uncaught: false,
        };
        let Ok(d) = py.detach(|| self.inner.report_exception_for_decision(&report)) else {
            return Ok(None);
        };
        let out = PyDict::new(py);
        out.set_item("restart_in_process", d.restart_in_process)?;
        out.set_item("seq", d.seq)?;
        out.set_item("rule", d.rule)?;
        out.set_item("reason", d.reason)?;
        Ok(Some(out))
    }

    /// Makes a restart request pending as if the agent had sent it (for
    /// tests and restart drills without an agent): `warden.run` raises
    /// `RestartRequested` in its training function. False when `seq` was
    /// seen already.
    #[pyo3(signature = (seq, restart_count=1, reason=String::new(), incident_id=String::new()))]
    fn inject_restart(
        &self,
        seq: u64,
        restart_count: u32,
        reason: String,
        incident_id: String,
    ) -> PyResult<bool> {
        if seq == 0 {
            return Err(PyValueError::new_err("seq must not be 0"));
        }
        Ok(self.inner.inject_restart(warden_client::RestartRequest {
            seq,
            restart_count,
            incident_id,
            reason,
            via: warden_client::RestartVia::Injected,
        }))
    }

    /// The notice of a coming stop the agent set in this rank's slot, as
    /// `(source, deadline_unix_s, save_at_step)` (deadline 0: not said), or
    /// None: two atomic loads, cheap at every step boundary.
    fn notice(&self) -> Option<(&'static str, u32, u64)> {
        self.inner
            .notice()
            .map(|(n, step)| (n.source_name(), n.deadline_unix_s, step))
    }

    /// The restart request waiting for an acknowledgement, as a dict, or None.
    fn restart_pending<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(r) = self.inner.restart_pending() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("seq", r.seq)?;
        d.set_item("restart_count", r.restart_count)?;
        d.set_item("reason", r.reason)?;
        d.set_item("incident_id", r.incident_id)?;
        Ok(Some(d))
    }

    /// Deregisters from the agent; the client stays usable, disconnected.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> bool {
        py.detach(|| self.inner.close());
        false
    }

    fn __repr__(&self) -> String {
        let o = self.inner.options();
        format!(
            "<warden.Client job={:?} rank={}/{} connected={}>",
            o.job_id,
            o.global_rank,
            o.world_size,
            if self.inner.is_connected() {
                "True"
            } else {
                "False"
            }
        )
    }
}

fn snapshot_dict<'py>(py: Python<'py>, s: &SlotSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("heartbeats", s.heartbeats)?;
    d.set_item("step", s.step)?;
    d.set_item("step_open", s.step_open)?;
    d.set_item("steps_completed", s.steps_completed)?;
    d.set_item("depth", s.depth)?;
    d.set_item("misuse", s.misuse)?;
    let open = PyList::empty(py);
    for o in &s.open_sections {
        open.append((s.section_name(o.id), o.entered_ns))?;
    }
    d.set_item("open_sections", open)?;
    let steps = PyList::empty(py);
    for r in &s.recent_steps {
        let rd = PyDict::new(py);
        rd.set_item("step", r.step)?;
        rd.set_item("start_ns", r.start_ns)?;
        rd.set_item("duration_ns", r.duration_ns)?;
        let secs = PyDict::new(py);
        for t in &r.sections {
            secs.set_item(s.section_name(t.id), t.total_ns)?;
        }
        rd.set_item("sections", secs)?;
        rd.set_item("loss", r.loss)?;
        rd.set_item("grad_norm", r.grad_norm)?;
        steps.append(rd)?;
    }
    d.set_item("recent_steps", steps)?;
    Ok(d)
}

#[pymethods]
impl Section {
    fn __enter__(&self) {
        self.client.get().inner.section_open(self.id);
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.client.get().inner.section_close(self.id);
        false
    }

    /// Decorator form: `@warden.section("forward")` (sync and async functions).
    fn __call__(slf: &Bound<'_, Self>, func: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let decorate = py.import("warden")?.getattr("_decorate")?;
        Ok(decorate.call1((slf, func))?.unbind())
    }

    /// The section's id in the slot.
    #[getter]
    fn id(&self) -> u32 {
        self.id.get()
    }

    /// The section's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    fn __repr__(&self) -> String {
        format!("<warden.Section {:?} id={}>", self.name, self.id.get())
    }
}

#[pymethods]
impl Step {
    fn __enter__(&self) {
        self.client.get().inner.step_begin(self.step);
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.client.get().inner.step_end(self.step);
        false
    }

    fn __repr__(&self) -> String {
        format!("<warden.Step {}>", self.step)
    }
}

/// Connects with explicit settings; `None` means "from the environment".
///
/// Never raises because the agent is absent (the client retries in the
/// background); raises `ValueError` only for invalid arguments.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (job_id=None, global_rank=None, local_rank=None, world_size=None, socket_path=None, connect_timeout=None, devices=None, exception_report_timeout=None))]
fn connect(
    py: Python<'_>,
    job_id: Option<String>,
    global_rank: Option<u32>,
    local_rank: Option<u32>,
    world_size: Option<u32>,
    socket_path: Option<PathBuf>,
    connect_timeout: Option<f64>,
    devices: Option<Vec<String>>,
    exception_report_timeout: Option<f64>,
) -> PyResult<Client> {
    let mut o = options_from_env();
    if let Some(j) = job_id {
        o.job_id = j;
    }
    if let Some(r) = global_rank {
        o.global_rank = r;
        if local_rank.is_none() && std::env::var_os("LOCAL_RANK").is_none() {
            o.local_rank = r;
        }
        if world_size.is_none() && std::env::var_os("WORLD_SIZE").is_none() {
            o.world_size = o.world_size.max(r.saturating_add(1));
        }
    }
    if let Some(r) = local_rank {
        o.local_rank = r;
    }
    if let Some(w) = world_size {
        o.world_size = w;
    }
    if let Some(p) = socket_path {
        o.socket_path = p;
    }
    if let Some(t) = connect_timeout {
        o.connect_timeout = Duration::try_from_secs_f64(t)
            .map_err(|_| PyValueError::new_err(format!("connect_timeout={t} is not a duration")))?;
    }
    if let Some(d) = devices {
        o.devices = d;
    } else if local_rank.is_some() || global_rank.is_some() {
        // The environment's device for the local rank given here.
        o.devices = warden_client::devices_from_env(
            std::env::var("WARDEN_DEVICES").ok().as_deref(),
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            o.local_rank,
        );
    }
    if let Some(t) = exception_report_timeout {
        o.exception_report_timeout = Duration::try_from_secs_f64(t).map_err(|_| {
            PyValueError::new_err(format!("exception_report_timeout={t} is not a duration"))
        })?;
    }
    let inner = py
        .detach(|| warden_client::Client::connect_with(o))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(Client::new(py, inner))
}

/// The module-level client (created from the environment on first use).
#[pyfunction]
fn default_client(py: Python<'_>) -> PyResult<Py<Client>> {
    Ok(default_ref(py)?.clone_ref(py))
}

/// The default client if one was created, without creating it.
#[pyfunction]
fn _default_client_if_any(py: Python<'_>) -> Option<Py<Client>> {
    DEFAULT.get(py).map(|c| c.clone_ref(py))
}

/// Says "still alive" on the default client.
#[pyfunction]
fn heartbeat(py: Python<'_>) -> PyResult<()> {
    default_ref(py)?.get().inner.heartbeat();
    Ok(())
}

/// Starts step `step` on the default client.
#[pyfunction]
fn step_begin(py: Python<'_>, step: u64) -> PyResult<()> {
    default_ref(py)?.get().inner.step_begin(step);
    Ok(())
}

/// Ends the open step on the default client.
#[pyfunction]
fn step_end(py: Python<'_>, step: u64) -> PyResult<()> {
    default_ref(py)?.get().inner.step_end(step);
    Ok(())
}

/// Reports this step's loss and gradient norm on the default client.
#[pyfunction]
#[pyo3(signature = (loss=None, grad_norm=None))]
fn report_values(py: Python<'_>, loss: Option<f64>, grad_norm: Option<f64>) -> PyResult<()> {
    default_ref(py)?.get().inner.report_values(loss, grad_norm);
    Ok(())
}

/// A section of the default client: `with warden.section("forward"):` or a decorator.
#[pyfunction]
fn section(py: Python<'_>, name: &Bound<'_, PyString>) -> PyResult<Py<Section>> {
    section_of(default_ref(py)?.bind(py), name)
}

/// A step context manager on the default client: `with warden.step(n):`.
#[pyfunction]
fn step(py: Python<'_>, step: u64) -> PyResult<Step> {
    Ok(Step {
        client: default_ref(py)?.clone_ref(py),
        step,
    })
}

/// Whether the default client currently reaches an agent.
#[pyfunction]
fn is_connected(py: Python<'_>) -> PyResult<bool> {
    Ok(default_ref(py)?.get().inner.is_connected())
}

/// The default client's notice of a coming stop ([`Client::notice`]).
#[pyfunction]
fn notice(py: Python<'_>) -> PyResult<Option<(&'static str, u32, u64)>> {
    Ok(default_ref(py)?.get().notice())
}

/// Deregisters the default client if one was created (registered with `atexit`).
#[pyfunction]
fn _close_default(py: Python<'_>) {
    if let Some(c) = DEFAULT.get(py) {
        let c = c.clone_ref(py);
        py.detach(|| c.get().inner.close());
    }
}

/// The `warden._native` module.
#[pymodule]
#[pyo3(name = "_native")]
fn warden_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Section>()?;
    m.add_class::<Step>()?;
    m.add_function(wrap_pyfunction!(connect, m)?)?;
    m.add_function(wrap_pyfunction!(_set_stack_dump_signal, m)?)?;
    m.add_function(wrap_pyfunction!(_default_client_if_any, m)?)?;
    m.add_function(wrap_pyfunction!(default_client, m)?)?;
    m.add_function(wrap_pyfunction!(heartbeat, m)?)?;
    m.add_function(wrap_pyfunction!(step_begin, m)?)?;
    m.add_function(wrap_pyfunction!(step_end, m)?)?;
    m.add_function(wrap_pyfunction!(report_values, m)?)?;
    m.add_function(wrap_pyfunction!(section, m)?)?;
    m.add_function(wrap_pyfunction!(step, m)?)?;
    m.add_function(wrap_pyfunction!(is_connected, m)?)?;
    m.add_function(wrap_pyfunction!(notice, m)?)?;
    m.add_function(wrap_pyfunction!(_close_default, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_set_exception, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_set_abort, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_set_signal, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_pending, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_pending_caught, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_raised, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_should_raise, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_ack, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_call, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_deliveries, m)?)?;
    m.add_function(wrap_pyfunction!(restart::_restart_joined_early, m)?)?;
    m.add_function(wrap_pyfunction!(flight::_flight_recorder_set_hook, m)?)?;
    checkpoint::register(m)?;
    m.add_function(wrap_pyfunction!(copy::_copy_regions, m)?)?;
    m.add("SLOT_LAYOUT_VERSION", warden_client::slot::LAYOUT_VERSION)?;
    Ok(())
}
