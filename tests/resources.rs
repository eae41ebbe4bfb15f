//! System tests of the agent's bounds on what callers make it hold: the
//! real `wardend` over its real Unix socket.
//!
//! - Goodput journals: 1,000 jobs registered, deregistered and closed
//!   through the API leave the agent's descriptor count flat (issue 22: one
//!   descriptor stayed open per job id until `nofile` ran out).

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
    let agent = TestAgent::start("");
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
