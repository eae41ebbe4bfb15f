//! The launcher's decisions as a state machine: what to do about a worker's
//! exit, the agent's decision, a deadline, a signal or another host's round,
//! given everything decided before.
//!
//! In: one [`Input`] at a time and the time it arrives ([`Now`]), through
//! [`JobState::step`]. Out: the [`Command`]s the executor
//! ([`super::supervise`]) carries out, in order; a command that has an
//! answer (a stop, the gate, a rendezvous, a start, the node's fault) is the
//! last of its batch, and its answer is the next input. The summary's
//! attempt records ([`JobState::records`]).
//!
//! Never: I/O, tokio, protobuf or a clock of its own (the time comes in
//! with each input), so recorded scenarios replay it exactly
//! (`scenarios.rs`). It uses std, the launcher's own types and
//! `humantime` for durations in its messages: it moves as is with the
//! launcher.
//!
//! The flow of a restart, each step an answer to the previous command:
//! the cause (a failure's decision, the launcher's own fallback, a new
//! round) -> the budget check -> [`Command::Publish`] (a local restart, so
//! the other hosts stop meanwhile) -> [`Command::Stop`] -> [`Command::Gate`]
//! -> the backoff (a deadline; a signal ends the job) ->
//! [`Command::Rendezvous`] -> [`Command::Start`] -> running again. A local
//! restart first asks the agent how far the job got ([`Command::Observe`]):
//! `--max-no-progress-restarts` attempts in a row that did not advance it
//! ([`progress::judge`]) end the job with [`exit::EXIT_NO_PROGRESS`].
//!
//! A replacement is no restart: a `restart_in_process` decision carrying a
//! [`Replacement`] (ranks whose process is stopped, which the agent will
//! not wait for) -> [`Command::Replace`] (those workers killed and started
//! again, the others left running) -> [`Input::Replaced`] -> running again;
//! it counts against no budget. One that fails restarts in job.
//!
//! A heal is a replacement the launcher decides alone, at once: a worker
//! died by a signal while every other worker of the attempt lives and
//! declared a healable state ([`WorkerExit::healable`]) -> [`Command::Heal`]
//! (the agent asked to restart the survivors in process, the lost rank
//! started again at their restart count; it takes its state from a live
//! replica) -> [`Input::Replaced`] -> running again. The crash's decision,
//! when it comes, finds the job running and is not acted on unless it
//! stops the job or the node. At most [`MAX_HEALS`] heals within
//! [`HEAL_WINDOW`] (a survivor that left blocked during a heal, exit 75,
//! is part of the fault being healed and counts apart); past that, and
//! for exits by a code (an exception: the same code would fail the same
//! way), the decision is waited for as before. Across hosts the same heal
//! holds in a round whose store node rank 0's launcher hosts
//! ([`RunLimits::round_store_hosted`]): only this host's launcher acts; the
//! other hosts' ranks see the replacement enter the survivors' next
//! attempt on the round's store and join it (`warden.heal`), so no restart
//! is published and no host stops.
//!
//! A hang across hosts is healed too: the agent's `restart_in_job` for a
//! hang while every worker lives and declared a healable state
//! ([`FeedDecision::healable`]), in a round whose store a launcher hosts
//! ([`RunLimits::round_store_hosted`]: etcd's rounds, not torch's c10d
//! rendezvous), publishes the restart (a new round for
//! every host) and heals this host's workers into it in process
//! ([`Phase::HealingRound`], as for a round another host asked), within the
//! same [`MAX_HEALS`]. Why: the survivors of a lost host block in a
//! collective with its ranks, and their agents judge the hang (a 3 s floor)
//! before the lost host's lease runs out (5 s and the rejoin grace by
//! default); restarting in job there killed every survivor and read the
//! checkpoint, where the round the lease's end brings heals the lost
//! host's ranks from live replicas.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use super::exit::{
    self, AbortedAtExit, AttemptRecord, EXIT_BUDGET_SPENT, EXIT_LAUNCHER_ERROR, EXIT_NO_PROGRESS,
    IncidentBrief, RestartTiming,
};
use super::hosts::{AttemptPlan, Directive, Remote};
use super::spawn::Exit;

pub mod job_stop;
pub mod progress;
#[cfg(test)]
mod scenarios;

pub use job_stop::RuleStop;
use progress::AttemptVerdict;
pub use progress::Progress;
use warden_core::signal::join_ranks as join;

/// A failed worker the agent never registered: how long to wait for its
/// registration event to turn up before deciding without the agent.
pub const UNREGISTERED_WAIT: Duration = Duration::from_millis(300);

/// Heals within [`HEAL_WINDOW`] after which a failure waits for the
/// agent's decision again (a replacement that dies as it starts, again
/// and again, is no fault a heal cures).
pub const MAX_HEALS: usize = 3;

/// The window of [`MAX_HEALS`].
pub const HEAL_WINDOW: Duration = Duration::from_secs(60);

/// Whether `exit` is a survivor's that left blocked in a collective during
/// an in-process restart ([`exit::WORKER_LEFT_BLOCKED`], `warden.heal`):
/// part of the fault being healed, not a fault of its own. Counted as one,
/// the two survivors beside a killed rank in gloo's ring that left spent
/// [`MAX_HEALS`] with the first fault, and a second fault a few seconds
/// later restarted the whole job in job (a CI run of tests/torch_heal.rs).
fn left_blocked(exit: Option<Exit>) -> bool {
    matches!(exit, Some(Exit::Code(exit::WORKER_LEFT_BLOCKED)))
}

/// The time an input arrives: the monotonic clock for waits and spans, the
/// wall clock for what is compared with the agent's timestamps and shown.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Monotonic.
    pub at: Instant,
    /// Wall clock.
    pub wall: SystemTime,
}

