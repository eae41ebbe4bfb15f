//! `warden.checkpoint`'s native half: the calls around the Python side's
//! own write of a shard (begin, commit) and restore.
//!
//! Python writes the file itself (`open(path, "wb").write(buffer)` writes
//! straight from any buffer, with the GIL released, and `torch.save` wants
//! a path), so only the two agent calls and the restore cross into Rust.
//! They run with the GIL released. Failures raise
//! `warden.checkpoint.CheckpointError` (`TierFullError` when the tier has no
//! room, even after pruning).

use std::path::PathBuf;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;
use warden_client::{CheckpointError as ClientError, Checkpointer, Staged};

create_exception!(
    _native,
    CheckpointError,
    PyRuntimeError,
    "A checkpoint save or restore failed; the message says why."
);
create_exception!(
    _native,
    TierFullError,
    CheckpointError,
    "The checkpoint tier has no room for the shard, even after pruning old steps."
);

static CHECKPOINTER: PyOnceLock<Checkpointer> = PyOnceLock::new();

fn to_py(e: ClientError) -> PyErr {
    if e.is_full() {
        TierFullError::new_err(e.to_string())
    } else {
        CheckpointError::new_err(e.to_string())
    }
}

fn checkpointer(py: Python<'_>) -> PyResult<&'static Checkpointer> {
    CHECKPOINTER.get_or_try_init(py, || {
        Checkpointer::new(crate::options_from_env()).map_err(to_py)
    })
}

/// Names a staging file for `step`'s shard, room made for `size_hint` bytes:
/// returns (path, token).
#[pyfunction]
pub fn _ckpt_begin(py: Python<'_>, step: u64, size_hint: u64) -> PyResult<(String, String)> {
    let ck = checkpointer(py)?;
    let staged = py.detach(|| ck.begin(step, size_hint)).map_err(to_py)?;
    Ok((staged.path.display().to_string(), staged.token))
}

/// Commits the written staging file; returns the shard's path in the tier.
#[pyfunction]
pub fn _ckpt_commit(
    py: Python<'_>,
    step: u64,
    path: String,
    token: String,
    size: u64,
    stall_s: f64,
) -> PyResult<String> {
    let ck = checkpointer(py)?;
    let staged = Staged {
        path: PathBuf::from(path),
        token,
    };
    let stall = Duration::try_from_secs_f64(stall_s.max(0.0)).unwrap_or_default();
    let done = py
        .detach(|| ck.commit(step, &staged, size, stall))
        .map_err(to_py)?;
    Ok(done.display().to_string())
}

/// Restores `step` (0: the newest complete) of this rank's shard, or of
/// `rank`'s: a dict, or None on a fresh start.
#[pyfunction]
#[pyo3(signature = (step, rank=None))]
pub fn _ckpt_restore(py: Python<'_>, step: u64, rank: Option<u32>) -> PyResult<Option<Py<PyDict>>> {
    let ck = checkpointer(py)?;
    let rank = rank.unwrap_or(ck.options().global_rank);
    let Some(r) = py.detach(|| ck.restore_rank(rank, step)).map_err(to_py)? else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("path", r.path.display().to_string())?;
    d.set_item("size_bytes", r.size_bytes)?;
    d.set_item("tier", r.tier)?;
    d.set_item("source", r.source)?;
    d.set_item("skipped", r.skipped)?;
    Ok(Some(d.unbind()))
}

/// The job, rank and world size the checkpointer saves as.
#[pyfunction]
pub fn _ckpt_identity(py: Python<'_>) -> PyResult<(String, u32, u32)> {
    let o = checkpointer(py)?.options();
    Ok((o.job_id.clone(), o.global_rank, o.world_size))
}

/// Adds the functions and exceptions to `_native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_ckpt_begin, m)?)?;
    m.add_function(wrap_pyfunction!(_ckpt_commit, m)?)?;
    m.add_function(wrap_pyfunction!(_ckpt_restore, m)?)?;
    m.add_function(wrap_pyfunction!(_ckpt_identity, m)?)?;
    m.add("CheckpointError", m.py().get_type::<CheckpointError>())?;
    m.add("TierFullError", m.py().get_type::<TierFullError>())?;
    Ok(())
}
