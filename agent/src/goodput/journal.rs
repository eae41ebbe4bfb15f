//! The ledger on disk: one append-only journal per job in
//! `<state_dir>/goodput/<job>.jsonl`, replayed when the agent starts, so a
//! restart of the agent (a crash, `kill -9`, an upgrade) loses at most the
//! last flush interval, which the ledger then shows as idle/unknown time.
//!
//! Each line is the whole state of one rank (or of the job's own flags) as
//! of a flush; replay keeps the last line of each. Lines are written with a
//! single `write` of the line and its newline, so an agent killed midway
//! leaves at most one torn line at the end: it is skipped with a warning
//! and the rank's previous line stands. A journal past [`COMPACT_AT`] bytes
//! is rewritten with only the latest lines (a new file renamed over it).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ledger::{JobLedger, Ledger, RankLedger};

/// Size past which a job's journal is compacted.
pub const COMPACT_AT: u64 = 4 << 20;

/// Why the journal could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A file operation failed.
    #[error("goodput journal {path}: cannot {op}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

/// One line of a journal.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
enum Record {
    /// A rank's whole account.
    Rank {
        job: String,
        rank: u32,
        ledger: Box<RankLedger>,
    },
    /// The job's own flags.
    Job {
        job: String,
        resumed_ns: Option<u64>,
        stragglers: Vec<u32>,
    },
}

/// The journals of every job.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    /// Open files by job, with their size.
    files: BTreeMap<String, (File, u64)>,
}

impl Journal {
    /// Opens `<state_dir>/goodput` and replays every journal in it. Lines
    /// that cannot be read (a torn last line) are skipped; each comes back
    /// as a warning naming the file and line.
    pub fn open(state_dir: &Path) -> Result<(Journal, Ledger, Vec<String>), JournalError> {
        let dir = state_dir.join("goodput");
        let io = |op: &'static str, path: &Path| {
            let path = path.to_owned();
            move |source| JournalError::Io { path, op, source }
        };
        std::fs::create_dir_all(&dir).map_err(io("create directory", &dir))?;
        let mut ledger = Ledger::default();
        let mut warnings = Vec::new();
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io("list directory", &dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
            .collect();
        entries.sort();
        for path in entries {
            let text = std::fs::read(&path).map_err(io("read", &path))?;
            let text = String::from_utf8_lossy(&text);
            let lines: Vec<&str> = text.split('\n').collect();
            for (i, line) in lines.iter().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Record>(line) {
                    Ok(r) => apply(&mut ledger, r),
                    Err(e) => warnings.push(format!(
                        "{} line {}{}: skipped ({e})",
                        path.display(),
                        i + 1,
                        if i + 1 >= lines.len().saturating_sub(1) {
                            " (the last: torn by an agent that stopped while writing)"
                        } else {
                            ""
                        }
                    )),
                }
            }
        }
        Ok((
            Journal {
                dir,
                files: BTreeMap::new(),
            },
            ledger,
            warnings,
        ))
    }

    /// Appends the state of every rank changed since the last flush.
    pub fn flush(&mut self, ledger: &mut Ledger) -> Result<(), JournalError> {
        for (job, j) in &mut ledger.jobs {
            if j.dirty.is_empty() {
                continue;
            }
            let mut buf = Vec::new();
            line(&mut buf, &job_record(job, j));
            for rank in &j.dirty {
                if let Some(r) = j.ranks.get(rank) {
                    line(
                        &mut buf,
                        &Record::Rank {
                            job: job.clone(),
                            rank: *rank,
                            ledger: Box::new(r.clone()),
                        },
                    );
                }
            }
            j.dirty.clear();
            let size = self.append(job, &buf)?;
            if size > COMPACT_AT {
                self.compact(job, j)?;
            }
        }
        Ok(())
    }

    /// The journal file of `job`.
    pub fn path_of(&self, job: &str) -> PathBuf {
        self.dir.join(format!("{}.jsonl", file_name(job)))
    }

    fn append(&mut self, job: &str, buf: &[u8]) -> Result<u64, JournalError> {
        let path = self.path_of(job);
        if !self.files.contains_key(job) {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|source| JournalError::Io {
                    path: path.clone(),
                    op: "open for appending",
                    source,
                })?;
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            self.files.insert(job.to_owned(), (f, len));
        }
        let Some((f, len)) = self.files.get_mut(job) else {
            return Ok(0);
        };
        // Lines end with '\n'; one write per flush of a job keeps a torn
        // write to the tail.
        f.write_all(buf).map_err(|source| JournalError::Io {
            path,
            op: "append",
            source,
        })?;
        *len += buf.len() as u64;
        Ok(*len)
    }

    /// Rewrites `job`'s journal with its current state only.
    fn compact(&mut self, job: &str, j: &JobLedger) -> Result<(), JournalError> {
        let path = self.path_of(job);
        let tmp = path.with_extension("jsonl.tmp");
        let mut buf = Vec::new();
        line(&mut buf, &job_record(job, j));
        for (rank, r) in &j.ranks {
            line(
                &mut buf,
                &Record::Rank {
                    job: job.to_owned(),
                    rank: *rank,
                    ledger: Box::new(r.clone()),
                },
            );
        }
        let io = |op: &'static str, p: &Path| {
            let path = p.to_owned();
            move |source| JournalError::Io { path, op, source }
        };
        std::fs::write(&tmp, &buf).map_err(io("write compacted copy", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(io("replace with compacted copy", &path))?;
        self.files.remove(job);
        Ok(())
    }
}

