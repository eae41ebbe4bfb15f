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
//! - [`wire`], [`positions`]: the messages on the wire, checked both ways.

pub mod aggregate;
pub mod positions;
pub mod report;
pub mod routes;
pub mod wire;
