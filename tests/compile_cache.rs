//! The compilation cache in the agent's tier survives an in-job restart:
//! a torch.compile'd model (tests/fixtures/compile_job.py, Inductor on the
//! CPU with the machine's C++ compiler) under `warden run`, its first
//! attempt crashing after its first step. The restarted worker (a new
//! process) finds its FX graphs in the cache the launcher pointed it to, in
//! the tier's `.cache/<uid>/<job>/`, and compiles nothing again. The first
//! step's time of both attempts is printed (docs/benchmarks.md has the
//! bench), not asserted.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON`; skips, saying so, only when torch
//! is missing and `WARDEN_REQUIRE_TORCH` is unset.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{WARDEN, python, repo_root, run, torch_available};

/// A cold compile on a loaded 2-core machine took 34 s here; twice that
/// and the restart, with room.
const RUN: Duration = Duration::from_secs(400);

const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n";

#[test]
fn a_restarted_worker_finds_its_compiled_graphs_in_the_tier() {
    if !torch_available() {
        eprintln!("skipped: no torch in {}", python().display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("agent.toml"), AGENT_TOML).unwrap();
    // A job id of its own: a cache left by an earlier run of this test
    // would make the first attempt warm.
    let job = format!(
        "compile-cache-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    );
    let out = dir.path().join("out.jsonl");
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(dir.path().join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", "1", "--rdzv-id", &job, "--no-standby"])
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--agent-config")
        .arg(dir.path().join("agent.toml"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/compile_job.py"))
        .arg(&out)
        .arg("--exit-first-attempt")
        .env_remove("WARDEN_SOCKET")
        .env_remove("TORCHINDUCTOR_CACHE_DIR")
        .env_remove("TORCHINDUCTOR_FORCE_DISABLE_CACHES")
        .current_dir(dir.path());
    let done = run(&mut cmd, RUN);
    let all = format!("{}\n{}", done.stdout, done.stderr);
    assert_eq!(done.code(), 0, "{all}");
    assert!(
        done.stderr
            .contains("compilation caches (torch.compile, Triton, XLA) in "),
        "{all}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}\n{all}");
    let (first, second) = (&lines[0], &lines[1]);
    assert_eq!(first["attempt"], 0);
    assert_eq!(second["attempt"], 1);
    let uid = nix::unistd::Uid::effective().as_raw();
    let want = format!("/.cache/{uid}/{job}/inductor");
    for l in &lines {
        let d = l["cache_dir"].as_str().unwrap_or_default();
        assert!(d.ends_with(&want), "cache dir {d:?}, want *{want}");
    }
    // Cold: compiled; warm: every graph from the cache, none compiled.
    assert!(first["misses"].as_u64().unwrap() > 0, "{first}");
    assert_eq!(first["hits"].as_u64().unwrap(), 0, "{first}");
    assert!(second["hits"].as_u64().unwrap() > 0, "{second}");
    assert_eq!(second["misses"].as_u64().unwrap(), 0, "{second}");
    eprintln!(
        "first step: cold {:.2} s, after the restart {:.2} s (from the cache)",
        first["first_step_s"].as_f64().unwrap(),
        second["first_step_s"].as_f64().unwrap()
    );
}
