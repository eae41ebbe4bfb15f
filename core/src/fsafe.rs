//! Files in the agent's own trees, opened so that nobody else can redirect
//! them: the checkpoint tier and the state dir (goodput journals,
//! incidents, the cordon, the node condition, calibrations, job owners);
//! the slot dir's stack dumps are read with [`open_leaf`].
//!
//! In: a directory the agent owns ([`Dir::ensure`]) and single names under
//! it. Out: descriptors of directories and regular files reached one
//! component at a time with `O_NOFOLLOW` relative to a directory
//! descriptor (the effect of `openat2`'s `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS`, on every kernel), random names from the kernel's
//! generator, renames and removals relative to directory descriptors.
//! Never: follows a symlink, takes a name with `/` or `..`, opens something
//! that is not a regular file or a directory, or keeps using a directory
//! that someone other than the agent owns or may write. Every refusal
//! names the path and why.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, openat, renameat};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};

/// Why a file or directory of the agent's tree was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// A symlink where the agent expects its own file or directory.
    #[error("{0} is a symlink; the agent never follows one in its own tree (refused)")]
    Symlink(String),
    /// Something else than the kind expected (a FIFO, a device, a dir...).
    #[error("{path} is not a {want} (refused)")]
    Kind {
        /// The path.
        path: String,
        /// "regular file" or "directory".
        want: &'static str,
    },
    /// Owned by someone other than expected.
    #[error("{path} is owned by uid {uid}, not by uid {want} (refused)")]
    Owner {
        /// The path.
        path: String,
        /// Its owner.
        uid: u32,
        /// Who should own it.
        want: u32,
    },
    /// A directory someone other than the agent may write.
    #[error(
        "{path} has mode {mode:04o}: group or others may write it; the agent's directories must be writable by the agent alone (refused)"
    )]
    Writable {
        /// The path.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// A file with more than one name: it may be reached from elsewhere.
    #[error("{path} has {links} hard links; the agent takes only files with one (refused)")]
    Links {
        /// The path.
        path: String,
        /// Its link count.
        links: u64,
    },
    /// A name that is not one plain component.
    #[error("{0:?} is not a plain file name (refused)")]
    BadName(String),
    /// The system said no.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

impl FsError {
    /// True when the file or directory was simply not there.
    pub fn is_not_found(&self) -> bool {
        matches!(self, FsError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

fn io_err(what: &'static str, path: &Path, e: impl Into<std::io::Error>) -> FsError {
    FsError::Io {
        what,
        path: path.display().to_string(),
        source: e.into(),
    }
}

/// The error of an open with `O_NOFOLLOW`: ELOOP means a symlink.
fn open_err(what: &'static str, path: &Path, e: Errno) -> FsError {
    match e {
        Errno::ELOOP => FsError::Symlink(path.display().to_string()),
        Errno::ENOTDIR => FsError::Kind {
            path: path.display().to_string(),
            want: "directory",
        },
        e => io_err(what, path, e),
    }
}

/// `name` as one component: no `/`, not `.` or `..`, not empty.
fn check_name(name: &str) -> Result<(), FsError> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(FsError::BadName(name.to_owned()));
    }
    Ok(())
}

/// A name nobody can predict: `prefix` and 128 bits from the kernel's
/// random generator (getrandom(2)), in hex.
pub fn random_name(prefix: &str) -> Result<String, FsError> {
    let mut buf = [0u8; 16];
    let mut filled = 0;
    while filled < buf.len() {
        let rest = buf.get_mut(filled..).unwrap_or_default();
        // SAFETY: `rest` is a live, writable buffer of `rest.len()` bytes
        // for the whole call; getrandom writes at most that many.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io_err("getrandom for", Path::new(prefix), e));
        }
        filled += usize::try_from(n).unwrap_or(0);
    }
    let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{prefix}{hex}"))
}

/// The ids a file is handed to (a rank's, from its socket's peer
/// credentials); None where used: keep the agent's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

/// The agent's effective uid: who owns its trees.
pub fn me() -> u32 {
    Uid::effective().as_raw()
}

/// The mode of `agent.state_dir`: checked at start (daemon) and by each
/// module that keeps files there when it opens it.
pub const STATE_DIR_MODE: u32 = 0o750;

/// An open directory of the agent's tree, with the path it stands for
/// (for messages only: every operation goes through the descriptor).
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

impl Dir {
    /// Creates `path` (parents as needed, the last with `mode`) and opens
    /// it. The last component must not be a symlink and must be the
    /// agent's; group/other write bits are taken off (it is the agent's)
    /// and the mode set to `mode`. The parents are the operator's choice
    /// (config), followed as the system resolves them.
    pub fn ensure(path: &Path, mode: u32) -> Result<Self, FsError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
        }
        match nix::unistd::mkdir(path, Mode::from_bits_truncate(mode)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(io_err("creating", path, e)),
        }
        let fd = nix::fcntl::open(path, DIR_FLAGS, Mode::empty()).map_err(|e| {
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => FsError::Symlink(path.display().to_string()),
                _ => open_err("opening", path, e),
            }
        })?;
        let d = Self {
            fd,
            path: path.to_owned(),
        };
        d.own(mode)?;
        Ok(d)
    }

    /// Checks the directory is the agent's and sets its mode to `mode`.
    fn own(&self, mode: u32) -> Result<(), FsError> {
        let st = fstat(&self.fd).map_err(|e| io_err("inspecting", &self.path, e))?;
        kind(&st, &self.path, SFlag::S_IFDIR, "directory")?;
        if st.st_uid != me() {
            return Err(FsError::Owner {
                path: self.path.display().to_string(),
                uid: st.st_uid,
                want: me(),
            });
        }
        if st.st_mode & 0o7777 != mode {
            fchmod(&self.fd, Mode::from_bits_truncate(mode))
                .map_err(|e| io_err("setting the mode of", &self.path, e))?;
        }
        Ok(())
    }

    /// The path it stands for.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The subdirectory `name` opened (created first with `mode` when
    /// given), never through a symlink (one in its place is refused by
    /// name), and checked to be a directory: its descriptor, status and
    /// path, for the caller's owner and mode rules.
    fn open_sub(
        &self,
        name: &str,
        create: Option<u32>,
    ) -> Result<(OwnedFd, FileStat, PathBuf), FsError> {
        check_name(name)?;
        let path = self.join(name);
        if let Some(mode) = create {
            match mkdirat(&self.fd, name, Mode::from_bits_truncate(mode)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(io_err("creating", &path, e)),
            }
        }
        let fd = openat(&self.fd, name, DIR_FLAGS, Mode::empty()).map_err(|e| {
            // O_DIRECTORY on a symlink says ENOTDIR: say what it is.
            match self.stat(name) {
                Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFLNK => {
                    FsError::Symlink(path.display().to_string())
                }
                _ => open_err("opening", &path, e),
            }
        })?;
        let st = fstat(&fd).map_err(|e| io_err("inspecting", &path, e))?;
        kind(&st, &path, SFlag::S_IFDIR, "directory")?;
        Ok((fd, st, path))
    }

    /// The subdirectory `name`, created with `mode` when `create`; must be
    /// the agent's and not writable by anyone else.
    pub fn sub(&self, name: &str, mode: u32, create: bool) -> Result<Dir, FsError> {
        let (fd, st, path) = self.open_sub(name, create.then_some(mode))?;
        if st.st_uid != me() {
            return Err(FsError::Owner {
                path: path.display().to_string(),
                uid: st.st_uid,
                want: me(),
            });
        }
        if st.st_mode & 0o022 != 0 {
            // The agent's own, left open by an older version or by hand:
            // closed again (what is inside is checked file by file).
            fchmod(&fd, Mode::from_bits_truncate(mode)).map_err(|_| FsError::Writable {
                path: path.display().to_string(),
                mode: st.st_mode & 0o7777,
            })?;
            tracing::warn!(path = %path.display(), was = format!("{:04o}", st.st_mode & 0o7777),
                now = format!("{mode:04o}"), "directory of the agent's tree was writable by others; mode fixed");
        }
        Ok(Dir { fd, path })
    }

    /// The subdirectory `name` handed to `owner` (mode 0700): created by
    /// the agent when missing, then given with `fchown` on its descriptor
    /// (never a path). One already there must be the agent's (not yet
    /// given) or `owner`'s: since only the agent creates entries in its own
    /// directories, another user's is refused with its owner. Returns its
    /// path, which `owner` then uses as it likes; the agent reads nothing
    /// in it.
    pub fn user_sub(&self, name: &str, owner: Owner) -> Result<PathBuf, FsError> {
        let (fd, st, path) = self.open_sub(name, Some(0o700))?;
        if st.st_uid == me() && owner.uid != me() {
            fchown(
                &fd,
                Some(Uid::from_raw(owner.uid)),
                Some(Gid::from_raw(owner.gid)),
            )
            .map_err(|e| io_err("handing over", &path, e))?;
        } else if st.st_uid != owner.uid {
            return Err(FsError::Owner {
                path: path.display().to_string(),
                uid: st.st_uid,
                want: owner.uid,
            });
        }
        if st.st_uid == me() && st.st_mode & 0o077 != 0 {
            fchmod(&fd, Mode::from_bits_truncate(0o700))
                .map_err(|e| io_err("closing", &path, e))?;
        }
        Ok(path)
    }

    /// Opens the regular file `name` for reading, never through a symlink
    /// (nor a FIFO: opened non-blocking, then checked).
    pub fn open_file(&self, name: &str) -> Result<(File, FileStat), FsError> {
        self.open_with(name, OFlag::O_RDONLY)
    }

    /// Opens the regular file `name` for reading and writing.
    pub fn open_rw(&self, name: &str) -> Result<(File, FileStat), FsError> {
        self.open_with(name, OFlag::O_RDWR)
    }

    fn open_with(&self, name: &str, access: OFlag) -> Result<(File, FileStat), FsError> {
        check_name(name)?;
        let path = self.join(name);
        let fd = openat(
            &self.fd,
            name,
            access | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
            Mode::empty(),
        )
        .map_err(|e| open_err("opening", &path, e))?;
        let st = fstat(&fd).map_err(|e| io_err("inspecting", &path, e))?;
        kind(&st, &path, SFlag::S_IFREG, "regular file")?;
        let f = File::from(fd);
        clear_nonblock(&f, &path)?;
        Ok((f, st))
    }

    /// Creates the new file `name` (`O_CREAT | O_EXCL | O_NOFOLLOW`, so
    /// nothing already there, link or not, is ever opened) with `mode`.
    pub fn create_new(&self, name: &str, mode: u32) -> Result<File, FsError> {
        check_name(name)?;
        let path = self.join(name);
        let fd = openat(
            &self.fd,
            name,
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(mode),
        )
        .map_err(|e| open_err("creating", &path, e))?;
        Ok(File::from(fd))
    }

    /// A new file with a random name (see [`random_name`]) and `mode`.
    pub fn create_random(&self, prefix: &str, mode: u32) -> Result<(File, String), FsError> {
        loop {
            let name = random_name(prefix)?;
            match self.create_new(&name, mode) {
                Err(FsError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::AlreadyExists =>
                {
                    continue;
                }
                r => return r.map(|f| (f, name)),
            }
        }
    }

    /// Writes `bytes` to `name` atomically but not durably: a random new
    /// file, then a rename over `name`, neither synced. A crash of the
    /// agent leaves the old or the new content; a crash of the machine may
    /// leave neither. For what must survive a power cut (a checkpoint
    /// manifest), use [`Dir::replace`], which syncs the file and this
    /// directory.
    pub fn write_atomic(&self, name: &str, bytes: &[u8], mode: u32) -> Result<(), FsError> {
        self.write_then_rename(name, bytes, mode, false)
    }

    /// Replaces the regular file `name` (or creates it) with `bytes`,
    /// atomically and durably: a random new file (see [`random_name`]),
    /// written, synced, renamed over `name`, and this directory synced so
    /// that the rename itself survives a power cut. Unlike
    /// [`Dir::write_atomic`], anything at `name` that is not a regular
    /// file (a symlink, a FIFO, a directory) is refused, not replaced, so a
    /// planted link is reported rather than silently undone; the rename
    /// itself never follows one either.
    pub fn replace(&self, name: &str, bytes: &[u8], mode: u32) -> Result<(), FsError> {
        check_name(name)?;
        match self.stat(name) {
            Ok(st) => kind(&st, &self.join(name), SFlag::S_IFREG, "regular file")?,
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        self.write_then_rename(name, bytes, mode, true)
    }

    /// A random new file with `bytes` (synced when `sync`), renamed over
    /// `name`; the new file is removed when anything fails.
    fn write_then_rename(
        &self,
        name: &str,
        bytes: &[u8],
        mode: u32,
        sync: bool,
    ) -> Result<(), FsError> {
        check_name(name)?;
        let (mut f, tmp) = self.create_random(".tmp-", mode)?;
        let written = std::io::Write::write_all(&mut f, bytes)
            .and_then(|()| if sync { f.sync_all() } else { Ok(()) })
            .map_err(|e| io_err("writing", &self.join(&tmp), e));
        drop(f);
        if let Err(e) = written.and_then(|()| self.rename(&tmp, self, name)) {
            let _ = self.remove(&tmp);
            return Err(e);
        }
        if sync {
            self.sync()?;
        }
        Ok(())
    }

    /// Syncs the directory itself (fsync of its descriptor): the names
    /// created, renamed or removed in it so far survive a power cut. On
    /// tmpfs it costs nothing and changes nothing.
    pub fn sync(&self) -> Result<(), FsError> {
        nix::unistd::fsync(&self.fd).map_err(|e| io_err("syncing", &self.path, e))
    }

    /// Opens the regular file `name` for appending, created with `mode`
    /// when absent (`O_APPEND | O_CREAT | O_NOFOLLOW`: a symlink at `name`,
    /// dangling or not, is refused, never created through). Only a file
    /// with one link is written: a hard link to a file elsewhere is
    /// refused. Returns the file and its status (its size: where the
    /// appends start).
    pub fn open_append(&self, name: &str, mode: u32) -> Result<(File, FileStat), FsError> {
        check_name(name)?;
        let path = self.join(name);
        let fd = openat(
            &self.fd,
            name,
            OFlag::O_WRONLY
                | OFlag::O_APPEND
                | OFlag::O_CREAT
                | OFlag::O_NOFOLLOW
                | OFlag::O_CLOEXEC
                | OFlag::O_NONBLOCK
                | OFlag::O_NOCTTY,
            Mode::from_bits_truncate(mode),
        )
        .map_err(|e| open_err("opening", &path, e))?;
        single_regular(fd, &path)
    }

    /// The whole content of the regular file `name` (opened as
    /// [`Dir::open_file`] does: never through a symlink). A missing file
    /// is an error for which [`FsError::is_not_found`] holds.
    pub fn read(&self, name: &str) -> Result<Vec<u8>, FsError> {
        let (mut f, st) = self.open_file(name)?;
        // The size is a hint only (the file may grow while read).
        let hint = usize::try_from(st.st_size).unwrap_or(0).min(1 << 20);
        let mut buf = Vec::with_capacity(hint);
        std::io::Read::read_to_end(&mut f, &mut buf)
            .map_err(|e| io_err("reading", &self.join(name), e))?;
        Ok(buf)
    }

    /// Renames `name` here to `to_name` in `to` (renameat: neither side
    /// resolves a symlink; one that sits at `to_name` is replaced, not
    /// followed).
    pub fn rename(&self, name: &str, to: &Dir, to_name: &str) -> Result<(), FsError> {
        check_name(name)?;
        check_name(to_name)?;
        renameat(&self.fd, name, &to.fd, to_name)
            .map_err(|e| io_err("renaming into", &to.join(to_name), e))
    }

    /// Removes the file `name` (a link itself, never what it points to).
    pub fn remove(&self, name: &str) -> Result<(), FsError> {
        check_name(name)?;
        unlinkat(&self.fd, name, UnlinkatFlags::NoRemoveDir)
            .map_err(|e| io_err("removing", &self.join(name), e))
    }

    /// Removes the empty subdirectory `name`.
    pub fn remove_dir(&self, name: &str) -> Result<(), FsError> {
        check_name(name)?;
        unlinkat(&self.fd, name, UnlinkatFlags::RemoveDir)
            .map_err(|e| io_err("removing", &self.join(name), e))
    }

    /// The status of `name` itself (a link is described, not followed).
    pub fn stat(&self, name: &str) -> Result<FileStat, FsError> {
        check_name(name)?;
        nix::sys::stat::fstatat(&self.fd, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| io_err("inspecting", &self.join(name), e))
    }

    /// The names in the directory (read through its descriptor).
    ///
    /// Through a new open of "." relative to the descriptor, not a
    /// duplicate of it: a duplicate shares the read position, so a listing
    /// would start where the last one stopped. (Not `/proc/self/fd`: core
    /// reads no /proc.)
    pub fn names(&self) -> Result<Vec<String>, FsError> {
        let mut dir = nix::dir::Dir::openat(
            &self.fd,
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("listing", &self.path, e))?;
        let names = dir
            .iter()
            .flatten()
            .filter_map(|e| e.file_name().to_str().ok().map(str::to_owned))
            .filter(|n| n != "." && n != "..")
            .collect();
        Ok(names)
    }

    /// The filesystem's free bytes.
    pub fn free_bytes(&self) -> Result<u64, FsError> {
        let st =
            nix::sys::statvfs::fstatvfs(&self.fd).map_err(|e| io_err("statvfs", &self.path, e))?;
        #[allow(clippy::unnecessary_cast)]
        Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
    }

    /// The filesystem's size in bytes: the most any one file in it can
    /// ever hold, whatever is pruned to make room.
    pub fn total_bytes(&self) -> Result<u64, FsError> {
        let st =
            nix::sys::statvfs::fstatvfs(&self.fd).map_err(|e| io_err("statvfs", &self.path, e))?;
        #[allow(clippy::unnecessary_cast)]
        Ok((st.blocks() as u64).saturating_mul(st.fragment_size() as u64))
    }
}

/// The agent's directory holding the file `path` (created, checked and set
/// to `mode` as [`Dir::ensure`] does) and the file's name in it: for a file
/// of the state dir whose path a caller hands over whole.
pub fn parent_of(path: &Path, mode: u32) -> Result<(Dir, String), FsError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| FsError::BadName(path.display().to_string()))?;
    check_name(name)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Ok((Dir::ensure(parent, mode)?, name.to_owned()))
}

