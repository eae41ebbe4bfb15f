//! The straggler detector at the edge: GetStragglers and the
//! ExchangeStragglerSummaries call of `warden.v1.Peer` (older agents'
//! summaries; the service itself is `api::peer_service`, the aggregator's
//! report `api::aggregate`). No task calls every peer any more: the last
//! all-to-all (SDC values) went to the aggregator with issue 30.
//!
//! ExchangeStragglerSummaries is decoded and taken by the exchange
//! (`peer_link::exchange::legacy`); here its caller is authorized (a host speaks only
//! for itself) and bad input becomes a gRPC status.

use std::time::Instant;

use tonic::Status;
use warden_proto::v1 as pb;

use super::peer_auth::Caller;
use crate::peer_link::exchange::legacy;
use crate::peer_link::exchange::wire::score_pb;
use crate::state::AgentState;

/// Answers GetStragglers from the agent's straggler scores: its own ranks'
/// and its peers', job-wide.
pub fn get_stragglers(
    state: &AgentState,
    req: pb::GetStragglersRequest,
) -> pb::GetStragglersResponse {
    let Some(det) = state.stragglers_if_made() else {
        return pb::GetStragglersResponse {
            ranks: Vec::new(),
            hosts: vec![state.host.clone()],
        };
    };
    let (scores, hosts) = det.scores(&req.job_id, req.flagged_only, Instant::now());
    pb::GetStragglersResponse {
        ranks: scores.iter().map(score_pb).collect(),
        hosts,
    }
}

/// Whether `caller` is a peer this agent knows by its certificate: one it
/// exchanged with, or a checkpoint peer.
pub(super) fn known_peer(state: &AgentState, caller: &Caller) -> bool {
    caller.identity().is_some_and(|id| {
        state.straggler_peers_seen.contains(id)
            || state
                .checkpoints
                .as_ref()
                .is_ok_and(|ck| ck.peers.knows(id))
    })
}

/// ExchangeStragglerSummaries: an older agent's summaries, positions and
/// values taken (checked, naming the field), answered with this agent's
/// (all of them to an older agent, its values alone to a newer one).
pub fn exchange(
    state: &AgentState,
    caller: &Caller,
    req: pb::StragglerSummaries,
) -> Result<pb::StragglerSummaries, Status> {
    if !state.config.straggler.enabled {
        return Err(Status::failed_precondition(format!(
            "straggler detection is off on {} (straggler.enabled = false)",
            state.host
        )));
    }
    let taken = legacy::decode(req)
        .map_err(|e| Status::invalid_argument(format!("straggler summaries: {e}")))?;
    if taken.host() == state.host {
        return Err(Status::failed_precondition(format!(
            "the summaries come from host {:?}, this agent's own name: give each agent \
             its own agent.host_name, and do not list an agent among its own peers",
            taken.host()
        )));
    }
    super::peer_auth::straggler(caller, taken.host(), known_peer(state, caller))?;
    Ok(legacy::take(&state.exchange, &state.stragglers(), taken))
}
