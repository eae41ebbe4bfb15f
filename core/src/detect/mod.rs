//! Detectors: signals in, incidents out.
//!
//! In: slot snapshots and process facts gathered by the agent's ranks
//! stage, and copies of the ranks' samples with the host's CPU facts for the
//! straggler detector ([`straggler::Stragglers::copy_out`],
//! [`straggler::HostProbe`]), and the flight-recorder dumps ranks wrote
//! ([`flight_recorder::parse`]).
//! Out: verdicts (a hang, with the threshold and how it was derived;
//! straggler flags; the ranks behind their peers on a process group,
//! from their flight recorders).
//! Never: the agent state, gRPC, or I/O but the hang calibration's own
//! file: the hang detector is pure functions over plain values, so a table
//! of cases tests them and the work loop decides when to gather evidence.

pub mod calibration;
pub mod culprit;
pub mod flight_recorder;
pub mod hang;
mod host_ttl;
pub mod positions;
pub mod sdc;
pub mod straggler;
