//! Issue 30: the job-wide exchange over the network. The `exchange_fleet`
//! bench runs the aggregator's code in one process without sockets; this
//! one runs real `wardend`s and real connections.
//!
//! What runs, per N (hosts of one job):
//! - a real `wardend` as the job's aggregator (index 0 of the order) on
//!   127.0.0.2, mutual TLS on `api.tcp`, handed the job's N hosts in node
//!   rank order with their names as a launcher hands them over from its
//!   etcd round (`SetCheckpointPeers`): the order the exchange routes by,
//!   and who may report for the job;
//! - in the tree set-up, a second real `wardend` as the leader of group 1
//!   (index k of the order, 127.0.0.4), which relays its members' reports
//!   to the aggregator over its own connection, as in a job;
//! - every other host simulated in this process: its own certificate (its
//!   name its identity), its own source address (127.1.x.y), its own TCP
//!   connection and TLS session, sending the real `ReportToAggregator`
//!   call with its report (8 ranks' sketches of 4 sections, their live
//!   positions, and their loss and gradient norm at 2 new steps and the
//!   last interval's 2) to the
//!   host its route names (`warden_core::detect::straggler::tree::route`). A
//!   simulated leader of the other groups sends its own report and its
//!   members' (marked relayed) on its one connection, as a leader's relay
//!   does; its own relay hop is the measured leader's.
//!
//! Set-ups per N: one aggregator; the tree with each relayed report passed
//! on alone (`straggler.relay_batch_window = 0`); and the tree with the
//! leaders' batches (`ReportBatchToAggregator`): the real leader's window
//! 100 ms, the simulated leaders' batches of each size in
//! `WARDEN_EXCHANGE_NET_BATCH` (default `0,8`; 0: a whole group).
//!
//! Every host reports at once (the burst a shared interval start would
//! make; real hosts spread over the 2 s interval), 10 intervals back to
//! back after one that opens the connections. Per N and set-up it
//! prints: the first interval (connections and TLS handshakes), the
//! median interval, each call's p50 and p99, the aggregator's and the
//! leader's CPU per interval (the sum of their threads' on-CPU time,
//! /proc/PID/task/*/schedstat), their resident memory once every
//! connection is up against before, this process's CPU per interval (the
//! simulated hosts' TLS and encoding: it shares the machine's cores with
//! the agents), and the connections at the aggregator. Every answer of
//! the last interval must count every reporting host (the job-wide
//! statistics cover the job) and carry the job-wide SDC statistics of
//! steps settled, or the bench fails.
//!
//! Run: `cargo bench -p warden-cli --bench exchange_net` (release);
//! `WARDEN_EXCHANGE_NET_HOSTS=16,256,1024,2048`,
//! `WARDEN_EXCHANGE_NET_BATCH=0,8`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
#[allow(dead_code)]
#[path = "../../tests/common/pki.rs"]
mod pki;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;
use tokio::task::JoinSet;
use tokio_rustls::rustls;
use tonic::transport::{Channel, Endpoint, Uri};
use warden_agent::peer_link::exchange::wire::report_pb;
use warden_core::detect::culprit::Position;
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::{JobValues, RankValues, StepValue};
use warden_core::detect::straggler::tree;
use warden_proto::v1 as pb;
use warden_proto::v1::peer_client::PeerClient;

use common::{Agent, RANKS_PER_HOST, cpu};

const INTERVALS: usize = 10;
const JOB: &str = "llm";
const AGGREGATOR: &str = "agg-000";
const LEADER: &str = "leader-001";

fn name(i: usize) -> String {
    format!("host-{i:05}")
}

/// Steps each rank reports values for per interval.
const STEPS_PER_INTERVAL: u64 = 2;

