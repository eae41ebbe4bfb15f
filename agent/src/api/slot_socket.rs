//! The slot socket (`<api socket>.fd`): hands each registered rank its
//! sealed slot memory, and nobody else anything.
//!
//! In: one connection per request, one request each (the generation
//! `RegisterRank` answered; protocol in [`warden_slot::socket`]).
//! Out: the slot's memfd over SCM_RIGHTS, or a refusal naming why. Never:
//! a descriptor to a process the kernel does not vouch for as the
//! registered rank (SO_PEERCRED), nor a wait on a slow peer while holding
//! the registry (the request is read first, with a deadline).
//!
//! Who gets a descriptor ([`authorize`]): the connection's pid, as the
//! kernel translates it into the agent's PID namespace, is the registered
//! rank's process or the process that registered it, and its uid is the
//! registering caller's. A rank in a PID namespace the agent cannot see
//! (registered with pid 0) is recognised by its uid alone, and only from a
//! connection whose pid the agent cannot see either.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use warden_slot::socket::{REQUEST_LEN, decode_request, send_reply};

use crate::api::caller::LocalPeer;
use crate::ranks::registry::{RankEntry, RankState};
use crate::state::AgentState;

/// How long a connection may take to send its request.
const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// Connections answered at once; more wait in the listen backlog.
const MAX_IN_FLIGHT: usize = 64;

/// Binds the slot socket at `path` with the API socket's `mode` and
/// group, replacing a stale one (the caller holds the agent's instance
/// claim, so no live agent serves it).
pub fn bind(path: &Path, mode: u32, gid: Option<u32>) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(std::io::Error::from)?;
    }
    Ok(l)
}

/// Serves the slot socket until the agent shuts down, then removes it.
pub async fn serve(listener: UnixListener, path: std::path::PathBuf, state: Arc<AgentState>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    // Out of descriptors: a growing pause and a warning every few seconds
    // naming the errno, not one per failed accept (issue 29).
    let mut acceptor = crate::listen::admission::Acceptor::new("slot socket");
    loop {
        let accepted = tokio::select! {
            () = state.shutdown.cancelled() => break,
            a = listener.accept() => a,
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
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let st = state.clone();
        tokio::spawn(async move {
            handle(stream, &st).await;
            drop(permit);
        });
    }
    let _ = std::fs::remove_file(&path);
}

async fn handle(mut stream: UnixStream, state: &AgentState) {
    let peer = match LocalPeer::of(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "slot socket: peer credentials unreadable; connection dropped");
            return;
        }
    };
    let mut buf = [0u8; REQUEST_LEN];
    let generation = match tokio::time::timeout(REQUEST_DEADLINE, stream.read_exact(&mut buf)).await
    {
        Ok(Ok(_)) => decode_request(&buf),
        Ok(Err(e)) => Err(format!("reading the request: {e}")),
        Err(_) => Err(format!(
            "no request of {REQUEST_LEN} bytes within {REQUEST_DEADLINE:?}"
        )),
    };
    // The descriptor is duplicated under the registry lock and sent after.
    let decided = generation.and_then(|g| {
        let reg = state.registry();
        let entry = reg.ranks.values().find(|e| e.generation == g);
        let slot = authorize(g, entry, &peer)?;
        reg.slots()
            .memory(slot)
            .ok_or_else(|| format!("slot {slot} has no memory (agent bug)"))?
            .fd()
            .try_clone_to_owned()
            .map_err(|e| format!("duplicating the slot's descriptor: {e}"))
            .map(|fd| (g, slot, fd))
    });
    let sent = match &decided {
        Ok((_, _, fd)) => {
            use std::os::fd::AsFd;
            reply(&stream, Ok(fd.as_fd())).await
        }
        Err(why) => {
            tracing::warn!(peer = %peer, why = %why, "slot socket: request refused");
            reply(&stream, Err(why)).await
        }
    };
    match (decided, sent) {
        (Ok((g, slot, _)), Ok(())) => {
            tracing::debug!(peer = %peer, generation = g, slot, "slot memory handed over");
        }
        (_, Err(e)) => tracing::warn!(peer = %peer, error = %e, "slot socket: reply not sent"),
        _ => {}
    }
}

async fn reply(
    stream: &UnixStream,
    r: Result<std::os::fd::BorrowedFd<'_>, &String>,
) -> std::io::Result<()> {
    let sent = tokio::time::timeout(REQUEST_DEADLINE, async {
        loop {
            stream.writable().await?;
            match stream.try_io(Interest::WRITABLE, || {
                send_reply(stream.as_raw_fd(), r.map_err(String::as_str))
            }) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                other => return other,
            }
        }
    })
    .await;
    sent.unwrap_or_else(|_| Err(std::io::Error::other("peer not reading")))
}

