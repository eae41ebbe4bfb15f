//! A notice of a coming stop, end to end: the real `wardend`, the real
//! `warden run`, real Python ranks (tests/fixtures/notice_train.py: the
//! `warden` package, no torch) saving into the agent's tier every 100
//! steps. Between two of those checkpoints the job gets a notice, from the
//! scheduler (SIGTERM to `warden run --term-grace`) or from the host (the
//! GCE metadata server's `instance/preempted`, served by a test server on
//! 127.0.0.6 that speaks the long-poll protocol). Every rank saves the
//! same step, the launcher exits 85 ("preempted: requeue me") within the
//! window, the agent shows the notice (events, `warden health`, metrics)
//! and books the stop as planned (no incident, no detection wait or
//! restart downtime), and the next run starts at the step after the
//! notice's save.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;
#[path = "common/metadata.rs"]
mod metadata;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Streaming, TestAgent, WARDEN, eventually, python, repo_root};
use nix::sys::signal::Signal;
use warden_proto::v1 as pb;

/// A whole run may take this long on a loaded machine.
const RUN: Duration = Duration::from_secs(120);
/// `--term-grace`: the scheduler's SIGTERM to SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(30);

/// Straggler detection off: two ranks sharing a loaded 2-core machine
/// straggle by CPU contention, an incident that is not this test's.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [straggler]\nenabled = false\n";

/// The launcher's command: 2 workers of notice_train.py on `agent`.
fn launcher(agent: &TestAgent, dir: &Path, job: &str, opts: &[&str], train: &[&str]) -> Command {
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", job])
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--summary-json")
        .arg(dir.join("summary.json"))
        .args(opts)
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/notice_train.py"))
        // 20 ms steps: the notice (SIGTERM or the server's change, the agent's
        // tick, the slot) has 90 steps, 1.8 s, to arrive before step 200.
        .args(["--every", "100", "--step-ms", "20"])
        .args(train)
        .current_dir(dir);
    cmd
}

/// The value of `key=` in a line.
fn value(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..].split_whitespace().next()?.parse().ok()
}

/// Waits until both ranks printed a line with `what`.
fn both(l: &mut Streaming, what: &str) -> [String; 2] {
    let mut found: [Option<String>; 2] = [None, None];
    for (r, f) in found.iter_mut().enumerate() {
        if let Some(line) = l
            .seen
            .iter()
            .find(|x| x.starts_with(&format!("[rank {r}]")) && x.contains(what))
        {
            *f = Some(line.clone());
        }
    }
    while found.iter().any(Option::is_none) {
        let line = l.wait_line(RUN, what, |x| x.contains(what));
        for (r, f) in found.iter_mut().enumerate() {
            if line.starts_with(&format!("[rank {r}]")) {
                *f = Some(line.clone());
            }
        }
    }
    found.map(Option::unwrap)
}

/// Runs a first attempt to past its checkpoint at step 100, gives the
/// notice with `notify`, and checks what must hold of the stop; returns
/// the step saved on the notice.
fn noticed_run(
    agent: &TestAgent,
    dir: &Path,
    job: &str,
    opts: &[&str],
    notify: impl FnOnce(&Streaming),
    source: &str,
) -> u64 {
    let mut cmd = launcher(agent, dir, job, opts, &[]);
    let mut l = Streaming::spawn(&mut cmd, dir.join("launcher-1.stderr"));
    both(&mut l, "start step=0");
    both(&mut l, "saved step=100 ");
    // Well between the checkpoints at 100 and 200.
    both(&mut l, "] step 110");
    let noticed_at = Instant::now();
    notify(&l);
    let seen = both(&mut l, "notice source=");
    for s in &seen {
        assert!(s.contains(&format!("notice source={source} ")), "{s}");
    }
    let saved = both(&mut l, "saved on notice step=");
    let steps: Vec<u64> = saved.iter().map(|s| value(s, "step").unwrap()).collect();
    assert_eq!(
        steps[0], steps[1],
        "every rank saves the same step: {saved:?}"
    );
    let step = steps[0];
    assert!(
        step > 110 && step < 200,
        "the notice's step {step} is between the checkpoints"
    );
    assert_eq!(
        value(&seen[0], "save_at_step"),
        Some(step),
        "the rank saved at the step the agent named: {seen:?}"
    );
    let status = l.wait_exit(RUN);
    let took = noticed_at.elapsed();
    assert_eq!(status.code(), Some(85), "{}", l.stderr());
    assert!(
        took < TERM_GRACE,
        "the job stopped {took:?} after the notice: past the window"
    );
    println!(
        "{job}: notice to launcher exit in {} ms (saved step {step})",
        took.as_millis()
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["exit_code"], 85, "{summary:#}");
    // It says where the save went: one agent here, no peer: this host only.
    assert_eq!(summary["notice_checkpoint"]["step"], step, "{summary:#}");
    assert_eq!(
        summary["notice_checkpoint"]["off_host"], false,
        "{summary:#}"
    );
    assert!(
        l.stderr().contains(&format!(
            "the notice's checkpoint: step {step}, complete for every rank, on this host only"
        )),
        "{}",
        l.stderr()
    );
    assert!(
        summary["outcome"]
            .as_str()
            .unwrap()
            .starts_with("preempted: every worker saved"),
        "{summary:#}"
    );
    step
}

