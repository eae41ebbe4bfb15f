//! The user's policy hook: an executable that may override a decision.
//!
//! Sites have knowledge warden lacks (a spare pool, a maintenance window, a
//! flaky rack), so `[policy.hook]` names a program that is shown each
//! diagnosis and may answer another action.
//!
//! Protocol, kept small so a ten-line shell or Python script can speak it:
//! - the hook is started with `command` as its argv and `WARDEN_HOOK=1` added
//!   to the agent's environment, in a process group of its own;
//! - it reads one JSON document (the diagnosis and the proposed decision,
//!   followed by a newline) on stdin, then EOF;
//! - it writes one JSON object on stdout, `{"action": "<name>", "reason":
//!   "..."}`, and exits 0. `{"action": "default"}`, `{}` or a missing or null
//!   `action` keep the proposed decision. Unknown fields are ignored;
//! - stderr is for its own diagnostics: a bounded tail is kept for the logs
//!   and for the error when the hook fails.
//!
//! Contract: [`ask`] always returns within the configured timeout (plus a
//! bounded grace to reap what it killed), never panics, and never leaves the
//! hook or the processes it started running after a failure: on timeout, on
//! an oversized answer or when the call itself is dropped, the hook's whole
//! process group is killed with SIGKILL. Every failure is a [`HookError`]
//! saying what went wrong; the caller then keeps the proposed decision.
//! A hook that exits 0 may leave a detached helper behind (a notifier with its
//! output redirected); it is not waited for. One that keeps the hook's stdout
//! or stderr open, though, holds the answer back until the timeout.

use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::Action;

/// Most bytes read from the hook's stdout: an answer is one small object, so
/// anything larger is a broken hook, and memory in the agent stays bounded.
pub const MAX_STDOUT: usize = 64 * 1024;
/// How much of the answer is kept as evidence in [`HookAnswer::raw`].
pub const RAW_KEEP: usize = 4 * 1024;
/// How much of the end of stderr is kept for logs and errors.
pub const STDERR_KEEP: usize = 1024;
/// How much of a bad answer is quoted in [`HookError::BadJson`].
const BAD_STDOUT_KEEP: usize = 1024;
/// Bounds on `policy.hook.timeout`: shorter cannot even start a process
/// reliably, longer holds a remediation back for too long.
const MIN_TIMEOUT: Duration = Duration::from_millis(10);
const MAX_TIMEOUT: Duration = Duration::from_secs(60);

/// `[policy.hook]`: the user's executable that may override decisions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HookConfig {
    /// The hook's argv: the executable (an absolute path, or a name looked
    /// up in `PATH`) and its arguments, e.g. `["/etc/warden/hook.py",
    /// "--site", "a"]`. Empty: no hook, warden's own decisions stand.
    pub command: Vec<String>,
    /// How long the hook may take to answer, from start to exit. Past it the
    /// hook's whole process group is killed and the proposed decision is
    /// kept. Between 10ms and 60s.
    #[serde(with = "crate::config::duration")]
    pub timeout: Duration,
}

impl Default for HookConfig {
    fn default() -> Self {
        Self {
            command: Vec::new(),
            timeout: Duration::from_secs(2),
        }
    }
}

impl HookConfig {
    /// True when a hook is configured: callers skip [`ask`] otherwise.
    pub fn is_enabled(&self) -> bool {
        !self.command.is_empty()
    }

