//! Who may do what on `warden.v1.Peer`: the rules applied to a peer agent
//! authenticated by its certificate on `api.tcp`.
//!
//! In: the caller as the accept path recorded it ([`PeerInfo`] in the
//! request's extensions) and what the request names (a job, a summary's
//! or a relayed report's host), with this host's view of each job's peers.
//! Whether a pushed replica is taken (its origin, the job's placement) is
//! the checkpoint tier's own decision, [`crate::ckpt::accept`].
//! Out: nothing, or PERMISSION_DENIED whose message names the rule. The
//! rules are pure functions of that data, tested by the table below.
//! Never: authorize an identity it cannot name. With `api.insecure` the
//! caller is unknown and today's behaviour holds (the agent says so at
//! start and in `warden health`); over the Unix socket the caller is
//! local and the socket's own authorization applies.

use tonic::Status;

use crate::tls::accept::PeerInfo;

/// The caller of a Peer method.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Over the Unix socket (no [`PeerInfo`]): a local process.
    Local,
    /// Over `api.tcp` with `api.insecure = true`: nobody knows who.
    Unauthenticated,
    /// Over `api.tcp` with mutual TLS: the identity its certificate proves.
    Peer(String),
}

impl Caller {
    /// The caller of a request with these extensions.
    pub fn of(info: Option<&PeerInfo>) -> Self {
        match info {
            None => Caller::Local,
            Some(PeerInfo { identity: None, .. }) => Caller::Unauthenticated,
            Some(PeerInfo {
                identity: Some(id), ..
            }) => Caller::Peer(id.clone()),
        }
    }

    /// The authenticated identity, when there is one to check.
    pub fn identity(&self) -> Option<&str> {
        match self {
            Caller::Peer(id) => Some(id),
            Caller::Local | Caller::Unauthenticated => None,
        }
    }
}

fn denied(rule: &str, why: String) -> Status {
    Status::permission_denied(format!("refused by rule {rule}: {why}"))
}

/// Rule `job-member`: a peer reads (fetch, list) or writes (push) shards
/// of `job` only when it is one of the job's peers on this host: handed
/// over by the job's launcher (SetCheckpointPeers) or configured in
/// `[[checkpoint.peers]]` with its `name`.
pub fn job_member(
    caller: &Caller,
    job: &str,
    is_member: impl Fn(&str) -> bool,
) -> Result<(), Status> {
    let Some(id) = caller.identity() else {
        return Ok(());
    };
    if is_member(id) {
        return Ok(());
    }
    Err(denied(
        "job-member",
        format!("peer {id:?} is not a checkpoint peer of job {job:?} on this host"),
    ))
}

/// Rules for ExchangeStragglerSummaries: `summaries-from-caller` (a peer
/// speaks only for its own host) and `straggler-peer` (it is a peer this
/// agent knows: one of its `straggler.peers`, whose name this agent's own
/// dial proved, or a checkpoint peer of any job).
pub fn straggler(caller: &Caller, batch_host: &str, known: bool) -> Result<(), Status> {
    let Some(id) = caller.identity() else {
        return Ok(());
    };
    if batch_host != id {
        return Err(denied(
            "summaries-from-caller",
            format!("peer {id:?} sent summaries for host {batch_host:?}"),
        ));
    }
    if !known {
        return Err(denied(
            "straggler-peer",
            format!(
                "peer {id:?} is neither a straggler peer this agent dialed nor a checkpoint peer"
            ),
        ));
    }
    Ok(())
}

/// Rule `relay-from-peer`: a report relayed by a group leader of the
/// two-level exchange speaks for another host of the leader's group, so
/// the leader itself must be a peer this agent takes reports from
/// (`known`), and the report's host one of each job's peers
/// ([`relayed_for`]).
pub fn relay(caller: &Caller, known: bool) -> Result<(), Status> {
    let Some(id) = caller.identity() else {
        return Ok(());
    };
    if !known {
        return Err(denied(
            "relay-from-peer",
            format!(
                "peer {id:?} relayed a report but is neither a straggler peer this agent dialed \
                 nor a checkpoint peer"
            ),
        ));
    }
    Ok(())
}

/// Rule `relay-for-member`: a relayed report's host is one of `job`'s
/// peers here (checked only where the caller has an identity, as every
/// rule of this module).
pub fn relayed_for(
    caller: &Caller,
    host: &str,
    job: &str,
    is_member: impl Fn(&str) -> bool,
) -> Result<(), Status> {
    if caller.identity().is_none() || is_member(host) {
        return Ok(());
    }
    Err(denied(
        "relay-for-member",
        format!(
            "a report relayed for host {host:?}, which is not a checkpoint peer of job {job:?} on this host"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str) -> Caller {
        Caller::Peer(id.into())
    }

    fn rule(r: Result<(), Status>) -> String {
        match r {
            Ok(()) => "ok".into(),
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
                s.message()
                    .strip_prefix("refused by rule ")
                    .and_then(|m| m.split(':').next())
                    .unwrap_or("?")
                    .to_owned()
            }
        }
    }

    #[test]
    fn each_rule_refuses_by_name_and_unknown_callers_keep_todays_behaviour() {
        let members = ["h1".to_owned(), "h2".to_owned()];
        let cases: Vec<(&str, Result<(), Status>, &str)> = vec![
            (
                "member",
                job_member(&peer("h1"), "j", |n| members.iter().any(|m| m == n)),
                "ok",
            ),
            (
                "not a member",
                job_member(&peer("h9"), "j", |n| members.iter().any(|m| m == n)),
                "job-member",
            ),
            ("local", job_member(&Caller::Local, "j", |_| false), "ok"),
            ("relay from a known peer", relay(&peer("h1"), true), "ok"),
            (
                "relay from an unknown peer",
                relay(&peer("h9"), false),
                "relay-from-peer",
            ),
            (
                "relayed for a member",
                relayed_for(&peer("h1"), "h2", "j", |n| members.iter().any(|m| m == n)),
                "ok",
            ),
            (
                "relayed for a stranger",
                relayed_for(&peer("h1"), "h9", "j", |n| members.iter().any(|m| m == n)),
                "relay-for-member",
            ),
            (
                "relayed, insecure",
                relayed_for(&Caller::Unauthenticated, "h9", "j", |_| false),
                "ok",
            ),
            (
                "insecure",
                job_member(&Caller::Unauthenticated, "j", |_| false),
                "ok",
            ),
            ("own summaries", straggler(&peer("h1"), "h1", true), "ok"),
            (
                "someone else's summaries",
                straggler(&peer("h1"), "h2", true),
                "summaries-from-caller",
            ),
            (
                "unknown peer",
                straggler(&peer("h1"), "h1", false),
                "straggler-peer",
            ),
        ];
        for (name, got, want) in cases {
            assert_eq!(rule(got), want, "{name}");
        }
    }

    #[test]
    fn the_caller_comes_from_the_connection() {
        assert_eq!(Caller::of(None), Caller::Local);
        let mut info = PeerInfo {
            remote: None,
            identity: None,
        };
        assert_eq!(Caller::of(Some(&info)), Caller::Unauthenticated);
        info.identity = Some("h1".into());
        assert_eq!(Caller::of(Some(&info)), peer("h1"));
    }
}
