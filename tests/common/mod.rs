//! The harness for warden's system tests: the real `wardend`, started the
//! way systemd starts it.
//!
//! [`TestAgent::start`] writes a config into a scratch directory (socket
//! there, metrics on a free port), binds a notify socket, spawns `wardend`
//! with `NOTIFY_SOCKET` pointing at it and waits for `READY=1`, exactly the
//! signal systemd waits for. Every wait has a deadline, so an agent that
//! hangs or dies fails the test with its stderr instead of hanging it. A
//! dropped agent is SIGKILLed and reaped; the scratch directory goes with it.

// Each test crate uses a different part of the harness; and a harness that
// cannot do its job panics, which fails the test that asked.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

/// A real etcd per test, for the multi-host coordination tests.
pub mod etcd;
/// One host of the heal-across-hosts tests.
pub mod heal_host;
/// The heal examples' log, and waits and counts over it, for the heal tests.
pub mod heal_log;
/// The deployment files (deploy/kubernetes) as data, for the packaging tests.
pub mod manifests;
/// A peer agent from before CollectHoldings (mixed-version tests).
pub mod old_peer;
/// A cluster CA and node certificates made by the test (mutual TLS tests).
pub mod pki;
/// A TCP proxy in front of etcd that holds its answers on one request
/// (a saturated etcd, for the join's retries).
pub mod stall_proxy;
/// Real unprivileged users, and attack code run as them (security tests).
pub mod users;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use warden_cli::Target;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

/// The agent binary under test.
pub const WARDEND: &str = env!("CARGO_BIN_EXE_wardend");
/// The CLI binary under test.
pub const WARDEN: &str = env!("CARGO_BIN_EXE_warden");

/// How long an agent may take to report READY=1. Generous: the test
/// machine may be busy compiling; a healthy agent needs milliseconds.
pub const STARTUP: Duration = Duration::from_secs(15);
/// How long anything else the tests wait for may take.
pub const WAIT: Duration = Duration::from_secs(10);

/// `[host]` thresholds under which host/memory is never DEGRADED or FAILED,
/// so a test's node health does not depend on the machine's free memory.
pub const MEMORY_NEVER_LOW: &str =
    "[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n";

/// A simulated node (`--simulate`) whose one GPU falls off the bus as soon
/// as the scenario starts: XID 79, an uncorrectable fault the default policy
/// answers with a cordon.
pub const XID79_AT_START: &str = r#"
description = "XID 79 on gpu0 at once"
[[gpu]]
count = 1
name = "Test GPU"
[[fault]]
at = "0s"
kind = "xid"
gpu = 0
xid = 79
"#;

/// Environment that would change how the binaries behave if the test runner
/// happened to have it set (under systemd, or a developer's shell).
const SCRUBBED_ENV: &[&str] = &[
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "WARDEN_CONFIG",
    "WARDEN_SOCKET",
    "RUNTIME_DIRECTORY",
    "STATE_DIRECTORY",
    "WARDEN_SIMULATE",
    "WARDEN_SIMULATE_SPEED",
];

/// Removes the agent-selecting variables a test run inherited from its
/// environment, keeping those the test set on `cmd` itself.
pub fn scrub(cmd: &mut Command) {
    let set: Vec<std::ffi::OsString> = cmd
        .get_envs()
        .filter(|(_, v)| v.is_some())
        .map(|(k, _)| k.to_owned())
        .collect();
    for var in SCRUBBED_ENV {
        if !set.iter().any(|k| k == var) {
            cmd.env_remove(var);
        }
    }
}

/// A scratch directory holding one agent's config and socket; shared by the
/// agents started on it (a second instance, a restart after a crash).
#[derive(Debug)]
pub struct Home {
    dir: tempfile::TempDir,
    /// The config file written there.
    pub config: PathBuf,
    /// The `api.socket` the config names.
    pub socket: PathBuf,
}

impl Home {
    /// A scratch directory with a config: [`config_toml`] of `extra_toml`.
    pub fn new(extra_toml: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-test-")
            .tempdir()
            .expect("create a scratch directory");
        let socket = dir.path().join("wardend.sock");
        let config = dir.path().join("wardend.toml");
        std::fs::write(&config, config_toml(&socket, extra_toml)).expect("write the config");
        Self {
            dir,
            config,
            socket,
        }
    }

