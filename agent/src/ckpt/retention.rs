//! Which shards the local tier may drop: retention and room for new saves.
//!
//! Shards are grouped by the host that saved them (a tier holds its own
//! ranks' shards and peers' replicas). Within a group a step is complete
//! when it holds every rank the group has saved for that job. The newest
//! `keep` complete steps stay, with everything newer (saves in progress);
//! older shards go. Room for a new save is made from the oldest shards that
//! are older than their group's newest complete step, so a restore point is
//! never traded for a save that might not finish.
//!
//! Whatever the groups say, the steps the tier holds complete for the whole
//! job (every rank below the world size, from any origin) are kept: the
//! newest `keep` of them from retention, the newest from eviction. A host
//! whose ranks go on saving while a lost host's replacement has not saved
//! yet would otherwise drop its own shards of the one step the tier holds
//! whole (with the lost host's replicas), and the replacement would find
//! no complete step anywhere and start the job over.

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

/// Per job, its `keep` newest steps held whole in `shards`: a copy of every
/// rank below the step's world size, whatever origin each came from.
fn whole_steps(shards: &[Manifest], keep: usize) -> BTreeSet<(&str, u64)> {
    let mut steps: BTreeMap<(&str, u64), (u32, BTreeSet<u32>)> = BTreeMap::new();
    for m in shards {
        let e = steps.entry((m.job_id.as_str(), m.step)).or_default();
        e.0 = e.0.max(m.world_size);
        e.1.insert(m.rank);
    }
    let mut kept: BTreeMap<&str, usize> = BTreeMap::new();
    steps
        .iter()
        .rev()
        .filter(|(_, (world, ranks))| *world > 0 && (0..*world).all(|r| ranks.contains(&r)))
        .filter(|((job, _), _)| {
            let n = kept.entry(job).or_default();
            *n += 1;
            *n <= keep
        })
        .map(|(k, _)| *k)
        .collect()
}

/// Shards past retention: older than the `keep`-th newest complete step of
/// their group, and not of one of the job's `keep` newest steps held whole.
pub fn expired(shards: &[Manifest], keep: usize) -> Vec<ShardKey> {
    let whole = whole_steps(shards, keep.max(1));
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
                .filter(|m| !whole.contains(&(m.job_id.as_str(), m.step)))
                .map(Manifest::key),
        );
    }
    out
}

/// Shards that may go to make room, oldest step first: everything older
/// than its group's newest complete step.
pub fn evictable(shards: &[Manifest]) -> Vec<(ShardKey, u64)> {
    let whole = whole_steps(shards, 1);
    let mut out = Vec::new();
    for ((job, origin), steps) in groups(shards) {
        let Some(&newest) = complete_steps(&steps).first() else {
            continue;
        };
        out.extend(
            shards
                .iter()
                .filter(|m| m.job_id == job && m.origin == origin && m.step < newest)
                .filter(|m| !whole.contains(&(m.job_id.as_str(), m.step)))
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
    fn the_one_step_held_whole_stays_while_this_host_saves_on() {
        // Step 10 is whole here: host b's replicas of ranks 0 and 1 (b is
        // lost) and this host a's ranks 2 and 3. Host a's ranks go on to
        // 20, 30 and 40 before b's replacement saves anything.
        let mut shards = vec![m(10, 0, "b"), m(10, 1, "b")];
        for step in [10, 20, 30, 40] {
            shards.push(m(step, 2, "a"));
            shards.push(m(step, 3, "a"));
        }
        // By its group alone, a's step 10 would go with keep 2.
        let gone = expired(&shards, 2);
        assert!(
            gone.iter().all(|k| k.step != 10),
            "the only step whole for the job was dropped: {gone:?}"
        );
        assert_eq!(
            gone.iter().map(|k| k.step).collect::<BTreeSet<_>>(),
            BTreeSet::from([20])
        );
        assert!(evictable(&shards).iter().all(|(k, _)| k.step != 10));
    }

    #[test]
    fn nothing_complete_means_nothing_evicted() {
        let shards = vec![m(10, 0, "a"), m(10, 1, "a"), m(20, 0, "a")];
        // Step 10 is complete (ranks 0 and 1); 20 is not.
        assert!(expired(&shards, 1).is_empty());
        assert!(evictable(&shards).is_empty());
    }
}
