//! The background link to the agent: registration, the slot handed over and
//! swapped in, the checks that the agent is still there, the `Control`
//! stream, and re-registration with backoff.
//!
//! In: the client's options and its shared `Inner`, on a thread of its own
//! with a current-thread tokio runtime. Out: the hot path moved onto the
//! agent's slot (and back to the private one when the agent goes), the link
//! status, restart and flight-recorder requests handed to their callbacks,
//! acknowledgements sent. Never: block or fail the training thread; every
//! call to the agent is bounded ([`RPC_TIMEOUT`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use tonic::transport::Channel;
use warden_proto::v1::agent_client::AgentClient;
use warden_proto::v1::{
    AckControlRequest, ControlMessage, ControlRequest, DeregisterRankRequest, GetNodeHealthRequest,
    RegisterRankRequest,
};

use super::{Inner, offer_restart};
use crate::channel::{RPC_TIMEOUT, connect_channel};
use crate::clock;
use crate::mapping::SlotMapping;
use crate::restart::{self, RestartRequest, RestartVia};
use crate::slot::{ControlWord, LAYOUT_VERSION, Slot, SlotError, SlotWriter};

/// A registration the background thread holds.
struct Link {
    agent: AgentClient<Channel>,
    index: u32,
    generation: u64,
    slot: *mut Slot,
    stack_dump_path: Option<PathBuf>,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

pub(super) fn background(inner: Arc<Inner>, first: mpsc::SyncSender<()>) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            inner.set_status(|s| s.last_error = Some(format!("tokio runtime: {e}")));
            let _ = first.try_send(());
            return;
        }
    };
    rt.block_on(run(inner, first));
}

async fn sleep_or_stop(inner: &Inner, d: Duration) -> bool {
    if inner.stop.load(Ordering::Acquire) {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = inner.wake.notified() => {}
    }
    inner.stop.load(Ordering::Acquire)
}

