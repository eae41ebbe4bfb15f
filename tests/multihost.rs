//! Multi-host jobs through a real etcd: two or three real `warden run`
//! launchers on this machine act as the job's hosts (host ids host-a, -b,
//! -c, -s; advertised addresses 127.0.0.2 and up), each with its own
//! embedded agent, scratch directory (logs, agent state, summary) and
//! `examples/train.py` workers (no torch, no GPU). The hosts share one
//! checkpoint directory, as hosts share a file system, except in the spare
//! test, where each saves into its own agent's tier (`--ckpt warden`).
//!
//! What is shown:
//! - a worker killed on one host: that host's agent decides a restart in
//!   job, and every host restarts exactly once, in the same new round;
//! - a host's launcher killed (SIGKILL; its workers die with it, their
//!   parent-death signal): after the lease TTL the others run a round
//!   without it (scale down: WORLD_SIZE smaller); the launcher started
//!   again: a round with every host (scale up: the full WORLD_SIZE);
//! - a user error (a Python exception) on one host: its agent stops the
//!   job, and every host stops with the rank's exit status;
//! - a GPU of one host fails (XID 79 from the NVML stand-in its embedded
//!   agent loads through `--agent-config`): its agent cordons the node,
//!   the launcher leaves the job and exits 86, and a standby spare
//!   (`--spare`) takes its node rank with the same WORLD_SIZE (hot-swap);
//!   its workers resume from the failed host's checkpoint shards, which
//!   the other host's agent holds as replicas: no `[[checkpoint.peers]]`
//!   anywhere, the agents learn each other from the launchers' rounds.
//!
//! - a GPU of a host fails where that host allows at most 40% of the
//!   job's hosts to be cordoned within the hour (`--max-cordon-share`):
//!   its agent cordons the node, but its launcher, past the share (one of
//!   two hosts), exits 87 (a person should look) instead of 86 and says
//!   why; the other host goes on without it.
//!
//! - etcd killed (SIGKILL) and started again on its data after two lease
//!   TTLs, then one host's lease expired in etcd: every host's workers keep
//!   stepping through both, the host rejoins under a new lease, no host
//!   leaves, no round is made, and the job finishes with exit 0 everywhere.
//!
//! The tests run one at a time (a lock): each runs up to seven Python
//! workers, three launchers and etcd, and the test machine has 2 cores.
//! Every wait has a deadline; progress is awaited on the launchers' and
//! workers' own output lines, never on sleeps.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::{WARDEN, eventually, python, repo_root, within};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use warden_cli::Target;
use warden_proto::v1 as pb;

/// Any one wait: a launcher's start, a round, a restart, the job's end on
/// a busy machine.
const WAIT: Duration = Duration::from_secs(90);
/// The membership lease of every launcher: 3 s, so the keep-alive every
/// second has the margin of a loaded 2-core machine (the issue-22 failure:
/// a 1 s lease lapsed under load). A lapse is survived anyway (the lease
/// is kept or regained), but costs a rejoin.
const TTL: &str = "3s";
/// [`TTL`] as a duration.
const TTL_S: Duration = Duration::from_secs(3);

/// The embedded agents: fast ticks, no kernel log, NVML or DCGM.
const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n";

/// One test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A host's scratch directory: its logs, its agent's config and state, its
/// summary. Outlives a launcher that is killed and started again.
struct Scratch {
    dir: tempfile::TempDir,
    host: &'static str,
    addr: &'static str,
}

/// What a launcher runs.
struct Spec<'a> {
    job: &'a str,
    nproc: u32,
    nnodes: &'a str,
    ckpt: &'a Path,
    steps: u32,
    step_ms: u32,
    extra: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
    /// More arguments of train.py (faults to inject).
    train: &'a [&'a str],
}

impl Scratch {
    /// The host's embedded agent is named after the host, and gets its own
    /// checkpoint tier in the scratch directory and a TCP listener on the
    /// host's address (port chosen by the kernel), where the job's other
    /// agents reach its tier.
    fn new(host: &'static str, addr: &'static str, agent_toml: &str) -> Self {
        Self::listening(host, addr, addr, agent_toml, "")
    }

    /// [`Scratch::new`] with the agent's TCP listener on `listen` (an
    /// unspecified address, `0.0.0.0`, as the DaemonSet suggests), the
    /// host still advertising `addr` in the job; `ckpt_extra` goes into
    /// `[checkpoint]`.
    fn listening(
        host: &'static str,
        addr: &'static str,
        listen: &str,
        agent_toml: &str,
        ckpt_extra: &str,
    ) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-mh-")
            .tempdir()
            .expect("create a scratch directory");
        let toml = format!(
            "{}[api]\ntcp = \"{listen}:0\"\n{}[checkpoint]\ndir = {:?}\n{ckpt_extra}",
            agent_toml.replacen(
                "[agent]\n",
                &format!("[agent]\nhost_name = \"{host}\"\n"),
                1
            ),
            common::pki::api_keys(host),
            dir.path().join("tier").display().to_string()
        );
        std::fs::write(dir.path().join("agent.toml"), toml).expect("write the agent config");
        Self { dir, host, addr }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `warden run --rdzv-backend etcd ...` as this host, in the background.
    fn launch(&self, etcd: &EtcdServer, s: &Spec) -> Launched {
        let mut cmd = Command::new(WARDEN);
        cmd.arg("--socket")
            .arg(self.path().join("no-agent-here.sock"))
            .arg("run")
            .args(["--nproc-per-node", &s.nproc.to_string()])
            .args(["--nnodes", s.nnodes])
            .args(["--rdzv-backend", "etcd"])
            .args(["--rdzv-endpoint", &etcd.endpoint])
            .args(["--rdzv-id", s.job])
            .args(["--rdzv-conf", "join_timeout=60,last_call_timeout=3"])
            .args(["--host-id", self.host])
            .args(["--advertise-addr", self.addr])
            .args(["--rdzv-lease-ttl", TTL])
            .arg("--log-dir")
            .arg(self.path().join("logs"))
            .arg("--agent-config")
            .arg(self.path().join("agent.toml"))
            .arg("--summary-json")
            .arg(self.path().join("summary.json"))
            .args(s.extra)
            .arg("--")
            .arg(python())
            .arg(repo_root().join("examples/train.py"))
            .arg("--ckpt-dir")
            .arg(s.ckpt)
            .args(["--steps", &s.steps.to_string()])
            .args(["--step-ms", &s.step_ms.to_string()])
            .args(["--report-every", "0"])
            .args(s.train)
            .current_dir(self.path());
        for (k, v) in s.env {
            cmd.env(k, v);
        }
        Launched::spawn(self.host, &mut cmd, self.path().join("output.log"))
    }

