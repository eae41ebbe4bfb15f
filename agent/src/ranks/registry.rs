//! The registry of jobs and ranks, and the slots they write into.
//!
//! A rank is identified by (job id, global rank). Registration validates the
//! request, refuses a rank that a live process already holds, and claims a
//! slot with a fresh generation. Each slot is its own sealed memfd
//! ([`SlotTable`]): nobody can truncate or replace it, so there is nothing to
//! check or rebuild; the rank receives it over the slot socket
//! (`api::slot_socket`), which asks this registry who holds which generation.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use warden_slot::{self as slot, SlotSnapshot, SlotTable};

pub use warden_core::rank::{ExitInfo, RankKey, RankState};

use warden_core::detect::calibration::{self, Calibration};
use warden_core::detect::hang::Threshold;

/// Why a registration was refused. Each message says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// A field is missing or out of range.
    #[error("invalid registration: {0}")]
    Invalid(String),
    /// The client writes another slot layout.
    #[error(
        "client writes slot layout v{client}, this agent reads v{agent}: upgrade the older side"
    )]
    LayoutMismatch {
        /// The client's version.
        client: u32,
        /// Ours.
        agent: u32,
    },
    /// Another live process holds the rank.
    #[error(
        "rank {rank} of job {job:?} is held by live pid {holder}; a second process cannot claim it (pid {claimant})"
    )]
    Held {
        /// Job id.
        job: String,
        /// Global rank.
        rank: u32,
        /// The holder.
        holder: u32,
        /// The refused claimant.
        claimant: u32,
    },
    /// Every slot is taken.
    #[error("all {0} rank slots are in use; raise ranks.max_ranks")]
    Full(u32),
    /// The calling process holds as many ranks as one process may.
    #[error(
        "pid {pid} already holds {held} registered ranks, the most one process may (ranks.max_per_process = {max})"
    )]
    PerProcess {
        /// The caller.
        pid: u32,
        /// Ranks it holds.
        held: u32,
        /// The bound.
        max: u32,
    },
    /// The calling uid holds its share of the slots.
    #[error(
        "uid {uid} already holds {held} rank slots, the most one uid may (ranks.max_ranks_per_uid = {max}); other users keep the rest"
    )]
    PerUid {
        /// The caller's uid.
        uid: u32,
        /// Slots it holds.
        held: u32,
        /// The bound.
        max: u32,
    },
    /// The slot's memory could not be made.
    #[error("slot memory: {0}")]
    Slot(#[from] slot::SlotError),
}

/// The registry as a handle: the API, the scan, the detectors and the exit
/// watches each hold a clone and lock it briefly (a scan, a registration).
#[derive(Debug, Clone)]
pub struct SharedRegistry(Arc<Mutex<Registry>>);

impl SharedRegistry {
    /// Shares `registry`.
    pub fn new(registry: Registry) -> Self {
        Self(Arc::new(Mutex::new(registry)))
    }

    /// Locks the registry (a poisoned lock is still usable: the registry
    /// holds no invariant a panic midway could break beyond one entry).
    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the progress check compares from one scan to the next. Any change
/// is progress: a heartbeat, a step, a section opened or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// Heartbeat counter.
    pub heartbeats: u64,
    /// Step number.
    pub step: u64,
    /// Steps completed.
    pub steps_completed: u64,
    /// Section depth.
    pub depth: u32,
    /// Innermost section id and entry time.
    pub innermost: Option<(u32, u64)>,
    /// Whether a step is open.
    pub step_open: bool,
}

impl Marker {
    /// The marker of a snapshot.
    pub fn of(s: &SlotSnapshot) -> Self {
        Self {
            heartbeats: s.heartbeats,
            step: s.step,
            steps_completed: s.steps_completed,
            depth: s.depth,
            innermost: s.innermost().map(|o| (o.id, o.entered_ns)),
            step_open: s.step_open,
        }
    }
}