impl Now {
    /// The clocks now (the executor's; the machine never reads them).
    pub fn read() -> Self {
        Self {
            at: Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

/// What the command line and the job fix for the whole run.
#[derive(Debug, Clone)]
pub struct RunLimits {
    /// `--max-restarts`: restarts this launcher may decide.
    pub max_restarts: Option<u32>,
    /// Restarts the launcher may decide alone (no decision from the agent).
    pub fallback_budget: u32,
    /// How long a failure waits for the agent's decision.
    pub decision_timeout: Duration,
    /// `--teardown-timeout`: how long a teardown failure waits for the
    /// other workers to exit before it counts as a failure ([`Teardown`]).
    pub teardown_timeout: Duration,
    /// SIGTERM to SIGKILL (shown when a signal stops the job).
    pub stop_grace: Duration,
    /// Workers per attempt on this node.
    pub nproc_per_node: u32,
    /// The coordinator's name ("local" on one host), for the messages.
    pub coordinator: String,
    /// Across hosts: each attempt waits for the job's round.
    pub across_hosts: bool,
    /// Across hosts: each round's store is hosted by node rank 0's
    /// launcher ([`crate::round_store`], a process of its own), not by a
    /// worker. Only then does a rank lost on this host heal inside the
    /// round: the survivors of every host and its replacement meet on a
    /// store that outlived it. False on one host (FileStores, no question).
    pub round_store_hosted: bool,
    /// `--max-no-progress-restarts`: failed attempts in a row that did not
    /// advance the job before it stops with [`EXIT_NO_PROGRESS`] (None:
    /// the rule is off).
    pub max_no_progress: Option<u32>,
    /// `--term-grace`: how long the scheduler waits between its SIGTERM
    /// and its SIGKILL (Slurm's KillWait, Kubernetes'
    /// terminationGracePeriodSeconds). Zero: a SIGTERM is forwarded to the
    /// workers as before; else it is a notice: the workers save at their
    /// next step boundary and leave, and the job ends with
    /// [`exit::EXIT_PREEMPTED`] within this window.
    pub term_grace: Duration,
}

/// The window a notice raised by the host (a worker left with
/// [`exit::EXIT_PREEMPTED`] first) gives the other workers when no
/// `--term-grace` is set: GCE's preemption notice.
pub const DEFAULT_NOTICE_WINDOW: Duration = Duration::from_secs(30);

/// What the agent decided about an incident: core's one vocabulary of
/// remediation actions (the proto's is converted at the edge, in the
/// executor's decoding of the incident feed).
pub use warden_core::policy::Action;

/// Ranks the agent asks to be replaced in the middle of an in-process
/// restart (their process is stopped: they can never acknowledge), and the
/// restart count their new processes start with (0 is refused): core's
/// type, which the agent's decision carries.
pub use warden_core::verdict::Replacement;

/// Why the launcher stops its ranks (StopRanks' typed `kind`): core's type,
/// the one the agent's goodput ledger books the exits by.
pub use warden_core::signal::StopKind;

/// One decision of the incident feed (a revision of one incident).
#[derive(Debug, Clone)]
pub struct FeedDecision {
    /// The incident's id.
    pub id: String,
    /// How many decisions it superseded: (id, revision) is seen once.
    pub revision: usize,
    /// When the incident opened (the agent's wall clock).
    pub opened: SystemTime,
    /// What to do (None: none given, an older agent or an unknown value).
    pub action: Option<Action>,
    /// A stop's status (0: none given).
    pub exit_code: i32,
    /// How long a restart waits first.
    pub backoff: Duration,
    /// The summary's view of the incident.
    pub brief: IncidentBrief,
    /// With [`Action::RestartInProcess`]: ranks to replace at once while
    /// the others restart in process.
    pub replace: Option<Replacement>,
    /// Every worker of the attempt declared a healable state when the
    /// decision came (`warden.heal`): a hang across hosts is healed into
    /// the job's next round instead of restarting in job.
    pub healable: bool,
}

/// The answer to [`Command::Replace`].
#[derive(Debug, Clone)]
pub struct Replaced {
    /// (global rank, pid) of each new worker started.
    pub workers: Vec<(u32, i32)>,
    /// Why a worker could not be killed or started again (the job then
    /// restarts in job).
    pub error: Option<String>,
}

/// What the pre-restart health gate said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateVerdict {
    /// Healthy.
    Pass,
    /// Not checked (why): the restart goes on.
    Unchecked(String),
    /// This node must not run the job (why).
    Refused(String),
}

/// A worker's exit, as the launcher saw it.
#[derive(Debug, Clone)]
pub struct WorkerExit {
    /// The attempt it belonged to ([`Command::Start`]'s generation).
    pub generation: u64,
    /// Its global rank.
    pub rank: u32,
    /// Its pid.
    pub pid: i32,
    /// Its status, when the launcher could read it.
    pub exit: Option<Exit>,
    /// The agent had registered it (it can diagnose the failure).
    pub registered: bool,
    /// Its client deregistered cleanly before the process ended (the
    /// client closes after the training code returned).
    pub deregistered: bool,
    /// Its own client registered it (not only the launcher on its
    /// behalf): a client that never deregistered did not end cleanly.
    pub client: bool,
    /// The type of the last exception its stderr showed, if any.
    pub traceback: Option<String>,
    /// It and every other live worker of the attempt declared a state a
    /// live replica can heal (`warden.heal`, [`crate::heal_ready`]).
    pub healable: bool,
}

/// The workers of an attempt that started (or began to).
#[derive(Debug, Clone)]
pub struct Started {
    /// The plan they run with (no node rank: a standby attempt).
    pub plan: AttemptPlan,
    /// (global rank, pid) of each worker spawned.
    pub workers: Vec<(u32, i32)>,
    /// When the start began (before the first spawn).
    pub at: Instant,
    /// The same, on the wall clock.
    pub wall: SystemTime,
    /// A worker could not be spawned (those spawned were killed).
    pub error: Option<String>,
}

/// One thing that happened, for [`JobState::step`].
#[derive(Debug, Clone)]
pub enum Input {
    /// The run begins.
    Begin,
    /// A worker exited.
    WorkerExit(WorkerExit),
    /// Every worker of the current attempt registered with the agent.
    AllRegistered,
    /// The agent decided about an incident of the job.
    FeedDecision(Box<FeedDecision>),
    /// [`JobState::deadline`] passed.
    Deadline,
    /// SIGINT, SIGTERM or SIGHUP reached the launcher.
    Signal(i32),
    /// The agent refused this launcher's call about its job because
    /// another uid owns the job now (its claim was released and taken):
    /// the agent's words. The job stops ([`exit::EXIT_JOB_OWNED`]): it
    /// never runs on watched by nobody, and never on another owner's
    /// decisions.
    Disowned(String),
    /// The agent told the job's ranks here of a notice from one of the
    /// host's own sources (GCE, EC2, a taint), naming `step`: the job
    /// stops on it as on the launcher's SIGTERM, and across hosts the
    /// executor tells the other hosts before any rank here left.
    HostNotice {
        /// The source and what it said, for people.
        reason: String,
        /// The step the agent named for the ranks here.
        step: u64,
        /// When the stop comes (None: the source did not say).
        deadline: Option<SystemTime>,
    },
    /// The other hosts brought something (a new round, a stop, a note).
    Round(Remote),
    /// The answer to [`Command::Rendezvous`]: the attempt's plan.
    Agreed(AttemptPlan),
    /// The answer to [`Command::Rendezvous`]: the hosts could not agree.
    NoRound {
        /// The status to exit with.
        exit_code: i32,
        /// The coordinator's message.
        message: String,
        /// The error as shown.
        error: String,
    },
    /// The answer to [`Command::Start`].
    Started(Box<Started>),
    /// The answer to [`Command::Start`]: nothing could be started (why).
    StartFailed(String),
    /// The answer to [`Command::Stop`]: every pid of the job seen.
    Stopped {
        /// For the GPU release wait.
        pids: Vec<u32>,
    },
    /// The answer to [`Command::Gate`].
    Gated(GateVerdict),
    /// The answer to [`Command::LeaveJob`]: the status to exit with.
    NodeFault {
        /// 86 unless the coordinator says otherwise.
        exit_code: i32,
    },
    /// The answer to [`Command::Observe`]: how far the job got.
    Progress(Progress),
    /// The answer to [`Command::Replace`].
    Replaced(Box<Replaced>),
    /// The answer to [`Command::HealRound`]: None when the workers were
    /// asked to restart into the round; else why not (the job then
    /// restarts in job into the round).
    RoundHealed(Option<String>),
}

/// How the job ends, for [`Command::Finish`].
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// The launcher's exit status.
    pub code: i32,
    /// The summary's outcome line.
    pub outcome: String,
    /// The job failed for good (the other hosts stop with it); false when
    /// this host leaves alone or the job succeeded.
    pub job_failed: bool,
    /// The job ends by the launcher's own rule (no progress): what the
    /// executor tells the agent (ReportJobStop).
    pub report: Option<RuleStop>,
}

/// What the executor does, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// A line on the console.
    Say(String),
    /// Tell the other hosts (a local restart).
    Publish(Directive),
    /// StopRanks (with `reason`), then stop every process of the attempt:
    /// `signal` first, SIGKILL after the grace. Answer: [`Input::Stopped`].
    Stop {
        /// Why, as StopRanks tells the agent (typed: goodput books a stop
        /// for a restart and one of a job ending apart).
        kind: StopKind,
        /// StopRanks' reason, for people.
        reason: String,
        /// The first signal.
        signal: i32,
    },
    /// A notice of a coming stop: StopRanks with kind PREEMPTED and the
    /// deadline, so the agent tells each rank (through its slot) to save
    /// at its next step boundary and leave. No answer: the workers' exits
    /// follow.
    Notice {
        /// When the stop comes.
        deadline: SystemTime,
        /// StopRanks' reason, for people.
        reason: String,
        /// The step every rank of the job saves at, as another host
        /// published it (across hosts). None: this host's notice: its agent
        /// names the step, and across hosts the executor publishes it
        /// (or adopts the one another host published first).
        step: Option<u64>,
    },
    /// A signal during a stop: SIGKILL now (unless already sent).
    Kill {
        /// The signal that asked for it.
        signal: i32,
    },
    /// The GPU release wait for `pids`, then the health gate. Answer:
    /// [`Input::Gated`].
    Gate {
        /// The stopped processes.
        pids: Vec<u32>,
        /// Say why the GPU release wait is skipped (the first restart only).
        say_no_nvml: bool,
    },
    /// The coordinator's part of this node's fault. Answer:
    /// [`Input::NodeFault`].
    LeaveJob {
        /// Why.
        why: String,
    },
    /// Reap the stopped attempt's zombies in the background.
    Reap,
    /// Ask the agent how far the job got (its newest complete checkpoint,
    /// the steps its ranks reported), before a local restart. Answer:
    /// [`Input::Progress`].
    Observe,
    /// Agree on attempt `restart_count` with the other hosts. Answer:
    /// [`Input::Agreed`], [`Input::NoRound`] or [`Input::Signal`].
    Rendezvous {
        /// The attempt's number.
        restart_count: u32,
    },
    /// Kill these workers (global rank, pid) of the running attempt
    /// (StopRanks for them alone first, then SIGKILL, which a stopped
    /// process takes too), wait for their exits, and start each rank again
    /// in the attempt (from its slot's standby when there is one), with
    /// WARDEN_RESTART_COUNT = `restart_count`; the other workers keep
    /// running. Answer: [`Input::Replaced`].
    Replace {
        /// The workers to replace.
        workers: Vec<(u32, i32)>,
        /// The in-process restart count the new processes start with.
        restart_count: u32,
        /// StopRanks' reason, for people.
        reason: String,
    },
    /// Heal: ask the agent to restart the job's live ranks in process
    /// (RequestRestart), then start `rank` (whose process `pid` is gone)
    /// again in the attempt at that request's restart count, as
    /// [`Command::Replace`] does; the new process takes its state from a
    /// live replica. Answer: [`Input::Replaced`] (with an error when the
    /// agent refused: the job then restarts in job).
    Heal {
        /// The lost worker's global rank.
        rank: u32,
        /// Its (dead) process.
        pid: i32,
        /// The request's reason, for people.
        reason: String,
    },
    /// Heal into a new round across hosts that keeps this host's place
    /// ([`Remote::NewRound`] with `keeps_place`): tell the running workers
    /// the round (`plan`: its epoch, rank 0's address and port) and ask
    /// the agent to restart them in process; they keep their processes and
    /// state and meet the other hosts' ranks (a spare's replacements among
    /// them) on the new round's store. Answer: [`Input::RoundHealed`].
    HealRound {
        /// The new round's plan for this host.
        plan: AttemptPlan,
        /// The request's reason, for people.
        reason: String,
    },
    /// Start the attempt's workers, their exits tagged with `generation`.
    /// Answer: [`Input::Started`] or [`Input::StartFailed`].
    Start {
        /// The agreed plan.
        plan: AttemptPlan,
        /// Tells this attempt's exits from an earlier one's.
        generation: u64,
    },
    /// The job ends: tell the others, stop what is left, summarise
    /// ([`JobState::records`]). Nothing follows.
    Finish(Finish),
}

/// Which inputs the executor waits for when it has none queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// Everything: exits, decisions, registrations, signals, rounds, and
    /// [`JobState::deadline`].
    Everything,
    /// Signals and the deadline only (the backoff).
    SignalsOnly,
    /// Nothing: an answer to a command is due.
    Answer,
}

/// A failed worker waiting for the agent's decision.
#[derive(Debug, Clone)]
struct Pending {
    seen: Instant,
    seen_wall: SystemTime,
    rank: u32,
    exit: Option<Exit>,
    deadline: Instant,
    registered: bool,
}

#[derive(Debug, Clone)]
struct Worker {
    rank: u32,
    pid: i32,
    exit: Option<Option<Exit>>,
}

#[derive(Debug, Clone)]
struct Attempt {
    n: u32,
    /// Counts every start, a standby one included.
    generation: u64,
    /// No place in the job's round here: no workers.
    standby: bool,
    /// Its record is in the history already (stopped for a restart).
    recorded: bool,
    started: Instant,
    started_wall: SystemTime,
    workers: Vec<Worker>,
    record: AttemptRecord,
    all_registered: bool,
    /// The global rank of this host's local rank 0 (a round that keeps it,
    /// the node rank and the world size keeps this host's ranks).
    rank_offset: u32,
}

/// A replacement under way: what a failed one restarts in job with.
#[derive(Debug, Clone)]
struct Replacing {
    /// The incident whose decision asked for it.
    id: String,
    brief: IncidentBrief,
    /// The ranks, for the messages.
    ranks: Vec<u32>,
    since: Instant,
    since_wall: SystemTime,
    /// A heal the launcher decided ([`Command::Heal`]), not the agent's
    /// replacement of a stopped rank.
    heal: bool,
}

/// A heal into a new round across hosts under way.
#[derive(Debug, Clone)]
struct RoundHeal {
    /// The round's reason, as the coordinator said it.
    reason: String,
    /// The plan agreed, once the rendezvous answered.
    plan: Option<AttemptPlan>,
    since: Instant,
    since_wall: SystemTime,
}

/// Why a restart happens.
#[derive(Debug, Clone)]
struct Cause {
    /// What the summary shows.
    brief: IncidentBrief,
    /// The incident, when the agent decided.
    incident: Option<String>,
    backoff: Duration,
    /// Decided by the launcher alone (counts against the fallback budget).
    fallback: bool,
    /// A round another host caused: not published, not counted against
    /// `--max-restarts`.
    remote: bool,
    /// When the failure was seen (or the decision came, for a hang).
    since: Instant,
    since_wall: SystemTime,
    decided: Instant,
}

/// A restart under way.
#[derive(Debug, Clone)]
struct Restart {
    cause: Cause,
    had_workers: bool,
    next: u32,
    t_stop: Instant,
    t_gate: Instant,
}

