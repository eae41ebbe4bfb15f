//! Who is calling on the Unix socket, as the kernel says.
//!
//! In: each accepted Unix-socket connection. Out: the connection wrapped
//! with its [`LocalPeer`] (SO_PEERCRED's uid, gid and pid, SO_PEERGROUPS'
//! supplementary groups), read once at accept and handed to every request
//! on that connection through tonic's connect info. Never: take a client's
//! word for who it is. A request without a [`LocalPeer`] did not come over
//! the Unix socket, and the calls that need one refuse it.

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::UnixStream;
use tonic::Status;
use tonic::transport::server::Connected;

use crate::api::uds_authority::AuthorityFilter;

/// The process at the other end of a Unix-socket connection, as the kernel
/// reported it when the connection was accepted: what authorization and
/// rank registration are decided on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalPeer {
    /// Effective uid of the process that connected.
    pub uid: u32,
    /// Its effective gid.
    pub gid: u32,
    /// Its pid in the agent's PID namespace; `None` when the kernel could
    /// not translate it (a process in a namespace the agent cannot see, a
    /// sidecar without a shared PID namespace).
    pub pid: Option<u32>,
    /// Its supplementary groups (SO_PEERGROUPS); empty where the kernel
    /// does not report them.
    pub groups: Vec<u32>,
}

impl LocalPeer {
    /// The peer of `stream`: SO_PEERCRED, then SO_PEERGROUPS.
    pub fn of(stream: &UnixStream) -> io::Result<Self> {
        let cred = stream.peer_cred()?;
        let pid = cred
            .pid()
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p != 0);
        Ok(Self {
            uid: cred.uid(),
            gid: cred.gid(),
            pid,
            groups: peer_groups(stream).unwrap_or_default(),
        })
    }

    /// The peer's uid and gid as the owner of a file the agent hands it
    /// (a staging file, a restored shard, its stack-dump file).
    pub fn owner(&self) -> warden_core::fsafe::Owner {
        warden_core::fsafe::Owner {
            uid: self.uid,
            gid: self.gid,
        }
    }

    /// Whether the peer is in group `gid`, as its primary or a
    /// supplementary group.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

impl std::fmt::Display for LocalPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} gid {}", self.uid, self.gid)?;
        match self.pid {
            Some(p) => write!(f, " pid {p}"),
            None => write!(f, " (pid not visible to the agent)"),
        }
    }
}

/// SO_PEERGROUPS: the peer's supplementary groups at connect time.
fn peer_groups(stream: &UnixStream) -> io::Result<Vec<u32>> {
    let fd = stream.as_raw_fd();
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = libc::socklen_t::try_from(groups.len() * size_of::<libc::gid_t>())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `groups` is a live buffer of `len` bytes that the kernel
        // fills with gid_t values; `len` is updated to the bytes needed or
        // written. `fd` is the open socket `stream` owns.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = usize::try_from(len).unwrap_or(0) / size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        // ERANGE: the buffer was short; `len` says how much is needed (the
        // kernel caps supplementary groups at 65536).
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= 65_536 {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

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
