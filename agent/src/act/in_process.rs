//! In-process restarts: the ranks of a job keep their processes (interpreter,
//! imports, CUDA context) and run their training function again from the
//! local checkpoint.
//!
//! In: a `restart_in_process` decision ([`start`], from the attribution
//! task) or a `RequestRestart` call ([`request`]). Out, for every live local
//! rank of the job: the request in its slot's control word
//! ([`ControlWord`]) and on its `Control` stream ([`subscribe`]), the event
//! `restart.requested`, and a waiter that reports `restart.acknowledged`
//! once every rank acknowledged (`AckControl`, [`ack`], or the slot's ack
//! word, whichever comes first), or `restart.in_process_timeout` after
//! `restart.in_process_timeout`, escalating the incident to
//! `restart_in_job` through [`Handles::escalations`] so the launcher
//! restarts the processes. A rank that exits or registers again meanwhile
//! counts as handled: its launcher restarts it. A rank whose process is
//! stopped (SIGSTOP: state T or t for [`STOPPED_FOR`]) can never answer:
//! the waiter asks at once for it alone to be replaced (`restart.replace_ranks`,
//! a revision of the incident's `restart_in_process` decision carrying a
//! [`Replacement`]), and goes on waiting for the others; the launcher's
//! StopRanks for it makes it handled.
//!
//! Never: block the caller (the waiter is a task of its own, and every lock
//! is held for a few map operations), hold the registry and the restart
//! state at once, or ask a rank that is not alive.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, watch};
use warden_slot::ControlWord;

use crate::ranks::RankKey;
use crate::ranks::procfs;
use crate::ranks::registry::RankState;
use crate::ranks::registry::{Registry, SharedRegistry};
use tokio_util::sync::CancellationToken;
use warden_core::attribute::{Escalation, IncidentRecord};
use warden_core::events::{EventBus, NewEvent, Severity};
use warden_core::policy::{Action, Replacement};
use warden_core::signal::join_ranks as join;
use warden_core::signal::{RestartRequested, Signal};

/// How often the waiter reads the ranks' ack words from their slots (an
/// `AckControl` call wakes it at once).
const ACK_POLL: Duration = Duration::from_millis(5);

/// How often the waiter reads the process state of the ranks that have not
/// answered (one /proc read each).
const STATE_POLL: Duration = Duration::from_millis(50);

/// How long a rank's process must show as stopped, read after read, before
/// it is replaced: a tracer's stop (`t`, a debugger or strace stepping it)
/// passes within this; SIGSTOP lasts until someone sends SIGCONT.
pub const STOPPED_FOR: Duration = Duration::from_millis(200);

/// A request to restart a job's ranks in process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartRequest {
    /// The job.
    pub job: String,
    /// Its sequence number: what the ranks acknowledge.
    pub seq: u64,
    /// The restart count the ranks' next attempt runs with (1 for the
    /// job's first restart on this agent).
    pub restart_count: u32,
    /// The incident that asked for it ("" when asked by hand or by another
    /// host).
    pub incident: String,
    /// Why, for a person.
    pub reason: String,
}

/// What one rank's `Control` stream carries: the request and the
/// registration (generation) it is addressed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankRequest {
    /// The generation the rank held when asked.
    pub generation: u64,
    /// The request.
    pub request: RestartRequest,
}

/// What a request asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The ranks asked (the job's live local ranks), ascending.
    pub ranks: Vec<u32>,
    /// The request's sequence number.
    pub seq: u64,
    /// The restart count the ranks run with.
    pub restart_count: u32,
    /// True when the job already had a request in flight, which this one
    /// joined (no new sequence number, nobody asked twice).
    pub joined: bool,
}

/// Why a restart could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    /// The request named no job.
    #[error("job_id must be set")]
    EmptyJob,
    /// Nothing to restart here.
    #[error("job {job:?} has no live rank on this agent")]
    NoLiveRanks {
        /// The job.
        job: String,
    },
}

/// Why a rank's `Control` stream or acknowledgement was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The rank never registered here (or left).
    #[error("{key} is not registered with this agent")]
    UnknownRank {
        /// The rank.
        key: RankKey,
    },
    /// The caller speaks for an older registration of the rank.
    #[error(
        "{key} is registered with generation {current}, not {given} (a stale registration: register again)"
    )]
    StaleGeneration {
        /// The rank.
        key: RankKey,
        /// The generation in force.
        current: u64,
        /// The one the caller gave.
        given: u64,
    },
    /// The rank's process is gone or its slot was lost.
    #[error("{key} is {state}, not running")]
    NotLive {
        /// The rank.
        key: RankKey,
        /// Its state.
        state: &'static str,
    },
}

