//! The shared-memory heartbeat slot: the one layout both sides agree on.
//!
//! The agent owns one sealed memfd per slot ([`SlotMemory`]: a
//! [`FileHeader`] of 128 bytes and one fixed-size [`Slot`]), kept in its
//! [`SlotTable`]. It claims slot `i` for a rank ([`SlotTable::claim`]) and
//! hands that slot's descriptor to the rank's process alone over the slot
//! socket ([`crate::slot_socket`]); the rank maps it read-write and writes
//! into it through a [`SlotWriter`]; the agent reads every slot on its tick
//! with [`SlotTable::snapshot`]. No file exists that anyone could open,
//! truncate or replace.
//!
//! Why shared memory: a heartbeat, a section open/close or a step boundary
//! must cost the training loop a few nanoseconds, with no syscall, lock or
//! allocation. Every field is an atomic, so both processes may touch the
//! bytes at once without UB.
//!
//! Layout of a slot (all offsets fixed, checked by const asserts):
//! - bytes 0..128, the agent's line: state, owner pid, generation (the token
//!   the agent issues at claim), claim time, control word (agent -> client),
//!   notice word and its save step (agent -> client: [`NoticeWord`]).
//! - bytes 128..256, the client's hot line: seqlock counter, the generation
//!   the writer echoes, heartbeat counter, current step, completed-step
//!   count, ack word, writer pid, section depth, flags, misuse counter.
//! - the open-section stack ([`MAX_DEPTH`] entries of id + entered-at).
//! - the name table ([`MAX_SECTIONS`] fixed-size names; ids below
//!   [`FIRST_USER_SECTION`] are the well-known names and are not stored).
//! - the step ring ([`RING_LEN`] records: step, start, duration, the step's
//!   reported values (loss, gradient norm: [`SlotWriter::report_values`]),
//!   per-section inclusive totals). The record at `steps_completed % RING_LEN` is the step
//!   in progress; the others are the last `RING_LEN - 1` completed steps.
//!
//! Consistency: multi-word updates (step, stack, ring) are wrapped in a
//! seqlock (`seq` odd while a write is in progress); the reader retries a
//! bounded number of times. The heartbeat counter is one word, outside the
//! seqlock. Names are written once per claim, length last, and read apart.
//! There is ONE writer per slot: step and section calls must come from one
//! thread at a time (the training loop); heartbeats may come from any thread
//! (a lost increment from a race is harmless, the counter still moves).
//!
//! Everything read from the file is untrusted: the reader bounds every index
//! and sanitises every value, and never panics.
//!
//! The control word (agent -> client) and the ack word (client -> agent)
//! carry in-process restart requests; see [`ControlWord`] for the encoding.
//! The agent also pushes each request on the rank's `Control` stream: the
//! slot is the path that works when the stream is down, and the cheap one
//! the client's background thread polls every few milliseconds.
//!
//! Timestamps are `CLOCK_MONOTONIC` nanoseconds (see [`crate::clock`]); the
//! client's are TSC-derived and may lead the agent's own reading by a few
//! microseconds, so subtract with saturation. A heartbeat carries no
//! timestamp (a clock read would triple its cost): the agent notes when it
//! saw the counter move. Step boundaries also bump the counter.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// Identifies a warden slot file ("WARDNSLT" in little-endian bytes).
pub const MAGIC: u64 = u64::from_le_bytes(*b"WARDNSLT");
/// Bumped on any change to the layout or to how a slot reaches a rank; sent
/// in `RegisterRankRequest` (2: a sealed memfd over the slot socket, no file;
/// 3: each step record carries the step's loss and gradient norm).
pub const LAYOUT_VERSION: u32 = 3;
/// Size of the file header; slots start right after it.
pub const HEADER_SIZE: usize = 128;
/// Deepest section nesting that is recorded (deeper sections are counted, not timed).
pub const MAX_DEPTH: usize = 8;
/// Section ids are `0..MAX_SECTIONS`.
pub const MAX_SECTIONS: usize = 32;
/// Longest section name stored in the slot, in bytes (longer names are truncated).
pub const NAME_LEN: usize = 32;
/// Step records kept per slot (one is the step in progress).
pub const RING_LEN: usize = 64;
/// Upper bound on slots in one file, so a corrupted header cannot ask for terabytes.
pub const MAX_SLOTS: u32 = 65_536;
/// Size of one slot in bytes.
pub const SLOT_SIZE: usize = 21_120;

/// The well-known section names; a name's index is its fixed id.
pub const WELL_KNOWN_SECTIONS: [&str; 8] = [
    "init",
    "step",
    "forward",
    "backward",
    "optimizer",
    "checkpoint",
    "data",
    "other",
];
/// Fixed id of "init".
pub const SECTION_INIT: u32 = 0;
/// Fixed id of "step": pushed by `step_begin`, never opened as a section.
pub const SECTION_STEP: u32 = 1;
/// Fixed id of "forward".
pub const SECTION_FORWARD: u32 = 2;
/// Fixed id of "backward".
pub const SECTION_BACKWARD: u32 = 3;
/// Fixed id of "optimizer".
pub const SECTION_OPTIMIZER: u32 = 4;
/// Fixed id of "checkpoint".
pub const SECTION_CHECKPOINT: u32 = 5;
/// Fixed id of "data".
pub const SECTION_DATA: u32 = 6;
/// Where names go once the user table is full, and what invalid ids read as.
pub const SECTION_OTHER: u32 = 7;
/// First id handed to a user-defined name.
pub const FIRST_USER_SECTION: u32 = 8;

const STATE_FREE: u32 = 0;
const STATE_CLAIMED: u32 = 1;
const FLAG_STEP_OPEN: u32 = 1;
/// Bit of a step record's `values_set`: `loss` holds a reported loss.
const VALUE_LOSS: u32 = 1;
/// Bit of a step record's `values_set`: `grad_norm` holds a reported norm.
const VALUE_GRAD_NORM: u32 = 2;
const SNAPSHOT_RETRIES: u32 = 256;

