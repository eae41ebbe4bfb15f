//! Free space of the checkpoint tier (`[host] checkpoint_dir`, by default
//! the agent's own tier directory `[checkpoint] dir`), read with statvfs.
//!
//! A checkpoint that does not fit fails late and takes the job's last good
//! state with it; low free space is reported before the write, as
//! `disk/checkpoint`, DEGRADED and FAILED below the `[host]` thresholds.
//!
//! FAILED is the node's verdict, so it is given only for space that is the
//! agent's: the watched directory is a filesystem of its own (a mount
//! point) that the agent owns and nobody else may write. On a filesystem
//! others can write too (the default `/dev/shm`, mode 1777; a directory
//! on the root filesystem, beside `/tmp`) a stranger could fill it and
//! drain the node, so there the same shortage is DEGRADED, with the cause
//! ("shared with other users: ...") in the reason and label `shared`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use warden_core::config::ConfigError;
use warden_core::taxonomy::signals::HealthSignal;

use crate::sources::host_config::HostConfig;
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};

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

/// Whether the filesystem holding `dir` is the agent's alone: None when
/// `dir` is a mount point owned by the agent (`me`) that group and others
/// cannot write; else why others may fill it (for the reason).
pub fn shared(dir: &Path, me: u32) -> Result<Option<String>, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot stat {}: {e}", dir.display()))?;
    // The mount point: the highest ancestor on the same device.
    let mut root = dir.to_path_buf();
    while let Some(parent) = root.parent() {
        match std::fs::metadata(parent) {
            Ok(m) if m.dev() == meta.dev() => root = parent.to_path_buf(),
            _ => break,
        }
    }
    if root != dir {
        return Ok(Some(format!(
            "{} is a directory on the filesystem mounted at {}, which other users may fill too",
            dir.display(),
            root.display()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if meta.uid() != me || mode & 0o022 != 0 {
        return Ok(Some(format!(
            "{} (mode {mode:04o}, owner uid {}) is writable by users other than the agent's (uid {me})",
            dir.display(),
            meta.uid()
        )));
    }
    // A bind mount (a container's hostPath) of a directory inside a larger
    // filesystem shares that filesystem's space with whatever else is on it.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    match mount_root(&mountinfo, dir) {
        Some(r) if r == "/" => Ok(None),
        Some(r) => Ok(Some(format!(
            "{} is a bind mount of {r} inside a larger filesystem, which other users may fill too",
            dir.display()
        ))),
        None => Ok(Some(format!(
            "{} is not in /proc/self/mountinfo: the agent cannot tell whose space it is",
            dir.display()
        ))),
    }
}

/// The root within its filesystem (mountinfo's 4th field) of the last
/// mount at `at`: "/" for a whole filesystem, a directory for a bind mount.
fn mount_root(mountinfo: &str, at: &Path) -> Option<String> {
    // mountinfo escapes space, tab, newline and backslash as octal.
    let unescape = |s: &str| -> String {
        let mut out = Vec::with_capacity(s.len());
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'\\'
                && let Some(Ok(v)) = s.get(i + 1..i + 4).map(|o| u8::from_str_radix(o, 8))
            {
                out.push(v);
                i += 4;
                continue;
            }
            out.push(b[i]);
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    let at = at.to_str()?;
    mountinfo.lines().rev().find_map(|l| {
        let mut f = l.split(' ');
        let root = f.nth(3)?;
        let point = f.next()?;
        (unescape(point) == at).then(|| unescape(root))
    })
}

/// Judges a reading (or the failure to get one) of `dir` against the
/// `[host]` thresholds; `shared` says why others may fill the filesystem
/// (see [`shared`]): then a shortage is DEGRADED at most. Pure: tests
/// feed it readings.
pub fn judge(
    reading: Result<Space, String>,
    shared: Option<&str>,
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
                kind: ReasonKind::Judged,
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
    if let Some(why) = shared {
        report.labels.insert("shared".into(), why.to_owned());
    }
    let pct = space.available_percent();
    let (status, threshold) = if pct < cfg.checkpoint_failed_below_percent && shared.is_none() {
        (Status::Failed, cfg.checkpoint_failed_below_percent)
    } else if pct < cfg.checkpoint_degraded_below_percent
        || pct < cfg.checkpoint_failed_below_percent
    {
        (Status::Degraded, cfg.checkpoint_degraded_below_percent)
    } else {
        return report;
    };
    report.reasons.push(Reason {
        status,
        kind: ReasonKind::Judged,
        signal: HealthSignal::TierDisk.name().into(),
        value: format!("{pct:.1}%"),
        threshold: format!("< {threshold}%"),
        window: String::new(),
        since: now,
        message: match shared {
            None => format!(
                "only {} of {} free on the checkpoint tier {dir} ({pct:.1}%): the next checkpoint may not fit",
                gib(space.available),
                gib(space.total)
            ),
            Some(why) => format!(
                "only {} of {} free on the checkpoint tier {dir} ({pct:.1}%): the next checkpoint may not fit; \
                 DEGRADED, not FAILED: the filesystem is shared with other users ({why}), whose files may be what fills it",
                gib(space.available),
                gib(space.total)
            ),
        },
    });
    report
}

/// Checks the `[host]` keys this source reads (a bad one is [`ConfigError::Invalid`]).
pub fn validate(cfg: &HostConfig, origin: &str) -> Result<(), ConfigError> {
    if let Some(d) = &cfg.checkpoint_dir
        && !d.is_empty()
        && !Path::new(d).is_absolute()
    {
        return Err(ConfigError::invalid(
            origin,
            "host.checkpoint_dir",
            format!("{d:?}"),
            "must be an absolute path, empty for off, or unset for checkpoint.dir",
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
            return Err(ConfigError::invalid(
                origin,
                key,
                v.to_string(),
                "must be a percentage, 0 to 100",
            ));
        }
    }
    if cfg.checkpoint_failed_below_percent > cfg.checkpoint_degraded_below_percent {
        return Err(ConfigError::invalid(
            origin,
            "host.checkpoint_failed_below_percent",
            cfg.checkpoint_failed_below_percent.to_string(),
            "must not exceed host.checkpoint_degraded_below_percent",
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
    /// Watches `[host] checkpoint_dir`, or when it is unset the agent's
    /// tier `checkpoint` names (its `dir`, when the tier is on); None when
    /// it is empty (off) or unset with the tier off.
    pub fn new(
        cfg: HostConfig,
        checkpoint: &crate::ckpt::config::CheckpointConfig,
    ) -> Option<Self> {
        let dir = match &cfg.checkpoint_dir {
            Some(d) if d.is_empty() => return None,
            Some(d) => d.clone(),
            None if checkpoint.enabled => checkpoint.dir.clone(),
            None => return None,
        };
        Some(Self {
            dir: PathBuf::from(dir),
            cfg,
        })
    }
}

impl crate::sources::SourceKind for HostDisk {
    const NAME: &'static str = "host_disk";
    type Config = HostConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a HostConfig {
        settings.host
    }

    fn validate(cfg: &HostConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        validate(cfg, origin)
    }

    fn build(
        cfg: &HostConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        Ok(Self::new(cfg.clone(), settings.checkpoint)
            .map(|s| Box::new(s) as Box<dyn crate::sources::Source>))
    }
}

impl super::Source for HostDisk {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        let reading = read(&self.dir);
        // Unknown ownership counts as shared: never FAILED on a guess.
        let shared = match shared(&self.dir, warden_core::fsafe::me()) {
            Ok(s) => s,
            Err(e) => Some(e),
        };
        super::Poll {
            reports: vec![judge(
                reading,
                shared.as_deref(),
                &self.dir.display().to_string(),
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
        assert!(judge(at(500), None, "/x", &cfg, now).reasons.is_empty());
        assert_eq!(
            judge(at(50), None, "/x", &cfg, now).reasons[0].status,
            Status::Degraded
        );
        assert_eq!(
            judge(at(10), None, "/x", &cfg, now).reasons[0].status,
            Status::Failed
        );
        // Shared with others: DEGRADED at most, with the cause.
        let shared = judge(at(10), Some("/dev/shm is mode 1777"), "/x", &cfg, now);
        assert_eq!(shared.reasons[0].status, Status::Degraded);
        assert!(
            shared.reasons[0].message.contains("mode 1777"),
            "{shared:?}"
        );
        assert_eq!(shared.labels["shared"], "/dev/shm is mode 1777");
        assert!(
            judge(at(500), Some("x"), "/x", &cfg, now)
                .reasons
                .is_empty()
        );
        let gone = judge(read(Path::new("/nonexistent/ckpt")), None, "/x", &cfg, now);
        assert_eq!(gone.status_override, Some(Status::Unknown));
    }

    #[test]
    fn a_bind_mount_is_told_from_a_whole_filesystem() {
        let info = "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n\
                    30 22 0:25 / /dev/shm rw - tmpfs tmpfs rw\n\
                    41 22 8:1 /var/lib/warden /ckpt\\040dir rw - ext4 /dev/sda1 rw\n";
        assert_eq!(
            mount_root(info, Path::new("/dev/shm")).as_deref(),
            Some("/")
        );
        assert_eq!(
            mount_root(info, Path::new("/ckpt dir")).as_deref(),
            Some("/var/lib/warden")
        );
        assert_eq!(mount_root(info, Path::new("/nowhere")), None);
    }

    #[test]
    fn a_directory_on_a_larger_filesystem_is_shared() {
        let t = tempfile::tempdir().expect("tempdir");
        let why = shared(t.path(), warden_core::fsafe::me())
            .expect("stat")
            .expect("shared");
        assert!(why.contains("mounted at"), "{why}");
    }

    #[test]
    fn reads_a_real_filesystem() {
        let s = read(Path::new("/")).unwrap_or_else(|e| panic!("{e}"));
        assert!(s.total > 0 && s.available <= s.total, "{s:?}");
    }
}
