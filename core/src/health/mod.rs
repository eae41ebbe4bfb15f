//! The health model: every component of the node with a status and the
//! reasons for it.
//!
//! In: sources report a component's current findings ([`ComponentReport`]).
//! Out: a consistent snapshot for the API ([`HealthModel::snapshot`]), a
//! version number that watchers wait on, and a [`StatusChange`] for each
//! component whose status moved, which the caller turns into an event.
//! Never: I/O, blocking, or knowledge of gRPC. A report replaces the
//! component's reasons as a whole; the `since` of a reason that persists is
//! kept, so "since when" survives repeated polls.

pub mod window;

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use tokio::sync::watch;

/// A component's state, ordered by severity:
/// `Absent < Ok < Unknown < Degraded < Failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Status {
    /// An integration that is not on this host by design (its library is
    /// not installed and the config does not ask for it: DCGM on a host
    /// with NVML alone, NVML on a TPU host). Shown so an operator sees it,
    /// but it never lowers the node's status: the node rolls it up as OK.
    /// A source that should be there and is not (configured, or its
    /// hardware present) is `Unknown` instead.
    Absent,
    /// Working as expected.
    Ok,
    /// The agent cannot tell (no library, no answer): not a fault by itself.
    Unknown,
    /// Working with reduced capability or showing early signs of failing.
    Degraded,
    /// Not usable; work placed on it will fail.
    Failed,
}

impl Status {
    /// Upper-case name as shown by the CLI and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Absent => "ABSENT",
            Status::Ok => "OK",
            Status::Unknown => "UNKNOWN",
            Status::Degraded => "DEGRADED",
            Status::Failed => "FAILED",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a finding is to attribution, set by the source that makes it: so
/// that attribution weighs a reason by its kind, never by sorting its
/// signal's name (which stays for the evidence a person reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasonKind {
    /// Any other finding a source judged: weighed by its signal's rule
    /// (`attribute::rules::signal_rule`).
    #[default]
    Judged,
    /// An XID itself (NVML's or the kernel log's): its own `Xid` signal,
    /// with its pid and sources, is the evidence; the health change only
    /// opens the incident.
    Xid,
    /// Another report about XIDs (DCGM's XID and SXID errors): what the
    /// health model holds of it is left to the XID's own evidence.
    AboutXids,
    /// The driver's own recovery verdict (NVML's recovery action, DCGM's
    /// `gpu_recovery_*`): it overrides every per-XID guess.
    DriverVerdict,
}

impl ReasonKind {
    /// Its name in a `health.changed` event's `reason_kind` field.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonKind::Judged => "judged",
            ReasonKind::Xid => "xid",
            ReasonKind::AboutXids => "about_xids",
            ReasonKind::DriverVerdict => "driver_verdict",
        }
    }

    /// The kind named `name` ([`ReasonKind::as_str`]).
    pub fn parse(name: &str) -> Option<Self> {
        [
            ReasonKind::Judged,
            ReasonKind::Xid,
            ReasonKind::AboutXids,
            ReasonKind::DriverVerdict,
        ]
        .into_iter()
        .find(|k| k.as_str() == name)
    }
}

/// One finding with its evidence.
#[derive(Debug, Clone, PartialEq)]
pub struct Reason {
    /// The status this finding alone implies.
    pub status: Status,
    /// What it is to attribution, as its source knows it.
    pub kind: ReasonKind,
    /// Stable signal name, e.g. `memory.available_percent`.
    pub signal: String,
    /// The observed value, formatted with its unit.
    pub value: String,
    /// The threshold it was judged against.
    pub threshold: String,
    /// The window of a delta or rate; empty for a level.
    pub window: String,
    /// When this finding was first seen (kept across polls).
    pub since: SystemTime,
    /// A sentence for a person.
    pub message: String,
}

impl Reason {
    /// This finding as one of `kind` (a source that reports an XID or a
    /// driver's verdict says so here; every other finding is judged).
    #[must_use]
    pub fn of_kind(mut self, kind: ReasonKind) -> Self {
        self.kind = kind;
        self
    }
}

/// What a source says about one component at one moment.
#[derive(Debug, Clone)]
pub struct ComponentReport {
    /// Component id: `host/memory`, `gpu0`, `gpu0/nvlink3`...
    pub id: String,
    /// Coarse kind for grouping: `host`, `gpu`, `agent`...
    pub kind: String,
    /// Identification labels (uuid, pci bus id, mount point).
    pub labels: BTreeMap<String, String>,
    /// `Some(Unknown)` when the source cannot read the component at all;
    /// `None` to derive the status from the reasons (worst, or OK if none).
    pub status_override: Option<Status>,
    /// Every current finding; an empty list means nothing is wrong.
    pub reasons: Vec<Reason>,
}

/// A component as the model holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    /// Component id.
    pub id: String,
    /// Coarse kind.
    pub kind: String,
    /// Identification labels.
    pub labels: BTreeMap<String, String>,
    /// Current status.
    pub status: Status,
    /// When the component entered its current status.
    pub since: SystemTime,
    /// Current findings, worst first.
    pub reasons: Vec<Reason>,
}

