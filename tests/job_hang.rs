//! System tests of the job-wide hang verdict: two real `wardend`s on
//! 127.0.0.2 and 127.0.0.3 (api.tcp, mutual TLS with a test-made cluster
//! CA, each the other's straggler peer) as two hosts of one job, and four
//! real torch ranks (gloo on CPU, tests/fixtures/torch_rank.py with
//! `--sections`), two per agent, each step a `compute` section and an
//! all_reduce in an `allreduce` section.
//!
//! 1. Rank 1 (host A) hangs in Python inside `compute` at step 12; ranks
//!    0, 2 and 3 wait for it in their all_reduce. Each agent sees only its
//!    own ranks stuck; both name rank 1 on host-a in `job.hang_verdict`,
//!    from torch's flight recorder (on: rank 1 is a collective behind on
//!    the default group), host A is charged, and host B's hang incident
//!    records that it waited on rank 1 on host-a.
//! 2. Rank 3 (host B) freezes itself with SIGSTOP at step 12: both agents
//!    name it, with its stopped process as the evidence, and host A's
//!    incident records that it waited on rank 3 on host-b.
//! 3. As 1, with no `[straggler] peers`: each agent learns the other as the
//!    job's peer the way a multi-host `warden run` hands it over from its
//!    etcd round (SetCheckpointPeers), and the hang's positions reach it;
//!    the flight recorder is off, so the sections name the culprit.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it);
//! skips, saying so, only when torch is missing and `WARDEN_REQUIRE_TORCH`
//! is unset (CI sets it). Every wait has a deadline and waits for events.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    Events, Streaming, TestAgent, evidence, free_port, python_rank, spawn_python_rank,
    torch_available,
};
use warden_proto::v1 as pb;

/// Generous: importing torch takes seconds on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(120);

/// The two scenarios start eight torch processes between them: one at a
/// time on a 2-core machine.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Hosts {
    a: TestAgent,
    b: TestAgent,
    addrs: (String, String),
    _state: (tempfile::TempDir, tempfile::TempDir),
}

/// How the agents know each other.
#[derive(Clone, Copy, PartialEq)]
enum Peering {
    /// `[straggler] peers` in each config.
    Configured,
    /// Handed over per job, as a launcher does (SetCheckpointPeers).
    PerJob,
}

/// Two agents, each the other's peer, with hang thresholds of about a
/// second once calibrated.
fn two_hosts(peering: Peering) -> Hosts {
    let (a_addr, b_addr) = (
        format!("127.0.0.2:{}", free_port("127.0.0.2")),
        format!("127.0.0.3:{}", free_port("127.0.0.3")),
    );
    let state_a = tempfile::tempdir().unwrap();
    let state_b = tempfile::tempdir().unwrap();
    let config = |host: &str, tcp: &str, peer: &str, state: &tempfile::TempDir| {
        let peers = if peering == Peering::Configured {
            format!("peers = [\"{peer}\"]\n")
        } else {
            String::new()
        };
        format!(
            "[agent]\ntick = \"50ms\"\nhost_name = \"{host}\"\nstate_dir = \"{}\"\n\
             [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
             [hang]\nfloor = \"1s\"\nwarmup_samples = 5\nverdict_wait = \"20s\"\n\
             [api]\ntcp = \"{tcp}\"\n{}\
             [checkpoint]\ndir = \"{}/ckpt\"\n\
             [straggler]\n{peers}exchange_interval = \"500ms\"\n",
            state.path().display(),
            common::pki::api_keys(host),
            state.path().display(),
        )
    };
    Hosts {
        a: TestAgent::start(&config("host-a", &a_addr, &b_addr, &state_a)),
        b: TestAgent::start(&config("host-b", &b_addr, &a_addr, &state_b)),
        addrs: (a_addr, b_addr),
        _state: (state_a, state_b),
    }
}

