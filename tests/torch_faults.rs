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
//! 4. Under `warden run`, 2 and 4 ranks: rank 1 freezes itself with
//!    SIGSTOP while its peers wait in all_reduce. The agent finds the hang,
//!    restarts the job in process, sees rank 1's process stopped and has
//!    the launcher replace it at once (`restart.replace_ranks`): the frozen
//!    pid is gone, rank 1 runs in a new process that joins its peers'
//!    attempt (restart count 1, the same checkpoint), every other rank is
//!    in its original process, every rank finishes with identical weights,
//!    and the in-process restart's timeout (30 s, as configured by default)
//!    never fires: the replacement came before it.
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
    Events, Finished, Streaming, TestAgent, WARDEN, describe, evidence, python, python_rank,
    repo_root, spawn_python_rank, torch_available,
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
            // A crash in the interpreter (one run in about a hundred, a
            // rank whose ValueError ended it died of SIGSEGV in torch's
            // teardown) names its Python frames in the stderr the
            // assertions print.
            cmd.env("PYTHONFAULTHANDLER", "1");
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
        // The hook wrote into the file made for it, then took its write
        // bits off: the agent's sign that the dump is complete.
        assert_eq!(mode & 0o777, 0o400, "{name}");
    }
}

/// A whole `warden run` of torch ranks: start-up (every interpreter
/// importing torch at once on a loaded 2-core machine), the freeze, the
/// replacement's start and the rest of the training.
const RUN: Duration = Duration::from_secs(300);

/// `[rank R] key=value ...` lines of the launcher's stdout: (rank, the
/// line after the prefix), for lines starting with `what`.
fn rank_lines<'a>(out: &'a str, what: &str) -> Vec<(u32, &'a str)> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("[rank ")?;
            let (rank, line) = rest.split_once("] ")?;
            line.starts_with(what)
                .then(|| rank.parse().ok().map(|r| (r, line)))
                .flatten()
        })
        .collect()
}

/// The `pid=` of rank `rank`'s lines starting with `what`, in order.
fn pids_of(out: &str, what: &str, rank: u32) -> Vec<String> {
    rank_lines(out, what)
        .into_iter()
        .filter(|(r, _)| *r == rank)
        .map(|(_, l)| field(l, "pid").to_owned())
        .collect()
}

fn show(f: &Finished) -> String {
    format!(
        "status {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        f.status, f.stdout, f.stderr
    )
}

