//! The pre-restart health gate, on demand (`warden diag`) and before a
//! launcher respawns workers on this node, as a use case: the level a call
//! may ask for, the calls one uid may have in progress, one run at a time
//! with its result cached for the callers behind it, and the verdict
//! published (`gate.passed`, or `gate.failed`, which attribution turns into
//! an incident of the job).
//!
//! In: a caller already authorised by the edge (an admin, or the owner of
//! some job here) and its uid. Out: the gate's verdict, from a run or from
//! the last run's cache (with its age). Never: a level above
//! `dcgm.gate_max_level` (refused, naming the key: `dcgmi diag -r 4`
//! stresses every GPU of every tenant), two runs at once on the node
//! (callers queue on [`Gate`] and share the result), more calls of one uid
//! in progress than `dcgm.gate_max_per_uid` (refused naming the key), or a
//! run abandoned midway because its caller went away (it runs to its end,
//! or `dcgm.gate_timeout`, and its result is cached for the callers queued
//! behind it). The gRPC edge (`api::service`) decodes, calls [`run`] and
//! maps [`GateError`] and [`GateAnswer`].

pub mod state;

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::sources::dcgm::config::DcgmConfig;
use crate::sources::dcgm::diag::{self, DiagError, GateOutcome};
use warden_core::events::{EventBus, NewEvent, Severity};
use warden_core::health::HealthModel;
use warden_core::signal::{GateFailed, GateFailure, Signal};

pub use state::Gate;
use state::LastRun;

/// What a gate run needs of the agent, and nothing more.
#[derive(Debug, Clone)]
pub struct Handles {
    /// The node's one gate (its last run, the calls in progress).
    pub gate: Arc<Gate>,
    /// The gate's settings.
    pub dcgm: Arc<DcgmConfig>,
    /// The NVML view, for the check where dcgmi gives no verdict.
    pub health: Arc<HealthModel>,
    /// Where the verdict is published.
    pub events: Arc<EventBus>,
}

/// Why a gate call was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GateError {
    /// A level deeper than `dcgm.gate_max_level`.
    #[error(
        "health gate level {level} refused: above dcgm.gate_max_level ({max}); a gate stresses every GPU of the node, whoever uses them (an admin may raise dcgm.gate_max_level)"
    )]
    TooDeep {
        /// Asked.
        level: u32,
        /// The bound.
        max: u32,
    },
    /// The uid has as many calls in progress as it may.
    #[error(
        "RunHealthGate refused for uid {uid}: {calls} of its gate calls are in progress (dcgm.gate_max_per_uid {max}); one gate runs at a time on the node"
    )]
    Busy {
        /// The caller's uid.
        uid: u32,
        /// Its calls in progress.
        calls: u32,
        /// The bound.
        max: u32,
    },
    /// The run's task ended without an answer (it panicked).
    #[error("the health gate's task failed: {0}")]
    Task(String),
}

/// A gate's verdict, fresh or from the cache.
#[derive(Debug, Clone)]
pub struct GateAnswer {
    /// The run's verdict.
    pub outcome: GateOutcome,
    /// For a cached answer: the level of the run it comes from, and its age.
    pub cached: Option<(u32, Duration)>,
}

impl GateAnswer {
    /// The note for the caller: a cached answer says so, with the age and
    /// level of its run, before the run's own note.
    pub fn note(&self, cache_for: Duration) -> String {
        let note = &self.outcome.note;
        let Some((level, age)) = self.cached else {
            return note.clone();
        };
        let age_s = humantime::format_duration(Duration::from_secs(age.as_secs()));
        let said = format!(
            "cached: the result of the level-{level} gate that ended {age_s} ago \
             (dcgm.gate_cache_for {})",
            humantime::format_duration(cache_for)
        );
        if note.is_empty() {
            said
        } else {
            format!("{said}; {note}")
        }
    }
}

