//! The heal examples' log (`$EXAMPLE_LOG` of examples/heal/*.py), as the
//! heal tests on one host and across hosts read it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use super::Streaming;

/// A line of `$EXAMPLE_LOG`.
#[derive(Debug, Clone)]
pub enum Entry {
    /// `T step N rank R pid P`: rank R finished step N at wall time T.
    Step { t: f64, n: u32, rank: u32, pid: i32 },
    /// `T done rank R digest D`: rank R's final weights.
    Done { rank: u32, digest: String },
}

/// The log's entries (a missing file: none; a line of another shape: skipped).
pub fn read_log(path: &Path) -> Vec<Entry> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                [t, "step", n, "rank", r, "pid", p] => Some(Entry::Step {
                    t: t.parse().ok()?,
                    n: n.parse().ok()?,
                    rank: r.parse().ok()?,
                    pid: p.parse().ok()?,
                }),
                [_, "done", "rank", r, "digest", d] => Some(Entry::Done {
                    rank: r.parse().ok()?,
                    digest: (*d).to_owned(),
                }),
                _ => None,
            }
        })
        .collect()
}

/// Every rank's digest, by rank.
pub fn digests(entries: &[Entry]) -> BTreeMap<u32, String> {
    entries
        .iter()
        .filter_map(|e| match e {
            Entry::Done { rank, digest } => Some((*rank, digest.clone())),
            Entry::Step { .. } => None,
        })
        .collect()
}

/// The 90th percentile of the time between a rank's consecutive steps,
/// over every rank: a step's length as the run saw it, which a loaded
/// machine stretches well past the ledger's median (0 with too few steps).
pub fn step_gap_p90(entries: &[Entry]) -> f64 {
    let mut last: BTreeMap<u32, f64> = BTreeMap::new();
    let mut gaps: Vec<f64> = Vec::new();
    for e in entries {
        if let Entry::Step { t, rank, .. } = e
            && let Some(prev) = last.insert(*rank, *t)
        {
            gaps.push((t - prev).max(0.0));
        }
    }
    if gaps.len() < 10 {
        return 0.0;
    }
    gaps.sort_by(f64::total_cmp);
    gaps[gaps.len() * 9 / 10]
}

/// Now, as the examples stamp their lines (seconds since the epoch).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Polls the log until `rank` logged a step >= `step`, within `within`; its
/// pid. A job that ends first fails the test with its output.
pub fn wait_step(
    log: &Path,
    rank: u32,
    step: u32,
    jobs: &mut [&mut Streaming],
    within: Duration,
) -> i32 {
    let deadline = Instant::now() + within;
    loop {
        let found = read_log(log).into_iter().find_map(|e| match e {
            Entry::Step {
                n, rank: r, pid, ..
            } if r == rank && n >= step => Some(pid),
            _ => None,
        });
        if let Some(pid) = found {
            return pid;
        }
        for j in jobs.iter_mut() {
            if let Ok(Some(status)) = j.child.try_wait() {
                let label = j.label.clone();
                panic!(
                    "{label} ended ({status}) before rank {rank} reached step {step}\n{}",
                    show(j)
                );
            }
        }
        assert!(
            Instant::now() < deadline,
            "rank {rank} did not reach step {step} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A line every rank prints once per attempt, 600 characters long, that
/// says nothing about a fault: DDP's note on `find_unused_parameters=True`
/// (the examples set it on purpose, see examples/heal/ddp.py).
const NOISE: &str = "find_unused_parameters=True was specified in DDP constructor";

/// What a job printed, for a failure's message, less [`NOISE`]: CI keeps
/// only the head and the tail of a failure's output, and with four of
/// those lines an attempt, the launcher's lines in the middle of a run
/// with several heals were cut.
pub fn show(job: &mut Streaming) -> String {
    job.drain(Duration::from_secs(5));
    job.seen
        .iter()
        .filter(|l| !l.contains(NOISE))
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The longest time from `t` to a rank's first step after it, over ranks
/// `0..world`.
pub fn back_after(entries: &[Entry], t: f64, world: u32, all: &str) -> f64 {
    (0..world)
        .map(|rank| {
            entries
                .iter()
                .find_map(|e| match e {
                    Entry::Step { t: at, rank: r, .. } if *r == rank && *at > t => Some(at - t),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("rank {rank} never stepped after the kill\n{all}"))
        })
        .fold(0.0, f64::max)
}

/// Steps logged after `t` whose number the same rank had logged before
/// `t`: the work redone, in steps (the most over ranks `0..world`).
pub fn redone(entries: &[Entry], t: f64, world: u32) -> u32 {
    (0..world)
        .map(|rank| {
            let before: BTreeSet<u32> = entries
                .iter()
                .filter_map(|e| match e {
                    Entry::Step {
                        t: at, n, rank: r, ..
                    } if *r == rank && *at <= t => Some(*n),
                    _ => None,
                })
                .collect();
            let again: BTreeSet<u32> = entries
                .iter()
                .filter_map(|e| match e {
                    Entry::Step {
                        t: at, n, rank: r, ..
                    } if *r == rank && *at > t && before.contains(n) => Some(*n),
                    _ => None,
                })
                .collect();
            u32::try_from(again.len()).unwrap()
        })
        .max()
        .unwrap_or(0)
}

/// Each rank's pids, as its steps were logged.
pub type Pids = BTreeMap<u32, BTreeSet<i32>>;

/// Each rank's pids, and how often each (rank, step) was logged.
pub fn pids_and_counts(entries: &[Entry]) -> (Pids, BTreeMap<(u32, u32), u32>) {
    let mut pids: Pids = BTreeMap::new();
    let mut times: BTreeMap<(u32, u32), u32> = BTreeMap::new();
    for e in entries {
        if let Entry::Step { n, rank, pid, .. } = e {
            pids.entry(*rank).or_default().insert(*pid);
            *times.entry((*rank, *n)).or_default() += 1;
        }
    }
    (pids, times)
}

/// Fails the test when a rank logged one step number more than twice (the
/// heal redoes at most the step in flight); `all` is the run's output.
pub fn assert_no_step_logged_more_than_twice(times: &BTreeMap<(u32, u32), u32>, all: &str) {
    let worst = times.iter().max_by_key(|(_, c)| **c).unwrap();
    assert!(
        *worst.1 <= 2,
        "rank {} logged step {} {} times\n{all}",
        worst.0.0,
        worst.0.1,
        worst.1
    );
}
