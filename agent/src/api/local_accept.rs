//! The accept loop of the agent's Unix sockets (the API socket, the
//! nvhcd socket).
//!
//! In: a bound Unix listener and the per-uid quota. Out: a stream of
//! accepted connections for tonic, each with its peer (SO_PEERCRED), its
//! place under the quotas and the preface and idle rules
//! ([`crate::listen::conn_watch`]). Never: spin or log once per failed accept
//! (issue 29), nor read more than a uid of a connection it refuses.

use std::sync::Arc;

use tokio::net::UnixListener;

use super::caller::{LocalConn, LocalPeer};
use crate::listen::admission::{Acceptor, ConnLimits, RateLimitedLog, Ticket};
use crate::listen::conn_watch::{RequestLimiter, RequestQuota, Rules, Watched};
use crate::state::AgentState;

/// The Unix socket's connections, each with the kernel's word on who is at
/// the other end (SO_PEERCRED, SO_PEERGROUPS), which every call is
/// authorized on, and its place under the connection quotas. A connection
/// whose peer cannot be read, or past its uid's cap or the agent's, is
/// closed as soon as it is accepted; its requests count under `requests`
/// (`api.max_requests_per_uid`, admins exempt); accept errors pause the loop and are
/// logged with their cause, at most every few seconds.
pub fn local_connections(
    listener: &'static str,
    uds: UnixListener,
    state: Arc<AgentState>,
    limits: Arc<ConnLimits<u32>>,
    requests: Arc<RequestLimiter>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<LocalWatched>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let rules = Rules::Grpc {
        preface: state.config.api.preface_timeout,
        idle: state.config.api.idle_timeout,
    };
    tokio::spawn(async move {
        let mut acceptor = Acceptor::new(listener);
        let unreadable = RateLimitedLog::new(listener);
        loop {
            let accepted = tokio::select! {
                () = state.shutdown.cancelled() => return,
                a = uds.accept() => a,
            };
            let stream = match accepted {
                Ok((s, _)) => {
                    acceptor.succeeded();
                    s
                }
                Err(e) => {
                    acceptor.failed(&e).await;
                    continue;
                }
            };
            // The uid first (one getsockopt): a refused connection of a
            // flood costs no more.
            let uid = match stream.peer_cred() {
                Ok(c) => c.uid(),
                Err(e) => {
                    unreadable.warn(&format!(
                        "connection dropped: its peer credentials cannot be read: {e}"
                    ));
                    continue;
                }
            };
            let admitted = limits.admit_lazy(uid, || {
                LocalPeer::of(&stream).is_ok_and(|p| state.authz.is_admin(&p))
            });
            let Ok(ticket) = admitted else {
                continue;
            };
            let conn = match LocalConn::accept(stream) {
                Ok(c) => c,
                Err(e) => {
                    unreadable.warn(&format!(
                        "connection dropped: its peer credentials cannot be read: {e}"
                    ));
                    continue;
                }
            };
            let peer = tonic::transport::server::Connected::connect_info(&conn);
            let quota = RequestQuota {
                limiter: requests.clone(),
                uid: peer.uid,
                exempt: state.authz.is_admin(&peer),
            };
            let conn = Watched::new(conn, rules, ticket).with_quota(quota);
            if tx.send(Ok(conn)).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A Unix-socket connection under the quotas and the preface and idle rules.
pub type LocalWatched = Watched<LocalConn, Ticket<u32>>;
