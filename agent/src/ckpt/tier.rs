//! The local tier: staging, atomic commit, listing, retention, room.
//!
//! In: a rank's begin/commit, a replica or restored copy that arrived.
//! Out: committed shards on disk, each with its manifest. All file work is
//! blocking and short; callers on the runtime go through `spawn_blocking`.
//!
//! Contract: a shard is listed only once its manifest exists, and the
//! manifest is written only after the bytes were renamed into place,
//! hashed and synced, so no listing ever shows a shard that is not whole.
//! [`LocalTier::seal`] returns only once the data file, the manifest and
//! the directories that name them are synced: a commit answered after it
//! survives the agent's death and, on disk, a power cut. A save that does
//! not fit fails at begin, after old steps were pruned, with the numbers
//! that did not add up. A shard a scrub found corrupt carries a `.bad`
//! marker and is never listed, replicated or restored again.
//!
//! At open, whatever a crash left half-written is removed and reported
//! ([`LocalTier::take_recovered`]): data without a manifest (its commit
//! was never answered), temporary files of an atomic write, staging files
//! (their reservations died with the agent). Only what the commit protocol
//! proves is garbage is removed: a step holding a manifest that does not
//! read (corrupt, truncated, describing another shard, its data missing or
//! of another size) may hold intact bytes, so the whole step directory is
//! moved, by one rename, to `<dir>/.quarantine/` (mode 0700) and reported
//! (`ckpt.quarantined`); nothing in it is deleted. An admin inspects and
//! removes it; nothing lists, restores or prunes it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::layout::{self, Layout, ShardKey};
use super::manifest::{self, Manifest};
use super::retention;
use nix::sys::stat::fstat;
pub use warden_core::fsafe::Owner;
use warden_core::fsafe::{self, Dir, FsError};

/// Saves in flight (BeginShard without its commit yet) one uid may hold:
/// each keeps a descriptor open in the agent (see [`LocalTier::police_staging`]),
/// so their number is bounded per caller, not only by their bytes.
pub const MAX_IN_FLIGHT_PER_UID: usize = 256;
/// A reservation nobody committed is forgotten (its file removed) after this long.
const RESERVATION_TTL: Duration = Duration::from_secs(600);
/// Staging files older than this at start belong to writers long gone.
const STALE_STAGING: Duration = Duration::from_secs(600);
/// The tier's directories: the agent writes, anyone may traverse (a rank
/// opens the file it was handed by name), nobody else lists or creates.
const DIR_MODE: u32 = 0o711;
/// Shard files: their owner's alone.
const FILE_MODE: u32 = 0o600;
/// Where steps the agent cannot vouch for are moved at start, whole.
pub const QUARANTINE: &str = ".quarantine";
/// The quarantine holds ranks' bytes as they were: nobody else traverses.
const QUARANTINE_MODE: u32 = 0o700;

/// Why a tier operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// A name the tier will not turn into a path.
    #[error(transparent)]
    BadJobId(#[from] layout::BadJobId),
    /// A request that does not describe a shard.
    #[error("{0}")]
    Invalid(String),
    /// The tier cannot hold the shard even after pruning.
    #[error(
        "checkpoint tier {dir} is full: the shard needs {need} bytes; {detail}; \
         pruning older steps freed {freed} bytes (the newest complete step of each job is kept)"
    )]
    Full {
        /// The tier.
        dir: String,
        /// Bytes asked for.
        need: u64,
        /// What was short: free space, or checkpoint.max_bytes.
        detail: String,
        /// Bytes pruning gave back.
        freed: u64,
    },
    /// The caller already holds [`MAX_IN_FLIGHT_PER_UID`] saves in flight.
    #[error(
        "uid {uid} already has {count} saves in flight on this agent (BeginShard without its \
         CommitShard), the most one uid may; each is forgotten 10 minutes after its BeginShard"
    )]
    TooManyInFlight {
        /// The caller's uid.
        uid: u32,
        /// Its saves in flight.
        count: usize,
    },
    /// A file or directory refused (a symlink, another owner, a FIFO...),
    /// or the filesystem said no.
    #[error(transparent)]
    Fs(#[from] FsError),
    /// Reading or writing an open file failed.
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

fn io(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> TierError {
    let path = path.display().to_string();
    move |source| TierError::Io { what, path, source }
}

/// Removes a staging file when dropped, unless [`StagedGuard::keep`] was
/// called: a gRPC handler is dropped mid-await when its peer's connection
/// goes, and its half-received file must not outlive it.
#[derive(Debug)]
pub struct StagedGuard<'a>(&'a LocalTier, Option<String>);

impl<'a> StagedGuard<'a> {
    /// Guards the staging file `token` of `tier`.
    pub fn new(tier: &'a LocalTier, token: String) -> Self {
        Self(tier, Some(token))
    }

    /// The file is committed (renamed away): nothing to remove.
    pub fn keep(mut self) {
        self.1 = None;
    }
}

impl Drop for StagedGuard<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.1.take() {
            self.0.discard(&t);
        }
    }
}

/// One thing a crash left half-written, or a step the agent could not
/// vouch for, found when the tier opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The path found.
    pub path: PathBuf,
    /// The shard it belonged to, when it names one.
    pub key: Option<ShardKey>,
    /// Why it could not be kept.
    pub why: String,
    /// What became of it.
    pub fate: Fate,
}

