//! What a producer says when it has no typed signal of its own: a
//! [`NewEvent`] (kind, subject, words, evidence) with its [`Severity`],
//! carried as [`super::Signal::Notice`]. Here, beside the signals, because
//! every signal renders into these words (`render.rs`); the bus
//! (`crate::events`) re-exports them.

/// How bad an event is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Routine: started, registered, recovered.
    Info,
    /// Needs attention, nothing failed yet.
    Warning,
    /// Something failed.
    Error,
    /// Something failed and work is lost or about to be.
    Critical,
}

impl Severity {
    /// Lower-case name, used as a metric label and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
            Severity::Critical => "critical",
        }
    }
}

/// An event as a producer describes it; the bus adds id and time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewEvent {
    /// How bad.
    pub severity: Severity,
    /// Dotted, stable kind: `agent.started`, `health.changed`, `rank.hang`.
    pub kind: &'static str,
    /// What it is about: a component id, `job/J/rank/R`, `agent`.
    pub subject: String,
    /// A sentence for a person.
    pub message: String,
    /// Evidence as ordered key/value pairs.
    pub evidence: Vec<(String, String)>,
}

impl NewEvent {
    /// Starts an event; add evidence with [`NewEvent::with`].
    pub fn new(
        severity: Severity,
        kind: &'static str,
        subject: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            severity,
            kind,
            subject: subject.into(),
            message: message.into(),
            evidence: Vec::new(),
        }
    }

    /// Adds one piece of evidence.
    pub fn with(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.evidence.push((key.into(), value.to_string()));
        self
    }
}
