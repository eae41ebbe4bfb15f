//! Heal from a live replica (issue 31) with real PyTorch (gloo on CPU): the
//! real `warden run` with 4 ranks of examples/heal/ddp.py (plain DDP, Adam,
//! dropout, data seeded by step and rank; a checkpoint every 40 steps).
//!
//! A fault-free run gives the reference digests (sha256 of every parameter
//! and optimizer tensor, per rank). Then, each in its own run, ranks are
//! SIGKILLed from outside at a step between two checkpoints:
//! 1. one rank;
//! 2. two faults in a row (a second rank once every rank stepped again);
//! 3. a fault during the heal: a survivor killed as soon as the launcher
//!    says it heals the first;
//! 4. one rank while the others wait for it in their all-reduce (it is a
//!    straggler): the survivor opposite it in gloo's ring stays blocked in
//!    a collective no abort wakes (gloo's `abort()` is a no-op on a waiting
//!    op in torch 2.15): `warden.heal` shuts down the connections of its
//!    attempt's group so that it takes the restart in its own process, or,
//!    still blocked, it leaves by itself (exit 75) to be healed in turn.
//!    Before that exit existed, this case hung the job for gloo's whole
//!    timeout in about 1 run in 5 of test 1.
//! 5. HSDP (examples/heal/hsdp.py: FSDP2 over a 2 x 2 mesh ("replicate",
//!    "shard")): rank 1 killed; its replacement takes shard 1 from rank 3,
//!    the same shard position in the other replica group, with its own
//!    fault-free reference (the digest of every tensor gathered whole).
//!
//! 6. a fault during the heal that no exit shows: rank 1 killed, its
//!    replacement frozen (SIGSTOP) as it starts; found by
//!    `hang.heal_timeout` (8 s here), replaced in turn, healed again.
//!
//! Each run must: exit 0; end with every rank's digest equal to the
//! fault-free run's; keep the survivors' processes (one pid per rank that
//! was not killed, or that did not leave blocked, which it says); log no (rank, step) more than twice (at most the step
//! in flight is redone); heal (the replacement says it took its state from
//! a live rank) and never restart in job or restore a checkpoint; book at
//! most 3 steps a rank and fault as lost progress in the launcher's goodput
//! ledger (a checkpoint restart here redoes about 15). The time
//! from each kill to every rank logging a new step is printed
//! (docs/benchmarks.md), not asserted: tests do not assert speed.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it);
//! skips, saying so, only when torch is missing and `WARDEN_REQUIRE_TORCH`
//! is unset (tests/run-all.sh sets it, so CI never skips).

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::heal_log::{
    self, Entry, assert_no_step_logged_more_than_twice, digests, pids_and_counts, read_log, show,
    step_gap_p90, unix_now,
};
use common::{Streaming, WARDEN, python, repo_root, torch_available};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A whole run: eight interpreters (four ranks, four standbys) importing
/// torch at once on a loaded 2-core machine, then the training.
const RUN: Duration = Duration::from_secs(400);
const STEPS: u32 = 120;
const CKPT_EVERY: u32 = 40;
const WORLD: u32 = 4;
/// The standby interpreters a faulted run keeps (`--standbys`): two, for
/// the tests that lose two ranks at once; a standby for each of the four
/// would cost two more torch imports a run, on two cores, for nothing.
const STANDBYS: u32 = 2;

/// One run at a time: each is eight interpreters on two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// The examples the runs take (paths from the repository's root).
const DDP: &str = "examples/heal/ddp.py";
const HSDP: &str = "examples/heal/hsdp.py";

/// The launcher (its lines and the workers' on one stream) running the
/// example with its log at `log`. The job id is made unique to this run:
/// the checkpoint tier is the host's, keyed by job id, and a first attempt
/// restores what an earlier job of the same id saved.
fn launch(dir: &Path, job: &str, log: &Path) -> Streaming {
    launch_with(dir, DDP, job, log, &[])
}

