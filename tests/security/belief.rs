//! Issue 29, point 2: what the agent believes from a rank. A member of the
//! socket group, through its own ranks' words (exception text,
//! self-declared devices, launcher stops, reported loss and gradient
//! norm), must not cordon the node, use up
//! the circuit breaker, wipe the node's history, or swallow another job's
//! crash; the agent's own readings (a real XID 79 from the kernel log) keep
//! working.
//!
//! The agent is a real root wardend following a kernel log file (the kmsg
//! source's stand-in, as in tests/incidents.rs); the attacks run as
//! [`users::MEMBER`] in a copy of this binary. Each attack's ranks are real
//! child processes of the attacker, registered as its ranks and killed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use serde_json::{Value, json};
use warden_proto::v1 as pb;
use warden_proto::v1::agent_client::AgentClient;

use crate::common::users::{self, block_on, socket_arg};
use crate::common::{Home, TestAgent, WAIT, eventually, within};

/// The PCI addresses of the two GPUs the kernel log names.
const PCI: [&str; 2] = ["0000:1a:00", "0000:3b:00"];
/// What the fake exception says.
const ECC: &str = "CUDA error: uncorrectable ECC error encountered";

/// A root agent in a shared home, following `log` as its kernel log (with
/// `extra`), once it follows it (lines written before are old to it).
async fn agent_following(log: &Path, extra: &str) -> TestAgent {
    std::fs::write(log, "").expect("create the kernel log");
    let pci: Vec<String> = PCI.iter().map(|p| format!("{p:?}")).collect();
    let home = Arc::new(Home::shared(&format!(
        "[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [kmsg]\npath = {:?}\npoll_interval = \"50ms\"\ngpu_pci = [{}]\n{extra}",
        log.display().to_string(),
        pci.join(", ")
    )));
    let agent = TestAgent::start_in(home);
    eventually(WAIT, "the kmsg component OK", async || {
        agent
            .component("kmsg")
            .await
            .filter(|c| c.status == pb::Status::Ok as i32)
    })
    .await;
    agent
}

/// A real XID from the kernel log (what the driver writes).
fn xid(log: &Path, gpu: usize, code: u32) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(log)
        .expect("open the kernel log");
    writeln!(
        f,
        "NVRM: Xid (PCI:{}): {code}, pid=1, name=python, written by the test",
        PCI[gpu]
    )
    .expect("append an XID");
}

async fn incidents(agent: &TestAgent) -> pb::GetIncidentsResponse {
    agent
        .client()
        .await
        .get_incidents(pb::GetIncidentsRequest {
            job_id: String::new(),
            limit: 0,
        })
        .await
        .expect("GetIncidents")
        .into_inner()
}

fn action(i: &pb::Incident) -> pb::Action {
    i.decision
        .as_ref()
        .and_then(|d| pb::Action::try_from(d.action).ok())
        .unwrap_or(pb::Action::Unspecified)
}

/// The decided incident of `job` ("" and `device`: the node's on it).
async fn decided(agent: &TestAgent, job: &str, device: &str) -> pb::Incident {
    eventually(
        WAIT * 2,
        &format!("a decided incident of {job:?} {device}"),
        async || {
            incidents(agent).await.incidents.into_iter().find(|i| {
                i.decision.is_some()
                    && i.job_id == job
                    && (device.is_empty() || i.devices.iter().any(|d| d == device))
            })
        },
    )
    .await
}

/// A child that lives until killed: the attacker's (or victim's) rank.
fn rank_process() -> Child {
    Command::new("sleep")
        .arg("600")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn a rank process")
}

fn register(job: &str, pid: u32) -> pb::RegisterRankRequest {
    pb::RegisterRankRequest {
        job_id: job.to_owned(),
        global_rank: 0,
        local_rank: 0,
        world_size: 1,
        pid,
        host: "belief".to_owned(),
        slot_layout_version: warden_client::slot::LAYOUT_VERSION,
        previous_slot: None,
        stack_dump_signal: 0,
        // Self-declared: the attacker names the node's GPU 0.
        devices: vec!["gpu0".to_owned()],
    }
}

/// Registers a child as rank 0 of `job`, reports `message` (if any) as its
/// uncaught exception, and kills it: a crash, as a rank's own words say.
async fn crash(c: &mut AgentClient<tonic::transport::Channel>, job: &str, message: &str) -> Value {
    let mut child = rank_process();
    let pid = child.id();
    let generation = match c.register_rank(register(job, pid)).await {
        Ok(r) => r.into_inner().generation,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return json!({"job": job, "registered": false, "error": e.message()});
        }
    };
    let reported = if message.is_empty() {
        true
    } else {
        c.report_exception(pb::ReportExceptionRequest {
            job_id: job.to_owned(),
            global_rank: 0,
            generation,
            pid,
            exception_type: "RuntimeError".to_owned(),
            message: message.to_owned(),
            step: 40,
            uncaught: true,
            ..Default::default()
        })
        .await
        .is_ok()
    };
    let _ = child.kill();
    let _ = child.wait();
    json!({"job": job, "registered": true, "reported": reported})
}

