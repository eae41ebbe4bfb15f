//! How long a due round waits before a decider writes it: the last call,
//! and the rejoin grace of each vanished member.
//!
//! In: the epoch the round would follow, what the plan says it waits for
//! ([`Wait`]), and the time. Out: until when it waits (none: write now).
//! Never: lets one member's wait eat another's. The last call and the grace
//! keep timers apart (a member that vanishes while a candidate's last call
//! runs gets its whole grace), and each vanished member's grace runs from
//! when a decider saw its key go, not from the first vanished member's: a
//! second launcher whose lease lapsed 1.9 s into the first's 2 s grace used
//! to be dropped 0.1 s later, its workers stopped though it was coming back.
//! The price is a later round for the first lost member, bounded: the round
//! comes no later than one grace more than the first's
//! ([`Waits::until`]), so hosts vanishing one after another cannot hold a
//! broken job for ever.
//!
//! Pure: the driver ([`super::session`]) reads the time and the view; this
//! keeps the timers, so they are tested without etcd.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

/// What a due round waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait<'a> {
    /// More hosts to arrive: this long from when the round first became due
    /// this way at this epoch.
    LastCall(Duration),
    /// The launchers of the vanished members `lost` (host ids) to
    /// re-register: each this long from when it was first seen gone.
    RejoinGrace {
        /// Each member's wait.
        grace: Duration,
        /// The members gone without a word now.
        lost: &'a [String],
    },
}

/// The driver's timers ([`Wait`]), kept for one epoch at a time.
#[derive(Debug, Default)]
pub(crate) struct Waits {
    /// The last call: at which epoch, since when.
    last_call: Option<(u64, Instant)>,
    /// The epoch the vanished members below belong to.
    vanished_at: u64,
    /// Each vanished member of that epoch's round, by host id: since when
    /// it is seen gone. A member that comes back is forgotten, so it gets a
    /// whole grace again if it goes again.
    vanished: HashMap<String, Instant>,
}

impl Waits {
    /// Forgets every timer: nothing is due, or the round was written.
    pub(crate) fn clear(&mut self) {
        self.last_call = None;
        self.vanished.clear();
    }

