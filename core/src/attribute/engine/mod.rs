//! The attribution engine: reads the agent's events, joins the signals
//! that belong together into incidents, and diagnoses each one.
//!
//! In: every published [`Event`] ([`Engine::observe`]): registrations (which
//! rank drives which device), exceptions, exits, hangs, stragglers, XIDs
//! and health changes. Out: incidents due for a diagnosis
//! ([`Engine::take_due`]), each with its class, confidence and chain of
//! evidence. Pure and synchronous: the caller owns the clock, the device
//! names and the I/O, so recorded event sequences replay exactly (the
//! scenario suite does that).

mod evidence;

use crate::device::DeviceId;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use super::FaultClass;
use super::config::AttributionConfig;
use super::diagnosis::{Diagnosis, Evidence, IncidentKind, IncidentRecord};
use super::rules;
use crate::events::{Event, Severity};
use crate::health::{ReasonKind, Status};
use crate::rank::RankKey;
use crate::signal::{GateFailed, HealthChanged, Signal, Xid, XidSource};
use crate::verdict::PastDecision;

/// Hardware observations kept (a bound on memory whatever the event rate).
const MAX_OBSERVATIONS: usize = 4096;
/// NVML process sets kept per GPU (each a change; a bound on memory).
const MAX_GPU_SETS: usize = 64;
/// GPUs whose process sets are kept.
const MAX_GPUS: usize = 256;
/// The same XID reported by NVML and the kernel log within this long is one.
const XID_DEDUP: Duration = Duration::from_secs(2);

/// Maps the names a client may give a device (a UUID, a PCI bus id, an
/// index) to the health model's component id ("gpu3").
#[derive(Debug, Clone, Default)]
pub struct DeviceMap {
    aliases: HashMap<String, String>,
    /// Current findings per component: events only carry a component's
    /// worst reason at a status change, so a diagnosis also reads these.
    reasons: HashMap<String, Vec<CurrentReason>>,
}

/// A finding the health model holds now about a component.
#[derive(Debug, Clone)]
pub struct CurrentReason {
    /// The signal.
    pub signal: String,
    /// What it is to attribution, as its source set it.
    pub kind: ReasonKind,
    /// FAILED, DEGRADED, or OK (a finding under its threshold).
    pub status: Status,
    /// Its value.
    pub value: String,
    /// Since when.
    pub since: SystemTime,
}

impl DeviceMap {
    /// Adds a component and its identifying labels (uuid, pci).
    pub fn add(&mut self, component: &str, labels: impl IntoIterator<Item = String>) {
        for l in labels {
            self.aliases.insert(l.to_lowercase(), component.to_owned());
        }
    }

    /// Adds a current finding about `component`.
    pub fn add_reason(&mut self, component: &str, reason: CurrentReason) {
        self.reasons
            .entry(component.to_owned())
            .or_default()
            .push(reason);
    }

    /// The component id for a device name; unknown names are kept as
    /// given, and a bare index "3" (or "03") becomes "gpu3".
    pub fn resolve(&self, name: &str) -> String {
        if let Some(c) = self.aliases.get(&name.to_lowercase()) {
            return c.clone();
        }
        match DeviceId::gpu_index(name) {
            Some(i) => DeviceId::Gpu(i).to_string(),
            None => name.to_owned(),
        }
    }
}

/// What the engine knows of a registered rank: its process as the agent
/// sees it, and since when. Not the devices it declared: those are the
/// rank's word, and a rank's devices for attribution are only those the
/// agent maps its pid to itself ([`Engine::devices_of`]).
#[derive(Debug, Clone)]
struct RankMeta {
    /// 0: a process the agent cannot see (no device is ever mapped to it).
    pid: u32,
    /// When it registered: an XID naming its pid before that named another
    /// process under a recycled pid.
    since: SystemTime,
}

/// An exception a rank reported.
#[derive(Debug, Clone)]
struct ExceptionSeen {
    at: SystemTime,
    event_id: u64,
    exception_type: String,
    message: String,
    step: Option<u64>,
}

/// What kind of signal an observation is: the rules match on this, never
/// on the signal's name (which is for the evidence a person reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Observed {
    /// The kernel's OOM killer killed a process (`Signal::OomKill`).
    OomKill,
    /// An XID with its code, from NVML or the kernel log (`Signal::Xid`).
    Xid(u32),
    /// A health signal a source judged (`Signal::HealthChanged`), with
    /// what its reason is to the rules.
    Health(ReasonKind),
    /// A failed pre-restart health gate (`Signal::GateFailed`).
    Gate,
}

