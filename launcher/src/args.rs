//! `warden run`'s command line: torchrun's flags (both `--nproc-per-node`
//! and `--nproc_per_node` spellings), so a job script swaps the command and
//! keeps its arguments, plus what warden adds (the agent, the stop grace,
//! the decision wait, the etcd coordinator's host id, address, spare role
//! and lease).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::torchrun_flags::TorchrunFlags;

/// etcd's client port, for an endpoint given without one.
pub const DEFAULT_ETCD_PORT: u16 = 2379;

/// Which agent the launcher uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AgentMode {
    /// The local wardend when one answers, else one embedded in the launcher.
    Auto,
    /// The local wardend only; fail (exit 1) when none answers.
    Local,
    /// Always embed an agent, even when a wardend runs (a private socket).
    Embedded,
}

/// `warden run [OPTIONS] [--] COMMAND [ARGS]...`
#[derive(Debug, Clone, Args)]
#[command(
    after_help = "Exit status: 0 all workers succeeded; a worker's own code when the agent \
                  diagnosed a user error (across hosts: on every host); 86 this node is at fault \
                  (cordon, scale-down, refused health gate, its etcd lease lost); 87 restart \
                  budget or --max-restarts spent; 88 no progress; 89 the job id belongs to another \
                  user on this agent (pick another --rdzv-id, or an admin runs `warden release-job`); 85 preempted: \
                  the workers saved on a notice (SIGTERM with --term-grace, a cloud's preemption or \
                  maintenance, a node taint), requeue me; 1 launcher error; 2 bad arguments; 128+N \
                  the launcher got signal N (130 SIGINT, 143 SIGTERM without --term-grace). \
                  See docs/operations.md."
)]
pub struct RunArgs {
    /// Workers on this node: a number, or `gpu` (one per visible GPU),
    /// `auto` (one per GPU, else per CPU), `cpu` (one per CPU), as
    /// torchrun's.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value = "1", value_parser = crate::nproc::parse)]
    pub nproc: crate::nproc::NProc,
    /// `--nproc-per-node` as a count on this node ([`RunArgs::resolve`]).
    #[arg(skip)]
    pub nproc_per_node: u32,
    /// Nodes in the job: N, or MIN:MAX (elastic: the job goes on with as
    /// few as MIN hosts; needs --rdzv-backend c10d or etcd).
    #[arg(long, default_value = "1", value_parser = parse_nnodes)]
    pub nnodes: NNodes,
    /// This node's rank among the job's nodes (GROUP_RANK), default 0.
    /// With --rdzv-backend etcd the rounds assign it and this is ignored.
    #[arg(long = "node-rank", alias = "node_rank")]
    pub node_rank: Option<u32>,
    /// Address of the rank-0 node (MASTER_ADDR).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Port of the rank-0 store (MASTER_PORT). Default: a free port picked
    /// anew for every attempt on a single node (no stale store to trip
    /// over), 29500 across nodes.
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<u16>,
    /// torchrun's rendezvous endpoint. Static rendezvous: `HOST[:PORT]`,
    /// taken as the master address and port. With --rdzv-backend c10d
    /// across nodes: torch's rendezvous store, `HOST[:PORT]` (port 29400
    /// when left out). With --rdzv-backend etcd: the
    /// etcd client endpoints, `HOST[:PORT]`, `http://HOST:PORT`, or with
    /// --etcd-cacert `https://HOST:PORT`, comma-separated (port 2379 when
    /// left out).
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint")]
    pub rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: `static` (node ranks from
    /// --node-rank), `c10d` (with --nnodes above 1 and no --node-rank:
    /// torchrun's rendezvous, run by torch, at --rdzv-endpoint; the same
    /// line on every host), or `etcd` (also
    /// `etcd-v2`): the launchers of the job's hosts agree on every round
    /// through etcd (membership under leases, restarts in one round on all
    /// hosts, scale down and up, spares).
    #[arg(long = "rdzv-backend", alias = "rdzv_backend")]
    pub rdzv_backend: Option<String>,
    /// torchrun's rendezvous settings, `KEY=VALUE,...`: `join_timeout`
    /// (seconds a rendezvous waits for a round this host runs in; default
    /// 600) and `last_call_timeout` (seconds a round that could grow waits
    /// for more hosts; default 2). Other keys are ignored, said so.
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", default_value = "", value_parser = parse_rdzv_conf)]
    pub rdzv_conf: RdzvConf,
    /// With --rdzv-backend etcd: this host's id in the job. Default: the
    /// host name. Letters, digits, `.`, `_`, `-`, `:`.
    #[arg(long = "host-id")]
    pub host_id: Option<String>,
    /// With --rdzv-backend etcd or c10d: the address the other hosts reach
    /// this host's workers at (MASTER_ADDR when it is node rank 0; with
    /// c10d, the launcher whose address is the endpoint's hosts torch's
    /// store). Default (etcd): the
    /// local address of the route to the first etcd endpoint (the host
    /// name's address when etcd runs here).
    #[arg(long = "advertise-addr")]
    pub advertise_addr: Option<String>,
    /// With --rdzv-backend etcd: join as a standby spare: no workers until
    /// a host of the job leaves, then take its node rank (hot-swap).
    #[arg(long)]
    pub spare: bool,
    /// With --rdzv-backend etcd: the TTL of this host's membership lease
    /// (whole seconds): a launcher that dies for this long (plus one more
    /// TTL of grace) is out of the job, and the others restart without it.
    /// One that only lost etcd, or stalled, keeps its workers running and
    /// regains its membership (a new lease if etcd expired the old one) for
    /// up to 10 TTLs or a minute before it leaves with 86.
    #[arg(long = "rdzv-lease-ttl", default_value = "5s", value_parser = humantime::parse_duration)]
    pub rdzv_lease_ttl: Duration,
    /// With --rdzv-backend etcd: past this share (0 to 1) of the job's
    /// hosts cordoned within --cordon-share-window (this one included), a
    /// host whose agent cordoned it does not exit 86 (node fault: requeue
    /// elsewhere, drain) but 87 (a person should look), and says why: a
    /// cordon storm must not drain a whole job. 1: no cap.
    #[arg(long = "max-cordon-share", default_value = "1.0", value_parser = parse_share)]
    pub max_cordon_share: f64,
    /// The window of --max-cordon-share.
    #[arg(long = "cordon-share-window", default_value = "1h", value_parser = humantime::parse_duration)]
    pub cordon_share_window: Duration,
    /// With --rdzv-backend etcd: TLS and authentication to etcd.
    #[command(flatten)]
    pub etcd: crate::coord::etcd_flags::EtcdFlags,
    /// In-job restarts allowed before giving up with 87 (torchrun's
    /// meaning). Default: the agent's policy budgets decide.
    #[arg(long = "max-restarts", alias = "max_restarts")]
    pub max_restarts: Option<u32>,
    /// Stop with 88 after this many failed attempts in a row that did not
    /// advance the job: its newest complete checkpoint in the agent's tier
    /// (without one, the step its ranks resumed from). A restart loop that
    /// trains and loses the same steps again stops here instead of
    /// spending every restart; 0 turns the rule off.
    #[arg(long = "max-no-progress-restarts", default_value_t = 3)]
    pub max_no_progress_restarts: u32,
    /// The job's id (TORCHELASTIC_RUN_ID, WARDEN_JOB_ID). Default:
    /// $WARDEN_JOB_ID, else `<host>-<pid>`.
    #[arg(long = "rdzv-id", alias = "rdzv_id", visible_alias = "job-id")]
    pub job_id: Option<String>,
    /// A single-node job on a free local port (torchrun's --standalone).
    #[arg(long)]
    pub standalone: bool,
    /// The worker role's name (ROLE_NAME).
    #[arg(long, default_value = "default")]
    pub role: String,
    /// Per-rank logs go to `<LOG_DIR>/<job>/attempt_<n>/rank_<r>.{stdout,stderr}.log`.
    /// Default: $XDG_STATE_HOME/warden/runs (~/.local/state/warden/runs).
    #[arg(long = "log-dir", alias = "log_dir")]
    pub log_dir: Option<PathBuf>,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    #[arg(long = "stop-grace", default_value = "5s", value_parser = humantime::parse_duration)]
    pub stop_grace: Duration,
    /// How long the scheduler waits between its SIGTERM and its SIGKILL
    /// (Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds). Set,
    /// a SIGTERM is a notice: the workers are not signalled but told
    /// through the agent to save at their next step boundary and leave;
    /// those left after the window less --stop-grace and 1 s are stopped,
    /// and the launcher exits 85 (preempted: requeue me). 0: a SIGTERM is
    /// forwarded to the workers (exit 143).
    #[arg(long = "term-grace", default_value = "0s", value_parser = humantime::parse_duration)]
    pub term_grace: Duration,
    /// The bound, in GiB, on this job's compilation caches in the agent's
    /// tier (torch.compile's and XLA's, kept across restarts: see
    /// docs/operations.md); the job's files least recently written go
    /// first. 0: no cache in the tier (the frameworks' own defaults apply).
    #[arg(long = "compile-cache-max-gib", default_value_t = 10.0, value_parser = parse_gib)]
    pub compile_cache_max_gib: f64,
    /// The bound, in GiB, on all this user's jobs' compilation caches in
    /// the tier (at least the job's bound): past it the files least
    /// recently written of any of their jobs go first, so one user cannot
    /// fill the tier.
    #[arg(long = "compile-cache-user-max-gib", default_value_t = 40.0, value_parser = parse_gib)]
    pub compile_cache_user_max_gib: f64,
    /// How long a failed worker waits for the agent's decision before the
    /// launcher treats the failure as class unknown.
    #[arg(long = "decision-timeout", default_value = "5s", value_parser = humantime::parse_duration)]
    pub decision_timeout: Duration,
    /// How long, once a worker failed in its teardown (its training ended:
    /// its client closed, then it died by a signal or exited non-zero), the
    /// launcher waits for the other workers to exit before it takes the
    /// failure for a failure (a peer still training). Ending a process
    /// that ran torch (freeing memory, tearing down gloo or NCCL) takes
    /// seconds, more on a loaded host: a shorter wait restarts a job whose
    /// training had ended.
    #[arg(long = "teardown-timeout", default_value = "60s", value_parser = humantime::parse_duration)]
    pub teardown_timeout: Duration,
    /// How long a restart waits for the GPUs to release the stopped
    /// workers (NVML); then it goes on and says so.
    #[arg(long = "gpu-release-timeout", default_value = "30s", value_parser = humantime::parse_duration)]
    pub gpu_release_timeout: Duration,
    /// Run COMMAND as given, not through the Python interpreter, even when
    /// it ends in `.py` (torchrun's --no-python).
    #[arg(long = "no-python", alias = "no_python", conflicts_with = "module")]
    pub no_python: bool,
    /// COMMAND is a Python module (`python3 -m COMMAND`), as torchrun's -m.
    #[arg(short = 'm', long)]
    pub module: bool,
    /// Keep a standby interpreter per local worker, started in advance
    /// with torch (and --preload) imported, and make the restarted workers
    /// of an in-job restart out of them (warm restarts): for `script.py`,
    /// `-m MODULE` and `PYTHON script.py` entrypoints. The default; see
    /// docs/operations.md.
    #[arg(long, overrides_with = "no_standby")]
    pub standby: bool,
    /// No standby interpreters: every restart starts its workers cold.
    #[arg(long = "no-standby", overrides_with = "standby")]
    pub no_standby: bool,
    /// How many standby interpreters to keep (default: one per local
    /// worker). Each holds an interpreter with torch imported (hundreds of
    /// MB, seconds of CPU at its start): fewer save both, and a restart
    /// that replaces more workers than there are standbys starts the rest
    /// cold. 0 is --no-standby.
    #[arg(long, value_name = "N", conflicts_with = "no_standby")]
    pub standbys: Option<u32>,
    /// Modules the standby interpreters import besides torch,
    /// torch.distributed, torch.nn.parallel and torch._dynamo,
    /// comma-separated (`--preload numpy,mypkg.model`).
    #[arg(long, value_delimiter = ',', value_name = "MODULES")]
    pub preload: Vec<String>,
    /// A JAX job: each worker also gets what `jax.distributed.initialize()`
    /// reads with no arguments (the coordinator's address, a new port each
    /// attempt on one node, and the process count and id). Default: on when
    /// the program imports jax; `--no-jax` turns it off.
    #[arg(long, overrides_with = "no_jax")]
    pub jax: bool,
    /// Not a JAX job, even when the program imports jax.
    #[arg(long = "no-jax", overrides_with = "jax")]
    pub no_jax: bool,
    /// Which agent to use.
    #[arg(long, value_enum, default_value_t = AgentMode::Auto)]
    pub agent: AgentMode,
    /// Config of the embedded agent (wardend's TOML); its socket is always
    /// private to this launcher.
    #[arg(long = "agent-config")]
    pub agent_config: Option<PathBuf>,
    /// Also write the run's summary (attempts, restarts, their diagnoses and
    /// timings) to FILE as JSON.
    #[arg(long = "summary-json")]
    pub summary_json: Option<PathBuf>,
    /// Do not copy the workers' output to the console (log files only).
    #[arg(long)]
    pub quiet: bool,
    /// torchrun's options that shape the console and the logs.
    #[command(flatten)]
    pub torchrun: TorchrunFlags,
    /// The training command: `train.py ARGS` (run with python3), `-m MODULE
    /// ARGS`, or any executable (`python3 train.py`, `bash job.sh`).
    #[arg(required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// `--rdzv-conf`: the rendezvous settings warden reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdzvConf {
    /// `join_timeout`: how long a rendezvous waits for a round this host
    /// runs in (torchrun's default, 600 s, when not given).
    pub join_timeout: Option<Duration>,
    /// `last_call_timeout`: how long a round that could grow waits for
    /// more hosts.
    pub last_call: Option<Duration>,
    /// Keys given that warden does not use.
    pub ignored: Vec<String>,
    /// Those keys with their values, for torch's c10d rendezvous, which
    /// reads some of them (`keep_alive_interval`, `is_host`, ...: `c10d`).
    pub other: Vec<(String, String)>,
}

/// torchrun's default `join_timeout`.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);

impl RdzvConf {
    /// How long a rendezvous waits for a round.
    pub fn join_timeout(&self) -> Duration {
        self.join_timeout.unwrap_or(DEFAULT_JOIN_TIMEOUT)
    }
}

fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, String> {
    let mut conf = RdzvConf::default();
    for kv in s.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("{kv:?} is not KEY=VALUE"))?;
        let (k, v) = (k.trim(), v.trim());
        let secs = || -> Result<Duration, String> {
            // torchrun's are seconds; a unit (`2s`, `500ms`) is taken too.
            match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(Duration::from_secs_f64(x)),
                Ok(_) => Err(format!("{k}={v}: not a duration")),
                Err(_) => humantime::parse_duration(v).map_err(|e| format!("{k}={v}: {e}")),
            }
        };
        match k {
            "join_timeout" => conf.join_timeout = Some(secs()?),
            "last_call_timeout" => conf.last_call = Some(secs()?),
            _ => {
                conf.ignored.push(k.to_owned());
                conf.other.push((k.to_owned(), v.to_owned()));
            }
        }
    }
    Ok(conf)
}

