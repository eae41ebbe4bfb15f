//! Acting on decisions: in-process restarts (the agent, through the
//! ranks' slots and control streams) and the launcher `warden run`, which
//! owns the worker processes (in-job restarts, stop, cordon); and Slurm,
//! which drains the node while it is cordoned; and the pre-restart health
//! gate (`gate`), run before a launcher respawns workers here; and a
//! launcher's stop of its ranks (`stopping`: marked, a preemption's
//! notice raised first).

pub mod config;
pub mod gate;
pub mod in_process;
pub mod slurm;
pub mod stopping;
