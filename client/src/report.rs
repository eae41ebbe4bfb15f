//! Exception reports: what a rank tells the agent about an exception that is
//! about to end it (or one of its threads), sent as `ReportException`.
//!
//! In: an [`ExceptionReport`] and the registration it belongs to (job, rank,
//! generation, pid, filled in by [`crate::Client::report_exception`]). Out:
//! `Ok` once the agent has accepted it, or a [`ReportError`] saying why not.
//!
//! Contract: bounded. The caller is usually a dying process (Python's
//! excepthook, a C++ terminate handler), so a report never takes longer than
//! its deadline (`ConnectOptions::exception_report_timeout`, 1 s by default),
//! whatever the agent does, and never panics. A client that is not
//! registered returns at once without trying.
//!
//! Why a thread of its own per report: the caller may be on a thread that
//! runs a tokio runtime already (where `block_on` would panic), and the
//! client's background runtime belongs to its own thread. A short-lived
//! thread with a current-thread runtime opens a fresh connection on the
//! agent's socket (a local Unix socket: about a millisecond), sends the one
//! call, and hands the outcome back over a channel that the caller waits on
//! with the deadline. Should the agent stall, the caller leaves at the
//! deadline and the thread ends at its own (the same) timeout.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use warden_proto::v1::agent_client::AgentClient;
use warden_proto::v1::{Action, ReportExceptionRequest, ReportExceptionResponse};

use crate::slot::truncate_utf8;

/// An exception, as a rank reports it to the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExceptionReport {
    /// The exception's qualified type: "RuntimeError", "torch.OutOfMemoryError",
    /// "std::bad_alloc". Must not be empty.
    pub exception_type: String,
    /// Its message (`str(exc)` in Python).
    pub message: String,
    /// The formatted traceback, innermost frame last. Long ones are cut to
    /// their last [`MAX_TRACEBACK`] bytes: the innermost frames say what failed.
    pub traceback: String,
    /// The training step it happened in; `None`: the step the client's slot
    /// holds (the open step, or the last one), 0 when no step was ever begun.
    pub step: Option<u64>,
    /// True when nothing caught it: the process is about to exit because of
    /// it. The client then leaves its registration in place when it is
    /// closed (see [`crate::Client::report_exception`]).
    pub uncaught: bool,
}

/// The agent's answer to a report that awaits its decision
/// ([`crate::Client::report_exception_for_decision`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExceptionDecision {
    /// True: the exception is transient and every live rank of the job on
    /// this host was asked to restart in process (request [`Self::seq`]),
    /// this one included; false: the exception ends the rank.
    pub restart_in_process: bool,
    /// The in-process restart request's sequence number (0 without one).
    pub seq: u64,
    /// The exception rule that classified it ("" when none matched).
    pub rule: String,
    /// Why, for a person.
    pub reason: String,
}

impl From<ReportExceptionResponse> for ExceptionDecision {
    fn from(r: ReportExceptionResponse) -> Self {
        Self {
            restart_in_process: r.action == Action::RestartInProcess as i32,
            seq: r.seq,
            rule: r.rule,
            reason: r.reason,
        }
    }
}

/// Why a report did not reach the agent. Never raised into training code by
/// the Python package or the C ABI: they turn it into `False` / `-1`.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// `exception_type` is empty (the agent refuses such a report).
    #[error("the exception type must not be empty")]
    EmptyType,
    /// The client holds no registration: no agent, not yet, or no longer
    /// (and after `fork`, never: a child is not the rank).
    #[error("not registered with an agent: {0}")]
    NotRegistered(String),
    /// The thread that sends the report could not be started.
    #[error("cannot start the thread that sends the report: {0}")]
    Thread(std::io::Error),
    /// The report thread's tokio runtime could not be built.
    #[error("cannot build the report's tokio runtime: {0}")]
    Runtime(std::io::Error),
    /// The agent's socket did not accept a connection.
    #[error("connect {path}: {error}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// What went wrong.
        error: String,
    },
    /// The agent answered with an error.
    #[error("ReportException: {code}: {message}")]
    Rejected {
        /// The gRPC status code.
        code: tonic::Code,
        /// The agent's message.
        message: String,
    },
    /// No answer within the deadline.
    #[error("no answer from the agent within {0:?}")]
    TimedOut(Duration),
    /// The report thread ended without an answer (it cannot panic; kept so
    /// that the caller never has to assume).
    #[error("the report thread ended without an answer")]
    Lost,
}

/// Most bytes of a traceback sent (its end: the innermost frames). The agent
/// keeps the same amount.
pub const MAX_TRACEBACK: usize = 16 * 1024;

