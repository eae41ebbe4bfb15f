//! A round as one host sees it: the stored record plus this host's place.

use super::plan::RoundRecord;
use super::records::CkptPeer;

/// The job's round at one epoch, from this host's side: what its launcher
/// needs to start (or not start) its workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    /// The job id.
    pub job: String,
    /// The epoch: rounds only go forward; any new one means "stop the
    /// workers of the old one".
    pub epoch: u64,
    /// This host's node rank (`GROUP_RANK`); `None` when it is not in the
    /// round (a standby spare, or the round is waiting).
    pub node_rank: Option<u32>,
    /// Hosts in the round (`NNODES`, `GROUP_WORLD_SIZE`).
    pub nnodes: u32,
    /// This host's workers.
    pub local_world_size: u32,
    /// The global rank of this host's local rank 0.
    pub rank_offset: u32,
    /// Workers in the round (`WORLD_SIZE`).
    pub world_size: u32,
    /// Node rank 0's address (`MASTER_ADDR`).
    pub master_addr: String,
    /// The rendezvous port of this epoch (`MASTER_PORT`).
    pub master_port: u16,
    /// The members' host ids in node-rank order. Shared: the coordinator
    /// publishes its round on every watch event, and a clone of a
    /// 12,500-host list per event would be O(N) for nothing.
    pub members: std::sync::Arc<[String]>,
    /// The members' agents that take checkpoint replicas, with their host
    /// ids, in node-rank order (this host's own included).
    /// Shared, as `members`.
    pub ckpt_peers: std::sync::Arc<[(String, CkptPeer)]>,
    /// The record's [`RoundRecord::hosts_digest`]: of one scheme, the same
    /// in two rounds exactly when they hold the same hosts in the same
    /// places. Empty when the record's launcher wrote none.
    pub hosts_digest: String,
    /// The record's [`RoundRecord::ckpt_ring_by_place`]: the job's replica
    /// ring is its node-rank order.
    pub ckpt_ring_by_place: bool,
    /// The record's [`RoundRecord::ckpt_replicas`]: the most
    /// `checkpoint.replicas` among the job's agents (0: not said).
    pub ckpt_replicas: u32,
    /// The record's [`RoundRecord::ckpt_window`]: how many places after
    /// an origin its replica targets may lie (0: none said).
    pub ckpt_window: u32,
    /// Live hosts not in the round (spares, hosts beyond `max_nodes`), as
    /// this host sees them now.
    pub standby: Vec<String>,
    /// Too few hosts: nobody runs workers.
    pub waiting: bool,
    /// Why the round was made.
    pub reason: String,
    /// Which host made it.
    pub decided_by: String,
    /// The host that asked for it heals its workers into it in process
    /// ([`super::plan::RoundRecord::heal`]).
    pub heal: bool,
}

impl Round {
    /// `record` as seen by the host `host` holding lease `lease` in
    /// launcher incarnation `incarnation`.
    pub(crate) fn from_record(
        job: &str,
        record: &RoundRecord,
        host: &str,
        lease: i64,
        incarnation: u64,
    ) -> Self {
        let mut node_rank = None;
        let mut rank_offset = 0u32;
        let mut local_world_size = 0u32;
        if record.nproc != 0 {
            // Every member runs the same workers (checked against the
            // members when the record was read): the place alone gives the
            // offset, with no sum over the hosts before it.
            if let Some(i) = record
                .members
                .iter()
                .position(|m| m.is(host, lease, incarnation))
            {
                node_rank = u32::try_from(i).ok();
                rank_offset = node_rank.map_or(0, |r| r.saturating_mul(record.nproc));
                local_world_size = record.nproc;
            }
        } else {
            let mut before = 0u32;
            for (i, m) in record.members.iter().enumerate() {
                if m.is(host, lease, incarnation) {
                    node_rank = u32::try_from(i).ok();
                    rank_offset = before;
                    local_world_size = m.nproc_per_node;
                }
                before = before.saturating_add(m.nproc_per_node);
            }
        }
        Self {
            job: job.to_owned(),
            epoch: record.epoch,
            node_rank,
            nnodes: record.nnodes,
            local_world_size,
            rank_offset,
            world_size: record.world_size,
            master_addr: record.master_addr.clone(),
            master_port: record.master_port,
            members: record.members.iter().map(|m| m.host.clone()).collect(),
            ckpt_peers: record
                .members
                .iter()
                .filter_map(|m| Some((m.host.clone(), m.ckpt_peer.clone()?)))
                .collect(),
            hosts_digest: record.hosts_digest.clone(),
            ckpt_ring_by_place: record.ckpt_ring_by_place,
            ckpt_replicas: record.ckpt_replicas,
            ckpt_window: record.ckpt_window,
            standby: record.standby.clone(),
            waiting: record.waiting,
            reason: record.reason.clone(),
            decided_by: record.decided_by.clone(),
            heal: record.heal,
        }
    }

    /// Whether this host runs workers in this round.
    pub fn runs_workers(&self) -> bool {
        !self.waiting && self.node_rank.is_some()
    }

