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
//!
//! Descriptors are bounded: a job's journal is closed as soon as a flush
//! finds every rank of the job ended (its ranks exited, or CloseGoodput
//! closed it), when it was not written for [`IDLE_FLUSHES`] flushes, and
//! the least recently written one is closed when [`MAX_OPEN`] are open; the
//! next write of that job opens it again. So an agent that has seen any
//! number of jobs holds at most [`MAX_OPEN`] journal descriptors.
//!
//! Each job has a file of its own: the name is the id with every byte
//! outside `[A-Za-z0-9_.-]` percent-encoded (an injective mapping, so
//! `a/b` and `a_b` no longer share `a_b.jsonl`, and compacting one cannot
//! drop the other's lines); an id whose name would pass [`MAX_NAME`] bytes
//! keeps a prefix and a 64-bit hash of the whole id. Journals written under
//! an older naming are replayed first and then rewritten under their jobs'
//! names and removed.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::ledger::{JobLedger, Ledger, RankLedger};
use crate::fsafe::{self, Dir, FsError};

/// Size past which a job's journal is compacted.
pub const COMPACT_AT: u64 = 4 << 20;

/// Most journals kept open at once: past it the least recently written
/// one is closed (reopened on its next write). A job's journal is written
/// at most once a flush, so reopening costs one `openat` per job and flush
/// at worst, where holding every job's descriptor ran the agent out of them
/// (issue 22: about 240 jobs exhausted `nofile=256`).
pub const MAX_OPEN: usize = 32;

/// Flushes without a write after which a job's journal is closed.
pub const IDLE_FLUSHES: u64 = 10;

/// Longest journal name (without `.jsonl`) before it is shortened to a
/// prefix and a hash; well under `NAME_MAX` (255).
pub const MAX_NAME: usize = 200;

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

/// A job's journal while it is open.
#[derive(Debug)]
struct OpenJournal {
    /// Opened for append.
    file: File,
    /// Its size, to know when to compact.
    len: u64,
    /// The flush that last wrote it (for the idle close and the LRU).
    last_flush: u64,
}

