//! Heal from a live replica across hosts (issue 31, "a fault on a second
//! host"): real etcd, three real `warden run` launchers on this machine as
//! hosts (host-a 127.0.0.2, host-b 127.0.0.3, and the spare host-s
//! 127.0.0.4 with `--spare`), each with its own embedded agent, one rank per
//! host of examples/heal/ddp.py (plain DDP on gloo, Adam, dropout, data
//! seeded by step and rank), or of examples/heal/lightning_ddp.py (the same
//! under PyTorch Lightning's DDP strategy): the two ranks are data-parallel
//! replicas on two hosts. Or two ranks a host of
//! examples/heal/lightning_hsdp.py (Lightning's FSDP2 in replica groups):
//! each host one replica group of two shards.
//!
//! A fault-free run of host-a and host-b gives the reference digests. Then
//! host-b is lost: its worker and its launcher SIGKILLed (a dead host) at a
//! step between two checkpoints. Its lease runs out, the spare takes its
//! node rank in a new round (so rank 1 stays rank 1), and:
//! - host-a's launcher keeps its worker and heals it into the new round in
//!   process ("healed into round"): the same pid steps on;
//! - each round's store is hosted by node rank 0's launcher (a store
//!   process of its own, `round_store`), never by a worker: host-a's
//!   launcher serves the new round's store at its new port, or, when host-b
//!   was node rank 0, the spare's launcher does;
//! - host-s starts rank 1, which takes model, optimizer and step from rank
//!   0 over the new round's store ("healed from rank 0");
//! - both launchers exit 0 with every digest equal to the fault-free run's,
//!   no step logged more than twice, no restart in job and no checkpoint
//!   restore.
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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::etcd::EtcdServer;
use common::heal_host::{Host, Launch};
use common::heal_log::{
    Entry, assert_no_step_logged_more_than_twice, back_after, digests, pids_and_counts, read_log,
    redone, show, unix_now, wait_step,
};
use common::{Streaming, torch_available};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A whole run on a loaded 2-core machine: interpreters importing torch on
/// three hosts, the lost host's lease and rejoin grace, the training.
const RUN: Duration = Duration::from_secs(480);
const STEPS: u32 = 150;
const CKPT_EVERY: u32 = 50;
/// The step of rank 1 after which host-b is lost.
const KILL_AT: u32 = 70;
/// The step of host-a's rank after which it is SIGKILLed, in the test of
/// two faults in a row (between the checkpoints at 100 and 150).
const SECOND_AT: u32 = 115;
const WORLD: u32 = 2;
/// Every launcher's lease (as tests/multihost.rs: margin for a loaded
/// machine's keep-alives).
const TTL: &str = "3s";

/// One run at a time: each is several torch interpreters on two cores.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Which job of examples/heal/ a test runs, and its pace.
#[derive(Clone, Copy)]
struct Example {
    /// The file under examples/heal/.
    file: &'static str,
    /// What its standby imports ahead (`--preload`).
    preload: Option<&'static str>,
    steps: u32,
    ckpt_every: u32,
    /// The step of the lost host's rank after which it is lost.
    kill_at: u32,
    /// Workers a host (`--nproc-per-node`).
    nproc: u32,
    /// Hosts in the job (`--nnodes`), the spare not counted.
    nnodes: u32,
    /// Every launcher's lease (`--rdzv-lease-ttl`).
    ttl: &'static str,
}

/// Plain DDP (examples/heal/ddp.py).
const DDP: Example = Example {
    file: "ddp.py",
    preload: None,
    steps: STEPS,
    ckpt_every: CKPT_EVERY,
    kill_at: KILL_AT,
    nproc: 1,
    nnodes: WORLD,
    ttl: TTL,
};

/// PyTorch Lightning's DDP strategy (examples/heal/lightning_ddp.py), its
/// standby with Lightning imported as `warden run --preload` would have
/// it; fewer steps (Lightning's own work per step is the slow part here).
const LIGHTNING: Example = Example {
    file: "lightning_ddp.py",
    preload: Some("pytorch_lightning"),
    steps: 90,
    ckpt_every: 30,
    kill_at: 40,
    nproc: 1,
    nnodes: WORLD,
    ttl: TTL,
};

