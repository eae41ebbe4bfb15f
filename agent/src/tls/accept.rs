//! The `api.tcp` accept path: each connection's TLS handshake in its own
//! task, bounded in time and in number, and the peer's identity attached
//! to the connection so every request on it carries it.
//!
//! In: a bound TCP listener and the [`PeerTls`] mode. Out: a stream of
//! [`PeerConn`]s for tonic's `serve_with_incoming`; tonic copies each
//! connection's [`PeerInfo`] into the extensions of its requests, where
//! the Peer service's authorization reads it. Never: let a slow or
//! silent client hold up the accept loop (a handshake that takes longer
//! than [`HANDSHAKE`] is dropped), let one source address take more than
//! `api.max_handshakes_per_source` of the [`MAX_HANDSHAKES`] places (issue
//! 29: 400 idle connections from one host starved the valid peers), nor
//! hand over a connection whose client presented no certificate of the
//! cluster CA.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

use super::PeerTls;
use crate::listen::admission::{Acceptor, ConnLimits, Ticket};
use crate::listen::conn_watch::{Rules, Watched};

/// The quotas of the `api.tcp` accept path.
#[derive(Debug, Clone)]
pub struct TcpQuotas {
    /// Connections, in the agent's shared budget (no per-source cap).
    pub connections: Arc<ConnLimits<IpAddr>>,
    /// Handshakes in progress, per source address
    /// (`api.max_handshakes_per_source`).
    pub handshakes: Arc<ConnLimits<IpAddr>>,
    /// The preface and idle rules the connections are held to.
    pub rules: Rules,
}

/// An accepted, handshaken connection with its place in the budget.
pub type WatchedPeerConn = Watched<PeerConn, Ticket<IpAddr>>;

/// Longest a client may take to complete its handshake.
pub const HANDSHAKE: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; more connections wait to be accepted
/// (the kernel's backlog holds them), so a flood costs bounded memory.
pub const MAX_HANDSHAKES: usize = 256;

/// Who is at the other end of a TCP connection, as the accept path
/// established it. Absent from a request's extensions: the request came
/// over the Unix socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The client's address.
    pub remote: Option<SocketAddr>,
    /// The identity its certificate carries (first DNS name); None when
    /// the listener runs with `api.insecure = true` and nothing is known.
    pub identity: Option<String>,
}

/// A connection accepted on `api.tcp`: TLS or (insecure) plain.
#[derive(Debug)]
pub struct PeerConn {
    io: Io,
    info: PeerInfo,
}

/// Mutual TLS (left), or plain TCP with `api.insecure = true` (right).
type Io = tokio_util::either::Either<Box<tokio_rustls::server::TlsStream<TcpStream>>, TcpStream>;

impl tonic::transport::server::Connected for PeerConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

delegate_async_write!(impl[] for PeerConn, io);

/// Accepts on `listener` until `stop`, handshaking each connection in
/// its own task; the connections that pass come out of the returned
/// stream.
pub fn incoming(
    listener: TcpListener,
    tls: PeerTls,
    stop: CancellationToken,
    quotas: TcpQuotas,
) -> tokio_stream::wrappers::ReceiverStream<Result<WatchedPeerConn, std::io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, tls, stop, tx, quotas));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: TcpListener,
    tls: PeerTls,
    stop: CancellationToken,
    tx: mpsc::Sender<Result<WatchedPeerConn, std::io::Error>>,
    quotas: TcpQuotas,
) {
    let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    let mut acceptor = Acceptor::new("api.tcp");
    loop {
        let permit = tokio::select! {
            () = stop.cancelled() => return,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let (tcp, remote) = match accepted {
            Ok(a) => {
                acceptor.succeeded();
                a
            }
            Err(e) => {
                // EMFILE and the like: logged with its cause at most every
                // few seconds, and a growing pause rather than a spin.
                acceptor.failed(&e).await;
                continue;
            }
        };
        // Past a cap the connection is closed at once (dropped here).
        let Ok(place) = quotas.connections.admit(remote.ip(), false) else {
            continue;
        };
        let Ok(handshake) = quotas.handshakes.admit(remote.ip(), false) else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (tls, tx, rules) = (tls.clone(), tx.clone(), quotas.rules);
        tokio::spawn(async move {
            let _permit = permit;
            let conn = match tls {
                PeerTls::Insecure => PeerConn {
                    io: Io::Right(tcp),
                    info: PeerInfo {
                        remote: Some(remote),
                        identity: None,
                    },
                },
                PeerTls::Mutual(r) => {
                    let acceptor = tokio_rustls::TlsAcceptor::from(r.current().server.clone());
                    match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                        Err(_) => {
                            refused(remote, "no handshake within 10s");
                            return;
                        }
                        Ok(Err(e)) => {
                            refused(remote, &e.to_string());
                            return;
                        }
                        Ok(Ok(s)) => {
                            let identity = s
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first())
                                .and_then(super::identity_of);
                            let Some(identity) = identity else {
                                refused(remote, "the client certificate names no DNS identity");
                                return;
                            };
                            PeerConn {
                                io: Io::Left(Box::new(s)),
                                info: PeerInfo {
                                    remote: Some(remote),
                                    identity: Some(identity),
                                },
                            }
                        }
                    }
                }
            };
            // The handshake is over: its place goes to the next one.
            drop(handshake);
            let _ = tx.send(Ok(Watched::new(conn, rules, place))).await;
        });
    }
}

/// A refused handshake: counted, and logged at debug (a port scanner
/// must not fill the journal).
fn refused(remote: SocketAddr, why: &str) {
    metrics::counter!("warden_tls_handshakes_refused_total").increment(1);
    tracing::debug!(%remote, why, "api.tcp: TLS handshake refused");
}
