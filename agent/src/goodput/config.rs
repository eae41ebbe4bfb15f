//! `[goodput]`: how long the ledger keeps jobs that ended.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::ConfigError;

/// What is kept of jobs that ended (every rank ended: CloseGoodput, or each
/// rank exited). Without a bound, each job id ever seen kept its ledger in
/// memory, its journal on disk and its metric series for ever.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GoodputConfig {
    /// An ended job's ledger (GetGoodput) and journal
    /// (`<state_dir>/goodput/<job>.jsonl`) are dropped this long after the
    /// agent saw it end (a job found ended at start counts from the start).
    #[serde(with = "warden_core::config::duration")]
    pub retain_ended: Duration,
    /// At most this many ended jobs are kept; past it the ones that ended
    /// longest ago are dropped first.
    pub max_ended_jobs: usize,
    /// An ended job's series (`warden_goodput_seconds{job}`,
    /// `warden_goodput_ratio{job}`, the straggler gauges) stay on
    /// `/metrics` this long after it ended, so a scrape sees its final
    /// values; then they are removed.
    #[serde(with = "warden_core::config::duration")]
    pub series_after_end: Duration,
}

impl Default for GoodputConfig {
    fn default() -> Self {
        Self {
            retain_ended: Duration::from_secs(24 * 3600),
            max_ended_jobs: 256,
            series_after_end: Duration::from_secs(300),
        }
    }
}

impl GoodputConfig {
    /// The ledger's retention.
    pub fn retention(&self) -> warden_core::goodput::Retention {
        warden_core::goodput::Retention {
            max_age: self.retain_ended,
            max_jobs: self.max_ended_jobs,
        }
    }

    /// Refuses values that cannot work; errors name the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.retain_ended < Duration::from_secs(1) {
            return Err(invalid(
                "goodput.retain_ended",
                show(self.retain_ended),
                "must be at least 1s",
            ));
        }
        if !(1..=65_536).contains(&self.max_ended_jobs) {
            return Err(invalid(
                "goodput.max_ended_jobs",
                self.max_ended_jobs.to_string(),
                "must be between 1 and 65536",
            ));
        }
        if self.series_after_end > Duration::from_secs(24 * 3600) {
            return Err(invalid(
                "goodput.series_after_end",
                show(self.series_after_end),
                "must be at most 24h",
            ));
        }
        Ok(())
    }
}
