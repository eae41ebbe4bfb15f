//! Token buckets per caller ([`Quota`]): how often one caller may make the
//! agent do something costly. The job-stop quota per uid
//! ([`super::stop_limiter`]) and the checkpoint collector's quota per peer
//! ([`crate::ckpt::collect`]) are two of them.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Per key, a bucket holding `tokens`, refilled evenly over `period`. A
/// bucket that has refilled is forgotten, so the map holds only the keys
/// that took a token within the last `period`.
#[derive(Debug)]
pub struct Quota<K> {
    tokens: u32,
    period: Duration,
    /// Per key: the tokens left and when they were counted.
    pub(crate) buckets: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Eq + Hash + Clone> Quota<K> {
    /// Buckets of `tokens`, refilled over `period`.
    pub fn new(tokens: u32, period: Duration) -> Self {
        Self {
            tokens,
            period,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// The tokens a bucket holds, and the period they refill over.
    pub fn size(&self) -> (u32, Duration) {
        (self.tokens, self.period)
    }

    /// Takes a token of `key`'s bucket at `now`; else how long until one.
    pub fn take(&self, key: &K, now: Instant) -> Result<(), Duration> {
        let full = f64::from(self.tokens);
        let per_sec = full / self.period.as_secs_f64().max(1e-9);
        let level = |(tokens, at): (f64, Instant)| {
            (tokens + now.saturating_duration_since(at).as_secs_f64() * per_sec).min(full)
        };
        let mut b = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        b.retain(|_, v| level(*v) < full);
        let tokens = b.get(key).map_or(full, |v| level(*v));
        if tokens < 1.0 {
            return Err(Duration::from_secs_f64((1.0 - tokens) / per_sec));
        }
        b.insert(key.clone(), (tokens - 1.0, now));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_past_its_burst_waits_for_a_token_and_others_are_not_held() {
        let q = Quota::new(2, Duration::from_secs(10));
        let t = Instant::now();
        assert!(q.take(&"a", t).is_ok());
        assert!(q.take(&"a", t).is_ok());
        let wait = q.take(&"a", t).unwrap_err();
        assert!(
            (Duration::from_millis(4_900)..=Duration::from_millis(5_100)).contains(&wait),
            "one token comes back in period / tokens: {wait:?}"
        );
        assert!(q.take(&"b", t).is_ok(), "another key has its own bucket");
        assert!(q.take(&"a", t + Duration::from_secs(5)).is_ok());
        // Refilled buckets are forgotten.
        assert!(q.take(&"c", t + Duration::from_secs(60)).is_ok());
        assert_eq!(q.buckets.lock().unwrap().len(), 1);
    }
}
