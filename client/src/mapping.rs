//! The client's mapping of its one slot in the agent's slot file.
//!
//! Why not [`crate::slot::SlotFile`]: a rank needs only its own slot, and a
//! mapping it gives up must stay harmless to write for as long as a training
//! thread may still hold the old pointer (a store racing the swap). So the
//! client maps just the pages around its slot, and on retirement replaces
//! them in place with anonymous memory (`MAP_FIXED`): late stores land in
//! private memory, the agent's file is no longer referenced, and the address
//! range stays valid until the client itself is dropped.

use std::fs::OpenOptions;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::slot::{SLOT_SIZE, Slot, SlotError, read_header, slot_offset};

/// One slot of an agent's file, mapped read-write.
#[derive(Debug)]
pub(crate) struct SlotMapping {
    base: NonNull<libc::c_void>,
    len: usize,
    slot: NonNull<Slot>,
    /// Device and inode of the file mapped, to notice the agent replacing it.
    pub(crate) file_id: (u64, u64),
    pub(crate) path: PathBuf,
    retired: bool,
}

// SAFETY: the mapping is only accessed through `&Slot`, whose fields are all
// atomics; the raw pointers are owned exclusively by this value.
unsafe impl Send for SlotMapping {}
// SAFETY: as above, shared access goes through atomics only.
unsafe impl Sync for SlotMapping {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

impl SlotMapping {
    /// Opens `path`, validates its header, and maps slot `index`.
    pub(crate) fn open(path: &Path, index: u32) -> Result<SlotMapping, SlotError> {
        let io_err = |op| {
            move |source| SlotError::Io {
                path: path.to_owned(),
                op,
                source,
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err("open"))?;
        let (count, _) = read_header(path, &file)?;
        if index >= count {
            return Err(SlotError::IndexOutOfRange { index, count });
        }
        let meta = file.metadata().map_err(io_err("fstat"))?;
        let page = page_size() as u64;
        let start = slot_offset(index);
        let map_start = start - start % page;
        let map_end = (start + SLOT_SIZE as u64).div_ceil(page) * page;
        let len = (map_end - map_start) as usize;
        // SAFETY: a fresh shared mapping of a range the header check proved
        // lies inside the file (the last page may extend past EOF only within
        // the final page, which the kernel zero-fills and we never touch
        // beyond the slot); fd is valid for the call.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                map_start as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io_err("mmap")(std::io::Error::last_os_error()));
        }
        let Some(base) = NonNull::new(base) else {
            return Err(io_err("mmap")(std::io::Error::other("null mapping")));
        };
        // SAFETY: start - map_start < page <= len, so the slot starts inside the mapping.
        let slot_ptr = unsafe { base.as_ptr().cast::<u8>().add((start - map_start) as usize) };
        let Some(slot) = NonNull::new(slot_ptr.cast::<Slot>()) else {
            return Err(io_err("mmap")(std::io::Error::other("null slot")));
        };
        Ok(SlotMapping {
            base,
            len,
            slot,
            file_id: (meta.dev(), meta.ino()),
            path: path.to_owned(),
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
