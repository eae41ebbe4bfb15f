//! Restart requests: who asks (a `restart_in_process` decision, a
//! `RequestRestart` call, a rank's transient exception) and what is sent.
//!
//! In: a job, why, and the incident that asked ("" by hand). Out: a new
//! request (a sequence number, the job's next restart count) set in each
//! live local rank's slot and on its `Control` stream, the event
//! `restart.requested`, and the waiter that follows it (`mod.rs`); or the
//! request in flight, joined. The budget of restarts a rank's own
//! exception may ask for ([`admit_exception_restart`]).
//!
//! Never: ask a rank that is not alive, or a slot another registration
//! holds now; hold the registry's lock and the restarts' at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::Notify;
use warden_core::attribute::{Escalation, IncidentRecord};
use warden_core::events::{NewEvent, Severity};
use warden_core::policy::Action;
use warden_core::signal::{RestartRequested, Signal};
use warden_slot::ControlWord;

use super::control::RankRequest;
use super::waiter::{JobRestart, Waiter, WaiterInput};
use super::{Answered, Handles, Pending, Restarts, now, step, wait};
use crate::ranks::RankKey;
use crate::ranks::registry::RankState;

/// What a request asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The ranks asked (the job's live local ranks), ascending.
    pub ranks: Vec<u32>,
    /// The request's sequence number.
    pub seq: u64,
    /// The restart count the ranks run with.
    pub restart_count: u32,
    /// True when the job already had a request in flight, which this one
    /// joined (no new sequence number, nobody asked twice).
    pub joined: bool,
}

/// Why a restart could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    /// The request named no job.
    #[error("job_id must be set")]
    EmptyJob,
    /// Nothing to restart here.
    #[error("job {job:?} has no live rank on this agent")]
    NoLiveRanks {
        /// The job.
        job: String,
    },
}

/// Carries out a `restart_in_process` decision: asks every live local rank
/// of the incident's job. With none alive there is nothing to restart in
/// process: the incident is escalated to `restart_in_job` at once.
///
/// A decision about evidence that the job's last restart already followed
/// is carried out: it is said (`restart.already_done`), not asked again
/// ([`already_done`]). A launcher heals a rank's exit at once
/// (`RequestRestart`, then the rank started again) while the agent's
/// diagnosis of the same exit settles; a second request then would restart
/// the healed ranks into another attempt than the replacement's, and the
/// job would hang.
pub fn start(state: &Handles, record: &IncidentRecord) {
    if let Some(how) = already_done(state, record) {
        state.events.publish(
            NewEvent::new(
                Severity::Info,
                "restart.already_done",
                format!("job/{}", record.job),
                format!(
                    "job {}: {}'s restart in process is already done: {how}",
                    record.job, record.id
                ),
            )
            .with("incident", record.id.clone())
            .with("covered_by", how),
        );
        return;
    }
    let reason = record.decision.as_ref().map_or_else(
        || format!("incident {}", record.id),
        |d| format!("{}: {}", record.id, d.reason),
    );
    match request(state, &record.job, &reason, &record.id) {
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(incident = %record.id, error = %e, "no in-process restart; escalating to restart_in_job");
            let _ = state.escalations.send(Escalation {
                incident: record.id.clone(),
                action: Action::RestartInJob,
                reason: format!("in-process restart impossible: {e}"),
                replace: None,
            });
        }
    }
}

