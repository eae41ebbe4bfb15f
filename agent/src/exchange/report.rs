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
//! lists the same set, so all agree). "Live": it answered; a candidate that
//! failed is skipped for three intervals, and every host tries the
//! candidates in the same order, so when the aggregator is lost the next
//! takes over within one interval plus `straggler.peer_timeout`, and a
//! returning one takes over again. When this agent is first it aggregates
//! its own report in place.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tonic::transport::{Channel, Endpoint};
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::JobValues;
use warden_core::detect::straggler::Stragglers;
use warden_core::detect::straggler::aggregate::Report;
use warden_proto::v1::peer_client::PeerClient;

use super::aggregate::{Here, aggregate_here};
use super::wire::{answer_from_pb, report_pb};
use crate::state::AgentState;
use crate::tls::connect::PeerConnector;

/// The aggregator candidates of `job` in order (addresses; this agent's
/// own is `me`).
fn candidates(state: &AgentState, job: &str, statics: &[String]) -> Vec<String> {
    if let Ok(ck) = &state.checkpoints {
        let order = ck.peers.order_of(job);
        if !order.is_empty() {
            return order;
        }
    }
    statics.to_vec()
}

/// One candidate and what is known of it.
#[derive(Debug, Default)]
struct Link {
    client: Option<PeerClient<Channel>>,
    /// When it last failed, and the failure logged.
    down: Option<(Instant, String)>,
}

/// Starts the task that reports to the aggregators every
/// `straggler.exchange_interval`, until the agent shuts down.
pub fn spawn_reports(state: Arc<AgentState>, det: Arc<Stragglers>) {
    tokio::spawn(report_loop(state, det));
}

async fn report_loop(state: Arc<AgentState>, det: Arc<Stragglers>) {
    let cfg = det.config().clone();
    let me = state.config.api.tcp.clone();
    let mut statics: Vec<String> = cfg.peers.clone();
    if !me.is_empty() {
        statics.push(me.clone());
    }
    statics.sort();
    statics.dedup();
    let mut links: HashMap<String, Link> = HashMap::new();
    let mut ticker = tokio::time::interval(cfg.exchange_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let skip_for = cfg.exchange_interval * 3;
    loop {
        tokio::select! {
            () = state.shutdown.cancelled() => return,
            _ = ticker.tick() => {}
            () = state.hang_board.exchange_now.notified() => {}
        }
        let report = det.report(Instant::now());
        let positions = state.hang_board.outbox();
        let values = if state.config.sdc.enabled {
            state.peer_values.outbox()
        } else {
            Vec::new()
        };
        // Jobs by their candidate list: one call per aggregator.
        let mut groups: BTreeMap<Vec<String>, Group> = BTreeMap::new();
        let empty = || Report {
            host: report.host.clone(),
            relative_threshold: report.relative_threshold,
            z_threshold: report.z_threshold,
            jobs: Vec::new(),
        };
        for j in &report.jobs {
            let c = candidates(&state, &j.job, &statics);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .0
                .jobs
                .push(j.clone());
        }
        for p in &positions {
            let c = candidates(&state, &p.job, &statics);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .1
                .push(p.clone());
        }
        let worlds = job_worlds(&state);
        for mut v in values {
            let c = candidates(&state, &v.job, &statics);
            v.world = worlds.get(&v.job).copied().unwrap_or(0);
            groups
                .entry(c)
                .or_insert_with(|| (empty(), Vec::new(), Vec::new()))
                .2
                .push(v);
        }
        let mut calls = JoinSet::new();
        let now = Instant::now();
        for (order, (mut rep, mut pos, vals)) in groups {
            if order.is_empty() {
                // No candidate at all (no peers, no api.tcp, nothing handed
                // over): the values are judged here, in place; the
                // straggler part and positions have nobody to go to.
                if vals.is_empty() {
                    continue;
                }
                rep.jobs.clear();
                pos.clear();
                let state = state.clone();
                let limit = cfg.peer_timeout;
                let plan = vec![(String::new(), None)];
                calls.spawn(async move { send(&state, plan, rep, pos, vals, limit).await });
                continue;
            }
            // The first candidate not known down (all down: try them all).
            let up: Vec<String> = order
                .iter()
                .filter(|a| {
                    links
                        .get(*a)
                        .and_then(|l| l.down.as_ref())
                        .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= skip_for)
                })
                .cloned()
                .collect();
            let tries = if up.is_empty() { order } else { up };
            let mut plan = Vec::new();
            for addr in tries {
                if addr == me || addr.is_empty() {
                    plan.push((addr, None));
                    break;
                }
                let link = links.entry(addr.clone()).or_default();
                if link.client.is_none() {
                    link.client = client_for(&state, &addr, &cfg);
                }
                plan.push((addr, link.client.clone()));
            }
            if order_is_local_only(&plan)
                && rep.jobs.is_empty()
                && pos.is_empty()
                && vals.is_empty()
            {
                continue;
            }
            let state = state.clone();
            let limit = cfg.peer_timeout;
            calls.spawn(async move { send(&state, plan, rep, pos, vals, limit).await });
        }
        let stop = state.shutdown.clone();
        loop {
            let joined = tokio::select! {
                () = stop.cancelled() => return,
                j = calls.join_next() => j,
            };
            let Some(joined) = joined else { break };
            let Ok(outcome) = joined else { continue };
            for (addr, err) in outcome.failed {
                let link = links.entry(addr.clone()).or_default();
                metrics::counter!("warden_straggler_exchanges_total", "result" => "error")
                    .increment(1);
                if link.down.is_none() {
                    tracing::warn!(
                        aggregator = %addr,
                        error = %err,
                        "straggler aggregator unreachable; the next in order takes over (logged once)"
                    );
                }
                link.down = Some((Instant::now(), err));
            }
            if let Some(addr) = outcome.answered {
                metrics::counter!("warden_straggler_exchanges_total", "result" => "ok")
                    .increment(1);
                if let Some(l) = links.get_mut(&addr)
                    && l.down.take().is_some()
                {
                    tracing::info!(aggregator = %addr, "straggler aggregator answers again");
                }
            }
            let now = Instant::now();
            let Some(here) = outcome.here else { continue };
            for w in here.wide {
                det.take_job_wide(w, now);
            }
            for (job, at, v) in here.verdicts {
                state.hang_board.announce(&job, at, v);
            }
            if here.values_aggregated {
                state.peer_values.receive(here.values);
            } else {
                // An older aggregator (or one with sdc off): judged with
                // this host's ranks alone.
                state.peer_values.alone(outcome.value_jobs);
            }
        }
    }
}

