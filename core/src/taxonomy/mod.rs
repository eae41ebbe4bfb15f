//! What warden knows about faults, in one place: the XID table (NVIDIA's
//! Xid catalog: class, health and advice per code) and DCGM's health-watch
//! incident codes. Sources read it to judge a device, attribution to
//! classify an incident; neither owns it, so neither imports the other.

pub mod dcgm;
pub mod xid;
