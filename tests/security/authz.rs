//! Identities and authorization on the Unix socket (issue 18, points 2 and
//! 3 as a local user can try them, and the bounds): a member of the socket
//! group, in its own process, tries to register someone else's process,
//! act on another user's job, forge or read its checkpoints, lift the
//! node's cordon and exhaust the agent; each is refused naming the rule,
//! and the victim's job is as it was.

use serde_json::{Map, Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;
use warden_proto::v1::peer_client::PeerClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{TestAgent, WAIT, within};

type Channel = tonic::transport::Channel;

async fn channel(args: &Value) -> Channel {
    warden_cli::Target::Unix(socket_arg(args))
        .channel()
        .await
        .expect("the member connects (it is in the socket group)")
}

fn register(job: &str, rank: u32, world: u32, pid: u32, signal: i32) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: rank,
        local_rank: rank,
        world_size: world,
        pid,
        host: "attacker".to_owned(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: signal,
        devices: Vec::new(),
    }
}

/// Every call a hostile member of the socket group would try against the
/// victim's job (`args.job`), the root process `args.pid`, and the agent;
/// the result of each by name.
pub fn attack_everything(args: &Value) -> Value {
    block_on(async {
        let ch = channel(args).await;
        let mut c = AgentClient::new(ch.clone());
        let mut peer = PeerClient::new(ch);
        let job = args["job"].as_str().expect("the victim's job").to_owned();
        let victim_pid = u32::try_from(args["pid"].as_u64().expect("the victim's pid")).unwrap();
        let me = std::process::id();
        let mut out = Map::new();
        let mut put = |k: &str, v: Value| {
            out.insert(k.to_owned(), v);
        };
        // The health gate first, while the caller owns no job here.
        put(
            "run_health_gate",
            call_result(
                c.run_health_gate(pb::RunHealthGateRequest::default()).await,
                |_| json!({}),
            ),
        );
        // Point 2: a root process registered as a rank, with SIGKILL as its
        // "stack dump signal"; then with a harmless signal, in a job of our own.
        put(
            "register_foreign_pid_sigkill",
            call_result(
                c.register_rank(register("mine", 0, 1, victim_pid, 9)).await,
                |_| json!({}),
            ),
        );
        put(
            "register_foreign_pid",
            call_result(
                c.register_rank(register("mine", 0, 1, victim_pid, libc::SIGUSR2))
                    .await,
                |_| json!({}),
            ),
        );
        put(
            "register_own_pid_sigkill",
            call_result(c.register_rank(register("mine", 0, 1, me, 9)).await, |_| {
                json!({})
            }),
        );
        // Joining the victim's job with our own process.
        put(
            "register_into_victims_job",
            call_result(c.register_rank(register(&job, 1, 2, me, 0)).await, |_| {
                json!({})
            }),
        );
        // Point 3 on the socket: control of the victim's job and the node.
        put(
            "uncordon",
            call_result(
                c.uncordon(pb::UncordonRequest {
                    reason: "attacker".into(),
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "stop_ranks",
            call_result(
                c.stop_ranks(pb::StopRanksRequest {
                    job_id: job.clone(),
                    ranks: Vec::new(),
                    reason: "attacker".into(),
                    ..Default::default()
                })
                .await,
                |_| json!({}),
            ),
        );
        // A notice for the victim's job (what `warden run --term-grace`
        // sends its own job on SIGTERM): would make its ranks save and leave.
        put(
            "stop_ranks_preempted",
            call_result(
                c.stop_ranks(pb::StopRanksRequest {
                    job_id: job.clone(),
                    ranks: Vec::new(),
                    reason: "attacker: preempted".into(),
                    kind: pb::StopKind::Preempted as i32,
                    notice_deadline_unix_ms: u64::MAX,
                    notice_save_at_step: Some(u64::MAX),
                    notice_lead_ms: u32::MAX,
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "report_job_stop",
            call_result(
                c.report_job_stop(pb::ReportJobStopRequest {
                    job_id: job.clone(),
                    reason: pb::JobStopReason::NoProgress as i32,
                    summary: "attacker".into(),
                    exit_code: 88,
                    ..Default::default()
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "request_restart",
            call_result(
                c.request_restart(pb::RequestRestartRequest {
                    job_id: job.clone(),
                    reason: "attacker".into(),
                    ..Default::default()
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "set_checkpoint_peers",
            call_result(
                c.set_checkpoint_peers(pb::SetCheckpointPeersRequest {
                    job_id: job.clone(),
                    peers: vec![pb::CheckpointPeer {
                        addr: "127.0.0.9:7411".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "close_goodput",
            call_result(
                c.close_goodput(pb::CloseGoodputRequest {
                    job_id: job.clone(),
                })
                .await,
                |_| json!({}),
            ),
        );
        // Checkpoint forgery and theft through the rank calls.
        put(
            "begin_shard",
            call_result(
                c.begin_shard(pb::BeginShardRequest {
                    job_id: job.clone(),
                    rank: 0,
                    step: 1_000_000,
                    size_bytes: 8,
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "restore",
            call_result(
                c.restore(pb::RestoreRequest {
                    job_id: job.clone(),
                    rank: 0,
                    step: 0,
                })
                .await,
                |r| json!({"path": r.into_inner().path}),
            ),
        );
        // ... and through the Peer service on the socket.
        let fetched = async {
            let mut s = peer
                .fetch_shard(pb::FetchShardRequest {
                    job_id: job.clone(),
                    step: 1,
                    rank: 0,
                })
                .await?
                .into_inner();
            let mut n = 0usize;
            while let Some(chunk) = s.message().await? {
                n += chunk.data.len();
            }
            Ok::<usize, tonic::Status>(n)
        }
        .await;
        put("fetch_shard", call_result(fetched, |n| json!({"bytes": n})));
        let pushed = peer
            .push_shard(tokio_stream::iter(vec![pb::ShardChunk {
                info: Some(pb::ShardInfo {
                    job_id: job.clone(),
                    step: 1_000_000,
                    rank: 0,
                    world_size: 1,
                    size_bytes: 3,
                    xxh3: xxhash_rust::xxh3::xxh3_64(b"1e9"),
                    origin: "victim-host".into(),
                }),
                data: b"1e9".to_vec().into(),
            }]))
            .await;
        put("push_shard", call_result(pushed, |_| json!({})));
        put(
            "list_shards",
            call_result(
                peer.list_shards(pb::ListShardsRequest::default()).await,
                |r| json!({"shards": r.into_inner().shards.len()}),
            ),
        );
        put(
            "collect_holdings",
            call_result(
                peer.collect_holdings(pb::HoldingsAsk {
                    job_id: "victim".into(),
                    limit_ms: 1000,
                    ..Default::default()
                })
                .await,
                |r| json!({"steps": r.into_inner().steps.len()}),
            ),
        );
        // Reads stay open to the socket group.
        put(
            "get_ranks",
            call_result(
                c.get_ranks(pb::GetRanksRequest::default()).await,
                |r| json!({"ranks": r.into_inner().ranks.len()}),
            ),
        );
        // Bounds: counts and sizes the caller controls, in a job of its own.
        put(
            "world_size_2_32",
            call_result(
                c.register_rank(register("huge", 0, u32::MAX, me, 0)).await,
                |_| json!({}),
            ),
        );
        put(
            "commit_world_size_2_32",
            call_result(
                c.commit_shard(pb::CommitShardRequest {
                    job_id: "huge".into(),
                    rank: 0,
                    step: 1,
                    token: "x".into(),
                    size_bytes: 1,
                    world_size: u32::MAX,
                    stall_ns: 0,
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "restore_step_2_64",
            call_result(
                c.restore(pb::RestoreRequest {
                    job_id: "huge".into(),
                    rank: 0,
                    step: u64::MAX,
                })
                .await,
                |_| json!({}),
            ),
        );
        put(
            "long_job_id",
            call_result(
                c.begin_shard(pb::BeginShardRequest {
                    job_id: "j".repeat(100_000),
                    rank: 0,
                    step: 1,
                    size_bytes: 1,
                })
                .await,
                |_| json!({}),
            ),
        );
        // One process taking every slot: ranks.max_per_process (3 in the test).
        let mut per_process = Vec::new();
        for rank in 0..5 {
            let r = c.register_rank(register("many", rank, 5, me, 0)).await;
            per_process.push(call_result(r, |_| json!({})));
        }
        put("per_process", Value::Array(per_process));
        Value::Object(out)
    })
}

fn refused(out: &Value, call: &str, code: &str, says: &[&str]) {
    let r = &out[call];
    assert_eq!(r["ok"], json!(false), "{call} was answered: {r}");
    assert_eq!(r["code"], json!(code), "{call}: {r}");
    let msg = r["message"].as_str().unwrap_or_default();
    for s in says {
        assert!(msg.contains(s), "{call}: {msg:?} does not say {s:?}");
    }
}

/// The whole local replay: a root victim (a job with a registered rank and
/// a saved step, and a root `sleep` standing for any root process) and a
/// member of the socket group trying everything above.
#[tokio::test(flavor = "multi_thread")]
async fn a_socket_group_member_cannot_reach_what_is_not_its_own() {
    let agent = TestAgent::start_shared("[ranks]\nmax_per_process = 3\n");
    let u = users::users();
    // The victim: root's job "victim", one rank (this test process), a
    // committed step 1.
    let mut c = agent.client().await;
    let victim = c
        .register_rank(register("victim", 0, 1, std::process::id(), 0))
        .await
        .expect("root registers its own rank")
        .into_inner();
    let begin = c
        .begin_shard(pb::BeginShardRequest {
            job_id: "victim".into(),
            rank: 0,
            step: 1,
            size_bytes: 4,
        })
        .await
        .expect("BeginShard")
        .into_inner();
    std::fs::write(&begin.staging_path, b"w=1.").expect("write the shard");
    c.commit_shard(pb::CommitShardRequest {
        job_id: "victim".into(),
        rank: 0,
        step: 1,
        token: begin.token,
        size_bytes: 4,
        world_size: 1,
        stall_ns: 0,
    })
    .await
    .expect("CommitShard");
    let listed_before = crate::common::eventually(WAIT, "the victim's step 1 listed", || {
        let mut c = c.clone();
        async move {
            let l = c
                .list_checkpoints(pb::ListCheckpointsRequest {
                    job_id: "victim".into(),
                    ..Default::default()
                })
                .await
                .ok()?
                .into_inner();
            l.steps.iter().any(|s| s.complete).then_some(l)
        }
    })
    .await;
    let mut sleeper = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .expect("a root process");
    let args = json!({"socket": agent.socket(), "job": "victim", "pid": sleeper.id()});
    let out = within(WAIT * 6, "the attack process", async move {
        tokio::task::spawn_blocking(move || users::run_as(&u.member, "authz.everything", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;

    refused(
        &out,
        "register_foreign_pid_sigkill",
        "PermissionDenied",
        &["is not the caller"],
    );
    refused(
        &out,
        "register_foreign_pid",
        "PermissionDenied",
        &[
            "is not the caller",
            "rule: a rank registers only its own process",
        ],
    );
    refused(
        &out,
        "register_own_pid_sigkill",
        "InvalidArgument",
        &["stack_dump_signal"],
    );
    refused(
        &out,
        "register_into_victims_job",
        "PermissionDenied",
        &["belongs to uid 0", "rule: the job's owner"],
    );
    refused(&out, "uncordon", "PermissionDenied", &["rule: admins only"]);
    for call in [
        "stop_ranks",
        "stop_ranks_preempted",
        "report_job_stop",
        "request_restart",
        "set_checkpoint_peers",
        "close_goodput",
        "begin_shard",
        "restore",
    ] {
        refused(
            &out,
            call,
            "PermissionDenied",
            &["belongs to uid 0", "rule:"],
        );
    }
    refused(
        &out,
        "run_health_gate",
        "PermissionDenied",
        &["owns no job here", "rule: an admin, or the owner"],
    );
    for call in [
        "fetch_shard",
        "push_shard",
        "list_shards",
        "collect_holdings",
    ] {
        refused(
            &out,
            call,
            "PermissionDenied",
            &["warden.v1.Peer service on the Unix socket is for admins only"],
        );
    }
    assert_eq!(out["get_ranks"]["ok"], json!(true), "reads are open: {out}");
    refused(
        &out,
        "world_size_2_32",
        "InvalidArgument",
        &["ranks.max_world_size"],
    );
    refused(
        &out,
        "commit_world_size_2_32",
        "InvalidArgument",
        &["ranks.max_world_size"],
    );
    refused(
        &out,
        "restore_step_2_64",
        "InvalidArgument",
        &["step 18446744073709551615"],
    );
    refused(&out, "long_job_id", "InvalidArgument", &["job_id"]);
    let per: Vec<bool> = out["per_process"]
        .as_array()
        .expect("per_process results")
        .iter()
        .map(|r| r["ok"] == json!(true))
        .collect();
    assert_eq!(per, vec![true, true, true, false, false], "{out}");
    let fourth = &out["per_process"][3];
    assert_eq!(fourth["code"], json!("ResourceExhausted"), "{fourth}");
    assert!(
        fourth["message"]
            .as_str()
            .unwrap_or_default()
            .contains("ranks.max_per_process = 3"),
        "{fourth}"
    );

    // Nothing changed: the root process lives, the victim's rank is still
    // running (not stopping, not restarted), its steps are the ones it saved.
    assert!(
        sleeper.try_wait().expect("the sleeper").is_none(),
        "the root process was signalled"
    );
    let ranks = c
        .get_ranks(pb::GetRanksRequest {
            job_id: "victim".into(),
        })
        .await
        .expect("GetRanks")
        .into_inner()
        .ranks;
    assert_eq!(ranks.len(), 1, "{ranks:?}");
    assert_eq!(ranks[0].pid, std::process::id(), "{ranks:?}");
    assert_eq!(ranks[0].slot_index, victim.slot_index, "{ranks:?}");
    assert_eq!(ranks[0].state, "running", "{ranks:?}");
    let listed_after = c
        .list_checkpoints(pb::ListCheckpointsRequest {
            job_id: "victim".into(),
            ..Default::default()
        })
        .await
        .expect("ListCheckpoints")
        .into_inner();
    assert_eq!(listed_after.steps, listed_before.steps);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}

/// A rank of this user registers itself and writes to the stack-dump file
/// the agent made for it; the path it was given, and whether it could.
pub fn attack_stack_file(args: &Value) -> Value {
    block_on(async {
        let mut c = AgentClient::new(channel(args).await);
        let r = c
            .register_rank(register("own-job", 0, 1, std::process::id(), libc::SIGUSR2))
            .await;
        call_result(r, |r| {
            let r = r.into_inner();
            let path = r.stack_dump_path;
            let wrote = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .and_then(|mut f| {
                    std::io::Write::write_all(&mut f, b"Thread 0x1 (most recent call first):\n")
                });
            json!({"path": path, "wrote": wrote.is_ok()})
        })
    })
}

/// The stack-dump file is the agent's making: a random name in its own
/// directory (0711), handed to the rank's uid, which can write it; nobody
/// could have planted a link at its name beforehand.
#[tokio::test(flavor = "multi_thread")]
async fn a_ranks_stack_dump_file_is_made_for_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let args = json!({"socket": agent.socket()});
    let out = within(WAIT * 6, "the rank process", async move {
        tokio::task::spawn_blocking(move || users::run_as(&u.member, "authz.stack_file", &args))
            .await
            .expect("run the rank")
    })
    .await
    .result;
    assert_eq!(out["ok"], json!(true), "{out}");
    assert_eq!(
        out["wrote"],
        json!(true),
        "the rank could not write its dump file: {out}"
    );
    let path = std::path::PathBuf::from(out["path"].as_str().unwrap());
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("own-job-0.") && name.len() > "own-job-0.".len() + 16,
        "{name}: not a random name"
    );
    let file = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(file.uid(), u.member.uid, "handed to the rank's uid");
    assert_eq!(file.mode() & 0o777, 0o600);
    assert!(file.len() > 0, "the rank's write landed");
    let dir = std::fs::symlink_metadata(path.parent().unwrap()).unwrap();
    assert_eq!(dir.uid(), 0, "the stacks directory is the agent's");
    assert_eq!(dir.permissions().mode() & 0o777, 0o711);
}