impl AsFd for Dir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn kind(st: &FileStat, path: &Path, want: SFlag, what: &'static str) -> Result<(), FsError> {
    if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == want {
        Ok(())
    } else if st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFLNK.bits() {
        Err(FsError::Symlink(path.display().to_string()))
    } else {
        Err(FsError::Kind {
            path: path.display().to_string(),
            want: what,
        })
    }
}

fn clear_nonblock(f: &File, path: &Path) -> Result<(), FsError> {
    let flags = nix::fcntl::fcntl(f, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| io_err("inspecting", path, e))?;
    let flags = OFlag::from_bits_truncate(flags) & !OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(f, nix::fcntl::FcntlArg::F_SETFL(flags))
        .map_err(|e| io_err("inspecting", path, e))?;
    Ok(())
}

/// Opens `path` for reading where only its last component may be
/// someone else's doing (a rank's file in a directory ranks write, such as
/// `<slot_dir>/stacks/`): never through a symlink there, only a regular
/// file with one link (a hard link to a file of someone else is refused).
pub fn open_leaf(path: &Path) -> Result<(File, FileStat), FsError> {
    let fd = nix::fcntl::open(
        path,
        OFlag::O_RDONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | OFlag::O_NONBLOCK
            | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| open_err("opening", path, e))?;
    single_regular(fd, path)
}

