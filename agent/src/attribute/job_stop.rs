//! A launcher's stop of its job, recorded as the agent records its own
//! decisions: a launcher ended its job by a rule of its own (no progress
//! across restarts, exit 88; the job's share of cordoned hosts, 87), and
//! the agent makes that decision as visible as its own: an incident of the
//! job (kind `no_progress` / `cordon_share`), the events `job.stopped`,
//! `incident.diagnosed` and `incident.decided`, and the metric
//! `warden_job_stops_total{reason}`.
//!
//! In: a [`StopReport`] the edge decoded (`ReportJobStop`, its caller
//! already authorised for the job and within its per-uid quota). Out: the
//! recorded incident's id. Never: a record the caller can grow without
//! bound (every count and string is bounded or clipped here, in
//! [`JobStop::new`]), more than [`MAX_STOPS_PER_JOB`] stops of one job in
//! the journal, a stop charged to this node (the kinds are not counted by
//! the lemon rule), or the stop sent to launchers as a decision to carry
//! out (the launcher that reports it is already ending the job; the job's
//! other hosts hear it through their coordinator).

use std::sync::PoisonError;
use std::time::{Duration, SystemTime};

use warden_core::attribute::{Diagnosis, Evidence, FaultClass, IncidentKind, IncidentRecord};
use warden_core::events::{NewEvent, Severity};
use warden_core::policy::{Action, Decision};
use warden_core::text::clip_line;

use super::task::Handles;

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

/// One piece of the launcher's evidence, as it sent it (core's type, the
/// launcher's too).
pub use warden_core::attribute::StopEvidence;

/// A launcher's report of its job's stop, before it is bounded.
#[derive(Debug, Clone, PartialEq)]
pub struct StopReport {
    /// The job (already checked by the edge's authorization).
    pub job: String,
    /// `NoProgress` or `CordonShare`; any other kind is refused.
    pub kind: IncidentKind,
    /// What the launcher says happened.
    pub summary: String,
    /// The exit status the launcher ends with.
    pub exit_code: i32,
    /// The flag whose limit was reached (`--max-no-progress-restarts 3`).
    pub limit: String,
    /// What the launcher saw.
    pub evidence: Vec<StopEvidence>,
    /// The incident the launcher was acting on, if any.
    pub incident: String,
}

/// Why a stop was not recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobStopError {
    /// A kind that is not a launcher's stop.
    #[error("reason {0} is not a launcher's stop: NO_PROGRESS or CORDON_SHARE")]
    NotAStop(&'static str),
    /// An exit status no process has.
    #[error("exit_code {0} is not an exit status (0..=255)")]
    ExitCode(i32),
    /// More evidence than is kept.
    #[error("{0} evidence items: at most {MAX_EVIDENCE}")]
    Evidence(usize),
    /// The job's journal already holds its share of launcher stops.
    #[error(
        "job {job} already has {earlier} launcher stops recorded (at most {MAX_STOPS_PER_JOB})"
    )]
    TooMany {
        /// The job.
        job: String,
        /// Launcher stops already recorded for it.
        earlier: usize,
    },
}

/// A validated, clipped report.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStop {
    job: String,
    kind: IncidentKind,
    summary: String,
    exit_code: i32,
    limit: String,
    evidence: Vec<StopEvidence>,
    incident: String,
}

