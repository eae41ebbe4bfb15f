//! The launcher's coordinator across hosts without etcd: torchrun's c10d
//! rendezvous, run by torch itself ([`super::hosts::AcrossHosts`] on a
//! Python helper).
//!
//! In: `--rdzv-backend c10d --rdzv-endpoint HOST:PORT --nnodes N|MIN:MAX`
//! without `--node-rank` ([`config`]). Out: every attempt planned from
//! torch's rendezvous round (this host's node rank, the round's node count,
//! rank 0's address and a free port node 0 picked), the rounds other hosts
//! cause as [`Remote::NewRound`], another host's end of the job as a note
//! or a stop.
//!
//! How: the launcher starts `c10d_rdzv.py` (with `python -c`, in the
//! workers' interpreter, which has torch) and talks to it over its stdin and
//! stdout, one line a message. The helper runs torch's
//! `DynamicRendezvousHandler` on the `C10dRendezvousBackend` at the
//! endpoint, as `torchrun --rdzv-backend c10d` does: the launcher whose
//! address is the endpoint's hosts the `TCPStore`; every round is one
//! compare-and-set of torch's state in that store, so node ranks are
//! handed out once, 0..n-1, by whichever node completes the round. A
//! restart is torchrun's: this host joins the next round at once (torch
//! puts it on the wait list); the others see a node waiting and join too.
//! A lost host drops out when its heartbeats stop (torch's keep-alive);
//! the helper sees a participant of the round gone, and the next round is
//! smaller, or a node waiting beyond `--nnodes` MAX takes its place.
//!
//! Mapping: `rendezvous` is `join` and the helper's `round`;
//! `publish(RestartInJob)` is `join` at once (the wait list tells the
//! others); `publish(Stop)` is `end` (a note in the store, then torch's
//! `set_closed`) for a job finished or failed here, `leave` (torch's exit
//! op) when this host goes alone; `next_remote` is the helper's `news`,
//! `ended` and `note`; `publish_notice` is `notice` (the job's one notice
//! in the store, naming its round).
//!
//! A notice another host wrote reaches this one as the helper's `notice`,
//! read on a client of the store of the poll's own (so a join waiting in
//! torch does not hide it), with whether this node is in the notice's
//! round: if not (it left that round for a restart, waits for a later
//! one, or its workers run in another), it is between rounds, and its
//! workers could not meet that round's, which save its step and leave: the
//! rendezvous ends with 85 at once (not at torch's join timeout), or the
//! running workers are stopped with 85 ([`StoreNotice::between_rounds`]).
//!
//! Exit barrier (torchrun's agent's): a host whose job finished answers
//! its `end` only when every node of its round has ended, left or moved on
//! (a count in the store), at most [`EXIT_BARRIER`]; the last closes the
//! rendezvous. So the store's host never ends while another host still
//! needs the store (a round it is still finishing joining); a failed job
//! closes at once and does not wait.
//!
//! Never: take a line of the helper past [`MAX_LINE`] bytes, a node rank
//! outside the round, a round larger than `--nnodes` MAX, or a master
//! address that is not a host name or an IP address (it comes from the
//! store, which anyone reaching the endpoint can write); run or open
//! anything the store names.

use std::collections::VecDeque;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;

use super::args::{ArgsError, RunArgs};
use super::exit::{EXIT_LAUNCHER_ERROR, EXIT_NODE_FAULT, EXIT_PREEMPTED};
use super::hosts::{AcrossHosts, AcrossHostsError, AttemptPlan, Directive, NodeFault, Remote};
use super::output::Console;

/// The helper's program, run with `python -c`.
const SOURCE: &str = include_str!("c10d_rdzv.py");

/// The longest line the helper may write: its messages are a few hundred
/// bytes; anything longer is not its.
pub const MAX_LINE: usize = 16 * 1024;

/// torch's c10d port when the endpoint names none (torchrun's).
pub const DEFAULT_PORT: u16 = 29400;

/// The longest host name or address taken as rank 0's.
const MAX_ADDR: usize = 255;

/// How long a host whose job finished waits in the exit barrier for the
/// other nodes of its round to be done with it (torchrun's agent's
/// `exit_barrier_timeout`, 300 s by default; torchrun has no flag for it,
/// nor has `warden run`). Only a finished job waits, and only for nodes
/// that have neither ended, left nor moved to another round: a host gone
/// without a word (its heartbeats stopped) is the one that costs the bound.
pub const EXIT_BARRIER: Duration = Duration::from_secs(300);

