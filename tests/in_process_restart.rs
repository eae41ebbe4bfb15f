//! System tests of in-process restarts, with the real `wardend` and real
//! Python ranks (tests/fixtures/restartable.py) running their training
//! function under `warden.run`.
//!
//! 1. Two ranks of one job; rank 1 hangs in a long `time.sleep`. The agent
//!    finds the hang, decides `restart_in_process` (a lone hang is a
//!    transient fault), and asks both ranks: each raises `RestartRequested`
//!    (the sleeping one interrupted by the restart signal), acknowledges,
//!    and runs its training function again from its local checkpoint with
//!    restart count 1, in the same process, to the end.
//! 2. A rank that is not under `warden.run` never acknowledges: after
//!    `restart.in_process_timeout` the agent reports it and the decision
//!    becomes `restart_in_job`, superseding the in-process one.
//! 3. `RequestRestart`, `Control` and `AckControl` at the API: a restart by
//!    hand, and the refusals (unknown job, stale generation).
//! 4. With torch: a rank that declared its state to `warden.heal` and is
//!    blocked in a gloo collective that nothing wakes (its peer keeps the
//!    group alive) cannot take a restart: it leaves by itself with exit 75,
//!    so that `warden run` heals it, instead of holding the job until
//!    gloo's timeout.
//!
//! The Python interpreter is `$WARDEN_TEST_PYTHON` (tests/run-all.sh sets it),
//! else the repository's `.venv/bin/python`; it must `import warden`.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use nix::sys::signal::Signal;
use std::path::Path;
use std::time::Duration;

use common::{
    Events, Streaming, TestAgent, WAIT, describe, evidence, python_rank, spawn_python_rank, within,
};

/// Bound on a wait that spans a torch rank's start (importing torch and
/// joining a gloo group): 40 s was passed under CI's load (load 15-20, two
/// such tests at once, no line printed yet). A deadline, not a sleep: a
/// passing test waits only as long as its ranks take.
const TORCH_WAIT: Duration = Duration::from_secs(180);
use tokio_stream::StreamExt;
use warden_proto::v1 as pb;

// ------------------------------------------------------------------ harness

/// Fast ticks and hang thresholds of about a second once calibrated (as in
/// tests/ranks.rs); `extra` adds tables.
fn start_agent(extra: &str) -> (tempfile::TempDir, TestAgent) {
    let state = tempfile::Builder::new()
        .prefix("warden-state-")
        .tempdir()
        .expect("create a state directory");
    let agent = TestAgent::start(&format!(
        "[agent]\ntick = \"50ms\"\nstate_dir = \"{}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n{extra}",
        state.path().display()
    ));
    (state, agent)
}

/// A rank running tests/fixtures/restartable.py with `args`, its
/// checkpoints in `ckpt`.
fn spawn_rank(
    agent: &TestAgent,
    job: &str,
    (rank, world): (u32, u32),
    ckpt: &Path,
    args: &[&str],
) -> Streaming {
    let ckpt = ckpt.display().to_string();
    let args: Vec<&str> = ["--checkpoint-dir", ckpt.as_str()]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let mut cmd = python_rank(
        agent,
        "tests/fixtures/restartable.py",
        job,
        (rank, world),
        &args,
    );
    spawn_python_rank(agent, job, rank, &mut cmd)
}

/// `key=value` from a line of the fixture's output.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Waits for the registration line; returns the pid and generation.
fn registered(rank: &mut Streaming) -> (u32, u64) {
    let line = rank.wait_line(WAIT, "registered", |l| l.starts_with("registered "));
    (
        field(&line, "pid").parse().unwrap(),
        field(&line, "generation").parse().unwrap(),
    )
}

// -------------------------------------------------------------------- tests

