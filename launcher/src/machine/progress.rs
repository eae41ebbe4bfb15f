//! The no-progress rule: whether the attempt that just failed moved the job
//! forward, judged from what the agent showed at the failure.
//!
//! In: two [`Progress`] observations, the one at the previous failure and
//! the one now. Out: an [`AttemptVerdict`] with the words the console and the
//! summary show. Never: I/O or a clock (the executor observes, the machine
//! counts the verdicts in a row against `--max-no-progress-restarts`).
//!
//! The measure, in order:
//!
//! 1. The job's newest complete checkpoint step in the agent's tier
//!    (ListCheckpoints, what `warden ckpt ls` shows): once either
//!    observation has one, only it counts; a step newer than the last one
//!    seen is progress, and nothing else is (steps trained and lost again
//!    are no progress).
//! 2. A job that never saved to the tier (its own checkpoints, or none):
//!    the step the failed attempt resumed from, as its ranks' reports show
//!    (GetRanks: the rank's step less the steps it completed since it
//!    registered, the highest over the attempt's ranks). That estimate is
//!    one step short when every rank was between steps, so only a resume
//!    point more than one step later than the previous one counts as
//!    progress: a checkpoint every step is not a real job's interval.
//!    It lags one attempt (a resume point says what the attempt before
//!    saved), so the rule counts the attempts before the failed one.
//! 3. Neither known (the agent did not answer, ranks without a client
//!    report no steps): not judged; the count in a row stays as it was.

/// What the agent showed of a job's progress when one of its attempts
/// failed: the answer to the machine's `Command::Observe`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// The newest step complete for every rank in the agent's checkpoint
    /// tier; None when it holds none of the job's (or has no tier).
    pub checkpoint: Option<u64>,
    /// The tier answered: a `checkpoint` of None means it holds none of
    /// the job's, not that it could not be asked.
    pub listed: bool,
    /// The step the failed attempt's ranks resumed from, from their
    /// reports; None when none reported a completed step.
    pub resumed_from: Option<u64>,
    /// What could not be read, for the console (an agent that did not
    /// answer, a tier that is off); empty when everything answered.
    pub note: String,
}

/// The rule's judgment of one failed attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptVerdict {
    /// The job moved forward (how).
    Advanced(String),
    /// It did not (what stayed where it was).
    Stalled(String),
    /// Nothing to judge from (why).
    Unjudged(String),
}

/// Judges the attempt that failed now, from the observation at the
/// previous failure (`before`) and the one now.
pub fn judge(before: &Progress, now: &Progress) -> AttemptVerdict {
    if before.checkpoint.is_some() || now.checkpoint.is_some() {
        return match (before.checkpoint, now.checkpoint) {
            (b, Some(n)) if b.is_none_or(|b| n > b) => AttemptVerdict::Advanced(format!(
                "the newest complete checkpoint went from {} to step {n}",
                b.map_or("none".to_owned(), |b| format!("step {b}"))
            )),
            (_, Some(n)) => {
                AttemptVerdict::Stalled(format!("the newest complete checkpoint is still step {n}"))
            }
            (Some(_), None) if !now.listed => {
                AttemptVerdict::Unjudged(format!("progress not observed: {}", now.note))
            }
            // The tier lost the job's checkpoints (retention, a scrub):
            // nothing newer, so no progress.
            (Some(b), None) => AttemptVerdict::Stalled(format!(
                "the agent's tier no longer holds a complete checkpoint (it held step {b})"
            )),
            (None, None) => AttemptVerdict::Unjudged("no checkpoint".into()),
        };
    }
    match (before.resumed_from, now.resumed_from) {
        (Some(b), Some(n)) if n > b.saturating_add(1) => AttemptVerdict::Advanced(format!(
            "no checkpoint in the agent's tier; the attempts resumed from step {b}, then step {n}"
        )),
        (Some(b), Some(n)) => AttemptVerdict::Stalled(format!(
            "no checkpoint in the agent's tier, and the ranks' steps show no resume point later than step {}",
            b.max(n)
        )),
        _ => AttemptVerdict::Unjudged(if now.note.is_empty() {
            "no checkpoint in the agent's tier and no steps reported by the ranks".into()
        } else {
            format!("progress not observed: {}", now.note)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ckpt(step: Option<u64>, resumed: Option<u64>) -> Progress {
        Progress {
            checkpoint: step,
            listed: true,
            resumed_from: resumed,
            note: String::new(),
        }
    }

    #[test]
    fn a_newer_complete_checkpoint_is_progress_and_the_same_one_is_not() {
        assert!(matches!(
            judge(&ckpt(None, Some(0)), &ckpt(Some(5), Some(0))),
            AttemptVerdict::Advanced(_)
        ));
        assert!(matches!(
            judge(&ckpt(Some(5), None), &ckpt(Some(10), None)),
            AttemptVerdict::Advanced(_)
        ));
        let v = judge(&ckpt(Some(10), Some(10)), &ckpt(Some(10), Some(30)));
        // Once the tier holds the job's checkpoints, the ranks' resume
        // points do not count.
        assert_eq!(
            v,
            AttemptVerdict::Stalled("the newest complete checkpoint is still step 10".into())
        );
        assert!(matches!(
            judge(&ckpt(Some(10), None), &ckpt(None, None)),
            AttemptVerdict::Stalled(_)
        ));
        // A tier that did not answer has not lost anything.
        let unanswered = Progress {
            note: "ListCheckpoints timed out".into(),
            ..Progress::default()
        };
        assert_eq!(
            judge(&ckpt(Some(10), None), &unanswered),
            AttemptVerdict::Unjudged("progress not observed: ListCheckpoints timed out".into())
        );
    }

    #[test]
    fn without_the_tier_the_resume_point_must_move_by_more_than_one_step() {
        assert!(matches!(
            judge(&ckpt(None, Some(0)), &ckpt(None, Some(0))),
            AttemptVerdict::Stalled(_)
        ));
        assert!(matches!(
            judge(&ckpt(None, Some(4)), &ckpt(None, Some(5))),
            AttemptVerdict::Stalled(_)
        ));
        assert!(matches!(
            judge(&ckpt(None, Some(5)), &ckpt(None, Some(10))),
            AttemptVerdict::Advanced(_)
        ));
    }

    #[test]
    fn nothing_observed_is_not_judged() {
        let none = Progress {
            note: "GetRanks: unavailable".into(),
            ..Progress::default()
        };
        assert_eq!(
            judge(&ckpt(None, Some(3)), &none),
            AttemptVerdict::Unjudged("progress not observed: GetRanks: unavailable".into())
        );
        assert!(matches!(
            judge(&Progress::default(), &Progress::default()),
            AttemptVerdict::Unjudged(_)
        ));
    }
}
