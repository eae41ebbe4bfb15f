//! The job-wide side of the straggler exchange: what the job's aggregator
//! keeps of every host's report, and the statistics it answers with.
//!
//! Each host sends its aggregator, once per `straggler.exchange_interval`,
//! one [`Sketch`] per (job, compute section) over its own ranks' window
//! medians, and its own ranks' scores. The aggregator keeps each host's
//! latest report and a running sum of the sketches (a new report subtracts
//! the host's previous one: O(bins), never O(hosts)), and answers each
//! host with, per section of its jobs, the job's median, spread and the
//! count of ranks over the caller's thresholds ([`SectionStat`]), plus the
//! job's [`TOP_SCORES`] most notable ranks (flagged first, then slowest)
//! for GetStragglers. Each host still scores its own ranks, against these.
//!
//! Cost: a report costs the aggregator O(sections x bins + ranks x log N);
//! an answer is O(sections + TOP_SCORES), whatever the job's size. Hosts
//! not heard from for the ttl are swept at most every quarter ttl.
//!
//! Never: I/O; memory a caller controls beyond [`MAX_JOBS`] jobs,
//! [`MAX_HOSTS_PER_JOB`] hosts and [`MAX_JOB_RANKS`] ranks per job (a report
//! past them is refused with an [`AggregateError`] naming the limit, never
//! truncated silently).

use crate::detect::host_ttl;
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::exchange::Score;
use super::score::{MAX_SECTIONS, Spread};
use super::sketch::Sketch;

/// Jobs one aggregator keeps.
pub const MAX_JOBS: usize = 1024;
/// Hosts one job's aggregator keeps (4x the 16,384 the design is for).
pub const MAX_HOSTS_PER_JOB: usize = 65_536;
/// Ranks one job's aggregator keeps scores of.
pub const MAX_JOB_RANKS: usize = 1 << 20;
/// Scores an answer carries per job: the flagged first, then the slowest.
pub const TOP_SCORES: usize = 64;

/// One host's part of one job, as reported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobPart {
    /// The job.
    pub job: String,
    /// A sketch of the host's ranks' window medians per compute section
    /// (only ranks with enough samples to be judged).
    pub sections: Vec<(String, Sketch)>,
    /// The host's own ranks' latest scores.
    pub scores: Vec<Score>,
}

/// What a host sends its aggregator.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostReport {
    /// The sender's host name.
    pub host: String,
    /// Its thresholds, for the over-threshold counts it is answered with.
    pub relative_threshold: f64,
    /// See `relative_threshold`.
    pub z_threshold: f64,
    /// Its jobs.
    pub jobs: Vec<JobPart>,
}

/// One section of one job, job-wide.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SectionStatValues {
    /// Ranks in the comparison.
    pub n: u64,
    /// Median of the ranks' window medians, ns.
    pub median_ns: f64,
    /// 1.4826 x MAD, floored as the scorer floors it, ns.
    pub sigma_ns: f64,
    /// Ranks over both of the caller's thresholds.
    pub over: u64,
}

/// A section's name and its job-wide statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SectionStat {
    /// The section.
    pub section: String,
    /// Its statistics.
    pub stat: SectionStatValues,
}

impl SectionStat {
    /// As the scorer's spread.
    pub fn spread(&self) -> Option<Spread> {
        (self.stat.n > 0).then(|| Spread {
            median: self.stat.median_ns,
            sigma: self.stat.sigma_ns,
            n: usize::try_from(self.stat.n).unwrap_or(usize::MAX),
        })
    }
}

/// One job, job-wide, as answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobWide {
    /// The job.
    pub job: String,
    /// Per section.
    pub sections: Vec<SectionStat>,
    /// The most notable ranks' scores (owners' verdicts).
    pub top: Vec<Score>,
    /// Hosts that reported the job.
    pub hosts: u32,
    /// Ranks with a score.
    pub ranks: u32,
}

