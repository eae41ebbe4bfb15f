//! The simulated node: GPUs, NVLinks and TPU chips scripted by a scenario.
//!
//! In: a scenario TOML (`wardend --simulate FILE`, examples under
//! `examples/scenarios/`) listing devices and faults at times. Out: reports
//! on `gpuN`, `gpuN/nvlinkL` and `tpuN` and events (`gpu.xid`, `gpu.ecc`,
//! `gpu.nvlink_down`, `gpu.thermal_throttle`, `tpu.core_error`,
//! `sim.recovered`), exactly as a real source would, so the whole agent runs,
//! demos and is tested without hardware. Never: touch real devices.
//!
//! Scenario time is wall time since the first poll times `speed`, so a test
//! plays a 30 s scenario in 3 s at speed 10. The state at a scenario time is
//! a pure function of the script ([`SimScenario::state_at`]).

pub mod config;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};
use warden_core::device::DeviceId;
use warden_core::taxonomy::signals::HealthSignal;

use serde::Deserialize;

use crate::sources::kmsg::xid_verdict;
use warden_core::config::ConfigError;
use warden_core::events::{NewEvent, Severity};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};
use warden_core::signal::{Report, Signal, Xid, XidSource};

pub use config::SimulatedConfig;

/// Why a scenario could not be used; every variant names the key.
#[derive(Debug, thiserror::Error)]
pub enum SimScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Not TOML, an unknown key, or a wrong type.
    #[error("{origin}: key `{key}`: {message}")]
    Parse {
        /// The file.
        origin: String,
        /// Dotted path of the key.
        key: String,
        /// The parser's words.
        message: String,
    },
    /// A value that parses but makes no sense.
    #[error("{origin}: key `{key}`: {why}")]
    Invalid {
        /// The file.
        origin: String,
        /// Dotted path of the key.
        key: String,
        /// What is wrong and what is accepted.
        why: String,
    },
}

/// A scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimScenario {
    /// A sentence saying what the scenario shows.
    #[serde(default)]
    pub description: String,
    /// Scenario seconds per wall second (`--simulate-speed` overrides it).
    #[serde(default = "one")]
    pub speed: f64,
    /// Groups of GPUs, numbered in order from gpu0.
    #[serde(default)]
    pub gpu: Vec<GpuGroup>,
    /// Groups of TPU chips, numbered in order from tpu0.
    #[serde(default)]
    pub tpu: Vec<TpuGroup>,
    /// Scripted faults, in any order.
    #[serde(default)]
    pub fault: Vec<Fault>,
}

fn one() -> f64 {
    1.0
}

/// `[[gpu]]`: identical GPUs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuGroup {
    /// How many.
    #[serde(default = "one_u32")]
    pub count: u32,
    /// Product name shown as a label.
    #[serde(default = "gpu_name")]
    pub name: String,
    /// NVLinks per GPU reported as `gpuN/nvlinkL` (0: none).
    #[serde(default)]
    pub nvlinks: u32,
}

fn one_u32() -> u32 {
    1
}

fn gpu_name() -> String {
    "Simulated GPU".into()
}

/// `[[tpu]]`: identical TPU chips.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TpuGroup {
    /// How many.
    #[serde(default = "one_u32")]
    pub count: u32,
    /// Generation shown as a label (`v5e`).
    #[serde(default)]
    pub name: String,
}

/// The kinds of scripted fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// An XID on `gpu` (`xid`), judged by the kernel-log XID table.
    Xid,
    /// ECC counts on `gpu` climbing at `corrected_per_min` and
    /// `uncorrected_per_min` (for `duration`, or until recovered).
    Ecc,
    /// NVLink `link` of `gpu` down.
    NvlinkDown,
    /// `gpu` clocks held down by thermal slowdown for `duration`.
    Thermal,
    /// A TPU runtime core error on `chip` with `message`.
    TpuError,
    /// Clears every fault on `gpu` or `chip` (or everything when neither).
    Recover,
}

