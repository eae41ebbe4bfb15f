//! System tests of exception reports and device naming, with the real
//! `wardend`, real Python ranks (tests/fixtures/raise.py, through the
//! `warden` package's excepthook) and the Rust client's API.
//!
//! A rank that dies of an uncaught exception must show up twice, in this
//! order: `rank.exception` (what killed it: type, message, step, traceback,
//! sent by the excepthook before Python prints the traceback) and
//! `rank.exited` (exit code 1, seen by the agent from the zombie: the test
//! process never reaps a rank before the agent has reported it). It must
//! not deregister: the atexit handler that runs after the excepthook would
//! otherwise tell the agent it left cleanly.
//!
//! The Python interpreter is `$WARDEN_TEST_PYTHON` (tests/run-all.sh sets
//! it), else the repository's `.venv/bin/python`; it must `import warden`.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    Events, Streaming, TestAgent, WAIT, describe, evidence, python_rank, spawn_python_rank,
};
use warden_client::{Client, ConnectOptions, ExceptionReport, ReportError};
use warden_proto::v1 as pb;

// ------------------------------------------------------------------ harness

/// A short agent tick, state in a scratch directory.
fn start_agent() -> (tempfile::TempDir, TestAgent) {
    let state = tempfile::Builder::new()
        .prefix("warden-state-")
        .tempdir()
        .expect("create a state directory");
    let agent = TestAgent::start(&format!(
        "[agent]\ntick = \"50ms\"\nstate_dir = \"{}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n",
        state.path().display()
    ));
    (state, agent)
}

fn subject(job: &str, rank: u32) -> String {
    format!("job/{job}/rank/{rank}")
}

/// A rank: `tests/fixtures/raise.py` with `args` and `env`, registered as
/// `rank` (local rank `local`) of `world` in `job`.
fn spawn_rank(
    agent: &TestAgent,
    job: &str,
    (rank, local, world): (u32, u32, u32),
    args: &[&str],
    env: &[(&str, &str)],
) -> Streaming {
    let mut cmd = python_rank(agent, "tests/fixtures/raise.py", job, (rank, world), args);
    cmd.env("LOCAL_RANK", local.to_string())
        .envs(env.iter().copied());
    spawn_python_rank(agent, job, rank, &mut cmd)
}

// -------------------------------------------------------------------- tests

