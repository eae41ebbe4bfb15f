//! The signal rules' shape: what a health signal says when a source reports
//! it. In the shared vocabulary, so that the fault tables (`taxonomy`) and
//! the attribution rules both name it and neither imports the other.

use super::FaultClass;

/// What a health signal says when a source reports it (the source has
/// already judged it against its thresholds and debounce).
#[derive(Debug, Clone, Copy)]
pub struct SignalRule {
    /// The reason's signal name, as the sources spell it.
    pub signal: &'static str,
    /// Class when the source judged the component FAILED.
    pub failed: FaultClass,
    /// Class when DEGRADED; None where a degradation is a warning about
    /// what may come, never the cause of a failure that has come.
    pub degraded: Option<FaultClass>,
    /// How strongly.
    pub weight: f64,
    /// Why.
    pub note: &'static str,
}