/// What the tier did with something it found at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Removed: the commit protocol proves it garbage.
    Removed,
    /// A step moved whole to the quarantine, at this path.
    Quarantined(PathBuf),
    /// A step that should have gone to the quarantine but could not (the
    /// reason): left where it was, not listed.
    LeftInPlace(String),
}

/// A save in flight: what BeginShard promised, to whom.
#[derive(Debug)]
struct Reservation {
    key: ShardKey,
    size: u64,
    owner: Option<Owner>,
    at: Instant,
    /// The agent's own descriptor of the staging file (None for bytes the
    /// agent writes itself): how [`LocalTier::police_staging`] sees and
    /// cuts it, whatever the rank does with the name or its own descriptor.
    file: Option<File>,
    /// Set once the rank wrote past `size`: the file was cut to nothing
    /// and the commit will be refused with this.
    overrun: Option<String>,
}

/// A staging file found written past its declared size, and cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overrun {
    /// The shard the save was for.
    pub key: ShardKey,
    /// The size BeginShard declared.
    pub declared: u64,
    /// The file's length when found (its allocation, when only that was
    /// over).
    pub found: u64,
}

/// Bytes a staging file may have allocated beyond its declared size before
/// it counts as written past it: filesystems allocate ahead of writes
/// (XFS's speculative preallocation reaches the file's size again), so
/// only allocation beyond twice the size plus this is held against a rank.
/// The file's length itself may never pass the declared size.
const ALLOC_SLACK: u64 = 64 << 20;

/// One host's local tier.
#[derive(Debug)]
pub struct LocalTier {
    layout: Layout,
    /// The tier's root, held open: every path below is reached from it.
    root: Dir,
    /// `.staging`, the agent's alone (mode 0711): files in flight, each
    /// created by the agent under a random name.
    staging: Dir,
    host: String,
    keep: usize,
    max_bytes: u64,
    /// Staging token (the random file name) -> the save it belongs to.
    reserved: Mutex<HashMap<String, Reservation>>,
    /// Serialises commits, pruning and making room.
    lock: Mutex<()>,
    /// What the last start removed, until taken (and reported) once.
    recovered: Mutex<Vec<Recovered>>,
}

impl LocalTier {
    /// Opens (creating) the tier at `dir`, the agent's own (mode 0711),
    /// and removes what a crash left half-written (see the module's
    /// contract; [`LocalTier::take_recovered`] says what). A root or
    /// `.staging` owned by someone else, or a symlink, is refused with the
    /// path.
    pub fn open(
        dir: &std::path::Path,
        host: &str,
        keep: usize,
        max_bytes: u64,
    ) -> Result<Self, TierError> {
        let layout = Layout::new(dir);
        let root = Dir::ensure(dir, DIR_MODE)?;
        let staging = root.sub(".staging", DIR_MODE, true)?;
        let mut recovered = Vec::new();
        // Every staging file belongs to a reservation of an agent that is
        // gone: no commit can name it any more.
        for name in staging.names()? {
            let age = staging.stat(&name).ok().and_then(|st| {
                let mtime =
                    UNIX_EPOCH + Duration::from_secs(u64::try_from(st.st_mtime).unwrap_or(0));
                mtime.elapsed().ok()
            });
            if staging.remove(&name).is_ok() {
                recovered.push(Recovered {
                    fate: Fate::Removed,
                    path: staging.path().join(&name),
                    key: None,
                    why: format!(
                        "staging file of a save never committed{}",
                        match age {
                            Some(a) if a > STALE_STAGING => " (older than 10 minutes)",
                            _ => " (its reservation died with the previous agent)",
                        }
                    ),
                });
            }
        }
        let tier = Self {
            layout,
            root,
            staging,
            host: host.to_owned(),
            keep,
            max_bytes,
            reserved: Mutex::new(HashMap::new()),
            lock: Mutex::new(()),
            recovered: Mutex::new(Vec::new()),
        };
        tier.recover(&mut recovered);
        *tier.recovered.lock().unwrap_or_else(|p| p.into_inner()) = recovered;
        Ok(tier)
    }

