//! The supervision loop: start the attempt's workers, watch them and the
//! agent's decisions about the job, and act.
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
//!   with a failed worker the launcher restarts in job at once.
//! - `continue`: nothing.
//! - SIGINT/SIGTERM/SIGHUP: forwarded to the workers' process groups, a
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

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use warden_proto::v1 as pb;

use super::agent::{self, AgentLink, Seen};
use super::coord::{AttemptPlan, Coordinator, Directive, LocalOnly, NodeFault, Remote};
use super::env::WorkerEnv;
use super::exit::{
    self, AttemptRecord, EXIT_BUDGET_SPENT, EXIT_LAUNCHER_ERROR, IncidentBrief, RestartTiming,
    Summary,
};
use super::gate::{self, Gate, GpuRelease};
use super::output::{self, Console, Stream};
use super::spawn::{self, Exit};

/// How long exited workers stay zombies, at most, waiting for the agent to
/// report them (it reads their status from the zombie).
const REAP_WAIT: Duration = Duration::from_secs(1);
/// How long a worker's output may keep flowing after the job ended.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);
/// A failed worker the agent never registered: how long to wait for its
/// registration event to turn up before deciding without the agent.
const UNREGISTERED_WAIT: Duration = Duration::from_millis(300);
/// How long StopRanks may take before the launcher stops the workers anyway.
const STOP_RANKS_TIMEOUT: Duration = Duration::from_secs(1);
/// Processes that survive SIGKILL this long (uninterruptible sleep) are
/// reported and left.
const KILL_WAIT: Duration = Duration::from_secs(10);

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
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// Nodes in the job.
    pub nnodes: u32,
    /// This node's rank.
    pub node_rank: u32,
    /// ROLE_NAME.
    pub role: String,
    /// Rank 0's address.
    pub master_addr: String,
    /// A fixed store port; None: a free one per attempt.
    pub master_port: Option<u16>,
    /// `--max-restarts`.
    pub max_restarts: Option<u32>,
    /// Restarts the launcher may decide alone (no decision from the agent).
    pub fallback_budget: u32,
    /// SIGTERM to SIGKILL.
    pub stop_grace: Duration,
    /// How long a failure waits for the agent's decision.
    pub decision_timeout: Duration,
    /// The GPU release wait's bound.
    pub gpu_release_timeout: Duration,
}

/// SIGINT, SIGTERM and SIGHUP, installed before anything is started.
#[derive(Debug)]
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
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
        })
    }

    /// The next signal received.
    pub async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.hup.recv() => libc::SIGHUP,
        }
    }
}

#[derive(Debug)]
struct Worker {
    rank: u32,
    pid: i32,
    exit: Option<Option<Exit>>,
    pumps: Vec<JoinHandle<()>>,
}

#[derive(Debug)]
struct ExitNote {
    /// The attempt's generation ([`Attempt::generation`]).
    generation: u64,
    rank: u32,
    pid: i32,
    exit: Option<Exit>,
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

#[derive(Debug)]
struct Attempt {
    n: u32,
    /// Counts every start, a standby one included: exits of an earlier
    /// attempt are told apart by it.
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
}

/// Why a restart happens.
#[derive(Debug)]
struct Cause {
    /// What the summary shows.
    brief: IncidentBrief,
    /// The incident, when the agent decided.
    incident: Option<String>,
    backoff: Duration,
    /// Decided by the launcher alone (counts against the fallback budget).
    fallback: bool,
    /// A round another host caused: not published again, not counted
    /// against `--max-restarts`.
    remote: bool,
    /// When the failure was seen (or the decision came, for a hang).
    since: Instant,
    since_wall: SystemTime,
    decided: Instant,
}

// One value per event, moved once: its size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Flow {
    Go,
    Restart(Box<Cause>),
    Finish {
        code: i32,
        outcome: String,
        ended: String,
        incident: Option<IncidentBrief>,
    },
}

enum Ev {
    Exit(ExitNote),
    Decision(Box<pb::Incident>),
    DecisionsClosed,
    Deadline,
    Seen,
    SeenClosed,
    Signal(i32),
    Remote(Remote),
}

/// Why no attempt could be agreed.
enum Halt {
    /// The coordinator gave up (its message and exit status).
    Coord(super::coord::CoordError),
    /// A signal came while waiting.
    Signal(i32),
}

