//! Warm in-job restarts from standby interpreters with real PyTorch (gloo on
//! CPU): the plain DDP script (tests/fixtures/torch_plain.py), 2 ranks, rank
//! 1 exits with code 3 mid-training, once cold (`--no-standby`) and once
//! warm (the default), in the same test run.
//!
//! Both finish the second attempt with identical weights on both ranks. The
//! warm run's restarted ranks are the standby interpreters the launcher
//! started before the crash (the console names them, and the ranks' own
//! `pid=` says they are those processes); the cold one's are not. Neither
//! leaves a standby behind. The time from the crash to every rank's first
//! step of the new attempt is printed for both (docs/benchmarks.md), not
//! asserted: tests do not assert speed.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it);
//! skips, saying so, only when torch is missing and `WARDEN_REQUIRE_TORCH`
//! is unset.
//!
//! Without torch: a SIGTERM while a restart waits for a standby still
//! importing (a `--preload` module that never finishes) stops the job
//! with 143 at once, and no standby outlives it.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Finished, Streaming, WARDEN, python, repo_root, run, torch_available};
use nix::sys::signal::Signal;

/// A whole run: four interpreters importing torch at once on a loaded
/// 2-core machine, then the restart.
const RUN: Duration = Duration::from_secs(300);

/// The embedded agent: no kernel log or NVML, host memory never a fault.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n";

/// Rank 1 exits at step 60 of 70 (100 ms apart): late enough for the
/// standbys started alongside the first attempt to have their imports done
/// on most runs (one still importing is waited for, and still used).
const FAULT: &[&str] = &[
    "--steps",
    "70",
    "--step-ms",
    "100",
    "--exit-rank",
    "1",
    "--exit-step",
    "60",
    "--exit-code",
    "3",
    "--stamp",
];

fn launch(dir: &Path, job: &str, standby: &str) -> Finished {
    std::fs::write(dir.join("agent.toml"), AGENT_TOML).unwrap();
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(dir.join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", job, standby])
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--agent-config")
        .arg(dir.join("agent.toml"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/torch_plain.py"))
        .args(FAULT)
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir);
    run(&mut cmd, RUN)
}

/// What one run showed.
struct Restart {
    /// Crash to every rank's first step of attempt 1, seconds.
    back_s: f64,
    /// The pids that stepped in attempt 1, by rank.
    pids: Vec<(u32, u32)>,
    /// `weights=` of each rank's `done` line.
    weights: Vec<String>,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key))
}

fn restart_of(out: &str, all: &str) -> Restart {
    let crash: f64 = out
        .lines()
        .find(|l| l.starts_with("[rank 1] exiting with code 3"))
        .and_then(|l| field(l, "t="))
        .unwrap_or_else(|| panic!("no crash line\n{all}"))
        .parse()
        .unwrap();
    let mut back = 0f64;
    let mut pids = Vec::new();
    for rank in 0..2u32 {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] step 1 restart=1 ")))
            .unwrap_or_else(|| panic!("rank {rank} never stepped in attempt 1\n{all}"));
        let t: f64 = field(line, "t=").unwrap().parse().unwrap();
        back = back.max(t - crash);
        pids.push((rank, field(line, "pid=").unwrap().parse().unwrap()));
    }
    let weights = out
        .lines()
        .filter_map(|l| l.split_once("] done "))
        .filter_map(|(_, rest)| field(rest, "weights="))
        .map(str::to_owned)
        .collect();
    Restart {
        back_s: back,
        pids,
        weights,
    }
}

/// The pids of every "standby interpreters for warm restarts: pids A B"
/// line, in order.
fn standby_pids(err: &str) -> Vec<Vec<u32>> {
    err.lines()
        .filter_map(|l| l.split_once("standby interpreters for warm restarts: pids "))
        .map(|(_, rest)| {
            rest.split(" (")
                .next()
                .unwrap()
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect()
        })
        .collect()
}

fn show(f: &Finished) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        f.status, f.stdout, f.stderr
    )
}

