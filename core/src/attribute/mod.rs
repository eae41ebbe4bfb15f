//! Attribution: every incident becomes a diagnosis (a fault class, a
//! confidence and the chain of evidence).

pub mod class;

pub use class::FaultClass;
pub mod config;
pub use crate::verdict::diagnosis;
pub mod engine;
pub mod rules;
pub mod store;

pub use config::AttributionConfig;
pub use diagnosis::{Diagnosis, Evidence, IncidentKind, IncidentRecord, StopEvidence};

/// A later decision about an incident, taken outside the attribution task
/// (an in-process restart nobody acknowledged in time, so the launcher must
/// restart the job): sent by the agent's in-process restarts to its
/// attribution task (`warden_agent::act::in_process::Handles::escalations`).
#[derive(Debug, Clone)]
pub struct Escalation {
    /// The incident.
    pub incident: String,
    /// The new action.
    pub action: crate::verdict::Action,
    /// Why, for a person.
    pub reason: String,
    /// With [`crate::verdict::Action::RestartInProcess`]: the ranks its
    /// launcher replaces while the others restart in process (a rank
    /// frozen with SIGSTOP); the decision carries it to the launcher.
    pub replace: Option<crate::verdict::Replacement>,
}

#[cfg(test)]
mod scenarios;
