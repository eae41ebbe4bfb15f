//! The job's compilation cache carried to its other hosts as a checkpoint,
//! so that a replacement on a spare host compiles nothing again.
//!
//! In: the job's cache folder ([`CompileCache`]), the agent's socket and
//! the bound (`--compile-cache-max-gib`). Out: once per attempt, the folder
//! packed into one tar blob saved through the agent's ordinary checkpoint
//! calls under a job id of its own (`<job>.compile-cache`, rank 0 of 1, the
//! step the wall clock's seconds, so the newest pack anywhere wins), which
//! the agent replicates to its peers as it does any shard; and at start,
//! when the job's folder holds no file, the newest such blob restored
//! (local tier, a peer or the durable store: the ordinary restore) and
//! unpacked into it before any worker starts.
//! Never: follows a link, packs more than the bound, unpacks anything but
//! folders and regular files at relative paths below the job's folder
//! (no `..`, no absolute path, no link, no device, at most the bound), or
//! fails the job: a pack or restore that cannot be done is a warning.
//!
//! Why the launcher, not the agent: the folder is the user's (their
//! workers write it) and the launcher runs as that user; the agent, root on
//! a shared node, never reads inside a tree another user can change under
//! it. It only stores and replicates the blob, with every check a
//! checkpoint shard gets (ownership, checksum, peers' identities).

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use warden_client::client::ConnectOptions;
use warden_client::{CheckpointError, Checkpointer};

use crate::compile_cache::{self, CompileCache};

/// What the reserved job id ends with.
pub const SUFFIX: &str = ".compile-cache";
/// The agent's longest job id.
const MAX_JOB_ID: usize = 128;
/// How long an attempt runs before its cache is packed: its workers have
/// compiled their first steps by then (a cold compile of a large model
/// takes minutes). An attempt that ends sooner is packed when the job
/// ends.
pub const PACK_AFTER: Duration = Duration::from_secs(180);

/// Why a pack or an unpack failed.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// Reading the folder or writing the blob.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// An entry of the blob that is not a folder or a regular file at a
    /// plain relative path.
    #[error("entry {entry:?} refused: {why}")]
    Refused {
        /// The entry's path as the blob names it.
        entry: String,
        /// Why.
        why: &'static str,
    },
    /// More bytes or files than the bound.
    #[error("the blob holds more than {limit} {what}")]
    TooBig {
        /// "bytes" or "files".
        what: &'static str,
        /// The bound.
        limit: u64,
    },
    /// The folder to unpack into holds files already.
    #[error("{} is not empty", .0.display())]
    NotEmpty(PathBuf),
    /// The agent's checkpoint call.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The blocking task.
    #[error("the pack task: {0}")]
    Task(String),
}

/// What a pack or an unpack moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Regular files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Files left out: over the bound (pack only).
    pub left_out: u64,
}

/// The reserved job id of `dir_name`'s (a directory-safe job id) cache
/// blobs; None when it would be longer than the agent takes.
pub fn blob_job(dir_name: &str) -> Option<String> {
    let id = format!("{dir_name}{SUFFIX}");
    (id.len() <= MAX_JOB_ID && !id.starts_with('.')).then_some(id)
}

/// Whether `dir` holds no regular file (its empty subfolders do not count).
pub fn holds_no_file(dir: &Path) -> bool {
    let mut files = Vec::new();
    let mut truncated = false;
    compile_cache::walk(dir, 0, &mut files, &mut truncated);
    !files
        .iter()
        .any(|(_, _, p)| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file()))
}

