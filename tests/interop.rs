//! Stock gRPC clients on the agent's Unix sockets (issue 22, Interop).
//!
//! The real `wardend`; the clients are the stock ones, with their defaults:
//! grpcio (Python, gRPC C-core, which names the socket path,
//! percent-encoded, as `:authority`), grpclib (Python, an HTTP/2 stack of
//! its own) and grpcurl (Go). They call every read RPC of
//! `warden.v1.Agent`, `grpc.health.v1` and server reflection over the Unix
//! socket; and NVRx 0.7's node health check (its exact call, from
//! nvidia-resiliency-ext v0.7.0, commit 02ee37aa3117) asks the nvhcd
//! socket of a healthy and of a failed simulated node.
//!
//! Needs: `$WARDEN_TEST_PYTHON` with grpcio, grpcio-tools,
//! grpcio-health-checking, grpcio-reflection and grpclib, and grpcurl
//! beside it (tests/run-all.sh installs tests/interop/requirements.txt;
//! `$WARDEN_TEST_GRPCURL` may name another grpcurl).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{TestAgent, WAIT, eventually, sample, scrape};

/// The read RPCs of warden.v1.Agent (tests/interop/stock_clients.py calls
/// each; this list is the test's check that none is left out).
const READ_RPCS: &[&str] = &[
    "GetNodeHealth",
    "GetAgentInfo",
    "ListEvents",
    "GetRanks",
    "GetIncidents",
    "GetStragglers",
    "ListCheckpoints",
    "GetGoodput",
    "WatchHealth",
    "WatchEvents",
    "WatchIncidents",
];

/// Two healthy simulated GPUs, and a TPU, with nothing else on the node.
const HEALTHY: &str = r#"
description = "two healthy GPUs"
[[gpu]]
count = 2
name = "Test GPU"
"#;

/// The same node with gpu1 lost at once (XID 79: fallen off the bus).
const GPU_LOST: &str = r#"
description = "XID 79 on gpu1 at 0s"
[[gpu]]
count = 2
name = "Test GPU"
[[fault]]
at = "0s"
kind = "xid"
gpu = 1
xid = 79
"#;

fn script() -> PathBuf {
    common::repo_root().join("tests/interop/stock_clients.py")
}

/// Runs one stock client from tests/interop/stock_clients.py; its JSON.
fn stock_client(client: &str, socket: &Path) -> serde_json::Value {
    let python = common::python();
    let probe = common::run(
        Command::new(python).args([
            "-c",
            "import grpc, grpc_tools, grpc_health, grpc_reflection, grpclib",
        ]),
        Duration::from_secs(60),
    );
    assert!(
        probe.status.success(),
        "{} lacks the stock gRPC clients (tests/run-all.sh installs them: \
         .venv/bin/pip install -r tests/interop/requirements.txt):\n{}",
        python.display(),
        probe.stderr
    );
    let out = common::run(
        Command::new(python)
            .arg(script())
            .arg(client)
            .arg(socket)
            .arg(common::repo_root().join("proto")),
        Duration::from_secs(180),
    );
    assert!(
        out.status.success(),
        "{client} client failed:\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.stdout,
        out.stderr
    );
    serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("{client} client printed no JSON ({e}): {}", out.stdout))
}

fn scenario_agent(dir: &Path, scenario: &str, extra_toml: &str) -> TestAgent {
    let path = dir.join("scenario.toml");
    std::fs::write(&path, scenario).unwrap();
    let path = path.display().to_string();
    TestAgent::start_with(
        &format!("[kmsg]\nenabled = false\n{extra_toml}"),
        &[("WARDEN_SIMULATE", &path)],
    )
}

/// GetGoodput for a job with no rank on the node: the agent's own answer,
/// NOT_FOUND naming why (proof the call reached the service).
const NO_LEDGER: &str = "no goodput ledger for job";

