//! The goodput ledger: a pure state machine that splits each rank's wall
//! time into productive step time and badput by cause.
//!
//! Every rank has a cursor: all of its time before the cursor is accounted
//! to exactly one [`Cause`], none after it. Each observation (a completed
//! step, an incident, an exit, a restore) advances the cursor and hands the
//! interval it crossed to one cause, or moves time already accounted from
//! one cause to another (a checkpoint save stall measured by the client).
//! So the parts always add up to the span between the rank's launch and its
//! cursor, and nothing is counted twice: that is the invariant the tests
//! check. A job's totals are the sum over its ranks (accelerator-seconds:
//! time x ranks).
//!
//! Times are CLOCK_MONOTONIC nanoseconds (the clock of the heartbeat slots,
//! the same for every process of one boot, so the journal replays across
//! agent restarts). No I/O here: [`super::task`] feeds it, [`super::journal`]
//! keeps it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where a rank's time went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Steps that count: completed, not redone, less the badput carved out
    /// of them (data wait, straggler drag, save stall).
    Productive,
    /// Launch to the client's registration: the interpreter and the imports
    /// that run before the training script reaches warden.
    StartupImport,
    /// Time in the "init" section before the first step (process-group
    /// set-up), when the client opens one.
    StartupInit,
    /// The rest of launch to first step of the first attempt.
    Startup,
    /// The training step blocked by a checkpoint save (the client measures it).
    CheckpointSave,
    /// A restarted rank restoring its checkpoint.
    CheckpointRestore,
    /// Last completed step to the incident (a hang's timeout, a crash's
    /// exit), less the step in flight (lost progress).
    DetectionWait,
    /// The incident to the first step after the restart, less the restore.
    RestartDowntime,
    /// Work redone after a fault: the step in flight when it came (up to
    /// one step of the rank's baseline), and a step number completed
    /// before, seen again after a restart.
    LostProgress,
    /// Step time above the rank's own baseline while a rank of its job is
    /// flagged as a straggler.
    StragglerDrag,
    /// Time in the "data" section above its own baseline.
    DataWait,
    /// Between steps with nothing to show for it, or unobserved (the agent
    /// was down).
    Idle,
}

impl Cause {
    /// Every cause, in report order.
    pub const ALL: [Cause; 12] = [
        Cause::Productive,
        Cause::StartupImport,
        Cause::StartupInit,
        Cause::Startup,
        Cause::CheckpointSave,
        Cause::CheckpointRestore,
        Cause::DetectionWait,
        Cause::RestartDowntime,
        Cause::LostProgress,
        Cause::StragglerDrag,
        Cause::DataWait,
        Cause::Idle,
    ];

    /// The stable name used in the API, the journal, metrics and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Productive => "productive",
            Cause::StartupImport => "startup_import",
            Cause::StartupInit => "startup_init",
            Cause::Startup => "startup",
            Cause::CheckpointSave => "checkpoint_save",
            Cause::CheckpointRestore => "checkpoint_restore",
            Cause::DetectionWait => "detection_wait",
            Cause::RestartDowntime => "restart_downtime",
            Cause::LostProgress => "lost_progress",
            Cause::StragglerDrag => "straggler_drag",
            Cause::DataWait => "data_wait",
            Cause::Idle => "idle",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Nanoseconds per cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Parts(pub [i64; 12]);

impl Parts {
    /// Time accounted to `c`.
    pub fn get(&self, c: Cause) -> i64 {
        self.0[c.index()]
    }

    /// Sum of every cause.
    pub fn total(&self) -> i64 {
        self.0.iter().sum()
    }

    fn add(&mut self, c: Cause, ns: i64) {
        self.0[c.index()] += ns;
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &Parts) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a += b;
        }
    }
}