/// Why a report was refused (the aggregator keeps what it had).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AggregateError {
    /// A new job past [`MAX_JOBS`].
    #[error("this aggregator already keeps {MAX_JOBS} jobs; job {0:?} is refused")]
    TooManyJobs(String),
    /// A new host past [`MAX_HOSTS_PER_JOB`].
    #[error("job {0:?} already has {MAX_HOSTS_PER_JOB} hosts reporting; host {1:?} is refused")]
    TooManyHosts(String, String),
    /// Scores past [`MAX_JOB_RANKS`].
    #[error("job {0:?} would have more than {MAX_JOB_RANKS} ranks")]
    TooManyRanks(String),
    /// More sections than a job compares.
    #[error("job {0:?}: {1} sections; at most {MAX_SECTIONS}")]
    TooManySections(String, usize),
}

/// Ordering key of a score: flagged first, then the highest relative.
type TopKey = (Reverse<bool>, Reverse<u64>, u32);

fn top_key(s: &Score) -> TopKey {
    // Non-negative finite floats order like their bits.
    let rel = if s.relative.is_finite() && s.relative > 0.0 {
        s.relative.to_bits()
    } else {
        0
    };
    (Reverse(s.flagged), Reverse(rel), s.rank)
}

#[derive(Debug)]
struct HostPart {
    at: Instant,
    sections: Vec<(String, Sketch)>,
    ranks: Vec<u32>,
}

#[derive(Debug, Default)]
struct JobAgg {
    hosts: HashMap<String, HostPart>,
    merged: HashMap<String, Sketch>,
    scores: HashMap<u32, (String, Score)>,
    order: BTreeSet<TopKey>,
}

impl host_ttl::HostTable for JobAgg {
    fn heard(&self) -> impl Iterator<Item = (&String, Instant)> {
        self.hosts.iter().map(|(k, h)| (k, h.at))
    }

    fn drop_host(&mut self, host: &str) {
        self.remove_host(host);
    }

    fn no_hosts(&self) -> bool {
        self.hosts.is_empty()
    }
}

impl JobAgg {
    fn remove_host(&mut self, host: &str) {
        let Some(old) = self.hosts.remove(host) else {
            return;
        };
        self.forget_part(host, &old);
    }

    fn forget_part(&mut self, host: &str, old: &HostPart) {
        for (name, sk) in &old.sections {
            if let Some(m) = self.merged.get_mut(name) {
                m.subtract(sk);
                if m.is_empty() {
                    self.merged.remove(name);
                }
            }
        }
        for r in &old.ranks {
            // A rank that moved to another host is that host's now.
            if self.scores.get(r).is_some_and(|(h, _)| h == host)
                && let Some((_, s)) = self.scores.remove(r)
            {
                self.order.remove(&top_key(&s));
            }
        }
    }
}

/// The aggregator's store (see the module doc).
#[derive(Debug)]
pub struct Aggregator {
    ttl: Duration,
    jobs: HashMap<String, JobAgg>,
    swept: Option<Instant>,
}