fn assert_all_ok(client: &str, results: &serde_json::Value, calls: &[&str]) {
    for call in calls {
        let r = &results[*call];
        if *call == "GetGoodput" {
            assert_eq!(r["code"], "NOT_FOUND", "{client}: {r}");
            assert!(
                r["details"].as_str().unwrap().contains(NO_LEDGER),
                "{client}: {r}"
            );
            continue;
        }
        assert_eq!(
            r["code"], "OK",
            "{client}: {call} did not succeed: {r}\nall results: {results:#}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_with_its_defaults_calls_every_read_rpc_health_and_reflection() {
    let dir = tempfile::tempdir().unwrap();
    let agent = scenario_agent(dir.path(), HEALTHY, "");
    let r = stock_client("grpcio", agent.socket());
    assert_all_ok("grpcio", &r, READ_RPCS);
    assert_all_ok(
        "grpcio",
        &r,
        &[
            "health.Check(node)",
            "health.Check(warden.v1.Agent)",
            "health.Watch",
            "reflection.v1alpha",
        ],
    );
    assert_eq!(r["health.Check(node)"]["summary"], "SERVING");
    assert_eq!(r["health.Check(warden.v1.Agent)"]["summary"], "SERVING");
    assert_eq!(r["health.Watch"]["summary"], "SERVING");
    let services = r["reflection.v1alpha"]["summary"]["services"]
        .as_array()
        .unwrap();
    for s in ["warden.v1.Agent", "grpc.health.v1.Health"] {
        assert!(services.iter().any(|x| x == s), "{s} not in {services:?}");
    }
    // The answers are the agent's: the simulated GPUs are in the health.
    let health = r["GetNodeHealth"]["summary"].as_str().unwrap();
    assert!(health.contains("gpu1"), "{health}");
    let info = r["GetAgentInfo"]["summary"].as_str().unwrap();
    assert!(info.contains(env!("CARGO_PKG_VERSION")), "{info}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpclib_calls_every_read_rpc_and_health() {
    let dir = tempfile::tempdir().unwrap();
    let agent = scenario_agent(dir.path(), HEALTHY, "");
    let r = stock_client("grpclib", agent.socket());
    assert_all_ok("grpclib", &r, READ_RPCS);
    assert_all_ok("grpclib", &r, &["health.Check(node)"]);
    assert_eq!(r["health.Check(node)"]["summary"], "SERVING");
    assert!(
        r["GetNodeHealth"]["summary"]
            .as_str()
            .unwrap()
            .contains("gpu1")
    );
}

/// grpcurl: `$WARDEN_TEST_GRPCURL`, else the one installed beside the
/// test interpreter (tests/run-all.sh puts it in .venv/bin from
/// tests/interop/requirements.txt), else one on PATH.
fn grpcurl() -> PathBuf {
    if let Some(p) = std::env::var_os("WARDEN_TEST_GRPCURL").filter(|p| !p.is_empty()) {
        return p.into();
    }
    let beside = common::python().with_file_name("grpcurl");
    if beside.exists() {
        return beside;
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("grpcurl"))
                .find(|p| p.exists())
        })
        .unwrap_or_default();
    on_path.unwrap_or_else(|| {
        panic!(
            "no grpcurl: run `bash tests/run-all.sh`, or `.venv/bin/pip install -r tests/interop/requirements.txt`, \
             or set WARDEN_TEST_GRPCURL"
        )
    })
}

/// `grpcurl -plaintext -unix FLAGS SOCKET ARGS` (grpcurl's defaults
/// otherwise, `:authority` included), which must succeed; its stdout.
fn grpcurl_ok(socket: &Path, flags: &[&str], args: &[&str]) -> String {
    let mut cmd = Command::new(grpcurl());
    cmd.args(["-plaintext", "-unix", "-max-time", "30"]);
    cmd.args(flags).arg(socket).args(args);
    let out = common::run(&mut cmd, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "grpcurl {args:?} failed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_lists_describes_and_calls_through_reflection() {
    let dir = tempfile::tempdir().unwrap();
    let agent = scenario_agent(dir.path(), HEALTHY, "");
    let socket = agent.socket().to_owned();
    let list = grpcurl_ok(&socket, &[], &["list"]);
    for s in [
        "warden.v1.Agent",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(list.lines().any(|l| l == s), "{s} not listed:\n{list}");
    }
    let methods = grpcurl_ok(&socket, &[], &["list", "warden.v1.Agent"]);
    for m in READ_RPCS {
        assert!(
            methods.lines().any(|l| l == format!("warden.v1.Agent.{m}")),
            "{m} not listed:\n{methods}"
        );
        // Unary calls answer; streams are the Python clients' (grpcurl
        // would wait on them until -max-time).
        if *m == "GetGoodput" {
            let out = common::run(
                Command::new(grpcurl())
                    .args([
                        "-plaintext",
                        "-unix",
                        "-max-time",
                        "30",
                        "-d",
                        r#"{"job_id":"interop"}"#,
                    ])
                    .arg(&socket)
                    .arg("warden.v1.Agent/GetGoodput"),
                Duration::from_secs(60),
            );
            assert!(
                out.stderr.contains("NotFound") && out.stderr.contains(NO_LEDGER),
                "GetGoodput: {}",
                out.stderr
            );
        } else if !m.starts_with("Watch") {
            let body = match *m {
                "GetStragglers" => r#"{"job_id":"interop"}"#,
                _ => "{}",
            };
            let out = grpcurl_ok(&socket, &["-d", body], &[&format!("warden.v1.Agent/{m}")]);
            serde_json::from_str::<serde_json::Value>(&out)
                .unwrap_or_else(|e| panic!("{m}: no JSON answer ({e}): {out}"));
        }
    }
    let health = grpcurl_ok(&socket, &[], &["grpc.health.v1.Health/Check"]);
    assert!(health.contains("SERVING"), "{health}");
    let described = grpcurl_ok(&socket, &[], &["describe", "warden.v1.NodeHealth"]);
    assert!(described.contains("components"), "{described}");
    let nh = grpcurl_ok(&socket, &[], &["warden.v1.Agent/GetNodeHealth"]);
    assert!(nh.contains("gpu1"), "{nh}");
}

/// The verdict NVRx 0.7's NodeHealthCheck reaches against the agent's
/// nvhcd socket, and the exception it swallowed on the way (it fails open:
/// a connectivity error reads as healthy).
fn nvrx_verdict(socket: &Path) -> (bool, Option<String>) {
    let r = stock_client("nvrx", socket);
    (
        r["healthy"].as_bool().expect("healthy is a bool"),
        r["connectivity_error"].as_str().map(str::to_owned),
    )
}

fn nvhcd_toml(dir: &Path) -> (PathBuf, String) {
    let socket = dir.join("nvhcd.sock");
    let toml = format!("[nvhcd]\nsocket = \"{}\"\n", socket.display());
    (socket, toml)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvrx_node_health_check_reads_a_healthy_node_as_healthy() {
    let dir = tempfile::tempdir().unwrap();
    let (socket, toml) = nvhcd_toml(dir.path());
    let agent = scenario_agent(dir.path(), HEALTHY, &toml);
    eventually(WAIT, "gpu1 reported", async || {
        agent.component("gpu1").await.map(|_| ())
    })
    .await;
    let failed: Vec<String> = agent
        .health()
        .await
        .components
        .into_iter()
        .filter(|c| c.status == warden_proto::v1::Status::Failed as i32)
        .map(|c| c.id)
        .collect();
    assert!(
        failed.is_empty(),
        "the test node has FAILED components: {failed:?}"
    );
    let (healthy, error) = nvrx_verdict(&socket);
    assert_eq!(error, None, "NVRx's call did not go through");
    assert!(healthy, "NVRx read a healthy node as unhealthy");
    // Counted like the agent's own calls.
    let (s, body) = scrape(&agent).await;
    let calls = sample(
        &s,
        "warden_api_requests_total",
        &[("method", "nvhcd.RunHealthCheck"), ("code", "OK")],
    );
    assert!(calls >= 1.0, "NVRx's call is not counted:\n{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvrx_node_health_check_sees_a_failed_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let (socket, toml) = nvhcd_toml(dir.path());
    let agent = scenario_agent(dir.path(), GPU_LOST, &toml);
    eventually(WAIT, "gpu1 FAILED", async || {
        agent
            .component("gpu1")
            .await
            .filter(|c| c.status == warden_proto::v1::Status::Failed as i32)
            .map(|_| ())
    })
    .await;
    let (healthy, error) = nvrx_verdict(&socket);
    assert_eq!(
        error, None,
        "NVRx's call did not go through (it would fail open)"
    );
    assert!(!healthy, "NVRx read a node with a lost GPU as healthy");
}