/// Writes `bytes` to `path`, a file the operator placed outside the
/// agent's trees (such as `policy.condition_file`), as [`Dir::replace`]
/// does: its directory (created when missing) is resolved as the system
/// resolves it, the operator's choice; the file's own name is never
/// followed: a symlink there is refused, the content goes to a random new
/// name beside it, synced, renamed over the file.
pub fn write_leaf(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FsError> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| FsError::BadName(path.display().to_string()))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(parent).map_err(|e| io_err("creating", parent, e))?;
    let fd = nix::fcntl::open(
        parent,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| open_err("opening", parent, e))?;
    let dir = Dir {
        fd,
        path: parent.to_owned(),
    };
    dir.replace(name, bytes, mode)
}

/// Checks an open file: owned by `uid`, with exactly one link.
pub fn check_owned_single(st: &FileStat, path: &Path, uid: u32) -> Result<(), FsError> {
    if st.st_uid != uid {
        return Err(FsError::Owner {
            path: path.display().to_string(),
            uid: st.st_uid,
            want: uid,
        });
    }
    one_link(st, path)
}

/// Refuses a file whose link count is not one: a hard link from elsewhere
/// in or out of the tree would let a writer reach a file the agent serves.
fn one_link(st: &FileStat, path: &Path) -> Result<(), FsError> {
    #[allow(clippy::unnecessary_cast)]
    let links = st.st_nlink as u64;
    if links != 1 {
        return Err(FsError::Links {
            path: path.display().to_string(),
            links,
        });
    }
    Ok(())
}

