//! Slurm: the node the agent cordons is drained in Slurm, and resumed when
//! the cordon is lifted, so that the scheduler stops placing jobs on it.
//!
//! In: drain and resume requests, in the order they were made: a cordon
//! decided by attribution (and a cordon found again at start-up), and
//! `warden uncordon`. They go through a channel to one task, which runs
//! `scontrol` for each.
//!
//! Out: `scontrol update nodename=<node> state=drain reason="warden:
//! <incident> <summary>"`, or `state=resume`; one event per outcome
//! (`slurm.drained`, `slurm.resumed`, `slurm.resume_skipped`,
//! `slurm.failed`) and the counter `warden_slurm_updates_total{action,
//! result}`.
//!
//! Never: blocks the caller (a request is a channel send); lets `scontrol`
//! run past `slurm.timeout` (its process group is killed); resumes a node
//! that someone else drained: before resuming, `scontrol show node` must say
//! the node is drained with a reason starting `warden:`, otherwise the
//! resume is skipped and the event says whose drain it is. A failure is
//! logged and reported and never retried here: the prolog
//! (deploy/slurm/prolog.sh) refuses jobs on a cordoned node meanwhile.

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::process::Command;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_util::sync::CancellationToken;

use warden_core::config::ConfigError;
use warden_core::events::{EventBus, NewEvent, Severity};

/// What every reason the agent sets starts with: how a resume tells the
/// agent's own drains from an administrator's or another tool's.
pub const REASON_PREFIX: &str = "warden:";

/// Longest drain reason set, in bytes: a summary can be long, and a reason
/// is read in `sinfo -R` columns.
pub const MAX_REASON: usize = 200;

/// How much of `scontrol`'s stderr is kept for an error.
const STDERR_KEEP: usize = 512;

/// Bounds on `slurm.timeout`: shorter cannot reach a busy slurmctld, longer
/// only delays the report of a failure.
const MIN_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_TIMEOUT: Duration = Duration::from_secs(120);

/// `[slurm]`: drain the node in Slurm while the agent has it cordoned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    /// Drain this node in Slurm when a decision cordons it, and resume it
    /// on `warden uncordon`. Off by default: only on Slurm compute nodes,
    /// where the agent runs as root (or as `SlurmUser`).
    pub enabled: bool,
    /// The node's name in slurm.conf (`NodeName`). Empty: the agent's host
    /// name (`agent.host_name`, else the kernel's) up to its first dot, as
    /// Slurm names nodes by default.
    pub node_name: String,
    /// The `scontrol` to run: an absolute path, or a name looked up in
    /// `PATH`. It reads slurm.conf as usual (`SLURM_CONF` in the agent's
    /// environment, else the compiled-in path).
    pub scontrol: String,
    /// How long one `scontrol` call may take before its process group is
    /// killed and the call reported as failed. Between 1s and 2m.
    #[serde(with = "warden_core::config::duration")]
    pub timeout: Duration,
}

impl Default for SlurmConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            node_name: String::new(),
            scontrol: "scontrol".into(),
            timeout: Duration::from_secs(10),
        }
    }
}

impl SlurmConfig {
    /// Checks the `[slurm]` keys; the error names the key and the value.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if self.timeout < MIN_TIMEOUT || self.timeout > MAX_TIMEOUT {
            return Err(invalid(
                "slurm.timeout",
                humantime::format_duration(self.timeout).to_string(),
                "must be between 1s and 2m",
            ));
        }
        if self.scontrol.is_empty()
            || (self.scontrol.contains('/') && !self.scontrol.starts_with('/'))
        {
            return Err(invalid(
                "slurm.scontrol",
                format!("{:?}", self.scontrol),
                "must be an absolute path or a bare name looked up in PATH",
            ));
        }
        if self
            .node_name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ',' || c == '=')
        {
            return Err(invalid(
                "slurm.node_name",
                format!("{:?}", self.node_name),
                "must be one Slurm node name (no spaces, commas or '='), or empty for the short host name",
            ));
        }
        Ok(())
    }

    /// The node name to give `scontrol`: `node_name`, else `host` up to its
    /// first dot.
    pub fn node(&self, host: &str) -> String {
        if self.node_name.is_empty() {
            host.split('.').next().unwrap_or(host).to_owned()
        } else {
            self.node_name.clone()
        }
    }
}