/// How a rank's part of a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// It acknowledged, this long after the request, by this path.
    Acked { after: Duration, via: &'static str },
    /// It exited, was lost or registered again: its launcher restarts it.
    Gone { why: &'static str },
}

#[derive(Debug)]
struct RankWait {
    generation: u64,
    slot: u32,
    outcome: Option<Outcome>,
    /// Since when every read of its process state said stopped.
    stopped_since: Option<Instant>,
    /// Its launcher was asked to replace it.
    replaced: bool,
}

#[derive(Debug)]
struct Pending {
    request: RestartRequest,
    asked_at: Instant,
    ranks: BTreeMap<u32, RankWait>,
    wake: Arc<Notify>,
    /// When the unanswered ranks' process states are read next.
    next_state_check: Instant,
    /// The job's world size as its ranks declared it: more than the ranks
    /// asked means ranks on other hosts, which this agent cannot see.
    world_size: u32,
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
}

#[derive(Debug)]
struct Inner {
    /// The last sequence number issued (32 bits: it must fit the slot's
    /// control word).
    last_seq: u32,
    jobs: HashMap<String, JobRestarts>,
    /// Per rank, the request its `Control` stream delivers (the latest;
    /// `None` once the rank acknowledged or the request ended).
    streams: HashMap<RankKey, watch::Sender<Option<Arc<RankRequest>>>>,
    /// The last flight-recorder dump request issued.
    last_dump: u64,
    /// Per rank, the flight-recorder dump its `Control` stream delivers
    /// (`None` once the asker stopped waiting). Apart from `streams`: a
    /// dump must not replace a restart request not yet acknowledged.
    dumps: HashMap<RankKey, watch::Sender<Option<Arc<DumpRequest>>>>,
}

/// A request that a rank write its torch flight recorder to `path`
/// (`ranks::flight` makes and reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpRequest {
    /// The generation the rank held when asked: a stream of another
    /// registration never delivers it.
    pub generation: u64,
    /// Increases with every dump request this agent makes.
    pub seq: u64,
    /// Where the rank writes it, in a directory the agent made for this
    /// request.
    pub path: std::path::PathBuf,
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
                streams: HashMap::new(),
                last_dump: 0,
                dumps: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
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

/// Carries out a `restart_in_process` decision: asks every live local rank
/// of the incident's job. With none alive there is nothing to restart in
/// process: the incident is escalated to `restart_in_job` at once.
pub fn start(state: &Handles, record: &IncidentRecord) {
    let reason = record.decision.as_ref().map_or_else(
        || format!("incident {}", record.id),
        |d| format!("{}: {}", record.id, d.reason),
    );
    match request(state, &record.job, &reason, &record.id) {
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(incident = %record.id, error = %e, "no in-process restart; escalating to restart_in_job");
            let _ = state.escalations.send(Escalation {
                incident: record.id.clone(),
                action: Action::RestartInJob,
                reason: format!("in-process restart impossible: {e}"),
                replace: None,
            });
        }
    }
}

/// Asks every live local rank of `job` to restart in process; `incident`
/// is "" when asked by hand. A job whose previous request is still in
/// flight joins it (see [`Asked::joined`]).
pub fn request(
    state: &Handles,
    job: &str,
    reason: &str,
    incident: &str,
) -> Result<Asked, RestartError> {
    if job.is_empty() {
        return Err(RestartError::EmptyJob);
    }
    // The live ranks, from the registry (its lock only).
    let (live, world_size): (Vec<(u32, u64, u32)>, u32) = {
        let reg = state.registry();
        let entries: Vec<_> = reg
            .ranks
            .values()
            .filter(|e| {
                e.key.job == job
                    && e.holds_slot
                    && matches!(e.state, RankState::Running | RankState::Hung)
            })
            .collect();
        (
            entries
                .iter()
                .map(|e| (e.key.rank, e.generation, e.slot))
                .collect(),
            entries.iter().map(|e| e.world_size).max().unwrap_or(0),
        )
    };
    if live.is_empty() {
        return Err(RestartError::NoLiveRanks {
            job: job.to_owned(),
        });
    }
    let restarts = &state.restarts;
    let mut g = restarts.lock();
    if let Some(p) = g.jobs.get_mut(job).and_then(|j| j.pending.as_mut()) {
        // A request asked by hand (a launcher's heal) carries no incident,
        // so its timeout would escalate nothing and a rank that can never
        // answer (blocked in a collective no signal interrupts) would hold
        // the job until the collective's own timeout. The first incident
        // that joins it is the one its timeout and replacements carry.
        if p.request.incident.is_empty() && !incident.is_empty() {
            p.request.incident = incident.to_owned();
        }
        return Ok(Asked {
            ranks: p.ranks.keys().copied().collect(),
            seq: p.request.seq,
            restart_count: p.request.restart_count,
            joined: true,
        });
    }
    g.last_seq = match g.last_seq.wrapping_add(1) {
        0 => 1,
        s => s,
    };
    let seq = g.last_seq;
    let entry = g.jobs.entry(job.to_owned()).or_default();
    entry.restart_count = entry.restart_count.saturating_add(1);
    let req = RestartRequest {
        job: job.to_owned(),
        seq: u64::from(seq),
        restart_count: entry.restart_count,
        incident: incident.to_owned(),
        reason: reason.to_owned(),
    };
    let wake = Arc::new(Notify::new());
    entry.pending = Some(Pending {
        request: req.clone(),
        asked_at: Instant::now(),
        ranks: live
            .iter()
            .map(|&(rank, generation, slot)| {
                (
                    rank,
                    RankWait {
                        generation,
                        slot,
                        outcome: None,
                        stopped_since: None,
                        replaced: false,
                    },
                )
            })
            .collect(),
        wake: wake.clone(),
        next_state_check: Instant::now(),
        world_size,
    });
    for &(rank, generation, _) in &live {
        let key = RankKey {
            job: job.to_owned(),
            rank,
        };
        let msg = Some(Arc::new(RankRequest {
            generation,
            request: req.clone(),
        }));
        g.streams
            .entry(key)
            .or_insert_with(|| watch::channel(None).0)
            .send_replace(msg);
    }
    drop(g);
    // The slots, after the streams are armed (the registry's lock alone).
    let word = ControlWord::restart(seq, req.restart_count).encode();
    {
        let reg = state.registry();
        for &(rank, generation, slot) in &live {
            let key = RankKey {
                job: job.to_owned(),
                rank,
            };
            // Only a slot the rank still holds with this generation: after a
            // rebuild or re-registration the index may be another rank's.
            let ours = reg
                .ranks
                .get(&key)
                .is_some_and(|e| e.holds_slot && e.generation == generation && e.slot == slot);
            if ours && let Err(e) = reg.slots().set_control(slot, word) {
                tracing::warn!(rank = %key, error = %e, "cannot set the restart request in the slot");
            }
        }
    }
    let ranks: Vec<u32> = live.iter().map(|&(r, _, _)| r).collect();
    let timeout = state.timeout;
    state
        .events
        .publish(Signal::RestartRequested(RestartRequested {
            job: job.to_owned(),
            seq: req.seq,
            restart_count: req.restart_count,
            ranks: ranks.clone(),
            incident: incident.to_owned(),
            reason: reason.to_owned(),
            timeout,
        }));
    tokio::spawn(wait(state.clone(), req.clone(), wake, timeout));
    Ok(Asked {
        ranks,
        seq: req.seq,
        restart_count: req.restart_count,
        joined: false,
    })
}

