//! How a joining launcher rides out an etcd that does not answer.
//!
//! In a mass start of thousands of hosts, etcd is saturated for seconds:
//! a lease grant or a register txn gets no answer within the request
//! deadline, or etcd says "request timed out" or "too many requests".
//! A join used to fail on the first such answer, and the launcher exited:
//! the job lost a host that would have been in by the next second. Once
//! the connection's first read succeeded (so a wrong endpoint, a bad
//! certificate or a missing permission still fails at once, with its
//! cause), a join asks again, backing off, until the launcher's
//! `rejoin_timeout`: the same patience a member shows for its lease.
//!
//! In: each failed attempt's error. Out: how long to wait before the next,
//! or the error when it is not worth another (a refusal, or the patience
//! spent). Never: retry a refusal; wait past the budget; make every host
//! of a mass start ask again in step (the waits are spread).

use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use super::CoordError;

/// The first wait: short, since a stall of etcd's usually is.
const FIRST: Duration = Duration::from_millis(250);
/// The longest wait between attempts.
const MOST: Duration = Duration::from_secs(4);

/// The attempts of one joining request and the time they may take.
#[derive(Debug)]
pub(crate) struct Patience {
    since: Instant,
    budget: Duration,
    next: Duration,
    attempts: u32,
}

impl Patience {
    /// Patience of `budget` from now.
    pub(crate) fn new(budget: Duration) -> Self {
        Self {
            since: Instant::now(),
            budget,
            next: FIRST,
            attempts: 0,
        }
    }

    /// After a failed attempt: how long to wait before the next (then
    /// the caller asks again), or the error back when etcd refused, or
    /// the budget would be spent by the wait.
    pub(crate) fn again(&mut self, err: CoordError) -> Result<Duration, CoordError> {
        if !err.etcd_busy() {
            return Err(err);
        }
        self.next_wait().ok_or(err)
    }

    /// After a failed attempt the caller judged worth another: how long to
    /// wait before it, or `None` when the wait would spend the budget.
    pub(crate) fn next_wait(&mut self) -> Option<Duration> {
        let wait = spread(self.next);
        if self.since.elapsed() + wait >= self.budget {
            return None;
        }
        self.attempts += 1;
        self.next = (self.next * 2).min(MOST);
        Some(wait)
    }

    /// How many attempts were asked again so far.
    pub(crate) fn retried(&self) -> u32 {
        self.attempts
    }
}

/// `wait` less up to half, drawn per call: thousands of hosts that met
/// the same stall do not come back at the same instant.
fn spread(wait: Duration) -> Duration {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let cut = h.finish() % 1000;
    wait - wait.mul_f64(cut as f64 / 2000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout() -> CoordError {
        CoordError::Timeout {
            endpoints: "http://127.0.0.1:2379".into(),
            op: "lease grant",
            key: "/warden/jobs/j/members/h".into(),
            after: Duration::from_secs(5),
        }
    }

    #[test]
    fn waits_grow_to_a_cap_and_stop_at_the_budget() {
        let mut p = Patience::new(Duration::from_secs(3600));
        let waits: Vec<Duration> = (0..8)
            .map(|_| p.again(timeout()).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        assert!(waits[0] >= FIRST / 2 && waits[0] <= FIRST, "{waits:?}");
        assert!(waits.iter().all(|w| *w <= MOST), "{waits:?}");
        assert!(waits[7] >= MOST / 2, "{waits:?}");
        assert_eq!(p.retried(), 8);

        let mut spent = Patience::new(Duration::from_millis(100));
        assert!(
            spent.again(timeout()).is_err(),
            "a wait past the budget is not made"
        );
    }

    #[test]
    fn a_refusal_is_not_asked_again() {
        let mut p = Patience::new(Duration::from_secs(3600));
        let refused = CoordError::Stopped { host: "h".into() };
        assert!(p.again(refused).is_err());
        assert_eq!(p.retried(), 0);
    }
}
