//! System tests of `warden run` with real processes: the real `warden`
//! binary launching the toy training job `examples/train.py` as real Python
//! workers (the `warden` package, no torch), with faults injected: a crash
//! comes back through an in-job restart, a hang through the agent's
//! in-process restart, a user exception stops the job with its code and
//! diagnosis, orphans and signals leave nothing behind, a wardend that
//! runs is used instead of an embedded agent, and a restart loop that
//! makes no progress stops with 88 (its agent records the stop as an
//! incident, event and metric; an agent that does not costs the stop
//! nothing) while one whose checkpoints advance runs on.
//!
//! Each launcher gets its own scratch directory for logs, checkpoints and
//! (through the log directory) its embedded agent's state; `--socket` points
//! at a path where no agent answers, so the launcher embeds one on a private
//! socket even on a machine that runs a wardend.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Finished, Streaming, TestAgent, WARDEN, eventually, python, repo_root, run};
use nix::sys::signal::Signal;
use serde_json::Value;
use warden_proto::v1 as pb;

/// A whole launcher run may take this long (Python start-up on a busy
/// machine, a restart, the agent's settle time).
const RUN: Duration = Duration::from_secs(90);

/// The embedded agent's config: fast ticks and hang thresholds of about a
/// second once calibrated; no kernel log or NVML (the test machines have
/// neither reliably).
///
/// The checkpoint tier reads DEGRADED (nearly full) on every run, whatever
/// the host's disk holds: CI's fresh clone once ran on a disk 8.9% free,
/// and a warning about the next save must not turn a hang or a crash into
/// the node's fault.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    checkpoint_degraded_below_percent = 100.0\n\
    [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n";

/// A scratch directory for one launcher: logs, checkpoints, agent config.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-run-")
            .tempdir()
            .expect("create a scratch directory");
        let s = Self { dir };
        std::fs::write(s.path().join("agent.toml"), s.agent_toml(""))
            .expect("write the agent config");
        s
    }

    /// [`AGENT_TOML`] with the checkpoint tier in the scratch directory (a
    /// job id reused by an earlier run must not find that run's saves in the
    /// host-wide default tier), then `extra`.
    fn agent_toml(&self, extra: &str) -> String {
        format!(
            "{AGENT_TOML}[checkpoint]\ndir = \"{}\"\n{extra}",
            self.path().join("tier").display()
        )
    }

    /// The agent's config with `extra` appended (a policy for one test).
    fn agent_config(self, extra: &str) -> Self {
        std::fs::write(self.path().join("agent.toml"), self.agent_toml(extra))
            .expect("write the agent config");
        self
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn logs(&self) -> PathBuf {
        self.path().join("logs")
    }

    /// `warden --socket <none> run --nproc-per-node N <opts> -- python
    /// examples/train.py --ckpt-dir <scratch>/ckpt <train>`.
    fn command(&self, job: &str, nproc: u32, opts: &[&str], train: &[&str]) -> Command {
        let config = self.path().join("agent.toml");
        self.command_on(
            &self.path().join("no-agent-here.sock"),
            Some(&config),
            job,
            nproc,
            opts,
            train,
        )
    }

    /// As [`Scratch::command`], with the agent at `socket` (a wardend the
    /// test started, read after the launcher ended) and the embedded
    /// agent's config, if any.
    fn command_on(
        &self,
        socket: &Path,
        agent_config: Option<&Path>,
        job: &str,
        nproc: u32,
        opts: &[&str],
        train: &[&str],
    ) -> Command {
        let mut cmd = Command::new(WARDEN);
        cmd.arg("--socket")
            .arg(socket)
            .arg("run")
            .args(["--nproc-per-node", &nproc.to_string()])
            .args(["--rdzv-id", job])
            .arg("--log-dir")
            .arg(self.logs());
        if let Some(config) = agent_config {
            cmd.arg("--agent-config").arg(config);
        }
        cmd.arg("--summary-json")
            .arg(self.path().join("summary.json"))
            .args(opts)
            .arg("--")
            .arg(python())
            .arg(repo_root().join("examples/train.py"))
            .arg("--ckpt-dir")
            .arg(self.path().join("ckpt"))
            .args(train)
            .current_dir(self.path());
        cmd
    }

    fn summary(&self) -> Value {
        let text = std::fs::read_to_string(self.path().join("summary.json"))
            .expect("the launcher wrote its summary");
        serde_json::from_str(&text).expect("the summary is JSON")
    }
}

