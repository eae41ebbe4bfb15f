//! DCGM: GPU and NVSwitch health from NVIDIA's Data Center GPU Manager,
//! where fleets already run it.
//!
//! In: DCGM's health watches (`dcgmHealthSet` on all GPUs, `dcgmHealthCheck`
//! every `dcgm.poll_interval`) through nv-hostengine or DCGM embedded. Out:
//! the `dcgm` component (library, mode, response version), DCGM's findings
//! on `gpuN` / `nvswitchN` (as source `dcgm`, beside NVML's own: the health
//! model keeps each source's findings apart), a `dcgm.incident` event per
//! new incident, `warden_dcgm_incidents_total{system,result,reason}`.
//! Must never: load DCGM into the agent's own process (the library runs in
//! `wardend --dcgm-helper`, see [`helper`]), wait on a DCGM call past
//! `dcgm.call_timeout`, or fail the agent when DCGM is absent. Where no
//! library loads under the default names and `dcgm.library` is empty, DCGM
//! is absent by design: the `dcgm` component is ABSENT (it does not lower
//! the node). A library that is named but does not load, or one that loads
//! and cannot reach its host engine, is UNKNOWN with the reason. Either says
//! whether NVML still covers the GPUs.

pub mod config;
pub mod diag;
pub mod ffi;
pub mod helper;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, SystemTime};
use warden_core::device::DeviceId;

pub use config::DcgmConfig;

use self::ffi::{DcgmIncident, OpenParams};
use self::helper::{HelperRequest, Response};
use super::{Poll, Source};
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::taxonomy::dcgm as reasons;

/// The node-level component of this source.
pub const COMPONENT: &str = "dcgm";

/// Environment variable naming the helper executable (default: this one).
pub const HELPER_ENV: &str = "WARDEN_DCGM_HELPER";

/// The running helper process.
struct Helper {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Helper {
    fn spawn() -> Result<Self, String> {
        // `WARDEN_DCGM_HELPER` names the executable to run as the helper
        // when this process is not wardend (a benchmark, a test harness).
        let exe = match std::env::var_os(HELPER_ENV).filter(|v| !v.is_empty()) {
            Some(p) => std::path::PathBuf::from(p),
            None => std::env::current_exe()
                .map_err(|e| format!("cannot find wardend's own executable: {e}"))?,
        };
        let mut child = Command::new(&exe)
            .arg("--dcgm-helper")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the DCGM helper ({}): {e}", exe.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the DCGM helper has no pipes".into());
        };
        let (tx, lines) = channel();
        std::thread::Builder::new()
            .name("dcgm-helper-out".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| format!("cannot start the DCGM reader thread: {e}"))?;
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    /// One request, its answer within `deadline`.
    fn call(&mut self, req: &HelperRequest, deadline: Duration) -> Result<Response, CallError> {
        let text = serde_json::to_string(req).map_err(|e| CallError::Failed(e.to_string()))?;
        writeln!(self.stdin, "{text}")
            .and_then(|()| self.stdin.flush())
            .map_err(|_| self.exited())?;
        match self.lines.recv_timeout(deadline) {
            Ok(line) => serde_json::from_str(&line).map_err(|e| {
                CallError::Failed(format!("the DCGM helper answered garbage ({e}): {line:?}"))
            }),
            Err(RecvTimeoutError::Timeout) => Err(CallError::Timeout),
            Err(RecvTimeoutError::Disconnected) => Err(self.exited()),
        }
    }

