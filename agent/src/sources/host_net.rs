//! NIC and InfiniBand link health from sysfs.
//!
//! - Ethernet: `<sysfs>/class/net/NAME/{operstate,carrier,flags}` and the
//!   carrier-drop counter (`carrier_down_count`, else half of
//!   `carrier_changes`), as component `nic/NAME`.
//! - InfiniBand (and RoCE) ports: `<sysfs>/class/infiniband/DEV/ports/PORT/
//!   {state,phys_state,rate}` and `counters/link_downed`, as `ib/DEV/PORT`.
//!
//! Verdict (fault taxonomy, "infrastructure"): a link down now is FAILED; a
//! link that went down `link_flaps_degraded` times (default 2) within
//! `link_flap_window` (default 5m) is flapping, DEGRADED, and a
//! `net.link_flap` event says so once per episode. Counters are judged as
//! deltas over the window, never lifetime totals: a link that flapped last
//! week is healthy now.
//!
//! Which NICs: those named in `[host] net_interfaces`, else every one with a
//! `device` link (a physical function) whose name does not match
//! `net_ignore` (loopback, veth, docker, bridges...); administratively down
//! interfaces (`flags` without IFF_UP) are not watched unless named.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};
use warden_core::config::ConfigError;

use crate::sources::host_config::HostConfig;
use warden_core::events::{NewEvent, Severity};
use warden_core::health::window::CounterWindow;
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};

pub use super::host_config::DEFAULT_IGNORE;

/// Whether `name` matches one of `patterns` (a trailing `*` is a prefix).
pub fn matches(name: &str, patterns: &[String]) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == p,
    })
}

fn read_trim(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

fn read_u64(path: &Path) -> Option<u64> {
    read_trim(path)?.parse().ok()
}

/// One reading of a link, NIC or IB port.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkReading {
    /// `nic/eth0`, `ib/mlx5_0/1`.
    pub id: String,
    /// `nic` or `ib`.
    pub kind: &'static str,
    /// What the link is now, and why: None when up.
    pub down: Option<(Status, String)>,
    /// The lifetime link-down counter, if the kernel exposes one.
    pub downs: Option<u64>,
    /// Labels (speed, state, rate).
    pub labels: BTreeMap<String, String>,
}

/// Judges an Ethernet `operstate` (and `carrier`, for drivers that report
/// "unknown"). Pure.
pub fn judge_operstate(operstate: &str, carrier: Option<u64>) -> Option<(Status, String)> {
    match (operstate, carrier) {
        ("up", _) => None,
        ("unknown", Some(1)) => None,
        ("dormant" | "testing", _) => Some((
            Status::Degraded,
            format!("operstate {operstate}: not passing traffic yet"),
        )),
        (s, c) => Some((
            Status::Failed,
            format!(
                "operstate {s}, carrier {}: link down",
                c.map_or("unreadable".to_owned(), |c| c.to_string())
            ),
        )),
    }
}

/// Judges an IB port `state` ("4: ACTIVE"). Pure.
pub fn judge_ib_state(state: &str) -> Option<(Status, String)> {
    let name = state.split_once(':').map_or(state, |(_, n)| n).trim();
    match name {
        "ACTIVE" => None,
        "INIT" | "ARMED" | "ACTIVE_DEFER" => Some((
            Status::Degraded,
            format!("port state {name}: not active yet (subnet manager?)"),
        )),
        _ => Some((Status::Failed, format!("port state {name}: link down"))),
    }
}

/// Reads the NICs to watch under `<root>/class/net`.
pub fn read_nics(root: &Path, cfg: &HostConfig) -> Vec<LinkReading> {
    let base = root.join("class/net");
    let mut names: Vec<String> = match std::fs::read_dir(&base) {
        Ok(d) => d
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect(),
        Err(_) => return Vec::new(),
    };
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let dir = base.join(&name);
        let named = cfg.net_interfaces.contains(&name);
        if !cfg.net_interfaces.is_empty() && !named {
            continue;
        }
        if !named {
            if matches(&name, &cfg.net_ignore) || !dir.join("device").exists() {
                continue;
            }
            let flags = read_trim(&dir.join("flags"))
                .and_then(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok());
            if flags.is_some_and(|f| f & 0x1 == 0) {
                continue; // administratively down: nobody expects traffic
            }
        }
        let operstate = read_trim(&dir.join("operstate")).unwrap_or_else(|| "unreadable".into());
        let carrier = read_u64(&dir.join("carrier"));
        let downs = read_u64(&dir.join("carrier_down_count"))
            .or_else(|| read_u64(&dir.join("carrier_changes")).map(|c| c / 2));
        let mut labels = BTreeMap::from([("operstate".to_owned(), operstate.clone())]);
        if let Some(speed) = read_trim(&dir.join("speed")).filter(|s| !s.starts_with('-')) {
            labels.insert("speed".into(), format!("{speed} Mb/s"));
        }
        out.push(LinkReading {
            id: format!("nic/{name}"),
            kind: "nic",
            down: judge_operstate(&operstate, carrier),
            downs,
            labels,
        });
    }
    out
}

