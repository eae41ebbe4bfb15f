//! System tests of heartbeats and hang detection with real processes: the
//! real `wardend`, and training ranks that are real Python processes running
//! the `warden` package (tests/fixtures/rank.py), stopped, killed, crashed and
//! hung the way trainers are.
//!
//! The test process is every rank's parent and leaves an exited rank a zombie
//! until the agent has reported it: the agent reads the exit status from the
//! zombie. Thresholds are made small (`hang.floor = 1s`, 5 warm-up samples,
//! steps of tens of milliseconds), so a calibrated rank is found hung within
//! about a second.
//!
//! The Python interpreter is `$WARDEN_TEST_PYTHON` (tests/run-all.sh sets it),
//! else the repository's `.venv/bin/python`; it must be able to `import warden`.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    Events, Streaming, TestAgent, WAIT, WARDEN, describe, eventually, evidence, http_get,
    proc_state, python_rank, run, spawn_python_rank, within,
};
use nix::sys::signal::Signal;
use serde_json::Value;
use warden_proto::v1 as pb;

// ------------------------------------------------------------------ harness

/// The agent's config for these tests: fast ticks, thresholds of about a
/// second once calibrated, state in `state`; `extra` goes after the `[hang]`
/// keys (more `[hang]` keys, or further tables).
fn config(state: &Path, extra: &str) -> String {
    format!(
        "[agent]\ntick = \"50ms\"\nstate_dir = \"{}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n{extra}",
        state.display()
    )
}

/// An agent with [`config`], and its state directory.
fn start_agent(extra: &str) -> (tempfile::TempDir, TestAgent) {
    let state = tempfile::Builder::new()
        .prefix("warden-state-")
        .tempdir()
        .expect("create a state directory");
    let agent = TestAgent::start(&config(state.path(), extra));
    (state, agent)
}

fn subject(job: &str, rank: u32) -> String {
    format!("job/{job}/rank/{rank}")
}

/// A rank: `tests/fixtures/rank.py` with `args`, registered as `rank` of
/// `world` in `job` (see [`Streaming`]: never reaped before the test says
/// so, since the agent reads exit statuses from the zombie).
type Rank = Streaming;

fn spawn_rank(agent: &TestAgent, job: &str, rank: u32, world: u32, args: &[&str]) -> Rank {
    let mut cmd = python_rank(agent, "tests/fixtures/rank.py", job, (rank, world), args);
    spawn_python_rank(agent, job, rank, &mut cmd)
}

/// Waits for the rank's "registered" line; checks it is this process.
fn wait_registered(rank: &mut Rank) {
    let line = rank.wait_line(WAIT, "registered", |l| l.starts_with("registered "));
    let pid = format!("pid={}", rank.pid());
    assert!(
        line.split_whitespace().any(|w| w == pid),
        "{}: {line}",
        rank.label
    );
}

/// Spawns `count` ranks of `job` with the same arguments and waits until
/// each has registered.
fn spawn_ranks(agent: &TestAgent, job: &str, count: u32, args: &[&str]) -> Vec<Rank> {
    let mut ranks: Vec<Rank> = (0..count)
        .map(|r| spawn_rank(agent, job, r, count, args))
        .collect();
    for r in &mut ranks {
        wait_registered(r);
    }
    ranks
}

/// Parses a duration as the agent formats evidence: "1.234s", "250ms".
fn parse_evidence_duration(s: &str) -> Duration {
    if let Some(ms) = s.strip_suffix("ms") {
        Duration::from_millis(ms.parse().unwrap_or_else(|e| panic!("{s:?}: {e}")))
    } else if let Some(secs) = s.strip_suffix('s') {
        Duration::from_secs_f64(secs.parse().unwrap_or_else(|e| panic!("{s:?}: {e}")))
    } else {
        panic!("not a duration as the agent writes them: {s:?}")
    }
}

fn to_std(d: Option<&prost_types::Duration>) -> Option<Duration> {
    d.map(|d| {
        Duration::new(
            u64::try_from(d.seconds).expect("a non-negative duration"),
            u32::try_from(d.nanos).expect("non-negative nanos"),
        )
    })
}

