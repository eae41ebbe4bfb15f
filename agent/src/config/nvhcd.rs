//! `[nvhcd]`: where the agent answers NVIDIA's node health check protocol
//! (`api::nvhcd` serves it).

use serde::{Deserialize, Serialize};
use warden_core::config::ConfigError;

/// `[nvhcd]`: NVIDIA's node health check protocol.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvhcdConfig {
    /// Unix socket to serve `nvhcd.HealthCheckService` on; empty: off. Give
    /// the same path to NVRx's `--ft-node-health-check-endpoint`. Its mode
    /// is `api.socket_mode` and its group `api.socket_group`, as the API
    /// socket's.
    pub socket: String,
}

impl NvhcdConfig {
    /// Checks the `[nvhcd]` keys (a bad one is [`ConfigError::Invalid`]).
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        if !self.socket.is_empty() && !std::path::Path::new(&self.socket).is_absolute() {
            return Err(ConfigError::invalid(
                origin,
                "nvhcd.socket",
                format!("{:?}", self.socket),
                "must be an absolute path, or empty for off",
            ));
        }
        Ok(())
    }
}
