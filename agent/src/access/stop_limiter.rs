//! The rate of ReportJobStop per uid ([`StopLimiter`]): the agent's state
//! holds one, the call takes from it. Its own module so that the state does
//! not import the call's module (which reads the state).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// ReportJobStop calls per uid: a token bucket per uid holding
/// `api.job_stops_per_minute` tokens, refilled evenly over a minute. A
/// launcher reports a job's end once; a caller looping on the call (issue
/// 29: 576 calls in 0.6 s, each an incident, three events and a journal
/// line) is refused past its burst.
#[derive(Debug)]
pub struct StopLimiter {
    /// Tokens a bucket holds, and gains per minute.
    per_minute: u32,
    /// Per uid: the tokens left and when they were counted. A bucket that
    /// has refilled is forgotten, so the map holds only the uids that
    /// called within the last minute.
    pub(crate) buckets: Mutex<HashMap<u32, (f64, Instant)>>,
}

impl StopLimiter {
    /// Buckets of `per_minute` tokens.
    pub fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a token of `uid`'s bucket at `now`; else how long until one.
    pub fn take(&self, uid: u32, now: Instant) -> Result<(), Duration> {
        let full = f64::from(self.per_minute);
        let per_sec = full / 60.0;
        let level = |(tokens, at): (f64, Instant)| {
            (tokens + now.saturating_duration_since(at).as_secs_f64() * per_sec).min(full)
        };
        let mut b = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        b.retain(|_, v| level(*v) < full);
        let tokens = b.get(&uid).map_or(full, |v| level(*v));
        if tokens < 1.0 {
            return Err(Duration::from_secs_f64((1.0 - tokens) / per_sec));
        }
        b.insert(uid, (tokens - 1.0, now));
        Ok(())
    }
}
