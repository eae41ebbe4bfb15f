//! The supervision loop's executor: start the attempt's workers, watch them
//! and the agent's decisions about the job, and carry out what the
//! launcher's state machine ([`super::machine`]) decides.
//!
//! In: the job, the agent link, the coordinator, the console, the signals.
//! Out: the machine's inputs (worker exits read from pidfds, decisions
//! decoded from WatchIncidents, registrations from WatchEvents, deadlines,
//! signals, the other hosts' rounds, and the answers to its commands), and
//! its commands carried out (spawning, StopRanks and the stop sweep, the
//! GPU release and health gate, etcd, printing); the summary. Never: decide
//! (what to do about any input is the machine's).
//!
//! What the machine decides, in short:
//!
//! - Every worker exits 0: the job succeeded (0).
//! - A worker fails: the launcher knows its status at once (pidfd, then
//!   `waitid(WNOWAIT)`: the zombie stays for the agent to read) and waits
//!   for the agent's decision (WatchIncidents; the agent settles for
//!   `attribution.settle`, ~200 ms). No decision within `--decision-timeout`
//!   (a worker that died before registering: the agent has no rank to
//!   attribute; an agent that is down) is class unknown: an in-job restart
//!   within `--max-restarts`, else the policy's `unknown` budget.
//! - `restart_in_job`: StopRanks (their exits are then no incidents), stop
//!   every process of the job (SIGTERM to each worker's process group, SIGKILL
//!   after `--stop-grace`, orphans found and reaped), wait for the GPUs to
//!   release them, pass the health gate, wait the decision's backoff, and
//!   start the next attempt with the restart count + 1.
//! - `stop`: stop the workers, print the diagnosis, exit with the
//!   decision's status (a user error: the rank's own code).
//! - `cordon`, `scale_down`: this node is at fault: the coordinator says
//!   what that means (one host: stop and exit 86; across hosts: leave the
//!   job, then exit 86).
//! - `restart_in_process`: the agent's to carry out (through the ranks'
//!   clients); the launcher keeps its hands off the live workers. A
//!   superseding `restart_in_job` (the agent's escalation when the ranks do
//!   not acknowledge) is acted on. A worker whose process is gone cannot come
//!   back in process (the agent counts it as its launcher's to restart), so
//!   with a failed worker the launcher restarts in job at once. A revision
//!   carrying a replacement (a rank's process is stopped: it can never
//!   acknowledge) kills that worker alone and starts its rank again in the
//!   same attempt, with the in-process restart's count, while the others
//!   restart in process; a failed replacement restarts in job.
//! - `continue`: nothing.
//! - SIGINT/SIGTERM/SIGHUP/SIGQUIT: forwarded to the workers' process groups, a
//!   graceful stop, exit 128+N; a second one kills at once.
//!
//! Across hosts (the coordinator's part): every attempt is planned by a
//! rendezvous (the job's round: node rank or none, world size, rank 0's
//! address); a local restart is published first, so every host restarts
//! in the same round; a round another host caused (a restart, a host lost,
//! cordoned or back, a spare taken in) stops the local workers as a
//! restart does (StopRanks first) and starts them on the new round, without
//! counting against `--max-restarts`; a host with no place in the round
//! (a standby spare) runs no workers until a round gives it one; the job's
//! end is published (the others stop with a failed job's status).

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use warden_proto::v1 as pb;

use super::agent::{self, AgentLink, Seen};
use super::env::WorkerEnv;
use super::exit::{IncidentBrief, RunSummary};
use super::gate::{self, GateResult, GpuRelease};
use super::heal_ready;
use super::hosts::{AcrossHosts, AttemptPlan, Directive, LocalOnly, NodeFault, Remote};
use super::machine::{
    Command, FeedDecision, Finish, GateVerdict, Input, JobState, Listen, Now, Progress, Replaced,
    Replacement, RunLimits, Started, StopKind, WorkerExit,
};
use super::output::{self, Console, Stream};
use super::reported_imports;
use super::spawn::{self, Exit};
use super::standby::{self, Standby};
use super::zero_code;

/// How long an exit waits for the agent's word that the worker's client
/// deregistered ([`Sup::await_deregistration`]).
const DEREGISTRATION_GRACE: Duration = Duration::from_secs(1);

/// How long exited workers stay zombies, at most, waiting for the agent to
/// report them (it reads their status from the zombie).
const REAP_WAIT: Duration = Duration::from_secs(1);
/// How long a failed worker's stderr may take to close after its exit,
/// for its last traceback (a child that inherited the pipe keeps it open).
const STDERR_DRAIN: Duration = Duration::from_millis(500);
/// How long a worker's output may keep flowing after the job ended.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);
/// How long StopRanks may take before the launcher stops the workers anyway.
const STOP_RANKS_TIMEOUT: Duration = Duration::from_secs(1);

/// Across hosts: how far ahead (at the job's step time) the step named for
/// this host's notice lies, so that the other hosts, told through etcd
/// (a txn, their watch, their agent's StopRanks and next tick), reach their
/// ranks before those pass it. At most a quarter of the notice's window.
pub const NOTICE_LEAD: Duration = warden_agent::notice::ACROSS_HOSTS_LEAD;
/// How long each of the agent's answers about the job's progress may take
/// at a restart (ListCheckpoints waits up to 5 s for shards being sealed;
/// a restart does not).
const OBSERVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Processes that survive SIGKILL this long (uninterruptible sleep) are
/// reported and left.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// The most ranks one decision may ask this launcher to replace (more are
/// dropped: a host runs far fewer workers).
const MAX_REPLACE: usize = 4096;
/// How long a restart waits for a standby still importing (it has a head
/// start over a cold worker) before starting the rank cold.
const STANDBY_READY_WAIT: Duration = Duration::from_secs(30);
/// On one host: how long a worker whose collective lost a local peer waits
/// for the heal's restart request before it reports the error
/// (`WARDEN_HEAL_PEER_WAIT_S`). The launcher sees the death at once but
/// acts on it only once the command before it is done (one at a time): a
/// second death during a heal waits for that heal, which may wait for a
/// standby still importing ([`STANDBY_READY_WAIT`]). The client's own 2 s
/// (enough for a first death) could run out there, and the survivor's
/// error would end it and restart the job in job. The wait ends at the
/// request, or at the launcher's stop of a job it does not heal.
pub const LOCAL_HEAL_PEER_WAIT: Duration = Duration::from_secs(STANDBY_READY_WAIT.as_secs() + 10);
/// How long after a warm restart the used standbys are replaced: their
/// imports would compete for the CPU with the restarted ranks' start.
const STANDBY_REPLENISH_AFTER: Duration = Duration::from_secs(5);
/// The workers' variables a standby gets at its start (every rank has the
/// same ones; modules may read them at import): the thread defaults.
const STANDBY_ENV: &[&str] = &[
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTHONUNBUFFERED",
];
/// When, after an attempt starts, the workers' reported imports are read
/// for the standbys (the client writes when `warden.run` starts and 20 s
/// later): each delay counts from the check before.
const IMPORTS_CHECKS: &[Duration] = &[
    Duration::from_secs(5),
    Duration::from_secs(20),
    Duration::from_secs(40),
];

/// What the supervisor runs.
#[derive(Debug, Clone)]
pub struct Job {
    /// The job's id.
    pub id: String,
    /// The argv of every worker.
    pub argv: Vec<String>,
    /// Their working directory.
    pub cwd: PathBuf,
    /// `<log-dir>/<job>`.
    pub log_root: PathBuf,
    /// The same, open: the launcher's own directory, where each attempt's
    /// directory and log files are made ([`output::LogRoot`]).
    pub logs: std::sync::Arc<output::LogRoot>,
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// ROLE_NAME.
    pub role: String,
    /// torchrun's console and log options.
    pub torchrun: crate::torchrun_flags::TorchrunFlags,
    /// Rank 0's address.
    pub master_addr: String,
    /// A fixed store port; None: a free one per attempt.
    pub master_port: Option<u16>,
    /// `--max-restarts`.
    pub max_restarts: Option<u32>,
    /// Restarts the launcher may decide alone (no decision from the agent).
    pub fallback_budget: u32,
    /// `--max-no-progress-restarts` (None: off).
    pub max_no_progress: Option<u32>,
    /// SIGTERM to SIGKILL.
    pub stop_grace: Duration,
    /// `--term-grace`: the scheduler's SIGTERM to its SIGKILL (0: off).
    pub term_grace: Duration,
    /// How long a failure waits for the agent's decision.
    pub decision_timeout: Duration,
    /// How long a teardown failure waits for the other workers' exits.
    pub teardown_timeout: Duration,
    /// The GPU release wait's bound.
    pub gpu_release_timeout: Duration,
    /// Standby interpreters for warm in-job restarts (`--standby`); None:
    /// every attempt starts cold.
    pub standby: Option<standby::StandbyPlan>,
    /// A JAX job (`--jax`): each worker also gets what
    /// `jax.distributed.initialize()` reads ([`crate::jax`]).
    pub jax: bool,
    /// The job's compilation caches in the agent's tier (None: the
    /// frameworks' defaults).
    pub compile_cache: Option<crate::compile_cache::CompileCache>,
    /// The compilation cache saved for the job's other hosts, once per
    /// attempt ([`crate::cache_share::PACK_AFTER`] into it), off the
    /// workers' path. None: not shared.
    pub compile_share: Option<std::sync::Arc<crate::cache_share::CacheShare>>,
    /// How long a worker that lost a peer waits for its launcher's heal
    /// before it reports the error (`WARDEN_HEAL_PEER_WAIT_S`). Across
    /// hosts, for the heal into the next round: the lost host's lease TTL,
    /// the others' rejoin grace and the round's writing, with margin; on
    /// one host [`LOCAL_HEAL_PEER_WAIT`]. None: not set (the client's own
    /// 2 s).
    pub heal_peer_wait: Option<Duration>,
    /// Across hosts: the Python interpreter that hosts the round's store
    /// when this host is node rank 0 ([`crate::round_store`]), so that the
    /// store outlives any worker. None on one host (FileStores) or for a
    /// command that is not a Python entrypoint (rank 0 hosts it, as before).
    pub round_store_python: Option<String>,
}

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT (torchrun's `--signals-to-handle`
/// default), installed before anything is started.
#[derive(Debug)]
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers: from now on these signals reach the launcher
    /// as events instead of killing it.
    pub fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next signal received.
    pub async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.hup.recv() => libc::SIGHUP,
            _ = self.quit.recv() => libc::SIGQUIT,
        }
    }
}

/// What the current attempt's workers were started with: a replacement
/// starts its rank again with the same.
#[derive(Debug, Clone)]
struct AttemptEnv {
    wenv: WorkerEnv,
    /// The attempt's log directory, open (its log files are made there).
    logs: std::sync::Arc<output::AttemptLogs>,
    host: String,
    /// Tags the attempt's exits.
    generation: u64,
}

