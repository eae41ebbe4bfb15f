//! Whether a peer's replica is taken here (PushShard), decided on its first
//! chunk, before anything touches the tier.
//!
//! In: who pushed it (the identity its certificate proves; None over an
//! insecure listener or the local socket, where today's behaviour holds),
//! the origin its manifest names, and this host's view of the job's ring.
//! Out: nothing, or [`Refused`] naming the rule. Pure but for the ring
//! lookup; the table test below covers every rule.

use super::Checkpoints;

/// Why a replica was refused: the rule and what broke it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refused by rule {rule}: {why}")]
pub struct Refused {
    /// The rule's name (`origin-not-this-host`, `origin-is-pusher`,
    /// `placement`).
    pub rule: &'static str,
    /// What broke it, naming the hosts and the job.
    pub why: String,
}

/// What a replica is checked against.
#[derive(Debug)]
pub struct Offer<'a> {
    /// The identity the pusher's certificate proves, if any.
    pub pusher: Option<&'a str>,
    /// The job of the shard.
    pub job: &'a str,
    /// The origin its manifest names.
    pub origin: &'a str,
    /// This host's name.
    pub this_host: &'a str,
    /// Whether the job's placement, computed from the origin's place on
    /// the ring, names this host as a target of the origin's shards
    /// (None: the origin is not on the job's ring at all).
    pub placed_here: Option<bool>,
}

/// Takes or refuses the replica of `origin`'s shard of `job` pushed by
/// `pusher`, against `ck`'s view of the job's ring.
pub fn replica(
    ck: &Checkpoints,
    pusher: Option<&str>,
    job: &str,
    origin: &str,
) -> Result<(), Refused> {
    rules(&Offer {
        pusher,
        job,
        origin,
        this_host: &ck.host,
        placed_here: ck.peers.placed_here(job, origin),
    })
}

/// The rules: `origin-not-this-host` (a replica naming this host as origin
/// would let retention delete this host's own steps), `origin-is-pusher`
/// (a peer pushes only its own shards, so nobody forges another host's
/// steps), and `placement` (this host is where the job's ring sends that
/// origin's replicas). An unproved pusher is not checked.
pub fn rules(f: &Offer<'_>) -> Result<(), Refused> {
    let Some(id) = f.pusher else {
        return Ok(());
    };
    let refused = |rule, why| Err(Refused { rule, why });
    if f.origin == f.this_host {
        return refused(
            "origin-not-this-host",
            format!(
                "the shard names this host ({:?}) as its origin; a replica comes from another host",
                f.this_host
            ),
        );
    }
    if f.origin != id {
        return refused(
            "origin-is-pusher",
            format!(
                "peer {id:?} pushed a shard whose origin is {:?}; a peer pushes only its own shards",
                f.origin
            ),
        );
    }
    match f.placed_here {
        Some(true) => Ok(()),
        Some(false) => refused(
            "placement",
            format!(
                "job {:?}'s placement does not send {id:?}'s replicas to this host",
                f.job
            ),
        ),
        None => refused(
            "placement",
            format!("{id:?} is not on job {:?}'s ring on this host", f.job),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(pusher: Option<&str>, origin: &str, placed: Option<bool>) -> &'static str {
        let offer = Offer {
            pusher,
            job: "j",
            origin,
            this_host: "h0",
            placed_here: placed,
        };
        match rules(&offer) {
            Ok(()) => "ok",
            Err(r) => {
                assert!(
                    r.to_string()
                        .starts_with(&format!("refused by rule {}: ", r.rule)),
                    "{r}"
                );
                r.rule
            }
        }
    }

    #[test]
    fn each_rule_refuses_by_name_and_an_unproved_pusher_keeps_todays_behaviour() {
        let cases = [
            ("own shard", Some("h1"), "h1", Some(true), "ok"),
            (
                "another's shard",
                Some("h1"),
                "h2",
                Some(true),
                "origin-is-pusher",
            ),
            (
                "this host as origin",
                Some("h1"),
                "h0",
                Some(true),
                "origin-not-this-host",
            ),
            (
                "not placed here",
                Some("h1"),
                "h1",
                Some(false),
                "placement",
            ),
            ("off the ring", Some("h1"), "h1", None, "placement"),
            ("insecure push", None, "h0", None, "ok"),
        ];
        for (name, pusher, origin, placed, want) in cases {
            assert_eq!(rule(pusher, origin, placed), want, "{name}");
        }
    }
}
