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
//! A step is judged once every rank of the job that reported recently has
//! reported it, or once the job is [`SdcConfig::judge_lag`] steps past it.
//! A rank is reported once per metric until one of its values is judged
//! clean again.

mod score;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

pub use score::{Departure, MAD_TO_SIGMA, MIN_SPREAD, robust_departure};

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
        let invalid = |key, value, why: &str| ConfigError::invalid(origin, key, value, why);
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

    fn index(self) -> usize {
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

/// One rank's values at one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Values {
    loss: Option<f64>,
    grad_norm: Option<f64>,
}

impl Values {
    fn get(&self, m: Metric) -> Option<f64> {
        match m {
            Metric::Loss => self.loss,
            Metric::GradNorm => self.grad_norm,
        }
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
    /// Steps waiting to be judged: rank -> values.
    pending: BTreeMap<u64, BTreeMap<u32, Values>>,
    ranks: BTreeMap<u32, RankState>,
    newest: u64,
}

/// The detector: per job, steps waiting for their ranks and each rank's
/// recent clean values. Owned by the agent's work loop (one thread).
#[derive(Debug)]
pub struct SdcDetector {
    cfg: SdcConfig,
    jobs: HashMap<String, JobState>,
}

impl SdcDetector {
    /// A detector with `cfg`.
    pub fn new(cfg: SdcConfig) -> Self {
        Self {
            cfg,
            jobs: HashMap::new(),
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
        j.pending
            .entry(step)
            .or_default()
            .insert(rank, Values { loss, grad_norm });
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

    /// Judges every step that is ready; returns the new suspects, oldest
    /// step first.
    pub fn judge(&mut self) -> Vec<SdcFinding> {
        let mut out = Vec::new();
        let mut jobs: Vec<&String> = self.jobs.keys().collect();
        jobs.sort();
        let jobs: Vec<String> = jobs.into_iter().cloned().collect();
        for job in jobs {
            let Some(j) = self.jobs.get_mut(&job) else {
                continue;
            };
            let lag = self.cfg.judge_lag;
            while let Some((&step, vals)) = j.pending.first_key_value() {
                let stale = step.saturating_add(lag) < j.newest;
                let complete = j
                    .ranks
                    .iter()
                    .filter(|(_, r)| {
                        r.last_step
                            .is_some_and(|l| l.saturating_add(lag) >= j.newest)
                    })
                    .all(|(rank, _)| vals.contains_key(rank));
                if !(stale || complete) {
                    break;
                }
                let Some((step, vals)) = j.pending.pop_first() else {
                    break;
                };
                judge_step(&self.cfg, &job, step, &vals, &mut j.ranks, &mut out);
            }
        }
        out
    }
}

/// Judges one step's values, updates the ranks' histories and flags, and
/// appends the new suspects.
fn judge_step(
    cfg: &SdcConfig,
    job: &str,
    step: u64,
    vals: &BTreeMap<u32, Values>,
    ranks: &mut BTreeMap<u32, RankState>,
    out: &mut Vec<SdcFinding>,
) {
    for metric in Metric::ALL {
        let m = metric.index();
        let xs: Vec<(u32, f64)> = vals
            .iter()
            .filter_map(|(r, v)| v.get(metric).map(|x| (*r, x)))
            .collect();
        if xs.is_empty() {
            continue;
        }
        let mut finite: Vec<f64> = xs
            .iter()
            .map(|(_, x)| *x)
            .filter(|x| x.is_finite())
            .collect();
        let job_median = score::median(&mut finite);
        let n = finite.len();
        let mut suspects: Vec<SdcFinding> = Vec::new();
        let mut ambiguous = false;
        let finding = |rank: u32, value: f64, basis: Basis| SdcFinding {
            job: job.to_owned(),
            rank,
            step,
            metric,
            value,
            job_median,
            own_median: None,
            score: None,
            ranks: xs.len(),
            basis,
        };
        // Non-finite on some ranks only (or on a rank alone).
        if n > 0 || xs.len() == 1 {
            let basis = if xs.len() == 1 {
                Basis::NonFiniteAlone
            } else {
                Basis::NonFinite
            };
            for (rank, x) in xs.iter().filter(|(_, x)| !x.is_finite()) {
                suspects.push(finding(*rank, *x, basis));
            }
        }
        let fin: Vec<(u32, f64)> = xs.iter().copied().filter(|(_, x)| x.is_finite()).collect();
        if n >= 3 {
            let mut all: Vec<f64> = fin.iter().map(|(_, x)| *x).collect();
            for (rank, x) in &fin {
                if let Some(d) = robust_departure(*x, &mut all, cfg.z_threshold, cfg.min_relative)
                    && d.departs
                {
                    suspects.push(SdcFinding {
                        score: Some(d.z),
                        ..finding(*rank, *x, Basis::Peers)
                    });
                }
            }
        } else if n == 2 {
            let (a, b) = (fin[0], fin[1]);
            if score::disagree(a.1, b.1, cfg.min_relative) {
                let own = |rank: u32, x: f64| -> Option<Departure> {
                    let h = &ranks.get(&rank)?.history[m];
                    if h.len() < cfg.min_history {
                        return None;
                    }
                    let mut v: Vec<f64> = h.iter().copied().collect();
                    robust_departure(x, &mut v, cfg.z_threshold, cfg.min_relative)
                };
                let (da, db) = (own(a.0, a.1), own(b.0, b.1));
                let departed = |d: &Option<Departure>| d.as_ref().is_some_and(|d| d.departs);
                match (departed(&da), departed(&db)) {
                    (true, false) | (false, true) => {
                        let (rank, x, d) = if departed(&da) {
                            (a.0, a.1, da)
                        } else {
                            (b.0, b.1, db)
                        };
                        suspects.push(SdcFinding {
                            own_median: d.as_ref().map(|d| d.median),
                            score: d.as_ref().map(|d| d.z),
                            ..finding(rank, x, Basis::OwnHistory)
                        });
                    }
                    _ => ambiguous = true,
                }
            }
        }
        // Histories and flags: a clean finite value is history; a suspect is
        // reported once until the rank is judged clean again. A value with
        // no finite peer was compared with nothing: it is neither.
        let compared = n >= 2;
        for (rank, x) in &xs {
            let Some(r) = ranks.get_mut(rank) else {
                continue;
            };
            match suspects.iter().position(|s| s.rank == *rank) {
                Some(i) if !r.flagged[m] => {
                    r.flagged[m] = true;
                    out.push(suspects[i].clone());
                }
                Some(_) => {}
                None if x.is_finite() && compared && !ambiguous => {
                    r.flagged[m] = false;
                    let h = &mut r.history[m];
                    if h.len() >= cfg.history {
                        h.pop_front();
                    }
                    h.push_back(*x);
                }
                None => {}
            }
        }
    }
}