fn job_record(job: &str, j: &JobLedger) -> Record {
    Record::Job {
        job: job.to_owned(),
        resumed_ns: j.resumed_ns,
        stragglers: j.stragglers.iter().copied().collect(),
    }
}

fn line(buf: &mut Vec<u8>, r: &Record) {
    // Serialising these plain structs cannot fail; a failure would only
    // drop the line, which replay survives.
    if serde_json::to_writer(&mut *buf, r).is_ok() {
        buf.push(b'\n');
    }
}

fn apply(ledger: &mut Ledger, r: Record) {
    match r {
        Record::Rank {
            job,
            rank,
            ledger: l,
        } => {
            ledger.jobs.entry(job).or_default().ranks.insert(rank, *l);
        }
        Record::Job {
            job,
            resumed_ns,
            stragglers,
        } => {
            let j = ledger.jobs.entry(job).or_default();
            j.resumed_ns = resumed_ns;
            j.stragglers = stragglers.into_iter().collect();
        }
    }
}

/// A job id as a file name (several ids may share a file: every line names
/// its job).
fn file_name(job: &str) -> String {
    job.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::super::ledger::{ExitKind, StepObs};
    use super::*;

    /// What the journal keeps (baselines are relearned, not kept).
    fn journaled(l: &Ledger) -> serde_json::Value {
        serde_json::to_value(&l.jobs["a/b"].ranks).unwrap()
    }

    fn sample() -> Ledger {
        let mut l = Ledger::default();
        l.registered("a/b", 0, 10, 0, 1_000);
        l.step(
            "a/b",
            0,
            StepObs {
                pid: 10,
                step: 0,
                start_ns: 2_000,
                duration_ns: 5_000,
                data_ns: 0,
            },
        );
        l.straggler("a/b", 3, true);
        l
    }

    #[test]
    fn replay_gives_back_what_was_flushed_and_a_torn_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, w) = Journal::open(dir.path()).unwrap();
        assert!(w.is_empty());
        let mut l = sample();
        j.flush(&mut l).unwrap();
        l.exited("a/b", 0, 10, ExitKind::Clean, 9_000);
        j.flush(&mut l).unwrap();
        let path = j.path_of("a/b");
        // A torn line at the end, as a kill -9 during a write leaves it.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"record\":\"rank\",\"job\":\"a/b\",\"ra")
            .unwrap();
        drop(f);
        let (_, back, warnings) = Journal::open(dir.path()).unwrap();
        assert_eq!(journaled(&back), journaled(&l));
        assert_eq!(back.jobs["a/b"].stragglers, l.jobs["a/b"].stragglers);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("torn"), "{warnings:?}");
    }

    #[test]
    fn compaction_keeps_the_latest_state() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        let mut l = sample();
        j.flush(&mut l).unwrap();
        let job = l.jobs["a/b"].clone();
        j.compact("a/b", &job).unwrap();
        l.jobs.get_mut("a/b").unwrap().dirty.insert(0);
        j.flush(&mut l).unwrap();
        let (_, back, warnings) = Journal::open(dir.path()).unwrap();
        assert!(warnings.is_empty());
        assert_eq!(journaled(&back), journaled(&l));
        let lines = std::fs::read_to_string(j.path_of("a/b")).unwrap();
        assert_eq!(lines.lines().count(), 4);
    }
}
