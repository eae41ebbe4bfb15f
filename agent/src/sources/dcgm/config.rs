//! `[dcgm]`: the DCGM source and the DCGM diagnostic gate.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use warden_core::config::ConfigError;
use warden_core::taxonomy::dcgm::SYSTEMS;

/// How DCGM is reached and read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DcgmConfig {
    /// Read DCGM's health watches. Without a library or a host engine the
    /// agent runs on and reports component `dcgm` UNKNOWN with the reason.
    pub enabled: bool,
    /// The library: empty tries libdcgm.so.4 then libdcgm.so.3; else a
    /// file name or absolute path.
    pub library: String,
    /// "connect" to a running nv-hostengine, or "embedded": start DCGM
    /// inside the helper process (AUTO mode), for nodes without one.
    pub mode: String,
    /// nv-hostengine's address: "host:port" (default port 5555) or
    /// "unix:/path/to/socket".
    pub address: String,
    /// Health systems to watch: "all", or names among pcie, nvlink, pmu,
    /// mcu, mem, sm, inforom, thermal, power, driver, nvswitch_nonfatal,
    /// nvswitch_fatal, connectx.
    pub systems: Vec<String>,
    /// How often dcgmHealthCheck is called.
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
    /// A DCGM call that takes longer is abandoned: the helper process is
    /// killed and started again; `dcgm` reads UNKNOWN meanwhile.
    #[serde(with = "warden_core::config::duration")]
    pub call_timeout: Duration,
    /// Checks in a row an incident must be gone before its reason clears.
    pub clear_after: u32,
    /// `dcgmi`, for the pre-restart diagnostic gate; where it is absent the
    /// gate runs the fast NVML check instead.
    pub dcgmi: String,
    /// `dcgmi diag -r LEVEL` for the gate (1 quick, 2 medium, 3 long).
    pub gate_level: u32,
    /// The gate's deadline.
    #[serde(with = "warden_core::config::duration")]
    pub gate_timeout: Duration,
    /// The deepest level a caller may ask for (RunHealthGate's `level`,
    /// `warden diag --level`): a gate stresses every GPU of the node, every
    /// tenant's, so a deeper one is refused (INVALID_ARGUMENT naming this
    /// key). At least `gate_level`.
    pub gate_max_level: u32,
    /// A gate's result is answered again, marked cached with its age, to
    /// callers asking for the same level or a lower one within this long
    /// after its run ended; 0s: every call runs (one at a time).
    #[serde(with = "warden_core::config::duration")]
    pub gate_cache_for: Duration,
    /// Gate calls one uid may have in progress (waiting or running) at
    /// once; the next is refused with RESOURCE_EXHAUSTED naming this key.
    pub gate_max_per_uid: u32,
}

impl Default for DcgmConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            library: String::new(),
            mode: "connect".into(),
            address: "127.0.0.1:5555".into(),
            systems: vec!["all".into()],
            poll_interval: Duration::from_secs(10),
            call_timeout: Duration::from_secs(10),
            clear_after: 1,
            dcgmi: "dcgmi".into(),
            gate_level: 1,
            gate_timeout: Duration::from_secs(120),
            gate_max_level: 2,
            gate_cache_for: Duration::from_secs(60),
            gate_max_per_uid: 2,
        }
    }
}

impl DcgmConfig {
    /// The systems as DCGM's bitmask.
    pub fn systems_mask(&self) -> Result<u32, String> {
        let mut mask = 0u32;
        for s in &self.systems {
            if s == "all" {
                return Ok(u32::MAX);
            }
            match SYSTEMS.iter().find(|(_, n)| n == s) {
                Some((b, _)) => mask |= b,
                None => {
                    let names: Vec<&str> = SYSTEMS.iter().map(|(_, n)| *n).collect();
                    return Err(format!(
                        "unknown system {s:?}; expected \"all\" or among {}",
                        names.join(", ")
                    ));
                }
            }
        }
        Ok(mask)
    }

    /// Refuses values that cannot work; errors name the key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if self.mode != "connect" && self.mode != "embedded" {
            return Err(invalid(
                "dcgm.mode",
                self.mode.clone(),
                "must be \"connect\" or \"embedded\"",
            ));
        }
        if let Err(why) = self.systems_mask() {
            return Err(invalid("dcgm.systems", format!("{:?}", self.systems), &why));
        }
        if self.poll_interval < Duration::from_secs(1) {
            return Err(invalid(
                "dcgm.poll_interval",
                show(self.poll_interval),
                "must be at least 1s",
            ));
        }
        if self.call_timeout < Duration::from_millis(100)
            || self.call_timeout > Duration::from_secs(300)
        {
            return Err(invalid(
                "dcgm.call_timeout",
                show(self.call_timeout),
                "must be between 100ms and 5m",
            ));
        }
        if !(1..=4).contains(&self.gate_level) {
            return Err(invalid(
                "dcgm.gate_level",
                self.gate_level.to_string(),
                "must be 1, 2, 3 or 4 (dcgmi diag -r)",
            ));
        }
        if !(1..=4).contains(&self.gate_max_level) {
            return Err(invalid(
                "dcgm.gate_max_level",
                self.gate_max_level.to_string(),
                "must be 1, 2, 3 or 4 (dcgmi diag -r)",
            ));
        }
        if self.gate_level > self.gate_max_level {
            return Err(invalid(
                "dcgm.gate_level",
                self.gate_level.to_string(),
                &format!(
                    "must not exceed dcgm.gate_max_level ({})",
                    self.gate_max_level
                ),
            ));
        }
        if self.gate_cache_for > Duration::from_secs(3600) {
            return Err(invalid(
                "dcgm.gate_cache_for",
                show(self.gate_cache_for),
                "must be at most 1h",
            ));
        }
        if !(1..=1024).contains(&self.gate_max_per_uid) {
            return Err(invalid(
                "dcgm.gate_max_per_uid",
                self.gate_max_per_uid.to_string(),
                "must be between 1 and 1024",
            ));
        }
        if self.clear_after == 0 {
            return Err(invalid(
                "dcgm.clear_after",
                "0".into(),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