/// Recovery occurrences: how often each thing happened and how long it
/// took in all, per rank, in wall nanoseconds (the planner's inputs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Occurrences {
    /// Steps counted productive, and their duration.
    pub steps: (u64, i64),
    /// First-attempt start-ups (launch to first step).
    pub startups: (u64, i64),
    /// Detections (last step to incident, less the step in flight).
    pub detections: (u64, i64),
    /// Restarts completed (incident to first step, less restore).
    pub restarts: (u64, i64),
    /// Restores reported by the client.
    pub restores: (u64, i64),
    /// Saves reported by the client, with their stall.
    pub saves: (u64, i64),
}

impl Occurrences {
    /// Adds `o` into `self`.
    pub fn merge(&mut self, o: &Occurrences) {
        for (a, b) in [
            (&mut self.steps, o.steps),
            (&mut self.startups, o.startups),
            (&mut self.detections, o.detections),
            (&mut self.restarts, o.restarts),
            (&mut self.restores, o.restores),
            (&mut self.saves, o.saves),
        ] {
            a.0 += b.0;
            a.1 += b.1;
        }
    }
}

/// Where a rank is in its life, as the ledger sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "phase")]
pub enum Phase {
    /// Launched, no step yet (first attempt): time is start-up.
    Starting,
    /// Stepping: gaps are idle, steps productive (or a cause carved out).
    Running,
    /// The job had an incident at `at_ns`: time is restart downtime until
    /// a step of the restarted rank (a new process, or after the job was
    /// told to resume in process at or after `at_ns`).
    Disrupted {
        /// When the incident happened.
        at_ns: u64,
        /// The rank's process when it happened.
        pid: u32,
    },
    /// Finished (clean exit, or the job was closed): no more time accrues.
    Ended,
}

/// One rank's account.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankLedger {
    /// When the rank was first launched (its process start).
    pub start_ns: u64,
    /// Everything before is accounted.
    pub cursor_ns: u64,
    /// Where the rank is.
    pub phase: Phase,
    /// Its current process.
    pub pid: u32,
    /// Highest step number completed in any attempt (lost progress: a
    /// number at or below it, completed again after a restart).
    pub high_water: Option<u64>,
    /// Time per cause.
    pub parts: Parts,
    /// Occurrences for the recovery means.
    pub occ: Occurrences,
    /// A save stall reported before the time it covers was accounted: taken
    /// from the next idle or productive time.
    pub save_debt_ns: i64,
    /// A restore reported before the downtime it covers was accounted.
    pub restore_debt_ns: i64,
    /// When the rank's "init" section opened before its first step.
    #[serde(default)]
    pub init_open_ns: Option<u64>,
    /// Time spent in "init" before the first step, not yet carved out of
    /// start-up.
    #[serde(default)]
    pub init_ns: i64,
    /// When the rank last entered its client's `heal_wait` section (a lost
    /// peer's error: it waits for that peer's heal, then goes on in the
    /// same process), until its next step takes it ([`JobLedger::step`]).
    #[serde(default)]
    pub heal_wait_ns: Option<u64>,
    /// Recent step durations (baseline for straggler drag); not journaled.
    #[serde(skip)]
    step_base: Baseline,
    /// Recent "data" section durations (baseline for data wait); not journaled.
    #[serde(skip)]
    data_base: Baseline,
}

/// A small window of recent durations and their median.
///
/// The median is recomputed every [`Baseline::EVERY`] pushes, on a copy on
/// the stack: a baseline moves slowly, and the ledger runs on every scan,
/// so it must cost next to nothing per step (no allocation).
#[derive(Debug, Clone, Default, PartialEq)]
struct Baseline {
    ring: [i64; Baseline::LEN],
    len: usize,
    next: usize,
    pushes: u32,
    median: Option<i64>,
}

impl Baseline {
    const LEN: usize = 31;
    const MIN: usize = 5;
    const EVERY: u32 = 8;

    fn median(&self) -> Option<i64> {
        self.median
    }

