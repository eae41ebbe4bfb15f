//! The agent's configuration: one TOML file, every key optional.
//!
//! Contract: [`Config::from_toml`] either returns a config whose every value
//! has been checked, or an error that names the offending key and says why.
//! Unknown keys are errors (a typo must not silently fall back to a default).
//! The documented reference for every key is `systemd/wardend.toml`; a test
//! keeps that file and [`Config::default`] in agreement.

pub use crate::sources::host_config::HostConfig;
pub use crate::telemetry::{LogConfig, LogFormat};
use warden_core::config::{ConfigError, HangConfig, duration, parse_toml};
use warden_core::rank::MAX_WORLD_SIZE;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The whole configuration of `wardend`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Identity and the main loop.
    pub agent: AgentConfig,
    /// Where the gRPC API listens.
    pub api: ApiConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// Log output.
    pub log: LogConfig,
    /// The event ring behind ListEvents / WatchEvents.
    pub events: EventsConfig,
    /// Host health thresholds.
    pub host: HostConfig,
    /// Registration of training ranks and their heartbeat slots.
    pub ranks: RanksConfig,
    /// Hang detection.
    pub hang: HangConfig,
    /// GPU health through NVML.
    pub nvml: crate::sources::nvml::NvmlConfig,
    /// TPU chips and libtpu's runtime metrics service.
    pub tpu: crate::sources::tpu::TpuConfig,
    /// NVIDIA's node health check protocol, served from the health model.
    pub nvhcd: nvhcd::NvhcdConfig,
    /// The kernel log source (XIDs, OOM kills, NIC links).
    pub kmsg: crate::sources::kmsg::KmsgConfig,
    /// DCGM's health watches, and its diagnostics as the pre-restart gate.
    pub dcgm: crate::sources::dcgm::DcgmConfig,
    /// A scripted node played next to the real sources (`--simulate`).
    pub simulated: crate::sources::simulated::SimulatedConfig,
    /// Straggler detection: slow ranks found from their compute sections,
    /// compared job-wide with peer agents, and explained.
    pub straggler: warden_core::detect::straggler::StragglerConfig,
    /// Silent-data-corruption suspects: ranks whose reported loss or
    /// gradient norm departs from their peers' or goes NaN/Inf.
    pub sdc: warden_core::detect::sdc::SdcConfig,
    /// How signals are joined into incidents and diagnosed.
    pub attribution: warden_core::attribute::AttributionConfig,
    /// Remediation per fault class, budgets, backoff and the user's hook.
    pub policy: warden_core::policy::PolicyConfig,
    /// Restarts the agent carries out itself (in process).
    pub restart: crate::act::config::RestartConfig,
    /// `[checkpoint]`: the local tier, peers, durable store.
    pub checkpoint: crate::ckpt::CheckpointConfig,
    /// `[slurm]`: drain the node in Slurm while it is cordoned.
    pub slurm: crate::act::slurm::SlurmConfig,
    /// `[goodput]`: how long ended jobs' ledgers, journals and series stay.
    pub goodput: crate::goodput::config::GoodputConfig,
    /// `[notice]`: where notices of a coming stop are read (GCE, EC2, a
    /// Kubernetes taint).
    pub notice: crate::notice::config::NoticeConfig,
}

/// `[agent]`: identity and the work loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// The name this node reports; empty means the kernel's host name.
    /// Set it where the scheduler knows nodes by another name.
    pub host_name: String,
    /// Period of the work loop that scans heartbeat slots and sources, and
    /// pings the systemd watchdog. Detection latency is bounded by it.
    #[serde(with = "duration")]
    pub tick: Duration,
    /// Where the agent keeps state that must survive its own restart (hang
    /// calibration, goodput journals). Empty: `/var/lib/warden` as root, else
    /// `$XDG_STATE_HOME/warden` or `~/.local/state/warden`.
    pub state_dir: String,
    /// How long shutdown waits for in-flight API calls before closing them.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
    /// A source stuck in one call for longer than this (or twice its poll
    /// interval, if longer) is stalled: its components read UNKNOWN until
    /// it answers again. Vendor libraries (NVML, DCGM) can hang on a GPU
    /// that fell off the bus; the agent must not hang with them.
    #[serde(with = "duration")]
    pub source_stall_after: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            host_name: String::new(),
            tick: Duration::from_millis(100),
            state_dir: String::new(),
            shutdown_grace: Duration::from_secs(5),
            source_stall_after: Duration::from_secs(30),
        }
    }
}