/// Hugging Face Transformers' Trainer with DDP
/// (examples/heal/transformers_ddp.py), its standby with the Trainer
/// imported; the same pace as Lightning's.
const TRANSFORMERS: Example = Example {
    file: "transformers_ddp.py",
    preload: Some("transformers,transformers.trainer"),
    steps: 90,
    ckpt_every: 30,
    kill_at: 40,
    nproc: 1,
    nnodes: WORLD,
    ttl: TTL,
};

/// Lightning's FSDP2 in replica groups (examples/heal/lightning_hsdp.py,
/// `WardenModelParallelStrategy(heal=True)`), two ranks a host: each host
/// holds one replica group (host-a ranks 0 and 1, shards 0 and 1; host-b
/// ranks 2 and 3), as HSDP is laid out (shards within a host, replicas
/// across hosts); Lightning's pace.
const LIGHTNING_HSDP: Example = Example {
    file: "lightning_hsdp.py",
    preload: Some("pytorch_lightning"),
    steps: 90,
    ckpt_every: 30,
    kill_at: 40,
    nproc: 2,
    nnodes: WORLD,
    // Longer than the agent's hang floor (3 s) plus its poll: the
    // survivors' agents judge the hang of their collectives before the
    // lost host's lease runs out, as on a real host whose ranks block in a
    // collective with the lost ones (the default lease is 5 s).
    ttl: "8s",
};

/// `warden run` of `ex` as host `h` (its lines and its workers' on one
/// stream), with the default standbys.
fn launch(
    h: &Host,
    etcd: &EtcdServer,
    job: (&str, Example),
    log: &Path,
    spare: bool,
    heal: bool,
) -> Streaming {
    launch_keeping(h, etcd, job, log, spare, heal, None)
}

/// [`launch`] keeping `standbys` standby interpreters (`--standbys`; None:
/// the default, one per local worker).
fn launch_keeping(
    h: &Host,
    etcd: &EtcdServer,
    (job, ex): (&str, Example),
    log: &Path,
    spare: bool,
    heal: bool,
    standbys: Option<u32>,
) -> Streaming {
    h.launch(&Launch {
        etcd,
        job,
        log,
        nproc: ex.nproc,
        nnodes: ex.nnodes,
        spare,
        heal,
        ttl: ex.ttl,
        steps: ex.steps,
        ckpt_every: ex.ckpt_every,
        example: ex.file,
        preload: ex.preload,
        standbys,
    })
}

struct Hosts {
    a: Host,
    b: Host,
    s: Host,
}

fn hosts() -> Hosts {
    Hosts {
        a: Host::new("host-a", "127.0.0.2", "warden-hostheal-"),
        b: Host::new("host-b", "127.0.0.3", "warden-hostheal-"),
        s: Host::new("host-s", "127.0.0.4", "warden-hostheal-"),
    }
}

/// The fault-free run's digests of `ex` (host-a and host-b, no spare),
/// made once per test binary and example (on an etcd of its own).
fn reference(ex: Example) -> BTreeMap<u32, String> {
    static REF: Mutex<BTreeMap<&'static str, BTreeMap<u32, String>>> = Mutex::new(BTreeMap::new());
    let mut refs = REF
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    refs.entry(ex.file)
        .or_insert_with(|| {
            let etcd = EtcdServer::start();
            let scratch = tempfile::Builder::new()
                .prefix("warden-hostheal-")
                .tempdir()
                .unwrap();
            fault_free(&etcd, scratch.path(), ex)
        })
        .clone()
}

fn fault_free(etcd: &EtcdServer, scratch: &Path, ex: Example) -> BTreeMap<u32, String> {
    let h = hosts();
    let log = scratch.join("fault-free.log");
    // No standbys: nothing fails in this run, so they would only import
    // torch (and the framework) beside its workers.
    let mut a = launch_keeping(&h.a, etcd, ("hostheal-ref", ex), &log, false, true, Some(0));
    a.wait_line(RUN, "host-a's join", |l| {
        l.contains("joined as host host-a")
    });
    let mut b = launch_keeping(&h.b, etcd, ("hostheal-ref", ex), &log, false, true, Some(0));
    for j in [&mut a, &mut b] {
        let status = j.wait_exit(RUN);
        assert!(status.success(), "fault-free run: {status}\n{}", show(j));
    }
    let d = digests(&read_log(&log));
    assert_eq!(
        d.len(),
        (WORLD * ex.nproc) as usize,
        "{}\n{}",
        show(&mut a),
        show(&mut b)
    );
    assert!(
        d.values().all(|x| x == &d[&0] && x.len() == 64),
        "fault-free digests differ: {d:?}"
    );
    d
}