/// GetRanks for `job`.
async fn get_ranks(agent: &TestAgent, job: &str) -> Vec<pb::RankInfo> {
    within(WAIT, "GetRanks", async {
        agent
            .client()
            .await
            .get_ranks(pb::GetRanksRequest {
                job_id: job.to_owned(),
            })
            .await
    })
    .await
    .unwrap_or_else(|s| panic!("GetRanks: {s}\n--- wardend stderr ---\n{}", agent.stderr()))
    .into_inner()
    .ranks
}

fn rank_info(ranks: &[pb::RankInfo], rank: u32) -> &pb::RankInfo {
    ranks
        .iter()
        .find(|r| r.global_rank == rank)
        .unwrap_or_else(|| panic!("no rank {rank} in GetRanks: {ranks:#?}"))
}

/// A threshold that came from the job's history, not the defaults.
fn is_calibrated(source: &str) -> bool {
    (source.contains("p99") || source.starts_with("floor")) && !source.starts_with("default")
}

/// Waits until every one of the `count` ranks of `job` has completed at
/// least `steps` steps and has a calibrated threshold; returns GetRanks.
async fn wait_calibrated(
    agent: &TestAgent,
    job: &str,
    count: usize,
    steps: u64,
) -> Vec<pb::RankInfo> {
    eventually(
        WAIT,
        &format!("{count} ranks of {job} past {steps} steps with calibrated thresholds"),
        async || {
            let ranks = get_ranks(agent, job).await;
            (ranks.len() == count
                && ranks.iter().all(|r| {
                    r.state == "running"
                        && r.steps_completed >= steps
                        && is_calibrated(&r.hang_threshold_source)
                }))
            .then_some(ranks)
        },
    )
    .await
}

/// How many slot scans the agent's work loop has run (its Prometheus
/// `warden_scan_seconds` histogram).
fn scans(metrics_url: &str) -> f64 {
    let body = http_get(metrics_url);
    body.lines()
        .find(|l| l.starts_with("warden_scan_seconds_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no warden_scan_seconds_count in the metrics:\n{body}"))
}

