//! What "normal" looks like for each section of a job: recent durations.
//!
//! Hang thresholds are derived from these, so a job with 1 s steps is found
//! hung within seconds instead of after a fixed ten minutes. The history is
//! per job (all ranks of the job feed it) and persisted in the agent's state
//! directory, so a restarted training run is calibrated from its first step.
//!
//! Files: `<state_dir>/calibration/<job>.json`, reached through
//! [`crate::fsafe`]: the directory is the agent's own (a symlink or another
//! user's is refused), the file is read with `O_NOFOLLOW` relative to it and
//! replaced through a random new name renamed over it. A file that is a
//! symlink is refused (an error naming it), never read nor written through.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fsafe::{self, FsError};

/// Mode of `<state_dir>/calibration/`.
const DIR_MODE: u32 = 0o750;
/// Mode of a calibration file.
const FILE_MODE: u32 = 0o644;

/// Name used for time outside any section before the first step.
pub const INIT: &str = "init";
/// Name used for time outside any section between steps.
pub const IDLE: &str = "idle";
/// The section `warden.heal` opens around a restart attempt's regrouping
/// and heal from a live replica.
pub const HEAL: &str = "heal";
/// Where the agent puts a rank it asked to restart in process, from the
/// ask until the rank steps again (its teardown, process group and
/// restore), unless it opened a section since: the client marks no
/// section there, and the gap between steps its `idle` was calibrated on
/// is far shorter than a restart.
pub const RESTART: &str = "restart";
/// The section the Python client opens from a lost peer's error (with
/// `warden.heal` declared) until its next attempt begins: the wait for
/// that peer's heal (across hosts, the lost host's lease TTL and the
/// rejoin grace) and the teardown after it, which no ask of the agent's
/// covers. Judged by `hang.heal_timeout` until set apart
/// (`hang.timeouts.heal_wait`), and never calibrated: its length is the
/// launcher's wait, not the job's. Out of any section it was `idle`, and
/// a survivor waiting as designed was called hung.
pub const HEAL_WAIT: &str = "heal_wait";

/// Why calibration could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    /// The file or its directory was refused (a symlink, not a regular
    /// file, not the agent's) or could not be read or written; the error
    /// names it.
    #[error("calibration file: {0}")]
    Fs(#[from] FsError),
    /// The file is not what we wrote.
    #[error("calibration file {path} is not valid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
struct Samples {
    /// Durations in nanoseconds, oldest first.
    ns: VecDeque<u64>,
    /// Sorted copy, rebuilt lazily when `ns` changed.
    #[serde(skip)]
    sorted: Option<Vec<u64>>,
}

/// Per-section duration history of one job.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Calibration {
    /// File format version.
    version: u32,
    sections: BTreeMap<String, Samples>,
    /// Set on every new sample, cleared by [`Calibration::save`].
    #[serde(skip)]
    dirty: bool,
}

impl Calibration {
    /// Adds one observed duration of `section`, keeping at most `cap` samples.
    pub fn add(&mut self, section: &str, ns: u64, cap: usize) {
        let s = match self.sections.get_mut(section) {
            Some(s) => s,
            None => self.sections.entry(section.to_owned()).or_default(),
        };
        if s.ns.len() >= cap.max(1) {
            s.ns.pop_front();
        }
        s.ns.push_back(ns);
        s.sorted = None;
        self.dirty = true;
    }

    /// Number of samples of `section`.
    pub fn count(&self, section: &str) -> usize {
        self.sections.get(section).map_or(0, |s| s.ns.len())
    }

    /// The `p`th percentile (0-100, nearest rank) of `section`, if any samples.
    pub fn percentile(&mut self, section: &str, p: f64) -> Option<u64> {
        let s = self.sections.get_mut(section)?;
        if s.ns.is_empty() {
            return None;
        }
        let sorted = s.sorted.get_or_insert_with(|| {
            let mut v: Vec<u64> = s.ns.iter().copied().collect();
            v.sort_unstable();
            v
        });
        nearest_rank(sorted, p)
    }

