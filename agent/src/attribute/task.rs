//! The attribution task: the agent's events in, decisions out.
//!
//! Subscribes to the event bus before anything else publishes, feeds every
//! event to the [`Engine`], and when an incident is due: resolves device
//! names through the health model, asks the policy (and the user's hook),
//! records the decision, publishes `incident.diagnosed` and
//! `incident.decided`, appends the journal, and for a cordon marks the node
//! (health component `node/cordon`, the condition file, `node.cordoned`).
//! Between the policy and the record, the node-level rules of
//! [`guard`] read the journal: the lemon rule (before the hook, which may
//! overrule it), the cordon circuit breaker and dry run (after it, so no
//! hook gets past them); each shows in the decision's reason, an event
//! (`policy.lemon`, `policy.circuit_breaker`, `policy.dry_run`) and a
//! metric.
//! Runs on its own task: a slow hook delays other decisions by at most its
//! timeout, never a scan or an API call.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;

use crate::act::in_process;
use crate::policy::hook;
use warden_core::attribute::AttributionConfig;
use warden_core::attribute::engine::{CurrentReason, DeviceMap, Diagnosed, Engine};
use warden_core::attribute::store::Cordon;
use warden_core::attribute::store::IncidentStore;
use warden_core::attribute::{Escalation, IncidentRecord};
use warden_core::events::EventBus;
use warden_core::events::health_reporter::Reporter;
use warden_core::events::{Event, NewEvent, Severity, Subscription};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::policy::PolicyConfig;
use warden_core::policy::guard;
use warden_core::policy::{self, Action, Context, Decision};
use warden_core::signal::Signal;

/// What attribution uses of the agent, and nothing more. The API's
/// Uncordon is handed it too.
#[derive(Debug, Clone)]
pub struct Handles {
    /// The bus: subscribed to, and where diagnoses and decisions go.
    pub events: Arc<EventBus>,
    /// The health model (device names, the `node/cordon` component).
    pub reporter: Reporter,
    /// The incident journal and the cordon.
    pub store: Arc<Mutex<IncidentStore>>,
    /// Decided incidents, to the launchers following their job.
    pub feed: tokio::sync::broadcast::Sender<IncidentRecord>,
    /// `[attribution]`.
    pub attribution: AttributionConfig,
    /// `[policy]`, the hook included.
    pub policy: PolicyConfig,
    /// This host, for the engine and the hook's input.
    pub host: String,
    /// For `restart_in_process` decisions, which the agent carries out.
    pub in_process: in_process::Handles,
    /// Drains the node in Slurm on a cordon, resumes it on uncordon.
    pub slurm: Arc<crate::act::slurm::Slurm>,
    /// Ends the task with the agent.
    pub shutdown: CancellationToken,
}

impl Handles {
    fn incident_store(&self) -> MutexGuard<'_, IncidentStore> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Subscribes now (call before the agent starts publishing) and returns
/// the task to spawn; `escalations` are decisions taken outside it (an
/// in-process restart not acknowledged in time).
pub fn start(
    state: Handles,
    escalations: Option<UnboundedReceiver<Escalation>>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let sub = state.events.subscribe(None);
    // Attribution's memory: its own incidents, not the stops launchers
    // reported (ReportJobStop), which no budget or repeat rule reads.
    let history = state
        .incident_store()
        .all()
        .into_iter()
        .filter(|r| !r.kind.from_launcher())
        .collect();
    let engine = Engine::new(state.attribution.clone(), state.host.clone(), history);
    // A cordon from before a restart is shown again.
    if let Some(c) = state.incident_store().cordon().cloned() {
        report_cordon(&state, Some(&c));
        // Drained again: a drain that failed before the restart is retried.
        state.slurm.drain(&c.incident, &c.summary);
    }
    run(state, sub, engine, escalations)
}

async fn run(
    state: Handles,
    sub: Subscription,
    mut engine: Engine,
    mut escalations: Option<UnboundedReceiver<Escalation>>,
) {
    let mut last_id = 0u64;
    for e in &sub.backlog {
        engine.observe(e);
        last_id = e.id;
    }
    let mut live = sub.live;
    loop {
        let wait = engine.next_due().map(|d| {
            d.duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO)
        });
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            r = live.recv() => match r {
                Ok(e) => {
                    if e.id > last_id {
                        last_id = e.id;
                        engine.observe(&e);
                    }
                }
                Err(RecvError::Lagged(n)) => {
                    // Catch up from the ring; what it no longer holds is lost
                    // to attribution, and said so.
                    let (missed, dropped_up_to) = state.events.list(last_id, 0);
                    if dropped_up_to > last_id {
                        tracing::warn!(lagged = n, "attribution fell behind the event bus; some events were not seen");
                    }
                    for e in missed {
                        last_id = e.id;
                        engine.observe(&e);
                    }
                }
                Err(RecvError::Closed) => return,
            },
            () = sleep(wait) => {}
            Some(e) = recv_escalation(&mut escalations) => escalate(&state, &mut engine, e),
        }
        let now = SystemTime::now();
        if engine.next_due().is_some_and(|d| d <= now) {
            let devices = device_map(&state);
            for d in engine.take_due(now, &devices) {
                handle(&state, &mut engine, d).await;
            }
        }
    }
}