/// Watches the agent for `window`: GetNodeHealth keeps answering, the
/// process is not a zombie, and the work loop, which scans the slots, keeps
/// turning (a panic in the scan or a deadlock on the registry stops it).
async fn assert_agent_stays_up(agent: &TestAgent, window: Duration, after: &str) {
    let url = within(WAIT, "GetAgentInfo", agent.metrics_url()).await;
    let before = scans(&url);
    let end = Instant::now() + window;
    while Instant::now() < end {
        let state = proc_state(agent.pid());
        assert!(
            matches!(state, Some(s) if s != 'Z' && s != 'X'),
            "wardend died {after} (state {state:?})\n--- wardend stderr ---\n{}",
            agent.stderr()
        );
        let health = within(
            Duration::from_secs(2),
            &format!("GetNodeHealth {after}"),
            async {
                agent
                    .client()
                    .await
                    .get_node_health(pb::GetNodeHealthRequest {})
                    .await
            },
        )
        .await;
        if let Err(status) = health {
            panic!(
                "GetNodeHealth failed {after}: {status}\n--- wardend stderr ---\n{}",
                agent.stderr()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A scan every 50 ms tick: about 40 in 2 s.
    let turned = scans(&url) - before;
    let expected = window.as_secs_f64() / 0.05;
    assert!(
        turned >= expected / 4.0,
        "only {turned} slot scans in {window:?} {after} (expected about {expected}): the work loop stalled\n--- wardend stderr ---\n{}",
        agent.stderr()
    );
}

/// Fast steps for calibration in tens of milliseconds.
const FAST: &[&str] = &["--step-ms", "20", "--step-max-ms", "40"];

// -------------------------------------------------------------------- tests

#[tokio::test]
async fn stopped_rank_is_hung_alone_then_recovers() {
    // A stopped process cannot write a stack dump: keep the wait for one
    // short (were the agent to hold rank.hang back for it, the event would
    // still come within threshold + 1 s). Straggler detection off: these
    // toy ranks step in 20-40 ms at random, so under load the running peer
    // can score as a straggler against its own best window, and a finding
    // in the same job joins the incident; this test is about the hang.
    let (_state, agent) =
        start_agent("stack_dump_wait = \"300ms\"\n[straggler]\nenabled = false\n");
    let job = "stop";
    let ranks = spawn_ranks(&agent, job, 2, FAST);
    wait_calibrated(&agent, job, 2, 20).await;
    let mut events = Events::live(&agent).await;

    ranks[0].signal(Signal::SIGSTOP);
    let stopped = Instant::now();
    let me = subject(job, 0);
    let hang = events
        .expect(&agent, WAIT, "rank.hang for the stopped rank", |e| {
            e.kind == "rank.hang" && e.subject == me
        })
        .await;
    let latency = stopped.elapsed();
    eprintln!("rank.hang {latency:?} after SIGSTOP");
    let ev = |key: &str| {
        evidence(&hang, key)
            .unwrap_or_else(|| panic!("no {key} in {}", describe(&hang)))
            .to_owned()
    };
    let threshold = parse_evidence_duration(&ev("threshold"));
    assert!(
        threshold <= Duration::from_secs(2),
        "a calibrated threshold of about the 1 s floor: {}",
        describe(&hang)
    );
    assert!(
        latency <= threshold + Duration::from_secs(1),
        "rank.hang came {latency:?} after SIGSTOP, threshold {threshold:?}: {}",
        describe(&hang)
    );
    assert_eq!(ev("pid"), ranks[0].pid().to_string(), "{}", describe(&hang));
    assert!(ev("process_state").starts_with('T'), "{}", describe(&hang));
    assert!(ev("cpu_advancing").starts_with("no"), "{}", describe(&hang));
    assert!(!ev("section").is_empty(), "{}", describe(&hang));
    ev("step")
        .parse::<u64>()
        .unwrap_or_else(|e| panic!("step: {e}: {}", describe(&hang)));
    assert!(
        is_calibrated(&ev("threshold_source")),
        "{}",
        describe(&hang)
    );
    assert!(
        ev("pattern").contains("stuck alone"),
        "the peer still progresses: {}",
        describe(&hang)
    );
    assert_eq!(
        hang.severity,
        pb::Severity::Error as i32,
        "{}",
        describe(&hang)
    );
    assert_eq!(
        events.count("rank.hang", &subject(job, 1)),
        0,
        "the running peer is not hung:\n{}",
        events.summary()
    );
    let info = get_ranks(&agent, job).await;
    assert_eq!(rank_info(&info, 0).state, "hung", "{info:#?}");
    assert_eq!(rank_info(&info, 1).state, "running", "{info:#?}");

    // Attribution: a rank hung alone is a transient fault of that rank;
    // the first remedy keeps the process (in-process restart).
    let diagnosed = events
        .expect(&agent, WAIT, "incident.diagnosed for the hang", |e| {
            e.kind == "incident.diagnosed"
        })
        .await;
    assert_eq!(
        evidence(&diagnosed, "ranks"),
        Some("0"),
        "{}",
        describe(&diagnosed)
    );
    assert_eq!(
        evidence(&diagnosed, "rule"),
        Some("hang.alone"),
        "{}",
        describe(&diagnosed)
    );

    let decided = events
        .expect(&agent, WAIT, "incident.decided for the hang", |e| {
            e.kind == "incident.decided"
        })
        .await;
    assert_eq!(
        evidence(&decided, "class"),
        Some("transient_software"),
        "{}",
        describe(&decided)
    );
    assert_eq!(
        evidence(&decided, "action"),
        Some("restart_in_process"),
        "{}",
        describe(&decided)
    );
    ranks[0].signal(Signal::SIGCONT);
    let recovered = events
        .expect(&agent, WAIT, "rank.recovered after SIGCONT", |e| {
            e.kind == "rank.recovered" && e.subject == me
        })
        .await;
    assert_eq!(
        evidence(&recovered, "pid"),
        Some(ranks[0].pid().to_string().as_str())
    );
    let info = get_ranks(&agent, job).await;
    assert_eq!(rank_info(&info, 0).state, "running", "{info:#?}");
}

#[tokio::test]
async fn configured_section_timeout_applies_and_names_the_stack() {
    let (_state, agent) = start_agent("[hang.timeouts]\nslow = \"2s\"\n");
    let job = "slow";
    let mut events = Events::all(&agent).await;
    let mut rank = spawn_rank(
        &agent,
        job,
        0,
        1,
        &[
            FAST,
            &[
                "--fault",
                "sleep",
                "--section",
                "slow",
                "--fault-step",
                "10",
            ],
        ]
        .concat(),
    );
    wait_registered(&mut rank);
    rank.wait_line(WAIT, "the fault", |l| l.starts_with("fault sleep"));
    let entered = Instant::now();
    let me = subject(job, 0);
    let hang = events
        .expect(&agent, WAIT, "rank.hang in 'slow'", |e| {
            e.kind == "rank.hang" && e.subject == me
        })
        .await;
    let after = entered.elapsed();
    eprintln!("rank.hang {after:?} after the rank entered 'slow'");
    assert_eq!(
        evidence(&hang, "section"),
        Some("slow"),
        "{}",
        describe(&hang)
    );
    assert_eq!(
        evidence(&hang, "threshold"),
        Some("2.000s"),
        "{}",
        describe(&hang)
    );
    let source = evidence(&hang, "threshold_source").unwrap_or_default();
    assert!(source.contains("configured"), "{}", describe(&hang));
    assert_eq!(evidence(&hang, "step"), Some("10"), "{}", describe(&hang));
    // Not at the 1 s floor: the configured 2 s (less the few ms it took the
    // test to read the fault line).
    assert!(
        after >= Duration::from_millis(1_700),
        "rank.hang {after:?} after entering 'slow', threshold 2s: {}",
        describe(&hang)
    );
    // A process asleep in a syscall: state S, no CPU.
    assert!(
        evidence(&hang, "process_state").is_some_and(|s| s.starts_with('S')),
        "{}",
        describe(&hang)
    );
    assert!(
        evidence(&hang, "cpu_advancing").is_some_and(|s| s.starts_with("no")),
        "{}",
        describe(&hang)
    );
    // The stack dump follows in a rank.stack event that names the hang
    // event: the Python client registered faulthandler for the agent's file.
    assert_eq!(
        evidence(&hang, "stack"),
        Some("requested: follows as a rank.stack event"),
        "{}",
        describe(&hang)
    );
    let follow_up = events
        .expect(&agent, WAIT, "the rank.stack that follows rank.hang", |e| {
            e.kind == "rank.stack"
                && evidence(e, "hang_event") == Some(hang.id.to_string().as_str())
        })
        .await;
    assert_eq!(follow_up.subject, me, "{}", describe(&follow_up));
    let stack = evidence(&follow_up, "stack").unwrap_or_default();
    assert!(
        stack.contains("sleep_in_section") && stack.contains("most recent call first"),
        "the stack dump names the function the rank sleeps in: {stack}"
    );
    assert_eq!(
        evidence(&hang, "open_sections"),
        Some("step > slow"),
        "{}",
        describe(&hang)
    );
}

#[tokio::test]
async fn rank_exiting_with_code_1_is_reported() {
    let (_state, agent) = start_agent("");
    let job = "crash";
    let mut events = Events::all(&agent).await;
    let mut rank = spawn_rank(
        &agent,
        job,
        0,
        1,
        &[
            FAST,
            &["--fault", "exit", "--exit-code", "1", "--fault-step", "10"],
        ]
        .concat(),
    );
    wait_registered(&mut rank);
    let me = subject(job, 0);
    // Not reaped until the agent has read the status from the zombie.
    let exited = events
        .expect(&agent, WAIT, "rank.exited", |e| {
            e.kind == "rank.exited" && e.subject == me
        })
        .await;
    assert_eq!(
        evidence(&exited, "exit_code"),
        Some("1"),
        "{}",
        describe(&exited)
    );
    assert_eq!(evidence(&exited, "signal"), None, "{}", describe(&exited));
    assert_eq!(
        exited.severity,
        pb::Severity::Error as i32,
        "{}",
        describe(&exited)
    );
    assert_eq!(
        evidence(&exited, "pid"),
        Some(rank.pid().to_string().as_str())
    );
    // Steps 0 to 9 ran; it died between steps, before step 10 began. The
    // slot holds that to the end: the event reports where it died, not where
    // the last scan happened to see it.
    assert_eq!(
        (evidence(&exited, "step"), evidence(&exited, "section")),
        (Some("9"), Some("idle")),
        "{}",
        describe(&exited)
    );
    let info = get_ranks(&agent, job).await;
    let r = rank_info(&info, 0);
    assert_eq!(r.state, "exited", "{r:#?}");
    assert_eq!(r.exit_code, Some(1), "{r:#?}");
    assert_eq!(r.exit_signal, None, "{r:#?}");
    assert_eq!(events.count("rank.hang", &me), 0, "{}", events.summary());
    // The fixture did exit with 1 (the agent read it right, not by chance).
    let status = rank.child.wait().expect("reap the rank");
    assert_eq!(status.code(), Some(1), "{status}\n{}", rank.stderr());
    // Its stdout is drained by a reader thread: wait for the line rather
    // than look only at what was consumed so far.
    rank.wait_line(Duration::from_secs(5), "the fixture's fault line", |l| {
        l == "fault exit code=1 step=10"
    });
}

#[tokio::test]
async fn rank_killed_by_sigkill_is_reported_with_the_signal() {
    let (_state, agent) = start_agent("");
    let job = "killed";
    let mut events = Events::all(&agent).await;
    let mut rank = spawn_rank(
        &agent,
        job,
        0,
        1,
        &[FAST, &["--report-every", "5"]].concat(),
    );
    wait_registered(&mut rank);
    rank.wait_line(WAIT, "step 5", |l| l == "step 5");
    rank.signal(Signal::SIGKILL);
    let me = subject(job, 0);
    let exited = events
        .expect(&agent, WAIT, "rank.exited", |e| {
            e.kind == "rank.exited" && e.subject == me
        })
        .await;
    assert_eq!(
        evidence(&exited, "signal"),
        Some("9"),
        "{}",
        describe(&exited)
    );
    assert_eq!(
        evidence(&exited, "exit_code"),
        None,
        "{}",
        describe(&exited)
    );
    assert!(exited.message.contains("SIGKILL"), "{}", describe(&exited));
    let info = get_ranks(&agent, job).await;
    let r = rank_info(&info, 0);
    assert_eq!(r.state, "exited", "{r:#?}");
    assert_eq!(r.exit_signal, Some(9), "{r:#?}");
    assert_eq!(r.exit_code, None, "{r:#?}");
    let status = rank.child.wait().expect("reap the rank");
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
}

#[tokio::test]
async fn jittery_steps_raise_no_false_hang() {
    let (_state, agent) = start_agent("");
    let job = "jitter";
    let mut ranks: Vec<Rank> = (0..4)
        .map(|r| {
            let seed = r.to_string();
            spawn_rank(
                &agent,
                job,
                r,
                4,
                &[
                    "--step-ms",
                    "10",
                    "--step-max-ms",
                    "60",
                    "--spike-ms",
                    "150",
                    "--spike-prob",
                    "0.05",
                    "--seed",
                    &seed,
                ],
            )
        })
        .collect();
    for r in &mut ranks {
        wait_registered(r);
    }
    let soak_started = Instant::now();
    // Calibrated (thresholds of about a second, not the 10 min default),
    // else the absence of hangs would prove nothing.
    let before = wait_calibrated(&agent, job, 4, 10).await;
    // The point here is elapsed time: ~12 s of jittery steps.
    tokio::time::sleep(Duration::from_secs(12).saturating_sub(soak_started.elapsed())).await;
    let after = get_ranks(&agent, job).await;
    assert_eq!(after.len(), 4, "{after:#?}");
    for r in &after {
        let was = rank_info(&before, r.global_rank);
        assert_eq!(r.state, "running", "{r:#?}");
        assert!(
            r.steps_completed >= was.steps_completed + 50,
            "rank {} completed {} steps, {} before ~10 s earlier",
            r.global_rank,
            r.steps_completed,
            was.steps_completed
        );
        assert!(r.step > was.step, "{r:#?}");
        let p50 = to_std(r.step_time_p50.as_ref()).unwrap_or_else(|| panic!("no p50: {r:#?}"));
        let p99 = to_std(r.step_time_p99.as_ref()).unwrap_or_else(|| panic!("no p99: {r:#?}"));
        assert!(
            p50 >= Duration::from_millis(10) && p50 <= Duration::from_millis(200),
            "{r:#?}"
        );
        assert!(p99 >= p50 && p99 <= Duration::from_millis(500), "{r:#?}");
        assert!(is_calibrated(&r.hang_threshold_source), "{r:#?}");
    }
    let events = within(WAIT, "ListEvents", agent.events()).await;
    let bad: Vec<String> = events
        .iter()
        .filter(|e| {
            matches!(
                e.kind.as_str(),
                "rank.hang" | "rank.exited" | "rank.slot_unreadable"
            )
        })
        .map(describe)
        .collect();
    assert!(
        bad.is_empty(),
        "false alarms during the soak:\n{}",
        bad.join("\n")
    );
}

#[tokio::test]
async fn registrations_that_cannot_be_honoured_are_refused_naming_why() {
    let (_state, agent) = start_agent("");
    let job = "held";
    let mut holder = spawn_rank(&agent, job, 0, 2, FAST);
    wait_registered(&mut holder);
    let request = |job: &str, rank: u32, world: u32, layout: u32| pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: rank,
        local_rank: rank,
        world_size: world,
        pid: std::process::id(),
        host: "test".to_owned(),
        slot_layout_version: layout,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: Vec::new(),
    };
    let layout = warden_client::slot::LAYOUT_VERSION;
    let refused = async |req: pb::RegisterRankRequest| -> tonic::Status {
        let call = async { agent.client().await.register_rank(req.clone()).await };
        match within(WAIT, "RegisterRank", call).await {
            Ok(ok) => panic!("{req:?} was accepted: {:?}", ok.into_inner()),
            Err(status) => status,
        }
    };

    // A second process claiming a rank a live one holds.
    let s = refused(request(job, 0, 2, layout)).await;
    assert_eq!(s.code(), tonic::Code::AlreadyExists, "{s:?}");
    assert!(
        s.message().contains(&format!("pid {}", holder.pid())),
        "names the holder: {s:?}"
    );

    // Invalid requests name the field at fault.
    let cases = [
        (
            request(job, 2, 2, layout),
            tonic::Code::InvalidArgument,
            "global_rank",
        ),
        (
            request("", 0, 1, layout),
            tonic::Code::InvalidArgument,
            "job_id",
        ),
        (
            request(job, 0, 0, layout),
            tonic::Code::InvalidArgument,
            "world_size",
        ),
        (
            request("other", 0, 1, layout + 1),
            tonic::Code::FailedPrecondition,
            "layout",
        ),
        (
            pb::RegisterRankRequest {
                devices: vec!["gpu0\n".into()],
                ..request("other", 0, 1, layout)
            },
            tonic::Code::InvalidArgument,
            "device name",
        ),
        (
            pb::RegisterRankRequest {
                devices: (0..17).map(|i| format!("gpu{i}")).collect(),
                ..request("other", 0, 1, layout)
            },
            tonic::Code::InvalidArgument,
            "devices",
        ),
    ];
    for (req, code, field) in cases {
        let s = refused(req.clone()).await;
        assert_eq!(s.code(), code, "{req:?}: {s:?}");
        assert!(
            s.message().contains(field),
            "{req:?}: {s:?} should name {field}"
        );
    }

    // The holder is untouched.
    let info = get_ranks(&agent, "").await;
    assert_eq!(info.len(), 1, "only the holder is registered: {info:#?}");
    assert_eq!(info[0].pid, holder.pid(), "{info:#?}");
    assert_eq!(info[0].state, "running", "{info:#?}");
    let events = within(WAIT, "ListEvents", agent.events()).await;
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == "rank.registered")
            .count(),
        1,
        "{events:#?}"
    );
}

