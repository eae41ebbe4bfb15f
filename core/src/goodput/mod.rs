//! Goodput accounting: where each job's accelerator time went.
//!
//! In: the heartbeat scan's completed steps and pre-step sections (handed
//! over by the work loop, [`Goodput::observe_scan`]), and the event bus
//! (registrations, exits, hangs, in-process restarts, stragglers,
//! checkpoint saves and restores; [`task`]). Out: per job, the split of its
//! accelerator-seconds into productive step time and badput by cause
//! ([`ledger::Cause`]), through GetGoodput / CloseGoodput, `warden goodput`,
//! Prometheus gauges `warden_goodput_seconds{job,cause}` and
//! `warden_goodput_ratio{job}`, the counter
//! `warden_goodput_occurrences_total{kind}`, and the breakdown `warden run`
//! prints and writes when a job ends. Kept on disk ([`journal`]).
//!
//! Never: block the scan or make it pay for the accounting (the work loop
//! only appends the records it already read to a buffer; whoever takes the
//! ledger next folds them in first, the goodput task at least once a
//! second; the journal is written by the task, off the tick), or count an
//! interval twice (the ledger's cursor per rank; see [`ledger`]).

pub mod journal;
pub mod ledger;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

pub use ledger::{Cause, JobReport, Ledger, StepObs};

/// What one scan saw that the ledger needs: completed steps, and the
/// "init" section of ranks with no step yet.
///
/// Built on the tick, so it costs no allocation per record: a record names
/// its job by an index into `jobs`, which holds one copy of a job id per run
/// of its ranks (the scan visits ranks in key order, so a job's ranks come
/// together: one copy per job and scan, not one `RankKey` clone per rank).
#[derive(Debug, Default, Clone)]
pub struct ScanFeed {
    /// Job ids the records name, by index.
    jobs: Vec<String>,
    /// Completed steps newly read: (job index, rank, step), in scan order.
    steps: Vec<(usize, u32, StepObs)>,
    /// Ranks with no step yet whose innermost section changed: (job index,
    /// rank, the time they entered "init", None: not in it).
    init: Vec<(usize, u32, Option<u64>)>,
    /// Ranks seen entering their client's `heal_wait` section: (job index,
    /// rank, when).
    heal_waits: Vec<(usize, u32, u64)>,
}

impl ScanFeed {
    /// True when the scan saw nothing for the ledger.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.init.is_empty() && self.heal_waits.is_empty()
    }

    /// A completed step of `job`'s `rank`, newly read from its slot.
    pub fn push_step(&mut self, job: &str, rank: u32, s: StepObs) {
        let j = self.job_index(job);
        self.steps.push((j, rank, s));
    }

    /// `job`'s `rank`, with no step yet, entered "init" at `entered` (None:
    /// it is not in it).
    pub fn push_init(&mut self, job: &str, rank: u32, entered: Option<u64>) {
        let j = self.job_index(job);
        self.init.push((j, rank, entered));
    }

    /// `job`'s `rank` entered its client's `heal_wait` section at
    /// `entered` (a lost peer's heal awaited).
    pub fn push_heal_wait(&mut self, job: &str, rank: u32, entered: u64) {
        let j = self.job_index(job);
        self.heal_waits.push((j, rank, entered));
    }

    /// The completed steps, in the order the scan read them.
    pub fn steps(&self) -> impl Iterator<Item = (&str, u32, &StepObs)> {
        self.steps
            .iter()
            .map(|(j, rank, s)| (self.job_name(*j), *rank, s))
    }

    /// The job ids' index: the last one again when it is the same job.
    fn job_index(&mut self, job: &str) -> usize {
        match self.jobs.last() {
            Some(last) if last == job => self.jobs.len() - 1,
            _ => {
                self.jobs.push(job.to_owned());
                self.jobs.len() - 1
            }
        }
    }

    fn job_name(&self, j: usize) -> &str {
        self.jobs.get(j).map_or("", String::as_str)
    }

    /// Folds the feed into the ledger, as the scan at `now_ns` saw it: its
    /// heal waits (noted before its steps, as the scan noted them: a wait
    /// and the step after the heal can come in one scan), its steps in
    /// scan order, then its init sections (the order the ledger took them
    /// in when the tick applied them itself). Each run of one job's records
    /// looks the job up once.
    fn fold_into(&self, l: &mut Ledger, now_ns: u64) {
        for (j, rank, entered) in &self.heal_waits {
            l.heal_wait(self.job_name(*j), *rank, *entered);
        }
        for run in self.steps.chunk_by(|a, b| a.0 == b.0) {
            let Some(job) = run
                .first()
                .and_then(|(j, _, _)| l.jobs.get_mut(self.job_name(*j)))
            else {
                continue;
            };
            for (_, rank, s) in run {
                job.step(*rank, *s);
            }
        }
        for (j, rank, entered) in &self.init {
            l.init_section(self.job_name(*j), *rank, *entered, now_ns);
        }
    }
}

