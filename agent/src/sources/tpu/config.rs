//! `[tpu]`: the TPU source's section. Kept apart from the source so that
//! the sources' settings (`super::super::settings`) name it without
//! importing the source.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use warden_core::config::ConfigError;

/// `[tpu]`: TPU chips and libtpu's runtime metrics service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TpuConfig {
    /// Look for TPU chips (and, where there are some, ask the runtime).
    pub enabled: bool,
    /// Loopback ports of libtpu's runtime metrics service. The ports in
    /// `TPU_RUNTIME_METRICS_PORTS` (comma-separated) are added to these.
    pub ports: Vec<u16>,
    /// How often chips and the runtime are read.
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
    /// Bound on each connection and call to the runtime.
    #[serde(with = "warden_core::config::duration")]
    pub rpc_timeout: Duration,
}

impl Default for TpuConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            ports: vec![8431],
            poll_interval: Duration::from_secs(5),
            rpc_timeout: Duration::from_secs(2),
        }
    }
}

impl TpuConfig {
    /// Checks the `[tpu]` keys (a bad one is [`ConfigError::Invalid`]).
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        if self.poll_interval < Duration::from_millis(100) {
            return Err(ConfigError::invalid(
                origin,
                "tpu.poll_interval",
                humantime::format_duration(self.poll_interval).to_string(),
                "must be at least 100ms",
            ));
        }
        if self.rpc_timeout < Duration::from_millis(10)
            || self.rpc_timeout > Duration::from_secs(60)
        {
            return Err(ConfigError::invalid(
                origin,
                "tpu.rpc_timeout",
                humantime::format_duration(self.rpc_timeout).to_string(),
                "must be between 10ms and 60s",
            ));
        }
        if self.ports.contains(&0) {
            return Err(ConfigError::invalid(
                origin,
                "tpu.ports",
                format!("{:?}", self.ports),
                "ports must be 1 to 65535",
            ));
        }
        Ok(())
    }

    /// The configured ports plus those in `env` (`TPU_RUNTIME_METRICS_PORTS`),
    /// without repeats; unparsable entries are skipped.
    pub fn all_ports(&self, env: Option<&str>) -> Vec<u16> {
        let mut ports = self.ports.clone();
        for p in env.unwrap_or("").split(',') {
            if let Ok(p) = p.trim().parse::<u16>()
                && p != 0
                && !ports.contains(&p)
            {
                ports.push(p);
            }
        }
        ports
    }
}
