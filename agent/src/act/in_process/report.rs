//! What the waiter's decisions say to the world: the events
//! `restart.acknowledged`, `restart.in_process_timeout` and
//! `restart.replace_ranks`, their counters, and the escalations the
//! attribution task records as revisions of the incident.
//!
//! In: the request and a decision of the waiter ([`super::waiter`]). Out:
//! one event and one count per decision; an [`Escalation`] when an
//! incident carries it. Never: decide anything (the waiter did), or send
//! an escalation for a request asked by hand (no incident to revise).

use std::collections::BTreeMap;
use std::time::Duration;

use warden_core::attribute::Escalation;
use warden_core::events::{NewEvent, Severity};
use warden_core::policy::{Action, Replacement};
use warden_core::signal::join_ranks as join;

use super::Handles;
use super::waiter::JobRestart;
use super::waiter::{RankOutcome, STOPPED_FOR};

/// Every rank answered `req`: who acknowledged, how fast and by which
/// path, and who was handled by its launcher instead.
pub(super) fn acknowledged(
    state: &Handles,
    req: &JobRestart,
    outcomes: &BTreeMap<u32, RankOutcome>,
) {
    let acked: Vec<(u32, Duration, &str)> = outcomes
        .iter()
        .filter_map(|(&r, o)| match *o {
            RankOutcome::Acked { after, via } => Some((r, after, via.as_str())),
            RankOutcome::Gone { .. } => None,
        })
        .collect();
    let gone: Vec<String> = outcomes
        .iter()
        .filter_map(|(&r, o)| match *o {
            RankOutcome::Gone { why } => Some(format!("{r} ({why})")),
            RankOutcome::Acked { .. } => None,
        })
        .collect();
    let slowest = acked.iter().map(|a| a.1).max().unwrap_or_default();
    metrics::counter!("warden_in_process_restarts_total", "outcome" => "acknowledged").increment(1);
    let mut ev = NewEvent::new(
        Severity::Info,
        "restart.acknowledged",
        format!("job/{}", req.job),
        format!(
            "job {}: restart {} (seq {}) acknowledged by ranks {} within {}{}",
            req.job,
            req.restart_count,
            req.seq,
            join(&acked.iter().map(|a| a.0).collect::<Vec<_>>()),
            ms(slowest),
            if gone.is_empty() {
                String::new()
            } else {
                format!("; handled by their launcher: {}", gone.join(", "))
            }
        ),
    )
    .with("seq", req.seq)
    .with("restart_count", req.restart_count)
    .with("incident", &req.incident)
    .with(
        "acknowledged",
        join(&acked.iter().map(|a| a.0).collect::<Vec<_>>()),
    )
    .with("gone", gone.join(", "))
    .with("slowest", ms(slowest));
    for (rank, after, via) in &acked {
        ev = ev.with(
            format!("latency.rank.{rank}"),
            format!("{} ({via})", ms(*after)),
        );
    }
    state.events.publish(ev);
}

/// `silent` never answered `req` within `timeout`: the event, and with an
/// incident its escalation to `restart_in_job`.
pub(super) fn timed_out(
    state: &Handles,
    req: &JobRestart,
    silent: &[u32],
    acked: &[u32],
    timeout: Duration,
) {
    metrics::counter!("warden_in_process_restarts_total", "outcome" => "timeout").increment(1);
    let escalate = !req.incident.is_empty();
    let reason = format!(
        "ranks {} did not acknowledge the in-process restart (seq {}) within {}",
        join(silent),
        req.seq,
        humantime::format_duration(timeout)
    );
    state.events.publish(
        NewEvent::new(
            Severity::Error,
            "restart.in_process_timeout",
            format!("job/{}", req.job),
            format!(
                "job {}: {reason}; {}",
                req.job,
                if escalate {
                    format!("{} escalated to restart_in_job", req.incident)
                } else {
                    "no incident to escalate (asked by hand)".to_owned()
                }
            ),
        )
        .with("seq", req.seq)
        .with("restart_count", req.restart_count)
        .with("incident", &req.incident)
        .with("unacknowledged", join(silent))
        .with("acknowledged", join(acked))
        .with("timeout", humantime::format_duration(timeout))
        .with("escalated_to", if escalate { "restart_in_job" } else { "" }),
    );
    if escalate {
        let _ = state.escalations.send(Escalation {
            incident: req.incident.clone(),
            action: Action::RestartInJob,
            reason,
            replace: None,
        });
    }
}

/// Asks the launcher to replace `ranks` (stopped processes) while the
/// request goes on for the others: an escalation of the incident that keeps
/// `restart_in_process` and adds the [`Replacement`], the event
/// `restart.replace_ranks` and its count. With no incident (asked by hand)
/// nothing carries it to a launcher: the event says so, and the timeout
/// escalates nothing, as before.
pub(super) fn replace_ranks(state: &Handles, req: &JobRestart, ranks: Vec<u32>) {
    let carried = !req.incident.is_empty();
    metrics::counter!("warden_in_process_replacements_total").increment(ranks.len() as u64);
    let reason = format!(
        "rank{} {} stopped (SIGSTOP or a tracer) for {} during the in-process restart (seq {}): it can never acknowledge; replaced at once, the other ranks restart in process",
        if ranks.len() == 1 { "" } else { "s" },
        join(&ranks),
        humantime::format_duration(STOPPED_FOR),
        req.seq
    );
    state.events.publish(
        NewEvent::new(
            Severity::Warning,
            "restart.replace_ranks",
            format!("job/{}", req.job),
            format!(
                "job {}: {reason}; {}",
                req.job,
                if carried {
                    format!("{} asks its launcher", req.incident)
                } else {
                    "no incident to carry it to a launcher (asked by hand): waiting for the timeout"
                        .to_owned()
                }
            ),
        )
        .with("seq", req.seq)
        .with("restart_count", req.restart_count)
        .with("incident", &req.incident)
        .with("ranks", join(&ranks))
        .with("carried", carried),
    );
    if carried {
        let _ = state.escalations.send(Escalation {
            incident: req.incident.clone(),
            action: Action::RestartInProcess,
            reason,
            replace: Some(Replacement {
                ranks,
                restart_count: req.restart_count,
            }),
        });
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}ms", d.as_secs_f64() * 1000.0)
}
