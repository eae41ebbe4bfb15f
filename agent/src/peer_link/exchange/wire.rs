//! The exchange's messages on the wire, both ways: this host's report to
//! its aggregator (`warden.v1.AggregateReport`) and the aggregator's
//! answer (`AggregateAnswer`), and a straggler score as the API shows it.
//! What comes from a peer is checked here, and bad input is refused naming
//! the field; counts are bounded before anything is expanded.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_core::detect::culprit::{self, Blame};
use warden_core::detect::positions::{JobPositions, MAX_JOBS};
use warden_core::detect::sdc::aggregate::JobValues;
use warden_core::detect::straggler::aggregate::{
    HostReport, JobPart, JobWide, SectionStat, SectionStatValues,
};
use warden_core::detect::straggler::exchange::{self, MAX_BATCH_RANKS};
use warden_core::detect::straggler::score::MAX_SECTIONS;
use warden_core::detect::straggler::sketch::Sketch;
use warden_core::detect::straggler::{Batch, Score, Summary};
use warden_core::text::unfit_name;
use warden_proto::v1 as pb;

use crate::exchange::aggregate::Here;

/// Hosts a verdict notice names (the count says how many were read).
const MAX_NOTICE_HOSTS: usize = 64;

fn opt_time(t: Option<SystemTime>) -> Option<prost_types::Timestamp> {
    t.map(prost_types::Timestamp::from)
}

fn from_time(t: Option<&prost_types::Timestamp>) -> Option<SystemTime> {
    let t = t?;
    let secs = u64::try_from(t.seconds).ok()?;
    let nanos = u32::try_from(t.nanos).ok().filter(|n| *n < 1_000_000_000)?;
    UNIX_EPOCH.checked_add(Duration::new(secs, nanos))
}

/// A score as the API shows it.
pub fn score_pb(s: &Score) -> pb::StragglerScore {
    pb::StragglerScore {
        job_id: s.job.clone(),
        global_rank: s.rank,
        host: s.host.clone(),
        section: s.section.clone(),
        relative: s.relative,
        individual: s.individual,
        flagged: s.flagged,
        consecutive: s.consecutive,
        flagged_since: opt_time(s.flagged_since),
        explanation: s.explanation.clone(),
        samples: s.samples,
        robust_z: s.robust_z,
        cause_class: s.cause_class.clone(),
        devices: s.devices.clone(),
        rank_median_ns: s.rank_median_ns,
        job_median_ns: s.job_median_ns,
        ranks_compared: s.ranks_compared,
        scored_at: opt_time(s.scored_at),
    }
}

/// A score from the wire (checked by the caller).
pub fn score_from_pb(p: &pb::StragglerScore) -> Score {
    Score {
        job: p.job_id.clone(),
        rank: p.global_rank,
        host: p.host.clone(),
        section: p.section.clone(),
        relative: p.relative,
        individual: p.individual,
        robust_z: p.robust_z,
        flagged: p.flagged,
        consecutive: p.consecutive,
        flagged_since: from_time(p.flagged_since.as_ref()),
        explanation: p.explanation.clone(),
        cause_class: p.cause_class.clone(),
        samples: p.samples,
        devices: p.devices.clone(),
        rank_median_ns: p.rank_median_ns,
        job_median_ns: p.job_median_ns,
        ranks_compared: p.ranks_compared,
        scored_at: from_time(p.scored_at.as_ref()),
    }
}

/// A report on the wire.
pub fn report_pb(
    r: &HostReport,
    positions: &[JobPositions],
    values: &[JobValues],
) -> pb::AggregateReport {
    pb::AggregateReport {
        host: r.host.clone(),
        relative_threshold: r.relative_threshold,
        z_threshold: r.z_threshold,
        jobs: r
            .jobs
            .iter()
            .map(|j| pb::JobSketches {
                job_id: j.job.clone(),
                sections: j
                    .sections
                    .iter()
                    .map(|(name, sk)| {
                        let (keys, counts) = sk.bins().unzip();
                        pb::SectionSketch {
                            section: name.clone(),
                            keys,
                            counts,
                        }
                    })
                    .collect(),
                scores: j.scores.iter().map(score_pb).collect(),
            })
            .collect(),
        positions: super::positions::to_pb(positions),
        values: super::positions::job_values_to_pb(values),
        relayed: false,
    }
}