/// A request to the Slurm task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlurmRequest {
    /// Drain the node: a decision cordoned it.
    Drain {
        /// The incident whose decision cordoned the node.
        incident: String,
        /// Its diagnosis' summary, for the reason.
        summary: String,
    },
    /// Resume the node: the cordon was lifted.
    Resume {
        /// The person's reason for lifting it, for the event.
        why: String,
    },
}

/// The agent's handle on the Slurm task: cheap, non-blocking requests.
/// Held in `AgentState`; does nothing when `[slurm]` is off.
#[derive(Debug)]
pub struct Slurm {
    /// `slurm.enabled`: requests are dropped when off, so nothing queues up
    /// for a task that never runs.
    enabled: bool,
    /// Where requests go, in order.
    tx: UnboundedSender<SlurmRequest>,
    /// The task's end, taken once by [`start`].
    rx: Mutex<Option<UnboundedReceiver<SlurmRequest>>>,
}

impl Slurm {
    /// A handle for `cfg`; the task that serves it is [`start`].
    pub fn new(cfg: &SlurmConfig) -> Self {
        let (tx, rx) = unbounded_channel();
        Self {
            enabled: cfg.enabled,
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }

    /// Asks for the node to be drained, naming the incident; returns at once.
    pub fn drain(&self, incident: &str, summary: &str) {
        self.send(SlurmRequest::Drain {
            incident: incident.to_owned(),
            summary: summary.to_owned(),
        });
    }

    /// Asks for the node to be resumed (if the agent drained it); returns at
    /// once.
    pub fn resume(&self, why: &str) {
        self.send(SlurmRequest::Resume {
            why: why.to_owned(),
        });
    }

    fn send(&self, r: SlurmRequest) {
        if self.enabled {
            // The receiver is gone only once the agent shuts down.
            let _ = self.tx.send(r);
        }
    }

    fn take(&self) -> Option<UnboundedReceiver<SlurmRequest>> {
        self.rx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// The task that carries out the requests, when `[slurm]` is on (None
/// otherwise, or when already started). Spawn it; it ends when `shutdown`
/// is cancelled. `host` is the agent's host name (the default node name);
/// outcomes are published on `events`.
pub fn start(
    cfg: SlurmConfig,
    host: &str,
    slurm: &Slurm,
    events: Arc<EventBus>,
    shutdown: CancellationToken,
) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
    if !cfg.enabled {
        return None;
    }
    let rx = slurm.take()?;
    let node = cfg.node(host);
    Some(run(cfg, node, rx, events, shutdown))
}

async fn run(
    cfg: SlurmConfig,
    node: String,
    mut rx: UnboundedReceiver<SlurmRequest>,
    events: Arc<EventBus>,
    shutdown: CancellationToken,
) {
    tracing::info!(node = %node, scontrol = %cfg.scontrol, "slurm: draining this node while it is cordoned");
    loop {
        let req = tokio::select! {
            () = shutdown.cancelled() => return,
            r = rx.recv() => match r {
                Some(r) => r,
                None => return,
            },
        };
        let outcome = match &req {
            SlurmRequest::Drain { incident, summary } => {
                drain(&cfg, &node, incident, summary).await
            }
            SlurmRequest::Resume { .. } => resume(&cfg, &node).await,
        };
        report(&events, &node, &req, outcome);
    }
}

/// What became of one request.
#[derive(Debug)]
pub enum SlurmOutcome {
    /// The node was drained with this reason.
    Drained(String),
    /// The node was resumed.
    Resumed,
    /// Nothing was done, and why (the node is not drained, or someone
    /// else drained it).
    Skipped(String),
    /// `scontrol` failed.
    Failed(SlurmError),
}

/// Why an `scontrol` call failed.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// The program could not be started.
    #[error("cannot start {program:?}: {source}")]
    Spawn {
        /// `slurm.scontrol`.
        program: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// No exit within `slurm.timeout`; its process group was killed.
    #[error("{program} did not finish within {}; it was killed", humantime::format_duration(*after))]
    Timeout {
        /// `slurm.scontrol`.
        program: String,
        /// `slurm.timeout`.
        after: Duration,
    },
    /// It exited non-zero (slurmctld down, unknown node, not permitted...).
    #[error("{program} failed ({status}): {stderr}")]
    Exit {
        /// `slurm.scontrol`.
        program: String,
        /// Exit code or signal.
        status: ExitStatus,
        /// The end of its stderr.
        stderr: String,
    },
}

async fn drain(cfg: &SlurmConfig, node: &str, incident: &str, summary: &str) -> SlurmOutcome {
    let reason = drain_reason(incident, summary);
    let args = [
        "update".to_owned(),
        format!("nodename={node}"),
        "state=drain".to_owned(),
        format!("reason={reason}"),
    ];
    match scontrol(cfg, &args).await {
        Ok(_) => SlurmOutcome::Drained(reason),
        Err(e) => SlurmOutcome::Failed(e),
    }
}

async fn resume(cfg: &SlurmConfig, node: &str) -> SlurmOutcome {
    let shown = match scontrol(
        cfg,
        &[
            "show".to_owned(),
            "node".to_owned(),
            node.to_owned(),
            "--oneliner".to_owned(),
        ],
    )
    .await
    {
        Ok(out) => out,
        Err(e) => return SlurmOutcome::Failed(e),
    };
    if let Some(why) = resume_refusal(&shown) {
        return SlurmOutcome::Skipped(why);
    }
    let args = [
        "update".to_owned(),
        format!("nodename={node}"),
        "state=resume".to_owned(),
    ];
    match scontrol(cfg, &args).await {
        Ok(_) => SlurmOutcome::Resumed,
        Err(e) => SlurmOutcome::Failed(e),
    }
}

/// The drain reason: `warden: <incident> <summary>`, on one line, at most
/// [`MAX_REASON`] bytes (cut at a character boundary, marked with `…`).
pub fn drain_reason(incident: &str, summary: &str) -> String {
    let text = format!("{REASON_PREFIX} {incident} {summary}");
    let mut one_line = String::with_capacity(text.len());
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if !(c == ' ' && one_line.ends_with(' ')) {
            one_line.push(c);
        }
    }
    let one_line = one_line.trim_end().to_owned();
    if one_line.len() <= MAX_REASON {
        return one_line;
    }
    let mut end = MAX_REASON - '…'.len_utf8();
    while !one_line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &one_line[..end])
}