/// How long an end or a leave may take in the helper before the launcher
/// goes on without its answer: the exit barrier's bound, then torch's
/// close (a few store round trips; 30 s for a loaded host). Shorter, and
/// the launcher would end the store's host (its helper is killed with the
/// coordinator) while the barrier still holds it for the others.
const DONE_WAIT: Duration = EXIT_BARRIER.saturating_add(Duration::from_secs(30));
// The launcher waits for the helper's answer longer than the helper waits
// in the barrier: else it ends the store's host mid-barrier.
const _: () = assert!(DONE_WAIT.as_secs() > EXIT_BARRIER.as_secs());

/// How long the helper may take to write a notice into the store.
const NOTICE_WAIT: Duration = Duration::from_secs(15);
/// How long an end may go unanswered before the console says the exit
/// barrier waits (most answer at once: every host ends about together).
const BARRIER_SAY: Duration = Duration::from_secs(10);
/// The furthest ahead a notice's deadline read from the store is believed.
const MAX_NOTICE_AHEAD: Duration = Duration::from_secs(3600);

/// How often the helper asks the store whether a node waits or left.
const POLL: Duration = Duration::from_millis(500);

/// `--rdzv-conf` keys handed to torch's handler and store as they are
/// (torchrun's meaning), each an integer of seconds or a count.
const TORCH_INT_KEYS: &[&str] = &[
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "close_timeout",
    "heartbeat_timeout",
];

/// What the helper runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct C10dConfig {
    /// The store's `HOST:PORT`.
    pub endpoint: String,
    /// The job id (torch's run id).
    pub run_id: String,
    /// `--nnodes` MIN.
    pub min_nodes: u32,
    /// `--nnodes` MAX.
    pub max_nodes: u32,
    /// Workers on this host (every host of the job runs as many).
    pub nproc_per_node: u32,
    /// This host's address for the others (`--local-addr`,
    /// `--advertise-addr`); torch's host name lookup when `None`.
    pub local_addr: Option<String>,
    /// Whether this launcher hosts the store: `--rdzv-conf is_host`, else
    /// whether its address is the endpoint's host, else torch's guess.
    pub is_host: Option<bool>,
    /// How long a round may take to form (`join_timeout`).
    pub join_timeout: Duration,
    /// torch's settings: `join_timeout`, `last_call_timeout` and the
    /// [`TORCH_INT_KEYS`] given.
    pub torch: Vec<(String, u64)>,
    /// `--rdzv-conf` keys neither warden nor torch's c10d rendezvous reads.
    pub ignored: Vec<String>,
    /// The interpreter: the workers' when the command is a Python
    /// entrypoint, else `$PYTHON`, else `python3`.
    pub python: String,
}

/// The helper's config from `warden run`'s flags for job `job`.
pub fn config(args: &RunArgs, job: &str) -> Result<C10dConfig, ArgsError> {
    let (host, port) = args.endpoint()?;
    let port = port.unwrap_or(DEFAULT_PORT);
    let endpoint = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let local_addr = args
        .advertise_addr
        .clone()
        .or_else(|| args.torchrun.local_addr.clone());
    let join_timeout = args.rdzv_conf.join_timeout();
    // torch takes whole seconds, at least one.
    let secs = |d: Duration| d.as_secs_f64().ceil().max(1.0) as u64;
    let mut torch = vec![("join_timeout".to_owned(), secs(join_timeout))];
    torch.push((
        "last_call_timeout".to_owned(),
        secs(args.rdzv_conf.last_call.unwrap_or(Duration::from_secs(2))),
    ));
    let mut is_host = local_addr.as_deref().map(|a| a == host);
    let mut ignored = Vec::new();
    for (k, v) in &args.rdzv_conf.other {
        if k == "is_host" {
            is_host = Some(match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "y" | "on" => true,
                "0" | "false" | "no" | "n" | "off" => false,
                _ => {
                    return Err(ArgsError::Torchrun(format!(
                        "--rdzv-conf is_host={v}: not a boolean (true or false)"
                    )));
                }
            });
        } else if TORCH_INT_KEYS.contains(&k.as_str()) {
            let n = v.parse::<u64>().ok().filter(|n| (1..=86_400).contains(n));
            let Some(n) = n else {
                return Err(ArgsError::Torchrun(format!(
                    "--rdzv-conf {k}={v}: a whole number from 1 to 86400"
                )));
            };
            torch.push((k.clone(), n));
        } else {
            ignored.push(k.clone());
        }
    }
    let argv = args.argv();
    let python = crate::standby::Entry::of(&argv)
        .map(|e| e.python)
        .or_else(|| std::env::var("PYTHON").ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| "python3".to_owned());
    Ok(C10dConfig {
        endpoint,
        run_id: job.to_owned(),
        min_nodes: args.nnodes.min,
        max_nodes: args.nnodes.max,
        nproc_per_node: args.nproc_per_node,
        local_addr,
        is_host,
        join_timeout,
        torch,
        ignored,
        python,
    })
}