    fn push(&mut self, ns: i64) {
        self.ring[self.next] = ns;
        self.next = (self.next + 1) % Self::LEN;
        self.len = (self.len + 1).min(Self::LEN);
        self.pushes = self.pushes.wrapping_add(1);
        if self.len >= Self::MIN
            && (self.median.is_none() || self.pushes.is_multiple_of(Self::EVERY))
        {
            let mut v = self.ring;
            let w = &mut v[..self.len];
            let mid = w.len() / 2;
            self.median = Some(*w.select_nth_unstable(mid).1);
        }
    }
}

impl RankLedger {
    fn new(start_ns: u64, pid: u32) -> Self {
        Self {
            start_ns,
            cursor_ns: start_ns,
            phase: Phase::Starting,
            pid,
            high_water: None,
            parts: Parts::default(),
            occ: Occurrences::default(),
            save_debt_ns: 0,
            restore_debt_ns: 0,
            init_open_ns: None,
            init_ns: 0,
            heal_wait_ns: None,
            step_base: Baseline::default(),
            data_base: Baseline::default(),
        }
    }

    /// A lost peer's heal awaited in the same process, the failure seen at
    /// `failed_ns` and the rank back at `back_ns`: from the cursor, the
    /// step in flight (up to one step of its baseline) is lost progress,
    /// the rest to the failure detection wait, then restart downtime (the
    /// heal and the round), as an incident's ([`Ledger::incident`]); one
    /// detection and one restart counted. `in_flight_booked`: the step in
    /// flight already has a record (ended at the failure, its number to be
    /// redone and booked lost then), so none of the gap is carved for it.
    fn healed(&mut self, failed_ns: u64, back_ns: u64, in_flight_booked: bool) {
        self.detected(failed_ns, !in_flight_booked);
        let ns = self.advance(back_ns, Cause::RestartDowntime);
        self.occ.restarts.0 += 1;
        self.occ.restarts.1 += ns;
    }

    /// A fault seen at `at_ns`: from the cursor, the step in flight (up to
    /// one step of the rank's baseline, when `carve_in_flight`) is lost
    /// progress, the rest detection wait; one detection counted.
    fn detected(&mut self, at_ns: u64, carve_in_flight: bool) {
        let since = ns_between(self.cursor_ns, at_ns);
        let in_flight = if carve_in_flight {
            self.step_base.median().map_or(0, |b| b.clamp(0, since))
        } else {
            0
        };
        let cut = self
            .cursor_ns
            .saturating_add(u64::try_from(in_flight).unwrap_or(0));
        self.advance(cut, Cause::LostProgress);
        let ns = self.advance(at_ns, Cause::DetectionWait);
        self.occ.detections.0 += 1;
        self.occ.detections.1 += ns;
    }

    /// The rank runs in a new process `pid`, launched at `launch_ns`
    /// (from its registration, or its first step when that came first).
    fn new_process(&mut self, pid: u32, launch_ns: u64) {
        let old = self.pid;
        self.pid = pid;
        // A heal the old process awaited is not the new one's.
        self.heal_wait_ns = None;
        match self.phase {
            Phase::Disrupted { .. } => {}
            Phase::Starting | Phase::Running => {
                // A new process with no incident seen (the agent was down
                // when it happened, or the old process's exit is still on
                // its way): downtime from the last accounted time.
                self.phase = Phase::Disrupted {
                    at_ns: self.cursor_ns,
                    pid: old,
                };
            }
            Phase::Ended => {
                // The job id runs again: the time in between is nobody's,
                // but the invariant wants it somewhere; it is idle.
                self.advance(launch_ns, Cause::Idle);
                self.phase = Phase::Disrupted {
                    at_ns: launch_ns,
                    pid: old,
                };
            }
        }
    }

    /// Accounts `[cursor, to)` to `cause`; returns the length accounted.
    fn advance(&mut self, to: u64, cause: Cause) -> i64 {
        if to <= self.cursor_ns {
            return 0;
        }
        let ns = ns_between(self.cursor_ns, to);
        self.parts.add(cause, ns);
        self.cursor_ns = to;
        ns
    }

