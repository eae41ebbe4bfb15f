//! The checkpoint commit as a contract (issue 22), end to end with real
//! agents, real ranks (the Rust client library; a real Python rank) and
//! real kills:
//!
//! 1. A save answered "committed" survives a kill -9 of the agent right
//!    after the answer: the manifest is on disk before the answer, and the
//!    restarted agent restores the shard byte-exact.
//! 2. A restarted agent removes every half-written step (data without a
//!    manifest, staging and temporary leftovers) and publishes
//!    `ckpt.recovered` for each; a step whose manifest does not describe
//!    its data is moved whole to the quarantine (`ckpt.quarantined`),
//!    nothing in it deleted (issue 29).
//! 3. After an agent restart the first save succeeds (the client dials
//!    again before it answers); while the agent is down a save fails at
//!    once with an error naming the socket. The same from Python.
//! 4. The background scrub finds flipped bytes in a real tier, marks the
//!    copy corrupt (`warden ckpt ls` shows it), publishes `ckpt.corrupt`
//!    and a metric, and a restore goes to the peer's copy.
//! 5. Hostile sizes (world_size 2^32-1 on CommitShard and PushShard, rank
//!    and step at their maximum on Restore, a huge BeginShard) are refused
//!    with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for room), and the
//!    agent stays up.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{Events, TestAgent, checkpoint_rank, evidence, free_port, shard_bytes};
use warden_client::CheckpointError;
use warden_proto::v1 as pb;

fn step_dir(agent: &TestAgent, job: &str, step: u64) -> PathBuf {
    agent
        .home
        .path()
        .join("ckpt")
        .join(job)
        .join(format!("step-{step:020}"))
}