/// Errors from making, receiving or reading slot memory.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    /// A system call on the memory failed.
    #[error("slot memory {path}: {op}: {source}")]
    Io {
        /// The memory (`memfd:warden-slot`; it has no path).
        path: PathBuf,
        /// What we were doing.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The memory is shorter than its header says it should be.
    #[error("slot memory {path} is {len} bytes, expected {expected}")]
    BadLength {
        /// The memory (`memfd:warden-slot`; it has no path).
        path: PathBuf,
        /// Its actual length.
        len: u64,
        /// What the header implies.
        expected: u64,
    },
    /// The memory does not start with [`MAGIC`].
    #[error("slot memory {path} has magic {found:#018x}, expected {MAGIC:#018x}")]
    BadMagic {
        /// The memory (`memfd:warden-slot`; it has no path).
        path: PathBuf,
        /// What it starts with.
        found: u64,
    },
    /// The memory was written with another layout version.
    #[error("slot memory {path} has layout version {found}, this build speaks {LAYOUT_VERSION}")]
    BadVersion {
        /// The memory (`memfd:warden-slot`; it has no path).
        path: PathBuf,
        /// Its version.
        found: u32,
    },
    /// A header field disagrees with this build's layout.
    #[error("slot memory {path}: header field {field} is {found}, expected {expected}")]
    BadHeader {
        /// The memory (`memfd:warden-slot`; it has no path).
        path: PathBuf,
        /// Which field.
        field: &'static str,
        /// Its value.
        found: u64,
        /// What this build expects.
        expected: u64,
    },
    /// A slot count of zero or above [`MAX_SLOTS`] was asked for or found.
    #[error("slot count {0} is out of range 1..={MAX_SLOTS}")]
    BadSlotCount(u64),
    /// A slot index past the end of the table.
    #[error("slot index {index} is out of range (the table has {count} slots)")]
    IndexOutOfRange {
        /// The index asked for.
        index: u32,
        /// Slots in the table.
        count: u32,
    },
    /// Slot memory received without the seals that fix its size.
    #[error(
        "slot memory is not sealed against shrinking and growing (seals {found:#x}): refusing to map it, a holder could truncate it under us"
    )]
    NotSealed {
        /// The seals found (F_GET_SEALS).
        found: i32,
    },
    /// The writer kept the seqlock busy through every retry.
    #[error(
        "slot {index} stayed inconsistent through {retries} read attempts (writer busy or dead mid-write)"
    )]
    Inconsistent {
        /// The slot.
        index: u32,
        /// Attempts made.
        retries: u32,
    },
}

/// The header of a slot memory. Written once by [`SlotMemory::create`].
#[repr(C, align(128))]
#[derive(Debug)]
pub struct FileHeader {
    magic: AtomicU64,
    layout_version: AtomicU32,
    header_size: AtomicU32,
    slot_size: AtomicU32,
    slot_count: AtomicU32,
    created_ns: AtomicU64,
    _reserved: [AtomicU64; 12],
}

#[repr(C)]
#[derive(Debug)]
struct StackEntry {
    id: AtomicU32,
    _pad: AtomicU32,
    entered_ns: AtomicU64,
}

#[repr(C)]
#[derive(Debug)]
struct NameEntry {
    /// Byte length of the name; 0 = unset. Written last (Release).
    len: AtomicU32,
    _pad: AtomicU32,
    bytes: [AtomicU64; NAME_LEN / 8],
}

#[repr(C)]
#[derive(Debug)]
struct StepRecord {
    step: AtomicU64,
    start_ns: AtomicU64,
    duration_ns: AtomicU64,
    /// Bit `i` set: `section_ns[i]` holds this step's total for section `i`.
    section_mask: AtomicU32,
    /// [`VALUE_LOSS`] / [`VALUE_GRAD_NORM`]: which of the values below the
    /// client reported for this step (a NaN is a value, so no sentinel).
    values_set: AtomicU32,
    /// The step's loss, as `f64` bits.
    loss: AtomicU64,
    /// The step's gradient norm, as `f64` bits.
    grad_norm: AtomicU64,
    section_ns: [AtomicU64; MAX_SECTIONS],
}

/// One rank's slot. Opaque: written through [`SlotWriter`], read through
/// [`SlotTable::snapshot`] or [`Slot::snapshot`].
#[repr(C, align(128))]
#[derive(Debug)]
pub struct Slot {
    // ---- the agent's line
    state: AtomicU32,
    owner_pid: AtomicU32,
    generation: AtomicU64,
    claimed_ns: AtomicU64,
    /// Agent -> client: the latest request ([`ControlWord::encode`]; 0 =
    /// none). Written by the agent only; cleared at claim.
    control: AtomicU64,
    /// Agent -> client: a notice of a coming stop ([`NoticeWord::encode`];
    /// 0 = none). Written by the agent only, on every tick while the
    /// notice stands; cleared at claim.
    notice: AtomicU64,
    /// Agent -> client, with `notice`: the step at whose boundary the rank
    /// saves (the step after the job's furthest rank's when the agent told
    /// them), so every rank saves the same step. Stored before `notice`.
    notice_step: AtomicU64,
    _agent_pad: [AtomicU64; 10],
    // ---- the client's hot line
    seq: AtomicU64,
    writer_generation: AtomicU64,
    heartbeats: AtomicU64,
    step: AtomicU64,
    steps_completed: AtomicU64,
    /// Client -> agent: the `seq` of the last request the rank acknowledged
    /// (see [`ControlWord`]). Carried across slot swaps like the rest of
    /// the client's line.
    ack: AtomicU64,
    writer_pid: AtomicU32,
    depth: AtomicU32,
    flags: AtomicU32,
    /// Depth (stack index) at which the open step's "step" entry sits.
    step_depth: AtomicU32,
    misuse: AtomicU32,
    _client_pad32: AtomicU32,
    _client_pad: [AtomicU64; 7],
    // ---- the rest
    stack: [StackEntry; MAX_DEPTH],
    names: [NameEntry; MAX_SECTIONS],
    ring: [StepRecord; RING_LEN],
}

const _: () = assert!(std::mem::size_of::<FileHeader>() == HEADER_SIZE);
const _: () = assert!(std::mem::size_of::<StackEntry>() == 16);
const _: () = assert!(std::mem::size_of::<NameEntry>() == 8 + NAME_LEN);
const _: () = assert!(std::mem::size_of::<StepRecord>() == 48 + 8 * MAX_SECTIONS);
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);
const _: () = assert!(std::mem::offset_of!(Slot, notice) == 32);
const _: () = assert!(std::mem::offset_of!(Slot, notice_step) == 40);
const _: () = assert!(std::mem::offset_of!(Slot, seq) == 128);
const _: () = assert!(std::mem::offset_of!(Slot, stack) == 256);
const _: () = assert!(SLOT_SIZE.is_multiple_of(128) && HEADER_SIZE.is_multiple_of(128));
const _: () = assert!(MAX_SECTIONS <= 32, "section_mask is a u32");
const _: () = assert!(WELL_KNOWN_SECTIONS.len() == FIRST_USER_SECTION as usize);

/// Kind of a [`ControlWord`]: restart in process (Python: raise
/// `warden.RestartRequested` in the training loop and run the training
/// function again).
pub const CONTROL_RESTART: u8 = 1;

/// Largest restart count a control word carries (24 bits); higher counts
/// read as this value (the `Control` stream carries the full count).
pub const CONTROL_MAX_RESTART_COUNT: u32 = (1 << 24) - 1;

