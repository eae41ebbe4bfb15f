//! Judging GPU readings: pure functions from a reading (and the windows
//! kept between polls) to component reports. No NVML in here, so a table of
//! cases tests every verdict.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};
use warden_core::device::DeviceId;
use warden_core::taxonomy::signals::HealthSignal;

use super::NvmlConfig;
use warden_core::health::window::{CounterWindow, Debounce};
use warden_core::health::{ComponentReport, Reason, ReasonKind, Status};

/// Clock event (throttle) reasons that mean the hardware is protecting
/// itself: HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, power brake 0x80.
pub const BAD_CLOCK_EVENTS: u64 = 0x8 | 0x20 | 0x40 | 0x80;

/// Row remapping state (`nvmlDeviceGetRemappedRows`, Ampere and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemappedRows {
    /// Rows remapped for correctable errors.
    pub corrected: u32,
    /// Rows remapped for uncorrectable errors.
    pub uncorrected: u32,
    /// A remap waits for the next GPU reset.
    pub pending: bool,
    /// A remap failed: the GPU has run out of spare rows.
    pub failure: bool,
}

/// One NVLink's reading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvLinkReading {
    /// Link number.
    pub link: u32,
    /// The link is up.
    pub active: bool,
    /// DL replay errors (lifetime counter).
    pub replay: Option<u64>,
    /// DL recovery errors (lifetime counter).
    pub recovery: Option<u64>,
    /// CRC flit + CRC data errors (lifetime counters).
    pub crc: Option<u64>,
}

/// Everything read from one GPU in one poll. `None`: not supported by this
/// GPU or driver (not a finding).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuReading {
    /// NVML index.
    pub index: u32,
    /// uuid, pci, name, where read.
    pub labels: BTreeMap<String, String>,
    /// GPU_IS_LOST / RESET_REQUIRED from any call: which call and what it said.
    pub lost: Option<String>,
    /// Volatile (since driver load) corrected ECC errors.
    pub ecc_corrected_volatile: Option<u64>,
    /// Volatile uncorrected ECC errors.
    pub ecc_uncorrected_volatile: Option<u64>,
    /// Lifetime uncorrected ECC errors (a label, not a verdict).
    pub ecc_uncorrected_aggregate: Option<u64>,
    /// Retired pages (both causes).
    pub retired_pages: Option<u64>,
    /// A page retirement waits for the next reset.
    pub retired_pending: Option<bool>,
    /// Row remapping.
    pub remapped: Option<RemappedRows>,
    /// PCIe replay counter (lifetime).
    pub pcie_replays: Option<u64>,
    /// PCIe link generation (current, max).
    pub pcie_gen: Option<(u32, u32)>,
    /// PCIe link width (current, max).
    pub pcie_width: Option<(u32, u32)>,
    /// Clock event reasons bitmask.
    pub clock_events: Option<u64>,
    /// Temperature, Celsius.
    pub temperature: Option<u32>,
    /// Power draw, milliwatts.
    pub power_mw: Option<u32>,
    /// NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (r570+).
    pub recovery_action: Option<u64>,
    /// NVLinks.
    pub links: Vec<NvLinkReading>,
    /// NVML calls that answered NOT_SUPPORTED (or another error short of a
    /// lost GPU): what this GPU is judged without, shown as its `unread`
    /// label.
    pub unread: Vec<String>,
}

/// An XID delivered by the event thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidEvent {
    /// GPU index.
    pub gpu: u32,
    /// XID code.
    pub xid: u64,
    /// PCI bus id of the GPU, where known.
    pub pci: String,
}

/// What an XID says about the GPU: the one table in [`warden_core::taxonomy::xid`].
pub fn xid_status(xid: u64) -> Status {
    u32::try_from(xid).map_or(Status::Degraded, |x| {
        warden_core::taxonomy::xid::rule(x).status
    })
}

/// The windows one GPU keeps between polls.
#[derive(Debug, Clone)]
pub struct GpuState {
    ecc_corrected: CounterWindow,
    ecc_uncorrected: CounterWindow,
    pcie_replays: CounterWindow,
    links: BTreeMap<u32, [CounterWindow; 3]>,
    clock_events: Debounce,
    xids: VecDeque<(Instant, SystemTime, XidEvent)>,
}