/// `[api]`: the gRPC listeners.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Unix socket path. Empty: `$RUNTIME_DIRECTORY/wardend.sock`, else
    /// `/run/warden/wardend.sock` as root, else the user's runtime directory.
    pub socket: String,
    /// Permission bits of the socket file, octal. 0660 lets the `warden`
    /// group (and so training jobs run by its members) connect.
    pub socket_mode: String,
    /// The group the socket file is handed to after binding (a group name
    /// or a numeric gid): with `socket_mode` 0660, its members (training
    /// users, the CLI) may connect and nobody else. Empty: the agent's own
    /// group (systemd's `Group=`).
    pub socket_group: String,
    /// Optional TCP address (`host:port`) where peer agents reach this one
    /// (checkpoint replicas and restores, the straggler exchange); empty:
    /// off. Only `warden.v1.Peer` is served there, and only to peers
    /// presenting a certificate of the cluster CA (`tls_ca`); the rest of
    /// the API is on the Unix socket only.
    pub tcp: String,
    /// The cluster CA certificate(s), PEM: a peer's certificate must chain
    /// to it, on `api.tcp` and when this agent dials a peer. Re-read when
    /// the file changes.
    pub tls_ca: String,
    /// This node's certificate chain, PEM, signed by the cluster CA; its
    /// first DNS subject alternative name must be this agent's host name
    /// (`agent.host_name`), which is its identity to peers. Re-read when
    /// the file changes (rotation needs no restart).
    pub tls_cert: String,
    /// This node's private key, PEM (PKCS#8, PKCS#1 or SEC1), readable by
    /// the agent only. Re-read when the file changes.
    pub tls_key: String,
    /// Serve `api.tcp` and dial peers in plain TCP, with no authentication:
    /// anyone who reaches the port may push, fetch and list checkpoint
    /// shards. For a trusted test network only; the agent warns at start
    /// and `warden health` reports the node DEGRADED while it is on.
    pub insecure: bool,
    /// A group (name or numeric gid) whose members are admins of the agent
    /// beside root and the agent's own user: they may call Uncordon and act
    /// on any job (docs/security.md). Empty: root and the agent's user only.
    pub admin_group: String,
    /// Streams (WatchEvents, WatchHealth, WatchIncidents) one uid may hold
    /// open at once; the next is refused with RESOURCE_EXHAUSTED naming
    /// this key. Each open stream holds a task, a buffer and HTTP/2 state.
    /// Control streams are bounded apart: one per registered rank (a newer
    /// one for the same registration replaces the older), so a uid holds
    /// at most `ranks.max_ranks_per_uid` of them.
    pub max_streams_per_uid: u32,
    /// Streams open at once over all callers, Control streams included
    /// (same refusal).
    pub max_streams: u32,
    /// Connections to the Unix socket one uid (SO_PEERCRED) may hold at
    /// once; past it a new connection is closed as soon as it is accepted.
    /// Admins (root, the agent's uid, `admin_group`) are exempt. A training
    /// process holds one; the CLI one per command.
    pub max_connections_per_uid: u32,
    /// Connections the agent takes at once over all its listeners (Unix
    /// socket, `api.tcp`, `metrics.listen`). The agent lowers it further to
    /// its open-file limit (RLIMIT_NOFILE) less a reserve for its own files
    /// (256 plus two per rank slot), and keeps the last 32 places (or an
    /// eighth, if fewer) for admins, so an operator reaches a flooded agent.
    pub max_connections: u32,
    /// A connection that has not sent the HTTP/2 connection preface this
    /// long after it was accepted is closed.
    #[serde(with = "duration")]
    pub preface_timeout: Duration,
    /// A connection with no request or stream open for this long is closed
    /// (clients dial again when they next call).
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// TLS handshakes on `api.tcp` one source address may have in progress
    /// at once; further connections from it are closed at once, so one
    /// host cannot take the handshake places of the valid peers.
    pub max_handshakes_per_source: u32,
    /// Requests one uid may have open at once over all its Unix-socket
    /// connections: unary calls in flight and streams of every kind (a
    /// request whose message never comes holds its stream as long as the
    /// client likes). Past it, RESOURCE_EXHAUSTED naming this key. Admins
    /// are exempt.
    pub max_requests_per_uid: u32,
    /// ReportJobStop calls one uid may make per minute (a token bucket
    /// holding as many, refilled evenly): a launcher reports a job's end
    /// once; past it the call is refused with RESOURCE_EXHAUSTED naming
    /// this key and nothing is recorded.
    pub job_stops_per_minute: u32,
}