/// The rendezvous `warden run` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Fixed node ranks and master address (torchrun's static, or c10d
    /// taken as static).
    Static,
    /// Rounds agreed through etcd.
    Etcd,
}

/// `--nnodes`: a fixed count or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NNodes {
    /// The fewest nodes the job runs on.
    pub min: u32,
    /// The most.
    pub max: u32,
}

fn parse_nnodes(s: &str) -> Result<NNodes, String> {
    let num = |v: &str| {
        v.trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=65536).contains(n))
            .ok_or_else(|| format!("{v:?} is not a node count in 1..=65536"))
    };
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if min > max {
        return Err(format!("{s:?}: MIN is above MAX"));
    }
    Ok(NNodes { min, max })
}

/// Why the arguments cannot be followed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    /// An option before the program that `warden run` does not know: it
    /// would otherwise be started as the program.
    #[error(
        "unknown option {0:?} before the program: `warden run` takes torchrun's options and its own (`warden run --help`; docs/operations.md, \"torchrun's options\")"
    )]
    UnknownOption(String),
    /// A torchrun option that cannot apply, or `--nproc-per-node` that
    /// cannot be resolved here.
    #[error("{0}")]
    Torchrun(String),
    /// `--node-rank` outside `--nnodes`.
    #[error("--node-rank {rank} is not below --nnodes {nnodes}")]
    NodeRank {
        /// The node rank given.
        rank: u32,
        /// The node count given.
        nnodes: u32,
    },
    /// A job id the agent would refuse.
    #[error("job id {0:?} must be 1 to 128 characters, without control characters")]
    JobId(String),
    /// `--standalone` with several nodes.
    #[error("--standalone runs on one node; --nnodes is {0}")]
    Standalone(u32),
    /// `--rdzv-endpoint` that is not HOST[:PORT].
    #[error("--rdzv-endpoint {0:?} is not HOST[:PORT]")]
    Endpoint(String),
    /// What needs the etcd coordinator across hosts.
    #[error(
        "{0} needs --rdzv-backend etcd (the launchers of the job's hosts agree on each round through etcd)"
    )]
    NeedsEtcd(String),
    /// A rendezvous backend this launcher does not have.
    #[error("--rdzv-backend {0:?}: use static, c10d (static here) or etcd")]
    Backend(String),
    /// `--rdzv-backend etcd` without its endpoints.
    #[error(
        "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (the etcd endpoints)"
    )]
    NoEtcdEndpoint,
    /// A lease TTL etcd cannot take.
    #[error("--rdzv-lease-ttl {0:?} must be whole seconds, at least 1s")]
    LeaseTtl(Duration),
    /// A job id that cannot be one etcd key segment.
    #[error(
        "job id {0:?}: with --rdzv-backend etcd it must be 1 to 128 characters of letters, digits, '.', '_', '-', ':'"
    )]
    EtcdJobId(String),
    /// A host id that cannot be one etcd key segment.
    #[error("--host-id {0:?} must be 1 to 128 characters of letters, digits, '.', '_', '-', ':'")]
    HostId(String),
    /// More ranks than a u32 holds.
    #[error("--nnodes {nnodes} x --nproc-per-node {nproc} ranks is too many")]
    WorldSize {
        /// Nodes.
        nnodes: u32,
        /// Workers per node.
        nproc: u32,
    },
}

