//! The job-wide side of SDC: per-step aggregates of the values every host's
//! ranks reported, kept by the job's aggregator (the straggler exchange's,
//! `straggler::aggregate`), and the statistics it answers with.
//!
//! In: each host's report ([`JobValues`] per job, every exchange interval):
//! its own ranks' values at the steps it has not had judged yet, each with
//! whether it departs from that rank's own history (only the owner keeps
//! that history), and how many of its ranks report recently. Out: per
//! settled step and metric a [`MetricStat`]: the count of values, the count
//! of non-finite ones, the median and MAD of the finite ones (a
//! [`ValueSketch`], 0.1%), and the [`EXTREMES`] lowest and highest values
//! and the first non-finite ones with their (host, rank). Each host judges
//! its own ranks against these (`super::judge`).
//!
//! A step settles as the host detector judged it before: once as many
//! values arrived as the job has recently reporting ranks (or its world
//! size, when larger), or once the job is `judge_lag` steps past it and
//! every host has reported since the step opened; steps settle in order. Each rank's steps
//! are taken once (a host re-sends what is not judged yet every interval,
//! so a new aggregator after a lost one gets them too); a rank's new
//! registration (generation) starts its steps afresh, and its steps the
//! job has settled already are answered with what was settled.
//!
//! Cost: a report costs O(its values x log) plus O(steps settled x bins);
//! an answer is O(steps of the caller's report x [`EXTREMES`]), whatever the
//! job's size: bytes per host do not grow with N.
//!
//! Never: I/O; memory a caller controls beyond [`MAX_JOBS`] jobs,
//! [`MAX_HOSTS_PER_JOB`] hosts, [`MAX_JOB_RANKS`] ranks, [`MAX_OPEN_STEPS`]
//! open and [`MAX_SETTLED`] settled steps per job (a report past the first
//! three is refused with an [`SdcAggregateError`] naming the limit; open
//! steps past theirs settle early, oldest first, as stale).

use crate::detect::host_ttl;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::Metric;
use super::score::median;
use super::sketch::ValueSketch;

/// Jobs one aggregator keeps values of.
pub const MAX_JOBS: usize = 1024;
/// Hosts per job (4x the 16,384 the design is for).
pub const MAX_HOSTS_PER_JOB: usize = 65_536;
/// Ranks per job whose steps are tracked.
pub const MAX_JOB_RANKS: usize = 1 << 20;
/// Steps per job waiting to settle; a newer one settles the oldest.
pub const MAX_OPEN_STEPS: usize = 64;
/// Settled steps per job kept for hosts still to ask.
pub const MAX_SETTLED: usize = 256;
/// Finite values per step and metric up to which the median and MAD are
/// exact (kept as they are); past it the sketch's, within 0.1%.
pub const EXACT_UP_TO: usize = 64;
/// Lowest and highest values named per step and metric (and as many
/// non-finite ones): enough to name a single departing rank, and both
/// values of a two-rank job.
pub const EXTREMES: usize = 4;

/// One rank's values at one step, as its host reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepValue {
    /// The step.
    pub step: u64,
    /// Per [`Metric`] (index order): the value, if reported.
    pub values: [Option<f64>; 2],
    /// Per metric: departs from the rank's own recent values (the owner's
    /// judgement, for a two-rank job).
    pub departs_own: [bool; 2],
}

/// One rank's values not judged yet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankValues {
    /// Global rank.
    pub rank: u32,
    /// Its registration on its own agent (a new one restarts its steps).
    pub generation: u64,
    /// Oldest first.
    pub steps: Vec<StepValue>,
}

/// One host's part of one job.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobValues {
    /// The job.
    pub job: String,
    /// The host's ranks that reported recently (a step is complete when
    /// the job's sum of these have given it).
    pub active: u32,
    /// The job's world size as its ranks registered it (0: unknown): a
    /// step also waits for this many values, so the first host to report
    /// does not settle a step alone.
    pub world: u32,
    /// Its ranks.
    pub ranks: Vec<RankValues>,
}

/// A value with whose it is.
#[derive(Debug, Clone, PartialEq)]
pub struct ValueAt {
    /// The rank's host.
    pub host: String,
    /// The rank.
    pub rank: u32,
    /// The value.
    pub value: f64,
    /// Departs from the rank's own history (its owner's word).
    pub departs_own: bool,
}

