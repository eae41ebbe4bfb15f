//! A restore's view of a job through the exchange's two-level tree (issue
//! 30), so that no host asks every other what it holds.
//!
//! A restore must know which steps have a copy of every rank, and where its
//! own rank's copies are. Asked of every host, that is O(N) calls a host and
//! O(N^2) a job-wide restore, and past an agent's connection cap the later
//! hosts are refused (`fan_in`). Here the job's order (node-rank order from
//! the launchers' round, or the static fleet's sorted addresses) is cut into
//! groups of about the square root of its hosts
//! ([`warden_core::detect::straggler::tree`], `checkpoint.collect_fan_out`):
//!
//! - a restoring host asks its group's first host (its leader), which
//!   passes the ask on (`relayed`) to the job's first host; a host of group
//!   0 asks that one directly; where the leader does not answer, the host
//!   asks the job's first hosts itself;
//! - only group 0's hosts collect (a relayed ask is answered where it
//!   arrives); a host elsewhere whose collectors do not answer says so
//!   (they are named unreachable: the restore asks again), rather than
//!   collect itself, which under load made every host collect;
//! - the host that answers a job's ask *collects*: it asks each group's
//!   leader what its group holds (the leader lists its members' tiers; a
//!   leader that does not answer has its members listed directly), and
//!   shares one collection among the asks that come while it runs;
//! - the answer is the job's view for the asker's ranks: per step, the
//!   world size, how many ranks have a copy, the first missing, and those
//!   ranks' holders, whom the asker then lists itself (a few hosts). The
//!   ranks of one host that restore at once ask once (`super::restore`):
//!   at 8 ranks a host, a wave's asks at the collector are one a host, not
//!   one a rank. An older agent on the way answers the first rank alone;
//!   the asker asks for the others one by one, as it did before.
//!
//! So a host takes about 2√N connections (its group's asks and the other
//! collectors' group asks) and makes O(1) calls a restore, plus O(√N) as a
//! leader or collector. Failover comes from the order alone, as in the
//! exchange: no election, and an ask relayed once is never relayed again.
//! A finished collection serves the asks of the next `peer_timeout` too
//! (a wave of restores asks over longer than one collection takes, and
//! should see one view).
//!
//! Time: an ask carries the bound on one host's listing (`checkpoint.
//! peer_timeout` as the restoring host has it, L). A leader's group answer
//! takes about L at most (its listings run at once), and is waited for
//! 1.5L; a collection 2.5L (a group's leader waited for, then its hosts
//! listed directly), waited for 3L as a relayed ask; a leader passing an
//! ask on tries the job's first hosts within 5.5L and is waited for 6L. So
//! a holder that is silent costs a restore L, as asking every host did, a
//! silent group leader 2.5L, the asker's own silent leader 6L more (then
//! the asker tries two of the job's first hosts itself, 3L each).
//!
//! What a peer may make this agent do: a collection or a group's listing
//! is O(hosts) calls, so a peer that asks in a loop must not get one per
//! ask. Both are shared (one under way, or one finished within
//! `peer_timeout`, serves every ask for the same job), their listings are
//! bounded by this agent's own `peer_timeout` (or three times it, a
//! restore's second ask), never by the asker's word, so an ask's bound
//! picks one of two shared results; and a peer may start at most
//! [`STARTS_PER_PEER`] of them per `peer_timeout` (joining one is free).
//! Past that its ask is refused as busy, naming the quota, and the asker
//! goes on to the next collector.
//!
//! An agent from before the collector answers UNIMPLEMENTED: a restoring
//! host whose leader and collectors all do is told so
//! ([`ViewError::OldCollectors`]) and asks every host instead, as such an
//! agent would (a rolling upgrade of a large job still restores).
//!
//! In: a job, some ranks, the listing bound; a peer's ask ([`answer`]).
//! Out: the job's view for the ranks ([`JobView`]), or a group's holdings. Never:
//! answers later than its bound says; counts a host that could not be asked
//! as holding nothing (it is named unreachable).

use std::sync::Arc;
use std::time::Duration;

use warden_core::detect::straggler::tree;

use super::Checkpoints;
use super::holdings::{Counted, Holdings, JobView};
use super::link_error::LinkError;