    /// Moves up to `ns` from the causes in `from` (in order) to `to`;
    /// returns what could not be moved.
    fn carve(&mut self, mut ns: i64, from: &[Cause], to: Cause) -> i64 {
        for &c in from {
            if ns <= 0 {
                break;
            }
            let take = ns.min(self.parts.get(c).max(0));
            self.parts.add(c, -take);
            self.parts.add(to, take);
            ns -= take;
        }
        ns
    }

    /// Pays the start-up carve-outs (init section, restore) out of start-up.
    fn settle_startup_carves(&mut self) {
        if self.init_ns > 0 {
            self.init_ns = self.carve(self.init_ns, &[Cause::Startup], Cause::StartupInit);
        }
        self.pay_restore_debt();
    }

    fn pay_restore_debt(&mut self) {
        if self.restore_debt_ns > 0 {
            self.restore_debt_ns = self.carve(
                self.restore_debt_ns,
                &[Cause::RestartDowntime, Cause::Startup],
                Cause::CheckpointRestore,
            );
        }
    }

    fn pay_save_debt(&mut self) {
        if self.save_debt_ns > 0 {
            self.save_debt_ns = self.carve(
                self.save_debt_ns,
                &[Cause::Idle, Cause::Productive],
                Cause::CheckpointSave,
            );
        }
    }
}

fn ns_between(from: u64, to: u64) -> i64 {
    i64::try_from(to.saturating_sub(from)).unwrap_or(i64::MAX)
}

/// A completed step, as the heartbeat scan read it from a rank's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepObs {
    /// The rank's process.
    pub pid: u32,
    /// Step number.
    pub step: u64,
    /// When it began (CLOCK_MONOTONIC ns).
    pub start_ns: u64,
    /// How long it took.
    pub duration_ns: u64,
    /// Time in its "data" section, when it has one.
    pub data_ns: u64,
}

/// One job's account.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobLedger {
    /// Per global rank.
    pub ranks: BTreeMap<u32, RankLedger>,
    /// The job was told to go on in process (an in-process restart, a hang
    /// that cleared) at this time: disrupted ranks resume at their next step
    /// begun after it.
    pub resumed_ns: Option<u64>,
    /// Ranks flagged as stragglers now.
    #[serde(default)]
    pub stragglers: std::collections::BTreeSet<u32>,
    /// Ranks whose state changed since the journal last took them.
    #[serde(skip)]
    pub dirty: std::collections::BTreeSet<u32>,
}

impl JobLedger {
    /// True when no rank of the job can accrue time any more (every one
    /// ended, or none registered): its journal can be closed.
    pub fn all_ended(&self) -> bool {
        self.ranks.values().all(|r| r.phase == Phase::Ended)
    }