/// One metric at one step, job-wide.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricStat {
    /// Values (finite or not).
    pub count: u64,
    /// Of which NaN or infinite.
    pub non_finite: u64,
    /// Median of the finite ones.
    pub median: Option<f64>,
    /// Their median absolute deviation from it.
    pub mad: Option<f64>,
    /// The lowest finite values, lowest first (at most [`EXTREMES`]).
    pub lowest: Vec<ValueAt>,
    /// The highest finite values, highest first.
    pub highest: Vec<ValueAt>,
    /// The first non-finite values taken.
    pub non_finite_at: Vec<ValueAt>,
}

impl MetricStat {
    /// Finite values.
    pub fn finite(&self) -> u64 {
        self.count.saturating_sub(self.non_finite)
    }
}

/// One settled step, job-wide.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStat {
    /// The step.
    pub step: u64,
    /// Per [`Metric`] (index order); None when no rank reported it.
    pub metrics: [Option<MetricStat>; 2],
}

/// The settled steps of one job a host asked about.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobSteps {
    /// The job.
    pub job: String,
    /// Ascending.
    pub steps: Vec<StepStat>,
}

/// The steps one job's values in a report carried (ascending, each once):
/// what its answer names once they settle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AskedSteps {
    /// The job.
    pub job: String,
    /// Ascending.
    pub steps: Vec<u64>,
}

/// Why a report was refused (the aggregator keeps what it had).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SdcAggregateError {
    /// A new job past [`MAX_JOBS`].
    #[error("this aggregator already keeps values of {MAX_JOBS} jobs; job {0:?} is refused")]
    TooManyJobs(String),
    /// A new host past [`MAX_HOSTS_PER_JOB`].
    #[error(
        "job {0:?} already has {MAX_HOSTS_PER_JOB} hosts reporting values; host {1:?} is refused"
    )]
    TooManyHosts(String, String),
    /// New ranks past [`MAX_JOB_RANKS`].
    #[error("job {0:?} would have values of more than {MAX_JOB_RANKS} ranks")]
    TooManyRanks(String),
}

#[derive(Debug, Default)]
struct MetricAgg {
    count: u64,
    non_finite: u64,
    sketch: ValueSketch,
    /// The finite values while there are at most [`EXACT_UP_TO`].
    exact: Option<Vec<f64>>,
    lowest: Vec<ValueAt>,
    highest: Vec<ValueAt>,
    non_finite_at: Vec<ValueAt>,
}

impl MetricAgg {
    fn add(&mut self, v: ValueAt) {
        self.count += 1;
        if !v.value.is_finite() {
            self.non_finite += 1;
            if self.non_finite_at.len() < EXTREMES {
                self.non_finite_at.push(v);
            }
            return;
        }
        self.sketch.add(v.value);
        if self.sketch.count() <= EXACT_UP_TO as u64 {
            self.exact.get_or_insert_with(Vec::new).push(v.value);
        } else {
            self.exact = None;
        }
        keep(&mut self.lowest, v.clone(), |a, b| a < b);
        keep(&mut self.highest, v, |a, b| a > b);
    }

    fn stat(self) -> Option<MetricStat> {
        if self.count == 0 {
            return None;
        }
        let (median, mad) = match self.exact {
            Some(mut v) => {
                let median = median(&mut v);
                let mad = median.and_then(|m| {
                    let mut dev: Vec<f64> = v.iter().map(|x| (x - m).abs()).collect();
                    super::score::median(&mut dev)
                });
                (median, mad)
            }
            None => {
                let median = self.sketch.median();
                (median, median.and_then(|m| self.sketch.mad(m)))
            }
        };
        Some(MetricStat {
            count: self.count,
            non_finite: self.non_finite,
            median,
            mad,
            lowest: self.lowest,
            highest: self.highest,
            non_finite_at: self.non_finite_at,
        })
    }
}

/// Keeps the [`EXTREMES`] values first by `before`, in that order.
fn keep(list: &mut Vec<ValueAt>, v: ValueAt, before: impl Fn(f64, f64) -> bool) {
    let at = list
        .iter()
        .position(|x| before(v.value, x.value))
        .unwrap_or(list.len());
    if at < EXTREMES {
        list.insert(at, v);
        list.truncate(EXTREMES);
    }
}

#[derive(Debug, Default)]
struct OpenStep {
    /// Ranks that gave the step (any metric).
    ranks: u64,
    /// Reports of the job taken since the step opened: once there are as
    /// many as hosts, every host had its chance to give it.
    reports_since: u64,
    metrics: [MetricAgg; 2],
}

#[derive(Debug)]
struct HostPart {
    at: Instant,
    active: u32,
    ranks: BTreeSet<u32>,
}

