//! The bytes both sides agree on: sizes, offsets, the well-known section
//! ids, the header and slot structs, and the two words the agent writes
//! for the client ([`ControlWord`], [`NoticeWord`]).
//!
//! In: nothing (definitions). Out: the `#[repr(C)]` structs every other
//! module reads or writes, checked by const asserts against the sizes and
//! offsets a peer of another build relies on. Never: change an offset or
//! size without bumping [`LAYOUT_VERSION`] (an agent and a client of
//! different builds refuse each other by it).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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

pub(crate) const STATE_FREE: u32 = 0;
pub(crate) const STATE_CLAIMED: u32 = 1;
pub(crate) const FLAG_STEP_OPEN: u32 = 1;
/// Bit of a step record's `values_set`: `loss` holds a reported loss.
pub(crate) const VALUE_LOSS: u32 = 1;
/// Bit of a step record's `values_set`: `grad_norm` holds a reported norm.
pub(crate) const VALUE_GRAD_NORM: u32 = 2;

/// The header of a slot memory. Written once by [`crate::memory::SlotMemory::create`].
#[repr(C, align(128))]
#[derive(Debug)]
pub struct FileHeader {
    pub(crate) magic: AtomicU64,
    pub(crate) layout_version: AtomicU32,
    pub(crate) header_size: AtomicU32,
    pub(crate) slot_size: AtomicU32,
    pub(crate) slot_count: AtomicU32,
    pub(crate) created_ns: AtomicU64,
    _reserved: [AtomicU64; 12],
}

#[repr(C)]
#[derive(Debug)]
pub(crate) struct StackEntry {
    pub(crate) id: AtomicU32,
    _pad: AtomicU32,
    pub(crate) entered_ns: AtomicU64,
}

#[repr(C)]
#[derive(Debug)]
pub(crate) struct NameEntry {
    /// Byte length of the name; 0 = unset. Written last (Release).
    pub(crate) len: AtomicU32,
    _pad: AtomicU32,
    pub(crate) bytes: [AtomicU64; NAME_LEN / 8],
}

#[repr(C)]
#[derive(Debug)]
pub(crate) struct StepRecord {
    pub(crate) step: AtomicU64,
    pub(crate) start_ns: AtomicU64,
    pub(crate) duration_ns: AtomicU64,
    /// Bit `i` set: `section_ns[i]` holds this step's total for section `i`.
    pub(crate) section_mask: AtomicU32,
    /// [`VALUE_LOSS`] / [`VALUE_GRAD_NORM`]: which of the values below the
    /// client reported for this step (a NaN is a value, so no sentinel).
    pub(crate) values_set: AtomicU32,
    /// The step's loss, as `f64` bits.
    pub(crate) loss: AtomicU64,
    /// The step's gradient norm, as `f64` bits.
    pub(crate) grad_norm: AtomicU64,
    pub(crate) section_ns: [AtomicU64; MAX_SECTIONS],
}

/// One rank's slot. Opaque: written through [`crate::write::SlotWriter`], read
/// through [`crate::table::SlotTable::snapshot`] or [`Slot::snapshot`].
#[repr(C, align(128))]
#[derive(Debug)]
pub struct Slot {
    // ---- the agent's line
    pub(crate) state: AtomicU32,
    pub(crate) owner_pid: AtomicU32,
    pub(crate) generation: AtomicU64,
    pub(crate) claimed_ns: AtomicU64,
    /// Agent -> client: the latest request ([`ControlWord::encode`]; 0 =
    /// none). Written by the agent only; cleared at claim.
    pub(crate) control: AtomicU64,
    /// Agent -> client: a notice of a coming stop ([`NoticeWord::encode`];
    /// 0 = none). Written by the agent only, on every tick while the
    /// notice stands; cleared at claim.
    pub(crate) notice: AtomicU64,
    /// Agent -> client, with `notice`: the step at whose boundary the rank
    /// saves (the step after the job's furthest rank's when the agent told
    /// them), so every rank saves the same step. Stored before `notice`.
    pub(crate) notice_step: AtomicU64,
    _agent_pad: [AtomicU64; 10],
    // ---- the client's hot line
    pub(crate) seq: AtomicU64,
    pub(crate) writer_generation: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    pub(crate) step: AtomicU64,
    pub(crate) steps_completed: AtomicU64,
    /// Client -> agent: the `seq` of the last request the rank acknowledged
    /// (see [`ControlWord`]). Carried across slot swaps like the rest of
    /// the client's line.
    pub(crate) ack: AtomicU64,
    pub(crate) writer_pid: AtomicU32,
    pub(crate) depth: AtomicU32,
    pub(crate) flags: AtomicU32,
    /// Depth (stack index) at which the open step's "step" entry sits.
    pub(crate) step_depth: AtomicU32,
    pub(crate) misuse: AtomicU32,
    _client_pad32: AtomicU32,
    _client_pad: [AtomicU64; 7],
    // ---- the rest
    pub(crate) stack: [StackEntry; MAX_DEPTH],
    pub(crate) names: [NameEntry; MAX_SECTIONS],
    pub(crate) ring: [StepRecord; RING_LEN],
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

    /// The generation the agent stamped at claim (0: never claimed).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the agent currently has the slot handed out.
    pub fn is_claimed(&self) -> bool {
        self.state.load(Ordering::Acquire) == STATE_CLAIMED
    }
}