/// The slot's control word, decoded.
///
/// Encoding of the 64-bit word (little end first):
///
/// | bits | field |
/// |---|---|
/// | 0..8 | `kind` ([`CONTROL_RESTART`]; 0: no request) |
/// | 8..32 | `restart_count` (24 bits, saturating at [`CONTROL_MAX_RESTART_COUNT`]) |
/// | 32..64 | `seq` (32 bits, never 0 for a request) |
///
/// Why one word: a single atomic store publishes a whole request, so a
/// reader never sees a kind from one request and a sequence number from
/// another. The client acknowledges by storing `seq` into the slot's ack
/// word; the agent waits for `ack == seq`. Sequence numbers are issued by
/// the agent from a clock-derived start (like generations), so an ack
/// carried over from a previous agent's slot never matches a new request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlWord {
    /// What is asked ([`CONTROL_RESTART`]).
    pub kind: u8,
    /// The request's sequence number (what an ack carries).
    pub seq: u32,
    /// The restart count the next attempt runs with (1 for the first restart).
    pub restart_count: u32,
}

impl ControlWord {
    /// A restart request.
    pub fn restart(seq: u32, restart_count: u32) -> Self {
        Self {
            kind: CONTROL_RESTART,
            seq,
            restart_count,
        }
    }

    /// The 64-bit word stored in the slot.
    pub fn encode(self) -> u64 {
        u64::from(self.kind)
            | u64::from(self.restart_count.min(CONTROL_MAX_RESTART_COUNT)) << 8
            | u64::from(self.seq) << 32
    }

    /// The request a word holds; `None` for 0 (nothing asked), an unknown
    /// kind, or a zero sequence number (the word is untrusted).
    pub fn decode(word: u64) -> Option<Self> {
        let kind = (word & 0xff) as u8;
        let restart_count = ((word >> 8) & u64::from(CONTROL_MAX_RESTART_COUNT)) as u32;
        let seq = (word >> 32) as u32;
        (kind == CONTROL_RESTART && seq != 0).then_some(Self {
            kind,
            seq,
            restart_count,
        })
    }
}

/// Where a notice of a coming stop came from ([`NoticeWord::source`]).
pub const NOTICE_SOURCES: [&str; 5] = ["launcher", "gce", "aws", "kubernetes", "other"];

/// The slot's notice word, decoded: the agent tells a rank that its host or
/// its job will be stopped, so the rank saves at its next step boundary
/// and leaves (`warden.notice()` in Python).
///
/// Encoding of the 64-bit word (little end first):
///
/// | bits | field |
/// |---|---|
/// | 0..8 | `1`: a notice stands (0: none) |
/// | 8..16 | `source`, an index into [`NOTICE_SOURCES`] |
/// | 16..32 | reserved, 0 |
/// | 32..64 | `deadline_unix_s`: when the stop comes (Unix seconds; 0: not said) |
///
/// Why a word of its own beside the control word: a notice is not a
/// request to acknowledge but a state that stands until the job stops; the
/// agent stores it again on every tick (a rank that registers after the
/// notice, or gets a new slot, sees it within a tick), and the client reads
/// it with one load at a step boundary, no syscall, no thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoticeWord {
    /// Index into [`NOTICE_SOURCES`].
    pub source: u8,
    /// When the stop comes, Unix seconds (0: the source did not say).
    pub deadline_unix_s: u32,
}

impl NoticeWord {
    /// The 64-bit word stored in the slot.
    pub fn encode(self) -> u64 {
        1 | u64::from(self.source) << 8 | u64::from(self.deadline_unix_s) << 32
    }

    /// The notice a word holds; `None` for 0 or a word that is not one
    /// (the word is untrusted: an unknown source reads as "other").
    pub fn decode(word: u64) -> Option<Self> {
        if word & 0xff != 1 {
            return None;
        }
        let source = ((word >> 8) & 0xff) as u8;
        Some(Self {
            source: source.min((NOTICE_SOURCES.len() - 1) as u8),
            deadline_unix_s: (word >> 32) as u32,
        })
    }

    /// The source's name (`gce`, `launcher`...).
    pub fn source_name(self) -> &'static str {
        NOTICE_SOURCES
            .get(usize::from(self.source))
            .copied()
            .unwrap_or("other")
    }
}

/// Byte offset of slot `index` in the file.
pub const fn slot_offset(index: u32) -> u64 {
    HEADER_SIZE as u64 + index as u64 * SLOT_SIZE as u64
}

/// Expected file length for `slots` slots.
pub const fn file_len(slots: u32) -> u64 {
    slot_offset(slots)
}

/// The fixed id of a well-known section name.
pub fn well_known_id(name: &str) -> Option<u32> {
    WELL_KNOWN_SECTIONS
        .iter()
        .position(|n| *n == name)
        .map(|i| i as u32)
}

/// Validates a header read from `path` (a file of `len` bytes); returns the slot count.
///
/// Shared by [`SlotTable::open_existing`] and the client's one-slot mapping, so
/// both refuse the same files with the same messages.
pub fn validate_header(
    path: &Path,
    header: &[u8; HEADER_SIZE],
    len: u64,
) -> Result<u32, SlotError> {
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&header[o..o + 8]);
        u64::from_ne_bytes(b)
    };
    let u32_at = |o: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&header[o..o + 4]);
        u32::from_ne_bytes(b)
    };
    let magic = u64_at(0);
    if magic != MAGIC {
        return Err(SlotError::BadMagic {
            path: path.to_owned(),
            found: magic,
        });
    }
    let version = u32_at(8);
    if version != LAYOUT_VERSION {
        return Err(SlotError::BadVersion {
            path: path.to_owned(),
            found: version,
        });
    }
    let check = |field, found: u32, expected: usize| {
        if found as usize == expected {
            Ok(())
        } else {
            Err(SlotError::BadHeader {
                path: path.to_owned(),
                field,
                found: found.into(),
                expected: expected as u64,
            })
        }
    };
    check("header_size", u32_at(12), HEADER_SIZE)?;
    check("slot_size", u32_at(16), SLOT_SIZE)?;
    let count = u32_at(20);
    if count == 0 || count > MAX_SLOTS {
        return Err(SlotError::BadSlotCount(count.into()));
    }
    if len < file_len(count) {
        return Err(SlotError::BadLength {
            path: path.to_owned(),
            len,
            expected: file_len(count),
        });
    }
    Ok(count)
}

/// Reads the header of an open file after checking it is long enough to hold one.
pub(crate) fn read_header(path: &Path, file: &File) -> Result<(u32, u64), SlotError> {
    let io_err = |op| {
        move |source| SlotError::Io {
            path: path.to_owned(),
            op,
            source,
        }
    };
    let len = file.metadata().map_err(io_err("fstat"))?.len();
    if len < HEADER_SIZE as u64 {
        return Err(SlotError::BadLength {
            path: path.to_owned(),
            len,
            expected: HEADER_SIZE as u64,
        });
    }
    let mut header = [0u8; HEADER_SIZE];
    file.read_exact_at(&mut header, 0)
        .map_err(io_err("read header"))?;
    let count = validate_header(path, &header, len)?;
    Ok((count, len))
}