/// Reads every port under `<root>/class/infiniband`.
pub fn read_ib(root: &Path) -> Vec<LinkReading> {
    let base = root.join("class/infiniband");
    let mut out = Vec::new();
    let Ok(devs) = std::fs::read_dir(&base) else {
        return out;
    };
    let mut devs: Vec<String> = devs
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    devs.sort();
    for dev in devs {
        let Ok(ports) = std::fs::read_dir(base.join(&dev).join("ports")) else {
            continue;
        };
        let mut ports: Vec<String> = ports
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        ports.sort();
        for port in ports {
            let dir = base.join(&dev).join("ports").join(&port);
            let state = read_trim(&dir.join("state")).unwrap_or_else(|| "unreadable".into());
            let mut labels = BTreeMap::from([("state".to_owned(), state.clone())]);
            for key in ["phys_state", "rate", "link_layer"] {
                if let Some(v) = read_trim(&dir.join(key)) {
                    labels.insert(key.into(), v);
                }
            }
            out.push(LinkReading {
                id: format!("ib/{dev}/{port}"),
                kind: "ib",
                down: judge_ib_state(&state),
                downs: read_u64(&dir.join("counters/link_downed")),
                labels,
            });
        }
    }
    out
}

/// Checks the `[host]` keys this source reads (a bad one is [`ConfigError::Invalid`]).
pub fn validate(cfg: &HostConfig, origin: &str) -> Result<(), ConfigError> {
    if !Path::new(&cfg.sysfs_root).is_absolute() {
        return Err(ConfigError::invalid(
            origin,
            "host.sysfs_root",
            format!("{:?}", cfg.sysfs_root),
            "must be an absolute path",
        ));
    }
    if cfg.link_flap_window < Duration::from_secs(1) {
        return Err(ConfigError::invalid(
            origin,
            "host.link_flap_window",
            humantime::format_duration(cfg.link_flap_window).to_string(),
            "must be at least 1s",
        ));
    }
    if cfg.link_flaps_degraded == 0 {
        return Err(ConfigError::invalid(
            origin,
            "host.link_flaps_degraded",
            "0".into(),
            "must be at least 1",
        ));
    }
    Ok(())
}

/// The NIC and IB source, run by [`super::runner`].
#[derive(Debug)]
pub struct HostNet {
    root: PathBuf,
    cfg: HostConfig,
    /// Link-down counters per component, judged over `link_flap_window`.
    windows: HashMap<String, CounterWindow>,
    /// Components currently flapping, so `net.link_flap` is told once per
    /// episode, not on every poll.
    flapping: HashMap<String, bool>,
}

impl HostNet {
    /// Reads under `[host] sysfs_root` with the `[host]` windows.
    pub fn new(cfg: HostConfig) -> Self {
        Self {
            root: PathBuf::from(&cfg.sysfs_root),
            cfg,
            windows: HashMap::new(),
            flapping: HashMap::new(),
        }
    }