/// Whether `peer` may have the slot memory of registration `generation`
/// (`entry`, when one has it): the slot index, or the refusal's reason.
///
/// A pure decision, so a table of cases tests it; see the module docs for
/// the rule.
pub fn authorize(
    generation: u64,
    entry: Option<&RankEntry>,
    peer: &LocalPeer,
) -> Result<u32, String> {
    let Some(e) = entry else {
        return Err(format!(
            "no live registration has generation {generation} (it ended or was replaced: register again)"
        ));
    };
    if !matches!(e.state, RankState::Running | RankState::Hung) || !e.holds_slot {
        return Err(format!(
            "registration {generation} ({}) is {:?} and holds no slot: register again",
            e.key, e.state
        ));
    }
    if let Some(owner) = e.owner
        && owner.uid != peer.uid
    {
        return Err(format!(
            "{} was registered by uid {}; this connection is from {peer}",
            e.key, owner.uid
        ));
    }
    let ok = match (e.pid, peer.pid) {
        // Seen by pid: the rank itself or whoever registered it.
        (rank, Some(p)) if rank != 0 => p == rank || e.registered_by == Some(p),
        // Registered from a PID namespace the agent cannot see, asked from
        // one too: the uid (checked above) is all the kernel says.
        (0, None) => e.owner.is_some(),
        _ => false,
    };
    if ok {
        Ok(e.slot)
    } else {
        Err(format!(
            "{} is pid {} (registered by {}); this connection is from {peer}",
            e.key,
            e.pid,
            e.registered_by
                .map_or_else(|| "an unseen pid".to_owned(), |p| format!("pid {p}"))
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranks::registry::{RegisterRequest, Registry};
    use warden_core::fsafe::Owner;

    fn peer(uid: u32, pid: Option<u32>) -> LocalPeer {
        LocalPeer {
            uid,
            gid: uid,
            pid,
            groups: Vec::new(),
        }
    }

    /// A registration of rank `rank` (pid `pid`, registered by `caller`,
    /// uid 1000); its generation.
    fn register(reg: &mut Registry, rank: u32, pid: u32, caller: Option<u32>) -> u64 {
        let r = RegisterRequest {
            job_id: "j".into(),
            global_rank: rank,
            local_rank: rank,
            world_size: 4,
            pid,
            declared_pid: pid.max(1),
            host: "h".into(),
            layout_version: warden_slot::LAYOUT_VERSION,
            stack_dump_signal: 0,
            devices: Vec::new(),
            process: None,
            caller_pid: caller,
            owner: Some(Owner {
                uid: 1000,
                gid: 1000,
            }),
        };
        reg.register(&r, 0).unwrap().generation
    }

    fn decide(reg: &Registry, generation: u64, p: &LocalPeer) -> Result<u32, String> {
        let entry = reg.ranks.values().find(|e| e.generation == generation);
        authorize(generation, entry, p)
    }

    #[test]
    fn only_the_registered_process_gets_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let mut reg = Registry::new(&dir.path().join("run"), &dir.path().join("state"), 4).unwrap();
        let me = std::process::id();
        // A rank registered by itself, one by its launcher, one unseen.
        let own = register(&mut reg, 0, me, Some(me));
        let launched = register(&mut reg, 1, me, Some(1));
        let unseen = register(&mut reg, 2, 0, None);
        let cases: [(&str, u64, LocalPeer, bool, &str); 9] = [
            ("the rank itself", own, peer(1000, Some(me)), true, ""),
            (
                "another pid, same uid",
                own,
                peer(1000, Some(me + 1)),
                false,
                "pid",
            ),
            (
                "the rank's pid, another uid",
                own,
                peer(1001, Some(me)),
                false,
                "uid 1000",
            ),
            (
                "an unseen pid for a seen rank",
                own,
                peer(1000, None),
                false,
                "pid",
            ),
            (
                "the launcher that registered it",
                launched,
                peer(1000, Some(1)),
                true,
                "",
            ),
            (
                "an unseen rank, unseen caller, same uid",
                unseen,
                peer(1000, None),
                true,
                "",
            ),
            (
                "an unseen rank, a seen caller",
                unseen,
                peer(1000, Some(me)),
                false,
                "pid",
            ),
            (
                "an unseen rank, another uid",
                unseen,
                peer(1001, None),
                false,
                "uid",
            ),
            (
                "a generation nobody holds",
                own + 100,
                peer(1000, Some(me)),
                false,
                "register again",
            ),
        ];
        for (what, generation, p, ok, needle) in cases {
            match decide(&reg, generation, &p) {
                Ok(_) => assert!(ok, "{what}: granted"),
                Err(why) => {
                    assert!(!ok, "{what}: refused: {why}");
                    assert!(why.contains(needle), "{what}: {why}");
                }
            }
        }
        // A rank that left holds no slot: nobody gets it any more.
        let key = reg
            .ranks
            .values()
            .find(|e| e.generation == own)
            .unwrap()
            .key
            .clone();
        assert!(reg.deregister(&key, own));
        let why = decide(&reg, own, &peer(1000, Some(me))).unwrap_err();
        assert!(why.contains("register again"), "{why}");
    }

    #[test]
    fn requests_are_checked_for_their_protocol() {
        let mut b = warden_slot::socket::encode_request(42);
        assert_eq!(decode_request(&b), Ok(42));
        b[0] = b'X';
        let why = decode_request(&b).unwrap_err();
        assert!(why.contains("WSLTREQ1"), "{why}");
    }
}
