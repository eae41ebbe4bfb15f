//! The decisions of coordination, as pure functions of etcd's state: when a
//! new round is due ([`trigger`]) and who is in it ([`assign`]).
//!
//! No I/O here: the session reads etcd into a [`Member`] list and the
//! current [`RoundRecord`], asks these functions, and writes the answer in
//! one txn. Every host asks the same functions of the same state, so they
//! agree on what should happen; the txn's compare on the epoch makes sure
//! only one of them writes it, and everybody reads that record.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::records::is_zero;

pub use super::records::{CkptPeer, MemberRecord, RoundMember};

/// A live member: its record and what etcd says about its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The record.
    pub record: MemberRecord,
    /// The lease the key is under: a host that rejoins comes back with
    /// another lease, so a round naming the old one has lost it.
    pub lease: i64,
    /// The key's create revision: join order, the same for every reader.
    pub join_revision: i64,
}

/// The round of one epoch, as stored at `rounds/<epoch>`: every launcher
/// reads this record rather than computing its own, so all agree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// The epoch.
    pub epoch: u64,
    /// The hosts that run workers, in node-rank order; empty when waiting.
    /// Stored empty when `layout` is set (the members are the layout's):
    /// a host fills it in when it reads the record.
    #[serde(default)]
    pub members: Vec<RoundMember>,
    /// Live hosts not in the round (spares, or beyond `max_nodes`).
    pub standby: Vec<String>,
    /// Too few hosts: nobody runs workers until a later round.
    pub waiting: bool,
    /// `members.len()`.
    pub nnodes: u32,
    /// The sum of the members' workers.
    pub world_size: u32,
    /// Node rank 0's address; empty when waiting.
    pub master_addr: String,
    /// `base_port + epoch % port_span`.
    pub master_port: u16,
    /// The limits it was formed under.
    pub min_nodes: u32,
    /// See `min_nodes`.
    pub max_nodes: u32,
    /// Why this round: "formed", "restart requested by ...", "host-c lost", ...
    pub reason: String,
    /// The host that wrote it.
    pub decided_by: String,
    /// When (Unix ms).
    pub decided_at_ms: u64,
    /// Where the members are stored: a base written apart and this
    /// round's delta from it ([`super::layout`]); `None` in a waiting
    /// round and in records of launchers before issue 30, whose
    /// `members` are inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<super::layout::LayoutRef>,
    /// The host that asked for this round heals its workers into it in
    /// process (a hang across hosts, judged before a lost host's lease ran
    /// out): a host that keeps its place heals its own too, where a
    /// restart of the same hosts would have killed every worker and read
    /// the checkpoint. Absent (false) in any other round and in records of
    /// launchers before it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub heal: bool,
    /// The workers every member runs, when they all run the same number:
    /// node rank `r`'s first global rank is then `r * nproc`, known from
    /// the header alone. 0 when they differ, in a waiting round, and in
    /// records of launchers before it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nproc: u32,
    /// [`super::layout::digest`] of the members in node-rank order: a host
    /// checks the members it made from a base and a delta against it.
    /// Empty in records of launchers before it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub members_digest: String,
    /// [`super::layout::hosts_digest`] of the members: the host ids alone,
    /// so that a host can tell whether another host took a place without
    /// the member lists. Empty in records of launchers before it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hosts_digest: String,
    /// The job's replica ring is its node-rank order: every member whose
    /// agent takes replicas said its agent takes that ring
    /// ([`super::records::MemberRecord::ckpt_ring_by_place`]), and at least
    /// one does. Absent: by address (an older launcher's round, or an
    /// older agent anywhere), as every agent then computes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ckpt_ring_by_place: bool,
    /// The most `checkpoint.replicas` among the agents of the members
    /// that take replicas ([`super::records::MemberRecord::ckpt_replicas`]),
    /// where every one of them said its own (so judges by the job's), at
    /// most 16: each agent takes an origin's shards when it is among the
    /// first that many of the origin's targets, so a host configured with
    /// fewer does not refuse what an origin with more sends it. 0: not
    /// said (an older launcher's round, or a member that does not say
    /// it): each agent its own.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ckpt_replicas: u32,
    /// On the ring by node-rank order, how many places after an origin
    /// its replica targets may lie (`warden_agent::ckpt::placement::window`
    /// at [`RoundRecord::ckpt_replicas`]): a host that knows the places
    /// within this many of it on each side agrees with every other host on
    /// every origin it holds or sends to, the part of the order a partial
    /// view must hold for the replicas. 0: none said (the ring by address,
    /// no replicas said, a walk past
    /// [`warden_agent::ckpt::placement::MAX_WINDOW`] places, or too few
    /// domains): a host needs every place.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ckpt_window: u32,
}

/// [`RoundRecord::ckpt_window`] over the checkpoint peers' ring by place.
fn ckpt_window(ring: &[warden_agent::ckpt::placement::RingMember], replicas: u32) -> u32 {
    use warden_agent::ckpt::placement::{MAX_WINDOW, window};
    let replicas = usize::try_from(replicas).unwrap_or(usize::MAX);
    // No replicas: a window of 0, as "none said".
    window(ring, replicas, MAX_WINDOW)
        .and_then(|w| u32::try_from(w).ok())
        .unwrap_or(0)
}

impl RoundRecord {
    /// Checks the members (inline, or made from the layout) against the
    /// header: the digest, and with `nproc` set every member's workers and
    /// the world size. Each check passes when its field is absent (a
    /// launcher before it).
    pub fn check_members(&self) -> Result<(), super::layout::LayoutError> {
        use super::layout::LayoutError;
        if self.nproc != 0 {
            if let Some((index, m)) = self
                .members
                .iter()
                .enumerate()
                .find(|(_, m)| m.nproc_per_node != self.nproc)
            {
                return Err(LayoutError::Nproc {
                    index,
                    host: m.host.clone(),
                    got: m.nproc_per_node,
                    want: self.nproc,
                });
            }
            if u64::from(self.nnodes) * u64::from(self.nproc) != u64::from(self.world_size) {
                return Err(LayoutError::WorldSize {
                    world_size: self.world_size,
                    nnodes: self.nnodes,
                    nproc: self.nproc,
                });
            }
        }
        super::layout::check_digest(&self.members, &self.members_digest, &self.hosts_digest)
    }
}

