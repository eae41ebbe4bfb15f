//! The peer agents a host's checkpoints travel to: the ones in
//! `[[checkpoint.peers]]`, plus, per job, the ones a multi-host job's
//! launcher hands over from its etcd rounds (`SetCheckpointPeers`).
//!
//! Static peers suit a fixed fleet (VMs, a DaemonSet); a job scheduled onto
//! whatever hosts were free only learns its neighbours when its launchers
//! meet in etcd, and the set changes when a host is lost or a spare steps
//! in. Both kinds are one ring per job: placement runs over the union, so a
//! replica still never lands in this host's failure domain.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use super::Peer;
use super::order::{Order, OrderError};
use super::placement::{self, RingMember};

/// A peer as a launcher describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerSpec {
    /// `host:port` of its agent's `api.tcp` listener.
    pub addr: String,
    /// Its failure domain; empty: a domain of its own.
    pub domain: String,
    /// Its host id in the job, for messages.
    pub host: String,
    /// Its agent's identity (the name its certificate carries); empty
    /// when the launcher did not say (an older one, `api.insecure`).
    pub identity: String,
    /// Its place in the job's order, where the launcher says how many
    /// hosts the order has ([`PeerSet::set_job_partial`]); else unread
    /// (the list's own order is the job's).
    pub place: usize,
}

/// Why a launcher's peer list was refused.
#[derive(Debug, thiserror::Error)]
pub enum PeerSetError {
    /// An address that is not `host:port`.
    #[error("peer {index} ({host:?}): address {addr:?} is not host:port")]
    BadAddr {
        /// Its place in the list.
        index: usize,
        /// Its host id.
        host: String,
        /// The address given.
        addr: String,
    },
    /// This host's own address, as its launcher published it, is not
    /// `host:port`.
    #[error("self_addr {0:?} (this host as the job's other hosts reach it) is not host:port")]
    BadSelfAddr(String),
    /// The places of a partial list that cannot make an order.
    #[error("the job's order of {hosts} hosts: {source}")]
    Order {
        /// How many hosts the launcher said the order has.
        hosts: usize,
        /// What was wrong.
        source: OrderError,
    },
    /// In a list by place, one address at two places, or this agent's own
    /// at a place not its own: hosts handed the list in another order
    /// would put it at different places.
    #[error("address {addr:?} is at place {place} and at place {other} of the job's order")]
    TwoPlaces {
        /// The address.
        addr: String,
        /// The place it was first given (this agent's own, for its own
        /// address).
        place: usize,
        /// The other place.
        other: usize,
    },
    /// `replicas` past what an agent takes.
    #[error(
        "replicas {replicas} (the most checkpoint.replicas among the job's agents) is past {most}"
    )]
    TooManyReplicas {
        /// The count given.
        replicas: usize,
        /// [`super::config::MAX_REPLICAS`].
        most: usize,
    },
    /// A client could not be built for it.
    #[error("peer {addr}: {message}")]
    Client {
        /// The address.
        addr: String,
        /// Why.
        message: String,
    },
}

/// Where this agent stands in a job, as its launcher says
/// (`SetCheckpointPeers`: `self_place`, `self_addr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnPlace {
    /// How many of the job's other hosts come before this one.
    pub index: usize,
    /// This agent's address as the job's other hosts know it (the one its
    /// launcher published: an unspecified `api.tcp` IP replaced by the
    /// host's advertised address); empty: `api.tcp` (an older launcher).
    pub addr: String,
}

/// What a launcher says of a job's order besides its peers
/// (`SetCheckpointPeers`: `job_hosts`, `ring_by_place`, `replicas`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobShape {
    /// How many hosts the order has (0: not said, the list is the order).
    pub hosts: usize,
    /// The job's replica ring is its node-rank order
    /// ([`placement::Ring::by_place`]), not its agents' addresses: said by
    /// the launcher where every agent of the job's round takes it, since
    /// all must compute the same ring.
    pub ring_by_place: bool,
    /// The most `checkpoint.replicas` among the job's agents, as the
    /// launchers' round says (0: not said). This agent takes an origin's
    /// shards when it is among the first that many of the origin's
    /// targets (never fewer than its own `checkpoint.replicas`): an
    /// origin sends its own count, the first of the same walk, so a host
    /// configured with fewer no longer refuses the copies past its count.
    pub replicas: usize,
}

/// Every peer this host knows, static and per job.
#[derive(Debug)]
pub struct PeerSet {
    me: RingMember,
    replicas: usize,
    timeout: Duration,
    dial: std::sync::Arc<dyn super::link::PeerDial>,
    configured: Vec<Peer>,
    /// The configured peers' addresses and this agent's, sorted: the order
    /// of a job no launcher handed over (as the exchange's routes take it).
    statics: JobOrder,
    jobs: Mutex<BTreeMap<String, Vec<Peer>>>,
    /// Each job's agents' addresses as the launchers' round lists them (node
    /// rank order, this agent included), whole or the places handed over:
    /// the straggler exchange's order of aggregators and the restore's of
    /// collectors.
    orders: Mutex<BTreeMap<String, JobOrder>>,
    /// Each handed-over job's ring kept ready (see [`JobRing`]).
    rings: Mutex<BTreeMap<String, JobRing>>,
    /// This agent on a job's ring where its launcher published another
    /// address for it than `api.tcp` ([`OwnPlace::addr`]). Every host of
    /// the job computes each origin's targets on its own, so all must see
    /// this agent at the same place: with `api.tcp = "0.0.0.0:P"` its own
    /// view put it first on the ring and the others' after the published
    /// address, and the placement rule refused its neighbours' replicas.
    ring_me: Mutex<BTreeMap<String, RingMember>>,
}

/// One job's placement kept ready at [`PeerSet::set_job`]: per shard pushed
/// here and per save, a walk of the ring, not a copy of every peer and a
/// sort (issue 30: up to 16,384 of them).
#[derive(Debug, Default)]
struct JobRing {
    /// By address: [`PeerSet::of_job`]'s members, then this agent (the
    /// last). By place: the job's known places in order, this agent at its
    /// own.
    ring: placement::Ring,
    /// This agent's index in `ring` (None: not on it).
    me: Option<usize>,
    /// Each named peer's index in the ring (the first of a name).
    names: std::collections::HashMap<String, usize>,
    /// This agent's own targets.
    targets: Vec<Peer>,
    /// How many of an origin's targets this agent takes the shards of
    /// ([`JobShape::replicas`], at least this agent's own count).
    accepts: usize,
}