impl GpuState {
    /// Empty windows of `cfg.window`.
    pub fn new(cfg: &NvmlConfig) -> Self {
        Self {
            ecc_corrected: CounterWindow::new(cfg.window),
            ecc_uncorrected: CounterWindow::new(cfg.window),
            pcie_replays: CounterWindow::new(cfg.window),
            links: BTreeMap::new(),
            clock_events: Debounce::new(2, 2),
            xids: VecDeque::new(),
        }
    }

    /// Remembers an XID for `xid_window`.
    pub fn note_xid(&mut self, mono: Instant, now: SystemTime, xid: XidEvent) {
        self.xids.push_back((mono, now, xid));
    }
}

fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn reason(
    status: Status,
    signal: &str,
    value: impl ToString,
    threshold: impl ToString,
    window: &str,
    now: SystemTime,
    message: String,
) -> Reason {
    Reason {
        status,
        kind: ReasonKind::Judged,
        signal: signal.into(),
        value: value.to_string(),
        threshold: threshold.to_string(),
        window: window.into(),
        since: now,
        message,
    }
}

fn report(id: String, labels: BTreeMap<String, String>) -> ComponentReport {
    ComponentReport {
        id,
        kind: "gpu".into(),
        labels,
        status_override: None,
        reasons: Vec::new(),
    }
}

