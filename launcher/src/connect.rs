//! Reaching the agent: its Unix socket. The read and control API is local
//! only; `api.tcp` serves peer agents, and `--addr` says so.

use std::fmt;
use std::path::PathBuf;

use anyhow::{Context, Result};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use warden_proto::v1::agent_client::AgentClient;

/// Where the agent is.
#[derive(Debug, Clone)]
pub enum Target {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP `host:port`.
    Tcp(String),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Unix(p) => write!(f, "unix:{}", p.display()),
            Target::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

impl Target {
    /// `--addr`, else `--socket`, else `$WARDEN_SOCKET`, else the default path.
    pub fn from_args(socket: Option<PathBuf>, addr: Option<String>) -> Self {
        match (addr, socket) {
            (Some(a), _) => Target::Tcp(a),
            (None, Some(p)) => Target::Unix(p),
            (None, None) => Target::Unix(warden_client::paths::client_socket_path()),
        }
    }

    /// A channel to the agent; the error names what was tried.
    pub async fn channel(&self) -> Result<Channel> {
        let hint = "is wardend running? point at it with --socket or WARDEN_SOCKET";
        match self {
            // api.tcp serves only the peer agents (warden.v1.Peer, behind
            // mutual TLS): the CLI's API is local, on the Unix socket;
            // remote reads go through the Prometheus endpoint.
            Target::Tcp(addr) => anyhow::bail!(
                "--addr {addr}: the agent's TCP port serves only its peer agents (mutual TLS); \
                 run warden on the node, against its Unix socket (--socket or WARDEN_SOCKET), \
                 or read the node remotely from its Prometheus metrics"
            ),
            Target::Unix(path) => {
                // The URI is required by the API but unused: the connector dials the socket.
                let path = path.clone();
                let endpoint = Endpoint::from_static("http://wardend.local");
                // Dial once up front: tonic's own error would not say which socket failed.
                UnixStream::connect(&path)
                    .await
                    .with_context(|| format!("no warden agent answers at {self} ({hint})"))?;
                endpoint
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?))
                        }
                    }))
                    .await
                    .with_context(|| format!("no warden agent answers at {self} ({hint})"))
            }
        }
    }

    /// A warden.v1.Agent client.
    pub async fn connect(&self) -> Result<AgentClient<Channel>> {
        Ok(AgentClient::new(self.channel().await?))
    }
}