impl ApiConfig {
    /// The TLS files, when all three are set.
    pub fn tls_files(&self) -> Option<crate::tls::TlsFiles> {
        if self.tls_ca.is_empty() || self.tls_cert.is_empty() || self.tls_key.is_empty() {
            return None;
        }
        Some(crate::tls::TlsFiles {
            ca: PathBuf::from(&self.tls_ca),
            cert: PathBuf::from(&self.tls_cert),
            key: PathBuf::from(&self.tls_key),
        })
    }

    /// The connection cap a job's fan-in is checked against when its peers
    /// are handed over (`ckpt::fan_in`, `exchange::capacity`): `listened`,
    /// the one the listeners enforce (None: none counted yet), and None
    /// where this agent serves no TCP, which no peer can dial.
    pub fn peer_cap(&self, listened: Option<usize>) -> Option<usize> {
        if self.tcp.is_empty() { None } else { listened }
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            socket: String::new(),
            socket_mode: "0660".into(),
            socket_group: String::new(),
            tcp: String::new(),
            admin_group: String::new(),
            tls_ca: String::new(),
            tls_cert: String::new(),
            tls_key: String::new(),
            insecure: false,
            max_streams_per_uid: 64,
            max_streams: 512,
            max_connections_per_uid: 128,
            max_connections: 4096,
            preface_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(300),
            max_handshakes_per_source: 8,
            max_requests_per_uid: 1024,
            job_stops_per_minute: 30,
        }
    }
}

/// `[metrics]`: the Prometheus scrape endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `host:port` serving `/metrics` in the Prometheus text format; empty:
    /// off. Port 0 picks a free port (GetAgentInfo shows which).
    pub listen: String,
    /// Connections one source address may hold to `listen` at once (any
    /// local user can reach a loopback port); further ones are closed at
    /// once. A scraper needs one. Every metrics connection is also closed
    /// after 5 s without a byte from its client, or 30 s after it opened.
    pub max_connections_per_source: u32,
    /// Job-labelled series (`{job="..."}`) held at once; past it a new one
    /// is not recorded (counted in `warden_metrics_job_series_dropped_total`).
    /// Ended jobs' series are removed after `goodput.series_after_end`.
    pub max_job_series: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            max_connections_per_source: 8,
            max_job_series: 8192,
        }
    }
}

/// `[events]`: the in-memory event ring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventsConfig {
    /// How many recent events are kept for ListEvents and for watchers that
    /// resume after an id. Older ones are dropped (the ring says so).
    pub retain: usize,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self { retain: 4096 }
    }
}

