//! Model types to protobuf messages, in one place.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_proto::v1 as pb;

use warden_core::events::{Event, Severity};
use warden_core::health::{Component, NodeSnapshot, Reason, Status};

/// A wall-clock time as a protobuf Timestamp.
pub fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A duration as a protobuf Duration.
pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// Status to its wire enum.
pub fn status(s: Status) -> pb::Status {
    match s {
        Status::Absent => pb::Status::Absent,
        Status::Ok => pb::Status::Ok,
        Status::Unknown => pb::Status::Unknown,
        Status::Degraded => pb::Status::Degraded,
        Status::Failed => pb::Status::Failed,
    }
}

/// Severity to its wire enum.
pub fn severity(s: Severity) -> pb::Severity {
    match s {
        Severity::Info => pb::Severity::Info,
        Severity::Warning => pb::Severity::Warning,
        Severity::Error => pb::Severity::Error,
        Severity::Critical => pb::Severity::Critical,
    }
}

fn reason(r: &Reason) -> pb::Reason {
    pb::Reason {
        status: status(r.status).into(),
        signal: r.signal.clone(),
        value: r.value.clone(),
        threshold: r.threshold.clone(),
        window: r.window.clone(),
        since: Some(timestamp(r.since)),
        message: r.message.clone(),
    }
}

fn component(c: &Component) -> pb::Component {
    pb::Component {
        id: c.id.clone(),
        kind: c.kind.clone(),
        status: status(c.status).into(),
        since: Some(timestamp(c.since)),
        reasons: c.reasons.iter().map(reason).collect(),
        labels: c.labels.clone().into_iter().collect(),
    }
}

/// A node snapshot as NodeHealth.
pub fn node_health(host: &str, s: &NodeSnapshot) -> pb::NodeHealth {
    pb::NodeHealth {
        host: host.to_owned(),
        status: status(s.status).into(),
        components: s.components.iter().map(component).collect(),
        observed_at: Some(timestamp(s.observed_at)),
    }
}

/// An event as its wire message.
pub fn event(e: &Event) -> pb::Event {
    pb::Event {
        id: e.id,
        time: Some(timestamp(e.time)),
        severity: severity(e.severity).into(),
        kind: e.kind.to_owned(),
        subject: e.subject.clone(),
        message: e.message.clone(),
        evidence: e
            .evidence
            .iter()
            .map(|(k, v)| pb::KeyValue {
                key: k.clone(),
                value: v.clone(),
            })
            .collect(),
    }
}

/// A registered rank as RankInfo; `now_ns` is CLOCK_MONOTONIC.
pub fn rank_info(e: &crate::ranks::registry::RankEntry, now_ns: u64) -> pb::RankInfo {
    let snap = e.last.as_ref();
    let mut durations: Vec<u64> = snap
        .map(|s| {
            s.recent_steps
                .iter()
                .map(|st| st.duration_ns)
                .filter(|d| *d > 0)
                .collect()
        })
        .unwrap_or_default();
    durations.sort_unstable();
    let pct = |p: f64| {
        warden_core::detect::calibration::nearest_rank(&durations, p)
            .map(|ns| duration(Duration::from_nanos(ns)))
    };
    let in_section = snap
        .and_then(|s| s.innermost())
        .map(|o| duration(Duration::from_nanos(now_ns.saturating_sub(o.entered_ns))));
    pb::RankInfo {
        job_id: e.key.job.clone(),
        global_rank: e.key.rank,
        local_rank: e.local_rank,
        world_size: e.world_size,
        pid: e.pid,
        state: e.state.as_str().to_owned(),
        step: snap.map_or(0, |s| s.step),
        section: e.section.clone(),
        in_section,
        heartbeat_age: Some(duration(Duration::from_nanos(
            now_ns.saturating_sub(e.progress_ns),
        ))),
        step_time_p50: pct(50.0),
        step_time_p90: pct(90.0),
        step_time_p99: pct(99.0),
        exit_code: e.exit.as_ref().and_then(|x| x.code),
        exit_signal: e.exit.as_ref().and_then(|x| x.signal),
        slot_index: e.slot,
        steps_completed: snap.map_or(0, |s| s.steps_completed),
        hang_threshold: e.threshold.as_ref().map(|t| duration(t.value)),
        hang_threshold_source: e
            .threshold
            .as_ref()
            .map(|t| t.source.clone())
            .unwrap_or_default(),
        host: e.host.clone(),
    }
}

/// A fault class to its wire enum.
pub fn fault_class(c: warden_core::attribute::FaultClass) -> pb::FaultClass {
    use warden_core::attribute::FaultClass as F;
    match c {
        F::UserError => pb::FaultClass::UserError,
        F::TransientSoftware => pb::FaultClass::TransientSoftware,
        F::CorrectableHardware => pb::FaultClass::CorrectableHardware,
        F::UncorrectableHardware => pb::FaultClass::UncorrectableHardware,
        F::Infrastructure => pb::FaultClass::Infrastructure,
        F::Unknown => pb::FaultClass::Unknown,
    }
}

