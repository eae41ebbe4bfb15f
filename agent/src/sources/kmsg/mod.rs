//! The kernel log: NVIDIA XIDs, OOM kills and NIC link changes.
//!
//! In: `/dev/kmsg` records (`priority,seq,usec,flags;message`), or the lines
//! of a file or FIFO named in `[kmsg] path` (dmesg-style `[  12.3] message`
//! and plain messages work too), followed like `tail -f`. Out: one event per
//! recognised line (`kmsg.xid`, `kmsg.oom_kill`, `kmsg.link_down`,
//! `kmsg.link_up`) with its evidence (an XID also counts in
//! `warden_gpu_xids_total{source="kmsg"}`), and reasons on `gpuN` (an XID, held for
//! `[kmsg] xid_hold`), `nic/NAME` (while the link is down) and `host/oom`
//! (held for `[kmsg] oom_hold`). Never: stop the agent. A log that cannot be
//! opened makes the `kmsg` component UNKNOWN with the reason and is retried;
//! a line that is not understood is counted and ignored.
//!
//! Parsing is pure ([`parse_line`]), so recorded lines under
//! `tests/fixtures/kmsg/` test it; how bad each XID is comes from the one
//! XID table, [`warden_core::taxonomy::xid`], which NVML and the simulated source
//! read too.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime};
use warden_core::device::DeviceId;
use warden_core::taxonomy::signals::HealthSignal;

use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::signal::{OomKill, Report, Signal, Xid, XidSource};

pub mod config;
pub use config::{KmsgConfig, normalize_pci};

/// The component that stands for the kernel log itself.
pub const COMPONENT: &str = "kmsg";
/// The component OOM kills are reported on.
pub const OOM_COMPONENT: &str = "host/oom";

/// How bad an XID is: (status of the GPU, class from the fault taxonomy),
/// as the one XID table (`warden_core::taxonomy::xid`) says; anything it
/// does not list is DEGRADED there, since an unknown XID is worth a look
/// but not a verdict.
pub fn xid_verdict(xid: u32) -> (Status, &'static str) {
    let rule = warden_core::taxonomy::xid::rule(xid);
    (rule.status, rule.class.as_str())
}

/// A kernel-log line the source understands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelEvent {
    /// `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.`
    Xid {
        /// Normalised PCI address.
        pci: String,
        /// The XID number.
        xid: u32,
        /// The process the driver blamed, when it named one.
        pid: Option<u32>,
        /// Its name, when given.
        name: Option<String>,
        /// The rest of the line.
        text: String,
    },
    /// `Out of memory: Killed process 1234 (python)` or an `oom-kill:` line.
    OomKill {
        /// The killed process.
        pid: u32,
        /// Its command name.
        name: String,
    },
    /// A NIC link going down or up.
    Link {
        /// Interface (or device) name.
        nic: String,
        /// True for up.
        up: bool,
    },
}

/// What a line turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// A line this source acts on.
    Event(KernelEvent),
    /// A line of no interest (most of the log).
    Other,
    /// A line that looked like one of ours but did not parse.
    Malformed,
}

/// Strips the `/dev/kmsg` record header, a dmesg `[ 12.345]` stamp or a
/// syslog `... kernel: ` prefix, leaving the message.
fn message(line: &str) -> &str {
    let mut m = line.trim_end_matches(['\n', '\r']);
    // /dev/kmsg: "6,1234,5678901,-;message" (header fields have no spaces).
    if let Some((head, rest)) = m.split_once(';')
        && head.split(',').count() >= 3
        && head
            .split(',')
            .take(3)
            .all(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_digit()))
    {
        m = rest;
    }
    if let Some(i) = m.find("kernel: ") {
        m = &m[i + "kernel: ".len()..];
    }
    let t = m.trim_start();
    if let Some(rest) = t.strip_prefix('[')
        && let Some((stamp, after)) = rest.split_once(']')
        && stamp.trim().chars().all(|c| c.is_ascii_digit() || c == '.')
    {
        return after.trim_start();
    }
    t
}

