//! The event bus: every decision and observation worth telling someone.
//!
//! In: [`Signal`]s from any part of the agent (a [`NewEvent`] is a
//! [`Signal::Notice`]), rendered once by [`Signal::render`]. Out: a
//! bounded ring of [`Event`]s, each with its typed signal beside its
//! rendering (consumers match on the signal, watchers read the rest), for
//! ListEvents and for watchers that resume after an id, a broadcast for live
//! watchers, one tracing line and one counter increment per event (so logs
//! and metrics never disagree). Never blocks: a slow watcher loses its place
//! in the broadcast and catches up from the ring, or learns what it missed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::broadcast;

pub mod health_reporter;

pub use crate::signal::Signal;
pub use crate::signal::notice::{NewEvent, Severity};

/// A published event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Strictly increasing id (see [`EventBus::new`] for why it starts where it does).
    pub id: u64,
    /// When it was published.
    pub time: SystemTime,
    /// How bad.
    pub severity: Severity,
    /// Dotted kind.
    pub kind: &'static str,
    /// Subject.
    pub subject: String,
    /// Message.
    pub message: String,
    /// Evidence.
    pub evidence: Vec<(String, String)>,
    /// What the producer said, typed: the parts of the agent that act on
    /// events (attribution, goodput) read this, never the strings above,
    /// which [`Signal::render`] made from it.
    pub signal: Signal,
}

impl Event {
    /// An event stamped with `id` and `time`, its wire fields rendered
    /// from `signal` (the bus's one way to make one; replays use it too).
    pub fn new(id: u64, time: SystemTime, signal: Signal) -> Self {
        let new = signal.render();
        Self {
            id,
            time,
            severity: new.severity,
            kind: new.kind,
            subject: new.subject,
            message: new.message,
            evidence: new.evidence,
            signal,
        }
    }
}

struct Ring {
    events: VecDeque<Arc<Event>>,
    next_id: u64,
    /// Highest id dropped from the ring (0: nothing dropped yet).
    dropped_up_to: u64,
}

/// The agent's event bus.
pub struct EventBus {
    ring: Mutex<Ring>,
    retain: usize,
    live: broadcast::Sender<Arc<Event>>,
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("retain", &self.retain)
            .finish_non_exhaustive()
    }
}

/// A subscription: the backlog to send first, then the live receiver.
#[derive(Debug)]
pub struct Subscription {
    /// Retained events after the requested id, oldest first.
    pub backlog: Vec<Arc<Event>>,
    /// Events published after the backlog was taken; no gap, no duplicate.
    pub live: broadcast::Receiver<Arc<Event>>,
    /// True when events after the requested id were already dropped.
    pub missed: bool,
}

