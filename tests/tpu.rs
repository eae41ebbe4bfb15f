//! System test of the TPU source against the real `wardend`: a fake sysfs
//! tree with two v5e chips (PCI vendor 0x1ae0) and a test server speaking
//! libtpu's `tpu.monitoring.runtime.RuntimeMetricService` on 127.0.0.1.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{TestAgent, WAIT, eventually};
use tonic::{Request, Response, Status};
use warden_proto::tpu::monitoring::runtime as rt;
use warden_proto::tpu::monitoring::runtime::runtime_metric_service_server::{
    RuntimeMetricService, RuntimeMetricServiceServer,
};
use warden_proto::tpu_telemetry::{CurrentCoreStateSummary, TpuCoreIdentifier};
use warden_proto::v1 as pb;

const GIB: i64 = 1 << 30;

/// A stand-in for libtpu: fixed metrics, a core error the test can set.
#[derive(Debug, Clone, Default)]
struct FakeLibtpu {
    core_error: Arc<Mutex<Option<String>>>,
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
            "tpu.runtime.hbm.memory.usage.bytes" => vec![
                metric(0, Value::AsInt(4 * GIB)),
                metric(1, Value::AsInt(12 * GIB)),
            ],
            "tpu.runtime.hbm.memory.total.bytes" => vec![
                metric(0, Value::AsInt(16 * GIB)),
                metric(1, Value::AsInt(16 * GIB)),
            ],
            "tpu.runtime.tensorcore.dutycycle.percent" => vec![
                metric(0, Value::AsDouble(50.0)),
                metric(1, Value::AsDouble(99.0)),
            ],
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
        let core = |id: i32, error_message: Option<String>| CurrentCoreStateSummary {
            core_id: Some(TpuCoreIdentifier {
                global_core_id: id,
                chip_id: id,
                core_on_chip: 0,
            }),
            xdb_server_running: false,
            launch_id: 1,
            error_message,
        };
        Ok(Response::new(rt::GetTpuRuntimeStatusResponse {
            host_name: Some("test-host".into()),
            core_states: HashMap::from([(0, core(0, None)), (1, core(1, error))]),
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

    let fake = FakeLibtpu::default();
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
    *fake.core_error.lock().unwrap() = Some("TensorCore halted: HBM uncorrectable".into());
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
