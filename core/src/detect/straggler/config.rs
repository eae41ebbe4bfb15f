//! `[straggler]`: how slow ranks are found, and with whom this agent
//! compares notes.
//!
//! The defaults are chosen so that the simulation benchmark holds
//! (`cargo bench -p warden-cli --bench stragglers`, docs/benchmarks.md):
//! with 3% jitter on every compute section no rank of 1,024 is flagged over
//! 10,000 steps, and a rank 10% slower is flagged within 15 steps.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, duration};

/// Step records a rank's sample ring holds (the scan's horizon): the
/// longest window and `min_steps` are bounded by it.
pub const MAX_WINDOW: usize = 64;

/// `[straggler]`: the straggler detector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StragglerConfig {
    /// Score ranks at all. Off: no scores, no events, no exchange.
    pub enabled: bool,
    /// Steps in one scoring window: each rank's duration of a section is
    /// the median over its last `window_steps` steps (one slow step, a GC
    /// pause, does not move a median).
    pub window_steps: usize,
    /// A new window is scored every `stride_steps` new steps of a rank, so
    /// consecutive windows overlap when it is below `window_steps`; half a
    /// window lets a slowdown that starts mid-window be seen by the next.
    pub stride_steps: usize,
    /// Steps of a section a rank must have completed before it is judged.
    pub min_steps: usize,
    /// Smallest effect that counts: a rank's window median over the job's
    /// median for the section must reach this (1.06: 6% slower).
    pub relative_threshold: f64,
    /// And it must stand out of the job's spread: robust z, the distance
    /// from the job's median in units of 1.4826 x MAD (the median absolute
    /// deviation, which one slow rank cannot inflate).
    pub z_threshold: f64,
    /// For jobs with fewer than `min_ranks` ranks scored, where a spread
    /// means nothing, a rank must also be this much slower than its own best
    /// recent window.
    pub individual_threshold: f64,
    /// How many of a rank's recent windows its "best recent window" is
    /// taken from (the individual score).
    pub individual_windows: usize,
    /// Ranks (all hosts) with a section needed to compare them by robust z.
    pub min_ranks: usize,
    /// At most this share of a job's ranks (and at least one) may be over
    /// the thresholds in a section for any of them to count: when more are,
    /// the difference is the job's shape (ranks doing different work, such
    /// as pipeline stages), not stragglers.
    pub max_share: f64,
    /// A rank is flagged after this many consecutive windows over the
    /// thresholds.
    pub flag_after: u32,
    /// A flagged rank is cleared after this many consecutive windows under.
    pub clear_after: u32,
    /// Sections that are the rank's own work and are compared: exact names,
    /// or a prefix ending in `*`.
    pub compute_sections: Vec<String>,
    /// Sections that wait on others (collectives, data, barriers) and are
    /// never compared, since waiting makes every rank as slow as the
    /// slowest: a name containing any of these. They win over
    /// `compute_sections`. A rank that marks no compute section is scored
    /// on its step time minus these (section `step-minus-wait`, or `step`
    /// when it marks no section at all).
    pub wait_sections: Vec<String>,
    /// Explain a flagged rank from its GPUs' health (clock-event reasons,
    /// temperature, power, PCIe link, NVLink errors) and host CPU contention.
    pub explain: bool,
    /// Share of wall time a rank's main thread waited for a CPU
    /// (`/proc/<pid>/schedstat` run_delay) from which host CPU contention
    /// explains a slowdown.
    pub cpu_wait_share: f64,
    /// Peer agents (`host:port` of their `api.tcp`) that watch other ranks
    /// of the same jobs: per-rank summaries are exchanged with them so the
    /// comparison covers the whole job. Empty: this host only.
    pub peers: Vec<String>,
    /// How often summaries are sent to each peer.
    #[serde(with = "duration")]
    pub exchange_interval: Duration,
    /// Bound on connecting to a peer and on each exchange call.
    #[serde(with = "duration")]
    pub peer_timeout: Duration,
    /// A peer's summaries are forgotten this long after they arrived.
    #[serde(with = "duration")]
    pub summary_ttl: Duration,
    /// Hosts per group of the job-wide exchange's two-level tree: a host
    /// reports to its group's first live host, which relays to the job's
    /// aggregator, so no host holds a connection from every other one.
    /// 0 (the default): the square root of the job's host count, at least
    /// [`AUTO_MIN_FAN_OUT`] (a job of up to that many hosts has one group:
    /// every host reports to the aggregator itself).
    pub aggregator_fan_out: u32,
    /// How long a group leader holds its members' reports before it passes
    /// them on to the aggregator in one call (`ReportBatchToAggregator`):
    /// the aggregator then answers one call per batch, not one per member.
    /// The wait adds to each member's answer; 0 passes every report on
    /// alone. At most 1 s; a leader waits at most half of `peer_timeout`
    /// ([`Self::relay_batch_wait`]), so a member's call (twice
    /// `peer_timeout` through a leader) holds the wait and the relay.
    #[serde(with = "duration")]
    pub relay_batch_window: Duration,
}