/// Every slot memory the agent holds, opened read-write through
/// `/proc/<agent>/fd` as the most privileged local process could (the
/// agent's own uid, or root): what no one in the socket group can even
/// reach, since the memory has no name in any directory.
fn slot_memories(agent: &TestAgent) -> Vec<File> {
    let dir = format!("/proc/{}/fd", agent.pid());
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:warden-slot"))
        })
        .map(|e| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(e.path())
                .unwrap_or_else(|err| panic!("open {}: {err}", e.path().display()))
        })
        .collect()
}

/// Overwrites every byte of `file` with random ones, in place (same size).
fn overwrite_with_noise(mut file: &File) {
    let len = file.metadata().expect("stat the slot memory").len();
    let mut noise = vec![0u8; usize::try_from(len).expect("fits")];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut noise))
        .expect("read /dev/urandom");
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0)).expect("seek");
    file.write_all(&noise).expect("overwrite the slot memory");
}

/// Issue 22, the slot file: there is no slot file; each rank's memory is
/// sealed, so not even its holders can truncate or grow it (no SIGBUS for
/// anyone); garbage written into it (what a rogue holder still can do)
/// costs that rank's heartbeats until it registers again, never a rank nor
/// the agent.
#[tokio::test]
async fn slot_memory_cannot_be_truncated_and_garbage_in_it_kills_nobody() {
    let (_state, agent) = start_agent("");
    let job = "sealed";
    let ranks = spawn_ranks(&agent, job, 2, FAST);
    wait_calibrated(&agent, job, 2, 5).await;
    let files: Vec<String> = std::fs::read_dir(agent.home.path())
        .expect("the agent's home")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("slots"))
        .collect();
    assert!(files.is_empty(), "no slot file: {files:?}");

    let memories = slot_memories(&agent);
    assert_eq!(memories.len(), 2, "one memory per rank's slot");
    for m in &memories {
        let len = m.metadata().expect("stat").len();
        for to in [0, 100, len - 1, len + 4096] {
            let err = m
                .set_len(to)
                .expect_err("a sealed memory cannot be resized");
            assert_eq!(
                err.raw_os_error(),
                Some(libc::EPERM),
                "set_len({to}): {err}"
            );
        }
        assert_eq!(m.metadata().expect("stat").len(), len);
    }
    let before = get_ranks(&agent, job).await;
    let events = Events::live(&agent).await;
    for m in &memories {
        overwrite_with_noise(m);
    }
    assert_agent_stays_up(
        &agent,
        Duration::from_secs(2),
        "after every slot memory was overwritten",
    )
    .await;
    // Each client sees a slot that is no longer its own, registers again
    // and is watched again: GetRanks sees its steps move past where they
    // were before the garbage. On failure, say what GetRanks last showed.
    let deadline = Instant::now() + WAIT;
    loop {
        let now = get_ranks(&agent, job).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = get_ranks(&agent, job).await;
        if after.len() == 2
            && after.iter().all(|r| {
                r.state == "running"
                    && r.step > rank_info(&now, r.global_rank).step
                    && r.step > rank_info(&before, r.global_rank).step
            })
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "both ranks did not progress again after the garbage within {WAIT:?}; \
             last GetRanks: {after:#?}\nevents: {}",
            events.summary()
        );
    }
    for r in &ranks {
        let state = proc_state(r.pid());
        assert!(
            matches!(state, Some(s) if s != 'Z' && s != 'X'),
            "{} died after its slot memory was overwritten (state {state:?})\n--- rank stderr ---\n{}",
            r.label,
            r.stderr()
        );
    }
    let all = within(WAIT, "ListEvents", agent.events()).await;
    let exits: Vec<String> = all
        .iter()
        .filter(|e| e.kind == "rank.exited")
        .map(describe)
        .collect();
    assert!(exits.is_empty(), "a rank exited: {}", exits.join("\n"));
}