/// [`launch`] of `example` with more of its variables.
fn launch_with(
    dir: &Path,
    example: &str,
    job: &str,
    log: &Path,
    vars: &[(&str, &str)],
) -> Streaming {
    launch_full(dir, example, job, log, vars, None, STANDBYS)
}

/// [`launch_with`], the embedded agent configured by `agent_config` (and
/// its tier in `dir`), keeping `standbys` standby interpreters (0: none).
fn launch_full(
    dir: &Path,
    example: &str,
    job: &str,
    log: &Path,
    vars: &[(&str, &str)],
    agent_config: Option<&Path>,
    standbys: u32,
) -> Streaming {
    let tag = dir.file_name().unwrap().to_string_lossy().replace('.', "-");
    let job = format!("{job}-{tag}");
    let job = job.as_str();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
        .arg("--socket")
        .arg(dir.join("no-agent-here.sock"))
        .arg("run")
        .args(["--nproc-per-node", &WORLD.to_string(), "--rdzv-id", job])
        .args(["--standbys", &standbys.to_string()])
        .arg("--log-dir")
        .arg(dir.join("logs"));
    let config = dir.join(format!("{job}.agent.toml"));
    let mut toml = agent_config
        .map(|c| std::fs::read_to_string(c).unwrap())
        .unwrap_or_default();
    toml.push_str(&common::tier_in(dir));
    std::fs::write(&config, toml).unwrap();
    cmd.arg("--agent-config").arg(&config);
    cmd.arg("--")
        .arg(python())
        .arg(repo_root().join(example))
        .env("EXAMPLE_LOG", log)
        .env("EXAMPLE_STEPS", STEPS.to_string())
        .env("EXAMPLE_CKPT_EVERY", CKPT_EVERY.to_string())
        .env("EXAMPLE_STEP_MS", "30")
        // A folder per run: a FileStore left by an earlier run of the same
        // scratch (the reference's) holds that run's addresses, and a rank
        // that read them met nobody (connection refused at the first
        // attempt of the HSDP run, whose first group is made before the
        // declaration's gc.freeze and so never destroyed).
        .env("WARDEN_HEAL_STORE_DIR", dir.join(format!("stores-{job}")))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("WARDEN_SOCKET")
        .envs(vars.iter().copied())
        .current_dir(dir);
    Streaming::spawn(&mut cmd, dir.join(format!("{job}.stderr")))
}

/// Polls the log until `rank` logged a step >= `step`; its pid.
fn wait_step(log: &Path, rank: u32, step: u32, job: &mut Streaming) -> i32 {
    heal_log::wait_step(log, rank, step, &mut [job], RUN)
}

