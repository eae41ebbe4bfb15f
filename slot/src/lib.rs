//! What a training rank and its local agent share below gRPC: the
//! shared-memory heartbeat slot, the socket that hands it over, the clock
//! its timestamps are in, and where the agent's socket is.
//!
//! Why a crate of its own: the client (linked into every rank, with its
//! gRPC link) and the agent (which owns the slots) must agree on these
//! bytes to the offset, and the agent must not link the rank's library to
//! get them. Both depend on this crate; it depends on neither, and on no
//! tonic, tokio or protobuf.
//!
//! # Layout
//! - [`layout`]: sizes, offsets, the header and slot structs, the
//!   well-known section ids, the [`ControlWord`] and [`NoticeWord`] the
//!   agent writes for the client.
//! - [`read`]: the header check and the seqlock [`SlotSnapshot`] (the
//!   memory is untrusted: every value bounded).
//! - [`write`](mod@write): the hot-path [`SlotWriter`] and the client's moves between
//!   slots.
//! - [`table`]: the agent's [`SlotTable`] (claim, release, snapshot).
//! - [`memory`]: one slot's sealed memfd, [`SlotMemory`].
//! - [`socket`]: the slot socket protocol (`<api socket>.fd`, SCM_RIGHTS),
//!   both ends.
//! - [`clock`]: the `CLOCK_MONOTONIC` nanoseconds the slot carries (TSC on
//!   the client's hot path, the syscall for the agent).
//! - [`paths`]: where the agent's socket is, the one rule for agent, CLI
//!   and client.
//! - [`text`]: [`truncate_utf8`], cutting text to a byte budget on a
//!   character boundary.
//! - `error`: [`SlotError`].
//!
//! # The slot
//!
//! The agent owns one sealed memfd per slot ([`SlotMemory`]: a
//! [`FileHeader`] of 128 bytes and one fixed-size [`Slot`]), kept in its
//! [`SlotTable`]. It claims slot `i` for a rank ([`SlotTable::claim`]) and
//! hands that slot's descriptor to the rank's process alone over the slot
//! socket ([`socket`]); the rank maps it read-write and writes
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
//! Timestamps are `CLOCK_MONOTONIC` nanoseconds (see [`clock`]); the
//! client's are TSC-derived and may lead the agent's own reading by a few
//! microseconds, so subtract with saturation. A heartbeat carries no
//! timestamp (a clock read would triple its cost): the agent notes when it
//! saw the counter move. Step boundaries also bump the counter.

pub mod clock;
mod error;
pub mod layout;
pub mod memory;
pub mod paths;
pub mod read;
pub mod socket;
pub mod table;
pub mod text;
pub mod write;

pub use error::SlotError;
pub use layout::{
    CONTROL_MAX_RESTART_COUNT, CONTROL_RESTART, ControlWord, FIRST_USER_SECTION, FileHeader,
    HEADER_SIZE, LAYOUT_VERSION, MAGIC, MAX_DEPTH, MAX_SECTIONS, MAX_SLOTS, NAME_LEN,
    NOTICE_SOURCES, NoticeWord, RING_LEN, SECTION_BACKWARD, SECTION_CHECKPOINT, SECTION_DATA,
    SECTION_FORWARD, SECTION_INIT, SECTION_OPTIMIZER, SECTION_OTHER, SECTION_STEP, SLOT_SIZE, Slot,
    WELL_KNOWN_SECTIONS, file_len, slot_offset, well_known_id,
};
pub use memory::{MEMFD_NAME, SEALS, SlotMemory, check_received, check_sealed, memory_len};
pub use read::{OpenSection, SectionTime, SlotSnapshot, StepSummary, validate_header};
pub use table::SlotTable;
pub use text::truncate_utf8;
pub use write::SlotWriter;

#[cfg(test)]
mod tests;
