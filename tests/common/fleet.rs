//! A fleet of simulated hosts of one multi-host job on a real etcd, for the
//! scale bench (cli/benches/coord_fleet.rs) and its CI test
//! (tests/coord_fleet.rs): issue 30's measurements, in the repository.
//!
//! In: the etcd endpoints (one real server or a cluster,
//! tests/common/etcd.rs) and a [`FleetConfig`]: how many hosts, how many of
//! them run the real [`Coordinator`] ("full" hosts) and the lease TTL.
//! Out: a [`Fleet`] that joins every host, makes restart rounds (also
//! while an etcd member is killed or paused: a request refused during an
//! election is asked again, as the launcher does), loses a host without a
//! word (its lease left to expire), swaps a spare in for a lost or a
//! cordoned host, says whether every host kept its lease
//! ([`LeaseCheck`]), and reads etcd's own counters ([`EtcdMetrics`]: bytes
//! sent and received on the client port, CPU seconds, resident memory)
//! and this process's, so a caller turns them into per-round and per-host
//! figures.
//!
//! A "light" host does a launcher's share of etcd work without the
//! coordinator's decisions: its own connection, a lease it keeps alive
//! (every third of the TTL), its member record (the same JSON, so the full
//! hosts count it in every round), the read a joining launcher makes, and
//! a watch of what a launcher watches, as a launcher that does not decide
//! rounds (every host past the first 8 by join, issue 30: the full hosts
//! join first, so they are the deciders); it follows the epoch from that
//! watch. Like the coordinator, it opens a new keep-alive stream when one
//! breaks or goes unanswered for a sixth of the TTL, on the next endpoint,
//! and a new watch from the last revision it saw when its watch ends: a
//! killed or paused etcd member costs it a stream, not its lease. It never advances the epoch itself (a real launcher would also
//! race for the txn): that work is the full hosts'. So N hosts with K full
//! ones cost etcd what N launchers cost it, less N-K losing txns per round,
//! and cost this process K coordinators' CPU.
//!
//! Never: wait without a deadline (every wait here is bounded and panics
//! with what it waited for), or leave a task behind (dropping the fleet
//! aborts every light host's tasks; full coordinators stop on drop).

// Each user takes a part; the bench and the test panic on a broken set-up.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use warden_launcher::coord::join_read::{self, JoinRead};
use warden_launcher::coord::keys::Keys;
use warden_launcher::coord::plan::MemberRecord;
use warden_launcher::coord::{CoordConfig, Coordinator, Round};
use warden_planner::fleet::FaultRounds;

/// Light hosts' keep-alive streams opened again on the next endpoint: one
/// left unanswered for its deadline (late), or one that ended, failed or
/// could not connect (broken). Printed per fault by `rounds_through`: how
/// many hosts moved, and why, while a member was killed or paused.
static KEEPALIVE_LATE: AtomicU64 = AtomicU64::new(0);
static KEEPALIVE_BROKEN: AtomicU64 = AtomicU64::new(0);
/// Why streams broke, by the start of what etcd or the client said, and
/// where (connecting, opening, a keep-alive): printed with the moves, so a
/// fault's moves say whether the member went away or etcd refused.
static BROKEN_WHY: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Counts one broken stream, and why.
fn broken(at: &str, why: &str) {
    KEEPALIVE_BROKEN.fetch_add(1, Ordering::Relaxed);
    let short: String = why.chars().take(90).collect();
    *BROKEN_WHY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(format!("{at}: {short}"))
        .or_default() += 1;
}

/// Every wait of the fleet: generous, a loaded 2-core machine with
/// thousands of hosts on it.
pub const WAIT: Duration = Duration::from_secs(300);

/// The job's key prefix (the coordinator's default).
const PREFIX: &str = "/warden/jobs";

/// What fleet to run.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// etcd's client endpoints.
    pub endpoints: Vec<String>,
    /// The job id.
    pub job: String,
    /// Hosts in all.
    pub hosts: usize,
    /// How many of them run the real coordinator (at least 1).
    pub full: usize,
    /// The lease TTL of every host.
    pub ttl: Duration,
    /// The full hosts' rejoin grace (a member lost without a word is
    /// replaced after the TTL and this).
    pub rejoin_grace: Duration,
    /// How many light hosts join at once (a real fleet joins in one burst;
    /// a bound keeps this process's connection set-up from starving the
    /// keep-alives of the hosts already in).
    pub join_concurrency: usize,
    /// Light hosts read and watch every member key, as every launcher did
    /// before only the first 8 by join decided rounds (issue 30): the
    /// baseline of the join measurement, in the same binary.
    pub every_host_decides: bool,
    /// Light hosts join as a launcher did before the deciders' markers
    /// (issue 30): the register txn also reads the first 8 member keys by
    /// create revision (a sorted range, which etcd 3.4 answers by reading
    /// every member record), and the watch takes the member keys'
    /// deletions instead of the markers: the baseline of that change, in
    /// the same binary.
    pub sorted_join: bool,
    /// Every host's etcd request deadline (the coordinator's
    /// `request_timeout`; a light host's keep-alive unanswered this long
    /// opens a new stream).
    pub request_timeout: Duration,
    /// etcd gRPC proxies' endpoints (`EtcdProxy`): when any, host `i`
    /// reaches etcd through proxy `i % len` alone, as a host would through
    /// its rack's proxy; `endpoints` are then the members', for their
    /// metrics.
    pub proxies: Vec<String>,
}

impl FleetConfig {
    /// `hosts` hosts, `full` of them full, a 10 s TTL.
    pub fn new(endpoints: Vec<String>, job: &str, hosts: usize, full: usize) -> Self {
        Self {
            endpoints,
            job: job.to_owned(),
            hosts,
            full: full.clamp(1, hosts),
            ttl: Duration::from_secs(10),
            rejoin_grace: Duration::from_secs(1),
            join_concurrency: 32,
            every_host_decides: false,
            sorted_join: false,
            request_timeout: Duration::from_secs(30),
            proxies: Vec::new(),
        }
    }

    /// What host `i` connects to: its proxy, else every member.
    pub fn endpoints_of(&self, i: usize) -> Vec<String> {
        if self.proxies.is_empty() {
            self.endpoints.clone()
        } else {
            vec![self.proxies[i % self.proxies.len()].clone()]
        }
    }

    /// The `i`th host's id.
    fn host(i: usize) -> String {
        format!("host-{i:05}")
    }

    /// The config of a full host: min one host short of the fleet (a lost
    /// host makes a smaller round, not a waiting one), max the fleet; a
    /// last call long enough that the first round forms only with every
    /// host in (at max, at once).
    fn coord(&self, host: &str, i: usize) -> CoordConfig {
        let mut c = CoordConfig::new(self.endpoints_of(i), &self.job, host, addr(i));
        c.nproc_per_node = 8;
        c.min_nodes = u32::try_from(self.hosts.saturating_sub(1).max(1)).unwrap();
        c.max_nodes = u32::try_from(self.hosts).unwrap();
        c.lease_ttl = self.ttl;
        c.last_call = Duration::from_secs(600);
        c.rejoin_grace = self.rejoin_grace;
        c.rejoin_timeout = Duration::from_secs(600);
        c.join_timeout = Duration::from_secs(5);
        c.request_timeout = self.request_timeout;
        c
    }

