//! In-process restarts: the ranks of a job keep their processes (interpreter,
//! imports, CUDA context) and run their training function again from the
//! local checkpoint.
//!
//! In: a `restart_in_process` decision ([`start`], from the attribution
//! task), a `RequestRestart` call or a rank's transient exception
//! ([`request`]); the ranks' acknowledgements (`AckControl`, [`ack`], or
//! the slot's ack word, whichever comes first). Out, for every live local
//! rank of the job: the request in its slot's control word
//! ([`warden_slot::ControlWord`]) and on its `Control` stream
//! ([`subscribe`]), the event `restart.requested`, and a waiter that
//! reports `restart.acknowledged` once every rank answered, or
//! `restart.in_process_timeout` after `restart.in_process_timeout`,
//! escalating the incident to `restart_in_job` through
//! [`Handles::escalations`] so the launcher restarts the processes. A rank
//! that exits or registers again meanwhile counts as handled: its launcher
//! restarts it. A rank whose process is stopped (SIGSTOP: state T or t
//! for [`STOPPED_FOR`]) can never answer: the waiter asks at once for it
//! alone to be replaced (`restart.replace_ranks`, a revision of the
//! incident's `restart_in_process` decision carrying a
//! [`warden_core::policy::Replacement`]), and goes on waiting for the
//! others; the launcher's StopRanks for it makes it handled. Besides, the
//! ranks' flight-recorder dumps travel on the same streams ([`ask_dump`]).
//!
//! Never: block the caller (the waiter is a task of its own, and every lock
//! is held for a few map operations), hold the registry and the restart
//! state at once, or ask a rank that is not alive.
//!
//! The rooms:
//! - `request.rs`: who asks and what is sent (the request, the slots, the
//!   streams armed, the waiter spawned; the exception restarts' budget);
//! - `control.rs`: the per-rank `Control` streams and `AckControl`;
//! - `dump.rs`: flight-recorder dump requests on those streams;
//! - `exception.rs`: the answer to a rank's reported exception that waits
//!   on it (a restart in process or a stop), within the policy's budget;
//! - `waiter.rs`: the pure machine that decides, from acknowledgements,
//!   exits, process states and the clock, when to wait, replace, escalate
//!   or finish (replayed from recorded scenarios in `scenarios.rs`);
//! - `report.rs`: the events, counts and escalations its decisions make;
//! - here: the shared state and the glue that feeds the registry's view,
//!   /proc readings and timers into the machine and carries its decisions
//!   out.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use warden_core::attribute::Escalation;
use warden_core::events::EventBus;

use crate::ranks::RankKey;
use crate::ranks::procfs;
use crate::ranks::registry::{RankState, Registry, SharedRegistry};

pub mod control;
pub mod dump;
pub mod exception;
mod report;
pub mod request;
#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod tests;
pub mod waiter;

pub use control::{ControlError, RankRequest, ack, subscribe};
pub use dump::{DumpRequest, ask_dump, end_dump, subscribe_dumps};
pub use request::{
    Asked, RestartError, admit_exception_restart, request, request_replacing, start,
};
use waiter::{Gone, Via, Waiter, WaiterInput, WaiterStep, Waiting};
pub use waiter::{JobRestart, STOPPED_FOR};

/// How often the waiter reads the ranks' ack words from their slots (an
/// `AckControl` call wakes it at once).
const ACK_POLL: Duration = Duration::from_millis(5);

/// The request in flight for a job.
#[derive(Debug)]
struct Pending {
    /// Its wait, as the pure machine keeps it.
    waiter: Waiter,
    /// Wakes the waiter's task (an `AckControl` came).
    wake: Arc<Notify>,
    /// When it was asked, on the wall clock (evidence is timed on it).
    asked_at: SystemTime,
}

