//! Goodput as the agent runs it: the task that folds the bus's signals into
//! the ledger ([`warden_core::goodput`]) and writes the journals, and the
//! job-wide view merged from every host's report.

pub mod config;
pub mod task;
