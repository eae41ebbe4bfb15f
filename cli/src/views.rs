//! How API answers are shown: tables for people, JSON for scripts.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::one_line;
use comfy_table::presets::NOTHING;
use comfy_table::{Cell, Table};
use serde_json::{Value, json};
use warden_proto::v1 as pb;

/// A protobuf timestamp as RFC 3339 (seconds), or "-".
pub fn time(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(|t| {
        let secs = u64::try_from(t.seconds).ok()?;
        Some(humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs)).to_string())
    })
    .unwrap_or_else(|| "-".into())
}

/// How long ago a timestamp was, rounded for reading ("3m 12s").
pub fn ago(t: Option<&prost_types::Timestamp>) -> String {
    let Some(secs) = t.and_then(|t| u64::try_from(t.seconds).ok()) else {
        return "-".into();
    };
    let then = UNIX_EPOCH + Duration::from_secs(secs);
    let d = SystemTime::now().duration_since(then).unwrap_or_default();
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

fn status_name(v: i32) -> &'static str {
    match pb::Status::try_from(v) {
        Ok(pb::Status::Ok) => "OK",
        Ok(pb::Status::Degraded) => "DEGRADED",
        Ok(pb::Status::Failed) => "FAILED",
        Ok(pb::Status::Unknown) => "UNKNOWN",
        Ok(pb::Status::Absent) => "ABSENT",
        _ => "UNSPECIFIED",
    }
}

fn severity_name(v: i32) -> &'static str {
    match pb::Severity::try_from(v) {
        Ok(pb::Severity::Info) => "info",
        Ok(pb::Severity::Warning) => "warning",
        Ok(pb::Severity::Error) => "error",
        Ok(pb::Severity::Critical) => "critical",
        _ => "unspecified",
    }
}

fn table() -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    t
}

/// JSON form of AgentInfo.
pub fn info_json(i: &pb::AgentInfo) -> Value {
    json!({
        "version": i.version,
        "host": i.host,
        "pid": i.pid,
        "started_at": time(i.started_at.as_ref()),
        "uptime_seconds": i.uptime.as_ref().map_or(0, |d| d.seconds),
        "endpoints": i.endpoints.iter().map(|e| json!({"kind": e.kind, "address": e.address})).collect::<Vec<_>>(),
        "config_source": i.config_source,
        "config_toml": i.config_toml,
    })
}

/// Prints AgentInfo.
pub fn print_info(i: &pb::AgentInfo, as_json: bool, with_config: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", info_json(i))?;
        return Ok(());
    }
    let mut t = table();
    t.add_row(vec!["version", &i.version]);
    t.add_row(vec!["host", &i.host]);
    t.add_row(vec!["pid", &i.pid.to_string()]);
    let uptime = i
        .uptime
        .as_ref()
        .map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0));
    t.add_row(vec![
        "uptime".to_owned(),
        humantime::format_duration(Duration::from_secs(uptime)).to_string(),
    ]);
    t.add_row(vec!["started".to_owned(), time(i.started_at.as_ref())]);
    t.add_row(vec!["config", &i.config_source]);
    for e in &i.endpoints {
        t.add_row(vec![&e.kind, &e.address]);
    }
    outln!("{t}")?;
    if with_config {
        outln!("\n{}", i.config_toml)?;
    }
    Ok(())
}

