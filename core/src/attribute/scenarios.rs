//! The recorded incident scenarios (tests/fixtures/incidents/scenarios.toml)
//! replayed through the engine and the default policy: each scenario is
//! the sequence of events the agent published, with their timing, and the
//! diagnosis and decision it must come to.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use super::engine::{CurrentReason, DeviceMap, Engine};
use super::{AttributionConfig, Diagnosis, FaultClass, IncidentKind, IncidentRecord};
use crate::events::{Event, Severity};
use crate::health::{ReasonKind, Status};
use crate::policy::{self, Action, Context, Decision, PolicyConfig};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    scenario: Vec<Scenario>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    name: String,
    #[allow(dead_code)]
    about: String,
    events: Vec<Recorded>,
    #[serde(default)]
    health: Vec<HealthNow>,
    #[serde(default)]
    aliases: BTreeMap<String, String>,
    /// The node's incident journal before the scenario starts (earlier
    /// jobs, earlier cordons): what the lemon rule and the circuit breaker
    /// count.
    #[serde(default)]
    history: Vec<Past>,
    /// The node is cordoned when the scenario starts.
    #[serde(default)]
    cordoned: bool,
    /// `[policy]` for this scenario (default: the default policy).
    #[serde(default)]
    policy: PolicyConfig,
    expect: Expect,
}

/// One decided incident of the journal from before the scenario.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Past {
    id: String,
    /// Seconds before the scenario's start that it opened and was decided.
    ago_s: u64,
    #[serde(default)]
    job: String,
    #[serde(default = "crash")]
    kind: IncidentKind,
    class: FaultClass,
    action: Action,
    /// Who decided ("policy", "lemon rule").
    #[serde(default = "by_policy")]
    decided_by: String,
    /// Where its deciding evidence came from: "kmsg" (the default: the
    /// agent's own reading) or a rank's word ("rank", "sdc").
    #[serde(default = "from_kmsg")]
    source: String,
}

fn from_kmsg() -> String {
    "kmsg".into()
}

fn crash() -> IncidentKind {
    IncidentKind::Crash
}

fn by_policy() -> String {
    "policy".into()
}

