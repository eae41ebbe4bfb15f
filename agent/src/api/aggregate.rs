//! The job-wide exchange at the edge: `ReportToAggregator`, the
//! `warden.v1.Peer` call a host's report reaches its aggregator by. It
//! decodes the report (bad input named, INVALID_ARGUMENT), authorizes the
//! caller (it speaks only for its own host and for jobs it is a member
//! of; a group leader that relays speaks for a member of its group), and
//! then either relays the report (this agent leads a group of the
//! two-level tree: [`crate::exchange::relay`]) or hands it to the
//! aggregator's use case ([`crate::exchange::aggregate`]) and maps its
//! answer; a report
//! past a limit is RESOURCE_EXHAUSTED naming the limit. The reporting task
//! is `exchange::report`.

use std::net::SocketAddr;
use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use super::peer_auth::Caller;
use crate::exchange::aggregate::aggregate_here;
use crate::exchange::relay::{RelayError, relay};
use crate::exchange::wire::{answer_pb, report_from_pb};
use crate::state::AgentState;

/// Serves `ReportToAggregator` (the Peer service calls it).
pub async fn report_to_aggregator(
    state: &Arc<AgentState>,
    caller: &Caller,
    remote: Option<SocketAddr>,
    req: pb::AggregateReport,
) -> Result<pb::AggregateAnswer, Status> {
    if !state.config.straggler.enabled {
        return Err(Status::failed_precondition(format!(
            "straggler detection is off on {} (straggler.enabled = false)",
            state.host
        )));
    }
    let relayed = req.relayed;
    // A report from a member of this agent's group goes on to the
    // aggregator (a relayed one never again). Every job of one report has
    // the same hosts to try at the sender, so its first job decides.
    let relay_plan = if relayed {
        None
    } else {
        first_job(&req).and_then(|job| {
            let skip_for = state.config.straggler.exchange_interval * 3;
            state.exchange.routes.relay_plan(job, skip_for)
        })
    };
    let forward = relay_plan.as_ref().map(|_| req.clone());
    let (report, positions, values) = report_from_pb(req)
        .map_err(|e| Status::invalid_argument(format!("aggregate report: {e}")))?;
    if report.host == state.host {
        return Err(Status::failed_precondition(format!(
            "the report comes from host {:?}, this agent's own name: give each agent its own \
             agent.host_name",
            report.host
        )));
    }
    let known = super::stragglers::known_peer(state, caller)
        || (caller.identity().is_some()
            && from_configured_peer(&state.config.straggler.peers, remote));
    if relayed {
        super::peer_auth::relay(caller, known)?;
    } else {
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
    if let (Some(plan), Some(forward)) = (relay_plan, forward) {
        let limit = state.config.straggler.peer_timeout;
        return relay(
            &state.exchange,
            plan,
            forward,
            (report, positions, values),
            limit,
        )
        .await
        .map_err(|e| match e {
            RelayError::Refused(e) => Status::resource_exhausted(format!("aggregate report: {e}")),
            RelayError::NoneAnswered(e) => Status::aborted(e),
        });
    }
    let here = aggregate_here(&state.exchange, report, positions, values)
        .map_err(|e| Status::resource_exhausted(format!("aggregate report: {e}")))?;
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
