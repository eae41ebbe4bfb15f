//! In-process restart requests, as the client sees them.
//!
//! The agent asks a rank to restart in process in two ways at once: it
//! stores a [`ControlWord`](crate::slot::ControlWord) in the rank's slot and
//! pushes a `ControlMessage` on the rank's `Control` stream. The client's
//! background thread reads both (the stream as messages arrive, the slot
//! every [`SLOT_POLL`]) and hands each request to [`RestartState::offer`],
//! which keeps the newest one pending and says whether it is new, so the
//! registered callbacks run once per request whichever path was first.
//!
//! A request stays pending until the training code acknowledges it
//! ([`crate::Client::ack_restart`]): the ack is stored into the slot's ack
//! word at once, and sent as an `AckControl` call by the background thread.
//! The agent takes either. Nothing here raises or blocks training: what to
//! do about a request (the Python package raises `warden.RestartRequested`
//! in the training loop) is the callback's business.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

/// How often the background thread reads the slot's control word while
/// registered: one atomic load, so a request reaches the client within a
/// few milliseconds even when its `Control` stream is down.
pub const SLOT_POLL: Duration = Duration::from_millis(5);

/// How long a request seen in the slot waits for the `Control` stream's
/// copy (which carries the reason and incident) while the stream is open.
/// The agent sends on the stream first; the slot is the fallback.
pub const SLOT_GRACE: Duration = Duration::from_millis(10);

/// How many recent sequence numbers are remembered, so a request seen in
/// the slot and then again on the stream (or replayed when the stream
/// reconnects) is new only once.
const SEEN: usize = 16;

/// Which path brought a request to the client first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartVia {
    /// The `Control` stream (carries the reason and incident).
    Stream,
    /// The slot's control word (sequence number and restart count only).
    Slot,
    /// Put there by the process itself ([`crate::Client::inject_restart`]),
    /// for tests and for drills without an agent.
    Injected,
}

/// A request from the agent to restart the training function in process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartRequest {
    /// The request's sequence number: acknowledge this one.
    pub seq: u64,
    /// The restart count the next attempt runs with (1 for the first
    /// restart of the job on this agent).
    pub restart_count: u32,
    /// The incident that asked for it (empty: asked by hand or by another
    /// host's launcher).
    pub incident_id: String,
    /// Why, for a person (empty when only the slot carried the request
    /// so far).
    pub reason: String,
    /// Which path brought it first.
    pub via: RestartVia,
}

/// A callback run for each new request (on the client's background thread:
/// it must return quickly).
pub type RestartCallback = Arc<dyn Fn(&RestartRequest) + Send + Sync>;

/// The client's restart bookkeeping: the request pending, the callbacks,
/// and acknowledgements not yet sent to the agent.
#[derive(Default)]
pub(crate) struct RestartState {
    inner: Mutex<Inner>,
    /// Woken when an acknowledgement waits to be sent.
    pub(crate) ack_wake: Notify,
}

impl std::fmt::Debug for RestartState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.lock();
        f.debug_struct("RestartState")
            .field("pending", &g.pending)
            .field("seen", &g.seen)
            .field("callbacks", &g.callbacks.len())
            .field("unsent_acks", &g.unsent_acks)
            .finish()
    }
}

#[derive(Default)]
struct Inner {
    /// Sequence numbers seen lately, newest last.
    seen: VecDeque<u64>,
    /// The newest request not yet acknowledged.
    pending: Option<RestartRequest>,
    callbacks: Vec<RestartCallback>,
    /// Acknowledged sequence numbers the background thread is to send.
    unsent_acks: Vec<u64>,
}

