//! The job-wide exchange at the edge: `ReportToAggregator`, the
//! `warden.v1.Peer` call a host's report reaches its aggregator by. It
//! decodes the report (bad input named, INVALID_ARGUMENT), authorizes the
//! caller (it speaks only for its own host and for jobs it is a member
//! of; a group leader that relays speaks for a member of its group), and
//! then either relays the report (this agent leads a group of the
//! two-level tree: [`crate::peer_link::exchange::relay`]) or hands it to the
//! aggregator's use case ([`crate::exchange::aggregate`]) and maps its
//! answer; a report
//! past a limit is RESOURCE_EXHAUSTED naming the limit. A leader relays
//! through its batches ([`crate::peer_link::exchange::batch`]) unless
//! `straggler.relay_batch_window` is 0. `ReportBatchToAggregator`, a
//! leader's batch, is taken here report by report, each as a relayed
//! `ReportToAggregator` and answered in its own item. The reporting task
//! is `exchange::report`.

use std::net::SocketAddr;
use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use super::peer_auth::Caller;
use crate::exchange::aggregate::{aggregate_here, answer_batch, fold};
use crate::peer_link::exchange::batch::Batches;
use crate::peer_link::exchange::call::{AGGREGATOR_REFUSED, report_refused};
use crate::peer_link::exchange::positions::step_stat_pb;
use crate::peer_link::exchange::relay::{Decoded, RelayError, relay};
use crate::peer_link::exchange::wire::{answer_pb, job_stats_pb, report_from_pb};
use crate::state::AgentState;

/// Serves `ReportToAggregator` (the Peer service calls it).
pub async fn report_to_aggregator(
    state: &Arc<AgentState>,
    caller: &Caller,
    remote: Option<SocketAddr>,
    req: pb::AggregateReport,
) -> Result<pb::AggregateAnswer, Status> {
    detector_on(state)?;
    let relayed = req.relayed;
    // A report from a member of this agent's group goes on to the
    // aggregator (a relayed one never again). Every job of one report has
    // the same hosts to try at the sender, so its first job decides.
    let relay_plan = if relayed {
        None
    } else {
        first_job(&req).and_then(|job| {
            let skip_for = state.config.straggler.exchange_interval * 3;
            state
                .exchange
                .routes
                .relay_plan(job, skip_for)
                .map(|plan| (job.to_owned(), plan))
        })
    };
    let forward = relay_plan.as_ref().map(|_| req.clone());
    let known = known(state, caller, remote);
    if relayed {
        super::peer_auth::relay(caller, known)?;
    }
    let decoded = admit(state, caller, known, req)?;
    if let (Some((job, plan)), Some(forward)) = (relay_plan, forward) {
        let ex = &state.exchange;
        let relayed = if ex.relay_batch_wait.is_zero() {
            relay(ex, plan, forward, decoded, ex.relay_limit).await
        } else {
            Batches::submit(ex, &state.relay_batches, job, plan, forward, decoded).await
        };
        return relayed.map_err(|e| match e {
            RelayError::Refused(e) => Status::resource_exhausted(report_refused(e)),
            RelayError::NoneAnswered(e) => Status::aborted(e),
            RelayError::Aggregator { code, message } => Status::new(
                tonic::Code::from_i32(code),
                format!("{AGGREGATOR_REFUSED}: {message}"),
            ),
        });
    }
    take(state, decoded)
}

/// Serves `ReportBatchToAggregator`: a group leader's members' reports in
/// one call, each taken as a relayed `ReportToAggregator` and answered in
/// its own item (a report refused alone does not refuse the others).
pub async fn report_batch_to_aggregator(
    state: &Arc<AgentState>,
    caller: &Caller,
    remote: Option<SocketAddr>,
    req: pb::AggregateBatch,
) -> Result<pb::AggregateBatchAnswer, Status> {
    detector_on(state)?;
    if req.reports.len() > MAX_BATCH {
        return Err(Status::resource_exhausted(format!(
            "aggregate batch: {} reports, more than the {MAX_BATCH} one call may carry",
            req.reports.len()
        )));
    }
    let known = known(state, caller, remote);
    super::peer_auth::relay(caller, known)?;
    // Every report first, then the answers ([`answer_batch`]).
    let mut folded = Vec::with_capacity(req.reports.len());
    for (i, mut report) in req.reports.into_iter().enumerate() {
        // A batch of thousands holds a worker for tens of ms: let the
        // agent's other tasks run between every 64 reports.
        if i > 0 && i % 64 == 0 {
            tokio::task::yield_now().await;
        }
        report.relayed = true;
        folded.push(admit(state, caller, known, report).and_then(|(r, p, v)| {
            fold(&state.exchange, r, p, v)
                .map_err(|e| Status::resource_exhausted(report_refused(e)))
        }));
    }
    let batch = answer_batch(&state.exchange, folded, req.shared_steps, |item| {
        pb::AggregateBatchItem {
            outcome: Some(pb::aggregate_batch_item::Outcome::Answer(answer_pb(
                &state.host,
                &item.answer,
            ))),
            jobs: item.jobs,
            values: item
                .steps
                .into_iter()
                .map(|steps| pb::StepRefs { steps })
                .collect(),
        }
    });
    let items = batch
        .items
        .into_iter()
        .map(|item| match item {
            Ok(item) => item,
            Err(s) => pb::AggregateBatchItem {
                outcome: Some(pb::aggregate_batch_item::Outcome::Error(
                    pb::BatchItemError {
                        code: s.code() as i32,
                        message: s.message().to_owned(),
                    },
                )),
                jobs: Vec::new(),
                values: Vec::new(),
            },
        })
        .collect();
    Ok(pb::AggregateBatchAnswer {
        items,
        jobs: batch.jobs.iter().map(job_stats_pb).collect(),
        steps: batch
            .steps
            .iter()
            .map(|(job, s)| pb::SharedStep {
                job_id: job.clone(),
                step: Some(step_stat_pb(s)),
            })
            .collect(),
    })
}