    /// A completed step of `rank` (the work of [`Ledger::step`], for a
    /// caller that already holds the job: a fold of the scan's records
    /// looks each job up once per run of its ranks, not once per record).
    pub fn step(&mut self, rank: u32, s: StepObs) {
        let straggling = !self.stragglers.is_empty();
        let resumed = self.resumed_ns;
        let Some(r) = self.ranks.get_mut(&rank) else {
            return;
        };
        let end = s.start_ns.saturating_add(s.duration_ns);
        if end <= r.cursor_ns || r.phase == Phase::Ended {
            return; // already accounted (a ring read again after a restart)
        }
        self.dirty.insert(rank);
        if s.pid != 0
            && s.pid != r.pid
            && !matches!(r.phase, Phase::Disrupted { pid, .. } if pid == s.pid)
        {
            // A step of a process the ledger has not seen register yet:
            // steps come straight from the scan, registrations through the
            // bus, so a warm restart's first steps (back within ~0.1 s) can
            // arrive before its RankRegistered. The step's own pid says whose
            // it is; its registration then finds the same process.
            r.new_process(s.pid, s.start_ns);
        }
        let start = s.start_ns.max(r.cursor_ns);
        let dur = ns_between(start, end);
        let redone = r.high_water.is_some_and(|hw| s.step <= hw);
        let high_water_before = r.high_water;
        r.high_water = Some(r.high_water.map_or(s.step, |hw| hw.max(s.step)));
        match r.phase {
            Phase::Starting => {
                if let Some(open) = r.init_open_ns.take() {
                    r.init_ns += ns_between(open, start);
                }
                let ns = r.advance(start, Cause::Startup);
                let import = r.parts.get(Cause::StartupImport);
                r.occ.startups.0 += 1;
                r.occ.startups.1 += ns + import;
                r.settle_startup_carves();
                r.phase = Phase::Running;
            }
            Phase::Disrupted { at_ns, pid } => {
                let restarted = (pid != 0 && r.pid != pid) || resumed.is_some_and(|t| t >= at_ns);
                if !restarted || start < at_ns {
                    // A step of the old attempt finishing after the
                    // incident: the job is down, the step will be redone.
                    r.advance(end, Cause::RestartDowntime);
                    return;
                }
                let restore_before = r.parts.get(Cause::CheckpointRestore);
                r.advance(start, Cause::RestartDowntime);
                r.pay_restore_debt();
                let carved = r.parts.get(Cause::CheckpointRestore) - restore_before;
                r.occ.restarts.0 += 1;
                r.occ.restarts.1 += (ns_between(at_ns, start) - carved).max(0);
                r.phase = Phase::Running;
            }
            // A wait for a lost peer's heal (its client's `heal_wait`):
            // no incident is booked on a survivor's host, the fault being
            // the other host's, so without this the wait was idle time (or
            // a productive step's, below). Booked as an incident's
            // ([`RankLedger::healed`]), once.
            Phase::Running => match r.heal_wait_ns {
                // In the gap before this step: the interrupted step's
                // record ended at the failure (as a step context ends it),
                // or where the wait began (the scan cuts a record that
                // held the wait there, so the wait starts at the cursor).
                Some(t) if t >= r.cursor_ns && t < start => {
                    r.heal_wait_ns = None;
                    // This step redoing a number already completed: the
                    // interrupted record was the step in flight (its time,
                    // the collective's wait for the fault included, stays
                    // in it; this step is booked lost below).
                    r.healed(t, start, redone);
                }
                // Inside this step's record: the step was interrupted and
                // its record ran on until the next step began (a client
                // that only marks each step's start). It is the attempt
                // the heal redoes: no work of it is kept, its number not
                // completed.
                Some(t) if t >= r.cursor_ns && t < end => {
                    r.heal_wait_ns = None;
                    r.high_water = high_water_before;
                    r.advance(start, Cause::Idle);
                    r.healed(t, end, false);
                    return;
                }
                wait => {
                    // One past this step waits for the next; one already
                    // behind the cursor is stale.
                    if wait.is_some_and(|t| t < r.cursor_ns) {
                        r.heal_wait_ns = None;
                    }
                    r.advance(start, Cause::Idle);
                }
            },
            Phase::Ended => return,
        }
        // The step itself.
        if redone {
            r.advance(end, Cause::LostProgress);
            return;
        }
        let data = i64::try_from(s.data_ns).unwrap_or(i64::MAX).min(dur);
        let data_wait = r.data_base.median().map_or(0, |b| (data - b).clamp(0, dur));
        if s.data_ns > 0 {
            r.data_base.push(data);
        }
        let drag = if straggling {
            r.step_base
                .median()
                .map_or(0, |b| (dur - data_wait - b).clamp(0, dur - data_wait))
        } else {
            r.step_base.push(dur);
            0
        };
        let from = r.cursor_ns;
        r.parts.add(Cause::DataWait, data_wait);
        r.parts.add(Cause::StragglerDrag, drag);
        r.parts.add(Cause::Productive, dur - data_wait - drag);
        r.cursor_ns = end;
        debug_assert_eq!(ns_between(from, end), dur);
        r.occ.steps.0 += 1;
        r.occ.steps.1 += dur;
        r.pay_save_debt();
    }
}

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    /// Exited with code 0 on its own.
    Clean,
    /// Stopped by its launcher because the job ends.
    JobEnding,
    /// Stopped by its launcher for a restart.
    StoppedForRestart,
    /// Stopped on a notice of a coming stop (preemption, maintenance):
    /// planned, booked like the job's end, never as an incident.
    Preempted,
    /// Crashed or was killed: an incident.
    Failed,
}

