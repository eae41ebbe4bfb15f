//! The task that feeds the ledger from the event bus, writes its journal
//! and sets its metrics.
//!
//! Events come with a wall-clock time; the ledger runs on CLOCK_MONOTONIC,
//! so each is converted by its age ([`warden_core::goodput::mono_of`]). The scan's steps
//! come from the work loop ([`warden_core::goodput::Goodput::observe_scan`]) into a buffer
//! that every taking of the ledger folds in first: this task's, before each
//! event (so a step the scan read before an incident is accounted before
//! it, as when the tick applied steps itself) and at each flush, so the
//! ledger never lags the scan by more than [`FLUSH_EVERY`]. This task never
//! touches the registry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;

use tokio_util::sync::CancellationToken;
use warden_core::events::EventBus;
use warden_core::events::{Event, Severity};
use warden_core::goodput::Goodput;
use warden_core::goodput::ledger::{Cause, ExitKind, Ledger, Occurrences};
use warden_core::goodput::mono_of;
use warden_core::signal::{Signal, StopKind, StopReason};

use crate::ranks::procfs::process_start_ns;

/// How often the journal is written and the gauges set.
pub const FLUSH_EVERY: Duration = Duration::from_secs(1);

/// Subscribes now (before the caller lets anything publish) and returns
/// the task to run; it ends when the agent shuts down, after a last flush.
/// An ended job's series are exported for `series_after_end` after it
/// ended (`goodput.series_after_end`), then removed.
pub fn start(
    events: &EventBus,
    goodput: Arc<Goodput>,
    shutdown: CancellationToken,
    series_after_end: Duration,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let mut sub = events.subscribe(None);
    async move {
        let mut tick = tokio::time::interval(FLUSH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen: BTreeMap<String, Occurrences> = BTreeMap::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => {
                    goodput.flush();
                    set_metrics(&goodput, &mut seen, series_after_end);
                }
                ev = sub.live.recv() => match ev {
                    Ok(ev) => apply(&mut goodput.ledger(), &ev),
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "goodput ledger missed events: the bus outran it");
                    }
                    Err(RecvError::Closed) => break,
                },
            }
        }
        goodput.flush();
    }
}

/// Applies one event to the ledger (pure but for reading a registering
/// process's start time from /proc). Reads the event's typed signal.
pub fn apply(l: &mut Ledger, ev: &Event) {
    let at = mono_of(ev.time);
    match &ev.signal {
        Signal::RankRegistered(r) => {
            let launch = process_start_ns(r.pid).unwrap_or(at);
            l.registered(&r.key.job, r.key.rank, r.pid, launch, at);
        }
        Signal::RankExited(r) => {
            let kind = match &r.stopped_by {
                Some(StopReason {
                    kind: StopKind::JobEnding,
                    ..
                }) => ExitKind::JobEnding,
                Some(StopReason {
                    kind: StopKind::Preempted,
                    ..
                }) => ExitKind::Preempted,
                // A launcher that got a signal was booked as stopping for a
                // restart before the kind was typed; kept so.
                Some(_) => ExitKind::StoppedForRestart,
                None if r.severity() == Severity::Info => ExitKind::Clean,
                None => ExitKind::Failed,
            };
            l.exited(&r.key.job, r.key.rank, r.pid, kind, at);
        }
        Signal::RankDeregistered { key } => l.exited(&key.job, key.rank, 0, ExitKind::Clean, at),
        Signal::RankHang(h) => l.incident(&h.key.job, at),
        Signal::RankRecovered { key, .. } => l.resumed(&key.job, at),
        Signal::RestartRequested(r) => l.resumed(&r.job, at),
        Signal::RankStraggler(s) => l.straggler(&s.key.job, s.key.rank, true),
        Signal::RankStragglerCleared { key, .. } => l.straggler(&key.job, key.rank, false),
        Signal::CkptSaved(c) => {
            if let Some(ns) = ms_to_ns(&format!("{:.3}", c.stall_ms)) {
                l.saved(&c.job, c.rank, ns);
            }
        }
        Signal::CkptRestored(c) => {
            if let Some(ns) = ms_to_ns(&format!("{:.3}", c.duration_ms)) {
                l.restored(&c.job, c.rank, ns);
            }
        }
        _ => {}
    }
}

/// Milliseconds as the event shows them (three decimals) into
/// nanoseconds; None for what is not a finite, non-negative number.
fn ms_to_ns(shown: &str) -> Option<i64> {
    let ms = shown.parse::<f64>().ok()?;
    if !ms.is_finite() || ms < 0.0 {
        return None;
    }
    #[allow(clippy::cast_possible_truncation)]
    Some((ms * 1e6) as i64)
}

/// Sets the gauges of the jobs still exported (running, or ended less than
/// `series_after_end` ago), removes every other job's series
/// ([`crate::telemetry::job_series::retain`]), and counts new occurrences.
fn set_metrics(
    goodput: &Goodput,
    seen: &mut BTreeMap<String, Occurrences>,
    series_after_end: Duration,
) {
    let now = warden_core::goodput::mono_now();
    let window = u64::try_from(series_after_end.as_nanos()).unwrap_or(u64::MAX);
    let ended = goodput.ended();
    let reports = goodput.reports(None);
    let exported: std::collections::BTreeSet<&str> = reports
        .iter()
        .map(|r| r.job.as_str())
        .filter(|j| {
            ended
                .get(*j)
                .is_none_or(|since| now.saturating_sub(*since) < window)
        })
        .collect();
    crate::telemetry::job_series::retain(|job| exported.contains(job));
    // The ledger dropped these jobs: nothing more to count for them.
    let known: std::collections::BTreeSet<&str> = reports.iter().map(|r| r.job.as_str()).collect();
    seen.retain(|job, _| known.contains(job.as_str()));
    for rep in &reports {
        if !exported.contains(rep.job.as_str()) {
            continue;
        }
        for c in Cause::ALL {
            metrics::gauge!("warden_goodput_seconds", "job" => rep.job.clone(), "cause" => c.as_str())
                .set(rep.parts.get(c) as f64 / 1e9);
        }
        metrics::gauge!("warden_goodput_ratio", "job" => rep.job.clone()).set(rep.goodput());
        let before = seen.entry(rep.job.clone()).or_default();
        for (kind, now, then) in [
            ("startup", rep.occ.startups.0, before.startups.0),
            ("detection", rep.occ.detections.0, before.detections.0),
            ("restart", rep.occ.restarts.0, before.restarts.0),
            ("restore", rep.occ.restores.0, before.restores.0),
            ("save", rep.occ.saves.0, before.saves.0),
        ] {
            if now > then {
                metrics::counter!("warden_goodput_occurrences_total", "kind" => kind)
                    .increment(now - then);
            }
        }
        *before = rep.occ;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_as_shown() {
        assert_eq!(ms_to_ns("1.500"), Some(1_500_000));
        assert_eq!(ms_to_ns("-1.000"), None);
        assert_eq!(ms_to_ns("NaN"), None);
        assert_eq!(ms_to_ns("inf"), None);
    }
}