/// host-b, at node rank (and rank) `lost_rank`, lost (its worker and
/// launcher SIGKILLed) once its rank logged [`KILL_AT`], with the spare
/// waiting; returns the log, the kill's time and when the spare was given
/// its place, the lost worker's pid and the two launchers
/// left, both exited.
fn lose_host_b(
    etcd: &EtcdServer,
    scratch: &Path,
    job: (&str, Example),
    heal: bool,
    lost_rank: u32,
) -> (PathBuf, (f64, f64), i32, Streaming, Streaming) {
    let (log, times, lost, a, s, _) = lose_host_b_then(etcd, scratch, job, heal, lost_rank, None);
    (log, times, lost, a, s)
}

/// [`lose_host_b`], and then, with `second` = Some(step), host-a's worker
/// SIGKILLed once it logged that step (a second fault, in the healed
/// round); returns that kill's time and pid too.
#[allow(clippy::type_complexity)]
fn lose_host_b_then(
    etcd: &EtcdServer,
    scratch: &Path,
    job: (&str, Example),
    heal: bool,
    lost_rank: u32,
    second: Option<u32>,
) -> (
    PathBuf,
    (f64, f64),
    i32,
    Streaming,
    Streaming,
    Option<(f64, i32)>,
) {
    let h = hosts();
    let log = scratch.join(format!("{}.log", job.0));
    // Node ranks follow the join order: the first to join is node rank 0,
    // whose launcher hosts the round's store.
    let (mut a, mut b) = if lost_rank == 1 {
        let mut a = launch(&h.a, etcd, job, &log, false, heal);
        a.wait_line(RUN, "host-a's join", |l| {
            l.contains("joined as host host-a")
        });
        let b = launch(&h.b, etcd, job, &log, false, heal);
        (a, b)
    } else {
        let mut b = launch(&h.b, etcd, job, &log, false, heal);
        b.wait_line(RUN, "host-b's join", |l| {
            l.contains("joined as host host-b")
        });
        let a = launch(&h.a, etcd, job, &log, false, heal);
        (a, b)
    };
    let place = format!("host-b: node rank {lost_rank}");
    b.wait_line(RUN, &place, |l| l.contains(&place));
    let mut s = launch(&h.s, etcd, job, &log, true, heal);
    s.wait_line(RUN, "the spare's standby attempt", |l| {
        l.contains("no place in this round")
    });
    // Every rank of host-b (node rank x workers a host onwards) past the
    // step, all SIGKILLed at once, then the launcher. With several ranks a
    // host (HSDP, each host a replica group), a host whose ranks stood a
    // step apart as it died leaves its shard positions' survivors a step
    // apart too (a survivor waits in the step its lost partner never
    // finished), and no live replica holds every position at one step: the
    // job falls back to the checkpoint, rightly. Seen once in 8 runs when
    // only the first rank's step was awaited; the ranks past the same step
    // die before the next step's collectives (each step sleeps 30 ms first).
    let first = lost_rank * job.1.nproc;
    let pids: Vec<i32> = (first..first + job.1.nproc)
        .map(|rank| {
            wait_step(
                &log,
                rank,
                job.1.kill_at,
                &mut [&mut a, &mut b, &mut s],
                RUN,
            )
        })
        .collect();
    let lost = pids[0];
    let t = unix_now();
    for pid in &pids {
        kill(Pid::from_raw(*pid), Signal::SIGKILL).expect("SIGKILL host-b's worker");
    }
    b.signal(Signal::SIGKILL);
    let _ = b.child.wait();
    // When the spare is given host-b's place (its launcher says the round
    // as it starts its worker), on either path: what follows is the
    // recovery's own part (before it, host-b's lease and the rejoin grace
    // run out, or host-a's worker fails and restarts first).
    s.wait_line(RUN, "the spare's place in a round", |l| {
        l.contains("host-s: node rank")
    });
    let round_seen = unix_now();
    let second = second.map(|step| {
        let survivor = 1 - lost_rank;
        let pid = wait_step(&log, survivor, step, &mut [&mut a, &mut s], RUN);
        let t2 = unix_now();
        kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL host-a's worker");
        (t2, pid)
    });
    for j in [&mut a, &mut s] {
        let status = j.wait_exit(RUN);
        let label = j.label.clone();
        assert!(status.success(), "{label}: {status}\n{}", show(j));
    }
    // The hosts' scratch directories go with `h`; everything needed is read.
    a.drain(Duration::from_secs(5));
    s.drain(Duration::from_secs(5));
    (log, (t, round_seen), lost, a, s, second)
}

