//! A client of libtpu's runtime metrics service
//! (`tpu.monitoring.runtime.RuntimeMetricService`), served on loopback by the
//! training process while it holds the TPU.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use warden_proto::tpu::monitoring::runtime as pb;
use warden_proto::tpu::monitoring::runtime::runtime_metric_service_client::RuntimeMetricServiceClient;

/// HBM in use per device (core), bytes.
pub const HBM_USAGE: &str = "tpu.runtime.hbm.memory.usage.bytes";
/// HBM size per device (core), bytes.
pub const HBM_TOTAL: &str = "tpu.runtime.hbm.memory.total.bytes";
/// TensorCore duty cycle per chip, percent.
pub const DUTY_CYCLE: &str = "tpu.runtime.tensorcore.dutycycle.percent";

/// A core that reported an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreError {
    /// The key of `core_states` (the core's global index).
    pub core: i32,
    /// The chip, where the summary names it.
    pub chip: Option<i32>,
    /// libtpu's message.
    pub message: String,
}

/// What one runtime (one port) said.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RuntimeReading {
    /// The port it answered on.
    pub port: u16,
    /// HBM in use by device id, bytes.
    pub hbm_used: BTreeMap<i64, f64>,
    /// HBM size by device id, bytes.
    pub hbm_total: BTreeMap<i64, f64>,
    /// Duty cycle by chip, percent.
    pub duty_cycle: BTreeMap<i64, f64>,
    /// Cores with an error message.
    pub core_errors: Vec<CoreError>,
    /// Whether GetTpuRuntimeStatus answered (older libtpu: UNIMPLEMENTED).
    pub status_served: bool,
}

/// The device a metric is about: its attribute's value as an integer,
/// whatever the key (tpu-info reads it the same way).
pub fn device_of(m: &pb::Metric) -> Option<i64> {
    use pb::attr_value::Attr;
    match m.attribute.as_ref()?.value.as_ref()?.attr.as_ref()? {
        Attr::IntAttr(i) => Some(*i),
        Attr::StringAttr(s) => s.trim().parse().ok(),
        Attr::DoubleAttr(d) => Some(d.round() as i64),
        Attr::BoolAttr(_) => None,
    }
}

/// A metric's value as a number (gauge or counter).
pub fn value_of(m: &pb::Metric) -> Option<f64> {
    use pb::metric::Measure;
    match m.measure.as_ref()? {
        Measure::Gauge(g) => match g.value.as_ref()? {
            pb::gauge::Value::AsDouble(d) => Some(*d),
            pb::gauge::Value::AsInt(i) => Some(*i as f64),
            pb::gauge::Value::AsString(s) => s.trim().parse().ok(),
            pb::gauge::Value::AsBool(_) => None,
        },
        Measure::Counter(c) => match c.value.as_ref()? {
            pb::counter::Value::AsDouble(d) => Some(*d),
            pb::counter::Value::AsInt(i) => Some(*i as f64),
        },
        Measure::Distribution(_) | Measure::Summary(_) => None,
    }
}

async fn metric(
    client: &mut RuntimeMetricServiceClient<Channel>,
    name: &str,
) -> BTreeMap<i64, f64> {
    let req = pb::MetricRequest {
        metric_name: name.into(),
        skip_node_aggregation: false,
    };
    // A metric this libtpu does not serve is simply absent.
    let Ok(resp) = client.get_runtime_metric(req).await else {
        return BTreeMap::new();
    };
    resp.into_inner()
        .metric
        .map(|m| {
            m.metrics
                .iter()
                .filter_map(|x| Some((device_of(x)?, value_of(x)?)))
                .collect()
        })
        .unwrap_or_default()
}

/// Asks the runtime on `127.0.0.1:port`; an error means nobody serves there.
pub async fn query(port: u16, timeout: Duration) -> Result<RuntimeReading, String> {
    let endpoint = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(timeout)
        .timeout(timeout);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| format!("port {port}: {e}"))?;
    let mut client = RuntimeMetricServiceClient::new(channel);
    let mut reading = RuntimeReading {
        port,
        hbm_used: metric(&mut client, HBM_USAGE).await,
        hbm_total: metric(&mut client, HBM_TOTAL).await,
        duty_cycle: metric(&mut client, DUTY_CYCLE).await,
        ..RuntimeReading::default()
    };
    match client
        .get_tpu_runtime_status(pb::GetTpuRuntimeStatusRequest {
            include_hlo_info: false,
        })
        .await
    {
        Ok(resp) => {
            reading.status_served = true;
            for (core, s) in resp.into_inner().core_states {
                if let Some(message) = s.error_message.filter(|m| !m.trim().is_empty()) {
                    reading.core_errors.push(CoreError {
                        core,
                        chip: s.core_id.map(|c| c.chip_id),
                        message,
                    });
                }
            }
            reading.core_errors.sort_by_key(|e| e.core);
        }
        // Older libtpu: UNIMPLEMENTED is normal, not a fault.
        Err(s) if s.code() == tonic::Code::Unimplemented => {}
        Err(s) => return Err(format!("port {port}: GetTpuRuntimeStatus: {s}")),
    }
    Ok(reading)
}