/// Polls the log until every rank logged a step after `t`.
fn wait_all_stepping(log: &Path, t: f64, job: &mut Streaming) {
    let deadline = Instant::now() + RUN;
    loop {
        let ranks: BTreeSet<u32> = read_log(log)
            .into_iter()
            .filter_map(|e| match e {
                Entry::Step { t: at, rank, .. } if at > t => Some(rank),
                _ => None,
            })
            .collect();
        if ranks.len() == WORLD as usize {
            return;
        }
        if Instant::now() >= deadline || matches!(job.child.try_wait(), Ok(Some(_))) {
            panic!(
                "not every rank stepped again within {RUN:?} (ranks {ranks:?})\n{}",
                show(job)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn sigkill(pid: i32) -> f64 {
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the rank");
    unix_now()
}

/// The fault-free run's digests of `example`, made once per example.
fn reference(scratch: &Path, example: &'static str) -> &'static BTreeMap<u32, String> {
    static DDP_REF: OnceLock<BTreeMap<u32, String>> = OnceLock::new();
    static HSDP_REF: OnceLock<BTreeMap<u32, String>> = OnceLock::new();
    let cell = if example == HSDP { &HSDP_REF } else { &DDP_REF };
    cell.get_or_init(|| {
        let log = scratch.join("fault-free.log");
        // No standbys: nothing fails in this run, so they would only
        // import torch beside its workers.
        let mut job = launch_full(scratch, example, "heal-ref", &log, &[], None, 0);
        let status = job.wait_exit(RUN);
        assert!(
            status.success(),
            "fault-free run: {status}\n{}",
            show(&mut job)
        );
        let d = digests(&read_log(&log));
        assert_eq!(d.len(), WORLD as usize, "{}", show(&mut job));
        assert!(
            d.values().all(|x| x == &d[&0] && x.len() == 64),
            "fault-free digests differ: {d:?}"
        );
        d
    })
}

/// What every faulted run of examples/heal/ddp.py must show. `killed`:
/// (pid, time of the kill).
fn check(job: &mut Streaming, log: &Path, killed: &[(i32, f64)], heals: usize) {
    check_of(DDP, job, log, killed, heals);
}

/// [`check`] of a run of `example`; returns everything it said.
fn check_of(
    example: &'static str,
    job: &mut Streaming,
    log: &Path,
    killed: &[(i32, f64)],
    heals: usize,
) -> String {
    // Everything the launcher and the workers said, read to the end.
    let status = job.wait_exit(RUN);
    let all = show(job);
    assert!(status.success(), "exit: {status}\n{all}");
    let entries = read_log(log);
    let want = reference(log.parent().unwrap(), example);
    assert_eq!(
        &digests(&entries),
        want,
        "digests against the fault-free run\n{all}"
    );

    // Killed from outside, or left blocked in a collective (said on stderr:
    // "warden.heal: rank R (pid P): the restart request ... leaving").
    let mut dead: BTreeSet<i32> = killed.iter().map(|k| k.0).collect();
    dead.extend(left_blocked(&all));
    let (pids, times) = pids_and_counts(&entries);
    for (rank, p) in &pids {
        let want = 1 + p.intersection(&dead).count();
        assert!(
            p.len() == want,
            "rank {rank}: {} processes {p:?}, want {want} (its first, and one more per kill or exit 75 of \
             {dead:?})\nwhat the launcher and warden.heal said:\n{}\n\neverything:\n{all}",
            p.len(),
            said_by_warden(&all)
        );
    }
    assert_no_step_logged_more_than_twice(&times, &all);
    let healed = all.matches("healed from rank").count();
    assert!(
        healed >= heals,
        "{healed} replacements healed, want {heals}\n{all}"
    );
    for never in ["restarting in job", "restored from the checkpoint"] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    // The ledger books the redone work as lost progress: at most the step
    // in flight per rank and fault (a checkpoint restart here redoes about
    // 15 steps on each of the 4 ranks); 3 steps of margin for step times
    // on a loaded machine.
    let ledger = goodput_of(log.parent().unwrap());
    let lost = ledger["parts"]["lost_progress"]["accelerator_s"]
        .as_f64()
        .unwrap();
    // A step as long as the run's steps were (its 90th percentile): on a
    // loaded machine the step in flight at the kill runs long, past the
    // ledger's median.
    let step_s = ledger["recovery"]["step_s"]
        .as_f64()
        .unwrap()
        .max(step_gap_p90(&entries));
    let faults = killed.len() + left_blocked(&all).len();
    let bound = 3.0 * step_s * f64::from(WORLD) * faults as f64;
    assert!(
        lost <= bound,
        "lost progress {lost:.3} accelerator-s, more than {bound:.3} ({faults} faults, {WORLD} ranks, 3 steps of {step_s:.3} s)\n{all}"
    );
    eprintln!(
        "lost progress booked: {lost:.3} accelerator-s ({:.1} steps of {step_s:.3} s over {WORLD} ranks, {faults} faults)",
        lost / step_s
    );
    // The heals' story, for a run watched with --nocapture.
    eprintln!("{}", said_by_warden(&all));
    for &(pid, t) in killed {
        let back = (0..WORLD)
            .map(|rank| {
                entries
                    .iter()
                    .find_map(|e| match e {
                        Entry::Step { t: at, rank: r, .. } if *r == rank && *at > t => Some(at - t),
                        _ => None,
                    })
                    .unwrap_or_else(|| {
                        panic!("rank {rank} never stepped after the kill of {pid}\n{all}")
                    })
            })
            .fold(0.0, f64::max);
        eprintln!(
            "SIGKILL of pid {pid} -> every rank stepping again: {back:.3} s (4 ranks, gloo, {example})"
        );
    }
    all
}

/// The launcher's goodput ledger of the faulted run in `scratch` (not the
/// fault-free reference's).
fn goodput_of(scratch: &Path) -> serde_json::Value {
    let logs = scratch.join("logs");
    let found = std::fs::read_dir(&logs)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with("heal-ref"))
        .map(|e| e.path().join("goodput.json"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no goodput.json under {}", logs.display()));
    serde_json::from_str(&std::fs::read_to_string(&found).unwrap()).unwrap()
}

/// The launcher's lines and the workers' `warden.heal` ones: the story of
/// the heals in a few dozen lines, put first in a failure's message (CI
/// keeps only the head and the tail of a failed test's output).
fn said_by_warden(all: &str) -> String {
    all.lines()
        .filter(|l| {
            l.starts_with("[warden]") || l.contains("warden.heal:") || l.contains("warden:")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The pids of the ranks that left blocked in a collective, as they said.
fn left_blocked(all: &str) -> Vec<i32> {
    all.lines()
        .filter(|l| l.contains("leaving with exit 75"))
        .filter_map(|l| {
            let at = l.find("(pid ")? + 5;
            let rest = &l[at..];
            rest[..rest.find(')')?].parse().ok()
        })
        .collect()
}

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("warden-heal-")
        .tempdir()
        .unwrap()
}

/// One faulted run's frame: None without torch; else this run's turn (one
/// at a time), its scratch directory with the fault-free reference made
/// (once per binary), and its example log `NAME.log`.
fn prepare(
    name: &str,
) -> Option<(
    std::sync::MutexGuard<'static, ()>,
    tempfile::TempDir,
    std::path::PathBuf,
)> {
    prepare_of(DDP, name)
}

/// [`prepare`] for a run of `example`.
fn prepare_of(
    example: &'static str,
    name: &str,
) -> Option<(
    std::sync::MutexGuard<'static, ()>,
    tempfile::TempDir,
    std::path::PathBuf,
)> {
    if !torch_available() {
        return None;
    }
    let one = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = scratch();
    reference(dir.path(), example);
    let log = dir.path().join(format!("{name}.log"));
    Some((one, dir, log))
}

#[test]
fn a_rank_killed_between_checkpoints_heals_from_a_live_replica() {
    let Some((_one, dir, log)) = prepare("one") else {
        return;
    };
    let mut job = launch(dir.path(), "heal-one", &log);
    let pid = wait_step(&log, 1, 55, &mut job);
    let t = sigkill(pid);
    check(&mut job, &log, &[(pid, t)], 1);
}

#[test]
fn two_faults_in_a_row_heal_twice() {
    let Some((_one, dir, log)) = prepare("two") else {
        return;
    };
    let mut job = launch(dir.path(), "heal-two", &log);
    let first = wait_step(&log, 1, 45, &mut job);
    let t1 = sigkill(first);
    wait_all_stepping(&log, t1, &mut job);
    let second = wait_step(&log, 2, 65, &mut job);
    let t2 = sigkill(second);
    check(&mut job, &log, &[(first, t1), (second, t2)], 2);
}

#[test]
fn a_fault_during_the_heal_heals_again() {
    let Some((_one, dir, log)) = prepare("during") else {
        return;
    };
    let mut job = launch(dir.path(), "heal-during", &log);
    let first = wait_step(&log, 1, 55, &mut job);
    let survivor = wait_step(&log, 2, 55, &mut job);
    let t1 = sigkill(first);
    job.wait_line(RUN, "the heal", |l| {
        l.contains("healing it from a live replica")
    });
    let t2 = sigkill(survivor);
    check(&mut job, &log, &[(first, t1), (survivor, t2)], 1);
    // The pool of two gave two warm starts: rank 1's from its own slot,
    // and the next replacement's (rank 2, with no slot of its own in a pool
    // of two, from slot 0's; or rank 0, had it left blocked in gloo's ring
    // with rank 1 and been healed first, from its own).
    job.drain(Duration::from_secs(5));
    let warm = |rank: u32| {
        job.seen
            .iter()
            .any(|l| l.contains(&format!("rank {rank}: warm start from standby")))
    };
    let warm_ranks: Vec<u32> = (0..WORLD).filter(|r| warm(*r)).collect();
    assert!(
        warm(1) && warm_ranks.len() >= 2,
        "warm starts of ranks {warm_ranks:?}, not rank 1's and another's\n{}",
        show(&mut job)
    );
}

#[test]
fn a_survivor_blocked_in_a_collective_leaves_and_is_healed() {
    let Some((_one, dir, log)) = prepare("blocked") else {
        return;
    };
    // Rank 1 takes 250 ms more a step: the others wait for it inside their
    // all-reduce most of the time, so its kill lands in their collective.
    let mut job = launch_with(
        dir.path(),
        DDP,
        "heal-blocked",
        &log,
        &[("EXAMPLE_SLOW_RANK", "1"), ("EXAMPLE_SLOW_MS", "250")],
    );
    let pid = wait_step(&log, 1, 50, &mut job);
    // Into the next step's all-reduce: the others logged this step too.
    for rank in [0, 2, 3] {
        wait_step(&log, rank, 50, &mut job);
    }
    let t = sigkill(pid);
    check(&mut job, &log, &[(pid, t)], 1);
}

/// A fault during the heal that no exit shows: rank 1 is killed, and its
/// replacement is frozen (SIGSTOP) as soon as the launcher starts it. The
/// survivors wait for it in the heal; the agent judges that wait by
/// `hang.heal_timeout` (8 s here), finds the replacement stopped, and has
/// its launcher replace it in turn; the job heals again. A survivor that
/// was blocked in gloo's ring with the killed rank meanwhile leaves (exit
/// 75) and is healed too: the new replacement counts as declared (it runs
/// the script its predecessor declared with), and the agent's diagnosis of
/// that exit does not ask a second restart on top of the launcher's heal
/// (before both, 2 runs in 5 restarted the job from its checkpoint, and
/// the first try at the launcher's half alone hung the job).
#[test]
fn a_replacement_frozen_during_the_heal_is_replaced_and_the_job_heals() {
    let Some((_one, dir, log)) = prepare("frozen") else {
        return;
    };
    let config = dir.path().join("agent.toml");
    std::fs::write(&config, "[hang]\nheal_timeout = \"8s\"\n").unwrap();
    let mut job = launch_full(
        dir.path(),
        DDP,
        "heal-frozen",
        &log,
        &[],
        Some(&config),
        STANDBYS,
    );
    let first = wait_step(&log, 1, 55, &mut job);
    let t = sigkill(first);
    let line = job.wait_line(RUN, "the replacement started", |l| {
        l.contains("rank 1: started again as pid")
    });
    let replacement: i32 = line
        .split("as pid ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"));
    kill(Pid::from_raw(replacement), Signal::SIGSTOP).expect("SIGSTOP the replacement");
    let all = check_of(DDP, &mut job, &log, &[(first, t)], 1);
    assert!(
        all.matches("rank 1: started again as pid").count() >= 2,
        "the frozen replacement was replaced in turn\n{all}"
    );
}

/// HSDP (examples/heal/hsdp.py): FSDP2 over a 2 x 2 mesh ("replicate",
/// "shard"); rank 1 holds shard 1 of replica group 0, and rank 3 is the
/// only other holder of that shard. Rank 1 is SIGKILLed between two
/// checkpoints; its replacement must take its shards from rank 3 (the plan
/// follows from the DTensors' mesh), with the checks of every DDP run
/// (exit 0, the fault-free run's digests, survivors' pids, no step logged
/// more than twice, no checkpoint restore).
#[test]
fn hsdp_a_rank_killed_heals_from_the_same_shard_of_another_replica_group() {
    let Some((_one, dir, log)) = prepare_of(HSDP, "hsdp-one") else {
        return;
    };
    let mut job = launch_with(dir.path(), HSDP, "heal-hsdp", &log, &[]);
    let pid = wait_step(&log, 1, 55, &mut job);
    let t = sigkill(pid);
    let all = check_of(HSDP, &mut job, &log, &[(pid, t)], 1);
    assert!(
        all.contains("rank 1: healed from rank 3 at step"),
        "rank 1 takes shard 1 from rank 3, its peer in the other replica group\n{all}"
    );
}

/// HSDP, two faults in a row: rank 1 (shard 1 of replica group 0) at step
/// 45, then, once every rank stepped again, rank 2 (shard 0 of group 1) at
/// step 65; each heals from the other group's holder of its shard.
#[test]
fn hsdp_two_faults_in_a_row_heal_twice() {
    let Some((_one, dir, log)) = prepare_of(HSDP, "hsdp-two") else {
        return;
    };
    let mut job = launch_with(dir.path(), HSDP, "heal-hsdp-two", &log, &[]);
    let first = wait_step(&log, 1, 45, &mut job);
    let t1 = sigkill(first);
    wait_all_stepping(&log, t1, &mut job);
    let second = wait_step(&log, 2, 65, &mut job);
    let t2 = sigkill(second);
    let all = check_of(HSDP, &mut job, &log, &[(first, t1), (second, t2)], 2);
    for said in [
        "rank 1: healed from rank 3 at step",
        "rank 2: healed from rank 0 at step",
    ] {
        assert!(all.contains(said), "{said:?}\n{all}");
    }
}

/// HSDP, a fault during the heal: rank 1 killed, then rank 2 as soon as the
/// launcher says it heals rank 1. Each lost shard position still has a
/// holder in the other replica group (ranks 3 and 0).
#[test]
fn hsdp_a_fault_during_the_heal_heals_again() {
    let Some((_one, dir, log)) = prepare_of(HSDP, "hsdp-during") else {
        return;
    };
    let mut job = launch_with(dir.path(), HSDP, "heal-hsdp-during", &log, &[]);
    let first = wait_step(&log, 1, 55, &mut job);
    let survivor = wait_step(&log, 2, 55, &mut job);
    let t1 = sigkill(first);
    job.wait_line(RUN, "the heal", |l| {
        l.contains("healing it from a live replica")
    });
    let t2 = sigkill(survivor);
    check_of(HSDP, &mut job, &log, &[(first, t1), (survivor, t2)], 1);
}

/// HSDP with no live replica of a shard: both holders of shard 1 (rank 1
/// in replica group 0, rank 3 in group 1) killed at once between two
/// checkpoints. No rank can send that shard, so the job falls back to the
/// newest checkpoint every rank has, says so, and still ends with the
/// fault-free run's digests (issue 31: "where no replica holds a lost
/// rank's state, the job falls back to today's path ... and says so").
#[test]
fn hsdp_a_shard_with_no_live_replica_restores_from_the_checkpoint_and_says_so() {
    let Some((_one, dir, log)) = prepare_of(HSDP, "hsdp-lost") else {
        return;
    };
    let mut job = launch_with(dir.path(), HSDP, "heal-hsdp-lost", &log, &[]);
    let a = wait_step(&log, 1, 55, &mut job);
    let b = wait_step(&log, 3, 55, &mut job);
    sigkill(a);
    sigkill(b);
    let status = job.wait_exit(RUN);
    let all = show(&mut job);
    assert!(status.success(), "exit: {status}\n{all}");
    let entries = read_log(&log);
    assert_eq!(
        &digests(&entries),
        reference(dir.path(), HSDP),
        "digests against the fault-free run\n{all}"
    );
    for said in [
        "no live replica holds",
        "restored from the checkpoint at step",
    ] {
        assert!(all.contains(said), "{said:?}\n{all}");
    }
}
