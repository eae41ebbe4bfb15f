//! Every typed signal renders to the kind, severity, subject, message and
//! evidence its producer published before signals were typed (a table).

use std::time::Duration;

use super::*;
use crate::events::NewEvent;
use crate::health::Reason;

fn key() -> RankKey {
    RankKey {
        job: "j".into(),
        rank: 3,
    }
}

fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// An incident as attribution records it: a crash of rank 1, restarted.
fn incident() -> std::sync::Arc<IncidentRecord> {
    use crate::attribute::{Diagnosis, Evidence, IncidentKind};
    use crate::policy::{Action, Decision};
    let t = std::time::SystemTime::UNIX_EPOCH;
    std::sync::Arc::new(IncidentRecord {
        id: "inc-7".into(),
        opened_at: t,
        updated_at: t,
        kind: IncidentKind::Crash,
        host: "h".into(),
        job: "j".into(),
        ranks: vec![1, 2],
        devices: vec!["gpu1".into()],
        diagnosis: Diagnosis {
            class: FaultClass::TransientSoftware,
            confidence: 0.8,
            summary: "rank 1 crashed".into(),
            rule: "exit".into(),
            evidence: vec![Evidence {
                at: t,
                source: "rank".into(),
                signal: "exit.code".into(),
                subject: "job/j/rank/1".into(),
                value: "1".into(),
                points_to: Some(FaultClass::TransientSoftware),
                weight: 0.5,
                note: "non-zero exit".into(),
                event_id: 0,
            }],
        },
        decision: Some(Decision {
            action: Action::RestartInJob,
            reason: "restart 1 of 3".into(),
            decided_by: "policy".into(),
            attempt: 1,
            budget: 3,
            backoff: Duration::from_secs(2),
            exit_code: 0,
            decided_at: t,
            dry_run: false,
            replace: None,
        }),
        superseded: Vec::new(),
        signature: "exit:1".into(),
        step: Some(4),
        exit_code: Some(1),
        waited_on: Vec::new(),
    })
}

struct Case {
    signal: Signal,
    severity: Severity,
    kind: &'static str,
    subject: &'static str,
    message: &'static str,
    evidence: Vec<(String, String)>,
}

fn exited(state_before: RankState, code: Option<i32>, signal: Option<i32>) -> RankExited {
    RankExited {
        key: key(),
        pid: 10,
        declared_pid: 11,
        step: Some(7),
        section: "backward".into(),
        state_before,
        exit: ExitInfo {
            code,
            signal,
            source: "src".into(),
        },
        stopped_by: (state_before == RankState::Stopping).then(|| StopReason {
            kind: StopKind::JobEnding,
            why: "job ending: finished".into(),
        }),
    }
}