/// A hardware or host signal, with what the rules make of it.
#[derive(Debug, Clone)]
struct Observation {
    at: SystemTime,
    event_id: u64,
    kind: Observed,
    source: String,
    component: String,
    /// The signal's name, for the evidence.
    signal: String,
    value: String,
    pid: Option<u32>,
    class: Option<FaultClass>,
    weight: f64,
    note: String,
}

impl Observation {
    /// The XID's code, for an XID.
    fn xid(&self) -> Option<u32> {
        match self.kind {
            Observed::Xid(code) => Some(code),
            _ => None,
        }
    }
}

/// What opened or joined an incident.
#[derive(Debug, Clone)]
enum Trigger {
    Crash {
        key: RankKey,
        at: SystemTime,
        event_id: u64,
        code: Option<i32>,
        signal: Option<i32>,
        step: Option<u64>,
        section: String,
        pid: Option<u32>,
    },
    Hang {
        key: RankKey,
        at: SystemTime,
        event_id: u64,
        step: Option<u64>,
        section: String,
        pattern: String,
        process_state: String,
        wchan: String,
    },
    Hardware {
        component: String,
        at: SystemTime,
    },
    Straggler {
        key: RankKey,
        at: SystemTime,
        event_id: u64,
        section: String,
        relative: String,
        explanation: String,
        cause: FaultClass,
    },
    /// The job-wide verdict on a hang: joins the job's hang incident.
    Verdict {
        job: String,
        at: SystemTime,
        event_id: u64,
        summary: String,
        /// A culprit runs here.
        charged: bool,
        /// The culprits elsewhere, when none runs here.
        waited_on: Vec<String>,
        /// The culprits, named, for the evidence.
        culprits: Vec<String>,
    },
    Sdc {
        key: RankKey,
        at: SystemTime,
        event_id: u64,
        step: u64,
        metric: String,
        value: f64,
        job_median: Option<f64>,
        basis: String,
    },
}

impl Trigger {
    fn kind(&self) -> IncidentKind {
        match self {
            Trigger::Crash { .. } => IncidentKind::Crash,
            Trigger::Hang { .. } | Trigger::Verdict { .. } => IncidentKind::Hang,
            Trigger::Hardware { .. } => IncidentKind::Hardware,
            Trigger::Straggler { .. } => IncidentKind::Straggler,
            Trigger::Sdc { .. } => IncidentKind::Sdc,
        }
    }

    fn key(&self) -> Option<&RankKey> {
        match self {
            Trigger::Crash { key, .. }
            | Trigger::Hang { key, .. }
            | Trigger::Straggler { key, .. }
            | Trigger::Sdc { key, .. } => Some(key),
            Trigger::Hardware { .. } | Trigger::Verdict { .. } => None,
        }
    }

    /// The job it is about, if any.
    fn job(&self) -> Option<&str> {
        match self {
            Trigger::Verdict { job, .. } => Some(job),
            other => other.key().map(|k| k.job.as_str()),
        }
    }
}

/// An incident still open to new evidence.
#[derive(Debug, Clone)]
struct Open {
    record: IncidentRecord,
    triggers: Vec<Trigger>,
    /// When to diagnose next (None: diagnosed, nothing new since).
    due: Option<SystemTime>,
    /// Class and kind the decision in force answered.
    decided_on: Option<(FaultClass, IncidentKind)>,
}

/// An incident just diagnosed.
#[derive(Debug, Clone)]
pub struct Diagnosed {
    /// The incident with its new diagnosis (its decision is the caller's).
    pub record: IncidentRecord,
    /// True when it needs a decision: new, or its class or kind changed.
    pub needs_decision: bool,
}

/// The attribution engine (see the module doc).
#[derive(Debug)]
pub struct Engine {
    cfg: AttributionConfig,
    host: String,
    ranks: HashMap<RankKey, RankMeta>,
    exceptions: HashMap<RankKey, ExceptionSeen>,
    observations: VecDeque<Observation>,
    /// Per GPU, the process sets NVML reported (`gpu.processes`), oldest
    /// first: the agent's own map of ranks to devices.
    gpu_sets: HashMap<String, VecDeque<(SystemTime, Vec<u32>)>>,
    open: Vec<Open>,
    /// Incidents no longer open: the history the repeat rule and the
    /// budgets read.
    closed: VecDeque<IncidentRecord>,
}

