//! Whom to blame for a hang that spans hosts: the job-wide verdict.
//!
//! When a collective hangs, every rank that reached it waits, and each
//! agent sees only that its own ranks wait. The culprit is the rank that
//! did not get there: frozen (stopped), behind by steps, in another section
//! than the rest, or behind in a process group's collective sequence (from
//! torch's flight recorder). Each agent snapshots where its ranks stood
//! when it found the hang, the agents exchange the snapshots, and each
//! judges the whole job with [`judge`]: both sides of a hang name the same
//! culprit, the culprit's host is charged and the others record that they
//! waited on it.
//!
//! In: one [`Position`] per rank (any host), the job's world size.
//! Out: a [`HangJudgement`] naming culprits with a sentence of evidence each,
//! the ranks that waited, and the ranks nobody reported.
//! Never: I/O; guess when the positions do not tell (ranks split evenly
//! between two places name no culprit).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Most positions one job's verdict reads (bounds a peer's say).
pub const MAX_POSITIONS: usize = 65_536;
/// Most process groups one position carries.
pub const MAX_GROUPS: usize = 64;
/// Longest section, state or group name kept from a peer.
pub const MAX_NAME: usize = 256;
/// Most unreported ranks blamed by name; past it they are only counted.
pub const MAX_MISSING_BLAMED: usize = 64;

/// A rank's place in one process group's collective sequence, from the
/// flight recorder of torch (`pg_status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSeq {
    /// The process group ("0:default_pg").
    pub group: String,
    /// The newest collective the rank enqueued on it (its sequence number).
    pub enqueued: u64,
    /// The oldest collective not completed, for a person ("gloo:all_reduce #42").
    pub pending: String,
}

/// Where one rank stood when its agent looked.
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    /// The agent (host) that owns the rank.
    pub host: String,
    /// Global rank.
    pub rank: u32,
    /// The step it was at.
    pub step: u64,
    /// The section it was in ("step" when it marks none).
    pub section: String,
    /// Whether it had made no progress past its threshold.
    pub stalled: bool,
    /// Milliseconds without progress.
    pub stalled_ms: u64,
    /// Its process state as /proc shows it ("T (stopped)"); empty when not
    /// read.
    pub process_state: String,
    /// Its collective sequence per process group, when the flight recorder
    /// was read.
    pub groups: Vec<GroupSeq>,
}

impl Position {
    /// Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it cannot run.
    pub fn frozen(&self) -> bool {
        self.process_state.starts_with('T') || self.process_state.starts_with('t')
    }
}

pub use crate::verdict::Blame;

/// The job-wide verdict on a hang.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HangJudgement {
    /// The ranks that held the others up, most certain first.
    pub culprits: Vec<Blame>,
    /// The ranks that waited on them.
    pub waiting: Vec<u32>,
    /// Ranks below the world size that no agent reported.
    pub missing: Vec<u32>,
    /// Hosts whose positions were read.
    pub hosts: Vec<String>,
    /// One sentence for a person.
    pub summary: String,
}

impl HangJudgement {
    /// The culprits on `host`.
    pub fn culprits_on<'a>(&'a self, host: &'a str) -> impl Iterator<Item = &'a Blame> + 'a {
        self.culprits.iter().filter(move |b| b.host == host)
    }

    /// `rank 3 on host-b, rank 5 on host-c`, for a waiter's record.
    pub fn culprit_names(&self) -> Vec<String> {
        self.culprits.iter().map(Blame::name).collect()
    }
}

/// A compact list of ranks: "0-2,5".
pub fn ranks_list(ranks: &[u32]) -> String {
    let mut sorted: Vec<u32> = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if end == start {
            let _ = write!(out, "{start}");
        } else {
            let _ = write!(out, "{start}-{end}");
        }
        i += 1;
    }
    out
}

