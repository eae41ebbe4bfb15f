//! A rank's own fault inside a multi-host round heals, with nothing rolled
//! back (issue 31): real etcd, two real `warden run` launchers on this
//! machine as hosts (host-a 127.0.0.2, host-b 127.0.0.3), each with its own
//! embedded agent, two ranks per host of examples/heal/ddp.py (plain DDP on
//! gloo, Adam, dropout, data seeded by step and rank): world 4, every rank a
//! data-parallel replica of the others.
//!
//! A fault-free run gives the reference digests. Then rank 3 (host-b's
//! second) is SIGKILLed at a step between two checkpoints; host-b's launcher
//! and agent live. Node rank 0's launcher (host-a) hosts the round's store
//! (`round_store`), so:
//! - host-b's launcher heals the rank as on one host ("healing it from a
//!   live replica"): its agent restarts rank 2 in process, and rank 3 starts
//!   again from its standby;
//! - the replacement takes its attempt number from the round's store (the
//!   survivors' next: "joins attempt N of round E"), not from host-b's
//!   agent's restart count;
//! - host-a's ranks, which only saw a lost peer and which nothing asks,
//!   see that attempt begun on the round's store and join it without a
//!   request ("joining the peers' next attempt");
//! - rank 3 receives model, optimizer and step from a live rank ("healed
//!   from rank"), no host restarts in job, nothing is read back from a
//!   checkpoint;
//! - both launchers exit 0, every digest equals the fault-free run's, ranks
//!   0, 1 and 2 (on both hosts) keep their processes, and no rank logs a
//!   step number more than twice.
//!
//! The time from the kill to every rank logging a new step is printed
//! (docs/benchmarks.md), beside the same fault where the workers declare no
//! healable state (`EXAMPLE_HEAL=0`): today's path, every host restarting
//! in job from the checkpoint. Tests do not assert speed.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` and etcd; skips, saying so, only
//! when torch is missing and `WARDEN_REQUIRE_TORCH` is unset.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::heal_host::{Host, Launch};
use common::heal_log::{
    assert_no_step_logged_more_than_twice, back_after, digests, pids_and_counts, read_log, redone,
    show, unix_now, wait_step,
};
use common::{Streaming, torch_available};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A whole run on a loaded 2-core machine: eight interpreters (four ranks,
/// four standbys) and the round's store importing torch on two hosts, then
/// the training.
const RUN: Duration = Duration::from_secs(480);
const STEPS: u32 = 150;
const CKPT_EVERY: u32 = 50;
/// The step of the killed rank after which it is killed (between the
/// checkpoints at 50 and 100).
const KILL_AT: u32 = 70;
/// The rank killed: host-b's second (node rank 1, local rank 1).
const LOST: u32 = 3;
const NPROC: u32 = 2;
const WORLD: u32 = 4;
/// Every launcher's lease (as tests/multihost.rs: margin for a loaded
/// machine's keep-alives).
const TTL: &str = "3s";

/// One run at a time: each is nine torch interpreters on two cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `warden run` of the example as host `h` (its lines and its workers' on
/// one stream), keeping `standbys` standby interpreters (`--standbys`;
/// None: the default, one per local worker).
fn launch(
    h: &Host,
    etcd: &EtcdServer,
    job: &str,
    log: &Path,
    heal: bool,
    standbys: Option<u32>,
) -> Streaming {
    h.launch(&Launch {
        etcd,
        job,
        log,
        nproc: NPROC,
        nnodes: 2,
        spare: false,
        heal,
        ttl: TTL,
        steps: STEPS,
        ckpt_every: CKPT_EVERY,
        example: "ddp.py",
        preload: None,
        standbys,
    })
}

struct Hosts {
    a: Host,
    b: Host,
}

fn hosts() -> Hosts {
    Hosts {
        a: Host::new("host-a", "127.0.0.2", "warden-mhheal-"),
        b: Host::new("host-b", "127.0.0.3", "warden-mhheal-"),
    }
}

/// Starts host-a, then host-b once host-a joined (so host-a is node rank 0,
/// whose launcher hosts the round's store): ranks 0-1 on host-a, 2-3 on
/// host-b.
fn start_both(
    h: &Hosts,
    etcd: &EtcdServer,
    job: &str,
    log: &Path,
    heal: bool,
) -> (Streaming, Streaming) {
    start_both_keeping(h, etcd, job, log, heal, None)
}

/// [`start_both`] keeping `standbys` standby interpreters a host.
fn start_both_keeping(
    h: &Hosts,
    etcd: &EtcdServer,
    job: &str,
    log: &Path,
    heal: bool,
    standbys: Option<u32>,
) -> (Streaming, Streaming) {
    let mut a = launch(&h.a, etcd, job, log, heal, standbys);
    a.wait_line(RUN, "host-a's join", |l| {
        l.contains("joined as host host-a")
    });
    let b = launch(&h.b, etcd, job, log, heal, standbys);
    (a, b)
}

/// The fault-free run's digests, made once per test binary (on an etcd of
/// its own).
fn reference() -> &'static BTreeMap<u32, String> {
    static REF: std::sync::OnceLock<BTreeMap<u32, String>> = std::sync::OnceLock::new();
    REF.get_or_init(|| {
        let etcd = EtcdServer::start();
        let scratch = tempfile::Builder::new()
            .prefix("warden-mhheal-")
            .tempdir()
            .unwrap();
        let h = hosts();
        let log = scratch.path().join("fault-free.log");
        // No standbys: nothing fails in this run.
        let (mut a, mut b) = start_both_keeping(&h, &etcd, "mhheal-ref", &log, true, Some(0));
        for j in [&mut a, &mut b] {
            let status = j.wait_exit(RUN);
            assert!(status.success(), "fault-free run: {status}\n{}", show(j));
        }
        let d = digests(&read_log(&log));
        assert_eq!(
            d.len(),
            WORLD as usize,
            "{}\n{}",
            show(&mut a),
            show(&mut b)
        );
        assert!(
            d.values().all(|x| x == &d[&0] && x.len() == 64),
            "fault-free digests differ: {d:?}"
        );
        d
    })
}

