//! Typed signals: what the agent's parts tell each other through the bus.
//!
//! In: a producer's typed facts (a rank exited with this status and stop
//! reason, a hang at this step and section, an XID from this source...).
//! Out: the [`Signal`] the [`crate::events::EventBus`] publishes, and its
//! rendering as the wire and log event (kind, subject, message, evidence)
//! in exactly one place, [`Signal::render`] (render.rs), so that the
//! consumers (attribution, goodput) match on variants and read typed fields
//! while every event kind and field string the API, the CLI and the docs
//! show stays as it was. Never: parse an event back into a signal on a
//! runtime path (replay.rs does it for recorded scenarios, in tests only),
//! I/O, or knowledge of tonic.
//!
//! A variant exists for every event some part of the agent reads. Events
//! only a person or a watcher reads (`agent.started`, `tls.reloaded`,
//! `ckpt.pruned`...) travel as [`Signal::Notice`], a [`NewEvent`] as its
//! producer wrote it; a notice whose kind is one of the typed ones is a
//! bug, caught by a debug assertion in `From<NewEvent>`.

pub mod notice;
mod render;
/// Rank lists joined as events and logs show them ("0,1,2").
pub use render::join as join_ranks;
#[cfg(test)]
pub mod replay;
#[cfg(test)]
mod tests;

use crate::device::DeviceId;
use std::sync::Arc;

use crate::health::{Reason, Status};
use crate::rank::{ExitInfo, RankKey, RankState};
use crate::verdict::{FaultClass, IncidentRecord};
pub use notice::{NewEvent, Severity};

/// Why a launcher stopped a job's ranks (StopRanks' `kind`): what the
/// goodput ledger books the stopped ranks' exits as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// For a restart: new workers follow.
    Restart,
    /// The job ends: no worker follows.
    JobEnding,
    /// The launcher got a signal and stops the job.
    LauncherSignalled,
    /// A notice of a coming stop (a preemption, host maintenance, the
    /// scheduler's SIGTERM with `--term-grace`): the ranks save and leave,
    /// and the job is requeued. A planned stop, never an incident.
    Preempted,
}

/// Why a rank was stopped by its launcher: the typed kind and the
/// launcher's words for a person.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopReason {
    /// What the stop means for the job.
    pub kind: StopKind,
    /// The launcher's sentence ("restart 2: ...", "job ending: ...").
    pub why: String,
}

/// What the parts of the agent tell each other; the bus publishes it and
/// renders it once as the wire and log event.
#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    /// A rank registered (`rank.registered`).
    RankRegistered(RankRegistered),
    /// A rank reported a Python exception (`rank.exception`).
    RankException(RankException),
    /// A rank's process exited without deregistering (`rank.exited`).
    RankExited(RankExited),
    /// A rank left cleanly (`rank.deregistered`).
    RankDeregistered {
        /// Which rank.
        key: RankKey,
    },
    /// A rank made no progress past its threshold (`rank.hang`).
    RankHang(RankHang),
    /// A hung rank made progress again (`rank.recovered`).
    RankRecovered {
        /// Which rank.
        key: RankKey,
        /// The step it is at.
        step: u64,
        /// Its process.
        pid: u32,
    },
    /// A rank was flagged as a straggler (`rank.straggler`).
    RankStraggler(Straggler),
    /// A rank's straggler flag was lifted (`rank.straggler_cleared`).
    RankStragglerCleared {
        /// Which rank.
        key: RankKey,
        /// The headline and evidence, as the detector words them.
        report: Report,
    },
    /// A rank's reported loss or gradient norm departed from its peers'
    /// or went NaN/Inf: a silent-data-corruption suspect
    /// (`rank.sdc_suspect`).
    RankSdcSuspect(SdcSuspect),
    /// The job-wide verdict on a hang: the ranks that held the job up and
    /// those that waited on them (`job.hang_verdict`).
    HangVerdict(HangVerdict),
    /// Ranks of a job were asked to restart in process
    /// (`restart.requested`).
    RestartRequested(RestartRequested),
    /// A checkpoint shard was committed (`ckpt.saved`).
    CkptSaved(CkptSaved),
    /// A checkpoint shard was restored (`ckpt.restored`).
    CkptRestored(CkptRestored),
    /// A GPU reported an XID, through NVML (`gpu.xid`) or the kernel log
    /// (`kmsg.xid`).
    Xid(Xid),
    /// The kernel's OOM killer killed a process (`kmsg.oom_kill`).
    OomKill(OomKill),
    /// The processes NVML lists with a compute context on a GPU
    /// (`gpu.processes`): the agent's own map of ranks to devices.
    GpuProcesses(GpuProcesses),
    /// The pre-restart health gate failed (`gate.failed`).
    GateFailed(GateFailed),
    /// A health component's status moved (`health.changed`).
    HealthChanged(HealthChanged),
    /// Attribution diagnosed an incident (`incident.diagnosed`): its
    /// class, confidence, rule and evidence.
    IncidentDiagnosed(Arc<IncidentRecord>),
    /// Attribution decided what to do about an incident
    /// (`incident.decided`): the record with its decision in force.
    IncidentDecided(Arc<IncidentRecord>),
    /// Anything no part of the agent reads: told to people and watchers
    /// as its producer wrote it.
    Notice(NewEvent),
}

