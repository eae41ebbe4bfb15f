//! Multi-node the torchrun way (issue 33, point 3): no etcd, the same
//! `warden run --nnodes N|MIN:MAX --rdzv-backend c10d --rdzv-endpoint
//! 127.0.0.2:PORT` line on two hosts of this machine (127.0.0.2, which
//! hosts torch's store, and 127.0.0.3; `--local-addr` each), each launcher
//! with its own embedded agent, real torch workers (tests/fixtures/
//! c10d_job.py: gloo all-reduces checked against the world size).
//!
//! What is shown:
//! - torch's rendezvous gives the two hosts distinct node ranks and the
//!   workers RANKs 0..W-1;
//! - a worker killed on one host: that host joins the next round, the other
//!   sees it waiting, and both run one new round together; the job ends 0;
//! - a host lost (its launcher and its worker SIGKILLed) under `--nnodes
//!   1:2`: its heartbeats stop, torch drops it, and the survivor runs on in
//!   a round of one and ends 0;
//! - a third host started with the same line under `--nnodes 2` waits
//!   (torch's spare) and takes a lost host's place in the next round;
//! - two hosts started at the same instant, several times: never the same
//!   node rank;
//! - jobs of no steps, the store's host done first: it waits in the exit
//!   barrier (torchrun's) until the other is done with the round; both
//!   end 0;
//! - a pickle a stranger writes into the store as torch's state is refused
//!   before torch unpickles it: its command never runs.
//!
//! The tests run one at a time (a lock). Every wait has a deadline and
//! awaits the launchers' or workers' own lines, never a sleep. Needs torch
//! in `$WARDEN_TEST_PYTHON`; skips, saying so, only when torch is missing
//! and `WARDEN_REQUIRE_TORCH` is unset.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{Streaming, WARDEN, free_port_below_ephemeral, python, repo_root, torch_available};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

/// Any one wait on a loaded 2-core machine: interpreters importing torch,
/// torch's heartbeat timeout, a round's last call.
const WAIT: Duration = Duration::from_secs(240);

/// torch's rendezvous settings: a heartbeat every 2 s, a node dead after 3
/// missed (6 s: margin for a loaded machine's heartbeat thread), a last
/// call of 3 s.
const RDZV_CONF: &str =
    "join_timeout=180,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3";

/// The embedded agents: no kernel log, NVML or DCGM.
const AGENT_TOML: &str =
    "[kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n";

/// One test at a time: each runs several torch interpreters on two cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One host: its address and scratch directory (logs, agent config,
/// summary).
struct Host {
    dir: tempfile::TempDir,
    addr: &'static str,
}

impl Host {
    fn new(addr: &'static str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-c10d-")
            .tempdir()
            .unwrap();
        std::fs::write(dir.path().join("agent.toml"), AGENT_TOML).unwrap();
        Self { dir, addr }
    }

    /// The same line as every other host's, but for `--local-addr` and the
    /// host's own directories; its lines and its workers' on one stream.
    fn launch(&self, port: u16, job: &str, nnodes: &str, steps: u32) -> Streaming {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
            .arg("--socket")
            .arg(self.dir.path().join("no-agent-here.sock"))
            .arg("run")
            .args(["--nnodes", nnodes, "--nproc-per-node", "1"])
            .args(["--rdzv-backend", "c10d"])
            .args(["--rdzv-endpoint", &format!("127.0.0.2:{port}")])
            .args(["--rdzv-id", job])
            .args(["--rdzv-conf", RDZV_CONF])
            .args(["--local-addr", self.addr])
            // Fewer interpreters importing torch on two cores.
            .arg("--no-standby")
            .arg("--log-dir")
            .arg(self.dir.path().join("logs"))
            .arg("--agent-config")
            .arg(self.dir.path().join("agent.toml"))
            .arg("--summary-json")
            .arg(self.dir.path().join(format!("{job}.json")))
            .arg("--")
            .arg(python())
            .arg(repo_root().join("tests/fixtures/c10d_job.py"))
            .env("C10D_STEPS", steps.to_string())
            .env("C10D_STEP_MS", "100")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("WARDEN_SOCKET")
            .env_remove("WARDEN_JOB_ID")
            .current_dir(self.dir.path());
        let mut s = Streaming::spawn(&mut cmd, self.dir.path().join(format!("{job}.stderr")));
        s.label = format!("{} ({})", self.addr, s.label);
        s
    }

    fn summary(&self, job: &str) -> Value {
        let path = self.dir.path().join(format!("{job}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: no summary at {}: {e}", self.addr, path.display()));
        serde_json::from_str(&text).unwrap()
    }
}

