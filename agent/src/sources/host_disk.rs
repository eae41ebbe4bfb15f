//! Free space of the checkpoint tier (`[host] checkpoint_dir`, by default
//! `/dev/shm`), read with statvfs.
//!
//! A checkpoint that does not fit fails late and takes the job's last good
//! state with it; low free space is reported before the write, as
//! `disk/checkpoint`, DEGRADED and FAILED below the `[host]` thresholds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::config::HostConfig;
use warden_core::health::{ComponentReport, Reason, Status};

/// The component id this source reports on.
pub const COMPONENT: &str = "disk/checkpoint";

/// Size and free space of one filesystem, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    /// Total size.
    pub total: u64,
    /// Available to unprivileged writers (statvfs `f_bavail`).
    pub available: u64,
}

impl Space {
    /// Available space as a percentage of the total.
    pub fn available_percent(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        self.available as f64 * 100.0 / self.total as f64
    }
}

/// Reads the filesystem holding `path`.
pub fn read(path: &Path) -> Result<Space, String> {
    let st = nix::sys::statvfs::statvfs(path)
        .map_err(|e| format!("cannot statvfs {}: {e}", path.display()))?;
    let frag = st.fragment_size();
    Ok(Space {
        total: st.blocks().saturating_mul(frag),
        available: st.blocks_available().saturating_mul(frag),
    })
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Judges a reading (or the failure to get one) of `dir` against the
/// `[host]` thresholds. Pure: tests feed it readings.
pub fn judge(
    reading: Result<Space, String>,
    dir: &str,
    cfg: &HostConfig,
    now: SystemTime,
) -> ComponentReport {
    let mut report = ComponentReport {
        id: COMPONENT.into(),
        kind: "disk".into(),
        labels: BTreeMap::from([("path".to_owned(), dir.to_owned())]),
        status_override: None,
        reasons: Vec::new(),
    };
    let space = match reading {
        Ok(s) => s,
        Err(message) => {
            report.status_override = Some(Status::Unknown);
            report.reasons.push(Reason {
                status: Status::Unknown,
                signal: "disk.statvfs".into(),
                value: String::new(),
                threshold: String::new(),
                window: String::new(),
                since: now,
                message,
            });
            return report;
        }
    };
    report.labels.insert("total".into(), gib(space.total));
    report
        .labels
        .insert("available".into(), gib(space.available));
    let pct = space.available_percent();
    let (status, threshold) = if pct < cfg.checkpoint_failed_below_percent {
        (Status::Failed, cfg.checkpoint_failed_below_percent)
    } else if pct < cfg.checkpoint_degraded_below_percent {
        (Status::Degraded, cfg.checkpoint_degraded_below_percent)
    } else {
        return report;
    };
    report.reasons.push(Reason {
        status,
        signal: "disk.available_percent".into(),
        value: format!("{pct:.1}%"),
        threshold: format!("< {threshold}%"),
        window: String::new(),
        since: now,
        message: format!(
            "only {} of {} free on the checkpoint tier {dir} ({pct:.1}%): the next checkpoint may not fit",
            gib(space.available),
            gib(space.total)
        ),
    });
    report
}

/// Checks the `[host]` keys this source reads: `(key, value, why)`.
pub fn validate(cfg: &HostConfig) -> Result<(), (&'static str, String, String)> {
    if !cfg.checkpoint_dir.is_empty() && !Path::new(&cfg.checkpoint_dir).is_absolute() {
        return Err((
            "host.checkpoint_dir",
            format!("{:?}", cfg.checkpoint_dir),
            "must be an absolute path, or empty for off".into(),
        ));
    }
    for (key, v) in [
        (
            "host.checkpoint_degraded_below_percent",
            cfg.checkpoint_degraded_below_percent,
        ),
        (
            "host.checkpoint_failed_below_percent",
            cfg.checkpoint_failed_below_percent,
        ),
    ] {
        if !(0.0..=100.0).contains(&v) {
            return Err((key, v.to_string(), "must be a percentage, 0 to 100".into()));
        }
    }
    if cfg.checkpoint_failed_below_percent > cfg.checkpoint_degraded_below_percent {
        return Err((
            "host.checkpoint_failed_below_percent",
            cfg.checkpoint_failed_below_percent.to_string(),
            "must not exceed host.checkpoint_degraded_below_percent".into(),
        ));
    }
    Ok(())
}

/// The checkpoint-tier source, run by [`super::runner`].
#[derive(Debug)]
pub struct HostDisk {
    dir: PathBuf,
    cfg: HostConfig,
}

impl HostDisk {
    /// Watches `[host] checkpoint_dir`; None when it is empty (off).
    pub fn new(cfg: HostConfig) -> Option<Self> {
        if cfg.checkpoint_dir.is_empty() {
            return None;
        }
        Some(Self {
            dir: PathBuf::from(&cfg.checkpoint_dir),
            cfg,
        })
    }
}

impl super::Source for HostDisk {
    fn name(&self) -> &'static str {
        "host_disk"
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        super::Poll {
            reports: vec![judge(
                read(&self.dir),
                &self.cfg.checkpoint_dir,
                &self.cfg,
                now,
            )],
            events: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds() {
        let cfg = HostConfig::default();
        let now = SystemTime::now();
        let at = |available| {
            Ok(Space {
                total: 1000,
                available,
            })
        };
        assert!(judge(at(500), "/x", &cfg, now).reasons.is_empty());
        assert_eq!(
            judge(at(50), "/x", &cfg, now).reasons[0].status,
            Status::Degraded
        );
        assert_eq!(
            judge(at(10), "/x", &cfg, now).reasons[0].status,
            Status::Failed
        );
        let gone = judge(read(Path::new("/nonexistent/ckpt")), "/x", &cfg, now);
        assert_eq!(gone.status_override, Some(Status::Unknown));
    }

    #[test]
    fn reads_a_real_filesystem() {
        let s = read(Path::new("/")).unwrap_or_else(|e| panic!("{e}"));
        assert!(s.total > 0 && s.available <= s.total, "{s:?}");
    }
}