    /// A spare's config: as a full host's, marked spare (taken into a
    /// round only in a regular host's place).
    fn coord_spare(&self, host: &str, i: usize) -> CoordConfig {
        let mut c = self.coord(host, i);
        c.spare = true;
        c
    }
}

/// A loopback address per host, as each host would advertise its own.
fn addr(i: usize) -> String {
    format!("127.0.{}.{}", (i / 250) % 250, 2 + i % 250)
}

/// A simulated host: etcd work without the coordinator (module doc).
#[derive(Debug)]
struct Light {
    host: String,
    /// A spare host (taken into a round only in a regular host's place).
    spare: bool,
    /// The epoch its watch saw last.
    epoch: Arc<AtomicU64>,
    /// When etcd last renewed its lease, at the earliest: [`since_start`]
    /// when the grant was asked for or the last answered keep-alive sent.
    /// Its lease ends a TTL after, or later.
    kept: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

/// Nanoseconds since the first call in this process: a clock the light
/// hosts' keep-alives can stamp into an atomic.
fn since_start() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A light host lost without a word ([`Fleet::lose_one`]).
#[derive(Debug, Clone, Copy)]
pub struct Loss {
    /// From the host's end (its keep-alives stopped) until every other
    /// host holds the round without it.
    pub out: Duration,
    /// The same, counted from its lease's end (etcd's last renewal, taken
    /// as when the keep-alive it answered was sent, plus the TTL), in
    /// seconds: what is left past the lease is etcd's expiry sweep, the
    /// rejoin grace and the round. Never less than the real figure.
    pub beyond_lease_s: f64,
    /// From then until a new host joined in its place is in a round.
    pub replaced: Duration,
}

impl Drop for Light {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The fleet.
pub struct Fleet {
    cfg: FleetConfig,
    keys: Keys,
    full: Vec<Coordinator>,
    light: Vec<Light>,
    /// Bumped by every light host whose epoch moved.
    moved: Arc<watch::Sender<u64>>,
    /// Host ids given so far (a replacement gets a new one).
    next: usize,
    /// Light hosts whose lease etcd let expire (keep-alives starved on a
    /// loaded machine, or no member answered within the TTL).
    leases_lost: Arc<AtomicU64>,
    /// The epoch every host holds now.
    pub epoch: u64,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("hosts", &(self.full.len() + self.light.len()))
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// What joining took.
#[derive(Debug, Clone, Copy)]
pub struct Joined {
    /// From the first join to every host holding the first round.
    pub all: Duration,
    /// This process's resident memory grown by the full hosts, per host.
    pub rss_per_full: u64,
    /// ... and by the light hosts, per host.
    pub rss_per_light: u64,
    /// Where the join's time went, phase by phase.
    pub phases: JoinPhases,
}

/// The join in phases, each from the end of the one before: the full hosts
/// joined; every light host registered, read what a joining launcher reads
/// and watching; the first round that is not waiting held by the first
/// full host (written and read back); every host holding it. With etcd's
/// CPU and this process's CPU in each, so a phase that is etcd-bound or
/// client-bound says so.
#[derive(Debug, Clone, Copy, Default)]
pub struct JoinPhases {
    /// Phase durations, seconds: full, light, formed, spread.
    pub wall: [f64; 4],
    /// etcd's CPU seconds in each phase (every member).
    pub etcd_cpu: [f64; 4],
    /// etcd's bytes sent in each phase.
    pub etcd_sent: [f64; 4],
    /// This process's CPU seconds in each phase.
    pub fleet_cpu: [f64; 4],
}

impl std::fmt::Display for JoinPhases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = ["full hosts", "light hosts", "first round", "to every host"];
        for (i, name) in names.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(
                f,
                "{name} {:.2} s (etcd CPU {:.2} s, sent {:.1} MB; fleet CPU {:.2} s)",
                self.wall[i],
                self.etcd_cpu[i],
                self.etcd_sent[i] / 1e6,
                self.fleet_cpu[i]
            )?;
        }
        Ok(())
    }
}

/// A point in the join: when, etcd's counters and this process's CPU.
struct Mark(Instant, EtcdMetrics, f64);

impl Mark {
    fn now(endpoints: &[String]) -> Self {
        Self(Instant::now(), EtcdMetrics::read_all(endpoints), cpu_self())
    }
}

impl JoinPhases {
    fn of(marks: &[Mark; 5]) -> Self {
        let mut p = Self::default();
        for i in 0..4 {
            let (a, b) = (&marks[i], &marks[i + 1]);
            p.wall[i] = secs(b.0.duration_since(a.0));
            p.etcd_cpu[i] = b.1.cpu - a.1.cpu;
            p.etcd_sent[i] = b.1.sent - a.1.sent;
            p.fleet_cpu[i] = b.2 - a.2;
        }
        p
    }
}

impl Fleet {
    /// Joins every host (full ones first, then the light ones, at most
    /// `join_concurrency` at once) and waits until all hold the first round.
    pub async fn join(cfg: FleetConfig) -> (Self, Joined) {
        let keys = Keys::new(PREFIX, &cfg.job);
        let (moved, _) = watch::channel(0u64);
        let mut fleet = Self {
            keys,
            full: Vec::new(),
            light: Vec::new(),
            moved: Arc::new(moved),
            next: cfg.hosts,
            leases_lost: Arc::new(AtomicU64::new(0)),
            epoch: 0,
            cfg,
        };
        let m0 = Mark::now(&fleet.cfg.endpoints);
        let t0 = m0.0;
        let rss0 = memory_now();
        let joins: Vec<_> = (0..fleet.cfg.full)
            .map(|i| {
                let c = fleet.cfg.coord(&FleetConfig::host(i), i);
                tokio::spawn(async move {
                    tokio::time::timeout(WAIT, Coordinator::join(c))
                        .await
                        .expect("a full host joins in time")
                        .expect("a full host joins")
                })
            })
            .collect();
        for j in joins {
            fleet.full.push(j.await.unwrap());
        }
        let rss1 = memory_now();
        let m1 = Mark::now(&fleet.cfg.endpoints);
        let gate = Arc::new(Semaphore::new(fleet.cfg.join_concurrency.max(1)));
        let joins: Vec<_> = (fleet.cfg.full..fleet.cfg.hosts)
            .map(|i| fleet.spawn_light(i, false, Arc::clone(&gate)))
            .collect();
        for j in joins {
            fleet.light.push(j.await.unwrap());
        }
        let m2 = Mark::now(&fleet.cfg.endpoints);
        // Why no first round came, when none does: what the first full
        // host sees, and the light hosts whose lease lapsed in the join (the
        // round waits the full hosts' last call for them).
        let no_first_round = |fleet: &Self| {
            let s = fleet.full[0].state();
            format!(
                "no first round within {WAIT:?}: {} sees {} of {} hosts live, {} light host lease(s) lost",
                fleet.full[0].host(),
                s.live,
                fleet.full.len() + fleet.light.len(),
                fleet.leases_lost.load(Ordering::Relaxed),
            )
        };
        let mut first = tokio::time::timeout(WAIT, fleet.full[0].next_round(0))
            .await
            .unwrap_or_else(|_| panic!("{}", no_first_round(&fleet)))
            .expect("a first round");
        while first.waiting {
            first = tokio::time::timeout(WAIT, fleet.full[0].next_round(first.epoch))
                .await
                .unwrap_or_else(|_| panic!("{}", no_first_round(&fleet)))
                .expect("a first round");
        }
        let m3 = Mark::now(&fleet.cfg.endpoints);
        // A round written while hosts were still arriving is a waiting one
        // (too few hosts, nobody runs workers): the fleet has formed at the
        // first round that is not.
        let mut round = fleet.wait_round(0).await;
        while round.waiting {
            round = fleet.wait_round(round.epoch).await;
        }
        let all = t0.elapsed();
        let m4 = Mark::now(&fleet.cfg.endpoints);
        assert_eq!(
            round.nnodes as usize, fleet.cfg.hosts,
            "the first round has every host"
        );
        let rss2 = memory_now();
        let per = |d: u64, n: usize| d / u64::try_from(n.max(1)).unwrap();
        let joined = Joined {
            all,
            rss_per_full: per(rss1.saturating_sub(rss0), fleet.full.len()),
            rss_per_light: per(rss2.saturating_sub(rss1), fleet.light.len()),
            phases: JoinPhases::of(&[m0, m1, m2, m3, m4]),
        };
        (fleet, joined)
    }

