//! DCGM's failure reasons (`dcgm_errors.h`), as data: what each says about
//! whose fault an incident is, next to the XID table and the NVML signals
//! in attribution. The `dcgm` severity column is DCGM's own advice
//! (isolate the GPU, reset it, monitor it, triage by hand); the class is
//! warden's, and the policy maps the class to an action.

use crate::health::ReasonKind;
use crate::verdict::FaultClass::{
    self, CorrectableHardware, Infrastructure, UncorrectableHardware,
};
use crate::verdict::SignalRule;

/// DCGM's advice for a failure reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Take the GPU out of service.
    Isolate,
    /// Reset the GPU (or reboot) to clear it.
    Reset,
    /// Keep watching; no action yet.
    Monitor,
    /// A person should look.
    Triage,
}

impl Advice {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Advice::Isolate => "isolate",
            Advice::Reset => "reset",
            Advice::Monitor => "monitor",
            Advice::Triage => "triage",
        }
    }
}

/// One failure reason.
#[derive(Debug, Clone, Copy)]
pub struct DcgmReason {
    /// `dcgmError_t` code.
    pub code: u32,
    /// DCGM's advice.
    pub advice: Advice,
    /// The attribution rule (signal `dcgm.<name>`, class when FAILED / when
    /// DEGRADED, weight).
    pub rule: SignalRule,
    /// What the source's reason is to attribution: a report about XIDs
    /// (left to the XID's own evidence), the driver's recovery verdict, or
    /// a judged finding weighed by `rule`.
    pub kind: ReasonKind,
}

impl DcgmReason {
    /// This reason as one of `kind`.
    const fn of_kind(mut self, kind: ReasonKind) -> Self {
        self.kind = kind;
        self
    }
}

const fn r(
    code: u32,
    signal: &'static str,
    advice: Advice,
    failed: FaultClass,
    degraded: FaultClass,
    weight: f64,
    note: &'static str,
) -> DcgmReason {
    DcgmReason {
        code,
        advice,
        rule: SignalRule {
            signal,
            failed,
            degraded: Some(degraded),
            weight,
            note,
        },
        kind: ReasonKind::Judged,
    }
}

use Advice::{Isolate, Monitor, Reset, Triage};

/// The table, ordered by code.
pub const REASONS: &[DcgmReason] = &[
    r(
        3,
        "dcgm.pci_replay_rate",
        Isolate,
        CorrectableHardware,
        CorrectableHardware,
        0.6,
        "DCGM: PCIe replay rate over its limit",
    ),
    r(
        4,
        "dcgm.volatile_dbe_detected",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "DCGM: double-bit ECC error",
    ),
    r(
        5,
        "dcgm.volatile_sbe_detected",
        Monitor,
        CorrectableHardware,
        CorrectableHardware,
        0.6,
        "DCGM: single-bit ECC errors",
    ),
    r(
        6,
        "dcgm.pending_page_retirements",
        Reset,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: page retirements wait for a reset",
    ),
    r(
        7,
        "dcgm.retired_pages_limit",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: retired pages at the limit",
    ),
    r(
        8,
        "dcgm.retired_pages_dbe_limit",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: pages retired for DBEs at the limit",
    ),
    r(
        9,
        "dcgm.corrupt_inforom",
        Triage,
        UncorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: corrupt InfoROM",
    ),
    r(
        10,
        "dcgm.clocks_event_thermal",
        Monitor,
        CorrectableHardware,
        CorrectableHardware,
        0.5,
        "DCGM: thermal clock slowdown",
    ),
    r(
        11,
        "dcgm.power_unreadable",
        Monitor,
        CorrectableHardware,
        CorrectableHardware,
        0.4,
        "DCGM: power cannot be read",
    ),
    r(
        12,
        "dcgm.clocks_event_power",
        Monitor,
        CorrectableHardware,
        CorrectableHardware,
        0.5,
        "DCGM: power clock slowdown",
    ),
    r(
        13,
        "dcgm.nvlink_error_threshold",
        Isolate,
        UncorrectableHardware,
        CorrectableHardware,
        0.8,
        "DCGM: NVLink errors over the threshold",
    ),
    r(
        14,
        "dcgm.nvlink_down",
        Triage,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: an NVLink is down",
    ),
    r(
        15,
        "dcgm.nvswitch_fatal_error",
        Isolate,
        Infrastructure,
        Infrastructure,
        0.85,
        "DCGM: fatal NVSwitch error",
    ),
    r(
        16,
        "dcgm.nvswitch_non_fatal_error",
        Monitor,
        Infrastructure,
        Infrastructure,
        0.5,
        "DCGM: non-fatal NVSwitch error",
    ),
    r(
        33,
        "dcgm.field_violation",
        Isolate,
        CorrectableHardware,
        CorrectableHardware,
        0.5,
        "DCGM: a field over its policy limit",
    ),
    r(
        70,
        "dcgm.nvlink_crc_error_threshold",
        Isolate,
        UncorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: NVLink CRC errors over the threshold",
    ),
    r(
        71,
        "dcgm.nvlink_error_critical",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: critical NVLink error",
    ),
    r(
        80,
        "dcgm.row_remap_failure",
        Reset,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "DCGM: row remapping failed",
    ),
    r(
        81,
        "dcgm.uncontained_error",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "DCGM: uncontained ECC error",
    ),
    r(
        83,
        "dcgm.dbe_pending_page_retirements",
        Reset,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: DBE page retirements pending",
    ),
    r(
        84,
        "dcgm.uncorrectable_row_remap",
        Reset,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: uncorrectable row remap",
    ),
    r(
        85,
        "dcgm.pending_row_remap",
        Reset,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: a row remap waits for a reset",
    ),
    r(
        101,
        "dcgm.xid_error",
        Triage,
        UncorrectableHardware,
        CorrectableHardware,
        0.8,
        "DCGM: an XID error",
    )
    .of_kind(ReasonKind::AboutXids),
    r(
        109,
        "dcgm.sxid_error",
        Isolate,
        Infrastructure,
        Infrastructure,
        0.8,
        "DCGM: an NVSwitch SXID",
    )
    .of_kind(ReasonKind::AboutXids),
    r(
        118,
        "dcgm.sram_threshold",
        Isolate,
        UncorrectableHardware,
        CorrectableHardware,
        0.8,
        "DCGM: SRAM errors over the threshold",
    ),
    r(
        119,
        "dcgm.nvlink_effective_ber_threshold",
        Isolate,
        UncorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: NVLink effective BER over the threshold",
    ),
    r(
        120,
        "dcgm.fallen_off_bus",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.95,
        "DCGM: the GPU fell off the bus",
    ),
    r(
        121,
        "dcgm.nvlink_symbol_ber_threshold",
        Isolate,
        UncorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: NVLink symbol BER over the threshold",
    ),
    r(
        122,
        "dcgm.imex_unhealthy",
        Triage,
        Infrastructure,
        Infrastructure,
        0.6,
        "DCGM: the IMEX daemon is unhealthy",
    ),
    r(
        125,
        "dcgm.gpu_recovery_reset",
        Reset,
        UncorrectableHardware,
        UncorrectableHardware,
        0.97,
        "DCGM: the driver asks for a GPU reset",
    )
    .of_kind(ReasonKind::DriverVerdict),
    r(
        126,
        "dcgm.gpu_recovery_reboot",
        Isolate,
        UncorrectableHardware,
        UncorrectableHardware,
        0.97,
        "DCGM: the driver asks for a node reboot",
    )
    .of_kind(ReasonKind::DriverVerdict),
    r(
        127,
        "dcgm.gpu_recovery_drain_p2p",
        Reset,
        CorrectableHardware,
        CorrectableHardware,
        0.9,
        "DCGM: the driver asks to drain P2P traffic",
    )
    .of_kind(ReasonKind::DriverVerdict),
    r(
        128,
        "dcgm.gpu_recovery_drain_reset",
        Reset,
        UncorrectableHardware,
        UncorrectableHardware,
        0.97,
        "DCGM: the driver asks to drain and reset",
    )
    .of_kind(ReasonKind::DriverVerdict),
    r(
        131,
        "dcgm.contained_error",
        Monitor,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "DCGM: contained ECC error",
    ),
    r(
        132,
        "dcgm.uncorrectable_row_remap_limit",
        Triage,
        UncorrectableHardware,
        UncorrectableHardware,
        0.85,
        "DCGM: uncorrectable row remaps at the limit",
    ),
];