/// Runs the job to its end; returns the summary (its `exit_code` is the
/// launcher's exit status).
pub async fn run<C: Coordinator>(
    job: Job,
    link: &AgentLink,
    coord: C,
    console: Console,
    signals: &mut Signals,
) -> Summary {
    let stop = CancellationToken::new();
    let seen = agent::watch_ranks(link.client.clone(), job.id.clone(), stop.clone()).await;
    let decisions = agent::watch_decisions(link.client.clone(), job.id.clone(), stop.clone());
    let (exits_tx, exits_rx) = mpsc::unbounded_channel();
    let (peers_tx, peers_rx) = watch::channel(Vec::new());
    agent::keep_peers(link.client.clone(), job.id.clone(), peers_rx, stop.clone());
    let now = Instant::now();
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
        peers_tx,
        handled: HashSet::new(),
        acted_on: HashSet::new(),
        attempt: Attempt {
            n: 0,
            generation: 0,
            standby: true,
            recorded: false,
            started: now,
            started_wall: SystemTime::now(),
            workers: Vec::new(),
            record: AttemptRecord::default(),
            all_registered: false,
        },
        history: Vec::new(),
        pending: None,
        restarts: 0,
        local_restarts: 0,
        attempts_started: 0,
        leaves_alone: false,
        fallback_used: 0,
        started: now,
        started_wall: SystemTime::now(),
        awaiting_registration: None,
        failed_unrestarted: None,
        reapers: Vec::new(),
    };
    let summary = sup.run().await;
    stop.cancel();
    summary
}

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
    /// The current round's checkpoint peers, handed to the agent again
    /// now and then ([`agent::keep_peers`]).
    peers_tx: watch::Sender<agent::CkptPeers>,
    /// Decisions already seen: (incident, revision).
    handled: HashSet<(String, usize)>,
    /// Incidents already answered with an in-job restart or a stop.
    acted_on: HashSet<String>,
    attempt: Attempt,
    history: Vec<AttemptRecord>,
    pending: Option<Pending>,
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
    started: Instant,
    started_wall: SystemTime,
    /// After a restart: when the failure (or the new round) was seen, and
    /// which, until every new worker registered.
    awaiting_registration: Option<(Instant, &'static str)>,
    /// A failure the agent answered with `continue`: the job's status at
    /// the end.
    failed_unrestarted: Option<Exit>,
    /// Background reaping of stopped attempts' zombies.
    reapers: Vec<JoinHandle<()>>,
}

