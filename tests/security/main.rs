//! Security tests: each attack on the agent replayed with real processes
//! and sockets, and shown refused with nothing changed.

#![allow(clippy::expect_used, clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;
mod tls;
