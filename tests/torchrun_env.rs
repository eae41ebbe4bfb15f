//! `warden run` against the real torchrun (torch 2.15's
//! `torch.distributed.run`), in the same test (issue 33): torchtitan 0.3's
//! `run_train.sh` line as is (`--nproc_per_node=2 --rdzv_backend c10d
//! --rdzv_endpoint="localhost:0" --local-ranks-filter 0 --role rank
//! --tee 3 -m MODULE`, on a small module of ours) under each, and every
//! variable torchrun sets in its workers is set by `warden run` with the
//! same value, except the ones that name a port, a path or an id, and the
//! two where warden differs on purpose (each named below with why).
//!
//! Skipped without torch unless `WARDEN_REQUIRE_TORCH` is set (as in CI).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{WARDEN, python, repo_root, run, torch_available};

const RUN: Duration = Duration::from_secs(180);

/// Variables whose values differ by nature: ports and paths chosen per
/// run, and the job id (torchrun's is `none` without `--rdzv-id`).
const PER_RUN: [&str; 3] = [
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
];

/// Where warden differs on purpose:
/// - `TORCHELASTIC_USE_AGENT_STORE`: torchrun's workers use its agent's
///   store, kept across restarts (stale keys after a restart); warden's
///   rank 0 hosts a fresh store per attempt, so it is `False`.
/// - `TORCHELASTIC_MAX_RESTARTS`: torchrun's is `--max-restarts` (0 by
///   default); warden's is the restart budget that applies (the agent's
///   policy when `--max-restarts` is not given).
const ON_PURPOSE: [&str; 2] = ["TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS"];

fn read_env(dir: &Path, rank: u32) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.json")))
        .unwrap_or_else(|e| panic!("rank {rank}'s environment in {}: {e}", dir.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("rank {rank}'s JSON: {e}"))
}

#[test]
fn a_worker_under_warden_run_sees_what_it_sees_under_torchrun() {
    if !torch_available() {
        return;
    }
    let scratch = tempfile::Builder::new()
        .prefix("warden-torchrun-env-")
        .tempdir()
        .unwrap_or_else(|e| panic!("a scratch directory: {e}"));
    let line = [
        "--nproc_per_node=2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint=localhost:0",
        "--local-ranks-filter",
        "0",
        "--role",
        "rank",
        "--tee",
        "3",
        "-m",
        "print_env",
    ];
    // The parent's environment: the same small one for both, the module
    // found on PYTHONPATH.
    let clean = |cmd: &mut Command| {
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", scratch.path())
            .env("PYTHONPATH", repo_root().join("tests/fixtures"))
            .current_dir(scratch.path());
    };
    let mut torchrun = Command::new(python());
    clean(&mut torchrun);
    torchrun
        .args(["-m", "torch.distributed.run"])
        .args(line)
        .arg(scratch.path().join("torchrun"));
    let out = run(&mut torchrun, RUN);
    assert_eq!(out.code(), 0, "torchrun: {out:?}");
    let mut warden = Command::new(WARDEN);
    clean(&mut warden);
    warden
        .arg("--socket")
        .arg(scratch.path().join("no-agent-here.sock"))
        .arg("run")
        .args(["--no-standby", "--log-dir"])
        .arg(scratch.path().join("logs"))
        .args(line)
        .arg(scratch.path().join("warden"));
    let out = run(&mut warden, RUN);
    assert_eq!(out.code(), 0, "warden run: {out:?}");

    for rank in 0..2 {
        let t = read_env(&scratch.path().join("torchrun"), rank);
        let w = read_env(&scratch.path().join("warden"), rank);
        let set_by_torchrun: Vec<&String> = t
            .keys()
            .filter(|k| !["PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str()))
            .collect();
        assert!(
            set_by_torchrun.len() >= 15,
            "torchrun set only {set_by_torchrun:?}"
        );
        let mut differ = Vec::new();
        for k in set_by_torchrun {
            let ours = w.get(k);
            if PER_RUN.contains(&k.as_str()) || ON_PURPOSE.contains(&k.as_str()) {
                assert!(ours.is_some(), "rank {rank}: warden run does not set {k}");
                continue;
            }
            if ours != t.get(k) {
                differ.push(format!("{k}: torchrun {:?}, warden {ours:?}", t[k]));
            }
        }
        assert!(
            differ.is_empty(),
            "rank {rank}: variables torchrun sets that warden run sets otherwise:\n{}",
            differ.join("\n")
        );
        assert_eq!(w["ROLE_NAME"], "rank");
        assert_eq!(w["MASTER_ADDR"], "localhost");
        assert_ne!(w["MASTER_PORT"], "0", "port 0 is any free port");
    }
}

/// `--nproc-per-node xpu` asks torch in the workers' interpreter, as
/// torchrun does (`torch.xpu.device_count()`): this machine has no Intel
/// XPU, so both refuse it with torchrun's "Xpu is not available" (warden
/// run with 2, a bad command line here), and nothing starts.
#[test]
fn nproc_per_node_xpu_asks_torch_and_refuses_without_one_as_torchrun_does() {
    if !torch_available() {
        return;
    }
    let scratch = tempfile::Builder::new()
        .prefix("warden-torchrun-xpu-")
        .tempdir()
        .unwrap_or_else(|e| panic!("a scratch directory: {e}"));
    let marker = scratch.path().join("started");
    let script = format!("open({:?}, 'w')", marker.display().to_string());
    let mut torchrun = Command::new(python());
    torchrun
        .args(["-m", "torch.distributed.run", "--nproc-per-node", "xpu"])
        .args(["--no-python", "--standalone"])
        .arg(python())
        .args(["-c", &script])
        .current_dir(scratch.path());
    let t = run(&mut torchrun, RUN);
    assert_ne!(
        t.code(),
        0,
        "torchrun took xpu on a machine without one: {t:?}"
    );
    assert!(
        t.stderr.contains("Xpu is not available"),
        "torchrun's own words: {t:?}"
    );
    let mut warden = Command::new(WARDEN);
    warden
        .arg("--socket")
        .arg(scratch.path().join("no-agent-here.sock"))
        .args(["run", "--no-standby", "--nproc-per-node", "xpu", "--"])
        .arg(python())
        .args(["-c", &script])
        .current_dir(scratch.path());
    let w = run(&mut warden, RUN);
    assert_eq!(w.code(), 2, "warden run: {w:?}");
    assert!(
        w.stderr
            .contains("--nproc-per-node xpu: Xpu is not available"),
        "{w:?}"
    );
    assert!(!marker.exists(), "a worker started");
}