#[tokio::test]
async fn calibration_survives_an_agent_restart() {
    let (state, mut agent) = start_agent("");
    let job = "persist";
    let mut events = Events::all(&agent).await;
    let first = spawn_ranks(&agent, job, 1, FAST);
    wait_calibrated(&agent, job, 1, 20).await;
    // The rank goes first: alive, it would re-register with the next agent.
    first[0].signal(Signal::SIGKILL);
    events
        .expect(&agent, WAIT, "rank.exited", |e| e.kind == "rank.exited")
        .await;
    drop(first);
    drop(events);
    agent.signal(Signal::SIGTERM);
    let status = agent.exited(WAIT).await;
    assert_eq!(status.code(), Some(0), "{status}\n{}", agent.stderr());

    let file = state.path().join("calibration").join(format!("{job}.json"));
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", file.display(), agent.stderr()));
    let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let forward = doc["sections"]["forward"]["ns"]
        .as_array()
        .unwrap_or_else(|| panic!("no 'forward' history in {text}"));
    assert!(forward.len() >= 5, "{text}");

    let agent = TestAgent::start_in(agent.home.clone());
    // Slow steps: it is seen in its first sections long before 5 complete.
    let mut second = spawn_rank(&agent, job, 0, 1, &["--step-ms", "1200"]);
    wait_registered(&mut second);
    let info = eventually(WAIT, "the new rank in its first step", async || {
        let ranks = get_ranks(&agent, job).await;
        ranks
            .first()
            .filter(|r| r.section != "init" && !r.section.is_empty())
            .cloned()
    })
    .await;
    assert!(info.steps_completed < 5, "{info:#?}");
    assert!(
        is_calibrated(&info.hang_threshold_source),
        "calibrated from the previous agent's history: {info:#?}"
    );
    assert_eq!(
        to_std(info.hang_threshold.as_ref()),
        Some(Duration::from_secs(1)),
        "the 1 s floor: {info:#?}"
    );
}

