//! The training-side client: registration, the hot path, and staying out of the way.
//!
//! A [`Client`] always has a slot to write into: the agent's (connected) or
//! a private in-process one (disconnected). The hot path loads one
//! `AtomicPtr` and does a few relaxed stores into whichever it points at, so
//! agent trouble never costs training anything and never raises.
//!
//! A background thread, owning a current-thread tokio runtime, registers
//! with the agent over its Unix socket (gRPC), receives its slot's sealed
//! memory over the slot socket beside it ([`crate::slot_socket`]), maps it, copies the
//! current state (step, open sections, step ring, names) into it and swaps
//! the pointer. It then checks every `probe_interval` that the agent is still
//! there: the slot still carries our generation and is claimed, and (every fifth check) a
//! `GetNodeHealth` call on the open channel succeeds (the cheapest
//! call: it does not touch the rank registry, so a node with many ranks
//! does not pay for their probes). That call cannot tell an agent that was
//! restarted (the channel dials the new one by itself, and the slot's sealed
//! memory outlives the agent that made it): the `Control` stream does. It
//! breaks when the agent goes, is opened again every second, and a new
//! agent answers `NOT_FOUND` for a registration it never made. On any failure it copies
//! the state back into the private slot, swaps, retires the mapping and
//! re-registers with backoff (100 ms doubling to 5 s), passing the slot it
//! had as `previous_slot`.
//!
//! While registered, the same thread also follows in-process restart
//! requests (see [`crate::restart`]): it opens the rank's `Control` stream
//! (again after each registration, and after a broken stream), reads the
//! slot's control word every [`restart::SLOT_POLL`], runs the callbacks
//! registered with [`Client::on_restart`] once per new request, and sends
//! the `AckControl` calls that [`Client::ack_restart`] queues.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::Notify;
use tonic::transport::{Channel, Endpoint, Uri};
use warden_proto::v1::agent_client::AgentClient;
use warden_proto::v1::{
    AckControlRequest, ControlMessage, ControlRequest, DeregisterRankRequest, GetNodeHealthRequest,
    RegisterRankRequest,
};

use crate::clock;
use crate::mapping::SlotMapping;
use crate::report::{self, ExceptionDecision, ExceptionReport, ReportError};
use crate::restart::{self, RestartCallback, RestartRequest, RestartState, RestartVia};
use crate::slot::{
    ControlWord, FIRST_USER_SECTION, LAYOUT_VERSION, MAX_SECTIONS, SECTION_OTHER, Slot, SlotError,
    SlotSnapshot, SlotWriter, well_known_id,
};

/// Errors from building a client's options. Agent trouble is never an error.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An environment variable holds something that is not a number.
    #[error("environment variable {var}={value:?} is not a valid {what}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        what: &'static str,
    },
    /// The job id is empty.
    #[error("job id must not be empty")]
    EmptyJobId,
    /// The world size is zero or a rank does not fit in it.
    #[error("rank {rank} is out of range for world size {world_size}")]
    BadRank {
        /// The global rank.
        rank: u32,
        /// The world size.
        world_size: u32,
    },
    /// The background thread could not be started.
    #[error("cannot start the client's background thread: {0}")]
    Thread(std::io::Error),
    /// A device name the agent would refuse (so the rank could never register).
    #[error("device name {name:?} {why}")]
    BadDevice {
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// More devices than the agent accepts for one rank.
    #[error("{count} devices named; at most {MAX_DEVICES}")]
    TooManyDevices {
        /// How many were named.
        count: usize,
    },
}

/// Most devices one rank may name; the agent refuses a registration with more.
pub const MAX_DEVICES: usize = 16;
/// Longest device name, in bytes; the agent refuses longer ones.
pub const MAX_DEVICE_NAME: usize = 128;

/// How to reach the agent and who this rank is.
///
/// Why a struct apart from the client: defaults come from the launcher's
/// environment, and C, Python and Rust callers override single fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The agent's socket (default: [`crate::paths::client_socket_path`]).
    pub socket_path: PathBuf,
    /// Job id (`WARDEN_JOB_ID`, else `TORCHELASTIC_RUN_ID`, else "default").
    pub job_id: String,
    /// Global rank (`RANK`, else 0).
    pub global_rank: u32,
    /// Rank on this host (`LOCAL_RANK`, else the global rank).
    pub local_rank: u32,
    /// Ranks in the job (`WORLD_SIZE`, else global rank + 1).
    pub world_size: u32,
    /// How long `connect` waits for the first registration attempt.
    pub connect_timeout: Duration,
    /// How often the background thread checks that the agent is still there.
    pub probe_interval: Duration,
    /// The signal on which this process writes a dump of all its threads'
    /// stacks to [`LinkStatus::stack_dump_path`], so the agent can attach it
    /// to a hang; 0 when the process has no such handler (plain Rust and C
    /// clients, unless they set `WARDEN_STACK_DUMP_SIGNAL` and handle it).
    /// The Python package sets it and installs faulthandler.
    pub stack_dump_signal: i32,
    /// The accelerators this rank drives ("gpu5", "GPU-8f3c...", "MIG-..."),
    /// sent at registration so the agent ties a GPU fault to the ranks it
    /// hurts and a rank's crash to its GPU. Empty: the agent assumes
    /// `gpu<local_rank>`, the torchrun convention. From the environment:
    /// see [`devices_from_env`].
    pub devices: Vec<String>,
    /// The most [`Client::report_exception`] may take, connect and answer
    /// included (default 1 s): a dying process must never hang on it.
    pub exception_report_timeout: Duration,
}

