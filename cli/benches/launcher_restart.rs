//! In-job restart under `warden run`, against the real `warden` binary and
//! real Python workers (`examples/train.py`, 4 workers, no torch needed):
//! from a worker's death to every local worker respawned, split into
//! detection, decision, stop, gate and respawn, side by side in the same run
//! with two baselines:
//!
//! - a bare respawn: the same 4 Python workers started with no supervision
//!   at all (what any launcher pays to bring the processes back: the
//!   interpreter, imports, the checkpoint read);
//! - torchrun's restart of the same toy job (`--max-restarts 1`), when a
//!   `torchrun` is found: `$TORCHRUN`, else on `$PATH`. Its Python runs the
//!   script without the warden package (it imports it only if installed).
//!
//! And the same restart across hosts: two `warden run` launchers on this
//! machine acting as two hosts of one job (`--rdzv-backend etcd`, a real
//! etcd from tests/common/etcd.rs, 2 workers each: the same 4 ranks), the
//! worker dying on one host: from its death until the other host's
//! launcher holds the new round, and until every worker on both hosts is
//! respawned and ready. Skipped, said so, when no `etcd` is found.
//!
//! Times come from the workers' own clocks (`crash ... t=` just before
//! `os._exit`, `ready ... t=` once a respawned worker restored its
//! checkpoint and is about to train) and from the launcher's summary
//! (`--summary-json`), all on the same host's wall clock.
//!
//! Run: `cargo bench -p warden-cli --bench launcher_restart` (release
//! build); `LAUNCHER_BENCH_RUNS` (default 5) runs of each. The Python is
//! `$WARDEN_TEST_PYTHON`, else the repository's `.venv/bin/python`.
//! Prints a markdown table for docs/benchmarks.md.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../../tests/common/etcd.rs"]
mod etcd;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

