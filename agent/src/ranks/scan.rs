//! One scan of every registered rank's slot, run on each tick.
//!
//! Reads each slot (a seqlock snapshot: never blocks the writer), notes
//! progress, feeds completed steps into the job's calibration, and declares
//! a rank hung when it made no progress past its section's threshold. The
//! slow parts of the evidence (procfs sampling, a stack dump) are left to the
//! caller, off the tick.

use std::path::PathBuf;
use std::time::Duration;

use warden_slot::{RING_LEN, SlotSnapshot, SlotTable};

/// Completed steps a slot's ring holds.
const RING_STEPS: usize = RING_LEN - 1;

use super::procfs;
use super::registry::{Marker, RankEntry, RankKey, RankState, Registry, live_sections, section_of};
use warden_core::config::HangConfig;
use warden_core::detect::calibration::{self, IDLE};
use warden_core::detect::culprit::Position;
use warden_core::detect::hang::{self, PeerPosition, Threshold};
use warden_core::detect::positions::JobPositions;
use warden_core::detect::straggler::RankSamples;
use warden_core::events::{NewEvent, Severity};
use warden_core::signal::Signal;

/// How many of a job's other local ranks are listed by name in a hang's
/// evidence; the rest are counted.
const MAX_PEERS_LISTED: usize = 8;

/// A rank found hung, with its evidence; the caller publishes it at once
/// and asks the rank for a stack dump afterwards.
#[derive(Debug, Clone)]
pub struct HangFinding {
    /// Which rank.
    pub key: RankKey,
    /// Its process.
    pub pid: u32,
    /// Its generation (to ignore a finding about a re-registered rank).
    pub generation: u64,
    /// Evidence gathered from the slot and the job's other ranks.
    pub evidence: Vec<(String, String)>,
    /// What attribution reads of it (also in the evidence, for a person).
    pub facts: warden_core::signal::HangFacts,
    /// The headline.
    pub message: String,
    /// Signal, file and the held process for a stack dump, when the client
    /// supports one and its process was verified at registration.
    pub stack_dump: Option<(i32, PathBuf, super::process::RankProcess)>,
}

/// How long a rank goes without progress before the scan reads its
/// process state for its position: a rank frozen with SIGSTOP must show
/// as stopped in the first hang snapshot of its host, taken when any rank
/// there crossed its threshold, possibly before this one did.
const QUIET_FOR_STATE: Duration = Duration::from_millis(250);

/// Every running rank's place, grouped by job, with the process state of
/// the ones that stopped making progress (a stopped process is the
/// verdict's strongest fact). Ranks stepping faster than
/// [`QUIET_FOR_STATE`] cost no /proc read.
fn job_positions(
    ranks: &std::collections::BTreeMap<RankKey, RankEntry>,
    positions: &[(RankKey, PeerPosition)],
    now_ns: u64,
) -> Vec<JobPositions> {
    let taken_at = std::time::SystemTime::now();
    let mut jobs: std::collections::BTreeMap<&str, JobPositions> =
        std::collections::BTreeMap::new();
    for (key, p) in positions {
        let Some(entry) = ranks.get(key) else {
            continue;
        };
        let quiet = Duration::from_nanos(now_ns.saturating_sub(entry.progress_ns));
        let process_state = if (p.stalled || quiet >= QUIET_FOR_STATE) && entry.pid != 0 {
            procfs::state(entry.pid).unwrap_or_else(|| "gone".to_owned())
        } else {
            String::new()
        };
        let job = jobs
            .entry(key.job.as_str())
            .or_insert_with(|| JobPositions {
                job: key.job.clone(),
                world_size: 0,
                hang: false,
                taken_at,
                ranks: Vec::new(),
                pending: false,
            });
        job.world_size = job.world_size.max(entry.world_size);
        job.ranks.push(Position {
            // The work loop names this host.
            host: String::new(),
            rank: key.rank,
            step: p.step,
            section: p.section.clone(),
            stalled: p.stalled,
            stalled_ms: Duration::from_nanos(now_ns.saturating_sub(entry.progress_ns)).as_millis()
                as u64,
            process_state,
            groups: Vec::new(),
        });
    }
    jobs.into_values().collect()
}

/// What one scan produced.
#[derive(Debug, Default)]
pub struct ScanResult {
    /// Signals to publish as they are.
    pub events: Vec<Signal>,
    /// Hangs whose evidence is still to be completed.
    pub hangs: Vec<HangFinding>,
    /// Ranks read.
    pub scanned: usize,
    /// Completed steps and pre-step sections for the goodput ledger.
    pub goodput: warden_core::goodput::ScanFeed,
    /// The loss and gradient norm the ranks reported with their recent
    /// steps, for the SDC detector (which drops the ones it already has).
    pub values: Vec<StepValues>,
    /// Where every running rank stands, per job, for the job-wide hang
    /// verdict (`detect::positions`).
    pub positions: Vec<JobPositions>,
}

/// One rank's reported values at one completed step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepValues {
    /// Which rank.
    pub key: RankKey,
    /// Its registration (a new one restarts its step count).
    pub generation: u64,
    /// The step.
    pub step: u64,
    /// Its loss, if reported.
    pub loss: Option<f64>,
    /// Its gradient norm, if reported.
    pub grad_norm: Option<f64>,
}

