//! The NVML source against a stand-in libnvidia-ml (tests/nvml_stub), built
//! here with `cc` and scripted through the file named by `NVML_STUB_STATE`.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{TestAgent, WAIT, eventually, evidence};
use warden_proto::v1 as pb;

/// Builds the stub into `dir` as `libnvidia-ml.so.1`.
fn build_stub(dir: &Path) -> PathBuf {
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

/// A stub library, its state file, and the agent config pointing at them.
struct Stub {
    _dir: tempfile::TempDir,
    lib: PathBuf,
    state: PathBuf,
}

impl Stub {
    fn new(state: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let lib = build_stub(dir.path());
        let state_path = dir.path().join("state");
        std::fs::write(&state_path, state).expect("write state");
        Self {
            _dir: dir,
            lib,
            state: state_path,
        }
    }

    /// Rewrites the state atomically (the stub re-reads it on every call).
    fn set(&self, state: &str) {
        let tmp = self.state.with_extension("tmp");
        std::fs::write(&tmp, state).expect("write state");
        std::fs::rename(&tmp, &self.state).expect("rename state");
    }

    fn start(&self, extra: &str) -> TestAgent {
        let toml = format!(
            "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n{extra}",
            self.lib.display().to_string()
        );
        TestAgent::start_with(&toml, &[("NVML_STUB_STATE", self.state.to_str().unwrap())])
    }
}

fn status(s: i32) -> pb::Status {
    pb::Status::try_from(s).unwrap_or(pb::Status::Unspecified)
}

/// GetNodeHealth until component `id` satisfies `check`.
async fn component_where(
    agent: &TestAgent,
    id: &str,
    what: &str,
    check: impl Fn(&pb::Component) -> bool,
) -> pb::Component {
    let mut client = agent.client().await;
    eventually(WAIT, what, async || {
        let h = client
            .get_node_health(pb::GetNodeHealthRequest {})
            .await
            .expect("GetNodeHealth")
            .into_inner();
        h.components.into_iter().find(|c| c.id == id && check(c))
    })
    .await
}

fn has_reason(c: &pb::Component, signal: &str) -> bool {
    c.reasons.iter().any(|r| r.signal == signal)
}

#[tokio::test]
async fn gpus_ok_then_ecc_xid_lost_and_count() {
    let stub = Stub::new("count=2\ngpu0.ecc_unc=3\n");
    let agent = stub.start("expected_gpus = 2\n");
    for id in ["gpu0", "gpu1"] {
        let c = component_where(&agent, id, &format!("{id} OK"), |c| {
            status(c.status) == pb::Status::Ok
        })
        .await;
        assert!(c.labels["uuid"].starts_with("GPU-"), "{c:?}");
        assert!(c.labels.contains_key("pci"), "{c:?}");
        assert_eq!(c.labels["name"], "Stub GPU");
    }
    component_where(&agent, "nvml", "nvml OK with 2 GPUs", |c| {
        status(c.status) == pb::Status::Ok && c.labels.get("gpus").map(String::as_str) == Some("2")
    })
    .await;

    // An uncorrectable ECC increase: FAILED with signal, value, threshold, window.
    stub.set("count=2\ngpu0.ecc_unc=5\n");
    let c = component_where(&agent, "gpu0", "gpu0 FAILED on ECC", |c| {
        status(c.status) == pb::Status::Failed
    })
    .await;
    let r = c
        .reasons
        .iter()
        .find(|r| r.signal == "ecc.uncorrected_volatile")
        .expect("the ECC reason");
    assert_eq!(
        (r.value.as_str(), r.threshold.as_str(), r.window.as_str()),
        ("2", ">= 1", "1m")
    );

    // XID 79 arrives as an event and marks gpu1.
    stub.set("count=2\ngpu0.ecc_unc=5\nxid.1=1,79\n");
    let c = component_where(&agent, "gpu1", "gpu1 marked by XID 79", |c| {
        has_reason(c, "gpu.xid")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
    let events = agent.events().await;
    let xid = events
        .iter()
        .find(|e| e.kind == "gpu.xid")
        .expect("a gpu.xid event");
    assert_eq!(evidence(xid, "xid"), Some("79"));
    assert_eq!(evidence(xid, "gpu"), Some("1"));
    assert_eq!(evidence(xid, "pci"), Some("00000000:11:00.0"));

    // GPU lost: FAILED from any call.
    stub.set("count=2\ngpu0.ecc_unc=5\nxid.1=1,79\ngpu1.lost=1\n");
    component_where(&agent, "gpu1", "gpu1 lost", |c| has_reason(c, "gpu.lost")).await;

    // Fewer GPUs than expected: a node-level reason, and the missing GPU FAILED.
    stub.set("count=1\nxid.1=1,79\n");
    let c = component_where(&agent, "nvml", "count below expected", |c| {
        has_reason(c, "gpu.count")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
}

#[tokio::test]
async fn no_library_is_unknown_and_the_agent_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("libnvidia-ml.so.1");
    let agent = TestAgent::start(&format!(
        "[nvml]\nlibrary = {:?}\npoll_interval = \"200ms\"\n",
        missing.display().to_string()
    ));
    let c = component_where(&agent, "nvml", "nvml UNKNOWN", |c| {
        status(c.status) == pb::Status::Unknown
    })
    .await;
    assert_eq!(c.reasons[0].signal, "nvml.load");
    assert!(c.reasons[0].message.contains("libnvidia-ml.so.1"), "{c:?}");
    // Still serving other components.
    component_where(&agent, "host/memory", "host/memory", |_| true).await;
}

#[tokio::test]
async fn a_call_that_blocks_marks_the_source_stalled_not_the_agent() {
    let stub = Stub::new("count=1\n");
    let agent = stub.start("[agent]\nsource_stall_after = \"1s\"\n");
    component_where(&agent, "gpu0", "gpu0 OK", |c| {
        status(c.status) == pb::Status::Ok
    })
    .await;
    stub.set("count=1\nhang=1\n");
    let started = std::time::Instant::now();
    let c = component_where(&agent, "gpu0", "gpu0 stalled", |c| {
        has_reason(c, "source.nvml.stalled")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Unknown);
    assert!(started.elapsed() < Duration::from_secs(8));
    // The agent answered every GetNodeHealth meanwhile; once the call
    // returns, the GPU is read again.
    stub.set("count=1\n");
    component_where(&agent, "gpu0", "gpu0 back", |c| {
        status(c.status) == pb::Status::Ok
    })
    .await;
}

#[tokio::test]
async fn recovery_action_node_reboot_fails_the_gpu_and_an_old_driver_says_nothing() {
    // gpu0 asks for a node reboot, gpu1 for nothing, gpu2's driver predates
    // the field (NOT_SUPPORTED).
    let stub = Stub::new("count=3\ngpu0.recovery_action=2\ngpu1.recovery_action=0\n");
    let agent = stub.start("");
    let c = component_where(&agent, "gpu0", "gpu0 FAILED on recovery action", |c| {
        has_reason(c, "gpu.recovery_action")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
    let r = c
        .reasons
        .iter()
        .find(|r| r.signal == "gpu.recovery_action")
        .expect("the reason");
    assert_eq!(r.value, "2 (node reboot)");
    assert!(r.message.contains("node reboot"), "{r:?}");
    for id in ["gpu1", "gpu2"] {
        let c = component_where(&agent, id, &format!("{id} OK"), |c| {
            status(c.status) == pb::Status::Ok
        })
        .await;
        assert!(c.reasons.is_empty(), "{c:?}");
    }
    // The driver clears the action: the reason goes.
    stub.set("count=3\ngpu0.recovery_action=0\n");
    component_where(&agent, "gpu0", "gpu0 OK again", |c| {
        status(c.status) == pb::Status::Ok
    })
    .await;
}

#[tokio::test]
async fn one_gpu_refusing_xid_events_leaves_the_others_watched() {
    // gpu0 registers first; gpu1 refuses (NOT_SUPPORTED). Freeing the set on
    // gpu1's refusal would lose gpu0's registration.
    let stub = Stub::new("count=2\ngpu1.register_error=3\n");
    let agent = stub.start("");
    let c = component_where(&agent, "nvml", "nvml says which GPU is unwatched", |c| {
        c.labels
            .get("xid")
            .is_some_and(|x| x.starts_with("watched"))
    })
    .await;
    let xid = &c.labels["xid"];
    assert!(xid.contains("gpu1") && !xid.contains("gpu0"), "{xid}");
    // XID 48 on gpu0 arrives; nothing can come from gpu1.
    stub.set("count=2\ngpu1.register_error=3\nxid.1=0,48\n");
    let c = component_where(&agent, "gpu0", "gpu0 marked by XID 48", |c| {
        has_reason(c, "gpu.xid")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
    let events = agent.events().await;
    let x = events
        .iter()
        .find(|e| e.kind == "gpu.xid")
        .expect("a gpu.xid event");
    assert_eq!(evidence(x, "gpu"), Some("0"));
    assert_eq!(evidence(x, "xid"), Some("48"));
    component_where(&agent, "gpu1", "gpu1 still read, OK", |c| {
        status(c.status) == pb::Status::Ok
    })
    .await;
}