/// Checks that `key` is registered with `generation` and alive.
fn check_rank(state: &Handles, key: &RankKey, generation: u64) -> Result<(), ControlError> {
    let reg = state.registry();
    let Some(e) = reg.ranks.get(key) else {
        return Err(ControlError::UnknownRank { key: key.clone() });
    };
    if e.generation != generation {
        return Err(ControlError::StaleGeneration {
            key: key.clone(),
            current: e.generation,
            given: generation,
        });
    }
    if !matches!(e.state, RankState::Running | RankState::Hung) {
        return Err(ControlError::NotLive {
            key: key.clone(),
            state: e.state.as_str(),
        });
    }
    Ok(())
}

/// The requests for a rank's `Control` stream: the receiver holds the
/// pending one at once (a client whose stream broke gets it again), then
/// each new one. Only for the registration in force.
pub fn subscribe(
    state: &Handles,
    key: &RankKey,
    generation: u64,
) -> Result<watch::Receiver<Option<Arc<RankRequest>>>, ControlError> {
    check_rank(state, key, generation)?;
    let mut g = state.restarts.lock();
    // Streams of ranks that left, with nobody listening, go.
    g.streams
        .retain(|k, tx| k == key || tx.receiver_count() > 0 || tx.borrow().is_some());
    let tx = g
        .streams
        .entry(key.clone())
        .or_insert_with(|| watch::channel(None).0);
    Ok(tx.subscribe())
}

/// The flight-recorder dump requests for a rank's `Control` stream: the
/// receiver holds the one in flight at once, then each new one. Only for
/// the registration in force.
pub fn subscribe_dumps(
    state: &Handles,
    key: &RankKey,
    generation: u64,
) -> Result<watch::Receiver<Option<Arc<DumpRequest>>>, ControlError> {
    check_rank(state, key, generation)?;
    let mut g = state.restarts.lock();
    g.dumps
        .retain(|k, tx| k == key || tx.receiver_count() > 0 || tx.borrow().is_some());
    let tx = g
        .dumps
        .entry(key.clone())
        .or_insert_with(|| watch::channel(None).0);
    Ok(tx.subscribe())
}

/// Puts a flight-recorder dump request on `key`'s `Control` stream (the
/// generation it must be delivered to, the file to write); returns its
/// sequence number. [`end_dump`] takes it off again.
pub fn ask_dump(
    restarts: &Restarts,
    key: &RankKey,
    generation: u64,
    path: std::path::PathBuf,
) -> u64 {
    let mut g = restarts.lock();
    g.last_dump = g.last_dump.wrapping_add(1).max(1);
    let seq = g.last_dump;
    g.dumps
        .entry(key.clone())
        .or_insert_with(|| watch::channel(None).0)
        .send_replace(Some(Arc::new(DumpRequest {
            generation,
            seq,
            path,
        })));
    seq
}

/// Takes dump request `seq` off `key`'s stream, if it is still the one
/// there: a stream opened later must not deliver a request nobody awaits.
pub fn end_dump(restarts: &Restarts, key: &RankKey, seq: u64) {
    let g = restarts.lock();
    if let Some(tx) = g.dumps.get(key) {
        tx.send_if_modified(|v| {
            if v.as_ref().is_some_and(|d| d.seq == seq) {
                *v = None;
                true
            } else {
                false
            }
        });
    }
}

/// Whether a rank's transient exception may restart its job in process
/// once more: at most `budget` such restarts within `window` per job (the
/// policy's `transient_software` budget), so an exception that comes back on every
/// attempt ends in the crash's own diagnosis and policy rather than in
/// restarts forever. A request already in flight for the job is joined and
/// not counted again. `Ok(attempt)` (1-based), or `Err(spent)`.
pub fn admit_exception_restart(
    restarts: &Restarts,
    job: &str,
    budget: u32,
    window: Duration,
    now: Instant,
) -> Result<u32, u32> {
    let mut g = restarts.lock();
    let entry = g.jobs.entry(job.to_owned()).or_default();
    while entry
        .exception_restarts
        .front()
        .is_some_and(|&at| now.saturating_duration_since(at) > window)
    {
        entry.exception_restarts.pop_front();
    }
    let spent = u32::try_from(entry.exception_restarts.len()).unwrap_or(u32::MAX);
    if entry.pending.is_some() {
        return Ok(spent.max(1));
    }
    if spent >= budget {
        return Err(spent);
    }
    entry.exception_restarts.push_back(now);
    Ok(spent + 1)
}

/// Records a rank's acknowledgement of request `seq` (the `AckControl`
/// call). True when it answered a request in flight; an acknowledgement of
/// an older or unknown request is accepted and ignored.
pub fn ack(
    state: &Handles,
    key: &RankKey,
    generation: u64,
    seq: u64,
) -> Result<bool, ControlError> {
    check_rank(state, key, generation)?;
    let mut g = state.restarts.lock();
    let Some(p) = g
        .jobs
        .get_mut(&key.job)
        .and_then(|j| j.pending.as_mut())
        .filter(|p| p.request.seq == seq)
    else {
        return Ok(false);
    };
    let after = p.asked_at.elapsed();
    let Some(w) = p
        .ranks
        .get_mut(&key.rank)
        .filter(|w| w.generation == generation && w.outcome.is_none())
    else {
        return Ok(false);
    };
    w.outcome = Some(Outcome::Acked { after, via: "rpc" });
    p.wake.notify_one();
    clear_stream(&mut g, key, seq);
    Ok(true)
}

/// Stops delivering request `seq` on a rank's stream (it answered, or the
/// request ended), without waking the stream.
fn clear_stream(g: &mut Inner, key: &RankKey, seq: u64) {
    if let Some(tx) = g.streams.get(key) {
        tx.send_if_modified(|v| {
            if v.as_ref().is_some_and(|r| r.request.seq == seq) {
                *v = None;
            }
            false
        });
    }
}