/// Scans' feeds not yet folded into the ledger, oldest first.
#[derive(Debug, Default)]
struct Pending {
    /// Each feed with the scan's time.
    feeds: Vec<(ScanFeed, u64)>,
}

/// How long a feed may wait for a fold before the tick folds it itself:
/// only when nothing else took the ledger for that long (the goodput task
/// folds at least every [`task::FLUSH_EVERY`]), so a task that stalls or
/// is gone still cannot make the buffer grow without bound.
pub const FOLD_BACKSTOP: std::time::Duration = std::time::Duration::from_secs(3);

/// How long and how many ended jobs are kept: their ledger in memory, their
/// journal on disk, and (through the agent's goodput task) their metric
/// series. Without it every job id ever seen stayed forever (issue 29: 3,000
/// register/close cycles left 3,000 journals and 38,766 series).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// An ended job (every rank ended: CloseGoodput, or each rank exited)
    /// is dropped this long after the agent first saw it ended.
    pub max_age: std::time::Duration,
    /// At most this many ended jobs are kept; past it the longest-ended
    /// go first.
    pub max_jobs: usize,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            max_age: std::time::Duration::from_secs(24 * 3600),
            max_jobs: 256,
        }
    }
}

/// When each ended job was first seen ended, and the rule that drops them.
#[derive(Debug, Default)]
struct Ended {
    /// Job -> CLOCK_MONOTONIC ns of the flush that first found it ended.
    /// A job found ended in its journal at start counts from then (never
    /// earlier than it ended, so it is never dropped early).
    since: BTreeMap<String, u64>,
    /// The rule.
    retention: Retention,
}

impl Ended {
    /// Notes which jobs of `l` ended (or opened again) as of `now_ns`, and
    /// removes from `l` the ended jobs past the retention: older than
    /// `max_age`, then the longest-ended past `max_jobs`. Returns them, for
    /// the journal to remove their files. Pure: the clock is passed in.
    fn prune(&mut self, l: &mut Ledger, now_ns: u64) -> Vec<String> {
        self.since.retain(|job, _| l.jobs.contains_key(job));
        for (job, j) in &l.jobs {
            if j.all_ended() {
                self.since.entry(job.clone()).or_insert(now_ns);
            } else {
                self.since.remove(job);
            }
        }
        let max_age = duration_ns(self.retention.max_age);
        let mut by_age: Vec<(u64, &String)> = self.since.iter().map(|(j, t)| (*t, j)).collect();
        by_age.sort();
        let excess = by_age.len().saturating_sub(self.retention.max_jobs);
        let gone: Vec<String> = by_age
            .iter()
            .enumerate()
            .filter(|(i, (t, _))| *i < excess || now_ns.saturating_sub(*t) >= max_age)
            .map(|(_, (_, j))| (*j).clone())
            .collect();
        for job in &gone {
            self.since.remove(job);
            l.jobs.remove(job);
        }
        gone
    }
}

/// The agent's ledger, the scans' feeds waiting to be folded into it, and
/// its journal.
///
/// The tick only appends its feed to `pending` ([`Goodput::observe_scan`]);
/// whoever takes the ledger ([`Goodput::ledger`]: the goodput task for an
/// event or its flush once a second, GetGoodput, CloseGoodput, a rank's
/// exit) folds the pending feeds in first, under the ledger's lock. So every
/// read sees every step the scan has read, in the order it read them, and
/// the accounting work runs off the tick.
#[derive(Debug)]
pub struct Goodput {
    /// The accounts. Lock order: `ledger`, `folding`, `pending`.
    ledger: Mutex<Ledger>,
    /// Feeds appended by the tick, folded by the next taker of the ledger.
    /// Held only to append or to take them all (no work under it), so the
    /// tick never waits on the ledger's lock (held by the journal's writes).
    pending: Mutex<Pending>,
    /// The buffer a fold swaps with `pending`'s and empties: handed back
    /// with its capacity, so the tick's append does not allocate. Taken
    /// only under the ledger's lock (never contended).
    folding: Mutex<Vec<(ScanFeed, u64)>>,
    /// Where the accounts are kept; None: memory only.
    journal: Mutex<Option<journal::Journal>>,
    /// Ended jobs and when they ended, for [`Retention`]. Lock order:
    /// `journal`, `ledger`, `ended`.
    ended: Mutex<Ended>,
}