    /// One poll with both clocks given (tests advance `mono`).
    pub fn poll_at(&mut self, now: SystemTime, mono: Instant) -> super::Poll {
        let mut poll = super::Poll::default();
        let window = self.cfg.link_flap_window;
        let shown_window = humantime::format_duration(window).to_string();
        let mut links = read_nics(&self.root, &self.cfg);
        links.extend(read_ib(&self.root));
        for link in links {
            let mut report = ComponentReport {
                id: link.id.clone(),
                kind: link.kind.into(),
                labels: link.labels,
                status_override: None,
                reasons: Vec::new(),
            };
            if let Some((status, message)) = link.down {
                report.reasons.push(Reason {
                    status,
                    kind: ReasonKind::Judged,
                    signal: format!("{}.link_state", link.kind),
                    value: report
                        .labels
                        .get("operstate")
                        .or(report.labels.get("state"))
                        .cloned()
                        .unwrap_or_default(),
                    threshold: String::new(),
                    window: String::new(),
                    since: now,
                    message,
                });
            }
            if let Some(downs) = link.downs {
                let delta = self
                    .windows
                    .entry(link.id.clone())
                    .or_insert_with(|| CounterWindow::new(window))
                    .observe(mono, downs);
                let flapping = delta >= self.cfg.link_flaps_degraded;
                let was = self.flapping.insert(link.id.clone(), flapping);
                if flapping {
                    let message = format!(
                        "link went down {delta} times in {shown_window}: flapping (cable, optic or switch port)"
                    );
                    if was != Some(true) {
                        poll.events.push(
                            NewEvent::new(
                                Severity::Warning,
                                "net.link_flap",
                                link.id.clone(),
                                format!("{}: {message}", link.id),
                            )
                            .with("downs", delta)
                            .with("window", &shown_window)
                            .with("threshold", self.cfg.link_flaps_degraded)
                            .into(),
                        );
                    }
                    report.reasons.push(Reason {
                        status: Status::Degraded,
                        kind: ReasonKind::Judged,
                        signal: format!("{}.link_downs", link.kind),
                        value: delta.to_string(),
                        threshold: format!(">= {}", self.cfg.link_flaps_degraded),
                        window: shown_window.clone(),
                        since: now,
                        message,
                    });
                }
            }
            poll.reports.push(report);
        }
        poll
    }
}

impl crate::sources::SourceKind for HostNet {
    const NAME: &'static str = "host_net";
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

impl super::Source for HostNet {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        self.poll_at(now, Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let ignore: Vec<String> = DEFAULT_IGNORE.iter().map(|s| (*s).to_owned()).collect();
        assert!(matches("lo", &ignore));
        assert!(matches("veth12ab", &ignore));
        assert!(matches("docker0", &ignore));
        assert!(!matches("eth0", &ignore));
        assert!(!matches("lox", &ignore));
    }

    #[test]
    fn states() {
        assert_eq!(judge_operstate("up", Some(1)), None);
        assert_eq!(judge_operstate("unknown", Some(1)), None);
        assert_eq!(
            judge_operstate("down", Some(0)).map(|d| d.0),
            Some(Status::Failed)
        );
        assert_eq!(judge_ib_state("4: ACTIVE"), None);
        assert_eq!(judge_ib_state("1: DOWN").map(|d| d.0), Some(Status::Failed));
        assert_eq!(
            judge_ib_state("2: INIT").map(|d| d.0),
            Some(Status::Degraded)
        );
    }

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new("/"))).unwrap_or_default();
        std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }

    #[test]
    fn flaps_are_judged_over_the_window() {
        let Ok(dir) = tempfile::tempdir() else {
            panic!("tempdir")
        };
        let root = dir.path();
        let port = root.join("class/infiniband/mlx5_0/ports/1");
        write(&port.join("state"), "4: ACTIVE\n");
        write(&port.join("counters/link_downed"), "7\n");
        let cfg = HostConfig {
            sysfs_root: root.display().to_string(),
            ..HostConfig::default()
        };
        let mut src = HostNet::new(cfg);
        let t0 = Instant::now();
        let now = SystemTime::now();
        let p = src.poll_at(now, t0);
        assert_eq!(p.reports.len(), 1);
        assert!(p.reports[0].reasons.is_empty(), "lifetime total ignored");
        write(&port.join("counters/link_downed"), "8\n");
        let p = src.poll_at(now, t0 + Duration::from_secs(30));
        assert!(p.reports[0].reasons.is_empty(), "one flap is not a verdict");
        write(&port.join("counters/link_downed"), "9\n");
        let p = src.poll_at(now, t0 + Duration::from_secs(60));
        assert_eq!(p.reports[0].reasons[0].status, Status::Degraded);
        assert_eq!(p.events.len(), 1);
        assert_eq!(p.events[0].kind(), "net.link_flap");
        let p = src.poll_at(now, t0 + Duration::from_secs(90));
        assert!(p.events.is_empty(), "told once per episode");
        let p = src.poll_at(now, t0 + Duration::from_secs(600));
        assert!(p.reports[0].reasons.is_empty(), "flaps left the window");
        write(&port.join("state"), "1: DOWN\n");
        let p = src.poll_at(now, t0 + Duration::from_secs(610));
        assert_eq!(p.reports[0].reasons[0].status, Status::Failed);
    }
}
