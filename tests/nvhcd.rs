//! System test of the nvhcd endpoint: a tonic client calls
//! `nvhcd.HealthCheckService/RunHealthCheck` over `[nvhcd] socket` of the
//! real `wardend`, as nvidia-resiliency-ext does, and reads the verdict.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{TestAgent, WAIT, eventually};
use warden_cli::Target;
use warden_proto::nvhcd::HealthCheckRequest;
use warden_proto::nvhcd::health_check_service_client::HealthCheckServiceClient;

async fn check(socket: &Path) -> (bool, i32, serde_json::Value) {
    let channel = Target::Unix(socket.to_owned())
        .channel()
        .await
        .expect("connect to the nvhcd socket");
    let resp = HealthCheckServiceClient::new(channel)
        .run_health_check(HealthCheckRequest {
            args: ["--no-slurm", "--group", "prolog", "epilog", "logs", "gpu"]
                .map(String::from)
                .to_vec(),
        })
        .await
        .expect("RunHealthCheck")
        .into_inner();
    let out: serde_json::Value = serde_json::from_str(&resp.output).expect("output is JSON");
    (resp.success, resp.exit_code, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_from_the_health_model() {
    let sys = tempfile::tempdir().unwrap();
    let sock_dir = tempfile::tempdir().unwrap();
    let socket = sock_dir.path().join("nvhcd.sock");
    // A NIC that is down: a FAILED component once the host source reads it.
    let eth = sys.path().join("class/net/eth9");
    std::fs::create_dir_all(eth.join("device")).unwrap();
    std::fs::write(eth.join("operstate"), "up\n").unwrap();
    std::fs::write(eth.join("carrier"), "1\n").unwrap();
    std::fs::write(eth.join("flags"), "0x1003\n").unwrap();
    let agent = TestAgent::start(&format!(
        "[host]\npoll_interval = \"100ms\"\nsysfs_root = \"{}\"\n[nvhcd]\nsocket = \"{}\"\n",
        sys.path().display(),
        socket.display()
    ));
    let info = agent.info().await;
    assert_eq!(
        common::endpoint(&info, "nvhcd"),
        socket.display().to_string()
    );

    eventually(WAIT, "nic/eth9 read", async || {
        let health = agent
            .client()
            .await
            .get_node_health(warden_proto::v1::GetNodeHealthRequest {})
            .await
            .expect("GetNodeHealth")
            .into_inner();
        health
            .components
            .iter()
            .any(|c| c.id == "nic/eth9")
            .then_some(())
    })
    .await;
    let (success, code, out) = check(&socket).await;
    // Healthy unless something on the test machine itself is FAILED.
    if out["fail_count"] == 0 {
        assert!(success);
        assert_eq!(code, 0);
    }
    assert_eq!(out["args"][0], "--no-slurm");

    std::fs::write(eth.join("operstate"), "down\n").unwrap();
    std::fs::write(eth.join("carrier"), "0\n").unwrap();
    let (success, code, out) = eventually(WAIT, "nic/eth9 among failed_checks", async || {
        let (s, c, out) = check(&socket).await;
        out["failed_checks"]
            .as_array()?
            .iter()
            .any(|f| f["component"] == "nic/eth9")
            .then_some((s, c, out))
    })
    .await;
    assert!(!success);
    assert_eq!(code, 1);
    assert!(out["fail_count"].as_u64().unwrap() >= 1, "{out}");
    let failed = out["failed_checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["component"] == "nic/eth9")
        .unwrap();
    assert_eq!(failed["reasons"][0]["signal"], "nic.link_state");

    drop(agent);
}
