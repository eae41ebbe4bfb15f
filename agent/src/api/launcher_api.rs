//! WatchIncidents and StopRanks: what a launcher (`warden run`, or another
//! one speaking the API) needs from the agent to act on its decisions.
//!
//! WatchIncidents streams every decided incident of a job as it is decided,
//! and again when a later decision supersedes it (the attribution task sends
//! each on [`AgentState::incident_feed`]). StopRanks marks ranks as being
//! stopped on purpose, so their exits are recorded (`rank.exited`, Info,
//! `stopped_by`) instead of opening incidents: decoded here, carried out by
//! `act::stopping`.

use std::sync::Arc;

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use warden_proto::v1 as pb;

use super::convert;
use super::streams::BoxStream;
use crate::act::stopping;
use crate::state::AgentState;
use warden_core::attribute::IncidentRecord;

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

/// StopRanks: decoded here, carried out by [`act::stopping::stop`] (the
/// job's live ranks, only `ranks` when given, marked as stopped by their
/// launcher; a preemption's notice raised and its step named).
pub async fn stop_ranks(
    state: &Arc<AgentState>,
    req: pb::StopRanksRequest,
) -> Result<pb::StopRanksResponse, Status> {
    let done = stopping::stop(
        &state.ranks,
        &state.notices,
        &state.events,
        stopping::StopAsk {
            job: &req.job_id,
            ranks: &req.ranks,
            // Clipped by the use case; an older launcher's kind is read
            // from the words it gave.
            kind: stop_kind(req.kind(), &req.reason),
            reason: &req.reason,
            notice_deadline_unix_ms: req.notice_deadline_unix_ms,
            notice_save_at_step: req.notice_save_at_step,
            notice_lead: std::time::Duration::from_millis(u64::from(req.notice_lead_ms)),
        },
    )
    .map_err(|e| Status::invalid_argument(e.to_string()))?;
    Ok(pb::StopRanksResponse {
        ranks: done.ranks,
        notice_save_at_step: done.notice_save_at_step,
    })
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