/// `[ranks]`: training ranks and their shared-memory heartbeat slots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RanksConfig {
    /// How many ranks this agent can watch at once (each takes one ~20 KiB
    /// slot of shared memory, a sealed memfd and one descriptor in the agent).
    /// A registration past it is refused.
    pub max_ranks: u32,
    /// Directory of the stack dumps (slots are sealed memfds, not files). Empty: the socket's
    /// directory, which is already shared with every client (and with the
    /// trainer container in a sidecar deployment). Should be on tmpfs.
    pub slot_dir: String,
    /// Ranks one process may hold registered at once (a training process
    /// is one rank; a launcher registering its workers, a few): so no
    /// single caller can take every slot.
    pub max_per_process: u32,
    /// Rank slots one uid (the registering caller's) may hold at once, so
    /// no single user can take every slot from the others. 0: half of
    /// `max_ranks` (at least 1). Root and admins are held to it too: their
    /// ranks are training ranks like any other.
    pub max_ranks_per_uid: u32,
    /// The largest world size a rank, a saved shard or a peer's replica may
    /// declare. Bounds what the agent sizes by it (a step's completeness,
    /// the ranks a restore reports missing).
    pub max_world_size: u32,
}

impl Default for RanksConfig {
    fn default() -> Self {
        Self {
            max_ranks: 256,
            slot_dir: String::new(),
            max_per_process: 8,
            max_ranks_per_uid: 0,
            max_world_size: 1 << 20,
        }
    }
}

impl RanksConfig {
    /// `max_ranks_per_uid` in force: as set, or half of `max_ranks` (at
    /// least 1) when 0.
    pub fn per_uid(&self) -> u32 {
        match self.max_ranks_per_uid {
            0 => (self.max_ranks / 2).max(1),
            n => n,
        }
    }
}

impl Config {
    /// The connection quotas' keys, for [`crate::listen::admission::Quotas::new`].
    pub fn quotas(&self) -> crate::listen::admission::QuotaSettings {
        crate::listen::admission::QuotaSettings {
            max_ranks: self.ranks.max_ranks,
            max_connections: self.api.max_connections,
            max_connections_per_uid: self.api.max_connections_per_uid,
            max_connections_per_source: self.metrics.max_connections_per_source,
            max_handshakes_per_source: self.api.max_handshakes_per_source,
            max_requests_per_uid: self.api.max_requests_per_uid,
        }
    }
}