const NPROC: u32 = 4;
const CRASH_STEP: &str = "8";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn python() -> PathBuf {
    std::env::var_os("WARDEN_TEST_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(|| repo().join(".venv/bin/python"), PathBuf::from)
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The `t=` of the first line starting with `prefix` (after a `[rank N] `
/// prefix, when there is one) that also contains `with`.
fn times(text: &str, prefix: &str, with: &str) -> Vec<f64> {
    text.lines()
        .map(|l| l.split_once("] ").map_or(l, |(_, r)| r))
        .filter(|l| l.starts_with(prefix) && l.contains(with))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("t="))
                .and_then(|t| t.parse().ok())
        })
        .collect()
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn train_args(ckpt: &Path) -> Vec<String> {
    [
        "--steps",
        "16",
        "--step-ms",
        "20",
        "--crash-at-step",
        CRASH_STEP,
        "--crash-rank",
        "1",
        "--report-every",
        "0",
        "--ckpt-dir",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([ckpt.display().to_string()])
    .collect()
}

#[derive(Debug, Default)]
struct WardenRun {
    detect: f64,
    decision: f64,
    stop: f64,
    gate: f64,
    spawned: f64,
    registered: f64,
    ready: f64,
}

/// One `warden run` of the toy job with a crash; times in ms.
fn warden_run(i: u32) -> WardenRun {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let summary = dir.path().join("summary.json");
    let job = format!("bench-{}-{i}", std::process::id());
    let out = Command::new(env!("CARGO_BIN_EXE_warden"))
        .arg("--socket")
        .arg(dir.path().join("no-agent.sock"))
        .args(["run", "--quiet", "--nproc-per-node", &NPROC.to_string()])
        .args(["--rdzv-id", &job])
        .arg("--log-dir")
        .arg(&logs)
        .arg("--summary-json")
        .arg(&summary)
        .arg("--")
        .arg(python())
        .arg(repo().join("examples/train.py"))
        .args(train_args(&dir.path().join("ckpt")))
        .env_remove("WARDEN_SOCKET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "warden run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |attempt: u32, rank: u32| {
        std::fs::read_to_string(
            logs.join(&job)
                .join(format!("attempt_{attempt}/rank_{rank}.stdout.log")),
        )
        .unwrap_or_default()
    };
    let crash = times(&read(0, 1), "crash:", "")[0];
    let ready: Vec<f64> = (0..NPROC)
        .flat_map(|r| times(&read(1, r), "ready", "restart=1"))
        .collect();
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
    let r = &s["attempts"][0]["restart"];
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let detect = (f("failure_seen_unix_s") - crash) * 1000.0;
    WardenRun {
        detect,
        decision: f("decision_ms"),
        stop: f("stop_ms"),
        gate: f("gate_ms"),
        spawned: f("spawn_ms") + detect,
        registered: f("registered_ms") + detect,
        ready: (max(&ready) - crash) * 1000.0,
    }
}

/// One restart across two hosts; times in ms from the worker's death.
#[derive(Debug, Default)]
struct TwoHostRun {
    /// The failing host's launcher sees it.
    detect: f64,
    /// Its agent's decision.
    decision: f64,
    /// The other host's launcher holds the new round.
    other_round: f64,
    /// The failing host's new workers started.
    spawned_here: f64,
    /// The other host's new workers started.
    spawned_there: f64,
    /// Every new worker on both hosts ready.
    ready: f64,
}

fn etcd_found() -> bool {
    std::env::var_os("WARDEN_TEST_ETCD").is_some()
        || std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file()))
}

/// Two `warden run` launchers as two hosts of one job (2 workers each),
/// global rank 1 dying at step CRASH_STEP of the first round.
fn two_host_run(etcd: &etcd::EtcdServer, i: u32) -> TwoHostRun {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let job = format!("bench-mh-{}-{i}", std::process::id());
    let hosts = [("host-a", "127.0.0.2"), ("host-b", "127.0.0.3")];
    let children: Vec<_> = hosts
        .iter()
        .map(|(host, addr)| {
            let home = dir.path().join(host);
            std::fs::create_dir_all(&home).unwrap();
            Command::new(env!("CARGO_BIN_EXE_warden"))
                .arg("--socket")
                .arg(home.join("no-agent.sock"))
                .args(["run", "--quiet", "--nproc-per-node", "2", "--nnodes", "2"])
                .args(["--rdzv-backend", "etcd", "--rdzv-endpoint", &etcd.endpoint])
                .args([
                    "--rdzv-id",
                    &job,
                    "--host-id",
                    host,
                    "--advertise-addr",
                    addr,
                ])
                .arg("--log-dir")
                .arg(home.join("logs"))
                .arg("--summary-json")
                .arg(home.join("summary.json"))
                .arg("--")
                .arg(python())
                .arg(repo().join("examples/train.py"))
                .args(train_args(&ckpt))
                // Long enough that the host without the crash is still
                // training when the restart comes (the toy's ranks share
                // no collective to hold it back).
                .args(["--steps", "60"])
                .env_remove("WARDEN_SOCKET")
                .env_remove("WARDEN_JOB_ID")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "warden run (etcd) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let read = |host: &str, attempt: u32, rank: u32| {
        std::fs::read_to_string(
            dir.path()
                .join(host)
                .join("logs")
                .join(&job)
                .join(format!("attempt_{attempt}/rank_{rank}.stdout.log")),
        )
        .unwrap_or_default()
    };
    // Global rank 1 is on node rank 0: whichever host joined first.
    let here = hosts
        .iter()
        .map(|(h, _)| *h)
        .find(|h| !read(h, 0, 1).is_empty())
        .unwrap();
    let there = hosts.iter().map(|(h, _)| *h).find(|h| *h != here).unwrap();
    let crash = times(&read(here, 0, 1), "crash:", "")[0];
    let ready: Vec<f64> = (0..NPROC)
        .flat_map(|r| {
            [here, there]
                .into_iter()
                .flat_map(move |h| times(&read(h, 1, r), "ready", "restart=1"))
        })
        .collect();
    assert_eq!(ready.len(), NPROC as usize, "every rank came back once");
    let summary = |h: &str| -> serde_json::Value {
        serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(h).join("summary.json")).unwrap(),
        )
        .unwrap()
    };
    let (a, b) = (summary(here), summary(there));
    let ra = &a["attempts"][0]["restart"];
    let rb = &b["attempts"][0]["restart"];
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let detect = (f(ra, "failure_seen_unix_s") - crash) * 1000.0;
    let other_round = (f(rb, "failure_seen_unix_s") - crash) * 1000.0;
    TwoHostRun {
        detect,
        decision: detect + f(ra, "decision_ms"),
        other_round,
        spawned_here: detect + f(ra, "spawn_ms"),
        spawned_there: other_round + f(rb, "spawn_ms"),
        ready: (max(&ready) - crash) * 1000.0,
    }
}

