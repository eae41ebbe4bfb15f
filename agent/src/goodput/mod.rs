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
//! Never: block the scan (the work loop only hands over the steps it
//! already read, under the ledger's own short lock; the journal is written
//! by the task, off the tick), or count an interval twice (the ledger's
//! cursor per rank; see [`ledger`]).

pub mod job_wide;
pub mod journal;
pub mod ledger;
pub mod task;

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

pub use ledger::{Cause, JobReport, Ledger, StepObs};

use crate::ranks::registry::RankKey;

/// What one scan saw that the ledger needs.
#[derive(Debug, Default, Clone)]
pub struct ScanFeed {
    /// Completed steps newly read, by rank.
    pub steps: Vec<(RankKey, StepObs)>,
    /// Ranks with no step yet whose innermost section changed: the time
    /// they entered "init" (None: not in it), and when the scan saw it.
    pub init: Vec<(RankKey, Option<u64>)>,
}

impl ScanFeed {
    /// True when the scan saw nothing for the ledger.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.init.is_empty()
    }
}

/// The agent's ledger and its journal.
#[derive(Debug)]
pub struct Goodput {
    ledger: Mutex<Ledger>,
    journal: Mutex<Option<journal::Journal>>,
}

impl Goodput {
    /// Replays the journals under `state_dir`. A journal that cannot be
    /// opened leaves the ledger in memory only (logged: accounting goes on,
    /// a restart of the agent then loses it).
    pub fn open(state_dir: &std::path::Path) -> Self {
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
            journal: Mutex::new(journal),
        }
    }

    /// Locks the ledger (poison-tolerant: every update keeps the invariant
    /// step by step).
    pub fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Feeds what one scan saw (called by the work loop after the scan,
    /// outside the registry lock).
    pub fn observe_scan(&self, feed: &ScanFeed, now_ns: u64) {
        if feed.is_empty() {
            return;
        }
        let mut l = self.ledger();
        for (key, s) in &feed.steps {
            l.step(&key.job, key.rank, *s);
        }
        for (key, entered) in &feed.init {
            l.init_section(&key.job, key.rank, *entered, now_ns);
        }
    }

    /// Writes what changed since the last flush.
    pub fn flush(&self) {
        let mut guard = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(journal) = guard.as_mut() else {
            return;
        };
        // The ledger is cloned out only for the changed jobs' lines; the
        // lock is held for the serialisation, which is short.
        let mut l = self.ledger();
        if let Err(e) = journal.flush(&mut l) {
            tracing::warn!("goodput journal: {e}");
        }
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

/// CLOCK_MONOTONIC now, in nanoseconds (the slots' clock).
pub fn mono_now() -> u64 {
    warden_client::clock::syscall_now()
}

/// A wall-clock time as CLOCK_MONOTONIC nanoseconds (for event times).
pub fn mono_of(t: SystemTime) -> u64 {
    let now = mono_now();
    let ago = SystemTime::now().duration_since(t).unwrap_or_default();
    now.saturating_sub(u64::try_from(ago.as_nanos()).unwrap_or(u64::MAX))
}

/// When process `pid` started, as CLOCK_MONOTONIC nanoseconds: its launch.
/// None when /proc cannot say.
pub fn process_start_ns(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = text.get(text.rfind(')')? + 1..)?;
    // Fields after the command: state is field 3, starttime field 22.
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|h| *h > 0)?;
    let boot_ns = ticks.checked_mul(1_000_000_000)? / hz;
    // starttime counts from boot including suspend (CLOCK_BOOTTIME).
    let mut boot = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut boot) } != 0 {
        return None;
    }
    let boot_now =
        u64::try_from(boot.tv_sec).ok()? * 1_000_000_000 + u64::try_from(boot.tv_nsec).ok()?;
    let mono = mono_now();
    Some(boot_ns.saturating_sub(boot_now.saturating_sub(mono)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn our_own_start_is_in_the_past() {
        let start = super::process_start_ns(std::process::id()).unwrap();
        let now = super::mono_now();
        assert!(
            start <= now && now - start < 3_600_000_000_000,
            "{start} {now}"
        );
    }
}
