//! What can go wrong in coordination, each naming what failed: which
//! endpoint, which key, which host.

use std::sync::Arc;
use std::time::Duration;

/// An error of the coordination library.
///
/// `Clone` because one failure (the lease lost) is handed to every caller
/// waiting on the coordinator; the etcd error inside is shared.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CoordError {
    /// A config field is wrong.
    #[error("coord config: `{field}` = {value}: {problem}")]
    Config {
        /// The field's name.
        field: &'static str,
        /// Its value, as given.
        value: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A new connection failed: the TLS handshake, the login or the first
    /// read of the job's keys (`super::connect`).
    #[error("etcd at {endpoints}: cannot connect: {problem}")]
    Connect {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// The cause in an operator's words, then what the client said
        /// (`super::diagnose`).
        problem: String,
        /// The client's error.
        #[source]
        source: Arc<etcd_client::Error>,
    },
    /// A TLS file cannot be used.
    #[error(transparent)]
    Access(#[from] super::access::AccessError),
    /// An etcd request failed.
    #[error("etcd at {endpoints}: {op} {key}: {source}")]
    Etcd {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// The request (get, put, txn, lease grant, watch, ...).
        op: &'static str,
        /// The key or key prefix it was about (or the lease id).
        key: String,
        /// What etcd or the client said.
        #[source]
        source: Arc<etcd_client::Error>,
    },
    /// An etcd request did not answer in time.
    #[error("etcd at {endpoints}: {op} {key}: no answer within {after:?}")]
    Timeout {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// The request.
        op: &'static str,
        /// The key or key prefix it was about.
        key: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// Another live launcher holds this host id in the job.
    #[error(
        "host id {host} is held by another launcher (key {key}, addr {holder_addr}, lease {holder_lease:x}); waited {waited:?} for it to go"
    )]
    HostTaken {
        /// The host id.
        host: String,
        /// The member key.
        key: String,
        /// The address the holder registered.
        holder_addr: String,
        /// The holder's lease.
        holder_lease: i64,
        /// How long `join` waited.
        waited: Duration,
    },
    /// This host's membership lease is gone (expired on the server, or no
    /// keep-alive got through for a whole TTL): the others have moved on or
    /// will, so this host's workers must stop now.
    #[error("host {host}: membership lease {lease:x} lost: {reason}")]
    LeaseLost {
        /// This host's id.
        host: String,
        /// The lease.
        lease: i64,
        /// What was seen.
        reason: String,
    },
    /// Too few hosts for a round within the wait.
    #[error(
        "job {job}: {live} host(s) alive ({hosts}), {min_nodes} needed; no round after waiting {waited:?}"
    )]
    NotEnoughNodes {
        /// The job.
        job: String,
        /// Live hosts.
        live: usize,
        /// Their ids, comma-separated.
        hosts: String,
        /// The minimum.
        min_nodes: u32,
        /// How long the caller waited.
        waited: Duration,
    },
    /// Enough hosts, but no new round within the wait.
    #[error(
        "job {job}: no round after epoch {after_epoch} within {waited:?} ({live} host(s) alive)"
    )]
    NoRound {
        /// The job.
        job: String,
        /// The epoch the caller had.
        after_epoch: u64,
        /// Live hosts.
        live: usize,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A host ended the job (finished or failed) at the current epoch.
    /// For [`super::Outcome::Finished`], let the local workers finish; for
    /// [`super::Outcome::Failed`], stop them.
    #[error("job {job} ended: {outcome:?} by host {by}: {reason}")]
    Ended {
        /// The job.
        job: String,
        /// The host that ended it.
        by: String,
        /// How.
        outcome: super::Outcome,
        /// Its words.
        reason: String,
        /// For a failure, the exit status to exit with.
        exit_code: Option<i32>,
    },
    /// A key holds something this version cannot read.
    #[error("etcd key {key}: unreadable value: {problem}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// The coordinator has stopped (it left the job).
    #[error("coordinator of host {host} has stopped")]
    Stopped {
        /// This host's id.
        host: String,
    },
}

impl CoordError {
    /// etcd was reached but did not answer this request, or said it is too
    /// busy to: worth asking again once the connection's first read
    /// succeeded (a stalled or saturated etcd in a mass start, a leader
    /// election). A refusal (permission, a bad request, a conflict) is not:
    /// asking again would get the same answer.
    pub fn etcd_busy(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Etcd { source, .. } => match source.as_ref() {
                etcd_client::Error::GRpcStatus(s) => matches!(
                    s.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::DeadlineExceeded
                        // The client channel's own deadline (the request
                        // timeout) ends a call as cancelled.
                        | tonic::Code::Cancelled
                        | tonic::Code::ResourceExhausted
                        | tonic::Code::Aborted
                ),
                etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
                _ => false,
            },
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(source: etcd_client::Error) -> CoordError {
        CoordError::Etcd {
            endpoints: "http://127.0.0.1:2379".into(),
            op: "txn (register member)",
            key: "/warden/jobs/j/members/h".into(),
            source: Arc::new(source),
        }
    }

    #[test]
    fn a_stalled_or_busy_etcd_is_asked_again_and_a_refusal_is_not() {
        let status = |code, msg: &str| {
            etcd(etcd_client::Error::GRpcStatus(tonic::Status::new(
                code, msg,
            )))
        };
        assert!(status(tonic::Code::Unavailable, "etcdserver: request timed out").etcd_busy());
        assert!(status(tonic::Code::Cancelled, "Timeout expired").etcd_busy());
        assert!(
            status(
                tonic::Code::ResourceExhausted,
                "etcdserver: too many requests"
            )
            .etcd_busy()
        );
        assert!(
            CoordError::Timeout {
                endpoints: "e".into(),
                op: "lease grant",
                key: "k".into(),
                after: Duration::from_secs(5),
            }
            .etcd_busy()
        );
        assert!(
            !status(
                tonic::Code::PermissionDenied,
                "etcdserver: permission denied"
            )
            .etcd_busy()
        );
        assert!(
            !status(
                tonic::Code::InvalidArgument,
                "etcdserver: request is too large"
            )
            .etcd_busy()
        );
        assert!(!CoordError::Stopped { host: "h".into() }.etcd_busy());
    }
}