/// One registered rank.
#[derive(Debug)]
pub struct RankEntry {
    /// Job and rank.
    pub key: RankKey,
    /// Local rank on this node.
    pub local_rank: u32,
    /// World size the rank declared.
    pub world_size: u32,
    /// Process id, as the agent sees it (from the socket's peer credentials);
    /// 0 when the process is outside the agent's PID namespace (a sidecar
    /// without a shared process namespace): then no exit watch, no process
    /// evidence and no signals, only the heartbeat slot.
    pub pid: u32,
    /// The pid the client declared: its own number in its own PID namespace,
    /// which is also its launcher's (events carry it so a launcher in another
    /// namespace recognises its workers).
    pub declared_pid: u32,
    /// Host the client declared.
    pub host: String,
    /// Slot index.
    pub slot: u32,
    /// Whether the entry still holds `slot`. False once the slot was freed
    /// (the rank exited) or lost (the file was rebuilt): the index may then
    /// belong to another rank and must never be released through this entry.
    pub holds_slot: bool,
    /// Generation handed out with the slot.
    pub generation: u64,
    /// Lifecycle state.
    pub state: RankState,
    /// Marker at the last scan.
    pub marker: Option<Marker>,
    /// When progress was last seen (CLOCK_MONOTONIC ns).
    pub progress_ns: u64,
    /// When the rank registered (CLOCK_MONOTONIC ns).
    pub registered_ns: u64,
    /// CPU ticks of the process and when they were read, taken once the
    /// rank has been stalled for half its threshold: at detection, the
    /// difference says whether it spins or is blocked, with no wait.
    pub cpu_mark: Option<(u64, u64)>,
    /// The last consistent snapshot.
    pub last: Option<SlotSnapshot>,
    /// Start time of the newest step record fed to calibration.
    pub ingested_start_ns: u64,
    /// When the agent last asked this rank to restart in process
    /// (CLOCK_MONOTONIC ns; 0 for never). The gap between two step records
    /// that spans it is the fault and the restart (a heal's is seconds),
    /// not the loop's own time between steps: it is no `idle` sample, or
    /// each restart would raise the job's between-steps hang threshold.
    pub restarted_ns: u64,
    /// When the rank last began to await a lost peer's heal by itself (the
    /// client's `heal_wait` section, seen live by a scan; 0 for never):
    /// like an ask, the gap between two steps that spans it is no `idle`
    /// sample. Kept apart from `restarted_ns`, which is the agent's ask
    /// and tells which of the rank's open sections are stale.
    pub heal_wait_ns: u64,
    /// Asked to restart in process at `restarted_ns` and no step begun
    /// since (the step the ask interrupted ends, as a completed one, in
    /// the teardown: it is no sign of a new attempt). Between the ask and
    /// the first step of its next attempt the rank tears down and
    /// re-initialises (its process group, its restore), far longer than
    /// the gap between two steps its `idle` threshold was calibrated on:
    /// judged as `idle`, a restart slower than that (1 s in a test on a
    /// loaded machine; 3 s x the p99 gap by default) was called a hang and
    /// the job restarted a second time. It is judged meanwhile in
    /// `restart` (`hang.heal_timeout`, bounded: a teardown stuck for good
    /// is still a hang), or in a section it opened since the ask, its
    /// stall counted from the ask.
    pub restarting: bool,
    /// The section the rank is in, as of the last scan.
    pub section: String,
    /// The threshold in force at the last scan.
    pub threshold: Option<Threshold>,
    /// How the process ended.
    pub exit: Option<ExitInfo>,
    /// Why the launcher is stopping the rank (StopRanks), once it is
    /// [`RankState::Stopping`]: carried into its `rank.exited` event.
    pub stop_reason: Option<warden_core::signal::StopReason>,
    /// Signal for a stack dump (0: none).
    pub stack_dump_signal: i32,
    /// The accelerators the rank declared (empty: not declared).
    pub devices: Vec<String>,
    /// Where the dump is written.
    pub stack_dump_path: PathBuf,
    /// The last slot read error, reported once until it clears.
    pub slot_error: Option<String>,
    /// The process, verified as the caller's and held by a pidfd; None
    /// when the caller's pid is not visible to the agent (then nothing is
    /// ever signalled, and the exit is seen by the scan only).
    pub process: Option<super::process::RankProcess>,
    /// The pid of the process that registered the rank (itself, or its
    /// launcher): what `ranks.max_per_process` counts by.
    pub registered_by: Option<u32>,
    /// The registering caller's uid and gid (SO_PEERCRED): the slot socket
    /// hands this rank's memory only to a process running as them.
    pub owner: Option<warden_core::fsafe::Owner>,
    /// The slot's change counters at the last snapshot: unchanged means no
    /// write since, and the scan skips the snapshot.
    pub counters: Option<(u64, u64)>,
    /// Section names by id, read once per id (names are write-once).
    pub names: Vec<String>,
    /// Durations of the rank's recent completed steps, for GetRanks.
    pub step_times: std::collections::VecDeque<u64>,
    /// The rank's recent steps with their section durations, fed by the
    /// scan for the straggler detector (bounded: 64 steps, 8 sections).
    pub straggler: warden_core::detect::straggler::RankSamples,
}

impl RankEntry {
    /// Completed steps kept for percentiles.
    pub const STEP_TIMES: usize = 64;

