//! Files (issue 18, point 1): what a member of the socket group can make
//! the root agent read, write or follow in its checkpoint tier, state dir
//! and slot dir. Each attack runs as [`users::MEMBER`] in its own process.

use serde_json::{Value, json};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use warden_proto::v1 as pb;

use warden_proto::v1::agent_client::AgentClient;
use warden_proto::v1::peer_client::PeerClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{TestAgent, WAIT, within};

/// A client of the agent at the socket the arguments name.
async fn agent(args: &Value) -> Result<AgentClient<tonic::transport::Channel>, tonic::Status> {
    warden_cli::Target::Unix(socket_arg(args))
        .channel()
        .await
        .map(AgentClient::new)
        .map_err(|e| tonic::Status::unavailable(format!("{e:#}")))
}

/// GetAgentInfo: does the socket let this user in at all?
pub fn attack_info(args: &Value) -> Value {
    block_on(async {
        let r = match agent(args).await {
            Ok(mut c) => c.get_agent_info(pb::GetAgentInfoRequest {}).await,
            Err(s) => Err(s),
        };
        call_result(r, |i| json!({"version": i.into_inner().version}))
    })
}

/// The socket group decides who connects: the member is answered, the
/// stranger is not (the harness works, and so does `api.socket_group`).
#[tokio::test(flavor = "multi_thread")]
async fn only_the_socket_group_connects() {
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let args = json!({"socket": agent.socket()});
    let socket = agent.socket().to_owned();
    let meta = std::fs::metadata(&socket).expect("the socket");
    assert_eq!(meta.gid(), u.sock_gid, "api.socket_group chowns the socket");
    let (member, stranger) = within(WAIT * 6, "the two attack processes", async {
        tokio::task::spawn_blocking(move || {
            (
                users::run_as(&u.member, "socket.info", &args),
                users::run_as(&u.stranger, "socket.info", &args),
            )
        })
        .await
        .expect("run the attacks")
    })
    .await;
    assert_eq!(member.result["ok"], json!(true), "{member:?}");
    assert_eq!(stranger.result["ok"], json!(false), "{stranger:?}");
    assert!(
        stranger.str("message").contains("ermission denied"),
        "{stranger:?}"
    );
}

/// The error of a file operation as text ("ok" when it worked).
fn fs_result(r: std::io::Result<impl Sized>) -> String {
    match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => e.to_string(),
    }
}

/// FetchShard over the socket: the bytes that came back, or the status.
async fn fetch(args: &Value, job: &str, step: u64, rank: u32) -> Value {
    let channel = match warden_cli::Target::Unix(socket_arg(args)).channel().await {
        Ok(c) => c,
        Err(e) => return json!({"ok": false, "message": format!("{e:#}")}),
    };
    let mut peer = PeerClient::new(channel);
    let r = peer
        .fetch_shard(pb::FetchShardRequest {
            job_id: job.to_owned(),
            step,
            rank,
        })
        .await;
    let mut stream = match r {
        Ok(s) => s.into_inner(),
        Err(s) => return call_result::<()>(Err(s), |_| json!({})),
    };
    let mut bytes = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(c)) => bytes.extend_from_slice(&c.data),
            Ok(None) => break,
            Err(s) => return call_result::<()>(Err(s), |_| json!({})),
        }
    }
    json!({"ok": true, "bytes": String::from_utf8_lossy(&bytes)})
}