/// 1 - product of (1 - w): agreeing independent signals make a surer verdict.
fn combine(weights: impl Iterator<Item = f64>) -> f64 {
    let miss: f64 = weights.map(|w| 1.0 - w.clamp(0.0, 1.0)).product();
    (1.0 - miss).min(0.99)
}

fn within(at: SystemTime, from: SystemTime, to: SystemTime) -> bool {
    at >= from && at <= to
}

impl Engine {
    /// An engine for this host, with `history` (incidents from before a
    /// restart of the agent, oldest first) as its memory.
    pub fn new(cfg: AttributionConfig, host: String, history: Vec<IncidentRecord>) -> Self {
        Self {
            cfg,
            host,
            ranks: HashMap::new(),
            exceptions: HashMap::new(),
            observations: VecDeque::new(),
            gpu_sets: HashMap::new(),
            open: Vec::new(),
            closed: history.into(),
        }
    }

    /// Reads one event: remembers what later diagnoses need, and opens or
    /// extends an incident for a crash, hang, straggler or hardware failure.
    /// Reads the event's typed signal, never its rendered strings.
    pub fn observe(&mut self, ev: &Event) {
        match &ev.signal {
            Signal::RankRegistered(r) => {
                self.ranks.insert(
                    r.key.clone(),
                    RankMeta {
                        pid: r.pid,
                        since: ev.time,
                    },
                );
            }
            // A rank that left is no longer on any device: a later hardware
            // incident does not take its job in.
            Signal::RankDeregistered { key } => {
                self.ranks.remove(key);
            }
            Signal::RankException(r) => {
                self.exceptions.insert(
                    r.key.clone(),
                    ExceptionSeen {
                        at: ev.time,
                        event_id: ev.id,
                        exception_type: r.exception_type.clone(),
                        message: r.message.clone(),
                        step: r.step,
                    },
                );
            }
            Signal::RankExited(r) if r.severity() >= Severity::Error => {
                let t = Trigger::Crash {
                    key: r.key.clone(),
                    at: ev.time,
                    event_id: ev.id,
                    code: r.exit.code,
                    signal: r.exit.signal,
                    step: r.step,
                    section: r.section.clone(),
                    pid: Some(r.pid),
                };
                self.trigger(t, ev);
            }
            Signal::RankHang(h) => {
                let t = Trigger::Hang {
                    key: h.key.clone(),
                    at: ev.time,
                    event_id: ev.id,
                    step: Some(h.facts.step),
                    section: h.facts.section.clone(),
                    pattern: h.facts.pattern.clone(),
                    process_state: h.facts.process_state.clone(),
                    wchan: h.facts.wchan.clone(),
                };
                self.trigger(t, ev);
            }
            Signal::RankStraggler(s) => {
                let t = Trigger::Straggler {
                    key: s.key.clone(),
                    at: ev.time,
                    event_id: ev.id,
                    section: s.section.clone(),
                    relative: s.relative.clone(),
                    explanation: s.explanation.clone(),
                    cause: s.cause,
                };
                self.trigger(t, ev);
            }
            Signal::HangVerdict(v) => {
                let t = Trigger::Verdict {
                    job: v.job.clone(),
                    at: ev.time,
                    event_id: ev.id,
                    summary: v.summary.clone(),
                    charged: v.charges_this_host(),
                    waited_on: v.waited_on(),
                    culprits: v
                        .culprits
                        .iter()
                        .map(|b| format!("rank {} on {}: {}", b.rank, b.host, b.why))
                        .collect(),
                };
                self.trigger(t, ev);
            }
            Signal::RankSdcSuspect(s) => {
                let t = Trigger::Sdc {
                    key: s.key.clone(),
                    at: ev.time,
                    event_id: ev.id,
                    step: s.step,
                    metric: s.metric.clone(),
                    value: s.value,
                    job_median: s.job_median,
                    basis: s.basis.clone(),
                };
                self.trigger(t, ev);
            }
            Signal::Xid(x) => self.observe_xid(ev, x),
            Signal::GpuProcesses(g) => {
                if self.gpu_sets.len() >= MAX_GPUS && !self.gpu_sets.contains_key(&g.component) {
                    return;
                }
                let sets = self.gpu_sets.entry(g.component.clone()).or_default();
                if sets.len() >= MAX_GPU_SETS {
                    sets.pop_front();
                }
                sets.push_back((ev.time, g.pids.clone()));
            }
            Signal::GateFailed(g) => self.observe_gate(ev, g),
            Signal::HealthChanged(h) => self.observe_health(ev, h),
            Signal::OomKill(o) => {
                self.push_observation(Observation {
                    at: ev.time,
                    event_id: ev.id,
                    kind: Observed::OomKill,
                    source: "kmsg".into(),
                    component: o.component.clone(),
                    signal: ev.signal.kind().into(),
                    value: o.process.clone(),
                    pid: Some(o.pid),
                    class: None,
                    weight: 0.0,
                    note: "the kernel's OOM killer killed a process".into(),
                });
            }
            _ => {}
        }
    }

