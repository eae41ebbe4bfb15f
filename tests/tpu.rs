//! System test of the TPU source against the real `wardend`: a fake sysfs
//! tree with v5e chips (PCI vendor 0x1ae0) and a test server speaking
//! libtpu's `tpu.monitoring.runtime.RuntimeMetricService` on 127.0.0.1,
//! encoding with upstream tpu-info's schema (every field of a core's state
//! filled, `core_on_chip` a message, as a real libtpu sends it).

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{TestAgent, WAIT, eventually};
use tonic::{Request, Response, Status};
use warden_proto::tpu::monitoring::runtime as rt;
use warden_proto::tpu::monitoring::runtime::runtime_metric_service_server::{
    RuntimeMetricService, RuntimeMetricServiceServer,
};
use warden_proto::tpu_telemetry::{
    CurrentCoreStateSummary, QueuedProgramInfo, SequencerInfo, TpuCoreIdentifier,
    TpuCoreOnChipProto, TpuCoreTypeProto, TpuSequencerTypeProto,
};
use warden_proto::v1 as pb;

const GIB: i64 = 1 << 30;

/// A stand-in for libtpu, encoding with upstream tpu-info's schema
/// (proto/tpu_info/proto/): `chips` chips with fixed metrics, and a core
/// error the test can set on one core.
#[derive(Debug, Clone)]
struct FakeLibtpu {
    chips: i64,
    core_error: Arc<Mutex<Option<(i32, String)>>>,
}

impl FakeLibtpu {
    fn new(chips: i64) -> Self {
        Self {
            chips,
            core_error: Arc::default(),
        }
    }

    fn per_chip(&self, f: impl Fn(i64) -> rt::gauge::Value) -> Vec<rt::Metric> {
        (0..self.chips).map(|d| metric(d, f(d))).collect()
    }
}

/// One core's state as a real libtpu fills it: every field of upstream's
/// `CurrentCoreStateSummary`, `core_on_chip` (a `TpuCoreOnChipProto`
/// message, which an int32 schema cannot decode) included.
fn core_state(id: i32, error_message: Option<String>) -> CurrentCoreStateSummary {
    CurrentCoreStateSummary {
        core_id: Some(TpuCoreIdentifier {
            global_core_id: Some(id),
            chip_id: Some(id),
            core_on_chip: Some(TpuCoreOnChipProto {
                r#type: Some(TpuCoreTypeProto::TpuCoreTypeTensorCore as i32),
                index: Some(0),
            }),
        }),
        sequencer_info: vec![SequencerInfo {
            sequencer_type: Some(TpuSequencerTypeProto::TpuSequencerTypeTensorCoreSequencer as i32),
            sequencer_index: Some(0),
            pc: Some(4096 + i64::from(id)),
            tag: Some(7),
            tracemark: Some(3),
            program_id: Some(11),
            run_id: Some(42),
            hlo_location: Some("fusion.12 (train.py:88)".into()),
            hlo_detailed_info: Some("[]".into()),
        }],
        xdb_server_running: Some(false),
        program_fingerprint: Some(vec![0xab; 32]),
        launch_id: Some(1),
        queued_program_info: vec![QueuedProgramInfo {
            run_id: Some(43),
            launch_id: Some(2),
            program_fingerprint: Some(vec![0xcd; 32]),
        }],
        error_message,
    }
}

fn metric(device: i64, gauge: rt::gauge::Value) -> rt::Metric {
    rt::Metric {
        attribute: Some(rt::Attribute {
            key: "device-id".into(),
            value: Some(rt::AttrValue {
                attr: Some(rt::attr_value::Attr::IntAttr(device)),
            }),
        }),
        timestamp: None,
        measure: Some(rt::metric::Measure::Gauge(rt::Gauge { value: Some(gauge) })),
        start_timestamp: None,
    }
}

