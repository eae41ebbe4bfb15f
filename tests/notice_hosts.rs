//! A notice of a coming stop on one host of a multi-host job (issue 32):
//! a real etcd, two real `warden run` launchers as host-a (127.0.0.2) and
//! host-b (127.0.0.3), each with its own embedded agent and checkpoint
//! tier, and real torch ranks (tests/fixtures/notice_train.py --lockstep) kept in
//! lockstep by a gloo all_reduce at every step, as a data-parallel job's
//! are. Only host-a's launcher gets the scheduler's SIGTERM
//! (`--term-grace`): its agent names a step far enough ahead, host-a
//! publishes it in etcd, host-b's launcher reads it from its watch and
//! tells its agent; every rank of both hosts saves that same step, both
//! launchers exit 85, and the next run of both hosts resumes at the step
//! after it.
//!
//! The same over torch's c10d rendezvous (no etcd): the notice goes
//! through torch's store at the endpoint; the agents are each other's
//! checkpoint peers by their config, as c10d rounds name none.
//!
//! A host's own notice (issue 32): host-a's agent alone reads a GCE
//! metadata server (tests/common/metadata.rs, on 127.0.0.4), which says
//! `instance/preempted = TRUE`. host-a's agent names a step with the same
//! lead, its launcher learns of it from the agent's `notice.raised` event
//! and publishes it before any rank left: every rank of both hosts saves
//! that step.
//!
//! A host between rounds: two launchers' coordinators over a real etcd;
//! host-a asks for a restart (it is between rounds), host-b publishes a
//! notice in the round host-a left; host-a's next rendezvous ends with 85
//! instead of starting workers in a round the others are leaving. The same
//! over torch's c10d store (the real helper, torch's real handler), where
//! host-a's join would otherwise wait for a round until torch's timeout.
//! A launcher that joins while the job stops on a notice exits 85 at
//! once; one of the job's next run (every launcher of the stopped run
//! gone) does not, even within the notice's deadline.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;
#[path = "common/metadata.rs"]
mod metadata;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::{Streaming, WARDEN, python, repo_root};
use nix::sys::signal::Signal;
use warden_launcher::c10d::{C10dConfig, C10dCoordinator};
use warden_launcher::coord::CoordConfig;
use warden_launcher::etcd::{CordonCap, EtcdCoordinator};
use warden_launcher::hosts::{AcrossHosts, AttemptPlan, Directive, Remote};
use warden_launcher::output::Console;

/// Any one wait on a loaded 2-core machine (4 torch ranks, 2 agents, etcd).
const WAIT: Duration = Duration::from_secs(180);
/// `--term-grace`: the scheduler's SIGTERM to SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(40);

const AGENT_TOML: &str = "[agent]\ntick = \"50ms\"\n\
    [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
    [straggler]\nenabled = false\n\
    [kmsg]\nenabled = false\n[nvml]\nenabled = false\n[dcgm]\nenabled = false\n";

/// How the hosts meet.
#[derive(Clone, Copy)]
enum Rdzv<'a> {
    /// Through etcd: rounds, and the checkpoint peers they name.
    Etcd(&'a EtcdServer),
    /// Through torch's c10d store at host-a's address and this port.
    C10d(u16),
}

/// One host: its scratch directory (logs, agent config, tier, summary).
struct Host {
    dir: tempfile::TempDir,
    id: &'static str,
    addr: &'static str,
}

impl Host {
    fn new(id: &'static str, addr: &'static str) -> Self {
        Self::with_api(id, addr, &format!("{addr}:0"), "")
    }

    /// A host whose agent reads the GCE metadata server at `url` (a test
    /// server on a loopback address: `allow_user_endpoints`).
    fn on_gce(id: &'static str, addr: &'static str, url: &str) -> Self {
        Self::with_api(
            id,
            addr,
            &format!("{addr}:0"),
            &format!(
                "[notice]\nallow_user_endpoints = true\n\
                 [notice.gce]\nenabled = \"on\"\nurl = \"{url}\"\nwait = \"30s\"\n"
            ),
        )
    }

