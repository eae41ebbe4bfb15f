//! The records the job's hosts keep in etcd that several parts of the
//! coordinator read: a member's registration, its agent as a checkpoint
//! peer, a round's member, a notice of a coming stop. Shapes only (serde),
//! no I/O and no decisions: the plan, the layout, the session and the
//! notice each import them here and none imports another for them.

use serde::{Deserialize, Serialize};

/// What a launcher registers under `members/<host>`, under its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// The host id.
    pub host: String,
    /// Where the other hosts reach its workers (MASTER_ADDR at rank 0).
    pub addr: String,
    /// Worker processes it runs.
    pub nproc_per_node: u32,
    /// Taken into a round after every regular host.
    pub spare: bool,
    /// Its limits, to warn when the hosts of a job disagree.
    pub min_nodes: u32,
    /// See `min_nodes`.
    pub max_nodes: u32,
    /// The launcher's pid, for whoever reads etcd by hand.
    pub pid: u32,
    /// When it joined (Unix ms), ditto.
    pub joined_at_ms: u64,
    /// Where its agent takes checkpoint replicas; absent when that agent
    /// has no checkpoint tier or no TCP listener (or the launcher is older).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_peer: Option<CkptPeer>,
    /// This launcher process's membership, drawn at random when it joins
    /// and kept when it re-registers under a new lease after its lease
    /// lapsed (an etcd outage, a stall): the rounds know it by this, so a
    /// rejoin is the same member and nobody restarts. 0: a launcher of an
    /// older version, known by its lease alone.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
    /// Its agent takes a replica ring by node-rank order
    /// (`warden_agent::RING_BY_PLACE`): a round whose every checkpoint peer
    /// says so puts the job on it ([`super::plan::RoundRecord::ckpt_ring_by_place`]).
    /// Here, not in [`CkptPeer`], so that a round's member list (the
    /// layout base every host reads) does not carry it per member.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ckpt_ring_by_place: bool,
    /// Its agent's `checkpoint.replicas`, where its agent takes replicas
    /// and judges placement by the job's most (`warden_agent::JOB_REPLICAS`):
    /// the round says the most of them where every checkpoint peer says
    /// its own ([`super::plan::RoundRecord::ckpt_replicas`]). Here, not in
    /// [`CkptPeer`], for the reason above. Absent: not said (a launcher
    /// before it, an older agent, or a config the launcher could not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_replicas: Option<u32>,
}

impl MemberRecord {
    /// What makes a member record read from etcd unusable in a round,
    /// named; `None` when it is usable. Another version's or a hand-written
    /// record may carry anything: a worker count is held to what
    /// `--nproc-per-node` takes (1 to [`crate::nproc::MAX`]), so that no
    /// job below 2^22 hosts sums its workers past a round's `world_size`
    /// (a `u32`).
    pub fn problem(&self) -> Option<String> {
        let max = crate::nproc::MAX;
        if !(1..=max).contains(&self.nproc_per_node) {
            return Some(format!(
                "nproc_per_node {} is not between 1 and {max}",
                self.nproc_per_node
            ));
        }
        None
    }
}

/// A count left out of a record where it is 0 (what a launcher before it
/// wrote): records of every size and version read alike.
pub(crate) fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// A host's agent as a checkpoint peer: the job's other hosts replicate to
/// it and restore from it (`SetCheckpointPeers`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CkptPeer {
    /// `host:port` of the agent's `api.tcp` listener, as the other hosts
    /// reach it.
    pub addr: String,
    /// Its `checkpoint.domain`; empty: a domain of its own.
    #[serde(default)]
    pub domain: String,
    /// The TLS identity of its agent (the first DNS name of the agent's
    /// certificate, its `agent.host_name`): the other agents dial it
    /// expecting that name and authorize its pushes and fetches under it.
    /// Empty: none (`api.insecure`, or a launcher of an older version).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub identity: String,
}

/// A member of a round, in node-rank order in `RoundRecord::members` (`super::plan`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundMember {
    /// The host id.
    pub host: String,
    /// Its address.
    pub addr: String,
    /// Its workers.
    pub nproc_per_node: u32,
    /// The lease it had when the round formed.
    pub lease: i64,
    /// Its agent as a checkpoint peer, copied from its member record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_peer: Option<CkptPeer>,
    /// Its launcher's incarnation ([`MemberRecord::incarnation`]) when the
    /// round formed; 0 from an older launcher.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
}

impl RoundMember {
    /// Whether the launcher `host`, holding `lease` in incarnation
    /// `incarnation`, is this member: the same lease, or the same launcher
    /// process re-registered under a new lease (a lapsed lease rejoined).
    /// Another launcher on the same host id (restarted: a new incarnation)
    /// is not: its workers are new.
    pub fn is(&self, host: &str, lease: i64, incarnation: u64) -> bool {
        self.host == host
            && (self.lease == lease || (self.incarnation != 0 && self.incarnation == incarnation))
    }
}

/// `notices/<epoch>`: what the first host to get a notice in that round
/// told the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticeRecord {
    /// The host whose launcher got the notice.
    pub by: String,
    /// The step at whose boundary every rank of the job saves.
    pub step: u64,
    /// When the stop comes (ms since the Unix epoch; 0: not said).
    pub deadline_ms: u64,
    /// Why (the notice's source and words), for the console.
    pub reason: String,
    /// When it was written (ms since the Unix epoch).
    pub at_ms: u64,
}
