//! WatchIncidents and StopRanks: what a launcher (`warden run`, or another
//! one speaking the API) needs from the agent to act on its decisions.
//!
//! WatchIncidents streams every decided incident of a job as it is decided,
//! and again when a later decision supersedes it (the attribution task sends
//! each on [`AgentState::incident_feed`]). StopRanks marks ranks as being
//! stopped on purpose, so their exits are recorded (`rank.exited`, Info,
//! `stopped_by`) instead of opening incidents.

use std::sync::Arc;

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use warden_proto::v1 as pb;

use super::convert;
use super::streams::BoxStream;
use crate::state::AgentState;
use warden_core::attribute::IncidentRecord;
use warden_core::events::{NewEvent, Severity};

/// Longest reason kept from a StopRanks request.
const MAX_REASON: usize = 256;

/// WatchIncidents: the job's decided incidents (all jobs' when `job_id` is
/// empty), the retained ones first when `replay` is set, then each new or
/// superseding decision as it is taken, until the watcher leaves or the
/// agent stops. Only records of jobs `viewer` (the caller's uid) owns at the
/// time are sent: a launcher carries out what it is sent, so no decision
/// about a job another user holds may reach it (its claim released and the
/// id taken by someone else mid-run included).
///
/// The feed is subscribed before the store is read, so nothing decided in
/// between is missed; a record may then come twice (launchers key decisions
/// by incident id and revision). A watcher too slow for the feed is resent
/// the job's retained records instead of losing decisions.
pub async fn watch_incidents(
    state: &Arc<AgentState>,
    req: pb::WatchIncidentsRequest,
    viewer: u32,
) -> Result<BoxStream<pb::Incident>, Status> {
    if req.job_id.len() > 128 || req.job_id.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "job_id {:?} is longer than 128 characters or holds control characters",
            req.job_id
        )));
    }
    let mut feed = state.incident_feed.subscribe();
    let (tx, rx) = mpsc::channel(64);
    let state = state.clone();
    let job = req.job_id;
    tokio::spawn(async move {
        if req.replay && !send_retained(&state, &job, viewer, &tx).await {
            return;
        }
        loop {
            let record = tokio::select! {
                () = state.shutdown.cancelled() => return,
                () = tx.closed() => return,
                r = feed.recv() => r,
            };
            match record {
                Ok(r) => {
                    if (job.is_empty() || r.job == job)
                        && state.authz.owns(viewer, &r.job)
                        && !send(&tx, &r).await
                    {
                        return;
                    }
                }
                Err(RecvError::Lagged(n)) => {
                    tracing::warn!(
                        lagged = n,
                        job = %job,
                        "an incident watcher fell behind; resending the job's retained incidents"
                    );
                    if !send_retained(&state, &job, viewer, &tx).await {
                        return;
                    }
                }
                Err(RecvError::Closed) => return,
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Sends the retained decided incidents of `job` that `viewer` owns; false
/// once the watcher left.
async fn send_retained(
    state: &AgentState,
    job: &str,
    viewer: u32,
    tx: &mpsc::Sender<Result<pb::Incident, Status>>,
) -> bool {
    let retained = state.incident_store().list(job, 0);
    // A stop a launcher reported (ReportJobStop) is no decision for a
    // launcher to carry out: it was carried out already.
    for r in retained.iter().filter(|r| {
        r.decision.is_some() && !r.kind.from_launcher() && state.authz.owns(viewer, &r.job)
    }) {
        if !send(tx, r).await {
            return false;
        }
    }
    true
}

async fn send(tx: &mpsc::Sender<Result<pb::Incident, Status>>, r: &IncidentRecord) -> bool {
    tx.send(Ok(convert::incident(r))).await.is_ok()
}

/// StopRanks: marks the job's live ranks (only `ranks`, when given) as
/// being stopped by their launcher, so the scan no longer judges them and
/// their exits are `rank.exited` at Info with `stopped_by`, not incidents.
/// Publishes `ranks.stopping` naming them and the reason.
pub async fn stop_ranks(
    state: &Arc<AgentState>,
    req: pb::StopRanksRequest,
) -> Result<pb::StopRanksResponse, Status> {
    if req.job_id.is_empty() {
        return Err(Status::invalid_argument(
            "job_id is required: StopRanks marks the ranks of one job",
        ));
    }
    let reason = clip(&req.reason);
    let reason = if reason.is_empty() {
        "no reason given".to_owned()
    } else {
        reason
    };
    let stop = warden_core::signal::StopReason {
        kind: stop_kind(req.kind(), &reason),
        why: reason.clone(),
    };
    if stop.kind == warden_core::signal::StopKind::Preempted {
        // Before the ranks are marked: the tick that finds them marked
        // finds the job's notice too. Only this job's ranks get it (the
        // caller is the job's owner: api/authz.rs).
        state.notices.raise_job(
            &req.job_id,
            launcher_notice(req.notice_deadline_unix_ms, &reason),
        );
    }
    let (mut ranks, notice_save_at_step) = {
        let mut reg = state.registry();
        let ranks = reg.mark_stopping(&req.job_id, &req.ranks, &stop);
        // The step the ranks save at, named now (not at the next tick) so
        // the launcher can tell the job's other hosts (docs/operations.md,
        // "Notices ... across hosts").
        let step = (stop.kind == warden_core::signal::StopKind::Preempted).then(|| {
            state.notices.name_step(
                &req.job_id,
                &reg,
                req.notice_save_at_step,
                std::time::Duration::from_millis(u64::from(
                    req.notice_lead_ms.min(MAX_NOTICE_LEAD_MS),
                )),
            )
        });
        (ranks, step.flatten())
    };
    ranks.sort_unstable();
    if !ranks.is_empty() {
        state.events.publish(
            NewEvent::new(
                Severity::Info,
                "ranks.stopping",
                format!("job/{}", req.job_id),
                format!(
                    "launcher stops ranks {} of job {}: {reason}",
                    list(&ranks),
                    req.job_id
                ),
            )
            .with("job", &req.job_id)
            .with("ranks", list(&ranks))
            .with("reason", &reason),
        );
    }
    Ok(pb::StopRanksResponse {
        ranks,
        notice_save_at_step,
    })
}

/// Longest lead a launcher may ask the notice's step to have (a caller's
/// number): a minute of steps.
const MAX_NOTICE_LEAD_MS: u32 = 60_000;

/// Longest notice a launcher may announce: a deadline further away is
/// shown as this far (the word is for the ranks' information only).
const MAX_NOTICE_WINDOW: std::time::Duration = std::time::Duration::from_secs(3600);

/// A launcher's notice: its deadline clamped to [now, now + 1 h] (a
/// caller's number, so bounded), none when it gave 0.
fn launcher_notice(deadline_unix_ms: u64, reason: &str) -> crate::notice::Notice {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    let now = SystemTime::now();
    let deadline = (deadline_unix_ms != 0).then(|| {
        let latest = now + MAX_NOTICE_WINDOW;
        UNIX_EPOCH
            .checked_add(Duration::from_millis(deadline_unix_ms))
            .map_or(latest, |at| at.clamp(now, latest))
    });
    crate::notice::Notice {
        source: crate::notice::Source::Launcher,
        what: reason.to_owned(),
        deadline,
        raised: now,
    }
}

fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The first [`MAX_REASON`] bytes of `s`, at a character boundary, with
/// control characters replaced.
fn clip(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if out.len() + c.len_utf8() > MAX_REASON {
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

/// The stop kind a StopRanks request names; for a launcher from before the
/// field (unspecified), the one its free text implies, read once here at
/// the API's edge: "job ending..." ends the job, anything else is a
/// restart (what the goodput ledger took every other stop for before).
fn stop_kind(kind: pb::StopKind, why: &str) -> warden_core::signal::StopKind {
    use warden_core::signal::StopKind;
    match kind {
        pb::StopKind::Restart => StopKind::Restart,
        pb::StopKind::JobEnding => StopKind::JobEnding,
        pb::StopKind::LauncherSignalled => StopKind::LauncherSignalled,
        pb::StopKind::Preempted => StopKind::Preempted,
        pb::StopKind::Unspecified if why.contains("job ending") => StopKind::JobEnding,
        pb::StopKind::Unspecified => StopKind::Restart,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_short_reasons_and_cuts_long_ones() {
        assert_eq!(clip("restart 1"), "restart 1");
        assert_eq!(clip("a\nb"), "a b");
        let long = "é".repeat(300);
        let c = clip(&long);
        assert!(c.len() <= MAX_REASON && c.is_char_boundary(c.len()));
    }
}