/// Judges one GPU's reading: its `gpuN` component, `gpuN/pcie` and one
/// `gpuN/nvlinkL` per link.
pub fn judge_gpu(
    r: &GpuReading,
    st: &mut GpuState,
    cfg: &NvmlConfig,
    mono: Instant,
    now: SystemTime,
) -> Vec<ComponentReport> {
    let id = DeviceId::Gpu(r.index).to_string();
    let win = show(cfg.window);
    let mut labels = r.labels.clone();
    let mut gpu = report(id.clone(), BTreeMap::new());
    let mut out = Vec::new();

    if let Some(why) = &r.lost {
        gpu.reasons.push(reason(
            Status::Failed,
            HealthSignal::GpuLost.name(),
            why,
            "",
            "",
            now,
            format!("NVML says the GPU is lost or needs a reset ({why})"),
        ));
    }
    if let Some(v) = r.ecc_uncorrected_volatile {
        let d = st.ecc_uncorrected.observe(mono, v);
        if d > 0 {
            gpu.reasons.push(reason(
                Status::Failed,
                HealthSignal::EccUncorrected.name(),
                d,
                ">= 1",
                &win,
                now,
                format!("{d} uncorrectable ECC errors in {win} ({v} since driver load)"),
            ));
        }
    }
    if let Some(v) = r.ecc_corrected_volatile {
        let d = st.ecc_corrected.observe(mono, v);
        if d >= cfg.corrected_ecc_per_window {
            gpu.reasons.push(reason(
                Status::Degraded,
                HealthSignal::EccCorrected.name(),
                d,
                format!(">= {}", cfg.corrected_ecc_per_window),
                &win,
                now,
                format!("{d} corrected ECC errors in {win}: memory degrading"),
            ));
        } else if d > 0 {
            // Under the threshold: kept as an OK finding, so attribution
            // can show it was weighed and found too small to matter.
            gpu.reasons.push(reason(
                Status::Ok,
                HealthSignal::EccCorrected.name(),
                d,
                format!(">= {}", cfg.corrected_ecc_per_window),
                &win,
                now,
                format!("{d} corrected ECC errors in {win}: under the threshold"),
            ));
        }
    }
    if let Some(v) = r.ecc_uncorrected_aggregate {
        labels.insert("ecc_uncorrected_aggregate".into(), v.to_string());
    }
    if !r.unread.is_empty() {
        labels.insert("unread".into(), r.unread.join(", "));
    }
    if let Some(n) = r.retired_pages {
        labels.insert("retired_pages".into(), n.to_string());
        if n >= cfg.retired_pages_failed_at {
            gpu.reasons.push(reason(
                Status::Failed,
                HealthSignal::PagesRetired.name(),
                n,
                format!(">= {}", cfg.retired_pages_failed_at),
                "",
                now,
                format!("{n} pages retired: replace the GPU"),
            ));
        }
    }
    if r.retired_pending == Some(true) {
        gpu.reasons.push(reason(
            Status::Degraded,
            HealthSignal::PagesRetirementPending.name(),
            "yes",
            "",
            "",
            now,
            "a page retirement waits for the next GPU reset".into(),
        ));
    }
    if let Some(m) = r.remapped {
        labels.insert(
            "remapped_rows".into(),
            format!("{} corrected, {} uncorrected", m.corrected, m.uncorrected),
        );
        if m.failure {
            gpu.reasons.push(reason(
                Status::Failed,
                HealthSignal::RowsRemapFailure.name(),
                "yes",
                "",
                "",
                now,
                "a row remap failed: the GPU has no spare rows left".into(),
            ));
        }
        if m.pending {
            gpu.reasons.push(reason(
                Status::Degraded,
                HealthSignal::RowsRemapPending.name(),
                "yes",
                "",
                "",
                now,
                "a row remap waits for the next GPU reset".into(),
            ));
        }
    }
    if let Some(bits) = r.clock_events {
        let bad = bits & BAD_CLOCK_EVENTS;
        let seen = if bad != 0 {
            Status::Degraded
        } else {
            Status::Ok
        };
        if st.clock_events.observe(seen) == Status::Degraded && bad != 0 {
            gpu.reasons.push(reason(
                Status::Degraded,
                HealthSignal::ClockEventReasons.name(),
                format!("{bad:#x}"),
                format!("any of {BAD_CLOCK_EVENTS:#x}"),
                "",
                now,
                format!("clocks held down by the hardware ({})", clock_names(bad)),
            ));
        }
    }
    if let Some(t) = r.temperature {
        labels.insert("temperature".into(), format!("{t} C"));
        if cfg.temperature_degraded_celsius > 0 && t >= cfg.temperature_degraded_celsius {
            gpu.reasons.push(reason(
                Status::Degraded,
                "temperature",
                format!("{t} C"),
                format!(">= {} C", cfg.temperature_degraded_celsius),
                "",
                now,
                format!("GPU at {t} C"),
            ));
        }
    }
    if let Some(p) = r.power_mw {
        labels.insert("power".into(), format!("{:.1} W", f64::from(p) / 1000.0));
    }
    if let Some(a) = r.recovery_action {
        let (status, what) = match a {
            0 => (Status::Ok, "none"),
            1 => (Status::Failed, "GPU reset"),
            2 => (Status::Failed, "node reboot"),
            3 => (Status::Degraded, "drain P2P"),
            4 => (Status::Failed, "drain and reset"),
            _ => (Status::Degraded, "unknown action"),
        };
        if status != Status::Ok {
            gpu.reasons.push(
                reason(
                    status,
                    HealthSignal::GpuRecoveryAction.name(),
                    format!("{a} ({what})"),
                    "0 (none)",
                    "",
                    now,
                    format!("the driver asks for recovery: {what}"),
                )
                .of_kind(ReasonKind::DriverVerdict),
            );
        }
    }
    // XIDs keep their reason for xid_window after they arrived.
    while st
        .xids
        .front()
        .is_some_and(|(t, _, _)| mono.saturating_duration_since(*t) >= cfg.xid_window)
    {
        st.xids.pop_front();
    }
    for (_, at, x) in &st.xids {
        let mut rs = reason(
            xid_status(x.xid),
            "gpu.xid",
            x.xid,
            "",
            &show(cfg.xid_window),
            now,
            format!("XID {} on this GPU", x.xid),
        )
        .of_kind(ReasonKind::Xid);
        rs.since = *at;
        gpu.reasons.push(rs);
    }

    // PCIe.
    let mut pcie = report(format!("{id}/pcie"), BTreeMap::new());
    let mut have_pcie = false;
    if let Some(v) = r.pcie_replays {
        have_pcie = true;
        let d = st.pcie_replays.observe(mono, v);
        if cfg.pcie_replays_per_window > 0 && d >= cfg.pcie_replays_per_window {
            pcie.reasons.push(reason(
                Status::Degraded,
                HealthSignal::PcieReplays.name(),
                d,
                format!(">= {}", cfg.pcie_replays_per_window),
                &win,
                now,
                format!("{d} PCIe replays in {win}"),
            ));
        }
    }
    for (name, val) in [("gen", r.pcie_gen), ("width", r.pcie_width)] {
        if let Some((cur, max)) = val {
            have_pcie = true;
            pcie.labels.insert(name.into(), format!("{cur} of {max}"));
            if cur < max {
                pcie.reasons.push(reason(
                    Status::Degraded,
                    &format!("{}_{name}", HealthSignal::PcieLink.name()),
                    cur,
                    format!("= {max} (max)"),
                    "",
                    now,
                    format!("PCIe link {name} {cur} below its maximum {max}"),
                ));
            }
        }
    }
    // NVLinks.
    let mut links = Vec::new();
    for l in &r.links {
        let mut c = report(format!("{id}/nvlink{}", l.link), BTreeMap::new());
        let ws = st.links.entry(l.link).or_insert_with(|| {
            [
                CounterWindow::new(cfg.window),
                CounterWindow::new(cfg.window),
                CounterWindow::new(cfg.window),
            ]
        });
        if !l.active {
            c.reasons.push(reason(
                Status::Failed,
                HealthSignal::NvlinkState.name(),
                "down",
                "up",
                "",
                now,
                format!("NVLink {} is down", l.link),
            ));
        }
        for (i, (signal, val, limit, status)) in [
            (
                HealthSignal::NvlinkReplay.name(),
                l.replay,
                1,
                Status::Failed,
            ),
            (
                HealthSignal::NvlinkRecovery.name(),
                l.recovery,
                1,
                Status::Failed,
            ),
            (
                HealthSignal::NvlinkCrc.name(),
                l.crc,
                cfg.nvlink_crc_per_window,
                Status::Degraded,
            ),
        ]
        .into_iter()
        .enumerate()
        {
            if let Some(v) = val {
                let d = ws[i].observe(mono, v);
                if d >= limit {
                    c.reasons.push(reason(
                        status,
                        signal,
                        d,
                        format!(">= {limit}"),
                        &win,
                        now,
                        format!("{d} NVLink {} errors in {win}", &signal[7..]),
                    ));
                }
            }
        }
        links.push(c);
    }

    gpu.labels = labels;
    out.push(gpu);
    if have_pcie {
        out.push(pcie);
    }
    out.extend(links);
    out
}