/// What a stop leads to.
#[derive(Debug, Clone)]
enum AfterStop {
    Restart(Box<Restart>),
    Finish { code: i32, name: &'static str },
}

#[derive(Debug, Clone)]
enum Phase {
    /// Before [`Input::Begin`].
    Idle,
    /// Waiting for the agent's view of the job's progress, before the
    /// restart this cause asks for.
    Observing(Box<Cause>),
    /// Waiting for the rendezvous (of a restart, or the first attempt).
    Rendezvous(Option<Box<Restart>>),
    /// Waiting for the start.
    Starting(Option<Box<Restart>>),
    /// The attempt runs.
    Running,
    /// Waiting for a replacement of some workers ([`Command::Replace`]).
    Replacing(Box<Replacing>),
    /// A new round that keeps this host's place: waiting for its plan
    /// ([`Command::Rendezvous`], the workers running), then for the heal
    /// into it ([`Command::HealRound`]).
    HealingRound(Box<RoundHeal>),
    /// Waiting for a stop.
    Stopping(AfterStop),
    /// A notice stands: the workers save and leave by themselves until the
    /// instant; those left are then stopped.
    Draining(Instant),
    /// Waiting for the gate.
    Gating(Box<Restart>),
    /// The backoff until the instant.
    BackingOff(Box<Restart>, Instant),
    /// Waiting for the coordinator's answer to this node's fault.
    LeavingJob {
        outcome: String,
        ended: String,
        incident: Option<IncidentBrief>,
    },
    /// Done.
    Finished {
        ended: String,
        incident: Option<IncidentBrief>,
    },
}

/// Everything the launcher decided so far about one job.
#[derive(Debug, Clone)]
pub struct JobState {
    limits: RunLimits,
    phase: Phase,
    /// When this launcher started (decisions of incidents opened before
    /// belong to an earlier run of the job).
    started_wall: SystemTime,
    attempt: Attempt,
    history: Vec<AttemptRecord>,
    pending: Option<Pending>,
    /// Decisions already seen: (incident, revision).
    handled: HashSet<(String, usize)>,
    /// Incidents already answered with an in-job restart or a stop.
    acted_on: HashSet<String>,
    /// Respawns of the workers (any cause).
    restarts: u32,
    /// Restarts this launcher decided (what `--max-restarts` counts).
    local_restarts: u32,
    /// Attempts that started workers: the next one's number.
    attempts_started: u32,
    /// The job ends here for this node alone (a signal, a node fault,
    /// another node's stop): the other nodes are not stopped with it.
    leaves_alone: bool,
    fallback_used: u32,
    /// After a restart: when the failure (or the new round) was seen, and
    /// which, until every new worker registered.
    awaiting_registration: Option<(Instant, &'static str)>,
    /// A failure the agent answered with `continue`: the job's status at
    /// the end.
    failed_unrestarted: Option<Exit>,
    /// A failure after the worker's training ended, waiting for the other
    /// workers' exits ([`Teardown`]).
    teardown: Option<Teardown>,
    /// What the agent showed at the previous failure: what the next one
    /// is compared with ([`progress::judge`]).
    progress: Option<Progress>,
    /// Failed attempts in a row that did not advance the job.
    stalled: u32,
    /// The progress observed at each failure since the job last advanced:
    /// the no-progress stop's evidence.
    progress_log: Vec<job_stop::StopEvidence>,
    /// The stop the launcher's own rule decided, for [`Finish::report`].
    report: Option<RuleStop>,
    /// Workers killed for a replacement: their exits are no failures.
    replaced_pids: HashSet<i32>,
    /// Workers replaced (any attempt).
    replacements: u32,
    /// When each heal was decided (the last [`HEAL_WINDOW`]'s), but those
    /// of survivors that left blocked ([`left_blocked`]).
    heals: Vec<Instant>,
    /// When each heal of a survivor that left blocked was decided (the
    /// last [`HEAL_WINDOW`]'s): at most one per worker of the attempt.
    left_heals: Vec<Instant>,
    /// Heals done (any attempt).
    healed: u32,
    /// When the last heal of any kind was decided (wall clock, as the
    /// agent's incidents are timed): a hang incident opened before it is
    /// about ranks that restarted since ([`JobState::hang_healed_since`]).
    last_heal_wall: Option<SystemTime>,
}

/// Workers that failed in their teardown: after their training ended, as
/// far as the launcher can tell ([`teardown_sign`]). When every worker of
/// the attempt has ended (exited 0 or failed with the sign), the job ends
/// with the training's result, not a restart: in a data-parallel job every
/// rank tears down the same process groups, so one, some or all of them
/// aborting together is the common case. If another worker fails without
/// the sign, or they do not all end within `--teardown-timeout` (a peer
/// still training), it is a failure like any other (the deferred decisions
/// are acted on).
#[derive(Debug, Clone)]
struct Teardown {
    /// The first one's failure: when the launcher saw it.
    seen: Instant,
    seen_wall: SystemTime,
    /// Each worker that failed with the sign, in the order seen.
    ranks: Vec<TornDown>,
    /// The first one's `--teardown-timeout`.
    deadline: Instant,
    /// The agent's decisions meanwhile, acted on only if it is no teardown.
    deferred: Vec<FeedDecision>,
}

/// One worker of a [`Teardown`].
#[derive(Debug, Clone)]
struct TornDown {
    rank: u32,
    exit: Option<Exit>,
    why: String,
}

impl TornDown {
    fn status(&self) -> String {
        self.exit
            .map_or("status unknown".to_owned(), |e| e.to_string())
    }
}

/// Why a failed worker's training had ended, when the launcher can tell:
/// its client deregistered cleanly before the process died (the client
/// closes after the training code returned, and torch's C++ teardown
/// aborts after that), or, for a worker without a client (zero-code), it
/// aborted (SIGABRT: `std::terminate` in a destructor, `os.abort()` at
/// exit). A Python traceback or a C++ exception on its stderr (`terminate
/// called after throwing ...`) says the training code failed: never a
/// sign. A worker whose client registered but never deregistered did not
/// end its training cleanly: no sign either, however it died. The sign
/// counts only once every worker of the attempt has ended
/// ([`JobState::end_of_teardown`]).
fn teardown_sign(e: &WorkerExit) -> Option<String> {
    if e.traceback.is_some() {
        return None;
    }
    if e.deregistered {
        return Some("its client had deregistered cleanly: its training ended".into());
    }
    if !e.client && matches!(e.exit, Some(Exit::Signal(6))) {
        return Some(
            "SIGABRT with no Python traceback on its stderr: an abort at exit, not an exception in the training code"
                .into(),
        );
    }
    None
}

/// `ranks` as "rank 0" or "ranks 0,1".
fn rank_list(ranks: &[TornDown]) -> String {
    let mut list: Vec<u32> = ranks.iter().map(|t| t.rank).collect();
    list.sort_unstable();
    match list.as_slice() {
        [one] => format!("rank {one}"),
        many => format!("ranks {}", join(many)),
    }
}

/// [`JobState::step`] as a function.
pub fn step(state: &mut JobState, input: Input, now: Now) -> Vec<Command> {
    state.step(input, now)
}

impl JobState {
    /// A job about to begin ([`Input::Begin`]) at `now`.
    pub fn new(limits: RunLimits, now: Now) -> Self {
        Self {
            limits,
            phase: Phase::Idle,
            started_wall: now.wall,
            attempt: Attempt {
                n: 0,
                generation: 0,
                standby: true,
                recorded: false,
                started: now.at,
                started_wall: now.wall,
                workers: Vec::new(),
                record: AttemptRecord::default(),
                all_registered: false,
                rank_offset: 0,
            },
            history: Vec::new(),
            pending: None,
            handled: HashSet::new(),
            acted_on: HashSet::new(),
            restarts: 0,
            local_restarts: 0,
            attempts_started: 0,
            leaves_alone: false,
            fallback_used: 0,
            awaiting_registration: None,
            failed_unrestarted: None,
            teardown: None,
            progress: None,
            stalled: 0,
            progress_log: Vec::new(),
            report: None,
            replaced_pids: HashSet::new(),
            replacements: 0,
            heals: Vec::new(),
            left_heals: Vec::new(),
            last_heal_wall: None,
            healed: 0,
        }
    }

    /// When the executor must say [`Input::Deadline`]: a failure's decision
    /// timeout, or the backoff's end.
    pub fn deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Running => self
                .pending
                .as_ref()
                .map(|p| p.deadline)
                .or(self.teardown.as_ref().map(|t| t.deadline)),
            Phase::BackingOff(_, until) | Phase::Draining(until) => Some(*until),
            _ => None,
        }
    }

    /// Which inputs the executor waits for.
    pub fn listen(&self) -> Listen {
        match self.phase {
            Phase::Running | Phase::Draining(_) => Listen::Everything,
            Phase::BackingOff(..) => Listen::SignalsOnly,
            _ => Listen::Answer,
        }
    }

    /// Every worker of the current attempt, by pid, until each registered:
    /// the executor checks them on every registration.
    pub fn unregistered_attempt(&self) -> Option<Vec<i32>> {
        if self.attempt.all_registered || self.attempt.workers.is_empty() {
            return None;
        }
        Some(self.attempt.workers.iter().map(|w| w.pid).collect())
    }

    /// Respawns so far (any cause).
    pub fn restarts(&self) -> u32 {
        self.restarts
    }

    /// Workers replaced so far in the middle of in-process restarts.
    pub fn replacements(&self) -> u32 {
        self.replacements
    }

    /// Lost ranks whose heal from a live replica was started so far. The
    /// launcher does not learn the outcome: where no replica held a lost
    /// rank's state, the ranks restore from the checkpoint and say so
    /// themselves (`warden.heal`).
    pub fn healed(&self) -> u32 {
        self.healed
    }

    /// Takes one input at `now`; returns what to do.
    pub fn step(&mut self, input: Input, now: Now) -> Vec<Command> {
        let mut out = Vec::new();
        let phase = std::mem::replace(&mut self.phase, Phase::Idle);
        match (phase, input) {
            (Phase::Idle, Input::Begin) => {
                self.phase = Phase::Rendezvous(None);
                out.push(Command::Rendezvous { restart_count: 0 });
            }
            (Phase::Running, input) => {
                self.phase = Phase::Running;
                self.running(input, now, &mut out);
            }
            (Phase::Draining(until), input) => {
                self.phase = Phase::Draining(until);
                self.draining(until, input, now, &mut out);
            }
            (Phase::Rendezvous(r), Input::Agreed(plan)) => {
                self.phase = Phase::Starting(r);
                out.push(Command::Start {
                    plan,
                    generation: self.attempt.generation + 1,
                });
            }
            (
                Phase::Rendezvous(_),
                Input::NoRound {
                    exit_code,
                    message,
                    error,
                },
            ) => {
                out.push(Command::Say(if exit_code == exit::EXIT_PREEMPTED {
                    format!(
                        "{message}: exit {} (preempted: requeue)",
                        exit::EXIT_PREEMPTED
                    )
                } else {
                    format!("the hosts could not agree on the next attempt: {error}")
                }));
                if exit_code == exit::EXIT_NODE_FAULT
                    || exit_code == exit::EXIT_SUCCESS
                    || exit_code == exit::EXIT_PREEMPTED
                {
                    self.leaves_alone = true;
                }
                let outcome = if exit_code == exit::EXIT_SUCCESS {
                    format!("done: {message}")
                } else if exit_code == exit::EXIT_PREEMPTED {
                    // The job is stopping on a notice another host got
                    // while this one was between rounds: no workers start.
                    format!("preempted: {message}; requeue the job")
                } else {
                    format!("failed: {error}")
                };
                out.push(self.finish(exit_code, outcome, "not started".into(), None));
            }
            (Phase::Rendezvous(_), Input::Signal(sig)) => {
                self.leaves_alone = true;
                let name = signal_name(sig);
                out.push(Command::Say(format!(
                    "got {name} while waiting for the job's round: stopping"
                )));
                out.push(self.finish(
                    exit::signalled(sig),
                    format!("stopped on {name}"),
                    format!("stopped on {name} waiting for the job's round"),
                    None,
                ));
            }
            (Phase::Starting(r), Input::Started(s)) => self.started(r, *s, now, &mut out),
            (Phase::Starting(_), Input::StartFailed(e)) => out.push(self.finish(
                EXIT_LAUNCHER_ERROR,
                format!("could not start the workers: {e}"),
                format!("not started: {e}"),
                None,
            )),
            (Phase::Stopping(after), Input::Stopped { pids }) => match after {
                AfterStop::Restart(mut r) => {
                    r.t_stop = now.at;
                    self.gate(r, pids, &mut out);
                }
                AfterStop::Finish { code, name } => out.push(self.finish(
                    code,
                    format!("stopped on {name}"),
                    format!("stopped on {name}"),
                    None,
                )),
            },
            // A second signal while the workers stop: kill them at once.
            (p @ (Phase::Stopping(_) | Phase::Finished { .. }), Input::Signal(sig)) => {
                self.phase = p;
                out.push(Command::Kill { signal: sig });
            }
            (Phase::Gating(r), Input::Gated(v)) => self.gated(r, v, now, &mut out),
            (Phase::Replacing(r), Input::Replaced(done)) => {
                self.replaced(*r, *done, now, &mut out);
            }
            (Phase::HealingRound(mut h), Input::Agreed(plan)) if h.plan.is_none() => {
                if plan.keeps_place && self.keeps_place(&plan) {
                    out.push(Command::HealRound {
                        plan: plan.clone(),
                        reason: format!("healing into a new round across hosts: {}", h.reason),
                    });
                    h.plan = Some(plan);
                    self.phase = Phase::HealingRound(h);
                } else {
                    let why = format!(
                        "{}; the round agreed does not keep this host's place after all",
                        h.reason
                    );
                    self.phase = Phase::Running;
                    self.restart_into_round(why, &h, now, &mut out);
                }
            }
            (Phase::HealingRound(h), Input::RoundHealed(error)) if h.plan.is_some() => {
                self.round_healed(*h, error, now, &mut out);
            }
            // The rendezvous found no round: as after any rendezvous.
            (Phase::HealingRound(h), input @ Input::NoRound { .. }) if h.plan.is_none() => {
                self.phase = Phase::Rendezvous(None);
                out.extend(self.step(input, now));
            }
            // A signal while the rendezvous waits: the workers still run,
            // so they stop as on any signal.
            (Phase::HealingRound(h), Input::Signal(sig)) if h.plan.is_none() => {
                self.phase = Phase::Running;
                self.running(Input::Signal(sig), now, &mut out);
            }
            (Phase::Observing(cause), Input::Progress(p)) => {
                self.observed(*cause, p, now, &mut out);
            }
            // A signal while the agent is asked: the attempt's workers
            // still run, so they stop as on any signal.
            (Phase::Observing(_), Input::Signal(sig)) => {
                self.phase = Phase::Running;
                self.running(Input::Signal(sig), now, &mut out);
            }
            (Phase::BackingOff(r, _), Input::Signal(sig)) => {
                let name = signal_name(sig);
                self.leaves_alone = true;
                out.push(self.finish(
                    exit::signalled(sig),
                    format!("stopped on {name}"),
                    format!("stopped on {name} during the backoff"),
                    Some(r.cause.brief),
                ));
            }
            (Phase::BackingOff(r, until), Input::Deadline) if now.at >= until => {
                self.backed_off(r, now, &mut out);
            }
            (
                Phase::LeavingJob {
                    outcome,
                    ended,
                    incident,
                },
                Input::NodeFault { exit_code },
            ) => {
                out.push(self.finish(exit_code, outcome, ended, incident));
            }
            // Anything else waits for its phase (the executor does not
            // bring it) or has nothing to change.
            (p, _) => self.phase = p,
        }
        out
    }