/// Attack 1, read: BeginShard, swap the staging file for a symlink to the
/// target, CommitShard with the target's size, FetchShard.
pub fn attack_read_via_staging(args: &Value) -> Value {
    block_on(async {
        let mut c = match agent(args).await {
            Ok(c) => c,
            Err(s) => return call_result::<()>(Err(s), |_| json!({})),
        };
        let target = args["target"].as_str().unwrap_or_default().to_owned();
        let size = args["size"].as_u64().unwrap_or(0);
        let begin = c
            .begin_shard(pb::BeginShardRequest {
                job_id: "victim".into(),
                rank: 0,
                step: 7,
                size_bytes: size,
            })
            .await;
        let begin = match begin {
            Ok(b) => b.into_inner(),
            Err(s) => return json!({"begin": call_result::<()>(Err(s), |_| json!({}))}),
        };
        let staged = PathBuf::from(&begin.staging_path);
        let unlink = fs_result(std::fs::remove_file(&staged));
        let symlink = fs_result(std::os::unix::fs::symlink(&target, &staged));
        let aside = staged.with_file_name("planted");
        let plant = fs_result(std::os::unix::fs::symlink(&target, &aside));
        let list = fs_result(std::fs::read_dir(staged.parent().unwrap_or(Path::new("/"))));
        let commit = c
            .commit_shard(pb::CommitShardRequest {
                job_id: "victim".into(),
                rank: 0,
                step: 7,
                token: begin.token.clone(),
                size_bytes: size,
                world_size: 1,
                stall_ns: 0,
            })
            .await;
        json!({
            "staging_path": begin.staging_path,
            "token": begin.token,
            "unlink": unlink,
            "symlink": symlink,
            "plant": plant,
            "list": list,
            "commit": call_result(commit, |_| json!({})),
            "fetch": fetch(args, "victim", 7, 0).await,
        })
    })
}

/// Attack 1, write: plant symlinks in the tier where the agent will write
/// (staging, a step directory), then a push of a replica and a save.
pub fn attack_plant_staging(args: &Value) -> Value {
    let target = args["target"].as_str().unwrap_or_default().to_owned();
    let tier = PathBuf::from(args["tier"].as_str().unwrap_or_default());
    let mut planted = serde_json::Map::new();
    for (i, dir) in [
        tier.join(".staging"),
        tier.join("victim"),
        tier.join("victim/step-00000000000000000009"),
    ]
    .iter()
    .enumerate()
    {
        let name = dir.join(format!("victim.9.0.{}-{i}", std::process::id()));
        planted.insert(
            dir.display().to_string(),
            json!(fs_result(std::os::unix::fs::symlink(&target, &name))),
        );
    }
    block_on(async {
        // A save of the member's own (it works: the file is the agent's
        // making, handed to the member).
        let save = warden_client::checkpoint::Checkpointer::new(options(args, "victim"))
            .map_err(|e| e.to_string())
            .and_then(|ck| {
                ck.save(9, b"ATTACKER BYTES")
                    .map(|s| s.path.display().to_string())
                    .map_err(|e| e.to_string())
            });
        json!({
            "planted": planted,
            "save": match save { Ok(p) => json!({"ok": true, "path": p}), Err(e) => json!({"ok": false, "message": e}) },
        })
    })
}

fn options(args: &Value, job: &str) -> warden_client::ConnectOptions {
    let mut o = warden_client::ConnectOptions::from_env_lossy();
    o.socket_path = socket_arg(args);
    o.job_id = job.to_owned();
    o.global_rank = 0;
    o.local_rank = 0;
    o.world_size = 1;
    o
}

/// A rank running as the member saves and restores through the client.
pub fn attack_save_restore(args: &Value) -> Value {
    let run = || -> Result<Value, String> {
        let ck = warden_client::checkpoint::Checkpointer::new(options(args, "member-job"))
            .map_err(|e| e.to_string())?;
        let saved = ck
            .save(3, b"the member's weights")
            .map_err(|e| e.to_string())?;
        let r = ck
            .restore(0)
            .map_err(|e| e.to_string())?
            .ok_or("no step to restore")?;
        let bytes = r.read().map_err(|e| e.to_string())?;
        Ok(json!({
            "ok": true,
            "saved": saved.path.display().to_string(),
            "step": r.step,
            "restored": String::from_utf8_lossy(&bytes),
        }))
    };
    run().unwrap_or_else(|e| json!({"ok": false, "message": e}))
}

/// A root-only 0600 file outside the tier, the attacks' target.
fn secret(agent: &TestAgent, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = agent.home.path().join("root-only");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let p = dir.join("secret");
    std::fs::write(&p, body).expect("write the secret");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    p
}

