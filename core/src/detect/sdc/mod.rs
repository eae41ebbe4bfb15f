//! Silent data corruption (SDC) suspects: a rank whose reported loss or
//! gradient norm departs from its data-parallel peers' at the same step, or
//! goes NaN or infinite while theirs do not.
//!
//! In: each rank's per-step values as its client reported them
//! ([`SdcDetector::observe`]: job, rank, generation, step, loss, gradient
//! norm), fed by the agent's scan from the slot's step records.
//! Out: [`SdcFinding`]s with the evidence (step, value, job median, score),
//! from [`SdcDetector::judge`]; the agent publishes them as
//! `rank.sdc_suspect`.
//! Never: I/O, clocks or randomness: the same inputs give the same findings.
//!
//! Why these statistics (score.rs): data-parallel ranks see the same
//! parameters, so after the gradient all-reduce their gradient norms agree
//! to rounding, and their losses differ only by their data; a corrupted
//! rank departs by a large factor. The median and the median absolute
//! deviation (MAD) across the job's ranks at the same step, as the
//! straggler detector uses, are not moved by the one bad rank. With two
//! ranks a median cannot tell which one departed, so there each rank is
//! also compared with its own recent values: the one that jumped is the
//! suspect; when both or neither did, nothing is said. A non-finite value
//! on some ranks while the others stay finite is flagged at once; on every
//! rank it is the model diverging (a training problem), not a fault of one
//! device, and is not flagged.
//!
//! Job-wide (issue 30: nothing all-to-all): the detector keeps this host's
//! ranks' values until their step is judged, and hands them, each with
//! whether it departs from the rank's own history, to the job's aggregator
//! ([`SdcDetector::report`]; aggregate.rs merges every host's into
//! per-step statistics). The aggregator settles a step once every rank of
//! the job that reported recently has given it, or once the job is
//! [`SdcConfig::judge_lag`] steps past it, and answers with the step's
//! count, non-finite count, median, MAD and extreme values; this host
//! judges its own ranks against them ([`SdcDetector::take_answer`],
//! judge.rs). A host that talks to no aggregator (one host, no exchange)
//! aggregates its own values in place ([`SdcDetector::judge`]): the same
//! code, its ranks only. A rank is reported once per metric until one of
//! its values is judged clean again.

pub mod aggregate;
pub mod judge;
mod score;
pub mod sketch;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

pub use score::{MAD_TO_SIGMA, MIN_SPREAD, ValueDeparture, robust_departure};

/// Most steps kept waiting per job, whatever the ranks report: a rank that
/// writes garbage step numbers cannot grow the agent's memory.
const MAX_PENDING_STEPS: usize = 256;

/// `[sdc]`: when a rank's reported values make it an SDC suspect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SdcConfig {
    /// Judge the values ranks report (`warden.report_values`).
    pub enabled: bool,
    /// A value is an outlier this many robust standard deviations (1.4826 x
    /// MAD) from the median, of its peers or of its own history.
    pub z_threshold: f64,
    /// ...and departs from that median by at least this share of it (0.5:
    /// 50%): a minimum effect, so a job whose ranks agree to the last bit
    /// does not flag a rounding difference.
    pub min_relative: f64,
    /// Values kept per rank and metric for the own-history comparison.
    pub history: usize,
    /// Values a rank must have before its own history is believed.
    pub min_history: usize,
    /// Steps a job may move past a step before it is judged with the ranks
    /// that reported it (a rank that stopped reporting is not waited for).
    pub judge_lag: u64,
}

impl Default for SdcConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            z_threshold: 12.0,
            min_relative: 0.5,
            history: 32,
            min_history: 8,
            judge_lag: 8,
        }
    }
}

impl SdcConfig {
    /// Refuses values the detector cannot use.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if !(self.z_threshold.is_finite() && self.z_threshold > 0.0) {
            return Err(invalid(
                "sdc.z_threshold",
                self.z_threshold.to_string(),
                "must be a number above 0",
            ));
        }
        if !(self.min_relative.is_finite() && self.min_relative >= 0.0) {
            return Err(invalid(
                "sdc.min_relative",
                self.min_relative.to_string(),
                "must be a number of at least 0",
            ));
        }
        if self.min_history < 2 || self.history < self.min_history || self.history > 1024 {
            return Err(invalid(
                "sdc.history",
                format!("{} (min_history {})", self.history, self.min_history),
                "needs 2 <= min_history <= history <= 1024",
            ));
        }
        if self.judge_lag == 0 || self.judge_lag > 128 {
            return Err(invalid(
                "sdc.judge_lag",
                self.judge_lag.to_string(),
                "must be 1..=128 steps",
            ));
        }
        Ok(())
    }
}

