//! `warden run`'s exit statuses, chosen so a scheduler can tell what
//! happened without reading logs, and the run's summary (one screen on the
//! console; JSON with `--summary-json`).
//!
//! | status | meaning |
//! |---|---|
//! | 0 | every worker exited 0 |
//! | the worker's own | the agent diagnosed a user error and stopped the job (the scheduler shows the real failure) |
//! | 86 | this node is at fault (cordon, scale-down, refused health gate), or out of a multi-host job (its etcd lease lost): requeue elsewhere, drain the node |
//! | 87 | a restart budget is spent (the policy's, or `--max-restarts`): the job keeps failing |
//! | 88 | no progress: `--max-no-progress-restarts` failed attempts in a row did not advance the job's newest complete checkpoint (or, without one in the agent's tier, the step its ranks resumed from) |
//! | 89 | the job id belongs to another user on this host's agent (ClaimJob refused; docs/security.md): nothing was started; pick another `--rdzv-id`, or have an admin release it (`warden release-job JOB`). Mid-run: another user owns the job now (its claim released and taken): the workers were stopped |
//! | 85 | preempted: requeue me. A notice of a coming stop (the launcher's SIGTERM with `--term-grace`, or the host's: GCE preemption or maintenance, an EC2 Spot interruption, a Kubernetes taint) made the workers save at their next step boundary and leave; the next run resumes at that step |
//! | 1 | the launcher failed (could not start the workers or the agent), or a stop decision with no better status |
//! | 2 | bad command line |
//! | 128+N | the launcher got signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP) and stopped the workers |

use serde::Serialize;

pub use warden_core::policy::{EXIT_BUDGET_SPENT, EXIT_NODE_FAULT};

/// Every worker succeeded.
pub const EXIT_SUCCESS: i32 = 0;
/// The launcher itself failed.
pub const EXIT_LAUNCHER_ERROR: i32 = 1;
/// The command line is wrong (clap's own status for usage errors).
pub const EXIT_USAGE: i32 = 2;
/// Preempted: requeue me. The job stopped on a notice of a coming stop
/// (the scheduler's SIGTERM with `--term-grace`, a cloud's preemption or
/// maintenance notice, a node taint) after its workers saved: a planned
/// stop, not a failure. Also the status a worker leaves with once it saved
/// on a notice (`warden.Preempted`), which is how the launcher learns of a
/// notice the host raised. Below 86-89 and outside 128+N and sysexits'
/// 64-78, so it is told apart from every other status here.
pub const EXIT_PREEMPTED: i32 = 85;
/// A worker's status, not the launcher's: `warden.heal` leaves with it when a
/// restart request cannot reach its training thread (blocked in a gloo
/// collective that no abort wakes). Its state is out of reach but a live
/// replica holds it, so the launcher heals it as it heals a rank killed by
/// a signal. sysexits' EX_TEMPFAIL: try again.
pub const WORKER_LEFT_BLOCKED: i32 = 75;
/// The job's restarts stopped making progress: a restart loop that a
/// budget of restarts per hour would let run on, told apart from a spent
/// budget (87) so a scheduler does not requeue it as is.
pub const EXIT_NO_PROGRESS: i32 = 88;
/// The job id belongs to another user on this host's agent: nothing was
/// started. Told apart from a node fault (86: requeue elsewhere) and a
/// failed launcher (1): requeueing it as is fails the same way, and the
/// other user's decisions about that id must never reach this job.
pub const EXIT_JOB_OWNED: i32 = 89;

/// The status of a launcher stopped by signal `sig` (the shell's 128+N).
pub fn signalled(sig: i32) -> i32 {
    128 + sig
}

/// The run, as the summary shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunSummary {
    /// The job's id.
    pub job: String,
    /// Which agent served it.
    pub agent: String,
    /// How it ended, in words.
    pub outcome: String,
    /// The launcher's exit status.
    pub exit_code: i32,
    /// Wall time of the whole run.
    pub elapsed_s: f64,
    /// Where the per-rank logs are.
    pub log_dir: String,
    /// Each attempt, the first one 0.
    pub attempts: Vec<AttemptRecord>,
    /// After a stop on a notice (exit 85): where the checkpoint saved on
    /// it is, as the agent listed it.
    pub notice_checkpoint: Option<crate::notice_ckpt::Whereabouts>,
}