    fn observe_xid(&mut self, ev: &Event, x: &Xid) {
        let Ok(code) = u32::try_from(x.xid) else {
            return;
        };
        let source = match x.source {
            XidSource::Nvml => "nvml",
            XidSource::Kmsg => "kmsg",
        };
        let pid = x.pid;
        // NVML and the kernel log report the same XID: one observation,
        // both sources named.
        if let Some(o) = self.observations.iter_mut().rev().find(|o| {
            o.kind == Observed::Xid(code)
                && o.component == x.component
                && o.source != source
                && ev.time.duration_since(o.at).unwrap_or_default() <= XID_DEDUP
        }) {
            o.source = format!("{}+{source}", o.source);
            o.pid = o.pid.or(pid);
            return;
        }
        let (class, weight, note) = match rules::xid_verdict(code) {
            Some((c, w, meaning)) => (Some(c), w, format!("XID {code}: {meaning}")),
            None => (
                None,
                0.0,
                format!("XID {code} follows another error; judged by that one"),
            ),
        };
        self.push_observation(Observation {
            at: ev.time,
            event_id: ev.id,
            kind: Observed::Xid(code),
            source: source.into(),
            component: x.component.clone(),
            signal: "xid".into(),
            value: code.to_string(),
            pid,
            class,
            weight,
            note,
        });
    }

    fn observe_health(&mut self, ev: &Event, h: &HealthChanged) {
        let failed = h.to == Status::Failed;
        if !failed && h.to != Status::Degraded {
            return;
        }
        let signal = h.signal();
        let component = &h.component;
        let device = DeviceId::is_device(component);
        let hardware_trigger = |class: FaultClass| {
            device && (failed || class.is_hardware() || class == FaultClass::Infrastructure)
        };
        // An XID's own event (with its pid and sources) is the evidence;
        // the health change it caused only opens the incident.
        let kind = h.reason.as_ref().map_or(ReasonKind::Judged, |r| r.kind);
        if kind == ReasonKind::Xid {
            if device {
                let t = Trigger::Hardware {
                    component: component.clone(),
                    at: ev.time,
                };
                self.trigger(t, ev);
            }
            return;
        }
        let Some(rule) = rules::signal_rule(signal) else {
            return;
        };
        let class = if failed {
            rule.failed
        } else {
            match rule.degraded {
                Some(c) => c,
                // A warning about what may come: shown where it is read,
                // never weighed as the cause of a failure.
                None => return,
            }
        };
        let (value, threshold) = h
            .reason
            .as_ref()
            .map_or(("", "-"), |r| (r.value.as_str(), r.threshold.as_str()));
        self.push_observation(Observation {
            at: ev.time,
            event_id: ev.id,
            kind: Observed::Health(kind),
            source: "health".into(),
            component: component.clone(),
            signal: signal.to_owned(),
            value: value.to_owned(),
            pid: None,
            class: Some(class),
            weight: rule.weight,
            note: format!("{} ({}; threshold {threshold})", rule.note, h.to),
        });
        // A device failing is an incident of its own; so is a degradation
        // that points at hardware or the infrastructure.
        if hardware_trigger(class) {
            let t = Trigger::Hardware {
                component: component.clone(),
                at: ev.time,
            };
            self.trigger(t, ev);
        }
    }

    /// A failed pre-restart health gate: the node should not take the
    /// restart; the incident belongs to the job that was restarting.
    fn observe_gate(&mut self, ev: &Event, g: &GateFailed) {
        let first = g.failures.first();
        let component = first.map_or("node", |f| f.entity.as_str()).to_owned();
        let severity = first.map_or("", |f| f.severity.as_str());
        self.push_observation(Observation {
            at: ev.time,
            event_id: ev.id,
            kind: Observed::Gate,
            source: "gate".into(),
            component: component.clone(),
            signal: format!("gate.{}", first.map_or("failed", |f| f.test.as_str())),
            value: first.map_or("", |f| f.message.as_str()).to_owned(),
            pid: None,
            class: Some(FaultClass::UncorrectableHardware),
            weight: if severity == "isolate" { 0.9 } else { 0.8 },
            note: format!(
                "the pre-restart health gate ({}) failed: do not restart on this node [gate.failed]",
                g.ran
            ),
        });
        let t = Trigger::Hardware {
            component,
            at: ev.time,
        };
        self.trigger(t, ev);
        if !g.job.is_empty()
            && let Some(o) = self.open.last_mut()
            && o.record.job.is_empty()
        {
            o.record.job = g.job.clone();
        }
    }