/// The least group size [`StragglerConfig::aggregator_fan_out`] = 0
/// chooses: below it, a relay's extra hop buys nothing.
pub const AUTO_MIN_FAN_OUT: usize = 32;

/// The largest `straggler.aggregator_fan_out`.
pub const MAX_FAN_OUT: u32 = 65_536;

impl Default for StragglerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window_steps: 10,
            stride_steps: 5,
            min_steps: 10,
            relative_threshold: 1.06,
            z_threshold: 4.0,
            individual_threshold: 1.1,
            individual_windows: 20,
            min_ranks: 3,
            max_share: 0.1,
            flag_after: 2,
            clear_after: 3,
            compute_sections: ["forward", "backward", "optimizer", "compute"]
                .map(str::to_owned)
                .to_vec(),
            wait_sections: [
                "allreduce",
                "all_reduce",
                "allgather",
                "all_gather",
                "reduce_scatter",
                "alltoall",
                "all_to_all",
                "broadcast",
                "barrier",
                "nccl",
                "comm",
                "wait",
                "sync",
                "data",
                "checkpoint",
            ]
            .map(str::to_owned)
            .to_vec(),
            explain: true,
            cpu_wait_share: 0.1,
            peers: Vec::new(),
            exchange_interval: Duration::from_secs(2),
            peer_timeout: Duration::from_secs(1),
            summary_ttl: Duration::from_secs(30),
            aggregator_fan_out: 0,
            relay_batch_window: Duration::from_millis(100),
        }
    }
}

impl StragglerConfig {
    /// How long a group leader holds its members' reports:
    /// `relay_batch_window`, at most half of `peer_timeout`.
    pub fn relay_batch_wait(&self) -> Duration {
        self.relay_batch_window.min(self.peer_timeout / 2)
    }