/// The agent's slots: one sealed memory per slot index, made when the
/// index is first used (its first claim) and kept for the agent's life.
///
/// Why one memory per slot and not one shared file: a rank receives only
/// its own slot's descriptor, so it can neither scribble on another rank's
/// slot nor (the memory being sealed, see [`SlotMemory`]) change anyone's
/// size; nobody else can open it at all. Why kept across claims: a rank the
/// agent let go still maps the memory and must see its release there
/// (state free, generation changed) to detach. The cost of keeping it: a
/// rank that held an index earlier and did not detach still maps it, and
/// what it writes there is read as the next holder's (the generation the
/// writer echoes tells the two apart, as before).
/// Why the agent maps each one: a snapshot is then a few hundred loads
/// from memory, with no syscall per rank per tick.
#[derive(Debug)]
pub struct SlotTable {
    slots: Vec<std::sync::OnceLock<SlotMemory>>,
}

impl SlotTable {
    /// A table of `slots` slot indexes; no memory is made before a claim,
    /// so an agent sized for many ranks holds descriptors only for the
    /// indexes it ever handed out.
    pub fn new(slots: u32) -> Result<SlotTable, SlotError> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(SlotError::BadSlotCount(slots.into()));
        }
        Ok(SlotTable {
            slots: (0..slots).map(|_| std::sync::OnceLock::new()).collect(),
        })
    }

    /// Number of slot indexes.
    pub fn slot_count(&self) -> u32 {
        u32::try_from(self.slots.len()).unwrap_or(u32::MAX)
    }

    /// The memory of slot `index`, once it was ever claimed: its
    /// descriptor is what the slot socket hands to the rank holding it.
    pub fn memory(&self, index: u32) -> Option<&SlotMemory> {
        self.slots.get(index as usize).and_then(|m| m.get())
    }

    /// The slot at `index`, bounds-checked; its memory is made on first
    /// use (a free, zeroed slot), which can fail like any memfd_create.
    pub fn slot(&self, index: u32) -> Result<&Slot, SlotError> {
        let cell = self
            .slots
            .get(index as usize)
            .ok_or(SlotError::IndexOutOfRange {
                index,
                count: self.slot_count(),
            })?;
        if let Some(m) = cell.get() {
            return Ok(m.slot());
        }
        // A failed set only means another thread made it first; either way
        // the cell now holds the one memory every later call sees.
        let _ = cell.set(SlotMemory::create()?);
        cell.get()
            .map(SlotMemory::slot)
            .ok_or(SlotError::IndexOutOfRange {
                index,
                count: self.slot_count(),
            })
    }

    /// Resets slot `index` for a new owner and stamps its generation.
    ///
    /// The client echoes `generation` into the slot once it maps it, so the
    /// agent can tell the current owner from a stale writer.
    pub fn claim(&self, index: u32, generation: u64, pid: u32) -> Result<(), SlotError> {
        let slot = self.slot(index)?;
        if let Some(m) = self.memory(index) {
            m.stamp_header();
        }
        slot.reset_client_area();
        slot.owner_pid.store(pid, Ordering::Relaxed);
        slot.claimed_ns
            .store(crate::clock::now_ns(), Ordering::Relaxed);
        slot.control.store(0, Ordering::Relaxed);
        slot.notice.store(0, Ordering::Relaxed);
        slot.notice_step.store(0, Ordering::Relaxed);
        slot.generation.store(generation, Ordering::Relaxed);
        slot.state.store(STATE_CLAIMED, Ordering::Release);
        Ok(())
    }

    /// Frees slot `index`; a stale writer sees the state change and detaches.
    pub fn release(&self, index: u32) -> Result<(), SlotError> {
        let slot = self.slot(index)?;
        slot.state.store(STATE_FREE, Ordering::Release);
        slot.owner_pid.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Sets the agent-to-client control word of slot `index` (a
    /// [`ControlWord::encode`]d restart request).
    pub fn set_control(&self, index: u32, value: u64) -> Result<(), SlotError> {
        self.slot(index)?.control.store(value, Ordering::Release);
        Ok(())
    }

    /// Sets the agent-to-client notice of slot `index`: the
    /// [`NoticeWord::encode`]d notice of a coming stop (0 clears it) and
    /// the step at whose boundary the rank saves (stored first, so a
    /// client that sees the word sees the step).
    pub fn set_notice(&self, index: u32, value: u64, save_at_step: u64) -> Result<(), SlotError> {
        let slot = self.slot(index)?;
        slot.notice_step.store(save_at_step, Ordering::Relaxed);
        slot.notice.store(value, Ordering::Release);
        Ok(())
    }

    /// The step slot `index`'s rank is in (one word: no seqlock), for a
    /// notice's save step, which must be read as fresh as it is written.
    pub fn current_step(&self, index: u32) -> Result<u64, SlotError> {
        Ok(self.slot(index)?.step.load(Ordering::Acquire))
    }

    /// The notice word of slot `index`, as the agent last set it.
    pub fn notice_word(&self, index: u32) -> Result<u64, SlotError> {
        Ok(self.slot(index)?.notice.load(Ordering::Acquire))
    }

    /// The client's ack word of slot `index` (the `seq` it acknowledged) and
    /// the generation its writer echoed: one cheap read, no seqlock.
    ///
    /// Why apart from [`SlotTable::snapshot`]: the agent waiting for
    /// acknowledgements polls every few milliseconds and needs two words,
    /// not the whole slot.
    pub fn ack_word(&self, index: u32) -> Result<(u64, u64), SlotError> {
        let slot = self.slot(index)?;
        Ok((
            slot.ack.load(Ordering::Acquire),
            slot.writer_generation.load(Ordering::Acquire),
        ))
    }

    /// A consistent copy of slot `index` (seqlock read, bounded retries).
    pub fn snapshot(&self, index: u32) -> Result<SlotSnapshot, SlotError> {
        self.slot(index)?.snapshot(index)
    }

    /// Like [`SlotTable::snapshot`], with at most `max_steps` completed steps.
    ///
    /// Why: a tick only needs the steps completed since the last one (and
    /// the live part: step, stack); reading less keeps the seqlock read
    /// window short, so a rank updating very often cannot starve the reader.
    pub fn snapshot_recent(&self, index: u32, max_steps: usize) -> Result<SlotSnapshot, SlotError> {
        self.slot(index)?.snapshot_recent(index, max_steps)
    }

    /// Like [`SlotTable::snapshot_recent`], without the section-name table
    /// (`section_names` is empty; read names with [`SlotTable::section_name`]).
    ///
    /// Why: the agent reads every slot on every tick. Names are written once
    /// per id, so it caches them and reads one only when it meets a new id,
    /// instead of copying 32 names per slot per tick.
    pub fn snapshot_for_scan(
        &self,
        index: u32,
        max_steps: usize,
    ) -> Result<SlotSnapshot, SlotError> {
        self.slot(index)?.snapshot_inner(index, max_steps, false)
    }

    /// The name of section `id` in slot `index` ("" when unset or out of range).
    pub fn section_name(&self, index: u32, id: u32) -> Result<String, SlotError> {
        let slot = self.slot(index)?;
        Ok(match id {
            i if i < FIRST_USER_SECTION => WELL_KNOWN_SECTIONS
                .get(i as usize)
                .map(|s| (*s).to_owned())
                .unwrap_or_default(),
            i => slot
                .names
                .get(i as usize)
                .and_then(read_name)
                .unwrap_or_default(),
        })
    }

    /// Two counters that change on every write to slot `index`: the seqlock
    /// sequence (steps, sections) and the heartbeat count.
    ///
    /// Why: a slot whose counters did not move since the last scan needs no
    /// snapshot at all; the scan only re-judges its stall.
    pub fn change_counters(&self, index: u32) -> Result<(u64, u64), SlotError> {
        let slot = self.slot(index)?;
        Ok((
            slot.seq.load(Ordering::Acquire),
            slot.heartbeats.load(Ordering::Acquire),
        ))
    }

    /// A writer on slot `index`: for tests and simulated ranks inside the agent.
    pub fn writer(&self, index: u32) -> Result<SlotWriter<'_>, SlotError> {
        Ok(SlotWriter::new(self.slot(index)?))
    }
}

