//! Issue 29, "Trust, round two", the agent's own files: what a member of
//! the socket group (or a stranger outside it) once did with the flight
//! recorder's dump, the checkpoint tier and the agent's state, replayed as
//! that user against a real wardend, and shown refused.
//!
//! 1. The flight recorder: the rank was handed a directory and built a
//!    30,000-deep chain in it; the agent's recursive removal overflowed
//!    its stack. Now it is handed one file the agent made, in the agent's
//!    own directory: nothing to build, nothing walked.
//! 2. (Issue point 4b.) A 16 MiB dump of `{}` entries cost the agent 790
//!    MB (1.38 GB for four ranks). Now the parser caps while it reads: the
//!    agent's peak memory (VmHWM) is measured around four such dumps.
//! 3. (Point 8.) The watched tier was `/dev/shm` (1777): a stranger filled
//!    it and the node went FAILED. Now the default is the agent's own tier,
//!    and a
//!    shared filesystem is DEGRADED at most, with the cause. A staging
//!    file took bytes past its declared size until commit; now it is cut.
//! 4. (Point 10.) A truncated `job-owners.json` dropped every claim (a
//!    stranger took a job over); a corrupt manifest made the agent delete
//!    intact shard data. Now claims fail closed and the step is
//!    quarantined.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, Ident, block_on, call_result, socket_arg};
use crate::common::{Events, TestAgent, WAIT, eventually, evidence, within};

/// Hang thresholds of about a second once calibrated, a flight-recorder
/// wait long enough for a 16 MiB write on a loaded machine.
const HANG: &str = "[agent]\ntick = \"50ms\"\n\
    [hang]\nfloor = \"1s\"\nwarmup_samples = 5\nstack_dump_wait = \"30s\"\nverdict_wait = \"5s\"\n";

/// The longest an attack waits for the agent (a hang to be found, a dump
/// asked for, an event): generous for a loaded 2-core machine.
const ATTACK_WAIT: Duration = Duration::from_secs(90);

fn fs_result(r: std::io::Result<impl Sized>) -> String {
    match r {
        Ok(_) => "ok".to_owned(),
        Err(e) => e.to_string(),
    }
}

async fn agent_client(args: &Value) -> Result<AgentClient<tonic::transport::Channel>, String> {
    warden_cli::Target::Unix(socket_arg(args))
        .channel()
        .await
        .map(AgentClient::new)
        .map_err(|e| format!("{e:#}"))
}

fn options(args: &Value, job: &str, rank: u32, world: u32) -> warden_client::ConnectOptions {
    let mut o = warden_client::ConnectOptions::from_env_lossy();
    o.socket_path = socket_arg(args);
    o.job_id = job.to_owned();
    o.global_rank = rank;
    o.local_rank = rank;
    o.world_size = world;
    o
}

