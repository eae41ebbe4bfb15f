//! `[host]`: the thresholds of the host's own sources (memory, NICs and
//! InfiniBand ports, the checkpoint tier's free space, where sysfs is).
//!
//! Why its own module: the host sources read it and the agent's config
//! holds it; here, neither imports the other through it.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use warden_core::config::duration;

/// Default `[host] net_ignore`: loopback and virtual interfaces.
pub const DEFAULT_IGNORE: &[&str] = &[
    "lo", "veth*", "docker*", "br-*", "virbr*", "cni*", "flannel*", "cali*", "vxlan*", "tun*",
    "tap*", "wg*", "kube-*", "dummy*",
];

/// `[host]`: thresholds for the host's own health.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// How often host signals (memory) are read.
    #[serde(with = "duration")]
    pub poll_interval: Duration,
    /// Available memory below this share of the total (percent) is DEGRADED.
    pub memory_degraded_below_percent: f64,
    /// Available memory below this share of the total (percent) is FAILED:
    /// the OOM killer is about to pick a rank.
    pub memory_failed_below_percent: f64,
    /// Root of sysfs, where NICs, InfiniBand ports and TPU chips are found.
    /// Tests point it at a fake tree.
    pub sysfs_root: String,
    /// The checkpoint tier whose free space is watched (`disk/checkpoint`);
    /// unset: the agent's own tier, `[checkpoint] dir` (when the tier is
    /// on); empty: not watched. FAILED only when it is a filesystem of the
    /// agent's own (sources/host_disk.rs), DEGRADED at most when others
    /// may write it too.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<String>,
    /// Free space of `checkpoint_dir` below this share (percent) is DEGRADED.
    pub checkpoint_degraded_below_percent: f64,
    /// Free space below this share (percent) is FAILED: the next checkpoint
    /// may not fit.
    pub checkpoint_failed_below_percent: f64,
    /// NICs to watch by name; empty: every physical one not in `net_ignore`.
    pub net_interfaces: Vec<String>,
    /// NIC names (a trailing `*` matches a prefix) never watched unless
    /// listed in `net_interfaces`: loopback and virtual interfaces.
    pub net_ignore: Vec<String>,
    /// The window over which link-down counts (carrier drops, IB link_downed)
    /// are judged.
    #[serde(with = "duration")]
    pub link_flap_window: Duration,
    /// Link-downs within `link_flap_window` that make a link DEGRADED (flapping).
    pub link_flaps_degraded: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(5),
            memory_degraded_below_percent: 10.0,
            memory_failed_below_percent: 3.0,
            sysfs_root: "/sys".into(),
            checkpoint_dir: None,
            checkpoint_degraded_below_percent: 10.0,
            checkpoint_failed_below_percent: 3.0,
            net_interfaces: Vec::new(),
            net_ignore: DEFAULT_IGNORE.iter().map(|s| (*s).to_owned()).collect(),
            link_flap_window: Duration::from_secs(300),
            link_flaps_degraded: 2,
        }
    }
}
