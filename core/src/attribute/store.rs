//! Incidents as the API serves them, kept on disk so an agent restart
//! loses neither the record nor the history the budgets and the repeat
//! rule read; and the node's cordon, told to cluster tools through a
//! node-condition file.
//!
//! Files (in the state directory): `incidents.jsonl`, one JSON record per
//! decision, appended and compacted to the newest `retain`;
//! `node-ledger.json`, the incidents that bear on the node (those the
//! agent's own evidence supports: what the cordon, the lemon rule and the
//! circuit breaker read), kept apart from that journal so no flood of other
//! records (ReportJobStop) pushes them out; `cordon.json`
//! while a decision has the node cordoned; the condition file (by default
//! `node-condition.json`), always present, written atomically.
//!
//! Every one is reached through [`crate::fsafe`]: the state directory is
//! opened once as the agent's own; files in it are opened relative to it
//! with `O_NOFOLLOW` and replaced through a random new name renamed over
//! them. A condition file configured outside the state directory is written
//! the same way in its directory as the system resolves it
//! ([`fsafe::write_leaf`]). A file that is a symlink (or not a regular
//! file) is refused with a warning naming it, never read nor written
//! through; the store goes on in memory. A `cordon.json` there that cannot
//! be read (refused, or damaged as before) keeps the node cordoned.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::diagnosis::IncidentRecord;
use crate::fsafe::{self, Dir, FsError};

/// The incident journal's name in the state directory.
const JOURNAL: &str = "incidents.jsonl";
/// The cordon's name in the state directory.
const CORDON: &str = "cordon.json";
/// The node ledger's name in the state directory.
const LEDGER: &str = "node-ledger.json";
/// Incidents the node ledger keeps (the newest): far more than the lemon
/// rule and the breaker count in their windows. Only incidents the agent's
/// own evidence supports enter it, so no caller can fill it.
pub const LEDGER_RETAIN: usize = 256;
/// Mode of the store's files (the condition file is read by cluster tools).
const FILE_MODE: u32 = 0o644;

/// Why a cordon is in force.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cordon {
    /// Since when.
    pub since: SystemTime,
    /// The incident whose decision cordoned the node.
    pub incident: String,
    /// Its fault class.
    pub class: String,
    /// Its summary.
    pub summary: String,
}

/// Where the node condition is written.
#[derive(Debug)]
enum ConditionFile {
    /// This name in the state directory (the default).
    InState(String),
    /// A path the operator chose outside the state directory
    /// ([`fsafe::write_leaf`]).
    Elsewhere(PathBuf),
}

/// The incidents of this agent and the node's cordon.
#[derive(Debug)]
pub struct IncidentStore {
    records: VecDeque<IncidentRecord>,
    retain: usize,
    /// The state directory, opened once; None: the journal and the cordon
    /// are kept in memory only.
    dir: Option<Dir>,
    journal_lines: usize,
    cordon: Option<Cordon>,
    condition: Option<ConditionFile>,
    /// The incidents that bear on the node ([`bears_on_node`]), oldest
    /// first, outside the journal's LRU.
    ledger: VecDeque<IncidentRecord>,
}

/// True for an incident the node-level rules read: one whose diagnosis
/// the agent's own evidence supports, charged to this node. Never a
/// launcher's stop or a rank's word.
pub fn bears_on_node(r: &IncidentRecord) -> bool {
    r.kind.charges_node() && r.diagnosis.corroborated()
}

impl IncidentStore {
    /// An empty store that keeps nothing on disk (tests, no state dir).
    pub fn in_memory(retain: usize) -> Self {
        Self {
            records: VecDeque::new(),
            retain: retain.max(1),
            dir: None,
            journal_lines: 0,
            cordon: None,
            condition: None,
            ledger: VecDeque::new(),
        }
    }

