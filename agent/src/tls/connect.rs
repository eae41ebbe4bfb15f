//! The one connector every dialer of a peer agent uses (checkpoint
//! replication, listings and restores, the straggler exchange): TCP, then
//! TLS with this node's certificate, verifying the peer's against the
//! cluster CA.
//!
//! In: the `host:port` tonic asks for, the [`PeerTls`] mode, and the name
//! the peer's certificate must carry when it is known (a launcher's record
//! or `[[checkpoint.peers]] name`). Out: a connection for tonic's channel.
//! Each new connection takes the TLS set in force, so a rotated node
//! certificate is presented from the next connection on. Never: send a
//! byte to a peer whose certificate does not chain to the cluster CA, or
//! whose name is not the one expected.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

use super::PeerTls;

/// Identities of the peers this agent dialed by address and that proved
/// to hold a cluster certificate: the straggler exchange takes summaries
/// from them (see `api::peer_auth`).
#[derive(Debug, Default)]
pub struct SeenNames(Mutex<BTreeSet<String>>);

impl SeenNames {
    /// Whether `name` answered one of this agent's dials.
    pub fn contains(&self, name: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(name)
    }

    fn add(&self, name: String) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name);
    }
}

/// Dials one peer agent (cheap to clone; tonic clones it per connection).
#[derive(Debug, Clone)]
pub struct PeerConnector {
    tls: PeerTls,
    name: Option<String>,
    seen: Option<Arc<SeenNames>>,
}

impl PeerConnector {
    /// A connector for a peer whose certificate must carry `name` (empty:
    /// not known; any certificate of the cluster CA is accepted).
    pub fn new(tls: PeerTls, name: &str) -> Self {
        Self {
            tls,
            name: (!name.is_empty()).then(|| name.to_owned()),
            seen: None,
        }
    }

    /// Records the identity each handshake proves into `seen`.
    pub fn recording(mut self, seen: Arc<SeenNames>) -> Self {
        self.seen = Some(seen);
        self
    }
}

/// A dialed connection: mutual TLS (left), or plain TCP with
/// `api.insecure = true` (right); tokio-util's `Either` forwards reads and
/// writes to whichever it is.
pub type ClientIo =
    tokio_util::either::Either<Box<tokio_rustls::client::TlsStream<TcpStream>>, TcpStream>;

/// Why a peer could not be dialed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URI tonic passed has no host or port.
    #[error("peer address {0:?} has no host:port")]
    Address(String),
    /// TCP connect or the TLS handshake failed.
    #[error("peer {addr}: {source}")]
    Io {
        /// Where.
        addr: String,
        /// The OS's or rustls' words.
        source: std::io::Error,
    },
    /// The expected name is not a valid DNS name.
    #[error("peer {addr}: {name:?} is not a DNS name a certificate can carry")]
    Name {
        /// Where.
        addr: String,
        /// The name.
        name: String,
    },
}

impl tower::Service<http::Uri> for PeerConnector {
    type Response = TokioIo<ClientIo>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let (Some(host), Some(port)) = (uri.host(), uri.port_u16()) else {
                return Err(ConnectError::Address(uri.to_string()));
            };
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let addr = format!("{}:{port}", uri.host().unwrap_or_default());
            let io = |source| ConnectError::Io {
                addr: addr.clone(),
                source,
            };
            let tcp = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(io)?;
            let _ = tcp.set_nodelay(true);
            let r = match &this.tls {
                PeerTls::Insecure => {
                    return Ok(TokioIo::new(tokio_util::either::Either::Right(tcp)));
                }
                PeerTls::Mutual(r) => r.current(),
            };
            let (config, server_name) = match &this.name {
                Some(n) => (
                    r.client_named.clone(),
                    ServerName::try_from(n.clone()).map_err(|_| ConnectError::Name {
                        addr: addr.clone(),
                        name: n.clone(),
                    })?,
                ),
                None => (
                    r.client_any.clone(),
                    ServerName::try_from(host.clone()).map_err(|_| ConnectError::Name {
                        addr: addr.clone(),
                        name: host.clone(),
                    })?,
                ),
            };
            let s = tokio_rustls::TlsConnector::from(config)
                .connect(server_name, tcp)
                .await
                .map_err(io)?;
            if let Some(seen) = &this.seen
                && let Some(id) = s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(super::identity_of)
            {
                seen.add(id);
            }
            Ok(TokioIo::new(tokio_util::either::Either::Left(Box::new(s))))
        })
    }
}
