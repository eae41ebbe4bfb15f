//! The job-wide verdict on a hang, after the scan found one: each local
//! rank's torch flight recorder asked for over its `Control` stream and
//! read back (`flight`), the job's positions gathered from every host and
//! judged once (`verdict`).
//!
//! Why a stage of its own and not part of `ranks`: it asks the ranks
//! through in-process control streams (`act::in_process`), which itself
//! reads the registry, so inside `ranks` the two folders imported each
//! other. Here it sits above both: it reads the registry and the control
//! streams, and the exchange carries its board across hosts.

pub mod flight;
pub mod verdict;
