//! The calls between agents on the wire, for the checkpoint flow: protobuf
//! and tonic live here and in the edge (`api/`), never in the flow itself.
//!
//! - [`tonic_peer`]: the flow's [`crate::ckpt::link::PeerLink`] and
//!   [`crate::ckpt::link::PeerDial`] over `warden.v1.Peer`.
//! - [`channel`]: the connection to a peer (HTTP/2 windows and frames, the
//!   message ceiling) and a local shard read out to it in paced chunks.
//! - [`wire`]: the shards' chunks framed by hand, both ways, their bytes
//!   never copied between the socket and the tier.
//! - [`collect_wire`]: the collector's questions and answers, checked both
//!   ways.
//!
//! The straggler exchange (`exchange/`) shares a job's peer connection
//! through [`tonic_peer::client_of`].

pub mod channel;
pub mod collect_wire;
pub mod tonic_peer;
pub mod wire;