/// The value of `key=` in a worker's line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn num(line: &str, key: &str) -> u64 {
    field(line, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// A worker's `world ...` line (the fixture prints it at start).
fn is_world(line: &str) -> bool {
    line.starts_with("[rank ") && line.contains("] world rank=")
}

/// Waits for the launcher's exit; its code, after reading the rest of its
/// lines.
fn exit_code(h: &mut Streaming) -> i32 {
    let status = h.wait_exit(WAIT);
    h.drain(Duration::from_secs(5));
    status.code().unwrap_or_else(|| {
        panic!(
            "{}: killed by a signal: {status}; lines: {:?}",
            h.label, h.seen
        )
    })
}

fn context(h: &Streaming) -> String {
    let from = h.seen.len().saturating_sub(60);
    format!("--- {} ---\n{}", h.label, h.seen[from..].join("\n"))
}

fn attempts(summary: &Value) -> Vec<Value> {
    summary["attempts"].as_array().cloned().unwrap_or_default()
}

/// Two hosts' world lines of one round: the same round, one node each, the
/// ranks 0..W-1 once each.
fn one_round(lines: &[&str], world: u64) -> u64 {
    let epochs: BTreeSet<u64> = lines.iter().map(|l| num(l, "epoch")).collect();
    assert_eq!(epochs.len(), 1, "one round for every host: {lines:?}");
    let nodes: BTreeSet<u64> = lines.iter().map(|l| num(l, "group_rank")).collect();
    let ranks: BTreeSet<u64> = lines.iter().map(|l| num(l, "rank")).collect();
    let want: BTreeSet<u64> = (0..world).collect();
    assert_eq!(nodes, want, "distinct node ranks 0..{world}: {lines:?}");
    assert_eq!(ranks, want, "RANKs 0..{world} once each: {lines:?}");
    for l in lines {
        assert_eq!(num(l, "world_size"), world, "{l}");
        assert_eq!(num(l, "nnodes"), world, "{l}");
    }
    epochs.into_iter().next().unwrap()
}

#[test]
fn two_hosts_get_distinct_node_ranks_and_a_crash_makes_one_round_on_both() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    let job = "c10d-crash";
    let port = free_port_below_ephemeral("127.0.0.2");
    let (ha, hb) = (Host::new("127.0.0.2"), Host::new("127.0.0.3"));
    let mut a = ha.launch(port, job, "2", 120);
    let mut b = hb.launch(port, job, "2", 120);
    let wa = a.wait_line(WAIT, "a worker's world", is_world);
    let wb = b.wait_line(WAIT, "a worker's world", is_world);
    let e0 = one_round(&[&wa, &wb], 2);
    // Both workers step together, then one of host-b's dies.
    b.wait_line(WAIT, "a step of host-b's worker", |l| {
        l.contains("] step 10 ")
    });
    let victim = i32::try_from(num(&wb, "pid")).unwrap();
    kill(Pid::from_raw(victim), Signal::SIGKILL).expect("kill host-b's worker");

    // Every host restarts, in one new round.
    let mut second = Vec::new();
    for h in [&mut a, &mut b] {
        h.wait_line(WAIT, "the second attempt", |l| {
            l.contains("attempt 1: started 1 worker")
        });
        second.push(h.wait_line(WAIT, "a worker of the second attempt", |l| {
            is_world(l) && num(l, "epoch") > e0
        }));
    }
    let e1 = one_round(&[&second[0], &second[1]], 2);
    assert_eq!(e1, e0 + 1, "the next round of torch's rendezvous");
    assert!(
        b.seen
            .iter()
            .any(|l| l.contains("decision: restart_in_job")),
        "host-b's agent decided the restart\n{}",
        context(&b)
    );
    assert_eq!(exit_code(&mut a), 0, "{}", context(&a));
    assert_eq!(exit_code(&mut b), 0, "{}", context(&b));
    for (host, h) in [(&ha, &a), (&hb, &b)] {
        let at = attempts(&host.summary(job));
        assert_eq!(
            at.len(),
            2,
            "{}: one restart, not more: {at:?}\n{}",
            host.addr,
            context(h)
        );
        assert_eq!(at[1]["epoch"].as_u64(), Some(e1), "{at:?}");
        assert_eq!(at[1]["world_size"], 2, "{at:?}");
        assert!(
            h.seen.iter().any(|l| l.contains("] done rank=")),
            "{}: the workers of the new round finished\n{}",
            host.addr,
            context(h)
        );
    }
}

