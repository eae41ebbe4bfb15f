//! System tests of `wardend --simulate`: a scripted node played by the real
//! agent, its components and faults seen through the API.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{TestAgent, WAIT, WARDEN, WARDEND, config_toml, eventually, evidence, run};
use warden_proto::v1 as pb;

const SCENARIO: &str = r#"
description = "XID 79 on gpu1 at 20s"
[[gpu]]
count = 2
name = "Test GPU"
nvlinks = 2
[[tpu]]
count = 1
[[fault]]
at = "20s"
kind = "xid"
gpu = 1
xid = 79
"#;

fn status(c: &pb::Component) -> pb::Status {
    pb::Status::try_from(c.status).unwrap_or(pb::Status::Unspecified)
}

#[tokio::test]
async fn scripted_xid_arrives_and_fails_the_gpu_on_time() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("xid.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let scenario = scenario.display().to_string();
    // Speed 10: the fault at 20 s arrives 2 s after start.
    let agent = TestAgent::start_with(
        "[kmsg]\nenabled = false\n",
        &[
            ("WARDEN_SIMULATE", &scenario),
            ("WARDEN_SIMULATE_SPEED", "10"),
        ],
    );
    let started = Instant::now();
    let mut client = agent.client().await;
    let ids = eventually(WAIT, "simulated components", async || {
        let h = client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<String> = h.components.iter().map(|c| c.id.clone()).collect();
        ids.iter().any(|i| i == "tpu0").then_some(ids)
    })
    .await;
    for id in ["gpu0", "gpu1", "gpu0/nvlink0", "gpu1/nvlink1", "tpu0"] {
        assert!(ids.iter().any(|i| i == id), "{id} missing from {ids:?}");
    }
    let xid = eventually(WAIT, "gpu.xid", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "gpu.xid")
    })
    .await;
    let at = started.elapsed();
    assert_eq!(xid.subject, "gpu1");
    assert_eq!(evidence(&xid, "xid"), Some("79"));
    // 20 s of scenario at speed 10 is 2 s; allow for a busy test machine.
    assert!(
        at >= Duration::from_millis(1500) && at < Duration::from_secs(6),
        "the XID came after {at:?}"
    );
    let gpu1 = eventually(WAIT, "gpu1 FAILED", async || {
        let h = client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .unwrap()
            .into_inner();
        h.components
            .into_iter()
            .find(|c| c.id == "gpu1" && status(c) == pb::Status::Failed)
    })
    .await;
    assert_eq!(gpu1.reasons[0].signal, "gpu.xid");
}

#[test]
fn a_bad_scenario_exits_78_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("bad.toml");
    std::fs::write(&scenario, "[[gpu]]\ncount = 2\n[[fault]]\nat = \"1s\"\nkind = \"xid\"\ngpu = 0\nxid = 79\nseverity = \"high\"\n").unwrap();
    let config = dir.path().join("wardend.toml");
    std::fs::write(&config, config_toml(&dir.path().join("w.sock"), "")).unwrap();
    let out = run(
        Command::new(WARDEND)
            .arg("--config")
            .arg(&config)
            .arg("--simulate")
            .arg(&scenario),
        WAIT,
    );
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    assert!(
        out.stderr.contains("fault[0]") && out.stderr.contains("severity"),
        "{}",
        out.stderr
    );
}

/// Issue 34: the simulated node is a source kind like the others, its
/// `[simulated]` section in the config file (the flags only fill it in).
/// Played from the config alone; its GPU's health reason says it is an
/// XID (`reason_kind`), as NVML's does; a bad scenario named in a config
/// is refused by `--check-config`, naming the key and the scenario's own.
#[tokio::test]
async fn a_scenario_named_in_the_config_is_played_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("xid.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let agent = TestAgent::start(&format!(
        "[kmsg]\nenabled = false\n[simulated]\nscenario = {:?}\nspeed = 10.0\n",
        scenario.display().to_string()
    ));
    let changed = eventually(WAIT, "gpu1's health.changed to FAILED", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "health.changed" && e.subject == "gpu1")
    })
    .await;
    assert_eq!(evidence(&changed, "to"), Some("FAILED"), "{changed:?}");
    assert_eq!(evidence(&changed, "signal"), Some("gpu.xid"), "{changed:?}");
    assert_eq!(
        evidence(&changed, "reason_kind"),
        Some("xid"),
        "{changed:?}"
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[gpu]]\ncount = 1\n[[fault]]\nat = \"1s\"\nkind = \"xid\"\ngpu = 3\nxid = 79\n",
    )
    .unwrap();
    // `wardend --check-config` of a config with `section` (and `flags`):
    // refused (78), its message naming each of `named`.
    let config = dir.path().join("wardend.toml");
    let refused = |section: &str, flags: &[&std::ffi::OsStr], named: &[&str]| {
        std::fs::write(&config, config_toml(&dir.path().join("w.sock"), section)).unwrap();
        let out = run(
            Command::new(WARDEND)
                .arg("--check-config")
                .arg(&config)
                .args(flags),
            WAIT,
        );
        assert_eq!(out.status.code(), Some(78), "{section}: {out:?}");
        for n in named {
            assert!(out.stderr.contains(n), "{section}: {n} in {}", out.stderr);
        }
    };
    let bad_scenario = format!("[simulated]\nscenario = {:?}\n", bad.display().to_string());
    refused(&bad_scenario, &[], &["simulated.scenario", "fault[0].gpu"]);
    // The flags are checked with the file: a bad scenario given by flag
    // fails the check as it would fail the start.
    refused(
        "",
        &["--simulate".as_ref(), bad.as_os_str()],
        &["fault[0].gpu"],
    );
    // A relative path would be read from wherever the config is read.
    refused(
        "[simulated]\nscenario = \"xid.toml\"\n",
        &[],
        &["simulated.scenario", "absolute"],
    );
    // A speed without a scenario plays nothing.
    refused("[simulated]\nspeed = 5.0\n", &[], &["simulated.speed"]);

    // `warden run` embedding an agent of that config refuses to start the
    // job: the worker never runs on an agent whose sources would fail.
    std::fs::write(&config, format!("[kmsg]\nenabled = false\n{bad_scenario}")).unwrap();
    let ran = dir.path().join("worker-ran");
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(dir.path().join("no-agent-here.sock"))
            .args(["run", "--nproc-per-node", "1", "--agent-config"])
            .arg(&config)
            .args(["--", "touch"])
            .arg(&ran)
            .env_remove("WARDEN_SOCKET"),
        WAIT,
    );
    assert!(!out.status.success(), "{out:?}");
    for n in ["invalid scenario", "fault[0].gpu"] {
        assert!(out.stderr.contains(n), "{n} in {}", out.stderr);
    }
    assert!(!ran.exists(), "the worker ran: {}", out.stderr);
}
