//! ReportJobStop: a launcher ended its job by a rule of its own (no
//! progress across restarts, exit 88; the job's share of cordoned hosts,
//! 87), and the agent makes that decision as visible as its own: an
//! incident of the job (kind `no_progress` / `cordon_share`), the events
//! `job.stopped`, `incident.diagnosed` and `incident.decided`, and the
//! metric `warden_job_stops_total{reason}`.
//!
//! In: the launcher's request, already authorised (the job's owner or an
//! admin). Out: the recorded incident's id. Never: more calls of one uid
//! than `api.job_stops_per_minute` ([`StopLimiter`]: past it the call is
//! refused before anything is read or recorded), a record the caller can
//! grow without bound (every count and string is capped here), a stop
//! charged to this node (the kinds are not counted by the lemon rule), or
//! the stop sent to launchers as a decision to carry out (the launcher that
//! reports it is already ending the job; the job's other hosts hear it
//! through their coordinator).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tonic::Status;
use warden_core::attribute::{Diagnosis, Evidence, FaultClass, IncidentKind, IncidentRecord};
use warden_core::events::{NewEvent, Severity};
use warden_core::policy::{Action, Decision};
use warden_proto::v1 as pb;

use super::authz::MAX_JOB_ID;
use crate::state::AgentState;

/// Evidence items kept from one report.
pub const MAX_EVIDENCE: usize = 64;
/// The longest summary kept.
pub const MAX_SUMMARY: usize = 1024;
/// The longest evidence field, limit or incident id kept.
pub const MAX_FIELD: usize = 256;
/// Stops one job may have recorded in the journal at once: a launcher
/// reports a job's end once; a caller looping on the call is refused past
/// this.
pub const MAX_STOPS_PER_JOB: usize = 16;

pub use super::stop_limiter::StopLimiter;

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
    let stop = Stop::from_request(req)?;
    let earlier = state
        .incident_store()
        .list(&req.job_id, 0)
        .iter()
        .filter(|r| r.kind.from_launcher())
        .count();
    if earlier >= MAX_STOPS_PER_JOB {
        return Err(Status::resource_exhausted(format!(
            "job {} already has {earlier} launcher stops recorded (at most {MAX_STOPS_PER_JOB})",
            req.job_id
        )));
    }
    let ev = state.events.publish(
        NewEvent::new(
            Severity::Critical,
            "job.stopped",
            format!("job/{}", req.job_id),
            format!(
                "the launcher stopped job {} ({}, exit {}): {}",
                req.job_id,
                stop.kind.as_str(),
                stop.exit_code,
                stop.summary
            ),
        )
        .with("job", &req.job_id)
        .with("reason", stop.kind.as_str())
        .with("exit_code", stop.exit_code)
        .with("limit", &stop.limit)
        .with("evidence", stop.evidence.len())
        .with("incident", &stop.incident),
    );
    let record = stop.record(
        format!("inc-{}", ev.id),
        &state.host,
        &req.job_id,
        caller_uid,
        ev.time,
    );
    state.incident_store().upsert(record.clone(), true);
    crate::attribute::task::publish_decided(&state.events, &record);
    metrics::counter!("warden_job_stops_total", "reason" => stop.kind.as_str()).increment(1);
    Ok(pb::ReportJobStopResponse {
        incident_id: record.id,
    })
}

/// A validated, clipped report.
#[derive(Debug, Clone, PartialEq)]
struct Stop {
    kind: IncidentKind,
    summary: String,
    exit_code: i32,
    limit: String,
    evidence: Vec<(String, String, String, String)>,
    incident: String,
}

