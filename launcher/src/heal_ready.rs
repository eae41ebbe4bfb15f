//! Which workers declared a state that a live replica can heal
//! (`warden.heal.declare` in Python), so that the launcher replaces a lost
//! rank alone instead of restarting the job.
//!
//! In: one file per rank in the job's `heal/` folder (`rank_<R>.pid`), the
//! worker's pid, written by the Python client through `WARDEN_HEAL_FILE`
//! when the training state is declared. Out: whether a given (rank, pid)
//! declared. Never: trust the file: links are refused (`O_NOFOLLOW`), only
//! a plain file's first bytes are read, and only its own pid counts (a
//! file left by the rank's previous process says nothing of the next).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The worker's variable naming its file.
pub const ENV: &str = "WARDEN_HEAL_FILE";

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
}
