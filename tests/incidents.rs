//! System tests of attribution and policy through the real agent: a
//! scripted GPU failure becomes an incident with its evidence and a cordon
//! (health, node condition file, events) that survives a restart of the
//! agent and is lifted by Uncordon; the user's policy hook, a real script,
//! overrides a decision, and a hook that hangs is killed and ignored.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use common::{Home, TestAgent, WAIT, eventually};
use warden_proto::v1 as pb;

const XID79: &str = r#"
description = "XID 79 on gpu1 at 1s"
[[gpu]]
count = 2
name = "Test GPU"
[[fault]]
at = "1s"
kind = "xid"
gpu = 1
xid = 79
"#;

fn simulate(home: &Home) -> Vec<(String, String)> {
    let scenario = home.path().join("xid79.toml");
    std::fs::write(&scenario, XID79).unwrap();
    vec![
        ("WARDEN_SIMULATE".into(), scenario.display().to_string()),
        ("WARDEN_SIMULATE_SPEED".into(), "4".into()),
    ]
}

fn start(home: Arc<Home>, env: &[(String, String)]) -> TestAgent {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut agent = TestAgent::spawn(home, &env);
    agent.wait_ready();
    agent
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

fn class(i: &pb::Incident) -> pb::FaultClass {
    pb::FaultClass::try_from(i.diagnosis.as_ref().unwrap().fault_class).unwrap()
}

fn action(i: &pb::Incident) -> pb::Action {
    pb::Action::try_from(i.decision.as_ref().unwrap().action).unwrap()
}

fn condition(home: &Home) -> serde_json::Value {
    let path = home.path().join("state/node-condition.json");
    serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

async fn wait_incident(agent: &TestAgent) -> pb::Incident {
    eventually(WAIT, "an incident with a decision", async || {
        incidents(agent)
            .await
            .incidents
            .into_iter()
            .find(|i| i.decision.is_some())
    })
    .await
}

#[tokio::test]
async fn gpu_failure_cordons_the_node_until_uncordoned_even_across_restarts() {
    let home = Arc::new(Home::new(""));
    let env = simulate(&home);
    let mut agent = start(home.clone(), &env);
    assert_eq!(
        condition(&home)["status"],
        "False",
        "a fresh node is not cordoned"
    );

    let inc = wait_incident(&agent).await;
    assert_eq!(inc.kind, "hardware");
    assert_eq!(class(&inc), pb::FaultClass::UncorrectableHardware);
    assert_eq!(action(&inc), pb::Action::Cordon);
    assert_eq!(inc.devices, vec!["gpu1".to_owned()]);
    let d = inc.diagnosis.as_ref().unwrap();
    assert!(
        d.evidence
            .iter()
            .any(|e| e.signal == "xid" && e.value == "79"),
        "the XID is the evidence: {:?}",
        d.evidence
    );
    let dec = inc.decision.as_ref().unwrap();
    assert_eq!(dec.exit_code, 86, "a node fault tells the scheduler so");
    assert_eq!(dec.decided_by, "policy");

    // The cordon shows everywhere a cluster tool looks.
    let cordon = eventually(WAIT, "node/cordon FAILED", async || {
        agent
            .component("node/cordon")
            .await
            .filter(|c| c.status == pb::Status::Failed as i32)
    })
    .await;
    assert!(
        cordon.reasons[0].message.contains(&inc.id),
        "{:?}",
        cordon.reasons
    );
    assert!(incidents(&agent).await.cordoned);
    let cond = condition(&home);
    assert_eq!(cond["status"], "True");
    assert_eq!(cond["reason"], "UncorrectableHardware");
    assert_eq!(cond["incident"], inc.id.as_str());
    let events = agent.events().await;
    for kind in ["incident.diagnosed", "incident.decided", "node.cordoned"] {
        assert!(events.iter().any(|e| e.kind == kind), "no {kind} event");
    }

    // A restart of the agent keeps the record and the cordon.
    agent.sigterm_and_wait(WAIT);
    drop(agent);
    let agent = start(home.clone(), &[]);
    let after = incidents(&agent).await;
    assert!(after.cordoned, "the cordon survives the restart");
    assert!(
        after.incidents.iter().any(|i| i.id == inc.id),
        "the incident survives the restart"
    );
    eventually(WAIT, "node/cordon FAILED after the restart", async || {
        agent
            .component("node/cordon")
            .await
            .filter(|c| c.status == pb::Status::Failed as i32)
    })
    .await;

    // Lifted by a person, once.
    let mut client = agent.client().await;
    let lifted = client
        .uncordon(pb::UncordonRequest {
            reason: "GPU 1 reseated".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(lifted.was_cordoned);
    let again = client
        .uncordon(pb::UncordonRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(!again.was_cordoned);
    assert_eq!(condition(&home)["status"], "False");
    let c = agent.component("node/cordon").await.expect("node/cordon");
    assert_eq!(c.status, pb::Status::Ok as i32);
    let ev = agent.events().await;
    let un = ev
        .iter()
        .find(|e| e.kind == "node.uncordoned")
        .expect("node.uncordoned");
    assert!(un.message.contains("GPU 1 reseated"), "{}", un.message);
}

fn script(home: &Home, name: &str, body: &str) -> String {
    let path = home.path().join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

#[tokio::test]
async fn policy_hook_overrides_the_decision() {
    let tmp = Home::new("");
    // The hook reads the incident and answers with its class in the reason.
    let hook = script(
        &tmp,
        "hook.sh",
        r#"input=$(cat)
case "$input" in
  *uncorrectable_hardware*) echo '{"action": "stop", "reason": "site policy: drain by hand"}' ;;
  *) echo '{"action": "default"}' ;;
esac"#,
    );
    let home = Arc::new(Home::new(&format!(
        "[policy.hook]\ncommand = [\"{hook}\"]\ntimeout = \"5s\"\n"
    )));
    let env = simulate(&home);
    let agent = start(home.clone(), &env);
    let inc = wait_incident(&agent).await;
    let dec = inc.decision.as_ref().unwrap();
    assert_eq!(action(&inc), pb::Action::Stop, "{dec:?}");
    assert_eq!(dec.decided_by, "hook");
    assert!(
        dec.reason.contains("site policy: drain by hand"),
        "{}",
        dec.reason
    );
    assert!(
        !incidents(&agent).await.cordoned,
        "the hook said stop, not cordon"
    );
    assert_eq!(condition(&home)["status"], "False");
}

#[tokio::test]
async fn a_hook_that_hangs_is_killed_and_the_policy_stands() {
    let tmp = Home::new("");
    let marker = tmp.path().join("hook-ran");
    let hook = script(
        &tmp,
        "slow.sh",
        &format!(
            "touch {}\nsleep 30\necho '{{\"action\": \"continue\"}}'",
            marker.display()
        ),
    );
    let home = Arc::new(Home::new(&format!(
        "[policy.hook]\ncommand = [\"{hook}\"]\ntimeout = \"300ms\"\n"
    )));
    let env = simulate(&home);
    let agent = start(home.clone(), &env);
    let inc = wait_incident(&agent).await;
    let dec = inc.decision.as_ref().unwrap();
    assert!(marker.exists(), "the hook was started");
    assert_eq!(
        action(&inc),
        pb::Action::Cordon,
        "warden's own decision stands"
    );
    assert!(
        dec.decided_by.starts_with("policy (hook failed:"),
        "{}",
        dec.decided_by
    );
    assert!(
        dec.decided_by.contains("did not answer within"),
        "{}",
        dec.decided_by
    );
    let events = agent.events().await;
    let failed = events
        .iter()
        .find(|e| e.kind == "policy.hook_failed")
        .expect("policy.hook_failed event");
    assert_eq!(failed.subject, inc.id);
}

// Node-level rules over the incident journal (core/src/policy/guard.rs):
// XIDs appended on demand to a kernel-log file the agent follows, so each
// lands after the test has set up the job it should hit.

/// PCI addresses of gpu0..gpu3 in the kernel-log config.
const PCI: [&str; 4] = ["0000:1a:00", "0000:3b:00", "0000:5c:00", "0000:7d:00"];

/// An agent home following `log` as its kernel log, with `extra` TOML.
fn kmsg_home(log: &std::path::Path, extra: &str) -> Arc<Home> {
    std::fs::write(log, "").unwrap();
    let pci: Vec<String> = PCI.iter().map(|p| format!("{p:?}")).collect();
    Arc::new(Home::new(&format!(
        "[host]\nmemory_degraded_below_percent = 0.0\nmemory_failed_below_percent = 0.0\n\
         [kmsg]\npath = {:?}\npoll_interval = \"50ms\"\ngpu_pci = [{}]\n{extra}",
        log.display().to_string(),
        pci.join(", ")
    )))
}

/// Appends an XID on `gpu<gpu>` naming this process (the rank [`register`]
/// registers), as the driver names the process a fault hit: the agent's own
/// map of that rank to the GPU (a rank's declared devices are not).
fn xid(log: &std::path::Path, gpu: usize, code: u32) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    writeln!(
        f,
        "NVRM: Xid (PCI:{}): {code}, pid={}, name=python, simulated by the test",
        PCI[gpu],
        std::process::id()
    )
    .unwrap();
}

/// Starts an agent of a [`kmsg_home`] and waits until it follows the log
/// (lines appended before that are old to it, and skipped).
async fn start_following(home: Arc<Home>) -> TestAgent {
    let agent = start(home, &[]);
    eventually(WAIT, "the kmsg component OK", async || {
        agent
            .component("kmsg")
            .await
            .filter(|c| c.status == pb::Status::Ok as i32)
    })
    .await;
    agent
}

/// Registers a rank of `job` on `gpu<gpu>` (this process stands in for it).
async fn register(agent: &TestAgent, job: &str, gpu: usize) -> u64 {
    agent
        .client()
        .await
        .register_rank(pb::RegisterRankRequest {
            job_id: job.to_owned(),
            global_rank: 0,
            local_rank: 0,
            world_size: 1,
            pid: std::process::id(),
            host: "test".to_owned(),
            slot_layout_version: warden_client::slot::LAYOUT_VERSION,
            previous_slot: None,
            stack_dump_signal: 0,
            devices: vec![format!("gpu{gpu}")],
        })
        .await
        .expect("RegisterRank")
        .into_inner()
        .generation
}

async fn deregister(agent: &TestAgent, job: &str, generation: u64) {
    agent
        .client()
        .await
        .deregister_rank(pb::DeregisterRankRequest {
            job_id: job.to_owned(),
            global_rank: 0,
            generation,
        })
        .await
        .expect("DeregisterRank");
}

/// The decided incident on `gpu<gpu>`.
async fn decided_on(agent: &TestAgent, gpu: usize) -> pb::Incident {
    let dev = format!("gpu{gpu}");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let seen = incidents(agent).await.incidents;
        if let Some(i) = seen
            .iter()
            .find(|i| i.decision.is_some() && i.devices.contains(&dev))
        {
            return i.clone();
        }
        if std::time::Instant::now() > deadline {
            let events: Vec<String> = agent.events().await.iter().map(common::describe).collect();
            panic!(
                "no decided incident on {dev} after {WAIT:?}; incidents: {seen:#?}\nevents:\n{}",
                events.join("\n")
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// One XID 92 (correctable) in `job` on `gpu<gpu>`: the job goes on.
async fn correctable_in_job(
    agent: &TestAgent,
    log: &std::path::Path,
    job: &str,
    gpu: usize,
) -> pb::Incident {
    let generation = register(agent, job, gpu).await;
    xid(log, gpu, 92);
    let inc = decided_on(agent, gpu).await;
    deregister(agent, job, generation).await;
    assert_eq!(inc.job_id, job, "{inc:?}");
    assert_eq!(class(&inc), pb::FaultClass::CorrectableHardware);
    inc
}

#[tokio::test]
async fn repeated_hardware_incidents_across_jobs_cordon_a_lemon_node_even_across_restarts() {
    let tmp = Home::new("");
    let log = tmp.path().join("kmsg");
    let home = kmsg_home(&log, "");
    let mut agent = start_following(home.clone()).await;

    let first = correctable_in_job(&agent, &log, "job-a", 0).await;
    let second = correctable_in_job(&agent, &log, "job-b", 1).await;
    for inc in [&first, &second] {
        assert_eq!(
            action(inc),
            pb::Action::Continue,
            "one incident is not a lemon"
        );
    }
    assert!(!incidents(&agent).await.cordoned);

    // The count is read from the journal: a restart does not reset it.
    agent.sigterm_and_wait(WAIT);
    drop(agent);
    let agent = start_following(home.clone()).await;
    let third = correctable_in_job(&agent, &log, "job-c", 2).await;
    assert_eq!(action(&third), pb::Action::Cordon);
    let dec = third.decision.as_ref().unwrap();
    assert_eq!(dec.decided_by, "lemon rule");
    assert_eq!(dec.exit_code, 86);
    let ids = format!("{}, {}, {}", first.id, second.id, third.id);
    assert!(
        dec.reason.contains(&ids),
        "the evidence lists {ids}: {}",
        dec.reason
    );
    assert!(dec.reason.contains("job-a, job-b, job-c"), "{}", dec.reason);
    eventually(WAIT, "the node cordoned", async || {
        incidents(&agent).await.cordoned.then_some(())
    })
    .await;
    assert_eq!(condition(&home)["incident"], third.id.as_str());
    let events = agent.events().await;
    let lemon = events
        .iter()
        .find(|e| e.kind == "policy.lemon")
        .expect("a policy.lemon event");
    assert_eq!(lemon.subject, third.id);
    assert_eq!(
        common::evidence(lemon, "incidents"),
        Some(format!("{},{},{}", first.id, second.id, third.id).as_str())
    );
    assert!(events.iter().any(|e| e.kind == "node.cordoned"));
    let (scrape, _) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(&scrape, "warden_lemon_cordons_total", &[]),
        1.0
    );
}

#[tokio::test]
async fn past_the_cap_a_cordon_is_held_and_the_breaker_reported() {
    let tmp = Home::new("");
    let log = tmp.path().join("kmsg");
    let home = kmsg_home(
        &log,
        "[policy.lemon]\nenabled = false\n[policy.circuit_breaker]\nmax_cordons = 2\nwindow = \"1h\"\n",
    );
    let agent = start_following(home.clone()).await;
    let mut client = agent.client().await;
    let mut cordoned = Vec::new();
    for gpu in 0..2 {
        xid(&log, gpu, 79);
        let inc = decided_on(&agent, gpu).await;
        assert_eq!(action(&inc), pb::Action::Cordon, "{inc:?}");
        eventually(WAIT, "the node cordoned", async || {
            incidents(&agent).await.cordoned.then_some(())
        })
        .await;
        let lifted = client
            .uncordon(pb::UncordonRequest {
                reason: format!("gpu{gpu} replaced"),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(lifted.was_cordoned);
        cordoned.push(inc.id);
    }

    xid(&log, 2, 79);
    let held = decided_on(&agent, 2).await;
    assert_eq!(
        action(&held),
        pb::Action::Continue,
        "past the cap the cordon is held (the job was not down)"
    );
    let dec = held.decision.as_ref().unwrap();
    assert_eq!(dec.decided_by, "policy (circuit breaker)");
    assert!(
        dec.reason.contains("circuit breaker open: 2 cordons"),
        "{}",
        dec.reason
    );
    assert!(dec.reason.contains(&cordoned.join(", ")), "{}", dec.reason);
    let events = agent.events().await;
    let breaker = events
        .iter()
        .find(|e| e.kind == "policy.circuit_breaker")
        .expect("a policy.circuit_breaker event");
    assert_eq!(breaker.subject, held.id);
    assert_eq!(
        events.iter().filter(|e| e.kind == "node.cordoned").count(),
        2,
        "the third was not cordoned"
    );
    assert!(!incidents(&agent).await.cordoned);
    assert_eq!(condition(&home)["status"], "False");
    let (scrape, _) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(&scrape, "warden_circuit_breaker_open", &[]),
        1.0
    );
    assert_eq!(
        common::sample(&scrape, "warden_circuit_breaker_held_total", &[]),
        1.0
    );
}

#[tokio::test]
async fn dry_run_reports_every_action_and_takes_none() {
    use tokio_stream::StreamExt;
    let tmp = Home::new("");
    let log = tmp.path().join("kmsg");
    let home = kmsg_home(&log, "[policy]\ndry_run = true\n");
    let agent = start_following(home.clone()).await;
    let generation = register(&agent, "dry", 0).await;
    // What a launcher of the job is told.
    let mut watch = agent
        .client()
        .await
        .watch_incidents(pb::WatchIncidentsRequest {
            job_id: "dry".into(),
            replay: true,
        })
        .await
        .expect("WatchIncidents")
        .into_inner();
    xid(&log, 0, 79);
    let inc = decided_on(&agent, 0).await;
    assert_eq!(class(&inc), pb::FaultClass::UncorrectableHardware);
    assert_eq!(action(&inc), pb::Action::Continue, "nothing is done");
    let dec = inc.decision.as_ref().unwrap();
    assert!(
        dec.reason.starts_with("dry run: would cordon"),
        "{}",
        dec.reason
    );
    assert_eq!(dec.exit_code, 0);
    let told = common::within(WAIT, "the launcher's feed", watch.next())
        .await
        .expect("an incident on the feed")
        .expect("WatchIncidents item");
    assert_eq!(told.id, inc.id);
    assert_eq!(
        pb::Action::try_from(told.decision.as_ref().unwrap().action).unwrap(),
        pb::Action::Continue,
        "the launcher is not told to leave the job"
    );
    deregister(&agent, "dry", generation).await;

    let events = agent.events().await;
    let dry = events
        .iter()
        .find(|e| e.kind == "policy.dry_run")
        .expect("a policy.dry_run event");
    assert_eq!(dry.subject, inc.id);
    assert!(dry.message.contains("would cordon"), "{}", dry.message);
    assert!(!events.iter().any(|e| e.kind == "node.cordoned"));
    assert!(!incidents(&agent).await.cordoned);
    assert_eq!(condition(&home)["status"], "False");
    let c = agent.component("node/cordon").await;
    assert!(
        c.as_ref()
            .is_none_or(|c| c.status != pb::Status::Failed as i32),
        "{c:?}"
    );
    let (scrape, _) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(
            &scrape,
            "warden_dry_run_decisions_total",
            &[("action", "cordon")]
        ),
        1.0
    );
}
