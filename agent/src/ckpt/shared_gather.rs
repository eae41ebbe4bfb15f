//! One gather of a job's copies for the ranks of this host that restore at
//! once.
//!
//! A restore asks every peer of the job what it holds
//! ([`super::restore::gather`]), and at a restart every rank of a host
//! restores: with 8 ranks a host, 8 times every peer (issue 30: O(N) calls
//! per rank, and every peer lists its tier for each). A rank that asks
//! while a gather of the same job and time limit is under way here takes
//! that gather's view instead of starting its own, unless a commit was
//! sealed here since it started: a restore right after its own save must
//! see that save ([`super::Sealing`] counts them).
//!
//! In: the job, the limit, this agent's count of sealed commits, and the
//! gather to run. Out: the view, shared. Never: hands a caller a view
//! gathered before a commit sealed here that the caller could have waited
//! for; keeps a finished view for a later caller (the next restore asks
//! again); holds more than one gather per job, set of ranks and limit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OnceCell;

use super::restore::CopiesView;

/// The gathers under way on this agent, per job, ranks (none: every rank)
/// and limit. Also shares the collector's collections of a job
/// ([`super::collect`]), whose gather is a [`super::holdings::Holdings`].
#[derive(Debug)]
pub struct InFlight<T = CopiesView> {
    flights: Mutex<HashMap<Key, Flight<T>>>,
    /// How long a finished view still serves those that come (0: none).
    keep: Duration,
}

/// A gather's job, ranks (none: every rank; the ranks of this host that
/// restore at once; for a group's listing, the group's start in the job's
/// order) and limit.
type Key = (String, Vec<u32>, Duration);

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        Self::keeping(Duration::ZERO)
    }
}

#[derive(Debug)]
struct Flight<T> {
    /// Commits sealed here when it started.
    sealed: u64,
    view: Arc<OnceCell<Arc<T>>>,
    /// When its gather finished (a view kept for [`InFlight::keep`]).
    done: Option<tokio::time::Instant>,
}

impl<T> InFlight<T> {
    /// Gathers shared while they run and, for `keep` after they finished,
    /// by those that come then too (the collector's: a wave of restores
    /// asks over longer than one collection takes, and every ask of the
    /// wave should see the same view).
    pub fn keeping(keep: Duration) -> Self {
        Self {
            flights: Mutex::new(HashMap::new()),
            keep,
        }
    }

    /// The view of `job` (for `part`'s ranks, or every rank) within `limit`: the
    /// gather under way, when it started with `sealed` commits sealed here
    /// as now, or else `gather`, run here and shared with those that come
    /// while it runs.
    pub async fn view<F>(
        &self,
        job: &str,
        part: &[u32],
        limit: Duration,
        sealed: u64,
        gather: impl FnOnce() -> F,
    ) -> Arc<T>
    where
        F: std::future::Future<Output = T>,
    {
        let ok = || Ok::<(), std::convert::Infallible>(());
        let admitted = self.view_admitted(job, part, limit, sealed, ok, gather);
        let Ok(v) = admitted.await;
        v
    }

    /// [`InFlight::view`] for a restore of `rank`, whose own set of ranks is
    /// `part` (sorted): a gather under way for the same job and limit whose
    /// ranks include `rank` is joined, else `gather` runs for `part`. The
    /// ranks of a host that registered between their restores compute
    /// different sets, and should still share one gather (each set its own
    /// was up to 8 gathers again). `gather` is given the ranks to gather
    /// for: a waiter whose runner went away runs the joined set's gather.
    pub async fn view_covering<F>(
        &self,
        job: &str,
        (rank, part): (u32, &[u32]),
        limit: Duration,
        sealed: u64,
        gather: impl FnOnce(Vec<u32>) -> F,
    ) -> Arc<T>
    where
        F: std::future::Future<Output = T>,
    {
        let joined = {
            let m = self.flights.lock().unwrap_or_else(|p| p.into_inner());
            m.iter()
                .find(|((j, p, l), f)| {
                    j == job
                        && *l == limit
                        && f.sealed == sealed
                        && !f.view.initialized()
                        && p.binary_search(&rank).is_ok()
                })
                .map(|((_, p, _), _)| p.clone())
        };
        let part = joined.unwrap_or_else(|| part.to_vec());
        let ranks = part.clone();
        self.view(job, &part, limit, sealed, move || gather(ranks))
            .await
    }

    /// [`InFlight::view`], where starting a gather (not joining one under
    /// way or kept) must first be let through by `admit`: the collector's
    /// quota per asking peer ([`super::collect`]), so that a peer cannot
    /// make this agent list a job's hosts in a loop. A refusal is `admit`'s
    /// error.
    pub async fn view_admitted<F, E>(
        &self,
        job: &str,
        part: &[u32],
        limit: Duration,
        sealed: u64,
        admit: impl FnOnce() -> Result<(), E>,
        gather: impl FnOnce() -> F,
    ) -> Result<Arc<T>, E>
    where
        F: std::future::Future<Output = T>,
    {
        let key = (job.to_owned(), part.to_vec(), limit);
        let cell = {
            let mut m = self.flights.lock().unwrap_or_else(|p| p.into_inner());
            let keep = self.keep;
            // Views kept past their time go (a job that ended leaves none).
            m.retain(|_, f| f.done.is_none_or(|t| t.elapsed() < keep));
            match m.get(&key) {
                Some(f) if f.sealed == sealed && (f.done.is_some() || !f.view.initialized()) => {
                    f.view.clone()
                }
                _ => {
                    admit()?;
                    let cell = Arc::new(OnceCell::new());
                    m.insert(
                        key.clone(),
                        Flight {
                            sealed,
                            view: cell.clone(),
                            done: None,
                        },
                    );
                    cell
                }
            }
        };
        // One caller runs its gather; the others wait for its view. Should
        // that caller go away mid-way, the next waiter runs its own.
        let view = cell
            .get_or_init(|| async { Arc::new(gather().await) })
            .await
            .clone();
        let mut m = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = m.get_mut(&key).filter(|f| Arc::ptr_eq(&f.view, &cell)) {
            if self.keep.is_zero() {
                m.remove(&key);
            } else if f.done.is_none() {
                f.done = Some(tokio::time::Instant::now());
            }
        }
        Ok(view)
    }