/// The whole node at one moment.
#[derive(Debug, Clone)]
pub struct NodeSnapshot {
    /// Worst status over all components (OK when there are none; an
    /// `Absent` component counts as OK).
    pub status: Status,
    /// Components ordered by id.
    pub components: Vec<Component>,
    /// When the snapshot was taken.
    pub observed_at: SystemTime,
    /// Model version at the time (increases on every change).
    pub version: u64,
}

/// A component whose status moved; the caller publishes it as an event.
#[derive(Debug, Clone)]
pub struct StatusChange {
    /// Component id.
    pub id: String,
    /// Status before (None for a component seen for the first time).
    pub from: Option<Status>,
    /// Status now.
    pub to: Status,
    /// The worst reason now, if any: the evidence for the change.
    pub reason: Option<Reason>,
}

/// What one source last said about one component.
#[derive(Debug, Clone, PartialEq)]
struct Finding {
    status_override: Option<Status>,
    reasons: Vec<Reason>,
}

/// A component and, per source, what that source said about it.
#[derive(Debug, Clone)]
struct Entry {
    component: Component,
    findings: BTreeMap<String, Finding>,
}

/// Shared, thread-safe health state of the node.
///
/// Several sources may speak about one component (the kernel log and the
/// NIC source about `nic/eth0`, NVML and DCGM about `gpu3`): each source's
/// findings are kept apart and the component's status and reasons are
/// derived from all of them, so one source never erases another's verdict.
#[derive(Debug)]
pub struct HealthModel {
    components: Mutex<BTreeMap<String, Entry>>,
    /// Bumped on every change; watchers (WatchHealth, systemd STATUS=) wait on it.
    version: watch::Sender<u64>,
}

impl Default for HealthModel {
    fn default() -> Self {
        Self::new()
    }
}

impl HealthModel {
    /// An empty model.
    pub fn new() -> Self {
        Self {
            components: Mutex::new(BTreeMap::new()),
            version: watch::Sender::new(0),
        }
    }

    /// Applies a report from an unnamed source; see [`HealthModel::report_from`].
    pub fn report(&self, report: ComponentReport, now: SystemTime) -> Option<StatusChange> {
        self.report_from("", report, now)
    }

    /// Applies what `source` now says about a component (replacing what it
    /// said before, leaving other sources' findings alone); returns the
    /// status change if the component's status moved.
    pub fn report_from(
        &self,
        source: &str,
        mut report: ComponentReport,
        now: SystemTime,
    ) -> Option<StatusChange> {
        let mut map = self
            .components
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let previous = map.get(&report.id);
        // Keep the first-seen time of findings that persist.
        if let Some(old) = previous.and_then(|p| p.findings.get(source)) {
            for r in &mut report.reasons {
                if let Some(o) = old.reasons.iter().find(|o| o.signal == r.signal) {
                    r.since = o.since;
                }
            }
        }
        let mut findings = previous.map(|p| p.findings.clone()).unwrap_or_default();
        findings.insert(
            source.to_owned(),
            Finding {
                status_override: report.status_override,
                reasons: std::mem::take(&mut report.reasons),
            },
        );
        let status = findings
            .values()
            .map(|f| {
                f.status_override.unwrap_or_else(|| {
                    f.reasons
                        .iter()
                        .map(|r| r.status)
                        .max()
                        .unwrap_or(Status::Ok)
                })
            })
            .max()
            .unwrap_or(Status::Ok);
        let mut reasons: Vec<Reason> = findings
            .values()
            .flat_map(|f| f.reasons.iter().cloned())
            .collect();
        reasons.sort_by_key(|r| std::cmp::Reverse(r.status));
        let mut labels = previous
            .map(|p| p.component.labels.clone())
            .unwrap_or_default();
        labels.extend(report.labels);
        let from = previous.map(|p| p.component.status);
        let since = match previous {
            Some(p) if p.component.status == status => p.component.since,
            _ => now,
        };
        let component = Component {
            id: report.id.clone(),
            kind: report.kind,
            labels,
            status,
            since,
            reasons,
        };
        if previous.is_some_and(|p| p.component == component && p.findings == findings) {
            return None;
        }
        let change = (from != Some(status)).then(|| StatusChange {
            id: component.id.clone(),
            from,
            to: status,
            reason: component.reasons.first().cloned(),
        });
        map.insert(
            report.id,
            Entry {
                component,
                findings,
            },
        );
        drop(map);
        self.version.send_modify(|v| *v += 1);
        change
    }

