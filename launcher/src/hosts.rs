//! The seam between the launcher and the job's other hosts.
//!
//! On one host every decision is local: [`LocalOnly`]. Across hosts the
//! etcd coordinator ([`super::etcd::EtcdCoordinator`], on `crate::coord`)
//! makes the nodes agree on each attempt (who runs workers, at which node
//! rank, with which world size and rendezvous address), tells the others
//! when this node restarts or stops, and brings their rounds here; without
//! etcd, torchrun's c10d rendezvous run by torch does the same
//! ([`super::c10d::C10dCoordinator`]). The supervisor only talks to this
//! trait.

use std::future::Future;

/// What one attempt runs with, agreed by the job's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptPlan {
    /// The launcher's attempt number on this host (TORCHELASTIC_RESTART_COUNT):
    /// 0 for its first workers, + 1 for every respawn.
    pub restart_count: u32,
    /// Rank 0's address.
    pub master_addr: String,
    /// Rank 0's store port.
    pub master_port: u16,
    /// This node's rank (GROUP_RANK); `None`: no place in the round (a
    /// standby spare), no workers to start.
    pub node_rank: Option<u32>,
    /// Nodes in the attempt (GROUP_WORLD_SIZE).
    pub nnodes: u32,
    /// Workers in the attempt across all nodes (WORLD_SIZE).
    pub world_size: u32,
    /// The global rank of this node's local rank 0.
    pub rank_offset: u32,
    /// The job-wide round the attempt belongs to (WARDEN_ROUND_EPOCH);
    /// `None` on one host.
    pub epoch: Option<u64>,
    /// The round in words (why it was made, its hosts), for the console.
    pub round: Option<String>,
    /// The round's other hosts whose agents take checkpoint replicas, and
    /// this host's place among them: handed to this host's agent
    /// (`SetCheckpointPeers`). Empty on one host.
    pub ckpt_peers: CkptPeers,
    /// Across hosts, etcd's rounds: this round keeps this host's place
    /// from the attempt's round (`etcd::keeps_place`: a spare in a lost
    /// host's place, or a round its asker heals into), so its workers may
    /// heal into it in process. Judged on the round agreed, which may be
    /// later than the one a heal was started for (another host's restart
    /// of the same hosts written meanwhile: that one restarts). False on
    /// one host and under c10d.
    pub keeps_place: bool,
}

/// A round's checkpoint peers as this host hands them to its agent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CkptPeers {
    /// The other hosts whose agents take replicas (host id, agent), in
    /// node-rank order.
    pub others: Vec<(String, crate::coord::records::CkptPeer)>,
    /// How many of `others` come before this host in that order; `None`
    /// when this host's own agent is not among the round's checkpoint
    /// peers (its tier is off). The agent cuts the job-wide exchange's
    /// tree and the restore's collectors from its place in the order, so
    /// a list without it put every agent outside the order (issue 30).
    pub place: Option<u32>,
    /// This host's agent as the round publishes it (the address the other
    /// hosts reach), with `place`: its place on the job's replica ring.
    pub addr: String,
    /// The job's replica ring is its node-rank order (the round says every
    /// agent takes it).
    pub ring_by_place: bool,
    /// The most `checkpoint.replicas` among the job's agents (the round's;
    /// 0: not said).
    pub replicas: u32,
    /// How many places after an origin its replica targets may lie on the
    /// ring by node-rank order (the round's; 0: none said). Said on the
    /// console; not handed to the agent.
    pub window: u32,
}

impl CkptPeers {
    /// This host's view of a round's checkpoint peers (`all`, in node-rank
    /// order, this host among them when its agent takes replicas).
    pub fn of_round(all: &[(String, crate::coord::records::CkptPeer)], host: &str) -> Self {
        let mine = all.iter().position(|(h, _)| h == host);
        Self {
            others: all.iter().filter(|(h, _)| h != host).cloned().collect(),
            place: mine.and_then(|p| u32::try_from(p).ok()),
            addr: mine.map(|p| all[p].1.addr.clone()).unwrap_or_default(),
            ring_by_place: false,
            replicas: 0,
            window: 0,
        }
    }

    /// Whether no other host takes replicas.
    pub fn is_empty(&self) -> bool {
        self.others.is_empty()
    }
}

/// What this node tells the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Directive {
    /// Every node stops its workers and starts the next attempt.
    RestartInJob {
        /// Why (the incident and its diagnosis).
        reason: String,
        /// This node heals its workers into the new round in process
        /// instead of stopping them: the round says so, and nodes that keep
        /// their place heal theirs too (etcd's rounds; torch's c10d
        /// rendezvous has no such round and restarts every node).
        heal: bool,
    },
    /// This node's launcher ends with `exit_code` (0: the job's work here
    /// is done).
    Stop {
        /// The exit status for the scheduler.
        exit_code: i32,
        /// Why.
        reason: String,
        /// The job failed for good (a user error, a spent budget): the
        /// others stop too, with the same status. False when this node goes
        /// alone (a signal, a node fault, another node's stop): the others
        /// go on without it.
        job_failed: bool,
    },
}