/// A report from a peer, checked; the error names the field.
#[allow(clippy::type_complexity)]
pub fn report_from_pb(
    p: pb::AggregateReport,
) -> Result<(HostReport, Vec<JobPositions>, Vec<JobValues>), String> {
    if unfit_name(&p.host, 255) {
        return Err(format!(
            "host must be 1 to 255 characters without control characters (got {:?})",
            p.host
        ));
    }
    for (field, v) in [
        ("relative_threshold", p.relative_threshold),
        ("z_threshold", p.z_threshold),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("{field} must be a positive number (got {v})"));
        }
    }
    if p.jobs.len() > MAX_JOBS {
        return Err(format!("jobs: {} jobs; at most {MAX_JOBS}", p.jobs.len()));
    }
    let total: usize = p.jobs.iter().map(|j| j.scores.len()).sum();
    if total > MAX_BATCH_RANKS {
        return Err(format!(
            "jobs: {total} scores in all; at most {MAX_BATCH_RANKS}"
        ));
    }
    let positions = super::positions::from_pb(&p.host, p.positions)?;
    let values = super::positions::job_values_from_pb(p.values)?;
    let mut jobs = Vec::with_capacity(p.jobs.len());
    let mut seen = std::collections::HashSet::new();
    for (i, j) in p.jobs.into_iter().enumerate() {
        if unfit_name(&j.job_id, 128) {
            return Err(format!(
                "jobs[{i}].job_id must be 1 to 128 characters without control characters (got {:?})",
                j.job_id
            ));
        }
        if !seen.insert(j.job_id.clone()) {
            return Err(format!("jobs[{i}]: job {:?} appears twice", j.job_id));
        }
        if j.sections.len() > MAX_SECTIONS {
            return Err(format!(
                "jobs[{i}].sections: {} sections; at most {MAX_SECTIONS}",
                j.sections.len()
            ));
        }
        let mut sections = Vec::with_capacity(j.sections.len());
        for (k, s) in j.sections.into_iter().enumerate() {
            if unfit_name(&s.section, 64) {
                return Err(format!(
                    "jobs[{i}].sections[{k}].section must be 1 to 64 characters (got {:?})",
                    s.section
                ));
            }
            if sections.iter().any(|(n, _)| *n == s.section) {
                return Err(format!(
                    "jobs[{i}].sections[{k}]: section {:?} appears twice",
                    s.section
                ));
            }
            if s.keys.len() != s.counts.len() {
                return Err(format!(
                    "jobs[{i}].sections[{k}]: {} keys but {} counts",
                    s.keys.len(),
                    s.counts.len()
                ));
            }
            let sk = Sketch::from_bins(s.keys.into_iter().zip(s.counts))
                .map_err(|e| format!("jobs[{i}].sections[{k}]: {e}"))?;
            sections.push((s.section, sk));
        }
        // The scores are checked as the legacy exchange checks them.
        let batch = Batch {
            host: p.host.clone(),
            ranks: j
                .scores
                .iter()
                .map(|s| Summary {
                    job: j.job_id.clone(),
                    rank: s.global_rank,
                    sections: Vec::new(),
                    window_seq: 0,
                    score: Some(score_from_pb(s)),
                })
                .collect(),
        };
        exchange::validate(&batch).map_err(|e| format!("jobs[{i}].scores: {e}"))?;
        let scores = batch
            .ranks
            .into_iter()
            .filter_map(|s| s.score)
            .map(|mut sc| {
                sc.job.clone_from(&j.job_id);
                sc.host.clone_from(&p.host);
                sc
            })
            .collect();
        jobs.push(JobPart {
            job: j.job_id,
            sections,
            scores,
        });
    }
    Ok((
        HostReport {
            host: p.host,
            relative_threshold: p.relative_threshold,
            z_threshold: p.z_threshold,
            jobs,
        },
        positions,
        values,
    ))
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A job's statistics on the wire.
pub fn job_stats_pb(w: &JobWide) -> pb::JobStats {
    pb::JobStats {
        job_id: w.job.clone(),
        sections: w
            .sections
            .iter()
            .map(|s| pb::SectionStats {
                section: s.section.clone(),
                n: s.stat.n,
                median_ns: s.stat.median_ns,
                sigma_ns: s.stat.sigma_ns,
                over: s.stat.over,
            })
            .collect(),
        top: w.top.iter().map(score_pb).collect(),
        hosts: w.hosts,
        ranks: w.ranks,
    }
}

