//! Ranks: the training processes that registered with this agent.
//!
//! In: RegisterRank / DeregisterRank calls, the shared-memory slots the ranks
//! write, process exits (pidfd), procfs. Out: the registry behind GetRanks,
//! hang verdicts with their evidence, exit outcomes (exited.rs) the caller
//! publishes. Never: block a rank (the
//! agent only reads slots), or trust a slot's contents (every value is
//! sanitised by `warden_slot` and every index bounded).

pub mod admit;
pub mod evidence;
pub mod exit_watch;
pub mod exited;
pub mod peer_values;
pub mod process;
pub mod procfs;
pub mod registry;
pub mod scan;
pub mod stragglers;

pub use registry::{RankKey, RegisterError, Registry};
