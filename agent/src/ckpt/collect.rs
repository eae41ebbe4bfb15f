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
//! - a restoring host asks its group's first host (its leader; the next
//!   when that one does not answer; itself when it is the first);
//! - a leader outside group 0 passes the ask on to group 0's first hosts
//!   (`relayed`), which answer it where it arrives;
//! - the host that answers a job's ask *collects*: it asks each group's
//!   leader what its group holds (the leader lists its members' tiers; a
//!   leader that does not answer has its members listed directly), and
//!   shares one collection among the asks that come while it runs;
//! - the answer is the job's view for the asker's rank: per step, the
//!   world size, how many ranks have a copy, the first missing, and that
//!   rank's holders, whom the asker then lists itself (a few hosts).
//!
//! So a host takes about 2√N connections (its group's asks and the other
//! collectors' group asks) and makes O(1) calls a restore, plus O(√N) as a
//! leader or collector. Failover comes from the order alone, as in the
//! exchange: no election, and an ask relayed once is never relayed again.
//!
//! Time: an ask carries the bound on one host's listing (`checkpoint.
//! peer_timeout` as the restoring host has it, L). A leader's group answer
//! takes about L at most (its listings run at once), and is waited for
//! 1.5L; a collection 2.5L (a group's leader waited for, then its hosts
//! listed directly), waited for 3L; a relayed ask 3L and then, unanswered,
//! a collection here: 5.5L, waited for 6L. So a holder that is silent costs
//! a restore L, as asking every host did, and a silent leader 2.5L.
//!
//! In: a job, a rank, the listing bound; a peer's ask ([`answer`]). Out: the
//! job's view for the rank ([`JobView`]), or a group's holdings. Never:
//! answers later than its bound says; counts a host that could not be asked
//! as holding nothing (it is named unreachable).

use std::sync::Arc;
use std::time::Duration;

use warden_core::detect::straggler::tree;

use super::Checkpoints;
use super::holdings::{Holdings, JobView};

/// How long a group's answer is waited for, in listing bounds.
const GROUP_WAIT: f64 = 1.5;

/// How long a relayed job's ask is waited for (a collection: 2.5).
const RELAYED_WAIT: f64 = 3.0;

/// How long a restoring host waits for its leader's answer (a relayed ask,
/// then a collection: 5.5).
const JOB_WAIT: f64 = 6.0;

/// What is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The job's view, for this rank.
    Job {
        /// The rank whose copies the asker wants located.
        rank: u32,
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
    pub scope: Scope,
    /// Passed on by a group leader: answered where it arrives.
    pub relayed: bool,
    /// The bound on one host's listing (L); the answer's own bound follows
    /// from it and the scope.
    pub limit: Duration,
}

/// An answer.
#[derive(Debug)]
pub enum Answer {
    /// The job's view for the asked rank.
    Job(JobView),
    /// A group's holdings.
    Group(Holdings),
}

/// Why an ask was refused.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
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

/// The group size for a job of `len` hosts.
fn group_size(ck: &Checkpoints, len: usize) -> usize {
    tree::fan_out(len, ck.cfg.collect_fan_out).max(1)
}

/// The job's view for `rank` as a restoring host gets it, each host's
/// listing bounded by `limit`: asked of its group's leader, or answered
/// here when it leads its group or its leader did not answer.
pub async fn job_view(ck: &Arc<Checkpoints>, job: &str, rank: u32, limit: Duration) -> JobView {
    let leader = ck.peers.with_order_or_static(job, |order, me| {
        let pos = me.filter(|&p| p < order.len())?;
        let start = pos / group_size(ck, order.len()) * group_size(ck, order.len());
        (start < pos).then(|| order[start].clone())
    });
    let ask = Ask {
        job: job.to_owned(),
        scope: Scope::Job { rank },
        relayed: false,
        limit,
    };
    if let Some(v) = view_from(ck, leader, &ask, limit.mul_f64(JOB_WAIT)).await {
        return v;
    }
    answer_job(ck, job, rank, false, limit).await
}

/// Answers a peer's ask.
pub async fn answer(ck: &Arc<Checkpoints>, ask: Ask) -> Result<Answer, CollectError> {
    match ask.scope {
        Scope::Group { start } => group_here(ck, &ask.job, start, ask.limit)
            .await
            .map(Answer::Group),
        Scope::Job { rank } => Ok(Answer::Job(
            answer_job(ck, &ask.job, rank, ask.relayed, ask.limit).await,
        )),
    }
}