    /// Loads the journal and the cordon from `state_dir` (the agent's own
    /// directory: created as needed; a symlink or another user's is
    /// refused, and the store then keeps them in memory only). A damaged
    /// line is skipped with a warning (the rest is kept): a torn last write
    /// must not cost the whole history. A journal that is refused (a
    /// symlink) is not read, with a warning naming it.
    pub fn load(state_dir: &Path, condition_file: PathBuf, retain: usize) -> Self {
        let mut store = Self::in_memory(retain);
        let dir = match Dir::ensure(state_dir, fsafe::STATE_DIR_MODE) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "state directory refused or unusable; incidents and the cordon are kept in memory only");
                None
            }
        };
        if let Some(dir) = &dir {
            let journal = dir.path().join(JOURNAL);
            match dir.read(JOURNAL) {
                Ok(text) => {
                    let text = String::from_utf8_lossy(&text);
                    for (n, line) in text.lines().enumerate() {
                        if line.trim().is_empty() {
                            continue;
                        }
                        store.journal_lines += 1;
                        match serde_json::from_str::<IncidentRecord>(line) {
                            Ok(r) => store.upsert_mem(r),
                            Err(e) => tracing::warn!(
                                file = %journal.display(), line = n + 1, error = %e,
                                "skipping a damaged incident record"
                            ),
                        }
                    }
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the incident journal; the history starts empty");
                }
            }
            store.cordon = load_cordon(dir);
            match dir.read(LEDGER) {
                Ok(text) => match serde_json::from_slice::<Vec<IncidentRecord>>(&text) {
                    Ok(v) => {
                        for r in v {
                            store.ledger_mem(r);
                        }
                    }
                    Err(e) => tracing::warn!(file = %dir.path().join(LEDGER).display(), error = %e,
                        "node ledger unreadable; the node-level rules start from the journal alone"),
                },
                Err(e) if e.is_not_found() => {
                    // First start with a ledger: what the journal holds.
                    for r in store.records.clone() {
                        store.ledger_mem(r);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot read the node ledger"),
            }
        }
        store.dir = dir;
        // In the state directory: through its descriptor (or not at all
        // when it was refused), never by path.
        let in_state = condition_file.parent() == Some(state_dir);
        store.condition = Some(match condition_file.file_name().and_then(|n| n.to_str()) {
            Some(name) if in_state => ConditionFile::InState(name.to_owned()),
            _ => ConditionFile::Elsewhere(condition_file),
        });
        store.write_condition();
        store
    }

    /// Every record, oldest first (the engine's history at start-up).
    pub fn all(&self) -> Vec<IncidentRecord> {
        self.records.iter().cloned().collect()
    }

    /// What the node-level rules read (the lemon rule, the circuit
    /// breaker): the node ledger and the journal, each incident once.
    pub fn node_journal(&self) -> Vec<IncidentRecord> {
        let mut out: Vec<IncidentRecord> = self.ledger.iter().cloned().collect();
        out.extend(
            self.records
                .iter()
                .filter(|r| !self.ledger.iter().any(|l| l.id == r.id))
                .cloned(),
        );
        out
    }

    /// The newest `limit` records of `job` (empty: all jobs; 0: no limit),
    /// oldest first. The node ledger's incidents stay listed after the
    /// journal dropped them: a cordon's evidence outlives any flood.
    pub fn list(&self, job: &str, limit: usize) -> Vec<IncidentRecord> {
        let mut out: Vec<IncidentRecord> = self
            .records
            .iter()
            .chain(
                self.ledger
                    .iter()
                    .filter(|l| !self.records.iter().any(|r| r.id == l.id)),
            )
            .filter(|r| job.is_empty() || r.job == job)
            .cloned()
            .collect();
        out.sort_by_key(|r| r.opened_at);
        if limit > 0 && out.len() > limit {
            out.drain(..out.len() - limit);
        }
        out
    }

    fn upsert_mem(&mut self, r: IncidentRecord) {
        if let Some(old) = self.records.iter_mut().find(|o| o.id == r.id) {
            *old = r;
            return;
        }
        self.records.push_back(r);
        while self.records.len() > self.retain {
            self.records.pop_front();
        }
    }

    /// Adds or replaces a record; with `persist`, appends it to the journal
    /// (and rewrites the node ledger when it bears on the node).
    pub fn upsert(&mut self, r: IncidentRecord, persist: bool) {
        if persist {
            self.append(&r);
        }
        if bears_on_node(&r) {
            self.ledger_mem(r.clone());
            if persist {
                self.write_ledger();
            }
        }
        self.upsert_mem(r);
    }

    fn ledger_mem(&mut self, r: IncidentRecord) {
        if !bears_on_node(&r) {
            return;
        }
        if let Some(old) = self.ledger.iter_mut().find(|o| o.id == r.id) {
            *old = r;
            return;
        }
        self.ledger.push_back(r);
        while self.ledger.len() > LEDGER_RETAIN {
            self.ledger.pop_front();
        }
    }

    /// Rewrites the node ledger (atomically, never through a link).
    fn write_ledger(&self) {
        let Some(dir) = &self.dir else {
            return;
        };
        let recs: Vec<&IncidentRecord> = self.ledger.iter().collect();
        match serde_json::to_vec(&recs) {
            Ok(b) => {
                if let Err(e) = dir.replace(LEDGER, &b, FILE_MODE) {
                    tracing::warn!(error = %e, "cannot write the node ledger; it holds until the agent restarts");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot encode the node ledger"),
        }
    }

    fn append(&mut self, r: &IncidentRecord) {
        if self.dir.is_none() {
            return;
        }
        let line = match serde_json::to_string(r) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode an incident record");
                return;
            }
        };
        if let Err(e) = self.append_line(&line) {
            tracing::warn!(error = %e, "cannot append to the incident journal");
            return;
        }
        self.journal_lines += 1;
        // Updates append; once the file holds twice what is kept, rewrite it.
        if self.journal_lines > 2 * self.retain.max(64) {
            self.compact();
        }
    }

    /// Appends `line` and a newline to the journal (one write), never
    /// through a symlink.
    fn append_line(&self, line: &str) -> Result<(), FsError> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let (mut f, _) = dir.open_append(JOURNAL, FILE_MODE)?;
        f.write_all(format!("{line}\n").as_bytes())
            .map_err(|source| FsError::Io {
                what: "appending to",
                path: dir.path().join(JOURNAL).display().to_string(),
                source,
            })
    }

    fn compact(&mut self) {
        let Some(dir) = &self.dir else {
            return;
        };
        let mut text = String::new();
        for r in &self.records {
            if let Ok(l) = serde_json::to_string(r) {
                text.push_str(&l);
                text.push('\n');
            }
        }
        match dir.replace(JOURNAL, text.as_bytes(), FILE_MODE) {
            Ok(()) => self.journal_lines = self.records.len(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot compact the incident journal")
            }
        }
    }

    /// The cordon in force, if any.
    pub fn cordon(&self) -> Option<&Cordon> {
        self.cordon.as_ref()
    }

    /// Cordons the node (once: a second decision keeps the first reason).
    /// Returns false when it already was.
    pub fn set_cordon(&mut self, c: Cordon) -> bool {
        if self.cordon.is_some() {
            return false;
        }
        if let Some(dir) = &self.dir {
            match serde_json::to_vec_pretty(&c) {
                Ok(b) => {
                    if let Err(e) = dir.replace(CORDON, &b, FILE_MODE) {
                        tracing::warn!(error = %e, "cannot persist the cordon; it holds until the agent restarts");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot encode the cordon; it holds until the agent restarts");
                }
            }
        }
        self.cordon = Some(c);
        self.write_condition();
        true
    }

    /// Lifts the cordon; returns what it was. The cordon file is removed
    /// (a link there is removed itself, never what it points to).
    pub fn clear_cordon(&mut self) -> Option<Cordon> {
        let was = self.cordon.take();
        if let Some(dir) = &self.dir
            && let Err(e) = dir.remove(CORDON)
            && !e.is_not_found()
        {
            tracing::warn!(error = %e, "cannot remove the cordon file");
        }
        self.write_condition();
        was
    }

    /// Writes the node condition (Kubernetes NodeCondition fields) for
    /// node-problem-detector-style tools and scripts; a failure (a symlink
    /// at its name: refused) is logged.
    fn write_condition(&self) {
        if let Err(e) = self.try_write_condition() {
            tracing::warn!(error = %e, "cannot write the node condition file");
        }
    }

    /// [`IncidentStore::write_condition`], with its error.
    fn try_write_condition(&self) -> Result<(), FsError> {
        let Some(cond) = &self.condition else {
            return Ok(());
        };
        let rfc = |t: SystemTime| humantime::format_rfc3339_seconds(t).to_string();
        let doc = match &self.cordon {
            Some(c) => serde_json::json!({
                "type": "WardenCordoned",
                "status": "True",
                "reason": reason_word(&c.class),
                "message": c.summary,
                "lastTransitionTime": rfc(c.since),
                "incident": c.incident,
            }),
            None => serde_json::json!({
                "type": "WardenCordoned",
                "status": "False",
                "reason": "NodeHealthy",
                "message": "no warden decision has cordoned this node",
                "lastTransitionTime": rfc(SystemTime::now()),
                "incident": "",
            }),
        };
        let bytes = match serde_json::to_vec_pretty(&doc) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode the node condition");
                return Ok(());
            }
        };
        match (cond, &self.dir) {
            (ConditionFile::InState(name), Some(dir)) => dir.replace(name, &bytes, FILE_MODE),
            (ConditionFile::InState(name), None) => Err(FsError::Io {
                what: "writing",
                path: name.clone(),
                source: std::io::Error::other("the state directory was refused or unusable"),
            }),
            (ConditionFile::Elsewhere(path), _) => fsafe::write_leaf(path, &bytes, FILE_MODE),
        }
    }
}