    fn push_observation(&mut self, o: Observation) {
        if self.observations.len() >= MAX_OBSERVATIONS {
            self.observations.pop_front();
        }
        self.observations.push_back(o);
    }

    /// The devices the agent itself maps a rank to: those NVML listed the
    /// rank's process on (in the set in force when it registered, or any
    /// set since: an earlier holder of a recycled pid had left the set
    /// before), and those whose XIDs (the kernel log's `pid=`) named it
    /// since it registered.
    /// Never the devices the rank declared (its word: an attacker names a
    /// busy GPU to pull another job's failures into its own incident, or a
    /// degraded one to borrow its evidence). A rank the agent has no
    /// mapping for has no device here; its own crash, hang or exception is
    /// still its own job's incident.
    fn devices_of(&self, key: &RankKey) -> Vec<String> {
        let Some(m) = self.ranks.get(key).filter(|m| m.pid != 0) else {
            return Vec::new();
        };
        let mut out: Vec<String> = Vec::new();
        let mut gpus: Vec<&String> = self.gpu_sets.keys().collect();
        gpus.sort();
        for gpu in gpus {
            let sets = &self.gpu_sets[gpu];
            let in_force = sets.iter().rev().find(|(at, _)| *at <= m.since);
            let after = sets.iter().filter(|(at, _)| *at > m.since);
            if in_force
                .into_iter()
                .chain(after)
                .any(|(_, pids)| pids.contains(&m.pid))
            {
                out.push(gpu.clone());
            }
        }
        for o in &self.observations {
            if o.xid().is_some()
                && o.pid == Some(m.pid)
                && o.at >= m.since
                && !out.contains(&o.component)
            {
                out.push(o.component.clone());
            }
        }
        out
    }

    /// Opens an incident for `t`, or adds it to an open one it belongs to.
    fn trigger(&mut self, t: Trigger, ev: &Event) {
        let due = ev.time + self.cfg.settle;
        let devices: Vec<String> = match &t {
            Trigger::Hardware { component, .. } => vec![component.clone()],
            other => other.key().map(|k| self.devices_of(k)).unwrap_or_default(),
        };
        let job = t.job().map(str::to_owned);
        let window = self.cfg.correlate_window;
        // A crash or hang after the job was restarted in job is a failure of
        // the new workers: a new incident (so it gets its own decision, and
        // the same failure at the same step reads as the code's).
        let after_restart = |o: &Open| {
            matches!(t, Trigger::Crash { .. } | Trigger::Hang { .. })
                && o.record
                    .decision
                    .as_ref()
                    .is_some_and(|d| d.action == crate::verdict::Action::RestartInJob)
        };
        // Never across jobs: a trigger of job J joins an incident of J, or
        // one of no job yet (a device failing) on a device the agent maps
        // J's rank to; another job's incident is never its.
        let same_job = |o: &Open| {
            job.as_ref()
                .is_some_and(|j| !j.is_empty() && *j == o.record.job)
        };
        let other_job = |o: &Open| {
            job.as_ref()
                .is_some_and(|j| !j.is_empty() && !o.record.job.is_empty() && *j != o.record.job)
        };
        let joined = self.open.iter_mut().find(|o| {
            !after_restart(o)
                && ev
                    .time
                    .duration_since(o.record.opened_at)
                    .unwrap_or_default()
                    <= window
                && !other_job(o)
                && (same_job(o) || devices.iter().any(|d| o.record.devices.contains(d)))
        });
        let open = match joined {
            Some(o) => o,
            None => {
                let record = IncidentRecord {
                    id: format!("inc-{}", ev.id),
                    opened_at: ev.time,
                    updated_at: ev.time,
                    kind: t.kind(),
                    host: self.host.clone(),
                    job: String::new(),
                    ranks: Vec::new(),
                    devices: Vec::new(),
                    diagnosis: Diagnosis {
                        class: FaultClass::Unknown,
                        confidence: 0.0,
                        summary: String::new(),
                        rule: String::new(),
                        evidence: Vec::new(),
                    },
                    decision: None,
                    superseded: Vec::new(),
                    signature: String::new(),
                    step: None,
                    exit_code: None,
                    waited_on: Vec::new(),
                };
                self.open.push(Open {
                    record,
                    triggers: Vec::new(),
                    due: None,
                    decided_on: None,
                });
                let last = self.open.len() - 1;
                &mut self.open[last]
            }
        };
        if open.record.job.is_empty()
            && let Some(j) = &job
        {
            open.record.job.clone_from(j);
        }
        if let Trigger::Verdict { waited_on, .. } = &t {
            open.record.waited_on.clone_from(waited_on);
        }
        if let Some(k) = t.key()
            && !open.record.ranks.contains(&k.rank)
        {
            open.record.ranks.push(k.rank);
            open.record.ranks.sort_unstable();
        }
        for d in devices {
            if !open.record.devices.contains(&d) {
                open.record.devices.push(d);
            }
        }
        if priority(t.kind()) > priority(open.record.kind) {
            open.record.kind = t.kind();
        }
        open.triggers.push(t);
        open.due = Some(open.due.map_or(due, |d| d.min(due)));
    }