/// Every job's ledger.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    /// By job id.
    pub jobs: BTreeMap<String, JobLedger>,
}

impl Ledger {
    /// A rank registered: launched at `launch_ns` (its process start),
    /// registered at `registered_ns`, as process `pid`.
    pub fn registered(
        &mut self,
        job: &str,
        rank: u32,
        pid: u32,
        launch_ns: u64,
        registered_ns: u64,
    ) {
        let j = self.jobs.entry(job.to_owned()).or_default();
        j.dirty.insert(rank);
        let launch_ns = launch_ns.min(registered_ns);
        let Some(r) = j.ranks.get_mut(&rank) else {
            let mut r = RankLedger::new(launch_ns, pid);
            r.advance(registered_ns, Cause::StartupImport);
            j.ranks.insert(rank, r);
            return;
        };
        if r.pid == pid {
            // The same process again: it reconnected (the agent restarted,
            // or its slot was rebuilt). Nothing about the job changed.
            return;
        }
        r.new_process(pid, launch_ns);
    }

    /// The scan saw a rank with no step yet in its "init" section
    /// (`entered_ns`), or out of it (`None`) at `now_ns`.
    pub fn init_section(&mut self, job: &str, rank: u32, entered_ns: Option<u64>, now_ns: u64) {
        let Some(r) = self.jobs.get_mut(job).and_then(|j| j.ranks.get_mut(&rank)) else {
            return;
        };
        if r.phase != Phase::Starting {
            return;
        }
        match (r.init_open_ns, entered_ns) {
            (None, Some(t)) => r.init_open_ns = Some(t),
            (Some(open), None) => {
                r.init_ns += ns_between(open, now_ns);
                r.init_open_ns = None;
            }
            _ => {}
        }
    }

    /// The scan saw `job`'s `rank` enter its client's `heal_wait` section
    /// at `entered_ns`: the gap before its next step is the heal's
    /// ([`JobLedger::step`]), not idle time.
    pub fn heal_wait(&mut self, job: &str, rank: u32, entered_ns: u64) {
        let Some(j) = self.jobs.get_mut(job) else {
            return;
        };
        let Some(r) = j.ranks.get_mut(&rank) else {
            return;
        };
        // Kept in any phase but the end (a first step or a restart's may be
        // folded after it in the same scan); only a running rank's next
        // step takes it.
        if r.phase != Phase::Ended && entered_ns >= r.cursor_ns {
            r.heal_wait_ns = Some(entered_ns);
            j.dirty.insert(rank);
        }
    }

    /// A completed step of a rank.
    pub fn step(&mut self, job: &str, rank: u32, s: StepObs) {
        if let Some(j) = self.jobs.get_mut(job) {
            j.step(rank, s);
        }
    }
    /// An incident in `job` at `at_ns` (a hang declared, a rank crashed):
    /// every rank's time since its last step is the step in flight, lost,
    /// then detection wait; from now on restart downtime.
    ///
    /// The step in flight never completes: whatever recovers the job (a
    /// heal from a live replica, an in-process restart, a checkpoint
    /// restore) does it again. So its work so far is lost progress, at most
    /// one step of the rank's own baseline (the median of its recent
    /// steps) after its last one; only the time past that is the wait for
    /// the incident to be seen. Without a baseline yet (fewer than 5 steps
    /// since the agent started) it is all detection wait.
    pub fn incident(&mut self, job: &str, at_ns: u64) {
        let Some(j) = self.jobs.get_mut(job) else {
            return;
        };
        for (rank, r) in &mut j.ranks {
            match r.phase {
                Phase::Running => r.detected(at_ns, true),
                Phase::Starting => {
                    r.advance(at_ns, Cause::Startup);
                    r.settle_startup_carves();
                }
                Phase::Disrupted { .. } | Phase::Ended => continue,
            }
            r.phase = Phase::Disrupted {
                at_ns: at_ns.max(r.cursor_ns),
                pid: r.pid,
            };
            j.dirty.insert(*rank);
        }
    }

