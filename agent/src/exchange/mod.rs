//! The job-wide exchange across hosts, without all-to-all (issue 30):
//! every host reports its part (straggler sketches and scores, hang
//! positions, SDC values) to its job's aggregator, which answers with the
//! job-wide statistics and verdicts.
//!
//! - [`report`]: the task that reports to the aggregators and takes their
//!   answers.
//! - [`aggregate`]: the aggregator's use case (a report in, the job-wide
//!   answer out), for a peer's report (through `api::aggregate`, which
//!   decodes and authorizes) and for this host's own.
//! - [`routes`]: whom a host reports to and where a group leader relays
//!   (the two-level tree), and what is known of each host on the way.
//! - [`link`]: the one call to another host, as a port ([`link::AggregatorLink`]).
//! - [`capacity`]: how many hosts and jobs one aggregator keeps.
//!
//! The wire is elsewhere (`crate::peer_link::exchange`): the messages both
//! ways, the port over tonic, a group leader's relays and batches (which
//! pass a member's report on as it came), and an older agent's
//! ExchangeStragglerSummaries. This stage names no protobuf or tonic type.
//!
//! [`Exchange`] is the stage's state and handles, handed over whole.

pub mod aggregate;
pub mod capacity;
pub mod link;
pub mod report;
pub mod routes;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use warden_core::detect::sdc::aggregate::SdcAggregator;
use warden_core::detect::straggler::aggregate::Aggregator;

use crate::hang::verdict::HangBoard;
use crate::ranks::peer_values::PeerValues;
use crate::ranks::registry::SharedRegistry;

/// What the exchange keeps and the handles it works with: its own
/// aggregators and routes, and the hang board, the SDC values and the
/// registry it shares with the work loop. The daemon and the edge hand it
/// over whole; it never reads the agent's whole state.
#[derive(Debug)]
pub struct Exchange {
    /// This agent's host name (a report under it is this agent's own).
    pub host: String,
    /// `sdc.enabled`: values are aggregated and sent.
    pub sdc_enabled: bool,
    /// `hang.verdict_wait`: how long the collector waits for positions.
    pub verdict_wait: Duration,
    /// What this agent keeps as its jobs' straggler aggregator: every
    /// reporting host's sketches and scores.
    pub aggregator: Mutex<Aggregator>,
    /// What this agent keeps as its jobs' aggregator of reported values:
    /// per-step aggregates of every host's ranks (`detect::sdc::aggregate`).
    pub sdc_aggregator: Mutex<SdcAggregator>,
    /// Whom this agent reports its jobs' part to and relays its group's
    /// reports to, and what is known of each.
    pub routes: routes::Routes,
    /// `straggler.relay_batch_wait()`: how long a batch stays open.
    pub relay_batch_wait: Duration,
    /// `straggler.peer_timeout`: the bound on passing a member's report, or
    /// a batch of them, on.
    pub relay_limit: Duration,
    /// Where every rank of the jobs stands (`hang::verdict`).
    pub hang_board: Arc<HangBoard>,
    /// The SDC detector's link to its jobs' aggregator (`ranks::peer_values`).
    pub peer_values: Arc<PeerValues>,
    /// The ranks (their jobs' world sizes).
    pub registry: SharedRegistry,
    /// The agent's shutdown.
    pub shutdown: CancellationToken,
}
