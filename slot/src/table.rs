//! The agent's slots: one sealed memory per slot index, claimed for a
//! rank, released, and read on every tick.
//!
//! In: the agent's claims and releases, its control and notice words. Out:
//! each slot's memory (whose descriptor the slot socket hands over) and
//! snapshots of what the ranks wrote. Never: hand one rank's memory to
//! another index, or fail a read for an index out of range other than with
//! [`SlotError::IndexOutOfRange`].

use std::sync::atomic::Ordering;

use crate::error::SlotError;
#[cfg(doc)]
use crate::layout::{ControlWord, NoticeWord};
use crate::layout::{
    FIRST_USER_SECTION, MAX_SLOTS, STATE_CLAIMED, STATE_FREE, Slot, WELL_KNOWN_SECTIONS,
};
use crate::memory::SlotMemory;
use crate::read::{SlotSnapshot, read_name};
use crate::write::SlotWriter;

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
