//! System tests with real PyTorch (gloo on CPU): the real `wardend` and real
//! torch ranks (tests/fixtures/torch_rank.py) training under `warden.run`,
//! each step ending in an all_reduce that the other ranks wait in.
//!
//! 1. One rank hangs in Python while its peers wait in all_reduce, 2 and 4
//!    ranks: the agent finds the hang and restarts the job in process;
//!    every rank is back in the same process on a new process group (the
//!    hung one interrupted by the restart signal, the waiting ones because
//!    the request aborts their groups and the hung rank's destroyed group
//!    closes their collective), training goes on from the newest common
//!    checkpoint, and the weights are identical on every rank at the end.
//! 2. One rank raises an NCCL-timeout RuntimeError mid-step while its peer
//!    waits in all_reduce: `warden.run` reports it and waits for the
//!    agent's decision; the class is transient, so the job restarts in
//!    process as in 1 (same pids, identical weights).
//! 3. A ValueError in one rank (a user error) still ends that rank with
//!    its exit code.
//!
//! Needs torch in `$WARDEN_TEST_PYTHON` (tests/torch-venv.sh installs it).
//! Skips, saying so, only when torch is not importable and
//! `WARDEN_REQUIRE_TORCH` is unset; tests/run-all.sh sets it, so CI never
//! skips.

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

/// Fast ticks and hang thresholds of about a second once calibrated.
fn start_agent() -> (tempfile::TempDir, TestAgent) {
    let state = tempfile::Builder::new()
        .prefix("warden-state-")
        .tempdir()
        .expect("create a state directory");
    let agent = TestAgent::start(&format!(
        "[agent]\ntick = \"50ms\"\nstate_dir = \"{}\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [hang]\nfloor = \"1s\"\nwarmup_samples = 5\n",
        state.path().display()
    ));
    (state, agent)
}

/// `key=value` from a line of the fixture's output.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

struct Job {
    _state: tempfile::TempDir,
    agent: TestAgent,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
    ranks: Vec<Streaming>,
    pids: Vec<String>,
}

/// Starts `world` torch ranks of job `job` with `fault` on rank 1 at step 10.
fn start_job(job: &str, world: u32, fault: &str) -> Job {
    let (state, agent) = start_agent();
    let ckpt = tempfile::tempdir().unwrap();
    let store = tempfile::tempdir().unwrap();
    let (c, s) = (
        ckpt.path().display().to_string(),
        store.path().display().to_string(),
    );
    let mut ranks: Vec<Streaming> = (0..world)
        .map(|rank| {
            let args = [
                "--checkpoint-dir",
                c.as_str(),
                "--store-dir",
                s.as_str(),
                "--steps",
                "40",
                "--step-ms",
                "30",
                "--fault",
                fault,
                "--fault-rank",
                "1",
                "--fault-step",
                "12",
            ];
            let mut cmd = python_rank(
                &agent,
                "tests/fixtures/torch_rank.py",
                job,
                (rank, world),
                &args,
            );
            spawn_python_rank(&agent, job, rank, &mut cmd)
        })
        .collect();
    let pids = ranks
        .iter_mut()
        .map(|r| {
            field(
                &r.wait_line(SLOW, "registered", |l| l.starts_with("registered ")),
                "pid",
            )
            .to_owned()
        })
        .collect();
    Job {
        _state: state,
        agent,
        _dirs: (ckpt, store),
        ranks,
        pids,
    }
}

/// Rank 1 of `world` meets `fault` ("hang" or "transient"); every rank is
/// back in its process on a new group and ends with identical weights.
async fn restarts_in_process(job: &str, world: u32, fault: &str) {
    let mut j = start_job(job, world, fault);
    let mut events = Events::all(&j.agent).await;
    let kind = fault;
    let fault_line = format!("fault {kind} ");
    let fault = j.ranks[1].wait_line(SLOW, "the fault", |l| l.starts_with(&fault_line));
    let fault_t: f64 = field(&fault, "t").parse().unwrap();
    let requested = events
        .expect(&j.agent, SLOW, "restart.requested", |e| {
            e.kind == "restart.requested"
        })
        .await;
    let d = describe(&requested);
    if kind == "transient" {
        // The decision names the rule that classified the exception.
        assert!(
            evidence(&requested, "reason").is_some_and(|r| r.contains("exception.nccl_timeout")),
            "{d}"
        );
    }
    let all: Vec<String> = (0..world).map(|r| r.to_string()).collect();
    assert_eq!(
        evidence(&requested, "ranks"),
        Some(all.join(",").as_str()),
        "{d}"
    );
    let mut back = Vec::new();
    let mut weights = Vec::new();
    for (rank, r) in j.ranks.iter_mut().enumerate() {
        let name = format!("rank {rank}");
        let line = r.wait_line(SLOW, "the second attempt", |l| {
            l.starts_with("attempt restart_count=1 ")
        });
        assert_eq!(field(&line, "pid"), j.pids[rank], "{name}: same process");
        let line = r.wait_line(SLOW, "stepping again", |l| {
            l.starts_with("stepping restart_count=1 ")
        });
        back.push(field(&line, "t").parse::<f64>().unwrap() - fault_t);
        let line = r.wait_line(SLOW, "the end", |l| l.starts_with("done "));
        assert_eq!(field(&line, "pid"), j.pids[rank], "{name}: {line}");
        assert_eq!(field(&line, "restart_count"), "1", "{name}: {line}");
        weights.push(field(&line, "weights").to_owned());
        let status = r.wait_exit(SLOW);
        assert!(
            status.success(),
            "{name} exits 0: {status:?}\n{}",
            r.stderr()
        );
    }
    assert!(
        weights.iter().all(|w| *w == weights[0]),
        "identical weights on every rank: {weights:?}"
    );
    let slowest = back.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "{world} ranks, rank 1 {fault_line}: fault -> every rank stepping again in {slowest:.3} s (per rank {back:?})"
    );
    assert_eq!(
        events.count("restart.in_process_timeout", ""),
        0,
        "{}",
        events.summary()
    );
}

