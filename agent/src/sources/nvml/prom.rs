//! Per-GPU Prometheus metrics, recorded through the `metrics` facade from
//! each poll's readings (the recorder renders them on `/metrics`; their
//! descriptions are in `api::metrics_http`). `gpu` is the component id
//! (`gpu0`), so a series joins `warden_component_status{component}`.
//! Counters NVML keeps (ECC, NVLink errors) are exported as gauges of their
//! value: the agent did not count them and does not own their resets.

use super::judge::GpuReading;
use warden_core::device::DeviceId;

/// The XID counter: `warden_gpu_xids_total{gpu,xid,source}`, incremented by
/// every source that sees an XID (`source`: `nvml` or `kmsg`, so a node that
/// runs both does not count one XID twice in one series).
pub fn count_xid(gpu: &str, xid: u64, source: &'static str) {
    metrics::counter!(
        "warden_gpu_xids_total",
        "gpu" => gpu.to_owned(),
        "xid" => xid.to_string(),
        "source" => source,
    )
    .increment(1);
}

/// Records one GPU's reading; signals not read are left as they were.
#[allow(clippy::cast_precision_loss)] // counters far below 2^53
pub fn record(r: &GpuReading) {
    let gpu = DeviceId::Gpu(r.index).to_string();
    let uuid = r.labels.get("uuid").cloned().unwrap_or_default();
    for (kind, v) in [
        ("corrected", r.ecc_corrected_volatile),
        ("uncorrected", r.ecc_uncorrected_volatile),
    ] {
        if let Some(v) = v {
            metrics::gauge!(
                "warden_gpu_ecc_errors",
                "gpu" => gpu.clone(),
                "uuid" => uuid.clone(),
                "kind" => kind,
                "scope" => "volatile",
            )
            .set(v as f64);
        }
    }
    if let Some(bits) = r.clock_events {
        metrics::gauge!("warden_gpu_clock_event_reasons", "gpu" => gpu.clone(), "uuid" => uuid.clone())
            .set(bits as f64);
    }
    if let Some(t) = r.temperature {
        metrics::gauge!("warden_gpu_temperature_celsius", "gpu" => gpu.clone(), "uuid" => uuid.clone())
            .set(f64::from(t));
    }
    if let Some(mw) = r.power_mw {
        metrics::gauge!("warden_gpu_power_watts", "gpu" => gpu.clone(), "uuid" => uuid.clone())
            .set(f64::from(mw) / 1000.0);
    }
    for l in &r.links {
        for (counter, v) in [
            ("replay", l.replay),
            ("recovery", l.recovery),
            ("crc", l.crc),
        ] {
            if let Some(v) = v {
                metrics::gauge!(
                    "warden_gpu_nvlink_errors",
                    "gpu" => gpu.clone(),
                    "uuid" => uuid.clone(),
                    "link" => l.link.to_string(),
                    "counter" => counter,
                )
                .set(v as f64);
            }
        }
    }
}