/// The default of [`ConnectOptions::exception_report_timeout`].
pub const EXCEPTION_REPORT_TIMEOUT: Duration = Duration::from_secs(1);

/// The devices a rank drives, from its environment (a pure function of the
/// variables, so a table of cases tests it).
///
/// - `WARDEN_DEVICES` (`warden_devices`), comma-separated, wins and is used
///   as given: the launcher or the user knows best (a rank driving several
///   GPUs, a UUID, a PCI bus id).
/// - Else `CUDA_VISIBLE_DEVICES` (`cuda_visible`) when set and not empty.
///   With several entries the rank drives the one at its `local_rank`: the
///   launcher gave every rank the node's list and each rank selects its own
///   device by local rank (`torch.cuda.set_device(local_rank)`), so entry
///   `local_rank` is the physical device behind it. With one entry, the
///   launcher pinned the rank to that device. A number `N` names the GPU
///   the agent calls `gpuN` (NVML's index; CUDA's numbering agrees under
///   `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and on nodes of identical GPUs); a UUID
///   (`GPU-...`, `MIG-...`) is kept as is, for the agent to match against
///   NVML's UUIDs, since it names the device whatever the order. A negative
///   entry (`-1`: "no GPU") or a local rank past the list's end names
///   nothing.
/// - Else nothing: the agent assumes `gpu<local_rank>`, which is right for
///   torchrun's one-process-per-GPU default without `CUDA_VISIBLE_DEVICES`.
///
/// Names the agent would refuse (empty, control characters, longer than
/// [`MAX_DEVICE_NAME`]) are dropped and at most [`MAX_DEVICES`] kept, so a
/// malformed variable costs the device attribution, never the registration.
pub fn devices_from_env(
    warden_devices: Option<&str>,
    cuda_visible: Option<&str>,
    local_rank: u32,
) -> Vec<String> {
    let names: Vec<String> = if let Some(list) = warden_devices.filter(|v| !v.trim().is_empty()) {
        list.split(',').map(|d| d.trim().to_owned()).collect()
    } else if let Some(list) = cuda_visible.filter(|v| !v.trim().is_empty()) {
        let entries: Vec<&str> = list.split(',').map(str::trim).collect();
        let mine = match entries.as_slice() {
            [one] => Some(*one),
            many => usize::try_from(local_rank)
                .ok()
                .and_then(|i| many.get(i).copied()),
        };
        match mine {
            Some(e) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
                // Leading zeros ("01") name the same GPU as "1".
                let n = e.trim_start_matches('0');
                vec![format!("gpu{}", if n.is_empty() { "0" } else { n })]
            }
            Some(e) if e.starts_with('-') => Vec::new(),
            Some(e) => vec![e.to_owned()],
            None => Vec::new(),
        }
    } else {
        Vec::new()
    };
    names
        .into_iter()
        .filter(|d| device_name_problem(d).is_none())
        .take(MAX_DEVICES)
        .collect()
}

/// Why the agent would refuse `name` as a device name, if it would.
fn device_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_DEVICE_NAME {
        Some("is longer than 128 bytes")
    } else if name.chars().any(char::is_control) {
        Some("holds control characters")
    } else {
        None
    }
}

/// [`devices_from_env`] of this process's environment.
fn env_devices(local_rank: u32) -> Vec<String> {
    let var = |v: &str| std::env::var(v).ok();
    devices_from_env(
        var("WARDEN_DEVICES").as_deref(),
        var("CUDA_VISIBLE_DEVICES").as_deref(),
        local_rank,
    )
}

fn env_u32(var: &'static str) -> Result<Option<u32>, ClientError> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().map(Some).map_err(|_| ClientError::BadEnv {
                var,
                value: v,
                what: "non-negative integer",
            })
        }
        _ => Ok(None),
    }
}

