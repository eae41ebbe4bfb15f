//! The state every part of the running agent shares.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::ranks::registry::{Registry, SharedRegistry};
use warden_core::attribute::store::IncidentStore;
use warden_core::events::EventBus;
use warden_core::health::{ComponentReport, HealthModel};

/// Shared by the API, the work loop and the sources (behind an `Arc`).
#[derive(Debug)]
pub struct AgentState {
    /// The validated configuration in force.
    pub config: Config,
    /// Where it came from: a path or "embedded defaults".
    pub config_source: String,
    /// The node name reported everywhere.
    pub host: String,
    /// Wall-clock start, reported in GetAgentInfo.
    pub started_at: SystemTime,
    /// Monotonic start, for uptime.
    pub started: Instant,
    /// Node health (a handle: the sources and the detectors hold clones).
    pub health: Arc<HealthModel>,
    /// Event bus (a handle: every stage that publishes holds a clone).
    pub events: Arc<EventBus>,
    /// Where the agent listens, filled in as listeners bind: (kind, address).
    endpoints: Mutex<Vec<(String, String)>>,
    /// Cancelled when the agent shuts down; every task and stream watches it.
    pub shutdown: CancellationToken,
    /// Registered ranks and their slots. Held briefly: a scan, a registration.
    pub ranks: SharedRegistry,
    /// Diagnosed incidents and the node's cordon (written by the
    /// attribution task, read by the API).
    pub incidents: Arc<Mutex<IncidentStore>>,
    /// Every decided incident as it is decided (and again when a later
    /// decision supersedes it): what WatchIncidents streams to launchers.
    pub incident_feed: tokio::sync::broadcast::Sender<warden_core::attribute::IncidentRecord>,
    /// Later decisions about an incident, taken outside the attribution
    /// task (an in-process restart nobody acknowledged): the task records
    /// and publishes them.
    pub escalations: tokio::sync::mpsc::UnboundedSender<warden_core::attribute::Escalation>,
    escalations_rx:
        Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<warden_core::attribute::Escalation>>>,
    /// In-process restarts: the request in flight per job, restart counts,
    /// and what each rank's `Control` stream delivers (its own lock, never
    /// held together with the registry's).
    pub restarts: Arc<crate::act::in_process::Restarts>,
    /// Drain and resume requests for the Slurm task (act::slurm): the
    /// cordon and its lifting reach Slurm without waiting for `scontrol`.
    pub slurm: Arc<crate::act::slurm::Slurm>,
    /// Notices of a coming stop standing on this host or for a job
    /// (notice/): the work loop tells the ranks on each tick.
    pub notices: crate::notice::NoticeBoard,
    /// The checkpoint tiers, or why there are none (off, or the tier's
    /// directory could not be made): the checkpoint calls answer with it.
    pub checkpoints: Result<std::sync::Arc<crate::ckpt::Checkpoints>, String>,
    /// The goodput ledger and its journal (fed by the work loop's scan and
    /// the goodput task; read by GetGoodput).
    pub goodput: Arc<warden_core::goodput::Goodput>,
    /// Who may call what on the Unix socket, and who owns each job
    /// (docs/security.md).
    pub authz: crate::access::authz::Authz,
    /// How peer agents are served and dialed over TCP: mutual TLS with the
    /// cluster CA (the files watched for rotation), or `api.insecure`.
    pub peer_tls: crate::tls::PeerTls,
    /// Identities proved by the straggler exchange's own dials (peers
    /// configured by address): summaries are taken from them.
    pub straggler_peers_seen: std::sync::Arc<crate::tls::connect::SeenNames>,
    /// The straggler detector, made on first use (the work loop's first
    /// tick with `straggler.enabled`, or a peer's first summaries): the
    /// work loop runs it, GetStragglers and the Peer service read it.
    stragglers: std::sync::OnceLock<Arc<warden_core::detect::straggler::Stragglers>>,
    /// How many connections a host that is not an admin may hold here, over
    /// every listener: set once by the daemon from the budget its listeners
    /// share (`listen::admission`), so what the agent says about its cap is
    /// the cap it enforces. Unset (an agent with no listeners): no cap said.
    stranger_connections: std::sync::OnceLock<usize>,
    /// Where every rank of the jobs stands, this host's and the peers',
    /// for the job-wide hang verdict (`hang::verdict`).
    pub hang_board: Arc<crate::hang::verdict::HangBoard>,
    /// The SDC detector's link to its jobs' aggregator: this host's values
    /// out, the job-wide per-step statistics in (`ranks::peer_values`).
    pub peer_values: Arc<crate::ranks::peer_values::PeerValues>,
    /// The job-wide exchange: this agent's aggregators, its routes, and the
    /// handles it shares (`exchange::Exchange`).
    pub exchange: Arc<crate::exchange::Exchange>,
    /// Relayed reports waiting to go on to their aggregator in one batched
    /// call (`straggler.relay_batch_wait`). Transport state, so it lives
    /// beside the exchange rather than in it (`peer_link::exchange::batch`).
    pub relay_batches: Arc<crate::peer_link::exchange::batch::Batches>,
    /// The node's health gate: one run at a time, its result cached, calls
    /// per uid bounded (`act::gate`).
    pub gate: Arc<crate::act::gate::Gate>,
    /// The gate's settings (`[dcgm]`), shared with each call's handles
    /// rather than copied per call.
    gate_dcgm: Arc<crate::sources::dcgm::config::DcgmConfig>,
    /// ReportJobStop calls per uid (`api.job_stops_per_minute`).
    pub job_stops: crate::access::stop_limiter::StopLimiter,
}