    /// As [`Home::new`], open to the unprivileged test users
    /// ([`users`]): the directory is traversable (0711: they reach the
    /// socket and the files the agent hands them, and list nothing), and
    /// `api.socket_group` is their socket group unless `extra_toml` sets
    /// it. Creates the users (the test must be root).
    pub fn shared(extra_toml: &str) -> Self {
        use std::os::unix::fs::PermissionsExt;
        users::users();
        let mut doc: toml::Table = extra_toml
            .parse()
            .unwrap_or_else(|e| panic!("the test's extra TOML does not parse: {e}\n{extra_toml}"));
        doc.entry("api")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .expect("`api` in the test's TOML is a table")
            .entry("socket_group")
            .or_insert(toml::Value::String(users::SOCK_GROUP.to_owned()));
        let home = Self::new(&toml::to_string(&doc).expect("render the extra TOML"));
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o711))
            .expect("open the scratch directory to the test users");
        home
    }

    /// The scratch directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// The test config: `extra_toml` with `api.socket` and `metrics.listen`
/// filled in where it does not set them itself. Merged as tables, so the
/// caller may add keys to `[api]` or `[metrics]` without repeating a table.
pub fn config_toml(socket: &Path, extra_toml: &str) -> String {
    let mut doc: toml::Table = extra_toml
        .parse()
        .unwrap_or_else(|e| panic!("the test's extra TOML does not parse: {e}\n{extra_toml}"));
    let own_tier = doc.get("checkpoint").and_then(|c| c.get("dir")).is_some();
    let mut set_default = |table: &str, key: &str, value: String| {
        doc.entry(table)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .unwrap_or_else(|| panic!("`{table}` in the test's TOML is not a table"))
            .entry(key)
            .or_insert(toml::Value::String(value));
    };
    set_default("api", "socket", socket.display().to_string());
    // Each agent its own state (calibrations, incidents, the cordon): tests
    // run in parallel, often as root, whose default is /var/lib/warden.
    if let Some(home) = socket.parent() {
        set_default(
            "agent",
            "state_dir",
            home.join("state").display().to_string(),
        );
        // Likewise the checkpoint tier (the default is /dev/shm, shared).
        // Its space is watched where it was before issue 29 made the tier
        // the default (the scratch directory's filesystem may be nearly
        // full on a test machine, which is not what these tests are about),
        // unless the test names its own tier.
        if !own_tier {
            set_default("host", "checkpoint_dir", "/dev/shm".to_owned());
        }
        set_default("checkpoint", "dir", home.join("ckpt").display().to_string());
    }
    // Port 0: tests run in parallel and must not fight over a fixed port.
    set_default("metrics", "listen", "127.0.0.1:0".to_owned());
    // The test machines have no GPU: NVML would (rightly) read UNKNOWN and
    // so would the node. Off unless a test brings the stand-in library.
    // Likewise the kernel log: /dev/kmsg is unreadable without privileges
    // on some machines, which would make the node UNKNOWN. Off unless a
    // test points it at a file. DCGM likewise (no host engine here).
    for source in ["nvml", "kmsg", "dcgm"] {
        if !doc.contains_key(source) {
            let mut table = toml::Table::new();
            table.insert("enabled".into(), toml::Value::Boolean(false));
            doc.insert(source.into(), toml::Value::Table(table));
        }
    }
    toml::to_string(&doc).expect("render the test config")
}

/// A `wardend` process started by a test.
#[derive(Debug)]
pub struct TestAgent {
    /// Where its config and socket are.
    pub home: Arc<Home>,
    child: Child,
    notify: UnixDatagram,
    stderr: PathBuf,
    /// Every notify message received so far, in order.
    pub notifications: Vec<String>,
    exited: Option<ExitStatus>,
}

impl TestAgent {
    /// Starts an agent with `extra_toml` added to the test config and
    /// waits for READY=1.
    pub fn start(extra_toml: &str) -> Self {
        Self::start_with(extra_toml, &[])
    }