fn clock_names(bits: u64) -> String {
    let names: Vec<&str> = [
        (0x8, "HW slowdown"),
        (0x20, "SW thermal"),
        (0x40, "HW thermal"),
        (0x80, "power brake"),
    ]
    .into_iter()
    .filter(|(b, _)| bits & b != 0)
    .map(|(_, n)| n)
    .collect();
    names.join(", ")
}

/// The node-level `nvml` component: the library loaded, the device count
/// against the expected one.
pub fn judge_count(
    count: u32,
    cfg: &NvmlConfig,
    labels: BTreeMap<String, String>,
    now: SystemTime,
) -> ComponentReport {
    let mut c = report(super::COMPONENT.into(), labels);
    c.labels.insert("gpus".into(), count.to_string());
    if cfg.expected_gpus > 0 && count < cfg.expected_gpus {
        c.reasons.push(reason(
            Status::Failed,
            HealthSignal::GpuCount.name(),
            count,
            format!(">= {}", cfg.expected_gpus),
            "",
            now,
            format!(
                "NVML sees {count} GPUs, {} expected: a GPU fell off the bus or was not found",
                cfg.expected_gpus
            ),
        ));
    }
    c
}

/// The `nvml` component when NVML cannot be used at all.
pub fn unknown(signal: &str, message: String, now: SystemTime) -> ComponentReport {
    let mut c = report(super::COMPONENT.into(), BTreeMap::new());
    c.status_override = Some(Status::Unknown);
    c.reasons
        .push(reason(Status::Unknown, signal, "", "", "", now, message));
    c
}

