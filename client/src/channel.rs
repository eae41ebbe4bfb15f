//! The gRPC channel to the agent's Unix socket, for every part of the
//! client that calls the agent (the background link, exception reports,
//! checkpoints). Its own module so each of them imports it and none
//! imports another for it.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The bound on connecting, and on each call of a channel from
/// [`connect_channel`]: an agent that is down is found at once, and no
/// call to it holds a client thread for long.
pub(crate) const RPC_TIMEOUT: Duration = Duration::from_secs(2);

/// A channel to the agent's socket, each call bounded by [`RPC_TIMEOUT`].
pub(crate) async fn connect_channel(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    connect_channel_with(path, RPC_TIMEOUT).await
}

/// A channel to the agent's socket whose calls may each take `timeout`
/// (connecting is bounded by [`RPC_TIMEOUT`] all the same: an agent that
/// is down is found at once).
pub(crate) async fn connect_channel_with(
    path: PathBuf,
    timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by tonic but unused: the connector dials the socket.
    Endpoint::from_static("http://warden.local")
        .connect_timeout(RPC_TIMEOUT)
        .timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}
