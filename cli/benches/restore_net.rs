//! Issue 30: a job-wide restore over the network, every host asking every
//! other ("direct") against the collector along the two-level tree
//! (`ckpt::collect`), with real agents.
//!
//! What runs, per N (hosts of one job) and set-up:
//! - N real `wardend`s, each on its own loopback address (127.3.x.y),
//!   mutual TLS on `api.tcp`, each handed the job's N hosts in node-rank
//!   order with their names (`SetCheckpointPeers`), as each host's launcher
//!   does from its etcd round;
//! - each host's 2 ranks save a 64 KiB shard of step 10 through the real
//!   client library, replicated to one peer (`checkpoint.replicas` 1);
//! - then every rank of every host restores at once (the wave after a
//!   job-wide restart): `warden_client::Checkpointer::restore(0)`.
//!
//! Set-ups: `direct` (`checkpoint.collect_above` above N: each host's
//! restore lists every other host) and `collector` (`collect_above` 0,
//! groups of `checkpoint.collect_fan_out`'s default: about √N, at least
//! 32). Per row it prints: the wave's wall time (the first restore asked
//! to the last answered), the connections each agent holds from the others
//! after the wave (established TCP connections to its `api.tcp`, from
//! /proc/net/tcp: the agents keep them until `api.idle_timeout`), their
//! largest and their sum, and the agents' CPU in the wave (their threads'
//! on-CPU time, /proc/PID/task/*/schedstat), the sum and the largest, and
//! how many restores answered an error (ABORTED: a holder out of reach),
//! the first one's message on stderr. Every restore that answers must give
//! step 10's bytes, and through the collector every restore must answer,
//! or the bench fails.
//!
//! On loopback every agent dials its peers from 127.0.0.1 (a real host
//! from its own address), so `api.max_handshakes_per_source` is raised
//! here: at its default (8) the agents refuse each other's handshakes past
//! eight at once, in both set-ups.
//!
//! A third set-up, `calls`, times what `collector_answer` leaves out: the
//! gRPC call itself (HTTP/2, TLS, tonic's task, the authorization) at the
//! agents that answer a wave's asks. It is `collector` with groups of 8
//! (`collect_fan_out`, so that 32 hosts make four groups) and a
//! `peer_timeout` of 30 s (the wave's collection, finished, serves every
//! ask that follows, as it serves a wave's: no ask starts a collection of
//! its own). After the wave, from this process with the hosts' own
//! certificates, `WARDEN_RESTORE_NET_CALLS` asks (default 2000) for a
//! host's ranks, each checked, 64 at once:
//! - **baseline**: as many `grpc.health.v1.Health/Check` calls to the
//!   collector over one held connection, which the TCP listener answers
//!   UNIMPLEMENTED: the transport's cost per call (TLS records, HTTP/2,
//!   tonic's routing), nothing of CollectHoldings;
//! - **held**: relayed asks to the collector (the job's first host) over one
//!   connection, as the group leaders relay a wave's asks over the
//!   connections they hold;
//! - **fresh**: a quarter as many, each over a connection of its own (a
//!   TCP connect and a full TLS handshake with a client certificate,
//!   session resumption off, then the ask), 16 at once: a host's first
//!   contact with its leader;
//! - **resumed**: as many again with rustls' default client, which resumes
//!   a session each host's earlier connection left (a PSK handshake: no
//!   certificate signed or checked): a host that connects again;
//! - **leader**: asks to group 1's leader, which passes each on to the
//!   collector over the connection it holds.
//!
//! Per ask it prints the agents' CPU (the collector's, and the leader's
//! for the last): each thread's time in the phase, less the agent's idle
//! rate (measured over a second before the phases) over its length. The
//! phases must end within 15 s of the wave (half the collection's
//! keeping), or the bench fails.
//!
//! Run: `cargo bench -p warden-cli --bench restore_net` (release);
//! `WARDEN_RESTORE_NET_HOSTS=32,64,128,256`, `WARDEN_RESTORE_NET_OUT=x.json`,
//! `WARDEN_RESTORE_NET_SETUPS=direct,collector` (or `calls`),
//! `WARDEN_RESTORE_NET_CALLS=2000`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
#[allow(dead_code)]
#[path = "../../tests/common/pki.rs"]
mod pki;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use warden_proto::v1 as pb;