/// `[[fault]]`: one scripted fault.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// When, from the start: "30s", "2m".
    #[serde(with = "warden_core::config::duration")]
    pub at: Duration,
    /// What.
    pub kind: FaultKind,
    /// The GPU index (xid, ecc, nvlink_down, thermal, recover).
    pub gpu: Option<u32>,
    /// The TPU chip index (tpu_error, recover).
    pub chip: Option<u32>,
    /// The XID number (xid).
    pub xid: Option<u32>,
    /// The NVLink index (nvlink_down).
    pub link: Option<u32>,
    /// How long it lasts (thermal; optional for ecc); absent: until recovered.
    #[serde(default, with = "opt_duration")]
    pub duration: Option<Duration>,
    /// Corrected ECC errors per minute (ecc).
    #[serde(default)]
    pub corrected_per_min: f64,
    /// Uncorrected ECC errors per minute (ecc).
    #[serde(default)]
    pub uncorrected_per_min: f64,
    /// Text of the fault (xid, tpu_error).
    #[serde(default)]
    pub message: String,
}

mod opt_duration {
    use std::time::Duration;

    use serde::Deserializer;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        warden_core::config::duration::deserialize(d).map(Some)
    }
}

/// Corrected ECC errors per minute above which a GPU is DEGRADED.
const CORRECTED_PER_MIN_DEGRADED: u64 = 10;
/// The window ECC counts are judged over, as DCGM does.
const ECC_WINDOW: Duration = Duration::from_secs(60);