/// The job's size limits and port rule: the inputs of a round besides
/// etcd's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Fewest hosts.
    pub min_nodes: u32,
    /// Most hosts.
    pub max_nodes: u32,
    /// Rendezvous port of epoch 0.
    pub base_port: u16,
    /// Ports cycled through.
    pub port_span: u16,
}

/// How soon a new round is due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// Nothing to do.
    None,
    /// Now: a member is gone (its workers are broken anyway), or the round
    /// can reach `max_nodes`.
    Now(String),
    /// After the last call, to let more hosts arrive first.
    AfterLastCall(String),
    /// After the rejoin grace: every missing member vanished with its
    /// lease (no departure written, no other launcher on its host id), as
    /// when etcd was out or the host stalled longer than a TTL. Its
    /// launcher re-registers under a new lease within the grace and is the
    /// same member again; only if it does not is the round re-formed.
    AfterRejoinGrace(String),
}

/// Who would be in the next round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// In node-rank order.
    pub members: Vec<Member>,
    /// Live hosts left out.
    pub standby: Vec<String>,
}

/// Whether `member` is the host the round member names (same lease, or the
/// same launcher rejoined under a new one).
fn same(rm: &RoundMember, m: &Member) -> bool {
    rm.is(&m.record.host, m.lease, m.record.incarnation)
}

/// The round's members by host id: host -> node rank.
fn ranks(round: &RoundRecord) -> HashMap<String, usize> {
    round
        .members
        .iter()
        .enumerate()
        .map(|(i, rm)| (rm.host.clone(), i))
        .collect()
}

/// Whether `m` is a member of `round` (`ranks` is [`ranks`] of it).
fn in_round(round: Option<&RoundRecord>, ranks: &HashMap<String, usize>, m: &Member) -> bool {
    round.is_some_and(|r| {
        ranks
            .get(&m.record.host)
            .and_then(|&i| r.members.get(i))
            .is_some_and(|rm| same(rm, m))
    })
}

/// What [`decide`] needs of the live members against the current round,
/// kept up to date one member at a time: built once per round
/// ([`Standing::new`], O(N log N)), then each member key written or
/// deleted costs O(log N) ([`Standing::member_changed`]). Before it (issue
/// 30) every watch event ran scans of every live host against every round
/// member: 18 ms of one host's CPU per event at 2,048 hosts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standing {
    /// The round's members by host id: host -> node rank.
    ranks: HashMap<String, usize>,
    /// Node ranks of the round's members that no live member is (lost).
    lost: BTreeSet<usize>,
    /// Live members not in the round, in the order they are taken:
    /// regular hosts before spares, each by join revision.
    candidates: BTreeSet<(bool, i64, String)>,
    /// Each candidate's place in `candidates`, by host id.
    candidate_of: HashMap<String, (bool, i64)>,
    /// How many members are live.
    live: usize,
    /// Live members by join (create revision), for the deciders
    /// ([`super::deciders`]) and their place in the writers' line.
    by_join: BTreeSet<(i64, String)>,
    /// Each live member's join revision, by host id.
    join_of: HashMap<String, i64>,
}

impl Standing {
    /// The standing of `live` (by host id) against `round`.
    pub fn new(round: Option<&RoundRecord>, live: &BTreeMap<String, Member>) -> Self {
        let mut s = Self {
            ranks: round.map(ranks).unwrap_or_default(),
            live: live.len(),
            ..Self::default()
        };
        if let Some(r) = round {
            s.lost = (0..r.members.len()).collect();
        }
        for host in live.keys() {
            s.member_changed(round, live, host);
        }
        s
    }