    /// When the next diagnosis is due, for the caller's timer.
    pub fn next_due(&self) -> Option<SystemTime> {
        self.open.iter().filter_map(|o| o.due).min()
    }

    /// Diagnoses every incident due by `now`, with device names resolved
    /// through `devices`; closes incidents past the correlation window.
    pub fn take_due(&mut self, now: SystemTime, devices: &DeviceMap) -> Vec<Diagnosed> {
        // Close what no longer takes new evidence (decided earlier, past
        // the correlation window).
        let window = self.cfg.correlate_window;
        let mut i = 0;
        while i < self.open.len() {
            let o = &self.open[i];
            if o.due.is_none()
                && now.duration_since(o.record.opened_at).unwrap_or_default() > window
            {
                let o = self.open.remove(i);
                self.closed.push_back(o.record);
                if self.closed.len() > self.cfg.retain {
                    self.closed.pop_front();
                }
            } else {
                i += 1;
            }
        }
        let mut out = Vec::new();
        for i in 0..self.open.len() {
            if self.open[i].due.is_none_or(|d| d > now) {
                continue;
            }
            self.open[i].due = None;
            self.resolve_devices(i, devices);
            let (diagnosis, signature, step, exit_code) = self.diagnose(i, now, devices);
            let open = &mut self.open[i];
            open.record.diagnosis = diagnosis;
            open.record.signature = signature;
            open.record.step = step;
            open.record.exit_code = exit_code;
            open.record.updated_at = now;
            let basis = (open.record.diagnosis.class, open.record.kind);
            let needs_decision = open.decided_on != Some(basis);
            out.push(Diagnosed {
                record: open.record.clone(),
                needs_decision,
            });
        }
        let keep = self.cfg.hardware_window.max(self.cfg.xid_repeat_window);
        while self
            .observations
            .front()
            .is_some_and(|o| now.duration_since(o.at).unwrap_or_default() > keep)
        {
            self.observations.pop_front();
        }
        out
    }

    /// Records the decision taken for an incident (after policy and hook).
    pub fn decided(
        &mut self,
        id: &str,
        decision: crate::verdict::Decision,
    ) -> Option<IncidentRecord> {
        if let Some(open) = self.open.iter_mut().find(|o| o.record.id == id) {
            if let Some(old) = open.record.decision.take() {
                open.record.superseded.push(old);
            }
            open.record.decision = Some(decision);
            open.decided_on = Some((open.record.diagnosis.class, open.record.kind));
            return Some(open.record.clone());
        }
        // A later decision about a closed incident (an escalation after an
        // unanswered in-process restart): recorded, so budgets count it.
        let rec = self.closed.iter_mut().find(|r| r.id == id)?;
        if let Some(old) = rec.decision.take() {
            rec.superseded.push(old);
        }
        rec.decision = Some(decision);
        Some(rec.clone())
    }

    /// The record of an incident, open or closed.
    pub fn record(&self, id: &str) -> Option<&IncidentRecord> {
        self.open
            .iter()
            .map(|o| &o.record)
            .chain(self.closed.iter())
            .find(|r| r.id == id)
    }

