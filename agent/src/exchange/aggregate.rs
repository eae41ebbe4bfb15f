//! The aggregator's use case: a host's report (its own, or a peer's the
//! edge has checked and authorized) folded into the job-wide statistics,
//! the hang collector's board and the SDC step aggregates, and what it
//! answers.
//!
//! In: a [`HostReport`] with its positions and values. Out: [`Here`] (the
//! statistics of the report's jobs, fresh verdicts, settled steps). Never:
//! a wire type (the edge, `api::aggregate`, and the reporting task,
//! `exchange::report`, convert), a limit passed (the error names it and
//! nothing changes).

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

use warden_core::detect::culprit;
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::{AskedSteps, JobSteps, JobValues, StepStat};
use warden_core::detect::straggler::aggregate::{AggregateError, HostReport, JobWide};

use super::Exchange;

/// What an aggregator answered (here or over the wire).
#[derive(Debug, Default)]
pub struct Here {
    /// The straggler statistics of the report's jobs.
    pub wide: Vec<JobWide>,
    /// Fresh hang verdicts of its jobs.
    pub verdicts: Vec<(String, SystemTime, culprit::HangJudgement)>,
    /// The settled steps of its values (SDC).
    pub values: Vec<JobSteps>,
    /// Whether the aggregator aggregates values (an older one does not).
    pub values_aggregated: bool,
}

/// Aggregates `report` here (a peer's, or this agent's own when it is
/// first in order): the statistics of its jobs, their fresh verdicts and
/// the settled steps of its values. A report carrying a hang snapshot
/// starts the collector's judgement. A report past a limit changes nothing
/// (the error names the limit).
pub fn aggregate_here(
    ex: &Exchange,
    report: HostReport,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
) -> Result<Here, String> {
    let folded = fold(ex, report, positions, values)?;
    let values = settled_steps(ex, &folded);
    let wide = {
        let agg = ex
            .aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        folded
            .asked
            .iter()
            .filter_map(|job| agg.stats(job, folded.thresholds.0, folded.thresholds.1))
            .collect()
    };
    Ok(folded.answer(ex, wide, values))
}

/// A report folded into the aggregates, not answered yet: what its answer
/// needs.
#[derive(Debug)]
pub struct Folded {
    /// The jobs of its straggler part, in its order: one statistics each.
    pub asked: Vec<String>,
    /// Its relative and z thresholds.
    pub thresholds: (f64, f64),
    /// Every job it named (sorted, once each): their verdicts.
    jobs: Vec<String>,
    /// The steps of its values, per job in its order: answered once they
    /// settle.
    pub values: Vec<AskedSteps>,
}

impl Folded {
    /// The answer, with `wide` the statistics of [`Self::asked`] and
    /// `values` the settled steps of [`Self::values`].
    pub fn answer(&self, ex: &Exchange, wide: Vec<JobWide>, values: Vec<JobSteps>) -> Here {
        let verdicts = ex
            .hang_board
            .announced_for(self.jobs.iter().map(String::as_str));
        Here {
            wide,
            verdicts,
            values,
            values_aggregated: ex.sdc_enabled,
        }
    }
}

/// The settled steps of `folded`'s values, as its own answer carries them.
fn settled_steps(ex: &Exchange, folded: &Folded) -> Vec<JobSteps> {
    if folded.values.is_empty() {
        return Vec::new();
    }
    let sdc = ex
        .sdc_aggregator
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    folded
        .values
        .iter()
        .map(|a| sdc.steps(&a.job, &a.steps))
        .collect()
}

/// Folds `report` into the aggregates here (the statistics, the SDC steps,
/// the hang board; a hang snapshot starts the collector's judgement),
/// without computing its jobs' statistics: a leader's batch is folded
/// whole and then answered once per job ([`Aggregator::stats`]). A report
/// past a limit changes nothing (the error names the limit).
///
/// [`Aggregator::stats`]: warden_core::detect::straggler::aggregate::Aggregator::stats
pub fn fold(
    ex: &Exchange,
    report: HostReport,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
) -> Result<Folded, String> {
    let host = report.host.clone();
    let values = if ex.sdc_enabled && !values.is_empty() {
        ex.sdc_aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .fold(&host, values, Instant::now())
            .map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    let asked: Vec<String> = report.jobs.iter().map(|j| j.job.clone()).collect();
    let mut jobs = asked.clone();
    jobs.extend(positions.iter().map(|p| p.job.clone()));
    let hung: Vec<String> = positions
        .iter()
        .filter(|p| p.hang)
        .map(|p| p.job.clone())
        .collect();
    let thresholds = (report.relative_threshold, report.z_threshold);
    ex.aggregator
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .fold(report, Instant::now())
        .map_err(|e: AggregateError| e.to_string())?;
    if host != ex.host {
        ex.hang_board.merge_remote(&host, positions);
    }
    for job in hung {
        tokio::spawn(crate::hang::verdict::collect(
            ex.hang_board.clone(),
            job,
            ex.verdict_wait,
        ));
    }
    jobs.sort();
    jobs.dedup();
    Ok(Folded {
        asked,
        thresholds,
        jobs,
        values,
    })
}

/// The statistics a leader's batch shares, once per job and thresholds,
/// computed after the whole batch is folded: the statistics, and per
/// folded report the indices of its jobs' statistics among them (one per
/// job of its straggler part, in order).
fn shared_stats<'a>(
    ex: &Exchange,
    folded: impl Iterator<Item = &'a Folded>,
) -> (Vec<JobWide>, Vec<Vec<u32>>) {
    let agg = ex
        .aggregator
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut shared: Vec<JobWide> = Vec::new();
    let mut index: HashMap<(&str, u64, u64), u32> = HashMap::new();
    let indices = folded
        .map(|f| {
            let (rel, z) = f.thresholds;
            f.asked
                .iter()
                .filter_map(|job| {
                    let key = (job.as_str(), rel.to_bits(), z.to_bits());
                    shared_index(&mut index, &mut shared, key, || agg.stats(job, rel, z))
                })
                .collect()
        })
        .collect();
    (shared, indices)
}