    /// `round`'s lost members (no live member is them), in node-rank
    /// order: O(lost).
    pub fn lost_members<'a>(
        &'a self,
        round: &'a RoundRecord,
    ) -> impl Iterator<Item = &'a RoundMember> + 'a {
        self.lost.iter().filter_map(|&i| round.members.get(i))
    }

    /// The host ids of [`Standing::lost_members`].
    pub fn lost_hosts(&self, round: &RoundRecord) -> Vec<String> {
        self.lost_members(round).map(|m| m.host.clone()).collect()
    }

    /// After `host`'s member key was written or deleted in `live`.
    pub fn member_changed(
        &mut self,
        round: Option<&RoundRecord>,
        live: &BTreeMap<String, Member>,
        host: &str,
    ) {
        self.live = live.len();
        if let Some(key) = self.candidate_of.remove(host) {
            self.candidates.remove(&(key.0, key.1, host.to_owned()));
        }
        let member = live.get(host);
        if let Some(rev) = self.join_of.remove(host) {
            self.by_join.remove(&(rev, host.to_owned()));
        }
        if let Some(m) = member {
            self.by_join.insert((m.join_revision, host.to_owned()));
            self.join_of.insert(host.to_owned(), m.join_revision);
        }
        let rank = self.ranks.get(host).copied();
        if let (Some(i), Some(r)) = (rank, round)
            && let Some(rm) = r.members.get(i)
        {
            if member.is_some_and(|m| same(rm, m)) {
                self.lost.remove(&i);
                return;
            }
            self.lost.insert(i);
        }
        if let Some(m) = member {
            let key = (m.record.spare, m.join_revision);
            self.candidates.insert((key.0, key.1, host.to_owned()));
            self.candidate_of.insert(host.to_owned(), key);
        }
    }

    /// Live hosts whose host id is not in the round (the standby), sorted.
    pub fn standby(&self) -> Vec<String> {
        let mut hosts: Vec<String> = self
            .candidates
            .iter()
            .filter(|(_, _, h)| !self.ranks.contains_key(h))
            .map(|(_, _, h)| h.clone())
            .collect();
        hosts.sort();
        hosts
    }

    /// Whether some member of the round is still live.
    pub fn any_member_live(&self) -> bool {
        self.lost.len() < self.ranks.len()
    }

    /// Whether `host` has a place in the round (by host id).
    pub fn in_round(&self, host: &str) -> bool {
        self.ranks.contains_key(host)
    }

    /// `host`'s place in line to write the next round, capped at `cap`:
    /// 0 for the live member of the round with the lowest node rank (or,
    /// when no member is live, the first candidate), then the others in
    /// node-rank order, then the candidates in the order they are taken.
    /// Every host computes the same line from the same view, so one writes
    /// and the others only stand by in case it cannot (issue 30: a lost
    /// host made every host of the job try the txn). O(lost members + cap).
    pub fn writer_place(&self, host: &str, cap: usize) -> usize {
        let members = self.ranks.len() - self.lost.len().min(self.ranks.len());
        if let Some(&i) = self.ranks.get(host)
            && !self.lost.contains(&i)
        {
            return (i - self.lost.range(..i).count()).min(cap);
        }
        self.candidates
            .iter()
            .take(cap)
            .position(|(_, _, h)| h == host)
            .map_or(cap, |p| (members + p).min(cap))
    }

    /// `host`'s place in line among the hosts that decide rounds: the first
    /// `deciders` live members by join, and `host` itself (it decides).
    /// Each is ordered by its [`Standing::writer_place`] (capped at
    /// `2 * cap`), then by join; capped at `cap`. A host that does not
    /// decide never writes, so a decider does not wait for one that is
    /// before it in node-rank order. O(deciders * (lost members + cap)).
    pub fn decider_place(&self, host: &str, deciders: usize, cap: usize) -> usize {
        let wide = cap.saturating_mul(2);
        let key = |h: &str| {
            (
                self.writer_place(h, wide),
                self.join_of.get(h).copied().unwrap_or(i64::MAX),
            )
        };
        let mine = key(host);
        self.by_join
            .iter()
            .take(deciders)
            .filter(|(_, h)| h != host && key(h) < mine)
            .count()
            .min(cap)
    }
}

/// Live members not in `round`, in the order they are taken: regular hosts
/// before spares, each by join revision.
fn candidates<'a>(round: Option<&RoundRecord>, live: &'a [Member]) -> Vec<&'a Member> {
    let ranks = round.map(ranks).unwrap_or_default();
    let mut c: Vec<&Member> = live
        .iter()
        .filter(|m| !in_round(round, &ranks, m))
        .collect();
    c.sort_by_key(|m| (m.record.spare, m.join_revision, m.record.host.clone()));
    c
}

/// The round after `prev`, given the live members.
///
/// Members of `prev` that are still live keep their place; a lost member's
/// node rank goes to the first candidate (hot-swap), or, with none, the
/// survivors close ranks (scale down); then candidates fill up to
/// `max_nodes` (scale up). Fewer than `min_nodes` makes a waiting round.
pub fn assign(prev: Option<&RoundRecord>, live: &[Member], limits: Limits) -> Assignment {
    // By host id, so each of the previous round's members is one lookup
    // (issue 30: a scan of the live hosts per member was O(N^2)).
    let by_host: HashMap<&str, &Member> =
        live.iter().map(|m| (m.record.host.as_str(), m)).collect();
    let mut queue = candidates(prev, live).into_iter();
    let max = usize::try_from(limits.max_nodes).unwrap_or(usize::MAX);
    let min = usize::try_from(limits.min_nodes).unwrap_or(usize::MAX);
    let mut members: Vec<Member> = Vec::new();
    if let Some(prev) = prev {
        for rm in &prev.members {
            match by_host.get(rm.host.as_str()).filter(|m| same(rm, m)) {
                Some(m) => members.push((*m).clone()),
                None => {
                    if let Some(c) = queue.next() {
                        members.push(c.clone());
                    }
                }
            }
        }
    }
    let mut standby: Vec<String> = Vec::new();
    // A lower max_nodes than the previous round's: the last ranks go.
    while members.len() > max {
        if let Some(m) = members.pop() {
            standby.insert(0, m.record.host);
        }
    }
    while members.len() < max {
        match queue.next() {
            Some(c) => members.push(c.clone()),
            None => break,
        }
    }
    standby.extend(queue.map(|m| m.record.host.clone()));
    if members.len() < min {
        standby = live.iter().map(|m| m.record.host.clone()).collect();
        standby.sort();
        members.clear();
    }
    Assignment { members, standby }
}

/// Whether a new round is due after `round` (the current one, `None`
/// before the first), given the live members and the hosts that said why
/// they left (`departures`, host -> reason). `ended`: the job finished or
/// failed at this round, so members that leave are not replaced.
///
/// Builds the [`Standing`] and asks [`decide`]: for a one-off question;
/// the coordinator keeps its standing up to date instead.
pub fn trigger(
    round: Option<&RoundRecord>,
    live: &[Member],
    departures: &BTreeMap<String, String>,
    ended: bool,
    limits: Limits,
) -> Trigger {
    let live: BTreeMap<String, Member> = live
        .iter()
        .map(|m| (m.record.host.clone(), m.clone()))
        .collect();
    let standing = Standing::new(round, &live);
    decide(round, &standing, &live, departures, ended, limits)
}

