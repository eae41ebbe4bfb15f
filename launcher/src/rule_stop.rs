//! A stop of the job by one of the launcher's own rules (no progress across
//! restarts, 88; the job's share of cordoned hosts, 87), as the launcher
//! reports it to its agent (ReportJobStop). A leaf: the machine
//! (`machine::job_stop` gathers the no-progress evidence), the hosts' seam
//! (`hosts::NodeFault::Held`) and the cordon-share rule
//! (`coord::cordon_share`) all name it, and none of them imports another
//! for it.

/// Evidence items a report carries at most (the agent's own cap).
pub const MAX_EVIDENCE: usize = 64;

/// Which of the launcher's rules ended the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopRule {
    /// `--max-no-progress-restarts`: exit 88.
    NoProgress,
    /// `--max-cordon-share`: exit 87 instead of 86.
    CordonShare,
}

/// One item of evidence (core's type, which the agent records).
pub use warden_core::attribute::StopEvidence;

/// A stop by the launcher's own rule, for its agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleStop {
    /// The rule.
    pub rule: StopRule,
    /// The launcher's diagnosis, one line.
    pub summary: String,
    /// The rule's limit as this launcher runs it ("--max-no-progress-restarts 3").
    pub limit: String,
    /// The launcher's exit status.
    pub exit_code: i32,
    /// Oldest first.
    pub evidence: Vec<StopEvidence>,
    /// The incident the launcher was acting on when it stopped.
    pub incident: Option<String>,
}

/// Appends `items`, keeping the newest [`MAX_EVIDENCE`].
pub fn keep_newest(log: &mut Vec<StopEvidence>, items: impl IntoIterator<Item = StopEvidence>) {
    log.extend(items);
    if log.len() > MAX_EVIDENCE {
        log.drain(..log.len() - MAX_EVIDENCE);
    }
}