/// A launcher running in the background: its stdout read line by line with
/// deadlines, its stderr in a file; killed and reaped when dropped.
type Launched = Streaming;

fn show(f: &Finished) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        f.status, f.stdout, f.stderr
    )
}

/// Values of `key=` in the worker lines `[rank R] <prefix> ... key=V`.
fn values(out: &str, prefix: &str, key: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.split_once("] ").map(|(_, rest)| rest))
        .filter(|rest| rest.starts_with(prefix))
        .filter_map(|rest| {
            rest.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{key}=")))
                .map(str::to_owned)
        })
        .collect()
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next().map(str::to_owned))
        })
        .is_some_and(|state| state != "Z" && state != "X")
}

/// Pids of live processes whose environment names `launcher` as theirs.
fn marked(launcher: u32) -> Vec<i32> {
    let want = format!("WARDEN_LAUNCHER_PID={launcher}");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()))
        })
        .filter(|pid| alive(*pid))
        .collect()
}

#[test]
fn clean_run_sets_the_torch_environment_and_keeps_per_rank_logs() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-clean",
            2,
            &[],
            &["--steps", "6", "--step-ms", "10", "--print-env"],
        ),
        RUN,
    );
    assert_eq!(out.code(), 0, "{}", show(&out));
    assert!(
        out.stderr.contains("running the agent embedded"),
        "{}",
        show(&out)
    );
    // Every worker line on the console carries its rank.
    for rank in 0..2 {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with(&format!("[rank {rank}] done steps=6"))),
            "{}",
            show(&out)
        );
    }
    assert!(
        out.stdout.lines().all(|l| l.starts_with("[rank ")),
        "{}",
        show(&out)
    );
    let envs: Vec<Value> = out
        .stdout
        .lines()
        .filter_map(|l| l.split_once("] env ").map(|(_, j)| j))
        .map(|j| serde_json::from_str(j).unwrap())
        .collect();
    assert_eq!(envs.len(), 2, "{}", show(&out));
    for e in &envs {
        let rank = e["RANK"].as_str().unwrap();
        assert_eq!(e["LOCAL_RANK"], rank);
        assert_eq!(e["ROLE_RANK"], rank);
        assert_eq!(e["WORLD_SIZE"], "2");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(e["ROLE_WORLD_SIZE"], "2");
        assert_eq!(e["GROUP_RANK"], "0");
        assert_eq!(e["ROLE_NAME"], "default");
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
        assert!(e["MASTER_PORT"].as_str().unwrap().parse::<u16>().unwrap() > 0);
        assert_eq!(e["TORCHELASTIC_RESTART_COUNT"], "0");
        assert_eq!(e["WARDEN_RESTART_COUNT"], "0");
        assert_eq!(e["TORCHELASTIC_RUN_ID"], "t-clean");
        assert_eq!(e["WARDEN_JOB_ID"], "t-clean");
        assert_eq!(e["TORCHELASTIC_USE_AGENT_STORE"], "False");
        assert_eq!(e["OMP_NUM_THREADS"], "1");
        assert_eq!(e["PYTHONUNBUFFERED"], "1");
        // On one host a lost peer's heal may wait behind another heal and
        // its standby (`supervise::LOCAL_HEAL_PEER_WAIT`), not the client's
        // own 2 s.
        assert_eq!(e["WARDEN_HEAL_PEER_WAIT_S"], "40.0");
        assert!(
            e["WARDEN_SOCKET"]
                .as_str()
                .unwrap()
                .ends_with("wardend.sock")
        );
    }
    let attempt = s.logs().join("t-clean/attempt_0");
    for rank in 0..2 {
        let log = std::fs::read_to_string(attempt.join(format!("rank_{rank}.stdout.log")))
            .expect("the rank's stdout log");
        assert!(log.contains("done steps=6"), "{log}");
        assert!(
            !log.contains("[rank"),
            "log files hold the raw lines: {log}"
        );
        assert!(attempt.join(format!("rank_{rank}.stderr.log")).exists());
    }
    assert!(!s.logs().join("t-clean/attempt_1").exists());
    let summary = s.summary();
    assert_eq!(summary["exit_code"], 0);
    assert_eq!(summary["attempts"].as_array().unwrap().len(), 1);
}

