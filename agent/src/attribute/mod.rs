//! Attribution: every incident becomes a diagnosis (a fault class, a
//! confidence and the chain of evidence).

pub mod class;

pub use class::FaultClass;
pub mod config;
pub mod diagnosis;
pub mod engine;
pub mod rules;
pub mod store;
pub mod task;

pub use config::AttributionConfig;
pub use diagnosis::{Diagnosis, Evidence, IncidentKind, IncidentRecord};

#[cfg(test)]
mod scenarios;
