//! The attribution rules, as data: what each kind of evidence says about
//! whose fault an incident is, and how strongly. docs/fault-taxonomy.md is
//! their human form; the XIDs stay in [`crate::taxonomy::xid`], the one XID
//! table, and are mapped to classes here.
//!
//! A weight is the confidence a signal gives on its own. Attribution picks
//! the class with the strongest evidence and combines agreeing signals
//! (1 - product of (1 - weight)), so two independent hints are surer than
//! one; an override rule (the driver's recovery action) wins outright.

use super::FaultClass::{
    self, CorrectableHardware, Infrastructure, TransientSoftware, UncorrectableHardware, Unknown,
    UserError,
};
use crate::taxonomy::signals::HealthSignal::{
    self, ClockEventReasons, EccCorrected, EccUncorrected, GpuCount, GpuLost, GpuRecoveryAction,
    HostMemory, KmsgLink, NicLinkDowns, NicLinkState, NvlinkCrc, NvlinkRecovery, NvlinkReplay,
    NvlinkState, OomKill, PagesRetired, PagesRetirementPending, PcieLink, PcieReplays,
    RowsRemapFailure, RowsRemapPending, TierDisk, TpuCoreError,
};
use crate::taxonomy::xid::{self, XidClass};

/// What a Python exception says, matched on "type: message".
#[derive(Debug, Clone, Copy)]
pub struct ExceptionRule {
    /// Rule name, shown in diagnoses and listed in the docs.
    pub name: &'static str,
    /// Case-insensitive substrings of "qualified.Type: message"; any matches.
    pub patterns: &'static [&'static str],
    /// The class it points to.
    pub class: FaultClass,
    /// How strongly.
    pub weight: f64,
    /// Why, for a person.
    pub note: &'static str,
}

const fn exc(
    name: &'static str,
    patterns: &'static [&'static str],
    class: FaultClass,
    weight: f64,
    note: &'static str,
) -> ExceptionRule {
    ExceptionRule {
        name,
        patterns,
        class,
        weight,
        note,
    }
}

/// Exception rules, most specific first: the first that matches decides.
pub const EXCEPTIONS: &[ExceptionRule] = &[
    // First: its message names the holders and why each could not be
    // asked, which may be "connection refused" (a network rule's words).
    exc(
        "exception.ckpt_holders_unreachable",
        &["could not be asked (the checkpoint may be on them"],
        TransientSoftware,
        0.6,
        "a restore could not ask every holder of the job's checkpoint (a peer agent slow or down): a restart asks again, rather than start over at step 0",
    ),
    exc(
        "exception.cuda_ecc",
        &["uncorrectable ecc error", "ecc error encountered"],
        UncorrectableHardware,
        0.8,
        "the CUDA runtime reports an uncorrectable ECC error: GPU memory is failing",
    ),
    exc(
        "exception.gpu_lost",
        &[
            "gpu is lost",
            "fallen off the bus",
            "cudaerrordevicesunavailable",
        ],
        UncorrectableHardware,
        0.75,
        "the CUDA runtime lost the GPU",
    ),
    exc(
        "exception.nccl_timeout",
        &[
            "watchdog caught collective operation timeout",
            "collective operation timeout",
            "nccl timeout",
            "timed out waiting for",
            "dist.barrier timed out",
        ],
        TransientSoftware,
        0.7,
        "a collective timed out: a peer was slow, hung or gone; a restart usually clears it",
    ),
    exc(
        "exception.nccl_network",
        &[
            "ncclremoteerror",
            "ncclsystemerror",
            "unhandled system error",
            "remote process exited or there was a network error",
            "nccl_ib",
            "connection reset by peer",
            "connection closed by peer",
            "connection refused",
            "broken pipe",
        ],
        Infrastructure,
        0.65,
        "NCCL or the rendezvous lost a connection: the network or a peer host",
    ),
    exc(
        "exception.nccl_internal",
        &[
            "ncclinternalerror",
            "ncclinvalidusage",
            "nccl error",
            "processgroupnccl",
        ],
        TransientSoftware,
        0.55,
        "an NCCL error without a network cause",
    ),
    exc(
        "exception.cuda_oom",
        &[
            "outofmemoryerror",
            "cuda out of memory",
            "cuda error: out of memory",
        ],
        UserError,
        0.85,
        "CUDA out of memory: the model, batch or activations do not fit; a restart fails the same way",
    ),
    exc(
        "exception.illegal_address",
        &[
            "illegal memory access",
            "misaligned address",
            "device-side assert",
            "illegal instruction was encountered",
        ],
        UserError,
        0.6,
        "a kernel touched memory it must not: usually the code (a hardware XID beside it says otherwise)",
    ),
    exc(
        "exception.disk_full",
        &["no space left on device", "disk quota exceeded"],
        Infrastructure,
        0.7,
        "a file system is full",
    ),
    exc(
        "exception.io",
        &[
            "input/output error",
            "stale file handle",
            "transport endpoint is not connected",
        ],
        Infrastructure,
        0.6,
        "storage failed under the job",
    ),
    exc(
        "exception.python",
        &[
            "keyerror",
            "valueerror",
            "typeerror",
            "attributeerror",
            "indexerror",
            "nameerror",
            "assertionerror",
            "zerodivisionerror",
            "filenotfounderror",
            "modulenotfounderror",
            "importerror",
            "syntaxerror",
            "notimplementederror",
            "floatingpointerror",
            "unboundlocalerror",
            "recursionerror",
        ],
        UserError,
        0.8,
        "a Python error in the training code",
    ),
];

