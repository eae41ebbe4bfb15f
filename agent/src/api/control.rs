//! RequestRestart, Control and AckControl: in-process restarts at the API
//! edge. The work is [`crate::act::in_process`]'s; this module turns its
//! requests and errors into protobuf messages and gRPC statuses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use warden_proto::v1 as pb;

use super::streams::BoxStream;
use crate::act::in_process::{self, ControlError, DumpRequest, RankRequest, RestartError};
use crate::ranks::RankKey;
use crate::state::AgentState;

/// Longest reason kept from a request (its start).
const MAX_REASON: usize = 1024;

fn status_of_restart(e: RestartError) -> Status {
    match e {
        RestartError::EmptyJob => Status::invalid_argument(e.to_string()),
        RestartError::NoLiveRanks { .. } => Status::not_found(e.to_string()),
    }
}

fn status_of_control(e: ControlError) -> Status {
    match e {
        ControlError::UnknownRank { .. } => Status::not_found(e.to_string()),
        ControlError::StaleGeneration { .. } | ControlError::NotLive { .. } => {
            Status::failed_precondition(e.to_string())
        }
    }
}

/// RequestRestart: asks every live local rank of the job to restart in
/// process, as a `restart_in_process` decision does. `NOT_FOUND` when the
/// job has no live rank here, unless the caller starts them again itself
/// (`replacing`: the restart is then recorded with no rank asked).
pub async fn request_restart(
    state: &Arc<AgentState>,
    req: pb::RequestRestartRequest,
) -> Result<pb::RequestRestartResponse, Status> {
    let mut reason = req.reason;
    if reason.is_empty() {
        reason = "asked through RequestRestart".to_owned();
    }
    let reason = clip(&reason, MAX_REASON);
    let ask = if req.replacing {
        in_process::request_replacing
    } else {
        in_process::request
    };
    let asked = ask(&state.in_process(), &req.job_id, &reason, &req.incident_id)
        .map_err(status_of_restart)?;
    Ok(pb::RequestRestartResponse {
        ranks: asked.ranks,
        seq: asked.seq,
        restart_count: asked.restart_count,
    })
}

/// The message a rank's stream sends for a request.
fn message(r: &RankRequest) -> pb::ControlMessage {
    pb::ControlMessage {
        kind: pb::control_message::Kind::Restart as i32,
        seq: r.request.seq,
        restart_count: r.request.restart_count,
        incident_id: r.request.incident.clone(),
        reason: r.request.reason.clone(),
        flight_recorder_path: String::new(),
    }
}

/// The message a rank's stream sends for a flight-recorder dump request.
fn dump_message(d: &DumpRequest) -> pb::ControlMessage {
    pb::ControlMessage {
        kind: pb::control_message::Kind::DumpFlightRecorder as i32,
        seq: d.seq,
        flight_recorder_path: d.path.display().to_string(),
        ..Default::default()
    }
}

/// The Control streams open now: one per registered rank. A rank needs
/// one; a second for the same rank (its client reconnecting while the
/// agent has not yet seen the first go) replaces the first, which ends.
/// So Control streams are bounded by the ranks registered, and one caller
/// cannot open thousands on one registration (issue 29: 80,000 took the
/// agent from 25 MB to 1.07 GB).
#[derive(Debug, Default)]
pub struct ControlStreams {
    next: AtomicU64,
    open: Mutex<HashMap<RankKey, (u64, CancellationToken)>>,
}