#[derive(Debug, Clone, Copy)]
struct RankSeen {
    generation: u64,
    last_step: u64,
}

#[derive(Debug, Default)]
struct JobAgg {
    hosts: HashMap<String, HostPart>,
    /// Sum of the hosts' `active`.
    active: u64,
    /// The latest world size a host reported.
    world: u64,
    ranks: HashMap<u32, RankSeen>,
    open: BTreeMap<u64, OpenStep>,
    settled: BTreeMap<u64, StepStat>,
    newest: u64,
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
        if let Some(h) = self.hosts.remove(host) {
            self.active = self.active.saturating_sub(u64::from(h.active));
            for r in h.ranks {
                self.ranks.remove(&r);
            }
        }
    }

    fn settle(&mut self, lag: u64) {
        let expected = self.active.max(self.world);
        let hosts = self.hosts.len() as u64;
        while let Some((&step, open)) = self.open.first_key_value() {
            let complete = expected > 0 && open.ranks >= expected;
            // Past by the lag, and every host had a report since it
            // opened: a host reports once an interval, so a job whose
            // steps outrun the lag still hears from every host first.
            let stale = step.saturating_add(lag) < self.newest && open.reports_since >= hosts;
            let crowded = self.open.len() > MAX_OPEN_STEPS;
            if !(complete || stale || crowded) {
                break;
            }
            let Some((step, open)) = self.open.pop_first() else {
                break;
            };
            let [a, b] = open.metrics;
            self.settled.insert(
                step,
                StepStat {
                    step,
                    metrics: [a.stat(), b.stat()],
                },
            );
            while self.settled.len() > MAX_SETTLED {
                self.settled.pop_first();
            }
        }
    }
}

/// The aggregator's store of values (see the module doc).
#[derive(Debug)]
pub struct SdcAggregator {
    ttl: Duration,
    lag: u64,
    jobs: HashMap<String, JobAgg>,
    swept: Option<Instant>,
}

impl SdcAggregator {
    /// A store forgetting hosts `ttl` after their last report, settling a
    /// step once its job is `judge_lag` steps past it.
    pub fn new(ttl: Duration, judge_lag: u64) -> Self {
        Self {
            ttl,
            lag: judge_lag,
            jobs: HashMap::new(),
            swept: None,
        }
    }

    /// Jobs kept.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Steps of `job` waiting to settle.
    pub fn open_steps(&self, job: &str) -> usize {
        self.jobs.get(job).map_or(0, |j| j.open.len())
    }

    /// Ranks of `job` tracked.
    pub fn ranks_of(&self, job: &str) -> usize {
        self.jobs.get(job).map_or(0, |j| j.ranks.len())
    }

    /// Takes `host`'s values of the jobs in `jobs` and answers, per job,
    /// with the settled steps among those it reported ([`Self::fold`] then
    /// [`Self::steps`]).
    pub fn report(
        &mut self,
        host: &str,
        jobs: Vec<JobValues>,
        now: Instant,
    ) -> Result<Vec<JobSteps>, SdcAggregateError> {
        let asked = self.fold(host, jobs, now)?;
        Ok(asked
            .into_iter()
            .map(|a| self.steps(&a.job, &a.steps))
            .collect())
    }

    /// Takes `host`'s values of the jobs in `jobs` without answering: per
    /// job, in its order, the steps it reported ([`AskedSteps`]), to be
    /// answered by [`Self::steps`] once a group leader's whole batch is in
    /// (every member of a job asks about the same steps).
    pub fn fold(
        &mut self,
        host: &str,
        jobs: Vec<JobValues>,
        now: Instant,
    ) -> Result<Vec<AskedSteps>, SdcAggregateError> {
        self.sweep(now);
        // Limits first: a refused report changes nothing.
        let mut new_jobs = 0;
        for j in &jobs {
            match self.jobs.get(&j.job) {
                None => new_jobs += 1,
                Some(agg) => {
                    if !agg.hosts.contains_key(host) && agg.hosts.len() >= MAX_HOSTS_PER_JOB {
                        return Err(SdcAggregateError::TooManyHosts(
                            j.job.clone(),
                            host.to_owned(),
                        ));
                    }
                    let fresh = j
                        .ranks
                        .iter()
                        .filter(|r| !agg.ranks.contains_key(&r.rank))
                        .count();
                    if agg.ranks.len() + fresh > MAX_JOB_RANKS {
                        return Err(SdcAggregateError::TooManyRanks(j.job.clone()));
                    }
                }
            }
            if j.ranks.len() > MAX_JOB_RANKS {
                return Err(SdcAggregateError::TooManyRanks(j.job.clone()));
            }
            if self.jobs.len() + new_jobs > MAX_JOBS {
                return Err(SdcAggregateError::TooManyJobs(j.job.clone()));
            }
        }
        let lag = self.lag;
        let mut out = Vec::with_capacity(jobs.len());
        for j in jobs {
            let agg = self.jobs.entry(j.job.clone()).or_default();
            let part = agg.hosts.entry(host.to_owned()).or_insert(HostPart {
                at: now,
                active: 0,
                ranks: BTreeSet::new(),
            });
            part.at = now;
            agg.active = agg.active.saturating_sub(u64::from(part.active)) + u64::from(j.active);
            part.active = j.active;
            if j.world > 0 {
                agg.world = u64::from(j.world);
            }
            for open in agg.open.values_mut() {
                open.reports_since += 1;
            }
            let mut asked = BTreeSet::new();
            for r in j.ranks {
                take_rank(agg, host, r, &mut asked);
            }
            agg.settle(lag);
            out.push(AskedSteps {
                job: j.job,
                steps: asked.into_iter().collect(),
            });
        }
        Ok(out)
    }