    /// The summary's attempt records once the job finished: the current
    /// attempt's closed at `now` (unless a restart recorded it).
    pub fn records(&mut self, now: Now) -> Vec<AttemptRecord> {
        let (ended, incident) = match &mut self.phase {
            Phase::Finished { ended, incident } => (ended.clone(), incident.take()),
            _ => (String::new(), None),
        };
        if !self.attempt.recorded && (!self.attempt.workers.is_empty() || self.history.is_empty()) {
            let mut record = std::mem::take(&mut self.attempt.record);
            record.duration_s = now.at.duration_since(self.attempt.started).as_secs_f64();
            record.ended = match record.failures.first() {
                Some((rank, status)) if !ended.contains("stopped on SIG") => {
                    format!("rank {rank} failed ({status}); {ended}")
                }
                _ => ended,
            };
            record.incident = incident;
            self.history.push(record);
            self.attempt.recorded = true;
        }
        std::mem::take(&mut self.history)
    }

    fn running(&mut self, input: Input, now: Now, out: &mut Vec<Command>) {
        match input {
            Input::WorkerExit(e) => self.on_exit(e, now, out),
            Input::AllRegistered => self.on_registered(now, out),
            Input::FeedDecision(d) => self.on_decision(*d, now, out),
            Input::Deadline => self.on_no_decision(now, out),
            Input::Signal(sig) if sig == SIGTERM && !self.limits.term_grace.is_zero() => {
                let window = self.limits.term_grace;
                self.notice(
                    format!(
                        "got SIGTERM: a notice, --term-grace {}",
                        humantime::format_duration(window)
                    ),
                    window,
                    now,
                    out,
                );
            }
            Input::Signal(sig) => {
                let name = signal_name(sig);
                out.push(Command::Say(format!(
                    "got {name}: forwarding it to the workers and stopping them (grace {}; send it again to kill at once)",
                    humantime::format_duration(self.limits.stop_grace)
                )));
                self.leaves_alone = true;
                out.push(Command::Stop {
                    kind: StopKind::LauncherSignalled,
                    reason: format!("the launcher got {name}"),
                    signal: sig,
                });
                self.phase = Phase::Stopping(AfterStop::Finish {
                    code: exit::signalled(sig),
                    name,
                });
            }
            Input::Round(Remote::NewRound {
                reason,
                keeps_place: true,
            }) if self.may_heal_round(now) => {
                out.push(Command::Say(format!(
                    "new round across hosts: {reason}; this host keeps its place: healing its workers into the round in process"
                )));
                self.heal_into_round(reason, now, out);
            }
            Input::Round(Remote::NewRound { reason, .. }) => {
                out.push(Command::Say(format!("new round across hosts: {reason}")));
                let cause = self.new_round_cause(reason, now.at, now.wall, now);
                self.restart(cause, now, out);
            }
            Input::Round(Remote::Stop { exit_code, reason }) => {
                self.leaves_alone = true;
                out.push(Command::Say(format!("stopping: {reason}")));
                out.push(self.finish(
                    exit_code,
                    format!("stopped across hosts: {reason}"),
                    format!("stopped across hosts: {reason}"),
                    None,
                ));
            }
            Input::Round(Remote::Note(text)) => out.push(Command::Say(text)),
            Input::HostNotice {
                reason,
                step,
                deadline,
            } => {
                let window = self.notice_window(deadline, now);
                // The agent named the step already: this host's notice, so
                // across hosts the executor asks the agent for it again
                // (the same step) and publishes it.
                self.notice(
                    format!("{reason}: the agent told the ranks here to save at step {step}"),
                    window,
                    now,
                    out,
                );
            }
            Input::Round(Remote::Notice {
                step,
                deadline,
                reason,
            }) => {
                let window = self.notice_window(deadline, now);
                self.notice_at(
                    format!("{reason}: every rank of the job saves at step {step}"),
                    window,
                    Some(step),
                    now,
                    out,
                );
            }
            Input::Disowned(why) => {
                out.push(Command::Say(format!(
                    "the agent no longer takes this launcher's calls about the job: {why}; stopping the workers (exit {})",
                    exit::EXIT_JOB_OWNED
                )));
                self.leaves_alone = true;
                out.push(Command::Stop {
                    kind: StopKind::JobEnding,
                    reason: "the job belongs to another user at the agent now".into(),
                    signal: SIGTERM,
                });
                self.phase = Phase::Stopping(AfterStop::Finish {
                    code: exit::EXIT_JOB_OWNED,
                    name: "the loss of the job's claim at the agent",
                });
            }
            // Answers to commands never come while the attempt runs.
            Input::Begin
            | Input::Agreed(_)
            | Input::NoRound { .. }
            | Input::Started(_)
            | Input::StartFailed(_)
            | Input::Stopped { .. }
            | Input::Gated(_)
            | Input::NodeFault { .. }
            | Input::Progress(_)
            | Input::Replaced(_)
            | Input::RoundHealed(_) => {}
        }
    }

    /// The window of a notice with `deadline`: the time left to it,
    /// bounded (another host's record in etcd, or a source's word, is not
    /// this host's to trust beyond the hour the agent takes); without one,
    /// `--term-grace` or [`DEFAULT_NOTICE_WINDOW`].
    fn notice_window(&self, deadline: Option<SystemTime>, now: Now) -> Duration {
        deadline
            .and_then(|d| d.duration_since(now.wall).ok())
            .map(|w| {
                // Whole milliseconds: the window is shown on the console.
                let ms = u64::try_from(w.as_millis()).unwrap_or(u64::MAX);
                Duration::from_millis(ms).min(Duration::from_secs(3600))
            })
            .unwrap_or(if self.limits.term_grace.is_zero() {
                DEFAULT_NOTICE_WINDOW
            } else {
                self.limits.term_grace
            })
    }

    /// A notice of a coming stop: the ranks are told (StopRanks, kind
    /// PREEMPTED: the agent sets the notice in their slots), and the job
    /// waits for them to save and leave until the window's end less the
    /// stop sweep's grace and a second, then stops those left. The job
    /// ends with [`exit::EXIT_PREEMPTED`]: "requeue me".
    fn notice(&mut self, why: String, window: Duration, now: Now, out: &mut Vec<Command>) {
        self.notice_at(why, window, None, now, out);
    }

    /// [`Self::notice`], with the step another host published (`Some`).
    fn notice_at(
        &mut self,
        why: String,
        window: Duration,
        step: Option<u64>,
        now: Now,
        out: &mut Vec<Command>,
    ) {
        let wait = window.saturating_sub(self.limits.stop_grace + Duration::from_secs(1));
        out.push(Command::Say(format!(
            "{why}: the workers save at their next step boundary and leave; those left after {} are stopped; exit {} (preempted: requeue)",
            humantime::format_duration(wait),
            exit::EXIT_PREEMPTED
        )));
        out.push(Command::Notice {
            deadline: now.wall + window,
            reason: why,
            step,
        });
        self.leaves_alone = true;
        self.pending = None;
        self.teardown = None;
        self.phase = Phase::Draining(now.at + wait);
        self.drained(out);
    }

    /// While a notice stands: exits are expected, decisions are not acted
    /// on (the job is leaving), the window's end stops the workers left.
    fn draining(&mut self, until: Instant, input: Input, now: Now, out: &mut Vec<Command>) {
        match input {
            Input::WorkerExit(e) => {
                if e.generation != self.attempt.generation {
                    return;
                }
                if let Some(w) = self.attempt.workers.iter_mut().find(|w| w.pid == e.pid) {
                    w.exit = Some(e.exit);
                }
                match e.exit {
                    Some(Exit::Code(c)) if c == exit::EXIT_PREEMPTED || c == 0 => {}
                    other => {
                        let status = other.map_or("status unknown".to_owned(), |x| x.to_string());
                        out.push(Command::Say(format!(
                            "rank {} left during the notice with {status}, not after a save on it",
                            e.rank
                        )));
                        self.attempt.record.failures.push((e.rank, status));
                    }
                }
                self.drained(out);
            }
            Input::Deadline if now.at >= until => {
                let left: Vec<u32> = self
                    .attempt
                    .workers
                    .iter()
                    .filter(|w| w.exit.is_none())
                    .map(|w| w.rank)
                    .collect();
                out.push(Command::Say(format!(
                    "the notice's window is over: stopping rank{} {} (they did not leave)",
                    if left.len() == 1 { "" } else { "s" },
                    left.iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                )));
                out.push(Command::Stop {
                    kind: StopKind::Preempted,
                    reason: "the notice's window is over".into(),
                    signal: SIGTERM,
                });
                self.phase = Phase::Stopping(AfterStop::Finish {
                    code: exit::EXIT_PREEMPTED,
                    name: "a notice (preempted)",
                });
            }
            // The scheduler's next word: stop now.
            Input::Signal(sig) => {
                out.push(Command::Stop {
                    kind: StopKind::Preempted,
                    reason: format!("the launcher got {} during the notice", signal_name(sig)),
                    signal: sig,
                });
                self.phase = Phase::Stopping(AfterStop::Finish {
                    code: exit::EXIT_PREEMPTED,
                    name: "a notice (preempted)",
                });
            }
            _ => {}
        }
    }

    /// Every worker left during the notice: the job ends, preempted.
    fn drained(&mut self, out: &mut Vec<Command>) {
        if !self.attempt.workers.iter().all(|w| w.exit.is_some()) {
            return;
        }
        let saved = self.attempt.record.failures.is_empty();
        let outcome = if saved {
            "preempted: every worker saved on the notice and left; requeue the job".to_owned()
        } else {
            "preempted: the workers left on the notice (not every one after a save); requeue the job".to_owned()
        };
        out.push(self.finish(
            exit::EXIT_PREEMPTED,
            outcome,
            "left on a notice".into(),
            None,
        ));
    }