/// Judges a job's hang from its ranks' positions (one per rank; a later
/// duplicate of a rank is ignored) and its world size (0: unknown). See the
/// module doc for the rules; their order is their strength: a frozen
/// process, then the flight recorder's sequence numbers, then steps, then
/// sections.
pub fn judge(positions: &[Position], world_size: u32) -> HangJudgement {
    let mut by_rank: BTreeMap<u32, &Position> = BTreeMap::new();
    for p in positions.iter().take(MAX_POSITIONS) {
        by_rank.entry(p.rank).or_insert(p);
    }
    let hosts: Vec<String> = by_rank
        .values()
        .map(|p| p.host.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let missing: Vec<u32> = (0..world_size.min(MAX_POSITIONS as u32))
        .filter(|r| !by_rank.contains_key(r))
        .collect();
    let mut culprits: Vec<Blame> = Vec::new();
    let blamed = |c: &Vec<Blame>, r: u32| c.iter().any(|b| b.rank == r);

    // 1. A process that cannot run holds every collective it is part of.
    for p in by_rank.values().filter(|p| p.frozen()) {
        culprits.push(Blame {
            rank: p.rank,
            host: p.host.clone(),
            why: format!(
                "its process is stopped ({}: SIGSTOP, a debugger or a tracer) at step {} in '{}'",
                p.process_state, p.step, p.section
            ),
        });
    }

    // 2. The flight recorder: behind in a process group's sequence.
    for b in behind_in_groups(&by_rank) {
        if !blamed(&culprits, b.rank) {
            culprits.push(b);
        }
    }

    // 3. Behind by steps: ranks of a data-parallel job meet every step.
    let top = by_rank.values().map(|p| p.step).max().unwrap_or(0);
    let at_top: Vec<u32> = by_rank
        .values()
        .filter(|p| p.step == top)
        .map(|p| p.rank)
        .collect();
    for p in by_rank.values().filter(|p| p.step < top) {
        if !blamed(&culprits, p.rank) {
            culprits.push(Blame {
                rank: p.rank,
                host: p.host.clone(),
                why: format!(
                    "behind: at step {} in '{}' while ranks {} reached step {top}",
                    p.step,
                    p.section,
                    ranks_list(&at_top)
                ),
            });
        }
    }

    // 4. At the newest step, the ranks outside the place most ranks wait.
    let mut places: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for p in by_rank.values().filter(|p| p.step == top) {
        places.entry(p.section.as_str()).or_default().push(p.rank);
    }
    let mut split = false;
    if places.len() > 1 {
        let most = places.values().map(Vec::len).max().unwrap_or(0);
        let crowded: Vec<&str> = places
            .iter()
            .filter(|(_, r)| r.len() == most)
            .map(|(s, _)| *s)
            .collect();
        if let [wait] = crowded.as_slice() {
            let waiters = &places[wait];
            for p in by_rank
                .values()
                .filter(|p| p.step == top && p.section != *wait)
            {
                if !blamed(&culprits, p.rank) {
                    culprits.push(Blame {
                        rank: p.rank,
                        host: p.host.clone(),
                        why: format!(
                            "in '{}' at step {top} while ranks {} wait in '{wait}'",
                            p.section,
                            ranks_list(waiters)
                        ),
                    });
                }
            }
        } else {
            split = true;
        }
    }

    // 5. Nobody reported these ranks: when everyone else waits, they are
    // where the job is stuck.
    if culprits.is_empty()
        && !missing.is_empty()
        && missing.len() <= MAX_MISSING_BLAMED
        && !by_rank.is_empty()
    {
        for &r in &missing {
            culprits.push(Blame {
                rank: r,
                host: String::new(),
                why: "no agent reported this rank, while every rank reported waits".into(),
            });
        }
    }

    let waiting: Vec<u32> = by_rank
        .keys()
        .copied()
        .filter(|r| !blamed(&culprits, *r))
        .collect();
    let summary = summarise(&culprits, &waiting, &missing, &places, top, split);
    HangJudgement {
        culprits,
        waiting,
        missing,
        hosts,
        summary,
    }
}

/// Ranks whose newest enqueued collective on a group is older than the
/// newest any rank of that group enqueued.
fn behind_in_groups(by_rank: &BTreeMap<u32, &Position>) -> Vec<Blame> {
    let mut groups: BTreeMap<&str, Vec<(u32, &GroupSeq)>> = BTreeMap::new();
    for p in by_rank.values() {
        for g in p.groups.iter().take(MAX_GROUPS) {
            groups
                .entry(g.group.as_str())
                .or_default()
                .push((p.rank, g));
        }
    }
    let mut out: Vec<Blame> = Vec::new();
    for (group, members) in groups {
        let Some(top) = members.iter().map(|(_, g)| g.enqueued).max() else {
            continue;
        };
        let ahead: Vec<u32> = members
            .iter()
            .filter(|(_, g)| g.enqueued == top)
            .map(|(r, _)| *r)
            .collect();
        let pending = members
            .iter()
            .find(|(_, g)| g.enqueued == top && !g.pending.is_empty())
            .map(|(_, g)| format!(" ({})", g.pending))
            .unwrap_or_default();
        for (rank, g) in members.iter().filter(|(_, g)| g.enqueued < top) {
            if out.iter().any(|b| b.rank == *rank) {
                continue;
            }
            let host = by_rank
                .get(rank)
                .map(|p| p.host.clone())
                .unwrap_or_default();
            out.push(Blame {
                rank: *rank,
                host,
                why: format!(
                    "flight recorder: enqueued collective #{} on process group {group} while ranks {} are at #{top}{pending}",
                    g.enqueued,
                    ranks_list(&ahead)
                ),
            });
        }
    }
    out
}

fn summarise(
    culprits: &[Blame],
    waiting: &[u32],
    missing: &[u32],
    places: &BTreeMap<&str, Vec<u32>>,
    top: u64,
    split: bool,
) -> String {
    let mut s = if culprits.is_empty() {
        if split {
            let where_: Vec<String> = places
                .iter()
                .map(|(sec, r)| format!("ranks {} in '{sec}'", ranks_list(r)))
                .collect();
            format!(
                "no culprit: at step {top} the ranks are split evenly ({})",
                where_.join(", ")
            )
        } else if let Some((sec, _)) = places.iter().next() {
            format!(
                "no rank is behind: all {} ranks wait at step {top} in '{sec}'; the collective itself (network, NCCL, a fault shared by every rank) is suspect",
                waiting.len()
            )
        } else {
            "no positions to judge".to_owned()
        }
    } else {
        let named: Vec<String> = culprits
            .iter()
            .map(|b| {
                if b.host.is_empty() {
                    format!("rank {} ({})", b.rank, b.why)
                } else {
                    format!("rank {} on {} ({})", b.rank, b.host, b.why)
                }
            })
            .collect();
        format!(
            "{} held up the job; ranks {} waited",
            named.join("; "),
            if waiting.is_empty() {
                "none".to_owned()
            } else {
                ranks_list(waiting)
            }
        )
    };
    if !missing.is_empty() && !culprits.iter().any(|b| b.host.is_empty()) {
        if missing.len() > MAX_MISSING_BLAMED {
            let _ = write!(s, "; no position from {} ranks", missing.len());
        } else {
            let _ = write!(s, "; no position from ranks {}", ranks_list(missing));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pos(host: &str, rank: u32, step: u64, section: &str) -> Position {
        Position {
            host: host.into(),
            rank,
            step,
            section: section.into(),
            stalled: true,
            stalled_ms: 5000,
            process_state: "S (sleeping)".into(),
            groups: Vec::new(),
        }
    }

    #[test]
    fn the_rank_in_compute_is_named_and_the_waiters_listed() {
        let v = judge(
            &[
                pos("a", 0, 12, "allreduce"),
                pos("a", 1, 12, "compute"),
                pos("b", 2, 12, "allreduce"),
                pos("b", 3, 12, "allreduce"),
            ],
            4,
        );
        assert_eq!(v.culprits.len(), 1, "{v:?}");
        assert_eq!((v.culprits[0].rank, v.culprits[0].host.as_str()), (1, "a"));
        assert!(
            v.culprits[0]
                .why
                .contains("in 'compute' at step 12 while ranks 0,2-3 wait in 'allreduce'"),
            "{v:?}"
        );
        assert_eq!(v.waiting, [0, 2, 3]);
        assert_eq!(v.hosts, ["a", "b"]);
        assert_eq!(v.culprits_on("b").count(), 0);
        assert_eq!(v.culprit_names(), ["rank 1 on a"]);
    }

    #[test]
    fn a_stopped_process_is_named_first_wherever_it_stood() {
        let mut frozen = pos("b", 3, 12, "allreduce");
        frozen.process_state = "T (stopped)".into();
        let v = judge(
            &[
                pos("a", 0, 12, "allreduce"),
                pos("a", 1, 12, "allreduce"),
                pos("b", 2, 12, "allreduce"),
                frozen,
            ],
            4,
        );
        assert_eq!(v.culprits.len(), 1, "{v:?}");
        assert_eq!(v.culprits[0].rank, 3);
        assert!(v.culprits[0].why.contains("stopped"), "{v:?}");
    }

    #[test]
    fn ranks_behind_by_steps_are_named() {
        let v = judge(
            &[
                pos("a", 0, 12, "step"),
                pos("a", 1, 11, "step"),
                pos("b", 2, 12, "step"),
            ],
            3,
        );
        assert_eq!(v.culprits.len(), 1, "{v:?}");
        assert!(v.culprits[0].why.starts_with("behind: at step 11"), "{v:?}");
    }

    #[test]
    fn the_flight_recorder_outranks_sections() {
        let seq = |n: u64| GroupSeq {
            group: "0:default_pg".into(),
            enqueued: n,
            pending: format!("gloo:all_reduce #{n}"),
        };
        let mut ps = vec![
            pos("a", 0, 12, "step"),
            pos("a", 1, 12, "step"),
            pos("b", 2, 12, "step"),
            pos("b", 3, 12, "step"),
        ];
        for (i, p) in ps.iter_mut().enumerate() {
            p.groups = vec![seq(if i == 2 { 41 } else { 42 })];
        }
        let v = judge(&ps, 4);
        assert_eq!(v.culprits.len(), 1, "{v:?}");
        assert_eq!(v.culprits[0].rank, 2);
        assert!(
            v.culprits[0]
                .why
                .contains("#41 on process group 0:default_pg while ranks 0-1,3 are at #42 (gloo:all_reduce #42)"),
            "{v:?}"
        );
    }

    #[test]
    fn everyone_in_one_place_names_no_one_and_says_so() {
        let v = judge(
            &[pos("a", 0, 5, "allreduce"), pos("b", 1, 5, "allreduce")],
            2,
        );
        assert!(v.culprits.is_empty(), "{v:?}");
        assert!(v.summary.contains("no rank is behind"), "{v:?}");
    }

    #[test]
    fn an_even_split_names_no_one() {
        let v = judge(
            &[
                pos("a", 0, 5, "forward"),
                pos("a", 1, 5, "forward"),
                pos("b", 2, 5, "allreduce"),
                pos("b", 3, 5, "allreduce"),
            ],
            4,
        );
        assert!(v.culprits.is_empty(), "{v:?}");
        assert!(v.summary.contains("split evenly"), "{v:?}");
    }

    #[test]
    fn unreported_ranks_are_the_suspects_when_the_rest_wait() {
        let v = judge(
            &[pos("a", 0, 5, "allreduce"), pos("a", 1, 5, "allreduce")],
            4,
        );
        assert_eq!(
            v.culprits.iter().map(|b| b.rank).collect::<Vec<_>>(),
            [2, 3]
        );
        assert_eq!(v.missing, [2, 3]);
        assert_eq!(v.culprit_names(), ["rank 2", "rank 3"]);
        // With a culprit found, the missing ones are only mentioned.
        let v = judge(&[pos("a", 0, 5, "allreduce"), pos("a", 1, 4, "step")], 3);
        assert_eq!(v.culprits.len(), 1);
        assert!(v.summary.ends_with("no position from ranks 2"), "{v:?}");
    }

    #[test]
    fn duplicates_and_huge_world_sizes_are_bounded() {
        let v = judge(&[pos("a", 0, 5, "x"), pos("evil", 0, 1, "y")], u32::MAX);
        assert_eq!(v.hosts, ["a"]);
        assert_eq!(v.missing.len(), MAX_POSITIONS - 1);
        assert!(v.culprits.is_empty(), "{v:?}");
        assert!(v.summary.ends_with("no position from 65535 ranks"), "{v:?}");
    }

    #[test]
    fn rank_lists_are_compact() {
        assert_eq!(ranks_list(&[5, 0, 1, 2, 7, 8]), "0-2,5,7-8");
        assert_eq!(ranks_list(&[]), "");
    }
}
