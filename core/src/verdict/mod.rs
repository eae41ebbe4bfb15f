//! The vocabulary that attribution, the policy and the launcher share:
//! whose fault an incident is ([`FaultClass`]), what may be done about it
//! ([`Action`]) and what was decided ([`Decision`]); and the shape of a
//! health signal's rule ([`SignalRule`]), which the fault tables and
//! attribution both fill. Its own module, so that
//! attribution (which records decisions with its incidents) and the policy
//! (which reads diagnoses) each import it and never each other both ways.

pub mod action;
pub mod blame;
pub mod class;
pub mod decision;
pub mod diagnosis;
pub mod rule;

pub use action::Action;
pub use blame::Blame;
pub use class::FaultClass;
pub use decision::{
    Decision, EXIT_BUDGET_SPENT, EXIT_NODE_FAULT, PastDecision, Replacement, exit_code_for,
};
pub use diagnosis::{Diagnosis, Evidence, IncidentKind, IncidentRecord, StopEvidence};
pub use rule::SignalRule;
