//! Job ownership (issue 29, point 3): a member of the socket group squats a
//! job id before its launcher starts, and attacks a job whose launcher
//! runs. The squatted launcher stops before starting anything, naming the
//! owner, with exit 89 (not 86); an admin releases the id and the job runs.
//! The running job's launcher owns it: the member's claim, health gate,
//! registration, incident stream and release about it are refused, and the
//! victim's worker keeps running with no incident opened. Even when an
//! admin releases the running job and the member takes the id and makes
//! an incident of it, the victim's launcher is sent none of its decisions.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Map, Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, block_on, call_result, socket_arg};
use crate::common::{Streaming, TestAgent, WAIT, WARDEN, run, within};

/// A whole `warden run` may take this long on a loaded machine.
const RUN: Duration = Duration::from_secs(90);

async fn client(args: &Value) -> AgentClient<tonic::transport::Channel> {
    let ch = warden_cli::Target::Unix(socket_arg(args))
        .channel()
        .await
        .expect("the member connects (it is in the socket group)");
    AgentClient::new(ch)
}

/// The squat: the member uses `args.job` first (SetCheckpointPeers, as a
/// launcher would), before the victim's launcher starts.
pub fn attack_squat(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        let job = args["job"].as_str().expect("the job to squat").to_owned();
        call_result(
            c.set_checkpoint_peers(pb::SetCheckpointPeersRequest {
                job_id: job,
                peers: Vec::new(),
                ..Default::default()
            })
            .await,
            |_| json!({}),
        )
    })
}

/// Everything the member tries against a job whose launcher runs
/// (`args.job`): take it over, attach a failing gate to it, register into
/// it, follow its decisions, release it.
pub fn attack_running(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        let job = args["job"].as_str().expect("the victim's job").to_owned();
        let mut out = Map::new();
        // A job of its own first: the gate is then open to it without a job.
        out.insert(
            "own_job".to_owned(),
            call_result(
                c.claim_job(pb::ClaimJobRequest {
                    job_id: "member-own".into(),
                })
                .await,
                |r| json!({"owner": r.into_inner().owner_uid}),
            ),
        );
        out.insert(
            "claim".to_owned(),
            call_result(
                c.claim_job(pb::ClaimJobRequest {
                    job_id: job.clone(),
                })
                .await,
                |_| json!({}),
            ),
        );
        out.insert(
            "gate_for_victim".to_owned(),
            call_result(
                c.run_health_gate(pb::RunHealthGateRequest {
                    level: 1,
                    job_id: job.clone(),
                })
                .await,
                |r| json!({"passed": r.into_inner().passed}),
            ),
        );
        out.insert(
            "register_into_victim".to_owned(),
            call_result(
                c.register_rank(pb::RegisterRankRequest {
                    job_id: job.clone(),
                    global_rank: 1,
                    local_rank: 1,
                    world_size: 2,
                    pid: std::process::id(),
                    host: "attacker".into(),
                    slot_layout_version: warden_client::slot::LAYOUT_VERSION,
                    ..Default::default()
                })
                .await,
                |_| json!({}),
            ),
        );
        out.insert(
            "watch_victim".to_owned(),
            call_result(
                c.watch_incidents(pb::WatchIncidentsRequest {
                    job_id: job.clone(),
                    replay: true,
                })
                .await,
                |_| json!({}),
            ),
        );
        out.insert(
            "release".to_owned(),
            call_result(
                c.release_job(pb::ReleaseJobRequest {
                    job_id: job.clone(),
                })
                .await,
                |_| json!({}),
            ),
        );
        Value::Object(out)
    })
}

