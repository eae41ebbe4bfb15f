//! Attribution as the agent runs it: the task that feeds the bus's signals
//! to the engine ([`warden_core::attribute`]), asks the policy and its hook,
//! records incidents and starts in-process restarts.

pub mod job_stop;
pub mod task;
