//! The agent the launcher works with: the host's wardend when one answers,
//! else one embedded in the launcher's own process on a private socket (the
//! single-host default: nothing else to install or start).
//!
//! Also the two streams the supervisor follows: the agent's events about
//! the job's ranks (registrations and exits, by pid: when the workers of an
//! attempt are registered, when a zombie may be reaped) and its decided
//! incidents (WatchIncidents). Both reconnect when the agent restarts: the
//! agent dying is not the job dying.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use super::args::AgentMode;
use crate::connect::Target;
use warden_agent::config::Config;
use warden_agent::daemon::DaemonError;

/// How long a wardend has to answer GetAgentInfo before the launcher
/// embeds its own.
const PROBE: Duration = Duration::from_secs(1);
/// How long an embedded agent may take to serve.
const EMBED_START: Duration = Duration::from_secs(15);
/// Pause before reconnecting a stream to an agent that went away.
const RECONNECT: Duration = Duration::from_millis(500);

/// Why the launcher has no agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// `--agent local` and none answers.
    #[error(
        "no wardend answers at {0} (--agent local); start it, or leave --agent at auto to embed one"
    )]
    NoLocal(String),
    /// `--socket`/`--addr` named a TCP address: workers need the Unix socket.
    #[error(
        "warden run needs the agent's Unix socket (workers register over it); --addr {0} is TCP"
    )]
    Tcp(String),
    /// The embedded agent's config is invalid.
    #[error("--agent-config: {0}")]
    Config(#[from] warden_core::config::ConfigError),
    /// The embedded agent could not be set up.
    #[error("cannot set up the embedded agent in {dir}: {source}")]
    Dir {
        /// Its runtime directory.
        dir: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The embedded agent failed to start.
    #[error("the embedded agent did not start: {0}")]
    Embedded(String),
}

/// The agent in use.
#[derive(Debug)]
pub struct AgentLink {
    /// Its Unix socket (what the workers get as WARDEN_SOCKET).
    pub socket: PathBuf,
    /// A client (cheap to clone).
    pub client: AgentClient<Channel>,
    /// Its effective config (policy budgets for the launcher's own
    /// fallback, the NVML library).
    pub config: Config,
    /// Local or embedded.
    pub kind: Kind,
    /// Where the agent's TCP listener actually is (`api.tcp`, its port
    /// resolved); empty when it has none. The job's other hosts reach its
    /// checkpoint tier there.
    pub tcp: String,
    /// What it says it takes (GetAgentInfo's `capabilities`; none from an
    /// older agent): published for the job's other hosts where a job-wide
    /// behaviour needs every agent to take it.
    pub capabilities: Vec<String>,
}

/// Which agent it is.
#[derive(Debug)]
pub enum Kind {
    /// The host's wardend.
    Local {
        /// Its pid.
        pid: u32,
        /// Its version.
        version: String,
    },
    /// One running in this process.
    Embedded(Embedded),
}

/// An agent running inside the launcher.
#[derive(Debug)]
pub struct Embedded {
    token: CancellationToken,
    task: JoinHandle<Result<(), DaemonError>>,
    runtime_dir: PathBuf,
    /// Where it keeps its state (incident journal, calibrations).
    pub state_dir: PathBuf,
}

impl AgentLink {
    /// Finds or starts the agent, as `mode` says. `target` is where a
    /// wardend would answer; `state_dir` is the embedded agent's default
    /// state directory.
    pub async fn open(
        mode: AgentMode,
        target: &Target,
        agent_config: Option<&Path>,
        state_dir: &Path,
    ) -> Result<Self, AgentError> {
        let socket = match target {
            Target::Unix(p) => p.clone(),
            Target::Tcp(a) => return Err(AgentError::Tcp(a.clone())),
        };
        if mode != AgentMode::Embedded {
            if let Some((client, info)) = probe(&socket).await {
                // A config this launcher cannot read (an agent of another
                // release, a key it does not know) is said, not silently
                // replaced: the defaults then stand for what is read from
                // it (the policy's budgets, the checkpoint and TLS setup).
                let (config, read) = match Config::from_toml(&info.config_toml, "the local wardend")
                {
                    Ok(c) => (c, true),
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            version = %info.version,
                            "cannot read the local wardend's config: its defaults stand in for it"
                        );
                        (Config::default(), false)
                    }
                };
                let tcp = tcp_endpoint(&info, &config);
                // A replica count this launcher could not read is not
                // published as the defaults' (the job's most would be
                // understated): the agent is taken as not judging by it.
                let capabilities = info
                    .capabilities
                    .iter()
                    .filter(|c| read || *c != warden_agent::JOB_REPLICAS)
                    .cloned()
                    .collect();
                return Ok(Self {
                    socket,
                    client,
                    config,
                    tcp,
                    capabilities,
                    kind: Kind::Local {
                        pid: info.pid,
                        version: info.version,
                    },
                });
            }
            if mode == AgentMode::Local {
                return Err(AgentError::NoLocal(socket.display().to_string()));
            }
        }
        embed(agent_config, state_dir).await
    }

    /// Whether the agent says it takes `capability` (e.g.
    /// [`warden_agent::RING_BY_PLACE`]).
    pub fn takes(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }

    /// One line saying which agent is used.
    pub fn describe(&self) -> String {
        match &self.kind {
            Kind::Local { pid, version } => format!(
                "using the local wardend {version} (pid {pid}) at {}",
                self.socket.display()
            ),
            Kind::Embedded(e) => format!(
                "no wardend answers on this host: running the agent embedded in this launcher (socket {}, state {})",
                self.socket.display(),
                e.state_dir.display()
            ),
        }
    }

    /// A few words for the summary.
    pub fn label(&self) -> String {
        match &self.kind {
            Kind::Local { pid, .. } => format!("agent: the local wardend (pid {pid})"),
            Kind::Embedded(_) => "agent: embedded in the launcher".to_owned(),
        }
    }

    /// True when the agent runs in this process.
    pub fn is_embedded(&self) -> bool {
        matches!(self.kind, Kind::Embedded(_))
    }

    /// Stops an embedded agent cleanly (its shutdown token; in-flight calls
    /// get its shutdown grace) and removes its runtime directory.
    pub async fn close(self) {
        if let Kind::Embedded(e) = self.kind {
            e.token.cancel();
            let bound = self.config.agent.shutdown_grace + Duration::from_secs(2);
            match tokio::time::timeout(bound, e.task).await {
                Ok(Ok(Err(err))) => {
                    tracing::warn!(error = %err, "embedded agent stopped with an error")
                }
                Err(_) => tracing::warn!("embedded agent did not stop in time"),
                _ => {}
            }
            let _ = std::fs::remove_dir_all(&e.runtime_dir);
        }
    }
}