#[derive(Debug)]
struct Worker {
    rank: u32,
    pid: i32,
    pumps: Vec<JoinHandle<()>>,
}

#[derive(Debug)]
struct ExitNote {
    /// The attempt's generation ([`Command::Start`]'s).
    generation: u64,
    rank: u32,
    pid: i32,
    exit: Option<Exit>,
    /// The type of the last exception its stderr showed.
    traceback: Option<String>,
}

enum Ev {
    Exit(ExitNote),
    FeedDecision(Box<pb::Incident>),
    DecisionsClosed,
    Deadline,
    Seen,
    SeenClosed,
    Signal(i32),
    Disowned(String),
    Remote(Remote),
    Replenish,
    Imports,
}

/// What carrying out one command led to.
// One value per command, moved once: its size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Done {
    /// Nothing to tell the machine.
    Nothing,
    /// The command's answer, the machine's next input.
    Answer(Input),
    /// The job ended.
    Finished(RunSummary),
}

/// Runs the job to its end; returns the summary (its `exit_code` is the
/// launcher's exit status).
pub async fn run<C: AcrossHosts>(
    job: Job,
    link: &AgentLink,
    coord: C,
    console: Console,
    signals: &mut Signals,
) -> RunSummary {
    let stop = CancellationToken::new();
    let seen = agent::watch_ranks(link.client.clone(), job.id.clone(), stop.clone()).await;
    let decisions = agent::watch_decisions(link.client.clone(), job.id.clone(), stop.clone());
    let (exits_tx, exits_rx) = mpsc::unbounded_channel();
    let (peers_tx, peers_rx) = watch::channel(agent::CkptPeers::default());
    agent::keep_peers(link.client.clone(), job.id.clone(), peers_rx, stop.clone());
    let (disowned_tx, disowned_rx) = mpsc::unbounded_channel();
    agent::keep_claim(
        link.client.clone(),
        job.id.clone(),
        disowned_tx.clone(),
        stop.clone(),
    );
    let now = Now::read();
    let limits = RunLimits {
        max_restarts: job.max_restarts,
        fallback_budget: job.fallback_budget,
        decision_timeout: job.decision_timeout,
        teardown_timeout: job.teardown_timeout,
        stop_grace: job.stop_grace,
        nproc_per_node: job.nproc_per_node,
        coordinator: coord.name().to_owned(),
        across_hosts: coord.name() != LocalOnly.name(),
        // The same rule as the workers' WARDEN_ROUND_STORE_PORT
        // (`round_store_port`): a Python entrypoint, not JAX.
        round_store_hosted: job.round_store_python.is_some() && !job.jax,
        max_no_progress: job.max_no_progress,
        term_grace: job.term_grace,
    };
    let mut sup = Sup {
        agent_line: link.label(),
        socket: link.socket.clone(),
        client: link.client.clone(),
        nvml_library: link.config.nvml.library.clone(),
        job,
        coord,
        console,
        signals,
        seen,
        seen_open: true,
        decisions,
        decisions_open: true,
        exits_tx,
        exits_rx,
        disowned_tx,
        disowned_rx,
        peers_tx,
        state: JobState::new(limits, now),
        workers: Vec::new(),
        started: now.at,
        reapers: Vec::new(),
        held_stop: None,
        notice_deadline: None,
        notice_step: None,
        host_notice_brought: false,
        standbys: Vec::new(),
        healed_pids: HashSet::new(),
        round_store: None,
        round_store_open: Vec::new(),
        standby_env: Vec::new(),
        replenish_at: None,
        imports: Imports::default(),
        attempts_started: 0,
        deferred_signal: None,
        attempt_env: None,
        jax_port: None,
    };
    let summary = sup.run().await;
    stop.cancel();
    summary
}

/// The workers' reported imports ([`reported_imports`]) on their way to
/// the standbys.
#[derive(Debug, Default)]
struct Imports {
    /// The next read.
    check_at: Option<Instant>,
    /// Which of [`IMPORTS_CHECKS`] comes after it.
    next: usize,
    /// Names already handed to the standbys.
    sent: std::collections::BTreeSet<String>,
}

impl Imports {
    /// Plans read `i` of [`IMPORTS_CHECKS`] from now (none past the last).
    fn schedule(&mut self, i: usize) {
        self.check_at = IMPORTS_CHECKS.get(i).map(|d| Instant::now() + *d);
        self.next = i + 1;
    }
}

/// The executor: carries out the machine's commands and turns what happens
/// (exits, the agent's streams, signals, the other hosts) into its inputs.
struct Sup<'a, C> {
    agent_line: String,
    socket: PathBuf,
    client: warden_proto::v1::agent_client::AgentClient<tonic::transport::Channel>,
    nvml_library: String,
    job: Job,
    coord: C,
    console: Console,
    signals: &'a mut Signals,
    seen: watch::Receiver<Seen>,
    seen_open: bool,
    decisions: mpsc::Receiver<pb::Incident>,
    decisions_open: bool,
    exits_tx: mpsc::UnboundedSender<ExitNote>,
    exits_rx: mpsc::UnboundedReceiver<ExitNote>,
    /// The agent's refusals of this launcher's calls about its job because
    /// another uid owns it now (a worker's registration, the claim's
    /// renewal): the machine stops the job on the first
    /// ([`Input::Disowned`]).
    disowned_tx: mpsc::UnboundedSender<String>,
    disowned_rx: mpsc::UnboundedReceiver<String>,
    /// The current round's checkpoint peers, handed to the agent again
    /// now and then ([`agent::keep_peers`]).
    peers_tx: watch::Sender<agent::CkptPeers>,
    /// The decisions ([`machine`]).
    state: JobState,
    /// The current attempt's processes.
    workers: Vec<Worker>,
    started: Instant,
    /// Background reaping of stopped attempts' zombies.
    reapers: Vec<JoinHandle<()>>,
    /// The cordon share held this host's node fault: the stop to report
    /// to the agent at the job's end.
    held_stop: Option<crate::machine::RuleStop>,
    /// When the notice's stop comes (set by [`Command::Notice`]): the
    /// bound on waiting for the notice's checkpoint to be replicated.
    notice_deadline: Option<SystemTime>,
    /// The step this host's ranks save on the notice, as the agent named
    /// it: the step the notice's checkpoint check waits to see complete.
    notice_step: Option<u64>,
    /// The agent's host notice ([`agent::Seen::host_notice`]) was handed
    /// to the machine (once).
    host_notice_brought: bool,
    /// The standby interpreters, when kept ([`Job::standby`]): one slot per
    /// local worker, or fewer (`--standbys`). A restarted worker takes one
    /// as [`standby::pick_slot`] says.
    standbys: Vec<Option<Standby>>,
    /// Workers started in place of one that had declared its state (a
    /// heal's replacement, or one replacing a frozen rank): they run the
    /// script that declared, and count as healable before they declared it
    /// again.
    healed_pids: HashSet<i32>,
    /// The round's store process, while this host is node rank 0 of a
    /// round across hosts ([`crate::round_store`]); started at the first
    /// such round, kept for the next (torch imported once).
    /// Shared with the task that opens a round's store at an attempt's
    /// start (its first answer waits for torch's import: the executor does
    /// not).
    round_store: Option<std::sync::Arc<tokio::sync::Mutex<crate::round_store::RoundStore>>>,
    /// The tasks opening a round's store at an attempt's start (aborted
    /// at the job's end: each holds a console handle, which the launcher's
    /// exit waits for).
    round_store_open: Vec<JoinHandle<()>>,
    /// What a standby gets at its start besides the launcher's environment.
    standby_env: Vec<(String, String)>,
    /// When the standbys used by a warm restart are replaced.
    replenish_at: Option<Instant>,
    /// The workers' reported imports, passed on to the standbys.
    imports: Imports,
    /// Attempts started so far (the first starts cold).
    attempts_started: u32,
    /// A signal received while a start waited for a standby: the next
    /// input.
    deferred_signal: Option<i32>,
    /// The current attempt's environment, for replacements (None before
    /// the first start and for a standby attempt).
    attempt_env: Option<AttemptEnv>,
    /// A JAX job's coordinator port picked free for the attempt whose
    /// MASTER_PORT is the first (one node, no fixed port); else
    /// MASTER_PORT + 1 ([`crate::jax::coordinator_port`]).
    jax_port: Option<(u16, u16)>,
}

