//! The work loop: one tick drives the periodic work and the watchdog.
//!
//! Every `agent.tick` it scans the ranks' heartbeat slots (hang detection),
//! reports ranks whose processes it cannot see (`ranks/pid_visibility`),
//! marks sources stuck in a call as stalled, and pings the systemd
//! watchdog. Pinging from here (not from a timer of its own) means a loop
//! that stops turning stops the pings, and systemd restarts the agent.

use std::sync::Arc;
use std::time::Instant;

use tokio::time::MissedTickBehavior;

use super::notify::{self, Watchdog};
use crate::ranks::{evidence, scan};
use crate::sources::runner::Sources;
use warden_core::detect::sdc::{Basis, SdcDetector, SdcFinding};
use warden_core::health::{ComponentReport, ReasonKind, Status};
use warden_core::rank::RankKey;
use warden_core::signal::{RankHang, Report, SdcSuspect, Signal};

/// How often changed hang calibrations are written to the state directory.
const CALIBRATION_SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
use crate::state::AgentState;

/// Runs until the agent shuts down.
pub async fn run(state: Arc<AgentState>, mut watchdog: Watchdog, sources: Sources) {
    let cfg = &state.config;
    let mut ticker = tokio::time::interval(cfg.agent.tick);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    state.apply_report(ComponentReport {
        id: "agent".into(),
        kind: "agent".into(),
        labels: [("version".to_owned(), crate::VERSION.to_owned())].into(),
        status_override: None,
        reasons: Vec::new(),
    });
    let mut last_status = None;
    let mut pids_hidden = 0;
    let mut prev_ns = warden_slot::clock::syscall_now();
    let mut sdc = SdcDetector::new(cfg.sdc.clone());
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = Instant::now();
        let now_ns = warden_slot::clock::syscall_now();
        let (result, live_jobs, noticed) = {
            let mut reg = state.registry();
            // Before the scan: a rank marked as stopping on a notice is not
            // judged for hangs while it saves.
            state.notices.forget_ended(&reg);
            let noticed = state.notices.tell(&mut reg);
            let result = scan::scan(&mut reg, &cfg.hang, now_ns, prev_ns);
            reg.save_calibrations(CALIBRATION_SAVE_EVERY, false);
            let live_jobs: Vec<String> = reg.jobs.keys().cloned().collect();
            (result, live_jobs, noticed)
        };
        for ev in noticed {
            state.events.publish(ev);
        }
        state.notices.report(&state.health_reporter());
        sdc.retain_jobs(|j| live_jobs.iter().any(|l| l == j));
        prev_ns = now_ns;
        state.goodput.observe_scan(result.goodput, now_ns);
        report_pid_visibility(&state, &mut pids_hidden);
        metrics::histogram!("warden_scan_seconds").record(now.elapsed().as_secs_f64());
        metrics::gauge!("warden_ranks_watched").set(result.scanned as f64);
        for ev in result.events {
            state.events.publish(ev);
        }
        state.hang_board.set_live(result.positions);
        for finding in result.hangs {
            metrics::counter!("warden_rank_hangs_total").increment(1);
            let wants_stack = finding.stack_dump.is_some() && cfg.hang.stack_dump;
            let hang = Signal::RankHang(RankHang {
                key: finding.key.clone(),
                facts: finding.facts.clone(),
                report: Report {
                    message: finding.message.clone(),
                    evidence: finding.evidence.clone(),
                },
                stack_requested: wants_stack,
            });
            let id = state.events.publish(hang).id;
            if state.hang_board.on_hang(&finding.key.job) {
                tokio::spawn(crate::hang::verdict::follow_up(
                    state.hang_board.clone(),
                    state.events.clone(),
                    state.in_process(),
                    finding.key.job.clone(),
                    id,
                    (cfg.hang.verdict_wait, cfg.hang.stack_dump_wait),
                ));
            }
            if wants_stack {
                tokio::spawn(evidence::stack_follow_up(
                    state.events.clone(),
                    cfg.hang.stack_dump_wait,
                    finding,
                    id,
                ));
            }
        }
        run_sdc(&state, &mut sdc, result.values, now);
        // Straggler scores from the steps the scan just read (outside the
        // registry lock but for a short copy).
        run_stragglers(&state, now);
        sources.check_stalls(&state.health_reporter(), cfg.agent.source_stall_after);
        let node = state.health.snapshot();
        if last_status != Some((node.status, node.version)) {
            last_status = Some((node.status, node.version));
            notify::status(&status_line(&node));
        }
        watchdog.tick(now);
    }
}

/// Whether this agent's jobs have an aggregator task (`exchange::report`):
/// then the SDC values go to it, else they are judged here, in place.
fn reports_to_aggregator(state: &AgentState) -> bool {
    let cfg = &state.config.straggler;
    cfg.enabled && (!cfg.peers.is_empty() || state.checkpoints.is_ok())
}

/// Feeds the values the scan read to the SDC detector, hands its report to
/// the aggregator task (or judges in place when there is none), judges this
/// host's ranks from the job-wide statistics that came back, and publishes
/// each new suspect as `rank.sdc_suspect`, with `warden_sdc_suspects_total`.
fn run_sdc(state: &AgentState, det: &mut SdcDetector, values: Vec<scan::StepValues>, now: Instant) {
    if !state.config.sdc.enabled {
        return;
    }
    for v in values {
        det.observe(
            &v.key.job,
            v.key.rank,
            v.generation,
            v.step,
            v.loss,
            v.grad_norm,
        );
    }
    let findings = if reports_to_aggregator(state) {
        state.peer_values.set_outbox(det.report());
        let (answers, alone) = state.peer_values.take_inbox();
        let mut f = det.take_answer(answers);
        if !alone.is_empty() {
            f.extend(det.judge_jobs(|j| alone.contains(j), now));
        }
        f
    } else {
        det.judge(now)
    };
    for f in findings {
        // Only this host's ranks are judged here (each host judges its
        // own against the job-wide statistics).
        metrics::counter!(
            "warden_sdc_suspects_total",
            "metric" => f.metric.as_str(),
            "basis" => f.basis.as_str()
        )
        .increment(1);
        state.events.publish(Signal::RankSdcSuspect(sdc_signal(f)));
    }
}

