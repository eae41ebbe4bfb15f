//! Reading a slot: the header check and the seqlock snapshot.
//!
//! In: slot memory another process writes (untrusted). Out: a
//! [`SlotSnapshot`] of plain, sanitised values, or an error naming what was
//! wrong. Never: panic, index out of bounds, or trust a value from the
//! memory (every index is bounded, every count capped); never wait
//! unboundedly on a writer (`SNAPSHOT_RETRIES` attempts, then
//! [`SlotError::Inconsistent`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{Ordering, fence};

use crate::error::SlotError;
use crate::layout::{
    FIRST_USER_SECTION, FLAG_STEP_OPEN, HEADER_SIZE, LAYOUT_VERSION, MAGIC, MAX_DEPTH,
    MAX_SECTIONS, MAX_SLOTS, NAME_LEN, NameEntry, RING_LEN, SECTION_OTHER, SLOT_SIZE, Slot,
    VALUE_GRAD_NORM, VALUE_LOSS, WELL_KNOWN_SECTIONS, file_len,
};

/// Read attempts a snapshot makes before it reports the slot inconsistent.
pub(crate) const SNAPSHOT_RETRIES: u32 = 256;

/// Validates a header read from `path` (a file of `len` bytes); returns the slot count.
///
/// Shared by [`crate::SlotMemory::open`] and the client's one-slot mapping, so
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
    /// A consistent, sanitised copy of this slot (see [`crate::table::SlotTable::snapshot`]).
    pub fn snapshot(&self, index: u32) -> Result<SlotSnapshot, SlotError> {
        self.snapshot_recent(index, RING_LEN - 1)
    }

    /// A snapshot with at most `max_steps` completed steps (see [`crate::table::SlotTable::snapshot_recent`]).
    pub fn snapshot_recent(&self, index: u32, max_steps: usize) -> Result<SlotSnapshot, SlotError> {
        self.snapshot_inner(index, max_steps, true)
    }

    pub(crate) fn snapshot_inner(
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
}

pub(crate) fn read_name(entry: &NameEntry) -> Option<String> {
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