/// The `nvml` component where NVML is absent by design (not installed,
/// no NVIDIA device): ABSENT, which does not lower the node.
pub fn absent(signal: &str, message: String, now: SystemTime) -> ComponentReport {
    let mut c = report(super::COMPONENT.into(), BTreeMap::new());
    c.status_override = Some(Status::Absent);
    c.reasons
        .push(reason(Status::Absent, signal, "", "", "", now, message));
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(c: &ComponentReport) -> Status {
        c.status_override.unwrap_or_else(|| {
            c.reasons
                .iter()
                .map(|r| r.status)
                .max()
                .unwrap_or(Status::Ok)
        })
    }

    fn gpu(f: impl FnOnce(&mut GpuReading)) -> GpuReading {
        let mut r = GpuReading {
            ecc_uncorrected_volatile: Some(0),
            ecc_corrected_volatile: Some(0),
            ..GpuReading::default()
        };
        f(&mut r);
        r
    }

    #[test]
    fn uncorrected_ecc_is_judged_as_a_delta_over_the_window() {
        let cfg = NvmlConfig::default();
        let mut st = GpuState::new(&cfg);
        let (t0, now) = (Instant::now(), SystemTime::now());
        // A lifetime total from before the agent started is no verdict.
        let r = gpu(|r| r.ecc_uncorrected_volatile = Some(7));
        assert_eq!(
            status(&judge_gpu(&r, &mut st, &cfg, t0, now)[0]),
            Status::Ok
        );
        let r = gpu(|r| r.ecc_uncorrected_volatile = Some(9));
        let c = &judge_gpu(&r, &mut st, &cfg, t0 + Duration::from_secs(5), now)[0];
        assert_eq!(status(c), Status::Failed);
        assert_eq!(c.reasons[0].signal, "ecc.uncorrected_volatile");
        assert_eq!(c.reasons[0].value, "2");
        assert_eq!(c.reasons[0].window, "1m");
        // Once the increase has left the window the GPU is OK again.
        let later = t0 + Duration::from_secs(200);
        let c = &judge_gpu(&r, &mut st, &cfg, later, now)[0];
        assert_eq!(status(c), Status::Ok);
    }

    #[test]
    fn verdicts() {
        let cfg = NvmlConfig::default();
        let (t0, now) = (Instant::now(), SystemTime::now());
        let cases: Vec<(GpuReading, Status, &str)> = vec![
            (gpu(|_| {}), Status::Ok, ""),
            (
                gpu(|r| r.lost = Some("GPU is lost".into())),
                Status::Failed,
                "gpu.lost",
            ),
            (
                gpu(|r| r.retired_pages = Some(63)),
                Status::Failed,
                "pages.retired",
            ),
            (
                gpu(|r| r.retired_pending = Some(true)),
                Status::Degraded,
                "pages.retirement_pending",
            ),
            (
                gpu(|r| {
                    r.remapped = Some(RemappedRows {
                        corrected: 1,
                        uncorrected: 2,
                        pending: false,
                        failure: true,
                    })
                }),
                Status::Failed,
                "rows.remap_failure",
            ),
            (
                gpu(|r| r.temperature = Some(95)),
                Status::Degraded,
                "temperature",
            ),
            (gpu(|r| r.recovery_action = Some(0)), Status::Ok, ""),
            (
                gpu(|r| r.recovery_action = Some(2)),
                Status::Failed,
                "gpu.recovery_action",
            ),
        ];
        for (r, want, signal) in cases {
            let mut st = GpuState::new(&cfg);
            let c = &judge_gpu(&r, &mut st, &cfg, t0, now)[0];
            assert_eq!(status(c), want, "{r:?}");
            if !signal.is_empty() {
                assert_eq!(c.reasons[0].signal, signal);
            }
        }
    }

    #[test]
    fn a_single_throttle_sample_is_not_a_verdict() {
        let cfg = NvmlConfig::default();
        let mut st = GpuState::new(&cfg);
        let (t0, now) = (Instant::now(), SystemTime::now());
        let hot = gpu(|r| r.clock_events = Some(0x40 | 0x1));
        assert_eq!(
            status(&judge_gpu(&hot, &mut st, &cfg, t0, now)[0]),
            Status::Ok
        );
        let c = &judge_gpu(&hot, &mut st, &cfg, t0, now)[0];
        assert_eq!(status(c), Status::Degraded);
        assert_eq!(c.reasons[0].value, "0x40");
    }

    #[test]
    fn xids_mark_the_gpu_for_their_window() {
        let cfg = NvmlConfig::default();
        let mut st = GpuState::new(&cfg);
        let (t0, now) = (Instant::now(), SystemTime::now());
        let x = |xid| XidEvent {
            gpu: 0,
            xid,
            pci: String::new(),
        };
        st.note_xid(t0, now, x(13));
        assert_eq!(
            status(&judge_gpu(&gpu(|_| {}), &mut st, &cfg, t0, now)[0]),
            Status::Ok
        );
        st.note_xid(t0, now, x(79));
        let c = &judge_gpu(&gpu(|_| {}), &mut st, &cfg, t0, now)[0];
        assert_eq!(status(c), Status::Failed);
        // The source says what its reasons are to attribution: an XID,
        // and (below) the driver's verdict; attribution never reads names.
        assert!(
            c.reasons.iter().all(|r| r.kind == ReasonKind::Xid),
            "{:?}",
            c.reasons
        );
        let c = &judge_gpu(
            &gpu(|r| r.recovery_action = Some(2)),
            &mut st,
            &cfg,
            t0,
            now,
        )[0];
        let kind = |signal: &str| {
            c.reasons
                .iter()
                .find(|r| r.signal == signal)
                .map(|r| r.kind)
        };
        assert_eq!(kind("gpu.recovery_action"), Some(ReasonKind::DriverVerdict));
        assert_eq!(kind("gpu.xid"), Some(ReasonKind::Xid));
        let later = t0 + cfg.xid_window;
        let c = &judge_gpu(&gpu(|_| {}), &mut st, &cfg, later, now)[0];
        assert!(c.reasons.is_empty());
    }

    #[test]
    fn links_and_pcie() {
        let cfg = NvmlConfig::default();
        let mut st = GpuState::new(&cfg);
        let (t0, now) = (Instant::now(), SystemTime::now());
        let mut r = gpu(|r| {
            r.pcie_replays = Some(100);
            r.pcie_gen = Some((4, 4));
            r.pcie_width = Some((8, 16));
            r.links = vec![
                NvLinkReading {
                    link: 0,
                    active: true,
                    replay: Some(5),
                    recovery: Some(0),
                    crc: Some(0),
                },
                NvLinkReading {
                    link: 1,
                    active: false,
                    ..NvLinkReading::default()
                },
            ];
        });
        let out = judge_gpu(&r, &mut st, &cfg, t0, now);
        let ids: Vec<&str> = out.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["gpu0", "gpu0/pcie", "gpu0/nvlink0", "gpu0/nvlink1"]);
        assert_eq!(status(&out[1]), Status::Degraded, "x8 of x16");
        assert_eq!(
            status(&out[2]),
            Status::Ok,
            "lifetime replays are no verdict"
        );
        assert_eq!(status(&out[3]), Status::Failed, "link down");
        r.links[0].replay = Some(6);
        r.pcie_replays = Some(120);
        let out = judge_gpu(&r, &mut st, &cfg, t0 + Duration::from_secs(5), now);
        assert_eq!(out[2].reasons[0].signal, "nvlink.replay");
        assert!(out[1].reasons.iter().any(|r| r.signal == "pcie.replays"));
    }

    #[test]
    fn count_below_expected() {
        let cfg = NvmlConfig {
            expected_gpus: 8,
            ..NvmlConfig::default()
        };
        let c = judge_count(7, &cfg, BTreeMap::new(), SystemTime::now());
        assert_eq!(status(&c), Status::Failed);
        assert_eq!(c.reasons[0].value, "7");
        assert_eq!(
            status(&judge_count(8, &cfg, BTreeMap::new(), SystemTime::now())),
            Status::Ok
        );
    }
}
