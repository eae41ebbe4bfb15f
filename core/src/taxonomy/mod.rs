//! What warden knows about faults, in one place: the XID table (NVIDIA's
//! Xid catalog: class, health and advice per code), DCGM's health-watch
//! incident codes, and the health signals' names ([`signals`]). Sources read
//! it to judge a device and to name what they saw, attribution to classify
//! an incident; neither owns it, so neither imports the other.

pub mod dcgm;
pub mod signals;
pub mod xid;