/// host-a's and the spare's console lines (for assertion messages) and
/// the job's log, its digests checked against the fault-free run's.
fn outcome(
    a: &Streaming,
    s: &Streaming,
    log: &Path,
    want: &BTreeMap<u32, String>,
) -> (String, Vec<Entry>) {
    let all = format!(
        "--- host-a ---\n{}\n--- host-s ---\n{}",
        a.seen.join("\n"),
        s.seen.join("\n")
    );
    let entries = read_log(log);
    assert_eq!(
        &digests(&entries),
        want,
        "digests against the fault-free run\n{all}"
    );
    (all, entries)
}

/// A survivor whose job ended while the lost host-b's goodput report was
/// still its live copy (a lost host stores no final one) does not wait
/// for it, and says so; no launcher gives up waiting for a host that is
/// still in the job (host-a or the spare).
fn assert_lost_host_not_awaited(a: &Streaming, s: &Streaming, all: &str) {
    for j in [a, s] {
        let running = j.seen.iter().find_map(|l| {
            l.contains("job-wide goodput, ")
                .then(|| l.split_once("still running, as last reported: "))
                .flatten()
                .map(|(_, hosts)| hosts)
        });
        if running.is_some_and(|hosts| hosts.contains("host-b")) {
            assert!(
                j.seen
                    .iter()
                    .any(|l| l.contains("not waiting for the final report of host-b: lost")),
                "{}: waited for the lost host's final report\n{all}",
                j.label
            );
        }
        assert!(
            !j.seen
                .iter()
                .any(|l| l.contains("not waiting for the final report of")
                    && (l.contains("host-a") || l.contains("host-s"))),
            "{}: gave up on a host still in the job\n{all}",
            j.label
        );
    }
}

fn prepare() -> Option<(MutexGuard<'static, ()>, tempfile::TempDir, EtcdServer)> {
    if !torch_available() {
        return None;
    }
    let one = serial();
    let dir = tempfile::Builder::new()
        .prefix("warden-hostheal-")
        .tempdir()
        .unwrap();
    Some((one, dir, EtcdServer::start()))
}

#[test]
fn a_lost_host_is_healed_on_a_spare_while_the_survivor_keeps_its_process() {
    heal_case(("hostheal-one", DDP), 1);
}

/// The same fault under PyTorch Lightning (issue 31: the integrations heal
/// where their strategy allows, and a fault on a second host): a
/// LightningModule with its DDP strategy and `WardenCallback`, one rank per
/// host; the spare's rank takes its model, optimizer and the loops' state
/// from the survivor over the new round, and every digest is Lightning's
/// own fault-free run's.
#[test]
fn a_lost_host_under_lightning_is_healed_on_a_spare() {
    if !common::python_has("pytorch_lightning") {
        return;
    }
    heal_case(("hostheal-lightning", LIGHTNING), 1);
}

/// The same fault under the Transformers Trainer (`WardenTrainer`, DDP):
/// the spare's rank takes model, optimizer, scheduler and the Trainer's
/// state from the survivor over the new round.
#[test]
fn a_lost_host_under_transformers_is_healed_on_a_spare() {
    if !common::python_has("transformers") {
        return;
    }
    heal_case(("hostheal-transformers", TRANSFORMERS), 1);
}

