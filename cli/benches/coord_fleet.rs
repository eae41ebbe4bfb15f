//! Issue 30's scale measurements: a fleet of N simulated hosts of one job on
//! one real etcd (tests/common/etcd.rs; etcd 3.4, single member, fsync on),
//! through tests/common/fleet.rs: a few hosts run the real `Coordinator`,
//! the rest are light hosts that still do a launcher's share of etcd work
//! (their own connection, lease and keep-alive, member key, joining read
//! and watch).
//!
//! For each N (a fresh etcd each): joining every host until all hold the
//! first round; restart rounds (`request_restart` on one full host until
//! every host holds the new round); a light host lost without a word (its
//! lease expires after the TTL; the others hold the round without it) and
//! a new host joining in its place; etcd's bytes sent and received and CPU
//! per restart round (its `/metrics`); this process's CPU per round (all
//! the hosts' client side); resident memory per host (this process: light
//! hosts as they join, full hosts as 8 more join the full fleet) and
//! etcd's.
//!
//! Run: `cargo bench -p warden-cli --bench coord_fleet` (release build).
//! `WARDEN_FLEET_HOSTS=16,256,1024,2048` (the Ns), `WARDEN_FLEET_FULL=8`
//! (full hosts per N), `WARDEN_FLEET_ROUNDS=10` (restart rounds per N),
//! `WARDEN_FLEET_LOSSES=1`, `WARDEN_FLEET_TTL_S=10`. Prints markdown for
//! docs/benchmarks.md, one row per N as it completes.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../../tests/common/etcd.rs"]
mod etcd;
#[path = "../../tests/common/fleet.rs"]
mod fleet;

use std::io::Write;
use std::time::Duration;

use etcd::EtcdServer;
use fleet::{EtcdMetrics, Fleet, FleetConfig, cpu_self};

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

fn ms(d: Duration) -> String {
    if d >= Duration::from_secs(10) {
        format!("{:.1} s", d.as_secs_f64())
    } else {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    }
}

fn bytes(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} KB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

async fn run(n: usize, full: usize, rounds: usize, losses: usize, ttl: Duration) -> String {
    let etcd = EtcdServer::start();
    let mut cfg = FleetConfig::new(etcd.endpoints(), "fleet", n, full);
    cfg.ttl = ttl;
    let (mut fleet, joined) = Fleet::join(cfg).await;
    // One round untimed: every connection warm.
    fleet.restart().await;
    let before = EtcdMetrics::read(&etcd.endpoint);
    let cpu0 = cpu_self();
    let mut times = Vec::new();
    for _ in 0..rounds {
        times.push(fleet.restart().await);
    }
    let after = EtcdMetrics::read(&etcd.endpoint);
    let cpu1 = cpu_self();
    let record = fleet.round_bytes().await;
    let mut lost = Vec::new();
    let mut replaced = Vec::new();
    for _ in 0..losses {
        let (l, r) = fleet.lose_one().await;
        lost.push(l);
        replaced.push(r);
    }
    let per_full = fleet.full_host_memory(8).await;
    times.sort();
    let pick = |d: &[Duration], q: f64| d[((d.len() - 1) as f64 * q).round() as usize];
    let r = rounds as f64;
    let median = |d: &mut Vec<Duration>| {
        d.sort();
        if d.is_empty() {
            "-".to_owned()
        } else {
            ms(pick(d, 0.5))
        }
    };
    format!(
        "| {n} ({full}) | {} | {} | {} | {} | {} | {} | {} | {:.0} ms | {:.0} ms | {} | {} | {} | {} |",
        ms(joined.all),
        ms(pick(&times, 0.5)),
        ms(pick(&times, 0.9)),
        median(&mut lost),
        median(&mut replaced),
        bytes((after.sent - before.sent) / r),
        bytes((after.received - before.received) / r),
        (after.cpu - before.cpu) / r * 1e3,
        (cpu1 - cpu0) / r * 1e3,
        bytes(record as f64),
        bytes(joined.rss_per_light as f64),
        bytes(per_full as f64),
        bytes(after.rss),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let ns = env_list("WARDEN_FLEET_HOSTS", "16,256,1024,2048");
    let full = env_one("WARDEN_FLEET_FULL", 8);
    let rounds = env_one("WARDEN_FLEET_ROUNDS", 10).max(1);
    let losses = env_one("WARDEN_FLEET_LOSSES", 1);
    let ttl = Duration::from_secs(env_one("WARDEN_FLEET_TTL_S", 10) as u64);
    println!(
        "| hosts (full) | join, all hosts | restart round, median | p90 | lost host (TTL {ttl:?}) | a new host joins | etcd sent per round | etcd received per round | etcd CPU per round | fleet CPU per round | round record | memory per light host | memory per full host (8 more join) | etcd memory |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for n in ns {
        let row = run(n, full.min(n), rounds, losses, ttl).await;
        println!("{row}");
        let _ = std::io::stdout().flush();
    }
}
