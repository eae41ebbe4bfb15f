//! The slot socket: how a registered rank receives its slot memory.
//!
//! In: a Unix stream connection to `<api socket>.fd` ([`socket_path`]),
//! carrying one request of [`REQUEST_LEN`] bytes: [`REQUEST_MAGIC`] and the
//! generation `RegisterRank` answered, little-endian. Out: one reply, a short
//! UTF-8 text: `ok` with the slot's memfd attached (SCM_RIGHTS), or
//! `refused: <why>` with nothing attached. Never: a descriptor to a process
//! the agent did not check against the registration (the agent reads the
//! connection's SO_PEERCRED; see `warden_agent::ranks::slot_handoff`).
//!
//! Why a socket beside the gRPC one: HTTP/2 cannot carry a descriptor, and
//! the memory must reach the rank without ever having a name in a
//! directory that others could open. The socket sits next to the API socket
//! with its mode and group, so a rank in a container that mounts the
//! agent's directory reaches both, and SCM_RIGHTS works across PID and
//! mount namespaces.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// First bytes of a request: names the protocol and its version.
pub const REQUEST_MAGIC: [u8; 8] = *b"WSLTREQ1";
/// Length of a request: the magic and a little-endian u64 generation.
pub const REQUEST_LEN: usize = 16;
/// Longest reply text; longer refusals are cut.
pub const MAX_REPLY: usize = 512;
/// Suffix the slot socket adds to the API socket's path.
pub const SUFFIX: &str = ".fd";

/// Why a slot memory could not be received.
#[derive(Debug, thiserror::Error)]
pub enum SlotSocketError {
    /// Connecting, writing or reading failed.
    #[error("slot socket {path}: {op}: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// What we were doing.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The agent answered, but not with a descriptor.
    #[error("slot socket {path}: the agent refused: {why}")]
    Refused {
        /// The socket.
        path: PathBuf,
        /// Its reason.
        why: String,
    },
}

/// The slot socket beside the API socket `api_socket`.
pub fn socket_path(api_socket: &Path) -> PathBuf {
    let mut s = api_socket.as_os_str().to_owned();
    s.push(SUFFIX);
    PathBuf::from(s)
}

/// Encodes a request for the memory of `generation`.
pub fn encode_request(generation: u64) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..8].copy_from_slice(&REQUEST_MAGIC);
    b[8..].copy_from_slice(&generation.to_le_bytes());
    b
}

/// Decodes a request: the generation asked for, or why it is not one.
pub fn decode_request(b: &[u8; REQUEST_LEN]) -> Result<u64, String> {
    if b[..8] != REQUEST_MAGIC {
        return Err(format!(
            "request does not start with {:?} (protocol {:?})",
            String::from_utf8_lossy(&REQUEST_MAGIC),
            String::from_utf8_lossy(&b[..8])
        ));
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&b[8..]);
    Ok(u64::from_le_bytes(g))
}

/// Sends the reply on the connected socket `sock`: `ok` with `memory`
/// attached, or `refused: <why>` alone. One `sendmsg`: the reply is small
/// enough never to be split.
pub fn send_reply(sock: RawFd, reply: Result<BorrowedFd<'_>, &str>) -> std::io::Result<()> {
    let (text, fds): (String, Vec<RawFd>) = match reply {
        Ok(fd) => ("ok".to_owned(), vec![fd.as_raw_fd()]),
        Err(why) => {
            let mut t = format!("refused: {why}");
            if t.len() > MAX_REPLY {
                let mut cut = MAX_REPLY;
                while !t.is_char_boundary(cut) {
                    cut -= 1;
                }
                t.truncate(cut);
            }
            (t, Vec::new())
        }
    };
    let iov = [IoSlice::new(text.as_bytes())];
    let cmsgs: Vec<ControlMessage<'_>> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&fds)]
    };
    sendmsg::<()>(sock, &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// Asks the agent on `path` for the slot memory of registration
/// `generation`, waiting at most `timeout` for each step.
///
/// Blocking: the client calls it from its background thread, never from
/// the training loop.
pub fn fetch(path: &Path, generation: u64, timeout: Duration) -> Result<OwnedFd, SlotSocketError> {
    let io = |op| {
        move |source| SlotSocketError::Io {
            path: path.to_owned(),
            op,
            source,
        }
    };
    let mut sock = UnixStream::connect(path).map_err(io("connect"))?;
    sock.set_read_timeout(Some(timeout))
        .map_err(io("set timeout"))?;
    sock.set_write_timeout(Some(timeout))
        .map_err(io("set timeout"))?;
    sock.write_all(&encode_request(generation))
        .map_err(io("send request"))?;
    let mut buf = [0u8; MAX_REPLY];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (n, fd) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| io("receive reply")(e.into()))?;
        let mut fd = None;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for raw in fds {
                        // SAFETY: the kernel just installed `raw` in this
                        // process for us (SCM_RIGHTS); nothing else owns it.
                        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                        if fd.is_none() {
                            fd = Some(owned);
                        }
                    }
                }
            }
        }
        (msg.bytes, fd)
    };
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    match fd {
        Some(fd) if text == "ok" => Ok(fd),
        _ => {
            // Whatever else the agent said, read to the end (bounded).
            let mut rest = Vec::new();
            let _ = (&sock).take((MAX_REPLY - n) as u64).read_to_end(&mut rest);
            let mut why = text;
            why.push_str(&String::from_utf8_lossy(&rest));
            let why = why.strip_prefix("refused: ").unwrap_or(&why).to_owned();
            Err(SlotSocketError::Refused {
                path: path.to_owned(),
                why: if why.is_empty() {
                    "no descriptor and no reason (closed)".to_owned()
                } else {
                    why
                },
            })
        }
    }
}
