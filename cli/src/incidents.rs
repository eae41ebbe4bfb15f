//! `warden incidents` and `warden uncordon`: what went wrong, whose fault it
//! was, what was decided, and lifting the cordon a decision put on the node.
//!
//! Text is written for the person paged at 3am: each incident is a header
//! line (when, id, kind, job, ranks, devices), a diagnosis line (fault
//! class, confidence, summary), a decision line (action, by whom, why), then
//! the chain of evidence indented under it. `--json` prints one document
//! with the same content, enums as snake_case names and times as RFC 3339
//! (milliseconds, so evidence within one second keeps its order; `null`
//! when absent).
//!
//! Rendering is pure (`render_*` return strings), so it is tested without an
//! agent; the `print_*` functions only write what those return.

use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use comfy_table::Table;
use comfy_table::presets::NOTHING;
use serde_json::{Value, json};
use warden_proto::v1 as pb;

use super::views::time;

/// Evidence lines shown per incident without `--evidence`; the rest are
/// counted ("3 more") so nothing is hidden silently.
pub const EVIDENCE_SHOWN: usize = 5;

/// The snake_case name of a `FaultClass` ("user_error").
pub fn fault_class_name(v: i32) -> &'static str {
    match pb::FaultClass::try_from(v) {
        Ok(pb::FaultClass::UserError) => "user_error",
        Ok(pb::FaultClass::TransientSoftware) => "transient_software",
        Ok(pb::FaultClass::CorrectableHardware) => "correctable_hardware",
        Ok(pb::FaultClass::UncorrectableHardware) => "uncorrectable_hardware",
        Ok(pb::FaultClass::Infrastructure) => "infrastructure",
        Ok(pb::FaultClass::Unknown) => "unknown",
        Ok(pb::FaultClass::Unspecified) | Err(_) => "unspecified",
    }
}

/// The snake_case name of an `Action` ("restart_in_job").
pub fn action_name(v: i32) -> &'static str {
    warden_agent::api::convert::action_of(v).map_or("unspecified", |a| a.as_str())
}

/// A protobuf timestamp as RFC 3339 with milliseconds, or `null`.
fn json_time(t: Option<&prost_types::Timestamp>) -> Value {
    t.and_then(|t| {
        let secs = u64::try_from(t.seconds).ok()?;
        let nanos = u32::try_from(t.nanos).ok()?;
        let at = UNIX_EPOCH + Duration::new(secs, nanos);
        Some(Value::String(
            humantime::format_rfc3339_millis(at).to_string(),
        ))
    })
    .unwrap_or(Value::Null)
}

/// A protobuf duration in seconds (fractional), or `null`.
fn json_secs(d: Option<&prost_types::Duration>) -> Value {
    d.map_or(Value::Null, |d| {
        // Exact for any backoff a policy would choose (well under 2^53 s).
        #[allow(clippy::cast_precision_loss)]
        let secs = d.seconds as f64;
        json!(secs + f64::from(d.nanos) / 1e9)
    })
}

/// A protobuf duration for reading ("30s", "1m 30s"), or `None` when absent or zero.
fn human_duration(d: Option<&prost_types::Duration>) -> Option<String> {
    let d = d?;
    let secs = u64::try_from(d.seconds).unwrap_or(0);
    let nanos = u32::try_from(d.nanos).unwrap_or(0);
    let d = Duration::new(secs, nanos);
    if d.is_zero() {
        return None;
    }
    // Whole milliseconds: "1s 500ms", not "1s 500ms 12us 3ns".
    let millis = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    Some(humantime::format_duration(Duration::from_millis(millis)).to_string())
}

/// JSON form of one piece of evidence.
pub fn evidence_json(e: &pb::Evidence) -> Value {
    json!({
        "at": json_time(e.at.as_ref()),
        "source": e.source,
        "signal": e.signal,
        "subject": e.subject,
        "value": e.value,
        "points_to": fault_class_name(e.points_to),
        "note": e.note,
        "event_id": e.event_id,
    })
}

/// JSON form of a Diagnosis.
pub fn diagnosis_json(d: &pb::Diagnosis) -> Value {
    json!({
        "fault_class": fault_class_name(d.fault_class),
        "confidence": d.confidence,
        "summary": d.summary,
        "rule": d.rule,
        "evidence": d.evidence.iter().map(evidence_json).collect::<Vec<_>>(),
    })
}