/// torchrun's console options act as torchrun's (issue 33): only local
/// rank 0 on the console, with the prefix template; every rank still in
/// its log files; lines with a filter word also in `filtered_stdout.log`.
/// An option nobody knows is refused with 2, never started as the program.
#[test]
fn torchruns_console_options_shape_the_console_and_an_unknown_one_is_refused() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-console",
            2,
            &[
                "--tee",
                "3",
                "--local-ranks-filter",
                "0",
                "--role",
                "trainer",
                "--log-line-prefix-template",
                "${role_name}${local_rank}/${rank}: ",
                "--duplicate-stdout-filters",
                "done steps",
                "--monitor-interval",
                "0.1",
            ],
            &["--steps", "4", "--step-ms", "10"],
        ),
        RUN,
    );
    assert_eq!(out.code(), 0, "{}", show(&out));
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("trainer0/0: done steps=4")),
        "{}",
        show(&out)
    );
    assert!(
        out.stdout.lines().all(|l| l.starts_with("trainer0/0: ")),
        "only local rank 0 on the console: {}",
        show(&out)
    );
    let attempt = s.logs().join("t-console/attempt_0");
    let log = std::fs::read_to_string(attempt.join("rank_1.stdout.log")).expect("rank 1's log");
    assert!(log.contains("done steps=4"), "{log}");
    let filtered =
        std::fs::read_to_string(attempt.join("filtered_stdout.log")).expect("the filtered file");
    assert_eq!(
        filtered
            .lines()
            .filter(|l| l.contains("done steps=4"))
            .count(),
        2,
        "both ranks' matching lines: {filtered}"
    );
    assert!(
        filtered.lines().all(|l| l.contains("done steps")),
        "{filtered}"
    );

    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(s.path().join("no-agent-here.sock"))
            .args(["run", "--tee-everything", "3", "train.py"])
            .current_dir(s.path()),
        RUN,
    );
    assert_eq!(out.code(), 2, "{}", show(&out));
    assert!(
        out.stderr
            .contains("unknown option \"--tee-everything\" before the program"),
        "{}",
        show(&out)
    );
    assert!(!out.stderr.contains("cannot start"), "{}", show(&out));
}

#[test]
fn a_crash_comes_back_through_an_in_job_restart_from_the_checkpoint() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-crash",
            2,
            &[],
            &[
                "--steps",
                "12",
                "--step-ms",
                "10",
                "--crash-at-step",
                "5",
                "--crash-rank",
                "1",
            ],
        ),
        RUN,
    );
    assert_eq!(out.code(), 0, "{}", show(&out));
    assert!(
        out.stdout.contains("[rank 1] crash: os._exit(3) at step 5"),
        "{}",
        show(&out)
    );
    // Attempt 1 ran with the next restart count and resumed from the
    // checkpoint saved at step 5.
    assert!(
        out.stdout
            .contains("[rank 1] resumed from checkpoint at step 5"),
        "{}",
        show(&out)
    );
    assert!(
        values(&out.stdout, "ready", "restart").contains(&"1".to_owned()),
        "{}",
        show(&out)
    );
    assert!(
        out.stdout.contains("[rank 1] done steps=12"),
        "{}",
        show(&out)
    );
    assert!(
        s.logs()
            .join("t-crash/attempt_1/rank_1.stdout.log")
            .exists()
    );
    // The summary names the diagnosis and the decision.
    assert!(out.stderr.contains("diagnosis: inc-"), "{}", show(&out));
    assert!(
        out.stderr.contains("decision: restart_in_job"),
        "{}",
        show(&out)
    );
    let summary = s.summary();
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{summary:#}");
    let inc = &attempts[0]["incident"];
    assert_eq!(inc["kind"], "crash", "{summary:#}");
    assert_eq!(inc["action"], "restart_in_job", "{summary:#}");
    assert_eq!(inc["decided_by"], "policy", "{summary:#}");
    assert!(
        inc["summary"].as_str().unwrap().contains("code 3"),
        "{summary:#}"
    );
    assert!(attempts[0]["restart"]["registered_ms"].as_f64().is_some());
}

