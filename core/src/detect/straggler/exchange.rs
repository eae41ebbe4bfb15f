//! What agents on different hosts of one job tell each other, and what one
//! keeps of what it was told.
//!
//! Each agent owns the ranks registered with it: it scores them and is the
//! only one to flag them (it can explain them: it sees their GPUs and
//! processes). To compare them with the whole job it sends peers a compact
//! summary per owned rank (each compute section's window median and sample
//! count, and its own verdict) and receives theirs. A host's batch replaces
//! everything that host said before, and is forgotten `summary_ttl` after
//! it arrived, so a peer that goes away takes its ranks with it.
//!
//! Pure: the network is the api module's business (`api::stragglers`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use super::score::SectionMedian;
use crate::text::unfit_name;

/// Most ranks one batch may carry (a host with more is not a host).
pub const MAX_BATCH_RANKS: usize = 65_536;
/// Most sections one rank's summary may carry.
pub const MAX_SUMMARY_SECTIONS: usize = 32;
/// Most hosts whose summaries are kept; past it, the one heard from
/// longest ago is dropped (the API has no authentication: memory must stay
/// bounded whoever calls).
pub const MAX_HOSTS: usize = 65_536;
/// Longest explanation accepted from a peer.
pub const MAX_EXPLANATION: usize = 4096;

/// A rank's score as GetStragglers shows it, computed here or by its owner.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Score {
    /// Job id.
    pub job: String,
    /// Global rank.
    pub rank: u32,
    /// The agent that owns (and judged) the rank.
    pub host: String,
    /// The headline section (the rank's slowest compute section).
    pub section: String,
    /// Rank median / job median of it.
    pub relative: f64,
    /// Rank median / its best recent window.
    pub individual: f64,
    /// Robust z against the job's spread.
    pub robust_z: f64,
    /// Flagged now.
    pub flagged: bool,
    /// Consecutive windows over (or, once flagged, under) the thresholds.
    pub consecutive: u32,
    /// Since when it is flagged.
    pub flagged_since: Option<SystemTime>,
    /// Why, when flagged.
    pub explanation: String,
    /// `correctable_hardware`, `infrastructure`, `unknown`; empty unflagged.
    pub cause_class: String,
    /// Samples of the section.
    pub samples: u32,
    /// The rank's devices as component ids.
    pub devices: Vec<String>,
    /// The rank's median of the section, ns.
    pub rank_median_ns: f64,
    /// The job's median of it, ns.
    pub job_median_ns: f64,
    /// Ranks compared.
    pub ranks_compared: u32,
    /// When it was scored.
    pub scored_at: Option<SystemTime>,
}

/// One owned rank's summary for peers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Job id.
    pub job: String,
    /// Global rank.
    pub rank: u32,
    /// Its compute sections over its latest window.
    pub sections: Vec<SectionMedian>,
    /// Windows scored for it so far.
    pub window_seq: u64,
    /// The owner's verdict, once it has one.
    pub score: Option<Score>,
}

/// What one agent sends: its host name and its owned ranks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    /// The sender's host name.
    pub host: String,
    /// Its ranks' summaries.
    pub ranks: Vec<Summary>,
}