    /// Starts joining light host `i` (a spare or not) once `gate` lets it.
    fn spawn_light(&self, i: usize, spare: bool, gate: Arc<Semaphore>) -> JoinHandle<Light> {
        let cfg = self.cfg.clone();
        let keys = self.keys.clone();
        let moved = Arc::clone(&self.moved);
        let lost = Arc::clone(&self.leases_lost);
        tokio::spawn(async move {
            let _permit = gate.acquire().await.unwrap();
            let join = join_light(cfg, keys, i, spare, moved, lost);
            tokio::time::timeout(WAIT, join)
                .await
                .expect("a light host joins in time")
        })
    }

    /// Hosts in the fleet now, spares included.
    pub fn hosts(&self) -> usize {
        self.full.len() + self.light.len()
    }

    /// Regular hosts in the fleet now (spares left out).
    pub fn regular(&self) -> usize {
        self.full.len() + self.light.iter().filter(|l| !l.spare).count()
    }

    /// Waits until every host holds a round after `after`: the full hosts
    /// through `next_round`, the light ones through their watch. Returns
    /// the first full host's round.
    pub async fn wait_round(&mut self, after: u64) -> Round {
        let mut rx = self.moved.subscribe();
        let mut first = None;
        for c in &self.full {
            let r = tokio::time::timeout(WAIT, c.next_round(after))
                .await
                .unwrap_or_else(|_| {
                    let s = c.state();
                    panic!(
                        "{}: no round after {after} in {WAIT:?}; it sees {} of {} hosts live, \
                         {} light host lease(s) lost",
                        c.host(),
                        s.live,
                        self.full.len() + self.light.len(),
                        self.leases_lost.load(Ordering::Relaxed),
                    )
                })
                .unwrap_or_else(|e| panic!("{}: no round after {after}: {e}", c.host()));
            first.get_or_insert(r);
        }
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            rx.borrow_and_update();
            let behind = self
                .light
                .iter()
                .filter(|l| l.epoch.load(Ordering::Acquire) <= after)
                .count();
            if behind == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                panic!("{behind} light host(s) saw no round after {after} in {WAIT:?}");
            }
        }
        let round = first.expect("at least one full host");
        self.epoch = round.epoch;
        round
    }

    /// One restart round: the first full host asks for it; until every
    /// host holds it.
    pub async fn restart(&mut self) -> Duration {
        let t0 = Instant::now();
        let seen = self.epoch;
        let next = self.full[0]
            .request_restart(seen, "fleet bench")
            .await
            .expect("request_restart");
        assert_eq!(next, seen + 1, "one restart makes one round");
        self.wait_round(seen).await;
        t0.elapsed()
    }

    /// One restart round while etcd may be losing a member: a request that
    /// fails (an election under way, a member that does not answer) is
    /// asked again every 100 ms, as the launcher asks again while it waits
    /// (launcher/src/etcd.rs); until every host holds a round after the
    /// one it saw. Returns the time and the requests refused.
    pub async fn restart_through_faults(&mut self) -> (Duration, u32) {
        let t0 = Instant::now();
        let seen = self.epoch;
        let mut refused = 0u32;
        let deadline = Instant::now() + WAIT;
        loop {
            match self.full[0].request_restart(seen, "fleet bench").await {
                Ok(e) if e > seen => break,
                Ok(e) => panic!("request_restart after {seen} left the epoch at {e}"),
                Err(e) => {
                    refused += 1;
                    assert!(
                        Instant::now() < deadline,
                        "no restart round taken in {WAIT:?}: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        self.wait_round(seen).await;
        (t0.elapsed(), refused)
    }

    /// Restart rounds while `fault` runs beside them (it returns when the
    /// fault began and how long it lasted); rounds go on until `until` after
    /// the fault began and at least `min_rounds` were made.
    pub async fn rounds_through<F>(
        &mut self,
        fault: F,
        min_rounds: usize,
        until: Duration,
    ) -> FaultRounds
    where
        F: std::future::Future<Output = (Instant, Duration)> + Send + 'static,
    {
        let before = self.leases().await;
        let moves0 = (
            KEEPALIVE_LATE.load(Ordering::Relaxed),
            KEEPALIVE_BROKEN.load(Ordering::Relaxed),
        );
        let mut fault = tokio::spawn(fault);
        let mut spans: Vec<(Instant, Duration)> = Vec::new();
        let mut refused = 0;
        let mut began: Option<(Instant, Duration)> = None;
        loop {
            let t0 = Instant::now();
            let (took, r) = self.restart_through_faults().await;
            refused += r;
            spans.push((t0, took));
            if began.is_none() && fault.is_finished() {
                began = Some((&mut fault).await.expect("the fault task"));
            }
            if let Some((at, _)) = began
                && spans.len() >= min_rounds
                && at.elapsed() >= until
            {
                break;
            }
        }
        let (at, lasted) = began.expect("the fault began");
        // The rounds from the one in flight when the fault began.
        let during: Vec<&(Instant, Duration)> = spans
            .iter()
            .filter(|(t0, took)| *t0 + *took >= at)
            .collect();
        let times: Vec<Duration> = during.iter().map(|s| s.1).collect();
        let after = self.leases().await;
        eprintln!(
            "fleet: light hosts' keep-alive streams moved to the next member from the round before the fault: {} left unanswered, {} broken or not connected",
            KEEPALIVE_LATE.load(Ordering::Relaxed) - moves0.0,
            KEEPALIVE_BROKEN.load(Ordering::Relaxed) - moves0.1,
        );
        let why = std::mem::take(
            &mut *BROKEN_WHY
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for (what, n) in why {
            eprintln!("fleet:   broken since the previous report: {n} x {what}");
        }
        let lost = after.light_lost.saturating_sub(before.light_lost)
            + u64::try_from(after.full_lost.saturating_sub(before.full_lost)).unwrap();
        FaultRounds {
            rounds: u32::try_from(times.len()).unwrap(),
            hit_s: times.first().map_or(0.0, |d| secs(*d)),
            max_s: times.iter().max().map_or(0.0, |d| secs(*d)),
            median_s: quantile(&times, 0.5),
            refused,
            fault_s: secs(lasted),
            leases_lost: lost,
            leases_kept: lost == 0 && after.member_keys == after.hosts,
        }
    }

    /// Whether every host kept its lease: light hosts that lost theirs,
    /// full hosts that found theirs gone (and rejoined, or failed), and
    /// the member keys in etcd against the hosts of the fleet.
    pub async fn leases(&self) -> LeaseCheck {
        let full_lost = self
            .full
            .iter()
            .filter(|c| {
                let s = c.state();
                s.rejoins > 0 || s.failed.is_some()
            })
            .count();
        // Each member in turn until one answers: a killed member refuses,
        // and a client over all endpoints may pick it.
        let mut members = None;
        for e in &self.cfg.endpoints {
            let Ok(mut client) = Client::connect([e.as_str()], Some(connect_options())).await
            else {
                continue;
            };
            let count = client
                .get(
                    self.keys.members(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                )
                .await;
            if let Ok(r) = count {
                members = Some(r.count());
                break;
            }
        }
        let members = members.expect("a member answers the count of member keys");
        LeaseCheck {
            light_lost: self.leases_lost.load(Ordering::Relaxed),
            full_lost,
            member_keys: usize::try_from(members).unwrap_or(0),
            hosts: self.hosts(),
        }
    }

    /// A spare host joins (light; standby: the round is full, so no new
    /// round) and sees the current epoch.
    pub async fn add_spare(&mut self) {
        let i = self.next;
        self.next += 1;
        let gate = Arc::new(Semaphore::new(1));
        let l = self.spawn_light(i, true, gate).await.unwrap();
        self.light.push(l);
    }

    /// Waits until every host holds a round after `after` that has `host`
    /// in it (a loss may first make a round without the lost host and
    /// then one with the spare).
    async fn wait_round_with(&mut self, after: u64, host: &str) -> Round {
        let mut seen = after;
        loop {
            let round = self.wait_round(seen).await;
            if round.members.iter().any(|m| m == host) {
                return round;
            }
            seen = round.epoch;
        }
    }

    /// A spare swap after a host lost without a word: a regular light host
    /// dies (its lease left to expire) while a spare stands by; from the
    /// loss until every host holds the round with the spare in it.
    pub async fn swap_lost(&mut self) -> Duration {
        let spare = self.standby_spare();
        let at = self
            .light
            .iter()
            .rposition(|l| !l.spare)
            .expect("a regular light host to lose");
        let lost = self.light.remove(at);
        let t0 = Instant::now();
        let seen = self.epoch;
        drop(lost);
        let round = self.wait_round_with(seen, &spare).await;
        let took = t0.elapsed();
        assert_eq!(
            round.nnodes as usize,
            self.regular() + 1,
            "the round is full again"
        );
        self.take_in(&spare);
        took
    }

    /// A spare swap after a cordon: the last full host leaves with
    /// `Leave::Cordoned` (its member key deleted and its departure written
    /// in one txn, as a launcher does on a hardware fault) while a spare
    /// stands by; from the leave until every host holds the round with the
    /// spare in it.
    pub async fn swap_cordoned(&mut self) -> Duration {
        assert!(
            self.full.len() >= 2,
            "a full host to cordon besides the first"
        );
        let spare = self.standby_spare();
        let leaving = self.full.pop().expect("a full host");
        let t0 = Instant::now();
        let seen = self.epoch;
        leaving
            .leave(warden_launcher::coord::Leave::Cordoned(
                "fleet bench".into(),
            ))
            .await
            .expect("a cordoned host leaves");
        let round = self.wait_round_with(seen, &spare).await;
        let took = t0.elapsed();
        assert_eq!(
            round.nnodes as usize,
            self.regular() + 1,
            "the round is full again"
        );
        self.take_in(&spare);
        took
    }

    /// The id of a spare standing by.
    fn standby_spare(&self) -> String {
        self.light
            .iter()
            .find(|l| l.spare)
            .map(|l| l.host.clone())
            .expect("a spare standing by (add_spare)")
    }

    /// A spare now in the round counts as a regular host.
    fn take_in(&mut self, host: &str) {
        if let Some(l) = self.light.iter_mut().find(|l| l.host == host) {
            l.spare = false;
        }
    }

    /// A light host dies without a word (its keep-alives stop, its lease
    /// left to expire): until every other host holds the round without it.
    /// Then a new host joins in its place (until every host holds that
    /// round too). Returns both times, the first also from its lease's end.
    pub async fn lose_one(&mut self) -> Loss {
        let lost = self.light.pop().expect("a light host to lose");
        let seen = self.epoch;
        let kept = Arc::clone(&lost.kept);
        let t0 = Instant::now();
        let at = since_start();
        drop(lost);
        let round = self.wait_round(seen).await;
        let lost_after = t0.elapsed();
        // The lease's end from the drop: its last renewal a TTL on.
        let renewed_ago = at.saturating_sub(kept.load(Ordering::Acquire)) as f64 / 1e9;
        let lease_end = self.cfg.ttl.as_secs_f64() - renewed_ago;
        assert_eq!(
            round.nnodes as usize,
            self.hosts(),
            "the round after a loss has the hosts left"
        );
        let t1 = Instant::now();
        let seen = self.epoch;
        let i = self.next;
        self.next += 1;
        let gate = Arc::new(Semaphore::new(1));
        let l = self.spawn_light(i, false, gate).await.unwrap();
        self.light.push(l);
        let round = self.wait_round(seen).await;
        assert_eq!(round.nnodes as usize, self.hosts(), "the new host is in");
        Loss {
            out: lost_after,
            beyond_lease_s: lost_after.as_secs_f64() - lease_end,
            replaced: t1.elapsed(),
        }
    }

    /// This process's memory ([`memory_now`]) per full host at the fleet's size:
    /// `k` more full hosts join (as standby: the round is full, so no new
    /// round; past the first 8 by join, so they do not decide rounds), each
    /// until it holds the current round; the growth divided by `k`. Then
    /// they leave.
    pub async fn full_host_memory(&mut self, k: usize) -> u64 {
        let rss0 = memory_now();
        let mut extra = Vec::new();
        for _ in 0..k {
            let i = self.next;
            self.next += 1;
            let c = tokio::time::timeout(
                WAIT,
                Coordinator::join(self.cfg.coord(&FleetConfig::host(i), i)),
            )
            .await
            .expect("an extra full host joins in time")
            .expect("an extra full host joins");
            extra.push(c);
        }
        // Each extra host joins past the first 8 by join, so it does not
        // decide rounds and holds no other host's member record (issue
        // 30): until it holds the current round, its base read.
        let epoch = self.epoch;
        for c in &extra {
            tokio::time::timeout(WAIT, async {
                let mut rx = c.rounds();
                while rx
                    .borrow_and_update()
                    .round
                    .as_ref()
                    .is_none_or(|r| r.epoch < epoch)
                {
                    if rx.changed().await.is_err() {
                        break;
                    }
                }
            })
            .await
            .expect("an extra full host holds the current round");
        }
        let per = memory_now().saturating_sub(rss0) / u64::try_from(k.max(1)).unwrap();
        for c in extra {
            c.leave(warden_launcher::coord::Leave::Stopped(
                "fleet: memory measured".into(),
            ))
            .await
            .expect("an extra full host leaves");
        }
        per
    }

    /// The job's `layouts/` prefix (for `etcd::bases_in_history`).
    pub fn layouts(&self) -> String {
        self.keys.layouts()
    }

    /// The bytes of what a host reads for the current round: the round
    /// record.
    pub async fn round_bytes(&self) -> usize {
        let mut c = Client::connect(self.cfg.endpoints.clone(), Some(connect_options()))
            .await
            .unwrap();
        let r = c.get(self.keys.round(self.epoch), None).await.unwrap();
        r.kvs().first().map_or(0, |kv| kv.value().len())
    }
}

/// A light host's waits between attempts of its join, as the
/// coordinator's (250 ms doubling to 4 s); after 60 s of them the join
/// fails loudly.
struct Patience {
    since: Instant,
    next: Duration,
}

/// How many times light hosts asked again in their joins (all fleets of
/// this process).
pub static JOIN_RETRIES: AtomicU64 = AtomicU64::new(0);

impl Patience {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            next: Duration::from_millis(250),
        }
    }

    async fn wait(&mut self, host: &str, what: &str, error: &str) {
        assert!(
            self.since.elapsed() < Duration::from_secs(60),
            "{host}: {what} failed for 60 s: {error}"
        );
        if JOIN_RETRIES.fetch_add(1, Ordering::Relaxed) == 0 {
            eprintln!("fleet: {host}: {what}: {error}; asking again (the first light host to)");
        }
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(Duration::from_secs(4));
    }
}

/// The connection options of a light host (and of the fleet's own
/// reads): the coordinator's (launcher/src/coord/connect.rs), with the
/// fleet's generous deadlines.
fn connect_options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(30))
        .with_timeout(Duration::from_secs(60))
}

/// A light host joins: connect, lease, member key (waiting out a held
/// one), the joining read, then the keep-alive and the watch.
async fn join_light(
    cfg: FleetConfig,
    keys: Keys,
    i: usize,
    spare: bool,
    moved: Arc<watch::Sender<u64>>,
    leases_lost: Arc<AtomicU64>,
) -> Light {
    let host = FleetConfig::host(i);
    let endpoints = cfg.endpoints_of(i);
    // HTTP/2 pings every third of the TTL, as the coordinator's client:
    // a connection to a member that stopped answering is dropped before
    // the lease runs out.
    let options = connect_options().with_keep_alive(cfg.ttl / 3, cfg.request_timeout);
    let mut client = Client::connect(endpoints.clone(), Some(options))
        .await
        .expect("a light host connects");
    // The connection's first read, as the coordinator's (launcher/src/
    // coord/connect.rs): the one key the job's prefix names, asked again
    // while etcd's server itself says it cannot serve it now (a 4,096-host
    // join on 3 members met "etcdserver: leader changed" here).
    let mut patience = Patience::new();
    loop {
        match client
            .get(keys.base(), Some(GetOptions::new().with_count_only()))
            .await
        {
            Ok(_) => break,
            Err(e) if warden_launcher::coord::etcd_cannot_serve_now(&e) => {
                patience.wait(&host, "first read", &e.to_string()).await;
            }
            Err(e) => panic!("{host}: a light host's first read: {e}"),
        }
    }
    let asked = since_start();
    // Asked again while etcd does not answer or is too busy to, as the
    // coordinator does (launcher/src/coord/patience.rs): a mass start of
    // 16,384 hosts gets "request timed out" from etcd.
    let mut patience = Patience::new();
    let lease = loop {
        let grant = client.lease_grant(i64::try_from(cfg.ttl.as_secs().max(1)).unwrap(), None);
        match tokio::time::timeout(cfg.request_timeout, grant).await {
            Ok(Ok(r)) => break r.id(),
            Ok(Err(e)) => patience.wait(&host, "lease grant", &e.to_string()).await,
            Err(_) => patience.wait(&host, "lease grant", "no answer").await,
        }
    };
    let kept = Arc::new(AtomicU64::new(asked));
    let record = MemberRecord {
        host: host.clone(),
        addr: addr(i),
        nproc_per_node: 8,
        spare,
        min_nodes: u32::try_from(cfg.hosts.saturating_sub(1).max(1)).unwrap(),
        max_nodes: u32::try_from(cfg.hosts).unwrap(),
        pid: std::process::id(),
        joined_at_ms: 0,
        ckpt_peer: None,
        incarnation: 1_000_000 + u64::try_from(i).unwrap(),
        ckpt_ring_by_place: false,
        ckpt_replicas: None,
    };
    let key = keys.member(&host);
    let decides = cfg.every_host_decides;
    // Registering and the joining read in one txn, as the coordinator
    // (launcher/src/coord/join_read.rs).
    let mut ops = vec![
        TxnOp::put(
            key.as_str(),
            serde_json::to_string(&record).unwrap(),
            Some(PutOptions::new().with_lease(lease)),
        ),
        TxnOp::delete(keys.departure(&host), None),
    ];
    if cfg.sorted_join {
        ops.push(TxnOp::get(
            keys.members(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_keys_only()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(8),
            ),
        ));
    }
    let skip = ops.len();
    ops.extend(join_read::ops(&keys));
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then(ops)
        .or_else([TxnOp::get(key.as_str(), None)]);
    let (revision, read) = loop {
        let resp = match tokio::time::timeout(cfg.request_timeout, client.txn(txn.clone())).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                patience.wait(&host, "register", &e.to_string()).await;
                continue;
            }
            Err(_) => {
                patience.wait(&host, "register", "no answer").await;
                continue;
            }
        };
        if resp.succeeded() {
            let revision = resp.header().map_or(0, |h| h.revision());
            break (
                revision,
                JoinRead::parse(resp.op_responses(), skip).expect("the joining read"),
            );
        }
        // An earlier attempt whose answer was lost wrote the key (under
        // this lease, as the coordinator checks): read the job alone.
        let mine = resp.op_responses().into_iter().any(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().is_some_and(|kv| kv.lease() == lease),
            _ => false,
        });
        assert!(mine, "{host}: the host id is free");
        let reads = Txn::new().and_then(join_read::ops(&keys));
        match tokio::time::timeout(cfg.request_timeout, client.txn(reads)).await {
            Ok(Ok(r)) => {
                let revision = r.header().map_or(0, |h| h.revision());
                break (
                    revision,
                    JoinRead::parse(r.op_responses(), 0).expect("the joining read"),
                );
            }
            Ok(Err(e)) => patience.wait(&host, "read the job", &e.to_string()).await,
            Err(_) => patience.wait(&host, "read the job", "no answer").await,
        }
    };
    let seen = joining_read(&mut client, &keys, decides, &read, revision).await;
    let epoch = Arc::new(AtomicU64::new(seen));
    moved.send_modify(|g| *g += 1);
    // With several members the keep-alive and the watch each have a client
    // of their own to one member (below), and the joining client, over
    // every member, is not used again: it is closed, so a light host holds
    // 2 connections, not 5 (4,096 hosts on 3 members passed the bench
    // process's 20,000 descriptors, which the sandbox will not raise). A
    // launcher keeps it for its decisions; what that leaves out of etcd's
    // load is 3 idle connections' HTTP/2 pings a host.
    let shared = (endpoints.len() == 1).then_some(client);
    let keeper = tokio::spawn(keep_alive(
        shared.clone(),
        endpoints.clone(),
        i,
        Renewal {
            lease,
            kept: Arc::clone(&kept),
        },
        cfg.ttl,
        cfg.request_timeout,
        leases_lost,
    ));
    let watcher = tokio::spawn(follow(
        Route {
            shared,
            order: warden_launcher::coord::member_order(&endpoints, &FleetConfig::host(i)),
            endpoints: endpoints.clone(),
            at: 0,
            ttl: cfg.ttl,
            request_timeout: cfg.request_timeout,
        },
        keys,
        revision,
        Arc::clone(&epoch),
        moved,
        decides,
        cfg.sorted_join,
    ));
    Light {
        host,
        spare,
        epoch,
        kept,
        tasks: vec![keeper, watcher],
    }
}

