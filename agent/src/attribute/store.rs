//! Incidents as the API serves them, kept on disk so an agent restart
//! loses neither the record nor the history the budgets and the repeat
//! rule read; and the node's cordon, told to cluster tools through a
//! node-condition file.
//!
//! Files (in the state directory): `incidents.jsonl`, one JSON record per
//! decision, appended and compacted to the newest `retain`; `cordon.json`
//! while a decision has the node cordoned; the condition file (by default
//! `node-condition.json`), always present, written atomically.

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::diagnosis::IncidentRecord;

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

/// The incidents of this agent and the node's cordon.
#[derive(Debug)]
pub struct IncidentStore {
    records: VecDeque<IncidentRecord>,
    retain: usize,
    journal: Option<PathBuf>,
    journal_lines: usize,
    cordon: Option<Cordon>,
    cordon_file: Option<PathBuf>,
    condition_file: Option<PathBuf>,
}

impl IncidentStore {
    /// An empty store that keeps nothing on disk (tests, no state dir).
    pub fn in_memory(retain: usize) -> Self {
        Self {
            records: VecDeque::new(),
            retain: retain.max(1),
            journal: None,
            journal_lines: 0,
            cordon: None,
            cordon_file: None,
            condition_file: None,
        }
    }

    /// Loads the journal and the cordon from `state_dir`. A damaged line is
    /// skipped with a warning (the rest is kept): a torn last write must
    /// not cost the whole history.
    pub fn load(state_dir: &Path, condition_file: PathBuf, retain: usize) -> Self {
        let mut store = Self::in_memory(retain);
        if let Err(e) = std::fs::create_dir_all(state_dir) {
            tracing::warn!(dir = %state_dir.display(), error = %e, "cannot create the state directory; incidents are kept in memory only");
        }
        let journal = state_dir.join("incidents.jsonl");
        if let Ok(text) = std::fs::read_to_string(&journal) {
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
        let cordon_file = state_dir.join("cordon.json");
        if let Ok(text) = std::fs::read_to_string(&cordon_file) {
            match serde_json::from_str::<Cordon>(&text) {
                Ok(c) => store.cordon = Some(c),
                Err(e) => tracing::warn!(
                    file = %cordon_file.display(), error = %e,
                    "cordon file unreadable; the node stays cordoned until `warden uncordon`"
                ),
            }
            if store.cordon.is_none() {
                store.cordon = Some(Cordon {
                    since: SystemTime::now(),
                    incident: String::new(),
                    class: "unknown".into(),
                    summary: format!("{} exists but cannot be read", cordon_file.display()),
                });
            }
        }
        store.journal = Some(journal);
        store.cordon_file = Some(cordon_file);
        store.condition_file = Some(condition_file);
        store.write_condition();
        store
    }

    /// Every record, oldest first (the engine's history at start-up).
    pub fn all(&self) -> Vec<IncidentRecord> {
        self.records.iter().cloned().collect()
    }

    /// The newest `limit` records of `job` (empty: all jobs; 0: no limit),
    /// oldest first.
    pub fn list(&self, job: &str, limit: usize) -> Vec<IncidentRecord> {
        let mut out: Vec<IncidentRecord> = self
            .records
            .iter()
            .filter(|r| job.is_empty() || r.job == job)
            .cloned()
            .collect();
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

    /// Adds or replaces a record; with `persist`, appends it to the journal.
    pub fn upsert(&mut self, r: IncidentRecord, persist: bool) {
        if persist {
            self.append(&r);
        }
        self.upsert_mem(r);
    }

    fn append(&mut self, r: &IncidentRecord) {
        let Some(path) = self.journal.clone() else {
            return;
        };
        let line = match serde_json::to_string(r) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode an incident record");
                return;
            }
        };
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            tracing::warn!(file = %path.display(), error = %e, "cannot append to the incident journal");
            return;
        }
        self.journal_lines += 1;
        // Updates append; once the file holds twice what is kept, rewrite it.
        if self.journal_lines > 2 * self.retain.max(64) {
            self.compact(&path);
        }
    }

    fn compact(&mut self, path: &Path) {
        let mut text = String::new();
        for r in &self.records {
            if let Ok(l) = serde_json::to_string(r) {
                text.push_str(&l);
                text.push('\n');
            }
        }
        match write_atomic(path, text.as_bytes()) {
            Ok(()) => self.journal_lines = self.records.len(),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot compact the incident journal")
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
        if let Some(p) = &self.cordon_file {
            let written = serde_json::to_vec_pretty(&c)
                .map_err(std::io::Error::other)
                .and_then(|b| write_atomic(p, &b));
            if let Err(e) = written {
                tracing::warn!(file = %p.display(), error = %e, "cannot persist the cordon; it holds until the agent restarts");
            }
        }
        self.cordon = Some(c);
        self.write_condition();
        true
    }

    /// Lifts the cordon; returns what it was.
    pub fn clear_cordon(&mut self) -> Option<Cordon> {
        let was = self.cordon.take();
        if let Some(p) = &self.cordon_file
            && let Err(e) = std::fs::remove_file(p)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %p.display(), error = %e, "cannot remove the cordon file");
        }
        self.write_condition();
        was
    }

    /// Writes the node condition (Kubernetes NodeCondition fields) for
    /// node-problem-detector-style tools and scripts.
    fn write_condition(&self) {
        let Some(path) = &self.condition_file else {
            return;
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
                return;
            }
        };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = write_atomic(path, &bytes) {
            tracing::warn!(file = %path.display(), error = %e, "cannot write the node condition file");
        }
    }
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

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
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
        }
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
}