    /// What the tier removed when it opened, once (the caller logs and
    /// publishes it).
    pub fn take_recovered(&self) -> Vec<Recovered> {
        std::mem::take(&mut *self.recovered.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Walks every step directory and removes what is not a committed
    /// shard: see the module's contract. A directory it cannot read is
    /// left alone (listing leaves it out too).
    fn recover(&self, out: &mut Vec<Recovered>) {
        let jobs = self.root.names().unwrap_or_default();
        for j in jobs.into_iter().filter(|n| layout::check_job_id(n).is_ok()) {
            let Ok(jd) = self.root.sub(&j, DIR_MODE, false) else {
                continue;
            };
            for s in jd.names().unwrap_or_default() {
                if let Some(step) = layout::parse_step(&s)
                    && let Ok(sd) = jd.sub(&s, DIR_MODE, false)
                {
                    let damaged = self.recover_step(&j, step, &sd, out);
                    drop(sd);
                    if damaged.is_empty() {
                        // Only succeeds once nothing is left in it.
                        let _ = jd.remove_dir(&s);
                    } else {
                        out.push(self.quarantine(&jd, &j, &s, damaged));
                    }
                } else if s.starts_with(".tmp-") && jd.remove(&s).is_ok() {
                    out.push(Recovered {
                        fate: Fate::Removed,
                        path: jd.path().join(&s),
                        key: None,
                        why: "temporary file of an interrupted write".into(),
                    });
                }
            }
        }
    }

    /// Moves the step directory `step` of `jd` whole into the quarantine
    /// (one rename: nothing inside is walked or deleted), for the
    /// manifests in `damaged`.
    fn quarantine(
        &self,
        jd: &Dir,
        job: &str,
        step: &str,
        damaged: Vec<(ShardKey, String)>,
    ) -> Recovered {
        let why = damaged
            .iter()
            .map(|(k, w)| format!("rank {}: {w}", k.rank))
            .collect::<Vec<_>>()
            .join("; ");
        let moved = self
            .root
            .sub(QUARANTINE, QUARANTINE_MODE, true)
            .and_then(|q| {
                let name = fsafe::random_name(&format!("{job}.{step}."))?;
                jd.rename(step, &q, &name)?;
                Ok(q.path().join(name))
            });
        Recovered {
            path: jd.path().join(step),
            key: damaged.into_iter().next().map(|(k, _)| k),
            why: format!("a manifest the agent cannot vouch for ({why})"),
            fate: match moved {
                Ok(to) => Fate::Quarantined(to),
                Err(e) => Fate::LeftInPlace(e.to_string()),
            },
        }
    }

    /// Removes what the commit protocol proves is garbage in one step
    /// directory; returns the shards whose manifest does not read (the
    /// caller quarantines the step: their bytes may be intact).
    fn recover_step(
        &self,
        job: &str,
        step: u64,
        sd: &Dir,
        out: &mut Vec<Recovered>,
    ) -> Vec<(ShardKey, String)> {
        let names = sd.names().unwrap_or_default();
        let has = |n: &str| names.iter().any(|x| x == n);
        let mut damaged = Vec::new();
        let mut gone = |name: &str, key: Option<ShardKey>, why: String| {
            if sd.remove(name).is_ok() {
                out.push(Recovered {
                    fate: Fate::Removed,
                    path: sd.path().join(name),
                    key,
                    why,
                });
            }
        };
        for name in &names {
            if name.starts_with(".tmp-") {
                gone(name, None, "temporary file of an interrupted write".into());
                continue;
            }
            let Some((rank, kind)) = layout::parse_shard_file(name) else {
                continue;
            };
            if has(&layout::bad_name(rank)) {
                // Marked corrupt by a scrub: kept as it is for inspection
                // (listed as corrupt, never used) until retention removes
                // its step. Its manifest no longer reads as usable, which
                // must not make it look half-written here.
                continue;
            }
            let key = ShardKey {
                job_id: job.to_owned(),
                step,
                rank,
            };
            match kind {
                "bin" if !has(&layout::manifest_name(rank)) => {
                    gone(
                        name,
                        Some(key),
                        "data without a manifest: its commit was never answered".into(),
                    );
                }
                "json" => {
                    if let Err(why) = self.read_manifest(sd, &key) {
                        damaged.push((key, why));
                    }
                }
                _ => {}
            }
        }
        damaged
    }

    /// The directory names.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Creates the staging file of a shard about to be written, after
    /// making room for `size` bytes: a new file (never one already there)
    /// under a random name in the agent's staging directory, handed to
    /// `owner` (the calling rank's ids; None: the agent's). Returns its
    /// path, which the rank opens and writes, and its name, the token the
    /// commit presents.
    pub fn begin(
        &self,
        key: &ShardKey,
        size: u64,
        owner: Option<Owner>,
    ) -> Result<(PathBuf, String), TierError> {
        layout::check_job_id(&key.job_id)?;
        self.check_size(size)?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.expire();
        let uid = owner.map_or_else(fsafe::me, |o| o.uid);
        let count = self
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| r.owner.map_or_else(fsafe::me, |o| o.uid) == uid)
            .count();
        if count >= MAX_IN_FLIGHT_PER_UID {
            return Err(TierError::TooManyInFlight { uid, count });
        }
        self.make_room(size)?;
        let (f, token) = self.staging.create_random("", FILE_MODE)?;
        let path = self.staging.path().join(&token);
        // Handed over only to another user than the agent's, and never to
        // root (who may write it anyway; an agent running as a plain user
        // could not chown to root).
        let owner = owner.filter(|o| o.uid != 0 && o.uid != fsafe::me());
        if let Some(Err(e)) = owner.map(|o| fsafe::give(&f, &path, o)) {
            self.discard(&token);
            return Err(e.into());
        }
        self.reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                token.clone(),
                Reservation {
                    key: key.clone(),
                    size,
                    owner,
                    at: Instant::now(),
                    file: Some(f),
                    overrun: None,
                },
            );
        Ok((path, token))
    }

