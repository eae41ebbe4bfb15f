//! Rank positions (`warden.v1.JobPositions`, for the job-wide hang
//! verdict) and reported values (`warden.v1.RankValues`, for SDC) on the
//! wire, both ways: a peer's batch is checked here, and bad input is
//! refused naming the field.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_core::detect::culprit::{GroupSeq, MAX_GROUPS, MAX_NAME, MAX_POSITIONS, Position};
use warden_core::detect::positions::{JobPositions, MAX_JOBS};
use warden_core::text::unfit_name;
use warden_proto::v1 as pb;

use crate::ranks::peer_values::{LegacyRankValues, LegacyStepValue};
use warden_core::detect::sdc::aggregate::{
    self as sdc_agg, JobSteps, JobValues, MetricStat, StepStat, ValueAt,
};

/// Most step values one report to the aggregator may carry in all.
pub const MAX_REPORT_VALUES: usize = 262_144;

/// This host's values for its jobs' aggregator.
pub fn job_values_to_pb(jobs: &[JobValues]) -> Vec<pb::JobValues> {
    jobs.iter()
        .map(|j| pb::JobValues {
            job_id: j.job.clone(),
            active: j.active,
            world_size: j.world,
            ranks: j
                .ranks
                .iter()
                .map(|r| pb::RankValues {
                    job_id: String::new(),
                    global_rank: r.rank,
                    generation: r.generation,
                    steps: r
                        .steps
                        .iter()
                        .map(|s| pb::StepValue {
                            step: s.step,
                            loss: s.values[0],
                            grad_norm: s.values[1],
                            loss_departs_own: s.departs_own[0],
                            grad_norm_departs_own: s.departs_own[1],
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

/// A host's values as its aggregator takes them, checked; the error names
/// the field. Counts are bounded here, before anything is kept.
pub fn job_values_from_pb(jobs: Vec<pb::JobValues>) -> Result<Vec<JobValues>, String> {
    if jobs.len() > MAX_JOBS {
        return Err(format!("values: {} jobs; at most {MAX_JOBS}", jobs.len()));
    }
    let ranks: usize = jobs.iter().map(|j| j.ranks.len()).sum();
    if ranks > MAX_POSITIONS {
        return Err(format!(
            "values: {ranks} ranks in all; at most {MAX_POSITIONS}"
        ));
    }
    let steps: usize = jobs
        .iter()
        .flat_map(|j| &j.ranks)
        .map(|r| r.steps.len())
        .sum();
    if steps > MAX_REPORT_VALUES {
        return Err(format!(
            "values: {steps} step values in all; at most {MAX_REPORT_VALUES}"
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(jobs.len());
    for (i, j) in jobs.into_iter().enumerate() {
        if unfit_name(&j.job_id, MAX_NAME) {
            return Err(format!(
                "values[{i}].job_id: empty, over {MAX_NAME} bytes or with control characters"
            ));
        }
        if !seen.insert(j.job_id.clone()) {
            return Err(format!("values[{i}]: job {:?} appears twice", j.job_id));
        }
        let mut ranks = Vec::with_capacity(j.ranks.len());
        for (k, r) in j.ranks.into_iter().enumerate() {
            if r.steps.len() > MAX_STEPS_PER_RANK {
                return Err(format!(
                    "values[{i}].ranks[{k}].steps: {} steps; at most {MAX_STEPS_PER_RANK}",
                    r.steps.len()
                ));
            }
            ranks.push(sdc_agg::RankValues {
                rank: r.global_rank,
                generation: r.generation,
                steps: r
                    .steps
                    .into_iter()
                    .map(|s| sdc_agg::StepValue {
                        step: s.step,
                        values: [s.loss, s.grad_norm],
                        departs_own: [s.loss_departs_own, s.grad_norm_departs_own],
                    })
                    .collect(),
            });
        }
        out.push(JobValues {
            job: j.job_id,
            active: j.active,
            world: j.world_size,
            ranks,
        });
    }
    Ok(out)
}

fn value_at_pb(v: &ValueAt) -> pb::ValueAt {
    pb::ValueAt {
        host: v.host.clone(),
        global_rank: v.rank,
        value: v.value,
        departs_own: v.departs_own,
    }
}

fn metric_pb(m: &MetricStat) -> pb::MetricStats {
    pb::MetricStats {
        count: m.count,
        non_finite: m.non_finite,
        median: m.median,
        mad: m.mad,
        lowest: m.lowest.iter().map(value_at_pb).collect(),
        highest: m.highest.iter().map(value_at_pb).collect(),
        non_finite_at: m.non_finite_at.iter().map(value_at_pb).collect(),
    }
}

/// The aggregator's per-step statistics as answered.
pub fn step_stats_to_pb(jobs: &[JobSteps]) -> Vec<pb::JobStepStats> {
    jobs.iter()
        .map(|j| pb::JobStepStats {
            job_id: j.job.clone(),
            steps: j.steps.iter().map(step_stat_pb).collect(),
        })
        .collect()
}

/// One settled step on the wire.
pub fn step_stat_pb(s: &StepStat) -> pb::StepStats {
    pb::StepStats {
        step: s.step,
        loss: s.metrics[0].as_ref().map(metric_pb),
        grad_norm: s.metrics[1].as_ref().map(metric_pb),
    }
}

fn metric_from_pb(m: pb::MetricStats, field: &str) -> Result<MetricStat, String> {
    let lists = [&m.lowest, &m.highest, &m.non_finite_at];
    if lists.iter().any(|l| l.len() > sdc_agg::EXTREMES) {
        return Err(format!(
            "{field}: more than {} values named",
            sdc_agg::EXTREMES
        ));
    }
    if m.non_finite > m.count
        || m.median.is_some_and(|v| !v.is_finite())
        || m.mad.is_some_and(|v| !(v.is_finite() && v >= 0.0))
    {
        return Err(format!("{field}: inconsistent counts, median or MAD"));
    }
    let conv = |l: Vec<pb::ValueAt>| -> Result<Vec<ValueAt>, String> {
        l.into_iter()
            .map(|v| {
                if v.host.len() > 255 {
                    return Err(format!("{field}: a host name over 255 bytes"));
                }
                Ok(ValueAt {
                    host: v.host,
                    rank: v.global_rank,
                    value: v.value,
                    departs_own: v.departs_own,
                })
            })
            .collect()
    };
    Ok(MetricStat {
        count: m.count,
        non_finite: m.non_finite,
        median: m.median,
        mad: m.mad,
        lowest: conv(m.lowest)?,
        highest: conv(m.highest)?,
        non_finite_at: conv(m.non_finite_at)?,
    })
}

/// An aggregator's per-step statistics, checked; the error names the field.
pub fn step_stats_from_pb(jobs: Vec<pb::JobStepStats>) -> Result<Vec<JobSteps>, String> {
    if jobs.len() > MAX_JOBS {
        return Err(format!("values: {} jobs; at most {MAX_JOBS}", jobs.len()));
    }
    let mut out = Vec::with_capacity(jobs.len());
    for (i, j) in jobs.into_iter().enumerate() {
        if j.steps.len() > sdc_agg::MAX_SETTLED {
            return Err(format!(
                "values[{i}].steps: {} steps; at most {}",
                j.steps.len(),
                sdc_agg::MAX_SETTLED
            ));
        }
        let mut steps = Vec::with_capacity(j.steps.len());
        for (k, s) in j.steps.into_iter().enumerate() {
            let field = |m: &str| format!("values[{i}].steps[{k}].{m}");
            steps.push(StepStat {
                step: s.step,
                metrics: [
                    s.loss
                        .map(|m| metric_from_pb(m, &field("loss")))
                        .transpose()?,
                    s.grad_norm
                        .map(|m| metric_from_pb(m, &field("grad_norm")))
                        .transpose()?,
                ],
            });
        }
        out.push(JobSteps {
            job: j.job_id,
            steps,
        });
    }
    Ok(out)
}

/// This host's positions as sent.
pub fn to_pb(jobs: &[JobPositions]) -> Vec<pb::JobPositions> {
    jobs.iter()
        .map(|j| pb::JobPositions {
            job_id: j.job.clone(),
            world_size: j.world_size,
            hang: j.hang,
            flight_recorder_pending: j.pending,
            taken_at_unix_ms: j
                .taken_at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            ranks: j
                .ranks
                .iter()
                .map(|p| pb::RankPosition {
                    global_rank: p.rank,
                    step: p.step,
                    section: p.section.clone(),
                    stalled: p.stalled,
                    stalled_ms: p.stalled_ms,
                    process_state: p.process_state.clone(),
                    groups: p
                        .groups
                        .iter()
                        .map(|g| pb::GroupSeq {
                            group: g.group.clone(),
                            enqueued: g.enqueued,
                            pending: g.pending.clone(),
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

/// A peer's positions, checked; `host` is the sender's name. The error
/// names the field.
pub fn from_pb(host: &str, jobs: Vec<pb::JobPositions>) -> Result<Vec<JobPositions>, String> {
    if jobs.len() > MAX_JOBS {
        return Err(format!(
            "positions: {} jobs in one batch; at most {MAX_JOBS}",
            jobs.len()
        ));
    }
    let total: usize = jobs.iter().map(|j| j.ranks.len()).sum();
    if total > MAX_POSITIONS {
        return Err(format!(
            "positions: {total} ranks in one batch; at most {MAX_POSITIONS}"
        ));
    }
    let name = |field: String, s: &str| {
        if s.len() > MAX_NAME {
            Err(format!("{field}: {} bytes; at most {MAX_NAME}", s.len()))
        } else {
            Ok(())
        }
    };
    let mut out = Vec::with_capacity(jobs.len());
    for (i, j) in jobs.into_iter().enumerate() {
        if j.job_id.is_empty() {
            return Err(format!("positions[{i}].job_id: empty"));
        }
        name(format!("positions[{i}].job_id"), &j.job_id)?;
        let mut ranks = Vec::with_capacity(j.ranks.len());
        for (k, r) in j.ranks.into_iter().enumerate() {
            let at = format!("positions[{i}].ranks[{k}]");
            if j.world_size > 0 && r.global_rank >= j.world_size {
                return Err(format!(
                    "{at}.global_rank: {} is not below world_size {}",
                    r.global_rank, j.world_size
                ));
            }
            name(format!("{at}.section"), &r.section)?;
            name(format!("{at}.process_state"), &r.process_state)?;
            if r.groups.len() > MAX_GROUPS {
                return Err(format!(
                    "{at}.groups: {} groups; at most {MAX_GROUPS}",
                    r.groups.len()
                ));
            }
            let mut groups = Vec::with_capacity(r.groups.len());
            for (g_i, g) in r.groups.into_iter().enumerate() {
                name(format!("{at}.groups[{g_i}].group"), &g.group)?;
                name(format!("{at}.groups[{g_i}].pending"), &g.pending)?;
                groups.push(GroupSeq {
                    group: g.group,
                    enqueued: g.enqueued,
                    pending: g.pending,
                });
            }
            ranks.push(Position {
                host: host.to_owned(),
                rank: r.global_rank,
                step: r.step,
                section: r.section,
                stalled: r.stalled,
                stalled_ms: r.stalled_ms,
                process_state: r.process_state,
                groups,
            });
        }
        out.push(JobPositions {
            job: j.job_id,
            world_size: j.world_size,
            hang: j.hang,
            taken_at: UNIX_EPOCH
                .checked_add(Duration::from_millis(j.taken_at_unix_ms))
                .unwrap_or(SystemTime::UNIX_EPOCH),
            ranks,
            pending: j.flight_recorder_pending,
        });
    }
    Ok(out)
}

/// Most steps of one rank a peer may send.
pub const MAX_STEPS_PER_RANK: usize = 64;

/// This host's ranks' values as sent.
pub fn values_to_pb(values: &[LegacyRankValues]) -> Vec<pb::RankValues> {
    values
        .iter()
        .map(|r| pb::RankValues {
            job_id: r.job.clone(),
            global_rank: r.rank,
            generation: r.generation,
            steps: r
                .steps
                .iter()
                .map(|s| pb::StepValue {
                    step: s.step,
                    loss: s.loss,
                    grad_norm: s.grad_norm,
                    loss_departs_own: false,
                    grad_norm_departs_own: false,
                })
                .collect(),
        })
        .collect()
}

/// A peer's values, checked; the error names the field.
pub fn values_from_pb(values: Vec<pb::RankValues>) -> Result<Vec<LegacyRankValues>, String> {
    if values.len() > MAX_POSITIONS {
        return Err(format!(
            "values: {} ranks in one batch; at most {MAX_POSITIONS}",
            values.len()
        ));
    }
    let mut out = Vec::with_capacity(values.len());
    for (i, r) in values.into_iter().enumerate() {
        if r.job_id.is_empty() || r.job_id.len() > MAX_NAME {
            return Err(format!(
                "values[{i}].job_id: empty or over {MAX_NAME} bytes"
            ));
        }
        if r.steps.len() > MAX_STEPS_PER_RANK {
            return Err(format!(
                "values[{i}].steps: {} steps; at most {MAX_STEPS_PER_RANK}",
                r.steps.len()
            ));
        }
        out.push(LegacyRankValues {
            job: r.job_id,
            rank: r.global_rank,
            generation: r.generation,
            steps: r
                .steps
                .into_iter()
                .map(|s| LegacyStepValue {
                    step: s.step,
                    loss: s.loss,
                    grad_norm: s.grad_norm,
                })
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_survive_the_wire_and_bad_ones_are_named() {
        let jobs = vec![JobPositions {
            job: "j".into(),
            world_size: 4,
            hang: true,
            taken_at: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            pending: true,
            ranks: vec![Position {
                host: "b".into(),
                rank: 3,
                step: 12,
                section: "compute".into(),
                stalled: true,
                stalled_ms: 4000,
                process_state: "T (stopped)".into(),
                groups: vec![GroupSeq {
                    group: "0:default_pg".into(),
                    enqueued: 41,
                    pending: "gloo:all_reduce #41".into(),
                }],
            }],
        }];
        assert_eq!(from_pb("b", to_pb(&jobs)).unwrap(), jobs);
        let mut bad = to_pb(&jobs);
        bad[0].ranks[0].global_rank = 4;
        assert!(
            from_pb("b", bad)
                .unwrap_err()
                .contains("positions[0].ranks[0].global_rank")
        );
        let mut bad = to_pb(&jobs);
        bad[0].ranks[0].section = "x".repeat(MAX_NAME + 1);
        assert!(from_pb("b", bad).unwrap_err().contains("ranks[0].section"));
        let mut bad = to_pb(&jobs);
        bad[0].job_id.clear();
        assert!(
            from_pb("b", bad)
                .unwrap_err()
                .contains("positions[0].job_id")
        );
        let mut bad = to_pb(&jobs);
        bad[0].ranks[0].groups = vec![pb::GroupSeq::default(); MAX_GROUPS + 1];
        assert!(from_pb("b", bad).unwrap_err().contains("groups"));
    }

    #[test]
    fn values_survive_the_wire_and_bad_ones_are_named() {
        let v = vec![LegacyRankValues {
            job: "j".into(),
            rank: 3,
            generation: 2,
            steps: vec![LegacyStepValue {
                step: 30,
                loss: Some(f64::NAN),
                grad_norm: None,
            }],
        }];
        let back = values_from_pb(values_to_pb(&v)).unwrap();
        assert_eq!(back[0].steps[0].step, 30);
        assert!(back[0].steps[0].loss.is_some_and(f64::is_nan));
        assert_eq!(back[0].steps[0].grad_norm, None);
        let mut bad = values_to_pb(&v);
        bad[0].steps = vec![pb::StepValue::default(); MAX_STEPS_PER_RANK + 1];
        assert!(values_from_pb(bad).unwrap_err().contains("values[0].steps"));
        let mut bad = values_to_pb(&v);
        bad[0].job_id.clear();
        assert!(
            values_from_pb(bad)
                .unwrap_err()
                .contains("values[0].job_id")
        );
    }

    #[test]
    fn job_values_and_step_stats_survive_the_wire_and_hostile_counts_are_named() {
        use warden_core::detect::sdc::aggregate as a;
        let v = vec![a::JobValues {
            job: "j".into(),
            active: 2,
            world: 4,
            ranks: vec![a::RankValues {
                rank: 3,
                generation: 7,
                steps: vec![a::StepValue {
                    step: 9,
                    values: [Some(1.5), None],
                    departs_own: [true, false],
                }],
            }],
        }];
        assert_eq!(job_values_from_pb(job_values_to_pb(&v)).unwrap(), v);
        let mut bad = job_values_to_pb(&v);
        bad[0].ranks[0].steps = vec![bad[0].ranks[0].steps[0]; MAX_STEPS_PER_RANK + 1];
        let e = job_values_from_pb(bad).unwrap_err();
        assert!(e.contains("values[0].ranks[0].steps: 65 steps"), "{e}");
        let mut bad = job_values_to_pb(&v);
        let rank = bad[0].ranks[0].clone();
        bad[0].ranks = vec![
            pb::RankValues {
                steps: vec![rank.steps[0]; MAX_STEPS_PER_RANK],
                ..rank
            };
            MAX_REPORT_VALUES / MAX_STEPS_PER_RANK + 1
        ];
        let e = job_values_from_pb(bad).unwrap_err();
        assert!(e.contains("step values in all; at most 262144"), "{e}");
        let mut bad = job_values_to_pb(&v);
        bad.push(bad[0].clone());
        assert!(
            job_values_from_pb(bad)
                .unwrap_err()
                .contains("appears twice")
        );
        let stats = vec![a::JobSteps {
            job: "j".into(),
            steps: vec![a::StepStat {
                step: 9,
                metrics: [
                    Some(a::MetricStat {
                        count: 2,
                        non_finite: 1,
                        median: Some(1.5),
                        mad: Some(0.0),
                        ..a::MetricStat::default()
                    }),
                    None,
                ],
            }],
        }];
        assert_eq!(step_stats_from_pb(step_stats_to_pb(&stats)).unwrap(), stats);
        let mut bad = step_stats_to_pb(&stats);
        if let Some(m) = bad[0].steps[0].loss.as_mut() {
            m.non_finite = 3;
        }
        let e = step_stats_from_pb(bad).unwrap_err();
        assert!(e.contains("values[0].steps[0].loss"), "{e}");
    }
}
