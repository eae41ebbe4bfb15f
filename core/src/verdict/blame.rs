//! Whom a job-wide hang verdict blames: a rank, its host and why. Here,
//! with the rest of the vocabulary the detectors, attribution and the
//! signals share, because the verdict's signal (`job.hang_verdict`)
//! carries it and `detect::culprit` makes it.

/// One rank blamed, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blame {
    /// Global rank.
    pub rank: u32,
    /// Its host ("" when no host reported it).
    pub host: String,
    /// The evidence, one sentence.
    pub why: String,
}

impl Blame {
    /// "rank 3 on host-b" ("rank 3" when no host reported it): how a
    /// waiter's incident names whom it waited on.
    pub fn name(&self) -> String {
        if self.host.is_empty() {
            format!("rank {}", self.rank)
        } else {
            format!("rank {} on {}", self.rank, self.host)
        }
    }
}