#[tokio::test]
async fn a_rank_hung_in_python_two_ranks_restart_in_process_with_identical_weights() {
    if torch_available() {
        restarts_in_process("torch-hang-2", 2, "hang").await;
    }
}

// Four ranks: the hung rank's neighbours see their collective fail; rank 3,
// whose neighbours are 0 and 2, returns only once their old groups are
// destroyed and their sockets close (gloo's abort does not wake it).
#[tokio::test]
async fn a_rank_hung_in_python_four_ranks_restart_in_process_with_identical_weights() {
    if torch_available() {
        restarts_in_process("torch-hang-4", 4, "hang").await;
    }
}

// Rank 1 raises an NCCL-timeout RuntimeError mid-step while rank 0 waits in
// all_reduce: warden.run reports it and waits; the agent classifies it as
// transient and restarts the job in process.
#[tokio::test]
async fn a_transient_exception_restarts_every_rank_in_process_with_identical_weights() {
    if torch_available() {
        restarts_in_process("torch-transient", 2, "transient").await;
    }
}

#[tokio::test]
async fn a_value_error_still_ends_the_rank_with_its_code() {
    if !torch_available() {
        return;
    }
    let mut j = start_job("torch-user", 2, "user");
    j.ranks[1].wait_line(SLOW, "the fault", |l| l.starts_with("fault user "));
    let status = j.ranks[1].wait_exit(SLOW);
    assert_eq!(
        status.code(),
        Some(1),
        "{status:?}\n{}",
        j.ranks[1].stderr()
    );
    assert!(
        j.ranks[1].stderr().contains("ValueError: bad batch"),
        "{}",
        j.ranks[1].stderr()
    );
    assert!(
        !j.ranks[1]
            .seen
            .iter()
            .any(|l| l.starts_with("attempt restart_count=1"))
    );
}

// The flight-recorder half of a hang's diagnosis: rank 0 waits in an
// all_reduce rank 1 has not reached; each writes its flight recorder through
// warden's hook (what the client runs on the agent's request), and the
// agent's parser puts rank 1 behind with the collective rank 0 waits in.
#[tokio::test]
async fn a_rank_waiting_in_an_all_reduce_dumps_a_flight_recorder_the_agent_reads() {
    use warden_core::detect::flight_recorder::{compare, parse};
    if !torch_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let rank = |r: u32| {
        let mut cmd = std::process::Command::new(common::python());
        cmd.arg(common::repo_root().join("tests/fixtures/torch_flight_recorder.py"))
            .arg(r.to_string())
            .arg(&store)
            .arg(&out)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("WARDEN_SOCKET");
        cmd
    };
    let (mut c0, mut c1) = (rank(0), rank(1));
    let r1 = std::thread::spawn(move || common::run(&mut c1, SLOW));
    let f0 = common::run(&mut c0, SLOW);
    let f1 = r1.join().expect("rank 1's thread");
    assert_eq!(f0.code(), 0, "{f0:?}");
    assert_eq!(f1.code(), 0, "{f1:?}");
    let read = |name: &str| std::fs::read(out.join(name)).unwrap();
    let before = String::from_utf8(read("before_init.json")).unwrap();
    assert!(
        before.contains("\"warden_unavailable\"") && before.contains("not initialised"),
        "{before}"
    );
    let p0 = parse(&read("rank0.json")).expect("rank 0's dump");
    let p1 = parse(&read("rank1.json")).expect("rank 1's dump");
    assert_eq!(p0[0].pg, "0:default_pg", "{p0:?}");
    assert_eq!(p0[0].last_enqueued, Some(5), "{p0:?}");
    assert_eq!(
        p0[0].pending.as_deref(),
        Some("gloo:all_reduce #5"),
        "{p0:?}"
    );
    assert_eq!(p1[0].last_enqueued, Some(4), "{p1:?}");
    let behind = compare(&[(0, p0), (1, p1)]);
    assert_eq!(behind.len(), 1, "{behind:?}");
    assert_eq!(
        behind[0].evidence,
        "rank 1 enqueued collective #4 on pg 0:default_pg, rank 0 is at #5 (gloo:all_reduce)"
    );
    for name in ["rank0.json", "rank1.json"] {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(out.join(name)).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600, "{name}");
    }
}
