//! The parts of configuration every stage shares: the error that names the
//! offending key, the duration format, the TOML parser that reports a key's
//! dotted path, and the `[hang]` table the hang detector reads.
//!
//! The whole `wardend` config (`warden_agent::config::Config`) gathers each
//! stage's table; those of the stages in this crate (attribution, policy,
//! straggler, hang) live here so the core needs nothing from the agent.

pub mod duration;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Why a configuration could not be used. Every variant names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read at all.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file we tried.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not valid TOML, or a key is unknown or has the wrong type.
    #[error("{origin}: key `{key}`: {message}")]
    Parse {
        /// Where the TOML came from.
        origin: String,
        /// Dotted path of the key, or `(document)` for a syntax error.
        key: String,
        /// The parser's own words (with line and column where it gave them).
        message: String,
    },
    /// The key parsed but its value is not acceptable.
    #[error("{origin}: key `{key}` = {value}: {why}")]
    Invalid {
        /// Where the TOML came from.
        origin: String,
        /// Dotted path of the key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// Why it was refused and what is accepted.
        why: String,
    },
}

impl ConfigError {
    /// [`ConfigError::Invalid`]: `key` of the config from `origin` has
    /// `value`, refused for `why`. Every stage's `validate` says it so.
    pub fn invalid(origin: &str, key: &'static str, value: String, why: &str) -> Self {
        Self::Invalid {
            origin: origin.to_owned(),
            key,
            value,
            why: why.to_owned(),
        }
    }

    /// The refusals of one config's `validate`: [`ConfigError::invalid`]
    /// with its `origin` given once, so a validator names only the key,
    /// the value and why.
    pub fn invalid_in(origin: &str) -> impl Fn(&'static str, String, &str) -> Self + '_ {
        move |key, value, why| Self::invalid(origin, key, value, why)
    }
}

/// `[hang]`: when a rank with no progress is declared hung.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HangConfig {
    /// Derive each section's timeout from the job's observed durations of it.
    pub calibrate: bool,
    /// Calibrated timeout = multiplier x the percentile of recent durations.
    pub multiplier: f64,
    /// The percentile (0-100) of recent durations the multiplier applies to.
    pub percentile: f64,
    /// A calibrated timeout is never shorter than this (GC pauses, hiccups).
    #[serde(with = "duration")]
    pub floor: Duration,
    /// Durations of a section needed before its calibrated timeout applies.
    pub warmup_samples: usize,
    /// Durations kept per section and job (and persisted in the state dir).
    pub history: usize,
    /// Timeout before the first step (imports, process-group set-up).
    #[serde(with = "duration")]
    pub init_timeout: Duration,
    /// Timeout of a "checkpoint" section until it is calibrated.
    #[serde(with = "duration")]
    pub checkpoint_timeout: Duration,
    /// Timeout of a "heal" section until it is calibrated: a restart
    /// attempt's regrouping and heal from a live replica, where the
    /// survivors wait for their replacement (`warden.heal`); and of
    /// "restart", where the agent puts a rank it asked to restart in
    /// process until it steps again (its teardown and re-initialisation);
    /// and of "heal_wait" always (never calibrated), where the Python
    /// client awaits a lost peer's heal.
    #[serde(with = "duration")]
    pub heal_timeout: Duration,
    /// Timeout of any other section until it is calibrated.
    #[serde(with = "duration")]
    pub default_timeout: Duration,
    /// Fixed timeouts per section name ("init", "idle", "step", "forward",
    /// "checkpoint", a user section...), overriding calibration.
    #[serde(with = "duration::map")]
    pub timeouts: std::collections::BTreeMap<String, Duration>,
    /// Ask a hung rank for a stack dump of all its threads and attach it.
    pub stack_dump: bool,
    /// How long to wait for the stack dump to be written.
    #[serde(with = "duration")]
    pub stack_dump_wait: Duration,
    /// How long a hang's job-wide verdict waits for every rank's position
    /// (the other hosts' snapshots, over the straggler peer exchange)
    /// before it judges with what it has and names the ranks not heard.
    #[serde(with = "duration")]
    pub verdict_wait: Duration,
}

impl Default for HangConfig {
    fn default() -> Self {
        Self {
            calibrate: true,
            multiplier: 3.0,
            percentile: 99.0,
            floor: Duration::from_secs(3),
            warmup_samples: 5,
            history: 256,
            init_timeout: Duration::from_secs(15 * 60),
            checkpoint_timeout: Duration::from_secs(30 * 60),
            heal_timeout: Duration::from_secs(2 * 60),
            default_timeout: Duration::from_secs(10 * 60),
            timeouts: std::collections::BTreeMap::new(),
            stack_dump: true,
            stack_dump_wait: Duration::from_secs(2),
            verdict_wait: Duration::from_secs(5),
        }
    }
}

/// Parses TOML into `T` (config, scenario files). On failure: the dotted
/// path of the offending key (`(document)` for a syntax error) and the
/// parser's message on one line.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, (String, String)> {
    let de = toml::Deserializer::parse(text)
        .map_err(|e| ("(document)".to_owned(), one_line(&e.to_string())))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        (
            if key == "." { "(document)".into() } else { key },
            one_line(&e.into_inner().to_string()),
        )
    })
}

/// Whether `addr` is an IP socket address on the unspecified IP
/// (`0.0.0.0:P`, `[::]:P`): a listener's, not one a peer can name.
pub fn unspecified_addr(addr: &str) -> bool {
    addr.parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().is_unspecified())
}

/// A peer agent's address as `[straggler] peers` and `[[checkpoint.peers]]`
/// take it: `host:port` with a port, an IP address or a name resolved at
/// connect (no scheme: the agents speak plain gRPC to each other).
pub fn valid_peer_addr(p: &str) -> bool {
    if p.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    match p.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        }
        None => false,
    }
}

/// TOML parser messages span several lines (a caret under the column); one
/// line reads better in logs and in systemd's status.
fn one_line(s: &str) -> String {
    // Drop the source excerpt and caret lines ("2 | key = 1", "  |   ^^^").
    s.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.contains('|'))
        .collect::<Vec<_>>()
        .join(": ")
}
