//! A real etcd server per test: Debian's `etcd-server` (3.4), or the binary
//! `$WARDEN_TEST_ETCD` names.
//!
//! [`EtcdServer::start`] runs a single-member cluster on 127.0.0.1 with free
//! client and peer ports and its data in a scratch directory, waits until
//! `/health` answers true, and SIGKILLs it on drop. It runs with a 10 ms
//! heartbeat and a 100 ms election timeout so that it elects itself at
//! once and grants 1 s leases (etcd's shortest lease is 1.5 election
//! timeouts). A server that will not start fails the test with its log.
//!
//! [`EtcdCluster::start`] runs a cluster of 3 (or more) members, each on its
//! own loopback address (127.0.0.2, 127.0.0.3, ...) with its own client and
//! peer ports and data directory, with etcd's default raft timing (100 ms
//! heartbeat, 1 s election timeout: a leader lost costs an election, as in
//! a real cluster). A member can be SIGKILLed, started again, paused
//! (SIGSTOP) and resumed (SIGCONT); [`EtcdCluster::leader`] finds the
//! current leader from each member's `/metrics` (`etcd_server_is_leader`).
//!
//! [`EtcdServer::start_secure`] runs the same server with TLS on its client
//! port (`--client-cert-auth`: a client must show a certificate of the
//! test's CA) and authentication on, with certificates the test makes
//! ([`Pki`], rcgen) and users set up through etcd's own auth API
//! ([`SecureEtcd`]). Its health is read on a plain-HTTP metrics port.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long etcd may take to become healthy (a busy test machine).
const ETCD_STARTUP: Duration = Duration::from_secs(20);

/// A running etcd, killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    log: PathBuf,
    /// The client URL, `http://127.0.0.1:PORT` (`https://` for a secure one).
    pub endpoint: String,
    /// The arguments it was started with, to start it again on the same
    /// ports and data directory ([`EtcdServer::restart`]).
    args: Vec<String>,
    /// Where `GET /health` answers.
    health_port: u16,
    /// The loopback address it listens on.
    ip: Ipv4Addr,
    /// SIGSTOPped and not yet resumed.
    paused: bool,
}

/// The version of the etcd binary the tests run (`etcd --version`'s
/// "etcd Version: X.Y.Z"), asked once: the fleet bench records it in its
/// rows, and a 3.5 proxy takes flags a 3.4 one refuses.
pub fn etcd_version() -> String {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION
        .get_or_init(|| {
            let out = Command::new(etcd_binary())
                .arg("--version")
                .output()
                .unwrap_or_else(|e| panic!("run {} --version: {e}", etcd_binary()));
            let text = String::from_utf8_lossy(&out.stdout);
            text.lines()
                .find_map(|l| l.strip_prefix("etcd Version:"))
                .map(|v| v.trim().to_owned())
                .unwrap_or_else(|| panic!("no \"etcd Version:\" in `etcd --version`:\n{text}"))
        })
        .clone()
}

/// Whether the tests' etcd is 3.5 or later (its `major.minor`).
pub fn etcd_at_least_3_5() -> bool {
    let version = etcd_version();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (3, 5)
}

/// The etcd binary: `$WARDEN_TEST_ETCD`, else `etcd` on PATH.
fn etcd_binary() -> String {
    if let Ok(path) = std::env::var("WARDEN_TEST_ETCD") {
        return path;
    }
    let on_path = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("etcd").is_file()));
    assert!(
        on_path,
        "no `etcd` on PATH: install Debian's etcd-server (tests/run-all.sh does: \
         apt-get install --no-install-recommends etcd-server) or set WARDEN_TEST_ETCD"
    );
    "etcd".to_owned()
}

/// A port free at this moment on 127.0.0.1.
fn free_port() -> u16 {
    free_port_on(Ipv4Addr::LOCALHOST)
}

