//! What the hosts of a job hold, as the restore's collector counts it
//! ([`super::collect`]): per step, which ranks have a copy, on which hosts,
//! and each shard's size, without the copies' other descriptions (a host
//! that restores lists the few holders of its own rank itself).
//!
//! In: listings of hosts' tiers, or other collections. Out: a group's
//! holdings (every rank with a copy in the group), and the job's view for
//! some ranks (one host's, restoring at once): each step's world size, how many ranks have a copy anywhere,
//! the first that have none, its copies and bytes ([`Tally`], what a
//! summary listing of a large job shows: `super::listing`), and where the
//! ranks' copies are. Never: trusts
//! a peer's collection before [`Holdings::check`] has bounded it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::manifest::Manifest;
use warden_core::rank::MAX_WORLD_SIZE;

/// The most ranks a step's view names as missing (the first ones).
pub const MAX_MISSING: usize = 64;

/// The most hosts a peer's collection may name: a group's hosts, at most
/// `checkpoint.collect_fan_out`'s bound.
pub const MAX_HOSTS: usize = 65_536;

/// The most steps a peer's collection may carry.
pub const MAX_STEPS: usize = 4_096;

/// The most ranks one ask for the job's view may name: a host's ranks
/// restoring at once (8 a host, 16 at most on today's nodes), or a listing
/// of a host's own ranks (`super::listing`). Past it, each rank asks alone.
pub const MAX_VIEW_RANKS: usize = 64;

/// The holder address under which a collection counts the durable store's
/// copies (not `host:port`, so never a peer's): a step every rank of which
/// is in the store, or on some host, is complete. A restoring host reads
/// its own rank's manifest from the store itself.
pub const DURABLE: &str = "durable";

/// One host holding copies: its address and host name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderRef {
    /// `host:port`.
    pub addr: String,
    /// Its `agent.host_name`.
    pub host: String,
}

/// One step of a collection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepHoldings {
    /// What its shards say (the largest, should they disagree).
    pub world: u32,
    /// Each rank with a copy, and its holders (indices into
    /// [`Holdings::hosts`]).
    pub ranks: BTreeMap<u32, Vec<u32>>,
    /// Each rank's shard size, where a holder listed it (an older agent's
    /// group answer and the durable store's names do not).
    pub sizes: BTreeMap<u32, u64>,
}

/// A collection: what a set of hosts holds of one job.
#[derive(Debug, Clone, Default)]
pub struct Holdings {
    /// The holders `steps` refers to.
    pub hosts: Vec<HolderRef>,
    by_addr: HashMap<String, u32>,
    /// Step -> what is held of it.
    pub steps: BTreeMap<u64, StepHoldings>,
    /// Hosts that could not be asked, with why.
    pub unreachable: Vec<String>,
}

impl Holdings {
    /// The index of the holder at `addr` (added the first time).
    pub fn host(&mut self, addr: &str, host: &str) -> u32 {
        if let Some(&i) = self.by_addr.get(addr) {
            return i;
        }
        let i = self.hosts.len() as u32;
        self.hosts.push(HolderRef {
            addr: addr.to_owned(),
            host: host.to_owned(),
        });
        self.by_addr.insert(addr.to_owned(), i);
        i
    }

    /// Records that holder `h` has a copy of `rank` at `step`.
    pub fn add(&mut self, h: u32, step: u64, rank: u32, world: u32) {
        self.add_sized(h, step, rank, world, 0);
    }

    /// [`Holdings::add`], of `size` bytes (0: not said).
    pub fn add_sized(&mut self, h: u32, step: u64, rank: u32, world: u32, size: u64) {
        let s = self.steps.entry(step).or_default();
        s.world = s.world.max(world);
        let hs = s.ranks.entry(rank).or_default();
        if !hs.contains(&h) {
            hs.push(h);
        }
        if size > 0 {
            s.sizes.entry(rank).or_insert(size);
        }
    }

