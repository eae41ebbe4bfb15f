//! Issue 30: the job-wide straggler exchange at N hosts, through one
//! aggregator, beside the all-to-all it replaced, in the same run.
//!
//! What runs: the real code of both paths, in this process, without the
//! network (labelled so in docs/benchmarks.md): each of N hosts' reports is
//! built from its 8 ranks' section medians (the sketches the agent
//! sends), encoded as the wire message (`warden.v1.AggregateReport`), and
//! decoded and merged by the real `Aggregator` (and the host's entry of
//! the collector's hang board updated, as the agent does), whose answer is
//! encoded too; the all-to-all's batches (`warden.v1.StragglerSummaries`, 8 ranks
//! each) are encoded once and merged into one host's real `Stragglers`
//! detector N-1 times (what every host did every interval).
//!
//! Per N it prints: calls per interval (the fleet's), bytes sent and
//! received per host per interval, the aggregator's CPU per interval (all
//! N reports: decode, merge, answer) against one host's CPU per interval
//! under all-to-all (N-1 batches decoded and merged), both single-thread
//! wall time on this machine.
//!
//! The two-level tree (`straggler.aggregator_fan_out`, by default the
//! square root of N, at least 32) beside them: the connections the busiest
//! host holds and the calls per interval, counted from the real routes
//! (`warden_core::detect::straggler::tree`), and a group leader's share:
//! its members' reports decoded and checked (what the edge does before it
//! relays), marked relayed and encoded again, timed; the relay's network
//! hop itself is not in it.
//!
//! Run: `cargo bench -p warden-cli --bench exchange_fleet` (release);
//! `WARDEN_EXCHANGE_HOSTS=16,256,1024,2048,8192,16384`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::{Duration, Instant};

use common::{RANKS_PER_HOST, SECTIONS, host_report, median_ns};
use prost::Message;
use warden_agent::exchange::aggregate::Here;
use warden_agent::peer_link::exchange::legacy::{batch_from_pb, batch_pb};
use warden_agent::peer_link::exchange::wire::{answer_pb, report_from_pb, report_pb};
use warden_core::detect::positions::Board;
use warden_core::detect::straggler::aggregate::Aggregator;
use warden_core::detect::straggler::score::SectionMedian;
use warden_core::detect::straggler::tree;
use warden_core::detect::straggler::{Batch, StragglerConfig, Stragglers, Summary};

fn batch_of(host: u32) -> Batch {
    Batch {
        host: format!("host-{host:05}"),
        ranks: (0..RANKS_PER_HOST)
            .map(|r| Summary {
                job: "llm".into(),
                rank: host * RANKS_PER_HOST + r,
                sections: SECTIONS
                    .iter()
                    .enumerate()
                    .map(|(i, name)| SectionMedian {
                        section: (*name).to_owned(),
                        median_ns: median_ns(host, r, i),
                        samples: 20,
                    })
                    .collect(),
                window_seq: 7,
                score: None,
            })
            .collect(),
    }
}

struct Row {
    hosts: u32,
    agg_calls: u64,
    agg_sent: usize,
    agg_received: usize,
    agg_cpu: Duration,
    all_calls: u64,
    all_sent: usize,
    all_received: usize,
    all_cpu: Option<Duration>,
    /// The tree's group size.
    k: usize,
    /// Connections from other hosts at the busiest host, with the tree.
    tree_in: usize,
    /// Calls per interval with the tree (a relayed report is two).
    tree_calls: u64,
    /// A leader's bytes per interval (its members' reports and answers,
    /// in and out again).
    leader_bytes: usize,
    /// A leader's CPU per interval for its members' reports.
    leader_cpu: Duration,
}

/// The tree's calls per interval with every host live: a host's first hop
/// that relays makes two calls, any other one.
fn tree_calls(n: usize, k: usize) -> u64 {
    (0..n)
        .map(|me| match tree::route(n, Some(me), k).next() {
            Some(first) if first == me => 0,
            Some(first) if tree::relays(first, k) => 2,
            Some(_) => 1,
            None => 0,
        })
        .sum()
}