async fn recv_escalation(rx: &mut Option<UnboundedReceiver<Escalation>>) -> Option<Escalation> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Records a decision taken outside the task, superseding the one in force.
fn escalate(state: &Handles, engine: &mut Engine, e: Escalation) {
    let Some(rec) = engine.record(&e.incident).cloned() else {
        tracing::warn!(incident = %e.incident, "escalation for an incident attribution does not know");
        return;
    };
    let previous = rec.decision.clone();
    let mut decision = Decision {
        action: e.action,
        reason: e.reason,
        decided_by: "escalation".into(),
        attempt: previous.as_ref().map_or(1, |d| d.attempt),
        budget: previous.as_ref().map_or(0, |d| d.budget),
        backoff: Duration::ZERO,
        exit_code: policy::exit_code_for(e.action, rec.diagnosis.class, false, rec.exit_code),
        decided_at: SystemTime::now(),
        dry_run: false,
        replace: e.replace,
    };
    if state.policy.dry_run {
        guard::dry_run(&mut decision);
    }
    let Some(record) = engine.decided(&e.incident, decision) else {
        return;
    };
    carry_out(state, record);
}

async fn sleep(wait: Option<Duration>) {
    match wait {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

/// Device aliases (uuid, PCI bus id) and current findings, from the health
/// model.
fn device_map(state: &Handles) -> DeviceMap {
    let mut map = DeviceMap::default();
    for c in state.reporter.model.snapshot().components {
        let labels = ["uuid", "pci"]
            .iter()
            .filter_map(|k| c.labels.get(*k).cloned())
            .collect::<Vec<_>>();
        map.add(&c.id, labels);
        for r in &c.reasons {
            {
                map.add_reason(
                    &c.id,
                    CurrentReason {
                        signal: r.signal.clone(),
                        kind: r.kind,
                        status: r.status,
                        value: r.value.clone(),
                        since: r.since,
                    },
                );
            }
        }
    }
    map
}

async fn handle(state: &Handles, engine: &mut Engine, d: Diagnosed) {
    if !d.needs_decision {
        // New evidence, same verdict: the record is updated quietly.
        state.incident_store().upsert(d.record, true);
        return;
    }
    let record = d.record;
    let history = engine.past_decisions(&record.job, &record.id);
    let now = SystemTime::now();
    let ctx = Context {
        job_down: record.kind.job_down(),
        exit_code: record.exit_code,
        history: &history,
        now,
        sdc: record.kind == warden_core::attribute::IncidentKind::Sdc,
    };
    let mut decision = policy::decide(&state.policy, &record.diagnosis, &ctx);
    // The node's whole journal (every job, across agent restarts).
    let journal = state.incident_store().node_journal();
    let lemon = policy::before_hook(&state.policy, &journal, &record, &mut decision, now);
    if state.policy.hook.is_enabled() {
        ask_hook(state, &record, &mut decision).await;
    }
    let cordoned = state.incident_store().cordon().is_some();
    let held = policy::after_hook(
        &state.policy,
        &journal,
        &record,
        &mut decision,
        cordoned,
        now,
    );
    let Some(record) = engine.decided(&record.id, decision) else {
        return;
    };
    carry_out(state, record.clone());
    report_rules(state, &record, lemon.as_ref(), held.as_ref());
}

/// The events and metrics of the node-level rules that changed a decision.
fn report_rules(
    state: &Handles,
    r: &IncidentRecord,
    lemon: Option<&guard::Lemon>,
    held: Option<&guard::Breaker>,
) {
    let Some(dec) = &r.decision else {
        return;
    };
    // Unless the hook overruled it (a held cordon is still the rule's).
    if let Some(found) = lemon.filter(|_| dec.decided_by.starts_with(guard::LEMON_DECIDED_BY)) {
        if dec.action == Action::Cordon && !dec.dry_run {
            metrics::counter!("warden_lemon_cordons_total").increment(1);
        }
        state.events.publish(
            NewEvent::new(
                Severity::Critical,
                "policy.lemon",
                r.id.clone(),
                format!(
                    "lemon node: {} repeated incidents ({}); {}",
                    found.incidents.len(),
                    found.incidents.join(", "),
                    if dec.dry_run {
                        "dry run: would cordon"
                    } else if dec.action == Action::Cordon {
                        "cordoning"
                    } else {
                        "the cordon was not carried out"
                    }
                ),
            )
            .with("incidents", found.incidents.join(","))
            .with(
                "jobs",
                found.jobs.iter().cloned().collect::<Vec<_>>().join(","),
            )
            .with("action", dec.action),
        );
    }
    if let Some(b) = held {
        metrics::counter!("warden_circuit_breaker_held_total").increment(1);
        state.events.publish(
            NewEvent::new(
                Severity::Warning,
                "policy.circuit_breaker",
                r.id.clone(),
                format!(
                    "circuit breaker open: {} not cordoned ({} cordons in {} already: {}); {} instead",
                    r.id,
                    b.recent.len(),
                    humantime::format_duration(state.policy.circuit_breaker.window),
                    b.recent.join(", "),
                    dec.action
                ),
            )
            .with("recent", b.recent.join(","))
            .with("max_cordons", state.policy.circuit_breaker.max_cordons)
            .with("action", dec.action),
        );
    }
    if dec.dry_run {
        metrics::counter!("warden_dry_run_decisions_total", "action" => dec.action.as_str())
            .increment(1);
        state.events.publish(
            NewEvent::new(
                Severity::Info,
                "policy.dry_run",
                r.id.clone(),
                format!("dry run: would {} for {}; nothing done", dec.action, r.id),
            )
            .with("action", dec.action)
            .with("reason", &dec.reason),
        );
    }
}

/// Publishes a decided incident, records it, tells the launchers, and does
/// what the agent itself does about it.
fn carry_out(state: &Handles, record: IncidentRecord) {
    publish(state, &record);
    state.incident_store().upsert(record.clone(), true);
    // Launchers following the job (WatchIncidents) act on it; no receiver
    // is no error.
    let _ = state.feed.send(record.clone());
    // In dry run nothing is done (launchers read `continue`).
    match record.decision.as_ref().map(|d| d.effective_action()) {
        Some(Action::Cordon) => cordon(state, &record),
        // The agent carries this one out itself: it owns the ranks' slots
        // and control streams, whatever launched them.
        // A replacement is a revision of a request already in flight: the
        // launcher replaces the ranks, the waiter goes on for the others.
        Some(Action::RestartInProcess)
            if record.decision.as_ref().is_none_or(|d| d.replace.is_none()) =>
        {
            in_process::start(&state.in_process, &record);
        }
        _ => {}
    }
}

/// Lets the user's hook override `decision`; a failing hook leaves it as it
/// is and says why.
async fn ask_hook(state: &Handles, record: &IncidentRecord, decision: &mut Decision) {
    let input = serde_json::json!({
        "host": state.host,
        "incident": record,
        "proposed": decision,
    });
    match hook::ask(&state.policy.hook, &input).await {
        Ok(answer) => match answer.action {
            Some(a) => {
                decision.action = a;
                decision.reason = if answer.reason.is_empty() {
                    format!("the policy hook chose {a} (proposed: {})", decision.reason)
                } else {
                    format!("the policy hook chose {a}: {}", answer.reason)
                };
                decision.decided_by = "hook".into();
                decision.exit_code = policy::exit_code_for(
                    a,
                    record.diagnosis.class,
                    decision.attempt > decision.budget,
                    record.exit_code,
                );
                if !a.is_restart() {
                    decision.backoff = Duration::ZERO;
                }
            }
            // The proposal's author kept ("policy", "lemon rule").
            None => decision.decided_by = format!("{} (the hook agreed)", decision.decided_by),
        },
        Err(e) => {
            metrics::counter!("warden_policy_hook_failures_total").increment(1);
            decision.decided_by = format!("{} (hook failed: {e})", decision.decided_by);
            state.events.publish(
                NewEvent::new(
                    Severity::Warning,
                    "policy.hook_failed",
                    record.id.clone(),
                    format!("policy hook gave no usable answer for {}: {e}; warden's own decision stands", record.id),
                )
                .with("error", e.to_string())
                .with("command", state.policy.hook.command.join(" ")),
            );
        }
    }
}

fn publish(state: &Handles, r: &IncidentRecord) {
    publish_decided(&state.events, r);
}

/// Publishes a decided incident (`incident.diagnosed`, `incident.decided`)
/// and counts it: for attribution's decisions and for the stops launchers
/// report (ReportJobStop), so both read alike in events and metrics.
pub fn publish_decided(events: &EventBus, r: &IncidentRecord) {
    let diag = &r.diagnosis;
    let Some(dec) = &r.decision else {
        return;
    };
    metrics::counter!("warden_incidents_total", "class" => diag.class.as_str(), "kind" => r.kind.as_str())
        .increment(1);
    metrics::counter!("warden_decisions_total", "action" => dec.action.as_str()).increment(1);
    let r = Arc::new(r.clone());
    events.publish(Signal::IncidentDiagnosed(r.clone()));
    events.publish(Signal::IncidentDecided(r));
}

fn cordon(state: &Handles, r: &IncidentRecord) {
    let c = Cordon {
        since: SystemTime::now(),
        incident: r.id.clone(),
        class: r.diagnosis.class.as_str().to_owned(),
        summary: r.diagnosis.summary.clone(),
    };
    if !state.incident_store().set_cordon(c.clone()) {
        return;
    }
    report_cordon(state, Some(&c));
    state.slurm.drain(&c.incident, &c.summary);
    state.events.publish(
        NewEvent::new(
            Severity::Critical,
            "node.cordoned",
            "node/cordon",
            format!("node cordoned by {}: {}", r.id, r.diagnosis.summary),
        )
        .with("incident", &r.id)
        .with("class", r.diagnosis.class),
    );
}

/// Lifts the cordon (the Uncordon RPC); returns whether there was one.
pub fn uncordon(state: &Handles, reason: &str) -> bool {
    let Some(was) = state.incident_store().clear_cordon() else {
        return false;
    };
    report_cordon(state, None);
    state.slurm.resume(reason);
    state.events.publish(
        NewEvent::new(
            Severity::Info,
            "node.uncordoned",
            "node/cordon",
            format!(
                "cordon lifted ({}); it was set by {}",
                if reason.is_empty() {
                    "no reason given"
                } else {
                    reason
                },
                was.incident
            ),
        )
        .with("incident", was.incident)
        .with("reason", reason),
    );
    true
}

/// Shows the cordon as a health component, so `warden health`, GetNodeHealth
/// and `warden health --plugin` report it like any other failure.
fn report_cordon(state: &Handles, c: Option<&Cordon>) {
    let reasons = c
        .map(|c| Reason {
            status: Status::Failed,
            kind: ReasonKind::Judged,
            signal: "policy.cordon".into(),
            value: c.class.clone(),
            threshold: String::new(),
            window: String::new(),
            since: c.since,
            message: format!(
                "cordoned by {}: {} (lift with `warden uncordon` after repair)",
                if c.incident.is_empty() {
                    "an earlier decision"
                } else {
                    &c.incident
                },
                c.summary
            ),
        })
        .into_iter()
        .collect();
    state.reporter.apply_from(
        "policy",
        ComponentReport {
            id: "node/cordon".into(),
            kind: "node".into(),
            labels: Default::default(),
            status_override: None,
            reasons,
        },
    );
}

/// Diagnosis events the CLI and tests read, by kind.
pub const EVENT_KINDS: &[&str] = &[
    "incident.diagnosed",
    "incident.decided",
    "policy.hook_failed",
    "policy.lemon",
    "policy.circuit_breaker",
    "policy.dry_run",
    "node.cordoned",
    "node.uncordoned",
];

/// True for the events this task publishes (so replays can skip them).
pub fn is_own(e: &Event) -> bool {
    EVENT_KINDS.contains(&e.kind)
}