async fn member_client(args: &Value) -> AgentClient<tonic::transport::Channel> {
    AgentClient::new(
        warden_cli::Target::Unix(socket_arg(args))
            .channel()
            .await
            .expect("the member connects"),
    )
}

/// As the member: three crashes of jobs `args.jobs`, each rank on the
/// self-declared gpu0 with an uncorrectable-ECC exception of its own.
pub fn attack_fake_crashes(args: &Value) -> Value {
    block_on(async {
        let mut c = member_client(args).await;
        let mut out = Vec::new();
        for job in args["jobs"].as_array().expect("jobs") {
            out.push(crash(&mut c, job.as_str().expect("a job"), ECC).await);
        }
        json!({"crashes": out})
    })
}

/// As the member: `args.calls` ReportJobStop calls over as many jobs as
/// the per-job cap needs, as fast as it can.
pub fn attack_stop_flood(args: &Value) -> Value {
    block_on(async {
        let mut c = member_client(args).await;
        let calls = args["calls"].as_u64().expect("calls");
        let started = std::time::Instant::now();
        let (mut ok, mut refused) = (0u64, 0u64);
        for n in 0..calls {
            let r = c
                .report_job_stop(pb::ReportJobStopRequest {
                    job_id: format!("flood-{}", n / 16),
                    reason: pb::JobStopReason::NoProgress as i32,
                    summary: format!("flood {n}"),
                    exit_code: 88,
                    ..Default::default()
                })
                .await;
            if r.is_ok() { ok += 1 } else { refused += 1 }
        }
        json!({"ok": ok, "refused": refused, "secs": started.elapsed().as_secs_f64()})
    })
}

/// The step at which rank 1 of each forged job reports a NaN gradient norm.
const FORGED_STEP: u64 = 10;
/// Steps each forged job reports.
const FORGED_STEPS: u64 = 12;

/// As the member: the jobs `args.jobs` one after another, each two ranks
/// held by this process (one client each, as a launcher's workers are)
/// reporting a loss and gradient norm per step through the slot, as
/// `warden.report_values` does. Rank 1 reports a NaN gradient norm at
/// [`FORGED_STEP`] while rank 0 stays finite: a forged value, nothing
/// computed wrong. Each job waits (bounded) until the agent has published
/// `rank.sdc_suspect` about its rank 1, then ends cleanly (deregisters).
pub fn attack_forged_values(args: &Value) -> Value {
    let mut out = Vec::new();
    for job in args["jobs"].as_array().expect("jobs") {
        let job = job.as_str().expect("a job");
        let mut ranks = Vec::new();
        for rank in 0..2u32 {
            let mut o = warden_client::ConnectOptions::from_env_lossy();
            o.socket_path = socket_arg(args);
            o.job_id = job.to_owned();
            o.global_rank = rank;
            o.local_rank = rank;
            o.world_size = 2;
            match warden_client::Client::connect_with(o) {
                Ok(c) => ranks.push(c),
                Err(e) => return json!({"job": job, "connect": e.to_string()}),
            }
        }
        let connected = ranks.iter().all(warden_client::Client::is_connected);
        for step in 1..=FORGED_STEPS {
            for (rank, c) in ranks.iter().enumerate() {
                c.step_begin(step);
                let grad_norm = if rank == 1 && step == FORGED_STEP {
                    f64::NAN
                } else {
                    1.0 + 0.01 * step as f64
                };
                c.report_values(
                    Some(2.0 - 0.05 * step as f64 + 0.001 * rank as f64),
                    Some(grad_norm),
                );
                c.step_end(step);
            }
        }
        let suspect = block_on(suspect_published(args, &format!("job/{job}/rank/1")));
        for c in &ranks {
            c.close();
        }
        out.push(json!({"job": job, "connected": connected, "suspect": suspect}));
    }
    json!({"jobs": out})
}

