//! The local tier: staging, atomic commit, listing, retention, room.
//!
//! In: a rank's begin/commit, a replica or restored copy that arrived.
//! Out: committed shards on disk, each with its manifest. All file work is
//! blocking and short; callers on the runtime go through `spawn_blocking`.
//!
//! Contract: a shard is listed only once its manifest exists, and the
//! manifest is written only after the bytes were renamed into place and
//! hashed, so no listing ever shows a shard that is not whole. A save that
//! does not fit fails at begin, after old steps were pruned, with the
//! numbers that did not add up.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::layout::{self, Layout, ShardKey};
use super::manifest::{self, Manifest};
use super::retention;

/// A reservation nobody committed is forgotten after this long.
const RESERVATION_TTL: Duration = Duration::from_secs(600);
/// Staging files older than this at start belong to writers long gone.
const STALE_STAGING: Duration = Duration::from_secs(600);

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
    /// The filesystem said no.
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

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TierError {
    let path = path.display().to_string();
    move |source| TierError::Io { what, path, source }
}

/// Removes a staging file when dropped, unless [`StagedGuard::keep`] was
/// called: a gRPC handler is dropped mid-await when its peer's connection
/// goes, and its half-received file must not outlive it.
#[derive(Debug)]
pub struct StagedGuard(Option<PathBuf>);

impl StagedGuard {
    /// Guards `path`.
    pub fn new(path: PathBuf) -> Self {
        Self(Some(path))
    }

