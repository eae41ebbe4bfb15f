//! The DCGM source against a stand-in libdcgm (tests/dcgm_stub), built here
//! with `cc`, loaded by the agent's DCGM helper process exactly as it would
//! load NVIDIA's, and scripted through the file named by `DCGM_STUB_STATE`;
//! and the pre-restart health gate against a stand-in `dcgmi` printing
//! recorded `dcgmi diag -j` output in DCGM 4's shape.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{TestAgent, WAIT, WARDEN, eventually, python, repo_root, run};
use warden_proto::v1 as pb;

/// The stub library, its script, and a stand-in dcgmi.
struct Stub {
    dir: tempfile::TempDir,
    lib: PathBuf,
    state: PathBuf,
}

impl Stub {
    fn new(state: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/dcgm_stub/dcgm_stub.c");
        let lib = dir.path().join("libdcgm.so.4");
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(&lib)
            .arg(&src)
            .output()
            .expect("run cc");
        assert!(
            out.status.success(),
            "cc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let state_path = dir.path().join("state");
        std::fs::write(&state_path, state).unwrap();
        Self {
            dir,
            lib,
            state: state_path,
        }
    }

    /// Rewrites the script atomically (the stub re-reads it on every call).
    fn set(&self, state: &str) {
        let tmp = self.state.with_extension("tmp");
        std::fs::write(&tmp, state).unwrap();
        std::fs::rename(&tmp, &self.state).unwrap();
    }

    /// A stand-in dcgmi that prints `stdout` and exits with `code` (after
    /// `sleep_s` seconds).
    fn dcgmi(&self, stdout: &str, code: i32, sleep_s: u32) -> PathBuf {
        let out = self.dir.path().join("dcgmi.out");
        std::fs::write(&out, stdout).unwrap();
        let path = self.dir.path().join("dcgmi");
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\n[ \"$*\" = \"diag -r 1 -j\" ] || {{ echo \"unexpected args: $*\" >&2; exit 2; }}\nsleep {sleep_s}\ncat {}\nexit {code}\n",
                out.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    fn start(&self, extra: &str) -> TestAgent {
        let toml = format!(
            "[dcgm]\nenabled = true\nlibrary = {:?}\npoll_interval = \"1s\"\ncall_timeout = \"1s\"\n{extra}",
            self.lib.display().to_string()
        );
        TestAgent::start_with(&toml, &[("DCGM_STUB_STATE", self.state.to_str().unwrap())])
    }
}

fn status(c: &pb::Component) -> pb::Status {
    pb::Status::try_from(c.status).unwrap_or(pb::Status::Unspecified)
}

async fn component_where(
    agent: &TestAgent,
    id: &str,
    what: &str,
    check: impl Fn(&pb::Component) -> bool,
) -> pb::Component {
    eventually(WAIT, what, async || {
        agent.component(id).await.filter(|c| check(c))
    })
    .await
}

fn reason_text(c: &pb::Component) -> String {
    c.reasons
        .iter()
        .map(|r| format!("{} {}: {}", r.signal, r.value, r.message))
        .collect::<Vec<_>>()
        .join(" | ")
}

const HEALTHY: &str = "gpus 0 1\nconnect ok\nversion 5\ncheck ok\n";

#[tokio::test]
async fn incidents_become_findings_with_their_class_and_clear() {
    let stub = Stub::new(HEALTHY);
    let agent = stub.start("");
    let d = component_where(&agent, "dcgm", "dcgm OK", |c| status(c) == pb::Status::Ok).await;
    assert_eq!(d.labels["health_response"], "v5", "{d:?}");
    assert_eq!(d.labels["gpus"], "2");
    assert!(d.labels["library"].ends_with("libdcgm.so.4"), "{d:?}");

    // A double-bit ECC error on GPU 1 (FAIL) and thermal slowdown on GPU 0 (WARN).
    stub.set(&format!(
        "{HEALTHY}incident 1 1 0x10 20 4 Volatile DBE detected on GPU 1\nincident 1 0 0x80 10 10 Clocks throttled for thermal reasons on GPU 0\n"
    ));
    let g1 = component_where(&agent, "gpu1", "gpu1 FAILED", |c| {
        status(c) == pb::Status::Failed
    })
    .await;
    assert!(
        g1.reasons
            .iter()
            .any(|r| r.signal == "dcgm.volatile_dbe_detected" && r.threshold == "system mem"),
        "{}",
        reason_text(&g1)
    );
    component_where(&agent, "gpu0", "gpu0 DEGRADED", |c| {
        status(c) == pb::Status::Degraded
    })
    .await;

    // Attribution: the DBE is uncorrectable hardware on gpu1, and the node is cordoned.
    let inc = eventually(WAIT, "an incident on gpu1", async || {
        agent
            .client()
            .await
            .get_incidents(pb::GetIncidentsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .incidents
            .into_iter()
            .find(|i| i.devices.contains(&"gpu1".to_owned()) && i.decision.is_some())
    })
    .await;
    let diag = inc.diagnosis.as_ref().unwrap();
    assert_eq!(
        diag.fault_class,
        pb::FaultClass::UncorrectableHardware as i32,
        "{diag:?}"
    );
    assert!(
        diag.evidence
            .iter()
            .any(|e| e.signal == "dcgm.volatile_dbe_detected"),
        "{diag:?}"
    );
    assert_eq!(
        inc.decision.as_ref().unwrap().action,
        pb::Action::Cordon as i32
    );
    let events = agent.events().await;
    assert!(
        events
            .iter()
            .any(|e| e.kind == "dcgm.incident" && e.subject == "gpu1"),
        "a dcgm.incident event"
    );

    // An NVSwitch's fatal error lands on its own component.
    stub.set(&format!(
        "{HEALTHY}incident 1 1 0x10 20 4 Volatile DBE detected on GPU 1\nincident 3 2 0x800 20 15 NVSwitch 2 fatal error (SXid 20034)\n"
    ));
    let sw = component_where(&agent, "nvswitch2", "nvswitch2 FAILED", |c| {
        status(c) == pb::Status::Failed
    })
    .await;
    assert!(
        reason_text(&sw).contains("dcgm.nvswitch_fatal_error"),
        "{}",
        reason_text(&sw)
    );

    // The WARN goes away: gpu0 clears at the next check.
    stub.set(&format!(
        "{HEALTHY}incident 1 1 0x10 20 4 Volatile DBE detected on GPU 1\n"
    ));
    component_where(&agent, "gpu0", "gpu0 OK again", |c| {
        status(c) == pb::Status::Ok
    })
    .await;
    let text = common::http_get(&agent.metrics_url().await);
    assert!(
        text.contains("warden_dcgm_incidents_total{") && text.contains("reason=\"4\""),
        "metrics: {}",
        text.lines()
            .filter(|l| l.contains("dcgm"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test]
async fn an_all_system_xid_79_fails_the_gpu() {
    let stub = Stub::new(&format!(
        "{HEALTHY}incident 1 0 0xffffffff 20 120 GPU 0 has fallen off the bus (XID 79)\n"
    ));
    let agent = stub.start("");
    let g0 = component_where(&agent, "gpu0", "gpu0 FAILED", |c| {
        status(c) == pb::Status::Failed
    })
    .await;
    assert!(
        g0.reasons
            .iter()
            .any(|r| r.signal == "dcgm.fallen_off_bus" && r.threshold == "system all"),
        "{}",
        reason_text(&g0)
    );
}

/// Issue 34: the source says what its reasons are to attribution, from
/// DCGM's table: an XID error (101) is a report about XIDs, a recovery
/// reboot (126) the driver's own verdict; each recorded on its GPU's
/// `health.changed` as `reason_kind`, where attribution reads it.
#[tokio::test]
async fn dcgm_reasons_carry_their_kind_from_the_table() {
    let stub = Stub::new(&format!(
        "{HEALTHY}incident 1 0 0x1 20 101 XID error on GPU 0\nincident 1 1 0x1 20 126 GPU 1 needs a node reboot\n"
    ));
    let agent = stub.start("");
    for (gpu, signal, kind) in [
        ("gpu0", "dcgm.xid_error", "about_xids"),
        ("gpu1", "dcgm.gpu_recovery_reboot", "driver_verdict"),
    ] {
        let changed = eventually(WAIT, "the GPU's health.changed", async || {
            agent
                .events()
                .await
                .into_iter()
                .find(|e| e.kind == "health.changed" && e.subject == gpu)
        })
        .await;
        assert_eq!(
            common::evidence(&changed, "signal"),
            Some(signal),
            "{changed:?}"
        );
        assert_eq!(
            common::evidence(&changed, "reason_kind"),
            Some(kind),
            "{changed:?}"
        );
    }
}

#[tokio::test]
async fn unsupported_version_and_absent_host_engine_leave_dcgm_unknown() {
    let stub = Stub::new("gpus 0\nconnect ok\nversion none\ncheck ok\n");
    let agent = stub.start("");
    let d = component_where(&agent, "dcgm", "dcgm UNKNOWN (version)", |c| {
        status(c) == pb::Status::Unknown && reason_text(c).contains("unsupported DCGM version")
    })
    .await;
    assert!(
        reason_text(&d).contains("NVML"),
        "says what covers the GPUs: {}",
        reason_text(&d)
    );

    // No library at all.
    let agent3 = TestAgent::start(
        "[dcgm]\nenabled = true\nlibrary = \"/nonexistent/libdcgm.so.4\"\npoll_interval = \"1s\"\n",
    );
    component_where(&agent3, "dcgm", "dcgm UNKNOWN (no library)", |c| {
        status(c) == pb::Status::Unknown && reason_text(c).contains("no DCGM library")
    })
    .await;
    drop(agent3);

    // Embedded mode needs no host engine.
    stub.set("gpus 0\nconnect refuse\nversion 5\ncheck ok\n");
    let embedded = stub.start("mode = \"embedded\"\n");
    let d = component_where(&embedded, "dcgm", "dcgm OK (embedded)", |c| {
        status(c) == pb::Status::Ok
    })
    .await;
    assert_eq!(d.labels["mode"], "embedded");
    drop(embedded);

    stub.set("gpus 0\nconnect refuse\nversion 5\n");
    let agent2 = stub.start("address = \"127.0.0.1:1\"\n");
    let d = component_where(&agent2, "dcgm", "dcgm UNKNOWN (no host engine)", |c| {
        status(c) == pb::Status::Unknown
            && reason_text(c).contains("cannot connect to nv-hostengine at 127.0.0.1:1")
    })
    .await;
    assert!(!reason_text(&d).is_empty());
    drop(agent);
}

#[tokio::test]
async fn a_blocking_or_crashing_library_does_not_take_the_agent_down() {
    let stub = Stub::new(HEALTHY);
    let agent = stub.start("");
    component_where(&agent, "dcgm", "dcgm OK", |c| status(c) == pb::Status::Ok).await;

    stub.set("gpus 0 1\nconnect ok\nversion 5\ncheck block\n");
    let d = component_where(&agent, "dcgm", "dcgm UNKNOWN (blocked)", |c| {
        status(c) == pb::Status::Unknown && reason_text(c).contains("did not return within")
    })
    .await;
    assert!(
        reason_text(&d).contains("dcgmHealthCheck"),
        "{}",
        reason_text(&d)
    );
    // The API answers at once meanwhile.
    let t = Instant::now();
    agent.health().await;
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "GetNodeHealth took {:?}",
        t.elapsed()
    );

    stub.set("gpus 0 1\nconnect ok\nversion 5\ncheck crash\n");
    component_where(&agent, "dcgm", "dcgm UNKNOWN (crashed)", |c| {
        status(c) == pb::Status::Unknown && reason_text(c).contains("died")
    })
    .await;
    assert!(
        common::proc_state(agent.pid()).is_some_and(|s| s != 'Z'),
        "the agent is still up"
    );

    // Back to normal: a new helper opens DCGM again.
    stub.set(HEALTHY);
    component_where(&agent, "dcgm", "dcgm OK again", |c| {
        status(c) == pb::Status::Ok
    })
    .await;
}

const DIAG_PASS: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
 {"category": "Deployment", "tests": [{"name": "software", "results": [
  {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}],
  "test_summary": {"status": "Pass"}}]}]}}"#;
const DIAG_FAIL: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "test_categories": [
 {"category": "Hardware", "tests": [{"name": "memory", "results": [
  {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
   "warnings": [{"warning": "Memory test found 3 uncorrectable errors on GPU 1", "error_id": 4,
                 "error_category": 2, "error_severity": "isolate"}]}],
  "test_summary": {"status": "Fail"}}]}]}}"#;
const DIAG_RUNTIME: &str = r#"{"DCGM Diagnostic": {"version": "4.2.3", "runtime_error": "Unable to connect to the host engine"}}"#;

fn diag(agent: &TestAgent) -> (i32, serde_json::Value) {
    let out = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .args(["diag", "--job", "jobx", "--json"]),
        Duration::from_secs(20),
    );
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", out.stdout, out.stderr));
    (out.code(), v)
}