impl Past {
    fn record(&self, t0: SystemTime) -> IncidentRecord {
        let at = t0 - Duration::from_secs(self.ago_s);
        IncidentRecord {
            id: self.id.clone(),
            opened_at: at,
            updated_at: at,
            kind: self.kind,
            host: "h".into(),
            job: self.job.clone(),
            ranks: Vec::new(),
            devices: Vec::new(),
            diagnosis: Diagnosis {
                class: self.class,
                confidence: 0.9,
                summary: format!("recorded {} incident", self.class),
                rule: "history".into(),
                evidence: vec![crate::attribute::Evidence {
                    at,
                    source: self.source.clone(),
                    signal: "recorded".into(),
                    subject: "gpu0".into(),
                    value: String::new(),
                    points_to: Some(self.class),
                    weight: 0.9,
                    note: "recorded".into(),
                    event_id: 0,
                }],
            },
            decision: Some(Decision {
                action: self.action,
                reason: "recorded".into(),
                decided_by: self.decided_by.clone(),
                attempt: 1,
                budget: 1,
                backoff: Duration::ZERO,
                exit_code: 0,
                decided_at: at,
                dry_run: false,
                replace: None,
            }),
            superseded: Vec::new(),
            signature: String::new(),
            step: None,
            exit_code: None,
            waited_on: Vec::new(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Recorded {
    /// Milliseconds after the scenario's start.
    t: u64,
    kind: String,
    subject: String,
    #[serde(default)]
    severity: Option<String>,
    #[serde(default)]
    evidence: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HealthNow {
    component: String,
    signal: String,
    /// The reason's kind as its source sets it (`ReasonKind::as_str`);
    /// none: a judged finding.
    #[serde(default)]
    kind: Option<String>,
    status: String,
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    class: FaultClass,
    action: Action,
    #[serde(default)]
    rule: Option<String>,
    #[serde(default)]
    min_confidence: Option<f64>,
    #[serde(default)]
    kind: Option<String>,
    /// How many incidents the scenario opens (default: any).
    #[serde(default)]
    incidents: Option<usize>,
    #[serde(default)]
    ranks: Option<Vec<u32>>,
    #[serde(default)]
    exit_code: Option<i32>,
    /// An evidence item whose signal is this must be present.
    #[serde(default)]
    evidence_signal: Option<String>,
    /// And its source must be this.
    #[serde(default)]
    evidence_source: Option<String>,
    /// Signals that must not point anywhere (weighed, found harmless).
    #[serde(default)]
    context_signal: Option<String>,
    /// What the last incident records it waited on (a hang whose
    /// job-wide verdict put the culprit on another host); `[]`: charged.
    #[serde(default)]
    waited_on: Option<Vec<String>>,
    /// The decision's `decided_by` ("lemon rule", "policy (circuit breaker)").
    #[serde(default)]
    decided_by: Option<String>,
    /// Texts the decision's reason must hold (the lemon rule's repeats).
    #[serde(default)]
    reason_contains: Vec<String>,
    /// The decision is (or is not) a dry run's.
    #[serde(default)]
    dry_run: Option<bool>,
}

fn kind_static(kind: &str) -> &'static str {
    // Event kinds are `&'static str` in the bus; the scenarios use a known set.
    const KINDS: &[&str] = &[
        "rank.registered",
        "rank.exception",
        "rank.exited",
        "rank.hang",
        "rank.straggler",
        "rank.sdc_suspect",
        "job.hang_verdict",
        "gpu.xid",
        "kmsg.xid",
        "kmsg.oom_kill",
        "gpu.processes",
        "health.changed",
        "rank.deregistered",
    ];
    KINDS
        .iter()
        .find(|k| **k == kind)
        .copied()
        .unwrap_or_else(|| panic!("scenario uses an event kind the runner does not know: {kind}"))
}

fn severity(s: Option<&str>, kind: &str) -> Severity {
    match s {
        Some("info") => Severity::Info,
        Some("warning") => Severity::Warning,
        Some("error") => Severity::Error,
        Some("critical") => Severity::Critical,
        Some(other) => panic!("unknown severity {other}"),
        None if kind == "rank.exited" => Severity::Error,
        None => Severity::Info,
    }
}

/// Replays one scenario; returns every incident's final record. Each
/// decision goes through the policy and the node-level rules as the
/// agent's attribution task runs them (no hook), over the scenario's
/// `history` and the incidents decided so far.
fn replay(s: &Scenario) -> Vec<IncidentRecord> {
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    let cfg = AttributionConfig::default();
    let settle = cfg.settle;
    let policy_cfg = &s.policy;
    let mut past: Vec<IncidentRecord> = s.history.iter().map(|p| p.record(t0)).collect();
    past.sort_by_key(|r| r.opened_at);
    let mut engine = Engine::new(cfg, "h".into(), past.clone());
    let mut devices = DeviceMap::default();
    for (alias, comp) in &s.aliases {
        devices.add(comp, [alias.clone()]);
    }
    for h in &s.health {
        devices.add_reason(
            &h.component,
            CurrentReason {
                signal: h.signal.clone(),
                kind: h.kind.as_deref().map_or(ReasonKind::Judged, |k| {
                    ReasonKind::parse(k).unwrap_or_else(|| panic!("unknown reason kind {k:?}"))
                }),
                status: match h.status.as_str() {
                    "FAILED" => Status::Failed,
                    "DEGRADED" => Status::Degraded,
                    "OK" => Status::Ok,
                    other => panic!("health status {other:?}: FAILED, DEGRADED or OK"),
                },
                value: h.value.clone(),
                since: t0,
            },
        );
    }
    let mut out: BTreeMap<String, IncidentRecord> = BTreeMap::new();
    let mut cordoned = s.cordoned;
    let mut decide_due = |engine: &mut Engine,
                          now: SystemTime,
                          out: &mut BTreeMap<String, IncidentRecord>| {
        for d in engine.take_due(now, &devices) {
            if !d.needs_decision {
                out.insert(d.record.id.clone(), d.record);
                continue;
            }
            let history = engine.past_decisions(&d.record.job, &d.record.id);
            let ctx = Context {
                job_down: d.record.kind.job_down(),
                exit_code: d.record.exit_code,
                history: &history,
                now,
                sdc: d.record.kind == crate::attribute::IncidentKind::Sdc,
            };
            let mut decision = policy::decide(policy_cfg, &d.record.diagnosis, &ctx);
            // The journal as the agent's store holds it: the history,
            // then what this scenario decided so far.
            let journal: Vec<IncidentRecord> = past.iter().chain(out.values()).cloned().collect();
            policy::before_hook(policy_cfg, &journal, &d.record, &mut decision, now);
            policy::after_hook(
                policy_cfg,
                &journal,
                &d.record,
                &mut decision,
                cordoned,
                now,
            );
            if decision.effective_action() == Action::Cordon {
                cordoned = true;
            }
            let rec = engine
                .decided(&d.record.id, decision)
                .expect("open incident");
            out.insert(rec.id.clone(), rec);
        }
    };
    for (i, r) in s.events.iter().enumerate() {
        let at = t0 + Duration::from_millis(r.t);
        decide_due(&mut engine, at, &mut out);
        let evidence = r
            .evidence
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect();
        let signal = crate::signal::replay::signal_of(
            kind_static(&r.kind),
            &r.subject,
            severity(r.severity.as_deref(), &r.kind),
            &evidence,
        )
        .unwrap_or_else(|| panic!("{}: event {i} ({}) does not replay", s.name, r.kind));
        let ev = Event::new(1000 + i as u64, at, signal);
        engine.observe(&ev);
    }
    let end = t0 + Duration::from_millis(s.events.last().map_or(0, |e| e.t)) + settle;
    decide_due(&mut engine, end, &mut out);
    let mut v: Vec<IncidentRecord> = out.into_values().collect();
    v.sort_by_key(|r| r.opened_at);
    v
}

#[test]
fn recorded_scenarios() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/incidents/scenarios.toml"
    );
    let text = std::fs::read_to_string(path).expect("scenario file");
    let file: File = crate::config::parse_toml(&text)
        .unwrap_or_else(|(key, msg)| panic!("{path}: key `{key}`: {msg}"));
    assert!(
        file.scenario.len() >= 30,
        "the suite holds {} scenarios",
        file.scenario.len()
    );
    let mut failures = Vec::new();
    for s in &file.scenario {
        let got = replay(s);
        let Some(last) = got.last() else {
            failures.push(format!("{}: no incident", s.name));
            continue;
        };
        let d = &last.diagnosis;
        let dec = last.decision.as_ref().expect("decided");
        let e = &s.expect;
        let mut wrong = Vec::new();
        if d.class != e.class {
            wrong.push(format!("class {} (want {})", d.class, e.class));
        }
        if dec.action != e.action {
            wrong.push(format!("action {} (want {})", dec.action, e.action));
        }
        if let Some(r) = &e.rule
            && d.rule != *r
        {
            wrong.push(format!("rule {} (want {r})", d.rule));
        }
        if let Some(c) = e.min_confidence
            && d.confidence < c
        {
            wrong.push(format!("confidence {:.2} (want >= {c})", d.confidence));
        }
        if let Some(k) = &e.kind
            && last.kind.as_str() != k
        {
            wrong.push(format!("kind {} (want {k})", last.kind.as_str()));
        }
        if let Some(n) = e.incidents
            && got.len() != n
        {
            wrong.push(format!("{} incidents (want {n})", got.len()));
        }
        if let Some(r) = &e.ranks
            && last.ranks != *r
        {
            wrong.push(format!("ranks {:?} (want {r:?})", last.ranks));
        }
        if let Some(c) = e.exit_code
            && dec.exit_code != c
        {
            wrong.push(format!("exit code {} (want {c})", dec.exit_code));
        }
        if let Some(w) = &e.waited_on
            && last.waited_on != *w
        {
            wrong.push(format!("waited on {:?} (want {w:?})", last.waited_on));
        }
        if let Some(sig) = &e.evidence_signal {
            match d.evidence.iter().find(|x| x.signal == *sig) {
                None => wrong.push(format!("no evidence with signal {sig}")),
                Some(x) => {
                    if let Some(src) = &e.evidence_source
                        && x.source != *src
                    {
                        wrong.push(format!("evidence {sig} from {} (want {src})", x.source));
                    }
                }
            }
        }
        if let Some(sig) = &e.context_signal {
            match d.evidence.iter().find(|x| x.signal == *sig) {
                None => wrong.push(format!("no context evidence with signal {sig}")),
                Some(x) if x.points_to.is_some() => wrong.push(format!(
                    "{sig} points to {:?}; want context only",
                    x.points_to
                )),
                Some(_) => {}
            }
        }
        if let Some(by) = &e.decided_by
            && dec.decided_by != *by
        {
            wrong.push(format!("decided by {} (want {by})", dec.decided_by));
        }
        for text in &e.reason_contains {
            if !dec.reason.contains(text.as_str()) {
                wrong.push(format!("reason {:?} lacks {text:?}", dec.reason));
            }
        }
        if let Some(dry) = e.dry_run
            && dec.dry_run != dry
        {
            wrong.push(format!("dry run {} (want {dry})", dec.dry_run));
        }
        if !wrong.is_empty() {
            failures.push(format!(
                "{}: {}\n    summary: {}\n    evidence: {:#?}",
                s.name,
                wrong.join(", "),
                d.summary,
                d.evidence
                    .iter()
                    .map(|x| format!(
                        "{} {} {} -> {:?} {:.2}",
                        x.source, x.signal, x.value, x.points_to, x.weight
                    ))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} scenarios failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