/// Parses one kernel-log line.
pub fn parse_line(line: &str) -> Parsed {
    // Continuation lines of a /dev/kmsg record (" SUBSYSTEM=pci") carry
    // dictionary keys, not messages.
    if line.starts_with(' ') && line.contains('=') && !line.contains("Xid") {
        return Parsed::Other;
    }
    let m = message(line);
    if let Some(i) = m.find("NVRM: Xid") {
        return parse_xid(&m[i + "NVRM: Xid".len()..]).map_or(Parsed::Malformed, Parsed::Event);
    }
    if let Some(i) = m.find("Killed process ") {
        return parse_killed(&m[i + "Killed process ".len()..])
            .map_or(Parsed::Malformed, Parsed::Event);
    }
    if let Some(i) = m.find("oom-kill:") {
        return parse_oom_kill(&m[i + "oom-kill:".len()..])
            .map_or(Parsed::Malformed, Parsed::Event);
    }
    parse_link(m).map_or(Parsed::Other, Parsed::Event)
}

/// ` (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.`
fn parse_xid(rest: &str) -> Option<KernelEvent> {
    let rest = rest.trim_start().strip_prefix('(')?;
    let (addr, rest) = rest.split_once(')')?;
    let pci = normalize_pci(addr)?;
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let (num, mut rest) = rest.split_once(',').unwrap_or((rest, ""));
    let xid = num.trim().parse().ok()?;
    let mut pid = None;
    let mut name = None;
    loop {
        let r = rest.trim_start();
        if let Some(v) = r.strip_prefix("pid=") {
            let (v, tail) = v.split_once(',').unwrap_or((v, ""));
            pid = v.trim().trim_matches('\'').parse().ok();
            rest = tail;
        } else if let Some(v) = r.strip_prefix("name=") {
            let (v, tail) = v.split_once(',').unwrap_or((v, ""));
            let v = v.trim();
            if !v.is_empty() && v != "<unknown>" {
                name = Some(v.to_owned());
            }
            rest = tail;
        } else {
            rest = r;
            break;
        }
    }
    Some(KernelEvent::Xid {
        pci,
        xid,
        pid,
        name,
        text: rest.trim().to_owned(),
    })
}

/// `1234 (python) total-vm:...`
fn parse_killed(rest: &str) -> Option<KernelEvent> {
    let (pid, rest) = rest.split_once(' ')?;
    let pid = pid.parse().ok()?;
    let name = rest.strip_prefix('(')?.split_once(')')?.0.to_owned();
    Some(KernelEvent::OomKill { pid, name })
}

/// `constraint=CONSTRAINT_NONE,...,task=python,pid=1234,uid=0`
fn parse_oom_kill(rest: &str) -> Option<KernelEvent> {
    let field = |k: &str| {
        rest.split(',')
            .find_map(|kv| kv.trim().strip_prefix(k)?.strip_prefix('='))
    };
    Some(KernelEvent::OomKill {
        pid: field("pid")?.parse().ok()?,
        name: field("task")?.to_owned(),
    })
}

/// `mlx5_core 0000:3b:00.0 eth2: Link down`, `ib0: link down`,
/// `e1000e 0000:00:1f.6 eno1: NIC Link is Up 1000 Mbps Full Duplex`.
fn parse_link(m: &str) -> Option<KernelEvent> {
    let lower = m.to_ascii_lowercase();
    let (at, up) = ["link is down", "link down"]
        .iter()
        .find_map(|p| lower.find(p).map(|i| (i, false)))
        .or_else(|| {
            ["link is up", "link up"]
                .iter()
                .find_map(|p| lower.find(p).map(|i| (i, true)))
        })?;
    // The interface is the last "name:" before the phrase.
    let nic = m[..at]
        .split_whitespace()
        .rev()
        .find_map(|t| t.strip_suffix(':'))
        .filter(|n| !n.is_empty() && !n.contains('(') && !n.contains("NVRM"))?;
    Some(KernelEvent::Link {
        nic: nic.to_owned(),
        up,
    })
}

/// GPU index by normalised PCI address, from `/proc/driver/nvidia/gpus`.
fn gpu_map_from_procfs(root: &Path) -> BTreeMap<String, usize> {
    let mut map = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(root) else {
        return map;
    };
    for entry in dir.flatten() {
        let Some(pci) = normalize_pci(&entry.file_name().to_string_lossy()) else {
            continue;
        };
        let info = std::fs::read_to_string(entry.path().join("information")).unwrap_or_default();
        if let Some(minor) = info.lines().find_map(|l| {
            l.strip_prefix("Device Minor:")
                .and_then(|v| v.trim().parse::<usize>().ok())
        }) {
            map.insert(pci, minor);
        }
    }
    map
}