    /// As [`TestAgent::start`], with extra environment variables.
    pub fn start_with(extra_toml: &str, env: &[(&str, &str)]) -> Self {
        let mut agent = Self::spawn(Arc::new(Home::new(extra_toml)), env);
        agent.wait_ready();
        agent
    }

    /// As [`TestAgent::start`] in a [`Home::shared`]: the unprivileged
    /// test users reach it (the socket group's members connect).
    pub fn start_shared(extra_toml: &str) -> Self {
        let mut agent = Self::spawn(Arc::new(Home::shared(extra_toml)), &[]);
        agent.wait_ready();
        agent
    }

    /// Starts another agent on an existing home (same config, same socket)
    /// and waits for READY=1.
    pub fn start_in(home: Arc<Home>) -> Self {
        let mut agent = Self::spawn(home, &[]);
        agent.wait_ready();
        agent
    }

    /// Spawns `wardend --config <home's config>` without waiting for anything.
    pub fn spawn(home: Arc<Home>, env: &[(&str, &str)]) -> Self {
        Self::spawn_adjusted(home, env, |_| {})
    }

    /// As [`TestAgent::spawn`], with `adjust` applied to the command before
    /// it runs (a resource limit, say).
    pub fn spawn_adjusted(
        home: Arc<Home>,
        env: &[(&str, &str)],
        adjust: impl FnOnce(&mut Command),
    ) -> Self {
        static SPAWNED: AtomicU32 = AtomicU32::new(0);
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let notify_path = home.path().join(format!("notify-{n}.sock"));
        let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
        let stderr = home.path().join(format!("wardend-{n}.stderr"));
        let mut cmd = Command::new(WARDEND);
        cmd.arg("--config")
            .arg(&home.config)
            .env("NOTIFY_SOCKET", &notify_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("create the stderr file"));
        cmd.envs(env.iter().copied());
        scrub(&mut cmd);
        adjust(&mut cmd);
        let child = cmd.spawn().expect("spawn wardend");
        Self {
            home,
            child,
            notify,
            stderr,
            notifications: Vec::new(),
            exited: None,
        }
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The socket it serves.
    pub fn socket(&self) -> &Path {
        &self.home.socket
    }

    /// What the agent wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read(&self.stderr)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Waits for a notify message with a line for which `pred` holds;
    /// returns that message. Fails the test, with the agent's stderr, when
    /// none comes within `timeout` or the agent exits first.
    pub fn wait_notify(
        &mut self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            match self.recv_notify(deadline) {
                Some(msg) if msg.lines().any(&pred) => return msg,
                Some(_) => {}
                None => {
                    let exited = self.child.try_wait().ok().flatten();
                    panic!(
                        "no notify message with {what} within {timeout:?} (agent {}); received: {:?}\n--- wardend stderr ---\n{}",
                        exited.map_or("still running".to_owned(), |s| format!("exited: {s}")),
                        self.notifications,
                        self.stderr()
                    );
                }
            }
        }
    }

    /// The next notify message, or None at the deadline or once the agent
    /// has exited and nothing more is queued.
    pub fn recv_notify(&mut self, deadline: Instant) -> Option<String> {
        let mut buf = [0u8; 4096];
        loop {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            // Short slices, so an agent that died is noticed quickly.
            let slice = (deadline - now).min(Duration::from_millis(50));
            self.notify
                .set_read_timeout(Some(slice))
                .expect("set a read timeout");
            match self.notify.recv(&mut buf) {
                Ok(n) => {
                    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                    self.notifications.push(msg.clone());
                    return Some(msg);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.has_exited() {
                        // One last look: it may have sent something before dying.
                        self.notify.set_nonblocking(true).expect("set non-blocking");
                        let last = self.notify.recv(&mut buf).ok();
                        self.notify.set_nonblocking(false).expect("set blocking");
                        let msg = String::from_utf8_lossy(&buf[..last?]).into_owned();
                        self.notifications.push(msg.clone());
                        return Some(msg);
                    }
                }
                Err(e) => panic!("reading the notify socket: {e}"),
            }
        }
    }

