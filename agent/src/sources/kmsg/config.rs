//! `[kmsg]`: the kernel log source's section, and the PCI address form it
//! and the XID lines share. Kept apart from the source so that the
//! sources' settings (`super::super::settings`) name it without importing
//! the source.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[kmsg]`: the kernel log source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KmsgConfig {
    /// Read the kernel log at all.
    pub enabled: bool,
    /// What to read: `/dev/kmsg`, or a file or FIFO of kernel-log lines (a
    /// container's forwarded log, a test's file). It is followed like
    /// `tail -f`; a file that is truncated or replaced is read from its start.
    pub path: String,
    /// Read what the log already holds when the agent starts (false: only
    /// what is written after). Old XIDs replayed at start would blame GPUs
    /// for faults a reset may already have cleared.
    pub from_start: bool,
    /// PCI addresses (`0000:3b:00`, as XID lines print them) of GPU 0, 1, ...
    /// Empty: read `/proc/driver/nvidia/gpus/*/information` (the minor
    /// number); an address found in neither is reported as `gpu-<address>`.
    pub gpu_pci: Vec<String>,
    /// How long a GPU keeps the reason of an XID after its last occurrence.
    #[serde(with = "warden_core::config::duration")]
    pub xid_hold: Duration,
    /// How long `host/oom` stays DEGRADED after the last OOM kill.
    #[serde(with = "warden_core::config::duration")]
    pub oom_hold: Duration,
    /// How often new lines are read.
    #[serde(with = "warden_core::config::duration")]
    pub poll_interval: Duration,
}

impl Default for KmsgConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: "/dev/kmsg".into(),
            from_start: false,
            gpu_pci: Vec::new(),
            xid_hold: Duration::from_secs(10 * 60),
            oom_hold: Duration::from_secs(5 * 60),
            poll_interval: Duration::from_millis(500),
        }
    }
}

impl KmsgConfig {
    /// Checks values that parse but make no sense; the error names the key.
    pub fn validate(&self, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        let invalid = warden_core::config::ConfigError::invalid_in(origin);
        if self.enabled && self.path.is_empty() {
            return Err(invalid(
                "kmsg.path",
                "\"\"".into(),
                "must name /dev/kmsg or a file (or set kmsg.enabled = false)",
            ));
        }
        if self.poll_interval < Duration::from_millis(10)
            || self.poll_interval > Duration::from_secs(60)
        {
            return Err(invalid(
                "kmsg.poll_interval",
                humantime::format_duration(self.poll_interval).to_string(),
                "must be between 10ms and 1m",
            ));
        }
        for pci in &self.gpu_pci {
            if normalize_pci(pci).is_none() {
                return Err(invalid(
                    "kmsg.gpu_pci",
                    format!("{pci:?}"),
                    "each entry must be a PCI address such as \"0000:3b:00\" or \"00000000:3B:00.0\"",
                ));
            }
        }
        Ok(())
    }
}

/// Normalises a PCI address to `dddd:bb:dd` (lower case, 4-digit domain,
/// no function): XID lines, `nvidia-smi` and procfs each write it their way.
pub fn normalize_pci(s: &str) -> Option<String> {
    let s = s.trim().to_ascii_lowercase();
    let s = s.strip_prefix("pci:").unwrap_or(&s);
    let mut parts: Vec<&str> = s.split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0000");
    }
    let [domain, bus, dev] = parts[..] else {
        return None;
    };
    let dev = dev.split('.').next().unwrap_or(dev);
    let hex = |p: &str, max: usize| {
        !p.is_empty() && p.len() <= max && p.chars().all(|c| c.is_ascii_hexdigit())
    };
    if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2)) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u32::from_str_radix(bus, 16).ok()?;
    let dev = u32::from_str_radix(dev, 16).ok()?;
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}"))
}