/// [`trigger`] on a kept [`Standing`] of `live` against `round`: O(log N)
/// plus what changed (the lost members and the candidates it names).
pub fn decide(
    round: Option<&RoundRecord>,
    standing: &Standing,
    live: &BTreeMap<String, Member>,
    departures: &BTreeMap<String, String>,
    ended: bool,
    limits: Limits,
) -> Trigger {
    let max = usize::try_from(limits.max_nodes).unwrap_or(usize::MAX);
    let min = usize::try_from(limits.min_nodes).unwrap_or(usize::MAX);
    let running = round.filter(|r| !r.waiting);
    let Some(round) = running else {
        // Before the first round, or waiting for hosts.
        let hosts = standing.live;
        return if hosts >= max {
            Trigger::Now(format!("{hosts} host(s) present (max {max})"))
        } else if hosts >= min {
            Trigger::AfterLastCall(format!("{hosts} host(s) present (min {min}, max {max})"))
        } else {
            Trigger::None
        };
    };
    let lost: Vec<&RoundMember> = standing.lost_members(round).collect();
    if !lost.is_empty() {
        if ended && lost.len() < round.members.len() {
            // The job is over; the others are finishing too.
            return Trigger::None;
        }
        let mut vanished_only = true;
        let why: Vec<String> = lost
            .iter()
            .map(|rm| match departures.get(&rm.host) {
                Some(reason) => {
                    vanished_only = false;
                    format!("{} left ({reason})", rm.host)
                }
                None if live.contains_key(&rm.host) => {
                    vanished_only = false;
                    format!("{} rejoined", rm.host)
                }
                None => format!("{} lost", rm.host),
            })
            .collect();
        let why = why.join(", ");
        // A member gone without a word may be rejoining (its lease lapsed);
        // one that said why, or a new launcher on its host id, is gone.
        return if vanished_only && lost.iter().all(|rm| rm.incarnation != 0) {
            Trigger::AfterRejoinGrace(why)
        } else {
            Trigger::Now(why)
        };
    }
    if ended {
        return Trigger::None;
    }
    let new = &standing.candidates;
    if round.members.len() < max && !new.is_empty() {
        let names: Vec<&str> = new.iter().map(|(_, _, h)| h.as_str()).collect();
        let why = format!("scale up: {} joined", names.join(", "));
        return if round.members.len() + new.len() >= max {
            Trigger::Now(why)
        } else {
            Trigger::AfterLastCall(why)
        };
    }
    Trigger::None
}