    /// A host whose agent listens at `api` (`ip:port`), with `peers` (TOML
    /// `[[checkpoint.peers]]` tables, or any tables) added to its config.
    fn with_api(id: &'static str, addr: &'static str, api: &str, peers: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("warden-noticeh-")
            .tempdir()
            .unwrap();
        let toml = format!(
            "{}[api]\ntcp = \"{api}\"\n{}[checkpoint]\ndir = {:?}\ndomain = \"{id}\"\n{peers}",
            AGENT_TOML.replacen("[agent]\n", &format!("[agent]\nhost_name = \"{id}\"\n"), 1),
            common::pki::api_keys(id),
            dir.path().join("tier").display().to_string()
        );
        std::fs::write(dir.path().join("agent.toml"), toml).unwrap();
        Self { dir, id, addr }
    }

    /// Two hosts whose agents are each other's checkpoint peers by config,
    /// their job's listings through its checkpoint collector
    /// (`collect_above = 0`, as a job past 128 hosts): the notice check
    /// must find the peer this host replicated to though the collector,
    /// which lists a stopped agent as unreachable, names no copy on it.
    fn peered() -> (Self, Self) {
        let apis = [
            format!("127.0.0.2:{}", common::free_port("127.0.0.2")),
            format!("127.0.0.3:{}", common::free_port("127.0.0.3")),
        ];
        let peer = |id: &str, api: &str| {
            format!(
                "collect_above = 0\n[[checkpoint.peers]]\naddr = \"{api}\"\ndomain = \"{id}\"\nname = \"{id}\"\n"
            )
        };
        (
            Self::with_api("host-a", "127.0.0.2", &apis[0], &peer("host-b", &apis[1])),
            Self::with_api("host-b", "127.0.0.3", &apis[1], &peer("host-a", &apis[0])),
        )
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Waits until this host's tier holds a committed shard of every rank
    /// below `world` of `step` of `job` (its manifest, written last, by
    /// rename: the shard is whole), its own ranks' and its peer's replicas.
    fn wait_for_step(&self, job: &str, step: u64, world: u32) {
        let dir = self
            .path()
            .join("tier")
            .join(job)
            .join(format!("step-{step:020}"));
        let until = Instant::now() + WAIT;
        let missing = || {
            (0..world)
                .filter(|r| !dir.join(format!("rank-{r:06}.json")).exists())
                .collect::<Vec<_>>()
        };
        loop {
            let m = missing();
            if m.is_empty() {
                return;
            }
            assert!(
                Instant::now() < until,
                "{}: ranks {m:?} of step {step} never reached {}",
                self.id,
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `warden run` of 2 lockstep ranks on this host, in the background.
    fn launch(&self, rdzv: Rdzv<'_>, job: &str, run: u32, train: &[&str]) -> Streaming {
        let grace = format!("{}s", TERM_GRACE.as_secs());
        let mut cmd = Command::new(WARDEN);
        cmd.arg("--socket")
            .arg(self.path().join("no-agent-here.sock"))
            .arg("run")
            .args(["--nproc-per-node", "2", "--nnodes", "2"]);
        match rdzv {
            Rdzv::Etcd(etcd) => cmd
                .args(["--rdzv-backend", "etcd", "--rdzv-endpoint", &etcd.endpoint])
                .args(["--rdzv-id", job, "--host-id", self.id])
                .args(["--advertise-addr", self.addr, "--rdzv-lease-ttl", "3s"])
                .args(["--rdzv-conf", "join_timeout=90,last_call_timeout=3"]),
            Rdzv::C10d(port) => cmd
                .args(["--rdzv-backend", "c10d"])
                .args(["--rdzv-endpoint", &format!("127.0.0.2:{port}")])
                .args(["--rdzv-id", job, "--local-addr", self.addr])
                .args([
                    "--rdzv-conf",
                    "join_timeout=180,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3",
                ]),
        };
        cmd.args(["--term-grace", &grace])
            .arg("--log-dir")
            .arg(self.path().join(format!("logs-{run}")))
            .arg("--agent-config")
            .arg(self.path().join("agent.toml"))
            .arg("--summary-json")
            .arg(self.path().join(format!("summary-{run}.json")))
            .arg("--")
            .arg(python())
            .arg(repo_root().join("tests/fixtures/notice_train.py"))
            .arg("--lockstep")
            // 50 ms steps: the lead (2 s) is 40 steps, well before step 200.
            .args(["--every", "100", "--step-ms", "50"])
            .args(train)
            .current_dir(self.path());
        for var in ["WARDEN_SOCKET", "WARDEN_JOB_ID"] {
            cmd.env_remove(var);
        }
        let mut s = Streaming::spawn(&mut cmd, self.path().join(format!("launcher-{run}.stderr")));
        s.label = format!("{} run {run}", self.id);
        s
    }
}

/// The value of `key=` in a line.
fn value(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    line[at..].split_whitespace().next()?.parse().ok()
}

/// Waits until both of the host's ranks printed a line with `what`
/// (lines read before count); returns them.
fn both(l: &mut Streaming, what: &str) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    let mut ranks: Vec<String> = Vec::new();
    let rank_of = |x: &str| x.split(']').next().unwrap_or("").to_owned();
    for x in l.seen.clone() {
        if x.contains(what) && !ranks.contains(&rank_of(&x)) {
            ranks.push(rank_of(&x));
            found.push(x);
        }
    }
    while found.len() < 2 {
        let line = l.wait_line(WAIT, what, |x| x.contains(what));
        if !ranks.contains(&rank_of(&line)) {
            ranks.push(rank_of(&line));
            found.push(line);
        }
    }
    found
}

#[test]
fn a_notice_on_one_host_makes_every_rank_of_every_host_save_one_step_and_exit_85() {
    let etcd = EtcdServer::start();
    let a = Host::new("host-a", "127.0.0.2");
    let b = Host::new("host-b", "127.0.0.3");
    notice_on_host_a(
        &a,
        &b,
        Rdzv::Etcd(&etcd),
        "t-notice-hosts",
        |la| la.signal(Signal::SIGTERM),
        || {},
    );
}

/// A GCE preemption notice served to host-a's agent alone: host-a's
/// launcher hears of it from its agent and spreads it before any rank
/// left, with the lead; every rank of both hosts saves one step.
#[test]
fn a_gce_notice_on_one_hosts_agent_makes_every_rank_of_every_host_save_one_step() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gce = rt.block_on(metadata::Gce::start("127.0.0.4"));
    let etcd = EtcdServer::start();
    let a = Host::on_gce("host-a", "127.0.0.2", &gce.url());
    let b = Host::new("host-b", "127.0.0.3");
    let g = gce.clone();
    notice_on_host_a(
        &a,
        &b,
        Rdzv::Etcd(&etcd),
        "t-notice-gce-hosts",
        move |la| {
            // host-a's agent holds its long-polls (preempted and
            // maintenance-event) before the server changes its answer.
            let until = Instant::now() + WAIT;
            while g.waiting() < 2 {
                assert!(Instant::now() < until, "no long-polls: {}", la.stderr());
                std::thread::yield_now();
            }
            g.set("instance/preempted", Some("TRUE"));
        },
        || gce.set("instance/preempted", Some("FALSE")),
    );
    let a1 = std::fs::read_to_string(a.path().join("launcher-1.stderr")).unwrap();
    assert!(
        a1.contains("notice from gce: instance/preempted = TRUE"),
        "host-a's launcher heard of its agent's notice: {a1}"
    );
    // It heard before any rank left (no rank's exit started it).
    assert!(!a1.contains("saved on a notice and left"), "{a1}");
    for line in a1
        .lines()
        .filter(|l| l.contains("[warden]") && l.contains("notice"))
    {
        println!("host-a: {line}");
    }
}

/// The same job met through torch's c10d rendezvous, with no etcd: the
/// notice's step goes through torch's store at the endpoint.
#[test]
fn a_notice_spreads_through_torchs_c10d_store_too() {
    let (a, b) = Host::peered();
    let port = common::free_port_below_ephemeral("127.0.0.2");
    notice_on_host_a(
        &a,
        &b,
        Rdzv::C10d(port),
        "t-notice-c10d",
        |la| la.signal(Signal::SIGTERM),
        || {},
    );
}

/// Both hosts run `job`; host-a alone gets the notice (`notify`: the
/// scheduler's SIGTERM, or its agent's source); every rank saves one step,
/// both exit 85, and the next run (after `requeue`: the notice over)
/// resumes after it.
fn notice_on_host_a(
    a: &Host,
    b: &Host,
    rdzv: Rdzv<'_>,
    job: &str,
    notify: impl FnOnce(&Streaming),
    requeue: impl FnOnce(),
) {
    let mut la = a.launch(rdzv, job, 1, &[]);
    let mut lb = b.launch(rdzv, job, 1, &[]);
    for l in [&mut la, &mut lb] {
        for s in both(l, "start step=") {
            assert_eq!(value(&s, "step"), Some(0), "{s}");
            assert!(s.contains("world=4"), "{s}");
        }
    }
    both(&mut la, "saved step=100 ");
    // Step 100 has a copy of every rank on both hosts (each host's agent
    // replicated its ranks' shards to the other's): replication is at
    // work, so the notice's save must leave the host too before the exit.
    for h in [a, b] {
        h.wait_for_step(job, 100, 4);
    }
    la.wait_line(WAIT, "step 110", |x| x.contains("] step 110"));

    // The notice reaches host-a alone.
    let noticed_at = Instant::now();
    notify(&la);
    let mut steps = Vec::new();
    for l in [&mut la, &mut lb] {
        for s in both(l, "saved on notice step=") {
            steps.push(value(&s, "step").unwrap());
        }
    }
    assert!(
        steps.iter().all(|s| *s == steps[0]),
        "every rank of both hosts saves the same step: {steps:?}"
    );
    let step = steps[0];
    assert!(
        step > 110 && step < 200,
        "the notice's step {step} is between the checkpoints"
    );
    for l in [&mut la, &mut lb] {
        let status = l.wait_exit(WAIT);
        assert_eq!(status.code(), Some(85), "{}: {}", l.label, l.stderr());
    }
    let took = noticed_at.elapsed();
    assert!(
        took < TERM_GRACE,
        "the job stopped {took:?} after the notice: past the window"
    );
    println!(
        "notice on host-a to both launchers' exit in {} ms (saved step {step})",
        took.as_millis()
    );
    assert!(
        la.stderr().contains(&format!(
            "told the job's other hosts of the notice: every rank saves at step {step}"
        )),
        "{}",
        la.stderr()
    );
    // etcd names a host by its id, torch's rendezvous by its address.
    assert!(
        [a.id, a.addr]
            .iter()
            .any(|h| lb.stderr().contains(&format!("host {h} got a notice"))),
        "{}",
        lb.stderr()
    );
    for h in [a, b] {
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(h.path().join("summary-1.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["exit_code"], 85, "{}: {summary:#}", h.id);
        assert!(
            summary["outcome"]
                .as_str()
                .unwrap()
                .starts_with("preempted: every worker saved"),
            "{}: {summary:#}",
            h.id
        );
        // The notice's save left the host before the launcher exited: a
        // copy of each of its ranks' shards is on the other host.
        assert_eq!(
            summary["notice_checkpoint"]["step"], step,
            "{}: {summary:#}",
            h.id
        );
        assert_eq!(
            summary["notice_checkpoint"]["off_host"], true,
            "{}: {summary:#}",
            h.id
        );
    }

    // The requeued job: both hosts resume at the step after the notice's
    // (the notice standing in etcd is the last run's: not acted on).
    requeue();
    let end = (step + 20).to_string();
    let mut la = a.launch(rdzv, job, 2, &["--steps", &end]);
    let mut lb = b.launch(rdzv, job, 2, &["--steps", &end]);
    for l in [&mut la, &mut lb] {
        for s in both(l, "start step=") {
            assert_eq!(
                value(&s, "step"),
                Some(step + 1),
                "resumed after the notice's step {step}: {s}"
            );
        }
    }
    for l in [&mut la, &mut lb] {
        both(l, "done");
        assert_eq!(
            l.wait_exit(WAIT).code(),
            Some(0),
            "{}: {}",
            l.label,
            l.stderr()
        );
    }
}

/// A coordinator of `job` for `host` at `addr` (2 hosts, 2 workers each).
async fn coordinator(etcd: &EtcdServer, job: &str, host: &str, addr: &str) -> EtcdCoordinator {
    coordinator_of(etcd, job, host, addr, 2).await
}

/// A coordinator of `job` for `host` at `addr`: `nodes` hosts, 2 workers
/// each; its rendezvous waits up to [`WAIT`] for a round.
async fn coordinator_of(
    etcd: &EtcdServer,
    job: &str,
    host: &str,
    addr: &str,
    nodes: u32,
) -> EtcdCoordinator {
    let mut c = CoordConfig::new(etcd.endpoints(), job, host, addr);
    c.nproc_per_node = 2;
    c.min_nodes = nodes;
    c.max_nodes = nodes;
    c.lease_ttl = Duration::from_secs(3);
    c.last_call = Duration::from_millis(300);
    let cap = CordonCap {
        max_share: 1.0,
        window: Duration::from_secs(3600),
    };
    tokio::time::timeout(WAIT, EtcdCoordinator::join(c, WAIT, cap))
        .await
        .expect("joined in time")
        .unwrap_or_else(|e| panic!("{host} could not join: {e}"))
}

fn proposed() -> AttemptPlan {
    AttemptPlan {
        restart_count: 0,
        master_addr: "127.0.0.2".into(),
        master_port: 29500,
        node_rank: Some(0),
        nnodes: 2,
        world_size: 4,
        rank_offset: 0,
        epoch: None,
        round: None,
        ckpt_peers: Default::default(),
        keeps_place: false,
    }
}

/// Both hosts' next round, as each agrees on it.
async fn both_agree(a: &mut EtcdCoordinator, b: &mut EtcdCoordinator) -> u64 {
    let (pa, pb) = tokio::time::timeout(WAIT, async {
        tokio::join!(a.rendezvous(proposed()), b.rendezvous(proposed()))
    })
    .await
    .expect("a round in time");
    let (pa, pb) = (pa.expect("host-a's round"), pb.expect("host-b's round"));
    assert_eq!(pa.epoch, pb.epoch);
    pa.epoch.expect("an epoch")
}

/// A host between rounds when another host publishes a notice in the
/// round it left: its rendezvous ends with 85 (no workers start in a round
/// the others are leaving); a host whose next round was agreed first has
/// its workers stopped with 85 instead. A restart with no notice
/// meanwhile agrees as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_between_rounds_stops_on_the_notice_written_meanwhile() {
    let etcd = EtcdServer::start();
    let job = "t-notice-between";
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let mut b = coordinator(&etcd, job, "host-b", "127.0.0.3").await;
    let first = both_agree(&mut a, &mut b).await;
    let restart = Directive::RestartInJob {
        reason: "rank 1 failed".into(),
        heal: false,
    };
    let deadline = std::time::SystemTime::now() + Duration::from_secs(40);
    let reason = "notice from gce: instance/preempted = TRUE";

    // A restart with no notice: the next round, as ever.
    a.publish(&restart).await.expect("restart published");
    let second = both_agree(&mut a, &mut b).await;
    assert!(second > first, "{second} after {first}");

    // host-b, in round `second`, publishes a notice; host-a, between
    // rounds (its restart asked for, its machine listening to nothing
    // but the rendezvous' answer), then meets the next round.
    let agreed = b
        .publish_notice(151, deadline, reason)
        .await
        .expect("notice published");
    assert_eq!(agreed, 151, "host-b's notice is the round's first");
    a.publish(&restart).await.expect("restart published");
    let err = tokio::time::timeout(WAIT, a.rendezvous(proposed()))
        .await
        .expect("host-a's rendezvous ends")
        .expect_err("host-a starts no workers on a notice the others leave on");
    assert_eq!(err.exit_code, 85, "{err}");
    assert!(
        err.message.contains("host host-b got a notice")
            && err.message.contains("saves at step 151")
            && err.message.contains(&format!("in round {second}")),
        "{err}"
    );

    // A second job: host-a's next round is agreed before host-b publishes
    // a notice in the round host-a left: host-a's workers are stopped, 85.
    drop((a, b));
    let job = "t-notice-between-2";
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let mut b = coordinator(&etcd, job, "host-b", "127.0.0.3").await;
    let first = both_agree(&mut a, &mut b).await;
    a.publish(&restart).await.expect("restart published");
    let plan = tokio::time::timeout(WAIT, a.rendezvous(proposed()))
        .await
        .expect("host-a's rendezvous ends")
        .expect("no notice yet: host-a's next round");
    assert!(plan.epoch > Some(first), "{plan:?}");
    b.publish_notice(97, deadline, reason)
        .await
        .expect("notice published");
    match tokio::time::timeout(WAIT, a.next_remote()).await {
        Ok(Remote::Stop { exit_code, reason }) => {
            assert_eq!(exit_code, 85, "{reason}");
            assert!(
                reason.contains("host host-b got a notice") && reason.contains("saves at step 97"),
                "{reason}"
            );
        }
        other => panic!("host-a's workers must stop on the notice: {other:?}"),
    }
}

/// Far less than a rendezvous' own wait for a round ([`WAIT`]): an answer
/// within it is the notice's, not the round timeout's.
const PROMPT: Duration = Duration::from_secs(60);

/// A host's launcher leaving on 85, as the machine makes it after a
/// notice.
async fn leave_on_notice(c: &mut EtcdCoordinator) {
    c.publish(&Directive::Stop {
        exit_code: 85,
        reason: "a notice".into(),
        job_failed: false,
    })
    .await
    .expect("left the job");
}

/// A launcher that joins while the job stops on a notice (a late host, or
/// one restarted on a host of the job) exits 85 at its first rendezvous,
/// where it waited for a round until its timeout; once every launcher of
/// that run is gone, the next run's launchers (well within the notice's
/// deadline) form their round as ever; and past the deadline a launcher
/// left over from that run does not hold the notice up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_that_joins_during_the_stop_exits_85_and_the_next_run_does_not() {
    let etcd = EtcdServer::start();
    let job = "t-notice-join";
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let mut b = coordinator(&etcd, job, "host-b", "127.0.0.3").await;
    let first = both_agree(&mut a, &mut b).await;
    let deadline = std::time::SystemTime::now() + Duration::from_secs(600);
    let reason = "notice from gce: instance/preempted = TRUE";
    b.publish_notice(151, deadline, reason)
        .await
        .expect("notice published");

    // A late host joins while host-a and host-b save and leave.
    let mut c = coordinator(&etcd, job, "host-c", "127.0.0.4").await;
    let asked = Instant::now();
    let err = tokio::time::timeout(PROMPT, c.rendezvous(proposed()))
        .await
        .expect("host-c's rendezvous ends at once, not at its round timeout")
        .expect_err("host-c starts no workers in a job stopping on a notice");
    println!(
        "a joiner during the stop: 85 after {} ms",
        asked.elapsed().as_millis()
    );
    assert_eq!(err.exit_code, 85, "{err}");
    assert!(
        err.message.contains("host host-b got a notice")
            && err.message.contains(&format!("in round {first}"))
            && err
                .message
                .contains("was stopping on it when this launcher joined")
            && err.message.contains("saves at step 151"),
        "{err}"
    );
    leave_on_notice(&mut c).await;

    // host-a's launcher dies and a new one joins on its host id (after
    // the old lease), while host-b still saves: 85 too.
    drop(a);
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let err = tokio::time::timeout(PROMPT, a.rendezvous(proposed()))
        .await
        .expect("the restarted host-a's rendezvous ends at once")
        .expect_err("the restarted host-a starts no workers");
    assert_eq!(err.exit_code, 85, "{err}");
    assert!(err.message.contains("saves at step 151"), "{err}");

    // Every launcher of that run leaves; the requeued job's launchers join
    // within the notice's deadline and form their round.
    leave_on_notice(&mut a).await;
    leave_on_notice(&mut b).await;
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let mut b = coordinator(&etcd, job, "host-b", "127.0.0.3").await;
    let next = both_agree(&mut a, &mut b).await;
    assert!(next > first, "the next run's round {next} after {first}");
    assert!(
        std::time::SystemTime::now() < deadline,
        "the next run joined within the notice's deadline"
    );

    // Past its deadline, a notice does not stop a joiner though a
    // launcher of its run is still in the job.
    drop((a, b));
    let job = "t-notice-join-past";
    let mut a = coordinator(&etcd, job, "host-a", "127.0.0.2").await;
    let mut b = coordinator(&etcd, job, "host-b", "127.0.0.3").await;
    both_agree(&mut a, &mut b).await;
    let past = std::time::SystemTime::now() - Duration::from_secs(1);
    b.publish_notice(97, past, reason)
        .await
        .expect("notice published");
    let mut c = coordinator(&etcd, job, "host-c", "127.0.0.4").await;
    let plan = tokio::time::timeout(PROMPT, c.rendezvous(proposed()))
        .await
        .expect("host-c's rendezvous ends")
        .expect("a notice past its deadline is a previous run's");
    assert_eq!(plan.node_rank, None, "host-c stands by: {plan:?}");
}

/// A host waiting for a round that may never come (a host of the job was
/// lost, too few are left) when another host publishes a notice: its
/// rendezvous ends with 85 at once, not at its round timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_waiting_for_a_round_stops_on_a_notice() {
    let etcd = EtcdServer::start();
    let job = "t-notice-waiting";
    let mut a = coordinator_of(&etcd, job, "host-a", "127.0.0.2", 3).await;
    let mut b = coordinator_of(&etcd, job, "host-b", "127.0.0.3", 3).await;
    let mut c = coordinator_of(&etcd, job, "host-c", "127.0.0.4", 3).await;
    let (pa, pb, pc) = tokio::time::timeout(WAIT, async {
        tokio::join!(
            a.rendezvous(proposed()),
            b.rendezvous(proposed()),
            c.rendezvous(proposed())
        )
    })
    .await
    .expect("a round in time");
    let first = pa.expect("host-a's round").epoch;
    assert_eq!(first, pb.expect("host-b's round").epoch);
    assert_eq!(first, pc.expect("host-c's round").epoch);

    // host-c is cordoned: two hosts are too few for a round.
    c.publish(&Directive::Stop {
        exit_code: 86,
        reason: "a bad GPU".into(),
        job_failed: false,
    })
    .await
    .expect("host-c left");
    match tokio::time::timeout(WAIT, a.next_remote()).await {
        Ok(Remote::NewRound { .. }) => {}
        other => panic!("host-a sees host-c gone: {other:?}"),
    }
    let waiting = tokio::spawn(async move {
        let asked = Instant::now();
        let r = tokio::time::timeout(PROMPT, a.rendezvous(proposed())).await;
        (r, asked.elapsed())
    });
    // host-b, its workers still in the first round, gets a notice.
    b.publish_notice(
        120,
        std::time::SystemTime::now() + Duration::from_secs(40),
        "SIGTERM",
    )
    .await
    .expect("notice published");
    let (r, took) = waiting.await.expect("host-a's task");
    let err = r
        .expect("host-a's rendezvous ends at once, not at its round timeout")
        .expect_err("host-a waits no longer for a round");
    println!(
        "a host waiting for a round: 85 after {} ms",
        took.as_millis()
    );
    assert_eq!(err.exit_code, 85, "{err}");
    assert!(
        err.message.contains("host host-b got a notice")
            && err.message.contains("between rounds")
            && err.message.contains("saves at step 120"),
        "{err}"
    );
}

/// A c10d coordinator of `job` for the host at `addr`: 2 hosts, the store
/// at host-a's address on `port` (hosted by host-a's helper).
fn c10d(dir: &Path, job: &str, addr: &str, port: u16, console: &Console) -> C10dCoordinator {
    let cfg = C10dConfig {
        endpoint: format!("127.0.0.2:{port}"),
        run_id: job.to_owned(),
        min_nodes: 2,
        max_nodes: 2,
        nproc_per_node: 2,
        local_addr: Some(addr.to_owned()),
        is_host: Some(addr == "127.0.0.2"),
        join_timeout: WAIT,
        torch: vec![
            ("join_timeout".into(), WAIT.as_secs()),
            ("last_call_timeout".into(), 1),
            ("keep_alive_interval".into(), 2),
            ("keep_alive_max_attempt".into(), 3),
        ],
        ignored: Vec::new(),
        python: python().display().to_string(),
    };
    C10dCoordinator::start(
        cfg,
        &dir.join(format!("rendezvous-{addr}.log")),
        dir,
        console.clone(),
    )
    .unwrap_or_else(|e| panic!("the helper of {addr}: {e}"))
}

/// Under torch's c10d rendezvous: host-a asks for a restart (torch puts it
/// on the wait list for the next round) and host-b, its workers in the
/// round host-a left, publishes a notice. host-a's join would wait for a
/// round nobody will make until torch's join timeout; it ends with 85 at
/// once, as under etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c10d_host_between_rounds_stops_on_the_notice_written_meanwhile() {
    let dir = tempfile::Builder::new()
        .prefix("warden-noticec10d-")
        .tempdir()
        .unwrap();
    let (console, _printer) = Console::start(false);
    let port = common::free_port_below_ephemeral("127.0.0.2");
    let job = "t-notice-c10d-between";
    let mut a = c10d(dir.path(), job, "127.0.0.2", port, &console);
    let mut b = c10d(dir.path(), job, "127.0.0.3", port, &console);
    let (pa, pb) = tokio::time::timeout(WAIT, async {
        tokio::join!(a.rendezvous(proposed()), b.rendezvous(proposed()))
    })
    .await
    .expect("a round in time");
    let (pa, pb) = (pa.expect("host-a's round"), pb.expect("host-b's round"));
    assert_eq!(pa.epoch, pb.epoch, "one round: {pa:?} {pb:?}");
    assert_eq!((pa.nnodes, pa.world_size), (2, 4), "{pa:?}");

    a.publish(&Directive::RestartInJob {
        reason: "rank 1 failed".into(),
        heal: false,
    })
    .await
    .expect("host-a joins the next round");
    let deadline = std::time::SystemTime::now() + Duration::from_secs(40);
    let agreed = b
        .publish_notice(151, deadline, "notice from gce: instance/preempted = TRUE")
        .await
        .expect("notice written into torch's store");
    assert_eq!(agreed, 151);
    let asked = Instant::now();
    let err = tokio::time::timeout(PROMPT, a.rendezvous(proposed()))
        .await
        .expect("host-a's join ends on the notice, not at torch's join timeout")
        .expect_err("host-a starts no workers on a notice the others leave on");
    println!(
        "c10d: a host between rounds: 85 after {} ms",
        asked.elapsed().as_millis()
    );
    assert_eq!(err.exit_code, 85, "{err}");
    let round = pb.epoch.expect("torch's round");
    assert!(
        err.message.contains("host 127.0.0.3 got a notice")
            && err
                .message
                .contains(&format!("in round {round} of torch's c10d rendezvous"))
            && err.message.contains("between rounds")
            && err.message.contains("saves at step 151"),
        "{err}"
    );
    // A launcher that joins afresh while the job stops (torch's store is
    // this run's: it lives with host-a's launcher) is between rounds too.
    let mut c = c10d(dir.path(), job, "127.0.0.4", port, &console);
    let err = tokio::time::timeout(PROMPT, c.rendezvous(proposed()))
        .await
        .expect("host-c's join ends on the notice, not at torch's join timeout")
        .expect_err("host-c starts no workers in a job stopping on a notice");
    assert_eq!(err.exit_code, 85, "{err}");
    assert!(err.message.contains("saves at step 151"), "{err}");
}