    fn summary(&self) -> Value {
        let path = self.path().join("summary.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: no summary at {}: {e}", self.host, path.display()));
        serde_json::from_str(&text).expect("the summary is JSON")
    }
}

/// A running launcher: its stdout (worker lines) and stderr (`[warden]`
/// lines) read line by line into one channel with deadlines, and copied to
/// a file for the failure messages; killed and reaped when dropped.
struct Launched {
    host: &'static str,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Launched {
    fn spawn(host: &'static str, cmd: &mut Command, copy: PathBuf) -> Self {
        for var in [
            "WARDEN_SOCKET",
            "WARDEN_JOB_ID",
            "RUNTIME_DIRECTORY",
            "STATE_DIRECTORY",
            "NOTIFY_SOCKET",
        ] {
            cmd.env_remove(var);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn warden run");
        let (tx, lines) = mpsc::channel();
        let file = std::sync::Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(copy)
                .expect("open the output copy"),
        ));
        let pipe = |r: Box<dyn Read + Send>| {
            let tx = tx.clone();
            let file = std::sync::Arc::clone(&file);
            std::thread::spawn(move || {
                for line in BufReader::new(r).lines() {
                    let Ok(line) = line else { return };
                    if let Ok(mut f) = file.lock() {
                        use std::io::Write;
                        let _ = writeln!(f, "{line}");
                    }
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
        };
        pipe(Box::new(child.stdout.take().expect("piped stdout")));
        pipe(Box::new(child.stderr.take().expect("piped stderr")));
        Self {
            host,
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    fn context(&self) -> String {
        let from = self.seen.len().saturating_sub(80);
        format!(
            "--- {} (last {} lines) ---\n{}",
            self.host,
            self.seen.len() - from,
            self.seen[from..].join("\n")
        )
    }

    /// The next line (from now on) that satisfies `pred`.
    fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "{}: no line with {what} within {WAIT:?} ({e})\n{}",
                    self.host,
                    self.context()
                ),
            }
        }
    }

    /// Every line that comes within `d`.
    fn read_for(&mut self, d: Duration) -> Vec<String> {
        let deadline = Instant::now() + d;
        let mut got = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return got;
            }
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    got.push(line);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => return got,
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!(
                    "{}: the launcher's output ended during the wait\n{}",
                    self.host,
                    self.context()
                ),
            }
        }
    }

    /// A line already read that satisfies `pred`.
    fn seen_line(&self, pred: impl Fn(&str) -> bool) -> Option<&str> {
        self.seen.iter().map(String::as_str).find(|l| pred(l))
    }

    /// Reads the rest of the output and the exit code.
    fn wait_exit(&mut self) -> i32 {
        let deadline = Instant::now() + WAIT;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            if let Some(status) = self.child.try_wait().expect("poll the launcher") {
                // The pipes close with the process; take what is left.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
                    self.seen.push(line);
                }
                return status.code().unwrap_or_else(|| {
                    panic!(
                        "{}: killed by a signal: {status}\n{}",
                        self.host,
                        self.context()
                    )
                });
            }
            assert!(
                Instant::now() < deadline,
                "{}: the launcher did not exit within {WAIT:?}\n{}",
                self.host,
                self.context()
            );
            // Poll the exit; lines are drained above meanwhile.
            if let Ok(line) = self.lines.recv_timeout(Duration::from_millis(20)) {
                self.seen.push(line);
            }
        }
    }

    fn sigkill(&mut self) {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The value of `key=` in a `[rank R] world ...` line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// A worker's `world ...` line (train.py prints it at start).
fn is_world(line: &str) -> bool {
    line.starts_with("[rank ") && line.contains("] world rank=")
}

/// The first `world` line of `h`'s workers, read already or awaited.
fn first_world(h: &mut Launched) -> String {
    match h.seen_line(is_world) {
        Some(l) => l.to_owned(),
        None => h.wait_line("a worker's world", is_world),
    }
}

fn epoch_of(line: &str) -> u64 {
    field(line, "epoch")
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("no epoch in {line:?}"))
}

