//! System tests of the kernel-log source: the real `wardend` following a
//! file the test appends kernel-log lines to, as `[kmsg] path` allows for
//! containers.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::path::Path;

use common::{TestAgent, WAIT, eventually, evidence, sample, scrape};
use warden_proto::v1 as pb;

fn agent_on(log: &Path) -> TestAgent {
    TestAgent::start(&format!(
        "[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [kmsg]\npath = {:?}\npoll_interval = \"50ms\"\ngpu_pci = [\"0000:1a:00\", \"0000:3b:00\"]\n",
        log.display().to_string()
    ))
}

fn append(log: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

async fn event_of(agent: &TestAgent, kind: &str) -> pb::Event {
    eventually(WAIT, kind, async || {
        agent.events().await.into_iter().find(|e| e.kind == kind)
    })
    .await
}

fn status(c: &pb::Component) -> pb::Status {
    pb::Status::try_from(c.status).unwrap_or(pb::Status::Unspecified)
}

#[tokio::test]
async fn xid_79_fails_the_mapped_gpu_and_oom_is_published() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kern.log");
    // Old lines are not replayed: the agent follows from the end.
    std::fs::write(
        &log,
        "NVRM: Xid (PCI:0000:1a:00): 79, pid=1, name=old, GPU has fallen off the bus.\n",
    )
    .unwrap();
    let agent = agent_on(&log);
    eventually(WAIT, "kmsg component OK", async || {
        agent
            .component("kmsg")
            .await
            .filter(|c| status(c) == pb::Status::Ok)
    })
    .await;

    append(
        &log,
        "this is not a kernel line\n\u{1}\u{2}garbage;;;\nNVRM: Xid (PCI:zz): x\n",
    );
    append(
        &log,
        "[ 4242.000001] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n",
    );
    let xid = event_of(&agent, "kmsg.xid").await;
    assert_eq!(xid.subject, "gpu1");
    assert_eq!(evidence(&xid, "pci"), Some("0000:3b:00"));
    assert_eq!(evidence(&xid, "xid"), Some("79"));
    assert_eq!(evidence(&xid, "pid"), Some("1234"));
    let gpu = eventually(WAIT, "gpu1 FAILED", async || {
        agent
            .component("gpu1")
            .await
            .filter(|c| status(c) == pb::Status::Failed)
    })
    .await;
    assert_eq!(gpu.reasons[0].signal, "kmsg.xid.79", "{gpu:?}");
    let (m, body) = scrape(&agent).await;
    assert_eq!(
        sample(
            &m,
            "warden_gpu_xids_total",
            &[("gpu", "gpu1"), ("xid", "79"), ("source", "kmsg")]
        ),
        1.0,
        "{body}"
    );
    assert!(
        agent.component("gpu0").await.is_none(),
        "the old line was replayed"
    );

    append(
        &log,
        "[ 4300.1] Out of memory: Killed process 4242 (torchrun) total-vm:1kB\n",
    );
    let oom = event_of(&agent, "kmsg.oom_kill").await;
    assert_eq!(evidence(&oom, "pid"), Some("4242"));
    assert_eq!(evidence(&oom, "process"), Some("torchrun"));

    // Garbage did not take the agent down, and it still reads on.
    append(&log, "ib0: link down\n");
    event_of(&agent, "kmsg.link_down").await;
    assert_eq!(
        agent
            .events()
            .await
            .iter()
            .filter(|e| e.kind == "kmsg.xid")
            .count(),
        1
    );
}

#[tokio::test]
async fn an_unreadable_log_is_unknown_and_the_agent_runs_on() {
    let agent = TestAgent::start("[kmsg]\npath = \"/nonexistent/warden-test/kmsg\"\n");
    let c = eventually(WAIT, "kmsg UNKNOWN", async || {
        agent
            .component("kmsg")
            .await
            .filter(|c| status(c) == pb::Status::Unknown)
    })
    .await;
    assert!(
        c.reasons[0]
            .message
            .contains("/nonexistent/warden-test/kmsg"),
        "{c:?}"
    );
    assert!(agent.component("agent").await.is_some());
}

#[tokio::test]
async fn watch_health_streams_the_change_a_kernel_log_line_causes() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("kern.log");
    std::fs::write(&log, "").unwrap();
    let agent = agent_on(&log);
    let mut stream = agent
        .client()
        .await
        .watch_health(pb::WatchHealthRequest {})
        .await
        .expect("WatchHealth")
        .into_inner();
    // The first message is the whole node as it is now: no GPU failed.
    let first = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("first WatchHealth message in time")
        .expect("stream")
        .expect("a message");
    assert!(
        first
            .components
            .iter()
            .all(|c| status(c) != pb::Status::Failed),
        "{first:#?}"
    );
    append(
        &log,
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=42, name=python, GPU has fallen off the bus.\n",
    );
    // Then an update arrives when gpu1 fails, without asking again.
    let changed = tokio::time::timeout(WAIT, async {
        loop {
            let h = stream.message().await.expect("stream").expect("a message");
            if h.components
                .iter()
                .any(|c| c.id == "gpu1" && status(c) == pb::Status::Failed)
            {
                return h;
            }
        }
    })
    .await
    .expect("a WatchHealth update with gpu1 FAILED in time");
    assert_eq!(
        pb::Status::try_from(changed.status).unwrap(),
        pb::Status::Failed,
        "the node is as bad as its worst component"
    );
}