/// What one run with rank [`LOST`] killed left: the log, the kill's time,
/// the killed pid, both launchers (exited 0, their output read).
struct Lost {
    log: PathBuf,
    t: f64,
    pid: i32,
    a: Streaming,
    b: Streaming,
}

impl Lost {
    fn all(&self) -> String {
        format!(
            "--- host-a ---\n{}\n--- host-b ---\n{}",
            self.a.seen.join("\n"),
            self.b.seen.join("\n")
        )
    }
}

/// Rank [`LOST`] SIGKILLed once it logged [`KILL_AT`]; both launchers must
/// exit 0.
fn lose_rank(etcd: &EtcdServer, scratch: &Path, job: &str, heal: bool) -> Lost {
    let h = hosts();
    let log = scratch.join(format!("{job}.log"));
    let (mut a, mut b) = start_both(&h, etcd, job, &log, heal);
    b.wait_line(RUN, "host-b's place", |l| l.contains("host-b: node rank 1"));
    let pid = wait_step(&log, LOST, KILL_AT, &mut [&mut a, &mut b], RUN);
    let t = unix_now();
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the rank");
    wait_both(&mut a, &mut b);
    // The hosts' scratch directories go with `h`; everything needed is read.
    a.drain(Duration::from_secs(5));
    b.drain(Duration::from_secs(5));
    Lost { log, t, pid, a, b }
}

/// Waits for both launchers to exit 0; at the deadline or on a failure,
/// fails with everything both said (each reads its stream to the end).
fn wait_both(a: &mut Streaming, b: &mut Streaming) {
    let deadline = Instant::now() + RUN;
    let mut done = [None, None];
    while done.iter().any(Option::is_none) {
        for (i, j) in [&mut *a, &mut *b].into_iter().enumerate() {
            if done[i].is_none() {
                done[i] = j.child.try_wait().expect("poll the launcher");
            }
        }
        let failed = done.iter().flatten().any(|s| !s.success());
        if failed || Instant::now() >= deadline {
            for j in [&mut *a, &mut *b] {
                if matches!(j.child.try_wait(), Ok(None)) {
                    let _ = j.child.kill();
                    let _ = j.child.wait();
                }
            }
            panic!(
                "launchers: {done:?} (None: still running after {RUN:?})\n--- host-a ---\n{}\n--- host-b ---\n{}",
                show(a),
                show(b)
            );
        }
        // Both streams read meanwhile, so neither launcher blocks on a
        // full pipe.
        a.drain(Duration::from_millis(50));
        b.drain(Duration::from_millis(50));
    }
}