/// A section open in the slot, innermost last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSection {
    /// Section id (out-of-range ids read as [`SECTION_OTHER`]).
    pub id: u32,
    /// When it was entered (`CLOCK_MONOTONIC` ns).
    pub entered_ns: u64,
}

/// One section's total time inside one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionTime {
    /// Section id.
    pub id: u32,
    /// Inclusive time spent in it during the step, summed over its openings.
    pub total_ns: u64,
}

/// One step's record.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSummary {
    /// The step number the training loop passed to `step_begin`.
    pub step: u64,
    /// When it began (`CLOCK_MONOTONIC` ns).
    pub start_ns: u64,
    /// Its duration; 0 for the step in progress.
    pub duration_ns: u64,
    /// Per-section totals, ascending id, only sections that ran.
    pub sections: Vec<SectionTime>,
    /// The loss the client reported for this step, if it did (may be NaN or
    /// infinite: that is what the SDC detector looks for).
    pub loss: Option<f64>,
    /// The gradient norm the client reported for this step, if it did.
    pub grad_norm: Option<f64>,
}

/// A consistent copy of one slot, all values sanitised.
///
/// Why a copy: the agent's detectors work on plain values and never touch
/// shared memory, so they are pure functions tests can drive.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotSnapshot {
    /// Slot index.
    pub index: u32,
    /// Whether the agent has handed the slot out.
    pub claimed: bool,
    /// Pid the agent gave at claim.
    pub owner_pid: u32,
    /// Generation the agent issued at claim.
    pub generation: u64,
    /// Agent-to-client control word.
    pub control: u64,
    /// Generation the writer echoed (differs from `generation`: not attached yet, or stale).
    pub writer_generation: u64,
    /// Pid of the process writing.
    pub writer_pid: u32,
    /// Heartbeat counter (moves while the rank is alive).
    pub heartbeats: u64,
    /// Client's acknowledgement of `control`.
    pub ack: u64,
    /// Current (or last) step number.
    pub step: u64,
    /// Whether a step is in progress.
    pub step_open: bool,
    /// Steps completed since the slot was claimed (or carried over).
    pub steps_completed: u64,
    /// Section nesting depth (may exceed `open_sections.len()` past [`MAX_DEPTH`]).
    pub depth: u32,
    /// The recorded open sections, outermost first ("step" included).
    pub open_sections: Vec<OpenSection>,
    /// The step in progress, if any (duration 0).
    pub current_step: Option<StepSummary>,
    /// Completed steps, oldest first, at most `RING_LEN - 1` (or the `max_steps` asked for).
    pub recent_steps: Vec<StepSummary>,
    /// Mismatched closes, step_end without step_begin, and similar misuse.
    pub misuse: u32,
    /// Section names by id (empty string: unused id).
    pub section_names: Vec<String>,
}

impl SlotSnapshot {
    /// Name of section `id` ("" when unknown).
    pub fn section_name(&self, id: u32) -> &str {
        self.section_names
            .get(id as usize)
            .map(String::as_str)
            .unwrap_or("")
    }

    /// The innermost open section, if any.
    pub fn innermost(&self) -> Option<&OpenSection> {
        self.open_sections.last()
    }

    /// Whether the current writer is the owner the agent handed the slot to.
    pub fn writer_is_owner(&self) -> bool {
        self.claimed && self.writer_generation == self.generation
    }
}

impl Slot {
    /// A zeroed slot on the heap: the client's private stand-in while no agent is there.
    pub fn new_boxed() -> Box<Slot> {
        let layout = std::alloc::Layout::new::<Slot>();
        // SAFETY: the layout is Slot's own, non-zero-sized.
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Slot>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: p was allocated with Slot's layout by the global allocator
        // (as Box requires) and Slot is made only of atomic integers, for
        // which all-zero bytes are a valid value.
        unsafe { Box::from_raw(p) }
    }

    /// The generation the writer echoed at attach (see [`Slot::attach_writer`]).
    pub fn writer_generation(&self) -> u64 {
        self.writer_generation.load(Ordering::Acquire)
    }

    /// Clears everything the client writes (step, stack, ring, counters).
    pub(crate) fn reset_client_area(&self) {
        let s = self.write_begin();
        self.writer_generation.store(0, Ordering::Relaxed);
        self.heartbeats.store(0, Ordering::Relaxed);
        self.step.store(0, Ordering::Relaxed);
        self.steps_completed.store(0, Ordering::Relaxed);
        self.ack.store(0, Ordering::Relaxed);
        self.writer_pid.store(0, Ordering::Relaxed);
        self.depth.store(0, Ordering::Relaxed);
        self.flags.store(0, Ordering::Relaxed);
        self.step_depth.store(0, Ordering::Relaxed);
        self.misuse.store(0, Ordering::Relaxed);
        for e in &self.stack {
            e.id.store(0, Ordering::Relaxed);
            e.entered_ns.store(0, Ordering::Relaxed);
        }
        for n in &self.names {
            n.len.store(0, Ordering::Relaxed);
            for b in &n.bytes {
                b.store(0, Ordering::Relaxed);
            }
        }
        for r in &self.ring {
            r.step.store(0, Ordering::Relaxed);
            r.start_ns.store(0, Ordering::Relaxed);
            r.duration_ns.store(0, Ordering::Relaxed);
            r.section_mask.store(0, Ordering::Relaxed);
            r.values_set.store(0, Ordering::Relaxed);
        }
        self.write_end(s);
        // Leave the seqlock at an even value even if it had been left odd.
        self.seq.store(0, Ordering::Release);
    }