/// After an admin released `args.job` by mistake: the member takes the id
/// (ClaimJob), registers a process of its own as rank 1 and kills it, so
/// the agent decides an incident of the job; returns its id once decided.
pub fn attack_take_over(args: &Value) -> Value {
    block_on(async {
        let mut c = client(args).await;
        let job = args["job"].as_str().expect("the victim's job").to_owned();
        let claimed = call_result(
            c.claim_job(pb::ClaimJobRequest {
                job_id: job.clone(),
            })
            .await,
            |_| json!({}),
        );
        if claimed["ok"] != json!(true) {
            return json!({"claim": claimed});
        }
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .expect("a process of the member's");
        let registered = call_result(
            c.register_rank(pb::RegisterRankRequest {
                job_id: job.clone(),
                global_rank: 1,
                local_rank: 1,
                world_size: 2,
                pid: child.id(),
                host: "attacker".into(),
                slot_layout_version: warden_client::slot::LAYOUT_VERSION,
                ..Default::default()
            })
            .await,
            |_| json!({}),
        );
        let _ = child.kill();
        let decided = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let listed = c
                    .get_incidents(pb::GetIncidentsRequest {
                        job_id: job.clone(),
                        limit: 0,
                    })
                    .await
                    .map(|r| r.into_inner().incidents)
                    .unwrap_or_default();
                if let Some(i) = listed.into_iter().find(|i| i.decision.is_some()) {
                    return i.id;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        let _ = child.wait();
        json!({"claim": claimed, "register": registered, "incident": decided.ok()})
    })
}

fn refused(out: &Value, call: &str, says: &[&str]) {
    let r = &out[call];
    assert_eq!(r["ok"], json!(false), "{call} was answered: {r}");
    assert_eq!(r["code"], json!("PermissionDenied"), "{call}: {r}");
    let msg = r["message"].as_str().unwrap_or_default();
    for s in says {
        assert!(msg.contains(s), "{call}: {msg:?} does not say {s:?}");
    }
}

/// `warden --socket S run --agent local` of job `job` running `sh -c
/// script` (one worker), logs under `logs`.
fn launcher(socket: &Path, logs: &Path, job: &str, script: &str) -> Command {
    let mut cmd = Command::new("sh");
    // The launcher's own lines (stderr) with the workers' on one stream.
    cmd.args(["-c", "exec \"$0\" \"$@\" 2>&1", WARDEN])
        .arg("--socket")
        .arg(socket)
        .arg("run")
        .args(["--agent", "local", "--nproc-per-node", "1"])
        .args(["--rdzv-id", job])
        .arg("--log-dir")
        .arg(logs)
        .args(["--", "sh", "-c", script])
        .env_remove("WARDEN_JOB_ID");
    cmd
}

async fn ranks_of(agent: &TestAgent, job: &str) -> Vec<pb::RankInfo> {
    let mut c = agent.client().await;
    c.get_ranks(pb::GetRanksRequest {
        job_id: job.to_owned(),
    })
    .await
    .expect("GetRanks")
    .into_inner()
    .ranks
}

/// Point 3: the member squats `train-43`; root's launcher of that id is
/// refused before any worker starts (exit 89, the owner and the way out
/// named); after `warden release-job` the same id runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_squatted_job_id_stops_its_launcher_before_anything_runs() {
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let marker = scratch.path().join("worker-ran");
    let args = json!({"socket": agent.socket(), "job": "train-43"});
    let member = u.member.clone();
    let squat = within(WAIT * 6, "the squat", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "ownership.squat", &args))
            .await
            .expect("run the attack")
    })
    .await;
    assert_eq!(squat.result["ok"], json!(true), "{:?}", squat.result);

    let script = format!("touch {}", marker.display());
    let logs = scratch.path().join("logs");
    let done = run(
        &mut launcher(agent.socket(), &logs, "train-43", &script),
        RUN,
    );
    let all = format!("{}{}", done.stdout, done.stderr);
    assert_eq!(done.code(), 89, "{all}");
    assert!(
        all.contains(&format!(
            "job \"train-43\" on this agent belongs to uid {} ({})",
            u.member.uid,
            users::MEMBER
        )) && all.contains("warden release-job train-43"),
        "{all}"
    );
    assert!(!marker.exists(), "the squatted job's worker ran\n{all}");
    assert!(ranks_of(&agent, "train-43").await.is_empty());

    // An admin releases the id; the job then runs as its own.
    let released = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["release-job", "train-43"]),
        WAIT * 3,
    );
    assert_eq!(released.code(), 0, "{released:?}");
    assert!(
        released
            .stdout
            .contains(&format!("the claim of uid {} released", u.member.uid)),
        "{released:?}"
    );
    let done = run(
        &mut launcher(agent.socket(), &logs, "train-43", &script),
        RUN,
    );
    assert_eq!(done.code(), 0, "{}{}", done.stdout, done.stderr);
    assert!(marker.exists(), "{}{}", done.stdout, done.stderr);
}

