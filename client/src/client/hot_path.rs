//! The hot path: what the training loop calls, a few stores into whichever
//! slot is current, and the section names those calls intern.
//!
//! In: heartbeats, step boundaries, section opens and closes, the step's
//! values, from the training thread. Out: relaxed atomic stores through a
//! [`SlotWriter`] on the slot `Inner::current` points at (the agent's or
//! the private one). Never: a syscall, a lock, an allocation or an error
//! (a new section name takes a lock once, on first use); never a wait on
//! the agent.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::{Client, Inner};
use crate::clock;
#[cfg(doc)]
use crate::slot::ControlWord;
use crate::slot::{
    FIRST_USER_SECTION, MAX_SECTIONS, NoticeWord, SECTION_OTHER, Slot, SlotWriter, well_known_id,
};

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
pub(super) struct Names {
    pub(super) user: [OnceLock<Box<str>>; MAX_SECTIONS],
    /// Held to assign ids and to write names into a slot (also across swaps).
    lock: Mutex<()>,
}

impl Names {
    pub(super) fn new() -> Names {
        Names {
            user: std::array::from_fn(|_| OnceLock::new()),
            lock: Mutex::new(()),
        }
    }

    /// Lock-free lookup: well-known names, then the user table in order.
    #[inline]
    pub(super) fn lookup(&self, name: &str) -> Option<u32> {
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

    pub(super) fn guard(&self) -> MutexGuard<'_, ()> {
        match self.lock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub(super) fn write_all(&self, slot: &Slot) {
        for (id, entry) in self.user.iter().enumerate() {
            if let Some(n) = entry.get() {
                slot.write_name(id as u32, n);
            }
        }
    }
}

impl Inner {
    /// A writer on the slot the hot path writes now.
    #[inline(always)]
    pub(super) fn writer(&self) -> SlotWriter<'_> {
        let p = self.current.load(Ordering::Acquire);
        // SAFETY: `current` only ever holds `dummy` (owned by self) or the
        // slot of a mapping in `mappings`, which are never unmapped before
        // self is dropped (retired ones are remapped anonymous, still valid).
        SlotWriter::new(unsafe { &*p })
    }
}

impl Client {
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
    pub fn notice(&self) -> Option<(NoticeWord, u64)> {
        let (word, step) = self.inner.writer().notice();
        NoticeWord::decode(word).map(|n| (n, step))
    }

    /// Stores `value` into the slot's ack word as is. Prefer
    /// [`Client::ack_restart`], which also tells the agent over gRPC.
    pub fn ack(&self, value: u64) {
        self.inner.writer().ack(value);
    }
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
