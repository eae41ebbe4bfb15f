//! Why a rank is slow: its devices' health reasons and the host's CPU
//! contention, matched to the flag as one sentence and a cause class.
//!
//! Pure: the caller passes the health model's components (a snapshot) and
//! the CPU facts it read; nothing here reads a file or a clock.
//!
//! The cause classes are the attribution engine's names: a GPU that reports
//! a reason that slows it (clock-event reasons, temperature, power, a PCIe
//! link below its maximum or replaying, NVLink errors) is
//! `correctable_hardware`; a host that keeps the rank waiting for a CPU is
//! `infrastructure`; anything else is `unknown`.

use crate::device::DeviceId;
use crate::health::{Component, Status};
use crate::taxonomy::signals::HealthSignal;

/// What explains a flagged rank, from the most specific evidence found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CauseClass {
    /// A GPU the rank drives reports a reason that slows it.
    CorrectableHardware,
    /// The host keeps the rank waiting for a CPU.
    Infrastructure,
    /// No reason found.
    Unknown,
}

impl CauseClass {
    /// The name the attribution engine and the API use.
    pub fn as_str(self) -> &'static str {
        match self {
            CauseClass::CorrectableHardware => "correctable_hardware",
            CauseClass::Infrastructure => "infrastructure",
            CauseClass::Unknown => "unknown",
        }
    }
}

/// Host CPU facts about the rank's process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuFacts {
    /// Share of wall time the rank's main thread was runnable but waiting
    /// for a CPU, over the last window (schedstat run_delay); None: unknown.
    pub wait_share: Option<f64>,
    /// 1-minute load average.
    pub load: Option<f64>,
    /// CPUs the agent may run on (for scale).
    pub cores: usize,
}

/// The sentence, its class and the facts behind it.
#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    /// One sentence: "rank 19 is 12% slower in forward; gpu3 reports HW
    /// thermal slowdown (clocks.event_reasons)".
    pub sentence: String,
    /// The cause class.
    pub cause_class: CauseClass,
    /// Evidence pairs for the event (gpu temperature and power, CPU wait).
    pub facts: Vec<(String, String)>,
}

/// Maps the devices a rank declared to health component ids (`gpuN`): a
/// component id as is, `cuda:N` or a bare index as `gpuN`, a UUID or PCI
/// bus id through the GPU components' `uuid` / `pci` labels. Nothing
/// declared: `gpu<local_rank>` (torchrun's convention). A device no
/// component knows is kept as declared.
pub fn resolve_devices(
    declared: &[String],
    local_rank: u32,
    components: &[Component],
) -> Vec<String> {
    if declared.is_empty() {
        return vec![DeviceId::Gpu(local_rank).to_string()];
    }
    declared
        .iter()
        .map(|d| {
            let d = d.trim();
            if components.iter().any(|c| c.id == d) {
                return d.to_owned();
            }
            if let Some(i) = DeviceId::gpu_index(d.strip_prefix("cuda:").unwrap_or(d)) {
                return DeviceId::Gpu(i).to_string();
            }
            let pci = normalize_pci(d);
            components
                .iter()
                .filter(|c| c.kind == "gpu" && !c.id.contains('/'))
                .find(|c| {
                    c.labels
                        .get("uuid")
                        .is_some_and(|u| u.eq_ignore_ascii_case(d))
                        || (pci.is_some()
                            && c.labels.get("pci").and_then(|p| normalize_pci(p)) == pci)
                })
                .map_or_else(|| d.to_owned(), |c| c.id.clone())
        })
        .collect()
}