impl RestartState {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a request seen on the stream or in the slot. Returns it with
    /// the callbacks to run when it is new; `None` when it was seen before
    /// (a request first seen in the slot gets its reason and incident from
    /// the stream's copy, quietly).
    pub(crate) fn offer(
        &self,
        req: RestartRequest,
    ) -> Option<(RestartRequest, Vec<RestartCallback>)> {
        if req.seq == 0 {
            return None;
        }
        let mut g = self.lock();
        if g.seen.contains(&req.seq) {
            if let Some(p) = g.pending.as_mut().filter(|p| p.seq == req.seq) {
                if p.reason.is_empty() {
                    p.reason = req.reason;
                }
                if p.incident_id.is_empty() {
                    p.incident_id = req.incident_id;
                }
            }
            return None;
        }
        if g.seen.len() == SEEN {
            g.seen.pop_front();
        }
        g.seen.push_back(req.seq);
        g.pending = Some(req.clone());
        Some((req, g.callbacks.clone()))
    }

    /// The request pending, if any.
    pub(crate) fn pending(&self) -> Option<RestartRequest> {
        self.lock().pending.clone()
    }

    /// Acknowledges `seq` if it is the pending request: clears it and
    /// queues the `AckControl` call. False when `seq` is not pending (already
    /// acknowledged, superseded by a newer request, or never seen).
    pub(crate) fn ack(&self, seq: u64) -> bool {
        let mut g = self.lock();
        if g.pending.as_ref().is_none_or(|p| p.seq != seq) {
            return false;
        }
        g.pending = None;
        if g.unsent_acks.len() < SEEN {
            g.unsent_acks.push(seq);
        }
        drop(g);
        self.ack_wake.notify_one();
        true
    }

    /// The acknowledgements to send now.
    pub(crate) fn take_acks(&self) -> Vec<u64> {
        std::mem::take(&mut self.lock().unsent_acks)
    }

    /// Adds a callback; returns the pending request, which the caller
    /// hands to it at once (a callback registered late misses nothing).
    pub(crate) fn add_callback(&self, cb: RestartCallback) -> Option<RestartRequest> {
        let mut g = self.lock();
        g.callbacks.push(cb);
        g.pending.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn req(seq: u64, count: u32, reason: &str, via: RestartVia) -> RestartRequest {
        RestartRequest {
            seq,
            restart_count: count,
            incident_id: String::new(),
            reason: reason.into(),
            via,
        }
    }

    #[test]
    fn a_request_is_new_once_whichever_path_brings_it() {
        let s = RestartState::default();
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        assert!(
            s.add_callback(Arc::new(move |_| {
                c.fetch_add(1, Ordering::Relaxed);
            }))
            .is_none()
        );
        let (r, cbs) = s.offer(req(7, 1, "", RestartVia::Slot)).unwrap();
        for cb in &cbs {
            cb(&r);
        }
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        // The stream's copy of the same request: not new, fills in the reason.
        assert!(
            s.offer(req(7, 1, "rank 1 hung", RestartVia::Stream))
                .is_none()
        );
        let p = s.pending().unwrap();
        assert_eq!(
            (p.seq, p.reason.as_str(), p.via),
            (7, "rank 1 hung", RestartVia::Slot)
        );
        assert!(
            s.offer(req(0, 1, "", RestartVia::Slot)).is_none(),
            "0 is no request"
        );
    }

    #[test]
    fn ack_clears_only_the_pending_request_and_queues_the_call() {
        let s = RestartState::default();
        s.offer(req(7, 1, "", RestartVia::Stream)).unwrap();
        assert!(!s.ack(6), "not pending");
        // A newer request supersedes the pending one.
        s.offer(req(8, 2, "", RestartVia::Stream)).unwrap();
        assert!(!s.ack(7));
        assert!(s.ack(8));
        assert!(s.pending().is_none());
        assert!(!s.ack(8), "acknowledged once");
        assert_eq!(s.take_acks(), vec![8]);
        assert!(s.take_acks().is_empty());
        // A late replay of an older request is not new again.
        assert!(s.offer(req(7, 1, "", RestartVia::Stream)).is_none());
        assert!(s.pending().is_none());
    }

    #[test]
    fn a_late_callback_gets_the_pending_request() {
        let s = RestartState::default();
        s.offer(req(3, 1, "", RestartVia::Injected)).unwrap();
        let p = s.add_callback(Arc::new(|_| {})).unwrap();
        assert_eq!(p.seq, 3);
    }
}
