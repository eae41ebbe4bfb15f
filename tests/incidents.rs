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