/// Checks a batch received from a peer; the error names the field.
pub fn validate(b: &Batch) -> Result<(), String> {
    if unfit_name(&b.host, 255) {
        return Err(format!(
            "host must be 1 to 255 characters without control characters (got {:?})",
            b.host
        ));
    }
    if b.ranks.len() > MAX_BATCH_RANKS {
        return Err(format!(
            "{} ranks in one batch; at most {MAX_BATCH_RANKS}",
            b.ranks.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, r) in b.ranks.iter().enumerate() {
        if unfit_name(&r.job, 128) {
            return Err(format!(
                "ranks[{i}].job_id must be 1 to 128 characters without control characters (got {:?})",
                r.job
            ));
        }
        if !seen.insert((r.job.as_str(), r.rank)) {
            return Err(format!(
                "ranks[{i}]: rank {} of job {:?} appears twice",
                r.rank, r.job
            ));
        }
        if r.sections.len() > MAX_SUMMARY_SECTIONS {
            return Err(format!(
                "ranks[{i}].sections: {} sections; at most {MAX_SUMMARY_SECTIONS}",
                r.sections.len()
            ));
        }
        for (j, s) in r.sections.iter().enumerate() {
            if unfit_name(&s.section, 64) {
                return Err(format!(
                    "ranks[{i}].sections[{j}].section must be 1 to 64 characters (got {:?})",
                    s.section
                ));
            }
            if !(s.median_ns.is_finite() && s.median_ns > 0.0) {
                return Err(format!(
                    "ranks[{i}].sections[{j}].median_ns must be a positive number (got {})",
                    s.median_ns
                ));
            }
        }
        if let Some(sc) = &r.score {
            for (field, v) in [
                ("relative", sc.relative),
                ("individual", sc.individual),
                ("robust_z", sc.robust_z),
                ("rank_median_ns", sc.rank_median_ns),
                ("job_median_ns", sc.job_median_ns),
            ] {
                if !v.is_finite() {
                    return Err(format!("ranks[{i}].score.{field} must be finite (got {v})"));
                }
            }
            if sc.explanation.len() > MAX_EXPLANATION {
                return Err(format!(
                    "ranks[{i}].score.explanation is {} bytes; at most {MAX_EXPLANATION}",
                    sc.explanation.len()
                ));
            }
            if sc.devices.len() > 16 || sc.devices.iter().any(|d| unfit_name(d, 128)) {
                return Err(format!(
                    "ranks[{i}].score.devices: at most 16 names of 1 to 128 characters"
                ));
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
struct HostEntry {
    received: Instant,
    ranks: Vec<Summary>,
}

/// Peers' summaries, by sending host.
#[derive(Debug, Clone, Default)]
pub struct RemoteStore {
    hosts: BTreeMap<String, HostEntry>,
}

impl RemoteStore {
    /// Takes a host's batch; it replaces what that host said before.
    pub fn merge(&mut self, batch: Batch, now: Instant) {
        if !self.hosts.contains_key(&batch.host)
            && self.hosts.len() >= MAX_HOSTS
            && let Some(oldest) = self
                .hosts
                .iter()
                .min_by_key(|(_, h)| h.received)
                .map(|(k, _)| k.clone())
        {
            self.hosts.remove(&oldest);
        }
        self.hosts.insert(
            batch.host,
            HostEntry {
                received: now,
                ranks: batch.ranks,
            },
        );
    }

    /// Forgets hosts not heard from for `ttl`.
    pub fn expire(&mut self, now: Instant, ttl: Duration) {
        self.hosts
            .retain(|_, h| now.saturating_duration_since(h.received) < ttl);
    }

    /// Hosts heard from (and not expired), by name.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts.keys().map(String::as_str)
    }

    /// Every remote rank with the host that sent it; a rank two hosts claim
    /// is taken from the one heard from last (it moved).
    pub fn ranks(&self) -> Vec<(&str, &Summary)> {
        let mut order: Vec<(&String, &HostEntry)> = self.hosts.iter().collect();
        order.sort_by_key(|(_, h)| h.received);
        let mut by_key: BTreeMap<(&str, u32), (&str, &Summary)> = BTreeMap::new();
        for (host, h) in order {
            for s in &h.ranks {
                by_key.insert((s.job.as_str(), s.rank), (host.as_str(), s));
            }
        }
        by_key.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(job: &str, rank: u32, median: f64) -> Summary {
        Summary {
            job: job.into(),
            rank,
            sections: vec![SectionMedian {
                section: "forward".into(),
                median_ns: median,
                samples: 10,
            }],
            window_seq: 1,
            score: None,
        }
    }

    #[test]
    fn validation_names_the_field() {
        let ok = Batch {
            host: "b".into(),
            ranks: vec![summary("j", 0, 1.0), summary("j", 1, 1.0)],
        };
        validate(&ok).unwrap();
        let mut b = ok.clone();
        b.host.clear();
        assert!(validate(&b).unwrap_err().starts_with("host"));
        let mut b = ok.clone();
        b.ranks[1].rank = 0;
        assert!(validate(&b).unwrap_err().contains("appears twice"));
        let mut b = ok.clone();
        b.ranks[1].sections[0].median_ns = f64::NAN;
        assert!(
            validate(&b)
                .unwrap_err()
                .contains("ranks[1].sections[0].median_ns")
        );
        let mut b = ok;
        b.ranks[0].score = Some(Score {
            relative: f64::INFINITY,
            ..Score::default()
        });
        assert!(
            validate(&b)
                .unwrap_err()
                .contains("ranks[0].score.relative")
        );
    }

    #[test]
    fn batches_replace_and_age_out() {
        let t0 = Instant::now();
        let mut s = RemoteStore::default();
        s.merge(
            Batch {
                host: "a".into(),
                ranks: vec![summary("j", 0, 1.0), summary("j", 1, 1.0)],
            },
            t0,
        );
        s.merge(
            Batch {
                host: "b".into(),
                ranks: vec![summary("j", 1, 2.0)],
            },
            t0 + Duration::from_secs(1),
        );
        let ranks = s.ranks();
        assert_eq!(ranks.len(), 2);
        assert_eq!(ranks[1].0, "b", "rank 1 moved to b, heard from last");
        s.merge(
            Batch {
                host: "a".into(),
                ranks: vec![],
            },
            t0 + Duration::from_secs(2),
        );
        assert_eq!(s.ranks().len(), 1, "a's new batch replaces its old one");
        s.expire(t0 + Duration::from_secs(11), Duration::from_secs(10));
        assert_eq!(s.hosts().collect::<Vec<_>>(), ["a"]);
        for i in 0..MAX_HOSTS + 5 {
            s.merge(
                Batch {
                    host: format!("h{i}"),
                    ranks: vec![],
                },
                t0 + Duration::from_secs(20 + i as u64),
            );
        }
        assert_eq!(s.hosts().count(), MAX_HOSTS);
        assert!(
            !s.hosts().any(|h| h == "a" || h == "h0"),
            "the oldest go first"
        );
    }
}
