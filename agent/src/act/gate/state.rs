//! What the agent holds of the pre-restart gate ([`Gate`]: the last run,
//! the calls in progress); `act::gate` runs it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::sources::dcgm::diag::GateOutcome;

/// The node's one gate: the last run (held while a run goes on, so callers
/// queue behind it) and the calls in progress per uid.
#[derive(Debug, Default)]
pub struct Gate {
    /// The last run's level, verdict and end; locked for the whole of a run.
    pub(crate) last: tokio::sync::Mutex<Option<LastRun>>,
    /// Calls in progress (waiting or running) per uid; a uid at zero is
    /// removed, so the map holds only callers of the moment.
    pub(crate) calls: Mutex<HashMap<u32, u32>>,
}

/// A finished run.
#[derive(Debug, Clone)]
pub(crate) struct LastRun {
    pub(crate) level: u32,
    pub(crate) outcome: GateOutcome,
    pub(crate) ended: Instant,
}