/// One job's hosts as last handed over, with what is looked up per report
/// kept ready: this agent's place in the order, and the peers' names.
#[derive(Debug, Default)]
struct JobOrder {
    /// Addresses in node-rank order, this agent's included.
    addrs: Order,
    /// This agent's place in `addrs`.
    me: Option<usize>,
    /// The identities of the job's handed-over peers.
    names: std::collections::HashSet<String>,
    /// The job's ring is by place ([`JobShape::ring_by_place`]).
    ring_by_place: bool,
    /// [`JobShape::replicas`].
    replicas: usize,
}

impl PeerSet {
    /// The set with only the configured peers; `me` is this agent on the
    /// ring (its address and domain).
    pub fn new(
        me: RingMember,
        replicas: usize,
        timeout: Duration,
        dial: std::sync::Arc<dyn super::link::PeerDial>,
        configured: Vec<Peer>,
    ) -> Self {
        let mut addrs: Vec<String> = configured.iter().map(|p| p.member.addr.clone()).collect();
        addrs.push(me.addr.clone());
        addrs.sort();
        addrs.dedup();
        let statics = JobOrder {
            me: addrs.iter().position(|a| *a == me.addr),
            addrs: Order::whole(addrs),
            names: Default::default(),
            ring_by_place: false,
            replicas: 0,
        };
        Self {
            me,
            replicas,
            timeout,
            dial,
            configured,
            statics,
            jobs: Mutex::new(BTreeMap::new()),
            orders: Mutex::new(BTreeMap::new()),
            rings: Mutex::new(BTreeMap::new()),
            ring_me: Mutex::new(BTreeMap::new()),
        }
    }

