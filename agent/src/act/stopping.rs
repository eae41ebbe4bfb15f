//! A launcher stopping its ranks on purpose, as a use case: the ranks are
//! marked as being stopped by their launcher, so the scan no longer judges
//! them and their exits are `rank.exited` at Info with `stopped_by`, not
//! incidents; a preemption raises the job's notice first and names the
//! step its ranks save at.
//!
//! Why here and not at the gRPC edge: which ranks are marked, when the
//! notice is raised relative to the marking, and how far a caller's numbers
//! are believed are the registry's and the notice board's decisions. The
//! edge (`api::launcher_api`) decodes StopRanks, calls [`stop`] and maps
//! [`StopError`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_core::events::{EventBus, NewEvent, Severity};
use warden_core::signal::{StopKind, StopReason};

use crate::notice::{Notice, NoticeBoard, NoticeSource};
use crate::ranks::registry::SharedRegistry;

/// Longest reason kept from a launcher.
pub const MAX_REASON: usize = 256;

/// Longest lead a launcher may ask the notice's step to have (a caller's
/// number): a minute of steps.
const MAX_NOTICE_LEAD: Duration = Duration::from_secs(60);

/// Longest notice a launcher may announce: a deadline further away is
/// shown as this far (the word is for the ranks' information only).
const MAX_NOTICE_WINDOW: Duration = Duration::from_secs(3600);

/// What a launcher asks.
#[derive(Debug, Clone)]
pub struct StopAsk<'a> {
    /// The job.
    pub job: &'a str,
    /// Its ranks to stop; empty: every live one.
    pub ranks: &'a [u32],
    /// Why, as the ledger books it.
    pub kind: StopKind,
    /// Why, in words (clipped here to [`MAX_REASON`]).
    pub reason: &'a str,
    /// A preemption's deadline, Unix ms; 0: none said.
    pub notice_deadline_unix_ms: u64,
    /// A preemption's step, when the launcher names it (another host's).
    pub notice_save_at_step: Option<u64>,
    /// How far ahead of the furthest rank the step should be, when named
    /// here.
    pub notice_lead: Duration,
}

/// What was stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopping {
    /// The ranks marked, in order.
    pub ranks: Vec<u32>,
    /// The step the ranks save at, for a preemption.
    pub notice_save_at_step: Option<u64>,
}

/// Why a stop was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StopError {
    /// No job named.
    #[error("job_id is required: StopRanks marks the ranks of one job")]
    NoJob,
}

/// Marks `ask`'s ranks as stopped by their launcher and publishes
/// `ranks.stopping` naming them and the reason. A preemption raises the
/// job's notice before the ranks are marked (the tick that finds them
/// marked finds the notice too; only this job's ranks get it) and names
/// the step they save at now, not at the next tick, so the launcher can
/// tell the job's other hosts.
pub fn stop(
    registry: &SharedRegistry,
    notices: &NoticeBoard,
    events: &EventBus,
    ask: StopAsk<'_>,
) -> Result<Stopping, StopError> {
    if ask.job.is_empty() {
        return Err(StopError::NoJob);
    }
    let reason = match clip_reason(ask.reason) {
        r if r.is_empty() => "no reason given".to_owned(),
        r => r,
    };
    let stop = StopReason {
        kind: ask.kind,
        why: reason.clone(),
    };
    let preempted = stop.kind == StopKind::Preempted;
    if preempted {
        notices.raise_job(
            ask.job,
            launcher_notice(ask.notice_deadline_unix_ms, &reason),
        );
    }
    let (mut ranks, notice_save_at_step) = {
        let mut reg = registry.lock();
        let ranks = reg.mark_stopping(ask.job, ask.ranks, &stop);
        let step = preempted.then(|| {
            notices.name_step(
                ask.job,
                &reg,
                ask.notice_save_at_step,
                ask.notice_lead.min(MAX_NOTICE_LEAD),
            )
        });
        (ranks, step.flatten())
    };
    ranks.sort_unstable();
    if !ranks.is_empty() {
        events.publish(
            NewEvent::new(
                Severity::Info,
                "ranks.stopping",
                format!("job/{}", ask.job),
                format!(
                    "launcher stops ranks {} of job {}: {reason}",
                    list(&ranks),
                    ask.job
                ),
            )
            .with("job", ask.job)
            .with("ranks", list(&ranks))
            .with("reason", &reason),
        );
    }
    Ok(Stopping {
        ranks,
        notice_save_at_step,
    })
}

/// A launcher's notice: its deadline clamped to [now, now + 1 h] (a
/// caller's number, so bounded), none when it gave 0.
fn launcher_notice(deadline_unix_ms: u64, reason: &str) -> Notice {
    let now = SystemTime::now();
    let deadline = (deadline_unix_ms != 0).then(|| {
        let latest = now + MAX_NOTICE_WINDOW;
        UNIX_EPOCH
            .checked_add(Duration::from_millis(deadline_unix_ms))
            .map_or(latest, |at| at.clamp(now, latest))
    });
    Notice {
        source: NoticeSource::Launcher,
        what: reason.to_owned(),
        deadline,
        raised: now,
    }
}

fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The first [`MAX_REASON`] bytes of `s`, at a character boundary, with
/// control characters replaced.
pub fn clip_reason(s: &str) -> String {
    warden_core::text::clip_line(s, MAX_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_short_reasons_and_cuts_long_ones() {
        assert_eq!(clip_reason("restart 1"), "restart 1");
        assert_eq!(clip_reason("a\nb"), "a b");
        let long = "é".repeat(300);
        let c = clip_reason(&long);
        assert!(c.len() <= MAX_REASON && c.is_char_boundary(c.len()));
    }

    #[test]
    fn a_launchers_deadline_is_bounded_to_the_next_hour() {
        let far = launcher_notice(u64::MAX, "x").deadline.unwrap();
        let now = SystemTime::now();
        assert!(far <= now + MAX_NOTICE_WINDOW && far > now);
        let past = launcher_notice(1, "x").deadline.unwrap();
        assert!(past <= SystemTime::now() && past + Duration::from_secs(5) >= now);
        assert!(launcher_notice(0, "x").deadline.is_none());
    }
}
