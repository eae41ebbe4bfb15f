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

use crate::device::DeviceId;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, SystemTime};

use super::FaultClass;
use super::config::AttributionConfig;
use super::diagnosis::{Diagnosis, Evidence, IncidentKind, IncidentRecord};
use super::rules;
use crate::events::{Event, Severity};
use crate::health::Status;
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
    /// "FAILED", "DEGRADED" or "OK" (a finding under its threshold).
    pub status: String,
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
    /// given, and a bare index "3" becomes "gpu3".
    pub fn resolve(&self, name: &str) -> String {
        if let Some(c) = self.aliases.get(&name.to_lowercase()) {
            return c.clone();
        }
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
            return DeviceId::gpu(name);
        }
        name.to_owned()
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

/// A hardware or host signal, with what the rules make of it.
#[derive(Debug, Clone)]
struct Observation {
    at: SystemTime,
    event_id: u64,
    source: String,
    component: String,
    signal: String,
    value: String,
    pid: Option<u32>,
    xid: Option<u32>,
    class: Option<FaultClass>,
    weight: f64,
    note: String,
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
                    source: "kmsg".into(),
                    component: o.component.clone(),
                    signal: "kmsg.oom_kill".into(),
                    value: o.process.clone(),
                    pid: Some(o.pid),
                    xid: None,
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
            o.xid == Some(code)
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
            source: source.into(),
            component: x.component.clone(),
            signal: "xid".into(),
            value: code.to_string(),
            pid,
            xid: Some(code),
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
        // The kernel log's reason names the code (`kmsg.xid.79`).
        let xid_signal = matches!(signal, "gpu.xid" | "kmsg.xid" | "xid")
            || signal
                .strip_prefix("kmsg.xid.")
                .is_some_and(|code| code.parse::<u32>().is_ok());
        if xid_signal {
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
            source: "health".into(),
            component: component.clone(),
            signal: signal.to_owned(),
            value: value.to_owned(),
            pid: None,
            xid: None,
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
            source: "gate".into(),
            component: component.clone(),
            signal: format!("gate.{}", first.map_or("failed", |f| f.test.as_str())),
            value: first.map_or("", |f| f.message.as_str()).to_owned(),
            pid: None,
            xid: None,
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
            if o.xid.is_some()
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

    /// The diagnosis of open incident `i`, its signature, step and exit code.
    fn diagnose(
        &self,
        i: usize,
        now: SystemTime,
        devices: &DeviceMap,
    ) -> (Diagnosis, String, Option<u64>, Option<i32>) {
        let open = &self.open[i];
        let rec = &open.record;
        let mut ev: Vec<Evidence> = Vec::new();
        let mut signature = String::new();
        let mut step = None;
        let mut exit_code = None;
        let mut pids: Vec<u32> = Vec::new();
        let mut what = Vec::new();
        let first_at = open
            .triggers
            .iter()
            .map(trigger_at)
            .min()
            .unwrap_or(rec.opened_at);

        for t in &open.triggers {
            match t {
                Trigger::Crash {
                    key,
                    at,
                    event_id,
                    code,
                    signal,
                    step: s,
                    section,
                    pid,
                } => {
                    step = step.or(*s);
                    exit_code = exit_code.or(*code);
                    if let Some(p) = pid.or_else(|| self.ranks.get(key).map(|m| m.pid)) {
                        pids.push(p);
                    }
                    let (rule, class, weight, note) = rules::exit_rule(*code, *signal);
                    let value = match (code, signal) {
                        (_, Some(s)) => format!("signal {s}"),
                        (Some(c), None) => format!("code {c}"),
                        _ => "unknown".into(),
                    };
                    what.push(format!(
                        "{key} {} at step {} in '{section}'",
                        match (code, signal) {
                            (_, Some(s)) => format!("was killed by signal {s}"),
                            (Some(c), None) => format!("exited with code {c}"),
                            _ => "exited".into(),
                        },
                        s.map_or("?".into(), |v| v.to_string())
                    ));
                    let exception = self.exceptions.get(key).filter(|x| {
                        within(x.at, *at - self.cfg.hardware_window, *at + self.cfg.settle)
                    });
                    // A SIGKILL right after the kernel's OOM killer named
                    // this pid: the host ran out of memory.
                    let oom = pid.and_then(|p| {
                        self.observations.iter().find(|o| {
                            o.signal == "kmsg.oom_kill"
                                && o.pid == Some(p)
                                && within(
                                    o.at,
                                    *at - self.cfg.hardware_window,
                                    *at + self.cfg.settle,
                                )
                        })
                    });
                    match (exception, oom) {
                        (_, Some(o)) => {
                            signature = format!("oom_kill:{}", o.value);
                            ev.push(Evidence {
                                at: o.at,
                                source: "kmsg".into(),
                                signal: "kmsg.oom_kill".into(),
                                subject: key.to_string(),
                                value: format!("pid {p}", p = o.pid.unwrap_or(0)),
                                points_to: Some(FaultClass::UserError),
                                weight: 0.6,
                                note: "the kernel's OOM killer killed this rank: host memory exhausted, most often by the job's own data loading".into(),
                                event_id: o.event_id,
                            });
                        }
                        (Some(x), None) => {
                            step = step.or(x.step);
                            let first_line = x.message.lines().next().unwrap_or("");
                            signature =
                                format!("exception:{}:{}", x.exception_type, normalize(first_line));
                            let (class, weight, note, name) =
                                match rules::exception_rule(&x.exception_type, &x.message) {
                                    Some(r) => (r.class, r.weight, r.note.to_owned(), r.name),
                                    None => (
                                        FaultClass::Unknown,
                                        0.35,
                                        "an exception no rule knows".to_owned(),
                                        "exception.other",
                                    ),
                                };
                            ev.push(Evidence {
                                at: x.at,
                                source: "rank".into(),
                                signal: "exception".into(),
                                subject: key.to_string(),
                                value: format!("{}: {}", x.exception_type, clip(first_line, 200)),
                                points_to: Some(class),
                                weight,
                                note: format!("{note} [{name}]"),
                                event_id: x.event_id,
                            });
                        }
                        (None, None) => {
                            signature = format!("exit:{value}");
                        }
                    }
                    ev.push(Evidence {
                        at: *at,
                        source: "rank".into(),
                        signal: if signal.is_some() {
                            "exit.signal"
                        } else {
                            "exit.code"
                        }
                        .into(),
                        subject: key.to_string(),
                        value,
                        // The exception, when there is one, explains the exit.
                        points_to: (exception.is_none() && oom.is_none()).then_some(class),
                        weight: if exception.is_none() && oom.is_none() {
                            weight
                        } else {
                            0.0
                        },
                        note: format!("{note} [{rule}]"),
                        event_id: *event_id,
                    });
                }
                Trigger::Hang {
                    key,
                    at,
                    event_id,
                    step: s,
                    section,
                    pattern,
                    process_state,
                    wchan,
                } => {
                    step = step.or(*s);
                    if let Some(m) = self.ranks.get(key) {
                        pids.push(m.pid);
                    }
                    what.push(format!(
                        "{key} hung at step {} in '{section}'",
                        s.map_or("?".into(), |v| v.to_string())
                    ));
                    if signature.is_empty() {
                        signature = format!("hang:{section}");
                    }
                    let (class, weight, note) = if pattern.contains("collective") {
                        (
                            FaultClass::TransientSoftware,
                            rules::COLLECTIVE_HANG_WEIGHT,
                            "every local rank is stuck in the same place: a collective hang (a peer elsewhere, NCCL or the network); a restart usually clears it [hang.collective]",
                        )
                    } else if process_state.starts_with('D') {
                        (
                            FaultClass::Infrastructure,
                            rules::KERNEL_BLOCKED_WEIGHT,
                            "blocked in the kernel (uninterruptible sleep): storage, a file system or a driver [hang.kernel_blocked]",
                        )
                    } else if pattern.contains("stuck alone") {
                        (
                            FaultClass::TransientSoftware,
                            rules::LONE_HANG_WEIGHT,
                            "this rank is stuck alone while its peers progress: look at this rank and its device [hang.alone]",
                        )
                    } else {
                        (
                            FaultClass::TransientSoftware,
                            rules::LONE_HANG_WEIGHT,
                            "no progress past the threshold [hang.other]",
                        )
                    };
                    ev.push(Evidence {
                        at: *at,
                        source: "hang".into(),
                        signal: "hang.pattern".into(),
                        subject: key.to_string(),
                        value: if wchan.is_empty() || wchan == "-" {
                            clip(pattern, 200)
                        } else {
                            format!("{} (wchan {wchan})", clip(pattern, 180))
                        },
                        points_to: Some(class),
                        weight,
                        note: note.into(),
                        event_id: *event_id,
                    });
                }
                Trigger::Hardware { component, at, .. } => {
                    what.push(format!("{component} failed"));
                    let _ = at;
                }
                Trigger::Verdict {
                    job,
                    at,
                    event_id,
                    summary,
                    charged,
                    waited_on,
                    culprits,
                } => {
                    let (value, note) = if *charged {
                        (
                            clip(&culprits.join("; "), 400),
                            "job-wide, the agents' positions put the culprit on this host: it is charged with the hang [hang.job_wide]".to_owned(),
                        )
                    } else if !waited_on.is_empty() {
                        what.push(format!("waited on {}", waited_on.join(", ")));
                        (
                            clip(&culprits.join("; "), 400),
                            format!(
                                "job-wide, this host's ranks waited on {}: the culprit's host is charged, not this one [hang.job_wide]",
                                waited_on.join(", ")
                            ),
                        )
                    } else {
                        (
                            clip(summary, 400),
                            "job-wide, the positions name no culprit [hang.job_wide]".to_owned(),
                        )
                    };
                    ev.push(Evidence {
                        at: *at,
                        source: "peers".into(),
                        signal: "hang.verdict".into(),
                        subject: format!("job/{job}"),
                        value,
                        points_to: None,
                        weight: 0.0,
                        note,
                        event_id: *event_id,
                    });
                }
                Trigger::Straggler {
                    key,
                    at,
                    event_id,
                    section,
                    relative,
                    explanation,
                    cause,
                } => {
                    what.push(format!(
                        "{key} straggles in '{section}' ({relative}x its peers)"
                    ));
                    ev.push(Evidence {
                        at: *at,
                        source: "straggler".into(),
                        signal: "straggler".into(),
                        subject: key.to_string(),
                        value: format!("{relative}x in {section}"),
                        points_to: Some(*cause),
                        weight: if *cause == FaultClass::Unknown {
                            0.3
                        } else {
                            rules::STRAGGLER_WEIGHT
                        },
                        note: format!("{explanation} [straggler]"),
                        event_id: *event_id,
                    });
                }
                Trigger::Sdc {
                    key,
                    at,
                    event_id,
                    step,
                    metric,
                    value,
                    job_median,
                    basis,
                } => {
                    let rule = rules::sdc_rule(basis);
                    let median =
                        job_median.map_or_else(|| "none".to_owned(), |m| format!("{m:.6}"));
                    what.push(format!(
                        "{key} reported {metric} {value:.6} at step {step} (job median {median})"
                    ));
                    ev.push(Evidence {
                        at: *at,
                        source: "sdc".into(),
                        signal: "sdc".into(),
                        subject: key.to_string(),
                        value: format!("{metric}={value:.6} at step {step}, job median {median}"),
                        points_to: Some(rule.class),
                        weight: rule.weight,
                        note: format!("{} [{}]", rule.note, rule.name),
                        event_id: *event_id,
                    });
                }
            }
        }

        // Hardware and host signals on the incident's devices (or naming
        // one of its processes) within the window before it.
        let from = first_at
            .checked_sub(self.cfg.hardware_window)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let to = now.max(first_at + self.cfg.settle);

        // The exceptions of the job's other ranks around a crash (a peer
        // failing in a collective when a rank died: gloo's "Connection
        // closed by peer"), as context: a consequence of the failure or its
        // cause, never a vote (the rank that failed first is what the
        // incident is about).
        let crashed: Vec<&RankKey> = open
            .triggers
            .iter()
            .filter(|t| matches!(t, Trigger::Crash { .. }))
            .filter_map(Trigger::key)
            .collect();
        let mut peers: Vec<(&RankKey, &ExceptionSeen)> = self
            .exceptions
            .iter()
            .filter(|(k, x)| k.job == rec.job && !crashed.contains(k) && within(x.at, from, to))
            .collect();
        if crashed.is_empty() {
            peers.clear();
        }
        peers.sort_by_key(|(k, _)| k.rank);
        for (k, x) in peers {
            let first_line = x.message.lines().next().unwrap_or("");
            let name = rules::exception_rule(&x.exception_type, &x.message)
                .map_or("exception.other", |r| r.name);
            ev.push(Evidence {
                at: x.at,
                source: "rank".into(),
                signal: "exception.peer".into(),
                subject: k.to_string(),
                value: format!("{}: {}", x.exception_type, clip(first_line, 200)),
                points_to: None,
                weight: 0.0,
                note: format!(
                    "a peer's exception around the failure: its consequence (a collective that lost the failed rank) or its cause [{name}]"
                ),
                event_id: x.event_id,
            });
        }
        let devs: BTreeSet<String> = rec.devices.iter().cloned().collect();
        let job_down = open.triggers.iter().any(|t| t.kind().job_down());
        for o in self.observations.iter().filter(|o| within(o.at, from, to)) {
            let comp = devices.resolve(&o.component);
            let on_device = devs.contains(&comp);
            let by_pid = o.pid.is_some_and(|p| pids.contains(&p));
            // Node-wide troubles (a NIC, host memory, the checkpoint disk)
            // count for a job that went down on this node.
            let node_wide = job_down
                && !DeviceId::is_gpu(&comp)
                && o.signal != "kmsg.oom_kill"
                && o.class.is_some_and(|c| c == FaultClass::Infrastructure);
            if !(on_device || by_pid || node_wide) {
                continue;
            }
            ev.push(Evidence {
                at: o.at,
                source: o.source.clone(),
                signal: o.signal.clone(),
                subject: comp,
                value: o.value.clone(),
                points_to: o.class,
                weight: o.weight,
                note: o.note.clone(),
                event_id: o.event_id,
            });
        }

        // What the health model holds now about the devices, where no event
        // already said it (a second reason of a component already FAILED
        // changes no status and publishes nothing).
        for d in &devs {
            for r in devices.reasons.get(d).into_iter().flatten() {
                if r.signal.contains("xid")
                    || ev.iter().any(|e| e.subject == *d && e.signal == r.signal)
                {
                    continue;
                }
                let Some(rule) = rules::signal_rule(&r.signal) else {
                    continue;
                };
                let (class, weight, note) = match r.status.as_str() {
                    "FAILED" => (
                        Some(rule.failed),
                        rule.weight,
                        format!("{} (FAILED, held now)", rule.note),
                    ),
                    "DEGRADED" if rule.degraded.is_some() => (
                        rule.degraded,
                        rule.weight,
                        format!("{} (DEGRADED, held now)", rule.note),
                    ),
                    "DEGRADED" => (
                        None,
                        0.0,
                        format!(
                            "{} (DEGRADED, held now): a warning about the next save, not a cause of this failure",
                            rule.note
                        ),
                    ),
                    // A finding the source judged harmless (under its
                    // threshold): shown as weighed, pointing nowhere.
                    _ => (
                        None,
                        0.0,
                        "under its threshold: not a fault on its own".to_owned(),
                    ),
                };
                ev.push(Evidence {
                    at: r.since,
                    source: "health".into(),
                    signal: r.signal.clone(),
                    subject: d.clone(),
                    value: r.value.clone(),
                    points_to: class,
                    weight,
                    note,
                    event_id: 0,
                });
            }
        }

        // An application XID that keeps coming back on one GPU, while the
        // other GPUs see none, points at that GPU.
        for d in &devs {
            let since = now
                .checked_sub(self.cfg.xid_repeat_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let user_xid = |o: &&Observation| {
                o.xid.is_some() && o.class == Some(FaultClass::UserError) && o.at >= since
            };
            let here: Vec<&Observation> = self
                .observations
                .iter()
                .filter(user_xid)
                .filter(|o| devices.resolve(&o.component) == *d)
                .collect();
            let elsewhere = self
                .observations
                .iter()
                .filter(user_xid)
                .any(|o| devices.resolve(&o.component) != *d);
            if here.len() >= self.cfg.xid_repeat_count as usize && !elsewhere {
                let steps_differ = self.differs_across_history(&rec.job, step, &rec.id);
                if steps_differ {
                    // The application XIDs on this GPU are read again: not
                    // the code's, the GPU's.
                    for e in ev.iter_mut().filter(|e| {
                        e.signal == "xid"
                            && e.subject == *d
                            && e.points_to == Some(FaultClass::UserError)
                    }) {
                        e.points_to = None;
                        e.weight = 0.0;
                        e.note = format!("{} (repeats on this GPU: see xid.repeat)", e.note);
                    }
                    ev.push(Evidence {
                        at: here.last().map_or(now, |o| o.at),
                        source: "history".into(),
                        signal: "xid.repeat".into(),
                        subject: d.clone(),
                        value: format!(
                            "{} application XIDs in {}",
                            here.len(),
                            humantime::format_duration(self.cfg.xid_repeat_window)
                        ),
                        points_to: Some(FaultClass::UncorrectableHardware),
                        weight: rules::XID_REPEAT_WEIGHT,
                        note: "application XIDs keep coming back on this GPU alone, at different steps: the GPU, not the code [xid.repeat_on_gpu]".into(),
                        event_id: 0,
                    });
                }
            }
        }

        // The same failure at the same step after a restart is the code's;
        // except a kill from outside (SIGKILL, SIGTERM: an operator, the
        // scheduler, a chaos test; the OOM killer has its own signature),
        // which no code does to itself, so two at one step are chance.
        let external = matches!(signature.as_str(), "exit:signal 9" | "exit:signal 15");
        if job_down && !signature.is_empty() && !external && step.is_some() {
            let since = now
                .checked_sub(self.cfg.history_window)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            if let Some(prev) = self
                .closed
                .iter()
                .chain(self.open.iter().map(|o| &o.record))
                .filter(|r| r.id != rec.id && r.job == rec.job && r.opened_at >= since)
                .find(|r| r.signature == signature && r.step == step)
            {
                ev.push(Evidence {
                    at: prev.opened_at,
                    source: "history".into(),
                    signal: "repeat_at_step".into(),
                    subject: format!("job/{}", rec.job),
                    value: format!("{} at step {}", prev.id, step.unwrap_or(0)),
                    points_to: Some(FaultClass::UserError),
                    weight: rules::REPEAT_AT_STEP_WEIGHT,
                    note: "the same failure at the same step before a restart: the code, not the machine [history.repeat_at_step]".into(),
                    event_id: 0,
                });
            }
        }

        let diagnosis = conclude(ev, &what);
        (diagnosis, signature, step, exit_code)
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
fn conclude(mut ev: Vec<Evidence>, what: &[String]) -> Diagnosis {
    // The driver's recovery action is the driver's own verdict: it wins.
    let override_item = ev
        .iter()
        .filter(|e| {
            (e.signal == "gpu.recovery_action"
                || crate::taxonomy::dcgm::is_recovery_action(&e.signal))
                && e.points_to.is_some()
        })
        .max_by(|a, b| a.weight.total_cmp(&b.weight))
        .cloned();
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