#[tonic::async_trait]
impl RuntimeMetricService for FakeLibtpu {
    async fn get_runtime_metric(
        &self,
        req: Request<rt::MetricRequest>,
    ) -> Result<Response<rt::MetricResponse>, Status> {
        use rt::gauge::Value;
        let name = req.into_inner().metric_name;
        let metrics = match name.as_str() {
            "tpu.runtime.hbm.memory.usage.bytes" => self.per_chip(|d| {
                Value::AsInt(match d {
                    0 => 4 * GIB,
                    1 => 12 * GIB,
                    _ => 8 * GIB,
                })
            }),
            "tpu.runtime.hbm.memory.total.bytes" => self.per_chip(|_| Value::AsInt(16 * GIB)),
            "tpu.runtime.tensorcore.dutycycle.percent" => self.per_chip(|d| {
                Value::AsDouble(match d {
                    0 => 50.0,
                    1 => 99.0,
                    _ => 70.0,
                })
            }),
            _ => return Err(Status::not_found(format!("no metric {name}"))),
        };
        Ok(Response::new(rt::MetricResponse {
            metric: Some(rt::TpuMetric {
                name,
                description: String::new(),
                metrics,
            }),
        }))
    }

    async fn list_supported_metrics(
        &self,
        _: Request<rt::ListSupportedMetricsRequest>,
    ) -> Result<Response<rt::ListSupportedMetricsResponse>, Status> {
        Ok(Response::new(rt::ListSupportedMetricsResponse::default()))
    }

    async fn get_tpu_runtime_status(
        &self,
        _: Request<rt::GetTpuRuntimeStatusRequest>,
    ) -> Result<Response<rt::GetTpuRuntimeStatusResponse>, Status> {
        let error = self.core_error.lock().unwrap().clone();
        let states = (0..i32::try_from(self.chips).unwrap())
            .map(|id| {
                let message = error
                    .as_ref()
                    .filter(|(core, _)| *core == id)
                    .map(|(_, m)| m.clone());
                (id, core_state(id, message))
            })
            .collect();
        Ok(Response::new(rt::GetTpuRuntimeStatusResponse {
            host_name: Some("test-host".into()),
            core_states: states,
        }))
    }
}

