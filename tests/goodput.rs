//! System test of the goodput ledger: the real `warden run` launching the
//! toy job `examples/train.py` as real Python workers, against a real
//! `wardend` that is a separate process, with a crash (an in-job restart), a
//! hang (the agent's in-process restart) and a `kill -9` of the agent in
//! between. The breakdown the launcher writes when the job ends must add
//! up to the wall time, count the steps redone after each restore as lost
//! progress, and still hold what was accounted before the agent died.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{Streaming, TestAgent, WARDEN, eventually, python, repo_root};
use serde_json::Value;
use warden_proto::v1 as pb;

/// The whole job may take this long.
const RUN: Duration = Duration::from_secs(120);
const JOB: &str = "t-goodput";
const STEP_MS: f64 = 100.0;

/// Fast ticks; a fixed hang threshold for "backward" (no calibration to
/// wait for after the agent restarts).
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n\
    [hang.timeouts]\nbackward = \"1500ms\"\n";

async fn goodput(agent: &TestAgent) -> Option<pb::JobGoodput> {
    agent
        .client()
        .await
        .get_goodput(pb::GetGoodputRequest { job_id: JOB.into() })
        .await
        .ok()?
        .into_inner()
        .jobs
        .into_iter()
        .next()
}

fn part(j: &pb::JobGoodput, cause: &str) -> f64 {
    j.parts
        .iter()
        .find(|p| p.cause == cause)
        .map_or(0.0, |p| p.accelerator_seconds)
}