/// How often the job's checkpoint peers are handed to the agent again
/// while they stay the same: an agent restarted mid-job has them back
/// within this.
const PEERS_AGAIN: Duration = Duration::from_secs(10);
/// How often the launcher renews its claim on the job: an agent forgets a
/// claim unused for 7 days (`authz::OWNER_IDLE`), and a long job may make
/// no other call that renews it.
const CLAIM_AGAIN: Duration = Duration::from_secs(3600);
/// How long ClaimJob may take.
const CLAIM_TIMEOUT: Duration = Duration::from_secs(10);

pub use crate::hosts::CkptPeers;

/// The most bytes of peers one `SetCheckpointPeers` request carries: half
/// the agent's 4 MiB request limit (about 25,000 peers of ordinary names;
/// 4,000 of names as long as allowed). A longer list goes in pages.
const PEERS_PAGE_BYTES: usize = 2 << 20;

/// What the agent answered to a round's checkpoint peers.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PeersTaken {
    /// The addresses that now hold this host's replicas of the job.
    pub targets: Vec<String>,
    /// What the agent says about this host at the job's size (empty: nothing).
    pub warning: String,
}

/// The job's checkpoint peers as requests of at most [`PEERS_PAGE_BYTES`]
/// of peers each: one request (no paging fields) when the list fits, as
/// an older agent expects; else pages 0 .. n-1 of one list. Each says this
/// host's place in the job's order (`self_place`), the order's length
/// (`job_hosts`) and each peer's place in it, which an older agent
/// ignores: `others` is the whole order less this host, so the peer at
/// index i stands at i before this host's place and at i + 1 after it.
pub fn peer_pages(
    job: &str,
    peers: &CkptPeers,
    list_id: u64,
) -> Vec<pb::SetCheckpointPeersRequest> {
    use prost::Message as _;
    let mut pages: Vec<Vec<pb::CheckpointPeer>> = vec![Vec::new()];
    let mut bytes = 0;
    for (i, (host, p)) in peers.others.iter().enumerate() {
        let i = u32::try_from(i).unwrap_or(u32::MAX);
        let place = match peers.place {
            Some(mine) if i >= mine => i.saturating_add(1),
            _ => i,
        };
        let peer = pb::CheckpointPeer {
            addr: p.addr.clone(),
            domain: p.domain.clone(),
            host: host.clone(),
            identity: p.identity.clone(),
            place,
        };
        let len = peer.encoded_len() + 4;
        if bytes + len > PEERS_PAGE_BYTES && bytes > 0 {
            pages.push(Vec::new());
            bytes = 0;
        }
        bytes += len;
        if let Some(last) = pages.last_mut() {
            last.push(peer);
        }
    }
    let n = u32::try_from(pages.len()).unwrap_or(u32::MAX);
    let self_place = peers.place.map_or(0, |p| p.saturating_add(1));
    // Past what an agent takes as an order's length, not said: the agent
    // then takes the list as the order, as from a launcher before it.
    let job_hosts = u32::try_from(peers.others.len())
        .unwrap_or(u32::MAX)
        .saturating_add(u32::from(peers.place.is_some()));
    let job_hosts = if job_hosts > warden_agent::ckpt::job_peers::MAX_JOB_HOSTS {
        0
    } else {
        job_hosts
    };
    let ring_by_place = peers.ring_by_place;
    // A round's count past what an agent takes (a hand-written record, a
    // later release's) would have the whole list refused.
    let replicas = peers
        .replicas
        .min(u32::try_from(warden_agent::ckpt::config::MAX_REPLICAS).unwrap_or(u32::MAX));
    let self_addr = if peers.place.is_some() {
        peers.addr.clone()
    } else {
        String::new()
    };
    pages
        .into_iter()
        .enumerate()
        .map(|(i, peers)| pb::SetCheckpointPeersRequest {
            job_id: job.to_owned(),
            peers,
            page: if n > 1 {
                u32::try_from(i).unwrap_or(u32::MAX)
            } else {
                0
            },
            pages: if n > 1 { n } else { 0 },
            list_id: if n > 1 { list_id } else { 0 },
            self_place,
            self_addr: self_addr.clone(),
            job_hosts,
            ring_by_place,
            replicas,
        })
        .collect()
}