impl C10dConfig {
    /// The helper's argv[1]: what it runs with, as JSON.
    fn helper_json(&self) -> String {
        let mut torch = serde_json::Map::new();
        for (k, v) in &self.torch {
            torch.insert(k.clone(), serde_json::Value::from(*v));
        }
        if let Some(h) = self.is_host {
            torch.insert("is_host".into(), serde_json::Value::from(h));
        }
        serde_json::json!({
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "local_addr": self.local_addr,
            "poll_s": POLL.as_secs_f64(),
            "exit_barrier_s": EXIT_BARRIER.as_secs_f64(),
            "torch": torch,
        })
        .to_string()
    }

    /// One line for the console.
    pub fn describe(&self) -> String {
        format!(
            "node rank from torch's c10d rendezvous at {} (--nnodes {}:{}; {}; this host {})",
            self.endpoint,
            self.min_nodes,
            self.max_nodes,
            match self.is_host {
                Some(true) => "this launcher hosts the store",
                Some(false) => "another host's launcher hosts the store",
                None => "torch decides which launcher hosts the store",
            },
            self.local_addr.as_deref().unwrap_or("by its host name"),
        )
    }
}

/// Another host's end of the job, as it left it in the store.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct End {
    /// `finished` or `failed`.
    pub outcome: String,
    /// A failed job's status.
    pub exit_code: Option<i32>,
    /// The address of the host that ended it.
    pub by: String,
}

/// One line of the helper.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
enum Event {
    /// The store is reached and the handler made.
    Ready,
    /// A round this host is in.
    Round {
        round: u64,
        rank: u32,
        world: u32,
        master_addr: String,
        master_port: u16,
    },
    /// Round `round` is over for this host: another waits or one is gone.
    News { round: u64, why: String },
    /// Another host ended the job (closed the rendezvous).
    Ended { end: Option<End> },
    /// Worth a line on the console.
    Note { text: String },
    /// A join failed: `closed`, `timeout` or `store`.
    Error {
        kind: String,
        text: String,
        #[serde(default)]
        end: Option<End>,
    },
    /// An end or a leave was carried out.
    Done,
    /// The job's notice after this host's `notice`: this host's, or the
    /// one another host wrote first (None: the store could not be asked).
    NoticeSet {
        notice: Option<StoreNotice>,
        #[serde(default)]
        text: String,
    },
    /// Another host's notice of a coming stop, seen once; `in_round`:
    /// this host is in the round it was written in (false: it left that
    /// round, waits for a later one, or the others moved on).
    Notice {
        notice: StoreNotice,
        #[serde(default = "yes")]
        in_round: bool,
    },
}

fn yes() -> bool {
    true
}

/// The job's notice of a coming stop, as the helper read it from the store
/// (bounded and checked there, checked again by [`StoreNotice::remote`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StoreNotice {
    /// The step at whose boundary every rank of the job saves.
    pub step: u64,
    /// When the stop comes (ms since the Unix epoch; 0: not said).
    pub deadline_ms: u64,
    /// Why, for the console.
    pub reason: String,
    /// The address of the host that got it.
    pub by: String,
    /// The round of torch's rendezvous it was written in (`None`: not
    /// said).
    #[serde(default)]
    pub round: Option<u64>,
}

impl StoreNotice {
    /// What a host between rounds is told (`in_round` false: it left the
    /// notice's round, or waits for a later one nobody will make): its
    /// workers could not meet that round's, which save its step and
    /// leave, so none run here and the launcher exits 85 too.
    fn between_rounds(&self) -> AcrossHostsError {
        AcrossHostsError {
            message: format!(
                "host {} got a notice ({}) in round {} of torch's c10d rendezvous while this host was between rounds: every rank of that round saves at step {} and the job stops; this host's workers do not run again",
                plain(&self.by),
                plain(&self.reason),
                self.round.map_or("?".to_owned(), |r| r.to_string()),
                self.step
            ),
            exit_code: EXIT_PREEMPTED,
        }
    }

    /// What the machine is told of a notice while its workers run: the
    /// notice, or, when they are not in its round, a stop with 85
    /// ([`Self::between_rounds`]).
    fn remote_here(&self, in_round: bool) -> Remote {
        if in_round {
            return self.remote();
        }
        let e = self.between_rounds();
        Remote::Stop {
            exit_code: e.exit_code,
            reason: e.message,
        }
    }

    /// What the machine is told. A deadline more than [`MAX_NOTICE_AHEAD`]
    /// away is not believed (anyone who reaches the store can write it):
    /// the notice stands, with no deadline.
    fn remote(&self) -> Remote {
        let deadline = (self.deadline_ms != 0)
            .then(|| std::time::UNIX_EPOCH + Duration::from_millis(self.deadline_ms))
            .filter(|d| {
                d.duration_since(std::time::SystemTime::now())
                    .map_or(true, |ahead| ahead <= MAX_NOTICE_AHEAD)
            });
        Remote::Notice {
            step: self.step,
            deadline,
            reason: format!(
                "host {} got a notice ({})",
                plain(&self.by),
                plain(&self.reason)
            ),
        }
    }
}