/// A wardend for the bare workers to register with, as they do under
/// `warden run` (a client with no agent to reach pays its connect timeout).
struct Wardend {
    child: std::process::Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Wardend {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("wardend.sock");
        let config = dir.path().join("wardend.toml");
        std::fs::write(
            &config,
            format!(
                "[api]\nsocket = \"{}\"\n[agent]\nstate_dir = \"{}\"\n[metrics]\nlisten = \"\"\n[kmsg]\nenabled = false\n[nvml]\nenabled = false\n",
                socket.display(),
                dir.path().join("state").display()
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_wardend"))
            .arg("--config")
            .arg(&config)
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
        while !socket.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "wardend did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Self {
            child,
            socket,
            _dir: dir,
        }
    }
}

impl Drop for Wardend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The same 4 workers started bare (no launcher; registering with a running
/// wardend): spawn to the last one ready, in ms.
fn bare_spawn(agent: &Wardend) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let t0 = now_s();
    let children: Vec<_> = (0..NPROC)
        .map(|r| {
            Command::new(python())
                .arg(repo().join("examples/train.py"))
                .args(["--steps", "0", "--ckpt-dir"])
                .arg(dir.path())
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", NPROC.to_string())
                .env("WARDEN_SOCKET", &agent.socket)
                .env("WARDEN_JOB_ID", format!("bare-{}", std::process::id()))
                .env("PYTHONUNBUFFERED", "1")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let ready: Vec<f64> = children
        .into_iter()
        .flat_map(|c| {
            let out = c.wait_with_output().unwrap();
            times(&String::from_utf8_lossy(&out.stdout), "ready", "")
        })
        .collect();
    (max(&ready) - t0) * 1000.0
}

fn torchrun() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TORCHRUN").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("torchrun"))
            .find(|p| p.exists())
    })
}