/// The pids in `[warden] attempt N: started K workers (pids P Q; ...`.
fn pids_of(line: &str) -> Vec<i32> {
    line.split_once("(pids ")
        .and_then(|(_, rest)| rest.split_once(';'))
        .map(|(pids, _)| {
            pids.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
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

fn attempts(summary: &Value) -> Vec<Value> {
    summary["attempts"].as_array().cloned().unwrap_or_default()
}

fn shared_ckpt() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("warden-mh-ckpt-")
        .tempdir()
        .expect("create the shared checkpoint directory")
}

/// A client of `host`'s embedded agent at `socket` (10 s to connect).
async fn embedded_agent(
    socket: &Path,
    host: &str,
) -> warden_proto::v1::agent_client::AgentClient<tonic::transport::Channel> {
    within(
        Duration::from_secs(10),
        &format!("a connection to {host}'s agent"),
        Target::Unix(socket.to_owned()).connect(),
    )
    .await
    .unwrap_or_else(|e| panic!("connect to {host}'s embedded agent: {e:#}"))
}

/// Waits until host-b's embedded agent (at `socket`) sees gpu0 and gpu1
/// OK (its XID event set is registered).
async fn host_b_with_both_gpus(socket: &Path, state: &Path, rank1: i32) {
    // NVML lists local rank 1's process on gpu1: the agent's own map of
    // pids to GPUs, which is what ties a GPU's fault to the job (the devices
    // a rank declares are its word only: docs/security.md).
    write_stub_state(state, &format!("count=2\ngpu1.pids={rank1}\n"));
    let mut client = embedded_agent(socket, "host-b").await;
    eventually(WAIT, "gpu0 and gpu1 OK on host-b", async || {
        let h = client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .ok()?
            .into_inner();
        let ok = |id: &str| {
            h.components
                .iter()
                .any(|c| c.id == id && c.status == pb::Status::Ok as i32)
        };
        (ok("gpu0") && ok("gpu1")).then_some(())
    })
    .await;
    let pid = rank1.to_string();
    eventually(WAIT, "NVML's process list for gpu1 on host-b", async || {
        let events = client
            .list_events(pb::ListEventsRequest::default())
            .await
            .ok()?
            .into_inner()
            .events;
        events
            .iter()
            .any(|e| {
                e.kind == "gpu.processes"
                    && e.subject == "gpu1"
                    && e.evidence
                        .iter()
                        .any(|kv| kv.key == "pids" && kv.value == pid)
            })
            .then_some(())
    })
    .await;
}

/// Replaces the NVML stand-in's state file at once (written beside it,
/// then renamed: the stub never reads half a file).
fn write_stub_state(state: &Path, text: &str) {
    let tmp = state.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, state).unwrap();
}

/// Local rank 1's pid on a host, from its launcher's first start line.
fn local_rank1(h: &mut Launched) -> i32 {
    let started = |l: &str| l.contains("attempt 0: started 2 workers");
    let line = match h.seen_line(started) {
        Some(l) => l.to_owned(),
        None => h.wait_line("the first attempt's workers started", started),
    };
    pids_of(&line)[1]
}

#[test]
fn a_worker_killed_on_one_host_restarts_every_host_once_in_one_round() {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    let spec = Spec {
        job: "mh-restart",
        nproc: 2,
        nnodes: "2",
        ckpt: ckpt.path(),
        steps: 160,
        step_ms: 50,
        extra: &[],
        env: &[],
        train: &[],
    };
    let sa = Scratch::new("host-a", "127.0.0.2", AGENT_TOML);
    let sb = Scratch::new("host-b", "127.0.0.3", AGENT_TOML);
    let mut a = sa.launch(&etcd, &spec);
    let mut b = sb.launch(&etcd, &spec);
    for h in [&mut a, &mut b] {
        h.wait_line("the first attempt's workers registered", |l| {
            l.contains("attempt 0: all 2 workers registered")
        });
    }
    let first = a
        .seen_line(|l| l.contains("attempt 0: started 2 workers"))
        .map(pids_of)
        .unwrap_or_default();
    assert_eq!(first.len(), 2, "{}", a.context());
    let e0 = epoch_of(&first_world(&mut a));
    assert_eq!(epoch_of(&first_world(&mut b)), e0, "one first round");
    kill(Pid::from_raw(first[1]), Signal::SIGKILL).expect("kill one of host-a's workers");

    // Every host restarts, on the same new round.
    let mut epochs = Vec::new();
    for h in [&mut a, &mut b] {
        h.wait_line("the second attempt started", |l| {
            l.contains("attempt 1: started 2 workers")
        });
        let world = h.wait_line("a worker of the second attempt", |l| {
            is_world(l) && epoch_of(l) > e0
        });
        epochs.push(epoch_of(&world));
    }
    assert_eq!(epochs[0], e0 + 1, "the next round");
    assert_eq!(epochs[0], epochs[1], "one round for both hosts");
    assert!(
        a.seen_line(|l| l.contains("decision: restart_in_job"))
            .is_some(),
        "host-a's agent decided the restart\n{}",
        a.context()
    );
    assert!(
        b.seen_line(
            |l| l.contains("new round across hosts") && l.contains("restart requested by host-a")
        )
        .is_some(),
        "host-b restarted on host-a's request\n{}",
        b.context()
    );
    assert_eq!(a.wait_exit(), 0, "{}", a.context());
    assert_eq!(b.wait_exit(), 0, "{}", b.context());

    // Exactly one new attempt each, on one round after the first.
    for (s, h) in [(&sa, &a), (&sb, &b)] {
        let at = attempts(&s.summary());
        assert_eq!(at.len(), 2, "{}: {at:?}\n{}", s.host, h.context());
        let (e0, e1) = (at[0]["epoch"].as_u64(), at[1]["epoch"].as_u64());
        assert_eq!(e1, Some(epochs[0]), "{}: {at:?}", s.host);
        assert_eq!(
            e0.map(|e| e + 1),
            e1,
            "{}: one round, not more: {at:?}",
            s.host
        );
        assert_eq!(at[1]["world_size"], 4);
        assert!(
            h.seen_line(|l| l.contains("attempt 2:")).is_none(),
            "{}: a second restart\n{}",
            s.host,
            h.context()
        );
    }
    let ended = |s: &Scratch| {
        attempts(&s.summary())[0]["ended"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert!(ended(&sa).contains("restarted in job"), "{}", ended(&sa));
    assert_eq!(ended(&sb), "stopped for a new round");

    // Goodput job-wide: each launcher kept its host's breakdown in etcd;
    // the sum has every rank of both hosts, adds up, and is the sum of the
    // two hosts' own goodput.json.
    let out = Command::new(WARDEN)
        .args(["--json", "goodput", "--etcd", &etcd.endpoint])
        .args(["--job", "mh-restart"])
        .output()
        .expect("run warden goodput --etcd");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let job = &v["job"];
    assert_eq!(job["ranks"], 4, "{v}");
    assert_eq!(job["hosts"], serde_json::json!(["host-a", "host-b"]), "{v}");
    assert_eq!(job["open"], false, "both hosts' final reports: {v}");
    let total = job["accelerator_s"].as_f64().unwrap();
    let parts: f64 = job["parts"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p["accelerator_s"].as_f64().unwrap())
        .sum();
    assert!((parts - total).abs() < 1e-6 * total, "{parts} vs {total}");
    assert!(
        job["parts"]["restart_downtime"]["accelerator_s"]
            .as_f64()
            .unwrap()
            > 0.0,
        "the restart shows: {v}"
    );
    let own = |s: &Scratch, file: &str| -> Option<Value> {
        let dir = PathBuf::from(s.summary()["log_dir"].as_str().unwrap());
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        Some(serde_json::from_str(&text).unwrap())
    };
    let hosts_sum: f64 = [&sa, &sb]
        .iter()
        .map(|s| {
            own(s, "goodput.json").expect("each host's goodput.json")["accelerator_s"]
                .as_f64()
                .unwrap()
        })
        .sum();
    assert!(
        (hosts_sum - total).abs() < 1e-6 * total,
        "{hosts_sum} vs {total}"
    );
    // Each launcher wrote the whole job with both hosts' final reports:
    // the one that ended first waited for the other's (either host may end
    // last: a host restarted by the other's round can start, and so end,
    // first), and a live copy never replaced a final one.
    for s in [&sa, &sb] {
        let job = own(s, "goodput-job.json").expect("each host's goodput-job.json");
        let why = || {
            format!(
                "{}: {job}\netcd's sum: {v}\nhost-a:\n{}\nhost-b:\n{}",
                s.host,
                a.context(),
                b.context()
            )
        };
        assert_eq!(job["hosts"].as_array().map_or(0, Vec::len), 2, "{}", why());
        assert_eq!(job["open"], Value::Bool(false), "{}", why());
        assert_eq!(job["ranks"], 4, "{}", why());
        assert!(
            (job["accelerator_s"].as_f64().unwrap() - total).abs() < 1e-6 * total,
            "{}",
            why()
        );
    }
}

#[test]
fn a_dead_launcher_scales_the_job_down_and_its_return_scales_it_up() {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    let spec = Spec {
        job: "mh-elastic",
        nproc: 1,
        nnodes: "2:3",
        ckpt: ckpt.path(),
        steps: 400,
        step_ms: 40,
        extra: &[],
        env: &[],
        train: &[],
    };
    let sa = Scratch::new("host-a", "127.0.0.2", AGENT_TOML);
    let sb = Scratch::new("host-b", "127.0.0.3", AGENT_TOML);
    let sc = Scratch::new("host-c", "127.0.0.4", AGENT_TOML);
    let mut a = sa.launch(&etcd, &spec);
    let mut b = sb.launch(&etcd, &spec);
    let mut c = sc.launch(&etcd, &spec);
    // All three in one round (the first may have had two: then a scale-up).
    let full = |l: &str| is_world(l) && field(l, "world_size") == Some("3");
    let mut e_full = 0;
    for h in [&mut a, &mut b, &mut c] {
        e_full = e_full.max(epoch_of(&h.wait_line("a worker in a round of 3", full)));
    }
    // The worker of that round says its pid after its world line (the
    // same process, in order). The launcher's "started" line comes on its
    // stderr, read by another thread, so the newest one read may still be
    // an earlier attempt's, whose worker is gone already.
    let c_worker: i32 = c
        .wait_line("host-c's worker ready", |l| l.contains("] ready pid="))
        .split_once("] ready pid=")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .expect("host-c's worker pid");
    assert!(alive(c_worker), "host-c's worker {c_worker} runs");

    // host-c's launcher dies; its worker goes with it.
    let killed = Instant::now();
    c.sigkill();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(eventually(
        Duration::from_secs(10),
        "host-c's worker to die with its launcher",
        async || (!alive(c_worker)).then_some(()),
    ));
    let smaller = |l: &str| {
        is_world(l) && field(l, "world_size") == Some("2") && field(l, "nnodes") == Some("2")
    };
    let mut e_down = 0;
    for h in [&mut a, &mut b] {
        let line = h.wait_line("a worker in the scaled-down round", smaller);
        e_down = e_down.max(epoch_of(&line));
        assert!(epoch_of(&line) > e_full, "{line}");
        assert!(
            h.seen_line(|l| l.contains("host-c lost")).is_some(),
            "{}",
            h.context()
        );
    }
    let took = killed.elapsed();
    println!(
        "scale down: both hosts run the smaller round {took:?} after the launcher died (lease TTL {TTL})"
    );
    assert!(took < Duration::from_secs(30), "scale down took {took:?}");

    // host-c comes back: every host in a round of 3 again.
    let mut c = sc.launch(&etcd, &spec);
    let mut e_up = Vec::new();
    for h in [&mut a, &mut b, &mut c] {
        let line = h.wait_line("a worker in the scaled-up round", |l| {
            full(l) && epoch_of(l) > e_down
        });
        e_up.push(epoch_of(&line));
    }
    assert!(e_up.iter().all(|e| *e == e_up[0]), "one round: {e_up:?}");
    for h in [&mut a, &mut b, &mut c] {
        assert_eq!(h.wait_exit(), 0, "{}", h.context());
    }
    for s in [&sa, &sb] {
        let at = attempts(&s.summary());
        let sizes: Vec<u64> = at.iter().filter_map(|a| a["world_size"].as_u64()).collect();
        assert!(
            sizes.ends_with(&[3, 2, 3]),
            "{}: world sizes {sizes:?}: {at:?}",
            s.host
        );
        assert_eq!(at.last().unwrap()["epoch"].as_u64(), Some(e_up[0]));
    }
    let at = attempts(&sc.summary());
    assert_eq!(at.last().unwrap()["world_size"], 3, "{at:?}");
}

/// Builds the NVML stand-in (tests/nvml_stub) into `dir`.
fn build_nvml_stub(dir: &Path) -> PathBuf {
    let src = repo_root().join("tests/nvml_stub/nvml_stub.c");
    let lib = dir.join("libnvidia-ml.so.1");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

/// The embedded agent's socket, from the launcher's first line.
fn agent_socket(h: &mut Launched) -> PathBuf {
    let line = h.wait_line("the embedded agent's socket", |l| {
        l.contains("running the agent embedded")
    });
    line.split_once("(socket ")
        .and_then(|(_, r)| r.split_once(", state"))
        .map(|(s, _)| PathBuf::from(s))
        .unwrap_or_else(|| panic!("no socket in {line:?}"))
}

#[test]
fn a_spare_takes_the_place_of_a_host_whose_gpu_fails() {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    // host-b's agent watches two GPUs through the NVML stand-in; its local
    // rank 1 drives gpu1.
    let sb_dir = tempfile::tempdir().expect("a directory for the stub");
    let lib = build_nvml_stub(sb_dir.path());
    let state = sb_dir.path().join("nvml-state");
    std::fs::write(&state, "count=2\n").unwrap();
    let nvml_toml = AGENT_TOML.replace(
        "[nvml]\nenabled = false\n",
        &format!(
            "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n",
            lib.display().to_string()
        ),
    );
    let state_env = state.display().to_string();
    let b_env = [("NVML_STUB_STATE", state_env.as_str())];
    let spec = |extra: &'static [&'static str], env| Spec {
        job: "mh-spare",
        nproc: 2,
        nnodes: "2",
        ckpt: ckpt.path(),
        steps: 200,
        step_ms: 50,
        extra,
        env,
        // Each host saves into its own agent's tier; the agents learn
        // their peers from the launchers' etcd rounds.
        train: &["--ckpt", "warden"],
    };
    let sa = Scratch::new("host-a", "127.0.0.2", AGENT_TOML);
    let sb = Scratch::new("host-b", "127.0.0.3", &nvml_toml);
    let ss = Scratch::new("host-s", "127.0.0.4", AGENT_TOML);
    let mut a = sa.launch(&etcd, &spec(&[], &[]));
    let mut b = sb.launch(&etcd, &spec(&[], &b_env));
    let socket = agent_socket(&mut b);
    let a_socket = agent_socket(&mut a);
    for h in [&mut a, &mut b] {
        h.wait_line("the first attempt's workers registered", |l| {
            l.contains("attempt 0: all 2 workers registered")
        });
    }
    let a_world = first_world(&mut a);
    let e1 = epoch_of(&a_world);
    // Node ranks follow the join order: either host may be node 0.
    let a_rank = field(&a_world, "group_rank").unwrap().to_owned();
    let b_rank = field(&first_world(&mut b), "group_rank")
        .unwrap()
        .to_owned();
    assert_ne!(a_rank, b_rank);
    // The spare joins a full round: no place, no workers.
    let mut s = ss.launch(&etcd, &spec(&["--spare"], &[]));
    s.wait_line("the spare on standby", |l| {
        l.contains("no place in this round")
    });
    // host-b's agent sees both GPUs (its XID event set is registered).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rank1 = local_rank1(&mut b);
    rt.block_on(async {
        host_b_with_both_gpus(&socket, &state, rank1).await;

        // host-b's shards reach host-a's tier (the agents learnt each
        // other from the round): a step complete with a copy of every
        // rank on host-a.
        let mut client_a = embedded_agent(&a_socket, "host-a").await;
        eventually(WAIT, "a step with all 4 shards on host-a", async || {
            let l = client_a
                .list_checkpoints(pb::ListCheckpointsRequest {
                    job_id: "mh-spare".into(),
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            l.steps
                .iter()
                .find(|s| {
                    s.complete
                        && s.world_size == 4
                        && s.shards.len() == 4
                        && s.shards.iter().all(|sh| {
                            sh.copies
                                .iter()
                                .any(|c| c.tier == "local" && c.holder == "host-a")
                        })
                })
                .map(|s| s.step)
        })
        .await;
    });

    // gpu1 falls off the bus.
    write_stub_state(&state, &format!("count=2\ngpu1.pids={rank1}\nxid.1=1,79\n"));
    assert_eq!(b.wait_exit(), 86, "{}", b.context());
    assert!(
        b.seen_line(|l| l.contains("decision: cordon")).is_some(),
        "{}",
        b.context()
    );

    // The spare takes host-b's node rank; the world size stays.
    let sw = s.wait_line("the spare's workers", is_world);
    assert_eq!(
        field(&sw, "group_rank"),
        Some(b_rank.as_str()),
        "host-b's: {sw}"
    );
    assert_eq!(field(&sw, "world_size"), Some("4"), "{sw}");
    assert_eq!(epoch_of(&sw), e1 + 1, "{sw}");
    // ... and resumes host-b's shards from host-a's copies: the only peer
    // it has is the one the round named.
    let resumed = s.wait_line("the spare's workers resuming", |l| {
        l.contains("resumed from checkpoint at step")
    });
    assert!(
        resumed.contains("tier peer") && resumed.contains("host-a"),
        "{resumed}\n{}",
        s.context()
    );
    // On the ring by node-rank order (every agent here takes it): the
    // spare in host-b's place has host-b's neighbour, which holds its
    // replicas. The round says the most checkpoint.replicas of its agents
    // (each has the default, 1), from the launchers' member records, and
    // how far along the order a host's targets lie (each agent its own
    // domain: the next place).
    assert!(
        s.seen_line(|l| l.contains("checkpoint peers of this round: host-a")
            && l.contains("(ring by node-rank order; each agent takes the first 1 of")
            && l.contains("all within 1 place of it)"))
            .is_some(),
        "{}",
        s.context()
    );
    let aw = a.wait_line("host-a's workers on the new round", |l| {
        is_world(l) && epoch_of(l) > e1
    });
    assert_eq!(epoch_of(&aw), e1 + 1, "{aw}");
    assert_eq!(field(&aw, "world_size"), Some("4"), "{aw}");
    assert_eq!(field(&aw, "group_rank"), Some(a_rank.as_str()), "{aw}");
    assert!(
        a.seen_line(|l| l.contains("host-b left (cordoned"))
            .is_some(),
        "{}",
        a.context()
    );
    assert_eq!(a.wait_exit(), 0, "{}", a.context());
    assert_eq!(s.wait_exit(), 0, "{}", s.context());

    assert_eq!(sb.summary()["exit_code"], 86);
    let at = attempts(&ss.summary());
    assert_eq!(at.len(), 1, "the spare ran once: {at:?}");
    assert_eq!(
        (
            at[0]["epoch"].as_u64(),
            at[0]["node_rank"].as_u64(),
            at[0]["world_size"].as_u64()
        ),
        (Some(e1 + 1), b_rank.parse().ok(), Some(4)),
        "{at:?}"
    );
}

#[test]
fn a_cordon_past_the_jobs_share_cap_exits_87_not_86() {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    // host-b's agent watches two GPUs through the NVML stand-in; its local
    // rank 1 drives gpu1. It allows at most 40% of the job's hosts to be
    // cordoned within the hour: itself alone is half of them.
    let sb_dir = tempfile::tempdir().expect("a directory for the stub");
    let lib = build_nvml_stub(sb_dir.path());
    let state = sb_dir.path().join("nvml-state");
    std::fs::write(&state, "count=2\n").unwrap();
    let nvml_toml = AGENT_TOML.replace(
        "[nvml]\nenabled = false\n",
        &format!(
            "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n",
            lib.display().to_string()
        ),
    );
    let state_env = state.display().to_string();
    let b_env = [("NVML_STUB_STATE", state_env.as_str())];
    let spec = |extra: &'static [&'static str], env| Spec {
        job: "mh-share",
        nproc: 2,
        nnodes: "1:2",
        ckpt: ckpt.path(),
        steps: 200,
        step_ms: 50,
        extra,
        env,
        train: &[],
    };
    let sa = Scratch::new("host-a", "127.0.0.2", AGENT_TOML);
    let sb = Scratch::new("host-b", "127.0.0.3", &nvml_toml);
    let mut a = sa.launch(&etcd, &spec(&[], &[]));
    let mut b = sb.launch(
        &etcd,
        &spec(
            &["--max-cordon-share", "0.4", "--cordon-share-window", "1h"],
            &b_env,
        ),
    );
    let socket = agent_socket(&mut b);
    b.wait_line("host-b's workers registered", |l| {
        l.contains("all 2 workers registered")
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rank1 = local_rank1(&mut b);
    rt.block_on(async {
        host_b_with_both_gpus(&socket, &state, rank1).await;
    });

    // gpu1 falls off the bus: the agent cordons host-b, and its launcher,
    // past the share, does not report a node fault.
    write_stub_state(&state, &format!("count=2\ngpu1.pids={rank1}\nxid.1=1,79\n"));
    assert_eq!(b.wait_exit(), 87, "{}", b.context());
    assert!(
        b.seen_line(|l| l.contains("decision: cordon")).is_some(),
        "{}",
        b.context()
    );
    // Read as host-b left: its own cordon is the one counted.
    let held = "cordon share cap: 1 of the job's 2 hosts cordoned within 1h (host-b)";
    assert!(
        b.seen_line(|l| l.contains(held)).is_some(),
        "{held}\n{}",
        b.context()
    );
    assert_eq!(sb.summary()["exit_code"], 87);
    // Its agent heard the held stop (ReportJobStop): an incident of the
    // job, kind cordon_share, not a fault of another node.
    assert!(
        b.seen_line(|l| l.contains("the agent recorded the stop as incident inc-"))
            .is_some(),
        "{}",
        b.context()
    );
    // host-a goes on without it and finishes.
    a.wait_line("host-b's departure", |l| {
        l.contains("host-b left (cordoned")
    });
    assert_eq!(a.wait_exit(), 0, "{}", a.context());
}

#[test]
fn a_user_error_on_one_host_stops_every_host_with_its_exit_code() {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    // Global rank 0 (node rank 0, whichever host that is) raises a
    // ValueError at step 10, on every attempt: no restart can fix it.
    let spec = Spec {
        job: "mh-user",
        nproc: 1,
        nnodes: "2",
        ckpt: ckpt.path(),
        steps: 400,
        step_ms: 50,
        extra: &[],
        env: &[],
        train: &["--raise-at-step", "10", "--raise-rank", "0"],
    };
    // No hang is part of this test: a hang floor of 1 s on a starved
    // machine (a CI run beside a build) judged the ranks hung before the
    // error, and the restart that made gave two attempts where one is
    // wanted. The floor here is longer than the whole job.
    let toml = AGENT_TOML.replacen("floor = \"1s\"", "floor = \"60s\"", 1);
    assert_ne!(toml, AGENT_TOML, "the hang floor is in AGENT_TOML");
    let sa = Scratch::new("host-a", "127.0.0.2", &toml);
    let sb = Scratch::new("host-b", "127.0.0.3", &toml);
    let mut a = sa.launch(&etcd, &spec);
    let mut b = sb.launch(&etcd, &spec);
    let (ca, cb) = (a.wait_exit(), b.wait_exit());
    assert_eq!((ca, cb), (1, 1), "{}\n{}", a.context(), b.context());
    let (failed, other) = if a.seen_line(|l| l.contains("decision: stop")).is_some() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert!(
        failed.seen_line(|l| l.contains("ValueError")).is_some(),
        "{}",
        failed.context()
    );
    let stopped = format!("ended: Failed by host {}", failed.host);
    assert!(
        other
            .seen_line(|l| l.contains("stopping: job mh-user") && l.contains(&stopped))
            .is_some(),
        "{} stopped with {}'s status\n{}",
        other.host,
        failed.host,
        other.context()
    );
    for s in [&sa, &sb] {
        let summary = s.summary();
        assert_eq!(summary["exit_code"], 1, "{summary:#}");
        assert_eq!(attempts(&summary).len(), 1, "no restart: {summary:#}");
    }
}

/// Issue 30: each launcher hands its agent the round's other hosts and
/// where its own host stands among them, and the agents' job-wide
/// exchange is cut from that order: node rank 0's agent aggregates, and
/// every rank of the job is judged against all of the job's ranks. Before,
/// the launcher left its own host out and said nothing of its place, so
/// every agent stood outside the job's order: node rank 0 reported to node
/// rank 1 and the others to node rank 0, two aggregators each with part of
/// the job (seen here: ranks compared with 2 of the 4), and no group
/// leader ever relayed (the tree was never used in a launcher's job).
#[test]
fn each_hosts_agent_stands_at_its_node_rank_and_judges_against_the_whole_job() {
    exchange_job(
        "mh-order",
        &[("host-a", "127.0.0.2"), ("host-b", "127.0.0.3")],
        2,
        "",
    );
}

/// Issue 30: agents listening on an unspecified address (`api.tcp =
/// "0.0.0.0:P"`, as deploy/kubernetes/daemonset.yaml suggests), each host
/// advertising its own. Each agent must stand on its job's replica ring at
/// the address the others know it by: before, it stood at `0.0.0.0:P` on
/// its own ring, sorted itself first, and sent its replicas to a host
/// whose own reckoning named another target, which refused them. Here
/// every step's shards reach a second host, and the exchange judges every
/// rank against the whole job.
#[test]
fn agents_on_an_unspecified_listener_replicate_and_judge_the_whole_job() {
    exchange_job_on(
        "mh-any",
        &[
            ("host-a", "127.0.0.2"),
            ("host-b", "127.0.0.3"),
            ("host-c", "127.0.0.4"),
        ],
        1,
        "",
        Some("0.0.0.0"),
    );
}

/// The same across the exchange's two-level tree: four hosts of one rank
/// in groups of two (`straggler.aggregator_fan_out = 2`): node rank 3
/// reports to node rank 2, its group's leader, which relays to node rank
/// 0, and every rank is judged against all four.
#[test]
fn four_hosts_in_groups_of_two_judge_every_rank_against_the_whole_job() {
    exchange_job(
        "mh-tree",
        &[
            ("host-a", "127.0.0.2"),
            ("host-b", "127.0.0.3"),
            ("host-c", "127.0.0.4"),
            ("host-d", "127.0.0.5"),
        ],
        1,
        "aggregator_fan_out = 2\n",
    );
}

/// `job` on `hosts` (host id, address) of `nproc` ranks each, under real
/// launchers over etcd, their agents exchanging every 200 ms (`extra`
/// more of `[straggler]`; no hang judged: a starved machine's pauses are
/// no part of it): waits until every host's ranks are judged against all
/// of the job's. The launchers are killed when it returns.
fn exchange_job(job: &str, hosts: &[(&'static str, &'static str)], nproc: u32, extra: &str) {
    exchange_job_on(job, hosts, nproc, extra, None);
}

/// [`exchange_job`] with every agent's TCP listener on `listen` when
/// given (an unspecified address): each rank then also saves into its
/// agent's tier, and every step's shards must reach a second host.
fn exchange_job_on(
    job: &str,
    hosts: &[(&'static str, &'static str)],
    nproc: u32,
    extra: &str,
    listen: Option<&str>,
) {
    let _one = serial();
    let etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    let nnodes = hosts.len().to_string();
    let spec = Spec {
        job,
        nproc,
        nnodes: &nnodes,
        ckpt: ckpt.path(),
        // Long enough for any wait below.
        steps: 4_000,
        step_ms: 50,
        extra: &[],
        env: &[],
        train: if listen.is_some() {
            &["--ckpt", "warden"]
        } else {
            &[]
        },
    };
    let toml = format!(
        "{}[straggler]\nexchange_interval = \"200ms\"\nsummary_ttl = \"3s\"\npeer_timeout = \"1s\"\n{extra}",
        AGENT_TOML.replacen("floor = \"1s\"", "floor = \"60s\"", 1)
    );
    let scratch: Vec<Scratch> = hosts
        .iter()
        // Every step kept: the ranks of train.py do not step together, and
        // under load they drift apart by more than the default two steps
        // kept, so no step would stay whole on every host (seen: ranks 0, 1
        // and 2 at steps 1630, 1645 and 1650).
        .map(|(host, addr)| {
            Scratch::listening(
                host,
                addr,
                listen.unwrap_or(addr),
                &toml,
                "keep_steps = 1000\n",
            )
        })
        .collect();
    let mut launched: Vec<(Launched, PathBuf)> = scratch
        .iter()
        .map(|h| {
            let mut l = h.launch(&etcd, &spec);
            let socket = agent_socket(&mut l);
            (l, socket)
        })
        .collect();
    let registered = format!("attempt 0: all {nproc} workers registered");
    for (l, _) in &mut launched {
        l.wait_line("the first attempt's workers registered", |l| {
            l.contains(&registered)
        });
    }
    let rt = runtime();
    let ranks = u32::try_from(hosts.len()).unwrap() * nproc;
    for (l, socket) in &launched {
        rt.block_on(judged_against(socket, l.host, job, nproc as usize, ranks));
    }
    if listen.is_some() {
        rt.block_on(replicated(&launched[0].1, job, ranks));
    }
}

/// Waits until the agent at `socket` lists a step of `job` complete for
/// its `ranks`, each shard with good copies on two hosts: every origin's
/// replica was taken by the host it was sent to.
async fn replicated(socket: &Path, job: &str, ranks: u32) {
    let mut client = embedded_agent(socket, "the first host").await;
    let on_two_hosts = |sh: &pb::ShardLocations| {
        sh.copies
            .iter()
            .filter(|c| c.corrupt.is_empty() && !c.unconfirmed)
            .map(|c| &c.holder)
            .collect::<std::collections::HashSet<_>>()
            .len()
            >= 2
    };
    let deadline = Instant::now() + WAIT;
    loop {
        // Every step is kept here: past 1,024 shards the default listing
        // would leave them out.
        let steps = client
            .list_checkpoints(pb::ListCheckpointsRequest {
                job_id: job.into(),
                detail: pb::ListDetail::All.into(),
                ranks: Vec::new(),
            })
            .await
            .map(|l| l.into_inner().steps)
            .unwrap_or_default();
        if steps.iter().any(|s| {
            s.complete
                && s.world_size == ranks
                && s.shards.len() == ranks as usize
                && s.shards.iter().all(on_two_hosts)
        }) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no step of {job} with every shard on two hosts within {WAIT:?}; the newest steps \
             listed: {:#?}",
            &steps[..steps.len().min(3)]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Waits until the `local` ranks of `host` (its embedded agent at
/// `socket`) are judged against `want` ranks of `job`: the job-wide
/// statistics its agent got cover the whole job. Fails naming what each
/// rank was compared with.
async fn judged_against(socket: &Path, host: &str, job: &str, local: usize, want: u32) {
    let mut client = embedded_agent(socket, host).await;
    let deadline = Instant::now() + WAIT;
    loop {
        // (global rank, ranks compared) of this host's ranks.
        let mine: Vec<(u32, u32)> = client
            .get_stragglers(pb::GetStragglersRequest {
                job_id: job.into(),
                flagged_only: false,
            })
            .await
            .map(|r| {
                r.into_inner()
                    .ranks
                    .iter()
                    .filter(|s| s.host == host)
                    .map(|s| (s.global_rank, s.ranks_compared))
                    .collect()
            })
            .unwrap_or_default();
        if mine.len() == local && mine.iter().all(|(_, n)| *n == want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{host}'s ranks not judged against all {want} of the job's within {WAIT:?}: \
             (rank, ranks compared) {mine:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `(rank, step)` of a worker's `[rank R] step N loss L` line.
fn step_line(line: &str) -> Option<(u32, u64)> {
    let rest = line.strip_prefix("[rank ")?;
    let (rank, rest) = rest.split_once("] step ")?;
    let (step, _) = rest.split_once(' ')?;
    Some((rank.parse().ok()?, step.parse().ok()?))
}

#[test]
fn etcd_killed_and_a_lease_expired_under_a_running_job_lose_no_host() {
    let _one = serial();
    let mut etcd = EtcdServer::start();
    let ckpt = shared_ckpt();
    let spec = Spec {
        job: "mh-etcd-outage",
        nproc: 2,
        nnodes: "2",
        ckpt: ckpt.path(),
        steps: 600,
        step_ms: 50,
        extra: &[],
        env: &[],
        train: &["--report-every", "5"],
    };
    let sa = Scratch::new("host-a", "127.0.0.2", AGENT_TOML);
    let sb = Scratch::new("host-b", "127.0.0.3", AGENT_TOML);
    let mut a = sa.launch(&etcd, &spec);
    let mut b = sb.launch(&etcd, &spec);
    for h in [&mut a, &mut b] {
        h.wait_line("the first attempt's workers registered", |l| {
            l.contains("attempt 0: all 2 workers registered")
        });
    }
    let e0 = epoch_of(&first_world(&mut a));
    assert_eq!(epoch_of(&first_world(&mut b)), e0, "one first round");

    // etcd gone for two lease TTLs and more: by their own clocks both
    // hosts' leases lapse.
    etcd.kill();
    let outage = 2 * TTL_S + Duration::from_secs(2);
    let killed = Instant::now();
    let mut steps: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
    while killed.elapsed() < outage {
        for h in [&mut a, &mut b] {
            for line in h.read_for(Duration::from_millis(100)) {
                if let Some((rank, step)) = step_line(&line) {
                    steps.entry(rank).or_default().push(step);
                }
            }
        }
    }
    etcd.restart();
    let back = killed.elapsed();

    // Every rank of both hosts stepped on through the outage.
    assert_eq!(
        steps.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "a rank reported no step during the outage: {steps:?}\n{}\n{}",
        a.context(),
        b.context()
    );
    for (rank, seen) in &steps {
        assert!(
            seen.len() >= 3 && seen.windows(2).all(|w| w[1] > w[0]),
            "rank {rank} did not keep stepping during the {back:?} outage: {seen:?}"
        );
    }

    // Then etcd expires host-a's lease (as when the host stalls past its
    // TTL; here revoked from outside, so the moment is the test's): host-a
    // rejoins under a new lease, same round, its workers untouched.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let revoked = rt.block_on(async {
        let mut c = etcd_client::Client::connect(etcd.endpoints(), None)
            .await
            .expect("connect to etcd");
        let key = format!("/warden/jobs/{}/members/host-a", spec.job);
        let got = c
            .get(key.as_str(), None)
            .await
            .expect("host-a's member key");
        let lease = got.kvs().first().expect("host-a is a member").lease();
        c.lease_revoke(lease).await.expect("revoke host-a's lease");
        lease
    });
    let rejoined = a.wait_line("host-a rejoined under a new lease", |l| {
        l.contains("rejoined the job under a new lease")
    });
    assert!(
        !rejoined.contains(&format!("{revoked:x} ")),
        "the same lease? {rejoined}"
    );
    for h in [&mut a, &mut b] {
        let mut after: std::collections::BTreeMap<u32, u64> = Default::default();
        let deadline = Instant::now() + WAIT;
        while after.len() < 2 {
            assert!(Instant::now() < deadline, "{}", h.context());
            for line in h.read_for(Duration::from_millis(100)) {
                if let Some((rank, step)) = step_line(&line) {
                    after.insert(rank, step);
                }
            }
        }
        for (rank, step) in &after {
            assert!(
                *step > steps[rank].last().copied().unwrap_or(0),
                "rank {rank} stepped backwards after the rejoin (a restart?): {step}"
            );
        }
    }

    // The job finishes everywhere, on its first attempt: no host left,
    // no round was made, no worker was stopped.
    assert_eq!(a.wait_exit(), 0, "{}", a.context());
    assert_eq!(b.wait_exit(), 0, "{}", b.context());
    for (s, h) in [(&sa, &a), (&sb, &b)] {
        let at = attempts(&s.summary());
        assert_eq!(at.len(), 1, "{}: {at:?}\n{}", s.host, h.context());
        assert_eq!(at[0]["epoch"].as_u64(), Some(e0), "{}: {at:?}", s.host);
        assert!(
            h.seen_line(|l| l.contains("membership lease lapsed"))
                .is_some(),
            "{}: the lapse was not told on the console\n{}",
            s.host,
            h.context()
        );
        assert!(
            h.seen_line(|l| l.contains("new round across hosts"))
                .is_none(),
            "{}: a round during the outage\n{}",
            s.host,
            h.context()
        );
    }
    println!(
        "etcd outage of {back:?}, then host-a's lease {revoked:x} expired and rejoined (lease TTL {TTL}): \
         4 ranks stepped through both, job finished on its first attempt"
    );
}