impl RunArgs {
    /// The rendezvous asked for.
    pub fn backend(&self) -> Result<Backend, ArgsError> {
        match self.rdzv_backend.as_deref() {
            None | Some("static" | "c10d") => Ok(Backend::Static),
            Some("etcd" | "etcd-v2") => Ok(Backend::Etcd),
            Some(b) => Err(ArgsError::Backend(b.to_owned())),
        }
    }

    /// True with `--rdzv-backend etcd`.
    pub fn is_etcd(&self) -> bool {
        self.backend() == Ok(Backend::Etcd)
    }

    /// True when the node ranks come from torch's c10d rendezvous
    /// (`crate::c10d`): `--rdzv-backend c10d`, several nodes, no
    /// `--node-rank` (with one, the rendezvous is static, as before).
    pub fn is_c10d_rounds(&self) -> bool {
        self.rdzv_backend.as_deref() == Some("c10d")
            && self.node_rank.is_none()
            && self.nnodes.max > 1
    }

    /// This node's rank with a static rendezvous (`--node-rank`, else 0).
    pub fn node_rank(&self) -> u32 {
        self.node_rank.unwrap_or(0)
    }

    /// The etcd endpoints of `--rdzv-endpoint`, each with a port.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.rdzv_endpoint
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let bare = e
                    .strip_prefix("http://")
                    .or_else(|| e.strip_prefix("https://"))
                    .unwrap_or(e);
                // host:port, [v6]:port: a port is there; host, [v6]: add one.
                let has_port = match bare.rsplit_once(':') {
                    Some((h, p)) => {
                        !p.is_empty()
                            && p.bytes().all(|b| b.is_ascii_digit())
                            && (!h.contains(':') || h.ends_with(']'))
                    }
                    None => false,
                };
                if has_port {
                    e.to_owned()
                } else {
                    format!("{e}:{}", DEFAULT_ETCD_PORT)
                }
            })
            .collect()
    }

    /// Resolves what torchrun's options leave to the node: the worker
    /// count of `--nproc-per-node gpu|auto|cpu`, and the options warden
    /// takes under its own names (`--shutdown-timeout` is `--stop-grace`,
    /// `--local-addr` is `--advertise-addr`). `gpus` counts this node's
    /// GPUs (NVML), `cpus` its CPUs, `xpus` asks the workers' interpreter
    /// for its XPUs ([`crate::nproc::torch_xpus`]).
    pub fn resolve(
        &mut self,
        gpus: impl FnOnce() -> Result<u32, String>,
        cpus: impl FnOnce() -> u32,
        xpus: impl FnOnce(&str) -> Result<u32, String>,
    ) -> Result<(), ArgsError> {
        // The workers' interpreter counts the XPUs, as torchrun's own does.
        let python = self.argv().into_iter().next().unwrap_or_default();
        self.nproc_per_node = crate::nproc::resolve(self.nproc, gpus, cpus, || xpus(&python))
            .map_err(ArgsError::Torchrun)?;
        if let Some(secs) = self.torchrun.shutdown_timeout {
            self.stop_grace = Duration::from_secs_f64(secs);
        }
        if self.advertise_addr.is_none() && (self.is_etcd() || self.is_c10d_rounds()) {
            self.advertise_addr = self.torchrun.local_addr.clone();
        }
        Ok(())
    }

    /// Checks what clap cannot: ranges across flags, the job id, an
    /// unknown option where the program should be, torchrun options that
    /// cannot apply.
    pub fn validate(&self) -> Result<(), ArgsError> {
        if let Some(first) = self.command.first()
            && first.starts_with('-')
        {
            return Err(ArgsError::UnknownOption(first.clone()));
        }
        self.torchrun.refused().map_err(ArgsError::Torchrun)?;
        let etcd = self.backend()? == Backend::Etcd;
        let c10d = self.is_c10d_rounds();
        if !etcd {
            if self.nnodes.min != self.nnodes.max && !c10d {
                return Err(ArgsError::NeedsEtcd(format!(
                    "--nnodes {}:{}",
                    self.nnodes.min, self.nnodes.max
                )));
            }
            for (given, flag) in [
                (self.spare, "--spare"),
                (self.host_id.is_some(), "--host-id"),
                // Not the --etcd-* flags: they may come from WARDEN_ETCD_*
                // variables set for every job, single-node ones included.
                (self.advertise_addr.is_some() && !c10d, "--advertise-addr"),
                (self.max_cordon_share < 1.0, "--max-cordon-share"),
            ] {
                if given {
                    return Err(ArgsError::NeedsEtcd(flag.to_owned()));
                }
            }
        }
        let nnodes = self.nnodes.max;
        if !etcd && !c10d && nnodes > 1 && self.node_rank.is_none() {
            // A static rendezvous would make every host node 0 (two rank
            // 0s: a hang in init_process_group, or worse).
            return Err(ArgsError::Torchrun(format!(
                "--nnodes {nnodes} without --node-rank: a static rendezvous cannot hand out node ranks; give each host its --node-rank, or use --rdzv-backend c10d (torch's rendezvous at --rdzv-endpoint) or etcd"
            )));
        }
        if c10d && self.rdzv_endpoint.is_none() {
            return Err(ArgsError::Torchrun(
                "--rdzv-backend c10d across nodes needs --rdzv-endpoint HOST:PORT (where torch's rendezvous store runs)".to_owned(),
            ));
        }
        if etcd {
            if self.etcd_endpoints().is_empty() {
                return Err(ArgsError::NoEtcdEndpoint);
            }
            if self.rdzv_lease_ttl < Duration::from_secs(1)
                || self.rdzv_lease_ttl.subsec_nanos() != 0
            {
                return Err(ArgsError::LeaseTtl(self.rdzv_lease_ttl));
            }
            if let Some(h) = &self.host_id
                && !valid_key_segment(h)
            {
                return Err(ArgsError::HostId(h.clone()));
            }
        } else if self.node_rank() >= nnodes {
            return Err(ArgsError::NodeRank {
                rank: self.node_rank(),
                nnodes,
            });
        }
        if self.standalone && (nnodes != 1 || etcd) {
            return Err(ArgsError::Standalone(nnodes));
        }
        if nnodes.checked_mul(self.nproc_per_node).is_none() {
            return Err(ArgsError::WorldSize {
                nnodes,
                nproc: self.nproc_per_node,
            });
        }
        if let Some(id) = &self.job_id {
            valid_job_id(id)?;
        }
        if !etcd {
            self.endpoint()?;
        }
        Ok(())
    }

    /// Master address and fixed port, from `--rdzv-endpoint` when given.
    pub fn endpoint(&self) -> Result<(String, Option<u16>), ArgsError> {
        let Some(ep) = &self.rdzv_endpoint else {
            return Ok((self.master_addr.clone(), self.master_port));
        };
        let bad = || ArgsError::Endpoint(ep.clone());
        // [v6]:port, host:port, host
        let (host, port) = match ep.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(':') => (h, Some(p.parse::<u16>().map_err(|_| bad())?)),
            _ => (ep.as_str(), None),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad());
        }
        // Port 0 is torchrun's "any free port" (torchtitan's
        // `--rdzv_endpoint=localhost:0`): a free one per attempt here.
        Ok((
            host.to_owned(),
            port.filter(|p| *p != 0).or(self.master_port),
        ))
    }

    /// The standby interpreters to keep: with standbys on (the default)
    /// and a Python entrypoint, what they become and preload; else None.
    pub fn standby_plan(&self) -> Option<crate::standby::StandbyPlan> {
        if self.no_standby || self.standbys == Some(0) {
            return None;
        }
        Some(crate::standby::StandbyPlan {
            entry: crate::standby::Entry::of(&self.argv())?,
            preload: crate::standby::preload_spec(&self.preload),
            count: self.standbys,
        })
    }

    /// Whether the workers get JAX's variables: `--jax`, else (without
    /// `--no-jax`) a program found to import jax ([`crate::jax::detect`]).
    pub fn jax_job(&self) -> bool {
        if self.jax || self.no_jax {
            return self.jax;
        }
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        crate::jax::detect(&self.argv(), &cwd)
    }

    /// The argv to execute: `python3 script.py ARGS` for a script, `python3
    /// -m MODULE ARGS` with `-m`, else COMMAND as given.
    pub fn argv(&self) -> Vec<String> {
        let python = || std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        if self.module {
            let mut v = vec![python(), "-m".into()];
            v.extend(self.command.iter().cloned());
            return v;
        }
        if !self.no_python && self.command.first().is_some_and(|c| c.ends_with(".py")) {
            let mut v = vec![python()];
            v.extend(self.command.iter().cloned());
            return v;
        }
        self.command.clone()
    }
}