/// A plain string of a peer, for the console: control characters out,
/// bounded.
fn plain(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(400).collect()
}

/// A host name or IP address, as rank 0's address may be: it becomes
/// `MASTER_ADDR` only, never a path or a program.
pub fn valid_addr(a: &str) -> bool {
    !a.is_empty()
        && a.len() <= MAX_ADDR
        && a.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_' | '[' | ']' | '%')
        })
}

/// Checks a round the helper reports against the job's bounds: the plan of
/// the attempt, or why it is not one.
fn plan_of(
    cfg: &C10dConfig,
    restart_count: u32,
    round: u64,
    rank: u32,
    world: u32,
    master_addr: &str,
    master_port: u16,
) -> Result<AttemptPlan, String> {
    if world < cfg.min_nodes.max(1) || world > cfg.max_nodes {
        return Err(format!(
            "round {round} has {world} nodes, outside --nnodes {}:{}",
            cfg.min_nodes, cfg.max_nodes
        ));
    }
    if rank >= world {
        return Err(format!(
            "round {round}: node rank {rank} is not below {world}"
        ));
    }
    if !valid_addr(master_addr) || master_port == 0 {
        return Err(format!(
            "round {round}: rank 0's address {:?}:{master_port} is not a host and port",
            plain(&master_addr.chars().take(80).collect::<String>())
        ));
    }
    let world_size = world.checked_mul(cfg.nproc_per_node).ok_or_else(|| {
        format!(
            "round {round}: {world} nodes x {} workers overflow",
            cfg.nproc_per_node
        )
    })?;
    Ok(AttemptPlan {
        restart_count,
        master_addr: master_addr.to_owned(),
        master_port,
        node_rank: Some(rank),
        nnodes: world,
        world_size,
        rank_offset: rank * cfg.nproc_per_node,
        epoch: Some(round),
        round: Some(format!(
            "round {round} (torch's c10d rendezvous at {}): {world} host{}, world size {world_size}, master {master_addr}:{master_port}; this host: node rank {rank}",
            cfg.endpoint,
            if world == 1 { "" } else { "s" },
        )),
        ckpt_peers: Default::default(),
        keeps_place: false,
    })
}

/// A launcher's membership in a multi-host job through torch's c10d
/// rendezvous.
#[derive(Debug)]
pub struct C10dCoordinator {
    cfg: C10dConfig,
    /// The helper; killed when the coordinator is dropped (and by its
    /// parent-death signal when the launcher dies).
    child: Child,
    /// Its stdin; `None` once closed.
    stdin: Option<ChildStdin>,
    /// Its lines, parsed; closed when it exits.
    events: mpsc::Receiver<Event>,
    /// A join was sent and its round not taken yet.
    joining: bool,
    /// The round of the current attempt.
    round: Option<u64>,
    /// Another host ended the job.
    ended: Option<Option<End>>,
    /// The helper is gone.
    gone: bool,
    /// What to tell the machine next, before reading the helper again.
    pending: VecDeque<Remote>,
    /// The nodes of the current round.
    world: u32,
    /// The launcher's console: what the helper says while the job ends
    /// (the exit barrier's wait, a barrier given up), when the machine no
    /// longer reads [`AcrossHosts::next_remote`].
    console: Console,
}