    /// Waits for READY=1 (see [`TestAgent::wait_notify`]).
    pub fn wait_ready(&mut self) {
        self.wait_notify(STARTUP, "READY=1", |l| l == "READY=1");
    }

    fn has_exited(&mut self) -> bool {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().expect("poll the agent");
        }
        self.exited.is_some()
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: Signal) {
        let pid = i32::try_from(self.pid()).expect("pid fits i32");
        kill(Pid::from_raw(pid), signal).expect("signal the agent");
    }

    /// Waits for the agent to exit; fails the test (and kills it) if it
    /// does not within `timeout`. Polls, since std has no wait with a timeout.
    /// Blocks the thread: async tests that hold gRPC connections use
    /// [`TestAgent::exited`] instead.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if self.has_exited() {
                return self.exited.expect("exited");
            }
            if Instant::now() >= deadline {
                self.give_up_waiting(timeout);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills an agent that did not exit in time and fails the test with its stderr.
    fn give_up_waiting(&mut self, timeout: Duration) -> ! {
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!(
            "wardend did not exit within {timeout:?}\n--- wardend stderr ---\n{}",
            self.stderr()
        );
    }

    /// [`TestAgent::wait_exit`] for async tests: polls without blocking the
    /// runtime, which must keep driving the test's own gRPC connections (the
    /// agent's graceful shutdown waits for their HTTP/2 GOAWAY handshake).
    pub async fn exited(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if self.has_exited() {
                return self.exited.expect("exited");
            }
            if Instant::now() >= deadline {
                self.give_up_waiting(timeout);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGTERM, then [`TestAgent::wait_exit`].
    pub fn sigterm_and_wait(&mut self, timeout: Duration) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        self.wait_exit(timeout)
    }

    /// SIGKILL (a crash: nothing is cleaned up), then wait for it to die.
    pub fn sigkill_and_wait(&mut self) -> ExitStatus {
        self.signal(Signal::SIGKILL);
        let status = self.wait_exit(WAIT);
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
        status
    }

    /// A gRPC channel over the Unix socket.
    pub async fn channel(&self) -> Channel {
        Target::Unix(self.socket().to_owned())
            .channel()
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n--- wardend stderr ---\n{}", self.stderr()))
    }

    /// A warden.v1.Agent client over the Unix socket.
    pub async fn client(&self) -> AgentClient<Channel> {
        AgentClient::new(self.channel().await)
    }

    /// GetAgentInfo.
    pub async fn info(&self) -> pb::AgentInfo {
        self.client()
            .await
            .get_agent_info(pb::GetAgentInfoRequest {})
            .await
            .expect("GetAgentInfo")
            .into_inner()
    }

    /// GetNodeHealth.
    pub async fn health(&self) -> pb::NodeHealth {
        self.client()
            .await
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .expect("GetNodeHealth")
            .into_inner()
    }

    /// One component of GetNodeHealth, if the agent reports it.
    pub async fn component(&self, id: &str) -> Option<pb::Component> {
        self.health()
            .await
            .components
            .into_iter()
            .find(|c| c.id == id)
    }

    /// The Prometheus URL the agent reports in GetAgentInfo.
    pub async fn metrics_url(&self) -> String {
        endpoint(&self.info().await, "metrics")
    }

    /// The retained events (ListEvents, all of them).
    pub async fn events(&self) -> Vec<pb::Event> {
        self.client()
            .await
            .list_events(pb::ListEventsRequest {
                after_id: 0,
                limit: 0,
            })
            .await
            .expect("ListEvents")
            .into_inner()
            .events
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        if !self.has_exited() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A test failing on what the agent decided (a second restart, a
        // verdict it should not have reached) shows why: the last lines
        // the agent logged, before its home goes.
        if std::thread::panicking() {
            let log = self.stderr();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(120)..].join("\n");
            eprintln!(
                "--- {} (last {} of {} lines) ---\n{tail}",
                self.stderr.display(),
                lines.len().min(120),
                lines.len()
            );
        }
    }
}

/// The address of the endpoint of `kind` in an AgentInfo.
pub fn endpoint(info: &pb::AgentInfo, kind: &str) -> String {
    info.endpoints
        .iter()
        .find(|e| e.kind == kind)
        .map(|e| e.address.clone())
        .unwrap_or_else(|| panic!("no {kind} endpoint in {:?}", info.endpoints))
}

/// The value of evidence `key` in an event.
pub fn evidence<'a>(event: &'a pb::Event, key: &str) -> Option<&'a str> {
    event
        .evidence
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| kv.value.as_str())
}