    /// The file is committed (renamed away): nothing to remove.
    pub fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for StagedGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// One host's local tier.
#[derive(Debug)]
pub struct LocalTier {
    layout: Layout,
    host: String,
    keep: usize,
    max_bytes: u64,
    /// Staging token -> (bytes promised, when).
    reserved: Mutex<HashMap<String, (u64, Instant)>>,
    /// Serialises commits, pruning and making room.
    lock: Mutex<()>,
    nonce: AtomicU64,
}

impl LocalTier {
    /// Opens (creating) the tier at `dir`; stale staging files are removed.
    pub fn open(dir: &Path, host: &str, keep: usize, max_bytes: u64) -> Result<Self, TierError> {
        let layout = Layout::new(dir);
        let staging = layout.staging();
        std::fs::create_dir_all(&staging).map_err(io("creating", &staging))?;
        // Ranks may run as another user of the agent's group: they write
        // into staging, the agent renames.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o770));
        if let Ok(rd) = std::fs::read_dir(&staging) {
            for e in rd.flatten() {
                let stale = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_none_or(|age| age > STALE_STAGING);
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(Self {
            layout,
            host: host.to_owned(),
            keep,
            max_bytes,
            reserved: Mutex::new(HashMap::new()),
            lock: Mutex::new(()),
            nonce: AtomicU64::new(0),
        })
    }

    /// The directory names.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Names a staging file for a shard about to be written, after making
    /// room for `size` bytes.
    pub fn begin(&self, key: &ShardKey, size: u64) -> Result<(PathBuf, String), TierError> {
        let token = self.token(key)?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.make_room(size)?;
        let mut r = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|_, (_, at)| at.elapsed() < RESERVATION_TTL);
        r.insert(token.clone(), (size, Instant::now()));
        Ok((self.layout.staging().join(&token), token))
    }

    /// A staging file for bytes arriving from elsewhere (a peer's replica,
    /// a restore), room made first. Not reserved: the agent writes it
    /// itself, at once.
    pub fn begin_incoming(&self, key: &ShardKey, size: u64) -> Result<PathBuf, TierError> {
        let token = self.token(key)?;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.make_room(size)?;
        Ok(self.layout.staging().join(token))
    }

    /// A staging file name unique to this agent, prefixed with the shard it
    /// belongs to (what [`LocalTier::staged`] checks).
    fn token(&self, key: &ShardKey) -> Result<String, TierError> {
        layout::check_job_id(&key.job_id)?;
        Ok(format!(
            "{}.{}.{}.{}-{}",
            key.job_id,
            key.step,
            key.rank,
            std::process::id(),
            self.nonce.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Forgets a reservation (commit done, or the writer gave up).
    pub fn release(&self, token: &str) {
        self.reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(token);
    }

    /// The staging file of `token`, checked to belong to `key`.
    pub fn staged(&self, key: &ShardKey, token: &str) -> Result<PathBuf, TierError> {
        let prefix = format!("{}.{}.{}.", key.job_id, key.step, key.rank);
        if !token.starts_with(&prefix) || token.contains('/') || token.contains("..") {
            return Err(TierError::Invalid(format!(
                "token {token:?} was not given by BeginShard for {key}"
            )));
        }
        Ok(self.layout.staging().join(token))
    }

    /// Moves a rank's staged bytes into place. The shard is not committed
    /// until [`LocalTier::seal`] writes its manifest.
    pub fn place(&self, key: &ShardKey, staged: &Path, size: u64) -> Result<PathBuf, TierError> {
        layout::check_job_id(&key.job_id)?;
        let meta = std::fs::metadata(staged).map_err(io("reading the staged shard", staged))?;
        if meta.len() != size {
            return Err(TierError::Invalid(format!(
                "{key}: the staged file {} holds {} bytes, the commit says {size}",
                staged.display(),
                meta.len()
            )));
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let dir = self.layout.step_dir(&key.job_id, key.step);
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        // A shard saved again: its old manifest goes first, so the old
        // checksum never describes the new bytes.
        let m = self.layout.manifest(key);
        match std::fs::remove_file(&m) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("removing", &m)(e)),
        }
        let data = self.layout.data(key);
        std::fs::rename(staged, &data).map_err(io("committing", &data))?;
        Ok(data)
    }

    /// Hashes a placed shard and writes its manifest: the commit point.
    pub fn seal(
        &self,
        key: &ShardKey,
        world_size: u32,
        origin: &str,
    ) -> Result<Manifest, TierError> {
        let data = self.layout.data(key);
        let (size, hash) = manifest::hash_file(&data).map_err(io("hashing", &data))?;
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

    /// Installs bytes already verified against `m` (a replica, a restored
    /// copy) and commits them under `m`.
    pub fn install(&self, staged: &Path, m: &Manifest) -> Result<PathBuf, TierError> {
        let key = m.key();
        let data = self.place(&key, staged, m.size_bytes)?;
        self.write_manifest(m)?;
        Ok(data)
    }

    fn write_manifest(&self, m: &Manifest) -> Result<(), TierError> {
        let path = self.layout.manifest(&m.key());
        let tmp = path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(m)
            .map_err(|e| TierError::Invalid(format!("manifest of {}: {e}", m.key())))?;
        let mut f = std::fs::File::create(&tmp).map_err(io("writing", &tmp))?;
        f.write_all(&body).map_err(io("writing", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(io("committing", &path))?;
        Ok(())
    }

    /// Every committed shard of `job` (all jobs when None). A manifest that
    /// does not parse, or whose bytes are missing or of another size, is
    /// left out with a warning: it is not a usable copy.
    pub fn list(&self, job: Option<&str>) -> Vec<Manifest> {
        let mut out = Vec::new();
        let jobs: Vec<String> = match job {
            Some(j) => vec![j.to_owned()],
            None => std::fs::read_dir(self.layout.root())
                .map(|rd| {
                    rd.flatten()
                        .filter_map(|e| e.file_name().into_string().ok())
                        .filter(|n| layout::check_job_id(n).is_ok())
                        .collect()
                })
                .unwrap_or_default(),
        };
        for j in jobs {
            let Ok(steps) = std::fs::read_dir(self.layout.job_dir(&j)) else {
                continue;
            };
            for s in steps.flatten() {
                let Some(step) = s.file_name().to_str().and_then(layout::parse_step) else {
                    continue;
                };
                let Ok(files) = std::fs::read_dir(s.path()) else {
                    continue;
                };
                for f in files.flatten() {
                    let Some(rank) = f.file_name().to_str().and_then(layout::parse_manifest_rank)
                    else {
                        continue;
                    };
                    match self.read_manifest(&j, step, rank) {
                        Ok(m) => out.push(m),
                        Err(e) => tracing::warn!(error = %e, "checkpoint shard left out"),
                    }
                }
            }
        }
        out.sort_by_key(Manifest::key);
        out
    }

    fn read_manifest(&self, job: &str, step: u64, rank: u32) -> Result<Manifest, String> {
        let key = ShardKey {
            job_id: job.to_owned(),
            step,
            rank,
        };
        let path = self.layout.manifest(&key);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let m = Manifest::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        if m.key() != key {
            return Err(format!("{} describes {}", path.display(), m.key()));
        }
        let data = self.layout.data(&key);
        let len = std::fs::metadata(&data)
            .map_err(|e| format!("{}: {e}", data.display()))?
            .len();
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
        self.read_manifest(&key.job_id, key.step, key.rank).ok()
    }

    /// Removes a shard (manifest first, so it stops being listed at once).
    pub fn remove(&self, key: &ShardKey) {
        let _ = std::fs::remove_file(self.layout.manifest(key));
        let _ = std::fs::remove_file(self.layout.data(key));
        let dir = self.layout.step_dir(&key.job_id, key.step);
        // Only succeeds once the step directory is empty.
        let _ = std::fs::remove_dir(&dir);
    }

    /// Applies retention to `job`; returns the shards removed.
    pub fn prune(&self, job: &str) -> Vec<ShardKey> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let gone = retention::expired(&self.list(Some(job)), self.keep);
        for k in &gone {
            self.remove(k);
        }
        gone
    }

    /// Bytes promised to saves in flight (reservations not yet expired).
    fn reserved_bytes(&self) -> u64 {
        self.reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|(_, at)| at.elapsed() < RESERVATION_TTL)
            .map(|(n, _)| *n)
            .sum()
    }

    fn free_bytes(&self) -> Result<u64, TierError> {
        let st = nix::sys::statvfs::statvfs(self.layout.root()).map_err(|e| TierError::Io {
            what: "statvfs",
            path: self.layout.root().display().to_string(),
            source: std::io::Error::from(e),
        })?;
        #[allow(clippy::unnecessary_cast)]
        Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
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