/// How long one `SetCheckpointPeers` request may take: two seconds, plus
/// one for every [`PEERS_A_SECOND`] peers the agent handles in it (the
/// page's; at the last page the whole list's, which the agent then sets:
/// a client per peer, the ring, the exchange's and the restore's fan-in),
/// at most [`PAGE_DEADLINE_MAX`]. A fixed two seconds was short for a
/// 16,384-host list on a loaded machine. The peers go again every 10 s
/// ([`keep_peers`]) when a hand-over fails.
pub fn page_deadline(page_peers: usize, list_peers: Option<usize>) -> Duration {
    let peers = page_peers.max(list_peers.unwrap_or(0));
    let extra = u32::try_from(peers / PEERS_A_SECOND).unwrap_or(u32::MAX);
    (PROBE * 2)
        .saturating_add(Duration::from_secs(1).saturating_mul(extra))
        .min(PAGE_DEADLINE_MAX)
}

/// Peers an agent is given a second for in [`page_deadline`]: about a
/// tenth of what a debug agent handles a second on an idle core (16,384
/// long-named peers in under a second), a tenfold margin.
const PEERS_A_SECOND: usize = 2_048;

/// The most one `SetCheckpointPeers` request waits ([`page_deadline`]):
/// what a hung agent costs a round's start, per page (a signal ends the
/// wait at once).
const PAGE_DEADLINE_MAX: Duration = Duration::from_secs(30);

/// Hands the job's checkpoint peers to the agent (`SetCheckpointPeers`,
/// in pages when the list is longer than one request may be), waiting at
/// most [`page_deadline`] a request. Called before a round's workers
/// start, so their first restore already asks the round's other agents;
/// an agent that does not take them is logged and costs the job nothing.
pub async fn set_peers(
    client: &AgentClient<Channel>,
    job: &str,
    peers: &CkptPeers,
) -> Result<PeersTaken, String> {
    let list_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
        ^ u64::from(std::process::id());
    let requests = peer_pages(job, peers, list_id);
    let n = requests.len();
    let mut c = client.clone();
    let mut taken = PeersTaken::default();
    let total = peers.others.len();
    for (i, req) in requests.into_iter().enumerate() {
        let wait = page_deadline(req.peers.len(), (i + 1 == n).then_some(total));
        let r = match tokio::time::timeout(wait, c.set_checkpoint_peers(req)).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(e)) if n > 1 => return Err(format!("page {} of {n}: {}", i + 1, e.message())),
            Ok(Err(e)) => return Err(e.message().to_owned()),
            Err(_) if n > 1 => {
                return Err(format!("page {} of {n}: no answer within {wait:?}", i + 1));
            }
            Err(_) => return Err(format!("no answer within {wait:?}")),
        };
        taken = PeersTaken {
            targets: r.targets,
            warning: r.warning,
        };
    }
    Ok(taken)
}

