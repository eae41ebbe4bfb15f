//! The rate of ReportJobStop per uid ([`StopLimiter`]): the agent's state
//! holds one, the call takes from it. Its own module so that the state does
//! not import the call's module (which reads the state).

use std::time::{Duration, Instant};

use super::quota::Quota;

/// ReportJobStop calls per uid: a token bucket per uid holding
/// `api.job_stops_per_minute` tokens, refilled evenly over a minute. A
/// launcher reports a job's end once; a caller looping on the call (issue
/// 29: 576 calls in 0.6 s, each an incident, three events and a journal
/// line) is refused past its burst.
#[derive(Debug)]
pub struct StopLimiter {
    /// Per uid ([`Quota`] forgets the uids that have not called within a
    /// minute).
    pub(crate) quota: Quota<u32>,
}

impl StopLimiter {
    /// Buckets of `per_minute` tokens.
    pub fn new(per_minute: u32) -> Self {
        Self {
            quota: Quota::new(per_minute, Duration::from_secs(60)),
        }
    }

    /// Takes a token of `uid`'s bucket at `now`; else how long until one.
    pub fn take(&self, uid: u32, now: Instant) -> Result<(), Duration> {
        self.quota.take(&uid, now)
    }
}