/// The rest of what a joining launcher that does not decide rounds reads
/// of the job (as `Coordinator::join` does past the first 8 hosts by join,
/// issue 30), after the register txn's reads ([`join_read`]: the epoch,
/// the first hosts by join, a page of departures and of layout chunks, the
/// newest round): the departures and layout chunks past that page, in
/// pages of 256 keys at the txn's revision. No member record, unless
/// `decides` (the baseline: every member in pages too). Returns the epoch.
async fn joining_read(
    client: &mut Client,
    keys: &Keys,
    decides: bool,
    read: &JoinRead,
    revision: i64,
) -> u64 {
    let mut ranges = vec![
        (keys.departures(), join_read::after(&read.departures)),
        (keys.layouts(), join_read::after(&read.layouts)),
    ];
    if decides {
        ranges.push((keys.members(), Some(keys.members().into_bytes())));
    }
    for (prefix, from) in ranges {
        let Some(mut from) = from else { continue };
        let mut end = prefix.clone().into_bytes();
        let last = end.pop().expect("a prefix");
        end.push(last + 1);
        loop {
            let page = client
                .get(
                    from.clone(),
                    Some(
                        GetOptions::new()
                            .with_range(end.clone())
                            .with_limit(256)
                            .with_revision(revision),
                    ),
                )
                .await
                .expect("a page of the joining read");
            match page.kvs().last() {
                Some(kv) if page.more() => {
                    from = kv.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
    }
    read.epoch_value()
}

/// Where a light host's watch goes: as the coordinator's
/// (`session::drive`), with several endpoints one member at a time, each
/// through a client of its own, in the host's order of them
/// (`coord::member_order`), the `at`th of it (mod their number); with one,
/// the host's client.
struct Route {
    /// The host's client, with one endpoint (None with several).
    shared: Option<Client>,
    endpoints: Vec<String>,
    order: Vec<usize>,
    at: usize,
    ttl: Duration,
    request_timeout: Duration,
}

impl Route {
    fn can_move(&self) -> bool {
        self.endpoints.len() > 1
    }

    /// A sixth of the TTL, at most the request deadline (the keeper's
    /// `lease_route::answer_deadline`).
    fn deadline(&self) -> Duration {
        (self.ttl / 6)
            .min(self.request_timeout)
            .max(Duration::from_millis(100))
    }

    fn move_on(&mut self) {
        self.at += 1;
    }

    async fn client(&self) -> Option<Client> {
        if let Some(shared) = &self.shared {
            return Some(shared.clone());
        }
        let endpoint = &self.endpoints[self.order[self.at % self.order.len()]];
        let options = connect_options()
            .with_connect_timeout(self.deadline())
            .with_keep_alive(self.ttl / 3, self.deadline());
        let connect = Client::connect([endpoint.as_str()], Some(options));
        tokio::time::timeout(self.deadline(), connect)
            .await
            .ok()?
            .ok()
    }
}

/// What a launcher that does not decide watches, from `revision + 1` (as
/// `session::open_watch`): the departures, end markers, layout bases,
/// deciders' markers and round records (no member key), each its own
/// watch on one stream; a round record moves `epoch`. `decides` (the baseline): one
/// watch of the whole prefix, member keys' puts included, and the epoch
/// key's puts move `epoch`. A watch that ends (its member killed, or
/// dropped by its HTTP/2 keep-alive), or, with several endpoints, leaves a
/// progress request unanswered after a sixth of the TTL of silence (its
/// member paused), is opened again on the next endpoint from the last
/// revision seen of each prefix, as the coordinator's.
async fn follow(
    mut route: Route,
    keys: Keys,
    revision: i64,
    epoch: Arc<AtomicU64>,
    moved: Arc<watch::Sender<u64>>,
    decides: bool,
    sorted_join: bool,
) {
    let epoch_key = keys.epoch();
    let rounds = keys.rounds();
    let prefixes = [
        keys.departures(),
        keys.ends(),
        keys.layouts(),
        if sorted_join {
            keys.members()
        } else {
            keys.deciders()
        },
        rounds.clone(),
    ];
    let deadline = route.deadline();
    let open_limit = if route.can_move() {
        deadline
    } else {
        Duration::from_secs(60)
    };
    // How far each prefix was seen (the last: any other key).
    let mut seen = [revision; 6];
    'watch: loop {
        let Some(mut client) = route.client().await else {
            route.move_on();
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let mut stream = None;
        for (i, prefix) in prefixes.iter().enumerate() {
            if decides && i > 0 {
                break;
            }
            let (key, options) = if decides {
                let from = seen.iter().copied().max().unwrap_or(0) + 1;
                (
                    keys.base().to_owned(),
                    WatchOptions::new().with_prefix().with_start_revision(from),
                )
            } else {
                let mut o = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(seen[i] + 1);
                if *prefix == keys.members() {
                    o = o.with_filters([WatchFilterType::NoPut]);
                }
                if *prefix == keys.rounds() {
                    // As the coordinator: no deletion of an old round.
                    o = o.with_filters([WatchFilterType::NoDelete]);
                }
                (prefix.clone(), o)
            };
            let opened = tokio::time::timeout(open_limit, async {
                match &mut stream {
                    None => client
                        .watch(key, Some(options))
                        .await
                        .map(|s| stream = Some(s)),
                    Some(s) => s.watch(key, Some(options)).await,
                }
            })
            .await;
            if !matches!(opened, Ok(Ok(()))) {
                route.move_on();
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue 'watch;
            }
        }
        let Some(mut stream) = stream else { continue };
        let mut asked = false;
        loop {
            let message = if route.can_move() {
                match tokio::time::timeout(deadline, stream.message()).await {
                    Ok(m) => m,
                    // Silent for the deadline: ask for progress; silent
                    // for another, the member is left.
                    Err(_) if !asked && stream.request_progress().await.is_ok() => {
                        asked = true;
                        continue;
                    }
                    Err(_) => break,
                }
            } else {
                stream.message().await
            };
            asked = false;
            let Ok(Some(resp)) = message else { break };
            if resp.canceled() && resp.compact_revision() > 0 {
                // Compacted past what it saw: a launcher reloads; the bench
                // never compacts, so this is a broken set-up.
                panic!(
                    "a light host's watch was compacted at {}",
                    resp.compact_revision()
                );
            }
            for e in resp.events() {
                let Some(kv) = e.kv() else { continue };
                let range = prefixes
                    .iter()
                    .position(|p| kv.key().starts_with(p.as_bytes()))
                    .unwrap_or(5);
                seen[range] = seen[range].max(kv.mod_revision());
                if e.event_type() != EventType::Put {
                    continue;
                }
                let moved_to = if decides {
                    (kv.key() == epoch_key.as_bytes())
                        .then(|| kv.value_str().ok()?.parse::<u64>().ok())
                        .flatten()
                } else {
                    kv.key()
                        .strip_prefix(rounds.as_bytes())
                        .and_then(|e| std::str::from_utf8(e).ok()?.parse::<u64>().ok())
                };
                if let Some(n) = moved_to
                    && n > epoch.load(Ordering::Acquire)
                {
                    epoch.store(n, Ordering::Release);
                    moved.send_modify(|g| *g += 1);
                }
            }
        }
        // The stream ended or its member went silent: the next endpoint.
        route.move_on();
    }
}

/// A lease kept alive every third of the TTL, as the coordinator does
/// (launcher/src/coord/lease_route.rs): a stream that breaks, or a
/// keep-alive unanswered until a third of the TTL is left on the lease (at
/// least a sixth of the TTL, at most `request_timeout`), is opened again on
/// the next endpoint, each through a
/// client of its own to that endpoint, starting at endpoint `i` mod their
/// number (one endpoint: the host's client, as the coordinator); only
/// etcd saying the lease is gone ends it.
async fn keep_alive(
    shared: Option<Client>,
    endpoints: Vec<String>,
    i: usize,
    renewal: Renewal,
    ttl: Duration,
    request_timeout: Duration,
    leases_lost: Arc<AtomicU64>,
) {
    let Renewal { lease, kept } = renewal;
    let deadline = (ttl / 6)
        .min(request_timeout)
        .max(Duration::from_millis(100));
    // `WARDEN_FLEET_KEEPALIVE_WAIT_S` (an experiment): a fixed wait for a
    // keep-alive's answer before the host moves to the next member, in
    // place of the coordinator's rule (`lease_route::keep_alive_wait`:
    // until a third of the TTL is left on the lease, at least `deadline`,
    // at most the request deadline), mirrored here.
    let fixed = std::env::var("WARDEN_FLEET_KEEPALIVE_WAIT_S")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map(Duration::from_secs_f64);
    // With one endpoint (the shared client) a sixth of the TTL, as the
    // coordinator's route (`LeaseRoute::answer_wait`).
    let single = shared.is_some();
    let ttl_ns = u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX);
    // The lease's end by the last renewal's stamp.
    let lease_end = || kept.load(Ordering::Acquire).saturating_add(ttl_ns);
    let wait_for = |sent: u64| {
        fixed.unwrap_or_else(|| {
            if single {
                return deadline;
            }
            Duration::from_nanos(lease_end().saturating_sub(sent))
                .saturating_sub(ttl / 3)
                .min(request_timeout)
                .max(deadline)
        })
    };
    // `WARDEN_FLEET_KEEPALIVE_STAY=1` (an experiment, light hosts only;
    // issue 30: a leader kill at 4,096 hosts on 3 members moved streams
    // 29,797 times, 18,255 of them a new stream's first keep-alive left
    // unanswered on a live member, 7,758 a connection refused by the dead
    // one): a member that refused the connection is skipped for a TTL; a
    // new stream's first keep-alive is waited for until a sixth of the TTL
    // is left on the lease (the host commits to the member it moved to);
    // and the pause after a failed move doubles from 200 ms to a sixth of
    // the TTL, spread, until an answer comes.
    let stay = std::env::var("WARDEN_FLEET_KEEPALIVE_STAY").is_ok_and(|v| v == "1");
    let open_wait = |sent: u64| {
        if !stay || single {
            return wait_for(sent);
        }
        Duration::from_nanos(lease_end().saturating_sub(sent))
            .saturating_sub(ttl / 6)
            .min(request_timeout)
            .max(deadline)
    };
    let mut down_until = vec![0u64; endpoints.len().max(1)];
    let mut pause = Duration::from_millis(200);
    let after_failure = |pause: &mut Duration| {
        let now = *pause;
        if stay {
            let spread = u64::try_from(i).unwrap_or(0).wrapping_mul(2_654_435_761) % 1000;
            *pause = (*pause * 2).min(deadline);
            return now - now.mul_f64(spread as f64 / 2000.0);
        }
        now
    };
    // The coordinator's order of the members for this host
    // (`coord::member_order`): spread at the start and on every move.
    let order = warden_launcher::coord::member_order(&endpoints, &FleetConfig::host(i));
    let mut pos = 0;
    let mut at = order.first().copied().unwrap_or(0);
    let mut next = || {
        pos = (pos + 1) % order.len().max(1);
        order.get(pos).copied().unwrap_or(0)
    };
    loop {
        if stay && down_until[at] > since_start() {
            at = next();
            if down_until.iter().all(|&d| d > since_start()) {
                down_until.fill(0);
            }
            continue;
        }
        let mut client = if let Some(shared) = &shared {
            shared.clone()
        } else {
            let options = connect_options()
                .with_connect_timeout(deadline)
                .with_keep_alive(ttl / 3, deadline);
            let connect = Client::connect([endpoints[at].as_str()], Some(options));
            match tokio::time::timeout(deadline, connect).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    broken("connect", &e.to_string());
                    down_until[at] = since_start().saturating_add(ttl_ns);
                    at = next();
                    tokio::time::sleep(after_failure(&mut pause)).await;
                    continue;
                }
                Err(_) => {
                    broken("connect", "no connection within the deadline");
                    at = next();
                    tokio::time::sleep(after_failure(&mut pause)).await;
                    continue;
                }
            }
        };
        let sent = since_start();
        let opened = tokio::time::timeout(open_wait(sent), client.lease_keep_alive(lease)).await;
        let (mut keeper, mut stream) = match opened {
            // Opening sends one keep-alive and checks its answer.
            Ok(Ok(pair)) => {
                kept.store(sent, Ordering::Release);
                pause = Duration::from_millis(200);
                pair
            }
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(msg))) if msg.contains("not found") => {
                lost(&leases_lost);
                return;
            }
            Ok(Err(e)) => {
                let why = e.to_string();
                broken("open", &why);
                // The lazy connection's refusal comes with the open.
                if why.contains("tcp connect error") {
                    down_until[at] = since_start().saturating_add(ttl_ns);
                }
                at = next();
                tokio::time::sleep(after_failure(&mut pause)).await;
                continue;
            }
            Err(_) => {
                broken("open", "the first keep-alive went unanswered");
                at = next();
                tokio::time::sleep(after_failure(&mut pause)).await;
                continue;
            }
        };
        loop {
            tokio::time::sleep(ttl / 3).await;
            // Stamped when sent: etcd renews the lease after this, so the
            // lease's end taken from it is never later than the real one.
            let sent = since_start();
            let answer = tokio::time::timeout(wait_for(sent), async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            match answer {
                Ok(Ok(Some(r))) if r.ttl() > 0 => kept.store(sent, Ordering::Release),
                // etcd says the lease is gone. A light host does not rejoin
                // (a launcher would): its member key is gone, and the fleet
                // has one host fewer. Counted, so a fleet that cannot form
                // its round says why.
                Ok(Ok(Some(_))) => {
                    lost(&leases_lost);
                    return;
                }
                // The stream broke or went unanswered: a new one, on the
                // next endpoint.
                Ok(Ok(None)) => {
                    broken("keep-alive", "the stream ended");
                    at = next();
                    break;
                }
                Ok(Err(e)) => {
                    broken("keep-alive", &e.to_string());
                    at = next();
                    break;
                }
                Err(_) => {
                    KEEPALIVE_LATE.fetch_add(1, Ordering::Relaxed);
                    at = next();
                    break;
                }
            }
        }
    }
}