/// Lightning's FSDP2 in replica groups across hosts (issue 31: HSDP, and a
/// fault on a second host): two ranks a host, each host one replica group.
/// host-b (ranks 2 and 3, shards 0 and 1 of replica group 1) lost; the
/// spare takes node rank 1, and each of its ranks takes its own shards of
/// module and optimizer, the schedule and the loops' state from the holder
/// of the same shard position on host-a (rank 2 from rank 0, rank 3 from
/// rank 1) over the new round; host-a's ranks keep their processes and
/// shards; every digest (whole tensors, gathered over the shards) is the
/// fault-free run's; nothing is read from a checkpoint.
#[test]
fn a_lost_host_under_lightning_hsdp_is_healed_on_a_spare_shard_by_shard() {
    if !common::python_has("pytorch_lightning") {
        return;
    }
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let ex = LIGHTNING_HSDP;
    let world = WORLD * ex.nproc;
    let want = reference(ex);
    let (log, (t, round_seen), lost, a, s) =
        lose_host_b(&etcd, dir.path(), ("hostheal-lightning-hsdp", ex), true, 1);
    let (all, entries) = outcome(&a, &s, &log, &want);
    let (pids, times) = pids_and_counts(&entries);
    for rank in [0, 1] {
        assert_eq!(
            pids[&rank].len(),
            1,
            "rank {rank} (host-a) kept its process: {pids:?}\n{all}"
        );
    }
    for rank in [2, 3] {
        assert_eq!(
            pids[&rank].len(),
            2,
            "rank {rank}: host-b's process, then the spare's: {pids:?}\n{all}"
        );
    }
    assert!(pids[&2].contains(&lost), "{pids:?}\n{all}");
    assert_no_step_logged_more_than_twice(&times, &all);
    assert!(
        a.seen.iter().any(|l| l.contains("healed into round")),
        "host-a healed its workers into the new round\n{all}"
    );
    for (rank, from) in [(2, 0), (3, 1)] {
        let healed = format!("rank {rank}: healed from rank {from} at step");
        assert!(
            s.seen.iter().any(|l| l.contains(&healed)),
            "the spare's rank {rank} took its shards from rank {from}, the same shard position\n{all}"
        );
    }
    for never in [
        "restarting the workers into it",
        "restored from the checkpoint",
        "no live replica holds",
    ] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    eprintln!(
        "host-b (ranks 2 and 3, one replica group) lost -> every rank stepping again: {:.3} s, {} step(s) \
         redone (heal across hosts; lease TTL {}, 2 hosts of 2 ranks + spare, gloo, \
         examples/heal/lightning_hsdp.py); part: the spare given its place -> every rank stepping: {:.3} s",
        back_after(&entries, t, world, &all),
        redone(&entries, t, world),
        ex.ttl,
        back_after(&entries, round_seen, world, &all),
    );
}

/// The lost host was node rank 0, whose launcher hosted the round's store:
/// the spare takes node rank 0, its launcher hosts the new round's store
/// (`MASTER_ADDR` is the spare's address), and its new rank 0 receives its
/// state from rank 1 on host-a.
#[test]
fn a_lost_node_rank_0_moves_the_store_to_the_spare_and_heals() {
    heal_case(("hostheal-zero", DDP), 0);
}

/// host-b lost at rank `lost_rank`, healed on the spare; every check.
fn heal_case(job: (&str, Example), lost_rank: u32) {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let survivor = 1 - lost_rank;
    let want = reference(job.1);
    let (log, (t, round_seen), lost, a, s) = lose_host_b(&etcd, dir.path(), job, true, lost_rank);
    let (all, entries) = outcome(&a, &s, &log, &want);

    let (pids, times) = pids_and_counts(&entries);
    assert_eq!(
        pids[&survivor].len(),
        1,
        "rank {survivor} (host-a) kept its process: {pids:?}\n{all}"
    );
    assert!(
        pids[&lost_rank].len() == 2 && pids[&lost_rank].contains(&lost),
        "rank {lost_rank}: host-b's process, then the spare's: {pids:?}\n{all}"
    );
    assert_no_step_logged_more_than_twice(&times, &all);
    assert!(
        a.seen.iter().any(|l| l.contains("healed into round")),
        "host-a healed its worker into the new round\n{all}"
    );
    // The round's store is node rank 0's launcher's (a process of its own,
    // `round_store`), not a worker's: host-a's while it is node rank 0 (the
    // first round's, then the healed round's, at its new port), else the
    // spare's once it takes node rank 0; never the other host's. A
    // survivor blocked in a collective with the lost rank (no error) may be
    // judged hung before the lost host's lease runs out (the hang floor,
    // 3 s, is the lease's TTL): a hang heal round with the same hosts comes
    // first, then the lost host's round. Either way each round node rank 0
    // was in has its store, at its own port.
    let (host0, other, name0) = if lost_rank == 1 {
        (&a, &s, "host-a")
    } else {
        (&s, &a, "host-s")
    };
    let hosting: BTreeSet<&str> = host0
        .seen
        .iter()
        .filter_map(|l| {
            l.split_once("hosts the round's store at port ")
                .map(|(_, p)| p)
        })
        .filter_map(|p| p.split_whitespace().next())
        .collect();
    let zero = format!("{name0}: node rank 0");
    let rounds: BTreeSet<&str> = host0
        .seen
        .iter()
        .filter(|l| l.ends_with(&zero))
        .filter_map(|l| l.split_once("] round ").map(|(_, r)| r))
        .filter_map(|r| r.split_whitespace().next())
        .collect();
    // One round more only where a host judged a hang first (the client
    // waits for a lost peer's heal in `heal_wait`, which is no hang: a
    // regression there would bring the extra round back).
    let least = if lost_rank == 1 { 2 } else { 1 };
    let hang_first = usize::from(all.contains("a hang across hosts"));
    assert!(
        (least..=least + hang_first).contains(&rounds.len()),
        "{name0}: node rank 0 of the first round and of the round that replaced host-b (one more only after a hang verdict): {rounds:?}\n{all}"
    );
    assert_eq!(
        hosting.len(),
        rounds.len(),
        "node rank 0's launcher hosted each of its rounds' stores: {hosting:?} for rounds {rounds:?}\n{all}"
    );
    assert!(
        !other
            .seen
            .iter()
            .any(|l| l.contains("hosts the round's store")),
        "only node rank 0's launcher hosts the store\n{all}"
    );
    let healed = format!("healed from rank {survivor}");
    assert!(
        s.seen.iter().any(|l| l.contains(&healed)),
        "the spare's rank {lost_rank} took its state from rank {survivor}\n{all}"
    );
    for never in [
        "restarting the workers into it",
        "restored from the checkpoint",
    ] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    assert_lost_host_not_awaited(&a, &s, &all);
    let back = back_after(&entries, t, WORLD, &all);
    let part = back_after(&entries, round_seen, WORLD, &all);
    let warm = s.seen.iter().any(|l| l.contains("warm start from standby"));
    eprintln!(
        "host-b (rank {lost_rank}) lost (SIGKILL of its worker {lost} and launcher) -> every rank stepping again: {back:.3} s, {} step(s) redone (heal across hosts; lease TTL {TTL}, 2 hosts + spare, gloo, examples/heal/{}); part: the spare given its place -> every rank stepping: {part:.3} s; the spare's rank started {}",
        redone(&entries, t, WORLD),
        job.1.file,
        if warm {
            "warm from its standby"
        } else {
            "cold"
        }
    );
}