/// What one look at the ranks found.
enum Progress {
    /// The job has another request in flight, or none: this waiter is done.
    Superseded,
    /// Some ranks have not answered yet; these (stopped) are to be
    /// replaced now.
    Waiting(Vec<u32>),
    /// Every rank answered.
    Done(BTreeMap<u32, Outcome>),
}

/// Reads the ranks' registry entries and ack words, records what changed,
/// and says where the request stands.
fn look(state: &Handles, job: &str, seq: u64) -> Progress {
    let now = Instant::now();
    let (waiting, check_state): (Vec<(u32, u64, u32, bool)>, bool) = {
        let mut g = state.restarts.lock();
        match g
            .jobs
            .get_mut(job)
            .and_then(|j| j.pending.as_mut())
            .filter(|p| p.request.seq == seq)
        {
            Some(p) => {
                let check = now >= p.next_state_check;
                if check {
                    p.next_state_check = now + STATE_POLL;
                }
                let waiting = p
                    .ranks
                    .iter()
                    .filter(|(_, w)| w.outcome.is_none())
                    .map(|(&r, w)| (r, w.generation, w.slot, w.replaced))
                    .collect();
                (waiting, check)
            }
            None => return Progress::Superseded,
        }
    };
    // The registry's view, without the restart lock.
    let mut seen: Vec<(u32, Outcome)> = Vec::new();
    // (rank, whether its process is stopped), for ranks still waited for.
    let mut states: Vec<(u32, bool)> = Vec::new();
    if !waiting.is_empty() {
        let reg = state.registry();
        for (rank, generation, slot, replaced) in waiting {
            let key = RankKey {
                job: job.to_owned(),
                rank,
            };
            let gone = match reg.ranks.get(&key) {
                None => Some("left"),
                Some(e) if e.generation != generation => Some("registered again"),
                Some(e) if e.state == RankState::Exited => Some("exited"),
                Some(e) if e.state == RankState::Stopping && replaced => {
                    Some("replaced by its launcher")
                }
                Some(e) if e.state == RankState::Stopping => Some("stopped by its launcher"),
                Some(e) if e.state == RankState::Lost || !e.holds_slot => Some("lost its slot"),
                Some(_) => None,
            };
            if let Some(why) = gone {
                seen.push((rank, Outcome::Gone { why }));
                continue;
            }
            if check_state
                && !replaced
                && let Some(e) = reg.ranks.get(&key)
            {
                states.push((rank, stopped(e.process.as_ref())));
            }
            if let Ok((acked, writer)) = reg.slots().ack_word(slot)
                && acked == seq
                && writer == generation
            {
                // Dated when seen: at most ACK_POLL late.
                seen.push((
                    rank,
                    Outcome::Acked {
                        after: Duration::ZERO,
                        via: "slot",
                    },
                ));
            }
        }
    }
    let mut g = state.restarts.lock();
    let Some(p) = g
        .jobs
        .get_mut(job)
        .and_then(|j| j.pending.as_mut())
        .filter(|p| p.request.seq == seq)
    else {
        return Progress::Superseded;
    };
    let elapsed = p.asked_at.elapsed();
    for (rank, is_stopped) in states {
        if let Some(w) = p.ranks.get_mut(&rank) {
            w.stopped_since = if is_stopped {
                Some(w.stopped_since.unwrap_or(now))
            } else {
                None
            };
        }
    }
    let mut answered = Vec::new();
    for (rank, outcome) in seen {
        if let Some(w) = p.ranks.get_mut(&rank).filter(|w| w.outcome.is_none()) {
            w.outcome = Some(match outcome {
                Outcome::Acked { via, .. } => Outcome::Acked {
                    after: elapsed,
                    via,
                },
                gone => gone,
            });
            answered.push(rank);
        }
    }
    let done = p.ranks.values().all(|w| w.outcome.is_some());
    let outcomes: BTreeMap<u32, Outcome> = if done {
        p.ranks
            .iter()
            .filter_map(|(&r, w)| w.outcome.map(|o| (r, o)))
            .collect()
    } else {
        BTreeMap::new()
    };
    for rank in answered {
        clear_stream(
            &mut g,
            &RankKey {
                job: job.to_owned(),
                rank,
            },
            seq,
        );
    }
    if done {
        finish(&mut g, job, seq);
        return Progress::Done(outcomes);
    }
    let Some(p) = g
        .jobs
        .get_mut(job)
        .and_then(|j| j.pending.as_mut())
        .filter(|p| p.request.seq == seq)
    else {
        return Progress::Superseded;
    };
    let whole_job = u32::try_from(p.ranks.len()).unwrap_or(u32::MAX) >= p.world_size;
    Progress::Waiting(to_replace(&mut p.ranks, whole_job, now))
}