    /// Until when the round due after `epoch` waits for `wait`, as of
    /// `now`; None: it is due now.
    ///
    /// The rejoin grace ends when the newest vanished member's grace does,
    /// capped at one grace past the oldest one's: a lost member's round is
    /// late by at most one grace for the others, however many vanish after
    /// it.
    pub(crate) fn until(&mut self, epoch: u64, wait: Wait<'_>, now: Instant) -> Option<Instant> {
        let due = match wait {
            Wait::LastCall(last_call) => {
                // The plan asks for a last call only with no member lost:
                // every vanished one came back, and one that goes again
                // gets a whole grace.
                self.vanished.clear();
                let since = match self.last_call {
                    Some((e, t)) if e == epoch => t,
                    _ => {
                        self.last_call = Some((epoch, now));
                        now
                    }
                };
                since + last_call
            }
            Wait::RejoinGrace { grace, lost } => {
                if self.vanished_at != epoch {
                    self.vanished.clear();
                    self.vanished_at = epoch;
                }
                // O(lost): a partition may lose hundreds at once.
                let now_lost: HashSet<&str> = lost.iter().map(String::as_str).collect();
                self.vanished
                    .retain(|host, _| now_lost.contains(host.as_str()));
                for host in lost {
                    self.vanished.entry(host.clone()).or_insert(now);
                }
                let first = self.vanished.values().min().copied().unwrap_or(now);
                let newest = self.vanished.values().max().copied().unwrap_or(now);
                (newest + grace).min(first + grace + grace)
            }
        };
        (now < due).then_some(due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(2);

    fn grace(lost: &[String]) -> Wait<'_> {
        Wait::RejoinGrace { grace: GRACE, lost }
    }

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_member_vanished_later_gets_its_whole_grace() {
        let t0 = Instant::now();
        let mut w = Waits::default();
        let a = hosts(&["a"]);
        assert_eq!(w.until(4, grace(&a), t0), Some(t0 + GRACE));
        // b goes 1.9 s into a's grace: the round waits for b's too.
        let t1 = t0 + Duration::from_millis(1900);
        let ab = hosts(&["a", "b"]);
        assert_eq!(w.until(4, grace(&ab), t1), Some(t1 + GRACE));
        // Past a's grace, before b's: still waiting.
        let t2 = t0 + Duration::from_millis(2500);
        assert_eq!(w.until(4, grace(&ab), t2), Some(t1 + GRACE));
        assert_eq!(w.until(4, grace(&ab), t1 + GRACE), None);
    }

    #[test]
    fn members_vanishing_one_after_another_hold_the_round_one_grace_more_at_most() {
        let t0 = Instant::now();
        let mut w = Waits::default();
        let mut lost = Vec::new();
        let mut now = t0;
        // One every 1.5 s: b's grace holds the round to 3.5 s, c's is cut
        // at 4 s (one grace past a's).
        for (host, due) in [("a", 2000), ("b", 3500), ("c", 4000)] {
            lost.push(host.to_string());
            let want = t0 + Duration::from_millis(due);
            assert_eq!(w.until(7, grace(&lost), now), Some(want), "{host}");
            now += Duration::from_millis(1500);
        }
        // d, at 4.5 s, holds nothing.
        lost.push("d".into());
        assert_eq!(w.until(7, grace(&lost), now), None);
    }

    #[test]
    fn a_member_that_came_back_gets_a_whole_grace_if_it_goes_again() {
        let t0 = Instant::now();
        let mut w = Waits::default();
        let ab = hosts(&["a", "b"]);
        assert_eq!(w.until(1, grace(&ab), t0), Some(t0 + GRACE));
        // a re-registered; b is still gone: b's timer holds.
        let t1 = t0 + Duration::from_secs(1);
        let b = hosts(&["b"]);
        assert_eq!(w.until(1, grace(&b), t1), Some(t0 + GRACE));
        // a goes again: its grace counts from now.
        let t2 = t0 + Duration::from_millis(1500);
        assert_eq!(w.until(1, grace(&ab), t2), Some(t2 + GRACE));
    }

    #[test]
    fn a_new_epoch_starts_every_timer_again() {
        let t0 = Instant::now();
        let mut w = Waits::default();
        let a = hosts(&["a"]);
        let call = Wait::LastCall(Duration::from_millis(300));
        assert_eq!(w.until(1, grace(&a), t0), Some(t0 + GRACE));
        assert_eq!(w.until(1, call, t0), Some(t0 + Duration::from_millis(300)));
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(w.until(2, grace(&a), t1), Some(t1 + GRACE));
        assert_eq!(w.until(2, call, t1), Some(t1 + Duration::from_millis(300)));
    }

    #[test]
    fn the_last_call_and_the_grace_keep_apart() {
        let t0 = Instant::now();
        let mut w = Waits::default();
        let call = Wait::LastCall(Duration::from_secs(3));
        assert_eq!(w.until(3, call, t0), Some(t0 + Duration::from_secs(3)));
        // A member vanishes 2.9 s into the last call: its whole grace.
        let t1 = t0 + Duration::from_millis(2900);
        let a = hosts(&["a"]);
        assert_eq!(w.until(3, grace(&a), t1), Some(t1 + GRACE));
        // It comes back: the last call goes on from where it was.
        assert_eq!(w.until(3, call, t1), Some(t0 + Duration::from_secs(3)));
        assert_eq!(w.until(3, call, t0 + Duration::from_secs(3)), None);
        // It goes again: a whole grace from then, not from its first loss.
        let t2 = t0 + Duration::from_millis(3500);
        assert_eq!(w.until(3, grace(&a), t2), Some(t2 + GRACE));
        w.clear();
        assert_eq!(w.until(3, call, t1), Some(t1 + Duration::from_secs(3)));
    }
}