/// The record of round `epoch` for an assignment.
pub fn record(
    epoch: u64,
    assignment: Assignment,
    limits: Limits,
    reason: String,
    decided_by: String,
    decided_at_ms: u64,
) -> RoundRecord {
    let peers = || {
        assignment
            .members
            .iter()
            .filter(|m| m.record.ckpt_peer.is_some())
    };
    let ckpt_ring_by_place =
        peers().next().is_some() && peers().all(|m| m.record.ckpt_ring_by_place);
    // Only where every agent judges by it: an older one would still refuse
    // the copies past its own count. At most what an agent takes.
    let ckpt_replicas = if peers().all(|m| m.record.ckpt_replicas.is_some()) {
        peers()
            .filter_map(|m| m.record.ckpt_replicas)
            .max()
            .unwrap_or(0)
            .min(u32::try_from(warden_agent::ckpt::config::MAX_REPLICAS).unwrap_or(u32::MAX))
    } else {
        0
    };
    let ckpt_window = if ckpt_ring_by_place {
        let ring: Vec<warden_agent::ckpt::placement::RingMember> = peers()
            .filter_map(|m| m.record.ckpt_peer.as_ref())
            .map(|p| warden_agent::ckpt::placement::RingMember::at(&p.addr, &p.domain))
            .collect();
        ckpt_window(&ring, ckpt_replicas)
    } else {
        0
    };
    let members: Vec<RoundMember> = assignment
        .members
        .into_iter()
        .map(|m| RoundMember {
            host: m.record.host,
            addr: m.record.addr,
            nproc_per_node: m.record.nproc_per_node,
            lease: m.lease,
            ckpt_peer: m.record.ckpt_peer,
            incarnation: m.record.incarnation,
        })
        .collect();
    let span = u64::from(limits.port_span.max(1));
    let offset = u16::try_from(epoch % span).unwrap_or(0);
    let nproc = match members.split_first() {
        Some((first, rest))
            if rest
                .iter()
                .all(|m| m.nproc_per_node == first.nproc_per_node) =>
        {
            first.nproc_per_node
        }
        _ => 0,
    };
    // A waiting round has neither digest.
    let (members_digest, hosts_digest) = if members.is_empty() {
        Default::default()
    } else {
        (
            super::layout::digest(&members),
            super::layout::hosts_digest(&members),
        )
    };
    RoundRecord {
        epoch,
        waiting: members.is_empty(),
        nnodes: u32::try_from(members.len()).unwrap_or(u32::MAX),
        // Members are read with at most `nproc::MAX` workers each
        // (`MemberRecord::problem`), so this cannot reach `u32::MAX` below
        // 2^22 hosts; saturating rather than a sum that would wrap (or,
        // in a debug build, panic) past that.
        world_size: members
            .iter()
            .fold(0u32, |n, m| n.saturating_add(m.nproc_per_node)),
        master_addr: members.first().map(|m| m.addr.clone()).unwrap_or_default(),
        master_port: limits.base_port.saturating_add(offset),
        nproc,
        members_digest,
        hosts_digest,
        ckpt_ring_by_place,
        ckpt_replicas,
        ckpt_window,
        members,
        standby: assignment.standby,
        min_nodes: limits.min_nodes,
        max_nodes: limits.max_nodes,
        reason,
        decided_by,
        decided_at_ms,
        layout: None,
        heal: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_record_without_a_checkpoint_peer_still_reads() {
        // What a launcher of the previous version wrote.
        let old = r#"{"host":"h","addr":"10.0.0.1","nproc_per_node":8,"spare":false,
            "min_nodes":1,"max_nodes":2,"pid":7,"joined_at_ms":1}"#;
        let r: MemberRecord = serde_json::from_str(old).unwrap();
        assert_eq!(r.ckpt_peer, None);
        let with = MemberRecord {
            ckpt_peer: Some(CkptPeer {
                addr: "10.0.0.1:7000".into(),
                domain: "rack1".into(),
                identity: "h".into(),
            }),
            ..r
        };
        let back: MemberRecord =
            serde_json::from_str(&serde_json::to_string(&with).unwrap()).unwrap();
        assert_eq!(back, with);
    }

    const LIMITS: Limits = Limits {
        min_nodes: 2,
        max_nodes: 3,
        base_port: 29500,
        port_span: 1000,
    };

    fn m(host: &str, lease: i64, rev: i64, spare: bool) -> Member {
        Member {
            record: MemberRecord {
                host: host.into(),
                addr: format!("addr-{host}"),
                nproc_per_node: 2,
                spare,
                min_nodes: 2,
                max_nodes: 3,
                pid: 1,
                joined_at_ms: 0,
                ckpt_peer: None,
                incarnation: 100 + u64::try_from(rev).unwrap(),
                ckpt_ring_by_place: false,
                ckpt_replicas: None,
            },
            lease,
            join_revision: rev,
        }
    }

    fn round_of(epoch: u64, live: &[Member], limits: Limits) -> RoundRecord {
        record(
            epoch,
            assign(None, live, limits),
            limits,
            "t".into(),
            "t".into(),
            0,
        )
    }

    fn hosts(r: &RoundRecord) -> Vec<&str> {
        r.members.iter().map(|m| m.host.as_str()).collect()
    }

    fn none() -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    #[test]
    fn first_round_waits_for_min_then_last_call_then_max() {
        let a = m("a", 1, 10, false);
        let b = m("b", 2, 11, false);
        let c = m("c", 3, 12, false);
        assert_eq!(
            trigger(None, std::slice::from_ref(&a), &none(), false, LIMITS),
            Trigger::None
        );
        assert!(matches!(
            trigger(None, &[a.clone(), b.clone()], &none(), false, LIMITS),
            Trigger::AfterLastCall(_)
        ));
        assert!(matches!(
            trigger(
                None,
                &[a.clone(), b.clone(), c.clone()],
                &none(),
                false,
                LIMITS
            ),
            Trigger::Now(_)
        ));
        // Join order decides ranks, not the order etcd listed them in.
        let r = round_of(1, &[c, b, a], LIMITS);
        assert_eq!(hosts(&r), ["a", "b", "c"]);
        assert_eq!(
            (r.nnodes, r.world_size, r.master_addr.as_str()),
            (3, 6, "addr-a")
        );
        assert_eq!(r.master_port, 29501);
        assert!(!r.waiting);
    }

    #[test]
    fn lost_member_scales_down_and_returning_host_scales_up() {
        let (a, b, c) = (
            m("a", 1, 10, false),
            m("b", 2, 11, false),
            m("c", 3, 12, false),
        );
        let r1 = round_of(1, &[a.clone(), b.clone(), c.clone()], LIMITS);
        let live = [a.clone(), c.clone()];
        assert_eq!(
            trigger(Some(&r1), &live, &none(), false, LIMITS),
            Trigger::AfterRejoinGrace("b lost".into())
        );
        let r2 = record(
            2,
            assign(Some(&r1), &live, LIMITS),
            LIMITS,
            "".into(),
            "".into(),
            0,
        );
        assert_eq!(hosts(&r2), ["a", "c"]);
        assert_eq!(r2.world_size, 4);
        // b comes back with a new lease: it fills the round to max at once.
        let b2 = m("b", 4, 20, false);
        let live = [a, c, b2];
        assert_eq!(
            trigger(Some(&r2), &live, &none(), false, LIMITS),
            Trigger::Now("scale up: b joined".into())
        );
        let r3 = record(
            3,
            assign(Some(&r2), &live, LIMITS),
            LIMITS,
            "".into(),
            "".into(),
            0,
        );
        assert_eq!(hosts(&r3), ["a", "c", "b"]);
        assert_eq!(
            trigger(Some(&r3), &live, &none(), false, LIMITS),
            Trigger::None
        );
    }

    #[test]
    fn the_header_carries_a_uniform_nproc_and_the_members_digest_and_checks_them() {
        let (a, b, c) = (
            m("a", 1, 10, false),
            m("b", 2, 11, false),
            m("c", 3, 12, false),
        );
        let r = round_of(1, &[a.clone(), b.clone(), c.clone()], LIMITS);
        assert_eq!(r.nproc, 2);
        assert_eq!(r.members_digest, super::super::layout::digest(&r.members));
        assert_eq!(
            r.hosts_digest,
            super::super::layout::hosts_digest(&r.members)
        );
        assert_eq!(r.check_members(), Ok(()));
        // Read back as stored, and from a launcher before these fields.
        let back: RoundRecord = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        let mut old = serde_json::to_value(&r).unwrap();
        old.as_object_mut().unwrap().remove("nproc");
        old.as_object_mut().unwrap().remove("members_digest");
        old.as_object_mut().unwrap().remove("hosts_digest");
        let old: RoundRecord = serde_json::from_value(old).unwrap();
        assert_eq!((old.nproc, old.members_digest.as_str()), (0, ""));
        assert_eq!(old.hosts_digest, "");
        assert_eq!(old.check_members(), Ok(()));
        // Members that do not match their header are refused by name.
        let mut other = r.clone();
        other.members.swap(0, 1);
        let e = other.check_members().unwrap_err();
        assert!(e.to_string().contains("digest"), "{e}");
        let mut wider = r.clone();
        wider.members[2].nproc_per_node = 4;
        let e = wider.check_members().unwrap_err();
        assert!(e.to_string().contains("member 2 (c) runs 4 workers"), "{e}");
        let mut world = r.clone();
        world.world_size = 7;
        let e = world.check_members().unwrap_err();
        assert!(
            e.to_string()
                .contains("world size is 7, not its 3 hosts x 2"),
            "{e}"
        );
        // Hosts of different widths: no uniform nproc, the digest still.
        let mut wide = c;
        wide.record.nproc_per_node = 8;
        let r = round_of(2, &[a, b, wide], LIMITS);
        assert_eq!((r.nproc, r.world_size), (0, 12));
        assert_eq!(r.check_members(), Ok(()));
        // A waiting round has neither.
        let w = round_of(3, &[], LIMITS);
        assert!(w.waiting);
        assert_eq!((w.nproc, w.members_digest.as_str()), (0, ""));
        assert_eq!(w.hosts_digest, "");
        // A record whose two digests disagree (its hosts digest another
        // list's) is refused: a host would otherwise heal or restart on it
        // against what its members say.
        let mut mixed = round_of(4, &[m("a", 1, 10, false), m("b", 2, 11, false)], LIMITS);
        mixed.hosts_digest = super::super::layout::hosts_digest(&mixed.members[..1]);
        let e = mixed.check_members().unwrap_err();
        assert!(e.to_string().contains(&mixed.hosts_digest), "{e}");
    }

    /// `x` with its agent taking replicas at port 7000 of its address, in
    /// `domain`.
    fn with_ckpt_peer(mut x: Member, domain: &str) -> Member {
        x.record.ckpt_peer = Some(CkptPeer {
            addr: format!("{}:7000", x.record.addr),
            domain: domain.into(),
            identity: String::new(),
        });
        x
    }

    /// The ring by node-rank order is the job's only where every member
    /// whose agent takes replicas says its agent takes it: one older agent
    /// keeps every host on the ring by address, which it computes too. A
    /// member without a checkpoint peer is on no ring and decides nothing;
    /// a round from a launcher before the field reads as by address.
    #[test]
    fn the_ring_by_place_needs_every_checkpoint_peers_agent() {
        let peer = |x: Member, by_place: bool| {
            let mut x = with_ckpt_peer(x, "");
            x.record.ckpt_ring_by_place = by_place;
            x
        };
        let (a, b, c) = (
            m("a", 1, 10, false),
            m("b", 2, 11, false),
            m("c", 3, 12, false),
        );
        let all = [
            peer(a.clone(), true),
            peer(b.clone(), true),
            peer(c.clone(), true),
        ];
        let r = round_of(1, &all, LIMITS);
        assert!(r.ckpt_ring_by_place);
        let one_old = [
            peer(a.clone(), true),
            peer(b.clone(), false),
            peer(c.clone(), true),
        ];
        assert!(!round_of(2, &one_old, LIMITS).ckpt_ring_by_place);
        // c takes no replicas (its tier is off): a and b decide.
        let no_tier = [peer(a.clone(), true), peer(b.clone(), true), c.clone()];
        assert!(round_of(3, &no_tier, LIMITS).ckpt_ring_by_place);
        assert!(
            !round_of(4, &[a, b, c], LIMITS).ckpt_ring_by_place,
            "no ring at all"
        );
        let mut old = serde_json::to_value(&r).unwrap();
        assert_eq!(old["ckpt_ring_by_place"], true);
        old.as_object_mut().unwrap().remove("ckpt_ring_by_place");
        let old: RoundRecord = serde_json::from_value(old).unwrap();
        assert!(!old.ckpt_ring_by_place);
    }

    /// The round says the most `checkpoint.replicas` among the members
    /// whose agents take replicas (a member without a tier says nothing),
    /// at most 16, where every one of them says its own; it leaves it out
    /// where one does not (an older agent, which would still refuse the
    /// copies past its own count), as a launcher before it did.
    #[test]
    fn the_round_says_the_most_replicas_of_its_checkpoint_peers() {
        let with = |x: Member, peer: bool, replicas: Option<u32>| {
            let mut x = if peer { with_ckpt_peer(x, "") } else { x };
            x.record.ckpt_replicas = replicas;
            x
        };
        let (a, b, c) = (
            m("a", 1, 10, false),
            m("b", 2, 11, false),
            m("c", 3, 12, false),
        );
        let mixed = [
            with(a.clone(), true, Some(1)),
            with(b.clone(), true, Some(3)),
            with(c.clone(), true, Some(0)),
        ];
        assert_eq!(round_of(1, &mixed, LIMITS).ckpt_replicas, 3);
        let off = [
            with(a.clone(), true, Some(1)),
            with(b.clone(), true, Some(2)),
            with(c.clone(), false, Some(5)),
        ];
        assert_eq!(
            round_of(2, &off, LIMITS).ckpt_replicas,
            2,
            "c's tier is off"
        );
        let one_old = [
            with(a.clone(), true, Some(1)),
            with(b.clone(), true, None),
            with(c.clone(), true, Some(3)),
        ];
        assert_eq!(
            round_of(4, &one_old, LIMITS).ckpt_replicas,
            0,
            "b's agent is older"
        );
        let past = [
            with(a.clone(), true, Some(40)),
            with(b.clone(), true, Some(1)),
            with(c.clone(), true, Some(1)),
        ];
        assert_eq!(round_of(5, &past, LIMITS).ckpt_replicas, 16, "at most 16");
        let r = round_of(3, &[a, b, c], LIMITS);
        assert_eq!(r.ckpt_replicas, 0);
        assert_eq!(r.ckpt_window, 0, "no ring by place, no window");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("ckpt_replicas").is_none(), "{json}");
        assert!(json.get("ckpt_window").is_none(), "{json}");
    }

    /// On the ring by place the round says how far along the order an
    /// origin's targets lie, at the round's most replicas: a, b in one
    /// rack and c in another, one replica: a's target is c, two places on.
    /// Two replicas with two racks: the walk needs every place, no window.
    #[test]
    fn the_round_says_the_window_of_its_ring_by_place() {
        let peer = |x: Member, domain: &str, replicas: u32| {
            let mut x = with_ckpt_peer(x, domain);
            x.record.ckpt_ring_by_place = true;
            x.record.ckpt_replicas = Some(replicas);
            x
        };
        let (a, b, c) = (
            m("a", 1, 10, false),
            m("b", 2, 11, false),
            m("c", 3, 12, false),
        );
        let racks = |replicas| {
            [
                peer(a.clone(), "r0", replicas),
                peer(b.clone(), "r0", replicas),
                peer(c.clone(), "r1", replicas),
            ]
        };
        let r = round_of(1, &racks(1), LIMITS);
        assert_eq!(r.members[0].host, "a");
        assert_eq!((r.ckpt_replicas, r.ckpt_window), (1, 2));
        assert_eq!(round_of(2, &racks(2), LIMITS).ckpt_window, 0);
        // No domain set: each host its own, the next place.
        let own = [
            peer(a.clone(), "", 1),
            peer(b.clone(), "", 1),
            peer(c.clone(), "", 1),
        ];
        assert_eq!(round_of(3, &own, LIMITS).ckpt_window, 1);
    }

    #[test]
    fn spare_takes_the_lost_members_rank() {
        let limits = Limits {
            min_nodes: 2,
            max_nodes: 2,
            ..LIMITS
        };
        // The spare joined first, but regular hosts go first.
        let s = m("s", 9, 5, true);
        let (a, b) = (m("a", 1, 10, false), m("b", 2, 11, false));
        let r1 = round_of(1, &[s.clone(), a.clone(), b.clone()], limits);
        assert_eq!(hosts(&r1), ["a", "b"]);
        assert_eq!(r1.standby, ["s"]);
        let live = [s.clone(), b.clone()];
        let mut departures = BTreeMap::new();
        departures.insert("a".to_owned(), "cordoned: xid 79".to_owned());
        assert_eq!(
            trigger(Some(&r1), &live, &departures, false, limits),
            Trigger::Now("a left (cordoned: xid 79)".into())
        );
        let r2 = record(
            2,
            assign(Some(&r1), &live, limits),
            limits,
            "".into(),
            "".into(),
            0,
        );
        // s takes a's rank 0; b keeps rank 1.
        assert_eq!(hosts(&r2), ["s", "b"]);
        assert_eq!(r2.master_addr, "addr-s");
        assert!(r2.standby.is_empty());
    }

    #[test]
    fn below_min_waits_and_forms_again_when_hosts_return() {
        let (a, b) = (m("a", 1, 10, false), m("b", 2, 11, false));
        let r1 = round_of(1, &[a.clone(), b.clone()], LIMITS);
        let live = [a.clone()];
        // b vanished without a word: after the rejoin grace.
        assert!(matches!(
            trigger(Some(&r1), &live, &none(), false, LIMITS),
            Trigger::AfterRejoinGrace(_)
        ));
        let r2 = record(
            2,
            assign(Some(&r1), &live, LIMITS),
            LIMITS,
            "".into(),
            "".into(),
            0,
        );
        assert!(r2.waiting);
        assert_eq!(
            (r2.nnodes, r2.world_size, r2.master_addr.as_str()),
            (0, 0, "")
        );
        assert_eq!(r2.standby, ["a"]);
        // Waiting with too few: nothing; one more host: the last call.
        assert_eq!(
            trigger(Some(&r2), &live, &none(), false, LIMITS),
            Trigger::None
        );
        let b2 = m("b", 3, 20, false);
        assert!(matches!(
            trigger(Some(&r2), &[a, b2], &none(), false, LIMITS),
            Trigger::AfterLastCall(_)
        ));
    }

    #[test]
    fn rejoin_with_a_new_lease_is_a_lost_member() {
        let (a, b) = (m("a", 1, 10, false), m("b", 2, 11, false));
        let r1 = round_of(1, &[a.clone(), b.clone()], LIMITS);
        let b2 = m("b", 7, 30, false);
        assert_eq!(
            trigger(Some(&r1), &[a.clone(), b2.clone()], &none(), false, LIMITS),
            Trigger::Now("b rejoined".into())
        );
        let r2 = record(
            2,
            assign(Some(&r1), &[a, b2], LIMITS),
            LIMITS,
            "".into(),
            "".into(),
            0,
        );
        assert_eq!(hosts(&r2), ["a", "b"]);
        assert_eq!(r2.members[1].lease, 7);
    }

    #[test]
    fn the_same_launcher_rejoined_under_a_new_lease_keeps_its_place() {
        let (a, b) = (m("a", 1, 10, false), m("b", 2, 11, false));
        let r1 = round_of(1, &[a.clone(), b.clone()], LIMITS);
        // b's lease lapsed and expired: gone without a word, for now.
        assert_eq!(
            trigger(Some(&r1), std::slice::from_ref(&a), &none(), false, LIMITS),
            Trigger::AfterRejoinGrace("b lost".into())
        );
        // The same launcher (same incarnation) re-registers under lease 9:
        // the round still has it, nothing to do.
        let mut b2 = m("b", 9, 40, false);
        b2.record.incarnation = b.record.incarnation;
        assert_eq!(
            trigger(Some(&r1), &[a.clone(), b2.clone()], &none(), false, LIMITS),
            Trigger::None
        );
        assert_eq!(
            hosts(&record(
                2,
                assign(Some(&r1), &[a.clone(), b2], LIMITS),
                LIMITS,
                "".into(),
                "".into(),
                0
            )),
            ["a", "b"]
        );
        // A member of an older launcher (no incarnation) cannot rejoin:
        // lost at once, as before.
        let mut old = r1.clone();
        old.members[1].incarnation = 0;
        assert_eq!(
            trigger(Some(&old), &[a], &none(), false, LIMITS),
            Trigger::Now("b lost".into())
        );
    }

    #[test]
    fn an_ended_job_is_not_restarted_by_its_members_leaving() {
        let (a, b) = (m("a", 1, 10, false), m("b", 2, 11, false));
        let r1 = round_of(1, &[a.clone(), b.clone()], LIMITS);
        let mut departures = BTreeMap::new();
        departures.insert("a".to_owned(), "finished".to_owned());
        assert_eq!(
            trigger(Some(&r1), &[b], &departures, true, LIMITS),
            Trigger::None
        );
        // Once every member is gone, the job id can be used again.
        assert!(matches!(
            trigger(
                Some(&r1),
                &[m("x", 5, 40, false)],
                &departures,
                true,
                LIMITS
            ),
            Trigger::Now(_)
        ));
    }

    #[test]
    fn ports_cycle_with_the_epoch() {
        let live = [m("a", 1, 10, false), m("b", 2, 11, false)];
        assert_eq!(round_of(0, &live, LIMITS).master_port, 29500);
        assert_eq!(round_of(999, &live, LIMITS).master_port, 30499);
        assert_eq!(round_of(1000, &live, LIMITS).master_port, 29500);
    }

    /// The standing kept one member event at a time is the standing built
    /// from scratch, after each event of a run that loses, replaces,
    /// rejoins and adds hosts; and the decision on it is the same.
    #[test]
    fn a_kept_standing_is_the_one_built_from_scratch() {
        let (a, b, c) = (
            m("a", 1, 1, false),
            m("b", 2, 2, false),
            m("c", 3, 3, false),
        );
        let r1 = round_of(1, &[a.clone(), b.clone(), c.clone()], LIMITS);
        let mut live: BTreeMap<String, Member> = [&a, &b, &c]
            .into_iter()
            .map(|m| (m.record.host.clone(), m.clone()))
            .collect();
        let mut kept = Standing::new(Some(&r1), &live);
        assert_eq!(kept.lost.len(), 0);
        // (host, its member after the event: None = key deleted)
        let b_other = m("b", 9, 9, false); // another launcher on b's id
        let mut b_rejoined = b.clone(); // b's launcher under a new lease
        b_rejoined.lease = 22;
        let events: Vec<(&str, Option<Member>)> = vec![
            ("b", None),
            ("d", Some(m("d", 4, 4, true))),
            ("b", Some(b_other)),
            ("b", Some(b_rejoined)),
            ("e", Some(m("e", 5, 5, false))),
            ("a", None),
            ("d", None),
        ];
        for (host, member) in events {
            match member {
                Some(mm) => live.insert(host.to_owned(), mm),
                None => live.remove(host),
            };
            kept.member_changed(Some(&r1), &live, host);
            assert_eq!(kept, Standing::new(Some(&r1), &live), "after {host}");
            let as_slice: Vec<Member> = live.values().cloned().collect();
            assert_eq!(
                decide(Some(&r1), &kept, &live, &none(), false, LIMITS),
                trigger(Some(&r1), &as_slice, &none(), false, LIMITS),
            );
        }
        // What is left: a lost (rank 0), e a candidate, standby e.
        assert_eq!(kept.lost.iter().copied().collect::<Vec<_>>(), [0]);
        assert_eq!(kept.standby(), ["e"]);
        assert!(kept.any_member_live());
    }

    /// One line to write the next round, the same from every host's view:
    /// live members by node rank first (a lost one skipped), then the
    /// candidates in the order they are taken; capped.
    #[test]
    fn the_writers_line_is_members_by_rank_then_candidates() {
        let (a, b, c) = (
            m("a", 1, 1, false),
            m("b", 2, 2, false),
            m("c", 3, 3, false),
        );
        let r1 = round_of(1, &[a.clone(), b.clone(), c.clone()], LIMITS);
        let mut live: BTreeMap<String, Member> = [&a, &b, &c, &m("s", 9, 9, true)]
            .into_iter()
            .map(|m| (m.record.host.clone(), m.clone()))
            .collect();
        let st = Standing::new(Some(&r1), &live);
        let line = |st: &Standing| -> Vec<usize> {
            ["a", "b", "c", "s", "nobody"]
                .iter()
                .map(|h| st.writer_place(h, 8))
                .collect()
        };
        assert_eq!(line(&st), [0, 1, 2, 3, 8]);
        // a lost: b is first; the spare moves up.
        live.remove("a");
        let st = Standing::new(Some(&r1), &live);
        assert_eq!(line(&st), [8, 0, 1, 2, 8]);
        assert_eq!(st.writer_place("s", 1), 1, "capped");
        // No round yet: the candidates in join order.
        let st = Standing::new(None, &live);
        assert_eq!(line(&st), [8, 0, 1, 2, 8]);
    }

    #[test]
    fn a_deciders_place_skips_the_hosts_that_do_not_decide() {
        // z joined first and holds node rank 0 of a round of z, a, b; z
        // then rejoined (a new key, the last by join): with two deciders,
        // a and b decide, and a is first among them although z is live.
        let (z, a, b) = (
            m("z", 1, 1, false),
            m("a", 2, 2, false),
            m("b", 3, 3, false),
        );
        let r1 = round_of(1, &[z.clone(), a.clone(), b.clone()], LIMITS);
        assert_eq!(hosts(&r1), ["z", "a", "b"]);
        let mut z2 = z.clone();
        z2.join_revision = 9;
        let live: BTreeMap<String, Member> = [&z2, &a, &b]
            .into_iter()
            .map(|m| (m.record.host.clone(), m.clone()))
            .collect();
        let st = Standing::new(Some(&r1), &live);
        assert_eq!(st.writer_place("a", 8), 1, "z is first in node-rank order");
        assert_eq!(st.decider_place("a", 2, 8), 0);
        assert_eq!(st.decider_place("b", 2, 8), 1);
        // z decides too (it did before it rejoined): first again.
        assert_eq!(st.decider_place("z", 2, 8), 0);
        // Capped.
        assert_eq!(st.decider_place("b", 2, 0), 0);
    }
}
