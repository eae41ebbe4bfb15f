//! Completing a hang's evidence off the tick: what the process is doing
//! (state, wchan, threads, whether its CPU time advances) and, when the
//! client supports it, a stack dump of all its threads.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::procfs;
use super::scan::HangFinding;
use crate::events::{NewEvent, Severity};
use crate::state::AgentState;

/// How long CPU time is sampled to tell a spinning rank from a blocked one.
const CPU_SAMPLE: Duration = Duration::from_millis(250);
/// The most of a stack dump attached to an event.
const MAX_STACK_BYTES: usize = 32 * 1024;

/// Gathers the rest of the evidence and publishes `rank.hang`.
pub async fn complete(state: Arc<AgentState>, finding: HangFinding) {
    let mut ev = NewEvent::new(
        Severity::Error,
        "rank.hang",
        finding.key.to_string(),
        finding.message.clone(),
    );
    ev.evidence = finding.evidence.clone();
    let pid = finding.pid;
    match procfs::read(pid) {
        None => {
            ev = ev.with("process", "gone");
        }
        Some(before) => {
            tokio::time::sleep(CPU_SAMPLE).await;
            let after = procfs::read(pid);
            ev = ev
                .with(
                    "process_state",
                    format!("{} ({})", before.state, before.state_name()),
                )
                .with("threads", before.threads)
                .with(
                    "wchan",
                    if before.wchan.is_empty() || before.wchan == "0" {
                        "-".into()
                    } else {
                        before.wchan.clone()
                    },
                );
            if let Some(after) = after {
                let delta = after.cpu_ticks.saturating_sub(before.cpu_ticks);
                ev = ev.with(
                    "cpu_advancing",
                    if delta > 0 {
                        format!(
                            "yes (+{delta} ticks in {}ms: spinning or busy)",
                            CPU_SAMPLE.as_millis()
                        )
                    } else {
                        format!(
                            "no (0 ticks in {}ms: blocked or stopped)",
                            CPU_SAMPLE.as_millis()
                        )
                    },
                );
            }
        }
    }
    if let Some((signal, path)) = &finding.stack_dump
        && state.config.hang.stack_dump
    {
        match stack_dump(pid, *signal, path, state.config.hang.stack_dump_wait).await {
            Ok(text) => ev = ev.with("stack", text),
            Err(why) => ev = ev.with("stack", format!("unavailable: {why}")),
        }
    }
    // The rank may have recovered, exited or re-registered meanwhile.
    let still_hung = state.registry().ranks.get(&finding.key).is_some_and(|e| {
        e.generation == finding.generation && e.state == super::registry::RankState::Hung
    });
    if !still_hung {
        ev = ev.with(
            "note",
            "the rank recovered, exited or re-registered while evidence was gathered",
        );
    }
    metrics::counter!("warden_rank_hangs_total").increment(1);
    state.events.publish(ev);
}

/// Signals the rank to dump its stacks and reads the file once it settles.
async fn stack_dump(pid: u32, signal: i32, path: &Path, wait: Duration) -> Result<String, String> {
    let sig = nix::sys::signal::Signal::try_from(signal)
        .map_err(|e| format!("bad signal {signal}: {e}"))?;
    let before = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let pid_t = i32::try_from(pid).map_err(|_| format!("pid {pid} out of range"))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid_t), sig)
        .map_err(|e| format!("cannot send {sig} to pid {pid}: {e}"))?;
    let deadline = Instant::now() + wait;
    let mut last_len = before;
    let mut stable_since: Option<Instant> = None;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if len > before && len == last_len {
            // Unchanged for 100 ms after growing: the dump is complete.
            if stable_since.get_or_insert_with(Instant::now).elapsed() >= Duration::from_millis(100)
            {
                break;
            }
        } else {
            stable_since = None;
        }
        last_len = len;
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let start = usize::try_from(before).unwrap_or(0).min(bytes.len());
    let new = &bytes[start..];
    if new.is_empty() {
        return Err(format!(
            "no dump written to {} within {}ms",
            path.display(),
            wait.as_millis()
        ));
    }
    let text = String::from_utf8_lossy(&new[..new.len().min(MAX_STACK_BYTES)]).into_owned();
    Ok(text)
}