fn cases() -> Vec<Case> {
    let report = Report::new("headline").with("a", 1).with("b", "two");
    vec![
        Case {
            signal: Signal::RankRegistered(RankRegistered {
                key: key(),
                pid: 0,
                declared_pid: 42,
                local_rank: 1,
                world_size: 4,
                host: "h".into(),
                slot: 5,
                declared_devices: Vec::new(),
                replaced_pid: Some(9),
                by_self: false,
            }),
            severity: Severity::Info,
            kind: "rank.registered",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 registered (pid 42 in a PID namespace the agent cannot see: its exit and process state are not watched, slot 5)",
            evidence: kv(&[
                ("pid", "0"),
                ("declared_pid", "42"),
                ("local_rank", "1"),
                ("world_size", "4"),
                ("host", "h"),
                ("slot", "5"),
                ("registered_by", "launcher"),
                ("devices", "gpu1"),
                ("devices_from", "local_rank (the client named none)"),
                ("replaced_pid", "9"),
            ]),
        },
        Case {
            signal: Signal::RankRegistered(RankRegistered {
                key: key(),
                pid: 42,
                declared_pid: 42,
                local_rank: 1,
                world_size: 4,
                host: "h".into(),
                slot: 5,
                declared_devices: vec!["gpu0".into(), "gpu1".into()],
                replaced_pid: None,
                by_self: true,
            }),
            severity: Severity::Info,
            kind: "rank.registered",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 registered (pid 42, slot 5)",
            evidence: kv(&[
                ("pid", "42"),
                ("declared_pid", "42"),
                ("local_rank", "1"),
                ("world_size", "4"),
                ("host", "h"),
                ("slot", "5"),
                ("registered_by", "self"),
                ("devices", "gpu0,gpu1"),
                ("devices_from", "client"),
            ]),
        },
        Case {
            signal: Signal::RankException(RankException {
                key: key(),
                exception_type: "ValueError".into(),
                message: "bad\nmore".into(),
                step: Some(3),
                pid: 10,
                generation: 2,
                uncaught: true,
                traceback: "tb".into(),
                awaits_decision: false,
            }),
            severity: Severity::Error,
            kind: "rank.exception",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 dies of ValueError: bad",
            evidence: kv(&[
                ("exception_type", "ValueError"),
                ("message", "bad\nmore"),
                ("step", "3"),
                ("pid", "10"),
                ("generation", "2"),
                ("uncaught", "true"),
                ("traceback", "tb"),
                ("awaits_decision", "false"),
            ]),
        },
        Case {
            signal: Signal::RankExited(exited(RankState::Running, Some(1), None)),
            severity: Severity::Error,
            kind: "rank.exited",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 (pid 10) exited with code 1 at step 7 in 'backward' without deregistering",
            evidence: kv(&[
                ("pid", "10"),
                ("declared_pid", "11"),
                ("step", "7"),
                ("section", "backward"),
                ("state_before", "running"),
                ("status_source", "src"),
                ("exit_code", "1"),
            ]),
        },
        Case {
            signal: Signal::RankExited(RankExited {
                step: None,
                ..exited(RankState::Running, Some(3), None)
            }),
            severity: Severity::Error,
            kind: "rank.exited",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 (pid 10) exited with code 3 without deregistering; no step reported (no client)",
            evidence: kv(&[
                ("pid", "10"),
                ("declared_pid", "11"),
                ("step", "unknown"),
                ("section", "backward"),
                ("state_before", "running"),
                ("status_source", "src"),
                ("exit_code", "3"),
            ]),
        },
        Case {
            signal: Signal::RankExited(exited(RankState::Running, None, Some(9))),
            severity: Severity::Error,
            kind: "rank.exited",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 (pid 10) was killed by signal 9 (SIGKILL) at step 7 in 'backward' without deregistering",
            evidence: kv(&[
                ("pid", "10"),
                ("declared_pid", "11"),
                ("step", "7"),
                ("section", "backward"),
                ("state_before", "running"),
                ("status_source", "src"),
                ("signal", "9"),
            ]),
        },
        Case {
            signal: Signal::RankExited(exited(RankState::Stopping, None, Some(15))),
            severity: Severity::Info,
            kind: "rank.exited",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 (pid 10) was stopped by its launcher (signal 15) at step 7 in 'backward' without deregistering",
            evidence: kv(&[
                ("pid", "10"),
                ("declared_pid", "11"),
                ("step", "7"),
                ("section", "backward"),
                ("state_before", "stopping"),
                ("status_source", "src"),
                ("signal", "15"),
                ("stopped_by", "launcher: job ending: finished"),
            ]),
        },
        Case {
            signal: Signal::RankExited(exited(RankState::Running, Some(0), None)),
            severity: Severity::Info,
            kind: "rank.exited",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 (pid 10) exited with code 0 at step 7 in 'backward' without deregistering",
            evidence: kv(&[
                ("pid", "10"),
                ("declared_pid", "11"),
                ("step", "7"),
                ("section", "backward"),
                ("state_before", "running"),
                ("status_source", "src"),
                ("exit_code", "0"),
            ]),
        },
        Case {
            signal: Signal::RankDeregistered { key: key() },
            severity: Severity::Info,
            kind: "rank.deregistered",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 left cleanly",
            evidence: Vec::new(),
        },
        Case {
            signal: Signal::RankHang(RankHang {
                key: key(),
                facts: HangFacts::default(),
                report: report.clone(),
                stack_requested: true,
            }),
            severity: Severity::Error,
            kind: "rank.hang",
            subject: "job/j/rank/3",
            message: "headline",
            evidence: kv(&[
                ("a", "1"),
                ("b", "two"),
                ("stack", "requested: follows as a rank.stack event"),
            ]),
        },
        Case {
            signal: Signal::RankRecovered {
                key: key(),
                step: 4,
                pid: 10,
            },
            severity: Severity::Info,
            kind: "rank.recovered",
            subject: "job/j/rank/3",
            message: "job/j/rank/3 makes progress again (step 4)",
            evidence: kv(&[("step", "4"), ("pid", "10")]),
        },
        Case {
            signal: Signal::RankStraggler(Straggler {
                key: key(),
                section: "fwd".into(),
                relative: "1.50".into(),
                explanation: "x".into(),
                cause: FaultClass::Unknown,
                report: report.clone(),
            }),
            severity: Severity::Warning,
            kind: "rank.straggler",
            subject: "job/j/rank/3",
            message: "headline",
            evidence: kv(&[("a", "1"), ("b", "two")]),
        },
        Case {
            signal: Signal::RankStragglerCleared {
                key: key(),
                report: report.clone(),
            },
            severity: Severity::Info,
            kind: "rank.straggler_cleared",
            subject: "job/j/rank/3",
            message: "headline",
            evidence: kv(&[("a", "1"), ("b", "two")]),
        },
        Case {
            signal: Signal::RankSdcSuspect(SdcSuspect {
                key: key(),
                step: 30,
                metric: "grad_norm".into(),
                value: 150.0,
                job_median: Some(1.5),
                score: Some(99.0),
                basis: "own_history".into(),
                report: report.clone(),
            }),
            severity: Severity::Warning,
            kind: "rank.sdc_suspect",
            subject: "job/j/rank/3",
            message: "headline",
            evidence: kv(&[("a", "1"), ("b", "two")]),
        },
        Case {
            signal: Signal::RestartRequested(RestartRequested {
                job: "j".into(),
                seq: 2,
                restart_count: 1,
                ranks: vec![0, 1],
                incident: "inc-1".into(),
                reason: "why".into(),
                timeout: Duration::from_secs(30),
            }),
            severity: Severity::Warning,
            kind: "restart.requested",
            subject: "job/j",
            message: "job j: ranks 0,1 asked to restart in process (restart 1, seq 2): why",
            evidence: kv(&[
                ("seq", "2"),
                ("restart_count", "1"),
                ("ranks", "0,1"),
                ("incident", "inc-1"),
                ("reason", "why"),
                ("timeout", "30s"),
            ]),
        },
        Case {
            signal: Signal::CkptSaved(CkptSaved {
                subject: "ckpt/j/3/7".into(),
                shard: "j/3@7".into(),
                job: "j".into(),
                rank: 3,
                step: 7,
                stall_ms: 1.23456,
                bytes: 100,
                xxh3: "ab".into(),
            }),
            severity: Severity::Info,
            kind: "ckpt.saved",
            subject: "ckpt/j/3/7",
            message: "j/3@7 saved (100 bytes, 1.23 ms of the step)",
            evidence: kv(&[
                ("job_id", "j"),
                ("rank", "3"),
                ("step", "7"),
                ("stall_ms", "1.235"),
                ("bytes", "100"),
                ("xxh3", "ab"),
            ]),
        },
        Case {
            signal: Signal::CkptRestored(CkptRestored {
                subject: "ckpt/j/3/7".into(),
                shard: "j/3@7".into(),
                job: "j".into(),
                rank: 3,
                step: 7,
                duration_ms: 12.34,
                tier: "local".into(),
                source: "/p".into(),
                bytes: 100,
            }),
            severity: Severity::Info,
            kind: "ckpt.restored",
            subject: "ckpt/j/3/7",
            message: "j/3@7 restored from the local tier (/p) in 12.3 ms",
            evidence: kv(&[
                ("job_id", "j"),
                ("rank", "3"),
                ("step", "7"),
                ("duration_ms", "12.340"),
                ("tier", "local"),
                ("source", "/p"),
                ("bytes", "100"),
            ]),
        },
        Case {
            signal: Signal::Xid(Xid {
                source: XidSource::Kmsg,
                severity: Severity::Critical,
                component: "gpu1".into(),
                xid: 79,
                pid: None,
                report: report.clone(),
            }),
            severity: Severity::Critical,
            kind: "kmsg.xid",
            subject: "gpu1",
            message: "headline",
            evidence: kv(&[("a", "1"), ("b", "two")]),
        },
        Case {
            signal: Signal::Xid(Xid {
                source: XidSource::Nvml,
                severity: Severity::Warning,
                component: "gpu1".into(),
                xid: 13,
                pid: None,
                report: report.clone(),
            }),
            severity: Severity::Warning,
            kind: "gpu.xid",
            subject: "gpu1",
            message: "headline",
            evidence: kv(&[("a", "1"), ("b", "two")]),
        },
        Case {
            signal: Signal::OomKill(OomKill {
                component: "host/oom".into(),
                pid: 5,
                process: "python".into(),
                line: "l".into(),
            }),
            severity: Severity::Error,
            kind: "kmsg.oom_kill",
            subject: "host/oom",
            message: "the kernel's OOM killer killed process 5 (python)",
            evidence: kv(&[("pid", "5"), ("process", "python"), ("line", "l")]),
        },
        Case {
            signal: Signal::GpuProcesses(GpuProcesses {
                component: "gpu2".into(),
                pids: vec![7, 9],
            }),
            severity: Severity::Info,
            kind: "gpu.processes",
            subject: "gpu2",
            message: "processes 7, 9 hold a compute context on gpu2 (NVML)",
            evidence: kv(&[("pids", "7,9")]),
        },
        Case {
            signal: Signal::GateFailed(GateFailed {
                ran: "nvml".into(),
                duration: "1s".into(),
                job: "j".into(),
                note: "n".into(),
                failures: vec![
                    GateFailure {
                        test: "t1".into(),
                        entity: "gpu0".into(),
                        message: "m1".into(),
                        severity: "isolate".into(),
                    },
                    GateFailure {
                        test: "t2".into(),
                        entity: "gpu1".into(),
                        message: "m2".into(),
                        severity: "reset".into(),
                    },
                ],
            }),
            severity: Severity::Critical,
            kind: "gate.failed",
            subject: "gpu0",
            message: "health gate failed (nvml): t1 on gpu0: m1; t2 on gpu1: m2",
            evidence: kv(&[
                ("ran", "nvml"),
                ("duration", "1s"),
                ("job", "j"),
                ("note", "n"),
                ("test", "t1"),
                ("entity", "gpu0"),
                ("message", "m1"),
                ("severity", "isolate"),
            ]),
        },
        Case {
            signal: Signal::HealthChanged(HealthChanged {
                component: "gpu0".into(),
                from: Some(Status::Ok),
                to: Status::Degraded,
                reason: Some(Reason {
                    status: Status::Degraded,
                    kind: crate::health::ReasonKind::Judged,
                    signal: "gpu.temp".into(),
                    value: "90C".into(),
                    threshold: "85C".into(),
                    window: "1m".into(),
                    since: std::time::SystemTime::UNIX_EPOCH,
                    message: "hot".into(),
                }),
            }),
            severity: Severity::Warning,
            kind: "health.changed",
            subject: "gpu0",
            message: "gpu0 OK -> DEGRADED: hot",
            evidence: kv(&[
                ("from", "OK"),
                ("to", "DEGRADED"),
                ("signal", "gpu.temp"),
                ("value", "90C"),
                ("threshold", "85C"),
                ("window", "1m"),
            ]),
        },
        Case {
            signal: Signal::HealthChanged(HealthChanged {
                component: "gpu1".into(),
                from: Some(Status::Ok),
                to: Status::Failed,
                reason: Some(Reason {
                    status: Status::Failed,
                    kind: crate::health::ReasonKind::Xid,
                    signal: "gpu.xid".into(),
                    value: "79".into(),
                    threshold: String::new(),
                    window: String::new(),
                    since: std::time::SystemTime::UNIX_EPOCH,
                    message: "XID 79 on this GPU".into(),
                }),
            }),
            severity: Severity::Error,
            kind: "health.changed",
            subject: "gpu1",
            message: "gpu1 OK -> FAILED: XID 79 on this GPU",
            evidence: kv(&[
                ("from", "OK"),
                ("to", "FAILED"),
                ("signal", "gpu.xid"),
                ("value", "79"),
                ("threshold", ""),
                ("reason_kind", "xid"),
            ]),
        },
        Case {
            signal: Signal::HealthChanged(HealthChanged {
                component: "gpu0".into(),
                from: None,
                to: Status::Failed,
                reason: None,
            }),
            severity: Severity::Error,
            kind: "health.changed",
            subject: "gpu0",
            message: "gpu0 NEW -> FAILED",
            evidence: kv(&[("from", "NEW"), ("to", "FAILED")]),
        },
        Case {
            signal: Signal::IncidentDiagnosed(incident()),
            severity: Severity::Error,
            kind: "incident.diagnosed",
            subject: "inc-7",
            message: "inc-7: transient_software (80%): rank 1 crashed",
            evidence: kv(&[
                ("kind", "crash"),
                ("class", "transient_software"),
                ("confidence", "0.80"),
                ("rule", "exit"),
                ("job", "j"),
                ("ranks", "1,2"),
                ("devices", "gpu1"),
                ("revision", "1"),
                (
                    "evidence.1",
                    "rank job/j/rank/1 exit.code=1 -> transient_software (non-zero exit)",
                ),
            ]),
        },
        Case {
            signal: Signal::IncidentDecided(incident()),
            severity: Severity::Error,
            kind: "incident.decided",
            subject: "inc-7",
            message: "inc-7: restart_in_job (restart 1 of 3)",
            evidence: kv(&[
                ("action", "restart_in_job"),
                ("reason", "restart 1 of 3"),
                ("decided_by", "policy"),
                ("attempt", "1"),
                ("budget", "3"),
                ("backoff", "2s"),
                ("exit_code", "0"),
                ("class", "transient_software"),
                ("job", "j"),
            ]),
        },
        Case {
            signal: Signal::IncidentDecided(std::sync::Arc::new(IncidentRecord {
                decision: incident()
                    .decision
                    .clone()
                    .map(|d| crate::policy::Decision {
                        action: crate::policy::Action::RestartInProcess,
                        reason: "rank 1 frozen".into(),
                        replace: Some(crate::policy::Replacement {
                            ranks: vec![1],
                            restart_count: 2,
                        }),
                        ..d
                    }),
                ..(*incident()).clone()
            })),
            severity: Severity::Error,
            kind: "incident.decided",
            subject: "inc-7",
            message: "inc-7: restart_in_process (rank 1 frozen)",
            evidence: kv(&[
                ("action", "restart_in_process"),
                ("reason", "rank 1 frozen"),
                ("decided_by", "policy"),
                ("attempt", "1"),
                ("budget", "3"),
                ("backoff", "2s"),
                ("exit_code", "0"),
                ("class", "transient_software"),
                ("job", "j"),
                ("replace_ranks", "1"),
                ("replace_restart_count", "2"),
            ]),
        },
        Case {
            signal: Signal::Notice(
                NewEvent::new(Severity::Info, "agent.started", "agent", "up").with("k", "v"),
            ),
            severity: Severity::Info,
            kind: "agent.started",
            subject: "agent",
            message: "up",
            evidence: kv(&[("k", "v")]),
        },
    ]
}