use common::{Agent, cpu, threads};

const JOB: &str = "restore-net";
const RANKS_PER_HOST: u32 = 2;
const STEP: u64 = 10;
const SHARD: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    Direct,
    Collector,
    Calls,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::Collector => "collector",
            Setup::Calls => "calls",
        }
    }
}

fn ip(i: usize) -> String {
    format!("127.3.{}.{}", i / 200, i % 200 + 1)
}

fn free(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_agent(host: &str, tcp: &str, setup: Setup) -> Agent {
    let node = pki::cluster().node(host);
    let dir = tempfile::Builder::new()
        .prefix("warden-rsnet-")
        .tempdir()
        .unwrap();
    let ckpt = dir.path().join("ckpt");
    let collect = match setup {
        Setup::Direct => "collect_above = 1000000\n",
        Setup::Collector => "collect_above = 0\n",
        Setup::Calls => "collect_above = 0\ncollect_fan_out = 8\npeer_timeout = \"30s\"\n",
    };
    Agent::start(dir, |socket, state| {
        format!(
            "[agent]\nhost_name = \"{host}\"\nstate_dir = \"{}\"\n\
             [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
             [api]\nsocket = \"{}\"\ntcp = \"{tcp}\"\nmax_connections = 8192\n\
             max_handshakes_per_source = 4096\n{}\
             [metrics]\nlisten = \"\"\n[log]\nlevel = \"warn\"\n\
             [nvml]\nenabled = false\n[kmsg]\nenabled = false\n[dcgm]\nenabled = false\n\
             [checkpoint]\ndir = \"{}\"\nretry_interval = \"1h\"\n{collect}",
            state.display(),
            socket.display(),
            node.api_keys(),
            ckpt.display(),
        )
    })
}

/// Established TCP connections to each local `ip:port` in /proc/net/tcp.
fn established() -> HashMap<String, usize> {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let mut out = HashMap::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[3] != "01" {
            continue;
        }
        let Some((a, p)) = f[1].split_once(':') else {
            continue;
        };
        let (Ok(a), Ok(p)) = (u32::from_str_radix(a, 16), u16::from_str_radix(p, 16)) else {
            continue;
        };
        // /proc/net/tcp writes the address in host byte order (x86: little).
        let ip = std::net::Ipv4Addr::from(a.swap_bytes());
        *out.entry(format!("{ip}:{p}")).or_default() += 1;
    }
    out
}

fn checkpointer(agent: &Agent, rank: u32, world: u32) -> warden_client::Checkpointer {
    let mut o = warden_client::ConnectOptions::from_env_lossy();
    o.socket_path = agent.socket();
    o.job_id = JOB.to_owned();
    o.global_rank = rank;
    o.local_rank = rank;
    o.world_size = world;
    warden_client::Checkpointer::new(o).unwrap()
}

fn shard(rank: u32) -> Vec<u8> {
    (0..SHARD)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(rank) as u8)
        .collect()
}

struct Row {
    hosts: usize,
    setup: Setup,
    /// Restores that answered an error (every one that answered answered
    /// right).
    failed: usize,
    wave: Duration,
    conn_max: usize,
    conn_first: usize,
    conn_sum: usize,
    cpu_sum: Duration,
    cpu_max: Duration,
    calls: Option<Calls>,
}