#[test]
fn a_repeating_user_exception_stops_the_job_with_its_code_and_diagnosis() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-user",
            2,
            &[],
            &[
                "--steps",
                "200",
                "--step-ms",
                "10",
                "--raise-at-step",
                "3",
                "--raise-rank",
                "0",
            ],
        ),
        RUN,
    );
    // Python's own status for an uncaught exception: the scheduler sees it.
    assert_eq!(out.code(), 1, "{}", show(&out));
    assert!(out.stderr.contains("user_error"), "{}", show(&out));
    assert!(out.stderr.contains("ValueError"), "{}", show(&out));
    assert!(out.stderr.contains("decision: stop"), "{}", show(&out));
    // No loop: one attempt, and the other worker was stopped.
    assert!(
        !s.logs().join("t-user/attempt_1").exists(),
        "{}",
        show(&out)
    );
    let summary = s.summary();
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{summary:#}");
    assert_eq!(attempts[0]["incident"]["class"], "user_error");
    assert!(
        !out.stdout.contains("[rank 1] done"),
        "rank 1 was stopped: {}",
        show(&out)
    );
}

#[test]
fn a_crash_that_repeats_at_the_same_step_stops_after_one_restart() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-repeat",
            2,
            &[],
            &[
                "--steps",
                "200",
                "--step-ms",
                "10",
                "--crash-at-step",
                "5",
                "--crash-rank",
                "1",
                "--crash-code",
                "7",
                "--crash-every-attempt",
            ],
        ),
        RUN,
    );
    // The second crash is a new incident of the restarted workers; the same
    // failure at the same step is the code's: stop with the rank's status.
    assert_eq!(out.code(), 7, "{}", show(&out));
    assert!(out.stderr.contains("repeat_at_step"), "{}", show(&out));
    let summary = s.summary();
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{summary:#}");
    assert_eq!(attempts[0]["incident"]["action"], "restart_in_job");
    assert_eq!(attempts[1]["incident"]["class"], "user_error");
    assert_eq!(attempts[1]["incident"]["action"], "stop");
    assert!(!s.logs().join("t-repeat/attempt_2").exists());
}

