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
//! Run: `cargo bench -p warden-cli --bench restore_net` (release);
//! `WARDEN_RESTORE_NET_HOSTS=32,64,128,256`, `WARDEN_RESTORE_NET_OUT=x.json`,
//! `WARDEN_RESTORE_NET_SETUPS=direct,collector`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;
#[allow(dead_code)]
#[path = "../../tests/common/pki.rs"]
mod pki;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use warden_proto::v1 as pb;

use common::{Agent, cpu};

const JOB: &str = "restore-net";
const RANKS_PER_HOST: u32 = 2;
const STEP: u64 = 10;
const SHARD: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    Direct,
    Collector,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::Collector => "collector",
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
    let wave = wave.elapsed();
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
    }
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
            other => panic!("WARDEN_RESTORE_NET_SETUPS: {other:?} is not direct or collector"),
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
    if let Ok(out) = std::env::var("WARDEN_RESTORE_NET_OUT") {
        let json: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"hosts\":{},\"setup\":\"{}\",\"failed\":{},\"wave_ms\":{:.3},\
                     \"conn_max\":{},\"conn_first\":{},\"conn_sum\":{},\"cpu_sum_ms\":{:.1},\
                     \"cpu_max_ms\":{:.1}}}",
                    r.hosts,
                    r.setup.name(),
                    r.failed,
                    r.wave.as_secs_f64() * 1e3,
                    r.conn_max,
                    r.conn_first,
                    r.conn_sum,
                    r.cpu_sum.as_secs_f64() * 1e3,
                    r.cpu_max.as_secs_f64() * 1e3,
                )
            })
            .collect();
        std::fs::write(&out, format!("[\n{}\n]\n", json.join(",\n"))).unwrap();
    }
    // The claim: through the collector every restore answers.
    let short: Vec<String> = rows
        .iter()
        .filter(|r| r.setup == Setup::Collector && r.failed > 0)
        .map(|r| format!("{} hosts: {} failed", r.hosts, r.failed))
        .collect();
    assert!(
        short.is_empty(),
        "restores through the collector failed: {short:?}"
    );
}