/// `bus:device.function` in lower case, whatever the domain's width
/// ("0000:3b:00.0", "00000000:3B:00.0" and "3b:00.0" are one address).
fn normalize_pci(s: &str) -> Option<String> {
    let parts: Vec<&str> = s.split(':').collect();
    let (bus, devfn) = match parts.as_slice() {
        [_, bus, devfn] | [bus, devfn] => (*bus, *devfn),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.').unwrap_or((devfn, "0"));
    let hex = |x: &str| u32::from_str_radix(x, 16).ok();
    Some(format!(
        "{:02x}:{:02x}.{:x}",
        hex(bus)?,
        hex(dev)?,
        hex(func)?
    ))
}

/// NVML's clock-event reason bits that slow a GPU, by name.
fn clock_event_names(bits: u64) -> String {
    let names: Vec<&str> = [
        (0x8, "HW slowdown"),
        (0x20, "SW thermal slowdown"),
        (0x40, "HW thermal slowdown"),
        (0x80, "HW power brake slowdown"),
    ]
    .into_iter()
    .filter(|(b, _)| bits & b != 0)
    .map(|(_, n)| n)
    .collect();
    names.join(", ")
}

/// What one reason says, as a phrase.
fn phrase(gpu: &str, signal: &str, value: &str, message: &str) -> String {
    if matches!(
        HealthSignal::of(signal),
        HealthSignal::ClockEventReasons | HealthSignal::ClockOther
    ) {
        let decoded = value
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .map(clock_event_names)
            .filter(|n| !n.is_empty());
        let what = decoded.unwrap_or_else(|| value.to_owned());
        return format!("{gpu} reports {what} ({signal})");
    }
    format!("{gpu} reports {message} ({signal})")
}

/// Explains rank `rank`, `relative` x the job's median in `section`, from
/// the reasons of its `devices` (component ids) and the host's CPU facts.
/// `cpu_wait_share` is the share of wall time waiting for a CPU from which
/// contention explains it.
pub fn explain(
    rank: u32,
    section: &str,
    relative: f64,
    devices: &[String],
    components: &[Component],
    cpu: &CpuFacts,
    cpu_wait_share: f64,
) -> Explanation {
    let pct = ((relative - 1.0) * 100.0).round();
    let mut sentence = format!("rank {rank} is {pct:.0}% slower in {section}");
    let mut facts = Vec::new();
    let mut gpu_findings = Vec::new();
    for dev in devices {
        let prefix = format!("{dev}/");
        for c in components
            .iter()
            .filter(|c| c.id == *dev || c.id.starts_with(&prefix))
        {
            if c.id == *dev {
                for (label, key) in [("temperature", "gpu_temperature"), ("power", "gpu_power")] {
                    if let Some(v) = c.labels.get(label) {
                        facts.push((key.to_owned(), format!("{dev} {v}")));
                    }
                }
            }
            for r in &c.reasons {
                if r.status == Status::Ok || !HealthSignal::of(&r.signal).slows_gpu() {
                    continue;
                }
                gpu_findings.push(phrase(&c.id, &r.signal, &r.value, &r.message));
            }
        }
    }
    let contended = cpu.wait_share.filter(|w| *w >= cpu_wait_share);
    if let Some(w) = cpu.wait_share {
        facts.push(("cpu_wait_share".to_owned(), format!("{w:.2}")));
    }
    if let Some(l) = cpu.load {
        facts.push((
            "host_load".to_owned(),
            format!("{l:.1} on {} cores", cpu.cores),
        ));
    }
    let cause_class = if !gpu_findings.is_empty() {
        CauseClass::CorrectableHardware
    } else if contended.is_some() {
        CauseClass::Infrastructure
    } else {
        CauseClass::Unknown
    };
    for f in &gpu_findings {
        sentence.push_str("; ");
        sentence.push_str(f);
    }
    if let Some(w) = contended {
        sentence.push_str(&format!(
            "; host CPU contention: it waited for a CPU {:.0}% of the time",
            w * 100.0
        ));
        if let Some(l) = cpu.load {
            sentence.push_str(&format!(" (load {l:.1} on {} cores)", cpu.cores));
        }
    }
    if cause_class == CauseClass::Unknown {
        sentence.push_str(&format!(
            "; no GPU reason on {} and no host CPU contention found",
            if devices.is_empty() {
                "its devices".to_owned()
            } else {
                devices.join(", ")
            }
        ));
    }
    Explanation {
        sentence,
        cause_class,
        facts,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::SystemTime;

    use super::*;
    use crate::health::Reason;

    fn gpu(id: &str, labels: &[(&str, &str)], reasons: &[(&str, &str, &str)]) -> Component {
        Component {
            id: id.into(),
            kind: "gpu".into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            status: if reasons.is_empty() {
                Status::Ok
            } else {
                Status::Degraded
            },
            since: SystemTime::UNIX_EPOCH,
            reasons: reasons
                .iter()
                .map(|(signal, value, message)| Reason {
                    status: Status::Degraded,
                    kind: crate::health::ReasonKind::Judged,
                    signal: (*signal).into(),
                    value: (*value).into(),
                    threshold: String::new(),
                    window: String::new(),
                    since: SystemTime::UNIX_EPOCH,
                    message: (*message).into(),
                })
                .collect(),
        }
    }

    fn node() -> Vec<Component> {
        vec![
            gpu(
                "gpu3",
                &[
                    ("uuid", "GPU-abc"),
                    ("pci", "00000000:3B:00.0"),
                    ("temperature", "91 C"),
                    ("power", "301.5 W"),
                ],
                &[(
                    "clocks.event_reasons",
                    "0x40",
                    "clocks held down by the hardware (HW thermal)",
                )],
            ),
            gpu(
                "gpu3/pcie",
                &[],
                &[(
                    "pcie.link_width",
                    "8",
                    "PCIe link width 8 below its maximum 16",
                )],
            ),
            gpu(
                "gpu4",
                &[("uuid", "GPU-def")],
                &[("gpu.xid", "13", "XID 13")],
            ),
        ]
    }

    #[test]
    fn devices_resolve_by_id_index_uuid_and_pci() {
        let c = node();
        let got = resolve_devices(
            &[
                "gpu3".into(),
                "cuda:5".into(),
                "GPU-DEF".into(),
                "0000:3b:00.0".into(),
                "tpu0".into(),
            ],
            0,
            &c,
        );
        assert_eq!(got, ["gpu3", "gpu5", "gpu4", "gpu3", "tpu0"]);
        assert_eq!(resolve_devices(&[], 2, &c), ["gpu2"]);
    }

    #[test]
    fn a_thermal_gpu_is_correctable_hardware() {
        let e = explain(
            19,
            "forward",
            1.12,
            &["gpu3".into()],
            &node(),
            &CpuFacts::default(),
            0.1,
        );
        assert_eq!(e.cause_class, CauseClass::CorrectableHardware);
        assert_eq!(
            e.sentence,
            "rank 19 is 12% slower in forward; gpu3 reports HW thermal slowdown (clocks.event_reasons); \
             gpu3/pcie reports PCIe link width 8 below its maximum 16 (pcie.link_width)"
        );
        assert!(
            e.facts
                .contains(&("gpu_temperature".into(), "gpu3 91 C".into()))
        );
    }

    #[test]
    fn cpu_contention_is_infrastructure_and_unrelated_reasons_do_not_count() {
        let cpu = CpuFacts {
            wait_share: Some(0.25),
            load: Some(40.0),
            cores: 16,
        };
        let e = explain(2, "backward", 1.3, &["gpu4".into()], &node(), &cpu, 0.1);
        assert_eq!(
            e.cause_class,
            CauseClass::Infrastructure,
            "an XID 13 slows nothing"
        );
        assert!(
            e.sentence
                .ends_with("waited for a CPU 25% of the time (load 40.0 on 16 cores)"),
            "{}",
            e.sentence
        );
        let calm = CpuFacts {
            wait_share: Some(0.01),
            ..cpu
        };
        let e = explain(2, "backward", 1.3, &["gpu4".into()], &node(), &calm, 0.1);
        assert_eq!(e.cause_class, CauseClass::Unknown);
        assert!(
            e.sentence.contains("no GPU reason on gpu4"),
            "{}",
            e.sentence
        );
    }

    #[test]
    fn simulated_clock_values_read_as_they_are() {
        let c = vec![gpu(
            "gpu1",
            &[],
            &[(
                "clocks.thermal",
                "HW thermal slowdown (0x40)",
                "clocks held down",
            )],
        )];
        let e = explain(
            1,
            "forward",
            1.3,
            &["gpu1".into()],
            &c,
            &CpuFacts::default(),
            0.1,
        );
        assert!(
            e.sentence
                .ends_with("gpu1 reports HW thermal slowdown (0x40) (clocks.thermal)"),
            "{}",
            e.sentence
        );
    }
}
