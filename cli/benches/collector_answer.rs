//! Issue 30: the collector's CPU for one restore wave. A job-wide restore
//! asked the collector once per restoring rank (N hosts * 8 ranks); the
//! ranks of a host now ask once (N asks). Each ask is answered from one
//! shared collection (`ckpt::holdings`): per step, the job's count (world
//! size, ranks with a copy, the first missing) and the asking ranks'
//! holders.
//!
//! Ways to answer, side by side on the same collection:
//! - `count per ask` (`Holdings::for_ranks` of one rank): the count taken
//!   again for each ask, as the collector did before `Counted`
//!   (O(steps * world) an ask; today's count function, which walks the
//!   ranks present where the one before looked each rank up: if anything,
//!   faster than it was);
//! - `counted once` (`Counted::new`, then `Counted::for_ranks` of one rank
//!   per ask): the count taken once per collection (O(steps * holders) an
//!   ask);
//! - `encoded, an ask a rank` and `an ask a host`: counted once, and the
//!   answer encoded as sent (`collect_wire::view_to_pb`), for one rank
//!   (8N asks a wave) and for a host's 8 ranks (N asks).
//!
//! The collection: N hosts of 8 ranks, each rank's shard on its own host
//! and on the next host (one replica), five steps kept, one rank missing
//! from the newest step (a wave that restores the step before).
//!
//! Per N it prints the time per ask both ways (the median of a sample of
//! asks) and the wave's total (times 8N asks), and the time to count once.
//!
//! Run: `cargo bench -p warden-cli --bench collector_answer` (release);
//! `WARDEN_COLLECTOR_HOSTS=512,2048,12500`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use prost::Message;
use warden_agent::ckpt::holdings::{Counted, Holdings};
use warden_agent::peer_link::ckpt::collect_wire::view_to_pb;

const RANKS_PER_HOST: u32 = 8;
const STEPS: u64 = 5;

fn collection(hosts: u32) -> Holdings {
    let mut h = Holdings::default();
    let ids: Vec<u32> = (0..hosts)
        .map(|i| {
            h.host(
                &format!("10.0.{}.{}:7000", i / 256, i % 256),
                &format!("h{i}"),
            )
        })
        .collect();
    let world = hosts * RANKS_PER_HOST;
    for step in 1..=STEPS {
        for r in 0..world {
            if step == STEPS && r == world / 2 {
                continue;
            }
            let host = r / RANKS_PER_HOST;
            h.add(ids[host as usize], step * 100, r, world);
            h.add(ids[((host + 1) % hosts) as usize], step * 100, r, world);
        }
    }
    h
}

/// The median time of `f` over `asks` ranks spread over the world.
fn per_ask(world: u32, asks: u32, mut f: impl FnMut(u32) -> usize) -> Duration {
    let mut times: Vec<Duration> = (0..asks)
        .map(|i| {
            let rank = (u64::from(i) * u64::from(world) / u64::from(asks)) as u32;
            let t = Instant::now();
            std::hint::black_box(f(rank));
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn main() {
    let hosts: Vec<u32> = std::env::var("WARDEN_COLLECTOR_HOSTS")
        .unwrap_or_else(|_| "512,2048,12500".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("WARDEN_COLLECTOR_HOSTS: a list of host counts")
        })
        .collect();
    println!(
        "| hosts | ranks | count per ask: per ask | per wave | counted once: count | per ask | per wave \
         | encoded, an ask a rank: per ask | per wave | an ask a host: per ask | per wave |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for n in hosts {
        let h = collection(n);
        let world = n * RANKS_PER_HOST;
        let wave = f64::from(world);
        let slow = per_ask(world, 21, |r| h.for_ranks(&[r]).steps.len());
        let copy = h.clone();
        let t = Instant::now();
        let counted = Counted::new(copy);
        let count = t.elapsed();
        let fast = per_ask(world, 2001, |r| counted.for_ranks(&[r]).steps.len());
        let check = counted.for_ranks(&[world / 2]);
        assert_eq!(check, h.for_ranks(&[world / 2]), "both ways give one view");
        assert!(!check.steps[&(STEPS * 100)].complete());
        let rank_sent = per_ask(world, 2001, |r| {
            view_to_pb(&counted.for_ranks(&[r])).encode_to_vec().len()
        });
        // A host's ranks: the 8 of the host the sampled rank is on.
        let host_sent = per_ask(world, 2001, |r| {
            let first = r / RANKS_PER_HOST * RANKS_PER_HOST;
            let ranks: Vec<u32> = (first..first + RANKS_PER_HOST).collect();
            view_to_pb(&counted.for_ranks(&ranks)).encode_to_vec().len()
        });
        println!(
            "| {n} | {world} | {:.2} ms | {:.1} s | {:.1} ms | {:.2} us | {:.3} s \
             | {:.2} us | {:.3} s | {:.2} us | {:.3} s |",
            slow.as_secs_f64() * 1e3,
            slow.as_secs_f64() * wave,
            count.as_secs_f64() * 1e3,
            fast.as_secs_f64() * 1e6,
            fast.as_secs_f64() * wave + count.as_secs_f64(),
            rank_sent.as_secs_f64() * 1e6,
            rank_sent.as_secs_f64() * wave + count.as_secs_f64(),
            host_sent.as_secs_f64() * 1e6,
            host_sent.as_secs_f64() * f64::from(n) + count.as_secs_f64(),
        );
    }
}