/// How the job's last restart already followed every piece of `record`'s
/// evidence, with no request in flight now (one in flight is joined
/// instead): it was asked after the newest piece (a launcher's heal of the
/// exit the record is about), or every rank of the record answered it after
/// that piece (a rank that left during the restart, handled by its
/// launcher, which started it again in that restart). None: not followed,
/// or nothing to tell (no evidence, no rank named).
fn already_done(state: &Handles, record: &IncidentRecord) -> Option<String> {
    let newest = record.diagnosis.evidence.iter().map(|e| e.at).max()?;
    let g = state.restarts.lock();
    let job = g.jobs.get(&record.job)?;
    if job.pending.is_some() {
        return None;
    }
    let last = job.last_answered.as_ref()?;
    let since = |t: SystemTime| t.duration_since(newest).map_or(0, |d| d.as_millis());
    if last.asked_at > newest {
        return Some(format!(
            "the job's last restart was asked {} ms after its newest evidence and every rank answered it",
            since(last.asked_at)
        ));
    }
    let all_after = !record.ranks.is_empty()
        && record
            .ranks
            .iter()
            .all(|r| last.ranks.get(r).is_some_and(|&at| at > newest));
    all_after.then(|| {
        format!(
            "ranks {} answered the job's last restart (acknowledged, or handled by their launcher) \
             after its newest evidence",
            warden_core::signal::join_ranks(&record.ranks)
        )
    })
}

/// As [`request`], for a caller that starts the job's ranks again itself
/// (its launcher healing a rank, `RequestRestartRequest.replacing`): where
/// no rank of the job lives here (a host whose only rank died, its peers
/// on other hosts), the restart is recorded instead of refused. The count
/// advances and the restart counts as answered at once, so the decision
/// the agent makes about the same crash is not carried out again
/// ([`start`], `restart.already_done`): it would find no rank to restart
/// and escalate to a restart in job of a heal that is under way.
pub fn request_replacing(
    state: &Handles,
    job: &str,
    reason: &str,
    incident: &str,
) -> Result<Asked, RestartError> {
    match request(state, job, reason, incident) {
        Err(RestartError::NoLiveRanks { .. }) => {
            let mut g = state.restarts.lock();
            let (seq, entry) = g.next_request(job);
            entry.last_answered = Some(Answered {
                asked_at: SystemTime::now(),
                ranks: HashMap::new(),
            });
            tracing::info!(
                job,
                reason,
                count = entry.restart_count,
                "no rank of the job lives here: its launcher starts it again in this restart"
            );
            Ok(Asked {
                ranks: Vec::new(),
                seq: u64::from(seq),
                restart_count: entry.restart_count,
                joined: false,
            })
        }
        other => other,
    }
}

/// Asks every live local rank of `job` to restart in process; `incident`
/// is "" when asked by hand. A job whose previous request is still in
/// flight joins it (see [`Asked::joined`]).
pub fn request(
    state: &Handles,
    job: &str,
    reason: &str,
    incident: &str,
) -> Result<Asked, RestartError> {
    if job.is_empty() {
        return Err(RestartError::EmptyJob);
    }
    let (live, world_size) = live_ranks(state, job);
    if live.is_empty() {
        return Err(RestartError::NoLiveRanks {
            job: job.to_owned(),
        });
    }
    let mut g = state.restarts.lock();
    if let Some(p) = g.jobs.get_mut(job).and_then(|j| j.pending.as_mut()) {
        step(
            &mut p.waiter,
            WaiterInput::Joined {
                incident: incident.to_owned(),
            },
            now(),
        );
        return Ok(Asked {
            ranks: p.waiter.ranks(),
            seq: p.waiter.request().seq,
            restart_count: p.waiter.request().restart_count,
            joined: true,
        });
    }
    let (seq, entry) = g.next_request(job);
    let req = JobRestart {
        job: job.to_owned(),
        seq: u64::from(seq),
        restart_count: entry.restart_count,
        incident: incident.to_owned(),
        reason: reason.to_owned(),
    };
    let wake = Arc::new(Notify::new());
    let timeout = state.timeout;
    entry.pending = Some(Pending {
        waiter: Waiter::new(req.clone(), &live, world_size, now(), timeout),
        wake: wake.clone(),
        asked_at: SystemTime::now(),
    });
    for &(rank, generation, _) in &live {
        let key = RankKey {
            job: job.to_owned(),
            rank,
        };
        g.streams.send(
            key,
            RankRequest {
                generation,
                request: req.clone(),
            },
        );
    }
    drop(g);
    // The slots, after the streams are armed (the registry's lock alone).
    set_slots(
        state,
        job,
        &live,
        ControlWord::restart(seq, req.restart_count),
    );
    let ranks: Vec<u32> = live.iter().map(|&(r, _, _)| r).collect();
    state
        .events
        .publish(Signal::RestartRequested(RestartRequested {
            job: job.to_owned(),
            seq: req.seq,
            restart_count: req.restart_count,
            ranks: ranks.clone(),
            incident: incident.to_owned(),
            reason: reason.to_owned(),
            timeout,
        }));
    tokio::spawn(wait(state.clone(), req.clone(), wake));
    Ok(Asked {
        ranks,
        seq: req.seq,
        restart_count: req.restart_count,
        joined: false,
    })
}

