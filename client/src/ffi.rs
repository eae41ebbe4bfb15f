//! The C ABI (see `include/warden.h`): opaque handle, never fails for agent trouble.
//!
//! Why a C ABI: C++ training code and other runtimes link the same client.
//! Every function accepts a NULL handle as a no-op, so a caller that got
//! NULL (only on invalid arguments) keeps running. Nothing here can panic:
//! all inputs are checked and the client never raises.

use std::ffi::{CStr, c_char};

use crate::client::{Client, ConnectOptions, SectionId};
use crate::report::ExceptionReport;

/// Opaque handle handed to C (`warden_client*`).
#[derive(Debug)]
pub struct WardenClient {
    client: Client,
}

/// Reads an optional C string; `Err` when it is not UTF-8.
///
/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
unsafe fn opt_str<'a>(p: *const c_char) -> Result<Option<&'a str>, ()> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller promises a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(Some).map_err(|_| ())
}

/// Connects to the local agent (or starts in retrying mode when it is absent).
///
/// `job_id` may be NULL (environment); a negative rank or world size means
/// "from the environment". Returns NULL only for invalid arguments.
///
/// # Safety
/// `job_id` is NULL or a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_connect(
    job_id: *const c_char,
    global_rank: i64,
    local_rank: i64,
    world_size: i64,
) -> *mut WardenClient {
    let mut opts = ConnectOptions::from_env_lossy();
    // SAFETY: forwarded from our caller's contract.
    match unsafe { opt_str(job_id) } {
        Ok(Some(j)) => opts.job_id = j.to_owned(),
        Ok(None) => {}
        Err(()) => return std::ptr::null_mut(),
    }
    let to_u32 = |v: i64| u32::try_from(v).ok();
    if global_rank >= 0 {
        let Some(r) = to_u32(global_rank) else {
            return std::ptr::null_mut();
        };
        opts.global_rank = r;
    }
    if local_rank >= 0 {
        let Some(r) = to_u32(local_rank) else {
            return std::ptr::null_mut();
        };
        opts.local_rank = r;
    }
    if world_size >= 0 {
        let Some(w) = to_u32(world_size) else {
            return std::ptr::null_mut();
        };
        opts.world_size = w;
    }
    match Client::connect_with(opts) {
        Ok(client) => Box::into_raw(Box::new(WardenClient { client })),
        Err(_) => std::ptr::null_mut(),
    }
}

/// Borrows the client behind a handle.
///
/// # Safety
/// `c` is NULL or a live handle from `warden_connect`.
unsafe fn get<'a>(c: *const WardenClient) -> Option<&'a Client> {
    // SAFETY: the caller promises NULL or a live handle.
    unsafe { c.as_ref() }.map(|w| &w.client)
}

/// 1 when heartbeats reach an agent, 0 otherwise (and for NULL).
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_is_connected(c: *const WardenClient) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    i32::from(unsafe { get(c) }.is_some_and(Client::is_connected))
}

/// Says "still alive". Any thread.
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_heartbeat(c: *const WardenClient) {
    // SAFETY: forwarded from our caller's contract.
    if let Some(c) = unsafe { get(c) } {
        c.heartbeat();
    }
}

/// Starts training step `step`.
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_step_begin(c: *const WardenClient, step: u64) {
    // SAFETY: forwarded from our caller's contract.
    if let Some(c) = unsafe { get(c) } {
        c.step_begin(step);
    }
}

/// Ends the open step.
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_step_end(c: *const WardenClient, step: u64) {
    // SAFETY: forwarded from our caller's contract.
    if let Some(c) = unsafe { get(c) } {
        c.step_end(step);
    }
}

/// The id of section `name` (interned once); -1 for NULL or non-UTF-8 input.
///
/// # Safety
/// `c` is NULL or a live handle; `name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_section_id(c: *const WardenClient, name: *const c_char) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    let (Some(c), Ok(Some(name))) = (unsafe { get(c) }, unsafe { opt_str(name) }) else {
        return -1;
    };
    c.section_id(name).get() as i32
}

/// Opens section `id` (negative ids are ignored).
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_section_open(c: *const WardenClient, id: i32) {
    // SAFETY: forwarded from our caller's contract.
    if let (Some(c), Ok(id)) = (unsafe { get(c) }, u32::try_from(id)) {
        c.section_open(SectionId::from_raw(id));
    }
}

/// Closes section `id` and any section opened inside it.
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_section_close(c: *const WardenClient, id: i32) {
    // SAFETY: forwarded from our caller's contract.
    if let (Some(c), Ok(id)) = (unsafe { get(c) }, u32::try_from(id)) {
        c.section_close(SectionId::from_raw(id));
    }
}