impl<C: AcrossHosts> Sup<'_, C> {
    async fn run(&mut self) -> RunSummary {
        let mut queue = VecDeque::from([Input::Begin]);
        loop {
            let input = match queue.pop_front() {
                Some(i) => i,
                None => match self.next_input().await {
                    Some(i) => i,
                    None => continue,
                },
            };
            for command in self.state.step(input, Now::read()) {
                match self.execute(command).await {
                    Done::Nothing => {}
                    Done::Answer(i) => queue.push_back(i),
                    Done::Finished(summary) => return summary,
                }
            }
        }
    }

    /// For a failed worker whose client registered and whose clean
    /// deregistration the launcher has not heard of: waits a moment for it.
    /// The client's DeregisterRank returns before the process goes on to
    /// its teardown, so the agent has it when the process dies, but the
    /// agent's event can reach the launcher after the exit does; without
    /// the wait, a rank that closed and then aborted in torch's teardown
    /// would read as one that died in its training and restart a finished
    /// job. Only failures without a traceback wait (at most
    /// [`DEREGISTRATION_GRACE`]), and only when a client registered.
    async fn await_deregistration(&mut self, pid: u32) {
        // Over as soon as the agent reported the exit: a deregistration
        // comes before it on the same stream, so none is on its way (a
        // SIGKILLed rank is judged at once, not after the grace).
        let waiting = |s: &Seen| {
            s.self_registered.contains(&pid)
                && !s.deregistered.contains(&pid)
                && !s.exited.contains(&pid)
        };
        if !self.seen_open || !waiting(&self.seen.borrow()) {
            return;
        }
        let mut seen = self.seen.clone();
        let wait = seen.wait_for(|s| !waiting(s));
        let _ = tokio::time::timeout(DEREGISTRATION_GRACE, wait).await;
    }

    /// The next input from the world, as far as the machine listens; None
    /// for what only changes the executor (a stream closed).
    async fn next_input(&mut self) -> Option<Input> {
        if let Some(sig) = self.deferred_signal.take() {
            return Some(Input::Signal(sig));
        }
        let deadline = self.state.deadline();
        if self.state.listen() != Listen::Everything {
            return tokio::select! {
                () = sleep_until(deadline) => Some(Input::Deadline),
                sig = self.signals.recv() => Some(Input::Signal(sig)),
            };
        }
        let ev = tokio::select! {
            Some(n) = self.exits_rx.recv() => Ev::Exit(n),
            Some(why) = self.disowned_rx.recv() => Ev::Disowned(why),
            d = self.decisions.recv(), if self.decisions_open => match d {
                Some(i) => Ev::FeedDecision(Box::new(i)),
                None => Ev::DecisionsClosed,
            },
            () = sleep_until(deadline) => Ev::Deadline,
            r = self.seen.changed(), if self.seen_open => if r.is_ok() { Ev::Seen } else { Ev::SeenClosed },
            sig = self.signals.recv() => Ev::Signal(sig),
            d = self.coord.next_remote() => Ev::Remote(d),
            () = sleep_until(self.replenish_at), if self.replenish_at.is_some() => Ev::Replenish,
            () = sleep_until(self.imports.check_at), if self.imports.check_at.is_some() => Ev::Imports,
        };
        match ev {
            Ev::Exit(n) => {
                let pid = u32::try_from(n.pid).ok();
                let failed = !n.exit.is_some_and(Exit::success);
                if failed
                    && n.traceback.is_none()
                    && let Some(p) = pid
                {
                    self.await_deregistration(p).await;
                }
                let seen = self.seen.borrow();
                let registered = pid.is_some_and(|p| seen.registered.contains_key(&p));
                let deregistered = pid.is_some_and(|p| seen.deregistered.contains(&p));
                let client = pid.is_some_and(|p| seen.self_registered.contains(&p));
                drop(seen);
                let healable = self.healable(n.rank, n.pid);
                Some(Input::WorkerExit(WorkerExit {
                    generation: n.generation,
                    rank: n.rank,
                    pid: n.pid,
                    exit: n.exit,
                    registered,
                    deregistered,
                    client,
                    traceback: n.traceback,
                    healable,
                }))
            }
            Ev::FeedDecision(inc) => decision_of(&inc).map(|mut d| {
                d.healable = self.all_declared();
                Input::FeedDecision(Box::new(d))
            }),
            Ev::DecisionsClosed => {
                self.decisions_open = false;
                None
            }
            Ev::Deadline => Some(Input::Deadline),
            Ev::Seen => {
                // The host's own notice, once: the machine stops the job
                // on it (and across hosts tells the others) before any
                // rank here left on it.
                if !self.host_notice_brought
                    && let Some(n) = self.seen.borrow().host_notice.clone()
                {
                    self.host_notice_brought = true;
                    return Some(Input::HostNotice {
                        reason: format!("notice from {}: {}", n.source, n.what),
                        step: n.step,
                        deadline: n.deadline,
                    });
                }
                // Their clients (the launcher registers every worker at its
                // spawn; what the restart's timing measures is the training
                // code back on the agent).
                let pids = self.state.unregistered_attempt()?;
                let seen = self.seen.borrow();
                pids.iter()
                    .all(|&p| u32::try_from(p).is_ok_and(|p| seen.self_registered.contains(&p)))
                    .then_some(Input::AllRegistered)
            }
            Ev::SeenClosed => {
                self.seen_open = false;
                None
            }
            Ev::Signal(sig) => Some(Input::Signal(sig)),
            Ev::Disowned(why) => Some(Input::Disowned(why)),
            Ev::Remote(Remote::NewRound {
                reason,
                keeps_place,
            }) => Some(Input::Round(Remote::NewRound {
                reason,
                // Only workers that can be healed keep their processes.
                keeps_place: keeps_place && self.all_declared(),
            })),
            Ev::Remote(d) => Some(Input::Round(d)),
            Ev::Replenish => {
                self.replenish_at = None;
                self.start_standbys();
                None
            }
            Ev::Imports => {
                self.preload_reported().await;
                None
            }
        }
    }

    /// Carries out one command.
    async fn execute(&mut self, command: Command) -> Done {
        match command {
            Command::Say(text) => self.say(text),
            Command::Publish(d) => {
                if let Err(e) = self.coord.publish(&d).await {
                    self.say(format!("could not tell the other nodes: {e}"));
                }
            }
            Command::Stop {
                kind,
                reason,
                signal,
            } => {
                self.stop_ranks(kind, &reason).await;
                let first = Signal::try_from(signal).unwrap_or(Signal::SIGTERM);
                let pids = self.stop_workers(first).await;
                return Done::Answer(Input::Stopped { pids });
            }
            Command::Notice {
                deadline,
                reason,
                step,
            } => self.notice(deadline, &reason, step).await,
            // Only ever asked for from within a stop ([`Self::stop_workers`]).
            Command::Kill { .. } => {}
            Command::Gate { pids, say_no_nvml } => {
                return Done::Answer(Input::Gated(self.gate(pids, say_no_nvml).await));
            }
            Command::LeaveJob { why } => {
                let exit_code = match self.coord.node_fault(&why).await {
                    NodeFault::Exit(code) => code,
                    NodeFault::Held {
                        exit_code,
                        why,
                        report,
                    } => {
                        self.say(why);
                        self.held_stop = Some(report);
                        exit_code
                    }
                };
                return Done::Answer(Input::NodeFault { exit_code });
            }
            Command::Observe => return Done::Answer(Input::Progress(self.observe().await)),
            Command::Reap => {
                let reaper = self.reap_attempt();
                self.reapers.push(reaper);
            }
            Command::Rendezvous { restart_count } => {
                let proposed = self.plan(restart_count);
                return Done::Answer(match self.agree(proposed).await {
                    Ok(plan) => Input::Agreed(plan),
                    Err(Halt::Coord(e)) => Input::NoRound {
                        exit_code: e.exit_code,
                        error: e.to_string(),
                        message: e.message,
                    },
                    Err(Halt::Signal(sig)) => Input::Signal(sig),
                });
            }
            Command::Start { plan, generation } => {
                return Done::Answer(self.start_attempt(plan, generation).await);
            }
            Command::Replace {
                workers,
                restart_count,
                reason,
            } => {
                return Done::Answer(self.replace_workers(workers, restart_count, &reason).await);
            }
            Command::Heal { rank, pid, reason } => {
                return Done::Answer(self.heal(rank, pid, &reason).await);
            }
            Command::HealRound { plan, reason } => {
                return Done::Answer(Input::RoundHealed(self.heal_round(&plan, &reason).await));
            }
            Command::Finish(f) => return Done::Finished(self.finish(f).await),
        }
        Done::Nothing
    }

    fn say(&self, msg: impl AsRef<str>) {
        self.console.say(msg);
    }

    /// This node's plan for attempt `restart_count`, as one host sees it
    /// (the coordinator's rendezvous may replace all but the count).
    fn plan(&self, restart_count: u32) -> AttemptPlan {
        let master_port = self.job.master_port.unwrap_or_else(|| {
            if self.job.nnodes > 1 {
                29500
            } else {
                free_port(&self.job.master_addr).unwrap_or(29500)
            }
        });
        AttemptPlan {
            restart_count,
            master_addr: self.job.master_addr.clone(),
            master_port,
            node_rank: Some(self.job.node_rank),
            nnodes: self.job.nnodes,
            world_size: self.job.nnodes.saturating_mul(self.job.nproc_per_node),
            rank_offset: self.job.node_rank.saturating_mul(self.job.nproc_per_node),
            epoch: None,
            round: None,
            ckpt_peers: Default::default(),
            keeps_place: false,
        }
    }

    /// Hands `job`'s checkpoint peers to the agent ([`agent::set_peers`],
    /// bounded per page by `agent::page_deadline`); a signal meanwhile
    /// halts the round as one during the rendezvous would.
    async fn hand_peers(
        &mut self,
        job: &str,
        peers: &crate::hosts::CkptPeers,
    ) -> Result<Result<agent::PeersTaken, String>, Halt> {
        tokio::select! {
            t = agent::set_peers(&self.client, job, peers) => Ok(t),
            sig = self.signals.recv() => Err(Halt::Signal(sig)),
        }
    }

    /// The coordinator's rendezvous, given up on a signal.
    async fn agree(&mut self, proposed: AttemptPlan) -> Result<AttemptPlan, Halt> {
        let agreed = tokio::select! {
            r = self.coord.rendezvous(proposed) => r.map_err(Halt::Coord),
            sig = self.signals.recv() => Err(Halt::Signal(sig)),
        };
        if let Ok(plan) = &agreed
            && *self.peers_tx.borrow() != plan.ckpt_peers
        {
            // Before the round's workers start: their first restore asks
            // the round's other agents.
            let names: Vec<String> = plan
                .ckpt_peers
                .others
                .iter()
                .map(|(h, p)| format!("{h} ({})", p.addr))
                .collect();
            match self.hand_peers(&self.job.id.clone(), &plan.ckpt_peers).await? {
                Ok(taken) => {
                    if !names.is_empty() {
                        self.say(format!(
                            "checkpoint peers of this round: {}; this host's replicas go to {} ({}{}{})",
                            crate::coord::round::named_briefly(&names),
                            if taken.targets.is_empty() { "none (no peer outside this host's failure domain)".to_owned() } else { taken.targets.join(", ") },
                            if plan.ckpt_peers.ring_by_place {
                                "ring by node-rank order"
                            } else {
                                "ring by address: the round does not say every agent takes the ring by node-rank order (an older agent, or a round an older launcher wrote)"
                            },
                            match plan.ckpt_peers.replicas {
                                0 => String::new(),
                                n => format!("; each agent takes the first {n} of an origin's targets, the most checkpoint.replicas of the round's agents"),
                            },
                            match plan.ckpt_peers.window {
                                0 => String::new(),
                                w => format!(", all within {w} place{} of it", if w == 1 { "" } else { "s" }),
                            }
                        ));
                    }
                    if !taken.warning.is_empty() {
                        self.say(format!("the agent warns: {}", taken.warning));
                    }
                }
                Err(e) => self.say(format!(
                    "the agent did not take this round's checkpoint peers ({e}); asked again every 10 s"
                )),
            }
            self.peers_tx.send_replace(plan.ckpt_peers.clone());
            // The compilation cache's blobs are a job of their own: the
            // round's agents hold them too, and a host whose folder is
            // still empty (a spare, a replacement) looks there before its
            // workers compile, at the first round that names peers only.
            if let Some(share) = self.job.compile_share.clone()
                && !plan.ckpt_peers.is_empty()
            {
                if let Err(e) = self.hand_peers(share.job(), &plan.ckpt_peers).await? {
                    tracing::debug!(job = share.job(), error = %e, "launcher: the agent did not take the cache's checkpoint peers");
                }
                if share.first_round_restore() {
                    crate::cache_share::restore_and_say(&share, &self.console, true).await;
                }
            }
        }
        agreed
    }

    /// Starts the plan's workers (none for a standby attempt); answers what
    /// started.
    async fn start_attempt(&mut self, plan: AttemptPlan, generation: u64) -> Input {
        let n = plan.restart_count;
        if let Some(round) = &plan.round {
            self.say(round);
        }
        let at = Instant::now();
        let wall = SystemTime::now();
        let Some(node_rank) = plan.node_rank else {
            self.workers = Vec::new();
            self.attempt_env = None;
            self.say("no place in this round: no workers on this host until a round gives it one");
            self.round_store_for_a_spare(&plan);
            self.standbys_for_a_spare(&plan);
            return Input::Started(Box::new(Started {
                plan,
                workers: Vec::new(),
                at,
                wall,
                error: None,
            }));
        };
        // A fresh attempt's workers take the round from their environment;
        // a round file of an earlier attempt would name an older round.
        let _ = std::fs::remove_file(heal_ready::round_file(&self.job.log_root.join("heal")));
        let logs = match self.job.logs.attempt(n) {
            Ok(l) => std::sync::Arc::new(l),
            Err(e) => {
                return Input::StartFailed(format!("the attempt's log directory: {e}"));
            }
        };
        let dir = logs.path().to_owned();
        let wenv = WorkerEnv {
            job_id: self.job.id.clone(),
            nproc_per_node: self.job.nproc_per_node,
            nnodes: plan.nnodes,
            node_rank,
            rank_offset: plan.rank_offset,
            world_size: plan.world_size,
            epoch: plan.epoch,
            role: self.job.role.clone(),
            master_addr: plan.master_addr.clone(),
            master_port: plan.master_port,
            restart_count: n,
            max_restarts: self.job.max_restarts.unwrap_or(self.job.fallback_budget),
            socket: self.socket.clone(),
            attempt_dir: dir.clone(),
            launcher_pid: std::process::id(),
        };
        self.workers = Vec::new();
        let mut error = None;
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_default();
        let at_env = AttemptEnv {
            wenv: wenv.clone(),
            logs,
            host,
            generation,
        };
        let first = self.attempts_started == 0;
        self.attempts_started += 1;
        if let Some(share) = &self.job.compile_share {
            share.started(u64::from(n), &self.console);
        }
        if self.job.jax {
            // A free port for each attempt where MASTER_PORT is one too: a
            // restarted `initialize()` never meets the last coordinator.
            let free = (self.job.master_port.is_none() && self.job.nnodes <= 1)
                .then(|| free_port(&plan.master_addr))
                .flatten();
            let port = crate::jax::coordinator_port(plan.master_port, free);
            self.jax_port = Some((plan.master_port, port));
        }
        for local in 0..self.job.nproc_per_node {
            let rank = wenv.global_rank(local);
            let env = self.worker_env(&wenv, local, rank);
            if first {
                self.standby_env = env
                    .iter()
                    .filter(|(k, _)| STANDBY_ENV.contains(&k.as_str()))
                    .cloned()
                    .collect();
            }
            let warm = self.warm_worker(local, rank, &env).await;
            let started = match warm {
                Some(s) => Ok(s),
                None => spawn::spawn(&self.job.argv, &env, &self.job.cwd),
            };
            let s = match started {
                Ok(s) => s,
                Err(e) => {
                    for w in &self.workers {
                        spawn::signal_group(w.pid, Signal::SIGKILL);
                    }
                    error = Some(e.to_string());
                    break;
                }
            };
            self.watch_worker(s, &at_env, local, &env);
        }
        self.attempt_env = Some(at_env);
        if error.is_none() {
            let pids: Vec<String> = self.workers.iter().map(|w| w.pid.to_string()).collect();
            let jax = match self.jax_port {
                Some((_, port)) if self.job.jax => format!(
                    "; JAX coordinator {}",
                    crate::jax::coordinator_address(&plan.master_addr, port)
                ),
                _ => String::new(),
            };
            self.say(format!(
                "attempt {n}: started {} worker{} (pids {}; MASTER_PORT {}{jax}; logs {})",
                self.job.nproc_per_node,
                if self.job.nproc_per_node == 1 {
                    ""
                } else {
                    "s"
                },
                pids.join(" "),
                plan.master_port,
                dir.display()
            ));
            if first {
                // Alongside the first attempt: ready for its first restart.
                self.start_standbys();
            } else if self.job.standby.is_some() {
                self.replenish_at = Some(Instant::now() + STANDBY_REPLENISH_AFTER);
            }
            if self.job.standby.is_some() {
                self.imports.schedule(0);
            }
        }
        // After the workers started (they retry their connection to it
        // meanwhile), in the background: the first round's answer waits for
        // torch's import in the store process. Not the attempt's failure: a
        // command whose interpreter has no torch uses no `warden.heal`
        // group (and no store); one that does finds no store, fails and
        // restarts in job.
        if error.is_none()
            && let Some(why) = self.host_round_store(&plan, false).await
        {
            self.say(format!(
                "round store: not hosted ({why}); ranks using warden.heal cannot meet in this round"
            ));
        }
        Input::Started(Box::new(Started {
            workers: self.workers.iter().map(|w| (w.rank, w.pid)).collect(),
            plan,
            at,
            wall,
            error,
        }))
    }

    /// Takes a started worker (local slot `local` of the attempt `at`, its
    /// environment `env`) into the attempt: its output pumps, its
    /// registration with the agent on its behalf, its traceback reports,
    /// and its exit watch (exits tagged with the attempt's generation).
    fn watch_worker(
        &mut self,
        mut s: spawn::Spawned,
        at: &AttemptEnv,
        local: u32,
        env: &[(String, String)],
    ) {
        let rank = at.wenv.global_rank(local);
        let generation = at.generation;
        let mut pumps = Vec::new();
        let flags = &self.job.torchrun;
        let prefix = flags.prefix(&self.job.role, local, rank, &at.host);
        let copies = |stream| output::Copies {
            prefix: prefix.clone(),
            console: flags
                .on_console(local, stream)
                .then(|| self.console.clone()),
            duplicate: {
                let filters = flags.duplicate_filters(stream);
                if filters.is_empty() {
                    None
                } else {
                    match at.logs.filtered(stream) {
                        Ok(f) => Some((f, filters)),
                        Err(e) => {
                            self.console.say(format!(
                                "rank {rank}: not writing filtered_{}.log: {e}",
                                stream.as_str()
                            ));
                            None
                        }
                    }
                }
            },
        };
        let log = |stream| match at.logs.create(rank, stream) {
            Ok(f) => Some(f),
            Err(e) => {
                self.console.say(format!(
                    "rank {rank}: not writing its {} log: {e}; this output goes to the console only",
                    stream.as_str()
                ));
                None
            }
        };
        if let Some(out) = s.stdout.take() {
            pumps.push(tokio::spawn(output::pump(
                out,
                Stream::Stdout,
                copies(Stream::Stdout),
                log(Stream::Stdout),
                None,
            )));
        }
        let (sink, tracebacks) = watch::channel(None);
        let (stderr_done_tx, stderr_done) = tokio::sync::oneshot::channel::<()>();
        if let Some(err) = s.stderr.take() {
            let pump = output::pump(
                err,
                Stream::Stderr,
                copies(Stream::Stderr),
                log(Stream::Stderr),
                Some(sink.clone()),
            );
            pumps.push(tokio::spawn(async move {
                pump.await;
                let _ = stderr_done_tx.send(());
            }));
        }
        let tx = self.exits_tx.clone();
        let pid = s.pid;
        let pidfd = s.pidfd;
        let id = zero_code::WorkerId {
            job: self.job.id.clone(),
            rank,
            local_rank: local,
            world_size: at.wenv.world_size,
            pid: u32::try_from(pid).unwrap_or(0),
            host: at.host.clone(),
            devices: zero_code::WorkerId::devices_of(env, local),
        };
        let client = self.client.clone();
        let console = self.console.clone();
        let disowned = self.disowned_tx.clone();
        tokio::spawn(zero_code::report_tracebacks(
            client.clone(),
            id.clone(),
            tracebacks.clone(),
            self.seen.clone(),
            console.clone(),
        ));
        tokio::spawn(async move {
            // Registered on its behalf at once: a worker that never
            // imports warden is still watched (zero-code mode); one
            // that does registers again itself, seconds later, and its
            // client's registration takes over.
            match zero_code::register(&client, &id).await {
                Ok(()) => {}
                // Another user owns the job at the agent now (ClaimJob
                // says so): the job stops rather than run on, unwatched.
                Err(e)
                    if e.code() == tonic::Code::PermissionDenied
                        && let Some(owner) = agent::owned_by_another(&client, &id.job).await =>
                {
                    let _ = disowned.send(format!(
                        "registering rank {rank} (pid {pid}) was refused: {}; {owner}",
                        e.message()
                    ));
                }
                Err(e) => console.say(format!(
                    "could not register rank {rank} (pid {pid}) with the agent: {}; it is watched by the launcher only",
                    e.message()
                )),
            }
            let exit = spawn::exited(pid, &pidfd).await;
            // What its stderr said last, once the pipe closed (the
            // process and what inherited the pipe are gone).
            if !exit.is_some_and(Exit::success) {
                let _ = tokio::time::timeout(STDERR_DRAIN, stderr_done).await;
            }
            let traceback = tracebacks
                .borrow()
                .as_ref()
                .map(|t| t.exception_type.clone());
            let _ = tx.send(ExitNote {
                generation,
                rank,
                pid,
                exit,
                traceback,
            });
        });
        self.workers.push(Worker { rank, pid, pumps });
    }

    /// Local worker `local` (global rank `rank`, environment `env`) made
    /// out of a standby interpreter of the pool ([`standby::pick_slot`]:
    /// its own slot's when ready, else another ready one, so that a pool
    /// smaller than the workers (`--standbys`), or a slot not refilled yet,
    /// still gives a warm start); None (said on the console when standbys
    /// are kept) to start it cold.
    async fn warm_worker(
        &mut self,
        local: u32,
        rank: u32,
        env: &[(String, String)],
    ) -> Option<spawn::Spawned> {
        let plan = self.job.standby.clone()?;
        let slots: Vec<Option<bool>> = self
            .standbys
            .iter_mut()
            .map(|s| s.as_mut().map(Standby::is_ready))
            .collect();
        let Some(slot) = standby::pick_slot(&slots, local as usize) else {
            self.say(format!(
                "rank {rank}: no standby left in the pool of {}; starting it cold",
                slots.len()
            ));
            return None;
        };
        let mut sb = self.standbys.get_mut(slot)?.take()?;
        let (pid, age) = (sb.pid(), sb.age());
        // A signal during the wait is the machine's, once the attempt
        // started (it then stops it); the rest of the slots wait no more.
        let mut ready = sb.wait_ready(Duration::ZERO).await;
        if matches!(ready, Err(standby::NotPromoted::NotReady(_))) && self.deferred_signal.is_none()
        {
            self.say(format!(
                "rank {rank}: standby pid {pid} is still importing; waiting for it up to {}",
                humantime::format_duration(STANDBY_READY_WAIT)
            ));
            ready = tokio::select! {
                r = sb.wait_ready(STANDBY_READY_WAIT) => r,
                sig = self.signals.recv() => {
                    self.deferred_signal = Some(sig);
                    Err(standby::NotPromoted::Interrupted)
                }
            };
        }
        let promoted = match ready {
            Ok(()) => {
                sb.promote(&plan.entry, env, &self.job.cwd, Duration::ZERO)
                    .await
            }
            Err(e) => {
                self.reapers.push(sb.discard());
                Err(e)
            }
        };
        match promoted {
            Ok(s) => {
                self.say(format!(
                    "rank {rank}: warm start from standby pid {pid} (started {:.1}s ago)",
                    age.as_secs_f64()
                ));
                Some(s)
            }
            Err(why) => {
                self.say(format!(
                    "rank {rank}: standby pid {pid} {why}; starting it cold"
                ));
                None
            }
        }
    }

    /// Local worker `local`'s (global rank `rank`) environment: the
    /// launcher's variables, and with standbys kept, the file its client
    /// reports its imports to.
    fn worker_env(&self, wenv: &WorkerEnv, local: u32, rank: u32) -> Vec<(String, String)> {
        let mut env = wenv.for_rank(local, |k| std::env::var(k).ok());
        if self.job.jax {
            let port = match self.jax_port {
                Some((master, port)) if master == wenv.master_port => port,
                _ => crate::jax::coordinator_port(wenv.master_port, None),
            };
            env.extend(crate::jax::env(wenv, local, port, |k| {
                std::env::var(k).ok()
            }));
        }
        if let Some(cache) = &self.job.compile_cache {
            env.extend(cache.env(|k| std::env::var(k).ok()));
        }
        let heal = self.job.log_root.join("heal");
        if std::fs::create_dir_all(&heal).is_ok() {
            let file = heal_ready::file_for(&heal, rank);
            env.push((
                heal_ready::ENV.to_owned(),
                file.to_string_lossy().into_owned(),
            ));
            if wenv.epoch.is_some() {
                env.push((
                    heal_ready::ROUND_ENV.to_owned(),
                    heal_ready::round_file(&heal).to_string_lossy().into_owned(),
                ));
                if let Some(port) = self.round_store_port(wenv.master_port) {
                    env.push((crate::round_store::PORT_ENV.to_owned(), port.to_string()));
                }
            }
        }
        if let Some(wait) = self.job.heal_peer_wait {
            env.push((
                heal_ready::PEER_WAIT_ENV.to_owned(),
                format!("{:.1}", wait.as_secs_f64()),
            ));
        }
        if self.job.standby.is_some() {
            let dir = self.job.log_root.join("imports");
            if std::fs::create_dir_all(&dir).is_ok() {
                let file = reported_imports::file_for(&dir, rank);
                env.push((
                    reported_imports::ENV.to_owned(),
                    file.to_string_lossy().into_owned(),
                ));
            }
        }
        env
    }

    /// Reads what the workers reported importing and has the standbys
    /// (those waiting now and those started later) import what they do not
    /// have yet; schedules the next read.
    async fn preload_reported(&mut self) {
        self.imports.schedule(self.imports.next);
        let Some(plan) = self.job.standby.as_mut() else {
            return;
        };
        let reported = reported_imports::read(&self.job.log_root.join("imports"));
        let new: Vec<String> = reported
            .into_iter()
            .filter(|n| {
                !self.imports.sent.contains(n) && !standby::DEFAULT_PRELOAD.contains(&n.as_str())
            })
            .take(reported_imports::MAX_NAMES.saturating_sub(self.imports.sent.len()))
            .collect();
        if new.is_empty() {
            return;
        }
        let spec = new
            .iter()
            .map(|n| format!("{n}?"))
            .collect::<Vec<_>>()
            .join(",");
        plan.preload = format!("{},{spec}", plan.preload);
        self.imports.sent.extend(new.iter().cloned());
        for sb in self.standbys.iter_mut().flatten() {
            // A dead standby's promotion fails and starts its rank cold.
            let _ = sb.preload_more(&spec).await;
        }
        self.say(format!(
            "standbys also preload what the workers imported (their clients' report): {}",
            new.join(", ")
        ));
    }

    /// A host with no place in the round yet (a spare) starts its standby
    /// interpreters now: its first workers are most likely a lost host's
    /// replacements, whose peers wait for them (a heal across hosts), so
    /// they start warm rather than import torch on the heal's path. Only
    /// before any attempt of its own had workers (later standbys follow
    /// the workers' attempts as before).
    fn standbys_for_a_spare(&mut self, plan: &AttemptPlan) {
        if self.attempts_started > 0 || self.job.standby.is_none() {
            return;
        }
        let wenv = WorkerEnv {
            job_id: self.job.id.clone(),
            nproc_per_node: self.job.nproc_per_node,
            nnodes: plan.nnodes.max(1),
            node_rank: 0,
            rank_offset: 0,
            world_size: plan.world_size.max(self.job.nproc_per_node),
            epoch: plan.epoch,
            role: self.job.role.clone(),
            master_addr: plan.master_addr.clone(),
            master_port: plan.master_port,
            restart_count: 0,
            max_restarts: self.job.max_restarts.unwrap_or(self.job.fallback_budget),
            socket: self.socket.clone(),
            attempt_dir: self.job.log_root.clone(),
            launcher_pid: std::process::id(),
        };
        self.standby_env = self
            .worker_env(&wenv, 0, 0)
            .into_iter()
            .filter(|(k, _)| STANDBY_ENV.contains(&k.as_str()))
            .collect();
        self.start_standbys();
    }

    /// Starts a standby interpreter for every slot of the pool without one
    /// ([`StandbyPlan::pool_size`](standby::StandbyPlan::pool_size)).
    fn start_standbys(&mut self) {
        let Some(plan) = self.job.standby.clone() else {
            return;
        };
        let n = plan.pool_size(self.job.nproc_per_node);
        self.standbys.resize_with(n, || None);
        let mut pids = Vec::new();
        for slot in &mut self.standbys {
            if slot.is_some() {
                continue;
            }
            match Standby::start(&plan.entry, &plan.preload, &self.standby_env, &self.job.cwd) {
                Ok(sb) => {
                    pids.push(sb.pid().to_string());
                    *slot = Some(sb);
                }
                Err(e) => {
                    self.console.say(format!(
                        "cannot start a standby interpreter: {e}; restarts start cold"
                    ));
                    break;
                }
            }
        }
        if !pids.is_empty() {
            self.say(format!(
                "standby interpreters for warm restarts: pids {} (preloading {})",
                pids.join(" "),
                plan.preload
            ));
        }
    }

    /// The GPU release wait for the stopped `pids`, then the health gate.
    async fn gate(&mut self, pids: Vec<u32>, say_no_nvml: bool) -> GateVerdict {
        let release = if pids.is_empty() {
            GpuRelease::Released(Duration::ZERO)
        } else {
            gate::gpu_release(
                pids,
                self.job.gpu_release_timeout,
                self.nvml_library.clone(),
            )
            .await
        };
        match release {
            GpuRelease::Released(_) => {}
            GpuRelease::NoNvml(why) => {
                if say_no_nvml {
                    self.say(format!("GPU release wait skipped: {why}"));
                }
            }
            GpuRelease::TimedOut(pids) => self.say(format!(
                "GPUs still list stopped pids {pids:?} after {}; starting anyway",
                humantime::format_duration(self.job.gpu_release_timeout)
            )),
        }
        match gate::health_gate(&mut self.client, &self.job.id).await {
            GateResult::Pass => GateVerdict::Pass,
            GateResult::Unchecked(why) => GateVerdict::Unchecked(why),
            GateResult::Refused(why) => GateVerdict::Refused(why),
        }
    }

    /// How far the job got, as the agent shows it now: the newest complete
    /// checkpoint step in its tier, and the step the current attempt's
    /// ranks resumed from (their step less the steps they completed since
    /// they registered; the highest over the attempt's workers). Each ask
    /// is bounded by [`OBSERVE_TIMEOUT`]; what did not answer is noted.
    async fn observe(&mut self) -> Progress {
        let mut p = Progress::default();
        let mut notes = Vec::new();
        // The steps' counts alone: every shard of a large job is megabytes,
        // past the client's receive limit (an older agent lists them all).
        let list = pb::ListCheckpointsRequest {
            job_id: self.job.id.clone(),
            detail: pb::ListDetail::Summary.into(),
            ranks: Vec::new(),
        };
        match tokio::time::timeout(OBSERVE_TIMEOUT, self.client.list_checkpoints(list)).await {
            Ok(Ok(r)) => {
                let (checkpoint, unknown) = newest_complete(&self.job.id, &r.into_inner());
                (p.checkpoint, p.listed) = (checkpoint, unknown.is_none());
                notes.extend(unknown);
            }
            Ok(Err(e)) => notes.push(format!("ListCheckpoints: {}", e.message())),
            Err(_) => notes.push("ListCheckpoints timed out".to_owned()),
        }
        let ranks = pb::GetRanksRequest {
            job_id: self.job.id.clone(),
        };
        match tokio::time::timeout(OBSERVE_TIMEOUT, self.client.get_ranks(ranks)).await {
            Ok(Ok(r)) => {
                let pids: HashSet<u32> = self
                    .workers
                    .iter()
                    .filter_map(|w| u32::try_from(w.pid).ok())
                    .collect();
                p.resumed_from = r
                    .into_inner()
                    .ranks
                    .iter()
                    .filter(|r| pids.contains(&r.pid) && r.steps_completed > 0)
                    .map(|r| r.step.saturating_sub(r.steps_completed))
                    .max();
            }
            Ok(Err(e)) => notes.push(format!("GetRanks: {}", e.message())),
            Err(_) => notes.push("GetRanks timed out".to_owned()),
        }
        p.note = notes.join("; ");
        p
    }

    /// Tells the agent the job's ranks are being stopped on purpose.
    async fn stop_ranks(&mut self, kind: StopKind, reason: &str) {
        let ranks = self.workers.iter().map(|w| w.rank).collect();
        self.stop_ranks_of(kind, reason, ranks).await;
    }

    /// Tells the agent of a notice for the job (StopRanks, kind PREEMPTED,
    /// with the deadline): it sets the notice in every rank's slot, and the
    /// ranks' exits are planned stops. An agent that cannot be told leaves
    /// the workers unwarned: said, and the window's end stops them.
    ///
    /// Across hosts, every host's ranks must save the same step: this
    /// host's own notice (`step` None) asks the agent for a step far enough
    /// ahead ([`NOTICE_LEAD`]) for the others to be told, publishes it in
    /// etcd, and, when another host published first, tells the agent that
    /// host's step instead; another host's notice (`step` Some) is told to
    /// the agent as is.
    async fn notice(&mut self, deadline: SystemTime, reason: &str, step: Option<u64>) {
        self.notice_deadline = Some(deadline);
        let ms = deadline
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let across = self.coord.name() != LocalOnly.name();
        let lead = if across && step.is_none() {
            let window = deadline
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            NOTICE_LEAD.min(window / 4)
        } else {
            Duration::ZERO
        };
        let named = self.tell_notice(ms, reason, step, lead).await;
        if !across || step.is_some() {
            return;
        }
        let Some(named) = named else {
            self.say(
                "the agent named no step for the notice (no rank of the job on it yet, or an agent from before notices across hosts): the other hosts are not told",
            );
            return;
        };
        match self.coord.publish_notice(named, deadline, reason).await {
            Ok(agreed) if agreed == named => self.say(format!(
                "told the job's other hosts of the notice: every rank saves at step {named}"
            )),
            Ok(agreed) => {
                self.say(format!(
                    "another host published a notice first: every rank saves at its step {agreed} (not {named})"
                ));
                self.tell_notice(ms, reason, Some(agreed), Duration::ZERO)
                    .await;
            }
            Err(e) => self.say(format!(
                "could not tell the job's other hosts of the notice ({e}): this host's ranks save at step {named}"
            )),
        }
    }

    /// StopRanks, kind PREEMPTED, for every worker: the step they save at,
    /// as the agent says it (None: it did not, or was not reached).
    async fn tell_notice(
        &mut self,
        deadline_ms: u64,
        reason: &str,
        step: Option<u64>,
        lead: Duration,
    ) -> Option<u64> {
        let req = pb::StopRanksRequest {
            job_id: self.job.id.clone(),
            reason: format!("notice: {reason}"),
            ranks: self.workers.iter().map(|w| w.rank).collect(),
            kind: pb::StopKind::Preempted as i32,
            notice_deadline_unix_ms: deadline_ms,
            notice_save_at_step: step,
            notice_lead_ms: u32::try_from(lead.as_millis()).unwrap_or(u32::MAX),
        };
        match tokio::time::timeout(STOP_RANKS_TIMEOUT, self.client.stop_ranks(req)).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                if r.notice_save_at_step.is_some() {
                    self.notice_step = r.notice_save_at_step;
                }
                self.say(format!(
                    "the agent told rank{} {} of the notice{}",
                    if r.ranks.len() == 1 { "" } else { "s" },
                    r.ranks
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    r.notice_save_at_step
                        .map_or(String::new(), |s| format!(": they save at step {s}"))
                ));
                r.notice_save_at_step
            }
            Ok(Err(e)) => {
                self.say(format!(
                    "the agent could not be told of the notice ({}): the workers are stopped at the window's end without a save",
                    e.message()
                ));
                None
            }
            Err(_) => {
                self.say(
                    "the agent did not answer the notice in time: the workers are stopped at the window's end without a save",
                );
                None
            }
        }
    }

    /// Tells the agent these ranks are being stopped on purpose.
    async fn stop_ranks_of(&mut self, kind: StopKind, reason: &str, ranks: Vec<u32>) {
        let kind = match kind {
            StopKind::Restart => pb::StopKind::Restart,
            StopKind::JobEnding => pb::StopKind::JobEnding,
            StopKind::LauncherSignalled => pb::StopKind::LauncherSignalled,
            StopKind::Preempted => pb::StopKind::Preempted,
        };
        let req = pb::StopRanksRequest {
            job_id: self.job.id.clone(),
            reason: reason.to_owned(),
            ranks,
            kind: kind as i32,
            notice_deadline_unix_ms: 0,
            notice_save_at_step: None,
            notice_lead_ms: 0,
        };
        match tokio::time::timeout(STOP_RANKS_TIMEOUT, self.client.stop_ranks(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => self.say(format!(
                "StopRanks failed ({}): the agent may report the stopped workers as failures",
                e.message()
            )),
            Err(_) => self
                .say("StopRanks timed out: the agent may report the stopped workers as failures"),
        }
    }

    /// Replaces `workers` (global rank, pid) of the running attempt: StopRanks
    /// for them alone (their exits are then no incidents, and the agent's
    /// in-process restart counts them as handled), SIGKILL to each one's
    /// process group (a stopped process takes it; its closed sockets wake
    /// peers blocked in a collective with it), a wait for each to exit, a
    /// background reap once the agent reported it, then each rank started
    /// again in the same attempt, warm from a standby of the pool when
    /// there is one, with `WARDEN_IN_PROCESS_RESTART_COUNT` so that it joins the
    /// attempt its peers make. The other workers are not touched.
    async fn replace_workers(
        &mut self,
        workers: Vec<(u32, i32)>,
        restart_count: u32,
        reason: &str,
    ) -> Input {
        let Some(at) = self.attempt_env.clone() else {
            return replaced(Vec::new(), Some("no attempt is running".into()));
        };
        let ranks: Vec<u32> = workers.iter().map(|w| w.0).collect();
        // A replacement runs the script its predecessor ran: one that had
        // declared its state counts as declared before it does again (a
        // heal's, and one that replaces a frozen rank the agent handed
        // over in the middle of a heal), so that a survivor leaving blocked
        // meanwhile is healed too, not restarted from the checkpoint.
        let declared: HashSet<u32> = workers
            .iter()
            .filter(|&&(rank, pid)| self.has_declared(rank, pid))
            .map(|w| w.0)
            .collect();
        self.stop_ranks_of(StopKind::Restart, reason, ranks).await;
        for &(_, pid) in &workers {
            spawn::signal_group(pid, Signal::SIGKILL);
            spawn::signal_pid(pid, Signal::SIGKILL);
        }
        let pids: Vec<i32> = workers.iter().map(|w| w.1).collect();
        let deadline = Instant::now() + KILL_WAIT;
        let mut poll = Duration::from_millis(1);
        loop {
            let alive: Vec<i32> = pids
                .iter()
                .copied()
                .filter(|&p| procfs_state(p).is_some_and(|s| s != 'Z' && s != 'X'))
                .collect();
            if alive.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return replaced(
                    Vec::new(),
                    Some(format!(
                        "pids {alive:?} survive SIGKILL after {}",
                        humantime::format_duration(KILL_WAIT)
                    )),
                );
            }
            tokio::time::sleep(poll).await;
            poll = (poll * 2).min(Duration::from_millis(20));
        }
        // Their zombies wait for the agent's report, off this path.
        let mut old = Vec::new();
        self.workers.retain_mut(|w| {
            if pids.contains(&w.pid) {
                old.push(w.pid);
                false
            } else {
                true
            }
        });
        self.reapers.push(self.reap_pids(old));
        let mut started = Vec::new();
        let mut warm_used = false;
        for (rank, _) in workers {
            let Some(local) = rank
                .checked_sub(at.wenv.rank_offset)
                .filter(|l| *l < self.job.nproc_per_node)
            else {
                return replaced(
                    started,
                    Some(format!("rank {rank} is not one of this host's")),
                );
            };
            let mut env = self.worker_env(&at.wenv, local, rank);
            env.push((
                "WARDEN_IN_PROCESS_RESTART_COUNT".into(),
                restart_count.to_string(),
            ));
            let warm = self.warm_worker(local, rank, &env).await;
            warm_used |= warm.is_some();
            let s = match warm {
                Some(s) => s,
                None => match spawn::spawn(&self.job.argv, &env, &self.job.cwd) {
                    Ok(s) => s,
                    Err(e) => {
                        return replaced(started, Some(format!("rank {rank}: {e}")));
                    }
                },
            };
            let pid = s.pid;
            self.watch_worker(s, &at, local, &env);
            self.say(format!(
                "rank {rank}: started again as pid {pid} (in-process restart {restart_count})"
            ));
            if declared.contains(&rank) {
                self.healed_pids.insert(pid);
            }
            started.push((rank, pid));
        }
        if warm_used {
            self.replenish_at = Some(Instant::now() + STANDBY_REPLENISH_AFTER);
        }
        replaced(started, None)
    }

    /// Whether rank `rank` (process `pid`, just gone) and every other live
    /// worker declared a healable state ([`heal_ready`]).
    fn healable(&self, rank: u32, pid: i32) -> bool {
        self.has_declared(rank, pid)
            && self
                .workers
                .iter()
                .filter(|w| w.pid != pid)
                .filter(|w| procfs_state(w.pid).is_some_and(|s| s != 'Z' && s != 'X'))
                .all(|w| self.has_declared(w.rank, w.pid))
    }

    /// Whether worker `pid` of `rank` declared a healable state
    /// ([`heal_ready`]), or counts as declared: a replacement of one that
    /// had runs the script that declared, and may not have got that far
    /// yet when the next fault comes.
    fn has_declared(&self, rank: u32, pid: i32) -> bool {
        self.healed_pids.contains(&pid)
            || heal_ready::declared(&self.job.log_root.join("heal"), rank, pid)
    }

    /// Whether every worker of the attempt declared a healable state
    /// ([`heal_ready`]) and runs.
    fn all_declared(&self) -> bool {
        !self.workers.is_empty()
            && self.workers.iter().all(|w| {
                procfs_state(w.pid).is_some_and(|s| s != 'Z' && s != 'X')
                    && self.has_declared(w.rank, w.pid)
            })
    }

    /// The round store's port for a round at `master_port`, when node rank
    /// 0's launcher hosts it ([`Job::round_store_python`]); the same on
    /// every host, so every rank finds it.
    fn round_store_port(&self, master_port: u16) -> Option<u16> {
        // A JAX job meets through jax.distributed, not torch's store.
        if self.job.jax {
            return None;
        }
        self.job.round_store_python.as_ref()?;
        crate::round_store::port_for(master_port)
    }

    /// A host with no place in the round (a spare) starts its store process
    /// now, serving nothing: if it takes a lost node rank 0's place, its
    /// launcher hosts the new round's store, and the replacements' peers
    /// wait for it; started now, torch is imported before that, not on
    /// the heal's path.
    fn round_store_for_a_spare(&mut self, plan: &AttemptPlan) {
        let Some(python) = self.job.round_store_python.clone() else {
            return;
        };
        if self.round_store.is_some()
            || self.job.jax
            || self.round_store_port(plan.master_port).is_none()
        {
            return;
        }
        match crate::round_store::RoundStore::start(&python, &self.job.cwd) {
            Ok(s) => self.round_store = Some(std::sync::Arc::new(tokio::sync::Mutex::new(s))),
            Err(e) => self.say(format!("round store: not started ({e})")),
        }
    }

    /// Hosts the round's store when this host is node rank 0 of `plan`'s
    /// round across hosts (started at the first such round, its process
    /// kept for the next); a host that is not lets its store go. With
    /// `wait`, None once it serves, else why not; without, the store opens
    /// in the background (its first answer waits for torch's import) and
    /// the console says how it went, and None.
    async fn host_round_store(&mut self, plan: &AttemptPlan, wait: bool) -> Option<String> {
        let (Some(python), Some(port), Some(_)) = (
            self.job.round_store_python.clone(),
            self.round_store_port(plan.master_port),
            plan.epoch,
        ) else {
            return None;
        };
        if plan.node_rank != Some(0) {
            self.round_store = None;
            return None;
        }
        if let Some(s) = &self.round_store
            && s.try_lock().is_ok_and(|s| s.is_broken())
        {
            self.round_store = None;
        }
        let store = match &self.round_store {
            Some(s) => s.clone(),
            None => match crate::round_store::RoundStore::start(&python, &self.job.cwd) {
                Ok(s) => {
                    let s = std::sync::Arc::new(tokio::sync::Mutex::new(s));
                    self.round_store = Some(s.clone());
                    s
                }
                Err(e) => return Some(e.to_string()),
            },
        };
        let addr = plan.master_addr.clone();
        let console = self.console.clone();
        let open = async move {
            let mut store = store.lock().await;
            let pid = store.pid();
            let done = store.serve(port, &addr).await;
            match &done {
                Ok(()) => console.say(format!(
                    "round store: this host (node rank 0) hosts the round's store at port {port} (pid {pid}): it outlives any worker"
                )),
                Err(e) => console.say(format!(
                    "round store: not hosted at port {port} ({e}); ranks using warden.heal cannot meet in this round"
                )),
            }
            done.err().map(|e| e.to_string())
        };
        if wait {
            open.await
        } else {
            // Each waits for the one before it (the store's lock): none is
            // cut off mid-order, which would leave an answer unread.
            self.round_store_open.retain(|t| !t.is_finished());
            self.round_store_open.push(tokio::spawn(async move {
                open.await;
            }));
            None
        }
    }

    /// Heals the running workers into a new round across hosts that keeps
    /// this host's place: the round goes to their round file
    /// ([`heal_ready::write_round`]: `warden.heal` makes the next attempt's
    /// process group on the round's store with it), the attempt's
    /// environment takes the round (for later replacements), and the agent
    /// asks them to restart in process. None when asked; else why not.
    async fn heal_round(&mut self, plan: &AttemptPlan, reason: &str) -> Option<String> {
        let Some(epoch) = plan.epoch else {
            return Some("the plan has no round".into());
        };
        let round = heal_ready::HealRound {
            epoch,
            master_addr: plan.master_addr.clone(),
            master_port: plan.master_port,
            world_size: plan.world_size,
            nnodes: plan.nnodes,
            store_port: self.round_store_port(plan.master_port),
        };
        if let Some(why) = self.host_round_store(plan, true).await {
            return Some(why);
        }
        let file = heal_ready::round_file(&self.job.log_root.join("heal"));
        if let Err(e) = heal_ready::write_round(&file, &round) {
            return Some(format!("writing {}: {e}", file.display()));
        }
        if let Some(at) = self.attempt_env.as_mut() {
            at.wenv.epoch = plan.epoch;
            at.wenv.master_addr.clone_from(&plan.master_addr);
            at.wenv.master_port = plan.master_port;
        }
        if let Some(round) = &plan.round {
            self.say(round);
        }
        let req = pb::RequestRestartRequest {
            job_id: self.job.id.clone(),
            reason: reason.to_owned(),
            incident_id: String::new(),
            replacing: false,
        };
        match tokio::time::timeout(STOP_RANKS_TIMEOUT, self.client.request_restart(req)).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(format!(
                "the agent refused the in-process restart: {}",
                e.message()
            )),
            Err(_) => Some("the agent did not answer the in-process restart".into()),
        }
    }

    /// Heals `rank` (its process `pid` gone): the agent asks the job's live
    /// ranks to restart in process (they keep their state), then the rank
    /// starts again at that request's count, warm from its standby when
    /// there is one, and takes its state from a live replica. Where it was
    /// this host's only rank (its replicas on other hosts) the agent has
    /// no rank to ask and records the restart (`replacing`).
    async fn heal(&mut self, rank: u32, pid: i32, reason: &str) -> Input {
        let req = pb::RequestRestartRequest {
            job_id: self.job.id.clone(),
            reason: reason.to_owned(),
            incident_id: String::new(),
            replacing: true,
        };
        let count = match tokio::time::timeout(STOP_RANKS_TIMEOUT, self.client.request_restart(req))
            .await
        {
            Ok(Ok(r)) => r.into_inner().restart_count,
            Ok(Err(e)) => {
                return replaced(
                    Vec::new(),
                    Some(format!(
                        "the agent refused the in-process restart: {}",
                        e.message()
                    )),
                );
            }
            Err(_) => {
                return replaced(
                    Vec::new(),
                    Some("the agent did not answer the in-process restart".into()),
                );
            }
        };
        // It declared (healable); its replacement counts as declared.
        self.replace_workers(vec![(rank, pid)], count, reason).await
    }

    /// Stops every process of the current attempt: `first` to each worker's
    /// process group (and to marked orphans), SIGKILL after the grace (or at
    /// once on a second signal), until none is alive; reaps the orphans.
    /// Returns every pid of the job seen (for the GPU release wait).
    async fn stop_workers(&mut self, first: Signal) -> Vec<u32> {
        let sessions: HashSet<i32> = self.workers.iter().map(|w| w.pid).collect();
        let me = nix::unistd::getpid().as_raw();
        let mut all: HashSet<i32> = sessions.clone();
        if sessions.is_empty() {
            return Vec::new();
        }
        // A stopped process (SIGSTOP, a frozen rank) acts on no signal but
        // SIGKILL until it is continued: SIGCONT after the first signal, as
        // systemd does, or the grace is waited out in full.
        let cont = first != Signal::SIGKILL;
        for &pgid in &sessions {
            spawn::signal_group(pgid, first);
            if cont {
                spawn::signal_group(pgid, Signal::SIGCONT);
            }
        }
        let started = Instant::now();
        let grace_end = started + self.job.stop_grace;
        let mut kill_end: Option<Instant> = None;
        let mut poll = Duration::from_millis(2);
        let mut orphans = 0usize;
        loop {
            let procs = spawn::scan();
            let job = spawn::job_processes(&procs, &sessions, me);
            for p in &job {
                if all.insert(p.pid) && !sessions.contains(&p.pid) {
                    orphans += 1;
                    // A marked orphan outside the workers' groups gets the
                    // signal the groups got.
                    if kill_end.is_none() && p.alive() {
                        spawn::signal_pid(p.pid, first);
                        if cont {
                            spawn::signal_pid(p.pid, Signal::SIGCONT);
                        }
                    }
                }
                // Orphans reparented to the launcher are reaped here; the
                // workers' own zombies wait for the agent's report.
                if !p.alive() && p.ppid == me && !sessions.contains(&p.pid) {
                    spawn::reap(p.pid);
                }
            }
            let alive: Vec<i32> = job.iter().filter(|p| p.alive()).map(|p| p.pid).collect();
            if alive.is_empty() {
                break;
            }
            let now = Instant::now();
            match kill_end {
                None if now >= grace_end => {
                    self.say(format!(
                        "{} process{} of the job still alive after the {} grace: SIGKILL",
                        alive.len(),
                        if alive.len() == 1 { "" } else { "es" },
                        humantime::format_duration(self.job.stop_grace)
                    ));
                    self.kill_all(&sessions, &alive);
                    kill_end = Some(now + KILL_WAIT);
                }
                Some(end) if now >= end => {
                    self.say(format!(
                        "processes {alive:?} survive SIGKILL (uninterruptible sleep?); leaving them"
                    ));
                    break;
                }
                _ => {}
            }
            tokio::select! {
                () = tokio::time::sleep(poll) => {}
                sig = self.signals.recv() => {
                    // The machine's answer to a signal during a stop.
                    let kill = self
                        .state
                        .step(Input::Signal(sig), Now::read())
                        .into_iter()
                        .any(|c| matches!(c, Command::Kill { .. }));
                    if kill && kill_end.is_none() {
                        let name = Signal::try_from(sig).map_or("a signal", |s| s.as_str());
                        self.say(format!("got {name} again: SIGKILL"));
                        self.kill_all(&sessions, &alive);
                        kill_end = Some(Instant::now() + KILL_WAIT);
                    }
                }
            }
            poll = (poll * 2).min(Duration::from_millis(50));
        }
        self.say(format!(
            "stopped {} worker{}{} in {:.2}s",
            sessions.len(),
            if sessions.len() == 1 { "" } else { "s" },
            if orphans > 0 {
                format!(
                    " and {orphans} orphaned process{}",
                    if orphans == 1 { "" } else { "es" }
                )
            } else {
                String::new()
            },
            started.elapsed().as_secs_f64()
        ));
        all.into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .collect()
    }

    fn kill_all(&self, sessions: &HashSet<i32>, alive: &[i32]) {
        for &pgid in sessions {
            spawn::signal_group(pgid, Signal::SIGKILL);
        }
        for &pid in alive {
            spawn::signal_pid(pid, Signal::SIGKILL);
        }
    }

    /// Reaps the attempt's exited workers once the agent reported them (it
    /// reads their status from the zombie), at most [`REAP_WAIT`], on a task
    /// of its own: never on the restart's path.
    fn reap_attempt(&self) -> JoinHandle<()> {
        self.reap_pids(self.workers.iter().map(|w| w.pid).collect())
    }

    /// Reaps these exited workers as [`Self::reap_attempt`] does.
    fn reap_pids(&self, pids: Vec<i32>) -> JoinHandle<()> {
        let mut seen = self.seen.clone();
        tokio::spawn(async move {
            let reported = |s: &Seen| {
                pids.iter().all(|&p| {
                    u32::try_from(p)
                        .is_ok_and(|p| s.exited.contains(&p) || !s.registered.contains_key(&p))
                })
            };
            let _ = tokio::time::timeout(REAP_WAIT, seen.wait_for(|s| reported(s))).await;
            for p in pids {
                if procfs_state(p).is_some_and(|s| s == 'Z') {
                    spawn::reap(p);
                }
            }
        })
    }

    /// The job's end: the other hosts first, then what is left of the
    /// workers, their zombies and output; the summary.
    async fn finish(&mut self, f: Finish) -> RunSummary {
        // The other hosts first: they stop (a failed job) or go on without
        // this one while its workers stop.
        let stop = Directive::Stop {
            exit_code: f.code,
            reason: f.outcome.clone(),
            job_failed: f.job_failed,
        };
        // A signal ends the wait: the c10d coordinator's answer to a
        // finished job waits for the other hosts (its exit barrier, up to
        // minutes), and a Ctrl-C must not wait with it (torchrun's agent
        // leaves its barrier on a signal too).
        let told = tokio::select! {
            r = self.coord.publish(&stop) => Ok(r),
            sig = self.signals.recv() => Err(sig),
        };
        match told {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.say(format!("could not tell the other nodes: {e}")),
            Err(sig) => {
                let name = Signal::try_from(sig).map_or("a signal", |s| s.as_str());
                self.say(format!(
                    "got {name} while telling the other nodes of the end: not waiting for them"
                ));
            }
        }
        self.replenish_at = None;
        for sb in std::mem::take(&mut self.standbys).into_iter().flatten() {
            self.reapers.push(sb.discard());
        }
        // The round's store goes with the job: an open still waiting (for
        // torch's import) is dropped with the console it holds, and the
        // process is killed and reaped with the last handle.
        for t in self.round_store_open.drain(..) {
            t.abort();
        }
        self.round_store = None;
        let any_alive = self
            .workers
            .iter()
            .any(|w| procfs_state(w.pid).is_some_and(|s| s != 'Z'));
        if any_alive {
            self.stop_ranks(StopKind::JobEnding, &format!("job ending: {}", f.outcome))
                .await;
            self.stop_workers(Signal::SIGTERM).await;
        }
        self.reapers.push(self.reap_attempt());
        let reapers = std::mem::take(&mut self.reapers);
        let _ = tokio::time::timeout(REAP_WAIT * 2, async {
            for r in reapers {
                let _ = r.await;
            }
        })
        .await;
        let pumps: Vec<JoinHandle<()>> = self
            .workers
            .iter_mut()
            .flat_map(|w| std::mem::take(&mut w.pumps))
            .collect();
        let _ = tokio::time::timeout(OUTPUT_DRAIN, async {
            for p in pumps {
                let _ = p.await;
            }
        })
        .await;
        // The agent hears the launcher's own stop once the workers are
        // down (an agent slow to answer delays no stop), so `warden
        // incidents` shows it; one that does not answer costs the stop
        // nothing: the launcher still exits with its status.
        if let Some(report) = f.report.as_ref().or(self.held_stop.as_ref()) {
            match agent::report_job_stop(&self.client, &self.job.id, report).await {
                Ok(id) => self.say(format!("the agent recorded the stop as incident {id}")),
                Err(e) => self.say(format!(
                    "the agent was not told of the stop ({e}): this console and the summary are its only record"
                )),
            }
        }
        let notice_checkpoint = if f.code == super::exit::EXIT_PREEMPTED {
            Some(self.notice_checkpoint().await)
        } else {
            None
        };
        let attempts = self.state.records(Now::read());
        if self.console.dropped() > 0 {
            self.say(format!(
                "{} worker lines did not fit the console (they are in the log files)",
                self.console.dropped()
            ));
        }
        RunSummary {
            job: self.job.id.clone(),
            agent: self.agent_line.clone(),
            outcome: f.outcome,
            exit_code: f.code,
            elapsed_s: self.started.elapsed().as_secs_f64(),
            log_dir: self.job.log_root.display().to_string(),
            attempts,
            notice_checkpoint,
        }
    }

    /// Where the checkpoint saved on the notice went (the agent's view of
    /// the job's newest complete step), said on the console. While the
    /// step the ranks saved on the notice is not the newest complete yet
    /// (another host's ranks still saving), or it is on this host alone and
    /// the agent evidently replicates the job's steps, asks again every
    /// 200 ms until neither holds, the notice's deadline less the stop
    /// grace, or 10 s.
    async fn notice_checkpoint(&mut self) -> crate::notice_ckpt::Whereabouts {
        use crate::notice_ckpt::Whereabouts;
        const MAX_WAIT: Duration = Duration::from_secs(10);
        let until = Instant::now()
            + self
                .notice_deadline
                .and_then(|d| d.duration_since(SystemTime::now()).ok())
                .map_or(Duration::ZERO, |left| {
                    left.saturating_sub(self.job.stop_grace)
                })
                .min(MAX_WAIT);
        // What the last answer said: an ask again that fails or runs past
        // `until` leaves it standing.
        let mut last: Option<Whereabouts> = None;
        loop {
            // This host's ranks: the notice is about their shards, and the
            // copies of every rank of a large job are megabytes.
            let req = pb::ListCheckpointsRequest {
                job_id: self.job.id.clone(),
                detail: pb::ListDetail::All.into(),
                ranks: self.workers.iter().map(|w| w.rank).collect(),
            };
            // The first ask has its full time; one again, at most what is
            // left before `until`.
            let limit = match last {
                None => OBSERVE_TIMEOUT,
                Some(_) => OBSERVE_TIMEOUT.min(until.saturating_duration_since(Instant::now())),
            };
            let answer = tokio::time::timeout(limit, self.client.list_checkpoints(req)).await;
            let w = match (answer, last.take()) {
                (Ok(Ok(r)), _) => Whereabouts::of(&self.job.id, &r.into_inner().steps),
                (_, Some(w)) => {
                    self.say(w.line());
                    return w;
                }
                (Ok(Err(e)), None) => {
                    self.say(format!(
                        "the agent could not say where the notice's checkpoint is (ListCheckpoints: {})",
                        e.message()
                    ));
                    return Whereabouts::default();
                }
                (Err(_), None) => {
                    self.say("the agent did not say in time where the notice's checkpoint is");
                    return Whereabouts::default();
                }
            };
            if !w.wait_for_copies(self.notice_step) || Instant::now() >= until {
                self.say(w.line());
                return w;
            }
            last = Some(w);
            tokio::time::sleep(
                Duration::from_millis(200).min(until.saturating_duration_since(Instant::now())),
            )
            .await;
        }
    }
}