/// The job's live local ranks (rank, generation, slot) and its world size
/// as its ranks declared it, from the registry (its lock only).
fn live_ranks(state: &Handles, job: &str) -> (Vec<(u32, u64, u32)>, u32) {
    let reg = state.registry();
    let entries: Vec<_> = reg
        .ranks
        .values()
        .filter(|e| {
            e.key.job == job
                && e.holds_slot
                && matches!(e.state, RankState::Running | RankState::Hung)
        })
        .collect();
    (
        entries
            .iter()
            .map(|e| (e.key.rank, e.generation, e.slot))
            .collect(),
        entries.iter().map(|e| e.world_size).max().unwrap_or(0),
    )
}

/// Sets `word` in the slot of each of `live` (rank, generation, slot) that
/// the rank still holds with that generation: after a rebuild or
/// re-registration the index may be another rank's.
fn set_slots(state: &Handles, job: &str, live: &[(u32, u64, u32)], word: ControlWord) {
    let word = word.encode();
    let now_ns = warden_slot::clock::syscall_now();
    let mut reg = state.registry();
    for &(rank, generation, slot) in live {
        let key = RankKey {
            job: job.to_owned(),
            rank,
        };
        let Some(entry) = reg
            .ranks
            .get_mut(&key)
            .filter(|e| e.holds_slot && e.generation == generation && e.slot == slot)
        else {
            continue;
        };
        entry.restart_asked(now_ns);
        if let Err(e) = reg.slots().set_control(slot, word) {
            tracing::warn!(rank = %key, error = %e, "cannot set the restart request in the slot");
        }
    }
}

/// Whether a rank's transient exception may restart its job in process
/// once more: at most `budget` such restarts within `window` per job (the
/// policy's `transient_software` budget), so an exception that comes back on every
/// attempt ends in the crash's own diagnosis and policy rather than in
/// restarts forever. A request already in flight for the job is joined and
/// not counted again. `Ok(attempt)` (1-based), or `Err(spent)`.
pub fn admit_exception_restart(
    restarts: &Restarts,
    job: &str,
    budget: u32,
    window: Duration,
    now: Instant,
) -> Result<u32, u32> {
    let mut g = restarts.lock();
    let entry = g.jobs.entry(job.to_owned()).or_default();
    while entry
        .exception_restarts
        .front()
        .is_some_and(|&at| now.saturating_duration_since(at) > window)
    {
        entry.exception_restarts.pop_front();
    }
    let spent = u32::try_from(entry.exception_restarts.len()).unwrap_or(u32::MAX);
    if entry.pending.is_some() {
        return Ok(spent.max(1));
    }
    if spent >= budget {
        return Err(spent);
    }
    entry.exception_restarts.push_back(now);
    Ok(spent + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exception_restarts_are_bounded_per_job_and_window() {
        let r = Restarts::new();
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Ok(1));
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Ok(2));
        // Spent for job a, not for job b.
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Err(2));
        assert_eq!(admit_exception_restart(&r, "b", 2, w, t0), Ok(1));
        // Out of the window, the oldest no longer counts.
        let later = t0 + w + Duration::from_secs(1);
        assert_eq!(admit_exception_restart(&r, "a", 2, w, later), Ok(1));
        // A budget of 0 admits none.
        assert_eq!(admit_exception_restart(&r, "c", 0, w, t0), Err(0));
    }
}