/// Tells each agent the other is a peer of `job`, as each host's launcher
/// does with the hosts of its etcd round.
async fn hand_over_peers(h: &Hosts, job: &str) {
    for (agent, (addr, host)) in [
        (&h.a, (&h.addrs.1, "host-b")),
        (&h.b, (&h.addrs.0, "host-a")),
    ] {
        agent
            .client()
            .await
            .set_checkpoint_peers(pb::SetCheckpointPeersRequest {
                job_id: job.to_owned(),
                peers: vec![pb::CheckpointPeer {
                    addr: addr.clone(),
                    domain: String::new(),
                    host: host.to_owned(),
                    identity: host.to_owned(),
                    ..Default::default()
                }],
                ..Default::default()
            })
            .await
            .expect("SetCheckpointPeers");
    }
}

struct Job {
    ranks: Vec<Streaming>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

/// Four ranks of `job`, 0-1 on host A and 2-3 on host B, with `fault` on
/// `fault_rank` at step 12, torch's flight recorder on or off; returns once
/// every rank has registered.
fn start_job(h: &Hosts, job: &str, fault: &str, fault_rank: u32, flight_recorder: bool) -> Job {
    let ckpt = tempfile::tempdir().unwrap();
    let store = tempfile::tempdir().unwrap();
    let (c, s) = (
        ckpt.path().display().to_string(),
        store.path().display().to_string(),
    );
    let fr = fault_rank.to_string();
    let mut ranks: Vec<Streaming> = (0..4u32)
        .map(|rank| {
            let agent = if rank < 2 { &h.a } else { &h.b };
            let args = [
                "--checkpoint-dir",
                c.as_str(),
                "--store-dir",
                s.as_str(),
                "--steps",
                "1000",
                "--step-ms",
                "30",
                "--sections",
                "--fault",
                fault,
                "--fault-rank",
                fr.as_str(),
                "--fault-step",
                "12",
            ];
            let mut cmd = python_rank(agent, "tests/fixtures/torch_rank.py", job, (rank, 4), &args);
            cmd.env("LOCAL_RANK", (rank % 2).to_string());
            // torch 2.15 records by default; 0 turns the recorder off.
            cmd.env(
                "TORCH_FR_BUFFER_SIZE",
                if flight_recorder { "2000" } else { "0" },
            );
            spawn_python_rank(agent, job, rank, &mut cmd)
        })
        .collect();
    for r in &mut ranks {
        r.wait_line(SLOW, "registered", |l| l.starts_with("registered "));
    }
    Job {
        ranks,
        _dirs: (ckpt, store),
    }
}

/// The agent's `job.hang_verdict` for `job`.
async fn verdict(agent: &TestAgent, events: &mut Events, job: &str) -> pb::Event {
    let subject = format!("job/{job}");
    events
        .expect(agent, SLOW, "job.hang_verdict", |e| {
            e.kind == "job.hang_verdict" && e.subject == subject
        })
        .await
}

/// The agent's hang incident of `job` once the verdict has joined it.
async fn judged_incident(agent: &TestAgent, job: &str) -> pb::Incident {
    common::eventually(SLOW, "a hang incident with the verdict", async || {
        let r = agent
            .client()
            .await
            .get_incidents(pb::GetIncidentsRequest {
                job_id: job.to_owned(),
                limit: 0,
            })
            .await
            .ok()?
            .into_inner();
        r.incidents.into_iter().find(|i| {
            i.kind == "hang"
                && i.diagnosis
                    .as_ref()
                    .is_some_and(|d| d.evidence.iter().any(|e| e.signal == "hang.verdict"))
        })
    })
    .await
}

fn verdict_evidence(i: &pb::Incident) -> &pb::Evidence {
    i.diagnosis
        .as_ref()
        .unwrap()
        .evidence
        .iter()
        .find(|e| e.signal == "hang.verdict")
        .unwrap()
}

/// Scenario 1 (and 3), with the agents peered as `peering` says.
async fn stuck_in_compute(peering: Peering, job_id: &str) {
    if !torch_available() {
        return;
    }
    let _one = SERIAL.lock().await;
    let h = two_hosts(peering);
    if peering == Peering::PerJob {
        hand_over_peers(&h, job_id).await;
    }
    let mut ev_a = Events::all(&h.a).await;
    let mut ev_b = Events::all(&h.b).await;
    // With static peers, torch's flight recorder is on: its sequence
    // numbers name the culprit; without, the sections do.
    let flight_recorder = peering == Peering::Configured;
    let mut job = start_job(&h, job_id, "hang", 1, flight_recorder);
    job.ranks[1].wait_line(SLOW, "the fault", |l| l.starts_with("fault hang "));

    for (agent, events, me) in [(&h.a, &mut ev_a, "host-a"), (&h.b, &mut ev_b, "host-b")] {
        let v = verdict(agent, events, job_id).await;
        assert_eq!(evidence(&v, "culprits"), Some("1@host-a"), "on {me}: {v:?}");
        let why = evidence(&v, "why.1").unwrap_or_default();
        let want = if flight_recorder {
            "flight recorder: enqueued collective #"
        } else {
            "in 'compute' at step 12 while ranks 0,2-3 wait in 'allreduce'"
        };
        assert!(why.contains(want), "on {me}: {v:?}");
        if flight_recorder {
            assert!(
                why.contains("on process group 0:default_pg while ranks 0,2-3 are at #"),
                "on {me}: {v:?}"
            );
        }
        assert_eq!(
            evidence(&v, "hosts"),
            Some("host-a,host-b"),
            "on {me}: {v:?}"
        );
    }
    let charged = |e: &pb::Event| evidence(e, "charged").map(str::to_owned);
    let last = |ev: &Events| {
        ev.seen
            .iter()
            .rev()
            .find(|e| e.kind == "job.hang_verdict")
            .cloned()
            .unwrap()
    };
    assert_eq!(charged(&last(&ev_a)).as_deref(), Some("this host"));
    assert_eq!(
        charged(&last(&ev_b)).as_deref(),
        Some("waited on rank 1 on host-a")
    );

    // Host B's incident is not charged to it; host A's is.
    let b = judged_incident(&h.b, job_id).await;
    assert_eq!(b.waited_on, ["rank 1 on host-a"], "{b:?}");
    assert!(
        verdict_evidence(&b)
            .note
            .contains("waited on rank 1 on host-a"),
        "{b:?}"
    );
    let a = judged_incident(&h.a, job_id).await;
    assert!(a.waited_on.is_empty(), "{a:?}");
    assert!(
        verdict_evidence(&a).note.contains("charged with the hang"),
        "{a:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_stuck_in_compute_is_named_by_both_hosts() {
    stuck_in_compute(Peering::Configured, "jh-compute").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_handed_over_per_job_carry_the_verdict_too() {
    stuck_in_compute(Peering::PerJob, "jh-per-job").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_frozen_with_sigstop_is_named_by_both_hosts() {
    if !torch_available() {
        return;
    }
    let _one = SERIAL.lock().await;
    let h = two_hosts(Peering::Configured);
    let mut ev_a = Events::all(&h.a).await;
    let mut ev_b = Events::all(&h.b).await;
    let mut job = start_job(&h, "jh-stop", "stop", 3, true);
    job.ranks[3].wait_line(SLOW, "the fault", |l| l.starts_with("fault stop "));

    for (agent, events, me) in [(&h.a, &mut ev_a, "host-a"), (&h.b, &mut ev_b, "host-b")] {
        let v = verdict(agent, events, "jh-stop").await;
        assert_eq!(evidence(&v, "culprits"), Some("3@host-b"), "on {me}: {v:?}");
        let why = evidence(&v, "why.3").unwrap_or_default();
        assert!(
            why.contains("its process is stopped (T (stopped)"),
            "on {me}: {v:?}"
        );
    }
    let a = judged_incident(&h.a, "jh-stop").await;
    assert_eq!(a.waited_on, ["rank 3 on host-b"], "{a:?}");
    let b = judged_incident(&h.b, "jh-stop").await;
    assert!(b.waited_on.is_empty(), "{b:?}");
    // The frozen rank is still there to be killed when the job drops.
    assert_eq!(common::proc_state(job.ranks[3].pid()), Some('T'));
}