/// The job's newest complete step in a listing, or, where it has none and
/// holders (or the job's collectors) could not be asked, why that "none"
/// is not known: the checkpoint may be on them, and a "none" would judge
/// the attempt stalled.
fn newest_complete(job: &str, r: &pb::ListCheckpointsResponse) -> (Option<u64>, Option<String>) {
    let newest = r
        .steps
        .iter()
        .filter(|s| s.job_id == job && s.complete)
        .map(|s| s.step)
        .max();
    if newest.is_some() || r.unreachable.is_empty() {
        return (newest, None);
    }
    let more = r.unreachable.len().saturating_sub(3);
    let why = format!(
        "ListCheckpoints: no complete step among the holders that answered; not asked: {}{}",
        r.unreachable[..r.unreachable.len().min(3)].join("; "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    );
    (None, Some(why))
}

/// The answer to a replacement.
fn replaced(workers: Vec<(u32, i32)>, error: Option<String>) -> Input {
    Input::Replaced(Box::new(Replaced { workers, error }))
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

/// A port free on `addr` now (the OS's pick), for rank 0's store.
fn free_port(addr: &str) -> Option<u16> {
    let l = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .ok()?;
    l.local_addr().ok().map(|a| a.port())
}

fn procfs_state(pid: i32) -> Option<char> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| spawn::parse_stat(&t))
        .map(|p| p.state)
}