async fn as_member(attack: &'static str, args: Value) -> users::Outcome {
    let u = users::users();
    within(WAIT * 6, attack, async move {
        tokio::task::spawn_blocking(move || users::run_as(&u.member, attack, &args))
            .await
            .expect("run the attack")
    })
    .await
}

/// Attack 1 (read): the staging file cannot be swapped, the commit is
/// refused without the target's size, nothing of the target comes back.
#[tokio::test(flavor = "multi_thread")]
async fn the_staging_file_cannot_be_swapped_for_a_symlink_to_a_root_file() {
    let agent = TestAgent::start_shared("");
    let body = "ROOT ONLY SECRET 1234567";
    let target = secret(&agent, body);
    let out = as_member(
        "files.read_via_staging",
        json!({"socket": agent.socket(), "target": target, "size": body.len()}),
    )
    .await;
    let r = &out.result;
    for step in ["unlink", "symlink", "plant", "list"] {
        let why = r[step].as_str().unwrap_or_default();
        // The symlink meets the file the unlink could not remove.
        assert!(
            why.contains("ermission denied") || (step == "symlink" && why.contains("exists")),
            "{step}: {out:?}"
        );
    }
    assert_eq!(r["commit"]["ok"], json!(false), "{out:?}");
    let msg = r["commit"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("holds 0 bytes"),
        "the staged file is the agent's: {msg}"
    );
    assert!(!out.stdout.contains(body), "{out:?}");
    assert_eq!(r["fetch"]["ok"], json!(false), "{out:?}");
    assert_eq!(std::fs::read_to_string(&target).expect("target"), body);
    // The token is a random name, not the shard's key and the agent's pid.
    let token = r["token"].as_str().unwrap_or_default();
    assert_eq!(token.len(), 32, "{token}");
    assert!(!token.contains("victim") && !token.contains(&agent.pid().to_string()));
    // Modes of the tier as the member met them.
    let tier = agent.home.path().join("ckpt");
    for d in [tier.clone(), tier.join(".staging")] {
        let m = std::fs::metadata(&d).expect("tier dir");
        assert_eq!((m.mode() & 0o7777, m.uid()), (0o711, 0), "{}", d.display());
    }
}

/// Attack 1 (write): symlinks the member tries to plant are refused by
/// the directories; symlinks planted by root (standing in for any way in)
/// at the old predictable names are never opened; a save and a push land
/// in files the agent made.
#[tokio::test(flavor = "multi_thread")]
async fn planted_symlinks_in_the_tier_are_never_written_through() {
    let agent = TestAgent::start_shared("");
    let body = "ROOT ONLY, DO NOT OVERWRITE";
    let target = secret(&agent, body);
    let tier = agent.home.path().join("ckpt");
    // Root plants where only root can: old-style names in staging, and the
    // names a commit of step 9 rank 0 renames to.
    let step = tier.join("victim/step-00000000000000000009");
    std::fs::create_dir_all(&step).expect("mkdir");
    for n in 0..64 {
        let name = format!("victim.9.0.{}-{n}", agent.pid());
        std::os::unix::fs::symlink(&target, tier.join(".staging").join(name)).expect("plant");
    }
    std::os::unix::fs::symlink(&target, step.join("rank-000000.json")).expect("plant");
    let out = as_member(
        "files.plant_staging",
        json!({"socket": agent.socket(), "target": target, "tier": tier}),
    )
    .await;
    for (dir, r) in out.result["planted"].as_object().expect("planted") {
        assert!(
            r.as_str().unwrap_or_default().contains("ermission denied"),
            "{dir}: {out:?}"
        );
    }
    assert_eq!(out.result["save"]["ok"], json!(true), "{out:?}");
    // A replica pushed over the socket: written into a file of the agent's.
    let mut peer = PeerClient::new(agent.channel().await);
    let data = b"REPLICA".to_vec();
    let info = pb::ShardInfo {
        job_id: "victim".into(),
        step: 9,
        rank: 1,
        world_size: 2,
        size_bytes: data.len() as u64,
        xxh3: xxhash_rust::xxh3::xxh3_64(&data),
        origin: "elsewhere".into(),
    };
    let chunk = pb::ShardChunk {
        info: Some(info),
        data: data.into(),
    };
    peer.push_shard(tokio_stream::iter(vec![chunk]))
        .await
        .expect("PushShard");
    assert_eq!(std::fs::read_to_string(&target).expect("target"), body);
    let meta = std::fs::symlink_metadata(step.join("rank-000000.json")).expect("manifest");
    assert!(
        meta.file_type().is_file(),
        "the planted link was replaced, not followed"
    );
    let saved = std::fs::symlink_metadata(step.join("rank-000000.bin")).expect("shard");
    assert_eq!(saved.uid(), users::users().member.uid, "handed to the rank");
    assert_eq!(saved.mode() & 0o777, 0o600);
}