/// Which reported value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    /// The step's loss.
    Loss,
    /// The step's gradient norm.
    GradNorm,
}

impl Metric {
    /// Both, in a fixed order.
    pub const ALL: [Metric; 2] = [Metric::Loss, Metric::GradNorm];

    /// As events and metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::GradNorm => "grad_norm",
        }
    }

    /// Its place in per-metric arrays.
    pub fn index(self) -> usize {
        match self {
            Metric::Loss => 0,
            Metric::GradNorm => 1,
        }
    }
}

/// What the suspicion rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// NaN or infinite while the job's other ranks were finite.
    NonFinite,
    /// NaN or infinite with no other rank reporting the step.
    NonFiniteAlone,
    /// An outlier among three or more ranks at the same step.
    Peers,
    /// Two ranks disagree and this one departed from its own history.
    OwnHistory,
}

impl Basis {
    /// As events spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Basis::NonFinite => "non_finite",
            Basis::NonFiniteAlone => "non_finite_alone",
            Basis::Peers => "peers",
            Basis::OwnHistory => "own_history",
        }
    }
}

/// One suspect, with the evidence a person needs to judge it.
#[derive(Debug, Clone, PartialEq)]
pub struct SdcFinding {
    /// The job.
    pub job: String,
    /// The rank.
    pub rank: u32,
    /// The step whose value departed.
    pub step: u64,
    /// Which value.
    pub metric: Metric,
    /// The value.
    pub value: f64,
    /// The median of the ranks' finite values at that step (None: none).
    pub job_median: Option<f64>,
    /// The median of the rank's own recent values, when that was compared.
    pub own_median: Option<f64>,
    /// Robust standard deviations from the median compared with (None for
    /// a non-finite value).
    pub score: Option<f64>,
    /// Ranks that reported this metric at that step.
    pub ranks: usize,
    /// What the suspicion rests on.
    pub basis: Basis,
}

/// Steps of each rank sent per report: a host re-sends what is not judged
/// yet, bounded.
pub const STEPS_SENT: usize = 64;

/// One rank's values at one step, waiting for the job-wide statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Pending {
    values: [Option<f64>; 2],
}

impl RankState {
    /// How far `x` departs from this rank's own recent clean values of
    /// `metric` (None: too little history, or `x` not finite). Asked when
    /// a report is made and again when the step is judged, so it is
    /// against the history as of then.
    fn own_departure(&self, cfg: &SdcConfig, metric: usize, x: f64) -> Option<ValueDeparture> {
        let h = &self.history[metric];
        if !x.is_finite() || h.len() < cfg.min_history {
            return None;
        }
        let mut v: Vec<f64> = h.iter().copied().collect();
        robust_departure(x, &mut v, cfg.z_threshold, cfg.min_relative)
    }
}

/// What the detector keeps of one rank.
#[derive(Debug, Default)]
struct RankState {
    generation: u64,
    /// Newest step observed (steps at or before it are not taken again).
    last_step: Option<u64>,
    /// Accepted (clean, finite) values per metric, oldest first.
    history: [VecDeque<f64>; 2],
    /// Reported and not yet judged clean again, per metric.
    flagged: [bool; 2],
}

#[derive(Debug, Default)]
struct JobState {
    /// Steps waiting for their statistics: rank -> values.
    pending: BTreeMap<u64, BTreeMap<u32, Pending>>,
    ranks: BTreeMap<u32, RankState>,
    newest: u64,
}

/// The detector: per job, this host's ranks' values waiting to be judged
/// and each rank's recent clean values. Owned by the agent's work loop (one
/// thread).
#[derive(Debug)]
pub struct SdcDetector {
    cfg: SdcConfig,
    jobs: HashMap<String, JobState>,
    /// The aggregator of the in-place path ([`SdcDetector::judge`]).
    here: aggregate::SdcAggregator,
}

impl SdcDetector {
    /// A detector with `cfg`.
    pub fn new(cfg: SdcConfig) -> Self {
        let lag = cfg.judge_lag;
        Self {
            cfg,
            jobs: HashMap::new(),
            // One host (this one) reports every tick: nothing expires.
            here: aggregate::SdcAggregator::new(Duration::from_secs(3600), lag),
        }
    }