/// Two faults in a row across hosts (issue 31): host-b lost and healed on
/// the spare, then, in the healed round, host-a's worker SIGKILLed once it
/// logged [`SECOND_AT`]. Its launcher heals it in the round from the
/// spare's rank (a live replica on another host): the spare's rank keeps
/// its process, host-a's rank is replaced once, every digest is the
/// fault-free run's, no step is logged more than twice, and no host
/// restarts in job or restores a checkpoint.
#[test]
fn a_second_fault_after_a_host_was_healed_on_the_spare_heals_too() {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let want = reference(DDP);
    let (log, (t, _), lost, a, s, second) = lose_host_b_then(
        &etcd,
        dir.path(),
        ("hostheal-twice", DDP),
        true,
        1,
        Some(SECOND_AT),
    );
    let (t2, second_pid) = second.expect("the second fault was made");
    let (all, entries) = outcome(&a, &s, &log, &want);
    let (pids, times) = pids_and_counts(&entries);
    assert!(
        pids[&0].len() == 2 && pids[&0].contains(&second_pid),
        "rank 0 (host-a): its first process, then its replacement: {pids:?}\n{all}"
    );
    assert!(
        pids[&1].len() == 2 && pids[&1].contains(&lost),
        "rank 1: host-b's process, then the spare's, which kept it through the second fault: \
         {pids:?}\n{all}"
    );
    assert_no_step_logged_more_than_twice(&times, &all);
    assert!(
        a.seen.iter().any(|l| l.contains("healed into round")),
        "host-a healed its worker into the spare's round\n{all}"
    );
    let heal =
        format!("rank 0 (pid {second_pid}) signal 9 (SIGKILL): healing it from a live replica");
    assert!(
        a.seen.iter().any(|l| l.contains(&heal)),
        "host-a's launcher healed its rank the second time\n{all}"
    );
    assert!(
        a.seen
            .iter()
            .any(|l| l.contains("rank 0: healed from rank 1")),
        "host-a's replacement took its state from the spare's rank\n{all}"
    );
    for never in [
        "restarting the workers",
        "restored from the checkpoint",
        "leaving with exit 75",
    ] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    eprintln!(
        "two faults in a row: host-b lost -> every rank stepping again: {:.3} s; then host-a's rank 0 \
         SIGKILLed (pid {second_pid}) -> every rank stepping again: {:.3} s, {} step(s) redone (lease TTL \
         {TTL}, 2 hosts + spare, gloo, examples/heal/ddp.py)",
        back_after(&entries, t, WORLD, &all),
        back_after(&entries, t2, WORLD, &all),
        redone(&entries, t2, WORLD),
    );
}