/// A symlink where the agent reads (a committed shard replaced by one, a
/// job directory that is one) is refused with the path, never followed.
#[tokio::test(flavor = "multi_thread")]
async fn symlinks_where_the_agent_reads_are_refused() {
    let agent = TestAgent::start_shared("");
    let body = "SECRET FOR READS";
    let target = secret(&agent, body);
    let ck = warden_client::checkpoint::Checkpointer::new(options(
        &json!({"socket": agent.socket()}),
        "j",
    ))
    .expect("checkpointer");
    let saved = tokio::task::spawn_blocking(move || ck.save(1, b"0123456789abcdef"))
        .await
        .expect("join")
        .expect("save");
    // Root swaps the committed bytes for a link to the secret (same size).
    std::fs::remove_file(&saved.path).expect("rm");
    std::os::unix::fs::symlink(&target, &saved.path).expect("plant");
    let r = fetch(&json!({"socket": agent.socket()}), "j", 1, 0).await;
    assert_eq!(r["ok"], json!(false), "{r}");
    assert!(!r.to_string().contains(body), "{r}");
    let mut c = agent.client().await;
    let restore = c
        .restore(pb::RestoreRequest {
            job_id: "j".into(),
            rank: 0,
            step: 0,
        })
        .await;
    assert!(
        restore.as_ref().map_or(true, |r| !r.get_ref().found),
        "{restore:?}"
    );
    // A job directory that is a symlink is left out of listings.
    std::os::unix::fs::symlink(
        agent.home.path().join("root-only"),
        agent.home.path().join("ckpt/linked"),
    )
    .expect("plant");
    let list = c
        .list_checkpoints(pb::ListCheckpointsRequest {
            job_id: "linked".into(),
            ..Default::default()
        })
        .await
        .expect("ListCheckpoints")
        .into_inner();
    assert!(list.steps.is_empty(), "{list:?}");
    assert_eq!(std::fs::read_to_string(&target).expect("target"), body);
    let log = agent.stderr();
    assert!(
        log.contains("symlink"),
        "the refusal is logged with its path:\n{log}"
    );
}

/// A rank running as the member (not the agent's user) saves and restores
/// through the Rust client: the staging file and the restored shard are
/// handed to it.
#[tokio::test(flavor = "multi_thread")]
async fn a_rank_of_another_user_saves_and_restores() {
    let agent = TestAgent::start_shared("");
    let out = as_member("files.save_restore", json!({"socket": agent.socket()})).await;
    assert_eq!(out.result["ok"], json!(true), "{out:?}\n{}", agent.stderr());
    assert_eq!(out.str("restored"), "the member's weights", "{out:?}");
    assert_eq!(out.result["step"], json!(3));
}

/// A state dir that is a symlink (to a directory of someone else's
/// choosing) is refused at start, with the key and the path.
#[test]
fn a_state_dir_that_is_a_symlink_is_refused_at_start() {
    let home = std::sync::Arc::new(crate::common::Home::new(""));
    let elsewhere = home.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    std::os::unix::fs::symlink(&elsewhere, home.path().join("state")).expect("plant");
    let mut agent = TestAgent::spawn(home, &[]);
    let status = agent.wait_exit(WAIT);
    assert!(!status.success(), "{status}");
    let err = agent.stderr();
    assert!(
        err.contains("agent.state_dir") && err.contains("symlink") && err.contains("state"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&elsewhere).expect("ls").count(),
        0,
        "nothing written through the link"
    );
}
