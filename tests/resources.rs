//! System tests of the agent's bounds on what callers make it hold: the
//! real `wardend` over its real Unix socket.
//!
//! - Goodput journals: 1,000 jobs registered, deregistered and closed
//!   through the API leave the agent's descriptor count flat (issue 22: one
//!   descriptor stayed open per job id until `nofile` ran out).
//! - Streams: WatchEvents up to `api.max_streams_per_uid` open, the next
//!   refused with RESOURCE_EXHAUSTED naming the key; closed, their places
//!   come back and the agent answers as before.
//! - Rank processes: 200 real processes registered and killed leave no
//!   pidfd behind (each exited rank's entry held one).
//! - Ranks per process: one process cannot take more than
//!   `ranks.max_per_process` of the `max_ranks` slots.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{TestAgent, eventually, within};
use warden_proto::v1 as pb;

/// A call on a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(30);

/// What `pid`'s descriptors point at, counted by kind (for a failure's
/// message).
fn fd_kinds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(e.path())
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        let kind = target.split(':').next().unwrap_or("").to_owned();
        let kind = if kind.starts_with('/') {
            target
                .rsplit_once('/')
                .map_or(target.clone(), |(d, _)| d.to_owned())
        } else {
            kind
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

/// Descriptors `pid` holds now.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read the agent's /proc/PID/fd")
        .count()
}

fn register(job: &str) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: 0,
        local_rank: 0,
        world_size: 1,
        pid: std::process::id(),
        host: "test".to_owned(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        devices: Vec::new(),
    }
}

/// One job's life through the API: a rank registers, deregisters, and the
/// launcher closes the job's goodput.
async fn one_job(agent: &TestAgent, job: &str) {
    let mut c = agent.client().await;
    let reg = within(WAIT, "RegisterRank", c.register_rank(register(job)))
        .await
        .unwrap_or_else(|s| panic!("RegisterRank {job}: {s:?}"))
        .into_inner();
    let dereg = pb::DeregisterRankRequest {
        job_id: job.to_owned(),
        global_rank: 0,
        generation: reg.generation,
    };
    within(WAIT, "DeregisterRank", c.deregister_rank(dereg))
        .await
        .unwrap_or_else(|s| panic!("DeregisterRank {job}: {s:?}"));
    // The ledger takes the registration from the event bus: a launcher
    // closes a job its ranks ran in, so wait until the ledger has it.
    eventually(WAIT, "the job in the goodput ledger", || {
        let mut c = c.clone();
        async move {
            let req = pb::GetGoodputRequest {
                job_id: job.to_owned(),
            };
            c.get_goodput(req).await.ok()
        }
    })
    .await;
    let close = pb::CloseGoodputRequest {
        job_id: job.to_owned(),
    };
    within(WAIT, "CloseGoodput", c.close_goodput(close))
        .await
        .unwrap_or_else(|s| panic!("CloseGoodput {job}: {s:?}"));
}

#[tokio::test]
async fn a_thousand_jobs_leave_the_descriptor_count_flat() {
    // Every ended job kept (the default prunes past 256 of them:
    // tests/security/gates.rs): the journals' names are what is checked.
    let agent = TestAgent::start("[goodput]\nmax_ended_jobs = 2048\n");
    let pid = agent.pid();
    // Warm up: the first jobs open what stays open anyway (the goodput
    // directory, the owners file's directory, connection pools).
    for i in 0..10 {
        one_job(&agent, &format!("warm-{i}")).await;
    }
    let base = fds(pid);
    let mut most = base;
    for i in 0..1_000 {
        // Ids that the older naming mapped to one file ("a/1" and "a_1").
        let job = if i % 2 == 0 {
            format!("fd/{i}")
        } else {
            format!("fd_{}", i - 1)
        };
        one_job(&agent, &job).await;
        if i % 25 == 0 {
            most = most.max(fds(pid));
        }
    }
    // Journals still open (a job whose events the ledger took after its
    // close) are closed when idle; at most 32 are open at any time.
    assert!(
        most <= base + 40,
        "{most} descriptors at most over 1,000 jobs, {base} after the warm-up: {:?}",
        fd_kinds(pid)
    );
    let settled = eventually(
        WAIT,
        "the descriptor count back near its baseline",
        || async {
            let now = fds(pid);
            (now <= base + 4).then_some(now)
        },
    )
    .await;
    assert!(settled <= base + 4, "{settled} vs {base}");
    // Every job's account was kept, each in a journal of its own.
    let goodput = agent.home.path().join("state").join("goodput");
    let files = std::fs::read_dir(&goodput)
        .unwrap_or_else(|e| panic!("{}: {e}", goodput.display()))
        .count();
    assert!(files >= 1_010, "{files} journals in {}", goodput.display());
    let mut c = agent.client().await;
    let all = within(
        WAIT,
        "GetGoodput",
        c.get_goodput(pb::GetGoodputRequest {
            job_id: String::new(),
        }),
    )
    .await
    .expect("GetGoodput")
    .into_inner();
    assert_eq!(all.jobs.len(), 1_010, "every job is accounted");
}