async fn list(agent: &TestAgent, job: &str) -> pb::ListCheckpointsResponse {
    agent
        .client()
        .await
        .list_checkpoints(pb::ListCheckpointsRequest {
            job_id: job.to_owned(),
            ..Default::default()
        })
        .await
        .expect("ListCheckpoints")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_answered_committed_survives_a_kill_9_right_after_the_answer() {
    let mut agent = TestAgent::start("");
    let home = agent.home.clone();
    for round in 1..=5u64 {
        let ck = checkpoint_rank(agent.socket(), "kc", 0, 1);
        // 4 MiB: hashing it takes long enough (milliseconds in a debug
        // build) that an agent answering before its seal, as before issue
        // 22, loses the race with the check below every time.
        let data = shard_bytes(round, 0, 4 << 20);
        ck.save(round, &data)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        // The answer came after the manifest was written: it is there now,
        // before anything else could have written it.
        let manifest = step_dir(&agent, "kc", round).join("rank-000000.json");
        assert!(
            manifest.is_file(),
            "round {round}: the save was answered but {} is absent",
            manifest.display()
        );
        agent.sigkill_and_wait();
        agent = TestAgent::start_in(home.clone());
        let r = checkpoint_rank(agent.socket(), "kc", 0, 1)
            .restore(round)
            .unwrap_or_else(|e| panic!("round {round}: restore: {e}\n{}", agent.stderr()))
            .expect("the committed step");
        assert_eq!(r.step, round);
        assert_eq!(r.tier, "local");
        assert!(
            r.read().expect("read") == data,
            "round {round}: bytes differ"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_removes_half_written_steps_and_says_so() {
    let mut agent = TestAgent::start("");
    let home = agent.home.clone();
    let ck = checkpoint_rank(agent.socket(), "hw", 0, 1);
    ck.save(1, &shard_bytes(1, 0, 4096)).expect("save 1");
    ck.save(2, &shard_bytes(2, 0, 4096)).expect("save 2");
    agent.sigkill_and_wait();

    // What a crash at each point could leave behind.
    let s1 = step_dir(&agent, "hw", 1);
    let s2 = step_dir(&agent, "hw", 2);
    let s3 = step_dir(&agent, "hw", 3);
    std::fs::create_dir(&s3).expect("step 3");
    let orphan = s3.join("rank-000000.bin");
    std::fs::write(&orphan, b"placed, never sealed").expect("orphan data");
    // Step 2's data is now of another size than its manifest says.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(s2.join("rank-000000.bin"))
        .expect("open step 2");
    std::io::Write::write_all(&mut f, b"more").expect("grow step 2");
    drop(f);
    let tmp = s1.join(".tmp-interrupted");
    std::fs::write(&tmp, b"{").expect("tmp");
    let staged = home.path().join("ckpt/.staging/leftover");
    std::fs::write(&staged, b"half a shard").expect("staging");

    let agent = TestAgent::start_in(home.clone());
    for gone in [&orphan, &s2, &tmp, &staged] {
        assert!(!gone.exists(), "{} is still there", gone.display());
    }
    assert!(!s3.exists(), "the empty step 3 directory is still there");
    // Step 1 was committed and is whole: kept.
    assert!(s1.join("rank-000000.json").is_file());
    // One ckpt.recovered event per file removed, in the order found.
    let mut want: Vec<String> = [&orphan, &tmp, &staged]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    // The tier walks its step directories in the directory's own order
    // (not sorted), each step's quarantine published beside its removals,
    // so step 2's ckpt.quarantined may come before any ckpt.recovered: both
    // kinds are read in one pass.
    let mut events = Events::all(&agent).await;
    let mut quarantined = None;
    while !want.is_empty() || quarantined.is_none() {
        let e = events
            .expect(
                &agent,
                Duration::from_secs(10),
                &format!(
                    "ckpt.recovered for {want:?}{}",
                    if quarantined.is_none() {
                        " and ckpt.quarantined for step 2"
                    } else {
                        ""
                    }
                ),
                |e| e.kind == "ckpt.recovered" || e.kind == "ckpt.quarantined",
            )
            .await;
        if e.kind == "ckpt.quarantined" {
            quarantined = Some(e);
            continue;
        }
        let path = evidence(&e, "path").unwrap_or_default().to_owned();
        want.retain(|p| *p != path);
    }
    // Step 2 went whole to the quarantine, its bytes kept as they were.
    let q = quarantined.expect("the loop ends with the quarantine seen");
    assert_eq!(
        evidence(&q, "path"),
        Some(s2.display().to_string().as_str())
    );
    let moved = PathBuf::from(evidence(&q, "moved_to").expect("moved_to"));
    assert!(
        moved.starts_with(home.path().join("ckpt/.quarantine")),
        "{moved:?}"
    );
    let mut grown = shard_bytes(2, 0, 4096);
    grown.extend_from_slice(b"more");
    assert!(std::fs::read(moved.join("rank-000000.bin")).expect("kept") == grown);
    assert!(moved.join("rank-000000.json").is_file());
    // The newest complete step is 1, byte-exact; 2 and 3 are not listed.
    let r = checkpoint_rank(agent.socket(), "hw", 0, 1)
        .restore(0)
        .expect("restore")
        .expect("a complete step");
    assert_eq!(r.step, 1);
    assert!(r.read().expect("read") == shard_bytes(1, 0, 4096));
    let l = list(&agent, "hw").await;
    assert_eq!(
        l.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        vec![1],
        "{l:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_save_after_an_agent_restart_succeeds_and_one_while_it_is_down_fails_fast() {
    let mut agent = TestAgent::start("");
    let home = agent.home.clone();
    let ck = checkpoint_rank(agent.socket(), "rc", 0, 1);
    ck.save(1, &shard_bytes(1, 0, 8192)).expect("save 1");
    // Restarted between two saves: the Checkpointer's connection is dead
    // and nothing told it so. The next save is the first after the
    // restart, and succeeds.
    agent.sigkill_and_wait();
    agent = TestAgent::start_in(home.clone());
    ck.save(2, &shard_bytes(2, 0, 8192))
        .unwrap_or_else(|e| panic!("the first save after a restart: {e}\n{}", agent.stderr()));

    agent.sigkill_and_wait();
    let t = Instant::now();
    let err = ck
        .save(2, &shard_bytes(2, 0, 8192))
        .expect_err("no agent: the save fails");
    // Fast: no retry loop while nobody listens (generous for a loaded CI).
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        matches!(err, CheckpointError::Connect { .. }),
        "a connect error naming the socket, got {err:?}"
    );
    assert!(
        err.to_string()
            .contains(&agent.socket().display().to_string()),
        "{err}"
    );

    let agent = TestAgent::start_in(home);
    // The same Checkpointer, its old connection dead: the first save after
    // the agent is back succeeds.
    let data = shard_bytes(3, 0, 8192);
    ck.save(3, &data)
        .unwrap_or_else(|e| panic!("the first save after the restart: {e}\n{}", agent.stderr()));
    let r = ck.restore(0).expect("restore").expect("step 3");
    assert_eq!(r.step, 3);
    assert!(r.read().expect("read") == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_rank_saves_again_after_an_agent_restart() {
    use std::io::{BufRead, BufReader, Write};
    let mut agent = TestAgent::start("");
    let home = agent.home.clone();
    // One save per line read; answers "ok N" or "err ...".
    let script = r#"
import sys, warden.checkpoint as ckpt
for line in sys.stdin:
    n = int(line)
    try:
        ckpt.save(n, bytes([n % 256]) * 65536)
        print("ok", n, flush=True)
    except ckpt.CheckpointError as e:
        print("err", str(e).replace("\n", " "), flush=True)
"#;
    let path = agent.home.path().join("saver.py");
    std::fs::write(&path, script).expect("write the script");
    let mut child = common::python_rank(&agent, &path.display().to_string(), "py", (0, 1), &[])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("python");
    let mut stdin = child.stdin.take().expect("stdin");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut ask = |n: u64| -> String {
        writeln!(stdin, "{n}").expect("write to the rank");
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the rank answers")
    };
    assert_eq!(ask(1), "ok 1");
    // Restarted between two saves: the next save succeeds.
    agent.sigkill_and_wait();
    agent = TestAgent::start_in(home.clone());
    let after = ask(2);
    assert_eq!(
        after,
        "ok 2",
        "the first save after a restart\n{}",
        agent.stderr()
    );
    // Down: the save fails with an error; back: the next one succeeds.
    agent.sigkill_and_wait();
    let down = ask(2);
    assert!(down.starts_with("err "), "{down}");
    let agent = TestAgent::start_in(home);
    let back = ask(3);
    assert_eq!(
        back,
        "ok 3",
        "the first save after the restart\n{}",
        agent.stderr()
    );
    drop(stdin);
    let _ = child.wait();
    let r = checkpoint_rank(agent.socket(), "py", 0, 1)
        .restore(0)
        .expect("restore")
        .expect("step 3");
    assert_eq!(r.step, 3);
    assert!(r.read().expect("read") == vec![3u8; 65536]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrub_marks_flipped_bytes_and_a_restore_takes_the_peers_copy() {
    let ips = ["127.0.0.2", "127.0.0.3"];
    let addrs: Vec<String> = ips
        .iter()
        .map(|ip| format!("{ip}:{}", free_port(ip)))
        .collect();
    let toml = |i: usize, extra: &str| {
        let j = 1 - i;
        format!(
            "[agent]\nhost_name = \"h{i}\"\n[api]\ntcp = \"{}\"\n{}\
             [checkpoint]\ndomain = \"rack{i}\"\nretry_interval = \"200ms\"\n{extra}\n\
             [[checkpoint.peers]]\naddr = \"{}\"\ndomain = \"rack{j}\"\nname = \"h{j}\"\n",
            addrs[i],
            common::pki::api_keys(&format!("h{i}")),
            addrs[j]
        )
    };
    let a = TestAgent::start(&toml(
        0,
        "scrub_bytes_per_sec = 100000000\nscrub_interval = \"100ms\"",
    ));
    let b = TestAgent::start(&toml(1, ""));
    let data = shard_bytes(5, 0, 1 << 20);
    checkpoint_rank(a.socket(), "sj", 0, 1)
        .save(5, &data)
        .expect("save");
    // Replicated to b before the local copy goes bad.
    common::eventually(Duration::from_secs(30), "the replica on h1", async || {
        let l = list(&b, "sj").await;
        l.steps
            .iter()
            .find(|s| {
                s.step == 5
                    && s.shards
                        .iter()
                        .any(|sh| sh.copies.iter().any(|c| c.tier == "local"))
            })
            .cloned()
    })
    .await;
    let mut events = Events::all(&a).await;
    // Flip bytes in place: same size, other content.
    let bin = step_dir(&a, "sj", 5).join("rank-000000.bin");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&bin)
        .expect("open the shard");
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(4096)).expect("seek");
    std::io::Write::write_all(&mut f, &[!data[4096], !data[4097]]).expect("flip");
    drop(f);
    let e = events
        .expect(
            &a,
            Duration::from_secs(30),
            "ckpt.corrupt from the scrub",
            |e| e.kind == "ckpt.corrupt" && evidence(e, "source") == Some("scrub"),
        )
        .await;
    assert_eq!(evidence(&e, "step"), Some("5"));
    // Listed as corrupt on h0, the step still complete through h1's copy.
    let l = list(&a, "sj").await;
    let s = l.steps.iter().find(|s| s.step == 5).expect("step 5 listed");
    let copies = &s.shards[0].copies;
    assert!(
        copies
            .iter()
            .any(|c| c.tier == "local" && !c.corrupt.is_empty()),
        "{copies:?}"
    );
    assert!(
        copies
            .iter()
            .any(|c| c.tier == "peer" && c.corrupt.is_empty()),
        "{copies:?}"
    );
    // The step's counts: the peer's copy good, h0's own corrupt.
    assert_eq!(
        (s.ranks_with_copy, s.good_copies, s.corrupt_copies),
        (1, 1, 1),
        "{s:?}"
    );
    assert!(s.missing_ranks.is_empty(), "{s:?}");
    let out = common::run(
        std::process::Command::new(common::WARDEN)
            .arg("--socket")
            .arg(a.socket())
            .args(["ckpt", "ls", "--job", "sj"]),
        Duration::from_secs(20),
    );
    assert_eq!(out.code(), 0, "{}", out.stderr);
    assert!(out.stdout.contains("local:h0(CORRUPT)"), "{}", out.stdout);
    let (scrape, text) = common::scrape(&a).await;
    assert!(
        common::sample(&scrape, "warden_ckpt_scrub_corrupt_total", &[]) >= 1.0,
        "{text}"
    );
    // A restore skips the marked copy and takes the peer's, byte-exact.
    let r = checkpoint_rank(a.socket(), "sj", 0, 1)
        .restore(5)
        .expect("restore")
        .expect("step 5");
    assert_eq!(r.tier, "peer", "{r:?}");
    assert!(r.read().expect("read") == data);
    // The good copy replaced the bad one and its mark.
    let l = list(&a, "sj").await;
    let copies = &l.steps[0].shards[0].copies;
    assert!(copies.iter().all(|c| c.corrupt.is_empty()), "{copies:?}");
}

/// The refusal's code and message; fails the test when it was accepted.
fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> (tonic::Code, String) {
    match r {
        Ok(a) => panic!("accepted: {a:?}"),
        Err(s) => (s.code(), s.message().to_owned()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_sizes_are_refused_and_the_agent_stays_up() {
    let agent = TestAgent::start("");
    let mut c = agent.client().await;
    let begin = |job: &str, size: u64| pb::BeginShardRequest {
        job_id: job.into(),
        rank: 0,
        step: 1,
        size_bytes: size,
    };
    // A real staging token, then a commit claiming 2^32-1 ranks.
    let staged = c
        .begin_shard(begin("hj", 16))
        .await
        .expect("begin")
        .into_inner();
    std::fs::write(&staged.staging_path, [0u8; 16]).expect("write");
    let (k, m) = code(
        c.commit_shard(pb::CommitShardRequest {
            job_id: "hj".into(),
            rank: 0,
            step: 1,
            token: staged.token.clone(),
            size_bytes: 16,
            world_size: u32::MAX,
            stall_ns: 0,
        })
        .await,
    );
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.contains("world_size"), "{m}");
    // PushShard (the Peer service, admins only on the socket: the test
    // runs as the agent's user) with the same world size.
    let chunk = pb::ShardChunk {
        info: Some(pb::ShardInfo {
            job_id: "hj".into(),
            step: 1,
            rank: 0,
            world_size: u32::MAX,
            size_bytes: 16,
            xxh3: 0,
            origin: "evil".into(),
        }),
        data: vec![0u8; 16].into(),
    };
    let pushed = warden_proto::v1::peer_client::PeerClient::new(agent.channel().await)
        .push_shard(tokio_stream::iter(vec![chunk]))
        .await;
    let (k, m) = code(pushed);
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.contains("world_size"), "{m}");
    // Restore at the largest rank and step.
    for (rank, step, field) in [(u32::MAX, 1, "rank"), (0, u64::MAX, "step")] {
        let (k, m) = code(
            c.restore(pb::RestoreRequest {
                job_id: "hj".into(),
                rank,
                step,
            })
            .await,
        );
        assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
        assert!(m.contains(field), "{m}");
    }
    // A job id far too long, on every checkpoint call that takes one.
    // The answer quotes it clipped: a 100 kB gRPC message header would
    // not reach the client at all.
    let long = "j".repeat(100_000);
    let (k, m) = code(c.begin_shard(begin(&long, 1)).await);
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.len() < 1024 && m.contains("job_id"), "{m}");
    let (k, m) = code(
        c.commit_shard(pb::CommitShardRequest {
            job_id: "hj".into(),
            rank: 0,
            step: 1,
            token: "t".repeat(100_000),
            size_bytes: 16,
            world_size: 1,
            stall_ns: 0,
        })
        .await,
    );
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.len() < 1024, "{m}");
    let (k, m) = code(
        agent
            .client()
            .await
            .list_checkpoints(pb::ListCheckpointsRequest {
                job_id: long.clone(),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.len() < 1024 && m.contains("100000 bytes"), "{m}");
    // BeginShard at the largest rank: refused before any room is made.
    let (k, m) = code(
        c.begin_shard(pb::BeginShardRequest {
            rank: u32::MAX,
            ..begin("hj", 16)
        })
        .await,
    );
    assert_eq!(k, tonic::Code::InvalidArgument, "{m}");
    assert!(m.contains("rank"), "{m}");
    // Room for 2^64-1 bytes: refused for room, with the numbers, and
    // nothing pruned for a shard that could never fit.
    let (k, m) = code(c.begin_shard(begin("hj", u64::MAX)).await);
    assert_eq!(k, tonic::Code::ResourceExhausted, "{m}");
    assert!(m.contains("nothing was pruned"), "{m}");
    // Still up, and the real save path still works.
    let r = c
        .restore(pb::RestoreRequest {
            job_id: "hj".into(),
            rank: 0,
            step: 0,
        })
        .await
        .expect("Restore after the hostile calls")
        .into_inner();
    assert!(!r.found);
    checkpoint_rank(agent.socket(), "hj", 0, 1)
        .save(2, b"fine")
        .expect("a save after the hostile calls");
    assert_eq!(
        common::proc_state(agent.pid()).map(|s| s != 'Z'),
        Some(true)
    );
}
