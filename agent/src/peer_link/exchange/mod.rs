//! The job-wide exchange on the wire (`warden.v1.Peer`'s
//! `ReportToAggregator`, `ReportBatchToAggregator` and the older
//! `ExchangeStragglerSummaries`): the exchange's port over tonic, and what a
//! group leader does with reports it passes on as they came.
//!
//! - [`tonic_aggregator`]: [`crate::exchange::link::AggregatorLink`] and
//!   [`crate::exchange::link::AggregatorDial`] over tonic.
//! - [`call`]: the calls, the messages refusals are worded with, and those
//!   refusals read back in the exchange's terms.
//! - [`relay`]: a group leader passing a member's report on.
//! - [`batch`]: a group leader passing its members' reports on in one call
//!   per `straggler.relay_batch_window`.
//! - [`wire`], [`positions`]: the messages, checked both ways.
//! - [`legacy`]: an older agent's ExchangeStragglerSummaries, taken and
//!   answered.

pub mod batch;
pub mod call;
pub mod legacy;
pub mod positions;
pub mod relay;
pub mod tonic_aggregator;
pub mod wire;
