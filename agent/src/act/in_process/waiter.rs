//! The waiter of one in-process restart request, as a pure machine: what
//! to do about the ranks' answers, their exits, a rank seen stopped and the
//! clock, given everything seen before.
//!
//! In: one [`WaiterInput`] at a time and the time it arrives, through
//! [`Waiter::step`]: an acknowledgement (by `AckControl` or the slot's ack
//! word), a rank gone (the registry's entry says why), a rank's process
//! state (read from /proc by the caller: [`Waiter::state_check_due`] says
//! when), a second request that joins this one, and [`WaiterInput::Tick`], the
//! clock read after each look. Out: a [`WaiterStep`]: wait, replace the
//! ranks stopped for [`STOPPED_FOR`] with the request's restart count,
//! escalate at the deadline, or done. A reading only records what it saw
//! (`Wait`, or `Ignored` when it changes nothing); the time-bound
//! decisions (replace, escalate, done) are taken on `Tick`, so that every
//! reading of one look is in before the machine decides.
//!
//! Never: I/O, locks, tokio, or a clock of its own (the time comes in with
//! each input), so recorded scenarios replay it exactly (`scenarios.rs`).
//! It publishes nothing and sends nothing: the glue (`mod.rs`) carries its
//! decisions out.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A request to restart a job's ranks in process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRestart {
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

/// How long a rank's process must show as stopped, read after read, before
/// it is replaced: a tracer's stop (`t`, a debugger or strace stepping it)
/// passes within this; SIGSTOP lasts until someone sends SIGCONT.
pub const STOPPED_FOR: Duration = Duration::from_millis(200);

/// How often the ranks that have not answered have their process state
/// read (one /proc read each).
pub const STATE_POLL: Duration = Duration::from_millis(50);

/// By which path an acknowledgement came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The `AckControl` call.
    Rpc,
    /// The slot's ack word.
    Slot,
}

impl Via {
    /// As the `restart.acknowledged` event's latencies name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rpc => "rpc",
            Self::Slot => "slot",
        }
    }
}

/// Why the registry says a rank no longer waits for the request: its
/// launcher restarts it either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Deregistered.
    Left,
    /// Registered again (another generation).
    RegisteredAgain,
    /// Its process exited.
    Exited,
    /// Its launcher stopped it (StopRanks): a replacement the waiter asked
    /// for, or the launcher's own stop.
    StoppedByLauncher,
    /// Lost, or its slot lost.
    LostSlot,
}

/// How a rank's part of a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankOutcome {
    /// It acknowledged, this long after the request, by this path.
    Acked {
        /// Since the request.
        after: Duration,
        /// Which path.
        via: Via,
    },
    /// It exited, was lost or registered again: its launcher restarts it.
    Gone {
        /// Why, for a person ("replaced by its launcher", ...).
        why: &'static str,
    },
}

/// One event the machine takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaiterInput {
    /// `rank` (its registration `generation`) acknowledged request `seq`.
    Acked {
        /// The rank.
        rank: u32,
        /// The generation it acknowledged with.
        generation: u64,
        /// The request it acknowledged.
        seq: u64,
        /// The path.
        via: Via,
    },
    /// The registry says `rank` no longer waits.
    Gone {
        /// The rank.
        rank: u32,
        /// Why.
        why: Gone,
    },
    /// `rank`'s process state as the caller read it: stopped (`T` or `t`)
    /// or not.
    State {
        /// The rank.
        rank: u32,
        /// Stopped.
        stopped: bool,
    },
    /// Another request for the job while this one is in flight (it joins
    /// this one); `incident` is "" when asked by hand.
    Joined {
        /// The incident that asked, if any.
        incident: String,
    },
    /// The clock, read after a look: what is due now.
    Tick,
}

/// What the machine says to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaiterStep {
    /// Taken; keep waiting.
    Wait,
    /// Nothing changed: an answer already had, another registration's or
    /// request's acknowledgement, or an input after the request ended.
    Ignored,
    /// Have the launcher replace these ranks (their process is stopped)
    /// while the others go on; they start with `restart_count`.
    Replace {
        /// The ranks, ascending.
        ranks: Vec<u32>,
        /// The request's restart count.
        restart_count: u32,
        /// The incident whose revision carries it to the launcher (None:
        /// asked by hand, nothing carries it).
        incident: Option<String>,
    },
    /// The deadline passed with ranks silent: the request ends, and the
    /// incident (if any) goes up to `restart_in_job`.
    Escalate {
        /// Those that never answered, ascending.
        silent: Vec<u32>,
        /// Those that acknowledged, ascending.
        acked: Vec<u32>,
        /// The incident to escalate (None: asked by hand).
        incident: Option<String>,
    },
    /// Every rank answered: the request ends.
    Done {
        /// Each rank's answer.
        outcomes: BTreeMap<u32, RankOutcome>,
    },
}