impl Goodput {
    /// Replays the journals under `state_dir`. A journal that cannot be
    /// opened leaves the ledger in memory only (logged: accounting goes on,
    /// a restart of the agent then loses it).
    pub fn open(state_dir: &std::path::Path) -> Self {
        Self::open_with(state_dir, Retention::default())
    }

    /// As [`Goodput::open`], keeping ended jobs as `retention` says.
    pub fn open_with(state_dir: &std::path::Path, retention: Retention) -> Self {
        let (journal, ledger) = match journal::Journal::open(state_dir) {
            Ok((j, l, warnings)) => {
                for w in warnings {
                    tracing::warn!("goodput journal: {w}");
                }
                if !l.jobs.is_empty() {
                    tracing::info!(
                        jobs = l.jobs.len(),
                        "goodput ledger replayed from its journal"
                    );
                }
                (Some(j), l)
            }
            Err(e) => {
                tracing::error!("goodput ledger kept in memory only: {e}");
                (None, Ledger::default())
            }
        };
        Self {
            ledger: Mutex::new(ledger),
            pending: Mutex::new(Pending::default()),
            folding: Mutex::new(Vec::new()),
            journal: Mutex::new(journal),
            ended: Mutex::new(Ended {
                since: BTreeMap::new(),
                retention,
            }),
        }
    }

    /// Locks the ledger, with every feed the scans handed over folded in
    /// (poison-tolerant: every update keeps the invariant step by step).
    pub fn ledger(&self) -> MutexGuard<'_, Ledger> {
        let mut l = self.ledger.lock().unwrap_or_else(PoisonError::into_inner);
        self.fold(&mut l);
        l
    }

    /// Folds the pending feeds into `l` (its lock held, so no other fold
    /// can overtake this one: feeds are applied in the order the ticks
    /// appended them).
    fn fold(&self, l: &mut Ledger) {
        let mut feeds = self.folding.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::swap(
            &mut self
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .feeds,
            &mut *feeds,
        );
        for (feed, now_ns) in feeds.drain(..) {
            feed.fold_into(l, now_ns);
        }
    }

    /// Hands over what one scan saw (called by the work loop after the
    /// scan, outside the registry lock): appended to the pending feeds, the
    /// ledger is not touched. Only when the oldest feed waited past
    /// [`FOLD_BACKSTOP`] does the tick fold them itself, and then only if
    /// the ledger is free (it never waits for it).
    pub fn observe_scan(&self, feed: ScanFeed, now_ns: u64) {
        if feed.is_empty() {
            return;
        }
        let overdue = {
            let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            p.feeds.push((feed, now_ns));
            p.feeds.first().is_some_and(|(_, oldest)| {
                now_ns.saturating_sub(*oldest) > duration_ns(FOLD_BACKSTOP)
            })
        };
        if overdue {
            match self.ledger.try_lock() {
                Ok(mut l) => self.fold(&mut l),
                Err(std::sync::TryLockError::Poisoned(e)) => {
                    let mut l = e.into_inner();
                    self.fold(&mut l);
                }
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
    }

    /// Feeds waiting to be folded (for tests and the benchmark).
    pub fn pending(&self) -> usize {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .feeds
            .len()
    }

    /// Folds the scans' pending feeds, writes what changed since the last
    /// flush, then drops the ended jobs past the [`Retention`] (ledger and
    /// journal). Returns the jobs dropped.
    pub fn flush(&self) -> Vec<String> {
        self.flush_at(mono_now())
    }

    /// [`Goodput::flush`] as of `now_ns` (tests pass their own clock).
    pub fn flush_at(&self, now_ns: u64) -> Vec<String> {
        let mut guard = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        // The ledger is cloned out only for the changed jobs' lines; the
        // lock is held for the serialisation, which is short. Memory only:
        // still fold the scans' feeds, so the buffer never waits for a
        // reader.
        let mut l = self.ledger();
        if let Some(journal) = guard.as_mut()
            && let Err(errors) = journal.flush(&mut l)
        {
            for e in errors {
                tracing::warn!("{e}");
            }
        }
        let gone = self
            .ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .prune(&mut l, now_ns);
        drop(l);
        if let Some(journal) = guard.as_mut() {
            for job in &gone {
                if let Err(e) = journal.remove(job) {
                    tracing::warn!(job, "goodput retention: {e}");
                }
            }
        }
        if !gone.is_empty() {
            tracing::debug!(jobs = gone.len(), "goodput retention dropped ended jobs");
        }
        gone
    }

    /// Ended jobs still kept, with when each was first seen ended
    /// (CLOCK_MONOTONIC ns): the goodput task keeps their metric series for
    /// a while after.
    pub fn ended(&self) -> BTreeMap<String, u64> {
        self.ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .since
            .clone()
    }

    /// Every job's report (or `job`'s only) as of now.
    pub fn reports(&self, job: Option<&str>) -> Vec<JobReport> {
        let now = mono_now();
        let l = self.ledger();
        l.jobs
            .keys()
            .filter(|j| job.is_none_or(|want| want == j.as_str()))
            .filter_map(|j| l.report(j, now))
            .collect()
    }

    /// Closes `job` now (its launcher says it is over) and returns its
    /// final report.
    pub fn close(&self, job: &str) -> Option<JobReport> {
        let now = mono_now();
        let report = {
            let mut l = self.ledger();
            l.close(job, now);
            l.report(job, now)
        };
        self.flush();
        report
    }
}

fn duration_ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// CLOCK_MONOTONIC now, in nanoseconds (the slots' clock).
pub fn mono_now() -> u64 {
    // The slots' clock: CLOCK_MONOTONIC, which always exists on Linux.
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |ts| {
        (ts.tv_sec() as u64)
            .wrapping_mul(1_000_000_000)
            .wrapping_add(ts.tv_nsec() as u64)
    })
}

