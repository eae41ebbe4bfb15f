//! Health signal names: the one spelling of each signal a source puts on a
//! reason, and what warden reads in one (issue 34). Attribution's rules,
//! the DCGM gate's fast NVML check and the straggler explanation each used
//! to match signal strings their own way (an exact list, a prefix list);
//! now the sources write [`HealthSignal::name`] and every reader asks
//! [`HealthSignal::of`] what a reason's signal is.
//!
//! In: a reason's `signal` string, as a source, a peer or a replayed record
//! gave it. Out: the [`HealthSignal`] it is, and whether it fails the fast
//! GPU gate or can slow a GPU down. Never: I/O; a signal nobody names here
//! is [`HealthSignal::Unknown`], which says nothing, never an error.

/// A health signal, as the readers of reasons tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HealthSignal {
    /// `gpu.lost`: the GPU fell off the bus or needs a reset.
    GpuLost,
    /// `gpu.count`: fewer GPUs than the host should have.
    GpuCount,
    /// `gpu.recovery_action`: the driver's own verdict (NVML 12.x+).
    GpuRecoveryAction,
    /// `ecc.uncorrected_volatile`.
    EccUncorrected,
    /// `ecc.corrected_volatile`.
    EccCorrected,
    /// `pages.retired`.
    PagesRetired,
    /// `pages.retirement_pending`.
    PagesRetirementPending,
    /// `rows.remap_failure`.
    RowsRemapFailure,
    /// `rows.remap_pending`.
    RowsRemapPending,
    /// `clocks.event_reasons`: NVML's clock event (throttle) reasons.
    ClockEventReasons,
    /// Another `clocks.*` signal (none of warden's sources writes one).
    ClockOther,
    /// `temperature*`.
    Temperature,
    /// `power*`.
    Power,
    /// `pcie.replays`.
    PcieReplays,
    /// `pcie.link*`: a PCIe link below its maximum.
    PcieLink,
    /// `nvlink.state*`: an NVLink down.
    NvlinkState,
    /// `nvlink.replay`.
    NvlinkReplay,
    /// `nvlink.recovery`.
    NvlinkRecovery,
    /// `nvlink.crc`.
    NvlinkCrc,
    /// Another `nvlink.*` signal.
    NvlinkOther,
    /// `kmsg.link`: the kernel log says a NIC link went down.
    KmsgLink,
    /// `*.link_state`: a NIC or InfiniBand port down (`ib.link_state`).
    NicLinkState,
    /// `*.link_downs`: a NIC or InfiniBand port flapping.
    NicLinkDowns,
    /// `kmsg.oom_kill`: the kernel's OOM killer ran.
    OomKill,
    /// `memory.available_percent`.
    HostMemory,
    /// `disk.available_percent`: the checkpoint tier's filesystem.
    TierDisk,
    /// `tpu.core_error`.
    TpuCoreError,
    /// `dcgm.*`: judged by DCGM's own table ([`super::dcgm`]).
    Dcgm,
    /// Any other signal.
    Unknown,
}

use HealthSignal::*;

/// The signals with a name of their own, in the order their names are
/// tried as prefixes (a more specific name before a shorter one it
/// starts with, as the rules' table has always been read).
const NAMED: [HealthSignal; 23] = [
    GpuLost,
    GpuCount,
    GpuRecoveryAction,
    EccUncorrected,
    EccCorrected,
    PagesRetired,
    PagesRetirementPending,
    RowsRemapFailure,
    RowsRemapPending,
    ClockEventReasons,
    PcieReplays,
    PcieLink,
    NvlinkState,
    NvlinkReplay,
    NvlinkRecovery,
    NvlinkCrc,
    KmsgLink,
    NicLinkState,
    NicLinkDowns,
    OomKill,
    HostMemory,
    TierDisk,
    TpuCoreError,
];