/// Reads `scontrol show node <n> --oneliner`: None when the node is drained
/// by the agent (its reason starts with [`REASON_PREFIX`]) and may be
/// resumed, else why not. Pure.
pub fn resume_refusal(shown: &str) -> Option<String> {
    let state = field(shown, "State").unwrap_or_default();
    if !state.contains("DRAIN") {
        return Some(format!("the node is not drained (State={state})"));
    }
    let reason = field(shown, "Reason").unwrap_or_default();
    if reason.starts_with(REASON_PREFIX) {
        None
    } else {
        Some(format!(
            "the node was drained by someone else (Reason={reason}); resume it with `scontrol update nodename=<node> state=resume` once that is settled"
        ))
    }
}

/// The value of `Key=` in `scontrol show node --oneliner` output. `Reason`
/// runs to the end of the line (it may hold spaces) less its ` [user@time]`
/// suffix; every other value ends at the next space.
fn field(shown: &str, key: &str) -> Option<String> {
    let needle = format!("{key}=");
    let start = shown
        .match_indices(&needle)
        .find(|(i, _)| *i == 0 || shown[..*i].ends_with(char::is_whitespace))
        .map(|(i, _)| i + needle.len())?;
    let rest = shown[start..].lines().next().unwrap_or_default();
    if key == "Reason" {
        let rest = rest.trim_end();
        let cut = match rest.rfind(" [") {
            Some(i) if rest.ends_with(']') => &rest[..i],
            _ => rest,
        };
        Some(cut.to_owned())
    } else {
        Some(
            rest.split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned(),
        )
    }
}

