//! Forgetting the hosts of a job's aggregate that stopped reporting: the
//! one sweep the straggler and the SDC aggregators share.
//!
//! In: each job's table of hosts with when each last reported, the ttl, the
//! clock. Out: the hosts past the ttl removed (by the table's own
//! `remove_host`, which takes their part out of the job's totals), jobs left
//! without hosts dropped. Never: a sweep more often than every quarter ttl
//! (it is O(hosts)).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A job's aggregate as the sweep sees it.
pub(crate) trait HostTable {
    /// Each host's name and when it last reported.
    fn heard(&self) -> impl Iterator<Item = (&String, Instant)>;
    /// Takes `host` and its part out of the aggregate.
    fn drop_host(&mut self, host: &str);
    /// No host left.
    fn no_hosts(&self) -> bool;
}

/// Forgets the hosts of `jobs` not heard from for `ttl`, at most every
/// quarter `ttl` (`swept`: the last sweep).
pub(crate) fn sweep<J: HostTable>(
    jobs: &mut HashMap<String, J>,
    swept: &mut Option<Instant>,
    ttl: Duration,
    now: Instant,
) {
    if swept.is_some_and(|at| now.saturating_duration_since(at) < ttl / 4) {
        return;
    }
    *swept = Some(now);
    for agg in jobs.values_mut() {
        let gone: Vec<String> = agg
            .heard()
            .filter(|(_, at)| now.saturating_duration_since(*at) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        for h in gone {
            agg.drop_host(&h);
        }
    }
    jobs.retain(|_, a| !a.no_hosts());
}