/// A headline and evidence as a producer words them, for signals whose
/// evidence is a detector's own account (a hang's, a straggler's): the
/// typed facts beside it are what the consumers read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// A sentence for a person.
    pub message: String,
    /// Ordered key/value evidence.
    pub evidence: Vec<(String, String)>,
}

impl Report {
    /// A headline; add evidence with [`Report::with`].
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            evidence: Vec::new(),
        }
    }

    /// Adds one piece of evidence.
    pub fn with(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.evidence.push((key.into(), value.to_string()));
        self
    }
}

/// `rank.registered`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankRegistered {
    /// Which rank.
    pub key: RankKey,
    /// Its process as the agent sees it (0: in a PID namespace it cannot see).
    pub pid: u32,
    /// The pid the client declared.
    pub declared_pid: u32,
    /// Local rank.
    pub local_rank: u32,
    /// World size.
    pub world_size: u32,
    /// The host the client named.
    pub host: String,
    /// Its heartbeat slot.
    pub slot: u32,
    /// The devices it drives, as the client named them (empty: none named,
    /// `gpu<local_rank>` is assumed).
    pub declared_devices: Vec<String>,
    /// The pid of the process it replaced in its slot, if any.
    pub replaced_pid: Option<u32>,
    /// True when the rank's own client registered it; false when its
    /// launcher did (zero-code mode: a script that never imports warden).
    pub by_self: bool,
}

impl RankRegistered {
    /// The devices the rank drives: the declared ones, else `gpu<local_rank>`.
    pub fn devices(&self) -> Vec<String> {
        if self.declared_devices.is_empty() {
            vec![DeviceId::Gpu(self.local_rank).to_string()]
        } else {
            self.declared_devices.clone()
        }
    }
}

/// `rank.exception`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankException {
    /// Which rank.
    pub key: RankKey,
    /// The Python exception type.
    pub exception_type: String,
    /// Its message (clipped).
    pub message: String,
    /// The step it was at; None for a worker no client attached to (the
    /// launcher reported what it printed: see [`RankExited::step`]).
    pub step: Option<u64>,
    /// Its process.
    pub pid: u32,
    /// Its registration's generation.
    pub generation: u64,
    /// True when the exception kills the rank.
    pub uncaught: bool,
    /// The traceback (clipped to its innermost frames).
    pub traceback: String,
    /// True when the rank holds on for the agent's decision (`warden.run`
    /// caught it): the answer may be a restart in process.
    pub awaits_decision: bool,
}

/// `rank.exited`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankExited {
    /// Which rank.
    pub key: RankKey,
    /// Its process as the agent saw it.
    pub pid: u32,
    /// The pid the client declared.
    pub declared_pid: u32,
    /// The step it was at; None when no step was ever reported (a worker
    /// its launcher registered whose script never attached a client: its
    /// slot says nothing, and step 0 would make two crashes at different
    /// steps read as a repeat at the same one).
    pub step: Option<u64>,
    /// The section it was in.
    pub section: String,
    /// Its state before the exit.
    pub state_before: RankState,
    /// Its exit status and where that came from.
    pub exit: ExitInfo,
    /// Why its launcher stopped it, when it did (state before: stopping).
    pub stopped_by: Option<StopReason>,
}