/// A lower-case name from a proto enum's name (`FAULT_CLASS_USER_ERROR` ->
/// `user_error`).
fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix)
        .unwrap_or(full)
        .to_ascii_lowercase()
}

/// Why no attempt could be agreed.
enum Halt {
    /// The coordinator gave up (its message and exit status).
    Coord(super::hosts::AcrossHostsError),
    /// A signal came while waiting.
    Signal(i32),
}

/// The machine's view of one decision of the incident feed; None for an
/// incident with no decision.
fn decision_of(inc: &pb::Incident) -> Option<FeedDecision> {
    let dec = inc.decision.as_ref()?;
    let opened = inc
        .opened_at
        .as_ref()
        .and_then(|t| SystemTime::try_from(*t).ok())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let action = warden_agent::api::convert::action_of(dec.action);
    Some(FeedDecision {
        id: inc.id.clone(),
        revision: inc.superseded.len(),
        opened,
        action,
        exit_code: dec.exit_code,
        backoff: dec
            .backoff
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default(),
        brief: brief_of(inc),
        replace: dec.replace.as_ref().map(|r| Replacement {
            // Bounded: at most one entry per possible rank of a host.
            ranks: r.ranks.iter().copied().take(MAX_REPLACE).collect(),
            restart_count: r.restart_count,
        }),
        healable: false,
    })
}

