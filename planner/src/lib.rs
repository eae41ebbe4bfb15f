//! warden's goodput planner: before a run, what goodput to expect, which
//! checkpoint interval maximises it, and what hot spares are worth, for
//! warden's recovery against the scheduler-requeue baseline users have today.
//!
//! It simulates the job (a seeded discrete-event simulation over many
//! repetitions) rather than trusting one closed form, because the closed
//! forms assume one kind of failure and one recovery cost; the simulation
//! has fault classes, hangs found by timeouts, in-process and in-job
//! restarts, hot-swaps, scale-down and failures during recovery. Where the
//! closed form's assumptions hold, the two agree (tests/young_daly.rs).
//!
//! # Layout
//! - [`scenario`]: the inputs, their defaults with sources, validation,
//!   the `llama3` preset and the ledger figures a finished job provides.
//! - [`sim`]: one repetition: a failure history, then the walk through it
//!   for one checkpoint interval, jumping from event to event.
//! - [`young_daly`]: Young's and Daly's optimum intervals and the
//!   first-order expected goodput.
//! - [`sweep`]: goodput against interval over many repetitions on all
//!   cores, each series' optimum, the spares table: the [`Plan`].
//! - [`svg`]: the plot of goodput against interval.
//! - [`fleet`]: the fleet bench's results (planner/data/fleet.json): the
//!   restart round across hosts at the job's host count, measured or read
//!   off the fitted curve.
//! - [`report`]: the plan as a table for people and as JSON.
//! - [`rng`]: the seeded random numbers.

pub mod fleet;
pub mod report;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod svg;
pub mod sweep;
pub mod young_daly;

pub use scenario::{Scenario, ScenarioError};
pub use sweep::{Plan, plan};