    /// When the agent asked this rank to restart in process, while it has
    /// not stepped since ([`RankEntry::restarting`]); None otherwise.
    pub fn restarting_since(&self) -> Option<u64> {
        self.restarting.then_some(self.restarted_ns)
    }

    /// The agent asked this rank to restart in process at `now_ns`: its
    /// stall is counted from the ask, and it is judged in `restart` until
    /// it steps again ([`RankEntry::restarting`]).
    pub fn restart_asked(&mut self, now_ns: u64) {
        self.restarted_ns = now_ns;
        self.restarting = true;
        self.progress_ns = self.progress_ns.max(now_ns);
        self.cpu_mark = None;
    }

    /// A worker its launcher registered whose script never attached a
    /// client (zero-code mode; a client's own registration replaces the
    /// entry): nothing writes its slot, so it has no step to report, and
    /// step 0 would make two failures at different steps read as a repeat
    /// at the same one.
    pub fn launcher_only(&self) -> bool {
        self.pid != 0 && self.registered_by.is_some_and(|by| by != self.pid)
    }
}

/// Per-job state.
#[derive(Debug)]
pub struct JobEntry {
    /// Section duration history.
    pub calibration: Calibration,
    /// Where it is persisted.
    pub calibration_path: PathBuf,
    /// When it was last saved.
    pub saved_at: Instant,
}

/// What a client needs after registering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// Its slot.
    pub slot_index: u32,
    /// Slot size in bytes.
    pub slot_size: u32,
    /// Generation to echo.
    pub generation: u64,
    /// Where to write a stack dump.
    pub stack_dump_path: PathBuf,
    /// Whether an earlier holder of the same rank was replaced.
    pub replaced_pid: Option<u32>,
}

/// A registration request, with the pid the kernel vouches for.
#[derive(Debug, Clone)]
pub struct RegisterRequest {
    /// Job id.
    pub job_id: String,
    /// Global rank.
    pub global_rank: u32,
    /// Local rank.
    pub local_rank: u32,
    /// World size.
    pub world_size: u32,
    /// Pid from SO_PEERCRED when available, else the declared one; 0 when
    /// the kernel says the caller is not visible in the agent's PID
    /// namespace.
    pub pid: u32,
    /// The pid the client declared (its own getpid()); never 0.
    pub declared_pid: u32,
    /// Host the client runs on.
    pub host: String,
    /// Slot layout the client writes.
    pub layout_version: u32,
    /// Stack dump signal (0: none).
    pub stack_dump_signal: i32,
    /// The accelerators the rank drives, as the client names them; empty:
    /// unknown (attribution then assumes `gpu<local_rank>`).
    pub devices: Vec<String>,
    /// The rank's process, verified and held (see [`RankEntry::process`]).
    pub process: Option<super::process::RankProcess>,
    /// The caller's pid (SO_PEERCRED), when visible.
    pub caller_pid: Option<u32>,
    /// The caller's uid and gid (SO_PEERCRED): who the stack-dump file is
    /// handed to. None: the agent keeps it.
    pub owner: Option<warden_core::fsafe::Owner>,
}

#[cfg(test)]
impl RegisterRequest {
    /// This process as rank `rank` of `world` in `job` on host "h", with
    /// no stack-dump signal, device or owner: what unit tests register.
    pub(crate) fn for_test(job: &str, rank: u32, world: u32) -> Self {
        Self {
            job_id: job.into(),
            global_rank: rank,
            local_rank: rank,
            world_size: world,
            pid: std::process::id(),
            declared_pid: std::process::id(),
            host: "h".into(),
            layout_version: warden_slot::LAYOUT_VERSION,
            stack_dump_signal: 0,
            devices: Vec::new(),
            process: None,
            caller_pid: None,
            owner: None,
        }
    }
}

/// Most devices one rank may declare (a rank drives one GPU, a few at most).
pub const MAX_DEVICES: usize = 16;

/// Jobs, ranks and their slots.
#[derive(Debug)]
pub struct Registry {
    slots: SlotTable,
    free: BTreeSet<u32>,
    next_generation: u64,
    /// Ranks by (job, rank).
    pub ranks: BTreeMap<RankKey, RankEntry>,
    /// Jobs by id.
    pub jobs: BTreeMap<String, JobEntry>,
    /// `<slot_dir>/stacks`: each rank's stack-dump file, made by the agent.
    stacks: warden_core::fsafe::Dir,
    state_dir: PathBuf,
    /// `ranks.max_per_process`: live ranks one caller may hold.
    pub max_per_process: u32,
    /// `ranks.max_ranks_per_uid` (in force): slots one uid may hold, so
    /// one user cannot take them all (issue 29: 34 processes of 8 ranks).
    pub max_per_uid: u32,
}