    /// Ends the job: the phase keeps what the records need.
    fn finish(
        &mut self,
        code: i32,
        outcome: String,
        ended: String,
        incident: Option<IncidentBrief>,
    ) -> Command {
        self.phase = Phase::Finished { ended, incident };
        Command::Finish(Finish {
            code,
            job_failed: code != exit::EXIT_SUCCESS && !self.leaves_alone,
            report: self.report.take(),
            outcome,
        })
    }

    fn started(&mut self, r: Option<Box<Restart>>, s: Started, now: Now, out: &mut Vec<Command>) {
        let plan = &s.plan;
        let n = plan.restart_count;
        let generation = self.attempt.generation + 1;
        let workers = s
            .workers
            .iter()
            .map(|&(rank, pid)| Worker {
                rank,
                pid,
                exit: None,
            })
            .collect();
        self.attempt = match plan.node_rank {
            None => Attempt {
                n,
                generation,
                standby: true,
                recorded: false,
                started: s.at,
                started_wall: s.wall,
                workers: Vec::new(),
                record: AttemptRecord {
                    attempt: n,
                    epoch: plan.epoch,
                    ..Default::default()
                },
                all_registered: false,
                rank_offset: 0,
            },
            Some(node_rank) => {
                self.attempts_started = self.attempts_started.max(n + 1);
                Attempt {
                    n,
                    generation,
                    standby: false,
                    recorded: false,
                    started: s.at,
                    started_wall: s.wall,
                    workers,
                    record: AttemptRecord {
                        attempt: n,
                        workers: self.limits.nproc_per_node,
                        master_port: plan.master_port,
                        epoch: plan.epoch,
                        node_rank,
                        nnodes: plan.nnodes,
                        world_size: plan.world_size,
                        ..Default::default()
                    },
                    all_registered: false,
                    rank_offset: plan.rank_offset,
                }
            }
        };
        if let Some(e) = s.error {
            out.push(self.finish(
                EXIT_LAUNCHER_ERROR,
                format!("could not start the workers: {e}"),
                format!("not started: {e}"),
                None,
            ));
            return;
        }
        self.phase = Phase::Running;
        let Some(r) = r else { return };
        if self.attempt.standby {
            return;
        }
        let since = r.cause.since;
        if r.had_workers {
            self.restarts += 1;
            if let Some(t) = self.history.last_mut().and_then(|a| a.restart.as_mut()) {
                t.spawn_ms = ms(now.at.duration_since(since));
            }
            self.awaiting_registration = Some((
                since,
                if r.cause.remote {
                    "the new round"
                } else {
                    "the failure"
                },
            ));
        }
        out.push(Command::Say(format!(
            "attempt {}: workers started {:.2}s after the {}",
            n,
            now.at.duration_since(since).as_secs_f64(),
            if r.cause.remote {
                "new round"
            } else {
                "failure"
            }
        )));
    }

    fn on_registered(&mut self, now: Now, out: &mut Vec<Command>) {
        if self.attempt.all_registered || self.attempt.workers.is_empty() {
            return;
        }
        self.attempt.all_registered = true;
        let count = self.attempt.workers.len();
        match self.awaiting_registration.take() {
            Some((since, what)) => {
                let ms = ms(now.at.duration_since(since));
                if let Some(r) = self.history.last_mut().and_then(|a| a.restart.as_mut()) {
                    r.registered_ms = Some(ms);
                }
                out.push(Command::Say(format!(
                    "attempt {}: all {count} workers registered with the agent, {:.2}s after {what}",
                    self.attempt.n,
                    ms / 1000.0
                )));
            }
            None => out.push(Command::Say(format!(
                "attempt {}: all {count} workers registered with the agent ({:.2}s after start)",
                self.attempt.n,
                now.at.duration_since(self.attempt.started).as_secs_f64()
            ))),
        }
    }

    fn on_exit(&mut self, e: WorkerExit, now: Now, out: &mut Vec<Command>) {
        let sign = teardown_sign(&e);
        let WorkerExit {
            generation,
            rank,
            pid,
            exit,
            registered,
            healable,
            traceback,
            ..
        } = e;
        if generation != self.attempt.generation {
            return;
        }
        // Killed for a replacement: expected, and its rank runs again.
        if self.replaced_pids.remove(&pid) {
            return;
        }
        if let Some(w) = self.attempt.workers.iter_mut().find(|w| w.pid == pid) {
            w.exit = Some(exit);
        }
        // A rank that saved on a notice of the host's (GCE, EC2, a taint)
        // and left: the others do the same within the notice's window.
        if exit == Some(Exit::Code(exit::EXIT_PREEMPTED)) {
            let window = if self.limits.term_grace.is_zero() {
                DEFAULT_NOTICE_WINDOW
            } else {
                self.limits.term_grace
            };
            self.notice(
                format!(
                    "rank {rank} (pid {pid}) saved on a notice and left (exit {})",
                    exit::EXIT_PREEMPTED
                ),
                window,
                now,
                out,
            );
            return;
        }
        let failed = !exit.is_some_and(Exit::success);
        if failed
            && self.pending.is_none()
            && let Some(why) = sign
        {
            let status = exit.map_or("status unknown".to_owned(), |e| e.to_string());
            out.push(Command::Say(format!(
                "rank {rank} (pid {pid}) failed after its training ended: {status} ({why}); the job's result is the training's"
            )));
            let torn = TornDown { rank, exit, why };
            match self.teardown.as_mut() {
                Some(t) => t.ranks.push(torn),
                None => {
                    self.teardown = Some(Teardown {
                        seen: now.at,
                        seen_wall: now.wall,
                        ranks: vec![torn],
                        deadline: now.at + self.limits.teardown_timeout,
                        deferred: Vec::new(),
                    });
                }
            }
            self.end_of_teardown(out);
            return;
        }
        if failed && let Some(t) = self.teardown.take() {
            // Another worker failed: the first one's was no teardown.
            self.teardown_failed(t, now, out);
            if !matches!(self.phase, Phase::Running) {
                // A held decision restarts or ends the job already.
                return;
            }
        }
        // A traceback on its stderr: the training code failed, and would again.
        if failed
            && healable
            && traceback.is_none()
            && self.pending.is_none()
            && self.may_heal(exit, now)
        {
            self.heal(rank, pid, exit, now, out);
            return;
        }
        if failed {
            let status = exit.map_or("status unknown".to_owned(), |e| e.to_string());
            self.attempt.record.failures.push((rank, status.clone()));
            if self.pending.is_none() {
                let wait = if registered {
                    self.limits.decision_timeout
                } else {
                    UNREGISTERED_WAIT.min(self.limits.decision_timeout)
                };
                out.push(Command::Say(format!(
                    "rank {rank} (pid {pid}) failed: {status}; {}",
                    if registered {
                        "waiting for the agent's diagnosis"
                    } else {
                        "it had not registered with the agent"
                    }
                )));
                self.pending = Some(Pending {
                    seen: now.at,
                    seen_wall: now.wall,
                    rank,
                    exit,
                    deadline: now.at + wait,
                    registered,
                });
            } else {
                out.push(Command::Say(format!(
                    "rank {rank} (pid {pid}) failed too: {status}"
                )));
            }
            return;
        }
        if self.teardown.is_some() {
            self.end_of_teardown(out);
            return;
        }
        let all_done = self.attempt.workers.iter().all(|w| w.exit.is_some());
        if !all_done || self.pending.is_some() {
            return;
        }
        let finish = match self.failed_unrestarted {
            Some(e) => self.finish(
                e.shell_code().max(1),
                "failed (a failure the agent let stand)".into(),
                "the other workers finished".into(),
                None,
            ),
            None => {
                let outcome = if self.restarts == 0 {
                    "succeeded".into()
                } else {
                    format!(
                        "succeeded after {} in-job restart{}",
                        self.restarts,
                        if self.restarts == 1 { "" } else { "s" }
                    )
                };
                self.finish(
                    exit::EXIT_SUCCESS,
                    outcome,
                    "every worker exited 0".into(),
                    None,
                )
            }
        };
        out.push(finish);
    }

    fn on_decision(&mut self, d: FeedDecision, now: Now, out: &mut Vec<Command>) {
        if let Some(t) = self.teardown.as_mut() {
            if !t
                .deferred
                .iter()
                .any(|x| x.id == d.id && x.revision == d.revision)
            {
                t.deferred.push(d);
            }
            return;
        }
        if !self.handled.insert((d.id.clone(), d.revision)) {
            return;
        }
        // The job's history from before this launcher (same job id, a
        // journal kept across runs) is not for us to act on.
        if d.opened + Duration::from_secs(1) < self.started_wall {
            return;
        }
        let brief = d.brief;
        let action = d.action;
        let replace = d.replace;
        let healable = d.healable;
        // About an attempt already stopped (its incident opened before the
        // current attempt started): a restart it asks for has been done.
        let stale = d.opened + Duration::from_millis(50) < self.attempt.started_wall;
        out.push(Command::Say(decision_text(&brief, stale)));
        if self.acted_on.contains(&d.id) && action != Some(Action::Stop) {
            return;
        }
        if !stale && matches!(action, Some(Action::RestartInProcess | Action::Continue)) {
            self.attempt.record.other_decisions.push(format!(
                "{} ({}) {} {:.0}%: {} by {}",
                brief.id,
                brief.kind,
                brief.class,
                brief.confidence * 100.0,
                brief.action,
                brief.decided_by
            ));
        }
        match action {
            Some(Action::RestartInJob) if stale => {}
            Some(Action::RestartInJob) if self.hang_healed_since(&brief, d.opened, now) => {
                out.push(Command::Say(format!(
                    "{}: not acted on: the hung ranks were healed since it opened and every worker runs",
                    d.id
                )));
            }
            Some(Action::RestartInJob) if self.healed_already(&brief, now) => {
                out.push(Command::Say(format!(
                    "{}: not acted on: the crash was healed and every worker runs",
                    d.id
                )));
            }
            // A hang across hosts whose workers can all be healed: the
            // likeliest cause is a host lost whose lease has not run out
            // yet (its ranks' collectives wait for ever), judged here
            // before the lease shows it. Restarting in job would kill
            // this host's workers and read the checkpoint; healed into the
            // job's next round they keep their state, and a lost host's
            // ranks, replaced in the round its lease's end brings, take
            // theirs from live replicas.
            Some(Action::RestartInJob)
                if healable
                    && brief.kind == "hang"
                    && self.limits.round_store_hosted
                    && self.may_heal_round(now) =>
            {
                self.heal_hang_into_round(brief, &d.id, now, out);
            }
            Some(Action::RestartInJob) => {
                let (since, since_wall) = self
                    .pending
                    .as_ref()
                    .map_or((now.at, now.wall), |p| (p.seen, p.seen_wall));
                let cause = Cause {
                    brief,
                    incident: Some(d.id),
                    backoff: d.backoff,
                    fallback: false,
                    remote: false,
                    since,
                    since_wall,
                    decided: now.at,
                };
                self.restart(cause, now, out);
            }
            // The agent charges every crash it diagnoses to the class's
            // restart budget, a healed one too: three heals within the
            // budget's window spent it, and the third crash's decision
            // stopped a job whose every worker runs. A heal's own bound is
            // MAX_HEALS in HEAL_WINDOW; a stop for any other reason (the
            // code's fault, a node fault) is still acted on.
            Some(Action::Stop)
                if d.exit_code == exit::EXIT_BUDGET_SPENT && self.healed_already(&brief, now) =>
            {
                out.push(Command::Say(format!(
                    "{}: not acted on: the crash was healed and every worker runs (the budget its heals spent stops no job that heals)",
                    d.id
                )));
            }
            Some(Action::Stop) => {
                self.acted_on.insert(d.id.clone());
                let code = if d.exit_code == 0 {
                    EXIT_LAUNCHER_ERROR
                } else {
                    d.exit_code
                };
                out.push(self.finish(
                    code,
                    format!("stopped on the agent's diagnosis: {}", brief.class),
                    format!("stopped on {}'s decision", d.id),
                    Some(brief),
                ));
            }
            Some(Action::Cordon | Action::ScaleDown) => {
                self.acted_on.insert(d.id.clone());
                self.leaves_alone = true;
                out.push(Command::LeaveJob {
                    why: brief.summary.clone(),
                });
                self.phase = Phase::LeavingJob {
                    outcome: format!(
                        "this node is at fault ({}): {}; run the job elsewhere",
                        brief.action, brief.summary
                    ),
                    ended: format!("{} on {}'s decision", brief.action, d.id),
                    incident: Some(brief),
                };
            }
            Some(Action::RestartInProcess) if stale => {}
            Some(Action::RestartInProcess) if replace.is_some() && self.pending.is_none() => {
                if let Some(r) = replace {
                    self.replace(d.id, brief, r, now, out);
                }
            }
            Some(Action::RestartInProcess) => match self.pending.take() {
                // The agent restarts the live ranks in process and counts an
                // exited one as its launcher's to restart: a process that is
                // gone cannot come back in process, so the job restarts.
                Some(p) => {
                    let mut b = brief;
                    b.action = "restart_in_job".into();
                    b.decided_by = format!("launcher, on {}'s restart_in_process", b.decided_by);
                    b.reason = format!(
                        "rank {}'s process is gone ({}): an in-process restart cannot bring it back; {}",
                        p.rank,
                        p.exit
                            .map_or("status unknown".to_owned(), |e| e.to_string()),
                        b.reason
                    );
                    self.restart_in_job_at_once(b, d.id, (p.seen, p.seen_wall), now, out);
                }
                None => out.push(Command::Say(
                    "the agent restarts the ranks in process; the launcher leaves the workers running"
                        .into(),
                )),
            },
            Some(Action::Continue) => {
                if let Some(p) = self.pending.take() {
                    self.failed_unrestarted = p.exit.or(Some(Exit::Code(1)));
                }
            }
            None => {}
        }
    }