#[test]
fn orphans_that_ignore_sigterm_are_killed_and_reaped() {
    let s = Scratch::new();
    let mut cmd = s.command(
        "t-orphans",
        2,
        &["--stop-grace", "500ms"],
        &[
            "--steps",
            "12",
            "--step-ms",
            "10",
            "--crash-at-step",
            "5",
            "--crash-rank",
            "1",
            "--orphan",
        ],
    );
    let mut launcher = Launched::spawn(&mut cmd, s.path().join("launcher.stderr"));
    let pid = launcher.pid();
    let mut orphans = Vec::new();
    while orphans.len() < 2 {
        let line = launcher.wait_line(RUN, "an orphan's pid", |l| l.contains("] orphan pid="));
        orphans.push(values(&line, "orphan", "pid")[0].parse::<i32>().unwrap());
    }
    let status = launcher.wait_exit(RUN);
    assert_eq!(status.code(), Some(0), "{}", launcher.stderr());
    assert!(
        launcher.stderr().contains("2 orphaned processes"),
        "{}",
        launcher.stderr()
    );
    for o in orphans {
        assert!(!alive(o), "orphan {o} outlived the restart");
    }
    assert_eq!(
        marked(pid),
        Vec::<i32>::new(),
        "processes of the job are left"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_the_workers_and_exits_143() {
    let s = Scratch::new();
    let mut cmd = s.command(
        "t-sigterm",
        2,
        &[],
        &["--steps", "100000", "--step-ms", "10"],
    );
    let mut launcher = Launched::spawn(&mut cmd, s.path().join("launcher.stderr"));
    let pid = launcher.pid();
    let mut workers = Vec::new();
    while workers.len() < 2 {
        let line = launcher.wait_line(RUN, "a worker ready", |l| l.contains("] ready pid="));
        workers.push(values(&line, "ready", "pid")[0].parse::<i32>().unwrap());
    }
    launcher.wait_line(RUN, "a step", |l| l.contains("] step 5 "));
    launcher.signal(Signal::SIGTERM);
    let status = launcher.wait_exit(RUN);
    assert_eq!(status.code(), Some(143), "{}", launcher.stderr());
    assert!(
        launcher.stderr().contains("got SIGTERM"),
        "{}",
        launcher.stderr()
    );
    for w in workers {
        assert!(!alive(w), "worker {w} outlived the launcher");
    }
    assert_eq!(marked(pid), Vec::<i32>::new());
}

#[tokio::test]
async fn a_running_wardend_is_used_instead_of_an_embedded_agent() {
    let agent = TestAgent::start(AGENT_TOML);
    let s = Scratch::new();
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", "t-local"])
        .arg("--log-dir")
        .arg(s.logs())
        .arg("--")
        .arg(python())
        .arg(repo_root().join("examples/train.py"))
        .arg("--ckpt-dir")
        .arg(s.path().join("ckpt"))
        .args(["--steps", "100000", "--step-ms", "10"]);
    let mut launcher = Launched::spawn(&mut cmd, s.path().join("launcher.stderr"));
    for _ in 0..2 {
        launcher.wait_line(RUN, "a worker ready", |l| l.contains("] ready pid="));
    }
    let mut client = agent.client().await;
    let ranks = eventually(
        Duration::from_secs(20),
        "the job's ranks in GetRanks",
        async || {
            let r = client
                .get_ranks(pb::GetRanksRequest {
                    job_id: "t-local".into(),
                })
                .await
                .ok()?
                .into_inner();
            (r.ranks.len() == 2).then_some(r)
        },
    )
    .await;
    assert!(
        ranks.ranks.iter().all(|r| r.state == "running"),
        "{ranks:?}"
    );
    assert!(
        launcher.stderr().contains("using the local wardend"),
        "{}",
        launcher.stderr()
    );
    assert!(
        !launcher.stderr().contains("embedded"),
        "{}",
        launcher.stderr()
    );
    // Stopping the job on purpose is no incident for the agent.
    launcher.signal(Signal::SIGINT);
    let started = Instant::now();
    let status = launcher.wait_exit(RUN);
    assert_eq!(status.code(), Some(130), "{}", launcher.stderr());
    assert!(started.elapsed() < Duration::from_secs(10));
    let exited = eventually(
        Duration::from_secs(10),
        "both rank.exited events",
        async || {
            let events = agent.events().await;
            let ex: Vec<pb::Event> = events
                .into_iter()
                .filter(|e| e.kind == "rank.exited" && e.subject.starts_with("job/t-local/"))
                .collect();
            (ex.len() == 2).then_some(ex)
        },
    )
    .await;
    for e in &exited {
        assert_eq!(e.severity, pb::Severity::Info as i32, "{e:?}");
        assert!(
            common::evidence(e, "stopped_by").is_some_and(|v| v.starts_with("launcher: ")),
            "{e:?}"
        );
    }
    let incidents = agent
        .client()
        .await
        .get_incidents(pb::GetIncidentsRequest {
            job_id: "t-local".into(),
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(incidents.incidents.is_empty(), "{incidents:?}");
}

#[test]
fn a_hang_comes_back_through_the_agents_in_process_restart() {
    let s = Scratch::new();
    let out = run(
        &mut s.command(
            "t-hang",
            2,
            &[],
            &[
                "--steps",
                "30",
                "--step-ms",
                "20",
                "--hang-at-step",
                "10",
                "--hang-rank",
                "1",
            ],
        ),
        RUN,
    );
    assert_eq!(out.code(), 0, "{}", show(&out));
    assert!(out.stdout.contains("[rank 1] hang:"), "{}", show(&out));
    assert!(
        out.stderr.contains("decision: restart_in_process"),
        "{}",
        show(&out)
    );
    // The same processes resumed: no second attempt, no respawn.
    assert!(
        !s.logs().join("t-hang/attempt_1").exists(),
        "{}",
        show(&out)
    );
    assert!(
        out.stdout
            .contains("[rank 1] resumed from checkpoint at step 10"),
        "{}",
        show(&out)
    );
    assert!(
        out.stdout.contains("[rank 1] done steps=30"),
        "{}",
        show(&out)
    );
    let rank1: Vec<String> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("[rank 1] ready"))
        .flat_map(|l| values(l, "ready", "pid"))
        .collect();
    assert_eq!(rank1.len(), 2, "{}", show(&out));
    assert_eq!(rank1[0], rank1[1], "the same process: {}", show(&out));
}

/// The policy the long job runs under: a failure of unknown class
/// (or transient software) may restart the job 12 times an hour, so only `--max-restarts 12` and the
/// no-progress rule can end a restart loop.
const LONG_JOB_POLICY: &str = "[policy.unknown]\n\
    on_failure = [\"restart_in_job\"]\non_running = \"continue\"\n\
    budget = 12\nwindow = \"1h\"\nexhausted = \"stop\"\n\
    [policy.transient_software]\n\
    on_failure = [\"restart_in_job\"]\non_running = \"continue\"\n\
    budget = 12\nwindow = \"1h\"\nexhausted = \"stop\"\n";

/// A job restarted 4 times ends within this (Python start-up four times on
/// a loaded 2-core machine, the agent's settle time each time).
const LONG_RUN: Duration = Duration::from_secs(240);

/// The long job as `job`, on the agent at `socket`: it never
/// saves, and rank 1 dies at step 5, 8, 11, ... (another step each attempt).
fn no_progress_job(s: &Scratch, socket: &Path, job: &str) -> Command {
    s.command_on(
        socket,
        None,
        job,
        2,
        &["--max-restarts", "12"],
        &[
            "--steps",
            "500",
            "--step-ms",
            "10",
            // Never saves: every attempt starts again from step 0.
            "--ckpt-every",
            "0",
            // Dies at step 5, 8, 11, ...: another step each time.
            "--crash-at-step",
            "5",
            "--crash-step-shift",
            "3",
            "--crash-rank",
            "1",
            "--crash-every-attempt",
        ],
    )
}

/// The long job, under a wardend the test reads after the
/// launcher ended: the stop is the launcher's, and the agent shows it in
/// `warden incidents` (GetIncidents), events and metrics.
#[tokio::test(flavor = "multi_thread")]
async fn a_restart_loop_without_progress_stops_with_88_after_three_restarts() {
    let agent = TestAgent::start(&format!("{AGENT_TOML}{LONG_JOB_POLICY}"));
    let s = Scratch::new();
    let mut cmd = no_progress_job(&s, agent.socket(), "t-noprog");
    let out = tokio::task::spawn_blocking(move || run(&mut cmd, LONG_RUN))
        .await
        .expect("the launcher's run");
    assert_eq!(out.code(), 88, "{}", show(&out));
    for step in [5, 8, 11, 14] {
        assert!(
            out.stdout
                .contains(&format!("[rank 1] crash: os._exit(3) at step {step} ")),
            "step {step}: {}",
            show(&out)
        );
    }
    // The console's diagnosis, then the summary's.
    assert!(
        out.stderr.contains(
            "no progress in 3 restarts in a row: no checkpoint in the agent's tier, and the ranks' steps show no resume point later than step 0 (--max-no-progress-restarts 3): not restarting again"
        ),
        "{}",
        show(&out)
    );
    assert!(
        out.stderr
            .contains("decided by launcher (--max-no-progress-restarts 3)")
            || out
                .stderr
                .contains("launcher (--max-no-progress-restarts 3)"),
        "{}",
        show(&out)
    );
    // M + 1 = 4 attempts, not 13.
    assert!(
        !s.logs().join("t-noprog/attempt_4").exists(),
        "{}",
        show(&out)
    );
    let summary = s.summary();
    assert_eq!(summary["exit_code"], 88, "{summary:#}");
    assert!(
        summary["outcome"]
            .as_str()
            .unwrap()
            .starts_with("failed: no progress in 3 restarts in a row"),
        "{summary:#}"
    );
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 4, "{summary:#}");
    for a in &attempts[..3] {
        assert_eq!(a["incident"]["action"], "restart_in_job", "{summary:#}");
    }
    let last = &attempts[3];
    assert_eq!(last["incident"]["action"], "stop", "{summary:#}");
    assert_eq!(
        last["incident"]["decided_by"], "launcher (--max-no-progress-restarts 3)",
        "{summary:#}"
    );
    assert!(
        last["ended"]
            .as_str()
            .unwrap()
            .contains("restart refused (no progress)"),
        "{summary:#}"
    );

    // The agent heard the stop: an incident of the job, not of the node.
    assert!(
        out.stderr
            .contains("the agent recorded the stop as incident inc-"),
        "{}",
        show(&out)
    );
    let mut client = agent.client().await;
    let incidents = client
        .get_incidents(pb::GetIncidentsRequest {
            job_id: "t-noprog".into(),
            limit: 0,
        })
        .await
        .expect("GetIncidents")
        .into_inner();
    assert!(!incidents.cordoned, "a job's stop never cordons the node");
    let stops: Vec<&pb::Incident> = incidents
        .incidents
        .iter()
        .filter(|i| i.kind == "no_progress")
        .collect();
    assert_eq!(stops.len(), 1, "{incidents:#?}");
    let stop = stops[0];
    let decision = stop.decision.as_ref().expect("decided");
    assert_eq!(decision.action, pb::Action::Stop as i32, "{stop:#?}");
    assert_eq!(decision.exit_code, 88, "{stop:#?}");
    assert!(
        decision.decided_by.contains("--max-no-progress-restarts 3"),
        "{stop:#?}"
    );
    let diagnosis = stop.diagnosis.as_ref().expect("a diagnosis");
    assert_eq!(diagnosis.rule, "launcher.no_progress", "{stop:#?}");
    assert!(
        diagnosis
            .summary
            .starts_with("no progress in 3 restarts in a row"),
        "{stop:#?}"
    );
    // The evidence: each failed attempt's resume point (and the tier's
    // answer), the first failure included; and the incident the launcher
    // was acting on.
    for attempt in 0..4 {
        let subject = format!("attempt/{attempt}");
        assert!(
            diagnosis
                .evidence
                .iter()
                .any(|e| e.subject == subject && e.source == "launcher"),
            "no evidence about {subject}: {stop:#?}"
        );
    }
    assert!(
        diagnosis
            .evidence
            .iter()
            .any(|e| e.signal == "resumed_from" && e.value == "0"),
        "{stop:#?}"
    );
    assert!(
        diagnosis
            .evidence
            .iter()
            .any(|e| e.signal == "checkpoint.newest" && e.value == "none"),
        "{stop:#?}"
    );
    assert!(
        diagnosis
            .evidence
            .iter()
            .any(|e| e.signal == "incident" && e.value.starts_with("inc-")),
        "{stop:#?}"
    );
    // `warden incidents` shows it, with its evidence.
    let shown = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["incidents", "--job", "t-noprog", "--evidence"]),
        RUN,
    );
    assert_eq!(shown.code(), 0, "{}", show(&shown));
    for want in [
        format!("{}  no_progress  job t-noprog", stop.id),
        "no progress in 3 restarts in a row".to_owned(),
        "launcher.no_progress".to_owned(),
        "attempt/3".to_owned(),
    ] {
        assert!(shown.stdout.contains(&want), "{want:?}: {}", show(&shown));
    }
    // Its event, and the incident's own two.
    let events = client
        .list_events(pb::ListEventsRequest::default())
        .await
        .expect("ListEvents")
        .into_inner()
        .events;
    let stopped = events
        .iter()
        .find(|e| e.kind == "job.stopped")
        .unwrap_or_else(|| panic!("no job.stopped event: {events:#?}"));
    assert_eq!(common::evidence(stopped, "reason"), Some("no_progress"));
    assert_eq!(common::evidence(stopped, "exit_code"), Some("88"));
    assert_eq!(common::evidence(stopped, "job"), Some("t-noprog"));
    assert!(
        events
            .iter()
            .any(|e| e.kind == "incident.decided" && e.subject == stop.id),
        "{events:#?}"
    );
    // Its metric.
    let (scrape, text) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(
            &scrape,
            "warden_job_stops_total",
            &[("reason", "no_progress")]
        ),
        1.0,
        "{text}"
    );
}