    /// The job was told to go on in process at `at_ns` (a restart request
    /// to its ranks, or a hung rank that made progress again).
    pub fn resumed(&mut self, job: &str, at_ns: u64) {
        if let Some(j) = self.jobs.get_mut(job) {
            j.resumed_ns = Some(at_ns);
        }
    }

    /// A rank's process ended at `at_ns`.
    pub fn exited(&mut self, job: &str, rank: u32, pid: u32, kind: ExitKind, at_ns: u64) {
        let older = |j: &JobLedger| j.ranks.get(&rank).is_some_and(|r| pid != 0 && r.pid != pid);
        if self.jobs.get(job).is_some_and(older) {
            // An older process of the rank, reported after its replacement
            // registered (a warm restart's rank is back within ~0.1 s, before
            // the agent has read every stopped process's exit): its attempt's
            // end was accounted when that attempt was disrupted; taking it
            // for a new incident would book the new attempt's steps as
            // downtime.
            return;
        }
        if kind == ExitKind::Failed
            || (kind == ExitKind::StoppedForRestart
                && self
                    .jobs
                    .get(job)
                    .and_then(|j| j.ranks.get(&rank))
                    .is_some_and(|r| matches!(r.phase, Phase::Running | Phase::Starting)))
        {
            self.incident(job, at_ns);
            return;
        }
        if matches!(kind, ExitKind::StoppedForRestart) {
            return;
        }
        let Some(j) = self.jobs.get_mut(job) else {
            return;
        };
        let Some(r) = j.ranks.get_mut(&rank) else {
            return;
        };
        j.dirty.insert(rank);
        end_rank(r, at_ns);
    }

    /// The job is over at `at_ns` (its launcher said so): every rank still
    /// open is closed; nothing accrues after. A rank that finished before
    /// the others held its accelerator until the job ended: that time is
    /// idle, so a closed job accounts wall time x ranks.
    pub fn close(&mut self, job: &str, at_ns: u64) {
        let Some(j) = self.jobs.get_mut(job) else {
            return;
        };
        for (rank, r) in &mut j.ranks {
            if r.phase == Phase::Ended {
                r.advance(at_ns, Cause::Idle);
            } else {
                end_rank(r, at_ns);
            }
            j.dirty.insert(*rank);
        }
    }

    /// A rank of the job is flagged as a straggler (`on`) or no longer.
    pub fn straggler(&mut self, job: &str, rank: u32, on: bool) {
        if let Some(j) = self.jobs.get_mut(job) {
            if on {
                j.stragglers.insert(rank);
            } else {
                j.stragglers.remove(&rank);
            }
        }
    }

    /// A checkpoint save blocked the rank's step for `stall_ns`.
    pub fn saved(&mut self, job: &str, rank: u32, stall_ns: i64) {
        let Some(r) = self.rank_mut(job, rank) else {
            return;
        };
        let stall = stall_ns.max(0);
        r.occ.saves.0 += 1;
        r.occ.saves.1 += stall;
        r.save_debt_ns += stall;
        r.pay_save_debt();
    }