impl ConnectOptions {
    /// Options from the environment the launchers set (torchrun, `warden run`).
    ///
    /// A malformed variable is an error so the caller can report it; use
    /// [`ConnectOptions::from_env_lossy`] to fall back to defaults instead.
    pub fn from_env() -> Result<ConnectOptions, ClientError> {
        let job_id = ["WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "default".to_owned());
        let global_rank = env_u32("RANK")?.unwrap_or(0);
        let local_rank = env_u32("LOCAL_RANK")?.unwrap_or(global_rank);
        let world_size = env_u32("WORLD_SIZE")?.unwrap_or(global_rank.saturating_add(1));
        let stack_dump_signal = env_u32("WARDEN_STACK_DUMP_SIGNAL")?
            .and_then(|s| i32::try_from(s).ok())
            .unwrap_or(0);
        Ok(ConnectOptions {
            socket_path: crate::paths::client_socket_path(),
            job_id,
            global_rank,
            local_rank,
            world_size,
            connect_timeout: Duration::from_secs(1),
            probe_interval: Duration::from_secs(1),
            stack_dump_signal,
            devices: env_devices(local_rank),
            exception_report_timeout: EXCEPTION_REPORT_TIMEOUT,
        })
    }

    /// [`ConnectOptions::from_env`], with defaults for malformed variables.
    pub fn from_env_lossy() -> ConnectOptions {
        match Self::from_env() {
            Ok(o) => o,
            Err(_) => {
                let mut o = ConnectOptions {
                    socket_path: crate::paths::client_socket_path(),
                    job_id: "default".to_owned(),
                    global_rank: 0,
                    local_rank: 0,
                    world_size: 1,
                    connect_timeout: Duration::from_secs(1),
                    probe_interval: Duration::from_secs(1),
                    stack_dump_signal: 0,
                    devices: Vec::new(),
                    exception_report_timeout: EXCEPTION_REPORT_TIMEOUT,
                };
                // The local rank as far as it parses (else the global rank,
                // else 0, as from_env would have it).
                let local = env_u32("LOCAL_RANK")
                    .ok()
                    .flatten()
                    .or_else(|| env_u32("RANK").ok().flatten())
                    .unwrap_or(0);
                o.devices = env_devices(local);
                if let Some(j) = ["WARDEN_JOB_ID", "TORCHELASTIC_RUN_ID"]
                    .iter()
                    .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
                {
                    o.job_id = j;
                }
                o
            }
        }
    }

    /// Checks the fields that a caller may have set by hand.
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.job_id.is_empty() {
            return Err(ClientError::EmptyJobId);
        }
        if self.world_size == 0 || self.global_rank >= self.world_size {
            return Err(ClientError::BadRank {
                rank: self.global_rank,
                world_size: self.world_size,
            });
        }
        if self.devices.len() > MAX_DEVICES {
            return Err(ClientError::TooManyDevices {
                count: self.devices.len(),
            });
        }
        if let Some((name, why)) = self
            .devices
            .iter()
            .find_map(|d| device_name_problem(d).map(|why| (d, why)))
        {
            return Err(ClientError::BadDevice {
                name: name.clone(),
                why,
            });
        }
        Ok(())
    }
}

/// A section id, resolved once from a name, cheap to open and close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SectionId(u32);

impl SectionId {
    /// Wraps a raw id (ids out of range become "other").
    pub fn from_raw(id: u32) -> SectionId {
        if (id as usize) < MAX_SECTIONS {
            SectionId(id)
        } else {
            SectionId(SECTION_OTHER)
        }
    }

    /// The raw id written into the slot.
    pub fn get(self) -> u32 {
        self.0
    }
}

/// Process-wide name -> id table, so ids stay stable across slot swaps.
#[derive(Debug)]
struct Names {
    user: [OnceLock<Box<str>>; MAX_SECTIONS],
    /// Held to assign ids and to write names into a slot (also across swaps).
    lock: Mutex<()>,
}

impl Names {
    fn new() -> Names {
        Names {
            user: std::array::from_fn(|_| OnceLock::new()),
            lock: Mutex::new(()),
        }
    }

    /// Lock-free lookup: well-known names, then the user table in order.
    #[inline]
    fn lookup(&self, name: &str) -> Option<u32> {
        if let Some(id) = well_known_id(name) {
            return Some(id);
        }
        for (id, entry) in self
            .user
            .iter()
            .enumerate()
            .skip(FIRST_USER_SECTION as usize)
        {
            match entry.get() {
                Some(n) if **n == *name => return Some(id as u32),
                Some(_) => continue,
                None => return None,
            }
        }
        None
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        match self.lock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn write_all(&self, slot: &Slot) {
        for (id, entry) in self.user.iter().enumerate() {
            if let Some(n) = entry.get() {
                slot.write_name(id as u32, n);
            }
        }
    }
}

/// What a client knows about its link to the agent (for status and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkStatus {
    /// Whether the hot path writes into an agent's slot.
    pub connected: bool,
    /// The slot index, when connected.
    pub slot_index: Option<u32>,
    /// The generation the agent issued, when connected.
    pub generation: Option<u64>,
    /// Registrations that succeeded so far.
    pub registrations: u64,
    /// The last reason the client was or went disconnected.
    pub last_error: Option<String>,
    /// Where the agent wants stack dumps written, when connected.
    pub stack_dump_path: Option<PathBuf>,
}