#[derive(Debug, Default)]
struct JobRestarts {
    /// Requests made for the job since this agent started.
    restart_count: u32,
    /// When each restart a rank's own exception asked for was admitted
    /// (those within the transient class's budget window).
    exception_restarts: VecDeque<Instant>,
    /// The request in flight, until every rank answered or the deadline.
    pending: Option<Pending>,
    /// The last request that every rank answered (acknowledged, or handled
    /// by its launcher): a `restart_in_process` decision about evidence it
    /// followed is already carried out ([`request::start`]).
    last_answered: Option<Answered>,
}

/// A request every rank answered, on the wall clock (evidence is timed on
/// it).
#[derive(Debug, Clone)]
struct Answered {
    /// When it was asked.
    asked_at: SystemTime,
    /// When each rank asked answered it: its acknowledgement, or (exited,
    /// replaced, registered again: its launcher restarts it) the end of
    /// the request.
    ranks: HashMap<u32, SystemTime>,
}

#[derive(Debug)]
struct Inner {
    /// The last sequence number issued (32 bits: it must fit the slot's
    /// control word).
    last_seq: u32,
    jobs: HashMap<String, JobRestarts>,
    /// The ranks' restart request streams.
    streams: control::RequestChannels,
    /// The ranks' flight-recorder dump streams. Apart from `streams`: a
    /// dump must not replace a restart request not yet acknowledged.
    dumps: dump::Dumps,
}

impl Inner {
    /// A new request of `job`: the next sequence number (never 0: the
    /// slot's control word takes 0 for none) and the job's entry, its count
    /// advanced.
    fn next_request(&mut self, job: &str) -> (u32, &mut JobRestarts) {
        self.last_seq = match self.last_seq.wrapping_add(1) {
            0 => 1,
            s => s,
        };
        let entry = self.jobs.entry(job.to_owned()).or_default();
        entry.restart_count = entry.restart_count.saturating_add(1);
        (self.last_seq, entry)
    }

    /// The request `seq` of `job`, if it is still the one in flight.
    fn pending(&mut self, job: &str, seq: u64) -> Option<&mut Pending> {
        self.jobs
            .get_mut(job)
            .and_then(|j| j.pending.as_mut())
            .filter(|p| p.waiter.request().seq == seq)
    }

    /// Ends request `seq` of `job`: no longer in flight, off every stream.
    fn finish(&mut self, job: &str, seq: u64) {
        let Some(p) = self
            .jobs
            .get_mut(job)
            .and_then(|j| j.pending.take_if(|p| p.waiter.request().seq == seq))
        else {
            return;
        };
        for rank in p.waiter.ranks() {
            self.streams.clear(
                &RankKey {
                    job: job.to_owned(),
                    rank,
                },
                seq,
            );
        }
    }
}

/// The agent's in-process restarts: sequence numbers, restart counts, the
/// request in flight per job and the ranks' control streams.
///
/// Why here and not in the registry: the registry is locked by every scan;
/// restarts are rare and their waiter polls, so they get their own lock
/// (never held together with the registry's).
#[derive(Debug)]
pub struct Restarts {
    inner: Mutex<Inner>,
}

impl Default for Restarts {
    fn default() -> Self {
        Self::new()
    }
}