    /// How the helper ended, once its output closed.
    fn exited(&mut self) -> CallError {
        let status = self
            .child
            .wait()
            .map_or_else(|e| e.to_string(), |s| s.to_string());
        CallError::Exited(status)
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum CallError {
    Timeout,
    Exited(String),
    Failed(String),
}

/// What DCGM told at the last successful open.
#[derive(Debug, Clone)]
struct Opened {
    library: String,
    gpus: Vec<u32>,
    response_version: u32,
}

/// The DCGM source, run by [`super::runner`].
pub struct DcgmSource {
    cfg: DcgmConfig,
    nvml_enabled: bool,
    helper: Option<Helper>,
    opened: Option<Opened>,
    /// Reasons held per (component, reason code): checks in a row without
    /// it, and the reason as last seen.
    held: BTreeMap<(String, u32), (u32, Reason)>,
    /// Incidents seen at the last check, to count and announce new ones.
    seen: BTreeSet<(String, u32, u32)>,
}

impl std::fmt::Debug for DcgmSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DcgmSource")
            .field("cfg", &self.cfg)
            .field("opened", &self.opened)
            .finish_non_exhaustive()
    }
}

impl DcgmSource {
    /// A source reading DCGM as `cfg` says; `nvml_enabled` only shapes the
    /// message when DCGM is absent.
    pub fn new(cfg: DcgmConfig, nvml_enabled: bool) -> Self {
        Self {
            cfg,
            nvml_enabled,
            helper: None,
            opened: None,
            held: BTreeMap::new(),
            seen: BTreeSet::new(),
        }
    }

    /// The helper process's pid while one runs (for measuring its CPU).
    pub fn helper_pid(&self) -> Option<u32> {
        self.helper.as_ref().map(|h| h.child.id())
    }

    fn unknown(&self, why: String, now: SystemTime) -> ComponentReport {
        let cover = if self.nvml_enabled {
            "GPU health comes from NVML alone"
        } else {
            "NVML is disabled too: no GPU health source"
        };
        ComponentReport {
            id: COMPONENT.into(),
            kind: "agent".into(),
            labels: [("mode".to_owned(), self.cfg.mode.clone())].into(),
            status_override: Some(Status::Unknown),
            reasons: vec![Reason {
                status: Status::Unknown,
                kind: ReasonKind::Judged,
                signal: "dcgm.available".into(),
                value: "no".into(),
                threshold: String::new(),
                window: String::new(),
                since: now,
                message: format!("DCGM unavailable: {why}; {cover}"),
            }],
        }
    }

    /// DCGM is not installed and the config names no library: ABSENT, so
    /// a GPU host with NVML alone (or a TPU host) reads OK, not UNKNOWN.
    fn absent(&self, why: String, now: SystemTime) -> ComponentReport {
        let mut r = self.unknown(why, now);
        r.status_override = Some(Status::Absent);
        for reason in &mut r.reasons {
            reason.status = Status::Absent;
            reason.message = reason.message.replacen(
                "DCGM unavailable",
                "DCGM not installed (absent by design)",
                1,
            );
        }
        r
    }

    /// DCGM stopped answering: the helper is gone; its GPU findings are
    /// unknown until it answers again.
    fn lost(&mut self, why: String, now: SystemTime, poll: &mut Poll) {
        self.helper = None;
        poll.reports.push(self.unknown(why, now));
        if let Some(o) = self.opened.take() {
            for g in o.gpus {
                poll.reports.push(ComponentReport {
                    id: DeviceId::Gpu(g).to_string(),
                    kind: "gpu".into(),
                    labels: BTreeMap::new(),
                    status_override: Some(Status::Unknown),
                    reasons: Vec::new(),
                });
            }
        }
    }

