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

use std::time::{Instant, SystemTime};

use warden_core::detect::culprit;
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::{JobSteps, JobValues};
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
    let host = report.host.clone();
    let aggregated = ex.sdc_enabled;
    let values = if aggregated && !values.is_empty() {
        ex.sdc_aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .report(&host, values, Instant::now())
            .map_err(|e| e.to_string())?
    } else {
        Vec::new()
    };
    let mut jobs: Vec<String> = report.jobs.iter().map(|j| j.job.clone()).collect();
    jobs.extend(positions.iter().map(|p| p.job.clone()));
    let hung: Vec<String> = positions
        .iter()
        .filter(|p| p.hang)
        .map(|p| p.job.clone())
        .collect();
    let wide = {
        let mut agg = ex
            .aggregator
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        agg.report(report, Instant::now())
            .map_err(|e: AggregateError| e.to_string())?
    };
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
    let verdicts = ex.hang_board.announced_for(jobs.iter().map(String::as_str));
    Ok(Here {
        wide,
        verdicts,
        values,
        values_aggregated: aggregated,
    })
}