/// An agent that does not record the stop costs the stop nothing: the
/// launcher still exits 88 and says the agent was not told. (Here the agent
/// refuses: the job already has the 16 launcher stops it keeps; a stop it
/// keeps is never handed to a launcher as a decision.)
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_the_agent_does_not_record_still_exits_88_and_says_so() {
    let agent = TestAgent::start(&format!("{AGENT_TOML}{LONG_JOB_POLICY}"));
    let mut client = agent.client().await;
    for _ in 0..16 {
        client
            .report_job_stop(pb::ReportJobStopRequest {
                job_id: "t-untold".into(),
                reason: pb::JobStopReason::NoProgress as i32,
                summary: "an earlier run".into(),
                exit_code: 88,
                ..Default::default()
            })
            .await
            .expect("ReportJobStop below the cap");
    }
    let s = Scratch::new();
    let mut cmd = no_progress_job(&s, agent.socket(), "t-untold");
    let out = tokio::task::spawn_blocking(move || run(&mut cmd, LONG_RUN))
        .await
        .expect("the launcher's run");
    assert_eq!(out.code(), 88, "{}", show(&out));
    assert!(
        out.stderr.contains("the agent was not told of the stop (")
            && out.stderr.contains("16 launcher stops recorded"),
        "{}",
        show(&out)
    );
    assert!(
        !s.logs().join("t-untold/attempt_4").exists(),
        "{}",
        show(&out)
    );
    assert_eq!(s.summary()["exit_code"], 88);
}

