//! Fault classes: whose fault an incident is, which decides what may help.

use serde::{Deserialize, Serialize};

/// Whose fault an incident is (docs/fault-taxonomy.md). The order is the
/// order of precedence when rules disagree at equal confidence: a hardware
/// verdict outranks a software one, since restarting onto bad hardware
/// wastes the restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultClass {
    /// Not enough evidence to say.
    Unknown,
    /// The training code or its inputs: a restart fails the same way.
    UserError,
    /// Software outside the user's code or a passing condition: a restart
    /// usually clears it.
    TransientSoftware,
    /// Hardware that saw an error and handled it; the node works, degraded.
    CorrectableHardware,
    /// The network, fabric, host or cluster around the job.
    Infrastructure,
    /// Hardware that cannot go on without a reset or repair.
    UncorrectableHardware,
}

impl FaultClass {
    /// Every class, for tables and config validation.
    pub const ALL: [FaultClass; 6] = [
        FaultClass::UserError,
        FaultClass::TransientSoftware,
        FaultClass::CorrectableHardware,
        FaultClass::UncorrectableHardware,
        FaultClass::Infrastructure,
        FaultClass::Unknown,
    ];

    /// Snake-case name, as config, events and JSON spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultClass::UserError => "user_error",
            FaultClass::TransientSoftware => "transient_software",
            FaultClass::CorrectableHardware => "correctable_hardware",
            FaultClass::UncorrectableHardware => "uncorrectable_hardware",
            FaultClass::Infrastructure => "infrastructure",
            FaultClass::Unknown => "unknown",
        }
    }

    /// True for the classes that put the node itself in doubt.
    pub fn is_hardware(self) -> bool {
        matches!(
            self,
            FaultClass::CorrectableHardware | FaultClass::UncorrectableHardware
        )
    }
}

impl std::fmt::Display for FaultClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
