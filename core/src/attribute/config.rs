//! `[attribution]`: the windows within which signals are joined to an
//! incident, and the thresholds of the rules that count repeats.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// How attribution joins signals into incidents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttributionConfig {
    /// Wait this long after a crash or hang before diagnosing it, so the
    /// XID the driver logs a moment later still joins (the kernel log and
    /// NVML's event thread deliver within milliseconds).
    #[serde(with = "crate::config::duration")]
    pub settle: Duration,
    /// How far back a hardware signal (an XID, an ECC change, a link going
    /// down) counts as evidence for a crash or hang on the same device.
    #[serde(with = "crate::config::duration")]
    pub hardware_window: Duration,
    /// A new trigger within this long of an open incident that shares its
    /// job or a device joins that incident instead of opening another.
    #[serde(with = "crate::config::duration")]
    pub correlate_window: Duration,
    /// An application XID (13, 31, 43...) seen this many times on one GPU
    /// within `xid_repeat_window`, at different steps or in different
    /// jobs, points at the GPU rather than at the code.
    pub xid_repeat_count: u32,
    /// The window of `xid_repeat_count`.
    #[serde(with = "crate::config::duration")]
    pub xid_repeat_window: Duration,
    /// How long a job's failures are remembered for the "same failure at
    /// the same step after a restart" rule.
    #[serde(with = "crate::config::duration")]
    pub history_window: Duration,
    /// Incidents kept for GetIncidents (and on disk, in the state
    /// directory's incidents.jsonl).
    pub retain: usize,
}

impl Default for AttributionConfig {
    fn default() -> Self {
        Self {
            settle: Duration::from_millis(200),
            hardware_window: Duration::from_secs(5 * 60),
            correlate_window: Duration::from_secs(30),
            xid_repeat_count: 3,
            xid_repeat_window: Duration::from_secs(60 * 60),
            history_window: Duration::from_secs(24 * 60 * 60),
            retain: 512,
        }
    }
}

impl AttributionConfig {
    /// Refuses values that would make attribution slow or blind.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.settle > Duration::from_secs(10) {
            return Err(invalid(
                "attribution.settle",
                show(self.settle),
                "must be at most 10s (it delays every restart decision)",
            ));
        }
        if self.correlate_window > self.hardware_window {
            return Err(invalid(
                "attribution.correlate_window",
                show(self.correlate_window),
                "must not exceed attribution.hardware_window",
            ));
        }
        if self.xid_repeat_count < 2 {
            return Err(invalid(
                "attribution.xid_repeat_count",
                self.xid_repeat_count.to_string(),
                "must be at least 2 (one XID is not a repeat)",
            ));
        }
        if self.retain == 0 || self.retain > 100_000 {
            return Err(invalid(
                "attribution.retain",
                self.retain.to_string(),
                "must be between 1 and 100000",
            ));
        }
        Ok(())
    }
}
