//! Runs each source on its own thread and watches for stalls.
//!
//! A source's `poll` may call into a vendor library that hangs (an NVML
//! call on a GPU falling off the bus, a DCGM host engine that stopped
//! answering). The thread is then stuck, but nothing else is: the work loop
//! calls [`Sources::check_stalls`] every tick, and a source whose last poll
//! began more than `stall_after` ago has its components marked UNKNOWN with
//! "source X stalled" until it comes back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use super::Source;
use tokio_util::sync::CancellationToken;
use warden_core::events::health_reporter::Reporter;
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};

/// What the runner knows about one source.
#[derive(Debug)]
struct Tracked {
    interval: Duration,
    /// When the current poll began (None between polls).
    polling_since: Option<Instant>,
    /// The components the source reported, with their kinds, so they can be
    /// marked UNKNOWN if it stalls.
    components: BTreeMap<String, String>,
    stalled: bool,
}

/// The running sources.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    tracked: Arc<Mutex<BTreeMap<&'static str, Tracked>>>,
}

impl Sources {
    /// Starts `source` on a thread of its own.
    pub fn spawn(
        &self,
        health: Reporter,
        shutdown: CancellationToken,
        mut source: Box<dyn Source>,
    ) -> std::io::Result<()> {
        let name = source.name();
        let interval = source.interval();
        self.lock().insert(
            name,
            Tracked {
                interval,
                polling_since: None,
                components: BTreeMap::new(),
                stalled: false,
            },
        );
        let tracked = self.tracked.clone();
        std::thread::Builder::new()
            .name(format!("source-{name}"))
            .spawn(move || {
                let mut next = Instant::now();
                while !shutdown.is_cancelled() {
                    set_polling(&tracked, name, Some(Instant::now()));
                    let poll = source.poll(SystemTime::now());
                    {
                        let mut t = tracked.lock().unwrap_or_else(PoisonError::into_inner);
                        if let Some(t) = t.get_mut(name) {
                            t.polling_since = None;
                            for r in &poll.reports {
                                t.components.insert(r.id.clone(), r.kind.clone());
                            }
                            if t.stalled {
                                t.stalled = false;
                                health.events.publish(NewEvent::new(
                                    Severity::Info,
                                    "source.recovered",
                                    name,
                                    format!("source {name} answers again"),
                                ));
                            }
                        }
                    }
                    for r in poll.reports {
                        health.apply_from(name, r);
                    }
                    for e in poll.events {
                        health.events.publish(e);
                    }
                    next += interval;
                    let now = Instant::now();
                    if next < now {
                        next = now;
                    }
                    // Sleep in short steps so shutdown is prompt.
                    while Instant::now() < next && !shutdown.is_cancelled() {
                        std::thread::sleep((next - Instant::now()).min(Duration::from_millis(100)));
                    }
                }
            })?;
        Ok(())
    }

    /// Marks the components of sources stuck in a poll for longer than
    /// `max(stall_after, 2 x interval)` UNKNOWN; called on every tick.
    pub fn check_stalls(&self, health: &Reporter, stall_after: Duration) {
        let mut stalled_now = Vec::new();
        {
            let mut t = self.lock();
            for (name, s) in t.iter_mut() {
                let limit = stall_after.max(s.interval * 2);
                if let Some(since) = s.polling_since
                    && !s.stalled
                    && since.elapsed() > limit
                {
                    s.stalled = true;
                    stalled_now.push((*name, since.elapsed(), limit, s.components.clone()));
                }
            }
        }
        for (name, for_, limit, components) in stalled_now {
            let message = format!(
                "source {name} has been stuck in a call for {}s (limit {}s); its readings are unknown until it answers",
                for_.as_secs(),
                limit.as_secs()
            );
            health.events.publish(
                NewEvent::new(Severity::Error, "source.stalled", name, message.clone())
                    .with("stuck_for", format!("{}s", for_.as_secs()))
                    .with("limit", format!("{}s", limit.as_secs())),
            );
            for (id, kind) in components {
                health.apply_from(
                    name,
                    ComponentReport {
                        id,
                        kind,
                        labels: BTreeMap::new(),
                        status_override: Some(Status::Unknown),
                        reasons: vec![Reason {
                            status: Status::Unknown,
                            kind: ReasonKind::Judged,
                            signal: format!("source.{name}.stalled"),
                            value: format!("{}s", for_.as_secs()),
                            threshold: format!("{}s", limit.as_secs()),
                            window: String::new(),
                            since: SystemTime::now(),
                            message: message.clone(),
                        }],
                    },
                );
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Tracked>> {
        self.tracked.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn set_polling(t: &Mutex<BTreeMap<&'static str, Tracked>>, name: &str, v: Option<Instant>) {
    if let Some(s) = t
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_mut(name)
    {
        s.polling_since = v;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::sources::Poll;
    use warden_core::events::EventBus;
    use warden_core::health::HealthModel;

    /// Reports gpu0 OK, then blocks in its second poll until released.
    struct Stuck {
        polls: u32,
        release: mpsc::Receiver<()>,
    }

    impl Source for Stuck {
        fn name(&self) -> &'static str {
            "stuck"
        }
        fn interval(&self) -> Duration {
            Duration::from_millis(10)
        }
        fn poll(&mut self, _now: SystemTime) -> Poll {
            self.polls += 1;
            if self.polls == 2 {
                let _ = self.release.recv();
            }
            Poll {
                reports: vec![ComponentReport {
                    id: "gpu0".into(),
                    kind: "gpu".into(),
                    labels: BTreeMap::new(),
                    status_override: None,
                    reasons: Vec::new(),
                }],
                events: Vec::new(),
            }
        }
    }

    fn status_of(health: &Reporter, id: &str) -> Option<Status> {
        health
            .model
            .snapshot()
            .components
            .into_iter()
            .find(|c| c.id == id)
            .map(|c| c.status)
    }

    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_source_stuck_in_a_call_is_marked_stalled_and_recovers() {
        let health = Reporter {
            model: Arc::new(HealthModel::new()),
            events: Arc::new(EventBus::new(1000)),
        };
        let shutdown = CancellationToken::new();
        let (tx, rx) = mpsc::channel();
        let sources = Sources::default();
        sources
            .spawn(
                health.clone(),
                shutdown.clone(),
                Box::new(Stuck {
                    polls: 0,
                    release: rx,
                }),
            )
            .unwrap();
        until("gpu0 OK", || status_of(&health, "gpu0") == Some(Status::Ok));
        until("gpu0 UNKNOWN while the source is stuck", || {
            sources.check_stalls(&health, Duration::from_millis(50));
            status_of(&health, "gpu0") == Some(Status::Unknown)
        });
        let snap = health.model.snapshot();
        let gpu = snap.components.iter().find(|c| c.id == "gpu0").unwrap();
        assert_eq!(gpu.reasons[0].signal, "source.stuck.stalled");
        let (events, _) = health.events.list(0, 0);
        assert!(events.iter().any(|e| e.kind == "source.stalled"));
        tx.send(()).unwrap();
        until("gpu0 OK again", || {
            status_of(&health, "gpu0") == Some(Status::Ok)
        });
        until("source.recovered", || {
            health
                .events
                .list(0, 0)
                .0
                .iter()
                .any(|e| e.kind == "source.recovered")
        });
        shutdown.cancel();
    }
}
