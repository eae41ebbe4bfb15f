//! What can go wrong making, receiving or reading slot memory.
//!
//! One enum for the crate's memory paths (the table, the sealed memory, the
//! header check, the seqlock read): the agent maps it to its start-up error
//! and the client to its link status, both by message.

use std::io;
use std::path::PathBuf;

use crate::layout::{LAYOUT_VERSION, MAGIC, MAX_SLOTS};

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
