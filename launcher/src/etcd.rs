//! The launcher's coordinator across hosts: [`super::hosts::AcrossHosts`]
//! on the etcd library of `crate::coord`.
//!
//! In: `--rdzv-backend etcd` and its flags ([`config`]). Out: every attempt
//! planned from the job's current round (this host's node rank, or none on
//! a standby spare; the round's node count, world size, rank offset, rank
//! 0's address and the epoch's port), the rounds other hosts cause as
//! [`Remote::NewRound`], the job's end or this host's lost lease as
//! [`Remote::Stop`].
//!
//! Mapping: `rendezvous` is `wait_for_round` after the epoch of the current
//! attempt, its plan's `keeps_place` judged against the attempt's round;
//! `publish(RestartInJob)` is `request_round` of that epoch with the
//! directive's `heal` (one round however many hosts report the same
//! failure; the flag set where this host heals its workers into it);
//! `publish(Stop)` is `leave`: `Finished` for a job that succeeded here, `Failed` (the others
//! stop with the same status) for a job that failed for good, `Cordoned`
//! for 86, `Stopped` when this host goes alone (a signal, the others'
//! stop); `next_remote` is `next_round`; `node_fault` is `leave(Cordoned)`
//! and exit 86; a lost lease is a stop with 86, but only once it could not
//! be regained: a lease that lapsed (etcd out, this host stalled) is kept or
//! re-granted by the coordinator, same place in the round, workers running.
//!
//! Never: start workers for a round this host has no place in, or ask for
//! a restart after the job ended elsewhere.

use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use tokio::time::Instant;

use crate::coord as etcd;

use super::args::RunArgs;
use super::exit::{EXIT_BUDGET_SPENT, EXIT_LAUNCHER_ERROR, EXIT_NODE_FAULT, EXIT_PREEMPTED};
use super::hosts::{AcrossHosts, AcrossHostsError, AttemptPlan, Directive, NodeFault, Remote};

pub use crate::args::DEFAULT_ETCD_PORT;

/// How often a restart request that did not reach etcd is tried again
/// while the rendezvous waits for its round.
const RETRY_RESTART: Duration = Duration::from_millis(500);

/// A launcher's membership in a multi-host job, through etcd.
#[derive(Debug)]
pub struct EtcdCoordinator {
    /// `None` once this host left the job.
    coord: Option<etcd::Coordinator>,
    host: String,
    /// Joined as a standby spare (`--spare`).
    spare: bool,
    /// The epoch of the current attempt's round (0 before the first).
    epoch: u64,
    /// No place in the current round: no workers here.
    standby: bool,
    /// How long a rendezvous waits for a round this host can run in.
    round_timeout: Duration,
    /// The job ended on another host: nothing more will come.
    ended_elsewhere: bool,
    /// The lease is lost: nothing to leave.
    lost: bool,
    /// A restart this host asked for that etcd did not take yet: the
    /// rendezvous asks again (else nobody would make its round).
    /// The flag: a round this host heals its workers into
    /// ([`Directive::RestartInJob`]'s `heal`).
    unsent: Option<(String, bool)>,
    /// The membership's lease state last told on the console: lapsed or
    /// not, and the rejoins so far.
    told_lease: (bool, u32),
    /// `--max-cordon-share` and `--cordon-share-window`.
    cordon_cap: CordonCap,
    /// The current attempt's round: what a new one is compared with
    /// ([`keeps_place`]).
    current: Option<etcd::Round>,
    /// The epoch of the round whose notice this launcher published or was
    /// told of: a notice is brought once.
    noticed: Option<u64>,
    /// The round of the notice that stood in etcd when this launcher
    /// joined and is a previous run's ([`etcd::notice::stop_underway`]):
    /// never acted on.
    notice_at_join: Option<u64>,
    /// The notice the job was stopping on when this launcher joined: its
    /// first rendezvous ends with 85, starting nothing.
    stop_at_join: Option<etcd::notice::NoticeAtJoin>,
    /// The newest round brought as [`Remote::NewRound`]: brought once. A
    /// launcher that does not act on it (its workers leaving on a notice)
    /// would otherwise be handed it again at once, for ever, starving the
    /// tasks that reap its workers.
    brought: u64,
    /// The hosts of the current attempt's round, its spares included:
    /// read at the job's end, after the coordinator is gone, to tell a host
    /// lost from the job from one still in it ([`EtcdCoordinator::round_hosts`]).
    round_hosts: tokio::sync::watch::Sender<RoundHosts>,
}

/// A round's hosts (node ranks in order) and its standby spares; empty
/// before the first round.
#[derive(Debug, Clone, Default)]
pub struct RoundHosts {
    /// The hosts with a node rank.
    pub members: std::sync::Arc<[String]>,
    /// The spares waiting in it.
    pub spares: Vec<String>,
}

impl RoundHosts {
    /// Every host in the round, with a node rank or as a spare.
    pub fn all(&self) -> std::collections::HashSet<&str> {
        self.members
            .iter()
            .chain(&self.spares)
            .map(String::as_str)
            .collect()
    }
}

