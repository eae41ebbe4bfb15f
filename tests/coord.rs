//! Multi-host coordination through a real etcd: three coordinators in one
//! process act as three hosts' launchers (host-a/b/c, advertising
//! 127.0.0.1/2/3), each test with its own etcd server.
//!
//! What is shown: one round for all at start; one round per failure when
//! two hosts report it at once; a host whose launcher dies is out after one
//! lease TTL (scale down) and back when it returns (scale up); a spare takes
//! a cordoned member's node rank (hot-swap); too few hosts is a waiting
//! round and a clear error; losing etcd is this host's lease lost; a job
//! that finishes or fails on one host is not restarted around it.

mod common;

use std::time::{Duration, Instant};

use common::etcd::EtcdServer;
use common::within;
use warden_agent::coord::{CoordConfig, CoordError, Coordinator, Leave, Outcome, Round};

/// Every wait in these tests; rounds come in milliseconds, lease expiry in
/// about a TTL (1 s) plus etcd's 500 ms expiry sweep.
const WAIT: Duration = Duration::from_secs(15);
const TTL: Duration = Duration::from_secs(1);

fn cfg(etcd: &EtcdServer, job: &str, host: &str, addr: &str, min: u32, max: u32) -> CoordConfig {
    let mut c = CoordConfig::new(etcd.endpoints(), job, host, addr);
    c.nproc_per_node = 2;
    c.min_nodes = min;
    c.max_nodes = max;
    c.lease_ttl = TTL;
    c.last_call = Duration::from_millis(300);
    c.join_timeout = Duration::from_secs(1);
    c
}

async fn join(c: CoordConfig) -> Coordinator {
    let host = c.host.clone();
    within(WAIT, "join", Coordinator::join(c))
        .await
        .unwrap_or_else(|e| panic!("{host} could not join: {e}"))
}