/// Packs the regular files below `dir` into a tar at `out`: paths relative
/// to `dir`, links and other kinds left out, at most `max_bytes` of file
/// data (the most recently written first, as the bound's eviction keeps
/// them). Blocking.
pub fn pack(dir: &Path, out: &Path, max_bytes: u64) -> Result<Moved, ShareError> {
    let mut files = Vec::new();
    let mut truncated = false;
    compile_cache::walk(dir, 0, &mut files, &mut truncated);
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    let io = |what, path: &Path| {
        let path = path.to_owned();
        move |source| ShareError::Io { what, path, source }
    };
    let file = std::fs::File::create(out).map_err(io("creating", out))?;
    let mut tar = tar::Builder::new(std::io::BufWriter::new(file));
    tar.follow_symlinks(false);
    let mut moved = Moved::default();
    for (_, _, path) in files {
        let Ok(rel) = path.strip_prefix(dir) else {
            continue;
        };
        // Opened without following a link (one swapped in since the walk
        // is refused by the kernel), and checked to be a regular file.
        let Ok(mut f) = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        let Ok(meta) = f.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        if moved.bytes.saturating_add(meta.len()) > max_bytes {
            moved.left_out += 1;
            continue;
        }
        // Read whole: the size in the header is what was read, even when
        // the file changes meanwhile.
        let mut data = Vec::new();
        if (&mut f).take(meta.len()).read_to_end(&mut data).is_err() {
            continue;
        }
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_mtime(
            meta.modified()
                .ok()
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
        );
        tar.append_data(&mut h, rel, data.as_slice())
            .map_err(io("packing", &path))?;
        moved.files += 1;
        moved.bytes += data.len() as u64;
    }
    let mut w = tar.into_inner().map_err(io("finishing", out))?;
    w.flush().map_err(io("writing", out))?;
    Ok(moved)
}

/// Unpacks the tar at `blob` into `dir`, which must hold no file: folders
/// and regular files only, each at a plain relative path (no `..`, no
/// root, at most [`compile_cache::MAX_DEPTH`] deep), new files only (mode
/// 0600), at most `max_bytes` and [`compile_cache::MAX_FILES`] files. Any
/// other entry refuses the whole blob, and the files written so far are
/// removed. Blocking.
pub fn unpack(blob: &Path, dir: &Path, max_bytes: u64) -> Result<Moved, ShareError> {
    if !holds_no_file(dir) {
        return Err(ShareError::NotEmpty(dir.to_owned()));
    }
    let mut written = Vec::new();
    let out = unpack_into(blob, dir, max_bytes, &mut written);
    if out.is_err() {
        for f in written.iter().rev() {
            let _ = std::fs::remove_file(f);
        }
    }
    out
}

fn unpack_into(
    blob: &Path,
    dir: &Path,
    max_bytes: u64,
    written: &mut Vec<PathBuf>,
) -> Result<Moved, ShareError> {
    let io = |what, path: &Path| {
        let path = path.to_owned();
        move |source| ShareError::Io { what, path, source }
    };
    let file = std::fs::File::open(blob).map_err(io("opening", blob))?;
    let mut ar = tar::Archive::new(std::io::BufReader::new(file));
    let mut moved = Moved::default();
    for entry in ar.entries().map_err(io("reading", blob))? {
        let mut entry = entry.map_err(io("reading", blob))?;
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8_lossy(&raw).into_owned();
        let refuse = |why| ShareError::Refused {
            entry: name.clone(),
            why,
        };
        let rel = entry.path().map_err(|_| refuse("not a path"))?.into_owned();
        let plain = rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !plain || rel.as_os_str().is_empty() {
            return Err(refuse("not a plain relative path (\"..\", \"/\" or \".\")"));
        }
        if rel.components().count() > compile_cache::MAX_DEPTH {
            return Err(refuse("nested too deep"));
        }
        let kind = entry.header().entry_type();
        let to = dir.join(&rel);
        match kind {
            tar::EntryType::Directory => make_dirs(dir, &rel)?,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                moved.files += 1;
                if moved.files > compile_cache::MAX_FILES as u64 {
                    return Err(ShareError::TooBig {
                        what: "files",
                        limit: compile_cache::MAX_FILES as u64,
                    });
                }
                let size = entry.header().size().map_err(|_| refuse("no size"))?;
                moved.bytes = moved.bytes.saturating_add(size);
                if moved.bytes > max_bytes {
                    return Err(ShareError::TooBig {
                        what: "bytes",
                        limit: max_bytes,
                    });
                }
                if let Some(parent) = rel.parent() {
                    make_dirs(dir, parent)?;
                }
                // A new file, never through a link: an existing name
                // (a second entry of the same path) is refused.
                let mut f = std::fs::File::options()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&to)
                    .map_err(io("creating", &to))?;
                written.push(to.clone());
                let n = std::io::copy(&mut (&mut entry).take(size), &mut f)
                    .map_err(io("writing", &to))?;
                if n != size {
                    return Err(refuse("shorter than its header says"));
                }
            }
            _ => return Err(refuse("not a folder or a regular file")),
        }
    }
    Ok(moved)
}

