//! TPU health: chips from sysfs, readings from libtpu's runtime metrics
//! service.
//!
//! In: `<sysfs>/bus/pci/devices/*` (vendor `0x1ae0`, see [`chips`]) and the
//! runtime metrics service on `127.0.0.1` at `[tpu] ports` plus
//! `TPU_RUNTIME_METRICS_PORTS` ([`runtime`]). Out: one component `tpuN` per
//! chip (kind `tpu`), labelled with generation, PCI address, device node, HBM
//! in use and size, duty cycle; and a `tpu.core_error` event per new core
//! error message.
//!
//! Verdicts:
//! - A core's `error_message` (GetTpuRuntimeStatus) makes its chip FAILED
//!   with the message as the reason (fault class: transient software; the
//!   workload on that chip has stopped).
//! - No service answering means no workload holds the TPU (libtpu serves it
//!   only inside the training process): not a failure. The chips stay OK with
//!   the label `runtime = "not serving"`. A dead chip shows as missing from
//!   sysfs, which the chip count catches, not as a silent port.
//! - Without chips in sysfs the service is not asked at all (a GPU node
//!   spends nothing on it).
//!
//! The gRPC calls run on a small runtime owned by the source's thread, each
//! bounded by `[tpu] rpc_timeout`, so a wedged libtpu stalls only this source.

pub mod chips;
pub mod config;
pub mod runtime;

pub use config::TpuConfig;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::sources::host_config::HostConfig;
use chips::Chip;
use runtime::RuntimeReading;
use warden_core::device::DeviceId;
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::taxonomy::signals::HealthSignal;

fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
}

/// Judges the chips and what the runtimes said. Pure: `readings` are the
/// runtimes that answered, `silent` the ports that did not.
pub fn judge(
    chips: &[Chip],
    readings: &[RuntimeReading],
    silent: &[u16],
    now: SystemTime,
) -> Vec<ComponentReport> {
    // Devices (cores) in the HBM metrics map onto chips in order.
    let devices: BTreeSet<i64> = readings
        .iter()
        .flat_map(|r| r.hbm_total.keys().chain(r.hbm_used.keys()).copied())
        .collect();
    let cores_per_chip = if chips.is_empty() {
        1
    } else {
        devices.len().div_ceil(chips.len()).max(1)
    } as i64;
    let chip_of = |device: i64| usize::try_from(device / cores_per_chip).unwrap_or(usize::MAX);
    let mut used: BTreeMap<usize, f64> = BTreeMap::new();
    let mut total: BTreeMap<usize, f64> = BTreeMap::new();
    let mut duty: BTreeMap<usize, f64> = BTreeMap::new();
    let mut errors: BTreeMap<usize, Vec<&runtime::CoreError>> = BTreeMap::new();
    let mut ports: BTreeMap<usize, u16> = BTreeMap::new();
    for r in readings {
        for (d, v) in &r.hbm_used {
            *used.entry(chip_of(*d)).or_default() += v;
            ports.entry(chip_of(*d)).or_insert(r.port);
        }
        for (d, v) in &r.hbm_total {
            *total.entry(chip_of(*d)).or_default() += v;
        }
        for (c, v) in &r.duty_cycle {
            if let Ok(c) = usize::try_from(*c) {
                duty.insert(c, *v);
            }
        }
        for e in &r.core_errors {
            let chip = e
                .chip
                .and_then(|c| usize::try_from(c).ok())
                .unwrap_or_else(|| chip_of(i64::from(e.core)));
            errors.entry(chip).or_default().push(e);
        }
    }
    let count = chips.len().max(
        used.keys()
            .chain(errors.keys())
            .map(|c| c + 1)
            .max()
            .unwrap_or(0),
    );
    let serving = !readings.is_empty();
    (0..count)
        .map(|i| {
            let mut labels = BTreeMap::new();
            if let Some(c) = chips.get(i) {
                labels.insert("pci".to_owned(), c.pci.join(","));
                labels.insert("device_id".to_owned(), c.device_id.clone());
                if let Some(g) = c.generation {
                    labels.insert("generation".to_owned(), g.to_owned());
                }
                if let Some(d) = &c.dev {
                    labels.insert("dev".to_owned(), d.clone());
                }
            } else {
                labels.insert("sysfs".to_owned(), "not found".to_owned());
            }
            let runtime = match ports.get(&i) {
                Some(p) => format!("serving on port {p}"),
                None if serving => "serving".to_owned(),
                None => format!("not serving (no workload holds the TPU; asked ports {silent:?})"),
            };
            labels.insert("runtime".to_owned(), runtime);
            if let Some(u) = used.get(&i) {
                labels.insert("hbm_used".to_owned(), gib(*u));
            }
            if let Some(t) = total.get(&i) {
                labels.insert("hbm_total".to_owned(), gib(*t));
                if let Some(u) = used.get(&i).filter(|_| *t > 0.0) {
                    labels.insert(
                        "hbm_used_percent".to_owned(),
                        format!("{:.0}%", u * 100.0 / t),
                    );
                }
            }
            if let Some(d) = duty.get(&i) {
                labels.insert("duty_cycle".to_owned(), format!("{d:.0}%"));
            }
            let reasons = errors
                .get(&i)
                .into_iter()
                .flatten()
                .map(|e| Reason {
                    status: Status::Failed,
                    kind: ReasonKind::Judged,
                    signal: format!("{}.{}", HealthSignal::TpuCoreError.name(), e.core),
                    value: e.message.clone(),
                    threshold: String::new(),
                    window: String::new(),
                    since: now,
                    message: format!("TPU core {} reported an error: {}", e.core, e.message),
                })
                .collect();
            ComponentReport {
                // `i` is below a chip id the runtime gave as an i32, plus one.
                id: DeviceId::Tpu(u32::try_from(i).unwrap_or(u32::MAX)).to_string(),
                kind: "tpu".into(),
                labels,
                status_override: None,
                reasons,
            }
        })
        .collect()
}