impl Registry {
    /// A registry of `max_ranks` slots (their memory is made as ranks
    /// claim them) and the stack-dump directory `<slot_dir>/stacks`.
    pub fn new(slot_dir: &Path, state_dir: &Path, max_ranks: u32) -> Result<Self, slot::SlotError> {
        let io = |op| {
            move |source| slot::SlotError::Io {
                path: slot_dir.to_owned(),
                op,
                source,
            }
        };
        std::fs::create_dir_all(slot_dir).map_err(io("create directory"))?;
        // The agent's own directory (0711): ranks reach the dump file the
        // agent made for them by name, and can neither list, create,
        // rename nor plant anything in it.
        let stack_dir = slot_dir.join("stacks");
        let stacks = warden_core::fsafe::Dir::ensure(&stack_dir, 0o711).map_err(|e| {
            slot::SlotError::Io {
                path: stack_dir.clone(),
                op: "create stacks directory",
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        // Slot files of earlier agents (before slots were sealed memfds)
        // go: nothing maps them any more once their ranks re-register.
        remove_old_slot_files(slot_dir);
        let slots = SlotTable::new(max_ranks)?;
        Ok(Self {
            slots,
            free: (0..max_ranks).collect(),
            // Generations differ across agent restarts: start from the clock.
            next_generation: warden_slot::clock::syscall_now().max(1),
            ranks: BTreeMap::new(),
            jobs: BTreeMap::new(),
            stacks,
            state_dir: state_dir.to_owned(),
            max_per_process: u32::MAX,
            max_per_uid: u32::MAX,
        })
    }

    /// Split borrows for the scan: slots read, ranks and jobs updated.
    pub fn parts(
        &mut self,
    ) -> (
        &SlotTable,
        &mut BTreeMap<RankKey, RankEntry>,
        &mut BTreeMap<String, JobEntry>,
    ) {
        (&self.slots, &mut self.ranks, &mut self.jobs)
    }

    /// The slots (for reading snapshots).
    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }

    /// Registers a rank.
    pub fn register(
        &mut self,
        req: &RegisterRequest,
        now_ns: u64,
    ) -> Result<Registration, RegisterError> {
        validate(req)?;
        let key = RankKey {
            job: req.job_id.clone(),
            rank: req.global_rank,
        };
        let mut replaced_pid = None;
        if let Some(old) = self.ranks.get(&key) {
            let old_live = matches!(old.state, RankState::Running | RankState::Hung)
                && super::procfs::read(old.pid).is_some_and(|f| f.state != 'Z' && f.state != 'X');
            if old_live && old.pid != req.pid {
                return Err(RegisterError::Held {
                    job: key.job.clone(),
                    rank: key.rank,
                    holder: old.pid,
                    claimant: req.pid,
                });
            }
            if old.pid != req.pid {
                replaced_pid = Some(old.pid);
            }
            if let Some(old) = self.ranks.remove(&key) {
                self.release_slot_of(&old);
                let _ = std::fs::remove_file(&old.stack_dump_path);
            }
        }
        if let Some(caller) = req.caller_pid {
            let held = self
                .ranks
                .values()
                .filter(|e| {
                    e.registered_by == Some(caller)
                        && matches!(e.state, RankState::Running | RankState::Hung)
                })
                .count();
            let held = u32::try_from(held).unwrap_or(u32::MAX);
            if held >= self.max_per_process {
                return Err(RegisterError::PerProcess {
                    pid: caller,
                    held,
                    max: self.max_per_process,
                });
            }
        }
        if let Some(owner) = req.owner {
            let held = self
                .ranks
                .values()
                .filter(|e| e.holds_slot && e.owner.is_some_and(|o| o.uid == owner.uid))
                .count();
            let held = u32::try_from(held).unwrap_or(u32::MAX);
            if held >= self.max_per_uid {
                return Err(RegisterError::PerUid {
                    uid: owner.uid,
                    held,
                    max: self.max_per_uid,
                });
            }
        }
        let index = self
            .free
            .pop_first()
            .ok_or(RegisterError::Full(self.slots.slot_count()))?;
        let generation = self.next_generation;
        self.next_generation += 1;
        if let Err(e) = self.slots.claim(index, generation, req.pid) {
            self.free.insert(index);
            return Err(e.into());
        }
        let stack_dump_path = match self.stack_file(&key, req.owner) {
            Ok(p) => p,
            Err(e) => {
                let _ = self.slots.release(index);
                self.free.insert(index);
                return Err(e);
            }
        };
        if !self.jobs.contains_key(&key.job) {
            let path = calibration::path_for(&self.state_dir, &key.job);
            let cal = Calibration::load(&path).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "starting calibration afresh");
                Calibration::default()
            });
            self.jobs.insert(
                key.job.clone(),
                JobEntry {
                    calibration: cal,
                    calibration_path: path,
                    saved_at: Instant::now(),
                },
            );
        }
        self.ranks.insert(
            key.clone(),
            RankEntry {
                key,
                local_rank: req.local_rank,
                world_size: req.world_size,
                pid: req.pid,
                declared_pid: req.declared_pid,
                host: req.host.clone(),
                slot: index,
                holds_slot: true,
                generation,
                state: RankState::Running,
                marker: None,
                progress_ns: now_ns,
                registered_ns: now_ns,
                cpu_mark: None,
                last: None,
                ingested_start_ns: 0,
                restarted_ns: 0,
                heal_wait_ns: 0,
                restarting: false,
                section: calibration::INIT.into(),
                threshold: None,
                exit: None,
                stop_reason: None,
                stack_dump_signal: req.stack_dump_signal,
                devices: req.devices.clone(),
                stack_dump_path: stack_dump_path.clone(),
                slot_error: None,
                process: req.process.clone(),
                registered_by: req.caller_pid,
                owner: req.owner,
                counters: None,
                names: Vec::new(),
                step_times: std::collections::VecDeque::new(),
                straggler: warden_core::detect::straggler::RankSamples::default(),
            },
        );
        Ok(Registration {
            slot_index: index,
            slot_size: slot::SLOT_SIZE as u32,
            generation,
            stack_dump_path,
            replaced_pid,
        })
    }

    /// The stack-dump directory `<slot_dir>/stacks` (the agent's, 0711),
    /// where `hang::flight` makes each flight-recorder dump file.
    pub fn stacks(&self) -> &warden_core::fsafe::Dir {
        &self.stacks
    }

    /// Makes the rank's stack-dump file: a random name nobody can plant a
    /// link at beforehand, created exclusively (0600) in the agent's own
    /// directory and handed to the rank's uid, which appends to it.
    fn stack_file(
        &self,
        key: &RankKey,
        owner: Option<warden_core::fsafe::Owner>,
    ) -> Result<PathBuf, RegisterError> {
        let prefix = format!("{}-{}.", sanitize(&key.job), key.rank);
        let (file, name) = self.stacks.create_random(&prefix, 0o600).map_err(|e| {
            RegisterError::Slot(slot::SlotError::Io {
                path: self.stacks.path().to_owned(),
                op: "create the stack dump file",
                source: std::io::Error::other(e.to_string()),
            })
        })?;
        let path = self.stacks.path().join(name);
        // Root writes it anyway; the agent's own user owns it already. An
        // agent without CAP_CHOWN (a sidecar run as a user) cannot hand it
        // over: the rank then cannot write dumps, which its hang evidence
        // will say; the registration stands.
        if let Some(o) = owner.filter(|o| o.uid != warden_core::fsafe::me() && o.uid != 0)
            && let Err(e) = warden_core::fsafe::give(&file, &path, o)
        {
            tracing::warn!(rank = %key, error = %e, "the stack dump file stays the agent's: the rank cannot write dumps into it");
        }
        Ok(path)
    }

    /// Ranks running or hung, and how many of them registered from outside
    /// the agent's PID namespace (pid 0): what the agent cannot watch as
    /// processes (component `ranks/pid_visibility`).
    pub fn pid_visibility(&self) -> (usize, usize) {
        let live = self
            .ranks
            .values()
            .filter(|e| matches!(e.state, RankState::Running | RankState::Hung));
        live.fold((0, 0), |(hidden, all), e| {
            (hidden + usize::from(e.pid == 0), all + 1)
        })
    }

    /// Removes a rank that leaves cleanly; false if the generation is stale.
    pub fn deregister(&mut self, key: &RankKey, generation: u64) -> bool {
        match self.ranks.get(key) {
            Some(e) if e.generation == generation => {}
            _ => return false,
        }
        if let Some(e) = self.ranks.remove(key) {
            self.release_slot_of(&e);
            let _ = std::fs::remove_file(&e.stack_dump_path);
        }
        true
    }

    /// Marks the live ranks of `job` (only `ranks`, when not empty) as being
    /// stopped by their launcher for `reason`; returns the ranks marked.
    /// Ranks already exited are left as they are: their exit was reported.
    pub fn mark_stopping(
        &mut self,
        job: &str,
        ranks: &[u32],
        reason: &warden_core::signal::StopReason,
    ) -> Vec<u32> {
        let mut marked = Vec::new();
        for e in self.ranks.values_mut() {
            if e.key.job != job || (!ranks.is_empty() && !ranks.contains(&e.key.rank)) {
                continue;
            }
            if matches!(
                e.state,
                RankState::Running | RankState::Hung | RankState::Lost | RankState::Stopping
            ) {
                e.state = RankState::Stopping;
                e.stop_reason = Some(reason.clone());
                marked.push(e.key.rank);
            }
        }
        marked
    }

    /// Frees the slots of exited ranks (their entries stay for GetRanks).
    pub fn free_slot_of(&mut self, key: &RankKey) {
        if let Some(e) = self.ranks.get_mut(key)
            && e.holds_slot
        {
            e.holds_slot = false;
            let slot = e.slot;
            if self.slots.release(slot).is_ok() {
                self.free.insert(slot);
            }
        }
    }

    /// Returns an entry's slot to the free list, if the entry still holds it.
    fn release_slot_of(&mut self, e: &RankEntry) {
        if e.holds_slot && self.slots.release(e.slot).is_ok() {
            self.free.insert(e.slot);
        }
    }

    /// Saves calibrations that changed, at most every `every`.
    pub fn save_calibrations(&mut self, every: std::time::Duration, force: bool) {
        for (job, j) in &mut self.jobs {
            if j.calibration.is_dirty() && (force || j.saved_at.elapsed() >= every) {
                if let Err(e) = j.calibration.save(&j.calibration_path) {
                    tracing::warn!(job = %job, error = %e, "cannot save hang calibration");
                }
                j.saved_at = Instant::now();
            }
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Removes the slot files agents before the sealed memfds left in `dir`
/// (`slots`, `slots.*`): unlinked, never followed. Their ranks register
/// again with this agent and receive memory instead.
fn remove_old_slot_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name == "slots" || name.starts_with("slots.") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn validate(r: &RegisterRequest) -> Result<(), RegisterError> {
    let bad = |m: String| Err(RegisterError::Invalid(m));
    if r.job_id.is_empty() || r.job_id.len() > 128 {
        return bad(format!(
            "job_id must be 1 to 128 characters (got {} characters)",
            r.job_id.len()
        ));
    }
    if r.job_id.chars().any(char::is_control) {
        return bad(format!("job_id {:?} contains control characters", r.job_id));
    }
    if r.world_size == 0 {
        return bad("world_size must be at least 1".into());
    }
    if r.global_rank >= r.world_size {
        return bad(format!(
            "global_rank {} is not below world_size {}",
            r.global_rank, r.world_size
        ));
    }
    if r.local_rank >= r.world_size {
        return bad(format!(
            "local_rank {} is not below world_size {}",
            r.local_rank, r.world_size
        ));
    }
    if r.declared_pid == 0 {
        return bad("pid must be set".into());
    }
    if r.host.len() > 255 {
        return bad("host is longer than 255 bytes".into());
    }
    if !(0..=64).contains(&r.stack_dump_signal)
        || r.stack_dump_signal == libc::SIGKILL
        || r.stack_dump_signal == libc::SIGSTOP
    {
        return bad(format!(
            "stack_dump_signal {} is not a signal a rank can dump its stacks on",
            r.stack_dump_signal
        ));
    }
    if r.devices.len() > MAX_DEVICES {
        return bad(format!(
            "{} devices named; at most {MAX_DEVICES}",
            r.devices.len()
        ));
    }
    if let Some(d) = r
        .devices
        .iter()
        .find(|d| warden_core::text::unfit_name(d, 128))
    {
        return bad(format!(
            "device name {d:?} is empty, longer than 128 bytes or holds control characters"
        ));
    }
    if r.layout_version != slot::LAYOUT_VERSION {
        return Err(RegisterError::LayoutMismatch {
            client: r.layout_version,
            agent: slot::LAYOUT_VERSION,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(job: &str, rank: u32, pid: u32) -> RegisterRequest {
        RegisterRequest {
            pid,
            declared_pid: pid,
            ..RegisterRequest::for_test(job, rank, 4)
        }
    }

    fn registry(dir: &Path) -> Registry {
        Registry::new(&dir.join("run"), &dir.join("state"), 4).unwrap()
    }

    /// The rank's client names its GPU without linking core (its crate
    /// stays free of the agent's): the name it sends is core's spelling of
    /// that GPU, which attribution matches with `DeviceId`.
    #[test]
    fn a_ranks_client_names_its_gpu_as_the_agent_does() {
        use warden_core::device::DeviceId;
        for (cuda, local, gpu) in [("3", 0, 3), ("0,1,2,3", 2, 2), ("07", 0, 7), ("0", 0, 0)] {
            let named = warden_client::devices_from_env(None, Some(cuda), local);
            assert_eq!(
                named,
                [DeviceId::Gpu(gpu).to_string()],
                "CUDA_VISIBLE_DEVICES={cuda}"
            );
            assert_eq!(DeviceId::of_component(&named[0]), DeviceId::Gpu(gpu));
        }
    }

    #[test]
    fn registers_and_refuses_a_live_holder() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let me = std::process::id();
        let a = r.register(&req("j", 0, me), 0).unwrap();
        assert_eq!(a.slot_index, 0);
        // Our parent is alive and is not us: the rank is held.
        let parent = std::os::unix::process::parent_id();
        let err = r.register(&req("j", 0, parent), 0).unwrap_err().to_string();
        assert!(err.contains(&format!("live pid {me}")), "{err}");
        // The same process may register again (it lost its connection).
        let b = r.register(&req("j", 0, me), 0).unwrap();
        assert_ne!(a.generation, b.generation);
    }

    #[test]
    fn dead_holder_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        r.register(&req("j", 1, dead), 0).unwrap();
        let again = r.register(&req("j", 1, std::process::id()), 0).unwrap();
        assert_eq!(again.replaced_pid, Some(dead));
    }

    #[test]
    fn invalid_requests_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let mut q = req("", 0, 1);
        assert!(
            r.register(&q, 0)
                .unwrap_err()
                .to_string()
                .contains("job_id")
        );
        q = req("j", 9, 1);
        assert!(
            r.register(&q, 0)
                .unwrap_err()
                .to_string()
                .contains("world_size 4")
        );
        q = req("j", 0, 1);
        q.layout_version = 99;
        assert!(
            r.register(&q, 0)
                .unwrap_err()
                .to_string()
                .contains("layout")
        );
    }

    #[test]
    fn full_registry_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let me = std::process::id();
        for rank in 0..4 {
            r.register(&req("j", rank, me), 0).unwrap();
        }
        let mut q = req("k", 0, me);
        q.world_size = 1;
        assert!(matches!(r.register(&q, 0), Err(RegisterError::Full(4))));
    }

    #[test]
    fn a_freed_slot_is_never_released_again_through_its_old_entry() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let me = std::process::id();
        let a = r.register(&req("j", 0, me), 0).unwrap();
        // Rank 0 exits: its slot is freed and handed to rank 1.
        let key0 = RankKey {
            job: "j".into(),
            rank: 0,
        };
        r.ranks.get_mut(&key0).unwrap().state = RankState::Exited;
        r.free_slot_of(&key0);
        let b = r.register(&req("j", 1, me), 0).unwrap();
        assert_eq!(a.slot_index, b.slot_index);
        // Rank 0 comes back: it must not take (or free) rank 1's slot.
        let c = r.register(&req("j", 0, me), 0).unwrap();
        assert_ne!(c.slot_index, b.slot_index);
        let snap = r.slots().snapshot(b.slot_index).unwrap();
        assert!(snap.claimed);
        assert_eq!(snap.generation, b.generation);
    }

    #[test]
    fn each_slot_is_its_own_sealed_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = registry(dir.path());
        let me = std::process::id();
        let a = r.register(&req("j", 0, me), 0).unwrap();
        let b = r.register(&req("j", 1, me), 0).unwrap();
        let ma = r.slots().memory(a.slot_index).unwrap();
        let mb = r.slots().memory(b.slot_index).unwrap();
        // Two memories: holding one gives no way into the other.
        let ino = |fd| nix::sys::stat::fstat(fd).unwrap().st_ino;
        assert_ne!(ino(ma.fd()), ino(mb.fd()));
        // Sealed: nobody, the agent included, can change its size.
        let f = std::fs::File::from(ma.fd().try_clone_to_owned().unwrap());
        let err = f.set_len(10).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        let err = f.set_len(1 << 20).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
        assert!(r.slots().snapshot(a.slot_index).unwrap().claimed);
        // No slot file was made in the slot dir.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("run"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["stacks".to_owned()]);
    }

    #[test]
    fn slot_files_of_earlier_agents_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("slots.abc"), b"old").unwrap();
        std::fs::write(run.join("slots"), b"older").unwrap();
        let _r = registry(dir.path());
        assert!(!run.join("slots.abc").exists());
        assert!(!run.join("slots").exists());
    }

    #[test]
    fn a_rank_outside_the_agents_pid_namespace_registers_unseen() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        // SO_PEERCRED gives 0 for a process the agent's namespace cannot see.
        let mut q = req("j", 0, 0);
        q.declared_pid = 7;
        r.register(&q, 0).unwrap();
        r.register(&req("j", 1, std::process::id()), 0).unwrap();
        assert_eq!(r.pid_visibility(), (1, 2));
        let e = &r.ranks[&RankKey {
            job: "j".into(),
            rank: 0,
        }];
        assert_eq!((e.pid, e.declared_pid), (0, 7));
        // The client must still say who it is.
        q.declared_pid = 0;
        q.global_rank = 2;
        let err = r.register(&q, 0).unwrap_err().to_string();
        assert!(err.contains("pid must be set"), "{err}");
    }
}

