//! System tests of the SDC signals with real PyTorch (gloo on CPU): the
//! real `wardend` and two real torch ranks (tests/fixtures/torch_sdc_rank.py)
//! training a model data-parallel and reporting each step's loss and
//! gradient norm with `warden.report_values`.
//!
//! 1. Rank 1's gradients are multiplied by 100 after the all-reduce from
//!    step 30: the agent flags rank 1 (`rank.sdc_suspect`, gradient norm,
//!    with the step, value, job median and score) within K = 3 steps of the
//!    first bad one, and never rank 0; attribution opens an `sdc` incident
//!    and the default policy (`policy.sdc = "report"`) lets the job go on.
//! 2. The same job without corruption: no suspect in its 60 steps.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it).
//! Skips, saying so, only when torch is not importable and
//! `WARDEN_REQUIRE_TORCH` is unset; tests/run-all.sh sets it.

// Helpers outside #[test] functions panic on purpose: that is a failed test.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    Events, Streaming, TestAgent, describe, evidence, python_rank, spawn_python_rank,
    torch_available,
};

/// Generous: importing torch takes seconds on a loaded 2-core machine.
const SLOW: Duration = Duration::from_secs(90);
/// The first corrupted step.
const CORRUPT_STEP: u64 = 30;
/// Rank 1 must be flagged at a step before `CORRUPT_STEP + K`.
const K: u64 = 3;
const STEPS: &str = "60";

struct Job {
    _state: tempfile::TempDir,
    agent: TestAgent,
    _store: tempfile::TempDir,
    ranks: Vec<Streaming>,
}