/// A finding as the typed signal, with its evidence for a person.
fn sdc_signal(f: SdcFinding) -> SdcSuspect {
    let key = RankKey {
        job: f.job.clone(),
        rank: f.rank,
    };
    let fmt = |v: Option<f64>| v.map_or_else(|| "none".to_owned(), |v| format!("{v:.6}"));
    let message = match f.basis {
        Basis::NonFinite | Basis::NonFiniteAlone => format!(
            "{key}: {} is {} at step {} (job median {}): silent data corruption suspected",
            f.metric.as_str(),
            f.value,
            f.step,
            fmt(f.job_median)
        ),
        Basis::Peers | Basis::OwnHistory => format!(
            "{key}: {} {:.6} at step {} departs from the job median {} ({} robust deviations): silent data corruption suspected",
            f.metric.as_str(),
            f.value,
            f.step,
            fmt(f.job_median),
            f.score
                .map_or_else(|| "none".to_owned(), |z| format!("{z:.1}"))
        ),
    };
    let mut report = Report::new(message)
        .with("step", f.step)
        .with("metric", f.metric.as_str())
        .with("value", f.value)
        .with("job_median", fmt(f.job_median))
        .with("score", fmt(f.score))
        .with("basis", f.basis.as_str())
        .with("ranks_compared", f.ranks);
    if let Some(m) = f.own_median {
        report = report.with("own_median", format!("{m:.6}"));
    }
    SdcSuspect {
        key,
        step: f.step,
        metric: f.metric.as_str().to_owned(),
        value: f.value,
        job_median: f.job_median,
        score: f.score,
        basis: f.basis.as_str().to_owned(),
        report,
    }
}

/// Runs the straggler detector for one tick when it is on: starts the peer
/// exchange the first time when peers are configured, and publishes the
/// flag changes.
pub(crate) fn run_stragglers(state: &Arc<AgentState>, now: Instant) {
    let cfg = &state.config.straggler;
    if !cfg.enabled {
        return;
    }
    let det = state.stragglers();
    // With checkpoints on, a multi-host job's launcher may hand over its
    // peers (SetCheckpointPeers): the exchange carries a hang's positions
    // to them even without `straggler.peers`.
    if (!cfg.peers.is_empty() || state.checkpoints.is_ok()) && det.claim_exchange() {
        crate::exchange::report::spawn_reports(state.exchange.clone(), det.clone());
    }
    let wall = std::time::SystemTime::now();
    for signal in crate::ranks::stragglers::tick(&det, &state.ranks, &state.health, now, wall) {
        state.events.publish(signal);
    }
}

/// Component `ranks/pid_visibility`: UNKNOWN while ranks registered from
/// outside the agent's PID namespace (SO_PEERCRED gave no pid), whose exits,
/// process state and stack dumps the agent cannot see; OK once they are
/// gone; absent until the first such rank (a host agent or a sidecar that
/// shares the process namespace never shows it). `shown` is the count last
/// reported.
fn report_pid_visibility(state: &AgentState, shown: &mut usize) {
    let (hidden, live) = state.registry().pid_visibility();
    if hidden == *shown {
        return;
    }
    *shown = hidden;
    let reasons = if hidden == 0 {
        Vec::new()
    } else {
        vec![warden_core::health::Reason {
            status: Status::Unknown,
            kind: ReasonKind::Judged,
            signal: "ranks.pid_visible".into(),
            value: format!("{hidden} of {live} ranks"),
            threshold: "all ranks".into(),
            window: String::new(),
            since: std::time::SystemTime::now(),
            message: format!(
                "{hidden} of {live} ranks run in a PID namespace the agent cannot see: their exits, process state and stack dumps are not watched, hangs only through heartbeats; share the process namespace (shareProcessNamespace, docker --pid container:NAME) or run the agent with the host's (hostPID)"
            ),
        }]
    };
    state.apply_report(ComponentReport {
        id: PID_VISIBILITY.into(),
        kind: "ranks".into(),
        labels: Default::default(),
        status_override: (hidden > 0).then_some(Status::Unknown),
        reasons,
    });
}

/// The component that says whether the agent sees the ranks' processes.
const PID_VISIBILITY: &str = "ranks/pid_visibility";

/// The one line `systemctl status wardend` shows.
fn status_line(node: &warden_core::health::NodeSnapshot) -> String {
    let bad: Vec<String> = node
        .components
        .iter()
        .filter(|c| c.status != Status::Ok)
        .map(|c| format!("{} {}", c.id, c.status))
        .collect();
    if bad.is_empty() {
        format!("node OK, {} components", node.components.len())
    } else {
        format!("node {}: {}", node.status, bad.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// `straggler.enabled = false`: the tick makes no detector, so nothing
    /// is scored (moved here from detect/straggler with the driver's gate).
    #[test]
    fn off_means_nothing_is_scored() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.api.socket = dir.path().join("w.sock").display().to_string();
        cfg.agent.state_dir = dir.path().join("state").display().to_string();
        cfg.straggler.enabled = false;
        let state = Arc::new(AgentState::new(cfg, "test".into()).unwrap());
        run_stragglers(&state, Instant::now());
        assert!(state.stragglers_if_made().is_none());
    }
}