/// A light host's lease and where its keep-alive stamps each renewal.
struct Renewal {
    lease: i64,
    kept: Arc<AtomicU64>,
}

/// Counts a light host's lease lost.
fn lost(leases_lost: &AtomicU64) {
    leases_lost.fetch_add(1, Ordering::Relaxed);
}

/// Whether every host kept its lease through what was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCheck {
    /// Light hosts whose lease etcd let expire.
    pub light_lost: u64,
    /// Full hosts that found their lease gone (rejoined or failed).
    pub full_lost: usize,
    /// Member keys in etcd now.
    pub member_keys: usize,
    /// Hosts in the fleet now.
    pub hosts: usize,
}

impl LeaseCheck {
    /// Every host kept its lease, and etcd holds every host's member key.
    pub fn all_kept(&self) -> bool {
        self.light_lost == 0 && self.full_lost == 0 && self.member_keys == self.hosts
    }
}

/// etcd's own counters, from its `/metrics` page.
#[derive(Debug, Clone, Copy, Default)]
pub struct EtcdMetrics {
    /// Bytes etcd sent to clients (gRPC).
    pub sent: f64,
    /// Bytes it received from them.
    pub received: f64,
    /// Its CPU time, seconds.
    pub cpu: f64,
    /// Its resident memory, bytes.
    pub rss: f64,
}

