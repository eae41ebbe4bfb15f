//! Why a call to a peer agent brought no answer, in the checkpoint flow's
//! terms. Its own module so that the flow's stages (the collector's ask,
//! restores) name it without importing the transport ([`super::link`]),
//! which imports them.

use std::time::Duration;

/// Why a call to a peer brought no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// It answered with an error: its message.
    Refused(String),
    /// It does not know the call (UNIMPLEMENTED: an agent from before it).
    Unsupported(String),
    /// No answer within this long.
    Silent(Duration),
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) => f.write_str(why),
            Self::Unsupported(why) => write!(f, "it does not know the call: {why}"),
            Self::Silent(d) => write!(f, "no answer within {}", humantime::format_duration(*d)),
        }
    }
}