    /// The agent asks for `r.ranks` to be replaced while the others restart
    /// in process: those of them this host runs (and that still run) are
    /// killed and started again ([`Command::Replace`]). Refused without a
    /// restart count (the replacements could not join the others' attempt:
    /// the agent escalates at its timeout); ranks not running here are said
    /// and left to their own host.
    fn replace(
        &mut self,
        id: String,
        brief: IncidentBrief,
        r: Replacement,
        now: Now,
        out: &mut Vec<Command>,
    ) {
        let mut ranks = r.ranks;
        ranks.sort_unstable();
        ranks.dedup();
        if r.restart_count == 0 {
            out.push(Command::Say(format!(
                "{id}: a replacement of ranks {} without a restart count: refused (the new processes could not join their peers' attempt)",
                join(&ranks)
            )));
            return;
        }
        let workers: Vec<(u32, i32)> = self
            .attempt
            .workers
            .iter()
            .filter(|w| w.exit.is_none() && ranks.binary_search(&w.rank).is_ok())
            .map(|w| (w.rank, w.pid))
            .collect();
        let elsewhere: Vec<u32> = ranks
            .iter()
            .copied()
            .filter(|r| !workers.iter().any(|w| w.0 == *r))
            .collect();
        if !elsewhere.is_empty() {
            out.push(Command::Say(format!(
                "{id}: rank{} {} {} not running here: not replaced by this launcher",
                if elsewhere.len() == 1 { "" } else { "s" },
                join(&elsewhere),
                if elsewhere.len() == 1 { "is" } else { "are" }
            )));
        }
        if workers.is_empty() {
            return;
        }
        let here: Vec<u32> = workers.iter().map(|w| w.0).collect();
        let pids: Vec<String> = workers.iter().map(|w| w.1.to_string()).collect();
        self.attempt
            .workers
            .retain(|w| !workers.iter().any(|x| x.1 == w.pid));
        self.replaced_pids.extend(workers.iter().map(|w| w.1));
        out.push(Command::Say(format!(
            "{id}: replacing rank{} {} (pid{} {}) in restart {}: {}; the other ranks restart in process",
            if here.len() == 1 { "" } else { "s" },
            join(&here),
            if pids.len() == 1 { "" } else { "s" },
            pids.join(" "),
            r.restart_count,
            brief.reason
        )));
        out.push(Command::Replace {
            workers,
            restart_count: r.restart_count,
            reason: format!(
                "replacing rank{} {} ({id})",
                if here.len() == 1 { "" } else { "s" },
                join(&here)
            ),
        });
        self.phase = Phase::Replacing(Box::new(Replacing {
            id,
            brief,
            ranks: here,
            since: now.at,
            since_wall: now.wall,
            heal: false,
        }));
    }

    /// Whether the workers heal into a new round that keeps this host's
    /// place ([`Remote::NewRound`]'s `keeps_place`, which the executor
    /// gives only when every worker declared a healable state): across
    /// hosts, every worker of the attempt running, no failure waiting for
    /// its decision, and fewer than [`MAX_HEALS`] heals in the last
    /// [`HEAL_WINDOW`].
    fn may_heal_round(&mut self, now: Now) -> bool {
        if !self.limits.across_hosts
            || self.attempt.standby
            || self.pending.is_some()
            || self.teardown.is_some()
            || self.attempt.workers.is_empty()
            || self.attempt.workers.iter().any(|w| w.exit.is_some())
        {
            return false;
        }
        self.heals
            .retain(|t| now.at.saturating_duration_since(*t) < HEAL_WINDOW);
        self.heals.len() < MAX_HEALS
    }

    /// The agent's hang decision, healed into a new round: the job's hosts
    /// are asked for one (as for any restart of this host's), and this
    /// host's workers restart into it in process, as for a round another
    /// host asked ([`Phase::HealingRound`]).
    fn heal_hang_into_round(
        &mut self,
        brief: IncidentBrief,
        id: &str,
        now: Now,
        out: &mut Vec<Command>,
    ) {
        let told = told_other_hosts(&brief);
        out.push(Command::Publish(Directive::RestartInJob {
            reason: told.clone(),
            heal: true,
        }));
        out.push(Command::Say(format!(
            "{id}: a hang across hosts, and every worker here can be healed: a new round for the job's hosts, this host's workers healed into it in process (a host lost meanwhile is replaced once its lease runs out, its ranks healed from live replicas)"
        )));
        self.heal_into_round(format!("restart asked by this host: {told}"), now, out);
    }

    /// Agrees on the job's next round without stopping the workers, to heal
    /// them into it ([`Phase::HealingRound`]); counted as a heal.
    fn heal_into_round(&mut self, reason: String, now: Now, out: &mut Vec<Command>) {
        self.heals.push(now.at);
        self.last_heal_wall = Some(now.wall);
        out.push(Command::Rendezvous {
            restart_count: self.attempt.n,
        });
        self.phase = Phase::HealingRound(Box::new(RoundHeal {
            reason,
            plan: None,
            since: now.at,
            since_wall: now.wall,
        }));
    }

    /// Whether `plan` keeps this host's workers where they are: the same
    /// node rank, rank offset, node count and world size as the attempt.
    fn keeps_place(&self, plan: &AttemptPlan) -> bool {
        let r = &self.attempt.record;
        plan.node_rank == Some(r.node_rank)
            && plan.rank_offset == self.attempt.rank_offset
            && plan.nnodes == r.nnodes
            && plan.world_size == r.world_size
    }

    /// The answer to [`Command::HealRound`]: the workers run on in the new
    /// round (its epoch and port in the attempt's record), or, when they
    /// could not be asked, the job restarts in job into it.
    fn round_healed(
        &mut self,
        h: RoundHeal,
        error: Option<String>,
        now: Now,
        out: &mut Vec<Command>,
    ) {
        self.phase = Phase::Running;
        let Some(plan) = h.plan.clone() else {
            return;
        };
        if let Some(e) = error {
            let why = format!("{}; healing into it failed ({e})", h.reason);
            self.restart_into_round(why, &h, now, out);
            return;
        }
        self.healed += 1;
        let took = now.at.duration_since(h.since).as_secs_f64();
        let epoch = plan.epoch.map_or("?".to_owned(), |e| e.to_string());
        self.attempt.record.epoch = plan.epoch;
        self.attempt.record.master_port = plan.master_port;
        self.attempt.record.other_decisions.push(format!(
            "healed into round {epoch} in process: {}",
            h.reason
        ));
        out.push(Command::Say(format!(
            "healed into round {epoch} in {took:.2}s: the workers keep their processes and restart in process (master port {}); the other hosts' new ranks take their state from a live replica where one holds it (the ranks say which)",
            plan.master_port
        )));
    }

    /// A heal into a new round that cannot be done: the round's usual
    /// restart (stop, gate, rendezvous, start), as a round other hosts
    /// caused.
    fn restart_into_round(
        &mut self,
        reason: String,
        h: &RoundHeal,
        now: Now,
        out: &mut Vec<Command>,
    ) {
        out.push(Command::Say(format!(
            "new round across hosts: {reason}: restarting the workers into it"
        )));
        let cause = self.new_round_cause(reason, h.since, h.since_wall, now);
        self.restart(cause, now, out);
    }

    /// The cause of a restart into a new round the job's hosts agreed on
    /// (no incident of this host's: remote, at once), counted from `since`.
    fn new_round_cause(
        &self,
        reason: String,
        since: Instant,
        since_wall: SystemTime,
        now: Now,
    ) -> Cause {
        Cause {
            brief: IncidentBrief {
                action: "new_round".into(),
                reason,
                decided_by: format!("the job's hosts ({})", self.limits.coordinator),
                ..Default::default()
            },
            incident: None,
            backoff: Duration::ZERO,
            fallback: false,
            remote: true,
            since,
            since_wall,
            decided: now.at,
        }
    }

    /// A crash's restart decision that a heal answered already: a heal in
    /// the last [`HEAL_WINDOW`], no failure waiting, every worker running.
    /// Whether a hang's decision is about ranks healed since its incident
    /// opened (at `opened`, the agent's wall clock): a heal of this host's
    /// (into a round, or a rank's) restarted every rank in process after
    /// it, within [`HEAL_WINDOW`], and every worker runs. Seen: the
    /// survivors of a lost host hang, their agent first restarts them in
    /// process, the lost host's round heals them, and then the incident's
    /// revision (another class, `restart_in_job`) came, which would have
    /// stopped the healed job. A hang that comes back after the heal is
    /// a new judgement; past the window it is acted on.
    fn hang_healed_since(&self, brief: &IncidentBrief, opened: SystemTime, now: Now) -> bool {
        brief.kind == "hang"
            && self.last_heal_wall.is_some_and(|t| t > opened)
            && self.healed_and_running(now)
    }

    fn healed_already(&self, brief: &IncidentBrief, now: Now) -> bool {
        brief.kind == "crash" && self.healed_and_running(now)
    }

    /// A heal within [`HEAL_WINDOW`], no failure waiting, and every worker
    /// of the attempt running.
    fn healed_and_running(&self, now: Now) -> bool {
        self.pending.is_none()
            && self
                .heals
                .iter()
                .chain(&self.left_heals)
                .max()
                .is_some_and(|t| now.at.saturating_duration_since(*t) < HEAL_WINDOW)
            && !self.attempt.workers.is_empty()
            && self.attempt.workers.iter().all(|w| w.exit.is_none())
    }