#[derive(Debug)]
struct Inner {
    /// The slot the hot path writes: `dummy` or a live mapping's slot.
    current: AtomicPtr<Slot>,
    /// The private stand-in slot, used while no agent is there.
    dummy: Box<Slot>,
    names: Names,
    connected: AtomicBool,
    stop: AtomicBool,
    /// Set by a report of an uncaught exception: the process is about to
    /// exit because of it. Closing then leaves the registration in place,
    /// so the agent sees the exit (code, signal, with the exception before
    /// it) instead of a clean deregistration that would hide the crash
    /// (Python runs its atexit handlers, which close the client, after the
    /// excepthook).
    exiting: AtomicBool,
    wake: Notify,
    opts: ConnectOptions,
    /// Every mapping ever used: retired ones stay until the client is
    /// dropped so no pointer the hot path may still hold dangles.
    mappings: Mutex<Vec<SlotMapping>>,
    status: Mutex<LinkStatus>,
    /// In-process restart requests: the pending one, the callbacks, the
    /// acknowledgements still to send.
    restart: RestartState,
    /// Flight-recorder dump requests: the callbacks, the dump in progress.
    flight: crate::flight::FlightDumps,
}

impl Inner {
    #[inline(always)]
    fn writer(&self) -> SlotWriter<'_> {
        let p = self.current.load(Ordering::Acquire);
        // SAFETY: `current` only ever holds `dummy` (owned by self) or the
        // slot of a mapping in `mappings`, which are never unmapped before
        // self is dropped (retired ones are remapped anonymous, still valid).
        SlotWriter::new(unsafe { &*p })
    }

    fn set_status(&self, f: impl FnOnce(&mut LinkStatus)) {
        let mut g = match self.status.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g);
    }

    fn mappings(&self) -> MutexGuard<'_, Vec<SlotMapping>> {
        match self.mappings.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Moves the hot path to `to`, carrying state and names over.
    fn swap_to(&self, to: *mut Slot) {
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

    fn dummy_ptr(&self) -> *mut Slot {
        (&*self.dummy as *const Slot).cast_mut()
    }
}

/// The handle a training process holds: hot-path calls and lifecycle.
///
/// Why it never fails for agent trouble: the agent must never cost goodput,
/// so with no agent the client writes into a private slot and keeps trying.
/// Step and section calls must come from one thread at a time (the training
/// loop); `heartbeat` may be called from any thread.
#[derive(Debug)]
pub struct Client {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Client {
    /// Connects with options from the environment (malformed values fall back to defaults).
    pub fn connect() -> Client {
        let opts = ConnectOptions::from_env_lossy();
        match Self::connect_with(opts.clone()) {
            Ok(c) => c,
            // Only a thread spawn failure gets here: stay disconnected for good.
            Err(e) => Self::offline(opts, Some(e.to_string())),
        }
    }

    /// Connects with explicit options; errors only for invalid options.
    ///
    /// Waits up to `connect_timeout` for the first registration attempt, so a
    /// present agent is attached on return; an absent one is retried in the
    /// background.
    pub fn connect_with(opts: ConnectOptions) -> Result<Client, ClientError> {
        opts.validate()?;
        let _ = clock::now_ns();
        let client = Self::offline(opts, None);
        fork::track(&client.inner);
        let (tx, rx) = mpsc::sync_channel(1);
        let inner = client.inner.clone();
        let handle = std::thread::Builder::new()
            .name("warden-client".to_owned())
            .spawn(move || background(inner, tx))
            .map_err(ClientError::Thread)?;
        let timeout = client.inner.opts.connect_timeout;
        if let Ok(mut g) = client.thread.lock() {
            *g = Some(handle);
        }
        let _ = rx.recv_timeout(timeout);
        Ok(client)
    }