/// Scans every live rank. `now_ns` and `prev_ns` are this and the previous
/// scan's CLOCK_MONOTONIC times: a change first seen now happened after
/// `prev_ns`, so progress is dated no later than the change itself and a
/// hang is declared at most one tick after its threshold.
pub fn scan(reg: &mut Registry, cfg: &HangConfig, now_ns: u64, prev_ns: u64) -> ScanResult {
    let mut out = ScanResult::default();
    let (slots, ranks, jobs) = reg.parts();
    for entry in ranks.values_mut() {
        if !matches!(entry.state, RankState::Running | RankState::Hung) {
            continue;
        }
        out.scanned += 1;
        let counters = match slots.change_counters(entry.slot) {
            Ok(c) => c,
            Err(e) => {
                note_slot_error(entry, &e.to_string(), &mut out);
                continue;
            }
        };
        if entry.counters != Some(counters) || entry.last.is_none() {
            // Only the steps completed since the last snapshot are read.
            let seen = entry.last.as_ref().map_or(0, |s| s.steps_completed);
            let want = if entry.last.is_none() { RING_STEPS } else { 4 };
            let mut snap = match slots.snapshot_for_scan(entry.slot, want) {
                Ok(s) => s,
                Err(e) => {
                    note_slot_error(entry, &e.to_string(), &mut out);
                    continue;
                }
            };
            let new_steps =
                usize::try_from(snap.steps_completed.saturating_sub(seen)).unwrap_or(RING_STEPS);
            if new_steps > want && want < RING_STEPS {
                match slots.snapshot_for_scan(entry.slot, new_steps.min(RING_STEPS)) {
                    Ok(s) => snap = s,
                    Err(e) => {
                        note_slot_error(entry, &e.to_string(), &mut out);
                        continue;
                    }
                }
            }
            if snap.generation != entry.generation || !snap.claimed {
                // Our claim is gone from the slot: overwritten. The client
                // sees the same and registers again; until then the rank is
                // not judged on a slot that is no longer its own.
                note_slot_error(
                    entry,
                    &format!(
                        "slot {} no longer carries this rank's claim (generation {}, claimed {}; issued {}): overwritten",
                        entry.slot, snap.generation, snap.claimed, entry.generation
                    ),
                    &mut out,
                );
                entry.state = RankState::Lost;
                continue;
            }
            entry.slot_error = None;
            entry.counters = Some(counters);
            let marker = Marker::of(&snap);
            if entry.marker != Some(marker) {
                let client_ts = snap
                    .innermost()
                    .map(|o| o.entered_ns)
                    .into_iter()
                    .chain(snap.current_step.as_ref().map(|s| s.start_ns))
                    .filter(|t| *t > prev_ns && *t <= now_ns)
                    .max();
                let first = entry.marker.is_none();
                entry.marker = Some(marker);
                if snap.steps_completed == 0 && !snap.step_open {
                    let init = snap
                        .innermost()
                        .filter(|o| o.id == warden_slot::SECTION_INIT)
                        .map(|o| o.entered_ns);
                    out.goodput.push_init(&entry.key.job, entry.key.rank, init);
                }
                if !first || snap.writer_is_owner() {
                    entry.progress_ns = client_ts
                        .unwrap_or(prev_ns)
                        .max(entry.progress_ns)
                        .min(now_ns);
                    entry.cpu_mark = None;
                }
                if entry.state == RankState::Hung {
                    entry.state = RankState::Running;
                    out.events.push(Signal::RankRecovered {
                        key: entry.key.clone(),
                        step: snap.step,
                        pid: entry.pid,
                    });
                }
            }
            // Noted before the step records are read.
            note_heal_wait(entry, &snap, slots, now_ns, &mut out);
            // Step records feed calibration only from a slot the client
            // still owns (its echoed generation intact), and only records
            // that fit between its registration and now: garbage written
            // over a slot must not teach the agent absurd thresholds.
            let since = entry
                .ingested_start_ns
                .max(entry.registered_ns.saturating_sub(1));
            if snap.writer_is_owner()
                && let Some(job) = jobs.get_mut(&entry.key.job)
            {
                entry.ingested_start_ns = ingest(
                    &snap,
                    since,
                    now_ns,
                    &mut job.calibration,
                    cfg.history,
                    &mut |id| entry_name(&mut entry.names, slots, entry.slot, id),
                    &mut entry.step_times,
                    &mut entry.straggler,
                    &mut |s| out.goodput.push_step(&entry.key.job, entry.key.rank, s),
                    entry.pid,
                    [entry.restarted_ns, entry.heal_wait_ns],
                );
            }
            if snap.writer_is_owner() {
                out.values.extend(
                    snap.recent_steps
                        .iter()
                        .filter(|s| s.loss.is_some() || s.grad_norm.is_some())
                        .map(|s| StepValues {
                            key: entry.key.clone(),
                            generation: entry.generation,
                            step: s.step,
                            loss: s.loss,
                            grad_norm: s.grad_norm,
                        }),
                );
            }
            entry.last = Some(snap);
        } else if let Some(snap) = entry.last.take() {
            // Nothing written since the last read: a wait that read holds
            // but could not take yet (it began after that scan's clock
            // reading, before its read of the slot) is taken now. Else a
            // client asleep in its `heal_wait` writes nothing more, and the
            // wait was never noted (tests/goodput.rs failed on it under
            // load: the gap booked idle, no restart).
            note_heal_wait(entry, &snap, slots, now_ns, &mut out);
            entry.last = Some(snap);
        }
        let Some(job) = jobs.get_mut(&entry.key.job) else {
            continue;
        };
        let Some(snap) = entry.last.as_ref() else {
            continue;
        };
        if entry.restarting && stepped_since(snap, entry.restarted_ns) {
            entry.restarting = false;
        }
        let since = entry.restarting_since();
        let innermost = live_sections(snap, since).last().map(|o| o.id);
        let name = innermost.map(|id| entry_name(&mut entry.names, slots, entry.slot, id));
        let section = section_of(snap, since, name.as_deref());
        entry.threshold = Some(hang::threshold(cfg, &section, &mut job.calibration));
        entry.section = section;
        if entry.cpu_mark.is_none()
            && let Some(t) = &entry.threshold
            && Duration::from_nanos(now_ns.saturating_sub(entry.progress_ns)) > t.value / 2
            && entry.pid != 0
            && let Some(f) = procfs::read(entry.pid)
        {
            entry.cpu_mark = Some((f.cpu_ticks, now_ns));
        }
    }

    // Verdicts, with each rank's position among its job's local ranks.
    let positions: Vec<(RankKey, PeerPosition)> = ranks
        .values()
        .filter(|e| matches!(e.state, RankState::Running | RankState::Hung))
        .map(|e| {
            // Judged only on a slot its client writes: a rank its launcher
            // registered for a script that never imports warden (zero-code
            // mode) has no heartbeats to miss; its exit and process state
            // are what the agent watches.
            let written = e.last.as_ref().is_some_and(|s| s.writer_is_owner());
            let stalled = written && stalled_past(e.progress_ns, now_ns, e.threshold.as_ref());
            (
                e.key.clone(),
                PeerPosition {
                    rank: e.key.rank,
                    step: e.last.as_ref().map_or(0, |s| s.step),
                    section: e.section.clone(),
                    stalled,
                },
            )
        })
        .collect();
    out.positions = job_positions(ranks, &positions, now_ns);
    for (key, me) in &positions {
        if !me.stalled {
            continue;
        }
        let Some(entry) = ranks.get_mut(key) else {
            continue;
        };
        if entry.state != RankState::Running {
            continue;
        }
        entry.state = RankState::Hung;
        let peers: Vec<PeerPosition> = positions
            .iter()
            .filter(|(k, _)| k.job == key.job && k != key)
            .map(|(_, p)| p.clone())
            .collect();
        let threshold = entry.threshold.clone().unwrap_or(Threshold {
            value: Duration::ZERO,
            source: String::new(),
        });
        let stalled_for = Duration::from_nanos(now_ns.saturating_sub(entry.progress_ns));
        let snap = entry.last.as_ref();
        let since = entry.restarting_since();
        let in_section = snap
            .and_then(|s| live_sections(s, since).last())
            .map(|o| Duration::from_nanos(now_ns.saturating_sub(o.entered_ns)));
        let step = snap.map_or(0, |s| s.step);
        let mut evidence = vec![
            ("pid".to_owned(), entry.pid.to_string()),
            ("local_rank".to_owned(), entry.local_rank.to_string()),
            ("section".to_owned(), me.section.clone()),
            ("step".to_owned(), step.to_string()),
            (
                "steps_completed".to_owned(),
                snap.map_or(0, |s| s.steps_completed).to_string(),
            ),
            ("no_progress_for".to_owned(), hang::fmt(stalled_for)),
            ("threshold".to_owned(), hang::fmt(threshold.value)),
            ("threshold_source".to_owned(), threshold.source.clone()),
        ];
        if let Some(d) = in_section {
            evidence.push(("in_section_for".to_owned(), hang::fmt(d)));
        }
        if let Some(s) = snap {
            let slot_index = entry.slot;
            let stack: Vec<String> = live_sections(s, since)
                .map(|o| entry_name(&mut entry.names, slots, slot_index, o.id))
                .collect();
            evidence.push(("open_sections".to_owned(), stack.join(" > ")));
        }
        let mut facts = warden_core::signal::HangFacts {
            step,
            section: me.section.clone(),
            pattern: hang::pattern(me, &peers),
            process_state: String::new(),
            wchan: String::new(),
        };
        evidence.push(("pattern".to_owned(), facts.pattern.clone()));
        if !peers.is_empty() {
            let mut list: Vec<String> = peers
                .iter()
                .take(MAX_PEERS_LISTED)
                .map(|p| {
                    format!(
                        "{}@{}/{}{}",
                        p.rank,
                        p.step,
                        p.section,
                        if p.stalled { "(stalled)" } else { "" }
                    )
                })
                .collect();
            if peers.len() > MAX_PEERS_LISTED {
                list.push(format!("... {} more", peers.len() - MAX_PEERS_LISTED));
            }
            evidence.push(("local_peers".to_owned(), list.join(", ")));
        }
        match procfs::read(entry.pid).filter(|_| entry.pid != 0) {
            None if entry.pid == 0 => evidence.push((
                "process".to_owned(),
                "not visible: outside the agent's PID namespace".to_owned(),
            )),
            None => evidence.push(("process".to_owned(), "gone".to_owned())),
            Some(f) => {
                facts.process_state = format!("{} ({})", f.state, f.state_name());
                evidence.push(("process_state".to_owned(), facts.process_state.clone()));
                evidence.push(("threads".to_owned(), f.threads.to_string()));
                let wchan = if f.wchan.is_empty() || f.wchan == "0" {
                    "-".to_owned()
                } else {
                    f.wchan.clone()
                };
                facts.wchan.clone_from(&wchan);
                evidence.push(("wchan".to_owned(), wchan));
                if let Some((ticks, at)) = entry.cpu_mark {
                    let span = Duration::from_nanos(now_ns.saturating_sub(at));
                    let delta = f.cpu_ticks.saturating_sub(ticks);
                    evidence.push(("cpu_advancing".to_owned(), cpu_verdict(delta, span)));
                }
            }
        }
        out.hangs.push(HangFinding {
            key: key.clone(),
            pid: entry.pid,
            generation: entry.generation,
            message: format!(
                "{} hung: no progress for {} in '{}' at step {step} (threshold {})",
                key,
                hang::fmt(stalled_for),
                me.section,
                hang::fmt(threshold.value)
            ),
            evidence,
            facts,
            // Never with pid 0: kill(0, sig) would signal the agent's own
            // process group.
            stack_dump: entry
                .process
                .as_ref()
                .filter(|_| entry.stack_dump_signal > 0)
                .map(|p| {
                    (
                        entry.stack_dump_signal,
                        entry.stack_dump_path.clone(),
                        p.clone(),
                    )
                }),
        });
    }
    out
}

