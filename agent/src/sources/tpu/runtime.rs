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

/// The cores of a GetTpuRuntimeStatus answer that carry an error message,
/// by core. Pure.
pub fn core_errors(status: pb::GetTpuRuntimeStatusResponse) -> Vec<CoreError> {
    let mut errors: Vec<CoreError> = status
        .core_states
        .into_iter()
        .filter_map(|(core, s)| {
            let message = s.error_message.filter(|m| !m.trim().is_empty())?;
            Some(CoreError {
                core,
                chip: s.core_id.and_then(|c| c.chip_id),
                message,
            })
        })
        .collect();
    errors.sort_by_key(|e| e.core);
    errors
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
        // Upstream's schema also has list, key-value and bytes values: none
        // names one device.
        Attr::BoolAttr(_) | Attr::ArrayAttr(_) | Attr::KvlistAttr(_) | Attr::BytesAttr(_) => None,
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
            reading.core_errors = core_errors(resp.into_inner());
        }
        // Older libtpu: UNIMPLEMENTED is normal, not a fault.
        Err(s) if s.code() == tonic::Code::Unimplemented => {}
        Err(s) => return Err(format!("port {port}: GetTpuRuntimeStatus: {s}")),
    }
    Ok(reading)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// Protobuf wire helpers, written out by hand so the bytes do not come
    /// from the schema under test.
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn field_varint(out: &mut Vec<u8>, field: u64, v: u64) {
        varint(out, field << 3);
        varint(out, v);
    }
    fn field_bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
        varint(out, (field << 3) | 2);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }

    /// A GetTpuRuntimeStatusResponse as libtpu encodes it with upstream
    /// tpu-info's schema: four cores, `core_on_chip` a TpuCoreOnChipProto
    /// message (field 3, length-delimited), core 2 halted.
    fn upstream_bytes() -> Vec<u8> {
        let mut resp = Vec::new();
        field_bytes(&mut resp, 1, b"t1v-host-0");
        for core in 0..4u64 {
            let mut on_chip = Vec::new();
            field_varint(&mut on_chip, 1, 1); // TPU_CORE_TYPE_TENSOR_CORE
            field_varint(&mut on_chip, 2, 0);
            let mut id = Vec::new();
            field_varint(&mut id, 1, core);
            field_varint(&mut id, 2, core);
            field_bytes(&mut id, 3, &on_chip);
            let mut state = Vec::new();
            field_bytes(&mut state, 1, &id);
            field_varint(&mut state, 3, 0);
            field_bytes(&mut state, 4, &[0xab; 32]);
            field_varint(&mut state, 5, 9);
            if core == 2 {
                field_bytes(&mut state, 7, b"core 2 halted");
            }
            let mut entry = Vec::new();
            field_varint(&mut entry, 1, core);
            field_bytes(&mut entry, 2, &state);
            field_bytes(&mut resp, 2, &entry);
        }
        resp
    }

    #[test]
    fn a_status_filling_core_on_chip_decodes_and_shows_the_halted_core() {
        let status = pb::GetTpuRuntimeStatusResponse::decode(&upstream_bytes()[..])
            .expect("upstream's encoding decodes");
        assert_eq!(status.core_states.len(), 4);
        let on_chip = status.core_states[&1]
            .core_id
            .as_ref()
            .and_then(|c| c.core_on_chip.as_ref())
            .and_then(|c| c.index);
        assert_eq!(on_chip, Some(0));
        assert_eq!(
            core_errors(status),
            vec![CoreError {
                core: 2,
                chip: Some(2),
                message: "core 2 halted".into(),
            }]
        );
    }

    /// The schema warden had before (issue 22): `core_on_chip` an int32.
    /// The same bytes do not decode with it, which dropped the whole answer.
    #[derive(Clone, PartialEq, prost::Message)]
    struct OldIdentifier {
        #[prost(int32, tag = "3")]
        core_on_chip: i32,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct OldState {
        #[prost(message, optional, tag = "1")]
        core_id: Option<OldIdentifier>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct OldResponse {
        #[prost(map = "int32, message", tag = "2")]
        core_states: std::collections::HashMap<i32, OldState>,
    }

    #[test]
    fn the_old_int32_schema_could_not_decode_it() {
        assert!(OldResponse::decode(&upstream_bytes()[..]).is_err());
    }
}