    /// Decisions already taken for `job` ("" for the node), for budgets.
    pub fn past_decisions(&self, job: &str, excluding: &str) -> Vec<PastDecision> {
        self.closed
            .iter()
            .chain(self.open.iter().map(|o| &o.record))
            .filter(|r| r.job == job && r.id != excluding)
            .flat_map(|r| {
                r.decision
                    .iter()
                    .chain(r.superseded.iter())
                    .map(|d| PastDecision {
                        at: d.decided_at,
                        class: r.diagnosis.class,
                        action: d.action,
                    })
            })
            .collect()
    }

    fn resolve_devices(&mut self, i: usize, devices: &DeviceMap) {
        let mut names: Vec<String> = self.open[i]
            .record
            .devices
            .iter()
            .map(|d| devices.resolve(d))
            .collect();
        // A rank that named no device drives gpu<local_rank>; the
        // registration event already says so in its `devices`.
        names.dedup();
        self.open[i].record.devices = names;
        // The devices the agent maps the incident's own ranks to (an XID
        // naming a rank's pid may come after the crash it caused).
        let mapped: Vec<String> = self.open[i]
            .triggers
            .iter()
            .filter_map(Trigger::key)
            .flat_map(|k| self.devices_of(k))
            .map(|d| devices.resolve(&d))
            .collect();
        for d in mapped {
            if !self.open[i].record.devices.contains(&d) {
                self.open[i].record.devices.push(d);
            }
        }
        // A device failing takes in the ranks the agent maps to it (a
        // rank's own crash or hang does not take in its neighbours on a
        // shared GPU), of one job only: the incident's, or the first
        // found when it has none yet, in rank order so a replay agrees.
        let devs: BTreeSet<String> = self.open[i]
            .triggers
            .iter()
            .filter_map(|t| match t {
                Trigger::Hardware { component, .. } => Some(devices.resolve(component)),
                _ => None,
            })
            .collect();
        let mut on_device: Vec<RankKey> = self
            .ranks
            .keys()
            .filter(|k| {
                self.devices_of(k)
                    .iter()
                    .any(|d| devs.contains(&devices.resolve(d)))
            })
            .cloned()
            .collect();
        on_device.sort_by(|a, b| (&a.job, a.rank).cmp(&(&b.job, b.rank)));
        let rec = &mut self.open[i].record;
        for k in on_device {
            if rec.job.is_empty() {
                rec.job = k.job.clone();
            }
            if rec.job == k.job && !rec.ranks.contains(&k.rank) {
                rec.ranks.push(k.rank);
            }
        }
        rec.ranks.sort_unstable();
    }

    /// True unless every earlier incident of the job failed at `step`
    /// (then a repeated XID is the code's, at its step).
    fn differs_across_history(&self, job: &str, step: Option<u64>, id: &str) -> bool {
        let earlier: Vec<Option<u64>> = self
            .closed
            .iter()
            .chain(self.open.iter().map(|o| &o.record))
            .filter(|r| r.id != id && r.job == job)
            .map(|r| r.step)
            .collect();
        earlier.is_empty() || earlier.iter().any(|s| *s != step)
    }
}

fn trigger_at(t: &Trigger) -> SystemTime {
    match t {
        Trigger::Crash { at, .. }
        | Trigger::Hang { at, .. }
        | Trigger::Hardware { at, .. }
        | Trigger::Verdict { at, .. }
        | Trigger::Straggler { at, .. }
        | Trigger::Sdc { at, .. } => *at,
    }
}

fn priority(k: IncidentKind) -> u8 {
    match k {
        IncidentKind::Crash => 3,
        IncidentKind::Hang => 2,
        IncidentKind::Hardware => 1,
        IncidentKind::Straggler
        | IncidentKind::Sdc
        | IncidentKind::NoProgress
        | IncidentKind::CordonShare => 0,
    }
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// A message with its numbers and addresses blanked, so "tried to allocate
/// 2.00 GiB" and "tried to allocate 2.10 GiB" are the same failure.
fn normalize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_num = false;
    for c in s.chars().take(160) {
        if c.is_ascii_hexdigit() && (c.is_ascii_digit() || in_num) {
            if !in_num {
                out.push('#');
            }
            in_num = true;
        } else {
            in_num = false;
            out.push(c);
        }
    }
    out
}