/// What the agent must show after the stop: the notice event, the ranks'
/// exits as planned stops, no incident, nothing booked as a failure.
async fn planned_stop(agent: &TestAgent, job: &str, source: &str) {
    let events = eventually(
        Duration::from_secs(20),
        "the job's rank exits",
        async || {
            let ev = agent.events().await;
            let exits = ev
                .iter()
                .filter(|e| {
                    e.subject.starts_with(&format!("job/{job}/"))
                        && (e.kind == "rank.exited" || e.kind == "rank.deregistered")
                })
                .count();
            (exits >= 2).then_some(ev)
        },
    )
    .await;
    let raised = events
        .iter()
        .find(|e| e.kind == "notice.raised" && e.subject == format!("job/{job}"))
        .unwrap_or_else(|| panic!("no notice.raised for {job}: {events:?}"));
    assert_eq!(
        common::evidence(raised, "source"),
        Some(source),
        "{raised:?}"
    );
    for e in events
        .iter()
        .filter(|e| e.kind == "rank.exited" && e.subject.starts_with(&format!("job/{job}/")))
    {
        assert_eq!(e.severity, pb::Severity::Info as i32, "{e:?}");
    }
    let mut client = agent.client().await;
    let incidents = client
        .get_incidents(pb::GetIncidentsRequest {
            job_id: job.into(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(incidents.incidents.is_empty(), "{incidents:?}");
    let g = client
        .get_goodput(pb::GetGoodputRequest { job_id: job.into() })
        .await
        .unwrap()
        .into_inner();
    let j = &g.jobs[0];
    for cause in ["detection_wait", "restart_downtime", "lost_progress"] {
        let s = j
            .parts
            .iter()
            .find(|p| p.cause == cause)
            .map_or(0.0, |p| p.accelerator_seconds);
        assert!(s == 0.0, "{cause} booked {s}s for a planned stop: {j:?}");
    }
    assert_eq!(j.recovery.as_ref().map_or(0, |r| r.restarts), 0, "{j:?}");
}

/// The next run resumes at the step after the notice's save.
fn resumed_run(agent: &TestAgent, dir: &Path, job: &str, step: u64) {
    let end = (step + 20).to_string();
    let mut cmd = launcher(agent, dir, job, &[], &["--steps", &end]);
    let mut l = Streaming::spawn(&mut cmd, dir.join("launcher-2.stderr"));
    let starts = both(&mut l, "start step=");
    for s in &starts {
        assert_eq!(
            value(s, "step"),
            Some(step + 1),
            "resumed after the notice's step {step}: {s}"
        );
    }
    both(&mut l, "done");
    assert_eq!(l.wait_exit(RUN).code(), Some(0), "{}", l.stderr());
}

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::Builder::new()
        .prefix("warden-notice-")
        .tempdir()
        .unwrap();
    let p = d.path().to_path_buf();
    (d, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_term_grace_saves_every_rank_at_one_step_exits_85_and_the_next_run_resumes_there()
 {
    let agent = TestAgent::start(AGENT_TOML);
    let (_d, dir) = scratch();
    let grace = format!("{}s", TERM_GRACE.as_secs());
    let step = noticed_run(
        &agent,
        &dir,
        "t-notice-term",
        &["--term-grace", &grace],
        |l| l.signal(Signal::SIGTERM),
        "launcher",
    );
    planned_stop(&agent, "t-notice-term", "launcher").await;
    resumed_run(&agent, &dir, "t-notice-term", step);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gce_preemption_notice_makes_every_rank_save_and_the_job_exit_85() {
    let gce = metadata::Gce::start("127.0.0.6").await;
    let agent = TestAgent::start(&format!(
        "{AGENT_TOML}[notice]\nallow_user_endpoints = true\n\
         [notice.gce]\nenabled = \"on\"\nurl = \"{}\"\nwait = \"30s\"\n",
        gce.url()
    ));
    // The agent's long-polls hold before anything is asked of the job.
    eventually(
        Duration::from_secs(20),
        "the agent's long-polls",
        async || (gce.waiting() >= 2).then_some(()),
    )
    .await;
    let (_d, dir) = scratch();
    let job = "t-notice-gce";
    let g = gce.clone();
    let step = noticed_run(
        &agent,
        &dir,
        job,
        &[],
        move |_| g.set("instance/preempted", Some("TRUE")),
        "gce",
    );
    planned_stop(&agent, job, "gce").await;
    // `warden health`: the notice component is DEGRADED with the reason.
    let out = Command::new(WARDEN)
        .arg("--socket")
        .arg(agent.socket())
        .arg("health")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("notice"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        row.contains("DEGRADED") && row.contains("instance/preempted = TRUE"),
        "{text}"
    );
    // Metrics: the notice is active and counted.
    let (scrape, raw) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(&scrape, "warden_notice_active", &[("source", "gce")]),
        1.0,
        "{raw}"
    );
    assert!(
        common::sample(&scrape, "warden_notices_total", &[("source", "gce")]) >= 1.0,
        "{raw}"
    );
    // The VM came back (a new one, in real life): the notice clears, and
    // the requeued job resumes at the notice's step.
    gce.set("instance/preempted", Some("FALSE"));
    eventually(Duration::from_secs(20), "the notice cleared", async || {
        let (s, _) = common::scrape(&agent).await;
        (common::sample(&s, "warden_notice_active", &[("source", "gce")]) == 0.0).then_some(())
    })
    .await;
    resumed_run(&agent, &dir, job, step);
}