/// The cap on the share of a job's hosts cordoned within a window
/// ([`etcd::cordon_share`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CordonCap {
    /// Past this share (0..=1) of the job's hosts cordoned, a further
    /// cordoned host exits 87, not 86. 1: no cap.
    pub max_share: f64,
    /// How far back cordons count.
    pub window: Duration,
}

impl CordonCap {
    /// From `warden run`'s flags.
    pub fn from_args(args: &RunArgs) -> Self {
        Self {
            max_share: args.max_cordon_share,
            window: args.cordon_share_window,
        }
    }
}

/// The etcd coordinator's config from `warden run`'s flags, for job `job`,
/// reaching etcd with `access` (TLS, user: `args.etcd.access()`, read once
/// before anything starts).
pub fn config(args: &RunArgs, job: &str, access: etcd::EtcdAccess) -> etcd::CoordConfig {
    let endpoints = args.etcd_endpoints();
    let host = args.host_id.clone().unwrap_or_else(host_name);
    let addr = args
        .advertise_addr
        .clone()
        .unwrap_or_else(|| advertise_addr(&endpoints));
    let mut c = etcd::CoordConfig::new(endpoints, job, host, addr);
    c.access = access;
    c.nproc_per_node = args.nproc_per_node;
    c.min_nodes = args.nnodes.min;
    c.max_nodes = args.nnodes.max;
    c.spare = args.spare;
    c.lease_ttl = args.rdzv_lease_ttl;
    if let Some(d) = args.rdzv_conf.last_call {
        c.last_call = d;
    }
    if let Some(p) = args.master_port {
        c.base_port = p;
    }
    // A launcher restarted on the same host waits for its predecessor's
    // lease to run out.
    c.join_timeout = args.rdzv_lease_ttl + Duration::from_secs(10);
    // A member whose lease lapsed gets one more TTL to re-register before
    // the others re-form the round without it; this host keeps trying to
    // regain its own for a minute (or ten TTLs) with its workers running.
    c.rejoin_grace = args.rdzv_lease_ttl;
    c.rejoin_timeout = (args.rdzv_lease_ttl * 10).max(Duration::from_secs(60));
    c
}

/// This host's agent as a checkpoint peer of the job's other hosts, or why
/// it cannot be one. The agent's TCP listener (`tcp`) is where they reach
/// its tier; an unspecified IP (`0.0.0.0`, `[::]`) is replaced by the
/// address this host advertises in the job. A listener on loopback while
/// the job's address is not cannot be reached from elsewhere.
pub fn ckpt_peer(
    checkpoint: &warden_agent::ckpt::CheckpointConfig,
    tcp: &str,
    advertise: &str,
) -> Result<etcd::CkptPeer, String> {
    if !checkpoint.enabled {
        return Err("the agent's checkpoint tier is off".to_owned());
    }
    if tcp.is_empty() {
        return Err(
            "the agent has no TCP listener (api.tcp), where the other hosts' agents would reach its tier"
                .to_owned(),
        );
    }
    let Ok(sock) = tcp.parse::<std::net::SocketAddr>() else {
        // A host name: the other hosts resolve it themselves.
        return Ok(etcd::CkptPeer {
            addr: tcp.to_owned(),
            domain: checkpoint.domain.clone(),
            identity: String::new(),
        });
    };
    let adv: Option<IpAddr> = advertise.parse().ok();
    let addr = if sock.ip().is_unspecified() {
        match adv {
            Some(IpAddr::V6(ip)) => format!("[{ip}]:{}", sock.port()),
            Some(IpAddr::V4(ip)) => format!("{ip}:{}", sock.port()),
            None => format!("{advertise}:{}", sock.port()),
        }
    } else if sock.ip().is_loopback() && !adv.is_some_and(|a| a.is_loopback()) {
        return Err(format!(
            "the agent's TCP listener {tcp} is on loopback, which the job's other hosts cannot reach (this host's address in the job: {advertise})"
        ));
    } else {
        tcp.to_owned()
    };
    Ok(etcd::CkptPeer {
        addr,
        domain: checkpoint.domain.clone(),
        identity: String::new(),
    })
}

/// The kernel's host name (the default host id).
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// The address the other hosts reach this one at: the local address of
/// the route to the first etcd endpoint; when that is loopback (etcd runs
/// here), the host name's first non-loopback address, else the host name.
pub fn advertise_addr(endpoints: &[String]) -> String {
    let routed = endpoints.first().and_then(|e| {
        let hostport = e
            .trim_start_matches("http://")
            .trim_start_matches("https://");
        let sock = UdpSocket::bind(("0.0.0.0", 0)).ok()?;
        sock.connect(hostport).ok()?;
        sock.local_addr().ok().map(|a| a.ip())
    });
    if let Some(ip) = routed.filter(|ip| !ip.is_loopback() && !ip.is_unspecified()) {
        return ip.to_string();
    }
    let name = host_name();
    let resolved: Option<IpAddr> = (name.as_str(), 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.find(|a| !a.ip().is_loopback()).map(|a| a.ip()));
    resolved.map_or(name, |ip| ip.to_string())
}

