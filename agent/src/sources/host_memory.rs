//! Host memory pressure from `/proc/meminfo`.
//!
//! Low available memory is the leading sign of an OOM kill, which takes a
//! rank down with a SIGKILL that looks like a crash; reporting it first lets
//! attribution blame the host, not the job's code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::sources::host_config::HostConfig;
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::taxonomy::signals::HealthSignal;

/// The component id this source reports on.
pub const COMPONENT: &str = "host/memory";

/// Why meminfo could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MemInfoError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A field we need is missing or not a number.
    #[error("{path}: field {field} missing or not a number")]
    Field {
        /// The file.
        path: String,
        /// The field name.
        field: &'static str,
    },
}

/// Total and available memory, in kiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total_kib: u64,
    /// `MemAvailable`: what can be allocated without swapping.
    pub available_kib: u64,
}

impl MemInfo {
    /// Available memory as a percentage of the total.
    pub fn available_percent(&self) -> f64 {
        if self.total_kib == 0 {
            return 0.0;
        }
        self.available_kib as f64 * 100.0 / self.total_kib as f64
    }
}

/// Parses the text of `/proc/meminfo`.
pub fn parse(text: &str, path: &str) -> Result<MemInfo, MemInfoError> {
    let field = |name: &'static str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .ok_or(MemInfoError::Field {
                path: path.to_owned(),
                field: name,
            })
    };
    Ok(MemInfo {
        total_kib: field("MemTotal")?,
        available_kib: field("MemAvailable")?,
    })
}

/// Reads meminfo from `path` (normally `/proc/meminfo`).
pub fn read(path: &Path) -> Result<MemInfo, MemInfoError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| MemInfoError::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown)
}

/// Judges a reading (or the failure to get one) against the thresholds.
pub fn judge(
    reading: Result<MemInfo, MemInfoError>,
    cfg: &HostConfig,
    now: SystemTime,
) -> ComponentReport {
    let mut report = ComponentReport {
        id: COMPONENT.into(),
        kind: "host".into(),
        labels: BTreeMap::new(),
        status_override: None,
        reasons: Vec::new(),
    };
    match reading {
        Err(e) => {
            report.status_override = Some(Status::Unknown);
            report.reasons.push(Reason {
                status: Status::Unknown,
                kind: ReasonKind::Judged,
                signal: "memory.meminfo".into(),
                value: String::new(),
                threshold: String::new(),
                window: String::new(),
                since: now,
                message: e.to_string(),
            });
        }
        Ok(m) => {
            report
                .labels
                .insert("total".into(), format!("{} MiB", m.total_kib / 1024));
            let pct = m.available_percent();
            let (status, threshold) = if pct < cfg.memory_failed_below_percent {
                (Status::Failed, cfg.memory_failed_below_percent)
            } else if pct < cfg.memory_degraded_below_percent {
                (Status::Degraded, cfg.memory_degraded_below_percent)
            } else {
                return report;
            };
            report.reasons.push(Reason {
                status,
                kind: ReasonKind::Judged,
                signal: HealthSignal::HostMemory.name().into(),
                value: format!("{pct:.1}%"),
                threshold: format!("< {threshold}%"),
                window: String::new(),
                since: now,
                message: format!(
                    "only {} MiB of {} MiB available ({pct:.1}%): ranks risk the OOM killer",
                    m.available_kib / 1024,
                    m.total_kib / 1024
                ),
            });
        }
    }
    report
}

/// Reads meminfo again through `file`, kept open from an earlier read
/// (procfs regenerates the text at each read from offset 0).
fn reread(file: &std::fs::File, path: &Path) -> Result<MemInfo, MemInfoError> {
    use std::os::unix::fs::FileExt;
    let shown = path.display().to_string();
    let err = |source| MemInfoError::Read {
        path: shown.clone(),
        source,
    };
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        let n = file.read_at(&mut buf[len..], len as u64).map_err(err)?;
        if n == 0 {
            break;
        }
        len += n;
    }
    let text = String::from_utf8_lossy(&buf[..len]);
    parse(&text, &shown)
}