/// A port free at this moment on `ip`.
fn free_port_on(ip: Ipv4Addr) -> u16 {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy. Retries with fresh ports
    /// when another process took one between choosing and binding it.
    pub fn start() -> Self {
        Self::start_with(None)
    }

    fn start_with(tls: Option<&Pki>) -> Self {
        let mut last_log = String::new();
        for _ in 0..3 {
            match Self::try_start(tls) {
                Ok(server) => return server,
                Err(log) if log.contains("address already in use") => last_log = log,
                Err(log) => panic!("etcd did not start:\n{log}"),
            }
        }
        panic!("etcd did not start (ports taken three times):\n{last_log}");
    }

    fn try_start(tls: Option<&Pki>) -> Result<Self, String> {
        let dir = tempfile::Builder::new()
            .prefix("warden-etcd-")
            .tempdir()
            .expect("create a scratch directory for etcd");
        let (client, peer) = (free_port(), free_port());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let client_url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        // With TLS on the client port, health is read on a plain metrics port.
        let health_port = if tls.is_some() { free_port() } else { client };
        let log = dir.path().join("etcd.log");
        let log_file = std::fs::File::create(&log).expect("create etcd's log file");
        let mut args = vec![
            "--name=warden-test".to_owned(),
            format!("--data-dir={}", dir.path().join("data").display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=warden-test={peer_url}"),
            "--initial-cluster-state=new".to_owned(),
            "--heartbeat-interval=10".to_owned(),
            "--election-timeout=100".to_owned(),
            "--logger=zap".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        // For a profile of etcd in a bench (`/debug/pprof/` on the client
        // URL): docs/benchmarks.md says how it is read.
        if std::env::var_os("WARDEN_ETCD_PPROF").is_some() {
            args.push("--enable-pprof".to_owned());
        }
        if let Some(pki) = tls {
            args.extend([
                "--client-cert-auth".to_owned(),
                format!("--trusted-ca-file={}", pki.ca.display()),
                format!("--cert-file={}", pki.server_cert.display()),
                format!("--key-file={}", pki.server_key.display()),
                format!("--listen-metrics-urls=http://127.0.0.1:{health_port}"),
            ]);
        }
        drop(log_file);
        let mut server = Self {
            child: None,
            dir,
            log,
            endpoint: client_url,
            args,
            health_port,
            ip: Ipv4Addr::LOCALHOST,
            paused: false,
        };
        server.spawn();
        server.wait_healthy()?;
        Ok(server)
    }

    /// Spawns etcd with the saved arguments, its output appended to the log.
    fn spawn(&mut self) {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open etcd's log file");
        // `WARDEN_ETCD_CPUS` (a `taskset` list, "0") pins etcd to those
        // CPUs: the fleet bench then measures etcd's CPU per round without
        // the simulated hosts on the same cores (run the bench itself under
        // `taskset -c` on the others).
        let mut cmd = match std::env::var("WARDEN_ETCD_CPUS") {
            Ok(cpus) if !cpus.is_empty() => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpus).arg(etcd_binary());
                c
            }
            _ => Command::new(etcd_binary()),
        };
        // An ETCD_* variable in the runner's environment would override a flag.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(name);
            }
        }
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("clone etcd's log file"))
            .stderr(log_file);
        self.child = Some(cmd.spawn().unwrap_or_else(|e| panic!("spawn etcd: {e}")));
    }

    /// Starts a killed etcd again on the same ports and data directory (its
    /// keys and leases as it left them on disk) and waits until it is
    /// healthy.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is still running: kill it first");
        self.spawn();
        if let Err(log) = self.wait_healthy() {
            panic!("etcd did not start again:\n{log}");
        }
    }

    /// Waits for `GET /health`; on exit or timeout, the log.
    fn wait_healthy(&mut self) -> Result<(), String> {
        self.wait_healthy_for(ETCD_STARTUP)
    }

    /// [`Self::wait_healthy`] with its own deadline.
    fn wait_healthy_for(&mut self, limit: Duration) -> Result<(), String> {
        let server = self;
        let health_port = server.health_port;
        let deadline = Instant::now() + limit;
        loop {
            if server.healthy(health_port) {
                return Ok(());
            }
            if let Some(child) = server.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                server.child = None;
                return Err(format!("exited with {status}:\n{}", server.log()));
            }
            if Instant::now() > deadline {
                let log = server.log();
                return Err(format!("not healthy after {limit:?}:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether `GET /health` answers `"health":"true"`.
    fn healthy(&self, port: u16) -> bool {
        healthy_at(self.ip, port)
    }

    /// The client endpoint, as the coordinator's config wants it.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }

    /// What etcd logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The scratch directory (data and log).
    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// SIGKILLs etcd and reaps it: the cluster is gone, as in an outage.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
        self.paused = false;
    }

    /// The process id (to signal it from another task).
    pub fn pid(&self) -> i32 {
        let child = self.child.as_ref().expect("etcd is running");
        i32::try_from(child.id()).expect("a pid")
    }

    /// Whether the process runs (not killed; it may be paused).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGSTOPs etcd: it holds its sockets and answers nothing, as a member
    /// stalled on its disk or starved of CPU does.
    pub fn pause(&mut self) {
        self.signal(Signal::SIGSTOP);
        self.paused = true;
    }

    /// SIGCONTs a paused etcd.
    pub fn resume(&mut self) {
        self.signal(Signal::SIGCONT);
        self.paused = false;
    }

    fn signal(&self, signal: Signal) {
        let child = self.child.as_ref().expect("etcd is running");
        let pid = i32::try_from(child.id()).expect("a pid");
        kill(Pid::from_raw(pid), signal).unwrap_or_else(|e| panic!("{signal} to etcd: {e}"));
    }

    /// etcd's `/metrics` page, or `None` when it does not answer within a
    /// second (killed, paused, busy).
    pub fn metrics_page(&self) -> Option<String> {
        if self.child.is_none() || self.paused {
            return None;
        }
        let mut s =
            TcpStream::connect_timeout(&(self.ip, self.health_port).into(), Duration::from_secs(1))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
        let request = format!(
            "GET /metrics HTTP/1.0\r\nHost: {}:{}\r\n\r\n",
            self.ip, self.health_port
        );
        s.write_all(request.as_bytes()).ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        Some(body)
    }
}

/// A cluster of etcd members on loopback, each on its own address, ports
/// and data directory; every member SIGKILLed on drop (a paused one too).
#[derive(Debug)]
pub struct EtcdCluster {
    /// The members, in the order of their addresses (127.0.0.2, ...).
    pub members: Vec<EtcdServer>,
}

impl EtcdCluster {
    /// Starts `n` members (127.0.0.2 up) and waits until each is healthy
    /// (a member is healthy once the cluster has a leader). Retries with
    /// fresh ports when another process took one.
    pub fn start(n: usize) -> Self {
        assert!((1..=200).contains(&n), "a cluster of 1 to 200 members");
        let mut last_log = String::new();
        for _ in 0..3 {
            match Self::try_start(n) {
                Ok(cluster) => return cluster,
                Err(log) if log.contains("address already in use") => last_log = log,
                Err(log) => panic!("the etcd cluster did not start:\n{log}"),
            }
        }
        panic!("the etcd cluster did not start (ports taken three times):\n{last_log}");
    }

    fn try_start(n: usize) -> Result<Self, String> {
        let ips: Vec<Ipv4Addr> = (0..n)
            .map(|i| Ipv4Addr::new(127, 0, 0, 2 + u8::try_from(i).expect("a small cluster")))
            .collect();
        let ports: Vec<(u16, u16)> = ips
            .iter()
            .map(|ip| (free_port_on(*ip), free_port_on(*ip)))
            .collect();
        let name = |i: usize| format!("warden-test-{i}");
        let initial = ips
            .iter()
            .zip(&ports)
            .enumerate()
            .map(|(i, (ip, (_, peer)))| format!("{}=http://{ip}:{peer}", name(i)))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (i, (ip, (client, peer))) in ips.iter().zip(&ports).enumerate() {
            let dir = tempfile::Builder::new()
                .prefix("warden-etcd-")
                .tempdir()
                .expect("create a scratch directory for etcd");
            let client_url = format!("http://{ip}:{client}");
            let peer_url = format!("http://{ip}:{peer}");
            let args = vec![
                format!("--name={}", name(i)),
                format!("--data-dir={}", dir.path().join("data").display()),
                format!("--listen-client-urls={client_url}"),
                format!("--advertise-client-urls={client_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster={initial}"),
                "--initial-cluster-state=new".to_owned(),
                "--initial-cluster-token=warden-test".to_owned(),
                "--heartbeat-interval=100".to_owned(),
                "--election-timeout=1000".to_owned(),
                "--logger=zap".to_owned(),
                "--log-level=warn".to_owned(),
            ];
            let mut member = EtcdServer {
                child: None,
                log: dir.path().join("etcd.log"),
                dir,
                endpoint: client_url,
                args,
                health_port: *client,
                ip: *ip,
                paused: false,
            };
            member.spawn();
            members.push(member);
        }
        for m in &mut members {
            m.wait_healthy_for(ETCD_STARTUP * 2)?;
        }
        Ok(Self { members })
    }

    /// Every member's client endpoint, as the coordinator's config wants
    /// them.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.endpoint.clone()).collect()
    }

    /// The index of the member that leads now, by its own `/metrics`
    /// (`etcd_server_is_leader 1`); waits up to `limit` for one (an
    /// election under way has none).
    pub fn leader(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let found = self.members.iter().position(|m| {
                m.metrics_page()
                    .is_some_and(|page| page.lines().any(|l| l.trim() == "etcd_server_is_leader 1"))
            });
            if let Some(i) = found {
                return i;
            }
            assert!(
                Instant::now() < deadline,
                "no etcd member says it leads after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts a killed member again (same address, ports and data) and
    /// waits until it is healthy: it rejoins the cluster from its log.
    pub fn restart(&mut self, i: usize) {
        let m = &mut self.members[i];
        assert!(
            m.child.is_none(),
            "member {i} is still running: kill it first"
        );
        m.spawn();
        if let Err(log) = m.wait_healthy_for(ETCD_STARTUP * 3) {
            panic!("etcd member {i} did not start again:\n{log}");
        }
    }
}

/// Whether `GET /health` on `ip:port` answers `"health":"true"`.
fn healthy_at(ip: Ipv4Addr, port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&(ip, port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
    let request = format!("GET /health HTTP/1.0\r\nHost: {ip}\r\n\r\n");
    if s.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An etcd gRPC proxy (`etcd grpc-proxy start`) in front of a cluster, on
/// its own loopback address; SIGKILLed on drop. What it is for: it
/// coalesces the watches of its clients on one range into one watch on the
/// cluster, and their lease keep-alives, so the members serve the proxies
/// and not every host (etcd's docs, "gRPC proxy").
#[derive(Debug)]
pub struct EtcdProxy {
    child: Option<Child>,
    _dir: tempfile::TempDir,
    log: PathBuf,
    /// Its client endpoint, `http://IP:PORT`.
    pub endpoint: String,
}

impl EtcdProxy {
    /// Starts a proxy on `ip` for the cluster at `members` and waits until
    /// its `/health` answers (which asks the cluster through it).
    pub fn start(members: &[String], ip: Ipv4Addr) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-etcd-proxy-")
            .tempdir()
            .expect("create a scratch directory for the proxy");
        let port = free_port_on(ip);
        let log = dir.path().join("proxy.log");
        let file = std::fs::File::create(&log).expect("create the proxy's log");
        let upstream: Vec<&str> = members
            .iter()
            .map(|m| m.trim_start_matches("http://"))
            .collect();
        let mut cmd = Command::new(etcd_binary());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(name);
            }
        }
        cmd.args([
            "grpc-proxy".to_owned(),
            "start".to_owned(),
            format!("--endpoints={}", upstream.join(",")),
            format!("--listen-addr={ip}:{port}"),
            format!("--data-dir={}", dir.path().join("data").display()),
            // A joining launcher's paged read takes up to 64 MiB (the
            // coordinator's receive limit); the proxy's default send limit
            // is etcd's 1.5 MiB request limit.
            format!("--max-send-bytes={}", 64 << 20),
        ]);
        if etcd_at_least_3_5() {
            // A launcher pings its connection every third of the lease TTL
            // (3.3 s at 10 s); a 3.4 proxy keeps grpc-go's 5-minute minimum
            // and closes such clients for "too many pings", and a 3.5 one
            // defaults to 5 s. 3.5 takes the minimum as a flag
            // (etcd-io/etcd#11711): 1 s, under any TTL the tests use.
            cmd.arg("--grpc-keepalive-min-time=1s");
        }
        cmd.stdin(Stdio::null())
            .stdout(file.try_clone().expect("clone the proxy's log"))
            .stderr(file);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn etcd grpc-proxy: {e}"));
        let proxy = Self {
            child: Some(child),
            _dir: dir,
            log,
            endpoint: format!("http://{ip}:{port}"),
        };
        let deadline = Instant::now() + ETCD_STARTUP;
        loop {
            if healthy_at(ip, port) {
                return proxy;
            }
            assert!(
                Instant::now() < deadline,
                "the etcd gRPC proxy on {ip}:{port} is not healthy after {ETCD_STARTUP:?}:\n{}",
                std::fs::read_to_string(&proxy.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its CPU seconds (user and system) and resident bytes, from
    /// `/proc` (its `/metrics` page is the cluster's, not its own).
    pub fn cpu_and_rss(&self) -> (f64, f64) {
        let Some(child) = self.child.as_ref() else {
            return (0.0, 0.0);
        };
        let pid = child.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis: utime is the
        // 12th, stime the 13th (proc(5)'s 14 and 15).
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let tick = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .map_or(100.0, |v| v as f64);
        let cpu = (tick(11) + tick(12)) / hz;
        let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(0.0, |kb| kb * 1024.0);
        (cpu, rss)
    }
}

impl Drop for EtcdProxy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// The etcd user the launchers log in as in the secure tests: its role may
/// read and write the jobs' prefix and nothing else.
pub const USER: &str = "warden";
/// [`USER`]'s password.
pub const PASSWORD: &str = "warden-test-password";
/// The role [`USER`] holds.
pub const ROLE: &str = "warden-jobs";
/// What [`ROLE`] grants readwrite on: the default job prefix and a slash.
pub const JOBS_PREFIX: &str = "/warden/jobs/";
/// A user etcd knows, with a password but no role: it may touch no key.
pub const OUTSIDER: &str = "outsider";
/// [`OUTSIDER`]'s password.
pub const OUTSIDER_PASSWORD: &str = "outsider-test-password";
/// The root user's password (only the harness uses it, to set auth up).
const ROOT_PASSWORD: &str = "root-test-password";

/// Certificates for a secure etcd, made by rcgen in a scratch directory:
/// the cluster CA, etcd's server certificate (127.0.0.1 and localhost),
/// a client certificate of the CA, and a client certificate of another CA
/// that etcd must refuse. The client certificates' common names are no
/// etcd user (etcd takes a certificate's CN as the user when a request
/// carries no token), so a certificate alone grants nothing here.
#[derive(Debug)]
pub struct Pki {
    dir: tempfile::TempDir,
    /// The cluster CA's certificate (PEM).
    pub ca: PathBuf,
    /// etcd's server certificate.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// A client certificate of the cluster CA.
    pub client_cert: PathBuf,
    /// Its key.
    pub client_key: PathBuf,
    /// A client certificate of another CA.
    pub stranger_cert: PathBuf,
    /// Its key.
    pub stranger_key: PathBuf,
    /// The other CA's certificate.
    pub stranger_ca: PathBuf,
    /// A file holding [`PASSWORD`] and a newline, mode 0600.
    pub password_file: PathBuf,
    /// A file holding [`OUTSIDER_PASSWORD`].
    pub outsider_password_file: PathBuf,
    /// A file holding a password no user has.
    pub wrong_password_file: PathBuf,
}

/// A CA: its certificate and what signs with it.
fn new_ca(name: &str) -> (rcgen::Certificate, rcgen::Issuer<'static, rcgen::KeyPair>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("self-sign the CA");
    (cert, rcgen::Issuer::new(params, key))
}

/// A leaf certificate and its key (PEM), signed by `issuer`.
fn new_leaf(
    issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
    cn: &str,
    names: &[&str],
    server: bool,
) -> (String, String) {
    use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, KeyPair, SanType};
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
    params.distinguished_name.push(DnType::CommonName, cn);
    for n in names {
        params.subject_alt_names.push(match n.parse() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName((*n).try_into().expect("a DNS name")),
        });
    }
    params.use_authority_key_identifier_extension = true;
    params.extended_key_usages = if server {
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ]
    } else {
        vec![ExtendedKeyUsagePurpose::ClientAuth]
    };
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("sign the leaf");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    /// Makes the certificates and password files.
    pub fn new() -> Self {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("warden-pki-")
            .tempdir()
            .expect("create a scratch directory for certificates");
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("write a PEM file");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .expect("chmod a PEM file");
            path
        };
        let (ca_cert, ca) = new_ca("warden test cluster CA");
        let (other_cert, other) = new_ca("some other CA");
        let (server_cert, server_key) = new_leaf(&ca, "etcd", &["127.0.0.1", "localhost"], true);
        let (client_cert, client_key) = new_leaf(&ca, "warden-client", &[], false);
        let (stranger_cert, stranger_key) = new_leaf(&other, "warden-client", &[], false);
        Self {
            ca: write("ca.pem", &ca_cert.pem()),
            server_cert: write("server.pem", &server_cert),
            server_key: write("server-key.pem", &server_key),
            client_cert: write("client.pem", &client_cert),
            client_key: write("client-key.pem", &client_key),
            stranger_cert: write("stranger.pem", &stranger_cert),
            stranger_key: write("stranger-key.pem", &stranger_key),
            stranger_ca: write("stranger-ca.pem", &other_cert.pem()),
            password_file: write("warden.password", &format!("{PASSWORD}\n")),
            outsider_password_file: write("outsider.password", &format!("{OUTSIDER_PASSWORD}\n")),
            wrong_password_file: write("wrong.password", "not-the-password\n"),
            dir,
        }
    }

    /// The scratch directory holding the files.
    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

/// An etcd with TLS, client-certificate authentication and user
/// authentication on: [`USER`] with [`ROLE`] (readwrite on
/// [`JOBS_PREFIX`]), [`OUTSIDER`] with no role, and root.
#[derive(Debug)]
pub struct SecureEtcd {
    /// The server; its `endpoint` is `https://127.0.0.1:PORT`.
    pub server: EtcdServer,
    /// The certificates and password files.
    pub pki: Pki,
}

impl EtcdServer {
    /// Starts an etcd with TLS and authentication on (see [`SecureEtcd`]).
    pub fn start_secure() -> SecureEtcd {
        let pki = Pki::new();
        let server = Self::start_with(Some(&pki));
        let endpoint = server.endpoint.clone();
        let files = (
            std::fs::read(&pki.ca).expect("read the CA"),
            std::fs::read(&pki.client_cert).expect("read the client certificate"),
            std::fs::read(&pki.client_key).expect("read the client key"),
        );
        // Its own thread and runtime: callable from sync and async tests.
        let setup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the auth set-up");
            rt.block_on(enable_auth(&endpoint, files))
        })
        .join()
        .expect("the auth set-up thread");
        if let Err(e) = setup {
            panic!("cannot set up etcd's users: {e}\n{}", server.log());
        }
        SecureEtcd { server, pki }
    }
}

/// Users, the role and `auth enable`, through etcd's auth API as root would
/// with etcdctl.
async fn enable_auth(
    endpoint: &str,
    (ca, cert, key): (Vec<u8>, Vec<u8>, Vec<u8>),
) -> Result<(), etcd_client::Error> {
    use etcd_client::{Certificate, Client, ConnectOptions, Identity, Permission, TlsOptions};
    let tls = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(cert, key));
    let options = ConnectOptions::new()
        .with_tls(tls)
        .with_connect_timeout(ETCD_STARTUP)
        .with_timeout(ETCD_STARTUP);
    let mut c = Client::connect([endpoint], Some(options)).await?;
    c.user_add("root", ROOT_PASSWORD, None).await?;
    c.user_grant_role("root", "root").await?;
    c.role_add(ROLE).await?;
    c.role_grant_permission(ROLE, Permission::read_write(JOBS_PREFIX).with_prefix())
        .await?;
    c.user_add(USER, PASSWORD, None).await?;
    c.user_grant_role(USER, ROLE).await?;
    c.user_add(OUTSIDER, OUTSIDER_PASSWORD, None).await?;
    c.auth_enable().await?;
    Ok(())
}

