//! One rank's slot memory: a sealed memfd, never a file anyone can open.
//!
//! In: a registration (the agent creates one [`SlotMemory`] per slot
//! index) or a descriptor received over the slot socket (the client checks
//! it with [`check_sealed`] and the header before mapping it). Out: the
//! mapped [`Slot`]. Never: map memory whose size someone else could change.
//!
//! Why a memfd sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`: a
//! shared file could be truncated by anyone allowed to open it, and every
//! process mapping it would die of SIGBUS on its next store. A memfd has no
//! name in any directory, so nobody can open, replace or unlink it; it
//! reaches a process only as a descriptor the agent hands over
//! ([`crate::socket`]), and the seals make its size fixed for every
//! holder, the agent included. A holder can still write garbage into it;
//! the reader bounds every value (see [`crate::read`]), so garbage costs at most
//! that rank's heartbeats.
//!
//! Layout: the usual [`FileHeader`] with a slot count of 1, then the
//! one slot at [`slot_offset`]`(0)`: the same bytes a one-slot file
//! had, so the reader and the writer are unchanged.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::Ordering;

use memmap2::MmapMut;
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};

use crate::error::SlotError;
use crate::layout::{
    FileHeader, HEADER_SIZE, LAYOUT_VERSION, MAGIC, SLOT_SIZE, Slot, file_len, slot_offset,
};
use crate::read::read_header;
use crate::write::SlotWriter;

/// The seals every slot memory carries: its size can change no more, and
/// no seal can be added or removed. `F_SEAL_WRITE` is left off: the rank
/// writes its heartbeats into it.
pub const SEALS: SealFlag = SealFlag::F_SEAL_SHRINK
    .union(SealFlag::F_SEAL_GROW)
    .union(SealFlag::F_SEAL_SEAL);

/// What the memfd is called in `/proc/PID/maps` and `/proc/PID/fd`
/// (`/memfd:warden-slot (deleted)`): a name for people, not a path.
pub const MEMFD_NAME: &str = "warden-slot";

/// Size of one slot memory: the header and one slot.
pub fn memory_len() -> u64 {
    file_len(1)
}

/// The name errors give a slot memory (it has no path).
fn label() -> &'static Path {
    Path::new("memfd:warden-slot")
}

fn io_err(op: &'static str) -> impl Fn(std::io::Error) -> SlotError {
    move |source| SlotError::Io {
        path: label().to_owned(),
        op,
        source,
    }
}

/// Checks that `fd` carries at least [`SEALS`]' shrink and grow seals.
///
/// Why the client checks what the agent promises: a rank maps only memory
/// whose size nobody can change, so no one (not even a rogue process
/// answering on the slot socket) can make it die of SIGBUS.
pub fn check_sealed(fd: BorrowedFd<'_>) -> Result<(), SlotError> {
    let found = fcntl(fd, FcntlArg::F_GET_SEALS)
        .map_err(|e| io_err("read seals (F_GET_SEALS)")(e.into()))?;
    let found = SealFlag::from_bits_truncate(found);
    let need = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW;
    if found.contains(need) {
        Ok(())
    } else {
        Err(SlotError::NotSealed {
            found: found.bits(),
        })
    }
}

/// Checks a received descriptor: sealed, and holding a one-slot header of
/// this build's layout with a length that covers it.
pub fn check_received(fd: &OwnedFd) -> Result<(), SlotError> {
    check_sealed(fd.as_fd())?;
    let file = File::from(fd.try_clone().map_err(io_err("dup"))?);
    let (count, _) = read_header(label(), &file)?;
    if count != 1 {
        return Err(SlotError::BadSlotCount(count.into()));
    }
    Ok(())
}

/// One slot's memory, as the agent holds it: the sealed memfd (to hand to
/// the rank) and the agent's own mapping of it (to read on every tick).
#[derive(Debug)]
pub struct SlotMemory {
    fd: OwnedFd,
    map: MmapMut,
}

impl SlotMemory {
    /// Creates, sizes, stamps and seals a fresh slot memory.
    pub fn create() -> Result<SlotMemory, SlotError> {
        let fd = memfd_create(
            MEMFD_NAME,
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(|e| io_err("memfd_create")(e.into()))?;
        let file = File::from(fd.try_clone().map_err(io_err("dup"))?);
        file.set_len(memory_len()).map_err(io_err("ftruncate"))?;
        fcntl(fd.as_fd(), FcntlArg::F_ADD_SEALS(SEALS))
            .map_err(|e| io_err("seal (F_ADD_SEALS)")(e.into()))?;
        // SAFETY: the memfd is ours, sized above and sealed against
        // shrinking and growing, so the mapping stays backed for its life.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(io_err("mmap"))?;
        let this = SlotMemory { fd, map };
        this.stamp_header();
        Ok(this)
    }

    /// Writes the header (again).
    ///
    /// Why again at each claim: every holder of the memory can write into
    /// it, header included; the next rank handed this slot must find a
    /// header it accepts, whatever an earlier holder left there.
    pub(crate) fn stamp_header(&self) {
        let h = self.header();
        h.layout_version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.header_size.store(HEADER_SIZE as u32, Ordering::Relaxed);
        h.slot_size.store(SLOT_SIZE as u32, Ordering::Relaxed);
        h.slot_count.store(1, Ordering::Relaxed);
        h.created_ns
            .store(crate::clock::now_ns(), Ordering::Relaxed);
        // Magic last: a reader that sees it sees a complete header.
        h.magic.store(MAGIC, Ordering::Release);
    }

    /// Maps a slot memory received as `fd` (for tools and tests that act
    /// as a rank without warden-client's `Client`), after [`check_received`].
    pub fn open(fd: OwnedFd) -> Result<SlotMemory, SlotError> {
        check_received(&fd)?;
        let file = File::from(fd.try_clone().map_err(io_err("dup"))?);
        // SAFETY: the memfd is sealed against shrinking (checked above) and
        // at least memory_len() long (read_header checked), so every page of
        // the mapping stays backed.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .len(memory_len() as usize)
                .map_mut(&file)
        }
        .map_err(io_err("mmap"))?;
        Ok(SlotMemory { fd, map })
    }

    /// The memfd, to hand to the rank that holds this slot.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn header(&self) -> &FileHeader {
        // SAFETY: the map is page-aligned and memory_len() >= HEADER_SIZE
        // long; FileHeader is all atomics, valid for any bytes.
        unsafe { &*(self.map.as_ptr() as *const FileHeader) }
    }

    /// A writer on the slot: for tools, tests and benches that act as a rank
    /// without warden-client's `Client`.
    pub fn writer(&self) -> SlotWriter<'_> {
        SlotWriter::new(self.slot())
    }

    /// The slot.
    pub fn slot(&self) -> &Slot {
        // SAFETY: the map covers file_len(1) bytes, so slot 0 lies inside
        // it; its offset is a multiple of 128 from a page-aligned base,
        // satisfying Slot's alignment; Slot is all atomics, valid for any
        // bit pattern and safe to share across processes.
        unsafe { &*(self.map.as_ptr().add(slot_offset(0) as usize) as *const Slot) }
    }
}