impl RankExited {
    /// How bad: Info for a stop by the launcher or exit code 0 (which
    /// attribution does not take as a failure), Error otherwise.
    pub fn severity(&self) -> Severity {
        if self.state_before == RankState::Stopping || self.exit.code == Some(0) {
            Severity::Info
        } else {
            Severity::Error
        }
    }
}

/// What attribution reads of a hang: where the rank was and what its
/// process was doing (also in the evidence, for a person).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HangFacts {
    /// The step it was at.
    pub step: u64,
    /// The section it was in.
    pub section: String,
    /// How its job's other ranks stand (`alone`, `all`...).
    pub pattern: String,
    /// Its process state ("S (sleeping)"); empty when not read.
    pub process_state: String,
    /// Where its process waits in the kernel; empty when not read.
    pub wchan: String,
}

/// `rank.hang`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankHang {
    /// Which rank.
    pub key: RankKey,
    /// What attribution reads.
    pub facts: HangFacts,
    /// The detector's headline and evidence.
    pub report: Report,
    /// True when a stack dump was requested (a `rank.stack` follows).
    pub stack_requested: bool,
}

/// `rank.straggler`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Straggler {
    /// Which rank.
    pub key: RankKey,
    /// The section it is slow in.
    pub section: String,
    /// Its time against the job's median, formatted ("1.52").
    pub relative: String,
    /// Why it is slow, for a person.
    pub explanation: String,
    /// The fault class the explanation points at.
    pub cause: FaultClass,
    /// The detector's headline and evidence.
    pub report: Report,
}

/// `rank.sdc_suspect`: the SDC detector's finding
/// ([`crate::detect::sdc::SdcFinding`]) about one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct SdcSuspect {
    /// Which rank.
    pub key: RankKey,
    /// The step whose value departed.
    pub step: u64,
    /// `loss` or `grad_norm`.
    pub metric: String,
    /// The value (may be NaN or infinite).
    pub value: f64,
    /// The median of the job's finite values at that step.
    pub job_median: Option<f64>,
    /// Robust standard deviations from the median compared with.
    pub score: Option<f64>,
    /// `non_finite`, `peers` or `own_history`.
    pub basis: String,
    /// The headline and evidence.
    pub report: Report,
}

/// `job.hang_verdict`: what [`crate::detect::culprit::judge`] made of every
/// rank's position, on the host that published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HangVerdict {
    /// The job.
    pub job: String,
    /// The host that judged (this agent's).
    pub host: String,
    /// The ranks that held the job up, with why.
    pub culprits: Vec<crate::verdict::Blame>,
    /// The ranks that waited on them.
    pub waiting: Vec<u32>,
    /// Ranks no agent reported.
    pub missing: Vec<u32>,
    /// The hosts whose positions were read.
    pub hosts: Vec<String>,
    /// One sentence for a person.
    pub summary: String,
    /// The `rank.hang` event that started the judging.
    pub hang_event: u64,
}

impl HangVerdict {
    /// True when a culprit runs on the judging host: this host is charged.
    pub fn charges_this_host(&self) -> bool {
        self.culprits.iter().any(|b| b.host == self.host)
    }

    /// The culprits elsewhere, named, when none runs here: what this
    /// host's incident records it waited on (empty: charged, or no
    /// culprit).
    pub fn waited_on(&self) -> Vec<String> {
        if self.charges_this_host() {
            return Vec::new();
        }
        self.culprits
            .iter()
            .map(crate::verdict::Blame::name)
            .collect()
    }
}

/// `restart.requested`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartRequested {
    /// The job.
    pub job: String,
    /// The request's sequence number.
    pub seq: u64,
    /// The job's in-process restart count.
    pub restart_count: u32,
    /// The ranks asked.
    pub ranks: Vec<u32>,
    /// The incident it answers.
    pub incident: String,
    /// Why.
    pub reason: String,
    /// How long the ranks have to acknowledge it.
    pub timeout: std::time::Duration,
}

/// `ckpt.saved`.
#[derive(Debug, Clone, PartialEq)]
pub struct CkptSaved {
    /// The shard's subject (`ckpt/<job>/<rank>/<step>`).
    pub subject: String,
    /// The shard, for the headline.
    pub shard: String,
    /// The job.
    pub job: String,
    /// The rank.
    pub rank: u32,
    /// The step.
    pub step: u64,
    /// How long the commit stalled the step, in milliseconds.
    pub stall_ms: f64,
    /// Its size.
    pub bytes: u64,
    /// Its checksum.
    pub xxh3: String,
}