/// Polls `check` until it returns `Some`, at most for `timeout`; fails the
/// test naming `what` otherwise. For state the agent reaches on its own time
/// (a source's first reading); never a sleep standing in for an event.
pub async fn eventually<T>(
    timeout: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A free TCP port on `ip` (bound, read and released: agents bind it a
/// moment later, and each other's configs must name it beforehand).
pub fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap_or_else(|e| panic!("bind {ip}:0: {e}"))
        .local_addr()
        .unwrap()
        .port()
}

/// A port free on `ip` now, below Linux's ephemeral range (32768 and up),
/// for a server that clients dial before it listens (torch's c10d store at
/// a rendezvous endpoint: a host started first retries the connect in a
/// loop). A port in the ephemeral range can be handed to the dialling
/// socket itself as its source port, and a connect to a port nobody
/// listens on then connects the socket to itself (TCP's simultaneous
/// open): the store client talks to itself and the connection breaks.
/// Real endpoints sit below the range for the same reason (torchrun's
/// 29400).
pub fn free_port_below_ephemeral(ip: &str) -> u16 {
    // Spread the starting points so parallel tests rarely probe the same
    // ports; every port is checked by binding it.
    let start = 20_000 + (std::process::id() % 10_000) as u16;
    (0..10_000u16)
        .map(|i| 20_000 + (start - 20_000 + i * 7) % 12_000)
        .find(|p| std::net::TcpListener::bind((ip, *p)).is_ok())
        .unwrap_or_else(|| panic!("no free port on {ip} in 20000-31999"))
}

/// Awaits `fut` for at most `timeout`; fails the test naming `what`.
pub async fn within<F: std::future::IntoFuture>(
    timeout: Duration,
    what: &str,
    fut: F,
) -> F::Output {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// What a finished command left.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Finished {
    /// The exit code; fails the test when it was killed by a signal.
    pub fn code(&self) -> i32 {
        self.status
            .code()
            .unwrap_or_else(|| panic!("killed by a signal: {self:?}"))
    }
}

/// Runs `cmd` to completion with a deadline; a command still running at
/// the deadline is killed and fails the test with what it printed.
pub fn run(cmd: &mut Command, timeout: Duration) -> Finished {
    scrub(cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    // Drained by threads so a chatty command cannot block on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll the command") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} still running after {timeout:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                out.join().unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Finished {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// A long-running command whose stdout is read line by line with deadlines.
/// Never reaped before the test waits for it (the agent reads exit statuses
/// from the zombie); killed and reaped when dropped.
#[derive(Debug)]
pub struct Streaming {
    /// The process.
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every stdout line read so far.
    pub seen: Vec<String>,
    stderr: PathBuf,
    /// Names the process in failure messages ("job/j/rank/1 (pid 42)").
    pub label: String,
}

impl Streaming {
    /// Spawns `cmd`, its stderr into `stderr_file`.
    pub fn spawn(cmd: &mut Command, stderr_file: PathBuf) -> Self {
        scrub(cmd);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_file).expect("create the stderr file"))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            // WARDEN_TEST_ECHO=1: each line also on the test's stderr as it
            // arrives, stamped (Unix seconds modulo 1000), to see where a
            // slow test's time goes (docs/testing.md).
            let echo = std::env::var_os("WARDEN_TEST_ECHO").is_some_and(|v| v == "1");
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if echo {
                    let t = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64();
                    eprintln!("[{:8.3}] {line}", t % 1000.0);
                }
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let label = format!("pid {}", child.id());
        Self {
            child,
            lines,
            seen: Vec::new(),
            stderr: stderr_file,
            label,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: Signal) {
        let pid = i32::try_from(self.pid()).expect("pid fits i32");
        kill(Pid::from_raw(pid), signal).expect("signal the process");
    }

    /// Reads lines until one satisfies `pred`; fails the test at the deadline
    /// or when stdout closes first.
    pub fn wait_line(
        &mut self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
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
                    "{}: no stdout line with {what} within {timeout:?} ({e}); lines: {:?}\n--- stderr ---\n{}",
                    self.label,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// Reads the rest of stdout into `seen`, until it closes or `timeout`.
    pub fn drain(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line);
        }
    }

    /// Waits for the command to exit; kills it and fails the test at the deadline.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the command") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                // Every line it wrote, not only those a wait read.
                self.drain(Duration::from_secs(2));
                panic!(
                    "{} did not exit within {timeout:?}; lines: {:?}\n--- stderr ---\n{}",
                    self.label,
                    self.seen,
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What the command wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read(&self.stderr)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `GET url` over a plain HTTP/1.1 connection; returns the body of a 200.
/// Hand-rolled so the tests need no HTTP client; `Connection: close` lets
/// the body run to the end of the stream.
pub fn http_get(url: &str) -> String {
    let rest = url
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("not an http URL: {url}"));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.is_empty() { "/" } else { path };
    let mut stream = TcpStream::connect(authority).unwrap_or_else(|e| panic!("connect {url}: {e}"));
    stream
        .set_read_timeout(Some(WAIT))
        .expect("set a read timeout");
    stream
        .set_write_timeout(Some(WAIT))
        .expect("set a write timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .unwrap_or_else(|e| panic!("read the response from {url}: {e}"));
    let response = String::from_utf8(response).expect("a UTF-8 response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in the response: {response:?}"));
    let status_line = head.lines().next().unwrap_or_default();
    assert!(
        status_line.starts_with("HTTP/1.1 200"),
        "GET {url}: {status_line}\n{body}"
    );
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").expect("a chunk size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("a hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = &rest[size + 2..];
    }
}

/// The number in a sample, whatever its declared type.
pub fn number(v: &prometheus_parse::Value) -> f64 {
    match v {
        prometheus_parse::Value::Counter(x)
        | prometheus_parse::Value::Gauge(x)
        | prometheus_parse::Value::Untyped(x) => *x,
        other => panic!("not a plain number: {other:?}"),
    }
}

/// The sample of `metric` whose labels include every pair in `labels`.
pub fn sample(scrape: &prometheus_parse::Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| number(&s.value))
        .collect();
    match found.as_slice() {
        [one] => *one,
        [] => panic!("no {metric}{labels:?} in the scrape"),
        many => panic!("{} samples of {metric}{labels:?}: {many:?}", many.len()),
    }
}

/// Scrapes the agent's `/metrics` and parses it; the raw text comes along
/// for assertion messages.
pub async fn scrape(agent: &TestAgent) -> (prometheus_parse::Scrape, String) {
    let url = agent.metrics_url().await;
    let body = tokio::task::spawn_blocking(move || http_get(&url))
        .await
        .expect("the scrape");
    let parsed = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
        .unwrap_or_else(|e| panic!("not Prometheus text ({e}):\n{body}"));
    (parsed, body)
}

/// An embedded agent's `[checkpoint]` table with its tier in `dir/tier`:
/// a test's launcher runs its agent with it so the tier goes with the
/// test's scratch. The default, /dev/shm/warden-ckpt/<job>, outlives the
/// job by design, and every run of a test with unique job ids left its
/// tiers there.
pub fn tier_in(dir: &Path) -> String {
    format!(
        "[checkpoint]\ndir = {:?}\n",
        dir.join("tier").display().to_string()
    )
}

/// The repository root (the agent crate sits in the workspace).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the agent crate sits in the workspace")
        .to_owned()
}

