//! The job-wide verdict on a hang, followed up off the tick.
//!
//! When the scan finds a rank hung, the work loop snapshots where the
//! job's local ranks stood ([`HangBoard::on_hang`]), has the straggler
//! exchange send the snapshot to the peer agents at once, and starts
//! [`follow_up`]: it asks each of the job's local ranks for torch's flight
//! recorder (`hang::flight`, in parallel, at most `hang.stack_dump_wait`;
//! a rank that does not answer stays without one), puts each process
//! group's sequence into the snapshot and sends it again, final; then it
//! waits (at most `hang.verdict_wait`) until every rank of the job is
//! covered by a final snapshot from this episode, judges them
//! (`detect::culprit::judge`) and publishes `job.hang_verdict`. Attribution
//! joins it to the job's hang incident: the culprit's host is charged, the
//! others record whom they waited on.
//!
//! One collector judges: the job's aggregator (`exchange::aggregate`) holds
//! every host's positions, so its board is complete; it judges once and
//! announces the verdict in its answers, and each host publishes it as its
//! own `job.hang_verdict`. A host whose board is complete (the collector,
//! or a job on one host) judges and announces itself; one that hears no
//! verdict within `hang.verdict_wait` (the collector was lost) judges what
//! it has, naming the ranks it is missing.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;
use warden_core::detect::culprit;
use warden_core::detect::positions::{Board, JobPositions};
use warden_core::events::EventBus;
use warden_core::rank::RankKey;
use warden_core::signal::{HangVerdict, Signal};

/// The board and the wake-ups around it (shared by the work loop, the
/// straggler exchange and the Peer service).
#[derive(Debug)]
pub struct HangBoard {
    host: String,
    board: Mutex<Board>,
    /// Wakes the straggler exchange for a round now (a hang snapshot to send).
    pub exchange_now: Notify,
    /// Woken when a peer's positions arrive (a verdict may be complete) or
    /// a verdict is announced.
    changed: Notify,
    /// Verdicts judged here or announced by the collector, by job, with
    /// when they were judged (wall clock: compared with other hosts').
    announced: Mutex<std::collections::HashMap<String, (SystemTime, culprit::HangJudgement)>>,
    /// Jobs a collection runs for (one per job at a time).
    collecting: Mutex<std::collections::HashSet<String>>,
    /// How long a verdict is news.
    hang_life: Duration,
}

impl HangBoard {
    /// A board for `host`, forgetting peers after `ttl` and hang snapshots
    /// after `hang_life`.
    pub fn new(host: String, ttl: Duration, hang_life: Duration) -> Self {
        Self {
            host,
            board: Mutex::new(Board::new(ttl, hang_life)),
            exchange_now: Notify::new(),
            changed: Notify::new(),
            announced: Mutex::default(),
            collecting: Mutex::default(),
            hang_life,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This host's live positions from the scan (named as this host's).
    pub fn set_live(&self, mut jobs: Vec<JobPositions>) {
        for j in &mut jobs {
            for p in &mut j.ranks {
                p.host.clone_from(&self.host);
            }
        }
        self.lock().set_live(jobs);
    }

    /// What to send peers.
    pub fn outbox(&self) -> Vec<JobPositions> {
        self.lock().outbox(Instant::now())
    }

    /// Takes a peer's positions and wakes verdicts waiting for them.
    pub fn merge_remote(&self, host: &str, jobs: Vec<JobPositions>) {
        if host == self.host {
            return;
        }
        self.lock().merge_remote(host, jobs, Instant::now());
        self.changed.notify_waiters();
    }

    /// Records a verdict on `job` judged at `at` (here or by the collector)
    /// and wakes the follow-ups waiting for one.
    pub fn announce(&self, job: &str, at: SystemTime, v: culprit::HangJudgement) {
        let mut a = self
            .announced
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let life = self.hang_life;
        a.retain(|_, (t, _)| SystemTime::now().duration_since(*t).unwrap_or_default() < life);
        if a.get(job).is_none_or(|(t, _)| *t < at) {
            a.insert(job.to_owned(), (at, v));
        }
        drop(a);
        self.changed.notify_waiters();
    }

    /// The verdict announced for `job` no earlier than `after`.
    pub fn announced(
        &self,
        job: &str,
        after: SystemTime,
    ) -> Option<(SystemTime, culprit::HangJudgement)> {
        self.announced
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(job)
            .filter(|(t, _)| *t >= after)
            .cloned()
    }

    /// The fresh verdicts of `jobs`, for an answer.
    pub fn announced_for<'a>(
        &self,
        jobs: impl Iterator<Item = &'a str>,
    ) -> Vec<(String, SystemTime, culprit::HangJudgement)> {
        let a = self
            .announced
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = SystemTime::now();
        jobs.filter_map(|j| {
            let (t, v) = a.get(j)?;
            (now.duration_since(*t).unwrap_or_default() < self.hang_life)
                .then(|| (j.to_owned(), *t, v.clone()))
        })
        .collect()
    }

    /// Called for each hung rank the scan found: the first of a job's hang
    /// episode snapshots the job and returns true (start a verdict).
    pub fn on_hang(&self, job: &str) -> bool {
        let took = self.lock().snapshot_hang(job, Instant::now());
        if took {
            self.exchange_now.notify_one();
        }
        took
    }
}

