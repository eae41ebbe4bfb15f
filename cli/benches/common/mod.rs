//! What the benches that start the real `wardend` share: the agent in a
//! scratch directory, started the way systemd starts it (READY=1 on a
//! notify socket), killed when dropped; and a client over its socket.

#![allow(dead_code)]

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream as TokioUnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use warden_proto::v1::agent_client::AgentClient;

/// A running `wardend` and its scratch directory.
pub struct Agent {
    child: Child,
    /// Its scratch directory: config, socket (`wardend.sock`), state.
    pub dir: tempfile::TempDir,
}

impl Agent {
    /// Starts `wardend` in `dir` with `config(socket, state_dir)` as its
    /// config and waits for READY=1.
    pub fn start(dir: tempfile::TempDir, config: impl FnOnce(&Path, &Path) -> String) -> Self {
        let cfg = dir.path().join("wardend.toml");
        let text = config(&dir.path().join("wardend.sock"), &dir.path().join("state"));
        std::fs::write(&cfg, text).unwrap();
        let notify = dir.path().join("notify");
        let sock = UnixDatagram::bind(&notify).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_wardend"))
            .arg("--config")
            .arg(&cfg)
            .env("NOTIFY_SOCKET", &notify)
            .env_remove("WARDEN_SOCKET")
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut buf = [0u8; 512];
        loop {
            let n = sock.recv(&mut buf).expect("wardend did not get ready");
            if String::from_utf8_lossy(&buf[..n]).contains("READY=1") {
                break;
            }
        }
        Self { child, dir }
    }

    /// Its Unix socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("wardend.sock")
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A gRPC client over the Unix socket at `path`.
pub async fn connect(path: &Path) -> AgentClient<Channel> {
    let path = path.to_owned();
    let ch =
        Endpoint::from_static("http://wardend.local")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(TokioUnixStream::connect(path).await?))
                }
            }))
            .await
            .unwrap();
    AgentClient::new(ch)
}

/// Ranks per simulated host in the exchange benches.
pub const RANKS_PER_HOST: u32 = 8;

/// The compute sections of the exchange benches' simulated ranks.
pub const SECTIONS: [&str; 4] = ["forward", "backward", "optimizer", "data"];

/// A deterministic jitter in [0.97, 1.03).
pub fn jitter(h: u64) -> f64 {
    let x = h
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    0.97 + (x >> 11) as f64 / (1u64 << 53) as f64 * 0.06
}

/// The window median (ns) of `section` (an index of [`SECTIONS`]) of
/// `host`'s rank `rank` in the exchange benches: each section's base
/// time, jittered by 3%.
pub fn median_ns(host: u32, rank: u32, section: usize) -> f64 {
    let base = [40e6, 80e6, 10e6, 5e6][section];
    base * jitter(u64::from(host) << 32 | u64::from(rank) << 8 | section as u64)
}

/// Simulated host `host`'s part of job `llm` as its agent reports it to
/// the aggregator: a sketch per section of its ranks' window medians.
pub fn host_report(host: u32) -> warden_core::detect::straggler::aggregate::HostReport {
    use warden_core::detect::straggler::aggregate::{HostReport, JobPart};
    let sections = SECTIONS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut sk = warden_core::detect::straggler::sketch::Sketch::default();
            for r in 0..RANKS_PER_HOST {
                sk.add(median_ns(host, r, i));
            }
            ((*name).to_owned(), sk)
        })
        .collect();
    HostReport {
        host: format!("host-{host:05}"),
        relative_threshold: 1.1,
        z_threshold: 3.0,
        jobs: vec![JobPart {
            job: "llm".into(),
            sections,
            scores: Vec::new(),
        }],
    }
}

/// The on-CPU time of every thread of process `pid` so far
/// (`/proc/PID/task/*/schedstat`).
pub fn cpu(pid: u32) -> Duration {
    Duration::from_nanos(threads(pid).values().sum())
}

/// Each live thread's on-CPU time of process `pid` so far, in ns, by
/// thread id (`/proc/PID/task/*/schedstat`).
pub fn threads(pid: u32) -> std::collections::HashMap<String, u64> {
    let mut out = std::collections::HashMap::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in dir.flatten() {
            let ns = std::fs::read_to_string(t.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            if let Some(ns) = ns {
                out.insert(t.file_name().to_string_lossy().into_owned(), ns);
            }
        }
    }
    out
}

/// Hands `agent` the hosts of `job` in node-rank order (address, name), as
/// each host's launcher does from its etcd round (`SetCheckpointPeers`):
/// the order the exchange and the restore's collector route by, and the
/// names that may call for the job.
pub async fn hand_over(agent: &Agent, job: &str, order: &[(String, String)]) {
    use warden_proto::v1 as pb;
    let peers = order
        .iter()
        .map(|(addr, name)| pb::CheckpointPeer {
            addr: addr.clone(),
            domain: String::new(),
            host: name.clone(),
            identity: name.clone(),
            ..Default::default()
        })
        .collect();
    connect(&agent.socket())
        .await
        .set_checkpoint_peers(pb::SetCheckpointPeersRequest {
            job_id: job.into(),
            peers,
            ..Default::default()
        })
        .await
        .expect("SetCheckpointPeers");
}
