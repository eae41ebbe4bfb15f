//! Who may call what: the callers on the Unix socket as the kernel names
//! them (`peer`), the rules of docs/security.md and who owns each job
//! (`authz`, persisted in the state directory), and the quota on job stops
//! a launcher reports (`stop_limiter`), on the buckets per caller of
//! `quota`.
//!
//! Why a folder of its own, not part of `api`: what it holds lives as long
//! as the agent (the job owners, the quota's windows), so the agent's
//! shared state keeps it; inside `api`, the shared state imported the API
//! and the API the shared state. The API's handlers ask it; it asks
//! nothing of them.

pub mod authz;
pub mod peer;
pub mod quota;
pub mod stop_limiter;
