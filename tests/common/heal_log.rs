//! The heal examples' log (`$EXAMPLE_LOG` of examples/heal/*.py), as the
//! heal tests on one host and across hosts read it.

use std::collections::BTreeMap;
use std::path::Path;

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