/// Host `i`'s report in interval `at` of a job of `world` ranks (its
/// ranks' global numbers from `ord`, its place among the hosts that
/// report), as its agent encodes it: its ranks' sketches, where they stand (live
/// positions, for the collector's hang verdict) and their loss and
/// gradient norm at the steps not judged yet (SDC).
fn report(i: usize, ord: u32, relayed: bool, at: u64, world: u32) -> pb::AggregateReport {
    let r = common::host_report(i as u32);
    // Global ranks by the host's place among those reporting.
    let ranks = || (0..RANKS_PER_HOST).map(|r| ord * RANKS_PER_HOST + r);
    // The steps of this interval, and those of the last one, which are not
    // judged here yet: an agent sends a step's values until an answer
    // brings the step's job-wide statistics, which is once every rank has
    // given it, so after the last host's report of that interval.
    let first = at.saturating_sub(1) * STEPS_PER_INTERVAL;
    let end = (at + 1) * STEPS_PER_INTERVAL;
    let positions = JobPositions {
        job: JOB.into(),
        world_size: world,
        hang: false,
        taken_at: SystemTime::now(),
        pending: false,
        ranks: ranks()
            .map(|rank| Position {
                host: name(i),
                rank,
                step: end,
                section: "forward".into(),
                stalled: false,
                stalled_ms: 0,
                process_state: String::new(),
                groups: Vec::new(),
            })
            .collect(),
    };
    let values = JobValues {
        job: JOB.into(),
        active: RANKS_PER_HOST,
        world,
        ranks: ranks()
            .map(|rank| RankValues {
                rank,
                generation: 1,
                steps: (first..end)
                    .map(|step| StepValue {
                        step,
                        values: [
                            Some(2.5 * common::jitter(u64::from(rank) << 32 | step)),
                            Some(1.0 * common::jitter(u64::from(rank) << 40 | step)),
                        ],
                        departs_own: [false, false],
                    })
                    .collect(),
            })
            .collect(),
    };
    let mut pbr = report_pb(&r, &[positions], &[values]);
    pbr.relayed = relayed;
    pbr
}

/// The address host `i` has in the job's order: the aggregator's and
/// the leader's real ones, the simulated hosts' listed only (the
/// aggregator and the leader never dial them; each simulated host calls
/// from its own source address, [`source`]).
fn listed(i: usize, k: usize, agg: &str, leader: Option<&str>) -> String {
    match (i, leader) {
        (0, _) => agg.to_owned(),
        (i, Some(l)) if i == k => l.to_owned(),
        (i, _) => format!("127.0.0.3:{}", 10_000 + i),
    }
}