/// One attempt: its workers and how it ended.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AttemptRecord {
    /// Its number (TORCHELASTIC_RESTART_COUNT).
    pub attempt: u32,
    /// Local workers.
    pub workers: u32,
    /// Rank 0's store port.
    pub master_port: u16,
    /// The job-wide round it ran in (across hosts; `None` on one host).
    pub epoch: Option<u64>,
    /// This node's rank in it.
    pub node_rank: u32,
    /// Nodes in it.
    pub nnodes: u32,
    /// Workers in it across all nodes (WORLD_SIZE).
    pub world_size: u32,
    /// How long it ran.
    pub duration_s: f64,
    /// How it ended.
    pub ended: String,
    /// Workers that failed: global rank and status.
    pub failures: Vec<(u32, String)>,
    /// The incident that ended it, as the agent diagnosed and decided it.
    pub incident: Option<IncidentBrief>,
    /// When it ended in a restart: how long each part took.
    pub restart: Option<RestartTiming>,
    /// Decisions that did not end it (an in-process restart the agent
    /// carried out, a `continue`), one line each.
    pub other_decisions: Vec<String>,
    /// Workers that failed after their training ended (torch's teardown
    /// abort at exit): not counted as failures, and why.
    pub aborted_at_exit: Vec<AbortedAtExit>,
}

/// A worker that failed after its training had ended: the job ended with
/// the training's result instead of restarting.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AbortedAtExit {
    /// Its global rank.
    pub rank: u32,
    /// How it ended (`signal 6 (SIGABRT)`).
    pub status: String,
    /// Why its training had ended (the sign the launcher read).
    pub why: String,
}

/// An incident as the summary shows it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IncidentBrief {
    /// The agent's id ("inc-..."); empty when the launcher decided alone.
    pub id: String,
    /// crash, hang, hardware, straggler.
    pub kind: String,
    /// The fault class.
    pub class: String,
    /// Its confidence, 0..1.
    pub confidence: f64,
    /// One line.
    pub summary: String,
    /// The strongest evidence, one line each.
    pub evidence: Vec<String>,
    /// The action taken.
    pub action: String,
    /// Why.
    pub reason: String,
    /// policy, hook, escalation, or the launcher.
    pub decided_by: String,
    /// Remediations of the class in its window, this one included.
    pub attempt: u32,
    /// The class's budget.
    pub budget: u32,
}

/// Where the time of one in-job restart went, in milliseconds from the
/// launcher seeing the failure (the worker's exit, through its pidfd).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestartTiming {
    /// Wall-clock time the launcher saw the failure (Unix seconds), so a
    /// benchmark can measure detection against the worker's own clock.
    pub failure_seen_unix_s: f64,
    /// Until the decision arrived (the agent's settle time, policy, hook).
    pub decision_ms: f64,
    /// Until every process of the job was gone (SIGTERM, grace, SIGKILL).
    pub stop_ms: f64,
    /// Until the GPUs released them and the health gate passed.
    pub gate_ms: f64,
    /// The decision's backoff.
    pub backoff_ms: f64,
    /// Until the new workers were started.
    pub spawn_ms: f64,
    /// Until every new worker had registered with the agent (None: not
    /// all did, or the workers do not use the client).
    pub registered_ms: Option<f64>,
}

