//! RunHealthGate: the pre-restart health gate, on demand (`warden diag`)
//! and before a launcher respawns workers on this node.

use std::sync::Arc;

use warden_proto::v1 as pb;

use super::convert;
use crate::sources::dcgm::diag::{self, DiagError, GateOutcome};
use crate::state::AgentState;
use warden_core::events::{NewEvent, Severity};
use warden_core::signal::{GateFailed, GateFailure, Signal};

/// Runs the gate: dcgmi where it gives a verdict, else the NVML check; a
/// failure is published as `gate.failed`, which attribution turns into an
/// incident of the job (uncorrectable hardware: the node-level path).
pub async fn run(state: &Arc<AgentState>, req: pb::RunHealthGateRequest) -> pb::HealthGateResult {
    let cfg = &state.config.dcgm;
    let level = if req.level == 0 {
        cfg.gate_level
    } else {
        req.level.min(4)
    };
    let outcome = match diag::run_dcgmi(cfg, level).await {
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
    };
    publish(state, &req.job_id, &outcome);
    pb::HealthGateResult {
        passed: outcome.passed,
        ran: outcome.ran.clone(),
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
        note: outcome.note,
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