/// The interpreter that runs Python ranks, checked once: it imports the
/// `warden` package, and one recent enough to have exception reports (a
/// stale install has not). `$WARDEN_TEST_PYTHON` (tests/run-all.sh sets
/// it), else the repository's `.venv/bin/python`.
pub fn python() -> &'static Path {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| {
        let py = std::env::var_os("WARDEN_TEST_PYTHON")
            .filter(|p| !p.is_empty())
            .map_or_else(|| repo_root().join(".venv/bin/python"), PathBuf::from);
        let fix = "run `bash tests/run-all.sh`, or in the repository root \
                   `python3 -m venv .venv && .venv/bin/pip install ./client/python` \
                   (or point WARDEN_TEST_PYTHON at an interpreter that has the warden package)";
        assert!(
            py.exists(),
            "no Python interpreter for the rank tests at {}: {fix}",
            py.display()
        );
        let out = run(
            Command::new(&py).args([
                "-c",
                "import warden, warden._excepthook; print(warden.SLOT_LAYOUT_VERSION)",
            ]),
            Duration::from_secs(30),
        );
        assert!(
            out.status.success(),
            "{} cannot import a current warden package (stale? reinstall it): {fix}\n--- stderr ---\n{}",
            py.display(),
            out.stderr
        );
        py
    })
}

