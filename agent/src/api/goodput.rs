//! GetGoodput and CloseGoodput: the goodput ledger's reports as protobuf.

use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use crate::state::AgentState;
use warden_core::goodput::{Cause, JobReport};

/// GetGoodput: every job's breakdown, or `job_id`'s (NOT_FOUND when the
/// agent has no ledger for it).
pub fn get_goodput(
    state: &Arc<AgentState>,
    req: &pb::GetGoodputRequest,
) -> Result<pb::GetGoodputResponse, Status> {
    check_job(&req.job_id, false)?;
    let job = (!req.job_id.is_empty()).then_some(req.job_id.as_str());
    let reports = state.goodput.reports(job);
    if let Some(j) = job
        && reports.is_empty()
    {
        return Err(not_found(j));
    }
    Ok(pb::GetGoodputResponse {
        jobs: reports.iter().map(job_goodput).collect(),
    })
}

/// CloseGoodput: closes `job_id`'s ledger now and returns its final breakdown.
pub fn close_goodput(
    state: &Arc<AgentState>,
    req: &pb::CloseGoodputRequest,
) -> Result<pb::GetGoodputResponse, Status> {
    check_job(&req.job_id, true)?;
    let rep = state
        .goodput
        .close(&req.job_id)
        .ok_or_else(|| not_found(&req.job_id))?;
    Ok(pb::GetGoodputResponse {
        jobs: vec![job_goodput(&rep)],
    })
}

fn check_job(job: &str, required: bool) -> Result<(), Status> {
    if required && job.is_empty() {
        return Err(Status::invalid_argument(
            "job_id is required: CloseGoodput closes the ledger of one job",
        ));
    }
    if job.len() > 128 || job.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "job_id {job:?} is longer than 128 characters or holds control characters"
        )));
    }
    Ok(())
}

fn not_found(job: &str) -> Status {
    Status::not_found(format!(
        "no goodput ledger for job {job:?}: no rank of it registered with this agent"
    ))
}

fn secs(ns: i64) -> f64 {
    ns as f64 / 1e9
}

fn mean((n, ns): (u64, i64)) -> Option<f64> {
    (n > 0).then(|| secs(ns) / n as f64)
}

/// One job's report as protobuf.
pub fn job_goodput(r: &JobReport) -> pb::JobGoodput {
    let total = r.parts.total();
    pb::JobGoodput {
        job_id: r.job.clone(),
        parts: Cause::ALL
            .iter()
            .map(|c| pb::GoodputPart {
                cause: c.as_str().to_owned(),
                accelerator_seconds: secs(r.parts.get(*c)),
                fraction: if total > 0 {
                    r.parts.get(*c) as f64 / total as f64
                } else {
                    0.0
                },
            })
            .collect(),
        wall_seconds: secs(r.wall_ns),
        ranks: r.ranks,
        accelerator_seconds: secs(total),
        goodput: r.goodput(),
        recovery: Some(pb::GoodputRecovery {
            step_s: mean(r.occ.steps),
            startup_s: mean(r.occ.startups),
            detection_s: mean(r.occ.detections),
            restart_downtime_s: mean(r.occ.restarts),
            restore_s: mean(r.occ.restores),
            save_stall_s: mean(r.occ.saves),
            restarts: r.restarts,
            saves: r.saves,
        }),
        open: r.open,
        hosts: Vec::new(),
    }
}