#[test]
fn a_lost_host_leaves_the_survivor_in_a_smaller_round() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    let job = "c10d-lost";
    let port = free_port_below_ephemeral("127.0.0.2");
    let (ha, hb) = (Host::new("127.0.0.2"), Host::new("127.0.0.3"));
    let mut a = ha.launch(port, job, "1:2", 150);
    let mut b = hb.launch(port, job, "1:2", 150);
    // Both in one round of two (the first may have had one host: then a
    // scale up, torch's wait list).
    let of_two = |l: &str| is_world(l) && field(l, "world_size") == Some("2");
    let wa = a.wait_line(WAIT, "a worker in a round of two", of_two);
    let wb = b.wait_line(WAIT, "a worker in a round of two", of_two);
    let e = one_round(&[&wa, &wb], 2);
    b.wait_line(WAIT, "a step of host-b's worker", |l| {
        l.contains("] step 10 ")
    });

    // host-b is lost: its launcher and its worker.
    let lost = Instant::now();
    b.signal(Signal::SIGKILL);
    let worker = i32::try_from(num(&wb, "pid")).unwrap();
    let _ = kill(Pid::from_raw(worker), Signal::SIGKILL);
    b.wait_exit(WAIT);

    let smaller = a.wait_line(WAIT, "a worker in a round of one", |l| {
        is_world(l) && field(l, "world_size") == Some("1")
    });
    let took = lost.elapsed();
    assert!(num(&smaller, "epoch") > e, "{smaller}");
    assert_eq!(num(&smaller, "group_rank"), 0, "{smaller}");
    assert_eq!(num(&smaller, "nnodes"), 1, "{smaller}");
    println!("scale down: host-a's worker runs the round of one {took:?} after host-b was lost");
    a.wait_line(WAIT, "the survivor's end", |l| {
        l.contains("] done rank=0 world_size=1")
    });
    assert_eq!(exit_code(&mut a), 0, "{}", context(&a));
    let at = attempts(&ha.summary(job));
    let last = at.last().unwrap();
    assert_eq!(last["world_size"], 1, "{at:?}");
    assert_eq!(
        last["epoch"].as_u64(),
        Some(num(&smaller, "epoch")),
        "{at:?}"
    );
}

#[test]
fn hosts_started_at_the_same_instant_never_share_a_node_rank() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    for round in 0..3 {
        let job = format!("c10d-race-{round}");
        let port = free_port_below_ephemeral("127.0.0.2");
        let (ha, hb) = (Host::new("127.0.0.2"), Host::new("127.0.0.3"));
        // Started back to back, the client first: both join torch's first
        // round at once. Ten seconds of steps each, all-reduced across the
        // hosts (jobs of no steps: the exit barrier's test, below).
        let mut b = hb.launch(port, &job, "2", 100);
        let mut a = ha.launch(port, &job, "2", 100);
        let wa = a.wait_line(WAIT, "a worker's world", is_world);
        let wb = b.wait_line(WAIT, "a worker's world", is_world);
        one_round(&[&wa, &wb], 2);
        assert_eq!(exit_code(&mut a), 0, "{}", context(&a));
        assert_eq!(exit_code(&mut b), 0, "{}", context(&b));
    }
}

/// torchrun's exit barrier: jobs of no steps, the client started first, so
/// the store's host completes the round, runs its worker and finishes while
/// the other host is still in its join (torch's next look at the state).
/// Without the barrier the store's host closed the rendezvous and went,
/// and the other lost the store mid-join ("Failed to recv, got 0 bytes")
/// or found the rendezvous closed: it stopped with 1. With it, the store's
/// host waits until the other is done with the round: both run their
/// worker in one round of two and end 0. Several times: it is a race.
#[test]
fn hosts_whose_jobs_end_at_once_both_exit_0_through_the_exit_barrier() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    for round in 0..3 {
        let job = format!("c10d-exit-{round}");
        let port = free_port_below_ephemeral("127.0.0.2");
        let (ha, hb) = (Host::new("127.0.0.2"), Host::new("127.0.0.3"));
        let mut b = hb.launch(port, &job, "2", 0);
        let mut a = ha.launch(port, &job, "2", 0);
        let wa = a.wait_line(WAIT, "a worker's world", is_world);
        let wb = b.wait_line(WAIT, "a worker's world", is_world);
        one_round(&[&wa, &wb], 2);
        assert_eq!(exit_code(&mut a), 0, "{}", context(&a));
        assert_eq!(exit_code(&mut b), 0, "{}", context(&b));
        for (host, h) in [(&ha, &a), (&hb, &b)] {
            assert!(
                h.seen.iter().any(|l| l.contains("] done rank=")),
                "{}: its worker finished\n{}",
                host.addr,
                context(h)
            );
            let at = attempts(&host.summary(&job));
            assert_eq!(at.len(), 1, "{}: one attempt: {at:?}", host.addr);
            // The barrier let go of every host together, after the close:
            // none found the store gone or could not close.
            assert!(
                !h.seen.iter().any(|l| l.contains("without every node")
                    || l.contains("could not close")
                    || l.contains("could not count")),
                "{}: a clean end\n{}",
                host.addr,
                context(h)
            );
        }
    }
}

