//! Detectors: signals in, incidents out.
//!
//! In: slot snapshots and process facts gathered by [`crate::ranks`].
//! Out: verdicts (a hang, with the threshold and how it was derived).
//! Never: I/O. Detectors are pure functions over plain values, so a table of
//! cases tests them and the work loop decides when to gather evidence.

pub mod calibration;
pub mod hang;
pub mod straggler;
pub mod xid;
