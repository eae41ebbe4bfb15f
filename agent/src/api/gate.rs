//! RunHealthGate: the pre-restart health gate, on demand (`warden diag`)
//! and before a launcher respawns workers on this node.
//!
//! In: a caller already authorised (an admin, or the owner of some job
//! here) and its uid. Out: the gate's verdict, from a run or from the last
//! run's cache (marked `cached`, with its age). Never: a level above
//! `dcgm.gate_max_level` (refused, naming the key: `dcgmi diag -r 4`
//! stresses every GPU of every tenant), two runs at once on the node
//! (callers queue on [`Gate`] and share the result), more calls of one uid
//! in progress than `dcgm.gate_max_per_uid` (RESOURCE_EXHAUSTED naming the
//! key), or a run abandoned midway because its caller went away (it runs to
//! its end, or `dcgm.gate_timeout`, and its result is cached for the
//! callers queued behind it).

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tonic::Status;
use warden_proto::v1 as pb;

use super::convert;
use crate::sources::dcgm::diag::{self, DiagError, GateOutcome};
use crate::state::AgentState;
use warden_core::events::{NewEvent, Severity};
use warden_core::signal::{GateFailed, GateFailure, Signal};

pub use super::gate_state::Gate;
use super::gate_state::LastRun;

/// One call's place among its uid's calls; given back when dropped.
#[derive(Debug)]
struct CallPermit {
    state: Arc<AgentState>,
    uid: u32,
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        let mut calls = self
            .state
            .gate
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = calls.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                calls.remove(&self.uid);
            }
        }
    }
}

/// The level a call asks for (0: `dcgm.gate_level`), or INVALID_ARGUMENT
/// naming `dcgm.gate_max_level` when it is deeper than that.
pub fn level_of(asked: u32, default: u32, max: u32) -> Result<u32, Status> {
    let level = if asked == 0 { default } else { asked };
    if level > max {
        return Err(Status::invalid_argument(format!(
            "health gate level {level} refused: above dcgm.gate_max_level ({max}); a gate \
             stresses every GPU of the node, whoever uses them (an admin may raise \
             dcgm.gate_max_level)"
        )));
    }
    Ok(level)
}

/// Runs the gate for `uid`: dcgmi where it gives a verdict, else the NVML
/// check; a failure is published as `gate.failed`, which attribution turns
/// into an incident of the job (uncorrectable hardware: the node-level
/// path). Only one run at a time; a run that ended within
/// `dcgm.gate_cache_for` at this level or deeper answers instead.
pub async fn run(
    state: &Arc<AgentState>,
    req: pb::RunHealthGateRequest,
    uid: u32,
) -> Result<pb::HealthGateResult, Status> {
    let cfg = &state.config.dcgm;
    let level = level_of(req.level, cfg.gate_level, cfg.gate_max_level).inspect_err(|_| {
        metrics::counter!("warden_gate_answers_total", "answer" => "refused").increment(1);
    })?;
    let permit = enter(state, uid)?;
    // The run is a task of its own: a caller that goes away neither kills
    // it (its dcgmi would be killed midway and the next caller start over)
    // nor frees its uid's place before it ends.
    let st = state.clone();
    let job = req.job_id;
    let answer = tokio::spawn(async move {
        let _permit = permit;
        let cache_for = st.config.dcgm.gate_cache_for;
        let mut last = st.gate.last.lock().await;
        if let Some(l) = last.as_ref()
            && l.level >= level
            && l.ended.elapsed() < cache_for
        {
            metrics::counter!("warden_gate_answers_total", "answer" => "cached").increment(1);
            return (l.outcome.clone(), Some((l.level, l.ended.elapsed())));
        }
        let outcome = execute(&st, level).await;
        publish(&st, &job, &outcome);
        metrics::counter!("warden_gate_answers_total", "answer" => "ran").increment(1);
        *last = Some(LastRun {
            level,
            outcome: outcome.clone(),
            ended: Instant::now(),
        });
        (outcome, None)
    })
    .await
    .map_err(|e| Status::internal(format!("the health gate's task failed: {e}")))?;
    let (outcome, cached) = answer;
    Ok(result(outcome, cached, state.config.dcgm.gate_cache_for))
}