/// The layout bases put under `layouts` (a job's `layouts/` prefix) in
/// etcd's whole history, and their bytes: a watch from revision 1 of the
/// prefix and of a marker key just past it (`layouts0`: `/` sorts before
/// `0`, so no key under the prefix comes after it, and no launcher watches
/// it but a decider, which ignores it), put first; etcd sends a watch's
/// events in revision order, so once the marker's put arrives every base
/// before it has. Not a progress notify: etcd answered a requested one at
/// once with its current revision, whether the watch had caught up or not,
/// until etcd-io/etcd#15220 was fixed (#15237, 2023). Debian's 3.4.23 and
/// 3.5.1 both predate the fix, so the notify worked on 3.4 by timing only;
/// the fleet bench at 12,500 hosts on 3.5.1 read 0 bases that way where
/// one had gone to every host. Bases a writer deleted after losing its
/// race count too: each was sent to every host watching (issue 30, one
/// writer per base).
pub async fn bases_in_history(
    client: &mut etcd_client::Client,
    layouts: &str,
) -> (std::collections::BTreeSet<String>, usize) {
    assert!(
        layouts.ends_with('/'),
        "{layouts:?} is not a prefix ending in /"
    );
    let marker = format!("{}0", layouts.trim_end_matches('/'));
    let at = client
        .put(marker.as_str(), "", None)
        .await
        .expect("put the history's end marker")
        .header()
        .expect("a response header")
        .revision();
    let options = etcd_client::WatchOptions::new()
        .with_range(format!("{marker}\0"))
        .with_start_revision(1);
    let mut stream = client
        .watch(layouts, Some(options))
        .await
        .expect("watch the layouts' history");
    let mut bases = std::collections::BTreeSet::new();
    let mut bytes = 0usize;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let resp = tokio::time::timeout(left, stream.message())
            .await
            .unwrap_or_else(|_| {
                panic!("the history's watch never reached its end marker (revision {at})")
            })
            .expect("the history's watch")
            .expect("the watch open");
        assert!(
            !resp.canceled(),
            "the history's watch was cancelled (compacted at {}): {}",
            resp.compact_revision(),
            resp.cancel_reason()
        );
        for e in resp.events() {
            let Some(kv) = e.kv() else { continue };
            if kv.key() == marker.as_bytes() {
                if kv.mod_revision() >= at {
                    client
                        .delete(marker.as_str(), None)
                        .await
                        .expect("delete the history's end marker");
                    return (bases, bytes);
                }
                continue;
            }
            if e.event_type() != etcd_client::EventType::Put {
                continue;
            }
            let key = String::from_utf8_lossy(kv.key());
            if let Some(base) = key.strip_prefix(layouts).and_then(|k| k.split('/').next()) {
                bases.insert(base.to_owned());
            }
            bytes += kv.value().len();
        }
    }
}
