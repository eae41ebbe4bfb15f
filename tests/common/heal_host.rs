//! One host of the heal-across-hosts tests (`torch_hostheal`, a lost host
//! replaced by a spare; `torch_mhheal`, a rank's own fault inside a round):
//! a real `warden run` of a job of examples/heal/ (ddp.py, hsdp.py or
//! a framework's) on its own loopback address,
//! with its embedded agent, over a real etcd.

use std::path::Path;
use std::process::Command;

use super::etcd::EtcdServer;
use super::{Streaming, WARDEN, python, repo_root};

/// The embedded agents: no kernel log, NVML or DCGM.
const AGENT_TOML: &str =
    "[kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n";

/// One host: its scratch directory (logs, agent config and tier).
pub struct Host {
    pub dir: tempfile::TempDir,
    pub id: &'static str,
    pub addr: &'static str,
}

/// What a host's `warden run` of the example is asked to do.
pub struct Launch<'a> {
    pub etcd: &'a EtcdServer,
    pub job: &'a str,
    pub log: &'a Path,
    /// Workers on this host.
    pub nproc: u32,
    /// Hosts in the job (`--nnodes`), spares not counted.
    pub nnodes: u32,
    /// Joins as a spare (`--spare`).
    pub spare: bool,
    /// The workers declare their state (`EXAMPLE_HEAL=1`); else they
    /// restart in job from the checkpoint.
    pub heal: bool,
    /// Every launcher's lease (`--rdzv-lease-ttl`).
    pub ttl: &'a str,
    pub steps: u32,
    pub ckpt_every: u32,
    /// The job under `examples/heal/` (`ddp.py`, `lightning_ddp.py`).
    pub example: &'a str,
    /// Modules the standby imports ahead (`--preload`), if any.
    pub preload: Option<&'a str>,
    /// Standby interpreters to keep (`--standbys`; 0: none); None: the
    /// default, one per local worker.
    pub standbys: Option<u32>,
}

impl Host {
    /// A host named `id` on `addr`, its directory under `prefix`. A TCP
    /// listener on the host's address (mutual TLS): the other hosts' agents
    /// keep replicas of this host's checkpoint shards, so the in-job
    /// baseline restores a lost rank from its checkpoint, as a real job
    /// would.
    pub fn new(id: &'static str, addr: &'static str, prefix: &str) -> Self {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
        let toml = format!(
            "[agent]\nhost_name = \"{id}\"\n{AGENT_TOML}[api]\ntcp = \"{addr}:0\"\n{}{}",
            super::pki::api_keys(id),
            super::tier_in(dir.path())
        );
        std::fs::write(dir.path().join("agent.toml"), toml).unwrap();
        Self { dir, id, addr }
    }

    /// Adds `toml` (whole tables) to this host's agent configuration.
    pub fn configure_agent(&self, toml: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("agent.toml"))
            .unwrap();
        f.write_all(toml.as_bytes()).unwrap();
    }

    /// `warden run` of the example as this host (its lines and its
    /// workers' on one stream).
    pub fn launch(&self, l: &Launch<'_>) -> Streaming {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
            .arg("--socket")
            .arg(self.dir.path().join("no-agent-here.sock"))
            .arg("run")
            .args(["--nproc-per-node", &l.nproc.to_string()])
            .args(["--nnodes", &l.nnodes.to_string()])
            .args(["--rdzv-backend", "etcd"])
            .args(["--rdzv-endpoint", &l.etcd.endpoint])
            .args(["--rdzv-id", l.job])
            .args(["--rdzv-conf", "join_timeout=120,last_call_timeout=3"])
            .args(["--host-id", self.id])
            .args(["--advertise-addr", self.addr])
            .args(["--rdzv-lease-ttl", l.ttl])
            .arg("--log-dir")
            .arg(self.dir.path().join("logs"))
            .arg("--agent-config")
            .arg(self.dir.path().join("agent.toml"))
            .args(if l.spare { &["--spare"][..] } else { &[][..] })
            .args(l.preload.map(|p| ["--preload", p]).as_slice().concat())
            .args(
                l.standbys
                    .map(|n| ["--standbys".to_owned(), n.to_string()])
                    .as_slice()
                    .concat(),
            )
            .arg("--")
            .arg(python())
            .arg(repo_root().join("examples/heal").join(l.example))
            .env("EXAMPLE_LOG", l.log)
            .env("EXAMPLE_STEPS", l.steps.to_string())
            .env("EXAMPLE_CKPT_EVERY", l.ckpt_every.to_string())
            .env("EXAMPLE_STEP_MS", "30")
            .env("EXAMPLE_HEAL", if l.heal { "1" } else { "0" })
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("WARDEN_SOCKET")
            .current_dir(self.dir.path());
        let mut s = Streaming::spawn(&mut cmd, self.dir.path().join(format!("{}.stderr", l.job)));
        s.label = format!("{} ({})", self.id, s.label);
        s
    }
}
