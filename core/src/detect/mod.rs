//! Detectors: signals in, incidents out.
//!
//! In: slot snapshots and process facts gathered by [`crate::ranks`].
//! Out: verdicts (a hang, with the threshold and how it was derived).
//! Never: the agent state, gRPC, or I/O but one read: the hang detector and
//! the XID table ([`xid`]) are pure functions over plain values, so a table of
//! cases tests them and the work loop decides when to gather evidence; the
//! straggler driver ([`straggler::Stragglers::tick`]), handed the registry
//! and the health model, reads `/proc/<pid>/schedstat` to explain a flag.

pub mod calibration;
pub mod hang;
pub mod straggler;