fn open_streams(scrape: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with("warden_api_streams_open "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn watch_streams_are_capped_per_uid_and_come_back_when_closed() {
    const CAP: usize = 8;
    let agent = TestAgent::start(&format!(
        "[api]\nmax_streams_per_uid = {CAP}\nmax_streams = 16\n"
    ));
    let client = agent.client().await;
    let mut open = Vec::new();
    for i in 0..CAP {
        let mut c = client.clone();
        let s = within(
            WAIT,
            "WatchEvents",
            c.watch_events(pb::WatchEventsRequest { after_id: None }),
        )
        .await
        .unwrap_or_else(|e| panic!("stream {i} refused below the cap: {e:?}"));
        open.push(s.into_inner());
    }
    // Through another connection all the same: the cap is the uid's.
    let mut other = agent.client().await;
    let refused = within(
        WAIT,
        "WatchEvents",
        other.watch_events(pb::WatchEventsRequest { after_id: None }),
    )
    .await
    .expect_err("the stream past the cap was accepted");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("api.max_streams_per_uid = 8"),
        "names the cap: {refused:?}"
    );
    // WatchHealth counts against the same cap.
    let refused = within(
        WAIT,
        "WatchHealth",
        other.watch_health(pb::WatchHealthRequest {}),
    )
    .await
    .expect_err("WatchHealth past the cap was accepted");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let (_, text) = common::scrape(&agent).await;
    assert_eq!(open_streams(&text), Some(CAP as f64), "{text}");

    drop(open);
    // The agent sees each stream go (its client reset it) and frees its
    // place: the gauge is back to zero and a new stream opens.
    eventually(WAIT, "the streams' places freed", || async {
        let (_, text) = common::scrape(&agent).await;
        (open_streams(&text) == Some(0.0)).then_some(())
    })
    .await;
    let mut again = Vec::new();
    for _ in 0..CAP {
        let mut c = client.clone();
        let s = within(
            WAIT,
            "WatchEvents",
            c.watch_events(pb::WatchEventsRequest { after_id: None }),
        )
        .await
        .expect("a stream after the others closed");
        again.push(s.into_inner());
    }
    // The agent is fine: it answers, and a stream delivers.
    let h = within(WAIT, "GetNodeHealth", agent.health()).await;
    assert!(!h.host.is_empty());
    one_job(&agent, "after-streams").await;
    let ev = within(WAIT, "an event on an open stream", async {
        loop {
            match again[0].message().await {
                Ok(Some(e)) if e.subject.contains("after-streams") => return e,
                Ok(Some(_)) => {}
                other => panic!("stream ended: {other:?}"),
            }
        }
    })
    .await;
    assert!(ev.kind.starts_with("rank."), "{ev:?}");
}

#[tokio::test]
async fn one_process_cannot_take_every_rank_slot() {
    let agent = TestAgent::start("[ranks]\nmax_ranks = 8\nmax_per_process = 3\n");
    let mut c = agent.client().await;
    let mut held = Vec::new();
    for rank in 0..3 {
        let req = pb::RegisterRankRequest {
            global_rank: rank,
            local_rank: rank,
            world_size: 8,
            ..register("hog")
        };
        let r = within(WAIT, "RegisterRank", c.register_rank(req))
            .await
            .unwrap_or_else(|s| panic!("rank {rank} refused below the cap: {s:?}"))
            .into_inner();
        held.push(r.generation);
    }
    let fourth = pb::RegisterRankRequest {
        global_rank: 3,
        local_rank: 3,
        world_size: 8,
        ..register("hog")
    };
    let s = within(WAIT, "RegisterRank", c.register_rank(fourth.clone()))
        .await
        .expect_err("a fourth rank of one process was accepted");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    assert!(
        s.message().contains("ranks.max_per_process = 3")
            && s.message().contains(&format!("pid {}", std::process::id())),
        "{s:?}"
    );
    // Another job of the same process is refused too: the cap is per process.
    let s = within(WAIT, "RegisterRank", c.register_rank(register("hog-2")))
        .await
        .expect_err("another job's rank of the same process was accepted");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    // One deregistered, the fourth fits.
    let dereg = pb::DeregisterRankRequest {
        job_id: "hog".into(),
        global_rank: 0,
        generation: held[0],
    };
    within(WAIT, "DeregisterRank", c.deregister_rank(dereg))
        .await
        .expect("DeregisterRank");
    within(WAIT, "RegisterRank", c.register_rank(fourth))
        .await
        .expect("the fourth rank after one left");
}

#[tokio::test]
async fn exited_rank_processes_leave_no_descriptor_behind() {
    let agent = TestAgent::start("");
    let pid = agent.pid();
    let mut c = agent.client().await;
    let mut events = within(
        WAIT,
        "WatchEvents",
        c.watch_events(pb::WatchEventsRequest { after_id: None }),
    )
    .await
    .expect("WatchEvents")
    .into_inner();
    let mut cycle = async |i: usize| {
        // A real process, this test's child, registered as its launcher
        // registers a worker; then it dies.
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .expect("spawn sleep");
        let job = format!("exit-{i}");
        let req = pb::RegisterRankRequest {
            pid: child.id(),
            ..register(&job)
        };
        within(WAIT, "RegisterRank", c.register_rank(req))
            .await
            .unwrap_or_else(|s| panic!("RegisterRank {job}: {s:?}"));
        child.kill().expect("kill sleep");
        child.wait().expect("reap sleep");
        let want = format!("job/{job}/rank/0");
        within(WAIT, "rank.exited", async {
            loop {
                match events.message().await {
                    Ok(Some(e)) if e.kind == "rank.exited" && e.subject == want => return,
                    Ok(Some(_)) => {}
                    other => panic!("event stream ended: {other:?}"),
                }
            }
        })
        .await;
    };
    for i in 0..5 {
        cycle(i).await;
    }
    let base = fds(pid);
    for i in 5..205 {
        cycle(i).await;
    }
    let settled = eventually(
        WAIT,
        "the descriptor count back near its baseline",
        || async {
            let now = fds(pid);
            (now <= base + 4).then_some(now)
        },
    )
    .await;
    assert!(
        settled <= base + 4,
        "{settled} vs {base}: {:?}",
        fd_kinds(pid)
    );
}