/// A wall-clock time as CLOCK_MONOTONIC nanoseconds (for event times).
pub fn mono_of(t: SystemTime) -> u64 {
    let now = mono_now();
    let ago = SystemTime::now().duration_since(t).unwrap_or_default();
    now.saturating_sub(u64::try_from(ago.as_nanos()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn obs(pid: u32, n: u64, start_ms: u64) -> StepObs {
        StepObs {
            pid,
            step: n,
            start_ns: start_ms * MS,
            duration_ns: 100 * MS,
            data_ns: 10 * MS,
        }
    }

    /// Two jobs of two ranks; every scan reads one step of each rank.
    fn scans(n: u64) -> Vec<(ScanFeed, u64)> {
        (0..n)
            .map(|i| {
                let mut f = ScanFeed::default();
                for job in ["a", "b"] {
                    for rank in 0..2 {
                        f.push_step(job, rank, obs(10 + rank, i, 1000 + i * 110));
                    }
                }
                // A third run of "a" after "b": a record for a rank that
                // never registered, and a stale one read again.
                f.push_step("a", 7, obs(17, i, 1000));
                f.push_step("a", 0, obs(10, 0, 1000));
                (f, (1100 + i * 110) * MS)
            })
            .collect()
    }

    fn register(l: &mut Ledger) {
        for job in ["a", "b"] {
            for rank in 0..2 {
                l.registered(job, rank, 10 + rank, 0, 500 * MS);
                l.init_section(job, rank, Some(600 * MS), 700 * MS);
            }
        }
    }

    #[test]
    fn folding_later_gives_the_numbers_of_applying_at_once() {
        let mut direct = Ledger::default();
        register(&mut direct);
        for (feed, _) in scans(25) {
            for (job, rank, s) in feed.steps() {
                direct.step(job, rank, *s);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let g = Goodput::open(dir.path());
        register(&mut g.ledger());
        for (feed, now) in scans(25) {
            g.observe_scan(feed, now);
        }
        assert_eq!(g.pending(), 25, "the tick only appends");
        let folded = g.ledger().clone();
        assert_eq!(g.pending(), 0);
        for job in ["a", "b"] {
            assert_eq!(folded.report(job, 0), direct.report(job, 0), "{job}");
            assert_eq!(folded.jobs[job].ranks, direct.jobs[job].ranks, "{job}");
        }
        assert!(folded.report("a", 0).unwrap().parts.get(Cause::Productive) > 0);
    }

    #[test]
    fn an_event_sees_the_steps_read_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let g = Goodput::open(dir.path());
        g.ledger().registered("j", 0, 10, 0, 500 * MS);
        let mut feed = ScanFeed::default();
        feed.push_step("j", 0, obs(10, 0, 1000));
        g.observe_scan(feed, 1100 * MS);
        // The incident comes after the step was read: the step is
        // productive, the time after it detection wait.
        g.ledger().incident("j", 1500 * MS);
        let rep = g.reports(Some("j")).remove(0);
        assert_eq!(rep.parts.get(Cause::Productive), 100 * MS as i64);
        assert_eq!(rep.parts.get(Cause::DetectionWait), 400 * MS as i64);
    }

    #[test]
    fn init_sections_are_folded_at_their_scans_time() {
        let dir = tempfile::tempdir().unwrap();
        let g = Goodput::open(dir.path());
        g.ledger().registered("j", 0, 10, 0, 500 * MS);
        for (entered, now) in [(Some(600), 650), (None, 900)] {
            let mut feed = ScanFeed::default();
            feed.push_init("j", 0, entered.map(|t| t * MS));
            g.observe_scan(feed, now * MS);
        }
        let mut feed = ScanFeed::default();
        feed.push_step("j", 0, obs(10, 0, 1000));
        g.observe_scan(feed, 1100 * MS);
        let rep = g.close("j").unwrap();
        assert_eq!(rep.parts.get(Cause::StartupInit), 300 * MS as i64);
    }

    #[test]
    fn the_tick_folds_itself_only_when_nobody_did_for_long() {
        let dir = tempfile::tempdir().unwrap();
        let g = Goodput::open(dir.path());
        g.ledger().registered("j", 0, 10, 0, 0);
        let tick = 100 * MS;
        let backstop = duration_ns(FOLD_BACKSTOP);
        let mut now = 0;
        let mut n = 0;
        while now <= backstop + tick {
            now += tick;
            let mut feed = ScanFeed::default();
            feed.push_step("j", 0, obs(10, n, now / MS - 100));
            g.observe_scan(feed, now);
            n += 1;
        }
        assert_eq!(g.pending(), 0, "folded by the tick past the backstop");
        // An empty scan appends nothing.
        g.observe_scan(ScanFeed::default(), now + tick);
        assert_eq!(g.pending(), 0);
        let rep = g.ledger().report("j", 0).unwrap();
        assert_eq!(rep.occ.steps.0, n);
    }

    #[test]
    fn ended_jobs_go_after_their_retention_and_past_the_cap() {
        const S: u64 = 1_000_000_000;
        let dir = tempfile::tempdir().unwrap();
        let g = Goodput::open_with(
            dir.path(),
            Retention {
                max_age: std::time::Duration::from_secs(60),
                max_jobs: 3,
            },
        );
        let journals = || {
            std::fs::read_dir(dir.path().join("goodput"))
                .unwrap()
                .count()
        };
        // One job runs throughout; ten are registered and closed one a second.
        g.ledger().registered("live", 0, 10, 0, 0);
        for i in 0..10u64 {
            let job = format!("done-{i}");
            g.ledger().registered(&job, 0, 11, 0, i * S);
            g.ledger().close(&job, i * S + 1);
            let gone = g.flush_at(i * S + 2);
            assert!(gone.iter().all(|j| j.starts_with("done-")), "{gone:?}");
            assert!(g.ended().len() <= 3, "{:?}", g.ended());
        }
        // The cap kept the three that ended last, and the live job.
        let kept: Vec<String> = g.ledger().jobs.keys().cloned().collect();
        assert_eq!(kept, ["done-7", "done-8", "done-9", "live"]);
        assert_eq!(journals(), 4, "the dropped jobs' journals are removed");
        // A job that runs again is not ended any more.
        g.ledger().registered("done-9", 0, 12, 0, 10 * S);
        g.flush_at(10 * S);
        assert_eq!(g.ended().len(), 2);
        // Past max_age from when they ended, the ended ones go.
        let gone = g.flush_at(9 * S + 2 + 60 * S);
        assert_eq!(gone, ["done-7", "done-8"]);
        let kept: Vec<String> = g.ledger().jobs.keys().cloned().collect();
        assert_eq!(kept, ["done-9", "live"]);
        assert_eq!(journals(), 2);
        // What the journal keeps is what is replayed: nothing comes back.
        drop(g);
        let again = Goodput::open(dir.path());
        assert_eq!(again.ledger().jobs.len(), 2);
    }
}