/// The settled SDC steps a leader's batch shares, each (job, step) once,
/// taken after the whole batch is folded (the members of one job report
/// the same steps): the steps, and per folded report, per job of its
/// values in order, the indices of that job's settled steps among them.
#[derive(Debug, Default)]
struct SharedSteps {
    /// (job, step), each once.
    steps: Vec<(String, StepStat)>,
    /// Per folded report, per job of its values: indices into `steps`.
    refs: Vec<Vec<Vec<u32>>>,
}

/// The [`SharedSteps`] of a batch's folded reports.
fn shared_steps<'a>(ex: &Exchange, folded: impl Iterator<Item = &'a Folded>) -> SharedSteps {
    let sdc = ex
        .sdc_aggregator
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = SharedSteps::default();
    let mut index: HashMap<(&str, u64), u32> = HashMap::new();
    for f in folded {
        let refs = f
            .values
            .iter()
            .map(|a| {
                sdc.settled(&a.job, &a.steps)
                    .filter_map(|s| {
                        shared_index(&mut index, &mut out.steps, (a.job.as_str(), s.step), || {
                            Some((a.job.clone(), s.clone()))
                        })
                    })
                    .collect()
            })
            .collect();
        out.refs.push(refs);
    }
    out
}

/// One report of a leader's batch, answered: its own answer (its jobs'
/// statistics left to the batch's shared ones), the indices of those
/// statistics among the batch's, and, where the batch shares its SDC
/// steps, per job of its values the indices of its settled steps among the
/// batch's.
#[derive(Debug)]
pub struct BatchItem {
    /// Its answer: verdicts, and its settled steps unless shared.
    pub answer: Here,
    /// Indices into [`BatchAnswer::jobs`], one per job of its straggler part.
    pub jobs: Vec<u32>,
    /// Per job of its values: indices into [`BatchAnswer::steps`] (empty
    /// unless the steps are shared).
    pub steps: Vec<Vec<u32>>,
}

/// A leader's batch answered: each report's item as the caller made it
/// from its [`BatchItem`], or why it was refused, in the batch's order,
/// and what the items share.
#[derive(Debug)]
pub struct BatchAnswer<O, E> {
    /// Per report, in order.
    pub items: Vec<Result<O, E>>,
    /// The statistics of each (job, thresholds) of the batch, once.
    pub jobs: Vec<JobWide>,
    /// The settled (job, step)s of the batch, once each, where shared.
    pub steps: Vec<(String, StepStat)>,
}

/// Answers a leader's batch whose reports were all folded first
/// ([`fold`]; a refused one stays refused): the members of one job get the
/// same statistics, computed and sent once; with `share_steps` each
/// settled (job, step) too (an older leader takes each item's steps in
/// full instead). Each item is handed to `item` as it is made (the edge
/// turns it into its message at once, bounding what an answer holds: a
/// verdict's hosts, in full in each [`Here`], are cut there).
pub fn answer_batch<O, E>(
    ex: &Exchange,
    folded: Vec<Result<Folded, E>>,
    share_steps: bool,
    mut item: impl FnMut(BatchItem) -> O,
) -> BatchAnswer<O, E> {
    let (jobs, indices) = shared_stats(ex, folded.iter().flatten());
    let mut steps = if share_steps {
        shared_steps(ex, folded.iter().flatten())
    } else {
        SharedSteps::default()
    };
    let mut indices = indices.into_iter();
    let mut refs = std::mem::take(&mut steps.refs).into_iter();
    let items = folded
        .into_iter()
        .map(|f| {
            f.map(|f| {
                let (values, steps) = if share_steps {
                    let bare = f
                        .values
                        .iter()
                        .map(|a| JobSteps {
                            job: a.job.clone(),
                            steps: Vec::new(),
                        })
                        .collect();
                    (bare, refs.next().unwrap_or_default())
                } else {
                    (settled_steps(ex, &f), Vec::new())
                };
                item(BatchItem {
                    answer: f.answer(ex, Vec::new(), values),
                    jobs: indices.next().unwrap_or_default(),
                    steps,
                })
            })
        })
        .collect();
    BatchAnswer {
        items,
        jobs,
        steps: steps.steps,
    }
}

/// The index of `key`'s entry among a batch's `shared` entries, the entry
/// made by `make` the first time the key is seen (None: `make` has none,
/// or past u32 entries).
fn shared_index<K: Eq + std::hash::Hash, V>(
    index: &mut HashMap<K, u32>,
    shared: &mut Vec<V>,
    key: K,
    make: impl FnOnce() -> Option<V>,
) -> Option<u32> {
    if let Some(i) = index.get(&key) {
        return Some(*i);
    }
    let i = u32::try_from(shared.len()).ok()?;
    shared.push(make()?);
    index.insert(key, i);
    Some(i)
}