    fn open(&mut self, now: SystemTime, poll: &mut Poll) -> bool {
        if self.opened.is_some() && self.helper.is_some() {
            return true;
        }
        let helper = match self.helper.take() {
            Some(h) => h,
            None => match Helper::spawn() {
                Ok(h) => h,
                Err(e) => {
                    poll.reports.push(self.unknown(e, now));
                    return false;
                }
            },
        };
        let mut helper = helper;
        let params = OpenParams {
            library: self.cfg.library.clone(),
            embedded: self.cfg.mode == "embedded",
            address: self.cfg.address.clone(),
            systems: self.cfg.systems_mask().unwrap_or(u32::MAX),
            timeout_ms: u32::try_from(self.cfg.call_timeout.as_millis()).unwrap_or(u32::MAX),
        };
        match helper.call(&HelperRequest::Open(params), self.cfg.call_timeout) {
            Ok(Response::Opened {
                library,
                gpus,
                response_version,
            }) => {
                self.opened = Some(Opened {
                    library,
                    gpus,
                    response_version,
                });
                self.helper = Some(helper);
                true
            }
            Ok(Response::Error { message }) => {
                // The helper stays: the next poll tries to open again.
                self.helper = Some(helper);
                poll.reports.push(self.unknown(message, now));
                false
            }
            Ok(Response::Absent { message }) => {
                // Not installed: looked for again at the next poll (an
                // install then shows up without a restart).
                self.helper = Some(helper);
                poll.reports.push(self.absent(message, now));
                false
            }
            Ok(other) => {
                self.lost(format!("unexpected answer to open: {other:?}"), now, poll);
                false
            }
            Err(e) => {
                drop(helper);
                let why = self.call_error("opening DCGM", e);
                self.lost(why, now, poll);
                false
            }
        }
    }

    fn call_error(&self, what: &str, e: CallError) -> String {
        match e {
            CallError::Timeout => format!(
                "{what} did not return within {} (dcgm.call_timeout); the DCGM helper was killed and is started again",
                humantime::format_duration(self.cfg.call_timeout)
            ),
            CallError::Exited(status) => format!(
                "the DCGM helper died while {what} ({status}): a crash in the DCGM library; it is started again"
            ),
            CallError::Failed(m) => m,
        }
    }

    /// Turns one check's incidents into component reports.
    fn judge(&mut self, incidents: &[DcgmIncident], now: SystemTime, poll: &mut Poll) {
        let Some(opened) = &self.opened else {
            return;
        };
        let mut present: BTreeMap<(String, u32), Reason> = BTreeMap::new();
        let mut kinds: BTreeMap<String, &'static str> = opened
            .gpus
            .iter()
            .map(|g| (DeviceId::Gpu(*g).to_string(), "gpu"))
            .collect();
        let mut now_seen = BTreeSet::new();
        for inc in incidents {
            let status = match inc.health {
                0 => continue,
                10 => Status::Degraded,
                _ => Status::Failed,
            };
            let (component, kind) = entity_component(inc.entity_group, inc.entity_id);
            kinds.entry(component.clone()).or_insert(kind);
            let rule = reasons::reason(inc.code);
            let signal = rule.map_or_else(
                || format!("dcgm.error_{}", inc.code),
                |r| r.rule.signal.to_owned(),
            );
            let system = reasons::system_name(inc.system);
            let advice = rule.map_or("unknown", |r| r.advice.as_str());
            let reason = Reason {
                status,
                kind: rule.map_or(ReasonKind::Judged, |r| r.kind),
                signal,
                value: inc.code.to_string(),
                threshold: format!("system {system}"),
                window: String::new(),
                since: now,
                message: format!("DCGM ({system}, advice {advice}): {}", inc.message),
            };
            let key = (component.clone(), inc.code, inc.health);
            if !self.seen.contains(&key) {
                let result = if status == Status::Failed {
                    "fail"
                } else {
                    "warn"
                };
                metrics::counter!(
                    "warden_dcgm_incidents_total",
                    "system" => system.clone(),
                    "result" => result,
                    "reason" => inc.code.to_string()
                )
                .increment(1);
                poll.events.push(
                    NewEvent::new(
                        if status == Status::Failed {
                            Severity::Error
                        } else {
                            Severity::Warning
                        },
                        "dcgm.incident",
                        component.clone(),
                        format!("{component}: DCGM {result} ({system}): {}", inc.message),
                    )
                    .with("system", &system)
                    .with("result", result)
                    .with("code", inc.code)
                    .with("reason", reason.signal.clone())
                    .with("advice", advice)
                    .with("entity_group", inc.entity_group)
                    .with("entity_id", inc.entity_id)
                    .into(),
                );
            }
            now_seen.insert(key);
            let slot = present
                .entry((component, inc.code))
                .or_insert(reason.clone());
            if reason.status > slot.status {
                *slot = reason;
            }
        }
        self.seen = now_seen;
        // A reason is raised at once and cleared after `dcgm.clear_after`
        // checks in a row without it.
        let clear = self.cfg.clear_after;
        let mut by_component: BTreeMap<String, Vec<Reason>> =
            kinds.keys().map(|c| (c.clone(), Vec::new())).collect();
        for (key, r) in &present {
            let e = self.held.entry(key.clone()).or_insert((0, r.clone()));
            let since = if e.0 == 0 { e.1.since } else { r.since };
            *e = (0, Reason { since, ..r.clone() });
        }
        self.held.retain(|key, (missing, last)| {
            if !present.contains_key(key) {
                *missing += 1;
            }
            let keep = *missing < clear;
            if keep {
                by_component
                    .entry(key.0.clone())
                    .or_default()
                    .push(last.clone());
            }
            keep
        });
        for (id, reasons) in by_component {
            let kind = kinds.get(&id).copied().unwrap_or("gpu");
            poll.reports.push(ComponentReport {
                id,
                kind: kind.into(),
                labels: BTreeMap::new(),
                status_override: None,
                reasons,
            });
        }
    }
}