/// An XID still held on a GPU.
#[derive(Debug, Clone)]
struct HeldXid {
    first: SystemTime,
    last: SystemTime,
    count: u64,
    pci: String,
    text: String,
}

/// The kernel log source, run by [`super::runner`].
#[derive(Debug)]
pub struct Kmsg {
    cfg: KmsgConfig,
    gpu_by_pci: BTreeMap<String, usize>,
    file: Option<File>,
    /// A `/dev/kmsg`-like device: one record per read.
    record_device: bool,
    /// Bytes of an unfinished last line (files and FIFOs).
    pending: Vec<u8>,
    /// Offset read up to in a regular file (to spot truncation).
    offset: u64,
    open_error: Option<String>,
    /// Per GPU component: XID number -> what is held.
    xids: BTreeMap<String, BTreeMap<u32, HeldXid>>,
    /// Links currently down: nic -> since.
    links: BTreeMap<String, SystemTime>,
    /// Links seen up again, to be reported OK once.
    links_up: Vec<String>,
    /// Last OOM kill: (time, pid, name, count).
    oom: Option<(SystemTime, u32, String, u64)>,
    /// GPU components that lost their last XID and must be reported clear.
    cleared: Vec<String>,
}

impl Kmsg {
    /// A source reading `cfg.path`.
    pub fn new(cfg: KmsgConfig) -> Self {
        let mut gpu_by_pci: BTreeMap<String, usize> = cfg
            .gpu_pci
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((normalize_pci(p)?, i)))
            .collect();
        if gpu_by_pci.is_empty() {
            gpu_by_pci = gpu_map_from_procfs(Path::new("/proc/driver/nvidia/gpus"));
        }
        Self {
            cfg,
            gpu_by_pci,
            file: None,
            record_device: false,
            pending: Vec::new(),
            offset: 0,
            open_error: None,
            xids: BTreeMap::new(),
            links: BTreeMap::new(),
            links_up: Vec::new(),
            oom: None,
            cleared: Vec::new(),
        }
    }

    /// The component of the GPU at `pci`.
    fn gpu_component(&self, pci: &str) -> String {
        match self.gpu_by_pci.get(pci).map(|i| u32::try_from(*i)) {
            Some(Ok(i)) => DeviceId::Gpu(i).to_string(),
            _ => DeviceId::gpu_at_unknown_pci(pci),
        }
    }

    fn open(&mut self) -> Result<(), String> {
        let path = &self.cfg.path;
        // Non-blocking: a FIFO with no writer must not block open, and reads
        // must return at once when nothing new was logged.
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| format!("cannot open {path}: {e}"))?;
        let meta = f
            .metadata()
            .map_err(|e| format!("cannot stat {path}: {e}"))?;
        self.record_device = meta.file_type().is_char_device();
        self.pending.clear();
        self.offset = 0;
        if !self.cfg.from_start && !meta.file_type().is_fifo() {
            // /dev/kmsg supports SEEK_END (to the next new record) too.
            self.offset = f.seek(SeekFrom::End(0)).unwrap_or(0);
        }
        self.file = Some(f);
        Ok(())
    }

    /// Reads what is new; returns complete lines.
    fn read_lines(&mut self) -> Result<Vec<String>, String> {
        let path = self.cfg.path.clone();
        let Some(f) = self.file.as_mut() else {
            return Ok(Vec::new());
        };
        if !self.record_device
            && let Ok(meta) = f.metadata()
            && meta.is_file()
        {
            let replaced = std::fs::metadata(&path).is_ok_and(|m| {
                use std::os::unix::fs::MetadataExt;
                m.ino() != meta.ino() || m.dev() != meta.dev()
            });
            if replaced || meta.len() < self.offset {
                // Rotated or truncated: start over from the beginning.
                let mut reopened =
                    std::fs::File::open(&path).map_err(|e| format!("cannot reopen {path}: {e}"))?;
                if !replaced {
                    reopened
                        .seek(SeekFrom::Start(0))
                        .map_err(|e| e.to_string())?;
                }
                *f = reopened;
                self.offset = 0;
                self.pending.clear();
            }
        }
        let mut lines = Vec::new();
        let mut buf = vec![0u8; 16 * 1024];
        // Bounded per poll so a flood cannot starve the rest of the poll.
        for _ in 0..1024 {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    self.offset += n as u64;
                    let chunk = buf.get(..n).unwrap_or_default();
                    if self.record_device {
                        lines.push(String::from_utf8_lossy(chunk).into_owned());
                    } else {
                        self.pending.extend_from_slice(chunk);
                        while let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = self.pending.drain(..=i).collect();
                            lines.push(String::from_utf8_lossy(&line).into_owned());
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // /dev/kmsg: records were overwritten before we read them;
                // the next read returns the oldest one still there.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    metrics::counter!("warden_kmsg_lines_total", "result" => "lost").increment(1);
                }
                Err(e) => {
                    self.file = None;
                    return Err(format!("cannot read {path}: {e}"));
                }
            }
        }
        Ok(lines)
    }

    /// Applies one parsed line at `now`; returns its event.
    fn apply(&mut self, ev: KernelEvent, raw: &str, now: SystemTime) -> Option<Signal> {
        let raw = raw.trim_end();
        match ev {
            KernelEvent::Xid {
                pci,
                xid,
                pid,
                name,
                text,
            } => {
                let component = self.gpu_component(&pci);
                let (status, class) = xid_verdict(xid);
                crate::sources::nvml::count_xid(&component, u64::from(xid), "kmsg");
                let held = self.xids.entry(component.clone()).or_default();
                let h = held.entry(xid).or_insert_with(|| HeldXid {
                    first: now,
                    last: now,
                    count: 0,
                    pci: pci.clone(),
                    text: String::new(),
                });
                h.last = now;
                h.count += 1;
                h.text.clone_from(&text);
                self.cleared.retain(|c| *c != component);
                let severity = if status == Status::Failed {
                    Severity::Critical
                } else {
                    Severity::Warning
                };
                let mut report = Report::new(format!("{component}: XID {xid} ({class}): {text}"))
                    .with("pci", &pci)
                    .with("xid", xid)
                    .with("class", class)
                    .with("status", status);
                if let Some(pid) = pid {
                    report = report.with("pid", pid);
                }
                if let Some(name) = name {
                    report = report.with("process", name);
                }
                Some(Signal::Xid(Xid {
                    source: XidSource::Kmsg,
                    severity,
                    component,
                    xid: u64::from(xid),
                    pid,
                    report: report.with("text", text).with("line", raw),
                }))
            }
            KernelEvent::OomKill { pid, name } => {
                // The kernel logs "Killed process" and "oom-kill:" for one
                // kill: one event.
                if let Some((t, last_pid, _, _)) = &self.oom
                    && *last_pid == pid
                    && now.duration_since(*t).unwrap_or_default() < Duration::from_secs(10)
                {
                    return None;
                }
                let count = self.oom.as_ref().map_or(0, |o| o.3) + 1;
                self.oom = Some((now, pid, name.clone(), count));
                Some(Signal::OomKill(OomKill {
                    component: OOM_COMPONENT.to_owned(),
                    pid,
                    process: name,
                    line: raw.to_owned(),
                }))
            }
            KernelEvent::Link { nic, up } => {
                let component = format!("nic/{nic}");
                if up {
                    self.links.remove(&nic);
                    self.links_up.push(nic.clone());
                } else {
                    self.links.entry(nic.clone()).or_insert(now);
                    self.links_up.retain(|n| *n != nic);
                }
                let (kind, severity, word) = if up {
                    ("kmsg.link_up", Severity::Info, "up")
                } else {
                    ("kmsg.link_down", Severity::Error, "down")
                };
                Some(
                    NewEvent::new(severity, kind, component, format!("NIC {nic}: link {word}"))
                        .with("nic", nic)
                        .with("line", raw)
                        .into(),
                )
            }
        }
    }

    /// Drops held XIDs older than `xid_hold`.
    fn expire(&mut self, now: SystemTime) {
        let hold = self.cfg.xid_hold;
        for (component, held) in &mut self.xids {
            held.retain(|_, h| now.duration_since(h.last).unwrap_or_default() < hold);
            if held.is_empty() {
                self.cleared.push(component.clone());
            }
        }
        self.xids.retain(|_, h| !h.is_empty());
    }

    fn reports(&mut self, now: SystemTime) -> Vec<ComponentReport> {
        let mut out = Vec::new();
        let report = |id: String, kind: &str| ComponentReport {
            id,
            kind: kind.into(),
            labels: BTreeMap::new(),
            status_override: None,
            reasons: Vec::new(),
        };
        let mut me = report(COMPONENT.into(), "host");
        me.labels.insert("path".into(), self.cfg.path.clone());
        if let Some(e) = &self.open_error {
            me.status_override = Some(Status::Unknown);
            me.reasons.push(Reason {
                status: Status::Unknown,
                kind: ReasonKind::Judged,
                signal: "kmsg.readable".into(),
                value: String::new(),
                threshold: String::new(),
                window: String::new(),
                since: now,
                message: format!(
                    "{e}: kernel-log faults (XIDs, OOM kills, link flaps) are not seen"
                ),
            });
        }
        out.push(me);
        for (component, held) in &self.xids {
            let mut r = report(component.clone(), "gpu");
            for (xid, h) in held {
                let (status, class) = xid_verdict(*xid);
                r.labels.insert("pci".into(), h.pci.clone());
                r.reasons.push(Reason {
                    status,
                    kind: ReasonKind::Xid,
                    signal: format!("kmsg.xid.{xid}"),
                    value: format!("{} in the log", h.count),
                    threshold: "any".into(),
                    window: humantime::format_duration(self.cfg.xid_hold).to_string(),
                    since: h.first,
                    message: format!("XID {xid} ({class}): {}", h.text),
                });
            }
            out.push(r);
        }
        for component in self.cleared.drain(..) {
            out.push(report(component, "gpu"));
        }
        for (nic, since) in &self.links {
            let mut r = report(format!("nic/{nic}"), "nic");
            r.reasons.push(Reason {
                status: Status::Failed,
                kind: ReasonKind::Judged,
                signal: HealthSignal::KmsgLink.name().into(),
                value: "down".into(),
                threshold: "up".into(),
                window: String::new(),
                since: *since,
                message: format!("the kernel logged link down on {nic}"),
            });
            out.push(r);
        }
        for nic in self.links_up.drain(..) {
            out.push(report(format!("nic/{nic}"), "nic"));
        }
        if let Some((t, pid, name, count)) = &self.oom {
            let mut r = report(OOM_COMPONENT.into(), "host");
            if now.duration_since(*t).unwrap_or_default() < self.cfg.oom_hold {
                r.reasons.push(Reason {
                    status: Status::Degraded,
                    kind: ReasonKind::Judged,
                    signal: HealthSignal::OomKill.name().into(),
                    value: format!("{count} kills"),
                    threshold: "any".into(),
                    window: humantime::format_duration(self.cfg.oom_hold).to_string(),
                    since: *t,
                    message: format!("the OOM killer killed process {pid} ({name})"),
                });
            } else {
                self.oom = None;
            }
            out.push(r);
        }
        out
    }
}

