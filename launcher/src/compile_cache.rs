//! The job's compilation caches in the agent's checkpoint tier, so that a
//! restarted worker does not compile again: torch.compile's (Inductor's FX
//! graph cache and its Triton kernels) and JAX/XLA's persistent cache.
//!
//! In: the user's cache folder the agent made in its tier (ClaimJob's
//! `compile_cache_dir`, `<tier>/.cache/<uid>`, this user's, mode 0700), the
//! job id and the bounds (`--compile-cache-max-gib` per job,
//! `--compile-cache-user-max-gib` for all the user's jobs). Out: the
//! workers' variables (`TORCHINDUCTOR_CACHE_DIR`,
//! `TORCHINDUCTOR_FX_GRAPH_CACHE`, `TRITON_CACHE_DIR`,
//! `JAX_COMPILATION_CACHE_DIR`, each kept when the user set it) pointing
//! into `<folder>/<job>/`, and the folders kept under the bounds: the job's
//! folder under its own (its files least recently written go first, no
//! other job's), then the user's whole folder under the user's total (the
//! files least recently written of all their jobs go first), so one job
//! cannot evict another's cache by growing and one user cannot fill the
//! tier.
//! Never: follows a symlink (a link is removed as a link; nothing outside
//! the folder is read or deleted), or fails the job: a cache that cannot
//! be made is said on the console and the workers run without it.
//!
//! Why the launcher bounds it, not the agent: the folder is the user's own
//! (their workers write it), and the launcher runs as that user, so the
//! eviction needs no privilege; an agent running as root on a shared node
//! never walks a tree another user can change under it.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Most files looked at in one pass: a cache of more is evicted from the
/// ones seen (the walk stops there, and says so).
pub(crate) const MAX_FILES: usize = 1_000_000;
/// Deepest folder nesting walked (Inductor's is 3 or 4 levels).
pub(crate) const MAX_DEPTH: usize = 16;

/// One job's cache folders.
#[derive(Debug, Clone)]
pub struct CompileCache {
    /// The user's folder in the tier (all their jobs' caches).
    root: PathBuf,
    /// This job's: `<root>/<job>`.
    job: PathBuf,
    /// The bound on this job's folder, bytes.
    max_bytes: u64,
    /// The bound on the whole user's folder (all their jobs), bytes.
    user_max_bytes: u64,
}

/// What one eviction pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Eviction {
    /// Bytes in the job's folder before the pass.
    pub before: u64,
    /// Bytes in the user's folder after the job's was bounded.
    pub user_before: u64,
    /// Files removed, and their bytes.
    pub removed: usize,
    /// Bytes removed.
    pub removed_bytes: u64,
    /// The walk stopped at [`MAX_FILES`].
    pub truncated: bool,
}