/// Counts a call of `uid`, or refuses it past `dcgm.gate_max_per_uid`.
fn enter(state: &Arc<AgentState>, uid: u32) -> Result<CallPermit, Status> {
    let max = state.config.dcgm.gate_max_per_uid;
    let mut calls = state
        .gate
        .calls
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let n = calls.entry(uid).or_insert(0);
    if *n >= max {
        metrics::counter!("warden_api_quota_refused_total", "key" => "dcgm.gate_max_per_uid")
            .increment(1);
        return Err(Status::resource_exhausted(format!(
            "RunHealthGate refused for uid {uid}: {n} of its gate calls are in progress \
             (dcgm.gate_max_per_uid {max}); one gate runs at a time on the node"
        )));
    }
    *n += 1;
    Ok(CallPermit {
        state: state.clone(),
        uid,
    })
}

/// One run: dcgmi, or the NVML check where dcgmi gives no verdict.
async fn execute(state: &AgentState, level: u32) -> GateOutcome {
    match diag::run_dcgmi(&state.config.dcgm, level).await {
        Ok(o) => o,
        Err(e) => {
            let mut o = diag::nvml_check(&state.health.snapshot());
            let why = match &e {
                DiagError::Absent(_) => format!("{e}; ran the NVML check instead"),
                DiagError::Timeout(_) | DiagError::NoVerdict(_) => {
                    format!("{e}; ran the NVML check instead (a gate that cannot tell fails safe)")
                }
            };
            o.note = if o.note.is_empty() {
                why
            } else {
                format!("{why}; {}", o.note)
            };
            o
        }
    }
}

/// The answer; a cached one says so, with the age and level of its run.
fn result(
    outcome: GateOutcome,
    cached: Option<(u32, Duration)>,
    cache_for: Duration,
) -> pb::HealthGateResult {
    let mut note = outcome.note;
    if let Some((level, age)) = cached {
        let age_s = humantime::format_duration(Duration::from_secs(age.as_secs()));
        let said = format!(
            "cached: the result of the level-{level} gate that ended {age_s} ago \
             (dcgm.gate_cache_for {})",
            humantime::format_duration(cache_for)
        );
        note = if note.is_empty() {
            said
        } else {
            format!("{said}; {note}")
        };
    }
    pb::HealthGateResult {
        passed: outcome.passed,
        ran: outcome.ran,
        duration: Some(convert::duration(outcome.duration)),
        failures: outcome
            .failures
            .iter()
            .map(|f| pb::GateFailure {
                test: f.test.clone(),
                entity: f.entity.clone(),
                status: f.status.clone(),
                message: f.message.clone(),
                severity: f.severity.clone(),
            })
            .collect(),
        note,
        cached: cached.is_some(),
        cached_age: cached.map(|(_, age)| convert::duration(age)),
    }
}

fn publish(state: &AgentState, job: &str, o: &GateOutcome) {
    let took = humantime::format_duration(o.duration).to_string();
    metrics::histogram!("warden_gate_seconds", "ran" => o.ran.clone())
        .record(o.duration.as_secs_f64());
    if o.passed {
        state.events.publish(
            NewEvent::new(
                Severity::Info,
                "gate.passed",
                "node",
                format!("health gate passed ({}, {took})", o.ran),
            )
            .with("ran", &o.ran)
            .with("duration", took)
            .with("job", job)
            .with("note", &o.note),
        );
        return;
    }
    state.events.publish(Signal::GateFailed(GateFailed {
        ran: o.ran.clone(),
        duration: took.to_string(),
        job: job.to_string(),
        note: o.note.clone(),
        failures: o
            .failures
            .iter()
            .map(|f| GateFailure {
                test: f.test.clone(),
                entity: f.entity.clone(),
                message: f.message.clone(),
                severity: f.severity.clone(),
            })
            .collect(),
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_above_the_bound_is_refused_naming_the_key() {
        assert_eq!(level_of(0, 1, 2).unwrap(), 1);
        assert_eq!(level_of(2, 1, 2).unwrap(), 2);
        for asked in [3, 4, 99] {
            let e = level_of(asked, 1, 2).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("dcgm.gate_max_level (2)"), "{e:?}");
        }
    }

    #[test]
    fn a_cached_answer_says_so_with_its_age() {
        let o = GateOutcome {
            passed: true,
            ran: "dcgmi diag -r 2".into(),
            duration: Duration::from_secs(3),
            failures: Vec::new(),
            note: String::new(),
        };
        let fresh = result(o.clone(), None, Duration::from_secs(60));
        assert!(!fresh.cached && fresh.cached_age.is_none() && fresh.note.is_empty());
        let r = result(
            o,
            Some((2, Duration::from_millis(12_500))),
            Duration::from_secs(60),
        );
        assert!(r.cached);
        assert_eq!(r.cached_age.unwrap().seconds, 12);
        assert!(
            r.note
                .starts_with("cached: the result of the level-2 gate that ended 12s ago"),
            "{}",
            r.note
        );
    }
}