/// One event on one line: id, kind, subject, message and evidence.
pub fn describe(e: &pb::Event) -> String {
    let ev: Vec<String> = e
        .evidence
        .iter()
        .map(|kv| format!("{}={:?}", kv.key, kv.value))
        .collect();
    format!(
        "#{} {} {}: {} [{}]",
        e.id,
        e.kind,
        e.subject,
        e.message,
        ev.join(", ")
    )
}

/// A WatchEvents stream and what it delivered so far.
pub struct Events {
    stream: tonic::Streaming<pb::Event>,
    /// Every event delivered so far, in order.
    pub seen: Vec<pb::Event>,
}

impl Events {
    /// Events from now on.
    pub async fn live(agent: &TestAgent) -> Events {
        Self::watch(agent, None).await
    }

    /// Every retained event, then live ones.
    pub async fn all(agent: &TestAgent) -> Events {
        Self::watch(agent, Some(0)).await
    }

    async fn watch(agent: &TestAgent, after_id: Option<u64>) -> Events {
        let stream = within(WAIT, "WatchEvents", async {
            agent
                .client()
                .await
                .watch_events(pb::WatchEventsRequest { after_id })
                .await
        })
        .await
        .expect("WatchEvents")
        .into_inner();
        Events {
            stream,
            seen: Vec::new(),
        }
    }

