//! Acting on decisions: in-process restarts (the agent, through the
//! ranks' slots and control streams) and the launcher `warden run`, which
//! owns the worker processes (in-job restarts, stop, cordon).

pub mod config;
pub mod in_process;