/// An action to its wire enum.
pub fn action(a: warden_core::policy::Action) -> pb::Action {
    use warden_core::policy::Action as A;
    match a {
        A::Continue => pb::Action::Continue,
        A::Stop => pb::Action::Stop,
        A::RestartInProcess => pb::Action::RestartInProcess,
        A::RestartInJob => pb::Action::RestartInJob,
        A::Cordon => pb::Action::Cordon,
        A::ScaleDown => pb::Action::ScaleDown,
    }
}

/// A wire action back to core's (`None`: unspecified, or a value this
/// build does not know). The launcher's incident feed and the CLI read
/// decisions through it, so the wire enum is mapped in this file alone.
pub fn action_of(v: i32) -> Option<warden_core::policy::Action> {
    use warden_core::policy::Action as A;
    match pb::Action::try_from(v).ok()? {
        pb::Action::Unspecified => None,
        pb::Action::Continue => Some(A::Continue),
        pb::Action::Stop => Some(A::Stop),
        pb::Action::RestartInProcess => Some(A::RestartInProcess),
        pb::Action::RestartInJob => Some(A::RestartInJob),
        pb::Action::Cordon => Some(A::Cordon),
        pb::Action::ScaleDown => Some(A::ScaleDown),
    }
}

/// A decision to its message.
pub fn decision(d: &warden_core::policy::Decision) -> pb::Decision {
    pb::Decision {
        // In dry run the action taken is `continue`; the reason says what
        // would have been done.
        action: action(d.effective_action()) as i32,
        reason: d.reason.clone(),
        decided_by: d.decided_by.clone(),
        attempt: d.attempt,
        budget: d.budget,
        backoff: Some(duration(d.backoff)),
        exit_code: if d.dry_run { 0 } else { d.exit_code },
        decided_at: Some(timestamp(d.decided_at)),
        replace: d.replace.as_ref().map(|r| pb::Replacement {
            ranks: r.ranks.clone(),
            restart_count: r.restart_count,
        }),
    }
}

/// An incident record to its message.
pub fn incident(r: &warden_core::attribute::IncidentRecord) -> pb::Incident {
    let d = &r.diagnosis;
    pb::Incident {
        id: r.id.clone(),
        opened_at: Some(timestamp(r.opened_at)),
        updated_at: Some(timestamp(r.updated_at)),
        kind: r.kind.as_str().to_owned(),
        host: r.host.clone(),
        job_id: r.job.clone(),
        ranks: r.ranks.clone(),
        devices: r.devices.clone(),
        diagnosis: Some(pb::Diagnosis {
            fault_class: fault_class(d.class) as i32,
            confidence: d.confidence,
            summary: d.summary.clone(),
            rule: d.rule.clone(),
            evidence: d
                .evidence
                .iter()
                .map(|e| pb::Evidence {
                    at: Some(timestamp(e.at)),
                    source: e.source.clone(),
                    signal: e.signal.clone(),
                    subject: e.subject.clone(),
                    value: e.value.clone(),
                    points_to: e.points_to.map_or(pb::FaultClass::Unspecified, fault_class) as i32,
                    note: e.note.clone(),
                    event_id: e.event_id,
                })
                .collect(),
        }),
        decision: r.decision.as_ref().map(decision),
        superseded: r.superseded.iter().map(decision).collect(),
        waited_on: r.waited_on.clone(),
    }
}

/// ListCheckpoints' answer from the tier's listing.
pub fn checkpoints(l: crate::ckpt::listing::Listing) -> pb::ListCheckpointsResponse {
    pb::ListCheckpointsResponse {
        steps: l
            .steps
            .into_iter()
            .map(|s| pb::CheckpointStep {
                job_id: s.job,
                step: s.step,
                world_size: s.world_size,
                complete: s.complete,
                shards: s
                    .shards
                    .into_iter()
                    .map(|sh| pb::ShardLocations {
                        rank: sh.rank,
                        size_bytes: sh.size_bytes,
                        xxh3: sh.xxh3,
                        copies: sh
                            .copies
                            .into_iter()
                            .map(|c| pb::ShardCopy {
                                tier: c.tier.to_owned(),
                                holder: c.holder,
                                corrupt: c.corrupt.unwrap_or_default(),
                                unconfirmed: c.unconfirmed,
                            })
                            .collect(),
                    })
                    .collect(),
                ranks_with_copy: s.counts.ranks_with_copy,
                size_bytes: s.counts.size_bytes,
                sized_ranks: s.counts.sized_ranks,
                good_copies: s.counts.good_copies,
                corrupt_copies: s.counts.corrupt_copies,
                missing_ranks: s.counts.missing,
            })
            .collect(),
        unreachable: l.unreachable,
        summarized: l.summarized,
        collected: l.collected,
    }
}

/// ReportException's answer from the in-process stage's.
pub fn exception_answer(
    a: crate::act::in_process::exception::ExceptionAnswer,
) -> pb::ReportExceptionResponse {
    use crate::act::in_process::exception::ExceptionAnswer;
    match a {
        ExceptionAnswer::Restart { seq, rule, reason } => pb::ReportExceptionResponse {
            action: pb::Action::RestartInProcess as i32,
            seq,
            rule: rule.to_owned(),
            reason,
        },
        ExceptionAnswer::Stop { rule, reason } => pb::ReportExceptionResponse {
            action: pb::Action::Stop as i32,
            seq: 0,
            rule: rule.to_owned(),
            reason,
        },
    }
}
