//! What every host said about where its ranks stand, kept for the
//! job-wide hang verdict ([`super::culprit`]).
//!
//! Each agent keeps its own ranks' live positions (replaced every scan)
//! and, when it finds a hang, a snapshot of where the job's local ranks
//! stood at that moment: the restart that follows moves them, and the
//! verdict must judge the hang, not the recovery. Peers send theirs on the
//! straggler exchange; a host's batch replaces what it said before and is
//! forgotten after the board's `ttl`.
//!
//! In: live positions per job, hang snapshots, peers' batches.
//! Out: the outbox for peers (a job's hang snapshot while it is fresh,
//! else its live positions), and for one job the positions the verdict
//! reads once every rank is covered.
//! Never: I/O; memory a peer controls beyond [`MAX_HOSTS`] hosts and
//! [`MAX_JOBS`] jobs per host.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use super::culprit::Position;

/// Most hosts whose batches are kept (the oldest heard is dropped past it).
pub const MAX_HOSTS: usize = 65_536;
/// Most jobs one batch may carry.
pub const MAX_JOBS: usize = 1024;

/// One host's positions of one job's ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPositions {
    /// The job.
    pub job: String,
    /// Its world size as the ranks registered it (0: unknown).
    pub world_size: u32,
    /// True for a hang snapshot, false for live positions.
    pub hang: bool,
    /// When the positions were read (wall clock: compared across hosts).
    pub taken_at: SystemTime,
    /// The ranks (their `host` is the sender).
    pub ranks: Vec<Position>,
    /// A hang snapshot whose ranks' flight recorders are still being read:
    /// not final yet.
    pub pending: bool,
}

#[derive(Debug, Clone)]
struct Heard {
    at: Instant,
    jobs: Vec<JobPositions>,
}

/// The board (see the module doc).
#[derive(Debug)]
pub struct Board {
    ttl: Duration,
    hang_life: Duration,
    live: HashMap<String, JobPositions>,
    hangs: HashMap<String, (Instant, JobPositions)>,
    remote: HashMap<String, Heard>,
    /// When stale peers were last forgotten ([`Board::forget_stale`]).
    swept: Option<Instant>,
}

/// What [`Board::gather`] found for one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Gathered {
    /// One position per rank: a hang snapshot where a host has one of this
    /// episode, else its live positions read since the hang.
    pub positions: Vec<Position>,
    /// The largest world size any host reported.
    pub world_size: u32,
    /// True when every rank below the world size is covered, by hang
    /// snapshots only.
    pub complete: bool,
}

impl Board {
    /// A board forgetting peers' batches `ttl` after they arrived, and
    /// its own hang snapshots `hang_life` after they were taken (a hang
    /// after that is a new episode, with a snapshot of its own).
    pub fn new(ttl: Duration, hang_life: Duration) -> Self {
        Self {
            ttl,
            hang_life,
            live: HashMap::new(),
            hangs: HashMap::new(),
            remote: HashMap::new(),
            swept: None,
        }
    }

    /// Replaces this host's live positions (every job).
    pub fn set_live(&mut self, jobs: Vec<JobPositions>) {
        self.live = jobs.into_iter().map(|j| (j.job.clone(), j)).collect();
    }

    /// Snapshots `job`'s live positions as its hang snapshot, unless one
    /// fresher than the ttl exists (one hang episode, one snapshot).
    /// Returns true when it took one.
    pub fn snapshot_hang(&mut self, job: &str, now: Instant) -> bool {
        if self
            .hangs
            .get(job)
            .is_some_and(|(at, _)| now.duration_since(*at) < self.hang_life)
        {
            return false;
        }
        let Some(live) = self.live.get(job) else {
            return false;
        };
        let mut snap = live.clone();
        snap.hang = true;
        snap.pending = true;
        self.hangs.insert(job.to_owned(), (now, snap));
        true
    }

    /// The ranks of `job`'s hang snapshot (this host's).
    pub fn snapshot_ranks(&self, job: &str) -> Vec<u32> {
        self.hangs
            .get(job)
            .map(|(_, s)| s.ranks.iter().map(|p| p.rank).collect())
            .unwrap_or_default()
    }

    /// Marks `job`'s hang snapshot final: its flight recorders were read
    /// (or did not answer).
    pub fn snapshot_done(&mut self, job: &str) {
        if let Some((_, snap)) = self.hangs.get_mut(job) {
            snap.pending = false;
        }
    }

    /// Updates the groups (flight recorder) of `rank` in `job`'s hang
    /// snapshot, read after it was taken.
    pub fn set_groups(&mut self, job: &str, rank: u32, groups: Vec<super::culprit::GroupSeq>) {
        if let Some((_, snap)) = self.hangs.get_mut(job)
            && let Some(p) = snap.ranks.iter_mut().find(|p| p.rank == rank)
        {
            p.groups = groups;
        }
    }