/// How long a group's answer is waited for, in listing bounds.
const GROUP_WAIT: f64 = 1.5;

/// How long a relayed job's ask is waited for (a collection: 2.5).
const RELAYED_WAIT: f64 = 3.0;

/// How long a restoring host waits for its leader's answer (a relayed ask,
/// then a collection: 5.5).
const JOB_WAIT: f64 = 6.0;

/// How many collections or group listings one peer may start here per
/// `peer_timeout` (joining one under way or kept is free). A collector's
/// legitimate starts are a few per job and restore wave: one per listing
/// bound, again after a commit sealed here.
pub const STARTS_PER_PEER: u32 = 16;

/// How many times `peer_timeout` a restore's second ask gives each listing
/// (the collector's larger listing bound).
const SECOND_ASK: u32 = 3;

/// What is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AskScope {
    /// The job's view, for these ranks.
    Job {
        /// The ranks whose copies the asker wants located (one at least,
        /// [`super::holdings::MAX_VIEW_RANKS`] at most, each once; an older
        /// agent reads the first alone).
        ranks: Vec<u32>,
    },
    /// What the group starting at this index of the job's order holds.
    Group {
        /// Index into the job's order.
        start: usize,
    },
}

/// One ask.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The job.
    pub job: String,
    /// What is asked.
    pub scope: AskScope,
    /// Passed on by a group leader: answered where it arrives.
    pub relayed: bool,
    /// The bound on one host's listing (L); the answer's own bound follows
    /// from it and the scope.
    pub limit: Duration,
}

/// An answer.
#[derive(Debug)]
pub enum Collected {
    /// The job's view for the asked ranks.
    Job(JobView),
    /// A group's holdings.
    Group(Holdings),
}

/// Why an ask was refused.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// The asking peer started its quota of collections and listings here.
    #[error(
        "busy: peer {peer:?} started {tokens} collections or group listings here within {}; \
         the next may start in {}",
        humantime::format_duration(*period),
        humantime::format_duration(*wait)
    )]
    Busy {
        /// The asking peer's identity ("" without peer authentication).
        peer: String,
        /// The quota's tokens ([`STARTS_PER_PEER`]).
        tokens: u32,
        /// Over how long they refill (`peer_timeout`).
        period: Duration,
        /// Until the next token.
        wait: Duration,
    },
    /// This host, a group leader, passed the ask on to the job's first
    /// hosts, and each answered that it does not know the call.
    #[error("{0}")]
    OldCollectors(String),
    /// The group asked for starts past the job's order as known here.
    #[error("group: index {start}, but the job's order here has {len} hosts")]
    NoSuchGroup {
        /// The index asked.
        start: usize,
        /// The order's length here.
        len: usize,
    },
}

/// Whether a restore of `job` goes through the collector: a named job of
/// more hosts than `checkpoint.collect_above`.
pub fn collects(ck: &Checkpoints, job: &str) -> bool {
    !job.is_empty()
        && ck
            .peers
            .with_order_or_static(job, |o, _| o.len() > 1 && o.len() > ck.cfg.collect_above)
}

/// Why a restoring host has no view from the collectors.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// Every host it asked (its leader, the job's first hosts) runs an
    /// agent without CollectHoldings: the restore asks every host instead.
    #[error(
        "the job's checkpoint collectors run an agent without CollectHoldings ({0}); \
         asking every host instead"
    )]
    OldCollectors(String),
}

/// The bound a collection's or group listing's each listing gets here, for
/// an ask bounded by `asked`: this agent's `peer_timeout` (L), or `3L` for
/// an ask of at least that (a restore's second ask). An asker's bound only
/// picks one of the two (each collection is shared per bound), and cannot
/// hold this agent's listings longer than its own config allows.
pub fn listing_bound(ck: &Checkpoints, asked: Duration) -> Duration {
    let own = ck.cfg.peer_timeout;
    if asked >= own * SECOND_ASK {
        own * SECOND_ASK
    } else {
        own
    }
}