#[test]
fn a_crash_restarts_warm_from_standbys_and_cold_without() {
    if !torch_available() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("warden-standby-")
        .tempdir()
        .unwrap();

    let cold = launch(dir.path(), "sb-cold", "--no-standby");
    let all = show(&cold);
    assert_eq!(cold.code(), 0, "{all}");
    let c = restart_of(&cold.stdout, &all);
    assert!(standby_pids(&cold.stderr).is_empty(), "{all}");
    assert!(!cold.stderr.contains("warm start"), "{all}");
    assert_eq!(c.weights.len(), 2, "{all}");
    assert!(
        !c.weights[0].is_empty() && c.weights[0] == c.weights[1],
        "{all}"
    );

    let warm = launch(dir.path(), "sb-warm", "--standby");
    let all = show(&warm);
    assert_eq!(warm.code(), 0, "{all}");
    let w = restart_of(&warm.stdout, &all);
    let spares = standby_pids(&warm.stderr);
    assert!(!spares.is_empty(), "{all}");
    // The restarted ranks are the spares started with the first attempt.
    for &(rank, pid) in &w.pids {
        assert!(
            spares[0].contains(&pid),
            "rank {rank} pid {pid}: {spares:?}\n{all}"
        );
        assert!(
            warm.stderr
                .contains(&format!("rank {rank}: warm start from standby pid {pid} ")),
            "{all}"
        );
    }
    assert_eq!(w.weights.len(), 2, "{all}");
    assert!(
        !w.weights[0].is_empty() && w.weights[0] == w.weights[1],
        "{all}"
    );
    // The same training, warm or cold.
    assert_eq!(w.weights, c.weights, "{all}");
    // No spare outlives the job (the replacements started after the
    // restart included).
    for pid in spares.iter().flatten() {
        // Its exec-time environment names it a standby while it lives.
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let env = String::from_utf8_lossy(&env);
        assert!(
            !env.contains("WARDEN_STANDBY_PRELOAD="),
            "standby {pid} outlived the job\n{all}"
        );
    }

    eprintln!(
        "crash -> every rank stepping again: cold {:.2} s, warm {:.2} s (2 ranks, torch_plain.py)",
        c.back_s, w.back_s
    );
}

#[test]
fn a_signal_while_a_restart_waits_for_a_standby_stops_the_job() {
    let dir = tempfile::Builder::new()
        .prefix("warden-standby-sig-")
        .tempdir()
        .unwrap();
    // A preload that never finishes: the standby is never ready.
    std::fs::write(
        dir.path().join("never_ready.py"),
        "import time\ntime.sleep(3600)\n",
    )
    .unwrap();
    let mut cmd = Command::new("sh");
    // The launcher's own lines (stderr) with the workers' on one stream.
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
        .arg("--socket")
        .arg(dir.path().join("no-agent-here.sock"))
        .arg("run")
        .args(["--agent", "embedded", "--nproc-per-node", "2"])
        .args([
            "--rdzv-id",
            "sb-sig",
            "--standby",
            "--preload",
            "never_ready",
        ])
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("examples/train.py"))
        .arg("--ckpt-dir")
        .arg(dir.path().join("ckpt"))
        .args(["--steps", "1000", "--step-ms", "20", "--crash-at-step", "3"])
        .env("PYTHONPATH", dir.path())
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir.path());
    let mut job = Streaming::spawn(&mut cmd, dir.path().join("stderr"));
    let spares = job.wait_line(RUN, "the standbys", |l| {
        l.contains("standby interpreters for warm restarts: pids")
    });
    job.wait_line(RUN, "the restart waiting for a standby", |l| {
        l.contains("is still importing; waiting for it up to 30s")
    });
    job.signal(Signal::SIGTERM);
    job.wait_line(Duration::from_secs(30), "the wait given up", |l| {
        l.contains("was still importing when the launcher got a signal; starting it cold")
    });
    let status = job.wait_exit(Duration::from_secs(60));
    let seen = job.seen.join("\n");
    assert_eq!(status.code(), Some(143), "{seen}");
    for pid in &standby_pids(&spares)[0] {
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&env).contains("WARDEN_STANDBY_PRELOAD="),
            "standby {pid} outlived the job\n{seen}"
        );
    }
}

/// The standbys import what the workers imported, as the client reports
/// it (`warden.run` writes the list to WARDEN_IMPORTS_FILE): the warm
/// rank finds a package of the first attempt's already loaded before its
/// script runs, where the first attempt's cold interpreter did not.
#[test]
fn standbys_preload_what_the_first_attempt_reported_importing() {
    let dir = tempfile::Builder::new()
        .prefix("warden-standby-imports-")
        .tempdir()
        .unwrap();
    let crash_when = dir.path().join("crash-now");
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
        .arg("--socket")
        .arg(dir.path().join("no-agent-here.sock"))
        .arg("run")
        .args(["--agent", "embedded", "--nproc-per-node", "1"])
        .args(["--rdzv-id", "sb-imports", "--standby"])
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/imports_rank.py"))
        .arg("--crash-when")
        .arg(&crash_when)
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir.path());
    let mut job = Streaming::spawn(&mut cmd, dir.path().join("stderr"));
    let first = job.wait_line(RUN, "attempt 0", |l| l.contains("attempt restart=0 "));
    assert!(first.contains("preloaded=False"), "{first}");
    job.wait_line(RUN, "the standbys told to preload the report", |l| {
        l.contains("standbys also preload what the workers imported") && l.contains("iniconfig")
    });
    std::fs::write(&crash_when, b"").unwrap();
    let second = job.wait_line(RUN, "attempt 1", |l| l.contains("attempt restart=1 "));
    let status = job.wait_exit(RUN);
    let seen = job.seen.join("\n");
    assert_eq!(status.code(), Some(0), "{seen}");
    assert!(
        seen.contains("warm start from standby"),
        "the restart was not warm:\n{seen}"
    );
    assert!(
        second.contains("preloaded=True"),
        "the warm rank had not imported iniconfig before its script:\n{seen}"
    );
}
