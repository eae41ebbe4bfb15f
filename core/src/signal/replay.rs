//! Recorded events back into signals, for replaying recorded scenarios
//! (tests/fixtures/incidents/scenarios.toml) through attribution.
//!
//! In: a recorded kind, subject, severity and evidence. Out: the signal
//! that renders as that event (fields a recording leaves out take their
//! empty value). Never: used on a runtime path (tests only): the agent's
//! parts publish signals, they never parse events.

use std::collections::BTreeMap;

use super::Severity;
use super::{
    GpuProcesses, HangFacts, HangVerdict, HealthChanged, OomKill, RankException, RankExited,
    RankHang, RankRegistered, Report, SdcSuspect, Signal, Straggler, Xid, XidSource,
};
use crate::health::{Reason, ReasonKind, Status};
use crate::rank::{ExitInfo, RankKey, RankState};
use crate::verdict::Blame;
use crate::verdict::FaultClass;

/// Parses the `job/J/rank/R` subject of a rank event.
pub fn rank_subject(subject: &str) -> Option<RankKey> {
    let rest = subject.strip_prefix("job/")?;
    let (job, rank) = rest.rsplit_once("/rank/")?;
    Some(RankKey {
        job: job.to_owned(),
        rank: rank.parse().ok()?,
    })
}

fn status(s: &str) -> Status {
    match s {
        "OK" => Status::Ok,
        "DEGRADED" => Status::Degraded,
        "FAILED" => Status::Failed,
        "ABSENT" => Status::Absent,
        _ => Status::Unknown,
    }
}