/// Lets `peer` start one more collection or group listing here, or says
/// it is busy.
fn admit(ck: &Checkpoints, peer: &str) -> Result<(), CollectError> {
    ck.collect_quota
        .take(&peer.to_owned(), std::time::Instant::now())
        .map_err(|wait| {
            let (tokens, period) = ck.collect_quota.size();
            CollectError::Busy {
                peer: peer.to_owned(),
                tokens,
                period,
                // Whole milliseconds, rounded up: the message is read.
                wait: Duration::from_millis(
                    u64::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u64::MAX),
                ),
            }
        })
}

/// The group size for a job of `len` hosts.
pub(crate) fn group_size(ck: &Checkpoints, len: usize) -> usize {
    tree::fan_out(len, ck.cfg.collect_fan_out).max(1)
}

/// How many of the job's first hosts an ask tries, one after another.
const MAX_TRIES: usize = 2;

/// Where a host stands in `job`'s order: the leader of its group when it is
/// not that leader itself (None in group 0, whose hosts ask the collectors
/// directly), the collectors it may ask (group 0's hosts, before itself when
/// it is one of them), and whether it may collect itself (it is in group
/// 0). A host not in the order asks group 0 and never collects.
fn place(ck: &Checkpoints, job: &str) -> (Option<String>, Vec<String>, bool) {
    ck.peers.with_order_or_static(job, |order, me| {
        let k = group_size(ck, order.len());
        match me.filter(|&p| p < order.len()) {
            Some(pos) if pos < k => (None, order.addrs_in(0..pos), true),
            Some(pos) => {
                // Its group's first host known here: the leader in a
                // whole order.
                let start = pos / k * k;
                let leader = order.range(start..pos).next().map(|(_, a)| a.to_owned());
                (leader, order.addrs_in(0..k), false)
            }
            None => (None, order.addrs_in(0..k), false),
        }
    })
}

/// The job's view for `ranks` (one at least; an older agent on the way
/// answers the first alone: [`JobView::ranks`] says which were answered)
/// as a restoring host gets it, each host's listing bounded by `limit`:
/// asked of its group's leader (which passes it on to a collector), else of the job's first hosts (group 0) itself,
/// else, in group 0, collected here. A host outside group 0 never
/// collects: were the collectors out of reach for one host, they would be
/// for many, and every host collecting is every host asking every other
/// (measured: at 512 hosts on one machine that took two minutes and every
/// restore failed). It answers the collectors unreachable instead, and the
/// restore asks again, then answers ABORTED. Where every host asked runs an
/// agent without the call, it says so ([`ViewError::OldCollectors`]).
pub async fn job_view(
    ck: &Arc<Checkpoints>,
    job: &str,
    ranks: &[u32],
    limit: Duration,
) -> Result<JobView, ViewError> {
    let (leader, collectors, collects_here) = place(ck, job);
    let ask = |relayed| Ask {
        job: job.to_owned(),
        scope: AskScope::Job {
            ranks: ranks.to_vec(),
        },
        relayed,
        limit,
    };
    let (mut silent, mut old) = (Vec::new(), Vec::new());
    if let Some(l) = leader {
        match view_from(ck, &l, &ask(false), limit.mul_f64(JOB_WAIT)).await {
            Reply::View(v) => return Ok(v),
            Reply::Old(why) => old.push(why),
            Reply::No => {}
        }
    }
    for c in collectors.iter().take(MAX_TRIES) {
        match view_from(ck, c, &ask(true), limit.mul_f64(RELAYED_WAIT)).await {
            Reply::View(v) => return Ok(v),
            Reply::Old(why) => old.push(why),
            Reply::No => silent.push(c.clone()),
        }
    }
    if collects_here {
        return Ok(collected(ck, job, ranks, limit).await);
    }
    if silent.is_empty() && !old.is_empty() {
        return Err(ViewError::OldCollectors(old.join("; ")));
    }
    Ok(collectors_silent(&silent, ranks))
}

/// A view of `ranks` that says only that the collectors did not answer
/// (it answers every rank: none is asked again apart, to the same
/// silence).
fn collectors_silent(tried: &[String], ranks: &[u32]) -> JobView {
    JobView {
        steps: Default::default(),
        ranks: ranks.iter().copied().collect(),
        unreachable: vec![format!(
            "the job's checkpoint collectors (its first hosts) did not answer: {}",
            if tried.is_empty() {
                "none could be asked".to_owned()
            } else {
                tried.join(", ")
            }
        )],
    }
}

