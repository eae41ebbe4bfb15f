//! What attribution produces: a diagnosis with its chain of evidence, and
//! the incident record that carries it and the decision.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::class::FaultClass;
use super::decision::Decision;

/// One link in the chain of evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// When the signal was seen.
    pub at: SystemTime,
    /// Where it came from: "rank", "nvml", "kmsg", "health", "history"...
    pub source: String,
    /// Stable signal name: "exit.signal", "exception", "xid"...
    pub signal: String,
    /// What it is about: "gpu3", "job/j1/rank/2".
    pub subject: String,
    /// The observed value.
    pub value: String,
    /// The class it points to on its own (None: context, not a verdict).
    pub points_to: Option<FaultClass>,
    /// How strongly, 0..1.
    pub weight: f64,
    /// What the rule made of it.
    pub note: String,
    /// The event it was read from (0: derived).
    pub event_id: u64,
}

/// The evidence sources the agent reads itself: the kernel log, NVML, the
/// health model (NVML, DCGM and the host sources as judged), its own
/// pre-restart gate, and its history of those. A source named by several
/// ("nvml+kmsg") counts when every one of them is here. Everything else is
/// what a rank said or did about itself (its exception, exit, SDC values,
/// heartbeats, hang positions) or what another party reported: believed
/// for the rank's own job, never for the node (docs/security.md, "What the
/// agent believes from a rank").
pub const AGENT_READ_SOURCES: &[&str] = &["kmsg", "nvml", "dcgm", "health", "gate", "history"];

/// The rule name of the evidence item that marks a hardware or
/// infrastructure verdict resting on a rank's word only.
pub const RANK_WORD_ONLY: &str = "belief.rank_word_only";

impl Evidence {
    /// True when the agent read this itself ([`AGENT_READ_SOURCES`]); false
    /// for a rank's word and for unknown sources.
    pub fn read_by_agent(&self) -> bool {
        !self.source.is_empty()
            && self
                .source
                .split('+')
                .all(|s| AGENT_READ_SOURCES.contains(&s))
    }
}

/// An incident's diagnosis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Whose fault.
    pub class: FaultClass,
    /// 0..1.
    pub confidence: f64,
    /// One sentence for a person.
    pub summary: String,
    /// The rule that decided (docs/fault-taxonomy.md lists them).
    pub rule: String,
    /// The evidence, the deciding items first.
    pub evidence: Vec<Evidence>,
}

impl Diagnosis {
    /// True when evidence the agent read itself supports the class: the
    /// condition for any node-level verdict (a cordon, a count toward the
    /// lemon rule or the circuit breaker). Computed from the evidence, so
    /// records from before the rule existed are judged the same way.
    pub fn corroborated(&self) -> bool {
        self.evidence
            .iter()
            .any(|e| e.points_to == Some(self.class) && e.weight > 0.0 && e.read_by_agent())
    }
}

/// One item of a launcher's evidence for a stop by its own rule
/// ([`IncidentKind::NoProgress`], [`IncidentKind::CordonShare`]): what it is
/// about, the signal, its value, and what the rule made of it. The launcher
/// sends it; the agent bounds it and records it as the incident's evidence.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopEvidence {
    /// "attempt/2", "host/node-b", "job".
    pub subject: String,
    /// "checkpoint.newest", "resumed_from", "host.cordoned", "job.hosts".
    pub signal: String,
    /// "30", "none".
    pub value: String,
    /// The rule's word on it.
    pub note: String,
}

/// What kind of trigger opened an incident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IncidentKind {
    /// A rank's process exited with a failure.
    Crash,
    /// A rank made no progress past its threshold.
    Hang,
    /// A device or the host failed, with or without a rank on it.
    Hardware,
    /// A rank is persistently slower than its peers.
    Straggler,
    /// A rank's reported loss or gradient norm departed from its peers' or
    /// went NaN/Inf: silent data corruption suspected.
    Sdc,
    /// The job's launcher ended it: restarts in a row did not advance its
    /// newest complete checkpoint (`--max-no-progress-restarts`, exit 88).
    NoProgress,
    /// The job's launcher ended it: too large a share of its hosts was
    /// cordoned (`--max-cordon-share`, exit 87).
    CordonShare,
}

impl IncidentKind {
    /// Snake-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            IncidentKind::Crash => "crash",
            IncidentKind::Hang => "hang",
            IncidentKind::Hardware => "hardware",
            IncidentKind::Straggler => "straggler",
            IncidentKind::Sdc => "sdc",
            IncidentKind::NoProgress => "no_progress",
            IncidentKind::CordonShare => "cordon_share",
        }
    }

    /// True for the stops a launcher decided by its own rule and reported
    /// (ReportJobStop): attribution never opens them, and its engine does
    /// not remember them (budgets and repeats are about failures).
    pub fn from_launcher(self) -> bool {
        matches!(self, IncidentKind::NoProgress | IncidentKind::CordonShare)
    }

    /// False for the launchers' stops ([`Self::from_launcher`]): they say
    /// how the job went, not that this node failed, so the node-level
    /// rules (lemon nodes) never count them against the node.
    pub fn charges_node(self) -> bool {
        !self.from_launcher()
    }

    /// True when the job cannot go on without a remediation.
    pub fn job_down(self) -> bool {
        matches!(self, IncidentKind::Crash | IncidentKind::Hang)
    }
}

/// An incident as stored, served and persisted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IncidentRecord {
    /// "inc-" and the id of the event that opened it.
    pub id: String,
    /// When it opened.
    pub opened_at: SystemTime,
    /// When its diagnosis or decision last changed.
    pub updated_at: SystemTime,
    /// The strongest kind among its triggers (a crash outranks a hardware
    /// event: the job is down).
    pub kind: IncidentKind,
    /// This node.
    pub host: String,
    /// The job (empty for a device with no rank on it).
    pub job: String,
    /// Ranks involved.
    pub ranks: Vec<u32>,
    /// Devices involved.
    pub devices: Vec<String>,
    /// The diagnosis.
    pub diagnosis: Diagnosis,
    /// The decision in force.
    pub decision: Option<Decision>,
    /// Earlier decisions, when later evidence changed the diagnosis.
    pub superseded: Vec<Decision>,
    /// The failure's signature, for the repeat rule ("exception:RuntimeError:...").
    pub signature: String,
    /// The step the failure happened at, when known.
    pub step: Option<u64>,
    /// The failed rank's exit status, when it exited with one.
    pub exit_code: Option<i32>,
    /// A hang whose culprit runs on another host: the ranks this host's
    /// ranks waited on ("rank 3 on host-b"). Not empty means this host is
    /// not charged: the lemon rule does not count it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waited_on: Vec<String>,
}
