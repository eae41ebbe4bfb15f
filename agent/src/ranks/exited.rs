//! A rank's process exited: what the registry records and what the agent
//! must then do.
//!
//! In: the registry, the rank, its registration's generation and its exit
//! status. Out: an [`Exited`] outcome (the typed `rank.exited` signal and
//! the steps completed since the last scan) the caller publishes and books
//! in the goodput ledger, or nothing when the exit is stale (another
//! generation, already reported). Never: publish, lock anything but the
//! registry it is handed, or touch the ledger itself.

use super::registry::{ExitInfo, RankKey, RankState, Registry};
use warden_core::goodput::StepObs;
use warden_core::signal::RankExited;

/// Completed steps read from an exiting rank's slot for the goodput ledger
/// (those since the last scan: a tick's worth at most, in practice).
const LAST_STEPS: usize = 8;

/// What the caller does about an exit: publish `signal`, book `last_steps`.
#[derive(Debug, Clone, PartialEq)]
pub struct Exited {
    /// The `rank.exited` signal to publish.
    pub signal: RankExited,
    /// Steps the rank completed since the last scan, for the ledger (they
    /// set the high-water mark redone steps are judged by).
    pub last_steps: Vec<StepObs>,
}

/// Records that a rank's process exited: marks it exited, frees its slot,
/// and reads where it was from its slot. None when the exit is stale.
pub fn record(
    reg: &mut Registry,
    key: &RankKey,
    generation: u64,
    exit: ExitInfo,
) -> Option<Exited> {
    let entry = reg.ranks.get_mut(key)?;
    if entry.generation != generation || entry.state == RankState::Exited {
        return None;
    }
    let was = entry.state;
    // A rank its launcher is stopping (StopRanks) exits on purpose.
    let stop_reason = entry.stop_reason.clone();
    entry.state = RankState::Exited;
    entry.exit = Some(exit.clone());
    // The process is gone: its pidfd can reach nothing any more, and an
    // exited entry stays listed (GetRanks) after it, so holding the
    // descriptor kept one open per exited rank (issue 22: 1,000
    // register/exit cycles left 1,000 pidfds open).
    entry.process = None;
    let pid = entry.pid;
    let ingested = entry.ingested_start_ns;
    let declared_pid = entry.declared_pid;
    let slot_index = entry.slot;
    let no_client = entry.launcher_only();
    let restarting_since = entry.restarting_since();
    let (mut step, mut section) = (
        entry.last.as_ref().map_or(0, |s| s.step),
        entry.section.clone(),
    );
    // Where the rank was when it died, read from its slot now (the last
    // scan may be up to a tick old).
    let mut last_steps = Vec::new();
    if was != RankState::Lost
        && let Ok(snap) = reg.slots().snapshot_for_scan(slot_index, LAST_STEPS)
        && snap.generation == generation
    {
        if snap.writer_is_owner() {
            last_steps = snap
                .recent_steps
                .iter()
                .filter(|s| s.start_ns > ingested && s.duration_ns > 0)
                .map(|s| StepObs {
                    pid,
                    step: s.step,
                    start_ns: s.start_ns,
                    duration_ns: s.duration_ns,
                    data_ns: s
                        .sections
                        .iter()
                        .filter(|x| x.id == warden_slot::SECTION_DATA)
                        .map(|x| x.total_ns)
                        .sum(),
                })
                .collect();
        }
        step = snap.step;
        let name = super::registry::live_sections(&snap, restarting_since)
            .last()
            .map(|o| {
                reg.slots()
                    .section_name(slot_index, o.id)
                    .unwrap_or_default()
            });
        section = super::registry::section_of(&snap, restarting_since, name.as_deref());
    }
    reg.free_slot_of(key);
    Some(Exited {
        signal: RankExited {
            key: key.clone(),
            pid,
            declared_pid,
            step: (!no_client).then_some(step),
            section,
            state_before: was,
            exit,
            stopped_by: stop_reason.filter(|_| was == RankState::Stopping),
        },
        last_steps,
    })
}