/// The fixture's arguments: 20 ms steps, `corrupt` multiplied by 100 from
/// `step` (-1: never), the process groups' store in `store`.
fn rank_args(store: &str, corrupt: u32, step: &str) -> Vec<String> {
    [
        "--store-dir",
        store,
        "--steps",
        STEPS,
        "--step-ms",
        "20",
        "--corrupt-rank",
        &corrupt.to_string(),
        "--corrupt-step",
        step,
        "--factor",
        "100",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Two ranks of job `job`; rank 1 corrupted from `corrupt_step` (-1: never).
fn start_job(job: &str, corrupt_step: i64) -> Job {
    let state = tempfile::Builder::new()
        .prefix("warden-state-")
        .tempdir()
        .expect("create a state directory");
    let agent = TestAgent::start(&format!(
        "[agent]\ntick = \"50ms\"\nstate_dir = \"{}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [hang]\nfloor = \"30s\"\n",
        state.path().display()
    ));
    let store = tempfile::tempdir().unwrap();
    let s = store.path().display().to_string();
    let step = corrupt_step.to_string();
    let mut ranks: Vec<Streaming> = (0..2)
        .map(|rank| {
            let owned = rank_args(&s, 1, &step);
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            let mut cmd = python_rank(
                &agent,
                "tests/fixtures/torch_sdc_rank.py",
                job,
                (rank, 2),
                &args,
            );
            spawn_python_rank(&agent, job, rank, &mut cmd)
        })
        .collect();
    for r in &mut ranks {
        r.wait_line(SLOW, "registered", |l| l.starts_with("registered "));
    }
    Job {
        _state: state,
        agent,
        _store: store,
        ranks,
    }
}

/// Both ranks finish their steps and exit 0.
fn finish(j: &mut Job) {
    for (rank, r) in j.ranks.iter_mut().enumerate() {
        r.wait_line(SLOW, "the end", |l| l.starts_with("done "));
        let status = r.wait_exit(SLOW);
        assert!(
            status.success(),
            "rank {rank} exits 0: {status:?}\n{}",
            r.stderr()
        );
    }
}

#[tokio::test]
async fn a_rank_whose_gradients_are_corrupted_is_flagged_within_k_steps() {
    if !torch_available() {
        return;
    }
    let job = "torch-sdc";
    let mut j = start_job(job, CORRUPT_STEP as i64);
    let mut events = Events::all(&j.agent).await;
    j.ranks[1].wait_line(SLOW, "the corruption", |l| l.starts_with("corrupt "));
    let suspect = events
        .expect(&j.agent, SLOW, "rank.sdc_suspect", |e| {
            e.kind == "rank.sdc_suspect"
        })
        .await;
    let d = describe(&suspect);
    assert_eq!(suspect.subject, format!("job/{job}/rank/1"), "{d}");
    assert_eq!(evidence(&suspect, "metric"), Some("grad_norm"), "{d}");
    let step: u64 = evidence(&suspect, "step").unwrap().parse().unwrap();
    assert!(
        (CORRUPT_STEP..CORRUPT_STEP + K).contains(&step),
        "flagged at step {step}, within {K} steps of {CORRUPT_STEP}: {d}"
    );
    let value: f64 = evidence(&suspect, "value").unwrap().parse().unwrap();
    // Two ranks: the job median is their mean; the rank's own recent
    // values are what it departed from.
    let median: f64 = evidence(&suspect, "job_median").unwrap().parse().unwrap();
    let own: f64 = evidence(&suspect, "own_median").unwrap().parse().unwrap();
    let score: f64 = evidence(&suspect, "score").unwrap().parse().unwrap();
    assert!(value > median && value > 10.0 * own, "{d}");
    assert!(score >= 12.0, "{d}");
    assert_eq!(evidence(&suspect, "basis"), Some("own_history"), "{d}");
    // Attribution: an sdc incident on rank 1, reported (the default policy).
    let decided = events
        .expect(&j.agent, SLOW, "incident.decided", |e| {
            e.kind == "incident.decided"
        })
        .await;
    let dd = describe(&decided);
    assert!(dd.contains("sdc"), "{dd}");
    assert!(dd.contains("policy.sdc says continue"), "{dd}");
    finish(&mut j);
    // Drain what is left, then: rank 0 was never a suspect.
    let rank0 = format!("job/{job}/rank/0");
    if events.count("rank.deregistered", &rank0) == 0 {
        let _ = events
            .expect(&j.agent, SLOW, "rank 0 leaving", |e| {
                e.kind == "rank.deregistered" && e.subject == rank0
            })
            .await;
    }
    assert_eq!(
        events.count("rank.sdc_suspect", &format!("job/{job}/rank/0")),
        0,
        "{}",
        events.summary()
    );
}

#[tokio::test]
async fn a_clean_job_has_no_suspect() {
    if !torch_available() {
        return;
    }
    let job = "torch-sdc-clean";
    let mut j = start_job(job, -1);
    let mut events = Events::all(&j.agent).await;
    finish(&mut j);
    // Both ranks left (in either order): every step was judged by then.
    for rank in 0..2 {
        let subject = format!("job/{job}/rank/{rank}");
        if events.count("rank.deregistered", &subject) == 0 {
            let _ = events
                .expect(&j.agent, SLOW, "the rank leaving", |e| {
                    e.kind == "rank.deregistered" && e.subject == subject
                })
                .await;
        }
    }
    assert_eq!(
        events.count("rank.sdc_suspect", ""),
        0,
        "{}",
        events.summary()
    );
}

/// 3. Two agents on 127.0.0.2 and 127.0.0.3 (mutual TLS, each the other's
///    straggler peer), two ranks each: rank 3 on host B is corrupted from
///    step 30. Host B compares it with all four ranks, host A's two
///    included (basis `peers`, 4 ranks compared, where alone it would have
///    only its own history), and only host B, its owner, reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_rank_is_compared_with_its_peers_on_other_hosts() {
    if !torch_available() {
        return;
    }
    let (a_addr, b_addr) = (
        format!("127.0.0.2:{}", common::free_port("127.0.0.2")),
        format!("127.0.0.3:{}", common::free_port("127.0.0.3")),
    );
    let states = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let config = |host: &str, tcp: &str, peer: &str, state: &tempfile::TempDir| {
        format!(
            "[agent]\ntick = \"50ms\"\nhost_name = \"{host}\"\nstate_dir = \"{}\"\n\
             [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
             [hang]\nfloor = \"30s\"\n\
             [sdc]\njudge_lag = 40\n\
             [api]\ntcp = \"{tcp}\"\n{}\
             [checkpoint]\ndir = \"{}/ckpt\"\n\
             [straggler]\npeers = [\"{peer}\"]\nexchange_interval = \"100ms\"\n",
            state.path().display(),
            common::pki::api_keys(host),
            state.path().display(),
        )
    };
    let a = TestAgent::start(&config("host-a", &a_addr, &b_addr, &states.0));
    let b = TestAgent::start(&config("host-b", &b_addr, &a_addr, &states.1));
    let mut ev_a = Events::all(&a).await;
    let mut ev_b = Events::all(&b).await;
    let store = tempfile::tempdir().unwrap();
    let s = store.path().display().to_string();
    let job = "torch-sdc-hosts";
    let step = CORRUPT_STEP.to_string();
    let mut ranks: Vec<Streaming> = (0..4u32)
        .map(|rank| {
            let agent = if rank < 2 { &a } else { &b };
            let owned = rank_args(&s, 3, &step);
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            let mut cmd = python_rank(
                agent,
                "tests/fixtures/torch_sdc_rank.py",
                job,
                (rank, 4),
                &args,
            );
            cmd.env("LOCAL_RANK", (rank % 2).to_string());
            spawn_python_rank(agent, job, rank, &mut cmd)
        })
        .collect();
    for r in &mut ranks {
        r.wait_line(SLOW, "registered", |l| l.starts_with("registered "));
    }
    let suspect = ev_b
        .expect(&b, SLOW, "rank.sdc_suspect", |e| {
            e.kind == "rank.sdc_suspect"
        })
        .await;
    let d = describe(&suspect);
    assert_eq!(suspect.subject, format!("job/{job}/rank/3"), "{d}");
    assert_eq!(evidence(&suspect, "basis"), Some("peers"), "{d}");
    assert_eq!(evidence(&suspect, "ranks_compared"), Some("4"), "{d}");
    let flagged: u64 = evidence(&suspect, "step").unwrap().parse().unwrap();
    assert!(
        (CORRUPT_STEP..CORRUPT_STEP + K).contains(&flagged),
        "flagged at step {flagged}: {d}"
    );
    for (rank, r) in ranks.iter_mut().enumerate() {
        r.wait_line(SLOW, "the end", |l| l.starts_with("done "));
        let status = r.wait_exit(SLOW);
        assert!(status.success(), "rank {rank}: {status:?}\n{}", r.stderr());
    }
    // Host A judged rank 3 as a peer of its ranks but does not own it:
    // it reported nothing (its last events are its ranks leaving).
    for rank in 0..2 {
        let subject = format!("job/{job}/rank/{rank}");
        if ev_a.count("rank.deregistered", &subject) == 0 {
            let _ = ev_a
                .expect(&a, SLOW, "the rank leaving", |e| {
                    e.kind == "rank.deregistered" && e.subject == subject
                })
                .await;
        }
    }
    assert_eq!(ev_a.count("rank.sdc_suspect", ""), 0, "{}", ev_a.summary());
}
