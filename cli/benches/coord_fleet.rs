//! Issue 30's scale measurements: a fleet of N simulated hosts of one job on
//! a real etcd (tests/common/etcd.rs; etcd 3.4, fsync on), through
//! tests/common/fleet.rs: a few hosts run the real `Coordinator`, the rest
//! are light hosts that still do a launcher's share of etcd work (their own
//! connection, lease and keep-alive, member key, joining read and watch).
//!
//! Two etcd set-ups, a fresh one for each N: a single member (as every
//! earlier row), and a 3-member cluster on 127.0.0.2-4 (each member its own
//! address, ports and data; etcd's default 100 ms heartbeat and 1 s
//! election timeout).
//!
//! For each N: joining every host until all hold the first round; restart
//! rounds (`request_restart` on one full host until every host holds the
//! new round); a light host lost without a word (its lease expires after
//! the TTL; the others hold the round without it) and a new host joining
//! in its place; two spare swaps (a spare standing by while a host is lost
//! without a word, then while a full host is cordoned: until every host
//! holds the round with the spare in it); etcd's bytes sent and received
//! and CPU per restart round (every member's `/metrics`); this process's
//! CPU per round (all the hosts' client side); memory per host (the live
//! heap bytes of this process, counted by its allocator: light hosts as
//! they join, full hosts as 8 more join the full fleet) and etcd's
//! resident memory. On the cluster, two faults during restart
//! rounds: the leader (found through each member's
//! `etcd_server_is_leader`) SIGKILLed half a round into a run of rounds,
//! then started again; and a follower SIGSTOPped for the lease TTL plus
//! 2 s, then SIGCONTed; for each, the rounds' times and whether every host
//! kept its lease.
//!
//! Out: markdown tables and each series' growth exponent (least squares on
//! log-log, `warden_planner::fleet`) with the 12,500-host extrapolation,
//! printed as each row completes; the results as JSON (`WARDEN_FLEET_OUT`,
//! rows of the same set-up and N replaced, others kept) and the plot
//! (`WARDEN_FLEET_SVG`). `WARDEN_FLEET_FROM=results.json` prints the tables
//! and writes the plot from a results file without running anything.
//!
//! Run (docs/benchmarks.md, "Fleet"): `cargo bench -p warden-cli --bench
//! coord_fleet`. `WARDEN_FLEET_HOSTS=16,256,1024,2048` (the Ns),
//! `WARDEN_FLEET_MEMBERS=1,3` (etcd set-ups), `WARDEN_FLEET_FULL=8` (full
//! hosts per N), `WARDEN_FLEET_ROUNDS=10` (restart rounds per N),
//! `WARDEN_FLEET_LOSSES=1` (light hosts lost one after another, each
//! printed from its drop and from its lease's end; the row keeps the
//! first), `WARDEN_FLEET_TTL_S=10`, `WARDEN_FLEET_REQUEST_TIMEOUT_S=5`.
//! The etcd binary is `$WARDEN_TEST_ETCD` (else `etcd` on PATH: Debian's
//! 3.4); each row records its version, and a row on another line than 3.4
//! is a set-up of its own (its own table and fits; not in the plot or the
//! planner).
//! `WARDEN_FLEET_KEEPALIVE_WAIT_S` (unset: the coordinator's rule, until a
//! third of the TTL is left): how long a light host waits for a
//! keep-alive's answer before it moves to the next member (an
//! experiment). `WARDEN_FLEET_KEEPALIVE_STAY=1` (an experiment): a member
//! that refused the connection is skipped for a TTL, a new stream's first
//! answer is waited for until a sixth of the TTL is left, and failed moves
//! back off. Each fault prints why the light hosts' streams moved.
//! `WARDEN_FLEET_EVERY_HOST_DECIDES=1`: the baseline of the join (light
//! hosts read and watch every member key, as every launcher did before
//! only the first 8 by join decided rounds); write it to its own
//! `WARDEN_FLEET_OUT`. `WARDEN_FLEET_PROXIES=P` (default 0): P etcd gRPC
//! proxies (`etcd grpc-proxy start`, 127.0.0.20 up) between the hosts and
//! the members, host i through proxy i mod P; the row records the proxies'
//! CPU and memory beside etcd's and is a set-up of its own (the fits, the
//! plot and the planner leave it out). `WARDEN_FLEET_SORTED_JOIN=1`: the baseline of the
//! deciders' markers (light hosts read the first 8 by join in a sorted
//! range and watch the member keys' deletions, as before); its own
//! `WARDEN_FLEET_OUT` too.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../../tests/common/etcd.rs"]
mod etcd;
#[path = "../../tests/common/fleet.rs"]
mod fleet;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd::{EtcdCluster, EtcdProxy, EtcdServer};
use fleet::{EtcdMetrics, Fleet, FleetConfig, cpu_self};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use warden_planner::fleet::{FleetResults, FleetRow, markdown, svg};

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}: {s:?} is no number"))
        })
        .collect()
}