/// Host `i`'s own source address: 127.1.x.y.
fn source(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// A channel from `src` to `dst` over TLS with `cfg`, expecting `server`.
fn channel(
    src: Ipv4Addr,
    dst: SocketAddr,
    server: &str,
    cfg: Arc<rustls::ClientConfig>,
) -> Channel {
    let server = server.to_owned();
    Endpoint::from_shared(format!("http://{dst}"))
        .unwrap()
        .timeout(Duration::from_secs(60))
        .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let (cfg, server) = (cfg.clone(), server.clone());
            async move {
                let sock = TcpSocket::new_v4()?;
                sock.bind(SocketAddr::new(src.into(), 0))?;
                let tcp = sock.connect(dst).await?;
                // As the agent's own connector: no Nagle delay on a call.
                tcp.set_nodelay(true)?;
                let name = rustls::pki_types::ServerName::try_from(server)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
                let s = tokio_rustls::TlsConnector::from(cfg)
                    .connect(name, tcp)
                    .await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
}

/// One connection of a simulated host and whose reports it sends on it
/// each interval: its own, and a simulated leader's members' (relayed).
struct Sender {
    client: PeerClient<Channel>,
    hosts: Vec<(usize, u32, bool)>,
    /// Members' reports per `ReportBatchToAggregator` (0: each alone).
    batch: usize,
}

/// The sum of `pid`'s threads' on-CPU time.
fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn start_agent(host: &str, tcp: &str, k: usize, window: &str) -> Agent {
    let node = pki::cluster().node(host);
    let dir = tempfile::Builder::new()
        .prefix("warden-exnet-")
        .tempdir()
        .unwrap();
    let ckpt = dir.path().join("ckpt");
    Agent::start(dir, |socket, state| {
        format!(
            "[agent]\nhost_name = \"{host}\"\nstate_dir = \"{}\"\n\
             [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
             [api]\nsocket = \"{}\"\ntcp = \"{tcp}\"\nmax_connections = 8192\n{}\
             [metrics]\nlisten = \"\"\n[log]\nlevel = \"warn\"\n\
             [nvml]\nenabled = false\n[kmsg]\nenabled = false\n[dcgm]\nenabled = false\n\
             [checkpoint]\ndir = \"{}\"\n\
             [straggler]\naggregator_fan_out = {k}\nrelay_batch_window = \"{window}\"\n",
            state.display(),
            socket.display(),
            node.api_keys(),
            ckpt.display(),
        )
    })
}

fn free(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Row {
    hosts: usize,
    setup: Setup,
    k: usize,
    connections: usize,
    first: Duration,
    interval: Duration,
    p50: Duration,
    p99: Duration,
    agg_cpu: Duration,
    leader_cpu: Option<Duration>,
    agg_rss_kb: i64,
    leader_rss_kb: Option<i64>,
    bench_cpu: Duration,
}

/// Sends every sender's reports of interval `at` at once; each call's
/// latency, and per answer the hosts its job-wide statistics cover and
/// the settled SDC steps it carries.
async fn interval(
    senders: &[Sender],
    at: u64,
    world: u32,
) -> (Duration, Vec<Duration>, Vec<(u32, usize)>) {
    let reports: Vec<Vec<pb::AggregateReport>> = senders
        .iter()
        .map(|s| {
            s.hosts
                .iter()
                .map(|&(i, ord, relayed)| report(i, ord, relayed, at, world))
                .collect()
        })
        .collect();
    let started = Instant::now();
    let mut set = JoinSet::new();
    // Per answer: the job-wide statistics' host count, and the job-wide
    // SDC statistics of steps settled (0: none came back).
    let seen = |a: &pb::AggregateAnswer| {
        (
            a.jobs.first().map_or(0, |j| j.hosts),
            a.values.first().map_or(0, |v| v.steps.len()),
        )
    };
    for (s, rs) in senders.iter().zip(reports) {
        let (alone, members): (Vec<_>, Vec<_>) = if s.batch == 0 {
            (rs, Vec::new())
        } else {
            rs.into_iter().partition(|r| !r.relayed)
        };
        for r in alone {
            let mut c = s.client.clone();
            set.spawn(async move {
                let t = Instant::now();
                let a = c
                    .report_to_aggregator(r)
                    .await
                    .unwrap_or_else(|e| panic!("ReportToAggregator: {e}"))
                    .into_inner();
                (t.elapsed(), vec![seen(&a)])
            });
        }
        for chunk in members.chunks(s.batch.max(1)) {
            let mut c = s.client.clone();
            let reports = chunk.to_vec();
            set.spawn(async move {
                let t = Instant::now();
                let answer = c
                    .report_batch_to_aggregator(pb::AggregateBatch {
                        reports,
                        shared_steps: true,
                    })
                    .await
                    .unwrap_or_else(|e| panic!("ReportBatchToAggregator: {e}"))
                    .into_inner();
                // Each item with its job's statistics and settled steps put
                // back from those the batch shares, as a leader hands it to
                // its member.
                let answers = answer
                    .items
                    .into_iter()
                    .map(|i| match i.outcome {
                        Some(pb::aggregate_batch_item::Outcome::Answer(mut a)) => {
                            a.jobs = i
                                .jobs
                                .iter()
                                .map(|&j| answer.jobs[j as usize].clone())
                                .collect();
                            for (job, refs) in a.values.iter_mut().zip(&i.values) {
                                job.steps = refs
                                    .steps
                                    .iter()
                                    .filter_map(|&k| answer.steps[k as usize].step.clone())
                                    .collect();
                            }
                            seen(&a)
                        }
                        other => panic!("a relayed report refused: {other:?}"),
                    })
                    .collect();
                (t.elapsed(), answers)
            });
        }
    }
    let mut lat = Vec::new();
    let mut hosts = Vec::new();
    while let Some(r) = set.join_next().await {
        let (l, h) = r.unwrap();
        lat.push(l);
        hosts.extend(h);
    }
    (started.elapsed(), lat, hosts)
}

fn self_cpu() -> Duration {
    cpu(std::process::id())
}

/// How the job's reports reach the aggregator.
#[derive(Debug, Clone, Copy)]
enum Setup {
    /// Every host reports to the aggregator itself.
    One,
    /// The two-level tree, each relayed report passed on alone
    /// (`straggler.relay_batch_window = 0`).
    Tree,
    /// The tree, a leader's members' reports passed on in batches
    /// (`ReportBatchToAggregator`): the real leader's window 100 ms (its
    /// members all report within it here), a simulated leader's batches of
    /// this many (0: its whole group; fewer stand for members spread over
    /// the interval, each window catching a few).
    Batched(usize),
}

impl std::fmt::Display for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Setup::One => write!(f, "one aggregator"),
            Setup::Tree => write!(f, "tree, each relayed alone"),
            Setup::Batched(0) => write!(f, "tree, batches of a group"),
            Setup::Batched(b) => write!(f, "tree, batches of {b}"),
        }
    }
}