/// Point 3 against a running job: root's launcher owns `victim-run`; the
/// member's claim, gate, registration, incident stream and release about
/// it are refused by name, and the victim's worker runs on, no incident
/// opened.
#[tokio::test(flavor = "multi_thread")]
async fn nobody_else_decides_about_a_running_job() {
    let agent = TestAgent::start_shared("");
    let u = users::users();
    let scratch = tempfile::tempdir().expect("a scratch directory");
    let mut job = Streaming::spawn(
        &mut launcher(
            agent.socket(),
            &scratch.path().join("logs"),
            "victim-run",
            "echo worker-up; exec sleep 300",
        ),
        scratch.path().join("launcher.stderr"),
    );
    job.wait_line(RUN, "the victim's worker up", |l| l.contains("worker-up"));
    let pid = crate::common::eventually(WAIT * 3, "the victim's worker registered", || {
        let agent = &agent;
        async move {
            ranks_of(agent, "victim-run")
                .await
                .first()
                .map(|r| r.pid)
                .filter(|p| *p != 0)
        }
    })
    .await;

    let args = json!({"socket": agent.socket(), "job": "victim-run"});
    let member = u.member.clone();
    let out = within(WAIT * 6, "the attack", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "ownership.running", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;
    assert_eq!(out["own_job"]["ok"], json!(true), "{out}");
    let owned = ["job \"victim-run\" on this agent belongs to uid 0"];
    refused(&out, "claim", &owned);
    refused(&out, "gate_for_victim", &owned);
    refused(&out, "register_into_victim", &owned);
    refused(&out, "watch_victim", &owned);
    refused(&out, "release", &["rule: admins only"]);

    // The victim is as it was: its launcher and worker run, its rank is
    // the one registered, nothing was decided about it.
    assert!(
        matches!(job.child.try_wait(), Ok(None)),
        "the victim's launcher ended: {:?}",
        job.seen
    );
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the victim's worker is gone"
    );
    let ranks = ranks_of(&agent, "victim-run").await;
    assert_eq!(ranks.len(), 1, "{ranks:?}");
    let mut c = agent.client().await;
    let incidents = c
        .get_incidents(pb::GetIncidentsRequest {
            job_id: "victim-run".into(),
            limit: 0,
        })
        .await
        .expect("GetIncidents")
        .into_inner()
        .incidents;
    assert!(incidents.is_empty(), "{incidents:?}");

    // An admin releases the running job by mistake and the member takes
    // the id and makes an incident of it: the agent decides it, and sends
    // it to nobody but its owner; root's launcher is refused the job's
    // stream and carries out nothing, its worker runs on.
    let released = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["release-job", "victim-run"]),
        WAIT * 3,
    );
    assert_eq!(released.code(), 0, "{released:?}");
    let args = json!({"socket": agent.socket(), "job": "victim-run"});
    let member = u.member.clone();
    let taken = within(Duration::from_secs(120), "the take-over", async move {
        tokio::task::spawn_blocking(move || users::run_as(&member, "ownership.take_over", &args))
            .await
            .expect("run the attack")
    })
    .await
    .result;
    assert_eq!(taken["claim"]["ok"], json!(true), "{taken}");
    assert_eq!(taken["register"]["ok"], json!(true), "{taken}");
    let incident = taken["incident"]
        .as_str()
        .unwrap_or_else(|| panic!("no decided incident: {taken}"))
        .to_owned();
    let watch = c
        .watch_incidents(pb::WatchIncidentsRequest {
            job_id: "victim-run".into(),
            replay: true,
        })
        .await
        .map(|_| ())
        .expect_err("root's stream of a job the member owns");
    assert_eq!(watch.code(), tonic::Code::PermissionDenied, "{watch:?}");
    assert!(
        watch
            .message()
            .contains(&format!("belongs to uid {}", u.member.uid)),
        "{watch:?}"
    );
    assert!(
        matches!(job.child.try_wait(), Ok(None)),
        "the victim's launcher ended: {:?}",
        job.seen
    );
    assert!(
        Path::new(&format!("/proc/{pid}")).exists(),
        "the victim's worker is gone"
    );
    job.signal(nix::sys::signal::Signal::SIGTERM);
    let status = job.wait_exit(RUN);
    assert_eq!(status.code(), Some(143), "{:?}", job.seen);
    assert!(
        !job.seen.iter().any(|l| l.contains(&incident)),
        "the launcher was told of the member's incident {incident}: {:?}",
        job.seen
    );
}