impl SimScenario {
    /// Reads and checks a scenario file.
    pub fn from_file(path: &Path) -> Result<Self, SimScenarioError> {
        let text =
            warden_core::named_file::read_to_string(path, warden_core::named_file::CONFIG_CAP)
                .map_err(|source| SimScenarioError::Read {
                    path: path.display().to_string(),
                    source,
                })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses and checks scenario text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, SimScenarioError> {
        let s: SimScenario = warden_core::config::parse_toml(text).map_err(|(key, message)| {
            SimScenarioError::Parse {
                origin: origin.to_owned(),
                key,
                message,
            }
        })?;
        s.validate(origin)?;
        Ok(s)
    }

    fn gpus(&self) -> u32 {
        self.gpu.iter().map(|g| g.count).sum()
    }

    fn chips(&self) -> u32 {
        self.tpu.iter().map(|g| g.count).sum()
    }

    fn validate(&self, origin: &str) -> Result<(), SimScenarioError> {
        let invalid = |key: String, why: String| SimScenarioError::Invalid {
            origin: origin.to_owned(),
            key,
            why,
        };
        if !(self.speed > 0.0 && self.speed <= 10_000.0) {
            return Err(invalid(
                "speed".into(),
                format!("{} must be in (0, 10000]", self.speed),
            ));
        }
        let (gpus, chips) = (self.gpus(), self.chips());
        for (i, f) in self.fault.iter().enumerate() {
            let key = |k: &str| format!("fault[{i}].{k}");
            let need_gpu = || match f.gpu {
                Some(g) if g < gpus => Ok(g),
                Some(g) => Err(invalid(
                    key("gpu"),
                    format!("gpu {g} does not exist ({gpus} GPUs)"),
                )),
                None => Err(invalid(
                    key("gpu"),
                    format!("a {:?} fault needs `gpu`", f.kind),
                )),
            };
            match f.kind {
                FaultKind::Xid => {
                    need_gpu()?;
                    if f.xid.is_none() {
                        return Err(invalid(key("xid"), "an xid fault needs `xid`".into()));
                    }
                }
                FaultKind::Ecc => {
                    need_gpu()?;
                    if f.corrected_per_min < 0.0 || f.uncorrected_per_min < 0.0 {
                        return Err(invalid(
                            key("corrected_per_min"),
                            "rates must not be negative".into(),
                        ));
                    }
                }
                FaultKind::NvlinkDown => {
                    let g = need_gpu()?;
                    let links = self.nvlinks_of(g);
                    match f.link {
                        Some(l) if l < links => {}
                        _ => {
                            return Err(invalid(
                                key("link"),
                                format!("needs `link` below gpu {g}'s nvlinks ({links})"),
                            ));
                        }
                    }
                }
                FaultKind::Thermal => {
                    need_gpu()?;
                }
                FaultKind::TpuError => match f.chip {
                    Some(c) if c < chips => {}
                    _ => return Err(invalid(key("chip"), format!("needs `chip` below {chips}"))),
                },
                FaultKind::Recover => {
                    if let Some(g) = f.gpu {
                        need_gpu().map(|_| g)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn nvlinks_of(&self, gpu: u32) -> u32 {
        let mut first = 0;
        for g in &self.gpu {
            if gpu < first + g.count {
                return g.nvlinks;
            }
            first += g.count;
        }
        0
    }

    fn gpu_group(&self, gpu: u32) -> Option<&GpuGroup> {
        let mut first = 0;
        for g in &self.gpu {
            if gpu < first + g.count {
                return Some(g);
            }
            first += g.count;
        }
        None
    }

    /// The faults active at scenario time `t`: a fault applies from its
    /// `at` until its duration ends or a later `recover` covers it.
    fn active_at(&self, t: Duration) -> Vec<(usize, &Fault)> {
        let recovered = |i: usize, f: &Fault| {
            self.fault.iter().any(|r| {
                r.kind == FaultKind::Recover
                    && r.at >= f.at
                    && r.at <= t
                    && !std::ptr::eq(r, &self.fault[i])
                    && match (r.gpu, r.chip) {
                        (None, None) => true,
                        (Some(g), _) => f.gpu == Some(g),
                        (_, Some(c)) => f.chip == Some(c),
                    }
            })
        };
        self.fault
            .iter()
            .enumerate()
            .filter(|(i, f)| {
                f.kind != FaultKind::Recover
                    && f.at <= t
                    && f.duration.is_none_or(|d| t < f.at + d)
                    && !recovered(*i, f)
            })
            .collect()
    }

    /// Reports for every device at scenario time `t`, stamped `now`.
    pub fn state_at(&self, t: Duration, now: SystemTime) -> Vec<ComponentReport> {
        let active = self.active_at(t);
        let mut gpus: BTreeMap<u32, ComponentReport> = BTreeMap::new();
        let mut links: BTreeMap<(u32, u32), ComponentReport> = BTreeMap::new();
        let report = |id: String, kind: &str, labels: &[(&str, String)]| ComponentReport {
            id,
            kind: kind.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            status_override: None,
            reasons: Vec::new(),
        };
        for i in 0..self.gpus() {
            let name = self.gpu_group(i).map_or_else(gpu_name, |g| g.name.clone());
            gpus.insert(
                i,
                report(
                    DeviceId::Gpu(i).to_string(),
                    "gpu",
                    &[("name", name), ("simulated", "true".into())],
                ),
            );
            for l in 0..self.nvlinks_of(i) {
                links.insert((i, l), report(DeviceId::gpu_link(i, l), "nvlink", &[]));
            }
        }
        let mut chips: Vec<ComponentReport> = Vec::new();
        let mut idx = 0;
        for g in &self.tpu {
            for _ in 0..g.count {
                chips.push(report(
                    DeviceId::Tpu(idx).to_string(),
                    "tpu",
                    &[("name", g.name.clone()), ("simulated", "true".into())],
                ));
                idx += 1;
            }
        }
        let reason = |status,
                      signal: String,
                      value: String,
                      threshold: &str,
                      window: &str,
                      since: Duration,
                      message: String| Reason {
            status,
            kind: ReasonKind::Judged,
            signal,
            value,
            threshold: threshold.into(),
            window: window.into(),
            since: now.checked_sub(t.saturating_sub(since)).unwrap_or(now),
            message,
        };
        for (_, f) in active {
            let gpu = f.gpu.and_then(|g| gpus.get_mut(&g));
            match (f.kind, gpu) {
                (FaultKind::Xid, Some(r)) => {
                    let xid = f.xid.unwrap_or_default();
                    let (status, class) = xid_verdict(xid);
                    r.reasons.push(
                        reason(
                            status,
                            "gpu.xid".into(),
                            xid.to_string(),
                            "any",
                            "",
                            f.at,
                            format!("XID {xid} ({class}): {}", xid_text(f)),
                        )
                        .of_kind(ReasonKind::Xid),
                    );
                }
                (FaultKind::Ecc, Some(r)) => {
                    // Counts over the last window, from the scripted rates.
                    let window = t.min(ECC_WINDOW).min(t.saturating_sub(f.at));
                    let per = |rate: f64| (rate * window.as_secs_f64() / 60.0).floor() as u64;
                    let (corr, unc) = (per(f.corrected_per_min), per(f.uncorrected_per_min));
                    if unc > 0 {
                        r.reasons.push(reason(
                            Status::Failed,
                            HealthSignal::EccUncorrected.name().into(),
                            unc.to_string(),
                            "> 0",
                            "1m",
                            f.at,
                            format!("{unc} uncorrected (double-bit) ECC errors in the last minute"),
                        ));
                    }
                    if corr > CORRECTED_PER_MIN_DEGRADED {
                        r.reasons.push(reason(
                            Status::Degraded,
                            HealthSignal::EccCorrected.name().into(),
                            corr.to_string(),
                            &format!("> {CORRECTED_PER_MIN_DEGRADED}"),
                            "1m",
                            f.at,
                            format!(
                                "{corr} corrected ECC errors in the last minute: memory degrading"
                            ),
                        ));
                    }
                }
                (FaultKind::Thermal, Some(r)) => r.reasons.push(reason(
                    Status::Degraded,
                    // As NVML's source says it: the clock event reason
                    // bits, 0x40 being HW thermal slowdown.
                    HealthSignal::ClockEventReasons.name().into(),
                    "0x40".into(),
                    "none",
                    "",
                    f.at,
                    "clocks held down by thermal slowdown".into(),
                )),
                (FaultKind::NvlinkDown, _) => {
                    let (g, l) = (f.gpu.unwrap_or_default(), f.link.unwrap_or_default());
                    if let Some(r) = links.get_mut(&(g, l)) {
                        r.reasons.push(reason(
                            Status::Failed,
                            HealthSignal::NvlinkState.name().into(),
                            "down".into(),
                            "up",
                            "",
                            f.at,
                            format!("NVLink {l} of gpu{g} is down"),
                        ));
                    }
                }
                (FaultKind::TpuError, _) => {
                    if let Some(r) = f.chip.and_then(|c| chips.get_mut(c as usize)) {
                        r.reasons.push(reason(
                            Status::Degraded,
                            HealthSignal::TpuCoreError.name().into(),
                            f.message.clone(),
                            "none",
                            "",
                            f.at,
                            format!("TPU runtime core error: {}", f.message),
                        ));
                    }
                }
                _ => {}
            }
        }
        gpus.into_values()
            .chain(links.into_values())
            .chain(chips)
            .collect()
    }

    /// Events for faults whose `at` lies in `(from, to]`.
    pub fn events_between(&self, from: Option<Duration>, to: Duration) -> Vec<Signal> {
        let mut faults: Vec<&Fault> = self
            .fault
            .iter()
            .filter(|f| from.is_none_or(|from| f.at > from) && f.at <= to)
            .collect();
        faults.sort_by_key(|f| f.at);
        faults.into_iter().map(event_of).collect()
    }
}

fn xid_text(f: &Fault) -> String {
    if !f.message.is_empty() {
        return f.message.clone();
    }
    match f.xid {
        Some(79) => "GPU has fallen off the bus.".into(),
        Some(48) => "An uncorrectable double bit error (DBE) has been detected.".into(),
        _ => "simulated".into(),
    }
}

fn event_of(f: &Fault) -> Signal {
    let gpu = f.gpu.map(|g| DeviceId::Gpu(g).to_string());
    let at = humantime::format_duration(f.at).to_string();
    let e = match f.kind {
        FaultKind::Xid => {
            let xid = f.xid.unwrap_or_default();
            let (status, class) = xid_verdict(xid);
            let severity = if status == Status::Failed {
                Severity::Critical
            } else {
                Severity::Warning
            };
            let component = gpu.unwrap_or_default();
            return Signal::Xid(Xid {
                source: XidSource::Nvml,
                severity,
                report: Report::new(format!("{component}: XID {xid} ({class}): {}", xid_text(f)))
                    .with("xid", xid)
                    .with("class", class)
                    .with("status", status)
                    .with("simulated", "true")
                    .with("scenario_time", at),
                component,
                xid: u64::from(xid),
                pid: None,
            });
        }
        FaultKind::Ecc => NewEvent::new(
            Severity::Warning,
            "gpu.ecc",
            gpu.unwrap_or_default(),
            "ECC error counts are climbing",
        )
        .with("corrected_per_min", f.corrected_per_min)
        .with("uncorrected_per_min", f.uncorrected_per_min),
        FaultKind::NvlinkDown => {
            let subject = format!(
                "{}/nvlink{}",
                gpu.unwrap_or_default(),
                f.link.unwrap_or_default()
            );
            NewEvent::new(
                Severity::Error,
                "gpu.nvlink_down",
                subject.clone(),
                format!("{subject} is down"),
            )
        }
        FaultKind::Thermal => NewEvent::new(
            Severity::Warning,
            "gpu.thermal_throttle",
            gpu.unwrap_or_default(),
            "clocks held down by thermal slowdown",
        ),
        FaultKind::TpuError => {
            let subject = DeviceId::Tpu(f.chip.unwrap_or_default()).to_string();
            NewEvent::new(
                Severity::Error,
                HealthSignal::TpuCoreError.name(),
                subject.clone(),
                format!("{subject}: TPU runtime core error: {}", f.message),
            )
            .with("error_message", &f.message)
        }
        FaultKind::Recover => {
            let subject = gpu
                .or_else(|| f.chip.map(|c| DeviceId::Tpu(c).to_string()))
                .unwrap_or_else(|| "node".into());
            NewEvent::new(
                Severity::Info,
                "sim.recovered",
                subject.clone(),
                format!("{subject}: scripted recovery"),
            )
        }
    };
    Signal::Notice(e.with("simulated", "true").with("scenario_time", at))
}

/// The simulated source, run by [`super::runner`].
#[derive(Debug)]
pub struct Simulated {
    scenario: SimScenario,
    speed: f64,
    started: Option<SystemTime>,
    last: Option<Duration>,
}

impl Simulated {
    /// Plays `scenario` at `speed` (None: the scenario's own).
    pub fn new(scenario: SimScenario, speed: Option<f64>) -> Self {
        let speed = speed.unwrap_or(scenario.speed);
        Self {
            scenario,
            speed,
            started: None,
            last: None,
        }
    }
}

impl crate::sources::SourceKind for Simulated {
    const NAME: &'static str = "simulated";
    type Config = SimulatedConfig;

    fn config<'a>(settings: &crate::sources::settings::Settings<'a>) -> &'a SimulatedConfig {
        settings.simulated
    }

    fn validate(cfg: &SimulatedConfig, origin: &str) -> Result<(), ConfigError> {
        cfg.validate(origin)
    }

    /// The scenario is read again here: the file checked at validation may
    /// have changed since; a bad one stops the start, naming it.
    fn build(
        cfg: &SimulatedConfig,
        settings: &crate::sources::settings::Settings<'_>,
    ) -> std::io::Result<Option<Box<dyn crate::sources::Source>>> {
        let _ = settings;
        let scenario = cfg.load().map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("simulated.scenario: {e}"),
            )
        })?;
        Ok(scenario.map(|s| Box::new(Self::new(s, cfg.speed)) as Box<dyn crate::sources::Source>))
    }
}

impl super::Source for Simulated {
    fn name(&self) -> &'static str {
        <Self as crate::sources::SourceKind>::NAME
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(100)
    }

    fn poll(&mut self, now: SystemTime) -> super::Poll {
        let started = *self.started.get_or_insert(now);
        let wall = now.duration_since(started).unwrap_or_default();
        let t = wall.mul_f64(self.speed);
        let events = self.scenario.events_between(self.last, t);
        self.last = Some(t);
        super::Poll {
            reports: self.scenario.state_at(t, now),
            events,
        }
    }
}

#[cfg(test)]
mod tests;