    /// The generation the agent stamped at claim (0: never claimed).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the agent currently has the slot handed out.
    pub fn is_claimed(&self) -> bool {
        self.state.load(Ordering::Acquire) == STATE_CLAIMED
    }

    #[inline(always)]
    fn write_begin(&self) -> u64 {
        let odd = self.seq.load(Ordering::Relaxed) | 1;
        self.seq.store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        odd
    }

    #[inline(always)]
    fn write_end(&self, odd: u64) {
        self.seq.store(odd.wrapping_add(1), Ordering::Release);
    }

    /// A consistent, sanitised copy of this slot (see [`SlotTable::snapshot`]).
    pub fn snapshot(&self, index: u32) -> Result<SlotSnapshot, SlotError> {
        self.snapshot_recent(index, RING_LEN - 1)
    }

    /// A snapshot with at most `max_steps` completed steps (see [`SlotTable::snapshot_recent`]).
    pub fn snapshot_recent(&self, index: u32, max_steps: usize) -> Result<SlotSnapshot, SlotError> {
        self.snapshot_inner(index, max_steps, true)
    }

    fn snapshot_inner(
        &self,
        index: u32,
        max_steps: usize,
        names: bool,
    ) -> Result<SlotSnapshot, SlotError> {
        for attempt in 0..SNAPSHOT_RETRIES {
            if attempt > 16 {
                std::thread::yield_now();
            }
            let s1 = self.seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let raw = self.read_raw(max_steps);
            fence(Ordering::Acquire);
            let s2 = self.seq.load(Ordering::Relaxed);
            if s1 == s2 {
                return Ok(self.finish_snapshot(index, raw, names));
            }
        }
        Err(SlotError::Inconsistent {
            index,
            retries: SNAPSHOT_RETRIES,
        })
    }

    fn read_raw(&self, max_steps: usize) -> RawSlot {
        let r = Ordering::Relaxed;
        let mut raw = RawSlot {
            writer_generation: self.writer_generation.load(r),
            step: self.step.load(r),
            steps_completed: self.steps_completed.load(r),
            depth: self.depth.load(r),
            flags: self.flags.load(r),
            misuse: self.misuse.load(r),
            stack: [(0, 0); MAX_DEPTH],
            ring: Vec::with_capacity(max_steps.min(RING_LEN - 1) + 1),
        };
        for (dst, e) in raw.stack.iter_mut().zip(&self.stack) {
            *dst = (e.id.load(r), e.entered_ns.load(r));
        }
        let completed = raw.steps_completed;
        let stored = completed.min(RING_LEN as u64 - 1).min(max_steps as u64);
        // Oldest completed first, then the in-progress record.
        for k in (0..=stored).rev() {
            let i = (completed.wrapping_sub(k) % RING_LEN as u64) as usize;
            if let Some(rec) = self.ring.get(i) {
                let mask = rec.section_mask.load(r);
                let mut sections = [0u64; MAX_SECTIONS];
                for (id, v) in sections.iter_mut().enumerate() {
                    if mask & (1 << id) != 0 {
                        *v = rec.section_ns[id].load(r);
                    }
                }
                raw.ring.push(RawStep {
                    step: rec.step.load(r),
                    start_ns: rec.start_ns.load(r),
                    duration_ns: rec.duration_ns.load(r),
                    mask,
                    sections,
                    values_set: rec.values_set.load(r),
                    loss: rec.loss.load(r),
                    grad_norm: rec.grad_norm.load(r),
                });
            }
        }
        raw
    }

    fn finish_snapshot(&self, index: u32, raw: RawSlot, names: bool) -> SlotSnapshot {
        let depth = raw.depth;
        let open_sections = raw
            .stack
            .iter()
            .take((depth as usize).min(MAX_DEPTH))
            .map(|&(id, entered_ns)| OpenSection {
                id: if (id as usize) < MAX_SECTIONS {
                    id
                } else {
                    SECTION_OTHER
                },
                entered_ns,
            })
            .collect();
        let step_open = raw.flags & FLAG_STEP_OPEN != 0;
        let summarise = |s: &RawStep| StepSummary {
            step: s.step,
            start_ns: s.start_ns,
            duration_ns: s.duration_ns,
            sections: (0..MAX_SECTIONS)
                .filter(|&i| s.mask & (1 << i) != 0)
                .map(|i| SectionTime {
                    id: i as u32,
                    total_ns: s.sections[i],
                })
                .collect(),
            loss: (s.values_set & VALUE_LOSS != 0).then(|| f64::from_bits(s.loss)),
            grad_norm: (s.values_set & VALUE_GRAD_NORM != 0).then(|| f64::from_bits(s.grad_norm)),
        };
        let mut ring = raw.ring;
        let in_progress = ring.pop();
        let current_step = if step_open {
            in_progress.as_ref().map(|s| StepSummary {
                duration_ns: 0,
                ..summarise(s)
            })
        } else {
            None
        };
        SlotSnapshot {
            index,
            claimed: self.is_claimed(),
            owner_pid: self.owner_pid.load(Ordering::Relaxed),
            generation: self.generation(),
            control: self.control.load(Ordering::Relaxed),
            writer_generation: raw.writer_generation,
            writer_pid: self.writer_pid.load(Ordering::Relaxed),
            heartbeats: self.heartbeats.load(Ordering::Relaxed),
            ack: self.ack.load(Ordering::Relaxed),
            step: raw.step,
            step_open,
            steps_completed: raw.steps_completed,
            depth,
            open_sections,
            current_step,
            recent_steps: ring.iter().map(summarise).collect(),
            misuse: raw.misuse,
            section_names: if names { self.read_names() } else { Vec::new() },
        }
    }

    fn read_names(&self) -> Vec<String> {
        let mut out: Vec<String> = WELL_KNOWN_SECTIONS.iter().map(|s| s.to_string()).collect();
        for entry in self.names.iter().skip(FIRST_USER_SECTION as usize) {
            out.push(read_name(entry).unwrap_or_default());
        }
        out
    }