impl Aggregator {
    /// A store forgetting hosts `ttl` after their last report.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            jobs: HashMap::new(),
            swept: None,
        }
    }

    /// Jobs kept.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Hosts reporting `job`.
    pub fn hosts_of(&self, job: &str) -> usize {
        self.jobs.get(job).map_or(0, |j| j.hosts.len())
    }

    /// Every rank's score of `job` with its owner, for the aggregator's own
    /// GetStragglers (the whole job).
    pub fn scores_of(&self, job: &str) -> Vec<(String, Score)> {
        self.jobs
            .get(job)
            .map(|j| j.scores.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Takes a host's report (replacing what it said before of the jobs in
    /// it) and answers with the job-wide statistics of those jobs.
    pub fn report(&mut self, r: HostReport, now: Instant) -> Result<Vec<JobWide>, AggregateError> {
        let asked: Vec<String> = r.jobs.iter().map(|j| j.job.clone()).collect();
        let (relative, z) = (r.relative_threshold, r.z_threshold);
        self.fold(r, now)?;
        Ok(asked
            .iter()
            .filter_map(|job| self.stats(job, relative, z))
            .collect())
    }

    /// The job-wide statistics of `job` for a caller with these thresholds
    /// (None: no host reports it). A leader's batch is folded whole
    /// ([`Self::fold`]) and then answered with these, once per job and
    /// thresholds.
    pub fn stats(&self, job: &str, relative_threshold: f64, z_threshold: f64) -> Option<JobWide> {
        self.jobs
            .get(job)
            .map(|agg| answer(job, agg, relative_threshold, z_threshold))
    }

    /// Takes a host's report (replacing what it said before of the jobs in
    /// it), without answering ([`Self::stats`] answers). A report past a
    /// limit changes nothing.
    pub fn fold(&mut self, r: HostReport, now: Instant) -> Result<(), AggregateError> {
        self.sweep(now);
        // Check the limits first: a refused report changes nothing.
        let mut new_jobs = 0;
        for j in &r.jobs {
            if j.sections.len() > MAX_SECTIONS {
                return Err(AggregateError::TooManySections(
                    j.job.clone(),
                    j.sections.len(),
                ));
            }
            match self.jobs.get(&j.job) {
                None => new_jobs += 1,
                Some(agg) => {
                    if !agg.hosts.contains_key(&r.host) && agg.hosts.len() >= MAX_HOSTS_PER_JOB {
                        return Err(AggregateError::TooManyHosts(j.job.clone(), r.host.clone()));
                    }
                    let had = agg.hosts.get(&r.host).map_or(0, |h| h.ranks.len());
                    if agg.scores.len() - had.min(agg.scores.len()) + j.scores.len() > MAX_JOB_RANKS
                    {
                        return Err(AggregateError::TooManyRanks(j.job.clone()));
                    }
                }
            }
            if self.jobs.len() + new_jobs > MAX_JOBS {
                return Err(AggregateError::TooManyJobs(j.job.clone()));
            }
        }
        for j in r.jobs {
            let agg = self.jobs.entry(j.job.clone()).or_default();
            agg.remove_host(&r.host);
            for (name, sk) in &j.sections {
                agg.merged.entry(name.clone()).or_default().merge(sk);
            }
            let mut ranks = Vec::with_capacity(j.scores.len());
            for s in j.scores {
                ranks.push(s.rank);
                if let Some((_, old)) = agg.scores.remove(&s.rank) {
                    agg.order.remove(&top_key(&old));
                }
                agg.order.insert(top_key(&s));
                agg.scores.insert(s.rank, (r.host.clone(), s));
            }
            agg.hosts.insert(
                r.host.clone(),
                HostPart {
                    at: now,
                    sections: j.sections,
                    ranks,
                },
            );
        }
        Ok(())
    }

    /// Forgets hosts not heard from for the ttl ([`host_ttl::sweep`]).
    fn sweep(&mut self, now: Instant) {
        host_ttl::sweep(&mut self.jobs, &mut self.swept, self.ttl, now);
    }
}

/// The job-wide statistics of `agg` for a caller with these thresholds.
fn answer(job: &str, agg: &JobAgg, relative_threshold: f64, z_threshold: f64) -> JobWide {
    let mut sections: Vec<SectionStat> = agg
        .merged
        .iter()
        .filter_map(|(name, sk)| {
            let median = sk.median()?;
            let mad = sk.mad(median).unwrap_or(0.0);
            let sigma = (1.4826 * mad).max(super::score::MIN_SPREAD * median);
            let threshold = (median * relative_threshold).max(median + z_threshold * sigma);
            Some(SectionStat {
                section: name.clone(),
                stat: SectionStatValues {
                    n: sk.count(),
                    median_ns: median,
                    sigma_ns: sigma,
                    over: sk.count_at_least(threshold),
                },
            })
        })
        .collect();
    sections.sort_by(|a, b| a.section.cmp(&b.section));
    let top = agg
        .order
        .iter()
        .take(TOP_SCORES)
        .filter_map(|(_, _, rank)| agg.scores.get(rank))
        .map(|(host, s)| Score {
            host: host.clone(),
            ..s.clone()
        })
        .collect();
    JobWide {
        job: job.to_owned(),
        sections,
        top,
        hosts: u32::try_from(agg.hosts.len()).unwrap_or(u32::MAX),
        ranks: u32::try_from(agg.scores.len()).unwrap_or(u32::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(host: &str, ranks: &[(u32, f64, bool)]) -> HostReport {
        let mut sk = Sketch::default();
        for (_, v, _) in ranks {
            sk.add(*v);
        }
        HostReport {
            host: host.into(),
            relative_threshold: 1.1,
            z_threshold: 3.0,
            jobs: vec![JobPart {
                job: "j".into(),
                sections: vec![("forward".into(), sk)],
                scores: ranks
                    .iter()
                    .map(|(r, v, f)| Score {
                        job: "j".into(),
                        rank: *r,
                        relative: v / 1e7,
                        flagged: *f,
                        ..Score::default()
                    })
                    .collect(),
            }],
        }
    }

    #[test]
    fn hosts_add_up_replace_and_expire() {
        let t0 = Instant::now();
        let mut a = Aggregator::new(Duration::from_secs(10));
        for h in 0..100u32 {
            let ranks: Vec<(u32, f64, bool)> = (0..8).map(|i| (h * 8 + i, 1e7, false)).collect();
            a.report(report(&format!("h{h}"), &ranks), t0).unwrap();
        }
        // h7 has a slow rank now: its new report replaces the old one.
        let mut ranks: Vec<(u32, f64, bool)> = (0..8).map(|i| (56 + i, 1e7, false)).collect();
        ranks[3] = (59, 1.3e7, true);
        let w = a.report(report("h7", &ranks), t0).unwrap();
        let s = &w[0].sections[0];
        assert_eq!(s.stat.n, 800, "the old report was subtracted");
        assert!((s.stat.median_ns - 1e7).abs() <= 1e7 * super::super::sketch::ALPHA);
        assert_eq!(s.stat.over, 1);
        assert_eq!((w[0].hosts, w[0].ranks), (100, 800));
        assert_eq!(w[0].top.len(), TOP_SCORES);
        assert_eq!((w[0].top[0].rank, w[0].top[0].host.as_str()), (59, "h7"));
        assert!(w[0].top[0].flagged);
        // Only h7 keeps reporting: the others expire.
        let w = a
            .report(report("h7", &ranks), t0 + Duration::from_secs(11))
            .unwrap();
        assert_eq!((w[0].hosts, w[0].sections[0].stat.n), (1, 8));
        assert_eq!(a.hosts_of("j"), 1);
    }

    #[test]
    fn limits_refuse_and_change_nothing() {
        let t0 = Instant::now();
        let mut a = Aggregator::new(Duration::from_secs(10));
        let mut r = report("h", &[(0, 1e7, false)]);
        r.jobs[0].sections = (0..=MAX_SECTIONS)
            .map(|i| (format!("s{i}"), Sketch::default()))
            .collect();
        assert!(matches!(
            a.report(r, t0),
            Err(AggregateError::TooManySections(..))
        ));
        assert_eq!(a.jobs(), 0);
        for j in 0..MAX_JOBS {
            let mut r = report("h", &[]);
            r.jobs[0].job = format!("j{j}");
            a.report(r, t0).unwrap();
        }
        let err = a.report(report("h", &[]), t0).unwrap_err();
        assert_eq!(err, AggregateError::TooManyJobs("j".into()));
        assert!(err.to_string().contains("1024 jobs"), "{err}");
    }
}