/// The signal a recorded event stands for; None for a kind replay does
/// not know or a rank event whose subject names no rank.
pub fn signal_of(
    kind: &str,
    subject: &str,
    severity: Severity,
    ev: &BTreeMap<String, String>,
) -> Option<Signal> {
    let get = |k: &str| ev.get(k).cloned().unwrap_or_default();
    let num = |k: &str| ev.get(k).and_then(|v| v.parse::<u64>().ok());
    let n32 = |k: &str| ev.get(k).and_then(|v| v.parse::<u32>().ok());
    let ranks =
        |k: &str| -> Vec<u32> { get(k).split(',').filter_map(|r| r.parse().ok()).collect() };
    let report = || Report {
        message: String::new(),
        evidence: ev.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    };
    Some(match kind {
        "rank.registered" => Signal::RankRegistered(RankRegistered {
            key: rank_subject(subject)?,
            pid: n32("pid").unwrap_or(0),
            declared_pid: n32("pid").unwrap_or(0),
            local_rank: n32("local_rank").unwrap_or(0),
            world_size: n32("world_size").unwrap_or(0),
            host: get("host"),
            slot: 0,
            declared_devices: ev
                .get("devices")
                .map(|d| vec![d.clone()])
                .unwrap_or_default(),
            replaced_pid: None,
            by_self: get("registered_by") != "launcher",
        }),
        "rank.exception" => Signal::RankException(RankException {
            key: rank_subject(subject)?,
            exception_type: get("exception_type"),
            message: get("message"),
            step: num("step"),
            pid: n32("pid").unwrap_or(0),
            generation: 0,
            uncaught: get("uncaught") == "true",
            traceback: get("traceback"),
            awaits_decision: get("awaits_decision") == "true",
        }),
        "rank.exited" => Signal::RankExited(RankExited {
            key: rank_subject(subject)?,
            pid: n32("pid").unwrap_or(0),
            declared_pid: n32("pid").unwrap_or(0),
            step: num("step"),
            section: get("section"),
            // A recording at Info is a stop by the launcher.
            state_before: if severity == Severity::Info {
                RankState::Stopping
            } else {
                RankState::Running
            },
            exit: ExitInfo {
                code: ev.get("exit_code").and_then(|v| v.parse().ok()),
                signal: ev.get("signal").and_then(|v| v.parse().ok()),
                source: get("status_source"),
            },
            stopped_by: None,
        }),
        "rank.deregistered" => Signal::RankDeregistered {
            key: rank_subject(subject)?,
        },
        "rank.hang" => Signal::RankHang(RankHang {
            key: rank_subject(subject)?,
            facts: HangFacts {
                step: num("step").unwrap_or(0),
                section: get("section"),
                pattern: get("pattern"),
                process_state: get("process_state"),
                wchan: get("wchan"),
            },
            report: report(),
            stack_requested: false,
        }),
        "rank.straggler" => Signal::RankStraggler(Straggler {
            key: rank_subject(subject)?,
            section: get("section"),
            relative: get("relative"),
            explanation: get("explanation"),
            cause: match get("cause_class").as_str() {
                "correctable_hardware" => FaultClass::CorrectableHardware,
                "uncorrectable_hardware" => FaultClass::UncorrectableHardware,
                "infrastructure" => FaultClass::Infrastructure,
                _ => FaultClass::Unknown,
            },
            report: report(),
        }),
        "rank.sdc_suspect" => Signal::RankSdcSuspect(SdcSuspect {
            key: rank_subject(subject)?,
            step: num("step").unwrap_or(0),
            metric: get("metric"),
            value: get("value").parse().unwrap_or(f64::NAN),
            job_median: get("job_median").parse().ok(),
            score: get("score").parse().ok(),
            basis: get("basis"),
            report: report(),
        }),
        "job.hang_verdict" => Signal::HangVerdict(HangVerdict {
            job: subject.strip_prefix("job/")?.to_owned(),
            host: get("host"),
            culprits: get("culprits")
                .split(',')
                .filter_map(|c| {
                    let (rank, host) = c.split_once('@')?;
                    Some(Blame {
                        rank: rank.parse().ok()?,
                        host: host.to_owned(),
                        why: get(&format!("why.{rank}")),
                    })
                })
                .collect(),
            waiting: ranks("waiting"),
            missing: ranks("missing"),
            hosts: get("hosts")
                .split(',')
                .filter(|h| !h.is_empty())
                .map(str::to_owned)
                .collect(),
            summary: String::new(),
            hang_event: num("hang_event").unwrap_or(0),
        }),
        "gpu.xid" | "kmsg.xid" => Signal::Xid(Xid {
            source: if kind == "gpu.xid" {
                XidSource::Nvml
            } else {
                XidSource::Kmsg
            },
            severity,
            component: subject.to_owned(),
            xid: num("xid")?,
            pid: n32("pid"),
            report: report(),
        }),
        "gpu.processes" => Signal::GpuProcesses(GpuProcesses {
            component: subject.to_owned(),
            pids: get("pids")
                .split(',')
                .filter_map(|p| p.parse().ok())
                .collect(),
        }),
        "kmsg.oom_kill" => Signal::OomKill(OomKill {
            component: subject.to_owned(),
            pid: n32("pid").unwrap_or(0),
            process: get("process"),
            line: get("line"),
        }),
        // The reason's kind as its source set it (a recording without one:
        // a judged finding; one this code does not know: no signal).
        "health.changed" => Signal::HealthChanged(HealthChanged {
            component: subject.to_owned(),
            from: ev.get("from").filter(|f| *f != "NEW").map(|f| status(f)),
            to: status(&get("to")),
            reason: match ev.get("signal") {
                None => None,
                Some(signal) => Some(Reason {
                    status: status(&get("to")),
                    kind: match ev.get("reason_kind") {
                        Some(k) => ReasonKind::parse(k)?,
                        None => ReasonKind::Judged,
                    },
                    signal: signal.clone(),
                    value: get("value"),
                    threshold: ev.get("threshold").cloned().unwrap_or_else(|| "-".into()),
                    window: get("window"),
                    since: std::time::SystemTime::UNIX_EPOCH,
                    message: String::new(),
                }),
            },
        }),
        _ => return None,
    })
}
