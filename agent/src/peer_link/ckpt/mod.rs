//! The checkpoint flow's calls to peer agents on the wire.
//!
//! - [`tonic_peer`]: [`crate::ckpt::link::PeerLink`] and
//!   [`crate::ckpt::link::PeerDial`] over `warden.v1.Peer`; the straggler
//!   exchange shares a job's peer connection through
//!   [`tonic_peer::client_of`].
//! - [`wire`]: the shards' chunks framed by hand, both ways, their bytes
//!   never copied between the socket and the tier.
//! - [`collect_wire`]: the collector's questions and answers, checked both
//!   ways.

pub mod collect_wire;
pub mod tonic_peer;
pub mod wire;