    /// Checks values that parse but make no sense; the error names the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if !(2..=MAX_WINDOW).contains(&self.window_steps) {
            return Err(invalid(
                "straggler.window_steps",
                self.window_steps.to_string(),
                &format!("must be between 2 and {MAX_WINDOW}"),
            ));
        }
        if !(1..=self.window_steps).contains(&self.stride_steps) {
            return Err(invalid(
                "straggler.stride_steps",
                self.stride_steps.to_string(),
                "must be between 1 and straggler.window_steps",
            ));
        }
        if !(self.window_steps..=MAX_WINDOW).contains(&self.min_steps) {
            return Err(invalid(
                "straggler.min_steps",
                self.min_steps.to_string(),
                &format!("must be between straggler.window_steps and {MAX_WINDOW}"),
            ));
        }
        for (key, v) in [
            ("straggler.relative_threshold", self.relative_threshold),
            ("straggler.individual_threshold", self.individual_threshold),
        ] {
            if !(v > 1.0 && v <= 10.0) {
                return Err(invalid(
                    key,
                    v.to_string(),
                    "must be above 1 and at most 10",
                ));
            }
        }
        if !(self.z_threshold > 0.0 && self.z_threshold <= 100.0) {
            return Err(invalid(
                "straggler.z_threshold",
                self.z_threshold.to_string(),
                "must be above 0 and at most 100",
            ));
        }
        if !(1..=1000).contains(&self.individual_windows) {
            return Err(invalid(
                "straggler.individual_windows",
                self.individual_windows.to_string(),
                "must be between 1 and 1000",
            ));
        }
        if self.min_ranks < 3 {
            return Err(invalid(
                "straggler.min_ranks",
                self.min_ranks.to_string(),
                "must be at least 3 (a median absolute deviation of two values means nothing)",
            ));
        }
        if !(self.max_share > 0.0 && self.max_share <= 0.5) {
            return Err(invalid(
                "straggler.max_share",
                self.max_share.to_string(),
                "must be above 0 and at most 0.5 (a straggler is a minority)",
            ));
        }
        for (key, v) in [
            ("straggler.flag_after", self.flag_after),
            ("straggler.clear_after", self.clear_after),
        ] {
            if !(1..=1000).contains(&v) {
                return Err(invalid(key, v.to_string(), "must be between 1 and 1000"));
            }
        }
        for (key, list) in [
            ("straggler.compute_sections", &self.compute_sections),
            ("straggler.wait_sections", &self.wait_sections),
        ] {
            if let Some(bad) = list
                .iter()
                .find(|s| s.is_empty() || s.len() > 64 || s == &"*")
            {
                return Err(invalid(
                    key,
                    format!("{bad:?}"),
                    "each entry must be a section name of 1 to 64 bytes (a trailing * matches a prefix)",
                ));
            }
        }
        if !(self.cpu_wait_share > 0.0 && self.cpu_wait_share <= 1.0) {
            return Err(invalid(
                "straggler.cpu_wait_share",
                self.cpu_wait_share.to_string(),
                "must be above 0 and at most 1",
            ));
        }
        if let Some(bad) = self
            .peers
            .iter()
            .find(|p| !crate::config::valid_peer_addr(p))
        {
            return Err(invalid(
                "straggler.peers",
                format!("{bad:?}"),
                "each peer must be host:port of a peer agent's api.tcp, such as \"10.0.0.7:7070\"",
            ));
        }
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.exchange_interval < Duration::from_millis(100)
            || self.exchange_interval > Duration::from_secs(600)
        {
            return Err(invalid(
                "straggler.exchange_interval",
                show(self.exchange_interval),
                "must be between 100ms and 10m",
            ));
        }
        if self.peer_timeout < Duration::from_millis(10)
            || self.peer_timeout > Duration::from_secs(60)
        {
            return Err(invalid(
                "straggler.peer_timeout",
                show(self.peer_timeout),
                "must be between 10ms and 1m",
            ));
        }
        if self.summary_ttl < self.exchange_interval {
            return Err(invalid(
                "straggler.summary_ttl",
                show(self.summary_ttl),
                "must be at least straggler.exchange_interval",
            ));
        }
        if self.aggregator_fan_out == 1 || self.aggregator_fan_out > MAX_FAN_OUT {
            return Err(invalid(
                "straggler.aggregator_fan_out",
                self.aggregator_fan_out.to_string(),
                &format!(
                    "must be 0 (the square root of the job's hosts) or between 2 and {MAX_FAN_OUT}"
                ),
            ));
        }
        if self.relay_batch_window > Duration::from_secs(1) {
            return Err(invalid(
                "straggler.relay_batch_window",
                show(self.relay_batch_window),
                "must be at most 1s (0: a leader passes each report on alone)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        StragglerConfig::default().validate("t").unwrap();
    }

    #[test]
    fn bad_values_name_their_key() {
        type Case = (&'static str, fn(&mut StragglerConfig));
        let cases: [Case; 9] = [
            ("straggler.window_steps", |c| c.window_steps = 1),
            ("straggler.stride_steps", |c| c.stride_steps = 11),
            ("straggler.min_steps", |c| c.min_steps = 5),
            ("straggler.relative_threshold", |c| {
                c.relative_threshold = 1.0
            }),
            ("straggler.min_ranks", |c| c.min_ranks = 2),
            ("straggler.peers", |c| c.peers = vec!["nohost".into()]),
            ("straggler.summary_ttl", |c| {
                c.summary_ttl = Duration::from_millis(100)
            }),
            ("straggler.wait_sections", |c| {
                c.wait_sections = vec![String::new()]
            }),
            ("straggler.relay_batch_window", |c| {
                c.relay_batch_window = Duration::from_millis(1001)
            }),
        ];
        for (key, set) in cases {
            let mut c = StragglerConfig::default();
            set(&mut c);
            let err = c.validate("t").unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn peers_take_names_and_addresses() {
        use crate::config::valid_peer_addr as valid_peer;
        assert!(valid_peer("127.0.0.2:7070"));
        assert!(valid_peer("[::1]:7070"));
        assert!(valid_peer("node-7.cluster:7070"));
        assert!(valid_peer("node-3.rack:7411"));
        assert!(!valid_peer("node-7"));
        assert!(!valid_peer("node 7:70"));
        assert!(!valid_peer(":70"));
        assert!(!valid_peer("node:0"));
        assert!(!valid_peer("http://x:1"));
    }
}