/// The TPU source, run by [`super::runner`].
#[derive(Debug)]
pub struct Tpu {
    sysfs_root: PathBuf,
    cfg: TpuConfig,
    ports: Vec<u16>,
    rt: tokio::runtime::Runtime,
    /// Core errors already told as events, so each is told once.
    told: BTreeSet<(u16, i32, String)>,
}

impl Tpu {
    /// Reads chips under `[host] sysfs_root` and the runtime at `[tpu]
    /// ports` plus `TPU_RUNTIME_METRICS_PORTS`. None when `[tpu] enabled`
    /// is false.
    pub fn new(cfg: TpuConfig, host: &HostConfig) -> std::io::Result<Option<Self>> {
        if !cfg.enabled {
            return Ok(None);
        }
        let env = std::env::var("TPU_RUNTIME_METRICS_PORTS").ok();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Some(Self {
            sysfs_root: PathBuf::from(&host.sysfs_root),
            ports: cfg.all_ports(env.as_deref()),
            cfg,
            rt,
            told: BTreeSet::new(),
        }))
    }
}

impl crate::sources::SourceKind for Tpu {
    const NAME: &'static str = "tpu";
    type Config = TpuConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a TpuConfig {
        settings.tpu
    }

    fn validate(cfg: &TpuConfig, origin: &str) -> Result<(), warden_core::config::ConfigError> {
        cfg.validate(origin)
    }

    fn build(
        cfg: &TpuConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        Ok(Self::new(cfg.clone(), settings.host)?
            .map(|s| Box::new(s) as Box<dyn crate::sources::Source>))
    }
}