    /// Whether a worker's failure with `exit` is healed at once: it died by
    /// a signal (from outside, or a crash in native code; an exit by a code
    /// is an exception's, which would come back), every other worker of the
    /// attempt is still running, and fewer than [`MAX_HEALS`] heals in the
    /// last [`HEAL_WINDOW`] (for a survivor that left blocked, fewer heals
    /// of such survivors than the attempt has workers). Across hosts only
    /// in an attempt of a round whose store node rank 0's launcher hosts
    /// ([`RunLimits::round_store_hosted`]): the other hosts are not asked, their
    /// ranks see the replacement enter the survivors' next attempt on that
    /// store and join it (`warden.heal`); a store hosted by a worker may be
    /// the lost rank's, and every rank's next attempt would wait for it.
    fn may_heal(&mut self, exit: Option<Exit>, now: Now) -> bool {
        let healable_exit = matches!(exit, Some(Exit::Signal(_))) || left_blocked(exit);
        if !healable_exit
            || (self.limits.across_hosts
                && (!self.limits.round_store_hosted || self.attempt.record.epoch.is_none()))
        {
            return false;
        }
        // Someone must hold a live replica: another rank of this host, or,
        // across hosts, the ranks of the round's other hosts (this host's
        // only rank died; the replacement joins its peers' next attempt).
        let live_here = self.attempt.workers.iter().any(|w| w.exit.is_none());
        let other_hosts = self.limits.across_hosts && self.attempt.record.nnodes > 1;
        if !(live_here || other_hosts) {
            return false;
        }
        let recent = |t: &Instant| now.at.saturating_duration_since(*t) < HEAL_WINDOW;
        self.heals.retain(recent);
        self.left_heals.retain(recent);
        if left_blocked(exit) {
            return self.left_heals.len() < self.attempt.workers.len();
        }
        self.heals.len() < MAX_HEALS
    }

    /// Heals `rank`: its (dead) worker leaves the attempt, the agent asks
    /// the others to restart in process and the rank starts again at their
    /// count ([`Command::Heal`]).
    fn heal(&mut self, rank: u32, pid: i32, exit: Option<Exit>, now: Now, out: &mut Vec<Command>) {
        let status = exit.map_or("status unknown".to_owned(), |e| e.to_string());
        if left_blocked(exit) {
            self.left_heals.push(now.at);
        } else {
            self.heals.push(now.at);
        }
        self.last_heal_wall = Some(now.wall);
        self.attempt.workers.retain(|w| w.pid != pid);
        let reason = format!(
            "rank {rank} (pid {pid}) {status}: healing it from a live replica; the other ranks restart in process"
        );
        out.push(Command::Say(reason.clone()));
        out.push(Command::Heal {
            rank,
            pid,
            reason: reason.clone(),
        });
        self.phase = Phase::Replacing(Box::new(Replacing {
            id: "heal".into(),
            brief: IncidentBrief {
                kind: "crash".into(),
                action: "heal".into(),
                reason,
                decided_by: "the launcher".into(),
                ..Default::default()
            },
            ranks: vec![rank],
            since: now.at,
            since_wall: now.wall,
            heal: true,
        }));
    }

    /// The answer to [`Command::Replace`]: the new workers run in the
    /// attempt; if one could not be killed or started, the job restarts in
    /// job as it would have at the agent's timeout.
    fn replaced(&mut self, r: Replacing, done: Replaced, now: Now, out: &mut Vec<Command>) {
        self.phase = Phase::Running;
        for &(rank, pid) in &done.workers {
            self.attempt.workers.push(Worker {
                rank,
                pid,
                exit: None,
            });
        }
        let took = now.at.duration_since(r.since).as_secs_f64();
        match done.error {
            None if r.heal => {
                self.healed += u32::try_from(done.workers.len()).unwrap_or(u32::MAX);
                let new: Vec<String> = done
                    .workers
                    .iter()
                    .map(|(rank, pid)| format!("rank {rank} pid {pid}"))
                    .collect();
                self.attempt.record.other_decisions.push(format!(
                    "healed {}: {}",
                    new.join(", "),
                    r.brief.reason
                ));
                out.push(Command::Say(format!(
                    "heal started in {took:.2}s: {} started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                    new.join(", ")
                )));
            }
            None => {
                self.replacements += u32::try_from(done.workers.len()).unwrap_or(u32::MAX);
                let new: Vec<String> = done
                    .workers
                    .iter()
                    .map(|(rank, pid)| format!("rank {rank} pid {pid}"))
                    .collect();
                self.attempt.record.other_decisions.push(format!(
                    "{} ({}) replaced {} on its restart_in_process",
                    r.id,
                    r.brief.kind,
                    new.join(", ")
                ));
                out.push(Command::Say(format!(
                    "{}: replaced in {took:.2}s: {}",
                    r.id,
                    new.join(", ")
                )));
            }
            Some(e) if r.heal => {
                let mut b = r.brief;
                b.action = "restart_in_job".into();
                b.decided_by = "the launcher, after a failed heal".into();
                b.reason = format!(
                    "healing rank{} {} failed ({e}): the job restarts from its checkpoint; {}",
                    if r.ranks.len() == 1 { "" } else { "s" },
                    join(&r.ranks),
                    b.reason
                );
                self.restart_in_job_at_once(b, r.id, (r.since, r.since_wall), now, out);
            }
            Some(e) => {
                let mut b = r.brief;
                b.action = "restart_in_job".into();
                b.decided_by = format!(
                    "launcher, after a failed replacement on {}'s restart_in_process",
                    b.decided_by
                );
                b.reason = format!(
                    "replacing rank{} {} failed ({e}); {}",
                    if r.ranks.len() == 1 { "" } else { "s" },
                    join(&r.ranks),
                    b.reason
                );
                self.restart_in_job_at_once(b, r.id, (r.since, r.since_wall), now, out);
            }
        }
    }

    /// The launcher turns the agent's restart_in_process for `incident`
    /// into a restart in job now (a rank whose process is gone, a
    /// replacement that failed): said, no backoff, not a fallback.
    fn restart_in_job_at_once(
        &mut self,
        brief: IncidentBrief,
        incident: String,
        (since, since_wall): (Instant, SystemTime),
        now: Now,
        out: &mut Vec<Command>,
    ) {
        out.push(Command::Say(format!("{}: restarting in job", brief.reason)));
        let cause = Cause {
            brief,
            incident: Some(incident),
            backoff: Duration::ZERO,
            fallback: false,
            remote: false,
            since,
            since_wall,
            decided: now.at,
        };
        self.restart(cause, now, out);
    }

