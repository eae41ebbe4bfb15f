//! Fork safety: a forked child (a data-loader worker) must not write into
//! its parent's slot, so after `fork` every live client in the child moves
//! to its private slot.
//!
//! Why a fixed table of atomics: the child handler runs in a process with a
//! single thread where any lock may have been held at fork time, so it may
//! only do atomic loads and stores.
//!
//! In: the live clients ([`track`], [`forget`]). Out: in a forked child,
//! each one disconnected and on its private slot. Never: a lock or an
//! allocation in the child's handler.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Inner;
use std::sync::Once;
use std::sync::atomic::AtomicPtr;

const LIVE_MAX: usize = 64;
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: AtomicPtr<Inner> = AtomicPtr::new(std::ptr::null_mut());
static LIVE: [AtomicPtr<Inner>; LIVE_MAX] = [EMPTY; LIVE_MAX];
static INSTALL: Once = Once::new();

/// Registers a client (past `LIVE_MAX` clients, extra ones are not covered).
pub(super) fn track(inner: &Arc<Inner>) {
    INSTALL.call_once(|| {
        // SAFETY: registering a handler with no preconditions; the handler
        // only touches atomics (see `after_fork_in_child`).
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    let p = Arc::as_ptr(inner).cast_mut();
    for entry in &LIVE {
        if entry
            .compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

/// Unregisters a client before it is freed.
pub(super) fn forget(inner: &Arc<Inner>) {
    let p = Arc::as_ptr(inner).cast_mut();
    for entry in &LIVE {
        if entry
            .compare_exchange(p, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

extern "C" fn after_fork_in_child() {
    for entry in &LIVE {
        let p = entry.load(Ordering::Acquire);
        // SAFETY: entries are removed before their Inner is freed, and the
        // child has a single thread, so a non-null entry is a live Inner.
        if let Some(inner) = unsafe { p.as_ref() } {
            inner.connected.store(false, Ordering::Release);
            inner.current.store(inner.dummy_ptr(), Ordering::Release);
        }
    }
}