impl AgentState {
    /// State for an agent whose peers are dialed in plain TCP (unit tests
    /// and tools that never reach a peer); sets up the heartbeat slots.
    pub fn new(config: Config, config_source: String) -> Result<Self, warden_slot::SlotError> {
        Self::with_peer_tls(config, config_source, crate::tls::PeerTls::Insecure)
    }

    /// State for an agent about to start, with its TCP peers served and
    /// dialed through `peer_tls`; sets up the heartbeat slots.
    pub fn with_peer_tls(
        config: Config,
        config_source: String,
        peer_tls: crate::tls::PeerTls,
    ) -> Result<Self, warden_slot::SlotError> {
        let host = config.host_name();
        let events = EventBus::new(config.events.retain);
        let ranks = Registry::new(
            &config.slot_dir(),
            &config.state_dir(),
            config.ranks.max_ranks,
        )?;
        let condition_file = if config.policy.condition_file.is_empty() {
            config.state_dir().join("node-condition.json")
        } else {
            std::path::PathBuf::from(&config.policy.condition_file)
        };
        // The registry just created the state directory.
        let incidents = IncidentStore::load(
            &config.state_dir(),
            condition_file,
            config.attribution.retain,
        );
        let (escalations, escalations_rx) = tokio::sync::mpsc::unbounded_channel();
        let goodput = Arc::new(warden_core::goodput::Goodput::open_with(
            &config.state_dir(),
            config.goodput.retention(),
        ));
        let authz = crate::access::authz::Authz::new(
            nix::unistd::geteuid().as_raw(),
            config.admin_gid().ok().flatten(),
            config.state_dir().join("job-owners.json"),
        );
        let mut ranks = ranks;
        ranks.max_per_process = config.ranks.max_per_process;
        ranks.max_per_uid = config.ranks.per_uid();
        let checkpoints = if config.checkpoint.enabled {
            crate::ckpt::Checkpoints::open(
                &config.checkpoint,
                &host,
                &config.api.tcp,
                crate::peer_link::ckpt::tonic_peer::TonicDial::shared(peer_tls.clone()),
            )
            .map(std::sync::Arc::new)
            .inspect_err(|e| tracing::error!(error = %e, "checkpoint tier unavailable"))
        } else {
            Err("off (checkpoint.enabled = false)".to_owned())
        };
        let straggler_peers_seen = std::sync::Arc::<crate::tls::connect::SeenNames>::default();
        let ranks = SharedRegistry::new(ranks);
        let shutdown = CancellationToken::new();
        let hang_board = Arc::new(crate::hang::verdict::HangBoard::new(
            host.clone(),
            config.straggler.summary_ttl,
            config.hang.verdict_wait * 2,
        ));
        let peer_values = Arc::new(crate::ranks::peer_values::PeerValues::default());
        let exchange = Arc::new(crate::exchange::Exchange {
            host: host.clone(),
            sdc_enabled: config.sdc.enabled,
            verdict_wait: config.hang.verdict_wait,
            aggregator: Mutex::new(warden_core::detect::straggler::aggregate::Aggregator::new(
                config.straggler.summary_ttl,
            )),
            sdc_aggregator: Mutex::new(warden_core::detect::sdc::aggregate::SdcAggregator::new(
                config.straggler.summary_ttl,
                config.sdc.judge_lag,
            )),
            routes: crate::exchange::routes::Routes::new(
                &config.api.tcp,
                &config.straggler.peers,
                config.straggler.aggregator_fan_out,
                crate::exchange::routes::Dial {
                    checkpoints: checkpoints.as_ref().ok().cloned(),
                    dial: Arc::new(
                        crate::peer_link::exchange::tonic_aggregator::TonicAggregatorDial {
                            peer_tls: peer_tls.clone(),
                            seen: straggler_peers_seen.clone(),
                            peer_timeout: config.straggler.peer_timeout,
                        },
                    ),
                },
            ),
            relay_batch_wait: config.straggler.relay_batch_wait(),
            relay_limit: config.straggler.peer_timeout,
            hang_board: hang_board.clone(),
            peer_values: peer_values.clone(),
            registry: ranks.clone(),
            shutdown: shutdown.clone(),
        });
        let state = Self {
            goodput,
            authz,
            incidents: Arc::new(Mutex::new(incidents)),
            incident_feed: tokio::sync::broadcast::channel(256).0,
            escalations,
            escalations_rx: Mutex::new(Some(escalations_rx)),
            restarts: Arc::new(crate::act::in_process::Restarts::new()),
            slurm: Arc::new(crate::act::slurm::Slurm::new(&config.slurm)),
            notices: crate::notice::NoticeBoard::default(),
            checkpoints,
            peer_tls,
            straggler_peers_seen,
            stragglers: std::sync::OnceLock::new(),
            stranger_connections: std::sync::OnceLock::new(),
            peer_values,
            exchange,
            relay_batches: Arc::default(),
            gate: Arc::default(),
            gate_dcgm: Arc::new(config.dcgm.clone()),
            job_stops: crate::access::stop_limiter::StopLimiter::new(
                config.api.job_stops_per_minute,
            ),
            hang_board,
            config,
            config_source,
            host,
            started_at: SystemTime::now(),
            started: Instant::now(),
            health: Arc::new(HealthModel::new()),
            events: Arc::new(events),
            endpoints: Mutex::new(Vec::new()),
            shutdown,
            ranks,
        };
        // Component state/job_owners: DEGRADED while claims are refused.
        state.authz.attach_health(state.health_reporter());
        Ok(state)
    }

