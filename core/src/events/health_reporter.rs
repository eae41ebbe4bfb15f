//! Applying a source's report to the health model and telling the bus.
//!
//! In: a [`ComponentReport`] from a source (or the agent's own checks).
//! Out: the model updated and, when a component's status moved, one
//! `health.changed` signal on the bus. Never: I/O or blocking; it is the
//! only handle a source needs to speak about the node's health.
//!
//! Here, with the bus, not in `health`: the health model is vocabulary the
//! signals carry, and this handle speaks on the bus; in `health` the two
//! folders imported each other.

use std::sync::Arc;
use std::time::SystemTime;

use super::EventBus;
use crate::health::{ComponentReport, HealthModel, Status};
use crate::signal::{HealthChanged, Signal};

/// The health model and the bus, together: what a source is handed instead
/// of the whole agent state.
#[derive(Debug, Clone)]
pub struct Reporter {
    /// The model reports are applied to.
    pub model: Arc<HealthModel>,
    /// Where status changes are published.
    pub events: Arc<EventBus>,
}

impl Reporter {
    /// Applies a report from an unnamed source; see [`Reporter::apply_from`].
    pub fn apply(&self, report: ComponentReport) -> bool {
        self.apply_from("", report)
    }

    /// Applies what `source` says about a component (several sources may
    /// speak about one; see [`HealthModel`]) and publishes `health.changed`
    /// when its status moved. Returns true on a status change.
    pub fn apply_from(&self, source: &str, report: ComponentReport) -> bool {
        let Some(change) = self.model.report_from(source, report, SystemTime::now()) else {
            return false;
        };
        // A component appearing healthy is routine; anything else is news.
        if change.from.is_none() && change.to == Status::Ok {
            return true;
        }
        self.events.publish(Signal::HealthChanged(HealthChanged {
            component: change.id,
            from: change.from,
            to: change.to,
            reason: change.reason,
        }));
        true
    }
}
