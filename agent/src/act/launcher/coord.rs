//! The seam between the launcher and the job's other hosts.
//!
//! On one host every decision is local: [`LocalOnly`]. Across hosts a
//! coordinator (etcd, in `crate::coord`) makes the nodes agree on each
//! attempt (restart count, rank 0's address), tells the others when this node
//! restarts or stops, and brings their directives here. The supervisor only
//! talks to this trait, so plugging in multi-host touches nothing else.

use std::future::Future;

/// What one attempt runs with, agreed by the job's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptPlan {
    /// In-job restarts so far (TORCHELASTIC_RESTART_COUNT).
    pub restart_count: u32,
    /// Rank 0's address.
    pub master_addr: String,
    /// Rank 0's store port.
    pub master_port: u16,
}

/// What a node asks of the whole job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Directive {
    /// Every node stops its workers and starts the next attempt.
    RestartInJob {
        /// Why (the incident and its diagnosis).
        reason: String,
    },
    /// Every node stops its workers and exits with `exit_code`.
    Stop {
        /// The exit status for the scheduler.
        exit_code: i32,
        /// Why.
        reason: String,
    },
}

/// What this node's launcher does about a fault of its own node (a cordon,
/// a scale-down decision, a refused health gate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeFault {
    /// Stop here and exit with this status (86: requeue elsewhere).
    Exit(i32),
}

/// Why the job's nodes could not agree.
#[derive(Debug, thiserror::Error)]
#[error("coordination: {0}")]
pub struct CoordError(pub String);

/// How a launcher coordinates with the launchers of the job's other nodes.
pub trait Coordinator: Send {
    /// A short name for the launcher's messages.
    fn name(&self) -> &'static str;

    /// Agrees on the next attempt with the other nodes (a barrier across
    /// hosts); `proposed` is this node's plan.
    fn rendezvous(
        &mut self,
        proposed: AttemptPlan,
    ) -> impl Future<Output = Result<AttemptPlan, CoordError>> + Send;

    /// Tells the other nodes what this node decided.
    fn publish(&mut self, d: &Directive) -> impl Future<Output = Result<(), CoordError>> + Send;

    /// The next directive another node published; pending forever when
    /// there is none to come.
    fn next_remote(&mut self) -> impl Future<Output = Directive> + Send;

    /// What a fault of this node means for its launcher.
    fn node_fault(&mut self, reason: &str) -> impl Future<Output = NodeFault> + Send;
}

/// A job on one host: every plan stands as proposed, nothing to tell, a
/// node fault ends the job with 86 (the scheduler requeues it elsewhere).
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalOnly;

impl Coordinator for LocalOnly {
    fn name(&self) -> &'static str {
        "local"
    }

    async fn rendezvous(&mut self, proposed: AttemptPlan) -> Result<AttemptPlan, CoordError> {
        Ok(proposed)
    }

    async fn publish(&mut self, _d: &Directive) -> Result<(), CoordError> {
        Ok(())
    }

    async fn next_remote(&mut self) -> Directive {
        std::future::pending().await
    }

    async fn node_fault(&mut self, _reason: &str) -> NodeFault {
        NodeFault::Exit(crate::policy::EXIT_NODE_FAULT)
    }
}