    /// The torchrun-compatible environment of local worker `local_rank`
    /// (`RANK`, `LOCAL_RANK`, `GROUP_RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// ...), so training scripts written for torchrun learn the round's world
    /// size without change; `None` when this host has no place in the round
    /// or the local rank is out of range.
    pub fn worker_env(&self, local_rank: u32) -> Option<Vec<(&'static str, String)>> {
        let node_rank = self.node_rank.filter(|_| !self.waiting)?;
        if local_rank >= self.local_world_size {
            return None;
        }
        let rank = self.rank_offset + local_rank;
        Some(vec![
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("GROUP_RANK", node_rank.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("ROLE_WORLD_SIZE", self.world_size.to_string()),
            ("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TORCHELASTIC_RUN_ID", self.job.clone()),
            (
                "TORCHELASTIC_RESTART_COUNT",
                self.epoch.saturating_sub(1).to_string(),
            ),
            ("WARDEN_ROUND_EPOCH", self.epoch.to_string()),
        ])
    }
}

/// At most the first 8 of `names`, and how many more: a round of
/// thousands of hosts is one short line in a log or on the console, not
/// thousands of names per host per round.
pub fn named_briefly(names: &[String]) -> String {
    const SHOWN: usize = 8;
    match names.get(..SHOWN) {
        Some(first) if names.len() > SHOWN => format!(
            "{} hosts: {}, and {} more",
            names.len(),
            first.join(", "),
            names.len() - SHOWN
        ),
        _ => names.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coord::plan::RoundMember;

    fn rec() -> RoundRecord {
        let rm = |host: &str, lease, n| RoundMember {
            host: host.into(),
            addr: format!("10.0.0.{lease}"),
            nproc_per_node: n,
            lease,
            ckpt_peer: None,
            incarnation: u64::try_from(lease).unwrap_or(0) * 100,
        };
        RoundRecord {
            epoch: 3,
            members: vec![rm("a", 1, 4), rm("b", 2, 2), rm("c", 3, 4)],
            standby: vec!["s".into()],
            waiting: false,
            nnodes: 3,
            world_size: 10,
            master_addr: "10.0.0.1".into(),
            master_port: 29503,
            min_nodes: 2,
            max_nodes: 3,
            reason: "r".into(),
            decided_by: "a".into(),
            decided_at_ms: 0,
            layout: None,
            heal: false,
            nproc: 0,
            members_digest: String::new(),
            hosts_digest: String::new(),
            ckpt_ring_by_place: false,
            ckpt_replicas: 0,
            ckpt_window: 0,
        }
    }

    #[test]
    fn ranks_follow_the_members_before_this_host() {
        let r = Round::from_record("j", &rec(), "c", 3, 300);
        assert_eq!(
            (r.node_rank, r.rank_offset, r.local_world_size),
            (Some(2), 6, 4)
        );
        let env = r.worker_env(1).unwrap_or_default();
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("7"));
        assert_eq!(get("GROUP_RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("10"));
        assert_eq!(get("MASTER_PORT"), Some("29503"));
        assert!(r.worker_env(4).is_none());
    }

    #[test]
    fn a_uniform_nproc_gives_the_same_places_as_the_sum() {
        let mut r = rec();
        for m in &mut r.members {
            m.nproc_per_node = 4;
        }
        r.world_size = 12;
        let hosts = [("a", 1), ("b", 2), ("c", 3), ("s", 9)];
        let place = |r: &RoundRecord, (h, l): (&str, i64)| {
            let x = Round::from_record("j", r, h, l, 0);
            (x.node_rank, x.rank_offset, x.local_world_size)
        };
        let summed: Vec<_> = hosts.iter().map(|&h| place(&r, h)).collect();
        r.nproc = 4;
        let by_nproc: Vec<_> = hosts.iter().map(|&h| place(&r, h)).collect();
        assert_eq!(by_nproc, summed);
        assert_eq!(by_nproc[2], (Some(2), 8, 4));
        assert_eq!(by_nproc[3], (None, 0, 0));
    }

    #[test]
    fn a_spare_or_an_old_lease_has_no_place() {
        assert_eq!(Round::from_record("j", &rec(), "s", 9, 900).node_rank, None);
        // Same host id, another lease, another launcher: an earlier
        // incarnation's place.
        let r = Round::from_record("j", &rec(), "b", 42, 4200);
        assert_eq!(r.node_rank, None);
        assert!(!r.runs_workers());
        assert!(r.worker_env(0).is_none());
        // The same launcher rejoined under a new lease keeps its place.
        let r = Round::from_record("j", &rec(), "b", 42, 200);
        assert_eq!(r.node_rank, Some(1));
    }

    #[test]
    fn thousands_of_hosts_are_named_in_one_short_line() {
        let names: Vec<String> = (0..2048).map(|i| format!("h{i}")).collect();
        let line = named_briefly(&names);
        assert!(line.starts_with("2048 hosts: h0, h1,"), "{line}");
        assert!(line.ends_with("h7, and 2040 more"), "{line}");
        assert_eq!(named_briefly(&names[..2]), "h0, h1");
    }
}
