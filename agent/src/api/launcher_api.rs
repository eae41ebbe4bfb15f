//! WatchIncidents and StopRanks: what `warden run` needs from the agent (being written).

use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use super::service::BoxStream;
use crate::state::AgentState;

/// WatchIncidents.
pub async fn watch_incidents(
    _state: &Arc<AgentState>,
    _req: pb::WatchIncidentsRequest,
) -> Result<BoxStream<pb::Incident>, Status> {
    Err(Status::unimplemented("WatchIncidents: being written"))
}

/// StopRanks.
pub async fn stop_ranks(
    _state: &Arc<AgentState>,
    _req: pb::StopRanksRequest,
) -> Result<pb::StopRanksResponse, Status> {
    Err(Status::unimplemented("StopRanks: being written"))
}