impl Stop {
    /// Refuses what cannot be recorded (no job, a job id the agent takes
    /// nowhere, no reason, an exit status no process has, more evidence
    /// than [`MAX_EVIDENCE`]); clips every string.
    fn from_request(req: &pb::ReportJobStopRequest) -> Result<Self, Status> {
        if req.job_id.is_empty()
            || req.job_id.len() > MAX_JOB_ID
            || req.job_id.chars().any(char::is_control)
        {
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
        if !(0..=255).contains(&req.exit_code) {
            return Err(Status::invalid_argument(format!(
                "exit_code {} is not an exit status (0..=255)",
                req.exit_code
            )));
        }
        if req.evidence.len() > MAX_EVIDENCE {
            return Err(Status::invalid_argument(format!(
                "{} evidence items: at most {MAX_EVIDENCE}",
                req.evidence.len()
            )));
        }
        let summary = clip(&req.summary, MAX_SUMMARY);
        Ok(Self {
            kind,
            summary: if summary.is_empty() {
                format!("the launcher stopped the job ({})", kind.as_str())
            } else {
                summary
            },
            exit_code: req.exit_code,
            limit: clip(&req.limit, MAX_FIELD),
            evidence: req
                .evidence
                .iter()
                .map(|e| {
                    (
                        clip(&e.subject, MAX_FIELD),
                        clip(&e.signal, MAX_FIELD),
                        clip(&e.value, MAX_FIELD),
                        clip(&e.note, MAX_FIELD),
                    )
                })
                .collect(),
            incident: clip(&req.incident_id, MAX_FIELD),
        })
    }

    /// The incident: the launcher's diagnosis (class unknown: the rule
    /// says the job did not get on, not why), its evidence, and the
    /// decision `stop` it already carried out.
    fn record(
        &self,
        id: String,
        host: &str,
        job: &str,
        caller_uid: u32,
        at: SystemTime,
    ) -> IncidentRecord {
        let rule = format!("launcher.{}", self.kind.as_str());
        let mut evidence: Vec<Evidence> = self
            .evidence
            .iter()
            .map(|(subject, signal, value, note)| Evidence {
                at,
                source: "launcher".into(),
                signal: signal.clone(),
                subject: subject.clone(),
                value: value.clone(),
                points_to: None,
                weight: 0.0,
                note: note.clone(),
                event_id: 0,
            })
            .collect();
        if !self.incident.is_empty() {
            evidence.push(Evidence {
                at,
                source: "launcher".into(),
                signal: "incident".into(),
                subject: format!("job/{job}"),
                value: self.incident.clone(),
                points_to: None,
                weight: 0.0,
                note: "the incident the launcher was acting on when it stopped".into(),
                event_id: 0,
            });
        }
        let decided_by = if self.limit.is_empty() {
            format!("launcher (uid {caller_uid})")
        } else {
            format!("launcher (uid {caller_uid}, {})", self.limit)
        };
        IncidentRecord {
            id,
            opened_at: at,
            updated_at: at,
            kind: self.kind,
            host: host.to_owned(),
            job: job.to_owned(),
            ranks: Vec::new(),
            devices: Vec::new(),
            diagnosis: Diagnosis {
                class: FaultClass::Unknown,
                confidence: 1.0,
                summary: self.summary.clone(),
                rule,
                evidence,
            },
            decision: Some(Decision {
                action: Action::Stop,
                reason: self.summary.clone(),
                decided_by,
                attempt: 0,
                budget: 0,
                backoff: Duration::ZERO,
                exit_code: self.exit_code,
                decided_at: at,
                dry_run: false,
                replace: None,
            }),
            superseded: Vec::new(),
            signature: format!("launcher:{}", self.kind.as_str()),
            step: None,
            exit_code: None,
            waited_on: Vec::new(),
        }
    }
}

/// The first `max` bytes of `s`, at a character boundary, with control
/// characters replaced.
fn clip(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
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
    fn a_report_becomes_a_stop_of_the_job_not_charged_to_the_node() {
        let stop = Stop::from_request(&req()).unwrap();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let r = stop.record("inc-9".into(), "h", "j", 1000, at);
        assert_eq!(r.kind, IncidentKind::NoProgress);
        assert!(!r.kind.charges_node());
        assert_eq!(r.job, "j");
        assert_eq!(r.diagnosis.rule, "launcher.no_progress");
        assert_eq!(r.diagnosis.evidence.len(), 2);
        assert_eq!(r.diagnosis.evidence[0].subject, "attempt/1");
        assert_eq!(r.diagnosis.evidence[1].value, "inc-7");
        let d = r.decision.unwrap();
        assert_eq!(d.action, Action::Stop);
        assert_eq!(d.exit_code, 88);
        assert_eq!(
            d.decided_by,
            "launcher (uid 1000, --max-no-progress-restarts 3)"
        );
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
        assert_eq!(l.buckets.lock().unwrap().len(), 1);
    }

    #[test]
    fn what_a_caller_controls_is_bounded() {
        let refused = |r: pb::ReportJobStopRequest| Stop::from_request(&r).unwrap_err().code();
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
        r.evidence = vec![r.evidence[0].clone(); MAX_EVIDENCE + 1];
        assert_eq!(refused(r), tonic::Code::InvalidArgument);
        // Long strings are clipped, control characters replaced.
        let mut r = req();
        r.summary = "é".repeat(10 * MAX_SUMMARY);
        r.limit = "x".repeat(10 * MAX_FIELD);
        r.evidence = vec![
            pb::JobStopEvidence {
                subject: "s\n".repeat(MAX_FIELD),
                signal: "x".repeat(MAX_FIELD * 4),
                value: "v".repeat(MAX_FIELD * 4),
                note: "n".repeat(MAX_FIELD * 4),
            };
            MAX_EVIDENCE
        ];
        let s = Stop::from_request(&r).unwrap();
        assert!(s.summary.len() <= MAX_SUMMARY);
        assert!(s.limit.len() <= MAX_FIELD);
        assert_eq!(s.evidence.len(), MAX_EVIDENCE);
        for (a, b, c, d) in &s.evidence {
            for f in [a, b, c, d] {
                assert!(f.len() <= MAX_FIELD);
                assert!(!f.contains('\n'));
            }
        }
    }
}