    /// The settled steps of `job` among `asked` (ascending).
    pub fn steps(&self, job: &str, asked: &[u64]) -> JobSteps {
        JobSteps {
            job: job.to_owned(),
            steps: self.settled(job, asked).cloned().collect(),
        }
    }

    /// The settled steps of `job` among `asked`, by reference (a batch's
    /// answer shares each once).
    pub fn settled<'a>(
        &'a self,
        job: &str,
        asked: &'a [u64],
    ) -> impl Iterator<Item = &'a StepStat> + 'a {
        let settled = self.jobs.get(job).map(|j| &j.settled);
        asked
            .iter()
            .filter_map(move |s| settled.and_then(|m| m.get(s)))
    }

    /// Forgets hosts not heard from for the ttl ([`host_ttl::sweep`]).
    fn sweep(&mut self, now: Instant) {
        host_ttl::sweep(&mut self.jobs, &mut self.swept, self.ttl, now);
    }
}

/// The statistics of one step's values, all from `host` (a host's own
/// ranks, when no aggregator answered for the step).
pub fn step_stat(
    step: u64,
    host: &str,
    values: impl Iterator<Item = (u32, StepValue)>,
) -> StepStat {
    let mut open = OpenStep::default();
    for (rank, s) in values {
        open.add(host, rank, &s);
    }
    let [a, b] = open.metrics;
    StepStat {
        step,
        metrics: [a.stat(), b.stat()],
    }
}

impl OpenStep {
    fn add(&mut self, host: &str, rank: u32, s: &StepValue) {
        self.ranks += 1;
        for m in Metric::ALL {
            let i = m.index();
            if let Some(v) = s.values[i] {
                self.metrics[i].add(ValueAt {
                    host: host.to_owned(),
                    rank,
                    value: v,
                    departs_own: s.departs_own[i],
                });
            }
        }
    }
}

/// Takes one rank's new steps into `agg`; `asked` gathers the steps the
/// host wants answered.
fn take_rank(agg: &mut JobAgg, host: &str, r: RankValues, asked: &mut BTreeSet<u64>) {
    // A rank that moved here from another host is this host's now.
    if let Some(part) = agg.hosts.get_mut(host) {
        part.ranks.insert(r.rank);
    }
    // A new registration starts the rank's steps afresh. A step the job
    // settled already is not opened again: a rank restarted from a
    // checkpoint is judged against that step's statistics from before,
    // which a restore makes comparable (and the median is not moved by the
    // one rank that may have been the reason for the restart).
    let mut last = agg
        .ranks
        .get(&r.rank)
        .filter(|s| s.generation == r.generation)
        .map(|s| s.last_step);
    let mut steps = r.steps;
    steps.sort_by_key(|s| s.step);
    for s in steps {
        asked.insert(s.step);
        if last.is_some_and(|l| s.step <= l) {
            continue;
        }
        last = Some(s.step);
        // Late: settled already. (A step older than every open one opens
        // and, past MAX_OPEN_STEPS, settles at once: bounded either way.)
        if agg.settled.contains_key(&s.step) {
            continue;
        }
        agg.newest = agg.newest.max(s.step);
        agg.open.entry(s.step).or_default().add(host, r.rank, &s);
    }
    if let Some(l) = last {
        agg.ranks.insert(
            r.rank,
            RankSeen {
                generation: r.generation,
                last_step: l,
            },
        );
    }
}
