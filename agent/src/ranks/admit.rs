//! What a rank says about itself, as use cases: its registration, its
//! leaving, and its exceptions.
//!
//! Why here and not at the gRPC edge: each is a decision about the
//! registry (who may hold a rank, whose registration wins, which step an
//! exception is booked at) that the edge had made inside its handlers. The
//! edge now decodes, calls one of these, and maps [`AdmitError`] to a
//! status; nothing here knows of protobuf or of the agent's state.

use std::path::PathBuf;
use std::sync::Arc;

use warden_core::events::EventBus;
use warden_core::fsafe::Owner;
use warden_core::signal::{RankException, RankRegistered, Signal};

use super::exit_watch;
use super::process::RankProcess;
use super::registry::{RankState, RegisterRequest, SharedRegistry};
use super::{RankKey, RegisterError};

/// Longest exception message kept (its start).
pub const MAX_EXCEPTION_MESSAGE: usize = 4096;
/// Longest traceback kept (its end: the innermost frames).
pub const MAX_TRACEBACK: usize = 16 * 1024;

/// A registration as the rank (or its launcher) declared it.
#[derive(Debug, Clone, Default)]
pub struct Declared {
    /// Job id.
    pub job_id: String,
    /// Global rank.
    pub global_rank: u32,
    /// Local rank.
    pub local_rank: u32,
    /// World size.
    pub world_size: u32,
    /// The pid it declared (its own getpid(), or a launcher's worker).
    pub pid: u32,
    /// Host it runs on.
    pub host: String,
    /// Slot layout it writes.
    pub layout_version: u32,
    /// Stack dump signal (0: none).
    pub stack_dump_signal: i32,
    /// The accelerators it drives, as it names them.
    pub devices: Vec<String>,
}

/// Who is calling, on the kernel's word (SO_PEERCRED).
#[derive(Debug, Clone)]
pub struct PeerCred {
    /// Its pid in the agent's PID namespace; None when not visible.
    pub pid: Option<u32>,
    /// Its uid and gid.
    pub owner: Owner,
    /// How refusals name it ("uid 1000 gid 1000 pid 42").
    pub name: String,
}

/// A registration taken.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// Its slot.
    pub slot_index: u32,
    /// Slot size in bytes.
    pub slot_size: u32,
    /// Generation to echo.
    pub generation: u64,
    /// Where to write a stack dump.
    pub stack_dump_path: PathBuf,
}

/// Why a rank's word was not taken.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// A field is missing or out of range.
    #[error("{0}")]
    Invalid(String),
    /// The declared process is not the caller's to register.
    #[error(
        "RegisterRank refused for {caller}: {reason} (rule: a rank registers only its own process, or a launcher its descendants, running as the caller's uid)"
    )]
    NotItsProcess {
        /// The caller, named.
        caller: String,
        /// What the kernel said.
        reason: String,
    },
    /// The rank registered itself; its launcher's registration comes late.
    #[error(
        "{key} (pid {pid}) registered itself; its launcher's registration does not replace the client's"
    )]
    ClientHolds {
        /// The rank.
        key: RankKey,
        /// Its pid.
        pid: u32,
    },
    /// The registry refused it.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// Deregistration of a rank that is not there under that generation.
    #[error(
        "{key} with generation {generation} is not registered (already left, or re-registered since)"
    )]
    NotRegistered {
        /// The rank.
        key: RankKey,
        /// The generation asked for.
        generation: u64,
    },
}

