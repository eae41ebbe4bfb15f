//! RequestRestart, Control and AckControl: in-process restarts (being written).

use std::sync::Arc;

use tonic::Status;
use warden_proto::v1 as pb;

use super::service::BoxStream;
use crate::state::AgentState;

/// RequestRestart.
pub async fn request_restart(
    _state: &Arc<AgentState>,
    _req: pb::RequestRestartRequest,
) -> Result<pb::RequestRestartResponse, Status> {
    Err(Status::unimplemented("RequestRestart: being written"))
}

/// Control.
pub async fn control(
    _state: &Arc<AgentState>,
    _req: pb::ControlRequest,
) -> Result<BoxStream<pb::ControlMessage>, Status> {
    Err(Status::unimplemented("Control: being written"))
}

/// AckControl.
pub async fn ack_control(
    _state: &Arc<AgentState>,
    _req: pb::AckControlRequest,
) -> Result<pb::AckControlResponse, Status> {
    Err(Status::unimplemented("AckControl: being written"))
}