/// `present` bit: `loss` holds this step's loss.
pub const WARDEN_VALUE_LOSS: u32 = 1;
/// `present` bit: `grad_norm` holds this step's gradient norm.
pub const WARDEN_VALUE_GRAD_NORM: u32 = 2;

/// Reports the step's loss and gradient norm; `present` says which of the
/// two are given ([`WARDEN_VALUE_LOSS`], [`WARDEN_VALUE_GRAD_NORM`]), since
/// a NaN is a value the agent must see, not "absent".
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_report_values(
    c: *const WardenClient,
    loss: f64,
    grad_norm: f64,
    present: u32,
) {
    // SAFETY: forwarded from our caller's contract.
    if let Some(c) = unsafe { get(c) } {
        c.report_values(
            (present & WARDEN_VALUE_LOSS != 0).then_some(loss),
            (present & WARDEN_VALUE_GRAD_NORM != 0).then_some(grad_norm),
        );
    }
}

/// Reads a C string that may be NULL or hold bytes that are not UTF-8 (a
/// message quoting a path): NULL is "", bad bytes become U+FFFD.
///
/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
unsafe fn lossy_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller promises a valid NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Reports an exception to the agent (see [`Client::report_exception`]):
/// 0 when the agent accepted it, -1 otherwise (NULL client or type, empty
/// type, no agent, the agent's error, the deadline). Bounded: about a second
/// at most (`exception_report_timeout`), at once without an agent.
///
/// `message` and `traceback` may be NULL (""); a negative `step` means the
/// step the client's slot holds; `uncaught` non-zero: the process is about
/// to exit of it (the client then leaves its registration for the agent to
/// see the exit, instead of deregistering at `warden_close`).
///
/// # Safety
/// `c` is NULL or a live handle; the strings are NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_report_exception(
    c: *const WardenClient,
    exception_type: *const c_char,
    message: *const c_char,
    traceback: *const c_char,
    step: i64,
    uncaught: i32,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    let Some(client) = (unsafe { get(c) }) else {
        return -1;
    };
    if exception_type.is_null() {
        return -1;
    }
    // SAFETY: forwarded from our caller's contract (each string).
    let report = unsafe {
        ExceptionReport {
            exception_type: lossy_str(exception_type),
            message: lossy_str(message),
            traceback: lossy_str(traceback),
            step: u64::try_from(step).ok(),
            uncaught: uncaught != 0,
        }
    };
    match client.report_exception(&report) {
        Ok(()) => 0,
        Err(_) => -1,
    }
}

/// Whether an in-process restart request waits for an acknowledgement: 1
/// (and `*seq`, `*restart_count` set, each when not NULL), else 0 (and for
/// a NULL client).
///
/// Why polled: a C or C++ training loop checks it between steps (one
/// mutex, no syscall), stops the attempt, restores from its checkpoint,
/// calls [`warden_ack_restart`] and runs again.
///
/// # Safety
/// `c` is NULL or a live handle; `seq` and `restart_count` are NULL or
/// valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_restart_pending(
    c: *const WardenClient,
    seq: *mut u64,
    restart_count: *mut u32,
) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    let Some(req) = (unsafe { get(c) }).and_then(Client::restart_pending) else {
        return 0;
    };
    // SAFETY: the caller promises NULL or pointers valid for writes.
    unsafe {
        if let Some(s) = seq.as_mut() {
            *s = req.seq;
        }
        if let Some(n) = restart_count.as_mut() {
            *n = req.restart_count;
        }
    }
    1
}

/// Acknowledges restart request `seq` (the training function is running
/// again): 0 when it was the pending request, -1 otherwise (NULL client,
/// already acknowledged, superseded by a newer request). Never waits on
/// the agent.
///
/// # Safety
/// `c` is NULL or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_ack_restart(c: *const WardenClient, seq: u64) -> i32 {
    // SAFETY: forwarded from our caller's contract.
    match unsafe { get(c) } {
        Some(client) if client.ack_restart(seq) => 0,
        _ => -1,
    }
}

/// Deregisters and frees the handle; NULL is a no-op. The handle is invalid afterwards.
///
/// # Safety
/// `c` is NULL or a live handle not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warden_close(c: *mut WardenClient) {
    if !c.is_null() {
        // SAFETY: the handle came from Box::into_raw in warden_connect and is
        // given back exactly once.
        drop(unsafe { Box::from_raw(c) });
    }
}