/// Tells the agent the launcher ended the job by its own rule
/// (`ReportJobStop`), waiting at most two seconds; the incident's id, or
/// why the agent was not told. The stop stands either way: the caller says
/// so and exits with its status.
pub async fn report_job_stop(
    client: &AgentClient<Channel>,
    job: &str,
    stop: &crate::machine::RuleStop,
) -> Result<String, String> {
    use crate::rule_stop::StopRule;
    let req = pb::ReportJobStopRequest {
        job_id: job.to_owned(),
        reason: match stop.rule {
            StopRule::NoProgress => pb::JobStopReason::NoProgress,
            StopRule::CordonShare => pb::JobStopReason::CordonShare,
        } as i32,
        summary: stop.summary.clone(),
        exit_code: stop.exit_code,
        limit: stop.limit.clone(),
        evidence: stop
            .evidence
            .iter()
            .map(|e| pb::JobStopEvidence {
                subject: e.subject.clone(),
                signal: e.signal.clone(),
                value: e.value.clone(),
                note: e.note.clone(),
            })
            .collect(),
        incident_id: stop.incident.clone().unwrap_or_default(),
    };
    let mut c = client.clone();
    match tokio::time::timeout(PROBE * 2, c.report_job_stop(req)).await {
        Ok(Ok(r)) => Ok(r.into_inner().incident_id),
        Ok(Err(e)) => Err(e.message().to_owned()),
        Err(_) => Err(format!("no answer within {:?}", PROBE * 2)),
    }
}

/// Claims `job` for this launcher's user at the agent (ClaimJob), before
/// anything of the job starts. Another user's job id is the end of the
/// launcher ([`crate::exit::EXIT_JOB_OWNED`]), with the agent's words:
/// who owns it and the way out. An agent from before ClaimJob, or one that
/// does not answer, is said on the console and the job goes on: the agent
/// still refuses another user's calls about a job the launcher's workers
/// registered first. Returns this user's compilation cache folder in the
/// agent's tier, when the agent gave one.
pub async fn claim(
    client: &AgentClient<Channel>,
    job: &str,
    console: &crate::output::Console,
) -> Result<Option<std::path::PathBuf>, crate::LauncherError> {
    let mut c = client.clone();
    let asked = c.claim_job(pb::ClaimJobRequest {
        job_id: job.to_owned(),
    });
    match tokio::time::timeout(CLAIM_TIMEOUT, asked).await {
        Ok(Ok(r)) => {
            let dir = r.into_inner().compile_cache_dir;
            Ok((!dir.is_empty()).then(|| std::path::PathBuf::from(dir)))
        }
        Ok(Err(e)) if e.code() == tonic::Code::PermissionDenied => Err(
            crate::LauncherError::JobOwned(format!("cannot run job {job:?}: {}", e.message())),
        ),
        Ok(Err(e)) if e.code() == tonic::Code::Unimplemented => {
            console.say(format!(
                "warning: this agent predates ClaimJob: job {job:?} is not claimed for this user before its workers start"
            ));
            Ok(None)
        }
        Ok(Err(e)) => {
            console.say(format!(
                "warning: could not claim job {job:?} at the agent: {}; going on (the agent refuses other users' calls about a job once it is owned)",
                e.message()
            ));
            Ok(None)
        }
        Err(_) => {
            console.say(format!(
                "warning: the agent did not answer ClaimJob for {job:?} within {}; going on",
                humantime::format_duration(CLAIM_TIMEOUT)
            ));
            Ok(None)
        }
    }
}