/// Picks the class the evidence supports best and writes the summary.
/// `verdict` is the driver's own recovery verdict among the evidence, if
/// one points somewhere: it wins.
fn conclude(mut ev: Vec<Evidence>, verdict: Option<Evidence>, what: &[String]) -> Diagnosis {
    let override_item = verdict;
    let (class, confidence, rule) = if let Some(o) = override_item {
        (
            o.points_to.unwrap_or(FaultClass::Unknown),
            o.weight,
            "override.recovery_action".to_owned(),
        )
    } else {
        let mut best: Option<(FaultClass, f64)> = None;
        for c in FaultClass::ALL {
            // One vote per rule: four ranks hung in one collective, or
            // one XID repeated, are one signal, not four independent ones.
            let mut per_rule: HashMap<String, f64> = HashMap::new();
            for e in ev
                .iter()
                .filter(|e| e.points_to == Some(c) && e.weight > 0.0)
            {
                let w = per_rule.entry(vote_key(e)).or_insert(0.0);
                *w = w.max(e.weight);
            }
            let score = combine(per_rule.into_values());
            if score <= 0.0 {
                continue;
            }
            let better = match best {
                None => true,
                Some((bc, bs)) => score > bs + 1e-9 || ((score - bs).abs() <= 1e-9 && c > bc),
            };
            if better {
                best = Some((c, score));
            }
        }
        match best {
            Some((c, s)) => {
                let rule = ev
                    .iter()
                    .filter(|e| e.points_to == Some(c))
                    .max_by(|a, b| a.weight.total_cmp(&b.weight))
                    .map(rule_name)
                    .unwrap_or_default();
                (c, s, rule)
            }
            None => (FaultClass::Unknown, 0.2, "no_evidence".to_owned()),
        }
    };
    // A node-level class (hardware, infrastructure) that only a rank's own
    // word supports is a suspicion: said so in the evidence and summary,
    // and the policy never turns it into a cordon ([`Diagnosis::corroborated`]).
    let suspected = (class.is_hardware() || class == FaultClass::Infrastructure)
        && !ev
            .iter()
            .any(|e| e.points_to == Some(class) && e.weight > 0.0 && e.read_by_agent());
    if suspected {
        let at = ev
            .iter()
            .filter(|e| e.points_to == Some(class))
            .map(|e| e.at)
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        ev.push(Evidence {
            at,
            source: "agent".into(),
            signal: "belief".into(),
            subject: "node".into(),
            value: "the rank's word only".into(),
            points_to: None,
            weight: 0.0,
            note: format!(
                "no evidence the agent read itself (an XID, an ECC or link counter, DCGM, its gate) supports {class} in the window: a suspicion for the rank's own job, never a verdict on the node [{}]",
                super::diagnosis::RANK_WORD_ONLY
            ),
            event_id: 0,
        });
    }
    // The deciding evidence first, strongest first; context after.
    ev.sort_by(|a, b| {
        let ka = (a.points_to == Some(class), a.weight);
        let kb = (b.points_to == Some(class), b.weight);
        kb.0.cmp(&ka.0).then(kb.1.total_cmp(&ka.1))
    });
    let lead = ev
        .iter()
        .find(|e| e.points_to == Some(class))
        .map(|e| {
            let note = e.note.split(" [").next().unwrap_or(&e.note);
            // A rank's own words (its exception, its hang pattern) need no
            // label; a device signal does.
            if matches!(
                e.signal.as_str(),
                "exception" | "hang.pattern" | "straggler" | "sdc"
            ) {
                format!("{} ({note})", e.value)
            } else {
                format!("{} {}={} ({note})", e.subject, e.signal, e.value)
            }
        })
        .unwrap_or_else(|| "no signal points anywhere".into());
    // Class and confidence are fields of their own; the summary says what
    // happened and the evidence that decided.
    let summary = format!(
        "{}: {}{lead}",
        if what.is_empty() {
            "incident".to_owned()
        } else {
            what.join("; ")
        },
        if suspected {
            format!("suspected {class} on the rank's word only: ")
        } else {
            String::new()
        }
    );
    Diagnosis {
        class,
        confidence,
        summary,
        rule,
        evidence: ev,
    }
}

/// What makes two evidence items the same vote: the rule, and for an XID
/// its code (XID 48 and XID 63 are two signals; XID 13 twice is one).
fn vote_key(e: &Evidence) -> String {
    if e.signal == "xid" {
        format!("xid:{}", e.value)
    } else {
        rule_name(e)
    }
}

/// The rule name of an evidence item: the bracketed name in its note, or
/// its signal.
fn rule_name(e: &Evidence) -> String {
    e.note
        .rsplit_once(" [")
        .and_then(|(_, r)| r.strip_suffix(']'))
        .map_or_else(|| format!("signal.{}", e.signal), str::to_owned)
}