fn env_one(name: &str, default: usize) -> usize {
    env_list(name, &default.to_string())[0]
}

/// What the bench runs.
#[derive(Debug, Clone)]
struct Settings {
    full: usize,
    rounds: usize,
    /// Light hosts lost in a row (the row keeps the first).
    losses: usize,
    ttl: Duration,
    request_timeout: Duration,
    commit: String,
    /// The baseline: light hosts read and watch every member key.
    every_host_decides: bool,
    sorted_join: bool,
    /// etcd gRPC proxies between the hosts and the members.
    proxies: usize,
}

/// Either etcd set-up.
#[derive(Debug)]
enum Etcd {
    Single(EtcdServer),
    Cluster(EtcdCluster),
}

impl Etcd {
    fn start(members: usize) -> Self {
        if members == 1 {
            Self::Single(EtcdServer::start())
        } else {
            Self::Cluster(EtcdCluster::start(members))
        }
    }

    fn endpoints(&self) -> Vec<String> {
        match self {
            Self::Single(s) => s.endpoints(),
            Self::Cluster(c) => c.endpoints(),
        }
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

use fleet::quantile;

/// The 1-minute load average.
fn load() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

async fn run(n: usize, members: usize, s: &Settings) -> FleetRow {
    let mut etcd = Etcd::start(members);
    let endpoints = etcd.endpoints();
    eprintln!("fleet: etcd at {}", endpoints.join(","));
    let full = s.full.min(n);
    let proxies: Vec<EtcdProxy> = (0..s.proxies)
        .map(|k| {
            let ip =
                std::net::Ipv4Addr::new(127, 0, 0, 20 + u8::try_from(k).expect("a few proxies"));
            EtcdProxy::start(&endpoints, ip)
        })
        .collect();
    let proxy_usage = || {
        proxies
            .iter()
            .map(EtcdProxy::cpu_and_rss)
            .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
    };
    let mut cfg = FleetConfig::new(endpoints.clone(), "fleet", n, full);
    cfg.proxies = proxies.iter().map(|p| p.endpoint.clone()).collect();
    if !proxies.is_empty() {
        eprintln!(
            "fleet: through etcd gRPC proxies at {}",
            cfg.proxies.join(",")
        );
    }
    cfg.ttl = s.ttl;
    cfg.request_timeout = s.request_timeout;
    cfg.every_host_decides = s.every_host_decides;
    cfg.sorted_join = s.sorted_join;
    let (mut fleet, joined) = Fleet::join(cfg).await;
    eprintln!(
        "fleet: {n} hosts, {members}-member etcd: joined in {:?}: {}; light hosts' join requests asked again: {}",
        joined.all,
        joined.phases,
        fleet::JOIN_RETRIES.swap(0, std::sync::atomic::Ordering::Relaxed)
    );
    let (bases, base_bytes) = {
        let mut c = etcd_client::Client::connect(endpoints.clone(), None)
            .await
            .expect("connect to etcd");
        etcd::bases_in_history(&mut c, &fleet.layouts()).await
    };
    eprintln!(
        "fleet: layout bases written by the join: {} ({:.2} MB in all): {bases:?}",
        bases.len(),
        base_bytes as f64 / 1e6
    );
    // One round untimed: every connection warm. Asked again while etcd
    // does not answer, as a launcher asks again at its next plan: at
    // 12,500 hosts on 2 cores, etcd has stalled for seconds after the
    // join's base fan-out, and the bench used to end there.
    let (warm, refused) = fleet.restart_through_faults().await;
    if refused > 0 {
        eprintln!(
            "fleet: the first restart after the join was refused {refused} time(s) (etcd stalled) and taken after {warm:?}"
        );
    }
    let before = EtcdMetrics::read_all(&endpoints);
    let proxy0 = proxy_usage();
    let cpu0 = cpu_self();
    let rounds_began = std::time::Instant::now();
    let mut times = Vec::new();
    for _ in 0..s.rounds {
        times.push(fleet.restart().await);
    }
    let rounds_wall = rounds_began.elapsed();
    let after = EtcdMetrics::read_all(&endpoints);
    let proxy1 = proxy_usage();
    let cpu1 = cpu_self();
    // etcd's CPU with no round at all (over as long as the rounds took,
    // 2 s at least: etcd's CPU clock ticks in 10 ms): the keep-alives of
    // every host and etcd's own timers, which a round's CPU above
    // includes for as long as the round lasts.
    let idle_began = std::time::Instant::now();
    tokio::time::sleep(rounds_wall.max(std::time::Duration::from_secs(2))).await;
    let idle = EtcdMetrics::read_all(&endpoints);
    let idle_cpu_rate = (idle.cpu - after.cpu) / idle_began.elapsed().as_secs_f64();
    let idle_per_round = idle_cpu_rate * rounds_wall.as_secs_f64() / s.rounds as f64;
    eprintln!(
        "fleet: {} rounds to epoch {}, median {:.1} ms; etcd sent {:.2} MB and CPU {:.0} ms per round, of it {:.0} ms at the idle rate ({:.0} ms/s over {rounds_wall:?} without rounds)",
        s.rounds,
        fleet.epoch,
        quantile(&times, 0.5) * 1e3,
        (after.sent - before.sent) / s.rounds as f64 / 1e6,
        (after.cpu - before.cpu) / s.rounds as f64 * 1e3,
        idle_per_round * 1e3,
        idle_cpu_rate * 1e3
    );
    let record = fleet.round_bytes().await;
    // The first loss is the row's; more (`WARDEN_FLEET_LOSSES`) show the
    // spread, which the keep-alive's phase and etcd's sweep make wide.
    let mut losses = Vec::new();
    for _ in 0..s.losses {
        let loss = fleet.lose_one().await;
        eprintln!(
            "fleet: lost host out after {:?} ({:+.0} ms beyond the TTL, {:+.0} ms beyond its lease's end), replaced in {:?}",
            loss.out,
            (seconds(loss.out) - seconds(s.ttl)) * 1e3,
            loss.beyond_lease_s * 1e3,
            loss.replaced
        );
        losses.push(loss);
    }
    if losses.len() > 1 {
        let beyond_ttl: Vec<f64> = losses
            .iter()
            .map(|l| (seconds(l.out) - seconds(s.ttl)) * 1e3)
            .collect();
        let beyond_lease: Vec<f64> = losses.iter().map(|l| l.beyond_lease_s * 1e3).collect();
        let span = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            format!(
                "{:+.0} to {:+.0} ms, median {:+.0} ms",
                v[0],
                v[v.len() - 1],
                v[(v.len() - 1) / 2]
            )
        };
        eprintln!(
            "fleet: {} lost hosts: beyond the TTL {}; beyond the lease's end {}",
            losses.len(),
            span(&beyond_ttl),
            span(&beyond_lease)
        );
    }
    let (lost, replaced) = (losses[0].out, losses[0].replaced);
    fleet.add_spare().await;
    let swap_lost = fleet.swap_lost().await;
    let swap_cordon = if fleet.hosts() > 2 && full >= 2 {
        fleet.add_spare().await;
        fleet.swap_cordoned().await
    } else {
        Duration::ZERO
    };
    eprintln!("fleet: spare swaps: lost {swap_lost:?}, cordon {swap_cordon:?}");
    let (leader_kill, member_pause) = match &mut etcd {
        Etcd::Single(_) => (None, None),
        Etcd::Cluster(cluster) => {
            let half_round = Duration::from_secs_f64(quantile(&times, 0.5) / 2.0);
            let leader = cluster.leader(Duration::from_secs(30));
            let pid = cluster.members[leader].pid();
            let kill_fault = async move {
                tokio::time::sleep(half_round).await;
                kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the etcd leader");
                (Instant::now(), Duration::ZERO)
            };
            let killed = fleet
                .rounds_through(kill_fault, 5, s.ttl + Duration::from_secs(2))
                .await;
            eprintln!("fleet: leader {leader} killed: {killed:?}");
            let killed_leader = leader;
            cluster.members[leader].kill();
            cluster.restart(leader);
            fleet.restart_through_faults().await;
            let leader = cluster.leader(Duration::from_secs(30));
            // A follower that was not the killed leader: hosts left that
            // one for the others and none went back to it once it was
            // restarted, so pausing it tested nothing (0 keep-alives moved
            // in two runs).
            let n = cluster.members.len();
            let follower = (1..n)
                .map(|k| (leader + k) % n)
                .find(|&m| m != killed_leader)
                .unwrap_or((leader + 1) % n);
            let pid = cluster.members[follower].pid();
            let pause = s.ttl + Duration::from_secs(2);
            let pause_fault = async move {
                tokio::time::sleep(half_round).await;
                kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("SIGSTOP an etcd follower");
                let at = Instant::now();
                tokio::time::sleep(pause).await;
                kill(Pid::from_raw(pid), Signal::SIGCONT).expect("SIGCONT the etcd follower");
                (at, at.elapsed())
            };
            // Rounds go on past the pause's end by a TTL: a lease that
            // could not be renewed during the pause has expired by then.
            let paused = fleet
                .rounds_through(pause_fault, 5, pause + s.ttl + Duration::from_secs(1))
                .await;
            eprintln!("fleet: follower {follower} paused: {paused:?}");
            (Some(killed), Some(paused))
        }
    };
    let per_full = fleet.full_host_memory(8).await;
    let r = s.rounds as f64;
    FleetRow {
        commit: s.commit.clone(),
        hosts: n as u64,
        full: full as u64,
        etcd_members: u32::try_from(members).unwrap(),
        ttl_s: seconds(s.ttl),
        load: load(),
        join_s: seconds(joined.all),
        round_median_s: quantile(&times, 0.5),
        round_p90_s: quantile(&times, 0.9),
        lost_s: seconds(lost),
        replaced_s: seconds(replaced),
        swap_lost_s: seconds(swap_lost),
        swap_cordon_s: seconds(swap_cordon),
        etcd_sent_per_round: (after.sent - before.sent) / r,
        etcd_received_per_round: (after.received - before.received) / r,
        etcd_cpu_per_round_s: (after.cpu - before.cpu) / r,
        etcd_idle_cpu_per_round_s: idle_per_round,
        fleet_cpu_per_round_s: (cpu1 - cpu0) / r,
        round_record_bytes: record as u64,
        rss_per_light: joined.rss_per_light,
        rss_per_full: per_full,
        memory: "heap".into(),
        etcd_rss: after.rss as u64,
        leader_kill,
        member_pause,
        proxies: u32::try_from(proxies.len()).unwrap(),
        proxy_cpu_per_round_s: (proxy1.0 - proxy0.0) / r,
        proxy_rss: proxy1.1 as u64,
        etcd_version: etcd::etcd_version(),
    }
}

/// The commit measured.
fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_owned(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        )
}