/// JSON form of a Decision.
pub fn decision_json(d: &pb::Decision) -> Value {
    json!({
        "action": action_name(d.action),
        "reason": d.reason,
        "decided_by": d.decided_by,
        "attempt": d.attempt,
        "budget": d.budget,
        "backoff_seconds": json_secs(d.backoff.as_ref()),
        "exit_code": d.exit_code,
        "decided_at": json_time(d.decided_at.as_ref()),
    })
}

/// JSON form of an Incident.
pub fn incident_json(i: &pb::Incident) -> Value {
    json!({
        "id": i.id,
        "opened_at": json_time(i.opened_at.as_ref()),
        "updated_at": json_time(i.updated_at.as_ref()),
        "kind": i.kind,
        "host": i.host,
        "job_id": i.job_id,
        "ranks": i.ranks,
        "devices": i.devices,
        "diagnosis": i.diagnosis.as_ref().map_or(Value::Null, diagnosis_json),
        "decision": i.decision.as_ref().map_or(Value::Null, decision_json),
        "superseded": i.superseded.iter().map(decision_json).collect::<Vec<_>>(),
        "waited_on": i.waited_on,
    })
}

/// JSON form of GetIncidents: `{"incidents": [...], "cordoned": bool}`.
pub fn incidents_json(r: &pb::GetIncidentsResponse) -> Value {
    json!({
        "incidents": r.incidents.iter().map(incident_json).collect::<Vec<_>>(),
        "cordoned": r.cordoned,
    })
}

fn joined<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Confidence 0..1 as a whole percentage ("87%").
fn percent(confidence: f64) -> String {
    format!("{:.0}%", (confidence.clamp(0.0, 1.0)) * 100.0)
}

/// The incident's first line: when, id, kind, then job, ranks and devices
/// where there are any.
fn header_line(i: &pb::Incident) -> String {
    let mut s = format!("{}  {}  {}", time(i.opened_at.as_ref()), i.id, i.kind);
    if i.job_id.is_empty() {
        s.push_str("  node-level");
    } else {
        let _ = write!(s, "  job {}", i.job_id);
    }
    if !i.ranks.is_empty() {
        let word = if i.ranks.len() == 1 { "rank" } else { "ranks" };
        let _ = write!(s, "  {word} {}", joined(&i.ranks));
    }
    if !i.devices.is_empty() {
        let _ = write!(s, "  on {}", joined(&i.devices));
    }
    if !i.host.is_empty() {
        let _ = write!(s, "  host {}", i.host);
    }
    if !i.waited_on.is_empty() {
        let _ = write!(s, "  waited on {} (not charged)", i.waited_on.join(", "));
    }
    s
}

/// "cordon by policy: reason (attempt 1/3, backoff 30s, exit code 75)".
fn decision_text(d: &pb::Decision) -> String {
    let mut s = action_name(d.action).to_owned();
    if !d.decided_by.is_empty() {
        let _ = write!(s, " by {}", d.decided_by);
    }
    if !d.reason.is_empty() {
        let _ = write!(s, ": {}", d.reason);
    }
    let mut details = Vec::new();
    if d.budget > 0 {
        details.push(format!("attempt {}/{}", d.attempt, d.budget));
    }
    if let Some(b) = human_duration(d.backoff.as_ref()) {
        details.push(format!("backoff {b}"));
    }
    if d.exit_code != 0 {
        details.push(format!("exit code {}", d.exit_code));
    }
    if !details.is_empty() {
        let _ = write!(s, " ({})", details.join(", "));
    }
    s
}

/// The evidence as an aligned table, each line indented by `indent`.
fn evidence_table(evidence: &[pb::Evidence], with_event_ids: bool, indent: &str) -> String {
    let mut t = Table::new();
    t.load_preset(NOTHING);
    let mut header = vec![
        "AT",
        "SOURCE",
        "SIGNAL",
        "SUBJECT",
        "VALUE",
        "POINTS TO",
        "NOTE",
    ];
    if with_event_ids {
        header.push("EVENT");
    }
    t.set_header(header);
    for e in evidence {
        let mut row = vec![
            time(e.at.as_ref()),
            e.source.clone(),
            e.signal.clone(),
            e.subject.clone(),
            e.value.clone(),
            fault_class_name(e.points_to).to_owned(),
            e.note.clone(),
        ];
        if with_event_ids {
            row.push(if e.event_id == 0 {
                "-".to_owned()
            } else {
                e.event_id.to_string()
            });
        }
        t.add_row(row);
    }
    let mut out = String::new();
    for line in t.to_string().lines() {
        let _ = writeln!(out, "{indent}{}", line.trim_end());
    }
    out
}

