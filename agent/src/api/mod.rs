//! The API edge: gRPC (warden.v1, grpc.health.v1, reflection), metrics, and
//! the slot socket that hands ranks their slot memory.
//!
//! In: requests. Out: calls on [`crate::state::AgentState`] and the model
//! types turned into protobuf messages, errors into gRPC statuses, all in
//! this module. The core knows nothing of tonic or HTTP.

pub mod aggregate;
pub mod caller;
pub mod ckpt;
pub mod control;
pub mod convert;
pub mod gate;
pub mod goodput;
pub mod job_stop;
pub mod launcher_api;
pub mod local_accept;
pub mod metrics_http;
pub mod nvhcd;
pub mod observe;
pub mod peer_auth;
pub mod peer_service;
pub mod service;
pub mod slot_socket;
pub mod stragglers;
pub mod streams;
pub mod uds_authority;

pub use service::AgentService;
