//! `[nvhcd]`: where the agent answers NVIDIA's node health check protocol
//! (`api::nvhcd` serves it).

use serde::{Deserialize, Serialize};

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
    /// Checks the `[nvhcd]` keys: `(key, value, why)`.
    pub fn validate(&self) -> Result<(), (&'static str, String, String)> {
        if !self.socket.is_empty() && !std::path::Path::new(&self.socket).is_absolute() {
            return Err((
                "nvhcd.socket",
                format!("{:?}", self.socket),
                "must be an absolute path, or empty for off".into(),
            ));
        }
        Ok(())
    }
}
