//! Where shards live in the local tier, and which names are acceptable.
//!
//! `<dir>/<job>/step-<20 digits>/rank-<6 digits>.bin` with the manifest
//! `rank-<6 digits>.json` beside it; `<dir>/.staging/` holds files being
//! written. Zero-padded numbers make a directory listing sort by step. Job
//! ids become directory names, so they are checked here: a job id that
//! could climb out of the tier (`..`, `/`) is refused, not escaped.

use std::path::{Path, PathBuf};

/// Identifies one shard: one rank's bytes of one step of one job.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardKey {
    /// The job.
    pub job_id: String,
    /// The training step the shard belongs to.
    pub step: u64,
    /// The rank (global) that saved it.
    pub rank: u32,
}

impl std::fmt::Display for ShardKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} step {} rank {}", self.job_id, self.step, self.rank)
    }
}

/// Why a name was refused. The name is quoted clipped (its first 64
/// bytes and its length): a caller's megabyte of name must not come back
/// as a megabyte of error message, which no gRPC client reads as a header.
#[derive(Debug, thiserror::Error)]
#[error(
    "job_id {} can't name a checkpoint directory: use 1-128 of A-Z a-z 0-9 . _ - not starting with '.'",
    quoted(.0)
)]
pub struct BadJobId(pub String);

/// `"name"`, or `"first 64 bytes"... (N bytes)` when longer.
fn quoted(name: &str) -> String {
    let head = warden_slot::truncate_utf8(name, 64);
    if head.len() == name.len() {
        format!("{name:?}")
    } else {
        format!("{head:?}... ({} bytes)", name.len())
    }
}

/// Checks a job id before it becomes a directory name.
pub fn check_job_id(job: &str) -> Result<(), BadJobId> {
    let ok = !job.is_empty()
        && job.len() <= 128
        && !job.starts_with('.')
        && job
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(BadJobId(job.to_owned()))
    }
}

/// The highest step a shard may be saved at: 2^53 - 1, the largest integer
/// every JSON reader of a manifest (Python's, JavaScript's) reads exactly.
pub const MAX_STEP: u64 = (1 << 53) - 1;

/// Why a step was refused.
#[derive(Debug, thiserror::Error)]
#[error("step {0} is above the highest a checkpoint may be saved at ({MAX_STEP})")]
pub struct BadStep(pub u64);

/// Checks a step before it names a directory and a manifest field.
pub fn check_step(step: u64) -> Result<(), BadStep> {
    if step > MAX_STEP {
        return Err(BadStep(step));
    }
    Ok(())
}

/// The tier's directory names.
#[derive(Debug, Clone)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    /// A layout rooted at `root` (the `checkpoint.dir`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The tier's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Files in flight: same filesystem as the tier, so commit is a rename.
    pub fn staging(&self) -> PathBuf {
        self.root.join(".staging")
    }

    /// One job's steps.
    pub fn job_dir(&self, job: &str) -> PathBuf {
        self.root.join(job)
    }

    /// One step's shards.
    pub fn step_dir(&self, job: &str, step: u64) -> PathBuf {
        self.job_dir(job).join(step_name(step))
    }

    /// A shard's bytes.
    pub fn data(&self, key: &ShardKey) -> PathBuf {
        self.step_dir(&key.job_id, key.step)
            .join(data_name(key.rank))
    }

    /// A shard's manifest: its presence is what makes the shard committed.
    pub fn manifest(&self, key: &ShardKey) -> PathBuf {
        self.step_dir(&key.job_id, key.step)
            .join(manifest_name(key.rank))
    }
}

/// The file name of a rank's bytes in its step directory.
pub fn data_name(rank: u32) -> String {
    format!("rank-{rank:06}.bin")
}

/// The file name of a rank's manifest in its step directory.
pub fn manifest_name(rank: u32) -> String {
    format!("rank-{rank:06}.json")
}

/// The file name of the marker a scrub leaves beside a rank's shard whose
/// bytes no longer match its manifest: the copy is kept for inspection but
/// never listed, replicated or restored; it holds the reason.
pub fn bad_name(rank: u32) -> String {
    format!("rank-{rank:06}.bad")
}

/// The rank and kind ("bin", "json", "bad") of a shard file name
/// `rank-000003.<kind>`.
pub fn parse_shard_file(name: &str) -> Option<(u32, &str)> {
    let (rank, kind) = name.strip_prefix("rank-")?.split_once('.')?;
    if rank.len() != 6 {
        return None;
    }
    Some((rank.parse().ok()?, kind))
}

/// `step-00000000000000000042`.
pub fn step_name(step: u64) -> String {
    format!("step-{step:020}")
}

/// The step of a directory named by [`step_name`].
pub fn parse_step(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// The rank of a manifest file name `rank-000003.json`.
pub fn parse_manifest_rank(name: &str) -> Option<u32> {
    name.strip_prefix("rank-")?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// Object-store key of a shard's bytes or manifest under the durable prefix.
pub fn durable_key(key: &ShardKey, manifest: bool) -> String {
    format!(
        "{}/{}/rank-{:06}.{}",
        key.job_id,
        step_name(key.step),
        key.rank,
        if manifest { "json" } else { "bin" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_that_could_escape_are_refused() {
        for good in ["job-1", "llama_70b.run3", "A"] {
            assert!(check_job_id(good).is_ok(), "{good}");
        }
        for bad in ["", "..", ".hidden", "a/b", "a b", &"x".repeat(129)] {
            let err = check_job_id(bad).expect_err(bad).to_string();
            assert!(err.contains("job_id"), "{err}");
        }
        // A huge name comes back clipped, with its length.
        let err = check_job_id(&"y".repeat(1 << 20))
            .expect_err("huge")
            .to_string();
        assert!(err.len() < 300 && err.contains("(1048576 bytes)"), "{err}");
    }

    #[test]
    fn names_round_trip_and_sort_by_number() {
        assert_eq!(parse_step(&step_name(42)), Some(42));
        assert!(step_name(9) < step_name(10));
        assert_eq!(parse_manifest_rank("rank-000007.json"), Some(7));
        assert_eq!(parse_manifest_rank("rank-000007.bin"), None);
        assert_eq!(parse_shard_file(&bad_name(7)), Some((7, "bad")));
        assert_eq!(parse_shard_file(&data_name(3)), Some((3, "bin")));
        assert_eq!(parse_shard_file("rank-7.bin"), None);
        assert_eq!(parse_shard_file(".tmp-abc"), None);
        let k = ShardKey {
            job_id: "j".into(),
            step: 3,
            rank: 1,
        };
        assert_eq!(
            durable_key(&k, true),
            "j/step-00000000000000000003/rank-000001.json"
        );
    }
}