impl EtcdCoordinator {
    /// Joins the job in etcd (its lease kept alive from now on);
    /// `round_timeout` bounds every wait for a round this host can run in.
    pub async fn join(
        cfg: etcd::CoordConfig,
        round_timeout: Duration,
        cordon_cap: CordonCap,
    ) -> Result<Self, etcd::CoordError> {
        let host = cfg.host.clone();
        let spare = cfg.spare;
        let coord = etcd::Coordinator::join(cfg).await?;
        let (notice_at_join, stop_at_join) = match coord.notice_at_join() {
            Some(n) if n.underway => (None, Some(n.clone())),
            Some(n) => {
                tracing::info!(
                    epoch = n.epoch,
                    by = %n.record.by,
                    step = n.record.step,
                    "launcher: the notice standing in etcd is a previous run's (no launcher of that run is left in the job, or its deadline is past): not acted on"
                );
                (Some(n.epoch), None)
            }
            None => (None, None),
        };
        Ok(Self {
            notice_at_join,
            stop_at_join,
            coord: Some(coord),
            host,
            spare,
            epoch: 0,
            standby: false,
            round_timeout,
            ended_elsewhere: false,
            lost: false,
            unsent: None,
            told_lease: (false, 0),
            cordon_cap,
            current: None,
            noticed: None,
            brought: 0,
            round_hosts: tokio::sync::watch::Sender::new(RoundHosts::default()),
        })
    }

    /// The hosts of the current attempt's round, as it changes; the
    /// receiver outlives the coordinator.
    pub fn round_hosts(&self) -> tokio::sync::watch::Receiver<RoundHosts> {
        self.round_hosts.subscribe()
    }

    /// One line for the console: who this host is in the job.
    pub fn describe(&self) -> String {
        match &self.coord {
            Some(c) => format!("joined as host {} (lease {:x})", self.host, c.lease_id()),
            None => format!("host {} (left)", self.host),
        }
    }

    /// A library error as the launcher's: its exit status.
    fn halt(&mut self, e: etcd::CoordError) -> AcrossHostsError {
        let exit_code = match &e {
            // Out of the job: the membership was not regained in time, or
            // another launcher took this host id meanwhile.
            etcd::CoordError::LeaseLost { .. } | etcd::CoordError::HostTaken { .. } => {
                self.lost = true;
                EXIT_NODE_FAULT
            }
            etcd::CoordError::Ended {
                outcome: etcd::Outcome::Failed,
                exit_code,
                ..
            } => {
                self.ended_elsewhere = true;
                exit_code.unwrap_or(EXIT_LAUNCHER_ERROR)
            }
            // A spare with nothing to do: the job is done.
            etcd::CoordError::Ended {
                outcome: etcd::Outcome::Finished,
                ..
            } if self.standby => {
                self.ended_elsewhere = true;
                0
            }
            etcd::CoordError::Ended { .. } => {
                self.ended_elsewhere = true;
                EXIT_LAUNCHER_ERROR
            }
            _ => EXIT_LAUNCHER_ERROR,
        };
        AcrossHostsError {
            message: e.to_string(),
            exit_code,
        }
    }

    /// Leaves the job in etcd (once; nothing when the lease is lost).
    async fn leave(&mut self, how: etcd::Leave) -> Result<(), AcrossHostsError> {
        let Some(c) = self.coord.take() else {
            return Ok(());
        };
        if self.lost {
            return Ok(());
        }
        c.leave(how).await.map_err(|e| {
            AcrossHostsError::new(format!(
                "could not leave the job in etcd ({e}); the other hosts see this one go after its lease TTL"
            ))
        })
    }
}

/// The plan of an attempt in `round` for host `host`.
fn plan_of(round: &etcd::Round, restart_count: u32, host: &str, spare: bool) -> AttemptPlan {
    let place = match round.node_rank.filter(|_| round.runs_workers()) {
        Some(r) => format!("node rank {r}"),
        None if spare => "a standby spare, no workers".to_owned(),
        None => "no place in it, no workers".to_owned(),
    };
    AttemptPlan {
        restart_count,
        master_addr: round.master_addr.clone(),
        master_port: round.master_port,
        node_rank: round.node_rank.filter(|_| round.runs_workers()),
        nnodes: round.nnodes,
        world_size: round.world_size,
        rank_offset: round.rank_offset,
        epoch: Some(round.epoch),
        round: Some(format!(
            "round {} ({}; by {}): {} host{} [{}], world size {}, master {}:{}; {host}: {place}",
            round.epoch,
            round.reason,
            round.decided_by,
            round.nnodes,
            if round.nnodes == 1 { "" } else { "s" },
            crate::coord::round::named_briefly(&round.members),
            round.world_size,
            round.master_addr,
            round.master_port,
        )),
        ckpt_peers: crate::hosts::CkptPeers {
            ring_by_place: round.ckpt_ring_by_place,
            replicas: round.ckpt_replicas,
            window: round.ckpt_window,
            ..crate::hosts::CkptPeers::of_round(&round.ckpt_peers, host)
        },
        // Set by the rendezvous, which knows the attempt's round.
        keeps_place: false,
    }
}

