//! A rank's identity and lifecycle: the vocabulary the agent's registry,
//! the detectors, attribution and the internal signals share.

/// Identifies a rank across registrations.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankKey {
    /// Job id.
    pub job: String,
    /// Global rank.
    pub rank: u32,
}

impl std::fmt::Display for RankKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "job/{}/rank/{}", self.job, self.rank)
    }
}

/// A rank's lifecycle as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankState {
    /// Registered and making progress (or not yet past its threshold).
    Running,
    /// No progress past its section's threshold.
    Hung,
    /// The process is gone.
    Exited,
    /// Its slot was lost (agent state reset); waiting
    /// for the client to register again.
    Lost,
    /// Its launcher is stopping it on purpose (StopRanks: a restart, the end
    /// of the job): its exit is recorded, not an incident, and the scan no
    /// longer judges its progress (it is being killed, not hung).
    Stopping,
}

impl RankState {
    /// Lower-case name for the API.
    pub fn as_str(self) -> &'static str {
        match self {
            RankState::Running => "running",
            RankState::Hung => "hung",
            RankState::Exited => "exited",
            RankState::Lost => "lost",
            RankState::Stopping => "stopping",
        }
    }
}

/// How a rank's process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal, when it was killed.
    pub signal: Option<i32>,
    /// Where the status came from, or why it is unknown.
    pub source: String,
}

/// The most ranks a job may have in any count warden keeps or checks (the
/// agent's `ranks.max_world_size`, a manifest's or a peer's world size):
/// 2^24, far past any job run today, and still a bounded allocation per
/// step.
pub const MAX_WORLD_SIZE: u32 = 1 << 24;