    /// Locks the registry (a poisoned lock is still usable: the registry
    /// holds no invariant a panic midway could break beyond one entry).
    pub fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.ranks.lock()
    }

    /// The handles a health gate run holds (act::gate).
    pub fn gate_handles(&self) -> crate::act::gate::Handles {
        crate::act::gate::Handles {
            gate: self.gate.clone(),
            dcgm: self.gate_dcgm.clone(),
            health: self.health.clone(),
            events: self.events.clone(),
        }
    }

    /// The handles a rank's exit watch holds (ranks::exit_watch).
    pub fn exit_handles(&self) -> crate::ranks::exit_watch::Handles {
        crate::ranks::exit_watch::Handles {
            registry: self.ranks.clone(),
            goodput: self.goodput.clone(),
            events: self.events.clone(),
            shutdown: self.shutdown.clone(),
        }
    }

    /// The receiving end of [`AgentState::escalations`], once (the
    /// attribution task takes it).
    pub fn take_escalations(
        &self,
    ) -> Option<tokio::sync::mpsc::UnboundedReceiver<warden_core::attribute::Escalation>> {
        self.escalations_rx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Locks the incident store (poison-tolerant, like the registry).
    pub fn incident_store(&self) -> std::sync::MutexGuard<'_, IncidentStore> {
        self.incidents
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a listening endpoint.
    pub fn add_endpoint(&self, kind: &str, address: String) {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((kind.to_owned(), address));
    }

    /// The endpoints recorded so far.
    pub fn endpoints(&self) -> Vec<(String, String)> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The straggler detector, made now if it was not yet.
    pub fn stragglers(&self) -> Arc<warden_core::detect::straggler::Stragglers> {
        self.stragglers
            .get_or_init(|| {
                Arc::new(warden_core::detect::straggler::Stragglers::new(
                    self.config.straggler.clone(),
                    self.host.clone(),
                ))
            })
            .clone()
    }

    /// Records how many connections a non-admin may hold (the daemon, once).
    pub fn set_stranger_connections(&self, cap: usize) {
        let _ = self.stranger_connections.set(cap);
    }

    /// The cap [`AgentState::set_stranger_connections`] recorded, if the
    /// daemon set one.
    pub fn stranger_connections(&self) -> Option<usize> {
        self.stranger_connections.get().copied()
    }

    /// The straggler detector if one was made (nothing scored, no peer
    /// heard from: GetStragglers answers with this host alone).
    pub fn stragglers_if_made(&self) -> Option<Arc<warden_core::detect::straggler::Stragglers>> {
        self.stragglers.get().cloned()
    }

    /// What the attribution task (and the API's Uncordon) use.
    pub fn attribution(&self) -> crate::attribute::task::Handles {
        crate::attribute::task::Handles {
            events: self.events.clone(),
            reporter: self.health_reporter(),
            store: self.incidents.clone(),
            feed: self.incident_feed.clone(),
            attribution: self.config.attribution.clone(),
            policy: self.config.policy.clone(),
            host: self.host.clone(),
            in_process: self.in_process(),
            slurm: self.slurm.clone(),
            shutdown: self.shutdown.clone(),
        }
    }

    /// What in-process restarts use: the API's Control calls and the
    /// attribution task hand them this, not the whole state.
    pub fn in_process(&self) -> crate::act::in_process::Handles {
        crate::act::in_process::Handles {
            registry: self.ranks.clone(),
            events: self.events.clone(),
            restarts: self.restarts.clone(),
            escalations: self.escalations.clone(),
            timeout: self.config.restart.in_process_timeout,
            shutdown: self.shutdown.clone(),
        }
    }

    /// The health model and the bus as one handle, for a stage that
    /// reports health (the sources, the attribution task, the peer listener).
    pub fn health_reporter(&self) -> warden_core::events::health_reporter::Reporter {
        warden_core::events::health_reporter::Reporter {
            model: self.health.clone(),
            events: self.events.clone(),
        }
    }

    /// Applies a source's report and publishes a `health.changed` event when
    /// a component's status moved. Returns true on a status change.
    pub fn apply_report(&self, report: ComponentReport) -> bool {
        self.health_reporter().apply(report)
    }

    /// Like [`AgentState::apply_report`], for what `source` says (several
    /// sources may speak about one component; see [`HealthModel`]).
    pub fn apply_report_from(&self, source: &str, report: ComponentReport) -> bool {
        self.health_reporter().apply_from(source, report)
    }
}
