//! The in-process waiter's recorded scenarios replayed through the pure
//! machine: each is the sequence of inputs the glue fed it (milliseconds
//! after the request) and the decision each must give, by a short name.
//! Those marked "Recorded" are a real agent's sequences: the glue traces
//! every input the machine took and every decision other than waiting
//! (`RUST_LOG=warden_agent::act::in_process=trace`, with `at_ms`), here
//! from the named test of `tests.rs` (real registrations and slots, a
//! `sleep` child frozen with SIGSTOP); the traces leave out the looks that
//! changed nothing, so the ticks between reads are written back in, and a
//! few are added to pin the moment a decision must not come yet. The
//! others are written to reach what the tests cannot time (an answer with
//! the deadline, a tracer's stop, every way a rank goes).

use std::time::{Duration, Instant};

use super::waiter::JobRestart;
use super::waiter::{Gone, RankOutcome, Via, Waiter, WaiterInput, WaiterStep};

/// The request's sequence number in every scenario.
const SEQ: u64 = 7;

/// One scenario: the request, what came in, what the waiter must decide.
struct Scenario {
    name: &'static str,
    /// The ranks asked; rank `r` holds generation `gen(r)` and slot `r`.
    ranks: &'static [u32],
    /// The job's world size as its ranks declared it.
    world_size: u32,
    /// The incident that asked ("" by hand).
    incident: &'static str,
    /// `restart.in_process_timeout`, in ms.
    timeout_ms: u64,
    /// (ms after the request, input, the decision expected by short name).
    steps: Vec<(u64, WaiterInput, &'static str)>,
    /// The ranks still waited for at the end, and whether each was handed
    /// to its launcher.
    waiting: &'static [(u32, bool)],
}

/// Rank `r`'s generation.
fn gen_of(rank: u32) -> u64 {
    100 + u64::from(rank)
}

fn rpc(rank: u32) -> WaiterInput {
    WaiterInput::Acked {
        rank,
        generation: gen_of(rank),
        seq: SEQ,
        via: Via::Rpc,
    }
}

fn slot(rank: u32) -> WaiterInput {
    WaiterInput::Acked {
        rank,
        generation: gen_of(rank),
        seq: SEQ,
        via: Via::Slot,
    }
}

fn gone(rank: u32, why: Gone) -> WaiterInput {
    WaiterInput::Gone { rank, why }
}

fn state(rank: u32, stopped: bool) -> WaiterInput {
    WaiterInput::State { rank, stopped }
}

fn joined(incident: &str) -> WaiterInput {
    WaiterInput::Joined {
        incident: incident.to_owned(),
    }
}

const TICK: WaiterInput = WaiterInput::Tick;

/// A decision by its short name.
fn short(d: &WaiterStep) -> String {
    let by = |i: &Option<String>| i.clone().unwrap_or_else(|| "-".into());
    let list = |r: &[u32]| {
        if r.is_empty() {
            "-".to_owned()
        } else {
            r.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        }
    };
    match d {
        WaiterStep::Wait => "wait".into(),
        WaiterStep::Ignored => "ignored".into(),
        WaiterStep::Replace {
            ranks,
            restart_count,
            incident,
        } => format!(
            "replace {} at count {restart_count} by {}",
            list(ranks),
            by(incident)
        ),
        WaiterStep::Escalate {
            silent,
            acked,
            incident,
        } => format!(
            "escalate silent {} acked {} by {}",
            list(silent),
            list(acked),
            by(incident)
        ),
        WaiterStep::Done { outcomes } => format!(
            "done {}",
            outcomes
                .iter()
                .map(|(r, o)| match o {
                    RankOutcome::Acked { after, via } => {
                        format!("{r} {} {}ms", via.as_str(), after.as_millis())
                    }
                    RankOutcome::Gone { why } => format!("{r} {why}"),
                })
                .collect::<Vec<_>>()
                .join("; ")
        ),
    }
}

/// `rank` read every 50 ms (the glue's state poll) at `times`, stopped or
/// not, each look ending with a tick that waits.
fn reads(rank: u32, stopped: bool, times: &[u64]) -> Vec<(u64, WaiterInput, &'static str)> {
    times
        .iter()
        .flat_map(|&t| [(t, state(rank, stopped), "wait"), (t, TICK, "wait")])
        .collect()
}

fn scenarios() -> Vec<Scenario> {
    vec![
        // Recorded: tests.rs, every_rank_is_asked_through_slot_and_stream_and_both_acks_count.
        Scenario {
            name: "every rank acknowledges in time: one by AckControl, one by its slot (recorded: both within the first look)",
            ranks: &[0, 1],
            world_size: 4,
            incident: "",
            timeout_ms: 30_000,
            steps: vec![
                (0, joined(""), "wait"),
                (0, rpc(1), "wait"),
                (0, state(0, false), "wait"),
                (0, slot(0), "wait"),
                (0, TICK, "done 0 slot 0ms; 1 rpc 0ms"),
                // Over: nothing more is taken.
                (3, slot(0), "ignored"),
                (3, TICK, "ignored"),
            ],
            waiting: &[],
        },
        Scenario {
            name: "every rank acknowledges in time, at different moments: each acknowledgement is dated when taken, a second one of a rank is ignored",
            ranks: &[0, 1],
            world_size: 4,
            incident: "",
            timeout_ms: 30_000,
            steps: vec![
                (0, state(0, false), "wait"),
                (0, state(1, false), "wait"),
                (0, TICK, "wait"),
                (3, rpc(1), "wait"),
                (3, rpc(1), "ignored"),
                (4, TICK, "wait"),
                (9, slot(0), "wait"),
                (9, TICK, "done 0 slot 9ms; 1 rpc 3ms"),
            ],
            waiting: &[],
        },
        Scenario {
            name: "an acknowledgement of another registration or another request is not an answer",
            ranks: &[0],
            world_size: 1,
            incident: "inc-1",
            timeout_ms: 30_000,
            steps: vec![
                (
                    2,
                    WaiterInput::Acked {
                        rank: 0,
                        generation: gen_of(0) + 1,
                        seq: SEQ,
                        via: Via::Slot,
                    },
                    "ignored",
                ),
                (
                    2,
                    WaiterInput::Acked {
                        rank: 0,
                        generation: gen_of(0),
                        seq: SEQ - 1,
                        via: Via::Rpc,
                    },
                    "ignored",
                ),
                (2, rpc(5), "ignored"),
                (2, TICK, "wait"),
                (6, rpc(0), "wait"),
                (7, TICK, "done 0 rpc 6ms"),
            ],
            waiting: &[],
        },
        // Recorded: tests.rs, silence_is_waited_for_exactly_the_timeout (tokio's
        // paused clock); the tick at 29 999 ms is written in.
        Scenario {
            name: "one rank never acknowledges: at the timeout, and not a tick before, the incident is escalated to restart_in_job; a late answer is ignored",
            ranks: &[0],
            world_size: 4,
            incident: "inc-9",
            timeout_ms: 30_000,
            steps: {
                let mut s = reads(0, false, &(0..600).map(|i| i * 50).collect::<Vec<_>>());
                s.extend(vec![
                    (29_999, TICK, "wait"),
                    (30_000, state(0, false), "wait"),
                    (30_000, TICK, "escalate silent 0 acked - by inc-9"),
                    (30_004, rpc(0), "ignored"),
                ]);
                s
            },
            waiting: &[(0, false)],
        },
        // Recorded: tests.rs, silence_escalates_the_incident_and_a_rank_that_leaves_is_handled.
        Scenario {
            name: "a rank that leaves is handled by its launcher; the silent one is escalated at the timeout",
            ranks: &[0, 1],
            world_size: 4,
            incident: "inc-7",
            timeout_ms: 200,
            steps: {
                let mut s = vec![
                    (0, state(0, false), "wait"),
                    (0, gone(1, Gone::Left), "wait"),
                    (0, TICK, "wait"),
                ];
                s.extend(reads(0, false, &[56, 112, 162]));
                s.push((205, TICK, "escalate silent 0 acked - by inc-7"));
                s
            },
            waiting: &[(0, false)],
        },
        Scenario {
            name: "an answer that comes with the deadline counts: the last look ends in done, not in the escalation",
            ranks: &[0, 1],
            world_size: 2,
            incident: "inc-8",
            timeout_ms: 200,
            steps: vec![
                (5, rpc(1), "wait"),
                (5, TICK, "wait"),
                (200, slot(0), "wait"),
                (200, TICK, "done 0 slot 200ms; 1 rpc 5ms"),
            ],
            waiting: &[],
        },
        Scenario {
            name: "a rank exits during the wait: its launcher restarts it, the others' acknowledgements end the request",
            ranks: &[0, 1, 2],
            world_size: 3,
            incident: "inc-4",
            timeout_ms: 30_000,
            steps: vec![
                (0, TICK, "wait"),
                (2, rpc(2), "wait"),
                (40, gone(1, Gone::Exited), "wait"),
                (40, TICK, "wait"),
                // Seen again, registered anew: it answered already.
                (45, gone(1, Gone::RegisteredAgain), "ignored"),
                (60, slot(0), "wait"),
                (60, TICK, "done 0 slot 60ms; 1 exited; 2 rpc 2ms"),
            ],
            waiting: &[],
        },
        Scenario {
            name: "every way a rank goes is named for a person",
            ranks: &[0, 1, 2, 3],
            world_size: 4,
            incident: "inc-5",
            timeout_ms: 30_000,
            steps: vec![
                (10, gone(0, Gone::RegisteredAgain), "wait"),
                (10, gone(1, Gone::StoppedByLauncher), "wait"),
                (10, gone(2, Gone::LostSlot), "wait"),
                (10, TICK, "wait"),
                (20, gone(3, Gone::Left), "wait"),
                (
                    20,
                    TICK,
                    "done 0 registered again; 1 stopped by its launcher; 2 lost its slot; 3 left",
                ),
            ],
            waiting: &[],
        },
        // Recorded: tests.rs, a_stopped_rank_is_replaced_at_once_and_the_others_restart_in_process
        // (rank 1 a `sleep` child frozen with SIGSTOP).
        Scenario {
            name: "a rank frozen with SIGSTOP (state T read after read for 200 ms) is replaced at once with the request's restart count; its peer restarts in process; the launcher's stop of it ends the request",
            ranks: &[0, 1],
            world_size: 4,
            incident: "inc-3",
            timeout_ms: 30_000,
            steps: {
                let mut s = vec![
                    (0, state(0, false), "wait"),
                    (0, state(1, false), "wait"),
                    (0, TICK, "wait"),
                ];
                for t in [56, 107, 160, 216] {
                    s.extend(vec![
                        (t, state(0, false), "wait"),
                        (t, state(1, true), "wait"),
                        (t, TICK, "wait"),
                    ]);
                }
                s.extend(vec![
                    (255, TICK, "wait"),
                    (261, TICK, "replace 1 at count 1 by inc-3"),
                    // Handed over: its state is not taken again, and it is
                    // not replaced twice.
                    (261, state(1, true), "ignored"),
                    (261, TICK, "wait"),
                    (262, rpc(0), "wait"),
                    (262, gone(1, Gone::StoppedByLauncher), "wait"),
                    (262, TICK, "done 0 rpc 262ms; 1 replaced by its launcher"),
                ]);
                s
            },
            waiting: &[],
        },
        // Recorded: CI, torch_faults.rs
        // a_rank_frozen_with_sigstop_two_ranks_is_replaced_while_its_peer_restarts_in_process
        // (loaded machine): the warm replacement registered before the
        // waiter's next read, which saw a new generation, not the stop.
        Scenario {
            name: "a rank replaced whose replacement has registered by the next read is gone as replaced by its launcher, not as registered again",
            ranks: &[0, 1],
            world_size: 2,
            incident: "inc-4",
            timeout_ms: 30_000,
            steps: {
                let mut s = reads(1, true, &[0, 50, 100, 150]);
                s.extend(vec![
                    (200, TICK, "replace 1 at count 1 by inc-4"),
                    (202, rpc(0), "wait"),
                    (404, gone(1, Gone::RegisteredAgain), "wait"),
                    (404, TICK, "done 0 rpc 202ms; 1 replaced by its launcher"),
                ]);
                s
            },
            waiting: &[],
        },
        Scenario {
            name: "a rank replaced that its launcher never stops (a launcher from before replacements) is escalated at the timeout",
            ranks: &[0, 1],
            world_size: 4,
            incident: "inc-3",
            timeout_ms: 1_000,
            steps: {
                let mut s = reads(1, true, &[0, 50, 100, 150]);
                s.extend(vec![
                    (200, TICK, "replace 1 at count 1 by inc-3"),
                    (230, rpc(0), "wait"),
                    (230, TICK, "wait"),
                    (1_000, TICK, "escalate silent 1 acked 0 by inc-3"),
                ]);
                s
            },
            waiting: &[(1, true)],
        },
        Scenario {
            name: "a tracer's stop (state t) that passes within 200 ms replaces nobody",
            ranks: &[0, 1],
            world_size: 2,
            incident: "inc-2",
            timeout_ms: 30_000,
            steps: {
                let mut s = reads(1, true, &[0, 50, 100]);
                s.extend(reads(1, false, &[150]));
                // Stopped again: the 200 ms count from here.
                s.extend(reads(1, true, &[200, 250, 300, 350]));
                s.extend(vec![
                    (360, rpc(0), "wait"),
                    (360, rpc(1), "wait"),
                    (360, TICK, "done 0 rpc 360ms; 1 rpc 360ms"),
                ]);
                s
            },
            waiting: &[],
        },
        // Recorded: tests.rs, a_silent_rank_or_a_job_stopped_as_a_whole_waits_for_the_timeout, job "all".
        Scenario {
            name: "a job whose every rank is here and stopped is suspended as a whole: resumed, not replaced; the timeout escalates it",
            ranks: &[0, 1],
            world_size: 2,
            incident: "inc-a",
            timeout_ms: 800,
            steps: {
                let mut s = Vec::new();
                for t in [
                    0, 56, 110, 163, 213, 268, 323, 378, 429, 483, 539, 590, 642, 693, 747,
                ] {
                    s.push((t, state(0, true), "wait"));
                    s.extend(reads(1, true, &[t]));
                }
                s.extend(vec![
                    (802, state(0, true), "wait"),
                    (802, state(1, true), "wait"),
                    (802, TICK, "escalate silent 0,1 acked - by inc-a"),
                ]);
                s
            },
            waiting: &[(0, false), (1, false)],
        },
        // Recorded: the same test, job "hosts".
        Scenario {
            name: "a job's only local rank, with peers on other hosts (world 8), is replaced even though it is all the job has here",
            ranks: &[3],
            world_size: 8,
            incident: "inc-h",
            timeout_ms: 800,
            steps: {
                let mut s = reads(3, false, &[0]);
                s.extend(reads(3, true, &[61, 112, 168, 218]));
                s.extend(vec![
                    (258, TICK, "wait"),
                    (263, TICK, "replace 3 at count 1 by inc-h"),
                    (801, TICK, "escalate silent 3 acked - by inc-h"),
                ]);
                s
            },
            waiting: &[(3, true)],
        },
        // Recorded: the same test, job "hand".
        Scenario {
            name: "asked by hand, a stopped rank is said to be replaced with no incident to carry it; the timeout escalates nothing",
            ranks: &[1],
            world_size: 8,
            incident: "",
            timeout_ms: 800,
            steps: {
                let mut s = reads(1, true, &[0, 51, 106, 158]);
                s.extend(vec![
                    (205, TICK, "replace 1 at count 1 by -"),
                    (801, TICK, "escalate silent 1 acked - by -"),
                ]);
                s
            },
            waiting: &[(1, true)],
        },
        // Recorded: tests.rs, an_incident_that_joins_a_request_asked_by_hand_is_escalated_at_its_timeout.
        Scenario {
            name: "a second request during the wait joins it: the first incident that joins a request asked by hand is the one its timeout escalates, a later one does not take it over",
            ranks: &[0, 1],
            world_size: 4,
            incident: "",
            timeout_ms: 300,
            steps: {
                let mut s = vec![
                    (0, joined("inc-9"), "wait"),
                    (0, joined("inc-10"), "wait"),
                    (0, rpc(1), "wait"),
                ];
                s.extend(reads(0, false, &[0, 59, 110, 167, 219, 294]));
                s.push((300, TICK, "escalate silent 0 acked 1 by inc-9"));
                s
            },
            waiting: &[(0, false)],
        },
        Scenario {
            name: "a second request joins one that an incident asked: the stopped rank's replacement is carried by the first incident",
            ranks: &[0, 1],
            world_size: 4,
            incident: "inc-1",
            timeout_ms: 30_000,
            steps: {
                let mut s = vec![(0, joined("inc-2"), "wait")];
                s.extend(reads(0, true, &[0, 50, 100, 150]));
                s.extend(vec![
                    (200, TICK, "replace 0 at count 1 by inc-1"),
                    (210, slot(1), "wait"),
                    (210, gone(0, Gone::StoppedByLauncher), "wait"),
                    (210, TICK, "done 0 replaced by its launcher; 1 slot 210ms"),
                ]);
                s
            },
            waiting: &[],
        },
    ]
}

#[test]
fn recorded_scenarios_replay() {
    let base = Instant::now();
    let at = |ms: u64| base + Duration::from_millis(ms);
    for s in scenarios() {
        let request = JobRestart {
            job: "j".into(),
            seq: SEQ,
            restart_count: 1,
            incident: s.incident.into(),
            reason: "replay".into(),
        };
        let ranks: Vec<(u32, u64, u32)> = s.ranks.iter().map(|&r| (r, gen_of(r), r)).collect();
        let mut waiter = Waiter::new(
            request,
            &ranks,
            s.world_size,
            at(0),
            Duration::from_millis(s.timeout_ms),
        );
        assert_eq!(waiter.deadline(), at(s.timeout_ms), "{}", s.name);
        for (i, (t, input, want)) in s.steps.into_iter().enumerate() {
            let shown = format!("{input:?}");
            let got = short(&waiter.step(input, at(t)));
            assert_eq!(got, want, "{}: step {i} (t={t} ms, {shown})", s.name);
        }
        let waiting: Vec<(u32, bool)> = waiter
            .waiting()
            .iter()
            .map(|w| (w.rank, w.replaced))
            .collect();
        assert_eq!(waiting, s.waiting, "{}: waiting at the end", s.name);
    }
}

/// The glue reads the process states every `STATE_POLL`, not on every
/// look (5 ms): the first look reads them, the next ones within 50 ms not.
#[test]
fn process_states_are_read_every_state_poll() {
    let base = Instant::now();
    let at = |ms: u64| base + Duration::from_millis(ms);
    let request = JobRestart {
        job: "j".into(),
        seq: SEQ,
        restart_count: 1,
        incident: String::new(),
        reason: String::new(),
    };
    let mut w = Waiter::new(request, &[(0, 100, 0)], 1, at(0), Duration::from_secs(30));
    let due: Vec<bool> = [0, 5, 10, 49, 50, 55, 99, 101, 150]
        .iter()
        .map(|&t| w.state_check_due(at(t)))
        .collect();
    assert_eq!(
        due,
        [true, false, false, false, true, false, false, true, false]
    );
}