/// `ckpt.restored`.
#[derive(Debug, Clone, PartialEq)]
pub struct CkptRestored {
    /// The shard's subject.
    pub subject: String,
    /// The shard, for the headline.
    pub shard: String,
    /// The job.
    pub job: String,
    /// The rank.
    pub rank: u32,
    /// The step.
    pub step: u64,
    /// How long the restore took, in milliseconds.
    pub duration_ms: f64,
    /// The tier it came from.
    pub tier: String,
    /// Which copy (a path, a peer).
    pub source: String,
    /// Its size.
    pub bytes: u64,
}

/// Where an XID was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidSource {
    /// NVML's event set (`gpu.xid`).
    Nvml,
    /// The kernel log (`kmsg.xid`).
    Kmsg,
}

/// `gpu.xid` or `kmsg.xid`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xid {
    /// Where it was read.
    pub source: XidSource,
    /// How bad, as its source judged.
    pub severity: Severity,
    /// The GPU component (`gpu1`).
    pub component: String,
    /// The XID.
    pub xid: u64,
    /// The process it names, when the source says.
    pub pid: Option<u32>,
    /// The source's headline and evidence.
    pub report: Report,
}

/// `kmsg.oom_kill`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomKill {
    /// The component it is reported on.
    pub component: String,
    /// The process killed.
    pub pid: u32,
    /// Its name.
    pub process: String,
    /// The kernel log line.
    pub line: String,
}

/// `gpu.processes`: the processes the driver (NVML's running compute
/// processes) says hold a context on a GPU, published when the set
/// changes. Attribution maps a rank to a device only through this or an
/// XID naming its pid, never through the devices the rank declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProcesses {
    /// The GPU ("gpu3").
    pub component: String,
    /// The pids, ascending (bounded by the source).
    pub pids: Vec<u32>,
}

/// `gate.failed`: the first failure's test, entity and severity are what
/// attribution reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateFailed {
    /// What ran (`dcgmi diag -r 2`, `nvml`).
    pub ran: String,
    /// How long it took, formatted.
    pub duration: String,
    /// The job that was restarting (may be empty).
    pub job: String,
    /// A note on the run.
    pub note: String,
    /// Every failure: (test, entity, message, severity); the first names
    /// the event's subject.
    pub failures: Vec<GateFailure>,
}

/// One failed test of the health gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateFailure {
    /// The test.
    pub test: String,
    /// What it failed on (`gpu0`, `node`).
    pub entity: String,
    /// What it said.
    pub message: String,
    /// `isolate` or `reset`...
    pub severity: String,
}

/// `health.changed`.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthChanged {
    /// The component.
    pub component: String,
    /// Its status before (None: new).
    pub from: Option<Status>,
    /// Its status now.
    pub to: Status,
    /// The worst reason now, when there is one.
    pub reason: Option<Reason>,
}

impl HealthChanged {
    /// The reason's signal name (empty without a reason).
    pub fn signal(&self) -> &str {
        self.reason.as_ref().map_or("", |r| r.signal.as_str())
    }
}

/// The event kinds a [`Signal`] variant renders: a [`Signal::Notice`]
/// must not use one (its consumers would never see it).
pub const TYPED_KINDS: &[&str] = &[
    "rank.registered",
    "rank.exception",
    "rank.exited",
    "rank.deregistered",
    "rank.hang",
    "rank.recovered",
    "rank.straggler",
    "rank.straggler_cleared",
    "rank.sdc_suspect",
    "restart.requested",
    "ckpt.saved",
    "ckpt.restored",
    "gpu.xid",
    "kmsg.xid",
    "kmsg.oom_kill",
    "gpu.processes",
    "gate.failed",
    "health.changed",
    "incident.diagnosed",
    "incident.decided",
];

impl From<NewEvent> for Signal {
    fn from(e: NewEvent) -> Self {
        debug_assert!(
            !TYPED_KINDS.contains(&e.kind),
            "{} is a typed signal: publish its Signal variant",
            e.kind
        );
        Signal::Notice(e)
    }
}
