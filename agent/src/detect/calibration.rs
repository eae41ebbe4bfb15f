//! What "normal" looks like for each section of a job: recent durations.
//!
//! Hang thresholds are derived from these, so a job with 1 s steps is found
//! hung within seconds instead of after a fixed ten minutes. The history is
//! per job (all ranks of the job feed it) and persisted in the agent's state
//! directory, so a restarted training run is calibrated from its first step.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name used for time outside any section before the first step.
pub const INIT: &str = "init";
/// Name used for time outside any section between steps.
pub const IDLE: &str = "idle";

/// Why calibration could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    /// Reading or writing the file failed.
    #[error("calibration file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
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

    /// Loads a job's history; a missing file is an empty history.
    pub fn load(path: &Path) -> Result<Self, CalibrationError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(CalibrationError::Io {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        serde_json::from_str(&text).map_err(|e| CalibrationError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Writes the history atomically (temp file, then rename).
    pub fn save(&mut self, path: &Path) -> Result<(), CalibrationError> {
        let io = |source| CalibrationError::Io {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        self.version = 1;
        let text = serde_json::to_string(self).map_err(|e| CalibrationError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)?;
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
}
