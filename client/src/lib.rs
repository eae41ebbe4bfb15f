//! The library linked into training ranks to talk to the local warden agent.
//!
//! A rank registers with its host's `wardend` over a Unix socket and gets a
//! heartbeat slot in shared memory (a sealed memfd the agent hands to it
//! alone); from then on heartbeats, step
//! boundaries and section open/close are a few atomic stores into that slot:
//! no syscall, no lock, no allocation. With no agent (or after losing it) the
//! same calls write into a private slot while a background thread keeps
//! trying to register, so the agent can never slow down or break training.
//!
//! # Layout
//! - [`slot`] (the `warden-slot` crate, re-exported): the shared-memory
//!   layout both sides use, the agent's [`slot::SlotTable`] (claim,
//!   snapshot), each slot's sealed [`slot::SlotMemory`], and the hot-path
//!   [`slot::SlotWriter`]; [`slot_socket`], [`clock`] and [`paths`] are
//!   its modules too, re-exported under the names this crate always gave
//!   them (the C ABI, the Python package and the benches use them).
//! - [`slot_socket`]: how a registered rank receives its slot memory
//!   (SCM_RIGHTS on `<socket>.fd`).
//! - [`client`]: [`Client`], registration, reconnection, section guards,
//!   and [`ConnectOptions`] with its environment defaults (devices included).
//! - [`report`]: [`ExceptionReport`], sent by [`Client::report_exception`]
//!   within a bounded time (a dying process must never hang on it).
//! - [`restart`]: in-process restart requests from the agent
//!   ([`RestartRequest`]), followed by [`Client::on_restart`] and
//!   acknowledged with [`Client::ack_restart`].
//! - [`clock`]: the `CLOCK_MONOTONIC` nanosecond timestamps the slot carries.
//! - [`checkpoint`]: a rank's checkpoint shard saved into the local agent's
//!   tier and restored from the nearest valid copy.
//! - [`flight`]: the agent's flight-recorder dump requests, handed to the
//!   callbacks the rank registered, on a thread of their own.
//! - [`ffi`]: the C ABI declared in `include/warden.h`.
//! - [`paths`]: where the agent's socket is.
//! - `mapping` (private): the client's mapping of its received slot memory.
//! - `channel` (private): the gRPC channel to the agent's socket, for the
//!   link, exception reports and checkpoints.

mod channel;
pub mod checkpoint;
pub mod client;
pub mod ffi;
pub mod flight;
mod mapping;
pub mod report;
pub mod restart;

pub use warden_slot as slot;
pub use warden_slot::socket as slot_socket;
pub use warden_slot::{clock, paths};

pub use checkpoint::{CheckpointError, Checkpointer, Restored, Saved, Staged};
pub use client::{
    Client, ClientError, ConnectOptions, LinkStatus, RestartAcker, SectionGuard, SectionId,
    devices_from_env,
};
pub use flight::FlightRecorderDump;
pub use report::{ExceptionDecision, ExceptionReport, ReportError};
pub use restart::{RestartRequest, RestartVia};