/// The ranks stopped for [`STOPPED_FOR`] and not yet handed to their
/// launcher, marked as handed. None while every rank of the job (`whole_job`:
/// the request covers its world) is stopped: a job suspended as a whole, by
/// its scheduler or by hand, is resumed, not replaced (and replacing all of
/// it is the in-job restart the timeout leads to anyway). A job with ranks
/// on other hosts has peers this agent cannot see: its stopped local ranks
/// are replaced even when they are all it has here.
fn to_replace(ranks: &mut BTreeMap<u32, RankWait>, whole_job: bool, now: Instant) -> Vec<u32> {
    let is_stopped = |w: &RankWait| {
        w.outcome.is_none()
            && (w.replaced
                || w.stopped_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= STOPPED_FOR))
    };
    if whole_job && ranks.values().all(is_stopped) {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (&rank, w) in ranks.iter_mut() {
        if !w.replaced && is_stopped(w) {
            w.replaced = true;
            out.push(rank);
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

/// Ends request `seq` of `job`: no longer in flight, off every stream.
fn finish(g: &mut Inner, job: &str, seq: u64) {
    let Some(p) = g
        .jobs
        .get_mut(job)
        .and_then(|j| j.pending.take_if(|p| p.request.seq == seq))
    else {
        return;
    };
    for &rank in p.ranks.keys() {
        clear_stream(
            g,
            &RankKey {
                job: job.to_owned(),
                rank,
            },
            seq,
        );
    }
}

/// Waits for every rank's answer to `req`, then reports; at the deadline
/// reports the silent ranks and escalates the incident.
async fn wait(state: Handles, req: RestartRequest, wake: Arc<Notify>, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match look(&state, &req.job, req.seq) {
            Progress::Superseded => return,
            Progress::Done(outcomes) => {
                acknowledged(&state, &req, &outcomes);
                return;
            }
            Progress::Waiting(replace) => {
                if !replace.is_empty() {
                    replace_ranks(&state, &adopted(&state, &req), replace);
                }
            }
        }
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            () = wake.notified() => {}
            () = tokio::time::sleep(ACK_POLL) => {}
            () = tokio::time::sleep_until(deadline) => {
                // One last look: an answer may have come with the deadline.
                match look(&state, &req.job, req.seq) {
                    Progress::Superseded => {}
                    Progress::Done(outcomes) => acknowledged(&state, &req, &outcomes),
                    Progress::Waiting(_) => timed_out(&state, &adopted(&state, &req), timeout),
                }
                return;
            }
        }
    }
}

/// `req` with the incident its pending entry carries now (one that joined
/// it after it was asked: [`request`]).
fn adopted(state: &Handles, req: &RestartRequest) -> RestartRequest {
    let mut req = req.clone();
    let g = state.restarts.lock();
    if let Some(p) = g
        .jobs
        .get(&req.job)
        .and_then(|j| j.pending.as_ref())
        .filter(|p| p.request.seq == req.seq)
    {
        req.incident.clone_from(&p.request.incident);
    }
    req
}

fn acknowledged(state: &Handles, req: &RestartRequest, outcomes: &BTreeMap<u32, Outcome>) {
    let acked: Vec<(u32, Duration, &str)> = outcomes
        .iter()
        .filter_map(|(&r, o)| match *o {
            Outcome::Acked { after, via } => Some((r, after, via)),
            Outcome::Gone { .. } => None,
        })
        .collect();
    let gone: Vec<String> = outcomes
        .iter()
        .filter_map(|(&r, o)| match *o {
            Outcome::Gone { why } => Some(format!("{r} ({why})")),
            Outcome::Acked { .. } => None,
        })
        .collect();
    let slowest = acked.iter().map(|a| a.1).max().unwrap_or_default();
    metrics::counter!("warden_in_process_restarts_total", "outcome" => "acknowledged").increment(1);
    let mut ev = NewEvent::new(
        Severity::Info,
        "restart.acknowledged",
        format!("job/{}", req.job),
        format!(
            "job {}: restart {} (seq {}) acknowledged by ranks {} within {}{}",
            req.job,
            req.restart_count,
            req.seq,
            join(&acked.iter().map(|a| a.0).collect::<Vec<_>>()),
            ms(slowest),
            if gone.is_empty() {
                String::new()
            } else {
                format!("; handled by their launcher: {}", gone.join(", "))
            }
        ),
    )
    .with("seq", req.seq)
    .with("restart_count", req.restart_count)
    .with("incident", &req.incident)
    .with(
        "acknowledged",
        join(&acked.iter().map(|a| a.0).collect::<Vec<_>>()),
    )
    .with("gone", gone.join(", "))
    .with("slowest", ms(slowest));
    for (rank, after, via) in &acked {
        ev = ev.with(
            format!("latency.rank.{rank}"),
            format!("{} ({via})", ms(*after)),
        );
    }
    state.events.publish(ev);
}

fn timed_out(state: &Handles, req: &RestartRequest, timeout: Duration) {
    let (silent, acked) = {
        let mut g = state.restarts.lock();
        let Some(p) = g
            .jobs
            .get(&req.job)
            .and_then(|j| j.pending.as_ref())
            .filter(|p| p.request.seq == req.seq)
        else {
            return;
        };
        let silent: Vec<u32> = p
            .ranks
            .iter()
            .filter(|(_, w)| w.outcome.is_none())
            .map(|(&r, _)| r)
            .collect();
        let acked: Vec<u32> = p
            .ranks
            .iter()
            .filter(|(_, w)| matches!(w.outcome, Some(Outcome::Acked { .. })))
            .map(|(&r, _)| r)
            .collect();
        finish(&mut g, &req.job, req.seq);
        (silent, acked)
    };
    metrics::counter!("warden_in_process_restarts_total", "outcome" => "timeout").increment(1);
    let escalate = !req.incident.is_empty();
    let reason = format!(
        "ranks {} did not acknowledge the in-process restart (seq {}) within {}",
        join(&silent),
        req.seq,
        humantime::format_duration(timeout)
    );
    state.events.publish(
        NewEvent::new(
            Severity::Error,
            "restart.in_process_timeout",
            format!("job/{}", req.job),
            format!(
                "job {}: {reason}; {}",
                req.job,
                if escalate {
                    format!("{} escalated to restart_in_job", req.incident)
                } else {
                    "no incident to escalate (asked by hand)".to_owned()
                }
            ),
        )
        .with("seq", req.seq)
        .with("restart_count", req.restart_count)
        .with("incident", &req.incident)
        .with("unacknowledged", join(&silent))
        .with("acknowledged", join(&acked))
        .with("timeout", humantime::format_duration(timeout))
        .with("escalated_to", if escalate { "restart_in_job" } else { "" }),
    );
    if escalate {
        let _ = state.escalations.send(Escalation {
            incident: req.incident.clone(),
            action: Action::RestartInJob,
            reason,
            replace: None,
        });
    }
}

/// Asks the launcher to replace `ranks` (stopped processes) while the
/// request goes on for the others: an escalation of the incident that keeps
/// `restart_in_process` and adds the [`Replacement`], the event
/// `restart.replace_ranks` and its count. With no incident (asked by hand)
/// nothing carries it to a launcher: the event says so, and the timeout
/// escalates nothing, as before.
fn replace_ranks(state: &Handles, req: &RestartRequest, ranks: Vec<u32>) {
    let carried = !req.incident.is_empty();
    metrics::counter!("warden_in_process_replacements_total").increment(ranks.len() as u64);
    let reason = format!(
        "rank{} {} stopped (SIGSTOP or a tracer) for {} during the in-process restart (seq {}): it can never acknowledge; replaced at once, the other ranks restart in process",
        if ranks.len() == 1 { "" } else { "s" },
        join(&ranks),
        humantime::format_duration(STOPPED_FOR),
        req.seq
    );
    state.events.publish(
        NewEvent::new(
            Severity::Warning,
            "restart.replace_ranks",
            format!("job/{}", req.job),
            format!(
                "job {}: {reason}; {}",
                req.job,
                if carried {
                    format!("{} asks its launcher", req.incident)
                } else {
                    "no incident to carry it to a launcher (asked by hand): waiting for the timeout"
                        .to_owned()
                }
            ),
        )
        .with("seq", req.seq)
        .with("restart_count", req.restart_count)
        .with("incident", &req.incident)
        .with("ranks", join(&ranks))
        .with("carried", carried),
    );
    if carried {
        let _ = state.escalations.send(Escalation {
            incident: req.incident.clone(),
            action: Action::RestartInProcess,
            reason,
            replace: Some(Replacement {
                ranks,
                restart_count: req.restart_count,
            }),
        });
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}ms", d.as_secs_f64() * 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ranks::registry::{RegisterRequest, Registration};
    use crate::state::AgentState;

    #[test]
    fn exception_restarts_are_bounded_per_job_and_window() {
        let r = Restarts::new();
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Ok(1));
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Ok(2));
        // Spent for job a, not for job b.
        assert_eq!(admit_exception_restart(&r, "a", 2, w, t0), Err(2));
        assert_eq!(admit_exception_restart(&r, "b", 2, w, t0), Ok(1));
        // Out of the window, the oldest no longer counts.
        let later = t0 + w + Duration::from_secs(1);
        assert_eq!(admit_exception_restart(&r, "a", 2, w, later), Ok(1));
        // A budget of 0 admits none.
        assert_eq!(admit_exception_restart(&r, "c", 0, w, t0), Err(0));
    }

    fn agent(timeout: Duration) -> (tempfile::TempDir, Arc<AgentState>) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.api.socket = dir.path().join("w.sock").display().to_string();
        cfg.agent.state_dir = dir.path().join("state").display().to_string();
        cfg.restart.in_process_timeout = timeout;
        let state = Arc::new(AgentState::new(cfg, "test".into()).unwrap());
        (dir, state)
    }

    fn register(state: &AgentState, job: &str, rank: u32) -> Registration {
        let reg = state
            .registry()
            .register(&RegisterRequest::for_test(job, rank, 4), 0)
            .unwrap();
        // The client echoes its generation once it maps the slot.
        state
            .registry()
            .slots()
            .slot(reg.slot_index)
            .unwrap()
            .attach_writer(reg.generation, std::process::id());
        reg
    }

    fn key(job: &str, rank: u32) -> RankKey {
        RankKey {
            job: job.into(),
            rank,
        }
    }

    async fn event(state: &AgentState, kind: &str) -> Arc<warden_core::events::Event> {
        event_about(state, kind, "").await
    }

    /// The first event of `kind` about `subject` ("": any).
    async fn event_about(
        state: &AgentState,
        kind: &str,
        subject: &str,
    ) -> Arc<warden_core::events::Event> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let (events, _) = state.events.list(0, 0);
            if let Some(e) = events
                .into_iter()
                .find(|e| e.kind == kind && (subject.is_empty() || e.subject == subject))
            {
                return e;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {kind} event: {:?}",
                state.events.list(0, 0).0
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// No event of `kind` is in the agent's ring.
    fn never_published(state: &AgentState, kind: &str) -> bool {
        state.events.list(0, 0).0.iter().all(|e| e.kind != kind)
    }

    fn evidence<'a>(e: &'a warden_core::events::Event, k: &str) -> &'a str {
        e.evidence
            .iter()
            .find(|(key, _)| key == k)
            .map_or("", |(_, v)| v.as_str())
    }

    #[tokio::test]
    async fn every_rank_is_asked_through_slot_and_stream_and_both_acks_count() {
        let (_dir, state) = agent(Duration::from_secs(30));
        let r0 = register(&state, "j", 0);
        let r1 = register(&state, "j", 1);
        register(&state, "other", 0);
        let mut rx1 = subscribe(&state.in_process(), &key("j", 1), r1.generation).unwrap();
        assert!(rx1.borrow_and_update().is_none());

        let asked = request(&state.in_process(), "j", "drill", "").unwrap();
        assert_eq!((asked.ranks.clone(), asked.restart_count), (vec![0, 1], 1));
        assert!(!asked.joined);
        // The slot holds the request, for ranks of the job only.
        let word = |slot| state.registry().slots().snapshot(slot).unwrap().control;
        let want = ControlWord::restart(asked.seq as u32, 1);
        assert_eq!(ControlWord::decode(word(r0.slot_index)), Some(want));
        assert_eq!(ControlWord::decode(word(r1.slot_index)), Some(want));
        // The stream too, addressed to the registration in force.
        rx1.changed().await.unwrap();
        let msg = rx1.borrow_and_update().clone().unwrap();
        assert_eq!(
            (msg.generation, msg.request.seq),
            (r1.generation, asked.seq)
        );
        assert_eq!(msg.request.reason, "drill");
        // Asked again while in flight: joined, nobody asked twice.
        let again = request(&state.in_process(), "j", "again", "").unwrap();
        assert!(again.joined);
        assert_eq!(again.seq, asked.seq);

        // Rank 1 by AckControl (a stale generation is refused), rank 0 by
        // its slot's ack word.
        assert!(matches!(
            ack(
                &state.in_process(),
                &key("j", 1),
                r1.generation + 1,
                asked.seq
            ),
            Err(ControlError::StaleGeneration { .. })
        ));
        assert!(
            !ack(
                &state.in_process(),
                &key("j", 1),
                r1.generation,
                asked.seq + 7
            )
            .unwrap()
        );
        assert!(ack(&state.in_process(), &key("j", 1), r1.generation, asked.seq).unwrap());
        assert!(rx1.borrow().is_none(), "off the stream once acknowledged");
        state
            .registry()
            .slots()
            .writer(r0.slot_index)
            .unwrap()
            .ack(asked.seq);
        let done = event(&state, "restart.acknowledged").await;
        assert_eq!(evidence(&done, "acknowledged"), "0,1");
        assert!(
            evidence(&done, "latency.rank.0").ends_with("(slot)"),
            "{done:?}"
        );
        assert!(
            evidence(&done, "latency.rank.1").ends_with("(rpc)"),
            "{done:?}"
        );

        // The next request is new: count 2, another sequence number.
        let next = request(&state.in_process(), "j", "", "").unwrap();
        assert_eq!(next.restart_count, 2);
        assert_ne!(next.seq, asked.seq);
    }

    #[tokio::test]
    async fn silence_escalates_the_incident_and_a_rank_that_leaves_is_handled() {
        let (_dir, state) = agent(Duration::from_millis(200));
        let mut escalations = state.take_escalations().unwrap();
        let r0 = register(&state, "j", 0);
        let r1 = register(&state, "j", 1);
        let asked = request(&state.in_process(), "j", "hang", "inc-7").unwrap();
        // Rank 1 leaves: handled by its launcher. Rank 0 stays silent.
        assert!(state.registry().deregister(&key("j", 1), r1.generation));
        let timeout = event(&state, "restart.in_process_timeout").await;
        assert_eq!(evidence(&timeout, "unacknowledged"), "0");
        assert_eq!(evidence(&timeout, "escalated_to"), "restart_in_job");
        let e = escalations.recv().await.unwrap();
        assert_eq!(
            (e.incident.as_str(), e.action),
            ("inc-7", Action::RestartInJob)
        );
        assert!(e.reason.contains("did not acknowledge"), "{}", e.reason);
        // Over: a late acknowledgement is accepted and ignored.
        assert!(!ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
        assert!(never_published(&state, "restart.acknowledged"));
    }

    /// A launcher's heal asks by hand (no incident); the hang the agent then
    /// finds joins it. A rank that can never answer (blocked in a gloo
    /// collective) must still end in an escalation: before, the timeout
    /// escalated nothing and the job waited for the collective's timeout.
    #[tokio::test]
    async fn an_incident_that_joins_a_request_asked_by_hand_is_escalated_at_its_timeout() {
        let (_dir, state) = agent(Duration::from_millis(300));
        let mut escalations = state.take_escalations().unwrap();
        let _r0 = register(&state, "j", 0);
        let r1 = register(&state, "j", 1);
        let asked = request(&state.in_process(), "j", "heal of rank 2", "").unwrap();
        let joined = request(&state.in_process(), "j", "hang", "inc-9").unwrap();
        assert!(joined.joined);
        assert_eq!(joined.seq, asked.seq);
        // A later incident does not take it over from the first.
        let again = request(&state.in_process(), "j", "hang", "inc-10").unwrap();
        assert!(again.joined);
        assert!(ack(&state.in_process(), &key("j", 1), r1.generation, asked.seq).unwrap());
        let timeout = event(&state, "restart.in_process_timeout").await;
        assert_eq!(evidence(&timeout, "unacknowledged"), "0");
        assert_eq!(evidence(&timeout, "incident"), "inc-9");
        assert_eq!(evidence(&timeout, "escalated_to"), "restart_in_job");
        let e = escalations.recv().await.unwrap();
        assert_eq!(
            (e.incident.as_str(), e.action),
            ("inc-9", Action::RestartInJob)
        );
    }

    #[tokio::test]
    async fn nothing_to_restart_is_said() {
        let (_dir, state) = agent(Duration::from_secs(1));
        assert!(matches!(
            request(&state.in_process(), "nobody", "", ""),
            Err(RestartError::NoLiveRanks { .. })
        ));
        assert!(matches!(
            request(&state.in_process(), "", "", ""),
            Err(RestartError::EmptyJob)
        ));
        assert!(matches!(
            subscribe(&state.in_process(), &key("nobody", 0), 1),
            Err(ControlError::UnknownRank { .. })
        ));
    }

    /// A child process (`sleep`) registered as rank `rank` of `job`, held by
    /// its process handle as the API holds a client's; killed on drop.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn register_child(
        state: &AgentState,
        job: &str,
        (rank, world): (u32, u32),
    ) -> (Child, Registration) {
        let child = Child(
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap(),
        );
        let pid = child.0.id();
        let uid = nix::unistd::getuid().as_raw();
        let process =
            crate::ranks::process::RankProcess::verify(pid, std::process::id(), uid).unwrap();
        let mut req = RegisterRequest::for_test(job, rank, world);
        req.pid = pid;
        req.declared_pid = pid;
        req.process = Some(process);
        let reg = state.registry().register(&req, 0).unwrap();
        state
            .registry()
            .slots()
            .slot(reg.slot_index)
            .unwrap()
            .attach_writer(reg.generation, pid);
        (child, reg)
    }

    fn signal(child: &Child, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.0.id()).unwrap());
        nix::sys::signal::kill(pid, sig).unwrap();
    }

    /// A rank frozen with SIGSTOP is handed to its launcher at once (well
    /// before the timeout), its peer keeps its in-process restart, and the
    /// launcher's StopRanks for the frozen rank alone ends the request.
    #[tokio::test]
    async fn a_stopped_rank_is_replaced_at_once_and_the_others_restart_in_process() {
        let (_dir, state) = agent(Duration::from_secs(30));
        let mut escalations = state.take_escalations().unwrap();
        let r0 = register(&state, "j", 0);
        let (frozen, _r1) = register_child(&state, "j", (1, 4));
        signal(&frozen, nix::sys::signal::Signal::SIGSTOP);
        let t0 = Instant::now();
        let asked = request(&state.in_process(), "j", "hang", "inc-3").unwrap();
        assert_eq!(asked.ranks, vec![0, 1]);
        let e = escalations.recv().await.unwrap();
        let waited = t0.elapsed();
        assert!(waited >= STOPPED_FOR, "replaced after {waited:?}");
        assert!(
            waited < Duration::from_secs(10),
            "replaced after {waited:?}"
        );
        assert_eq!(
            (e.incident.as_str(), e.action),
            ("inc-3", Action::RestartInProcess)
        );
        assert_eq!(
            e.replace,
            Some(Replacement {
                ranks: vec![1],
                restart_count: asked.restart_count
            })
        );
        assert!(e.reason.contains("rank 1 stopped"), "{}", e.reason);
        let ev = event(&state, "restart.replace_ranks").await;
        assert_eq!(evidence(&ev, "ranks"), "1");
        assert_eq!(evidence(&ev, "carried"), "true");
        // Rank 0 answers; the launcher stops rank 1 alone (StopRanks).
        assert!(ack(&state.in_process(), &key("j", 0), r0.generation, asked.seq).unwrap());
        let stop = warden_core::signal::StopReason {
            kind: warden_core::signal::StopKind::Restart,
            why: "replacing rank 1".into(),
        };
        assert_eq!(state.registry().mark_stopping("j", &[1], &stop), vec![1]);
        let done = event(&state, "restart.acknowledged").await;
        assert_eq!(evidence(&done, "acknowledged"), "0");
        assert_eq!(evidence(&done, "gone"), "1 (replaced by its launcher)");
        // Asked once only.
        assert!(escalations.try_recv().is_err());
        assert!(never_published(&state, "restart.in_process_timeout"));
    }

    /// A rank that merely stays silent is not replaced; nor is a job whose
    /// every rank is stopped (suspended as a whole): both wait for the
    /// timeout and escalate to `restart_in_job`, as before. A job's only
    /// local rank, with peers on other hosts, is replaced; and with no
    /// incident (asked by hand) the replacement is said, not escalated.
    #[tokio::test]
    async fn a_silent_rank_or_a_job_stopped_as_a_whole_waits_for_the_timeout() {
        let (_dir, state) = agent(Duration::from_millis(800));
        let mut escalations = state.take_escalations().unwrap();
        let (_running, _) = register_child(&state, "run", (0, 2));
        let (frozen, _) = register_child(&state, "all", (0, 2));
        let (frozen2, _) = register_child(&state, "all", (1, 2));
        let (alone, _) = register_child(&state, "hosts", (3, 8));
        let (by_hand, _) = register_child(&state, "hand", (1, 8));
        for c in [&frozen, &frozen2, &alone, &by_hand] {
            signal(c, nix::sys::signal::Signal::SIGSTOP);
        }
        request(&state.in_process(), "hosts", "hang", "inc-h").unwrap();
        let e = escalations.recv().await.unwrap();
        assert_eq!(e.incident, "inc-h");
        assert_eq!(e.replace.map(|r| r.ranks), Some(vec![3]));
        request(&state.in_process(), "hand", "drill", "").unwrap();
        let by_hand_event = event_about(&state, "restart.replace_ranks", "job/hand").await;
        assert_eq!(evidence(&by_hand_event, "carried"), "false");
        request(&state.in_process(), "run", "hang", "inc-r").unwrap();
        request(&state.in_process(), "all", "hang", "inc-a").unwrap();
        // At the timeout: the silent rank, the suspended job, and the
        // hosts' job whose replacement no launcher carried out.
        let mut got = Vec::new();
        for _ in 0..3 {
            let e = escalations.recv().await.unwrap();
            assert_eq!(e.action, Action::RestartInJob, "{e:?}");
            assert!(e.replace.is_none(), "{e:?}");
            got.push(e.incident);
        }
        got.sort();
        assert_eq!(got, vec!["inc-a", "inc-h", "inc-r"]);
        // Neither of these two was replaced; only the hosts' job and the
        // one asked by hand were said to be.
        let replaced: Vec<String> = state
            .events
            .list(0, 0)
            .0
            .iter()
            .filter(|e| e.kind == "restart.replace_ranks")
            .map(|e| e.subject.clone())
            .collect();
        assert_eq!(replaced.len(), 2, "{replaced:?}");
        assert!(
            replaced.iter().all(|s| s == "job/hosts" || s == "job/hand"),
            "{replaced:?}"
        );
        assert!(escalations.try_recv().is_err());
    }

    /// The timeout as configured by default (30 s), in tokio's paused time:
    /// a silent rank is waited for the whole timeout and not a tick longer,
    /// without the test taking 30 s.
    #[tokio::test(start_paused = true)]
    async fn silence_is_waited_for_exactly_the_timeout() {
        let (_dir, state) = agent(Duration::from_secs(30));
        let mut escalations = state.take_escalations().unwrap();
        register(&state, "j", 0);
        let t0 = tokio::time::Instant::now();
        request(&state.in_process(), "j", "hang", "inc-9").unwrap();
        let e = escalations.recv().await.unwrap();
        let waited = t0.elapsed();
        assert_eq!(e.incident, "inc-9");
        assert!(
            waited >= Duration::from_secs(30) && waited < Duration::from_secs(30) + ACK_POLL * 2,
            "escalated after {waited:?}, the timeout is 30 s"
        );
        let timeout = event(&state, "restart.in_process_timeout").await;
        assert_eq!(evidence(&timeout, "unacknowledged"), "0");
    }
}