/// The job's view for `rank`, each listing bounded by `limit`: passed on
/// to the job's first host when this agent is in another group and the ask
/// was not relayed yet, else (or when that host did not answer) collected
/// here.
async fn answer_job(
    ck: &Arc<Checkpoints>,
    job: &str,
    rank: u32,
    relayed: bool,
    limit: Duration,
) -> JobView {
    if !relayed {
        let first = ck.peers.with_order_or_static(job, |order, me| {
            let pos = me.filter(|&p| p < order.len())?;
            (pos >= group_size(ck, order.len())).then(|| order[0].clone())
        });
        let ask = Ask {
            job: job.to_owned(),
            scope: Scope::Job { rank },
            relayed: true,
            limit,
        };
        if let Some(v) = view_from(ck, first, &ask, limit.mul_f64(RELAYED_WAIT)).await {
            return v;
        }
    }
    let held = ck
        .collections
        .view(job, None, limit, ck.sealing.sealed(), || {
            collect_now(ck, job, limit)
        })
        .await;
    held.for_rank(rank)
}

/// The job's view `host` gives to `ask` within `wait`; None when there is
/// no such host or it did not answer (logged).
async fn view_from(
    ck: &Arc<Checkpoints>,
    host: Option<String>,
    ask: &Ask,
    wait: Duration,
) -> Option<JobView> {
    let addr = host?;
    let why = match ck.peer(&addr) {
        Some(peer) => match peer.collect(ask, wait).await {
            Ok(Answer::Job(v)) => return Some(v),
            Ok(Answer::Group(_)) => "answered another question".to_owned(),
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
    None
}

/// One collection of what `job`'s hosts hold, each listing bounded by
/// `limit`: each group's leader asked for its group (waited for 1.5
/// `limit`), and a group whose leader did not answer listed here directly.
async fn collect_now(ck: &Arc<Checkpoints>, job: &str, limit: Duration) -> Holdings {
    let (leaders, mine) = ck.peers.with_order_or_static(job, |order, me| {
        let k = group_size(ck, order.len());
        let leaders: Vec<(usize, String)> = (0..order.len())
            .step_by(k)
            .map(|s| (s, order[s].clone()))
            .collect();
        (leaders, me.map(|p| p / k * k))
    });
    let groups = leaders.into_iter().map(|(start, leader)| {
        let (ck, job) = (ck.clone(), job.to_owned());
        tokio::spawn(async move {
            if mine == Some(start) {
                return group_here(&ck, &job, start, limit)
                    .await
                    .unwrap_or_default();
            }
            let ask = Ask {
                job: job.clone(),
                scope: Scope::Group { start },
                relayed: false,
                limit,
            };
            let why = match ck.peer(&leader) {
                Some(p) => match p.collect(&ask, limit.mul_f64(GROUP_WAIT)).await {
                    Ok(Answer::Group(h)) => return h,
                    Ok(Answer::Job(_)) => "answered another question".to_owned(),
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
            group_here(&ck, &job, start, limit)
                .await
                .unwrap_or_default()
        })
    });
    let groups: Vec<_> = groups.collect();
    let mut all = Holdings::default();
    for g in groups {
        match g.await {
            Ok(h) => all.merge(h),
            Err(e) => all.unreachable.push(format!("a group's collection: {e}")),
        }
    }
    all
}

/// What the hosts of the group starting at `start` of `job`'s order hold:
/// each listed within `limit` (this agent's own tier read here).
async fn group_here(
    ck: &Arc<Checkpoints>,
    job: &str,
    start: usize,
    limit: Duration,
) -> Result<Holdings, CollectError> {
    let members = ck.peers.with_order_or_static(job, |order, _| {
        if start >= order.len() {
            return Err(CollectError::NoSuchGroup {
                start,
                len: order.len(),
            });
        }
        let end = (start + group_size(ck, order.len())).min(order.len());
        Ok(order[start..end].to_vec())
    })?;
    let me = ck.peers.my_addr().to_owned();
    let lists = members.into_iter().map(|addr| {
        let (ck, job, me) = (ck.clone(), job.to_owned(), me.clone());
        tokio::spawn(async move {
            if addr == me {
                let (ck2, j) = (ck.clone(), job.clone());
                let local = tokio::task::spawn_blocking(move || ck2.tier.list(Some(&j)))
                    .await
                    .unwrap_or_default();
                return (addr, Ok((ck.host.clone(), local)));
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
    Ok(h)
}