/// Answers a peer's ask; `peer` is the asker's identity, whose quota a
/// collection or group listing started for it takes from.
pub async fn answer(
    ck: &Arc<Checkpoints>,
    ask: Ask,
    peer: &str,
) -> Result<Collected, CollectError> {
    match ask.scope {
        AskScope::Group { start } => group_here(ck, &ask.job, start, ask.limit, peer)
            .await
            .map(Collected::Group),
        AskScope::Job { ranks } => answer_job(ck, &ask.job, &ranks, ask.relayed, ask.limit, peer)
            .await
            .map(Collected::Job),
    }
}

/// The job's view for `ranks`, each listing bounded by `limit`: collected
/// here when the ask was relayed (its sender took this host for a
/// collector) or this host is in group 0; else, as its group's leader,
/// passed on to the job's first hosts while the asker's wait allows (a
/// view naming them unreachable when none answered).
async fn answer_job(
    ck: &Arc<Checkpoints>,
    job: &str,
    ranks: &[u32],
    relayed: bool,
    limit: Duration,
    peer: &str,
) -> Result<JobView, CollectError> {
    let (_, collectors, collects_here) = place(ck, job);
    if relayed || collects_here {
        let bound = listing_bound(ck, limit);
        let held = ck
            .collections
            .view_admitted(
                job,
                &[],
                bound,
                ck.sealing.sealed(),
                || admit(ck, peer),
                || async { Counted::new(collect_now(ck, job, bound).await) },
            )
            .await?;
        return Ok(held.for_ranks(ranks));
    }
    let ask = Ask {
        job: job.to_owned(),
        scope: AskScope::Job {
            ranks: ranks.to_vec(),
        },
        relayed: true,
        limit,
    };
    // The asker waits JOB_WAIT: one silent collector, or fast refusals.
    let deadline = tokio::time::Instant::now() + limit.mul_f64(JOB_WAIT - 0.5);
    let (mut silent, mut old) = (Vec::new(), Vec::new());
    for c in collectors.iter().take(MAX_TRIES) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left < limit.mul_f64(RELAYED_WAIT) {
            break;
        }
        match view_from(ck, c, &ask, limit.mul_f64(RELAYED_WAIT)).await {
            Reply::View(v) => return Ok(v),
            Reply::Old(why) => old.push(why),
            Reply::No => silent.push(c.clone()),
        }
    }
    if silent.is_empty() && !old.is_empty() {
        return Err(CollectError::OldCollectors(old.join("; ")));
    }
    Ok(collectors_silent(&silent, ranks))
}

/// The job's view for `ranks` from this agent's collection for its own
/// restores (one under way, or one finished within `peer_timeout`, is
/// shared; no quota).
async fn collected(ck: &Arc<Checkpoints>, job: &str, ranks: &[u32], limit: Duration) -> JobView {
    let bound = listing_bound(ck, limit);
    let held = ck
        .collections
        .view(job, &[], bound, ck.sealing.sealed(), || async {
            Counted::new(collect_now(ck, job, bound).await)
        })
        .await;
    held.for_ranks(ranks)
}

/// How one host answered an ask for the job's view.
enum Reply {
    /// The view.
    View(JobView),
    /// It does not know the call (an agent from before the collector), or
    /// it passed the ask on to such agents: why.
    Old(String),
    /// It did not answer, or refused (logged).
    No,
}

/// The job's view `addr` gives to `ask` within `wait`.
async fn view_from(ck: &Arc<Checkpoints>, addr: &str, ask: &Ask, wait: Duration) -> Reply {
    let why = match ck.peer(addr) {
        Some(peer) => match peer.collect(ask, wait).await {
            Ok(Collected::Job(v)) => return Reply::View(v),
            Ok(Collected::Group(_)) => "answered another question".to_owned(),
            Err(LinkError::Unsupported(why)) => {
                return Reply::Old(format!("peer {addr}: {why}"));
            }
            Err(e) => e.to_string(),
        },
        None => "not one of this agent's peers".to_owned(),
    };
    tracing::info!(
        job = %ask.job,
        host = %addr,
        error = %why,
        "the checkpoint collector on the way did not answer; going on from here"
    );
    Reply::No
}

