//! The client's mapping of its one slot memory, received from the agent.
//!
//! Why not [`crate::slot::SlotMemory`]: a mapping the client gives up must
//! stay harmless to write for as long as a training thread may still hold
//! the old pointer (a store racing the swap). So on retirement the client
//! replaces the pages in place with anonymous memory (`MAP_FIXED`): late
//! stores land in private memory, the agent's memory is no longer
//! referenced, and the address range stays valid until the client itself is
//! dropped. The memory is mapped only after [`crate::slot::check_received`]
//! found it sealed against shrinking, so no store can ever fault.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::slot::{Slot, SlotError, check_received, memory_len, slot_offset};

/// One slot memory, mapped read-write.
#[derive(Debug)]
pub(crate) struct SlotMapping {
    base: NonNull<libc::c_void>,
    len: usize,
    slot: NonNull<Slot>,
    retired: bool,
}

// SAFETY: the mapping is only accessed through `&Slot`, whose fields are all
// atomics; the raw pointers are owned exclusively by this value.
unsafe impl Send for SlotMapping {}
// SAFETY: as above, shared access goes through atomics only.
unsafe impl Sync for SlotMapping {}

impl SlotMapping {
    /// Checks the received `fd` (sealed, a one-slot header of this
    /// layout) and maps its slot. The descriptor is closed on return: the
    /// mapping holds the memory.
    pub(crate) fn from_fd(fd: OwnedFd) -> Result<SlotMapping, SlotError> {
        check_received(&fd)?;
        let io_err = |source| SlotError::Io {
            path: std::path::PathBuf::from("memfd:warden-slot"),
            op: "mmap",
            source,
        };
        let len = usize::try_from(memory_len())
            .map_err(|_| io_err(std::io::Error::other("slot memory too large")))?;
        // SAFETY: a fresh shared mapping of the whole memory, whose length
        // the header check proved and whose seals (checked above) keep it
        // so for every holder; fd is valid for the call.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io_err(std::io::Error::last_os_error()));
        }
        let Some(base) = NonNull::new(base) else {
            return Err(io_err(std::io::Error::other("null mapping")));
        };
        // SAFETY: slot_offset(0) + SLOT_SIZE == memory_len() == len, so the
        // slot lies inside the mapping.
        let slot_ptr = unsafe { base.as_ptr().cast::<u8>().add(slot_offset(0) as usize) };
        let Some(slot) = NonNull::new(slot_ptr.cast::<Slot>()) else {
            return Err(io_err(std::io::Error::other("null slot")));
        };
        Ok(SlotMapping {
            base,
            len,
            slot,
            retired: false,
        })
    }

    /// The mapped slot.
    pub(crate) fn slot(&self) -> &Slot {
        // SAFETY: the pointer lies inside our mapping, which lives as long as
        // self; offsets are 128-aligned within a page-aligned file; Slot is all
        // atomics and valid for any bytes (after retire: zeroes).
        unsafe { self.slot.as_ref() }
    }

    /// Raw pointer to the slot, for the client's `AtomicPtr` swap.
    pub(crate) fn slot_ptr(&self) -> *mut Slot {
        self.slot.as_ptr()
    }

    /// Replaces the file pages with private anonymous memory (see module docs).
    pub(crate) fn retire(&mut self) {
        if self.retired {
            return;
        }
        // SAFETY: MAP_FIXED over exactly the range we own; it atomically
        // replaces the file pages, so concurrent stores through old pointers
        // hit valid (anonymous) memory before and after.
        let r = unsafe {
            libc::mmap(
                self.base.as_ptr(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        // On failure the file mapping simply stays; still valid memory.
        self.retired = r != libc::MAP_FAILED;
    }
}

impl Drop for SlotMapping {
    fn drop(&mut self) {
        // SAFETY: base/len are the mapping we created; nothing references it
        // once its owner (the client) is dropped.
        unsafe { libc::munmap(self.base.as_ptr(), self.len) };
    }
}