    /// Removes a component that no longer exists (a GPU that fell off the bus
    /// is reported FAILED instead; this is for things that were never real).
    pub fn remove(&self, id: &str) {
        let removed = self
            .components
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id)
            .is_some();
        if removed {
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// A consistent copy of the whole node.
    pub fn snapshot(&self) -> NodeSnapshot {
        let map = self
            .components
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let components: Vec<Component> = map.values().map(|e| e.component.clone()).collect();
        let version = *self.version.borrow();
        drop(map);
        NodeSnapshot {
            status: components
                .iter()
                .map(|c| c.status.max(Status::Ok))
                .max()
                .unwrap_or(Status::Ok),
            components,
            observed_at: SystemTime::now(),
            version,
        }
    }

    /// A receiver that wakes whenever the model changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn reason(status: Status, signal: &str, at: SystemTime) -> Reason {
        Reason {
            status,
            kind: ReasonKind::Judged,
            signal: signal.into(),
            value: "1".into(),
            threshold: "0".into(),
            window: String::new(),
            since: at,
            message: format!("{signal} is off"),
        }
    }

    fn report(reasons: Vec<Reason>) -> ComponentReport {
        ComponentReport {
            id: "host/memory".into(),
            kind: "host".into(),
            labels: BTreeMap::new(),
            status_override: None,
            reasons,
        }
    }

    #[test]
    fn first_report_is_a_change_and_status_is_worst_reason() {
        let m = HealthModel::new();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let c = m
            .report(
                report(vec![
                    reason(Status::Degraded, "a", t0),
                    reason(Status::Failed, "b", t0),
                ]),
                t0,
            )
            .unwrap();
        assert_eq!(c.from, None);
        assert_eq!(c.to, Status::Failed);
        assert_eq!(c.reason.unwrap().signal, "b");
        assert_eq!(m.snapshot().status, Status::Failed);
    }

    #[test]
    fn same_status_is_not_a_change_and_keeps_since() {
        let m = HealthModel::new();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let t1 = t0 + Duration::from_secs(5);
        m.report(report(vec![reason(Status::Degraded, "a", t0)]), t0);
        assert!(
            m.report(report(vec![reason(Status::Degraded, "a", t1)]), t1)
                .is_none()
        );
        let snap = m.snapshot();
        assert_eq!(snap.components[0].since, t0);
        assert_eq!(snap.components[0].reasons[0].since, t0);
    }

    #[test]
    fn clearing_reasons_returns_to_ok() {
        let m = HealthModel::new();
        let t0 = SystemTime::UNIX_EPOCH;
        m.report(report(vec![reason(Status::Failed, "a", t0)]), t0);
        let c = m.report(report(vec![]), t0).unwrap();
        assert_eq!((c.from, c.to), (Some(Status::Failed), Status::Ok));
    }

    #[test]
    fn unknown_ranks_between_ok_and_degraded() {
        assert!(Status::Absent < Status::Ok);
        assert!(Status::Ok < Status::Unknown);
        assert!(Status::Unknown < Status::Degraded);
        let m = HealthModel::new();
        let mut r = report(vec![]);
        r.status_override = Some(Status::Unknown);
        m.report(r, SystemTime::UNIX_EPOCH);
        assert_eq!(m.snapshot().status, Status::Unknown);
    }

    #[test]
    fn two_sources_on_one_component_do_not_erase_each_other() {
        let m = HealthModel::new();
        let t0 = SystemTime::UNIX_EPOCH;
        m.report_from(
            "kmsg",
            report(vec![reason(Status::Failed, "link_down", t0)]),
            t0,
        );
        // The NIC source sees the link up again: its own finding is clean,
        // but the kernel log's verdict stands until the kernel log clears it.
        assert!(m.report_from("host_net", report(vec![]), t0).is_none());
        assert_eq!(m.snapshot().components[0].status, Status::Failed);
        let c = m.report_from("kmsg", report(vec![]), t0).unwrap();
        assert_eq!(c.to, Status::Ok);
        m.report_from(
            "host_net",
            report(vec![reason(Status::Degraded, "flap", t0)]),
            t0,
        );
        m.report_from(
            "kmsg",
            report(vec![reason(Status::Failed, "link_down", t0)]),
            t0,
        );
        let snap = m.snapshot();
        assert_eq!(snap.components[0].reasons.len(), 2);
        assert_eq!(snap.components[0].reasons[0].signal, "link_down");
    }

    #[test]
    fn version_bumps_only_on_change() {
        let m = HealthModel::new();
        let t0 = SystemTime::UNIX_EPOCH;
        m.report(report(vec![]), t0);
        let v = m.snapshot().version;
        m.report(report(vec![]), t0);
        assert_eq!(m.snapshot().version, v);
    }

    #[test]
    fn an_absent_integration_does_not_lower_the_node() {
        let m = HealthModel::new();
        let now = SystemTime::now();
        let mut dcgm = report(vec![reason(Status::Absent, "dcgm.available", now)]);
        dcgm.id = "dcgm".into();
        dcgm.status_override = Some(Status::Absent);
        m.report_from("dcgm", dcgm.clone(), now);
        let snap = m.snapshot();
        assert_eq!(snap.status, Status::Ok);
        assert_eq!(snap.components[0].status, Status::Absent);
        m.report(report(Vec::new()), now);
        assert_eq!(m.snapshot().status, Status::Ok);
        // The same source failing where it should be there still counts.
        dcgm.status_override = Some(Status::Unknown);
        m.report_from("dcgm", dcgm, now);
        assert_eq!(m.snapshot().status, Status::Unknown);
    }
}
