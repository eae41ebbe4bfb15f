//! `warden run` with a real JAX multi-process job on the CPU
//! (tests/jax/jax_job.py): two processes that call
//! `jax.distributed.initialize()` with no arguments, hold a weight array
//! sharded across them, and save through `warden.integrations.orbax`'s
//! CheckpointManager into a real wardend's tier.
//!
//! 1. Found from the program (no `--jax`): a fault-free run, the reference:
//!    JAX saw 2 processes, each its own id.
//! 2. `--jax`: rank 1 SIGKILLs itself right after step 8's save is in the
//!    tier; the launcher stops the attempt, restarts both processes on a
//!    new coordinator port, and they resume from the tier (each attempt's
//!    Orbax directory is new, as on a replacement host) with arrays whose
//!    digest is the reference's at step 8, and end with the reference's.
//!
//! Needs jax and orbax-checkpoint in `$WARDEN_TEST_PYTHON`
//! (tests/frameworks-venv.sh installs them). Skips, saying so, only when
//! they are missing and `WARDEN_REQUIRE_FRAMEWORKS` is unset;
//! tests/run-all.sh sets it, so CI never skips.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Finished, TestAgent, WARDEN, python, repo_root, run};

/// One run of the job: JAX's start, 14 steps and a restart on a loaded
/// 2-core machine take tens of seconds; generous.
const RUN: Duration = Duration::from_secs(240);

/// Whether the test interpreter has JAX and Orbax; panics when it has not
/// and `WARDEN_REQUIRE_FRAMEWORKS` is set.
fn jax_available() -> bool {
    let ok = Command::new(python())
        .args([
            "-c",
            "import jax, orbax.checkpoint, warden.integrations.orbax",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let required = std::env::var_os("WARDEN_REQUIRE_FRAMEWORKS").is_some_and(|v| v == "1");
        assert!(
            !required,
            "WARDEN_REQUIRE_FRAMEWORKS=1 but {} cannot import jax and orbax.checkpoint: run `bash tests/frameworks-venv.sh`",
            python().display()
        );
        eprintln!(
            "SKIPPED: {} cannot import jax and orbax.checkpoint (run `bash tests/frameworks-venv.sh`, or set WARDEN_REQUIRE_FRAMEWORKS=1 to fail instead)",
            python().display()
        );
    }
    ok
}

/// Runs the job as 2 workers of `job` under `warden run` with `flags`.
fn run_job(
    agent: &TestAgent,
    dir: &Path,
    job: &str,
    flags: &[&str],
    crash: Option<u32>,
) -> Finished {
    let (ckpt, out) = (
        dir.join(format!("{job}-ckpt")),
        dir.join(format!("{job}-out")),
    );
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", job])
        .args(flags)
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/jax/jax_job.py"))
        .arg("--ckpt-dir")
        .arg(&ckpt)
        .arg("--out")
        .arg(&out)
        .args(["--steps", "14"]);
    if let Some(s) = crash {
        cmd.args(["--crash-step", &s.to_string()]);
    }
    run(&mut cmd, RUN)
}

/// Each rank's result (`rank<R>.json`).
fn results(dir: &Path, job: &str) -> Vec<serde_json::Value> {
    (0..2)
        .map(|r| {
            let p = dir.join(format!("{job}-out/rank{r}.json"));
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

/// The JAX coordinator each attempt's console line names, by attempt.
fn coordinators(stderr: &str) -> BTreeMap<u32, String> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.split("[warden] attempt ").nth(1)?;
            let (n, rest) = rest.split_once(": started ")?;
            let addr = rest.split("JAX coordinator ").nth(1)?.split(';').next()?;
            Some((n.parse().ok()?, addr.to_owned()))
        })
        .collect()
}

#[test]
fn a_jax_job_killed_after_a_save_restarts_and_resumes_from_the_tier_with_identical_arrays() {
    if !jax_available() {
        return;
    }
    let agent = TestAgent::start("");
    let dir = tempfile::tempdir().unwrap();

    // The reference: found to be a JAX program from its imports.
    let clean = run_job(&agent, dir.path(), "jax-clean", &[], None);
    assert_eq!(clean.code(), 0, "{}", clean.stderr);
    let reference = results(dir.path(), "jax-clean");
    for (r, res) in reference.iter().enumerate() {
        assert_eq!(res["world"], 2, "JAX saw the job's processes: {res}");
        assert_eq!(res["rank"], r, "{res}");
        assert_eq!(res["attempt"], 0, "{res}");
        assert!(res["tier_restored"].is_null(), "a fresh start: {res}");
        assert_eq!(res["tier_steps"], serde_json::json!([0, 4, 8, 12]), "{res}");
    }
    assert_eq!(coordinators(&clean.stderr).len(), 1, "{}", clean.stderr);
    assert_ne!(
        reference[0]["final_digest"], reference[1]["final_digest"],
        "each process holds its own shard"
    );

    // The crash: rank 1 SIGKILLed right after step 8 is in the tier.
    let crashed = run_job(&agent, dir.path(), "jax-crash", &["--jax"], Some(8));
    assert_eq!(crashed.code(), 0, "{}", crashed.stderr);
    assert!(
        crashed
            .stderr
            .contains("rank 1 failed (signal 9 (SIGKILL)); restarted in job"),
        "{}",
        crashed.stderr
    );
    let ports = coordinators(&crashed.stderr);
    assert_eq!(
        ports.len(),
        2,
        "two attempts: {ports:?}\n{}",
        crashed.stderr
    );
    assert_ne!(
        ports[&0], ports[&1],
        "a new coordinator port for the restart"
    );
    let resumed = results(dir.path(), "jax-crash");
    for (r, res) in resumed.iter().enumerate() {
        let want = &reference[r];
        assert_eq!(res["attempt"], 1, "{res}");
        assert_eq!(res["world"], 2, "{res}");
        assert_eq!(res["coordinator"], ports[&1].as_str(), "{res}");
        assert_eq!(res["tier_restored"], 8, "from the tier: {res}");
        assert_eq!(res["resumed_from"], 8, "{res}");
        assert_eq!(
            res["restored_digest"], want["saved"]["8"],
            "rank {r}: the restored shard is the one saved at step 8 in the fault-free run"
        );
        assert_eq!(
            res["final_digest"], want["final_digest"],
            "rank {r}: the same arrays as the fault-free run at the end"
        );
        assert_eq!(res["tier_steps"], serde_json::json!([12]), "{res}");
    }
}