impl crate::sources::SourceKind for Kmsg {
    const NAME: &'static str = "kmsg";
    type Config = KmsgConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a KmsgConfig {
        settings.kmsg
    }

    fn validate(cfg: &KmsgConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        cfg.validate(origin)
    }

    fn build(
        cfg: &KmsgConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        let _ = settings;
        Ok(cfg
            .enabled
            .then(|| Box::new(Self::new(cfg.clone())) as Box<dyn crate::sources::Source>))
    }
}

impl super::Source for Kmsg {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        let mut events = Vec::new();
        if self.file.is_none() {
            match self.open() {
                Ok(()) => self.open_error = None,
                Err(e) => {
                    if self.open_error.as_ref() != Some(&e) {
                        tracing::warn!(error = %e, "kernel log unreadable; retrying every poll");
                    }
                    self.open_error = Some(e);
                }
            }
        }
        match self.read_lines() {
            Ok(lines) => {
                for line in lines {
                    match parse_line(&line) {
                        Parsed::Event(ev) => {
                            metrics::counter!("warden_kmsg_lines_total", "result" => "matched")
                                .increment(1);
                            events.extend(self.apply(ev, &line, now));
                        }
                        Parsed::Other => {
                            metrics::counter!("warden_kmsg_lines_total", "result" => "other")
                                .increment(1);
                        }
                        Parsed::Malformed => {
                            metrics::counter!("warden_kmsg_lines_total", "result" => "malformed")
                                .increment(1);
                            tracing::debug!(line = %line.trim_end(), "kernel-log line not understood");
                        }
                    }
                }
            }
            Err(e) => self.open_error = Some(e),
        }
        self.expire(now);
        super::Poll {
            reports: self.reports(now),
            events,
        }
    }
}

#[cfg(test)]
mod tests;