#[cfg(test)]
mod claim_visible {
    use super::*;

    #[test]
    fn a_claim_is_visible_through_the_memory_a_rank_receives() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        let q = RegisterRequest {
            job_id: "j".into(),
            global_rank: 0,
            local_rank: 0,
            world_size: 1,
            pid: std::process::id(),
            declared_pid: std::process::id(),
            host: "h".into(),
            layout_version: slot::LAYOUT_VERSION,
            stack_dump_signal: 0,
            devices: Vec::new(),
            process: None,
            caller_pid: None,
            owner: None,
        };
        let reg = r.register(&q, 0).unwrap();
        assert_eq!(r.pid_visibility(), (0, 1));
        let fd = r
            .slots()
            .memory(reg.slot_index)
            .unwrap()
            .fd()
            .try_clone_to_owned()
            .unwrap();
        let other = slot::SlotMemory::open(fd).unwrap();
        let snap = other.slot().snapshot(reg.slot_index).unwrap();
        assert!(snap.claimed);
        assert_eq!(snap.generation, reg.generation);
    }
}

#[cfg(test)]
mod per_uid {
    use super::*;

    #[test]
    fn one_uid_holds_at_most_its_share_and_others_keep_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        r.max_per_uid = 2;
        let me = warden_core::fsafe::me();
        // Another uid whose stack file the agent may make: root's needs no
        // chown; as root, chown to nobody works.
        let other = if me == 0 { 65_534 } else { 0 };
        let q = |rank: u32, uid: u32| RegisterRequest {
            job_id: format!("j{uid}"),
            global_rank: rank,
            local_rank: 0,
            world_size: 4,
            pid: std::process::id(),
            declared_pid: std::process::id(),
            host: "h".into(),
            layout_version: slot::LAYOUT_VERSION,
            stack_dump_signal: 0,
            devices: Vec::new(),
            process: None,
            caller_pid: None,
            owner: Some(warden_core::fsafe::Owner { uid, gid: 0 }),
        };
        r.register(&q(0, me), 0).unwrap();
        r.register(&q(1, me), 0).unwrap();
        let e = r.register(&q(2, me), 0).unwrap_err();
        assert!(
            matches!(
                e,
                RegisterError::PerUid {
                    held: 2,
                    max: 2,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("ranks.max_ranks_per_uid = 2"), "{e}");
        // The other uid still gets the slots left.
        r.register(&q(0, other), 0).unwrap();
        r.register(&q(1, other), 0).unwrap();
        // A slot given back (the rank exited) is a place again.
        r.free_slot_of(&RankKey {
            job: format!("j{me}"),
            rank: 0,
        });
        r.register(&q(2, me), 0).unwrap();
    }
}

/// The open sections of `snap` that count for its rank, outermost first:
/// all of them, or, while it restarts in process since `restarting_since`
/// ([`RankEntry::restarting_since`]), those entered after the ask (one left
/// open from before it is stale).
pub fn live_sections(
    snap: &warden_slot::SlotSnapshot,
    restarting_since: Option<u64>,
) -> impl Iterator<Item = &warden_slot::OpenSection> {
    snap.open_sections
        .iter()
        .filter(move |o| restarting_since.is_none_or(|t| o.entered_ns > t))
}

/// The section a rank is judged in: `innermost`, the name of its innermost
/// [`live_sections`] entry; else `restart` while it restarts in process,
/// `init` before its first step, `idle` between steps.
pub fn section_of(
    snap: &warden_slot::SlotSnapshot,
    restarting_since: Option<u64>,
    innermost: Option<&str>,
) -> String {
    if innermost.is_none() && restarting_since.is_some() {
        return warden_core::detect::calibration::RESTART.into();
    }
    let started = snap.steps_completed > 0 || snap.step_open;
    warden_core::detect::hang::current_section(innermost, started).to_owned()
}