/// `world` torch ranks under `warden run` (on the test's agent, so its
/// events can be read), rank 1 frozen with SIGSTOP at step 12; `warm`:
/// with `--standby` (the replacement is the standby interpreter), else
/// `--no-standby`.
async fn frozen_rank_is_replaced(job: &str, world: u32, warm: bool) {
    let standby = if warm { "--standby" } else { "--no-standby" };
    let (_state, agent) = start_agent();
    let dir = tempfile::Builder::new()
        .prefix("warden-frozen-")
        .tempdir()
        .unwrap();
    let (ckpt, store) = (dir.path().join("ckpt"), dir.path().join("store"));
    std::fs::create_dir(&ckpt).unwrap();
    std::fs::create_dir(&store).unwrap();
    let mut cmd = std::process::Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", &world.to_string(), "--rdzv-id", job])
        .arg(standby)
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/torch_rank.py"))
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .arg("--store-dir")
        .arg(&store)
        .args(["--steps", "40", "--step-ms", "30"])
        .args(["--fault", "stop", "--fault-rank", "1", "--fault-step", "12"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir.path());
    let out = tokio::task::spawn_blocking(move || common::run(&mut cmd, RUN))
        .await
        .expect("the launcher's run");
    let all = show(&out);
    assert_eq!(out.code(), 0, "{all}");
    let o = &out.stdout;

    // Rank 1 froze in its first process, and was started again in another.
    let fault = rank_lines(o, "fault stop ");
    assert_eq!(fault.len(), 1, "{all}");
    assert_eq!(fault[0].0, 1, "{all}");
    let frozen = field(fault[0].1, "pid").to_owned();
    let fault_t: f64 = field(fault[0].1, "t").parse().unwrap();
    let registered = pids_of(o, "registered ", 1);
    assert_eq!(registered.len(), 2, "rank 1 registered twice: {all}");
    assert_eq!(registered[0], frozen, "{all}");
    let replacement = registered[1].clone();
    assert_ne!(replacement, frozen, "{all}");
    // The frozen process is gone (killed and reaped).
    assert_eq!(
        common::proc_state(frozen.parse().unwrap()),
        None,
        "frozen pid {frozen} still there\n{all}"
    );
    assert!(
        out.stderr
            .contains(&format!("replacing rank 1 (pid {frozen}) in restart 1")),
        "{all}"
    );
    assert_eq!(
        out.stderr.contains(&format!(
            "rank 1: warm start from standby pid {replacement} "
        )),
        warm,
        "{all}"
    );

    let mut weights = Vec::new();
    for rank in 0..world {
        let first = pids_of(o, "registered ", rank)[0].clone();
        let want = if rank == 1 { &replacement } else { &first };
        if rank != 1 {
            assert_eq!(
                pids_of(o, "registered ", rank).len(),
                1,
                "rank {rank} registered once: {all}"
            );
        }
        // Its next attempt, in its original process (rank 1: the
        // replacement), on restart count 1, from the same checkpoint.
        let attempts: Vec<(u32, &str)> = rank_lines(o, "attempt restart_count=1 ")
            .into_iter()
            .filter(|(r, _)| *r == rank)
            .collect();
        assert_eq!(attempts.len(), 1, "rank {rank}: {all}");
        assert_eq!(field(attempts[0].1, "pid"), want, "rank {rank}: {all}");
        assert!(
            rank_lines(o, "stepping restart_count=1 ")
                .iter()
                .any(|(r, l)| *r == rank && field(l, "pid") == want),
            "rank {rank} steps again: {all}"
        );
        let done: Vec<(u32, &str)> = rank_lines(o, "done ")
            .into_iter()
            .filter(|(r, _)| *r == rank)
            .collect();
        assert_eq!(done.len(), 1, "rank {rank}: {all}");
        assert_eq!(field(done[0].1, "pid"), want, "rank {rank}: {all}");
        assert_eq!(field(done[0].1, "restart_count"), "1", "rank {rank}: {all}");
        weights.push(field(done[0].1, "weights").to_owned());
    }
    let starts: Vec<&str> = rank_lines(o, "attempt restart_count=1 ")
        .iter()
        .map(|(_, l)| field(l, "start"))
        .collect();
    assert!(
        starts.iter().all(|s| *s == starts[0]),
        "one checkpoint: {starts:?}\n{all}"
    );
    assert!(
        weights.iter().all(|w| *w == weights[0]),
        "identical weights on every rank: {weights:?}\n{all}"
    );
    // No in-job restart: one attempt directory.
    assert!(
        !dir.path().join(format!("logs/{job}/attempt_1")).exists(),
        "{all}"
    );

    // The agent's side: rank 1 replaced well before the in-process
    // restart's timeout, which never fired.
    let mut events = Events::all(&agent).await;
    let replace = events
        .expect(&agent, SLOW, "restart.replace_ranks", |e| {
            e.kind == "restart.replace_ranks"
        })
        .await;
    assert_eq!(
        evidence(&replace, "ranks"),
        Some("1"),
        "{}",
        describe(&replace)
    );
    let at = replace.time.unwrap();
    let replace_t = at.seconds as f64 + f64::from(at.nanos) / 1e9;
    let done = events
        .expect(&agent, SLOW, "restart.acknowledged", |e| {
            e.kind == "restart.acknowledged"
        })
        .await;
    assert_eq!(
        evidence(&done, "gone"),
        Some("1 (replaced by its launcher)"),
        "{}",
        describe(&done)
    );
    // Every other rank, as the agent writes a list of ranks.
    let others = if world == 4 { "0,2,3" } else { "0" };
    assert_eq!(
        evidence(&done, "acknowledged"),
        Some(others),
        "{}",
        describe(&done)
    );
    assert_eq!(
        events.count("restart.in_process_timeout", ""),
        0,
        "{}",
        events.summary()
    );
    let replaced_after = replace_t - fault_t;
    let back = rank_lines(o, "stepping restart_count=1 ")
        .iter()
        .map(|(_, l)| field(l, "t").parse::<f64>().unwrap() - fault_t)
        .fold(0.0, f64::max);
    assert!(
        replaced_after < 15.0,
        "replaced {replaced_after:.1} s after the freeze: not well under the 30 s timeout"
    );
    eprintln!(
        "{world} ranks, rank 1 frozen: replaced {replaced_after:.2} s after the freeze (pid {frozen} -> {replacement}, {}), every rank stepping again after {back:.2} s",
        if warm { "warm" } else { "cold" }
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rank_frozen_with_sigstop_two_ranks_is_replaced_while_its_peer_restarts_in_process() {
    if torch_available() {
        frozen_rank_is_replaced("torch-frozen-2", 2, true).await;
    }
}

// Four ranks, cold (no standby): the replacement imports torch while its
// three peers wait for it in their next attempt's init_process_group.
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_frozen_with_sigstop_four_ranks_is_replaced_while_its_peers_restart_in_process() {
    if torch_available() {
        frozen_rank_is_replaced("torch-frozen-4", 4, false).await;
    }
}

/// Issue 35: both ranks of a real torch job finish their training, close
/// their clients (DeregisterRank) and then abort (`os.abort()`, as torch's
/// gloo teardown does with "terminate called without an active
/// exception"). The job ends with exit 0, no second attempt, and the
/// summary names both ranks as aborted at exit and why.
#[tokio::test(flavor = "multi_thread")]
async fn every_rank_aborting_at_exit_after_its_training_ends_the_job_with_exit_0() {
    if !torch_available() {
        return;
    }
    let (_state, agent) = start_agent();
    let dir = tempfile::Builder::new()
        .prefix("warden-teardown-")
        .tempdir()
        .unwrap();
    let (ckpt, store) = (dir.path().join("ckpt"), dir.path().join("store"));
    std::fs::create_dir(&ckpt).unwrap();
    std::fs::create_dir(&store).unwrap();
    let summary_path = dir.path().join("summary.json");
    let mut cmd = std::process::Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(agent.socket())
        .arg("run")
        .args(["--nproc-per-node", "2", "--rdzv-id", "torch-teardown"])
        .arg("--no-standby")
        .arg("--log-dir")
        .arg(dir.path().join("logs"))
        .arg("--summary-json")
        .arg(&summary_path)
        .arg("--")
        .arg(python())
        .arg(repo_root().join("tests/fixtures/torch_rank.py"))
        .arg("--checkpoint-dir")
        .arg(&ckpt)
        .arg("--store-dir")
        .arg(&store)
        .args(["--steps", "12", "--step-ms", "10", "--abort-at-exit"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("WARDEN_SOCKET")
        .current_dir(dir.path());
    let out = tokio::task::spawn_blocking(move || common::run(&mut cmd, RUN))
        .await
        .expect("the launcher's run");
    let all = show(&out);
    assert_eq!(out.code(), 0, "{all}");
    let o = &out.stdout;
    // Each rank trained once to its end, then aborted; nothing ran again.
    for rank in 0..2 {
        assert_eq!(
            pids_of(o, "registered ", rank).len(),
            1,
            "rank {rank}: {all}"
        );
        assert_eq!(pids_of(o, "aborting ", rank).len(), 1, "rank {rank}: {all}");
        let done: Vec<(u32, &str)> = rank_lines(o, "done ")
            .into_iter()
            .filter(|(r, _)| *r == rank)
            .collect();
        assert_eq!(done.len(), 1, "rank {rank}: {all}");
        assert_eq!(field(done[0].1, "restart_count"), "0", "rank {rank}: {all}");
    }
    assert!(
        rank_lines(o, "attempt restart_count=1 ").is_empty(),
        "{all}"
    );
    assert!(
        out.stderr.contains(
            "every worker ended its training: the job succeeded; ranks 0,1 failed in their teardown"
        ),
        "{all}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&summary_path).unwrap()).unwrap();
    assert_eq!(summary["exit_code"], 0, "{summary:#}");
    let attempts = summary["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 1, "{summary:#}");
    let aborted: Vec<u64> = attempts[0]["aborted_at_exit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["rank"].as_u64().unwrap())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(aborted, [0, 1], "{summary:#}");
    for x in attempts[0]["aborted_at_exit"].as_array().unwrap() {
        assert_eq!(x["status"], "signal 6 (SIGABRT)", "{summary:#}");
        assert!(
            x["why"].as_str().unwrap().contains("deregistered cleanly"),
            "{summary:#}"
        );
    }
    assert!(
        attempts[0]["failures"].as_array().unwrap().is_empty(),
        "{summary:#}"
    );
}