/// Whether this host's workers can heal into `new` from `old` in process:
/// it runs workers in both at the same node rank and rank offset, the
/// round keeps its node count, world size and this host's worker count,
/// and another host changed (a spare took a lost host's node rank, so the
/// ranks of every kept host keep their numbers and the data-parallel
/// replicas line up). A round of the same hosts is a restart one of them
/// asked for (its workers failed), or a host's launcher restarted under
/// the same host id: its workers are new, so are everyone's collectives'
/// peers: no heal; unless its asker heals its own workers into it
/// ([`etcd::Round::heal`]: a hang across hosts, judged on that host before
/// a lost host's lease ran out, the others about to judge it too), where
/// every host that keeps its place heals (a host relaunched under its id
/// meanwhile has fresh ranks, which join the healed ones as a spare's
/// would and take their state from live replicas). Launchers before the
/// flag ignore it and restart in job into such a round, as before.
pub fn keeps_place(old: &etcd::Round, new: &etcd::Round) -> bool {
    same_place(old, new) && (other_hosts(old, new) || new.heal)
}

/// Whether another host holds a place in `new` than in `old`: by the
/// records' hosts digests where both carry one of the scheme this launcher
/// writes and checks (what a host that does not hold the member lists can
/// compare), by the lists otherwise (a launcher before the digest, or one
/// of a later scheme, which this one neither checked against the members
/// nor knows to be of host ids alone). A host relaunched under its id is
/// the same host in both.
fn other_hosts(old: &etcd::Round, new: &etcd::Round) -> bool {
    use crate::coord::layout::is_hosts_digest;
    if is_hosts_digest(&old.hosts_digest) && is_hosts_digest(&new.hosts_digest) {
        old.hosts_digest != new.hosts_digest
    } else {
        old.members != new.members
    }
}

/// Whether `new` gives this host the place it had in `old`: workers in
/// both at the same node rank and rank offset, the same node count (the
/// number of hosts: a round's member list is checked against it when
/// read, so the lists' lengths are not compared, and a host that holds
/// only its part of a round has none), world size and worker count.
fn same_place(old: &etcd::Round, new: &etcd::Round) -> bool {
    old.runs_workers()
        && new.runs_workers()
        && new.epoch > old.epoch
        && old.node_rank == new.node_rank
        && old.rank_offset == new.rank_offset
        && old.local_world_size == new.local_world_size
        && old.nnodes == new.nnodes
        && old.world_size == new.world_size
}

impl EtcdCoordinator {
    /// A notice another host wrote in an earlier round than `epoch` (the
    /// round this host is about to start) while this host was in the job
    /// but between rounds (stopping, gated, backing off, waiting for the
    /// round): the hosts of that round are saving its step and leaving
    /// (85). This host's workers would restart from an older checkpoint
    /// and could not reach that step in lockstep with hosts that are
    /// leaving, so none start: the launcher exits 85 too, and the next run
    /// resumes at the newest step complete for every rank (the notice's,
    /// when the other hosts' save of it is complete). A notice that stood
    /// when this launcher joined and is a previous run's is not acted on
    /// (one whose stop was underway ends the first rendezvous instead:
    /// [`Self::stop_at_join`]), nor is one this host already acted on,
    /// nor one of the round it starts (its workers are told of that one
    /// once they run, as the other hosts' are).
    fn standing_notice(&mut self, epoch: u64) -> Option<AcrossHostsError> {
        let (e, n) = self.coord.as_ref()?.state().notice?;
        if e >= epoch || Some(e) == self.notice_at_join || self.noticed.is_some_and(|s| s >= e) {
            return None;
        }
        self.noticed = Some(e);
        Some(AcrossHostsError {
            message: format!(
                "host {} got a notice ({}) in round {e} while this host was between rounds: every rank of that round saves at step {} and the job stops; this host's workers do not run in round {epoch}",
                n.by, n.reason, n.step
            ),
            exit_code: EXIT_PREEMPTED,
        })
    }

    /// The notice the job was stopping on when this launcher joined
    /// ([`etcd::notice::stop_underway`]), taken once: the first rendezvous
    /// ends with 85 rather than waiting for a round nobody will make (the
    /// job's hosts are saving and leaving) until its timeout.
    fn stop_at_join(&mut self) -> Option<AcrossHostsError> {
        let n = self.stop_at_join.take()?;
        self.noticed = Some(n.epoch);
        let left = n
            .record
            .deadline_ms
            .saturating_sub(crate::hosts::unix_ms(std::time::SystemTime::now()))
            .div_ceil(1000);
        Some(AcrossHostsError {
            message: format!(
                "host {} got a notice ({}) in round {} and the job was stopping on it when this launcher joined (a launcher of that run is still in the job, the stop's deadline {left} s ahead): every rank of that round saves at step {} and the job stops; this host starts no workers",
                n.record.by, n.record.reason, n.epoch, n.record.step
            ),
            exit_code: EXIT_PREEMPTED,
        })
    }

