//! A job's checkpoint peers set by its launcher (`SetCheckpointPeers`):
//! one page taken ([`super::peer_pages`]), and on the last one the job's
//! place for this host checked, the connection budgets weighed and the
//! job's peer set replaced at once ([`super::peerset`]).
//!
//! Why here and not at the edge: which peers a host replicates to and
//! restores from is the checkpoint tier's decision; the gRPC handler only
//! decodes the request and maps [`SetPeersError`] to a status.

use std::collections::HashSet;

use warden_core::detect::straggler::StragglerConfig;

use super::Checkpoints;
use super::peer_pages::{PageError, Paged};
use super::peerset::{JobShape, OwnPlace, PeerSetError, PeerSpec};
use crate::config::ApiConfig;

/// One page of a job's peers, as its launcher sent it.
#[derive(Debug, Clone)]
pub struct PeersPage {
    /// The job.
    pub job: String,
    /// The list the page belongs to (a new list replaces a waiting one).
    pub list_id: u64,
    /// This page's index.
    pub page: u32,
    /// How many pages the list has (0 or 1: the whole list at once).
    pub pages: u32,
    /// The page's peers.
    pub peers: Vec<PeerSpec>,
    /// This host's place among the job's hosts, plus one (0: not said).
    pub self_place: u32,
    /// This host's address as the job's other hosts reach it (empty: not
    /// said).
    pub self_addr: String,
    /// How many hosts the job's order has, each peer then at its own
    /// place (0: not said, the list is the order).
    pub job_hosts: u32,
    /// The job's replica ring is its node-rank order.
    pub ring_by_place: bool,
    /// The most `checkpoint.replicas` among the job's agents (0: not said).
    pub replicas: u32,
}

/// The most hosts a launcher may say a job's order has: what a restore's
/// collection holds ([`super::holdings::MAX_HOSTS`]).
pub const MAX_JOB_HOSTS: u32 = 65_536;

/// What the connection budgets are weighed against.
#[derive(Debug, Clone, Copy)]
pub struct Budgets<'a> {
    /// `[api]`: the peer connections this agent accepts.
    pub api: &'a ApiConfig,
    /// `[straggler]`: the exchange's fan-out.
    pub straggler: &'a StragglerConfig,
    /// The strangers' connection cap the listener was built with.
    pub strangers: Option<usize>,
}

/// What a page made of the job's peers.
#[derive(Debug, PartialEq, Eq)]
pub enum SetPeers {
    /// More pages are to come; nothing changed yet.
    More,
    /// The job's peers are set.
    Set {
        /// The peers this host replicates its shards to.
        targets: Vec<String>,
        /// Connection budgets the job would pass, in words (each also
        /// logged); None: within them.
        warning: Option<String>,
    },
}

/// Why a page or a list was refused.
#[derive(Debug, thiserror::Error)]
pub enum SetPeersError {
    /// The page itself (its count, order, or the bytes waiting).
    #[error(transparent)]
    Page(#[from] PageError),
    /// `self_place` past the list: a launcher's bug, refused by name rather
    /// than taken as the end of the order.
    #[error(
        "self_place {self_place} is past the {peers} peers of job {job:?} (at most {}: this host's place plus one)",
        peers + 1
    )]
    PlacePastList {
        /// The place given.
        self_place: u32,
        /// The peers listed.
        peers: usize,
        /// The job.
        job: String,
    },
    /// `job_hosts` past [`MAX_JOB_HOSTS`].
    #[error(
        "job_hosts {job_hosts} of job {job:?} is past the {MAX_JOB_HOSTS} hosts an order may have"
    )]
    TooManyHosts {
        /// The count given.
        job_hosts: u32,
        /// The job.
        job: String,
    },
    /// `self_place` past the order the launcher said the job has.
    #[error(
        "self_place {self_place} is past job {job:?}'s order of {job_hosts} hosts (at most {job_hosts}: this host's place plus one)"
    )]
    PlacePastOrder {
        /// The place given.
        self_place: u32,
        /// The order's length given.
        job_hosts: u32,
        /// The job.
        job: String,
    },
    /// A peer or this host's address that cannot be used.
    #[error(transparent)]
    PeerSet(#[from] PeerSetError),
}

