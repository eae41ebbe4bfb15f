//! The agent's answer to an exception that a rank reports and waits on
//! (`ReportException` with `awaits_decision`: `warden.run` caught it from
//! the training function and holds the rank until it knows what to do).
//!
//! In: the reporting rank and its exception's type and message. Out: a
//! transient class (attribution's exception rules, [`rules::exception_rule`])
//! asks every live local rank of the job to restart in process
//! ([`super::request`], the reporting rank included) and answers
//! [`ExceptionAnswer::Restart`] with the request's seq; anything else answers
//! [`ExceptionAnswer::Stop`]: the rank re-raises and exits, and attribution
//! diagnoses that exit as a crash with this exception, as for any uncaught
//! one. So one exception leads to one decision: a restart in process (the
//! `restart.requested` event, naming the rule) or the crash's incident.
//!
//! Bounded: at most the policy's `transient_software` budget of such
//! restarts per job within its window ([`super::admit_exception_restart`]);
//! past it the answer is `Stop`, and the crash goes through attribution and
//! the policy like any other.
//!
//! In dry run (`[policy] dry_run`) the answer is always `Stop`, saying what
//! would have been done.
//!
//! A rank that already took the job's request in flight (acknowledged it;
//! the other ranks have not all) is answered `Stop`, not joined to it: the
//! exception comes from its new attempt, and the request it would be
//! answered with is one it took, so it would wait for it in vain (the
//! client's 5 s) and leave anyway. It leaves at once; its exit is healed
//! from a live replica or decided as a crash.
//!
//! Never: open an incident of its own (the restart is asked as by hand:
//! no incident to escalate if the ranks do not acknowledge), or block (the
//! request is armed and its waiter runs on a task of its own).

use warden_core::attribute::FaultClass;
use warden_core::attribute::rules;
use warden_core::policy::PolicyConfig;

use super::Handles;
use crate::ranks::RankKey;
use crate::ranks::admit::{Reported, report_exception};

/// What a rank waiting on its exception does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExceptionAnswer {
    /// Restart in process: the request `seq` is in every live rank's slot.
    Restart {
        /// The request's sequence number.
        seq: u64,
        /// The exception rule that matched.
        rule: &'static str,
        /// Why, for the rank's log.
        reason: String,
    },
    /// Re-raise and exit; attribution takes the crash.
    Stop {
        /// The exception rule that matched, if one did.
        rule: &'static str,
        /// Why not a restart.
        reason: String,
    },
}

/// The use case of a reported exception: publishes `rank.exception`
/// (`ranks::admit::report_exception`, bounded there) and, when the rank
/// waits on it, decides what it does next ([`decide`], after the event, so
/// the decision's `restart.requested` follows it). None: nobody waits (an
/// uncaught exception, or a rank that did not ask).
pub fn report(h: &Handles, policy: &PolicyConfig, reported: Reported) -> Option<ExceptionAnswer> {
    let launcher_only = h
        .registry()
        .ranks
        .get(&reported.key)
        .is_some_and(|e| e.launcher_only());
    let key = reported.key.clone();
    let (exception_type, message) = (reported.exception_type.clone(), reported.message.clone());
    report_exception(&h.events, launcher_only, reported)
        .then(|| decide(h, policy, &key, &exception_type, &message))
}

/// Decides what a rank that waits on its exception does next (see the module).
pub fn decide(
    h: &Handles,
    policy: &PolicyConfig,
    key: &RankKey,
    exception_type: &str,
    message: &str,
) -> ExceptionAnswer {
    let rule = rules::exception_rule(exception_type, message);
    let name = rule.map_or("", |r| r.name);
    let stop = |reason: String| ExceptionAnswer::Stop { rule: name, reason };
    let Some(rule) = rule.filter(|r| r.class == FaultClass::TransientSoftware) else {
        return stop(match rule {
            Some(r) => format!(
                "{exception_type} is {} ({}: {}): a restart would not clear it",
                r.class, r.name, r.note
            ),
            None => format!("{exception_type} matches no transient exception rule"),
        });
    };
    if policy.dry_run {
        // Nothing is restarted in dry run: the rank re-raises, and its
        // crash's decision says what would have been done.
        return stop(format!(
            "dry run: would restart in process ({exception_type} is {}: {}); policy.dry_run",
            rule.class, rule.name
        ));
    }
    if let Some(seq) = h.restarts.answered_in_flight(key) {
        // Joining would answer with a request this rank has already taken:
        // it would wait for it in vain (the client's 5 s), then leave. It
        // leaves now; its exit is healed from a live replica or decided as
        // a crash.
        return stop(format!(
            "{key} reported {exception_type} after it took in-process restart request {seq}, \
             which the job's other ranks have not all taken yet: this rank leaves, and its \
             exit is handled as a crash"
        ));
    }
    let budget = policy.for_class(FaultClass::TransientSoftware);
    let attempt = match super::admit_exception_restart(
        &h.restarts,
        &key.job,
        budget.budget,
        budget.window,
        std::time::Instant::now(),
    ) {
        Ok(attempt) => attempt,
        Err(spent) => {
            return stop(format!(
                "{key} reported {exception_type} ({}): the in-process restarts it may ask for \
                 are spent ({spent} of {} in {}: policy.transient_software.budget)",
                rule.name,
                budget.budget,
                humantime::format_duration(budget.window)
            ));
        }
    };
    let reason = format!(
        "{key} reported {exception_type} ({}: {}), in-process restart {attempt} of {} in {}",
        rule.name,
        rule.note,
        budget.budget,
        humantime::format_duration(budget.window)
    );
    match super::request(h, &key.job, &reason, "") {
        Ok(asked) => ExceptionAnswer::Restart {
            seq: asked.seq,
            rule: rule.name,
            reason,
        },
        Err(e) => stop(format!("{reason}; no in-process restart: {e}")),
    }
}