impl EtcdMetrics {
    /// The sum over a cluster's members' endpoints: what the cluster
    /// costs.
    pub fn read_all(endpoints: &[String]) -> Self {
        endpoints
            .iter()
            .map(|e| Self::read(e))
            .fold(Self::default(), |a, b| Self {
                sent: a.sent + b.sent,
                received: a.received + b.received,
                cpu: a.cpu + b.cpu,
                rss: a.rss + b.rss,
            })
    }

    /// Reads `/metrics` at the plain-HTTP `endpoint` (`http://HOST:PORT`).
    pub fn read(endpoint: &str) -> Self {
        let hostport = endpoint
            .strip_prefix("http://")
            .expect("a plain-HTTP endpoint");
        let mut s = TcpStream::connect(hostport).expect("connect to etcd's metrics");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {hostport}\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).expect("read etcd's metrics");
        let value = |name: &str| -> f64 {
            body.lines()
                .find_map(|l| {
                    let rest = l.strip_prefix(name)?;
                    rest.strip_prefix(' ')?.trim().parse::<f64>().ok()
                })
                .unwrap_or_else(|| panic!("etcd's metrics have no {name}"))
        };
        Self {
            sent: value("etcd_network_client_grpc_sent_bytes_total"),
            received: value("etcd_network_client_grpc_received_bytes_total"),
            cpu: value("process_cpu_seconds_total"),
            rss: value("process_resident_memory_bytes"),
        }
    }
}