    /// Whether samples were added since the last save.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Loads a job's history from `path` (as [`path_for`] makes it); a
    /// missing file is an empty history. The file's directory is the
    /// agent's (created as needed, see [`fsafe::parent_of`]); the file is
    /// opened without following a symlink.
    pub fn load(path: &Path) -> Result<Self, CalibrationError> {
        let (dir, name) = fsafe::parent_of(path, DIR_MODE)?;
        let text = match dir.read(&name) {
            Ok(t) => t,
            Err(e) if e.is_not_found() => return Ok(Self::default()),
            Err(e) => return Err(e.into()),
        };
        serde_json::from_slice(&text).map_err(|e| CalibrationError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Writes the history to `path` atomically: a new file under a random
    /// name beside it, synced, renamed over it; a symlink (or anything not a
    /// regular file) at `path` is refused and left as it is. Stays dirty
    /// when it fails.
    pub fn save(&mut self, path: &Path) -> Result<(), CalibrationError> {
        let (dir, name) = fsafe::parent_of(path, DIR_MODE)?;
        self.version = 1;
        let text = serde_json::to_vec(self).map_err(|e| CalibrationError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        dir.replace(&name, &text, FILE_MODE)?;
        self.dirty = false;
        Ok(())
    }
}

/// The `p`th percentile (0-100) of sorted values by the nearest-rank method;
/// None for no values.
pub fn nearest_rank(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// The file holding a job's calibration under the agent's state directory.
pub fn path_for(state_dir: &Path, job_id: &str) -> PathBuf {
    let safe: String = job_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    state_dir.join("calibration").join(format!("{safe}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_nearest_rank() {
        let mut c = Calibration::default();
        for v in 1..=100 {
            c.add("step", v, 1000);
        }
        assert_eq!(c.percentile("step", 99.0), Some(99));
        assert_eq!(c.percentile("step", 50.0), Some(50));
        assert_eq!(c.percentile("step", 100.0), Some(100));
        assert_eq!(c.percentile("forward", 99.0), None);
    }

    #[test]
    fn cap_drops_oldest() {
        let mut c = Calibration::default();
        for v in 0..10 {
            c.add("s", v, 4);
        }
        assert_eq!(c.count("s"), 4);
        assert_eq!(c.percentile("s", 0.0), Some(6));
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_for(dir.path(), "job/with spaces");
        assert!(path.ends_with("job_with_spaces.json"));
        let mut c = Calibration::default();
        c.add("forward", 42, 10);
        c.save(&path).unwrap();
        assert!(!c.is_dirty());
        let mut back = Calibration::load(&path).unwrap();
        assert_eq!(back.percentile("forward", 99.0), Some(42));
        assert_eq!(
            Calibration::load(&dir.path().join("missing.json"))
                .unwrap()
                .count("x"),
            0
        );
        std::fs::write(&path, "garbage").unwrap();
        assert!(Calibration::load(&path).is_err());
    }

    #[test]
    fn a_calibration_file_that_is_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let path = path_for(&state, "j");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut theirs = Calibration::default();
        theirs.add("forward", 7, 10);
        let target = dir.path().join("target.json");
        std::fs::write(&target, serde_json::to_vec(&theirs).unwrap()).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let before = std::fs::read(&target).unwrap();
        let named = |e: CalibrationError| {
            let e = e.to_string();
            assert!(
                e.contains("symlink") && e.contains(&path.display().to_string()),
                "{e}"
            );
        };
        named(Calibration::load(&path).unwrap_err());
        let mut c = Calibration::default();
        c.add("forward", 42, 10);
        named(c.save(&path).unwrap_err());
        assert!(c.is_dirty(), "not saved");
        assert_eq!(std::fs::read(&target).unwrap(), before, "target unchanged");
        assert!(path.is_symlink());
    }
}