#[test]
fn a_lost_host_without_a_declared_state_restarts_in_job_from_the_checkpoint() {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let want = reference(DDP);
    let (log, (t, round_seen), _lost, a, s) =
        lose_host_b(&etcd, dir.path(), ("hostheal-injob", DDP), false, 1);
    let (all, entries) = outcome(&a, &s, &log, &want);
    let pids: BTreeSet<i32> = entries
        .iter()
        .filter_map(|e| match e {
            Entry::Step { rank: 0, pid, .. } => Some(*pid),
            _ => None,
        })
        .collect();
    assert_eq!(
        pids.len(),
        2,
        "host-a's rank restarted in job: {pids:?}\n{all}"
    );
    assert!(
        !a.seen.iter().any(|l| l.contains("healed into round")),
        "nothing declared: no heal\n{all}"
    );
    let back = back_after(&entries, t, WORLD, &all);
    let part = back_after(&entries, round_seen, WORLD, &all);
    eprintln!(
        "host-b (rank 1) lost (SIGKILL of its worker and launcher) -> every rank stepping again: {back:.3} s, {} step(s) redone (in-job restart of every host from the checkpoint; lease TTL {TTL}, 2 hosts + spare, gloo, examples/heal/ddp.py); part: the spare given its place -> every rank stepping: {part:.3} s",
        redone(&entries, t, WORLD)
    );
}

