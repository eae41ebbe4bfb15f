//! The task that reports this host's part to each job's aggregator every
//! `straggler.exchange_interval`, and at once when a hang snapshot is
//! taken, and hands the answers to the detector, the hang board and the
//! SDC values.
//!
//! Never: a call to every peer (one per aggregator reached, a few when the
//! first ones are down); a wait on the work loop (each call is bounded by
//! `straggler.peer_timeout` and runs in a task of its own).
//!
//! Who aggregates: for a job handed over by its launchers
//! (`SetCheckpointPeers`), the first live agent of its peer list in node
//! rank order; for the rest, the first live one of `straggler.peers` and
//! this agent's `api.tcp` sorted as strings (every host of a static fleet
//! lists the same set, so all agree). A job of more hosts than one group
//! (`straggler.aggregator_fan_out`, by default the square root of its
//! hosts, at least 32) reports through its group's leader, which relays
//! (`exchange::routes`, the tree in `warden_core::detect::straggler::tree`).
//! "Live": it answered; a host that failed is skipped for three intervals,
//! and every host tries in the same order, so when the aggregator or a
//! leader is lost the next takes over within one interval plus
//! `straggler.peer_timeout`, and a returning one takes over again. When
//! this agent is reached it aggregates its own report in place.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::JobValues;
use warden_core::detect::straggler::Stragglers;
use warden_core::detect::straggler::aggregate::HostReport;

use super::Exchange;
use super::aggregate::{Here, aggregate_here};
use super::link::CallFailed;
use super::routes::Hop;

/// Starts the task that reports to the aggregators every
/// `straggler.exchange_interval`, until the agent shuts down.
pub fn spawn_reports(ex: Arc<Exchange>, det: Arc<Stragglers>) {
    tokio::spawn(report_loop(ex, det));
}