/// What the `calls` set-up measured: agents' CPU per ask, idle removed.
struct Calls {
    asks: usize,
    base_cpu: Duration,
    held_cpu: Duration,
    held_wall: Duration,
    fresh: usize,
    fresh_cpu: Duration,
    fresh_wall: Duration,
    resumed_cpu: Duration,
    resumed_wall: Duration,
    leader_cpu: Duration,
    leader_collector_cpu: Duration,
    leader_wall: Duration,
}

impl Calls {
    /// Per ask (per call for the baseline), in microseconds: baseline,
    /// held, held wall, fresh, fresh wall, resumed, resumed wall, leader,
    /// collector through the leader, wall through the leader.
    fn per_ask(&self) -> [f64; 10] {
        let (n, f) = (self.asks, self.fresh);
        [
            per_ask(self.base_cpu, n),
            per_ask(self.held_cpu, n),
            per_ask(self.held_wall, n),
            per_ask(self.fresh_cpu, f),
            per_ask(self.fresh_wall, f),
            per_ask(self.resumed_cpu, f),
            per_ask(self.resumed_wall, f),
            per_ask(self.leader_cpu, n),
            per_ask(self.leader_collector_cpu, n),
            per_ask(self.leader_wall, n),
        ]
    }
}

/// An ask for host `h`'s ranks, as its restore sends it.
fn ask(h: usize, relayed: bool) -> pb::HoldingsAsk {
    let r = h as u32 * RANKS_PER_HOST;
    pb::HoldingsAsk {
        job_id: JOB.into(),
        group: 0,
        rank: r,
        relayed,
        limit_ms: 30_000,
        ranks: (r + 1..r + RANKS_PER_HOST).collect(),
    }
}

/// The answer to [`ask`] of host `h`: every rank answered, step 10 in it.
fn check(h: usize, got: &pb::Holdings) {
    let r = h as u32 * RANKS_PER_HOST;
    let mut answered = got.answered.clone();
    answered.sort_unstable();
    assert_eq!(
        answered,
        (r..r + RANKS_PER_HOST).collect::<Vec<_>>(),
        "host {h}: {got:?}"
    );
    assert!(
        got.steps.iter().any(|s| s.step == STEP),
        "host {h}: no step {STEP} in {got:?}"
    );
    assert!(got.unreachable.is_empty(), "host {h}: {got:?}");
}

/// `count` asks through `client` (clones share its connection), `at_once`
/// at a time, asked for hosts 1.. in turn; every answer checked.
async fn asks(
    client: &warden_proto::v1::peer_client::PeerClient<tonic::transport::Channel>,
    hosts: usize,
    count: usize,
    relayed: bool,
    at_once: usize,
) {
    let mut next = 0usize;
    let mut set = tokio::task::JoinSet::new();
    while next < count || !set.is_empty() {
        while next < count && set.len() < at_once {
            let h = 1 + next % (hosts - 1);
            let mut c = client.clone();
            set.spawn(async move {
                let got = c.collect_holdings(ask(h, relayed)).await;
                (h, got)
            });
            next += 1;
        }
        if let Some(done) = set.join_next().await {
            let (h, got) = done.unwrap();
            check(
                h,
                &got.unwrap_or_else(|e| panic!("host {h}: {e}")).into_inner(),
            );
        }
    }
}

/// What `pid`'s threads spent since `before` ([`threads`]): each live
/// thread's time less its own then. A thread that exited meanwhile (a
/// blocking thread idle for 10 s) leaves with what it spent in the phase,
/// not with everything it spent before it, as a sum over the process's
/// live threads would.
fn spent_since(pid: u32, before: &HashMap<String, u64>) -> Duration {
    let ns: u64 = threads(pid)
        .iter()
        .map(|(t, &now)| now.saturating_sub(before.get(t).copied().unwrap_or(0)))
        .sum();
    Duration::from_nanos(ns)
}

