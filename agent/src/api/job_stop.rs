//! ReportJobStop at the edge: a launcher ended its job by a rule of its
//! own, and the attribution stage records it as an incident of the job
//! ([`crate::attribute::job_stop`], which says what is recorded and what is
//! bounded).
//!
//! Here: the per-uid quota (`api.job_stops_per_minute`, [`StopLimiter`]:
//! past it the call is refused before anything is read or recorded), the
//! request decoded (a job id the agent takes, a reason that is a launcher's
//! stop), the stage called, its errors mapped to statuses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;
use warden_core::attribute::IncidentKind;
use warden_proto::v1 as pb;

use crate::access::authz::MAX_JOB_ID;
use crate::attribute::job_stop::{self, JobStop, JobStopError, StopEvidence, StopReport};
use crate::state::AgentState;

pub use crate::access::stop_limiter::StopLimiter;

/// ReportJobStop: records the stop, publishes it, counts it.
pub fn report_job_stop(
    state: &Arc<AgentState>,
    req: &pb::ReportJobStopRequest,
    caller_uid: u32,
) -> Result<pb::ReportJobStopResponse, Status> {
    if let Err(wait) = state.job_stops.take(caller_uid, Instant::now()) {
        metrics::counter!("warden_api_quota_refused_total", "key" => "api.job_stops_per_minute")
            .increment(1);
        return Err(Status::resource_exhausted(format!(
            "ReportJobStop refused for uid {caller_uid}: more than {} calls a minute \
             (api.job_stops_per_minute); the next is allowed in {}",
            state.config.api.job_stops_per_minute,
            humantime::format_duration(Duration::from_millis(
                u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1)
            ))
        )));
    }
    let stop = JobStop::new(decode(req)?).map_err(status)?;
    let incident_id = job_stop::record(&state.attribution(), &stop, caller_uid).map_err(status)?;
    Ok(pb::ReportJobStopResponse { incident_id })
}

/// The report as the stage takes it: refuses no job, a job id the agent
/// takes nowhere, no reason.
fn decode(req: &pb::ReportJobStopRequest) -> Result<StopReport, Status> {
    if warden_core::text::unfit_name(&req.job_id, MAX_JOB_ID) {
        return Err(Status::invalid_argument(format!(
            "job_id is required, at most {MAX_JOB_ID} bytes, without control characters"
        )));
    }
    let kind = match req.reason() {
        pb::JobStopReason::NoProgress => IncidentKind::NoProgress,
        pb::JobStopReason::CordonShare => IncidentKind::CordonShare,
        pb::JobStopReason::Unspecified => {
            return Err(Status::invalid_argument(
                "reason is required: NO_PROGRESS or CORDON_SHARE",
            ));
        }
    };
    // Counted before anything is copied: a caller's list is bounded first.
    if req.evidence.len() > job_stop::MAX_EVIDENCE {
        return Err(status(JobStopError::Evidence(req.evidence.len())));
    }
    Ok(StopReport {
        job: req.job_id.clone(),
        kind,
        summary: req.summary.clone(),
        exit_code: req.exit_code,
        limit: req.limit.clone(),
        evidence: req
            .evidence
            .iter()
            .map(|e| StopEvidence {
                subject: e.subject.clone(),
                signal: e.signal.clone(),
                value: e.value.clone(),
                note: e.note.clone(),
            })
            .collect(),
        incident: req.incident_id.clone(),
    })
}

/// The status for a refusal.
fn status(e: JobStopError) -> Status {
    match e {
        JobStopError::TooMany { .. } => Status::resource_exhausted(e.to_string()),
        JobStopError::NotAStop(_) | JobStopError::ExitCode(_) | JobStopError::Evidence(_) => {
            Status::invalid_argument(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> pb::ReportJobStopRequest {
        pb::ReportJobStopRequest {
            job_id: "j".into(),
            reason: pb::JobStopReason::NoProgress as i32,
            summary: "no progress in 3 restarts in a row".into(),
            exit_code: 88,
            limit: "--max-no-progress-restarts 3".into(),
            evidence: vec![pb::JobStopEvidence {
                subject: "attempt/1".into(),
                signal: "resumed_from".into(),
                value: "0".into(),
                note: "no progress".into(),
            }],
            incident_id: "inc-7".into(),
        }
    }

    #[test]
    fn stops_are_limited_per_uid_and_refill_over_a_minute() {
        let l = StopLimiter::new(6);
        let t0 = Instant::now();
        for _ in 0..6 {
            l.take(1000, t0).unwrap();
        }
        let wait = l.take(1000, t0).unwrap_err();
        assert!(
            wait.abs_diff(Duration::from_secs(10)) < Duration::from_millis(1),
            "one token per 10 s: {wait:?}"
        );
        // Another uid has its own bucket.
        l.take(1001, t0).unwrap();
        // Ten seconds later one more; then refused again.
        l.take(1000, t0 + Duration::from_secs(10)).unwrap();
        assert!(l.take(1000, t0 + Duration::from_secs(10)).is_err());
        // A refilled bucket is forgotten: the map does not keep every uid.
        let later = t0 + Duration::from_secs(120);
        l.take(1002, later).unwrap();
        assert_eq!(l.quota.buckets.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_request_the_stage_cannot_take_is_refused_at_the_edge() {
        let refused = |r: pb::ReportJobStopRequest| {
            decode(&r)
                .and_then(|r| JobStop::new(r).map_err(status))
                .unwrap_err()
                .code()
        };
        let mut r = req();
        r.job_id = String::new();
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.job_id = "j".repeat(MAX_JOB_ID + 1);
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.job_id = "j\n".into();
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.reason = 0;
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.reason = 99;
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.exit_code = 256;
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        let mut r = req();
        r.evidence = vec![r.evidence[0].clone(); job_stop::MAX_EVIDENCE + 1];
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        assert!(
            decode(&req())
                .and_then(|r| JobStop::new(r).map_err(status))
                .is_ok()
        );
    }
}