    /// What to send peers: each job's fresh hang snapshot, else its live
    /// positions.
    pub fn outbox(&self, now: Instant) -> Vec<JobPositions> {
        let mut out: BTreeMap<&str, JobPositions> = BTreeMap::new();
        for (job, j) in &self.live {
            out.insert(job, j.clone());
        }
        for (job, (at, snap)) in &self.hangs {
            if now.duration_since(*at) < self.hang_life {
                out.insert(job, snap.clone());
            }
        }
        out.into_values().collect()
    }

    /// Takes a peer's batch: it replaces everything `host` said before.
    pub fn merge_remote(&mut self, host: &str, jobs: Vec<JobPositions>, now: Instant) {
        let full = !self.remote.contains_key(host) && self.remote.len() >= MAX_HOSTS;
        self.forget_stale(now, full);
        if !self.remote.contains_key(host)
            && self.remote.len() >= MAX_HOSTS
            && let Some(oldest) = self
                .remote
                .iter()
                .min_by_key(|(_, h)| h.at)
                .map(|(k, _)| k.clone())
        {
            self.remote.remove(&oldest);
        }
        let mut jobs = jobs;
        jobs.truncate(MAX_JOBS);
        self.remote.insert(host.to_owned(), Heard { at: now, jobs });
        let life = self.hang_life;
        self.hangs
            .retain(|_, (at, _)| now.duration_since(*at) < life);
    }

    /// Forgets the peers not heard from for the ttl: at most every quarter
    /// ttl, unless the board is `full`. A sweep is O(hosts) and this runs on
    /// every peer's report, so sweeping each time made the collector's
    /// interval O(N^2): one of the two scans per report that made the
    /// aggregator fall behind at 2,048 hosts (docs/benchmarks.md, "Over the
    /// network"). A stale entry left until the next sweep is never read:
    /// [`Board::gather`] checks each one's age itself.
    fn forget_stale(&mut self, now: Instant, full: bool) {
        if !full
            && self
                .swept
                .is_some_and(|at| now.saturating_duration_since(at) < self.ttl / 4)
        {
            return;
        }
        self.swept = Some(now);
        let ttl = self.ttl;
        self.remote
            .retain(|_, h| now.saturating_duration_since(h.at) < ttl);
    }