impl JobStop {
    /// Refuses what cannot be recorded (a kind that is not a launcher's
    /// stop, an exit status no process has, more evidence than
    /// [`MAX_EVIDENCE`]); clips every string.
    pub fn new(r: StopReport) -> Result<Self, JobStopError> {
        if !r.kind.from_launcher() {
            return Err(JobStopError::NotAStop(r.kind.as_str()));
        }
        if !(0..=255).contains(&r.exit_code) {
            return Err(JobStopError::ExitCode(r.exit_code));
        }
        if r.evidence.len() > MAX_EVIDENCE {
            return Err(JobStopError::Evidence(r.evidence.len()));
        }
        let summary = clip_line(&r.summary, MAX_SUMMARY);
        Ok(Self {
            summary: if summary.is_empty() {
                format!("the launcher stopped the job ({})", r.kind.as_str())
            } else {
                summary
            },
            limit: clip_line(&r.limit, MAX_FIELD),
            evidence: r
                .evidence
                .iter()
                .map(|e| StopEvidence {
                    subject: clip_line(&e.subject, MAX_FIELD),
                    signal: clip_line(&e.signal, MAX_FIELD),
                    value: clip_line(&e.value, MAX_FIELD),
                    note: clip_line(&e.note, MAX_FIELD),
                })
                .collect(),
            incident: clip_line(&r.incident, MAX_FIELD),
            job: r.job,
            kind: r.kind,
            exit_code: r.exit_code,
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
            .map(|e| Evidence {
                at,
                source: "launcher".into(),
                signal: e.signal.clone(),
                subject: e.subject.clone(),
                value: e.value.clone(),
                points_to: None,
                weight: 0.0,
                note: e.note.clone(),
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

/// Records `stop` (see the module): the incident's id.
pub fn record(h: &Handles, stop: &JobStop, caller_uid: u32) -> Result<String, JobStopError> {
    let job = &stop.job;
    {
        let store = h.store.lock().unwrap_or_else(PoisonError::into_inner);
        let earlier = store
            .list(job, 0)
            .iter()
            .filter(|r| r.kind.from_launcher())
            .count();
        if earlier >= MAX_STOPS_PER_JOB {
            return Err(JobStopError::TooMany {
                job: job.clone(),
                earlier,
            });
        }
    }
    let ev = h.events.publish(
        NewEvent::new(
            Severity::Critical,
            "job.stopped",
            format!("job/{job}"),
            format!(
                "the launcher stopped job {job} ({}, exit {}): {}",
                stop.kind.as_str(),
                stop.exit_code,
                stop.summary
            ),
        )
        .with("job", job)
        .with("reason", stop.kind.as_str())
        .with("exit_code", stop.exit_code)
        .with("limit", &stop.limit)
        .with("evidence", stop.evidence.len())
        .with("incident", &stop.incident),
    );
    let record = stop.record(format!("inc-{}", ev.id), &h.host, job, caller_uid, ev.time);
    h.store
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .upsert(record.clone(), true);
    super::task::publish_decided(&h.events, &record);
    metrics::counter!("warden_job_stops_total", "reason" => stop.kind.as_str()).increment(1);
    Ok(record.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> StopReport {
        StopReport {
            job: "j".into(),
            kind: IncidentKind::NoProgress,
            summary: "no progress in 3 restarts in a row".into(),
            exit_code: 88,
            limit: "--max-no-progress-restarts 3".into(),
            evidence: vec![StopEvidence {
                subject: "attempt/1".into(),
                signal: "resumed_from".into(),
                value: "0".into(),
                note: "no progress".into(),
            }],
            incident: "inc-7".into(),
        }
    }

    #[test]
    fn a_report_becomes_a_stop_of_the_job_not_charged_to_the_node() {
        let stop = JobStop::new(report()).unwrap();
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
    fn what_a_caller_controls_is_bounded() {
        let refused = |r: StopReport| JobStop::new(r).unwrap_err();
        let mut r = report();
        r.kind = IncidentKind::Crash;
        assert!(matches!(refused(r), JobStopError::NotAStop(_)));
        let mut r = report();
        r.exit_code = 256;
        assert_eq!(refused(r), JobStopError::ExitCode(256));
        let mut r = report();
        r.exit_code = -1;
        assert_eq!(refused(r), JobStopError::ExitCode(-1));
        let mut r = report();
        r.evidence = vec![r.evidence[0].clone(); MAX_EVIDENCE + 1];
        assert_eq!(refused(r), JobStopError::Evidence(MAX_EVIDENCE + 1));
        // Long strings are clipped, control characters replaced.
        let mut r = report();
        r.summary = "é".repeat(10 * MAX_SUMMARY);
        r.limit = "x".repeat(10 * MAX_FIELD);
        r.evidence = vec![
            StopEvidence {
                subject: "s\n".repeat(MAX_FIELD),
                signal: "x".repeat(MAX_FIELD * 4),
                value: "v".repeat(MAX_FIELD * 4),
                note: "n".repeat(MAX_FIELD * 4),
            };
            MAX_EVIDENCE
        ];
        let s = JobStop::new(r).unwrap();
        assert!(s.summary.len() <= MAX_SUMMARY);
        assert!(s.limit.len() <= MAX_FIELD);
        assert_eq!(s.evidence.len(), MAX_EVIDENCE);
        for e in &s.evidence {
            for f in [&e.subject, &e.signal, &e.value, &e.note] {
                assert!(f.len() <= MAX_FIELD);
                assert!(!f.contains('\n'));
            }
        }
    }
}