    /// The next event for which `pred` holds; fails the test, listing the
    /// events seen and the agent's stderr, when none comes within `timeout`.
    pub async fn expect(
        &mut self,
        agent: &TestAgent,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&pb::Event) -> bool,
    ) -> pb::Event {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let why = match tokio::time::timeout(left, self.stream.next()).await {
                Ok(Some(Ok(e))) => {
                    self.seen.push(e.clone());
                    if pred(&e) {
                        return e;
                    }
                    continue;
                }
                Ok(Some(Err(status))) => format!("the stream failed: {status}"),
                Ok(None) => "the stream ended".to_owned(),
                Err(_) => format!("none within {timeout:?}"),
            };
            panic!(
                "waiting for {what}: {why} (wardend process state: {:?}); events seen:\n{}\n--- wardend stderr ---\n{}",
                proc_state(agent.pid()),
                self.summary(),
                agent.stderr()
            );
        }
    }

    /// How many events of `kind` about `subject` ("" for any) were seen.
    pub fn count(&self, kind: &str, subject: &str) -> usize {
        self.seen
            .iter()
            .filter(|e| e.kind == kind && (subject.is_empty() || e.subject == subject))
            .count()
    }

    pub fn summary(&self) -> String {
        self.seen
            .iter()
            .map(describe)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The process state letter of `pid` from /proc (without reaping it).
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// A Python rank: `script` (under the repository root) with `args` run by
/// the test interpreter, registered with `agent` as `rank` of `world` in
/// `job` through the `warden` package's environment. Inherited variables
/// that would change how the client behaves are removed.
pub fn python_rank(
    agent: &TestAgent,
    script: &str,
    job: &str,
    (rank, world): (u32, u32),
    args: &[&str],
) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join(script))
        .args(args)
        .env("WARDEN_SOCKET", agent.socket())
        .env("WARDEN_JOB_ID", job)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    for var in [
        "TORCHELASTIC_RUN_ID",
        "WARDEN_RESTART_SIGNAL",
        "WARDEN_STACK_DUMP_SIGNAL",
        "WARDEN_EXCEPTHOOK",
        "CUDA_VISIBLE_DEVICES",
        "WARDEN_DEVICES",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Spawns a [`python_rank`] command with its stderr in the agent's home,
/// labelled with its rank for failure messages.
pub fn spawn_python_rank(agent: &TestAgent, job: &str, rank: u32, cmd: &mut Command) -> Streaming {
    static SPAWNED: AtomicU32 = AtomicU32::new(0);
    let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
    let stderr = agent.home.path().join(format!("rank-{n}.stderr"));
    let mut s = Streaming::spawn(cmd, stderr);
    s.label = format!("job/{job}/rank/{rank} (pid {})", s.pid());
    s
}

/// Whether the test interpreter can import torch (with gloo), for the
/// real-torch tests; panics when it cannot and
/// `WARDEN_REQUIRE_TORCH` is set. Asked of the interpreter once per test
/// binary: the import costs about 4 s of CPU, and every torch test asks.
pub fn torch_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    let ok = *OK.get_or_init(|| {
        Command::new(python())
            .args([
                "-c",
                "import torch.distributed as d; assert d.is_gloo_available()",
            ])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !ok {
        let required = std::env::var_os("WARDEN_REQUIRE_TORCH").is_some_and(|v| !v.is_empty());
        assert!(
            !required,
            "WARDEN_REQUIRE_TORCH is set but {} cannot import torch with gloo: run `bash tests/torch-venv.sh`",
            python().display()
        );
        eprintln!(
            "SKIPPED: {} cannot import torch (run `bash tests/torch-venv.sh`, or set WARDEN_REQUIRE_TORCH=1 to fail instead)",
            python().display()
        );
    }
    ok
}

/// Whether the test interpreter can import `module` (a training framework:
/// `pytorch_lightning`...); panics when it cannot and
/// `WARDEN_REQUIRE_FRAMEWORKS` is set (tests/run-all.sh installs them), as
/// client/python/tests' `require_framework` does.
pub fn python_has(module: &str) -> bool {
    // Once per module and test binary: a framework's import costs seconds
    // of CPU (Lightning's about 9 s).
    static KNOWN: Mutex<BTreeMap<String, bool>> = Mutex::new(BTreeMap::new());
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let ok = *known.entry(module.to_owned()).or_insert_with(|| {
        Command::new(python())
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    drop(known);
    if !ok {
        assert!(
            std::env::var_os("WARDEN_REQUIRE_FRAMEWORKS").is_none_or(|v| v != "1"),
            "WARDEN_REQUIRE_FRAMEWORKS=1 but {} cannot import {module}: run `bash tests/frameworks-venv.sh`",
            python().display()
        );
        eprintln!(
            "SKIPPED: {} cannot import {module} (run `bash tests/frameworks-venv.sh`, or set WARDEN_REQUIRE_FRAMEWORKS=1 to fail instead)",
            python().display()
        );
    }
    ok
}

/// The real checkpoint client as rank `rank` of `world` in `job`, on the
/// agent's socket at `socket`.
pub fn checkpoint_rank(
    socket: &Path,
    job: &str,
    rank: u32,
    world: u32,
) -> warden_client::Checkpointer {
    let mut o = warden_client::ConnectOptions::from_env_lossy();
    o.socket_path = socket.to_path_buf();
    o.job_id = job.to_owned();
    o.global_rank = rank;
    o.local_rank = rank;
    o.world_size = world;
    warden_client::Checkpointer::new(o).expect("checkpointer")
}

/// Recognisable bytes for one shard: differ by step, rank and position.
pub fn shard_bytes(step: u64, rank: u32, len: usize) -> Vec<u8> {
    let seed = step.wrapping_mul(1_000_003) ^ u64::from(rank).wrapping_mul(7919);
    (0..len)
        .map(|i| (seed.wrapping_add(i as u64).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}