impl Config {
    /// The sections the sources read, for [`crate::sources::registry::configured`].
    pub fn sources(&self) -> crate::sources::settings::Settings<'_> {
        crate::sources::settings::Settings {
            host: &self.host,
            kmsg: &self.kmsg,
            nvml: &self.nvml,
            dcgm: &self.dcgm,
            tpu: &self.tpu,
            simulated: &self.simulated,
            checkpoint: &self.checkpoint,
        }
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text =
            warden_core::named_file::read_to_string(path, warden_core::named_file::CONFIG_CAP)
                .map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let config: Config = parse_toml(text).map_err(|(key, message)| ConfigError::Parse {
            origin: origin.to_owned(),
            key,
            message,
        })?;
        config.validate(origin)?;
        Ok(config)
    }

    /// The effective configuration as TOML, for GetAgentInfo and `--print-config`.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// The TCP keys together: TLS files all or none, absolute; TCP (or
    /// peers to dial) only with TLS or an explicit `api.insecure = true`.
    fn validate_tls(
        &self,
        invalid: &dyn Fn(&'static str, String, &str) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let api = &self.api;
        let keys = [
            ("api.tls_ca", &api.tls_ca),
            ("api.tls_cert", &api.tls_cert),
            ("api.tls_key", &api.tls_key),
        ];
        for (key, v) in keys {
            if !v.is_empty() && !Path::new(v).is_absolute() {
                return Err(invalid(key, format!("{v:?}"), "must be an absolute path"));
            }
        }
        let set = keys.iter().filter(|(_, v)| !v.is_empty()).count();
        if set > 0
            && set < keys.len()
            && let Some((key, _)) = keys.iter().find(|(_, v)| v.is_empty())
        {
            return Err(invalid(
                key,
                "\"\"".to_owned(),
                "api.tls_ca, api.tls_cert and api.tls_key go together: set all three",
            ));
        }
        let tls = set == keys.len();
        if tls && api.insecure {
            return Err(invalid(
                "api.insecure",
                "true".to_owned(),
                "TLS files are set too: remove api.insecure to use them, or the \
                 api.tls_* keys to run without authentication",
            ));
        }
        if tls || api.insecure {
            if tls && let Some(p) = self.checkpoint.peers.iter().find(|p| p.name.is_empty()) {
                return Err(invalid(
                    "checkpoint.peers.name",
                    format!("\"\" (peer {})", p.addr),
                    "with api.tls_* set, each configured peer needs the name its \
                     certificate carries (its agent.host_name)",
                ));
            }
            return Ok(());
        }
        let fix = "peer agents are served and dialed over TCP only with mutual TLS: set \
                   api.tls_ca, api.tls_cert and api.tls_key (docs/operations.md), or \
                   api.insecure = true on a trusted test network";
        if !api.tcp.is_empty() {
            return Err(invalid("api.tcp", format!("{:?}", api.tcp), fix));
        }
        if let Some(p) = self.checkpoint.peers.first() {
            return Err(invalid("checkpoint.peers", format!("{:?}", p.addr), fix));
        }
        if let Some(p) = self.straggler.peers.first() {
            return Err(invalid("straggler.peers", format!("{p:?}"), fix));
        }
        Ok(())
    }

    /// Checks values that parse but make no sense. Every error names its key.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        let tick = self.agent.tick;
        if tick < Duration::from_millis(10) || tick > Duration::from_secs(1) {
            return Err(invalid(
                "agent.tick",
                humantime::format_duration(tick).to_string(),
                "must be between 10ms and 1s (it bounds hang-detection latency)",
            ));
        }
        if self.agent.shutdown_grace > Duration::from_secs(300) {
            return Err(invalid(
                "agent.shutdown_grace",
                humantime::format_duration(self.agent.shutdown_grace).to_string(),
                "must be at most 5m",
            ));
        }
        if self.agent.source_stall_after < Duration::from_secs(1) {
            return Err(invalid(
                "agent.source_stall_after",
                humantime::format_duration(self.agent.source_stall_after).to_string(),
                "must be at least 1s",
            ));
        }
        if !self.agent.state_dir.is_empty() && !Path::new(&self.agent.state_dir).is_absolute() {
            return Err(invalid(
                "agent.state_dir",
                format!("{:?}", self.agent.state_dir),
                "must be an absolute path",
            ));
        }
        if !self.api.socket.is_empty() && !Path::new(&self.api.socket).is_absolute() {
            return Err(invalid(
                "api.socket",
                format!("{:?}", self.api.socket),
                "must be an absolute path",
            ));
        }
        match self.socket_mode() {
            None => {
                return Err(invalid(
                    "api.socket_mode",
                    format!("{:?}", self.api.socket_mode),
                    "must be octal permission bits such as \"0660\" (at most 0777)",
                ));
            }
            // Any user of the host could connect: every read call, and the
            // claim of any job id nobody holds yet (docs/security.md).
            Some(m) if m & 0o007 != 0 => {
                return Err(invalid(
                    "api.socket_mode",
                    format!("{:?}", self.api.socket_mode),
                    "gives others (every user of the host) access to the agent's sockets; use 0660 with api.socket_group, or 0600",
                ));
            }
            Some(_) => {}
        }
        if let Err(why) = self.socket_gid() {
            return Err(invalid(
                "api.socket_group",
                format!("{:?}", self.api.socket_group),
                &why,
            ));
        }
        if !self.api.tcp.is_empty() && self.api.tcp.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "api.tcp",
                format!("{:?}", self.api.tcp),
                "must be an IP address and port such as \"127.0.0.1:7070\", or empty for off",
            ));
        }
        self.validate_tls(&invalid)?;
        if !self.metrics.listen.is_empty() && self.metrics.listen.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                "metrics.listen",
                format!("{:?}", self.metrics.listen),
                "must be an IP address and port such as \"127.0.0.1:9464\", or empty for off",
            ));
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            return Err(invalid(
                "log.level",
                format!("{:?}", self.log.level),
                &format!("not a tracing filter ({e}); try \"info\" or \"debug\""),
            ));
        }
        if !(1..=1_000_000).contains(&self.events.retain) {
            return Err(invalid(
                "events.retain",
                self.events.retain.to_string(),
                "must be between 1 and 1000000",
            ));
        }
        if self.host.poll_interval < Duration::from_millis(100) {
            return Err(invalid(
                "host.poll_interval",
                humantime::format_duration(self.host.poll_interval).to_string(),
                "must be at least 100ms",
            ));
        }
        for (key, v) in [
            (
                "host.memory_degraded_below_percent",
                self.host.memory_degraded_below_percent,
            ),
            (
                "host.memory_failed_below_percent",
                self.host.memory_failed_below_percent,
            ),
        ] {
            if !(0.0..=100.0).contains(&v) {
                return Err(invalid(
                    key,
                    v.to_string(),
                    "must be a percentage, 0 to 100",
                ));
            }
        }
        if !(1..=warden_slot::MAX_SLOTS).contains(&self.ranks.max_ranks) {
            return Err(invalid(
                "ranks.max_ranks",
                self.ranks.max_ranks.to_string(),
                &format!("must be between 1 and {}", warden_slot::MAX_SLOTS),
            ));
        }
        if !(1..=MAX_STREAMS).contains(&self.api.max_streams) {
            return Err(invalid(
                "api.max_streams",
                self.api.max_streams.to_string(),
                &format!("must be between 1 and {MAX_STREAMS}"),
            ));
        }
        if self.api.max_streams_per_uid == 0 || self.api.max_streams_per_uid > self.api.max_streams
        {
            return Err(invalid(
                "api.max_streams_per_uid",
                self.api.max_streams_per_uid.to_string(),
                "must be between 1 and api.max_streams",
            ));
        }
        if self.ranks.max_ranks_per_uid > self.ranks.max_ranks {
            return Err(invalid(
                "ranks.max_ranks_per_uid",
                self.ranks.max_ranks_per_uid.to_string(),
                "must be at most ranks.max_ranks (0: half of it)",
            ));
        }
        for (key, v) in [
            (
                "api.max_connections_per_uid",
                self.api.max_connections_per_uid,
            ),
            ("api.max_connections", self.api.max_connections),
            (
                "api.max_handshakes_per_source",
                self.api.max_handshakes_per_source,
            ),
            ("api.max_requests_per_uid", self.api.max_requests_per_uid),
            (
                "metrics.max_connections_per_source",
                self.metrics.max_connections_per_source,
            ),
        ] {
            if v == 0 {
                return Err(invalid(key, v.to_string(), "must be at least 1"));
            }
        }
        for (key, v, least) in [
            (
                "api.preface_timeout",
                self.api.preface_timeout,
                Duration::from_millis(100),
            ),
            (
                "api.idle_timeout",
                self.api.idle_timeout,
                Duration::from_secs(1),
            ),
        ] {
            if v < least || v > Duration::from_secs(86_400) {
                return Err(invalid(
                    key,
                    humantime::format_duration(v).to_string(),
                    &format!(
                        "must be between {} and 24h",
                        humantime::format_duration(least)
                    ),
                ));
            }
        }
        if self.ranks.max_per_process == 0 || self.ranks.max_per_process > self.ranks.max_ranks {
            return Err(invalid(
                "ranks.max_per_process",
                self.ranks.max_per_process.to_string(),
                "must be between 1 and ranks.max_ranks",
            ));
        }
        if !(1..=MAX_WORLD_SIZE).contains(&self.ranks.max_world_size) {
            return Err(invalid(
                "ranks.max_world_size",
                self.ranks.max_world_size.to_string(),
                &format!("must be between 1 and {MAX_WORLD_SIZE}"),
            ));
        }
        if let Err(why) = self.admin_gid() {
            return Err(invalid(
                "api.admin_group",
                format!("{:?}", self.api.admin_group),
                &why,
            ));
        }
        if !self.ranks.slot_dir.is_empty() && !Path::new(&self.ranks.slot_dir).is_absolute() {
            return Err(invalid(
                "ranks.slot_dir",
                format!("{:?}", self.ranks.slot_dir),
                "must be an absolute path",
            ));
        }
        let h = &self.hang;
        if !(h.multiplier >= 1.0 && h.multiplier <= 100.0) {
            return Err(invalid(
                "hang.multiplier",
                h.multiplier.to_string(),
                "must be between 1 and 100",
            ));
        }
        if !(h.percentile > 0.0 && h.percentile <= 100.0) {
            return Err(invalid(
                "hang.percentile",
                h.percentile.to_string(),
                "must be in (0, 100]",
            ));
        }
        if h.floor < self.agent.tick {
            return Err(invalid(
                "hang.floor",
                humantime::format_duration(h.floor).to_string(),
                "must be at least agent.tick",
            ));
        }
        if h.warmup_samples == 0 || h.warmup_samples > h.history {
            return Err(invalid(
                "hang.warmup_samples",
                h.warmup_samples.to_string(),
                "must be at least 1 and at most hang.history",
            ));
        }
        if !(1..=100_000).contains(&h.history) {
            return Err(invalid(
                "hang.history",
                h.history.to_string(),
                "must be between 1 and 100000",
            ));
        }
        for (key, d) in [
            ("hang.init_timeout", h.init_timeout),
            ("hang.checkpoint_timeout", h.checkpoint_timeout),
            ("hang.heal_timeout", h.heal_timeout),
            ("hang.default_timeout", h.default_timeout),
        ] {
            if d < self.agent.tick {
                return Err(invalid(
                    key,
                    humantime::format_duration(d).to_string(),
                    "must be at least agent.tick",
                ));
            }
        }
        for (name, d) in &h.timeouts {
            if *d < self.agent.tick {
                return Err(invalid(
                    "hang.timeouts",
                    format!("{name} = {}", humantime::format_duration(*d)),
                    "each timeout must be at least agent.tick",
                ));
            }
        }
        if h.stack_dump_wait > Duration::from_secs(60) {
            return Err(invalid(
                "hang.stack_dump_wait",
                humantime::format_duration(h.stack_dump_wait).to_string(),
                "must be at most 60s",
            ));
        }
        if h.verdict_wait.is_zero() || h.verdict_wait > Duration::from_secs(300) {
            return Err(invalid(
                "hang.verdict_wait",
                humantime::format_duration(h.verdict_wait).to_string(),
                "must be more than 0s and at most 5m",
            ));
        }
        // Every source's section, by the sources' list.
        crate::sources::registry::validate(self.sources(), origin)?;
        self.nvhcd.validate(origin)?;
        self.straggler.validate(origin)?;
        self.sdc.validate(origin)?;
        self.attribution.validate(origin)?;
        self.policy.validate(origin)?;
        // The hook's executable on disk: core checks the config alone.
        if let Err(why) = crate::policy::hook::check_program(&self.policy.hook) {
            return Err(invalid(
                "policy.hook",
                format!("{:?}", self.policy.hook.command),
                &why,
            ));
        }
        self.restart.validate(origin)?;
        self.checkpoint.validate(origin)?;
        self.slurm.validate(origin)?;
        self.goodput.validate(origin)?;
        self.notice.validate(origin)?;
        if !(1..=6000).contains(&self.api.job_stops_per_minute) {
            return Err(invalid(
                "api.job_stops_per_minute",
                self.api.job_stops_per_minute.to_string(),
                "must be between 1 and 6000",
            ));
        }
        if !(1..=1 << 20).contains(&self.metrics.max_job_series) {
            return Err(invalid(
                "metrics.max_job_series",
                self.metrics.max_job_series.to_string(),
                "must be between 1 and 1048576",
            ));
        }
        Ok(())
    }

    /// The gid of `api.admin_group` (None: empty, no admin group), or why
    /// it names no group of this host.
    pub fn admin_gid(&self) -> Result<Option<u32>, String> {
        group_gid(&self.api.admin_group)
    }

    /// The socket permission bits, parsed from `api.socket_mode`.
    pub fn socket_mode(&self) -> Option<u32> {
        let s = self.api.socket_mode.trim_start_matches("0o");
        u32::from_str_radix(s, 8).ok().filter(|m| *m <= 0o777)
    }

    /// The gid of `api.socket_group` (None: empty, keep the agent's), or
    /// why it names no group of this host. A number is taken as a gid
    /// as it is (containers often run without a group database).
    pub fn socket_gid(&self) -> Result<Option<u32>, String> {
        group_gid(&self.api.socket_group)
    }

    /// The socket path to bind: `api.socket`, else the default.
    pub fn socket_path(&self) -> PathBuf {
        if self.api.socket.is_empty() {
            warden_slot::paths::default_socket_path()
        } else {
            PathBuf::from(&self.api.socket)
        }
    }

    /// The directory for state that outlives the agent process.
    pub fn state_dir(&self) -> PathBuf {
        if !self.agent.state_dir.is_empty() {
            return PathBuf::from(&self.agent.state_dir);
        }
        // systemd's StateDirectory= (and `warden demo`'s scratch directory).
        if let Some(d) = std::env::var_os("STATE_DIRECTORY").filter(|d| !d.is_empty()) {
            let first = d
                .to_string_lossy()
                .split(':')
                .next()
                .unwrap_or("")
                .to_owned();
            if !first.is_empty() {
                return PathBuf::from(first);
            }
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            return PathBuf::from("/var/lib/warden");
        }
        if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
            return PathBuf::from(d).join("warden");
        }
        match std::env::var_os("HOME").filter(|d| !d.is_empty()) {
            Some(home) => PathBuf::from(home).join(".local/state/warden"),
            None => std::env::temp_dir().join("warden-state"),
        }
    }

    /// The directory of the stack dumps.
    pub fn slot_dir(&self) -> PathBuf {
        if self.ranks.slot_dir.is_empty() {
            self.socket_path()
                .parent()
                .map_or_else(|| PathBuf::from("/"), Path::to_path_buf)
        } else {
            PathBuf::from(&self.ranks.slot_dir)
        }
    }

    /// The host name to report: `agent.host_name`, else the kernel's.
    pub fn host_name(&self) -> String {
        if !self.agent.host_name.is_empty() {
            return self.agent.host_name.clone();
        }
        nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".into())
    }
}

pub mod nvhcd;
#[cfg(test)]
mod tests;

/// A group given by name or number (`api.socket_group`,
/// `api.admin_group`) as its gid; None when empty; or why it names no
/// group of this host. A number is taken as a gid as it is (containers
/// often run without a group database).
fn group_gid(group: &str) -> Result<Option<u32>, String> {
    let g = group.trim();
    if g.is_empty() {
        return Ok(None);
    }
    if let Ok(gid) = g.parse::<u32>() {
        return Ok(Some(gid));
    }
    match nix::unistd::Group::from_name(g) {
        Ok(Some(group)) => Ok(Some(group.gid.as_raw())),
        Ok(None) => Err(format!(
            "no group named {g:?} on this host (create it with groupadd, or give a numeric gid)"
        )),
        Err(e) => Err(format!("looking up group {g:?}: {e}")),
    }
}

/// The most `api.max_streams` may say: each stream holds a task and a
/// bounded buffer, so even this many stays within tens of MiB.
pub const MAX_STREAMS: u32 = 16_384;
