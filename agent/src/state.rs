//! The state every part of the running agent shares.

use std::sync::{Mutex, PoisonError};
use std::time::{Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::events::{EventBus, NewEvent, Severity};
use crate::health::{ComponentReport, HealthModel, Status};

/// Shared by the API, the work loop and the sources (behind an `Arc`).
#[derive(Debug)]
pub struct AgentState {
    /// The validated configuration in force.
    pub config: Config,
    /// Where it came from: a path or "embedded defaults".
    pub config_source: String,
    /// The node name reported everywhere.
    pub host: String,
    /// Wall-clock start, reported in GetAgentInfo.
    pub started_at: SystemTime,
    /// Monotonic start, for uptime.
    pub started: Instant,
    /// Node health.
    pub health: HealthModel,
    /// Event bus.
    pub events: EventBus,
    /// Where the agent listens, filled in as listeners bind: (kind, address).
    endpoints: Mutex<Vec<(String, String)>>,
    /// Cancelled when the agent shuts down; every task and stream watches it.
    pub shutdown: CancellationToken,
}

impl AgentState {
    /// State for an agent about to start.
    pub fn new(config: Config, config_source: String) -> Self {
        let host = config.host_name();
        let events = EventBus::new(config.events.retain);
        Self {
            config,
            config_source,
            host,
            started_at: SystemTime::now(),
            started: Instant::now(),
            health: HealthModel::new(),
            events,
            endpoints: Mutex::new(Vec::new()),
            shutdown: CancellationToken::new(),
        }
    }

    /// Records a listening endpoint.
    pub fn add_endpoint(&self, kind: &str, address: String) {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((kind.to_owned(), address));
    }

    /// The endpoints recorded so far.
    pub fn endpoints(&self) -> Vec<(String, String)> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Applies a source's report and publishes a `health.changed` event when
    /// a component's status moved. Returns true on a status change.
    pub fn apply_report(&self, report: ComponentReport) -> bool {
        let Some(change) = self.health.report(report, SystemTime::now()) else {
            return false;
        };
        // A component appearing healthy is routine; anything else is news.
        if change.from.is_none() && change.to == Status::Ok {
            return true;
        }
        let severity = match change.to {
            Status::Ok | Status::Unknown => Severity::Info,
            Status::Degraded => Severity::Warning,
            Status::Failed => Severity::Error,
        };
        let from = change.from.map_or("NEW", |s| s.as_str());
        let mut event = NewEvent::new(
            severity,
            "health.changed",
            change.id.clone(),
            match &change.reason {
                Some(r) => format!("{} {from} -> {}: {}", change.id, change.to, r.message),
                None => format!("{} {from} -> {}", change.id, change.to),
            },
        )
        .with("from", from)
        .with("to", change.to);
        if let Some(r) = change.reason {
            event = event
                .with("signal", r.signal)
                .with("value", r.value)
                .with("threshold", r.threshold);
            if !r.window.is_empty() {
                event = event.with("window", r.window);
            }
        }
        self.events.publish(event);
        true
    }
}
