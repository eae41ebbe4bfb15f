//! The agent's answer to an exception that a rank reports and waits on
//! (`ReportException` with `awaits_decision`: `warden.run` caught it from
//! the training function and holds the rank until it knows what to do).
//!
//! In: the reporting rank and its exception's type and message. Out: a
//! transient class (attribution's exception rules, [`rules::exception_rule`])
//! asks every live local rank of the job to restart in process
//! ([`in_process::request`], the reporting rank included) and answers
//! `RESTART_IN_PROCESS` with the request's seq; anything else answers
//! `STOP`: the rank re-raises and exits, and attribution diagnoses that
//! exit as a crash with this exception, as for any uncaught one. So one
//! exception leads to one decision: a restart in process (the
//! `restart.requested` event, naming the rule) or the crash's incident.
//!
//! Bounded: at most the policy's `transient_software` budget of such restarts per
//! job within its window ([`in_process::admit_exception_restart`]); past
//! it the answer is `STOP`, and the crash goes through attribution and the
//! policy like any other.
//!
//! In dry run (`[policy] dry_run`) the answer is always `STOP`, saying what
//! would have been done.
//!
//! Never: open an incident of its own (the restart is asked as by hand:
//! no incident to escalate if the ranks do not acknowledge), or block (the
//! request is armed and its waiter runs on a task of its own).

use std::sync::Arc;

use warden_proto::v1 as pb;

use crate::act::in_process;
use crate::ranks::RankKey;
use crate::state::AgentState;
use warden_core::attribute::FaultClass;
use warden_core::attribute::rules;

/// Decides what a rank that waits on its exception does next (see the module).
pub fn decide(
    state: &Arc<AgentState>,
    key: &RankKey,
    exception_type: &str,
    message: &str,
) -> pb::ReportExceptionResponse {
    let rule = rules::exception_rule(exception_type, message);
    let name = rule.map_or("", |r| r.name);
    let stop = |reason: String| pb::ReportExceptionResponse {
        action: pb::Action::Stop as i32,
        seq: 0,
        rule: name.to_owned(),
        reason,
    };
    let Some(rule) = rule.filter(|r| r.class == FaultClass::TransientSoftware) else {
        return stop(match rule {
            Some(r) => format!(
                "{exception_type} is {} ({}: {}): a restart would not clear it",
                r.class, r.name, r.note
            ),
            None => format!("{exception_type} matches no transient exception rule"),
        });
    };
    if state.config.policy.dry_run {
        // Nothing is restarted in dry run: the rank re-raises, and its
        // crash's decision says what would have been done.
        return stop(format!(
            "dry run: would restart in process ({exception_type} is {}: {}); policy.dry_run",
            rule.class, rule.name
        ));
    }
    let budget = state.config.policy.for_class(FaultClass::TransientSoftware);
    let attempt = match in_process::admit_exception_restart(
        &state.restarts,
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
    match in_process::request(&state.in_process(), &key.job, &reason, "") {
        Ok(asked) => pb::ReportExceptionResponse {
            action: pb::Action::RestartInProcess as i32,
            seq: asked.seq,
            rule: rule.name.to_owned(),
            reason,
        },
        Err(e) => stop(format!("{reason}; no in-process restart: {e}")),
    }
}