/// CPU `pids` spent since `before` beyond their idle rate (`idle` per
/// second) over `wall`.
fn beyond_idle(
    before: &[HashMap<String, u64>],
    pids: &[u32],
    idle: &[f64],
    wall: Duration,
) -> Vec<Duration> {
    pids.iter()
        .zip(before)
        .zip(idle)
        .map(|((&p, b), &i)| {
            spent_since(p, b).saturating_sub(Duration::from_secs_f64(i * wall.as_secs_f64()))
        })
        .collect()
}

/// `count` asks to `addr` (the agent `name`), each on a connection of its
/// own, 16 at once, for hosts 1.. in turn with host h's client config
/// (`configs[h - 1]`); every answer checked.
async fn fresh_asks(addr: &str, name: &str, configs: &[rustls::ClientConfig], count: usize) {
    let hosts = configs.len() + 1;
    let mut set = tokio::task::JoinSet::new();
    let mut next = 0usize;
    while next < count || !set.is_empty() {
        while next < count && set.len() < 16 {
            let h = 1 + next % (hosts - 1);
            let mut c = pki::peer_client(addr, name, configs[h - 1].clone());
            set.spawn(async move { (h, c.collect_holdings(ask(h, true)).await) });
            next += 1;
        }
        if let Some(done) = set.join_next().await {
            let (h, got) = done.unwrap();
            check(
                h,
                &got.unwrap_or_else(|e| panic!("host {h}: {e}")).into_inner(),
            );
        }
    }
}

/// The `calls` set-up's phase, after its wave (see the module's notes).
async fn calls(
    agents: &[Agent],
    addrs: &[String],
    names: &[String],
    count: usize,
    wave_done: Instant,
) -> Calls {
    assert!(
        agents.len() > 9,
        "the calls set-up needs two groups of 8: 10 hosts at least"
    );
    let ca = pki::cluster();
    let member = |i: usize| ca.client_config(Some(&ca.node(&names[i])));
    let (collector, leader) = (agents[0].pid(), agents[8].pid());
    // The agents' idle rate, over a second before the phases.
    let (c0, l0) = (threads(collector), threads(leader));
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let secs = t.elapsed().as_secs_f64();
    let idle = [
        spent_since(collector, &c0).as_secs_f64() / secs,
        spent_since(leader, &l0).as_secs_f64() / secs,
    ];

    // Baseline: calls the TCP listener refuses, over one connection.
    let channel = pki::tls_channel(&addrs[0], &names[0], member(1));
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    let health_calls = |count: usize| {
        let health = health.clone();
        async move {
            let mut set = tokio::task::JoinSet::new();
            for i in 0..count {
                if set.len() >= 64 {
                    set.join_next().await.unwrap().unwrap();
                }
                let mut h = health.clone();
                set.spawn(async move {
                    let e = h
                        .check(tonic_health::pb::HealthCheckRequest::default())
                        .await
                        .expect_err("grpc.health on api.tcp");
                    assert_eq!(e.code(), tonic::Code::Unimplemented, "call {i}: {e}");
                });
            }
            while let Some(done) = set.join_next().await {
                done.unwrap();
            }
        }
    };
    health_calls(16).await;
    let before = [threads(collector)];
    let t = Instant::now();
    health_calls(count).await;
    let base_cpu = beyond_idle(&before, &[collector], &idle[..1], t.elapsed())[0];

    // Held: one connection to the collector, relayed asks.
    let held = pki::peer_client(&addrs[0], &names[0], member(1));
    asks(&held, agents.len(), 16, true, 16).await;
    let before = [threads(collector)];
    let t = Instant::now();
    asks(&held, agents.len(), count, true, 64).await;
    let held_wall = t.elapsed();
    let held_cpu = beyond_idle(&before, &[collector], &idle[..1], held_wall)[0];

    // Fresh: a connection and a full TLS handshake an ask (no session
    // resumed: a host's first contact).
    let fresh = (count / 4).max(1);
    let full: Vec<_> = (1..agents.len())
        .map(|i| {
            let mut c = member(i);
            c.resumption = rustls::client::Resumption::disabled();
            c
        })
        .collect();
    let before = [threads(collector)];
    let t = Instant::now();
    fresh_asks(&addrs[0], &names[0], &full, fresh).await;
    let fresh_wall = t.elapsed();
    let fresh_cpu = beyond_idle(&before, &[collector], &idle[..1], fresh_wall)[0];

    // Resumed: the same, each host's client keeping rustls' default
    // session store (every host connected once before): a host that
    // connects again.
    let resuming: Vec<_> = (1..agents.len()).map(member).collect();
    fresh_asks(&addrs[0], &names[0], &resuming, agents.len() - 1).await;
    let before = [threads(collector)];
    let t = Instant::now();
    fresh_asks(&addrs[0], &names[0], &resuming, fresh).await;
    let resumed_wall = t.elapsed();
    let resumed_cpu = beyond_idle(&before, &[collector], &idle[..1], resumed_wall)[0];

    // Leader: asks to group 1's leader (hosts 8..16), passed on.
    let to_leader = pki::peer_client(&addrs[8], &names[8], member(9));
    asks(&to_leader, agents.len(), 16, false, 16).await;
    let before = [threads(collector), threads(leader)];
    let t = Instant::now();
    asks(&to_leader, agents.len(), count, false, 64).await;
    let leader_wall = t.elapsed();
    let spent = beyond_idle(&before, &[collector, leader], &idle, leader_wall);
    // Within half the collection's keeping (peer_timeout 30 s): no ask
    // above started a collection of its own.
    assert!(
        wave_done.elapsed() < Duration::from_secs(15),
        "the phases took {:?} after the wave: past half of peer_timeout an ask may start a \
         collection of its own; lower WARDEN_RESTORE_NET_CALLS",
        wave_done.elapsed()
    );
    Calls {
        asks: count,
        base_cpu,
        held_cpu,
        held_wall,
        fresh,
        fresh_cpu,
        fresh_wall,
        resumed_cpu,
        resumed_wall,
        leader_cpu: spent[1],
        leader_collector_cpu: spent[0],
        leader_wall,
    }
}

