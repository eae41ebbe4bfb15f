//! Writing a slot: the client's hot path, and the client-side moves (attach,
//! reset, carry state between slots, section names).
//!
//! In: the training loop's calls, with their timestamps. Out: a few
//! relaxed stores into the slot, multi-word updates inside the seqlock.
//! Never: a syscall, a lock or an allocation on the hot path, or a panic
//! on a slot whose client line holds garbage (every index from the memory
//! is bounded before use).

use std::sync::atomic::{Ordering, fence};

#[cfg(doc)]
use crate::layout::{ControlWord, NoticeWord};
use crate::layout::{
    FIRST_USER_SECTION, FLAG_STEP_OPEN, MAX_DEPTH, MAX_SECTIONS, NAME_LEN, RING_LEN, SECTION_OTHER,
    SECTION_STEP, Slot, VALUE_GRAD_NORM, VALUE_LOSS,
};
use crate::text::truncate_utf8;

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

impl Slot {
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

    /// Clears everything the client writes (step, stack, ring, counters).
    pub fn reset_client_area(&self) {
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

    /// Copies the client-written state (step, stack, ring, counters) from `src`.
    ///
    /// Why: when the client moves between its private slot and an agent's
    /// slot, the agent must see the step and open sections as they are.
    pub fn copy_client_state_from(&self, src: &Slot) {
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
    pub fn write_name(&self, id: u32, name: &str) {
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