    /// Checks the keys that need nothing but the config: the timeout's
    /// bounds and a named executable. The error names the key, the value and
    /// what is accepted. Whether the executable is there, runnable and safe
    /// to run is the agent's check (`warden_agent::policy::hook::check_program`),
    /// which reads the filesystem and `PATH`: core reads neither.
    pub fn validate(&self) -> Result<(), String> {
        if self.timeout < MIN_TIMEOUT || self.timeout > MAX_TIMEOUT {
            return Err(format!(
                "policy.hook.timeout = \"{}\": must be between 10ms and 60s",
                humantime::format_duration(self.timeout)
            ));
        }
        let Some(program) = self.command.first() else {
            return Ok(());
        };
        if program.is_empty() {
            return Err(
                "policy.hook.command[0] = \"\": must name the hook's executable \
                 (or leave policy.hook.command empty for no hook)"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// What the hook answered, with what is needed to record it as evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookAnswer {
    /// The action the hook chose; `None` keeps the proposed decision
    /// (`{"action": "default"}`, `{}`).
    pub action: Option<Action>,
    /// The hook's explanation, as given; may be empty. Shown with the
    /// decision so people see why the hook overrode warden.
    pub reason: String,
    /// The hook's stdout, clipped to [`RAW_KEEP`] bytes: what it really said,
    /// for the incident's evidence.
    pub raw: String,
    /// The end of the hook's stderr (at most [`STDERR_KEEP`] bytes), for the
    /// logs: a working hook may still have warnings worth seeing.
    pub stderr: String,
    /// From start to exit: a hook that gets slow shows up before it times
    /// out.
    pub took: Duration,
}

/// Why the hook gave no usable answer. Each message says what was wrong;
/// the caller keeps the proposed decision and records the error.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// [`ask`] was called with an empty `policy.hook.command`.
    #[error("no policy hook is configured (policy.hook.command is empty)")]
    NotConfigured,
    /// The executable could not be started (missing, not executable, bad
    /// interpreter line...).
    #[error("cannot start policy hook {command:?}: {source}")]
    Spawn {
        /// `command[0]`, as configured.
        command: String,
        /// What the OS said.
        source: io::Error,
    },
    /// No answer in time; the hook's process group was killed.
    #[error(
        "policy hook did not answer within {}: {}; its process group was killed{}",
        humantime::format_duration(*after),
        if *exited {
            "it exited, but a process it started kept its stdout or stderr open \
             (redirect the output of background commands)"
        } else {
            "it was still running"
        },
        stderr_suffix(stderr)
    )]
    Timeout {
        /// The configured timeout.
        after: Duration,
        /// Whether the hook itself had exited (a background process held its
        /// output open) or was still running.
        exited: bool,
        /// The end of what it wrote on stderr by then.
        stderr: String,
    },
    /// The hook exited non-zero or was killed by a signal: its answer, if
    /// any, does not count.
    #[error("policy hook failed ({status}){}", stderr_suffix(stderr))]
    Exit {
        /// Exit code or signal.
        status: ExitStatus,
        /// The end of its stderr (at most [`STDERR_KEEP`] bytes).
        stderr: String,
    },
    /// Stdout was not one JSON object.
    #[error(
        "policy hook's answer is not one JSON object like \
         {{\"action\": \"cordon\", \"reason\": \"...\"}}: {error}; stdout was {stdout:?}"
    )]
    BadJson {
        /// What was wrong with it.
        error: String,
        /// The start of its stdout.
        stdout: String,
    },
    /// The hook's file, or a directory above it, may be changed by a user
    /// other than root or the agent's (the agent's `policy::hook::check_trusted`): it
    /// is not run.
    #[error("policy hook not run: {0}")]
    Untrusted(String),
    /// The object's `action` is not an action warden knows.
    #[error("policy hook answered an unusable action: {why}")]
    BadAction {
        /// What was wrong, with the valid names.
        why: String,
    },
    /// More than [`MAX_STDOUT`] bytes on stdout; the hook was killed.
    #[error(
        "policy hook wrote more than {limit} bytes on stdout and was killed; \
         the answer must be one small JSON object"
    )]
    TooLarge {
        /// The limit that was passed.
        limit: usize,
    },
    /// Reading from or writing to the hook failed (other than the hook
    /// closing its stdin early, which is allowed).
    #[error("I/O error talking to the policy hook: {0}")]
    Io(#[from] io::Error),
}

/// `; stderr: "..."` when there is something on stderr.
fn stderr_suffix(stderr: &str) -> String {
    if stderr.is_empty() {
        String::new()
    } else {
        format!("; stderr: {stderr:?}")
    }
}

/// The start of `bytes` as text, at most `max` bytes, cut on a character
/// boundary and marked with `…` when cut.
pub fn head_text(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() <= max {
        return text.into_owned();
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Reads the answer: one JSON object with an optional string `action`
/// (`"default"` or absent: `None`) and an optional string `reason`.
pub fn parse_answer(stdout: &[u8]) -> Result<(Option<Action>, String), HookError> {
    let bad = |error: String| HookError::BadJson {
        error,
        stdout: head_text(stdout, BAD_STDOUT_KEEP),
    };
    if stdout.iter().all(u8::is_ascii_whitespace) {
        return Err(bad("the hook wrote nothing on stdout".into()));
    }
    // Through `Value` first: serde would also fill a struct from an array.
    let value: Value = serde_json::from_slice(stdout).map_err(|e| bad(e.to_string()))?;
    let Value::Object(map) = value else {
        return Err(bad(format!("expected a JSON object, got {value}")));
    };
    let action = match map.get("action") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "default" => None,
        Some(Value::String(s)) => {
            Some(s.parse::<Action>().map_err(|why| HookError::BadAction {
                why: format!("{why} (or \"default\" to keep the proposed decision)"),
            })?)
        }
        Some(other) => {
            return Err(HookError::BadAction {
                why: format!("\"action\" must be a string, got {other}"),
            });
        }
    };
    let reason = match map.get("reason") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(bad(format!("\"reason\" must be a string, got {other}"))),
    };
    Ok((action, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(argv: &[&str], timeout: Duration) -> HookConfig {
        HookConfig {
            command: argv.iter().map(|s| s.to_string()).collect(),
            timeout,
        }
    }

    #[test]
    fn config_from_toml() {
        let cfg: HookConfig =
            toml::from_str("command = [\"/bin/true\", \"-x\"]\ntimeout = \"500ms\"\n").unwrap();
        assert_eq!(cfg.command, ["/bin/true", "-x"]);
        assert_eq!(cfg.timeout, Duration::from_millis(500));
        cfg.validate().unwrap();

        let cfg: HookConfig = toml::from_str("").unwrap();
        assert_eq!(cfg, HookConfig::default());
        assert_eq!(cfg.timeout, Duration::from_secs(2));

        let e = toml::from_str::<HookConfig>("comand = []\n").unwrap_err();
        assert!(e.to_string().contains("comand"), "{e}");

        let text = toml::to_string(&HookConfig::default()).unwrap();
        assert_eq!(
            toml::from_str::<HookConfig>(&text).unwrap(),
            HookConfig::default()
        );
    }

    #[test]
    fn timeout_bounds_name_the_key() {
        for t in [Duration::from_millis(5), Duration::from_secs(61)] {
            let cfg = HookConfig {
                timeout: t,
                ..HookConfig::default()
            };
            let e = cfg.validate().unwrap_err();
            assert!(e.contains("policy.hook.timeout"), "{e}");
            assert!(e.contains("between 10ms and 60s"), "{e}");
        }
        let cfg = hook(&["sh"], Duration::from_secs(60));
        cfg.validate().unwrap();
    }
}
