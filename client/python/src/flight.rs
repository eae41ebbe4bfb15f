//! Flight-recorder dumps in Python: the agent's request, handed to the hook
//! `warden._torch` registers at import (`dump_flight_recorder(seq, path)`),
//! which calls torch and writes the file.
//!
//! The Rust client runs [`deliver`] on a thread of its own, one request at
//! a time: waiting here for a GIL the training thread never releases stalls
//! only this thread, and the agent's bounded wait reports no dump.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use warden_client::FlightRecorderDump;

/// `warden._torch.dump_flight_recorder` (registered at import).
static HOOK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Calls the hook with the request's seq and path; an exception it raises
/// is printed (the agent then sees no file in time and says so).
pub fn deliver(req: &FlightRecorderDump) {
    let path = req.path.display().to_string();
    Python::attach(|py| {
        if let Some(hook) = HOOK.get(py)
            && let Err(e) = hook.bind(py).call1((req.seq, path))
        {
            e.print(py);
        }
    });
}

/// Registers the hook that writes a flight-recorder dump (at import).
#[pyfunction]
pub fn _flight_recorder_set_hook(py: Python<'_>, hook: Bound<'_, PyAny>) -> PyResult<()> {
    let _ = HOOK.set(py, hook.unbind());
    Ok(())
}