impl C10dCoordinator {
    /// Starts the helper; its stderr goes to `log`. The store is reached
    /// (or hosted) in the background: the first rendezvous waits for it.
    pub fn start(
        cfg: C10dConfig,
        log: &Path,
        cwd: &Path,
        console: Console,
    ) -> Result<Self, AcrossHostsError> {
        let stderr = std::fs::File::create(log).map_err(|e| {
            AcrossHostsError::new(format!(
                "cannot create the rendezvous helper's log {}: {e}",
                log.display()
            ))
        })?;
        let mut cmd = Command::new(&cfg.python);
        cmd.arg("-c")
            .arg(SOURCE)
            .arg(cfg.helper_json())
            .env_remove(crate::coord::etcd_flags::PASSWORD_ENV)
            .env_remove(super::env::MARKER)
            // `python -c` puts the working directory first on sys.path;
            // the helper runs in the launcher's own log directory, and
            // with this (3.11+) not even that.
            .env("PYTHONSAFEPATH", "1")
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        let parent = nix::unistd::getpid().as_raw();
        // SAFETY: the closure runs in the forked child before exec and
        // calls only async-signal-safe functions (prctl, getppid),
        // allocating nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            AcrossHostsError::new(format!(
                "cannot start the c10d rendezvous helper with {}: {e}",
                cfg.python
            ))
        })?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| AcrossHostsError::new("the rendezvous helper has no stdout"))?;
        let (tx, events) = mpsc::channel(64);
        tokio::spawn(read_lines(stdout, tx));
        Ok(Self {
            cfg,
            child,
            stdin,
            events,
            joining: false,
            round: None,
            ended: None,
            gone: false,
            pending: VecDeque::new(),
            world: 0,
            console,
        })
    }

    /// The helper's pid.
    pub fn helper_pid(&self) -> Option<u32> {
        self.child.id()
    }

    async fn send(&mut self, line: &str) -> Result<(), AcrossHostsError> {
        let Some(stdin) = self.stdin.as_mut() else {
            return Err(AcrossHostsError::new("the rendezvous helper is gone"));
        };
        let mut text = line.to_owned();
        text.push('\n');
        let sent = tokio::time::timeout(Duration::from_secs(5), stdin.write_all(text.as_bytes()))
            .await
            .map_err(|_| std::io::Error::other("the helper did not read its input within 5 s"))
            .and_then(|r| r);
        sent.map_err(|e| {
            self.stdin = None;
            AcrossHostsError::new(format!("cannot reach the rendezvous helper: {e}"))
        })
    }

    async fn join(&mut self) -> Result<(), AcrossHostsError> {
        if !self.joining {
            self.send("join").await?;
            self.joining = true;
        }
        Ok(())
    }

    fn ended_error(&self, end: Option<&End>, text: &str) -> AcrossHostsError {
        match end {
            Some(End {
                outcome,
                exit_code: Some(code),
                by,
            }) if outcome == "failed" => AcrossHostsError {
                message: format!("the job failed on {by} (exit {code}): {}", plain(text)),
                exit_code: *code,
            },
            Some(e) => AcrossHostsError::new(format!(
                "the job ended on {} ({}): no more rounds",
                e.by, e.outcome
            )),
            None => AcrossHostsError::new(format!(
                "torch's rendezvous was closed by another host: {}",
                plain(text)
            )),
        }
    }

    /// The helper's answer to an end or a leave, within [`DONE_WAIT`]
    /// (events meanwhile are of no use any more, but for its notes, which
    /// go to the console). An answer slower than [`BARRIER_SAY`] is the exit
    /// barrier waiting for another host: said once.
    async fn await_done(&mut self, finished: bool) {
        let console = self.console.clone();
        let (round, world) = (self.round, self.world);
        let events = &mut self.events;
        let wait = async {
            let said = tokio::time::sleep(BARRIER_SAY);
            tokio::pin!(said);
            let mut waiting = finished && world > 1;
            loop {
                tokio::select! {
                    ev = events.recv() => match ev {
                        None | Some(Event::Done) => return,
                        Some(Event::Note { text }) => {
                            console.say(format!("c10d rendezvous: {}", plain(&text)));
                        }
                        Some(_) => {}
                    },
                    () = &mut said, if waiting => {
                        waiting = false;
                        console.say(format!(
                            "the job finished here; waiting for the other hosts of round {} to be done with it (torchrun's exit barrier, at most {:?})",
                            round.unwrap_or_default(),
                            EXIT_BARRIER
                        ));
                    }
                }
            }
        };
        if tokio::time::timeout(DONE_WAIT, wait).await.is_err() {
            self.console.say(format!(
                "c10d rendezvous: the helper did not answer within {DONE_WAIT:?}; going on without it"
            ));
        }
    }
}

/// Reads the helper's lines into `tx`, each at most [`MAX_LINE`] bytes;
/// stops (and so closes the channel) at its end, a longer line or a read
/// error. A line that is not one of its messages is logged and skipped.
async fn read_lines(stdout: ChildStdout, tx: mpsc::Sender<Event>) {
    let mut r = BufReader::new(stdout);
    let mut buf = Vec::with_capacity(512);
    loop {
        buf.clear();
        let limit = u64::try_from(MAX_LINE + 1).unwrap_or(u64::MAX);
        match (&mut r).take(limit).read_until(b'\n', &mut buf).await {
            Ok(0) => return,
            Ok(_) if buf.last() != Some(&b'\n') && buf.len() > MAX_LINE => {
                tracing::warn!(
                    "launcher: the rendezvous helper wrote a line of more than {MAX_LINE} bytes: not listening to it any more"
                );
                return;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "launcher: reading the rendezvous helper");
                return;
            }
        }
        match serde_json::from_slice::<Event>(&buf) {
            Ok(ev) => {
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            Err(e) => tracing::warn!(
                error = %e,
                line = %plain(&String::from_utf8_lossy(&buf)),
                "launcher: a line of the rendezvous helper that is not one of its messages"
            ),
        }
    }
}

