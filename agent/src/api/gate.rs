//! RunHealthGate at the edge: decoded here, run by [`crate::act::gate`]
//! (the level bound, the per-uid calls, one run at a time and its cache,
//! the verdict published), its answer and refusals mapped here.

use std::sync::Arc;
use std::time::Duration;

use tonic::Status;
use warden_proto::v1 as pb;

use super::convert;
use crate::act::gate::{self, GateAnswer, GateError};
use crate::state::AgentState;

/// Runs the gate for `uid` (already authorised by the rule table).
pub async fn run(
    state: &Arc<AgentState>,
    req: pb::RunHealthGateRequest,
    uid: u32,
) -> Result<pb::HealthGateResult, Status> {
    let answer = gate::run(&state.gate_handles(), req.level, req.job_id, uid)
        .await
        .map_err(|e| match e {
            GateError::TooDeep { .. } => Status::invalid_argument(e.to_string()),
            GateError::Busy { .. } => Status::resource_exhausted(e.to_string()),
            GateError::Task(_) => Status::internal(e.to_string()),
        })?;
    Ok(result(&answer, state.config.dcgm.gate_cache_for))
}

/// The answer on the wire; a cached one says so, with its age.
fn result(a: &GateAnswer, cache_for: Duration) -> pb::HealthGateResult {
    let o = &a.outcome;
    pb::HealthGateResult {
        passed: o.passed,
        ran: o.ran.clone(),
        duration: Some(convert::duration(o.duration)),
        failures: o
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
        note: a.note(cache_for),
        cached: a.cached.is_some(),
        cached_age: a.cached.map(|(_, age)| convert::duration(age)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::dcgm::diag::GateOutcome;

    #[test]
    fn a_cached_answer_carries_its_age_on_the_wire() {
        let a = GateAnswer {
            outcome: GateOutcome {
                passed: true,
                ran: "dcgmi diag -r 2".into(),
                duration: Duration::from_secs(3),
                failures: Vec::new(),
                note: String::new(),
            },
            cached: Some((2, Duration::from_millis(12_500))),
        };
        let r = result(&a, Duration::from_secs(60));
        assert!(r.cached);
        assert_eq!(r.cached_age.unwrap().seconds, 12);
        assert!(r.note.starts_with("cached: the result of the level-2 gate"));
        let fresh = result(&GateAnswer { cached: None, ..a }, Duration::from_secs(60));
        assert!(!fresh.cached && fresh.cached_age.is_none() && fresh.note.is_empty());
    }
}