/// Anyone who reaches the endpoint can write torch's rendezvous state,
/// which torch keeps as a pickle. A stranger's state that would run a
/// command when unpickled is refused before torch unpickles it: the
/// launcher stops (exit 1, naming the refusal) and the command never runs.
#[test]
fn a_state_a_stranger_writes_into_the_store_is_refused_not_run() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    let job = "c10d-stranger";
    let port = free_port_below_ephemeral("127.0.0.2");
    let ha = Host::new("127.0.0.2");
    // A job of two that waits for its second host: the launcher reads the
    // state again and again meanwhile.
    let mut a = ha.launch(port, job, "2", 0);
    a.wait_line(WAIT, "the launcher's start", |l| {
        l.contains("node rank from torch's c10d rendezvous")
    });
    let marker = ha.dir.path().join("ran");
    let stranger = format!(
        r#"
import base64, os, pickle, time
from datetime import timedelta
from torch.distributed import TCPStore
class Evil:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
s = TCPStore("127.0.0.2", {port}, is_master=False, timeout=timedelta(seconds=120))
key = "torch.rendezvous.{job}"
# Wait for the launcher's own state, then replace it.
while s.get(key) == b"Y2FuaW1hZGFt":
    time.sleep(0.2)
s.set(key, base64.b64encode(pickle.dumps(Evil())))
print("written", flush=True)
"#,
        marker = marker.display()
    );
    let out = common::run(Command::new(python()).args(["-c", &stranger]), WAIT);
    assert!(out.status.success(), "the stranger: {}", out.stderr);
    let refused = a.wait_line(WAIT, "the refusal", |l| l.contains("refused"));
    assert!(
        refused.contains("posix.system") || refused.contains("os.system"),
        "{refused}"
    );
    assert_eq!(exit_code(&mut a), 1, "{}", context(&a));
    assert!(!marker.exists(), "the stranger's command ran");
}

/// A third host started with the same line under `--nnodes 2` finds the
/// round full and waits (torch's redundancy list, torchrun's spare). When a
/// host of the round is lost, torch drops it, and the spare takes its place:
/// the survivor and the spare run a round of two together.
#[test]
fn a_waiting_host_replaces_a_lost_one() {
    if !torch_available() {
        return;
    }
    let _one = serial();
    let job = "c10d-spare";
    let port = free_port_below_ephemeral("127.0.0.2");
    let (ha, hb, hs) = (
        Host::new("127.0.0.2"),
        Host::new("127.0.0.3"),
        Host::new("127.0.0.4"),
    );
    let mut a = ha.launch(port, job, "2", 150);
    let mut b = hb.launch(port, job, "2", 150);
    let wa = a.wait_line(WAIT, "a worker's world", is_world);
    let wb = b.wait_line(WAIT, "a worker's world", is_world);
    let e = one_round(&[&wa, &wb], 2);
    let mut s = hs.launch(port, job, "2", 150);
    b.wait_line(WAIT, "a step of host-b's worker", |l| {
        l.contains("] step 10 ")
    });

    b.signal(Signal::SIGKILL);
    let worker = i32::try_from(num(&wb, "pid")).unwrap();
    let _ = kill(Pid::from_raw(worker), Signal::SIGKILL);
    b.wait_exit(WAIT);

    let later = |l: &str| is_world(l) && num(l, "epoch") > e;
    let wa = a.wait_line(WAIT, "a worker of the round with the spare", later);
    let ws = s.wait_line(WAIT, "the spare's worker", later);
    one_round(&[&wa, &ws], 2);
    assert_eq!(exit_code(&mut a), 0, "{}", context(&a));
    assert_eq!(exit_code(&mut s), 0, "{}", context(&s));
    assert!(
        s.seen.iter().all(|l| !is_world(l) || num(l, "epoch") > e),
        "the spare ran no workers before a place was free\n{}",
        context(&s)
    );
}