/// Reads the flight recorders of the job's local ranks into its hang
/// snapshot, waits for every rank's position (bounded by `wait`), judges
/// and publishes `job.hang_verdict`.
pub async fn follow_up(
    board: Arc<HangBoard>,
    events: Arc<EventBus>,
    ranks: crate::act::in_process::Handles,
    job: String,
    hang_event: u64,
    (wait, dump_wait): (Duration, Duration),
) {
    let since = (Instant::now(), SystemTime::now());
    read_flight_recorders(&board, &ranks, &job, dump_wait).await;
    let deadline = tokio::time::Instant::now() + wait;
    // A peer's snapshot of this episode may be up to twice the wait older
    // than ours (its ranks hung first).
    let episode = wait * 2;
    let earliest = since.1.checked_sub(episode).unwrap_or(since.1);
    let (v, complete) = loop {
        let changed = board.changed.notified();
        if let Some((_, v)) = board.announced(&job, earliest) {
            break (v, true);
        }
        let g = board.lock().gather(&job, since, episode, Instant::now());
        if g.complete {
            let v = culprit::judge(&g.positions, g.world_size);
            board.announce(&job, SystemTime::now(), v.clone());
            break (v, true);
        }
        if tokio::time::timeout_at(deadline, changed).await.is_err() {
            // No collector answered in time: what this host has.
            let g = board.lock().gather(&job, since, episode, Instant::now());
            break (culprit::judge(&g.positions, g.world_size), g.complete);
        }
    };
    let verdict = HangVerdict {
        job,
        host: board.host.clone(),
        culprits: v.culprits,
        waiting: v.waiting,
        missing: v.missing,
        hosts: v.hosts,
        summary: v.summary,
        hang_event,
    };
    let charged = if verdict.culprits.is_empty() {
        "none"
    } else if verdict.charges_this_host() {
        "this_host"
    } else {
        "other_host"
    };
    metrics::counter!("warden_hang_verdicts_total", "charged" => charged).increment(1);
    tracing::info!(
        job = %verdict.job,
        charged,
        complete,
        "job-wide hang verdict: {}",
        verdict.summary
    );
    events.publish(Signal::HangVerdict(verdict));
}

/// The collector's side for a job it holds a hang snapshot of from some
/// host: waits (at most `wait`) until every rank is covered, judges and
/// announces, so the hosts hear the verdict in their next answer. Runs
/// once per job at a time; publishes nothing (the hosts with ranks do).
pub async fn collect(board: Arc<HangBoard>, job: String, wait: Duration) {
    {
        let mut c = board
            .collecting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !c.insert(job.clone()) {
            return;
        }
    }
    let since = (Instant::now(), SystemTime::now());
    let episode = wait * 2;
    let earliest = since.1.checked_sub(episode).unwrap_or(since.1);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let changed = board.changed.notified();
        if board.announced(&job, earliest).is_some() {
            break;
        }
        let g = board.lock().gather(&job, since, episode, Instant::now());
        let timed_out = tokio::time::Instant::now() >= deadline;
        if g.complete || timed_out {
            let v = culprit::judge(&g.positions, g.world_size);
            tracing::info!(job = %job, complete = g.complete, "collector's hang verdict: {}", v.summary);
            board.announce(&job, SystemTime::now(), v);
            break;
        }
        let _ = tokio::time::timeout_at(deadline, changed).await;
    }
    board
        .collecting
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&job);
}

/// Asks every local rank of `job`'s hang snapshot for its flight recorder
/// at once and puts what comes back into the snapshot, then marks it
/// final and has the exchange send it.
async fn read_flight_recorders(
    board: &HangBoard,
    handles: &crate::act::in_process::Handles,
    job: &str,
    wait: Duration,
) {
    let keys: Vec<RankKey> = board
        .lock()
        .snapshot_ranks(job)
        .into_iter()
        .map(|rank| RankKey {
            job: job.to_owned(),
            rank,
        })
        .collect();
    let mut asks = tokio::task::JoinSet::new();
    for key in keys {
        let handles = handles.clone();
        asks.spawn(async move {
            let dump = super::flight::request_dump(&handles, &key, wait).await;
            (key, dump)
        });
    }
    let mut dumps = Vec::new();
    while let Some(done) = asks.join_next().await {
        if let Ok(d) = done {
            dumps.push(d);
        }
    }
    let mut b = board.lock();
    for (key, dump) in dumps {
        match dump {
            Ok(groups) => b.set_groups(
                job,
                key.rank,
                groups
                    .into_iter()
                    .take(culprit::MAX_GROUPS)
                    .map(|g| culprit::GroupSeq {
                        group: g.pg,
                        enqueued: g.last_enqueued.unwrap_or(0),
                        pending: g.pending.unwrap_or_default(),
                    })
                    .collect(),
            ),
            Err(why) => {
                // Info, not debug: a dump refused (over a cap, malformed)
                // is worth a line beside the verdict it is missing from.
                tracing::info!(rank = %key, "no flight recorder for the hang verdict: {why}")
            }
        }
    }
    b.snapshot_done(job);
    drop(b);
    board.exchange_now.notify_one();
}