impl HealthSignal {
    /// The signal's spelling, as a source writes it; for the two NIC
    /// families, the suffix every such signal ends with (`ib.link_state`).
    /// A family without one name (`clocks.*`, `nvlink.*`, `dcgm.*`) gives
    /// its prefix, and [`HealthSignal::Unknown`] the empty string.
    pub const fn name(self) -> &'static str {
        match self {
            GpuLost => "gpu.lost",
            GpuCount => "gpu.count",
            GpuRecoveryAction => "gpu.recovery_action",
            EccUncorrected => "ecc.uncorrected_volatile",
            EccCorrected => "ecc.corrected_volatile",
            PagesRetired => "pages.retired",
            PagesRetirementPending => "pages.retirement_pending",
            RowsRemapFailure => "rows.remap_failure",
            RowsRemapPending => "rows.remap_pending",
            ClockEventReasons => "clocks.event_reasons",
            ClockOther => "clocks.",
            Temperature => "temperature",
            Power => "power",
            PcieReplays => "pcie.replays",
            PcieLink => "pcie.link",
            NvlinkState => "nvlink.state",
            NvlinkReplay => "nvlink.replay",
            NvlinkRecovery => "nvlink.recovery",
            NvlinkCrc => "nvlink.crc",
            NvlinkOther => "nvlink.",
            KmsgLink => "kmsg.link",
            NicLinkState => ".link_state",
            NicLinkDowns => ".link_downs",
            OomKill => "kmsg.oom_kill",
            HostMemory => "memory.available_percent",
            TierDisk => "disk.available_percent",
            TpuCoreError => "tpu.core_error",
            Dcgm => "dcgm.",
            Unknown => "",
        }
    }

    /// What `signal` is: its exact name first; then the first name it
    /// starts with (`pcie.link_gen` is [`PcieLink`]) or, for the NIC
    /// families, ends with (`ib.link_state`); then its family.
    pub fn of(signal: &str) -> Self {
        if signal.starts_with(Dcgm.name()) {
            return Dcgm;
        }
        if let Some(s) = NAMED.iter().find(|s| s.name() == signal) {
            return *s;
        }
        let by_name = NAMED.iter().find(|s| {
            let name = s.name();
            match name.strip_prefix('.') {
                Some(_) => signal.ends_with(name),
                None => signal.starts_with(name),
            }
        });
        if let Some(s) = by_name {
            return *s;
        }
        [ClockOther, Temperature, Power, NvlinkOther]
            .into_iter()
            .find(|s| signal.starts_with(s.name()))
            .unwrap_or(Unknown)
    }

    /// Whether a reason of this signal at DEGRADED or worse fails the DCGM
    /// gate's fast NVML check (the GPU is unfit for a job, whatever DCGM's
    /// diagnostic would add).
    pub const fn fails_gpu_gate(self) -> bool {
        matches!(
            self,
            GpuLost
                | GpuCount
                | GpuRecoveryAction
                | RowsRemapPending
                | RowsRemapFailure
                | PagesRetirementPending
                | PagesRetired
                | NvlinkState
                | EccUncorrected
        )
    }

    /// Whether a reason of this signal can make a GPU slower (clocks held
    /// down, heat, a power cap, a narrowed PCIe link, NVLink errors): what
    /// a straggler's explanation looks for on the rank's devices.
    pub const fn slows_gpu(self) -> bool {
        matches!(
            self,
            ClockEventReasons
                | ClockOther
                | Temperature
                | Power
                | PcieReplays
                | PcieLink
                | NvlinkState
                | NvlinkReplay
                | NvlinkRecovery
                | NvlinkCrc
                | NvlinkOther
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_as_itself() {
        for s in NAMED {
            assert_eq!(HealthSignal::of(s.name()), s, "{}", s.name());
        }
        assert_eq!(HealthSignal::of("ib.link_state"), NicLinkState);
        assert_eq!(HealthSignal::of("mlx5_0.link_downs"), NicLinkDowns);
    }

    #[test]
    fn families_and_prefixes_are_what_the_readers_always_took_them_for() {
        assert_eq!(HealthSignal::of("pcie.link_gen"), PcieLink);
        assert_eq!(HealthSignal::of("nvlink.state_down"), NvlinkState);
        assert_eq!(HealthSignal::of("clocks.thermal"), ClockOther);
        assert_eq!(HealthSignal::of("nvlink.bandwidth"), NvlinkOther);
        assert_eq!(HealthSignal::of("dcgm.incident.DCGM_FR_XID_ERROR"), Dcgm);
        assert_eq!(HealthSignal::of("temperature"), Temperature);
        assert_eq!(HealthSignal::of("gpu.xid"), Unknown);
        assert_eq!(HealthSignal::of(""), Unknown);
    }

    #[test]
    fn the_gate_and_the_slowdown_read_their_signals_only() {
        let gate: Vec<_> = NAMED.iter().filter(|s| s.fails_gpu_gate()).collect();
        assert_eq!(gate.len(), 9);
        assert!(!EccCorrected.fails_gpu_gate());
        assert!(!ClockEventReasons.fails_gpu_gate());
        assert!(ClockEventReasons.slows_gpu());
        assert!(HealthSignal::of("clocks.thermal").slows_gpu());
        assert!(HealthSignal::of("power_cap").slows_gpu());
        assert!(!GpuLost.slows_gpu());
        assert!(!HealthSignal::of("memory.available_percent").slows_gpu());
        assert!(!Unknown.slows_gpu());
    }
}