/// An answer on the wire.
pub fn answer_pb(host: &str, here: &Here) -> pb::AggregateAnswer {
    let (wide, verdicts) = (&here.wide, &here.verdicts);
    pb::AggregateAnswer {
        host: host.to_owned(),
        values: super::positions::step_stats_to_pb(&here.values),
        values_aggregated: here.values_aggregated,
        jobs: wide.iter().map(job_stats_pb).collect(),
        verdicts: verdicts
            .iter()
            .map(|(job, at, v)| pb::HangVerdictNotice {
                job_id: job.clone(),
                judged_at_unix_ms: unix_ms(*at),
                culprits: v
                    .culprits
                    .iter()
                    .take(culprit::MAX_POSITIONS)
                    .map(|b| pb::HangBlame {
                        global_rank: b.rank,
                        host: b.host.clone(),
                        why: b.why.clone(),
                    })
                    .collect(),
                waiting: culprit::ranks_list(&v.waiting),
                missing: culprit::ranks_list(&v.missing),
                hosts: v.hosts.iter().take(MAX_NOTICE_HOSTS).cloned().collect(),
                hosts_read: u32::try_from(v.hosts.len()).unwrap_or(u32::MAX),
                summary: v.summary.clone(),
            })
            .collect(),
    }
}

/// Most ranks a compact list from a peer may expand to.
const MAX_LIST_RANKS: usize = 1 << 20;