/// A group leader's work per interval: each of its k-1 members' reports
/// decoded and checked, marked relayed and encoded again (the least of 9
/// runs: a run is well under a millisecond, so one is mostly noise).
fn leader_cpu(wire: &[Vec<u8>], k: usize) -> Duration {
    let members = &wire[..(k - 1).min(wire.len())];
    (0..9)
        .map(|_| {
            let started = Instant::now();
            for w in members {
                let pbr = warden_proto::v1::AggregateReport::decode(w.as_slice()).unwrap();
                let mut forward = pbr.clone();
                std::hint::black_box(report_from_pb(pbr).unwrap());
                forward.relayed = true;
                std::hint::black_box(forward.encode_to_vec());
            }
            started.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn measure(n: u32, all_to_all: bool) -> Row {
    // The aggregator: every host's report on the wire, decoded, merged,
    // answered (the answer encoded: what goes back on the wire).
    let wire: Vec<Vec<u8>> = (0..n)
        .map(|h| report_pb(&host_report(h), &[], &[]).encode_to_vec())
        .collect();
    let report_bytes = wire.iter().map(Vec::len).max().unwrap_or(0);
    let mut agg = Aggregator::new(Duration::from_secs(30));
    // The collector's hang board: the agent merges every report's
    // positions into it (`exchange::aggregate::aggregate_here`), none here.
    let mut board = Board::new(Duration::from_secs(30), Duration::from_secs(30));
    let now = Instant::now();
    let mut answer_bytes = 0;
    // Two intervals: the first fills the aggregator, the second is the
    // steady state measured (each host's report replaces its last one).
    for _ in 0..2 {
        let started = Instant::now();
        for w in &wire {
            let pbr = warden_proto::v1::AggregateReport::decode(w.as_slice()).unwrap();
            let (report, _, _) = report_from_pb(pbr).unwrap();
            let host = report.host.clone();
            let wide = agg.report(report, now).unwrap();
            board.merge_remote(&host, Vec::new(), now);
            let here = Here {
                wide,
                verdicts: Vec::new(),
                values: Vec::new(),
                values_aggregated: true,
            };
            answer_bytes = answer_bytes.max(answer_pb(&host, &here).encoded_len());
        }
        let cpu = started.elapsed();
        if agg.hosts_of("llm") == n as usize {
            let mut row = finish(n, all_to_all, report_bytes, answer_bytes, cpu);
            let k = tree::fan_out(n as usize, 0);
            row.k = k;
            row.tree_in = tree::max_in_degree(n as usize, k);
            row.tree_calls = tree_calls(n as usize, k);
            // A job of one group has no leader but the aggregator.
            if (n as usize) > k {
                row.leader_bytes = (k - 1) * (report_bytes + answer_bytes) * 2;
                row.leader_cpu = leader_cpu(&wire, k);
            }
            return row;
        }
    }
    unreachable!("the aggregator keeps every host")
}

fn finish(
    n: u32,
    all_to_all: bool,
    report_bytes: usize,
    answer_bytes: usize,
    agg_cpu: Duration,
) -> Row {
    // All-to-all: each host sends its batch to N-1 peers and gets theirs
    // back; one host's detector merges N-1 batches per interval.
    let batch = batch_pb(&batch_of(0)).encode_to_vec();
    let all_cpu = all_to_all.then(|| {
        let det = Stragglers::new(StragglerConfig::default(), "host-00000".into());
        let batches: Vec<Vec<u8>> = (1..n)
            .map(|h| batch_pb(&batch_of(h)).encode_to_vec())
            .collect();
        let now = Instant::now();
        let started = Instant::now();
        for b in &batches {
            let p = warden_proto::v1::StragglerSummaries::decode(b.as_slice()).unwrap();
            det.merge_remote(batch_from_pb(p).unwrap(), now);
        }
        started.elapsed()
    });
    let peers = n.saturating_sub(1) as usize;
    Row {
        hosts: n,
        agg_calls: u64::from(n.saturating_sub(1)),
        agg_sent: report_bytes,
        agg_received: answer_bytes,
        agg_cpu,
        all_calls: u64::from(n) * u64::from(n.saturating_sub(1)),
        all_sent: peers * batch.len() * 2,
        all_received: peers * batch.len() * 2,
        all_cpu,
        k: 0,
        tree_in: 0,
        tree_calls: 0,
        leader_bytes: 0,
        leader_cpu: Duration::ZERO,
    }
}

fn kb(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{:.1} MB", b as f64 / 1e6)
    } else {
        format!("{:.1} KB", b as f64 / 1e3)
    }
}

fn main() {
    let hosts: Vec<u32> = std::env::var("WARDEN_EXCHANGE_HOSTS")
        .unwrap_or_else(|_| "16,256,1024,2048,8192,16384".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    println!(
        "| hosts | calls per interval, aggregator | all-to-all | bytes per host per interval, aggregator (sent + received) | all-to-all | aggregator CPU per interval (all N reports) | one host's CPU per interval, all-to-all (N-1 batches merged) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut tree_rows = Vec::new();
    for n in hosts {
        // The all-to-all's merge is measured up to 2,048 hosts; past it the
        // bytes and calls are exact, and its CPU grows as measured.
        let r = measure(n, n <= 2048);
        println!(
            "| {} | {} | {} | {} + {} | {} | {:.2} ms | {} |",
            r.hosts,
            r.agg_calls,
            r.all_calls,
            kb(r.agg_sent),
            kb(r.agg_received),
            kb(r.all_sent + r.all_received),
            r.agg_cpu.as_secs_f64() * 1e3,
            r.all_cpu.map_or("(not run)".into(), |d| format!(
                "{:.2} ms",
                d.as_secs_f64() * 1e3
            )),
        );
        tree_rows.push(r);
    }
    println!();
    println!(
        "| hosts | connections at the busiest host, one aggregator | two-level tree (group size) | calls per interval, tree | a leader's bytes per interval (its members' reports and answers, in and out) | a leader's CPU per interval (its members' reports checked and passed on) |"
    );
    println!("|---|---|---|---|---|---|");
    for r in tree_rows {
        let leader = if r.leader_bytes == 0 {
            "(one group: no leader) | -".to_owned()
        } else {
            format!(
                "{} | {:.2} ms",
                kb(r.leader_bytes),
                r.leader_cpu.as_secs_f64() * 1e3
            )
        };
        println!(
            "| {} | {} | {} ({}) | {} | {leader} |",
            r.hosts,
            r.hosts.saturating_sub(1),
            r.tree_in,
            r.k,
            r.tree_calls,
        );
    }
}
