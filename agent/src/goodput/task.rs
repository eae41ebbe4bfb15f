//! The task that feeds the ledger from the event bus, writes its journal
//! and sets its metrics.
//!
//! Events come with a wall-clock time; the ledger runs on CLOCK_MONOTONIC,
//! so each is converted by its age ([`super::mono_of`]). The scan's steps
//! come from the work loop ([`super::Goodput::observe_scan`]) into a buffer
//! that every taking of the ledger folds in first: this task's, before each
//! event (so a step the scan read before an incident is accounted before
//! it, as when the tick applied steps itself) and at each flush, so the
//! ledger never lags the scan by more than [`FLUSH_EVERY`]. This task never
//! touches the registry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;

use super::ledger::{Cause, ExitKind, Ledger, Occurrences};
use super::{mono_of, process_start_ns};
use crate::events::{Event, Severity};
use crate::state::AgentState;

/// How often the journal is written and the gauges set.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Subscribes now (before the caller lets anything publish) and returns
/// the task to run; it ends when the agent shuts down, after a last flush.
pub fn start(state: Arc<AgentState>) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut sub = state.events.subscribe(None);
    async move {
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen: BTreeMap<String, Occurrences> = BTreeMap::new();
        loop {
            tokio::select! {
                () = state.shutdown.cancelled() => break,
                _ = tick.tick() => {
                    state.goodput.flush();
                    set_metrics(&state, &mut seen);
                }
                ev = sub.live.recv() => match ev {
                    Ok(ev) => apply(&mut state.goodput.ledger(), &ev),
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "goodput ledger missed events: the bus outran it");
                    }
                    Err(RecvError::Closed) => break,
                },
            }
        }
        state.goodput.flush();
    }
}

/// `job/J/rank/R` into (J, R).
fn rank_subject(subject: &str) -> Option<(&str, u32)> {
    let rest = subject.strip_prefix("job/")?;
    let (job, rank) = rest.rsplit_once("/rank/")?;
    Some((job, rank.parse().ok()?))
}

fn evidence<'a>(ev: &'a Event, key: &str) -> Option<&'a str> {
    ev.evidence
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Applies one event to the ledger (pure but for reading a registering
/// process's start time from /proc).
pub fn apply(l: &mut Ledger, ev: &Event) {
    let at = mono_of(ev.time);
    match ev.kind {
        "rank.registered" => {
            let (Some((job, rank)), Some(pid)) = (
                rank_subject(&ev.subject),
                evidence(ev, "pid").and_then(|p| p.parse::<u32>().ok()),
            ) else {
                return;
            };
            let launch = process_start_ns(pid).unwrap_or(at);
            l.registered(job, rank, pid, launch, at);
        }
        "rank.exited" => {
            let Some((job, rank)) = rank_subject(&ev.subject) else {
                return;
            };
            let pid = evidence(ev, "pid")
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            let kind = match evidence(ev, "stopped_by") {
                Some(why) if why.contains("job ending") => ExitKind::JobEnding,
                Some(_) => ExitKind::StoppedForRestart,
                None if ev.severity == Severity::Info => ExitKind::Clean,
                None => ExitKind::Failed,
            };
            l.exited(job, rank, pid, kind, at);
        }
        "rank.deregistered" => {
            if let Some((job, rank)) = rank_subject(&ev.subject) {
                l.exited(job, rank, 0, ExitKind::Clean, at);
            }
        }
        "rank.hang" => {
            if let Some((job, _)) = rank_subject(&ev.subject) {
                l.incident(job, at);
            }
        }
        "rank.recovered" => {
            if let Some((job, _)) = rank_subject(&ev.subject) {
                l.resumed(job, at);
            }
        }
        "restart.requested" => {
            if let Some(job) = ev.subject.strip_prefix("job/") {
                l.resumed(job, at);
            }
        }
        "rank.straggler" | "rank.straggler_cleared" => {
            if let Some((job, rank)) = rank_subject(&ev.subject) {
                l.straggler(job, rank, ev.kind == "rank.straggler");
            }
        }
        "ckpt.saved" | "ckpt.restored" => {
            let (Some(job), Some(rank)) = (
                evidence(ev, "job_id"),
                evidence(ev, "rank").and_then(|r| r.parse::<u32>().ok()),
            ) else {
                return;
            };
            let key = if ev.kind == "ckpt.saved" {
                "stall_ms"
            } else {
                "duration_ms"
            };
            let Some(ms) = evidence(ev, key).and_then(|v| v.parse::<f64>().ok()) else {
                return;
            };
            if !ms.is_finite() || ms < 0.0 {
                return;
            }
            #[allow(clippy::cast_possible_truncation)]
            let ns = (ms * 1e6) as i64;
            if ev.kind == "ckpt.saved" {
                l.saved(job, rank, ns);
            } else {
                l.restored(job, rank, ns);
            }
        }
        _ => {}
    }
}

fn set_metrics(state: &AgentState, seen: &mut BTreeMap<String, Occurrences>) {
    for rep in state.goodput.reports(None) {
        for c in Cause::ALL {
            metrics::gauge!("warden_goodput_seconds", "job" => rep.job.clone(), "cause" => c.as_str())
                .set(rep.parts.get(c) as f64 / 1e9);
        }
        metrics::gauge!("warden_goodput_ratio", "job" => rep.job.clone()).set(rep.goodput());
        let before = seen.entry(rep.job.clone()).or_default();
        for (kind, now, then) in [
            ("startup", rep.occ.startups.0, before.startups.0),
            ("detection", rep.occ.detections.0, before.detections.0),
            ("restart", rep.occ.restarts.0, before.restarts.0),
            ("restore", rep.occ.restores.0, before.restores.0),
            ("save", rep.occ.saves.0, before.saves.0),
        ] {
            if now > then {
                metrics::counter!("warden_goodput_occurrences_total", "kind" => kind)
                    .increment(now - then);
            }
        }
        *before = rep.occ;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_parsed() {
        assert_eq!(rank_subject("job/a/rank/3"), Some(("a", 3)));
        assert_eq!(rank_subject("job/a/rank/b/rank/3"), Some(("a/rank/b", 3)));
        assert_eq!(rank_subject("job/a"), None);
        assert_eq!(rank_subject("agent"), None);
    }
}
