//! A multi-host restart round through etcd, beside its baseline, in one run
//! against one real etcd (tests/common/etcd.rs starts it; data on the
//! scratch directory's disk, fsync on, as in production):
//!
//! 1. **baseline**: one raw etcd put, until three watchers (each on its own
//!    client connection, as three hosts would be) have seen it;
//! 2. **restart round**: `request_restart` on one of three coordinators,
//!    until all three hold the new round (`next_round` returned): the
//!    txn that advances the epoch and writes the round, the watch that
//!    carries it, and each coordinator's publication;
//! 3. **cordon round**: `leave(Cordoned)` of one member until the two
//!    others hold the round without it (then it rejoins, untimed);
//! 4. **dead launcher**: a coordinator dropped without leaving (lease TTL
//!    1 s, rejoin grace 1 s: `warden run` sets the grace to its lease TTL,
//!    launcher/src/etcd.rs) until the others hold the scaled-down round:
//!    bound by the TTL, etcd's expiry sweep and the grace, shown for scale.
//!
//! Target: a restart round under 1 s on top of the local restart.
//! Run: `cargo bench -p warden-cli --bench coord_round` (release build).
//! Prints markdown for docs/benchmarks.md.

// A benchmark program: failing loudly on set-up errors is what it should do.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

#[allow(dead_code)]
#[path = "../../tests/common/etcd.rs"]
mod etcd;

use std::time::{Duration, Instant};

use etcd::EtcdServer;
use etcd_client::{Client, EventType, WatchOptions};
use tokio::sync::mpsc;
use warden_launcher::coord::{CoordConfig, Coordinator, Leave};

const ROUNDS: usize = 200;
const KILLS: usize = 10;

fn cfg(etcd: &EtcdServer, job: &str, host: &str, n: u32) -> CoordConfig {
    let mut c = CoordConfig::new(
        etcd.endpoints(),
        job,
        host,
        format!("10.0.0.{}", host.len()),
    );
    c.nproc_per_node = 8;
    c.min_nodes = n - 1;
    c.max_nodes = n;
    c.lease_ttl = Duration::from_secs(1);
    // As `warden run` sets it (launcher/src/etcd.rs): the grace a member
    // lost without a word has to re-register is its lease TTL.
    c.rejoin_grace = c.lease_ttl;
    c.last_call = Duration::from_millis(200);
    c
}

fn stats(name: &str, mut d: Vec<Duration>) -> String {
    d.sort();
    let pick = |q: f64| d[((d.len() - 1) as f64 * q).round() as usize];
    let ms = |x: Duration| format!("{:.2} ms", x.as_secs_f64() * 1e3);
    format!(
        "| {name} | {} | {} | {} | {} | {} |",
        d.len(),
        ms(d[0]),
        ms(pick(0.5)),
        ms(pick(0.9)),
        ms(d[d.len() - 1])
    )
}

/// Baseline: put a value, wait until three watchers saw it.
async fn raw_round_trips(etcd: &EtcdServer) -> Vec<Duration> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, u64)>();
    let mut watchers = Vec::new();
    for w in 0..3 {
        let mut client = Client::connect(etcd.endpoints(), None).await.unwrap();
        let mut stream = client
            .watch("/bench/raw", Some(WatchOptions::new()))
            .await
            .unwrap();
        let tx = tx.clone();
        watchers.push(tokio::spawn(async move {
            let _client = client;
            while let Ok(Some(resp)) = stream.message().await {
                for e in resp.events() {
                    if e.event_type() == EventType::Put
                        && let Some(kv) = e.kv()
                    {
                        let v: u64 = kv.value_str().unwrap().parse().unwrap();
                        let _ = tx.send((w, v));
                    }
                }
            }
        }));
    }
    let mut client = Client::connect(etcd.endpoints(), None).await.unwrap();
    let mut out = Vec::new();
    for i in 0..ROUNDS as u64 + 10 {
        let t0 = Instant::now();
        client.put("/bench/raw", i.to_string(), None).await.unwrap();
        let mut seen = [false; 3];
        while !seen.iter().all(|s| *s) {
            let (w, v) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("a watcher answers")
                .unwrap();
            if v == i {
                seen[w] = true;
            }
        }
        if i >= 10 {
            out.push(t0.elapsed());
        }
    }
    for w in watchers {
        w.abort();
    }
    out
}

async fn all_see(hosts: &[&Coordinator], after: u64) -> u64 {
    let rounds = futures_join(hosts, after).await;
    rounds.iter().map(|r| r.epoch).max().unwrap()
}

async fn futures_join(hosts: &[&Coordinator], after: u64) -> Vec<warden_launcher::coord::Round> {
    let mut out = Vec::new();
    // Polled one after the other: a round already held returns at once, so
    // the total is the slowest host's.
    for h in hosts {
        let r = tokio::time::timeout(Duration::from_secs(10), h.next_round(after))
            .await
            .expect("a round in time")
            .expect("a round");
        out.push(r);
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let etcd = EtcdServer::start();
    let raw = raw_round_trips(&etcd).await;

    // Three hosts in one round.
    let job = "bench";
    let a = Coordinator::join(cfg(&etcd, job, "host-a", 3))
        .await
        .unwrap();
    let b = Coordinator::join(cfg(&etcd, job, "host-bb", 3))
        .await
        .unwrap();
    let mut c = Coordinator::join(cfg(&etcd, job, "host-ccc", 3))
        .await
        .unwrap();
    let mut epoch = all_see(&[&a, &b, &c], 0).await;

    let mut restart = Vec::new();
    for i in 0..ROUNDS + 10 {
        let t0 = Instant::now();
        let next = a.request_restart(epoch, "bench").await.unwrap();
        assert_eq!(next, epoch + 1);
        epoch = all_see(&[&a, &b, &c], epoch).await;
        if i >= 10 {
            restart.push(t0.elapsed());
        }
    }

    let mut cordon = Vec::new();
    for _ in 0..20 {
        let t0 = Instant::now();
        c.leave(Leave::Cordoned("bench".into())).await.unwrap();
        epoch = all_see(&[&a, &b], epoch).await;
        cordon.push(t0.elapsed());
        c = Coordinator::join(cfg(&etcd, job, "host-ccc", 3))
            .await
            .unwrap();
        epoch = all_see(&[&a, &b, &c], epoch).await;
    }

    let mut dead = Vec::new();
    for _ in 0..KILLS {
        let t0 = Instant::now();
        drop(c);
        epoch = all_see(&[&a, &b], epoch).await;
        dead.push(t0.elapsed());
        c = Coordinator::join(cfg(&etcd, job, "host-ccc", 3))
            .await
            .unwrap();
        epoch = all_see(&[&a, &b, &c], epoch).await;
    }

    println!("| round | n | min | median | p90 | max |");
    println!("|---|---|---|---|---|---|");
    println!(
        "{}",
        stats("**baseline**: raw etcd put -> 3 watchers saw it", raw)
    );
    println!(
        "{}",
        stats(
            "restart: `request_restart` -> 3 coordinators hold the new round",
            restart
        )
    );
    println!(
        "{}",
        stats(
            "cordon: `leave` -> 2 others hold the round without it",
            cordon
        )
    );
    println!(
        "{}",
        stats(
            "dead launcher (lease TTL 1 s, rejoin grace 1 s) -> 2 others hold the scaled-down round",
            dead
        )
    );
}