    /// The compilation cache folder of `owner` (None: the agent's own user)
    /// in the tier: `.cache/<uid>`, made by the agent and handed to that
    /// user (mode 0700), where the launcher keeps each job's torch.compile,
    /// Triton and XLA caches and bounds them (it runs as that user: the
    /// agent, root on a shared node, never reads or deletes in a folder a
    /// user writes). In the tier so that a restart on this host finds it.
    pub fn user_cache(&self, owner: Option<Owner>) -> Result<PathBuf, TierError> {
        let cache = self.root.sub(".cache", DIR_MODE, true)?;
        let owner = owner.unwrap_or(Owner {
            uid: fsafe::me(),
            gid: nix::unistd::Gid::effective().as_raw(),
        });
        Ok(cache.user_sub(&owner.uid.to_string(), owner)?)
    }

    /// Checks every staging file handed to a rank against the size its
    /// BeginShard declared, through the agent's own descriptor: one longer
    /// than that, or with far more allocated ([`ALLOC_SLACK`]), is cut to
    /// nothing (`ftruncate`, which frees the space at once even while the
    /// rank holds the file open; unlinking would not) and its commit will
    /// be refused. Cut again on every pass while the rank keeps writing.
    /// Returns the files found over their size for the first time.
    ///
    /// Why a watcher and not the kernel: no mechanism caps the size of a
    /// regular file another user writes (file seals exist only for memfds;
    /// RLIMIT_FSIZE is the writer's own limit; tmpfs quotas are per user,
    /// not per file). Between two passes a rank can write past its size as
    /// much as it can write in that time; the commit refuses it anyway.
    pub fn police_staging(&self) -> Vec<Overrun> {
        let mut found = Vec::new();
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        for res in r.values_mut() {
            let Some(f) = &res.file else { continue };
            let Ok(st) = fstat(f) else { continue };
            let len = u64::try_from(st.st_size).unwrap_or(0);
            let alloc = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
            let over_len = len > res.size;
            let over_alloc = alloc > res.size.saturating_mul(2).saturating_add(ALLOC_SLACK);
            if !(over_len || over_alloc) {
                continue;
            }
            if let Err(e) = f.set_len(0) {
                tracing::warn!(shard = %res.key, error = %e, "cannot cut a staging file written past its size");
            }
            if res.overrun.is_none() {
                let what = if over_len {
                    format!("{len} bytes long")
                } else {
                    format!("{alloc} bytes allocated")
                };
                res.overrun = Some(format!(
                    "{}: the staging file was written past the {} bytes BeginShard declared ({what}); \
                     the agent cut it to nothing and refuses its commit",
                    res.key, res.size
                ));
                found.push(Overrun {
                    key: res.key.clone(),
                    declared: res.size,
                    found: if over_len { len } else { alloc },
                });
            }
        }
        found
    }

    /// Forgets reservations past their time, removing their files.
    fn expire(&self) {
        let gone: Vec<String> = {
            let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
            let old: Vec<String> = r
                .iter()
                .filter(|(_, v)| v.at.elapsed() >= RESERVATION_TTL)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &old {
                // Cut first: a rank still holding the file open would keep
                // its bytes alive after the name is gone.
                if let Some(f) = r.remove(k).and_then(|v| v.file) {
                    let _ = f.set_len(0);
                }
            }
            old
        };
        for t in gone {
            self.discard(&t);
        }
    }

    /// A staging file for bytes arriving from elsewhere (a peer's replica,
    /// a restore), room made first: created by the agent, for the agent.
    pub fn begin_incoming(&self, key: &ShardKey, size: u64) -> Result<(File, String), TierError> {
        layout::check_job_id(&key.job_id)?;
        self.check_size(size)?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.make_room(size)?;
        Ok(self.staging.create_random("", FILE_MODE)?)
    }

    /// Refuses a shard that could never fit (above `checkpoint.max_bytes`,
    /// or above the whole filesystem) before anything is pruned for it: a
    /// caller's mistaken or hostile size must not cost the tier its older
    /// steps on the way to a refusal. Still [`TierError::Full`]
    /// (RESOURCE_EXHAUSTED), which clients already read as "no room".
    fn check_size(&self, size: u64) -> Result<(), TierError> {
        let never = |detail: String| TierError::Full {
            dir: self.layout.root().display().to_string(),
            need: size,
            detail,
            freed: 0,
        };
        if self.max_bytes > 0 && size > self.max_bytes {
            return Err(never(format!(
                "it is larger than checkpoint.max_bytes ({}), so nothing was pruned for it",
                self.max_bytes
            )));
        }
        let total = self.root.total_bytes()?;
        if size > total {
            return Err(never(format!(
                "it is larger than the whole filesystem ({total} bytes), so nothing was pruned for it"
            )));
        }
        Ok(())
    }

    /// Removes a staging file (a save abandoned, a transfer that failed).
    pub fn discard(&self, token: &str) {
        let _ = self.staging.remove(token);
    }

    /// Moves a rank's staged bytes into place: `token` must be one that
    /// [`LocalTier::begin`] gave for `key`; the file under it must be a
    /// regular file with one link, owned by the rank it was handed to, of
    /// `size` bytes. Returns the shard's path and the open file (hashed by
    /// [`LocalTier::seal`] through it). On any refusal the staged file is
    /// removed. The shard is not committed until its manifest is written.
    pub fn place(
        &self,
        key: &ShardKey,
        token: &str,
        size: u64,
    ) -> Result<(PathBuf, File), TierError> {
        layout::check_job_id(&key.job_id)?;
        let res = {
            let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
            match r.get(token) {
                Some(v) if v.key == *key => r.remove(token),
                _ => None,
            }
        };
        let Some(res) = res else {
            // Quoted clipped: the token is the caller's, of any length.
            let shown = warden_slot::truncate_utf8(token, 64);
            return Err(TierError::Invalid(format!(
                "token {shown:?} ({} bytes) was not given by BeginShard for {key} (or it expired)",
                token.len()
            )));
        };
        if let Some(why) = res.overrun {
            self.discard(token);
            return Err(TierError::Invalid(why));
        }
        let want = res.owner.map_or_else(fsafe::me, |o| o.uid);
        let r = self.take_staged(key, token, size, want);
        if r.is_err() {
            self.discard(token);
        }
        r
    }