async fn run(n: usize, setup: Setup) -> Row {
    let world = n as u32 * RANKS_PER_HOST;
    let addrs: Vec<String> = (0..n)
        .map(|i| {
            let ip = ip(i);
            format!("{ip}:{}", free(&ip))
        })
        .collect();
    let names: Vec<String> = (0..n).map(|i| format!("h{i:05}")).collect();
    let started = Instant::now();
    // Started 64 at a time: a thousand at once on two cores pass the
    // 20 s an agent is given to get ready.
    let mut agents: Vec<Agent> = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        agents.extend(std::thread::scope(|s| {
            let hs: Vec<_> = chunk
                .iter()
                .map(|&i| {
                    let (name, addr) = (&names[i], &addrs[i]);
                    s.spawn(move || start_agent(name, addr, setup))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        }));
    }
    eprintln!(
        "{n} agents ({}) up in {:?}",
        setup.name(),
        started.elapsed()
    );
    let order: Vec<(String, String)> = addrs.iter().cloned().zip(names.iter().cloned()).collect();
    for a in &agents {
        common::hand_over(a, JOB, &order).await;
    }
    std::thread::scope(|s| {
        for (h, a) in agents.iter().enumerate() {
            for r in 0..RANKS_PER_HOST {
                let rank = h as u32 * RANKS_PER_HOST + r;
                s.spawn(move || {
                    checkpointer(a, rank, world)
                        .save(STEP, &shard(rank))
                        .unwrap()
                });
            }
        }
    });
    // Every shard on its host and one peer before the wave.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let l = common::connect(&agents[0].socket())
            .await
            .list_checkpoints(pb::ListCheckpointsRequest {
                job_id: JOB.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let done = l.steps.iter().any(|s| {
            s.step == STEP && s.complete && s.shards.iter().all(|sh| sh.copies.len() >= 2)
        });
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "step {STEP} not replicated: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before: Vec<Duration> = agents.iter().map(|a| cpu(a.pid())).collect();
    let conn_before = established();
    let wave = Instant::now();
    let failed: Vec<String> = std::thread::scope(|s| {
        let restores: Vec<_> = agents
            .iter()
            .enumerate()
            .flat_map(|(h, a)| {
                (0..RANKS_PER_HOST).map(move |r| (h, a, h as u32 * RANKS_PER_HOST + r))
            })
            .map(|(h, a, rank)| {
                s.spawn(move || {
                    let got = match checkpointer(a, rank, world).restore(0) {
                        Ok(Some(got)) => got,
                        Ok(None) => return Some(format!("host {h} rank {rank}: nothing found")),
                        Err(e) => return Some(format!("host {h} rank {rank}: {e}")),
                    };
                    // A restore that answers must answer right.
                    assert_eq!(got.step, STEP, "host {h} rank {rank}");
                    assert_eq!(got.read().unwrap(), shard(rank), "host {h} rank {rank}");
                    None
                })
            })
            .collect();
        restores
            .into_iter()
            .filter_map(|t| t.join().unwrap())
            .collect()
    });
    let wave_done = Instant::now();
    let wave = wave_done - wave;
    if let Some(first) = failed.first() {
        eprintln!(
            "{n} hosts, {}: {} restores failed; the first: {}",
            setup.name(),
            failed.len(),
            first.chars().take(400).collect::<String>()
        );
    }
    let conns = established();
    let held: Vec<usize> = addrs
        .iter()
        .map(|a| {
            conns
                .get(a)
                .copied()
                .unwrap_or(0)
                .saturating_sub(conn_before.get(a).copied().unwrap_or(0))
        })
        .collect();
    let spent: Vec<Duration> = agents
        .iter()
        .zip(&before)
        .map(|(a, b)| cpu(a.pid()).saturating_sub(*b))
        .collect();
    let calls = match setup {
        Setup::Calls => Some(calls(&agents, &addrs, &names, calls_count(), wave_done).await),
        _ => None,
    };
    drop(agents);
    Row {
        hosts: n,
        setup,
        failed: failed.len(),
        wave,
        conn_max: held.iter().copied().max().unwrap_or(0),
        conn_first: held[0],
        conn_sum: held.iter().sum(),
        cpu_sum: spent.iter().sum(),
        cpu_max: spent.iter().copied().max().unwrap_or_default(),
        calls,
    }
}

fn calls_count() -> usize {
    std::env::var("WARDEN_RESTORE_NET_CALLS")
        .map(|s| s.trim().parse().expect("WARDEN_RESTORE_NET_CALLS: a count"))
        .unwrap_or(2000)
}

fn per_ask(d: Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e6 / n.max(1) as f64
}

fn main() {
    let hosts: Vec<usize> = std::env::var("WARDEN_RESTORE_NET_HOSTS")
        .unwrap_or_else(|_| "32,64,128,256".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("WARDEN_RESTORE_NET_HOSTS: a list of counts")
        })
        .collect();
    let setups: Vec<Setup> = std::env::var("WARDEN_RESTORE_NET_SETUPS")
        .unwrap_or_else(|_| "direct,collector".into())
        .split(',')
        .map(|s| match s.trim() {
            "direct" => Setup::Direct,
            "collector" => Setup::Collector,
            "calls" => Setup::Calls,
            other => {
                panic!("WARDEN_RESTORE_NET_SETUPS: {other:?} is not direct, collector or calls")
            }
        })
        .collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut rows = Vec::new();
    println!(
        "| hosts | set-up | restores failed | wave (every rank answered) | connections held, \
         busiest agent | at the job's first host | all agents | agents' CPU in the wave | \
         busiest agent's CPU |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &n in &hosts {
        for &setup in &setups {
            let r = rt.block_on(run(n, setup));
            println!(
                "| {} | {} | {} of {} | {:.1} ms | {} | {} | {} | {:.0} ms | {:.0} ms |",
                r.hosts,
                r.setup.name(),
                r.failed,
                r.hosts * RANKS_PER_HOST as usize,
                r.wave.as_secs_f64() * 1e3,
                r.conn_max,
                r.conn_first,
                r.conn_sum,
                r.cpu_sum.as_secs_f64() * 1e3,
                r.cpu_max.as_secs_f64() * 1e3,
            );
            rows.push(r);
        }
    }
    let measured: Vec<(usize, &Calls)> = rows
        .iter()
        .filter_map(|r| r.calls.as_ref().map(|c| (r.hosts, c)))
        .collect();
    if !measured.is_empty() {
        println!(
            "\n| hosts | asks | baseline (Health/Check, UNIMPLEMENTED on TCP): collector's CPU a \
             call | held connection: collector's CPU an ask | wall an ask (64 at once) | asks | \
             fresh connection, full TLS handshake: collector's CPU an ask | wall an ask (16 at \
             once) | fresh connection, session resumed: collector's CPU an ask | wall an ask | \
             through group 1's leader: leader's CPU an ask | collector's CPU an ask | wall an ask |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for (hosts, c) in &measured {
            let [b, h, hw, f, fw, r, rw, l, v, vw] = c.per_ask();
            println!(
                "| {hosts} | {} | {b:.1} us | {h:.1} us | {hw:.1} us | {} | {f:.1} us | {fw:.1} us | \
                 {r:.1} us | {rw:.1} us | {l:.1} us | {v:.1} us | {vw:.1} us |",
                c.asks, c.fresh,
            );
        }
    }
    if let Ok(out) = std::env::var("WARDEN_RESTORE_NET_OUT") {
        let json: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"hosts\":{},\"setup\":\"{}\",\"failed\":{},\"wave_ms\":{:.3},\
                     \"conn_max\":{},\"conn_first\":{},\"conn_sum\":{},\"cpu_sum_ms\":{:.1},\
                     \"cpu_max_ms\":{:.1}{}}}",
                    r.hosts,
                    r.setup.name(),
                    r.failed,
                    r.wave.as_secs_f64() * 1e3,
                    r.conn_max,
                    r.conn_first,
                    r.conn_sum,
                    r.cpu_sum.as_secs_f64() * 1e3,
                    r.cpu_max.as_secs_f64() * 1e3,
                    r.calls.as_ref().map_or(String::new(), |c| {
                        let [b, h, hw, f, fw, r, rw, l, v, vw] = c.per_ask();
                        format!(
                            ",\"calls\":{{\"asks\":{},\"base_cpu_us\":{b:.2},\
                             \"held_cpu_us\":{h:.2},\"held_wall_us\":{hw:.2},\"fresh\":{},\
                             \"fresh_full_cpu_us\":{f:.2},\"fresh_full_wall_us\":{fw:.2},\
                             \"fresh_resumed_cpu_us\":{r:.2},\"fresh_resumed_wall_us\":{rw:.2},\
                             \"leader_cpu_us\":{l:.2},\"leader_collector_cpu_us\":{v:.2},\
                             \"leader_wall_us\":{vw:.2}}}",
                            c.asks, c.fresh,
                        )
                    }),
                )
            })
            .collect();
        std::fs::write(&out, format!("[\n{}\n]\n", json.join(",\n"))).unwrap();
    }
    // The claim: through the collector every restore answers.
    let short: Vec<String> = rows
        .iter()
        .filter(|r| r.setup != Setup::Direct && r.failed > 0)
        .map(|r| format!("{} hosts: {} failed", r.hosts, r.failed))
        .collect();
    assert!(
        short.is_empty(),
        "restores through the collector failed: {short:?}"
    );
}