/// The most reports one `ReportBatchToAggregator` may carry (a leader's
/// group is at most the square root of the job's hosts by default; a
/// larger `straggler.aggregator_fan_out` is cut into several batches).
pub const MAX_BATCH: usize = crate::peer_link::exchange::batch::MAX_BATCH;

/// FAILED_PRECONDITION where the detector is off.
fn detector_on(state: &AgentState) -> Result<(), Status> {
    if state.config.straggler.enabled {
        return Ok(());
    }
    Err(Status::failed_precondition(format!(
        "straggler detection is off on {} (straggler.enabled = false)",
        state.host
    )))
}

/// Whether the caller is a peer this agent takes reports from: one it
/// dialed or a job's checkpoint peer, or with `straggler.peers` set any
/// agent the cluster CA signed.
fn known(state: &AgentState, caller: &Caller, remote: Option<SocketAddr>) -> bool {
    super::stragglers::known_peer(state, caller)
        || (caller.identity().is_some()
            && from_configured_peer(&state.config.straggler.peers, remote))
}

/// Decodes `req` (INVALID_ARGUMENT naming the field) and authorizes it:
/// not this agent's own name; its host the caller's own, or, relayed, a
/// member of each job it names (the caller's relaying itself is checked
/// once per call by [`super::peer_auth::relay`]); the caller a member of
/// each job it names, where this agent was handed the job's members.
fn admit(
    state: &AgentState,
    caller: &Caller,
    known: bool,
    req: pb::AggregateReport,
) -> Result<Decoded, Status> {
    let relayed = req.relayed;
    let (report, positions, values) =
        report_from_pb(req).map_err(|e| Status::invalid_argument(report_refused(e)))?;
    if report.host == state.host {
        return Err(Status::failed_precondition(format!(
            "the report comes from host {:?}, this agent's own name: give each agent its own \
             agent.host_name",
            report.host
        )));
    }
    if !relayed {
        super::peer_auth::straggler(caller, &report.host, known)?;
    }
    // A peer speaks only for jobs it is a member of, where this agent
    // knows the job's members (handed over by its launchers); a static
    // fleet's jobs are known to nobody and any known peer may report.
    if let Ok(ck) = &state.checkpoints {
        let named = report
            .jobs
            .iter()
            .map(|j| &j.job)
            .chain(positions.iter().map(|p| &p.job))
            .chain(values.iter().map(|v| &v.job));
        for job in named {
            if ck.peers.with_order(job, |o, _| o.is_empty()) {
                continue;
            }
            let member = |n: &str| ck.peers.is_member_name(job, n);
            super::peer_auth::job_member(caller, job, member)?;
            if relayed {
                super::peer_auth::relayed_for(caller, &report.host, job, member)?;
            }
        }
    }
    Ok((report, positions, values))
}

/// Aggregates an admitted report here and answers it (a limit passed:
/// RESOURCE_EXHAUSTED naming it).
fn take(
    state: &AgentState,
    (report, positions, values): Decoded,
) -> Result<pb::AggregateAnswer, Status> {
    let here = aggregate_here(&state.exchange, report, positions, values)
        .map_err(|e| Status::resource_exhausted(report_refused(e)))?;
    Ok(answer_pb(&state.host, &here))
}

/// The job a report names first.
fn first_job(req: &pb::AggregateReport) -> Option<&str> {
    req.jobs
        .first()
        .map(|j| j.job_id.as_str())
        .or_else(|| req.positions.first().map(|p| p.job_id.as_str()))
        .or_else(|| req.values.first().map(|v| v.job_id.as_str()))
}

/// Whether a static fleet's aggregator takes this caller: with
/// `straggler.peers` configured, any agent whose certificate the cluster CA
/// signed (the caller's identity is proved; it reports only for its own
/// host). The aggregator is called by peers it never dialed itself, so the
/// legacy rule (only agents it dialed) cannot hold; docs/security.md.
fn from_configured_peer(peers: &[String], _remote: Option<SocketAddr>) -> bool {
    !peers.is_empty()
}