/// A rank the request waits for.
#[derive(Debug, Clone)]
struct RankWait {
    generation: u64,
    slot: u32,
    outcome: Option<RankOutcome>,
    /// Since when every read of its process state said stopped.
    stopped_since: Option<Instant>,
    /// Its launcher was asked to replace it.
    replaced: bool,
}

/// A rank not answered yet, for the caller's look at the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// The rank.
    pub rank: u32,
    /// The generation it was asked with.
    pub generation: u64,
    /// Its slot then.
    pub slot: u32,
    /// Its launcher was asked to replace it (its state is not read again).
    pub replaced: bool,
}

/// One request's wait.
#[derive(Debug, Clone)]
pub struct Waiter {
    /// The request; its incident is the first that joined one asked by
    /// hand.
    request: JobRestart,
    asked_at: Instant,
    deadline: Instant,
    ranks: BTreeMap<u32, RankWait>,
    /// When the unanswered ranks' process states are read next.
    next_state_check: Instant,
    /// The job's world size as its ranks declared it: more than the ranks
    /// asked means ranks on other hosts, which this agent cannot see.
    world_size: u32,
    /// Done or escalated: every input is ignored.
    over: bool,
}

impl Waiter {
    /// A wait for `request`, asked of `ranks` (rank, generation, slot) at
    /// `now`, until `now + timeout`.
    pub fn new(
        request: JobRestart,
        ranks: &[(u32, u64, u32)],
        world_size: u32,
        now: Instant,
        timeout: Duration,
    ) -> Self {
        Self {
            request,
            asked_at: now,
            deadline: now + timeout,
            ranks: ranks
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
            next_state_check: now,
            world_size,
            over: false,
        }
    }

    /// The request, with the incident that carries it now.
    pub fn request(&self) -> &JobRestart {
        &self.request
    }

    /// The ranks asked, ascending.
    pub fn ranks(&self) -> Vec<u32> {
        self.ranks.keys().copied().collect()
    }