impl RunSummary {
    /// The one-screen text.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "[warden] ---- summary: job {} ----------------------------------------",
            self.job
        );
        let _ = writeln!(
            s,
            "[warden] {} (exit {}) after {} attempt{} in {:.1}s; {}",
            self.outcome,
            self.exit_code,
            self.attempts.len(),
            if self.attempts.len() == 1 { "" } else { "s" },
            self.elapsed_s,
            self.agent
        );
        for a in &self.attempts {
            let round = a.epoch.map_or(String::new(), |e| {
                format!(
                    " (round {e}: node {} of {}, world size {})",
                    a.node_rank, a.nnodes, a.world_size
                )
            });
            let _ = writeln!(
                s,
                "[warden] attempt {}: {} worker{}{round}, {:.1}s: {}",
                a.attempt,
                a.workers,
                if a.workers == 1 { "" } else { "s" },
                a.duration_s,
                a.ended
            );
            if let Some(i) = &a.incident
                && i.class.is_empty()
            {
                // No diagnosis here: a round another host caused.
                let _ = writeln!(
                    s,
                    "[warden]   {} by {}: {}",
                    i.action, i.decided_by, i.reason
                );
            } else if let Some(i) = &a.incident {
                let who = if i.id.is_empty() {
                    String::new()
                } else {
                    format!("{} ({}) ", i.id, i.kind)
                };
                let _ = writeln!(
                    s,
                    "[warden]   diagnosis: {who}{} {:.0}%: {}",
                    i.class,
                    i.confidence * 100.0,
                    i.summary
                );
                for e in i.evidence.iter().take(3) {
                    let _ = writeln!(s, "[warden]     evidence: {e}");
                }
                let _ = writeln!(
                    s,
                    "[warden]   decision: {} by {} ({}/{}): {}",
                    i.action, i.decided_by, i.attempt, i.budget, i.reason
                );
            }
            for d in &a.other_decisions {
                let _ = writeln!(s, "[warden]   meanwhile: {d}");
            }
            for x in &a.aborted_at_exit {
                let _ = writeln!(
                    s,
                    "[warden]   rank {} aborted at exit ({}), not counted as a failure: {}",
                    x.rank, x.status, x.why
                );
            }
            if let Some(r) = &a.restart {
                let reg = r
                    .registered_ms
                    .map_or("-".to_owned(), |v| format!("{:.0} ms", v));
                let _ = writeln!(
                    s,
                    "[warden]   restart: decision {:.0} ms, stop {:.0} ms, gate {:.0} ms, backoff {:.0} ms, spawned {:.0} ms, all registered {reg} (from the {})",
                    r.decision_ms,
                    r.stop_ms,
                    r.gate_ms,
                    r.backoff_ms,
                    r.spawn_ms,
                    // A round another host caused has no diagnosis here.
                    if a.incident.as_ref().is_some_and(|i| i.class.is_empty()) {
                        "new round"
                    } else {
                        "failure"
                    }
                );
            }
        }
        if let Some(w) = &self.notice_checkpoint {
            let _ = writeln!(s, "[warden] {}", w.line());
        }
        let _ = writeln!(s, "[warden] logs: {}", self.log_dir);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_attempts_diagnosis_and_timings() {
        let s = RunSummary {
            job: "j".into(),
            agent: "embedded agent".into(),
            outcome: "succeeded after 1 restart".into(),
            exit_code: 0,
            elapsed_s: 3.0,
            log_dir: "/l/j".into(),
            notice_checkpoint: None,
            attempts: vec![
                AttemptRecord {
                    attempt: 0,
                    workers: 2,
                    ended: "rank 1 exit code 3".into(),
                    incident: Some(IncidentBrief {
                        id: "inc-1".into(),
                        kind: "crash".into(),
                        class: "unknown".into(),
                        confidence: 0.3,
                        summary: "rank 1 exited with code 3".into(),
                        action: "restart_in_job".into(),
                        decided_by: "policy".into(),
                        attempt: 1,
                        budget: 2,
                        ..Default::default()
                    }),
                    restart: Some(RestartTiming {
                        decision_ms: 210.0,
                        registered_ms: Some(400.0),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                AttemptRecord {
                    attempt: 1,
                    workers: 2,
                    epoch: Some(4),
                    node_rank: 1,
                    nnodes: 2,
                    world_size: 4,
                    ended: "every worker exited 0".into(),
                    ..Default::default()
                },
            ],
        };
        let text = s.render();
        assert!(text.contains("after 2 attempts"), "{text}");
        assert!(
            text.contains("diagnosis: inc-1 (crash) unknown 30%"),
            "{text}"
        );
        assert!(
            text.contains("decision: restart_in_job by policy (1/2)"),
            "{text}"
        );
        assert!(text.contains("all registered 400 ms"), "{text}");
        assert!(
            text.contains("attempt 1: 2 workers (round 4: node 1 of 2, world size 4)"),
            "{text}"
        );
        assert_eq!(signalled(15), 143);
    }
}
