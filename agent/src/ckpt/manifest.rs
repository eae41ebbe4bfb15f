//! A shard's manifest (size, xxh3-64, world size, origin) and checksums.
//!
//! The manifest is written after the shard's bytes, by rename, so a shard
//! is committed exactly when its manifest exists; a crash in between leaves
//! bytes no listing shows. xxh3-64 hashes at memory speed (tens of GB/s),
//! so checking a copy before serving it costs little next to reading it.

use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::layout::ShardKey;

/// What is known of a committed shard, wherever it is held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The job.
    pub job_id: String,
    /// The step.
    pub step: u64,
    /// The rank that saved it.
    pub rank: u32,
    /// The job's ranks when it was saved: the step is complete when every
    /// rank below this has a shard.
    pub world_size: u32,
    /// Bytes.
    pub size_bytes: u64,
    /// xxh3-64 of the bytes, as 16 hex digits (JSON numbers lose u64s).
    pub xxh3: String,
    /// The host whose rank saved it.
    pub origin: String,
    /// When it was committed here, seconds since the epoch.
    pub committed_unix: u64,
}

impl Manifest {
    /// The shard it describes.
    pub fn key(&self) -> ShardKey {
        ShardKey {
            job_id: self.job_id.clone(),
            step: self.step,
            rank: self.rank,
        }
    }

    /// The checksum as a number; a manifest with a malformed one names it.
    pub fn hash(&self) -> Result<u64, String> {
        u64::from_str_radix(&self.xxh3, 16).map_err(|_| {
            format!(
                "manifest of {} has xxh3 {:?}, not 16 hex digits",
                self.key(),
                self.xxh3
            )
        })
    }

    /// Parses a manifest file's bytes; the error says what is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        m.hash()?;
        super::layout::check_job_id(&m.job_id).map_err(|e| e.to_string())?;
        if m.world_size == 0 || m.rank >= m.world_size {
            return Err(format!(
                "rank {} is not below world_size {}",
                m.rank, m.world_size
            ));
        }
        // A manifest from elsewhere (the durable store) sizes loops over
        // ranks: bounded like every request.
        if m.world_size > warden_core::rank::MAX_WORLD_SIZE {
            return Err(format!(
                "world_size {} is above the most any agent takes ({})",
                m.world_size,
                warden_core::rank::MAX_WORLD_SIZE
            ));
        }
        Ok(m)
    }
}

/// Formats a checksum the way manifests hold it.
pub fn hex(hash: u64) -> String {
    format!("{hash:016x}")
}

/// Size and xxh3-64 of a file opened by the caller (never by path here:
/// the tier opens its files without following symlinks), read in 4 MiB
/// blocks from where it stands.
pub fn hash_reader(f: &mut impl Read) -> std::io::Result<(u64, u64)> {
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(buf.get(..n).unwrap_or_default());
    }
    Ok((size, h.digest()))
}

/// Checks the bytes of `f` (the file at `path`) against `m`; the error
/// says what differs.
pub fn verify(f: &mut impl Read, path: &Path, m: &Manifest) -> Result<(), String> {
    let want = m.hash()?;
    let (size, got) = hash_reader(f).map_err(|e| format!("{}: {e}", path.display()))?;
    if size != m.size_bytes {
        return Err(format!(
            "corrupt: {} is {size} bytes, its manifest says {}",
            path.display(),
            m.size_bytes
        ));
    }
    if got != want {
        return Err(format!(
            "corrupt: {} has xxh3 {}, its manifest says {}",
            path.display(),
            hex(got),
            m.xxh3
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_names_size_and_checksum_mismatches() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("s.bin");
        std::fs::write(&p, b"hello shard").expect("write");
        let open = || std::fs::File::open(&p).expect("open");
        let (size, h) = hash_reader(&mut open()).expect("hash");
        assert_eq!(size, 11);
        assert_eq!(h, xxhash_rust::xxh3::xxh3_64(b"hello shard"));
        let mut m = Manifest {
            job_id: "j".into(),
            step: 1,
            rank: 0,
            world_size: 1,
            size_bytes: 11,
            xxh3: hex(h),
            origin: "h1".into(),
            committed_unix: 0,
        };
        assert!(verify(&mut open(), &p, &m).is_ok());
        m.xxh3 = hex(h ^ 1);
        assert!(
            verify(&mut open(), &p, &m)
                .expect_err("bad hash")
                .contains("xxh3")
        );
        m.size_bytes = 12;
        assert!(
            verify(&mut open(), &p, &m)
                .expect_err("bad size")
                .contains("12")
        );
    }

    #[test]
    fn a_manifest_with_nonsense_is_refused_with_the_reason() {
        let bad = br#"{"job_id":"j","step":1,"rank":3,"world_size":2,"size_bytes":1,"xxh3":"00","origin":"h","committed_unix":0}"#;
        assert!(
            Manifest::parse(bad)
                .expect_err("rank")
                .contains("world_size")
        );
        let bad = br#"{"job_id":"../x","step":1,"rank":0,"world_size":2,"size_bytes":1,"xxh3":"00","origin":"h","committed_unix":0}"#;
        assert!(Manifest::parse(bad).expect_err("job").contains("job_id"));
    }
}
