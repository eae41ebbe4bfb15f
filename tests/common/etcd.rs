//! A real etcd server per test: Debian's `etcd-server` (3.4), or the binary
//! `$WARDEN_TEST_ETCD` names.
//!
//! [`EtcdServer::start`] runs a single-member cluster on 127.0.0.1 with free
//! client and peer ports and its data in a scratch directory, waits until
//! `/health` answers true, and SIGKILLs it on drop. It runs with a 10 ms
//! heartbeat and a 100 ms election timeout so that it elects itself at
//! once and grants 1 s leases (etcd's shortest lease is 1.5 election
//! timeouts). A server that will not start fails the test with its log.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
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
    /// The client URL, `http://127.0.0.1:PORT`.
    pub endpoint: String,
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
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a free port")
        .port()
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy. Retries with fresh ports
    /// when another process took one between choosing and binding it.
    pub fn start() -> Self {
        let mut last_log = String::new();
        for _ in 0..3 {
            match Self::try_start() {
                Ok(server) => return server,
                Err(log) if log.contains("address already in use") => last_log = log,
                Err(log) => panic!("etcd did not start:\n{log}"),
            }
        }
        panic!("etcd did not start (ports taken three times):\n{last_log}");
    }

    fn try_start() -> Result<Self, String> {
        let dir = tempfile::Builder::new()
            .prefix("warden-etcd-")
            .tempdir()
            .expect("create a scratch directory for etcd");
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = dir.path().join("etcd.log");
        let log_file = std::fs::File::create(&log).expect("create etcd's log file");
        let mut cmd = Command::new(etcd_binary());
        // An ETCD_* variable in the runner's environment would override a flag.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(name);
            }
        }
        cmd.arg("--name=warden-test")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=warden-test={peer_url}"))
            .arg("--initial-cluster-state=new")
            .arg("--heartbeat-interval=10")
            .arg("--election-timeout=100")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("clone etcd's log file"))
            .stderr(log_file);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn etcd: {e}"));
        let mut server = Self {
            child: Some(child),
            dir,
            log,
            endpoint: client_url,
        };
        let deadline = Instant::now() + ETCD_STARTUP;
        loop {
            if server.healthy(client) {
                return Ok(server);
            }
            if let Some(child) = server.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                server.child = None;
                return Err(format!("exited with {status}:\n{}", server.log()));
            }
            if Instant::now() > deadline {
                let log = server.log();
                return Err(format!("not healthy after {ETCD_STARTUP:?}:\n{log}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether `GET /health` answers `"health":"true"`.
    fn healthy(&self, port: u16) -> bool {
        let Ok(mut s) =
            TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
        else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        if s.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
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
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
