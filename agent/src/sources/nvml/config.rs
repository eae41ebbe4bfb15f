//! `[nvml]`: the NVML source's configuration.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::ConfigError;

/// `[nvml]`: GPU health read through NVIDIA's management library.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NvmlConfig {
    /// Read GPU health through NVML. Without the library (a CPU node, no
    /// driver) the agent runs on and reports component `nvml` UNKNOWN.
    pub enabled: bool,
    /// The NVML library, loaded at run time: a file name searched the usual
    /// way (`ld.so`) or an absolute path.
    pub library: String,
    /// How often every GPU is read.
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
    /// GPUs this node must have; fewer is a node-level FAILED reason (a GPU
    /// that fell off the bus may vanish from the count). 0: do not check.
    pub expected_gpus: u32,
    /// The window over which counters (ECC, PCIe replays, NVLink errors) are
    /// judged as increases, never as lifetime totals.
    #[serde(with = "warden_core::config::duration")]
    pub window: Duration,
    /// Corrected (single-bit) volatile ECC errors within `window` at or above
    /// which a GPU is DEGRADED. Any uncorrected error in the window is FAILED.
    pub corrected_ecc_per_window: u64,
    /// Retired pages at or above which a GPU is FAILED (DCGM: 63).
    pub retired_pages_failed_at: u64,
    /// PCIe replays within `window` at or above which a GPU's `pcie`
    /// component is DEGRADED (DCGM: about 16 a minute at x16). 0: off.
    pub pcie_replays_per_window: u64,
    /// NVLink CRC errors (flit + data) within `window` at or above which a
    /// link is DEGRADED. Replay and recovery errors are FAILED at 1.
    pub nvlink_crc_per_window: u64,
    /// GPU temperature (Celsius) at or above which a GPU is DEGRADED. 0: off.
    pub temperature_degraded_celsius: u32,
    /// How long an XID keeps its reason on the GPU after it arrived.
    #[serde(with = "warden_core::config::duration")]
    pub xid_window: Duration,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            library: "libnvidia-ml.so.1".into(),
            poll_interval: Duration::from_secs(5),
            expected_gpus: 0,
            window: Duration::from_secs(60),
            corrected_ecc_per_window: 100,
            retired_pages_failed_at: 63,
            pcie_replays_per_window: 16,
            nvlink_crc_per_window: 100,
            temperature_degraded_celsius: 90,
            xid_window: Duration::from_secs(300),
        }
    }
}

impl NvmlConfig {
    /// Checks values that parse but make no sense; errors name the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.enabled && self.library.is_empty() {
            return Err(invalid(
                "nvml.library",
                "\"\"".into(),
                "must name the NVML library, e.g. \"libnvidia-ml.so.1\"",
            ));
        }
        if self.poll_interval < Duration::from_millis(100) {
            return Err(invalid(
                "nvml.poll_interval",
                show(self.poll_interval),
                "must be at least 100ms",
            ));
        }
        if self.window < self.poll_interval {
            return Err(invalid(
                "nvml.window",
                show(self.window),
                "must be at least nvml.poll_interval (a delta needs two readings)",
            ));
        }
        if self.xid_window.is_zero() {
            return Err(invalid(
                "nvml.xid_window",
                show(self.xid_window),
                "must be more than 0s",
            ));
        }
        if self.corrected_ecc_per_window == 0 {
            return Err(invalid(
                "nvml.corrected_ecc_per_window",
                "0".into(),
                "must be at least 1",
            ));
        }
        if self.nvlink_crc_per_window == 0 {
            return Err(invalid(
                "nvml.nvlink_crc_per_window",
                "0".into(),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