    /// A client that never connects: the no-agent mode, for tests and fallbacks.
    pub fn offline(opts: ConnectOptions, reason: Option<String>) -> Client {
        let dummy = Slot::new_boxed();
        let ptr = (&*dummy as *const Slot).cast_mut();
        Client {
            inner: Arc::new(Inner {
                current: AtomicPtr::new(ptr),
                dummy,
                names: Names::new(),
                connected: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                exiting: AtomicBool::new(false),
                wake: Notify::new(),
                opts,
                mappings: Mutex::new(Vec::new()),
                status: Mutex::new(LinkStatus {
                    last_error: reason,
                    ..LinkStatus::default()
                }),
                restart: RestartState::default(),
                flight: crate::flight::FlightDumps::default(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Whether heartbeats currently reach an agent.
    pub fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::Relaxed)
    }

    /// The link's state, for logs and diagnostics.
    pub fn status(&self) -> LinkStatus {
        match self.inner.status.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// A snapshot of the slot the hot path writes now (the agent's or the private one).
    ///
    /// Why: lets tests, the Python package and debugging tools see exactly
    /// what the agent would read, even with no agent.
    pub fn snapshot(&self) -> Result<SlotSnapshot, SlotError> {
        let _names = self.inner.names.guard();
        let p = self.inner.current.load(Ordering::Acquire);
        let index = self.status().slot_index.unwrap_or(0);
        // SAFETY: see `Inner::writer`.
        unsafe { &*p }.snapshot(index)
    }

    /// The options this client registered with.
    pub fn options(&self) -> &ConnectOptions {
        &self.inner.opts
    }

    /// Says "still alive": one load and one store.
    #[inline]
    pub fn heartbeat(&self) {
        self.inner.writer().heartbeat();
    }

    /// Marks the start of training step `step` (ends an open step first).
    #[inline]
    pub fn step_begin(&self, step: u64) {
        self.inner.writer().step_begin(step, clock::now_ns());
    }

    /// Marks the end of the open step, closing sections left open in it.
    #[inline]
    pub fn step_end(&self, step: u64) {
        self.inner.writer().step_end(step, clock::now_ns());
    }

    /// Reports this step's loss and gradient norm (`None`: not reported),
    /// for the agent's silent-data-corruption check, which compares them
    /// with the job's other ranks at the same step and flags NaN or Inf.
    ///
    /// Goes into the open step's record, or between steps into the step just
    /// ended. Costs what a section costs: no syscall, lock or allocation.
    #[inline]
    pub fn report_values(&self, loss: Option<f64>, grad_norm: Option<f64>) {
        self.inner.writer().report_values(loss, grad_norm);
    }

    /// The id for `name`, interning it on first use (takes a lock once per new name).
    ///
    /// Names past the table's capacity all map to "other".
    pub fn section_id(&self, name: &str) -> SectionId {
        if let Some(id) = self.inner.names.lookup(name) {
            return SectionId(id);
        }
        let _g = self.inner.names.guard();
        if let Some(id) = self.inner.names.lookup(name) {
            return SectionId(id);
        }
        let free = self
            .inner
            .names
            .user
            .iter()
            .enumerate()
            .skip(FIRST_USER_SECTION as usize)
            .find(|(_, e)| e.get().is_none());
        let Some((id, entry)) = free else {
            return SectionId(SECTION_OTHER);
        };
        let _ = entry.set(name.into());
        let p = self.inner.current.load(Ordering::Acquire);
        // SAFETY: see `Inner::writer`; the names lock keeps swaps out meanwhile.
        unsafe { &*p }.write_name(id as u32, name);
        SectionId(id as u32)
    }

    /// Opens the section `name` until the guard drops (no allocation after first use).
    #[inline]
    pub fn section(&self, name: &str) -> SectionGuard<'_> {
        let id = self.section_id(name);
        self.enter(id)
    }

    /// Opens section `id` until the guard drops.
    #[inline]
    pub fn enter(&self, id: SectionId) -> SectionGuard<'_> {
        self.section_open(id);
        SectionGuard { client: self, id }
    }

    /// Opens section `id` (for C and Python, which close explicitly).
    #[inline]
    pub fn section_open(&self, id: SectionId) {
        self.inner.writer().section_open(id.0, clock::now_ns());
    }

    /// Closes section `id` and any section opened inside it.
    #[inline]
    pub fn section_close(&self, id: SectionId) {
        self.inner.writer().section_close(id.0, clock::now_ns());
    }

    /// The raw control word the agent set in the slot (0 = none; decode
    /// with [`ControlWord::decode`]). Prefer [`Client::restart_pending`].
    pub fn control(&self) -> u64 {
        self.inner.writer().control()
    }

    /// The notice of a coming stop the agent set in the slot, if one
    /// stands: the rank should save at this step boundary and leave.
    ///
    /// Why from the slot: one atomic load, so a training loop may ask at
    /// every step; the agent stores the word again on every tick, so a
    /// rank that registered (or got a new slot) after the notice sees it
    /// within a tick. Without an agent (disconnected) nothing is noticed.
    /// Returns the notice and the step at whose boundary to save (every
    /// rank of the job is given the same one).
    #[inline]
    pub fn notice(&self) -> Option<(crate::slot::NoticeWord, u64)> {
        let (word, step) = self.inner.writer().notice();
        crate::slot::NoticeWord::decode(word).map(|n| (n, step))
    }

    /// Stores `value` into the slot's ack word as is. Prefer
    /// [`Client::ack_restart`], which also tells the agent over gRPC.
    pub fn ack(&self, value: u64) {
        self.inner.writer().ack(value);
    }

    /// Runs `f` for every new in-process restart request from the agent
    /// (and at once, on this thread, for one already pending).
    ///
    /// Why a callback: the request arrives on the client's background
    /// thread (the `Control` stream or the slot's control word, whichever
    /// is first), and only the program knows how to stop its training loop
    /// (the Python package raises `warden.RestartRequested` in it). `f`
    /// runs on that background thread and must return quickly. The request
    /// stays pending until [`Client::ack_restart`]; an agent that gets no
    /// acknowledgement within its `restart.in_process_timeout` restarts the
    /// job's processes instead.
    pub fn on_restart(&self, f: impl Fn(&RestartRequest) + Send + Sync + 'static) {
        let cb: RestartCallback = Arc::new(f);
        if let Some(pending) = self.inner.restart.add_callback(cb.clone()) {
            cb(&pending);
        }
    }

    /// Runs `f` for every flight-recorder dump request from the agent (a
    /// hung rank asked where its collectives stand), on a thread of its
    /// own: `f` may wait for a lock the training thread holds (Python's
    /// GIL) without stalling the client. Requests arriving while one runs
    /// are dropped; the agent waits a bounded time and says so. Only paths
    /// in the directory the agent named at registration reach `f`
    /// ([`crate::flight::check_path`]).
    pub fn on_flight_recorder_dump(
        &self,
        f: impl Fn(&crate::flight::FlightRecorderDump) + Send + Sync + 'static,
    ) {
        self.inner.flight.add(Arc::new(f));
    }

    /// The restart request waiting for an acknowledgement, if any.
    pub fn restart_pending(&self) -> Option<RestartRequest> {
        self.inner.restart.pending()
    }

    /// Acknowledges restart request `seq`: the training function is being
    /// run again. Stores `seq` into the slot's ack word at once and queues
    /// the `AckControl` call for the background thread (the caller never
    /// waits on the agent). False when `seq` is not the pending request.
    pub fn ack_restart(&self, seq: u64) -> bool {
        ack_restart(&self.inner, seq)
    }

    /// A handle that acknowledges restarts for this client without keeping
    /// it alive (for callbacks, which the client itself holds).
    pub fn restart_acker(&self) -> RestartAcker {
        RestartAcker {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Makes `req` pending as if the agent had sent it, and runs the
    /// callbacks; false when its sequence number was seen already.
    ///
    /// Why: tests and restart drills exercise the whole in-process path
    /// (the Python package's raise, `warden.run`'s retry) with no agent.
    /// Acknowledging an injected request writes the slot's ack word like
    /// any other (an agent ignores an ack it did not ask for).
    pub fn inject_restart(&self, mut req: RestartRequest) -> bool {
        req.via = RestartVia::Injected;
        offer_restart(&self.inner, req)
    }

    /// Reports an exception to the agent (`ReportException`), as this
    /// registration (job, rank, generation, pid); the agent publishes it as
    /// a `rank.exception` event and diagnoses the exit that may follow
    /// with it.
    ///
    /// Bounded: returns within `exception_report_timeout` (1 s by default)
    /// whatever the agent does, and at once when the client holds no
    /// registration (no agent, not yet, or a forked child). Never panics.
    /// `report.step` defaults to the step the client's slot holds.
    ///
    /// With `report.uncaught` the process is taken to be about to exit:
    /// [`Client::close`] (and drop) then no longer deregister, so the agent
    /// sees the exit itself, as a crash with its exit code.
    pub fn report_exception(&self, report: &ExceptionReport) -> Result<(), ReportError> {
        self.send_report(report, false).map(|_| ())
    }

    /// Reports an exception the rank caught and waits on (`warden.run`):
    /// the agent classifies it and answers whether the job restarts in
    /// process (a transient class: the request is on its way to every rank,
    /// this one included) or the exception ends the rank. Bounded as
    /// [`Client::report_exception`]; `report.uncaught` must be false.
    pub fn report_exception_for_decision(
        &self,
        report: &ExceptionReport,
    ) -> Result<ExceptionDecision, ReportError> {
        self.send_report(report, true).map(ExceptionDecision::from)
    }

    fn send_report(
        &self,
        report: &ExceptionReport,
        awaits_decision: bool,
    ) -> Result<warden_proto::v1::ReportExceptionResponse, ReportError> {
        if report.uncaught {
            self.inner.exiting.store(true, Ordering::Release);
        }
        if report.exception_type.is_empty() {
            return Err(ReportError::EmptyType);
        }
        // The atomic first, and no blocking lock after it: in a forked child
        // (never connected) a lock may be held by a thread that is not there.
        if !self.is_connected() {
            return Err(ReportError::NotRegistered(self.not_registered_reason()));
        }
        let status = self.status();
        let Some(generation) = status.generation.filter(|_| status.connected) else {
            return Err(ReportError::NotRegistered(self.not_registered_reason()));
        };
        let step = report
            .step
            .unwrap_or_else(|| self.current_step().unwrap_or(0));
        let opts = &self.inner.opts;
        let mut req = report::request(report, &opts.job_id, opts.global_rank, generation, step);
        req.awaits_decision = awaits_decision && !report.uncaught;
        report::send(opts.socket_path.clone(), req, opts.exception_report_timeout)
    }

    /// Why the client is not registered (the last error, if the status is
    /// free to read without waiting).
    fn not_registered_reason(&self) -> String {
        match self.inner.status.try_lock() {
            Ok(s) => s.last_error.clone(),
            Err(_) => None,
        }
        .unwrap_or_else(|| "not connected".to_owned())
    }

    /// The step the slot holds (open, or the last one), when a step was ever begun.
    fn current_step(&self) -> Option<u64> {
        let s = self.snapshot().ok()?;
        (s.step_open || s.steps_completed > 0 || s.step != 0).then_some(s.step)
    }

    /// Deregisters from the agent and stops the background thread (idempotent).
    ///
    /// Bounded: the deregistration call times out after a second. The client
    /// stays usable (disconnected) afterwards. After a report of an uncaught
    /// exception it does not deregister (see [`Client::report_exception`]).
    pub fn close(&self) {
        self.inner.stop.store(true, Ordering::Release);
        self.inner.wake.notify_one();
        let handle = match self.thread.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        fork::forget(&self.inner);
        self.close();
    }
}

/// Fork safety: a forked child (a data-loader worker) must not write into
/// its parent's slot, so after `fork` every live client in the child moves
/// to its private slot.
///
/// Why a fixed table of atomics: the child handler runs in a process with a
/// single thread where any lock may have been held at fork time, so it may
/// only do atomic loads and stores.
mod fork {
    use super::{Arc, Inner, Ordering};
    use std::sync::Once;
    use std::sync::atomic::AtomicPtr;

    const LIVE_MAX: usize = 64;
    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: AtomicPtr<Inner> = AtomicPtr::new(std::ptr::null_mut());
    static LIVE: [AtomicPtr<Inner>; LIVE_MAX] = [EMPTY; LIVE_MAX];
    static INSTALL: Once = Once::new();

    /// Registers a client (past `LIVE_MAX` clients, extra ones are not covered).
    pub(super) fn track(inner: &Arc<Inner>) {
        INSTALL.call_once(|| {
            // SAFETY: registering a handler with no preconditions; the handler
            // only touches atomics (see `after_fork_in_child`).
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        });
        let p = Arc::as_ptr(inner).cast_mut();
        for entry in &LIVE {
            if entry
                .compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Unregisters a client before it is freed.
    pub(super) fn forget(inner: &Arc<Inner>) {
        let p = Arc::as_ptr(inner).cast_mut();
        for entry in &LIVE {
            if entry
                .compare_exchange(p, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    extern "C" fn after_fork_in_child() {
        for entry in &LIVE {
            let p = entry.load(Ordering::Acquire);
            // SAFETY: entries are removed before their Inner is freed, and the
            // child has a single thread, so a non-null entry is a live Inner.
            if let Some(inner) = unsafe { p.as_ref() } {
                inner.connected.store(false, Ordering::Release);
                inner.current.store(inner.dummy_ptr(), Ordering::Release);
            }
        }
    }
}

/// Acknowledges restart requests for a client it does not keep alive
/// (see [`Client::restart_acker`]).
#[derive(Debug, Clone)]
pub struct RestartAcker {
    inner: std::sync::Weak<Inner>,
}

impl RestartAcker {
    /// [`Client::ack_restart`] on the client, if it still exists.
    pub fn ack(&self, seq: u64) -> bool {
        self.inner
            .upgrade()
            .is_some_and(|inner| ack_restart(&inner, seq))
    }

    /// [`Client::restart_pending`] on the client, if it still exists.
    pub fn pending(&self) -> Option<RestartRequest> {
        self.inner
            .upgrade()
            .and_then(|inner| inner.restart.pending())
    }
}

fn ack_restart(inner: &Inner, seq: u64) -> bool {
    if !inner.restart.ack(seq) {
        return false;
    }
    // The slot first: the agent reads it even when the call cannot be made.
    inner.writer().ack(seq);
    true
}

/// Hands a request to the restart state and runs the callbacks if it is new.
fn offer_restart(inner: &Inner, req: RestartRequest) -> bool {
    let Some((req, callbacks)) = inner.restart.offer(req) else {
        return false;
    };
    for cb in &callbacks {
        cb(&req);
    }
    true
}

/// An open section; closes it when dropped.
#[derive(Debug)]
#[must_use = "the section closes when the guard is dropped"]
pub struct SectionGuard<'a> {
    client: &'a Client,
    id: SectionId,
}

impl Drop for SectionGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.client.section_close(self.id);
    }
}

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
const RPC_TIMEOUT: Duration = Duration::from_secs(2);

fn background(inner: Arc<Inner>, first: mpsc::SyncSender<()>) {
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

pub(crate) async fn connect_channel(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    connect_channel_with(path, RPC_TIMEOUT).await
}

/// A channel to the agent's socket whose calls may each take `timeout`
/// (connecting is bounded by [`RPC_TIMEOUT`] all the same: an agent that
/// is down is found at once).
pub(crate) async fn connect_channel_with(
    path: PathBuf,
    timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by tonic but unused: the connector dials the socket.
    Endpoint::from_static("http://warden.local")
        .connect_timeout(RPC_TIMEOUT)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_from_the_environment() {
        // WARDEN_DEVICES, CUDA_VISIBLE_DEVICES, local rank -> devices
        type Case = (
            Option<&'static str>,
            Option<&'static str>,
            u32,
            &'static [&'static str],
        );
        let cases: &[Case] = &[
            (None, None, 3, &[]),
            (Some(""), Some(""), 0, &[]),
            // WARDEN_DEVICES wins, used as given (trimmed, empty entries dropped).
            (Some("GPU-abc"), Some("4,5"), 1, &["GPU-abc"]),
            (Some("gpu0, gpu1,"), None, 0, &["gpu0", "gpu1"]),
            (Some("7"), None, 0, &["7"]),
            // A list: the entry at the local rank.
            (None, Some("4,5"), 1, &["gpu5"]),
            (None, Some("4,5"), 0, &["gpu4"]),
            (None, Some("4, 5"), 1, &["gpu5"]),
            (None, Some("0,1"), 3, &[]),
            // One entry: that one, whatever the local rank.
            (None, Some("6"), 3, &["gpu6"]),
            (None, Some("06"), 0, &["gpu6"]),
            (None, Some("0"), 0, &["gpu0"]),
            (None, Some("GPU-8f3c1a"), 2, &["GPU-8f3c1a"]),
            (None, Some("MIG-1,MIG-2"), 1, &["MIG-2"]),
            // "No GPU".
            (None, Some("-1"), 0, &[]),
            (None, Some("NoDevFiles"), 0, &["NoDevFiles"]),
        ];
        for (warden, cuda, local, want) in cases {
            assert_eq!(
                devices_from_env(*warden, *cuda, *local),
                *want,
                "WARDEN_DEVICES={warden:?} CUDA_VISIBLE_DEVICES={cuda:?} LOCAL_RANK={local}"
            );
        }
    }

    #[test]
    fn device_names_the_agent_would_refuse_never_reach_it() {
        let long = "x".repeat(MAX_DEVICE_NAME + 1);
        let many = (0..40)
            .map(|i| format!("gpu{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            devices_from_env(Some(&format!("a\u{7},{long},b")), None, 0),
            ["b"]
        );
        assert_eq!(devices_from_env(Some(&many), None, 0).len(), MAX_DEVICES);

        let mut o = ConnectOptions::from_env_lossy();
        o.job_id = "j".into();
        o.global_rank = 0;
        o.world_size = 1;
        o.devices = vec!["gpu0".into()];
        assert!(o.validate().is_ok());
        o.devices = vec![String::new()];
        assert!(matches!(o.validate(), Err(ClientError::BadDevice { .. })));
        o.devices = vec!["g".into(); MAX_DEVICES + 1];
        assert!(matches!(
            o.validate(),
            Err(ClientError::TooManyDevices { count: 17 })
        ));
    }

    #[test]
    fn a_client_without_an_agent_reports_nothing_and_returns_at_once() {
        let mut o = ConnectOptions::from_env_lossy();
        o.socket_path = PathBuf::from("/nonexistent/warden/wardend.sock");
        o.job_id = "j".into();
        o.global_rank = 0;
        o.world_size = 1;
        let client = Client::offline(o, Some("no agent here".into()));
        let t0 = std::time::Instant::now();
        let r = client.report_exception(&ExceptionReport {
            exception_type: "RuntimeError".into(),
            message: "boom".into(),
            uncaught: false,
            ..ExceptionReport::default()
        });
        assert!(
            matches!(&r, Err(ReportError::NotRegistered(why)) if why == "no agent here"),
            "{r:?}"
        );
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "{:?}",
            t0.elapsed()
        );
        let r = client.report_exception(&ExceptionReport::default());
        assert!(matches!(r, Err(ReportError::EmptyType)), "{r:?}");
    }
}