/// Waits (bounded) until the agent has published `kind` about `subject`.
async fn wait_event(args: &Value, kind: &str, subject: &str) -> bool {
    let deadline = Instant::now() + ATTACK_WAIT;
    while Instant::now() < deadline {
        if let Ok(mut c) = agent_client(args).await
            && let Ok(r) = c
                .list_events(pb::ListEventsRequest {
                    after_id: 0,
                    limit: 0,
                })
                .await
            && r.into_inner()
                .events
                .iter()
                .any(|e| e.kind == kind && e.subject == subject)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// What a rank does with the file the agent names for its dump.
fn answer(path: &Path, huge: bool) -> Value {
    let dir = path.parent().unwrap_or(Path::new("/"));
    // The old attack: a chain of directories where the dump goes. Each
    // way to make one is tried.
    let unlink = fs_result(std::fs::remove_file(path));
    let mkdir_at = fs_result(std::fs::create_dir(path));
    let mkdir_beside = fs_result(std::fs::create_dir(dir.join("chain")));
    let file_beside = fs_result(std::fs::File::create(dir.join("planted")));
    let link_beside = fs_result(std::os::unix::fs::symlink("/", dir.join("loop")));
    let body = if huge {
        // 16 MiB of empty entries: the most bytes the agent reads.
        let cap = warden_core::detect::flight_recorder::MAX_DUMP_BYTES;
        let mut b = Vec::with_capacity(cap);
        b.extend_from_slice(b"{\"entries\":[{}");
        while b.len() + 5 <= cap {
            b.extend_from_slice(b",{}");
        }
        b.extend_from_slice(b"]}");
        b
    } else {
        br#"{"pg_status":{"0":{"last_enqueued_collective":"4","last_completed_collective":"4"}}}"#
            .to_vec()
    };
    let written = fs_result(warden_client::flight::write_dump(path, &body));
    json!({
        "path": path,
        "unlink": unlink,
        "mkdir_at": mkdir_at,
        "mkdir_beside": mkdir_beside,
        "file_beside": file_beside,
        "link_beside": link_beside,
        "written": written,
        "bytes": body.len(),
    })
}

/// As a member: `ranks` ranks of one job in this process, each answering
/// the agent's flight-recorder request with [`answer`]; they make steps,
/// then hang inside one until the agent has asked every rank and published
/// its verdict.
pub fn attack_flight(args: &Value) -> Value {
    let job = args["job"].as_str().unwrap_or("fr").to_owned();
    let ranks = u32::try_from(args["ranks"].as_u64().unwrap_or(1)).unwrap_or(1);
    let huge = args["huge"].as_bool().unwrap_or(false);
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    let mut clients = Vec::new();
    for r in 0..ranks {
        let c = match warden_client::Client::connect_with(options(args, &job, r, ranks)) {
            Ok(c) => c,
            Err(e) => return json!({"connect": e.to_string()}),
        };
        let tx = std::sync::Mutex::new(tx.clone());
        c.on_flight_recorder_dump(move |req| {
            let out = answer(&req.path, huge);
            let _ = tx.lock().map(|t| t.send(out));
        });
        clients.push(c);
    }
    for step in 1..=8u64 {
        for c in &clients {
            c.step_begin(step);
        }
        std::thread::sleep(Duration::from_millis(40));
        for c in &clients {
            c.step_end(step);
        }
    }
    // Hung inside step 9, as a rank stuck in a collective is.
    for c in &clients {
        c.step_begin(9);
    }
    let mut answers = Vec::new();
    let deadline = Instant::now() + ATTACK_WAIT;
    while answers.len() < ranks as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(a) => answers.push(a),
            Err(_) => break,
        }
    }
    let verdict = block_on(wait_event(args, "job.hang_verdict", &format!("job/{job}")));
    let left: Vec<bool> = answers
        .iter()
        .map(|a| Path::new(a["path"].as_str().unwrap_or("/")).exists())
        .collect();
    json!({"answers": answers, "verdict": verdict, "files_left": left})
}

fn vm_hwm_kib(pid: u32) -> u64 {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the agent's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the agent's fds")
        .count()
}

async fn as_user(who: Ident, attack: &'static str, args: Value) -> users::Outcome {
    within(ATTACK_WAIT * 2, attack, async move {
        tokio::task::spawn_blocking(move || users::run_as(&who, attack, &args))
            .await
            .expect("run the attack")
    })
    .await
}

fn member() -> Ident {
    users::users().member.clone()
}

fn stranger() -> Ident {
    users::users().stranger.clone()
}

/// Point 1: the rank gets one file in the agent's directory. It can remove,
/// replace or plant nothing there, so it has no tree for the agent to walk;
/// the agent reads its dump, removes that one name, and stays up with the
/// descriptors it had.
#[tokio::test(flavor = "multi_thread")]
async fn the_flight_recorder_hands_a_rank_no_directory_to_fill() {
    let agent = TestAgent::start_shared(HANG);
    let fds_before = fds(agent.pid());
    let out = as_user(
        member(),
        "state.flight",
        json!({"socket": agent.socket(), "job": "fr-chain", "ranks": 1}),
    )
    .await;
    let r = &out.result;
    assert_eq!(r["answers"].as_array().map(Vec::len), Some(1), "{out:?}");
    let a = &r["answers"][0];
    for step in ["unlink", "mkdir_beside", "file_beside", "link_beside"] {
        assert!(
            a[step]
                .as_str()
                .unwrap_or_default()
                .contains("ermission denied"),
            "{step}: {out:?}"
        );
    }
    assert!(
        a["mkdir_at"]
            .as_str()
            .unwrap_or_default()
            .contains("exists"),
        "{out:?}"
    );
    assert_eq!(a["written"], json!("ok"), "{out:?}");
    assert_eq!(r["verdict"], json!(true), "{out:?}\n{}", agent.stderr());
    assert_eq!(
        r["files_left"],
        json!([false]),
        "the agent removed its file"
    );
    // The file was the agent's making, directly in its own directory.
    let path = PathBuf::from(a["path"].as_str().expect("path"));
    let stacks = path.parent().expect("stacks");
    let m = std::fs::metadata(stacks).expect("stacks");
    assert_eq!((m.mode() & 0o7777, m.uid()), (0o711, 0));
    let left: Vec<String> = std::fs::read_dir(stacks)
        .expect("ls stacks")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".fr."))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // Up, answering at once, without descriptors piling up.
    let t0 = Instant::now();
    let h = agent.health().await;
    assert!(!h.components.is_empty());
    assert!(t0.elapsed() < WAIT, "health took {:?}", t0.elapsed());
    assert!(
        fds(agent.pid()) <= fds_before + 16,
        "{} fds before, {} after",
        fds_before,
        fds(agent.pid())
    );
}