#[tokio::test]
async fn the_gate_passes_refuses_and_fails_safe() {
    let stub = Stub::new(HEALTHY);
    // Pass.
    let dcgmi = stub.dcgmi(DIAG_PASS, 0, 0);
    // Each call below must run the stand-in as it is then (no cached answer).
    let agent = stub.start(&format!(
        "dcgmi = {:?}\ngate_timeout = \"2s\"\ngate_cache_for = \"0s\"\n",
        dcgmi.display().to_string()
    ));
    let (code, v) = diag(&agent);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["passed"], true);
    assert_eq!(v["ran"], "dcgmi diag -r 1");

    // A failed memory test with an isolate severity (exit 205): refused,
    // with the evidence, and an incident takes the node out.
    stub.dcgmi(DIAG_FAIL, 205, 0);
    let (code, v) = diag(&agent);
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["passed"], false);
    assert_eq!(v["failures"][0]["entity"], "gpu1");
    assert_eq!(v["failures"][0]["test"], "memory");
    assert_eq!(v["failures"][0]["severity"], "isolate");
    let inc = eventually(WAIT, "the gate's incident", async || {
        agent
            .client()
            .await
            .get_incidents(pb::GetIncidentsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .incidents
            .into_iter()
            .find(|i| i.job_id == "jobx" && i.decision.is_some())
    })
    .await;
    assert_eq!(
        inc.decision.as_ref().unwrap().action,
        pb::Action::Cordon as i32,
        "{inc:?}"
    );
    assert!(
        inc.diagnosis
            .as_ref()
            .unwrap()
            .evidence
            .iter()
            .any(|e| e.signal == "gate.memory" && e.source == "gate"),
        "{inc:?}"
    );

    // No verdict from dcgmi (a runtime error, garbage, a timeout): the NVML
    // check decides, and says why.
    for (out, code, sleep, why) in [
        (DIAG_RUNTIME, 226, 0, "runtime error"),
        ("Segmentation fault", 139, 0, "not JSON"),
        (DIAG_PASS, 0, 10, "did not finish"),
    ] {
        stub.dcgmi(out, code, sleep);
        let (exit, v) = diag(&agent);
        assert_eq!(v["ran"], "nvml check", "{why}: {v}");
        assert!(v["note"].as_str().unwrap().contains(why), "{why}: {v}");
        assert_eq!(exit, 0, "no NVML finding: the node passes ({why}): {v}");
    }
}

