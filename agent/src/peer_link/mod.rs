//! The calls between agents on the wire: protobuf and tonic live here and
//! in the edge (`api/`), never in the stages whose calls these carry. Each
//! stage names its calls as a port in its own terms; this module implements
//! the ports and imports the stages, never the other way round.
//!
//! - [`ckpt`]: the checkpoint flow's [`crate::ckpt::link::PeerLink`] and
//!   [`crate::ckpt::link::PeerDial`] over `warden.v1.Peer`, the shards'
//!   hand-framed chunks, the collector's questions and answers.
//! - [`exchange`]: the job-wide exchange's
//!   [`crate::exchange::link::AggregatorLink`] over the same service, its
//!   messages, and a group leader's relays and batches.
//! - [`channel`]: the connection to a peer (HTTP/2 windows and frames, the
//!   message ceiling) and a local shard read out to it in paced chunks.

pub mod channel;
pub mod ckpt;
pub mod exchange;