#[tokio::test]
async fn cli_lists_running_ranks_with_step_and_section() {
    let (_state, agent) = start_agent("");
    let job = "cli";
    let ranks = spawn_ranks(&agent, job, 2, FAST);
    let warden = |args: &[&str]| {
        let out = run(
            Command::new(WARDEN)
                .arg("--socket")
                .arg(agent.socket())
                .args(args),
            WAIT,
        );
        assert_eq!(out.code(), 0, "warden {args:?}: {out:?}");
        out.stdout
    };
    let doc = eventually(
        WAIT,
        "both ranks past step 0 in warden ranks --json",
        async || {
            let stdout = warden(&["ranks", "--json"]);
            let doc: Value =
                serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
            let list = doc["ranks"].as_array().expect("a ranks array").clone();
            (list.len() == 2 && list.iter().all(|r| r["step"].as_u64() > Some(0))).then_some(doc)
        },
    )
    .await;
    for r in doc["ranks"].as_array().expect("ranks") {
        let rank = u32::try_from(r["global_rank"].as_u64().expect("global_rank")).expect("u32");
        assert_eq!(r["job_id"], job, "{r}");
        assert_eq!(r["state"], "running", "{r}");
        assert_eq!(r["world_size"], 2, "{r}");
        assert_eq!(
            r["pid"].as_u64(),
            Some(u64::from(ranks[rank as usize].pid())),
            "{r}"
        );
        let section = r["section"].as_str().expect("section");
        assert!(
            ["forward", "backward", "step", "idle"].contains(&section),
            "{r}"
        );
    }
    let other = warden(&["ranks", "--json", "--job", "nobody"]);
    let other: Value = serde_json::from_str(&other).expect("JSON");
    assert_eq!(other["ranks"], Value::Array(Vec::new()), "{other}");
    let table = warden(&["ranks"]);
    for r in &ranks {
        assert!(
            table
                .lines()
                .any(|l| l.contains(job) && l.contains(&r.pid().to_string())),
            "no row for {}:\n{table}",
            r.label
        );
    }
}