/// The host memory source, run by [`super::runner`].
#[derive(Debug)]
pub struct HostMemory {
    meminfo: PathBuf,
    /// `/proc/meminfo`, held open between polls: reading it needs no new
    /// descriptor, so a flood that takes the agent's last one (issue 29)
    /// cannot turn `host/memory` UNKNOWN. Opened again after an error.
    file: Option<std::fs::File>,
    cfg: HostConfig,
}

/// Checks the `[host]` keys this source reads (a bad one is
/// [`warden_core::config::ConfigError::Invalid`]).
pub fn validate(cfg: &HostConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
    if cfg.memory_failed_below_percent > cfg.memory_degraded_below_percent {
        return Err(warden_core::config::ConfigError::invalid(
            origin,
            "host.memory_failed_below_percent",
            cfg.memory_failed_below_percent.to_string(),
            "must not exceed host.memory_degraded_below_percent",
        ));
    }
    Ok(())
}

impl HostMemory {
    /// Reads `/proc/meminfo` with the `[host]` thresholds.
    pub fn new(cfg: HostConfig) -> Self {
        let meminfo = PathBuf::from("/proc/meminfo");
        Self {
            file: std::fs::File::open(&meminfo).ok(),
            meminfo,
            cfg,
        }
    }

    fn read(&mut self) -> Result<MemInfo, MemInfoError> {
        if self.file.is_none() {
            self.file =
                Some(
                    std::fs::File::open(&self.meminfo).map_err(|source| MemInfoError::Read {
                        path: self.meminfo.display().to_string(),
                        source,
                    })?,
                );
        }
        let r = match &self.file {
            Some(f) => reread(f, &self.meminfo),
            None => read(&self.meminfo),
        };
        if r.is_err() {
            self.file = None;
        }
        r
    }
}

impl crate::sources::SourceKind for HostMemory {
    const NAME: &'static str = "host";
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
        let _ = settings;
        Ok(Some(Box::new(Self::new(cfg.clone()))))
    }
}

impl super::Source for HostMemory {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        super::Poll {
            reports: vec![judge(self.read(), &self.cfg, now)],
            events: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str =
        "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    1200000 kB\n";

    #[test]
    fn parses_meminfo() {
        let m = parse(SAMPLE, "x").unwrap();
        assert_eq!(m.total_kib, 16_000_000);
        assert_eq!(m.available_kib, 1_200_000);
    }

    #[test]
    fn missing_field_is_named() {
        let e = parse("MemTotal: 10 kB\n", "x").unwrap_err().to_string();
        assert!(e.contains("MemAvailable"), "{e}");
    }

    #[test]
    fn thresholds() {
        let cfg = HostConfig::default();
        let now = SystemTime::now();
        let at = |avail| MemInfo {
            total_kib: 1000,
            available_kib: avail,
        };
        assert!(judge(Ok(at(500)), &cfg, now).reasons.is_empty());
        assert_eq!(
            judge(Ok(at(50)), &cfg, now).reasons[0].status,
            Status::Degraded
        );
        assert_eq!(
            judge(Ok(at(10)), &cfg, now).reasons[0].status,
            Status::Failed
        );
        let unreadable = judge(read(Path::new("/nonexistent/meminfo")), &cfg, now);
        assert_eq!(unreadable.status_override, Some(Status::Unknown));
    }

    #[test]
    fn the_open_file_reads_again_without_a_new_descriptor() {
        let mut m = HostMemory::new(HostConfig::default());
        let first = m.read().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(m.file.as_ref().unwrap());
        let second = m.read().unwrap();
        assert_eq!(first.total_kib, second.total_kib);
        assert_eq!(
            fd,
            std::os::fd::AsRawFd::as_raw_fd(m.file.as_ref().unwrap())
        );
    }
}