/// The first exception rule matching `type_and_message` (lower-cased here).
pub fn exception_rule(exception_type: &str, message: &str) -> Option<&'static ExceptionRule> {
    let text = format!("{exception_type}: {message}").to_lowercase();
    EXCEPTIONS
        .iter()
        .find(|r| r.patterns.iter().any(|p| text.contains(p)))
}

/// What an exit status says on its own (weak: a status hides its cause).
pub fn exit_rule(
    code: Option<i32>,
    signal: Option<i32>,
) -> (&'static str, FaultClass, f64, String) {
    // Shells and launchers report a death by signal N as 128+N.
    let signal = signal.or(code.filter(|c| (129..=159).contains(c)).map(|c| c - 128));
    match (code, signal) {
        (_, Some(9)) => (
            "exit.sigkill",
            Unknown,
            0.3,
            "killed by SIGKILL from outside the process: the OOM killer, an operator or the scheduler".into(),
        ),
        (_, Some(s @ (2 | 15))) => (
            "exit.stopped",
            Infrastructure,
            0.4,
            format!("stopped by signal {s} from outside: preemption, an operator or the scheduler"),
        ),
        (_, Some(s @ (4 | 7 | 8 | 11))) => (
            "exit.native_crash",
            Unknown,
            0.35,
            format!("crashed in native code (signal {s}): the code, a library, the driver or memory"),
        ),
        (_, Some(6)) => (
            "exit.abort",
            Unknown,
            0.35,
            "aborted (SIGABRT): an uncaught C++ exception or a failed assertion in a library".into(),
        ),
        (_, Some(s)) => ("exit.signal", Unknown, 0.3, format!("killed by signal {s}")),
        (Some(c), None) => (
            "exit.code",
            Unknown,
            0.3,
            format!("exited with code {c} and reported no exception"),
        ),
        (None, None) => (
            "exit.unknown",
            Unknown,
            0.2,
            "exited; its status could not be read".into(),
        ),
    }
}

pub use super::class::SignalRule;

const fn sig(
    signal: HealthSignal,
    failed: FaultClass,
    degraded: FaultClass,
    weight: f64,
    note: &'static str,
) -> SignalRule {
    SignalRule {
        signal: signal.name(),
        failed,
        degraded: Some(degraded),
        weight,
        note,
    }
}

