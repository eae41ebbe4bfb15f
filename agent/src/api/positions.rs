//! Rank positions on the wire (`warden.v1.JobPositions`), both ways, for
//! the job-wide hang verdict: a peer's batch is checked here, and bad
//! input is refused naming the field.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use warden_core::detect::culprit::{GroupSeq, MAX_GROUPS, MAX_NAME, MAX_POSITIONS, Position};
use warden_core::detect::positions::{JobPositions, MAX_JOBS};
use warden_proto::v1 as pb;

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
}