/// Most bytes of a message sent (its start). The agent keeps less (4 KiB)
/// and marks the cut; this bound only keeps a runaway message off the wire.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// The last `max` bytes of `s` (at most), starting on a char boundary.
pub(crate) fn tail_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut start = s.len() - max;
    while start < s.len() && !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The request for `report`, clipped to the wire bounds.
pub(crate) fn request(
    report: &ExceptionReport,
    job_id: &str,
    global_rank: u32,
    generation: u64,
    step: u64,
) -> ReportExceptionRequest {
    ReportExceptionRequest {
        job_id: job_id.to_owned(),
        global_rank,
        generation,
        pid: std::process::id(),
        exception_type: truncate_utf8(&report.exception_type, 1024).to_owned(),
        message: truncate_utf8(&report.message, MAX_MESSAGE).to_owned(),
        traceback: tail_utf8(&report.traceback, MAX_TRACEBACK).to_owned(),
        step,
        uncaught: report.uncaught,
        awaits_decision: false,
    }
}

/// Sends `req` to the agent on `socket`; returns within `deadline` whatever
/// happens (see the module's contract).
pub(crate) fn send(
    socket: PathBuf,
    req: ReportExceptionRequest,
    deadline: Duration,
) -> Result<ReportExceptionResponse, ReportError> {
    let started = Instant::now();
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("warden-report".to_owned())
        .spawn(move || {
            let _ = tx.send(send_on_this_thread(socket, req, deadline));
        })
        .map_err(ReportError::Thread)?;
    let left = deadline.saturating_sub(started.elapsed());
    match rx.recv_timeout(left) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(ReportError::TimedOut(deadline)),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(ReportError::Lost),
    }
}

fn send_on_this_thread(
    socket: PathBuf,
    req: ReportExceptionRequest,
    deadline: Duration,
) -> Result<ReportExceptionResponse, ReportError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ReportError::Runtime)?;
    rt.block_on(async move {
        let call = async {
            let channel = crate::channel::connect_channel(socket.clone())
                .await
                .map_err(|e| ReportError::Connect {
                    path: socket,
                    error: e.to_string(),
                })?;
            let answer = AgentClient::new(channel)
                .report_exception(req)
                .await
                .map_err(|s| ReportError::Rejected {
                    code: s.code(),
                    message: s.message().to_owned(),
                })?;
            Ok(answer.into_inner())
        };
        tokio::time::timeout(deadline, call)
            .await
            .unwrap_or(Err(ReportError::TimedOut(deadline)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_end_on_a_char_boundary() {
        assert_eq!(tail_utf8("abc", 5), "abc");
        assert_eq!(tail_utf8("abcdef", 3), "def");
        // "é" is two bytes: a cut inside it moves forward.
        assert_eq!(tail_utf8("aé", 1), "");
        assert_eq!(tail_utf8("aéb", 2), "b");
        assert_eq!(tail_utf8("aéb", 3), "éb");
    }

    #[test]
    fn request_is_clipped_to_the_wire_bounds() {
        let report = ExceptionReport {
            exception_type: "RuntimeError".into(),
            message: "m".repeat(MAX_MESSAGE + 10),
            traceback: format!("{}innermost", "x".repeat(MAX_TRACEBACK)),
            step: None,
            uncaught: true,
        };
        let r = request(&report, "j", 2, 7, 3);
        assert_eq!(r.message.len(), MAX_MESSAGE);
        assert_eq!(r.traceback.len(), MAX_TRACEBACK);
        assert!(r.traceback.ends_with("innermost"));
        assert_eq!(
            (r.job_id.as_str(), r.global_rank, r.generation),
            ("j", 2, 7)
        );
        assert_eq!((r.step, r.uncaught, r.pid), (3, true, std::process::id()));
    }

    #[test]
    fn a_socket_nobody_serves_fails_fast() {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let r = send(
            dir.path().join("nobody.sock"),
            ReportExceptionRequest::default(),
            Duration::from_secs(5),
        );
        assert!(matches!(r, Err(ReportError::Connect { .. })), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn a_listener_that_never_answers_is_left_at_the_deadline() {
        // Accepts the connection (the kernel does, via the backlog) but
        // never speaks HTTP/2: the report must give up at its deadline.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mute.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let t0 = Instant::now();
        let r = send(
            path,
            ReportExceptionRequest::default(),
            Duration::from_millis(300),
        );
        let took = t0.elapsed();
        assert!(matches!(r, Err(ReportError::TimedOut(_))), "{r:?}");
        assert!(took >= Duration::from_millis(250), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
    }
}