/// One collection of what `job`'s hosts hold, each listing bounded by
/// `limit`: each group's leader asked for its group (waited for 1.5
/// `limit`), and a group whose leader did not answer listed here directly.
async fn collect_now(ck: &Arc<Checkpoints>, job: &str, limit: Duration) -> Holdings {
    let (groups, mine, unknown) = ck.peers.with_order_or_static(job, |order, me| {
        let k = group_size(ck, order.len());
        // A group none of whose hosts is known here (a partial view: a
        // collector is to be handed the whole order, and is warned when it
        // is not) is not asked; its places are named unreachable below.
        let groups: Vec<(usize, Vec<String>)> = (0..order.len())
            .step_by(k)
            .map(|s| (s, order.addrs_in(s..s + k)))
            .filter(|(_, members)| !members.is_empty())
            .collect();
        (
            groups,
            me.map(|p| p / k * k),
            unknown_places(order, 0..order.len()),
        )
    });
    let groups = groups.into_iter().map(|(start, members)| {
        let (ck, job) = (ck.clone(), job.to_owned());
        tokio::spawn(async move {
            if mine == Some(start) {
                return list_hosts(&ck, &job, members, limit).await;
            }
            let leader = members[0].clone();
            let ask = Ask {
                job: job.clone(),
                scope: AskScope::Group { start },
                relayed: false,
                limit,
            };
            let why = match ck.peer(&leader) {
                Some(p) => match p.collect(&ask, limit.mul_f64(GROUP_WAIT)).await {
                    Ok(Collected::Group(mut h)) => {
                        // The leader's order may differ from this one's (a
                        // round changing): the members it did not account
                        // for are listed here.
                        let left: Vec<String> =
                            members.into_iter().filter(|a| !h.accounts_for(a)).collect();
                        if !left.is_empty() {
                            h.merge(list_hosts(&ck, &job, left, limit).await);
                        }
                        return h;
                    }
                    Ok(Collected::Job(_)) => "answered another question".to_owned(),
                    Err(e) => e.to_string(),
                },
                None => "not one of this agent's peers".to_owned(),
            };
            tracing::info!(
                job = %job,
                leader = %leader,
                error = %why,
                "a checkpoint group's leader did not answer; listing its hosts from here"
            );
            list_hosts(&ck, &job, members, limit).await
        })
    });
    let groups: Vec<_> = groups.collect();
    // The durable store, counted here once for every restoring host (each
    // reads only its own rank's manifests there).
    let durable = ck.durable.as_ref().map(|_| {
        let ck = ck.clone();
        let job = job.to_owned();
        tokio::spawn(async move {
            let d = ck.durable.as_ref()?;
            let listed = tokio::time::timeout(limit, d.ranks(&job)).await;
            Some((d.url().to_owned(), listed))
        })
    });
    let mut all = Holdings::default();
    all.unreachable.extend(unknown);
    for g in groups {
        match g.await {
            Ok(h) => all.merge(h),
            Err(e) => all.unreachable.push(format!("a group's collection: {e}")),
        }
    }
    if let Some(d) = durable {
        match d.await {
            Ok(Some((url, Ok(Ok(steps))))) => all.add_durable(&url, steps),
            Ok(Some((url, Ok(Err(e))))) => all.unreachable.push(format!("durable {url}: {e}")),
            Ok(Some((url, Err(_)))) => all.unreachable.push(format!(
                "durable {url}: not listed within {}",
                humantime::format_duration(limit)
            )),
            Ok(None) => {}
            Err(e) => all
                .unreachable
                .push(format!("the durable store's listing: {e}")),
        }
    }
    all
}