/// "0-2,5" back to ranks; the error names what was wrong.
fn parse_ranks(s: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let a: u32 = a.parse().map_err(|_| format!("{part:?} is not a rank"))?;
        let b: u32 = b.parse().map_err(|_| format!("{part:?} is not a rank"))?;
        if b < a || out.len() + (b - a) as usize >= MAX_LIST_RANKS {
            return Err(format!("{part:?}: a bad or too large range"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// The answer from an aggregator, checked; the error names the field.
pub fn answer_from_pb(p: pb::AggregateAnswer) -> Result<Here, String> {
    if p.jobs.len() > MAX_JOBS || p.verdicts.len() > MAX_JOBS {
        return Err(format!("more than {MAX_JOBS} jobs"));
    }
    let mut wide = Vec::with_capacity(p.jobs.len());
    for (i, j) in p.jobs.into_iter().enumerate() {
        if j.sections.len() > MAX_SECTIONS * 2 {
            return Err(format!("jobs[{i}].sections: too many"));
        }
        if j.top.len() > warden_core::detect::straggler::aggregate::TOP_SCORES {
            return Err(format!("jobs[{i}].top: too many"));
        }
        let mut sections = Vec::new();
        for s in j.sections {
            let ok = s.median_ns.is_finite()
                && s.median_ns > 0.0
                && s.sigma_ns.is_finite()
                && s.sigma_ns > 0.0;
            if !ok || unfit_name(&s.section, 64) {
                return Err(format!("jobs[{i}].sections: bad section {:?}", s.section));
            }
            sections.push(SectionStat {
                section: s.section,
                stat: SectionStatValues {
                    n: s.n,
                    median_ns: s.median_ns,
                    sigma_ns: s.sigma_ns,
                    over: s.over,
                },
            });
        }
        let top: Vec<_> = j
            .top
            .iter()
            .map(score_from_pb)
            .filter(|s| s.job == j.job_id && !unfit_name(&s.host, 255))
            .collect();
        wide.push(JobWide {
            job: j.job_id,
            sections,
            top,
            hosts: j.hosts,
            ranks: j.ranks,
        });
    }
    let mut verdicts = Vec::new();
    for (i, v) in p.verdicts.into_iter().enumerate() {
        if v.culprits.len() > culprit::MAX_POSITIONS || v.hosts.len() > MAX_NOTICE_HOSTS {
            return Err(format!("verdicts[{i}]: too many culprits or hosts"));
        }
        let at = UNIX_EPOCH + Duration::from_millis(v.judged_at_unix_ms);
        verdicts.push((
            v.job_id,
            at,
            culprit::HangJudgement {
                culprits: v
                    .culprits
                    .into_iter()
                    .map(|b| Blame {
                        rank: b.global_rank,
                        host: b.host,
                        why: b.why,
                    })
                    .collect(),
                waiting: parse_ranks(&v.waiting)
                    .map_err(|e| format!("verdicts[{i}].waiting: {e}"))?,
                missing: parse_ranks(&v.missing)
                    .map_err(|e| format!("verdicts[{i}].missing: {e}"))?,
                hosts: v.hosts,
                summary: v.summary,
            },
        ));
    }
    Ok(Here {
        wide,
        verdicts,
        values: super::positions::step_stats_from_pb(p.values)?,
        values_aggregated: p.values_aggregated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_survive_the_wire_and_bad_ones_name_the_field() {
        let mut sk = Sketch::default();
        sk.add(1e7);
        sk.add(1.3e7);
        let r = HostReport {
            host: "h".into(),
            relative_threshold: 1.1,
            z_threshold: 3.0,
            jobs: vec![JobPart {
                job: "j".into(),
                sections: vec![("forward".into(), sk)],
                scores: vec![Score {
                    job: "j".into(),
                    rank: 3,
                    host: "h".into(),
                    section: "forward".into(),
                    relative: 1.3,
                    flagged: true,
                    ..Score::default()
                }],
            }],
        };
        let (back, pos, _) = report_from_pb(report_pb(&r, &[], &[])).unwrap();
        assert_eq!(back, r);
        assert!(pos.is_empty());
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs[0].sections[0].counts.pop();
        let e = report_from_pb(bad).unwrap_err();
        assert!(
            e.contains("jobs[0].sections[0]: 2 keys but 1 counts"),
            "{e}"
        );
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs[0].sections[0].keys = vec![0; 5000];
        bad.jobs[0].sections[0].counts = vec![1; 5000];
        let e = report_from_pb(bad).unwrap_err();
        assert!(e.contains("5000 bins; at most 4096"), "{e}");
        let mut bad = report_pb(&r, &[], &[]);
        bad.z_threshold = f64::NAN;
        assert!(report_from_pb(bad).unwrap_err().contains("z_threshold"));
        let mut bad = report_pb(&r, &[], &[]);
        bad.jobs.push(bad.jobs[0].clone());
        assert!(report_from_pb(bad).unwrap_err().contains("appears twice"));
    }

    #[test]
    fn compact_rank_lists_round_trip_and_are_bounded() {
        let ranks = vec![0, 1, 2, 5, 7, 8];
        assert_eq!(parse_ranks(&culprit::ranks_list(&ranks)).unwrap(), ranks);
        assert!(parse_ranks("0-4294967295").is_err());
        assert!(parse_ranks("5-2").is_err());
        assert!(parse_ranks("x").is_err());
    }
}