impl super::Source for Tpu {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.poll_interval
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        let chips = chips::discover(&self.sysfs_root);
        let mut poll = super::Poll::default();
        if chips.is_empty() {
            return poll;
        }
        let timeout = self.cfg.rpc_timeout;
        let mut readings = Vec::new();
        let mut silent = Vec::new();
        for &port in &self.ports {
            let answer = self.rt.block_on(async {
                tokio::time::timeout(timeout * 5, runtime::query(port, timeout)).await
            });
            match answer {
                Ok(Ok(r)) => readings.push(r),
                Ok(Err(e)) => {
                    tracing::debug!(port, error = %e, "TPU runtime metrics: no answer");
                    silent.push(port);
                }
                Err(_) => silent.push(port),
            }
        }
        let mut current = BTreeSet::new();
        for r in &readings {
            for e in &r.core_errors {
                let key = (r.port, e.core, e.message.clone());
                if !self.told.contains(&key) {
                    poll.events.push(
                        NewEvent::new(
                            Severity::Error,
                            HealthSignal::TpuCoreError.name(),
                            DeviceId::tpu_core(e.core),
                            format!("TPU core {} reported an error: {}", e.core, e.message),
                        )
                        .with("core", e.core)
                        .with(
                            "chip",
                            // A negative id names no chip.
                            e.chip
                                .and_then(|c| u32::try_from(c).ok())
                                .map_or("unknown".to_owned(), |c| DeviceId::Tpu(c).to_string()),
                        )
                        .with("port", r.port)
                        .with("error_message", &e.message)
                        .into(),
                    );
                }
                current.insert(key);
            }
        }
        self.told = current;
        poll.reports = judge(&chips, &readings, &silent, now);
        // Name the chip in the event's subject where the report knows it.
        for ev in &mut poll.events {
            let warden_core::signal::Signal::Notice(ev) = ev else {
                continue;
            };
            if let Some((_, chip)) = ev.evidence.iter().find(|(k, _)| k == "chip")
                && chip != "unknown"
            {
                ev.subject = chip.clone();
            }
        }
        poll
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use runtime::CoreError;

    fn chip() -> Chip {
        Chip {
            pci: vec!["0000:00:04.0".into()],
            device_id: "0x0063".into(),
            generation: Some("v5e"),
            hbm_gib: Some(16),
            dev: None,
        }
    }

    #[test]
    fn ports_merge_the_environment() {
        let cfg = TpuConfig::default();
        assert_eq!(cfg.all_ports(Some("8431, 8432,x,0")), vec![8431, 8432]);
        assert_eq!(cfg.all_ports(None), vec![8431]);
    }

    #[test]
    fn silent_runtime_is_not_a_failure() {
        let r = judge(&[chip(), chip()], &[], &[8431], SystemTime::now());
        assert_eq!(r.len(), 2);
        assert!(r.iter().all(|c| c.reasons.is_empty()));
        assert!(r[0].labels["runtime"].starts_with("not serving"));
    }

    #[test]
    fn hbm_and_core_errors_land_on_their_chip() {
        let gib = f64::from(1u32 << 30);
        let reading = RuntimeReading {
            port: 8431,
            hbm_used: BTreeMap::from([(0, 4.0 * gib), (1, 8.0 * gib)]),
            hbm_total: BTreeMap::from([(0, 16.0 * gib), (1, 16.0 * gib)]),
            duty_cycle: BTreeMap::from([(1, 87.0)]),
            core_errors: vec![CoreError {
                core: 1,
                chip: None,
                message: "HBM uncorrectable".into(),
            }],
            status_served: true,
        };
        let r = judge(&[chip(), chip()], &[reading], &[], SystemTime::now());
        assert_eq!(r[0].labels["hbm_used"], "4.0 GiB");
        assert_eq!(r[1].labels["hbm_used_percent"], "50%");
        assert_eq!(r[1].labels["duty_cycle"], "87%");
        assert!(r[0].reasons.is_empty());
        assert_eq!(r[1].reasons[0].status, Status::Failed);
        assert!(r[1].reasons[0].message.contains("HBM uncorrectable"));
    }
}
