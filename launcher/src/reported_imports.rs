//! What the workers imported, as their clients report it, for the standby
//! interpreters of warm restarts.
//!
//! In: one file per rank in the job's `imports/` folder (`rank_<R>.txt`, a
//! top-level package name a line), written by the Python client
//! (`warden._imports`, through `WARDEN_IMPORTS_FILE`) when `warden.run`
//! starts and a little later. Out: the union of the names, for the
//! standbys to import too. Never: trust the files: every count is
//! bounded, links and oversized files are skipped, a name that is not a
//! plain Python identifier is left out (the standby imports each name it is
//! given).

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The worker's variable naming its file.
pub const ENV: &str = "WARDEN_IMPORTS_FILE";

/// Files looked at in the folder (one per local rank is the need).
const MAX_FILES: usize = 1024;
/// Bytes read from one file.
const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Names kept in all (the client writes at most 256 per rank).
pub const MAX_NAMES: usize = 256;
/// Length of one name.
const MAX_NAME_LEN: usize = 128;

/// Rank `rank`'s file in `dir`.
pub fn file_for(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank_{rank}.txt"))
}

/// A top-level module name the standby may import: a plain identifier.
pub fn valid(name: &str) -> bool {
    let mut chars = name.chars();
    (1..=MAX_NAME_LEN).contains(&name.len())
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Every rank's reported names in `dir`, sorted, at most [`MAX_NAMES`];
/// empty when there is no folder yet.
pub fn read(dir: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return names;
    };
    for entry in entries.flatten().take(MAX_FILES) {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("rank_") && name.ends_with(".txt")) {
            continue;
        }
        // A plain file only (file_type does not follow a link).
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let mut text = String::new();
        // O_NOFOLLOW too: a file swapped for a link after the check above
        // is refused, not followed.
        let read = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(entry.path())
            .and_then(|f| f.take(MAX_FILE_BYTES).read_to_string(&mut text));
        if read.is_err() {
            continue;
        }
        for line in text.lines().map(str::trim).filter(|l| valid(l)) {
            if names.len() >= MAX_NAMES {
                return names;
            }
            names.insert(line.to_owned());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_identifiers() {
        for ok in ["numpy", "_private", "transformers", "a1"] {
            assert!(valid(ok), "{ok}");
        }
        for bad in ["", "a.b", "1a", "os;rm", "a b", "ü", &"x".repeat(129)] {
            assert!(!valid(bad), "{bad}");
        }
    }

    #[test]
    fn every_ranks_file_is_read_bounded_and_links_skipped() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(&dir.path().join("missing")).is_empty());
        std::fs::write(file_for(dir.path(), 0), "numpy\nyaml\n").unwrap();
        std::fs::write(file_for(dir.path(), 1), "yaml\nbad.name\n  transformers \n").unwrap();
        std::fs::write(dir.path().join("other.txt"), "ignored\n").unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "linked\n").unwrap();
        std::os::unix::fs::symlink(&secret, file_for(dir.path(), 2)).unwrap();
        let got: Vec<String> = read(dir.path()).into_iter().collect();
        assert_eq!(got, ["numpy", "transformers", "yaml"]);

        let many: String = (0..400).map(|i| format!("m{i}\n")).collect();
        std::fs::write(file_for(dir.path(), 3), many).unwrap();
        assert_eq!(read(dir.path()).len(), MAX_NAMES);
    }
}