/// torchrun's restart of the same job: the crash to the last respawned
/// worker ready, in ms.
fn torchrun_run(torchrun: &Path) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(torchrun)
        .args([
            "--nproc-per-node",
            &NPROC.to_string(),
            "--max-restarts",
            "1",
        ])
        .arg("--standalone")
        .arg(repo().join("examples/train.py"))
        .args(train_args(&dir.path().join("ckpt")))
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("WARDEN_SOCKET")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let crash = times(&text, "crash:", "");
    let ready = times(&text, "ready", "restart=1");
    assert!(
        !crash.is_empty() && ready.len() == NPROC as usize,
        "torchrun run incomplete ({}): {text}",
        out.status
    );
    (max(&ready) - crash[0]) * 1000.0
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing
    // we need: a quick smoke run then.
    let runs: u32 = std::env::var("LAUNCHER_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::env::args().any(|a| a == "--bench") {
            5
        } else {
            1
        });
    assert!(
        python().exists(),
        "no Python at {} (python3 -m venv .venv && .venv/bin/pip install ./client/python)",
        python().display()
    );
    let mut w = Vec::new();
    let mut bare = Vec::new();
    let mut tr = Vec::new();
    let mut mh = Vec::new();
    let torch = torchrun();
    let agent = Wardend::start();
    let etcd = etcd_found().then(etcd::EtcdServer::start);
    for i in 0..runs {
        w.push(warden_run(i));
        bare.push(bare_spawn(&agent));
        if let Some(t) = &torch {
            tr.push(torchrun_run(t));
        }
        if let Some(e) = &etcd {
            mh.push(two_host_run(e, i));
        }
    }
    let col = |f: fn(&WardenRun) -> f64| median(w.iter().map(f).collect());
    let bare_ms = median(bare.clone());
    let ready = col(|r| r.ready);
    println!(
        "launcher_restart: {NPROC} workers, crash of rank 1 at step {CRASH_STEP}, medians of {runs} run(s), ms from the worker's death\n"
    );
    println!("| what | warden run | bare respawn | torchrun --max-restarts 1 |");
    println!("|---|---|---|---|");
    println!(
        "| death -> launcher sees it (pidfd) | {:.1} | | |",
        col(|r| r.detect)
    );
    println!(
        "| -> agent's decision (settle 200 ms) | {:.0} | | |",
        col(|r| r.detect + r.decision)
    );
    println!(
        "| -> every process of the job gone | {:.0} | | |",
        col(|r| r.detect + r.decision + r.stop)
    );
    println!(
        "| -> GPU release + health gate passed | {:.0} | | |",
        col(|r| r.detect + r.decision + r.stop + r.gate)
    );
    println!(
        "| -> new workers started | {:.0} | 0 | |",
        col(|r| r.spawned)
    );
    println!(
        "| -> all new workers registered with the agent | {:.0} | | |",
        col(|r| r.registered)
    );
    println!(
        "| -> all new workers ready (checkpoint restored) | {:.0} | {:.0} | {} |",
        ready,
        bare_ms,
        if tr.is_empty() {
            "not run (no torchrun; set TORCHRUN)".to_owned()
        } else {
            format!("{:.0}", median(tr.clone()))
        }
    );
    println!(
        "\nwarden's own part (death -> new workers started): {:.0} ms, of which the agent's settle window is 200 ms; \
         death -> ready less the bare respawn: {:.0} ms",
        col(|r| r.spawned),
        ready - bare_ms
    );
    let mcol = |f: fn(&TwoHostRun) -> f64| median(mh.iter().map(f).collect());
    if mh.is_empty() {
        println!("\ntwo hosts through etcd: not run (no etcd; set WARDEN_TEST_ETCD)");
    } else {
        println!(
            "\ntwo hosts through etcd (2 + 2 workers, one job; ms from the worker's death, medians of {runs} run(s))\n"
        );
        println!("| what | one host, 4 workers | two hosts, 2 + 2 workers |");
        println!("|---|---|---|");
        println!(
            "| death -> the failing host's launcher sees it | {:.1} | {:.1} |",
            col(|r| r.detect),
            mcol(|r| r.detect)
        );
        println!(
            "| -> the agent's decision (settle 200 ms) | {:.0} | {:.0} |",
            col(|r| r.detect + r.decision),
            mcol(|r| r.decision)
        );
        println!(
            "| -> the other host's launcher holds the new round (etcd) | | {:.0} |",
            mcol(|r| r.other_round)
        );
        println!(
            "| -> new workers started on the failing host | {:.0} | {:.0} |",
            col(|r| r.spawned),
            mcol(|r| r.spawned_here)
        );
        println!(
            "| -> new workers started on the other host | | {:.0} |",
            mcol(|r| r.spawned_there)
        );
        println!(
            "| -> **every new worker ready** | {:.0} | {:.0} |",
            ready,
            mcol(|r| r.ready)
        );
        println!(
            "\nthe round across hosts on top of the local restart (every worker ready, two hosts less one): {:.0} ms",
            mcol(|r| r.ready) - ready
        );
    }
    for (i, r) in mh.iter().enumerate() {
        println!(
            "two hosts, run {i}: detect {:.1} decision {:.0} other host's round {:.0} spawned here {:.0} there {:.0} ready {:.0}",
            r.detect, r.decision, r.other_round, r.spawned_here, r.spawned_there, r.ready
        );
    }
    for (i, r) in w.iter().enumerate() {
        println!(
            "run {i}: warden detect {:.1} decision {:.0} stop {:.0} gate {:.0} spawned {:.0} registered {:.0} ready {:.0}; bare {:.0}{}",
            r.detect,
            r.decision,
            r.stop,
            r.gate,
            r.spawned,
            r.registered,
            r.ready,
            bare[i],
            tr.get(i)
                .map_or(String::new(), |t| format!("; torchrun {t:.0}"))
        );
    }
}