impl AcrossHosts for C10dCoordinator {
    fn name(&self) -> &'static str {
        "c10d"
    }

    async fn rendezvous(&mut self, proposed: AttemptPlan) -> Result<AttemptPlan, AcrossHostsError> {
        if let Some(end) = self.ended.clone() {
            return Err(self.ended_error(end.as_ref(), "the job ended elsewhere"));
        }
        self.join().await?;
        // torch's own join timeout ends the wait first; this one only
        // bounds a helper that says nothing (its store read timeout and
        // the start of an interpreter importing torch on a loaded host).
        let deadline =
            tokio::time::Instant::now() + self.cfg.join_timeout + Duration::from_secs(180);
        loop {
            let ev = tokio::time::timeout_at(deadline, self.events.recv()).await;
            let ev = match ev {
                Err(_) => {
                    return Err(AcrossHostsError::new(format!(
                        "no round from torch's c10d rendezvous at {} within {:?}",
                        self.cfg.endpoint,
                        self.cfg.join_timeout + Duration::from_secs(180)
                    )));
                }
                Ok(None) => {
                    self.gone = true;
                    return Err(AcrossHostsError::new(format!(
                        "the c10d rendezvous helper exited (its log: rendezvous.log in the job's log directory); store {}",
                        self.cfg.endpoint
                    )));
                }
                Ok(Some(ev)) => ev,
            };
            match ev {
                Event::Round {
                    round,
                    rank,
                    world,
                    master_addr,
                    master_port,
                } => {
                    self.joining = false;
                    let plan = plan_of(
                        &self.cfg,
                        proposed.restart_count,
                        round,
                        rank,
                        world,
                        &master_addr,
                        master_port,
                    )
                    .map_err(|why| {
                        AcrossHostsError::new(format!("torch's rendezvous: {why}: refused"))
                    })?;
                    self.round = Some(round);
                    self.world = world;
                    return Ok(plan);
                }
                Event::Error { kind, text, end } => {
                    self.joining = false;
                    return Err(match kind.as_str() {
                        "closed" => self.ended_error(end.as_ref(), &text),
                        "timeout" => AcrossHostsError::new(format!(
                            "no round of at least {} node(s) formed within join_timeout {:?} at {}: {}",
                            self.cfg.min_nodes,
                            self.cfg.join_timeout,
                            self.cfg.endpoint,
                            plain(&text)
                        )),
                        _ => AcrossHostsError::new(format!(
                            "torch's c10d rendezvous at {}: {}",
                            self.cfg.endpoint,
                            plain(&text)
                        )),
                    });
                }
                Event::Ended { end } => self.ended = Some(end),
                Event::Note { text } => self
                    .pending
                    .push_back(Remote::Note(format!("c10d rendezvous: {}", plain(&text)))),
                // A notice of a round this host is not joining: its hosts
                // save and leave, and the round this host waits for
                // will not come (torch's join would wait until its
                // timeout).
                Event::Notice {
                    notice,
                    in_round: false,
                } => return Err(notice.between_rounds()),
                // The round this host joins: its workers are told once
                // they run, as the others' were.
                Event::Notice { notice, .. } => self.pending.push_back(notice.remote()),
                Event::Ready | Event::News { .. } | Event::Done | Event::NoticeSet { .. } => {}
            }
        }
    }

    async fn publish(&mut self, d: &Directive) -> Result<(), AcrossHostsError> {
        match d {
            Directive::RestartInJob { .. } => {
                if let Some(end) = self.ended.clone() {
                    return Err(self.ended_error(end.as_ref(), "no restart across hosts"));
                }
                // torchrun's restart: into the next round at once; torch
                // puts this host on the wait list, which the others see.
                self.join().await
            }
            Directive::Stop {
                exit_code,
                reason,
                job_failed,
            } => {
                if self.gone || self.stdin.is_none() {
                    return Ok(());
                }
                let by = self.cfg.local_addr.clone().unwrap_or_default();
                let line = if *exit_code == 0 {
                    format!(
                        "end {}",
                        serde_json::json!({"outcome": "finished", "exit_code": null, "by": by})
                    )
                } else if *job_failed && self.ended.is_none() {
                    format!(
                        "end {}",
                        serde_json::json!({"outcome": "failed", "exit_code": exit_code, "by": by})
                    )
                } else {
                    tracing::info!(reason = %reason, "launcher: leaving torch's rendezvous");
                    "leave".to_owned()
                };
                let sent = self.send(&line).await;
                if sent.is_ok() {
                    self.await_done(*exit_code == 0).await;
                }
                sent
            }
        }
    }

    async fn next_remote(&mut self) -> Remote {
        if let Some(r) = self.pending.pop_front() {
            return r;
        }
        if self.gone || self.ended.is_some() {
            return std::future::pending().await;
        }
        loop {
            let Some(ev) = self.events.recv().await else {
                self.gone = true;
                return Remote::Stop {
                    exit_code: EXIT_LAUNCHER_ERROR,
                    reason: format!(
                        "the c10d rendezvous helper exited (its log: rendezvous.log in the job's log directory): this host can take part in no round at {}",
                        self.cfg.endpoint
                    ),
                };
            };
            match ev {
                Event::News { round, why } if Some(round) == self.round && !self.joining => {
                    return Remote::NewRound {
                        reason: format!(
                            "round {round} of torch's c10d rendezvous: {}",
                            plain(&why)
                        ),
                        keeps_place: false,
                    };
                }
                Event::Ended { end } => {
                    self.ended = Some(end.clone());
                    return match end {
                        Some(End {
                            outcome,
                            exit_code: Some(code),
                            by,
                        }) if outcome == "failed" => Remote::Stop {
                            exit_code: code,
                            reason: format!("the job failed on {by} (exit {code})"),
                        },
                        Some(e) => Remote::Note(format!(
                            "host {} finished its part of the job: no more rounds; the workers here finish theirs",
                            e.by
                        )),
                        None => Remote::Note(
                            "another host closed torch's rendezvous: no more rounds; the workers here finish theirs"
                                .to_owned(),
                        ),
                    };
                }
                Event::Note { text } => {
                    return Remote::Note(format!("c10d rendezvous: {}", plain(&text)));
                }
                Event::Notice { notice, in_round } => return notice.remote_here(in_round),
                _ => {}
            }
        }
    }

    async fn publish_notice(
        &mut self,
        step: u64,
        deadline: std::time::SystemTime,
        reason: &str,
    ) -> Result<u64, AcrossHostsError> {
        let ms = crate::hosts::unix_ms(deadline);
        let by = self.cfg.local_addr.clone().unwrap_or_default();
        let reason: String = reason.chars().take(300).collect();
        self.send(&format!(
            "notice {}",
            serde_json::json!({"step": step, "deadline_ms": ms, "reason": reason, "by": by})
        ))
        .await?;
        // The store's answer; what comes meanwhile is kept for next_remote.
        let wait = async {
            while let Some(ev) = self.events.recv().await {
                match ev {
                    Event::NoticeSet { notice, text } => return Some((notice, text)),
                    Event::Note { text } => self
                        .pending
                        .push_back(Remote::Note(format!("c10d rendezvous: {}", plain(&text)))),
                    Event::Notice { notice, in_round } => {
                        self.pending.push_back(notice.remote_here(in_round));
                    }
                    Event::News { round, why } if Some(round) == self.round && !self.joining => {
                        self.pending.push_back(Remote::NewRound {
                            reason: format!(
                                "round {round} of torch's c10d rendezvous: {}",
                                plain(&why)
                            ),
                            keeps_place: false,
                        });
                    }
                    Event::Ended { end } => self.ended = Some(end),
                    _ => {}
                }
            }
            None
        };
        match tokio::time::timeout(NOTICE_WAIT, wait).await {
            Ok(Some((Some(n), _))) => Ok(n.step),
            Ok(Some((None, text))) => Err(AcrossHostsError::new(format!(
                "the notice could not be written into torch's store at {}: {}",
                self.cfg.endpoint,
                plain(&text)
            ))),
            Ok(None) => {
                self.gone = true;
                Err(AcrossHostsError::new(
                    "the c10d rendezvous helper exited before it wrote the notice",
                ))
            }
            Err(_) => Err(AcrossHostsError::new(format!(
                "the rendezvous helper did not write the notice within {NOTICE_WAIT:?}"
            ))),
        }
    }

    async fn node_fault(&mut self, reason: &str) -> NodeFault {
        let stop = Directive::Stop {
            exit_code: EXIT_NODE_FAULT,
            reason: reason.to_owned(),
            job_failed: false,
        };
        if let Err(e) = self.publish(&stop).await {
            tracing::warn!(error = %e, "launcher: leaving torch's rendezvous after a node fault failed");
        }
        NodeFault::Exit(EXIT_NODE_FAULT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> C10dConfig {
        C10dConfig {
            endpoint: "10.0.0.1:29400".into(),
            run_id: "j".into(),
            min_nodes: 1,
            max_nodes: 4,
            nproc_per_node: 8,
            local_addr: Some("10.0.0.2".into()),
            is_host: Some(false),
            join_timeout: Duration::from_secs(600),
            torch: Vec::new(),
            ignored: Vec::new(),
            python: "python3".into(),
        }
    }

    /// What the store says is checked against the job: a round within
    /// --nnodes, a node rank in it, rank 0's address a host and a port.
    #[test]
    fn a_round_from_the_store_is_checked_before_it_becomes_a_plan() {
        let c = cfg();
        let p = plan_of(&c, 3, 7, 2, 3, "10.0.0.1", 41000).unwrap();
        assert_eq!(
            (p.node_rank, p.nnodes, p.world_size, p.rank_offset, p.epoch),
            (Some(2), 3, 24, 16, Some(7))
        );
        assert_eq!(p.restart_count, 3);
        assert!(
            plan_of(&c, 0, 1, 3, 3, "a", 1)
                .unwrap_err()
                .contains("node rank 3")
        );
        assert!(
            plan_of(&c, 0, 1, 0, 5, "a", 1)
                .unwrap_err()
                .contains("outside --nnodes")
        );
        assert!(plan_of(&c, 0, 1, 0, 0, "a", 1).is_err());
        for bad in [
            "",
            "/etc/passwd",
            "a b",
            "$(reboot)",
            "x\ny",
            &"h".repeat(256),
        ] {
            assert!(plan_of(&c, 0, 1, 0, 1, bad, 1).is_err(), "{bad:?}");
        }
        assert!(
            plan_of(&c, 0, 1, 0, 1, "node-7.example", 0).is_err(),
            "port 0"
        );
        assert!(plan_of(&c, 0, 1, 0, 1, "[fd00::1]", 5).is_ok());
    }

    fn args(line: &[&str]) -> RunArgs {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Wrap {
            #[command(flatten)]
            run: RunArgs,
        }
        let mut a = Wrap::try_parse_from(std::iter::once("run").chain(line.iter().copied()))
            .map(|w| w.run)
            .unwrap();
        a.resolve(|| Ok(8), || 16, |_| Ok(0)).unwrap();
        a
    }

    /// The launcher whose address is the endpoint's hosts the store
    /// (`is_host` overrides); torch's keys are taken as whole numbers and
    /// checked; others are named as ignored.
    #[test]
    fn the_config_follows_torchruns_flags() {
        let base = [
            "--nnodes",
            "1:3",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "10.0.0.1",
        ];
        let with = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            v.push("t.py");
            config(&args(&v), "j")
        };
        let c = with(&["--local-addr", "10.0.0.1"]).unwrap();
        assert_eq!(c.endpoint, "10.0.0.1:29400");
        assert_eq!((c.min_nodes, c.max_nodes, c.nproc_per_node), (1, 3, 2));
        assert_eq!(c.is_host, Some(true));
        assert_eq!(
            with(&["--local-addr", "10.0.0.2"]).unwrap().is_host,
            Some(false)
        );
        assert_eq!(with(&[]).unwrap().is_host, None, "torch's guess");
        let c = with(&[
            "--local-addr",
            "10.0.0.2",
            "--rdzv-conf",
            "is_host=yes,keep_alive_interval=2,last_call_timeout=0.5,store_type=file",
        ])
        .unwrap();
        assert_eq!(c.is_host, Some(true));
        assert!(c.torch.contains(&("keep_alive_interval".to_owned(), 2)));
        assert!(
            c.torch.contains(&("last_call_timeout".to_owned(), 1)),
            "whole seconds, at least 1: {:?}",
            c.torch
        );
        assert_eq!(
            c.ignored,
            ["store_type"],
            "only a TCP store at the endpoint"
        );
        for bad in ["keep_alive_interval=0", "read_timeout=x", "is_host=maybe"] {
            assert!(
                matches!(with(&["--rdzv-conf", bad]), Err(ArgsError::Torchrun(_))),
                "{bad}"
            );
        }
        let json: serde_json::Value = serde_json::from_str(&c.helper_json()).unwrap();
        assert_eq!(json["torch"]["is_host"], true);
        assert_eq!(json["max_nodes"], 3);
        assert_eq!(json["exit_barrier_s"], 300.0, "torchrun's bound");
    }

    /// The helper's messages parse; an unknown one does not.
    #[test]
    fn helper_lines_parse() {
        let ev: Event = serde_json::from_str(
            r#"{"ev":"round","round":2,"rank":1,"world":2,"master_addr":"127.0.0.2","master_port":4000}"#,
        )
        .unwrap();
        assert!(matches!(
            ev,
            Event::Round {
                rank: 1,
                world: 2,
                ..
            }
        ));
        let ev: Event = serde_json::from_str(
            r#"{"ev":"error","kind":"closed","text":"x","end":{"outcome":"failed","exit_code":3,"by":"h"}}"#,
        )
        .unwrap();
        assert!(matches!(
            ev,
            Event::Error {
                end: Some(End {
                    exit_code: Some(3),
                    ..
                }),
                ..
            }
        ));
        assert!(serde_json::from_str::<Event>(r#"{"ev":"run","cmd":"rm"}"#).is_err());
        assert!(
            serde_json::from_str::<Event>(
                r#"{"ev":"round","round":1,"rank":-1,"world":2,"master_addr":"a","master_port":1}"#
            )
            .is_err()
        );
    }
}