impl EventBus {
    /// A bus keeping the last `retain` events.
    ///
    /// The first id is the start time in microseconds since the epoch, so
    /// ids keep increasing across agent restarts and a watcher that resumes
    /// with an id from a previous agent gets everything the new one has.
    pub fn new(retain: usize) -> Self {
        let start_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX / 2))
            .unwrap_or(1);
        let (live, _) = broadcast::channel(1024);
        Self {
            ring: Mutex::new(Ring {
                events: VecDeque::with_capacity(retain.min(4096)),
                next_id: start_us.max(1),
                dropped_up_to: 0,
            }),
            retain: retain.max(1),
            live,
        }
    }

    /// Publishes a signal: renders it, logs it, counts it, keeps it,
    /// sends it live.
    pub fn publish(&self, signal: impl Into<Signal>) -> Arc<Event> {
        let signal = signal.into();
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let event = Arc::new(Event::new(ring.next_id, SystemTime::now(), signal));
        ring.next_id += 1;
        if ring.events.len() == self.retain
            && let Some(old) = ring.events.pop_front()
        {
            ring.dropped_up_to = old.id;
        }
        ring.events.push_back(event.clone());
        // Sent under the lock so live order equals id order and a subscriber
        // taking its backlog under the same lock sees no gap or duplicate.
        let _ = self.live.send(event.clone());
        drop(ring);
        log_event(&event);
        metrics::counter!("warden_events_total", "kind" => event.kind, "severity" => event.severity.as_str())
            .increment(1);
        event
    }

    /// Retained events with an id above `after_id`, at most `limit` of the
    /// newest (0: all), and the highest dropped id.
    pub fn list(&self, after_id: u64, limit: usize) -> (Vec<Arc<Event>>, u64) {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<Arc<Event>> = ring
            .events
            .iter()
            .filter(|e| e.id > after_id)
            .cloned()
            .collect();
        if limit > 0 && out.len() > limit {
            out.drain(..out.len() - limit);
        }
        (out, ring.dropped_up_to)
    }

    /// Subscribes; with `after_id`, the retained events after it come first.
    pub fn subscribe(&self, after_id: Option<u64>) -> Subscription {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let live = self.live.subscribe();
        let (backlog, missed) = match after_id {
            None => (Vec::new(), false),
            Some(after) => (
                ring.events
                    .iter()
                    .filter(|e| e.id > after)
                    .cloned()
                    .collect(),
                ring.dropped_up_to > after,
            ),
        };
        Subscription {
            backlog,
            live,
            missed,
        }
    }
}

fn log_event(e: &Event) {
    let evidence = e
        .evidence
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    match e.severity {
        Severity::Info => {
            tracing::info!(id = e.id, kind = e.kind, subject = %e.subject, %evidence, "{}", e.message)
        }
        Severity::Warning => {
            tracing::warn!(id = e.id, kind = e.kind, subject = %e.subject, %evidence, "{}", e.message)
        }
        Severity::Error | Severity::Critical => {
            tracing::error!(id = e.id, kind = e.kind, subject = %e.subject, severity = e.severity.as_str(), %evidence, "{}", e.message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(n: u32) -> NewEvent {
        NewEvent::new(Severity::Info, "test.event", "t", format!("event {n}"))
    }

    #[test]
    fn ids_increase_and_ring_drops_oldest() {
        let bus = EventBus::new(3);
        let ids: Vec<u64> = (0..5).map(|n| bus.publish(ev(n)).id).collect();
        assert!(ids.windows(2).all(|w| w[1] == w[0] + 1));
        let (kept, dropped) = bus.list(0, 0);
        assert_eq!(kept.len(), 3);
        assert_eq!(kept[0].id, ids[2]);
        assert_eq!(dropped, ids[1]);
    }

    #[test]
    fn list_after_and_limit() {
        let bus = EventBus::new(10);
        let ids: Vec<u64> = (0..5).map(|n| bus.publish(ev(n)).id).collect();
        let (after, _) = bus.list(ids[2], 0);
        assert_eq!(
            after.iter().map(|e| e.id).collect::<Vec<_>>(),
            ids[3..].to_vec()
        );
        let (newest, _) = bus.list(0, 2);
        assert_eq!(
            newest.iter().map(|e| e.id).collect::<Vec<_>>(),
            ids[3..].to_vec()
        );
    }

    #[tokio::test]
    async fn subscribe_after_has_no_gap_and_no_duplicate() {
        let bus = EventBus::new(10);
        let first = bus.publish(ev(0)).id;
        bus.publish(ev(1));
        let mut sub = bus.subscribe(Some(first));
        let next = bus.publish(ev(2)).id;
        assert_eq!(sub.backlog.len(), 1);
        assert_eq!(sub.backlog[0].id, first + 1);
        assert_eq!(sub.live.recv().await.unwrap().id, next);
        assert!(!sub.missed);
    }

    #[test]
    fn subscribe_reports_missed_events() {
        let bus = EventBus::new(2);
        let first = bus.publish(ev(0)).id;
        for n in 1..5 {
            bus.publish(ev(n));
        }
        assert!(bus.subscribe(Some(first)).missed);
    }
}