    /// Takes one rank's values at `step`. A step the rank already gave (the
    /// scan reads the same records more than once) is ignored; a new
    /// `generation` (the rank registered again, say after a restart from a
    /// checkpoint) starts its step count afresh, keeping its history.
    pub fn observe(
        &mut self,
        job: &str,
        rank: u32,
        generation: u64,
        step: u64,
        loss: Option<f64>,
        grad_norm: Option<f64>,
    ) {
        if loss.is_none() && grad_norm.is_none() {
            return;
        }
        if !self.jobs.contains_key(job) {
            self.jobs.insert(job.to_owned(), JobState::default());
        }
        let Some(j) = self.jobs.get_mut(job) else {
            return;
        };
        let r = j.ranks.entry(rank).or_default();
        if r.generation != generation {
            r.generation = generation;
            r.last_step = None;
        }
        if r.last_step.is_some_and(|l| step <= l) {
            return;
        }
        r.last_step = Some(step);
        j.newest = j.newest.max(step);
        j.pending.entry(step).or_default().insert(
            rank,
            Pending {
                values: [loss, grad_norm],
            },
        );
        while j.pending.len() > MAX_PENDING_STEPS {
            j.pending.pop_first();
        }
    }

    /// Forgets a rank that left (its pending values are judged without it).
    pub fn forget_rank(&mut self, job: &str, rank: u32) {
        if let Some(j) = self.jobs.get_mut(job) {
            j.ranks.remove(&rank);
            if j.ranks.is_empty() {
                self.jobs.remove(job);
            }
        }
    }

    /// Forgets the jobs `live` says are gone (the agent calls it each tick
    /// with its registry's jobs), so a long-lived agent keeps no state for
    /// jobs long finished.
    pub fn retain_jobs(&mut self, live: impl Fn(&str) -> bool) {
        self.jobs.retain(|j, _| live(j));
    }

    /// What this host sends its jobs' aggregator: per job, its ranks that
    /// reported recently and each rank's values not judged yet (the newest
    /// [`STEPS_SENT`]), each with its own-history verdict. Jobs are in name
    /// order.
    pub fn report(&self) -> Vec<aggregate::JobValues> {
        let mut jobs: Vec<&String> = self.jobs.keys().collect();
        jobs.sort();
        let lag = self.cfg.judge_lag;
        jobs.into_iter()
            .filter_map(|name| {
                let j = self.jobs.get(name)?;
                let active = j
                    .ranks
                    .values()
                    .filter(|r| {
                        r.last_step
                            .is_some_and(|l| l.saturating_add(lag) >= j.newest)
                    })
                    .count();
                let mut ranks: BTreeMap<u32, aggregate::RankValues> = BTreeMap::new();
                for (step, vals) in j.pending.iter().rev() {
                    for (rank, p) in vals {
                        let state = j.ranks.get(rank);
                        let generation = state.map_or(0, |r| r.generation);
                        let rv = ranks.entry(*rank).or_insert_with(|| aggregate::RankValues {
                            rank: *rank,
                            generation,
                            steps: Vec::new(),
                        });
                        if rv.steps.len() < STEPS_SENT {
                            let departs = |m: usize| {
                                p.values[m]
                                    .zip(state)
                                    .and_then(|(x, r)| r.own_departure(&self.cfg, m, x))
                                    .is_some_and(|d| d.departs)
                            };
                            rv.steps.push(aggregate::StepValue {
                                step: *step,
                                values: p.values,
                                departs_own: [departs(0), departs(1)],
                            });
                        }
                    }
                }
                let ranks = ranks
                    .into_values()
                    .map(|mut r| {
                        r.steps.reverse();
                        r
                    })
                    .collect();
                Some(aggregate::JobValues {
                    job: name.clone(),
                    active: u32::try_from(active).unwrap_or(u32::MAX),
                    world: 0,
                    ranks,
                })
            })
            .collect()
    }

    /// Judges this host's ranks at the steps the aggregator answered for;
    /// returns the new suspects, oldest step first. Steps the job has
    /// moved far past with no answer (an aggregator lost with them) are
    /// judged with this host's ranks alone, so nothing waits forever.
    pub fn take_answer(&mut self, answer: Vec<aggregate::JobSteps>) -> Vec<SdcFinding> {
        let mut out = Vec::new();
        for js in answer {
            let Some(j) = self.jobs.get_mut(&js.job) else {
                continue;
            };
            for st in js.steps {
                if let Some(vals) = j.pending.remove(&st.step) {
                    judge_step(&self.cfg, &js.job, &st, &vals, &mut j.ranks, &mut out);
                }
            }
        }
        out.extend(self.judge_lost());
        out
    }