fn order_is_local_only(plan: &[(String, Option<PeerClient<Channel>>)]) -> bool {
    plan.iter().all(|(_, c)| c.is_none())
}

/// A client for an aggregator at `addr`: a job's peer's (handed over) or
/// one dialed by address (its certificate's name is remembered, so that
/// its own reports are taken).
fn client_for(
    state: &AgentState,
    addr: &str,
    cfg: &warden_core::detect::straggler::StragglerConfig,
) -> Option<PeerClient<Channel>> {
    if let Ok(ck) = &state.checkpoints
        && let Some(p) = ck.peers.find(addr)
    {
        return Some(p.client);
    }
    Endpoint::from_shared(format!("http://{addr}"))
        .map(|e| {
            PeerClient::new(
                e.connect_timeout(cfg.peer_timeout)
                    .timeout(cfg.peer_timeout)
                    .connect_with_connector_lazy(
                        PeerConnector::new(state.peer_tls.clone(), "")
                            .recording(state.straggler_peers_seen.clone()),
                    ),
            )
        })
        .map_err(|e| tracing::warn!(peer = %addr, error = %e, "unusable aggregator address"))
        .ok()
}

/// One aggregator's share of a report: straggler part, positions, values.
type Group = (Report, Vec<JobPositions>, Vec<JobValues>);

/// The world size of each of this host's jobs, as its ranks registered it.
fn job_worlds(state: &AgentState) -> HashMap<String, u32> {
    let reg = state.registry();
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
    here: Option<Here>,
    /// The jobs whose values the report carried.
    value_jobs: Vec<String>,
}

/// Tries the candidates in `plan` in order until one answers (None: this
/// agent, aggregating in place).
async fn send(
    state: &Arc<AgentState>,
    plan: Vec<(String, Option<PeerClient<Channel>>)>,
    report: Report,
    positions: Vec<JobPositions>,
    values: Vec<JobValues>,
    limit: Duration,
) -> Outcome {
    let mut out = Outcome {
        value_jobs: values.iter().map(|v| v.job.clone()).collect(),
        ..Outcome::default()
    };
    let wire = report_pb(&report, &positions, &values);
    for (addr, client) in plan {
        let Some(mut client) = client else {
            match aggregate_here(state, report, positions, values) {
                Ok(here) => out.here = Some(here),
                Err(e) => tracing::warn!(error = %e, "this agent's own report was refused"),
            }
            return out;
        };
        let r = tokio::time::timeout(limit, client.report_to_aggregator(wire.clone())).await;
        let r = match r {
            Err(_) => Err(format!(
                "no answer within {}",
                humantime::format_duration(limit)
            )),
            Ok(Err(s)) => Err(format!("{}: {}", s.code(), s.message())),
            Ok(Ok(resp)) => {
                answer_from_pb(resp.into_inner()).map_err(|e| format!("bad answer: {e}"))
            }
        };
        match r {
            Ok(here) => {
                out.answered = Some(addr);
                out.here = Some(here);
                return out;
            }
            Err(e) => out.failed.push((addr, e)),
        }
    }
    out
}