/// Steps each rank completed again after a restart, from its own logs
/// (attempts in order): a step number at or below the highest one it had
/// completed before. `--report-every 1` prints every completed step as soon
/// as it is complete.
fn redone_steps(logs: &Path, ranks: u32) -> u64 {
    let mut total = 0;
    for rank in 0..ranks {
        let mut high: Option<u64> = None;
        for attempt in 0.. {
            let file = logs.join(format!("{JOB}/attempt_{attempt}/rank_{rank}.stdout.log"));
            let Ok(text) = std::fs::read_to_string(&file) else {
                break;
            };
            for line in text.lines() {
                let n = if let Some(rest) = line.strip_prefix("step ") {
                    rest.split_whitespace().next()
                } else {
                    None
                };
                let Some(n) = n.and_then(|n| n.parse::<u64>().ok()) else {
                    continue;
                };
                if high.is_some_and(|h| n <= h) {
                    total += 1;
                }
                high = Some(high.map_or(n, |h| h.max(n)));
            }
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_adds_up_counts_redone_steps_and_survives_a_kill_9_of_the_agent() {
    let agent = TestAgent::start(AGENT_TOML);
    let home: Arc<common::Home> = agent.home.clone();
    let scratch = tempfile::Builder::new()
        .prefix("warden-goodput-")
        .tempdir()
        .unwrap();
    let logs = scratch.path().join("logs");
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args([
            "--agent",
            "local",
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            JOB,
        ])
        .arg("--log-dir")
        .arg(&logs)
        .arg("--")
        .arg(python())
        .arg(repo_root().join("examples/train.py"))
        .arg("--ckpt-dir")
        .arg(scratch.path().join("ckpt"))
        .args(["--steps", "80", "--step-ms", &STEP_MS.to_string()])
        .args(["--ckpt-every", "10", "--report-every", "1"])
        // Attempt 0: rank 1 crashes after step 18 (restored from step 10).
        .args(["--crash-at-step", "18", "--crash-rank", "1"])
        // Attempt 1: rank 1 hangs in step 58 (restored from step 50). Well
        // after the agent's kill -9 below (at step 22 to 26): the steps a
        // rank makes while the agent is down are unobserved, idle in the
        // ledger, so if they were redone after the hang the log would count
        // them and the ledger could not. 24 steps (2.4 s) cover the agent's
        // restart on a loaded 2-core machine; 8 (the hang at 38) did not.
        .args([
            "--hang-at-step",
            "58",
            "--hang-rank",
            "1",
            "--hang-restart",
            "1",
        ]);
    let mut launcher = Streaming::spawn(&mut cmd, scratch.path().join("launcher.stderr"));
    launcher.wait_line(RUN, "rank 1's crash", |l| l.contains("] crash: os._exit"));
    // Past the steps redone after the crash (rank 1 restored step 10 and
    // had done 18; rank 0, stopped a few steps later, restored step 20): a step
    // made while the agent is down is unobserved (idle in the ledger), and
    // these must not be. One pass over the lines for both ranks: each rank's
    // standby is ready when its import ends, and on a loaded machine rank 0
    // was ten steps on (past its step 26) before rank 1 was ready, so a wait
    // for both ready lines first read rank 0's step line away. A step line
    // counts only after that rank's ready line of attempt 1, since rank 0,
    // stopped late, could pass step 26 in attempt 0.
    let deadline = std::time::Instant::now() + RUN;
    let (mut ready, mut past) = ([false, false], [false, false]);
    while !past.iter().all(|p| *p) {
        let line = launcher.wait_line(
            deadline.saturating_duration_since(std::time::Instant::now()),
            "both ranks ready in attempt 1 and past their redone steps",
            |l| {
                (l.contains("] ready pid=") && l.contains("restart=1"))
                    || l.starts_with("[rank 0] step 26 ")
                    || l.starts_with("[rank 1] step 22 ")
            },
        );
        let rank = usize::from(line.starts_with("[rank 1]"));
        if line.contains("] ready pid=") {
            ready[rank] = true;
        } else if ready[rank] {
            past[rank] = true;
        }
    }

    // The restart is accounted (a step after it seen) before the kill.
    let before = eventually(
        Duration::from_secs(60),
        "the ledger to count the in-job restart",
        async || {
            let j = goodput(&agent).await?;
            j.recovery
                .as_ref()
                .is_some_and(|r| r.restarts >= 1)
                .then_some(j)
        },
    )
    .await;
    // The crash came at a step's end: the step in flight on each rank
    // (under one step's baseline) is lost progress with the redone steps,
    // not detection wait.
    assert!(part(&before, "lost_progress") > 0.0, "{before:?}");
    assert!(part(&before, "restart_downtime") > 0.0, "{before:?}");
    // ... and written: the journal grows past what it held then.
    let journal = home.path().join(format!("state/goodput/{JOB}.jsonl"));
    let len_then = std::fs::metadata(&journal).map_or(0, |m| m.len());
    eventually(
        Duration::from_secs(10),
        "the journal to take the restart",
        async || (std::fs::metadata(&journal).map_or(0, |m| m.len()) > len_then).then_some(()),
    )
    .await;

    let mut agent = agent;
    agent.sigkill_and_wait();
    let agent = TestAgent::start_in(home.clone());
    let replayed = goodput(&agent)
        .await
        .expect("the new agent replayed the job's ledger");
    // Settled time only: a rank still down is reported with its downtime
    // up to the moment asked, which its next step settles a little lower.
    for cause in ["productive", "detection_wait", "startup", "startup_import"] {
        assert!(
            part(&replayed, cause) >= part(&before, cause) - 1e-6,
            "{cause}: {} before the kill, {} after the replay",
            part(&before, cause),
            part(&replayed, cause)
        );
    }
    assert!(replayed.recovery.as_ref().unwrap().restarts >= 1);

    // Either rank may finish first (they step apart).
    let mut done = [false, false];
    while !done.iter().all(|d| *d) {
        let line = launcher.wait_line(RUN, "both ranks' done lines", |l| {
            l.contains("] done steps=80")
        });
        done[usize::from(line.starts_with("[rank 1]"))] = true;
    }
    let status = launcher.wait_exit(RUN);
    assert_eq!(status.code(), Some(0), "{}", launcher.stderr());
    assert!(
        launcher.seen.iter().any(|l| l.contains("[rank 1] hang:")),
        "{:?}",
        launcher.seen
    );
    let text = std::fs::read_to_string(logs.join(JOB).join("goodput.json"))
        .unwrap_or_else(|e| panic!("goodput.json: {e}\n{}", launcher.stderr()));
    let g: Value = serde_json::from_str(&text).unwrap();
    let f = |v: &Value| {
        v.as_f64()
            .unwrap_or_else(|| panic!("not a number: {v} in {g:#}"))
    };
    let parts = g["parts"].as_object().unwrap();
    let sum: f64 = parts.values().map(|p| f(&p["accelerator_s"])).sum();
    let ranks = g["ranks"].as_u64().unwrap();
    assert_eq!(ranks, 2, "{g:#}");
    assert_eq!(g["open"], false, "{g:#}");
    // The parts add up to the wall time (x ranks) within 1%.
    let wall = f(&g["wall_s"]);
    assert!(
        (sum - wall * 2.0).abs() <= 0.01 * wall * 2.0,
        "parts sum to {sum} accelerator-s, wall {wall} s x 2 ranks: {g:#}\njournal:\n{}",
        std::fs::read_to_string(&journal).unwrap_or_default()
    );
    assert!((sum - f(&g["accelerator_s"])).abs() < 1e-6, "{g:#}");
    // Lost progress: the redone steps times the step time, plus the step
    // in flight at each incident (at most one step a rank: the crash and
    // the hang here), within 10%.
    let rec = &g["recovery"];
    let step_s = f(&rec["step_s"]);
    assert!(
        (step_s - STEP_MS / 1000.0).abs() < 0.3 * STEP_MS / 1000.0,
        "mean step {step_s} s for {STEP_MS} ms steps: {g:#}"
    );
    let redone = redone_steps(&logs, 2);
    assert!(redone >= 10, "redone steps {redone}");
    let expected = redone as f64 * step_s;
    let incidents = rec["restarts"].as_u64().unwrap_or(0).max(2) as f64;
    let in_flight = incidents * ranks as f64 * step_s;
    let lost = f(&parts["lost_progress"]["accelerator_s"]);
    assert!(
        lost >= 0.9 * expected && lost <= 1.1 * (expected + in_flight),
        "lost progress {lost} s, {redone} redone steps x {step_s} s = {expected} s, plus at most \
         {in_flight} s of steps in flight ({incidents} incidents x {ranks} ranks): {g:#}\njournal:\n{}",
        std::fs::read_to_string(&journal).unwrap_or_default()
    );
    // Both restarts (in job, in process) and the time before the kill.
    assert!(rec["restarts"].as_u64().unwrap() >= 2, "{g:#}");
    assert!(f(&rec["detection_s"]) > 0.0, "{g:#}");
    assert!(f(&rec["restart_downtime_s"]) > 0.0, "{g:#}");
    assert!(f(&rec["startup_s"]) > 0.0, "{g:#}");
    for cause in ["productive", "detection_wait", "startup"] {
        assert!(
            f(&parts[cause]["accelerator_s"]) >= part(&before, cause) - 1e-6,
            "{cause} shrank after the kill: {g:#}"
        );
    }
    // The hang's detection wait is at least its threshold (1.5 s) less
    // the step in flight (lost progress: one step of the rank's median,
    // within 30% of the mean step checked above) on the hung rank.
    let floor = 1.5 - 1.3 * step_s;
    assert!(
        f(&parts["detection_wait"]["accelerator_s"]) >= floor,
        "detection wait under {floor} s: {g:#}"
    );

    // `warden goodput --json` says the same as the file.
    let out = common::run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["goodput", "--job", JOB, "--json"]),
        Duration::from_secs(20),
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    let cli: Value = serde_json::from_str(&out.stdout).unwrap();
    let job = &cli["jobs"][0];
    assert_eq!(job["parts"], g["parts"], "{cli:#}\n{g:#}");
    assert_eq!(job["recovery"], g["recovery"], "{cli:#}\n{g:#}");
    // And the table.
    let out = common::run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["goodput", "--job", JOB]),
        Duration::from_secs(20),
    );
    assert!(out.stdout.contains("top causes: "), "{}", out.stdout);
    assert!(out.stdout.contains("lost_progress"), "{}", out.stdout);

    // Prometheus: the gauges per cause.
    let (scrape, text) = common::scrape(&agent).await;
    let productive = common::sample(
        &scrape,
        "warden_goodput_seconds",
        &[("job", JOB), ("cause", "productive")],
    );
    assert!(productive > 0.0, "{text}");
}