    /// A notice written while this host waits for a round: as
    /// [`Self::standing_notice`], at once (the round it waits for may never
    /// come: the hosts that would make it are leaving).
    fn notice_while_waiting(
        &mut self,
        e: u64,
        n: &etcd::records::NoticeRecord,
    ) -> AcrossHostsError {
        self.noticed = Some(e);
        AcrossHostsError {
            message: format!(
                "host {} got a notice ({}) in round {e} while this host was between rounds: every rank of that round saves at step {} and the job stops; this host's workers do not run again",
                n.by, n.reason, n.step
            ),
            exit_code: EXIT_PREEMPTED,
        }
    }
}

/// The first notice in `states` that this launcher has neither acted on
/// (`noticed`: the newest round whose notice it has) nor found at its join
/// as a previous run's (`at_join`); waits for one as long as it takes.
async fn fresh_notice(
    mut states: tokio::sync::watch::Receiver<etcd::CoordState>,
    noticed: Option<u64>,
    at_join: Option<u64>,
) -> (u64, etcd::records::NoticeRecord) {
    loop {
        {
            let s = states.borrow_and_update();
            if let Some((e, n)) = &s.notice
                && Some(*e) != at_join
                && noticed.is_none_or(|seen| seen < *e)
            {
                return (*e, n.clone());
            }
        }
        if states.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

impl AcrossHosts for EtcdCoordinator {
    fn name(&self) -> &'static str {
        "etcd"
    }

    async fn rendezvous(&mut self, proposed: AttemptPlan) -> Result<AttemptPlan, AcrossHostsError> {
        if let Some(stop) = self.stop_at_join() {
            return Err(stop);
        }
        let deadline = Instant::now() + self.round_timeout;
        let round = loop {
            let Some(c) = &self.coord else {
                return Err(AcrossHostsError::new("this host has left the job"));
            };
            if let Some((reason, heal)) = &self.unsent {
                match c.request_round(self.epoch, reason, *heal).await {
                    Ok(_) => self.unsent = None,
                    Err(e @ etcd::CoordError::LeaseLost { .. }) => return Err(self.halt(e)),
                    Err(e) => {
                        tracing::warn!(error = %e, "launcher: restart request not taken yet; retrying");
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let wait = if self.unsent.is_some() {
                left.min(RETRY_RESTART)
            } else {
                left
            };
            let waited = tokio::select! {
                // A round already there comes first: a notice of an
                // earlier round is then [`Self::standing_notice`]'s.
                biased;
                r = c.wait_for_round(self.epoch, wait) => r,
                (e, n) = fresh_notice(c.rounds(), self.noticed, self.notice_at_join) => {
                    return Err(self.notice_while_waiting(e, &n));
                }
            };
            match waited {
                Ok(r) => break r,
                Err(etcd::CoordError::NotEnoughNodes { .. } | etcd::CoordError::NoRound { .. })
                    if self.unsent.is_some() && Instant::now() < deadline => {}
                Err(e) => return Err(self.halt(e)),
            }
        };
        self.unsent = None;
        if let Some(stop) = self.standing_notice(round.epoch) {
            return Err(stop);
        }
        self.epoch = round.epoch;
        self.standby = !round.runs_workers();
        let mut plan = plan_of(&round, proposed.restart_count, &self.host, self.spare);
        plan.keeps_place = self
            .current
            .as_ref()
            .is_some_and(|old| keeps_place(old, &round));
        self.round_hosts.send_replace(RoundHosts {
            members: round.members.clone(),
            spares: round.standby.clone(),
        });
        self.current = Some(round);
        Ok(plan)
    }

    async fn publish(&mut self, d: &Directive) -> Result<(), AcrossHostsError> {
        match d {
            Directive::RestartInJob { reason, heal } => {
                if self.ended_elsewhere {
                    return Err(AcrossHostsError::new(
                        "the job already ended on another host: no restart across hosts",
                    ));
                }
                let Some(c) = &self.coord else {
                    return Err(AcrossHostsError::new("this host has left the job"));
                };
                match c.request_round(self.epoch, reason, *heal).await {
                    Ok(_) => Ok(()),
                    Err(e @ etcd::CoordError::LeaseLost { .. }) => Err(self.halt(e)),
                    Err(e) => {
                        // Asked again while the rendezvous waits.
                        self.unsent = Some((reason.clone(), *heal));
                        Err(AcrossHostsError::new(format!("{e}; asking again")))
                    }
                }
            }
            Directive::Stop {
                exit_code,
                reason,
                job_failed,
            } => {
                let how = if *exit_code == 0 {
                    etcd::Leave::Finished
                } else if *exit_code == EXIT_NODE_FAULT && !*job_failed {
                    etcd::Leave::Cordoned(reason.clone())
                } else if *job_failed && !self.ended_elsewhere {
                    etcd::Leave::Failed {
                        reason: reason.clone(),
                        exit_code: *exit_code,
                    }
                } else {
                    etcd::Leave::Stopped(reason.clone())
                };
                self.leave(how).await
            }
        }
    }

    async fn next_remote(&mut self) -> Remote {
        if self.ended_elsewhere || self.lost {
            return std::future::pending().await;
        }
        let Some(c) = &self.coord else {
            return std::future::pending().await;
        };
        let mut states = c.rounds();
        let told = self.told_lease;
        let (epoch, noticed, at_join) = (self.epoch, self.noticed, self.notice_at_join);
        let lease_news = async {
            loop {
                {
                    let s = states.borrow_and_update();
                    // Another host's notice in this attempt's round (or a
                    // later one: its workers are this round's still), or
                    // in an earlier round, written while this host was
                    // between rounds ([`Self::standing_notice`]).
                    if let Some((e, n)) = &s.notice
                        && Some(*e) != at_join
                        && noticed.is_none_or(|seen| seen < *e)
                    {
                        return Err((*e, n.clone()));
                    }
                    let now = (s.lease_lapsed.is_some(), s.rejoins);
                    if now != told {
                        return Ok((now, s.lease_lapsed.clone()));
                    }
                }
                if states.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        };
        let next = tokio::select! {
            r = c.next_round(self.epoch.max(self.brought)) => r,
            news = lease_news => {
                let ((lapsed, rejoins), why) = match news {
                    Err((e, _)) if e < epoch => {
                        // The workers of this round restarted from an
                        // older checkpoint than the step the leaving hosts
                        // save: they stop, and the job exits 85.
                        return match self.standing_notice(epoch) {
                            Some(stop) => Remote::Stop {
                                exit_code: stop.exit_code,
                                reason: stop.message,
                            },
                            None => {
                                self.noticed = Some(e);
                                Remote::Note(format!("a notice of round {e} stood already"))
                            }
                        };
                    }
                    Err((e, n)) => {
                        self.noticed = Some(e);
                        return Remote::Notice {
                            step: n.step,
                            deadline: (n.deadline_ms != 0)
                                .then(|| std::time::UNIX_EPOCH + Duration::from_millis(n.deadline_ms)),
                            reason: format!("host {} got a notice ({})", n.by, n.reason),
                        };
                    }
                    Ok(news) => news,
                };
                self.told_lease = (lapsed, rejoins);
                return Remote::Note(if lapsed {
                    format!(
                        "etcd: this host's membership lease lapsed ({}); the workers keep running while it is kept or regained",
                        why.unwrap_or_default()
                    )
                } else if rejoins > told.1 {
                    format!(
                        "etcd: rejoined the job under a new lease {:x} (the old one expired); same place in round {}, workers untouched",
                        c.lease_id(),
                        self.epoch
                    )
                } else {
                    "etcd: answered again and still holds this host's lease; nothing lost".to_owned()
                });
            }
        };
        match next {
            Ok(r) => {
                self.brought = r.epoch;
                Remote::NewRound {
                    reason: format!("round {}: {} (by {})", r.epoch, r.reason, r.decided_by),
                    keeps_place: self
                        .current
                        .as_ref()
                        .is_some_and(|old| keeps_place(old, &r)),
                }
            }
            Err(etcd::CoordError::Ended {
                outcome: etcd::Outcome::Finished,
                by,
                ..
            }) if !self.standby => {
                self.ended_elsewhere = true;
                Remote::Note(format!(
                    "host {by} finished its part of the job: no more rounds; the workers here finish theirs"
                ))
            }
            Err(e) => {
                let h = self.halt(e);
                Remote::Stop {
                    exit_code: h.exit_code,
                    reason: h.message,
                }
            }
        }
    }

    async fn publish_notice(
        &mut self,
        step: u64,
        deadline: std::time::SystemTime,
        reason: &str,
    ) -> Result<u64, AcrossHostsError> {
        let Some(c) = &self.coord else {
            return Err(AcrossHostsError::new("this host has left the job"));
        };
        let ms = crate::hosts::unix_ms(deadline);
        self.noticed = Some(self.epoch);
        match c.publish_notice(self.epoch, step, ms, reason).await {
            Ok(n) => Ok(n.step),
            Err(e @ etcd::CoordError::LeaseLost { .. }) => Err(self.halt(e)),
            Err(e) => Err(AcrossHostsError::new(e.to_string())),
        }
    }

    async fn node_fault(&mut self, reason: &str) -> NodeFault {
        // Read before leaving: etcd's view of the job as this host left it.
        let cap = self.cordon_cap;
        let share = self
            .coord
            .as_ref()
            .map(|c| c.cordon_share(cap.window, cap.max_share));
        if let Err(e) = self.leave(etcd::Leave::Cordoned(reason.to_owned())).await {
            tracing::warn!(error = %e, "launcher: leaving the job after a node fault failed");
        }
        match share {
            Some(s) if s.over => {
                let why = format!(
                    "cordon share cap: {}; not reporting a node fault (86): exiting {EXIT_BUDGET_SPENT}, a person should look",
                    s.describe(cap.max_share, cap.window)
                );
                tracing::warn!(
                    job_hosts = s.hosts,
                    cordoned = s.cordoned.len(),
                    "launcher: {why}"
                );
                NodeFault::Held {
                    exit_code: EXIT_BUDGET_SPENT,
                    report: s.report(&why, cap.max_share, cap.window, EXIT_BUDGET_SPENT),
                    why,
                }
            }
            _ => NodeFault::Exit(EXIT_NODE_FAULT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_agent::ckpt::CheckpointConfig;

    fn tier(domain: &str) -> CheckpointConfig {
        CheckpointConfig {
            domain: domain.into(),
            ..CheckpointConfig::default()
        }
    }

    #[test]
    fn the_agent_is_published_where_the_other_hosts_reach_it() {
        let p = ckpt_peer(&tier("rack7"), "0.0.0.0:7000", "10.1.2.3").unwrap();
        assert_eq!(
            (p.addr.as_str(), p.domain.as_str()),
            ("10.1.2.3:7000", "rack7")
        );
        let p = ckpt_peer(&tier(""), "[::]:7000", "fd00::5").unwrap();
        assert_eq!(p.addr, "[fd00::5]:7000");
        // A host-local test: loopback everywhere is fine.
        let p = ckpt_peer(&tier(""), "127.0.0.2:7000", "127.0.0.2").unwrap();
        assert_eq!(p.addr, "127.0.0.2:7000");
        assert_eq!(
            ckpt_peer(&tier(""), "node7.example:7000", "10.1.2.3")
                .unwrap()
                .addr,
            "node7.example:7000"
        );
    }

    fn round(epoch: u64, members: &[&str], me: Option<u32>) -> etcd::Round {
        etcd::Round {
            job: "j".into(),
            epoch,
            node_rank: me,
            nnodes: u32::try_from(members.len()).unwrap(),
            local_world_size: 1,
            rank_offset: me.unwrap_or(0),
            world_size: u32::try_from(members.len()).unwrap(),
            master_addr: "127.0.0.2".into(),
            master_port: 29500 + u16::try_from(epoch).unwrap(),
            members: members.iter().map(|m| (*m).to_owned()).collect(),
            ckpt_peers: Default::default(),
            hosts_digest: String::new(),
            ckpt_ring_by_place: false,
            ckpt_replicas: 0,
            ckpt_window: 0,
            standby: Vec::new(),
            waiting: false,
            reason: String::new(),
            decided_by: String::new(),
            heal: false,
        }
    }

    #[test]
    fn a_host_keeps_its_place_only_when_another_host_was_swapped() {
        let old = round(1, &["a", "b"], Some(0));
        // The spare took b's node rank: a heals in place.
        assert!(keeps_place(&old, &round(2, &["a", "s"], Some(0))));
        // The same hosts: a restart one asked for.
        assert!(!keeps_place(&old, &round(2, &["a", "b"], Some(0))));
        // Scale down: the world shrinks.
        assert!(!keeps_place(&old, &round(2, &["a"], Some(0))));
        // This host moved.
        assert!(!keeps_place(&old, &round(2, &["s", "a"], Some(1))));
        // No place in it, or none before.
        assert!(!keeps_place(&old, &round(2, &["s", "b"], None)));
        assert!(!keeps_place(
            &round(1, &["a", "b"], None),
            &round(2, &["a", "s"], Some(0))
        ));
        let mut waiting = round(2, &["a", "s"], Some(0));
        waiting.waiting = true;
        assert!(!keeps_place(&old, &waiting));
        // Not a later round.
        assert!(!keeps_place(&old, &round(1, &["a", "s"], Some(0))));
    }

    /// A round member on 127.0.0.2 with `nproc` workers.
    fn member(
        h: &str,
        nproc: u32,
        lease: i64,
        incarnation: u64,
    ) -> crate::coord::records::RoundMember {
        crate::coord::records::RoundMember {
            host: h.into(),
            addr: "127.0.0.2".into(),
            nproc_per_node: nproc,
            lease,
            ckpt_peer: None,
            incarnation,
        }
    }

    #[test]
    fn the_hosts_digests_decide_a_swap_where_both_rounds_carry_one() {
        use crate::coord::layout::hosts_digest;
        let with = |epoch, hosts: &[&str], lists: bool| {
            let mut r = round(epoch, hosts, Some(0));
            r.hosts_digest =
                hosts_digest(&hosts.iter().map(|h| member(h, 1, 1, 1)).collect::<Vec<_>>());
            if !lists {
                // What a host that read only its own place will hold.
                r.members = std::sync::Arc::from(Vec::new());
            }
            r
        };
        let old = with(1, &["a", "b"], false);
        assert!(keeps_place(&old, &with(2, &["a", "s"], false)));
        assert!(!keeps_place(&old, &with(2, &["a", "b"], false)));
        // The digests, not the lists, where both have one.
        let mut liar = with(2, &["a", "s"], true);
        liar.hosts_digest = old.hosts_digest.clone();
        assert!(!keeps_place(&with(1, &["a", "b"], true), &liar));
        // A record of a launcher before the digest: the lists decide.
        let mut older = round(2, &["a", "s"], Some(0));
        older.hosts_digest = String::new();
        assert!(keeps_place(&with(1, &["a", "b"], true), &older));
        // An older round without one, the new round with one: the lists.
        let mut before = with(1, &["a", "b"], true);
        before.hosts_digest = String::new();
        assert!(keeps_place(&before, &with(2, &["a", "s"], true)));
        assert!(!keeps_place(&before, &with(2, &["a", "b"], true)));
        // One of a later scheme, on one round or both: the lists decide
        // too (the same hosts are a restart, not a swap, whatever the two
        // digests say).
        let mut later = with(2, &["a", "b"], true);
        later.hosts_digest = "sha3-256:00".into();
        assert!(!keeps_place(&with(1, &["a", "b"], true), &later));
        let mut later_too = with(1, &["a", "b"], true);
        later_too.hosts_digest = "sha3-256:01".into();
        assert!(!keeps_place(&later_too, &later));
    }

    #[test]
    fn a_launcher_relaunched_under_its_host_id_restarts_and_a_swap_heals() {
        use crate::coord::{Limits, plan, records::RoundMember};
        let member = |h: &str, lease: i64, incarnation: u64| member(h, 2, lease, incarnation);
        let record = |epoch, members: Vec<RoundMember>| {
            let mut r = plan::record(
                epoch,
                plan::Assignment {
                    members: Vec::new(),
                    standby: Vec::new(),
                },
                Limits {
                    min_nodes: 1,
                    max_nodes: 4,
                    base_port: 29500,
                    port_span: 100,
                },
                "t".into(),
                "a".into(),
                0,
            );
            // The header `plan::record` writes for these members.
            r.waiting = false;
            r.nnodes = 2;
            r.nproc = 2;
            r.world_size = 4;
            r.members_digest = crate::coord::layout::digest(&members);
            r.hosts_digest = crate::coord::layout::hosts_digest(&members);
            r.members = members;
            assert_eq!(r.check_members(), Ok(()));
            r
        };
        let r1 = record(1, vec![member("a", 1, 1), member("b", 2, 1)]);
        // b's launcher relaunched: the same id, a new lease and incarnation.
        let r2 = record(2, vec![member("a", 1, 1), member("b", 3, 2)]);
        // A spare s took b's place.
        let r3 = record(2, vec![member("a", 1, 1), member("s", 4, 1)]);
        assert_ne!(r1.members_digest, r2.members_digest);
        assert_eq!(r1.hosts_digest, r2.hosts_digest);
        let seen = |r| {
            let mut round = etcd::Round::from_record("j", r, "a", 1, 1);
            // What a host that read only its own place will hold.
            round.members = std::sync::Arc::from(Vec::new());
            round
        };
        let old = seen(&r1);
        assert!(!keeps_place(&old, &seen(&r2)));
        assert!(keeps_place(&old, &seen(&r3)));
        // And with the lists, as every host reads today.
        let full = |r| etcd::Round::from_record("j", r, "a", 1, 1);
        assert!(!keeps_place(&full(&r1), &full(&r2)));
        assert!(keeps_place(&full(&r1), &full(&r3)));
    }

    #[test]
    fn a_round_its_asker_heals_into_keeps_the_place_of_the_same_hosts() {
        let old = round(1, &["a", "b", "c"], Some(2));
        let mut heal = round(2, &["a", "b", "c"], Some(2));
        heal.heal = true;
        assert!(keeps_place(&old, &heal));
        // Still only the same place: moved, or the job's size changed.
        let mut moved = round(2, &["c", "a", "b"], Some(0));
        moved.heal = true;
        assert!(!keeps_place(&old, &moved));
        let mut smaller = round(2, &["a", "c"], Some(1));
        smaller.heal = true;
        assert!(!keeps_place(&old, &smaller));
        let mut earlier = round(1, &["a", "b", "c"], Some(2));
        earlier.heal = true;
        assert!(!keeps_place(&old, &earlier));
    }

    #[test]
    fn an_agent_nobody_can_reach_is_not_published() {
        let e = ckpt_peer(&tier(""), "127.0.0.1:7000", "10.1.2.3").unwrap_err();
        assert!(e.contains("loopback"), "{e}");
        let e = ckpt_peer(&tier(""), "", "10.1.2.3").unwrap_err();
        assert!(e.contains("api.tcp"), "{e}");
        let off = CheckpointConfig {
            enabled: false,
            ..CheckpointConfig::default()
        };
        assert!(ckpt_peer(&off, "0.0.0.0:7000", "10.1.2.3").is_err());
    }
}