/// JSON form of NodeHealth.
pub fn health_json(h: &pb::NodeHealth) -> Value {
    json!({
        "host": h.host,
        "status": status_name(h.status),
        "observed_at": time(h.observed_at.as_ref()),
        "components": h.components.iter().map(|c| json!({
            "id": c.id,
            "kind": c.kind,
            "status": status_name(c.status),
            "since": time(c.since.as_ref()),
            "labels": c.labels,
            "reasons": c.reasons.iter().map(|r| json!({
                "status": status_name(r.status),
                "signal": r.signal,
                "value": r.value,
                "threshold": r.threshold,
                "window": r.window,
                "since": time(r.since.as_ref()),
                "message": r.message,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Prints NodeHealth: a headline, then one row per component.
pub fn print_health(h: &pb::NodeHealth, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", health_json(h))?;
        return Ok(());
    }
    outln!("node {}: {}", h.host, status_name(h.status))?;
    let mut t = table();
    t.set_header(vec!["COMPONENT", "STATUS", "FOR", "REASON"]);
    for c in &h.components {
        let reason = c.reasons.first().map_or_else(String::new, |r| {
            let mut s = r.message.clone();
            if !r.value.is_empty() {
                s.push_str(&format!(" [{}={}", r.signal, r.value));
                if !r.threshold.is_empty() {
                    s.push_str(&format!(", threshold {}", r.threshold));
                }
                s.push(']');
            }
            s
        });
        t.add_row(vec![
            Cell::new(&c.id),
            Cell::new(status_name(c.status)),
            Cell::new(ago(c.since.as_ref())),
            Cell::new(reason),
        ]);
    }
    outln!("{t}")?;
    Ok(())
}

/// JSON form of an Event.
pub fn event_json(e: &pb::Event) -> Value {
    json!({
        "id": e.id,
        "time": time(e.time.as_ref()),
        "severity": severity_name(e.severity),
        "kind": e.kind,
        "subject": e.subject,
        "message": e.message,
        "evidence": e.evidence.iter().map(|kv| (kv.key.clone(), Value::String(kv.value.clone()))).collect::<serde_json::Map<_, _>>(),
    })
}

/// Prints one event as a line (or one JSON object per line).
pub fn print_event(e: &pb::Event, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", event_json(e))?;
        return Ok(());
    }
    // One line per event: a value a rank wrote cannot start another.
    let evidence: Vec<String> = e
        .evidence
        .iter()
        .map(|kv| format!("{}={}", one_line(&kv.key), one_line(&kv.value)))
        .collect();
    outln!(
        "{} {} {:<8} {:<16} {:<14} {}{}{}",
        e.id,
        time(e.time.as_ref()),
        severity_name(e.severity),
        one_line(&e.kind),
        one_line(&e.subject),
        one_line(&e.message),
        if evidence.is_empty() { "" } else { "  " },
        evidence.join(" ")
    )?;
    Ok(())
}

fn dur(d: Option<&prost_types::Duration>) -> String {
    d.map_or_else(
        || "-".into(),
        |d| {
            let secs = u64::try_from(d.seconds).unwrap_or(0);
            let nanos = u32::try_from(d.nanos).unwrap_or(0);
            warden_core::detect::hang::fmt(Duration::new(secs, nanos))
        },
    )
}

fn dur_secs(d: Option<&prost_types::Duration>) -> Value {
    d.map_or(Value::Null, |d| {
        json!(d.seconds as f64 + f64::from(d.nanos) / 1e9)
    })
}

/// JSON form of GetRanks.
pub fn ranks_json(r: &pb::GetRanksResponse) -> Value {
    json!({
        "ranks": r.ranks.iter().map(|k| json!({
            "job_id": k.job_id,
            "global_rank": k.global_rank,
            "local_rank": k.local_rank,
            "world_size": k.world_size,
            "pid": k.pid,
            "host": k.host,
            "state": k.state,
            "step": k.step,
            "steps_completed": k.steps_completed,
            "section": k.section,
            "in_section_seconds": dur_secs(k.in_section.as_ref()),
            "heartbeat_age_seconds": dur_secs(k.heartbeat_age.as_ref()),
            "step_time_p50_seconds": dur_secs(k.step_time_p50.as_ref()),
            "step_time_p90_seconds": dur_secs(k.step_time_p90.as_ref()),
            "step_time_p99_seconds": dur_secs(k.step_time_p99.as_ref()),
            "hang_threshold_seconds": dur_secs(k.hang_threshold.as_ref()),
            "hang_threshold_source": k.hang_threshold_source,
            "exit_code": k.exit_code,
            "exit_signal": k.exit_signal,
            "slot": k.slot_index,
        })).collect::<Vec<_>>(),
    })
}

/// Prints one row per rank.
pub fn print_ranks(r: &pb::GetRanksResponse, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", ranks_json(r))?;
        return Ok(());
    }
    if r.ranks.is_empty() {
        outln!("no ranks registered")?;
        return Ok(());
    }
    let mut t = table();
    t.set_header(vec![
        "JOB",
        "RANK",
        "PID",
        "STATE",
        "STEP",
        "SECTION",
        "IN SECTION",
        "LAST PROGRESS",
        "STEP p50",
        "p99",
        "HANG AFTER",
    ]);
    for k in &r.ranks {
        let state = match (k.exit_code, k.exit_signal) {
            (Some(c), _) => format!("{} ({c})", k.state),
            (None, Some(s)) => format!("{} (signal {s})", k.state),
            _ => k.state.clone(),
        };
        t.add_row(vec![
            k.job_id.clone(),
            format!("{}/{}", k.global_rank, k.world_size),
            k.pid.to_string(),
            state,
            k.step.to_string(),
            k.section.clone(),
            dur(k.in_section.as_ref()),
            format!("{} ago", dur(k.heartbeat_age.as_ref())),
            dur(k.step_time_p50.as_ref()),
            dur(k.step_time_p99.as_ref()),
            dur(k.hang_threshold.as_ref()),
        ]);
    }
    outln!("{t}")?;
    Ok(())
}

/// The health gate's verdict: one line, then each failure.
pub fn print_gate(r: &pb::HealthGateResult, json: bool) -> std::io::Result<()> {
    let took = r
        .duration
        .as_ref()
        .map(|d| {
            std::time::Duration::new(
                u64::try_from(d.seconds).unwrap_or(0),
                u32::try_from(d.nanos).unwrap_or(0),
            )
        })
        .unwrap_or_default();
    if json {
        let v = serde_json::json!({
            "passed": r.passed,
            "ran": r.ran,
            "duration_seconds": took.as_secs_f64(),
            "note": r.note,
            "cached": r.cached,
            "cached_age_seconds": r.cached_age.as_ref().map(|d| d.seconds as f64 + f64::from(d.nanos) / 1e9),
            "failures": r.failures.iter().map(|f| serde_json::json!({
                "test": f.test, "entity": f.entity, "status": f.status,
                "message": f.message, "severity": f.severity,
            })).collect::<Vec<_>>(),
        });
        outln!("{v}")?;
        return Ok(());
    }
    outln!(
        "health gate {} ({}, {})",
        if r.passed { "PASSED" } else { "FAILED" },
        r.ran,
        humantime::format_duration(std::time::Duration::from_millis(
            u64::try_from(took.as_millis()).unwrap_or(u64::MAX)
        ))
    )?;
    if !r.note.is_empty() {
        outln!("  note: {}", r.note)?;
    }
    for f in &r.failures {
        let sev = if f.severity.is_empty() {
            String::new()
        } else {
            format!(" [{}]", f.severity)
        };
        outln!("  {} {} {}{sev}: {}", f.entity, f.test, f.status, f.message)?;
    }
    Ok(())
}