/// Whether `snap` shows a step begun after `t` (CLOCK_MONOTONIC ns, as
/// the client writes its steps): the rank is stepping again.
fn stepped_since(snap: &SlotSnapshot, t: u64) -> bool {
    snap.current_step.as_ref().is_some_and(|s| s.start_ns > t)
        || snap.recent_steps.iter().any(|s| s.start_ns > t)
}

fn stalled_past(progress_ns: u64, now_ns: u64, threshold: Option<&Threshold>) -> bool {
    threshold.is_some_and(|t| Duration::from_nanos(now_ns.saturating_sub(progress_ns)) > t.value)
}

/// Feeds the completed steps newer than `after_start_ns` into calibration,
/// the rank's step times and its per-section samples (the straggler
/// detector's input); returns the newest start time fed. A step whose
/// record holds the agent's last restart ask (`restarts[0]`) is no sample
/// (the ledger's accounting of it is the incident's, unchanged). The gap before a
/// step is an `idle` sample unless it spans one of `restarts`: the rank's
/// last restart request ([`RankEntry::restarted_ns`]) and the last time it
/// began to await a lost peer's heal ([`RankEntry::heal_wait_ns`]). A step
/// in which it awaited one (its step left open through the wait) is no
/// sample of `step`, of its sections, or of the rank's step times: its
/// length is the launcher's wait; the ledger gets its work before the
/// wait (`restarts[1]`, where the wait began, when it falls inside it).
#[allow(clippy::too_many_arguments)]
fn ingest(
    snap: &SlotSnapshot,
    after_start_ns: u64,
    now_ns: u64,
    cal: &mut calibration::Calibration,
    cap: usize,
    name_of: &mut dyn FnMut(u32) -> String,
    step_times: &mut std::collections::VecDeque<u64>,
    samples: &mut RankSamples,
    ledger: &mut dyn FnMut(warden_core::goodput::StepObs),
    pid: u32,
    restarts: [u64; 2],
) -> u64 {
    let mut newest = after_start_ns;
    let mut prev_end: Option<u64> = None;
    let mut sections: Vec<(String, u64)> = Vec::new();
    for st in &snap.recent_steps {
        let end = st.start_ns.saturating_add(st.duration_ns);
        if st.start_ns > after_start_ns && st.duration_ns > 0 && end <= now_ns {
            sections.clear();
            let mut awaited_heal = false;
            // The recovery the step held: the wait, then the regroup the
            // next attempt does before it begins a step of its own.
            let mut recovery_ns = 0u64;
            for sec in &st.sections {
                let name = name_of(sec.id);
                awaited_heal |= name == calibration::HEAL_WAIT;
                if matches!(
                    name.as_str(),
                    calibration::HEAL_WAIT | calibration::HEAL | calibration::RESTART
                ) {
                    recovery_ns = recovery_ns.saturating_add(sec.total_ns);
                }
                if !name.is_empty() && name != "step" {
                    sections.push((name, sec.total_ns));
                }
            }
            // A step the agent's own restart ask interrupted (the ask
            // inside its record: the record ran on into the restart) is no
            // sample either: its length is the restart's, and each such
            // sample raised the rank's thresholds.
            let asked_inside = restarts[0] != 0 && (st.start_ns..end).contains(&restarts[0]);
            if !awaited_heal && !asked_inside {
                cal.add("step", st.duration_ns, cap);
                if step_times.len() >= RankEntry::STEP_TIMES {
                    step_times.pop_front();
                }
                step_times.push_back(st.duration_ns);
                for (name, ns) in &sections {
                    cal.add(name, *ns, cap);
                }
                samples.push_step(
                    st.duration_ns,
                    sections.iter().map(|(n, ns)| (n.as_str(), *ns)),
                );
            }
            // The ledger takes the step's work before the wait: it ends
            // where the wait began (as a scan saw it open; else the step
            // less its recovery sections), so the wait and the regroup
            // after it fall between steps (time between steps, not useful
            // work), and the step, redone after the heal, is one step of
            // lost progress at most.
            let booked_ns = if !awaited_heal {
                st.duration_ns
            } else if (st.start_ns..end).contains(&restarts[1]) {
                restarts[1] - st.start_ns
            } else {
                st.duration_ns.saturating_sub(recovery_ns)
            };
            ledger(warden_core::goodput::StepObs {
                pid,
                step: st.step,
                start_ns: st.start_ns,
                duration_ns: booked_ns.max(1),
                data_ns: st
                    .sections
                    .iter()
                    .filter(|s| s.id == warden_slot::SECTION_DATA)
                    .map(|s| s.total_ns)
                    .sum(),
            });
            if let Some(pe) = prev_end
                && st.start_ns > pe
                && !restarts.iter().any(|t| (pe..st.start_ns).contains(t))
            {
                cal.add(IDLE, st.start_ns - pe, cap);
            }
            newest = newest.max(st.start_ns);
        }
        prev_end = Some(end);
    }
    newest
}