async fn measure(n: usize, setup: Setup) -> Row {
    let use_tree = !matches!(setup, Setup::One);
    let (window, batch) = match setup {
        Setup::Batched(0) => ("100ms", usize::MAX),
        Setup::Batched(b) => ("100ms", b),
        _ => ("0s", 0),
    };
    let k = if use_tree { tree::fan_out(n, 0) } else { n };
    // The leader exists where the tree has a group 1.
    let with_leader = use_tree && n > k;
    let agg_addr = format!("127.0.0.2:{}", free("127.0.0.2"));
    let leader_addr = with_leader.then(|| format!("127.0.0.4:{}", free("127.0.0.4")));
    let order: Vec<(String, String)> = (0..n)
        .map(|i| {
            let who = match i {
                0 => AGGREGATOR.to_owned(),
                i if with_leader && i == k => LEADER.to_owned(),
                i => name(i),
            };
            (listed(i, k, &agg_addr, leader_addr.as_deref()), who)
        })
        .collect();
    let agg = start_agent(AGGREGATOR, &agg_addr, k, window);
    common::hand_over(&agg, JOB, &order).await;
    let leader = leader_addr
        .as_ref()
        .map(|a| start_agent(LEADER, a, k, window));
    if let Some(l) = &leader {
        common::hand_over(l, JOB, &order).await;
    }

    // Each simulated host's first hop, from the real routes.
    let ca = pki::cluster();
    let mut senders: Vec<Sender> = Vec::new();
    let mut relayed_by: std::collections::HashMap<usize, Vec<usize>> = Default::default();
    let mut reporting = 0u32;
    let mut ord: std::collections::HashMap<usize, u32> = Default::default();
    for i in 1..n {
        if with_leader && i == k {
            continue; // the real leader: it has no ranks of its own
        }
        ord.insert(i, reporting);
        reporting += 1;
        let first = tree::route(n, Some(i), k).next().unwrap();
        if first != 0 && !(with_leader && first == k) {
            // Through a simulated leader: on its connection.
            relayed_by.entry(first).or_default().push(i);
        }
    }
    for i in 1..n {
        if with_leader && i == k {
            continue;
        }
        let first = tree::route(n, Some(i), k).next().unwrap();
        let (dst, server) = match first {
            0 => (agg_addr.as_str(), AGGREGATOR),
            f if with_leader && f == k => (leader_addr.as_deref().unwrap(), LEADER),
            _ => continue, // a simulated leader's member: sent by its leader
        };
        let node = ca.node(&name(i));
        let cfg = Arc::new(ca.client_config(Some(&node)));
        let mut hosts = vec![(i, ord[&i], false)];
        for m in relayed_by.get(&i).into_iter().flatten() {
            hosts.push((*m, ord[m], true));
        }
        senders.push(Sender {
            client: PeerClient::new(channel(source(i), dst.parse().unwrap(), server, cfg)),
            hosts,
            batch,
        });
    }
    let agg_conns = (1..n)
        .filter(|i| !(with_leader && *i == k))
        .filter(|i| tree::route(n, Some(*i), k).next() == Some(0))
        .count()
        + usize::from(with_leader);

    let (agg_rss0, leader_rss0) = (
        rss_kb(agg.pid()) as i64,
        leader.as_ref().map(|l| rss_kb(l.pid()) as i64),
    );
    let world = reporting * RANKS_PER_HOST;
    let (first, _, _) = interval(&senders, 0, world).await;
    let (agg_rss1, leader_rss1) = (
        rss_kb(agg.pid()) as i64,
        leader.as_ref().map(|l| rss_kb(l.pid()) as i64),
    );
    let (agg0, leader0, bench0) = (
        cpu(agg.pid()),
        leader.as_ref().map(|l| cpu(l.pid())),
        self_cpu(),
    );
    let mut walls = Vec::new();
    let mut lat = Vec::new();
    let mut last = Vec::new();
    for at in 1..=INTERVALS as u64 {
        let (w, l, h) = interval(&senders, at, world).await;
        walls.push(w);
        lat.extend(l);
        last = h;
    }
    let agg_cpu = (cpu(agg.pid()) - agg0) / INTERVALS as u32;
    let leader_cpu = leader
        .as_ref()
        .zip(leader0)
        .map(|(l, c0)| (cpu(l.pid()) - c0) / INTERVALS as u32);
    let bench_cpu = (self_cpu() - bench0) / INTERVALS as u32;
    assert!(
        last.iter().all(|(h, _)| *h == reporting),
        "every answer counts all {reporting} reporting hosts: {:?}",
        last.iter()
            .filter(|(h, _)| *h != reporting)
            .take(5)
            .collect::<Vec<_>>()
    );
    assert!(
        last.iter().all(|(_, settled)| *settled > 0),
        "every answer of the last interval carries job-wide SDC statistics of settled steps"
    );
    walls.sort();
    lat.sort();
    let pick = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
    drop(senders);
    Row {
        hosts: n,
        setup,
        k,
        connections: agg_conns,
        first,
        interval: walls[walls.len() / 2],
        p50: pick(0.5),
        p99: pick(0.99),
        agg_cpu,
        leader_cpu,
        agg_rss_kb: agg_rss1 - agg_rss0,
        leader_rss_kb: leader_rss1.zip(leader_rss0).map(|(a, b)| a - b),
        bench_cpu,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    let hosts: Vec<usize> = std::env::var("WARDEN_EXCHANGE_NET_HOSTS")
        .unwrap_or_else(|_| "16,256,1024,2048".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    // WARDEN_EXCHANGE_NET_BATCH: the simulated leaders' batch sizes, each
    // a set-up (0: a whole group); empty: no batched set-up.
    let mut setups = vec![Setup::One, Setup::Tree];
    setups.extend(
        std::env::var("WARDEN_EXCHANGE_NET_BATCH")
            .unwrap_or_else(|_| "0,8".into())
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .map(Setup::Batched),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "| hosts | set-up (group size) | connections at the aggregator | first interval (connect + TLS) | interval, median | call p50 | call p99 | aggregator CPU per interval | leader CPU per interval | aggregator memory, connections up | leader memory | simulated hosts' CPU per interval (this process) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for n in hosts {
        for setup in setups.iter().copied() {
            let r = rt.block_on(measure(n, setup));
            println!(
                "| {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} KB | {} | {} |",
                r.hosts,
                r.setup,
                r.k,
                r.connections,
                ms(r.first),
                ms(r.interval),
                ms(r.p50),
                ms(r.p99),
                ms(r.agg_cpu),
                r.leader_cpu.map_or("-".into(), ms),
                r.agg_rss_kb,
                r.leader_rss_kb.map_or("-".into(), |kb| format!("{kb} KB")),
                ms(r.bench_cpu),
            );
        }
    }
}