#[test]
fn a_job_whose_checkpoint_advances_between_failures_is_not_stopped() {
    let s = Scratch::new().agent_config(LONG_JOB_POLICY);
    let out = run(
        &mut s.command(
            "t-progress",
            2,
            &["--max-restarts", "12"],
            &[
                "--steps",
                "30",
                "--step-ms",
                "10",
                // Saved in the agent's tier every 5 steps; each attempt
                // dies 2 steps after the one it resumed from + 5: at 7,
                // 12, 17, 22, 27, each time one checkpoint later.
                "--ckpt",
                "warden",
                "--ckpt-every",
                "5",
                "--crash-at-step",
                "7",
                "--crash-step-shift",
                "5",
                "--crash-rank",
                "1",
                "--crash-every-attempt",
            ],
        ),
        LONG_RUN,
    );
    // Five failures, more than --max-no-progress-restarts allows in a row
    // without progress: every one came after a newer checkpoint.
    assert_eq!(out.code(), 0, "{}", show(&out));
    assert!(
        out.stdout
            .contains("[rank 1] crash: os._exit(3) at step 27 "),
        "{}",
        show(&out)
    );
    assert!(
        out.stdout
            .contains("[rank 1] resumed from checkpoint at step 25"),
        "{}",
        show(&out)
    );
    assert!(
        out.stderr.contains(
            "progress since the last restart: the newest complete checkpoint went from step 20 to step 25"
        ),
        "{}",
        show(&out)
    );
    assert!(!out.stderr.contains("no progress"), "{}", show(&out));
    let summary = s.summary();
    assert_eq!(
        summary["attempts"].as_array().unwrap().len(),
        6,
        "{summary:#}"
    );
}