impl CompileCache {
    /// This job's folders under `root` (made, mode 0700); `job` is a
    /// directory-safe job id; `max_bytes` bounds the job's folder,
    /// `user_max_bytes` the user's (raised to `max_bytes` when below it).
    pub fn prepare(
        root: &Path,
        job: &str,
        max_bytes: u64,
        user_max_bytes: u64,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let meta = std::fs::symlink_metadata(root)?;
        if !meta.is_dir() {
            return Err(std::io::Error::other(format!(
                "{} is not a directory",
                root.display()
            )));
        }
        let job_dir = root.join(job);
        for sub in ["", "inductor", "triton", "jax"] {
            let d = if sub.is_empty() {
                job_dir.clone()
            } else {
                job_dir.join(sub)
            };
            match std::fs::DirBuilder::new().mode(0o700).create(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if !std::fs::symlink_metadata(&d)?.is_dir() {
                        return Err(std::io::Error::other(format!(
                            "{} is not a directory",
                            d.display()
                        )));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Self {
            root: root.to_owned(),
            job: job_dir,
            max_bytes,
            user_max_bytes: user_max_bytes.max(max_bytes),
        })
    }

    /// This job's folder.
    pub fn dir(&self) -> &Path {
        &self.job
    }

    /// The bound on the job's folder, bytes (a packed job's cache is
    /// held to it too).
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The workers' variables, each left out when `inherited` has it (the
    /// user's own choice wins).
    pub fn env(&self, inherited: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
        let at = |sub: &str| self.job.join(sub).to_string_lossy().into_owned();
        [
            ("TORCHINDUCTOR_CACHE_DIR", at("inductor")),
            ("TORCHINDUCTOR_FX_GRAPH_CACHE", "1".to_owned()),
            ("TRITON_CACHE_DIR", at("triton")),
            ("JAX_COMPILATION_CACHE_DIR", at("jax")),
        ]
        .into_iter()
        .filter(|(k, _)| inherited(k).is_none())
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Removes the least recently written files of the job's folder until
    /// it holds at most the job's bound, then those of the user's folder
    /// (all their jobs) until it holds at most the user's. Blocking (file
    /// system walk): run it off the runtime.
    pub fn evict(&self) -> Eviction {
        let mut out = Eviction::default();
        out.before = evict_oldest(&self.job, self.max_bytes, &mut out);
        out.user_before = evict_oldest(&self.root, self.user_max_bytes, &mut out);
        out
    }
}

/// Removes the least recently written files below `dir` until it holds at
/// most `bound` bytes, counting them in `out`; returns the bytes before.
fn evict_oldest(dir: &Path, bound: u64, out: &mut Eviction) -> u64 {
    let mut files = Vec::new();
    walk(dir, 0, &mut files, &mut out.truncated);
    let before: u64 = files.iter().map(|f| f.1).sum();
    if before <= bound {
        return before;
    }
    files.sort_by_key(|f| f.0);
    let mut left = before;
    for (_, size, path) in files {
        if left <= bound {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            left = left.saturating_sub(size);
            out.removed += 1;
            out.removed_bytes += size;
        }
    }
    before
}

/// Every regular file (and symlink, as one of 0 bytes, so that a link
/// never outlives the bound's pass) below `dir`: (written at, bytes, path).
pub(crate) fn walk(
    dir: &Path,
    depth: usize,
    files: &mut Vec<(SystemTime, u64, PathBuf)>,
    truncated: &mut bool,
) {
    if depth > MAX_DEPTH {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if files.len() >= MAX_FILES {
            *truncated = true;
            return;
        }
        let path = e.path();
        // Never followed: the entry itself.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            walk(&path, depth + 1, files, truncated);
        } else {
            let at = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            let size = if meta.is_file() { meta.len() } else { 0 };
            files.push((at, size, path));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn write(p: &Path, bytes: usize, age_s: u64) {
        std::fs::write(p, vec![0u8; bytes]).expect("write");
        let at = SystemTime::now() - Duration::from_secs(age_s);
        let f = std::fs::File::options().write(true).open(p).expect("open");
        f.set_modified(at).expect("mtime");
    }

    #[test]
    fn the_env_points_into_the_job_folder_and_keeps_the_users_own() {
        let t = tempfile::tempdir().expect("tempdir");
        let c = CompileCache::prepare(t.path(), "job-1", 1 << 30, 1 << 32).expect("prepare");
        assert!(c.dir().join("inductor").is_dir() && c.dir().join("jax").is_dir());
        let env = c.env(|k| (k == "TRITON_CACHE_DIR").then(|| "/mine".to_owned()));
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            get("TORCHINDUCTOR_CACHE_DIR"),
            Some(t.path().join("job-1/inductor").display().to_string())
        );
        assert_eq!(get("TORCHINDUCTOR_FX_GRAPH_CACHE").as_deref(), Some("1"));
        assert_eq!(get("TRITON_CACHE_DIR"), None);
        // Again: the folders are kept.
        std::fs::write(c.dir().join("inductor/x"), b"1").expect("write");
        CompileCache::prepare(t.path(), "job-1", 1 << 30, 1 << 32).expect("again");
        assert!(c.dir().join("inductor/x").exists());
    }

    #[test]
    fn a_job_over_its_bound_loses_its_own_oldest_files_never_another_jobs() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("user");
        std::fs::create_dir(&root).expect("mkdir");
        // 2500 bytes a job, 10000 for the user: only the job bound bites.
        let a = CompileCache::prepare(&root, "a", 2500, 10_000).expect("a");
        let b = CompileCache::prepare(&root, "b", 2500, 10_000).expect("b");
        write(&b.dir().join("triton/oldest"), 1000, 900);
        write(&a.dir().join("inductor/old"), 1000, 600);
        write(&a.dir().join("triton/mid"), 1000, 300);
        write(&a.dir().join("jax/new"), 1000, 10);
        let e = a.evict();
        assert_eq!((e.before, e.user_before), (3000, 3000), "{e:?}");
        assert_eq!((e.removed, e.removed_bytes), (1, 1000), "{e:?}");
        // The job's oldest went; the other job's older file stays.
        assert!(!a.dir().join("inductor/old").exists());
        assert!(a.dir().join("triton/mid").exists() && a.dir().join("jax/new").exists());
        assert!(b.dir().join("triton/oldest").exists());
        // In order: a tighter job bound takes the next oldest, then the newest.
        let one = CompileCache {
            max_bytes: 1000,
            ..a.clone()
        };
        one.evict();
        assert!(!a.dir().join("triton/mid").exists() && a.dir().join("jax/new").exists());
        // Under both bounds: nothing more goes.
        assert_eq!(one.evict().removed, 0);
        // A user bound below the job's is raised to it.
        let c = CompileCache::prepare(&root, "c", 5000, 1).expect("c");
        assert_eq!(c.user_max_bytes, 5000);
    }

    #[test]
    fn the_oldest_files_of_all_jobs_go_first_and_no_link_is_followed() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("user");
        std::fs::create_dir(&root).expect("mkdir");
        // Each job under its own bound; the user's total (2500) bites.
        let a = CompileCache::prepare(&root, "a", 2500, 2500).expect("a");
        let b = CompileCache::prepare(&root, "b", 2500, 2500).expect("b");
        write(&a.dir().join("inductor/old"), 1000, 300);
        write(&b.dir().join("triton/older"), 1000, 600);
        write(&a.dir().join("inductor/new"), 1000, 10);
        // Links to a file and a folder outside: never followed or counted.
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).expect("mkdir");
        write(&outside.join("precious"), 10_000, 900);
        std::os::unix::fs::symlink(outside.join("precious"), a.dir().join("jax/link"))
            .expect("link");
        std::os::unix::fs::symlink(&outside, a.dir().join("jax/dirlink")).expect("link");

        let e = a.evict();
        assert_eq!((e.before, e.user_before), (2000, 3000), "{e:?}");
        assert_eq!((e.removed, e.removed_bytes), (1, 1000), "{e:?}");
        assert!(!b.dir().join("triton/older").exists());
        assert!(a.dir().join("inductor/old").exists() && a.dir().join("inductor/new").exists());

        let tight = CompileCache {
            max_bytes: 0,
            user_max_bytes: 0,
            ..a.clone()
        };
        tight.evict();
        assert!(!a.dir().join("inductor/new").exists());
        assert!(
            outside.join("precious").exists(),
            "a link's target was removed"
        );
        assert_eq!(
            std::fs::metadata(outside.join("precious"))
                .expect("stat")
                .len(),
            10_000
        );
    }
}