/// `warden run` asks the gate before an in-job restart: a failed dcgmi
/// diag refuses the restart on this node and the job exits 86 (node fault).
#[test]
fn a_failing_gate_refuses_the_in_job_restart() {
    let stub = Stub::new(HEALTHY);
    let dcgmi = stub.dcgmi(DIAG_FAIL, 205, 0);
    let dir = stub.dir.path();
    let agent_toml = dir.join("agent.toml");
    std::fs::write(
        &agent_toml,
        format!(
            "[agent]\ntick = \"50ms\"\n[kmsg]\nenabled = false\n[nvml]\nenabled = false\n\
             [dcgm]\nenabled = false\ndcgmi = {:?}\ngate_timeout = \"10s\"\n",
            dcgmi.display().to_string()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(WARDEN);
    cmd.arg("--socket")
        .arg(dir.join("no-agent-here.sock"))
        .args([
            "run",
            "--nproc-per-node",
            "2",
            "--rdzv-id",
            "gatejob",
            "--agent",
            "embedded",
        ])
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--agent-config")
        .arg(&agent_toml)
        .arg("--")
        .arg(python())
        .arg(repo_root().join("examples/train.py"))
        .arg("--ckpt-dir")
        .arg(dir.join("ckpt"))
        .args(["--steps", "30", "--step-ms", "20", "--crash-at-step", "4"])
        .current_dir(dir);
    let out = run(&mut cmd, Duration::from_secs(90));
    assert_eq!(
        out.code(),
        86,
        "a node fault\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.stdout,
        out.stderr
    );
    let all = format!("{}{}", out.stdout, out.stderr);
    assert!(
        all.contains("health gate refused") && all.contains("memory on gpu1"),
        "{all}"
    );
}

/// Builds the stand-in NVML into `dir` (as tests/nvml.rs does).
fn nvml_stub(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/nvml_stub/nvml_stub.c");
    let lib = dir.join("libnvidia-ml.so.1");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

/// A GPU host with NVML and no DCGM installed: `dcgm` is ABSENT (in the
/// API, `warden health` and the metrics) and the node is OK. The same host
/// with DCGM configured but its host engine unreachable is not OK: there
/// DCGM should be, and is not.
#[tokio::test]
async fn dcgm_absent_by_design_leaves_the_node_ok_and_configured_but_unreachable_does_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let nvml = nvml_stub(dir.path());
    let nvml_state = dir.path().join("nvml-state");
    std::fs::write(&nvml_state, "count=1\n").unwrap();
    let nvml_env = [("NVML_STUB_STATE", nvml_state.to_str().unwrap())];
    // Default DCGM settings: the library is looked for under its default
    // names, which this host does not have.
    let toml = format!(
        "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n[dcgm]\nenabled = true\npoll_interval = \"1s\"\n",
        nvml.display().to_string()
    );
    let agent = TestAgent::start_with(&toml, &nvml_env);
    let d = component_where(&agent, "dcgm", "dcgm ABSENT", |c| {
        status(c) == pb::Status::Absent
    })
    .await;
    assert!(
        reason_text(&d).contains("no DCGM library") && reason_text(&d).contains("NVML alone"),
        "{}",
        reason_text(&d)
    );
    component_where(&agent, "gpu0", "gpu0 OK", |c| status(c) == pb::Status::Ok).await;
    let node = eventually(WAIT, "the node OK", async || {
        let h = agent.health().await;
        (pb::Status::try_from(h.status) == Ok(pb::Status::Ok)).then_some(h)
    })
    .await;
    assert!(node.components.iter().any(|c| c.id == "dcgm"), "{node:#?}");
    let shown = run(
        Command::new(WARDEN)
            .arg("--socket")
            .arg(agent.socket())
            .arg("health"),
        Duration::from_secs(20),
    );
    assert_eq!(shown.code(), 0, "{shown:?}");
    assert!(shown.stdout.contains(": OK"), "{}", shown.stdout);
    let dcgm_row = shown
        .stdout
        .lines()
        .find(|l| l.contains("dcgm"))
        .unwrap_or_else(|| panic!("no dcgm row: {}", shown.stdout));
    assert!(dcgm_row.contains("ABSENT"), "{dcgm_row}");
    let (scrape, text) = common::scrape(&agent).await;
    assert_eq!(
        common::sample(&scrape, "warden_component_status", &[("component", "dcgm")]),
        -1.0,
        "{text}"
    );
    drop(agent);

    // DCGM configured (its library named) but the host engine unreachable.
    let stub = Stub::new("gpus 0\nconnect refuse\nversion 5\n");
    let toml = format!(
        "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n[dcgm]\nenabled = true\nlibrary = {:?}\naddress = \"127.0.0.1:1\"\npoll_interval = \"1s\"\ncall_timeout = \"1s\"\n",
        nvml.display().to_string(),
        stub.lib.display().to_string()
    );
    let agent = TestAgent::start_with(
        &toml,
        &[
            nvml_env[0],
            ("DCGM_STUB_STATE", stub.state.to_str().unwrap()),
        ],
    );
    component_where(&agent, "dcgm", "dcgm UNKNOWN (unreachable)", |c| {
        status(c) == pb::Status::Unknown
    })
    .await;
    let h = agent.health().await;
    assert_eq!(
        pb::Status::try_from(h.status),
        Ok(pb::Status::Unknown),
        "the node is not OK: {h:#?}"
    );
}

/// A TPU or CPU host: neither NVML nor DCGM is installed and no NVIDIA
/// device exists, so both read ABSENT and the node is OK (before, both were
/// UNKNOWN and so was the node).
#[tokio::test]
async fn a_host_without_nvidia_libraries_is_ok_with_nvml_and_dcgm_absent() {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this host has an NVIDIA device");
        return;
    }
    let agent = TestAgent::start("[nvml]\nenabled = true\n[dcgm]\nenabled = true\n");
    for id in ["nvml", "dcgm"] {
        component_where(&agent, id, &format!("{id} ABSENT"), |c| {
            status(c) == pb::Status::Absent
        })
        .await;
    }
    let h = agent.health().await;
    assert_eq!(pb::Status::try_from(h.status), Ok(pb::Status::Ok), "{h:#?}");
}