/// An agent killed -9 and started again (as systemd restarts it) has an
/// empty registry, while the ranks keep their slots' sealed memory and a
/// channel that dials the new agent by itself: nothing on the hot path
/// fails. They must still notice and register again, the same processes,
/// with their steps going on, or the new agent watches nobody.
#[tokio::test]
async fn ranks_register_again_with_an_agent_restarted_after_kill_9() {
    let (_state, mut agent) = start_agent("");
    let job = "reborn";
    let ranks = spawn_ranks(&agent, job, 2, FAST);
    let pids: Vec<u32> = ranks.iter().map(Streaming::pid).collect();
    let before = eventually(WAIT, "both ranks stepping", async || {
        let r = get_ranks(&agent, job).await;
        (r.len() == 2 && r.iter().all(|i| i.steps_completed >= 3)).then_some(r)
    })
    .await;

    agent.sigkill_and_wait();
    let agent = TestAgent::start_in(agent.home.clone());
    let after = eventually(
        WAIT,
        "both ranks registered with the new agent",
        async || {
            let r = get_ranks(&agent, job).await;
            (r.len() == 2
                && r.iter()
                    .all(|i| i.state == "running" && i.steps_completed >= 1))
            .then_some(r)
        },
    )
    .await;
    let mut got: Vec<u32> = after.iter().map(|i| i.pid).collect();
    got.sort_unstable();
    let mut want = pids.clone();
    want.sort_unstable();
    assert_eq!(got, want, "the same processes: {before:#?} {after:#?}");
    // Their steps went on from where they were (the client carries its
    // state into the new slot), not from zero.
    for (b, a) in before.iter().zip(&after) {
        assert!(a.step >= b.step, "step went back: {b:#?} {a:#?}");
    }
    drop(ranks);
}