/// Waits (bounded by [`WAIT`] * 4) until the agent has published
/// `rank.sdc_suspect` about `subject`, asking as the member.
async fn suspect_published(args: &Value, subject: &str) -> bool {
    let deadline = tokio::time::Instant::now() + WAIT * 4;
    let mut c = member_client(args).await;
    while tokio::time::Instant::now() < deadline {
        if let Ok(r) = c
            .list_events(pb::ListEventsRequest {
                after_id: 0,
                limit: 0,
            })
            .await
            && r.into_inner()
                .events
                .iter()
                .any(|e| e.kind == "rank.sdc_suspect" && e.subject == subject)
        {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

async fn attack(who: &users::Ident, name: &'static str, args: Value) -> Value {
    let who = who.clone();
    within(WAIT * 12, name, async move {
        tokio::task::spawn_blocking(move || users::run_as(&who, name, &args))
            .await
            .expect("run the attack")
    })
    .await
    .result
}

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("kmsg");
    (dir, log)
}

/// Attacks 1 and 2: three fake ECC crashes (each "uncorrectable_hardware"
/// on the rank's word) neither cordon nor use up the breaker
/// (`max_cordons` 3, the default): a real XID 79 then still cordons.
#[tokio::test(flavor = "multi_thread")]
async fn a_ranks_exception_never_cordons_nor_fills_the_breaker() {
    let (_dir, log) = scratch();
    let agent = agent_following(&log, "").await;
    let jobs = ["fake-ecc-0", "fake-ecc-1", "fake-ecc-2"];
    let out = attack(
        &users::users().member,
        "belief.fake_crashes",
        json!({"socket": agent.socket(), "jobs": jobs}),
    )
    .await;
    for c in out["crashes"].as_array().expect("crashes") {
        assert_eq!(c["registered"], json!(true), "{out}");
        assert_eq!(c["reported"], json!(true), "{out}");
    }
    for job in jobs {
        let inc = decided(&agent, job, "").await;
        let diag = inc.diagnosis.as_ref().expect("a diagnosis");
        assert_eq!(
            diag.fault_class,
            pb::FaultClass::UncorrectableHardware as i32,
            "reported as suspected: {inc:?}"
        );
        assert!(
            diag.summary.contains("on the rank's word only"),
            "{}",
            diag.summary
        );
        assert!(
            diag.evidence.iter().any(|e| e.signal == "belief"),
            "the evidence says it is the rank's word: {inc:?}"
        );
        assert_eq!(action(&inc), pb::Action::RestartInJob, "{inc:?}");
        assert!(inc.devices.is_empty(), "no self-declared device: {inc:?}");
    }
    assert!(!incidents(&agent).await.cordoned, "no cordon");
    assert!(
        !agent
            .events()
            .await
            .iter()
            .any(|e| e.kind == "node.cordoned"),
        "no node.cordoned event"
    );

    // The breaker is whole: a real XID 79 cordons.
    xid(&log, 1, 79);
    let real = decided(&agent, "", "gpu1").await;
    assert_eq!(action(&real), pb::Action::Cordon, "{real:?}");
    let reason = &real.decision.as_ref().expect("decision").reason;
    assert!(!reason.contains("circuit breaker"), "{reason}");
    eventually(WAIT, "the node cordoned by the real XID", async || {
        incidents(&agent).await.cordoned.then_some(())
    })
    .await;
}

/// Attack 4: 576 ReportJobStop calls neither push the cordon's incident
/// out of GetIncidents nor make the breaker forget it.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_job_stops_wipes_no_cordon_or_breaker_history() {
    let (_dir, log) = scratch();
    let agent = agent_following(
        &log,
        "[policy.circuit_breaker]\nmax_cordons = 1\nwindow = \"1h\"\n",
    )
    .await;
    xid(&log, 0, 79);
    let first = decided(&agent, "", "gpu0").await;
    assert_eq!(action(&first), pb::Action::Cordon, "{first:?}");

    let out = attack(
        &users::users().member,
        "belief.stop_flood",
        json!({"socket": agent.socket(), "calls": 576}),
    )
    .await;
    let ok = out["ok"].as_u64().expect("ok");
    assert!(ok > 0, "the flood reached the journal: {out}");

    let after = incidents(&agent).await;
    assert!(after.cordoned, "still cordoned");
    assert!(
        after.incidents.iter().any(|i| i.id == first.id),
        "the cordon's incident is still listed after {ok} stops"
    );
    // The breaker still counts it: lifted, a second real XID 79 is held.
    let lifted = agent
        .client()
        .await
        .uncordon(pb::UncordonRequest {
            reason: "gpu0 replaced".into(),
        })
        .await
        .expect("Uncordon as root")
        .into_inner();
    assert!(lifted.was_cordoned);
    xid(&log, 1, 79);
    let second = decided(&agent, "", "gpu1").await;
    let dec = second.decision.as_ref().expect("decision");
    assert_ne!(action(&second), pb::Action::Cordon, "{second:?}");
    assert!(
        dec.reason.contains("circuit breaker open: 1 cordons") && dec.reason.contains(&first.id),
        "{}",
        dec.reason
    );
}

/// Attack 5: the attacker's crash on its self-declared gpu0 does not take
/// in the victim's crash on gpu0 a moment later: each job gets its own
/// incident and decision.
#[tokio::test(flavor = "multi_thread")]
async fn another_jobs_crash_is_never_swallowed() {
    let (_dir, log) = scratch();
    let agent = agent_following(&log, "").await;
    let out = attack(
        &users::users().member,
        "belief.fake_crashes",
        json!({"socket": agent.socket(), "jobs": ["swallower"]}),
    )
    .await;
    assert_eq!(out["crashes"][0]["registered"], json!(true), "{out}");
    let theirs = decided(&agent, "swallower", "").await;

    // The victim (root): its rank on gpu0 too, crashing within the
    // correlation window of the attacker's incident.
    let mut c = agent.client().await;
    let victim = crash(&mut c, "victim-job", "").await;
    assert_eq!(victim["registered"], json!(true), "{victim}");
    let mine = decided(&agent, "victim-job", "").await;
    assert_ne!(mine.id, theirs.id, "its own incident");
    assert_eq!(mine.ranks, vec![0]);
    let again = incidents(&agent).await;
    let theirs_now = again
        .incidents
        .iter()
        .find(|i| i.id == theirs.id)
        .expect("the attacker's incident");
    assert_eq!(theirs_now.job_id, "swallower");
    assert!(
        !theirs_now
            .diagnosis
            .as_ref()
            .is_some_and(|d| d.summary.contains("victim-job")),
        "{theirs_now:?}"
    );
}

/// Attack 3 ("forged values make a lemon"): three small jobs of the member,
/// each with one rank reporting a NaN gradient norm while its peer stays
/// finite, each open an `sdc` incident (uncorrectable hardware suspected,
/// `policy.sdc = "report"`: the job goes on), and yet the lemon rule
/// (on, three incidents of hardware classes) does not cordon the node:
/// the values are the rank's word, never the agent's own reading. Before
/// issue 29 the third such incident made the node a lemon.
#[tokio::test(flavor = "multi_thread")]
async fn forged_values_never_make_a_lemon() {
    let agent = TestAgent::start_shared(
        "[agent]\ntick = \"50ms\"\n\
         [host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [hang]\nfloor = \"60s\"\n\
         [policy]\nsdc = \"report\"\n\
         [policy.lemon]\nenabled = true\nincidents = 3\nwindow = \"1h\"\n",
    );
    let jobs = ["forged-sdc-0", "forged-sdc-1", "forged-sdc-2"];
    let out = attack(
        &users::users().member,
        "belief.forged_values",
        json!({"socket": agent.socket(), "jobs": jobs}),
    )
    .await;
    let ran = out["jobs"].as_array().expect("jobs");
    assert_eq!(ran.len(), jobs.len(), "{out}");
    for j in ran {
        assert_eq!(j["connected"], json!(true), "{out}");
        assert_eq!(j["suspect"], json!(true), "the agent flagged rank 1: {out}");
    }
    let events = agent.events().await;
    let mut ids = Vec::new();
    for job in jobs {
        let suspect = events
            .iter()
            .find(|e| e.kind == "rank.sdc_suspect" && e.subject == format!("job/{job}/rank/1"))
            .unwrap_or_else(|| panic!("rank.sdc_suspect about {job}'s rank 1"));
        assert!(
            !events
                .iter()
                .any(|e| e.kind == "rank.sdc_suspect" && e.subject == format!("job/{job}/rank/0")),
            "never the honest rank 0: {suspect:?}"
        );
        let inc = decided(&agent, job, "").await;
        assert_eq!(inc.kind, "sdc", "{inc:?}");
        assert_eq!(inc.ranks, vec![1], "{inc:?}");
        let diag = inc.diagnosis.as_ref().expect("a diagnosis");
        assert_eq!(
            diag.fault_class,
            pb::FaultClass::UncorrectableHardware as i32,
            "a class the lemon rule counts: {inc:?}"
        );
        let dec = inc.decision.as_ref().expect("a decision");
        assert_eq!(
            action(&inc),
            pb::Action::Continue,
            "policy.sdc = report: {inc:?}"
        );
        assert!(
            !dec.decided_by
                .starts_with(warden_core::policy::guard::LEMON_DECIDED_BY),
            "not the lemon rule's: {inc:?}"
        );
        ids.push(inc.id);
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), jobs.len(), "one incident per job: {ids:?}");

    let after = incidents(&agent).await;
    assert!(!after.cordoned, "no cordon: {:?}", after.incidents);
    assert!(
        !after.incidents.iter().any(|i| {
            i.decision.iter().chain(i.superseded.iter()).any(|d| {
                d.decided_by
                    .starts_with(warden_core::policy::guard::LEMON_DECIDED_BY)
            })
        }),
        "no decision by the lemon rule: {:?}",
        after.incidents
    );
    assert!(
        !agent
            .events()
            .await
            .iter()
            .any(|e| e.kind == "node.cordoned"),
        "no node.cordoned event"
    );
}