/// A host or job id is one etcd key segment (the coordinator's rule).
pub fn valid_key_segment(h: &str) -> bool {
    (1..=128).contains(&h.len())
        && h.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))
}

/// Refuses a job id the agent's registry would refuse.
pub fn valid_job_id(id: &str) -> Result<(), ArgsError> {
    if warden_core::text::unfit_name(id, 128) {
        return Err(ArgsError::JobId(id.to_owned()));
    }
    Ok(())
}

/// A share of the job's hosts: a number from 0 to 1.
fn parse_share(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a share: from 0 to 1"))
    }
}

/// A size in GiB: a finite number, 0 or more.
fn parse_gib(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of GiB"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{s:?}: a size in GiB is finite and not negative"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrap {
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse(args: &[&str]) -> RunArgs {
        let mut v = vec!["run"];
        v.extend_from_slice(args);
        let mut a = Wrap::try_parse_from(v)
            .map(|w| w.run)
            .unwrap_or_else(|e| panic!("{e}"));
        // A node of 8 GPUs and 16 CPUs.
        a.resolve(|| Ok(8), || 16, |_| Ok(0))
            .unwrap_or_else(|e| panic!("{e}"));
        a
    }

    /// torchtitan 0.3's `run_train.sh` line, as is: every option taken
    /// with torchrun's meaning, none mistaken for the program.
    #[test]
    fn torchtitans_line_parses_as_torchrun_reads_it() {
        let a = parse(&[
            "--nproc_per_node=8",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter",
            "0",
            "--role",
            "rank",
            "--tee",
            "3",
            "-m",
            "torchtitan.train",
            "--job.config_file",
            "x.toml",
        ]);
        assert_eq!(a.validate(), Ok(()));
        assert_eq!(a.nproc_per_node, 8);
        assert_eq!(a.role, "rank");
        assert!(a.module);
        assert_eq!(
            a.command,
            ["torchtitan.train", "--job.config_file", "x.toml"]
        );
        assert!(a.torchrun.on_console(0, crate::output::Stream::Stdout));
        assert!(!a.torchrun.on_console(1, crate::output::Stream::Stdout));
    }

    #[test]
    fn nproc_words_resolve_and_unknown_options_are_errors() {
        assert_eq!(
            parse(&["--nproc-per-node", "gpu", "t.py"]).nproc_per_node,
            8
        );
        assert_eq!(parse(&["--nproc-per-node=auto", "t.py"]).nproc_per_node, 8);
        assert_eq!(
            parse(&["--nproc_per_node", "cpu", "t.py"]).nproc_per_node,
            16
        );
        let mut a = Wrap::try_parse_from(["run", "--nproc-per-node", "gpu", "t.py"])
            .map(|w| w.run)
            .unwrap_or_else(|e| panic!("{e}"));
        let e = a
            .resolve(|| Err("NVML not loadable".into()), || 16, |_| Ok(0))
            .unwrap_err();
        assert!(e.to_string().contains("--nproc-per-node gpu"), "{e}");
        // An option nobody knows is never started as the program.
        for unknown in ["--tee-all", "--bogus", "-x"] {
            let a = parse(&[unknown, "3", "t.py"]);
            assert_eq!(
                a.validate(),
                Err(ArgsError::UnknownOption(unknown.to_owned())),
                "{unknown}"
            );
        }
        // torchrun's process options map to warden's.
        let a = parse(&[
            "--shutdown-timeout",
            "12",
            "--monitor-interval",
            "0.1",
            "--start-method",
            "fork",
            "t.py",
        ]);
        assert_eq!(a.stop_grace, Duration::from_secs(12));
        assert_eq!(a.validate(), Ok(()));
        let a = parse(&["--numa-binding", "node", "t.py"]);
        assert!(
            matches!(a.validate(), Err(ArgsError::Torchrun(e)) if e.contains("--numa-binding"))
        );
    }

    #[test]
    fn torchrun_spellings_parse() {
        let a = parse(&[
            "--nproc_per_node",
            "4",
            "--max_restarts",
            "2",
            "--rdzv_id",
            "j1",
            "train.py",
            "--lr",
            "1",
        ]);
        assert_eq!(a.nproc_per_node, 4);
        assert_eq!(a.max_restarts, Some(2));
        assert_eq!(a.job_id.as_deref(), Some("j1"));
        assert_eq!(a.command, ["train.py", "--lr", "1"]);
        assert_eq!(a.argv()[1..], ["train.py", "--lr", "1"]);
    }

    #[test]
    fn explicit_interpreter_and_module() {
        let a = parse(&["--nproc-per-node", "2", "--", "python3", "t.py", "-x"]);
        assert_eq!(a.argv(), ["python3", "t.py", "-x"]);
        let m = parse(&["-m", "pkg.train", "--epochs", "3"]);
        assert_eq!(m.argv()[1..], ["-m", "pkg.train", "--epochs", "3"]);
        let n = parse(&["--no-python", "run.py"]);
        assert_eq!(n.argv(), ["run.py"]);
    }

    #[test]
    fn validation_names_the_flag() {
        let a = parse(&["--nnodes", "2", "t.py"]);
        assert!(
            matches!(a.validate(), Err(ArgsError::Torchrun(e)) if e.contains("without --node-rank")),
            "a static rendezvous would make both hosts node 0"
        );
        let a = parse(&["--nnodes", "2", "--rdzv-backend", "c10d", "t.py"]);
        assert!(
            matches!(a.validate(), Err(ArgsError::Torchrun(e)) if e.contains("needs --rdzv-endpoint")),
            "torch's rendezvous needs its store"
        );
        // The same line on every host: node ranks from torch's rendezvous.
        let a = parse(&[
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "10.0.0.1:29400",
            "--local-addr",
            "10.0.0.2",
            "--rdzv-conf",
            "keep_alive_interval=2,is_host=false",
            "t.py",
        ]);
        assert_eq!(a.validate(), Ok(()));
        assert!(a.is_c10d_rounds());
        assert_eq!(a.advertise_addr.as_deref(), Some("10.0.0.2"));
        assert_eq!(
            a.rdzv_conf.other,
            [
                ("keep_alive_interval".to_owned(), "2".to_owned()),
                ("is_host".to_owned(), "false".to_owned())
            ]
        );
        // With --node-rank, c10d stays the static rendezvous it was.
        let a = parse(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-backend",
            "c10d",
            "t.py",
        ]);
        assert!(!a.is_c10d_rounds());
        assert_eq!(a.validate(), Ok(()));
        let a = parse(&["--nnodes", "2", "--node-rank", "2", "t.py"]);
        assert_eq!(
            a.validate(),
            Err(ArgsError::NodeRank { rank: 2, nnodes: 2 })
        );
        let a = parse(&["--rdzv-id", "", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::JobId(_))));
        let a = parse(&["--rdzv-endpoint", "node0:29400", "t.py"]);
        assert_eq!(a.endpoint(), Ok(("node0".into(), Some(29400))));
        let a = parse(&["--rdzv-endpoint", "node0", "t.py"]);
        assert_eq!(a.endpoint(), Ok(("node0".into(), None)));
        let a = parse(&["--rdzv-endpoint", "localhost:0", "t.py"]);
        assert_eq!(
            a.endpoint(),
            Ok(("localhost".into(), None)),
            "port 0: any free one"
        );
        let a = parse(&["--rdzv-endpoint", "node0:x", "t.py"]);
        assert!(a.endpoint().is_err());
        let a = parse(&["--nnodes", "2:3", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::NeedsEtcd(_))));
        let a = parse(&["--spare", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::NeedsEtcd(_))));
        let a = parse(&["--rdzv-backend", "etcd", "t.py"]);
        assert_eq!(a.validate(), Err(ArgsError::NoEtcdEndpoint));
        let a = parse(&["--rdzv-backend", "zookeeper", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::Backend(_))));
        let a = parse(&["--max-cordon-share", "0.25", "t.py"]);
        assert!(matches!(a.validate(), Err(ArgsError::NeedsEtcd(f)) if f == "--max-cordon-share"));
        assert_eq!(parse(&["t.py"]).max_cordon_share, 1.0, "no cap by default");
        assert!(Wrap::try_parse_from(["run", "--max-cordon-share", "1.5", "t.py"]).is_err());
        assert!(Wrap::try_parse_from(["run", "--max-cordon-share", "x", "t.py"]).is_err());
        assert_eq!(
            parse(&["--nnodes", "4", "t.py"]).nnodes,
            NNodes { min: 4, max: 4 }
        );
    }

    #[test]
    fn standbys_are_on_for_python_entrypoints_unless_turned_off() {
        let p = parse(&["t.py", "-x"]).standby_plan().unwrap();
        assert_eq!(p.entry.args, ["t.py", "-x"]);
        assert_eq!(
            p.preload,
            "torch?,torch.distributed?,torch.nn.parallel?,torch._dynamo?"
        );
        let p = parse(&["--preload", "numpy,a.b", "-m", "pkg.train"])
            .standby_plan()
            .unwrap();
        assert_eq!(p.entry.args, ["-m", "pkg.train"]);
        assert!(
            p.preload.ends_with("torch._dynamo?,numpy,a.b"),
            "{}",
            p.preload
        );
        assert!(parse(&["--no-standby", "t.py"]).standby_plan().is_none());
        assert!(
            parse(&["--no-standby", "--standby", "t.py"])
                .standby_plan()
                .is_some()
        );
        assert!(parse(&["bash", "job.sh"]).standby_plan().is_none());
        assert!(parse(&["--no-python", "t.py"]).standby_plan().is_none());
        assert_eq!(parse(&["t.py"]).standby_plan().unwrap().count, None);
        assert_eq!(
            parse(&["--standbys", "2", "t.py"])
                .standby_plan()
                .unwrap()
                .count,
            Some(2)
        );
        assert!(parse(&["--standbys", "0", "t.py"]).standby_plan().is_none());
        assert!(Wrap::try_parse_from(["run", "--standbys", "-1", "t.py"]).is_err());
        assert!(Wrap::try_parse_from(["run", "--no-standby", "--standbys", "2", "t.py"]).is_err());
    }

    #[test]
    fn jax_flags_win_over_detection() {
        // t.py does not exist here: detection finds nothing.
        assert!(!parse(&["t.py"]).jax_job());
        assert!(parse(&["--jax", "t.py"]).jax_job());
        assert!(!parse(&["--jax", "--no-jax", "t.py"]).jax_job());
        assert!(parse(&["--no-jax", "--jax", "t.py"]).jax_job());
    }

    #[test]
    fn etcd_flags_parse_and_validate() {
        let a = parse(&[
            "--nnodes",
            "1:3",
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            "etcd-1:2379, http://etcd-2:2380,etcd-3,[::1],[::1]:23",
            "--rdzv-conf",
            "join_timeout=30,last_call_timeout=0.5,read_timeout=60",
            "--host-id",
            "node-a",
            "--advertise-addr",
            "10.0.0.7",
            "--spare",
            "--rdzv-lease-ttl",
            "2s",
            "--node-rank",
            "5",
            "t.py",
        ]);
        assert_eq!(a.validate(), Ok(()), "--node-rank is the rounds' with etcd");
        assert!(a.is_etcd() && a.spare);
        assert_eq!(
            a.etcd_endpoints(),
            [
                "etcd-1:2379",
                "http://etcd-2:2380",
                "etcd-3:2379",
                "[::1]:2379",
                "[::1]:23"
            ]
        );
        assert_eq!(a.rdzv_conf.join_timeout(), Duration::from_secs(30));
        assert_eq!(a.rdzv_conf.last_call, Some(Duration::from_millis(500)));
        assert_eq!(a.rdzv_conf.ignored, ["read_timeout"]);
        assert_eq!(a.rdzv_lease_ttl, Duration::from_secs(2));
        let bad = |extra: &[&str]| {
            let mut v = vec!["--rdzv-backend", "etcd", "--rdzv-endpoint", "e:1"];
            v.extend_from_slice(extra);
            v.push("t.py");
            parse(&v).validate()
        };
        assert!(matches!(
            bad(&["--rdzv-lease-ttl", "1500ms"]),
            Err(ArgsError::LeaseTtl(_))
        ));
        assert!(matches!(
            bad(&["--host-id", "a/b"]),
            Err(ArgsError::HostId(_))
        ));
        assert!(matches!(
            bad(&["--standalone"]),
            Err(ArgsError::Standalone(_))
        ));
        assert_eq!(bad(&[]), Ok(()));
    }
}