    /// Adds what the host at `addr` (named `host`) listed of `job`.
    pub fn add_listing<'a>(
        &mut self,
        addr: &str,
        host: &str,
        job: &str,
        shards: impl IntoIterator<Item = &'a Manifest>,
    ) {
        let h = self.host(addr, host);
        for m in shards.into_iter().filter(|m| m.job_id == job) {
            self.add_sized(h, m.step, m.rank, m.world_size, m.size_bytes);
        }
    }

    /// Adds the durable store's `(step, world size, ranks)` ([`DURABLE`],
    /// named by `url`).
    pub fn add_durable(&mut self, url: &str, steps: Vec<(u64, u32, Vec<u32>)>) {
        let h = self.host(DURABLE, url);
        for (step, world, ranks) in steps {
            for rank in ranks {
                self.add(h, step, rank, world);
            }
        }
    }

    /// Whether the host at `addr` was listed here, or named unreachable.
    pub fn accounts_for(&self, addr: &str) -> bool {
        self.by_addr.contains_key(addr)
            || self.unreachable.iter().any(|u| {
                u.strip_prefix("peer ")
                    .unwrap_or(u)
                    .starts_with(&format!("{addr}:"))
            })
    }

    /// Adds another collection (its holder indices renumbered).
    pub fn merge(&mut self, other: Holdings) {
        let map: Vec<u32> = other
            .hosts
            .iter()
            .map(|r| self.host(&r.addr, &r.host))
            .collect();
        for (step, s) in other.steps {
            for (rank, hs) in s.ranks {
                let size = s.sizes.get(&rank).copied().unwrap_or(0);
                for h in hs {
                    if let Some(&mine) = map.get(h as usize) {
                        self.add_sized(mine, step, rank, s.world, size);
                    }
                }
            }
        }
        self.unreachable.extend(other.unreachable);
    }

    /// Whether a peer's collection stays within bounds: the hosts, steps,
    /// world sizes and ranks it names, and every holder index among its
    /// hosts. The error names what was out of range.
    pub fn check(&self) -> Result<(), String> {
        if self.hosts.len() > MAX_HOSTS {
            return Err(format!("{} hosts; at most {MAX_HOSTS}", self.hosts.len()));
        }
        if self.steps.len() > MAX_STEPS {
            return Err(format!("{} steps; at most {MAX_STEPS}", self.steps.len()));
        }
        for (step, s) in &self.steps {
            if s.world > MAX_WORLD_SIZE {
                return Err(format!(
                    "step {step}: world size {}; at most {MAX_WORLD_SIZE}",
                    s.world
                ));
            }
            for (rank, hs) in &s.ranks {
                if *rank >= MAX_WORLD_SIZE {
                    return Err(format!("step {step}: rank {rank}; below {MAX_WORLD_SIZE}"));
                }
                if let Some(h) = hs.iter().find(|&&h| h as usize >= self.hosts.len()) {
                    return Err(format!(
                        "step {step} rank {rank}: holder {h} of {} hosts",
                        self.hosts.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// The job's view for `ranks`: every step's count, and the ranks'
    /// holders (one ask; a collector answering many counts once:
    /// [`Counted`]).
    pub fn for_ranks(&self, ranks: &[u32]) -> JobView {
        view(self, &counts(self), ranks)
    }
}

/// One step's count over the job: its world size, the ranks below it with
/// a copy, and the first without ([`MAX_MISSING`] at most).
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepCount {
    world: u32,
    present: u32,
    missing: Vec<u32>,
    tally: Tally,
}

/// A step's copies and bytes over the job (its ranks below the world
/// size), as a summary listing shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Copies over every holder, the durable store included.
    pub copies: u64,
    /// The sum of the shard sizes that a holder listed.
    pub size_bytes: u64,
    /// How many ranks `size_bytes` adds up.
    pub sized_ranks: u32,
}

/// A finished collection with each step's count taken once. A collector
/// answers every restoring rank of the job from one collection; counting
/// per answer walked the whole world size for each step (at 100,000 ranks
/// and five steps, half a million lookups an ask, 5 * 10^10 a job-wide
/// wave). Here an answer is O(steps * the rank's holders).
#[derive(Debug, Clone, Default)]
pub struct Counted {
    holdings: Holdings,
    counts: BTreeMap<u64, StepCount>,
}

impl Counted {
    /// Counts `holdings`' steps.
    pub fn new(holdings: Holdings) -> Self {
        let counts = counts(&holdings);
        Self { holdings, counts }
    }

    /// The job's view for `ranks`: every step's count, and their holders.
    pub fn for_ranks(&self, ranks: &[u32]) -> JobView {
        view(&self.holdings, &self.counts, ranks)
    }
}

/// Each step's count over the job.
fn counts(h: &Holdings) -> BTreeMap<u64, StepCount> {
    h.steps
        .iter()
        .map(|(&step, s)| {
            let present = s.ranks.range(..s.world).count() as u32;
            let mut tally = Tally::default();
            for (r, hs) in s.ranks.range(..s.world) {
                tally.copies += hs.len() as u64;
                if let Some(&size) = s.sizes.get(r) {
                    tally.size_bytes = tally.size_bytes.saturating_add(size);
                    tally.sized_ranks += 1;
                }
            }
            // The first ranks without a copy: walked only as far as the
            // gaps go (through every rank only when the step is whole).
            let mut missing = Vec::new();
            let mut next = 0u32;
            for &r in s.ranks.range(..s.world).map(|(r, _)| r) {
                while next < r && missing.len() < MAX_MISSING {
                    missing.push(next);
                    next += 1;
                }
                if missing.len() >= MAX_MISSING {
                    break;
                }
                next = r + 1;
            }
            while next < s.world && missing.len() < MAX_MISSING {
                missing.push(next);
                next += 1;
            }
            let count = StepCount {
                world: s.world,
                present,
                missing,
                tally,
            };
            (step, count)
        })
        .collect()
}

/// The job's view for `ranks` from `h` and its steps' `counts`.
fn view(h: &Holdings, counts: &BTreeMap<u64, StepCount>, ranks: &[u32]) -> JobView {
    let steps = h
        .steps
        .iter()
        .filter_map(|(step, s)| Some((step, s, counts.get(step)?)))
        .map(|(&step, s, c)| {
            let holders = ranks
                .iter()
                .filter_map(|r| Some((*r, s.ranks.get(r)?)))
                .map(|(r, hs)| {
                    let refs = hs.iter().filter_map(|&i| h.hosts.get(i as usize).cloned());
                    (r, refs.collect())
                })
                .collect();
            (
                step,
                JobStep {
                    world: c.world,
                    present: c.present,
                    missing: c.missing.clone(),
                    holders,
                    tally: Some(c.tally),
                },
            )
        })
        .collect();
    JobView {
        steps,
        unreachable: h.unreachable.clone(),
        ranks: ranks.iter().copied().collect(),
    }
}

/// One step of the job as a restoring rank sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStep {
    /// The step's world size.
    pub world: u32,
    /// Ranks below `world` with a copy somewhere.
    pub present: u32,
    /// The first ranks with none ([`MAX_MISSING`] at most).
    pub missing: Vec<u32>,
    /// The hosts holding each asked rank's copies (a rank without any is
    /// not in it).
    pub holders: BTreeMap<u32, Vec<HolderRef>>,
    /// Its copies and bytes; `None` from an older agent, which does not
    /// count them.
    pub tally: Option<Tally>,
}

impl JobStep {
    /// Every rank below the world size has a copy.
    pub fn complete(&self) -> bool {
        self.world > 0 && self.present >= self.world
    }
}

/// The job's view for some ranks ([`Holdings::for_ranks`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobView {
    /// Step -> its count and the rank's holders.
    pub steps: BTreeMap<u64, JobStep>,
    /// Hosts that could not be asked, with why.
    pub unreachable: Vec<String>,
    /// The ranks whose holders `steps` name: those asked, or fewer where
    /// an older agent answered (it answers for the first alone).
    pub ranks: BTreeSet<u32>,
}

impl JobView {
    /// Whether a peer's view stays within bounds (steps, world sizes, the
    /// counts and the ranks named); the error names what was out of range.
    pub fn check(&self) -> Result<(), String> {
        if self.steps.len() > MAX_STEPS {
            return Err(format!("{} steps; at most {MAX_STEPS}", self.steps.len()));
        }
        for (step, s) in &self.steps {
            if s.world > MAX_WORLD_SIZE || s.present > s.world {
                return Err(format!(
                    "step {step}: {} of world size {} present; at most {MAX_WORLD_SIZE}",
                    s.present, s.world
                ));
            }
            if let Some(t) = s.tally.filter(|t| t.sized_ranks > s.present) {
                return Err(format!(
                    "step {step}: {} ranks sized of {} present",
                    t.sized_ranks, s.present
                ));
            }
            let named: usize = s.holders.values().map(Vec::len).sum();
            if s.missing.len() > MAX_MISSING || named > MAX_HOSTS {
                return Err(format!(
                    "step {step}: {} missing and {named} holders named",
                    s.missing.len(),
                ));
            }
            if let Some(r) = s.holders.keys().find(|r| !self.ranks.contains(r)) {
                return Err(format!("step {step}: holders of rank {r}, not answered"));
            }
        }
        if self.ranks.len() > MAX_VIEW_RANKS {
            return Err(format!(
                "{} ranks answered; at most {MAX_VIEW_RANKS}",
                self.ranks.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(job: &str, step: u64, rank: u32, world: u32) -> Manifest {
        Manifest {
            job_id: job.to_owned(),
            step,
            rank,
            world_size: world,
            size_bytes: 100 + u64::from(rank),
            xxh3: "0".into(),
            origin: "o".into(),
            committed_unix: 0,
        }
    }

    #[test]
    fn groups_merge_into_the_jobs_view_of_one_rank() {
        // Group A: a holds ranks 0, 1 of step 5 and 7; b holds 2 and a's
        // replica of rank 0.
        let mut a = Holdings::default();
        a.add_listing(
            "a:1",
            "ha",
            "j",
            &[m("j", 5, 0, 4), m("j", 5, 1, 4), m("j", 7, 0, 4)],
        );
        a.add_listing(
            "b:1",
            "hb",
            "j",
            &[m("j", 5, 2, 4), m("j", 5, 0, 4), m("x", 5, 3, 4)],
        );
        // Group B: c holds rank 3 of step 5, and b (again) rank 2's replica.
        let mut b = Holdings::default();
        b.add_listing("c:1", "hc", "j", &[m("j", 5, 3, 4)]);
        b.add_listing("b:1", "hb", "j", &[m("j", 5, 2, 4)]);
        b.unreachable.push("d:1: no answer".into());
        a.merge(b);
        a.check().expect("in bounds");
        let v = a.for_ranks(&[0]);
        let s5 = &v.steps[&5];
        assert!(s5.complete(), "{s5:?}");
        let addrs = |s: &JobStep, r| {
            s.holders
                .get(&r)
                .into_iter()
                .flatten()
                .map(|h| h.addr.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(addrs(s5, 0), ["a:1", "b:1"]);
        assert_eq!(s5.holders.len(), 1, "rank 0's holders alone");
        // Several ranks in one ask: each one's holders, the same counts;
        // a rank without a copy at a step is answered, with none.
        let w = a.for_ranks(&[0, 2, 3]);
        assert_eq!(w.ranks, [0, 2, 3].into());
        assert_eq!(addrs(&w.steps[&5], 2), ["b:1"]);
        assert_eq!(addrs(&w.steps[&5], 3), ["c:1"]);
        assert_eq!(addrs(&w.steps[&7], 0), ["a:1"]);
        assert!(addrs(&w.steps[&7], 2).is_empty());
        assert_eq!(w.steps[&5].present, s5.present);
        w.check().expect("in bounds");
        let s7 = &v.steps[&7];
        assert!(!s7.complete());
        assert_eq!((s7.present, s7.missing.clone()), (1, vec![1, 2, 3]));
        assert_eq!(v.unreachable, ["d:1: no answer"]);
        // Copies and bytes: ranks 0 (on a and b), 1, 2 (b, in both groups:
        // one copy) and 3; at step 7 rank 0 alone.
        let tally = |copies, size_bytes, sized_ranks| {
            Some(Tally {
                copies,
                size_bytes,
                sized_ranks,
            })
        };
        assert_eq!(s5.tally, tally(5, 100 + 101 + 102 + 103, 4));
        assert_eq!(s7.tally, tally(1, 100, 1));
        // Another job's shard (x) is not counted; b is one host, once.
        assert_eq!(a.hosts.len(), 3);
        assert_eq!(v.steps[&5].present, 4);
        assert_eq!(a.steps[&5].ranks[&2], vec![1]);
    }

    #[test]
    fn a_peers_collection_out_of_bounds_is_refused_naming_it() {
        let mut h = Holdings::default();
        let i = h.host("a:1", "ha");
        h.add(i, 5, 0, 4);
        h.steps.get_mut(&5).expect("step").ranks.insert(1, vec![9]);
        assert!(
            h.check()
                .expect_err("holder 9")
                .contains("holder 9 of 1 hosts")
        );
        let mut h = Holdings::default();
        h.add(0, 5, MAX_WORLD_SIZE, 4);
        h.host("a:1", "ha");
        assert!(h.check().expect_err("rank").contains("rank 16777216"));
        let mut v = JobView::default();
        v.steps.insert(
            1,
            JobStep {
                world: 2,
                present: 3,
                missing: vec![],
                holders: BTreeMap::new(),
                tally: None,
            },
        );
        assert!(
            v.check()
                .expect_err("present")
                .contains("3 of world size 2")
        );
        // Holders of a rank the view does not say it answered, and more
        // ranks answered than an ask may name.
        let s = v.steps.get_mut(&1).expect("step");
        s.present = 2;
        s.holders.insert(7, vec![]);
        assert!(
            v.check()
                .expect_err("not answered")
                .contains("rank 7, not answered")
        );
        v.ranks = (0..=MAX_VIEW_RANKS as u32).collect();
        assert!(v.check().expect_err("ranks").contains("ranks answered"));
    }

    #[test]
    fn a_collection_accounts_for_the_hosts_it_listed_or_could_not() {
        let mut h = Holdings::default();
        h.add_listing("a:1", "ha", "j", &[]);
        h.unreachable.push("peer b:2: no answer within 1s".into());
        assert!(h.accounts_for("a:1") && h.accounts_for("b:2"));
        assert!(!h.accounts_for("b:20") && !h.accounts_for("c:1"));
    }

    #[test]
    fn counted_once_the_view_is_what_counting_each_ask_gave() {
        // Patterns of gaps: none, at the start, the end, sparse, dense,
        // more than MAX_MISSING, ranks past the world size.
        let world = 300u32;
        let patterns: Vec<Box<dyn Fn(u32) -> bool>> = vec![
            Box::new(|_| true),
            Box::new(|r| r >= 10),
            Box::new(|r| r < 290),
            Box::new(|r| r % 7 != 3),
            Box::new(|r| r % 2 == 0),
            Box::new(|r| r % 100 == 0),
            Box::new(|_| false),
        ];
        for (n, held) in patterns.iter().enumerate() {
            let mut h = Holdings::default();
            let i = h.host("a:1", "ha");
            for r in (0..world + 5).filter(|&r| held(r)) {
                h.add(i, 1, r, world);
            }
            if h.steps.is_empty() {
                continue;
            }
            let v = Counted::new(h.clone()).for_ranks(&[4]);
            let s = &v.steps[&1];
            let naive_missing: Vec<u32> = (0..world)
                .filter(|r| !h.steps[&1].ranks.contains_key(r))
                .take(MAX_MISSING)
                .collect();
            let naive_present = (0..world).filter(|&r| held(r)).count() as u32;
            assert_eq!(s.missing, naive_missing, "pattern {n}");
            assert_eq!(s.present, naive_present, "pattern {n}");
            assert_eq!(s.holders.len(), usize::from(held(4)), "pattern {n}");
            assert_eq!(v.ranks, [4].into());
        }
    }

    #[test]
    fn missing_ranks_are_named_up_to_the_bound() {
        let mut h = Holdings::default();
        let i = h.host("a:1", "ha");
        h.add(i, 1, 0, 1000);
        let v = h.for_ranks(&[5]);
        let s = &v.steps[&1];
        assert_eq!(s.present, 1);
        assert_eq!(s.missing.len(), MAX_MISSING);
        assert_eq!(s.missing[0], 1);
        assert!(s.holders.is_empty());
    }
}
