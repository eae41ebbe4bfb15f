//! Model types to protobuf messages, in one place.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_proto::v1 as pb;

use crate::events::{Event, Severity};
use crate::health::{Component, NodeSnapshot, Reason, Status};

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