/// Takes `page`; on the list's last page sets the job's peers.
pub fn set(
    ck: &Checkpoints,
    budgets: Budgets<'_>,
    page: PeersPage,
) -> Result<SetPeers, SetPeersError> {
    let PeersPage {
        job,
        list_id,
        page,
        pages,
        peers,
        self_place,
        self_addr,
        job_hosts,
        ring_by_place,
        replicas,
    } = page;
    let specs = match ck.peer_pages.take(&job, list_id, page, pages, peers)? {
        Paged::Done(specs) => specs,
        Paged::More => return Ok(SetPeers::More),
    };
    if job_hosts > MAX_JOB_HOSTS {
        return Err(SetPeersError::TooManyHosts { job_hosts, job });
    }
    if job_hosts > 0 && self_place > job_hosts {
        return Err(SetPeersError::PlacePastOrder {
            self_place,
            job_hosts,
            job,
        });
    }
    // Within u32, and job_hosts within MAX_JOB_HOSTS: no overflow below.
    let hosts = job_hosts as usize;
    let own = match usize::try_from(self_place).unwrap_or(usize::MAX) {
        0 => None,
        p if hosts > 0 || p - 1 <= specs.len() => Some(OwnPlace {
            index: p - 1,
            addr: self_addr,
        }),
        _ => {
            return Err(SetPeersError::PlacePastList {
                self_place,
                peers: specs.len(),
                job,
            });
        }
    };
    // The job's other hosts: where the order's length is said, all of
    // them, listed here or not (a partial list is not the job's size).
    let others = if hosts > 0 {
        hosts - usize::from(own.is_some())
    } else {
        specs
            .iter()
            .map(|s| s.addr.as_str())
            .filter(|a| *a != ck.peers.my_addr())
            .collect::<HashSet<_>>()
            .len()
    };
    let warnings: Vec<String> = [
        crate::exchange::capacity::connections_short(
            budgets.api,
            budgets.straggler,
            budgets.strangers,
            others,
        ),
        super::fan_in::restore_connections_short(
            budgets.api,
            &ck.cfg,
            budgets.strangers,
            others,
            ck.cfg
                .replicas
                .max(usize::try_from(replicas).unwrap_or(usize::MAX)),
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    for w in &warnings {
        tracing::warn!(job = %job, "{w}");
    }
    let targets = ck.peers.set_job_partial(
        &job,
        &specs,
        own.as_ref(),
        JobShape {
            hosts,
            ring_by_place,
            replicas: usize::try_from(replicas).unwrap_or(usize::MAX),
        },
    )?;
    let warnings = match gaps(ck, budgets.straggler, &job) {
        Some(w) => {
            tracing::warn!(job = %job, "{w}");
            warnings.into_iter().chain([w]).collect()
        }
        None => warnings,
    };
    tracing::info!(job = %job, peers = specs.len(), targets = ?targets,
        "checkpoint peers of the job set by its launcher");
    Ok(SetPeers::Set {
        targets,
        warning: (!warnings.is_empty()).then(|| warnings.join("; and ")),
    })
}

/// What a partial order lacks of the places this agent needs, in words:
/// outside group 0 its own group and group 0, in group 0 every place, cut
/// with the exchange's group size and with the restore's collectors'
/// (`warden_core::detect::straggler::tree::needed`). A place not known is
/// passed over by a report, and named unreachable by a collection (so a
/// restore asks again, then aborts, rather than take what the others
/// hold for the job's): a launcher's short list weakens the exchange and
/// the restore without failing them, said, not refused.
fn gaps(ck: &Checkpoints, straggler: &StragglerConfig, job: &str) -> Option<String> {
    use warden_core::detect::straggler::tree;
    ck.peers.with_order(job, |order, me| {
        if order.is_whole() {
            return None;
        }
        let n = order.len();
        let cuts = [
            tree::fan_out(n, straggler.aggregator_fan_out),
            super::collect::group_size(ck, n),
        ];
        let mut missing: Vec<usize> = cuts
            .into_iter()
            .flat_map(|k| tree::needed(n, me, k))
            .filter(|p| order.get(*p).is_none())
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let first = *missing.first()?;
        Some(format!(
            "the launcher handed over {} of job {job:?}'s {n} places, without {} of those this host \
             needs (outside group 0, its group and group 0 of the straggler exchange and the \
             restore's collectors; in group 0, every place), the first at place {first}: reports \
             pass over them, and a collection names them unreachable",
            order.known(),
            missing.len(),
        ))
    })
}