#[tokio::test]
async fn a_hung_rank_and_its_peer_restart_in_process_and_finish() {
    let (_state, agent) = start_agent("");
    let ckpt = tempfile::tempdir().unwrap();
    let job = "ipr";
    let mut events = Events::all(&agent).await;
    let steps = ["--steps", "200", "--step-ms", "20"];
    let mut r0 = spawn_rank(&agent, job, (0, 2), ckpt.path(), &steps);
    let mut r1 = spawn_rank(
        &agent,
        job,
        (1, 2),
        ckpt.path(),
        &[&steps[..], &["--fault-step", "25"]].concat(),
    );
    let (pid0, _) = registered(&mut r0);
    let (pid1, _) = registered(&mut r1);
    r1.wait_line(WAIT, "the fault", |l| l.starts_with("fault sleep step=25"));

    let decided = events
        .expect(&agent, WAIT, "the hang's decision", |e| {
            e.kind == "incident.decided"
        })
        .await;
    assert_eq!(
        evidence(&decided, "action"),
        Some("restart_in_process"),
        "{}",
        describe(&decided)
    );
    let requested = events
        .expect(&agent, WAIT, "restart.requested", |e| {
            e.kind == "restart.requested"
        })
        .await;
    let d = describe(&requested);
    assert_eq!(requested.subject, format!("job/{job}"), "{d}");
    assert_eq!(evidence(&requested, "ranks"), Some("0,1"), "{d}");
    assert_eq!(evidence(&requested, "restart_count"), Some("1"), "{d}");
    assert_eq!(
        evidence(&requested, "incident"),
        Some(decided.subject.as_str()),
        "{d}"
    );
    let seq = evidence(&requested, "seq").unwrap().to_owned();

    let acked = events
        .expect(&agent, WAIT, "restart.acknowledged", |e| {
            e.kind == "restart.acknowledged"
        })
        .await;
    let d = describe(&acked);
    eprintln!("{d}");
    assert_eq!(evidence(&acked, "seq"), Some(seq.as_str()), "{d}");
    assert_eq!(evidence(&acked, "acknowledged"), Some("0,1"), "{d}");
    assert_eq!(evidence(&acked, "gone"), Some(""), "{d}");
    for rank in ["0", "1"] {
        let latency = evidence(&acked, &format!("latency.rank.{rank}"))
            .unwrap_or_else(|| panic!("no latency for rank {rank}: {d}"));
        let ms: f64 = latency.split("ms").next().unwrap().parse().unwrap();
        assert!(
            ms < 2000.0,
            "rank {rank} took {latency} to acknowledge: {d}"
        );
    }
    assert!(
        acked.id > requested.id,
        "requested before acknowledged:\n{}",
        events.summary()
    );

    // Each rank: the exception in the same process, then the training
    // function again with restart count 1, from its checkpoint, to the end.
    for (rank, pid, name) in [(&mut r0, pid0, "rank 0"), (&mut r1, pid1, "rank 1 (hung)")] {
        let line = rank.wait_line(WAIT, "the restart", |l| l.starts_with("restart requested "));
        assert_eq!(field(&line, "seq"), seq, "{name}: {line}");
        assert_eq!(field(&line, "restart_count"), "1", "{name}: {line}");
        assert_eq!(field(&line, "pid"), pid.to_string(), "{name}: in process");
        let line = rank.wait_line(WAIT, "the second attempt", |l| {
            l.starts_with("attempt restart_count=1 ")
        });
        assert_eq!(field(&line, "pid"), pid.to_string(), "{name}: same process");
        let start: u64 = field(&line, "start").parse().unwrap();
        assert!(start > 0, "{name} resumes from its checkpoint: {line}");
        if name.starts_with("rank 1") {
            assert_eq!(start, 25, "{name} resumes at the step it hung in: {line}");
        }
        let line = rank.wait_line(WAIT, "the end", |l| l.starts_with("done "));
        assert_eq!(field(&line, "restart_count"), "1", "{name}: {line}");
        assert_eq!(field(&line, "pid"), pid.to_string(), "{name}: {line}");
        let status = rank.wait_exit(WAIT);
        assert!(
            status.success(),
            "{name} exits 0: {status:?}\n{}",
            rank.stderr()
        );
    }
    assert!(
        events.count("restart.in_process_timeout", "") == 0,
        "{}",
        events.summary()
    );
    // The hung rank made progress again: seen already (its first step after
    // the raise can be published before the acknowledgement), or still to
    // come.
    let rank1 = format!("job/{job}/rank/1");
    if events.count("rank.recovered", &rank1) == 0 {
        events
            .expect(&agent, WAIT, "rank.recovered", |e| {
                e.kind == "rank.recovered" && e.subject == rank1
            })
            .await;
    }
}