    /// Steps more than `judge_lag` + the aggregator's open window behind
    /// the job's newest: judged here with this host's ranks only.
    fn judge_lost(&mut self) -> Vec<SdcFinding> {
        let horizon = self.cfg.judge_lag + aggregate::MAX_OPEN_STEPS as u64 * 2;
        let lost: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| {
                j.pending
                    .first_key_value()
                    .is_some_and(|(s, _)| s.saturating_add(horizon) < j.newest)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::new();
        for job in lost {
            let Some(j) = self.jobs.get_mut(&job) else {
                continue;
            };
            while let Some((&step, _)) = j.pending.first_key_value() {
                if step.saturating_add(horizon) >= j.newest {
                    break;
                }
                let Some((step, vals)) = j.pending.pop_first() else {
                    break;
                };
                let st = stat_of(step, &vals, &j.ranks, &self.cfg);
                judge_step(&self.cfg, &job, &st, &vals, &mut j.ranks, &mut out);
            }
        }
        out
    }

    /// Judges every step that is ready with this host's ranks alone (the
    /// in-place aggregator: one host, or a job whose aggregator does not
    /// aggregate values); returns the new suspects, oldest step first.
    pub fn judge(&mut self, now: Instant) -> Vec<SdcFinding> {
        self.judge_jobs(|_| true, now)
    }

    /// [`SdcDetector::judge`] for the jobs `which` picks.
    pub fn judge_jobs(&mut self, which: impl Fn(&str) -> bool, now: Instant) -> Vec<SdcFinding> {
        let mut report = self.report();
        report.retain(|j| which(&j.job));
        if report.is_empty() {
            return Vec::new();
        }
        match self.here.report("", report, now) {
            Ok(answer) => self.take_answer(answer),
            // This host's own jobs cannot pass the aggregator's limits
            // (the registry's are lower); nothing to judge if they did.
            Err(_) => Vec::new(),
        }
    }
}

/// The statistics of this host's own values at one step (for a step no
/// aggregator answered).
fn stat_of(
    step: u64,
    vals: &BTreeMap<u32, Pending>,
    ranks: &BTreeMap<u32, RankState>,
    cfg: &SdcConfig,
) -> aggregate::StepStat {
    aggregate::step_stat(
        step,
        "",
        vals.iter().map(|(rank, p)| {
            let departs = |m: usize| {
                p.values[m]
                    .zip(ranks.get(rank))
                    .and_then(|(x, r)| r.own_departure(cfg, m, x))
                    .is_some_and(|d| d.departs)
            };
            (
                *rank,
                aggregate::StepValue {
                    step,
                    values: p.values,
                    departs_own: [departs(0), departs(1)],
                },
            )
        }),
    )
}

/// Judges this host's ranks' values at one step against the job's
/// statistics there, updates their histories and flags, and appends the
/// new suspects.
fn judge_step(
    cfg: &SdcConfig,
    job: &str,
    st: &aggregate::StepStat,
    vals: &BTreeMap<u32, Pending>,
    ranks: &mut BTreeMap<u32, RankState>,
    out: &mut Vec<SdcFinding>,
) {
    for metric in Metric::ALL {
        let m = metric.index();
        let Some(stat) = &st.metrics[m] else {
            continue;
        };
        for (rank, p) in vals {
            let Some(x) = p.values[m] else {
                continue;
            };
            // Own-history verdicts as of now, for this rank and any other
            // of this host's (the step's history is what came before it).
            let own = ranks.get(rank).and_then(|r| r.own_departure(cfg, m, x));
            let local = |other: u32, v: f64| -> Option<bool> {
                let r = ranks.get(&other)?;
                vals.get(&other)?;
                Some(r.own_departure(cfg, m, v).is_some_and(|d| d.departs))
            };
            let verdict = judge::judge(cfg, stat, *rank, x, own, &local);
            let Some(r) = ranks.get_mut(rank) else {
                continue;
            };
            match verdict {
                judge::ValueVerdict::Suspect {
                    basis,
                    z,
                    own_median,
                } => {
                    if !r.flagged[m] {
                        r.flagged[m] = true;
                        out.push(SdcFinding {
                            job: job.to_owned(),
                            rank: *rank,
                            step: st.step,
                            metric,
                            value: x,
                            job_median: stat.median,
                            own_median,
                            score: z,
                            ranks: usize::try_from(stat.count).unwrap_or(usize::MAX),
                            basis,
                        });
                    }
                }
                judge::ValueVerdict::Clean => {
                    r.flagged[m] = false;
                    let h = &mut r.history[m];
                    if h.len() >= cfg.history {
                        h.pop_front();
                    }
                    h.push_back(x);
                }
                judge::ValueVerdict::Neither => {}
            }
        }
    }
}