/// Prints the tables and writes the plot.
fn report(results: &FleetResults) {
    println!("{}", markdown(results));
    let _ = std::io::stdout().flush();
    if let Some(path) = std::env::var_os("WARDEN_FLEET_SVG") {
        std::fs::write(&path, svg(results)).expect("write the plot");
        eprintln!("fleet: plot written to {}", PathBuf::from(path).display());
    }
}

/// The system allocator, counting the bytes it holds live: the fleet's
/// memory per host ([`fleet::memory_now`]). Resident memory, which the
/// bench read before, moves by whole arenas in a process that hosts
/// thousands of hosts (0 B and 1 KB a full host at 256 and 1,024 hosts).
/// Hand-written: a dozen lines over `System`, for a benchmark only.
struct Counting;

static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is `System`'s own with the caller's arguments; the
// count is only a statistic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_heap_bytes() -> u64 {
    LIVE_BYTES.load(Ordering::Relaxed)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    fleet::set_memory_probe(live_heap_bytes);
    if let Some(from) = std::env::var_os("WARDEN_FLEET_FROM") {
        let text = std::fs::read_to_string(&from).expect("read the results file");
        let results = FleetResults::parse(&text).expect("the bench's results");
        report(&results);
        return;
    }
    let ns = env_list("WARDEN_FLEET_HOSTS", "16,256,1024,2048");
    let setups = env_list("WARDEN_FLEET_MEMBERS", "1,3");
    let settings = Settings {
        full: env_one("WARDEN_FLEET_FULL", 8),
        rounds: env_one("WARDEN_FLEET_ROUNDS", 10).max(1),
        losses: env_one("WARDEN_FLEET_LOSSES", 1).max(1),
        ttl: Duration::from_secs(env_one("WARDEN_FLEET_TTL_S", 10) as u64),
        request_timeout: Duration::from_secs(env_one("WARDEN_FLEET_REQUEST_TIMEOUT_S", 5) as u64),
        commit: commit(),
        every_host_decides: std::env::var_os("WARDEN_FLEET_EVERY_HOST_DECIDES").is_some(),
        sorted_join: std::env::var_os("WARDEN_FLEET_SORTED_JOIN").is_some(),
        proxies: env_one("WARDEN_FLEET_PROXIES", 0),
    };
    let out = std::env::var_os("WARDEN_FLEET_OUT").map_or_else(
        || std::env::temp_dir().join("warden-coord-fleet.json"),
        PathBuf::from,
    );
    // A file this binary cannot read (another version's fields) is never
    // overwritten with the new rows alone.
    let mut results = match std::fs::read_to_string(&out) {
        Ok(text) => FleetResults::parse(&text).unwrap_or_else(|e| {
            panic!(
                "{} does not read as fleet results ({e}): name another WARDEN_FLEET_OUT",
                out.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => FleetResults::default(),
        Err(e) => panic!("read {}: {e}", out.display()),
    };
    for members in setups {
        for &n in &ns {
            let row = run(n, members, &settings).await;
            results.rows.retain(|r| !r.same_setup(&row));
            results.rows.push(row);
            let json = serde_json::to_string_pretty(&results).unwrap();
            std::fs::write(&out, json + "\n").expect("write the results");
            eprintln!("fleet: results written to {}", out.display());
            report(&results);
        }
    }
}
