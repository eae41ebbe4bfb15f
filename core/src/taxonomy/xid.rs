//! The XID table: what each NVIDIA XID says about a GPU, in one place, as
//! data. The kernel-log source, the NVML source (and later attribution)
//! read it; docs/fault-taxonomy.md is its human form.
//!
//! The status is what the XID says about the GPU's health on its own:
//! application errors (13, 31, 43...) leave the GPU OK (the reason stays as
//! evidence; a repeat on one GPU is attribution's call, not this table's);
//! errors the hardware contained or corrected degrade it; uncorrectable
//! ones fail it (DCGM always fails on 48, 74, 79, 95, 119, 120, 140).

use crate::health::Status;

/// Whose fault an XID most likely is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidClass {
    /// The application (bad kernel, bad pointer).
    User,
    /// The driver or a transient condition; a restart usually clears it.
    TransientSoftware,
    /// The hardware saw an error and handled it.
    CorrectableHardware,
    /// The hardware cannot go on without a reset or repair.
    UncorrectableHardware,
    /// Follows another XID; judge that one.
    FollowUp,
    /// Not in the table.
    Unclassified,
}

impl XidClass {
    /// Snake-case name, as events and docs show it.
    pub fn as_str(self) -> &'static str {
        match self {
            XidClass::User => "user_error",
            XidClass::TransientSoftware => "transient_software",
            XidClass::CorrectableHardware => "correctable_hardware",
            XidClass::UncorrectableHardware => "uncorrectable_hardware",
            XidClass::FollowUp => "follow_up",
            XidClass::Unclassified => "unclassified",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidRule {
    /// The XID.
    pub xid: u32,
    /// Whose fault it most likely is.
    pub class: XidClass,
    /// What it says about the GPU's health.
    pub status: Status,
    /// NVIDIA's meaning, short.
    pub meaning: &'static str,
}

const fn row(xid: u32, class: XidClass, status: Status, meaning: &'static str) -> XidRule {
    XidRule {
        xid,
        class,
        status,
        meaning,
    }
}

use Status::{Degraded, Failed, Ok};
use XidClass::{CorrectableHardware, FollowUp, TransientSoftware, UncorrectableHardware, User};

/// The table (Ampere and later), from NVIDIA's XID catalog and DCGM.
pub const TABLE: &[XidRule] = &[
    row(8, TransientSoftware, Degraded, "GPU stopped processing"),
    row(13, User, Ok, "graphics engine exception"),
    row(31, User, Ok, "GPU memory page fault"),
    row(32, TransientSoftware, Degraded, "corrupted push buffer"),
    row(43, User, Ok, "GPU stopped processing, GPU healthy"),
    row(45, FollowUp, Ok, "preemptive cleanup after another error"),
    row(48, UncorrectableHardware, Failed, "double-bit ECC error"),
    row(62, UncorrectableHardware, Failed, "PMU halt"),
    row(
        63,
        CorrectableHardware,
        Degraded,
        "row remap / page retirement event",
    ),
    row(
        64,
        UncorrectableHardware,
        Failed,
        "row remap / page retirement failure",
    ),
    row(68, User, Ok, "video decoder error"),
    row(69, User, Ok, "graphics engine class error"),
    row(74, UncorrectableHardware, Failed, "NVLink error"),
    row(79, UncorrectableHardware, Failed, "GPU fell off the bus"),
    row(
        92,
        CorrectableHardware,
        Degraded,
        "excessive single-bit ECC rate",
    ),
    row(94, CorrectableHardware, Degraded, "contained ECC error"),
    row(95, UncorrectableHardware, Failed, "uncontained ECC error"),
    row(109, TransientSoftware, Degraded, "context switch timeout"),
    row(119, UncorrectableHardware, Failed, "GSP RPC timeout"),
    row(120, UncorrectableHardware, Failed, "GSP error"),
    row(
        136,
        UncorrectableHardware,
        Failed,
        "NVLink link training failure",
    ),
    row(
        140,
        UncorrectableHardware,
        Failed,
        "unrecoverable ECC error",
    ),
    row(
        143,
        UncorrectableHardware,
        Failed,
        "GPU initialization failure",
    ),
    row(154, FollowUp, Degraded, "GPU recovery action changed"),
    row(158, UncorrectableHardware, Failed, "GPU fatal timeout"),
];

/// The rule for `xid`; an XID not in the table degrades the GPU until a
/// person has looked at it.
pub fn rule(xid: u32) -> XidRule {
    TABLE.iter().find(|r| r.xid == xid).copied().unwrap_or(row(
        xid,
        XidClass::Unclassified,
        Degraded,
        "not in warden's XID table",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sorted_and_unique() {
        assert!(TABLE.windows(2).all(|w| w[0].xid < w[1].xid));
    }

    #[test]
    fn dcgm_always_fails_these() {
        for x in [48, 74, 79, 95, 119, 120, 140] {
            assert_eq!(rule(x).status, Failed, "xid {x}");
        }
    }

    #[test]
    fn application_errors_leave_the_gpu_ok() {
        for x in [13, 31, 43, 68] {
            assert_eq!(rule(x).class, User, "xid {x}");
            assert_eq!(rule(x).status, Ok, "xid {x}");
        }
        assert_eq!(rule(9999).class, XidClass::Unclassified);
    }
}