async fn report_loop(ex: Arc<Exchange>, det: Arc<Stragglers>) {
    let cfg = det.config().clone();
    let mut ticker = tokio::time::interval(cfg.exchange_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let skip_for = cfg.exchange_interval * 3;
    loop {
        tokio::select! {
            () = ex.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            () = ex.hang_board.exchange_now.notified() => {}
        }
        let report = det.report(Instant::now());
        let positions = ex.hang_board.outbox();
        let values = if ex.sdc_enabled {
            ex.peer_values.outbox()
        } else {
            Vec::new()
        };
        // Jobs by the hosts to try: one call per aggregator or leader.
        let mut groups: BTreeMap<Vec<String>, (Vec<Hop>, Group)> = BTreeMap::new();
        let mut plans: HashMap<String, Vec<Hop>> = HashMap::new();
        let mut plan_of = |job: &str| {
            plans
                .entry(job.to_owned())
                .or_insert_with(|| ex.routes.plan(job, skip_for))
                .clone()
        };
        let empty = || HostReport {
            host: report.host.clone(),
            relative_threshold: report.relative_threshold,
            z_threshold: report.z_threshold,
            jobs: Vec::new(),
        };
        for j in &report.jobs {
            group_of(&mut groups, plan_of(&j.job), empty)
                .0
                .jobs
                .push(j.clone());
        }
        for p in &positions {
            group_of(&mut groups, plan_of(&p.job), empty)
                .1
                .push(p.clone());
        }
        let worlds = job_worlds(&ex);
        for mut v in values {
            v.world = worlds.get(&v.job).copied().unwrap_or(0);
            group_of(&mut groups, plan_of(&v.job), empty).2.push(v);
        }
        let mut calls = JoinSet::new();
        for (plan, (mut rep, mut pos, vals)) in groups.into_values() {
            if plan.is_empty() {
                // No candidate at all (no peers, no api.tcp, nothing handed
                // over): the values are judged here, in place; the
                // straggler part and positions have nobody to go to.
                if vals.is_empty() {
                    continue;
                }
                rep.jobs.clear();
                pos.clear();
                let ex = ex.clone();
                let limit = cfg.peer_timeout;
                let plan = vec![Hop {
                    addr: String::new(),
                    link: None,
                    relays: false,
                }];
                calls.spawn(async move { send(&ex, plan, rep, pos, vals, limit).await });
                continue;
            }
            if plan.iter().all(|h| h.link.is_none())
                && rep.jobs.is_empty()
                && pos.is_empty()
                && vals.is_empty()
            {
                continue;
            }
            let ex = ex.clone();
            let limit = cfg.peer_timeout;
            calls.spawn(async move { send(&ex, plan, rep, pos, vals, limit).await });
        }
        let stop = ex.shutdown.clone();
        loop {
            let joined = tokio::select! {
                () = stop.cancelled() => return,
                j = calls.join_next() => j,
            };
            let Some(joined) = joined else { break };
            let Ok(outcome) = joined else { continue };
            for (addr, err) in outcome.failed {
                metrics::counter!("warden_straggler_exchanges_total", "result" => "error")
                    .increment(1);
                ex.routes.note_failed(&addr, err, "this host");
            }
            if let Some((addr, err)) = outcome.relay_failed {
                // The leader is up; the aggregator behind it was not
                // reached. The leader skips it from now on.
                metrics::counter!("warden_straggler_exchanges_total", "result" => "relay_failed")
                    .increment(1);
                tracing::debug!(leader = %addr, error = %err, "the group leader could not relay this report");
            }
            if let Some((addr, err)) = outcome.refused {
                // A limit or a rule of the aggregator's, for this host's
                // report: the operator's to see, not a host to skip.
                metrics::counter!("warden_straggler_exchanges_total", "result" => "refused")
                    .increment(1);
                tracing::warn!(host = %addr, error = %err, "the job's aggregator refused this host's report");
            }
            if let Some(addr) = outcome.answered {
                metrics::counter!("warden_straggler_exchanges_total", "result" => "ok")
                    .increment(1);
                ex.routes.note_answered(&addr);
            }
            let now = Instant::now();
            let Some(here) = outcome.here else { continue };
            for w in here.wide {
                det.take_job_wide(w, now);
            }
            for (job, at, v) in here.verdicts {
                ex.hang_board.announce(&job, at, v);
            }
            if here.values_aggregated {
                ex.peer_values.receive(here.values);
            } else {
                // An older aggregator (or one with sdc off): judged with
                // this host's ranks alone.
                ex.peer_values.alone(outcome.value_jobs);
            }
        }
    }
}

/// The share of the report that goes by `plan` (one call for every job
/// whose hosts to try are the same).
fn group_of(
    groups: &mut BTreeMap<Vec<String>, (Vec<Hop>, Group)>,
    plan: Vec<Hop>,
    empty: impl FnOnce() -> HostReport,
) -> &mut Group {
    let key = plan.iter().map(|h| h.addr.clone()).collect();
    &mut groups
        .entry(key)
        .or_insert_with(|| (plan, (empty(), Vec::new(), Vec::new())))
        .1
}

/// One aggregator's share of a report: straggler part, positions, values.
type Group = (HostReport, Vec<JobPositions>, Vec<JobValues>);

/// The world size of each of this host's jobs, as its ranks registered it.
fn job_worlds(ex: &Exchange) -> HashMap<String, u32> {
    let reg = ex.registry.lock();
    reg.ranks
        .iter()
        .map(|(k, r)| (k.job.clone(), r.world_size))
        .collect()
}

/// What one report's tries came to.
#[derive(Debug, Default)]
struct Outcome {
    answered: Option<String>,
    failed: Vec<(String, String)>,
    /// A leader that is up but could not relay (it answered ABORTED,
    /// [`RELAY_FAILED`](super::routes::RELAY_FAILED)).
    relay_failed: Option<(String, String)>,
    /// A leader whose aggregator refused this report alone (it answered
    /// [`AGGREGATOR_REFUSED`](super::routes::AGGREGATOR_REFUSED)), or a
    /// host that refused it for the report's own sake
    /// ([`REPORT_REFUSED`](super::routes::REPORT_REFUSED)): all are up,
    /// none is skipped.
    refused: Option<(String, String)>,
    here: Option<Here>,
    /// The jobs whose values the report carried.
    value_jobs: Vec<String>,
}

/// Tries the hosts in `plan` in order until one answers (no client: this
/// agent, aggregating in place). A leader's answer may take two calls, so
/// it is given twice `limit`; a leader that answers that it could not relay
/// ends the tries (it is up: the next interval it relays elsewhere).
async fn send(
    ex: &Arc<Exchange>,
    plan: Vec<Hop>,
    report: HostReport,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
    limit: Duration,
) -> Outcome {
    let mut out = Outcome {
        value_jobs: values.iter().map(|v| v.job.clone()).collect(),
        ..Outcome::default()
    };
    for Hop { addr, link, relays } in plan {
        let Some(link) = link else {
            match aggregate_here(ex, report, positions, values) {
                Ok(here) => out.here = Some(here),
                Err(e) => tracing::warn!(error = %e, "this agent's own report was refused"),
            }
            return out;
        };
        let limit = if relays { limit * 2 } else { limit };
        match link.report(&report, &positions, &values, limit).await {
            Ok(here) => {
                out.answered = Some(addr);
                out.here = Some(here);
                return out;
            }
            Err(CallFailed::RelayFailed(why)) => {
                out.relay_failed = Some((addr, why));
                return out;
            }
            // The aggregator (behind a leader) or the host itself refused
            // the report for its own sake: it is up, and the next would
            // refuse it too.
            Err(CallFailed::AggregatorRefused(why) | CallFailed::ReportRefused(why)) => {
                out.refused = Some((addr, why));
                return out;
            }
            Err(e) => out.failed.push((addr, e.to_string())),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    use crate::peer_link::exchange::batch::tests::{Aggregating, exchange, serve};

    /// This host's report sent to `first`, which refuses it saying `why`,
    /// with `next` behind it: nothing is noted failed, the refusal is
    /// kept, and `next` is not tried.
    async fn refused_by_the_first(first: Aggregating, next: Aggregating, why: &str) {
        let dir = tempfile::tempdir().unwrap();
        let ex = exchange(dir.path());
        let (first, next) = (Arc::new(first), Arc::new(next));
        let plan = vec![serve(first.clone()).await, serve(next.clone()).await];
        let report = HostReport {
            host: "leader".into(),
            relative_threshold: 1.06,
            z_threshold: 4.0,
            jobs: Vec::new(),
        };
        let out = send(
            &ex,
            plan,
            report,
            Vec::new(),
            Vec::new(),
            Duration::from_secs(5),
        )
        .await;
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        let (_, said) = out.refused.expect("refused");
        assert!(said.contains(why), "{said}");
        assert!(out.here.is_none() && out.answered.is_none());
        assert_eq!(first.singles.load(Ordering::SeqCst), 1);
        assert_eq!(
            next.singles.load(Ordering::SeqCst),
            0,
            "no other host tried"
        );
    }

    /// A leader whose aggregator refused this host's report alone: the
    /// member skips neither (nothing is noted failed) and tries no other
    /// host for the report, where the same rule would refuse it.
    #[tokio::test]
    async fn a_report_the_aggregator_refused_alone_skips_no_host() {
        let leader = Aggregating {
            leader: true,
            refuse: "leader".into(),
            ..Default::default()
        };
        let next = Aggregating {
            leader: true,
            ..Default::default()
        };
        refused_by_the_first(leader, next, "not leader's to relay").await;
    }

    /// The aggregator itself refused this host's report for the report's
    /// own sake (a limit): nothing is noted failed and no other host is
    /// tried, as when a leader hands such a refusal back.
    #[tokio::test]
    async fn a_report_refused_for_its_own_sake_skips_no_host() {
        let agg = Aggregating {
            refuse: "leader".into(),
            ..Default::default()
        };
        refused_by_the_first(agg, Aggregating::default(), "already keeps 1024 jobs").await;
    }
}