/// What the other nodes bring to this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remote {
    /// The job moved to a new round (a restart another node asked for, a
    /// host lost, cordoned or back, a spare taken in): stop the workers and
    /// rendezvous again.
    NewRound {
        /// Why the round was made, and by which host.
        reason: String,
        /// This host keeps its place in the new round (the same node rank,
        /// rank offset, node count and world size) and only other hosts
        /// changed (a lost host's node rank taken by a spare): its workers
        /// can heal into the round in process instead of restarting
        /// ([`crate::machine`]). False on one host and for any other round
        /// (a restart asked for, a scale down or up, a move).
        keeps_place: bool,
    },
    /// Stop the workers and exit with `exit_code`.
    Stop {
        /// The exit status (a failed job's own, 86 when this node is out).
        exit_code: i32,
        /// Why.
        reason: String,
    },
    /// Nothing to do; worth a line on the console.
    Note(String),
    /// Another host got a notice of a coming stop: every rank of the job
    /// saves at `step`'s boundary and leaves; the job ends preempted (85).
    Notice {
        /// The step every rank saves at.
        step: u64,
        /// When the stop comes, as that host was told.
        deadline: Option<std::time::SystemTime>,
        /// Why, and which host got it.
        reason: String,
    },
}

/// What this node's launcher does about a fault of its own node (a cordon,
/// a scale-down decision, a refused health gate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeFault {
    /// Stop here and exit with this status (86: requeue elsewhere).
    Exit(i32),
    /// Stop here, but not as a node fault: too many of the job's hosts
    /// were cordoned within the window (`--max-cordon-share`), so this
    /// one exits 87 (a person should look) and says why.
    Held {
        /// The status to exit with.
        exit_code: i32,
        /// Why, for the console.
        why: String,
        /// The stop, for the agent (ReportJobStop): the hosts cordoned
        /// and the cap.
        report: crate::rule_stop::RuleStop,
    },
}

/// Why the job's nodes could not agree, and the status to exit with.
#[derive(Debug, Clone, thiserror::Error)]
#[error("coordination: {message}")]
pub struct AcrossHostsError {
    /// What went wrong.
    pub message: String,
    /// The launcher's exit status (1 when nothing better applies).
    pub exit_code: i32,
}

impl AcrossHostsError {
    /// An error with the launcher-error status (1).
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            exit_code: super::exit::EXIT_LAUNCHER_ERROR,
        }
    }
}

/// How a launcher coordinates with the launchers of the job's other nodes.
pub trait AcrossHosts: Send {
    /// A short name for the launcher's messages.
    fn name(&self) -> &'static str;

    /// Agrees on the next attempt with the other nodes (a barrier across
    /// hosts); `proposed` is this node's plan (its restart count is kept).
    /// Called for the first attempt and after the workers were stopped.
    fn rendezvous(
        &mut self,
        proposed: AttemptPlan,
    ) -> impl Future<Output = Result<AttemptPlan, AcrossHostsError>> + Send;

    /// Tells the other nodes what this node decided.
    fn publish(
        &mut self,
        d: &Directive,
    ) -> impl Future<Output = Result<(), AcrossHostsError>> + Send;

    /// The next thing the other nodes bring; pending forever when there is
    /// none to come. Cancel-safe: the supervisor drops it for other events.
    fn next_remote(&mut self) -> impl Future<Output = Remote> + Send;

    /// Tells the other nodes of a notice of a coming stop: every rank
    /// saves at `step`'s boundary. Returns the step the job agreed on:
    /// this one, or the one another node published first.
    fn publish_notice(
        &mut self,
        step: u64,
        deadline: std::time::SystemTime,
        reason: &str,
    ) -> impl Future<Output = Result<u64, AcrossHostsError>> + Send;

    /// What a fault of this node means for its launcher.
    fn node_fault(&mut self, reason: &str) -> impl Future<Output = NodeFault> + Send;
}

/// `t` in milliseconds since the Unix epoch, as a notice's deadline travels
/// between hosts (0 before the epoch).
pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A job on one host: every plan stands as proposed, nothing to tell, a
/// node fault ends the job with 86 (the scheduler requeues it elsewhere).
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalOnly;

impl AcrossHosts for LocalOnly {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn rendezvous(&mut self, proposed: AttemptPlan) -> Result<AttemptPlan, AcrossHostsError> {
        Ok(proposed)
    }

    async fn publish(&mut self, _d: &Directive) -> Result<(), AcrossHostsError> {
        Ok(())
    }

    async fn next_remote(&mut self) -> Remote {
        std::future::pending().await
    }

    async fn publish_notice(
        &mut self,
        step: u64,
        _deadline: std::time::SystemTime,
        _reason: &str,
    ) -> Result<u64, AcrossHostsError> {
        Ok(step)
    }

    async fn node_fault(&mut self, _reason: &str) -> NodeFault {
        NodeFault::Exit(warden_core::policy::EXIT_NODE_FAULT)
    }
}