/// One incident as text: header, diagnosis, decision, evidence. With
/// `verbose`, every piece of evidence (with its event id), the rule, when
/// it was last updated, and the decisions later evidence superseded.
pub fn render_incident(i: &pb::Incident, verbose: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", header_line(i));
    match &i.diagnosis {
        Some(d) => {
            let _ = write!(
                out,
                "  {} ({}): {}",
                fault_class_name(d.fault_class),
                percent(d.confidence),
                if d.summary.is_empty() {
                    "(no summary)"
                } else {
                    &d.summary
                }
            );
            if verbose && !d.rule.is_empty() {
                let _ = write!(out, "  [rule {}]", d.rule);
            }
            out.push('\n');
        }
        None => out.push_str("  not diagnosed yet\n"),
    }
    match &i.decision {
        Some(d) => {
            let _ = writeln!(out, "  decision: {}", decision_text(d));
        }
        None => out.push_str("  decision: none yet\n"),
    }
    if verbose {
        if i.updated_at.is_some() {
            let _ = writeln!(out, "  updated: {}", time(i.updated_at.as_ref()));
        }
        for s in &i.superseded {
            let _ = writeln!(
                out,
                "  superseded ({}): {}",
                time(s.decided_at.as_ref()),
                decision_text(s)
            );
        }
    }
    let evidence = i.diagnosis.as_ref().map_or(&[][..], |d| &d.evidence[..]);
    if evidence.is_empty() {
        out.push_str("  evidence: none\n");
        return out;
    }
    let shown = if verbose {
        evidence.len()
    } else {
        evidence.len().min(EVIDENCE_SHOWN)
    };
    // Three spaces: the table pads its first column with one more.
    out.push_str(&evidence_table(&evidence[..shown], verbose, "   "));
    if shown < evidence.len() {
        let _ = writeln!(
            out,
            "    ... {} more (warden incidents --evidence shows all)",
            evidence.len() - shown
        );
    }
    out
}

/// The line that opens the listing when the node is cordoned: which
/// decision did it (the newest cordon among the incidents shown) and how
/// to lift it.
fn cordon_line(r: &pb::GetIncidentsResponse) -> String {
    let by = r.incidents.iter().rev().find(|i| {
        i.decision
            .as_ref()
            .is_some_and(|d| d.action == pb::Action::Cordon as i32)
    });
    let why = by.map_or_else(
        || "a remediation decision took it out of service".to_owned(),
        |i| {
            let summary = i
                .diagnosis
                .as_ref()
                .map(|d| d.summary.as_str())
                .filter(|s| !s.is_empty())
                .unwrap_or(i.kind.as_str());
            let since = i
                .decision
                .as_ref()
                .and_then(|d| d.decided_at.as_ref())
                .or(i.opened_at.as_ref());
            format!("{} since {}: {summary}", i.id, time(since))
        },
    );
    format!("node is CORDONED: {why}\n  after repair, `warden uncordon` lifts it")
}

/// GetIncidents as text: the cordon line when cordoned, then each incident
/// (newest last, as the agent lists them) separated by a blank line, or
/// "no incidents".
pub fn render_incidents(r: &pb::GetIncidentsResponse, job: Option<&str>, verbose: bool) -> String {
    let mut out = String::new();
    if r.cordoned {
        let _ = writeln!(out, "{}\n", cordon_line(r));
    }
    if r.incidents.is_empty() {
        match job {
            Some(j) => {
                let _ = writeln!(out, "no incidents for job {j}");
            }
            None => out.push_str("no incidents\n"),
        }
        return out;
    }
    let blocks: Vec<String> = r
        .incidents
        .iter()
        .map(|i| render_incident(i, verbose))
        .collect();
    out.push_str(&blocks.join("\n"));
    out
}

/// Prints GetIncidents (see [`render_incidents`], [`incidents_json`]).
pub fn print_incidents(
    r: &pb::GetIncidentsResponse,
    job: Option<&str>,
    as_json: bool,
    verbose: bool,
) -> std::io::Result<()> {
    if as_json {
        outln!("{}", incidents_json(r))?;
    } else {
        out!("{}", render_incidents(r, job, verbose))?;
    }
    Ok(())
}

/// Who is running the CLI, for the record the agent keeps of an uncordon:
/// the user behind sudo, else the login name, else the uid's name.
fn operator() -> String {
    ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| {
            let uid = nix::unistd::getuid();
            match nix::unistd::User::from_uid(uid) {
                Ok(Some(u)) => u.name,
                _ => format!("uid {uid}"),
            }
        })
}

