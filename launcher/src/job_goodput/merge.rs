//! One breakdown for a job spread over hosts: the sum of the hosts' own.
//!
//! Each agent accounts only the ranks it watches; a multi-host job's
//! launchers keep their host's report in etcd (`coord::reports`), and this
//! sums them. Ranks on different hosts are different ranks, so their
//! accelerator-seconds add: the parts still sum to the total and nothing is
//! counted twice. A restart is one event for the whole job, seen by every
//! host: restarts and saves take the most any host saw, as one host's
//! report already does over its ranks.

use std::collections::BTreeMap;

use warden_proto::v1 as pb;

/// The job-wide breakdown of `reports` (host id, that host's report of the
/// job); `None` when there is none. Per-occurrence means are weighted by
/// the ranks each host accounted.
pub fn merge(reports: &[(String, pb::JobGoodput)]) -> Option<pb::JobGoodput> {
    let (_, first) = reports.first()?;
    // Causes in the order the first host lists them, then any other.
    let mut order: Vec<String> = Vec::new();
    let mut secs: BTreeMap<String, f64> = BTreeMap::new();
    for (_, r) in reports {
        for p in &r.parts {
            if !secs.contains_key(&p.cause) {
                order.push(p.cause.clone());
            }
            *secs.entry(p.cause.clone()).or_default() += p.accelerator_seconds;
        }
    }
    let total: f64 = secs.values().sum();
    let share = |s: f64| if total > 0.0 { s / total } else { 0.0 };
    let parts: Vec<pb::GoodputPart> = order
        .iter()
        .map(|c| {
            let s = secs.get(c).copied().unwrap_or(0.0);
            pb::GoodputPart {
                cause: c.clone(),
                accelerator_seconds: s,
                fraction: share(s),
            }
        })
        .collect();
    let mut hosts: Vec<String> = reports.iter().map(|(h, _)| h.clone()).collect();
    hosts.sort();
    hosts.dedup();
    Some(pb::JobGoodput {
        job_id: first.job_id.clone(),
        goodput: share(secs.get("productive").copied().unwrap_or(0.0)),
        parts,
        wall_seconds: reports
            .iter()
            .map(|(_, r)| r.wall_seconds)
            .fold(0.0, f64::max),
        ranks: reports.iter().map(|(_, r)| r.ranks).sum(),
        accelerator_seconds: total,
        recovery: Some(recovery(reports)),
        open: reports.iter().any(|(_, r)| r.open),
        hosts,
    })
}

/// The hosts' recovery figures as one: means weighted by ranks, counts the
/// most any host saw.
fn recovery(reports: &[(String, pb::JobGoodput)]) -> pb::GoodputRecovery {
    let mean = |get: fn(&pb::GoodputRecovery) -> Option<f64>| -> Option<f64> {
        let (mut sum, mut weight) = (0.0, 0.0);
        for (_, r) in reports {
            if let Some(v) = r.recovery.as_ref().and_then(get) {
                let w = f64::from(r.ranks.max(1));
                sum += v * w;
                weight += w;
            }
        }
        (weight > 0.0).then(|| sum / weight)
    };
    let most = |get: fn(&pb::GoodputRecovery) -> u64| -> u64 {
        reports
            .iter()
            .filter_map(|(_, r)| r.recovery.as_ref().map(get))
            .max()
            .unwrap_or(0)
    };
    pb::GoodputRecovery {
        step_s: mean(|r| r.step_s),
        startup_s: mean(|r| r.startup_s),
        detection_s: mean(|r| r.detection_s),
        restart_downtime_s: mean(|r| r.restart_downtime_s),
        restore_s: mean(|r| r.restore_s),
        save_stall_s: mean(|r| r.save_stall_s),
        restarts: most(|r| r.restarts),
        saves: most(|r| r.saves),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(ranks: u32, productive: f64, restart: f64, step_s: f64, open: bool) -> pb::JobGoodput {
        let total = productive + restart;
        pb::JobGoodput {
            job_id: "j".into(),
            parts: vec![
                pb::GoodputPart {
                    cause: "productive".into(),
                    accelerator_seconds: productive,
                    fraction: productive / total,
                },
                pb::GoodputPart {
                    cause: "restart_downtime".into(),
                    accelerator_seconds: restart,
                    fraction: restart / total,
                },
            ],
            wall_seconds: total / f64::from(ranks),
            ranks,
            accelerator_seconds: total,
            goodput: productive / total,
            recovery: Some(pb::GoodputRecovery {
                step_s: Some(step_s),
                restarts: 1,
                saves: 4,
                ..Default::default()
            }),
            open,
            hosts: Vec::new(),
        }
    }

    #[test]
    fn hosts_add_up_and_shares_are_of_the_sum() {
        let j = merge(&[
            ("b".into(), host(2, 18.0, 2.0, 0.1, false)),
            ("a".into(), host(6, 50.0, 10.0, 0.3, true)),
        ])
        .unwrap();
        assert_eq!(j.ranks, 8);
        assert_eq!(j.hosts, vec!["a", "b"]);
        assert!((j.accelerator_seconds - 80.0).abs() < 1e-9);
        assert!((j.goodput - 68.0 / 80.0).abs() < 1e-9);
        let sum: f64 = j.parts.iter().map(|p| p.accelerator_seconds).sum();
        assert!((sum - j.accelerator_seconds).abs() < 1e-9);
        let fr: f64 = j.parts.iter().map(|p| p.fraction).sum();
        assert!((fr - 1.0).abs() < 1e-9);
        assert!((j.wall_seconds - 10.0).abs() < 1e-9, "{}", j.wall_seconds);
        assert!(j.open, "one host still running");
        let rec = j.recovery.unwrap();
        // (0.1 * 2 + 0.3 * 6) / 8
        assert!((rec.step_s.unwrap() - 0.25).abs() < 1e-9);
        assert_eq!((rec.restarts, rec.saves, rec.restore_s), (1, 4, None));
    }

    #[test]
    fn nothing_to_merge_is_none() {
        assert!(merge(&[]).is_none());
    }
}