    /// How long after the request `now` is (what a recorded scenario's
    /// times count from).
    pub fn since_asked(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.asked_at)
    }

    /// When silence escalates.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The ranks not answered yet.
    pub fn waiting(&self) -> Vec<Waiting> {
        self.ranks
            .iter()
            .filter(|(_, w)| w.outcome.is_none())
            .map(|(&rank, w)| Waiting {
                rank,
                generation: w.generation,
                slot: w.slot,
                replaced: w.replaced,
            })
            .collect()
    }

    /// Whether this look reads the process states of the ranks waited for
    /// (every [`STATE_POLL`]); true moves the next read on.
    pub fn state_check_due(&mut self, now: Instant) -> bool {
        let due = now >= self.next_state_check;
        if due {
            self.next_state_check = now + STATE_POLL;
        }
        due
    }

    /// Takes one input at `now`.
    pub fn step(&mut self, input: WaiterInput, now: Instant) -> WaiterStep {
        if self.over {
            return WaiterStep::Ignored;
        }
        match input {
            WaiterInput::Acked {
                rank,
                generation,
                seq,
                via,
            } => {
                let after = now.saturating_duration_since(self.asked_at);
                self.answer(
                    rank,
                    Some(generation).filter(|_| seq == self.request.seq),
                    RankOutcome::Acked { after, via },
                )
            }
            WaiterInput::Gone { rank, why } => {
                let replaced = self.ranks.get(&rank).is_some_and(|w| w.replaced);
                // A rank handed to its launcher for replacement is gone
                // by that replacement, whichever trace of it the next
                // read finds: the launcher's stop, the exit, or (a warm
                // standby is fast, the reads are ACK_POLL apart) the
                // replacement already registered in its place.
                let why = match why {
                    _ if replaced => "replaced by its launcher",
                    Gone::Left => "left",
                    Gone::RegisteredAgain => "registered again",
                    Gone::Exited => "exited",
                    Gone::StoppedByLauncher => "stopped by its launcher",
                    Gone::LostSlot => "lost its slot",
                };
                self.answer(rank, None, RankOutcome::Gone { why })
            }
            WaiterInput::State { rank, stopped } => {
                match self
                    .ranks
                    .get_mut(&rank)
                    .filter(|w| w.outcome.is_none() && !w.replaced)
                {
                    Some(w) => {
                        w.stopped_since = if stopped {
                            Some(w.stopped_since.unwrap_or(now))
                        } else {
                            None
                        };
                        WaiterStep::Wait
                    }
                    None => WaiterStep::Ignored,
                }
            }
            WaiterInput::Joined { incident } => {
                // A request asked by hand (a launcher's heal) carries no
                // incident, so its timeout would escalate nothing and a
                // rank that can never answer (blocked in a collective no
                // signal interrupts) would hold the job until the
                // collective's own timeout. The first incident that joins
                // it is the one its timeout and replacements carry.
                if self.request.incident.is_empty() && !incident.is_empty() {
                    self.request.incident = incident;
                }
                WaiterStep::Wait
            }
            WaiterInput::Tick => self.tick(now),
        }
    }

    /// Records `rank`'s answer; `generation`, for an acknowledgement, must
    /// be the one asked (None with an acknowledgement: another request's).
    fn answer(&mut self, rank: u32, generation: Option<u64>, outcome: RankOutcome) -> WaiterStep {
        let is_ack = matches!(outcome, RankOutcome::Acked { .. });
        match self.ranks.get_mut(&rank).filter(|w| {
            w.outcome.is_none() && (!is_ack || generation.is_some_and(|g| g == w.generation))
        }) {
            Some(w) => {
                w.outcome = Some(outcome);
                WaiterStep::Wait
            }
            None => WaiterStep::Ignored,
        }
    }

    /// What is due at `now`: done once every rank answered, else the
    /// escalation at the deadline, else the replacement of ranks stopped
    /// long enough.
    fn tick(&mut self, now: Instant) -> WaiterStep {
        if self.ranks.values().all(|w| w.outcome.is_some()) {
            self.over = true;
            return WaiterStep::Done {
                outcomes: self
                    .ranks
                    .iter()
                    .filter_map(|(&r, w)| w.outcome.map(|o| (r, o)))
                    .collect(),
            };
        }
        if now >= self.deadline {
            self.over = true;
            return WaiterStep::Escalate {
                silent: self
                    .ranks
                    .iter()
                    .filter(|(_, w)| w.outcome.is_none())
                    .map(|(&r, _)| r)
                    .collect(),
                acked: self
                    .ranks
                    .iter()
                    .filter(|(_, w)| matches!(w.outcome, Some(RankOutcome::Acked { .. })))
                    .map(|(&r, _)| r)
                    .collect(),
                incident: self.incident(),
            };
        }
        let ranks = self.stopped_to_replace(now);
        if ranks.is_empty() {
            return WaiterStep::Wait;
        }
        WaiterStep::Replace {
            ranks,
            restart_count: self.request.restart_count,
            incident: self.incident(),
        }
    }

    fn incident(&self) -> Option<String> {
        Some(self.request.incident.clone()).filter(|i| !i.is_empty())
    }

    /// The ranks stopped for [`STOPPED_FOR`] and not yet handed to their
    /// launcher, marked as handed. None while every rank of the job (the
    /// request covers its world) is stopped: a job suspended as a whole, by
    /// its scheduler or by hand, is resumed, not replaced (and replacing
    /// all of it is the in-job restart the timeout leads to anyway). A job
    /// with ranks on other hosts has peers this agent cannot see: its
    /// stopped local ranks are replaced even when they are all it has here.
    fn stopped_to_replace(&mut self, now: Instant) -> Vec<u32> {
        let whole_job = u32::try_from(self.ranks.len()).unwrap_or(u32::MAX) >= self.world_size;
        let is_stopped = |w: &RankWait| {
            w.outcome.is_none()
                && (w.replaced
                    || w.stopped_since
                        .is_some_and(|t| now.saturating_duration_since(t) >= STOPPED_FOR))
        };
        if whole_job && self.ranks.values().all(is_stopped) {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (&rank, w) in &mut self.ranks {
            if !w.replaced && is_stopped(w) {
                w.replaced = true;
                out.push(rank);
            }
        }
        out
    }
}