    /// No gather under way (the tests' check that none is kept).
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A gather that counts itself and ends when `go` is notified.
    async fn counted(n: &AtomicUsize, go: &tokio::sync::Notify) -> CopiesView {
        n.fetch_add(1, Ordering::SeqCst);
        go.notified().await;
        CopiesView::default()
    }

    #[tokio::test]
    async fn callers_while_a_gather_runs_share_it_and_the_next_asks_again() {
        let flights = InFlight::<CopiesView>::default();
        let (n, go) = (AtomicUsize::new(0), tokio::sync::Notify::new());
        let limit = Duration::from_secs(1);
        let first = flights.view("j", &[], limit, 0, || counted(&n, &go));
        let second = flights.view("j", &[], limit, 0, || counted(&n, &go));
        // Another job, and another limit (the restore's longer second ask),
        // are gathers of their own; so is one rank's.
        let other_job = flights.view("k", &[], limit, 0, || counted(&n, &go));
        let other_limit = flights.view("j", &[], limit * 3, 0, || counted(&n, &go));
        let one_rank = flights.view("j", &[1], limit, 0, || counted(&n, &go));
        let release = async {
            // Each started gather waits on `go`; release them once all four
            // callers are in (three gathers).
            while n.load(Ordering::SeqCst) < 4 {
                tokio::task::yield_now().await;
            }
            go.notify_waiters();
        };
        let (a, b, _, _, _, ()) =
            tokio::join!(first, second, other_job, other_limit, one_rank, release);
        assert!(
            Arc::ptr_eq(&a, &b),
            "the second caller took the first's view"
        );
        assert_eq!(
            n.load(Ordering::SeqCst),
            4,
            "one gather per job, rank and limit"
        );
        assert!(flights.is_empty(), "a finished gather is not kept");

        // After it finished, a caller gathers again.
        go.notify_one();
        flights.view("j", &[], limit, 0, || counted(&n, &go)).await;
        assert_eq!(n.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn a_restore_joins_a_gather_under_way_whose_ranks_include_its_own() {
        let flights = InFlight::<CopiesView>::default();
        let (n, go) = (AtomicUsize::new(0), tokio::sync::Notify::new());
        let limit = Duration::from_secs(1);
        let asked = std::sync::Mutex::new(Vec::new());
        let run = |part: Vec<u32>| {
            asked.lock().unwrap().push(part);
            counted(&n, &go)
        };
        // Ranks 0-2 registered when rank 0 restored; 3 since.
        let first = flights.view_covering("j", (0, &[0, 1, 2]), limit, 0, run);
        let joins = flights.view_covering("j", (2, &[0, 1, 2, 3]), limit, 0, run);
        let own = flights.view_covering("j", (3, &[0, 1, 2, 3]), limit, 0, run);
        let release = async {
            while n.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
            go.notify_waiters();
        };
        let (a, b, c, ()) = tokio::join!(first, joins, own, release);
        assert!(Arc::ptr_eq(&a, &b), "rank 2 joined the gather of 0-2");
        assert!(
            !Arc::ptr_eq(&a, &c),
            "rank 3 is not in it: a gather of its own"
        );
        let mut asked = asked.into_inner().unwrap();
        asked.sort();
        assert_eq!(asked, [vec![0, 1, 2], vec![0, 1, 2, 3]]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_view_serves_those_that_come_after_until_its_time_is_out() {
        let flights = InFlight::<CopiesView>::keeping(Duration::from_millis(200));
        let (n, go) = (AtomicUsize::new(0), tokio::sync::Notify::new());
        let limit = Duration::from_secs(1);
        go.notify_one();
        let a = flights.view("j", &[], limit, 0, || counted(&n, &go)).await;
        let b = flights.view("j", &[], limit, 0, || counted(&n, &go)).await;
        assert!(Arc::ptr_eq(&a, &b), "the finished view is kept");
        assert_eq!(n.load(Ordering::SeqCst), 1);
        // A commit sealed since: gathered again, even within the time.
        go.notify_one();
        flights.view("j", &[], limit, 1, || counted(&n, &go)).await;
        assert_eq!(n.load(Ordering::SeqCst), 2);
        tokio::time::advance(Duration::from_millis(250)).await;
        go.notify_one();
        flights.view("j", &[], limit, 1, || counted(&n, &go)).await;
        assert_eq!(n.load(Ordering::SeqCst), 3, "past its time, gathered again");
    }

    #[tokio::test]
    async fn a_commit_sealed_since_the_gather_started_gets_a_gather_of_its_own() {
        let flights = InFlight::<CopiesView>::default();
        let (n, go) = (AtomicUsize::new(0), tokio::sync::Notify::new());
        let limit = Duration::from_secs(1);
        let before = flights.view("j", &[], limit, 0, || counted(&n, &go));
        let after_a_commit = flights.view("j", &[], limit, 1, || counted(&n, &go));
        let release = async {
            while n.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
            go.notify_waiters();
        };
        let (a, b, ()) = tokio::join!(before, after_a_commit, release);
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }
}