/// What the hosts of the group starting at `start` of `job`'s order hold:
/// each listed within this agent's bound for `limit` (its own tier read
/// here), shared like a collection and started within `peer`'s quota.
async fn group_here(
    ck: &Arc<Checkpoints>,
    job: &str,
    start: usize,
    limit: Duration,
    peer: &str,
) -> Result<Holdings, CollectError> {
    let (members, unknown) = ck.peers.with_order_or_static(job, |order, _| {
        if start >= order.len() {
            return Err(CollectError::NoSuchGroup {
                start,
                len: order.len(),
            });
        }
        let group = start..start + group_size(ck, order.len());
        Ok((order.addrs_in(group.clone()), unknown_places(order, group)))
    })?;
    let bound = listing_bound(ck, limit);
    // An order's index fits a u32 (the order is bounded far below).
    let part = u32::try_from(start).unwrap_or(u32::MAX);
    let held = ck
        .group_listings
        .view_admitted(
            job,
            &[part],
            bound,
            ck.sealing.sealed(),
            || admit(ck, peer),
            || async move {
                let mut h = list_hosts(ck, job, members, bound).await;
                h.unreachable.extend(unknown);
                h
            },
        )
        .await?;
    Ok(Holdings::clone(&held))
}

/// The places of `r` in `order` not known here (a partial view), as one
/// unreachable entry: their holdings are not known, so a restore does not
/// take what the others hold for the whole job's (it asks again, then
/// answers ABORTED, as for a host that did not answer).
fn unknown_places(order: &super::order::Order, r: std::ops::Range<usize>) -> Option<String> {
    let end = r.end.min(order.len());
    let start = r.start.min(end);
    let missing = (end - start) - order.range(start..end).count();
    (missing > 0).then(|| {
        let first = (start..end).find(|p| order.get(*p).is_none()).unwrap_or(start);
        format!(
            "{missing} of the job's places {start}..{end} were not handed over to this host (the first: \
             place {first}): what they hold is not known here"
        )
    })
}

/// What `hosts` hold of `job`, each listed within `limit` (this agent's own
/// tier read here); a host not listed is named unreachable, with why.
async fn list_hosts(
    ck: &Arc<Checkpoints>,
    job: &str,
    members: Vec<String>,
    limit: Duration,
) -> Holdings {
    let me = ck.peers.my_addr().to_owned();
    let known_as = ck.peers.known_as(job);
    let lists = members.into_iter().map(|addr| {
        let (ck, job, me, known_as) = (ck.clone(), job.to_owned(), me.clone(), known_as.clone());
        tokio::spawn(async move {
            if addr == me || addr == known_as {
                let (ck2, j) = (ck.clone(), job.clone());
                let local = tokio::task::spawn_blocking(move || ck2.tier.list(Some(&j)))
                    .await
                    .unwrap_or_default();
                // Under the address the job's other hosts know this agent
                // by (its order names it by api.tcp, which may be 0.0.0.0
                // or port 0): they ask it for its copies there.
                return (known_as, Ok((ck.host.clone(), local)));
            }
            let Some(peer) = ck.peer(&addr) else {
                return (addr, Err("not one of this agent's peers".to_owned()));
            };
            let r = peer.list(&job, limit).await.map_err(|e| e.to_string());
            (
                addr,
                r.map(|l| {
                    let ok = l.shards.into_iter().filter_map(Result::ok).collect();
                    (l.host, ok)
                }),
            )
        })
    });
    let lists: Vec<_> = lists.collect();
    let mut h = Holdings::default();
    for l in lists {
        match l.await {
            Ok((addr, Ok((host, shards)))) => h.add_listing(&addr, &host, job, &shards),
            Ok((addr, Err(e))) => h.unreachable.push(format!("peer {addr}: {e}")),
            Err(e) => h.unreachable.push(format!("a listing: {e}")),
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::super::order::Order;
    use super::*;

    /// A collection over a partial order names the places it lacks, so a
    /// restore does not take what the others hold for the job's.
    #[test]
    fn the_places_not_handed_over_are_named_unreachable() {
        let a = |p: usize| (p, format!("127.0.0.{}:7000", p + 2));
        let part = Order::partial(8, [0, 1, 2, 5, 6].map(a).to_vec()).expect("valid");
        let all = unknown_places(&part, 0..8).expect("three missing");
        assert!(
            all.starts_with("3 of the job's places 0..8 were not handed over")
                && all.contains("the first: place 3"),
            "{all}"
        );
        assert_eq!(unknown_places(&part, 0..3), None);
        let group = unknown_places(&part, 6..9).expect("place 7");
        assert!(group.starts_with("1 of the job's places 6..8"), "{group}");
        let whole = Order::whole((0..4).map(|p| a(p).1).collect());
        assert_eq!(unknown_places(&whole, 0..4), None);
    }
}