    /// Copies the client-written state (step, stack, ring, counters) from `src`.
    ///
    /// Why: when the client moves between its private slot and an agent's
    /// slot, the agent must see the step and open sections as they are.
    pub(crate) fn copy_client_state_from(&self, src: &Slot) {
        let r = Ordering::Relaxed;
        let s = self.write_begin();
        self.heartbeats.store(src.heartbeats.load(r), r);
        self.step.store(src.step.load(r), r);
        self.steps_completed.store(src.steps_completed.load(r), r);
        self.ack.store(src.ack.load(r), r);
        self.depth.store(src.depth.load(r), r);
        self.flags.store(src.flags.load(r), r);
        self.step_depth.store(src.step_depth.load(r), r);
        self.misuse.store(src.misuse.load(r), r);
        for (d, e) in self.stack.iter().zip(&src.stack) {
            d.id.store(e.id.load(r), r);
            d.entered_ns.store(e.entered_ns.load(r), r);
        }
        for (d, e) in self.ring.iter().zip(&src.ring) {
            d.step.store(e.step.load(r), r);
            d.start_ns.store(e.start_ns.load(r), r);
            d.duration_ns.store(e.duration_ns.load(r), r);
            d.section_mask.store(e.section_mask.load(r), r);
            d.values_set.store(e.values_set.load(r), r);
            d.loss.store(e.loss.load(r), r);
            d.grad_norm.store(e.grad_norm.load(r), r);
            for (a, b) in d.section_ns.iter().zip(&e.section_ns) {
                a.store(b.load(r), r);
            }
        }
        self.write_end(s);
    }

    /// Writes a user section name into the table (cold path, once per name per slot).
    pub(crate) fn write_name(&self, id: u32, name: &str) {
        let Some(entry) = self.names.get(id as usize) else {
            return;
        };
        if id < FIRST_USER_SECTION {
            return;
        }
        let bytes = truncate_utf8(name, NAME_LEN).as_bytes();
        let mut buf = [0u8; NAME_LEN];
        buf[..bytes.len()].copy_from_slice(bytes);
        entry.len.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        for (word, chunk) in entry.bytes.iter().zip(buf.chunks_exact(8)) {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            word.store(u64::from_ne_bytes(w), Ordering::Relaxed);
        }
        entry.len.store(bytes.len() as u32, Ordering::Release);
    }

    /// Marks the slot as written by this process with this generation.
    ///
    /// The client calls it right after mapping its slot; public so the agent's
    /// tests and simulated ranks can stand in for a client.
    pub fn attach_writer(&self, generation: u64, pid: u32) {
        self.writer_pid.store(pid, Ordering::Relaxed);
        self.writer_generation.store(generation, Ordering::Release);
    }
}

fn read_name(entry: &NameEntry) -> Option<String> {
    let len = entry.len.load(Ordering::Acquire) as usize;
    if len == 0 || len > NAME_LEN {
        return None;
    }
    let mut buf = [0u8; NAME_LEN];
    for (chunk, word) in buf.chunks_exact_mut(8).zip(&entry.bytes) {
        chunk.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
    }
    fence(Ordering::Acquire);
    if entry.len.load(Ordering::Relaxed) as usize != len {
        return None;
    }
    Some(String::from_utf8_lossy(&buf[..len]).into_owned())
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

struct RawStep {
    step: u64,
    start_ns: u64,
    duration_ns: u64,
    mask: u32,
    sections: [u64; MAX_SECTIONS],
    values_set: u32,
    loss: u64,
    grad_norm: u64,
}

struct RawSlot {
    writer_generation: u64,
    step: u64,
    steps_completed: u64,
    depth: u32,
    flags: u32,
    misuse: u32,
    stack: [(u32, u64); MAX_DEPTH],
    ring: Vec<RawStep>,
}

/// The client's hot-path writer on one slot: a few relaxed stores per call.
///
/// Why a borrowed wrapper: the client swaps the slot under it (agent gone,
/// agent back) by swapping one pointer; a writer is rebuilt per call for free.
/// Timestamps are passed in so tests can drive time.
#[derive(Debug, Clone, Copy)]
pub struct SlotWriter<'a> {
    slot: &'a Slot,
}

impl<'a> SlotWriter<'a> {
    /// A writer on `slot`.
    #[inline(always)]
    pub fn new(slot: &'a Slot) -> Self {
        SlotWriter { slot }
    }

