//! A hung rank's stack dump, fetched off the tick after the hang event.
//!
//! The `rank.hang` event goes out at detection (threshold + at most one
//! tick); asking the rank for its stacks takes up to `hang.stack_dump_wait`,
//! so the dump follows as `rank.stack`, naming the hang event it belongs to.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::process::RankProcess;
use super::scan::HangFinding;
use warden_core::events::EventBus;
use warden_core::events::{NewEvent, Severity};

/// The most of a stack dump attached to an event.
const MAX_STACK_BYTES: usize = 32 * 1024;

/// Signals the hung rank for a dump and publishes it as `rank.stack`.
pub async fn stack_follow_up(
    events: Arc<EventBus>,
    wait: std::time::Duration,
    finding: HangFinding,
    hang_event: u64,
) {
    let Some((signal, path, process)) = &finding.stack_dump else {
        return;
    };
    let (severity, message, stack) = match stack_dump(process, *signal, path, wait).await {
        Ok(text) => (
            Severity::Info,
            format!("stack dump of {} (hung)", finding.key),
            text,
        ),
        Err(why) => (
            Severity::Warning,
            format!("no stack dump from {}: {why}", finding.key),
            format!("unavailable: {why}"),
        ),
    };
    events.publish(
        NewEvent::new(severity, "rank.stack", finding.key.to_string(), message)
            .with("hang_event", hang_event)
            .with("pid", finding.pid)
            .with("stack", stack),
    );
}

/// Signals the rank, through the pidfd it was verified and held by, to
/// dump its stacks, and reads the file once it settles.
async fn stack_dump(
    process: &RankProcess,
    signal: i32,
    path: &Path,
    wait: Duration,
) -> Result<String, String> {
    let sig = nix::sys::signal::Signal::try_from(signal)
        .map_err(|e| format!("bad signal {signal}: {e}"))?;
    let before = std::fs::symlink_metadata(path)
        .map(|m| m.len())
        .unwrap_or(0);
    let pid = process.pid;
    process
        .signal(signal)
        .map_err(|e| format!("cannot send {sig} to pid {pid}: {e}"))?;
    let deadline = Instant::now() + wait;
    let mut last_len = before;
    let mut stable_since: Option<Instant> = None;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let len = std::fs::symlink_metadata(path)
            .map(|m| m.len())
            .unwrap_or(0);
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
    // The rank writes this file: never followed if it became a symlink,
    // never read if it is not a plain file of one link (warden_core::fsafe).
    let (f, _) =
        warden_core::fsafe::open_leaf(path).map_err(|e| format!("cannot read stack dump: {e}"))?;
    let mut bytes = Vec::new();
    let limit = before.saturating_add(MAX_STACK_BYTES as u64);
    std::io::Read::read_to_end(&mut std::io::Read::take(f, limit), &mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let start = usize::try_from(before).unwrap_or(0).min(bytes.len());
    let new = &bytes[start..];
    if new.is_empty() {
        return Err(format!(
            "nothing written to {} within {}ms (is the rank stopped, or its client without a dump handler?)",
            path.display(),
            wait.as_millis()
        ));
    }
    Ok(String::from_utf8_lossy(&new[..new.len().min(MAX_STACK_BYTES)]).into_owned())
}