/// Health signals (the `signal` of a reason; docs/fault-taxonomy.md).
pub const SIGNALS: &[SignalRule] = &[
    sig(
        GpuLost,
        UncorrectableHardware,
        UncorrectableHardware,
        0.95,
        "the GPU is lost or needs a reset",
    ),
    sig(
        GpuCount,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "fewer GPUs than expected",
    ),
    sig(
        GpuRecoveryAction,
        UncorrectableHardware,
        CorrectableHardware,
        0.97,
        "the driver's own verdict on the GPU; it overrides per-XID guesses",
    ),
    sig(
        EccUncorrected,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "uncorrectable (double-bit) ECC errors",
    ),
    sig(
        EccCorrected,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "corrected ECC errors over their threshold",
    ),
    sig(
        PagesRetired,
        UncorrectableHardware,
        CorrectableHardware,
        0.85,
        "retired pages at the limit",
    ),
    sig(
        PagesRetirementPending,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "a page retirement waits for a reset",
    ),
    sig(
        RowsRemapFailure,
        UncorrectableHardware,
        UncorrectableHardware,
        0.9,
        "row remapping failed",
    ),
    sig(
        RowsRemapPending,
        CorrectableHardware,
        CorrectableHardware,
        0.7,
        "a row remap waits for a reset",
    ),
    sig(
        ClockEventReasons,
        CorrectableHardware,
        CorrectableHardware,
        0.5,
        "thermal or power slowdown",
    ),
    sig(
        PcieReplays,
        CorrectableHardware,
        CorrectableHardware,
        0.55,
        "PCIe replays over their limit",
    ),
    sig(
        PcieLink,
        CorrectableHardware,
        CorrectableHardware,
        0.55,
        "PCIe link below its maximum",
    ),
    sig(
        NvlinkState,
        UncorrectableHardware,
        CorrectableHardware,
        0.85,
        "an NVLink is down",
    ),
    sig(
        NvlinkReplay,
        UncorrectableHardware,
        CorrectableHardware,
        0.8,
        "NVLink replay errors",
    ),
    sig(
        NvlinkRecovery,
        UncorrectableHardware,
        CorrectableHardware,
        0.8,
        "NVLink recovery errors",
    ),
    sig(
        NvlinkCrc,
        CorrectableHardware,
        CorrectableHardware,
        0.55,
        "NVLink CRC errors over their threshold",
    ),
    sig(
        KmsgLink,
        Infrastructure,
        Infrastructure,
        0.75,
        "a NIC link is down",
    ),
    sig(
        NicLinkState,
        Infrastructure,
        Infrastructure,
        0.75,
        "a NIC or InfiniBand link is down",
    ),
    sig(
        NicLinkDowns,
        Infrastructure,
        Infrastructure,
        0.7,
        "a NIC or InfiniBand link flaps",
    ),
    sig(
        OomKill,
        Infrastructure,
        Infrastructure,
        0.5,
        "the kernel's OOM killer ran on this host",
    ),
    sig(
        HostMemory,
        Infrastructure,
        Infrastructure,
        0.45,
        "host memory is nearly exhausted",
    ),
    // DEGRADED is a warning that the next checkpoint may not fit: it cannot
    // have made a rank crash or hang in its step, and on a filesystem other
    // users can write (DEGRADED is all such a tier ever gets) a stranger
    // could fill it to turn every failure of another's job into the node's.
    // FAILED (the agent's own filesystem, nearly out) can fail a write.
    SignalRule {
        signal: TierDisk.name(),
        failed: Infrastructure,
        degraded: None,
        weight: 0.6,
        note: "the checkpoint tier is nearly full",
    },
    sig(
        TpuCoreError,
        TransientSoftware,
        TransientSoftware,
        0.6,
        "the TPU runtime reports a core error",
    ),
];