/// One call's place among its uid's calls; given back when dropped.
#[derive(Debug)]
struct CallPermit {
    gate: Arc<Gate>,
    uid: u32,
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        let mut calls = self
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

/// The level a call asks for (0: `dcgm.gate_level`), refused when it is
/// deeper than `dcgm.gate_max_level`.
pub fn level_of(asked: u32, default: u32, max: u32) -> Result<u32, GateError> {
    let level = if asked == 0 { default } else { asked };
    if level > max {
        return Err(GateError::TooDeep { level, max });
    }
    Ok(level)
}

/// Runs the gate for `uid` at level `asked` about `job`: dcgmi where it
/// gives a verdict, else the NVML check; a failure is published as
/// `gate.failed`, which attribution turns into an incident of the job
/// (uncorrectable hardware: the node-level path). Only one run at a time;
/// a run that ended within `dcgm.gate_cache_for` at this level or deeper
/// answers instead.
pub async fn run(h: &Handles, asked: u32, job: String, uid: u32) -> Result<GateAnswer, GateError> {
    let level = level_of(asked, h.dcgm.gate_level, h.dcgm.gate_max_level).inspect_err(|_| {
        metrics::counter!("warden_gate_answers_total", "answer" => "refused").increment(1);
    })?;
    let permit = enter(h, uid)?;
    // The run is a task of its own: a caller that goes away neither kills
    // it (its dcgmi would be killed midway and the next caller start over)
    // nor frees its uid's place before it ends.
    let h = h.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let mut last = h.gate.last.lock().await;
        if let Some(l) = last.as_ref()
            && l.level >= level
            && l.ended.elapsed() < h.dcgm.gate_cache_for
        {
            metrics::counter!("warden_gate_answers_total", "answer" => "cached").increment(1);
            return GateAnswer {
                outcome: l.outcome.clone(),
                cached: Some((l.level, l.ended.elapsed())),
            };
        }
        let outcome = execute(&h, level).await;
        publish(&h.events, &job, &outcome);
        metrics::counter!("warden_gate_answers_total", "answer" => "ran").increment(1);
        *last = Some(LastRun {
            level,
            outcome: outcome.clone(),
            ended: Instant::now(),
        });
        GateAnswer {
            outcome,
            cached: None,
        }
    })
    .await
    .map_err(|e| GateError::Task(e.to_string()))
}

/// Counts a call of `uid`, or refuses it past `dcgm.gate_max_per_uid`.
fn enter(h: &Handles, uid: u32) -> Result<CallPermit, GateError> {
    let max = h.dcgm.gate_max_per_uid;
    let mut calls = h.gate.calls.lock().unwrap_or_else(PoisonError::into_inner);
    let n = calls.entry(uid).or_insert(0);
    if *n >= max {
        metrics::counter!("warden_api_quota_refused_total", "key" => "dcgm.gate_max_per_uid")
            .increment(1);
        return Err(GateError::Busy {
            uid,
            calls: *n,
            max,
        });
    }
    *n += 1;
    Ok(CallPermit {
        gate: h.gate.clone(),
        uid,
    })
}

/// One run: dcgmi, or the NVML check where dcgmi gives no verdict.
async fn execute(h: &Handles, level: u32) -> GateOutcome {
    match diag::run_dcgmi(&h.dcgm, level).await {
        Ok(o) => o,
        Err(e) => {
            let mut o = diag::nvml_check(&h.health.snapshot());
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

fn publish(events: &EventBus, job: &str, o: &GateOutcome) {
    let took = humantime::format_duration(o.duration).to_string();
    metrics::histogram!("warden_gate_seconds", "ran" => o.ran.clone())
        .record(o.duration.as_secs_f64());
    if o.passed {
        events.publish(
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
    events.publish(Signal::GateFailed(GateFailed {
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
            assert_eq!(
                e,
                GateError::TooDeep {
                    level: asked,
                    max: 2
                }
            );
            assert!(e.to_string().contains("dcgm.gate_max_level (2)"), "{e:?}");
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
        let fresh = GateAnswer {
            outcome: o.clone(),
            cached: None,
        };
        assert!(fresh.note(Duration::from_secs(60)).is_empty());
        let cached = GateAnswer {
            outcome: o,
            cached: Some((2, Duration::from_millis(12_500))),
        };
        let note = cached.note(Duration::from_secs(60));
        assert!(
            note.starts_with("cached: the result of the level-2 gate that ended 12s ago"),
            "{note}"
        );
    }
}