/// A survivor of a lost host waits for that host's heal in its client's
/// `heal_wait` section, in the same process, with no incident on its own
/// host. The real client against a real agent: the ledger books the wait as
/// the fault's (detection wait, then restart downtime, one restart), not
/// as idle time, which it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_survivors_wait_for_a_lost_peers_heal_is_a_restart_in_the_ledger() {
    const HEAL_JOB: &str = "t-heal-wait";
    // The rank idles between steps while the test asks the agent: no hang
    // for a slow answer on a loaded machine (an incident would add a
    // restart of its own).
    let agent = TestAgent::start(&format!("{AGENT_TOML}idle = \"30s\"\n"));
    let mut o = warden_client::ConnectOptions::from_env_lossy();
    o.socket_path = agent.socket().to_owned();
    o.job_id = HEAL_JOB.into();
    o.world_size = 1;
    o.connect_timeout = Duration::from_secs(30);
    let c = warden_client::Client::connect_with(o).expect("client");
    assert!(c.is_connected(), "{:?}", c.status());
    let step = |n: u64| {
        c.step_begin(n);
        std::thread::sleep(Duration::from_millis(20));
        c.step_end(n);
    };
    for n in 0..10 {
        step(n);
    }
    // Step 10 fails on the lost peer: its step ends with the error (as
    // Python's step context ends it), the client waits for the heal in
    // `heal_wait` (the wait is the workload here, 1.5 s), then does step 10
    // again.
    c.step_begin(10);
    c.step_end(10);
    {
        let _wait = c.section("heal_wait");
        std::thread::sleep(Duration::from_millis(1500));
    }
    for n in 10..20 {
        step(n);
    }
    // Again, from a client that marks only each step's start: step 20's
    // record stays open through the wait.
    c.step_begin(20);
    {
        let _wait = c.section("heal_wait");
        std::thread::sleep(Duration::from_millis(1500));
    }
    // Steps go on while the ledger is asked (an idle rank would be judged
    // hung): each step, then the question.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut n = 20;
    let j = loop {
        step(n);
        n += 1;
        let j = agent
            .client()
            .await
            .get_goodput(pb::GetGoodputRequest {
                job_id: HEAL_JOB.into(),
            })
            .await
            .ok()
            .and_then(|r| r.into_inner().jobs.into_iter().next());
        if let Some(j) = j.filter(|j| j.recovery.as_ref().is_some_and(|r| r.restarts >= 2)) {
            break j;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ledger never counted both heals as restarts: {:?}\n{}",
            agent
                .client()
                .await
                .get_goodput(pb::GetGoodputRequest {
                    job_id: HEAL_JOB.into(),
                })
                .await
                .map(|r| r.into_inner()),
            agent.stderr()
        );
    };
    let (down, idle) = (part(&j, "restart_downtime"), part(&j, "idle"));
    // Two waits of 1.5 s: restart downtime, not idle (the gaps between
    // steps while the test asks the ledger are idle, well under a wait).
    assert!(down >= 2.4, "restart downtime {down} s: {j:?}");
    assert!(idle < 1.5, "idle {idle} s: {j:?}");
    drop(c);
}