impl<C: Coordinator> Sup<'_, C> {
    async fn run(&mut self) -> Summary {
        let plan = match self.agree(self.plan(0)).await {
            Ok(p) => p,
            Err(h) => return self.halted(h, "not started").await,
        };
        if let Err(e) = self.start_attempt(&plan) {
            return self
                .finish(
                    EXIT_LAUNCHER_ERROR,
                    format!("could not start the workers: {e}"),
                    format!("not started: {e}"),
                    None,
                )
                .await;
        }
        loop {
            let ev = self.next_event().await;
            let flow = match ev {
                Ev::Exit(n) => self.on_exit(n),
                Ev::Decision(inc) => self.on_decision(&inc).await,
                Ev::DecisionsClosed => {
                    self.decisions_open = false;
                    Flow::Go
                }
                Ev::Deadline => self.on_no_decision(),
                Ev::Seen => {
                    self.check_registered();
                    Flow::Go
                }
                Ev::SeenClosed => {
                    self.seen_open = false;
                    Flow::Go
                }
                Ev::Signal(sig) => self.on_signal(sig).await,
                Ev::Remote(d) => match d {
                    Remote::NewRound { reason } => {
                        self.say(format!("new round across hosts: {reason}"));
                        Flow::Restart(Box::new(Cause {
                            brief: IncidentBrief {
                                action: "new_round".into(),
                                reason,
                                decided_by: format!("the job's hosts ({})", self.coord.name()),
                                ..Default::default()
                            },
                            incident: None,
                            backoff: Duration::ZERO,
                            fallback: false,
                            remote: true,
                            since: Instant::now(),
                            since_wall: SystemTime::now(),
                            decided: Instant::now(),
                        }))
                    }
                    Remote::Stop { exit_code, reason } => {
                        self.leaves_alone = true;
                        self.say(format!("stopping: {reason}"));
                        Flow::Finish {
                            code: exit_code,
                            outcome: format!("stopped across hosts: {reason}"),
                            ended: format!("stopped across hosts: {reason}"),
                            incident: None,
                        }
                    }
                    Remote::Note(text) => {
                        self.say(text);
                        Flow::Go
                    }
                },
            };
            match flow {
                Flow::Go => {}
                Flow::Restart(cause) => {
                    if let Some(done) = self.restart(*cause).await {
                        return done;
                    }
                }
                Flow::Finish {
                    code,
                    outcome,
                    ended,
                    incident,
                } => return self.finish(code, outcome, ended, incident).await,
            }
        }
    }

    async fn next_event(&mut self) -> Ev {
        let deadline = self.pending.as_ref().map(|p| p.deadline);
        tokio::select! {
            Some(n) = self.exits_rx.recv() => Ev::Exit(n),
            d = self.decisions.recv(), if self.decisions_open => match d {
                Some(i) => Ev::Decision(Box::new(i)),
                None => Ev::DecisionsClosed,
            },
            () = sleep_until(deadline) => Ev::Deadline,
            r = self.seen.changed(), if self.seen_open => if r.is_ok() { Ev::Seen } else { Ev::SeenClosed },
            sig = self.signals.recv() => Ev::Signal(sig),
            d = self.coord.next_remote() => Ev::Remote(d),
        }
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
            ckpt_peers: Vec::new(),
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
                .iter()
                .map(|(h, p)| format!("{h} ({})", p.addr))
                .collect();
            match agent::set_peers(&self.client, &self.job.id, &plan.ckpt_peers).await {
                Ok(targets) if !names.is_empty() => self.say(format!(
                    "checkpoint peers of this round: {}; this host's replicas go to {}",
                    names.join(", "),
                    if targets.is_empty() { "none (no peer outside this host's failure domain)".to_owned() } else { targets.join(", ") }
                )),
                Ok(_) => {}
                Err(e) => self.say(format!(
                    "the agent did not take this round's checkpoint peers ({e}); asked again every 10 s"
                )),
            }
            self.peers_tx.send_replace(plan.ckpt_peers.clone());
        }
        agreed
    }

    /// Ends the run after a failed rendezvous.
    async fn halted(&mut self, h: Halt, ended: &str) -> Summary {
        match h {
            Halt::Coord(e) => {
                self.say(format!(
                    "the hosts could not agree on the next attempt: {e}"
                ));
                if e.exit_code == exit::EXIT_NODE_FAULT || e.exit_code == exit::EXIT_SUCCESS {
                    self.leaves_alone = true;
                }
                let outcome = if e.exit_code == exit::EXIT_SUCCESS {
                    format!("done: {}", e.message)
                } else {
                    format!("failed: {e}")
                };
                self.finish(e.exit_code, outcome, ended.to_owned(), None)
                    .await
            }
            Halt::Signal(sig) => {
                self.leaves_alone = true;
                let name = Signal::try_from(sig).map_or("a signal", |s| s.as_str());
                self.say(format!(
                    "got {name} while waiting for the job's round: stopping"
                ));
                self.finish(
                    exit::signalled(sig),
                    format!("stopped on {name}"),
                    format!("stopped on {name} waiting for the job's round"),
                    None,
                )
                .await
            }
        }
    }

    fn start_attempt(&mut self, plan: &AttemptPlan) -> Result<(), String> {
        let n = plan.restart_count;
        let generation = self.attempt.generation + 1;
        if let Some(round) = &plan.round {
            self.say(round);
        }
        let Some(node_rank) = plan.node_rank else {
            self.attempt = Attempt {
                n,
                generation,
                standby: true,
                recorded: false,
                started: Instant::now(),
                started_wall: SystemTime::now(),
                workers: Vec::new(),
                record: AttemptRecord {
                    attempt: n,
                    epoch: plan.epoch,
                    ..Default::default()
                },
                all_registered: false,
            };
            self.say("no place in this round: no workers on this host until a round gives it one");
            return Ok(());
        };
        let dir = self.job.log_root.join(format!("attempt_{n}"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
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
        self.attempt = Attempt {
            n,
            generation,
            standby: false,
            recorded: false,
            started: Instant::now(),
            started_wall: SystemTime::now(),
            workers: Vec::new(),
            record: AttemptRecord {
                attempt: n,
                workers: self.job.nproc_per_node,
                master_port: plan.master_port,
                epoch: plan.epoch,
                node_rank,
                nnodes: plan.nnodes,
                world_size: plan.world_size,
                ..Default::default()
            },
            all_registered: false,
        };
        self.attempts_started = self.attempts_started.max(n + 1);
        for local in 0..self.job.nproc_per_node {
            let rank = wenv.global_rank(local);
            let env = wenv.for_rank(local, |k| std::env::var(k).ok());
            let mut s = match spawn::spawn(&self.job.argv, &env, &self.job.cwd) {
                Ok(s) => s,
                Err(e) => {
                    for w in &self.attempt.workers {
                        spawn::signal_group(w.pid, Signal::SIGKILL);
                    }
                    return Err(e.to_string());
                }
            };
            let mut pumps = Vec::new();
            let prefix = format!("[rank {rank}] ");
            if let Some(out) = s.stdout.take() {
                pumps.push(tokio::spawn(output::pump(
                    out,
                    Stream::Stdout,
                    prefix.clone(),
                    output::log_file(&dir, rank, Stream::Stdout),
                    self.console.clone(),
                )));
            }
            if let Some(err) = s.stderr.take() {
                pumps.push(tokio::spawn(output::pump(
                    err,
                    Stream::Stderr,
                    prefix,
                    output::log_file(&dir, rank, Stream::Stderr),
                    self.console.clone(),
                )));
            }
            let tx = self.exits_tx.clone();
            let pid = s.pid;
            let pidfd = s.pidfd;
            tokio::spawn(async move {
                let exit = spawn::exited(pid, &pidfd).await;
                let _ = tx.send(ExitNote {
                    generation,
                    rank,
                    pid,
                    exit,
                });
            });
            self.attempt.workers.push(Worker {
                rank,
                pid,
                exit: None,
                pumps,
            });
        }
        let pids: Vec<String> = self
            .attempt
            .workers
            .iter()
            .map(|w| w.pid.to_string())
            .collect();
        self.say(format!(
            "attempt {n}: started {} worker{} (pids {}; MASTER_PORT {}; logs {})",
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
        Ok(())
    }

    fn check_registered(&mut self) {
        if self.attempt.all_registered || self.attempt.workers.is_empty() {
            return;
        }
        let all = {
            let seen = self.seen.borrow();
            self.attempt
                .workers
                .iter()
                .all(|w| u32::try_from(w.pid).is_ok_and(|p| seen.registered.contains_key(&p)))
        };
        if !all {
            return;
        }
        self.attempt.all_registered = true;
        match self.awaiting_registration.take() {
            Some((since, what)) => {
                let ms = ms(since.elapsed());
                if let Some(r) = self.history.last_mut().and_then(|a| a.restart.as_mut()) {
                    r.registered_ms = Some(ms);
                }
                self.say(format!(
                    "attempt {}: all {} workers registered with the agent, {:.2}s after {what}",
                    self.attempt.n,
                    self.attempt.workers.len(),
                    ms / 1000.0
                ));
            }
            None => self.say(format!(
                "attempt {}: all {} workers registered with the agent ({:.2}s after start)",
                self.attempt.n,
                self.attempt.workers.len(),
                self.attempt.started.elapsed().as_secs_f64()
            )),
        }
    }

    fn on_exit(&mut self, n: ExitNote) -> Flow {
        if n.generation != self.attempt.generation {
            return Flow::Go;
        }
        if let Some(w) = self.attempt.workers.iter_mut().find(|w| w.pid == n.pid) {
            w.exit = Some(n.exit);
        }
        let ok = n.exit.is_some_and(Exit::success);
        if !ok {
            let status = n
                .exit
                .map_or("status unknown".to_owned(), |e| e.to_string());
            self.attempt.record.failures.push((n.rank, status.clone()));
            if self.pending.is_none() {
                let registered = u32::try_from(n.pid)
                    .is_ok_and(|p| self.seen.borrow().registered.contains_key(&p));
                let wait = if registered {
                    self.job.decision_timeout
                } else {
                    UNREGISTERED_WAIT.min(self.job.decision_timeout)
                };
                self.say(format!(
                    "rank {} (pid {}) failed: {status}; {}",
                    n.rank,
                    n.pid,
                    if registered {
                        "waiting for the agent's diagnosis"
                    } else {
                        "it had not registered with the agent"
                    }
                ));
                self.pending = Some(Pending {
                    seen: Instant::now(),
                    seen_wall: SystemTime::now(),
                    rank: n.rank,
                    exit: n.exit,
                    deadline: Instant::now() + wait,
                    registered,
                });
            } else {
                self.say(format!(
                    "rank {} (pid {}) failed too: {status}",
                    n.rank, n.pid
                ));
            }
            return Flow::Go;
        }
        let all_done = self.attempt.workers.iter().all(|w| w.exit.is_some());
        if !all_done || self.pending.is_some() {
            return Flow::Go;
        }
        match self.failed_unrestarted {
            Some(e) => Flow::Finish {
                code: e.shell_code().max(1),
                outcome: "failed (a failure the agent let stand)".into(),
                ended: "the other workers finished".into(),
                incident: None,
            },
            None => Flow::Finish {
                code: exit::EXIT_SUCCESS,
                outcome: if self.restarts == 0 {
                    "succeeded".into()
                } else {
                    format!(
                        "succeeded after {} in-job restart{}",
                        self.restarts,
                        if self.restarts == 1 { "" } else { "s" }
                    )
                },
                ended: "every worker exited 0".into(),
                incident: None,
            },
        }
    }

    async fn on_decision(&mut self, inc: &pb::Incident) -> Flow {
        let Some(dec) = inc.decision.as_ref() else {
            return Flow::Go;
        };
        if !self.handled.insert((inc.id.clone(), inc.superseded.len())) {
            return Flow::Go;
        }
        let opened = inc
            .opened_at
            .as_ref()
            .and_then(|t| SystemTime::try_from(*t).ok())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        // The job's history from before this launcher (same job id, a
        // journal kept across runs) is not for us to act on.
        if opened + Duration::from_secs(1) < self.started_wall {
            return Flow::Go;
        }
        let brief = brief_of(inc);
        let action = pb::Action::try_from(dec.action).unwrap_or(pb::Action::Unspecified);
        // About an attempt already stopped (its incident opened before the
        // current attempt started): a restart it asks for has been done.
        let stale = opened + Duration::from_millis(50) < self.attempt.started_wall;
        self.print_decision(&brief, stale);
        if self.acted_on.contains(&inc.id) && action != pb::Action::Stop {
            return Flow::Go;
        }
        if !stale && matches!(action, pb::Action::RestartInProcess | pb::Action::Continue) {
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
            pb::Action::RestartInJob if stale => Flow::Go,
            pb::Action::RestartInJob => {
                let (since, since_wall) = self
                    .pending
                    .as_ref()
                    .map_or((Instant::now(), SystemTime::now()), |p| {
                        (p.seen, p.seen_wall)
                    });
                Flow::Restart(Box::new(Cause {
                    brief,
                    incident: Some(inc.id.clone()),
                    backoff: dec
                        .backoff
                        .and_then(|d| Duration::try_from(d).ok())
                        .unwrap_or_default(),
                    fallback: false,
                    remote: false,
                    since,
                    since_wall,
                    decided: Instant::now(),
                }))
            }
            pb::Action::Stop => {
                self.acted_on.insert(inc.id.clone());
                let code = if dec.exit_code == 0 {
                    EXIT_LAUNCHER_ERROR
                } else {
                    dec.exit_code
                };
                Flow::Finish {
                    code,
                    outcome: format!("stopped on the agent's diagnosis: {}", brief.class),
                    ended: format!("stopped on {}'s decision", inc.id),
                    incident: Some(brief),
                }
            }
            pb::Action::Cordon | pb::Action::ScaleDown => {
                self.acted_on.insert(inc.id.clone());
                self.leaves_alone = true;
                let NodeFault::Exit(code) = self.coord.node_fault(&brief.summary).await;
                Flow::Finish {
                    code,
                    outcome: format!(
                        "this node is at fault ({}): {}; run the job elsewhere",
                        brief.action, brief.summary
                    ),
                    ended: format!("{} on {}'s decision", brief.action, inc.id),
                    incident: Some(brief),
                }
            }
            pb::Action::RestartInProcess if stale => Flow::Go,
            pb::Action::RestartInProcess => match self.pending.take() {
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
                    self.say(format!("{}: restarting in job", b.reason));
                    Flow::Restart(Box::new(Cause {
                        brief: b,
                        incident: Some(inc.id.clone()),
                        backoff: Duration::ZERO,
                        fallback: false,
                        remote: false,
                        since: p.seen,
                        since_wall: p.seen_wall,
                        decided: Instant::now(),
                    }))
                }
                None => {
                    self.say("the agent restarts the ranks in process; the launcher leaves the workers running");
                    Flow::Go
                }
            },
            pb::Action::Continue => {
                if let Some(p) = self.pending.take() {
                    self.failed_unrestarted = p.exit.or(Some(Exit::Code(1)));
                }
                Flow::Go
            }
            pb::Action::Unspecified => Flow::Go,
        }
    }

    fn print_decision(&self, b: &IncidentBrief, stale: bool) {
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
        self.say(text);
    }

    fn on_no_decision(&mut self) -> Flow {
        let Some(p) = self.pending.take() else {
            return Flow::Go;
        };
        let status = p
            .exit
            .map_or("status unknown".to_owned(), |e| e.to_string());
        let wait = p.seen.elapsed();
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
            budget: self.job.fallback_budget,
            ..Default::default()
        };
        self.say(why);
        if self.fallback_used >= self.job.fallback_budget {
            let mut b = brief;
            b.action = "stop".into();
            return Flow::Finish {
                code: EXIT_BUDGET_SPENT,
                outcome: format!(
                    "failed: {} restart{} decided without the agent spent ({})",
                    self.job.fallback_budget,
                    if self.job.fallback_budget == 1 {
                        ""
                    } else {
                        "s"
                    },
                    if self.job.max_restarts.is_some() {
                        "--max-restarts"
                    } else {
                        "the policy's unknown budget"
                    }
                ),
                ended: format!("rank {} failed: {status}", p.rank),
                incident: Some(b),
            };
        }
        Flow::Restart(Box::new(Cause {
            brief,
            incident: None,
            backoff: Duration::ZERO,
            fallback: true,
            remote: false,
            since: p.seen,
            since_wall: p.seen_wall,
            decided: Instant::now(),
        }))
    }

    async fn on_signal(&mut self, sig: i32) -> Flow {
        let name = Signal::try_from(sig).map_or("a signal", |s| s.as_str());
        self.say(format!(
            "got {name}: forwarding it to the workers and stopping them (grace {}; send it again to kill at once)",
            humantime::format_duration(self.job.stop_grace)
        ));
        let first = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
        self.leaves_alone = true;
        self.stop_ranks(
            pb::StopKind::LauncherSignalled,
            &format!("the launcher got {name}"),
        )
        .await;
        self.stop_workers(first).await;
        Flow::Finish {
            code: exit::signalled(sig),
            outcome: format!("stopped on {name}"),
            ended: format!("stopped on {name}"),
            incident: None,
        }
    }

    /// The in-job restart (or a new round another host caused). Returns
    /// the summary when the job ends instead.
    async fn restart(&mut self, cause: Cause) -> Option<Summary> {
        if !cause.remote
            && let Some(k) = self.job.max_restarts
            && self.local_restarts >= k
        {
            self.say(format!("--max-restarts {k} reached: not restarting again"));
            return Some(
                self.finish(
                    EXIT_BUDGET_SPENT,
                    format!("failed: --max-restarts {k} spent"),
                    format!(
                        "{}: restart refused (--max-restarts {k})",
                        cause.brief.summary
                    ),
                    Some(cause.brief),
                )
                .await,
            );
        }
        if cause.fallback {
            self.fallback_used += 1;
        }
        if let Some(id) = &cause.incident {
            self.acted_on.insert(id.clone());
        }
        self.pending = None;
        let had_workers = !self.attempt.standby;
        let next = self.attempts_started;
        let reason = if cause.remote {
            format!("new round: {}", cause.brief.reason)
        } else {
            format!(
                "restart {next}: {}",
                if cause.brief.summary.is_empty() {
                    cause.brief.reason.clone()
                } else {
                    cause.brief.summary.clone()
                }
            )
        };
        if !cause.remote {
            self.local_restarts += 1;
            // First, so that the other hosts stop their workers meanwhile.
            let what = if cause.brief.summary.is_empty() {
                &cause.brief.reason
            } else {
                &cause.brief.summary
            };
            let told = format!(
                "{}{}: {}",
                cause.brief.id,
                if cause.brief.id.is_empty() {
                    cause.brief.class.clone()
                } else {
                    format!(" ({})", cause.brief.class)
                },
                clip(what, 160)
            );
            if let Err(e) = self
                .coord
                .publish(&Directive::RestartInJob { reason: told })
                .await
            {
                self.say(format!("could not tell the other nodes: {e}"));
            }
        }
        if had_workers {
            if cause.remote {
                self.say("stopping the workers for the new round");
            } else {
                self.say(format!(
                    "restarting in job (restart {}{}): stopping the workers",
                    self.local_restarts,
                    self.job
                        .max_restarts
                        .map_or(String::new(), |k| format!(" of at most {k}"))
                ));
            }
        }
        let stopped = if had_workers {
            self.stop_ranks(pb::StopKind::Restart, &reason).await;
            self.stop_workers(Signal::SIGTERM).await
        } else {
            Vec::new()
        };
        let t_stop = Instant::now();
        let release = if stopped.is_empty() {
            GpuRelease::Released(Duration::ZERO)
        } else {
            gate::gpu_release(
                stopped,
                self.job.gpu_release_timeout,
                self.nvml_library.clone(),
            )
            .await
        };
        match release {
            GpuRelease::Released(_) => {}
            GpuRelease::NoNvml(why) => {
                if self.restarts == 0 {
                    self.say(format!("GPU release wait skipped: {why}"));
                }
            }
            GpuRelease::TimedOut(pids) => self.say(format!(
                "GPUs still list stopped pids {pids:?} after {}; starting anyway",
                humantime::format_duration(self.job.gpu_release_timeout)
            )),
        }
        match gate::health_gate(&mut self.client, &self.job.id).await {
            Gate::Pass => {}
            Gate::Unchecked(why) => self.say(format!("health gate not checked: {why}")),
            Gate::Refused(why) => {
                self.say(format!("pre-restart health gate refused: {why}"));
                self.leaves_alone = true;
                let NodeFault::Exit(code) = self.coord.node_fault(&why).await;
                let mut b = cause.brief;
                b.reason = format!("{}; the health gate refused: {why}", b.reason);
                return Some(
                    self.finish(
                        code,
                        format!(
                            "this node is at fault (health gate: {why}); run the job elsewhere"
                        ),
                        "restart refused by the health gate".into(),
                        Some(b),
                    )
                    .await,
                );
            }
        }
        let t_gate = Instant::now();
        if !cause.backoff.is_zero() {
            self.say(format!(
                "backing off {} before the restart (policy)",
                humantime::format_duration(cause.backoff)
            ));
            tokio::select! {
                () = tokio::time::sleep(cause.backoff) => {}
                sig = self.signals.recv() => {
                    let name = Signal::try_from(sig).map_or("a signal", |s| s.as_str());
                    self.leaves_alone = true;
                    return Some(self.finish(exit::signalled(sig), format!("stopped on {name}"), format!("stopped on {name} during the backoff"), Some(cause.brief)).await);
                }
            }
        }
        let t_backoff = Instant::now();
        // Close the stopped attempt's record; its zombies are reaped in the
        // background (they hold their pids until then, so no group signalled
        // above can have been reused). A standby wait leaves no record.
        self.reapers.push(self.reap_attempt());
        if had_workers {
            let mut record = std::mem::take(&mut self.attempt.record);
            record.duration_s = self.attempt.started.elapsed().as_secs_f64();
            record.ended = match (record.failures.first(), cause.remote) {
                (Some((rank, status)), false) => {
                    format!("rank {rank} failed ({status}); restarted in job")
                }
                (Some((rank, status)), true) => {
                    format!("rank {rank} failed ({status}); stopped for a new round")
                }
                (None, false) => "restarted in job".into(),
                (None, true) => "stopped for a new round".into(),
            };
            record.incident = Some(cause.brief);
            record.restart = Some(RestartTiming {
                failure_seen_unix_s: unix_s(cause.since_wall),
                decision_ms: ms(cause.decided.duration_since(cause.since)),
                stop_ms: ms(t_stop.duration_since(cause.decided)),
                gate_ms: ms(t_gate.duration_since(t_stop)),
                backoff_ms: ms(t_backoff.duration_since(t_gate)),
                spawn_ms: 0.0,
                registered_ms: None,
            });
            self.history.push(record);
            self.attempt.recorded = true;
        }
        if self.coord.name() != LocalOnly.name() {
            self.say("waiting for the job's next round");
        }
        let plan = match self.agree(self.plan(next)).await {
            Ok(p) => p,
            Err(h) => return Some(self.halted(h, "not started").await),
        };
        if let Err(e) = self.start_attempt(&plan) {
            return Some(
                self.finish(
                    EXIT_LAUNCHER_ERROR,
                    format!("could not start the workers: {e}"),
                    format!("not started: {e}"),
                    None,
                )
                .await,
            );
        }
        if self.attempt.standby {
            return None;
        }
        if had_workers {
            self.restarts += 1;
            if let Some(r) = self.history.last_mut().and_then(|a| a.restart.as_mut()) {
                r.spawn_ms = ms(cause.since.elapsed());
            }
            self.awaiting_registration = Some((
                cause.since,
                if cause.remote {
                    "the new round"
                } else {
                    "the failure"
                },
            ));
        }
        self.say(format!(
            "attempt {}: workers started {:.2}s after the {}",
            plan.restart_count,
            cause.since.elapsed().as_secs_f64(),
            if cause.remote { "new round" } else { "failure" }
        ));
        None
    }

    /// Tells the agent the job's ranks are being stopped on purpose.
    async fn stop_ranks(&mut self, kind: pb::StopKind, reason: &str) {
        let req = pb::StopRanksRequest {
            job_id: self.job.id.clone(),
            reason: reason.to_owned(),
            kind: kind.into(),
            ranks: self.attempt.workers.iter().map(|w| w.rank).collect(),
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

    /// Stops every process of the current attempt: `first` to each worker's
    /// process group (and to marked orphans), SIGKILL after the grace (or at
    /// once on a second signal), until none is alive; reaps the orphans.
    /// Returns every pid of the job seen (for the GPU release wait).
    async fn stop_workers(&mut self, first: Signal) -> Vec<u32> {
        let sessions: HashSet<i32> = self.attempt.workers.iter().map(|w| w.pid).collect();
        let me = nix::unistd::getpid().as_raw();
        let mut all: HashSet<i32> = sessions.clone();
        if sessions.is_empty() {
            return Vec::new();
        }
        for &pgid in &sessions {
            spawn::signal_group(pgid, first);
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
                    if kill_end.is_none() {
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
        let pids: Vec<i32> = self.attempt.workers.iter().map(|w| w.pid).collect();
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

    async fn finish(
        &mut self,
        code: i32,
        outcome: String,
        ended: String,
        incident: Option<IncidentBrief>,
    ) -> Summary {
        // The other hosts first: they stop (a failed job) or go on without
        // this one while its workers stop.
        let stop = Directive::Stop {
            exit_code: code,
            reason: outcome.clone(),
            job_failed: code != exit::EXIT_SUCCESS && !self.leaves_alone,
        };
        if let Err(e) = self.coord.publish(&stop).await {
            self.say(format!("could not tell the other nodes: {e}"));
        }
        let any_alive = self
            .attempt
            .workers
            .iter()
            .any(|w| procfs_state(w.pid).is_some_and(|s| s != 'Z'));
        if any_alive {
            self.stop_ranks(pb::StopKind::JobEnding, &format!("job ending: {outcome}"))
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
            .attempt
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
        if !self.attempt.recorded && (!self.attempt.workers.is_empty() || self.history.is_empty()) {
            let mut record = std::mem::take(&mut self.attempt.record);
            record.duration_s = self.attempt.started.elapsed().as_secs_f64();
            record.ended = match record.failures.first() {
                Some((rank, status)) if !ended.contains("stopped on SIG") => {
                    format!("rank {rank} failed ({status}); {ended}")
                }
                _ => ended,
            };
            record.incident = incident;
            self.history.push(record);
        }
        if self.console.dropped() > 0 {
            self.say(format!(
                "{} worker lines did not fit the console (they are in the log files)",
                self.console.dropped()
            ));
        }
        Summary {
            job: self.job.id.clone(),
            agent: self.agent_line.clone(),
            outcome,
            exit_code: code,
            elapsed_s: self.started.elapsed().as_secs_f64(),
            log_dir: self.job.log_root.display().to_string(),
            attempts: std::mem::take(&mut self.history),
        }
    }
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

/// A lower-case name from a proto enum's name (`FAULT_CLASS_USER_ERROR` ->
/// `user_error`).
fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix)
        .unwrap_or(full)
        .to_ascii_lowercase()
}

/// The summary's view of an incident: class, confidence, summary, the
/// strongest evidence (what points somewhere first), the decision.
fn brief_of(inc: &pb::Incident) -> IncidentBrief {
    let diag = inc.diagnosis.clone().unwrap_or_default();
    let dec = inc.decision.clone().unwrap_or_default();
    let class = pb::FaultClass::try_from(diag.fault_class).map_or("unknown".into(), |c| {
        enum_name(c.as_str_name(), "FAULT_CLASS_")
    });
    let action = pb::Action::try_from(dec.action).map_or("unspecified".into(), |a| {
        enum_name(a.as_str_name(), "ACTION_")
    });
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
    fn a_free_port_is_found() {
        assert!(free_port("127.0.0.1").is_some_and(|p| p > 0));
    }
}