#[tokio::test]
async fn a_rank_that_never_acknowledges_is_escalated_to_restart_in_job() {
    let (_state, agent) = start_agent("[restart]\nin_process_timeout = \"2s\"\n");
    let ckpt = tempfile::tempdir().unwrap();
    let job = "stubborn";
    let mut events = Events::all(&agent).await;
    let mut r0 = spawn_rank(
        &agent,
        job,
        (0, 1),
        ckpt.path(),
        &["--mode", "plain", "--steps", "100", "--fault-step", "15"],
    );
    registered(&mut r0);
    r0.wait_line(WAIT, "the fault", |l| l.starts_with("fault sleep"));

    let requested = events
        .expect(&agent, WAIT, "restart.requested", |e| {
            e.kind == "restart.requested"
        })
        .await;
    let incident = evidence(&requested, "incident").unwrap().to_owned();
    assert!(incident.starts_with("inc-"), "{}", describe(&requested));
    let timeout = events
        .expect(&agent, WAIT, "restart.in_process_timeout", |e| {
            e.kind == "restart.in_process_timeout"
        })
        .await;
    let d = describe(&timeout);
    assert_eq!(evidence(&timeout, "unacknowledged"), Some("0"), "{d}");
    assert_eq!(
        evidence(&timeout, "escalated_to"),
        Some("restart_in_job"),
        "{d}"
    );
    assert_eq!(
        evidence(&timeout, "incident"),
        Some(incident.as_str()),
        "{d}"
    );
    assert_eq!(timeout.severity, pb::Severity::Error as i32, "{d}");
    let escalated = events
        .expect(&agent, WAIT, "the superseding decision", |e| {
            e.kind == "incident.decided"
                && e.subject == incident
                && evidence(e, "action") == Some("restart_in_job")
        })
        .await;
    assert_eq!(
        evidence(&escalated, "decided_by"),
        Some("escalation"),
        "{}",
        describe(&escalated)
    );
    assert_eq!(
        events.count("restart.acknowledged", ""),
        0,
        "{}",
        events.summary()
    );

    let incidents = agent
        .client()
        .await
        .get_incidents(pb::GetIncidentsRequest {
            job_id: job.to_owned(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .incidents;
    let inc = incidents
        .iter()
        .find(|i| i.id == incident)
        .unwrap_or_else(|| panic!("{incident} in {incidents:#?}"));
    let decision = inc.decision.as_ref().unwrap();
    assert_eq!(decision.action, pb::Action::RestartInJob as i32, "{inc:#?}");
    assert!(decision.reason.contains("did not acknowledge"), "{inc:#?}");
    assert_eq!(
        inc.superseded.iter().map(|d| d.action).collect::<Vec<_>>(),
        vec![pb::Action::RestartInProcess as i32],
        "{inc:#?}"
    );
    // Nothing was raised in the plain rank: it still sleeps where it hung.
    assert!(
        !r0.seen.iter().any(|l| l.starts_with("restart requested")),
        "{:?}",
        r0.seen
    );
}

#[tokio::test]
async fn restarts_by_hand_and_the_control_api() {
    let (_state, agent) = start_agent("");
    let ckpt = tempfile::tempdir().unwrap();
    let job = "by-hand";
    let mut client = agent.client().await;

    // Nothing to restart: NOT_FOUND; no job: INVALID_ARGUMENT.
    let err = client
        .request_restart(pb::RequestRestartRequest {
            job_id: "nobody".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    let err = client
        .request_restart(pb::RequestRestartRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    let mut events = Events::all(&agent).await;
    // Rank 0: Python under warden.run. Rank 1: this test, speaking the
    // protocol by hand (registered with the test's own pid).
    let mut r0 = spawn_rank(&agent, job, (0, 2), ckpt.path(), &["--steps", "400"]);
    let (pid, _) = registered(&mut r0);
    let me = client
        .register_rank(pb::RegisterRankRequest {
            job_id: job.into(),
            global_rank: 1,
            local_rank: 1,
            world_size: 2,
            pid: std::process::id(),
            host: "test".into(),
            slot_layout_version: warden_client::slot::LAYOUT_VERSION,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    r0.wait_line(WAIT, "a step", |l| l.starts_with("step 10 "));

    // A stale generation is refused on both control calls; an unknown rank too.
    let stale = me.generation + 1000;
    let err = client
        .control(pb::ControlRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: stale,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    let err = client
        .ack_control(pb::AckControlRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: stale,
            seq: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    let err = client
        .control(pb::ControlRequest {
            job_id: job.into(),
            global_rank: 5,
            generation: me.generation,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    let mut stream = client
        .control(pb::ControlRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: me.generation,
        })
        .await
        .unwrap()
        .into_inner();
    let asked = client
        .request_restart(pb::RequestRestartRequest {
            job_id: job.into(),
            reason: "drill".into(),
            incident_id: String::new(),
            replacing: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(asked.ranks, vec![0, 1]);
    assert_eq!(asked.restart_count, 1);
    let msg = within(WAIT, "the stream's message", stream.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(msg.kind, pb::control_message::Kind::Restart as i32);
    assert_eq!((msg.seq, msg.restart_count), (asked.seq, 1));
    assert_eq!(msg.reason, "drill");
    assert!(msg.incident_id.is_empty());
    // The slot carries the same request.
    // (This process registered itself, so the slot socket hands it the
    // memory, as it does a rank.)
    let fd = warden_client::slot_socket::fetch(
        &warden_client::slot_socket::socket_path(agent.socket()),
        me.generation,
        Duration::from_secs(10),
    )
    .unwrap();
    let word = warden_client::slot::SlotMemory::open(fd)
        .unwrap()
        .slot()
        .snapshot(me.slot_index)
        .unwrap()
        .control;
    assert_eq!(
        warden_client::slot::ControlWord::decode(word),
        Some(warden_client::slot::ControlWord::restart(
            u32::try_from(asked.seq).unwrap(),
            1
        ))
    );
    // Asked again while in flight: the same request, nobody asked twice.
    let joined = client
        .request_restart(pb::RequestRestartRequest {
            job_id: job.into(),
            reason: "impatient".into(),
            incident_id: String::new(),
            replacing: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((joined.seq, joined.restart_count), (asked.seq, 1));

    let line = r0.wait_line(WAIT, "the restart", |l| l.starts_with("restart requested "));
    assert_eq!(field(&line, "seq"), asked.seq.to_string());
    assert_eq!(field(&line, "reason"), "'drill'", "{line}");
    let line = r0.wait_line(WAIT, "the second attempt", |l| {
        l.starts_with("attempt restart_count=1 ")
    });
    assert_eq!(field(&line, "pid"), pid.to_string());
    // Rank 1 acknowledges by hand; then the request is done.
    client
        .ack_control(pb::AckControlRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: me.generation,
            seq: asked.seq,
        })
        .await
        .unwrap();
    let acked = events
        .expect(&agent, WAIT, "restart.acknowledged", |e| {
            e.kind == "restart.acknowledged"
        })
        .await;
    let d = describe(&acked);
    assert_eq!(
        evidence(&acked, "seq"),
        Some(asked.seq.to_string().as_str()),
        "{d}"
    );
    assert_eq!(evidence(&acked, "acknowledged"), Some("0,1"), "{d}");
    assert_eq!(evidence(&acked, "incident"), Some(""), "{d}");
    assert!(
        evidence(&acked, "latency.rank.1").is_some_and(|l| l.ends_with("(rpc)")),
        "{d}"
    );
    assert_eq!(
        events.count("restart.requested", ""),
        1,
        "{}",
        events.summary()
    );
    // A late acknowledgement is accepted and ignored.
    client
        .ack_control(pb::AckControlRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: me.generation,
            seq: asked.seq,
        })
        .await
        .unwrap();

    // A second request: restart count 2, a new sequence number; rank 1
    // leaves meanwhile, which counts as handled.
    let again = client
        .request_restart(pb::RequestRestartRequest {
            job_id: job.into(),
            reason: "again".into(),
            incident_id: String::new(),
            replacing: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.restart_count, 2);
    assert_ne!(again.seq, asked.seq);
    client
        .deregister_rank(pb::DeregisterRankRequest {
            job_id: job.into(),
            global_rank: 1,
            generation: me.generation,
        })
        .await
        .unwrap();
    r0.wait_line(WAIT, "the third attempt", |l| {
        l.starts_with("attempt restart_count=2 ")
    });
    let acked = events
        .expect(&agent, WAIT, "the second restart.acknowledged", |e| {
            e.kind == "restart.acknowledged"
        })
        .await;
    let d = describe(&acked);
    assert_eq!(evidence(&acked, "acknowledged"), Some("0"), "{d}");
    assert_eq!(evidence(&acked, "gone"), Some("1 (left)"), "{d}");
    let status = r0.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", r0.stderr());
}

/// Rank 0 blocked in a gloo collective that rank 1 never joins, a restart
/// requested: the connections of the group `warden.heal` made are shut down
/// (by rank 0's watchdog after 1 s, or sooner by rank 1 as it takes its own
/// restart), the collective fails, and rank 0 takes the restart in its own
/// process.
#[tokio::test]
async fn a_healable_rank_blocked_in_a_collective_is_unblocked_and_keeps_its_process() {
    if !common::torch_available() {
        return;
    }
    // Bound whole: the agent and folders live to the test's end.
    let mut blocked = blocked_ranks(false, false).await;
    // Unblocked by its own watchdog (the shut-down line, after 1 s), or
    // sooner by rank 1: a rank that takes its restart shuts its attempt's
    // group down (warden.run), and rank 0's collective fails with it.
    let (took, own, _) = blocked.rank0_restarts_in_its_own_process();
    eprintln!(
        "rank 0 took the restart {:.2} s after it was asked (threshold 1 s), in its own process, \
         unblocked by {}",
        took.as_secs_f64(),
        if own {
            "its own watchdog"
        } else {
            "rank 1 shutting the group down as it took its restart"
        }
    );
}

/// The same with rank 1 frozen (SIGSTOP) before the request: it takes no
/// restart and shuts nothing down, so only rank 0's own watchdog can bring
/// its training thread back. It must, by shutting down its group's
/// connections, and rank 0 keeps its process.
#[tokio::test]
async fn a_blocked_rank_whose_peer_is_frozen_is_unblocked_by_its_own_watchdog() {
    if !common::torch_available() {
        return;
    }
    // Bound whole: the agent and folders live to the test's end.
    let mut blocked = blocked_ranks(false, true).await;
    let (took, own, shown) = blocked.rank0_restarts_in_its_own_process();
    assert!(own, "not unblocked by its own watchdog: {shown}");
    let ranks = &mut blocked.ranks;
    // Rank 1 is still frozen: nothing of its own took a restart.
    assert!(
        !ranks[1]
            .seen
            .iter()
            .any(|l| l.starts_with("restart requested ")),
        "{:?}",
        ranks[1].seen
    );
    ranks[1].signal(Signal::SIGCONT);
    eprintln!(
        "rank 0 took the restart {:.2} s after it was asked (watchdog threshold 1 s), in its \
         own process, its peer frozen",
        took.as_secs_f64()
    );
}

/// The two ranks of tests/fixtures/heal_blocked.py, rank 0 blocked and a
/// restart requested (rank 1 took it, or is frozen when `frozen_peer`),
/// with their agent and scratch folder.
struct Blocked {
    ranks: Vec<Streaming>,
    /// Rank 0's pid.
    pid0: String,
    /// When the restart was asked.
    asked: std::time::Instant,
    _agent: TestAgent,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

impl Blocked {
    /// Waits for rank 0 to take the restart and checks that it did so in its
    /// own process (the same pid, no exit 75). Returns how long after the
    /// request, whether its own watchdog shut its group's connections down,
    /// and what it said (for failure messages).
    fn rank0_restarts_in_its_own_process(&mut self) -> (std::time::Duration, bool, String) {
        let pid0 = &self.pid0;
        let r0 = &mut self.ranks[0];
        let line = r0.wait_line(TORCH_WAIT, "rank 0's restart", |l| {
            l.starts_with("restart requested ")
        });
        let took = self.asked.elapsed();
        let shown = format!("lines: {:?}\n--- stderr ---\n{}", r0.seen, r0.stderr());
        assert_eq!(field(&line, "pid"), pid0, "the same process: {shown}");
        let own = r0.stderr().lines().any(|l| {
            l.contains(&format!("(pid {pid0})")) && l.contains("shut down its process group's")
        });
        assert!(!r0.stderr().contains("leaving with exit 75"), "{shown}");
        (took, own, shown)
    }
}

/// [`Blocked`]; `plain`: the group made by `dist.init_process_group` itself.
async fn blocked_ranks(plain: bool, frozen_peer: bool) -> Blocked {
    let (state, agent) = start_agent("");
    let scratch = tempfile::tempdir().unwrap();
    let job = "blocked";
    let mut ranks: Vec<Streaming> = (0..2)
        .map(|rank| {
            let mut cmd = python_rank(
                &agent,
                "tests/fixtures/heal_blocked.py",
                job,
                (rank, 2),
                &[],
            );
            cmd.env("WARDEN_HEAL_STORE_DIR", scratch.path().join("stores"))
                .env(
                    "WARDEN_HEAL_FILE",
                    scratch.path().join(format!("heal-{rank}")),
                )
                .env("HEAL_BLOCKED_PLAIN_GROUP", if plain { "1" } else { "0" })
                .env_remove("WARDEN_HEAL_STUCK_S");
            spawn_python_rank(&agent, job, rank, &mut cmd)
        })
        .collect();
    let slow = TORCH_WAIT;
    for r in &mut ranks {
        r.wait_line(slow, "registered", |l| l.starts_with("registered "));
    }
    let line = ranks[0].wait_line(slow, "blocked", |l| l.starts_with("blocked "));
    let pid0 = field(&line, "pid").to_owned();
    if frozen_peer {
        ranks[1].signal(Signal::SIGSTOP);
    }
    let mut client = agent.client().await;
    client
        .request_restart(pb::RequestRestartRequest {
            job_id: job.into(),
            reason: "a heal of another rank".into(),
            ..Default::default()
        })
        .await
        .expect("RequestRestart");
    if !frozen_peer {
        ranks[1].wait_line(slow, "rank 1's restart", |l| {
            l.starts_with("restart requested ")
        });
    }
    Blocked {
        ranks,
        pid0,
        asked: std::time::Instant::now(),
        _agent: agent,
        _dirs: (state, scratch),
    }
}

/// The same with a group `warden.heal` did not make (no connections it
/// knows): rank 0 cannot be woken, and leaves by itself (exit 75) to be
/// healed.
#[tokio::test]
async fn a_healable_rank_blocked_in_a_collective_leaves_to_be_healed() {
    if !common::torch_available() {
        return;
    }
    // Bound whole: the agent and folders live to the test's end.
    let mut blocked = blocked_ranks(true, false).await;
    let (ranks, pid0, asked) = (&mut blocked.ranks, blocked.pid0.clone(), blocked.asked);
    let slow = TORCH_WAIT;
    let status = ranks[0].wait_exit(slow);
    let took = asked.elapsed();
    ranks[0].drain(WAIT);
    let shown = format!(
        "lines: {:?}\n--- stderr ---\n{}",
        ranks[0].seen,
        ranks[0].stderr()
    );
    assert_eq!(status.code(), Some(75), "{shown}");
    let said = ranks[0]
        .stderr()
        .lines()
        .any(|l| l.contains(&format!("(pid {pid0})")) && l.contains("leaving with exit 75"));
    assert!(said, "no leaving line: {shown}");
    assert!(
        !ranks[0].seen.iter().any(|l| l == "the collective returned"),
        "{shown}"
    );
    eprintln!(
        "rank 0 left {:.2} s after rank 1 took the restart (threshold 1 s)",
        took.as_secs_f64()
    );
}
