//! The SDC detector's link to the job's aggregator: the work loop owns the
//! detector (one thread); the aggregator report task (`exchange::report`)
//! runs on its own. Between them, this host's latest report and the
//! answers not yet judged.
//!
//! The work loop puts its detector's report here every tick
//! ([`PeerValues::set_outbox`]: each of its ranks' values at the steps not
//! judged yet); the report task sends it with its straggler report and
//! drops the aggregator's per-step statistics into the inbox
//! ([`PeerValues::receive`]), or names the jobs whose aggregator does not
//! aggregate values ([`PeerValues::alone`]: an older agent); the work loop
//! judges its own ranks from them on the next tick
//! ([`PeerValues::take_inbox`]). Only a rank's own agent judges it.
//!
//! Never: memory an aggregator controls beyond [`MAX_INBOX`] steps.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard, PoisonError};

use warden_core::detect::sdc::aggregate::{JobSteps, JobValues};

/// Most steps waiting in the inbox (the oldest answers are dropped past it).
pub const MAX_INBOX: usize = 262_144;

/// One rank's values at one step, as an older agent's exchange carries
/// them (`warden.v1.StepValue`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LegacyStepValue {
    /// The step.
    pub step: u64,
    /// Its loss, if reported.
    pub loss: Option<f64>,
    /// Its gradient norm, if reported.
    pub grad_norm: Option<f64>,
}

/// One rank's recent values, as an older agent's exchange carries them.
#[derive(Debug, Clone, PartialEq)]
pub struct LegacyRankValues {
    /// The job.
    pub job: String,
    /// Global rank.
    pub rank: u32,
    /// Its registration on its own agent.
    pub generation: u64,
    /// Oldest first.
    pub steps: Vec<LegacyStepValue>,
}

#[derive(Debug, Default)]
struct Inbox {
    answers: Vec<JobSteps>,
    steps: usize,
    alone: BTreeSet<String>,
}

/// This host's report and the aggregators' answers (see the module doc).
#[derive(Debug, Default)]
pub struct PeerValues {
    outbox: Mutex<Vec<JobValues>>,
    inbox: Mutex<Inbox>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PeerValues {
    /// This host's report, as of the work loop's latest tick.
    pub fn set_outbox(&self, report: Vec<JobValues>) {
        *lock(&self.outbox) = report;
    }

    /// What to send the aggregators.
    pub fn outbox(&self) -> Vec<JobValues> {
        lock(&self.outbox).clone()
    }

    /// This host's values as an older agent's exchange carries them.
    pub fn legacy_outbox(&self) -> Vec<LegacyRankValues> {
        lock(&self.outbox)
            .iter()
            .flat_map(|j| {
                j.ranks.iter().map(|r| LegacyRankValues {
                    job: j.job.clone(),
                    rank: r.rank,
                    generation: r.generation,
                    steps: r
                        .steps
                        .iter()
                        .map(|s| LegacyStepValue {
                            step: s.step,
                            loss: s.values[0],
                            grad_norm: s.values[1],
                        })
                        .collect(),
                })
            })
            .collect()
    }

    /// Takes an aggregator's per-step statistics for the next tick.
    pub fn receive(&self, answers: Vec<JobSteps>) {
        let mut inbox = lock(&self.inbox);
        for a in answers {
            inbox.steps += a.steps.len();
            inbox.alone.remove(&a.job);
            inbox.answers.push(a);
        }
        while inbox.steps > MAX_INBOX && !inbox.answers.is_empty() {
            let first = inbox.answers.remove(0);
            inbox.steps -= first.steps.len();
        }
    }

    /// Says that `jobs`' aggregator does not aggregate values: this host
    /// judges them with its own ranks only until one does.
    pub fn alone(&self, jobs: impl IntoIterator<Item = String>) {
        lock(&self.inbox).alone.extend(jobs);
    }

    /// The answers received since the last call, and the jobs to judge
    /// alone.
    pub fn take_inbox(&self) -> (Vec<JobSteps>, BTreeSet<String>) {
        let mut inbox = lock(&self.inbox);
        inbox.steps = 0;
        (
            std::mem::take(&mut inbox.answers),
            std::mem::take(&mut inbox.alone),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warden_core::detect::sdc::aggregate::StepStat;

    #[test]
    fn the_inbox_is_bounded_and_drained() {
        let p = PeerValues::default();
        let big = JobSteps {
            job: "j".into(),
            steps: vec![StepStat::default(); MAX_INBOX / 2 + 1],
        };
        p.receive(vec![big.clone(), big.clone(), big]);
        p.alone(["k".to_owned()]);
        let (got, alone) = p.take_inbox();
        assert_eq!(got.len(), 1, "the oldest dropped past the cap");
        assert!(alone.contains("k"));
        let (got, alone) = p.take_inbox();
        assert!(got.is_empty() && alone.is_empty());
    }
}