/// Share of one core a process used, above which a stalled rank is said
/// to spin (a collective busy-polling) rather than to be blocked. Its own
/// housekeeping threads (the client's, the interpreter's) stay far below.
const SPIN_SHARE: f64 = 0.2;

/// Says whether CPU time advanced, and how much, over `span`.
fn cpu_verdict(delta_ticks: u64, span: Duration) -> String {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let secs = span.as_secs_f64().max(1e-3);
    let share = delta_ticks as f64 / hz / secs;
    let over = hang::fmt(span);
    if share >= SPIN_SHARE {
        format!(
            "yes ({:.0}% of a core over the last {over}: spinning or busy)",
            share * 100.0
        )
    } else {
        format!(
            "no ({:.0}% of a core over the last {over}: blocked or stopped)",
            share * 100.0
        )
    }
}

/// A section name through the rank's cache (names are write-once per id).
/// The rank awaits a lost peer's heal by itself (the client's `heal_wait`
/// in `snap`, innermost or not: a hook may open its own inside): the gap it
/// leaves between two steps is no `idle` sample, as after an ask of the
/// agent's, and the ledger books it as the heal's. Only from a slot the
/// client owns, at a time not past `now_ns` (garbage would stick: only a
/// later time replaces it), each wait once.
fn note_heal_wait(
    entry: &mut RankEntry,
    snap: &SlotSnapshot,
    slots: &SlotTable,
    now_ns: u64,
    out: &mut ScanResult,
) {
    if !snap.writer_is_owner() {
        return;
    }
    for o in &snap.open_sections {
        if o.entered_ns > entry.heal_wait_ns
            && o.entered_ns <= now_ns
            && entry_name(&mut entry.names, slots, entry.slot, o.id) == calibration::HEAL_WAIT
        {
            entry.heal_wait_ns = o.entered_ns;
            out.goodput
                .push_heal_wait(&entry.key.job, entry.key.rank, o.entered_ns);
        }
    }
}

