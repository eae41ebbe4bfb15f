//! The library linked into training ranks (placeholder, filled by the heartbeat work).
pub mod paths;
