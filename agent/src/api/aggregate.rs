//! The job-wide exchange at the edge: `ReportToAggregator`, the
//! `warden.v1.Peer` call a host's report reaches its aggregator by. It
//! decodes the report (bad input named, INVALID_ARGUMENT), authorizes the
//! caller (it speaks only for its own host and for jobs it is a member
//! of), hands the report to the aggregator's use case
//! ([`crate::exchange::aggregate`]) and maps its answer; a report past a
//! limit is RESOURCE_EXHAUSTED naming the limit. The reporting task is
//! `exchange::report`.

use std::net::SocketAddr;
use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use super::peer_auth::Caller;
use crate::exchange::aggregate::aggregate_here;
use crate::exchange::wire::{answer_pb, report_from_pb};
use crate::state::AgentState;

/// Serves `ReportToAggregator` (the Peer service calls it).
pub fn report_to_aggregator(
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
    super::peer_auth::straggler(caller, &report.host, known)?;
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
            if !ck.peers.order_of(job).is_empty() {
                super::peer_auth::job_member(caller, job, &ck.peers.names_of_job(job))?;
            }
        }
    }
    let here = aggregate_here(state, report, positions, values)
        .map_err(|e| Status::resource_exhausted(format!("aggregate report: {e}")))?;
    Ok(answer_pb(&state.host, &here))
}

/// Whether a static fleet's aggregator takes this caller: with
/// `straggler.peers` configured, any agent whose certificate the cluster CA
/// signed (the caller's identity is proved; it reports only for its own
/// host). The aggregator is called by peers it never dialed itself, so the
/// legacy rule (only agents it dialed) cannot hold; docs/security.md.
fn from_configured_peer(peers: &[String], _remote: Option<SocketAddr>) -> bool {
    !peers.is_empty()
}
