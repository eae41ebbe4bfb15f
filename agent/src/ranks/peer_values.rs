//! The loss and gradient norm of every rank, shared with the peer agents so
//! the SDC detector compares a rank with its data-parallel peers on other
//! hosts too (with tensor parallelism inside a host, those are the only
//! peers a replica has).
//!
//! The work loop records its own ranks' values as the scan reads them
//! ([`PeerValues::record`]); the straggler exchange sends the newest
//! [`STEPS_SENT`] steps of each ([`PeerValues::outbox`]) and drops what a
//! peer sends into the inbox, which the work loop feeds to its detector on
//! the next tick ([`PeerValues::take_inbox`]). The detector takes each step
//! of a rank once, so values sent twice are harmless. Only a rank's own
//! agent publishes a suspect about it.
//!
//! Never: memory a peer controls beyond [`MAX_INBOX`] steps.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Steps of each rank sent per round.
pub const STEPS_SENT: usize = 64;
/// Most steps waiting in the inbox (the oldest are dropped past it).
pub const MAX_INBOX: usize = 262_144;

/// One rank's values at one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepValue {
    /// The step.
    pub step: u64,
    /// Its loss, if reported.
    pub loss: Option<f64>,
    /// Its gradient norm, if reported.
    pub grad_norm: Option<f64>,
}

/// One rank's recent values, as sent or received.
#[derive(Debug, Clone, PartialEq)]
pub struct RankValues {
    /// The job.
    pub job: String,
    /// Global rank.
    pub rank: u32,
    /// Its registration on its own agent.
    pub generation: u64,
    /// Oldest first.
    pub steps: Vec<StepValue>,
}

type Key = (String, u32);

/// This host's ranks' recent values and the peers' waiting to be judged.
#[derive(Debug, Default)]
pub struct PeerValues {
    own: Mutex<BTreeMap<Key, (u64, VecDeque<StepValue>)>>,
    inbox: Mutex<VecDeque<RankValues>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PeerValues {
    /// Records one of this host's ranks' values.
    pub fn record(&self, job: &str, rank: u32, generation: u64, v: StepValue) {
        let mut own = lock(&self.own);
        let e = own
            .entry((job.to_owned(), rank))
            .or_insert_with(|| (generation, VecDeque::new()));
        if e.0 != generation {
            *e = (generation, VecDeque::new());
        }
        if e.1.back().is_some_and(|b| b.step >= v.step) {
            return;
        }
        e.1.push_back(v);
        while e.1.len() > STEPS_SENT {
            e.1.pop_front();
        }
    }

    /// Forgets the ranks of jobs `live` says are gone.
    pub fn retain_jobs(&self, live: impl Fn(&str) -> bool) {
        lock(&self.own).retain(|(j, _), _| live(j));
    }

    /// What to send peers: each rank's newest steps.
    pub fn outbox(&self) -> Vec<RankValues> {
        lock(&self.own)
            .iter()
            .map(|((job, rank), (generation, steps))| RankValues {
                job: job.clone(),
                rank: *rank,
                generation: *generation,
                steps: steps.iter().copied().collect(),
            })
            .collect()
    }

    /// Takes a peer's values for the next tick.
    pub fn receive(&self, values: Vec<RankValues>) {
        let mut inbox = lock(&self.inbox);
        let mut held: usize = inbox.iter().map(|r| r.steps.len()).sum();
        for r in values {
            held += r.steps.len();
            inbox.push_back(r);
        }
        while held > MAX_INBOX {
            match inbox.pop_front() {
                Some(r) => held -= r.steps.len(),
                None => break,
            }
        }
    }

    /// The peers' values received since the last call.
    pub fn take_inbox(&self) -> Vec<RankValues> {
        lock(&self.inbox).drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(step: u64) -> StepValue {
        StepValue {
            step,
            loss: Some(1.0),
            grad_norm: None,
        }
    }

    #[test]
    fn own_values_are_kept_newest_and_restart_with_a_registration() {
        let p = PeerValues::default();
        for s in 0..100 {
            p.record("j", 0, 1, v(s));
        }
        p.record("j", 0, 1, v(50)); // an old step again: ignored
        let out = p.outbox();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].steps.len(), STEPS_SENT);
        assert_eq!(out[0].steps.last().map(|s| s.step), Some(99));
        p.record("j", 0, 2, v(0));
        assert_eq!(p.outbox()[0].steps, [v(0)]);
        p.retain_jobs(|_| false);
        assert!(p.outbox().is_empty());
    }

    #[test]
    fn the_inbox_is_bounded_and_drained() {
        let p = PeerValues::default();
        let big = RankValues {
            job: "j".into(),
            rank: 1,
            generation: 1,
            steps: vec![v(0); MAX_INBOX / 2 + 1],
        };
        p.receive(vec![big.clone(), big.clone(), big]);
        let got = p.take_inbox();
        assert_eq!(got.len(), 1, "the oldest dropped past the cap");
        assert!(p.take_inbox().is_empty());
    }
}