/// The cordon kept in `dir`, if any. One that is there but cannot be read
/// (damaged, refused as a symlink or not a regular file) keeps the node
/// cordoned until `warden uncordon`, with a warning naming it.
fn load_cordon(dir: &Dir) -> Option<Cordon> {
    let path = dir.path().join(CORDON);
    let why = match dir.read(CORDON) {
        Ok(text) => match serde_json::from_slice::<Cordon>(&text) {
            Ok(c) => return Some(c),
            Err(e) => e.to_string(),
        },
        Err(e) if e.is_not_found() => return None,
        Err(e) => e.to_string(),
    };
    tracing::warn!(file = %path.display(), error = %why,
        "cordon file unreadable; the node stays cordoned until `warden uncordon`");
    Some(Cordon {
        since: SystemTime::now(),
        incident: String::new(),
        class: "unknown".into(),
        summary: format!("{} exists but cannot be read", path.display()),
    })
}

/// "uncorrectable_hardware" -> "UncorrectableHardware" (a condition reason
/// is CamelCase).
fn reason_word(class: &str) -> String {
    class
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::{Diagnosis, FaultClass, IncidentKind};

    fn rec(id: &str, job: &str) -> IncidentRecord {
        IncidentRecord {
            id: id.into(),
            opened_at: SystemTime::now(),
            updated_at: SystemTime::now(),
            kind: IncidentKind::Crash,
            host: "h".into(),
            job: job.into(),
            ranks: vec![1],
            devices: vec!["gpu1".into()],
            diagnosis: Diagnosis {
                class: FaultClass::UserError,
                confidence: 0.8,
                summary: "s".into(),
                rule: "r".into(),
                evidence: Vec::new(),
            },
            decision: None,
            superseded: Vec::new(),
            signature: "sig".into(),
            step: Some(3),
            exit_code: Some(1),
            waited_on: Vec::new(),
        }
    }

    #[test]
    fn the_node_ledger_outlives_a_flood_and_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let cond = dir.path().join("node-condition.json");
        let mut s = IncidentStore::load(dir.path(), cond.clone(), 8);
        let mut cordon = rec("inc-xid", "");
        cordon.kind = IncidentKind::Hardware;
        cordon.diagnosis.class = FaultClass::UncorrectableHardware;
        cordon.diagnosis.evidence = vec![crate::attribute::Evidence {
            at: SystemTime::now(),
            source: "kmsg".into(),
            signal: "xid".into(),
            subject: "gpu0".into(),
            value: "79".into(),
            points_to: Some(FaultClass::UncorrectableHardware),
            weight: 0.95,
            note: String::new(),
            event_id: 1,
        }];
        s.upsert(cordon, true);
        // A rank's word alone never enters the ledger.
        let mut forged = rec("inc-forged", "atk");
        forged.diagnosis.class = FaultClass::UncorrectableHardware;
        forged.diagnosis.evidence = vec![crate::attribute::Evidence {
            source: "rank".into(),
            ..s.list("", 0)[0].diagnosis.evidence[0].clone()
        }];
        s.upsert(forged, true);
        for i in 0..100 {
            let mut stop = rec(&format!("inc-stop-{i}"), "atk");
            stop.kind = IncidentKind::NoProgress;
            s.upsert(stop, true);
        }
        assert!(s.all().iter().all(|r| r.id.starts_with("inc-stop")));
        let ids = |v: Vec<IncidentRecord>| v.into_iter().map(|r| r.id).collect::<Vec<_>>();
        assert_eq!(ids(s.node_journal())[0], "inc-xid");
        assert!(ids(s.list("", 0)).contains(&"inc-xid".to_owned()));
        assert!(!ids(s.node_journal()).contains(&"inc-forged".to_owned()));
        let s = IncidentStore::load(dir.path(), cond, 8);
        assert_eq!(ids(s.node_journal())[0], "inc-xid", "kept across a restart");
    }

    #[test]
    fn journal_survives_a_restart_and_a_torn_line() {
        let dir = tempfile::tempdir().unwrap();
        let cond = dir.path().join("node-condition.json");
        let mut s = IncidentStore::load(dir.path(), cond.clone(), 10);
        s.upsert(rec("inc-1", "a"), true);
        s.upsert(rec("inc-2", "b"), true);
        let mut r = rec("inc-1", "a");
        r.step = Some(9);
        s.upsert(r, true);
        // A torn last write.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("incidents.jsonl"))
            .unwrap();
        f.write_all(b"{\"id\": \"inc-3\", \"opened").unwrap();
        let s = IncidentStore::load(dir.path(), cond, 10);
        let all = s.all();
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].step, Some(9), "the update replaced the first record");
        assert_eq!(s.list("b", 0).len(), 1);
    }

    #[test]
    fn cordon_persists_and_the_condition_file_follows() {
        let dir = tempfile::tempdir().unwrap();
        let cond = dir.path().join("node-condition.json");
        let mut s = IncidentStore::load(dir.path(), cond.clone(), 10);
        let read = || -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(&cond).unwrap()).unwrap()
        };
        assert_eq!(read()["status"], "False");
        assert!(s.set_cordon(Cordon {
            since: SystemTime::now(),
            incident: "inc-7".into(),
            class: "uncorrectable_hardware".into(),
            summary: "gpu3 fell off the bus".into(),
        }));
        assert!(!s.set_cordon(Cordon {
            since: SystemTime::now(),
            incident: "inc-8".into(),
            class: "unknown".into(),
            summary: "second".into(),
        }));
        assert_eq!(read()["status"], "True");
        assert_eq!(read()["reason"], "UncorrectableHardware");
        let s2 = IncidentStore::load(dir.path(), cond.clone(), 10);
        assert_eq!(s2.cordon().map(|c| c.incident.as_str()), Some("inc-7"));
        assert!(s.clear_cordon().is_some());
        assert_eq!(read()["status"], "False");
        let s3 = IncidentStore::load(dir.path(), cond, 10);
        assert!(s3.cordon().is_none());
    }

    #[test]
    fn symlinks_at_the_store_files_are_refused_and_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        let target = dir.path().join("target");
        let precious = serde_json::to_vec(&rec("theirs", "x")).unwrap();
        std::fs::write(&target, &precious).unwrap();
        let link = |p: &Path| std::os::unix::fs::symlink(&target, p).unwrap();
        let named = |e: FsError, p: &Path| {
            let e = e.to_string();
            assert!(
                e.contains("symlink") && e.contains(&p.display().to_string()),
                "{e}"
            );
        };
        let journal = state.join(JOURNAL);
        let cond = state.join("node-condition.json");
        link(&journal);
        link(&cond);

        let mut s = IncidentStore::load(&state, cond.clone(), 10);
        assert!(s.all().is_empty(), "the linked journal was not read");
        named(s.append_line("{}").unwrap_err(), &journal);
        named(s.try_write_condition().unwrap_err(), &cond);
        // The store goes on in memory; the cordon file, a plain one, is kept.
        s.upsert(rec("inc-1", "a"), true);
        assert_eq!(s.all().len(), 1);
        s.compact();
        assert!(s.set_cordon(Cordon {
            since: SystemTime::now(),
            incident: "inc-1".into(),
            class: "unknown".into(),
            summary: "s".into(),
        }));
        assert!(state.join(CORDON).is_file());

        // A cordon file that is a link keeps the node cordoned (it cannot
        // be read), and uncordoning removes the link, not its target.
        let cordon = state.join(CORDON);
        std::fs::remove_file(&cordon).unwrap();
        link(&cordon);
        let mut s2 = IncidentStore::load(&state, cond.clone(), 10);
        let c = s2.cordon().expect("still cordoned").clone();
        assert_eq!(c.class, "unknown");
        assert!(c.summary.contains(&cordon.display().to_string()), "{c:?}");
        assert!(s2.clear_cordon().is_some());
        assert!(std::fs::symlink_metadata(&cordon).is_err(), "link removed");

        // A condition file configured elsewhere: its last name not followed.
        let elsewhere = dir.path().join("npd").join("cond.json");
        std::fs::create_dir_all(elsewhere.parent().unwrap()).unwrap();
        link(&elsewhere);
        let s3 = IncidentStore::load(&state, elsewhere.clone(), 10);
        named(s3.try_write_condition().unwrap_err(), &elsewhere);

        assert_eq!(
            std::fs::read(&target).unwrap(),
            precious,
            "target unchanged"
        );
        assert!(journal.is_symlink() && cond.is_symlink() && elsewhere.is_symlink());
    }
}
