//! Zero-code mode with real PyTorch (gloo on CPU): `warden run` launching a
//! plain DDP script that never imports warden (tests/fixtures/torch_plain.py).
//!
//! 1. Rank 1 leaves with exit code 3 at step 8; rank 0 fails in the next
//!    all-reduce with gloo's connection error. The launcher registered both
//!    workers with its agent and reported rank 0's traceback as it was
//!    printed, so the agent diagnoses the crash (the incident names rank 1
//!    and its exit and carries the peer's gloo error as evidence, where the
//!    launcher alone said "class unknown 0%"), the job restarts once and
//!    finishes with identical weights on both ranks.
//! 2. Rank 0 aborts (SIGABRT) in an atexit handler after its training and
//!    teardown while rank 1 exits 0: the job ends with success and says
//!    that the failure was a teardown failure, with no restart.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it);
//! skips, saying so, only when torch is missing and `WARDEN_REQUIRE_TORCH`
//! is unset.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Finished, WARDEN, python, repo_root, run, torch_available};
use serde_json::Value;

/// A whole run: torch imports take seconds per worker on a loaded 2-core
/// machine, twice with the restart.
const RUN: Duration = Duration::from_secs(240);

/// The embedded agent: no kernel log or NVML (the test machines have
/// neither reliably), host memory never a fault.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n";

/// `warden run --nproc-per-node 2 -- python torch_plain.py <args>` in
/// `dir`, with an embedded agent (no wardend answers on `--socket`).
fn launch(dir: &Path, job: &str, args: &[&str]) -> Finished {
    std::fs::write(dir.join("agent.toml"), AGENT_TOML).unwrap();
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(dir.join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", job])
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--agent-config")
        .arg(dir.join("agent.toml"))
        .arg("--summary-json")
        .arg(dir.join("summary.json"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/torch_plain.py"))
        .args(args)
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir);
    run(&mut cmd, RUN)
}

fn show(f: &Finished) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        f.status, f.stdout, f.stderr
    )
}

/// `weights=` of each rank's `done` line, by rank.
fn weights(out: &str) -> Vec<(String, String)> {
    out.lines()
        .filter_map(|l| l.split_once("] done "))
        .map(|(rank, rest)| {
            let w = rest
                .split_whitespace()
                .find_map(|w| w.strip_prefix("weights="))
                .unwrap_or("")
                .to_owned();
            (rank.to_owned(), w)
        })
        .collect()
}

#[test]
fn a_plain_ddp_crash_is_diagnosed_and_restarted_once() {
    if !torch_available() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("warden-zero-code-")
        .tempdir()
        .unwrap();
    let out = launch(
        dir.path(),
        "zc-crash",
        &["--exit-rank", "1", "--exit-step", "8", "--exit-code", "3"],
    );
    let all = show(&out);
    assert_eq!(out.code(), 0, "{all}");
    assert!(
        out.stdout
            .contains("[rank 1] exiting with code 3 at step 8"),
        "{all}"
    );
    // Both ranks finished the second attempt with the same weights.
    let w = weights(&out.stdout);
    assert_eq!(w.len(), 2, "{all}");
    assert!(!w[0].1.is_empty() && w[0].1 == w[1].1, "{w:?}\n{all}");
    assert!(out.stdout.contains("restart=1"), "{all}");
    let text = std::fs::read_to_string(dir.path().join("summary.json")).unwrap();
    let summary: Value = serde_json::from_str(&text).unwrap();
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{summary:#}\n{all}");
    let inc = &attempts[0]["incident"];
    // The agent diagnosed it (the launcher's own fallback says "class
    // unknown" and is decided by "launcher").
    assert_eq!(inc["decided_by"], "policy", "{summary:#}\n{all}");
    assert_eq!(inc["action"], "restart_in_job", "{summary:#}\n{all}");
    // Rank 1 left with a bare exit code: whose fault that is, nobody can
    // say (class unknown, but weighed: not the launcher's 0% fallback).
    assert!(
        inc["confidence"].as_f64().unwrap() > 0.0,
        "{summary:#}\n{all}"
    );
    let s = inc["summary"].as_str().unwrap();
    assert!(
        s.contains("rank/1 exited with code 3"),
        "{summary:#}\n{all}"
    );
    let evidence: Vec<String> = inc["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap_or("").to_lowercase())
        .collect();
    assert!(
        evidence.iter().any(|e| e.contains("rank/0")
            && (e.contains("connection closed by peer") || e.contains("connection reset by peer"))),
        "the peer's gloo error: {evidence:#?}\n{all}"
    );
    assert!(
        evidence
            .iter()
            .any(|e| e.contains("rank/1") && e.contains("code 3")),
        "{evidence:#?}\n{all}"
    );
}

#[test]
fn an_abort_in_teardown_after_training_ends_the_job_with_success() {
    if !torch_available() {
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("warden-zero-code-")
        .tempdir()
        .unwrap();
    let out = launch(dir.path(), "zc-teardown", &["--abort-at-exit-rank", "0"]);
    let all = show(&out);
    assert_eq!(out.code(), 0, "{all}");
    assert_eq!(weights(&out.stdout).len(), 2, "{all}");
    assert!(
        out.stderr.contains("rank 0 (pid")
            && out.stderr.contains("failed after its training ended"),
        "{all}"
    );
    assert!(
        out.stderr
            .contains("the job succeeded; rank 0 failed in its teardown"),
        "{all}"
    );
    // No second attempt.
    assert!(!out.stdout.contains("restart=1"), "{all}");
    let text = std::fs::read_to_string(dir.path().join("summary.json")).unwrap();
    let summary: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        summary["attempts"].as_array().unwrap().len(),
        1,
        "{summary:#}"
    );
    assert!(
        summary["outcome"].as_str().unwrap().contains("teardown"),
        "{summary:#}"
    );
}
