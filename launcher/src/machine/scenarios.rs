//! The launcher's recorded scenarios replayed through the machine: each is
//! the sequence of inputs the executor brought (milliseconds after the
//! launcher started), the commands each must give (every command but the
//! console lines, by a short name), and how the job must end. The console
//! lines the system tests grep are checked by a part of their text.

use std::time::{Duration, Instant, SystemTime};

use super::{
    Action, Command, FeedDecision, GateVerdict, Input, JobState, Listen, Now, Progress, Replaced,
    Replacement, RunLimits, SIGTERM, Started, WorkerExit,
};
use crate::exit::IncidentBrief;
use crate::hosts::{AttemptPlan, Directive, Remote};
use crate::spawn::Exit;

const SIGINT: i32 = 2;

/// One scenario: what came in, what the machine must do, how it ends.
struct Scenario {
    name: &'static str,
    limits: RunLimits,
    /// (ms after the start, input, the commands expected, by short name).
    steps: Vec<(u64, Input, &'static [&'static str])>,
    expect: End,
}

/// How the job ends.
#[derive(Default)]
struct End {
    /// The finish's status (None: the job has not ended).
    code: Option<i32>,
    /// A part of the finish's outcome.
    outcome: &'static str,
    /// The other hosts stop with it.
    job_failed: bool,
    restarts: u32,
    local_restarts: u32,
    fallback_used: u32,
    /// Workers replaced in the middle of in-process restarts.
    replacements: u32,
    /// The summary's attempt records (after the end).
    records: usize,
    /// A part of the last record's `ended`.
    ended: &'static str,
    /// Parts of console lines, in order.
    says: &'static [&'static str],
    /// The stop the launcher reports to its agent: its evidence as
    /// "subject signal=value", in order (empty: no report).
    reported: &'static [&'static str],
    /// The ranks the last record says aborted at exit (the summary's
    /// `aborted_at_exit`), in order.
    aborted: &'static [u32],
}

fn limits() -> RunLimits {
    RunLimits {
        max_restarts: None,
        fallback_budget: 3,
        decision_timeout: Duration::from_secs(5),
        teardown_timeout: Duration::from_secs(60),
        stop_grace: Duration::from_secs(10),
        nproc_per_node: 2,
        coordinator: "local".into(),
        across_hosts: false,
        round_store_hosted: false,
        max_no_progress: None,
        term_grace: Duration::ZERO,
    }
}

fn across_hosts() -> RunLimits {
    RunLimits {
        coordinator: "etcd".into(),
        across_hosts: true,
        round_store_hosted: true,
        ..limits()
    }
}

fn plan(n: u32) -> AttemptPlan {
    AttemptPlan {
        restart_count: n,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        node_rank: Some(0),
        nnodes: 1,
        world_size: 2,
        rank_offset: 0,
        epoch: None,
        round: None,
        ckpt_peers: Default::default(),
        // What a heal into a round needs of the adapter; nothing else
        // reads it.
        keeps_place: true,
    }
}

fn standby(n: u32) -> AttemptPlan {
    AttemptPlan {
        node_rank: None,
        ..plan(n)
    }
}

/// The answer to a start: two workers, pids `base` and `base + 1`.
fn started(p: AttemptPlan, base: i32, t: u64) -> Input {
    let workers = if p.node_rank.is_some() {
        vec![(0, base), (1, base + 1)]
    } else {
        Vec::new()
    };
    Input::Started(Box::new(Started {
        plan: p,
        workers,
        at: at(t).at,
        wall: at(t).wall,
        error: None,
    }))
}

fn exit(generation: u64, rank: u32, pid: i32, code: i32) -> Input {
    Input::WorkerExit(WorkerExit {
        generation,
        rank,
        pid,
        exit: Some(Exit::Code(code)),
        registered: true,
        deregistered: false,
        client: false,
        traceback: None,
        healable: false,
    })
}

/// A worker of a script without a client that aborted (SIGABRT) with
/// `traceback` the last exception on its stderr.
fn abort(generation: u64, rank: u32, pid: i32, traceback: Option<&str>) -> Input {
    Input::WorkerExit(WorkerExit {
        generation,
        rank,
        pid,
        exit: Some(Exit::Signal(6)),
        registered: true,
        deregistered: false,
        client: false,
        traceback: traceback.map(str::to_owned),
        healable: false,
    })
}

/// A worker whose client deregistered cleanly (its training ended) and
/// that then ended with `exit` (torch's teardown abort: SIGABRT).
fn closed_then(generation: u64, rank: u32, pid: i32, exit: Exit) -> Input {
    Input::WorkerExit(WorkerExit {
        generation,
        rank,
        pid,
        exit: Some(exit),
        registered: true,
        deregistered: true,
        client: true,
        traceback: None,
        healable: false,
    })
}

/// A worker whose client registered but never deregistered, killed by
/// SIGABRT with no traceback: it died in its training.
fn aborted_training(generation: u64, rank: u32, pid: i32) -> Input {
    Input::WorkerExit(WorkerExit {
        generation,
        rank,
        pid,
        exit: Some(Exit::Signal(6)),
        registered: true,
        deregistered: false,
        client: true,
        traceback: None,
        healable: false,
    })
}

/// The first attempt with four workers (pids 100..=103).
fn first_attempt_of_four() -> Vec<(u64, Input, &'static [&'static str])> {
    let p = AttemptPlan {
        world_size: 4,
        ..plan(0)
    };
    vec![
        (0, Input::Begin, &["rendezvous 0"]),
        (1, Input::Agreed(p.clone()), &["start 0"]),
        (
            2,
            Input::Started(Box::new(Started {
                plan: p,
                workers: vec![(0, 100), (1, 101), (2, 102), (3, 103)],
                at: at(2).at,
                wall: at(2).wall,
                error: None,
            })),
            &[],
        ),
    ]
}

/// The agent's `restart_in_job` for a hang (incident `id`, its
/// `revision`, opened at `opened` ms), with every worker's state declared
/// healable or not.
fn hang_decision(id: &str, revision: usize, opened: u64, healable: bool) -> Input {
    match decision(id, revision, opened, Action::RestartInJob, 0) {
        Input::FeedDecision(mut d) => {
            d.brief.kind = "hang".into();
            d.healable = healable;
            Input::FeedDecision(d)
        }
        _ => unreachable!(),
    }
}

/// A decision about incident `id` opened at `opened` ms.
fn decision(id: &str, revision: usize, opened: u64, action: Action, exit_code: i32) -> Input {
    let name = action.as_str();
    Input::FeedDecision(Box::new(FeedDecision {
        id: id.into(),
        revision,
        opened: at(opened).wall,
        action: Some(action),
        exit_code,
        backoff: Duration::ZERO,
        brief: IncidentBrief {
            id: id.into(),
            kind: "crash".into(),
            class: "infra_transient".into(),
            confidence: 0.9,
            summary: format!("the failure of {id}"),
            action: name.into(),
            decided_by: "policy".into(),
            ..Default::default()
        },
        replace: None,
        healable: false,
    }))
}

/// Revision `revision` of incident `id`'s `restart_in_process`, asking for
/// `ranks` to be replaced with restart count `count`.
fn replace(id: &str, revision: usize, opened: u64, ranks: &[u32], count: u32) -> Input {
    match decision(id, revision, opened, Action::RestartInProcess, 0) {
        Input::FeedDecision(mut d) => {
            d.brief.kind = "hang".into();
            d.brief.reason = "rank 1 stopped (SIGSTOP or a tracer)".into();
            d.replace = Some(Replacement {
                ranks: ranks.to_vec(),
                restart_count: count,
            });
            Input::FeedDecision(d)
        }
        other => other,
    }
}

/// The answer to a replacement: the new workers, or why it failed.
fn replaced(workers: &[(u32, i32)], error: Option<&str>) -> Input {
    Input::Replaced(Box::new(Replaced {
        workers: workers.to_vec(),
        error: error.map(str::to_owned),
    }))
}

/// A worker killed by `sig`.
fn killed(generation: u64, rank: u32, pid: i32, sig: i32) -> Input {
    Input::WorkerExit(WorkerExit {
        generation,
        rank,
        pid,
        exit: Some(Exit::Signal(sig)),
        registered: true,
        deregistered: false,
        client: false,
        traceback: None,
        healable: false,
    })
}

/// A worker that declared a healable state (as every other live one did),
/// killed by `sig`.
fn killed_healable(generation: u64, rank: u32, pid: i32, sig: i32) -> Input {
    healable(killed(generation, rank, pid, sig))
}

/// A worker's exit with every worker of the attempt having declared a
/// healable state.
fn healable(input: Input) -> Input {
    match input {
        Input::WorkerExit(mut e) => {
            e.healable = true;
            Input::WorkerExit(e)
        }
        other => other,
    }
}

fn backoff(input: Input, by: Duration) -> Input {
    match input {
        Input::FeedDecision(mut d) => {
            d.backoff = by;
            Input::FeedDecision(d)
        }
        other => other,
    }
}

fn stopped() -> Input {
    Input::Stopped {
        pids: vec![100, 101],
    }
}

