//! Who is calling on the Unix socket, as the kernel says.
//!
//! In: each accepted Unix-socket connection. Out: the connection wrapped
//! with its [`LocalPeer`] (SO_PEERCRED's uid, gid and pid, SO_PEERGROUPS'
//! supplementary groups), read once at accept and handed to every request
//! on that connection through tonic's connect info. Never: take a client's
//! word for who it is. A request without a [`LocalPeer`] did not come over
//! the Unix socket, and the calls that need one refuse it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::UnixStream;
use tonic::Status;
use tonic::transport::server::Connected;

pub use crate::access::peer::LocalPeer;
use crate::api::uds_authority::AuthorityFilter;

/// A Unix-socket connection with the peer it was accepted from. What the
/// client sends goes through [`AuthorityFilter`], so stock gRPC clients
/// that name the socket path as `:authority` are served (see
/// [`crate::api::uds_authority`]).
#[derive(Debug)]
pub struct LocalConn {
    io: AuthorityFilter<UnixStream>,
    peer: LocalPeer,
}

impl LocalConn {
    /// Wraps an accepted connection; fails when the kernel will not say
    /// who is at the other end (the connection is then dropped). The
    /// credentials are read from the socket itself, before any byte of it
    /// is read, and stay with the connection whatever the filter does.
    pub fn accept(io: UnixStream) -> io::Result<Self> {
        let peer = LocalPeer::of(&io)?;
        Ok(Self {
            io: AuthorityFilter::new(io),
            peer,
        })
    }
}

impl Connected for LocalConn {
    type ConnectInfo = LocalPeer;

    fn connect_info(&self) -> LocalPeer {
        self.peer.clone()
    }
}

impl AsyncRead for LocalConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

delegate_async_write!(impl[] for LocalConn, io);

/// The Unix-socket peer of a request, or PERMISSION_DENIED naming the rule
/// when it came another way (TCP): `call` is the method, for the message.
pub fn local_peer<'a>(
    extensions: &'a http::Extensions,
    call: &str,
) -> Result<&'a LocalPeer, Status> {
    extensions.get::<LocalPeer>().ok_or_else(|| {
        Status::permission_denied(format!(
            "{call} is served on the agent's Unix socket only (rule: local callers, identified by SO_PEERCRED)"
        ))
    })
}