    /// The rank restored a checkpoint in `duration_ns`.
    pub fn restored(&mut self, job: &str, rank: u32, duration_ns: i64) {
        let Some(r) = self.rank_mut(job, rank) else {
            return;
        };
        let d = duration_ns.max(0);
        r.occ.restores.0 += 1;
        r.occ.restores.1 += d;
        r.restore_debt_ns += d;
        if r.phase == Phase::Running {
            // The downtime it covers is already accounted.
            r.pay_restore_debt();
        }
    }

    fn rank_mut(&mut self, job: &str, rank: u32) -> Option<&mut RankLedger> {
        let j = self.jobs.get_mut(job)?;
        j.dirty.insert(rank);
        j.ranks.get_mut(&rank)
    }

    /// The job's breakdown as of `now_ns`: settled time, plus the open time
    /// of ranks starting or down (unambiguous before the next observation).
    /// A running rank's time since its last step (the step in progress) is
    /// left out until the step ends.
    pub fn report(&self, job: &str, now_ns: u64) -> Option<JobReport> {
        let j = self.jobs.get(job)?;
        let mut rep = JobReport {
            job: job.to_owned(),
            ranks: u32::try_from(j.ranks.len()).unwrap_or(u32::MAX),
            ..JobReport::default()
        };
        let mut first = u64::MAX;
        let mut last = 0;
        for r in j.ranks.values() {
            let mut parts = r.parts;
            let mut end = r.cursor_ns;
            match r.phase {
                Phase::Starting => {
                    parts.add(Cause::Startup, ns_between(r.cursor_ns, now_ns));
                    end = end.max(now_ns);
                }
                Phase::Disrupted { .. } => {
                    parts.add(Cause::RestartDowntime, ns_between(r.cursor_ns, now_ns));
                    end = end.max(now_ns);
                }
                Phase::Running | Phase::Ended => {}
            }
            rep.parts.merge(&parts);
            rep.occ.merge(&r.occ);
            rep.restarts = rep.restarts.max(r.occ.restarts.0);
            rep.saves = rep.saves.max(r.occ.saves.0);
            first = first.min(r.start_ns);
            last = last.max(end);
            rep.open |= r.phase != Phase::Ended;
        }
        rep.wall_ns = ns_between(first, last);
        Some(rep)
    }
}

fn end_rank(r: &mut RankLedger, at_ns: u64) {
    match r.phase {
        Phase::Running => {
            r.advance(at_ns, Cause::Idle);
        }
        Phase::Starting => {
            r.advance(at_ns, Cause::Startup);
            r.settle_startup_carves();
        }
        Phase::Disrupted { .. } => {
            r.advance(at_ns, Cause::RestartDowntime);
            r.pay_restore_debt();
        }
        Phase::Ended => {}
    }
    r.phase = Phase::Ended;
}

/// A job's breakdown, summed over its ranks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobReport {
    /// Job id.
    pub job: String,
    /// Accelerator-nanoseconds per cause.
    pub parts: Parts,
    /// First launch to the last accounted time of any rank.
    pub wall_ns: i64,
    /// Ranks seen.
    pub ranks: u32,
    /// Occurrences summed over ranks.
    pub occ: Occurrences,
    /// Job restarts (the most any rank went through).
    pub restarts: u64,
    /// Checkpoint saves (the most any rank made).
    pub saves: u64,
    /// Whether some rank is still open.
    pub open: bool,
}

impl JobReport {
    /// Productive share of the accelerator time accounted.
    pub fn goodput(&self) -> f64 {
        let total = self.parts.total();
        if total <= 0 {
            return 0.0;
        }
        self.parts.get(Cause::Productive) as f64 / total as f64
    }

    /// Adds another host's report of the same job (its ranks are others).
    pub fn merge(&mut self, o: &JobReport) {
        self.parts.merge(&o.parts);
        self.occ.merge(&o.occ);
        self.ranks += o.ranks;
        self.wall_ns = self.wall_ns.max(o.wall_ns);
        self.restarts = self.restarts.max(o.restarts);
        self.saves = self.saves.max(o.saves);
        self.open |= o.open;
    }
}

#[cfg(test)]
mod tests;
