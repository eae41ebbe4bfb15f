//! In-process restart latency, against the real `wardend` and real Python
//! ranks (client/python/bench/restart_rank.py under `warden.run`):
//!
//! From the decision (a `RequestRestart` call, which runs exactly what a
//! `restart_in_process` decision runs; the clock starts before the call is
//! sent, so the figure includes its trip to the agent) to `RestartRequested`
//! raised in each rank's training code, for ranks blocked in `time.sleep`
//! (the restart signal interrupts them), spinning in pure Python, and
//! spinning with the signal off (the asynchronous exception alone). Target:
//! under 50 ms.
//!
//! Side by side, in the same run, the floors it is built on: a signal sent
//! to a plain Python process whose handler raises into a `time.sleep`
//! (no warden), and one unary gRPC call to the agent (`GetNodeHealth`).
//!
//! Run: `cargo bench -p warden-cli --bench in_process_restart` (release
//! build; the interpreter is `$WARDEN_TEST_PYTHON`, else `.venv/bin/python`,
//! with the `warden` package installed). Prints a markdown table for
//! docs/benchmarks.md.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{Agent, connect};
use tokio_stream::StreamExt;
use warden_client::clock::syscall_now;
use warden_proto::v1 as pb;

const ITERATIONS: usize = 30;
const WAIT: Duration = Duration::from_secs(10);

fn start_agent() -> Agent {
    Agent::start(tempfile::tempdir().unwrap(), |socket, state| {
        format!(
            "[api]\nsocket = \"{}\"\n[metrics]\nlisten = \"\"\n[agent]\nstate_dir = \"{}\"\n\
             [log]\nlevel = \"off\"\n[nvml]\nenabled = false\n[kmsg]\nenabled = false\n",
            socket.display(),
            state.display()
        )
    })
}

fn python() -> PathBuf {
    std::env::var_os("WARDEN_TEST_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"),
            PathBuf::from,
        )
}

/// A rank process and its stdout lines.
struct Rank {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Rank {
    fn spawn(
        socket: &Path,
        job: &str,
        rank: u32,
        world: u32,
        mode: &str,
        env: &[(&str, &str)],
    ) -> Rank {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/python/bench/restart_rank.py");
        let mut child = Command::new(python())
            .arg(script)
            .args(["--mode", mode])
            .env("WARDEN_SOCKET", socket)
            .env("WARDEN_JOB_ID", job)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .env_remove("WARDEN_RESTART_SIGNAL")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut r = Rank { child, lines };
        r.wait("registered");
        r
    }

    fn wait(&mut self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(WAIT)
                .unwrap_or_else(|e| panic!("no {prefix:?} line from the rank: {e}"));
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    /// Waits for `raised seq=S t_ns=T` and returns T.
    fn raised(&mut self) -> u64 {
        let line = self.wait("raised ");
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("t_ns="))
            .unwrap()
            .parse()
            .unwrap()
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn row(what: &str, mut ms: Vec<f64>) {
    ms.sort_by(f64::total_cmp);
    println!(
        "| {what} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
        ms.len(),
        ms[0],
        percentile(&ms, 0.5),
        percentile(&ms, 0.9),
        ms[ms.len() - 1]
    );
}

/// `ITERATIONS` restarts by `RequestRestart` of a job of `ranks` ranks in
/// `mode`; the latency of each rank's raise, in ms.
async fn restarts(
    agent: &Agent,
    job: &str,
    ranks: u32,
    mode: &str,
    env: &[(&str, &str)],
) -> Vec<f64> {
    let mut client = connect(&agent.socket()).await;
    let mut procs: Vec<Rank> = (0..ranks)
        .map(|r| Rank::spawn(&agent.socket(), job, r, ranks, mode, env))
        .collect();
    let mut events = client
        .watch_events(pb::WatchEventsRequest { after_id: None })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    for _ in 0..ITERATIONS {
        for p in &mut procs {
            p.wait("ready");
        }
        // Let the attempt settle into its sleep or loop.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let t0 = syscall_now();
        let asked = client
            .request_restart(pb::RequestRestartRequest {
                job_id: job.into(),
                reason: "bench".into(),
                incident_id: String::new(),
                replacing: false,
            })
            .await
            .unwrap()
            .into_inner();
        for p in &mut procs {
            let t = p.raised();
            out.push(t.saturating_sub(t0) as f64 / 1e6);
        }
        // The next request must not join this one: wait for its end.
        let deadline = Instant::now() + WAIT;
        loop {
            let e = tokio::time::timeout(deadline - Instant::now(), events.next())
                .await
                .expect("restart.acknowledged in time")
                .unwrap()
                .unwrap();
            let seq = e
                .evidence
                .iter()
                .find(|kv| kv.key == "seq")
                .map(|kv| kv.value.clone());
            if e.kind == "restart.acknowledged" && seq == Some(asked.seq.to_string()) {
                break;
            }
            assert_ne!(
                e.kind, "restart.in_process_timeout",
                "a rank did not acknowledge"
            );
        }
    }
    out
}

/// The baseline: SIGUSR1 to a plain Python process blocked in `time.sleep`
/// whose handler raises; from `kill` to the exception in its code.
fn signal_baseline() -> Vec<f64> {
    let mut r = Rank::spawn(Path::new("/nonexistent"), "none", 0, 1, "baseline", &[]);
    let pid = nix::unistd::Pid::from_raw(r.child.id() as i32);
    let mut out = Vec::new();
    for _ in 0..ITERATIONS {
        r.wait("ready");
        std::thread::sleep(Duration::from_millis(30));
        let t0 = syscall_now();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR1).unwrap();
        let t = r.raised();
        out.push(t.saturating_sub(t0) as f64 / 1e6);
    }
    out
}

/// The baseline: one unary gRPC call to the agent, round trip.
async fn grpc_baseline(agent: &Agent) -> Vec<f64> {
    let mut client = connect(&agent.socket()).await;
    let mut out = Vec::new();
    for _ in 0..ITERATIONS * 4 {
        let t0 = Instant::now();
        client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .unwrap();
        out.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    out
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let agent = start_agent();
    let sleep = rt.block_on(restarts(&agent, "bench-sleep", 2, "sleep", &[]));
    let busy = rt.block_on(restarts(&agent, "bench-busy", 2, "busy", &[]));
    let async_only = rt.block_on(restarts(
        &agent,
        "bench-async",
        1,
        "busy",
        &[("WARDEN_RESTART_SIGNAL", "off")],
    ));
    let signal = signal_baseline();
    let grpc = rt.block_on(grpc_baseline(&agent));
    println!(
        "| decision -> RestartRequested raised in Python | samples | min ms | median ms | p90 ms | max ms |"
    );
    println!("|---|---|---|---|---|---|");
    row("2 ranks blocked in `time.sleep` (restart signal)", sleep);
    row(
        "2 ranks spinning in Python (signal, async exception as fallback)",
        busy,
    );
    row(
        "1 rank spinning, `WARDEN_RESTART_SIGNAL=off` (async exception alone)",
        async_only,
    );
    row(
        "**baseline**: `kill(SIGUSR1)` -> a plain Python handler's raise in `time.sleep`",
        signal,
    );
    row(
        "**baseline**: one unary gRPC call to wardend (`GetNodeHealth`), round trip",
        grpc,
    );
}