/// The health model's component for a DCGM entity.
fn entity_component(group: u32, id: u32) -> (String, &'static str) {
    match group {
        1 => (DeviceId::Gpu(id).to_string(), "gpu"),
        3 => (format!("nvswitch{id}"), "nvswitch"),
        6 => (format!("nvlink{id}"), "nvlink"),
        7 => (format!("cpu{id}"), "cpu"),
        9 => (format!("nic/connectx{id}"), "nic"),
        _ => (format!("dcgm/entity{group}-{id}"), "gpu"),
    }
}

impl crate::sources::SourceKind for DcgmSource {
    const NAME: &'static str = "dcgm";
    type Config = DcgmConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a DcgmConfig {
        settings.dcgm
    }

    fn validate(cfg: &DcgmConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        cfg.validate(origin)
    }

    fn build(
        cfg: &DcgmConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        // Without NVML it reports the GPUs' health itself.
        Ok(cfg.enabled.then(|| {
            Box::new(Self::new(cfg.clone(), settings.nvml.enabled))
                as Box<dyn crate::sources::Source>
        }))
    }
}

impl Source for DcgmSource {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> Poll {
        let mut poll = Poll::default();
        if !self.open(now, &mut poll) {
            return poll;
        }
        let Some(helper) = self.helper.as_mut() else {
            return poll;
        };
        match helper.call(&HelperRequest::Check, self.cfg.call_timeout) {
            Ok(Response::Checked {
                incidents,
                response_version,
                ..
            }) => {
                if let Some(o) = self.opened.as_mut() {
                    o.response_version = response_version;
                }
                self.judge(&incidents, now, &mut poll);
                if let Some(o) = &self.opened {
                    poll.reports.push(ComponentReport {
                        id: COMPONENT.into(),
                        kind: "agent".into(),
                        labels: [
                            ("library".to_owned(), o.library.clone()),
                            ("mode".to_owned(), self.cfg.mode.clone()),
                            ("address".to_owned(), self.cfg.address.clone()),
                            (
                                "health_response".to_owned(),
                                format!("v{}", o.response_version),
                            ),
                            ("gpus".to_owned(), o.gpus.len().to_string()),
                        ]
                        .into(),
                        status_override: None,
                        reasons: Vec::new(),
                    });
                }
            }
            Ok(Response::Error { message }) => {
                // An unsupported version or a dropped connection: open again
                // at the next poll.
                self.opened = None;
                poll.reports.push(self.unknown(message, now));
            }
            Ok(other) => self.lost(
                format!("unexpected answer to check: {other:?}"),
                now,
                &mut poll,
            ),
            Err(e) => {
                let why = self.call_error("dcgmHealthCheck", e);
                self.lost(why, now, &mut poll);
            }
        }
        poll
    }
}
