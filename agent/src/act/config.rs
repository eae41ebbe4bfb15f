//! `[restart]`: how the agent carries out restarts itself.
//!
//! The agent carries out `restart_in_process` decisions on its own (it owns
//! the ranks' slots and control streams); this section bounds how long it
//! waits for the ranks before the decision becomes a restart of the job's
//! processes (see `act::in_process`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::{ConfigError, duration};

/// `[restart]`: in-process restarts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartConfig {
    /// How long every rank asked to restart in process has to acknowledge
    /// (it raised `RestartRequested` and runs its training function again).
    /// Past it, with a rank still silent (stuck in native code that no
    /// signal interrupts, or not running under `warden.run`), the decision
    /// becomes a restart in job: the launcher restarts the processes.
    #[serde(with = "duration")]
    pub in_process_timeout: Duration,
}

impl Default for RestartConfig {
    fn default() -> Self {
        Self {
            in_process_timeout: Duration::from_secs(30),
        }
    }
}

impl RestartConfig {
    /// Checks values that parse but make no sense; the error names the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        if !(Duration::from_millis(100)..=Duration::from_secs(3600))
            .contains(&self.in_process_timeout)
        {
            return Err(ConfigError::invalid(
                origin,
                "restart.in_process_timeout",
                humantime::format_duration(self.in_process_timeout).to_string(),
                "must be between 100ms and 1h",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_is_bounded_and_named() {
        assert!(RestartConfig::default().validate("t").is_ok());
        for bad in [Duration::from_millis(10), Duration::from_secs(7200)] {
            let err = RestartConfig {
                in_process_timeout: bad,
            }
            .validate("t")
            .unwrap_err()
            .to_string();
            assert!(err.contains("restart.in_process_timeout"), "{err}");
        }
    }
}