impl ControlStreams {
    /// Takes the rank's place, ending the stream that held it.
    fn claim(&self, key: &RankKey) -> (u64, CancellationToken) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        let old = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), (id, token.clone()));
        if let Some((_, old)) = old {
            old.cancel();
        }
        (id, token)
    }

    /// The stream `id` ended: frees the place if it still holds it.
    fn release(&self, key: &RankKey, id: u64) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.get(key).is_some_and(|(held, _)| *held == id) {
            open.remove(key);
        }
    }

    /// Control streams open now.
    pub fn open_now(&self) -> usize {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Control: a rank's stream of restart requests, the pending one first,
/// and of flight-recorder dump requests (`hang::flight`).
/// Ends when the agent stops, the client leaves, or the rank registers
/// again (a request for a newer generation). `FAILED_PRECONDITION` for a
/// stale generation, `NOT_FOUND` for a rank that is not registered.
pub async fn control(
    state: &Arc<AgentState>,
    req: pb::ControlRequest,
) -> Result<BoxStream<pb::ControlMessage>, Status> {
    control_in(state, None, req).await
}

/// As [`control`], holding the rank's one place in `streams`: a stream
/// already open for the rank ends.
pub async fn control_one_per_rank(
    state: &Arc<AgentState>,
    streams: &Arc<ControlStreams>,
    req: pb::ControlRequest,
) -> Result<BoxStream<pb::ControlMessage>, Status> {
    control_in(state, Some(streams), req).await
}

async fn control_in(
    state: &Arc<AgentState>,
    streams: Option<&Arc<ControlStreams>>,
    req: pb::ControlRequest,
) -> Result<BoxStream<pb::ControlMessage>, Status> {
    let key = RankKey {
        job: req.job_id,
        rank: req.global_rank,
    };
    let generation = req.generation;
    let handles = state.in_process();
    let mut rx = in_process::subscribe(&handles, &key, generation).map_err(status_of_control)?;
    let mut dumps =
        in_process::subscribe_dumps(&handles, &key, generation).map_err(status_of_control)?;
    let (tx, out) = mpsc::channel(4);
    let state = state.clone();
    let place = streams.map(|s| {
        let (id, token) = s.claim(&key);
        (s.clone(), id, token)
    });
    let replaced = place
        .as_ref()
        .map_or_else(CancellationToken::new, |(_, _, t)| t.clone());
    tokio::spawn(async move {
        serve_control(&state, &replaced, tx, &mut rx, &mut dumps, generation).await;
        if let Some((s, id, _)) = place {
            s.release(&key, id);
        }
    });
    Ok(Box::pin(ReceiverStream::new(out)))
}

/// The body of one Control stream, until it ends.
async fn serve_control(
    state: &AgentState,
    replaced: &CancellationToken,
    tx: mpsc::Sender<Result<pb::ControlMessage, Status>>,
    rx: &mut tokio::sync::watch::Receiver<Option<Arc<RankRequest>>>,
    dumps: &mut tokio::sync::watch::Receiver<Option<Arc<DumpRequest>>>,
    generation: u64,
) {
    let mut current = rx.borrow_and_update().clone();
    let mut dump = dumps.borrow_and_update().clone();
    loop {
        if let Some(d) = dump.take()
            && d.generation == generation
            && tx.send(Ok(dump_message(&d))).await.is_err()
        {
            return;
        }
        if let Some(r) = current.take() {
            if r.generation != generation {
                // Addressed to a later registration: this stream is stale.
                return;
            }
            if tx.send(Ok(message(&r))).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            () = replaced.cancelled() => return,
            () = tx.closed() => return,
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                current = rx.borrow_and_update().clone();
            }
            changed = dumps.changed() => {
                if changed.is_err() {
                    return;
                }
                dump = dumps.borrow_and_update().clone();
            }
        }
    }
}

/// AckControl: the rank raised `RestartRequested` and runs its training
/// function again. An acknowledgement of a request no longer in flight is
/// accepted and ignored; a stale generation is `FAILED_PRECONDITION`.
pub async fn ack_control(
    state: &Arc<AgentState>,
    req: pb::AckControlRequest,
) -> Result<pb::AckControlResponse, Status> {
    let key = RankKey {
        job: req.job_id,
        rank: req.global_rank,
    };
    in_process::ack(&state.in_process(), &key, req.generation, req.seq)
        .map_err(status_of_control)?;
    Ok(pb::AckControlResponse {})
}

/// The first `max` bytes of `s`, cut at a character boundary.
fn clip(s: &str, max: usize) -> String {
    warden_slot::truncate_utf8(s, max).to_owned()
}
