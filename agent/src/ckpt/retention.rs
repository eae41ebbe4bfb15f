//! Which shards the local tier may drop: retention and room for new saves.
//!
//! Shards are grouped by the host that saved them (a tier holds its own
//! ranks' shards and peers' replicas). Within a group a step is complete
//! when it holds every rank the group has saved for that job. The newest
//! `keep` complete steps stay, with everything newer (saves in progress);
//! older shards go. Room for a new save is made from the oldest shards that
//! are older than their group's newest complete step, so a restore point is
//! never traded for a save that might not finish.

use std::collections::{BTreeMap, BTreeSet};

use super::layout::ShardKey;
use super::manifest::Manifest;

/// Per (job, origin): its steps and the ranks in each.
fn groups(shards: &[Manifest]) -> BTreeMap<(&str, &str), BTreeMap<u64, BTreeSet<u32>>> {
    let mut g: BTreeMap<(&str, &str), BTreeMap<u64, BTreeSet<u32>>> = BTreeMap::new();
    for m in shards {
        g.entry((m.job_id.as_str(), m.origin.as_str()))
            .or_default()
            .entry(m.step)
            .or_default()
            .insert(m.rank);
    }
    g
}

/// Complete steps of one group, newest first.
fn complete_steps(steps: &BTreeMap<u64, BTreeSet<u32>>) -> Vec<u64> {
    let all: BTreeSet<u32> = steps.values().flatten().copied().collect();
    steps
        .iter()
        .rev()
        .filter(|(_, ranks)| **ranks == all)
        .map(|(s, _)| *s)
        .collect()
}

/// Shards past retention: older than the `keep`-th newest complete step of
/// their group.
pub fn expired(shards: &[Manifest], keep: usize) -> Vec<ShardKey> {
    let mut out = Vec::new();
    for ((job, origin), steps) in groups(shards) {
        let complete = complete_steps(&steps);
        let Some(&oldest_kept) = complete.get(keep.saturating_sub(1)) else {
            continue;
        };
        out.extend(
            shards
                .iter()
                .filter(|m| m.job_id == job && m.origin == origin && m.step < oldest_kept)
                .map(Manifest::key),
        );
    }
    out
}

/// Shards that may go to make room, oldest step first: everything older
/// than its group's newest complete step.
pub fn evictable(shards: &[Manifest]) -> Vec<(ShardKey, u64)> {
    let mut out = Vec::new();
    for ((job, origin), steps) in groups(shards) {
        let Some(&newest) = complete_steps(&steps).first() else {
            continue;
        };
        out.extend(
            shards
                .iter()
                .filter(|m| m.job_id == job && m.origin == origin && m.step < newest)
                .map(|m| (m.key(), m.size_bytes)),
        );
    }
    out.sort_by(|a, b| a.0.step.cmp(&b.0.step).then_with(|| a.0.cmp(&b.0)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(step: u64, rank: u32, origin: &str) -> Manifest {
        Manifest {
            job_id: "j".into(),
            step,
            rank,
            world_size: 4,
            size_bytes: 10,
            xxh3: "0".repeat(16),
            origin: origin.into(),
            committed_unix: 0,
        }
    }

    #[test]
    fn keeps_the_newest_complete_steps_and_saves_in_progress() {
        // Host a saves ranks 0 and 1; step 40 is half written.
        let shards = vec![
            m(10, 0, "a"),
            m(10, 1, "a"),
            m(20, 0, "a"),
            m(20, 1, "a"),
            m(30, 0, "a"),
            m(30, 1, "a"),
            m(40, 0, "a"),
        ];
        let gone = expired(&shards, 2);
        let steps: BTreeSet<u64> = gone.iter().map(|k| k.step).collect();
        assert_eq!(steps, BTreeSet::from([10]));
        // Room: everything older than step 30, oldest first; never 30 or 40.
        let ev: Vec<u64> = evictable(&shards).iter().map(|(k, _)| k.step).collect();
        assert_eq!(ev, vec![10, 10, 20, 20]);
    }

    #[test]
    fn replicas_are_judged_by_their_own_origin() {
        // Host b's replica of its rank 2 at step 10 only: complete for b.
        let shards = vec![m(10, 0, "a"), m(20, 0, "a"), m(10, 2, "b")];
        let gone = expired(&shards, 1);
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].step, gone[0].rank), (10, 0));
        assert!(evictable(&shards).iter().all(|(k, _)| k.rank != 2));
    }

    #[test]
    fn nothing_complete_means_nothing_evicted() {
        let shards = vec![m(10, 0, "a"), m(10, 1, "a"), m(20, 0, "a")];
        // Step 10 is complete (ranks 0 and 1); 20 is not.
        assert!(expired(&shards, 1).is_empty());
        assert!(evictable(&shards).is_empty());
    }
}