fn chip(root: &Path, addr: &str, group: u32) {
    let dir = root.join("bus/pci/devices").join(addr);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("vendor"), "0x1ae0\n").unwrap();
    std::fs::write(dir.join("device"), "0x0063\n").unwrap();
    std::os::unix::fs::symlink(
        format!("../../../kernel/iommu_groups/{group}"),
        dir.join("iommu_group"),
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chips_hbm_and_core_errors() {
    let sys = tempfile::tempdir().unwrap();
    chip(sys.path(), "0000:00:04.0", 3);
    chip(sys.path(), "0000:00:05.0", 4);
    // An unrelated device is not a chip.
    let other = sys.path().join("bus/pci/devices/0000:00:06.0");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("vendor"), "0x8086\n").unwrap();

    let fake = FakeLibtpu::new(2);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RuntimeMetricServiceServer::new(fake.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let agent = TestAgent::start(&format!(
        "[host]\nsysfs_root = \"{}\"\n[tpu]\nports = [{port}]\npoll_interval = \"100ms\"\n",
        sys.path().display()
    ));

    let status = |c: &pb::Component| pb::Status::try_from(c.status).unwrap();
    let chips = eventually(WAIT, "two TPU chips with HBM labels", async || {
        let c: Vec<_> = agent
            .health()
            .await
            .components
            .into_iter()
            .filter(|c| c.kind == "tpu")
            .collect();
        (c.len() == 2 && c.iter().all(|c| c.labels.contains_key("hbm_used"))).then_some(c)
    })
    .await;
    assert_eq!(chips[0].id, "tpu0");
    assert_eq!(status(&chips[0]), pb::Status::Ok, "{:?}", chips[0]);
    assert_eq!(chips[0].labels["generation"], "v5e");
    assert_eq!(chips[0].labels["pci"], "0000:00:04.0");
    assert_eq!(chips[0].labels["dev"], "/dev/vfio/3");
    assert_eq!(chips[0].labels["hbm_used"], "4.0 GiB");
    assert_eq!(chips[0].labels["hbm_total"], "16.0 GiB");
    assert_eq!(chips[1].labels["hbm_used_percent"], "75%");
    assert_eq!(chips[1].labels["duty_cycle"], "99%");
    assert_eq!(
        chips[1].labels["runtime"],
        format!("serving on port {port}")
    );

    // A core error: its chip FAILED with the message, and an event.
    *fake.core_error.lock().unwrap() = Some((1, "TensorCore halted: HBM uncorrectable".into()));
    let tpu1 = eventually(WAIT, "tpu1 FAILED", async || {
        agent
            .health()
            .await
            .components
            .into_iter()
            .find(|c| c.id == "tpu1" && status(c) == pb::Status::Failed)
    })
    .await;
    assert!(
        tpu1.reasons[0].message.contains("HBM uncorrectable"),
        "{tpu1:?}"
    );
    let event = eventually(WAIT, "tpu.core_error", async || {
        agent
            .events()
            .await
            .into_iter()
            .find(|e| e.kind == "tpu.core_error")
    })
    .await;
    assert_eq!(event.subject, "tpu1");
    assert_eq!(
        common::evidence(&event, "error_message"),
        Some("TensorCore halted: HBM uncorrectable")
    );
    let tpu0 = agent.component("tpu0").await;
    assert_eq!(tpu0.map(|c| status(&c)), Some(pb::Status::Ok));

    // The workload goes away: no service is not a failure.
    server.abort();
    let tpu1 = eventually(WAIT, "tpu1 OK, runtime not serving", async || {
        agent.health().await.components.into_iter().find(|c| {
            c.id == "tpu1"
                && status(c) == pb::Status::Ok
                && c.labels["runtime"].starts_with("not serving")
        })
    })
    .await;
    assert!(tpu1.reasons.is_empty());
}

/// Issue 22: four chips, the runtime reports core 2 halted, in answers that
/// fill `core_on_chip` (a message upstream; the int32 the old schema had
/// made every GetTpuRuntimeStatus answer fail to decode, and the chips
/// stayed OK). HBM, duty cycle and the core error all arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_chips_with_core_2_halted_in_upstream_encoding() {
    let sys = tempfile::tempdir().unwrap();
    for i in 0..4u32 {
        chip(sys.path(), &format!("0000:00:0{}.0", 4 + i), 3 + i);
    }
    let fake = FakeLibtpu::new(4);
    *fake.core_error.lock().unwrap() =
        Some((2, "core 2 halted: TensorCore sequencer fault".into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let _server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RuntimeMetricServiceServer::new(fake.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let agent = TestAgent::start(&format!(
        "[host]\nsysfs_root = \"{}\"\n[tpu]\nports = [{port}]\npoll_interval = \"100ms\"\n",
        sys.path().display()
    ));
    let status = |c: &pb::Component| pb::Status::try_from(c.status).unwrap();
    let chips = eventually(WAIT, "four chips read, tpu2 FAILED", async || {
        let c: Vec<_> = agent
            .health()
            .await
            .components
            .into_iter()
            .filter(|c| c.kind == "tpu")
            .collect();
        (c.len() == 4
            && c.iter().all(|c| c.labels.contains_key("duty_cycle"))
            && c.iter()
                .any(|c| c.id == "tpu2" && status(c) == pb::Status::Failed))
        .then_some(c)
    })
    .await;
    for c in &chips {
        let want = if c.id == "tpu2" {
            pb::Status::Failed
        } else {
            pb::Status::Ok
        };
        assert_eq!(status(c), want, "{c:?}");
        assert_eq!(c.labels["hbm_total"], "16.0 GiB", "{c:?}");
    }
    assert_eq!(chips[0].labels["hbm_used"], "4.0 GiB");
    assert_eq!(chips[2].labels["hbm_used"], "8.0 GiB");
    assert_eq!(chips[1].labels["duty_cycle"], "99%");
    assert_eq!(chips[3].labels["duty_cycle"], "70%");
    assert!(
        chips[2].reasons[0].message.contains("core 2 halted"),
        "{:?}",
        chips[2]
    );
}