    fn take_staged(
        &self,
        key: &ShardKey,
        token: &str,
        size: u64,
        uid: u32,
    ) -> Result<(PathBuf, File), TierError> {
        let staged = self.staging.path().join(token);
        let (f, st) = self.staging.open_file(token)?;
        fsafe::check_owned_single(&st, &staged, uid)?;
        let len = u64::try_from(st.st_size).unwrap_or(0);
        if len != size {
            return Err(TierError::Invalid(format!(
                "{key}: the staged file {} holds {len} bytes, the commit says {size}",
                staged.display()
            )));
        }
        // Space allocated past the end (fallocate with KEEP_SIZE) would
        // come into the tier unseen by the size.
        let alloc = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        if alloc > size.saturating_mul(2).saturating_add(ALLOC_SLACK) {
            return Err(TierError::Invalid(format!(
                "{key}: the staged file {} has {alloc} bytes allocated for {size} bytes of data",
                staged.display()
            )));
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.step_dir(key, true)?;
        // A shard saved again: its old manifest goes first, so the old
        // checksum never describes the new bytes.
        // So does a scrub's mark of the old copy: the new bytes are not it.
        for name in [layout::manifest_name(key.rank), layout::bad_name(key.rank)] {
            match dir.remove(&name) {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.staging
            .rename(token, &dir, &layout::data_name(key.rank))?;
        Ok((self.layout.data(key), f))
    }

    /// The step directory of `key`, created (mode 0711) when `create`.
    fn step_dir(&self, key: &ShardKey, create: bool) -> Result<Dir, TierError> {
        layout::check_job_id(&key.job_id)?;
        let job = self.root.sub(&key.job_id, DIR_MODE, create)?;
        Ok(job.sub(&layout::step_name(key.step), DIR_MODE, create)?)
    }

    /// Hashes a placed shard through its open file, syncs it and writes
    /// its manifest durably: the commit point. Returns once all of it is
    /// on stable storage (where the tier is on disk).
    pub fn seal(
        &self,
        key: &ShardKey,
        mut file: File,
        world_size: u32,
        origin: &str,
    ) -> Result<Manifest, TierError> {
        let data = self.layout.data(key);
        file.seek(SeekFrom::Start(0))
            .map_err(io("hashing", &data))?;
        let (size, hash) = manifest::hash_reader(&mut file).map_err(io("hashing", &data))?;
        file.sync_all().map_err(io("syncing", &data))?;
        let m = Manifest {
            job_id: key.job_id.clone(),
            step: key.step,
            rank: key.rank,
            world_size,
            size_bytes: size,
            xxh3: manifest::hex(hash),
            origin: origin.to_owned(),
            committed_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        self.write_manifest(&m)?;
        Ok(m)
    }

    /// Installs bytes the agent itself staged under `token` and verified
    /// against `m` (a replica, a restored copy), and commits them under `m`.
    pub fn install(&self, token: &str, m: &Manifest) -> Result<PathBuf, TierError> {
        let key = m.key();
        let (data, f) = self.take_staged(&key, token, m.size_bytes, fsafe::me())?;
        f.sync_all().map_err(io("syncing", &data))?;
        self.write_manifest(m)?;
        Ok(data)
    }

    fn write_manifest(&self, m: &Manifest) -> Result<(), TierError> {
        let key = m.key();
        let body = serde_json::to_vec_pretty(m)
            .map_err(|e| TierError::Invalid(format!("manifest of {key}: {e}")))?;
        let dir = self.step_dir(&key, true)?;
        // Written, synced, renamed, and the step directory synced: both
        // the manifest's name and the data's rename into it are durable.
        dir.replace(&layout::manifest_name(key.rank), &body, FILE_MODE)?;
        // The step and job directories may be new: their names too.
        self.root.sub(&key.job_id, DIR_MODE, false)?.sync()?;
        self.root.sync()?;
        Ok(())
    }

    /// Marks the committed shard `key` corrupt (a scrub found `why`), if it
    /// is still the copy `m` in the file `ino`: a shard saved again in the
    /// meantime is not the copy that was read. The marker, written
    /// durably, takes it out of listings, replication and restores; the
    /// bytes stay for inspection until retention removes the step. Returns
    /// whether it marked it.
    pub fn mark_bad(
        &self,
        key: &ShardKey,
        m: &Manifest,
        ino: u64,
        why: &str,
    ) -> Result<bool, TierError> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.step_dir(key, false)?;
        let still = self.read_manifest(&dir, key).is_ok_and(|now| now == *m)
            && dir
                .stat(&layout::data_name(key.rank))
                .is_ok_and(|st| st.st_ino == ino);
        if !still {
            return Ok(false);
        }
        dir.replace(&layout::bad_name(key.rank), why.as_bytes(), FILE_MODE)?;
        Ok(true)
    }

    /// Shards of `job` (all jobs when None) marked corrupt by a scrub,
    /// with the reason: shown by listings, never used.
    pub fn list_bad(&self, job: Option<&str>) -> Vec<(ShardKey, String)> {
        let mut out = Vec::new();
        let jobs: Vec<String> = match job {
            Some(j) => vec![j.to_owned()],
            None => self.root.names().unwrap_or_default(),
        };
        for j in jobs.into_iter().filter(|n| layout::check_job_id(n).is_ok()) {
            let Ok(jd) = self.root.sub(&j, DIR_MODE, false) else {
                continue;
            };
            for s in jd.names().unwrap_or_default() {
                let Some(step) = layout::parse_step(&s) else {
                    continue;
                };
                let Ok(sd) = jd.sub(&s, DIR_MODE, false) else {
                    continue;
                };
                for f in sd.names().unwrap_or_default() {
                    if let Some((rank, "bad")) = layout::parse_shard_file(&f) {
                        use std::io::Read;
                        let mut why = String::new();
                        if let Ok((file, _)) = sd.open_file(&f) {
                            let _ = file.take(4096).read_to_string(&mut why);
                        }
                        out.push((
                            ShardKey {
                                job_id: j.clone(),
                                step,
                                rank,
                            },
                            why,
                        ));
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// The committed shard `key` opened for reading (never through a
    /// symlink), with its manifest; refused when the bytes are not what
    /// the manifest says in size.
    pub fn open_data(&self, key: &ShardKey) -> Result<(File, Manifest), TierError> {
        let dir = self.step_dir(key, false)?;
        let m = self.read_manifest(&dir, key).map_err(TierError::Invalid)?;
        let (f, _) = dir.open_file(&layout::data_name(key.rank))?;
        Ok((f, m))
    }

    /// Hands the committed shard `key` to `owner` (a restoring rank): the
    /// rank opens the path Restore answers. Through the open file, never
    /// the path.
    pub fn hand_over(&self, key: &ShardKey, owner: Owner) -> Result<(), TierError> {
        let dir = self.step_dir(key, false)?;
        let path = self.layout.data(key);
        let (f, st) = dir.open_file(&layout::data_name(key.rank))?;
        // Root reads anything; a file already the rank's stays as it is.
        if owner.uid != 0 && st.st_uid != owner.uid {
            fsafe::give(&f, &path, owner)?;
        }
        Ok(())
    }

    /// Every committed shard of `job` (all jobs when None). A manifest that
    /// does not parse, or whose bytes are missing or of another size, or a
    /// symlink anywhere in the tree, is left out with a warning: it is not
    /// a usable copy.
    pub fn list(&self, job: Option<&str>) -> Vec<Manifest> {
        let mut out = Vec::new();
        let jobs: Vec<String> = match job {
            Some(j) => vec![j.to_owned()],
            None => self
                .root
                .names()
                .unwrap_or_default()
                .into_iter()
                .filter(|n| layout::check_job_id(n).is_ok())
                .collect(),
        };
        let warn = |e: &FsError| {
            if !e.is_not_found() {
                tracing::warn!(error = %e, "checkpoint directory left out");
            }
        };
        for j in jobs {
            let jd = match self.root.sub(&j, DIR_MODE, false) {
                Ok(d) => d,
                Err(e) => {
                    warn(&e);
                    continue;
                }
            };
            for s in jd.names().unwrap_or_default() {
                let Some(step) = layout::parse_step(&s) else {
                    continue;
                };
                let sd = match jd.sub(&s, DIR_MODE, false) {
                    Ok(d) => d,
                    Err(e) => {
                        warn(&e);
                        continue;
                    }
                };
                let names = sd.names().unwrap_or_default();
                for f in &names {
                    let Some(rank) = layout::parse_manifest_rank(f) else {
                        continue;
                    };
                    if names.contains(&layout::bad_name(rank)) {
                        // Found corrupt by a scrub: listed apart (list_bad).
                        continue;
                    }
                    let key = ShardKey {
                        job_id: j.clone(),
                        step,
                        rank,
                    };
                    match self.read_manifest(&sd, &key) {
                        Ok(m) => out.push(m),
                        Err(e) => tracing::warn!(error = %e, "checkpoint shard left out"),
                    }
                }
            }
        }
        out.sort_by_key(Manifest::key);
        out
    }

    fn read_manifest(&self, dir: &Dir, key: &ShardKey) -> Result<Manifest, String> {
        use std::io::Read;
        let path = self.layout.manifest(key);
        let (f, _) = dir
            .open_file(&layout::manifest_name(key.rank))
            .map_err(|e| e.to_string())?;
        let mut bytes = Vec::new();
        f.take(1 << 20)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let m = Manifest::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        if dir.stat(&layout::bad_name(key.rank)).is_ok() {
            return Err(format!(
                "{} is marked corrupt by a scrub",
                self.layout.data(key).display()
            ));
        }
        if m.key() != *key {
            return Err(format!("{} describes {}", path.display(), m.key()));
        }
        let data = self.layout.data(key);
        let st = dir
            .stat(&layout::data_name(key.rank))
            .map_err(|e| e.to_string())?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(format!(
                "{} is not a regular file (refused)",
                data.display()
            ));
        }
        let len = u64::try_from(st.st_size).unwrap_or(0);
        if len != m.size_bytes {
            return Err(format!(
                "{} is {len} bytes, its manifest says {}",
                data.display(),
                m.size_bytes
            ));
        }
        Ok(m)
    }

    /// The manifest of one shard, when committed here.
    pub fn get(&self, key: &ShardKey) -> Option<Manifest> {
        let dir = self.step_dir(key, false).ok()?;
        self.read_manifest(&dir, key).ok()
    }

    /// Removes a shard (manifest first, so it stops being listed at once).
    /// Names are removed, never followed.
    pub fn remove(&self, key: &ShardKey) {
        let Ok(dir) = self.step_dir(key, false) else {
            return;
        };
        let _ = dir.remove(&layout::manifest_name(key.rank));
        let _ = dir.remove(&layout::data_name(key.rank));
        let _ = dir.remove(&layout::bad_name(key.rank));
        drop(dir);
        // Only succeeds once the step directory is empty.
        if let Ok(job) = self.root.sub(&key.job_id, DIR_MODE, false) {
            let _ = job.remove_dir(&layout::step_name(key.step));
        }
    }

    /// Applies retention to `job`; returns the shards removed.
    pub fn prune(&self, job: &str) -> Vec<ShardKey> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let gone = retention::expired(&self.list(Some(job)), self.keep);
        for k in &gone {
            self.remove(k);
        }
        // Copies marked corrupt go with their step, and with any step older
        // than the oldest kept (they never count toward completeness).
        let oldest_kept = self.list(Some(job)).iter().map(|m| m.step).min();
        for (k, _) in self.list_bad(Some(job)) {
            if gone.iter().any(|g| g.step == k.step) || oldest_kept.is_some_and(|s| k.step < s) {
                self.remove(&k);
            }
        }
        gone
    }

    /// Bytes promised to saves in flight (reservations not yet expired).
    fn reserved_bytes(&self) -> u64 {
        self.reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| r.at.elapsed() < RESERVATION_TTL)
            .map(|r| r.size)
            .sum()
    }

    fn free_bytes(&self) -> Result<u64, TierError> {
        Ok(self.root.free_bytes()?)
    }

    /// What keeps `need` more bytes from fitting, if anything.
    fn shortfall(&self, need: u64) -> Result<Option<String>, TierError> {
        let reserved = self.reserved_bytes();
        let free = self.free_bytes()?.saturating_sub(reserved);
        if need > free {
            return Ok(Some(format!(
                "the filesystem has {free} bytes free (after {reserved} promised to saves in flight)"
            )));
        }
        if self.max_bytes > 0 {
            let committed: u64 = self.list(None).iter().map(|m| m.size_bytes).sum();
            let used = committed + reserved;
            if used + need > self.max_bytes {
                return Ok(Some(format!(
                    "checkpoint.max_bytes is {} and {used} are in use",
                    self.max_bytes
                )));
            }
        }
        Ok(None)
    }

    /// Prunes the oldest evictable shards until `need` bytes fit.
    fn make_room(&self, need: u64) -> Result<(), TierError> {
        let Some(mut why) = self.shortfall(need)? else {
            return Ok(());
        };
        let mut freed = 0u64;
        let candidates = retention::evictable(&self.list(None));
        let mut it = candidates.into_iter().peekable();
        while let Some((key, _)) = it.peek().cloned() {
            // Drop a whole step (of one job) at a time.
            while let Some((k, size)) =
                it.next_if(|(k, _)| k.job_id == key.job_id && k.step == key.step)
            {
                self.remove(&k);
                freed += size;
                tracing::info!(shard = %k, "checkpoint shard pruned to make room");
            }
            match self.shortfall(need)? {
                None => return Ok(()),
                Some(w) => why = w,
            }
        }
        Err(TierError::Full {
            dir: self.layout.root().display().to_string(),
            need,
            detail: why,
            freed,
        })
    }

    /// The host name written into manifests of shards saved here.
    pub fn host(&self) -> &str {
        &self.host
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn key(step: u64) -> ShardKey {
        ShardKey {
            job_id: "j".into(),
            step,
            rank: 0,
        }
    }

    /// Saves `bytes` as `key` the way a rank does: begin, write, place, seal.
    fn save(tier: &LocalTier, key: &ShardKey, bytes: &[u8]) -> Manifest {
        let size = bytes.len() as u64;
        let (path, token) = tier.begin(key, size, None).expect("begin");
        std::fs::write(&path, bytes).expect("write");
        let (_, f) = tier.place(key, &token, size).expect("place");
        tier.seal(key, f, 1, "h").expect("seal")
    }

    #[test]
    fn a_shard_marked_corrupt_is_kept_as_it_is_across_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("open");
        let m = save(&tier, &key(1), b"shard bytes");
        let data = tier.layout().data(&key(1));
        let ino = std::fs::metadata(&data).expect("stat").ino();
        assert!(
            tier.mark_bad(&key(1), &m, ino, "xxh3 differs")
                .expect("mark")
        );
        drop(tier);

        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("reopen");
        assert!(tier.take_recovered().is_empty(), "nothing half-written");
        assert!(data.is_file() && tier.layout().manifest(&key(1)).is_file());
        assert_eq!(tier.list_bad(Some("j")).len(), 1);
        assert!(tier.list(Some("j")).is_empty());
    }

    /// Issue 29: a staging file took any number of bytes until commit.
    #[test]
    fn a_staging_file_written_past_its_size_is_cut_and_its_commit_refused() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("open");
        let (path, token) = tier.begin(&key(1), 16, None).expect("begin");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("the rank opens it");
        f.write_all(&[7u8; 16]).expect("within size");
        assert!(tier.police_staging().is_empty(), "at its size: fine");
        f.write_all(&[7u8; 1 << 20]).expect("past its size");
        let found = tier.police_staging();
        assert_eq!(
            found,
            vec![Overrun {
                key: key(1),
                declared: 16,
                found: 16 + (1 << 20),
            }]
        );
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), 0, "cut");
        // Writing on: cut again, reported once.
        f.write_all(&[7u8; 4096]).expect("more");
        assert!(tier.police_staging().is_empty());
        assert_eq!(std::fs::metadata(&path).expect("stat").len(), 0);
        let e = tier.place(&key(1), &token, 16).expect_err("refused");
        assert!(e.to_string().contains("past the 16 bytes"), "{e}");
        assert!(!path.exists(), "discarded");
    }

    /// Each save in flight holds a descriptor in the agent: one uid's
    /// count is bounded, another uid's saves go on.
    #[test]
    fn saves_in_flight_are_bounded_per_uid() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("open");
        for _ in 0..MAX_IN_FLIGHT_PER_UID {
            tier.begin(&key(1), 1, None).expect("begin");
        }
        let e = tier.begin(&key(1), 1, None).expect_err("one too many");
        assert!(
            matches!(e, TierError::TooManyInFlight { count, .. } if count == MAX_IN_FLIGHT_PER_UID),
            "{e}"
        );
        if fsafe::me() == 0 {
            let other = Owner {
                uid: 4242,
                gid: 4242,
            };
            tier.begin(&key(1), 1, Some(other)).expect("another uid");
        }
    }

    /// Issue 29: a corrupt manifest once made the agent delete the intact
    /// shard at start. Now the step moves whole to the quarantine.
    #[test]
    fn a_step_with_a_corrupt_manifest_is_quarantined_not_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("open");
        save(&tier, &key(1), b"intact shard bytes");
        save(&tier, &key(2), b"newer bytes");
        let manifest = tier.layout().manifest(&key(1));
        let whole = std::fs::read(&manifest).expect("manifest");
        std::fs::write(&manifest, &whole[..whole.len() / 2]).expect("truncate");
        drop(tier);

        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("reopen");
        let r = tier.take_recovered();
        assert_eq!(r.len(), 1, "{r:?}");
        let Fate::Quarantined(to) = &r[0].fate else {
            panic!("{r:?}")
        };
        assert_eq!(r[0].key, Some(key(1)));
        assert!(r[0].why.contains("rank 0"), "{}", r[0].why);
        assert!(to.starts_with(dir.path().join(QUARANTINE)), "{to:?}");
        assert_eq!(
            std::fs::read(to.join("rank-000000.bin")).expect("kept"),
            b"intact shard bytes"
        );
        assert_eq!(
            std::fs::read(to.join("rank-000000.json")).expect("kept"),
            &whole[..whole.len() / 2]
        );
        let q = std::fs::metadata(dir.path().join(QUARANTINE)).expect("quarantine");
        assert_eq!(q.mode() & 0o777, 0o700);
        assert!(!tier.layout().data(&key(1)).exists());
        let steps: Vec<u64> = tier.list(Some("j")).iter().map(|m| m.step).collect();
        assert_eq!(steps, vec![2], "the quarantine is never listed");
        // And stays out of later starts.
        drop(tier);
        let tier = LocalTier::open(dir.path(), "h", 4, 0).expect("reopen");
        assert!(tier.take_recovered().is_empty());
        assert!(to.join("rank-000000.bin").is_file());
    }

    #[test]
    fn a_shard_larger_than_the_quota_is_refused_before_anything_is_pruned() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = LocalTier::open(dir.path(), "h", 1, 64).expect("open");
        save(&tier, &key(1), &[1u8; 30]);
        save(&tier, &key(2), &[2u8; 30]);
        let e = tier.begin(&key(3), 65, None).expect_err("above max_bytes");
        assert!(
            matches!(e, TierError::Full { freed: 0, .. }),
            "{e}: RESOURCE_EXHAUSTED, nothing freed"
        );
        assert!(e.to_string().contains("nothing was pruned"), "{e}");
        let other = tempfile::tempdir().expect("tempdir");
        let unbounded = LocalTier::open(other.path(), "h", 1, 0).expect("open");
        let e = unbounded
            .begin(&key(3), u64::MAX, None)
            .expect_err("above the disk");
        assert!(e.to_string().contains("whole filesystem"), "{e}");
        // Step 1 is older than the newest complete step and would have
        // been the first pruned: still there.
        let steps: Vec<u64> = tier.list(Some("j")).iter().map(|m| m.step).collect();
        assert_eq!(steps, vec![1, 2]);
    }
}