async fn run(inner: Arc<Inner>, first: mpsc::SyncSender<()>) {
    let mut backoff = BACKOFF_MIN;
    let mut previous_slot = None;
    loop {
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        match register(&inner, previous_slot).await {
            Ok(mut link) => {
                backoff = BACKOFF_MIN;
                previous_slot = Some(link.index);
                inner.swap_to(link.slot);
                inner.connected.store(true, Ordering::Release);
                inner.set_status(|s| {
                    s.connected = true;
                    s.slot_index = Some(link.index);
                    s.generation = Some(link.generation);
                    s.stack_dump_path = link.stack_dump_path.clone();
                    s.registrations += 1;
                    s.last_error = None;
                });
                let _ = first.try_send(());
                let reason = watch(&inner, &mut link).await;
                // SAFETY: link.slot points into a mapping kept in inner.mappings.
                let ours = unsafe { &*link.slot }.writer_generation() == link.generation;
                detach(&inner, ours);
                match reason {
                    // Dying of an uncaught exception: the agent is to see the exit.
                    None if inner.exiting.load(Ordering::Acquire) => return,
                    None => {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            link.agent.deregister_rank(DeregisterRankRequest {
                                job_id: inner.opts.job_id.clone(),
                                global_rank: inner.opts.global_rank,
                                generation: link.generation,
                            }),
                        )
                        .await;
                        return;
                    }
                    Some(why) => inner.set_status(|s| s.last_error = Some(why)),
                }
            }
            Err(why) => {
                inner.set_status(|s| s.last_error = Some(why));
                let _ = first.try_send(());
                // Keep the TSC fit fresh while disconnected too: the state
                // written now is carried into the agent's slot later.
                clock::recalibrate();
                if sleep_or_stop(&inner, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Back to the private slot; the agent's mapping is retired (kept, made anonymous).
///
/// `trusted`: the slot still carries this client's own echoed generation,
/// so its contents are what the client wrote and are carried over. A slot
/// overwritten by someone else is not copied: the private slot starts clean
/// (the next step_begin fills it again) rather than import garbage.
fn detach(inner: &Inner, trusted: bool) {
    inner.connected.store(false, Ordering::Release);
    if trusted {
        inner.swap_to(inner.dummy_ptr());
    } else {
        // The private slot is idle while the hot path writes the agent's.
        let _names = inner.names.guard();
        inner.dummy.reset_client_area();
        inner.names.write_all(&inner.dummy);
        inner.current.store(inner.dummy_ptr(), Ordering::Release);
    }
    inner.set_status(|s| {
        s.connected = false;
        s.slot_index = None;
        s.generation = None;
        s.stack_dump_path = None;
    });
    for m in inner.mappings().iter_mut() {
        m.retire();
    }
}

async fn register(inner: &Inner, previous_slot: Option<u32>) -> Result<Link, String> {
    let opts = &inner.opts;
    let channel = connect_channel(opts.socket_path.clone())
        .await
        .map_err(|e| format!("connect {}: {e}", opts.socket_path.display()))?;
    let mut agent = AgentClient::new(channel);
    let resp = agent
        .register_rank(RegisterRankRequest {
            job_id: opts.job_id.clone(),
            global_rank: opts.global_rank,
            local_rank: opts.local_rank,
            world_size: opts.world_size,
            pid: std::process::id(),
            host: hostname(),
            slot_layout_version: LAYOUT_VERSION,
            previous_slot,
            stack_dump_signal: opts.stack_dump_signal,
            devices: opts.devices.clone(),
        })
        .await
        .map_err(|s| format!("RegisterRank: {}: {}", s.code(), s.message()))?
        .into_inner();
    if resp.slot_size as usize != crate::slot::SLOT_SIZE {
        return Err(format!(
            "agent slot size {} differs from this client's {}",
            resp.slot_size,
            crate::slot::SLOT_SIZE
        ));
    }
    // The slot memory comes over the slot socket beside the API socket:
    // the agent hands it only to this process (SO_PEERCRED), sealed so no
    // one can truncate it under us. If this fails the rank trains on in
    // its private slot and registers again after the backoff.
    let slot_socket = crate::slot_socket::socket_path(&opts.socket_path);
    let generation = resp.generation;
    let fd = tokio::task::spawn_blocking(move || {
        crate::slot_socket::fetch(&slot_socket, generation, RPC_TIMEOUT)
    })
    .await
    .map_err(|e| format!("slot socket: {e}"))?
    .map_err(|e| e.to_string())?;
    let mapping = SlotMapping::from_fd(fd).map_err(|e: SlotError| e.to_string())?;
    let slot = mapping.slot();
    if !slot.is_claimed() || slot.generation() != resp.generation {
        return Err(format!(
            "slot {} carries generation {}, the agent said {}",
            resp.slot_index,
            slot.generation(),
            resp.generation
        ));
    }
    slot.attach_writer(resp.generation, std::process::id());
    let ptr = mapping.slot_ptr();
    inner.mappings().push(mapping);
    Ok(Link {
        agent,
        index: resp.slot_index,
        generation: resp.generation,
        slot: ptr,
        stack_dump_path: (!resp.stack_dump_path.is_empty())
            .then(|| PathBuf::from(&resp.stack_dump_path)),
    })
}

/// How long a broken `Control` stream waits before it is opened again.
const CONTROL_RETRY: Duration = Duration::from_secs(1);

/// The rank's `Control` stream on the current link.
struct ControlLink {
    stream: Option<tonic::Streaming<ControlMessage>>,
    /// When to open it (again); `None`: never, the agent does not serve it.
    reopen_at: Option<tokio::time::Instant>,
}

impl ControlLink {
    /// The next message, or never when the stream is not open.
    async fn next(&mut self) -> Result<Option<ControlMessage>, tonic::Status> {
        match self.stream.as_mut() {
            Some(s) => s.message().await,
            None => std::future::pending().await,
        }
    }

    /// When to open the stream (again), if it is closed and should be.
    fn reopen_at(&self) -> Option<tokio::time::Instant> {
        self.reopen_at.filter(|_| self.stream.is_none())
    }

    /// Opens the stream; on failure schedules the next try, or none when
    /// the agent does not serve `Control` (an older agent: the slot's
    /// control word still brings requests).
    ///
    /// `Some(reason)` when the agent does not know this registration: it was
    /// restarted (its registry starts empty) while the channel, which dials
    /// again by itself, hid that from every other call. The slot's memory
    /// outlives the agent that made it, so nothing else tells the client:
    /// it must register again.
    async fn open(&mut self, inner: &Inner, link: &Link) -> Option<String> {
        let mut agent = link.agent.clone();
        let call = agent.control(ControlRequest {
            job_id: inner.opts.job_id.clone(),
            global_rank: inner.opts.global_rank,
            generation: link.generation,
        });
        match tokio::time::timeout(RPC_TIMEOUT, call).await {
            Ok(Ok(resp)) => {
                self.stream = Some(resp.into_inner());
                self.reopen_at = None;
            }
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                self.stream = None;
                self.reopen_at = None;
            }
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => {
                self.retry_later();
                return Some(format!(
                    "the agent no longer knows this registration (restarted?): {}",
                    s.message()
                ));
            }
            _ => self.retry_later(),
        }
        None
    }

    fn retry_later(&mut self) {
        self.stream = None;
        self.reopen_at = Some(tokio::time::Instant::now() + CONTROL_RETRY);
    }
}

/// Sleeps until `at`; forever when `None`.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A restart request from a `Control` stream message (other kinds: none).
fn request_from_message(m: ControlMessage) -> Option<RestartRequest> {
    (m.kind == warden_proto::v1::control_message::Kind::Restart as i32).then_some(RestartRequest {
        seq: m.seq,
        restart_count: m.restart_count,
        incident_id: m.incident_id,
        reason: m.reason,
        via: RestartVia::Stream,
    })
}

/// A flight-recorder dump request from a `Control` stream message.
fn dump_from_message(m: &ControlMessage) -> Option<crate::flight::FlightRecorderDump> {
    (m.kind == warden_proto::v1::control_message::Kind::DumpFlightRecorder as i32).then(|| {
        crate::flight::FlightRecorderDump {
            seq: m.seq,
            path: PathBuf::from(&m.flight_recorder_path),
        }
    })
}

/// A restart request from the slot's control word, if it holds one.
fn request_from_slot(link: &Link) -> Option<RestartRequest> {
    // SAFETY: link.slot points into a mapping kept in inner.mappings.
    let word = SlotWriter::new(unsafe { &*link.slot }).control();
    ControlWord::decode(word).map(|w| RestartRequest {
        seq: u64::from(w.seq),
        restart_count: w.restart_count,
        incident_id: String::new(),
        reason: String::new(),
        via: RestartVia::Slot,
    })
}

/// Sends the queued acknowledgements as this registration (bounded; a
/// failed call is not retried: the slot's ack word already says it).
async fn send_acks(inner: &Inner, link: &Link) {
    for seq in inner.restart.take_acks() {
        let mut agent = link.agent.clone();
        let call = agent.ack_control(AckControlRequest {
            job_id: inner.opts.job_id.clone(),
            global_rank: inner.opts.global_rank,
            generation: link.generation,
            seq,
        });
        let _ = tokio::time::timeout(RPC_TIMEOUT, call).await;
    }
}

/// Returns `None` when asked to stop, `Some(reason)` when the agent is gone.
///
/// Meanwhile follows restart requests: the `Control` stream, the slot's
/// control word every [`restart::SLOT_POLL`], and the acknowledgements to send.
async fn watch(inner: &Inner, link: &mut Link) -> Option<String> {
    let mut tick: u64 = 0;
    let mut next_probe = tokio::time::Instant::now() + inner.opts.probe_interval;
    let mut poll = tokio::time::interval(restart::SLOT_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Acknowledgements queued under an earlier registration are moot: the
    // agent counts a rank that registered again as handled.
    let _ = inner.restart.take_acks();
    let mut control = ControlLink {
        stream: None,
        reopen_at: None,
    };
    // The request in the slot and when it was first seen there; the last
    // one handed over (the word stays set after the acknowledgement).
    let mut slot_seen: Option<(u64, tokio::time::Instant)> = None;
    let mut slot_taken = 0u64;
    if let Some(why) = control.open(inner, link).await {
        return Some(why);
    }
    loop {
        if inner.stop.load(Ordering::Acquire) {
            return None;
        }
        let reopen_at = control.reopen_at();
        tokio::select! {
            () = tokio::time::sleep_until(next_probe) => {
                next_probe = tokio::time::Instant::now() + inner.opts.probe_interval;
                tick += 1;
                if let Some(why) = probe(link, tick).await {
                    return Some(why);
                }
            }
            () = inner.wake.notified() => {}
            _ = poll.tick() => {
                if let Some(req) = request_from_slot(link).filter(|r| r.seq != slot_taken) {
                    // With the stream open, its copy (which carries the
                    // reason) normally lands within a millisecond: the slot's
                    // is taken once it has waited SLOT_GRACE, or at once
                    // without a stream.
                    let now = tokio::time::Instant::now();
                    let since = match slot_seen {
                        Some((seq, at)) if seq == req.seq => at,
                        _ => {
                            slot_seen = Some((req.seq, now));
                            now
                        }
                    };
                    if control.stream.is_none() || now - since >= restart::SLOT_GRACE {
                        slot_taken = req.seq;
                        offer_restart(inner, req);
                    }
                }
            }
            msg = control.next() => match msg {
                Ok(Some(m)) => {
                    if let Some(req) = dump_from_message(&m) {
                        inner.flight.offer(req, link.stack_dump_path.as_deref());
                    } else if let Some(req) = request_from_message(m) {
                        offer_restart(inner, req);
                    }
                }
                // Ended (agent stopping, stale registration) or broken.
                Ok(None) | Err(_) => control.retry_later(),
            },
            () = sleep_until_some(reopen_at) => {
                if let Some(why) = control.open(inner, link).await {
                    return Some(why);
                }
            }
            () = inner.restart.ack_wake.notified() => send_acks(inner, link).await,
        }
    }
}

/// One check that the agent is still there (see the module comment);
/// `Some(reason)` when it is not.
async fn probe(link: &mut Link, tick: u64) -> Option<String> {
    clock::recalibrate();
    // SAFETY: link.slot points into a mapping kept in inner.mappings.
    let slot = unsafe { &*link.slot };
    if !slot.is_claimed() || slot.generation() != link.generation {
        return Some(format!(
            "slot {} was released or handed to generation {}",
            link.index,
            slot.generation()
        ));
    }
    if tick.is_multiple_of(5) {
        let probe = link.agent.get_node_health(GetNodeHealthRequest {});
        match tokio::time::timeout(RPC_TIMEOUT, probe).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {}
            Ok(Err(s)) => {
                return Some(format!("GetNodeHealth: {}: {}", s.code(), s.message()));
            }
            Err(_) => return Some("GetNodeHealth timed out".to_owned()),
        }
    }
    None
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl Inner {
    /// Moves the hot path to `to`, carrying state and names over.
    pub(super) fn swap_to(&self, to: *mut Slot) {
        let _names = self.names.guard();
        let from = self.current.load(Ordering::Acquire);
        if from == to {
            return;
        }
        // SAFETY: both pointers are `dummy` or live mappings (see `writer`).
        let (from_ref, to_ref) = unsafe { (&*from, &*to) };
        to_ref.copy_client_state_from(from_ref);
        self.names.write_all(to_ref);
        self.current.store(to, Ordering::Release);
    }
}