    /// This agent on the ring.
    pub fn me(&self) -> &RingMember {
        &self.me
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Peer>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This agent's own address as its peers know it.
    pub fn my_addr(&self) -> &str {
        &self.me.addr
    }

    /// The peers that matter to `job`: the configured ones, then the job's
    /// own (one entry per address). For `""`, every peer of every job (a
    /// listing of everything).
    pub fn of_job(&self, job: &str) -> Vec<Peer> {
        let mut out = self.configured.clone();
        let jobs = self.jobs();
        let extra: Vec<&Peer> = if job.is_empty() {
            jobs.values().flatten().collect()
        } else {
            jobs.get(job).into_iter().flatten().collect()
        };
        let mut seen: std::collections::HashSet<String> =
            out.iter().map(|o| o.member.addr.clone()).collect();
        for p in extra {
            if seen.insert(p.member.addr.clone()) {
                out.push(p.clone());
            }
        }
        out
    }

    /// `f` over `job`'s agents' addresses in node-rank order (empty: none
    /// handed over; partial: the places handed over) and this agent's
    /// place in it, without copying a list of up to 16,384 hosts or
    /// searching it.
    pub fn with_order<T>(&self, job: &str, f: impl FnOnce(&Order, Option<usize>) -> T) -> T {
        let orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        match orders.get(job) {
            Some(o) => f(&o.addrs, o.me),
            None => f(&Order::default(), None),
        }
    }

    /// [`PeerSet::with_order`], or for a job no launcher handed over, the
    /// configured peers' and this agent's addresses, sorted (the static
    /// fleet's order, as the exchange's routes take it).
    pub fn with_order_or_static<T>(
        &self,
        job: &str,
        f: impl FnOnce(&Order, Option<usize>) -> T,
    ) -> T {
        let orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        match orders.get(job) {
            Some(o) if !o.addrs.is_empty() => f(&o.addrs, o.me),
            _ => f(&self.statics.addrs, self.statics.me),
        }
    }

    /// Whether the peer named `name` is one of `job`'s peers here
    /// (configured, or handed over for the job): who may push, fetch and
    /// list the job's shards, and report for it. Kept ready at
    /// [`PeerSet::set_job`], since it is asked per call.
    pub fn is_member_name(&self, job: &str, name: &str) -> bool {
        if name.is_empty() {
            return false;
        }
        self.configured.iter().any(|p| p.name == name)
            || self
                .orders
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(job)
                .is_some_and(|o| o.names.contains(name))
    }

    /// The peers that hold this host's replicas of `job`'s shards: the ring
    /// placement over [`PeerSet::of_job`].
    pub fn targets(&self, job: &str) -> Vec<Peer> {
        if let Some(r) = self.rings().get(job) {
            return r.targets.clone();
        }
        self.ring_of(job).targets
    }

    fn rings(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, JobRing>> {
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This agent's address as `job`'s other hosts know it: as its
    /// launcher published it, else `api.tcp`. A listing of this agent's
    /// own tier in a collection is labelled with it, so the collector
    /// (which checks a leader's listing accounts for each member) and a
    /// restoring host (which asks each holder for its copies) find it.
    pub fn known_as(&self, job: &str) -> String {
        self.me_in(job).addr
    }

    /// This agent on `job`'s ring: as its launcher published it, else
    /// `api.tcp`.
    fn me_in(&self, job: &str) -> RingMember {
        self.ring_me
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
            .cloned()
            .unwrap_or_else(|| self.me.clone())
    }

    /// Whether `name` is a peer of any job, or configured. Asked on every
    /// peer's call (each report to the aggregator), so it looks the name
    /// up in each job's names kept ready at [`PeerSet::set_job`]: it once
    /// copied every peer of every job per call, O(N) a report and O(N^2)
    /// an interval at a job's aggregator (docs/benchmarks.md, "over the
    /// network").
    pub fn knows(&self, name: &str) -> bool {
        !name.is_empty()
            && (self.configured.iter().any(|p| p.name == name)
                || self
                    .orders
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .values()
                    .any(|o| o.names.contains(name)))
    }

    /// Whether `job`'s placement sends the shards of the peer named
    /// `origin` to this host: the ring seen from the origin (the job's
    /// peers here, less the origin, plus this host) with the job's
    /// `checkpoint.replicas` ([`JobShape::replicas`], else this host's
    /// own). None when the origin is not one of the job's
    /// peers. Every host of a job is handed the same peer list by the
    /// launchers' round (and a static fleet configures each host's peers
    /// alike), so this is the origin's own choice of targets.
    pub fn placed_here(&self, job: &str, origin: &str) -> Option<bool> {
        if origin.is_empty() {
            return None;
        }
        // On a ring by place that lacks some places, the origin's targets
        // found before a place not known here: this host is one of them,
        // or, as far as this host can tell, not.
        let placed = |r: &JobRing| {
            let o = *r.names.get(origin)?;
            let walk = r.ring.walk_at(o, r.accepts)?;
            Some(r.me.is_some_and(|me| walk.targets.contains(&me)))
        };
        if let Some(r) = self.rings().get(job) {
            return placed(r);
        }
        placed(&self.ring_of(job))
    }

    /// The peer at `addr`, configured or handed over for any job.
    ///
    /// Asked per report by the exchange's routes (and per relayed report by
    /// a group leader): only the peer found is copied, not every peer of
    /// every job, as [`PeerSet::of_job`] would.
    pub fn find(&self, addr: &str) -> Option<Peer> {
        if let Some(p) = self.configured.iter().find(|p| p.member.addr == addr) {
            return Some(p.clone());
        }
        self.jobs()
            .values()
            .flatten()
            .find(|p| p.member.addr == addr)
            .cloned()
    }

    /// Replaces `job`'s handed-over peers with `specs` (this agent's own
    /// address left out); an empty list forgets the job. `own` is where
    /// this agent stands in the job, as its launcher says: the job's order
    /// is `specs` with this agent put at `own.index`, and on the job's ring
    /// it is at `own.addr`. Without it (an older launcher) this agent is in
    /// the order only where `specs` name its own address, and on the ring
    /// at `api.tcp`. Returns the addresses that will now hold this host's
    /// replicas of the job. Nothing changes when one entry is bad.
    pub fn set_job(
        &self,
        job: &str,
        specs: &[PeerSpec],
        own: Option<&OwnPlace>,
    ) -> Result<Vec<String>, PeerSetError> {
        self.set_job_partial(job, specs, own, JobShape::default())
    }

    /// [`PeerSet::set_job`] as the launcher shapes the job: where it says
    /// the order has `shape.hosts` hosts (0: not said, the list is the
    /// order), each spec stands at its own [`PeerSpec::place`] and this
    /// agent at `own.index`, and the places not handed over stay unknown
    /// here (a partial view: [`Order`]); with `shape.ring_by_place` the
    /// job's replica ring is that order, else its peers' addresses; with
    /// `shape.replicas` this agent takes the shards of origins whose first
    /// that many targets it is among.
    pub fn set_job_partial(
        &self,
        job: &str,
        specs: &[PeerSpec],
        own: Option<&OwnPlace>,
        shape: JobShape,
    ) -> Result<Vec<String>, PeerSetError> {
        let hosts = shape.hosts;
        if shape.replicas > super::config::MAX_REPLICAS {
            return Err(PeerSetError::TooManyReplicas {
                replicas: shape.replicas,
                most: super::config::MAX_REPLICAS,
            });
        }
        let place = own.map(|o| o.index);
        let published = own.map(|o| o.addr.as_str()).filter(|a| !a.is_empty());
        if let Some(addr) = published
            && !warden_core::config::valid_peer_addr(addr)
        {
            return Err(PeerSetError::BadSelfAddr(addr.to_owned()));
        }
        // Checked before anything changes.
        let partial = if hosts > 0 {
            Some(self.partial_order(specs, place, published, hosts)?)
        } else {
            None
        };
        let mut fresh: Vec<Peer> = Vec::new();
        {
            let jobs = self.jobs();
            // Hash maps, not scans: a job of 16,384 hosts hands over that
            // many peers every round and every 10 s (issue 30).
            let known: std::collections::HashMap<(&str, &str), &Peer> = jobs
                .values()
                .flatten()
                .map(|p| ((p.member.addr.as_str(), p.name.as_str()), p))
                .collect();
            let mut taken = std::collections::HashSet::with_capacity(specs.len());
            for (index, s) in specs.iter().enumerate() {
                if !warden_core::config::valid_peer_addr(&s.addr) {
                    return Err(PeerSetError::BadAddr {
                        index,
                        host: s.host.clone(),
                        addr: s.addr.clone(),
                    });
                }
                if s.addr == self.me.addr
                    || published == Some(s.addr.as_str())
                    || !taken.insert(s.addr.as_str())
                {
                    continue;
                }
                // Keep the connection of a peer already known under the
                // same identity (a new name needs a dial that checks it).
                let peer = match known.get(&(s.addr.as_str(), s.identity.as_str())) {
                    Some(p) => Peer::on(&s.addr, &s.domain, &s.identity, p.link.clone()),
                    None => Peer::new(&s.addr, &s.domain, &s.identity, self.timeout, &*self.dial)
                        .map_err(|message| PeerSetError::Client {
                        addr: s.addr.clone(),
                        message,
                    })?,
                };
                fresh.push(peer);
            }
        }
        {
            let mut jobs = self.jobs();
            if fresh.is_empty() {
                jobs.remove(job);
            } else {
                jobs.insert(job.to_owned(), fresh);
            }
        }
        {
            let (order, me) = match partial {
                Some(o) => {
                    // Without its place said, this agent stands where a
                    // spec names its own address, as in a whole list.
                    let me = place.or_else(|| o.position(&self.me.addr));
                    (o, me)
                }
                None => {
                    let o = self.whole_order(specs, place);
                    let me = o.position(&self.me.addr);
                    (o, me)
                }
            };
            let names = self
                .jobs()
                .get(job)
                .into_iter()
                .flatten()
                .filter(|p| !p.name.is_empty())
                .map(|p| p.name.clone())
                .collect();
            let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
            if order.is_empty() {
                orders.remove(job);
            } else {
                orders.insert(
                    job.to_owned(),
                    JobOrder {
                        addrs: order,
                        me,
                        names,
                        ring_by_place: shape.ring_by_place,
                        replicas: shape.replicas,
                    },
                );
            }
        }
        {
            let mut ring_me = self.ring_me.lock().unwrap_or_else(|p| p.into_inner());
            match published {
                Some(addr) if !specs.is_empty() => {
                    // The domain as the others derive it: the configured
                    // one, else the address they know this agent by.
                    let domain = if self.me.domain == self.me.addr {
                        addr.to_owned()
                    } else {
                        self.me.domain.clone()
                    };
                    ring_me.insert(
                        job.to_owned(),
                        RingMember {
                            addr: addr.to_owned(),
                            domain,
                        },
                    );
                }
                _ => {
                    ring_me.remove(job);
                }
            }
        }
        self.keep_ring(job);
        let targets: Vec<String> = self
            .targets(job)
            .into_iter()
            .map(|p| p.member.addr)
            .collect();
        if self.replicas > 0 && targets.len() < self.replicas && !self.of_job(job).is_empty() {
            tracing::warn!(
                job,
                wanted = self.replicas,
                placed = targets.len(),
                "too few checkpoint peers outside this host's failure domain for checkpoint.replicas"
            );
        }
        Ok(targets)
    }

    /// The job's order as the list gives it (an older launcher's, or one
    /// that does not say the order's length): the specs in their order,
    /// each address once, with this agent put at `place`. Without a place
    /// this agent is in it only where a spec names its own address. No
    /// peer: no order.
    fn whole_order(&self, specs: &[PeerSpec], place: Option<usize>) -> Order {
        let mut seen = std::collections::HashSet::with_capacity(specs.len() + 1);
        let mut order: Vec<String> = Vec::with_capacity(specs.len() + 1);
        for (i, s) in specs.iter().enumerate() {
            if place == Some(i) && seen.insert(self.me.addr.as_str()) {
                order.push(self.me.addr.clone());
            }
            if seen.insert(s.addr.as_str()) {
                order.push(s.addr.clone());
            }
        }
        if place.is_some_and(|p| p >= specs.len())
            && !order.is_empty()
            && seen.insert(self.me.addr.as_str())
        {
            order.push(self.me.addr.clone());
        }
        Order::whole(order)
    }

    /// The job's order of `hosts` places from the specs' own places, this
    /// agent at `place` (known by `api.tcp`, as in a whole order; a spec
    /// naming this agent at that place, by either address, is then left
    /// out). One address at two places, or this agent's at a place not
    /// its own, is refused: unlike a whole list, whose order is the
    /// order, which one to keep would depend on the list's order. No
    /// peer: no order.
    fn partial_order(
        &self,
        specs: &[PeerSpec],
        place: Option<usize>,
        published: Option<&str>,
        hosts: usize,
    ) -> Result<Order, PeerSetError> {
        if specs.is_empty() {
            return Ok(Order::default());
        }
        let mut seen: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::with_capacity(specs.len() + 1);
        let mut known: Vec<(usize, String)> = Vec::with_capacity(specs.len() + 1);
        if let Some(p) = place {
            seen.insert(self.me.addr.as_str(), p);
            if let Some(addr) = published {
                seen.insert(addr, p);
            }
            known.push((p, self.me.addr.clone()));
        }
        for s in specs {
            match seen.get(s.addr.as_str()) {
                Some(&p) if p == s.place => {}
                Some(&p) => {
                    return Err(PeerSetError::TwoPlaces {
                        addr: s.addr.clone(),
                        place: p,
                        other: s.place,
                    });
                }
                None => {
                    seen.insert(s.addr.as_str(), s.place);
                    known.push((s.place, s.addr.clone()));
                }
            }
        }
        Order::partial(hosts, known).map_err(|source| PeerSetError::Order { hosts, source })
    }

    /// Keeps `job`'s ring ready ([`JobRing`]), or forgets it when the job
    /// has no peers of its own left.
    fn keep_ring(&self, job: &str) {
        if !self.jobs().contains_key(job) {
            self.rings().remove(job);
            return;
        }
        let ring = self.ring_of(job);
        self.rings().insert(job.to_owned(), ring);
    }

    /// How many of an origin's targets this agent takes `job`'s shards
    /// for: the job's most `checkpoint.replicas` as its launcher said it,
    /// never fewer than this agent's own.
    fn accepts(&self, job: &str) -> usize {
        let said = self
            .orders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
            .map_or(0, |o| o.replicas);
        said.max(self.replicas)
    }

    /// `job`'s ring, built now (a job not handed over, or `""`, has none
    /// kept): by place where its launcher said so, else over
    /// [`PeerSet::of_job`] and this agent by address.
    fn ring_of(&self, job: &str) -> JobRing {
        if let Some(r) = self.ring_by_place(job) {
            return r;
        }
        let all = self.of_job(job);
        let mut names = std::collections::HashMap::with_capacity(all.len());
        for (i, p) in all.iter().enumerate() {
            if !p.name.is_empty() {
                names.entry(p.name.clone()).or_insert(i);
            }
        }
        let me = self.me_in(job);
        let mut members: Vec<RingMember> = all.iter().map(|p| p.member.clone()).collect();
        members.push(me.clone());
        let ring = placement::Ring::new(members);
        let targets = ring
            .targets_of(&me, self.replicas)
            .into_iter()
            .filter_map(|i| all.get(i).cloned())
            .collect();
        JobRing {
            me: Some(ring.members().len() - 1),
            ring,
            names,
            targets,
            accepts: self.accepts(job),
        }
    }

    /// `job`'s ring by place: its known places in node-rank order, each
    /// the peer handed over at that address, this agent at its own place
    /// (at its published address, as the others see it). The configured
    /// peers have no place in the job and are not on it. None: the job's
    /// ring is by address (or it has no order).
    fn ring_by_place(&self, job: &str) -> Option<JobRing> {
        let (places, me, len) = {
            let orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
            let o = orders.get(job).filter(|o| o.ring_by_place)?;
            let places: Vec<(usize, String)> = o
                .addrs
                .range(0..o.addrs.len())
                .map(|(p, a)| (p, a.to_owned()))
                .collect();
            (places, o.me, o.addrs.len())
        };
        let peers: std::collections::HashMap<String, Peer> = self
            .jobs()
            .get(job)
            .into_iter()
            .flatten()
            .map(|p| (p.member.addr.clone(), p.clone()))
            .collect();
        let mut members: Vec<RingMember> = Vec::with_capacity(places.len());
        let mut at: Vec<Option<Peer>> = Vec::with_capacity(places.len());
        let mut on_ring: Vec<usize> = Vec::with_capacity(places.len());
        let mut mine = None;
        for (place, addr) in places {
            if Some(place) == me {
                mine = Some(members.len());
                members.push(self.me_in(job));
                at.push(None);
            } else if let Some(p) = peers.get(&addr) {
                members.push(p.member.clone());
                at.push(Some(p.clone()));
            } else {
                // A place with no peer here (not one of the job's peers)
                // is a place this ring does not know.
                continue;
            }
            on_ring.push(place);
        }
        let mut names = std::collections::HashMap::with_capacity(at.len());
        for (i, p) in at.iter().enumerate() {
            if let Some(p) = p
                && !p.name.is_empty()
            {
                names.entry(p.name.clone()).or_insert(i);
            }
        }
        let ring = placement::Ring::by_known_places(members, on_ring, len);
        let walk = mine.and_then(|i| ring.walk_at(i, self.replicas));
        if let Some(w) = walk.as_ref().filter(|w| !w.decided) {
            tracing::warn!(
                job,
                found = w.targets.len(),
                wanted = self.replicas,
                "this host's checkpoint replicas reach a place of the job's ring by node-rank order \
                 that its launcher did not hand over: only those found before it take them"
            );
        }
        let targets = walk
            .map(|w| w.targets)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|i| at.get(i).cloned().flatten())
            .collect();
        Some(JobRing {
            ring,
            me: mine,
            names,
            targets,
            accepts: self.accepts(job),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real dialer, without TLS: these peers are never called.
    fn insecure() -> std::sync::Arc<dyn crate::ckpt::link::PeerDial> {
        crate::peer_link::ckpt::tonic_peer::TonicDial::shared(crate::tls::PeerTls::Insecure)
    }

    fn spec(addr: &str, domain: &str) -> PeerSpec {
        PeerSpec {
            addr: addr.into(),
            domain: domain.into(),
            host: addr.into(),
            identity: String::new(),
            ..Default::default()
        }
    }

    fn set(configured: &[(&str, &str)]) -> PeerSet {
        let configured = configured
            .iter()
            .map(|(a, d)| Peer::new(a, d, "", Duration::from_secs(1), &*insecure()).unwrap())
            .collect();
        PeerSet::new(
            RingMember {
                addr: "127.0.0.2:7000".into(),
                domain: "rack2".into(),
            },
            1,
            Duration::from_secs(1),
            insecure(),
            configured,
        )
    }

    fn addrs(v: Vec<Peer>) -> Vec<String> {
        v.into_iter().map(|p| p.member.addr).collect()
    }

    #[tokio::test]
    async fn job_peers_join_the_ring_of_their_job_only() {
        let s = set(&[("127.0.0.9:7000", "rack2")]);
        // The configured peer shares this host's domain: no target yet.
        assert!(s.targets("j1").is_empty());
        let t = s
            .set_job(
                "j1",
                &[
                    spec("127.0.0.2:7000", "rack2"), // this agent: left out
                    spec("127.0.0.3:7000", "rack3"),
                    spec("127.0.0.4:7000", "rack4"),
                ],
                None,
            )
            .unwrap();
        assert_eq!(t, vec!["127.0.0.3:7000"]);
        assert!(s.rings().contains_key("j1"), "the job's ring is kept");
        assert_eq!(
            addrs(s.of_job("j1")),
            vec!["127.0.0.9:7000", "127.0.0.3:7000", "127.0.0.4:7000"]
        );
        // Another job sees only the configured peer.
        assert_eq!(addrs(s.of_job("j2")), vec!["127.0.0.9:7000"]);
        assert!(s.find("127.0.0.4:7000").is_some());
        // A new round replaces the list; an empty one forgets the job.
        s.set_job("j1", &[spec("127.0.0.4:7000", "rack4")], None)
            .unwrap();
        assert_eq!(addrs(s.targets("j1")), vec!["127.0.0.4:7000"]);
        s.set_job("j1", &[], None).unwrap();
        assert!(s.targets("j1").is_empty());
        assert!(!s.rings().contains_key("j1"), "and forgotten with it");
        assert!(s.find("127.0.0.4:7000").is_none());
    }

    /// Issue 30: a launcher hands over the other hosts and says where its
    /// own stands. The agent is at that place in the job's order, which
    /// the exchange's tree and the restore's collectors are cut from, even
    /// where the list could not name it (the launcher publishes the
    /// advertised address, the agent knows itself by `api.tcp`). Without
    /// the place (before, every launcher-driven job) it stood nowhere.
    #[tokio::test]
    async fn the_launchers_place_puts_this_agent_in_the_jobs_order() {
        let s = set(&[]);
        let others = [
            spec("127.0.0.3:7000", "rack3"),
            spec("127.0.0.4:7000", "rack4"),
            spec("127.0.0.5:7000", "rack5"),
        ];
        let order = |s: &PeerSet| s.with_order("j", |o, me| (o.addrs_in(0..o.len()), me));
        s.set_job("j", &others, None).unwrap();
        assert_eq!(order(&s).1, None, "a list without this agent: nowhere");
        for place in 0..=3 {
            let own = OwnPlace {
                index: place,
                addr: String::new(),
            };
            s.set_job("j", &others, Some(&own)).unwrap();
            let (o, me) = order(&s);
            assert_eq!(me, Some(place), "{o:?}");
            assert_eq!(o.len(), 4, "{o:?}");
            assert_eq!(o[place], "127.0.0.2:7000");
            let rest: Vec<&String> = o.iter().filter(|a| *a != "127.0.0.2:7000").collect();
            assert_eq!(rest, ["127.0.0.3:7000", "127.0.0.4:7000", "127.0.0.5:7000"]);
        }
        // Its own address among the others (a launcher of before, which
        // sent the whole list): found there, once, place or not.
        let with_me = [
            others[0].clone(),
            spec("127.0.0.2:7000", "rack2"),
            others[1].clone(),
        ];
        s.set_job("j", &with_me, Some(&OwnPlace::default()))
            .unwrap();
        assert_eq!(order(&s).1, Some(0));
        assert_eq!(order(&s).0.len(), 3);
        s.set_job("j", &with_me, None).unwrap();
        assert_eq!(
            order(&s),
            (
                vec![
                    "127.0.0.3:7000".to_owned(),
                    "127.0.0.2:7000".to_owned(),
                    "127.0.0.4:7000".to_owned()
                ],
                Some(1)
            )
        );
        // No other host: the job is forgotten, as before.
        s.set_job("j", &[], Some(&OwnPlace::default())).unwrap();
        assert_eq!(order(&s), (Vec::new(), None));
    }

    /// Issue 30, partial views: a launcher that says the order's length
    /// hands over only some places, each peer at its own; this agent
    /// stands at its place (by `api.tcp`, its published address left out),
    /// the places not handed over stay unknown, and every index keeps its
    /// meaning. A place given twice or past the order is refused and
    /// changes nothing.
    #[tokio::test]
    async fn a_partial_list_puts_each_peer_at_its_own_place() {
        let s = set(&[]);
        let at = |addr: &str, place: usize| PeerSpec {
            place,
            ..spec(addr, "")
        };
        // This agent at 7 of 12, groups of 3: group 0 and its own group,
        // its published address among them.
        let specs = [
            at("127.0.0.10:7000", 0),
            at("127.0.0.11:7000", 1),
            at("127.0.0.12:7000", 2),
            at("127.0.0.16:7000", 6),
            at("10.1.1.7:7000", 7),
            at("127.0.0.18:7000", 8),
        ];
        let own = OwnPlace {
            index: 7,
            addr: "10.1.1.7:7000".into(),
        };
        s.set_job_partial("j", &specs, Some(&own), shape(12))
            .unwrap();
        let seen = |s: &PeerSet| {
            s.with_order("j", |o, me| {
                (
                    o.len(),
                    o.known(),
                    me,
                    o.get(7).map(str::to_owned),
                    o.get(4).map(str::to_owned),
                    o.addrs_in(6..9),
                )
            })
        };
        let want = (
            12,
            6,
            Some(7),
            Some("127.0.0.2:7000".to_owned()),
            None,
            vec![
                "127.0.0.16:7000".to_owned(),
                "127.0.0.2:7000".to_owned(),
                "127.0.0.18:7000".to_owned(),
            ],
        );
        assert_eq!(seen(&s), want);
        // Refused by name, nothing changed: a peer at this agent's place,
        // one past the order, one address at two places, this agent's own
        // address at a place not its own.
        let refused = [
            (
                vec![at("127.0.0.10:7000", 0), at("127.0.0.19:7000", 7)],
                "place 7 is given twice".to_owned(),
            ),
            (
                vec![at("127.0.0.10:7000", 12)],
                "the job's order of 12 hosts: place 12 (\"127.0.0.10:7000\") is past".to_owned(),
            ),
            (
                vec![at("127.0.0.10:7000", 0), at("127.0.0.10:7000", 3)],
                "\"127.0.0.10:7000\" is at place 0 and at place 3".to_owned(),
            ),
            (
                vec![at("10.1.1.7:7000", 2)],
                "is at place 7 and at place 2".to_owned(),
            ),
        ];
        for (specs, words) in refused {
            let e = s
                .set_job_partial("j", &specs, Some(&own), shape(12))
                .unwrap_err();
            assert!(e.to_string().contains(&words), "{words:?} in {e}");
        }
        assert_eq!(seen(&s), want);
        assert!(
            s.of_job("j")
                .iter()
                .all(|p| p.member.addr != "127.0.0.19:7000")
        );
        // Without its place said, this agent stands where a spec names its
        // api.tcp, as in a whole list.
        let named = [at("127.0.0.10:7000", 0), at("127.0.0.2:7000", 4)];
        s.set_job_partial("j", &named, None, shape(12)).unwrap();
        assert_eq!(s.with_order("j", |o, me| (o.len(), me)), (12, Some(4)));
    }

    /// Issue 30: agents listening on an unspecified address (`api.tcp =
    /// "0.0.0.0:P"`, as deploy/kubernetes suggests), each published by its
    /// launcher at the host's advertised address. Each host computes every
    /// origin's targets on its own (the origin to push, a target to accept
    /// under the placement rule), so all must agree: the hosts that take an
    /// origin's replicas are exactly its targets. Before, each agent put
    /// itself on its own ring at 0.0.0.0 (first, sorted) and the others put
    /// it at its published address: in this job of 6, origins' pushes were
    /// refused where they went.
    #[tokio::test]
    async fn hosts_on_unspecified_listeners_agree_on_every_origins_targets() {
        let n = 6;
        let published = |i: usize| format!("10.0.0.{}:{}", 20 - i, 7000 + i);
        let sets: Vec<PeerSet> = (0..n)
            .map(|i| {
                let addr = format!("0.0.0.0:{}", 7000 + i);
                PeerSet::new(
                    RingMember {
                        domain: addr.clone(),
                        addr,
                    },
                    2,
                    Duration::from_secs(1),
                    insecure(),
                    Vec::new(),
                )
            })
            .collect();
        for (i, s) in sets.iter().enumerate() {
            let others: Vec<PeerSpec> = (0..n)
                .filter(|&j| j != i)
                .map(|j| PeerSpec {
                    addr: published(j),
                    domain: String::new(),
                    host: format!("h{j}"),
                    identity: format!("h{j}"),
                    ..Default::default()
                })
                .collect();
            let own = OwnPlace {
                index: i,
                addr: published(i),
            };
            s.set_job("j", &others, Some(&own)).unwrap();
        }
        for o in 0..n {
            let mut targets = addrs(sets[o].targets("j"));
            targets.sort();
            let mut placed: Vec<String> = (0..n)
                .filter(|&r| r != o && sets[r].placed_here("j", &format!("h{o}")) == Some(true))
                .map(published)
                .collect();
            placed.sort();
            assert_eq!(targets.len(), 2, "origin h{o}: {targets:?}");
            assert_eq!(
                targets, placed,
                "origin h{o}'s targets and the hosts that accept it"
            );
        }
        // A published address that is not host:port is refused by name.
        let bad = OwnPlace {
            index: 0,
            addr: "nope".into(),
        };
        let e = sets[0].set_job("j", &[], Some(&bad)).unwrap_err();
        assert!(e.to_string().contains("self_addr \"nope\""), "{e}");
    }

    fn shape(hosts: usize) -> JobShape {
        JobShape {
            hosts,
            ring_by_place: false,
            replicas: 0,
        }
    }

    /// Issue 30, the ring by place: 16 hosts, two to a rack, published at
    /// addresses that sort against node-rank order. Each origin's replicas
    /// go to the next places in other racks, not the next addresses; every
    /// host agrees on every origin's targets both when handed the whole
    /// order and when handed only a window of five places each side (what
    /// a partial view holds); and a spare in a lost host's place, at a new
    /// address, has the lost host's targets.
    #[tokio::test]
    async fn a_ring_by_place_agrees_on_every_origin_whole_or_windowed() {
        let n = 16;
        let published = |i: usize, era: usize| format!("10.0.{era}.{}:7000", 200 - i);
        let spec_of = |j: usize, era: usize| PeerSpec {
            addr: published(j, era),
            domain: format!("rack{}", j / 2),
            host: format!("h{j}"),
            identity: format!("h{j}"),
            place: j,
        };
        // Place 5 at address era `gen5`, the others at era 0.
        let view = |i: usize, w: usize, gen5: usize| -> PeerSet {
            let era = |j: usize| if j == 5 { gen5 } else { 0 };
            windowed(n, i, w, 2, &|j| published(j, era(j)))
        };
        let host = placed_host;
        let targets_of = targets_by_place;
        for w in [n, 5] {
            let sets: Vec<PeerSet> = (0..n).map(|i| view(i, w, 0)).collect();
            for o in 0..n {
                let targets = targets_of(&sets, o);
                // The next places in racks not its own, one per rack.
                let rack = o / 2;
                let want: Vec<usize> = (1..n)
                    .map(|d| (o + d) % n)
                    .filter(|&j| j / 2 != rack)
                    .step_by(2)
                    .take(2)
                    .collect();
                assert_eq!(targets, want, "window {w}: origin h{o}");
                let mut placed: Vec<usize> = (0..n)
                    .filter(|&r| r != o && sets[r].placed_here("j", &format!("h{o}")) == Some(true))
                    .collect();
                placed.sort();
                let mut sorted = targets.clone();
                sorted.sort();
                assert_eq!(
                    sorted, placed,
                    "window {w}: h{o}'s targets and who accepts it"
                );
            }
            assert_eq!(targets_of(&sets, 5), [6, 8]);
            assert_eq!(targets_of(&sets, 15), [0, 2], "wraps");
        }
        // A spare takes place 5 at a new address: the same targets, and the
        // hosts that held the lost host's replicas accept its own.
        let sets: Vec<PeerSet> = (0..n).map(|i| view(i, 5, 1)).collect();
        assert_eq!(targets_of(&sets, 5), [6, 8]);
        assert_eq!(sets[6].placed_here("j", "h5"), Some(true));
        assert_eq!(sets[7].placed_here("j", "h5"), Some(false));
        // By address, the same hosts send elsewhere.
        let by_addr = PeerSet::new(
            RingMember {
                addr: published(5, 0),
                domain: "rack2".into(),
            },
            2,
            Duration::from_secs(1),
            insecure(),
            Vec::new(),
        );
        let all: Vec<PeerSpec> = (0..n).filter(|&j| j != 5).map(|j| spec_of(j, 0)).collect();
        by_addr.set_job("j", &all, None).unwrap();
        let t: Vec<usize> = by_addr
            .targets("j")
            .iter()
            .map(|p| host(&p.member.addr))
            .collect();
        assert_ne!(t, [6, 8], "by address: {t:?}");
    }

    /// Host `i` of a job of `n` on the ring by place, handed the places
    /// within `w` of it (all for `w >= n`), `rack` to a rack, place `j` at
    /// `addr(j)` (as [`placed_host`] reads back), replicas 2.
    fn windowed(
        n: usize,
        i: usize,
        w: usize,
        rack: usize,
        addr: &dyn Fn(usize) -> String,
    ) -> PeerSet {
        let shape = JobShape {
            hosts: n,
            ring_by_place: true,
            replicas: 0,
        };
        handed((n, i, w, rack), addr, 2, shape)
    }

    /// [`windowed`], `(n, i, w, rack)`, with this agent's own `replicas`
    /// and the launcher's `shape`.
    fn handed(
        (n, i, w, rack): (usize, usize, usize, usize),
        addr: &dyn Fn(usize) -> String,
        replicas: usize,
        shape: JobShape,
    ) -> PeerSet {
        let me = RingMember {
            addr: addr(i),
            domain: format!("rack{}", i / rack),
        };
        let s = PeerSet::new(me, replicas, Duration::from_secs(1), insecure(), Vec::new());
        let specs: Vec<PeerSpec> = (0..n)
            .filter(|&j| j != i)
            .filter(|&j| {
                let d = (j + n - i) % n;
                w >= n || d <= w || n - d <= w
            })
            .map(|j| PeerSpec {
                addr: addr(j),
                domain: format!("rack{}", j / rack),
                host: format!("h{j}"),
                identity: format!("h{j}"),
                place: j,
            })
            .collect();
        let own = OwnPlace {
            index: i,
            addr: String::new(),
        };
        s.set_job_partial("j", &specs, Some(&own), shape).unwrap();
        s
    }

    /// A job whose agents are configured with different
    /// `checkpoint.replicas` (1, 2 and 3 in turn; 12 hosts, two to a
    /// rack, by place and by address): every origin's targets accept its
    /// shards once the launcher says the job's most (3). Not said, each
    /// host judged with its own count and refused the copies an origin
    /// sent past it. More than an agent takes is refused by name.
    #[tokio::test]
    async fn hosts_with_fewer_replicas_than_an_origin_take_what_it_sends_them() {
        let n = 12;
        let own = |i: usize| 1 + i % 3;
        let addr = |j: usize| format!("10.0.0.{}:7000", 200 - j);
        let host = |i: usize, by_place: bool, said: usize| -> PeerSet {
            let shape = JobShape {
                hosts: n,
                ring_by_place: by_place,
                replicas: said,
            };
            handed((n, i, n, 2), &addr, own(i), shape)
        };
        // Each origin's refused targets, summed over the job.
        let refused = |sets: &[PeerSet]| -> usize {
            (0..n)
                .map(|o| {
                    let targets = targets_by_place(sets, o);
                    assert_eq!(targets.len(), own(o), "origin h{o} sends its own count");
                    targets
                        .iter()
                        .filter(|&&t| sets[t].placed_here("j", &format!("h{o}")) != Some(true))
                        .count()
                })
                .sum()
        };
        for by_place in [true, false] {
            let said: Vec<PeerSet> = (0..n).map(|i| host(i, by_place, 3)).collect();
            assert_eq!(refused(&said), 0, "by place {by_place}, the job's 3 said");
            let unsaid: Vec<PeerSet> = (0..n).map(|i| host(i, by_place, 0)).collect();
            assert!(refused(&unsaid) > 0, "by place {by_place}, not said");
        }
        let s = host(0, true, 0);
        let e = s
            .set_job_partial(
                "j",
                &[],
                None,
                JobShape {
                    replicas: 17,
                    ..JobShape::default()
                },
            )
            .unwrap_err();
        assert!(e.to_string().contains("replicas 17"), "{e}");
        assert!(
            !s.targets("j").is_empty(),
            "the refused list changed nothing"
        );
    }

    /// The place of an address made as `10.0.<era>.<200 - place>:7000`.
    fn placed_host(a: &str) -> usize {
        let last: usize = a.split(['.', ':']).nth(3).unwrap().parse().unwrap();
        200 - last
    }

    /// Host `o`'s own targets among `sets`, as places.
    fn targets_by_place(sets: &[PeerSet], o: usize) -> Vec<usize> {
        sets[o]
            .targets("j")
            .iter()
            .map(|p| placed_host(&p.member.addr))
            .collect()
    }

    /// Issue 30: a window too narrow for the walk (racks of four, three
    /// places each side, two replicas: an origin's second target may be
    /// five places on) takes fewer replicas, never misplaced ones: each
    /// origin's targets are a prefix of what the whole order gives, and
    /// no host accepts an origin the whole order does not send to it.
    /// Before, the walk stepped over the missing places and hosts
    /// disagreed: pushes went where they were refused.
    #[tokio::test]
    async fn a_window_too_narrow_for_the_walk_takes_fewer_replicas_never_misplaced_ones() {
        let n = 16;
        let addr = |j: usize| format!("10.0.0.{}:7000", 200 - j);
        let whole: Vec<PeerSet> = (0..n).map(|i| windowed(n, i, n, 4, &addr)).collect();
        let narrow: Vec<PeerSet> = (0..n).map(|i| windowed(n, i, 3, 4, &addr)).collect();
        let mut short = 0;
        for o in 0..n {
            let want = targets_by_place(&whole, o);
            assert_eq!(want.len(), 2, "origin h{o}");
            let got = targets_by_place(&narrow, o);
            assert_eq!(got, want[..got.len()], "origin h{o}: a prefix");
            short += usize::from(got.len() < want.len());
            for r in (0..n).filter(|&r| r != o) {
                if narrow[r].placed_here("j", &format!("h{o}")) == Some(true) {
                    assert!(
                        want.contains(&r),
                        "h{r} accepts h{o}, whose targets are {want:?}"
                    );
                }
            }
        }
        assert!(short > 0, "the narrow window left some origin short");
    }

    /// What the start-up warning of a static fleet on an unspecified
    /// listener looks for.
    #[test]
    fn an_unspecified_listener_is_told_from_a_named_address() {
        for a in ["0.0.0.0:7070", "[::]:7070"] {
            assert!(warden_core::config::unspecified_addr(a), "{a}");
        }
        for a in [
            "10.0.0.7:7070",
            "127.0.0.2:0",
            "[fd00::5]:7070",
            "node7.example:7070",
            "",
        ] {
            assert!(!warden_core::config::unspecified_addr(a), "{a}");
        }
    }

    #[tokio::test]
    async fn a_push_is_placed_here_only_when_the_origins_ring_says_so() {
        // This host is 127.0.0.2 (rack2); the job's peers: h3 and h4.
        let s = set(&[]);
        let named = |addr: &str, domain: &str, name: &str| PeerSpec {
            identity: name.into(),
            ..spec(addr, domain)
        };
        s.set_job(
            "j",
            &[
                named("127.0.0.3:7000", "rack3", "h3"),
                named("127.0.0.4:7000", "rack4", "h4"),
            ],
            None,
        )
        .unwrap();
        assert!(s.is_member_name("j", "h3") && s.is_member_name("j", "h4"));
        assert!(!s.is_member_name("j", "h9") && !s.is_member_name("j", ""));
        assert!(!s.is_member_name("other", "h3"));
        // h3's ring (one replica): the next address after it is .4, so
        // its replicas go to h4, not here; h4's wrap around to .2 (here).
        assert_eq!(s.placed_here("j", "h3"), Some(false));
        assert_eq!(s.placed_here("j", "h4"), Some(true));
        assert_eq!(s.placed_here("j", "h9"), None);
        assert_eq!(s.placed_here("j", ""), None);
        assert!(s.knows("h3") && !s.knows("h9") && !s.knows(""));
    }

    /// A job of 16,384 hosts in 128 racks: the kept ring answers every
    /// origin as the copy-and-sort did, and this host's targets too.
    #[tokio::test]
    async fn the_kept_ring_answers_as_the_sort_at_16384_hosts() {
        let s = set(&[]);
        let specs: Vec<PeerSpec> = (0..16_384u32)
            .map(|i| PeerSpec {
                identity: format!("h{i}"),
                ..spec(
                    &format!("10.{}.{}.{}:7070", i >> 16, (i >> 8) & 255, i & 255),
                    &format!("rack{}", i / 128),
                )
            })
            .collect();
        s.set_job("j", &specs, None).unwrap();
        let all = s.of_job("j");
        let slow = |origin: &str| {
            let o = all.iter().find(|p| p.name == origin).unwrap();
            let mut ring: Vec<RingMember> = all
                .iter()
                .filter(|p| p.member.addr != o.member.addr)
                .map(|p| p.member.clone())
                .collect();
            ring.push(s.me.clone());
            let mine = ring.len() - 1;
            placement::by_sort(&o.member, &ring, s.replicas).contains(&mine)
        };
        // The origin just before this host along the ring sends here.
        let before = all
            .iter()
            .filter(|p| p.member.addr < s.me.addr)
            .max_by(|a, b| a.member.addr.cmp(&b.member.addr))
            .map(|p| p.name.clone())
            .unwrap();
        let mut here = 0;
        let sample = (0..16_384).step_by(997).map(|i| format!("h{i}"));
        for name in sample.chain([before]) {
            let kept = s.placed_here("j", &name);
            assert_eq!(kept, Some(slow(&name)), "{name}");
            here += usize::from(kept == Some(true));
        }
        assert!(here > 0, "some origin places its replica here");
        let members: Vec<RingMember> = all.iter().map(|p| p.member.clone()).collect();
        let want: Vec<String> = placement::by_sort(&s.me, &members, 1)
            .into_iter()
            .map(|i| all[i].member.addr.clone())
            .collect();
        assert_eq!(addrs(s.targets("j")), want);
    }

    #[tokio::test]
    async fn a_bad_address_is_named_and_changes_nothing() {
        let s = set(&[]);
        s.set_job("j1", &[spec("127.0.0.3:7000", "r3")], None)
            .unwrap();
        let e = s
            .set_job(
                "j1",
                &[spec("127.0.0.4:7000", "r4"), spec("nope", "r5")],
                None,
            )
            .unwrap_err();
        assert!(e.to_string().contains("peer 1"), "{e}");
        assert!(e.to_string().contains("\"nope\""), "{e}");
        assert_eq!(addrs(s.targets("j1")), vec!["127.0.0.3:7000"]);
    }
}