fn entry_name(cache: &mut Vec<String>, slots: &SlotTable, slot: u32, id: u32) -> String {
    let i = id as usize;
    if let Some(n) = cache.get(i).filter(|n| !n.is_empty()) {
        return n.clone();
    }
    let name = slots.section_name(slot, id).unwrap_or_default();
    if i < warden_slot::MAX_SECTIONS {
        if cache.len() <= i {
            cache.resize(i + 1, String::new());
        }
        cache[i] = name.clone();
    }
    name
}

/// Reports a slot read error once, until it clears.
fn note_slot_error(entry: &mut RankEntry, msg: &str, out: &mut ScanResult) {
    if entry.slot_error.as_deref() != Some(msg) {
        out.events.push(
            NewEvent::new(
                Severity::Warning,
                "rank.slot_unreadable",
                entry.key.to_string(),
                format!("cannot read the heartbeat slot of {}: {msg}", entry.key),
            )
            .with("slot", entry.slot)
            .with("error", msg)
            .into(),
        );
        entry.slot_error = Some(msg.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranks::registry::RegisterRequest;
    use warden_slot::FIRST_USER_SECTION;

    const MS: u64 = 1_000_000;

    /// Writes step `step` into `slot` from `start` for `len` ns.
    fn step(reg: &Registry, slot: u32, step: u64, start: u64, len: u64) {
        let w = reg.slots().writer(slot).unwrap();
        w.step_begin(step, start);
        reg.slots()
            .writer(slot)
            .unwrap()
            .step_end(step, start + len);
    }

    /// The longest `idle` sample of job "j".
    fn longest_idle(reg: &mut Registry) -> Option<u64> {
        reg.jobs
            .get_mut("j")
            .unwrap()
            .calibration
            .percentile(IDLE, 1.0)
    }

    /// A survivor's gap across an in-process restart (or a heal) is the
    /// fault's, not the loop's: it must not become an `idle` sample, which
    /// would raise the job's between-steps hang threshold after each heal.
    #[test]
    fn a_gap_across_a_restart_request_is_no_idle_sample() {
        let dir = tempfile::tempdir().unwrap();
        let mut reg = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        let t0 = warden_slot::clock::syscall_now();
        let me = std::process::id();
        let a = reg
            .register(&RegisterRequest::for_test("j", 0, 1), t0)
            .unwrap();
        let (slot, generation) = (a.slot_index, a.generation);
        reg.slots()
            .slot(slot)
            .unwrap()
            .attach_writer(generation, me);
        let cfg = HangConfig::default();
        let idle = |reg: &mut Registry| reg.jobs.get_mut("j").unwrap().calibration.count(IDLE);

        // Two steps 1 ms apart: one idle sample.
        step(&reg, slot, 1, t0 + MS, 10 * MS);
        step(&reg, slot, 2, t0 + 12 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 30 * MS, t0);
        assert_eq!(idle(&mut reg), 1);

        // The agent asks for a restart at 40 ms; the rank steps again 5 s on.
        let key = RankKey {
            job: "j".into(),
            rank: 0,
        };
        reg.ranks.get_mut(&key).unwrap().restart_asked(t0 + 40 * MS);
        step(&reg, slot, 3, t0 + 5_000 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 5_020 * MS, t0 + 30 * MS);
        assert_eq!(idle(&mut reg), 1, "the restart's 5 s gap was taken as idle");

        // The loop's own gaps after the restart count again.
        step(&reg, slot, 4, t0 + 5_012 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 5_040 * MS, t0 + 5_020 * MS);
        assert_eq!(idle(&mut reg), 2);
        assert!(
            longest_idle(&mut reg) < Some(10 * MS),
            "an idle sample spans the restart"
        );
    }

    /// A registry with rank 0 of job "j" registered now (the returned
    /// time), its slot attached by this process, and its key; the
    /// directory holds the registry's files.
    fn one_rank() -> (tempfile::TempDir, Registry, u64, u32, RankKey) {
        let dir = tempfile::tempdir().unwrap();
        let mut reg = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        let t0 = warden_slot::clock::syscall_now();
        let a = reg
            .register(&RegisterRequest::for_test("j", 0, 1), t0)
            .unwrap();
        reg.slots()
            .slot(a.slot_index)
            .unwrap()
            .attach_writer(a.generation, std::process::id());
        let key = RankKey {
            job: "j".into(),
            rank: 0,
        };
        (dir, reg, t0, a.slot_index, key)
    }

    /// [`one_rank`], its first user section named `heal_wait`, as the
    /// Python client names it.
    fn heal_wait_rank() -> (tempfile::TempDir, Registry, u64, u32, RankKey) {
        let (dir, reg, t0, slot, key) = one_rank();
        reg.slots()
            .slot(slot)
            .unwrap()
            .write_name(FIRST_USER_SECTION, calibration::HEAL_WAIT);
        (dir, reg, t0, slot, key)
    }

    /// A rank that lost a peer waits for the peer's heal in the client's
    /// `heal_wait` section, then restarts by itself (no ask of the agent's):
    /// that wait is judged by `hang.heal_timeout`, not the `idle` threshold
    /// (a survivor waiting as designed was called hung), and the gap it
    /// leaves between two steps is no `idle` sample; a wait past the
    /// bound is still a hang.
    #[test]
    fn a_lost_peers_heal_awaited_by_the_client_is_judged_by_the_heal_timeout() {
        let (_dir, mut reg, t0, slot, key) = heal_wait_rank();
        let mut cfg = HangConfig::default();
        cfg.timeouts.insert(IDLE.into(), Duration::from_secs(1));
        let idle = |reg: &mut Registry| reg.jobs.get_mut("j").unwrap().calibration.count(IDLE);
        let sec = 1_000 * MS;

        step(&reg, slot, 1, t0 + MS, 10 * MS);
        step(&reg, slot, 2, t0 + 12 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 30 * MS, t0);
        assert_eq!(idle(&mut reg), 1);

        // Step 3 fails on the lost peer; the client waits 4 s (idle's 1 s
        // four times over) for the heal.
        step(&reg, slot, 3, t0 + 24 * MS, 10 * MS);
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(FIRST_USER_SECTION, t0 + 40 * MS);
        scan(&mut reg, &cfg, t0 + 4 * sec, t0 + 30 * MS);
        let e = &reg.ranks[&key];
        assert_eq!(e.state, RankState::Running, "a heal awaited called a hang");
        assert_eq!(e.section, calibration::HEAL_WAIT);
        assert!(!e.restarting, "no ask of the agent's");

        // Its next attempt steps: the 5 s gap is no idle sample.
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_close(FIRST_USER_SECTION, t0 + 5 * sec);
        step(&reg, slot, 4, t0 + 5 * sec + 10 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 5 * sec + 30 * MS, t0 + 4 * sec);
        assert_eq!(reg.ranks[&key].section, IDLE);
        assert_eq!(
            idle(&mut reg),
            2,
            "step 2 to 3 counts, 3 to 4 (the wait) does not"
        );
        assert!(
            longest_idle(&mut reg) < Some(10 * MS),
            "an idle sample spans the wait"
        );

        // A wait that never ends is a hang, at the heal timeout.
        let from = t0 + 6 * sec;
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(FIRST_USER_SECTION, from);
        let bound = u64::try_from(cfg.heal_timeout.as_nanos()).unwrap();
        scan(&mut reg, &cfg, from + bound - sec, t0 + 5 * sec + 30 * MS);
        assert_eq!(reg.ranks[&key].state, RankState::Running);
        scan(&mut reg, &cfg, from + bound + sec, from + bound - sec);
        assert_eq!(reg.ranks[&key].state, RankState::Hung);
        assert_eq!(reg.ranks[&key].section, calibration::HEAL_WAIT);
    }

    /// A `heal_wait` that began after a scan's clock reading but before
    /// its read of the slot is taken by a later scan, though the client,
    /// asleep in it, writes nothing more (tests/goodput.rs's heal, under
    /// load, was booked idle: the only scan that read the slot could not
    /// take the wait yet, and the next ones skipped the unchanged slot).
    #[test]
    fn a_heal_wait_entered_after_the_scans_clock_is_taken_by_the_next_scan() {
        let (_dir, mut reg, t0, slot, key) = heal_wait_rank();
        let cfg = HangConfig::default();
        step(&reg, slot, 1, t0 + MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 20 * MS, t0);
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(FIRST_USER_SECTION, t0 + 40 * MS);
        // This scan's clock read 30 ms: the wait entered at 40 is not yet.
        scan(&mut reg, &cfg, t0 + 30 * MS, t0 + 20 * MS);
        assert_eq!(reg.ranks[&key].heal_wait_ns, 0);
        // Nothing written since; the next scan takes it, once.
        let r = scan(&mut reg, &cfg, t0 + 80 * MS, t0 + 30 * MS);
        assert_eq!(reg.ranks[&key].heal_wait_ns, t0 + 40 * MS);
        let r2 = scan(&mut reg, &cfg, t0 + 130 * MS, t0 + 80 * MS);
        assert!(!r.goodput.is_empty(), "the wait went to the ledger");
        assert!(r2.goodput.is_empty(), "and once: {:?}", r2.goodput);
    }

    /// A `heal_wait` begun after an ask of the agent's, before the next
    /// attempt's first step (it lost a peer in its regrouping), stays the
    /// rank's live section scan after scan: it is no stale section of
    /// before the ask, and the rank is not judged in `restart` meanwhile.
    #[test]
    fn a_heal_awaited_after_an_ask_stays_its_section() {
        let (_dir, mut reg, t0, slot, key) = heal_wait_rank();
        let cfg = HangConfig::default();
        let sec = 1_000 * MS;

        step(&reg, slot, 1, t0 + MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 20 * MS, t0);
        reg.ranks.get_mut(&key).unwrap().restart_asked(t0 + 30 * MS);
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(FIRST_USER_SECTION, t0 + 100 * MS);
        for at in [sec, 2 * sec, 3 * sec] {
            scan(&mut reg, &cfg, t0 + at, t0 + at - sec);
            let e = &reg.ranks[&key];
            assert!(e.restarting, "no step since the ask");
            assert_eq!(e.section, calibration::HEAL_WAIT, "at {at} ns");
            assert_eq!(e.restarted_ns, t0 + 30 * MS, "the ask is the agent's own");
            assert_eq!(e.heal_wait_ns, t0 + 100 * MS);
        }
    }

    /// A step the agent's restart ask interrupted, its record running on
    /// into the restart (the ask inside it), is no sample of `step` or of
    /// the rank's step times: each such sample raised the thresholds.
    #[test]
    fn a_step_an_ask_interrupted_is_no_sample() {
        let (_dir, mut reg, t0, slot, key) = one_rank();
        let cfg = HangConfig::default();
        let steps = |reg: &mut Registry| reg.jobs.get_mut("j").unwrap().calibration.count("step");

        step(&reg, slot, 1, t0 + MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 20 * MS, t0);
        assert_eq!(steps(&mut reg), 1);
        let times = reg.ranks[&key].step_times.len();
        // Step 2 begins, the agent asks a restart at 40 ms, and the record
        // ends only when the next attempt begins its step, 2 s later.
        reg.ranks.get_mut(&key).unwrap().restart_asked(t0 + 40 * MS);
        step(&reg, slot, 2, t0 + 30 * MS, 2_000 * MS);
        step(&reg, slot, 2, t0 + 2_040 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 2_100 * MS, t0 + 20 * MS);
        assert_eq!(steps(&mut reg), 2, "only the redone step 2 is a sample");
        assert_eq!(reg.ranks[&key].step_times.len(), times + 1);
        assert!(
            reg.ranks[&key].step_times.iter().all(|d| *d < 100 * MS),
            "{:?}",
            reg.ranks[&key].step_times
        );
    }

    /// A step the client left open through a lost peer's heal awaited is
    /// no sample of `step`, of its sections, of the rank's step times or
    /// of its straggler samples: its length is the launcher's wait. The
    /// goodput ledger gets the step's work before the wait, not the wait
    /// (which would be booked as useful work).
    #[test]
    fn a_step_left_open_through_a_heal_awaited_is_no_sample() {
        let (_dir, mut reg, t0, slot, key) = heal_wait_rank();
        let cfg = HangConfig::default();
        let steps = |reg: &mut Registry| reg.jobs.get_mut("j").unwrap().calibration.count("step");
        let sec = 1_000 * MS;

        step(&reg, slot, 1, t0 + MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 20 * MS, t0);
        assert_eq!(steps(&mut reg), 1);
        let pushed = reg.ranks[&key].straggler.pushed();
        let w = || reg.slots().writer(slot).unwrap();
        w().step_begin(2, t0 + 90 * MS);
        w().section_open(FIRST_USER_SECTION, t0 + 100 * MS);
        scan(&mut reg, &cfg, t0 + sec, t0 + 20 * MS);
        let w = || reg.slots().writer(slot).unwrap();
        w().section_close(FIRST_USER_SECTION, t0 + 4 * sec);
        w().step_end(2, t0 + 4 * sec + MS);
        step(&reg, slot, 3, t0 + 4 * sec + 10 * MS, 10 * MS);
        let out = scan(&mut reg, &cfg, t0 + 4 * sec + 30 * MS, t0 + sec);
        assert_eq!(
            steps(&mut reg),
            2,
            "steps 1 and 3; step 2 held the 4 s wait"
        );
        let booked: Vec<(u64, u64, u64)> = out
            .goodput
            .steps()
            .map(|(_, _, s)| (s.step, s.start_ns, s.duration_ns))
            .collect();
        assert_eq!(
            booked,
            vec![
                (2, t0 + 90 * MS, 10 * MS),
                (3, t0 + 4 * sec + 10 * MS, 10 * MS)
            ],
            "step 2's work before the wait (opened 10 ms in, as the scan saw it), not the wait \
             nor the 1 ms after it"
        );

        // A wait no scan saw open (it began and ended between two), then
        // the next attempt's regroup in `heal`: the step less both.
        reg.slots()
            .slot(slot)
            .unwrap()
            .write_name(FIRST_USER_SECTION + 1, calibration::HEAL);
        let w = || reg.slots().writer(slot).unwrap();
        let b = t0 + 5 * sec;
        w().step_begin(4, b);
        w().section_open(FIRST_USER_SECTION, b + 20 * MS);
        w().section_close(FIRST_USER_SECTION, b + 520 * MS);
        w().section_open(FIRST_USER_SECTION + 1, b + 530 * MS);
        w().section_close(FIRST_USER_SECTION + 1, b + 730 * MS);
        w().step_end(4, b + 735 * MS);
        let out = scan(&mut reg, &cfg, b + 800 * MS, t0 + 4 * sec + 30 * MS);
        let booked: Vec<(u64, u64)> = out
            .goodput
            .steps()
            .map(|(_, _, s)| (s.step, s.duration_ns))
            .collect();
        assert_eq!(
            booked,
            vec![(4, 35 * MS)],
            "735 ms less the 500 ms wait and the 200 ms regroup"
        );
        let e = &reg.ranks[&key];
        assert!(
            e.step_times.iter().all(|&d| d < 100 * MS),
            "{:?}",
            e.step_times
        );
        assert_eq!(e.straggler.pushed(), pushed + 1, "step 3 only");
    }

    /// A rank asked to restart in process tears down and re-initialises
    /// before it steps again (its process group, its restore), for longer
    /// than its between-steps threshold: that is no hang (it restarted the
    /// job a second time). It is judged in `restart` from the ask until its
    /// next step, but for a section it opened since (one left open from
    /// before the ask is stale), and a restart that never steps is still a
    /// hang, at `restart`'s bounded threshold.
    #[test]
    fn a_rank_reinitialising_after_a_restart_request_is_judged_in_restart() {
        use warden_slot::{SECTION_CHECKPOINT, SECTION_FORWARD};
        let (_dir, mut reg, t0, slot, key) = one_rank();
        let mut cfg = HangConfig::default();
        cfg.timeouts.insert(IDLE.into(), Duration::from_secs(1));
        cfg.timeouts
            .insert("forward".into(), Duration::from_secs(1));
        let s = 1_000 * MS;

        step(&reg, slot, 1, t0 + MS, 10 * MS);
        step(&reg, slot, 2, t0 + 12 * MS, 10 * MS);
        // Step 3 stops in its forward pass (a peer's fault).
        reg.slots()
            .writer(slot)
            .unwrap()
            .step_begin(3, t0 + 30 * MS);
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(SECTION_FORWARD, t0 + 31 * MS);
        scan(&mut reg, &cfg, t0 + 40 * MS, t0);
        assert_eq!(reg.ranks[&key].section, "forward");

        // Asked at 1 s; 3 s later it has not stepped (forward's and idle's
        // 1 s passed), its forward section still open from before.
        reg.ranks.get_mut(&key).unwrap().restart_asked(t0 + s);
        scan(&mut reg, &cfg, t0 + 4 * s, t0 + 40 * MS);
        let e = &reg.ranks[&key];
        assert_eq!(e.state, RankState::Running, "a re-init called a hang");
        assert_eq!(e.section, calibration::RESTART, "the stale forward counts");
        // A section it opens after the ask is its own.
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_close(SECTION_FORWARD, t0 + 4 * s + 10 * MS);
        reg.slots()
            .writer(slot)
            .unwrap()
            .step_end(3, t0 + 4 * s + 11 * MS);
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_open(SECTION_CHECKPOINT, t0 + 4 * s + 20 * MS);
        scan(&mut reg, &cfg, t0 + 4 * s + 30 * MS, t0 + 4 * s);
        let e = &reg.ranks[&key];
        assert!(e.restarting, "the interrupted step's end is no new step");
        assert_eq!(e.section, "checkpoint");
        reg.slots()
            .writer(slot)
            .unwrap()
            .section_close(SECTION_CHECKPOINT, t0 + 4 * s + 40 * MS);

        // It steps again: judged on its steps and gaps as before.
        step(&reg, slot, 3, t0 + 5 * s, 10 * MS);
        scan(&mut reg, &cfg, t0 + 5 * s + 20 * MS, t0 + 4 * s + 30 * MS);
        let e = &reg.ranks[&key];
        assert!(!e.restarting);
        assert_eq!(e.section, IDLE);
        scan(&mut reg, &cfg, t0 + 7 * s, t0 + 5 * s + 20 * MS);
        assert_eq!(reg.ranks[&key].state, RankState::Hung, "idle's 1 s again");

        // It steps (recovered), is asked again long after and never steps:
        // a hang at restart's threshold (hang.heal_timeout) from the ask.
        step(&reg, slot, 4, t0 + 7 * s + 500 * MS, 10 * MS);
        scan(&mut reg, &cfg, t0 + 7 * s + 520 * MS, t0 + 7 * s);
        assert_eq!(reg.ranks[&key].state, RankState::Running);
        let ask = t0 + 30 * s;
        reg.ranks.get_mut(&key).unwrap().restart_asked(ask);
        let bound = u64::try_from(cfg.heal_timeout.as_nanos()).unwrap();
        scan(&mut reg, &cfg, ask + bound - s, t0 + 7 * s + 520 * MS);
        assert_eq!(reg.ranks[&key].state, RankState::Running);
        scan(&mut reg, &cfg, ask + bound + s, ask + bound - s);
        assert_eq!(reg.ranks[&key].state, RankState::Hung);
        assert_eq!(reg.ranks[&key].section, calibration::RESTART);
    }
}