#[test]
fn every_signal_renders_as_before() {
    let mut kinds_seen = std::collections::BTreeSet::new();
    for c in cases() {
        let e = c.signal.render();
        assert_eq!(e.kind, c.kind);
        assert_eq!(c.signal.kind(), c.kind);
        assert_eq!(e.severity, c.severity, "{}", c.kind);
        assert_eq!(e.subject, c.subject, "{}", c.kind);
        assert_eq!(e.message, c.message, "{}", c.kind);
        assert_eq!(e.evidence, c.evidence, "{}", c.kind);
        kinds_seen.insert(c.kind);
    }
    for k in TYPED_KINDS {
        assert!(kinds_seen.contains(k), "no rendering case for {k}");
    }
}

#[test]
fn a_reasons_kind_is_recorded_and_replayed() {
    use crate::health::ReasonKind;
    let ev = |kind: Option<&str>| {
        let mut e: std::collections::BTreeMap<String, String> = [
            ("from", "OK"),
            ("to", "FAILED"),
            ("signal", "dcgm.gpu_recovery_reset"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        if let Some(k) = kind {
            e.insert("reason_kind".into(), k.into());
        }
        super::replay::signal_of("health.changed", "gpu0", Severity::Error, &e)
    };
    let kind_of = |s: Option<Signal>| match s {
        Some(Signal::HealthChanged(h)) => h.reason.map(|r| r.kind),
        _ => None,
    };
    for k in [
        ReasonKind::Judged,
        ReasonKind::Xid,
        ReasonKind::AboutXids,
        ReasonKind::DriverVerdict,
    ] {
        assert_eq!(kind_of(ev(Some(k.as_str()))), Some(k), "{k:?}");
    }
    // No kind recorded: a judged finding, whatever its name says.
    assert_eq!(kind_of(ev(None)), Some(ReasonKind::Judged));
    assert!(
        ev(Some("guessed")).is_none(),
        "an unknown kind is no signal"
    );
}

#[test]
fn rank_subjects_are_parsed() {
    use super::replay::rank_subject;
    let k = |job: &str, rank| {
        Some(RankKey {
            job: job.into(),
            rank,
        })
    };
    assert_eq!(rank_subject("job/a/rank/3"), k("a", 3));
    assert_eq!(rank_subject("job/a/rank/b/rank/3"), k("a/rank/b", 3));
    assert_eq!(rank_subject("job/a"), None);
    assert_eq!(rank_subject("agent"), None);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "typed signal")]
fn a_notice_of_a_typed_kind_is_refused() {
    let _ = Signal::from(NewEvent::new(Severity::Error, "rank.exited", "x", "y"));
}