/// The reason sent with Uncordon: who sent it, then the operator's text or
/// a default ("alice: GPU 3 replaced").
pub fn uncordon_reason(reason: Option<&str>) -> String {
    let who = operator();
    match reason.map(str::trim).filter(|r| !r.is_empty()) {
        Some(r) => format!("{who}: {r}"),
        None => format!("{who}: lifted with `warden uncordon`"),
    }
}

/// Prints the answer to Uncordon: "cordon lifted" or "node was not
/// cordoned"; `{"was_cordoned": bool}` with `--json`.
pub fn print_uncordon(r: &pb::UncordonResponse, as_json: bool) -> std::io::Result<()> {
    if as_json {
        outln!("{}", json!({ "was_cordoned": r.was_cordoned }))?;
    } else if r.was_cordoned {
        outln!("cordon lifted")?;
    } else {
        outln!("node was not cordoned")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(seconds: i64, nanos: i32) -> Option<prost_types::Timestamp> {
        Some(prost_types::Timestamp { seconds, nanos })
    }

    fn xid_incident() -> pb::Incident {
        pb::Incident {
            id: "inc-42".into(),
            opened_at: ts(1_700_000_000, 0),
            updated_at: ts(1_700_000_003, 0),
            kind: "crash".into(),
            host: "node7".into(),
            job_id: "j1".into(),
            ranks: vec![1, 3],
            devices: vec!["gpu1".into()],
            diagnosis: Some(pb::Diagnosis {
                fault_class: pb::FaultClass::UncorrectableHardware as i32,
                confidence: 0.954,
                summary: "XID 79 on gpu1: GPU has fallen off the bus".into(),
                rule: "xid.fatal".into(),
                evidence: (0..7u32)
                    .map(|n| pb::Evidence {
                        at: ts(1_700_000_000, 250_000_000),
                        source: "kmsg".into(),
                        signal: "xid".into(),
                        subject: "gpu1".into(),
                        value: format!("{}", 79 + n),
                        points_to: pb::FaultClass::UncorrectableHardware as i32,
                        note: format!("note {n}"),
                        event_id: 100 + u64::from(n),
                    })
                    .collect(),
            }),
            decision: Some(pb::Decision {
                action: pb::Action::Cordon as i32,
                reason: "uncorrectable hardware".into(),
                decided_by: "policy".into(),
                attempt: 1,
                budget: 3,
                backoff: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: 0,
                }),
                exit_code: 75,
                decided_at: ts(1_700_000_001, 0),
                replace: None,
            }),
            superseded: vec![pb::Decision {
                action: pb::Action::RestartInJob as i32,
                decided_by: "policy".into(),
                ..Default::default()
            }],
            waited_on: Vec::new(),
        }
    }

    #[test]
    fn enum_names_are_snake_case() {
        let classes = [
            (pb::FaultClass::Unspecified, "unspecified"),
            (pb::FaultClass::UserError, "user_error"),
            (pb::FaultClass::TransientSoftware, "transient_software"),
            (pb::FaultClass::CorrectableHardware, "correctable_hardware"),
            (
                pb::FaultClass::UncorrectableHardware,
                "uncorrectable_hardware",
            ),
            (pb::FaultClass::Infrastructure, "infrastructure"),
            (pb::FaultClass::Unknown, "unknown"),
        ];
        for (c, name) in classes {
            assert_eq!(fault_class_name(c as i32), name);
        }
        let actions = [
            (pb::Action::Unspecified, "unspecified"),
            (pb::Action::Continue, "continue"),
            (pb::Action::Stop, "stop"),
            (pb::Action::RestartInProcess, "restart_in_process"),
            (pb::Action::RestartInJob, "restart_in_job"),
            (pb::Action::Cordon, "cordon"),
            (pb::Action::ScaleDown, "scale_down"),
        ];
        for (a, name) in actions {
            assert_eq!(action_name(a as i32), name);
        }
        assert_eq!(fault_class_name(99), "unspecified");
        assert_eq!(action_name(-1), "unspecified");
    }

    #[test]
    fn json_has_names_times_and_nulls() {
        let mut bare = xid_incident();
        bare.diagnosis = None;
        bare.decision = None;
        bare.updated_at = None;
        let doc = incidents_json(&pb::GetIncidentsResponse {
            incidents: vec![xid_incident(), bare],
            cordoned: true,
        });
        assert_eq!(doc["cordoned"], true);
        let i = &doc["incidents"][0];
        assert_eq!(i["opened_at"], "2023-11-14T22:13:20.000Z");
        assert_eq!(i["ranks"], json!([1, 3]));
        assert_eq!(i["diagnosis"]["fault_class"], "uncorrectable_hardware");
        assert_eq!(
            i["diagnosis"]["evidence"][0]["at"],
            "2023-11-14T22:13:20.250Z"
        );
        assert_eq!(
            i["diagnosis"]["evidence"][0]["points_to"],
            "uncorrectable_hardware"
        );
        assert_eq!(i["decision"]["action"], "cordon");
        assert_eq!(i["decision"]["backoff_seconds"], 30.0);
        assert_eq!(i["superseded"][0]["action"], "restart_in_job");
        assert_eq!(i["superseded"][0]["decided_at"], Value::Null);
        let bare = &doc["incidents"][1];
        assert_eq!(bare["diagnosis"], Value::Null);
        assert_eq!(bare["decision"], Value::Null);
        assert_eq!(bare["updated_at"], Value::Null);
    }

    #[test]
    fn empty_listing_says_so() {
        let empty = pb::GetIncidentsResponse::default();
        assert_eq!(render_incidents(&empty, None, false), "no incidents\n");
        assert_eq!(
            render_incidents(&empty, Some("j9"), false),
            "no incidents for job j9\n"
        );
        assert_eq!(
            incidents_json(&empty),
            json!({"incidents": [], "cordoned": false})
        );
        let cordoned = pb::GetIncidentsResponse {
            incidents: vec![],
            cordoned: true,
        };
        let text = render_incidents(&cordoned, None, false);
        assert!(text.starts_with("node is CORDONED: "), "{text}");
        assert!(text.ends_with("no incidents\n"), "{text}");
    }

    #[test]
    fn text_has_header_diagnosis_decision_and_evidence() {
        let r = pb::GetIncidentsResponse {
            incidents: vec![xid_incident()],
            cordoned: true,
        };
        let text = render_incidents(&r, None, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "node is CORDONED: inc-42 since 2023-11-14T22:13:21Z: XID 79 on gpu1: GPU has fallen off the bus",
            "{text}"
        );
        let header = lines
            .iter()
            .position(|l| l.contains("inc-42  crash"))
            .unwrap_or_else(|| panic!("no header:\n{text}"));
        assert_eq!(
            lines[header],
            "2023-11-14T22:13:20Z  inc-42  crash  job j1  ranks 1,3  on gpu1  host node7"
        );
        assert_eq!(
            lines[header + 1],
            "  uncorrectable_hardware (95%): XID 79 on gpu1: GPU has fallen off the bus"
        );
        assert_eq!(
            lines[header + 2],
            "  decision: cordon by policy: uncorrectable hardware (attempt 1/3, backoff 30s, exit code 75)"
        );
        assert!(lines[header + 3].trim_start().starts_with("AT"), "{text}");
        let evidence: Vec<&&str> = lines
            .iter()
            .filter(|l| l.starts_with("    ") && l.contains("kmsg"))
            .collect();
        assert_eq!(evidence.len(), EVIDENCE_SHOWN, "{text}");
        assert!(text.contains("... 2 more"), "{text}");
        assert!(!text.contains("superseded"), "{text}");

        let verbose = render_incidents(&r, None, true);
        let evidence = verbose
            .lines()
            .filter(|l| l.starts_with("    ") && l.contains("kmsg"))
            .count();
        assert_eq!(evidence, 7, "{verbose}");
        assert!(verbose.contains("[rule xid.fatal]"), "{verbose}");
        assert!(
            verbose.contains("superseded (-): restart_in_job by policy"),
            "{verbose}"
        );
        assert!(verbose.contains("106"), "event ids: {verbose}");
    }

    #[test]
    fn undiagnosed_node_level_incident() {
        let i = pb::Incident {
            id: "inc-1".into(),
            kind: "hardware".into(),
            ..Default::default()
        };
        let text = render_incident(&i, false);
        assert_eq!(
            text,
            "-  inc-1  hardware  node-level\n  not diagnosed yet\n  decision: none yet\n  evidence: none\n"
        );
    }

    #[test]
    fn uncordon_reason_names_the_operator() {
        let r = uncordon_reason(Some("GPU swapped"));
        assert!(r.ends_with(": GPU swapped") && r.len() > 13, "{r}");
        let r = uncordon_reason(Some("  "));
        assert!(r.ends_with(": lifted with `warden uncordon`"), "{r}");
    }
}
