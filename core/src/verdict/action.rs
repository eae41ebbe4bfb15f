//! Remediation actions: what may be done about an incident.

use serde::{Deserialize, Serialize};

/// What to do about an incident, from the mildest to the most disruptive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Nothing to do: the job is unaffected; the incident is reported.
    Continue,
    /// Raise `RestartRequested` in the ranks; they keep their process,
    /// interpreter and CUDA context.
    RestartInProcess,
    /// The launcher stops and respawns the workers.
    RestartInJob,
    /// Go on with fewer data-parallel replicas, without this node.
    ScaleDown,
    /// Take this node out: a spare takes its place (hot-swap) or the job
    /// scales down, and the node is marked for the cluster to drain.
    Cordon,
    /// Stop the job with the diagnosis: no restart would help.
    Stop,
}

impl Action {
    /// Every action, for docs and validation messages.
    pub const ALL: [Action; 6] = [
        Action::Continue,
        Action::RestartInProcess,
        Action::RestartInJob,
        Action::ScaleDown,
        Action::Cordon,
        Action::Stop,
    ];

    /// Snake-case name, as config, hooks and JSON spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Continue => "continue",
            Action::RestartInProcess => "restart_in_process",
            Action::RestartInJob => "restart_in_job",
            Action::ScaleDown => "scale_down",
            Action::Cordon => "cordon",
            Action::Stop => "stop",
        }
    }

    /// True for the actions that restart workers (and so spend a budget).
    pub fn is_restart(self) -> bool {
        matches!(
            self,
            Action::RestartInProcess | Action::RestartInJob | Action::ScaleDown | Action::Cordon
        )
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Action {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Action::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Action::ALL.iter().map(|a| a.as_str()).collect();
                format!("unknown action {s:?}; expected one of {}", names.join(", "))
            })
    }
}