impl Restarts {
    /// Empty; sequence numbers start from the clock (seconds since the
    /// epoch, 32 bits), so an acknowledgement a rank carried over from a
    /// previous agent's slot never matches a new request.
    pub fn new() -> Self {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as u32)
            .unwrap_or(1);
        Self {
            inner: Mutex::new(Inner {
                last_seq: start,
                jobs: HashMap::new(),
                streams: control::RequestChannels::default(),
                dumps: dump::Dumps::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The seq of the request in flight for `key`'s job, when `key`'s rank
    /// was asked and has answered it already (it took the restart; others
    /// have not yet).
    pub fn answered_in_flight(&self, key: &RankKey) -> Option<u64> {
        let g = self.lock();
        let w = &g.jobs.get(&key.job)?.pending.as_ref()?.waiter;
        let asked = w.ranks().contains(&key.rank);
        let waited = w.waiting().iter().any(|r| r.rank == key.rank);
        (asked && !waited).then(|| w.request().seq)
    }
}

/// What in-process restarts use of the agent, and nothing more: the rank
/// registry (slots and registrations), the bus, the restarts in flight,
/// where escalations go, the timeout, and the shutdown token. Cloned into
/// the waiter each request spawns.
#[derive(Debug, Clone)]
pub struct Handles {
    /// The ranks and their slots.
    pub registry: SharedRegistry,
    /// Where restart events go.
    pub events: Arc<EventBus>,
    /// Sequence numbers, counts, requests in flight, control streams.
    pub restarts: Arc<Restarts>,
    /// To the attribution task: an incident whose in-process restart cannot
    /// happen or was not acknowledged in time goes up to `restart_in_job`.
    pub escalations: tokio::sync::mpsc::UnboundedSender<Escalation>,
    /// `restart.in_process_timeout`.
    pub timeout: Duration,
    /// Ends the waiters with the agent.
    pub shutdown: CancellationToken,
}

impl Handles {
    /// The registry, locked (never held together with [`Restarts`]'s lock).
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock()
    }
}

/// The time the machine is given: tokio's clock, so that a test that
/// pauses it (`start_paused`) moves the waiter's deadline with its timers;
/// outside such a test it is the monotonic clock itself.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Waits for every rank's answer to `req`, then reports; at the deadline
/// reports the silent ranks and escalates the incident. Ends when the
/// request is over or another one took its place.
async fn wait(state: Handles, req: JobRestart, wake: Arc<Notify>) {
    let Some(deadline) = state
        .restarts
        .lock()
        .pending(&req.job, req.seq)
        .map(|p| p.waiter.deadline())
    else {
        return;
    };
    let deadline = tokio::time::Instant::from_std(deadline);
    while look(&state, &req) {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            () = wake.notified() => {}
            () = tokio::time::sleep(ACK_POLL) => {}
            () = tokio::time::sleep_until(deadline) => {
                // One last look: an answer may have come with the deadline;
                // the machine decides between done and the escalation.
                look(&state, &req);
                return;
            }
        }
    }
}

/// One look at the ranks of request `req`: the registry's view, the slots'
/// ack words and (every `STATE_POLL`) the /proc states of those not
/// answered, fed to the machine, then the clock; carries out what it
/// decides. False once the request is over (or superseded).
fn look(state: &Handles, req: &JobRestart) -> bool {
    let (job, seq) = (req.job.as_str(), req.seq);
    let (waiting, check_state) = {
        let mut g = state.restarts.lock();
        let Some(p) = g.pending(job, seq) else {
            return false;
        };
        let check = p.waiter.state_check_due(now());
        (p.waiter.waiting(), check)
    };
    // The registry's view, without the restart lock.
    let readings = read(state, job, seq, &waiting, check_state);
    let mut g = state.restarts.lock();
    let Some(p) = g.pending(job, seq) else {
        return false;
    };
    let now = now();
    let asked_at = p.asked_at;
    let mut answered = Vec::new();
    for input in readings {
        let rank = match input {
            WaiterInput::Acked { rank, .. } | WaiterInput::Gone { rank, .. } => Some(rank),
            _ => None,
        };
        if step(&mut p.waiter, input, now) == WaiterStep::Wait
            && let Some(rank) = rank
        {
            answered.push(rank);
        }
    }
    let decision = step(&mut p.waiter, WaiterInput::Tick, now);
    let adopted = p.waiter.request().clone();
    for rank in answered {
        g.streams.clear(
            &RankKey {
                job: job.to_owned(),
                rank,
            },
            seq,
        );
    }
    match decision {
        WaiterStep::Wait | WaiterStep::Ignored => true,
        WaiterStep::Done { outcomes } => {
            g.finish(job, seq);
            if let Some(j) = g.jobs.get_mut(job) {
                let end = SystemTime::now();
                let ranks = outcomes
                    .iter()
                    .map(|(&rank, o)| match *o {
                        waiter::RankOutcome::Acked { after, .. } => (rank, asked_at + after),
                        waiter::RankOutcome::Gone { .. } => (rank, end),
                    })
                    .collect();
                j.last_answered = Some(Answered { asked_at, ranks });
            }
            drop(g);
            report::acknowledged(state, req, &outcomes);
            false
        }
        WaiterStep::Escalate { silent, acked, .. } => {
            g.finish(job, seq);
            drop(g);
            report::timed_out(state, &adopted, &silent, &acked, state.timeout);
            false
        }
        WaiterStep::Replace { ranks, .. } => {
            drop(g);
            report::replace_ranks(state, &adopted, ranks);
            true
        }
    }
}

/// Feeds `input` to `waiter` at `now`; what it took and what it decided go
/// to the trace (`RUST_LOG=warden_agent::act::in_process=trace`) with the
/// time since the request, the form `scenarios.rs` records.
fn step(waiter: &mut Waiter, input: WaiterInput, now: Instant) -> WaiterStep {
    let logged = (!matches!(input, WaiterInput::Tick)).then(|| format!("{input:?}"));
    let decision = waiter.step(input, now);
    if decision != WaiterStep::Ignored && (logged.is_some() || decision != WaiterStep::Wait) {
        tracing::trace!(
            job = %waiter.request().job,
            seq = waiter.request().seq,
            at_ms = waiter.since_asked(now).as_millis(),
            input = logged.as_deref().unwrap_or("Tick"),
            decision = ?decision,
            "in-process waiter"
        );
    }
    decision
}

/// What the registry, the slots and /proc say of the ranks `waiting` for
/// request `seq` of `job`, as the machine's inputs (the registry's lock
/// alone). A process state is read only when `check_state`, and never for
/// a rank already handed to its launcher.
fn read(
    state: &Handles,
    job: &str,
    seq: u64,
    waiting: &[Waiting],
    check_state: bool,
) -> Vec<WaiterInput> {
    let mut out = Vec::new();
    if waiting.is_empty() {
        return out;
    }
    let reg = state.registry();
    for w in waiting {
        let key = RankKey {
            job: job.to_owned(),
            rank: w.rank,
        };
        let entry = reg.ranks.get(&key);
        let gone = match entry {
            None => Some(Gone::Left),
            Some(e) if e.generation != w.generation => Some(Gone::RegisteredAgain),
            Some(e) if e.state == RankState::Exited => Some(Gone::Exited),
            Some(e) if e.state == RankState::Stopping => Some(Gone::StoppedByLauncher),
            Some(e) if e.state == RankState::Lost || !e.holds_slot => Some(Gone::LostSlot),
            Some(_) => None,
        };
        if let Some(why) = gone {
            out.push(WaiterInput::Gone { rank: w.rank, why });
            continue;
        }
        if check_state
            && !w.replaced
            && let Some(e) = entry
        {
            out.push(WaiterInput::State {
                rank: w.rank,
                stopped: stopped(e.process.as_ref()),
            });
        }
        if let Ok((acked, writer)) = reg.slots().ack_word(w.slot)
            && acked == seq
        {
            // Dated when fed to the machine: at most ACK_POLL late.
            out.push(WaiterInput::Acked {
                rank: w.rank,
                generation: writer,
                seq: acked,
                via: Via::Slot,
            });
        }
    }
    out
}

/// Whether the rank's process is stopped (state `T`, SIGSTOP, or `t`, a
/// tracer), read through its registration's process handle: the pidfd
/// says it is still the process registered (a signal 0 through it fails
/// once it exited), then /proc/PID/stat gives the state. False when the
/// agent holds no handle (a rank outside its PID namespace).
fn stopped(process: Option<&crate::ranks::process::RankProcess>) -> bool {
    let Some(p) = process else { return false };
    if p.signal(0).is_err() {
        return false;
    }
    procfs::state(p.pid).is_some_and(|s| s.starts_with('T') || s.starts_with('t'))
}