/// An opened descriptor as a regular file of one link (no hard link from
/// elsewhere in or out of the tree), blocking again for reads.
fn single_regular(fd: OwnedFd, path: &Path) -> Result<(File, FileStat), FsError> {
    let st = fstat(&fd).map_err(|e| io_err("inspecting", path, e))?;
    kind(&st, path, SFlag::S_IFREG, "regular file")?;
    one_link(&st, path)?;
    let f = File::from(fd);
    clear_nonblock(&f, path)?;
    Ok((f, st))
}

/// Hands an open file to `owner` (fchown: the descriptor, never a path).
pub fn give(f: &File, path: &Path, owner: Owner) -> Result<(), FsError> {
    fchown(
        f,
        Some(Uid::from_raw(owner.uid)),
        Some(Gid::from_raw(owner.gid)),
    )
    .map_err(|e| io_err("handing over", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_sub_is_made_once_and_a_symlink_in_its_place_is_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = Dir::ensure(&t.path().join("tree"), 0o711).expect("ensure");
        let me_too = Owner {
            uid: me(),
            gid: nix::unistd::Gid::effective().as_raw(),
        };
        let p = d.user_sub("1000", me_too).expect("made");
        assert_eq!(p, d.path().join("1000"));
        let mode = std::fs::metadata(&p).expect("stat").permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
        // Again: the same folder, kept.
        std::fs::write(p.join("kept"), b"x").expect("write");
        assert_eq!(d.user_sub("1000", me_too).expect("again"), p);
        assert!(p.join("kept").exists());
        std::os::unix::fs::symlink(t.path(), d.path().join("1001")).expect("symlink");
        assert!(matches!(
            d.user_sub("1001", me_too),
            Err(FsError::Symlink(_))
        ));
        assert!(d.user_sub("../x", me_too).is_err());
    }

    #[test]
    fn symlinks_and_odd_names_are_refused_by_name() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = Dir::ensure(&t.path().join("tree"), 0o711).expect("ensure");
        std::fs::write(t.path().join("secret"), b"x").expect("write");
        std::os::unix::fs::symlink(t.path().join("secret"), d.path().join("link"))
            .expect("symlink");
        let e = d.open_file("link").expect_err("a symlink").to_string();
        assert!(e.contains("symlink") && e.contains("link"), "{e}");
        std::os::unix::fs::symlink(t.path(), d.path().join("dirlink")).expect("symlink");
        let e = d
            .sub("dirlink", 0o711, true)
            .expect_err("a symlink")
            .to_string();
        assert!(e.contains("symlink"), "{e}");
        assert!(d.open_file("../secret").is_err());
        let (f, name) = d.create_random("x.", 0o600).expect("create");
        drop(f);
        assert_eq!(name.len(), 2 + 32);
        assert!(d.create_new(&name, 0o600).is_err(), "O_EXCL");
        d.write_atomic("m.json", b"{}", 0o600).expect("write");
        let mut names = d.names().expect("names");
        names.sort();
        assert!(names.contains(&"m.json".to_owned()), "{names:?}");
    }

    #[test]
    fn state_files_are_appended_read_and_replaced_never_through_a_link() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = Dir::ensure(&t.path().join("state"), STATE_DIR_MODE).expect("ensure");
        let secret = t.path().join("secret");
        std::fs::write(&secret, b"precious").expect("write");
        for name in ["j.jsonl", "c.json"] {
            std::os::unix::fs::symlink(&secret, d.path().join(name)).expect("symlink");
        }
        std::os::unix::fs::symlink(t.path().join("nowhere"), d.path().join("dangling"))
            .expect("symlink");
        let named = |e: FsError, name: &str| {
            let e = e.to_string();
            let path = d.path().join(name).display().to_string();
            assert!(e.contains("symlink") && e.contains(&path), "{e}");
        };
        named(
            d.open_append("j.jsonl", 0o644).expect_err("link"),
            "j.jsonl",
        );
        named(
            d.open_append("dangling", 0o644).expect_err("link"),
            "dangling",
        );
        named(d.read("j.jsonl").expect_err("link"), "j.jsonl");
        named(
            d.replace("c.json", b"{}", 0o644).expect_err("link"),
            "c.json",
        );
        named(
            write_leaf(&d.path().join("c.json"), b"{}", 0o644).expect_err("link"),
            "c.json",
        );
        assert_eq!(std::fs::read(&secret).expect("read"), b"precious");
        assert!(!t.path().join("nowhere").exists());
        std::fs::hard_link(&secret, d.path().join("hard")).expect("link");
        let e = d.open_append("hard", 0o644).expect_err("two links");
        assert!(e.to_string().contains("2 hard links"), "{e}");
        // Ordinary use.
        let (mut f, st) = d.open_append("new.jsonl", 0o644).expect("create");
        assert_eq!(st.st_size, 0);
        std::io::Write::write_all(&mut f, b"a\n").expect("append");
        drop(f);
        let (mut f, st) = d.open_append("new.jsonl", 0o644).expect("reopen");
        assert_eq!(st.st_size, 2);
        std::io::Write::write_all(&mut f, b"b\n").expect("append");
        assert_eq!(d.read("new.jsonl").expect("read"), b"a\nb\n");
        d.replace("new.jsonl", b"c\n", 0o644).expect("replace");
        assert_eq!(d.read("new.jsonl").expect("read"), b"c\n");
        assert!(d.read("missing").expect_err("missing").is_not_found());
        write_leaf(&t.path().join("npd/cond.json"), b"{}", 0o644).expect("elsewhere");
        assert_eq!(
            std::fs::read(t.path().join("npd/cond.json")).expect("read"),
            b"{}"
        );
        let (dir, name) = parent_of(&d.path().join("o.json"), STATE_DIR_MODE).expect("parent");
        assert_eq!((dir.path(), name.as_str()), (d.path(), "o.json"));
        let left: Vec<String> = d
            .names()
            .expect("names")
            .into_iter()
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    #[test]
    fn a_leaf_that_is_a_link_is_refused() {
        let t = tempfile::tempdir().expect("tempdir");
        let secret = t.path().join("secret");
        std::fs::write(&secret, b"x").expect("write");
        let soft = t.path().join("soft");
        std::os::unix::fs::symlink(&secret, &soft).expect("symlink");
        let e = open_leaf(&soft).expect_err("symlink").to_string();
        assert!(e.contains("symlink") && e.contains("soft"), "{e}");
        let hard = t.path().join("hard");
        std::fs::hard_link(&secret, &hard).expect("link");
        let e = open_leaf(&hard).expect_err("two links").to_string();
        assert!(e.contains("2 hard links"), "{e}");
        let fifo = t.path().join("fifo");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).expect("mkfifo");
        let e = open_leaf(&fifo).expect_err("fifo").to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_directory_of_someone_else_is_refused_and_an_open_one_of_ours_closed() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let t = tempfile::tempdir().expect("tempdir");
        let d = Dir::ensure(&t.path().join("tree"), 0o711).expect("ensure");
        let sub = d.path().join("open");
        std::fs::create_dir(&sub).expect("mkdir");
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        d.sub("open", 0o711, false).expect("ours: fixed");
        let mode = std::fs::metadata(&sub).expect("stat").mode() & 0o777;
        assert_eq!(mode, 0o711);
        if me() == 0 {
            std::os::unix::fs::chown(&sub, Some(65534), None).expect("chown");
            let e = d.sub("open", 0o711, false).expect_err("theirs").to_string();
            assert!(e.contains("uid 65534") && e.contains("open"), "{e}");
        }
    }
}