    /// Every worker ended after a teardown failure (exited 0, or failed
    /// after its training ended): the job ends with the training's result.
    /// That is 0 when the failures were deaths by signal (torch's abort at
    /// exit), and a worker's own exit code when it chose one after its
    /// client closed (`sys.exit(3)`): the training's word, not a reason to
    /// run the finished training again.
    fn end_of_teardown(&mut self, out: &mut Vec<Command>) {
        let Some(t) = &self.teardown else { return };
        let all_done = self.attempt.workers.iter().all(|w| w.exit.is_some());
        if !all_done {
            return;
        }
        let every_worker = t.ranks.len() >= self.attempt.workers.len();
        // Reported in rank order: the order seen is a race between ranks
        // that abort together, and a report should read the same each run.
        let mut by_rank = t.ranks.clone();
        by_rank.sort_by_key(|x| x.rank);
        let note = match by_rank.as_slice() {
            [one] => format!(
                "rank {} failed in its teardown ({}): {}",
                one.rank,
                one.status(),
                one.why
            ),
            many => format!(
                "{} failed in their teardown: {}",
                rank_list(many),
                many.iter()
                    .map(|x| format!("rank {} ({}): {}", x.rank, x.status(), x.why))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        };
        for d in &t.deferred {
            out.push(Command::Say(format!(
                "{} ({}): not acted on, the job's training had ended",
                d.id, d.brief.action
            )));
        }
        let chosen = t.ranks.iter().find_map(|x| match x.exit {
            Some(Exit::Code(c)) if c != 0 => Some((x.rank, c)),
            _ => None,
        });
        self.attempt.record.aborted_at_exit = by_rank
            .iter()
            .map(|x| AbortedAtExit {
                rank: x.rank,
                status: x.status(),
                why: x.why.clone(),
            })
            .collect();
        let others = if every_worker {
            "every worker ended its training"
        } else {
            "every other worker exited 0"
        };
        let ended = if every_worker {
            format!(
                "every worker ended its training; {} teardown failure{}",
                t.ranks.len(),
                if t.ranks.len() == 1 { "" } else { "s" }
            )
        } else if t.ranks.len() == 1 {
            "every other worker exited 0; a teardown failure".to_owned()
        } else {
            format!(
                "every other worker exited 0; {} teardown failures",
                t.ranks.len()
            )
        };
        self.teardown = None;
        if let Some((rank, code)) = chosen {
            out.push(Command::Say(format!(
                "{others}: rank {rank} exited {code} after its client closed, the training's result; not restarted; {note}"
            )));
            let outcome = format!(
                "failed: rank {rank} exited {code} after its training ended, not restarted ({note})"
            );
            out.push(self.finish(code, outcome, ended, None));
            return;
        }
        out.push(Command::Say(format!("{others}: the job succeeded; {note}")));
        let outcome = if self.restarts == 0 {
            format!("succeeded ({note})")
        } else {
            format!(
                "succeeded after {} in-job restart{} ({note})",
                self.restarts,
                if self.restarts == 1 { "" } else { "s" }
            )
        };
        out.push(self.finish(exit::EXIT_SUCCESS, outcome, ended, None));
    }

    /// A teardown failure that turned out to be none (another worker
    /// failed, or the others did not end in time): a failure like any
    /// other, the decisions held back acted on.
    fn teardown_failed(&mut self, t: Teardown, now: Now, out: &mut Vec<Command>) {
        let Some(first) = t.ranks.first() else {
            return;
        };
        out.push(Command::Say(format!(
            "{}'s failure is handled as a failure: the other workers did not all end cleanly",
            rank_list(&t.ranks)
        )));
        for x in &t.ranks {
            self.attempt.record.failures.push((x.rank, x.status()));
        }
        self.pending = Some(Pending {
            seen: t.seen,
            seen_wall: t.seen_wall,
            rank: first.rank,
            exit: first.exit,
            deadline: now.at + self.limits.decision_timeout,
            registered: true,
        });
        for d in t.deferred {
            self.on_decision(d, now, out);
        }
    }

    fn on_no_decision(&mut self, now: Now, out: &mut Vec<Command>) {
        if self.pending.is_none()
            && let Some(t) = self.teardown.take()
        {
            if now.at < t.deadline {
                self.teardown = Some(t);
                return;
            }
            self.teardown_failed(t, now, out);
            return;
        }
        let Some(p) = self.pending.take() else {
            return;
        };
        if now.at < p.deadline {
            self.pending = Some(p);
            return;
        }
        let status = p
            .exit
            .map_or("status unknown".to_owned(), |e| e.to_string());
        let wait = now.at.duration_since(p.seen);
        let why = if p.registered {
            format!(
                "no decision from the agent within {:.1}s for rank {}'s failure ({status}): class unknown",
                wait.as_secs_f64(),
                p.rank
            )
        } else {
            format!(
                "rank {} failed ({status}) before registering with the agent, which has nothing to diagnose: class unknown",
                p.rank
            )
        };
        let brief = IncidentBrief {
            kind: "crash".into(),
            class: "unknown".into(),
            summary: format!("rank {} failed: {status}", p.rank),
            action: "restart_in_job".into(),
            reason: why.clone(),
            decided_by: "launcher".into(),
            attempt: self.fallback_used + 1,
            budget: self.limits.fallback_budget,
            ..Default::default()
        };
        out.push(Command::Say(why));
        if self.fallback_used >= self.limits.fallback_budget {
            let mut b = brief;
            b.action = "stop".into();
            let budget = self.limits.fallback_budget;
            let outcome = format!(
                "failed: {budget} restart{} decided without the agent spent ({})",
                if budget == 1 { "" } else { "s" },
                if self.limits.max_restarts.is_some() {
                    "--max-restarts"
                } else {
                    "the policy's unknown budget"
                }
            );
            out.push(self.finish(
                EXIT_BUDGET_SPENT,
                outcome,
                format!("rank {} failed: {status}", p.rank),
                Some(b),
            ));
            return;
        }
        let cause = Cause {
            brief,
            incident: None,
            backoff: Duration::ZERO,
            fallback: true,
            remote: false,
            since: p.seen,
            since_wall: p.seen_wall,
            decided: now.at,
        };
        self.restart(cause, now, out);
    }

    /// The in-job restart (or a new round another host caused), up to the
    /// stop.
    fn restart(&mut self, cause: Cause, now: Now, out: &mut Vec<Command>) {
        if !cause.remote
            && let Some(k) = self.limits.max_restarts
            && self.local_restarts >= k
        {
            out.push(Command::Say(format!(
                "--max-restarts {k} reached: not restarting again"
            )));
            let ended = format!(
                "{}: restart refused (--max-restarts {k})",
                cause.brief.summary
            );
            out.push(self.finish(
                EXIT_BUDGET_SPENT,
                format!("failed: --max-restarts {k} spent"),
                ended,
                Some(cause.brief),
            ));
            return;
        }
        if !cause.remote && !self.attempt.standby && self.limits.max_no_progress.is_some() {
            out.push(Command::Observe);
            self.phase = Phase::Observing(Box::new(cause));
            return;
        }
        self.restart_now(cause, now, out);
    }

    /// The agent's view of the job's progress at a failure: the restart
    /// goes on, unless this was the last of
    /// `--max-no-progress-restarts` failed attempts in a row that did not
    /// advance the job.
    fn observed(&mut self, cause: Cause, seen: Progress, now: Now, out: &mut Vec<Command>) {
        let Some(max) = self.limits.max_no_progress else {
            self.restart_now(cause, now, out);
            return;
        };
        let n = self.attempt.n;
        let Some(before) = self.progress.take() else {
            // The first failure: what the next one is compared with.
            job_stop::keep_newest(
                &mut self.progress_log,
                job_stop::attempt_evidence(
                    n,
                    &seen,
                    "the first failure: what the next is compared with",
                ),
            );
            self.progress = Some(seen);
            self.restart_now(cause, now, out);
            return;
        };
        match progress::judge(&before, &seen) {
            AttemptVerdict::Advanced(how) => {
                self.stalled = 0;
                self.progress_log.clear();
                job_stop::keep_newest(
                    &mut self.progress_log,
                    job_stop::attempt_evidence(n, &seen, &format!("progress: {how}")),
                );
                out.push(Command::Say(format!(
                    "progress since the last restart: {how}"
                )));
                self.progress = Some(seen);
            }
            AttemptVerdict::Unjudged(why) => {
                job_stop::keep_newest(
                    &mut self.progress_log,
                    job_stop::attempt_evidence(n, &seen, &format!("not judged: {why}")),
                );
                out.push(Command::Say(format!(
                    "progress not judged ({why}): {} attempt{} in a row without progress so far",
                    self.stalled,
                    if self.stalled == 1 { "" } else { "s" }
                )));
                self.progress = Some(before);
            }
            AttemptVerdict::Stalled(what) => {
                self.stalled += 1;
                job_stop::keep_newest(
                    &mut self.progress_log,
                    job_stop::attempt_evidence(n, &seen, &format!("no progress: {what}")),
                );
                self.progress = Some(seen);
                if self.stalled >= max {
                    self.no_progress(cause, &what, max, out);
                    return;
                }
                out.push(Command::Say(format!(
                    "no progress: {what} ({} of --max-no-progress-restarts {max})",
                    self.stalled
                )));
            }
        }
        self.restart_now(cause, now, out);
    }

    /// `--max-no-progress-restarts` reached: the job ends with its
    /// diagnosis instead of restarting again.
    fn no_progress(&mut self, cause: Cause, what: &str, max: u32, out: &mut Vec<Command>) {
        let n = self.stalled;
        let why = format!(
            "no progress in {n} restart{} in a row: {what} (--max-no-progress-restarts {max})",
            if n == 1 { "" } else { "s" }
        );
        out.push(Command::Say(format!("{why}: not restarting again")));
        let mut b = cause.brief;
        let ended = format!("{}: restart refused (no progress)", b.summary);
        b.reason = if b.reason.is_empty() {
            why.clone()
        } else {
            format!(
                "{why}; the failure's own decision: {} ({})",
                b.action, b.reason
            )
        };
        b.action = "stop".into();
        b.decided_by = format!("launcher (--max-no-progress-restarts {max})");
        if let Some(id) = &cause.incident {
            self.acted_on.insert(id.clone());
        }
        self.report = Some(RuleStop {
            rule: job_stop::StopRule::NoProgress,
            summary: why.clone(),
            limit: format!("--max-no-progress-restarts {max}"),
            exit_code: EXIT_NO_PROGRESS,
            evidence: std::mem::take(&mut self.progress_log),
            incident: cause.incident.clone(),
        });
        self.pending = None;
        out.push(self.finish(EXIT_NO_PROGRESS, format!("failed: {why}"), ended, Some(b)));
    }

    /// The restart itself, once nothing stands in its way: up to the stop.
    fn restart_now(&mut self, cause: Cause, now: Now, out: &mut Vec<Command>) {
        if cause.fallback {
            self.fallback_used += 1;
        }
        if let Some(id) = &cause.incident {
            self.acted_on.insert(id.clone());
        }
        self.pending = None;
        let had_workers = !self.attempt.standby;
        let next = self.attempts_started;
        let what = what_happened(&cause.brief);
        let reason = if cause.remote {
            format!("new round: {}", cause.brief.reason)
        } else {
            format!("restart {next}: {what}")
        };
        if !cause.remote {
            self.local_restarts += 1;
            // First, so that the other hosts stop their workers meanwhile.
            out.push(Command::Publish(Directive::RestartInJob {
                reason: told_other_hosts(&cause.brief),
                heal: false,
            }));
        }
        let r = Box::new(Restart {
            cause,
            had_workers,
            next,
            t_stop: now.at,
            t_gate: now.at,
        });
        if had_workers {
            out.push(Command::Say(if r.cause.remote {
                "stopping the workers for the new round".into()
            } else {
                format!(
                    "restarting in job (restart {}{}): stopping the workers",
                    self.local_restarts,
                    self.limits
                        .max_restarts
                        .map_or(String::new(), |k| format!(" of at most {k}"))
                )
            }));
            out.push(Command::Stop {
                kind: StopKind::Restart,
                reason,
                signal: SIGTERM,
            });
            self.phase = Phase::Stopping(AfterStop::Restart(r));
        } else {
            self.gate(r, Vec::new(), out);
        }
    }

    fn gate(&mut self, r: Box<Restart>, pids: Vec<u32>, out: &mut Vec<Command>) {
        out.push(Command::Gate {
            pids,
            say_no_nvml: self.restarts == 0,
        });
        self.phase = Phase::Gating(r);
    }

    fn gated(&mut self, mut r: Box<Restart>, v: GateVerdict, now: Now, out: &mut Vec<Command>) {
        match v {
            GateVerdict::Pass => {}
            GateVerdict::Unchecked(why) => {
                out.push(Command::Say(format!("health gate not checked: {why}")));
            }
            GateVerdict::Refused(why) => {
                out.push(Command::Say(format!(
                    "pre-restart health gate refused: {why}"
                )));
                self.leaves_alone = true;
                out.push(Command::LeaveJob { why: why.clone() });
                let mut b = r.cause.brief;
                b.reason = format!("{}; the health gate refused: {why}", b.reason);
                self.phase = Phase::LeavingJob {
                    outcome: format!(
                        "this node is at fault (health gate: {why}); run the job elsewhere"
                    ),
                    ended: "restart refused by the health gate".into(),
                    incident: Some(b),
                };
                return;
            }
        }
        r.t_gate = now.at;
        if r.cause.backoff.is_zero() {
            self.backed_off(r, now, out);
        } else {
            out.push(Command::Say(format!(
                "backing off {} before the restart (policy)",
                humantime::format_duration(r.cause.backoff)
            )));
            let until = now.at + r.cause.backoff;
            self.phase = Phase::BackingOff(r, until);
        }
    }

    /// After the backoff: close the stopped attempt's record and agree on
    /// the next one.
    fn backed_off(&mut self, r: Box<Restart>, now: Now, out: &mut Vec<Command>) {
        let t_backoff = now.at;
        // Its zombies are reaped in the background (they hold their pids
        // until then, so no group the stop signalled can have been reused).
        // A standby wait leaves no record.
        out.push(Command::Reap);
        if r.had_workers {
            let c = &r.cause;
            let mut record = std::mem::take(&mut self.attempt.record);
            record.duration_s = now.at.duration_since(self.attempt.started).as_secs_f64();
            record.ended = match (record.failures.first(), c.remote) {
                (Some((rank, status)), false) => {
                    format!("rank {rank} failed ({status}); restarted in job")
                }
                (Some((rank, status)), true) => {
                    format!("rank {rank} failed ({status}); stopped for a new round")
                }
                (None, false) => "restarted in job".into(),
                (None, true) => "stopped for a new round".into(),
            };
            record.incident = Some(c.brief.clone());
            record.restart = Some(RestartTiming {
                failure_seen_unix_s: unix_s(c.since_wall),
                decision_ms: ms(c.decided.duration_since(c.since)),
                stop_ms: ms(r.t_stop.duration_since(c.decided)),
                gate_ms: ms(r.t_gate.duration_since(r.t_stop)),
                backoff_ms: ms(t_backoff.duration_since(r.t_gate)),
                spawn_ms: 0.0,
                registered_ms: None,
            });
            self.history.push(record);
            self.attempt.recorded = true;
        }
        if self.limits.across_hosts {
            out.push(Command::Say("waiting for the job's next round".into()));
        }
        out.push(Command::Rendezvous {
            restart_count: r.next,
        });
        self.phase = Phase::Rendezvous(Some(r));
    }
}

/// SIGTERM's number (Linux), the restart's first signal.
pub const SIGTERM: i32 = 15;

/// A signal's name for the messages (the launcher handles SIGINT, SIGTERM
/// and SIGHUP).
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        9 => "SIGKILL",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

/// The console's account of a decision.
fn decision_text(b: &IncidentBrief, stale: bool) -> String {
    let mut text = format!(
        "agent: {} ({}): {} {:.0}%: {}",
        b.id,
        b.kind,
        b.class,
        b.confidence * 100.0,
        b.summary
    );
    for e in b.evidence.iter().take(3) {
        text.push_str(&format!("\n  evidence: {e}"));
    }
    text.push_str(&format!(
        "\n  decision: {} by {} ({}/{}): {}{}",
        b.action,
        b.decided_by,
        b.attempt,
        b.budget,
        b.reason,
        if stale {
            " [about an earlier attempt: already handled]"
        } else {
            ""
        }
    ));
    text
}

/// What an incident says happened: its summary, else its reason.
fn what_happened(brief: &IncidentBrief) -> &str {
    if brief.summary.is_empty() {
        &brief.reason
    } else {
        &brief.summary
    }
}

/// What a restart this host asks tells the other hosts: the incident, its
/// class and what happened, clipped.
fn told_other_hosts(brief: &IncidentBrief) -> String {
    format!(
        "{}{}: {}",
        brief.id,
        if brief.id.is_empty() {
            brief.class.clone()
        } else {
            format!(" ({})", brief.class)
        },
        clip(what_happened(brief), 160)
    )
}

/// `s` cut to at most `max` characters, marked when cut.
fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn unix_s(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
