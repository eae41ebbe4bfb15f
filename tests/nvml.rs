//! The NVML source against a stand-in libnvidia-ml (tests/nvml_stub), built
//! here with `cc` and scripted through the file named by `NVML_STUB_STATE`.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{TestAgent, WAIT, eventually, evidence, sample, scrape};
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
        // The stub, like a pre-r570 driver, answers the recovery-action
        // field NOT_SUPPORTED: the GPU says it is judged without it.
        assert!(
            c.labels
                .get("unread")
                .is_some_and(|u| u.contains("nvmlDeviceGetFieldValues")),
            "{c:?}"
        );
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

/// The reason `signal` on `c`.
fn reason<'a>(c: &'a pb::Component, signal: &str) -> &'a pb::Reason {
    c.reasons
        .iter()
        .find(|r| r.signal == signal)
        .unwrap_or_else(|| panic!("no {signal} reason on {c:?}"))
}

#[tokio::test]
async fn nvlink_pcie_clocks_remap_and_temperature_end_to_end() {
    // gpu0: NVLink 1 of 2 down. gpu1: PCIe at gen 3 x8 of gen 5 x16.
    // gpu2: HW thermal slowdown (0x40, with GPU idle 0x1). gpu3: a row remap
    // failed. gpu4: 95 C against the default 90 C.
    let healthy = "count=5\ngpu0.nvlinks=2\n";
    let stub = Stub::new(healthy);
    let agent = stub.start("");
    for id in ["gpu0", "gpu0/nvlink1", "gpu1/pcie", "gpu2", "gpu3", "gpu4"] {
        component_where(&agent, id, &format!("{id} OK"), |c| {
            status(c.status) == pb::Status::Ok
        })
        .await;
    }
    stub.set(
        "count=5\ngpu0.nvlinks=2\ngpu0.nvlink1.down=1\ngpu1.pcie_gen=3\ngpu1.pcie_width=8\n\
         gpu2.throttle=65\ngpu3.remap_corr=1\ngpu3.remap_failure=1\ngpu4.temp=95\n",
    );

    let c = component_where(&agent, "gpu0/nvlink1", "NVLink 1 down", |c| {
        has_reason(c, "nvlink.state")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
    assert_eq!(reason(&c, "nvlink.state").value, "down");
    component_where(&agent, "gpu0/nvlink0", "NVLink 0 still OK", |c| {
        status(c.status) == pb::Status::Ok
    })
    .await;

    let c = component_where(&agent, "gpu1/pcie", "PCIe below max", |c| {
        has_reason(c, "pcie.link_gen") && has_reason(c, "pcie.link_width")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Degraded);
    let (g, w) = (reason(&c, "pcie.link_gen"), reason(&c, "pcie.link_width"));
    assert_eq!((g.value.as_str(), g.threshold.as_str()), ("3", "= 5 (max)"));
    assert_eq!(
        (w.value.as_str(), w.threshold.as_str()),
        ("8", "= 16 (max)")
    );
    assert_eq!(c.labels["width"], "8 of 16");

    // Debounced: DEGRADED once the reason has been seen on two polls in a row.
    let c = component_where(&agent, "gpu2", "HW thermal held", |c| {
        has_reason(c, "clocks.event_reasons")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Degraded);
    let r = reason(&c, "clocks.event_reasons");
    assert_eq!(r.value, "0x40", "only the protective bits: {r:?}");
    assert!(r.message.contains("HW thermal"), "{r:?}");

    let c = component_where(&agent, "gpu3", "row remap failure", |c| {
        has_reason(c, "rows.remap_failure")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Failed);
    assert_eq!(c.labels["remapped_rows"], "1 corrected, 0 uncorrected");

    let c = component_where(&agent, "gpu4", "over temperature", |c| {
        has_reason(c, "temperature")
    })
    .await;
    assert_eq!(status(c.status), pb::Status::Degraded);
    let r = reason(&c, "temperature");
    assert_eq!(
        (r.value.as_str(), r.threshold.as_str()),
        ("95 C", ">= 90 C")
    );

    // All back to healthy: every verdict clears (the clock events after
    // their debounce).
    stub.set(healthy);
    for id in ["gpu0/nvlink1", "gpu1/pcie", "gpu2", "gpu3", "gpu4"] {
        component_where(&agent, id, &format!("{id} OK again"), |c| {
            status(c.status) == pb::Status::Ok
        })
        .await;
    }
}

#[tokio::test]
async fn per_gpu_metrics_on_the_scrape() {
    let stub = Stub::new(
        "count=2\ngpu0.temp=77\ngpu0.ecc_corr=12\ngpu0.throttle=64\ngpu0.nvlinks=1\n\
         gpu0.nvlink0.replay=3\ngpu1.power_mw=250500\nxid.1=0,79\nxid.2=0,79\nxid.3=1,13\n",
    );
    let agent = stub.start("");
    // Both XIDs on gpu0 and the one on gpu1 have reached the poll (counted
    // before the poll reports), and the gauges are set.
    component_where(&agent, "gpu0", "gpu0 with two XIDs", |c| {
        c.reasons.iter().filter(|r| r.signal == "gpu.xid").count() == 2
    })
    .await;
    component_where(&agent, "gpu1", "gpu1 with XID 13", |c| {
        has_reason(c, "gpu.xid")
    })
    .await;
    let (m, body) = scrape(&agent).await;
    let uuid0 = "GPU-00000000-0000-0000-0000-000000000000";
    let gpu0 = [("gpu", "gpu0"), ("uuid", uuid0)];
    assert_eq!(
        sample(&m, "warden_gpu_temperature_celsius", &gpu0),
        77.0,
        "{body}"
    );
    assert_eq!(
        sample(
            &m,
            "warden_gpu_xids_total",
            &[("gpu", "gpu0"), ("xid", "79"), ("source", "nvml")]
        ),
        2.0,
        "{body}"
    );
    assert_eq!(
        sample(
            &m,
            "warden_gpu_xids_total",
            &[("gpu", "gpu1"), ("xid", "13")]
        ),
        1.0,
        "{body}"
    );
    assert_eq!(
        sample(
            &m,
            "warden_gpu_ecc_errors",
            &[
                ("gpu", "gpu0"),
                ("kind", "corrected"),
                ("scope", "volatile")
            ]
        ),
        12.0,
        "{body}"
    );
    assert_eq!(
        sample(&m, "warden_gpu_clock_event_reasons", &gpu0),
        64.0,
        "{body}"
    );
    assert_eq!(
        sample(
            &m,
            "warden_gpu_nvlink_errors",
            &[("gpu", "gpu0"), ("link", "0"), ("counter", "replay")]
        ),
        3.0,
        "{body}"
    );
    assert!(
        (sample(&m, "warden_gpu_power_watts", &[("gpu", "gpu1")]) - 250.5).abs() < 1e-9,
        "{body}"
    );
    assert!(
        body.contains("# HELP warden_gpu_temperature_celsius"),
        "{body}"
    );
}