/// The clocks at `ms` after the scenario's start.
fn at(ms: u64) -> Now {
    let base = base();
    Now {
        at: base.0 + Duration::from_millis(ms),
        wall: base.1 + Duration::from_millis(ms),
    }
}

fn base() -> (Instant, SystemTime) {
    use std::sync::OnceLock;
    static BASE: OnceLock<(Instant, SystemTime)> = OnceLock::new();
    *BASE.get_or_init(|| {
        (
            Instant::now(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        )
    })
}

/// A command by its short name; None for a console line.
fn short(c: &Command) -> Option<String> {
    Some(match c {
        Command::Say(_) => return None,
        Command::Publish(Directive::RestartInJob { heal: false, .. }) => "publish restart".into(),
        Command::Publish(Directive::RestartInJob { heal: true, .. }) => "publish heal round".into(),
        Command::Publish(Directive::Stop { .. }) => "publish stop".into(),
        Command::Stop { signal, .. } => format!("stop {}", super::signal_name(*signal)),
        Command::Kill { .. } => "kill".into(),
        Command::Notice { step: None, .. } => "notice".into(),
        Command::Notice { step: Some(s), .. } => format!("notice at step {s}"),
        Command::Gate { .. } => "gate".into(),
        Command::LeaveJob { .. } => "leave".into(),
        Command::Reap => "reap".into(),
        Command::Observe => "observe".into(),
        Command::Rendezvous { restart_count } => format!("rendezvous {restart_count}"),
        Command::Start { plan, .. } => format!("start {}", plan.restart_count),
        Command::Heal { rank, pid, .. } => format!("heal {rank}/{pid}"),
        Command::HealRound { plan, .. } => format!("heal into round {}", plan.epoch.unwrap_or(0)),
        Command::Replace {
            workers,
            restart_count,
            ..
        } => format!(
            "replace {} in restart {restart_count}",
            workers
                .iter()
                .map(|(rank, pid)| format!("{rank}/{pid}"))
                .collect::<Vec<_>>()
                .join(",")
        ),
        Command::Finish(f) => format!("finish {}", f.code),
    })
}

/// Attempt `n`'s plan in round `epoch` across hosts: node rank 0 of 2.
fn round_plan(n: u32, epoch: u64) -> AttemptPlan {
    AttemptPlan {
        nnodes: 2,
        world_size: 4,
        epoch: Some(epoch),
        master_port: 29500 + u16::try_from(epoch).unwrap_or(0),
        ..plan(n)
    }
}

/// A round of two hosts with one rank each (this host's: rank 0).
fn one_rank_a_host(n: u32, epoch: u64) -> AttemptPlan {
    AttemptPlan {
        world_size: 2,
        ..round_plan(n, epoch)
    }
}

/// An attempt started with one worker: rank 0 as `pid`.
fn one_worker_started(p: AttemptPlan, pid: i32, t: u64) -> Input {
    Input::Started(Box::new(Started {
        plan: p,
        workers: vec![(0, pid)],
        at: at(t).at,
        wall: at(t).wall,
        error: None,
    }))
}

/// The first attempt of round 1 across hosts: pids 100/101.
fn first_attempt_in_round() -> Vec<(u64, Input, &'static [&'static str])> {
    vec![
        (0, Input::Begin, &["rendezvous 0"]),
        (1, Input::Agreed(round_plan(0, 1)), &["start 0"]),
        (2, started(round_plan(0, 1), 100, 2), &[]),
    ]
}

/// Another host replaced by a spare: a round that keeps this host's place.
fn swapped_round() -> Input {
    Input::Round(Remote::NewRound {
        reason: "round 2: host b lost, spare s in its place".into(),
        keeps_place: true,
    })
}

/// host-a's round for a hang it heals into: the same hosts, which keeps
/// this host's place (etcd.rs's keeps_place, on the round's heal flag).
fn hang_heal_round() -> Input {
    Input::Round(Remote::NewRound {
        reason: "round 2: restart requested by host-a: hang (heals into it)".into(),
        keeps_place: true,
    })
}

/// The first attempt's steps: begin, agree on attempt 0, start pids 100/101.
fn first_attempt() -> Vec<(u64, Input, &'static [&'static str])> {
    vec![
        (0, Input::Begin, &["rendezvous 0"]),
        (1, Input::Agreed(plan(0)), &["start 0"]),
        (2, started(plan(0), 100, 2), &[]),
    ]
}

/// The restart path after a decision: stopped, gated, agreed, started
/// (attempt `n`, pids `base`..).
fn restart_path(t: u64, n: u32, base: i32) -> Vec<(u64, Input, &'static [&'static str])> {
    let rendezvous: &'static [&'static str] = match n {
        1 => &["reap", "rendezvous 1"],
        2 => &["reap", "rendezvous 2"],
        _ => &["reap", "rendezvous 3"],
    };
    let start: &'static [&'static str] = match n {
        1 => &["start 1"],
        2 => &["start 2"],
        _ => &["start 3"],
    };
    vec![
        (t, stopped(), &["gate"]),
        (t + 10, Input::Gated(GateVerdict::Pass), rendezvous),
        (t + 11, Input::Agreed(plan(n)), start),
        (t + 12, started(plan(n), base, t + 12), &[]),
    ]
}

/// The limits with `--teardown-timeout 5s`: the scenarios of a peer that
/// outlives the teardown's wait.
fn short_teardown() -> RunLimits {
    RunLimits {
        teardown_timeout: Duration::from_secs(5),
        ..limits()
    }
}

/// The limits with `--max-no-progress-restarts 3`.
fn no_progress_limits() -> RunLimits {
    RunLimits {
        max_no_progress: Some(3),
        ..limits()
    }
}

/// What the agent shows of the job's progress: its newest complete
/// checkpoint (the tier answered), the step its ranks resumed from.
fn progress(checkpoint: Option<u64>, resumed_from: Option<u64>) -> Input {
    Input::Progress(Progress {
        checkpoint,
        listed: true,
        resumed_from,
        note: String::new(),
    })
}

/// Attempt `n` (generation `n + 1`, pids `base`..) started at `t`: rank 1
/// fails, the agent restarts, the launcher observes the job's progress
/// (`seen`) and goes on with the restart (`restart`) or finishes (88).
fn fail_and_observe(
    t: u64,
    n: u32,
    base: i32,
    seen: Input,
    restart: bool,
) -> Vec<(u64, Input, &'static [&'static str])> {
    let id: &'static str = Box::leak(format!("inc-{}", n + 1).into_boxed_str());
    let then: &'static [&'static str] = if restart {
        &["publish restart", "stop SIGTERM"]
    } else {
        &["finish 88"]
    };
    vec![
        (t, exit(u64::from(n) + 1, 1, base + 1, 3), &[]),
        (
            t + 200,
            decision(id, 0, t + 1, Action::RestartInJob, 0),
            &["observe"],
        ),
        (t + 210, seen, then),
    ]
}

/// Like [`restart_path`], for any attempt number.
fn restart_to(t: u64, n: u32, base: i32) -> Vec<(u64, Input, &'static [&'static str])> {
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let rendezvous: &'static [&'static str] =
        Box::leak(vec!["reap", leak(format!("rendezvous {n}"))].into_boxed_slice());
    let start: &'static [&'static str] =
        Box::leak(vec![leak(format!("start {n}"))].into_boxed_slice());
    vec![
        (t, stopped(), &["gate"]),
        (t + 10, Input::Gated(GateVerdict::Pass), rendezvous),
        (t + 11, Input::Agreed(plan(n)), start),
        (t + 12, started(plan(n), base, t + 12), &[]),
    ]
}

/// The no-progress scenarios: attempts that fail one after another, each
/// observed with `seen[n]`; the last one ends the job when `stops`.
fn failing_attempts(seen: Vec<Input>, stops: bool) -> Vec<(u64, Input, &'static [&'static str])> {
    let mut steps = first_attempt();
    let last = seen.len() - 1;
    for (i, p) in seen.into_iter().enumerate() {
        let n = u32::try_from(i).unwrap_or(u32::MAX);
        let t = 10_000 * u64::from(n) + 1000;
        let base = 100 * (i32::try_from(i).unwrap_or(0) + 1);
        steps.extend(fail_and_observe(t, n, base, p, !(stops && i == last)));
        if !(stops && i == last) {
            steps.extend(restart_to(t + 1000, n + 1, base + 100));
        }
    }
    steps
}