/// Whether the agent still takes `job` as this launcher user's: asks
/// ClaimJob again and answers the agent's words when another user owns it.
/// A refusal of something else about the job (a worker's registration the
/// agent could not match to this launcher, as across PID namespaces) is
/// not a lost claim: only this answer says whose the job is. An agent that
/// does not answer, or predates ClaimJob, leaves the job its owner's.
pub async fn owned_by_another(client: &AgentClient<Channel>, job: &str) -> Option<String> {
    let mut c = client.clone();
    let asked = c.claim_job(pb::ClaimJobRequest {
        job_id: job.to_owned(),
    });
    match tokio::time::timeout(CLAIM_TIMEOUT, asked).await {
        Ok(Err(e)) if e.code() == tonic::Code::PermissionDenied => Some(e.message().to_owned()),
        _ => None,
    }
}

/// Renews the claim on `job` every [`CLAIM_AGAIN`] until `stop`. A claim
/// refused (an admin released the job and another user took the id) goes
/// to `disowned`, once: the job then stops (the agent already sends this
/// launcher no decision about a job it does not own).
pub fn keep_claim(
    client: AgentClient<Channel>,
    job: String,
    disowned: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(CLAIM_AGAIN) => {}
            }
            let mut c = client.clone();
            let asked = c.claim_job(pb::ClaimJobRequest {
                job_id: job.clone(),
            });
            if let Ok(Err(e)) = tokio::time::timeout(CLAIM_TIMEOUT, asked).await
                && e.code() == tonic::Code::PermissionDenied
            {
                let _ = disowned.send(format!("renewing the claim was refused: {}", e.message()));
                return;
            }
        }
    })
}

/// Hands the current round's checkpoint peers to the agent again every
/// [`PEERS_AGAIN`], whether the last hand-over failed or not: an agent
/// restarted mid-job forgets them. The launcher's rendezvous hands each new
/// round's over itself ([`set_peers`]) and updates `peers`.
pub fn keep_peers(
    client: AgentClient<Channel>,
    job: String,
    mut peers: watch::Receiver<CkptPeers>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                r = peers.changed() => if r.is_err() { return },
                () = tokio::time::sleep(PEERS_AGAIN) => {
                    let now = peers.borrow().clone();
                    if !now.is_empty()
                        && let Err(e) = set_peers(&client, &job, &now).await
                    {
                        tracing::debug!(job, error = %e,
                            "launcher: the agent did not take the job's checkpoint peers; asking again");
                    }
                }
            }
        }
    })
}

/// The agent's TCP listener as it reports it (port resolved), else as
/// configured; empty when it has none.
fn tcp_endpoint(info: &pb::AgentInfo, config: &Config) -> String {
    info.endpoints
        .iter()
        .find(|e| e.kind == "tcp")
        .map_or_else(|| config.api.tcp.clone(), |e| e.address.clone())
}

async fn probe(socket: &Path) -> Option<(AgentClient<Channel>, pb::AgentInfo)> {
    if !socket.exists() {
        return None;
    }
    tokio::time::timeout(PROBE, async {
        let mut c = Target::Unix(socket.to_owned()).connect().await.ok()?;
        let info = c
            .get_agent_info(pb::GetAgentInfoRequest {})
            .await
            .ok()?
            .into_inner();
        Some((c, info))
    })
    .await
    .ok()
    .flatten()
}

/// A private runtime directory: `$XDG_RUNTIME_DIR/warden/run-<pid>`, else
/// `/tmp/warden-<uid>/run-<pid>` (short: a socket path holds 108 bytes).
fn private_runtime_dir() -> PathBuf {
    let pid = std::process::id();
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("warden").join(format!("run-{pid}")),
        None => PathBuf::from(format!(
            "/tmp/warden-{}/run-{pid}",
            nix::unistd::geteuid().as_raw()
        )),
    }
}

