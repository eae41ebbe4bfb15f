//! A remediation decision, as attribution records it, the policy takes it
//! and the launcher acts on it; and the exit statuses it carries.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{Action, FaultClass};

/// Exit status of a launcher that stops because this node is at fault
/// (cordon, scale down without a spare): requeue the job elsewhere, drain
/// the node. Outside the 64-78 sysexits range and the 128+N signal range.
pub const EXIT_NODE_FAULT: i32 = 86;
/// Exit status of a launcher that stops because the restart budget of a
/// class is spent: the job fails repeatedly; a person should look.
pub const EXIT_BUDGET_SPENT: i32 = 87;

/// A decision taken earlier, as the budget counts it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PastDecision {
    /// When.
    pub at: SystemTime,
    /// The class it answered.
    pub class: FaultClass,
    /// What was decided.
    pub action: Action,
}

/// A remediation decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// What to do.
    pub action: Action,
    /// Why, for a person.
    pub reason: String,
    /// "policy", "hook", or "policy (hook failed: ...)".
    pub decided_by: String,
    /// Restarts of this class in the window, this one included.
    pub attempt: u32,
    /// The class's budget.
    pub budget: u32,
    /// Wait this long before acting.
    #[serde(with = "crate::config::duration")]
    pub backoff: Duration,
    /// The exit status for a launcher that stops on this decision.
    pub exit_code: i32,
    /// When it was taken.
    pub decided_at: SystemTime,
    /// Taken in dry run (`[policy] dry_run`): reported, not acted on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// With `restart_in_process`: local ranks the launcher replaces at once
    /// (kills and starts again) while the others restart in process, for a
    /// rank whose process is stopped and so can never acknowledge. None
    /// for every decision the policy takes; only the in-process restart's
    /// waiter sets it (through an attribution `Escalation`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace: Option<Replacement>,
}

/// Ranks of a job to replace in the middle of an in-process restart, and
/// the restart count their new processes start with, so that they join the
/// attempt the job's other ranks make (each makes its process group on a
/// store keyed by `warden.restart_count()`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replacement {
    /// The global ranks, ascending, each once.
    pub ranks: Vec<u32>,
    /// The in-process restart count of the request the others answer
    /// (at least 1).
    pub restart_count: u32,
}

impl Decision {
    /// What is actually done: the action, or `continue` in dry run (what
    /// launchers are told, and what `warden incidents` shows beside the
    /// reason's "dry run: would ...").
    pub fn effective_action(&self) -> Action {
        if self.dry_run {
            Action::Continue
        } else {
            self.action
        }
    }
}

/// The exit status a launcher stopping on `action` returns: a node fault
/// and a spent budget get their own codes; a user error keeps the rank's.
pub fn exit_code_for(action: Action, class: FaultClass, spent: bool, rank: Option<i32>) -> i32 {
    match action {
        Action::Continue | Action::RestartInProcess | Action::RestartInJob => 0,
        Action::Cordon | Action::ScaleDown => EXIT_NODE_FAULT,
        Action::Stop if spent && class != FaultClass::UserError => EXIT_BUDGET_SPENT,
        Action::Stop => rank.filter(|c| *c != 0).unwrap_or(1),
    }
}