/// The `q` quantile of `d`, seconds (0 for none).
pub fn quantile(d: &[Duration], q: f64) -> f64 {
    let mut d = d.to_vec();
    d.sort();
    if d.is_empty() {
        return 0.0;
    }
    d[((d.len() - 1) as f64 * q).round() as usize].as_secs_f64()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// What the fleet's memory figures read: a probe a program installed
/// ([`set_memory_probe`]: the bench's live heap bytes), else this process's
/// resident memory.
///
/// Why a probe: one process hosts every simulated host, and its resident
/// memory moves by whole allocator arenas, not by what a host holds (the
/// bench read 0 B and 1 KB a full host at 256 and 1,024 hosts). A count of
/// the live heap bytes sees each host's own.
pub fn memory_now() -> u64 {
    MEMORY_PROBE.get().map_or_else(rss_self, |probe| probe())
}

static MEMORY_PROBE: std::sync::OnceLock<fn() -> u64> = std::sync::OnceLock::new();

/// Installs the probe [`memory_now`] reads (once; later calls are ignored).
#[allow(dead_code)] // the bench's; the test reads resident memory
pub fn set_memory_probe(probe: fn() -> u64) {
    let _ = MEMORY_PROBE.set(probe);
}

/// This process's resident memory, bytes.
pub fn rss_self() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// This process's CPU time (every thread, user + system), seconds, to the
/// nanosecond (`/proc`'s ticks are 10 ms, coarser than a small round).
pub fn cpu_self() -> f64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map_or(0.0, |t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
}