fn prepare() -> Option<(MutexGuard<'static, ()>, tempfile::TempDir, EtcdServer)> {
    if !torch_available() {
        return None;
    }
    let one = serial();
    let dir = tempfile::Builder::new()
        .prefix("warden-mhheal-")
        .tempdir()
        .unwrap();
    Some((one, dir, EtcdServer::start()))
}

#[test]
fn a_rank_killed_on_the_second_host_heals_in_the_round_and_every_survivor_keeps_its_process() {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let want = reference();
    let run = lose_rank(&etcd, dir.path(), "mhheal-one", true);
    let all = run.all();
    let entries = read_log(&run.log);
    assert_eq!(
        &digests(&entries),
        want,
        "digests against the fault-free run\n{all}"
    );
    let (pids, times) = pids_and_counts(&entries);
    for survivor in (0..WORLD).filter(|r| *r != LOST) {
        assert_eq!(
            pids[&survivor].len(),
            1,
            "rank {survivor} kept its process: {pids:?}\n{all}"
        );
    }
    assert!(
        pids[&LOST].len() == 2 && pids[&LOST].contains(&run.pid),
        "rank {LOST}: the killed process, then its replacement: {pids:?}\n{all}"
    );
    assert_no_step_logged_more_than_twice(&times, &all);
    let heal = format!(
        "rank {LOST} (pid {}) signal 9 (SIGKILL): healing it from a live replica",
        run.pid
    );
    assert!(
        run.b.seen.iter().any(|l| l.contains(&heal)),
        "host-b's launcher healed its rank\n{all}"
    );
    assert!(
        run.b
            .seen
            .iter()
            .any(|l| l.contains(&format!("rank {LOST}: joins attempt"))),
        "the replacement joined its peers' next attempt, from the round's store\n{all}"
    );
    assert!(
        run.b
            .seen
            .iter()
            .any(|l| l.contains(&format!("rank {LOST}: healed from rank"))),
        "the replacement took its state from a live rank\n{all}"
    );
    let joined = run
        .a
        .seen
        .iter()
        .filter(|l| l.contains("joining the peers' next attempt"))
        .count();
    assert_eq!(
        joined, NPROC as usize,
        "host-a's ranks joined the next attempt with no request\n{all}"
    );
    for never in [
        "restarting the workers",
        "stopping the workers",
        "restored from the checkpoint",
        "waiting for the agent's diagnosis",
        "leaving with exit 75",
    ] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    let back = back_after(&entries, run.t, WORLD, &all);
    let warm = run
        .b
        .seen
        .iter()
        .any(|l| l.contains(&format!("rank {LOST}: warm start from standby")));
    let shut = all
        .lines()
        .filter(|l| l.contains("shut down its process group"))
        .count();
    eprintln!(
        "rank {LOST} on host-b SIGKILLed (pid {}) -> every rank stepping again: {back:.3} s, {} step(s) redone (heal inside the round: 2 hosts x 2 ranks, gloo, examples/heal/ddp.py, lease TTL {TTL}); the replacement started {}; {shut} survivor(s) blocked in a collective had their group's connections shut down",
        run.pid,
        redone(&entries, run.t, WORLD),
        if warm {
            "warm from its standby"
        } else {
            "cold"
        }
    );
}

/// Today's path beside it: the workers declare no healable state, so the
/// crash waits for host-b's agent's diagnosis and every host restarts in
/// job from the checkpoint.
#[test]
fn a_rank_killed_without_a_declared_state_restarts_every_host_in_job() {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let want = reference();
    let run = lose_rank(&etcd, dir.path(), "mhheal-injob", false);
    let all = run.all();
    let entries = read_log(&run.log);
    assert_eq!(
        &digests(&entries),
        want,
        "digests against the fault-free run\n{all}"
    );
    let (pids, _) = pids_and_counts(&entries);
    assert!(
        (0..WORLD).all(|r| pids[&r].len() == 2),
        "every rank restarted in job: {pids:?}\n{all}"
    );
    assert!(
        !all.contains("healing it from a live replica"),
        "nothing declared: no heal\n{all}"
    );
    let back = back_after(&entries, run.t, WORLD, &all);
    eprintln!(
        "rank {LOST} on host-b SIGKILLed -> every rank stepping again: {back:.3} s, {} step(s) redone (in-job restart of every host from the checkpoint: 2 hosts x 2 ranks, gloo, examples/heal/ddp.py, lease TTL {TTL})",
        redone(&entries, run.t, WORLD)
    );
}