/// The first round after `after` that is not waiting, as `who` sees it.
async fn round(who: &Coordinator, after: u64) -> Round {
    who.wait_for_round(after, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{}: no round after {after}: {e}", who.host()))
}

/// Three hosts, min 2, max 3; the last call long enough that the round
/// forms once with all three even on a slow machine.
async fn three(etcd: &EtcdServer, job: &str) -> [Coordinator; 3] {
    let mk = |host: &str, addr: &str| {
        let mut c = cfg(etcd, job, host, addr, 2, 3);
        c.last_call = Duration::from_secs(3);
        c
    };
    let a = join(mk("host-a", "127.0.0.1")).await;
    let b = join(mk("host-b", "127.0.0.2")).await;
    let c = join(mk("host-c", "127.0.0.3")).await;
    [a, b, c]
}

fn ranks(rounds: &[&Round]) -> Vec<Option<u32>> {
    rounds.iter().map(|r| r.node_rank).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hosts_form_one_round() {
    let etcd = EtcdServer::start();
    let hosts = three(&etcd, "job-form").await;
    let [ra, rb, rc] = [
        round(&hosts[0], 0).await,
        round(&hosts[1], 0).await,
        round(&hosts[2], 0).await,
    ];
    for r in [&ra, &rb, &rc] {
        assert_eq!(r.epoch, 1, "{r:?}");
        assert_eq!(r.members, ["host-a", "host-b", "host-c"], "{r:?}");
        assert_eq!((r.nnodes, r.world_size), (3, 6));
        assert_eq!(
            (r.master_addr.as_str(), r.master_port),
            ("127.0.0.1", 29501)
        );
        assert!(r.runs_workers());
    }
    assert_eq!(ranks(&[&ra, &rb, &rc]), [Some(0), Some(1), Some(2)]);
    assert_eq!((rc.rank_offset, rc.local_world_size), (4, 2));
    let env = rc.worker_env(1).expect("host-c has a place");
    let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("RANK"), Some("5"));
    assert_eq!(get("GROUP_RANK"), Some("2"));
    assert_eq!(get("WORLD_SIZE"), Some("6"));
    assert_eq!(get("MASTER_PORT"), Some("29501"));
    // The record itself is in etcd, where every launcher read it.
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .expect("connect to etcd");
    let stored = client
        .get("/warden/jobs/job-form/rounds/00000000000000000001", None)
        .await
        .expect("read the round");
    let record: serde_json::Value =
        serde_json::from_slice(stored.kvs()[0].value()).expect("a JSON round record");
    assert_eq!(record["nnodes"], 3);
    assert_eq!(record["master_port"], 29501);
    // And it stays one round: nothing else is due.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for h in &hosts {
        assert_eq!(h.state().round.map(|r| r.epoch), Some(1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_restart_requests_make_one_round() {
    let etcd = EtcdServer::start();
    let [a, b, c] = three(&etcd, "job-restart").await;
    for h in [&a, &b, &c] {
        assert_eq!(round(h, 0).await.epoch, 1);
    }
    let (ea, eb) = within(WAIT, "two restart requests", async {
        tokio::join!(
            a.request_restart(1, "worker 3 exited 1"),
            b.request_restart(1, "NCCL timeout")
        )
    })
    .await;
    assert_eq!((ea.expect("a's request"), eb.expect("b's request")), (2, 2));
    // A late report of the same failure changes nothing.
    assert_eq!(c.request_restart(1, "late").await.expect("c's request"), 2);
    for h in [&a, &b, &c] {
        let r = within(WAIT, "round 2", h.next_round(1))
            .await
            .expect("round 2");
        assert_eq!(r.epoch, 2);
        assert_eq!(r.members, ["host-a", "host-b", "host-c"]);
        assert_eq!(r.master_port, 29502, "a new port each round");
        assert!(
            r.reason.starts_with("restart requested by host-"),
            "{}",
            r.reason
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for h in [&a, &b, &c] {
        assert_eq!(
            h.state().round.map(|r| r.epoch),
            Some(2),
            "exactly one advance"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_host_scales_the_job_down_and_its_return_scales_it_up() {
    let etcd = EtcdServer::start();
    let [a, b, c] = three(&etcd, "job-elastic").await;
    for h in [&a, &b, &c] {
        assert_eq!(round(h, 0).await.nnodes, 3);
    }
    // host-c's launcher dies: its lease is no longer kept alive.
    let killed = Instant::now();
    drop(c);
    let (ra, rb) = (round(&a, 1).await, round(&b, 1).await);
    let took = killed.elapsed();
    for r in [&ra, &rb] {
        assert_eq!(r.epoch, 2);
        assert_eq!(r.members, ["host-a", "host-b"]);
        assert_eq!((r.nnodes, r.world_size), (2, 4), "the new world size");
        assert_eq!(r.reason, "host-c lost");
    }
    assert_eq!(ranks(&[&ra, &rb]), [Some(0), Some(1)]);
    assert!(
        took < TTL + Duration::from_secs(3),
        "scale down took {took:?}"
    );
    println!("scale down seen {took:?} after the launcher died (lease TTL {TTL:?})");

    // It comes back (a new launcher, a new lease): the round grows at once.
    let c = join(cfg(&etcd, "job-elastic", "host-c", "127.0.0.3", 2, 3)).await;
    let rounds = [round(&a, 2).await, round(&b, 2).await, round(&c, 2).await];
    for r in &rounds {
        assert_eq!(r.epoch, 3);
        assert_eq!(r.members, ["host-a", "host-b", "host-c"]);
        assert_eq!(r.world_size, 6);
        assert_eq!(r.reason, "scale up: host-c joined");
    }
    assert_eq!(
        ranks(&rounds.iter().collect::<Vec<_>>()),
        [Some(0), Some(1), Some(2)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spare_takes_a_cordoned_hosts_rank() {
    let etcd = EtcdServer::start();
    let job = "job-spare";
    let a = join(cfg(&etcd, job, "host-a", "127.0.0.1", 2, 2)).await;
    let b = join(cfg(&etcd, job, "host-b", "127.0.0.2", 2, 2)).await;
    let mut spare = cfg(&etcd, job, "host-s", "127.0.0.3", 2, 2);
    spare.spare = true;
    let s = join(spare).await;
    let (ra, rb, rs) = (round(&a, 0).await, round(&b, 0).await, round(&s, 0).await);
    assert_eq!(
        ra.members,
        ["host-a", "host-b"],
        "regular hosts before the spare"
    );
    assert_eq!(ranks(&[&ra, &rb, &rs]), [Some(0), Some(1), None]);
    assert_eq!(rs.standby, ["host-s"]);
    assert!(!rs.runs_workers());
    let epoch = ra.epoch;

    within(
        WAIT,
        "leave",
        b.leave(Leave::Cordoned("xid 79 on GPU 3".into())),
    )
    .await
    .expect("host-b leaves");
    let (ra, rs) = (round(&a, epoch).await, round(&s, epoch).await);
    for r in [&ra, &rs] {
        assert_eq!(r.epoch, epoch + 1);
        assert_eq!(r.members, ["host-a", "host-s"], "host-s in host-b's place");
        assert_eq!(r.world_size, 4, "hot-swap keeps the world size");
        assert_eq!(r.reason, "host-b left (cordoned: xid 79 on GPU 3)");
    }
    assert_eq!(ranks(&[&ra, &rs]), [Some(0), Some(1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_few_hosts_wait_with_a_clear_error() {
    let etcd = EtcdServer::start();
    let job = "job-min";
    let a = join(cfg(&etcd, job, "host-a", "127.0.0.1", 2, 3)).await;
    match a.wait_for_round(0, Duration::from_secs(1)).await {
        Err(CoordError::NotEnoughNodes {
            live: 1,
            min_nodes: 2,
            ..
        }) => {}
        other => panic!("expected NotEnoughNodes, got {other:?}"),
    }
    let b = join(cfg(&etcd, job, "host-b", "127.0.0.2", 2, 3)).await;
    // Two of three: the round forms after the last call.
    let r1 = round(&a, 0).await;
    assert_eq!(r1.members, ["host-a", "host-b"]);

    within(WAIT, "leave", b.leave(Leave::Stopped("SIGTERM".into())))
        .await
        .expect("host-b leaves");
    // Below the minimum: a waiting round stops everybody's workers...
    let waiting = within(WAIT, "a waiting round", a.next_round(r1.epoch))
        .await
        .expect("a new epoch");
    assert!(waiting.waiting && !waiting.runs_workers(), "{waiting:?}");
    assert_eq!(waiting.reason, "host-b left (stopped: SIGTERM)");
    // ...and the wait for a runnable round ends in a clear error.
    let err = a
        .wait_for_round(waiting.epoch, Duration::from_secs(1))
        .await
        .expect_err("no round with one host");
    let text = err.to_string();
    assert!(
        text.contains("1 host(s) alive (host-a), 2 needed"),
        "unclear error: {text}"
    );
    // host-b back: the job runs again.
    let b = join(cfg(&etcd, job, "host-b", "127.0.0.2", 2, 3)).await;
    let r = round(&a, waiting.epoch).await;
    assert_eq!(r.members, ["host-a", "host-b"]);
    assert_eq!(round(&b, waiting.epoch).await.node_rank, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_etcd_is_losing_the_lease() {
    let mut etcd = EtcdServer::start();
    let job = "job-outage";
    let a = join(cfg(&etcd, job, "host-a", "127.0.0.1", 1, 1)).await;
    let r = round(&a, 0).await;
    let gone = Instant::now();
    etcd.kill();
    match within(WAIT, "the lease lost", a.next_round(r.epoch)).await {
        Err(CoordError::LeaseLost { host, .. }) => assert_eq!(host, "host-a"),
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    let took = gone.elapsed();
    assert!(
        took <= TTL + Duration::from_secs(1),
        "noticed after {took:?}"
    );
    assert!(a.request_restart(r.epoch, "x").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_id_held_by_a_live_launcher_is_refused() {
    let etcd = EtcdServer::start();
    let job = "job-dup";
    let _a = join(cfg(&etcd, job, "host-a", "127.0.0.1", 1, 2)).await;
    let started = Instant::now();
    match Coordinator::join(cfg(&etcd, job, "host-a", "127.0.0.9", 1, 2)).await {
        Err(CoordError::HostTaken { holder_addr, .. }) => assert_eq!(holder_addr, "127.0.0.1"),
        other => panic!("expected HostTaken, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_host_does_not_restart_the_others() {
    let etcd = EtcdServer::start();
    let job = "job-done";
    let mk = |host: &str, addr: &str| {
        let mut c = cfg(&etcd, job, host, addr, 1, 2);
        c.last_call = Duration::from_secs(3);
        c
    };
    let a = join(mk("host-a", "127.0.0.1")).await;
    let b = join(mk("host-b", "127.0.0.2")).await;
    let r = round(&b, 0).await;
    assert_eq!(r.nnodes, 2);
    assert_eq!(round(&a, 0).await.epoch, r.epoch);
    within(WAIT, "leave", a.leave(Leave::Finished))
        .await
        .expect("host-a leaves");
    match within(WAIT, "the end", b.next_round(r.epoch)).await {
        Err(CoordError::Ended { by, outcome, .. }) => {
            assert_eq!((by.as_str(), outcome), ("host-a", Outcome::Finished));
        }
        other => panic!("expected the job's end, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        b.state().round.map(|r| r.epoch),
        Some(r.epoch),
        "no new round"
    );
    within(WAIT, "leave", b.leave(Leave::Finished))
        .await
        .expect("host-b leaves");

    // The same job id run again: the old end marker does not end it.
    let a = join(mk("host-a", "127.0.0.1")).await;
    let b = join(mk("host-b", "127.0.0.2")).await;
    // (host-a alone may get a round first, min being 1.)
    let mut again = round(&a, r.epoch).await;
    while again.nnodes < 2 {
        again = round(&a, again.epoch).await;
    }
    assert_eq!(again.members, ["host-a", "host-b"], "{again:?}");
    let rb = b
        .wait_for_round(again.epoch - 1, WAIT)
        .await
        .expect("host-b's round");
    assert_eq!((rb.epoch, rb.node_rank), (again.epoch, Some(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_named_in_the_error() {
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut c = CoordConfig::new(
        vec![format!("127.0.0.1:{port}")],
        "job-x",
        "host-a",
        "127.0.0.1",
    );
    c.request_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = within(WAIT, "join to fail", Coordinator::join(c))
        .await
        .expect_err("nothing to join");
    let text = err.to_string();
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    // The first read of the job's keys finds it, before any lease.
    assert!(text.contains("nothing listens"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    println!("{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_stops_every_host_with_its_exit_code() {
    let etcd = EtcdServer::start();
    let mk = |host: &str, addr: &str| {
        let mut c = cfg(&etcd, "job-fail", host, addr, 1, 2);
        c.last_call = Duration::from_secs(3);
        c
    };
    let a = join(mk("host-a", "127.0.0.1")).await;
    let b = join(mk("host-b", "127.0.0.2")).await;
    let r = round(&b, 0).await;
    assert_eq!(round(&a, 0).await.epoch, r.epoch);
    let failed = Leave::Failed {
        reason: "rank 3: CUDA out of memory".into(),
        exit_code: 1,
    };
    within(WAIT, "leave", a.leave(failed))
        .await
        .expect("host-a leaves");
    match within(WAIT, "the end", b.next_round(r.epoch)).await {
        Err(CoordError::Ended {
            outcome, exit_code, ..
        }) => assert_eq!((outcome, exit_code), (Outcome::Failed, Some(1))),
        other => panic!("expected the job's end, got {other:?}"),
    }
}
