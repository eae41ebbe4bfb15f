//! Who is at the other end of a Unix-socket connection, as the kernel
//! said when it was accepted (SO_PEERCRED, SO_PEERGROUPS): what
//! authorization ([`super::authz`]) and rank registration decide on.
//! Never: take a client's word for who it is.

use std::io;
use std::os::fd::AsRawFd;

use tokio::net::UnixStream;

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