fn with(
    mut a: Vec<(u64, Input, &'static [&'static str])>,
    b: Vec<(u64, Input, &'static [&'static str])>,
) -> Vec<(u64, Input, &'static [&'static str])> {
    a.extend(b);
    a
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "no progress: a job that never checkpoints and dies at another step each time stops after 3 restarts with 88",
            limits: no_progress_limits(),
            // The ranks resume from step 0 every time (nothing saved), the
            // tier holds nothing of the job's.
            steps: failing_attempts(
                vec![
                    progress(None, Some(0)),
                    progress(None, Some(0)),
                    progress(None, Some(0)),
                    progress(None, Some(0)),
                ],
                true,
            ),
            expect: End {
                code: Some(88),
                outcome: "failed: no progress in 3 restarts in a row: no checkpoint in the agent's tier",
                job_failed: true,
                restarts: 3,
                local_restarts: 3,
                records: 4,
                ended: "restart refused (no progress)",
                says: &[
                    "no progress: no checkpoint in the agent's tier, and the ranks' steps show no resume point later than step 0 (1 of --max-no-progress-restarts 3)",
                    "(2 of --max-no-progress-restarts 3)",
                    "no progress in 3 restarts in a row: no checkpoint in the agent's tier, and the ranks' steps show no resume point later than step 0 (--max-no-progress-restarts 3): not restarting again",
                ],
                reported: &[
                    "attempt/0 checkpoint.newest=none",
                    "attempt/0 resumed_from=0",
                    "attempt/1 checkpoint.newest=none",
                    "attempt/1 resumed_from=0",
                    "attempt/2 checkpoint.newest=none",
                    "attempt/2 resumed_from=0",
                    "attempt/3 checkpoint.newest=none",
                    "attempt/3 resumed_from=0",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "progress: a newer checkpoint between failures resets the count; the job is not stopped",
            limits: no_progress_limits(),
            steps: failing_attempts(
                vec![
                    // Its own checkpoints first (the ranks resume later),
                    // then the agent's tier.
                    progress(None, Some(0)),
                    progress(None, Some(5)),
                    progress(Some(10), Some(5)),
                    progress(Some(10), Some(10)),
                    progress(Some(10), Some(10)),
                    progress(Some(15), Some(10)),
                    progress(Some(15), Some(15)),
                    progress(Some(15), Some(15)),
                ],
                false,
            ),
            expect: End {
                restarts: 8,
                local_restarts: 8,
                says: &[
                    "progress since the last restart: no checkpoint in the agent's tier; the attempts resumed from step 0, then step 5",
                    "progress since the last restart: the newest complete checkpoint went from none to step 10",
                    "no progress: the newest complete checkpoint is still step 10 (1 of",
                    "(2 of --max-no-progress-restarts 3)",
                    "progress since the last restart: the newest complete checkpoint went from step 10 to step 15",
                    "(1 of --max-no-progress-restarts 3)",
                    "(2 of --max-no-progress-restarts 3)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no progress: an attempt the agent could not be asked about is not judged",
            limits: no_progress_limits(),
            steps: failing_attempts(
                vec![
                    progress(None, Some(0)),
                    progress(None, Some(0)),
                    progress(None, Some(0)),
                    Input::Progress(Progress {
                        note: "ListCheckpoints timed out; GetRanks timed out".into(),
                        ..Progress::default()
                    }),
                    progress(None, Some(0)),
                ],
                true,
            ),
            expect: End {
                code: Some(88),
                outcome: "no progress in 3 restarts in a row",
                job_failed: true,
                restarts: 4,
                local_restarts: 4,
                records: 5,
                ended: "restart refused (no progress)",
                says: &[
                    "(2 of --max-no-progress-restarts 3)",
                    "progress not judged (progress not observed: ListCheckpoints timed out; GetRanks timed out): 2 attempts in a row without progress so far",
                    "no progress in 3 restarts in a row",
                ],
                reported: &[
                    "attempt/0 checkpoint.newest=none",
                    "attempt/0 resumed_from=0",
                    "attempt/1 checkpoint.newest=none",
                    "attempt/1 resumed_from=0",
                    "attempt/2 checkpoint.newest=none",
                    "attempt/2 resumed_from=0",
                    "attempt/3 progress=unknown",
                    "attempt/4 checkpoint.newest=none",
                    "attempt/4 resumed_from=0",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "teardown: a rank aborts after its training, the other exits 0: success",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, abort(1, 0, 100, None), &[]),
                    // The agent's decision about the abort is held back.
                    (
                        1200,
                        decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                        &[],
                    ),
                    (1500, exit(1, 1, 101, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded (rank 0 failed in its teardown (signal 6 (SIGABRT)): SIGABRT with no Python traceback",
                records: 1,
                ended: "every other worker exited 0; a teardown failure",
                says: &[
                    "rank 0 (pid 100) failed after its training ended",
                    "inc-1 (restart_in_job): not acted on, the job's training had ended",
                    "every other worker exited 0: the job succeeded",
                ],
                aborted: &[0],
                ..End::default()
            },
        },
        Scenario {
            // CI at load 30: the other rank's interpreter took more than
            // the 5 s decision timeout to end after its training, and a
            // finished job was restarted.
            name: "teardown: the other rank takes 20 s to exit after its training: success, no restart",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, abort(1, 0, 100, None), &[]),
                    (
                        1200,
                        decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                        &[],
                    ),
                    // Past the decision timeout, within the teardown's.
                    (6000, Input::Deadline, &[]),
                    (21000, exit(1, 1, 101, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded (rank 0 failed in its teardown (signal 6 (SIGABRT)): SIGABRT with no Python traceback",
                records: 1,
                ended: "every other worker exited 0; a teardown failure",
                says: &[
                    "inc-1 (restart_in_job): not acted on, the job's training had ended",
                    "every other worker exited 0: the job succeeded",
                ],
                aborted: &[0],
                ..End::default()
            },
        },
        Scenario {
            name: "teardown: a client that deregistered exits 1 after the other exited 0: the training's code, no restart",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 1, 101, 0), &[]),
                    (1100, closed_then(1, 0, 100, Exit::Code(1)), &["finish 1"]),
                ],
            ),
            expect: End {
                code: Some(1),
                outcome: "failed: rank 0 exited 1 after its training ended, not restarted (rank 0 failed in its teardown (exit code 1): its client had deregistered cleanly",
                job_failed: true,
                records: 1,
                ended: "a teardown failure",
                says: &[
                    "every other worker exited 0: rank 0 exited 1 after its client closed, the training's result; not restarted",
                ],
                aborted: &[0],
                ..End::default()
            },
        },
        Scenario {
            name: "teardown: every rank aborts after a clean deregistration: success, no restart",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (50, Input::AllRegistered, &[]),
                    (1000, closed_then(1, 0, 100, Exit::Signal(6)), &[]),
                    // The agent's decision about the first abort is held back.
                    (
                        1100,
                        decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                        &[],
                    ),
                    (1150, closed_then(1, 1, 101, Exit::Signal(6)), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded (ranks 0,1 failed in their teardown: rank 0 (signal 6 (SIGABRT)): its client had deregistered cleanly",
                records: 1,
                ended: "every worker ended its training; 2 teardown failures",
                says: &[
                    "rank 0 (pid 100) failed after its training ended",
                    "rank 1 (pid 101) failed after its training ended",
                    "inc-1 (restart_in_job): not acted on, the job's training had ended",
                    "every worker ended its training: the job succeeded; ranks 0,1 failed in their teardown",
                ],
                aborted: &[0, 1],
                ..End::default()
            },
        },
        Scenario {
            name: "teardown: the higher rank aborts first: the report still lists the ranks in order",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (50, Input::AllRegistered, &[]),
                    (1000, closed_then(1, 1, 101, Exit::Signal(6)), &[]),
                    (1010, closed_then(1, 0, 100, Exit::Signal(6)), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded (ranks 0,1 failed in their teardown: rank 0 (signal 6 (SIGABRT)): its client had deregistered cleanly",
                records: 1,
                ended: "every worker ended its training; 2 teardown failures",
                says: &[
                    "every worker ended its training: the job succeeded; ranks 0,1 failed in their teardown: rank 0 (signal 6 (SIGABRT))",
                ],
                aborted: &[0, 1],
                ..End::default()
            },
        },
        Scenario {
            name: "teardown: half the ranks abort after a clean deregistration, the others exit 0: success",
            limits: RunLimits {
                nproc_per_node: 4,
                ..limits()
            },
            steps: with(
                first_attempt_of_four(),
                vec![
                    (1000, closed_then(1, 2, 102, Exit::Signal(6)), &[]),
                    (1010, exit(1, 0, 100, 0), &[]),
                    (1020, closed_then(1, 3, 103, Exit::Signal(6)), &[]),
                    (1030, exit(1, 1, 101, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded (ranks 2,3 failed in their teardown",
                records: 1,
                ended: "every other worker exited 0; 2 teardown failures",
                says: &[
                    "every other worker exited 0: the job succeeded; ranks 2,3 failed in their teardown",
                ],
                aborted: &[2, 3],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: one rank aborts after its training, another exits with a traceback: the held decision restarts",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, closed_then(1, 0, 100, Exit::Signal(6)), &[]),
                        (
                            1100,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &[],
                        ),
                        (
                            1200,
                            Input::WorkerExit(WorkerExit {
                                generation: 1,
                                rank: 1,
                                pid: 101,
                                exit: Some(Exit::Code(1)),
                                registered: true,
                                deregistered: false,
                                client: true,
                                traceback: Some("RuntimeError".into()),
                                healable: false,
                            }),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "rank 0 (pid 100) failed after its training ended",
                    "rank 0's failure is handled as a failure",
                    "restarting in job (restart 1)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: a rank whose client never deregistered aborts mid-training: a failure",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, aborted_training(1, 1, 101), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "rank 1 (pid 101) failed: signal 6 (SIGABRT); waiting for the agent's diagnosis",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: a rank aborts after its training while a peer is still training past the timeout: a failure",
            limits: short_teardown(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, closed_then(1, 0, 100, Exit::Signal(6)), &[]),
                        (3000, Input::Deadline, &[]),
                        (6001, Input::Deadline, &[]),
                        (
                            6100,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "rank 0's failure is handled as a failure: the other workers did not all end cleanly",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: an abort, then the other rank fails: the held decision restarts",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, abort(1, 0, 100, None), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &[],
                        ),
                        (
                            1300,
                            exit(1, 1, 101, 1),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "rank 0 (pid 100) failed after its training ended",
                    "rank 0's failure is handled as a failure",
                    "restarting in job (restart 1)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: an abort with a traceback is a failure like any other",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, abort(1, 0, 100, Some("RuntimeError")), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "rank 0 (pid 100) failed: signal 6 (SIGABRT); waiting for the agent's diagnosis",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "no teardown: the other rank outlives the teardown timeout",
            limits: short_teardown(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, abort(1, 0, 100, None), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &[],
                        ),
                        (3000, Input::Deadline, &[]),
                        (6000, Input::Deadline, &["publish restart", "stop SIGTERM"]),
                    ],
                ),
                with(
                    restart_path(7000, 1, 200),
                    vec![
                        (9000, exit(2, 0, 200, 0), &[]),
                        (9001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &["rank 0's failure is handled as a failure"],
                ..End::default()
            },
        },
        Scenario {
            name: "crash: restarted in job, then every worker exits 0",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (50, Input::AllRegistered, &[]),
                        (1000, exit(1, 1, 101, 1), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(1300, 1, 200),
                    vec![
                        (1400, Input::AllRegistered, &[]),
                        (5000, exit(2, 0, 200, 0), &[]),
                        (5001, exit(2, 1, 201, 0), &["finish 0"]),
                    ],
                ),
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded after 1 in-job restart",
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "every worker exited 0",
                says: &[
                    "attempt 0: all 2 workers registered with the agent (0.05s after start)",
                    "rank 1 (pid 101) failed: exit code 1; waiting for the agent's diagnosis",
                    "agent: inc-1 (crash): infra_transient 90%",
                    "restarting in job (restart 1): stopping the workers",
                    "attempt 1: workers started 0.31s after the failure",
                    "attempt 1: all 2 workers registered with the agent, 0.40s after the failure",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "user error: the agent stops the job with the rank's own status",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 0, 100, 3), &[]),
                    (1001, exit(1, 1, 101, 1), &[]),
                    (
                        1200,
                        decision("inc-1", 0, 1001, Action::Stop, 3),
                        &["finish 3"],
                    ),
                ],
            ),
            expect: End {
                code: Some(3),
                outcome: "stopped on the agent's diagnosis: infra_transient",
                job_failed: true,
                records: 1,
                ended: "rank 0 failed (exit code 3); stopped on inc-1's decision",
                says: &["rank 1 (pid 101) failed too: exit code 1"],
                ..End::default()
            },
        },
        Scenario {
            name: "repeat at the same step: restarted once, then the agent stops",
            limits: limits(),
            steps: with(
                with(
                    with(
                        first_attempt(),
                        vec![
                            (1000, exit(1, 0, 100, 1), &[]),
                            (
                                1100,
                                decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                                &["publish restart", "stop SIGTERM"],
                            ),
                        ],
                    ),
                    restart_path(1200, 1, 200),
                ),
                vec![
                    // The first incident's decision again (a replay after a
                    // reconnect): seen once.
                    (
                        1300,
                        decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                        &[],
                    ),
                    (3000, exit(2, 0, 200, 1), &[]),
                    (
                        3100,
                        decision("inc-2", 0, 3001, Action::Stop, 1),
                        &["finish 1"],
                    ),
                ],
            ),
            expect: End {
                code: Some(1),
                outcome: "stopped on the agent's diagnosis",
                job_failed: true,
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "rank 0 failed (exit code 1); stopped on inc-2's decision",
                ..End::default()
            },
        },
        Scenario {
            name: "budget spent: --max-restarts 1 refuses the second restart",
            limits: RunLimits {
                max_restarts: Some(1),
                ..limits()
            },
            steps: with(
                with(
                    with(
                        first_attempt(),
                        vec![
                            (1000, exit(1, 0, 100, 1), &[]),
                            (
                                1100,
                                decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                                &["publish restart", "stop SIGTERM"],
                            ),
                        ],
                    ),
                    restart_path(1200, 1, 200),
                ),
                vec![
                    (3000, exit(2, 0, 200, 1), &[]),
                    (
                        3100,
                        decision("inc-2", 0, 3001, Action::RestartInJob, 0),
                        &["finish 87"],
                    ),
                ],
            ),
            expect: End {
                code: Some(87),
                outcome: "failed: --max-restarts 1 spent",
                job_failed: true,
                restarts: 1,
                local_restarts: 1,
                records: 2,
                ended: "restart refused (--max-restarts 1)",
                says: &[
                    "restarting in job (restart 1 of at most 1): stopping the workers",
                    "--max-restarts 1 reached: not restarting again",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "budget spent: no decision, the launcher's own restarts run out",
            limits: RunLimits {
                fallback_budget: 1,
                ..limits()
            },
            steps: with(
                with(
                    with(
                        first_attempt(),
                        vec![
                            (1000, exit(1, 0, 100, 1), &[]),
                            // Not yet: the decision timeout is 5 s.
                            (1500, Input::Deadline, &[]),
                            (6000, Input::Deadline, &["publish restart", "stop SIGTERM"]),
                        ],
                    ),
                    restart_path(6100, 1, 200),
                ),
                vec![
                    (
                        7000,
                        Input::WorkerExit(WorkerExit {
                            generation: 2,
                            rank: 1,
                            pid: 201,
                            exit: Some(Exit::Signal(9)),
                            registered: false,
                            deregistered: false,
                            client: false,
                            traceback: None,
                            healable: false,
                        }),
                        &[],
                    ),
                    // Unregistered: 300 ms, not the decision timeout.
                    (7300, Input::Deadline, &["finish 87"]),
                ],
            ),
            expect: End {
                code: Some(87),
                outcome: "failed: 1 restart decided without the agent spent (the policy's unknown budget)",
                job_failed: true,
                restarts: 1,
                local_restarts: 1,
                fallback_used: 1,
                records: 2,
                ended: "rank 1 failed: signal 9",
                says: &[
                    "no decision from the agent within 5.0s for rank 0's failure (exit code 1): class unknown",
                    "it had not registered with the agent",
                    "before registering with the agent, which has nothing to diagnose",
                ],
                reported: &[],
                replacements: 0,
                aborted: &[],
            },
        },
        Scenario {
            name: "cordon: this node is at fault, the coordinator's status (86)",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 0, 100, 1), &[]),
                    (
                        1100,
                        decision("inc-1", 0, 1001, Action::Cordon, 0),
                        &["leave"],
                    ),
                    (1150, Input::NodeFault { exit_code: 86 }, &["finish 86"]),
                ],
            ),
            expect: End {
                code: Some(86),
                outcome: "this node is at fault (cordon): the failure of inc-1; run the job elsewhere",
                records: 1,
                ended: "cordon on inc-1's decision",
                ..End::default()
            },
        },
        Scenario {
            name: "spare: a standby host waits without workers until a round gives it a place",
            limits: across_hosts(),
            steps: vec![
                (0, Input::Begin, &["rendezvous 0"]),
                (1, Input::Agreed(standby(0)), &["start 0"]),
                (2, started(standby(0), 0, 2), &[]),
                (
                    5000,
                    Input::Round(Remote::NewRound {
                        reason: "host b lost".into(),
                        keeps_place: false,
                    }),
                    &["gate"],
                ),
                (
                    5010,
                    Input::Gated(GateVerdict::Pass),
                    &["reap", "rendezvous 0"],
                ),
                (5020, Input::Agreed(plan(0)), &["start 0"]),
                (5030, started(plan(0), 300, 5030), &[]),
                (9000, exit(2, 0, 300, 0), &[]),
                (9001, exit(2, 1, 301, 0), &["finish 0"]),
            ],
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "new round across hosts: host b lost",
                    "waiting for the job's next round",
                    "attempt 0: workers started 0.03s after the new round",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "another host swapped for a spare: the workers heal into the round, not restarted",
            limits: across_hosts(),
            steps: with(
                first_attempt_in_round(),
                vec![
                    (3000, swapped_round(), &["rendezvous 0"]),
                    (
                        3010,
                        Input::Agreed(round_plan(0, 2)),
                        &["heal into round 2"],
                    ),
                    (3020, Input::RoundHealed(None), &[]),
                    (9000, exit(1, 0, 100, 0), &[]),
                    (9001, exit(1, 1, 101, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "this host keeps its place: healing its workers into the round in process",
                    "healed into round 2 in 0.02s",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a hang across hosts with healable workers heals into a new round; not healable: restarted in job",
            limits: across_hosts(),
            steps: with(
                with(
                    first_attempt_in_round(),
                    vec![
                        // The survivors of a lost host hang in a collective:
                        // the agent's decision comes before the lease's end.
                        (
                            3000,
                            hang_decision("inc-h", 0, 2990, true),
                            &["publish heal round", "rendezvous 0"],
                        ),
                        (
                            3010,
                            Input::Agreed(round_plan(0, 2)),
                            &["heal into round 2"],
                        ),
                        (3020, Input::RoundHealed(None), &[]),
                        // The lost host's lease ran out: its place to the spare.
                        (9000, swapped_round(), &["rendezvous 0"]),
                        (
                            9010,
                            Input::Agreed(round_plan(0, 3)),
                            &["heal into round 3"],
                        ),
                        (9020, Input::RoundHealed(None), &[]),
                        // The first incident's revision, after the heals:
                        // about ranks restarted since, not acted on.
                        (9500, hang_decision("inc-h", 1, 2990, true), &[]),
                        // A hang whose workers did not all declare: restarted in job.
                        (
                            12000,
                            hang_decision("inc-n", 0, 11990, false),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(12100, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "inc-h: a hang across hosts, and every worker here can be healed: a new round for the job's hosts, this host's workers healed into it in process",
                    "healed into round 2 in 0.02s",
                    "healed into round 3 in 0.02s",
                    "inc-h: not acted on: the hung ranks were healed since it opened",
                    "restarting in job (restart 1)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "another host's hang heal round keeps this host's place: healed into it, this host's own hang decision not acted on",
            limits: across_hosts(),
            steps: with(
                first_attempt_in_round(),
                vec![
                    // host-a judged the hang first and heals into a round
                    // of the same hosts: etcd's round says so, so this
                    // host keeps its place (etcd.rs's keeps_place; the
                    // flag itself is tested there and in tests/coord.rs,
                    // the machine's side here).
                    (
                        3000,
                        hang_heal_round(),
                        &["rendezvous 0"],
                    ),
                    (
                        3010,
                        Input::Agreed(round_plan(0, 2)),
                        &["heal into round 2"],
                    ),
                    (3020, Input::RoundHealed(None), &[]),
                    // This host's agent judged the same hang meanwhile.
                    (3100, hang_decision("inc-c", 0, 2950, true), &[]),
                ],
            ),
            expect: End {
                says: &[
                    "this host keeps its place: healing its workers into the round in process",
                    "healed into round 2 in 0.02s",
                    "inc-c: not acted on: the hung ranks were healed since it opened",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a hang across hosts whose round store no launcher hosts (c10d): restarted in job, healable or not",
            limits: RunLimits {
                round_store_hosted: false,
                ..across_hosts()
            },
            steps: with(
                first_attempt_in_round(),
                vec![(
                    3000,
                    hang_decision("inc-c", 0, 2990, true),
                    &["publish restart", "stop SIGTERM"],
                )],
            )
            .into_iter()
            .chain(restart_path(3100, 1, 200))
            .collect(),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &["restarting in job (restart 1)"],
                ..End::default()
            },
        },
        Scenario {
            name: "a swap round whose plan moved this host, or whose heal failed, restarts into it",
            limits: across_hosts(),
            steps: with(
                with(
                    first_attempt_in_round(),
                    vec![
                        (3000, swapped_round(), &["rendezvous 0"]),
                        (
                            3010,
                            Input::Agreed(AttemptPlan {
                                node_rank: Some(1),
                                rank_offset: 2,
                                ..round_plan(0, 2)
                            }),
                            &["stop SIGTERM"],
                        ),
                    ],
                ),
                with(
                    restart_path(3100, 1, 200),
                    vec![
                        (5000, swapped_round(), &["rendezvous 1"]),
                        (5010, Input::Agreed(plan(1)), &["heal into round 0"]),
                        (
                            5020,
                            Input::RoundHealed(Some("the agent refused".into())),
                            &["stop SIGTERM"],
                        ),
                    ],
                ),
            )
            .into_iter()
            .chain(restart_path(5100, 2, 300))
            .collect(),
            expect: End {
                restarts: 2,
                says: &[
                    "the round agreed does not keep this host's place after all: restarting the workers into it",
                    "healing into it failed (the agent refused): restarting the workers into it",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a heal into a round that finds a later restart of the same hosts agreed instead restarts into it",
            limits: across_hosts(),
            steps: with(
                first_attempt_in_round(),
                vec![
                    // host-a's heal round, seen here as keeping the place.
                    (
                        3000,
                        hang_heal_round(),
                        &["rendezvous 0"],
                    ),
                    // Before this host's rendezvous read it, host-b's own
                    // restart of the same hosts (no heal) made round 3,
                    // and that is the round agreed: the adapter judges it
                    // (the plan's keeps_place), so the workers restart
                    // into it with the other hosts'.
                    (
                        3010,
                        Input::Agreed(AttemptPlan {
                            keeps_place: false,
                            ..round_plan(0, 3)
                        }),
                        &["stop SIGTERM"],
                    ),
                ],
            )
            .into_iter()
            .chain(restart_path(3100, 1, 200))
            .collect(),
            expect: End {
                restarts: 1,
                says: &[
                    "the round agreed does not keep this host's place after all: restarting the workers into it",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a swap round while a worker's failure waits, or on one host: restarted as before",
            limits: across_hosts(),
            steps: with(
                first_attempt_in_round(),
                vec![
                    (2000, exit(1, 1, 101, 1), &[]),
                    (3000, swapped_round(), &["stop SIGTERM"]),
                ],
            )
            .into_iter()
            .chain(restart_path(3100, 1, 200))
            .collect(),
            expect: End {
                restarts: 1,
                says: &["new round across hosts: round 2: host b lost"],
                ..End::default()
            },
        },
        Scenario {
            name: "scale down and up: two rounds other hosts caused, not counted",
            limits: RunLimits {
                max_restarts: Some(0),
                ..across_hosts()
            },
            steps: with(
                with(
                    with(
                        first_attempt(),
                        vec![(
                            2000,
                            Input::Round(Remote::NewRound {
                                reason: "host c cordoned".into(),
                                keeps_place: false,
                            }),
                            &["stop SIGTERM"],
                        )],
                    ),
                    restart_path(2100, 1, 200),
                ),
                with(
                    vec![(
                        4000,
                        Input::Round(Remote::NewRound {
                            reason: "host c back".into(),
                            keeps_place: false,
                        }),
                        &["stop SIGTERM"],
                    )],
                    with(
                        restart_path(4100, 2, 300),
                        vec![(
                            6000,
                            Input::Round(Remote::Stop {
                                exit_code: 1,
                                reason: "the job failed on host d".into(),
                            }),
                            &["finish 1"],
                        )],
                    ),
                ),
            ),
            expect: End {
                code: Some(1),
                outcome: "stopped across hosts: the job failed on host d",
                restarts: 2,
                records: 3,
                ended: "stopped across hosts",
                says: &[
                    "stopping the workers for the new round",
                    "attempt 1: workers started 0.11s after the new round",
                    "stopping the workers for the new round",
                    "stopping: the job failed on host d",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "in-process escalation: live ranks left alone, then the escalation restarts in job",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (
                            1000,
                            decision("hang-1", 0, 1000, Action::RestartInProcess, 0),
                            &[],
                        ),
                        (
                            1500,
                            decision("hang-1", 1, 1000, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1600, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "the agent restarts the ranks in process; the launcher leaves the workers running",
                    "restarting in job (restart 1): stopping the workers",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "in-process on a dead worker: the launcher restarts in job at once",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, exit(1, 1, 101, 1), &[]),
                        (
                            1100,
                            decision("inc-1", 0, 1001, Action::RestartInProcess, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1200, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "rank 1's process is gone (exit code 1): an in-process restart cannot bring it back; : restarting in job",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a frozen rank replaced alone: its peers keep their processes, no restart counted",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (
                        1000,
                        decision("hang-1", 0, 1000, Action::RestartInProcess, 0),
                        &[],
                    ),
                    // The agent found rank 1 stopped: replace it.
                    (
                        1300,
                        replace("hang-1", 1, 1000, &[1], 1),
                        &["replace 1/101 in restart 1"],
                    ),
                    (1500, replaced(&[(1, 300)], None), &[]),
                    // The killed process's exit is no failure.
                    (1510, killed(1, 1, 101, 9), &[]),
                    // The same revision again (a feed replayed): once.
                    (1520, replace("hang-1", 1, 1000, &[1], 1), &[]),
                    (9000, exit(1, 0, 100, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                replacements: 1,
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "the agent restarts the ranks in process; the launcher leaves the workers running",
                    "hang-1: replacing rank 1 (pid 101) in restart 1: rank 1 stopped (SIGSTOP or a tracer); the other ranks restart in process",
                    "hang-1: replaced in 0.20s: rank 1 pid 300",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a healable rank killed by a signal is healed at once; the crash's decision is not acted on",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    // The agent's diagnosis of the same crash, later.
                    (
                        1250,
                        decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                        &[],
                    ),
                    (9000, exit(1, 0, 100, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "rank 1 (pid 101) signal 9 (SIGKILL): healing it from a live replica; the other ranks restart in process",
                    "heal started in 0.10s: rank 1 pid 300 started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                    "inc-1: not acted on: the crash was healed and every worker runs",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "across hosts, a healable rank killed in a round whose store the launcher hosts is healed at once",
            limits: across_hosts(),
            steps: with(
                first_attempt_in_round(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    // The agent's diagnosis of the same crash, later: no
                    // restart published, the other hosts are not stopped.
                    (
                        1250,
                        decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                        &[],
                    ),
                    (9000, exit(1, 0, 100, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "rank 1 (pid 101) signal 9 (SIGKILL): healing it from a live replica; the other ranks restart in process",
                    "heal started in 0.10s: rank 1 pid 300 started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                    "inc-1: not acted on: the crash was healed and every worker runs",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "across hosts, a host's only rank killed is healed: its replicas are on the other hosts",
            limits: across_hosts(),
            steps: with(
                vec![
                    (0, Input::Begin, &["rendezvous 0"]),
                    (1, Input::Agreed(one_rank_a_host(0, 1)), &["start 0"]),
                    (2, one_worker_started(one_rank_a_host(0, 1), 100, 2), &[]),
                ],
                vec![
                    (1000, killed_healable(1, 0, 100, 9), &["heal 0/100"]),
                    (1100, replaced(&[(0, 300)], None), &[]),
                    (
                        1250,
                        decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                        &[],
                    ),
                    (9000, exit(1, 0, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "rank 0 (pid 100) signal 9 (SIGKILL): healing it from a live replica; the other ranks restart in process",
                    "heal started in 0.10s: rank 0 pid 300 started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                    "inc-1: not acted on: the crash was healed and every worker runs",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "on one host, its only rank killed is not healed: no replica lives anywhere",
            limits: limits(),
            steps: with(
                with(
                    vec![
                        (0, Input::Begin, &["rendezvous 0"]),
                        (1, Input::Agreed(plan(0)), &["start 0"]),
                        (2, one_worker_started(plan(0), 100, 2), &[]),
                    ],
                    vec![
                        (1000, killed_healable(1, 0, 100, 9), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1300, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &["rank 0 (pid 100) failed: signal 9 (SIGKILL); waiting for the agent's diagnosis"],
                ..End::default()
            },
        },
        Scenario {
            name: "across hosts, a round whose store a worker hosts (not the launcher) restarts every host in job, as before",
            limits: RunLimits {
                round_store_hosted: false,
                ..across_hosts()
            },
            steps: with(
                with(
                    first_attempt_in_round(),
                    vec![
                        (1000, killed_healable(1, 1, 101, 9), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1300, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "rank 1 (pid 101) failed: signal 9 (SIGKILL); waiting for the agent's diagnosis",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "across hosts, a heal the agent refuses restarts every host from the checkpoint",
            limits: across_hosts(),
            steps: with(
                with(
                    first_attempt_in_round(),
                    vec![
                        (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                        (
                            1100,
                            replaced(
                                &[],
                                Some("the agent refused the in-process restart: no live rank"),
                            ),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1300, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "healing rank 1 failed (the agent refused the in-process restart: no live rank): the job restarts from its checkpoint",
                    "attempt 1: workers started",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a survivor that left blocked in a collective (exit 75) during a heal is healed in turn",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (2100, healable(exit(1, 0, 100, 75)), &["heal 0/100"]),
                    (2200, replaced(&[(0, 301)], None), &[]),
                    (9000, exit(1, 0, 301, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "rank 1 (pid 101) signal 9 (SIGKILL): healing it from a live replica; the other ranks restart in process",
                    "rank 0 (pid 100) exit code 75: healing it from a live replica; the other ranks restart in process",
                    "heal started in 0.10s: rank 0 pid 301 started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                ],
                ..End::default()
            },
        },
        Scenario {
            // Recorded: stop 43's CI run of tests/torch_heal.rs's two faults
            // in a row, with four ranks: the first kill's two ring
            // neighbours left blocked; the second kill came seconds later.
            name: "survivors that left blocked during a heal spend no heal of the budget: a second fault within the window heals too",
            limits: limits(),
            steps: with(
                first_attempt_of_four(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (2000, healable(exit(1, 2, 102, 75)), &["heal 2/102"]),
                    (2100, replaced(&[(2, 301)], None), &[]),
                    (2200, healable(exit(1, 0, 100, 75)), &["heal 0/100"]),
                    (2300, replaced(&[(0, 302)], None), &[]),
                    (5000, killed_healable(1, 2, 301, 9), &["heal 2/301"]),
                    (5100, replaced(&[(2, 303)], None), &[]),
                    (9000, exit(1, 0, 302, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &[]),
                    (9002, exit(1, 2, 303, 0), &[]),
                    (9003, exit(1, 3, 103, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "rank 0 (pid 100) exit code 75: healing it from a live replica; the other ranks restart in process",
                    "rank 2 (pid 301) signal 9 (SIGKILL): healing it from a live replica; the other ranks restart in process",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "survivors leaving blocked are healed at most once per worker within the heal window",
            limits: limits(),
            steps: with(
                first_attempt_of_four(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (1200, healable(exit(1, 0, 100, 75)), &["heal 0/100"]),
                    (1300, replaced(&[(0, 301)], None), &[]),
                    (1400, healable(exit(1, 2, 102, 75)), &["heal 2/102"]),
                    (1500, replaced(&[(2, 302)], None), &[]),
                    (1600, healable(exit(1, 3, 103, 75)), &["heal 3/103"]),
                    (1700, replaced(&[(3, 303)], None), &[]),
                    (1800, healable(exit(1, 1, 300, 75)), &["heal 1/300"]),
                    (1900, replaced(&[(1, 304)], None), &[]),
                    (2000, healable(exit(1, 0, 301, 75)), &[]),
                ],
            ),
            expect: End {
                records: 0,
                ..End::default()
            },
        },
        Scenario {
            name: "a fourth crash by a signal within the heal window waits for the agent's decision",
            limits: limits(),
            steps: with(
                first_attempt_of_four(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (2000, killed_healable(1, 2, 102, 9), &["heal 2/102"]),
                    (2100, replaced(&[(2, 301)], None), &[]),
                    (3000, killed_healable(1, 1, 300, 9), &["heal 1/300"]),
                    (3100, replaced(&[(1, 302)], None), &[]),
                    (4000, killed_healable(1, 1, 302, 9), &[]),
                ],
            ),
            expect: End {
                records: 0,
                ..End::default()
            },
        },
        Scenario {
            name: "a healed crash whose decision is the spent budget's stop does not stop a job that heals",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (
                        1250,
                        decision(
                            "inc-3",
                            0,
                            1000,
                            Action::Stop,
                            crate::exit::EXIT_BUDGET_SPENT,
                        ),
                        &[],
                    ),
                    (9000, exit(1, 0, 100, 0), &[]),
                    (9001, exit(1, 1, 300, 0), &["finish 0"]),
                ],
            ),
            expect: End {
                code: Some(0),
                outcome: "succeeded",
                records: 1,
                ended: "every worker exited 0",
                says: &[
                    "heal started in 0.10s: rank 1 pid 300 started; it takes its state from a live replica where one holds it, else every rank restores from the checkpoint (the ranks say which)",
                    "inc-3: not acted on: the crash was healed and every worker runs (the budget its heals spent stops no job that heals)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a healed crash whose decision stops the job for the code's fault still stops it",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (
                        1250,
                        decision("inc-3", 0, 1000, Action::Stop, 3),
                        &["finish 3"],
                    ),
                ],
            ),
            expect: End {
                code: Some(3),
                outcome: "stopped",
                job_failed: true,
                records: 1,
                ended: "stopped on inc-3's decision",
                says: &[],
                ..End::default()
            },
        },
        Scenario {
            name: "a worker not healable waits for the decision, which restarts in job, as before",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, killed(1, 1, 101, 9), &[]),
                        (
                            1200,
                            decision("inc-1", 0, 1000, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1300, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "rank 1 (pid 101) failed: signal 9 (SIGKILL); waiting for the agent's diagnosis",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a heal the agent refuses restarts the job from its checkpoint",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                        (
                            1100,
                            replaced(
                                &[],
                                Some("the agent refused the in-process restart: no live rank"),
                            ),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1300, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "healing rank 1 failed (the agent refused the in-process restart: no live rank): the job restarts from its checkpoint",
                    "attempt 1: workers started",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "more than MAX_HEALS heals within the window: the next failure waits for the decision",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, killed_healable(1, 1, 101, 9), &["heal 1/101"]),
                    (1100, replaced(&[(1, 300)], None), &[]),
                    (2000, killed_healable(1, 1, 300, 9), &["heal 1/300"]),
                    (2100, replaced(&[(1, 301)], None), &[]),
                    (3000, killed_healable(1, 1, 301, 9), &["heal 1/301"]),
                    (3100, replaced(&[(1, 302)], None), &[]),
                    (4000, killed_healable(1, 1, 302, 9), &[]),
                ],
            ),
            expect: End {
                says: &[
                    "rank 1 (pid 302) failed: signal 9 (SIGKILL); waiting for the agent's diagnosis",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a replacement that fails restarts the job in job",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (
                            1000,
                            decision("hang-1", 0, 1000, Action::RestartInProcess, 0),
                            &[],
                        ),
                        (
                            1300,
                            replace("hang-1", 1, 1000, &[1], 1),
                            &["replace 1/101 in restart 1"],
                        ),
                        (
                            1400,
                            replaced(&[], Some("rank 1: no such file")),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(1600, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &[
                    "replacing rank 1 failed (rank 1: no such file); rank 1 stopped (SIGSTOP or a tracer): restarting in job",
                    "attempt 1: workers started",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a replacement without a restart count, or of ranks not here, is refused",
            limits: limits(),
            steps: with(
                with(
                    first_attempt(),
                    vec![
                        (
                            1000,
                            decision("hang-1", 0, 1000, Action::RestartInProcess, 0),
                            &[],
                        ),
                        (1300, replace("hang-1", 1, 1000, &[1], 0), &[]),
                        (1400, replace("hang-1", 2, 1000, &[7, 9, 7], 1), &[]),
                        // Rank 0 here and rank 7 elsewhere: rank 0 alone.
                        (
                            1500,
                            replace("hang-1", 3, 1000, &[7, 0], 1),
                            &["replace 0/100 in restart 1"],
                        ),
                        (1600, replaced(&[(0, 400)], None), &[]),
                        // The escalation at the agent's timeout is still followed.
                        (
                            30_000,
                            decision("hang-1", 4, 1000, Action::RestartInJob, 0),
                            &["publish restart", "stop SIGTERM"],
                        ),
                    ],
                ),
                restart_path(30_100, 1, 200),
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                replacements: 1,
                says: &[
                    "hang-1: a replacement of ranks 1 without a restart count: refused",
                    "hang-1: ranks 7,9 are not running here: not replaced by this launcher",
                    "hang-1: rank 7 is not running here",
                    "hang-1: replacing rank 0 (pid 100)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "signals: the first stops gracefully, the second kills",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, Input::Signal(SIGINT), &["stop SIGINT"]),
                    (1100, Input::Signal(SIGINT), &["kill"]),
                    (1200, stopped(), &["finish 130"]),
                    (1300, Input::Signal(SIGTERM), &["kill"]),
                ],
            ),
            expect: End {
                code: Some(130),
                outcome: "stopped on SIGINT",
                records: 1,
                ended: "stopped on SIGINT",
                says: &[
                    "got SIGINT: forwarding it to the workers and stopping them (grace 10s; send it again to kill at once)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "notice: SIGTERM with --term-grace tells the workers, who save and leave with 85; the job exits 85",
            limits: RunLimits {
                term_grace: Duration::from_secs(30),
                ..limits()
            },
            steps: with(
                first_attempt(),
                vec![
                    (1000, Input::Signal(SIGTERM), &["notice"]),
                    // A decision meanwhile is not acted on: the job leaves.
                    (
                        1100,
                        decision("inc-1", 0, 1050, Action::RestartInJob, 0),
                        &[],
                    ),
                    (1200, exit(1, 0, 100, 85), &[]),
                    (1300, exit(1, 1, 101, 85), &["finish 85"]),
                ],
            ),
            expect: End {
                code: Some(85),
                outcome: "preempted: every worker saved on the notice and left; requeue the job",
                records: 1,
                ended: "left on a notice",
                says: &[
                    "got SIGTERM: a notice, --term-grace 30s: the workers save at their next step boundary and leave; those left after 19s are stopped; exit 85 (preempted: requeue)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "notice from another host (etcd): the workers save at the step it published and leave; the job exits 85",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (
                        1000,
                        Input::Round(Remote::Notice {
                            step: 137,
                            deadline: None,
                            reason: "host h1 got a notice (got SIGTERM)".into(),
                        }),
                        &["notice at step 137"],
                    ),
                    // The hosts that leave make a new round: not acted on.
                    (
                        1100,
                        Input::Round(Remote::NewRound {
                            reason: "round 2: h1 left".into(),
                            keeps_place: false,
                        }),
                        &[],
                    ),
                    (1200, exit(1, 0, 100, 85), &[]),
                    (1300, exit(1, 1, 101, 85), &["finish 85"]),
                ],
            ),
            expect: End {
                code: Some(85),
                outcome: "preempted: every worker saved on the notice and left; requeue the job",
                records: 1,
                ended: "left on a notice",
                says: &[
                    "host h1 got a notice (got SIGTERM): every rank of the job saves at step 137: the workers save at their next step boundary and leave; those left after 19s are stopped; exit 85 (preempted: requeue)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "notice from the host's agent (its notice.raised): the job stops on it before any worker left, asking the agent for its step; exit 85",
            limits: across_hosts(),
            steps: with(
                first_attempt(),
                vec![
                    (
                        1000,
                        Input::HostNotice {
                            reason: "notice from gce: instance/preempted = TRUE".into(),
                            step: 151,
                            deadline: None,
                        },
                        &["notice"],
                    ),
                    // Another host's notice meanwhile (it noticed too):
                    // the executor already adopted the first published.
                    (
                        1100,
                        Input::Round(Remote::Notice {
                            step: 151,
                            deadline: None,
                            reason: "host h1 got a notice".into(),
                        }),
                        &[],
                    ),
                    (1200, exit(1, 0, 100, 85), &[]),
                    (1300, exit(1, 1, 101, 85), &["finish 85"]),
                ],
            ),
            expect: End {
                code: Some(85),
                outcome: "preempted: every worker saved on the notice and left; requeue the job",
                records: 1,
                ended: "left on a notice",
                says: &[
                    "notice from gce: instance/preempted = TRUE: the agent told the ranks here to save at step 151: the workers save at their next step boundary and leave; those left after 19s are stopped; exit 85 (preempted: requeue)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "a host between rounds meets a notice another host published meanwhile: no workers start, exit 85, the job not failed",
            limits: across_hosts(),
            steps: vec![
                (0, Input::Begin, &["rendezvous 0"]),
                (
                    500,
                    Input::NoRound {
                        exit_code: 85,
                        message: "host h1 got a notice (got SIGTERM) in round 3 while this host was between rounds".into(),
                        error: "coordination: host h1 got a notice".into(),
                    },
                    &["finish 85"],
                ),
            ],
            expect: End {
                code: Some(85),
                outcome: "preempted: host h1 got a notice (got SIGTERM) in round 3 while this host was between rounds; requeue the job",
                records: 1,
                ended: "not started",
                says: &["while this host was between rounds: exit 85 (preempted: requeue)"],
                ..End::default()
            },
        },
        Scenario {
            name: "notice from the host: a worker leaves with 85, the others get the default window, those left are stopped; exit 85",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 0, 100, 85), &["notice"]),
                    // The window (30 s) less the stop grace (10 s) and 1 s.
                    (19_999, Input::Deadline, &[]),
                    (20_000, Input::Deadline, &["stop SIGTERM"]),
                    (20_500, stopped(), &["finish 85"]),
                ],
            ),
            expect: End {
                code: Some(85),
                outcome: "stopped on a notice (preempted)",
                records: 1,
                ended: "stopped on a notice (preempted)",
                says: &[
                    "rank 0 (pid 100) saved on a notice and left (exit 85): the workers save at their next step boundary",
                    "the notice's window is over: stopping rank 1 (they did not leave)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "notice: a worker that crashes instead of saving is named; the job still exits 85 (requeue)",
            limits: RunLimits {
                term_grace: Duration::from_secs(30),
                ..limits()
            },
            steps: with(
                first_attempt(),
                vec![
                    (1000, Input::Signal(SIGTERM), &["notice"]),
                    (1200, exit(1, 0, 100, 85), &[]),
                    (1300, exit(1, 1, 101, 3), &["finish 85"]),
                ],
            ),
            expect: End {
                code: Some(85),
                outcome: "preempted: the workers left on the notice (not every one after a save)",
                records: 1,
                ended: "rank 1 failed (exit code 3); left on a notice",
                says: &["rank 1 left during the notice with exit code 3, not after a save on it"],
                ..End::default()
            },
        },
        Scenario {
            name: "without --term-grace a SIGTERM is forwarded as before (143)",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, Input::Signal(SIGTERM), &["stop SIGTERM"]),
                    (1200, stopped(), &["finish 143"]),
                ],
            ),
            expect: End {
                code: Some(143),
                outcome: "stopped on SIGTERM",
                records: 1,
                ended: "stopped on SIGTERM",
                ..End::default()
            },
        },
        Scenario {
            name: "another user owns the job at the agent now: the workers stop, exit 89",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (
                        1000,
                        Input::Disowned("job \"j\" on this agent belongs to uid 1001".into()),
                        &["stop SIGTERM"],
                    ),
                    (1200, stopped(), &["finish 89"]),
                ],
            ),
            expect: End {
                code: Some(89),
                outcome: "stopped on the loss of the job's claim at the agent",
                records: 1,
                ended: "stopped on the loss of the job's claim at the agent",
                says: &[
                    "the agent no longer takes this launcher's calls about the job: job \"j\" on this agent belongs to uid 1001; stopping the workers (exit 89)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "signal during the backoff: the job ends, the workers already stopped",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 0, 100, 1), &[]),
                    (
                        1100,
                        backoff(
                            decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                            Duration::from_secs(30),
                        ),
                        &["publish restart", "stop SIGTERM"],
                    ),
                    (1200, stopped(), &["gate"]),
                    (
                        1300,
                        Input::Gated(GateVerdict::Unchecked("no agent".into())),
                        &[],
                    ),
                    (2000, Input::Deadline, &[]),
                    (3000, Input::Signal(SIGTERM), &["finish 143"]),
                ],
            ),
            expect: End {
                code: Some(143),
                outcome: "stopped on SIGTERM",
                local_restarts: 1,
                records: 1,
                ended: "stopped on SIGTERM during the backoff",
                says: &[
                    "health gate not checked: no agent",
                    "backing off 30s before the restart (policy)",
                ],
                ..End::default()
            },
        },
        Scenario {
            name: "health gate refused: this node leaves the job",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 0, 100, 1), &[]),
                    (
                        1100,
                        decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                        &["publish restart", "stop SIGTERM"],
                    ),
                    (1200, stopped(), &["gate"]),
                    (
                        1300,
                        Input::Gated(GateVerdict::Refused("GPU 0 FAILED".into())),
                        &["leave"],
                    ),
                    (1400, Input::NodeFault { exit_code: 86 }, &["finish 86"]),
                ],
            ),
            expect: End {
                code: Some(86),
                outcome: "this node is at fault (health gate: GPU 0 FAILED)",
                local_restarts: 1,
                records: 1,
                ended: "restart refused by the health gate",
                says: &["pre-restart health gate refused: GPU 0 FAILED"],
                ..End::default()
            },
        },
        Scenario {
            name: "continue: a failure the agent lets stand fails the job when the others finish",
            limits: limits(),
            steps: with(
                first_attempt(),
                vec![
                    (1000, exit(1, 1, 101, 2), &[]),
                    (1100, decision("inc-1", 0, 1001, Action::Continue, 0), &[]),
                    // An exit of an earlier generation is not this attempt's.
                    (1200, exit(0, 0, 100, 0), &[]),
                    (2000, exit(1, 0, 100, 0), &["finish 2"]),
                ],
            ),
            expect: End {
                code: Some(2),
                outcome: "failed (a failure the agent let stand)",
                job_failed: true,
                records: 1,
                ended: "rank 1 failed (exit code 2); the other workers finished",
                ..End::default()
            },
        },
        Scenario {
            name: "stale and old decisions: about a stopped attempt, or before this launcher",
            limits: limits(),
            steps: with(
                with(
                    with(
                        first_attempt(),
                        vec![
                            (1000, exit(1, 0, 100, 1), &[]),
                            (
                                1100,
                                decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                                &["publish restart", "stop SIGTERM"],
                            ),
                        ],
                    ),
                    restart_path(1200, 1, 200),
                ),
                vec![
                    // Another incident of the stopped attempt: already done.
                    (
                        1500,
                        decision("inc-0", 0, 1002, Action::RestartInJob, 0),
                        &[],
                    ),
                    // One from an earlier run of the job: not printed.
                    (
                        1600,
                        Input::FeedDecision(Box::new(FeedDecision {
                            opened: SystemTime::UNIX_EPOCH,
                            ..match decision("old", 0, 0, Action::Stop, 1) {
                                Input::FeedDecision(d) => *d,
                                _ => unreachable!(),
                            }
                        })),
                        &[],
                    ),
                ],
            ),
            expect: End {
                restarts: 1,
                local_restarts: 1,
                says: &["[about an earlier attempt: already handled]"],
                ..End::default()
            },
        },
        Scenario {
            name: "rendezvous lost: the hosts could not agree on the first attempt",
            limits: across_hosts(),
            steps: vec![
                (0, Input::Begin, &["rendezvous 0"]),
                (
                    30_000,
                    Input::NoRound {
                        exit_code: 1,
                        message: "no round within 30s".into(),
                        error: "coordination: no round within 30s".into(),
                    },
                    &["finish 1"],
                ),
            ],
            expect: End {
                code: Some(1),
                outcome: "failed: coordination: no round within 30s",
                job_failed: true,
                records: 1,
                ended: "not started",
                says: &["the hosts could not agree on the next attempt"],
                ..End::default()
            },
        },
        Scenario {
            name: "a signal while waiting for the round",
            limits: across_hosts(),
            steps: vec![
                (0, Input::Begin, &["rendezvous 0"]),
                (100, Input::Signal(SIGTERM), &["finish 143"]),
            ],
            expect: End {
                code: Some(143),
                outcome: "stopped on SIGTERM",
                records: 1,
                ended: "stopped on SIGTERM waiting for the job's round",
                ..End::default()
            },
        },
    ]
}

#[test]
fn recorded_scenarios_replay() {
    for s in scenarios() {
        let mut state = JobState::new(s.limits.clone(), at(0));
        let mut says = Vec::new();
        let mut finish = None;
        for (i, (t, input, want)) in s.steps.into_iter().enumerate() {
            let commands = state.step(input, at(t));
            let got: Vec<String> = commands.iter().filter_map(short).collect();
            assert_eq!(got, want, "{}: step {i} (t={t} ms)", s.name);
            for c in commands {
                match c {
                    Command::Say(text) => says.push(text),
                    Command::Finish(f) => finish = Some(f),
                    _ => {}
                }
            }
        }
        let e = &s.expect;
        let mut from = 0;
        for want in e.says {
            let found = says[from..].iter().position(|l| l.contains(want));
            assert!(
                found.is_some(),
                "{}: no console line with {want:?} after line {from} in {says:#?}",
                s.name
            );
            from += found.unwrap_or(0) + 1;
        }
        assert_eq!(state.restarts, e.restarts, "{}: restarts", s.name);
        assert_eq!(
            state.local_restarts, e.local_restarts,
            "{}: local restarts",
            s.name
        );
        assert_eq!(state.fallback_used, e.fallback_used, "{}: fallback", s.name);
        assert_eq!(
            state.replacements, e.replacements,
            "{}: replacements",
            s.name
        );
        match (e.code, finish) {
            (None, None) => assert_eq!(state.listen(), Listen::Everything, "{}", s.name),
            (Some(code), Some(f)) => {
                assert_eq!(f.code, code, "{}: exit status", s.name);
                assert!(
                    f.outcome.contains(e.outcome),
                    "{}: outcome {:?}",
                    s.name,
                    f.outcome
                );
                assert_eq!(f.job_failed, e.job_failed, "{}: job failed", s.name);
                let reported: Vec<String> = f
                    .report
                    .iter()
                    .flat_map(|r| &r.evidence)
                    .map(|e| format!("{} {}={}", e.subject, e.signal, e.value))
                    .collect();
                assert_eq!(reported, e.reported, "{}: the stop reported", s.name);
                if let Some(r) = &f.report {
                    assert_eq!(r.exit_code, code, "{}", s.name);
                    assert_eq!(r.limit, "--max-no-progress-restarts 3", "{}", s.name);
                    assert!(f.outcome.contains(&r.summary), "{}", s.name);
                    assert!(r.incident.is_some(), "{}", s.name);
                }
                let records = state.records(at(100_000));
                assert_eq!(records.len(), e.records, "{}: records", s.name);
                let last = records.last().map(|r| r.ended.as_str()).unwrap_or("");
                assert!(last.contains(e.ended), "{}: ended {last:?}", s.name);
                let aborted: Vec<u32> = records
                    .last()
                    .map(|r| r.aborted_at_exit.iter().map(|x| x.rank).collect())
                    .unwrap_or_default();
                assert_eq!(aborted, e.aborted, "{}: aborted at exit", s.name);
            }
            (want, got) => panic!("{}: finish {want:?}, got {got:?}", s.name),
        }
    }
}

#[test]
fn a_restart_records_its_timing() {
    let mut state = JobState::new(limits(), at(0));
    let steps = with(
        with(
            first_attempt(),
            vec![
                (1000, exit(1, 0, 100, 1), &[]),
                (
                    1200,
                    decision("inc-1", 0, 1001, Action::RestartInJob, 0),
                    &[],
                ),
            ],
        ),
        restart_path(1500, 1, 200),
    );
    for (t, input, _) in steps {
        state.step(input, at(t));
    }
    state.step(Input::AllRegistered, at(2000));
    let r = state.history[0].restart.clone().unwrap_or_default();
    assert_eq!(r.decision_ms, 200.0);
    assert_eq!(r.stop_ms, 300.0);
    assert_eq!(r.gate_ms, 10.0);
    assert_eq!(r.backoff_ms, 0.0);
    assert_eq!(r.spawn_ms, 512.0);
    assert_eq!(r.registered_ms, Some(1000.0));
    assert_eq!(
        state.history[0].ended,
        "rank 0 failed (exit code 1); restarted in job"
    );
    assert_eq!(state.deadline(), None);
}