/// The journals of every job.
#[derive(Debug)]
pub struct Journal {
    /// `<state_dir>/goodput`, opened once.
    dir: Dir,
    /// Open files by job (at most [`MAX_OPEN`]).
    files: BTreeMap<String, OpenJournal>,
    /// Flushes so far: the clock of `last_flush`.
    flushes: u64,
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
        // Files whose jobs are written elsewhere now (an older naming) are
        // replayed first, so the current journal of a job has the last say.
        let mut legacy: Vec<String> = Vec::new();
        let mut jobs_of: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for name in &entries {
            let Ok(text) = dir.read(name) else { continue };
            let jobs: std::collections::BTreeSet<String> = String::from_utf8_lossy(&text)
                .split('\n')
                .filter_map(|l| serde_json::from_str::<Record>(l).ok())
                .map(|r| r.job().to_owned())
                .collect();
            if jobs.iter().any(|j| journal_name(j) != *name) {
                legacy.push(name.clone());
            }
            jobs_of.insert(name.clone(), jobs.into_iter().collect());
        }
        entries.sort_by_key(|n| !legacy.contains(n));
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
        let mut journal = Journal {
            dir,
            files: BTreeMap::new(),
            flushes: 0,
            failing: BTreeMap::new(),
        };
        for name in legacy {
            let jobs = jobs_of.remove(&name).unwrap_or_default();
            if let Err(e) = journal.migrate(&name, &jobs, &ledger) {
                warnings.push(format!(
                    "{e}: the older journal {name} stays and is replayed before the current ones"
                ));
            }
        }
        Ok((journal, ledger, warnings))
    }

    /// Rewrites the jobs of `name`, a journal of an older naming, each into
    /// its own journal, then removes `name`.
    fn migrate(
        &mut self,
        name: &str,
        jobs: &[String],
        ledger: &Ledger,
    ) -> Result<(), JournalError> {
        for job in jobs {
            if let Some(j) = ledger.jobs.get(job) {
                self.compact(job, j)?;
            }
        }
        if jobs.iter().all(|j| journal_name(j) != name) {
            self.dir.remove(name)?;
        }
        Ok(())
    }

    /// Journals open now (for tests and the benchmark).
    pub fn open_files(&self) -> usize {
        self.files.len()
    }

    /// Appends the state of every rank changed since the last flush. A job
    /// whose journal cannot be written (refused, or a failed write) does not
    /// stop the others; its error comes back once, and again only when it
    /// changes or after a write of that job succeeded.
    ///
    /// Then closes the journals of jobs whose ranks have all ended and of
    /// jobs not written for [`IDLE_FLUSHES`] flushes.
    pub fn flush(&mut self, ledger: &mut Ledger) -> Result<(), Vec<JournalError>> {
        let mut errors = Vec::new();
        self.flushes += 1;
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
        let now = self.flushes;
        self.files.retain(|job, f| {
            now.saturating_sub(f.last_flush) < IDLE_FLUSHES
                && ledger.jobs.get(job).is_some_and(|j| !j.all_ended())
        });
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// Removes `job`'s journal (retention pruned the job: see
    /// [`super::Retention`]). A journal already gone is no error; a refused
    /// one (a symlink planted at its name) is unlinked itself, never
    /// followed.
    pub fn remove(&mut self, job: &str) -> Result<(), JournalError> {
        self.files.remove(job);
        self.failing.remove(job);
        match self.dir.remove(&journal_name(job)) {
            Err(e) if !e.is_not_found() => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// The journal file of `job`.
    pub fn path_of(&self, job: &str) -> PathBuf {
        self.dir.path().join(journal_name(job))
    }

    fn append(&mut self, job: &str, buf: &[u8]) -> Result<u64, JournalError> {
        let path = self.path_of(job);
        if !self.files.contains_key(job) {
            if self.files.len() >= MAX_OPEN {
                let oldest = self
                    .files
                    .iter()
                    .min_by_key(|(_, f)| f.last_flush)
                    .map(|(j, _)| j.clone());
                if let Some(oldest) = oldest {
                    self.files.remove(&oldest);
                }
            }
            let (file, st) = self.dir.open_append(&journal_name(job), FILE_MODE)?;
            let len = u64::try_from(st.st_size).unwrap_or(0);
            self.files.insert(
                job.to_owned(),
                OpenJournal {
                    file,
                    len,
                    last_flush: self.flushes,
                },
            );
        }
        let Some(f) = self.files.get_mut(job) else {
            return Ok(0);
        };
        f.last_flush = self.flushes;
        // Lines end with '\n'; one write per flush of a job keeps a torn
        // write to the tail.
        f.file.write_all(buf).map_err(|source| JournalError::Io {
            path,
            op: "append",
            source,
        })?;
        f.len += buf.len() as u64;
        Ok(f.len)
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

impl Record {
    /// The job the line belongs to.
    fn job(&self) -> &str {
        match self {
            Record::Rank { job, .. } | Record::Job { job, .. } => job,
        }
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

/// A job id as a file name, one per id: bytes outside `[A-Za-z0-9_.-]`
/// (and a leading `.`) become `%XX`, so two ids never share a name; a name
/// longer than [`MAX_NAME`] keeps its first bytes and `~` with the FNV-1a
/// hash of the whole id (`~` is never produced by the encoding, so a
/// shortened name cannot meet a plain one).
fn file_name(job: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(job.len());
    for (i, b) in job.bytes().enumerate() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    if out.len() > MAX_NAME {
        out.truncate(MAX_NAME - 17);
        let _ = write!(out, "~{:016x}", fnv1a(job.as_bytes()));
    }
    out
}

/// FNV-1a, 64 bits: a hash that is the same in every build (std's
/// `DefaultHasher` may change between Rust releases, and a journal's name
/// must not).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
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
        let link = state.join("goodput").join("a%2Fb.jsonl");
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

    #[test]
    fn names_are_one_per_id_and_bounded() {
        let ids = ["a/b", "a_b", "a%2Fb", ".hidden", "%2Ehidden", "x.y", "é"];
        let names: std::collections::BTreeSet<String> =
            ids.iter().map(|i| journal_name(i)).collect();
        assert_eq!(names.len(), ids.len(), "{names:?}");
        assert_eq!(journal_name("job-1.a_b"), "job-1.a_b.jsonl");
        assert!(!journal_name(".x").starts_with('.'));
        let long_a = "/".repeat(128);
        let long_b = format!("{}x", "/".repeat(127));
        let (a, b) = (journal_name(&long_a), journal_name(&long_b));
        assert_ne!(a, b);
        assert!(
            a.len() <= MAX_NAME + 6 && b.len() <= MAX_NAME + 6,
            "{a} {b}"
        );
    }

    #[test]
    fn two_ids_of_one_old_name_keep_their_lines_through_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        let mut l = sample();
        l.registered("a_b", 0, 11, 0, 1_000);
        j.flush(&mut l).unwrap();
        let other = l.jobs["a_b"].clone();
        j.compact("a_b", &other).unwrap();
        let (_, back, warnings) = Journal::open(dir.path()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(back.jobs.contains_key("a/b") && back.jobs.contains_key("a_b"));
    }

    #[test]
    fn descriptors_are_closed_when_jobs_end_idle_or_crowd() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = Journal::open(dir.path()).unwrap();
        let mut l = Ledger::default();
        // Ended jobs: closed by the flush that wrote their last lines.
        for i in 0..100 {
            let job = format!("done-{i}");
            l.registered(&job, 0, 10, 0, 1_000);
            l.exited(&job, 0, 10, ExitKind::Clean, 2_000);
            j.flush(&mut l).unwrap();
            assert_eq!(j.open_files(), 0, "{job}");
        }
        // Running jobs: at most MAX_OPEN open, the oldest closed first.
        for i in 0..(MAX_OPEN + 8) {
            l.registered(&format!("run-{i}"), 0, 10, 0, 1_000);
            j.flush(&mut l).unwrap();
            assert!(j.open_files() <= MAX_OPEN);
        }
        assert!(
            !j.files.contains_key("run-0")
                && j.files.contains_key(&format!("run-{}", MAX_OPEN + 7))
        );
        // Idle: nothing written for IDLE_FLUSHES flushes.
        for _ in 0..IDLE_FLUSHES {
            j.flush(&mut l).unwrap();
        }
        assert_eq!(j.open_files(), 0);
        // Reopened on demand: the next lines land in the same file.
        l.step(
            "run-0",
            0,
            StepObs {
                pid: 10,
                step: 0,
                start_ns: 2_000,
                duration_ns: 5_000,
                data_ns: 0,
            },
        );
        j.flush(&mut l).unwrap();
        assert_eq!(j.open_files(), 1);
        let (_, back, _) = Journal::open(dir.path()).unwrap();
        assert_eq!(back.jobs.len(), 100 + MAX_OPEN + 8);
        // What is journaled (baselines are relearned, not kept).
        let kept = |l: &Ledger| serde_json::to_value(&l.jobs["run-0"].ranks).unwrap();
        assert_eq!(kept(&back), kept(&l));
    }

    #[test]
    fn a_journal_of_the_older_naming_is_replayed_then_moved() {
        let dir = tempfile::tempdir().unwrap();
        let l = sample();
        let goodput = dir.path().join("goodput");
        std::fs::create_dir_all(&goodput).unwrap();
        let mut lines = Vec::new();
        line(&mut lines, &job_record("a/b", &l.jobs["a/b"]));
        for (rank, r) in &l.jobs["a/b"].ranks {
            line(
                &mut lines,
                &Record::Rank {
                    job: "a/b".into(),
                    rank: *rank,
                    ledger: Box::new(r.clone()),
                },
            );
        }
        // Written by an agent that named it "a_b".
        std::fs::write(goodput.join("a_b.jsonl"), &lines).unwrap();
        let (j, back, warnings) = Journal::open(dir.path()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(journaled(&back), journaled(&l));
        assert!(!goodput.join("a_b.jsonl").exists());
        assert!(j.path_of("a/b").is_file());
        let (_, again, _) = Journal::open(dir.path()).unwrap();
        assert_eq!(journaled(&again), journaled(&l));
    }
}