/// Three hosts of examples/heal/hsdp.py (plain FSDP2 over a 3 x 2 mesh:
/// each host one replica group of two shards), the spare waiting, and the
/// same lost host-b (ranks 2 and 3). The survivors' ranks, told by gloo
/// that their peers' connections closed, wait for the lost peers' heal in
/// the client's `heal_wait` section (judged by `hang.heal_timeout`, 2 min,
/// so by default nothing calls them hung and host-b's lease's end heals
/// them); host-a's agent, `hang.timeouts.heal_wait` set to 3 s here (as a
/// survivor blocked in an NCCL collective with no error would be judged
/// at its section's floor), judges the hang first ("hung ... in
/// 'heal_wait'"), within the lease's 8 s, and decides a restart in job
/// (its policy set so for every class), and host-a heals its workers
/// into a new round of the same hosts, which says so (`heal` in etcd's
/// round record). host-c, which has not judged it (its floor set past the
/// run here, to order the race every run: on a real job either survivor
/// may judge first), keeps its place in that round and heals its workers
/// into it in process too, where before it restarted them in job from the
/// checkpoint. The lost host's lease's end then brings the spare into
/// node rank 1, whose ranks take their shards from the same shard
/// positions on host-a or host-c. Every survivor keeps its process, every
/// digest is the fault-free run's, nothing is read from a checkpoint.
#[test]
fn a_hang_heal_round_asked_by_one_host_keeps_the_third_hosts_workers() {
    let Some((_one, dir, etcd)) = prepare() else {
        return;
    };
    let ex = Example {
        file: "hsdp.py",
        preload: None,
        steps: 90,
        ckpt_every: 30,
        kill_at: 40,
        nproc: 2,
        nnodes: 3,
        ttl: "8s",
    };
    let world = ex.nnodes * ex.nproc;
    let h = hosts();
    let c = Host::new("host-c", "127.0.0.5", "warden-hostheal-");
    c.configure_agent("[hang]\nfloor = \"5m\"\n");
    // host-a restarts in job for a hang of any class (infrastructure's
    // default; transient software's first answer is an in-process restart,
    // which the survivors' ranks take without a round): the decision this
    // test is about, every run.
    h.a.configure_agent(
        "[policy.transient_software]\non_failure = [\"restart_in_job\"]\non_running = \"continue\"\nbudget = 3\nwindow = \"1h\"\nexhausted = \"cordon\"\n\
         [hang.timeouts]\nheal_wait = \"3s\"\n",
    );
    let run = |host: &Host, job: &str, log: &Path, spare: bool| {
        launch(host, &etcd, (job, ex), log, spare, true)
    };
    // Node ranks follow the join order: host-a 0, host-b 1, host-c 2.
    let in_order = |job: &str, log: &Path| {
        let mut a = run(&h.a, job, log, false);
        a.wait_line(RUN, "host-a's join", |l| {
            l.contains("joined as host host-a")
        });
        let mut b = run(&h.b, job, log, false);
        b.wait_line(RUN, "host-b's join", |l| {
            l.contains("joined as host host-b")
        });
        let c = run(&c, job, log, false);
        (a, b, c)
    };

    let reference = dir.path().join("fault-free.log");
    let (mut a, mut b, mut cc) = in_order("hostheal3-ref", &reference);
    for j in [&mut a, &mut b, &mut cc] {
        let status = j.wait_exit(RUN);
        assert!(status.success(), "fault-free run: {status}\n{}", show(j));
    }
    let want = digests(&read_log(&reference));
    assert_eq!(want.len(), world as usize, "{want:?}\n{}", show(&mut a));
    assert!(
        want.values().all(|x| x == &want[&0] && x.len() == 64),
        "fault-free digests differ: {want:?}"
    );

    let log = dir.path().join("hostheal3.log");
    let (mut a, mut b, mut cc) = in_order("hostheal3", &log);
    b.wait_line(RUN, "host-b's place", |l| l.contains("host-b: node rank 1"));
    let mut s = run(&h.s, "hostheal3", &log, true);
    s.wait_line(RUN, "the spare's standby attempt", |l| {
        l.contains("no place in this round")
    });
    let pids: Vec<i32> = [2, 3]
        .into_iter()
        .map(|rank| {
            wait_step(
                &log,
                rank,
                ex.kill_at,
                &mut [&mut a, &mut b, &mut cc, &mut s],
                RUN,
            )
        })
        .collect();
    let t = unix_now();
    for pid in &pids {
        kill(Pid::from_raw(*pid), Signal::SIGKILL).expect("SIGKILL host-b's worker");
    }
    b.signal(Signal::SIGKILL);
    let _ = b.child.wait();
    for j in [&mut a, &mut cc, &mut s] {
        let status = j.wait_exit(RUN);
        let label = j.label.clone();
        assert!(status.success(), "{label}: {status}\n{}", show(j));
    }
    for j in [&mut a, &mut cc, &mut s] {
        j.drain(Duration::from_secs(5));
    }
    let all = format!(
        "--- host-a ---\n{}\n--- host-c ---\n{}\n--- host-s ---\n{}",
        a.seen.join("\n"),
        cc.seen.join("\n"),
        s.seen.join("\n")
    );
    let entries = read_log(&log);
    assert_eq!(
        digests(&entries),
        want,
        "digests against the fault-free run\n{all}"
    );
    let (ranks, times) = pids_and_counts(&entries);
    for rank in [0, 1, 4, 5] {
        assert_eq!(
            ranks[&rank].len(),
            1,
            "rank {rank} (host-a or host-c) kept its process: {ranks:?}\n{all}"
        );
    }
    for rank in [2, 3] {
        assert_eq!(
            ranks[&rank].len(),
            2,
            "rank {rank}: host-b's process, then the spare's: {ranks:?}\n{all}"
        );
    }
    assert_no_step_logged_more_than_twice(&times, &all);
    assert!(
        a.seen
            .iter()
            .any(|l| l.contains("a hang across hosts, and every worker here can be healed")),
        "host-a judged the hang and healed into a new round\n{all}"
    );
    assert!(
        a.seen
            .iter()
            .any(|l| l.contains("(hang):") && l.contains("in 'heal_wait'")),
        "host-a's ranks were judged where they waited, in 'heal_wait'\n{all}"
    );
    assert!(
        cc.seen
            .iter()
            .any(|l| l.contains("restart requested by host-a")
                && l.contains("this host keeps its place: healing its workers into the round")),
        "host-c healed its workers into host-a's round\n{all}"
    );
    for never in [
        "restarting the workers into it",
        "restarting in job",
        "restored from the checkpoint",
        "no live replica holds",
    ] {
        assert!(!all.contains(never), "{never:?}\n{all}");
    }
    eprintln!(
        "host-b (ranks 2 and 3) lost, 3 hosts of 2 ranks + spare, host-a judged the hang -> every rank stepping again: {:.3} s, {} step(s) redone (lease TTL {}, gloo, examples/heal/hsdp.py)",
        back_after(&entries, t, world, &all),
        redone(&entries, t, world),
        ex.ttl,
    );
}