/// The reason for `code`, if DCGM's table has it.
pub fn reason(code: u32) -> Option<&'static DcgmReason> {
    REASONS.iter().find(|r| r.code == code)
}

/// The attribution rule for a `dcgm.*` signal.
pub fn rule_for_signal(signal: &str) -> Option<&'static SignalRule> {
    REASONS.iter().map(|r| &r.rule).find(|r| r.signal == signal)
}

/// DCGM's health systems, by bit, for names in config and evidence.
pub const SYSTEMS: &[(u32, &str)] = &[
    (0x1, "pcie"),
    (0x2, "nvlink"),
    (0x4, "pmu"),
    (0x8, "mcu"),
    (0x10, "mem"),
    (0x20, "sm"),
    (0x40, "inforom"),
    (0x80, "thermal"),
    (0x100, "power"),
    (0x200, "driver"),
    (0x400, "nvswitch_nonfatal"),
    (0x800, "nvswitch_fatal"),
    (0x1000, "connectx"),
];

/// `system` as a name: "mem", "all" for 0xFFFFFFFF (DCGM 4.4.1+ reports
/// devastating XIDs that way), else the hex value.
pub fn system_name(system: u32) -> String {
    if system == u32::MAX {
        return "all".into();
    }
    SYSTEMS
        .iter()
        .find(|(b, _)| *b == system)
        .map_or_else(|| format!("{system:#x}"), |(_, n)| (*n).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_says_which_reasons_are_about_xids_or_the_drivers_verdict() {
        let kind = |code| reason(code).map(|r| r.kind);
        // DCGM_FR_XID_ERROR, DCGM_FR_SXID_ERROR: reports about XIDs.
        assert_eq!(kind(101), Some(ReasonKind::AboutXids));
        assert_eq!(kind(109), Some(ReasonKind::AboutXids));
        // DCGM_FR_GPU_RECOVERY_*: the driver's own verdict.
        for code in 125..=128 {
            assert_eq!(kind(code), Some(ReasonKind::DriverVerdict), "{code}");
        }
        // Every other reason is judged by its rule.
        let others = REASONS
            .iter()
            .filter(|r| !matches!(r.code, 101 | 109 | 125..=128))
            .filter(|r| r.kind != ReasonKind::Judged)
            .map(|r| r.rule.signal)
            .collect::<Vec<_>>();
        assert!(others.is_empty(), "{others:?}");
    }

    #[test]
    fn table_is_sorted_unique_and_named_dcgm() {
        assert!(REASONS.windows(2).all(|w| w[0].code < w[1].code));
        assert!(REASONS.iter().all(|r| r.rule.signal.starts_with("dcgm.")));
        assert_eq!(
            reason(4).map(|r| r.rule.failed),
            Some(UncorrectableHardware)
        );
        assert_eq!(system_name(u32::MAX), "all");
        assert_eq!(system_name(0x10), "mem");
    }
}
