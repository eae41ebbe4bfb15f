//! The save snapshot's copy of CPU tensors into the saver's buffer, in one
//! call for every tensor and split over a few threads.
//!
//! An async save holds the training step for this copy alone. Done from
//! Python one `memmove` per tensor, a model of many small tensors (a BERT
//! of 1 GiB has about 1,300) paid a call's cost per tensor on top of the
//! bytes, and one core copied while the others, their step held, idled:
//! two threads copied 1 GiB in 66-75 ms where one took 105-114 ms on the
//! 2-core VM of docs/benchmarks.md. Here the regions arrive as one list and
//! are copied with the GIL released, the bytes split evenly over the
//! threads whatever the tensors' sizes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Below this many bytes a thread of its own costs more than it saves (a
/// thread starts in tens of microseconds; 4 MiB copies in about 0.4 ms).
const MIN_BYTES_PER_THREAD: usize = 4 << 20;

/// At most this many threads: memory bandwidth, not cores, bounds a copy,
/// and a few threads reach it on the hosts warden runs on.
const MAX_THREADS: usize = 16;

/// One piece of a copy: `len` bytes from `src` to `dst`, addresses as
/// integers so that the pieces can cross into the copying threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    src: usize,
    dst: usize,
    len: usize,
}

/// Splits `regions` ((source address, offset into the buffer, bytes)) into
/// `threads` runs of (nearly) equal bytes, cutting a region where a run
/// ends, so that one large tensor is shared as evenly as many small ones.
fn plan(base: usize, regions: &[(usize, usize, usize)], threads: usize) -> Vec<Vec<Piece>> {
    let total: usize = regions.iter().map(|r| r.2).sum();
    let threads = threads.max(1);
    let mut runs: Vec<Vec<Piece>> = vec![Vec::new(); threads];
    let mut run = 0;
    // Bytes the current run has taken so far, and its share of the total.
    let mut taken = 0usize;
    let share = |k: usize| total / threads + usize::from(k < total % threads);
    for &(src, off, len) in regions {
        let mut done = 0;
        while done < len {
            while run + 1 < threads && taken >= share(run) {
                run += 1;
                taken = 0;
            }
            let room = if run + 1 < threads {
                share(run) - taken
            } else {
                usize::MAX
            };
            let n = (len - done).min(room);
            runs[run].push(Piece {
                src: src + done,
                dst: base + off + done,
                len: n,
            });
            taken += n;
            done += n;
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

fn copy_run(run: &[Piece]) {
    for p in run {
        // SAFETY: the caller (warden's own snapshot code) passes the data
        // pointers of live, contiguous tensors it keeps alive for the
        // call, each readable for its `nbytes`, and every destination was
        // checked to lie inside the buffer. The sources are the state's
        // tensors, never the saver's own buffer (it is not handed out to be
        // saved), so no thread writes what another reads; `copy` (memmove)
        // keeps even a piece that overlapped itself defined.
        unsafe { std::ptr::copy(p.src as *const u8, p.dst as *mut u8, p.len) };
    }
}

/// Copies each region (source address, offset into the buffer, bytes) into
/// the buffer at `base`, `capacity` bytes long, over at most `threads`
/// threads (fewer where there are too few bytes to share), with the GIL
/// released. For warden's snapshot code only: the sources are the data
/// pointers of tensors the caller holds, as with `ctypes.memmove`. A
/// region that would write past the buffer raises ValueError and nothing
/// is copied.
#[pyfunction]
pub fn _copy_regions(
    py: Python<'_>,
    base: usize,
    capacity: usize,
    regions: Vec<(usize, usize, usize)>,
    threads: usize,
) -> PyResult<()> {
    let mut total = 0usize;
    for (i, &(_, off, len)) in regions.iter().enumerate() {
        // Every region inside the buffer, and their sum checked too: a
        // caller's false sizes are refused, never a panic.
        match (off.checked_add(len), total.checked_add(len)) {
            (Some(end), Some(sum)) if end <= capacity => total = sum,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "copy region {i} ({len} bytes at offset {off}) does not fit the \
                     {capacity}-byte buffer"
                )));
            }
        }
    }
    if base == 0 && total > 0 {
        return Err(PyValueError::new_err("copy into a null buffer"));
    }
    let threads = threads
        .clamp(1, MAX_THREADS)
        .min(total.div_ceil(MIN_BYTES_PER_THREAD))
        .max(1);
    let runs = plan(base, &regions, threads);
    py.detach(|| match runs.as_slice() {
        [] => {}
        [one] => copy_run(one),
        [first, rest @ ..] => std::thread::scope(|s| {
            for run in rest {
                // A thread the system will not give is copied here instead.
                let spawned = std::thread::Builder::new()
                    .name("warden-save-copy".into())
                    .spawn_scoped(s, move || copy_run(run));
                if spawned.is_err() {
                    copy_run(run);
                }
            }
            copy_run(first);
        }),
    });
    Ok(())
}
