//! The work loop: one tick drives the periodic work and the watchdog.
//!
//! Every `agent.tick` it scans the ranks' heartbeat slots (hang detection),
//! marks sources stuck in a call as stalled, and pings the systemd
//! watchdog. Pinging from here (not from a timer of its own) means a loop
//! that stops turning stops the pings, and systemd restarts the agent.

use std::sync::Arc;
use std::time::Instant;

use tokio::time::MissedTickBehavior;

use super::notify::{self, Watchdog};
use crate::events::{NewEvent, Severity};
use crate::health::{ComponentReport, Status};
use crate::ranks::{evidence, scan};
use crate::sources::runner::Sources;

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
    let mut prev_ns = warden_client::clock::syscall_now();
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = Instant::now();
        let now_ns = warden_client::clock::syscall_now();
        let result = {
            let mut reg = state.registry();
            let result = scan::scan(&mut reg, &cfg.hang, now_ns, prev_ns);
            reg.save_calibrations(CALIBRATION_SAVE_EVERY, false);
            result
        };
        prev_ns = now_ns;
        state.goodput.observe_scan(&result.goodput, now_ns);
        metrics::histogram!("warden_scan_seconds").record(now.elapsed().as_secs_f64());
        metrics::gauge!("warden_ranks_watched").set(result.scanned as f64);
        for ev in result.events {
            state.events.publish(ev);
        }
        for finding in result.hangs {
            metrics::counter!("warden_rank_hangs_total").increment(1);
            let mut ev = NewEvent::new(
                Severity::Error,
                "rank.hang",
                finding.key.to_string(),
                finding.message.clone(),
            );
            ev.evidence = finding.evidence.clone();
            let wants_stack = finding.stack_dump.is_some() && cfg.hang.stack_dump;
            if wants_stack {
                ev = ev.with("stack", "requested: follows as a rank.stack event");
            }
            let id = state.events.publish(ev).id;
            if wants_stack {
                tokio::spawn(evidence::stack_follow_up(state.clone(), finding, id));
            }
        }
        // Straggler scores from the steps the scan just read (outside the
        // registry lock but for a short copy).
        crate::detect::straggler::tick(&state, now);
        sources.check_stalls(&state, cfg.agent.source_stall_after);
        let node = state.health.snapshot();
        if last_status != Some((node.status, node.version)) {
            last_status = Some((node.status, node.version));
            notify::status(&status_line(&node));
        }
        watchdog.tick(now);
    }
}

/// The one line `systemctl status wardend` shows.
fn status_line(node: &crate::health::NodeSnapshot) -> String {
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