    /// Bumps the heartbeat counter: one load and one store, no RMW.
    #[inline(always)]
    pub fn heartbeat(self) {
        let h = &self.slot.heartbeats;
        h.store(h.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    /// Starts step `step` at `now_ns`; an open step is ended first.
    #[inline]
    pub fn step_begin(self, step: u64, now_ns: u64) {
        let s = self.slot;
        let seq = s.write_begin();
        if s.flags.load(Ordering::Relaxed) & FLAG_STEP_OPEN != 0 {
            self.finish_step(now_ns);
        }
        let head = s.steps_completed.load(Ordering::Relaxed);
        let rec = &s.ring[(head % RING_LEN as u64) as usize];
        rec.step.store(step, Ordering::Relaxed);
        rec.start_ns.store(now_ns, Ordering::Relaxed);
        rec.duration_ns.store(0, Ordering::Relaxed);
        rec.section_mask.store(0, Ordering::Relaxed);
        rec.values_set.store(0, Ordering::Relaxed);
        s.step.store(step, Ordering::Relaxed);
        s.flags.store(FLAG_STEP_OPEN, Ordering::Relaxed);
        s.step_depth
            .store(s.depth.load(Ordering::Relaxed), Ordering::Relaxed);
        self.push(SECTION_STEP, now_ns);
        s.heartbeats.store(
            s.heartbeats.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
        s.write_end(seq);
    }

    /// Ends the open step at `now_ns`, closing sections left open inside it.
    ///
    /// `step` is informational: the step that was begun is the one recorded.
    #[inline]
    pub fn step_end(self, _step: u64, now_ns: u64) {
        let s = self.slot;
        let seq = s.write_begin();
        if s.flags.load(Ordering::Relaxed) & FLAG_STEP_OPEN != 0 {
            self.finish_step(now_ns);
        } else {
            self.misuse();
        }
        s.heartbeats.store(
            s.heartbeats.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
        s.write_end(seq);
    }

    /// Opens section `id` at `now_ns` (ids out of range count as "other").
    #[inline]
    pub fn section_open(self, id: u32, now_ns: u64) {
        let id = if id == SECTION_STEP {
            // "step" is only pushed by step_begin; count the misuse, record as other.
            self.misuse();
            SECTION_OTHER
        } else if (id as usize) < MAX_SECTIONS {
            id
        } else {
            SECTION_OTHER
        };
        let s = self.slot;
        let seq = s.write_begin();
        self.push(id, now_ns);
        s.write_end(seq);
    }

    /// Closes section `id` at `now_ns`, and any section opened inside it.
    ///
    /// A close that matches nothing open inside the current step is counted as
    /// misuse and otherwise ignored, so a stray close never corrupts the stack.
    #[inline]
    pub fn section_close(self, id: u32, now_ns: u64) {
        let s = self.slot;
        let id = if (id as usize) < MAX_SECTIONS && id != SECTION_STEP {
            id
        } else {
            SECTION_OTHER
        };
        let seq = s.write_begin();
        let depth = s.depth.load(Ordering::Relaxed) as usize;
        if depth > MAX_DEPTH {
            // Past the recorded stack: only the count moves.
            s.depth.store(depth as u32 - 1, Ordering::Relaxed);
        } else if depth > 0 && s.stack[depth - 1].id.load(Ordering::Relaxed) == id {
            self.pop(now_ns);
        } else {
            // Search down, not crossing the open step.
            let floor = if s.flags.load(Ordering::Relaxed) & FLAG_STEP_OPEN != 0 {
                s.step_depth.load(Ordering::Relaxed) as usize + 1
            } else {
                0
            };
            let found = (floor..depth).rev().find(|&i| {
                s.stack
                    .get(i)
                    .is_some_and(|e| e.id.load(Ordering::Relaxed) == id)
            });
            match found {
                Some(i) => {
                    for _ in i..depth {
                        self.pop(now_ns);
                    }
                }
                None => self.misuse(),
            }
        }
        s.write_end(seq);
    }

    /// Records the step's loss and gradient norm (`None`: not reported).
    ///
    /// Into the open step's record, or, between steps, the step that just
    /// ended (a loop may read the loss after `step_end`); before any step,
    /// counted as misuse. Why in the ring: the agent reads the values with
    /// the step they belong to, and compares ranks at the same step (the SDC
    /// detector). Same cost as a section: one seqlock write of a few words.
    #[inline]
    pub fn report_values(self, loss: Option<f64>, grad_norm: Option<f64>) {
        let s = self.slot;
        let seq = s.write_begin();
        let head = s.steps_completed.load(Ordering::Relaxed);
        let index = if s.flags.load(Ordering::Relaxed) & FLAG_STEP_OPEN != 0 {
            Some(head)
        } else {
            head.checked_sub(1)
        };
        match index {
            Some(i) => {
                let rec = &s.ring[(i % RING_LEN as u64) as usize];
                let mut set = rec.values_set.load(Ordering::Relaxed);
                if let Some(v) = loss {
                    rec.loss.store(v.to_bits(), Ordering::Relaxed);
                    set |= VALUE_LOSS;
                }
                if let Some(v) = grad_norm {
                    rec.grad_norm.store(v.to_bits(), Ordering::Relaxed);
                    set |= VALUE_GRAD_NORM;
                }
                rec.values_set.store(set, Ordering::Relaxed);
            }
            None => self.misuse(),
        }
        s.write_end(seq);
    }

    /// The control word the agent set (decode with [`ControlWord::decode`]).
    pub fn control(self) -> u64 {
        self.slot.control.load(Ordering::Acquire)
    }

    /// The notice word the agent set (decode with [`NoticeWord::decode`]):
    /// one atomic load, cheap enough for every step boundary.
    /// With it, the step at whose boundary to save.
    #[inline]
    pub fn notice(self) -> (u64, u64) {
        let word = self.slot.notice.load(Ordering::Acquire);
        (word, self.slot.notice_step.load(Ordering::Relaxed))
    }

    /// Acknowledges a request: stores its `seq` into the ack word.
    pub fn ack(self, value: u64) {
        self.slot.ack.store(value, Ordering::Release);
    }

    /// Current nesting depth (for guards that close to a depth).
    pub fn depth(self) -> u32 {
        self.slot.depth.load(Ordering::Relaxed)
    }

    #[inline(always)]
    fn misuse(self) {
        let m = &self.slot.misuse;
        m.store(m.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }

    #[inline(always)]
    fn push(self, id: u32, now_ns: u64) {
        let s = self.slot;
        let d = s.depth.load(Ordering::Relaxed);
        if let Some(e) = s.stack.get(d as usize) {
            e.id.store(id, Ordering::Relaxed);
            e.entered_ns.store(now_ns, Ordering::Relaxed);
        }
        s.depth.store(d.saturating_add(1), Ordering::Relaxed);
    }

    /// Pops the top entry, adding its time to the open step's record.
    #[inline(always)]
    fn pop(self, now_ns: u64) {
        let s = self.slot;
        let d = s.depth.load(Ordering::Relaxed);
        if d == 0 {
            return;
        }
        let top = d - 1;
        s.depth.store(top, Ordering::Relaxed);
        let Some(e) = s.stack.get(top as usize) else {
            return;
        };
        let id = e.id.load(Ordering::Relaxed);
        if id == SECTION_STEP || s.flags.load(Ordering::Relaxed) & FLAG_STEP_OPEN == 0 {
            return;
        }
        let dur = now_ns.saturating_sub(e.entered_ns.load(Ordering::Relaxed));
        let head = s.steps_completed.load(Ordering::Relaxed);
        let rec = &s.ring[(head % RING_LEN as u64) as usize];
        let Some(total) = rec.section_ns.get(id as usize) else {
            return;
        };
        let bit = 1u32 << id;
        let mask = rec.section_mask.load(Ordering::Relaxed);
        if mask & bit != 0 {
            total.store(
                total.load(Ordering::Relaxed).wrapping_add(dur),
                Ordering::Relaxed,
            );
        } else {
            total.store(dur, Ordering::Relaxed);
            rec.section_mask.store(mask | bit, Ordering::Relaxed);
        }
    }

    /// Pops to and including the step entry and closes the record (inside a write).
    fn finish_step(self, now_ns: u64) {
        let s = self.slot;
        let step_depth = s.step_depth.load(Ordering::Relaxed);
        let target = step_depth.saturating_add(1);
        // Sections past MAX_DEPTH were never timed: drop them at once, so the
        // loop below runs at most MAX_DEPTH times whatever the slot holds.
        if s.depth.load(Ordering::Relaxed) > MAX_DEPTH as u32 {
            s.depth
                .store((MAX_DEPTH as u32).max(target), Ordering::Relaxed);
        }
        while s.depth.load(Ordering::Relaxed) > target {
            self.pop(now_ns);
        }
        let head = s.steps_completed.load(Ordering::Relaxed);
        let rec = &s.ring[(head % RING_LEN as u64) as usize];
        rec.duration_ns.store(
            now_ns.saturating_sub(rec.start_ns.load(Ordering::Relaxed)),
            Ordering::Relaxed,
        );
        // Drop the "step" entry itself (no accumulation for it).
        s.flags.store(0, Ordering::Relaxed);
        if s.depth.load(Ordering::Relaxed) > step_depth {
            s.depth.store(step_depth, Ordering::Relaxed);
        }
        s.steps_completed
            .store(head.wrapping_add(1), Ordering::Relaxed);
    }
}

mod memory;
pub use memory::{MEMFD_NAME, SEALS, SlotMemory, check_received, check_sealed, memory_len};

#[cfg(test)]
mod tests;
