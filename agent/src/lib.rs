//! warden's node agent (`wardend`) and its CLI (`warden`).
//!
//! # Layout
//! One folder per stage of the flow (see docs/architecture.md):
//! - [`act`]: decisions carried out: in-process restarts, the launcher.
//! - [`config`]: the TOML configuration, validated with errors naming the key.
//! - [`coord`]: coordination across hosts through etcd: membership, epochs, rounds.
//! - [`sources`]: readings from the machine turned into component reports.
//! - [`ranks`]: registered training ranks, their heartbeat slots, exits.
//! - [`detect`]: detectors (hang) and their calibration, as pure functions.
//! - [`attribute`]: incidents turned into diagnoses (fault class, evidence).
//! - [`goodput`]: the goodput ledger: each job's time split by cause, its journal.
//! - [`policy`]: diagnoses turned into remediation decisions (budgets, hook).
//! - [`ckpt`]: checkpoint tiers: local, peer replicas, durable store, restore.
//! - [`health`]: the health model (components, statuses, reasons).
//! - [`events`]: the event bus (ring, live broadcast, logs and counters).
//! - [`signal`]: the typed signals the bus carries, rendered once as events.
//! - [`state`]: what the running agent's parts share.
//! - [`api`]: the gRPC services and the Prometheus endpoint.
//! - [`tls`]: mutual TLS between agents: the cluster CA, reloads, the
//!   `api.tcp` accept path and the one connector every peer dialer uses.
//! - [`daemon`]: start-up, listeners, the work loop, systemd, shutdown.
//! - [`cli`]: the `warden` command: a client of the API.
//! - [`telemetry`]: log set-up.
//! - [`fsafe`]: files in the agent's own trees, opened without following symlinks.
//! - [`named_file`]: files an operator names (config, CA, scenario): regular
//!   files only, with a size cap and a deadline.

pub mod act;
pub mod api;
pub mod attribute;
pub mod ckpt;
pub mod config;
pub mod daemon;
#[cfg(test)]
mod fuzz;
pub mod goodput;
pub mod policy;
pub mod ranks;
pub mod sources;
pub mod state;
pub mod telemetry;
pub mod tls;

/// The agent's version, as reported by GetAgentInfo and `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
