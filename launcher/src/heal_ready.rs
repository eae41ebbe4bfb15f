//! Which workers declared a state that a live replica can heal
//! (`warden.heal.declare` in Python), so that the launcher replaces a lost
//! rank alone instead of restarting the job; and, across hosts, the round
//! the workers heal into.
//!
//! In: one file per rank in the job's `heal/` folder (`rank_<R>.pid`), the
//! worker's pid, written by the Python client through `WARDEN_HEAL_FILE`
//! when the training state is declared. Out: whether a given (rank, pid)
//! declared; the job's round file (`round.json`, named to the workers by
//! `WARDEN_HEAL_ROUND_FILE`), written by the launcher before it asks its
//! workers to heal into a new round across hosts: `warden.heal` makes the
//! next attempt's process group on that round's store. Never: trust the
//! file: links are refused (`O_NOFOLLOW`), only a plain file's first bytes
//! are read, and only its own pid counts (a file left by the rank's
//! previous process says nothing of the next). The round file is replaced
//! whole (a rename), so a worker never reads half of one.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The worker's variable naming its file.
pub const ENV: &str = "WARDEN_HEAL_FILE";

/// The worker's variable naming the job's round file (across hosts).
pub const ROUND_ENV: &str = "WARDEN_HEAL_ROUND_FILE";

/// The worker's variable saying how long a collective error that names a
/// lost peer waits for the heal's restart before it is reported (across
/// hosts: the lost host's lease, the rejoin grace, the round).
pub const PEER_WAIT_ENV: &str = "WARDEN_HEAL_PEER_WAIT_S";

/// The round the workers heal into: where its store is (rank 0's address
/// and the round's port) and its size, which the heal keeps.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HealRound {
    /// The round's epoch (`WARDEN_ROUND_EPOCH` of its fresh workers).
    pub epoch: u64,
    /// Node rank 0's address (`MASTER_ADDR`).
    pub master_addr: String,
    /// The round's port (`MASTER_PORT`).
    pub master_port: u16,
    /// Workers in the round (`WORLD_SIZE`).
    pub world_size: u32,
    /// Hosts in the round.
    pub nnodes: u32,
    /// The round store's port at node rank 0's launcher
    /// (`WARDEN_ROUND_STORE_PORT`, [`crate::round_store`]); absent when
    /// rank 0 hosts the round's store at `MASTER_PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_port: Option<u16>,
}

/// The round file in `dir` (the job's `heal/` folder).
pub fn round_file(dir: &Path) -> PathBuf {
    dir.join("round.json")
}

/// Writes `round` to `path` whole: a file beside it, then a rename.
pub fn write_round(path: &Path, round: &HealRound) -> std::io::Result<()> {
    let text = serde_json::to_vec(round).map_err(std::io::Error::other)?;
    let tmp = path.with_extension(format!("json.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Bytes read from one file (a pid and a newline).
const MAX_FILE_BYTES: u64 = 32;

/// Rank `rank`'s file in `dir`.
pub fn file_for(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank_{rank}.pid"))
}

/// Whether rank `rank`'s process `pid` declared a healable state in `dir`.
pub fn declared(dir: &Path, rank: u32, pid: i32) -> bool {
    let path = file_for(dir, rank);
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
    else {
        return false;
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut text = String::new();
    if file.take(MAX_FILE_BYTES).read_to_string(&mut text).is_err() {
        return false;
    }
    text.trim().parse::<i32>().is_ok_and(|p| p == pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_processs_own_pid_in_a_plain_file_counts() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!declared(dir.path(), 0, 42), "no file");
        std::fs::write(file_for(dir.path(), 0), "42\n").unwrap();
        assert!(declared(dir.path(), 0, 42));
        assert!(!declared(dir.path(), 0, 43), "another process of rank 0");
        assert!(!declared(dir.path(), 1, 42), "another rank");
        std::fs::write(file_for(dir.path(), 2), "4x2\n").unwrap();
        assert!(!declared(dir.path(), 2, 42), "not a pid");
        std::fs::write(file_for(dir.path(), 3), format!("42{}", " ".repeat(100))).unwrap();
        assert!(
            declared(dir.path(), 3, 42),
            "trailing space cut at the bound"
        );
        std::fs::write(file_for(dir.path(), 4), format!("{}42", " ".repeat(100))).unwrap();
        assert!(!declared(dir.path(), 4, 42), "past the bound");
        let real = dir.path().join("real");
        std::fs::write(&real, "42\n").unwrap();
        std::os::unix::fs::symlink(&real, file_for(dir.path(), 5)).unwrap();
        assert!(!declared(dir.path(), 5, 42), "a link is refused");
        std::fs::create_dir(file_for(dir.path(), 6)).unwrap();
        assert!(!declared(dir.path(), 6, 42), "a folder");
    }

    #[test]
    fn a_round_file_is_replaced_whole_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = round_file(dir.path());
        let mut r = HealRound {
            epoch: 3,
            master_addr: "127.0.0.2".into(),
            master_port: 29503,
            world_size: 2,
            nnodes: 2,
            store_port: Some(30503),
        };
        write_round(&path, &r).unwrap();
        r.epoch = 4;
        r.master_port = 29504;
        write_round(&path, &r).unwrap();
        let back: HealRound = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, r);
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