/// The rule for a health signal; signals not listed say little. What the
/// signal is comes from the one table of names
/// ([`crate::taxonomy::signals`]): `pcie.link_gen` is read under
/// `pcie.link`, `ib.link_state` under `.link_state`.
pub fn signal_rule(signal: &str) -> Option<&'static SignalRule> {
    match HealthSignal::of(signal) {
        // DCGM's failure reasons are their own table, next to the source.
        HealthSignal::Dcgm => crate::taxonomy::dcgm::rule_for_signal(signal),
        HealthSignal::Unknown => None,
        kind => SIGNALS.iter().find(|r| r.signal == kind.name()),
    }
}

/// An XID's class and weight (None for a follow-up XID, judged by the one
/// it follows). From the one XID table.
pub fn xid_verdict(code: u32) -> Option<(FaultClass, f64, &'static str)> {
    let rule = xid::rule(code);
    let (class, weight) = match rule.class {
        XidClass::User => (UserError, 0.6),
        XidClass::TransientSoftware => (TransientSoftware, 0.6),
        XidClass::CorrectableHardware => (CorrectableHardware, 0.7),
        XidClass::UncorrectableHardware => (UncorrectableHardware, 0.9),
        XidClass::FollowUp => return None,
        XidClass::Unclassified => (Unknown, 0.3),
    };
    Some((class, weight, rule.meaning))
}

/// Weight of the "same failure at the same step after a restart" rule.
pub const REPEAT_AT_STEP_WEIGHT: f64 = 0.9;
/// Weight of an application XID repeating on one GPU across steps or jobs.
pub const XID_REPEAT_WEIGHT: f64 = 0.75;
/// Weight of a hang of every local rank in the same collective.
pub const COLLECTIVE_HANG_WEIGHT: f64 = 0.6;
/// Weight of one rank hung alone while its peers progress.
pub const LONE_HANG_WEIGHT: f64 = 0.5;
/// Weight of a lone hang blocked in the kernel (uninterruptible sleep).
pub const KERNEL_BLOCKED_WEIGHT: f64 = 0.55;
/// Weight of a straggler's explained cause.
pub const STRAGGLER_WEIGHT: f64 = 0.6;

/// What an SDC suspect (`rank.sdc_suspect`) says, by the detector's basis.
#[derive(Debug, Clone, Copy)]
pub struct SdcRule {
    /// Rule name, shown in diagnoses and listed in the docs.
    pub name: &'static str,
    /// The class it points to.
    pub class: FaultClass,
    /// How strongly.
    pub weight: f64,
    /// Why, for a person.
    pub note: &'static str,
}

/// One rank departing from data-parallel peers that hold the same
/// parameters: the device computed wrong without saying so (Llama 3 saw 6
/// such in 54 days). A suspicion, not proof: the weight stays under an
/// XID's, so device evidence decides when there is any.
pub const SDC_PEERS: SdcRule = SdcRule {
    name: "sdc.departs_from_peers",
    class: UncorrectableHardware,
    weight: 0.55,
    note: "one rank's loss or gradient norm departs from its data-parallel peers': silent data corruption on its device suspected",
};

/// A NaN or Inf on one rank while its peers stay finite.
pub const SDC_NON_FINITE: SdcRule = SdcRule {
    name: "sdc.non_finite",
    class: UncorrectableHardware,
    weight: 0.5,
    note: "one rank's loss or gradient norm went NaN/Inf while its peers' stayed finite: silent data corruption on its device suspected",
};

/// A NaN or Inf on a rank with no peers to compare: as likely the model
/// diverging as the device.
pub const SDC_ALONE: SdcRule = SdcRule {
    name: "sdc.non_finite_alone",
    class: Unknown,
    weight: 0.3,
    note: "the rank's loss or gradient norm went NaN/Inf and no peer reported the same step: the model diverging or its device",
};

/// The rule for a suspect with the detector's `basis` (`rank.sdc_suspect`'s
/// `basis` field).
pub fn sdc_rule(basis: &str) -> SdcRule {
    match basis {
        "non_finite" => SDC_NON_FINITE,
        "non_finite_alone" => SDC_ALONE,
        _ => SDC_PEERS,
    }
}