async fn embed(agent_config: Option<&Path>, state_dir: &Path) -> Result<AgentLink, AgentError> {
    let (mut config, source) = match agent_config {
        Some(p) => {
            let mut c = Config::from_file(p)?;
            if !names_metrics_listen(p) {
                c.metrics.listen.clear();
            }
            (c, p.display().to_string())
        }
        None => {
            let mut c = Config::default();
            c.metrics.listen.clear();
            (c, "embedded defaults (warden run)".to_owned())
        }
    };
    let runtime_dir = private_runtime_dir();
    let dir_err = |source| AgentError::Dir {
        dir: runtime_dir.display().to_string(),
        source,
    };
    let socket = runtime_dir.join(warden_client::paths::SOCKET_NAME);
    config.api.socket = socket.display().to_string();
    if config.agent.state_dir.is_empty() {
        config.agent.state_dir = state_dir.display().to_string();
    }
    config.validate(&source)?;
    // A `[simulated]` scenario is read now, as wardend reads it before it
    // serves: the agent reads it again only once its socket answers, and
    // a job must not start on an agent whose sources then failed.
    config
        .simulated
        .load()
        .map_err(|e| AgentError::Embedded(format!("invalid scenario: {e}")))?;
    std::fs::create_dir_all(&runtime_dir).map_err(dir_err)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&runtime_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(dir_err)?;
    }
    let token = CancellationToken::new();
    let mut task = tokio::spawn(warden_agent::daemon::run_embedded(
        config.clone(),
        source,
        token.clone(),
    ));
    let deadline = Instant::now() + EMBED_START;
    loop {
        if let Some((client, info)) = probe(&socket).await {
            let tcp = tcp_endpoint(&info, &config);
            return Ok(AgentLink {
                socket,
                client,
                tcp,
                capabilities: info.capabilities,
                kind: Kind::Embedded(Embedded {
                    token,
                    task,
                    runtime_dir,
                    state_dir: config.state_dir(),
                }),
                config,
            });
        }
        if task.is_finished() {
            let why = match (&mut task).await {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(())) => "it stopped at once".to_owned(),
                Err(e) => e.to_string(),
            };
            let _ = std::fs::remove_dir_all(&runtime_dir);
            return Err(AgentError::Embedded(why));
        }
        if Instant::now() > deadline {
            token.cancel();
            let _ = std::fs::remove_dir_all(&runtime_dir);
            return Err(AgentError::Embedded(format!(
                "not serving after {}",
                humantime::format_duration(EMBED_START)
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether the config file sets `metrics.listen` itself. Nothing of an
/// embedded agent listens beyond its private socket unless asked: two
/// launchers on one host must not fight over the default metrics port.
fn names_metrics_listen(path: &Path) -> bool {
    warden_core::named_file::read_to_string(path, warden_core::named_file::CONFIG_CAP)
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
        .and_then(|t| t.get("metrics")?.as_table()?.get("listen").cloned())
        .is_some()
}

/// What the agent said about the job's processes, by pid.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Registered pids: their global rank and when the launcher heard.
    pub registered: HashMap<u32, (u32, Instant)>,
    /// Pids whose exit the agent reported, or that left cleanly
    /// (deregistered: the agent no longer watches them).
    pub exited: HashSet<u32>,
    /// Pids that registered themselves (their client reports its own
    /// exceptions), not only through the launcher.
    pub self_registered: HashSet<u32>,
    /// Pids that deregistered cleanly (their client closed: the training
    /// ended), whatever became of the process after.
    pub deregistered: HashSet<u32>,
    /// The host's own notice of a coming stop (GCE, EC2, a taint), as the
    /// agent told the job's ranks of it (its `notice.raised` event): the
    /// launcher tells the job's other hosts at once, before any rank here
    /// left on it. None until one comes; the first stays.
    pub host_notice: Option<HostNotice>,
}

/// A notice the agent raised from one of the host's own sources, as its
/// `notice.raised` event about the job says it. Events come from the agent
/// alone (no caller can publish one), and the event's source is the
/// agent's own: a launcher's notice (source `launcher`) is not one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNotice {
    /// The source (`gce`, `aws`, `kubernetes`).
    pub source: String,
    /// What it said (`instance/preempted = TRUE`), clipped by the agent.
    pub what: String,
    /// The step at whose boundary the job's ranks here save.
    pub step: u64,
    /// When the stop comes (None: the source did not say).
    pub deadline: Option<std::time::SystemTime>,
}

impl HostNotice {
    /// From an agent event: a `notice.raised` about `job` (subject
    /// `job/<job>`) whose source is the host's. None for anything else.
    pub fn from_event(e: &pb::Event, job: &str) -> Option<Self> {
        if e.kind != "notice.raised" || e.subject.strip_prefix("job/") != Some(job) {
            return None;
        }
        let get = |key: &str| {
            e.evidence
                .iter()
                .find(|kv| kv.key == key)
                .map(|kv| kv.value.as_str())
        };
        let source = get("source")?;
        if !matches!(source, "gce" | "aws" | "kubernetes") {
            return None;
        }
        let step = get("save_at_step")?.parse().ok()?;
        let deadline = get("deadline_unix_ms")
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|ms| *ms != 0)
            .and_then(|ms| std::time::UNIX_EPOCH.checked_add(Duration::from_millis(ms)));
        Some(Self {
            source: source.to_owned(),
            what: get("what").unwrap_or_default().to_owned(),
            step,
            deadline,
        })
    }
}

/// Follows the agent's events about `job`'s ranks. The first stream is open
/// when this returns (so no registration of a worker spawned after is
/// missed); later ones resume after the last event seen.
pub async fn watch_ranks(
    client: AgentClient<Channel>,
    job: String,
    stop: CancellationToken,
) -> watch::Receiver<Seen> {
    let (tx, rx) = watch::channel(Seen::default());
    let mut c = client.clone();
    let first = c
        .watch_events(pb::WatchEventsRequest { after_id: None })
        .await
        .ok()
        .map(tonic::Response::into_inner);
    tokio::spawn(async move {
        let prefix = format!("job/{job}/rank/");
        let mut last: Option<u64> = None;
        let mut stream = first;
        loop {
            if let Some(s) = stream.as_mut() {
                loop {
                    let next = tokio::select! {
                        () = stop.cancelled() => return,
                        () = tx.closed() => return,
                        n = s.next() => n,
                    };
                    let Some(Ok(e)) = next else { break };
                    last = Some(e.id);
                    if let Some(n) = HostNotice::from_event(&e, &job) {
                        tx.send_if_modified(|s| {
                            let first = s.host_notice.is_none();
                            if first {
                                s.host_notice = Some(n);
                            }
                            first
                        });
                        continue;
                    }
                    let Some(rank) = e
                        .subject
                        .strip_prefix(&prefix)
                        .and_then(|r| r.parse::<u32>().ok())
                    else {
                        continue;
                    };
                    // The worker's own pid (declared_pid: its number in this
                    // launcher's PID namespace) over the agent's (pid: the
                    // number in the agent's namespace, which differs under a
                    // node agent with the host's PID namespace).
                    let number = |key: &str| {
                        e.evidence
                            .iter()
                            .find(|kv| kv.key == key)
                            .and_then(|kv| kv.value.parse::<u32>().ok())
                            .filter(|p| *p != 0)
                    };
                    let pid = number("declared_pid").or_else(|| number("pid"));
                    if e.kind == "rank.deregistered" {
                        // No pid in it: the rank's newest registration's.
                        tx.send_modify(|s| {
                            let newest = s
                                .registered
                                .iter()
                                .filter(|(_, (r, _))| *r == rank)
                                .max_by_key(|(_, (_, at))| *at)
                                .map(|(p, _)| *p);
                            if let Some(p) = newest {
                                s.exited.insert(p);
                                s.deregistered.insert(p);
                            }
                        });
                        continue;
                    }
                    let Some(pid) = pid else { continue };
                    match e.kind.as_str() {
                        "rank.registered" => tx.send_modify(|s| {
                            let by_self = !e
                                .evidence
                                .iter()
                                .any(|kv| kv.key == "registered_by" && kv.value == "launcher");
                            if by_self {
                                s.self_registered.insert(pid);
                            }
                            s.registered.insert(pid, (rank, Instant::now()));
                        }),
                        "rank.exited" => tx.send_modify(|s| {
                            s.exited.insert(pid);
                        }),
                        _ => {}
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(RECONNECT) => {}
            }
            let mut c = client.clone();
            stream = c
                .watch_events(pb::WatchEventsRequest { after_id: last })
                .await
                .ok()
                .map(tonic::Response::into_inner);
        }
    });
    rx
}

/// Follows the agent's decided incidents about `job` (WatchIncidents, with
/// the retained ones replayed on every connection: the receiver keys them
/// by incident and revision).
pub fn watch_decisions(
    client: AgentClient<Channel>,
    job: String,
    stop: CancellationToken,
) -> mpsc::Receiver<pb::Incident> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let mut c = client.clone();
            let stream = c
                .watch_incidents(pb::WatchIncidentsRequest {
                    job_id: job.clone(),
                    replay: true,
                })
                .await
                .ok()
                .map(tonic::Response::into_inner);
            if let Some(mut s) = stream {
                loop {
                    let next = tokio::select! {
                        () = stop.cancelled() => return,
                        () = tx.closed() => return,
                        n = s.next() => n,
                    };
                    let Some(Ok(inc)) = next else { break };
                    if tx.send(inc).await.is_err() {
                        return;
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(RECONNECT) => {}
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    fn peers(n: usize, name_len: usize) -> CkptPeers {
        let others = (0..n)
            .map(|i| {
                let name = format!("{i:0>name_len$}");
                (
                    name.clone(),
                    crate::coord::CkptPeer {
                        addr: format!("10.{}.{}.{}:7411", i >> 16, (i >> 8) & 255, i & 255),
                        domain: name.clone(),
                        identity: name,
                    },
                )
            })
            .collect();
        CkptPeers {
            others,
            place: Some(1),
            addr: "10.9.9.9:7411".into(),
            ring_by_place: false,
            replicas: 0,
            window: 0,
        }
    }

    #[test]
    fn a_page_waits_longer_for_more_peers_and_the_last_for_the_whole_list() {
        // A small job keeps the old two seconds.
        assert_eq!(page_deadline(8, Some(8)), Duration::from_secs(2));
        // A page of 4,096 peers: two more.
        assert_eq!(page_deadline(4_096, None), Duration::from_secs(4));
        // The last page of a 16,384-host list: the agent sets them all.
        assert_eq!(page_deadline(1_000, Some(16_384)), Duration::from_secs(10));
        // A one-page list is not counted twice.
        assert_eq!(page_deadline(16_384, Some(16_384)), Duration::from_secs(10));
        // A caller's absurd count saturates, and a wait is bounded.
        assert_eq!(
            page_deadline(usize::MAX, Some(usize::MAX)),
            PAGE_DEADLINE_MAX
        );
    }

    #[test]
    fn a_list_that_fits_goes_in_one_request_without_paging_fields() {
        let r = peer_pages("j", &peers(2_048, 12), 9);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].page, r[0].pages, r[0].list_id), (0, 0, 0));
        assert_eq!(r[0].peers.len(), 2_048);
        assert_eq!(r[0].self_place, 2, "this host's place, plus one");
        assert_eq!(r[0].self_addr, "10.9.9.9:7411");
        // The order's length and each peer's place in it: this host at 1,
        // so the peers stand at 0, then 2 on.
        assert_eq!(r[0].job_hosts, 2_049);
        let places: Vec<u32> = r[0].peers.iter().map(|p| p.place).collect();
        let want: Vec<u32> = [0].into_iter().chain(2..2_049).collect();
        assert_eq!(places, want);
        // A host whose agent takes no replicas is not in the order.
        let outside = CkptPeers {
            place: None,
            ..peers(3, 4)
        };
        let r = peer_pages("j", &outside, 9);
        assert_eq!((r[0].self_place, r[0].job_hosts), (0, 3));
        assert!(!r[0].ring_by_place);
        let by_place = CkptPeers {
            ring_by_place: true,
            ..peers(3, 4)
        };
        assert!(peer_pages("j", &by_place, 9)[0].ring_by_place);
        assert_eq!(r[0].replicas, 0, "not said");
        let most = CkptPeers {
            replicas: 3,
            ..peers(3, 4)
        };
        assert!(peer_pages("j", &most, 2).iter().all(|p| p.replicas == 3));
        let past = CkptPeers {
            replicas: 40,
            ..peers(3, 4)
        };
        assert_eq!(
            peer_pages("j", &past, 2)[0].replicas,
            16,
            "what an agent takes"
        );
        assert_eq!(
            r[0].peers.iter().map(|p| p.place).collect::<Vec<_>>(),
            [0, 1, 2]
        );
    }

    #[test]
    fn a_long_list_goes_in_pages_under_the_agents_request_limit_in_order() {
        // 16,384 hosts with names of 128 characters: about 7 MB.
        let all = peers(16_384, 128);
        let r = peer_pages("j", &all, 9);
        assert!(r.len() >= 3, "{} pages", r.len());
        for (i, req) in r.iter().enumerate() {
            assert_eq!(
                (req.page, req.pages, req.list_id, req.self_place),
                (i as u32, r.len() as u32, 9, 2)
            );
            assert!(
                req.encoded_len() < 4 << 20,
                "page {i}: {} bytes",
                req.encoded_len()
            );
        }
        let hosts: Vec<&str> = r
            .iter()
            .flat_map(|q| q.peers.iter().map(|p| p.host.as_str()))
            .collect();
        let want: Vec<&str> = all.others.iter().map(|(h, _)| h.as_str()).collect();
        assert_eq!(hosts, want);
    }
}
