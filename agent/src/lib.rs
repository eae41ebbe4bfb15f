//! warden's node agent (`wardend`): the stages that read the machine and
//! the ranks, carry decisions out, and serve the API, on `warden-core`.
//!
//! Crate `warden-agent`: above `warden-core` (the health model, detectors,
//! attribution, policy, goodput ledger, typed signals, the agent's own
//! files), `warden-slot` (the heartbeat slot and its socket, shared with
//! the rank's library, which the agent does not link), `warden-pidfd` and
//! `warden-proto`; below the launcher and the CLI.
//!
//! # Layout
//! One folder per stage of the flow (see docs/architecture.md):
//! - [`sources`]: readings from the machine turned into component reports.
//! - [`ranks`]: registered training ranks, their heartbeat slots, the scan,
//!   their processes (held by pidfd, read in /proc), exits.
//! - [`attribute`]: the attribution task: the bus's signals to core's engine
//!   and policy, the user's hook, incidents recorded and published.
//! - [`policy`]: the user's hook: its executable checked (`PATH`, file,
//!   owner), run in its own process group with a timeout.
//! - [`act`]: decisions carried out: in-process restarts, Slurm drains.
//! - [`goodput`]: the goodput task (the bus folded into core's ledger).
//! - [`hang`]: the job-wide hang verdict: the ranks' flight recorders
//!   read, every host's positions judged once.
//! - [`notice`]: notices of a coming stop (preemption, maintenance, a
//!   taint, the launcher's SIGTERM) turned into a save-and-leave word in
//!   the ranks' slots.
//! - [`exchange`]: the job-wide exchange across hosts: each host's report
//!   to its job's aggregator, the aggregator's use case, the routes; its
//!   calls to other hosts are a port ([`exchange::link`]), free of protobuf.
//! - [`ckpt`]: checkpoint tiers: local, peer replicas, durable store, restore;
//!   its calls to peers are a port ([`ckpt::link`]), free of protobuf.
//! - [`peer_link`]: those ports over tonic: the checkpoint flow's calls to
//!   peer agents, the shards' hand-framed chunks, the collector's wire; the
//!   exchange's reports, a group leader's relays and batches, the messages.
//! - [`config`]: the TOML configuration, validated with errors naming the key.
//! - [`state`]: what the running agent's parts share.
//! - [`access`]: who may call what: the Unix socket's callers as the
//!   kernel names them, the rules and the job owners, the job-stop quota.
//! - [`api`]: the gRPC services and the Prometheus endpoint.
//! - [`listen`]: every listener's connection quotas and watch (the API's
//!   sockets and the peers' TLS port alike).
//! - [`tls`]: mutual TLS between agents: the cluster CA, reloads, the
//!   `api.tcp` accept path and the one connector every peer dialer uses.
//! - [`daemon`]: start-up, listeners, the work loop, systemd, shutdown.
//! - [`telemetry`]: log set-up, and the job-labelled metric series (kept
//!   apart and capped; the goodput task removes an ended job's).
//! - `fuzz` (tests only): proptest fuzz targets for every parser of outside
//!   input.

/// Implements `tokio::io::AsyncWrite` for a connection wrapper by handing
/// every call to its field `$field` unchanged: the wrappers on the agent's
/// sockets (peer credentials, the HPACK filter, connection accounting, TLS
/// peers) act on what is read, never on what is written.
macro_rules! delegate_async_write {
    (impl[$($g:tt)*] for $ty:ty, $field:ident) => {
        impl<$($g)*> tokio::io::AsyncWrite for $ty {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                tokio::io::AsyncWrite::poll_write(std::pin::Pin::new(&mut self.get_mut().$field), cx, buf)
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                tokio::io::AsyncWrite::poll_flush(std::pin::Pin::new(&mut self.get_mut().$field), cx)
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                tokio::io::AsyncWrite::poll_shutdown(std::pin::Pin::new(&mut self.get_mut().$field), cx)
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                tokio::io::AsyncWrite::poll_write_vectored(std::pin::Pin::new(&mut self.get_mut().$field), cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                tokio::io::AsyncWrite::is_write_vectored(&self.$field)
            }
        }
    };
}

pub mod access;
pub mod act;
pub mod api;
pub mod attribute;
pub mod ckpt;
pub mod config;
pub mod daemon;
pub mod exchange;
#[cfg(test)]
mod fuzz;
pub mod goodput;
pub mod hang;
pub mod listen;
pub mod notice;
pub mod peer_link;
pub mod policy;
pub mod ranks;
pub mod sources;
pub mod state;
pub mod telemetry;
pub mod tls;

/// The agent's version, as reported by GetAgentInfo and `--version`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// What this agent takes that an older one does not, as GetAgentInfo says
/// it: a launcher publishes it for the job's other hosts, and a job-wide
/// behaviour that every agent must compute alike is turned on only where
/// every agent of the round says it.
pub const CAPABILITIES: &[&str] = &[RING_BY_PLACE, JOB_REPLICAS];

/// The capability of judging a job's replica placement by the job's most
/// `checkpoint.replicas` (`SetCheckpointPeersRequest.replicas`).
pub const JOB_REPLICAS: &str = "ckpt-job-replicas";

/// The capability of a replica ring by node-rank order
/// (`SetCheckpointPeersRequest.ring_by_place`).
pub const RING_BY_PLACE: &str = "ckpt-ring-by-place";