/// Point 4b: four ranks each answer with 16 MiB of empty entries. The
/// agent refuses each dump (over the entries cap) having kept only the
/// cap's worth; its peak memory grows by well under 512 MiB (it grew by
/// 1.38 GB before).
#[tokio::test(flavor = "multi_thread")]
async fn four_dumps_of_empty_entries_cost_the_agent_little_memory() {
    let agent = TestAgent::start_shared(HANG);
    let before = vm_hwm_kib(agent.pid());
    let out = as_user(
        member(),
        "state.flight",
        json!({"socket": agent.socket(), "job": "fr-huge", "ranks": 4, "huge": true}),
    )
    .await;
    let r = &out.result;
    let answers = r["answers"].as_array().expect("answers");
    assert_eq!(answers.len(), 4, "{}", out.stdout);
    for a in answers {
        assert_eq!(a["written"], json!("ok"), "{a}");
        assert!(a["bytes"].as_u64().unwrap_or(0) > 16_000_000, "{a}");
    }
    assert_eq!(r["verdict"], json!(true), "{}", agent.stderr());
    let after = vm_hwm_kib(agent.pid());
    // Each dump was read and refused by its count, not left unread.
    let log = agent.stderr();
    let refused = log
        .lines()
        .filter(|l| l.contains("entries, over the cap of 20000 (refused)"))
        .count();
    assert_eq!(refused, 4, "{log}");
    let grew_mib = after.saturating_sub(before) / 1024;
    eprintln!("agent VmHWM {before} kB before, {after} kB after: +{grew_mib} MiB");
    assert!(
        grew_mib < 160 && after / 1024 < 320,
        "the agent's peak memory grew by {grew_mib} MiB to {} MiB",
        after / 1024
    );
}

/// A tmpfs mounted for one test, unmounted when dropped.
struct Mount(PathBuf);