/// Registers a rank: checks the declared process against the caller (the
/// kernel's word, never the client's), keeps a client's own registration
/// from being replaced by its launcher's, registers it, watches its exit
/// through a pidfd, and publishes `rank.registered`.
///
/// The declared pid must be the caller itself or its descendant (a
/// launcher registering its workers) under the caller's uid, and is held by
/// a pidfd from here on, so the exit watch and any signal reach that
/// process and no other. It is right across PID namespaces (a node agent
/// with the host's PID namespace sees a pod's ranks under its own numbers).
/// A caller the agent cannot see (a sidecar without a shared process
/// namespace) is registered all the same with pid 0: watched through its
/// slot only, never signalled, and reported as component
/// ranks/pid_visibility.
pub fn register(
    handles: &exit_watch::Handles,
    max_world_size: u32,
    declared: Declared,
    caller: &PeerCred,
) -> Result<Admitted, AdmitError> {
    if declared.pid == 0 {
        return Err(AdmitError::Invalid(
            "invalid registration: pid must be set".into(),
        ));
    }
    if declared.world_size > max_world_size {
        return Err(AdmitError::Invalid(format!(
            "invalid registration: world_size {} is above ranks.max_world_size {max_world_size}",
            declared.world_size
        )));
    }
    let process = match caller.pid {
        Some(pid) => Some(
            RankProcess::verify(declared.pid, pid, caller.owner.uid).map_err(|e| {
                AdmitError::NotItsProcess {
                    caller: caller.name.clone(),
                    reason: e.to_string(),
                }
            })?,
        ),
        None => None,
    };
    let request = RegisterRequest {
        job_id: declared.job_id,
        global_rank: declared.global_rank,
        local_rank: declared.local_rank,
        world_size: declared.world_size,
        pid: process.as_ref().map_or(0, |p| p.pid),
        declared_pid: declared.pid,
        host: declared.host,
        layout_version: declared.layout_version,
        stack_dump_signal: declared.stack_dump_signal,
        devices: declared.devices,
        process: process.clone(),
        caller_pid: caller.pid,
        owner: Some(caller.owner),
    };
    let key = RankKey {
        job: request.job_id.clone(),
        rank: request.global_rank,
    };
    let now = warden_slot::clock::syscall_now();
    // Who registered: the process itself (a client), or its launcher on its
    // behalf (`warden run` registers every worker, so a script that never
    // imports warden is still watched).
    let by_self = process.as_ref().is_none_or(|p| caller.pid == Some(p.pid));
    let reg = {
        let mut registry = handles.registry.lock();
        // The client's own registration takes over its launcher's (the same
        // pid registering again replaces it), never the other way round: a
        // launcher's registration that comes late must not take the slot
        // of a client that registered itself.
        let own = registry.ranks.get(&key).is_some_and(|e| {
            !by_self
                && e.pid == request.pid
                && e.registered_by == Some(e.pid)
                && matches!(e.state, RankState::Running | RankState::Hung)
        });
        if own {
            return Err(AdmitError::ClientHolds {
                key,
                pid: request.pid,
            });
        }
        registry.register(&request, now)?
    };
    if let Some(p) = &process {
        exit_watch::spawn(handles.clone(), key.clone(), reg.generation, p);
    }
    handles
        .events
        .publish(Signal::RankRegistered(RankRegistered {
            key,
            pid: request.pid,
            declared_pid: declared.pid,
            local_rank: request.local_rank,
            world_size: request.world_size,
            host: request.host,
            slot: reg.slot_index,
            declared_devices: request.devices,
            replaced_pid: reg.replaced_pid,
            by_self,
        }));
    Ok(Admitted {
        slot_index: reg.slot_index,
        slot_size: reg.slot_size,
        generation: reg.generation,
        stack_dump_path: reg.stack_dump_path,
    })
}

/// Takes rank `key` (registration `generation`) out of the registry and
/// publishes `rank.deregistered`; a rank not there under that generation
/// (already left, or registered again since) is refused.
pub fn deregister(
    registry: &SharedRegistry,
    events: &EventBus,
    key: RankKey,
    generation: u64,
) -> Result<(), AdmitError> {
    if !registry.lock().deregister(&key, generation) {
        return Err(AdmitError::NotRegistered { key, generation });
    }
    events.publish(Signal::RankDeregistered { key });
    Ok(())
}

/// An exception a rank (or its launcher, from what a worker printed)
/// reports.
#[derive(Debug, Clone)]
pub struct Reported {
    /// The rank.
    pub key: RankKey,
    /// The exception's type (`RuntimeError`).
    pub exception_type: String,
    /// Its message.
    pub message: String,
    /// Its traceback.
    pub traceback: String,
    /// The step it was raised at, as the rank said.
    pub step: u64,
    /// The reporting process.
    pub pid: u32,
    /// The rank's registration generation.
    pub generation: u64,
    /// Whether nothing caught it.
    pub uncaught: bool,
    /// Whether the rank waits for the agent's answer.
    pub awaits_decision: bool,
}

/// Publishes `rank.exception` for what a rank reported: the message and
/// traceback bounded (a traceback of a deep recursion is megabytes; its
/// end, the innermost frames, says what failed), the step dropped when a
/// launcher reported for a worker (`launcher_only`: zero-code mode has no
/// step to give).
/// Returns whether the rank waits for a decision the caller should make
/// next (never for an uncaught exception), after this event.
pub fn report_exception(events: &Arc<EventBus>, launcher_only: bool, r: Reported) -> bool {
    let awaits_decision = r.awaits_decision && !r.uncaught;
    events.publish(Signal::RankException(RankException {
        key: r.key,
        exception_type: r.exception_type,
        message: clip_head(&r.message, MAX_EXCEPTION_MESSAGE),
        step: (!launcher_only).then_some(r.step),
        pid: r.pid,
        generation: r.generation,
        uncaught: r.uncaught,
        traceback: clip_tail(&r.traceback, MAX_TRACEBACK),
        awaits_decision: r.awaits_decision,
    }));
    awaits_decision
}

/// The first `max` bytes of `s`, cut at a character boundary.
pub fn clip_head(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... [{} bytes cut]", &s[..end], s.len() - end)
}

/// The last `max` bytes of `s`, cut at a character boundary.
fn clip_tail(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("[{start} bytes cut] ...{}", &s[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_keeps_the_head_or_the_tail_at_a_character_boundary() {
        assert_eq!(clip_head("short", 10), "short");
        // "é" is two bytes: a cut inside it moves before it.
        assert_eq!(clip_head("aé", 2), "a... [2 bytes cut]");
        assert_eq!(clip_tail("éb", 2), "[2 bytes cut] ...b");
        assert_eq!(clip_tail("abcdef", 3), "[3 bytes cut] ...def");
    }
}