#[tokio::test]
async fn uncaught_exception_is_reported_then_the_exit_it_causes() {
    let (_state, agent) = start_agent();
    let job = "oom";
    let me = subject(job, 0);
    let mut events = Events::all(&agent).await;
    let mut rank = spawn_rank(
        &agent,
        job,
        (0, 0, 1),
        &["--steps", "10", "--raise-step", "3"],
        &[],
    );
    rank.wait_line(WAIT, "registered", |l| l.starts_with("registered "));

    let exc = events
        .expect(&agent, WAIT, "rank.exception", |e| {
            e.kind == "rank.exception" && e.subject == me
        })
        .await;
    let d = describe(&exc);
    assert_eq!(
        evidence(&exc, "exception_type"),
        Some("RuntimeError"),
        "{d}"
    );
    assert_eq!(
        evidence(&exc, "message"),
        Some("CUDA out of memory. Tried to allocate 2.00 GiB"),
        "{d}"
    );
    assert_eq!(evidence(&exc, "uncaught"), Some("true"), "{d}");
    assert_eq!(evidence(&exc, "step"), Some("3"), "{d}");
    assert_eq!(
        evidence(&exc, "pid"),
        Some(rank.child.id().to_string().as_str()),
        "{d}"
    );
    let tb = evidence(&exc, "traceback").unwrap_or_default();
    assert!(
        tb.contains("in allocate_activations") && tb.contains("Traceback (most recent call last)"),
        "the traceback names the raising function: {tb}"
    );
    assert_eq!(exc.severity, pb::Severity::Error as i32, "{d}");

    // Then the exit, seen from the zombie: code 1, not a clean deregistration.
    let exited = events
        .expect(&agent, WAIT, "rank.exited after rank.exception", |e| {
            e.kind == "rank.exited" && e.subject == me
        })
        .await;
    assert_eq!(
        evidence(&exited, "exit_code"),
        Some("1"),
        "{}",
        describe(&exited)
    );
    assert!(exited.id > exc.id, "{}", events.summary());
    assert_eq!(
        events.count("rank.deregistered", &me),
        0,
        "a rank dying of an exception must not deregister:\n{}",
        events.summary()
    );

    // Attribution joins the two: the user's error, no restart, the rank's
    // own exit code for the scheduler, the exception as the evidence.
    let decided = events
        .expect(&agent, WAIT, "incident.decided", |e| {
            e.kind == "incident.decided"
        })
        .await;
    assert_eq!(
        evidence(&decided, "class"),
        Some("user_error"),
        "{}",
        describe(&decided)
    );
    assert_eq!(
        evidence(&decided, "action"),
        Some("stop"),
        "{}",
        describe(&decided)
    );
    assert_eq!(
        evidence(&decided, "exit_code"),
        Some("1"),
        "{}",
        describe(&decided)
    );
    let incidents = agent
        .client()
        .await
        .get_incidents(pb::GetIncidentsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .incidents;
    let inc = incidents
        .iter()
        .find(|i| i.id == decided.subject)
        .expect("the incident");
    let diag = inc.diagnosis.as_ref().unwrap();
    assert_eq!(inc.kind, "crash");
    assert_eq!(diag.rule, "exception.cuda_oom", "{diag:?}");
    assert!(
        diag.evidence
            .iter()
            .any(|e| e.signal == "exception" && e.value.contains("CUDA out of memory")),
        "{diag:?}"
    );

    let status = rank.wait_exit(WAIT);
    assert_eq!(status.code(), Some(1), "{status}\n{}", rank.stderr());
    // The previous hook (Python's own) still printed the traceback.
    let stderr = rank.stderr();
    assert!(
        stderr.contains("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
            && stderr.contains("allocate_activations"),
        "{stderr}"
    );
    // Its stdout is drained by a reader thread: wait for the line rather
    // than look only at what was consumed so far.
    rank.wait_line(WAIT, "the fixture's raising line", |l| {
        l == "raising step=3"
    });
}

/// Starts a rank with `env` that registers, runs one step and exits
/// cleanly; returns its `rank.registered` event.
async fn registered_with(agent: &TestAgent, job: &str, env: &[(&str, &str)]) -> pb::Event {
    let me = subject(job, 1);
    let mut events = Events::all(agent).await;
    let mut rank = spawn_rank(
        agent,
        job,
        (1, 1, 2),
        &["--steps", "1", "--raise-step", "-1"],
        env,
    );
    rank.wait_line(WAIT, "registered", |l| l.starts_with("registered "));
    let ev = events
        .expect(agent, WAIT, "rank.registered", |e| {
            e.kind == "rank.registered" && e.subject == me
        })
        .await;
    rank.wait_line(WAIT, "done", |l| l.starts_with("done "));
    let status = rank.wait_exit(WAIT);
    assert!(status.success(), "{status}\n{}", rank.stderr());
    ev
}

#[tokio::test]
async fn devices_come_from_the_environment() {
    let (_state, agent) = start_agent();

    // The launcher gave the node's list; local rank 1 drives its entry 1.
    let ev = registered_with(
        &agent,
        "cvd",
        &[("CUDA_VISIBLE_DEVICES", "4,5"), ("LOCAL_RANK", "1")],
    )
    .await;
    assert_eq!(evidence(&ev, "devices"), Some("gpu5"), "{}", describe(&ev));
    assert_eq!(
        evidence(&ev, "devices_from"),
        Some("client"),
        "{}",
        describe(&ev)
    );

    // WARDEN_DEVICES wins, used as given.
    let ev = registered_with(
        &agent,
        "explicit",
        &[
            ("WARDEN_DEVICES", "GPU-abc"),
            ("CUDA_VISIBLE_DEVICES", "4,5"),
        ],
    )
    .await;
    assert_eq!(
        evidence(&ev, "devices"),
        Some("GPU-abc"),
        "{}",
        describe(&ev)
    );

    // Neither: the client names nothing, the agent assumes gpu<local_rank>.
    let ev = registered_with(&agent, "none", &[]).await;
    assert_eq!(evidence(&ev, "devices"), Some("gpu1"), "{}", describe(&ev));
    assert_ne!(
        evidence(&ev, "devices_from"),
        Some("client"),
        "{}",
        describe(&ev)
    );
}

#[tokio::test]
async fn rust_client_reports_an_exception_and_stays_bounded_when_the_agent_dies() {
    let (_state, mut agent) = start_agent();
    let job = "rust";
    let me = subject(job, 2);
    let mut events = Events::all(&agent).await;
    let opts = ConnectOptions {
        socket_path: agent.socket().to_owned(),
        job_id: job.to_owned(),
        global_rank: 2,
        local_rank: 2,
        world_size: 4,
        connect_timeout: WAIT,
        probe_interval: Duration::from_secs(1),
        stack_dump_signal: 0,
        devices: vec!["gpu2".to_owned()],
        exception_report_timeout: Duration::from_secs(1),
    };
    let client = tokio::task::spawn_blocking(move || Client::connect_with(opts))
        .await
        .unwrap()
        .unwrap();
    assert!(client.is_connected(), "{:?}", client.status());
    let generation = client.status().generation.unwrap();
    client.step_begin(7);

    let client = std::sync::Arc::new(client);
    let report = |c: std::sync::Arc<Client>, r: ExceptionReport| async move {
        let t0 = Instant::now();
        let result = tokio::task::spawn_blocking(move || c.report_exception(&r))
            .await
            .unwrap();
        (result, t0.elapsed())
    };
    let (result, took) = report(
        client.clone(),
        ExceptionReport {
            exception_type: "std::bad_alloc".to_owned(),
            message: "out of host memory".to_owned(),
            traceback: "#0 main at train.cc:12".to_owned(),
            step: None,
            uncaught: false,
        },
    )
    .await;
    result.unwrap();
    assert!(took < Duration::from_secs(1), "{took:?}");

    let exc = events
        .expect(&agent, WAIT, "rank.exception", |e| {
            e.kind == "rank.exception" && e.subject == me
        })
        .await;
    let d = describe(&exc);
    assert_eq!(
        evidence(&exc, "exception_type"),
        Some("std::bad_alloc"),
        "{d}"
    );
    assert_eq!(evidence(&exc, "message"), Some("out of host memory"), "{d}");
    assert_eq!(
        evidence(&exc, "traceback"),
        Some("#0 main at train.cc:12"),
        "{d}"
    );
    assert_eq!(evidence(&exc, "step"), Some("7"), "{d}");
    assert_eq!(evidence(&exc, "uncaught"), Some("false"), "{d}");
    assert_eq!(
        evidence(&exc, "generation"),
        Some(generation.to_string().as_str()),
        "{d}"
    );
    assert_eq!(
        evidence(&exc, "pid"),
        Some(std::process::id().to_string().as_str()),
        "{d}"
    );
    assert_eq!(exc.severity, pb::Severity::Warning as i32, "{d}");

    // The agent dies (SIGKILL: its socket file stays, nobody listens). The
    // client may still think itself registered; the report fails, quickly.
    drop(events);
    agent.sigkill_and_wait();
    let (result, took) = report(
        client.clone(),
        ExceptionReport {
            exception_type: "RuntimeError".to_owned(),
            uncaught: true,
            ..ExceptionReport::default()
        },
    )
    .await;
    assert!(
        matches!(
            result,
            Err(ReportError::Connect { .. } | ReportError::NotRegistered(_))
        ),
        "{result:?}"
    );
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let t0 = Instant::now();
    tokio::task::spawn_blocking(move || drop(client))
        .await
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}