impl Mount {
    fn tmpfs(at: &Path, options: &str) -> Self {
        std::fs::create_dir_all(at).expect("mount point");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(at)
            .output()
            .expect("run mount (the security tests run as root)");
        assert!(
            out.status.success(),
            "mount -t tmpfs -o {options} {}: {} (this test needs root allowed to mount a tmpfs)",
            at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(at.to_owned())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("--lazy")
            .arg(&self.0)
            .status();
    }
}

/// As anyone: fill `dir` with a file of `bytes`, and try to write into
/// the agent's tier `tier`.
pub fn attack_fill(args: &Value) -> Value {
    use std::io::Write;
    let dir = PathBuf::from(args["dir"].as_str().unwrap_or("/nonexistent"));
    let tier = PathBuf::from(args["tier"].as_str().unwrap_or("/nonexistent"));
    let bytes = usize::try_from(args["bytes"].as_u64().unwrap_or(0)).unwrap_or(0);
    let fill = std::fs::File::create(dir.join(format!("filler-{}", std::process::id())))
        .and_then(|mut f| f.write_all(&vec![0x5a; bytes]));
    let into_tier = std::fs::File::create(tier.join("mine"));
    let into_staging = std::fs::File::create(tier.join(".staging").join("mine"));
    json!({
        "fill": fs_result(fill),
        "into_tier": fs_result(into_tier),
        "into_staging": fs_result(into_staging),
    })
}

async fn disk_status(agent: &TestAgent, want: pb::Status) -> pb::Component {
    eventually(WAIT * 3, &format!("disk/checkpoint {want:?}"), async || {
        agent
            .component("disk/checkpoint")
            .await
            .filter(|c| c.status == want as i32)
    })
    .await
}

/// Point 8: the default watched tier is the agent's own. On a filesystem
/// others may write (a 1777 tmpfs, as /dev/shm is) a stranger fills it:
/// DEGRADED with the cause, never FAILED. On a filesystem of the agent's
/// own (a tmpfs mounted at the tier, 0711) nobody else can write, and a
/// shortage there is FAILED.
#[tokio::test(flavor = "multi_thread")]
async fn a_stranger_filling_a_shared_tier_degrades_but_never_fails_the_node() {
    let home = std::sync::Arc::new(crate::common::Home::shared(""));
    let shm = home.path().join("shm");
    let _shared = Mount::tmpfs(&shm, "size=16m,mode=1777");
    let tier = shm.join("warden-ckpt");
    // `host.checkpoint_dir` unset: the default, the tier itself.
    let cfg = format!(
        "[host]\npoll_interval = \"100ms\"\n[checkpoint]\ndir = \"{}\"\n[api]\nsocket_group = \"{}\"\n",
        tier.display(),
        users::SOCK_GROUP
    );
    std::fs::write(&home.config, crate::common::config_toml(&home.socket, &cfg)).expect("config");
    let agent = TestAgent::start_in(home.clone());
    let ok = disk_status(&agent, pb::Status::Ok).await;
    assert_eq!(ok.labels["path"], tier.display().to_string());
    assert!(ok.labels["shared"].contains("mounted at"), "{ok:?}");

    let out = as_user(
        stranger(),
        "state.fill",
        json!({"dir": shm, "tier": tier, "bytes": 16_500_000}),
    )
    .await;
    assert_eq!(out.result["fill"], json!("ok"), "{out:?}");
    for k in ["into_tier", "into_staging"] {
        assert!(out.str(k).contains("ermission denied"), "{k}: {out:?}");
    }
    let d = disk_status(&agent, pb::Status::Degraded).await;
    assert!(
        d.reasons[0].message.contains("shared with other users"),
        "{d:?}"
    );
    let h = agent.health().await;
    assert_ne!(h.status, pb::Status::Failed as i32, "{h:?}");

    // The agent's own filesystem, mounted at the tier: only it writes
    // there, and a shortage there is the node's.
    let own = home.path().join("own");
    let _own = Mount::tmpfs(&own, "size=4m,mode=0711,uid=0");
    let cfg = format!(
        "[host]\npoll_interval = \"100ms\"\n[checkpoint]\ndir = \"{}\"\n[api]\nsocket_group = \"{}\"\n",
        own.display(),
        users::SOCK_GROUP
    );
    drop(agent);
    std::fs::write(&home.config, crate::common::config_toml(&home.socket, &cfg)).expect("config");
    let agent = TestAgent::start_in(home.clone());
    let ok = disk_status(&agent, pb::Status::Ok).await;
    assert!(!ok.labels.contains_key("shared"), "{ok:?}");
    let out = as_user(
        stranger(),
        "state.fill",
        json!({"dir": own, "tier": own, "bytes": 1}),
    )
    .await;
    assert!(out.str("fill").contains("ermission denied"), "{out:?}");
    std::fs::write(own.join("the-agents-own"), vec![0u8; 4_150_000]).expect("fill as root");
    let f = disk_status(&agent, pb::Status::Failed).await;
    assert!(f.reasons[0].message.contains("may not fit"), "{f:?}");
}

/// As a member: BeginShard for 4 KiB, then write 64 MiB into the staging
/// file, wait (bounded) until the agent cuts it, and commit.
pub fn attack_staging_grow(args: &Value) -> Value {
    use std::io::Write;
    block_on(async {
        let mut c = match agent_client(args).await {
            Ok(c) => c,
            Err(e) => return json!({"connect": e}),
        };
        let begin = c
            .begin_shard(pb::BeginShardRequest {
                job_id: "grow".into(),
                rank: 0,
                step: 1,
                size_bytes: 4096,
            })
            .await;
        let begin = match begin {
            Ok(b) => b.into_inner(),
            Err(s) => return json!({"begin": call_result::<()>(Err(s), |_| json!({}))}),
        };
        let mut f = match std::fs::OpenOptions::new()
            .write(true)
            .open(&begin.staging_path)
        {
            Ok(f) => f,
            Err(e) => return json!({"open": e.to_string()}),
        };
        let chunk = vec![0x33u8; 1 << 20];
        let mut wrote = 0u64;
        for _ in 0..64 {
            if f.write_all(&chunk).is_ok() {
                wrote += chunk.len() as u64;
            }
        }
        let deadline = Instant::now() + ATTACK_WAIT;
        let mut cut = false;
        while Instant::now() < deadline {
            if f.metadata().map(|m| m.len()).unwrap_or(u64::MAX) == 0 {
                cut = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Writing exactly the declared size now does not make it whole.
        let _ = std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(0));
        let rewrite = fs_result(f.write_all(&[1u8; 4096]));
        let commit = c
            .commit_shard(pb::CommitShardRequest {
                job_id: "grow".into(),
                rank: 0,
                step: 1,
                token: begin.token.clone(),
                size_bytes: 4096,
                world_size: 1,
                stall_ns: 0,
            })
            .await;
        json!({
            "wrote": wrote,
            "cut": cut,
            "rewrite": rewrite,
            "commit": call_result(commit, |_| json!({})),
        })
    })
}

/// Point 8, staging: bytes past the declared size are cut (the space
/// freed while the rank still holds the file) and the commit is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_staging_file_cannot_grow_past_its_declared_size() {
    let agent = TestAgent::start_shared("");
    let mut events = Events::all(&agent).await;
    let out = as_user(
        member(),
        "state.staging_grow",
        json!({"socket": agent.socket()}),
    )
    .await;
    let r = &out.result;
    assert_eq!(r["wrote"], json!(64u64 << 20), "{out:?}");
    assert_eq!(r["cut"], json!(true), "{out:?}");
    assert_eq!(r["rewrite"], json!("ok"), "{out:?}");
    assert_eq!(r["commit"]["ok"], json!(false), "{out:?}");
    assert!(
        r["commit"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("past the 4096 bytes"),
        "{out:?}"
    );
    let e = events
        .expect(&agent, WAIT, "ckpt.staging_overrun", |e| {
            e.kind == "ckpt.staging_overrun"
        })
        .await;
    assert_eq!(evidence(&e, "declared_bytes"), Some("4096"));
    assert_eq!(e.subject, "job/grow/rank/0");
    let staging = agent.home.path().join("ckpt/.staging");
    assert_eq!(std::fs::read_dir(&staging).expect("ls").count(), 0);
}

/// As a member: BeginShard for each job of `jobs`; with `until_open`, again
/// (bounded) until the answer is no longer FAILED_PRECONDITION.
pub fn attack_claims(args: &Value) -> Value {
    block_on(async {
        let jobs: Vec<String> = args["jobs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|j| j.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        let until_open = args["until_open"].as_bool().unwrap_or(false);
        let deadline = Instant::now() + ATTACK_WAIT;
        let mut out = serde_json::Map::new();
        for job in jobs {
            loop {
                let r = match agent_client(args).await {
                    Ok(mut c) => {
                        c.begin_shard(pb::BeginShardRequest {
                            job_id: job.clone(),
                            rank: 0,
                            step: 1,
                            size_bytes: 16,
                        })
                        .await
                    }
                    Err(e) => Err(tonic::Status::unavailable(e)),
                };
                let closed = matches!(&r, Err(s) if s.code() == tonic::Code::FailedPrecondition);
                if !(until_open && closed && Instant::now() < deadline) {
                    out.insert(job.clone(), call_result(r, |_| json!({})));
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Value::Object(out)
    })
}

/// Point 10, owners: a truncated `job-owners.json` keeps every claim
/// closed (the victim's job and the member's own), says why and what an
/// admin does, is kept as it is, and shows in `warden health`; once the
/// admin repairs it, each job is back with its owner.
#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_owners_file_keeps_claims_closed_until_an_admin_acts() {
    let u = users::users();
    let mut agent = TestAgent::start_shared("");
    let home = agent.home.clone();
    let args = json!({"socket": agent.socket(), "jobs": ["member-job"]});
    let first = as_user(member(), "state.claims", args).await;
    assert_eq!(first.result["member-job"]["ok"], json!(true), "{first:?}");
    agent.sigterm_and_wait(WAIT);
    // The victim's job, owned by another uid; then the file is cut short.
    let owners = home.path().join("state/job-owners.json");
    let mut all: serde_json::Map<String, Value> =
        serde_json::from_slice(&std::fs::read(&owners).expect("owners")).expect("owners JSON");
    let used = all["member-job"]["used"].clone();
    all.insert(
        "victim".into(),
        json!({"uid": u.stranger.uid, "used": used}),
    );
    let whole = serde_json::to_vec(&all).expect("JSON");
    std::fs::write(&owners, &whole[..whole.len() - 7]).expect("truncate");
    let damaged = std::fs::read(&owners).expect("owners");

    let agent = TestAgent::start_in(home.clone());
    let args = json!({"socket": agent.socket(), "jobs": ["victim", "member-job", "new-job"]});
    let out = as_user(member(), "state.claims", args.clone()).await;
    for job in ["victim", "member-job", "new-job"] {
        let r = &out.result[job];
        assert_eq!(r["ok"], json!(false), "{job}: {out:?}");
        assert_eq!(r["code"], json!("FailedPrecondition"), "{job}: {out:?}");
        let msg = r["message"].as_str().unwrap_or_default();
        assert!(
            msg.contains(&owners.display().to_string())
                && msg.contains("repairs it")
                && msg.contains("removes it"),
            "{job}: {msg}"
        );
    }
    assert_eq!(
        std::fs::read(&owners).expect("owners"),
        damaged,
        "kept as it was"
    );
    let c = agent
        .component("state/job_owners")
        .await
        .expect("component");
    assert_eq!(c.status, pb::Status::Degraded as i32, "{c:?}");
    assert!(c.reasons[0].message.contains("job owners file"), "{c:?}");

    // The admin repairs it: claims resume, each job with its owner.
    std::fs::write(&owners, &whole).expect("repair");
    let out = as_user(
        member(),
        "state.claims",
        json!({"socket": agent.socket(), "jobs": ["member-job", "victim"], "until_open": true}),
    )
    .await;
    assert_eq!(out.result["member-job"]["ok"], json!(true), "{out:?}");
    assert_eq!(
        out.result["victim"]["code"],
        json!("PermissionDenied"),
        "{out:?}"
    );
    assert!(
        out.result["victim"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("belongs to uid {}", u.stranger.uid)),
        "{out:?}"
    );
    let c = agent
        .component("state/job_owners")
        .await
        .expect("component");
    assert_eq!(c.status, pb::Status::Ok as i32, "{c:?}");
}

/// As a member: save step 1 of its job through the client.
pub fn attack_save(args: &Value) -> Value {
    let ck = match warden_client::checkpoint::Checkpointer::new(options(args, "kept", 0, 1)) {
        Ok(c) => c,
        Err(e) => return json!({"ok": false, "message": e.to_string()}),
    };
    match ck.save(1, b"the member's only checkpoint") {
        Ok(s) => json!({"ok": true, "path": s.path}),
        Err(e) => json!({"ok": false, "message": e.to_string()}),
    }
}

/// Point 10, manifests: a truncated manifest moves its step whole to the
/// quarantine at the next start (`ckpt.quarantined`, naming where), its
/// bytes intact and out of every user's reach; nothing is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_manifest_is_quarantined_not_deleted() {
    let mut agent = TestAgent::start_shared("");
    let home = agent.home.clone();
    let out = as_user(member(), "state.save", json!({"socket": agent.socket()})).await;
    assert_eq!(out.result["ok"], json!(true), "{out:?}");
    let data = PathBuf::from(out.str("path"));
    let step = data.parent().expect("step").to_owned();
    agent.sigterm_and_wait(WAIT);
    let manifest = step.join("rank-000000.json");
    let m = std::fs::read(&manifest).expect("manifest");
    std::fs::write(&manifest, &m[..m.len() / 3]).expect("truncate");

    let agent = TestAgent::start_in(home.clone());
    let mut events = Events::all(&agent).await;
    let e = events
        .expect(&agent, WAIT, "ckpt.quarantined", |e| {
            e.kind == "ckpt.quarantined"
        })
        .await;
    assert_eq!(
        evidence(&e, "path"),
        Some(step.display().to_string().as_str())
    );
    assert_eq!(e.severity, pb::Severity::Error as i32, "{e:?}");
    let moved = PathBuf::from(evidence(&e, "moved_to").expect("moved_to"));
    assert_eq!(
        std::fs::read(moved.join("rank-000000.bin")).expect("the data, kept"),
        b"the member's only checkpoint"
    );
    assert_eq!(
        std::fs::read(moved.join("rank-000000.json")).expect("the manifest, kept"),
        &m[..m.len() / 3]
    );
    let q = std::fs::metadata(home.path().join("ckpt/.quarantine")).expect("quarantine");
    assert_eq!((q.mode() & 0o7777, q.uid()), (0o700, 0));
    assert!(!step.exists(), "moved, not copied");
}