/// Runs `scontrol ARGS` within `cfg.timeout`, its own process group killed
/// if it overruns or the call is dropped; returns its stdout.
async fn scontrol(cfg: &SlurmConfig, args: &[String]) -> Result<String, SlurmError> {
    let program = cfg.scontrol.clone();
    let child = Command::new(&program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| SlurmError::Spawn {
            program: program.clone(),
            source,
        })?;
    let group = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(Pid::from_raw);
    let out = match tokio::time::timeout(cfg.timeout, child.wait_with_output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(source)) => return Err(SlurmError::Spawn { program, source }),
        Err(_elapsed) => {
            // The child itself dies with the future (kill_on_drop); the
            // group takes anything it started.
            if let Some(pgid) = group {
                let _ = killpg(pgid, Signal::SIGKILL);
            }
            return Err(SlurmError::Timeout {
                program,
                after: cfg.timeout,
            });
        }
    };
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr = stderr.trim();
        let mut start = stderr.len().saturating_sub(STDERR_KEEP);
        while !stderr.is_char_boundary(start) {
            start += 1;
        }
        return Err(SlurmError::Exit {
            program,
            status: out.status,
            stderr: stderr[start..].to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Logs, counts and publishes one outcome.
fn report(events: &EventBus, node: &str, req: &SlurmRequest, outcome: SlurmOutcome) {
    let (action, incident, why) = match req {
        SlurmRequest::Drain { incident, .. } => ("drain", incident.as_str(), ""),
        SlurmRequest::Resume { why } => ("resume", "", why.as_str()),
    };
    let subject = format!("slurm/{node}");
    let (result, ev) = match outcome {
        SlurmOutcome::Drained(reason) => {
            tracing::info!(node, incident, reason = %reason, "slurm: node drained");
            (
                "ok",
                NewEvent::new(
                    Severity::Info,
                    "slurm.drained",
                    subject,
                    format!("Slurm node {node} drained: {reason}"),
                )
                .with("node", node)
                .with("incident", incident)
                .with("reason", reason),
            )
        }
        SlurmOutcome::Resumed => {
            tracing::info!(node, why, "slurm: node resumed");
            (
                "ok",
                NewEvent::new(
                    Severity::Info,
                    "slurm.resumed",
                    subject,
                    format!("Slurm node {node} resumed: the cordon was lifted"),
                )
                .with("node", node)
                .with("why", why),
            )
        }
        SlurmOutcome::Skipped(skip) => {
            tracing::warn!(node, reason = %skip, "slurm: resume skipped");
            (
                "skipped",
                NewEvent::new(
                    Severity::Warning,
                    "slurm.resume_skipped",
                    subject,
                    format!("Slurm node {node} not resumed: {skip}"),
                )
                .with("node", node),
            )
        }
        SlurmOutcome::Failed(e) => {
            tracing::error!(node, action, error = %e, "slurm: scontrol failed");
            (
                "failed",
                NewEvent::new(
                    Severity::Error,
                    "slurm.failed",
                    subject,
                    format!("could not {action} Slurm node {node}: {e}"),
                )
                .with("node", node)
                .with("action", action)
                .with("incident", incident)
                .with("error", e.to_string()),
            )
        }
    };
    metrics::counter!("warden_slurm_updates_total", "action" => action, "result" => result)
        .increment(1);
    events.publish(ev);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const SHOWN: &str = "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 State=IDLE+DRAIN \
        ThreadsPerCore=1 Partitions=debug  ExtSensorsTemp=n/s \
        Reason=warden: inc-3 XID 79 on gpu1: fell off the bus [root@2026-11-23T20:10:46]\n";

    #[test]
    fn reason_is_one_bounded_line_naming_the_incident() {
        assert_eq!(
            drain_reason("inc-3", "XID 79 on gpu1\n  fell off the bus"),
            "warden: inc-3 XID 79 on gpu1 fell off the bus"
        );
        let long = drain_reason("inc-9", &"é".repeat(500));
        assert!(long.len() <= MAX_REASON, "{}", long.len());
        assert!(long.starts_with("warden: inc-9 é") && long.ends_with('…'));
    }

    #[test]
    fn resume_only_the_agents_own_drain() {
        assert_eq!(resume_refusal(SHOWN), None);
        for (shown, says) in [
            (
                "NodeName=vm State=IDLE Reason=warden: inc-1 x [root@t]",
                "not drained (State=IDLE)",
            ),
            (
                "NodeName=vm State=DRAINED Reason=maintenance window [admin@2026]",
                "someone else (Reason=maintenance window)",
            ),
            (
                "NodeName=vm State=MIXED+DRAIN Reason=Prolog error [slurm@2026]",
                "someone else (Reason=Prolog error)",
            ),
            ("NodeName=vm State=DOWN+DRAIN", "someone else (Reason=)"),
        ] {
            let why = resume_refusal(shown).expect(shown);
            assert!(why.contains(says), "{shown}: {why}");
        }
        // A drained node whose reason is the agent's, in any state.
        assert_eq!(
            resume_refusal("NodeName=vm State=ALLOCATED+DRAIN Reason=warden: inc-2 hang"),
            None
        );
    }

    #[test]
    fn fields_are_read_whole() {
        assert_eq!(field(SHOWN, "State").unwrap(), "IDLE+DRAIN");
        assert_eq!(
            field(SHOWN, "Reason").unwrap(),
            "warden: inc-3 XID 79 on gpu1: fell off the bus"
        );
        // `MCS_label=` does not match `label=`, nor `ExtSensorsTemp=` `Temp=`.
        assert_eq!(field(SHOWN, "Temp"), None);
    }

    #[test]
    fn config_defaults_node_name_and_bad_keys() {
        let cfg: SlurmConfig = toml::from_str("enabled = true\n").unwrap();
        assert_eq!(cfg.scontrol, "scontrol");
        assert_eq!(cfg.timeout, Duration::from_secs(10));
        cfg.validate("t").unwrap();
        assert_eq!(cfg.node("gpu-017.cluster.example"), "gpu-017");
        let named = SlurmConfig {
            node_name: "n17".into(),
            ..cfg.clone()
        };
        assert_eq!(named.node("gpu-017.cluster.example"), "n17");
        for (toml, key) in [
            ("timeout = \"100ms\"", "slurm.timeout"),
            ("scontrol = \"bin/scontrol\"", "slurm.scontrol"),
            ("scontrol = \"\"", "slurm.scontrol"),
            ("node_name = \"a,b\"", "slurm.node_name"),
        ] {
            let cfg: SlurmConfig = toml::from_str(toml).unwrap();
            let e = cfg.validate("t").unwrap_err().to_string();
            assert!(e.contains(key), "{toml}: {e}");
        }
        assert!(toml::from_str::<SlurmConfig>("enable = true").is_err());
    }

    #[tokio::test]
    async fn scontrol_failures_are_errors_within_the_deadline() {
        let cfg = SlurmConfig {
            scontrol: "/nonexistent/scontrol".into(),
            ..SlurmConfig::default()
        };
        let e = scontrol(&cfg, &[]).await.unwrap_err();
        assert!(matches!(e, SlurmError::Spawn { .. }), "{e:?}");

        let cfg = SlurmConfig {
            scontrol: "sh".into(),
            timeout: Duration::from_secs(1),
            ..SlurmConfig::default()
        };
        let args = |s: &str| ["-c".to_owned(), s.to_owned()];
        let e = scontrol(
            &cfg,
            &args("echo 'slurm_update error: Invalid node name specified' >&2; exit 1"),
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("Invalid node name"), "{e}");
        let started = std::time::Instant::now();
        let e = scontrol(&cfg, &args("sleep 30 & sleep 30"))
            .await
            .unwrap_err();
        assert!(matches!(e, SlurmError::Timeout { .. }), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(
            scontrol(&cfg, &args("echo State=IDLE")).await.unwrap(),
            "State=IDLE\n"
        );
    }
}
