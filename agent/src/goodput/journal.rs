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
//! is rewritten with only the latest lines (a new file under a random name,
//! synced, renamed over it).
//!
//! Files are reached through [`crate::fsafe`]: the state dir and
//! `goodput/` are the agent's own directories, each journal is opened
//! relative to `goodput/`'s descriptor with `O_NOFOLLOW`. A journal that is
//! a symlink (or not a regular file) is never read nor written through:
//! replay skips it with a warning naming it, and its job's lines are
//! refused with an error naming it (reported once, until a write of that
//! job succeeds again) while every other job's journal goes on.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ledger::{JobLedger, Ledger, RankLedger};
use crate::fsafe::{self, Dir, FsError};

/// Size past which a job's journal is compacted.
pub const COMPACT_AT: u64 = 4 << 20;

/// Mode of `<state_dir>/goodput/`.
const DIR_MODE: u32 = 0o750;
/// Mode of a journal.
const FILE_MODE: u32 = 0o644;

/// Why the journal could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// A write to an open journal failed.
    #[error("goodput journal {path}: cannot {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file or directory was refused (a symlink, not a regular file, not
    /// the agent's) or could not be opened, created or replaced; the error
    /// names it.
    #[error("goodput journal: {0}")]
    Fs(#[from] FsError),
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
    /// `<state_dir>/goodput`, opened once.
    dir: Dir,
    /// Open files by job, with their size.
    files: BTreeMap<String, (File, u64)>,
    /// Jobs whose last write failed, with the error already reported.
    failing: BTreeMap<String, String>,
}

impl Journal {
    /// Opens `<state_dir>/goodput` (both the agent's, created as needed;
    /// a symlink or a directory of someone else is refused) and replays
    /// every journal in it. Lines that cannot be read (a torn last line)
    /// are skipped, and so is a journal that is refused (a symlink, not a
    /// regular file) or cannot be read; each comes back as a warning naming
    /// the file (and line).
    pub fn open(state_dir: &Path) -> Result<(Journal, Ledger, Vec<String>), JournalError> {
        let dir = Dir::ensure(state_dir, fsafe::STATE_DIR_MODE)?.sub("goodput", DIR_MODE, true)?;
        let mut ledger = Ledger::default();
        let mut warnings = Vec::new();
        let mut entries: Vec<String> = dir
            .names()?
            .into_iter()
            .filter(|n| Path::new(n).extension().is_some_and(|x| x == "jsonl"))
            .collect();
        entries.sort();
        for name in entries {
            let path = dir.path().join(&name);
            let text = match dir.read(&name) {
                Ok(t) => t,
                Err(e) => {
                    warnings.push(format!("{e}: skipped; its jobs' accounts start afresh"));
                    continue;
                }
            };
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
                failing: BTreeMap::new(),
            },
            ledger,
            warnings,
        ))
    }

    /// Appends the state of every rank changed since the last flush. A job
    /// whose journal cannot be written (refused, or a failed write) does not
    /// stop the others; its error comes back once, and again only when it
    /// changes or after a write of that job succeeded.
    pub fn flush(&mut self, ledger: &mut Ledger) -> Result<(), Vec<JournalError>> {
        let mut errors = Vec::new();
        self.failing.retain(|job, _| ledger.jobs.contains_key(job));
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
            let written = self.append(job, &buf).and_then(|size| {
                if size > COMPACT_AT {
                    self.compact(job, j)
                } else {
                    Ok(())
                }
            });
            match written {
                Ok(()) => {
                    self.failing.remove(job);
                }
                Err(e) => {
                    let said = e.to_string();
                    if self.failing.get(job) != Some(&said) {
                        self.failing.insert(job.clone(), said);
                        errors.push(e);
                    }
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The journal file of `job`.
    pub fn path_of(&self, job: &str) -> PathBuf {
        self.dir.path().join(journal_name(job))
    }

    fn append(&mut self, job: &str, buf: &[u8]) -> Result<u64, JournalError> {
        let path = self.path_of(job);
        if !self.files.contains_key(job) {
            let (f, st) = self.dir.open_append(&journal_name(job), FILE_MODE)?;
            let len = u64::try_from(st.st_size).unwrap_or(0);
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
        self.dir.replace(&journal_name(job), &buf, FILE_MODE)?;
        self.files.remove(job);
        Ok(())
    }
}

/// The name of `job`'s journal in `goodput/`.
fn journal_name(job: &str) -> String {
    format!("{}.jsonl", file_name(job))
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
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
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

    #[test]
    fn a_journal_that_is_a_symlink_is_neither_read_nor_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let target = dir.path().join("elsewhere.jsonl");
        // Lines the agent would replay, were it to follow the link.
        let mut l = sample();
        let mut lines = Vec::new();
        line(&mut lines, &job_record("a/b", &l.jobs["a/b"]));
        std::fs::write(&target, &lines).unwrap();
        std::fs::create_dir_all(state.join("goodput")).unwrap();
        let link = state.join("goodput").join("a_b.jsonl");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let named = |e: &str| {
            assert!(
                e.contains("symlink") && e.contains(&link.display().to_string()),
                "{e}"
            );
        };

        let (mut j, back, warnings) = Journal::open(&state).unwrap();
        assert!(back.jobs.is_empty(), "the link was not read");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        named(&warnings[0]);
        assert_eq!(j.path_of("a/b"), link);
        // Another job's journal is written all the same.
        l.registered("c", 0, 11, 0, 1_000);
        let errors = j.flush(&mut l).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        named(&errors[0].to_string());
        assert!(j.path_of("c").is_file());
        // Reported once; compaction is refused too.
        l.jobs.get_mut("a/b").unwrap().dirty.insert(0);
        j.flush(&mut l).unwrap();
        let job = l.jobs["a/b"].clone();
        named(&j.compact("a/b", &job).unwrap_err().to_string());
        assert_eq!(std::fs::read(&target).unwrap(), lines, "target unchanged");
        assert!(link.is_symlink());
    }
}