/// Makes each folder of `rel` below `dir` (mode 0700), refusing any that
/// exists as something else (a link).
fn make_dirs(dir: &Path, rel: &Path) -> Result<(), ShareError> {
    let mut at = dir.to_owned();
    for c in rel.components() {
        at.push(c);
        match std::fs::DirBuilder::new().mode(0o700).create(&at) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if !std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir()) {
                    return Err(ShareError::Refused {
                        entry: rel.display().to_string(),
                        why: "a folder of it exists as something else",
                    });
                }
            }
            Err(source) => {
                return Err(ShareError::Io {
                    what: "making",
                    path: at,
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Where a restored cache came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The step (the wall clock's seconds when it was packed).
    pub step: u64,
    /// "local", "peer" or "durable".
    pub tier: String,
    /// The agent or store.
    pub source: String,
    /// What was unpacked.
    pub moved: Moved,
}

/// What a restore at start found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore {
    /// The job's folder holds files already: kept, nothing fetched.
    Kept,
    /// No blob of the job on this host, its peers or the durable store.
    NoneSaved,
    /// Unpacked.
    Fetched(Fetched),
}

/// One job's cache sharing: the reserved id, the agent, what was packed.
#[derive(Debug)]
pub struct CacheShare {
    cache: CompileCache,
    /// `<job>.compile-cache`.
    job: String,
    /// The agent's socket.
    socket: PathBuf,
    /// The attempt packed last; a pack for it again is skipped.
    packed: Mutex<Option<u64>>,
    /// The attempt running, once one started.
    attempt: Mutex<Option<u64>>,
    /// Cancelled when the job ended: the timed packs still waiting give
    /// up (and let go of the console, whose thread the launcher joins).
    ended: tokio_util::sync::CancellationToken,
    /// The restore from a round's peers was tried: once per run, so a
    /// job that compiles nothing (its folder stays empty) asks the peers
    /// once, not at every round on the recovery path.
    round_restore_tried: std::sync::atomic::AtomicBool,
}

impl CacheShare {
    /// Sharing for `cache` under `job` through the agent at `socket`.
    pub fn new(cache: CompileCache, job: String, socket: PathBuf) -> Self {
        Self {
            cache,
            job,
            socket,
            packed: Mutex::new(None),
            attempt: Mutex::new(None),
            ended: tokio_util::sync::CancellationToken::new(),
            round_restore_tried: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// True the first time only: whether to restore from the first round
    /// that names peers.
    pub fn first_round_restore(&self) -> bool {
        !self
            .round_restore_tried
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// The reserved job id.
    pub fn job(&self) -> &str {
        &self.job
    }

    fn checkpointer(&self) -> Result<Checkpointer, ShareError> {
        let mut o = ConnectOptions::from_env_lossy();
        o.socket_path = self.socket.clone();
        o.job_id = self.job.clone();
        o.global_rank = 0;
        o.local_rank = 0;
        o.world_size = 1;
        o.connect_timeout = Duration::from_secs(5);
        Ok(Checkpointer::new(o)?)
    }

    /// When the job's folder holds no file: the newest blob anywhere,
    /// unpacked into it. Blocking.
    pub fn restore(&self) -> Result<Restore, ShareError> {
        if !holds_no_file(self.cache.dir()) {
            return Ok(Restore::Kept);
        }
        let ck = self.checkpointer()?;
        let Some(r) = ck.restore(0)? else {
            return Ok(Restore::NoneSaved);
        };
        let moved = unpack(&r.path, self.cache.dir(), self.cache.max_bytes())?;
        Ok(Restore::Fetched(Fetched {
            step: r.step,
            tier: r.tier,
            source: r.source,
            moved,
        }))
    }

    /// Attempt `n` started: packed [`PACK_AFTER`] from now, unless the job
    /// ends first (then [`CacheShare::end`] packs it).
    pub fn started(self: &std::sync::Arc<Self>, n: u64, console: &crate::output::Console) {
        *self.attempt.lock().unwrap_or_else(|p| p.into_inner()) = Some(n);
        let (share, console) = (self.clone(), console.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(PACK_AFTER) => pack_in_background(share, &console).await,
                () = share.ended.cancelled() => {}
            }
        });
    }

    /// The job ended: the timed packs waiting are dropped, and the last
    /// attempt, when none packed it, is packed now (a short job's cache
    /// reaches the other hosts too).
    pub async fn end(self: std::sync::Arc<Self>, console: &crate::output::Console) {
        self.ended.cancel();
        pack_in_background(self, console).await;
    }

    /// Packs the folder and saves it, unless the attempt running was packed
    /// already (or none started); None when skipped. Blocking.
    pub fn pack_once(&self) -> Result<Option<(u64, Moved)>, ShareError> {
        let Some(n) = *self.attempt.lock().unwrap_or_else(|p| p.into_inner()) else {
            return Ok(None);
        };
        {
            let mut packed = self.packed.lock().unwrap_or_else(|p| p.into_inner());
            if *packed == Some(n) {
                return Ok(None);
            }
            *packed = Some(n);
        }
        if holds_no_file(self.cache.dir()) {
            return Ok(None);
        }
        let ck = self.checkpointer()?;
        let step = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs());
        let mut moved = Moved::default();
        let mut failed = None;
        let max = self.cache.max_bytes();
        let dir = self.cache.dir().to_owned();
        ck.save_in_place(step, max.min(1 << 30), |path| {
            match pack(&dir, path, max) {
                Ok(m) => moved = m,
                Err(e) => failed = Some(e),
            }
            match &failed {
                Some(e) => Err(std::io::Error::other(e.to_string())),
                None => Ok(()),
            }
        })?;
        Ok(Some((step, moved)))
    }
}

/// Packs once for the attempt running (see [`CacheShare::pack_once`]) on
/// a blocking thread, and says what it did.
pub async fn pack_in_background(
    share: std::sync::Arc<CacheShare>,
    console: &crate::output::Console,
) {
    let job = share.job().to_owned();
    let out = tokio::task::spawn_blocking(move || share.pack_once())
        .await
        .map_err(|e| ShareError::Task(e.to_string()))
        .and_then(|r| r);
    say_packed(console, &job, out);
}

/// When the job's folder holds no file: the newest blob anywhere, unpacked
/// into it, off the runtime's threads, and the console told where it came
/// from (or why not: a warning, never a failure: the workers compile).
/// `second_try`: once a round named the job's peers, after the try at
/// start said what it found: only a restore is said (no blob, or peers
/// that do not yet know this host for the cache's id, go to the log).
pub async fn restore_and_say(
    share: &std::sync::Arc<CacheShare>,
    console: &crate::output::Console,
    second_try: bool,
) {
    let s = share.clone();
    let restored = tokio::task::spawn_blocking(move || s.restore())
        .await
        .map_err(|e| ShareError::Task(e.to_string()))
        .and_then(|r| r);
    match restored {
        Ok(Restore::Fetched(f)) => console.say(format!(
            "compilation cache restored from the {} copy at {} ({} step {}): {} files ({:.1} MiB)",
            f.tier,
            f.source,
            share.job(),
            f.step,
            f.moved.files,
            f.moved.bytes as f64 / f64::from(1u32 << 20)
        )),
        Ok(Restore::Kept) => {}
        Ok(Restore::NoneSaved) if second_try => {}
        Err(e) if second_try => {
            tracing::debug!(job = share.job(), error = %e, "launcher: the compilation cache was not restored from the round's peers");
        }
        Ok(Restore::NoneSaved) => console.say(
            "compilation cache: none saved for this job on this host or its peers; the workers compile",
        ),
        Err(e) => console.say(format!(
            "warning: the compilation cache was not restored from the job's other hosts: {e}; the workers compile"
        )),
    }
}

/// Says what a pack did, on the console.
pub fn say_packed(
    console: &crate::output::Console,
    job: &str,
    out: Result<Option<(u64, Moved)>, ShareError>,
) {
    match out {
        Ok(Some((step, m))) => console.say(format!(
            "compilation cache saved for the job's other hosts: {} files ({:.1} MiB) as {job} step {step}{}",
            m.files,
            m.bytes as f64 / f64::from(1u32 << 20),
            if m.left_out > 0 {
                format!(", {} left out over the bound", m.left_out)
            } else {
                String::new()
            }
        )),
        Ok(None) => {}
        Err(e) => console.say(format!(
            "warning: the compilation cache was not saved for the job's other hosts: {e}"
        )),
    }
}

#[cfg(test)]
mod tests;