/// The summary's view of an incident: class, confidence, summary, the
/// strongest evidence (what points somewhere first), the decision.
fn brief_of(inc: &pb::Incident) -> IncidentBrief {
    let diag = inc.diagnosis.clone().unwrap_or_default();
    let dec = inc.decision.clone().unwrap_or_default();
    let class = pb::FaultClass::try_from(diag.fault_class).map_or("unknown".into(), |c| {
        enum_name(c.as_str_name(), "FAULT_CLASS_")
    });
    // One reading of the proto's action, the decisions' own.
    let action = warden_agent::api::convert::action_of(dec.action)
        .map_or("unspecified", |a| a.as_str())
        .to_owned();
    let mut ev: Vec<&pb::Evidence> = diag.evidence.iter().collect();
    ev.sort_by_key(|e| e.points_to == pb::FaultClass::Unspecified as i32);
    let evidence = ev
        .iter()
        .map(|e| {
            let to = pb::FaultClass::try_from(e.points_to)
                .ok()
                .filter(|c| *c != pb::FaultClass::Unspecified)
                .map_or("context".into(), |c| {
                    enum_name(c.as_str_name(), "FAULT_CLASS_")
                });
            let note = if e.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", e.note)
            };
            format!(
                "{} {} {}={} -> {to}{note}",
                e.source, e.subject, e.signal, e.value
            )
        })
        .collect();
    IncidentBrief {
        id: inc.id.clone(),
        kind: inc.kind.clone(),
        class,
        confidence: diag.confidence,
        summary: diag.summary,
        evidence,
        action,
        reason: dec.reason,
        decided_by: dec.decided_by,
        attempt: dec.attempt,
        budget: dec.budget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn briefs_name_class_action_and_strongest_evidence_first() {
        let inc = pb::Incident {
            id: "inc-1".into(),
            kind: "crash".into(),
            diagnosis: Some(pb::Diagnosis {
                fault_class: pb::FaultClass::UserError as i32,
                confidence: 0.8,
                summary: "ValueError".into(),
                evidence: vec![
                    pb::Evidence {
                        source: "agent".into(),
                        signal: "step".into(),
                        ..Default::default()
                    },
                    pb::Evidence {
                        source: "client".into(),
                        signal: "exception".into(),
                        value: "ValueError".into(),
                        points_to: pb::FaultClass::UserError as i32,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            decision: Some(pb::Decision {
                action: pb::Action::Stop as i32,
                exit_code: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        let b = brief_of(&inc);
        assert_eq!(b.class, "user_error");
        assert_eq!(b.action, "stop");
        assert!(
            b.evidence[0].contains("exception=ValueError -> user_error"),
            "{:?}",
            b.evidence
        );
    }

    #[test]
    fn no_step_with_holders_unreachable_is_not_known_rather_than_none() {
        let step = |step, complete| pb::CheckpointStep {
            job_id: "j".into(),
            step,
            complete,
            ..Default::default()
        };
        let mut r = pb::ListCheckpointsResponse {
            steps: vec![step(20, false), step(10, true)],
            ..Default::default()
        };
        assert_eq!(newest_complete("j", &r), (Some(10), None));
        assert_eq!(newest_complete("other", &r), (None, None));
        r.unreachable = (0..5).map(|i| format!("peer h{i}: silent")).collect();
        assert_eq!(newest_complete("j", &r), (Some(10), None));
        r.steps.pop();
        let (none, why) = newest_complete("j", &r);
        let why = why.expect("not known");
        assert_eq!(none, None);
        assert!(
            why.contains("peer h0: silent; peer h1") && why.ends_with("and 2 more"),
            "{why}"
        );
    }

    #[test]
    fn a_free_port_is_found() {
        assert!(free_port("127.0.0.1").is_some_and(|p| p > 0));
    }
}