    /// The positions of `job` for a verdict on a hang found at `since`:
    /// this host's hang snapshot (else live positions), and from each peer
    /// its hang snapshot of this episode (taken no earlier than `episode`
    /// before `since`) or else live positions heard after `since`.
    pub fn gather(
        &self,
        job: &str,
        since: (Instant, SystemTime),
        episode: Duration,
        now: Instant,
    ) -> Gathered {
        let (since_mono, since_wall) = since;
        let earliest = since_wall.checked_sub(episode).unwrap_or(since_wall);
        let mut sources: Vec<&JobPositions> = Vec::new();
        match self.hangs.get(job) {
            Some((at, snap)) if now.duration_since(*at) < self.hang_life => sources.push(snap),
            _ => sources.extend(self.live.get(job)),
        }
        for heard in self.remote.values() {
            if now.duration_since(heard.at) >= self.ttl {
                continue;
            }
            let Some(j) = heard.jobs.iter().find(|j| j.job == job) else {
                continue;
            };
            let fresh = if j.hang {
                j.taken_at >= earliest
            } else {
                heard.at >= since_mono
            };
            if fresh {
                sources.push(j);
            }
        }
        let world_size = sources.iter().map(|j| j.world_size).max().unwrap_or(0);
        // Live positions are a fallback: a host whose ranks wait too sends
        // its hang snapshot within a tick or two of ours, and that is the
        // moment to judge; one whose ranks still move never does, and the
        // caller's deadline judges with its live positions.
        let all_snapshots = sources.iter().all(|j| j.hang && !j.pending);
        let mut by_rank: BTreeMap<u32, Position> = BTreeMap::new();
        for j in &sources {
            for p in &j.ranks {
                by_rank.entry(p.rank).or_insert_with(|| p.clone());
            }
        }
        let complete =
            all_snapshots && world_size > 0 && (0..world_size).all(|r| by_rank.contains_key(&r));
        Gathered {
            positions: by_rank.into_values().collect(),
            world_size,
            complete,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(host: &str, ranks: &[(u32, u64, &str)], hang: bool, at: SystemTime) -> JobPositions {
        JobPositions {
            job: "j".into(),
            world_size: 4,
            hang,
            taken_at: at,
            pending: false,
            ranks: ranks
                .iter()
                .map(|&(rank, step, section)| Position {
                    host: host.into(),
                    rank,
                    step,
                    section: section.into(),
                    stalled: true,
                    stalled_ms: 0,
                    process_state: String::new(),
                    groups: Vec::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_hang_snapshot_outlives_the_live_positions_that_move_on() {
        let t0 = Instant::now();
        let w0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut b = Board::new(Duration::from_secs(30), Duration::from_secs(10));
        b.set_live(vec![job(
            "a",
            &[(0, 12, "allreduce"), (1, 12, "compute")],
            false,
            w0,
        )]);
        assert!(b.snapshot_hang("j", t0));
        assert_eq!(b.snapshot_ranks("j"), [0, 1]);
        assert!(
            b.outbox(t0)[0].pending,
            "final once its flight recorders are read"
        );
        b.snapshot_done("j");
        assert!(
            !b.snapshot_hang("j", t0 + Duration::from_secs(1)),
            "one per episode"
        );
        // The restart moves the ranks on; the snapshot still says where
        // they hung, and is what peers get.
        b.set_live(vec![job(
            "a",
            &[(0, 20, "step"), (1, 20, "step")],
            false,
            w0,
        )]);
        let out = b.outbox(t0);
        assert_eq!(out.len(), 1);
        assert!(out[0].hang);
        assert_eq!(out[0].ranks[1].section, "compute");

        // Not complete until the peer's ranks are there.
        let since = (t0, w0);
        let g = b.gather("j", since, Duration::from_secs(10), t0);
        assert!(!g.complete);
        // A live batch heard before the hang does not count...
        b.merge_remote(
            "b",
            vec![job(
                "b",
                &[(2, 12, "allreduce"), (3, 12, "allreduce")],
                false,
                w0,
            )],
            t0 - Duration::from_millis(1),
        );
        // (merge_remote is called at its arrival; simulate an early one)
        let g = b.gather("j", since, Duration::from_secs(10), t0);
        assert!(!g.complete, "{g:?}");
        // A live batch heard after the hang covers the ranks but is only
        // a fallback: not complete.
        b.merge_remote(
            "b",
            vec![job(
                "b",
                &[(2, 12, "allreduce"), (3, 12, "allreduce")],
                false,
                w0,
            )],
            t0 + Duration::from_millis(1),
        );
        let g = b.gather(
            "j",
            since,
            Duration::from_secs(10),
            t0 + Duration::from_millis(1),
        );
        assert_eq!((g.positions.len(), g.complete), (4, false), "{g:?}");
        // ...its hang snapshot of the same episode is.
        b.merge_remote(
            "b",
            vec![job(
                "b",
                &[(2, 12, "allreduce"), (3, 12, "allreduce")],
                true,
                w0 - Duration::from_secs(2),
            )],
            t0 + Duration::from_millis(5),
        );
        let g = b.gather(
            "j",
            since,
            Duration::from_secs(10),
            t0 + Duration::from_millis(5),
        );
        assert!(g.complete, "{g:?}");
        assert_eq!(g.positions.len(), 4);
        assert_eq!(g.world_size, 4);
        // A snapshot from an older episode does not.
        b.merge_remote(
            "b",
            vec![job(
                "b",
                &[(2, 3, "x"), (3, 3, "x")],
                true,
                w0 - Duration::from_secs(60),
            )],
            t0 + Duration::from_millis(6),
        );
        assert!(
            !b.gather(
                "j",
                since,
                Duration::from_secs(10),
                t0 + Duration::from_millis(6)
            )
            .complete
        );
    }

    #[test]
    fn a_peer_past_the_ttl_counts_for_nothing_before_the_sweep_forgets_it() {
        let t0 = Instant::now();
        let w0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut b = Board::new(Duration::from_secs(1), Duration::from_secs(10));
        b.set_live(vec![job("a", &[(0, 12, "x"), (1, 12, "x")], false, w0)]);
        assert!(b.snapshot_hang("j", t0));
        b.snapshot_done("j");
        let snap = |host: &str| job(host, &[(2, 12, "x"), (3, 12, "x")], true, w0);
        b.merge_remote("b", vec![snap("b")], t0);
        let since = (t0, w0);
        assert!(b.gather("j", since, Duration::from_secs(10), t0).complete);
        // Another peer within a quarter ttl: no sweep; "b" stays kept...
        b.merge_remote("c", Vec::new(), t0 + Duration::from_millis(100));
        let later = t0 + Duration::from_millis(1_050);
        assert!(b.remote.contains_key("b"));
        // ...but past its ttl it no longer covers ranks 2 and 3.
        let g = b.gather("j", since, Duration::from_secs(10), later);
        assert!(!g.complete, "{g:?}");
        // The next report past a quarter ttl sweeps it.
        b.merge_remote("c", Vec::new(), later);
        assert!(!b.remote.contains_key("b"));
    }

    #[test]
    fn peers_are_bounded_and_forgotten() {
        let t0 = Instant::now();
        let w0 = SystemTime::UNIX_EPOCH;
        let mut b = Board::new(Duration::from_secs(1), Duration::from_secs(1));
        for h in 0..(MAX_HOSTS + 10) {
            b.merge_remote(&format!("h{h}"), vec![job("x", &[], false, w0)], t0);
        }
        assert_eq!(b.remote.len(), MAX_HOSTS);
        b.merge_remote("late", Vec::new(), t0 + Duration::from_secs(2));
        assert_eq!(b.remote.len(), 1, "the stale ones are forgotten");
    }
}
